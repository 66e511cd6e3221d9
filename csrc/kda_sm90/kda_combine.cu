// Launcher of the sequence split's combine (kda_combine_kernel.cuh): size checks, device, launch.
#include <cuda_runtime_api.h>

#include <string>

#include "common/cuda_check.h"
#include "kda_sm90/kda_combine_kernel.cuh"
#include "kda_sm90/kda_fwd.h"

namespace fla_cula {

void run_kda_combine(KdaCombineParams const& a) {
  FLA_CULA_REQUIRE(a.slots >= 0 && a.pairs >= 0, "kda_combine: expected slots, pairs >= 0, got " +
                                                     std::to_string(a.slots) + ", " + std::to_string(a.pairs));
  int64_t const ctas = a.pairs * (128 / kda_sm90::kCombineCols);
  FLA_CULA_REQUIRE(ctas < (int64_t(1) << 31), "kda_combine: too many (sequence, value head) pairs");
  if (a.slots < 2 || ctas == 0) return;
  FLA_CULA_REQUIRE(a.seg_H && a.seg_M, "kda_combine: null device pointer");
  DeviceGuard guard(a.device);
  require_compute_capability(a.device, 9, 0, "kda_combine");
  opt_in_shared_memory<kda_sm90::kda_combine_kernel>(a.device, kda_sm90::kCombineSmemBytes);  // X + two maps
  kda_sm90::kda_combine_kernel<<<dim3(unsigned(ctas)), kda_sm90::kCombineThreads, kda_sm90::kCombineSmemBytes,
                                 static_cast<cudaStream_t>(a.stream)>>>(a.seg_H, a.seg_M, a.slots, a.pairs);
  FLA_CULA_CHECK_LAUNCH("kda_combine_kernel");
}

}  // namespace fla_cula
