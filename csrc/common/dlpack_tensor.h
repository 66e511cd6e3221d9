// The kernel ABI of fla_cula._C: Python tensors in, checked views out.
//
// A binding receives each tensor argument as a Python object (a torch.Tensor, or anything with
// `__dlpack__`) and turns it into a TensorArg: data pointer, dtype, device, shape and strides (in
// elements), copied out of the DLPack view, so nothing is borrowed past the call. The fast path is
// the producer's DLPack C exchange API (`torch.Tensor.__dlpack_c_exchange_api__`, DLPack >= 1.2:
// `dltensor_from_py_object_no_sync` fills a DLTensor on the stack, ~50 ns, no allocation, no sync);
// a tensor it refuses or a producer without it (torch < 2.10) goes through `__dlpack__(stream=-1)`
// (a capsule, no synchronization), detaching a tensor that requires grad first.
//
// The expect_* helpers check one property each and raise TypeError (wrong kind or dtype) or
// ValueError (shape, strides, device, alignment) naming the argument, the expectation and what was
// passed: "cu_seqlens: expected dtype int32 or int64, got float32". They read metadata only, so a
// binding runs every check before any CUDA call: the errors are the same (and testable) on a
// machine without a GPU. The device is the last check: a CPU tensor of the right dtype and shape
// gets "x: expected a CUDA tensor, got cpu".
//
// A binding then fills its kernel family's Params struct (plain C++, see e.g.
// varlen_schedule/varlen_schedule.h) with the pointers and sizes, takes the stream from
// current_stream(device) (the caller's current stream of that device) and calls the launcher.
// Host code only: no CUDA headers here.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <dlpack/dlpack.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace fla_cula {

namespace py = pybind11;

constexpr int kMaxTensorDims = 8;

// DLPack dtypes by name, for expect_dtype.
namespace dtype {
constexpr DLDataType kUInt8{kDLUInt, 8, 1};
constexpr DLDataType kInt32{kDLInt, 32, 1};
constexpr DLDataType kInt64{kDLInt, 64, 1};
constexpr DLDataType kFloat16{kDLFloat, 16, 1};
constexpr DLDataType kBFloat16{kDLBfloat, 16, 1};
constexpr DLDataType kFloat32{kDLFloat, 32, 1};
}  // namespace dtype

inline bool operator==(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}
inline bool operator!=(DLDataType a, DLDataType b) { return !(a == b); }

std::string dtype_name(DLDataType t);   // "int32", "bfloat16", "float8_e4m3fn", ...
std::string device_name(DLDevice d);    // "cpu", "cuda:0", ...

// A checked, non-owning view of one tensor argument, valid while the caller holds the tensor.
struct TensorArg {
  const char* name = "";          // the argument's name, for error messages
  void* data = nullptr;           // first element (byte_offset applied)
  DLDataType dtype{};
  DLDevice device{};
  int ndim = 0;
  int64_t shape[kMaxTensorDims] = {};
  int64_t strides[kMaxTensorDims] = {};  // in elements; compact row-major when the producer gave none

  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t stride(int d) const { return strides[d < 0 ? d + ndim : d]; }
  int64_t numel() const;
  int itemsize() const { return (dtype.bits * dtype.lanes + 7) / 8; }
  bool is_contiguous() const;   // row-major compact (size-1 dimensions may have any stride)
  bool is_cuda() const { return device.device_type == kDLCUDA; }
  std::string shape_str() const;    // "(3, 1)"
  std::string strides_str() const;  // "(1, 1)"
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// Bind the DLPack C exchange API of `tensor_type` (torch.Tensor), once per process. "" on success,
// else why it cannot be used (then every tensor goes through __dlpack__). Safe to call again.
std::string bind_exchange_api(PyObject* tensor_type);
bool exchange_api_bound();
const DLPackExchangeAPI* exchange_api();  // nullptr until bound
PyObject* exchange_tensor_type();         // the bound type (borrowed), nullptr until bound

// Read `obj` as a tensor. TypeError when it is not one ("x: expected a tensor (DLPack), got list").
TensorArg tensor_arg(py::handle obj, const char* name);

// The caller's current stream on `device` (cudaStream_t as void*; nullptr: the legacy default
// stream): the producer's current_work_stream, else torch.cuda.current_stream(i).cuda_stream.
void* current_stream(DLDevice device);

// Checks. Each throws py::type_error / py::value_error naming t.name, the expectation and the value.
void expect_dtype(TensorArg const& t, std::initializer_list<DLDataType> allowed);   // TypeError
void expect_ndim(TensorArg const& t, int ndim);                                      // "expected a 1-D tensor"
// Exact shape; -1 in `shape` accepts any size there. "x: expected shape (N, 2), got (4, 3)" uses
// `what` (e.g. "(N+1,)") when given, else the numbers.
void expect_shape(TensorArg const& t, std::initializer_list<int64_t> shape, const char* what = nullptr);
void expect_contiguous(TensorArg const& t);
void expect_inner_stride(TensorArg const& t, int64_t stride = 1);  // stride of the last dimension
void expect_aligned(TensorArg const& t, int bytes);                 // data pointer % bytes == 0
void expect_cuda(TensorArg const& t);                               // "x: expected a CUDA tensor, got cpu"
void expect_same_device(TensorArg const& t, TensorArg const& ref);  // "y: expected cuda:0 (as x), got cuda:1"

}  // namespace fla_cula
