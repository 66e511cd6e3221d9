# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""Lightning-attention prefill, warp-specialized (SM90, CuTe DSL): LightningPrefillConfig(ws=True).

The math is lightning_prefill's (chunks of C = 64 tokens, g = g_gamma[h] <= 0, S fp32 K x BV):
  o_i   = scale * [ exp(g(i+1)) q_i^T S_c + sum_{j<=i} exp(g(i-j)) (q_i . k_j) v_j ]
  S_c+1 = exp(gL) S_c + sum_{j<L} exp(g(L-1-j)) k_j v_j^T
Only the state update is a serial chain; each chunk's output needs S_c and nothing after it. So one CTA per
(BV-column block, head, sequence) runs three warpgroups of 128 threads:
  WG0  producer: one warp issues the chunk's Q, K, V boxes by TMA into a ring of ws_stages stages (mbarriers `ld`);
  WG1  state:    owns S (fp32 accumulators, K x BV). Per chunk c: publish bf16(S_c) into a slot of the S_c ring
                 (mbarriers `sp`), then Vd = decay(V) in shared memory and S += K^T Vd (wgmma);
  WG2  output:   per chunk c: A = Q K^T and O = Q S_c (one wgmma group), P = mask/decay(A) in registers,
                 O = exp(g(i+1)) O + P V (wgmma, P from registers), then o through an o slot: one TMA store of the
                 whole tile (o_tma), or 16-byte rows by the warpgroup's threads.
The state warpgroup runs up to an S_c ring ahead of the output warpgroup; the producer up to ws_stages chunks.
setmaxnreg: 24 registers for the producer, 240 for the two math warpgroups (128 x 504 <= 64K).
H200 measurements and the reasoning: docs/lightning_prefill.md, "v3 (session 16)".

Shared memory (bf16, BV = 128): Q, K, V 48 KB per stage x ws_stages, the bf16 S_c slots (32 KB each), Vd 16 KB,
the o slots (16 KB each): smem_plan() fits them in 227 KB, one CTA per SM. Layouts are lightning_prefill's wgmma
ones (128-byte swizzle): Q, K [token][kidx] K-major (K's bytes are also the MN-major A of K^T Vd), V, Vd
[token][v] and S_c [kidx][v] MN-major; the o slots [token][v] rows of 128-byte swizzle atoms, the TMA store's box.

Tails and varlen: a chunk's TMA box starts at the sequence's token bos + 64 c. Rows past the sequence are the next
sequence's tokens or zero (TMA fills past the tensor's end): finite. P_ij = 0 for j > i and Vd_j = 0 for j >= L
remove them from every sum; only rows i < L are stored (TMA clips a box at T; a varlen sequence's tail chunk goes
out row by row, its box would overwrite the next sequence's rows). Not here (lightning_prefill's kernels serve them):
reverse runs, the three-launch split's state pass (has_o=False).

Q/K multicast (cfg.mcast; unsplit, V = 2 BV): the head's two V-block CTAs (tiles 2m, 2m + 1) run as a cluster of 2; each
TMA-loads half of a chunk's Q and K rows into both CTAs' stage (multicast), and a stage is refilled once both CTAs'
consumer warps have released it (each warp arrives on the empty barrier of both CTAs). Cluster barriers after the
mbarrier init and before exit. Not yet measured (docs/lightning_prefill.md, "v5").

The fused sequence split (cfg.seg): one launch, one CTA per tile (BV block, head, segment p of sequence n), segments of
seg_len tokens (a multiple of C). The recurrence is linear, so with X_p the local state of segment p (from zero) and
d = exp(g seg_len), segment p starts from S_in(p) = d S_in(p-1) + X_(p-1), S_in(0) = h0. A CTA whose segment has more
tokens after it first runs the state warpgroup alone over the segment's K, V (the producer loads no Q; the output
warpgroup releases those stages unread), stores X_p (fp32) to mX and sets its flag (release). Then every CTA waits for
the flags of its earlier segments (acquire), sums S_in(p) by that recurrence in registers, and runs the loop above
from it; the sequence's last segment writes the final state. A CTA takes its tile from a ticket (an atomic counter in
mFlag[0]) in the order CTAs start, so the segments it waits for belong to CTAs already running: no deadlock whatever
the grid size. mFlag = [ticket, done, one flag per tile] is zero at launch, and the launch leaves it zero: once a CTA's
state warpgroup has read its last flag, its idle producer warp 1 counts the CTA done, and the last CTA done re-zeroes
mFlag, so the host needs no fill per call (lightning_prefill.split_flags owns the buffers).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import hopper_helpers as sm90

from fla_cula.kernels._dsl import DT as _DT
from fla_cula.kernels._dsl import make_seq_span
from fla_cula.kernels.lightning_prefill import (
    PAD,
    _acc_as_a,
    _decay_v,
    _mask_decay,
    _qk_and_qs,
    _state_init,
    _state_store,
    _store_o_rows,
    _swz,
    _wgmma,
)

WG = 128                  # threads per warpgroup
NTHR = 3 * WG             # producer, state, output
REGS_LOAD, REGS_MATH = 24, 240
BAR_STATE, BAR_OUT = 1, 2  # named barriers of the state and output warpgroups (0 is __syncthreads)
BAR_DONE = 3               # the fused split: the state warpgroup's flag reads are done (producer warp 1 waits)
SMEM_BYTES = 227 * 1024 - 1024   # the SM90 per-block maximum, less the swizzled buffers' alignment gaps


def smem_plan(cfg) -> tuple:
    """(Q/K/V stages, bf16 S_c slots, o slots, bytes): cfg.ws_stages stages (0: the most of 4, 3, 2 that fit); two S_c
    and two o slots where they fit, else one S_c slot (the state warpgroup then waits for the output warpgroup's
    Q S_c before publishing the next), else one o slot too (one more named barrier per chunk). ValueError when
    even that does not fit."""
    K, BV, C = cfg.K, cfg.bv, cfg.chunk
    e = 2   # bf16 / fp16
    stage, s_slot, o_slot = (2 * C * K + C * BV) * e, K * BV * e, C * (BV + (0 if cfg.o_tma else PAD)) * e
    fixed = C * BV * e + (C + 8) * 4 + 8 * 16   # Vd, the decay table, mbarriers
    if cfg.ws_stages not in (0, 2, 3, 4):
        raise ValueError(f"ws_stages {cfg.ws_stages}: expected 0 (the deepest that fits), 2, 3 or 4")
    for n in (cfg.ws_stages,) if cfg.ws_stages else (4, 3, 2):
        for ns, no in ((2, 2), (1, 2), (1, 1)):
            total = n * stage + ns * s_slot + no * o_slot + fixed
            if total <= SMEM_BYTES:
                return n, ns, no, total
    raise ValueError(f"ws_stages {cfg.ws_stages} at K={K} bv={BV}: {cfg.ws_stages} x {stage} B of Q/K/V stages do "
                     f"not fit the {SMEM_BYTES} B of shared memory")


def _layouts(cfg):
    """The shared-memory layouts (composed: swizzle o outer), in the order each tile is addressed:
    Q and K (token, kidx, stage) K-major; V (token, v, stage) and Vd (token, v) MN-major; S_c (kidx, v, slot);
    with o_tma the o slots (token, v, slot), v contiguous in 128-byte-swizzled rows (the TMA store's box)."""
    K, BV, C = cfg.K, cfg.bv, cfg.chunk
    DT = _DT[cfg.dtype]
    NST, NS, NO, _ = smem_plan(cfg)
    aK = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, DT)
    aM = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, DT)
    LQ = cute.tile_to_shape(aK, (C, K, NST), (0, 1, 2))
    LVt = cute.tile_to_shape(aM, (BV, C, NST), (1, 0, 2))    # (v, token, stage)
    LVdt = cute.tile_to_shape(aM, (BV, C), (1, 0))
    LSt = cute.tile_to_shape(aM, (BV, K, NS), (1, 0, 2))     # (v, kidx, slot)
    LV = cute.make_composed_layout(LVt.inner, 0, cute.select(LVt.outer, mode=[1, 0, 2]))
    LO = cute.tile_to_shape(aK, (C, BV, NO), (0, 1, 2))
    return LQ, LVt, LV, LVdt, LSt, LO


def _tok_major(m: cute.Tensor):
    """q/k/v [B, T, H, D] viewed as (T, D, H, B): the TMA box (C tokens, D columns) is mode 0 and 1."""
    return cute.make_tensor(m.iterator, cute.select(m.layout, mode=[1, 3, 2, 0]))


def _state_step(ld, cst, mma3, accS, fKt, fVd, sV, sVd, lt, L, tab, DT):
    """The state warpgroup's chunk at ring stage cst (waited for, then released): S = exp(gL) S + K^T Vd. The first
    barrier: the last chunk's K^T Vd is done reading Vd (and, first chunk of a tile, the decays are written); the
    second: Vd is whole."""
    ld.consumer_wait(cst)
    st = cst.index
    cute.arch.barrier(barrier_id=BAR_STATE, number_of_threads=WG)
    _decay_v(sV[None, None, st], sVd, lt, L, tab, DT)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=BAR_STATE, number_of_threads=WG)
    accS.store(accS.load() * tab[L])
    warpgroup.fence()
    _wgmma(mma3, accS, fKt[None, None, None, st], fVd)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    ld.consumer_release(cst)


def _issue_qk_qs(mmas, accA, fQ1, fK1, accO, fQ2, fS):
    """One wgmma group, committed, not waited for: accA = Q K^T and accO = Q S (cfg.o_pipe). mmas = (Q K^T, Q S)
    tiled MMAs, each as (first k-block: ACCUMULATE off, so the accumulators need no zero fill; the others: on)."""
    warpgroup.fence()
    for (m0, m), acc, a, b in zip(mmas, (accA, accO), (fQ1, fQ2), (fK1, fS), strict=True):
        for kb in range(cute.size(a, mode=[2])):   # plain Python: unrolled at trace time
            cute.gemm(m if kb > 0 else m0, acc, a[None, None, kb], b[None, None, kb], acc)
    warpgroup.commit_group()


def _scale_rows_pv(mmaP, accO, accQS, rP, tOc, tab, fV):
    """O = exp(g (i + 1)) (Q S)_i + P V: the rows of accQS (may be accO) scaled into accO, then P V (P = rP, in
    registers) issued and committed, not waited for."""
    for e in range(cute.size(accO)):   # plain Python: unrolled at trace time
        i, _ = tOc[e]
        accO[e] = accQS[e] * tab[i + 1]
    warpgroup.fence()
    _wgmma(mmaP, accO, _acc_as_a(rP), fV)
    warpgroup.commit_group()


def make_tile(cfg):
    """tile(mQ, mCu, t, H, seg_len, nseg) -> (vb, h, n, z, b, bos, Tn, more): tile t = (z H + h) NVB + vb is
    BV-column block vb of head h of sequence n = z (z = n nseg + p with cfg.seg: segment p of sequence n, logical
    tokens [min(p seg_len, L_n), min((p + 1) seg_len, L_n))); its tokens are rows bos .. bos + Tn - 1 of batch row
    b, and `more` tokens of the sequence follow them (0 without cfg.seg)."""
    seq_span = make_seq_span(cfg)
    NVB = cfg.V // cfg.bv

    @cute.jit
    def tile(mQ: cute.Tensor, mCu: cute.Tensor, t, H, seg_len, nseg):
        vb, h, z = t % NVB, t // NVB % H, t // NVB // H
        n = z
        if cutlass.const_expr(cfg.seg):
            n = z // nseg
        b, bos, Tn = seq_span(mQ, mCu, n)
        more = Int32(0)
        if cutlass.const_expr(cfg.seg):
            s0 = cutlass.min((z - n * nseg) * seg_len, Tn)
            bos = bos + s0
            more = Tn - s0
            Tn = cutlass.min(seg_len, more)
            more = more - Tn
        return vb, h, n, z, b, bos, Tn, more

    return tile


def make_launcher(cfg):
    """The @cute.jit launcher and its @cute.kernel: lightning_prefill's unsplit signature plus the SM count nsm (the
    persistent grid's size), or with cfg.seg the fused sequence split's (X, flags, seg_len, nseg; see the module
    docstring)."""
    K, BV, C = cfg.K, cfg.bv, cfg.chunk
    DT = _DT[cfg.dtype]
    VP = BV + PAD
    tile = make_tile(cfg)
    KMJ, MNJ = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
    E = DT.width // 8
    TX, TX_KV = (2 * C * K + C * BV) * E, (C * K + C * BV) * E   # bytes a stage's boxes write: Q, K, V / K, V
    LD_STAGES, S_SLOTS, O_SLOTS, _ = smem_plan(cfg)
    OT, SEG, MC = cfg.o_tma, cfg.seg, cfg.mcast
    NVB = cfg.V // BV
    CLUSTER = 2 if MC else 1   # cfg.mcast: the head's two V-block CTAs (tiles 2m, 2m + 1) are one cluster

    @cute.kernel
    def kernel(tmaQ: cute.CopyAtom, gQt: cute.Tensor, tmaK: cute.CopyAtom, gKt: cute.Tensor, tmaV: cute.CopyAtom,
               gVt: cute.Tensor, tmaO: cute.CopyAtom, gOt: cute.Tensor, mQ: cute.Tensor, mG: cute.Tensor,
               mH0: cute.Tensor, mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, mX: cute.Tensor,
               mFlag: cute.Tensor, scale: Float32, ntiles: Int32, seg_len: Int32, nseg: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lt = tidx % WG
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        H = mQ.shape[2]

        LQ, LVt, LV, LVdt, LSt, LO = _layouts(cfg)
        smem = cutlass.memory.SmemAllocator()
        mbar = smem.allocate_array(cutlass.Int64, 2 * LD_STAGES + 2 * S_SLOTS, byte_alignment=8)
        sQ = _swz(smem, DT, LQ)
        sK = _swz(smem, DT, LQ)
        sVt = _swz(smem, DT, LVt)
        sVdt = _swz(smem, DT, LVdt)
        sSt = _swz(smem, DT, LSt)
        if cutlass.const_expr(OT):
            sO = _swz(smem, DT, LO)
        else:
            sO = smem.allocate_tensor(DT, cute.make_layout((C, BV, O_SLOTS), stride=(VP, 1, C * VP)),
                                      byte_alignment=128)
        sTab = smem.allocate_tensor(Float32, cute.make_layout((2, C + 8), stride=(C + 8, 1)), byte_alignment=16)
        sKt = cute.make_tensor(sK.iterator, cute.select(LQ.outer, mode=[1, 0, 2]))      # (kidx, token, stage)
        sV = cute.make_tensor(sVt.iterator, LV.outer)                                     # (token, v, stage)
        sVd = cute.make_tensor(sVdt.iterator, cute.select(LVdt.outer, mode=[1, 0]))       # (token, v)
        sS = cute.make_tensor(sSt.iterator, cute.select(LSt.outer, mode=[1, 0, 2]))       # (kidx, v, slot)

        if cutlass.const_expr(MC):
            # a stage is written by both CTAs' boxes, so it is free once both CTAs' 8 consumer warps released it: each
            # consumer warp arrives on the stage's empty barrier of both CTAs (16 arrivals per barrier)
            ld = pipeline.PipelineTmaAsync.create(
                num_stages=LD_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * WG), tx_count=TX,
                barrier_storage=mbar, cta_layout_vmnk=cute.make_layout((1, CLUSTER, 1, 1)),
                enable_multicast_signaling=True, defer_sync=True)
        else:
            ld = pipeline.PipelineTmaAsync.create(
                num_stages=LD_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8), tx_count=TX,
                barrier_storage=mbar, defer_sync=True)
        sp = pipeline.PipelineAsync.create(
            num_stages=S_SLOTS, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG),
            barrier_storage=mbar + 2 * LD_STAGES, defer_sync=True)
        # tiles t = t0, t0 + step, ... < ntiles; the rings' states run on across tiles. One tile per CTA (t0 = bid)
        # unless persistent (step = the grid). The fused split numbers its tiles in the order CTAs start (a ticket
        # from mFlag[0]), so every segment a tile waits for belongs to a CTA already running: no deadlock, whatever
        # the grid's size or the other work on the GPU.
        t0, step = bid, nctas
        if cutlass.const_expr(SEG):
            sTk = smem.allocate_array(Int32, 1, byte_alignment=4)
            if tidx == 0:
                sTk[0] = cute.arch.atomic_add(mFlag.iterator.llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(MC):
            # the peer's boxes and arrivals reach this CTA's barriers: both CTAs' barriers are initialized first
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if cutlass.const_expr(SEG):
            t0 = sTk[0]

        if wg == 0:
            # producer: warp 0 issues each chunk's boxes on one mbarrier (the fused split's first pass: K and V)
            cute.arch.setmaxregister_decrease(REGS_LOAD)
            if cutlass.const_expr(SEG):
                # warp 1 (idle otherwise): once the state warpgroup has read its last flag, count this CTA done; the
                # last CTA done re-zeroes the ticket, the counter and the flags for the next launch on this buffer
                if warp == 1:
                    cute.arch.barrier(barrier_id=BAR_DONE, number_of_threads=WG + 32)
                    if tidx == 32:
                        d = cute.arch.atomic_add((mFlag.iterator + 1).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
                        if d == nctas - 1:
                            for j in cutlass.range(ntiles + 2, unroll=1):
                                cute.arch.store((mFlag.iterator + j).llvm_ptr, Int32(0), sem="relaxed", scope="gpu")
            if warp == 0:
                cpasync.prefetch_descriptor(tmaQ)
                cpasync.prefetch_descriptor(tmaK)
                cpasync.prefetch_descriptor(tmaV)
                pst = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, LD_STAGES)
                for t in cutlass.range(t0, ntiles, step, unroll=1):
                    vb, h, n, z, b, bos, Tn, more = tile(mQ, mCu, t, H, seg_len, nseg)
                    nch = (Tn + C - 1) // C
                    gQ = cute.local_tile(cute.domain_offset((bos, 0), gQt[None, None, h, b]), (C, K), (None, 0))
                    gK = cute.local_tile(cute.domain_offset((bos, 0), gKt[None, None, h, b]), (C, K), (None, 0))
                    gV = cute.local_tile(cute.domain_offset((bos, 0), gVt[None, None, h, b]), (C, BV), (None, vb))
                    # with cfg.mcast each CTA's Q and K boxes are its half of the tile's rows, written to both CTAs
                    rank = cute.arch.block_idx_in_cluster() if cutlass.const_expr(MC) else 0
                    tQs, tQg = cpasync.tma_partition(tmaQ, rank, cute.make_layout(CLUSTER),
                                                     cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                    tKs, tKg = cpasync.tma_partition(tmaK, rank, cute.make_layout(CLUSTER),
                                                     cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                    tVs, tVg = cpasync.tma_partition(tmaV, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                                     cute.group_modes(gV, 0, 2))
                    if cutlass.const_expr(SEG):
                        for c in cutlass.range(cutlass.select_(more > 0, nch, 0), unroll=1):
                            ld.sync_object_empty.wait(pst.index, pst.phase)
                            ld.sync_object_full.arrive_and_expect_tx(pst.index, TX_KV)
                            bar = ld.producer_get_barrier(pst)
                            cute.copy(tmaK, tKg[None, c], tKs[None, pst.index], tma_bar_ptr=bar)
                            cute.copy(tmaV, tVg[None, c], tVs[None, pst.index], tma_bar_ptr=bar)
                            pst.advance()
                    for c in cutlass.range(nch, unroll=1):
                        ld.producer_acquire(pst)
                        bar = ld.producer_get_barrier(pst)
                        if cutlass.const_expr(MC):
                            MASK = cutlass.Int16(3)   # both CTAs of the cluster
                            cute.copy(tmaQ, tQg[None, c], tQs[None, pst.index], tma_bar_ptr=bar, mcast_mask=MASK)
                            cute.copy(tmaK, tKg[None, c], tKs[None, pst.index], tma_bar_ptr=bar, mcast_mask=MASK)
                        else:
                            cute.copy(tmaQ, tQg[None, c], tQs[None, pst.index], tma_bar_ptr=bar)
                            cute.copy(tmaK, tKg[None, c], tKs[None, pst.index], tma_bar_ptr=bar)
                        cute.copy(tmaV, tVg[None, c], tVs[None, pst.index], tma_bar_ptr=bar)
                        pst.advance()

        if wg == 1:
            # state: publish bf16(S_c), then S_c+1 = exp(gL) S_c + K^T Vd
            cute.arch.setmaxregister_increase(REGS_MATH)
            mma3 = sm90.make_trivial_tiled_mma(DT, DT, MNJ, MNJ, Float32, (1, 1, 1), (64, BV))   # K^T Vd
            mma3.set(warpgroup.Field.ACCUMULATE, True)
            t3 = mma3.get_slice(lt)
            fKt = mma3.make_fragment_A(t3.partition_A(sKt))
            fVd = mma3.make_fragment_B(t3.partition_B(sVdt))
            tCsS = t3.partition_C(sS)
            tab = sTab[0, None]
            sst = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S_SLOTS)
            cst = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, LD_STAGES)
            for t in cutlass.range(t0, ntiles, step, unroll=1):
                vb, h, n, z, b, bos, Tn, more = tile(mQ, mCu, t, H, seg_len, nseg)
                nch = (Tn + C - 1) // C
                cute.arch.barrier(barrier_id=BAR_STATE, number_of_threads=WG)   # the last tile's decays are read
                if lt <= C:
                    tab[lt] = cute.math.exp(Float32(mG[h]) * Float32(lt), fastmath=False)
                if cutlass.const_expr(SEG):
                    # the fused split. First pass (a segment followed by more tokens: all its chunks are whole): the
                    # local state X_z from zero over the segment's K, V, published to mX[z] with a release flag
                    accS = _state_init(t3, mH0, n, h, vb, K, BV, False)
                    for _c in cutlass.range(cutlass.select_(more > 0, nch, 0), unroll=1):
                        _state_step(ld, cst, mma3, accS, fKt, fVd, sV, sVd, lt, Int32(C), tab, DT)
                        cst.advance()
                    if more > 0:
                        _state_store(t3, accS, mX, z, h, vb, K, BV)
                        cute.arch.barrier(barrier_id=BAR_STATE, number_of_threads=WG)
                        if lt == 0:
                            cute.arch.fence_acq_rel_gpu()
                            cute.arch.store((mFlag.iterator + 2 + t).llvm_ptr, Int32(1), sem="release", scope="gpu")
                    # the initial state, S_in(p) = exp(g seg_len) S_in(p - 1) + X_(p-1) from S_in(0) = h0, once every
                    # earlier segment's flag is set (thread j waits for segments j, j + 128, ...; at bv 64 two segments'
                    # X loads are in flight at a time). A segment with no tokens (p > 0) does nothing at all.
                    accS = _state_init(t3, mH0, n, h, vb, K, BV, cfg.has_h0)
                    p = z - n * nseg
                    np_ = cutlass.select_(Tn > 0, p, 0)
                    dseg = cute.math.exp(Float32(mG[h]) * Float32(seg_len), fastmath=False)
                    for j in cutlass.range(lt, np_, WG, unroll=1):
                        fp = (mFlag.iterator + 2 + t + (j - p) * (H * NVB)).llvm_ptr
                        f = cute.arch.load(fp, Int32, sem="acquire", scope="gpu")
                        while f == 0:
                            f = cute.arch.load(fp, Int32, sem="acquire", scope="gpu")
                    cute.arch.barrier(barrier_id=BAR_STATE, number_of_threads=WG)
                    cute.arch.barrier_arrive(barrier_id=BAR_DONE, number_of_threads=WG + 32)   # flag reads done
                    for j in cutlass.range(np_, unroll=2 if BV == 64 else 1):
                        xj = _state_init(t3, mX, z + j - p, h, vb, K, BV, True)
                        accS.store(accS.load() * dseg + xj.load())
                else:
                    accS = _state_init(t3, mH0, n, h, vb, K, BV, cfg.has_h0)
                for c in cutlass.range(nch, unroll=1):
                    L = cutlass.min(Int32(C), Tn - c * C)
                    sp.producer_acquire(sst)
                    rS = cute.make_fragment_like(accS, DT)
                    rS.store(accS.load().to(DT))
                    cute.autovec_copy(rS, tCsS[None, None, None, sst.index])
                    cute.arch.fence_proxy("async.shared", space="cta")   # st.shared -> the output WG's wgmma
                    sp.producer_commit(sst)
                    sst.advance()
                    _state_step(ld, cst, mma3, accS, fKt, fVd, sV, sVd, lt, L, tab, DT)
                    cst.advance()
                if cutlass.const_expr(cfg.has_ht):
                    if cutlass.const_expr(SEG):
                        # the sequence's final state: from its last segment (from segment 0 when it has no tokens)
                        if more == 0 and (Tn > 0 or z == n * nseg):
                            _state_store(t3, accS, mHt, n, h, vb, K, BV)
                    else:
                        _state_store(t3, accS, mHt, n, h, vb, K, BV)

        if wg == 2:
            # output: A = Q K^T, O = Q S_c; P = mask/decay(A); O = exp(g(i+1)) O + P V; o rows < L
            cute.arch.setmaxregister_increase(REGS_MATH)
            mma1 = sm90.make_trivial_tiled_mma(DT, DT, KMJ, KMJ, Float32, (1, 1, 1), (C, C))     # Q K^T
            mma2 = sm90.make_trivial_tiled_mma(DT, DT, KMJ, MNJ, Float32, (1, 1, 1), (C, BV))    # Q S_c
            mmaP = sm90.make_trivial_tiled_mma(DT, DT, KMJ, MNJ, Float32, (1, 1, 1), (C, BV),
                                               sm90.OperandSource.RMEM)                        # P V
            for m in (mma1, mma2, mmaP):
                m.set(warpgroup.Field.ACCUMULATE, True)
            if cutlass.const_expr(cfg.o_pipe):   # the first k-block of Q K^T and Q S_c: from zero
                mma1z = sm90.make_trivial_tiled_mma(DT, DT, KMJ, KMJ, Float32, (1, 1, 1), (C, C))
                mma2z = sm90.make_trivial_tiled_mma(DT, DT, KMJ, MNJ, Float32, (1, 1, 1), (C, BV))
                for m in (mma1z, mma2z):
                    m.set(warpgroup.Field.ACCUMULATE, False)
                mmas = ((mma1z, mma1), (mma2z, mma2))
            t1, t2 = mma1.get_slice(lt), mma2.get_slice(lt)
            fQ1 = mma1.make_fragment_A(t1.partition_A(sQ))
            fK1 = mma1.make_fragment_B(t1.partition_B(sK))
            fQ2 = mma2.make_fragment_A(t2.partition_A(sQ))
            fS = mma2.make_fragment_B(t2.partition_B(sSt))
            fV = mmaP.make_fragment_B(mmaP.get_slice(lt).partition_B(sVt))
            tAc = t1.partition_C(cute.make_identity_tensor((C, C)))
            tOc = t2.partition_C(cute.make_identity_tensor((C, BV)))
            tCsO = t2.partition_C(sO)
            tab = sTab[1, None]
            cst = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, LD_STAGES)
            sst = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S_SLOTS)
            oc = Int32(0)   # o slots used so far (the slot ring runs on across tiles)
            for t in cutlass.range(t0, ntiles, step, unroll=1):
                vb, h, n, z, b, bos, Tn, more = tile(mQ, mCu, t, H, seg_len, nseg)
                nch = (Tn + C - 1) // C
                v0 = vb * BV
                if cutlass.const_expr(SEG):
                    # the fused split's first pass feeds the state warpgroup alone: release its stages unread
                    for _c in cutlass.range(cutlass.select_(more > 0, nch, 0), unroll=1):
                        ld.consumer_wait(cst)
                        ld.consumer_release(cst)
                        cst.advance()
                cute.arch.barrier(barrier_id=BAR_OUT, number_of_threads=WG)   # the last tile's decays are read
                if lt <= C:
                    tab[lt] = cute.math.exp(Float32(mG[h]) * Float32(lt), fastmath=False)
                cute.arch.barrier(barrier_id=BAR_OUT, number_of_threads=WG)
                if cutlass.const_expr(OT):
                    gO = cute.local_tile(cute.domain_offset((bos, 0), gOt[None, None, h, b]), (C, BV), (None, vb))
                    tOs, tOg = cpasync.tma_partition(tmaO, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                                     cute.group_modes(gO, 0, 2))
                if cutlass.const_expr(cfg.o_pipe):
                    # chunk c's Q K^T and Q S_c are issued during chunk c - 1 (into pA, pN); cnx: stage c + 1
                    pA = cute.make_rmem_tensor(t1.partition_shape_C((C, C)), Float32)
                    pN = cute.make_rmem_tensor(t2.partition_shape_C((C, BV)), Float32)
                    pO = cute.make_rmem_tensor(t2.partition_shape_C((C, BV)), Float32)
                    if nch > 0:
                        ld.consumer_wait(cst)
                        sp.consumer_wait(sst)
                        _issue_qk_qs(mmas, pA, fQ1[None, None, None, cst.index], fK1[None, None, None, cst.index],
                                     pN, fQ2[None, None, None, cst.index], fS[None, None, None, sst.index])
                    cnx = cst.clone()
                    cnx.advance()
                for c in cutlass.range(nch, unroll=1):
                    c0 = c * C
                    L = cutlass.min(Int32(C), Tn - c0)
                    st = cst.index
                    if cutlass.const_expr(cfg.o_pipe):
                        warpgroup.wait_group(0)                    # Q K^T, Q S_c
                        sp.consumer_release(sst)
                        sst.advance()
                        _scale_rows_pv(mmaP, pO, pN, _mask_decay(pA, tAc, tab, DT, keep_acc=True), tOc, tab,
                                       fV[None, None, None, st])
                        if c + 1 < nch:
                            ld.consumer_wait(cnx)
                            sp.consumer_wait(sst)
                            _issue_qk_qs(mmas, pA, fQ1[None, None, None, cnx.index], fK1[None, None, None, cnx.index],
                                         pN, fQ2[None, None, None, cnx.index], fS[None, None, None, sst.index])
                            warpgroup.wait_group(1)                # P V of chunk c; chunk c + 1's products run on
                        else:
                            warpgroup.wait_group(0)
                        cnx.advance()
                        accO = pO
                    else:
                        ld.consumer_wait(cst)
                        sp.consumer_wait(sst)
                        accA, accO = _qk_and_qs(mma1, t1, fQ1[None, None, None, st], fK1[None, None, None, st], mma2,
                                                t2, fQ2[None, None, None, st], fS[None, None, None, sst.index], C, BV)
                        sp.consumer_release(sst)
                        sst.advance()
                        _scale_rows_pv(mmaP, accO, accO, _mask_decay(accA, tAc, tab, DT), tOc, tab,
                                       fV[None, None, None, st])
                        warpgroup.wait_group(0)
                    ld.consumer_release(cst)
                    cst.advance()
                    rO = cute.make_fragment_like(accO, DT)
                    rO.store((accO.load() * scale).to(DT))
                    slot = oc % O_SLOTS
                    oc += 1
                    if cutlass.const_expr(OT):
                        if warp == 2 * 4:   # the store warp: the TMA store that last read this slot is done
                            cute.arch.cp_async_bulk_wait_group(O_SLOTS - 1, read=True)
                        cute.arch.barrier(barrier_id=BAR_OUT, number_of_threads=WG)
                    elif cutlass.const_expr(O_SLOTS == 1):
                        cute.arch.barrier(barrier_id=BAR_OUT, number_of_threads=WG)   # the last o rows are read
                    cute.autovec_copy(rO, tCsO[None, None, None, slot])
                    if cutlass.const_expr(OT):
                        cute.arch.fence_proxy("async.shared", space="cta")   # st.shared -> the TMA store
                    cute.arch.barrier(barrier_id=BAR_OUT, number_of_threads=WG)   # the o tile is whole
                    if cutlass.const_expr(OT):
                        # one box per chunk; TMA clips rows past T. A varlen sequence's tail chunk would write into
                        # the next sequence's rows: stored row by row instead
                        if cutlass.const_expr(cfg.varlen):
                            if c0 + C <= Tn:
                                if warp == 2 * 4:
                                    cute.copy(tmaO, tOs[None, slot], tOg[None, c])
                                    cute.arch.cp_async_bulk_commit_group()
                            else:
                                _store_o_rows(sO[None, None, slot], mO, b, bos, c0, L, h, v0, False, lt, WG)
                        else:
                            if warp == 2 * 4:
                                cute.copy(tmaO, tOs[None, slot], tOg[None, c])
                                cute.arch.cp_async_bulk_commit_group()
                    else:
                        _store_o_rows(sO[None, None, slot], mO, b, bos, c0, L, h, v0, False, lt, WG)
            if cutlass.const_expr(OT):
                if warp == 2 * 4:
                    cute.arch.cp_async_bulk_wait_group(0)
        if cutlass.const_expr(MC):
            # neither CTA exits while the other may still arrive on its empty barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def tma_atoms(mQ, mK, mV, mO):
        LQ, LVt, LV, LVdt, LSt, LO = _layouts(cfg)
        op = cpasync.CopyBulkTensorTileG2SOp()
        qk = cpasync.CopyBulkTensorTileG2SMulticastOp() if MC else op
        return (*cpasync.make_tiled_tma_atom(qk, _tok_major(mQ), cute.slice_(LQ, (None, None, 0)), (C, K), CLUSTER),
                *cpasync.make_tiled_tma_atom(qk, _tok_major(mK), cute.slice_(LQ, (None, None, 0)), (C, K), CLUSTER),
                *cpasync.make_tiled_tma_atom(op, _tok_major(mV), cute.slice_(LV, (None, None, 0)), (C, BV)),
                *cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), _tok_major(mO),
                                             cute.slice_(LO, (None, None, 0)), (C, BV)))

    if SEG:
        @cute.jit
        def launch_seg(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
                       mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, mX: cute.Tensor, mFlag: cute.Tensor,
                       scale: Float32, seg_len: Int32, nseg: Int32, stream):
            # one CTA per tile: NVB x H x sequences x segments (the host keeps it <= 2^31 - 1)
            if cutlass.const_expr(cfg.varlen):
                nseq = mCu.shape[0] - 1
            else:
                nseq = mQ.shape[0]
            ntiles = NVB * mQ.shape[2] * nseq * nseg
            kernel(*tma_atoms(mQ, mK, mV, mO), mQ, mG, mH0, mHt, mO, mCu, mX, mFlag, scale, ntiles, seg_len,
                   nseg).launch(grid=[ntiles, 1, 1], block=[NTHR, 1, 1], stream=stream, min_blocks_per_mp=1)

        return launch_seg

    @cute.jit
    def launch(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
               mHt: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, scale: Float32, nsm: Int32, stream):
        if cutlass.const_expr(cfg.varlen):
            nseq = mCu.shape[0] - 1
        else:
            nseq = mQ.shape[0]
        ntiles = NVB * mQ.shape[2] * nseq
        nctas = ntiles
        if cutlass.const_expr(cfg.persistent):
            nctas = cutlass.min(ntiles, nsm)
        k = kernel(*tma_atoms(mQ, mK, mV, mO), mQ, mG, mH0, mHt, mO, mCu, None, None, scale, ntiles, Int32(0), Int32(1))
        if cutlass.const_expr(MC):
            k.launch(grid=[nctas, 1, 1], block=[NTHR, 1, 1], cluster=[CLUSTER, 1, 1], stream=stream,
                     min_blocks_per_mp=1)
        else:
            k.launch(grid=[nctas, 1, 1], block=[NTHR, 1, 1], stream=stream, min_blocks_per_mp=1)

    return launch
