"""fp64 reference for simple GLA with a constant per-head decay, and lightning attention on top.

Layouts (FLA's): q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g_gamma ``[H]`` (log decay per head);
state ``[N, H, K, V]`` (state_v_first: ``[N, H, V, K]``); cu_seqlens ``[N + 1]`` with B == 1.

Math, per sequence and head, S in R^{K x V}, S_0 = initial state (zeros if none):
  S_t = exp(g_gamma_h) S_{t-1} + k_t v_t^T
  o_t = S_t^T (scale * q_t)                     scale defaults to K ** -0.5
With reverse=True the tokens of each sequence are visited last to first (the initial state
enters at the last token; the final state is the one after the first token).

Lightning attention is this with ``g_gamma = lightning_g_gamma(H, layer_idx, num_layers)``.
Everything is computed in float64 and returned as float64; inputs are never modified.
"""

from __future__ import annotations

import torch

from .kda import _check_cu_seqlens, _check_state, _from_kv, _to_kv

__all__ = ["lightning_g_gamma", "lightning_recurrent", "simple_gla_recurrent"]

_F64 = torch.float64


def lightning_g_gamma(
    H: int, layer_idx: int, num_layers: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Lightning attention's per-head log decay, float32 ``[H]``, bit for bit as FLA computes it:
    ``-(8 / H * (1 - layer_idx / num_layers)) * arange(H, dtype=float32)``."""
    return -(8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float32, device=device)


def _gla_scan(q, k, v, decay, S, reverse: bool):
    """q, k: [N, T, H, K]; v: [N, T, H, V]; decay = exp(g_gamma): [H]; S: [N, H, K, V] (not modified)."""
    N, T, H, V = v.shape
    K = q.shape[-1]
    M = N * H

    def time_major(x):  # [N, T, H, D] -> contiguous [T, N*H, D]
        return x.transpose(0, 1).reshape(T, M, x.shape[-1]).contiguous()

    q, k, v = map(time_major, (q, k, v))
    d = decay.repeat(N).view(M, 1, 1)
    S = S.reshape(M, K, V).clone()
    o = v.new_empty(T, M, V)
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        S.mul_(d).baddbmm_(k[t].unsqueeze(-1), v[t].unsqueeze(1))   # S = exp(g) S + k_t v_t^T
        o[t] = torch.bmm(q[t].unsqueeze(1), S).squeeze(1)           # o_t = S^T (scale q_t)
    o = o.reshape(T, N, H, V).transpose(0, 1).contiguous()
    return o, S.reshape(N, H, K, V)


def simple_gla_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp64 reference of ``fused_recurrent_simple_gla(q, k, v, g_gamma=g_gamma, ...)`` (forward).

    Returns ``(o [B, T, H, V], final_state [N, H, K, V] (or [N, H, V, K]) or None)``, float64.
    """
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {list(q.shape)} and {list(k.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, V], got {list(v.shape)}")
    V = v.shape[3]
    if g_gamma.numel() != H:
        raise ValueError(f"g_gamma must have H={H} elements, got {g_gamma.numel()}")
    if scale is None:
        scale = K ** -0.5
    cu = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, B, T)
    N = B if cu is None else len(cu) - 1
    if initial_state is not None:
        _check_state(initial_state, N, H, K, V, state_v_first, "initial_state")
        S0 = _to_kv(initial_state, state_v_first)
    else:
        S0 = q.new_zeros(N, H, K, V, dtype=_F64)

    qd, kd, vd = q.to(_F64) * float(scale), k.to(_F64), v.to(_F64)
    decay = torch.exp(g_gamma.to(device=q.device, dtype=_F64).reshape(H))
    if cu is None:
        o, S = _gla_scan(qd, kd, vd, decay, S0, reverse)
    else:
        o = vd.new_zeros(1, T, H, V)
        finals = []
        for n in range(N):
            s = slice(cu[n], cu[n + 1])
            o_n, S_n = _gla_scan(qd[:, s], kd[:, s], vd[:, s], decay, S0[n:n + 1], reverse)
            o[:, s] = o_n
            finals.append(S_n)
        S = torch.cat(finals, 0)
    return o, (_from_kv(S, state_v_first) if output_final_state else None)


def lightning_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp64 reference of ``fused_recurrent_lightning_attn`` / ``chunk_lightning_attn`` (forward).

    ``simple_gla_recurrent`` with ``g_gamma = lightning_g_gamma(H, layer_idx, num_layers)`` (the
    float32 values FLA uses, then widened). State layout is always K-first, as in FLA.
    """
    g_gamma = lightning_g_gamma(q.shape[2], layer_idx, num_layers, device=q.device)
    return simple_gla_recurrent(q, k, v, g_gamma, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens)
