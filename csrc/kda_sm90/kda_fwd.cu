// Launcher of the fused KDA prefill forward v1: size checks, device, shared-memory opt-in, launch.
// Instantiations: the bounded sigmoid gate, 64 or 128 V columns per CTA, without and with the phase_cycles
// instrumentation; the softplus and precomputed gate forms of v2 are further GateForm values, one .cu each
// when they come.
#include "kda_sm90/kda_fwd.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "common/cuda_check.h"
#include "common/static_switch.h"
#include "kda_sm90/kda_fwd_kernel.cuh"

namespace fla_cula {
namespace {

constexpr int kMaxDevices = 64;

template <kda_sm90::GateForm kGate, bool kProfile, int kBV, bool kWgmma>
void launch(KdaFwdParams const& a) {
  auto* kernel = kda_sm90::kda_fwd_kernel<kGate, kProfile, kBV, kWgmma>;
  constexpr int smem = kda_sm90::kSmemBytes<kBV, kWgmma>;
  static std::atomic<bool> opted_in[kMaxDevices];
  FLA_CULA_REQUIRE(a.device >= 0 && a.device < kMaxDevices, "kda_fwd: device ordinal out of range");
  if (!opted_in[a.device].load(std::memory_order_acquire)) {
    FLA_CULA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    opted_in[a.device].store(true, std::memory_order_release);
  }
  int64_t const ctas = int64_t(a.N) * a.HV * (128 / kBV);
  kernel<<<dim3(unsigned(ctas)), kda_sm90::kThreads, smem, static_cast<cudaStream_t>(a.stream)>>>(a);
  FLA_CULA_CHECK_LAUNCH("kda_fwd_kernel");
}

}  // namespace

KdaFwdSpecialization const kKdaFwdSpecialization[kKdaFwdSpecializations] = {
    {"sigmoid_lb", false, kda_sm90::kThreads, 64, false, kda_sm90::kSmemBytes<64>},
    {"sigmoid_lb", true, kda_sm90::kThreads, 64, false, kda_sm90::kSmemBytes<64>},
    {"sigmoid_lb", false, kda_sm90::kThreads, 128, false, kda_sm90::kSmemBytes<128>},
    {"sigmoid_lb", true, kda_sm90::kThreads, 128, false, kda_sm90::kSmemBytes<128>},
    {"sigmoid_lb", false, kda_sm90::kThreads, 64, true, kda_sm90::kSmemBytes<64, true>},
    {"sigmoid_lb", true, kda_sm90::kThreads, 64, true, kda_sm90::kSmemBytes<64, true>},
    {"sigmoid_lb", false, kda_sm90::kThreads, 128, true, kda_sm90::kSmemBytes<128, true>},
    {"sigmoid_lb", true, kda_sm90::kThreads, 128, true, kda_sm90::kSmemBytes<128, true>},
};

void run_kda_fwd(KdaFwdParams const& a) {
  FLA_CULA_REQUIRE(a.N >= 0 && a.HV > 0 && a.H > 0 && a.HV % a.H == 0,
                   "kda_fwd: expected N >= 0 and HV a positive multiple of H, got N=" + std::to_string(a.N) +
                       " H=" + std::to_string(a.H) + " HV=" + std::to_string(a.HV));
  FLA_CULA_REQUIRE(a.lower_bound >= -5.f && a.lower_bound < 0.f,
                   "kda_fwd: expected -5 <= lower_bound < 0 (the overflow-free bound), got " +
                       std::to_string(a.lower_bound));
  FLA_CULA_REQUIRE(a.block_v == 64 || a.block_v == 128,
                   "kda_fwd: expected block_v 64 or 128, got " + std::to_string(a.block_v));
  int64_t const ctas = int64_t(a.N) * a.HV * (128 / a.block_v);
  FLA_CULA_REQUIRE(ctas < (int64_t(1) << 31), "kda_fwd: too many (sequence, head) pairs: " + std::to_string(ctas));
  FLA_CULA_REQUIRE(a.q && a.k && a.v && a.g && a.beta && a.o, "kda_fwd: null device pointer");
  if (ctas == 0) return;
  DeviceGuard guard(a.device);
  require_compute_capability(a.device, 9, 0, "kda_fwd");
  FLA_CULA_BOOL_SWITCH(a.phase_cycles != nullptr, kProfile, [&] {
    FLA_CULA_BOOL_SWITCH(a.wgmma, kWgmma, [&] {
      if (a.block_v == 128) {
        launch<kda_sm90::GateForm::SigmoidLB, kProfile, 128, kWgmma>(a);
      } else {
        launch<kda_sm90::GateForm::SigmoidLB, kProfile, 64, kWgmma>(a);
      }
    });
  });
}

}  // namespace fla_cula
