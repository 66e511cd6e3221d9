// Device code of kda_bwd_gate (kda_bwd.h): FLA 0.6.0's chunk_local_cumsum(dg, reverse) followed by kda_gate_bwd, in
// one pass over dg. Per chunk and channel, with g the chunk-local cumsum of the per-token gate a, gp = g_raw +
// dt_bias, A = exp(A_log) or 1 (A_log, dt_bias fp32 or bf16), dyg[t] = sum_{s >= t in the chunk} dg[s]:
//   lower_bound form, a = lower_bound sigmoid(A gp):
//     dg_raw[t] = dyg[t] lower_bound s (1 - s) A,   s = sigmoid(A gp[t]),   dA_log = sum dg_raw gp
//   softplus form (kSoftplus), a = -A softplus(gp) (A_log required):
//     dg_raw[t] = -dyg[t] A sigmoid(gp[t]),   dA_log = sum dyg a
//   and d dt_bias = sum dg_raw (dA / dA_log = A folded in).
// One CTA of 512 threads per (chunk, value head): thread (channel tid % 128, segment tid / 128 of 16 rows) issues all
// its loads first (dg and g_raw of its 16 rows), takes suffix sums, adds the later segments' totals through shared
// memory and writes dg_raw; the chunk's partial sums of dA_log and dt_bias go to dA_part / dbias_part for the host
// to add over the chunks (FLA adds its 32-token blocks' partials the same way). A few KB of shared memory, so several
// CTAs share an SM and hide each other's memory latency.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kda_sm90/kda_bwd.h"
#include "kda_sm90/kda_bwd_chunk.cuh"
#include "kda_sm90/kda_fwd_kernel.cuh"  // sigmoidf_, load_param

namespace fla_cula::kda_sm90 {

constexpr int kGateThreads = 512;
constexpr int kGateCh = 128;  // channels (head dim)

struct BwdGateStorage {
  float tot[4][kGateCh];  // the segments' suffix totals, then their dt_bias shares
  float red[kGateThreads / 32];  // the warps' dA_log shares
};
constexpr int kBwdGateSmemBytes = int(sizeof(BwdGateStorage));

// kF32: g_raw and dg_raw are fp32 (else bf16). Every load is unconditional (a tail's rows past L re-read row L - 1
// and are zeroed after), so a thread's 32 loads are all in flight before the first is used.
template <bool kF32, bool kSoftplus>
__global__ void __launch_bounds__(kGateThreads) kda_bwd_gate_kernel(__grid_constant__ KdaBwdGateParams const p) {
  using Raw = std::conditional_t<kF32, float, __nv_bfloat16>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  BwdGateStorage& sm = *reinterpret_cast<BwdGateStorage*>(smem_raw);
  int const tid = threadIdx.x, ch = tid & (kGateCh - 1), seg = tid >> 7, s0 = 16 * seg;
  int const HV = p.HV, hv = int(blockIdx.x % unsigned(HV));
  int64_t const chunk = blockIdx.x / unsigned(HV);
  ChunkSpan const span = chunk_span(p, chunk);
  int const L = span.L;
  int64_t const row = int64_t(HV) * kGateCh;  // elements between consecutive tokens
  int64_t const base = (span.t0 * HV + hv) * kGateCh + ch;
  float const* dg = p.dg + base;
  Raw const* g_raw = static_cast<Raw const*>(p.g_raw) + base;
  Raw* dg_raw = static_cast<Raw*>(p.dg_raw) + base;

  float x[16];  // dg, then its suffix sums
  Raw gr[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    int const t = s0 + i < L ? s0 + i : L - 1;
    x[i] = dg[t * row];
    gr[i] = g_raw[t * row];
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = s0 + i < L ? x[i] : 0.f;
  float const A = p.A_log != nullptr ? expf(load_param(p.A_log, p.A_log_fp32, hv)) : 1.f;
  float const bias = p.dt_bias != nullptr ? load_param(p.dt_bias, p.dt_bias_fp32, hv * kGateCh + ch) : 0.f;
#pragma unroll
  for (int i = 14; i >= 0; --i) x[i] += x[i + 1];
  sm.tot[seg][ch] = x[0];
  __syncthreads();
  float later = 0.f;
#pragma unroll
  for (int s = 1; s < 4; ++s) later += s > seg ? sm.tot[s][ch] : 0.f;
  float da = 0.f, dbias = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    int const t = s0 + i;
    if (t >= L) break;
    float gp;
    if constexpr (kF32) {
      gp = gr[i] + bias;
    } else {
      gp = __bfloat162float(gr[i]) + bias;
    }
    float const dy = x[i] + later;
    float d;
    if constexpr (kSoftplus) {  // softplus(gp) = log(1 + e^gp), gp itself from 20 on (FLA's threshold)
      float const sp = gp < 20.f ? log1pf(expf(gp)) : gp;
      d = -dy * A * sigmoidf_(gp);
      da -= dy * A * sp;
    } else {
      float const sg = sigmoidf_(A * gp);
      d = dy * (p.lower_bound * sg * (1.f - sg)) * A;
      da += d * gp;
    }
    if constexpr (kF32) {
      dg_raw[t * row] = d;
    } else {
      dg_raw[t * row] = __float2bfloat16_rn(d);
    }
    dbias += d;
  }
  __syncthreads();  // the segment totals read
  sm.tot[seg][ch] = dbias;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) da += __shfl_xor_sync(0xffffffffu, da, o);
  if ((tid & 31) == 0) sm.red[tid >> 5] = da;
  __syncthreads();
  if (seg == 0 && p.dbias_part != nullptr) {
    p.dbias_part[(chunk * HV + hv) * kGateCh + ch] = sm.tot[0][ch] + sm.tot[1][ch] + sm.tot[2][ch] + sm.tot[3][ch];
  }
  if (tid == 0 && p.dA_part != nullptr) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kGateThreads / 32; ++i) sum += sm.red[i];
    p.dA_part[chunk * HV + hv] = sum;
  }
}

}  // namespace fla_cula::kda_sm90
