// Launchers of kda_bwd_wy, kda_bwd_dv, kda_bwd_intra and kda_bwd_gate (their *_kernel.cuh): grid, shared memory,
// launch on the caller's stream.
#include <cuda_runtime_api.h>

#include <string>

#include "common/cuda_check.h"
#include "kda_sm90/kda_bwd.h"
#include "kda_sm90/kda_bwd_dv_kernel.cuh"
#include "kda_sm90/kda_bwd_gate_kernel.cuh"
#include "kda_sm90/kda_bwd_intra_kernel.cuh"
#include "kda_sm90/kda_bwd_wy_kernel.cuh"

namespace fla_cula {
namespace {

template <bool kVFirst, bool kIntra, bool kL2, bool kWide = false>
void launch_wy(KdaBwdWyParams const& p, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = kda_sm90::kBwdWySmemBytes;
  opt_in_shared_memory<kda_sm90::kda_bwd_wy_kernel<kVFirst, kIntra, kL2, kWide>>(p.device, kSmem);
  kda_sm90::kda_bwd_wy_kernel<kVFirst, kIntra, kL2, kWide><<<grid, kda_sm90::kBwdThreads, kSmem, stream>>>(p);
}

// state layout x (plain | intra fused | intra and l2norm backward fused), the intra step bounded or not (gate_shift 0)
template <bool kVFirst>
void launch_form(KdaBwdWyParams const& p, dim3 grid, cudaStream_t stream) {
  bool const wide = p.gate_shift == 0.f;
  if (p.q_rstd) {
    wide ? launch_wy<kVFirst, true, true, true>(p, grid, stream) : launch_wy<kVFirst, true, true>(p, grid, stream);
  } else if (p.intra) {
    wide ? launch_wy<kVFirst, true, false, true>(p, grid, stream) : launch_wy<kVFirst, true, false>(p, grid, stream);
  } else {
    launch_wy<kVFirst, false, false>(p, grid, stream);
  }
}

void launch_kda_bwd_wy(KdaBwdWyParams const& p, dim3 grid, cudaStream_t stream) {
  if (p.state_v_first) {
    launch_form<true>(p, grid, stream);
  } else {
    launch_form<false>(p, grid, stream);
  }
}

// One CTA per (chunk, value head): the 1-D grid's size, checked to fit (x dimension < 2^31)
int64_t pair_ctas(int chunks, int HV, char const* name) {
  int64_t const ctas = int64_t(chunks) * HV;
  FLA_CULA_REQUIRE(ctas < (int64_t(1) << 31),
                   std::string(name) + ": too many (chunk, value head) pairs: " + std::to_string(ctas));
  return ctas;
}

}  // namespace

void run_kda_bwd_wy(KdaBwdWyParams const& p) {
  int64_t const ctas = pair_ctas(p.chunks, p.HV, "kda_bwd_wy");
  if (ctas == 0) return;
  DeviceGuard guard(p.device);
  require_compute_capability(p.device, 9, 0, "kda_bwd_wy");
  dim3 const grid{unsigned(ctas)};
  auto const stream = static_cast<cudaStream_t>(p.stream);
  FLA_CULA_REQUIRE(!p.intra || p.gate_shift == 0.f || (p.gate_shift > 0.f && p.gate_shift <= 16.6f),
                   "kda_bwd_wy: with intra, gate_shift must be in (0, 16.6] (safe_gate with -11.5 <= lower_bound < 0) "
                   "or 0 (no per-token bound), got " + std::to_string(p.gate_shift));
  FLA_CULA_REQUIRE(p.q_rstd == nullptr || (p.intra && p.H == p.HV && p.k_rstd && p.dqx && p.dkx),
                   "kda_bwd_wy: the fused l2norm backward needs intra, H == HV, k_rstd, dqx and dkx");
  launch_kda_bwd_wy(p, grid, stream);
  FLA_CULA_CHECK_LAUNCH("kda_bwd_wy_kernel");
}

void run_kda_bwd_dv(KdaBwdDvParams const& p) {
  int64_t const ctas = pair_ctas(p.chunks, p.HV, "kda_bwd_dv");
  if (ctas == 0) return;
  DeviceGuard guard(p.device);
  require_compute_capability(p.device, 9, 0, "kda_bwd_dv");
  kda_sm90::kda_bwd_dv_kernel<<<dim3{unsigned(ctas)}, kda_sm90::kDvThreads, kda_sm90::kBwdDvSmemBytes,
                                static_cast<cudaStream_t>(p.stream)>>>(p);
  FLA_CULA_CHECK_LAUNCH("kda_bwd_dv_kernel");
}

void run_kda_bwd_intra(KdaBwdIntraParams const& p) {
  int64_t const ctas = pair_ctas(p.chunks, p.HV, "kda_bwd_intra");
  FLA_CULA_REQUIRE(p.gate_shift == 0.f || (p.gate_shift > 0.f && p.gate_shift <= 16.6f),
                   "kda_bwd_intra: gate_shift must be in (0, 16.6] (safe_gate with -11.5 <= lower_bound < 0) or 0 (no "
                   "per-token bound), got " + std::to_string(p.gate_shift));
  if (ctas == 0) return;
  DeviceGuard guard(p.device);
  require_compute_capability(p.device, 9, 0, "kda_bwd_intra");
  constexpr int kSmem = kda_sm90::kBwdIntraSmemBytes;
  bool const wide = p.gate_shift == 0.f;
  if (wide) {
    opt_in_shared_memory<kda_sm90::kda_bwd_intra_kernel<true>>(p.device, kSmem);
  } else {
    opt_in_shared_memory<kda_sm90::kda_bwd_intra_kernel<false>>(p.device, kSmem);
  }
  auto const kernel = wide ? kda_sm90::kda_bwd_intra_kernel<true> : kda_sm90::kda_bwd_intra_kernel<false>;
  kernel<<<dim3{unsigned(ctas)}, kda_sm90::kIntraThreads, kSmem, static_cast<cudaStream_t>(p.stream)>>>(p);
  FLA_CULA_CHECK_LAUNCH("kda_bwd_intra_kernel");
}

void run_kda_bwd_gate(KdaBwdGateParams const& p) {
  int64_t const ctas = pair_ctas(p.chunks, p.HV, "kda_bwd_gate");
  FLA_CULA_REQUIRE(p.softplus || p.lower_bound < 0.f,
                   "kda_bwd_gate: lower_bound must be < 0, got " + std::to_string(p.lower_bound));
  FLA_CULA_REQUIRE(!p.softplus || p.A_log != nullptr, "kda_bwd_gate: the softplus form needs A_log");
  if (ctas == 0) return;
  DeviceGuard guard(p.device);
  require_compute_capability(p.device, 9, 0, "kda_bwd_gate");
  auto const kernel = p.softplus ? (p.g_raw_fp32 ? kda_sm90::kda_bwd_gate_kernel<true, true>
                                                 : kda_sm90::kda_bwd_gate_kernel<false, true>)
                                 : (p.g_raw_fp32 ? kda_sm90::kda_bwd_gate_kernel<true, false>
                                                 : kda_sm90::kda_bwd_gate_kernel<false, false>);
  kernel<<<dim3{unsigned(ctas)}, kda_sm90::kGateThreads, kda_sm90::kBwdGateSmemBytes,
           static_cast<cudaStream_t>(p.stream)>>>(p);
  FLA_CULA_CHECK_LAUNCH("kda_bwd_gate_kernel");
}

}  // namespace fla_cula
