// Device code of kda_bwd_wy (kda_bwd.h): the chunk-local gradients of KDA after the state pass backward.
//
// One CTA (16 warps) per (chunk c, value head hv); tokens t, s, j < 64 of the chunk, channels k < 128, values
// v < 128. bA[t][s] = Akk[s][t] (FLA reads Akk transposed); H[v][k] the chunk-start state as read by FLA
// (S^T), dH likewise; e = exp2(g[t][k]), n the chunk's last row, L its length. Rows t >= L load as zero.
// Every 2^x is ex2 (MUFU, kda_fwd_kernel.cuh): the same bits as exp2f for results >= 2^-126, smaller ones flush to
// 0 (exp2f spends three more instructions to return them as subnormals).
//   dvb = bA dv                      dv2 = dvb diag(beta)           db  = rowsum(dvb * v)
//   dq  = scale e * (do H)           dk' = exp2(g_n - g) * (v' dH)  (0 on rows >= L)
//   dw  = bf16(-(dv H))              kg  = k e
//   dA  = dv v^T + dw bf16(kg)^T     dkgb = bA dw                   db += rowsum(dkgb * kg)
//   dgk = exp2(g_n) colsum(H * dH) + colsum(k * dk')
//   dg  = q dq - k dk' + [t = n] dgk + kg dkgb beta
//   dk  = dk' + dkgb e beta
//   X   = bf16(M(dA) diag(beta)),  dA_out = -M(bA bf16(X Akk))  (M: strictly lower, both rows < L)
//   dAqk = scale M'(do v'^T)         (kIntra; M': lower with the diagonal, rows < L: FLA's chunk_kda_bwd_dAv's dA)
// Products are warp mma.sync m16n8k16 over shared-memory tiles (ldmatrix, .trans for operands stored with the
// reduced index across rows), so no tile is stored twice. Warp w owns rows 16 (w % 4) .. + 15 and columns
// 32 (w / 4) .. + 31 of a 64 x 128 result (16 (w / 4) .. + 15 of a 64 x 64 one). Sixteen warps at <= 128
// registers: the CTA is alone on its SM (shared memory), so its warps are all the latency hiding there is.
// kIntra: the intra-chunk step (kda_bwd_intra_block.cuh) follows in the same CTA: dAqk is made from do and v' (step
// 8b, into dH's place) and dA_out stays in shared memory (H's place) instead of going out, both stored as the bf16
// hi / lo pairs the intra products read (split_dA's layout); the step adds its terms to the dq, dk, dg, db this CTA
// has just written (each entry re-read by the thread that wrote it). kL2 (with kIntra, H = HV, q_rstd given): FLA's
// l2norm backward of q and k follows on the final dq, dk: dqx = rstd (dq - y (y . dq)), y the normalized q in shared
// memory, the row dots summed over the 4 channel quarters in shared memory; dqx, dkx go out in bf16 (dq, dk hold the
// final fp32 values too; the thread keeps its entries of them in registers for this). One CTA per SM: nothing hides
// a tail's memory latency, so each tail issues all its loads before its first store.
#pragma once

#include <cstddef>

#include "kda_sm90/kda_bwd.h"
#include "kda_sm90/kda_bwd_chunk.cuh"
#include "kda_sm90/kda_bwd_intra_block.cuh"
#include "kda_sm90/kda_fwd_kernel.cuh"

namespace fla_cula::kda_sm90 {

constexpr int kBwdWarps = 16;
constexpr int kBwdThreads = 32 * kBwdWarps;
constexpr int kNT128 = 128 / (kBwdWarps / 4) / 8;  // 8-column tiles of a warp's share of a 64 x 128 result
constexpr int kNT64 = 64 / (kBwdWarps / 4) / 8;    // and of a 64 x 64 one

// x[h] summed over the warp's 4 lanes of row r0 + g8 + 8 h (lane = 4 g8 + t4) into slot[r0 + g8 + 8 h]: stored, or
// added (kAdd) to what the same lane stored there before. One slot row per channel quarter, summed in a fixed order
// by the reader (no atomics: the same bits every run).
template <bool kAdd>
__device__ __forceinline__ void put_row_shares(float* slot, float const (&x)[2], int r0, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v = x[h];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if ((lane & 3) == 0) {
      float& d = slot[r0 + (lane >> 2) + 8 * h];
      d = kAdd ? d + v : v;
    }
  }
}

// Shared memory (~214 KB, one CTA per SM). The 64 x 128 tiles die in phases and take the later tiles' places.
struct BwdWyStorage {
  bf16 dout[kC * kLdK];  // do; then bf16(Y) [64][kLdC]
  bf16 vn[kC * kLdK];    // v'
  bf16 dv[kC * kLdK];    // dv; then bf16(kg)
  bf16 v[kC * kLdK];     // v; then dw = bf16(-(dv H))
  bf16 h[kK * kLdK];     // the state as stored ([v][k] with state_v_first, else [k][v]); then X [64][kLdC], then
                         // dA_out (kIntra)
  bf16 dh[kK * kLdK];    // then dAqk (kIntra)
  bf16 A[kC * kLdC];     // Akk rows as stored: A[s][t] = bA[t][s]
  bf16 q[kC * kLdK];     // the epilogues' operands at the accumulator positions, loaded with the tiles
  bf16 k[kC * kLdK];
  float g[kC * kLdG];
  float beta[kC], gn[kK], dgk[kK];
  float dgkp[4][kK];     // colsum(k * dk') by row block (step 6)
  float db[4][kC];       // db by channel quarter (steps 2, 8, 10)
  // dgk and db: their partial sums, each written by one lane, summed in a fixed order (deterministic)
  __device__ __forceinline__ float dgk_at(int c) const {
    return dgk[c] + dgkp[0][c] + dgkp[1][c] + dgkp[2][c] + dgkp[3][c];
  }
  __device__ __forceinline__ float db_at(int t) const { return db[0][t] + db[1][t] + db[2][t] + db[3][t]; }
};
constexpr int kBwdWySmemBytes = int(sizeof(BwdWyStorage));
static_assert(offsetof(BwdWyStorage, gn) % 16 == 0, "g_n arrives by 16-byte copies");
static_assert(kBwdWySmemBytes <= 227 * 1024, "one CTA per SM: within the SM's 227 KB of shared memory");

// kWide (with kIntra): the intra step's unbounded form (gate_shift 0; kda_bwd_intra_block.cuh's diag_anchor)
template <bool kVFirst, bool kIntra, bool kL2 = false, bool kWide = false>
__global__ void __launch_bounds__(kBwdThreads, 1) kda_bwd_wy_kernel(__grid_constant__ KdaBwdWyParams const p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  BwdWyStorage& sm = *reinterpret_cast<BwdWyStorage*>(smem_raw);
  int const tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g8 = lane >> 2, t4 = lane & 3;
  int const r0 = 16 * (w & 3), c128 = 8 * kNT128 * (w >> 2), c64 = 8 * kNT64 * (w >> 2);
  int const HV = p.HV, hv = int(blockIdx.x % unsigned(HV)), hq = hv / (HV / p.H);
  int64_t const c = blockIdx.x / unsigned(HV);
  ChunkSpan const span = chunk_span(p, c);
  int64_t const t0 = span.t0;
  int const L = span.L;
  auto vrow = [&](int t) { return ((t0 + t) * HV + hv) * kK; };  // element offset of row t, [.., HV, 128] tensors
  auto qrow = [&](int t) { return ((t0 + t) * p.H + hq) * kK; };

  // 1. loads to shared memory (rows >= L zero) in three cp.async groups, in the order the steps use them, so that
  //    steps 2-3 run while H, dH and the rest are in flight (one CTA per SM: nothing else hides this load):
  //    group 0: Akk, dv, v, beta, g_n (steps 2-3); group 1: H, dH (step 4); group 2: do, v', q, k, g (step 5 on).
  auto load_rows = [&](bf16* dst, bf16 const* src, auto row_of) {  // a [64][128] bf16 tile, rows >= L zero
#pragma unroll
    for (int r = 0; r < kC * 16 / kBwdThreads; ++r) {
      int const i = tid + kBwdThreads * r, t = i >> 4, u = 8 * (i & 15);
      cp_async16(dst + t * kLdK + u, src + (t < L ? row_of(t) : 0) + u, t < L);
    }
  };
  {
    if (tid < kC) {
      cp_async4(sm.beta + tid, p.beta + (tid < L ? (t0 + tid) * HV + hv : 0), tid < L);
    } else if (tid < kC + kK / 4) {
      cp_async16(sm.gn + 4 * (tid - kC), p.g + vrow(L - 1) + 4 * (tid - kC), true);
    }
    bf16 const* As = static_cast<bf16 const*>(p.A);
#pragma unroll
    for (int r = 0; r < kC * 8 / kBwdThreads; ++r) {
      int const i = tid + kBwdThreads * r, t = i >> 3, u = 8 * (i & 7);
      cp_async16(sm.A + t * kLdC + u, As + (t < L ? ((t0 + t) * HV + hv) * kC : 0) + u, t < L);
    }
    load_rows(sm.dv, static_cast<bf16 const*>(p.dv), vrow);
    load_rows(sm.v, static_cast<bf16 const*>(p.v), vrow);
    cp_async_commit();
    int64_t const hoff = (c * HV + hv) * kK * kK;
    bf16 const* hs = static_cast<bf16 const*>(p.h) + hoff;
    bf16 const* dhs = static_cast<bf16 const*>(p.dh) + hoff;
#pragma unroll
    for (int r = 0; r < kK * 16 / kBwdThreads; ++r) {
      int const i = tid + kBwdThreads * r, row = i >> 4, u = 8 * (i & 15);
      cp_async16(sm.h + row * kLdK + u, hs + row * kK + u, true);
      cp_async16(sm.dh + row * kLdK + u, dhs + row * kK + u, true);
    }
    cp_async_commit();
    load_rows(sm.dout, static_cast<bf16 const*>(p.dout), vrow);
    load_rows(sm.vn, static_cast<bf16 const*>(p.v_new), vrow);
    load_rows(sm.q, static_cast<bf16 const*>(p.q), qrow);
    load_rows(sm.k, static_cast<bf16 const*>(p.k), qrow);
#pragma unroll
    for (int r = 0; r < kC * 32 / kBwdThreads; ++r) {
      int const i = tid + kBwdThreads * r, t = i >> 5, u = 4 * (i & 31);
      cp_async16(sm.g + t * kLdG + u, p.g + (t < L ? vrow(t) : 0) + u, t < L);
    }
    cp_async_commit();
    cp_async_wait_group<2>();
    __syncthreads();  // group 0 landed
  }

  float dbp[2] = {0.f, 0.f};  // this thread's share of db, rows r0 + g8 and + 8
  // 2. dvb = bA dv: dv2 and the first part of db
  {
    float acc[kNT128][4];
    zero(acc);
    warp_mma<kNT128, kC, true, true>(acc, sm.A + r0, kLdC, sm.dv + c128, kLdK, lane);
    bf16* dv2 = static_cast<bf16*>(p.dv2);
#pragma unroll
    for (int nt = 0; nt < kNT128; ++nt)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        int const t = r0 + g8 + 8 * hi, col = c128 + 8 * nt + 2 * t4;
        float const a0 = acc[nt][2 * hi], a1 = acc[nt][2 * hi + 1], b = sm.beta[t];
        float2 const vv = ld_bf16x2(sm.v + t * kLdK + col);
        dbp[hi] += a0 * vv.x + a1 * vv.y;
        if (t < L) *reinterpret_cast<__nv_bfloat162*>(dv2 + vrow(t) + col) = __floats2bfloat162_rn(a0 * b, a1 * b);
      }
  }
  // 3. dA = dv v^T (this warp's entries, in registers until step 9)
  float dA[kNT64][4];
  zero(dA);
  warp_mma<kNT64, kK, false, false>(dA, sm.dv + r0 * kLdK, kLdK, sm.v + c64 * kLdK, kLdK, lane);
  // 4. dv H (to become dw), and exp2(g_n) colsum(H * dH)
  cp_async_wait_group<1>();
  __syncthreads();  // group 1 landed
  float acc[kNT128][4];
  zero(acc);
  warp_mma<kNT128, kK, false, kVFirst>(acc, sm.dv + r0 * kLdK, kLdK, sm.h + (kVFirst ? c128 : c128 * kLdK), kLdK, lane);
  if (tid < kK) {
    float s = 0.f;
#pragma unroll 8
    for (int x = 0; x < kK; ++x) {
      int const o = kVFirst ? x * kLdK + tid : tid * kLdK + x;
      s += __bfloat162float(sm.h[o]) * __bfloat162float(sm.dh[o]);
    }
    sm.dgk[tid] = s * ex2(sm.gn[tid]);
  }
  cp_async_wait_group<0>();
  __syncthreads();  // dv and v are dead; group 2 landed
#pragma unroll
  for (int nt = 0; nt < kNT128; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      int const t = r0 + g8 + 8 * hi, col = c128 + 8 * nt + 2 * t4;
      *reinterpret_cast<__nv_bfloat162*>(sm.v + t * kLdK + col) =
          __floats2bfloat162_rn(-acc[nt][2 * hi], -acc[nt][2 * hi + 1]);
    }

  float dg[kNT128][4];  // dg of this warp's entries, summed over the steps below
  // 5. dq = scale e (do H)
  zero(acc);
  warp_mma<kNT128, kK, false, kVFirst>(acc, sm.dout + r0 * kLdK, kLdK, sm.h + (kVFirst ? c128 : c128 * kLdK), kLdK,
                                  lane);
#pragma unroll
  for (int nt = 0; nt < kNT128; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      int const t = r0 + g8 + 8 * hi, col = c128 + 8 * nt + 2 * t4;
      float2 d = make_float2(0.f, 0.f), q = d;
      if (t < L) {
        float2 const gg = *reinterpret_cast<float2 const*>(sm.g + t * kLdG + col);
        d = make_float2(acc[nt][2 * hi] * ex2(gg.x) * p.scale, acc[nt][2 * hi + 1] * ex2(gg.y) * p.scale);
        *reinterpret_cast<float2*>(p.dq + vrow(t) + col) = d;
        q = ld_bf16x2(sm.q + t * kLdK + col);
      }
      dg[nt][2 * hi] = q.x * d.x;
      dg[nt][2 * hi + 1] = q.y * d.y;
    }
  // 6. dk' = exp2(g_n - g) (v' dH); dg -= k dk'; colsum(k dk') into dgkp; kg = k e to shared memory (dv's place)
  float dk[kNT128][4];
  zero(dk);
  warp_mma<kNT128, kK, false, kVFirst>(dk, sm.vn + r0 * kLdK, kLdK, sm.dh + (kVFirst ? c128 : c128 * kLdK), kLdK, lane);
#pragma unroll
  for (int nt = 0; nt < kNT128; ++nt) {
    float cs[2] = {0.f, 0.f};
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      int const t = r0 + g8 + 8 * hi, col = c128 + 8 * nt + 2 * t4;
      float2 kk = make_float2(0.f, 0.f), kg = kk;
      if (t < L) {
        float2 const gg = *reinterpret_cast<float2 const*>(sm.g + t * kLdG + col);
        kk = ld_bf16x2(sm.k + t * kLdK + col);
        dk[nt][2 * hi] *= ex2(sm.gn[col] - gg.x);
        dk[nt][2 * hi + 1] *= ex2(sm.gn[col + 1] - gg.y);
        kg = make_float2(kk.x * ex2(gg.x), kk.y * ex2(gg.y));
      } else {
        dk[nt][2 * hi] = dk[nt][2 * hi + 1] = 0.f;
      }
      float const x0 = kk.x * dk[nt][2 * hi], x1 = kk.y * dk[nt][2 * hi + 1];
      dg[nt][2 * hi] -= x0;
      dg[nt][2 * hi + 1] -= x1;
      cs[0] += x0;
      cs[1] += x1;
      *reinterpret_cast<__nv_bfloat162*>(sm.dv + t * kLdK + col) = __floats2bfloat162_rn(kg.x, kg.y);
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {  // over the 8 row groups of the warp
      cs[0] += __shfl_xor_sync(0xffffffffu, cs[0], o);
      cs[1] += __shfl_xor_sync(0xffffffffu, cs[1], o);
    }
    if (g8 == 0) {
      sm.dgkp[w & 3][c128 + 8 * nt + 2 * t4] = cs[0];
      sm.dgkp[w & 3][c128 + 8 * nt + 2 * t4 + 1] = cs[1];
    }
  }
  __syncthreads();  // dw and kg complete; dgk complete; H and dH are dead
  // 7. dA += dw bf16(kg)^T (this warp's entries), then X = bf16(M(dA) diag(beta)) in H's place
  warp_mma<kNT64, kK, false, false>(dA, sm.v + r0 * kLdK, kLdK, sm.dv + c64 * kLdK, kLdK, lane);
  bf16* const X = sm.h;
#pragma unroll
  for (int nt = 0; nt < kNT64; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      int const t = r0 + g8 + 8 * hi, s = c64 + 8 * nt + 2 * t4;
      float const x0 = (s < t && t < L) ? dA[nt][2 * hi] * sm.beta[s] : 0.f;
      float const x1 = (s + 1 < t && t < L) ? dA[nt][2 * hi + 1] * sm.beta[s + 1] : 0.f;
      *reinterpret_cast<__nv_bfloat162*>(X + t * kLdC + s) = __floats2bfloat162_rn(x0, x1);
    }
  // 8. dkgb = bA dw: db, dg and dk
  zero(acc);
  warp_mma<kNT128, kC, true, true>(acc, sm.A + r0, kLdC, sm.v + c128, kLdK, lane);
#pragma unroll
  for (int nt = 0; nt < kNT128; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      int const t = r0 + g8 + 8 * hi, col = c128 + 8 * nt + 2 * t4;
      if (t >= L) continue;
      float2 const gg = *reinterpret_cast<float2 const*>(sm.g + t * kLdG + col);
      float2 const kk = ld_bf16x2(sm.k + t * kLdK + col);
      float const e0 = ex2(gg.x), e1 = ex2(gg.y), b = sm.beta[t];
      float const kg0 = kk.x * e0, kg1 = kk.y * e1, x0 = acc[nt][2 * hi], x1 = acc[nt][2 * hi + 1];
      dbp[hi] += x0 * kg0 + x1 * kg1;
      float2 d = make_float2(dg[nt][2 * hi] + kg0 * x0 * b, dg[nt][2 * hi + 1] + kg1 * x1 * b);
      if (t == L - 1) {
        d.x += sm.dgk_at(col);
        d.y += sm.dgk_at(col + 1);
      }
      *reinterpret_cast<float2*>(p.dg + vrow(t) + col) = d;
      *reinterpret_cast<float2*>(p.dk + vrow(t) + col) =
          make_float2(dk[nt][2 * hi] + x0 * e0 * b, dk[nt][2 * hi + 1] + x1 * e1 * b);
    }
  put_row_shares<false>(sm.db[w >> 2], dbp, r0, lane);
  float* const dAqk_sm = reinterpret_cast<float*>(sm.dh);  // kIntra: dAqk, dA_out [64][kLdF] in split_dA's layout
  float* const dAkk_sm = reinterpret_cast<float*>(sm.h);   // in dH's and (after X) H's places
  if constexpr (kIntra) {
    // 8b. dAqk = scale M'(do v'^T) (this warp's entries; rows >= L of do are zero)
    float a[kNT64][4];
    zero(a);
    warp_mma<kNT64, kK, false, false>(a, sm.dout + r0 * kLdK, kLdK, sm.vn + c64 * kLdK, kLdK, lane);
#pragma unroll
    for (int nt = 0; nt < kNT64; ++nt)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        int const t = r0 + g8 + 8 * hi, s = c64 + 8 * nt + 2 * t4;
        put_split_pair(dAqk_sm, t, s, s <= t ? a[nt][2 * hi] * p.scale : 0.f,
                       s + 1 <= t ? a[nt][2 * hi + 1] * p.scale : 0.f);
      }
  }
  __syncthreads();  // db, X (and dAqk) complete
  if (!kIntra && tid < L) p.db[(t0 + tid) * HV + hv] = sm.db_at(tid);
  // 9. Y = bf16(X Akk) in do's place, dA_out = -M(bA Y)
  bf16* const Y = sm.dout;
  float y[kNT64][4];
  zero(y);
  warp_mma<kNT64, kC, false, false>(y, X + r0 * kLdC, kLdC, sm.A + c64 * kLdC, kLdC, lane);
#pragma unroll
  for (int nt = 0; nt < kNT64; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
      *reinterpret_cast<__nv_bfloat162*>(Y + (r0 + g8 + 8 * hi) * kLdC + c64 + 8 * nt + 2 * t4) =
          __floats2bfloat162_rn(y[nt][2 * hi], y[nt][2 * hi + 1]);
  __syncthreads();
  zero(y);
  warp_mma<kNT64, kC, true, true>(y, sm.A + r0, kLdC, Y + c64, kLdC, lane);
#pragma unroll
  for (int nt = 0; nt < kNT64; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      int const t = r0 + g8 + 8 * hi, s = c64 + 8 * nt + 2 * t4;
      bool const in = t < L;
      float2 const d = make_float2(in && s < t ? -y[nt][2 * hi] : 0.f, in && s + 1 < t ? -y[nt][2 * hi + 1] : 0.f);
      if constexpr (kIntra) {
        put_split_pair(dAkk_sm, t, s, d.x, d.y);
      } else if (in) {
        *reinterpret_cast<float2*>(p.dA + ((t0 + t) * HV + hv) * kC + s) = d;
      }
    }
  if constexpr (kIntra) {
    // 10. the intra-chunk step on q, k, g, beta (still in shared memory), dAqk and dA_out
    __syncthreads();
    IntraTiles const tl{sm.g, sm.q, sm.k, sm.beta, dAqk_sm, dAkk_sm};
    int const I = w & 3;
    float aq[4][4], ak[4][4], at[4][4];
    intra_products<kWide>(tl, L, p.gate_shift, I, c128, lane, aq, ak, at);
    float db2[2] = {0.f, 0.f};
    float2 fq[2][kNT128], fk[2][kNT128];  // kL2: the final dq, dk of this thread's entries (zero past L)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < kNT128; ++nt) fq[h][nt] = fk[h][nt] = make_float2(0.f, 0.f);
    int64_t const row0 = vrow(0), row_step = int64_t(HV) * kK;  // element offset of row t: row0 + t row_step
    if constexpr (kWide) {
      intra_wide_fixup(tl, L, I, c128, lane, db2, [&](int t, int col, float2 dq, float2 dk, float2 dg) {
        int64_t const o = row0 + t * row_step + col;
        add_pair(p.dq + o, dq);
        add_pair(p.dk + o, dk);
        add_pair(p.dg + o, dg);
      });
    }
    intra_epilogue<kWide>(
        tl, L, p.gate_shift, I, c128, lane, aq, ak, at, db2,
        [&](int t, int col) {
          int64_t const o = row0 + t * row_step + col;
          return IntraIn{*reinterpret_cast<float2 const*>(p.dq + o), *reinterpret_cast<float2 const*>(p.dk + o),
                         *reinterpret_cast<float2 const*>(p.dg + o)};
        },
        [&](int t, int col, IntraIn const& r, int h, int nt) {
          int64_t const o = row0 + t * row_step + col;
          *reinterpret_cast<float2*>(p.dq + o) = r.dq;
          *reinterpret_cast<float2*>(p.dk + o) = r.dk;
          *reinterpret_cast<float2*>(p.dg + o) = r.dg;
          if constexpr (kL2) {
            fq[h][nt] = r.dq;
            fk[h][nt] = r.dk;
          }
        });
    put_row_shares<true>(sm.db[w >> 2], db2, r0, lane);
    if constexpr (kL2) {
      // 11. the l2norm backward from the final dq, dk of this thread's entries (kept from step 10): row dots over the
      // 4 channel quarters (Akk's dead place), then dqx, dkx in bf16
      float* const dots = reinterpret_cast<float*>(sm.A);  // [q, k][quarter][64]
      float rq[2], rk[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int const t = r0 + g8 + 8 * h;
        int64_t const row = (t0 + (t < L ? t : L - 1)) * HV + hv;  // H = HV: the head's row
        rq[h] = p.q_rstd[row];
        rk[h] = p.k_rstd[row];
        float a = 0.f, b = 0.f;  // this lane's shares of y . dq, y . dk on row t (zero past L)
#pragma unroll
        for (int nt = 0; nt < kNT128; ++nt) {
          int const col = c128 + 8 * nt + 2 * t4;
          float2 const y = ld_bf16x2(sm.q + t * kLdK + col), z = ld_bf16x2(sm.k + t * kLdK + col);
          a += y.x * fq[h][nt].x + y.y * fq[h][nt].y;
          b += z.x * fk[h][nt].x + z.y * fk[h][nt].y;
        }
        a += __shfl_xor_sync(0xffffffffu, a, 1);
        a += __shfl_xor_sync(0xffffffffu, a, 2);
        b += __shfl_xor_sync(0xffffffffu, b, 1);
        b += __shfl_xor_sync(0xffffffffu, b, 2);
        if (t4 == 0) {
          dots[(w >> 2) * kC + t] = a;
          dots[(4 + (w >> 2)) * kC + t] = b;
        }
      }
      __syncthreads();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int const t = r0 + g8 + 8 * h;
        if (t >= L) continue;
        float const dq_dot = dots[t] + dots[kC + t] + dots[2 * kC + t] + dots[3 * kC + t];
        float const dk_dot = dots[4 * kC + t] + dots[5 * kC + t] + dots[6 * kC + t] + dots[7 * kC + t];
        int64_t const row = (t0 + t) * HV + hv;
#pragma unroll
        for (int nt = 0; nt < kNT128; ++nt) {
          int const col = c128 + 8 * nt + 2 * t4;
          float2 const y = ld_bf16x2(sm.q + t * kLdK + col), z = ld_bf16x2(sm.k + t * kLdK + col);
          *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.dqx) + row * kK + col) =
              __floats2bfloat162_rn((fq[h][nt].x - dq_dot * y.x) * rq[h], (fq[h][nt].y - dq_dot * y.y) * rq[h]);
          *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.dkx) + row * kK + col) =
              __floats2bfloat162_rn((fk[h][nt].x - dk_dot * z.x) * rk[h], (fk[h][nt].y - dk_dot * z.y) * rk[h]);
        }
      }
    }
    __syncthreads();
    if (tid < L) {
      int t = tid;
      asm volatile("" : "+r"(t));  // an opaque row: its index is computed here, not kept live (spilled) from phase 1
      p.db[(t0 + t) * HV + hv] = sm.db_at(t);
    }
  }
}

}  // namespace fla_cula::kda_sm90
