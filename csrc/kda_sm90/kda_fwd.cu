// Launcher of the KDA prefill forward: size checks, device, shared-memory opt-in, launch. Instantiations: the fused
// kernel with the bounded sigmoid gate, 64 or 128 V columns per CTA, mma.sync or wgmma, without and with the
// phase_cycles instrumentation; the two-kernel form's prep kernel and its state kernel at 64 and 128 columns, each
// also with the instrumentation, and the state kernel with the state in registers (pass 2 at 64 / 128 columns, maps);
// the untimed fused and prep kernels also as the grad-extras variants that write q^, k^ and rstd.
#include "kda_sm90/kda_fwd.h"

#include <cuda_runtime_api.h>

#include <string>

#include "common/cuda_check.h"
#include "common/static_switch.h"
#include "kda_sm90/kda_fwd_kernel.cuh"
#include "kda_sm90/kda_roles_kernel.cuh"
#include "kda_sm90/kda_state_rs_kernel.cuh"

namespace fla_cula {
namespace {

using kda_sm90::kPrepSmemBytes, kda_sm90::kRolesSmemBytes, kda_sm90::kSmemBytes, kda_sm90::kStateRsSmemBytes,
    kda_sm90::kStateSmemBytes, kda_sm90::kThreads;

// One launch of `kernel` (its dynamic shared memory opted in once per device) on `ctas` CTAs. All of the SM's
// unified memory as shared memory: the prep kernel's two CTAs per SM need 2 x 110 KB.
template <auto kKernel, int kSmem, int kNT = kda_sm90::kThreads>
void launch(KdaFwdParams const& a, int64_t ctas, char const* name) {
  opt_in_shared_memory<kKernel>(a.device, kSmem, /*max_carveout=*/true);
  kKernel<<<dim3(unsigned(ctas)), kNT, kSmem, static_cast<cudaStream_t>(a.stream)>>>(a);
  cudaError_t const err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda_error(err, (std::string("launch of ") + name).c_str(), __FILE__, __LINE__);
}

template <kda_sm90::GateForm kGate, bool kProfile, int kBV, bool kWgmma, bool kQkHat>
void launch_fused(KdaFwdParams const& a, int64_t ctas) {
  launch<kda_sm90::kda_fwd_kernel<kGate, kProfile, kBV, kWgmma, kQkHat>, kSmemBytes<kBV, kWgmma>>(
      a, ctas, "kda_fwd_kernel");
}

// CTAs of a pass: fused N * HV * V blocks; prep N * HV * units; state N * HV * V blocks * units
int64_t pass_ctas(KdaFwdParams const& a) {
  int64_t const pairs = int64_t(a.N) * a.HV;
  if (a.pass == kKdaPrep) return pairs * a.units;
  return pairs * (128 / a.block_v) * (a.pass == kKdaState ? a.units : 1);
}

}  // namespace

KdaFwdSpecialization const kKdaFwdSpecialization[kKdaFwdSpecializations] = {
    {"sigmoid_lb", false, kThreads, 64, false, kKdaFused, kSmemBytes<64>, false, false, false},
    {"sigmoid_lb", true, kThreads, 64, false, kKdaFused, kSmemBytes<64>, false, false, false},
    {"sigmoid_lb", false, kThreads, 128, false, kKdaFused, kSmemBytes<128>, false, false, false},
    {"sigmoid_lb", true, kThreads, 128, false, kKdaFused, kSmemBytes<128>, false, false, false},
    {"sigmoid_lb", false, kThreads, 64, true, kKdaFused, kSmemBytes<64, true>, false, false, false},
    {"sigmoid_lb", true, kThreads, 64, true, kKdaFused, kSmemBytes<64, true>, false, false, false},
    {"sigmoid_lb", false, kThreads, 128, true, kKdaFused, kSmemBytes<128, true>, false, false, false},
    {"sigmoid_lb", true, kThreads, 128, true, kKdaFused, kSmemBytes<128, true>, false, false, false},
    {"sigmoid_lb", false, kThreads, 0, true, kKdaPrep, kPrepSmemBytes, false, false, false},
    {"sigmoid_lb", true, kThreads, 0, true, kKdaPrep, kPrepSmemBytes, false, false, false},
    {"none", false, kThreads, 64, true, kKdaState, kStateSmemBytes<64>, false, false, false},
    {"none", true, kThreads, 64, true, kKdaState, kStateSmemBytes<64>, false, false, false},
    {"none", false, kThreads, 128, true, kKdaState, kStateSmemBytes<128>, false, false, false},
    {"none", true, kThreads, 128, true, kKdaState, kStateSmemBytes<128>, false, false, false},
    {"none", false, 128, 64, true, kKdaState, kStateRsSmemBytes<64>, true, false, false},
    {"none", false, kThreads, 128, true, kKdaState, kStateRsSmemBytes<128>, true, false, false},
    {"none", false, kThreads, 128, true, kKdaState, kStateRsSmemBytes<128>, true, true, false},
    {"sigmoid_lb", false, kThreads, 64, false, kKdaFused, kSmemBytes<64>, false, false, true},
    {"sigmoid_lb", false, kThreads, 128, false, kKdaFused, kSmemBytes<128>, false, false, true},
    {"sigmoid_lb", false, kThreads, 64, true, kKdaFused, kSmemBytes<64, true>, false, false, true},
    {"sigmoid_lb", false, kThreads, 128, true, kKdaFused, kSmemBytes<128, true>, false, false, true},
    {"sigmoid_lb", false, kThreads, 0, true, kKdaPrep, kPrepSmemBytes, false, false, true},
    {"softplus", false, kThreads, 0, true, kKdaPrep, kPrepSmemBytes, false, false, false},
    {"softplus", false, kThreads, 0, true, kKdaPrep, kPrepSmemBytes, false, false, true},
    {"precomputed", false, kThreads, 0, true, kKdaPrep, kPrepSmemBytes, false, false, false},
    {"precomputed", false, kThreads, 0, true, kKdaPrep, kPrepSmemBytes, false, false, true},
    {"sigmoid_lb", false, kThreads, 64, true, kKdaRoles, kRolesSmemBytes, false, false, false},
    {"sigmoid_lb", false, kThreads, 64, true, kKdaRoles, kRolesSmemBytes, false, false, true},
    {"softplus", false, kThreads, 64, true, kKdaRoles, kRolesSmemBytes, false, false, false},
    {"softplus", false, kThreads, 64, true, kKdaRoles, kRolesSmemBytes, false, false, true},
    {"precomputed", false, kThreads, 64, true, kKdaRoles, kRolesSmemBytes, false, false, false},
    {"precomputed", false, kThreads, 64, true, kKdaRoles, kRolesSmemBytes, false, false, true},
};

void run_kda_fwd(KdaFwdParams const& a) {
  FLA_CULA_REQUIRE(a.N >= 0 && a.HV > 0 && a.H > 0 && a.HV % a.H == 0,
                   "kda_fwd: expected N >= 0 and HV a positive multiple of H, got N=" + std::to_string(a.N) +
                       " H=" + std::to_string(a.H) + " HV=" + std::to_string(a.HV));
  FLA_CULA_REQUIRE(a.gate >= 0 && a.gate <= 2 && (a.gate == 0 || a.pass == kKdaPrep || a.pass == kKdaRoles),
                   "kda_fwd: expected gate 0 (bounded sigmoid), or 1 (softplus) / 2 (precomputed) with the prep pass, "
                   "got gate " + std::to_string(a.gate) + " pass " + std::to_string(a.pass));
  FLA_CULA_REQUIRE(a.gate != 0 || (a.lower_bound >= -5.f && a.lower_bound < 0.f),
                   "kda_fwd: expected -5 <= lower_bound < 0 (the overflow-free bound), got " +
                       std::to_string(a.lower_bound));
  if (a.pass == kKdaRoles) {
    run_kda_roles(a);
    return;
  }
  FLA_CULA_REQUIRE(a.block_v == 64 || a.block_v == 128,
                   "kda_fwd: expected block_v 64 or 128, got " + std::to_string(a.block_v));
  FLA_CULA_REQUIRE(a.pass == kKdaFused || a.pass == kKdaPrep || a.pass == kKdaState,
                   "kda_fwd: expected pass 0 (fused), 1 (prep) or 2 (state), got " + std::to_string(a.pass));
  FLA_CULA_REQUIRE(a.pass == kKdaFused || (a.wgmma && a.rec != nullptr && a.units >= 1),
                   "kda_fwd: the prep / state passes need wgmma, records and units >= 1");
  FLA_CULA_REQUIRE(!a.state_rs || (a.pass == kKdaState && a.h_inter == nullptr && a.phase_cycles == nullptr &&
                                   (a.block_v == 128 || !a.maps)),
                   "kda_fwd: state_rs needs a state pass without h_inter or phase_cycles (maps: block_v 128)");
  FLA_CULA_REQUIRE(a.pass != kKdaState || (a.segments >= 1 && a.seg_lo >= 0 && a.seg_lo < a.segments),
                   "kda_fwd: expected 0 <= seg_lo < segments with the state pass");
  FLA_CULA_REQUIRE((a.seg_lo == 0 && !a.seg_H_out) || (a.state_rs && a.pass == kKdaState),
                   "kda_fwd: seg_lo > 0 and seg_H_out need the state_rs state pass");
  int64_t const ctas = pass_ctas(a);
  FLA_CULA_REQUIRE(ctas < (int64_t(1) << 31), "kda_fwd: too many CTAs: " + std::to_string(ctas));
  FLA_CULA_REQUIRE(a.q && a.k && a.v && a.g && a.beta && (a.o || a.pass == kKdaPrep || a.maps),
                   "kda_fwd: null device pointer");
  FLA_CULA_REQUIRE(a.gate == 0 || a.phase_cycles == nullptr, "kda_fwd: phase_cycles needs the bounded sigmoid gate");
  FLA_CULA_REQUIRE(a.q_hat == nullptr || (a.pass != kKdaState && a.phase_cycles == nullptr),
                   "kda_fwd: q_hat (the grad extras) needs the fused or prep pass without phase_cycles");
  if (ctas == 0) return;
  DeviceGuard guard(a.device);
  require_compute_capability(a.device, 9, 0, "kda_fwd");
  constexpr auto kG = kda_sm90::GateForm::SigmoidLB;
  FLA_CULA_BOOL_SWITCH(a.phase_cycles != nullptr, kProfile, [&] {
    if (a.pass == kKdaPrep && a.gate != 0) {  // the unbounded gates (untimed: the REQUIRE above keeps profile off)
      using kda_sm90::GateForm, kda_sm90::kda_prep_kernel, kda_sm90::kPrepSmemBytes;
      FLA_CULA_BOOL_SWITCH(a.q_hat != nullptr, kQk, [&] {
        if (a.gate == 1) {
          launch<kda_prep_kernel<GateForm::Softplus, false, kQk>, kPrepSmemBytes>(a, ctas, "kda_prep_kernel");
        } else {
          launch<kda_prep_kernel<GateForm::Precomputed, false, kQk>, kPrepSmemBytes>(a, ctas, "kda_prep_kernel");
        }
      });
      return;
    }
    if (a.pass == kKdaPrep) {
      if (a.q_hat != nullptr) {
        launch<kda_sm90::kda_prep_kernel<kG, false, true>, kda_sm90::kPrepSmemBytes>(a, ctas, "kda_prep_kernel");
      } else {
        launch<kda_sm90::kda_prep_kernel<kG, kProfile>, kda_sm90::kPrepSmemBytes>(a, ctas, "kda_prep_kernel");
      }
      return;
    }
    if (a.pass == kKdaState && a.state_rs) {
      if (a.maps) {
        launch<kda_sm90::kda_state_rs_kernel<true>, kda_sm90::kStateRsSmemBytes<128>>(a, ctas, "kda_state_rs_kernel");
      } else if (a.block_v == 128) {
        launch<kda_sm90::kda_state_rs_kernel<false>, kda_sm90::kStateRsSmemBytes<128>>(a, ctas,
                                                                                     "kda_state_rs_kernel");
      } else {
        launch<kda_sm90::kda_state_rs_kernel<false, 64>, kda_sm90::kStateRsSmemBytes<64>, 128>(a, ctas,
                                                                                             "kda_state_rs_kernel");
      }
      return;
    }
    if (a.pass == kKdaState) {
      if (a.block_v == 128) {
        launch<kda_sm90::kda_state_kernel<128, kProfile>, kStateSmemBytes<128>>(a, ctas,
                                                                                          "kda_state_kernel");
      } else {
        launch<kda_sm90::kda_state_kernel<64, kProfile>, kStateSmemBytes<64>>(a, ctas,
                                                                                        "kda_state_kernel");
      }
      return;
    }
    // q^, k^ only untimed (the REQUIRE above): kQk never instantiates an instrumented kernel with them
    FLA_CULA_BOOL_SWITCH(a.wgmma, kWgmma, [&] {
      FLA_CULA_BOOL_SWITCH(a.q_hat != nullptr, kQkHat, [&] {
        constexpr bool kQk = kQkHat && !kProfile;
        if (a.block_v == 128) {
          launch_fused<kG, kProfile, 128, kWgmma, kQk>(a, ctas);
        } else {
          launch_fused<kG, kProfile, 64, kWgmma, kQk>(a, ctas);
        }
      });
    });
  });
}

}  // namespace fla_cula
