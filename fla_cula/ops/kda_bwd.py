"""chunk_kda's backward: FLA 0.6.0's ``chunk_kda_bwd``, step for step, with fla_cula kernels where one applies.

The steps and their tensors are FLA's (fla/ops/kda/chunk_bwd.py ``chunk_kda_bwd``, cp_context None, no graph
buffers): the recompute of g, w, u, qg, kg, h and v_new; dAqk and dv from do (``chunk_kda_bwd_dAv``); the state pass
backward (``chunk_gated_delta_rule_bwd_dhu``); the chunk-local gradients (``chunk_kda_bwd_wy_dqkg_fused``); the intra
sub-chunk gradients (``chunk_kda_bwd_intra``); the GVA reductions; dg's reverse cumsum and the gate backward.
fla_cula replaces the chunk-local gradients with ``_C.kda_bwd_wy`` (csrc/kda_sm90/kda_bwd_wy_kernel.cuh: the same
math and rounding points; docs/kda_bwd_sm90.md) wherever it applies, route ``chunk_kda_bwd_wy`` in
``fla_cula.status()``; every other step is FLA's function.
"""

from __future__ import annotations

import torch
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
from fla.ops.kda.gate import kda_gate_bwd, kda_gate_chunk_cumsum
from fla.ops.kda.wy_fast import recompute_w_u_fwd
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2

from fla_cula import _ext, routing

OP_WY = "chunk_kda_bwd_wy"
FLA_CHUNK_KDA_BWD_WY = chunk_kda_bwd_wy_dqkg_fused
# False: FLA's Triton kernel for the chunk-local gradients whatever the inputs. FLA_CULA_STAND_IN=1 turns it off too:
# the stand-in's training path is FLA's backward bit for bit (tests/gpu/test_training_path.py, test_integration_gpu.py).
WY_KERNEL = True


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
           chunk_offsets):
    """FLA's chunk_kda_bwd_wy_dqkg_fused (same arguments and results): -> dq, dk, dv, db, dg, dA."""
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
    dA = torch.empty_like(A, dtype=torch.float)
    _ext.require().kda_bwd_wy(q, k, v, v_new, g, beta, A, h, do, dh, dv, dq, dk, dv2, dg, db, dA,
                              K ** -0.5 if scale is None else scale, state_v_first, cu_seqlens, chunk_indices)
    routing.record_kernel(OP_WY)
    return dq, dk, dv2, db, dg, dA


def chunk_kda_bwd(q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g=None, g_org=None, state_v_first=False,
                  cu_seqlens=None, chunk_indices=None, chunk_size=64, safe_gate=False, lower_bound=None,
                  use_gate_in_kernel=False, A_log=None, dt_bias=None, disable_recompute=False, chunk_offsets=None,
                  w=None, u=None, qg=None, kg=None, v_new=None, h=None):
    """FLA 0.6.0's chunk_kda_bwd (cp_context None, use_graph False): -> dq, dk, dv, db, dg, dh0, dA, dbias."""
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
    dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu_seqlens,
                                 chunk_size=chunk_size, chunk_indices=chunk_indices)
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, gk=g, h0=initial_state, dht=dht, do=do, dv=dv,
                                                 scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                                 chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                                                 state_v_first=state_v_first)
    dq, dk, dv, db, dg, dAkk = bwd_wy(q, k, v, v_new, g, beta, Akk, h, do, dh, dv, scale, state_v_first, cu_seqlens,
                                      chunk_size, chunk_indices, chunk_offsets)
    dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg,
                                         cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=chunk_size,
                                         safe_gate=safe_gate)
    if HV > H:  # GVA: dq, dk back from value heads to heads
        dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(dim=3)
        dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
    dA, dbias = None, None
    dg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, cu_seqlens=cu_seqlens,
                            chunk_indices=chunk_indices)
    if use_gate_in_kernel:
        dg, dA, dbias = kda_gate_bwd(g=g_org, A_log=A_log, dt_bias=dt_bias, dyg=dg, lower_bound=lower_bound)
    return dq, dk, dv, db, dg, dh0, dA, dbias
