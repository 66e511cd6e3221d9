// Host interface of the fused KDA prefill forward (issue 18; design: docs/kda_sm90.md). Plain C++, no
// CUDA headers: the binding (kda_fwd_api.cpp) compiles with the host compiler alone.
//
// v1 ("v1 as built" in docs/kda_sm90.md): one CTA of 256 threads per (sequence n, value head hv,
// V block of block_v = 64 or 128 columns), chunks of 64 tokens in four 16-token blocks, the state S
// (128 x block_v fp32) in mma.sync accumulators across chunks. Per chunk: l2norm, beta sigmoid and the
// bounded sigmoid gate a = lb * sigmoid(exp(A_log) * (g + dt_bias)) fused; integer-anchored gate factors
// (1.3); Aqk and L on mma.sync m16n8k16 bf16; (I + L)^-1 in fp32 (blocked forward substitution, 1.4); the
// WY products V' = U - W S, O = Qg S + Aqk V', S = diag(gamma) S + Kd^T V' on mma.sync (1.5), or with
// Params::wgmma on SM90 warpgroup MMA (docs/kda_sm90.md "Steps 1 and 2 as built"). Params::pass selects the fused
// kernel or one of the two-kernel form's (a chunk-parallel prep writing records, then a state pass over whole
// sequences or the segments of the exact sequence split; docs/kda_sm90.md "Two kernels and the exact sequence split").
#pragma once

#include <cstdint>

namespace fla_cula {

struct KdaFwdParams {
  // inputs, token-major: element (token t, head x, channel d) at t * tok_stride + x * head_stride + d;
  // for fixed length the token index runs over the flattened [B*T]
  void const* q;        // bf16 [B,T,H,128]
  void const* k;        // bf16 [B,T,H,128]
  int64_t qk_tok_stride, qk_head_stride;
  void const* v;        // bf16 [B,T,HV,128]
  int64_t v_tok_stride, v_head_stride;
  void const* g;        // bf16 raw gate [B,T,HV,128]
  int64_t g_tok_stride, g_head_stride;
  void const* beta;     // raw beta [B,T,HV], bf16 or fp32 (head stride 1)
  bool beta_fp32;
  int64_t beta_tok_stride;
  void const* A_log;    // [HV] fp32 or bf16, or null (exp(A_log) := 1)
  bool A_log_fp32;
  void const* dt_bias;  // [HV*128] fp32 or bf16, or null (0)
  bool dt_bias_fp32;
  float const* h0;      // [N,HV,128,128] fp32 ([N,HV,V,K] with state_v_first), or null (zero start)
  bool state_v_first;   // h0 / ht layout
  // outputs
  void* o;              // bf16 [B,T,HV,128]
  int64_t o_tok_stride, o_head_stride;
  float* ht;            // [N,HV,128,128] in the h0 layout, or null
  void* Aqk;            // bf16 [B,T,HV,64] or null (grad extras; written by the V block 0 CTAs)
  void* Akk;            // bf16 [B,T,HV,64] or null
  int64_t extras_tok_stride;  // HV * 64
  void* q_hat;          // bf16 [B,T,H,128] (q's strides) or null: bf16(q rstd_q), FLA's l2norm_fwd output (grad extras
  void* k_hat;          //   with use_qk_l2norm; written by the CTAs of each q head's first value head, V block 0)
  float* q_rstd;        // fp32 [B,T,H]: rstd = 1 / sqrt(sum x^2 + 1e-6)
  float* k_rstd;
  void* h_inter;        // bf16 [B, NT, HV, 128, 128] in the h0 layout, or null: bf16(S) at every chunk start
                        // (return_intermediate_states); chunk c of sequence n is NT index n * NT + c (fixed length)
                        // or chunk_offsets[n] + c (varlen, B = 1)
  void const* chunk_offsets;  // [N+1] int32 / int64 (FLA's prepare_chunk_offsets), varlen with h_inter only
  bool chunk_offsets_int64;
  int NT;                 // h_inter's chunk dimension
  long long* phase_cycles;    // [N*HV*128/block_v, kKdaFwdPhases] int64 or null: per CTA, clock64 cycles of a phase
                              // summed over its chunks (thread 0's view, between CTA barriers)
  // problem
  int B, T, N, H, HV;
  float scale, lower_bound, beta_scale;  // beta_scale 1, or 2 with allow_neg_eigval
  int gate;  // GateForm: 0 bounded sigmoid (lower_bound), 1 softplus, 2 precomputed (1, 2: the prep pass only)
  bool use_qk_l2norm, use_beta_sigmoid;
  void const* cu_seqlens;  // [N+1] int32 or int64, or null (fixed length)
  bool cu_seqlens_int64;
  int block_v;  // V columns per CTA: 64 (N*HV*2 CTAs) or 128 (N*HV CTAs, the K-side prep done once per pair)
  bool wgmma;   // the state-side products of phases 6-8 (-W, V', O, S) on wgmma instead of mma.sync
  // ---- the two-kernel form (docs/kda_sm90.md "Two kernels and the exact sequence split"; pass != kFused needs wgmma)
  int pass;             // KdaPass: kFused (one kernel), kPrep (chunk-parallel prep, records out), kState (records in)
  void* rec;            // records [HV][rec_slots][kKdaRecBytes]: the chunk's wgmma operand tiles as shared-memory
                        // images; chunk c of sequence n is slot floor(bos_n / 64) + n + c (disjoint for every layout)
  int64_t rec_slots;    // slots per value head: >= B * T / 64 + N
  int chunks_per_cta;   // kPrep: chunks per CTA; kState: chunks per segment (0: the whole sequence, units = 1)
  int units;            // CTAs per (sequence, value head[, V block]) along the sequence: kPrep chunk blocks; kState
                        // this launch's segments (seg_lo .. P - 1, or segment 0 alone with seg_H_out), or with maps
                        // its 2 P - 3 - seg_lo segment ends and maps
  int segments;         // kState: P, the split's segments (1: whole sequences)
  int seg_lo;           // kState: the first segment this launch runs (state_rs only when > 0); maps: 1 when segment
                        // 0's end state comes from pass 2 of segment 0 (seg_H_out) instead of this pass
  bool maps;            // kState pass 1: no o; unit u < P - 1 - seg_lo writes segment s = seg_lo + u's end state from
                        // its start state (h0 for s = 0, else 0) to seg_H[s]; the next P - 2 units m write the
                        // transition map of segment m + 1 (v = 0 from the identity) to seg_M[m]. Without maps,
                        // segment s >= 1 starts from seg_H[s - 1] (the host's combine has made it the state at the
                        // segment's start)
  bool seg_H_out;       // kState pass 2 of segment 0 alone (state_rs, P > 1): its end state also to seg_H[0], the
                        // maps pass running beside it with seg_lo = 1
  float* seg_H;         // [P-1][N*HV][128][128] fp32, K-major (row = key channel)
  float* seg_M;         // [P-2][N*HV][128][128] fp32, K-major: S_end = M S_start + H
  bool state_rs;        // kState (no h_inter, no phase_cycles; maps at block_v 128): kda_state_rs_kernel, the state
                        // transposed in wgmma registers (kda_state_rs_kernel.cuh), instead of kda_state_kernel
  int* rec_ready;        // kRoles (the one-launch form): [HV][rec_slots] int32, zero at launch; the prep role sets a
                        // record's flag once it is stored, pass 2 waits for it before reading the record
  int device;   // CUDA ordinal of every tensor
  void* stream; // cudaStream_t of the caller on that device
};

// kKdaRoles: the two-kernel form's prep and pass 2 (whole sequences, state_rs, 64 columns) in one launch: the first
// 2 N * HV CTAs run pass 2, waiting on Params::rec_ready, the rest the prep (kda_roles_kernel.cuh)
enum KdaPass : int { kKdaFused = 0, kKdaPrep = 1, kKdaState = 2, kKdaRoles = 3 };
// One record: -(X diag b) in order akkb [64][64], -W [64][128], Qg [64][128] (group A, read by V' and Qg S), then
// Aqk [64][64], Kd [64][128] (token-major: the state update's MN-major operand) bf16 and gamma [128] fp32 (group B,
// read by Aqk V' and the state update); every tile in its 128-byte-swizzled wgmma layout (sw128 / sw128k in
// kda_fwd_kernel.cuh).
constexpr int kKdaRecGroupA = (64 * 64 + 2 * 64 * 128) * 2;
constexpr int kKdaRecBytes = kKdaRecGroupA + (64 * 64 + 128 * 64) * 2 + 128 * 4;

// The split's combine (kda_combine_kernel.cuh): seg_H [slots][pairs][128][128] and seg_M [slots - 1][pairs][128][128]
// fp32, K-major; in place, seg_H[s] += seg_M[s - 1] seg_H[s - 1] for s = 1 .. slots - 1 in order.
struct KdaCombineParams {
  float* seg_H;
  float const* seg_M;
  int slots;      // P - 1
  int64_t pairs;  // N * HV
  int device;
  void* stream;
};
void run_kda_combine(KdaCombineParams const& params);

// Enqueues the forward on params.stream; never synchronizes. std::invalid_argument for bad sizes,
// std::runtime_error for CUDA failures.
void run_kda_fwd(KdaFwdParams const& params);
// pass kKdaRoles (run_kda_fwd forwards it): kda_roles.cu
void run_kda_roles(KdaFwdParams const& params);
// The SMs this process may use on `device` (usable_sm_count: MPS execution affinity included), the count the
// one-launch form's bound takes; std::invalid_argument for an index that names no device. kda_roles.cu
int kda_usable_sms(int device);

// The compiled specializations, for fla_cula info / the SASS check: the symbol contains "kda_fwd_kernel"
// (demangled: kda_fwd_kernel<(GateForm)0, false, 64, true>; profile = true is taken only when phase_cycles is
// given), "kda_prep_kernel", "kda_state_kernel", "kda_state_rs_kernel" or "kda_roles_kernel" (pass kKdaRoles, in
// kda_roles.cu).
struct KdaFwdSpecialization {
  char const* gate;  // gate form
  bool profile;      // phase_cycles instrumentation compiled in
  int threads;
  int block_v;       // V columns per CTA
  bool wgmma;        // phases 6-8 on wgmma (Params::wgmma)
  int pass;          // KdaPass: the fused kernel, the prep kernel (block_v 0: no state), the state kernel or the
                     // roles kernel (block_v 64: its pass 2)
  int smem_bytes;    // dynamic shared memory per CTA
  bool state_rs;     // kda_state_rs_kernel (Params::state_rs)
  bool maps;         // kda_state_rs_kernel<true>: the split's maps pass (Params::maps)
  bool qk_hat;       // writes the grad extras q^, k^, rstd (Params::q_hat; the fused and prep kernels, untimed)
};
constexpr int kKdaFwdSpecializations = 32;

// Phases of a chunk timed by phase_cycles, in order: gate + block scan, scan offsets + anchors + rstd,
// anchored factors (+ block scalars), Aqk+L,
// state-side factors, inverse (+ X diag b and the grad extras), -W, V' and Qg S, Aqk V' + state update,
// the next chunk's v store and the wait for its copies.
constexpr int kKdaFwdPhases = 10;
extern KdaFwdSpecialization const kKdaFwdSpecialization[kKdaFwdSpecializations];

}  // namespace fla_cula
