"""Host wrapper: FLA's `fused_recurrent_simple_gla` with a per-head `g_gamma` (lightning attention)
on the CuTe DSL recurrent decode kernel (mode='lightning').

`check(...)` returns a short reason when the call must stay on FLA; `run(...)` allocates the
outputs FLA allocates (o in q.dtype, the final state when asked) and launches on the current stream.
"""

import math

import torch

from fla_cula.kernels._host import FLOAT, I31, INT, KV, aligned, launch, qk_reason, seqs_reason, state_reason
from fla_cula.kernels.recurrent_decode import DecodeConfig, choose_bv, get_kernel


def check(q, k, v, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first,
          cu_seqlens) -> str | None:
    if reverse:
        return "reverse=True: kernel is forward-in-time only"
    r = qk_reason((("q", q), ("k", k), ("v", v)))
    if r:
        return r
    B, T, H, K = q.shape
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        return f"v shape {tuple(v.shape)}: expected [{B}, {T}, {H}, V]"
    if v.shape[3] != KV:
        return f"value dim {v.shape[3]}: kernel supports 128"
    dev = q.device
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device != dev:
            return f"{name} on {x.device}, q on {dev}"
        if not x.is_contiguous():
            return f"{name} not contiguous"
        if x.numel() >= I31:
            return f"{name} has >= 2^31 elements"
        if not aligned(x):
            return f"{name} not 16-byte aligned"
    if not isinstance(g_gamma, torch.Tensor) or g_gamma.dtype != torch.float32:
        return "g_gamma: expected a float32 tensor"
    if g_gamma.ndim != 1 or g_gamma.shape[0] != H or not g_gamma.is_contiguous() \
            or g_gamma.device != dev:
        return f"g_gamma shape {tuple(g_gamma.shape)}: expected contiguous [{H}] on {dev}"
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        return f"scale {scale!r}: expected a finite float"
    r, N = seqs_reason(cu_seqlens, B, dev)
    if r:
        return r
    if initial_state is not None:
        r = state_reason(initial_state, N, H, K, KV, state_v_first, q, "initial_state")
        if r:
            return r
        if initial_state.shape[0] != N or (N > 1 and initial_state.stride(0) != H * K * KV):
            return (f"initial_state batch {initial_state.shape[0]}: expected {N} contiguous states")
    return None


def plan(q, k, v, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first,
         cu_seqlens):
    """check(), then the compiled kernel and output shapes for this signature: (reason, None), or
    (None, go) where go(args) runs any call whose arguments have the same signature."""
    r = check(q, k, v, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens)
    if r:
        return r, None
    has_ht = bool(output_final_state)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    multi = q.shape[1] > (N if cu_seqlens is not None else 1)
    cfg = DecodeConfig(
        mode="lightning", state_v_first=bool(state_v_first), qk_dtype=FLOAT[q.dtype],
        v_dtype=FLOAT[v.dtype], g_dtype="float32", beta_dtype="float32",
        o_dtype=FLOAT[q.dtype], has_h0=initial_state is not None, has_ht=has_ht,
        varlen=cu_seqlens is not None,
        cu_dtype=INT[cu_seqlens.dtype] if cu_seqlens is not None else "int32",
        bv=choose_bv(bool(state_v_first), multi, N * q.shape[2]))
    fn = get_kernel(cfg)
    dev, o_dtype, o_shape = q.device, q.dtype, v.shape
    ht_shape = (N, q.shape[2], KV, KV)
    scale = float(scale)

    def go(args):
        """args: (q, k, v, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first,
        cu_seqlens), as check takes them."""
        q, k, v, g_gamma = args[:4]
        o = torch.empty(o_shape, dtype=o_dtype, device=dev)
        ht = torch.empty(ht_shape, dtype=torch.float32, device=dev) if has_ht else None
        launch(fn, dev, q, k, v, g_gamma, None, None, None, args[5], ht, o, args[9], None, None, scale, 0.0)
        return o, ht

    return None, go


def run(*args):
    """FLA's fused_recurrent_simple_gla(g_gamma=...) forward (the arguments of check); returns
    (o, final_state). The op layer memoizes plan() per signature; this form serves tests and tools."""
    r, go = plan(*args)
    if r:
        raise ValueError(f"lightning_decode: {r}")
    return go(args)
