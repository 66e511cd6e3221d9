// Launcher of state_gather: argument checks, choice of specialization, launch, error check.
#include "state_gather.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "../common/cuda_check.h"
#include "../common/static_switch.h"
#include "state_gather_kernel.cuh"

namespace fla_cula {

namespace {

// 256 threads x 4 vectors of 16 bytes = 16 KiB per CTA tile: enough bytes in flight per SM to
// saturate HBM with a few CTAs resident, small enough that a 64 KiB row (one 128x128 head) still
// spreads over 4 CTAs.
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxGridY = 65535;

template <class Vec, class Index>
void launch(StateGatherArgs const& a, int64_t row_vecs) {
  using Kernel = state_copy::StateGatherKernel<Vec, Index, kThreads, kUnroll>;
  int64_t const tiles = (row_vecs + Kernel::kTileVecs - 1) / Kernel::kTileVecs;
  FLA_CULA_REQUIRE(tiles <= kMaxGridY, "state_gather: row of " + std::to_string(a.row_elems) +
                                           " elements is too long (at most " +
                                           std::to_string(kMaxGridY * Kernel::kTileVecs * sizeof(Vec) / 4) + ")");
  typename Kernel::Params params{static_cast<Vec*>(a.dst), static_cast<Vec const*>(a.src),
                                 static_cast<Index const*>(a.idx), a.src_rows, row_vecs};
  dim3 grid(static_cast<unsigned>(a.n), static_cast<unsigned>(tiles));
  state_copy::state_gather_kernel<Kernel><<<grid, Kernel::kThreads, 0, static_cast<cudaStream_t>(a.stream)>>>(params);
  FLA_CULA_CHECK_LAUNCH("state_gather_kernel");
}

bool aligned16(void const* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

void state_gather(StateGatherArgs const& a) {
  FLA_CULA_REQUIRE(a.n >= 0, "state_gather: n must be >= 0, got " + std::to_string(a.n));
  FLA_CULA_REQUIRE(a.n <= INT32_MAX, "state_gather: n must be <= 2^31-1, got " + std::to_string(a.n));
  FLA_CULA_REQUIRE(a.row_elems >= 0, "state_gather: row_elems must be >= 0, got " + std::to_string(a.row_elems));
  FLA_CULA_REQUIRE(a.src_rows >= 0, "state_gather: src_rows must be >= 0, got " + std::to_string(a.src_rows));
  FLA_CULA_REQUIRE(a.idx_bytes == 4 || a.idx_bytes == 8,
                   "state_gather: idx_bytes must be 4 (int32) or 8 (int64), got " + std::to_string(a.idx_bytes));
  if (a.n == 0 || a.row_elems == 0) {
    return;
  }
  FLA_CULA_REQUIRE(a.dst != nullptr && a.idx != nullptr, "state_gather: dst and idx must not be null");
  FLA_CULA_REQUIRE(a.src != nullptr || a.src_rows == 0, "state_gather: src must not be null");
  FLA_CULA_REQUIRE((reinterpret_cast<uintptr_t>(a.idx) & (a.idx_bytes - 1)) == 0,
                   "state_gather: idx pointer is not aligned to its element size");
  FLA_CULA_REQUIRE((reinterpret_cast<uintptr_t>(a.dst) & 3u) == 0 && (reinterpret_cast<uintptr_t>(a.src) & 3u) == 0,
                   "state_gather: dst and src must be 4-byte aligned (float32)");

  bool const vec16 = a.row_elems % 4 == 0 && aligned16(a.dst) && aligned16(a.src);
  FLA_CULA_BOOL_SWITCH(vec16, kVec16, [&] {
    using Vec = std::conditional_t<kVec16, cute::uint128_t, float>;
    int64_t const row_vecs = a.row_elems / (sizeof(Vec) / sizeof(float));
    FLA_CULA_BOOL_SWITCH(a.idx_bytes == 8, kIdx64, [&] {
      using Index = std::conditional_t<kIdx64, int64_t, int32_t>;
      launch<Vec, Index>(a, row_vecs);
    });
  });
}

int cuda_build_version() { return CUDART_VERSION; }

}  // namespace fla_cula
