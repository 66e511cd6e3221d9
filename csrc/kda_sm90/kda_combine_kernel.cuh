// The exact sequence split's combine (docs/kda_sm90.md "Two kernels and the exact sequence split"), one launch for
// every segment boundary: for s = 1 .. P - 2, in order,
//   seg_H[s] <- seg_M[s - 1] seg_H[s - 1] + seg_H[s]      (128 x 128 fp32 per (sequence, value head), K-major)
// so that seg_H[s] becomes the state at the end of segment s. CTA = (sequence x value head, block of 8 state
// columns): the columns are independent, and 16 CTAs per pair fill the SMs at the small grids the split serves. The
// running 128 x 8 block X lives in shared memory; thread t owns rows r = t / 4 and r + 64 and columns 2 (t % 4), + 1
// of it, and sums its products over e = 0 .. 127 in order with fp32 FMAs, then adds H. The maps do not depend on
// the chain, so M_s is copied to shared memory (cp.async, two buffers) while step s runs on M_{s-1}: the steps wait
// on shared memory, not on L2. Plain CUDA cores: 131K FMA per CTA and boundary.
#pragma once

#include <cstdint>

#include "kda_sm90/cp_async.cuh"

namespace fla_cula::kda_sm90 {

constexpr int kCombineThreads = 256;
constexpr int kCombineCols = 8;         // state columns per CTA
constexpr int kCombineMStride = 132;    // floats per M row in shared memory: 4 consecutive rows hit 4 bank groups
constexpr int kCombineSmemBytes = (128 * kCombineCols + 2 * 128 * kCombineMStride) * 4;  // X + two M buffers

__global__ void __launch_bounds__(kCombineThreads) kda_combine_kernel(float* seg_H, float const* seg_M, int slots,
                                                                      int64_t pairs) {
  constexpr int kD = 128;
  int64_t const pair = blockIdx.x / (kD / kCombineCols);
  int const col0 = (blockIdx.x % (kD / kCombineCols)) * kCombineCols;
  int const tid = threadIdx.x, r = tid >> 2, c = (tid & 3) * 2;
  int64_t const slot_stride = pairs * kD * kD;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // kCombineSmemBytes
  float (&X)[kD][kCombineCols] = *reinterpret_cast<float (*)[kD][kCombineCols]>(smem_raw);
  float* const Mb = reinterpret_cast<float*>(smem_raw) + kD * kCombineCols;  // [2][kD][kCombineMStride]

  // seg_M[m] of this pair -> buffer m & 1 (one commit group)
  auto issue_m = [&](int m) {
    float const* const src = seg_M + m * slot_stride + pair * kD * kD;
    float* const dst = Mb + (m & 1) * kD * kCombineMStride;
    for (int i = tid; i < kD * kD / 4; i += kCombineThreads) {
      cp_async16(dst + (i >> 5) * kCombineMStride + (i & 31) * 4, src + 4 * i, true);
    }
    cp_async_commit();
  };
  if (slots > 1) issue_m(0);
  float* const h0 = seg_H + pair * kD * kD + col0;
  for (int i = tid; i < kD * kCombineCols; i += kCombineThreads) {
    X[i / kCombineCols][i % kCombineCols] = h0[(i / kCombineCols) * kD + i % kCombineCols];
  }
  for (int s = 1; s < slots; ++s) {
    if (s + 1 < slots) {
      issue_m(s);  // buffer s & 1: last read in step s - 1, before its closing barrier
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_group<0>();
    }
    float* const h = seg_H + s * slot_stride + pair * kD * kD + col0 + c;
    float2 const h_lo = *reinterpret_cast<float2 const*>(h + int64_t(r) * kD);  // in flight during the products
    float2 const h_hi = *reinterpret_cast<float2 const*>(h + int64_t(r + 64) * kD);
    __syncthreads();  // M_{s-1} and the block X of step s - 1 are in shared memory
    float const* const m_lo = Mb + ((s - 1) & 1) * kD * kCombineMStride + r * kCombineMStride;
    float const* const m_hi = m_lo + 64 * kCombineMStride;
    float lo[2] = {0.f, 0.f}, hi[2] = {0.f, 0.f};
#pragma unroll 4
    for (int e = 0; e < kD; e += 4) {
      float4 const a = *reinterpret_cast<float4 const*>(m_lo + e);
      float4 const b = *reinterpret_cast<float4 const*>(m_hi + e);
      float const ae[4] = {a.x, a.y, a.z, a.w}, be[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float2 const x = *reinterpret_cast<float2 const*>(&X[e + k][c]);
        float const xe[2] = {x.x, x.y};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          lo[j] = fmaf(ae[k], xe[j], lo[j]);
          hi[j] = fmaf(be[k], xe[j], hi[j]);
        }
      }
    }
    __syncthreads();  // every read of X (and of this M buffer) is done
    float2 const out_lo = make_float2(lo[0] + h_lo.x, lo[1] + h_lo.y);
    float2 const out_hi = make_float2(hi[0] + h_hi.x, hi[1] + h_hi.y);
    *reinterpret_cast<float2*>(&X[r][c]) = out_lo;
    *reinterpret_cast<float2*>(&X[r + 64][c]) = out_hi;
    *reinterpret_cast<float2*>(h + int64_t(r) * kD) = out_lo;
    *reinterpret_cast<float2*>(h + int64_t(r + 64) * kD) = out_hi;
  }
}

}  // namespace fla_cula::kda_sm90
