#include "common/dlpack_tensor.h"

#include <cstring>
#include <string>

namespace fla_cula {
namespace {

PyObject* g_tensor_type = nullptr;         // torch.Tensor (strong reference, kept for the process)
const DLPackExchangeAPI* g_api = nullptr;  // owned by torch, lives as long as the type

// "(a, b)", "(a,)", "()"; plain string appends (no iostreams: see expect_shape).
std::string join(int64_t const* v, int n) {
  std::string s = "(";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (n == 1 ? ",)" : ")");
}

std::string py_type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// Copy a DLTensor's metadata into `out`; false when it has more dimensions than we hold.
bool fill(DLTensor const& t, TensorArg& out) {
  if (t.ndim < 0 || t.ndim > kMaxTensorDims) return false;
  out.data = static_cast<char*>(t.data) + t.byte_offset;
  out.dtype = t.dtype;
  out.device = t.device;
  out.ndim = t.ndim;
  int64_t compact = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    out.shape[d] = t.shape[d];
    out.strides[d] = t.strides ? t.strides[d] : compact;
    compact *= t.shape[d];
  }
  return true;
}

// The __dlpack__ protocol: a capsule holding a DLManagedTensor(Versioned). We only read its
// metadata and leave the capsule unconsumed, so its destructor releases it.
bool from_capsule(py::handle obj, TensorArg& out, std::string& why) {
  try {
    py::object src = py::reinterpret_borrow<py::object>(obj);
    if (py::hasattr(src, "requires_grad") && py::hasattr(src, "detach") && src.attr("requires_grad").cast<bool>()) {
      src = src.attr("detach")();  // same storage; kernels read or write data, autograd is the caller's
    }
    py::object dlpack = src.attr("__dlpack__");
    py::object cap;
    try {
      cap = dlpack(py::arg("stream") = -1, py::arg("max_version") = py::make_tuple(DLPACK_MAJOR_VERSION, 0));
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) throw;
      cap = dlpack(py::arg("stream") = -1);  // a producer older than DLPack 1.0
    }
    PyObject* c = cap.ptr();
    if (PyCapsule_IsValid(c, "dltensor_versioned")) {
      auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
      if (m->version.major != DLPACK_MAJOR_VERSION) {
        why = "DLPack major version " + std::to_string(m->version.major) + ", expected " +
              std::to_string(DLPACK_MAJOR_VERSION);
        return false;
      }
      if (!fill(m->dl_tensor, out)) why = "more than " + std::to_string(kMaxTensorDims) + " dimensions";
      return why.empty();
    }
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      if (!fill(m->dl_tensor, out)) why = "more than " + std::to_string(kMaxTensorDims) + " dimensions";
      return why.empty();
    }
    why = "__dlpack__ returned no DLPack capsule";
  } catch (py::error_already_set& e) {
    why = std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value()));
  }
  return false;
}

}  // namespace

std::string dtype_name(DLDataType t) {
  std::string base;
  switch (t.code) {
    case kDLInt: base = "int" + std::to_string(t.bits); break;
    case kDLUInt: base = "uint" + std::to_string(t.bits); break;
    case kDLFloat: base = "float" + std::to_string(t.bits); break;
    case kDLBfloat: base = "bfloat" + std::to_string(t.bits); break;
    case kDLBool: base = "bool"; break;
    case kDLComplex: base = "complex" + std::to_string(t.bits); break;
    case kDLFloat8_e4m3fn: base = "float8_e4m3fn"; break;
    case kDLFloat8_e5m2: base = "float8_e5m2"; break;
    default: base = "dtype(code=" + std::to_string(t.code) + ", bits=" + std::to_string(t.bits) + ")";
  }
  return t.lanes == 1 ? base : base + "x" + std::to_string(t.lanes);
}

std::string device_name(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed";
    case kDLROCM: return "rocm:" + std::to_string(d.device_id);
    default: return "device_type " + std::to_string(int(d.device_type)) + ":" + std::to_string(d.device_id);
  }
}

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorArg::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorArg::shape_str() const { return join(shape, ndim); }
std::string TensorArg::strides_str() const { return join(strides, ndim); }

std::string bind_exchange_api(PyObject* tensor_type) {
  if (g_api != nullptr && tensor_type == g_tensor_type) return "";
  PyObject* cap = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
  if (cap == nullptr) {
    PyErr_Clear();
    return "torch.Tensor has no __dlpack_c_exchange_api__ (torch older than 2.10)";
  }
  void* p = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
  Py_DECREF(cap);  // the type keeps the capsule (and torch the struct) alive
  if (p == nullptr) {
    PyErr_Clear();
    return "__dlpack_c_exchange_api__ is not a 'dlpack_exchange_api' capsule";
  }
  auto* api = static_cast<const DLPackExchangeAPI*>(p);
  const DLPackVersion v = api->header.version;
  if (v.major != DLPACK_MAJOR_VERSION || v.minor < 2 || api->dltensor_from_py_object_no_sync == nullptr ||
      api->current_work_stream == nullptr) {
    return "DLPack exchange API " + std::to_string(v.major) + "." + std::to_string(v.minor) +
           ": need 1.x, x >= 2, with dltensor_from_py_object_no_sync and current_work_stream";
  }
  Py_INCREF(tensor_type);
  Py_XDECREF(g_tensor_type);
  g_tensor_type = tensor_type;
  g_api = api;
  return "";
}

bool exchange_api_bound() { return g_api != nullptr; }
const DLPackExchangeAPI* exchange_api() { return g_api; }
PyObject* exchange_tensor_type() { return g_tensor_type; }

TensorArg tensor_arg(py::handle obj, const char* name) {
  TensorArg out;
  out.name = name;
  if (g_api != nullptr && PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(g_tensor_type))) {
    DLTensor t;
    if (g_api->dltensor_from_py_object_no_sync(obj.ptr(), &t) == 0 && fill(t, out)) return out;
    PyErr_Clear();  // refused (a meta tensor, ...): try the protocol, which says why
  }
  if (!py::hasattr(obj, "__dlpack__")) {
    throw py::type_error(std::string(name) + ": expected a tensor (DLPack), got " + py_type_name(obj));
  }
  std::string why;
  if (!from_capsule(obj, out, why)) {
    throw py::type_error(std::string(name) + ": cannot read this " + py_type_name(obj) + " as DLPack: " + why);
  }
  return out;
}

void* current_stream(DLDevice device) {
  if (device.device_type != kDLCUDA) return nullptr;
  if (g_api != nullptr) {
    void* stream = nullptr;
    if (g_api->current_work_stream(kDLCUDA, device.device_id, &stream) != 0) throw py::error_already_set();
    return stream;
  }
  py::object s = py::module_::import("torch.cuda").attr("current_stream")(device.device_id);
  return reinterpret_cast<void*>(s.attr("cuda_stream").cast<uintptr_t>());
}

void expect_dtype(TensorArg const& t, std::initializer_list<DLDataType> allowed) {
  for (DLDataType a : allowed) {
    if (t.dtype == a) return;
  }
  std::string names;
  for (DLDataType a : allowed) names += (names.empty() ? "" : " or ") + dtype_name(a);
  throw py::type_error(std::string(t.name) + ": expected dtype " + names + ", got " + dtype_name(t.dtype));
}

void expect_ndim(TensorArg const& t, int ndim) {
  if (t.ndim != ndim) {
    throw py::value_error(std::string(t.name) + ": expected a " + std::to_string(ndim) + "-D tensor, got shape " +
                          t.shape_str());
  }
}

void expect_shape(TensorArg const& t, std::initializer_list<int64_t> shape, const char* what) {
  bool ok = t.ndim == int(shape.size());
  int d = 0;
  for (int64_t s : shape) {
    if (ok && s >= 0 && t.shape[d] != s) ok = false;
    ++d;
  }
  if (ok) return;
  // Messages are built by string appends, not std::ostringstream: on the H200 image (torch 2.11) the
  // error paths that formatted shapes through iostreams crashed the process (6 tests of
  // test_abi_errors_name_expected_and_actual, 2026-12-03) while those using std::to_string did not.
  std::string expected;
  if (what != nullptr) {
    expected = what;
  } else {
    expected = "(";
    int i = 0;
    for (int64_t v : shape) expected += (i++ ? ", " : "") + (v < 0 ? std::string("*") : std::to_string(v));
    expected += shape.size() == 1 ? ",)" : ")";
  }
  throw py::value_error(std::string(t.name) + ": expected shape " + expected + ", got " + t.shape_str());
}

void expect_contiguous(TensorArg const& t) {
  if (!t.is_contiguous()) {
    throw py::value_error(std::string(t.name) + ": expected a contiguous tensor, got shape " + t.shape_str() +
                          " strides " + t.strides_str());
  }
}

void expect_inner_stride(TensorArg const& t, int64_t stride) {
  if (t.ndim == 0 || t.shape[t.ndim - 1] == 1) return;
  if (t.strides[t.ndim - 1] != stride) {
    throw py::value_error(std::string(t.name) + ": expected stride " + std::to_string(stride) +
                          " in the last dimension, got strides " + t.strides_str() + " (shape " + t.shape_str() + ")");
  }
}

void expect_aligned(TensorArg const& t, int bytes) {
  auto const addr = reinterpret_cast<uintptr_t>(t.data);
  if (addr % uintptr_t(bytes) != 0) {
    throw py::value_error(std::string(t.name) + ": expected a " + std::to_string(bytes) +
                          "-byte aligned data pointer, got address % " + std::to_string(bytes) + " == " +
                          std::to_string(addr % uintptr_t(bytes)));
  }
}

void expect_cuda(TensorArg const& t) {
  if (!t.is_cuda()) {
    throw py::value_error(std::string(t.name) + ": expected a CUDA tensor, got " + device_name(t.device));
  }
}

void expect_same_device(TensorArg const& t, TensorArg const& ref) {
  if (t.device.device_type != ref.device.device_type || t.device.device_id != ref.device.device_id) {
    throw py::value_error(std::string(t.name) + ": expected a tensor on " + device_name(ref.device) + " (as " +
                          ref.name + "), got " + device_name(t.device));
  }
}

}  // namespace fla_cula
