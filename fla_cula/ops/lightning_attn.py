"""Lightning-attention ops with FLA 0.6.0's exact signatures.

Lightning attention is simple GLA with a per-head constant log decay
``g_gamma[h] = -(8 / H * (1 - layer_idx / num_layers)) * h`` (float32):
``S_t = exp(g_gamma[h]) S_{t-1} + k_t v_t^T``,  ``o_t = S_t^T (scale q_t)``.

- chunk_lightning_attn:          no kernel yet -> FLA.
- fused_recurrent_lightning_attn: decode kernel (fla_cula.kernels.lightning_decode) where it applies.
- fused_recurrent_simple_gla:    the same kernel when called with a g_gamma and no per-token gate
                                  (FLA's lightning calls it by module global, so patching it covers
                                  callers that hold FLA's original lightning function).
"""

from __future__ import annotations

import torch
from fla.ops.lightning_attn import chunk as _fla_chunk
from fla.ops.lightning_attn import fused_recurrent as _fla_fr
from fla.ops.simple_gla import fused_recurrent as _fla_sgla_fr

from fla_cula import routing
from fla_cula.ops.kda import _check_varlen, _pop_transpose_state_layout

FLA_CHUNK_LIGHTNING_ATTN = _fla_chunk.chunk_lightning_attn
FLA_FUSED_RECURRENT_LIGHTNING_ATTN = _fla_fr.fused_recurrent_lightning_attn
FLA_FUSED_RECURRENT_SIMPLE_GLA = _fla_sgla_fr.fused_recurrent_simple_gla

_DECODE = routing.LazyKernel("lightning_decode")
_PLANS = routing.plan_cache()
_g_gamma_cache: dict[tuple, torch.Tensor] = {}


def g_gamma_for(H: int, layer_idx: int, num_layers: int, device: torch.device) -> torch.Tensor:
    """FLA's lightning decay, computed as FLA does and cached per (H, layer, device): the cached
    tensor keeps a fixed address, so a captured CUDA graph stays valid."""
    key = (H, layer_idx, num_layers, device)
    t = _g_gamma_cache.get(key)
    if t is None:
        t = -(8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float, device=device)
        _g_gamma_cache[key] = t
    return t


@torch.compiler.disable
def chunk_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's chunk_lightning_attn. No fla_cula kernel yet: always FLA, with the reason."""
    if not routing.in_fallback():
        reason = routing.common_reason(q, k, v, initial_state) or routing.NO_KERNEL_YET
        routing.record_fallback("chunk_lightning_attn", reason)
    return routing.call_fla(FLA_CHUNK_LIGHTNING_ATTN, q, k, v, layer_idx, num_layers, scale, initial_state,
                            output_final_state, cu_seqlens, **kwargs)


def _route_decode(op, key_args, q, k, v, g_gamma_fn, scale, initial_state, output_final_state, reverse,
                  state_v_first, cu_seqlens):
    """Kernel result, or None after recording the fallback reason. `key_args` determine the decision
    (routing.signature): the op's own arguments, from which g_gamma_fn() follows."""
    if scale is None:
        scale = k.shape[-1] ** -0.5

    def decide():
        pre = routing.device_reason(q, k, v, initial_state) or _DECODE.reason()
        if pre:
            return pre, None, None
        post, go = _DECODE.mod.plan(q, k, v, g_gamma_fn(), scale, initial_state, output_final_state, reverse,
                                    state_v_first, cu_seqlens)
        return None, post, go

    go = routing.route(op, _PLANS, (op, scale, *key_args), (q, k, v, initial_state), decide)
    if go is None:
        return None
    return go((q, k, v, g_gamma_fn(), scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens))


@torch.compiler.disable
def fused_recurrent_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused_recurrent_lightning_attn, on the decode kernel when it applies."""
    args = (q, k, v, layer_idx, num_layers, scale, initial_state, output_final_state, reverse, cu_seqlens)
    if routing.in_fallback():
        return routing.call_fla(FLA_FUSED_RECURRENT_LIGHTNING_ATTN, *args)
    _check_varlen(q, initial_state, cu_seqlens, sep=" ")
    res = _route_decode("fused_recurrent_lightning_attn", args, q, k, v,
                        lambda: g_gamma_for(q.shape[2], layer_idx, num_layers, q.device),
                        scale, initial_state, output_final_state, reverse, False, cu_seqlens)
    if res is not None:
        return res
    return routing.call_fla(FLA_FUSED_RECURRENT_LIGHTNING_ATTN, *args)


@torch.compiler.disable
def fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused_recurrent_simple_gla; the lightning decode kernel serves the g_gamma-only case."""
    if routing.in_fallback():
        return routing.call_fla(FLA_FUSED_RECURRENT_SIMPLE_GLA, q, k, v, g, g_gamma, scale, initial_state,
                                output_final_state, reverse, state_v_first, cu_seqlens, **kwargs)
    state_v_first = _pop_transpose_state_layout(kwargs, state_v_first)
    _check_varlen(q, initial_state, cu_seqlens)
    op = "fused_recurrent_simple_gla"
    if g is not None or g_gamma is None:
        reason = "per-token gate g: kernel supports g_gamma only" if g is not None else "no g_gamma: no kernel"
        if not routing.enabled():
            reason = "FLA_CULA=0"
        routing.record_fallback(op, reason)
        res = None
    else:
        key = (q, k, v, g_gamma, initial_state, output_final_state, reverse, state_v_first, cu_seqlens)
        res = _route_decode(op, key, q, k, v, lambda: g_gamma, scale, initial_state, output_final_state, reverse,
                            state_v_first, cu_seqlens)
    if res is not None:
        return res
    return routing.call_fla(FLA_FUSED_RECURRENT_SIMPLE_GLA, q, k, v, g, g_gamma, scale, initial_state,
                            output_final_state, reverse, state_v_first, cu_seqlens, **kwargs)
