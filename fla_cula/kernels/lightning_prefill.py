# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""Lightning-attention prefill (SM90, CuTe DSL): FLA's `chunk_simple_gla(g_gamma=...)` forward in one
single-pass kernel, the state on chip across chunks (v1: mma.sync tensor cores, cp.async loads).

Per (sequence n, head h), K = V = 128 (or 64), g = g_gamma[h] <= 0 (natural-log decay per token):
  S_t = exp(g) S_{t-1} + k_t v_t^T,  o_t = scale * S_t^T q_t,  final_state = S_{T-1}   (S fp32, K x V)
in chunks of C = 64 tokens (i = 0..L-1 within a chunk, L <= C on a tail; S0 = state before the chunk):
  o_i   = scale * [ exp(g(i+1)) q_i^T S0 + sum_{j<=i} exp(g(i-j)) (q_i . k_j) v_j ]
  S_end = exp(gL) S0 + sum_{j<L} exp(g(L-1-j)) k_j v_j^T
Every exponent is <= 0. g is constant per head, so each factor is exp(g d) for an integer d in [0, C]:
a CTA tabulates those C + 1 values once in shared memory.

Work split: grid (V / BV, H, N), BV = 64: a CTA owns the K x BV column block of one (n, h) state (an
independent recurrence: exact) as the fp32 accumulator of a tiled mma.sync m16n8k16 (4 warps stacked
along M, 64 registers per thread). Per chunk (docs/lightning_prefill.md):
  1. A  = Q K^T  (C x C)             -> P = A * exp(g(i-j)) for j <= i, else 0; bf16 into smem
  2. O  = Q S0   (C x BV, S0 as bf16 from smem); O = exp(g(i+1)) O + P V
  3. S  = exp(gL) S + K^T Vd,  Vd_j = exp(g(L-1-j)) v_j for j < L, else 0
Operands come from shared memory through ldmatrix (transposed for K^T, V, Vd and S0); the q/k/v chunk
tiles arrive by 16-byte cp.async: the next chunk's Q as soon as the GEMMs reading Q are done, K and V
after GEMM 3, so they overlap the output store (and the other CTA on the SM). Rows past a sequence's
end load a clamped (valid) token; the math masks them and only rows < L are stored.

Variants (config knobs, all compiled and GPU-tested; defaults change only on an H200 measurement):
kv_stages=2 double-buffers K and V; mma="wgmma" runs the same schedule with warpgroup MMAs from
128-byte-swizzled shared memory (`LightningPrefill._wgmma_kernel`).

Static (compile key): dtype (q, k, v, o), K, V, BV, chunk, has_h0 and its dtype, has_ht, varlen and
cu_seqlens dtype, kv_stages, mma. Symbolic: B, T, H, N (one compile serves every batch, length, head count).
State layout: K-major [N, H, K, V] only (FLA's chunk_lightning_attn never passes state_v_first).
"""

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.utils import hopper_helpers as sm90

from fla_cula.jit import KernelSpec, register_kernel
from fla_cula.kernels._dsl import DT as _DT
from fla_cula.kernels._dsl import assume_align as _al
from fla_cula.kernels._dsl import make_seq_span
from fla_cula.kernels._host import FLOAT, I31, INT, aligned, launch, seqs_reason
from fla_cula.kernels._tuning import TUNING

NTHR = 128   # 4 warps, one tiled MMA (warps stacked along M)
PAD = 8      # shared-memory row padding (elements): 16 bytes, so the 8 rows of an ldmatrix hit distinct banks
VEC = 8      # elements per 16-byte vector (16-bit types)


@dataclass(frozen=True)
class LightningPrefillConfig:
    """The specialization (compile key). Sizes (B, T, H, N) are symbolic."""

    dtype: str = "bfloat16"      # q, k, v and o
    K: int = 128
    V: int = 128
    # value columns per CTA. 64: the v1 design (2 CTAs per SM). 32 (mma.sync only): twice the CTAs for small
    # grids (B*H <= ~64), ~70 KB shared memory and 166 registers, so 3 CTAs per SM; QK^T is then computed by
    # 4 CTAs per (n, h). Not measured yet.
    bv: int = 64
    chunk: int = 64
    has_h0: bool = False
    h0_dtype: str = "float32"    # FLA also accepts bf16/fp16 initial states (read as fp32)
    has_ht: bool = True
    varlen: bool = False
    cu_dtype: str = "int32"
    # shared-memory buffers for the K and V chunk tiles. 1 (the v1 design): the next chunk's K, V are issued
    # after GEMM 3 and overlap only the output store; 2: issued at the top of the chunk before (double
    # buffer; the output tile then reuses P's rows), ~108 KB per CTA, still 2 CTAs per SM. Not measured yet.
    kv_stages: int = 1
    # tensor-core instruction: "sync" (mma.sync m16n8k16, operands through ldmatrix from padded rows: v1) or
    # "wgmma" (warpgroup MMA m64n64k16 from 128-byte-swizzled shared memory; same schedule; kv_stages 1).
    # Not measured yet.
    mma: str = "sync"

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype}: expected bfloat16 or float16")
        if self.K not in (64, 128) or self.V not in (64, 128):
            raise ValueError(f"head dims K={self.K} V={self.V}: expected 64 or 128")
        if self.bv not in (32, 64) or self.V % self.bv or self.chunk != 64 or (self.mma == "wgmma" and self.bv != 64):
            raise ValueError(f"bv={self.bv} chunk={self.chunk} mma={self.mma}: supported bv 64 (32 with mma.sync), "
                             f"chunk 64")
        if self.kv_stages not in (1, 2):
            raise ValueError(f"kv_stages {self.kv_stages}: expected 1 or 2")
        if self.mma not in ("sync", "wgmma") or (self.mma == "wgmma" and self.kv_stages != 1):
            raise ValueError(f"mma {self.mma!r} with kv_stages {self.kv_stages}: expected 'sync', or 'wgmma' with 1")
        if self.h0_dtype not in ("float32", "bfloat16", "float16") or self.cu_dtype not in ("int32", "int64"):
            raise ValueError(f"h0_dtype {self.h0_dtype} / cu_dtype {self.cu_dtype} unsupported")

    def key(self):
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))


def _rowvec(t2d, r, cv):
    """Vector cv (VEC contiguous elements) of row r of a 2-D tensor whose rows are contiguous."""
    return cute.local_tile(t2d[r, None], (VEC,), (cv,))


def _gemm(tiled_mma, acc, cpy_a, ts_a, tr_a, fr_a, cpy_b, ts_b, tr_b, fr_b):
    """acc += A B over all k-blocks: ldmatrix the k-block's A and B fragments from shared memory, then MMA."""
    for kb in range(cute.size(ts_a, mode=[2])):  # plain Python: unrolled at trace time
        cute.copy(cpy_a, ts_a[None, None, kb], tr_a[None, None, kb])
        cute.copy(cpy_b, ts_b[None, None, kb], tr_b[None, None, kb])
        cute.gemm(tiled_mma, acc, fr_a[None, None, kb], fr_b[None, None, kb], acc)


def _stage(buf, st, rows, cols, rstride, transposed=False):
    """Stage st of a 1-D shared-memory buffer holding stages of (rows x cols) tiles with row stride rstride:
    the (rows, cols) view, or its transposed (cols, rows) view (the row dimension outer)."""
    base = buf.iterator + st * (rows * rstride)
    lay = (cute.make_layout((cols, rows), stride=(1, rstride)) if transposed
           else cute.make_layout((rows, cols), stride=(rstride, 1)))
    return _al(cute.make_tensor(base, lay), 16)


def _wgmma(tiled_mma, acc, fr_a, fr_b):
    """acc += A B over all k-blocks with warpgroup MMAs (operands: shared-memory descriptors)."""
    for kb in range(cute.size(fr_a, mode=[2])):
        cute.gemm(tiled_mma, acc, fr_a[None, None, kb], fr_b[None, None, kb], acc)


def _swz(smem, DT, layout):
    """A shared-memory tensor for a swizzled (composed) layout: the swizzle goes on the pointer."""
    return smem.allocate_tensor(DT, layout.outer, byte_alignment=1024, swizzle=layout.inner)


def _issue_rows(atom, mX, sX, b, bos, t0, Tn, h, col0, width):
    """cp.async one chunk's rows [t0, t0 + C) of mX[b, bos + ., h, col0 : col0 + width] into sX (C x width):
    16-byte vectors spread over the CTA's threads; the token index is clamped into the sequence."""
    tidx, _, _ = cute.arch.thread_idx()
    nv = width // VEC
    C = cute.size(sX, mode=[0])
    for it in range(C * nv // NTHR):
        idx = tidx + NTHR * it
        r = idx // nv
        cv = idx % nv
        tok = bos + cutlass.min(t0 + r, Tn - 1)
        src = _al(cute.local_tile(mX[b, tok, h, None], (VEC,), (col0 // VEC + cv,)), 16)
        cute.copy(atom, src, _rowvec(sX, r, cv))


class LightningPrefill:
    """Static config + @cute.jit launcher + @cute.kernel body."""

    def __init__(self, cfg: LightningPrefillConfig):
        self.cfg = cfg

    def jit_fn(self):
        cfg = self.cfg
        K, BV, C = cfg.K, cfg.bv, cfg.chunk
        DT = _DT[cfg.dtype]
        KP, VP, CP = K + PAD, BV + PAD, C + PAD
        S = cfg.kv_stages
        seq_span = make_seq_span(cfg)

        @cute.kernel
        def kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
                   mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, scale: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            vb, h, n = cute.arch.block_idx()
            b, bos, Tn = seq_span(mQ, mCu, n)
            v0 = vb * BV

            # ---- shared memory (rows padded by PAD elements; 128-byte aligned bases) ----
            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(DT, cute.make_layout((C, K), stride=(KP, 1)), byte_alignment=128)
            sKbuf = smem.allocate_tensor(DT, cute.make_layout((S * C * KP,)), byte_alignment=128)
            sVbuf = smem.allocate_tensor(DT, cute.make_layout((S * C * VP,)), byte_alignment=128)
            sVd = smem.allocate_tensor(DT, cute.make_layout((C, BV), stride=(VP, 1)), byte_alignment=128)
            sS0 = smem.allocate_tensor(DT, cute.make_layout((K, BV), stride=(VP, 1)), byte_alignment=128)
            sP = smem.allocate_tensor(DT, cute.make_layout((C, C), stride=(CP, 1)), byte_alignment=128)
            if cutlass.const_expr(S == 1 or BV != C):
                sO = smem.allocate_tensor(DT, cute.make_layout((C, BV), stride=(VP, 1)), byte_alignment=128)
            else:
                # the output tile reuses P's rows: warp w reads only P rows [16w, 16w + 16) (its M tile) and
                # writes only O rows [16w, 16w + 16), so a warp sync orders them (C == BV: same shape)
                sO = sP
            sTab = smem.allocate_tensor(Float32, cute.make_layout((C + 8,)), byte_alignment=16)
            # transposed views (the N / M dimension contiguous): B operands V^T, Vd^T, S0^T; A operand K^T
            sVdt = cute.make_tensor(sVd.iterator, cute.make_layout((BV, C), stride=(1, VP)))
            sS0t = cute.make_tensor(sS0.iterator, cute.make_layout((BV, K), stride=(1, VP)))
            sK0, sV0 = _stage(sKbuf, 0, C, K, KP), _stage(sVbuf, 0, C, BV, VP)

            # ---- MMA and copy atoms ----
            tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(DT, Float32, (16, 8, 16)), (NTHR // 32, 1, 1),
                                            permutation_mnk=(NTHR // 32 * 16, 16, 16))
            thr_mma = tiled_mma.get_slice(tidx)
            ld = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), DT)
            ldt = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), DT)
            cpy_a = cute.make_tiled_copy_A(ld, tiled_mma).get_slice(tidx)
            cpy_at = cute.make_tiled_copy_A(ldt, tiled_mma).get_slice(tidx)
            cpy_b = cute.make_tiled_copy_B(ld, tiled_mma).get_slice(tidx)
            cpy_bt = cute.make_tiled_copy_B(ldt, tiled_mma).get_slice(tidx)
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), DT,
                                      num_bits_per_copy=128)

            # GEMM 1: Q (C x K) . K^T ; GEMM 2a: Q . S0 ; GEMM 2b: P (C x C) . V ; GEMM 3: K^T (K x C) . Vd
            fQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            fK = thr_mma.make_fragment_B(thr_mma.partition_B(sK0))
            fS0 = thr_mma.make_fragment_B(thr_mma.partition_B(sS0t))
            fP = thr_mma.make_fragment_A(thr_mma.partition_A(sP))
            fV = thr_mma.make_fragment_B(thr_mma.partition_B(_stage(sVbuf, 0, C, BV, VP, transposed=True)))
            fKt = thr_mma.make_fragment_A(thr_mma.partition_A(_stage(sKbuf, 0, C, K, KP, transposed=True)))
            fVd = thr_mma.make_fragment_B(thr_mma.partition_B(sVdt))
            tsQ, trQ = cpy_a.partition_S(sQ), cpy_a.retile(fQ)
            trK = cpy_b.retile(fK)
            tsS0, trS0 = cpy_bt.partition_S(sS0t), cpy_bt.retile(fS0)
            tsP, trP = cpy_a.partition_S(sP), cpy_a.retile(fP)
            trV = cpy_bt.retile(fV)
            trKt = cpy_at.retile(fKt)
            tsVd, trVd = cpy_bt.partition_S(sVdt), cpy_bt.retile(fVd)

            # accumulator coordinates (row, col) of this thread's elements
            tAc = thr_mma.partition_C(cute.make_identity_tensor((C, C)))
            tOc = thr_mma.partition_C(cute.make_identity_tensor((C, BV)))
            tCsP = thr_mma.partition_C(sP)
            tCsO = thr_mma.partition_C(sO)
            tCsS0 = thr_mma.partition_C(sS0)

            # ---- decay table exp(g d), d = 0..C (accurate exp: these factors multiply the whole state) ----
            gam = Float32(mG[h])
            if tidx <= C:
                sTab[tidx] = cute.math.exp(gam * Float32(tidx), fastmath=False)

            # ---- the state block S[:, v0 : v0 + BV] (fp32 accumulator of GEMM 3) ----
            accS = cute.make_rmem_tensor(thr_mma.partition_shape_C((K, BV)), Float32)
            accS.fill(0.0)
            if cutlass.const_expr(cfg.has_h0):
                tCg = thr_mma.partition_C(cute.local_tile(mH0[n, h, None, None], (K, BV), (0, vb)))
                r0 = cute.make_fragment_like(tCg)
                cute.autovec_copy(tCg, r0)
                accS.store(r0.load().to(Float32))

            nch = (Tn + C - 1) // C
            if nch > 0:
                _issue_rows(g2s, mQ, sQ, b, bos, Int32(0), Tn, h, 0, K)
                _issue_rows(g2s, mK, sK0, b, bos, Int32(0), Tn, h, 0, K)
                _issue_rows(g2s, mV, sV0, b, bos, Int32(0), Tn, h, v0, BV)
                cute.arch.cp_async_commit_group()

            for c in cutlass.range(nch, unroll=1):
                t0 = c * C
                L = cutlass.min(Int32(C), Tn - t0)
                st = 0
                if cutlass.const_expr(S == 2):
                    st = c % 2
                sK, sV = _stage(sKbuf, st, C, K, KP), _stage(sVbuf, st, C, BV, VP)
                tsK = cpy_b.partition_S(sK)
                tsV = cpy_bt.partition_S(_stage(sVbuf, st, C, BV, VP, transposed=True))
                tsKt = cpy_at.partition_S(_stage(sKbuf, st, C, K, KP, transposed=True))
                if cutlass.const_expr(S == 2):
                    # next chunk's K, V into the other stage: its readers (chunk c - 1) passed barrier 3
                    if c + 1 < nch:
                        st1 = (c + 1) % S
                        _issue_rows(g2s, mK, _stage(sKbuf, st1, C, K, KP), b, bos, t0 + C, Tn, h, 0, K)
                        _issue_rows(g2s, mV, _stage(sVbuf, st1, C, BV, VP), b, bos, t0 + C, Tn, h, v0, BV)
                        cute.arch.cp_async_commit_group()
                # S0 (bf16) for GEMM 2a: its readers of the previous chunk passed barrier 2 of that chunk
                rS0 = cute.make_fragment_like(accS, DT)
                rS0.store(accS.load().to(DT))
                cute.autovec_copy(rS0, tCsS0)
                if cutlass.const_expr(S == 2):
                    if c + 1 < nch:
                        cute.arch.cp_async_wait_group(1)   # all but the group just issued (chunk c + 1's K, V)
                    else:
                        cute.arch.cp_async_wait_group(0)
                else:
                    cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()  # (1) this chunk's q/k/v, S0 and (first chunk) the table are visible

                # GEMM 1 -> P = mask/decay(Q K^T), bf16 into sP
                accA = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, C)), Float32)
                accA.fill(0.0)
                _gemm(tiled_mma, accA, cpy_a, tsQ, trQ, fQ, cpy_b, tsK, trK, fK)
                for e in cutlass.range_constexpr(cute.size(accA)):
                    i, j = tAc[e]
                    f = sTab[cutlass.max(i - j, 0)]
                    accA[e] = cutlass.select_(j <= i, accA[e] * f, Float32(0.0))
                rP = cute.make_fragment_like(accA, DT)
                rP.store(accA.load().to(DT))
                cute.autovec_copy(rP, tCsP)

                # GEMM 2a: O = exp(g(i+1)) Q S0
                accO = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, BV)), Float32)
                accO.fill(0.0)
                _gemm(tiled_mma, accO, cpy_a, tsQ, trQ, fQ, cpy_bt, tsS0, trS0, fS0)
                for e in cutlass.range_constexpr(cute.size(accO)):
                    i, _ = tOc[e]
                    accO[e] = accO[e] * sTab[i + 1]

                # Vd = exp(g(L-1-j)) v_j (j < L; 0 past the end): thread -> row tidx // 2, half tidx % 2
                # (rows past the end hold a clamped, finite token: times 0 they are exactly 0)
                jr = tidx // 2
                fv = cutlass.select_(jr < L, sTab[cutlass.max(L - 1 - jr, 0)], Float32(0.0))
                for hv in cutlass.range_constexpr(BV // VEC // 2):
                    cv = (tidx % 2) * (BV // VEC // 2) + hv
                    rv = cute.make_rmem_tensor((VEC,), DT)
                    cute.autovec_copy(_rowvec(sV, jr, cv), rv)
                    rv.store((rv.load().to(Float32) * fv).to(DT))
                    cute.autovec_copy(rv, _rowvec(sVd, jr, cv))
                cute.arch.barrier()  # (2) P and Vd visible; every read of sQ and sS0 is done

                if c + 1 < nch:
                    _issue_rows(g2s, mQ, sQ, b, bos, t0 + C, Tn, h, 0, K)
                    cute.arch.cp_async_commit_group()

                # GEMM 2b: O += P V
                _gemm(tiled_mma, accO, cpy_a, tsP, trP, fP, cpy_bt, tsV, trV, fV)
                # GEMM 3: S = exp(gL) S + K^T Vd
                accS.store(accS.load() * sTab[L])
                _gemm(tiled_mma, accS, cpy_at, tsKt, trKt, fKt, cpy_bt, tsVd, trVd, fVd)

                # output rows: scale, to the output dtype, staged in sO for 16-byte stores
                rO = cute.make_fragment_like(accO, DT)
                rO.store((accO.load() * scale).to(DT))
                if cutlass.const_expr(S == 2):
                    cute.arch.sync_warp()  # this warp's ldmatrix reads of its P rows precede the O writes there
                cute.autovec_copy(rO, tCsO)
                cute.arch.barrier()  # (3) sO visible; every read of sK, sV, sVd, sP is done

                if cutlass.const_expr(S == 1):
                    if c + 1 < nch:
                        _issue_rows(g2s, mK, sK, b, bos, t0 + C, Tn, h, 0, K)
                        _issue_rows(g2s, mV, sV, b, bos, t0 + C, Tn, h, v0, BV)
                        cute.arch.cp_async_commit_group()

                for it in cutlass.range_constexpr(C * (BV // VEC) // NTHR):
                    idx = tidx + NTHR * it
                    r = idx // (BV // VEC)
                    cv = idx % (BV // VEC)
                    if r < L:
                        ro = cute.make_rmem_tensor((VEC,), DT)
                        cute.autovec_copy(_rowvec(sO, r, cv), ro)
                        dst = _al(cute.local_tile(mO[b, bos + t0 + r, h, None], (VEC,), (v0 // VEC + cv,)), 16)
                        cute.autovec_copy(ro, dst)

            if cutlass.const_expr(cfg.has_ht):
                tCg = thr_mma.partition_C(cute.local_tile(mHt[n, h, None, None], (K, BV), (0, vb)))
                cute.autovec_copy(accS, tCg)

        kern = kernel if cfg.mma == "sync" else self._wgmma_kernel()

        @cute.jit
        def launch(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
                   mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, scale: Float32, stream):
            if cutlass.const_expr(cfg.varlen):
                nseq = mCu.shape[0] - 1
            else:
                nseq = mQ.shape[0]
            kern(mQ, mK, mV, mG, mH0, mHt, mO, mCu, scale).launch(
                grid=[cfg.V // BV, mQ.shape[2], nseq], block=[NTHR, 1, 1], stream=stream)

        return launch

    def _wgmma_kernel(self):
        """The same schedule with warpgroup MMAs (cfg.mma == "wgmma"): the 4 warps are one warpgroup; every
        GEMM operand lives in shared memory in a 128-byte-swizzled canonical layout:
          Q [token][kidx] K-major (A of QK^T and Q S0)   K [token][kidx]: K-major B of QK^T and, the same
          bytes, MN-major A of K^T Vd                      V, Vd [token][v]: MN-major B of P V and K^T Vd
          S0 [kidx][v]: MN-major B of Q S0                 P [i][j]: K-major A of P V
        Generic-proxy writes (cp.async, st.shared) are fenced to the async proxy before the barrier that
        publishes them; each GEMM pair is one wgmma group (fence, MMAs, commit, wait 0)."""
        cfg = self.cfg
        K, BV, C = cfg.K, cfg.bv, cfg.chunk
        DT = _DT[cfg.dtype]
        VP = BV + PAD
        seq_span = make_seq_span(cfg)
        KMJ, MNJ = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN

        @cute.kernel
        def kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
                   mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, scale: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            vb, h, n = cute.arch.block_idx()
            b, bos, Tn = seq_span(mQ, mCu, n)
            v0 = vb * BV

            aK = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, DT)
            aM = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, DT)
            LQ = cute.tile_to_shape(aK, (C, K), (0, 1))      # (token, kidx)
            LKt = cute.tile_to_shape(aM, (K, C), (1, 0))     # (kidx, token): the bytes of LQ's tiling
            LV = cute.tile_to_shape(aM, (BV, C), (1, 0))     # (v, token)
            LS0 = cute.tile_to_shape(aM, (BV, K), (1, 0))    # (v, kidx)
            LP = cute.tile_to_shape(aK, (C, C), (0, 1))      # (i, j)
            smem = cutlass.memory.SmemAllocator()
            sQ = _swz(smem, DT, LQ)
            sK = _swz(smem, DT, LQ)
            sVt = _swz(smem, DT, LV)
            sVdt = _swz(smem, DT, LV)
            sS0t = _swz(smem, DT, LS0)
            sP = _swz(smem, DT, LP)
            sO = smem.allocate_tensor(DT, cute.make_layout((C, BV), stride=(VP, 1)), byte_alignment=128)
            sTab = smem.allocate_tensor(Float32, cute.make_layout((C + 8,)), byte_alignment=16)
            sKt = cute.make_tensor(sK.iterator, LKt.outer)
            sV = cute.make_tensor(sVt.iterator, cute.select(LV.outer, mode=[1, 0]))     # (token, v)
            sVd = cute.make_tensor(sVdt.iterator, cute.select(LV.outer, mode=[1, 0]))
            sS0 = cute.make_tensor(sS0t.iterator, cute.select(LS0.outer, mode=[1, 0]))  # (kidx, v)

            mma1 = sm90.make_trivial_tiled_mma(DT, DT, KMJ, KMJ, Float32, (1, 1, 1), (C, C))     # Q K^T
            mma2 = sm90.make_trivial_tiled_mma(DT, DT, KMJ, MNJ, Float32, (1, 1, 1), (C, BV))    # Q S0, P V
            mma3 = sm90.make_trivial_tiled_mma(DT, DT, MNJ, MNJ, Float32, (1, 1, 1), (64, BV))   # K^T Vd
            for m in (mma1, mma2, mma3):
                m.set(warpgroup.Field.ACCUMULATE, True)
            t1, t2, t3 = mma1.get_slice(tidx), mma2.get_slice(tidx), mma3.get_slice(tidx)
            fQ1 = mma1.make_fragment_A(t1.partition_A(sQ))
            fK1 = mma1.make_fragment_B(t1.partition_B(sK))
            fQ2 = mma2.make_fragment_A(t2.partition_A(sQ))
            fS0 = mma2.make_fragment_B(t2.partition_B(sS0t))
            fP = mma2.make_fragment_A(t2.partition_A(sP))
            fV = mma2.make_fragment_B(t2.partition_B(sVt))
            fKt = mma3.make_fragment_A(t3.partition_A(sKt))
            fVd = mma3.make_fragment_B(t3.partition_B(sVdt))
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), DT,
                                      num_bits_per_copy=128)

            tAc = t1.partition_C(cute.make_identity_tensor((C, C)))
            tOc = t2.partition_C(cute.make_identity_tensor((C, BV)))
            tCsP = t1.partition_C(sP)
            tCsO = t2.partition_C(sO)
            tCsS0 = t3.partition_C(sS0)

            gam = Float32(mG[h])
            if tidx <= C:
                sTab[tidx] = cute.math.exp(gam * Float32(tidx), fastmath=False)

            accS = cute.make_rmem_tensor(t3.partition_shape_C((K, BV)), Float32)
            accS.fill(0.0)
            if cutlass.const_expr(cfg.has_h0):
                tCg = t3.partition_C(cute.local_tile(mH0[n, h, None, None], (K, BV), (0, vb)))
                r0 = cute.make_fragment_like(tCg)
                cute.autovec_copy(tCg, r0)
                accS.store(r0.load().to(Float32))

            nch = (Tn + C - 1) // C
            if nch > 0:
                _issue_rows(g2s, mQ, sQ, b, bos, Int32(0), Tn, h, 0, K)
                _issue_rows(g2s, mK, sK, b, bos, Int32(0), Tn, h, 0, K)
                _issue_rows(g2s, mV, sV, b, bos, Int32(0), Tn, h, v0, BV)
                cute.arch.cp_async_commit_group()

            for c in cutlass.range(nch, unroll=1):
                t0 = c * C
                L = cutlass.min(Int32(C), Tn - t0)
                rS0 = cute.make_fragment_like(accS, DT)
                rS0.store(accS.load().to(DT))
                cute.autovec_copy(rS0, tCsS0)
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")  # cp.async / st.shared -> wgmma reads
                cute.arch.barrier()  # (1)

                # GEMM 1 and GEMM 2a in one wgmma group
                accA = cute.make_rmem_tensor(t1.partition_shape_C((C, C)), Float32)
                accA.fill(0.0)
                accO = cute.make_rmem_tensor(t2.partition_shape_C((C, BV)), Float32)
                accO.fill(0.0)
                warpgroup.fence()
                _wgmma(mma1, accA, fQ1, fK1)
                _wgmma(mma2, accO, fQ2, fS0)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                for e in cutlass.range_constexpr(cute.size(accA)):
                    i, j = tAc[e]
                    f = sTab[cutlass.max(i - j, 0)]
                    accA[e] = cutlass.select_(j <= i, accA[e] * f, Float32(0.0))
                rP = cute.make_fragment_like(accA, DT)
                rP.store(accA.load().to(DT))
                cute.autovec_copy(rP, tCsP)
                for e in cutlass.range_constexpr(cute.size(accO)):
                    i, _ = tOc[e]
                    accO[e] = accO[e] * sTab[i + 1]

                jr = tidx // 2
                fv = cutlass.select_(jr < L, sTab[cutlass.max(L - 1 - jr, 0)], Float32(0.0))
                for hv in cutlass.range_constexpr(BV // VEC // 2):
                    cv = (tidx % 2) * (BV // VEC // 2) + hv
                    rv = cute.make_rmem_tensor((VEC,), DT)
                    cute.autovec_copy(_rowvec(sV, jr, cv), rv)
                    rv.store((rv.load().to(Float32) * fv).to(DT))
                    cute.autovec_copy(rv, _rowvec(sVd, jr, cv))
                cute.arch.fence_proxy("async.shared", space="cta")  # P, Vd -> wgmma reads
                cute.arch.barrier()  # (2) P and Vd visible; every read of sQ and sS0 is done

                if c + 1 < nch:
                    _issue_rows(g2s, mQ, sQ, b, bos, t0 + C, Tn, h, 0, K)
                    cute.arch.cp_async_commit_group()

                # GEMM 2b and GEMM 3 in one wgmma group
                accS.store(accS.load() * sTab[L])
                warpgroup.fence()
                _wgmma(mma2, accO, fP, fV)
                _wgmma(mma3, accS, fKt, fVd)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                rO = cute.make_fragment_like(accO, DT)
                rO.store((accO.load() * scale).to(DT))
                cute.autovec_copy(rO, tCsO)
                cute.arch.barrier()  # (3) sO visible; every read of sK, sV, sVd, sP is done

                if c + 1 < nch:
                    _issue_rows(g2s, mK, sK, b, bos, t0 + C, Tn, h, 0, K)
                    _issue_rows(g2s, mV, sV, b, bos, t0 + C, Tn, h, v0, BV)
                    cute.arch.cp_async_commit_group()

                for it in cutlass.range_constexpr(C * (BV // VEC) // NTHR):
                    idx = tidx + NTHR * it
                    r = idx // (BV // VEC)
                    cv = idx % (BV // VEC)
                    if r < L:
                        ro = cute.make_rmem_tensor((VEC,), DT)
                        cute.autovec_copy(_rowvec(sO, r, cv), ro)
                        dst = _al(cute.local_tile(mO[b, bos + t0 + r, h, None], (VEC,), (v0 // VEC + cv,)), 16)
                        cute.autovec_copy(ro, dst)

            if cutlass.const_expr(cfg.has_ht):
                tCg = t3.partition_C(cute.local_tile(mHt[n, h, None, None], (K, BV), (0, vb)))
                cute.autovec_copy(accS, tCg)

        return kernel

    def fake_args(self):
        """Fake tensors with symbolic sizes: the compile signature (8 tensors, scale, stream)."""
        c = self.cfg
        K, V = c.K, c.V
        B, T, H = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        dt = _DT[c.dtype]
        so = (3, 2, 1, 0)  # row-major; 32-bit strides (check() rejects >= 2^31 elements)
        q = make_fake_compact_tensor(dt, (B, T, H, K), stride_order=so, assumed_align=16, use_32bit_stride=True)
        k = make_fake_compact_tensor(dt, (B, T, H, K), stride_order=so, assumed_align=16, use_32bit_stride=True)
        v = make_fake_compact_tensor(dt, (B, T, H, V), stride_order=so, assumed_align=16, use_32bit_stride=True)
        o = make_fake_compact_tensor(dt, (B, T, H, V), stride_order=so, assumed_align=16, use_32bit_stride=True)
        g = make_fake_compact_tensor(Float32, (H,), assumed_align=4)
        h0 = ht = cu = None
        if c.has_h0:
            h0 = make_fake_tensor(_DT[c.h0_dtype], (cute.sym_int32(), H, K, V),
                                  (cute.sym_int64(divisibility=8), K * V, V, 1), assumed_align=16)
        if c.has_ht:
            ht = make_fake_tensor(Float32, (cute.sym_int32(), H, K, V),
                                  (cute.sym_int64(divisibility=8), K * V, V, 1), assumed_align=16)
        if c.varlen:
            cu = make_fake_compact_tensor(_DT[c.cu_dtype], (cute.sym_int32(),))
        return (q, k, v, g, h0, ht, o, cu, Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))

    def expect_ptx(self):
        common = (r"cp\.async\.cg\.shared\.global(\.\w+)*\s*\[[^\]]+\],\s*\[[^\]]+\],\s*16",
                  r"st\.global(\.\w+)*\.v4\.b32", r"bar\.sync")
        if self.cfg.mma == "wgmma":
            return (r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.(bf16\.bf16|f16\.f16)",
                    r"wgmma\.fence\.sync\.aligned", r"wgmma\.commit_group\.sync\.aligned",
                    r"wgmma\.wait_group\.sync\.aligned", r"fence\.proxy\.async\.shared::cta", *common)
        return (r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\.(bf16|f16)\.f32",
                r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16",
                r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16", *common)

    def spec(self) -> KernelSpec:
        def build():
            return self.jit_fn(), self.fake_args()

        return KernelSpec("lightning_prefill", self.cfg.key(), build, expect_ptx=self.expect_ptx())


def representative_configs() -> list:
    """What CI compiles for sm_90a: the serving shape (bf16, h0 + ht), fp16 varlen without h0, a bf16
    initial state with int64 cu_seqlens, inference without a final state, and K = V = 64."""
    P = LightningPrefillConfig
    return [
        P(has_h0=True, has_ht=True),
        P(dtype="float16", varlen=True, has_h0=False, has_ht=True),
        P(has_h0=True, h0_dtype="bfloat16", varlen=True, cu_dtype="int64"),
        P(has_h0=False, has_ht=False),
        P(K=64, V=64, has_h0=True, has_ht=True),
        P(has_h0=True, has_ht=True, kv_stages=2),
        P(has_h0=True, has_ht=True, bv=32, varlen=True),
        P(dtype="float16", varlen=True, has_h0=True, has_ht=True, kv_stages=2),
        P(has_h0=True, has_ht=True, mma="wgmma"),
        P(dtype="float16", varlen=True, has_h0=False, has_ht=True, mma="wgmma"),
        P(K=64, V=64, has_h0=True, h0_dtype="float16", has_ht=True, mma="wgmma"),
    ]


@register_kernel("lightning_prefill")
def _specs() -> list:
    return [LightningPrefill(c).spec() for c in representative_configs()]


TUNING.add("lightning_prefill", LightningPrefillConfig, lambda c: LightningPrefill(c).spec())


def set_tuning(**knobs) -> None:
    """Override LightningPrefillConfig fields (e.g. kv_stages=2) for every config the host wrapper builds
    (no arguments: back to the defaults); forgets memoized plans. Tests and benchmarks.variants use it."""
    TUNING.set("lightning_prefill", **knobs)


def get_kernel(cfg: LightningPrefillConfig):
    """The compiled TVM-FFI callable for a config (tuning knobs applied); process cache in front of fla_cula.jit."""
    return TUNING.get("lightning_prefill", cfg)


def compiled_configs() -> list:
    return TUNING.compiled_configs("lightning_prefill")


# ---------------------------------------------------------------------------------------------
# host wrapper
def _compact(shape) -> tuple:
    """Row-major strides of a shape (what the compiled signature assumes, size-1 dims included)."""
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return tuple(reversed(st))


def check(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens) -> str | None:
    """Why the kernel cannot serve this chunk_simple_gla(g_gamma=...) forward, or None. No host sync.
    check_static() and check_sizes() together: the first reads no runtime size (B, T, N), so routing
    decides it once per size-free signature; the second runs on every call."""
    return check_static(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens) or \
        check_sizes(q, k, v, initial_state, cu_seqlens)


def check_static(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens) -> str | None:
    """dtypes, ranks, head counts and dims, contiguity, alignment, devices: nothing that depends on B, T
    or the number of sequences."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            return f"{name} is not a tensor"
        if x.dtype not in (torch.bfloat16, torch.float16):
            return f"{name} dtype {x.dtype}: kernel supports bf16/fp16"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: kernel needs one dtype"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return f"q/k/v ranks {q.ndim}/{k.ndim}/{v.ndim}: expected [B, T, H, D]"
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    if k.shape[2:] != q.shape[2:] or v.shape[2] != H:
        return (f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)}: "
                "expected [B, T, H, K] twice and [B, T, H, V]")
    if (K, V) not in ((128, 128), (64, 64)):
        return f"head dims K={K} V={V}: kernel supports K=V=128 and K=V=64"
    if H == 0 or H > 65535:
        return f"H={H}: the grid holds 1 to 65535 heads"
    dev = q.device
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device != dev:
            return f"{name} on {x.device}, q on {dev}"
        if not x.is_contiguous():
            return f"{name} not contiguous (strides {x.stride()})"
        if not aligned(x):
            return f"{name} not 16-byte aligned"
    if not isinstance(g_gamma, torch.Tensor) or g_gamma.dtype != torch.float32:
        return "g_gamma: expected a float32 tensor"
    if g_gamma.ndim != 1 or g_gamma.shape[0] != H or not g_gamma.is_contiguous() or g_gamma.device != dev:
        return f"g_gamma shape {tuple(g_gamma.shape)}: expected contiguous [{H}] on {dev}"
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        return f"scale {scale!r}: expected a finite float"
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in INT:
            return "cu_seqlens: expected an int32/int64 tensor"
        if cu_seqlens.ndim != 1 or not cu_seqlens.is_contiguous() or cu_seqlens.device != dev:
            return f"cu_seqlens shape {tuple(cu_seqlens.shape)}: expected contiguous [N+1] on {dev}"
    if initial_state is not None:
        s = initial_state
        if not isinstance(s, torch.Tensor):
            return "initial_state is not a tensor"
        if s.dtype not in FLOAT:
            return f"initial_state dtype {s.dtype}: kernel supports float32/bf16/fp16"
        if s.ndim != 4 or tuple(s.shape[1:]) != (H, K, V):
            return f"initial_state shape {tuple(s.shape)}: expected [N, {H}, {K}, {V}] (K-major)"
        if s.device != dev:
            return f"initial_state on {s.device}, inputs on {dev}"
        if not s.is_contiguous():
            return f"initial_state not contiguous (strides {s.stride()})"
        if not aligned(s):
            return "initial_state not 16-byte aligned"
    return None


def check_sizes(q, k, v, initial_state, cu_seqlens) -> str | None:
    """The per-call checks on runtime sizes (no host sync: shapes only)."""
    B, T, H, K = q.shape
    V = v.shape[3]
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        return f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)}: batch and length must agree"
    if T == 0:
        return "empty input (T=0)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        # is_contiguous() (in the routing key) ignores the strides of size-1 dims; the compiled signature
        # assumes row-major strides for every dim
        if x.stride() != _compact(x.shape):
            return f"{name} not contiguous (strides {x.stride()})"
        if x.numel() >= I31:
            return f"{name} has >= 2^31 elements"
    r, N = seqs_reason(cu_seqlens, B, q.device)
    if r:
        return r
    if N > 65535:
        return f"{N} sequences: the grid holds at most 65535"
    if N * H * K * V >= I31:
        return "final state has >= 2^31 elements"
    if initial_state is not None:
        s = initial_state
        if s.shape[0] != N:
            return f"initial_state batch {s.shape[0]}: expected {N} (one per sequence)"
        if s.stride()[1:] != _compact(s.shape)[1:] or s.stride(0) % 8:
            return f"initial_state not contiguous (strides {s.stride()})"
    return None


def plan(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens):
    """check_static(), then the compiled kernel for this size-free signature: (reason, None), or (None, go)
    where go(args) runs any call whose arguments have the same signature and pass check_sizes()
    (go.size_reason, which routing calls on every call). Output shapes are read from each call's args."""
    r = check_static(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens)
    if r:
        return r, None
    has_ht = bool(output_final_state)
    K, V = q.shape[3], v.shape[3]
    cfg = LightningPrefillConfig(
        dtype=FLOAT[q.dtype], K=K, V=V, has_h0=initial_state is not None,
        h0_dtype=FLOAT[initial_state.dtype] if initial_state is not None else "float32",
        has_ht=has_ht, varlen=cu_seqlens is not None,
        cu_dtype=INT[cu_seqlens.dtype] if cu_seqlens is not None else "int32")
    fn = get_kernel(cfg)
    dev = q.device

    def go(args):
        """args: (q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens), as check takes them."""
        q, k, v, g_gamma, scale, h0, _, cu = args
        N = q.shape[0] if cu is None else cu.shape[0] - 1
        o = torch.empty(v.shape, dtype=q.dtype, device=dev)
        ht = torch.empty((N, q.shape[2], K, V), dtype=torch.float32, device=dev) if has_ht else None
        launch(fn, dev, q, k, v, g_gamma, h0, ht, o, cu, float(scale))
        return o, ht

    return None, go


def plan_chunk(q, k, v, g_gamma, initial_state, cu_seqlens, cfg):
    """plan() in the form fla_cula.ops.chunk_autograd plans chunk_lightning_attn: cfg holds scale and
    output_final_state (chunk_size changes nothing here). Returns (reason, None) or (None, fwd) with
    fwd(q, k, v, g_gamma, initial_state, cu_seqlens, cfg, chunk_indices) -> (o, final_state or None)
    and fwd.size_reason(q, k, v, g_gamma, initial_state, cu_seqlens, cfg), the per-call size checks."""
    r, go = plan(q, k, v, g_gamma, cfg.scale, initial_state, cfg.output_final_state, cu_seqlens)
    if r:
        return r, None

    def fwd(q, k, v, g_gamma, initial_state, cu_seqlens, cfg, chunk_indices=None):
        return go((q, k, v, g_gamma, cfg.scale, initial_state, cfg.output_final_state, cu_seqlens))

    fwd.size_reason = lambda q, k, v, g_gamma, h0, cu, cfg: check_sizes(q, k, v, h0, cu)
    return None, fwd


def run(*args):
    """chunk_simple_gla(g_gamma=...) forward on the arguments of check(); returns (o, final_state or None).
    The op layer memoizes plan() per signature; this form serves tests and tools."""
    r, go = plan(*args)
    r = r or check_sizes(args[0], args[1], args[2], args[5], args[7])
    if r:
        raise ValueError(f"lightning_prefill: {r}")
    return go(args)
