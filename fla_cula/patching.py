"""patch() / unpatch(): make FLA's own entry points (and every FLA layer and model) reach fla_cula.

Two mechanisms, both undone exactly by unpatch():
1. Name swap. Every module in the ``fla`` package that binds one of FLA's original functions
   (``fla.ops.kda.chunk.chunk_kda``, ``fla.ops.kda.chunk_kda``, ``fla.ops.chunk_kda``,
   ``fla.layers.kda.chunk_kda``, ... found by identity, so no binder is missed) gets the
   fla_cula function instead. Module globals matter too: FLA's ``fused_recurrent_kda`` looks up
   ``fused_recurrent_kda_fwd`` at call time, FLA's lightning looks up ``fused_recurrent_simple_gla``,
   ``ShortConvolution.step`` looks up ``causal_conv1d_update`` (the short convolutions' decode step).
2. FLA's backend dispatch (``fla.backends``): a backend is registered for the dispatched
   ``chunk_kda``, the ``kda`` operation (``fused_recurrent_kda_fwd``) and
   ``fused_recurrent_simple_gla``, so code that captured FLA's function object before patch()
   still reaches fla_cula. Its verifier declines while fla_cula itself is running FLA as a fallback.

FLA modules imported after patch() bind fla_cula's functions through the swapped package
attributes (``from fla.ops.kda import chunk_kda``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Iterator

from fla_cula import routing

_lock = threading.RLock()
_swapped: list[tuple[object, str, object]] = []  # (module, attribute, original)
_registered: list[tuple[object, str, object | None]] = []  # (registry, backend_type, previous)
_patched = False

# modules that define or re-export the names (imported so their bindings exist before the scan)
_MODULES = (
    "fla.ops.kda.chunk", "fla.ops.kda.fused_recurrent", "fla.ops.kda",
    "fla.ops.lightning_attn.chunk", "fla.ops.lightning_attn.fused_recurrent", "fla.ops.lightning_attn",
    "fla.ops.simple_gla.fused_recurrent", "fla.ops.simple_gla", "fla.ops",
    "fla.modules.causal_conv1d.ops", "fla.modules.causal_conv1d",
)
_OPTIONAL_MODULES = ("fla.layers.kda", "fla.layers")  # flash-linear-attention (not in fla-core)

BACKEND_TYPE = "fla_cula"


def _replacements() -> dict[int, tuple[object, object]]:
    """id(FLA original) -> (original, fla_cula replacement)."""
    from fla_cula.ops import conv, kda, lightning_attn
    pairs = [
        (conv.FLA_CAUSAL_CONV1D_UPDATE, conv.causal_conv1d_update),
        (kda.FLA_CHUNK_KDA, kda.chunk_kda),
        (kda.FLA_FUSED_RECURRENT_KDA, kda.fused_recurrent_kda),
        (kda.FLA_FUSED_RECURRENT_KDA_FWD, kda.fused_recurrent_kda_fwd),
        (lightning_attn.FLA_CHUNK_LIGHTNING_ATTN, lightning_attn.chunk_lightning_attn),
        (lightning_attn.FLA_FUSED_RECURRENT_LIGHTNING_ATTN, lightning_attn.fused_recurrent_lightning_attn),
        (lightning_attn.FLA_FUSED_RECURRENT_SIMPLE_GLA, lightning_attn.fused_recurrent_simple_gla),
    ]
    return {id(orig): (orig, new) for orig, new in pairs}


def _import_targets() -> None:
    for name in _MODULES:
        importlib.import_module(name)
    for name in _OPTIONAL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # fla-core alone: no fla.layers


def _fla_modules():
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "fla" or name.startswith("fla.")):
            yield mod


def _make_backends():
    from fla.backends import BaseBackend

    from fla_cula.ops import kda, lightning_attn

    def verifier(*args, **kwargs):
        if routing.in_fallback():
            return False, "fla_cula is running FLA as its fallback"
        return True, None

    class FlaCulaBackend(BaseBackend):
        """fla_cula as an FLA backend: it always accepts and routes (with its own reasons) itself."""
        backend_type = BACKEND_TYPE
        package_name = None
        env_var = None
        priority = 1  # before FlashKDA (3); fla_cula's fallback re-enters dispatch without it

        chunk_kda_verifier = staticmethod(verifier)
        fused_recurrent_kda_fwd_verifier = staticmethod(verifier)
        fused_recurrent_simple_gla_verifier = staticmethod(verifier)
        chunk_kda = staticmethod(kda.chunk_kda)
        fused_recurrent_kda_fwd = staticmethod(kda.fused_recurrent_kda_fwd)
        fused_recurrent_simple_gla = staticmethod(lightning_attn.fused_recurrent_simple_gla)

    return FlaCulaBackend


def _register_backends() -> None:
    from inspect import unwrap

    import fla.backends as fb

    from fla_cula.ops import kda, lightning_attn

    if getattr(fb, "_DISPATCH_DISABLED", False):
        return  # FLA_DISABLE_BACKEND_DISPATCH=1: FLA bypasses every backend; the name swap still applies
    backend = _make_backends()()
    registries = [fb._get_operation_registry("kda")]
    for fn in (kda.FLA_CHUNK_KDA, lightning_attn.FLA_FUSED_RECURRENT_SIMPLE_GLA):
        reg = fb._function_registries.get(unwrap(fn))
        if reg is not None:
            registries.append(reg)
    for reg in registries:
        previous = reg._backends.get(BACKEND_TYPE)
        reg.register(backend)
        _registered.append((reg, BACKEND_TYPE, previous))


def patch() -> None:
    """Route FLA's entry points through fla_cula. Idempotent and thread-safe."""
    global _patched
    with _lock:
        if _patched:
            return
        _import_targets()
        repl = _replacements()
        for mod in _fla_modules():
            for attr, value in list(vars(mod).items()):
                hit = repl.get(id(value))
                if hit is not None and hit[0] is value:
                    setattr(mod, attr, hit[1])
                    _swapped.append((mod, attr, value))
        _register_backends()
        _patched = True
        routing.logger.info("fla_cula: patched %d FLA bindings", len(_swapped))


def unpatch() -> None:
    """Restore exactly what patch() replaced. Idempotent and thread-safe."""
    global _patched
    with _lock:
        if not _patched:
            return
        for mod, attr, original in reversed(_swapped):
            setattr(mod, attr, original)
        _swapped.clear()
        for reg, backend_type, previous in reversed(_registered):
            if previous is None:
                reg._backends.pop(backend_type, None)
            else:
                reg._backends[backend_type] = previous
        _registered.clear()
        _patched = False


def is_patched() -> bool:
    return _patched


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Patch for the duration of a with-block; leaves an earlier patch() in place on exit."""
    with _lock:
        was = _patched
        patch()
    try:
        yield
    finally:
        if not was:
            unpatch()


def swapped_bindings() -> list[tuple[str, str]]:
    """(module name, attribute) of every swapped binding (for `python -m fla_cula info` and tests)."""
    return [(m.__name__, a) for m, a, _ in _swapped]
