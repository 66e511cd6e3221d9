// The intra-chunk step of the KDA backward as a warp-level device function: the gradients through the chunk-local
// Aqk and Akk (FLA's chunk_kda_bwd_intra; docs/kda_bwd_sm90.md), used by kda_bwd_intra_kernel and by kda_bwd_wy's
// fused form.
//
// Per (chunk, value head), tokens t, s < L of the chunk, channel c, E_tsc = exp2(g_tc - g_sc) for s <= t:
//   dq_t  += sum_s dAqk[t][s] E_ts k_s                      (row side)
//   dk'_t  = sum_{s<t} dAkk[t][s] E_ts k_s,   db_t += sum_c dk'_tc k_tc,   dk_t += beta_t dk'_t
//   dkt_s  = sum_{t>=s} E_ts (dAqk[t][s] q_t + dAkk[t][s] beta_t k_t)      (column side),   dk_s += dkt_s
//   dg_t  += q_t dq'_t + (beta_t dk'_t - dkt_t) k_t       (dq' the row side's dq term)
// as 16 x 16 x 16-token block products on the tensor cores. Blocks I, J of 16 tokens start at rows r_I = 16 I;
// D_m = exp2(g_{r_{m+1}} - g_{r_m}) per channel (<= 1). Off the diagonal every factor is <= 1:
//   row side of block I:    sum_{J<I} exp2(g_t - g_{r_I}) prod_{J<m<I} D_m (dA_IJ (k_J exp2(g_{r_{J+1}} - g_J)))
//   column side of block J: sum_{I>J} exp2(g_{r_{J+1}} - g_s) prod_{J<m<I} D_m (dA_IJ^T (x_I exp2(g_I - g_{r_I})))
// (x = q or beta k), summed Horner-wise over the blocks with the per-channel D_m applied to the accumulators. The
// diagonal block uses the anchor a_I = g_{r_I} - 7.5 shift (shift >= the largest per-token decay in log2,
// safe_gate's -lower_bound / ln 2): its factors exp2(g_t - a_I), exp2(a_I - g_s) lie in [2^-7.5 shift, 2^7.5 shift],
// inside fp32 for shift < 16.8 (lower_bound > -11.6). Without a per-token bound (kWide: softplus or precomputed
// gates) the anchors are per channel (diag_anchor): the midpoint of the block's span g_{r_I} - g_e (e its last row)
// while the span is <= kSpanMax (factors within 2^(+-60)); past it the channel is "wide": its row side is anchored at
// g_{r_I}, its column side at g_e (every factor <= 1), it leaves the block's own products, and its exact pairwise
// terms are added to the incoming gradients first (intra_wide_fixup; 16 ex2 per (token, channel) there). Each
// product is bf16x3: an fp32 operand x = hi + lo (two bf16), hi hi + hi lo + lo hi with fp32 accumulation (~2^-17
// relative; FLA: tf32, 2^-11). Warp w computes block I = w % 4 on both sides for the 32 channels 32 (w / 4) ..:
// I + 1 block pairs on the row side, 4 - I on the column side, five each (16 warps per chunk and value head). Shared
// tiles: g fp32 [64][kLdG], q, k bf16 [64][kLdK], beta [64], dAqk, dAkk [64][kLdF] ([t][s]: fp32 as loaded, then
// split once per CTA by split_dA into the bf16 hi / lo operands that ldmatrix reads, or stored split by
// put_split_pair); rows >= L zero.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kda_sm90/kda_fwd_kernel.cuh"

namespace fla_cula::kda_sm90 {

// A pair of bf16 values in shared memory as fp32 (the first at the lower address)
__device__ __forceinline__ float2 ld_bf16x2(void const* p) {
  uint32_t const x = *static_cast<uint32_t const*>(p);
  return make_float2(bf16_lo(x), bf16_hi(x));
}

// x[0], x[1] += d (a float2-aligned pair in shared or global memory)
__device__ __forceinline__ void add_pair(float* x, float2 d) {
  float2 const y = *reinterpret_cast<float2 const*>(x);
  *reinterpret_cast<float2*>(x) = make_float2(y.x + d.x, y.y + d.y);
}

// x = hi + lo for a pair of fp32 values: two packed bf16 pairs (the first value in the low halves)
struct Bf16x2Split {
  uint32_t hi, lo;
};
__device__ __forceinline__ Bf16x2Split split_bf16x2(float a, float b) {
  uint32_t const hi = pack_bf16(a, b);
  return {hi, pack_bf16(a - bf16_lo(hi), b - bf16_hi(hi))};
}

// An m16n8k16 operand pair split in hi and lo: A as a0..a3, B as b0, b1 (mma_bf16_16816's registers)
struct FragA3 {
  uint32_t hi[4], lo[4];
};
struct FragB3 {
  uint32_t hi[2], lo[2];
};

// acc += A B in bf16x3 (the small terms first)
__device__ __forceinline__ void mma3(float (&acc)[4], FragA3 const& a, FragB3 const& b) {
  mma_bf16_16816(acc, a.lo[0], a.lo[1], a.lo[2], a.lo[3], b.hi[0], b.hi[1]);
  mma_bf16_16816(acc, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b.lo[0], b.lo[1]);
  mma_bf16_16816(acc, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b.hi[0], b.hi[1]);
}

// dAqk and dAkk ([64][kLdF] fp32, [t][s]) split in place into the products' bf16 operands by the CTA's nthreads
// threads; a barrier must follow before intra_products reads them. Entries above the products' diagonal are zeroed
// (dAqk: s > t, dAkk: s >= t; every block the products read lies on or below the block diagonal, so this is their
// mask). The 8 entries of row t at s = 8 u .. 8 u + 7 (32 bytes) become their bf16 hi (bytes 32 u ..) and lo
// (32 u + 16 ..): each thread rewrites only the entries it read.
__device__ __forceinline__ void split_dA(float* dAqk, float* dAkk, int tid, int nthreads) {
  for (int i = tid; i < 2 * kC * 8; i += nthreads) {
    int const t = (i >> 3) & (kC - 1), u = i & 7, d = i / (kC * 8);  // d = 0: dAqk (s <= t kept), 1: dAkk (s < t)
    float* const p = (d ? dAkk : dAqk) + t * kLdF + 8 * u;
    float4 const a = *reinterpret_cast<float4 const*>(p), b = *reinterpret_cast<float4 const*>(p + 4);
    float const x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int const s = 8 * u + 2 * e;
      Bf16x2Split const sp = split_bf16x2(t - s >= d ? x[2 * e] : 0.f, t - s - 1 >= d ? x[2 * e + 1] : 0.f);
      hi[e] = sp.hi;
      lo[e] = sp.lo;
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(p + 4) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
}
static_assert(kLdF % 4 == 0, "split_dA: 16-byte aligned rows");

// Entries (t, s), (t, s + 1) (s even) of a [64][kLdF] tile stored in split_dA's layout from fp32 values a, b: the
// mma.sync epilogues' way to make a split tile without an fp32 pass (the caller applies the mask).
__device__ __forceinline__ void put_split_pair(float* tile, int t, int s, float a, float b) {
  Bf16x2Split const sp = split_bf16x2(a, b);
  uint32_t* const row = reinterpret_cast<uint32_t*>(tile + t * kLdF + (s & ~7));
  int const e = (s & 7) >> 1;
  row[e] = sp.hi;
  row[4 + e] = sp.lo;
}

// The A fragment (hi, lo) of the 16 x 16 tile at rows m0, columns k0 of a split dA tile (kTrans: of its transpose,
// A[m][k] = dA[k][m]): one ldmatrix for each half.
template <bool kTrans>
__device__ __forceinline__ FragA3 frag_a(float const* dA, int m0, int k0, int lane) {
  int const i = lane >> 3, j = lane & 7;  // lane 8 i + j addresses row j of 8 x 8 tile i
  // the hi of entries (t, s .. s + 7), s % 8 = 0; their lo is the next 8 bf16
  auto hi_at = [&](int t, int s) { return reinterpret_cast<bf16 const*>(dA + t * kLdF + s); };
  FragA3 f;
  if constexpr (kTrans) {  // tiles (m 0-7 | 8-15) x (k 0-7 | 8-15), stored as [k][m]
    bf16 const* const r = hi_at(k0 + 8 * (i >> 1) + j, m0 + 8 * (i & 1));
    ldmatrix_x4_trans(f.hi, r);
    ldmatrix_x4_trans(f.lo, r + 8);
  } else {
    bf16 const* const r = hi_at(m0 + 8 * (i & 1) + j, k0 + 8 * (i >> 1));
    ldmatrix_x4(f.hi, r);
    ldmatrix_x4(f.lo, r + 8);
  }
  return f;
}

// A bf16 [64][kLdK] tile x at this lane's B-operand positions of 16-token block J: entry (nt, e) is token
// 16 J + 2 t4 + {0, 1, 8, 9}[e] of channel c0 + 8 nt + g8 (nt < 4), by two ldmatrix.trans (load nt / 2, register
// 2 (nt % 2) + e / 2 holds the token pair, the even token in the low half)
struct TokenColumns {
  uint32_t r[2][4];
  __device__ __forceinline__ float operator()(int nt, int e) const {
    uint32_t const w = r[nt >> 1][2 * (nt & 1) + (e >> 1)];
    return e & 1 ? bf16_hi(w) : bf16_lo(w);
  }
};
__device__ __forceinline__ TokenColumns token_columns(bf16 const* x, int J, int c0, int lane) {
  int const i = lane >> 3, j = lane & 7;
  TokenColumns f;
#pragma unroll
  for (int np = 0; np < 2; ++np)
    ldmatrix_x4_trans(f.r[np], x + (16 * J + 8 * (i & 1) + j) * kLdK + c0 + 16 * np + 8 * (i >> 1));
  return f;
}

// acc[nt] *= f(c) at the accumulator columns c = c0 + 8 nt + 2 t4 + {0, 1}
template <class F>
__device__ __forceinline__ void scale_columns(float (&acc)[4][4], int c0, int lane, F const& f) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float const s = f(c0 + 8 * nt + 2 * (lane & 3) + e);
      acc[nt][e] *= s;
      acc[nt][2 + e] *= s;
    }
  }
}

// Entry (t, s) of a dA tile in split_dA's layout, as hi + lo
__device__ __forceinline__ float dA_at(float const* tile, int t, int s) {
  bf16 const* const row = reinterpret_cast<bf16 const*>(tile + t * kLdF + (s & ~7));
  return __bfloat162float(row[s & 7]) + __bfloat162float(row[8 + (s & 7)]);
}

// The unbounded form's anchors of channel c in the diagonal block of rows r0 .. e (e its last row < L)
struct DiagAnchor {
  float row, col;  // the row side's factors are exp2(g_t - row), exp2(row - g_s); the column side's likewise
  bool wide;
};
__device__ __forceinline__ DiagAnchor diag_anchor(float const* g, int r0, int e, int c) {
  float const top = g[r0 * kLdG + c], bot = g[e * kLdG + c], span = top - bot;
  if (span <= float(kSpanMax)) {
    float const mid = top - 0.5f * span;
    return {mid, mid, false};
  }
  return {top, bot, true};  // NaN spans too: their results are NaN either way
}

// The shared tiles of one (chunk, value head)
struct IntraTiles {
  float const* g;
  bf16 const* q;
  bf16 const* k;
  float const* beta;
  float const* dAqk;
  float const* dAkk;
};

// The block products of warp (I, channels c0 ..): aq = dq', ak = dk' (row side), at = dkt (column side) of block I,
// all relative to a_I (the epilogue's exp2(g_t - a_I), row side, and exp2(a_I - g_s), column side, still to apply;
// kWide: the channel's diag_anchor row / col). Nothing for a block without tokens (I > top).
template <bool kWide = false>
__device__ __forceinline__ void intra_products(IntraTiles const& tl, int L, float shift, int I, int c0, int lane,
                                               float (&aq)[4][4], float (&ak)[4][4], float (&at)[4][4]) {
  int const g8 = lane >> 2, t4 = lane & 3, r0 = 16 * I, top = (L - 1) >> 4;
  int const last = r0 + 15 < L - 1 ? r0 + 15 : L - 1;
  float const up = ex2(7.5f * shift), down = ex2(-7.5f * shift);  // exp2(+-(g_{r_I} - a_I))
  auto gs = [&](int t, int c) { return tl.g[t * kLdG + c]; };
  auto anchor = [&](int c) { return diag_anchor(tl.g, r0, last, c); };
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) aq[nt][e] = ak[nt][e] = at[nt][e] = 0.f;
  if (I > top) return;
#pragma unroll
  for (int J = 0; J < 4; ++J) {  // unrolled: every address below is a constant offset; J > I: nothing
    if (J > I) break;
    bool const diag = J == I;
    if (J > 0 && !diag) scale_columns(aq, c0, lane, [&](int c) { return ex2(gs(16 * J + 16, c) - gs(16 * J, c)); });
    if (J > 0 && !diag) scale_columns(ak, c0, lane, [&](int c) { return ex2(gs(16 * J + 16, c) - gs(16 * J, c)); });
    if (diag && I > 0) {  // exp2(g_t - g_{r_I}) = exp2(g_t - a_I) exp2(a_I - g_{r_I})
      if constexpr (kWide) {
        auto const f = [&](int c) { return ex2(anchor(c).row - gs(r0, c)); };
        scale_columns(aq, c0, lane, f);
        scale_columns(ak, c0, lane, f);
      } else {
        scale_columns(aq, c0, lane, [&](int) { return down; });
        scale_columns(ak, c0, lane, [&](int) { return down; });
      }
    }
    FragA3 const fq = frag_a<false>(tl.dAqk, r0, 16 * J, lane);  // s <= t
    FragA3 const fk = frag_a<false>(tl.dAkk, r0, 16 * J, lane);  // s < t
    TokenColumns const kc = token_columns(tl.k, J, c0, lane);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      int const c = c0 + 8 * nt + g8;
      float ref = diag ? gs(r0, c) - 7.5f * shift : gs(16 * J + 16, c);
      bool skip = false;  // a wide channel's own block: its terms come from intra_wide_fixup
      if constexpr (kWide) {
        if (diag) {
          DiagAnchor const a = anchor(c);
          ref = a.row;
          skip = a.wide;
        }
      }
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // tokens s = 16 J + 2 t4 + {0, 1, 8, 9}
        int const s = 16 * J + 2 * t4 + (e & 1) + 8 * (e >> 1);
        x[e] = s < L && !skip ? kc(nt, e) * ex2(ref - gs(s, c)) : 0.f;
      }
      Bf16x2Split const b0 = split_bf16x2(x[0], x[1]), b1 = split_bf16x2(x[2], x[3]);
      FragB3 const fb{{b0.hi, b1.hi}, {b0.lo, b1.lo}};
      mma3(aq[nt], fq, fb);
      mma3(ak[nt], fk, fb);
    }
  }
#pragma unroll
  for (int J = 3; J >= 0; --J) {  // J: the row block of dA here, I its column block
    if (J > top) continue;
    if (J < I) break;
    bool const diag = J == I;
    if (J < top && !diag) scale_columns(at, c0, lane, [&](int c) { return ex2(gs(16 * J + 16, c) - gs(16 * J, c)); });
    if (diag && J < top) {
      // exp2(g_{r_{I+1}} - g_s) = exp2(a_I - g_s) exp2(g_{r_{I+1}} - a_I), exp2(g_{r_I} - a_I) = up
      if constexpr (kWide) {
        scale_columns(at, c0, lane, [&](int c) { return ex2(gs(r0 + 16, c) - anchor(c).col); });
      } else {
        scale_columns(at, c0, lane, [&](int c) { return ex2(gs(r0 + 16, c) - gs(r0, c)) * up; });
      }
    }
    FragA3 const fq = frag_a<true>(tl.dAqk, r0, 16 * J, lane);  // A[s][t] = dAqk[t][s], t >= s
    FragA3 const fk = frag_a<true>(tl.dAkk, r0, 16 * J, lane);  // t > s
    TokenColumns const qc = token_columns(tl.q, J, c0, lane), kc = token_columns(tl.k, J, c0, lane);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      int const c = c0 + 8 * nt + g8;
      float ref = diag ? gs(r0, c) - 7.5f * shift : gs(16 * J, c);
      bool skip = false;
      if constexpr (kWide) {
        if (diag) {
          DiagAnchor const a = anchor(c);
          ref = a.col;
          skip = a.wide;
        }
      }
      float xq[4], xk[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // tokens t = 16 J + 2 t4 + {0, 1, 8, 9}
        int const t = 16 * J + 2 * t4 + (e & 1) + 8 * (e >> 1);
        float const f = t < L && !skip ? ex2(gs(t, c) - ref) : 0.f;
        xq[e] = qc(nt, e) * f;
        xk[e] = tl.beta[t] * kc(nt, e) * f;
      }
      Bf16x2Split const q0 = split_bf16x2(xq[0], xq[1]), q1 = split_bf16x2(xq[2], xq[3]);
      Bf16x2Split const k0 = split_bf16x2(xk[0], xk[1]), k1 = split_bf16x2(xk[2], xk[3]);
      mma3(at[nt], fq, FragB3{{q0.hi, q1.hi}, {q0.lo, q1.lo}});
      mma3(at[nt], fk, FragB3{{k0.hi, k1.hi}, {k0.lo, k1.lo}});
    }
  }
}

// kWide, before intra_epilogue: a wide channel's terms within its diagonal block (rows r0 .. e), pairwise with every
// factor <= 1, for this thread's entries (intra_epilogue's positions): row t's dq' and dk' (s <= t) and column t's
// dkt (u >= t),
//   w.q = sum_{s<=t} dAqk[t][s] E_ts k_s,   w.k likewise with dAkk,
//   w.t = sum_{u>=t} E_ut (dAqk[u][t] q_u + dAkk[u][t] beta_u k_u),
// added to the incoming values as the epilogue adds dq', dk', dkt (it is linear in them) through
// add(t, c, dq, dk, dg) (float2 over channels c, c + 1; each entry read and written by its owner thread) and to dbp.
// Four passes (row h, 4 of this thread's 8 channels), each one loop over the block's tokens: a token's g, k, q and 4
// dA entries loaded once for 4 entries, one ex2 each (E_ts for s <= t, E_st past it). A pass without a wide channel
// is skipped, the whole step where the warp has none.
template <class Add>
__device__ __forceinline__ void intra_wide_fixup(IntraTiles const& tl, int L, int I, int c0, int lane,
                                                 float (&dbp)[2], Add const& add) {
  int const g8 = lane >> 2, t4 = lane & 3, r0 = 16 * I;
  if (I > (L - 1) >> 4) return;
  int const last = r0 + 15 < L - 1 ? r0 + 15 : L - 1;
  auto col = [&](int j) { return c0 + 8 * (j >> 1) + 2 * t4 + (j & 1); };  // channel j of this thread's 8
  unsigned wide = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) wide |= unsigned(diag_anchor(tl.g, r0, last, col(j)).wide) << j;
  if (!__any_sync(0xffffffffu, wide != 0)) return;
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {  // row h = pass / 2, channels 4 (pass % 2) .. + 3 of this thread's 8
    int const h = pass >> 1, j0 = 4 * (pass & 1), t = r0 + g8 + 8 * h;
    unsigned const on = (wide >> j0) & 15u;  // its wide channels (the others: the epilogue has their terms)
    if (t >= L || !on) continue;
    float gt[4], wq[4], wk[4], wt[4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float2 const x = *reinterpret_cast<float2 const*>(tl.g + t * kLdG + col(j0 + 2 * n));
      gt[2 * n] = x.x, gt[2 * n + 1] = x.y;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) wq[j] = wk[j] = wt[j] = 0.f;
#pragma unroll 1
    for (int s = r0; s <= last; ++s) {
      bool const row = s <= t, column = s >= t;  // dAkk is zero on its diagonal
      float const aq = row ? dA_at(tl.dAqk, t, s) : 0.f, ak = row ? dA_at(tl.dAkk, t, s) : 0.f;
      float const tq = column ? dA_at(tl.dAqk, s, t) : 0.f, tk = column ? dA_at(tl.dAkk, s, t) * tl.beta[s] : 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        int const c = col(j0 + 2 * n);
        float2 const gs = *reinterpret_cast<float2 const*>(tl.g + s * kLdG + c);
        float2 const ks = ld_bf16x2(tl.k + s * kLdK + c), qs = ld_bf16x2(tl.q + s * kLdK + c);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          int const j = 2 * n + e;
          float const g = e ? gs.y : gs.x, kv = e ? ks.y : ks.x, qv = e ? qs.y : qs.x;
          float const E = ex2(row ? gt[j] - g : g - gt[j]);
          float const x = E * kv;
          wq[j] += aq * x;
          wk[j] += ak * x;
          wt[j] += E * (tq * qv + tk * kv);
        }
      }
    }
    float const b = tl.beta[t];
    float db = 0.f;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      if (!((on >> (2 * n)) & 3u)) continue;
      int const c = col(j0 + 2 * n);
      float2 const kk = ld_bf16x2(tl.k + t * kLdK + c), qq = ld_bf16x2(tl.q + t * kLdK + c);
      float dq[2], dk[2], dg[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int const j = 2 * n + e;
        bool const w = (on >> j) & 1u;
        float const q2 = w ? wq[j] : 0.f, k2 = w ? wk[j] : 0.f, t2 = w ? wt[j] : 0.f;
        float const kv = e ? kk.y : kk.x, qv = e ? qq.y : qq.x;
        dq[e] = q2;
        dk[e] = b * k2 + t2;
        dg[e] = qv * q2 + (b * k2 - t2) * kv;
        db += k2 * kv;
      }
      add(t, c, make_float2(dq[0], dq[1]), make_float2(dk[0], dk[1]), make_float2(dg[0], dg[1]));
    }
    dbp[0] += h ? 0.f : db;  // (h is a loop variable: dbp stays in registers)
    dbp[1] += h ? db : 0.f;
  }
}

// The step's outputs at warp (I, c0)'s accumulator positions (rows t = 16 I + g8 + 8 h < L, channels c = c0 + 8 nt
// + 2 t4, c + 1): in(t, c) gives the incoming dq, dk, dg there (IntraIn), out(t, c, IntraIn, h, nt) takes the results;
// dbp[h] gains this lane's share of row t's db term (sum over its channels of dk' k).
struct IntraIn {
  float2 dq, dk, dg;
};
template <bool kWide = false, class In, class Out>
__device__ __forceinline__ void intra_epilogue(IntraTiles const& tl, int L, float shift, int I, int c0, int lane,
                                               float const (&aq)[4][4], float const (&ak)[4][4],
                                               float const (&at)[4][4], float (&dbp)[2], In const& in,
                                               Out const& out) {
  int const g8 = lane >> 2, t4 = lane & 3, r0 = 16 * I, last = r0 + 15 < L - 1 ? r0 + 15 : L - 1;
  if (I > (L - 1) >> 4) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int const t = r0 + g8 + 8 * h;
    if (t >= L) continue;
    float const b = tl.beta[t];
    IntraIn xs[4];  // the row's inputs loaded before its first store: out may alias in for all the compiler knows
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) xs[nt] = in(t, c0 + 8 * nt + 2 * t4);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      int const c = c0 + 8 * nt + 2 * t4;
      IntraIn const& x = xs[nt];
      float rq[2], rk[2], rg[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float const gt = tl.g[t * kLdG + c + e];
        float dq2, dk2, dkt;
        if constexpr (kWide) {  // (a wide channel's own block: added to the incoming values by intra_wide_fixup)
          DiagAnchor const a = diag_anchor(tl.g, r0, last, c + e);
          float const eq = ex2(gt - a.row), es = ex2(a.col - gt);
          dq2 = eq * aq[nt][2 * h + e], dk2 = eq * ak[nt][2 * h + e], dkt = es * at[nt][2 * h + e];
        } else {
          float const a = tl.g[r0 * kLdG + c + e] - 7.5f * shift;
          float const eq = ex2(gt - a), es = ex2(a - gt);
          dq2 = eq * aq[nt][2 * h + e], dk2 = eq * ak[nt][2 * h + e], dkt = es * at[nt][2 * h + e];
        }
        float const kk = __bfloat162float(tl.k[t * kLdK + c + e]), qq = __bfloat162float(tl.q[t * kLdK + c + e]);
        dbp[h] += dk2 * kk;
        rq[e] = (e ? x.dq.y : x.dq.x) + dq2;
        rk[e] = (e ? x.dk.y : x.dk.x) + b * dk2 + dkt;
        rg[e] = (e ? x.dg.y : x.dg.x) + qq * dq2 + (b * dk2 - dkt) * kk;
      }
      out(t, c, IntraIn{make_float2(rq[0], rq[1]), make_float2(rk[0], rk[1]), make_float2(rg[0], rg[1])}, h, nt);
    }
  }
}

}  // namespace fla_cula::kda_sm90
