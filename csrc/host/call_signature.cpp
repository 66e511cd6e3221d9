#include "host/call_signature.h"

#include <cstdint>

#include "common/dlpack_tensor.h"

namespace fla_cula {
namespace {

constexpr int kMaxDims = 8;

// Pack one tensor's metadata; false (Python error cleared) when the API cannot read it.
bool pack_tensor(const DLPackExchangeAPI* api, PyObject* obj, int64_t* w, Py_ssize_t* n) {
  DLTensor t;
  if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
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

PyObject* call_signature(PyObject* args, PyObject* slow) {
  if (!PyTuple_Check(args)) {
    PyErr_SetString(PyExc_TypeError, "call_signature: expected a tuple");
    return nullptr;
  }
  const DLPackExchangeAPI* api = exchange_api();
  PyObject* tensor_type = exchange_tensor_type();
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  int64_t words[4 + 2 * kMaxDims];
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(args, i);
    PyObject* item;
    if (api != nullptr && PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(tensor_type))) {
      Py_ssize_t nw = 0;
      item = pack_tensor(api, x, words, &nw)
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
