# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""KDA multi-token decode step on tensor cores (SM90, CuTe DSL, mma.sync TF32 in 3xTF32).

The token-by-token kernel (recurrent_decode.py) spends ~9 instructions per state element per token
(decay, two K reductions with their shuffles and cross-warp sums, the rank-1 update); a T-token step
is bound by that instruction issue, not by the state stream (docs/decode_kernels.md). Here a
sequence's tokens are taken in chunks of C = 4 in WY form, so the state is touched by two small
matrix products per chunk, both on tensor cores:

  per (sequence n, value head hv), S_0 = the state at the chunk start, tokens t = 0..C-1,
  alpha_t = exp(a_t) in R^K (per-token decay), Gamma_t = alpha_0 ... alpha_t (elementwise),
  P(s, t) = alpha_{s+1} ... alpha_t (s <= t; P(t, t) = 1), k, q already l2-normalized (rk, rq):
    W   = S_0^T [Gamma_0 k_0, Gamma_0 q_0, ..., Gamma_3 k_3, Gamma_3 q_3]         (V x 2C, MMA 1)
    A_ts = sum_k k_s k_t P(s, t) (s < t),  B_ts = sum_k k_s q_t P(s, t) (s <= t)   (C x C, per CTA)
    u_t = beta_t (v_t - W_k,t - sum_{s<t} A_ts u_s)                                (forward substitution)
    o_t = W_q,t + sum_{s<=t} B_ts u_s
    S_C = diag(Gamma_3) S_0 + sum_s diag(P(s, 3)) k_s u_s^T = decay + U E^T        (V x K += V x C C x K, MMA 2)
  which is exactly the recurrence S'_t = diag(alpha_t) S_{t-1}, u_t = beta_t (v_t - S'_t^T k_t),
  S_t = S'_t + k_t u_t^T, o_t = S_t^T q_t reassociated. Decay products are formed by multiplication
  (never exp of a difference of cumulative sums, never a division), so any gate, however strong, is
  safe: a product underflows to 0 exactly where the recurrence's state does.

Precision: both products in 3xTF32 (fp32-class, see _mma.py); the decay multiply and the state
accumulate in float32 FMAs.

Work split: grid (V/64, HV, N); a CTA of 4 warps owns 64 value columns of one state. Warp w owns
value columns v0 = 64 cb + 32 (w % 2) .. +32 and key rows 64 (w // 2) .. +64; lane (g, t) = (lane/4,
lane%4) owns v = v0 + 4g + a (a < 4) x k = kb + 16 i + 4 t + b (i, b < 4): a 4 x 16 fp32 fragment
(64 registers) that is, element for element, the MMA A operand of S^T (MMA 1, with a K permutation
folded into the staged X) and the accumulator layout of MMA 2 (no shuffles between them). The two
key halves' partial W are summed through shared memory. Global access: [K,V] 16 x 16-byte loads
per thread (a warp instruction reads 4 rows x 128 bytes), [V,K] likewise (8 rows x 64 bytes).
Per chunk, thread k stages K position k (decays, X, E, the C x C sums' terms) in shared memory.

Static (compile key): state layout, dtypes, which optional inputs exist, gate / l2norm / beta flags.
Symbolic: B, T, H, HV, N, state count - as in recurrent_decode. No state pools (per-token pool
writes stay on recurrent_decode).
"""

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fla_cula.jit import KernelSpec, register_kernel
from fla_cula.kernels._dsl import assume_align, decode_fake_args, fexp, make_decay, make_seq_span, sigmoid, vec4
from fla_cula.kernels._mma import mma3_m16n8k4, mma3_m16n8k8, tf32_split
from fla_cula.kernels._tuning import TUNING

C = 4            # tokens per chunk (MMA 1: N = 2C = 8; MMA 2: K = C = 4)
NTHR = 128       # 4 warps; thread k stages K position k
NR_L2 = 24       # per-chunk sums over K: A (6), B (10), |q_t|^2 (4), |k_t|^2 (4)
# shared-memory row strides (32-bit words), padded so the fragment reads are bank-conflict free
ROW_X = 2 * 128 + 4   # X [2C][K/2][hi x2, lo x2]: a lane's LDS.128 per k-step, rows 1040 B apart
ROW_E = 2 * 128 + 8   # E [C][(kh, j, g)][hi, lo]: LDS.64 per n-tile, rows 1056 B apart
ROW_R = 128 + 16      # per-k terms of the C x C sums: [r][k], 4 readers per row


@dataclass(frozen=True)
class MmaDecodeConfig:
    """The specialization (compile key); field names follow DecodeConfig's."""

    state_v_first: bool = False
    qk_dtype: str = "bfloat16"
    v_dtype: str = "bfloat16"
    g_dtype: str = "bfloat16"
    beta_dtype: str = "bfloat16"
    o_dtype: str = "bfloat16"
    has_h0: bool = True
    has_ht: bool = True
    varlen: bool = False
    cu_dtype: str = "int32"
    l2norm: bool = False
    gate_in_kernel: bool = False
    has_A: bool = False
    a_dtype: str = "float32"
    has_bias: bool = False
    bias_dtype: str = "float32"
    has_lower_bound: bool = False
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    # CTAs per SM asked of ptxas (nvvm.minctasm; 0: no cap). 4 caps registers at 128 (24 B of stack),
    # so registers and the ~31 KiB of shared memory both allow 4 CTAs/SM; uncapped, the serving
    # config takes 144 registers and 3 CTAs/SM fit.
    min_ctas: int = 4
    # fixed here (read by decode_fake_args): KDA, K = V = 128, no state pool
    mode = "kda"
    K = 128
    V = 128
    pool = 0
    spec = False
    idx_dtype = "int32"
    na_dtype = "int32"

    def key(self):
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))

    @classmethod
    def from_decode(cls, cfg) -> "MmaDecodeConfig":
        """The same call's config for this kernel (a DecodeConfig with mode 'kda' and no pool)."""
        if cfg.mode != "kda" or cfg.pool:
            raise ValueError(f"recurrent_decode_mma serves KDA without state pools, got mode={cfg.mode} "
                             f"pool={cfg.pool}")
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if f.name != "min_ctas"})


def _frag_view(VF, t2d, v0g, k0):
    """A thread's 64-element state fragment ((b, i), a) -> S[k0 + 16 i + b, v0g + a] as a 16-byte
    aligned view of one (K, V) [K,V] or (V, K) [V,K] state: 16 vectors of 4 along the contiguous dim."""
    if VF:
        kk = t2d.shape[1]
        lay = cute.make_layout(((4, 4), 4), stride=((1, 16), kk))
        off = v0g * kk + k0
    else:
        vv = t2d.shape[1]
        lay = cute.make_layout(((4, 4), 4), stride=((vv, 16 * vv), 1))
        off = k0 * vv + v0g
    return assume_align(cute.make_tensor(t2d.iterator + off, lay), 16)


def _frag_regs(VF):
    """Registers of the fragment, laid out like the global view (the vectors stay vectors)."""
    if VF:
        return cute.make_rmem_tensor(cute.make_layout(((4, 4), 4), stride=((1, 4), 16)), Float32)
    return cute.make_rmem_tensor(cute.make_layout(((4, 4), 4), stride=((4, 16), 1)), Float32)


def _smem_vec(base, off, n, dtype_bytes=4):
    """n contiguous 32-bit words of a shared-memory tensor at word offset `off` (aligned to n words)."""
    return assume_align(cute.make_tensor(base.iterator + off, cute.make_layout((n,), stride=(1,))), n * dtype_bytes)


class RecurrentDecodeMma:
    """Static config + @cute.jit launcher + @cute.kernel body."""

    def __init__(self, cfg: MmaDecodeConfig):
        self.cfg = cfg

    def jit_fn(self):
        cfg = self.cfg
        K = cfg.K
        VF = cfg.state_v_first
        NR = NR_L2 if cfg.l2norm else 16
        f32 = Float32
        decay = make_decay(cfg)
        seq_span = make_seq_span(cfg)

        @cute.kernel
        def kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                   mBeta: cute.Tensor, mA: cute.Tensor, mBias: cute.Tensor, mH0: cute.Tensor,
                   mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, mIdx: cute.Tensor,
                   mNa: cute.Tensor, scale: f32, lower_bound: f32):
            tidx, _, _ = cute.arch.thread_idx()
            lane = tidx % 32
            warp = tidx // 32
            g = lane // 4
            t = lane % 4
            kh = warp // 2
            kb = 64 * kh
            cb, hv, n = cute.arch.block_idx()
            HQ = mQ.shape[2]
            HVn = mV.shape[2]
            hq = hv // (HVn // HQ)
            v0 = 64 * cb + 32 * (warp % 2)
            b, bos, Tn = seq_span(mQ, mCu, n)

            smem = cutlass.memory.SmemAllocator()
            sX = smem.allocate_tensor(Int32, cute.make_layout((2 * C * ROW_X,)), byte_alignment=16)
            sE = smem.allocate_tensor(Int32, cute.make_layout((C * ROW_E,)), byte_alignment=16)
            sGam = smem.allocate_tensor(f32, cute.make_layout((K,)), byte_alignment=16)
            sR = smem.allocate_tensor(f32, cute.make_layout((NR * ROW_R,)), byte_alignment=16)
            sRaw = smem.allocate_tensor(f32, cute.make_layout((NR_L2,)), byte_alignment=16)
            sW = smem.allocate_tensor(f32, cute.make_layout((4 * 2 * 32 * 4,)), byte_alignment=16)

            # ---- the state fragment (first in the issue order: its stream overlaps the staging) ----
            rS = _frag_regs(VF)
            rS.fill(0.0)
            if cutlass.const_expr(cfg.has_h0):
                cute.autovec_copy(_frag_view(VF, mH0[n, hv, None, None], v0 + 4 * g, kb + 4 * t), rS)

            # per-head / per-k constants of the staging thread (K position tidx)
            aexp = f32(1.0)
            if cutlass.const_expr(cfg.gate_in_kernel and cfg.has_A):
                aexp = fexp(f32(mA[hv]))
            bias = f32(0.0)
            if cutlass.const_expr(cfg.gate_in_kernel and cfg.has_bias):
                bias = f32(mBias[hv * K + tidx])
            # where thread k's E^T column goes: (kh, j, g) of the MMA-2 B operand (k = kb + kmap(j, g))
            kl = tidx % 64
            # and its X word: pairs of K positions as [hi(2m), hi(2m+1), lo(2m), lo(2m+1)] (one B-operand pair each)
            x_pos = 4 * (tidx // 2) + tidx % 2
            e_pos = (tidx // 64) * 64 + (2 * (kl // 16) + (kl // 2) % 2) * 8 + 2 * ((kl // 4) % 4) + kl % 2

            for c in cutlass.range((Tn + C - 1) // C, unroll=1):
                t0 = C * c
                cn = cutlass.min(Int32(C), Tn - t0)
                if c > 0:
                    cute.arch.barrier()  # the previous chunk's shared-memory reads are done
                # lane t's token inputs for the solve (v columns, beta), issued before everything that
                # waits: a load behind the barriers below would add a memory latency to every chunk
                tok = bos + t0 + cutlass.min(t, cn - 1)
                ok = t < cn
                rv = cute.make_rmem_tensor((4,), mV.element_type)
                cute.autovec_copy(vec4(mV[b, tok, hv, None], v0 // 4 + g), rv)
                bt = f32(mBeta[b, tok, hv])
                # ---- staging: thread k = tidx, tokens tau < C (past the sequence end: k = q = 0, alpha = 1)
                qs = []
                ks = []
                als = []
                for tau in cutlass.range_constexpr(C):
                    stok = bos + t0 + cutlass.min(Int32(tau), cn - 1)
                    sok = Int32(tau) < cn
                    qv = f32(mQ[b, stok, hq, tidx])
                    kv = f32(mK[b, stok, hq, tidx])
                    al = decay(f32(mG[b, stok, hv, tidx]), bias, aexp, lower_bound)
                    qs.append(f32(cutlass.select_(sok, qv, f32(0.0))))
                    ks.append(f32(cutlass.select_(sok, kv, f32(0.0))))
                    als.append(f32(cutlass.select_(sok, al, f32(1.0))))
                gam = als[0]
                for tau in cutlass.range_constexpr(C):
                    if tau > 0:
                        gam = gam * als[tau]
                    for col, x in ((2 * tau, ks[tau]), (2 * tau + 1, qs[tau])):
                        hi, lo = tf32_split(gam * x)
                        sX[col * ROW_X + x_pos] = hi
                        sX[col * ROW_X + x_pos + 2] = lo
                sGam[tidx] = gam
                # P(s, t) products; E^T row s = P(s, C-1) k_s
                P = [[f32(1.0)] * C for _ in range(C)]
                for tt in cutlass.range_constexpr(1, C):
                    for s in cutlass.range_constexpr(tt):
                        P[s][tt] = als[tt] if s == tt - 1 else P[s][tt - 1] * als[tt]
                for s in cutlass.range_constexpr(C):
                    hi, lo = tf32_split(P[s][C - 1] * ks[s] if s < C - 1 else ks[s])
                    sE[s * ROW_E + 2 * e_pos] = hi
                    sE[s * ROW_E + 2 * e_pos + 1] = lo
                # per-k terms of the C x C sums (row r of sR): A pairs, B pairs, norms
                r = 0
                for tt in cutlass.range_constexpr(1, C):
                    for s in cutlass.range_constexpr(tt):
                        sR[r * ROW_R + tidx] = ks[s] * ks[tt] * P[s][tt]
                        r += 1
                for tt in cutlass.range_constexpr(C):
                    for s in cutlass.range_constexpr(tt + 1):
                        sR[r * ROW_R + tidx] = ks[s] * qs[tt] if s == tt else ks[s] * P[s][tt] * qs[tt]
                        r += 1
                if cutlass.const_expr(cfg.l2norm):
                    for tt in cutlass.range_constexpr(C):
                        sR[(16 + tt) * ROW_R + tidx] = qs[tt] * qs[tt]
                        sR[(20 + tt) * ROW_R + tidx] = ks[tt] * ks[tt]
                cute.arch.barrier()

                # ---- the C x C sums: 4 threads per row (warp-uniform: NR x 4 = 64 or 96 threads)
                if tidx < 4 * NR:
                    rr = tidx // 4
                    q4 = tidx % 4
                    acc = f32(0.0)
                    for m in cutlass.range_constexpr(8):
                        v4 = cute.make_rmem_tensor((4,), f32)
                        cute.autovec_copy(_smem_vec(sR, rr * ROW_R + 16 * m + 4 * q4, 4), v4)
                        acc = acc + (v4[0] + v4[1]) + (v4[2] + v4[3])
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1)
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=2)
                    if q4 == 0:
                        sRaw[rr] = acc

                # ---- MMA 1: W = S_0^T X over this warp's 64 key rows (8 k-steps x 2 m-tiles)
                # accumulators [m-tile][k-step parity]: 4 independent chains of 12 dependent HMMAs, not 2 of 24
                Wp = [[[f32(0.0)] * 4 for _ in range(2)] for _ in range(2)]
                for j in cutlass.range_constexpr(8):
                    i = j // 2
                    bb = 2 * (j % 2)
                    xb = cute.make_rmem_tensor((4,), Int32)  # hi of X[k0, g], X[k0 + 1, g], then their lo
                    cute.autovec_copy(_smem_vec(sX, g * ROW_X + 2 * (kb + 16 * i + 4 * t + bb), 4), xb)
                    for mt in cutlass.range_constexpr(2):
                        a = [tf32_split(rS[(bb, i), 2 * mt]), tf32_split(rS[(bb, i), 2 * mt + 1]),
                             tf32_split(rS[(bb + 1, i), 2 * mt]), tf32_split(rS[(bb + 1, i), 2 * mt + 1])]
                        Wp[mt][j % 2] = mma3_m16n8k8([x[0] for x in a], [x[1] for x in a], [xb[0], xb[1]],
                                                     [xb[2], xb[3]], Wp[mt][j % 2])
                W = [[Wp[mt][0][e] + Wp[mt][1][e] for e in range(4)] for mt in range(2)]
                for mt in cutlass.range_constexpr(2):
                    wv = cute.make_rmem_tensor((4,), f32)
                    for e in cutlass.range_constexpr(4):
                        wv[e] = W[mt][e]
                    cute.autovec_copy(wv, _smem_vec(sW, ((warp * 2 + mt) * 32 + lane) * 4, 4))
                cute.arch.barrier()

                # ---- full W (the other key half's partial), then lane t solves token t for its 4 columns
                wk = [f32(0.0)] * 4  # S_0^T (Gamma_t k_t) at v = v0 + 4g + a
                wq = [f32(0.0)] * 4
                for mt in cutlass.range_constexpr(2):
                    wv = cute.make_rmem_tensor((4,), f32)
                    cute.autovec_copy(_smem_vec(sW, (((warp ^ 2) * 2 + mt) * 32 + lane) * 4, 4), wv)
                    for rw in cutlass.range_constexpr(2):
                        wk[2 * mt + rw] = W[mt][2 * rw] + wv[2 * rw]
                        wq[2 * mt + rw] = W[mt][2 * rw + 1] + wv[2 * rw + 1]
                rk = [f32(1.0)] * C
                rk_t = f32(1.0)
                rq_t = scale
                if cutlass.const_expr(cfg.l2norm):
                    for s in cutlass.range_constexpr(C):
                        rk[s] = cute.math.rsqrt(sRaw[20 + s] + f32(1e-6), fastmath=False)
                    rk_t = cute.math.rsqrt(sRaw[20 + t] + f32(1e-6), fastmath=False)
                    rq_t = scale * cute.math.rsqrt(sRaw[16 + t] + f32(1e-6), fastmath=False)
                if cutlass.const_expr(cfg.beta_sigmoid):
                    bt = sigmoid(bt)
                    if cutlass.const_expr(cfg.neg_eigval):
                        bt = bt * f32(2.0)
                bt = f32(cutlass.select_(ok, bt, f32(0.0)))
                vf = rv.load().to(f32)
                acc = [vf[a] - rk_t * wk[a] for a in range(4)]
                ov = [rq_t * wq[a] for a in range(4)]
                tri = t * (t - 1) // 2  # row of A(0, t) in sRaw; B(0, t) at 6 + t (t + 1) / 2
                for s in cutlass.range_constexpr(C):
                    # u_s (final in lane s after rounds < s), broadcast within the lane's group g
                    us = [cute.arch.shuffle_sync(bt * acc[a], offset=4 * g + s) for a in range(4)]
                    if cutlass.const_expr(s < C - 1):
                        a_ts = f32(cutlass.select_(Int32(s) < t, sRaw[tri + s] * rk_t * rk[s], f32(0.0)))
                        for a in cutlass.range_constexpr(4):
                            acc[a] = acc[a] - a_ts * us[a]
                    b_ts = f32(cutlass.select_(Int32(s) <= t, sRaw[6 + tri + t + s] * rq_t * rk[s], f32(0.0)))
                    for a in cutlass.range_constexpr(4):
                        ov[a] = ov[a] + b_ts * us[a]
                if kh == 0 and ok:
                    ro = cute.make_rmem_tensor((4,), mO.element_type)
                    for a in cutlass.range_constexpr(4):
                        ro[a] = ov[a].to(mO.element_type)
                    cute.autovec_copy(ro, vec4(mO[b, tok, hv, None], v0 // 4 + g))

                # ---- MMA 2: S = diag(Gamma_3) S_0 + U E^T on this warp's 64 key rows (8 n-tiles x 2 m-tiles)
                uu = [tf32_split(bt * acc[a] * rk_t) for a in range(4)]  # U[v, t] with E's raw k_t: rk_t here
                for j in cutlass.range_constexpr(8):
                    i = j // 2
                    bb = 2 * (j % 2)
                    eb = cute.make_rmem_tensor((2,), Int32)
                    cute.autovec_copy(_smem_vec(sE, t * ROW_E + 2 * (kb + 8 * j + g), 2), eb)
                    gv = cute.make_rmem_tensor((2,), f32)
                    cute.autovec_copy(_smem_vec(sGam, kb + 16 * i + 4 * t + bb, 2), gv)
                    for mt in cutlass.range_constexpr(2):
                        d = mma3_m16n8k4([uu[2 * mt][0], uu[2 * mt + 1][0]], [uu[2 * mt][1], uu[2 * mt + 1][1]],
                                         [eb[0]], [eb[1]], [f32(0.0)] * 4)
                        for rw in cutlass.range_constexpr(2):
                            for e in cutlass.range_constexpr(2):
                                x = rS[(bb + e, i), 2 * mt + rw]
                                rS[(bb + e, i), 2 * mt + rw] = x * gv[e] + d[2 * rw + e]

            if cutlass.const_expr(cfg.has_ht):
                cute.autovec_copy(rS, _frag_view(VF, mHt[n, hv, None, None], v0 + 4 * g, kb + 4 * t))

        @cute.jit
        def launch(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                   mBeta: cute.Tensor, mA: cute.Tensor, mBias: cute.Tensor, mH0: cute.Tensor,
                   mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, mIdx: cute.Tensor,
                   mNa: cute.Tensor, scale: f32, lower_bound: f32, stream):
            if cutlass.const_expr(cfg.varlen):
                nseq = mCu.shape[0] - 1
            else:
                nseq = mQ.shape[0]
            k = kernel(mQ, mK, mV, mG, mBeta, mA, mBias, mH0, mHt, mO, mCu, mIdx, mNa, scale, lower_bound)
            # ~31 KiB of shared memory per CTA; with a CTA count asked of ptxas, the carveout is given
            # explicitly (the DSL would otherwise query a device for it at compile time)
            k.launch(grid=[cfg.V // 64, mV.shape[2], nseq], block=[NTHR, 1, 1], stream=stream,
                     min_blocks_per_mp=cfg.min_ctas, preferred_smem_carveout=100 if cfg.min_ctas > 1 else None)

        return launch

    def expect_ptx(self):
        e = [r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32", r"mma\.sync\.aligned\.m16n8k4\.row\.col\.f32\.tf32",
             r"st\.global\.v4\.b32", r"bar\.sync"]
        if self.cfg.has_h0:
            e.append(r"ld\.global\.v4\.b32")
        return tuple(e)

    def spec(self) -> KernelSpec:
        def build():
            return self.jit_fn(), decode_fake_args(self.cfg)

        return KernelSpec("recurrent_decode_mma", self.cfg.key(), build, expect_ptx=self.expect_ptx())


# Host policy: multi-token KDA steps without a state pool run here (set_enabled(False) sends them back
# to recurrent_decode, for tests and benchmarks.variants). Single-token steps stay on recurrent_decode:
# at T=1 there is nothing to batch and its kernel already streams the state at 93-97% of a copy.
ENABLED = True


def serves(cfg, multi_token: bool) -> bool:
    """Whether a call with this DecodeConfig (and some sequence holding > 1 token) runs here."""
    return ENABLED and multi_token and cfg.mode == "kda" and cfg.pool == 0


def set_enabled(flag: bool) -> None:
    """Route multi-token KDA steps here (True, the default) or to recurrent_decode; forgets plans."""
    from fla_cula import routing
    global ENABLED
    ENABLED = bool(flag)
    routing.clear_plans()  # memoized plans hold the compiled kernel they chose


def set_tuning(**knobs) -> None:
    """Replace the MmaDecodeConfig knobs applied over every config (no arguments: back to the
    defaults) and forget memoized plans (fla_cula.kernels._tuning)."""
    TUNING.set("recurrent_decode_mma", **knobs)


def get_kernel(cfg: MmaDecodeConfig):
    """The compiled TVM-FFI callable for a config, tuning knobs applied."""
    return TUNING.get("recurrent_decode_mma", cfg)


def compiled_configs() -> list:
    """The configs (tuning knobs applied) this process has compiled or loaded."""
    return TUNING.compiled_configs("recurrent_decode_mma")


def representative_configs() -> list:
    """What CI compiles for sm_90a: the serving flags on both layouts, the precomputed gate, varlen
    without an initial state, the lower-bound gate with negative eigenvalues."""
    M = MmaDecodeConfig
    out = []
    for vf in (False, True):
        out.append(M(state_v_first=vf, l2norm=True, gate_in_kernel=True, has_A=True, has_bias=True,
                     beta_sigmoid=True))
    out.append(M(g_dtype="float32", beta_dtype="float32"))
    out.append(M(state_v_first=True, varlen=True, has_h0=False, l2norm=True, gate_in_kernel=True, has_bias=True,
                 has_lower_bound=True, beta_sigmoid=True, neg_eigval=True))
    return out


TUNING.add("recurrent_decode_mma", MmaDecodeConfig, lambda c: RecurrentDecodeMma(c).spec())


@register_kernel("recurrent_decode_mma")
def _specs() -> list:
    return [RecurrentDecodeMma(c).spec() for c in representative_configs()]
