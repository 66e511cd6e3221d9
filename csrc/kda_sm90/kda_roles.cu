// Launcher of the one-launch two-kernel form (kda_roles_kernel.cuh): the two roles' parameters from the binding's
// (pass kKdaRoles), the no-deadlock bound, the launch. Instantiations: the three gate forms, each also as the
// grad-extras variant that writes q^, k^ and rstd.
#include <cuda_runtime_api.h>

#include <string>

#include "common/cuda_check.h"
#include "common/static_switch.h"
#include "kda_sm90/kda_fwd.h"
#include "kda_sm90/kda_roles_kernel.cuh"

namespace fla_cula {
namespace {

template <kda_sm90::GateForm kGate, bool kQkHat>
void launch_roles(kda_sm90::KdaRolesParams const& r, int64_t ctas) {
  constexpr auto kKernel = kda_sm90::kda_roles_kernel<kGate, kQkHat>;
  opt_in_shared_memory<kKernel>(r.prep.device, kda_sm90::kRolesSmemBytes);
  kKernel<<<dim3(unsigned(ctas)), kda_sm90::kThreads, kda_sm90::kRolesSmemBytes,
            static_cast<cudaStream_t>(r.prep.stream)>>>(r);
  FLA_CULA_CHECK_LAUNCH("kda_roles_kernel");
}

}  // namespace

int kda_usable_sms(int device) {
  int count = 0;
  FLA_CULA_CUDA_CHECK(cudaGetDeviceCount(&count));
  FLA_CULA_REQUIRE(device >= 0 && device < count, "usable_sm_count: expected a device index in [0, " +
                                                      std::to_string(count) + "), got " + std::to_string(device));
  return usable_sm_count(device);
}

// (run_kda_fwd has checked the sizes and the gate form)
void run_kda_roles(KdaFwdParams const& a) {
  FLA_CULA_REQUIRE(a.pass == kKdaRoles && a.rec != nullptr && a.rec_ready != nullptr && a.units >= 1 &&
                       a.chunks_per_cta >= 1 && a.block_v == 64 && a.wgmma && a.o != nullptr,
                   "kda_roles: expected pass 3 with rec, rec_ready, o, block_v 64, wgmma, units >= 1 and "
                   "chunks_per_cta >= 1");
  FLA_CULA_REQUIRE(a.q && a.k && a.v && a.g && a.beta, "kda_roles: null device pointer");
  FLA_CULA_REQUIRE(a.h_inter == nullptr && a.phase_cycles == nullptr && a.seg_H == nullptr && !a.maps,
                   "kda_roles: h_inter, phase_cycles, seg_H and maps are not taken by the one-launch form");
  int64_t const pairs = int64_t(a.N) * a.HV, roles = 2 * pairs, ctas = roles + pairs * a.units;
  FLA_CULA_REQUIRE(ctas < (int64_t(1) << 31), "kda_roles: too many CTAs: " + std::to_string(ctas));
  if (roles == 0) return;
  DeviceGuard guard(a.device);
  require_compute_capability(a.device, 9, 0, "kda_roles");
  int const sms = usable_sm_count(a.device);
  // the pass-2 CTAs wait for prep CTAs: they must leave SMs to the prep (half the usable SMs at most)
  FLA_CULA_REQUIRE(2 * roles <= sms, "kda_roles: expected 2 N * HV <= usable SMs / 2 = " + std::to_string(sms / 2) +
                                         " (pass 2's CTAs wait for the prep on the other SMs), got " +
                                         std::to_string(roles));
  kda_sm90::KdaRolesParams const r = kda_sm90::roles_params(a);
  using kda_sm90::GateForm;
  FLA_CULA_BOOL_SWITCH(a.q_hat != nullptr, kQk, [&] {
    if (a.gate == 1) {
      launch_roles<GateForm::Softplus, kQk>(r, ctas);
    } else if (a.gate == 2) {
      launch_roles<GateForm::Precomputed, kQk>(r, ctas);
    } else {
      launch_roles<GateForm::SigmoidLB, kQk>(r, ctas);
    }
  });
}

}  // namespace fla_cula
