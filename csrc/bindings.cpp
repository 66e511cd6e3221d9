// pybind11 module fla_cula._C. Torch-free on purpose: tensors arrive as raw device pointers
// (tensor.data_ptr()), sizes as integers and the stream as torch.cuda.current_stream().cuda_stream,
// so one build serves every torch version. Validation of tensors happens in fla_cula/_ext.py;
// the launchers re-check what they rely on and raise ValueError / RuntimeError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "state_copy/state_gather.h"
#ifdef FLA_CULA_HAVE_DLPACK
#include "host/call_signature.h"
#endif

#ifndef FLA_CULA_VERSION
#error "FLA_CULA_VERSION must be defined by the build (setup.py)"
#endif
#ifndef FLA_CULA_BUILT_ARCH
#error "FLA_CULA_BUILT_ARCH must be defined by the build (setup.py)"
#endif

namespace py = pybind11;

// Bumped whenever a function's signature or semantics changes; fla_cula/_ext.py refuses a stale build.
constexpr int kApiVersion = 2;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fla_cula CUDA C++ kernels (sm_90a), torch-free pybind11 bindings";

  m.def(
      "state_gather",
      [](uintptr_t dst_ptr, uintptr_t src_ptr, uintptr_t idx_ptr, int64_t n, int64_t src_rows, int64_t row_elems,
         int idx_bytes, uintptr_t stream) {
        fla_cula::StateGatherArgs args{reinterpret_cast<void*>(dst_ptr), reinterpret_cast<void const*>(src_ptr),
                                       reinterpret_cast<void const*>(idx_ptr), idx_bytes, n, src_rows, row_elems,
                                       reinterpret_cast<void*>(stream)};
        fla_cula::state_gather(args);
      },
      py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("idx_ptr"), py::arg("n"), py::arg("src_rows"),
      py::arg("row_elems"), py::arg("idx_bytes"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
      "Enqueue dst[i, :] = src[idx[i], :] (float32 rows) on `stream`; rows with idx outside [0, src_rows) are\n"
      "left untouched. Raises ValueError for bad arguments, RuntimeError for CUDA errors. Does not synchronize.");

#ifdef FLA_CULA_HAVE_DLPACK
  m.def(
      "init_call_signature", [](py::object tensor_type) { return fla_cula::init_call_signature(tensor_type.ptr()); },
      py::arg("tensor_type"),
      "Bind torch's DLPack C exchange API (tensor_type = torch.Tensor); returns '' or why it cannot be used.");
  m.def(
      "call_signature",
      [](py::object args, py::object slow) {
        PyObject* r = fla_cula::call_signature(args.ptr(), slow.ptr());
        if (r == nullptr) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(r);
      },
      py::arg("args"), py::arg("slow"),
      "fla_cula.routing.signature(args): each tensor's dtype, device, address % 16, shape and strides as\n"
      "bytes, other items as they are; slow(tensor) for a tensor the exchange API refuses.");
#endif
  m.def("version", [] { return std::string(FLA_CULA_VERSION); }, "fla_cula version this module was built from.");
  m.def("built_arch", [] { return std::string(FLA_CULA_BUILT_ARCH); }, "GPU architecture of the device code.");
  m.def("api_version", [] { return kApiVersion; }, "Version of this module's function signatures.");
  m.def(
      "cuda_version",
      [] {
        int v = fla_cula::cuda_build_version();
        return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
      },
      "CUDA runtime version the kernels were compiled against (statically linked).");
}
