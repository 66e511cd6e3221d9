# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""Recurrent decode kernel (SM90, CuTe DSL) serving KDA and lightning attention.

One kernel body, specialized by a frozen :class:`DecodeConfig` (the compile key):

  mode='kda'        S' = diag(exp(a_t)) S;  u = beta (v - S'^T k);  S = S' + k u^T;  o = S^T (scale q)
  mode='lightning'  S  = exp(gamma_h) S + k v^T;                                    o = S^T (scale q)

per (sequence n, value head hv), S in R^{K x V} float32, state kept in registers for all T tokens
of the step (read once, written once per step; or once per token into a state pool when FLA's
continuous-batching semantics ask for it).

Static (compile key): mode, K, V, state layout, dtypes, which optional inputs exist, flags, BV.
Symbolic (runtime): batch B, tokens T, heads H/HV, number of sequences N, pool size, pool stride,
index-table width - a new batch size, step length or pool never recompiles.

Work split: grid (V/BV, HV, N); a CTA (one tile (vb, hv, n)) owns the K x BV column block of one
(n, hv) state (BV=32: 4 CTAs per state, so B=1, HV=32 already launches 128 CTAs); each thread
holds an 8 (k) x 4 (v) fp32 fragment (32 registers) in one of two mappings:
  warp-K ([V,K] state): warp w owns 8 value columns, lane = kl + 16*vq owns 8 rows {4kl..+4} U
      {64+4kl..+4} and columns [8w + 4vq, +4); reductions over K = 4 butterfly shuffles within 16
      lanes, no shared memory, no barrier; 16 lanes read 256 contiguous bytes of a [V,K] row.
  kv_rows ([K,V] state, the default there): lane = vl + 8*kr of warp w owns rows [32w + 8kr, +8)
      and columns [4vl, +4); 8 lanes cover a CTA's 32 columns, so a warp instruction reads 4 whole
      128-byte rows; reductions = 2 shuffles + one shared-memory exchange across warps per token.
      (kv_rows=False runs [K,V] with the warp-K mapping, "v2": 16 rows x 32 bytes per instruction.)
o and u use the identity o = S'^T q + (k.q) u, so a token needs ONE reduction pass (S'^T k,
S'^T q, k.q and, with l2norm, |q|^2, |k|^2 all in one batch of shuffles).

Token inputs: token t+1's loads are issued while token t computes (registers rq8, rk8, rv4, rg8,
rbt hold one token ahead); `l2_prefetch` additionally asks L2 for tokens 1..T-1 right after the
state stream is issued. `tok_smem` (KDA with 4 warps; off for lightning) computes each token's
per-k terms (decay, q, k and k.q, |q|^2, |k|^2) once per CTA through shared memory. The defaults
of `kv_rows`, `l2_prefetch`, `tok_smem` and `bv` are the measured choice (docs/decode_kernels.md).
"""

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from fla_cula.jit import KernelSpec, register_kernel
from fla_cula.kernels._dsl import assume_align, decode_fake_args, fexp, make_decay, make_seq_span, sigmoid, vec4
from fla_cula.kernels._tuning import TUNING


def _kvec(row, kb, KVROW):
    """Thread's 8 K-elements of a length-K row (its K rows of the state).
    Warp-K mapping (kb = kl): k in {4kl..4kl+3} U {64+4kl..64+4kl+3}, two 4-element vectors; across
    16 lanes each vector load covers 64 contiguous elements.
    Row mapping (KVROW, kb = 32 warp + 8 kr): the 8 contiguous k in [kb, kb+8), one vector."""
    if KVROW:
        v = cute.make_tensor(row.iterator + kb, cute.make_layout((8,), stride=(1,)))
        return assume_align(v, min(16, 8 * row.element_type.width // 8))
    v = cute.make_tensor(row.iterator + 4 * kb, cute.make_layout((4, 2), stride=(1, 64)))
    return assume_align(v, min(16, 4 * row.element_type.width // 8))


def _state_view(VF, KVROW, t2d, vc, kl):
    """Thread's 32-element state fragment as a 16-byte-aligned strided view.
    [K,V] (VF False): shape (8 k, 4 v), k = 4kl + (i%4) + 64(i//4), one float4 along V per row
                      (a warp instruction touches 16 rows x 32 bytes).
    [K,V] KVROW:      shape (8 k, 4 v), k = kb + i (kb = 32 warp + 8 kr); 8 lanes cover a CTA's
                      32 columns, so a warp instruction reads 4 whole 128-byte rows.
    [V,K] (VF True):  shape (4 v, 8 k), two float4 along K per row; 16 lanes read 256 contiguous
                      bytes per instruction (fully coalesced)."""
    if KVROW:
        vv = t2d.shape[1]
        lay = cute.make_layout((8, 4), stride=(vv, 1))
        return assume_align(cute.make_tensor(t2d.iterator + kl * vv + 4 * vc, lay), 16)
    if VF:
        kk = t2d.shape[1]
        lay = cute.make_layout((4, (4, 2)), stride=(kk, (1, 64)))
        off = 4 * vc * kk + 4 * kl
    else:
        vv = t2d.shape[1]
        lay = cute.make_layout(((4, 2), 4), stride=((vv, 64 * vv), 1))
        off = 4 * kl * vv + 4 * vc
    return assume_align(cute.make_tensor(t2d.iterator + off, lay), 16)


def _sget(rS, VF, i, j):
    """State element (k = kmap(i), v = 4vc + j) of the thread fragment, in either layout."""
    return rS[j, i] if VF else rS[i, j]


def _sset(rS, VF, i, j, x):
    if VF:
        rS[j, i] = x
    else:
        rS[i, j] = x


def _load_tok(KDA, KVROW, TOKS, mQ, mK, mV, mG, mBeta, rq8, rk8, rv4, rg8, rbt, b, tok, hq, hv, kl, vc, kk):
    """Issue one token's input loads (q, k, v; for KDA also g and beta) into registers: the
    thread's 8 K positions, or with TOKS (tok_smem) the one position kk it stages for the CTA;
    v for each of its column groups (rv4[g]: columns [4 (vc + 8g), +4))."""
    if TOKS:
        rq8[0] = mQ[b, tok, hq, kk]
        rk8[0] = mK[b, tok, hq, kk]
    else:
        cute.autovec_copy(_kvec(mQ[b, tok, hq, None], kl, KVROW), rq8)
        cute.autovec_copy(_kvec(mK[b, tok, hq, None], kl, KVROW), rk8)
    for g in range(len(rv4)):
        cute.autovec_copy(vec4(mV[b, tok, hv, None], vc + 8 * g), rv4[g])
    if KDA:
        if TOKS:
            rg8[0] = mG[b, tok, hv, kk]
        else:
            cute.autovec_copy(_kvec(mG[b, tok, hv, None], kl, KVROW), rg8)
        rbt[0] = Float32(mBeta[b, tok, hv])


def _prefetch_tok(KDA, KVROW, NC, mQ, mK, mV, mG, b, tok, hq, hv, kl, vc):
    """prefetch.global.L2 the lines of one token's inputs this thread will load (q, k and, for KDA,
    g: both 64-element halves of the thread's K positions; v: its 4 columns)."""
    rows = [mQ[b, tok, hq, None], mK[b, tok, hq, None]] + ([mG[b, tok, hv, None]] if KDA else [])
    for row in rows:
        p = _kvec(row, kl, KVROW).iterator
        cute.arch.prefetch(p.llvm_ptr, cache_level="L2")
        cute.arch.prefetch((p + 64).llvm_ptr, cache_level="L2")
    for g in range(NC):
        cute.arch.prefetch(vec4(mV[b, tok, hv, None], vc + 8 * g).iterator.llvm_ptr, cache_level="L2")


@dataclass(frozen=True)
class DecodeConfig:
    """The specialization (compile key). Sizes B, T, H, HV, N, pool are NOT here (symbolic)."""

    mode: str = "kda"              # 'kda' | 'lightning'
    K: int = 128
    V: int = 128
    state_v_first: bool = False    # state [.., V, K] instead of [.., K, V]
    qk_dtype: str = "bfloat16"
    v_dtype: str = "bfloat16"
    g_dtype: str = "bfloat16"      # kda: g; lightning: unused
    beta_dtype: str = "bfloat16"   # kda only
    o_dtype: str = "bfloat16"
    has_h0: bool = True            # initial state given
    has_ht: bool = True            # (non-pool) final state written to ht[n]
    varlen: bool = False           # cu_seqlens given
    cu_dtype: str = "int32"
    pool: int = 0                  # 0: no pool; 1: 1-D ssm_state_indices; 2: 2-D [N, Tmax]
    idx_dtype: str = "int32"
    spec: bool = False             # num_accepted_tokens given (with pool)
    na_dtype: str = "int32"
    l2norm: bool = False
    gate_in_kernel: bool = False
    has_A: bool = False
    a_dtype: str = "float32"
    has_bias: bool = False
    bias_dtype: str = "float32"
    has_lower_bound: bool = False
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    bv: int = 32                   # value columns per CTA (multiple of 8; kv_rows: 32 or 64)
    # [K,V] layout only (ignored for [V,K]): lanes along V so each warp instruction reads whole
    # 128-byte rows; K is split over lanes and warps, reduced by shuffles + one shared-memory
    # exchange per token. Off: the warp-K mapping (a warp instruction touches 16 rows x 32 bytes).
    kv_rows: bool = True
    # right after the state loads are issued, prefetch.global.L2 the lines of tokens 1..T-1's
    # inputs, so the serial token chain's loads hit L2.
    l2_prefetch: bool = True
    # KDA with 4 warps (128 threads = K): thread k computes token t's decay, q_k, k_k (fp32) and its
    # share of k.q, |q|^2, |k|^2 once for the CTA into shared memory (one barrier per token), instead
    # of every thread recomputing its 8 rows' gates and partial dot products.
    tok_smem: bool = True

    def __post_init__(self):
        # kv_rows names a [K,V] mapping: off for [V,K], so the compile key holds no dead flag
        if self.state_v_first and self.kv_rows:
            object.__setattr__(self, "kv_rows", False)
        # tok_smem stages one K position per thread of a 128-thread CTA; lightning has no per-k gate
        if self.tok_smem and (self.mode != "kda" or self.warps != 4):
            object.__setattr__(self, "tok_smem", False)

    def key(self):
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))

    @property
    def warps(self) -> int:
        """kv_rows: 4 warps cover K, each thread 8 rows x 4 columns per 32-column group;
        warp-K: a warp per 8 columns."""
        return 4 if self.kv_rows else self.bv // 8

    @property
    def groups(self) -> int:
        """4-column groups per thread (kv_rows with bv=64: 2, an 8 x 8 fragment)."""
        return self.bv // 32 if self.kv_rows else 1


class RecurrentDecode:
    """Static config + @cute.jit launcher + @cute.kernel body."""

    def __init__(self, cfg: DecodeConfig):
        assert cfg.K == 128 and cfg.V % cfg.bv == 0 and cfg.bv % 8 == 0
        if cfg.kv_rows and cfg.bv not in (32, 64):
            raise ValueError(f"kv_rows maps 4 warps x 32 value columns per group: bv must be 32 or 64, got {cfg.bv}")
        self.cfg = cfg

    # ------------------------------------------------------------------------------------------
    def jit_fn(self):
        cfg = self.cfg
        K = cfg.K
        V = cfg.V
        BV = cfg.bv
        NTHR = 32 * cfg.warps
        KDA = cfg.mode == "kda"
        VF = cfg.state_v_first
        POOL = cfg.pool
        KVROW = cfg.kv_rows
        TOKS = cfg.tok_smem
        NRK = 1 if TOKS else 8  # K positions a thread loads per token (1: staged through shared memory)
        NVB = V // BV
        NC = cfg.groups  # 4-column groups per thread (columns [4 (vc + 8g), +4), g < NC)
        f32 = Float32

        decay = make_decay(cfg)
        seq_span = make_seq_span(cfg)

        def thread_map(vb, lane, warp):
            """(kl, vc, wr) of a thread in column block vb; see _kvec / _state_view."""
            if KVROW:
                kl = 32 * warp + 8 * (lane // 8)
                return kl, vb * (BV // 4) + lane % 8, kl == 0
            kl = lane % 16
            return kl, vb * (BV // 4) + warp * 2 + lane // 16, kl == 0

        @cute.jit
        def tile_meta(tile, mQ: cute.Tensor, mCu: cute.Tensor, mIdx: cute.Tensor, mNa: cute.Tensor,
                      mH0: cute.Tensor, HVn):
            """Tile -> (vb, hv, n), the sequence's batch row b, first token bos, length Tn, whether
            it is active and which state slot it reads (values are clamped, never trusted)."""
            vb = tile % NVB
            hv = (tile // NVB) % HVn
            n = tile // (NVB * HVn)
            b, bos, Tn = seq_span(mQ, mCu, n)
            # pool slot to read (continuous batching)
            active = Int32(1)
            rslot = Int64(n)
            if cutlass.const_expr(POOL != 0):
                npool = mH0.shape[0]
                t0 = Int32(0)
                if cutlass.const_expr(cfg.spec):
                    t0 = Int32(mNa[n]) - 1
                rs = Int64(-1)
                if cutlass.const_expr(POOL == 1):
                    j = n + t0
                    if t0 >= 0 and j < mIdx.shape[0]:
                        rs = Int64(mIdx[j])
                else:
                    if t0 >= 0 and t0 < mIdx.shape[1]:
                        rs = Int64(mIdx[n, t0])
                rslot = rs
                if rslot < 0 or rslot >= Int64(npool) or Tn == 0:
                    active = Int32(0)
            return vb, hv, n, b, bos, Tn, active, rslot

        @cute.kernel
        def kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                   mBeta: cute.Tensor, mA: cute.Tensor, mBias: cute.Tensor, mH0: cute.Tensor,
                   mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, mIdx: cute.Tensor,
                   mNa: cute.Tensor, scale: f32, lower_bound: f32):
            tidx, _, _ = cute.arch.thread_idx()
            lane = tidx % 32
            warp = tidx // 32
            if cutlass.const_expr(KVROW):
                RP = 12 if NC == 1 else 20  # >= the values reduced per token, padded to 4 (8 NC + 3 for KDA)
                sRed = cutlass.memory.SmemAllocator().allocate_tensor(
                    f32, cute.make_layout((2, 4, 8, RP), stride=(32 * RP, 8 * RP, RP, 1)),  # [parity, warp, vl, r]
                    byte_alignment=16)
            if cutlass.const_expr(TOKS):
                # [parity, (decay, q, k), K] and [parity, warp, (k.q, |q|^2, |k|^2, pad)]
                sTok = cutlass.memory.SmemAllocator().allocate_tensor(
                    f32, cute.make_layout((2, 3, K), stride=(3 * K, K, 1)), byte_alignment=16)
                sTr = cutlass.memory.SmemAllocator().allocate_tensor(
                    f32, cute.make_layout((2, 4, 4), stride=(16, 4, 1)), byte_alignment=16)
            HQ = mQ.shape[2]
            HVn = mV.shape[2]
            bx, by, bz = cute.arch.block_idx()
            tile = bx + NVB * (by + HVn * bz)  # a CTA per tile (vb, hv, n), vb fastest
            vb, hv, n, b, bos, Tn, active, rslot = tile_meta(tile, mQ, mCu, mIdx, mNa, mH0, HVn)
            hq = hv // (HVn // HQ)
            # kl: the thread's K position (warp-K mapping: lane % 16; row mapping: first row kb)
            # vc: its column group, v in [4vc, 4vc+4); wr: whether it writes o (one writer per column)
            kl, vc, wr = thread_map(vb, lane, warp)
            # ---- registers: state fragment + one token's raw inputs (prefetch buffers) ----
            # rS[g] holds the thread's 32 state elements of column group g; S(i, j) names element
            # (k=kmap(i), v=4(vc+8g)+j) in either layout (trace-time index swap, no data movement).
            rS = [cute.make_rmem_tensor((4, 8) if VF else (8, 4), f32) for _ in range(NC)]
            for g in cutlass.range_constexpr(NC):
                rS[g].fill(0.0)
            rq8 = cute.make_rmem_tensor((NRK,), mQ.element_type)
            rk8 = cute.make_rmem_tensor((NRK,), mK.element_type)
            rv4 = [cute.make_rmem_tensor((4,), mV.element_type) for _ in range(NC)]
            ro4 = [cute.make_rmem_tensor((4,), mO.element_type) for _ in range(NC)]
            rdec = cute.make_rmem_tensor((8,), f32)
            rg8 = cute.make_rmem_tensor((NRK,), mG.element_type if KDA else f32)
            rg8.fill(0.0)
            rbt = cute.make_rmem_tensor((1,), f32)
            rbt[0] = f32(0.0)

            if active != 0:
                # Issue order = latency order: token 0's inputs and the per-head constants first,
                # then the 16 KiB state stream; nothing below waits until the decay multiply.
                if Tn > 0:
                    _load_tok(KDA, KVROW, TOKS, mQ, mK, mV, mG, mBeta, rq8, rk8, rv4, rg8, rbt, b, bos, hq, hv,
                              kl, vc, tidx)
                gam = f32(0.0)
                if cutlass.const_expr(not KDA):
                    gam = fexp(f32(mG[hq]))
                aexp = f32(1.0)
                if cutlass.const_expr(KDA and cfg.gate_in_kernel and cfg.has_A):
                    aexp = fexp(f32(mA[hv]))
                rbias = cute.make_rmem_tensor((NRK,), f32)
                rbias.fill(0.0)
                if cutlass.const_expr(KDA and cfg.gate_in_kernel and cfg.has_bias and TOKS):
                    rbias[0] = f32(mBias[hv * K + tidx])
                elif cutlass.const_expr(KDA and cfg.gate_in_kernel and cfg.has_bias):
                    rb8 = cute.make_rmem_tensor((8,), mBias.element_type)
                    cute.autovec_copy(_kvec(cute.local_tile(mBias, (K,), (hv,)), kl, KVROW), rb8)
                    rbias.store(rb8.load().to(f32))
                if cutlass.const_expr(cfg.has_h0):
                    for g in cutlass.range_constexpr(NC):
                        cute.autovec_copy(_state_view(VF, KVROW, mH0[rslot, hv, None, None], vc + 8 * g, kl), rS[g])

                if cutlass.const_expr(cfg.l2_prefetch):
                    for t in cutlass.range(1, Tn, unroll=1):
                        _prefetch_tok(KDA, KVROW, NC, mQ, mK, mV, mG, b, bos + t, hq, hv, kl, vc)
                for t in cutlass.range(Tn, unroll=1):
                    qf = rq8.load().to(f32)
                    kf = rk8.load().to(f32)
                    vf = [rv4[g].load().to(f32) for g in range(NC)]
                    gf = rg8.load().to(f32)
                    bt = rbt[0]
                    if t + 1 < Tn:
                        # the next token's loads: their latency leaves the serial chain
                        _load_tok(KDA, KVROW, TOKS, mQ, mK, mV, mG, mBeta, rq8, rk8, rv4, rg8, rbt,
                                  b, bos + t + 1, hq, hv, kl, vc, tidx)
                    NT = 3 if cfg.l2norm else 1  # k.q (and |q|^2, |k|^2): from the staging with TOKS
                    tr = cute.make_rmem_tensor((3,), f32)
                    if cutlass.const_expr(TOKS):
                        # ---- stage: thread k = tidx writes decay_k, q_k, k_k and reduces its warp's
                        # share of k.q, |q|^2, |k|^2; after the barrier every thread reads its 8 rows
                        # (double-buffered by token parity: a buffer is rewritten two barriers later)
                        par = t % 2
                        sTok[par, 0, tidx] = decay(gf[0], rbias[0], aexp, lower_bound)
                        sTok[par, 1, tidx] = qf[0]
                        sTok[par, 2, tidx] = kf[0]
                        tr[0] = qf[0] * kf[0]
                        tr[1] = qf[0] * qf[0]
                        tr[2] = kf[0] * kf[0]
                        for sh in cutlass.range_constexpr(5):
                            for r in cutlass.range_constexpr(NT):
                                tr[r] = tr[r] + cute.arch.shuffle_sync_bfly(tr[r], offset=1 << sh)
                        if lane == 0:
                            for r in cutlass.range_constexpr(NT):
                                sTr[par, warp, r] = tr[r]
                        cute.arch.barrier()
                        cute.autovec_copy(_kvec(sTok[par, 0, None], kl, KVROW), rdec)
                        rq = cute.make_rmem_tensor((8,), f32)
                        rk = cute.make_rmem_tensor((8,), f32)
                        cute.autovec_copy(_kvec(sTok[par, 1, None], kl, KVROW), rq)
                        cute.autovec_copy(_kvec(sTok[par, 2, None], kl, KVROW), rk)
                        qf = rq.load()
                        kf = rk.load()
                        for r in cutlass.range_constexpr(NT):
                            tr[r] = sTr[par, 0, r] + sTr[par, 1, r] + sTr[par, 2, r] + sTr[par, 3, r]
                    # ---- decay ----
                    if cutlass.const_expr(KDA):
                        if cutlass.const_expr(not TOKS):
                            for i in cutlass.range_constexpr(8):
                                rdec[i] = decay(gf[i], rbias[i], aexp, lower_bound)
                        for g in cutlass.range_constexpr(NC):
                            for i in cutlass.range_constexpr(8):
                                for jj in cutlass.range_constexpr(4):
                                    _sset(rS[g], VF, i, jj, _sget(rS[g], VF, i, jj) * rdec[i])
                    else:
                        for g in cutlass.range_constexpr(NC):
                            for i in cutlass.range_constexpr(8):
                                for jj in cutlass.range_constexpr(4):
                                    _sset(rS[g], VF, i, jj, _sget(rS[g], VF, i, jj) * gam)
                    # ---- one batched reduction over K (16 lanes hold all of K) ----
                    # red: [S'^T q for the thread's 4 NC columns, S'^T k for them (KDA), k.q, |q|^2, |k|^2]
                    NCOL = 4 * NC
                    base = 2 * NCOL if KDA else NCOL
                    NR = base + (0 if TOKS else NT)  # values reduced below (TOKS: k.q etc. are done)
                    # kv_rows, 16 values (KDA, tok_smem, two column groups): each of a warp's 4 row-lanes
                    # finishes one 16-byte quarter of the cross-warp sums (fewer instructions per token).
                    # With one group, or lightning's 9 values (unaligned quarters), every lane sums all
                    # values: there the quarters cost more registers than they save instructions.
                    QUARTERS = KVROW and NC == 2 and NR == 16
                    Q = (NR + 3) // 4
                    red = cute.make_rmem_tensor((max(base + NT, 4 * Q),), f32)
                    if cutlass.const_expr(QUARTERS and 4 * Q > NR):
                        for r in cutlass.range_constexpr(NR, 4 * Q):
                            red[r] = f32(0.0)
                    for g in cutlass.range_constexpr(NC):
                        for jj in cutlass.range_constexpr(4):
                            aq = f32(0.0)
                            for i in cutlass.range_constexpr(8):
                                aq = aq + _sget(rS[g], VF, i, jj) * qf[i]
                            red[4 * g + jj] = aq
                            if cutlass.const_expr(KDA):
                                ak = f32(0.0)
                                for i in cutlass.range_constexpr(8):
                                    ak = ak + _sget(rS[g], VF, i, jj) * kf[i]
                                red[NCOL + 4 * g + jj] = ak
                    if cutlass.const_expr(TOKS):
                        for r in cutlass.range_constexpr(NT):
                            red[base + r] = tr[r]
                    else:
                        kq = f32(0.0)
                        for i in cutlass.range_constexpr(8):
                            kq = kq + kf[i] * qf[i]
                        red[base] = kq
                        if cutlass.const_expr(cfg.l2norm):
                            qq = f32(0.0)
                            kk = f32(0.0)
                            for i in cutlass.range_constexpr(8):
                                qq = qq + qf[i] * qf[i]
                                kk = kk + kf[i] * kf[i]
                            red[base + 1] = qq
                            red[base + 2] = kk
                    if cutlass.const_expr(KVROW and not QUARTERS):
                        # over the 4 row-lanes of a warp, then over the 4 warps through shared memory
                        # (double-buffered by token parity: one barrier per token is enough)
                        for sh in cutlass.range_constexpr(2):
                            for r in cutlass.range_constexpr(NR):
                                red[r] = red[r] + cute.arch.shuffle_sync_bfly(red[r], offset=8 << sh)
                        par = t % 2
                        if lane < 8:
                            for r in cutlass.range_constexpr(NR):
                                sRed[par, warp, lane, r] = red[r]
                        cute.arch.barrier()
                        for r in cutlass.range_constexpr(NR):
                            acc = f32(0.0)
                            for w in cutlass.range_constexpr(4):
                                acc = acc + sRed[par, w, lane % 8, r]
                            red[r] = acc
                    elif cutlass.const_expr(QUARTERS):
                        # as above, but row-lane kr sums only quarter kr of the values over the warps and
                        # the quarters are gathered back with indexed shuffles
                        for sh in cutlass.range_constexpr(2):
                            for r in cutlass.range_constexpr(NR):
                                red[r] = red[r] + cute.arch.shuffle_sync_bfly(red[r], offset=8 << sh)
                        par = t % 2
                        vl = lane % 8
                        if lane < 8:
                            for r in cutlass.range_constexpr(4 * Q):
                                sRed[par, warp, lane, r] = red[r]
                        cute.arch.barrier()
                        part = cute.make_rmem_tensor((Q,), f32)
                        part.fill(0.0)
                        for w in cutlass.range_constexpr(4):
                            qv = cute.make_rmem_tensor((Q,), f32)
                            src = cute.make_tensor(sRed[par, w, vl, None].iterator + (lane // 8) * Q,
                                                   cute.make_layout((Q,), stride=(1,)))
                            cute.autovec_copy(assume_align(src, 16 if Q % 4 == 0 else 4), qv)
                            part.store(part.load() + qv.load())
                        for r in cutlass.range_constexpr(NR):
                            red[r] = cute.arch.shuffle_sync(part[r % Q], offset=vl + 8 * (r // Q))
                    else:
                        for sh in cutlass.range_constexpr(4):
                            for r in cutlass.range_constexpr(NR):
                                red[r] = red[r] + cute.arch.shuffle_sync_bfly(red[r], offset=1 << sh)
                    # ---- token update: u = beta (v - S'^T k);  o = S'^T q + (k.q) u;  S += k u^T ----
                    rqn = scale
                    rkn = f32(1.0)
                    if cutlass.const_expr(cfg.l2norm):
                        rqn = scale * cute.math.rsqrt(red[base + 1] + f32(1e-6), fastmath=False)
                        rkn = cute.math.rsqrt(red[base + 2] + f32(1e-6), fastmath=False)
                    kqn = red[base] * rkn
                    ru = cute.make_rmem_tensor((NCOL,), f32)
                    if cutlass.const_expr(KDA):
                        if cutlass.const_expr(cfg.beta_sigmoid):
                            bt = sigmoid(bt)
                            if cutlass.const_expr(cfg.neg_eigval):
                                bt = bt * f32(2.0)
                        for g in cutlass.range_constexpr(NC):
                            for jj in cutlass.range_constexpr(4):
                                ru[4 * g + jj] = bt * (vf[g][jj] - rkn * red[NCOL + 4 * g + jj])
                    else:
                        for g in cutlass.range_constexpr(NC):
                            for jj in cutlass.range_constexpr(4):
                                ru[4 * g + jj] = vf[g][jj]
                    for g in cutlass.range_constexpr(NC):
                        for jj in cutlass.range_constexpr(4):
                            ro4[g][jj] = (rqn * (red[4 * g + jj] + kqn * ru[4 * g + jj])).to(mO.element_type)
                    for i in cutlass.range_constexpr(8):
                        ki = kf[i] * rkn
                        for g in cutlass.range_constexpr(NC):
                            for jj in cutlass.range_constexpr(4):
                                _sset(rS[g], VF, i, jj, _sget(rS[g], VF, i, jj) + ki * ru[4 * g + jj])
                    if wr:
                        for g in cutlass.range_constexpr(NC):
                            cute.autovec_copy(ro4[g], vec4(mO[b, bos + t, hv, None], vc + 8 * g))
                    # ---- per-token state write into the pool (FLA continuous batching) ----
                    if cutlass.const_expr(POOL != 0):
                        ws = Int64(-1)
                        if cutlass.const_expr(POOL == 1):
                            j = n + t
                            if j < mIdx.shape[0]:
                                ws = Int64(mIdx[j])
                        else:
                            if t < mIdx.shape[1]:
                                ws = Int64(mIdx[n, t])
                        if ws >= 0 and ws < Int64(mH0.shape[0]):
                            for g in cutlass.range_constexpr(NC):
                                cute.autovec_copy(rS[g], _state_view(VF, KVROW, mH0[ws, hv, None, None], vc + 8 * g,
                                                                     kl))

                if cutlass.const_expr(POOL == 0 and cfg.has_ht):
                    for g in cutlass.range_constexpr(NC):
                        cute.autovec_copy(rS[g], _state_view(VF, KVROW, mHt[n, hv, None, None], vc + 8 * g, kl))
            else:
                # padding / empty sequence: touch no state; zero its output rows
                if cutlass.const_expr(POOL != 0):
                    for g in cutlass.range_constexpr(NC):
                        for jj in cutlass.range_constexpr(4):
                            ro4[g][jj] = f32(0.0).to(mO.element_type)
                    if wr:
                        for t in cutlass.range(Tn, unroll=1):
                            for g in cutlass.range_constexpr(NC):
                                cute.autovec_copy(ro4[g], vec4(mO[b, bos + t, hv, None], vc + 8 * g))

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
            # a CTA per tile; a few KiB of shared memory at most (kv_rows' exchange, tok_smem's staging):
            # the carveout goes to L1
            k.launch(grid=[NVB, mV.shape[2], nseq], block=[NTHR, 1, 1], stream=stream,
                     preferred_smem_carveout=0)

        return launch

    # ------------------------------------------------------------------------------------------
    def fake_args(self):
        return decode_fake_args(self.cfg)

    def expect_ptx(self):
        """What the PTX must hold: 16-byte state loads (when a state is read) and stores, the
        butterfly reduction, the fast exp2; rsqrt with l2norm."""
        c = self.cfg
        e = [r"st\.global\.v4\.b32", r"shfl\.sync\.bfly", r"ex2\.approx"]
        if c.has_h0:
            e.append(r"ld\.global\.v4\.b32")
        if c.l2norm:
            e.append(r"rsqrt")
        if c.tok_smem:
            e.append(r"bar\.sync")
        if c.l2_prefetch:
            e.append(r"prefetch\.global\.L2")
        return tuple(e)

    def spec(self) -> KernelSpec:
        def build():
            return self.jit_fn(), self.fake_args()

        return KernelSpec("recurrent_decode", self.cfg.key(), build, expect_ptx=self.expect_ptx())


# Host policy (measured, docs/decode_kernels.md "v7"): [K,V] multi-token steps over many states take
# 64-column CTAs (an 8 x 8 fragment per thread: fewer instructions per state element on the serial
# token chain), single-token steps and small grids 32-column CTAs (4 CTAs/SM instead of 3, and twice
# the CTAs).
WIDE_MIN_STATES = 1024


def choose_bv(state_v_first: bool, multi_token: bool, n_states: int) -> int:
    """Value columns per CTA for a call: `multi_token` = some sequence has more than one token,
    `n_states` = sequences x value heads."""
    return 64 if not state_v_first and multi_token and n_states >= WIDE_MIN_STATES else 32


def set_tuning(**knobs) -> None:
    """Replace the DecodeConfig knobs applied over every config the host wrappers build (no
    arguments: back to the defaults) and forget memoized plans (fla_cula.kernels._tuning)."""
    TUNING.set("recurrent_decode", **knobs)


def get_kernel(cfg: DecodeConfig):
    """The compiled TVM-FFI callable for a config, tuning knobs applied."""
    return TUNING.get("recurrent_decode", cfg)


def compiled_configs() -> list:
    """The configs (tuning knobs applied) this process has compiled or loaded."""
    return TUNING.compiled_configs("recurrent_decode")


def representative_configs() -> list:
    """What CI compiles for sm_90a: every flag and both layouts with the default knobs, plus the
    non-default knobs the tests and benchmarks.variants compare against."""
    C = DecodeConfig
    out = []
    for vf in (False, True):
        # KDA serving shapes: gate in kernel, l2norm, beta sigmoid, pool with 2-D indices + spec
        out.append(C(mode="kda", state_v_first=vf, l2norm=True, gate_in_kernel=True, has_A=True,
                     has_bias=True, has_lower_bound=False, beta_sigmoid=True, pool=2, spec=True,
                     has_ht=False, varlen=True))
        out.append(C(mode="kda", state_v_first=vf, l2norm=True, gate_in_kernel=True, has_A=True,
                     has_bias=True, has_lower_bound=True, beta_sigmoid=True, neg_eigval=True,
                     pool=1, has_ht=False, idx_dtype="int64"))
        # fixed batch, precomputed gate, fp32 beta, final state
        out.append(C(mode="kda", state_v_first=vf, g_dtype="float32", beta_dtype="float32"))
        # lightning: fixed and varlen
        out.append(C(mode="lightning", state_v_first=vf, g_dtype="float32", beta_dtype="float32"))
        out.append(C(mode="lightning", state_v_first=vf, g_dtype="float32", beta_dtype="float32",
                     varlen=True, cu_dtype="int64", has_h0=False))
    # [K,V] with the warp-K mapping (v2), and without the L2 prefetch
    out.append(C(mode="kda", l2norm=True, gate_in_kernel=True, has_A=True, has_bias=True, has_lower_bound=True,
                 beta_sigmoid=True, pool=2, spec=True, has_ht=False, varlen=True, kv_rows=False))
    out.append(C(mode="lightning", g_dtype="float32", beta_dtype="float32", kv_rows=False))
    out.append(C(mode="kda", g_dtype="float32", beta_dtype="float32", l2_prefetch=False))
    # kv_rows with 64-column CTAs (an 8 x 8 fragment per thread): KDA serving flags and lightning
    out.append(C(mode="kda", l2norm=True, gate_in_kernel=True, has_A=True, has_bias=True, beta_sigmoid=True,
                 bv=64))
    out.append(C(mode="lightning", g_dtype="float32", beta_dtype="float32", bv=64))
    # KDA without the shared-memory token staging (tok_smem off): serving flags on both layouts
    for vf in (False, True):
        out.append(C(mode="kda", state_v_first=vf, l2norm=True, gate_in_kernel=True, has_A=True, has_bias=True,
                     beta_sigmoid=True, pool=2, spec=True, has_ht=False, varlen=True, tok_smem=False))
    return out


TUNING.add("recurrent_decode", DecodeConfig, lambda c: RecurrentDecode(c).spec())


@register_kernel("recurrent_decode")
def _specs() -> list:
    return [RecurrentDecode(c).spec() for c in representative_configs()]
