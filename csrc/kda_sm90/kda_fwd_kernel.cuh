// Device code of the fused KDA prefill forward, v1 (see kda_fwd.h and docs/kda_sm90.md "v1 as built").
//
// One CTA (8 warps) per (sequence n, value head hv, V block vb of kBV = 64 or 128 columns): every V column
// of S is an independent recurrence under the same K-side operators, so V blocks of a pair are exact parts
// (kBV = 64: two CTAs per pair, the K-side prep recomputed by both, twice the CTAs for small grids;
// kBV = 128: the prep once per pair and the whole 128 x 128 state in one CTA). Per chunk of 64 tokens
// (rows >= L of a tail: q = k = v = 0, a = 0, beta = 0, never stored), in phases separated by __syncthreads:
//   1 load     q, k, g rows (raw, bf16) and v^T of the V block to smem, beta (sigmoid) per row: for chunk
//              c + 1 issued during chunk c (cp.async for q, k after phase 5 and g after phase 7 into the
//              buffers those phases free; v and beta through registers), waited for at the chunk's end
//   2 prep     a: gate a = lb sigmoid(exp(A_log) (g + dt_bias)) in log2 units, thread = (channel pair, 16-row
//              block), scanned in registers; b: G = cumsum per channel (block offsets through smem), anchors
//              A_r = ceil(G_16r), B_s = floor(G_16(s+1)) (B_3 = floor(G_63)), gamma = exp2(G_63); q, k row rstd
//   3 factors  Qe = bf16(scale q^ exp2(G - A_r)), Ke = bf16(k^ exp2(G - A_r)), Kf = bf16(k^ exp2(B_r - G))
//   4 intra    per 16x16 block (r, s <= r): Aqk = (Qe_r 2^(A_r - B_s)) Kf_s^T, L = b (Ke_r 2^(A_r - B_s)) Kf_s^T
//              (the power of two per channel, tabulated in phase 3, applied exactly to the bf16 row operand)
//   5 state-side factors Qg = bf16(scale q^ exp2 G), Kg^T, Kd^T = bf16(k^ exp2(G_63 - G))^T;
//              inverse X = (I + L)^-1: diagonal 16-blocks by forward substitution, then block rows
//   6 -W = -(X diag b) Kg
//   7 V' = (X diag b) V + (-W) bf16(S);  O = Qg bf16(S)
//   8 O += Aqk V' (stored, rows < L); S = diag(gamma) S + Kd^T V' (accumulators); bf16(S)^T for chunk+1
//   9 v^T and beta of chunk + 1 from registers to smem; wait for its cp.async copies (q, k, g)
// The two-kernel form runs the same body in two kernels (kPass): kda_prep_kernel does 1-6 chunk-parallel (CTA = (n,
// hv, block of chunks); no state; PrepStorage, two CTAs per SM: G stays in registers and phase 3 forms every factor)
// and writes each chunk's phase-7/8 operand tiles to a record in global memory, most of them from registers;
// kda_state_kernel loads them (cp.async, two commit groups a chunk ahead) and does 7-8 over a sequence or one segment
// of it (the exact sequence split: Params::maps, seg_H, seg_M; docs/kda_sm90.md "Two kernels and the exact sequence
// split"). kda_state_rs_kernel.cuh runs the same state passes with the state transposed in wgmma registers
// (Params::state_rs).
// Every exponent formed is <= 0 except the block scalars 2^(A_r - B_s) <= 2^118 for lb >= -5
// (docs/kda_sm90.md 1.3): nothing overflows. Products are warp-level mma.sync m16n8k16 over smem tiles
// (warp_mma_tn); with kWgmma those of phases 6-8 are warpgroup MMAs (wg_mma_tn) over 128-byte-swizzled tiles.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

#include "kda_sm90/cp_async.cuh"
#include "kda_sm90/kda_fwd.h"
#ifndef FLA_CULA_KDA_HOST_EMULATION
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#else
#include <atomic>
#endif

namespace fla_cula::kda_sm90 {

using bf16 = __nv_bfloat16;

constexpr int kC = 64;          // chunk
constexpr int kBC = 16;         // sub-block
constexpr int kK = 128;         // key head dim
constexpr int kThreads = 256;
constexpr int kLdK = kK + 8;    // bf16 rows of 128 channels (+16 B: conflict-free fragment loads)
constexpr int kLdC = kC + 8;    // bf16 rows of 64 tokens / 64 columns
constexpr int kLdF = kC + 4;    // fp32 64 x 64 tiles
constexpr int kLdG = kK + 4;    // fp32 rows of 128 channels (+16 B: token-pair x channel-pair reads hit 32 banks)
constexpr int kPairs = 10;      // (r, s) sub-block pairs with s <= r, numbered r (r + 1) / 2 + s
constexpr float kLog2e = 1.4426950408889634f;

// Gate forms (per token and channel, natural log units; the kernel works in log2 units):
//   SigmoidLB    a = lb sigmoid(exp(A_log) (g + dt_bias)), -5 <= lb < 0: bounded, |a| <= 5
//   Softplus     a = -exp(A_log) softplus(g + dt_bias) (FLA's form without lower_bound): unbounded
//   Precomputed  a = g (the caller's log decay): unbounded
// Unbounded forms run in the prep kernel only (the two-kernel form); kWide below.
enum class GateForm { SigmoidLB, Softplus, Precomputed };
// A 16-row block's span A_r - B_r of a channel (its anchors, log2 units) at most this: every anchored factor and
// the diagonal block scalar 2^(A_r - B_r) stay in bf16's normal range. The bounded gate never exceeds it
// (16 x 5 log2(e) + 2 < 118); an unbounded gate's wider channels take the exact pairwise path (kWide).
constexpr int kSpanMax = 120;

// kBV: V columns per CTA (64: two CTAs per (sequence, value head), each recomputing the K-side prep;
// 128: one CTA does the prep once and carries the whole state). kWgmma: the operand tiles of phases 6-8 (marked
// sw128) in the 128-byte-swizzled K-major layout of the wgmma descriptors, 1024-byte aligned; otherwise padded rows.
template <int kBV, bool kWgmma = false>
struct SharedStorage {
  static constexpr int kSwAlign = kWgmma ? 1024 : 16;
  alignas(kSwAlign) bf16 sT[kBV][kLdK];      // bf16(S)^T [v column][k channel], B operand of W S and Qg S, sw128
  union {
    struct {
      bf16 q[kC][kLdK];                      // raw q rows (phases 1-5)
      bf16 k[kC][kLdK];
    } raw;
    alignas(16) float X[kC][kLdF];           // (I + L)^-1 (phase 5-): raw q/k dead after the phase-5 factors
  } u1;
  union alignas(kSwAlign) {
    alignas(16) float G[kC][kLdG];           // gate cumsum (phases 2-5)
    bf16 Wn[kC][kLdK];                       // -W (phase 6-7), sw128: G dead after phase 5
  } u2;
  alignas(kSwAlign) bf16 vT[kBV][kLdC];      // v^T of the V block [column][token], sw128
  union alignas(kSwAlign) {
    bf16 graw[kC][kLdK];                     // raw gate rows (phases 1-2)
    bf16 t1[kC][kLdK];                       // Qe (3-4), then Qg (5-7), sw128: graw dead after phase 2
  } u3;
  union alignas(kSwAlign) {
    bf16 Ke[kC][kLdK];                       // (3-4), sw128k
    bf16 KgT[kK][kLdC];                      // (5-6), sw128
  } t2;
  union alignas(kSwAlign) {
    bf16 Kf[kC][kLdK];                       // (3-4)
    bf16 KdT[kK][kLdC];                      // (5-8), sw128
  } t3;
  alignas(kSwAlign) bf16 aqk[kC][kLdC];      // Aqk, masked j <= i (4-8), sw128
  union alignas(kSwAlign) {
    float L[kC][kLdF];                       // beta_i k_i . k_j decayed, strict lower (4-5)
    bf16 vpT[kBV][kLdC];                     // bf16(V')^T [column][token] (7-8), sw128: L dead after phase 5
  } u4;
  alignas(16) float tmp[3][kBC][kBC];        // inverse block-row partial sums (rows of 4 x float4)
  alignas(kSwAlign) bf16 akkb[kC][kLdC];     // X diag(beta) (5-7), sw128
  float beta[kC];
  float rstd_q[kC];
  float rstd_k[kC];
  alignas(16) float gamma[kK];               // (a record's last tile)
  long long prof[kKdaFwdPhases];             // phase_cycles accumulators (thread 0)
  long long prof_mark;                       // clock64 at the last phase boundary (thread 0)
  float dtb[kK];                             // dt_bias of this value head (0 when absent)
  float expA;                                // exp(A_log[hv]) (1 when absent)
  int anc_a[4][kK];                          // A_r = ceil(G_16r)
  int anc_b[4][kK];                          // B_s = floor(G_16(s+1)), B_3 = floor(G_63)
  alignas(16) float blk[4][kK];              // per-channel gate sums of each 16-row block (cumsum offsets)
  alignas(16) uint32_t pw[kPairs][kK / 2];   // bf16 pairs 2^(A_r - B_s) of channels (d, d + 1), pair (r, s <= r)
};

// The prep kernel's layout (kda_prep_kernel; docs/kda_sm90.md "Lean prep"): no state tiles, no G tile (G stays in
// the registers of the phase-2 thread, which forms every factor in phase 3), and Qg, Kd, Aqk go to the record
// straight from registers (-W through Kf's storage, dead by then). Under 113 KB: two CTAs per SM. Tiles that die
// early share storage, as in SharedStorage.
struct PrepStorage {
  union alignas(1024) {
    bf16 Ke[kC][kK];                         // (3-4), sw128k
    bf16 KgT[kK][kC];                        // (5-6), sw128: the A operand of -W's wgmma
  } t2;
  alignas(1024) bf16 akkb[kC][kC];           // X diag(beta) (5b-6), sw128
  union alignas(1024) {
    bf16 graw[kC][kLdK];                     // raw gate rows (1-2)
    bf16 t1[kC][kK];                         // Qe (3-4), sw128k
    alignas(16) float X[kC][kLdF];           // (I + L)^-1 (5b): Qe dead after phase 4
  } u3;
  union alignas(1024) {
    struct {
      bf16 q[kC][kLdK];                      // raw q, k rows (1-3)
      bf16 k[kC][kLdK];
    } raw;
    alignas(16) float L[kC][kLdF];           // (4-5b): every factor is formed in phase 3
  } u1;
  struct {
    bf16 Kf[kC][kLdK];                       // (3-4)
  } t3;
  alignas(16) float tmp[3][kBC][kBC];
  float beta[kC];
  float rstd_q[kC];
  float rstd_k[kC];
  alignas(16) float gamma[kK];
  float g63[kK];                             // G_63 per channel (phase 3's Kd)
  long long prof[kKdaFwdPhases];
  long long prof_mark;
  float dtb[kK];
  float expA;
  int anc_a[4][kK];
  int anc_b[4][kK];
  alignas(16) float blk[4][kK];
  alignas(16) uint32_t pw[kPairs][kK / 2];
};

// The state kernel's layout (kda_state_kernel): the operand tiles of phases 7-8, every one live across the chunk, no
// prep scratch (wgmma images, dense). ~97 KB at kBV 64: two CTAs per SM; ~130 KB at 128.
template <int kBV>
struct StateStorage {
  alignas(1024) bf16 sT[kBV][kK];            // bf16(S)^T, sw128k
  alignas(1024) bf16 vT[kBV][kC];            // v^T, sw128
  alignas(1024) bf16 akkb[kC][kC];           // record group A: X diag(beta), -W, Qg
  struct {
    alignas(1024) bf16 Wn[kC][kK];
  } u2;
  struct {
    alignas(1024) bf16 t1[kC][kK];
  } u3;
  alignas(1024) bf16 aqk[kC][kC];            // record group B: Aqk, Kd, gamma
  struct {
    alignas(1024) bf16 Kd[kC][kK];           // token-major, sw128k: the MN-major A of Kd^T V'
  } t3;
  struct {
    alignas(1024) bf16 vpT[kBV][kC];         // bf16(V')^T
  } u4;
  alignas(16) float gamma[kK];
  long long prof[kKdaFwdPhases];
  long long prof_mark;
};

template <int kBV, bool kWgmma = false>
constexpr int kSmemBytes = int(sizeof(SharedStorage<kBV, kWgmma>));
template <int kBV>
constexpr int kStateSmemBytes = int(sizeof(StateStorage<kBV>));
static_assert(2 * (kStateSmemBytes<64> + 1024) <= 228 * 1024, "the state kernel at 64 columns: two CTAs per SM");
constexpr int kPrepSmemBytes = int(sizeof(PrepStorage));
static_assert(2 * (kPrepSmemBytes + 1024) <= 228 * 1024, "the prep must fit two CTAs per SM");
static_assert(kSmemBytes<128> <= 227 * 1024, "shared memory over the SM90 opt-in maximum");
static_assert(kSmemBytes<128, true> <= 227 * 1024, "shared memory over the SM90 opt-in maximum");

// Element offset of (r, c < 64) in a [rows][64] bf16 tile in wgmma's K-major 128-byte-swizzled layout (CuTe
// GMMA::Layout_K_SW128_Atom: 128 B rows, the 16-byte chunk index XORed with the row index mod 8; the tile starts
// 1024-byte aligned). Pairs (c, c + 1), c even, stay adjacent.
__device__ __forceinline__ int sw128(int r, int c) { return r * 64 + ((c & 63) ^ ((r & 7) << 3)); }
// the same for a [rows][128] tile: two such [rows][64] tiles side by side in K (CuTe's tile_to_shape order)
template <int Rows>
__device__ __forceinline__ int sw128k(int r, int c) { return (c >> 6) * Rows * 64 + sw128(r, c & 63); }

__device__ __forceinline__ uint32_t ld32(bf16 const* p) { return *reinterpret_cast<uint32_t const*>(p); }

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
#ifdef FLA_CULA_KDA_HOST_EMULATION  // a CPU emulation of the warp's MMA (debugging the kernel without a GPU)
  kda_emulated_mma(c, a0, a1, a2, a3, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// acc[nt] += A[0:16, 0:K] * B[8 nt : 8 nt + 8, 0:K]^T, both row-major in K (bf16 smem, leading dims in
// elements, K-pairs contiguous). C fragment: acc[nt][0..1] at (row g, col 8 nt + 2 t + {0,1}),
// acc[nt][2..3] at row g + 8 (g = lane / 4, t = lane % 4).
template <int NT, int K>
__device__ __forceinline__ void warp_mma_tn(float (&acc)[NT][4], bf16 const* A, int lda, bf16 const* B, int ldb,
                                            int lane) {
  int const g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    bf16 const* a = A + g * lda + k0 + 2 * t;
    uint32_t const a0 = ld32(a), a1 = ld32(a + 8 * lda), a2 = ld32(a + 8), a3 = ld32(a + 8 * lda + 8);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      bf16 const* b = B + (nt * 8 + g) * ldb + k0 + 2 * t;
      mma_bf16_16816(acc[nt], a0, a1, a2, a3, ld32(b), ld32(b + 8));
    }
  }
}

#ifndef FLA_CULA_KDA_HOST_EMULATION
namespace wg {
using Bf = cutlass::bfloat16_t;
template <int N>
using Mma = cute::conditional_t<
    N == 128, cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
    cute::conditional_t<N == 64, cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
                        cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>>>;

// the descriptor of the first 16-token block of a [rows][64] SW128 K-major tile (CuTe's canonical layout, as the
// wgmma operands expect); the block kb starts 32 kb bytes later (+2 kb in the descriptor's address units)
template <int Rows>
__device__ __forceinline__ cute::GmmaDescriptor desc(bf16 const* tile) {
  using namespace cute;
  auto layout = tile_to_shape(GMMA::Layout_K_SW128_Atom<Bf>{}, Shape<Int<Rows>, Int<64>>{});
  Tensor t = make_tensor(make_smem_ptr(reinterpret_cast<Bf const*>(tile)), layout);
  return GMMA::make_gmma_desc<GMMA::Major::K>(local_tile(t, Shape<Int<Rows>, _16>{}, make_coord(0, 0)));
}

// the descriptor of 16-column block kb of a K-major sw128 tile whose 64-column halves lie `rows` rows apart: 32 B per
// block inside a half (2 descriptor address units), rows x 128 B to the next half
__device__ __forceinline__ uint64_t kblock(cute::GmmaDescriptor d, int kb, int rows) {
  d.reg32_[0] += (kb >> 2) * rows * 8 + 2 * (kb & 3);
  return d.desc_;
}

template <int N, size_t... I>
__device__ __forceinline__ void fma(uint64_t da, uint64_t db, float* d, std::index_sequence<I...>) {
  Mma<N>::fma(da, db, d[I]..., cute::GMMA::ScaleOut::One);
}

// A MN-major, B K-major
template <int N>
using MmaMN = cute::conditional_t<
    N == 128, cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::MN, cute::GMMA::Major::K>,
    cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::GMMA::Major::MN, cute::GMMA::Major::K>>;
template <int N, size_t... I>
__device__ __forceinline__ void fma_mn(uint64_t da, uint64_t db, float* d, cute::GMMA::ScaleOut s,
                                       std::index_sequence<I...>) {
  MmaMN<N>::fma(da, db, d[I]..., s);
}
// the descriptor of the first 16-row block of a [64 k][64 m] MN-major SW128 tile (element (m, k) at sw128(k, m));
// block kb starts 16 rows x 128 B = 2048 B later (+128 in the descriptor's address units)
__device__ __forceinline__ cute::GmmaDescriptor desc_mn(bf16 const* tile) {
  using namespace cute;
  auto layout = tile_to_shape(GMMA::Layout_MN_SW128_Atom<Bf>{}, Shape<_64, _64>{});
  Tensor t = make_tensor(make_smem_ptr(reinterpret_cast<Bf const*>(tile)), layout);
  return GMMA::make_gmma_desc<GMMA::Major::MN>(local_tile(t, Shape<_64, _16>{}, make_coord(0, 0)));
}
__device__ __forceinline__ uint64_t mn_kblock(cute::GmmaDescriptor d, int kb) {
  d.reg32_[0] += 128 * kb;
  return d.desc_;
}
}  // namespace wg
#endif

// acc += A[0:64, 0:K] B[0:N, 0:K]^T on the warpgroup: K / 16 x wgmma m64nNk16, A and B K-major 128-byte-swizzled
// tiles in shared memory (sw128 for K = 64; sw128k for K = 128, whose second 64 columns start BRows (B) / 64 (A)
// rows after the first: B may be N rows inside a taller tile), written through the generic proxy before a
// fence.proxy.async and a barrier. Warp i of the warpgroup (wi) holds rows 16 wi .. 16 wi + 15; each 8-column
// block of its accumulator is laid out as an mma.sync m16n8 C fragment, so acc[nt] means what it means in
// warp_mma_tn. Returns with acc final.
template <int N, int K = kC, int BRows = N>
__device__ __forceinline__ void wg_mma_tn(float (&acc)[N / 8][4], bf16 const* A, bf16 const* B, int lane, int wi) {
  static_assert(K == 64 || K == 128, "K: one or two 64-column atoms");
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_wgmma<N, K, BRows>(acc, A, B, lane, wi);
#else
  static_assert(N == 32 || N == 64 || N == 128, "wgmma N");
  float* d = &acc[0][0];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(d[i]);
  cute::warpgroup_arrive();
  cute::GmmaDescriptor da = wg::desc<64>(A), db = wg::desc<N>(B);
#pragma unroll
  for (int kb = 0; kb < K / 16; ++kb) {
    wg::fma<N>(wg::kblock(da, kb, 64), wg::kblock(db, kb, BRows), d, std::make_index_sequence<N / 2>{});
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(d[i]);
#endif
  (void)lane;
  (void)wi;
}

// acc (accumulate ? += : =) A[0:64, 0:64] B[0:N, 0:64]^T on the warpgroup, A an MN-major [64 k][64 m] sw128 tile
// (element (m, k) at sw128(k, m)), B K-major as in wg_mma_tn. Issued only: the caller fences, commits and waits.
template <int N>
__device__ __forceinline__ void wg_mn_issue(float (&acc)[N / 8][4], bf16 const* A, bf16 const* B, bool accumulate) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_wgmma_mn<N>(acc, A, B, accumulate);
#else
  cute::GmmaDescriptor const da = wg::desc_mn(A), db = wg::desc<N>(B);
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    wg::fma_mn<N>(wg::mn_kblock(da, kb), wg::kblock(db, kb, N), &acc[0][0],
                  kb == 0 && !accumulate ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                  std::make_index_sequence<N / 2>{});
  }
#endif
}

// acc += A B^T as wg_mn_issue, fenced, committed and waited for: returns with acc final.
template <int N>
__device__ __forceinline__ void wg_mma_mn(float (&acc)[N / 8][4], bf16 const* A, bf16 const* B) {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  float* d = &acc[0][0];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(d[i]);
  cute::warpgroup_arrive();
#endif
  wg_mn_issue<N>(acc, A, B, true);
#ifndef FLA_CULA_KDA_HOST_EMULATION
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(d[i]);
#endif
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// 2^e for an integer e <= 127, as fp32 and as a bf16 bit pattern (bf16 has fp32's exponent range); 0 below the
// normal range: the product it scales is < 2^-126 there.
__device__ __forceinline__ float pow2i(int e) {
  e = e > 127 ? 127 : e;
  return e < -126 ? 0.f : __int_as_float((e + 127) << 23);
}
__device__ __forceinline__ uint32_t pow2i_bf16(int e) {
  e = e > 127 ? 127 : e;
  return e < -126 ? 0u : uint32_t(e + 127) << 7;
}

// bf16 pair times a bf16 pair of powers of two (one mul.rn.bf16x2): the exact product, rounded once, so the same
// bits as rounding the fp32 product.
__device__ __forceinline__ uint32_t scale_pair(uint32_t x, uint32_t s) {
  __nv_bfloat162 const r = __hmul2_rn(*reinterpret_cast<__nv_bfloat162 const*>(&x),
                                      *reinterpret_cast<__nv_bfloat162 const*>(&s));
  return *reinterpret_cast<uint32_t const*>(&r);
}

// The low / high bf16 of a packed pair as fp32 (exact: bf16 is the top half of an fp32).
__device__ __forceinline__ float bf16_lo(uint32_t x) { return __int_as_float(int(x << 16)); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __int_as_float(int(x & 0xffff0000u)); }

// One halving level (xor offset 2 M) of a warp reduction of 2 M values per lane: the lane keeps
// x[e + M] (offset bit set) or x[e] (clear) and adds the partner's copy of it, into x[e], e < M.
template <int M>
__device__ __forceinline__ void butterfly_halve(float (&x)[16], int lane) {
  bool const up = (lane & (2 * M)) != 0;
#pragma unroll
  for (int e = 0; e < M; ++e) {
    float const send = up ? x[e] : x[e + M];
    float const keep = up ? x[e + M] : x[e];
    x[e] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * M);
  }
}

// 2^x and 1/x on the MUFU unit (ex2/rcp.approx.ftz, <= 2 ulp). Subnormal results flush to 0: every 2^x
// formed here scales a product that is then below 2^-126 (docs/kda_sm90.md 1.3).
__device__ __forceinline__ float ex2(float x) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float rcp(float x) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  return 1.f / x;
#else
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// *a += v in shared memory, atomically (red.shared.add.f32)
__device__ __forceinline__ void red_add_shared(float* a, float v) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  std::atomic_ref<float>(*a).fetch_add(v, std::memory_order_relaxed);
#else
  atomicAdd(a, v);
#endif
}

// log2(x) on the MUFU unit (lg2.approx.ftz)
__device__ __forceinline__ float lg2(float x) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  return log2f(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float sigmoidf_(float z) { return rcp(1.f + ex2(-z * kLog2e)); }

__device__ __forceinline__ float load_param(void const* p, bool fp32, int64_t i) {
  return fp32 ? static_cast<float const*>(p)[i] : __bfloat162float(static_cast<bf16 const*>(p)[i]);
}

__device__ __forceinline__ void store_pair(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// (bf16(a), bf16(b)) packed, a in the low half
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&r);
}

// a packed bf16 pair to / from p (4-byte aligned, shared or global)
__device__ __forceinline__ void st_word(bf16* p, uint32_t w) { *reinterpret_cast<uint32_t*>(p) = w; }
__device__ __forceinline__ uint32_t ld_word(bf16 const* p) { return *reinterpret_cast<uint32_t const*>(p); }

// the low halves of x and y as a pair (x's low), and the high halves: channel pairs (d, d + 1) of tokens i and i + 1
// regrouped as token pairs (i, i + 1) of channels d and d + 1
__device__ __forceinline__ uint32_t lo_halves(uint32_t x, uint32_t y) { return (x & 0xffffu) | y << 16; }
__device__ __forceinline__ uint32_t hi_halves(uint32_t x, uint32_t y) { return x >> 16 | (y & 0xffff0000u); }

// stmatrix.sync.aligned.m8n8.x4.trans: the warp stores four 8x8 bf16 tiles transposed. Register i holds tile i as an
// m16n8 C fragment half (lane l: row l / 4, columns 2 (l % 4) and + 1); lane 8 i + j gives the address of stored row
// j of tile i, which receives the tile's column j (8 consecutive bf16, 16 bytes, 16-byte aligned).
__device__ __forceinline__ void stmatrix_x4_trans(bf16* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_stmatrix_trans(row, r0, r1, r2, r3);
#else
  unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(s), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
#endif
}

// ldmatrix.sync.aligned.m8n8.x4: the warp loads four 8x8 bf16 tiles. Lane 8 i + j gives the address of row j of
// tile i (8 consecutive bf16, 16-byte aligned); register i receives row l / 4, columns 2 (l % 4) and + 1 of tile i:
// with tiles (rows 0-7 | 8-15) x (k 0-7 | 8-15) an m16n8k16 A fragment, with (n 0-7, k 0-7 | 8-15) two B fragments.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], bf16 const* row) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_ldmatrix(r, row);
#else
  unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#endif
}

// ldmatrix.sync.aligned.m8n8.x4.trans: as ldmatrix_x4, each 8 x 8 tile transposed (register i of lane l: stored
// rows 2 (l % 4) and + 1 of tile i at column l / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], bf16 const* row) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  kda_emulated_ldmatrix_trans(r, row);
#else
  unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#endif
}

// This thread's shared-memory writes through the generic proxy (st.shared, stmatrix, cp.async) become visible to
// the async proxy (wgmma operand reads) after the next barrier.
__device__ __forceinline__ void fence_async_shared() {
#ifndef FLA_CULA_KDA_HOST_EMULATION
  cutlass::arch::fence_view_async_shared();
#endif
}

// Byte offsets of a record's tiles (kda_fwd.h kKdaRecBytes): group A = [kRecAkkb, kKdaRecGroupA), group B the rest.
constexpr int kRecAkkb = 0, kRecWn = kRecAkkb + kC * kC * 2, kRecQg = kRecWn + kC * kK * 2;
constexpr int kRecAqk = kRecQg + kC * kK * 2, kRecKd = kRecAqk + kC * kC * 2, kRecGamma = kRecKd + kC * kK * 2;
static_assert(kRecAqk == kKdaRecGroupA && kRecGamma + kK * 4 == kKdaRecBytes, "record layout");

// Record-ready flags (the roles kernel, Params::rec_ready, one int per record slot, zero at launch): a prep CTA's
// threads store chunk c's record, meet at a CTA barrier, then thread 0 releases its flag at GPU scope; pass 2's thread
// 0 acquires it and fences the generic proxy's view against the async proxy before its bulk copy reads the record.
__device__ __forceinline__ void rec_flag_release(int* f) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  *f = 1;
#else
  __threadfence();
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(f), "r"(1) : "memory");
#endif
}
// true once the flag is set (with the proxy fence then issued)
__device__ __forceinline__ bool rec_flag_acquire(int const* f) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  return *f != 0;
#else
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(f) : "memory");
  if (v != 0) asm volatile("fence.proxy.async.global;\n" ::: "memory");
  return v != 0;
#endif
}
// waits for the flag (the emulator runs every prep CTA first: an unset flag there is an error, not a wait)
__device__ __forceinline__ void rec_flag_wait(int const* f) {
#ifdef FLA_CULA_KDA_HOST_EMULATION
  if (!rec_flag_acquire(f)) kda_emulated_unset_flag();
#else
  while (!rec_flag_acquire(f)) __nanosleep(64);
#endif
}

// [bos, eos) of sequence n in the flattened token index (clamped: a malformed cu_seqlens never reads outside)
__device__ __forceinline__ void sequence_bounds(KdaFwdParams const& p, int n, int64_t& bos, int64_t& eos) {
  int64_t const total = int64_t(p.B) * p.T;
  if (p.cu_seqlens == nullptr) {
    bos = int64_t(n) * p.T;
    eos = bos + p.T;
  } else if (p.cu_seqlens_int64) {
    bos = static_cast<int64_t const*>(p.cu_seqlens)[n];
    eos = static_cast<int64_t const*>(p.cu_seqlens)[n + 1];
  } else {
    bos = static_cast<int32_t const*>(p.cu_seqlens)[n];
    eos = static_cast<int32_t const*>(p.cu_seqlens)[n + 1];
  }
  bos = bos < 0 ? 0 : (bos > total ? total : bos);
  eos = eos < bos ? bos : (eos > total ? total : eos);
}

// The chunks [c_lo, c_hi) of unit u (a prep block or a state segment) of cpc chunks each (cpc = 0: the whole
// sequence, c_lo = 0, c_hi = nchunks): the last unit last_u also takes whatever lies beyond, so every chunk has a CTA
// whatever the host's unit count. last_seg: the last unit that holds a chunk (0 for an empty sequence).
__device__ __forceinline__ void unit_chunks(int cpc, int u, int last_u, int nchunks, int& c_lo, int& c_hi,
                                            int& last_seg) {
  c_lo = 0;
  c_hi = nchunks;
  last_seg = 0;
  if (cpc > 0) {
    c_lo = u * cpc < nchunks ? u * cpc : nchunks;
    c_hi = u == last_u || nchunks - c_lo < cpc ? nchunks : c_lo + cpc;
    last_seg = nchunks > 0 ? (nchunks - 1) / cpc : 0;
    last_seg = last_seg < last_u ? last_seg : last_u;
  }
}

// The kernels' body (they follow it). kProfile: the phase_cycles instrumentation is compiled in (a separate
// instantiation, so the timed-off kernel keeps its registers and schedule). kPass: kKdaFused runs every phase of every
// chunk; kKdaPrep phases 1-6 (no state: chunk-parallel) and writes records; kKdaState reads them and runs 7-8.
// kQkHat: the grad extras q^, k^, rstd are written (Params::q_hat; a separate instantiation, so that the inference
// kernel's phase 3 keeps its schedule).
template <GateForm kGate, bool kProfile, int kBV, bool kWgmma, KdaPass kPass, bool kQkHat = false>
__device__ __forceinline__ void kda_fwd_body(KdaFwdParams const& p, int const bid) {
  static_assert(kBV == 64 || kBV == 128, "V columns per CTA: 64 or 128");
  static_assert(!kQkHat || kPass != kKdaState, "q^, k^ come from the prep or the fused pass");
  // kWide: an unbounded gate (a channel's span in a block may pass kSpanMax): the prep kernel only
  constexpr bool kWide = kGate != GateForm::SigmoidLB;
  static_assert(!kWide || (kPass == kKdaPrep && !kProfile), "unbounded gates: the untimed prep kernel only");
  constexpr int kVBlocks = kK / kBV;
  constexpr int kNS = kBV / 8;   // n-tiles of 8 columns of the state rows a warp owns
  constexpr int kNO = kBV / 16;  // n-tiles of the V' / O tile a warp owns (half of the columns)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using Fused = SharedStorage<kBV, kWgmma>;
  using Smem = std::conditional_t<kPass == kKdaPrep, PrepStorage,
                                  std::conditional_t<kPass == kKdaState, StateStorage<kBV>, Fused>>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
#ifndef FLA_CULA_KDA_HOST_EMULATION
  // the swizzle of the wgmma tiles is a function of the shared-memory address: a base off 1024 B would make every
  // product silently wrong, so stop instead (SM90 starts dynamic shared memory 1024-byte aligned)
  if constexpr (kWgmma) {
    if (cute::cast_smem_ptr_to_uint(smem_raw) & 1023u) __trap();
  }
#endif
  // the phase-8 operand tiles, element (row, token): padded rows, or (kWgmma) the wgmma layout. Tiles that
  // PrepStorage lacks are reached only under `if constexpr (kFusedTiles)` (the prep never calls their accessors).
  constexpr bool kFusedTiles = kPass != kKdaPrep;
  constexpr bool kPrepTiles = kPass != kKdaState;  // StateStorage has no prep scratch
  auto aqk_at = [&](int i, int j) -> bf16& {
    if constexpr (!kFusedTiles) __builtin_unreachable();
    else if constexpr (kWgmma) return (&sm.aqk[0][0])[sw128(i, j)]; else return sm.aqk[i][j];
  };
  auto kdT_at = [&](int d, int i) -> bf16& {  // the fused kernel's own (the record holds Kd token-major)
    if constexpr (kPass != kKdaFused) __builtin_unreachable();
    else if constexpr (kWgmma) return (&sm.t3.KdT[0][0])[sw128(d, i)]; else return sm.t3.KdT[d][i];
  };
  auto vpT_at = [&](int c, int i) -> bf16& {
    if constexpr (!kFusedTiles) __builtin_unreachable();
    else if constexpr (kWgmma) return (&sm.u4.vpT[0][0])[sw128(c, i)]; else return sm.u4.vpT[c][i];
  };
  // and those of phases 6-7
  auto akkb_at = [&](int i, int j) -> bf16& {
    if constexpr (kWgmma) return (&sm.akkb[0][0])[sw128(i, j)]; else return sm.akkb[i][j];
  };
  auto kgT_at = [&](int d, int i) -> bf16& {
    if constexpr (!kPrepTiles) __builtin_unreachable();
    else if constexpr (kWgmma) return (&sm.t2.KgT[0][0])[sw128(d, i)]; else return sm.t2.KgT[d][i];
  };
  auto ke_at = [&](int i, int d) -> bf16& {  // phase 4's A operand, laid out as t1 so both share one addressing
    if constexpr (!kPrepTiles) __builtin_unreachable();
    else if constexpr (kWgmma) return (&sm.t2.Ke[0][0])[sw128k<kC>(i, d)]; else return sm.t2.Ke[i][d];
  };
  auto t1_at = [&](int i, int d) -> bf16& {
    if constexpr (kWgmma) return (&sm.u3.t1[0][0])[sw128k<kC>(i, d)]; else return sm.u3.t1[i][d];
  };
  // kPrep: -W's sw128k image is staged in Kf's storage (Kf dies in phase 4; the next chunk writes it in phase 3),
  // so that it reaches the record in 16-byte pieces (write_record) rather than as 4-byte pairs from the accumulators
  auto wn_stage = [&]() -> bf16* {
    if constexpr (kPass != kKdaPrep) __builtin_unreachable();
    else {
      static_assert(sizeof(sm.t3.Kf) >= kC * kK * sizeof(bf16), "Kf's storage holds -W's image");
      return &sm.t3.Kf[0][0];
    }
  };
  auto wn_at = [&](int i, int d) -> bf16& {
    if constexpr (!kFusedTiles) __builtin_unreachable();
    else if constexpr (kWgmma) return (&sm.u2.Wn[0][0])[sw128k<kC>(i, d)]; else return sm.u2.Wn[i][d];
  };
  auto sT_at = [&](int c, int d) -> bf16& {
    if constexpr (!kFusedTiles) __builtin_unreachable();
    else if constexpr (kWgmma) return (&sm.sT[0][0])[sw128k<kBV>(c, d)]; else return sm.sT[c][d];
  };

  int const tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int const g8 = lane >> 2, t4 = lane & 3;

  // L and X of the inverse (PrepStorage keeps them where the raw rows and Qe were)
  auto L_at = [&](int i, int j) -> float& {
    if constexpr (!kPrepTiles) __builtin_unreachable();
    else if constexpr (kPass == kKdaPrep) return sm.u1.L[i][j]; else return sm.u4.L[i][j];
  };
  auto X_at = [&](int i, int j) -> float& {
    if constexpr (!kPrepTiles) __builtin_unreachable();
    else if constexpr (kPass == kKdaPrep) return sm.u3.X[i][j]; else return sm.u1.X[i][j];
  };
  // X's diagonal 16-blocks D_r live in L's diagonal blocks (phase 4 inverts them in place); the others in X
  auto Xd_at = [&](int i, int j) -> float& { return (i >> 4) == (j >> 4) ? L_at(i, j) : X_at(i, j); };
  // kWide: the wide channels' exact share of the diagonal blocks, corr(0, r, i, j) of Aqk_rr and corr(1, r, i, j) of
  // L_rr (before beta), in akkb's storage (8 KB: free from the chunk's start to phase 5b). Zeroed in phase 2, summed
  // in phase 3 (a butterfly per warp, then one shared-memory add per warp and entry), added to the diagonal products
  // in phase 4.
  auto corr = [&](int m, int r, int i, int j) -> float& {
    return reinterpret_cast<float*>(&sm.akkb[0][0])[((m * 4 + r) * kBC + i) * kBC + j];
  };
  // raw q, k of tokens i, i + 1 at channels d, d + 1 and the row scales scale * rstd_q, rstd_k (phases 3 and 5a)
  struct RawPair {
    float2 q0, q1, k0, k1;
    float sq0, sq1, sk0, sk1;
  };
  auto raw_pair = [&](int i, int d) -> RawPair {
    if constexpr (!kPrepTiles) {
      __builtin_unreachable();
    } else {
      auto ld = [&](bf16 const (&rows)[kC][kLdK], int t) {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&rows[t][d]));
      };
      return RawPair{ld(sm.u1.raw.q, i), ld(sm.u1.raw.q, i + 1), ld(sm.u1.raw.k, i), ld(sm.u1.raw.k, i + 1),
                     p.scale * sm.rstd_q[i], p.scale * sm.rstd_q[i + 1], sm.rstd_k[i], sm.rstd_k[i + 1]};
    }
  };

  // bf16(S)^T into sT: warp w's state rows d = 16 w .. 16 w + 15 become channels d of every column row c of sT. One
  // stmatrix.trans x4 per column pair (nt, nt + 1): tiles (nt, rows 0-7), (nt, rows 8-15), (nt + 1, ...); lane l
  // addresses column nt * 8 + l % 8 (+ 8 for tiles 2, 3) at channel 16 w (+ 8 for tiles 1, 3). 16-byte rows: the
  // channels of an 8-aligned group are contiguous in both sT layouts (padded rows; sw128k's 16-byte chunks).
  auto store_sT = [&](float const (&s)[kBV / 8][4]) {
    int const m = lane >> 3, j = lane & 7;
#pragma unroll
    for (int nt = 0; nt < kBV / 8; nt += 2) {
      stmatrix_x4_trans(&sT_at((nt + (m >> 1)) * 8 + j, warp * 16 + (m & 1) * 8), pack_bf16(s[nt][0], s[nt][1]),
                        pack_bf16(s[nt][2], s[nt][3]), pack_bf16(s[nt + 1][0], s[nt + 1][1]),
                        pack_bf16(s[nt + 1][2], s[nt + 1][3]));
    }
  };
  // ---- which CTA (bid): (n, hv[, unit][, vb]); vb fastest (the V blocks of a pair share its prep / records in L2)
  int vb = 0, hv, n, unit = 0;
  {
    int x = bid;
    if constexpr (kPass != kKdaPrep) {
      vb = x % kVBlocks;
      x /= kVBlocks;
    }
    hv = x % p.HV;
    x /= p.HV;
    if constexpr (kPass != kKdaFused) {
      unit = x % p.units;
      x /= p.units;
    }
    n = x;
  }
  int const h = hv / (p.HV / p.H);
  int const col0 = vb * kBV;
  // kState: the segment and whether this CTA carries a transition map (maps pass: units = 2 P - 3)
  int seg = unit;
  bool mmap = false;
  if constexpr (kPass == kKdaState) {
    if (p.maps && unit >= p.segments - 1) {  // seg_lo = 0 here (state_rs only otherwise)
      mmap = true;
      seg = unit - (p.segments - 1) + 1;
    }
  }
  bool const with_o = kPass == kKdaFused || (kPass == kKdaState && !p.maps);  // runtime only in kState
  bool const with_v = kPass == kKdaFused || (kPass == kKdaState && !mmap);

  int64_t bos, eos;
  sequence_bounds(p, n, bos, eos);
  int const nchunks = int((eos - bos + kC - 1) / kC);
  // the chunks of this CTA: [c_lo, c_hi), chunks_per_cta of them from unit u's start; the last unit (prep block or
  // pass-2 segment P - 1) also takes whatever lies beyond, so every chunk has a CTA whatever the host's units
  int c_lo = 0, c_hi = nchunks, last_seg = 0;
  if constexpr (kPass != kKdaFused) {
    unit_chunks(p.chunks_per_cta, kPass == kKdaPrep ? unit : seg, (kPass == kKdaState ? p.segments : p.units) - 1,
                nchunks, c_lo, c_hi, last_seg);
    // nothing to do: a prep block past the sequence's chunks, a pass-2 segment past them (segment 0 of an empty
    // sequence still writes ht = h0). A maps CTA always writes: an empty segment's map is (M, H) = (I, 0).
    // Uniform per CTA, before any barrier.
    if (kPass == kKdaPrep && c_lo >= c_hi) return;
    if (kPass == kKdaState && !p.maps && seg > last_seg) return;
  }
  int64_t const slot0 = bos / kC + n;  // record slot of this sequence's chunk 0 (kPrep, kState)
  auto record = [&](int c) -> unsigned char* {
    return static_cast<unsigned char*>(p.rec) + (int64_t(hv) * p.rec_slots + slot0 + c) * kKdaRecBytes;
  };

  bf16 const* qg = static_cast<bf16 const*>(p.q) + h * p.qk_head_stride;
  bf16 const* kg = static_cast<bf16 const*>(p.k) + h * p.qk_head_stride;
  bf16 const* vg = static_cast<bf16 const*>(p.v) + hv * p.v_head_stride + col0;
  bf16 const* gg = static_cast<bf16 const*>(p.g) + hv * p.g_head_stride;
  bf16* og = p.o != nullptr ? static_cast<bf16*>(p.o) + hv * p.o_head_stride + col0 : nullptr;
  bool const extras = kPass != kKdaState && p.Aqk != nullptr && vb == 0;
  // q^ = bf16(q rstd_q), k^ = bf16(k rstd_k) and the rstd (grad extras, FLA's l2norm_fwd outputs): one CTA per q head
  // and chunk writes them (GVA: value head hv % (HV / H) == 0; V block 0). Token i (< rows) of the chunk at tok0.
  bool const qk_out = kQkHat && vb == 0 && hv % (p.HV / p.H) == 0;
  auto store_qk_hat = [&](int i, int d, float2 q, float2 k, float rq, float rk, int rows, int64_t tok0) {
    if (i >= rows) return;
    int64_t const o = int64_t(h) * p.qk_head_stride + (tok0 + i) * p.qk_tok_stride + d;
    *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.q_hat) + o) = pack_bf16(q.x * rq, q.y * rq);
    *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.k_hat) + o) = pack_bf16(k.x * rk, k.y * rk);
  };

  // optional per-phase cycle counts (Params::phase_cycles): thread 0 reads clock64 after each phase's barrier
  // (the last mark lives in shared memory: no register stays live across the phases for it)
  bool const prof = kProfile && p.phase_cycles != nullptr;
  auto mark = [&](int phase) {
    if (prof && tid == 0) {
      long long const t = clock64();
      if (phase >= 0) sm.prof[phase] += t - sm.prof_mark;
      sm.prof_mark = t;
    }
  };
  if (tid < kKdaFwdPhases) sm.prof[tid] = 0;
  if constexpr (kPass == kKdaFused) {
    // aqk above the diagonal blocks (s > r) is zero in every chunk: written once (phase 4 skips those blocks)
    for (int e = tid; e < kC * kC; e += kThreads) {
      int const i = e >> 6, j = e & (kC - 1);
      if ((j >> 4) > (i >> 4)) aqk_at(i, j) = __float2bfloat16_rn(0.f);
    }
  }
  if constexpr (kPass != kKdaState) {
    // per-channel gate constants (read by phase 2a; first written here, before the first barrier)
    if (tid < kK) {
      sm.dtb[tid] = p.dt_bias != nullptr ? load_param(p.dt_bias, p.dt_bias_fp32, int64_t(hv) * kK + tid) : 0.f;
      if (tid == 0) sm.expA = p.A_log != nullptr ? expf(load_param(p.A_log, p.A_log_fp32, hv)) : 1.f;
    }
  }

  // ---- state: warp w owns rows d = 16 w .. 16 w + 15 of S (K x kBV), as kNS m16n8 accumulator tiles. Its start:
  //      h0 (or 0); kState: the identity (a map), 0 (a later segment's H), or the combined seg_H of the segment before
  float S[kNS][4];
  int64_t const state_base = (int64_t(n) * p.HV + hv) * kK * 128;
  auto state_index = [&](int d, int c) -> int64_t {
    return state_base + (p.state_v_first ? int64_t(col0 + c) * kK + d : int64_t(d) * 128 + col0 + c);
  };
  // element (d, col0 + c) of segment slot s of seg_H / seg_M (K-major)
  auto seg_index = [&](int s, int d, int c) -> int64_t {
    return ((int64_t(s) * p.N + n) * p.HV + hv) * kK * 128 + int64_t(d) * 128 + col0 + c;
  };
  // return_intermediate_states: bf16(S) of chunk c's start to h_inter (the h0 layout; bf16 pairs along V are
  // adjacent K-major, 2-byte stores V-first)
  auto store_h = [&](int c) {
    int64_t t = int64_t(n) * p.NT + c;
    if (p.cu_seqlens != nullptr) {
      t = c + (p.chunk_offsets_int64 ? static_cast<int64_t const*>(p.chunk_offsets)[n]
                                     : static_cast<int32_t const*>(p.chunk_offsets)[n]);
    }
    bf16* const hb = static_cast<bf16*>(p.h_inter) + (t * p.HV + hv) * kK * 128;
    int const d0 = warp * 16 + g8;
#pragma unroll
    for (int nt = 0; nt < kNS; ++nt) {
      int const c0 = col0 + nt * 8 + 2 * t4;
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        int const d = d0 + (e >> 1) * 8;
        if (p.state_v_first) {
          hb[int64_t(c0) * kK + d] = __float2bfloat16_rn(S[nt][e]);
          hb[int64_t(c0 + 1) * kK + d] = __float2bfloat16_rn(S[nt][e + 1]);
        } else {
          *reinterpret_cast<uint32_t*>(hb + int64_t(d) * 128 + c0) = pack_bf16(S[nt][e], S[nt][e + 1]);
        }
      }
    }
  };
  if constexpr (kPass != kKdaPrep) {
    // elements (d, c) and (d, c + 1) of a thread's tile: adjacent in K-major states (seg_H: one 8-byte load); h0 is
    // read only where it is the start (its V-first rows are contiguous in d across the warp)
    int const d0 = warp * 16 + g8;
    bool const from_h0 = p.h0 != nullptr && (kPass != kKdaState || (!mmap && seg == 0));
#pragma unroll
    for (int nt = 0; nt < kNS; ++nt) {
      int const c = nt * 8 + 2 * t4;
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        int const d = d0 + (e >> 1) * 8;
        float2 s0 = make_float2(0.f, 0.f);
        if (from_h0) {
          s0 = make_float2(p.h0[state_index(d, c)], p.h0[state_index(d, c + 1)]);
        } else if constexpr (kPass == kKdaState) {
          if (mmap) {
            s0 = make_float2(d == col0 + c ? 1.f : 0.f, d == col0 + c + 1 ? 1.f : 0.f);
          } else if (seg > 0 && !p.maps) {
            s0 = *reinterpret_cast<float2 const*>(&p.seg_H[seg_index(seg - 1, d, c)]);
          }
        }
        S[nt][e] = s0.x;
        S[nt][e + 1] = s0.y;
      }
    }
    store_sT(S);
  }
  __syncthreads();

  auto chunk_rows = [&](int c) -> int {
    int64_t const left = eos - (bos + int64_t(c) * kC);
    return int(left < kC ? left : kC);
  };
  // Loads of chunk c (rows >= its length zero): q, k rows -> u1.raw and g rows -> u3.graw by cp.async
  // (waited for at the barrier that ends the previous chunk); v and raw beta through registers (vv, bv), stored to
  // vT / beta by store_vb (beta's sigmoid there, so that no warp waits for the load where it is issued). kPrep
  // reads no v, kState no q, k, g, beta (its records hold what they give).
  // rows of chunk c (128 channels, 16-byte copies) from src (token stride ld) to dst, and to dst2 from src2 when given
  auto issue_rows = [&](int c, bf16 (&dst)[kC][kLdK], bf16 const* src, bf16 (*dst2)[kLdK], bf16 const* src2,
                        int64_t ld) {
    // a thread's pieces: rows i0 + 16 u (u < 4) at columns c8; one row offset, stepped by 16 rows. The loop stays
    // rolled so that its copies spread between the neighbouring work (unrolled, they issue back to back)
    static_assert(kC * (kK / 8) == 4 * kThreads && kK / 8 == 16, "four 16-byte pieces per thread");
    int const rw = chunk_rows(c), i0 = tid >> 4, c8 = (tid & 15) * 8;
    int64_t off = (bos + int64_t(c) * kC + i0) * ld + c8;
    int64_t const step = int64_t(kThreads / 16) * ld;
#pragma unroll 1
    for (int i = i0; i < kC; i += kThreads / 16, off += step) {
      bool const in = i < rw;
      cp_async16(&dst[i][c8], src + (in ? off : 0), in);
      if (dst2 != nullptr) cp_async16(&dst2[i][c8], src2 + (in ? off : 0), in);
    }
  };
  auto issue_qk = [&](int c) {
    if constexpr (kPrepTiles) issue_rows(c, sm.u1.raw.q, qg, sm.u1.raw.k, kg, p.qk_tok_stride);
  };
  auto issue_g = [&](int c) {
    if constexpr (kPrepTiles) issue_rows(c, sm.u3.graw, gg, nullptr, nullptr, p.g_tok_stride);
  };
  constexpr int kVLoads = kC * (kBV / 8) / kThreads;  // 16-byte v loads per thread and chunk
  uint4 vv[kVLoads];
  float bv = 0.f;
  bool bvin = false;  // bv holds a row's raw beta (not a row past the chunk's end: 0)
  // 16-byte load u of a thread: token i, columns c8 .. c8 + 7 (a warp's load covers whole v rows). kWgmma: loads
  // u and u + 1 (u even) are tokens i and i + 1 of the same columns, so store_vb writes token pairs (4 bytes)
  auto v_slot = [&](int u, int& i, int& c8) {
    if constexpr (kWgmma) {
      int const pidx = tid + (u >> 1) * kThreads;
      i = 2 * (pidx / (kBV / 8)) + (u & 1);
      c8 = (pidx % (kBV / 8)) * 8;
    } else {
      int const idx = tid + u * kThreads;
      i = idx / (kBV / 8);
      c8 = (idx % (kBV / 8)) * 8;
    }
  };
  auto load_vb = [&](int c) {
    int64_t const t0 = bos + int64_t(c) * kC;
    int const rw = chunk_rows(c);
    if constexpr (kPass != kKdaPrep) {
#pragma unroll
      for (int u = 0; u < kVLoads; ++u) {
        int i, c8;
        v_slot(u, i, c8);
        vv[u] = make_uint4(0, 0, 0, 0);
        if (i < rw && with_v) vv[u] = *reinterpret_cast<uint4 const*>(vg + (t0 + i) * p.v_tok_stride + c8);
      }
    }
    if constexpr (kPass != kKdaState) {
      bvin = tid < rw;
      bv = bvin ? load_param(p.beta, p.beta_fp32, (t0 + tid) * p.beta_tok_stride + hv) : 0.f;
    }
  };
  auto store_vb = [&]() {
    if constexpr (kPass == kKdaPrep) {
    } else if constexpr (kWgmma) {
      // row c8 + j of the sw128 tile has phase j: the pair (i, i + 1) of column c8 + j lands at i ^ 8 j. Lanes of
      // one token pair hold 8-column groups whose rows are 1 KB apart (one bank set), so lane l writes column
      // c8 + ((s + l) mod 8) at step s: the phases differ and the 8 lanes hit 8 bank quads (2-way at kBV 128,
      // where 16 lanes share a token pair; none at 64). The pairs are rotated by l mod 8 in registers (3 stages
      // of selects) so that step s reads a fixed register.
      int const rot = lane & 7;
#pragma unroll
      for (int u = 0; u < kVLoads; u += 2) {
        int i, c8;
        v_slot(u, i, c8);
        uint32_t const* w0 = reinterpret_cast<uint32_t const*>(&vv[u]);
        uint32_t const* w1 = reinterpret_cast<uint32_t const*>(&vv[u + 1]);
        uint32_t pr[8];  // pr[j] = (token i, token i + 1) of column c8 + j
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // the j-th bf16 of each load (one PRMT)
          uint32_t const a = w0[j >> 1], b = w1[j >> 1];
          pr[j] = (j & 1) ? (a >> 16) | (b & 0xffff0000u) : (a & 0xffffu) | (b << 16);
        }
#pragma unroll
        for (int b = 1; b < 8; b <<= 1) {  // pr[s] <- pr[(s + rot) mod 8]
          bool const take = (rot & b) != 0;
          uint32_t t[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) t[j] = take ? pr[(j + b) & 7] : pr[j];
#pragma unroll
          for (int j = 0; j < 8; ++j) pr[j] = t[j];
        }
        bf16* const rows = &sm.vT[0][0] + c8 * kC;
#pragma unroll
        for (int st = 0; st < 8; ++st) {
          int const j = (st + rot) & 7;
          *reinterpret_cast<uint32_t*>(rows + j * kC + (i ^ (j << 3))) = pr[st];
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < kVLoads; ++u) {
        int i, c8;
        v_slot(u, i, c8);
        bf16 const* e = reinterpret_cast<bf16 const*>(&vv[u]);
#pragma unroll
        for (int j = 0; j < 8; ++j) sm.vT[c8 + j][i] = e[j];
      }
    }
    if constexpr (kPass != kKdaState) {
      if (tid < kC) sm.beta[tid] = bvin && p.use_beta_sigmoid ? p.beta_scale * sigmoidf_(bv) : bv;
    }
  };

  // ---- records (kPrep writes them, kState reads them): byte b of a record lives in the shared-memory tile at
  //      kRec* <= b (the wgmma images are dense at the start of their arrays); 16-byte pieces
  auto rec_smem = [&](int b) -> unsigned char* {  // kState
    static_assert(kPass == kKdaFused || kWgmma, "records are the wgmma tile images");
    if constexpr (!kFusedTiles) {
      __builtin_unreachable();
    } else {
      if (b < kRecWn) return reinterpret_cast<unsigned char*>(&sm.akkb[0][0]) + b;
      if (b < kRecQg) return reinterpret_cast<unsigned char*>(&sm.u2.Wn[0][0]) + (b - kRecWn);
      if (b < kRecAqk) return reinterpret_cast<unsigned char*>(&sm.u3.t1[0][0]) + (b - kRecQg);
      if (b < kRecKd) return reinterpret_cast<unsigned char*>(&sm.aqk[0][0]) + (b - kRecAqk);
      if (b < kRecGamma) return reinterpret_cast<unsigned char*>(&sm.t3) + (b - kRecKd);
      return reinterpret_cast<unsigned char*>(&sm.gamma[0]) + (b - kRecGamma);
    }
  };
  // kPrep: akkb, -W (staged) and gamma from shared memory in 16-byte pieces (Qg, Kd, Aqk went from registers)
  auto write_record = [&](int c) {
    unsigned char* const dst = record(c);
    constexpr int kAkkb = (kRecWn - kRecAkkb) / 16, kWn = (kRecQg - kRecWn) / 16;
    constexpr int kPieces = kAkkb + kWn + (kKdaRecBytes - kRecGamma) / 16;
    for (int j = tid; j < kPieces; j += kThreads) {
      int const b = j < kAkkb + kWn ? kRecAkkb + 16 * j : kRecGamma + 16 * (j - kAkkb - kWn);
      unsigned char const* const src =
          j < kAkkb        ? reinterpret_cast<unsigned char const*>(&sm.akkb[0][0]) + b
          : j < kAkkb + kWn ? reinterpret_cast<unsigned char const*>(wn_stage()) + (b - kRecWn)
                            : reinterpret_cast<unsigned char const*>(&sm.gamma[0]) + (b - kRecGamma);
      *reinterpret_cast<uint4*>(dst + b) = *reinterpret_cast<uint4 const*>(src);
    }
  };
  // bytes [b0, b1) of chunk c's record by cp.async, one commit group. Group A (phase 7's operands): akkb, -W and,
  // with o, Qg; group B (phase 8's): with o, Aqk; Kd, gamma
  int const rec_a_end = with_o ? kKdaRecGroupA : kRecQg, rec_b_begin = with_o ? kRecAqk : kRecKd;
  auto issue_record = [&](int c, int b0, int b1) {
    unsigned char const* const src = record(c);
    for (int b = b0 + 16 * tid; b < b1; b += 16 * kThreads) cp_async16(rec_smem(b), src + b, true);
    cp_async_commit();
  };

  if constexpr (kPass == kKdaState) {
    if (c_lo < c_hi) {  // chunk c_lo: both record groups in flight (waited for in the loop), v stored now
      issue_record(c_lo, 0, rec_a_end);
      issue_record(c_lo, rec_b_begin, kKdaRecBytes);
      load_vb(c_lo);
      store_vb();
    }
  } else if (c_lo < c_hi) {  // chunk c_lo: everything now
    issue_qk(c_lo);
    issue_g(c_lo);
    load_vb(c_lo);
    store_vb();
    cp_async_wait_all();
  }
  __syncthreads();

  // ---- 7: V' = (X diag b) V - W bf16(S) ; O = Qg bf16(S). 64 x kBV, warp = (row tile, kBV/2 columns): row tile
  //      w/2 and column half w%2, or (kWgmma) row tile w%4 and column half w/4, as a warpgroup MMA holds them.
  //      kState: no (X diag b) V for a map (v = 0), no O in the maps pass
  int const mt = kWgmma ? (warp & 3) : (warp >> 1), nb = (kWgmma ? (warp >> 2) : (warp & 1)) * (kBV / 2);
  auto phase7 = [&](float (&o_acc)[kNO][4]) {
    if constexpr (kFusedTiles) {
      {
        float vp[kNO][4];
        zero(vp);
        if constexpr (kWgmma) {
          if (with_v) wg_mma_tn<kBV / 2>(vp, &sm.akkb[0][0], &sm.vT[0][0] + nb * kC, lane, warp & 3);
          wg_mma_tn<kBV / 2, kK, kBV>(vp, &sm.u2.Wn[0][0], &sm.sT[0][0] + nb * kC, lane, warp & 3);
        } else {
          warp_mma_tn<kNO, kC>(vp, &sm.akkb[16 * mt][0], kLdC, &sm.vT[nb][0], kLdC, lane);
          warp_mma_tn<kNO, kK>(vp, &sm.u2.Wn[16 * mt][0], kLdK, &sm.sT[nb][0], kLdK, lane);
        }
#pragma unroll
        for (int nt = 0; nt < kNO; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            int const i = 16 * mt + g8 + (e >> 1) * 8, c = nb + nt * 8 + 2 * t4 + (e & 1);
            vpT_at(c, i) = __float2bfloat16_rn(vp[nt][e]);
          }
        }
      }
      zero(o_acc);  // after V' is stored: its accumulators and O's are not live at once
      if (with_o) {
        if constexpr (kWgmma) {
          wg_mma_tn<kBV / 2, kK, kBV>(o_acc, &sm.u3.t1[0][0], &sm.sT[0][0] + nb * kC, lane, warp & 3);
        } else {
          warp_mma_tn<kNO, kK>(o_acc, &sm.u3.t1[16 * mt][0], kLdK, &sm.sT[nb][0], kLdK, lane);
        }
      }
    }
  };

  // ---- 8: O += Aqk V' (store rows < `rows`); S = diag(gamma) S + Kd^T V'; bf16(S)^T for the next chunk.
  //      kWgmma: each warpgroup multiplies its 64 x kBV/2 block of O and its 64 state rows on wgmma (as in 6-7)
  auto phase8 = [&](float (&o_acc)[kNO][4], int64_t tok0, int rows) {
    if constexpr (kFusedTiles) {
      if (with_o) {
        if constexpr (kWgmma) {
          wg_mma_tn<kBV / 2>(o_acc, &sm.aqk[0][0], &sm.u4.vpT[0][0] + nb * kC, lane, warp & 3);
        } else {
          warp_mma_tn<kNO, kC>(o_acc, &sm.aqk[16 * mt][0], kLdC, &sm.u4.vpT[nb][0], kLdC, lane);
        }
#pragma unroll
        for (int nt = 0; nt < kNO; ++nt) {
          int const i = 16 * mt + g8, c = nb + nt * 8 + 2 * t4;
          if (i < rows) store_pair(og + (tok0 + i) * p.o_tok_stride + c, o_acc[nt][0], o_acc[nt][1]);
          if (i + 8 < rows) store_pair(og + (tok0 + i + 8) * p.o_tok_stride + c, o_acc[nt][2], o_acc[nt][3]);
        }
      }
      int const d0 = warp * 16 + g8;
      float const gm0 = sm.gamma[d0], gm1 = sm.gamma[d0 + 8];
#pragma unroll
      for (int nt = 0; nt < kNS; ++nt) {
        S[nt][0] *= gm0;
        S[nt][1] *= gm0;
        S[nt][2] *= gm1;
        S[nt][3] *= gm1;
      }
      if constexpr (kPass == kKdaState) {  // Kd from the record, token-major: warpgroup j's 64 channels are atom j
        wg_mma_mn<kBV>(S, &sm.t3.Kd[0][0] + (warp >> 2) * kC * 64, &sm.u4.vpT[0][0]);
      } else if constexpr (kWgmma) {
        wg_mma_tn<kBV>(S, &sm.t3.KdT[0][0] + (warp >> 2) * 64 * kC, &sm.u4.vpT[0][0], lane, warp & 3);
      } else {
        warp_mma_tn<kNS, kC>(S, &sm.t3.KdT[warp * 16][0], kLdC, &sm.u4.vpT[0][0], kLdC, lane);
      }
      store_sT(S);
    }
  };

  mark(-1);
  if constexpr (kPass == kKdaState) {
    // Records in: chunk c's group A is waited for before phase 7 and its group B before phase 8; chunk c + 1's
    // group A is issued after phase 7 (its tiles were last read there) and its group B after phase 8.
    for (int chunk = c_lo; chunk < c_hi; ++chunk) {
      int64_t const tok0 = bos + int64_t(chunk) * kC;
      int const rows = chunk_rows(chunk);
      bool const prefetch = chunk + 1 < c_hi;
      if (with_o && p.h_inter != nullptr) store_h(chunk);
      cp_async_wait_group<1>();  // group A of this chunk (its group B may still be in flight)
      // the copied tiles and (from the previous chunk / the prologue) sT, vT become visible to wgmma
      fence_async_shared();
      __syncthreads();
      mark(9);  // the timer build: waits for records in phase 9, the products in 7 and 8
      float o_acc[kNO][4];
      phase7(o_acc);
      if constexpr (kProfile) __syncthreads();
      mark(7);
      cp_async_wait_group<0>();  // group B
      fence_async_shared();      // ... and V'^T
      __syncthreads();
      mark(9);
      if (prefetch) {
        issue_record(chunk + 1, 0, rec_a_end);
        load_vb(chunk + 1);
      }
      phase8(o_acc, tok0, rows);
      if (prefetch) store_vb();  // vT last read in phase 7 (barrier between)
      __syncthreads();
      mark(8);
      if (prefetch) issue_record(chunk + 1, rec_b_begin, kKdaRecBytes);
    }
  } else {
    // ---- chunk loop (fused, prep): phases 2-6 (kPrep: then the record), or 2-8 (fused), per chunk
    for (int chunk = c_lo; chunk < c_hi; ++chunk) {
      int64_t const tok0 = bos + int64_t(chunk) * kC;
      int const rows = chunk_rows(chunk);
      bool const prefetch = chunk + 1 < c_hi;
      if (kPass == kKdaFused && p.h_inter != nullptr) store_h(chunk);  // (kPrep has no state)

      // ---- 2: gate a = lb sigmoid(exp(A_log) (g + dt_bias)) in log2 units and its chunk cumsum G. Thread =
      //      (channel pair d, d + 1; row block r = tid / 64): its 16 x 2 gates in registers (independent: the
      //      sigmoids pipeline), scanned locally; the block totals go through smem and each block adds the sum of
      //      the blocks before it (left to right, so G_{16r - 1} and the offset of block r are the same fp32 sum
      //      and G stays non-increasing across blocks). Rows >= `rows` get a = 0 (G frozen past the end).
      float2 Gr[kBC];
      if constexpr (kWide) {
        static_assert(sizeof(sm.akkb) == 2 * 4 * kBC * kBC * sizeof(float), "corr fills akkb's storage");
#pragma unroll
        for (int e = 0; e < 2; ++e) reinterpret_cast<float4*>(&corr(0, 0, 0, 0))[tid + e * kThreads] = float4{};
      }
      {
        int const r = tid >> 6, d = 2 * (tid & 63);
        // sigmoid(z) = 1 / (1 + 2^(c g + c b)) with c = -exp(A_log) log2(e): one fma per gate. Softplus in log2
        // units: -exp(A_log) log2(1 + 2^z2), z2 = (g + b) log2(e) (z2 itself from 15 on, as FLA's softplus2). An
        // unbounded gate is floored at -2^24 (a decay of 2^-2^24: zero in every float format), so that |G| <= 2^30
        // and the integer anchors hold it
        float const lbl = p.lower_bound * kLog2e, c = -sm.expA * kLog2e, cb0 = c * sm.dtb[d], cb1 = c * sm.dtb[d + 1];
        float const b20 = sm.dtb[d] * kLog2e, b21 = sm.dtb[d + 1] * kLog2e;
        auto gate2 = [&](float x, float cb, float b2) -> float {
          if constexpr (kGate == GateForm::SigmoidLB) {
            return lbl * rcp(1.f + ex2(fmaf(c, x, cb)));
          } else if constexpr (kGate == GateForm::Softplus) {
            float const z2 = fmaf(x, kLog2e, b2);
            return fmaxf(-sm.expA * (z2 < 15.f ? lg2(1.f + ex2(z2)) : z2), -16777216.f);
          } else {
            return fmaxf(x * kLog2e, -16777216.f);
          }
        };
        float2 acc = make_float2(0.f, 0.f);
#pragma unroll
        for (int u = 0; u < kBC; ++u) {
          // every row computed, rows past the end selected away (whatever their raw bits): no branch between the
          // 16 independent sigmoids
          bool const in = kBC * r + u < rows;
          float2 const x = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&sm.u3.graw[kBC * r + u][d]));
          float const ax = gate2(x.x, cb0, b20), ay = gate2(x.y, cb1, b21);
          acc.x += in ? ax : 0.f;
          acc.y += in ? ay : 0.f;
          Gr[u] = acc;
        }
        *reinterpret_cast<float2*>(&sm.blk[r][d]) = acc;
      }
      __syncthreads();
      mark(0);

      // ---- 2b: rstd of the q and k rows | G = offset + local scan, anchors A_r = ceil(G_16r),
      //      B_s = floor(G_16(s+1)) (B_3 = floor(G_63)), gamma = exp2(G_63)
      // rstd: warp w reduces its 8 rows i = w + 8 e at once. Lane l first sums the squares of channels
      // 4l .. 4l + 3 (in order) of the 16 values x[2 e] (q row i), x[2 e + 1] (k row i). Butterfly levels
      // 16, 8, 4, 2 halve the values a lane carries: it keeps the half its offset bit selects and adds the
      // partner's copy of that half (8 + 4 + 2 + 1 shuffles); lane l then carries value l >> 1, and level 1
      // completes it. Every value gets the xor tree 16, 8, 4, 2, 1 of a per-row butterfly (same bits).
      {
        float x[16];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          int const i = warp + 8 * e;
          uint2 const qa = *reinterpret_cast<uint2 const*>(&sm.u1.raw.q[i][lane * 4]);
          uint2 const ka = *reinterpret_cast<uint2 const*>(&sm.u1.raw.k[i][lane * 4]);
          float const q0 = bf16_lo(qa.x), q1 = bf16_hi(qa.x), q2 = bf16_lo(qa.y), q3 = bf16_hi(qa.y);
          float const k0 = bf16_lo(ka.x), k1 = bf16_hi(ka.x), k2 = bf16_lo(ka.y), k3 = bf16_hi(ka.y);
          float sq = 0.f, sk = 0.f;
          sq = fmaf(q0, q0, sq);
          sk = fmaf(k0, k0, sk);
          sq = fmaf(q1, q1, sq);
          sk = fmaf(k1, k1, sk);
          sq = fmaf(q2, q2, sq);
          sk = fmaf(k2, k2, sk);
          sq = fmaf(q3, q3, sq);
          sk = fmaf(k3, k3, sk);
          x[2 * e] = sq;
          x[2 * e + 1] = sk;
        }
        butterfly_halve<8>(x, lane);
        butterfly_halve<4>(x, lane);
        butterfly_halve<2>(x, lane);
        butterfly_halve<1>(x, lane);
        x[0] += __shfl_xor_sync(0xffffffffu, x[0], 1);
        if ((lane & 1) == 0) {
          int const v = lane >> 1, i = warp + 8 * (v >> 1);
          float const rs = p.use_qk_l2norm ? rsqrtf(x[0] + 1e-6f) : 1.f;
          if (v & 1) {
            sm.rstd_k[i] = rs;
          } else {
            sm.rstd_q[i] = rs;
          }
          if (qk_out && i < rows) ((v & 1) ? p.k_rstd : p.q_rstd)[(tok0 + i) * p.H + h] = rs;
        }
      }
      {
        int const r = tid >> 6, d = 2 * (tid & 63);
        float2 off = make_float2(0.f, 0.f);
#pragma unroll
        for (int t = 0; t < 3; ++t) {
          if (t < r) {
            float2 const bt = *reinterpret_cast<float2 const*>(&sm.blk[t][d]);
            off.x += bt.x;
            off.y += bt.y;
          }
        }
#pragma unroll
        for (int u = 0; u < kBC; ++u) {
          Gr[u].x += off.x;
          Gr[u].y += off.y;
          if constexpr (kPass != kKdaPrep) *reinterpret_cast<float2*>(&sm.u2.G[kBC * r + u][d]) = Gr[u];
        }
        sm.anc_a[r][d] = int(ceilf(Gr[0].x));
        sm.anc_a[r][d + 1] = int(ceilf(Gr[0].y));
        if (r > 0) {
          sm.anc_b[r - 1][d] = int(floorf(Gr[0].x));
          sm.anc_b[r - 1][d + 1] = int(floorf(Gr[0].y));
        }
        if (r == 3) {
          sm.anc_b[3][d] = int(floorf(Gr[kBC - 1].x));
          sm.anc_b[3][d + 1] = int(floorf(Gr[kBC - 1].y));
          sm.gamma[d] = ex2(Gr[kBC - 1].x);
          sm.gamma[d + 1] = ex2(Gr[kBC - 1].y);
          if constexpr (kPass == kKdaPrep) {
            sm.g63[d] = Gr[kBC - 1].x;
            sm.g63[d + 1] = Gr[kBC - 1].y;
          }
        }
      }
      __syncthreads();
      mark(1);

      // ---- 3: block-anchored factors (exponents G - A_r <= 0, B_r - G <= 0); the per-channel block scalars
      //      2^(A_r - B_s) of the pairs (r, s <= r) for phase 4: thread = (block r, channel pair d) as in phase 2
      //      (r is warp-uniform), one pair per s <= r, stored where phase 4's lane t4 of k-step k0 reads its two
      //      pairs (d = k0 + 2 t4 and + 8) as one 8-byte word
      {
        static_assert(kThreads == (kC / kBC) * (kK / 2), "one thread per (16-row block, channel pair)");
        int const r = tid >> 6, d = 2 * (tid & 63), w = (d >> 4) * 8 + (d & 7) + ((d >> 3) & 1);
        int const ia0 = sm.anc_a[r][d], ia1 = sm.anc_a[r][d + 1];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          if (s <= r) {
            int const e0 = ia0 - sm.anc_b[s][d], e1 = ia1 - sm.anc_b[s][d + 1];
            // kWide: a wide channel leaves the diagonal block's product (its exact share is in corr)
            bool const w0 = kWide && s == r && e0 > kSpanMax, w1 = kWide && s == r && e1 > kSpanMax;
            sm.pw[r * (r + 1) / 2 + s][w] = (w0 ? 0u : pow2i_bf16(e0)) | (w1 ? 0u : pow2i_bf16(e1)) << 16;
          }
        }
      }
      uint32_t kg[2][kBC / 2];  // kPrep: Kg^T token pairs (i, i + 1) of channels d, d + 1, stored after phase 4
      if constexpr (kPass == kKdaPrep) {
        // Thread = (16-row block r, channel pair d) of phase 2, G in its registers: every factor of its 16 x 2
        // elements, with the expressions of the fused kernel's phases 3 and 5a (same bits). Qe, Ke, Kf to shared
        // memory; Qg and Kd straight to the record (token-major sw128k images: a warp's 32 channel pairs of a token
        // fill one 128-byte row); Kg^T kept until Ke is dead.
        int const r = tid >> 6, d = 2 * (tid & 63);
        unsigned char* const rc = record(chunk);
        bf16* const rec_qg = reinterpret_cast<bf16*>(rc + kRecQg);
        bf16* const rec_kd = reinterpret_cast<bf16*>(rc + kRecKd);
        int const ia0 = sm.anc_a[r][d], ia1 = sm.anc_a[r][d + 1];
        float const a0 = float(ia0), a1 = float(ia1);
        uint32_t const pb0 = pow2i_bf16(ia0), pb1 = pow2i_bf16(ia1);  // 2^A_r as bf16 pairs
        uint32_t const pa01 = pb0 | pb1 << 16, pa00 = pb0 | pb0 << 16, pa11 = pb1 | pb1 << 16;
        float const b0 = float(sm.anc_b[r][d]), b1 = float(sm.anc_b[r][d + 1]);
        float const hb0 = ex2(sm.g63[d] - b0), hb1 = ex2(sm.g63[d + 1] - b1);  // 2^(G_63 - B_r)
        if constexpr (kWide) {
          // The wide channels (span A_r - B_r past kSpanMax; their diagonal-block factors are 0): their exact share
          // of block r's diagonal block, summed over the block's wide channels, W_ij = sum_c q^_ic k^_jc 2^(G_ic -
          // G_jc) (j <= i) of Aqk_rr and K_ij, the same with k^_ic (j < i), of L_rr (exponents <= 0: G is
          // non-increasing). Per row i a lane holds its channel pair's 16 + 16 terms (0 where not wide or j past
          // the mask); the warp's butterfly leaves lane l the warp's sum of term (l >> 1) % 16, of W (l even) or K
          // (l odd), added to corr (the block's two warps: two adds per entry). Warps with no wide channel skip it.
          bool const wd0 = ia0 - sm.anc_b[r][d] > kSpanMax, wd1 = ia1 - sm.anc_b[r][d + 1] > kSpanMax;
          if (__any_sync(0xffffffffu, wd0 || wd1)) {
#pragma unroll
            for (int i = 0; i < kBC; ++i) {
              int const ti = kBC * r + i;
              float2 const qi = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&sm.u1.raw.q[ti][d]));
              float2 const ki = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&sm.u1.raw.k[ti][d]));
              float const sq = p.scale * sm.rstd_q[ti], sk = sm.rstd_k[ti];
              float const qa = wd0 ? qi.x * sq : 0.f, qb = wd1 ? qi.y * sq : 0.f;
              float const ka = wd0 ? ki.x * sk : 0.f, kb = wd1 ? ki.y * sk : 0.f;
              float w[kBC], kk[kBC];
#pragma unroll
              for (int j = 0; j < kBC; ++j) {
                w[j] = kk[j] = 0.f;
                if (j <= i) {
                  int const tj = kBC * r + j;
                  float const skj = sm.rstd_k[tj];
                  __nv_bfloat162 const kj = *reinterpret_cast<__nv_bfloat162 const*>(&sm.u1.raw.k[tj][d]);
                  float const ta = __bfloat162float(kj.x) * skj * ex2(Gr[i].x - Gr[j].x);
                  float const tb = __bfloat162float(kj.y) * skj * ex2(Gr[i].y - Gr[j].y);
                  w[j] = fmaf(qa, ta, qb * tb);
                  if (j < i) kk[j] = fmaf(ka, ta, kb * tb);
                }
              }
              butterfly_halve<8>(w, lane);
              butterfly_halve<4>(w, lane);
              butterfly_halve<2>(w, lane);
              butterfly_halve<1>(w, lane);
              butterfly_halve<8>(kk, lane);
              butterfly_halve<4>(kk, lane);
              butterfly_halve<2>(kk, lane);
              butterfly_halve<1>(kk, lane);
              float const ws = w[0] + __shfl_xor_sync(0xffffffffu, w[0], 1);
              float const ks = kk[0] + __shfl_xor_sync(0xffffffffu, kk[0], 1);
              int const j = (lane >> 1) & (kBC - 1);
              if (lane & 1) {
                if (j < i) red_add_shared(&corr(1, r, i, j), ks);
              } else if (j <= i) {
                red_add_shared(&corr(0, r, i, j), ws);
              }
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kBC; u += 2) {
          int const i = kBC * r + u;
          float2 const G0 = Gr[u], G1 = Gr[u + 1];
          auto const [q0, q1, k0, k1, sq0, sq1, sk0, sk1] = raw_pair(i, d);
          if (qk_out) {
            store_qk_hat(i, d, q0, k0, sm.rstd_q[i], sk0, rows, tok0);
            store_qk_hat(i + 1, d, q1, k1, sm.rstd_q[i + 1], sk1, rows, tok0);
          }
          // anchored (phase 4's operands)
          float const ea00 = ex2(G0.x - a0), ea01 = ex2(G0.y - a1), ea10 = ex2(G1.x - a0), ea11 = ex2(G1.y - a1);
          float const fb00 = ex2(b0 - G0.x), fb01 = ex2(b1 - G0.y), fb10 = ex2(b0 - G1.x), fb11 = ex2(b1 - G1.y);
          uint32_t const qe0 = pack_bf16(q0.x * sq0 * ea00, q0.y * sq0 * ea01);  // Qe row i, channels d, d + 1
          uint32_t const qe1 = pack_bf16(q1.x * sq1 * ea10, q1.y * sq1 * ea11);
          uint32_t const ke0 = pack_bf16(k0.x * sk0 * ea00, k0.y * sk0 * ea01);
          uint32_t const ke1 = pack_bf16(k1.x * sk1 * ea10, k1.y * sk1 * ea11);
          st_word(&t1_at(i, d), qe0);
          st_word(&t1_at(i + 1, d), qe1);
          st_word(&ke_at(i, d), ke0);
          st_word(&ke_at(i + 1, d), ke1);
          store_pair(&sm.t3.Kf[i][d], k0.x * sk0 * fb00, k0.y * sk0 * fb01);
          store_pair(&sm.t3.Kf[i + 1][d], k1.x * sk1 * fb10, k1.y * sk1 * fb11);
          // state-side (exponents <= 0), from the anchored factors: Qg = Qe 2^A_r, Kg = Ke 2^A_r (scale_pair) and
          // 2^(G_63 - G) = 2^(B_r - G) 2^(G_63 - B_r) (the fused kernel's phase 5a forms the same products)
          st_word(rec_qg + sw128k<kC>(i, d), scale_pair(qe0, pa01));
          st_word(rec_qg + sw128k<kC>(i + 1, d), scale_pair(qe1, pa01));
          kg[0][u / 2] = scale_pair(lo_halves(ke0, ke1), pa00);
          kg[1][u / 2] = scale_pair(hi_halves(ke0, ke1), pa11);
          st_word(rec_kd + sw128k<kC>(i, d), pack_bf16(k0.x * sk0 * (fb00 * hb0), k0.y * sk0 * (fb01 * hb1)));
          st_word(rec_kd + sw128k<kC>(i + 1, d), pack_bf16(k1.x * sk1 * (fb10 * hb0), k1.y * sk1 * (fb11 * hb1)));
        }
      } else {
        for (int idx = tid; idx < kC * (kK / 2); idx += kThreads) {
          int const i = idx >> 6, d = (idx & 63) * 2, r = i >> 4;
          float2 const G = *reinterpret_cast<float2 const*>(&sm.u2.G[i][d]);
          float2 const q2 = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&sm.u1.raw.q[i][d]));
          float2 const k2 = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&sm.u1.raw.k[i][d]));
          float const sq = p.scale * sm.rstd_q[i], sk = sm.rstd_k[i];
          if (qk_out) store_qk_hat(i, d, q2, k2, sm.rstd_q[i], sk, rows, tok0);
          float const ea0 = ex2(G.x - float(sm.anc_a[r][d])), ea1 = ex2(G.y - float(sm.anc_a[r][d + 1]));
          float const fb0 = ex2(float(sm.anc_b[r][d]) - G.x), fb1 = ex2(float(sm.anc_b[r][d + 1]) - G.y);
          store_pair(&t1_at(i, d), q2.x * sq * ea0, q2.y * sq * ea1);
          store_pair(&ke_at(i, d), k2.x * sk * ea0, k2.y * sk * ea1);
          store_pair(&sm.t3.Kf[i][d], k2.x * sk * fb0, k2.y * sk * fb1);
        }
      }
      __syncthreads();
      mark(2);

      // ---- 4: Aqk and L on the 10 sub-block pairs (r, s <= r) each; warp w takes jobs w, w + 8, w + 16 of the
      //      2 kPairs = 20 (the blocks s > r of aqk stay zero from the prologue). Jobs 12-15, the second and last
      //      of warps 4-7, are L's diagonal blocks L_rr: the warp then inverts its block in place,
      //      D_r = (I + L_rr)^-1 (phase 5b's first step, done while warps 0-3 run their third job). kPrep: Aqk to
      //      the record (and the grad extras) from the accumulators, zero blocks included
      bf16* const rec_aqk = kPass == kKdaPrep ? reinterpret_cast<bf16*>(record(chunk) + kRecAqk) : nullptr;
      bf16* const aqk_g = extras ? static_cast<bf16*>(p.Aqk) + int64_t(hv) * kC : nullptr;
      for (int job = warp; job < 2 * kPairs; job += 8) {
        // jobs 0-9: Aqk of pair job; 10-19: L of pairs 1, 3, then the diagonal 0, 2, 5, 9 (jobs 12-15), 4, 6, 7, 8
        bool const is_l = job >= kPairs;
        int const pr = is_l ? int((0x8764952031ull >> (4 * (job - kPairs))) & 15) : job;
        int const r = pr >= 6 ? 3 : pr >= 3 ? 2 : pr >= 1 ? 1 : 0, s = pr - r * (r + 1) / 2;
        float acc[2][4];
        zero(acc);
        {
          // ldmatrix rows: lane l reads tile l / 8 at row lr = l % 8 + 8 ((l / 8) % 2), channel k0 + 8 (l / 16) of
          // Qe or Ke (padded rows, or (kWgmma) sw128k), and row 16 s + l % 8 + 8 (l / 16), channel k0 + 8 ((l / 8) % 2)
          // of Kf (nt = l / 16)
          int const lr = (lane & 7) + 8 * ((lane >> 3) & 1), lk = 8 * (lane >> 4);
          bf16 const* const A = is_l ? &sm.t2.Ke[0][0] : &sm.u3.t1[0][0];
          bf16 const* const B = &sm.t3.Kf[16 * s + (lane & 7) + 8 * (lane >> 4)][8 * ((lane >> 3) & 1)];
#pragma unroll
          for (int k0 = 0; k0 < kK; k0 += 16) {
            uint2 const sc = *reinterpret_cast<uint2 const*>(&sm.pw[pr][k0 / 2 + 2 * t4]);  // channels k0 + 2 t4 (+ 8)
            uint32_t const s01 = sc.x, s89 = sc.y;
            uint32_t a[4], b[4];
            ldmatrix_x4(a, kWgmma ? A + sw128k<kC>(16 * r + lr, k0 + lk) : A + (16 * r + lr) * kLdK + k0 + lk);
            ldmatrix_x4(b, B + k0);
            uint32_t const a0 = scale_pair(a[0], s01), a1 = scale_pair(a[1], s01);
            uint32_t const a2 = scale_pair(a[2], s89), a3 = scale_pair(a[3], s89);
            mma_bf16_16816(acc[0], a0, a1, a2, a3, b[0], b[1]);
            mma_bf16_16816(acc[1], a0, a1, a2, a3, b[2], b[3]);
          }
        }
        if constexpr (kWide) {
          if (r == s) {  // the wide channels' share (zero where none is wide)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[nt][e] += corr(is_l, r, g8 + (e >> 1) * 8, nt * 8 + 2 * t4 + (e & 1));
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if constexpr (kPass == kKdaPrep) {
            if (!is_l) {  // Aqk to the record (and FLA's Aqk) as bf16 pairs (j, j + 1)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                int const i = 16 * r + g8 + 8 * h, j = 16 * s + nt * 8 + 2 * t4;
                __nv_bfloat162 const a = __floats2bfloat162_rn(j <= i ? acc[nt][2 * h] : 0.f,
                                                                j + 1 <= i ? acc[nt][2 * h + 1] : 0.f);
                *reinterpret_cast<__nv_bfloat162*>(rec_aqk + sw128(i, j)) = a;
                if (extras && i < rows) {
                  *reinterpret_cast<__nv_bfloat162*>(aqk_g + (tok0 + i) * p.extras_tok_stride + j) = a;
                }
              }
              continue;
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            int const i = 16 * r + g8 + (e >> 1) * 8, j = 16 * s + nt * 8 + 2 * t4 + (e & 1);
            if (is_l) {
              L_at(i, j) = j < i ? sm.beta[i] * acc[nt][e] : 0.f;
            } else {
              aqk_at(i, j) = __float2bfloat16_rn(j <= i ? acc[nt][e] : 0.f);
            }
          }
        }
      }
      if (warp >= 4) {
        // D_r = (I + L_rr)^-1 by forward substitution (r = warp - 4: its L_rr is job 12 + r above), lane = column c
        // (lanes 16-31 repeat 0-15), written over L_rr
        __syncwarp();
        int const c = lane & 15, o = 16 * (warp - 4);
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          float sum = i == c ? 1.f : 0.f;
#pragma unroll
          for (int j = 0; j < i; ++j) sum = fmaf(-L_at(o + i, o + j), x[j], sum);
          x[i] = sum;
        }
        __syncwarp();
        if (lane < 16) {
#pragma unroll
          for (int i = 0; i < 16; ++i) L_at(o + i, o + c) = x[i];
        }
      }
      if constexpr (kPass == kKdaPrep) {  // the blocks s > r: 6 x 16 rows x 8 column pairs
        for (int e = tid; e < 6 * kBC * 8; e += kThreads) {
          int const bk = e >> 7, rb = bk < 3 ? 0 : bk < 5 ? 1 : 2, cb = bk < 3 ? bk + 1 : bk < 5 ? bk - 1 : 3;
          int const i = 16 * rb + ((e >> 3) & 15), j = 16 * cb + (e & 7) * 2;
          store_pair(rec_aqk + sw128(i, j), 0.f, 0.f);
          if (extras && i < rows) store_pair(aqk_g + (tok0 + i) * p.extras_tok_stride + j, 0.f, 0.f);
        }
      }
      __syncthreads();
      mark(3);

      // ---- 5a: state-side factors (all exponents <= 0); raw q/k and G read for the last time. Thread = (token
      //      pair i, i + 1; channel pair d, d + 1), a warp = 8 token pairs x 4 channel pairs: the bf16x2 stores
      //      into the transposed Kg^T / Kd^T rows and the float2 reads of G rows hit distinct banks.
      //      kPrep: formed in phase 3; Kg^T from its registers (16-byte rows of 8 tokens), Ke being dead
      if constexpr (kPass == kKdaPrep) {
        int const r = tid >> 6, d = 2 * (tid & 63);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            *reinterpret_cast<uint4*>(&kgT_at(d + c, 16 * r + 8 * h)) =
                make_uint4(kg[c][4 * h], kg[c][4 * h + 1], kg[c][4 * h + 2], kg[c][4 * h + 3]);
          }
        }
      } else {
        // Qg = Qe 2^A_r in place and Kg = Ke 2^A_r (scale_pair: the prep's products, same bits); Kg^T overwrites
        // Ke's storage, so every thread reads its Ke pairs before the barrier and stores Kg^T after it
        constexpr int kIt = (kC / 2) * (kK / 2) / kThreads;
        uint32_t kgw[kIt][2];
#pragma unroll
        for (int it = 0; it < kIt; ++it) {
          int const idx = tid + it * kThreads, l = idx & 31, grp = idx >> 5;
          int const i = 2 * ((grp & 3) * 8 + (l & 7)), d = 2 * ((grp >> 2) * 4 + (l >> 3));
          float2 const G0 = *reinterpret_cast<float2 const*>(&sm.u2.G[i][d]);
          float2 const G1 = *reinterpret_cast<float2 const*>(&sm.u2.G[i + 1][d]);
          float2 const G63 = *reinterpret_cast<float2 const*>(&sm.u2.G[kC - 1][d]);
          auto const [q0, q1, k0, k1, sq0, sq1, sk0, sk1] = raw_pair(i, d);
          // the prep's products (phase 3): 2^G = 2^(G - A_r) 2^A_r, 2^(G_63 - G) = 2^(B_r - G) 2^(G_63 - B_r)
          int const r = i >> 4;
          uint32_t const pb0 = pow2i_bf16(sm.anc_a[r][d]), pb1 = pow2i_bf16(sm.anc_a[r][d + 1]);
          float const b0 = float(sm.anc_b[r][d]), b1 = float(sm.anc_b[r][d + 1]);
          float const hb0 = ex2(G63.x - b0), hb1 = ex2(G63.y - b1);
          st_word(&t1_at(i, d), scale_pair(ld_word(&t1_at(i, d)), pb0 | pb1 << 16));
          st_word(&t1_at(i + 1, d), scale_pair(ld_word(&t1_at(i + 1, d)), pb0 | pb1 << 16));
          uint32_t const ke0 = ld_word(&ke_at(i, d)), ke1 = ld_word(&ke_at(i + 1, d));
          kgw[it][0] = scale_pair(lo_halves(ke0, ke1), pb0 | pb0 << 16);
          kgw[it][1] = scale_pair(hi_halves(ke0, ke1), pb1 | pb1 << 16);
          store_pair(&kdT_at(d, i), k0.x * sk0 * (ex2(b0 - G0.x) * hb0), k1.x * sk1 * (ex2(b0 - G1.x) * hb0));
          store_pair(&kdT_at(d + 1, i), k0.y * sk0 * (ex2(b1 - G0.y) * hb1), k1.y * sk1 * (ex2(b1 - G1.y) * hb1));
        }
        __syncthreads();
#pragma unroll
        for (int it = 0; it < kIt; ++it) {
          int const idx = tid + it * kThreads, l = idx & 31, grp = idx >> 5;
          int const i = 2 * ((grp & 3) * 8 + (l & 7)), d = 2 * ((grp >> 2) * 4 + (l >> 3));
          st_word(&kgT_at(d, i), kgw[it][0]);
          st_word(&kgT_at(d + 1, i), kgw[it][1]);
        }
      }
      __syncthreads();
      mark(4);

      // ---- 5b: inverse X = (I + L)^-1 by 16-blocks: X_rr = D_r = (I + L_rr)^-1 (phase 4, over L_rr: Xd_at) and,
      //      for s < r, X_rs = -D_r T_rs with T_rs = sum_{t=s}^{r-1} L_rt X_ts (sums over t, then m, in order).
      //      akkb = bf16(X diag(beta)) (the A operand of phases 6-7): off-diagonal blocks by their producer, the
      //      diagonal and zero blocks by idle warps in steps 4 and 5 below.
      // Off-diagonal blocks: a group of 64 threads (grp = warp / 2) computes one block per step, thread = a
      // 1 x 4 strip (row si, columns sj .. sj + 3): one L element times a float4 of X per fma step. The six
      // steps follow the longest chain X_10 -> X_20 -> X_30; a chain's earlier terms are summed in earlier
      // steps (T_30: t = 0, 1, 2 in steps 1, 3, 5 in registers; T_31's t = 1 term through X's unused
      // upper block (0, 3)); T blocks wait for their D_r product in tmp.
      {
        int const grp = warp >> 1, si = (tid >> 2) & 15, sj = (tid & 3) * 4;
        // acc += L_rt X_ts on the strip (block row r, column block s)
        // (diag: t == s, X_ss = D_s in L's storage)
        auto lx = [&](float4& acc, int r, int t, int s, auto diag) {
#pragma unroll
          for (int m = 0; m < 16; ++m) {
            float const l = L_at(16 * r + si, 16 * t + m);
            float const* const xp = decltype(diag)::value ? &L_at(16 * t + m, 16 * s + sj)
                                                          : &X_at(16 * t + m, 16 * s + sj);
            float4 const xv = *reinterpret_cast<float4 const*>(xp);
            acc.x = fmaf(l, xv.x, acc.x);
            acc.y = fmaf(l, xv.y, acc.y);
            acc.z = fmaf(l, xv.z, acc.z);
            acc.w = fmaf(l, xv.w, acc.w);
          }
        };
        auto tmp = [&](int slot) { return reinterpret_cast<float4*>(&sm.tmp[slot][si][sj]); };
        // X_rs = -D_r T, T in tmp[slot]; X diag(beta) to akkb
        auto dx = [&](int r, int s, int slot) {
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int m = 0; m < 16; ++m) {
            float const xv = L_at(16 * r + si, 16 * r + m);  // D_r
            float4 const tv = *reinterpret_cast<float4 const*>(&sm.tmp[slot][m][sj]);
            acc.x = fmaf(xv, tv.x, acc.x);
            acc.y = fmaf(xv, tv.y, acc.y);
            acc.z = fmaf(xv, tv.z, acc.z);
            acc.w = fmaf(xv, tv.w, acc.w);
          }
          int const i = 16 * r + si, j = 16 * s + sj;
          float4 const xn = make_float4(-acc.x, -acc.y, -acc.z, -acc.w);
          *reinterpret_cast<float4*>(&X_at(i, j)) = xn;
          store_pair(&akkb_at(i, j), xn.x * sm.beta[j], xn.y * sm.beta[j + 1]);
          store_pair(&akkb_at(i, j + 2), xn.z * sm.beta[j + 2], xn.w * sm.beta[j + 3]);
        };
        float4* const part31 = reinterpret_cast<float4*>(&X_at(si, 48 + sj));  // X block (0, 3): unused
        float4 const z4 = make_float4(0.f, 0.f, 0.f, 0.f);
        float4 acc30 = z4, acc = z4;
        // step 1: T_30 (t = 0) | T_20 (t = 0, kept in acc) | T_10 -> tmp 0 | T_21 -> tmp 1
        if (grp == 0) {
          lx(acc30, 3, 0, 0, std::true_type{});
        } else {
          int const r = grp == 2 ? 1 : 2, ts = grp == 3 ? 1 : 0;  // (r, t = s): (2, 0) | (1, 0) | (2, 1)
          lx(acc, r, ts, ts, std::true_type{});
          if (grp >= 2) *tmp(grp - 2) = acc;
        }
        __syncthreads();
        // step 2: T_32 | T_31 (t = 1) | X_10 | X_21
        if (grp == 0) {
          float4 t32 = z4;
          lx(t32, 3, 2, 2, std::true_type{});
          *tmp(2) = t32;
        } else if (grp == 1) {
          float4 t31 = z4;
          lx(t31, 3, 1, 1, std::true_type{});
          *part31 = t31;
        } else {
          dx(grp == 2 ? 1 : 2, grp == 2 ? 0 : 1, grp - 2);
        }
        __syncthreads();
        // step 3: T_30 (t = 1) | T_20 (t = 1) | X_32 | T_31 (t = 2)
        if (grp == 0) {
          lx(acc30, 3, 1, 0, std::false_type{});
        } else if (grp == 1) {
          lx(acc, 2, 1, 0, std::false_type{});
          *tmp(0) = acc;
        } else if (grp == 2) {
          dx(3, 2, 2);
        } else {
          float4 t31 = *part31;
          lx(t31, 3, 2, 1, std::false_type{});
          *tmp(1) = t31;
        }
        __syncthreads();
        // step 4: X_20 (warps 2, 3) | X_31 (warps 4, 5) | akkb of the 4 diagonal blocks (warps 0, 1, 6, 7: column
        //         pairs, 4 blocks x 16 rows x 8 pairs)
        if (grp == 1) {
          dx(2, 0, 0);
        } else if (grp == 2) {
          dx(3, 1, 1);
        } else {
#pragma unroll
          for (int e = (grp == 0 ? tid : tid - 128); e < 4 * kBC * 8; e += 128) {
            int const i = 16 * (e >> 7) + ((e >> 3) & 15), j = 16 * (e >> 7) + (e & 7) * 2;
            float2 const xv = *reinterpret_cast<float2 const*>(&L_at(i, j));  // D_r
            store_pair(&akkb_at(i, j), xv.x * sm.beta[j], xv.y * sm.beta[j + 1]);
          }
        }
        __syncthreads();
        // step 5: T_30 (t = 2) | akkb's 6 zero blocks (rb, cb > rb) (warps 2-7: 6 x 16 rows x 8 pairs)
        if (grp == 0) {
          lx(acc30, 3, 2, 0, std::false_type{});
          *tmp(2) = acc30;
        } else {
#pragma unroll
          for (int e = tid - 64; e < 6 * kBC * 8; e += 192) {
            int const bk = e >> 7, rb = bk < 3 ? 0 : bk < 5 ? 1 : 2, cb = bk < 3 ? bk + 1 : bk < 5 ? bk - 1 : 3;
            int const i = 16 * rb + ((e >> 3) & 15), j = 16 * cb + (e & 7) * 2;
            store_pair(&akkb_at(i, j), 0.f * sm.beta[j], 0.f * sm.beta[j + 1]);
          }
        }
        __syncthreads();
        // step 6: X_30
        if (grp == 0) dx(3, 0, 2);
#ifndef FLA_CULA_KDA_HOST_EMULATION
        // akkb and Kg^T (and this chunk's t1, sT, vT), written through the generic proxy, become visible to the
        // wgmma of phases 6-7
        if constexpr (kWgmma) cutlass::arch::fence_view_async_shared();
#endif
        __syncthreads();
      }
      // grad extras: Akk = bf16(X) (zeros above the diagonal), Aqk; X is raw q/k's storage (prefetched next)
      if (extras) {
        for (int idx = tid; idx < rows * (kC / 2); idx += kThreads) {
          int const i = idx >> 5, j = (idx & 31) * 2;
          bool const up = (j >> 4) > (i >> 4);
          float const x0 = up ? 0.f : Xd_at(i, j), x1 = up ? 0.f : Xd_at(i, j + 1);
          int64_t const off = (tok0 + i) * p.extras_tok_stride + int64_t(hv) * kC + j;
          store_pair(static_cast<bf16*>(p.Akk) + off, x0, x1);
          if constexpr (kPass != kKdaPrep) {  // (kPrep wrote Aqk in phase 4)
            *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.Aqk) + off) = ld32(&aqk_at(i, j));
          }
        }
        __syncthreads();
      }
      mark(5);
      if (prefetch) {
        issue_qk(chunk + 1);  // u1.raw: X (kPrep: L) was last read above (barrier between)
        if constexpr (kPass == kKdaPrep) {
          issue_g(chunk + 1);  // u3.graw: kPrep's X was last read above
          load_vb(chunk + 1);  // raw beta into a register, stored after phase 6
        }
      }

      // ---- 6: -W = -(X diag b) Kg : 64 x 128, warp = (row tile w/2, 64 columns), or (kWgmma) warpgroup = 64 columns
      {
        int const mt = kWgmma ? (warp & 3) : (warp >> 1), nb = (kWgmma ? (warp >> 2) : (warp & 1)) * 64;
        float acc[8][4];
        zero(acc);
        if constexpr (kWgmma) {
          wg_mma_tn<64>(acc, &sm.akkb[0][0], &sm.t2.KgT[0][0] + nb * kC, lane, warp & 3);
        } else {
          warp_mma_tn<8, kC>(acc, &sm.akkb[16 * mt][0], kLdC, &sm.t2.KgT[nb][0], kLdC, lane);
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          int const i = 16 * mt + g8, d = nb + nt * 8 + 2 * t4;
          if constexpr (kPass == kKdaPrep) {  // the sw128k image staged in Kf's storage; write_record copies it
            store_pair(wn_stage() + sw128k<kC>(i, d), -acc[nt][0], -acc[nt][1]);
            store_pair(wn_stage() + sw128k<kC>(i + 8, d), -acc[nt][2], -acc[nt][3]);
          } else {
            store_pair(&wn_at(i, d), -acc[nt][0], -acc[nt][1]);
            store_pair(&wn_at(i + 8, d), -acc[nt][2], -acc[nt][3]);
          }
        }
      }
#ifndef FLA_CULA_KDA_HOST_EMULATION
      if constexpr (kWgmma) cutlass::arch::fence_view_async_shared();  // -W for phase 7's wgmma
#endif
      __syncthreads();
      mark(6);

      if constexpr (kPass == kKdaPrep) {
        write_record(chunk);  // akkb, -W (staged in Kf's storage) and gamma; Qg, Kd, Aqk went from registers
        if (prefetch) store_vb();  // beta last read in phase 5 (barriers between); loaded before phase 6
        cp_async_wait_all();
        __syncthreads();  // every thread's record stores of this chunk precede the release
        if (p.rec_ready != nullptr && tid == 0) {
          rec_flag_release(p.rec_ready + int64_t(hv) * p.rec_slots + slot0 + chunk);
        }
      } else {
        float o_acc[kNO][4];
        phase7(o_acc);
        // the operand tiles of phase 8 (aqk, Kd^T, V'^T), written through the generic proxy, become visible to wgmma
        if constexpr (kWgmma) fence_async_shared();
        __syncthreads();
        mark(7);
        if (prefetch) {
          issue_g(chunk + 1);  // u3.graw: Qg (t1) was last read in phase 7 (barrier between)
          load_vb(chunk + 1);  // into registers; vT / beta are stored after phase 8
        }
        phase8(o_acc, tok0, rows);
        if constexpr (kProfile) __syncthreads();  // the timer build splits the products from the wait for chunk + 1
        mark(8);
        if (prefetch) store_vb();  // vT last read in phase 7, beta in phase 5 (barriers between)
        cp_async_wait_all();       // this thread's copies of chunk + 1 landed; the barrier publishes them
        __syncthreads();
        mark(9);
      }
    }
  }
  if (prof && tid == 0) {
    for (int ph = 0; ph < kKdaFwdPhases; ++ph) p.phase_cycles[int64_t(bid) * kKdaFwdPhases + ph] = sm.prof[ph];
  }

  // ---- final state: ht (fused; kState's last segment), or the maps pass's seg_H / seg_M (K-major)
  if constexpr (kPass != kKdaPrep) {
    bool const to_ht = p.ht != nullptr && (kPass == kKdaFused || (!p.maps && seg == last_seg));
    bool const to_seg = kPass == kKdaState && p.maps;
    if (to_ht || to_seg) {
      // (d, c), (d, c + 1) as one 8-byte store where adjacent (K-major: seg_H, seg_M, ht unless V-first, whose rows
      // are contiguous in d across the warp instead)
      int const d0 = warp * 16 + g8;
#pragma unroll
      for (int nt = 0; nt < kNS; ++nt) {
        int const c = nt * 8 + 2 * t4;
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          int const d = d0 + (e >> 1) * 8;
          float2 const v = make_float2(S[nt][e], S[nt][e + 1]);
          float* const dst = to_ht ? p.ht + state_index(d, c)
                             : mmap ? p.seg_M + seg_index(seg - 1, d, c)
                                    : p.seg_H + seg_index(seg, d, c);
          if (to_ht && p.state_v_first) {
            dst[0] = v.x;
            p.ht[state_index(d, c + 1)] = v.y;
          } else {
            *reinterpret_cast<float2*>(dst) = v;
          }
        }
      }
    }
  }
}

// The fused forward: one CTA per (sequence, value head, V block) runs every phase of every chunk.
template <GateForm kGate, bool kProfile, int kBV, bool kWgmma = false, bool kQkHat = false>
__global__ void __launch_bounds__(kThreads, 1) kda_fwd_kernel(__grid_constant__ KdaFwdParams const p) {
  kda_fwd_body<kGate, kProfile, kBV, kWgmma, kKdaFused, kQkHat>(p, blockIdx.x);
}

// The two-kernel form, kernel 1: phases 1-6 of chunks_per_cta chunks per CTA (n, hv, chunk block), chunk-parallel;
// each chunk's operand tiles to its record. PrepStorage: two CTAs per SM (128 registers a thread at most).
template <GateForm kGate, bool kProfile = false, bool kQkHat = false>
__global__ void __launch_bounds__(kThreads, 2) kda_prep_kernel(__grid_constant__ KdaFwdParams const p) {
  kda_fwd_body<kGate, kProfile, 64, true, kKdaPrep, kQkHat>(p, blockIdx.x);
}

// Kernel 2: phases 7-8 of a segment (or a whole sequence) per CTA (n, unit, hv, V block) from the records.
// StateStorage: two CTAs per SM at 64 columns (128 registers a thread at most).
template <int kBV, bool kProfile = false>
__global__ void __launch_bounds__(kThreads, kBV == 64 ? 2 : 1)
    kda_state_kernel(__grid_constant__ KdaFwdParams const p) {
  kda_fwd_body<GateForm::SigmoidLB, kProfile, kBV, true, kKdaState>(p, blockIdx.x);
}

}  // namespace fla_cula::kda_sm90
