"""Error metrics used to compare an implementation with a reference.

Both helpers compute in float64 whatever the input dtypes are.
"""

from __future__ import annotations

import torch


def rel_rms(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Relative error ``||x - ref||_2 / ||ref||_2`` in float64.

    Returns ``0.0`` when both are exactly equal (including both all-zero), ``inf`` when ``ref`` is
    all-zero and ``x`` is not, and ``nan`` when either holds a NaN.
    """
    if ref.shape != x.shape:
        raise ValueError(f"rel_rms: shapes differ, ref {tuple(ref.shape)} vs x {tuple(x.shape)}")
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    d = x.detach().to(device="cpu", dtype=torch.float64) - r
    num = torch.linalg.vector_norm(d).item()
    den = torch.linalg.vector_norm(r).item()
    if num == 0.0:
        return 0.0
    return num / den if den > 0.0 else float("inf")


def fla_close(ref: torch.Tensor, x: torch.Tensor, ratio: float, err_atol: float = 1e-6) -> bool:
    """FLA's ``fla.utils.assert_close`` acceptance rule, as a predicate.

    Passes when ``max|x - ref| <= err_atol`` (1e-6); otherwise neither tensor may hold a NaN and
    ``RMS(x - ref) / (RMS(ref) + 1e-8) < ratio``. (FLA's CI-only warning mode, which softens
    failures into warnings, is deliberately not reproduced.)
    """
    if ref.shape != x.shape:
        raise ValueError(f"fla_close: shapes differ, ref {tuple(ref.shape)} vs x {tuple(x.shape)}")
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    y = x.detach().to(device="cpu", dtype=torch.float64)
    if r.numel() == 0:
        return True
    d = (y - r).flatten()
    max_abs = d.abs().max().item()
    if max_abs <= err_atol:  # False for NaN
        return True
    if torch.isnan(r).any() or torch.isnan(y).any():
        return False
    err = d.square().mean().sqrt().item()
    base = r.flatten().square().mean().sqrt().item()
    return err / (base + 1e-8) < ratio
