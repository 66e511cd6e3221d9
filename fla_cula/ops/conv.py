"""FLA's short-convolution decode step with FLA 0.6.0's exact signature.

``causal_conv1d_update`` is what ``fla.modules.ShortConvolution.step`` calls for one token per sequence without
autograd (every KDA, GDN, ... layer's decode step runs three of them: the q, k and v convolutions): the conv kernel
(fla_cula.kernels.conv_update) where it applies, else FLA with the reason.
"""

from __future__ import annotations

import torch
from fla.modules.causal_conv1d import ops as _fla_conv

from fla_cula import routing

FLA_CAUSAL_CONV1D_UPDATE = _fla_conv.causal_conv1d_update

# The kernel's GPU tests (tests/gpu/test_conv_update.py: fp64 and FLA bars, in-place state, fallbacks) passed on the
# H200 in session 21 (docs/runs/2026-12-05b_tests_two.log); False would send every call to FLA with UNVERIFIED.
KERNEL_VERIFIED = True
UNVERIFIED = "the conv kernel has not run on the H200 yet (its GPU tests are pending; FLA_CULA_FORCE=1 runs it)"
# Below MIN_KERNEL_SEQS sequences FLA's kernel is faster (H200, KDA model decode graphs, session 21, 12 calls of
# D = 2048: B=1 18.7 us FLA vs 28.5 us ours; B=32 41.5 vs 30.7; B=128 120.8 vs 43.2). A straight line through these
# puts the crossover near 12 sequences. FLA_CULA_FORCE=1 runs the kernel there too.
MIN_KERNEL_SEQS = 16
FEW_SEQS = f"fewer than {MIN_KERNEL_SEQS} sequences: FLA's kernel is faster there (H200, session 21)"


def validate(x, cache, residual, weight, bias, activation) -> None:
    """Shapes FLA's kernel indexes without checking (x [.., D] of N tokens, cache [N, D, W], weight [D, W],
    bias [D], residual of N D elements): a mismatch would read or write out of bounds in any implementation."""
    if weight is None or cache is None or not isinstance(weight, torch.Tensor) or not isinstance(cache, torch.Tensor):
        return  # FLA's kernel runs without them (no window / no convolution); fla_cula falls back
    if weight.ndim != 2:
        raise ValueError(f"causal_conv1d_update: weight shape {tuple(weight.shape)}: expected [D, W]")
    D, W = weight.shape
    if x.ndim < 2 or (x.shape[-1] != D and x.ndim < 3):
        raise ValueError(f"causal_conv1d_update: x shape {tuple(x.shape)}: expected [N, D], [N, 1, D] or [1, N, D] "
                         f"with D = {D} (the weight's channels)")
    N = x.numel() // D
    if x.numel() != N * D:
        raise ValueError(f"causal_conv1d_update: x shape {tuple(x.shape)}: its elements are not a multiple of D = {D}")
    if tuple(cache.shape) != (N, D, W):
        raise ValueError(f"causal_conv1d_update: cache shape {tuple(cache.shape)}: expected [{N}, {D}, {W}] "
                         f"(sequences, channels, kernel width)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.numel() != D):
        raise ValueError(f"causal_conv1d_update: bias shape {tuple(getattr(bias, 'shape', ()))}: expected [{D}]")
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.numel() != N * D):
        raise ValueError(f"causal_conv1d_update: residual shape {tuple(getattr(residual, 'shape', ()))}: expected "
                         f"{N * D} elements ([N, D] as x)")


@torch.compiler.disable
def causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's causal_conv1d_update: y for the new token (a new tensor of x's shape) and the cache, updated in place."""
    args = (x, cache, residual, weight, bias, activation)
    if routing.in_fallback():
        return routing.call_fla(FLA_CAUSAL_CONV1D_UPDATE, *args)
    if not isinstance(x, torch.Tensor):
        routing.record_fallback("causal_conv1d_update", f"x is {type(x).__name__}, not a tensor")
        return routing.call_fla(FLA_CAUSAL_CONV1D_UPDATE, *args)
    if not KERNEL_VERIFIED and routing.enabled() and not routing.force():
        validate(*args)
        routing.record_fallback("causal_conv1d_update", UNVERIFIED)
        return routing.call_fla(FLA_CAUSAL_CONV1D_UPDATE, *args)
    if (isinstance(weight, torch.Tensor) and weight.ndim == 2 and routing.enabled() and not routing.force()
            and x.numel() < MIN_KERNEL_SEQS * weight.shape[0] and routing.device_reason(x) is None):
        validate(*args)
        routing.record_fallback("causal_conv1d_update", FEW_SEQS)
        return routing.call_fla(FLA_CAUSAL_CONV1D_UPDATE, *args)
    go = routing.route("causal_conv1d_update", args, (x, cache, residual, weight, bias), validate=validate)
    if go is None:
        return routing.call_fla(FLA_CAUSAL_CONV1D_UPDATE, *args)
    return go(args)
