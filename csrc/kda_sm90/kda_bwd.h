// Host interface of fla_cula's KDA backward kernels (issue 18, training path). Plain C++, no CUDA headers.
//
// kda_bwd_wy: the per-chunk gradient step of FLA 0.6.0's chunk_kda_bwd that follows the state pass backward
// (FLA's chunk_kda_bwd_kernel_wy_dqkg_fused, same inputs, outputs and rounding points; docs/kda_bwd_sm90.md).
// One CTA of 512 threads per (chunk, value head); every product on mma.sync m16n8k16 (bf16 in, fp32 out).
#pragma once

#include <cstdint>

namespace fla_cula {

// What every backward kernel's launch shares: the chunk list (one CTA per (chunk, value head); kda_bwd_chunk.cuh's
// chunk_span reads it) and the device and stream to launch on.
struct KdaBwdLaunch {
  int chunks;                 // B * ceil(T / 64), or the varlen chunk count (chunk_indices rows)
  void const* cu_seqlens;     // [N+1] int32 / int64 or null (fixed length)
  bool cu_seqlens_int64;
  void const* chunk_indices;  // [chunks, 2] (sequence, chunk) int32 / int64, with cu_seqlens (FLA's layout)
  bool chunk_indices_int64;
  int device;
  void* stream;
};

struct KdaBwdWyParams : KdaBwdLaunch {
  // token-major inputs, contiguous: element (token t, head x, channel d) at (t * heads + x) * width + d, the token
  // index running over the flattened [B*T]
  void const* q;       // bf16 [B,T,H,128] (l2-normalized when the forward normalized)
  void const* k;       // bf16 [B,T,H,128]
  void const* v;       // bf16 [B,T,HV,128]
  void const* v_new;   // bf16 [B,T,HV,128]  u - w h, from the forward recompute
  void const* dout;    // bf16 [B,T,HV,128]  do
  void const* dv;      // bf16 [B,T,HV,128]  dv after the state pass backward
  float const* g;      // fp32 [B,T,HV,128]  chunk-local cumsum of the gate, log2 units
  float const* beta;   // fp32 [B,T,HV]
  void const* A;       // bf16 [B,T,HV,64]   Akk: row t of its chunk, zero above the diagonal
  void const* h;       // bf16 [chunks, HV, 128, 128] chunk-start states, [V][K] with state_v_first else [K][V]
  void const* dh;      // bf16 [chunks, HV, 128, 128] same layout
  // outputs (rows past a sequence's end untouched)
  float* dq;           // fp32 [B,T,HV,128]
  float* dk;           // fp32 [B,T,HV,128]
  void* dv2;           // bf16 [B,T,HV,128]
  float* dg;           // fp32 [B,T,HV,128]
  float* db;           // fp32 [B,T,HV]
  float* dA;           // fp32 [B,T,HV,64] (unused with intra)
  bool intra;          // fuse FLA's chunk_kda_bwd_intra into this kernel, with its dAqk = scale M(do v_new^T) made here
                       // (the dAqk half of chunk_kda_bwd_dAv): dq, dk, dg, db then include its terms; dA not written
  float gate_shift;    // with intra: -lower_bound / ln 2 in (0, 16.6], or 0: no per-token bound (kda_bwd_intra's)
  float const* q_rstd;  // fp32 [B,T,H] or null; with intra and H == HV, non-null fuses FLA's l2norm_bwd of q and k:
  float const* k_rstd;  //   q, k are then the normalized y, and dqx, dkx receive rstd (dy - y (y . dy)) of the final
  void* dqx;            //   dq, dk in bf16 [B,T,H,128]; dq, dk keep only kda_bwd_wy's own terms (scratch)
  void* dkx;
  int B, T, H, HV;
  float scale;
  bool state_v_first;
};

void run_kda_bwd_wy(KdaBwdWyParams const& params);

// kda_bwd_dv: the dv half of FLA's chunk_kda_bwd_dAv, dv = M(Aqk)^T do per chunk and value head
// (kda_bwd_dv_kernel.cuh); its dAqk half is kda_bwd_wy's with intra.
struct KdaBwdDvParams : KdaBwdLaunch {
  void const* Aqk;   // bf16 [B,T,HV,64]: row t of its chunk, read on and below the diagonal only
  void const* dout;  // bf16 [B,T,HV,128] do
  void* dv;          // bf16 [B,T,HV,128] (rows past a sequence's end untouched)
  int B, T, HV;
};

void run_kda_bwd_dv(KdaBwdDvParams const& params);

// kda_bwd_intra: FLA's chunk_kda_bwd_intra, the gradients through the chunk-local Aqk and Akk added to the
// incoming dq, dk, db, dg (kda_bwd_intra_kernel.cuh). Block products on mma.sync (bf16x3); with a per-token gate
// bound (lower_bound) or without one (gate_shift 0: per-channel anchors, wide channels summed pairwise).
struct KdaBwdIntraParams : KdaBwdLaunch {
  void const* q;         // bf16 [B,T,H,128]
  void const* k;         // bf16 [B,T,H,128]
  float const* g;        // fp32 [B,T,HV,128] chunk-local cumsum, log2 units, per-token steps in [-gate_shift, 0]
  float const* beta;     // fp32 [B,T,HV]
  float const* dAqk;     // fp32 [B,T,HV,64]: zero above the diagonal
  float const* dAkk;     // fp32 [B,T,HV,64]: zero on and above the diagonal
  float const* dq;       // fp32 [B,T,HV,128] incoming (after kda_bwd_wy)
  float const* dk;
  float const* dg;
  float const* db;       // fp32 [B,T,HV]
  float* dq_out;         // fp32 [B,T,HV,128], may be dq (each entry read then written by one thread)
  float* dk_out;
  float* dg_out;
  float* db_out;         // fp32 [B,T,HV], may be db
  int B, T, H, HV;
  float gate_shift;      // -lower_bound / ln 2 in (0, 16.6], or 0: no per-token bound (steps <= 0 only)
};

void run_kda_bwd_intra(KdaBwdIntraParams const& params);

// kda_bwd_gate: FLA's chunk_local_cumsum(dg, reverse) and kda_gate_bwd (lower_bound or softplus form) in one pass
// (kda_bwd_gate_kernel.cuh): the gradient of the gate's input g_raw, and per-chunk partial sums of dA_log and
// dt_bias's gradient for the host to add over the chunks.
struct KdaBwdGateParams : KdaBwdLaunch {
  float const* dg;         // fp32 [B,T,HV,128]: the gradient w.r.t. the chunk-local cumsum g
  void const* g_raw;       // bf16 / fp32 [B,T,HV,128]: the gate's input
  bool g_raw_fp32;
  void const* A_log;       // fp32 / bf16 [HV] or null (A = 1)
  void const* dt_bias;     // fp32 / bf16 [HV*128] or null
  bool A_log_fp32, dt_bias_fp32;
  bool softplus;           // the softplus form a = -exp(A_log) softplus(g_raw + dt_bias) (A_log required)
  float lower_bound;       // < 0 (the lower_bound form a = lower_bound sigmoid(A (g_raw + dt_bias)))
  void* dg_raw;            // [B,T,HV,128] in g_raw's dtype
  float* dA_part;          // fp32 [chunks, HV], with A_log
  float* dbias_part;       // fp32 [chunks, HV*128], with dt_bias
  int B, T, HV;
};

void run_kda_bwd_gate(KdaBwdGateParams const& params);

}  // namespace fla_cula
