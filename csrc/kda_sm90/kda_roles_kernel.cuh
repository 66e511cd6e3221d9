// The two-kernel form in one launch, for grids that leave most SMs idle (docs/kda_sm90.md "The one-launch form"):
// CTA b < R = 2 N * HV runs pass 2 of pair b / 2's columns 64 (b % 2) .. + 63 over its whole sequence on its first
// warpgroup (kda_state_rs_body at 64 columns: a warpgroup alone on its SM keeps the chain short), CTA b >= R a prep
// unit (kda_fwd_body's prep pass), chunk block by chunk block across the pairs. Pass 2 follows the records as the prep
// stores them: its thread 0 waits on each record's flag (Params::rec_ready) before the bulk copy that reads it.
// One shared-memory size for both roles (the larger: one CTA per SM), so the waiting pass-2 CTAs hold R SMs and the
// prep runs on the others; no prep CTA waits on anything, so the launch completes whatever order the CTAs start in
// while R is below the SMs that can hold a CTA (the host requires 2 R <= SMs). Same records, same products, same
// rounding as the two launches: the same bits.
#pragma once

#include "kda_sm90/kda_state_rs_kernel.cuh"

namespace fla_cula::kda_sm90 {

// the two roles' parameters: prep (kKdaPrep: units chunk blocks of chunks_per_cta per pair) and pass 2 (kKdaState,
// state_rs, segments 1, block_v 64), sharing rec and rec_ready
struct KdaRolesParams {
  KdaFwdParams prep, state;
};

// the roles' parameters from the binding's (pass kKdaRoles: the prep's units and chunks_per_cta, o, ht, rec_ready)
inline KdaRolesParams roles_params(KdaFwdParams const& a) {
  KdaRolesParams r{a, a};
  r.prep.pass = kKdaPrep;
  r.prep.o = nullptr;
  r.prep.ht = nullptr;
  r.prep.block_v = 64;
  r.state.pass = kKdaState;
  r.state.state_rs = true;
  r.state.block_v = 64;
  r.state.units = 1;
  r.state.segments = 1;
  r.state.seg_lo = 0;
  r.state.seg_H_out = false;
  r.state.chunks_per_cta = 0;
  r.state.gate = 0;
  r.state.Aqk = r.state.Akk = r.state.q_hat = r.state.k_hat = nullptr;
  r.state.q_rstd = r.state.k_rstd = nullptr;
  return r;
}

constexpr int kRolesSmemBytes = kPrepSmemBytes > kStateRsSmemBytes<64> ? kPrepSmemBytes : kStateRsSmemBytes<64>;
static_assert(kRolesSmemBytes > 227 * 1024 / 2, "one CTA per SM: the waiting roles hold whole SMs");

template <GateForm kGate, bool kQkHat = false>
__global__ void __launch_bounds__(kThreads, 1) kda_roles_kernel(__grid_constant__ KdaRolesParams const r) {
  int const roles = 2 * r.state.N * r.state.HV;
  if (int(blockIdx.x) < roles) {
    if (threadIdx.x < 128) kda_state_rs_body<false, 64>(r.state, int(blockIdx.x));
  } else {
    // prep unit y in chunk-block order: every pair's block u before any pair's block u + 1, so that each pass-2 CTA
    // finds its next record soon whatever its sequence; bid is kda_prep_kernel's index of (n, unit, hv)
    int const y = int(blockIdx.x) - roles, pairs = r.prep.N * r.prep.HV, pair = y % pairs, unit = y / pairs;
    int const hv = pair % r.prep.HV, n = pair / r.prep.HV;
    kda_fwd_body<kGate, false, 64, true, kKdaPrep, kQkHat>(r.prep, (n * r.prep.units + unit) * r.prep.HV + hv);
  }
}

}  // namespace fla_cula::kda_sm90
