// Host interface of state_gather. Plain C++ (no CUDA headers), so the pybind11 binding compiles
// with the host compiler alone; the implementation lives in state_gather.cu.
#pragma once

#include <cstdint>

namespace fla_cula {

struct StateGatherArgs {
  void* dst;             // float32 [n, row_elems], device memory
  void const* src;       // float32 [src_rows, row_elems], device memory, must not overlap dst
  void const* idx;       // int32 or int64 [n], device memory
  int idx_bytes;         // 4 or 8
  int64_t n;             // destination rows
  int64_t src_rows;      // rows in the pool; indices outside [0, src_rows) are skipped
  int64_t row_elems;     // float32 elements per row
  void* stream;          // cudaStream_t of the caller (0: legacy default stream)
};

// Enqueues dst[i] = src[idx[i]] on args.stream; never synchronizes.
// Throws std::invalid_argument for bad arguments, std::runtime_error for CUDA failures.
void state_gather(StateGatherArgs const& args);

// CUDART_VERSION the launchers were compiled against (e.g. 13000).
int cuda_build_version();

}  // namespace fla_cula
