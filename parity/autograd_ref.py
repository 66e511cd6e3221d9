"""Differentiable fp64 recurrences: parity's gradient oracle.

``fla_cula.reference`` updates its state in place (fast, but torch autograd cannot differentiate
through it), so gradients come from these out-of-place twins. Their forward is checked against
``fla_cula.reference`` on every grad case (it must agree to 1e-10) and their autograd against
finite differences in ``python -m parity --cpu`` (``torch.autograd.gradcheck``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64


def _segments(cu_seqlens, B: int, T: int) -> list[tuple[int, slice]]:
    if cu_seqlens is None:
        return [(b, slice(0, T)) for b in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, slice(cu[n], cu[n + 1])) for n in range(len(cu) - 1)]


def kda(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
        lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens):
    """Same math and arguments as ``fla_cula.reference.kda_recurrent`` (output_final_state=True)."""
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    if use_gate_in_kernel:
        x = g + dt_bias.to(F64).reshape(HV, K) if dt_bias is not None else g
        A = A_log.to(F64).reshape(HV, 1) if A_log is not None else None
        if lower_bound is None:
            g = -torch.exp(A) * F.softplus(x)
        else:
            g = lower_bound * torch.sigmoid(torch.exp(A) * x if A is not None else x)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    q = q.repeat_interleave(G, dim=2) * scale
    k = k.repeat_interleave(G, dim=2)
    segs = _segments(cu_seqlens, B, T)
    o_rows, finals = [], []
    for n, (b, s) in enumerate(segs):
        if initial_state is not None:
            S = initial_state[n].to(F64)
            S = S.transpose(-1, -2) if state_v_first else S
        else:
            S = q.new_zeros(HV, K, V)
        outs = []
        for t in range(s.start, s.stop):
            S = S * torch.exp(g[b, t]).unsqueeze(-1)
            kt = k[b, t]
            u = beta[b, t].unsqueeze(-1) * (v[b, t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("hk,hkv->hv", q[b, t], S))
        o_rows.append(torch.stack(outs, 0) if outs else v.new_zeros(0, HV, V))
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    o = torch.cat(o_rows, 0).view(1, T, HV, V) if cu_seqlens is not None else torch.stack(o_rows, 0)
    return o, torch.stack(finals, 0)


def lightning(q, k, v, layer_idx, num_layers, *, scale, initial_state, reverse, cu_seqlens):
    """Same math and arguments as ``fla_cula.reference.lightning_recurrent`` (output_final_state=True)."""
    q, k, v = (x.to(F64) for x in (q, k, v))
    B, T, H, K = q.shape
    V = v.shape[-1]
    g_gamma = -(8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float32, device=q.device)
    decay = torch.exp(g_gamma.to(F64)).view(H, 1, 1)
    q = q * scale
    o_rows, finals = [], []
    for n, (b, s) in enumerate(_segments(cu_seqlens, B, T)):
        S = initial_state[n].to(F64) if initial_state is not None else q.new_zeros(H, K, V)
        ts = list(range(s.start, s.stop))
        outs = {}
        for t in reversed(ts) if reverse else ts:
            S = decay * S + k[b, t].unsqueeze(-1) * v[b, t].unsqueeze(-2)
            outs[t] = torch.einsum("hk,hkv->hv", q[b, t], S)
        o_rows.append(torch.stack([outs[t] for t in ts], 0) if ts else v.new_zeros(0, H, V))
        finals.append(S)
    o = torch.cat(o_rows, 0).view(1, T, H, V) if cu_seqlens is not None else torch.stack(o_rows, 0)
    return o, torch.stack(finals, 0)
