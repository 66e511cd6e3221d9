// Launcher of kda_bwd_wy (kda_bwd_wy_kernel.cuh): grid, shared memory, launch on the caller's stream.
#include <cuda_runtime_api.h>

#include <string>

#include "common/cuda_check.h"
#include "kda_sm90/kda_bwd.h"
#include "kda_sm90/kda_bwd_wy_kernel.cuh"

namespace fla_cula {

void run_kda_bwd_wy(KdaBwdWyParams const& p) {
  int64_t const ctas = int64_t(p.chunks) * p.HV;
  FLA_CULA_REQUIRE(ctas < (int64_t(1) << 31), "kda_bwd_wy: too many (chunk, value head) pairs: " +
                                                  std::to_string(ctas));
  if (ctas == 0) return;
  DeviceGuard guard(p.device);
  require_compute_capability(p.device, 9, 0, "kda_bwd_wy");
  dim3 const grid{unsigned(ctas)};
  auto const stream = static_cast<cudaStream_t>(p.stream);
  constexpr int kSmem = kda_sm90::kBwdWySmemBytes;
  if (p.state_v_first) {
    opt_in_shared_memory<kda_sm90::kda_bwd_wy_kernel<true>>(p.device, kSmem);
    kda_sm90::kda_bwd_wy_kernel<true><<<grid, kda_sm90::kBwdThreads, kSmem, stream>>>(p);
  } else {
    opt_in_shared_memory<kda_sm90::kda_bwd_wy_kernel<false>>(p.device, kSmem);
    kda_sm90::kda_bwd_wy_kernel<false><<<grid, kda_sm90::kBwdThreads, kSmem, stream>>>(p);
  }
  FLA_CULA_CHECK_LAUNCH("kda_bwd_wy_kernel");
}

}  // namespace fla_cula
