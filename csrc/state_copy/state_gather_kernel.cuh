// Device code for state_gather: dst[i, :] = src[idx[i], :] over rows of float32 recurrent state.
//
// One CTA copies one tile of one destination row: blockIdx.x is the destination row, blockIdx.y
// the tile within the row. A tile is kThreads * kUnroll vectors; thread t owns vectors
// t, t + kThreads, ... so each warp-wide load or store touches consecutive 16-byte words (fully
// coalesced) and every thread has kUnroll independent loads in flight before its first store.
// With Vec = 16-byte words this compiles to LDG.E.128 / STG.E.128; the 4-byte variant serves
// rows or pointers that are not 16-byte aligned.
//
// Rows whose index is negative (the serving engines' "padding slot") or >= src_rows are skipped:
// the destination row is left untouched and nothing out of bounds is read.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/device_kernel.h>  // CUTLASS_GRID_CONSTANT

namespace fla_cula::state_copy {

// Static specialization of the copy. Vec: the unit each thread moves (cute::uint128_t or float).
// Index: int32_t or int64_t. Everything else (number of rows, row length, pool size) is runtime.
template <class Vec_, class Index_, int kThreads_, int kUnroll_>
struct StateGatherKernel {
  using Vec = Vec_;
  using Index = Index_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kUnroll = kUnroll_;
  static constexpr int kTileVecs = kThreads * kUnroll;

  struct Params {
    Vec* dst;            // [n, row_vecs]
    Vec const* src;      // [src_rows, row_vecs]
    Index const* idx;    // [n]
    int64_t src_rows;
    int64_t row_vecs;    // row length in units of Vec
  };

  CUTE_DEVICE static void run(Params const& p) {
    using namespace cute;

    int64_t const row = blockIdx.x;
    // Every thread reads the same index: one broadcast transaction per warp.
    int64_t const src_row = static_cast<int64_t>(p.idx[row]);
    if (src_row < 0 || src_row >= p.src_rows) {
      return;
    }

    Tensor gSrc = make_tensor(make_gmem_ptr(p.src + src_row * p.row_vecs), make_layout(p.row_vecs));
    Tensor gDst = make_tensor(make_gmem_ptr(p.dst + row * p.row_vecs), make_layout(p.row_vecs));
    Tensor cRow = make_identity_tensor(make_shape(p.row_vecs));  // vector coordinates, for the residue

    auto tile = Shape<Int<kTileVecs>>{};
    Tensor tileSrc = local_tile(gSrc, tile, make_coord(blockIdx.y));  // (kTileVecs)
    Tensor tileDst = local_tile(gDst, tile, make_coord(blockIdx.y));
    Tensor tileCrd = local_tile(cRow, tile, make_coord(blockIdx.y));

    auto thr_layout = make_layout(Int<kThreads>{});
    Tensor thrSrc = local_partition(tileSrc, thr_layout, threadIdx.x);  // (kUnroll), stride kThreads
    Tensor thrDst = local_partition(tileDst, thr_layout, threadIdx.x);
    Tensor thrCrd = local_partition(tileCrd, thr_layout, threadIdx.x);

    Tensor pred = make_tensor<bool>(shape(thrCrd));
    CUTE_UNROLL
    for (int i = 0; i < size(pred); ++i) {
      pred(i) = get<0>(thrCrd(i)) < p.row_vecs;
    }

    Tensor frag = make_tensor<Vec>(shape(thrSrc));  // registers
    copy_if(pred, thrSrc, frag);                    // all kUnroll loads first ...
    copy_if(pred, frag, thrDst);                    // ... then the stores
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads) state_gather_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
  Kernel::run(params);
}

}  // namespace fla_cula::state_copy
