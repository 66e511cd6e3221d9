// The signature of a call's arguments (fla_cula.routing.signature), read in C++.
//
// The host side of a decode step memoizes its routing decision per signature: for every torch
// tensor argument its dtype, device, address modulo 16, shape and strides. Read from Python
// that is five attribute calls per tensor (~11 us for a KDA call on the H200's host); here each
// tensor is one call into torch's DLPack C exchange API, bound once by
// fla_cula::bind_exchange_api (common/dlpack_tensor.h).
#pragma once

#include <Python.h>

namespace fla_cula {

// A new tuple: `args` with every tensor replaced by a bytes object of its metadata (int64 words:
// dtype code|bits<<8|lanes<<16, device type<<32|id, address % 16, ndim, shape..., strides...),
// any other item as it is. A tensor the API refuses (one that requires grad, a meta tensor) is
// replaced by slow(tensor) instead. Call only after bind_exchange_api succeeded (until then tensors
// pass through unchanged). nullptr with a Python error set on failure.
PyObject* call_signature(PyObject* args, PyObject* slow);

}  // namespace fla_cula
