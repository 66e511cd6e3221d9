"""Routing: every public op decides kernel or FLA, and says why.

A decision is a reason string: ``None`` means "run our kernel", anything else names why the call
goes to FLA ("no CUDA device", "head dim 64: kernel supports 128", ...). Each distinct
(op, reason) is logged once on the ``fla_cula`` logger; :func:`status` counts every call.

Environment toggles are read at call time (cheap ``os.environ`` lookups):
  FLA_CULA=0         every call goes to FLA, even when patched.
  FLA_CULA_STRICT=1  a fallback raises :class:`FallbackError` with its reason instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("fla_cula")

KERNEL = "kernel"
NO_KERNEL_YET = "no kernel for this op yet"


class FallbackError(RuntimeError):
    """Raised instead of falling back to FLA when FLA_CULA_STRICT=1."""


# os.environ.get on an unset name costs ~1.5 us (a KeyError raised and caught inside the Mapping);
# os.environ keeps its encoded copy in `_data`, updated by every os.environ assignment (monkeypatch,
# putenv through os.environ): a dict lookup there reads the same value at call time.
_ENV = getattr(os.environ, "_data", None)


def _getenv(name: str, default: str) -> str:
    if _ENV is None:  # pragma: no cover - not CPython on POSIX
        return os.environ.get(name, default)
    x = _ENV.get(os.environ.encodekey(name))
    return default if x is None else os.environ.decodevalue(x)


def enabled() -> bool:
    return _getenv("FLA_CULA", "1") != "0"


def strict() -> bool:
    return _getenv("FLA_CULA_STRICT", "0") not in ("0", "")


# ---------------------------------------------------------------------------------------------
# accounting
_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_logged: set[tuple[str, str]] = set()
_tls = threading.local()


def _record(op: str, route: str) -> None:
    with _lock:
        _counts[op][route] += 1
    _tls.last = (op, route)


def record_kernel(op: str) -> None:
    _record(op, KERNEL)


def record_fallback(op: str, reason: str) -> None:
    """Count a fallback, log its reason once, or raise in strict mode."""
    if strict():
        raise FallbackError(f"fla_cula.{op}: would fall back to FLA: {reason} (FLA_CULA_STRICT=1)")
    key = (op, reason)
    if key not in _logged:
        _logged.add(key)
        logger.info("fla_cula.%s -> FLA: %s", op, reason)
    _record(op, "fallback: " + reason)


def status() -> dict[str, dict[str, Any]]:
    """Per op: ``{"kernel": n, "fallback": {reason: n}, "calls": n}``."""
    out: dict[str, dict[str, Any]] = {}
    with _lock:
        for op, routes in sorted(_counts.items()):
            fb = {r[len("fallback: "):]: n for r, n in routes.items() if r.startswith("fallback: ")}
            kern = routes.get(KERNEL, 0)
            out[op] = {"kernel": kern, "fallback": fb, "calls": kern + sum(fb.values())}
    return out


def reset_status() -> None:
    with _lock:
        _counts.clear()
    _logged.clear()


def last_route() -> tuple[str, str] | None:
    """(op, route) of the most recent call on this thread; route is "kernel" or "fallback: why"."""
    return getattr(_tls, "last", None)


# ---------------------------------------------------------------------------------------------
# re-entrancy: while we run FLA's own implementation as a fallback, FLA may call back into names
# we patched (fused_recurrent_kda -> fused_recurrent_kda_fwd, dispatch -> our backend). Those
# inner calls must go straight to FLA without being counted twice.
def in_fallback() -> bool:
    return getattr(_tls, "fallback_depth", 0) > 0


def call_fla(fn: Callable, *args, **kwargs):
    _tls.fallback_depth = getattr(_tls, "fallback_depth", 0) + 1
    try:
        return fn(*args, **kwargs)
    finally:
        _tls.fallback_depth -= 1


# ---------------------------------------------------------------------------------------------
# device checks shared by every kernel
_cc_cache: dict[int, str | None] = {}


def _device_reason(index: int) -> str | None:
    reason = _cc_cache.get(index, "?")
    if reason == "?":
        major, minor = torch.cuda.get_device_capability(index)
        reason = None if (major, minor) == (9, 0) else f"compute capability {major}.{minor}: kernels need SM90"
        if reason is None:
            from fla_cula.jit import dsl_available_reason
            reason = dsl_available_reason()
        _cc_cache[index] = reason
    return reason


def device_reason(x: torch.Tensor, *tensors: torch.Tensor | None) -> str | None:
    """Checks every kernel shares that depend on where the tensors live: CUDA, SM90, one device."""
    if x.device.type != "cuda":
        return "no CUDA device" if not torch.cuda.is_available() else f"tensors on {x.device.type}, not CUDA"
    reason = _device_reason(x.device.index)
    if reason is not None:
        return reason
    dev = x.device
    for t in tensors:
        if t is not None and t.device != dev:
            return f"tensors on different devices ({dev} and {t.device})"
    return None


def grad_reason(tensors) -> str | None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "grad enabled: forward-only kernel"
    return None


def common_reason(x: torch.Tensor, *tensors: torch.Tensor | None) -> str | None:
    """Checks every kernel shares: env toggle, CUDA device, SM90, one device, grad mode."""
    if not enabled():
        return "FLA_CULA=0"
    return device_reason(x, *tensors) or grad_reason((x, *tensors))


# ---------------------------------------------------------------------------------------------
# decisions memoized per call signature (the eager call path: a decode step's host work is ~all
# argument checks and bookkeeping, so a repeated call shape must not redo them)
MAX_PLANS = 4096
_plan_caches: list[dict] = []


def plan_cache() -> dict:
    """A memo for one op: signature -> (reason before the grad check, reason after it, plan)."""
    d: dict = {}
    _plan_caches.append(d)
    return d


def clear_plans() -> None:
    """Forget every memoized decision (kernel tuning changed, tests)."""
    for d in _plan_caches:
        d.clear()


def _tensor_signature(x: torch.Tensor) -> tuple:
    return (x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15)


def signature_py(args) -> tuple:
    """signature() in Python (five attribute calls per tensor)."""
    return tuple([_tensor_signature(x) if isinstance(x, torch.Tensor) else x for x in args])


def _native_signature():
    """fla_cula._C.call_signature bound to torch's DLPack C exchange API, or None (no extension, an
    older build, or a torch without the API): then signature() stays in Python."""
    from fla_cula import _ext
    mod, _ = _ext._load()
    fn = getattr(mod, "call_signature", None)
    if fn is None or mod.init_call_signature(torch.Tensor):
        return None
    return fn


_native = None
_native_loaded = False


def signature(args) -> tuple:
    """Everything a kernel's host checks read from a call's arguments: per tensor its dtype, shape,
    strides, device and address modulo 16; any other argument as it is. The checks read nothing
    else (no tensor values: no host sync), so equal signatures get equal decisions; requires_grad
    is left out and checked per call (grad_reason). Read in C++ when the extension has it (~1 us
    instead of ~11 for a KDA call on the H200's host); one process keeps to one representation."""
    global _native, _native_loaded
    if not _native_loaded:
        _native, _native_loaded = _native_signature(), True
    if _native is not None:
        return _native(args, _tensor_signature)
    return signature_py(args)


def route(op: str, cache: dict, key_args, grad_tensors, decide: Callable[[], tuple]):
    """The plan to run our kernel with, or None after recording why the call goes to FLA.

    decide() -> (pre, post, plan) runs once per distinct signature of `key_args`: `pre` a reason
    that precedes the grad check (device, kernel import), `post` one that follows it (the kernel's
    argument checks), `plan` what runs the call when both are None."""
    if not enabled():
        reason, plan = "FLA_CULA=0", None
    else:
        try:
            key = signature(key_args)
            ent = cache.get(key)
        except TypeError:  # an unhashable argument: decide without memo (its check names it)
            key = ent = None
        if ent is None:
            ent = decide()
            if key is not None:
                if len(cache) >= MAX_PLANS:
                    cache.clear()
                cache[key] = ent
        pre, post, plan = ent
        reason = pre or grad_reason(grad_tensors) or post
    if reason is None:
        record_kernel(op)
        return plan
    record_fallback(op, reason)
    return None


class LazyKernel:
    """A kernel module (fla_cula.kernels.<name>) imported on first use: it imports CuTe DSL, which a
    call that already fell back for a device reason never needs. An import failure is a reason too."""

    def __init__(self, name: str):
        self.name = name
        self.mod = None
        self._failed: str | None = None

    def reason(self) -> str | None:
        if self.mod is None and self._failed is None:
            try:
                self.mod = importlib.import_module(f"fla_cula.kernels.{self.name}")
            except Exception as e:  # noqa: BLE001 - reported as the fallback reason
                self._failed = f"{self.name} kernel unavailable ({type(e).__name__}: {e})"
        return self._failed
