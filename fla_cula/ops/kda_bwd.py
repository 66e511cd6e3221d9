"""chunk_kda's backward: FLA 0.6.0's ``chunk_kda_bwd``, step for step, with fla_cula kernels where one applies.

The steps and their tensors are FLA's (fla/ops/kda/chunk_bwd.py ``chunk_kda_bwd``, cp_context None, no graph
buffers): the recompute of g, w, u, qg, kg, h and v_new; dAqk and dv from do (``chunk_kda_bwd_dAv``); the state pass
backward (``chunk_gated_delta_rule_bwd_dhu``); the chunk-local gradients (``chunk_kda_bwd_wy_dqkg_fused``); the intra
sub-chunk gradients (``chunk_kda_bwd_intra``); the GVA reductions; dg's reverse cumsum and the gate backward.
fla_cula replaces the chunk-local gradients with ``_C.kda_bwd_wy`` (csrc/kda_sm90/kda_bwd_wy_kernel.cuh: the same
math and rounding points; route ``chunk_kda_bwd_wy``) and the intra sub-chunk gradients with ``_C.kda_bwd_intra``
(kda_bwd_intra_kernel.cuh; route ``chunk_kda_bwd_intra``), fuses the two and FLA's l2norm backward where it can
(route ``chunk_kda_bwd_l2norm``) and, with them fused, makes dAqk in that kernel and dv alone as
``_C.kda_bwd_dv`` (kda_bwd_dv_kernel.cuh; route ``chunk_kda_bwd_dv``) in place of ``chunk_kda_bwd_dAv``, and runs
dg's reverse cumsum and the gate backward as ``_C.kda_bwd_gate`` (kda_bwd_gate_kernel.cuh; route
``chunk_kda_bwd_gate``) wherever they apply (docs/kda_bwd_sm90.md); every other step is FLA's function.
"""

from __future__ import annotations

import torch
from fla.modules.norm.l2norm import l2norm_bwd
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
from fla.ops.kda.gate import kda_gate_bwd, kda_gate_chunk_cumsum
from fla.ops.kda.wy_fast import recompute_w_u_fwd
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2

from fla_cula import _ext, routing

OP_WY = "chunk_kda_bwd_wy"
OP_INTRA = "chunk_kda_bwd_intra"
OP_L2NORM = "chunk_kda_bwd_l2norm"
OP_GATE = "chunk_kda_bwd_gate"
OP_DV = "chunk_kda_bwd_dv"
FLA_CHUNK_KDA_BWD_WY = chunk_kda_bwd_wy_dqkg_fused
FLA_CHUNK_KDA_BWD_INTRA = chunk_kda_bwd_intra
# False: FLA's Triton kernels for these steps whatever the inputs. FLA_CULA_STAND_IN=1 turns both off too: the
# stand-in's training path is FLA's backward bit for bit (tests/gpu/test_training_path.py, test_integration_gpu.py).
WY_KERNEL = True
INTRA_KERNEL = True
# kda_bwd_intra's bounded anchors form exp2 factors up to 2^(7.5 shift), shift = -lower_bound / ln 2: within fp32
# (< 2^126) for lower_bound >= -11.5 (csrc/kda_sm90/kda_bwd_intra_block.cuh); below it, the unbounded form
INTRA_MIN_LOWER_BOUND = -11.5
# True: where both kernels apply, the intra step runs inside kda_bwd_wy's kernel (one pass over each chunk: dAkk
# never leaves shared memory; dq, dk, dg are re-read from L2); False: kda_bwd_intra runs after kda_bwd_wy.
FUSED_INTRA = True
# True: with the intra step fused, H == HV and q, k l2-normalized in kernel, FLA's l2norm_bwd of q and k runs in the
# same kernel too (dq, dk leave in bf16 w.r.t. the raw q, k); False: FLA's l2norm_bwd after chunk_kda_bwd's steps.
FUSED_L2NORM = True
# With the intra step fused (whose kernel makes dAqk itself): True: dv alone by _C.kda_bwd_dv; False: FLA's
# chunk_kda_bwd_dAv for dv (its dAqk unused).
DV_KERNEL = True
# False: FLA's chunk_local_cumsum(dg, reverse) and kda_gate_bwd; True: _C.kda_bwd_gate (both in one pass) where the
# gate is computed in kernel (lower_bound sigmoid form, or the softplus form with A_log).
GATE_KERNEL = True


def wy_reason(q, k, v, v_new, g, beta, A, h, do, dh, dv, chunk_size: int) -> str | None:
    """Why kda_bwd_wy cannot take these tensors (None: it can)."""
    ok, why = _ext.available()
    if not ok:
        return why
    r = routing.device_reason(q, k, v, v_new, g, beta, A, h, do, dh, dv)
    if r is not None:
        return r
    if chunk_size != 64:
        return f"chunk_size={chunk_size}: the kernel takes 64"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"K={q.shape[-1]}, V={v.shape[-1]}: the kernel takes K = V = 128"
    bf, f32 = torch.bfloat16, torch.float32
    for name, t, dt in (("q", q, bf), ("k", k, bf), ("v", v, bf), ("v_new", v_new, bf), ("do", do, bf),
                        ("dv", dv, bf), ("A", A, bf), ("h", h, bf), ("dh", dh, bf), ("g", g, f32),
                        ("beta", beta, f32)):
        if t.dtype != dt:
            return f"{name} is {t.dtype}: the kernel takes {dt}"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16 and name != "beta":
            return f"{name} is not 16-byte aligned"
    return None


def bwd_wy(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size, chunk_indices,
           chunk_offsets, intra=False, gate_shift=None, q_rstd=None, k_rstd=None):
    """FLA's chunk_kda_bwd_wy_dqkg_fused (same arguments and results): -> dq, dk, dv, db, dg, dA. With intra (and
    gate_shift: intra_shift's) where our kernel runs: chunk_kda_bwd_intra fused in (its dAqk, chunk_kda_bwd_dAv's, made
    from do and v_new in the kernel), dq, dk, db, dg final and dA None; with q_rstd, k_rstd too (H == HV): FLA's
    l2norm_bwd fused as well, dq, dk then bf16 w.r.t. the raw q, k. Where FLA's kernel runs instead, dA is Akk's
    gradient whatever intra says."""
    use = WY_KERNEL and routing.enabled() and not routing.stand_in()
    reason = wy_reason(q, k, v, v_new, g, beta, A, h, do, dh, dv, chunk_size) if use else None
    if not use or reason is not None:
        if reason is not None:
            routing.record_fallback(OP_WY, reason)
        return FLA_CHUNK_KDA_BWD_WY(q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv,
                                    scale=scale, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                    chunk_size=chunk_size, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    B, T, HV, K = *v.shape[:3], q.shape[-1]
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    dq = g.new_empty(B, T, HV, K, dtype=torch.float)
    dk = g.new_empty(B, T, HV, K, dtype=torch.float)
    dv2 = torch.empty_like(v)
    dg = torch.empty_like(g, dtype=torch.float)
    db = torch.empty_like(beta, dtype=torch.float)
    dA = None if intra else torch.empty_like(A, dtype=torch.float)
    l2 = intra and q_rstd is not None
    dqx, dkx = (torch.empty_like(q), torch.empty_like(k)) if l2 else (None, None)
    _ext.require().kda_bwd_wy(q, k, v, v_new, g, beta, A, h, do, dh, dv, dq, dk, dv2, dg, db, dA,
                              K ** -0.5 if scale is None else scale, state_v_first, cu_seqlens, chunk_indices,
                              intra, gate_shift if intra else None, q_rstd if l2 else None,
                              k_rstd if l2 else None, dqx, dkx)
    routing.record_kernel(OP_WY)
    if intra:
        routing.record_kernel(OP_INTRA)
    if l2:
        routing.record_kernel(OP_L2NORM)
        return dqx, dkx, dv2, db, dg, dA
    return dq, dk, dv2, db, dg, dA


def dv_reason(Aqk, do, chunk_size: int) -> str | None:
    """Why kda_bwd_dv cannot take these tensors (None: it can)."""
    ok, why = _ext.available()
    if not ok:
        return why
    r = routing.device_reason(Aqk, do)
    if r is not None:
        return r
    if chunk_size != 64:
        return f"chunk_size={chunk_size}: the kernel takes 64"
    if do.shape[-1] != 128 or Aqk.shape != (*do.shape[:3], 64):
        return (f"do of shape {tuple(do.shape)}, Aqk {tuple(Aqk.shape)}: the kernel takes [B, T, HV, 128], "
                "[B, T, HV, 64]")
    for name, t in (("Aqk", Aqk), ("do", do)):
        if t.dtype != torch.bfloat16:
            return f"{name} is {t.dtype}: the kernel takes torch.bfloat16"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return None


def bwd_dv(q, k, v_new, do, Aqk, scale, cu_seqlens, chunk_indices, chunk_size):
    """The dv of FLA's chunk_kda_bwd_dAv (dv = M(Aqk)^T do per chunk), for the fused form whose kernel makes dAqk:
    ours where it applies, else FLA's function (its dAqk unused)."""
    reason = dv_reason(Aqk, do, chunk_size) if DV_KERNEL else None
    if not DV_KERNEL or reason is not None:
        if reason is not None:
            routing.record_fallback(OP_DV, reason)
        return chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu_seqlens,
                                 chunk_size=chunk_size, chunk_indices=chunk_indices)[1]
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    dv = torch.empty_like(do)
    _ext.require().kda_bwd_dv(Aqk, do, dv, cu_seqlens, chunk_indices)
    routing.record_kernel(OP_DV)
    return dv


def intra_shift(lower_bound, safe_gate: bool, gate_in_kernel: bool) -> float | None:
    """kda_bwd_intra's gate_shift, -lower_bound / ln 2, where every per-token step of g lies in [lower_bound, 0] and
    the bounded form's anchors fit fp32; None: its unbounded form (per-channel anchors, wide channels pairwise; in
    kda_bwd_intra and in kda_bwd_wy's fused form). FLA's in-kernel gate with lower_bound is lower_bound * sigmoid(.)
    by construction; a precomputed gate has the bound only as safe_gate's promise."""
    if (lower_bound is None or not INTRA_MIN_LOWER_BOUND <= lower_bound < 0
            or not (safe_gate or gate_in_kernel)):
        return None
    return -lower_bound * RCP_LN2


def intra_reason(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size: int) -> str | None:
    """Why kda_bwd_intra cannot take these tensors (None: it can; dAkk, dq, dk, db, dg may be None: the fused form,
    where kda_bwd_wy's kernel makes them)."""
    ok, why = _ext.available()
    if not ok:
        return why
    r = routing.device_reason(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg)
    if r is not None:
        return r
    if chunk_size != 64:
        return f"chunk_size={chunk_size}: the kernel takes 64"
    if q.shape[-1] != 128:
        return f"K={q.shape[-1]}: the kernel takes K = 128"
    for name, t, dt in (("q", q, torch.bfloat16), ("k", k, torch.bfloat16), ("g", g, torch.float32),
                        ("beta", beta, torch.float32), ("dAqk", dAqk, torch.float32), ("dAkk", dAkk, torch.float32),
                        ("dq", dq, torch.float32), ("dk", dk, torch.float32), ("db", db, torch.float32),
                        ("dg", dg, torch.float32)):
        if t is None:
            continue
        if t.dtype != dt:
            return f"{name} is {t.dtype}: the kernel takes {dt}"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16 and name not in ("beta", "db"):
            return f"{name} is not 16-byte aligned"
    return None


def bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens, chunk_indices, chunk_size, safe_gate,
              lower_bound, gate_in_kernel=False):
    """FLA's chunk_kda_bwd_intra (same arguments and results): -> dq, dk, db, dg."""
    use = INTRA_KERNEL and routing.enabled() and not routing.stand_in()
    reason = intra_reason(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size) if use else None
    if not use or reason is not None:
        if reason is not None:
            routing.record_fallback(OP_INTRA, reason)
        return FLA_CHUNK_KDA_BWD_INTRA(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg,
                                       cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=chunk_size,
                                       safe_gate=safe_gate)
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    dq2, dk2, dg2, db2 = torch.empty_like(dq), torch.empty_like(dk), torch.empty_like(dg), torch.empty_like(db)
    _ext.require().kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, dg, db, dq2, dk2, dg2, db2,
                                 intra_shift(lower_bound, safe_gate, gate_in_kernel), cu_seqlens, chunk_indices)
    routing.record_kernel(OP_INTRA)
    return dq2, dk2, db2, dg2


def gate_reason(dg, g_org, A_log, dt_bias, lower_bound, chunk_size: int) -> str | None:
    """Why kda_bwd_gate cannot take these tensors (None: it can)."""
    ok, why = _ext.available()
    if not ok:
        return why
    r = routing.device_reason(*(t for t in (dg, g_org, A_log, dt_bias) if t is not None))
    if r is not None:
        return r
    if lower_bound is None and A_log is None:
        return "the softplus gate (lower_bound None) without A_log: the kernel's softplus form takes A_log"
    if lower_bound is not None and not lower_bound < 0:
        return f"lower_bound={lower_bound}: the kernel takes lower_bound < 0 or None (the softplus gate)"
    if chunk_size != 64:
        return f"chunk_size={chunk_size}: the kernel takes 64"
    if g_org.shape[-1] != 128 or g_org.shape != dg.shape:
        return f"g of shape {tuple(g_org.shape)}, dg {tuple(dg.shape)}: the kernel takes both [B, T, HV, 128]"
    for name, t, dts in (("dg", dg, (torch.float32,)), ("g", g_org, (torch.bfloat16, torch.float32)),
                         ("A_log", A_log, (torch.float32, torch.bfloat16)),
                         ("dt_bias", dt_bias, (torch.float32, torch.bfloat16))):
        if t is None:
            continue
        if t.dtype not in dts:
            return f"{name} is {t.dtype}: the kernel takes {' or '.join(str(d) for d in dts)}"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
    return None


def bwd_gate(dg, g_org, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, chunk_size):
    """FLA's chunk_local_cumsum(dg, reverse) then kda_gate_bwd: -> the gradients of g_org, A_log, dt_bias."""
    use = GATE_KERNEL and routing.enabled() and not routing.stand_in()
    if use:  # the kernel reads them contiguous (no copy where they already are)
        g_org, A_log, dt_bias = (None if t is None else t.contiguous() for t in (g_org, A_log, dt_bias))
    reason = gate_reason(dg, g_org, A_log, dt_bias, lower_bound, chunk_size) if use else None
    if not use or reason is not None:
        if reason is not None:
            routing.record_fallback(OP_GATE, reason)
        dyg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, cu_seqlens=cu_seqlens,
                                 chunk_indices=chunk_indices)
        return kda_gate_bwd(g=g_org, A_log=A_log, dt_bias=dt_bias, dyg=dyg, lower_bound=lower_bound)
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    B, T, HV, K = dg.shape
    chunks = B * ((T + chunk_size - 1) // chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    dg_raw = torch.empty_like(g_org)
    dA_part = dg.new_empty(chunks, HV) if A_log is not None else None
    dbias_part = dg.new_empty(chunks, HV * K) if dt_bias is not None else None
    _ext.require().kda_bwd_gate(dg, g_org, A_log, dt_bias, lower_bound, dg_raw, dA_part, dbias_part, cu_seqlens,
                                chunk_indices)
    routing.record_kernel(OP_GATE)
    # FLA's kda_gate_bwd adds its blocks' partial sums the same way
    dA = dA_part.sum(0).view_as(A_log).type_as(A_log) if A_log is not None else None
    dbias = dbias_part.sum(0).to(dt_bias) if dt_bias is not None else None
    return dg_raw, dA, dbias


def chunk_kda_bwd(q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g=None, g_org=None, state_v_first=False,
                  cu_seqlens=None, chunk_indices=None, chunk_size=64, safe_gate=False, lower_bound=None,
                  use_gate_in_kernel=False, A_log=None, dt_bias=None, disable_recompute=False, chunk_offsets=None,
                  w=None, u=None, qg=None, kg=None, v_new=None, h=None, q_rstd=None, k_rstd=None):
    """FLA 0.6.0's chunk_kda_bwd (cp_context None, use_graph False): -> dq, dk, dv, db, dg, dh0, dA, dbias. With
    q_rstd, k_rstd (q, k l2-normalized in kernel; FLA's autograd applies l2norm_bwd after this function): dq, dk
    come back w.r.t. the raw q, k, FLA's l2norm_bwd applied here (fused into our kernel where it can be)."""
    H, HV = q.shape[2], v.shape[2]
    if not disable_recompute:
        if use_gate_in_kernel:
            g = kda_gate_chunk_cumsum(g=g_org, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=chunk_size,
                                      cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, lower_bound=lower_bound)
        w, u, qg, kg = recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g, cu_seqlens=cu_seqlens,
                                         chunk_indices=chunk_indices)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=initial_state,
                                                   output_final_state=False, cu_seqlens=cu_seqlens,
                                                   chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                                                   chunk_size=chunk_size, state_v_first=state_v_first)
    # the intra step fused into kda_bwd_wy's kernel, which makes dAqk itself: dv alone here
    fuse = (FUSED_INTRA and INTRA_KERNEL and routing.enabled() and not routing.stand_in()
            and intra_reason(q, k, g, beta, None, None, None, None, None, None, chunk_size) is None)
    if fuse:
        dAqk, dv = None, bwd_dv(q, k, v_new, do, Aqk, scale, cu_seqlens, chunk_indices, chunk_size)
    else:
        dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu_seqlens,
                                     chunk_size=chunk_size, chunk_indices=chunk_indices)
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, gk=g, h0=initial_state, dht=dht, do=do, dv=dv,
                                                 scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                                 chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                                                 state_v_first=state_v_first)
    l2 = fuse and FUSED_L2NORM and q_rstd is not None and HV == H
    dq, dk, dv, db, dg, dAkk = bwd_wy(q, k, v, v_new, g, beta, Akk, h, do, dh, dv, scale, state_v_first, cu_seqlens,
                                      chunk_size, chunk_indices, chunk_offsets, intra=fuse,
                                      gate_shift=intra_shift(lower_bound, safe_gate, use_gate_in_kernel),
                                      q_rstd=q_rstd if l2 else None,
                                      k_rstd=k_rstd if l2 else None)
    if dAkk is not None:  # not fused (or FLA's wy ran): the intra step on its own
        if dAqk is None:  # fused form planned, FLA's wy ran: dAqk from FLA's function
            dAqk = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu_seqlens,
                                     chunk_size=chunk_size, chunk_indices=chunk_indices)[0]
        dq, dk, db, dg = bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens, chunk_indices, chunk_size,
                                   safe_gate, lower_bound, use_gate_in_kernel)
    if HV > H:  # GVA: dq, dk back from value heads to heads
        dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(dim=3)
        dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
    if q_rstd is not None and not (l2 and dAkk is None):  # the l2norm backward not fused: FLA's
        dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
    if use_gate_in_kernel:
        dg, dA, dbias = bwd_gate(dg, g_org, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, chunk_size)
        return dq, dk, dv, db, dg, dh0, dA, dbias
    dg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, cu_seqlens=cu_seqlens,
                            chunk_indices=chunk_indices)
    return dq, dk, dv, db, dg, dh0, None, None
