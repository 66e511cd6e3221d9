// The backward kernels' chunk list: CTA chunk index c -> the chunk's first token row and length (kda_bwd.h).
#pragma once

#include <cstdint>

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

}  // namespace fla_cula::kda_sm90
