// Device code of kda_bwd_intra (kda_bwd.h): FLA's chunk_kda_bwd_intra as one CTA of 16 warps per (chunk, value
// head) around intra_products / intra_epilogue (kda_bwd_intra_block.cuh: the math, the factors' ranges, the warp
// layout). Loads: g, q, k, beta, dAqk, dAkk, then the incoming dq, dk, dg as a second cp.async group that lands
// while the products run (204 KB of shared memory, one CTA per SM).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kda_sm90/cp_async.cuh"
#include "kda_sm90/kda_bwd.h"
#include "kda_sm90/kda_bwd_chunk.cuh"
#include "kda_sm90/kda_bwd_intra_block.cuh"

namespace fla_cula::kda_sm90 {

constexpr int kIntraThreads = 512;  // 16 warps: 4 blocks of 16 tokens x 4 quarters of the 128 channels

struct BwdIntraStorage {
  float g[kC * kLdG];
  bf16 q[kC * kLdK], k[kC * kLdK];
  float dAqk[kC * kLdF], dAkk[kC * kLdF];             // [t][s], split in place (split_dA)
  float dq[kC * kLdK], dk[kC * kLdK], dg[kC * kLdK];  // the incoming gradients (fp32 rows of kLdK)
  float beta[kC], db[4][kC];                          // db: one row of partial sums per channel quarter
};
constexpr int kBwdIntraSmemBytes = int(sizeof(BwdIntraStorage));

// kWide: no per-token gate bound (gate_shift 0: softplus or precomputed gates; kda_bwd_intra_block.cuh's diag_anchor)
template <bool kWide>
__global__ void __launch_bounds__(kIntraThreads, 1) kda_bwd_intra_kernel(__grid_constant__ KdaBwdIntraParams const p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  BwdIntraStorage& sm = *reinterpret_cast<BwdIntraStorage*>(smem_raw);
  int const tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g8 = lane >> 2, t4 = lane & 3;
  int const I = w & 3, c0 = 32 * (w >> 2);  // this warp's block and channels
  int const HV = p.HV, hv = int(blockIdx.x % unsigned(HV)), hq = hv / (HV / p.H);
  ChunkSpan const span = chunk_span(p, blockIdx.x / unsigned(HV));
  int64_t const t0 = span.t0;
  int const L = span.L;
  auto vrow = [&](int t) { return ((t0 + t) * HV + hv) * kK; };
  auto qrow = [&](int t) { return ((t0 + t) * p.H + hq) * kK; };

  // loads (rows >= L zero): g, q, k, dAqk, dAkk, beta; then dq, dk, dg
#pragma unroll
  for (int r = 0; r < kC * 32 / kIntraThreads; ++r) {
    int const i = tid + kIntraThreads * r, t = i >> 5, u = 4 * (i & 31);
    cp_async16(sm.g + t * kLdG + u, p.g + (t < L ? vrow(t) : 0) + u, t < L);
  }
#pragma unroll
  for (int r = 0; r < kC * 16 / kIntraThreads; ++r) {
    int const i = tid + kIntraThreads * r, t = i >> 4, u = 8 * (i & 15);
    cp_async16(sm.q + t * kLdK + u, static_cast<bf16 const*>(p.q) + (t < L ? qrow(t) : 0) + u, t < L);
    cp_async16(sm.k + t * kLdK + u, static_cast<bf16 const*>(p.k) + (t < L ? qrow(t) : 0) + u, t < L);
  }
#pragma unroll
  for (int r = 0; r < kC * 16 / kIntraThreads; ++r) {
    int const i = tid + kIntraThreads * r, t = i >> 4, u = 4 * (i & 15);
    int64_t const o = t < L ? ((t0 + t) * HV + hv) * kC + u : 0;
    cp_async16(sm.dAqk + t * kLdF + u, p.dAqk + o, t < L);
    cp_async16(sm.dAkk + t * kLdF + u, p.dAkk + o, t < L);
  }
  cp_async_commit();
  float const* const inc[3] = {p.dq, p.dk, p.dg};
  float* const inc_sm[3] = {sm.dq, sm.dk, sm.dg};
#pragma unroll
  for (int x = 0; x < 3; ++x)
#pragma unroll
    for (int r = 0; r < kC * 32 / kIntraThreads; ++r) {
      int const i = tid + kIntraThreads * r, t = i >> 5, u = 4 * (i & 31);
      cp_async16(inc_sm[x] + t * kLdK + u, inc[x] + (t < L ? vrow(t) : 0) + u, t < L);
    }
  cp_async_commit();
  if (tid < kC) sm.beta[tid] = tid < L ? p.beta[(t0 + tid) * HV + hv] : 0.f;
  cp_async_wait_group<1>();
  __syncthreads();
  split_dA(sm.dAqk, sm.dAkk, tid, kIntraThreads);
  __syncthreads();

  IntraTiles const tl{sm.g, sm.q, sm.k, sm.beta, sm.dAqk, sm.dAkk};
  float aq[4][4], ak[4][4], at[4][4];
  intra_products<kWide>(tl, L, p.gate_shift, I, c0, lane, aq, ak, at);
  cp_async_wait_all();
  __syncthreads();
  float dbp[2] = {0.f, 0.f};
  if constexpr (kWide) {
    intra_wide_fixup(tl, L, I, c0, lane, dbp, [&](int t, int c, float2 dq, float2 dk, float2 dg) {
      add_pair(sm.dq + t * kLdK + c, dq);
      add_pair(sm.dk + t * kLdK + c, dk);
      add_pair(sm.dg + t * kLdK + c, dg);
    });
  }
  intra_epilogue<kWide>(
      tl, L, p.gate_shift, I, c0, lane, aq, ak, at, dbp,
      [&](int t, int c) {
        auto at2 = [&](float const* x) { return *reinterpret_cast<float2 const*>(x + t * kLdK + c); };
        return IntraIn{at2(sm.dq), at2(sm.dk), at2(sm.dg)};
      },
      [&](int t, int c, IntraIn const& r, int, int) {
        int64_t const o = vrow(t) + c;
        *reinterpret_cast<float2*>(p.dq_out + o) = r.dq;
        *reinterpret_cast<float2*>(p.dk_out + o) = r.dk;
        *reinterpret_cast<float2*>(p.dg_out + o) = r.dg;
      });
  // db: the 4 lanes of a row, then the 4 channel quarters
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dbp[h] += __shfl_xor_sync(0xffffffffu, dbp[h], 1);
    dbp[h] += __shfl_xor_sync(0xffffffffu, dbp[h], 2);
    if (t4 == 0) sm.db[w >> 2][16 * I + g8 + 8 * h] = dbp[h];
  }
  __syncthreads();
  if (tid < L) {
    int64_t const o = (t0 + tid) * HV + hv;
    p.db_out[o] = p.db[o] + sm.db[0][tid] + sm.db[1][tid] + sm.db[2][tid] + sm.db[3][tid];
  }
}

}  // namespace fla_cula::kda_sm90
