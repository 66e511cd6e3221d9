// Python binding of the varlen work list: tensors in (DLPack), checks, VarlenScheduleParams, launch
// on the caller's current stream of the tensors' device. Every check reads metadata only and runs
// before any CUDA call.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/dlpack_tensor.h"
#include "varlen_schedule/varlen_schedule.h"

namespace fla_cula {
namespace {

namespace py = pybind11;

void varlen_schedule_api(py::handle cu_seqlens_obj, py::handle chunk_indices_obj, py::handle num_chunks_obj,
                         py::handle chunk_offsets_obj, int64_t total_tokens, int64_t chunk_size) {
  TensorArg cu = tensor_arg(cu_seqlens_obj, "cu_seqlens");
  TensorArg indices = tensor_arg(chunk_indices_obj, "chunk_indices");
  TensorArg count = tensor_arg(num_chunks_obj, "num_chunks");
  TensorArg offsets = tensor_arg(chunk_offsets_obj, "chunk_offsets");

  if (chunk_size <= 0 || chunk_size > (int64_t(1) << 20)) {
    throw py::value_error("chunk_size: expected 1 <= chunk_size <= 2^20, got " + std::to_string(chunk_size));
  }
  if (total_tokens < 0 || total_tokens > INT32_MAX) {
    throw py::value_error("total_tokens: expected 0 <= total_tokens <= 2^31-1, got " + std::to_string(total_tokens));
  }

  expect_dtype(cu, {dtype::kInt32, dtype::kInt64});
  expect_ndim(cu, 1);
  if (cu.size(0) < 1) throw py::value_error("cu_seqlens: expected at least 1 entry (N+1 for N sequences), got 0");
  expect_contiguous(cu);
  int64_t const n = cu.size(0) - 1;
  if (n > kVarlenScheduleMaxSeqs) {
    throw py::value_error("cu_seqlens: expected at most " + std::to_string(kVarlenScheduleMaxSeqs) +
                          " sequences, got " + std::to_string(n));
  }
  int64_t const need = total_tokens / chunk_size + n;

  expect_dtype(indices, {dtype::kInt32});
  expect_ndim(indices, 2);
  if (indices.size(0) < need || indices.size(1) != 2 || indices.size(0) > INT32_MAX) {
    throw py::value_error("chunk_indices: expected shape (R, 2) with R >= total_tokens // chunk_size + N = " +
                          std::to_string(need) + ", got " + indices.shape_str());
  }
  expect_contiguous(indices);
  expect_aligned(indices, 8);  // one (sequence, chunk) pair is one 8-byte store
  expect_dtype(count, {dtype::kInt32});
  expect_shape(count, {}, "() (a scalar)");
  expect_dtype(offsets, {dtype::kInt32});
  expect_shape(offsets, {n + 1}, ("(" + std::to_string(n + 1) + ",) (N+1, as cu_seqlens)").c_str());
  expect_contiguous(offsets);

  expect_cuda(cu);
  expect_same_device(indices, cu);
  expect_same_device(count, cu);
  expect_same_device(offsets, cu);

  VarlenScheduleParams params{};
  params.cu_seqlens = cu.data;
  params.cu_seqlens_int64 = cu.dtype == dtype::kInt64;
  params.chunk_indices = indices.ptr<int32_t>();
  params.num_chunks = count.ptr<int32_t>();
  params.chunk_offsets = offsets.ptr<int32_t>();
  params.num_seqs = static_cast<int32_t>(n);
  params.max_chunks = static_cast<int32_t>(indices.size(0));
  params.total_tokens = static_cast<int32_t>(total_tokens);
  params.chunk_size = static_cast<int32_t>(chunk_size);
  params.device = cu.device.device_id;
  params.stream = current_stream(cu.device);
  py::gil_scoped_release release;
  run_varlen_schedule(params);
}

}  // namespace

void register_varlen_schedule(py::module_& m) {
  m.def("varlen_schedule", &varlen_schedule_api, py::arg("cu_seqlens"), py::arg("chunk_indices"),
        py::arg("num_chunks"), py::arg("chunk_offsets"), py::arg("total_tokens"), py::arg("chunk_size"),
        "Enqueue the chunk schedule of a packed batch on the current stream of cu_seqlens' device (see\n"
        "csrc/varlen_schedule/varlen_schedule.h): chunk_indices [R, 2] int32 longest sequence first, rows\n"
        "past num_chunks (-1, -1); num_chunks [] int32; chunk_offsets [N+1] int32. R >= T // C + N.\n"
        "TypeError / ValueError for bad arguments (before any CUDA call), RuntimeError for CUDA errors.\n"
        "Does not synchronize.");
  m.attr("VARLEN_SCHEDULE_MAX_SEQS") = kVarlenScheduleMaxSeqs;
}

}  // namespace fla_cula
