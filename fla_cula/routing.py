"""Routing: every public op decides kernel or FLA, and says why.

``route(op, ...)`` is the one decision point: the op (``fla_cula.ops``) hands over its arguments,
routing finds the op's kernel in ``fla_cula.kernels.registry``, asks the kernel's plan function
whether it serves the call, applies the op's grad policy, counts the call and returns the plan that
runs it (or None: the op then calls FLA). A reason string names why a call goes to FLA ("no CUDA
device", "head dim 64: kernel supports 128", ...). Each distinct (op, reason) is logged once on the
``fla_cula`` logger; :func:`status` counts every call.

Environment toggles are read at call time (cheap ``os.environ`` lookups):
  FLA_CULA=0           every call goes to FLA, even when patched.
  FLA_CULA_STRICT=1    a fallback raises :class:`FallbackError` with its reason instead.
  FLA_CULA_STAND_IN=1  a chunk op runs FLA's forward inside fla_cula's autograd Function in place of its
                       kernel (counted as ``stand_in``): the training path's plumbing, bit-identical to FLA.
  FLA_CULA_FORCE=1     the kernels also take the calls their speed heuristics send to FLA (small grids, the
                       KDA cost model and grad gate): coverage runs such as FLA's own tests on small shapes.
                       Calls a kernel cannot run correctly still fall back.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from fla_cula.kernels import registry

logger = logging.getLogger("fla_cula")

KERNEL = "kernel"
STAND_IN = "stand_in"
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


def force() -> bool:
    """FLA_CULA_FORCE=1: kernels skip their speed-only fallbacks (see the module docstring)."""
    return _getenv("FLA_CULA_FORCE", "0") not in ("0", "")


def strict() -> bool:
    return _getenv("FLA_CULA_STRICT", "0") not in ("0", "")


def stand_in() -> bool:
    return _getenv("FLA_CULA_STAND_IN", "0") not in ("0", "")


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


def record_kernel(op: str, route: str = KERNEL) -> None:
    """Count a call served by fla_cula: route "kernel", or "stand_in" (FLA's forward in our Function)."""
    _record(op, route)


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
    """Per op: ``{"kernel": n, "fallback": {reason: n}, "calls": n}``, plus ``"stand_in": n`` for
    chunk-op calls that ran FLA's forward inside fla_cula's autograd Function, and ``"grad"``: the op's
    grad policy (``fla_cula.kernels.registry``) for ops fla_cula serves."""
    out: dict[str, dict[str, Any]] = {}
    with _lock:
        for op, routes in sorted(_counts.items()):
            fb = {r[len("fallback: "):]: n for r, n in routes.items() if r.startswith("fallback: ")}
            kern, si = routes.get(KERNEL, 0), routes.get(STAND_IN, 0)
            out[op] = {"kernel": kern, "fallback": fb, "calls": kern + si + sum(fb.values())}
            if si:
                out[op]["stand_in"] = si
            if op in registry.OPS:
                out[op]["grad"] = registry.GRAD_POLICY_TEXT[registry.OPS[op].grad]
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


# ---------------------------------------------------------------------------------------------
# decisions memoized per call signature (the eager call path: a decode step's host work is ~all
# argument checks and bookkeeping, so a repeated call shape must not redo them)
MAX_PLANS = 4096
_memo: dict[str, dict] = defaultdict(dict)  # op -> signature -> (reason before grad, reason after, plan)


def clear_plans() -> None:
    """Forget every memoized decision (kernel tuning changed, tests)."""
    for d in list(_memo.values()):
        d.clear()


def memo_size(op: str) -> int:
    return len(_memo.get(op, ()))


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


def size_free_signature(args, runtime_dims) -> tuple:
    """A signature without runtime sizes, for ops whose lengths change on every call (prefill): per
    tensor its dtype, device, rank, the dims after the first ``runtime_dims[i]`` (head counts and head
    dims), whether it is contiguous and its address modulo 16; other arguments as they are. A plan
    decided on this key must not depend on the sizes left out (B, T, N, the varlen layout): the
    per-call size_reason() covers what does."""
    out = []
    for x, lead in zip(args, runtime_dims, strict=True):
        if isinstance(x, torch.Tensor):
            out.append((x.dtype, x.device, x.dim(), tuple(x.shape[lead or 0:]), x.is_contiguous(),
                        x.data_ptr() & 15))
        else:
            out.append(x)
    return tuple(out)


I31 = 2 ** 31


def size_reason(tensors) -> str | None:
    """The size checks every size-free plan needs per call: 32-bit element offsets."""
    for t in tensors:
        if t is not None and t.numel() >= I31:
            return f"a tensor of shape {tuple(t.shape)} has >= 2^31 elements: kernels index with int32"
    return None


def _decide(spec, plan_args: tuple, tensors: tuple) -> tuple:
    """(reason before the grad check, reason after it, (plan, route label)) for one signature."""
    pre = device_reason(*tensors)
    if pre:
        return pre, None, None
    name = spec.kernel
    if spec.stand_in is not None and stand_in():  # FLA_CULA_STAND_IN=1: FLA's forward in place of the kernel
        name = spec.stand_in
    elif name is None:
        return NO_KERNEL_YET, None, None
    fn, why = registry.plan_function(name)
    if fn is None:
        return why, None, None
    post, plan = fn(*plan_args)
    return None, post, (plan, registry.KERNELS[name].route)




def route(op: str, plan_args: tuple, tensors: tuple, key_args=None, validate: Callable[..., None] | None = None):
    """The plan that runs this call on fla_cula, or None after recording why it goes to FLA.

    op:         a name in ``fla_cula.kernels.registry.OPS`` (its kernel, stand-in, grad policy, key form)
    plan_args:  what the kernel's plan function takes; the plan returned runs every call whose
                arguments have the same signature
    tensors:    the call's tensors (device checks; requires_grad for forward-only ops); the first is
                the one whose device the kernel runs on
    key_args:   what the memo key is read from (default plan_args)
    validate:   validate(*plan_args) raises for arguments that no implementation may run (ours or
                FLA's: out-of-bounds memory); run once per signature before it is memoized, so a failing call raises
                every time and a passing one costs nothing on later calls

    The memo key is signature(key_args), or size_free_signature() for ops with runtime dims. Read
    on every call, in this order: FLA_CULA, the memoized device/import reason, the grad policy,
    the memoized kernel checks, the per-call size checks (size-free ops)."""
    if not enabled():
        if validate is not None:
            validate(*plan_args)
        record_fallback(op, "FLA_CULA=0")
        return None
    spec = registry.OPS[op]
    ka = plan_args if key_args is None else key_args
    sized = spec.runtime_dims is not None
    cache = _memo[op]
    try:
        key = (spec.stand_in is not None and stand_in(), size_free_signature(ka, spec.runtime_dims)) if sized \
            else signature(ka)
        ent = cache.get(key)
    except TypeError:  # an unhashable argument: decide without memo (its check names it)
        key = ent = None
    if ent is None:
        if validate is not None:
            validate(*plan_args)
        ent = _decide(spec, plan_args, tensors)
        if key is not None:
            if len(cache) >= MAX_PLANS:
                cache.clear()
            cache[key] = ent
    pre, post, chosen = ent
    reason = pre or (grad_reason(tensors) if spec.grad == registry.FORWARD_ONLY else None) or post
    if reason is None and sized:
        check = getattr(chosen[0], "size_reason", None)  # a plan's own per-call size checks
        reason = size_reason(tensors) or (check(*plan_args) if check is not None else None)
    if reason is None:
        record_kernel(op, chosen[1])
        return chosen[0]
    record_fallback(op, reason)
    return None
