// The backward kernels' shared pieces: the chunk list (CTA chunk index c -> the chunk's first token row and length,
// kda_bwd.h) and the warp product over shared-memory tiles.
#pragma once

#include <cstdint>

#include "kda_sm90/kda_fwd_kernel.cuh"  // bf16, ldmatrix_x4(_trans), mma_bf16_16816

namespace fla_cula::kda_sm90 {

struct ChunkSpan {
  int64_t t0;  // token row of the chunk's first token in the flattened [B*T]
  int L;       // tokens in the chunk (64, or the sequence's tail)
};

// Fixed length: chunk c is chunk c % ceil(T / 64) of sequence c / ceil(T / 64). Varlen: chunk_indices[c] = (sequence n,
// chunk i of it) as FLA's prepare_chunk_indices lists them, n's rows from cu_seqlens.
template <class Params>
__device__ __forceinline__ ChunkSpan chunk_span(Params const& p, int64_t c) {
  int64_t bos, it, len;
  if (p.chunk_indices != nullptr) {
    auto at = [](void const* x, int64_t i, bool i64) {
      return i64 ? static_cast<int64_t const*>(x)[i] : int64_t(static_cast<int32_t const*>(x)[i]);
    };
    int64_t const n = at(p.chunk_indices, 2 * c, p.chunk_indices_int64);
    it = at(p.chunk_indices, 2 * c + 1, p.chunk_indices_int64);
    bos = at(p.cu_seqlens, n, p.cu_seqlens_int64);
    len = at(p.cu_seqlens, n + 1, p.cu_seqlens_int64) - bos;
  } else {
    int64_t const nt = (p.T + 63) / 64;
    it = c % nt;
    bos = c / nt * p.T;
    len = p.T;
  }
  return {bos + 64 * it, int(len - 64 * it < 64 ? len - 64 * it : 64)};
}

// acc[nt] += A[0:16][0:K] B[8 nt : 8 nt + 8][0:K]^T on the warp. A (m, k) at A[m lda + k], or A[k lda + m] with kAT;
// B (n, k) at B[n ldb + k], or B[k ldb + n] with kBT. Rows 16-byte aligned; C fragments as in warp_mma_tn.
template <int NT, int K, bool kAT, bool kBT>
__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], bf16 const* A, int lda, bf16 const* B, int ldb,
                                         int lane) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "two 8-column tiles per B load, 16-deep steps");
  int const i = lane >> 3, j = lane & 7;  // this lane addresses row j of 8 x 8 tile i
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4];  // tiles (m 0-7 | 8-15) x (k 0-7 | 8-15), m fastest
    if constexpr (kAT) {
      ldmatrix_x4_trans(a, A + (k0 + 8 * (i >> 1) + j) * lda + 8 * (i & 1));
    } else {
      ldmatrix_x4(a, A + (8 * (i & 1) + j) * lda + k0 + 8 * (i >> 1));
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];  // tiles (n 0-7 | 8-15) x (k 0-7 | 8-15), k fastest: b0, b1 of two 8-column tiles
      if constexpr (kBT) {
        ldmatrix_x4_trans(b, B + (k0 + 8 * (i & 1) + j) * ldb + 16 * np + 8 * (i >> 1));
      } else {
        ldmatrix_x4(b, B + (16 * np + 8 * (i >> 1) + j) * ldb + k0 + 8 * (i & 1));
      }
      mma_bf16_16816(acc[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
      mma_bf16_16816(acc[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
    }
  }
}

}  // namespace fla_cula::kda_sm90
