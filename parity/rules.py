"""Tolerances and the pass rule (pure functions; unit-tested on the CPU in tests/test_harness.py).

Error measure (FLA's ``get_err_ratio``): rel_rms(ref, x) = RMS(x - ref) / (RMS(ref) + 1e-8), here
always against the fp64 reference, computed in float64.

A tensor passes when BOTH hold:
  1. tolerance: rel_rms(ref, fla_cula) < TOL[name] (FLA's assert_close ratios: 0.005 for outputs
     and states, 0.008 for dq/dk/dv/dh0, 0.02 for dg/dbeta/dA_log/ddt_bias), or
     max|fla_cula - ref| <= 1e-6 (assert_close's err_atol);
  2. relative to FLA: rel_rms(ref, fla_cula) <= RATIO * rel_rms(ref, FLA) + floor(dtype), RATIO = 1.5.
     The floor keeps near-exact cases (FLA's error ~1e-7, e.g. a float32 state) from failing on
     rounding noise: floor = 2e-6 + 0.1 * eps(dtype of the compared tensor) — 2.0e-6 for float32,
     1.0e-4 for float16, 7.8e-4 for bfloat16. Stated in every report header.
When FLA could not run the case (it rejects or mishandles the inputs), only leg 1 applies and the
case is marked "FLA n/a". When FLA itself misses the tolerance on those inputs, leg 1 is replaced
by leg 2 alone and the case is marked "FLA over tol" (the inputs are hard for FLA's algorithm too).
NaN in fla_cula's result always fails.
"""

from __future__ import annotations

import math

import torch

TOL = {
    "o": 0.005,
    "ht": 0.005,
    "pool": 0.005,
    "dq": 0.008,
    "dk": 0.008,
    "dv": 0.008,
    "dh0": 0.008,
    "dg": 0.02,
    "dbeta": 0.02,
    "dA_log": 0.02,
    "ddt_bias": 0.02,
}
RATIO = 1.5
ABS_ATOL = 1e-6
FLOOR_BASE = 2e-6
FLOOR_EPS_FRACTION = 0.1


def floor_for(dtype: torch.dtype) -> float:
    return FLOOR_BASE + FLOOR_EPS_FRACTION * torch.finfo(dtype).eps


def rel_rms(ref: torch.Tensor, x: torch.Tensor) -> float:
    """RMS(x - ref) / (RMS(ref) + 1e-8) in float64; NaN if x has NaN."""
    r = ref.detach().double()
    d = x.detach().double() - r
    err = d.square().mean().sqrt().item() if d.numel() else 0.0
    base = r.square().mean().sqrt().item() if r.numel() else 0.0
    return err / (base + 1e-8)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def judge(name: str, err_cula: float, err_fla: float | None, abs_cula: float, dtype: torch.dtype) -> tuple[bool, str]:
    """Pass/fail of one tensor; returns (ok, note). err_fla None = FLA did not run on these inputs."""
    tol = TOL[name]
    if err_cula is None or math.isnan(err_cula):
        return False, f"{name}: NaN/unwritten in fla_cula"
    tol_ok = err_cula < tol or abs_cula <= ABS_ATOL
    if err_fla is None or math.isnan(err_fla):
        why = "FLA n/a" if err_fla is None else "FLA NaN"
        return tol_ok, ("" if tol_ok else f"{name}: {err_cula:.2e} >= tol {tol}") + f" ({why})"
    bound = RATIO * err_fla + floor_for(dtype)
    rel_ok = err_cula <= bound
    if err_fla >= tol:
        note = f"{name}: FLA over tol ({err_fla:.2e})"
        return rel_ok, note if rel_ok else f"{note}; fla_cula {err_cula:.2e} > {bound:.2e}"
    if not tol_ok:
        return False, f"{name}: {err_cula:.2e} >= tol {tol}"
    if not rel_ok:
        return False, f"{name}: {err_cula:.2e} > {RATIO}x FLA {err_fla:.2e} + floor"
    return True, ""


def rule_text() -> str:
    return (f"pass = rel_rms(fla_cula) < FLA tolerance ({', '.join(f'{k} {v}' for k, v in TOL.items())}; "
            f"or max abs err <= {ABS_ATOL:g}) AND rel_rms(fla_cula) <= {RATIO} x rel_rms(FLA) + floor, "
            f"floor = {FLOOR_BASE:g} + {FLOOR_EPS_FRACTION:g} x eps(dtype) (fp32 {floor_for(torch.float32):.1e}, "
            f"fp16 {floor_for(torch.float16):.1e}, bf16 {floor_for(torch.bfloat16):.1e}); all errors vs the fp64 "
            "reference. FLA over its own tolerance: the 1.5x leg alone decides (flagged).")
