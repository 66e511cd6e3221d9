// Device code of kda_bwd_dv (kda_bwd.h): the dv half of FLA 0.6.0's chunk_kda_bwd_kernel_dAv,
//   dv[s][v] = sum over s <= t < L of Aqk[t][s] do[t][v]        (bf16 operands, fp32 sums, bf16 out)
// per (chunk, value head); L the chunk's length. The dAqk half, scale M'(do v'^T), is made by kda_bwd_wy with intra.
// One CTA of 8 warps: Aqk [64][64] and do [64][128] to shared memory by cp.async (rows >= L zero), Aqk's entries
// above the diagonal zeroed there (the forward leaves them unwritten), then warp w computes rows 16 (w % 4) .. + 15
// and columns 64 (w / 4) .. + 63 of dv on mma.sync (Aqk read transposed by ldmatrix.trans), and the result goes back
// through do's tile so that each row leaves in 16-byte pieces.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kda_sm90/cp_async.cuh"
#include "kda_sm90/kda_bwd.h"
#include "kda_sm90/kda_bwd_chunk.cuh"

namespace fla_cula::kda_sm90 {

constexpr int kDvThreads = 256;

struct BwdDvStorage {
  bf16 a[kC * kLdC];     // Aqk [t][s]
  bf16 dout[kC * kLdK];  // do [t][v]; then dv [s][v]
};
constexpr int kBwdDvSmemBytes = int(sizeof(BwdDvStorage));

__global__ void __launch_bounds__(kDvThreads) kda_bwd_dv_kernel(__grid_constant__ KdaBwdDvParams const p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  BwdDvStorage& sm = *reinterpret_cast<BwdDvStorage*>(smem_raw);
  int const tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g8 = lane >> 2, t4 = lane & 3;
  int const r0 = 16 * (w & 3), c0 = 64 * (w >> 2);
  int const HV = p.HV, hv = int(blockIdx.x % unsigned(HV));
  ChunkSpan const span = chunk_span(p, blockIdx.x / unsigned(HV));
  int64_t const t0 = span.t0;
  int const L = span.L;
  auto row = [&](int t) { return (t0 + t) * HV + hv; };  // [B*T, HV] row of token t
  bf16 const* const A = static_cast<bf16 const*>(p.Aqk);
  bf16 const* const dout = static_cast<bf16 const*>(p.dout);

#pragma unroll
  for (int r = 0; r < kC * 8 / kDvThreads; ++r) {
    int const i = tid + kDvThreads * r, t = i >> 3, u = 8 * (i & 7);
    cp_async16(sm.a + t * kLdC + u, A + (t < L ? row(t) * kC : 0) + u, t < L);
  }
#pragma unroll
  for (int r = 0; r < kC * 16 / kDvThreads; ++r) {
    int const i = tid + kDvThreads * r, t = i >> 4, u = 8 * (i & 15);
    cp_async16(sm.dout + t * kLdK + u, dout + (t < L ? row(t) * kK : 0) + u, t < L);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  // Aqk above the diagonal (s > t) to zero: 8 entries of row t per thread and pass
#pragma unroll
  for (int r = 0; r < kC * 8 / kDvThreads; ++r) {
    int const i = tid + kDvThreads * r, t = i >> 3, u = 8 * (i & 7);
    if (u + 7 > t) {
      bf16* const x = sm.a + t * kLdC + u;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (u + e > t) x[e] = __float2bfloat16(0.f);
    }
  }
  __syncthreads();
  float acc[8][4];
  zero(acc);
  warp_mma<8, kC, true, true>(acc, sm.a + r0, kLdC, sm.dout + c0, kLdK, lane);
  __syncthreads();  // do is dead
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
      *reinterpret_cast<__nv_bfloat162*>(sm.dout + (r0 + g8 + 8 * hi) * kLdK + c0 + 8 * nt + 2 * t4) =
          __floats2bfloat162_rn(acc[nt][2 * hi], acc[nt][2 * hi + 1]);
  __syncthreads();
  bf16* const dv = static_cast<bf16*>(p.dv);
#pragma unroll
  for (int r = 0; r < kC * 16 / kDvThreads; ++r) {
    int const i = tid + kDvThreads * r, s = i >> 4, u = 8 * (i & 15);
    if (s < L) {
      *reinterpret_cast<uint4*>(dv + row(s) * kK + u) = *reinterpret_cast<uint4 const*>(sm.dout + s * kLdK + u);
    }
  }
}

}  // namespace fla_cula::kda_sm90
