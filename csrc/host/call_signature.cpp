#include "host/call_signature.h"

#include <cstdint>
#include <cstring>

#include <dlpack/dlpack.h>

namespace fla_cula {
namespace {

PyObject* g_tensor_type = nullptr;            // torch.Tensor (strong reference, kept for the process)
const DLPackExchangeAPI* g_api = nullptr;     // owned by torch, lives as long as the type

constexpr int kMaxDims = 8;

// Pack one tensor's metadata; false (Python error cleared) when the API cannot read it.
bool pack_tensor(PyObject* obj, int64_t* w, Py_ssize_t* n) {
  DLTensor t;
  if (g_api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
    PyErr_Clear();
    return false;
  }
  if (t.ndim < 0 || t.ndim > kMaxDims) return false;
  w[0] = int64_t(t.dtype.code) | (int64_t(t.dtype.bits) << 8) | (int64_t(t.dtype.lanes) << 16);
  w[1] = (int64_t(t.device.device_type) << 32) | int64_t(uint32_t(t.device.device_id));
  w[2] = int64_t((reinterpret_cast<uintptr_t>(t.data) + t.byte_offset) & 15);
  w[3] = t.ndim;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {  // strides == nullptr: compact row-major
    w[4 + d] = t.shape[d];
    w[4 + t.ndim + d] = t.strides ? t.strides[d] : stride;
    stride *= t.shape[d];
  }
  *n = 4 + 2 * t.ndim;
  return true;
}

}  // namespace

std::string init_call_signature(PyObject* tensor_type) {
  PyObject* cap = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
  if (cap == nullptr) {
    PyErr_Clear();
    return "torch.Tensor has no __dlpack_c_exchange_api__ (torch too old)";
  }
  void* p = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
  Py_DECREF(cap);  // the type keeps the capsule (and torch the struct) alive
  if (p == nullptr) {
    PyErr_Clear();
    return "__dlpack_c_exchange_api__ is not a 'dlpack_exchange_api' capsule";
  }
  auto* api = static_cast<const DLPackExchangeAPI*>(p);
  const DLPackVersion v = api->header.version;
  if (v.major != DLPACK_MAJOR_VERSION || v.minor < 2 || api->dltensor_from_py_object_no_sync == nullptr) {
    return "DLPack exchange API " + std::to_string(v.major) + "." + std::to_string(v.minor) +
           ": need 1.x, x >= 2, with dltensor_from_py_object_no_sync";
  }
  Py_INCREF(tensor_type);
  Py_XDECREF(g_tensor_type);
  g_tensor_type = tensor_type;
  g_api = api;
  return "";
}

PyObject* call_signature(PyObject* args, PyObject* slow) {
  if (!PyTuple_Check(args)) {
    PyErr_SetString(PyExc_TypeError, "call_signature: expected a tuple");
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  int64_t words[4 + 2 * kMaxDims];
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(args, i);
    PyObject* item;
    if (g_api != nullptr && PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(g_tensor_type))) {
      Py_ssize_t nw = 0;
      item = pack_tensor(x, words, &nw)
                 ? PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words), nw * Py_ssize_t(sizeof(int64_t)))
                 : PyObject_CallOneArg(slow, x);
      if (item == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
    } else {
      Py_INCREF(x);
      item = x;
    }
    PyTuple_SET_ITEM(out, i, item);
  }
  return out;
}

}  // namespace fla_cula
