// Turning CUDA runtime failures into C++ exceptions that pybind11 maps to Python errors.
//
// std::runtime_error -> RuntimeError, std::invalid_argument -> ValueError (pybind11's default
// translators). Every CUDA runtime call in a launcher goes through FLA_CULA_CUDA_CHECK, and every
// kernel launch is followed by FLA_CULA_CHECK_LAUNCH, so a failure surfaces in Python with the CUDA
// error name and message instead of corrupting a later, unrelated call.
#pragma once

#include <cuda.h>  // driver types only: cuCtxGetExecAffinity is reached through the runtime's entry-point query
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
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

namespace fla_cula {

// Makes `device` current for this thread's CUDA runtime while the guard lives. _C links the static
// runtime, whose current device is its own (torch's torch.cuda.set_device does not reach it), so
// every launcher sets it from its tensors' device before launching.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    FLA_CULA_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device_) FLA_CULA_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (prev_ != device_) cudaSetDevice(prev_);  // best effort: a destructor must not throw
  }
  DeviceGuard(DeviceGuard const&) = delete;
  DeviceGuard& operator=(DeviceGuard const&) = delete;

 private:
  int device_;
  int prev_ = 0;
};

// The SMs a launch on `device` may use from this process: the device's count, lowered by the current context's
// execution affinity (an MPS client's active-thread limit, CU_EXEC_AFFINITY_TYPE_SM_COUNT) where the driver reports
// one. Launches whose CTAs wait on other CTAs of the same grid bound their waiting CTAs by it.
inline int usable_sm_count(int device) {
  DeviceGuard guard(device);
  int sms = 0;
  FLA_CULA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  using ExecAffinityFn = CUresult (*)(CUexecAffinityParam*, CUexecAffinityType);
  static ExecAffinityFn const get_affinity = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetExecAffinity", &fn, 11040, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // an old driver without it: the device's count stands
      fn = nullptr;
    }
    return reinterpret_cast<ExecAffinityFn>(fn);
  }();
  CUexecAffinityParam affinity{};
  if (get_affinity != nullptr && get_affinity(&affinity, CU_EXEC_AFFINITY_TYPE_SM_COUNT) == CUDA_SUCCESS &&
      affinity.param.smCount.val > 0) {
    sms = std::min(sms, int(affinity.param.smCount.val));
  }
  return sms;
}

// RuntimeError unless `device` has compute capability major.minor (sm_90a code loads on 9.0 only).
inline void require_compute_capability(int device, int major, int minor, const char* what) {
  int have_major = 0, have_minor = 0;
  FLA_CULA_CUDA_CHECK(cudaDeviceGetAttribute(&have_major, cudaDevAttrComputeCapabilityMajor, device));
  FLA_CULA_CUDA_CHECK(cudaDeviceGetAttribute(&have_minor, cudaDevAttrComputeCapabilityMinor, device));
  if (have_major != major || have_minor != minor) {
    throw std::runtime_error(std::string(what) + ": fla_cula._C holds " FLA_CULA_BUILT_ARCH
                             " code, which runs on compute capability " + std::to_string(major) + "." +
                             std::to_string(minor) + " only; cuda:" + std::to_string(device) + " has " +
                             std::to_string(have_major) + "." + std::to_string(have_minor));
  }
}

}  // namespace fla_cula

#define FLA_CULA_REQUIRE(cond, msg)            \
  do {                                         \
    if (!(cond)) {                             \
      throw std::invalid_argument(msg);        \
    }                                          \
  } while (0)

namespace fla_cula {

// Raises kKernel's dynamic shared-memory limit to `bytes` (past the 48 KB default) and, with max_carveout, asks for
// all of the SM's unified memory as shared memory: once per device, which must be current (DeviceGuard).
template <auto kKernel>
void opt_in_shared_memory(int device, int bytes, bool max_carveout = false) {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];
  FLA_CULA_REQUIRE(device >= 0 && device < kMaxDevices, "device ordinal out of range: " + std::to_string(device));
  if (done[device].load(std::memory_order_acquire)) return;
  FLA_CULA_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (max_carveout) {
    FLA_CULA_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             int(cudaSharedmemCarveoutMaxShared)));
  }
  done[device].store(true, std::memory_order_release);
}

}  // namespace fla_cula
