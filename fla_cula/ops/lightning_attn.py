"""Lightning-attention ops with FLA 0.6.0's exact signatures.

Lightning attention is simple GLA with a per-head constant log decay
``g_gamma[h] = -(8 / H * (1 - layer_idx / num_layers)) * h`` (float32):
``S_t = exp(g_gamma[h]) S_{t-1} + k_t v_t^T``,  ``o_t = S_t^T (scale q_t)``.

- chunk_lightning_attn:          where the prefill kernel serves the call, our forward and our backward (three
                                  runs of the forward kernel: fla_cula.ops.chunk_autograd); else FLA with the reason.
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
from fla_cula.ops.chunk_autograd import ChunkLightningFunction, LightningChunkConfig, needs_grad
from fla_cula.ops.kda import _check_varlen, _pop_transpose_state_layout

FLA_CHUNK_LIGHTNING_ATTN = _fla_chunk.chunk_lightning_attn
FLA_FUSED_RECURRENT_LIGHTNING_ATTN = _fla_fr.fused_recurrent_lightning_attn
FLA_FUSED_RECURRENT_SIMPLE_GLA = _fla_sgla_fr.fused_recurrent_simple_gla

_g_gamma_cache: dict[tuple, torch.Tensor] = {}


def g_gamma_for(H: int, layer_idx: int, num_layers: int, device: torch.device) -> torch.Tensor:
    """FLA's lightning decay, computed as FLA does and cached per (H, layer, device): the cached
    tensor keeps a fixed address, so a captured CUDA graph stays valid. Made outside inference mode
    (a first call under torch.inference_mode() would cache an inference tensor, which a later
    training call cannot save for backward)."""
    key = (H, layer_idx, num_layers, device)
    t = _g_gamma_cache.get(key)
    if t is None:
        with torch.inference_mode(False):
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
    """FLA's chunk_lightning_attn: FLA's checks, then fla_cula's forward (and backward: chunk_autograd) where
    the kernel serves the call, else FLA with the reason. Like FLA it pops only chunk_size from kwargs."""
    args = (q, k, v, layer_idx, num_layers, scale, initial_state, output_final_state, cu_seqlens)
    if routing.in_fallback():
        return routing.call_fla(FLA_CHUNK_LIGHTNING_ATTN, *args, **kwargs)
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    chunk_size = kwargs.get("chunk_size")
    if not isinstance(q, torch.Tensor) or (chunk_size is not None and (
            not isinstance(chunk_size, int) or chunk_size != 2 ** (chunk_size.bit_length() - 1))):
        routing.record_fallback("chunk_lightning_attn", "arguments FLA checks itself (chunk_size, q)")
        return routing.call_fla(FLA_CHUNK_LIGHTNING_ATTN, *args, **kwargs)
    _check_varlen(q, initial_state, cu_seqlens, sep=" ")
    g_gamma = g_gamma_for(q.shape[2], layer_idx, num_layers, q.device)
    cfg = LightningChunkConfig(scale=float(k.shape[-1] ** -0.5 if scale is None else scale),
                               output_final_state=bool(output_final_state), chunk_size=chunk_size or 64)
    plan_args = (q, k, v, g_gamma, initial_state, cu_seqlens, cfg)
    fwd = routing.route("chunk_lightning_attn", plan_args, (q, k, v, initial_state, cu_seqlens))
    if fwd is None:
        return routing.call_fla(FLA_CHUNK_LIGHTNING_ATTN, *args, **kwargs)
    if needs_grad(q, k, v, initial_state):
        return ChunkLightningFunction.apply(fwd, cfg, cu_seqlens, q, k, v, g_gamma, initial_state)
    o, ht = fwd(q, k, v, g_gamma, initial_state, cu_seqlens, cfg, None)
    return o.to(q.dtype), ht


def _route_decode(op, q, k, v, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first,
                  cu_seqlens):
    """Kernel result, or None after recording the fallback reason."""
    if scale is None:
        scale = k.shape[-1] ** -0.5
    kargs = (q, k, v, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens)
    go = routing.route(op, kargs, (q, k, v, initial_state))
    return None if go is None else go(kargs)


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
    res = _route_decode("fused_recurrent_lightning_attn", q, k, v,
                        g_gamma_for(q.shape[2], layer_idx, num_layers, q.device),
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
        res = _route_decode(op, q, k, v, g_gamma, scale, initial_state, output_final_state, reverse,
                            state_v_first, cu_seqlens)
    if res is not None:
        return res
    return routing.call_fla(FLA_FUSED_RECURRENT_SIMPLE_GLA, q, k, v, g, g_gamma, scale, initial_state,
                            output_final_state, reverse, state_v_first, cu_seqlens, **kwargs)
