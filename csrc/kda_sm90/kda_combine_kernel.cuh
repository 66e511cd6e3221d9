// The exact sequence split's combine (docs/kda_sm90.md "Two kernels and the exact sequence split"), one launch for
// every segment boundary: for s = 1 .. P - 2, in order,
//   seg_H[s] <- seg_M[s - 1] seg_H[s - 1] + seg_H[s]      (128 x 128 fp32 per (sequence, value head), K-major)
// so that seg_H[s] becomes the state at the end of segment s. CTA = (sequence x value head, block of 8 state
// columns): the columns are independent, and 16 CTAs per pair fill the SMs at the small grids the split serves. The
// running 128 x 8 block X lives in shared memory. Each 128-term sum is cut in four quarters of 32 terms: warps 2q and
// 2q + 1 sum e in [32 q, 32 q + 32), thread u = t % 64 owning rows u / 2 + 32 i (i = 0 .. 3) and columns
// 4 (u % 2) .. + 3, 16 independent fp32 FMA chains fed by 8 16-byte shared loads per 4 terms; the four partial
// blocks meet in shared memory and thread t adds ((P0 + P1) + P2) + P3 + H for row t / 2, columns 4 (t % 2) .. + 3.
// The maps do not depend on the chain, so M_s is copied to shared memory (cp.async, two buffers) while step s runs on
// M_{s-1}; the 16 CTAs of a pair each copy the whole 64 KB map, and that copy bounds a step (profiled in
// docs/kda_sm90.md). Plain CUDA cores: 131K FMA per CTA and boundary.
#pragma once

#include <cstdint>

#include "kda_sm90/cp_async.cuh"

namespace fla_cula::kda_sm90 {

constexpr int kCombineThreads = 256;
constexpr int kCombineCols = 8;         // state columns per CTA
constexpr int kCombineQuarters = 4;     // partial sums per element, 32 terms each
constexpr int kCombineMStride = 132;    // floats per M row in shared memory: rows u / 2 of a warp hit 8 bank groups
constexpr int kCombineSmemBytes =       // X + the partial blocks + two M buffers
    ((1 + kCombineQuarters) * 128 * kCombineCols + 2 * 128 * kCombineMStride) * 4;

__global__ void __launch_bounds__(kCombineThreads) kda_combine_kernel(float* seg_H, float const* seg_M, int slots,
                                                                      int64_t pairs) {
  constexpr int kD = 128, kTerms = kD / kCombineQuarters;
  static_assert(kCombineThreads == 2 * kD && kCombineCols == 8, "thread maps below: 64 threads x 16 outputs a quarter");
  int64_t const pair = blockIdx.x / (kD / kCombineCols);
  int const col0 = (blockIdx.x % (kD / kCombineCols)) * kCombineCols;
  int const tid = threadIdx.x, q = tid >> 6, u = tid & 63, rq = u >> 1, cq = (u & 1) * 4;  // the products' map
  int const rr = tid >> 1, cr = (tid & 1) * 4;                                                // the sums' map
  int64_t const slot_stride = pairs * kD * kD;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // kCombineSmemBytes
  float (&X)[kD][kCombineCols] = *reinterpret_cast<float (*)[kD][kCombineCols]>(smem_raw);
  float (&Pq)[kCombineQuarters][kD][kCombineCols] =
      *reinterpret_cast<float (*)[kCombineQuarters][kD][kCombineCols]>(smem_raw + sizeof(X));
  float* const Mb = reinterpret_cast<float*>(smem_raw + sizeof(X) + sizeof(Pq));  // [2][kD][kCombineMStride]

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
    float* const h = seg_H + s * slot_stride + pair * kD * kD + col0 + cr + int64_t(rr) * kD;
    float4 const hv = *reinterpret_cast<float4 const*>(h);  // in flight during the products
    __syncthreads();  // M_{s-1} and the block X of step s - 1 are in shared memory
    float const* const m = Mb + ((s - 1) & 1) * kD * kCombineMStride + rq * kCombineMStride + q * kTerms;
    float acc[4][4] = {};
#pragma unroll 2
    for (int e = 0; e < kTerms; e += 4) {
      float4 a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<float4 const*>(m + 32 * i * kCombineMStride + e);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float4 const x = *reinterpret_cast<float4 const*>(&X[q * kTerms + e + k][cq]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float const ai = k == 0 ? a[i].x : k == 1 ? a[i].y : k == 2 ? a[i].z : a[i].w;
          acc[i][0] = fmaf(ai, x.x, acc[i][0]);
          acc[i][1] = fmaf(ai, x.y, acc[i][1]);
          acc[i][2] = fmaf(ai, x.z, acc[i][2]);
          acc[i][3] = fmaf(ai, x.w, acc[i][3]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      *reinterpret_cast<float4*>(&Pq[q][rq + 32 * i][cq]) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    }
    __syncthreads();  // every read of X (and of this M buffer) is done, the partial blocks are written
    float4 p[kCombineQuarters];
#pragma unroll
    for (int j = 0; j < kCombineQuarters; ++j) p[j] = *reinterpret_cast<float4 const*>(&Pq[j][rr][cr]);
    float4 out = p[0];
#pragma unroll
    for (int j = 1; j < kCombineQuarters; ++j) {
      out = make_float4(out.x + p[j].x, out.y + p[j].y, out.z + p[j].z, out.w + p[j].w);
    }
    out = make_float4(out.x + hv.x, out.y + hv.y, out.z + hv.z, out.w + hv.w);
    *reinterpret_cast<float4*>(&X[rr][cr]) = out;
    *reinterpret_cast<float4*>(h) = out;
  }
}

}  // namespace fla_cula::kda_sm90
