// The signature of a call's arguments (fla_cula.routing.signature), read in C++.
//
// The host side of a decode step memoizes its routing decision per signature: for every torch
// tensor argument its dtype, device, address modulo 16, shape and strides. Read from Python
// that is five attribute calls per tensor (~11 us for a KDA call on the H200's host); here each
// tensor is one call into torch's DLPack C exchange API (`torch.Tensor.__dlpack_c_exchange_api__`,
// DLPack >= 1.2: `dltensor_from_py_object_no_sync` fills a DLTensor view, no allocation, no sync).
// Built only when a DLPack header with that API is found (setup.py defines FLA_CULA_HAVE_DLPACK).
#pragma once

#include <Python.h>

#include <string>

namespace fla_cula {

// Bind the exchange API of `tensor_type` (torch.Tensor). "" on success, else why not.
std::string init_call_signature(PyObject* tensor_type);

// A new tuple: `args` with every tensor replaced by a bytes object of its metadata (int64 words:
// dtype code|bits<<8|lanes<<16, device type<<32|id, address % 16, ndim, shape..., strides...),
// any other item as it is. A tensor the API refuses (one that requires grad, a meta tensor) is
// replaced by slow(tensor) instead. nullptr with a Python error set on failure.
PyObject* call_signature(PyObject* args, PyObject* slow);

}  // namespace fla_cula
