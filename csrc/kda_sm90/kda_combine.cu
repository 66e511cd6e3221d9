// Launcher of the sequence split's combine (kda_combine_kernel.cuh): size checks, device, launch.
#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "common/cuda_check.h"
#include "kda_sm90/kda_combine_kernel.cuh"
#include "kda_sm90/kda_fwd.h"

namespace fla_cula {

namespace {
constexpr int kMaxDevices = 64;
}  // namespace

void run_kda_combine(KdaCombineParams const& a) {
  FLA_CULA_REQUIRE(a.slots >= 0 && a.pairs >= 0, "kda_combine: expected slots, pairs >= 0, got " +
                                                     std::to_string(a.slots) + ", " + std::to_string(a.pairs));
  int64_t const ctas = a.pairs * (128 / kda_sm90::kCombineCols);
  FLA_CULA_REQUIRE(ctas < (int64_t(1) << 31), "kda_combine: too many (sequence, value head) pairs");
  if (a.slots < 2 || ctas == 0) return;
  FLA_CULA_REQUIRE(a.seg_H && a.seg_M, "kda_combine: null device pointer");
  DeviceGuard guard(a.device);
  require_compute_capability(a.device, 9, 0, "kda_combine");
  static std::atomic<bool> opted_in[kMaxDevices];  // the running block and two maps: above the 48 KB default
  FLA_CULA_REQUIRE(a.device >= 0 && a.device < kMaxDevices, "kda_combine: device ordinal out of range");
  if (!opted_in[a.device].load(std::memory_order_acquire)) {
    FLA_CULA_CUDA_CHECK(cudaFuncSetAttribute(kda_sm90::kda_combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             kda_sm90::kCombineSmemBytes));
    opted_in[a.device].store(true, std::memory_order_release);
  }
  kda_sm90::kda_combine_kernel<<<dim3(unsigned(ctas)), kda_sm90::kCombineThreads, kda_sm90::kCombineSmemBytes,
                                 static_cast<cudaStream_t>(a.stream)>>>(a.seg_H, a.seg_M, a.slots, a.pairs);
  FLA_CULA_CHECK_LAUNCH("kda_combine_kernel");
}

}  // namespace fla_cula
