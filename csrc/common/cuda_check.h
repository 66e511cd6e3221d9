// Turning CUDA runtime failures into C++ exceptions that pybind11 maps to Python errors.
//
// std::runtime_error -> RuntimeError, std::invalid_argument -> ValueError (pybind11's default
// translators). Every CUDA runtime call in a launcher goes through FLA_CULA_CUDA_CHECK, and every
// kernel launch is followed by FLA_CULA_CHECK_LAUNCH, so a failure surfaces in Python with the CUDA
// error name and message instead of corrupting a later, unrelated call.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace fla_cula {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  std::string msg = std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                    ") at " + file + ":" + std::to_string(line);
  throw std::runtime_error(msg);
}

}  // namespace fla_cula

#define FLA_CULA_CUDA_CHECK(expr)                                          \
  do {                                                                     \
    cudaError_t fla_cula_err_ = (expr);                                    \
    if (fla_cula_err_ != cudaSuccess) {                                    \
      ::fla_cula::throw_cuda_error(fla_cula_err_, #expr, __FILE__, __LINE__); \
    }                                                                      \
  } while (0)

// After a <<<...>>> launch: configuration errors (bad grid, no kernel image for this device, no
// device at all) are reported by cudaGetLastError. Asynchronous faults are not waited for here:
// the launcher never synchronizes the stream.
#define FLA_CULA_CHECK_LAUNCH(kernel_name)                                 \
  do {                                                                     \
    cudaError_t fla_cula_err_ = cudaGetLastError();                        \
    if (fla_cula_err_ != cudaSuccess) {                                    \
      ::fla_cula::throw_cuda_error(fla_cula_err_, "launch of " kernel_name, __FILE__, __LINE__); \
    }                                                                      \
  } while (0)

#define FLA_CULA_REQUIRE(cond, msg)            \
  do {                                         \
    if (!(cond)) {                             \
      throw std::invalid_argument(msg);        \
    }                                          \
  } while (0)
