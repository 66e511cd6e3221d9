// The exact sequence split's combine (docs/kda_sm90.md "Two kernels and the exact sequence split"), one launch for
// every segment boundary: for s = 1 .. P - 2, in order,
//   seg_H[s] <- seg_M[s - 1] seg_H[s - 1] + seg_H[s]      (128 x 128 fp32 per (sequence, value head), K-major)
// so that seg_H[s] becomes the state at the end of segment s. CTA = (sequence x value head, block of 16 state
// columns): the columns are independent. The running 128 x 16 block lives in shared memory; thread = (row d, 8
// columns) sums its products over e = 0 .. 127 in order with fp32 FMAs (M's rows come from L2: the 8 column blocks
// of a pair read the same M), then adds H. Plain CUDA cores: 262K FMA per CTA and boundary.
#pragma once

#include <cstdint>

namespace fla_cula::kda_sm90 {

constexpr int kCombineThreads = 256;
constexpr int kCombineCols = 16;  // state columns per CTA
constexpr int kCombineSmemBytes = 128 * kCombineCols * 4;  // the running block, fp32 (dynamic shared memory)

__global__ void __launch_bounds__(kCombineThreads) kda_combine_kernel(float* seg_H, float const* seg_M, int slots,
                                                                      int64_t pairs) {
  constexpr int kD = 128;
  int64_t const pair = blockIdx.x / (kD / kCombineCols);
  int const col0 = (blockIdx.x % (kD / kCombineCols)) * kCombineCols;
  int const tid = threadIdx.x, d = tid >> 1, c0 = (tid & 1) * 8;
  int64_t const slot_stride = pairs * kD * kD;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // kCombineSmemBytes
  float (&X)[kD][kCombineCols] = *reinterpret_cast<float (*)[kD][kCombineCols]>(smem_raw);
  float* const h0 = seg_H + pair * kD * kD + col0;
  for (int i = tid; i < kD * kCombineCols; i += kCombineThreads) {
    X[i / kCombineCols][i % kCombineCols] = h0[(i / kCombineCols) * kD + i % kCombineCols];
  }
  __syncthreads();
  for (int s = 1; s < slots; ++s) {
    float const* const m = seg_M + (s - 1) * slot_stride + pair * kD * kD + int64_t(d) * kD;
    float* const h = seg_H + s * slot_stride + pair * kD * kD + int64_t(d) * kD + col0 + c0;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int e = 0; e < kD; e += 4) {
      float4 const mv = *reinterpret_cast<float4 const*>(m + e);
      float const me[4] = {mv.x, mv.y, mv.z, mv.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(me[k], X[e + k][c0 + j], acc[j]);
      }
    }
    __syncthreads();  // every read of the previous block is done
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float const v = acc[j] + h[j];
      X[d][c0 + j] = v;
      h[j] = v;
    }
    __syncthreads();
  }
}

}  // namespace fla_cula::kda_sm90
