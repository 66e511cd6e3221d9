"""One tuning registry for the decode kernels: per kernel, the knobs applied over every config the
host wrappers build, and the compiled callables in front of fla_cula.jit's cache.

A kernel module registers its config class and how a config becomes a KernelSpec, then exposes
`set_tuning(**knobs)` / `get_kernel(cfg)` as thin functions over `TUNING`. The knobs are empty in
production (the config defaults are the measured choice); tests and `python -m benchmarks.variants`
set candidates to compare them in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class _Kernel:
    config_cls: type
    spec_of: Callable[[Any], Any]   # config -> KernelSpec
    knobs: dict = dataclasses.field(default_factory=dict)
    compiled: dict = dataclasses.field(default_factory=dict)   # config (knobs applied) -> callable


class Tuning:
    """Kernel name -> config class, knobs and compiled callables."""

    def __init__(self) -> None:
        self._kernels: dict[str, _Kernel] = {}

    def add(self, name: str, config_cls: type, spec_of: Callable[[Any], Any]) -> None:
        """Register a kernel (once per module import; a re-import replaces the entry)."""
        self._kernels[name] = _Kernel(config_cls, spec_of)

    def _kernel(self, name: str) -> _Kernel:
        ent = self._kernels.get(name)
        if ent is None:
            raise KeyError(f"no tuned kernel {name!r}; registered: {sorted(self._kernels)}")
        return ent

    def set(self, name: str, **knobs) -> None:
        """Replace a kernel's knobs (no knobs: back to the defaults) and forget the memoized plans,
        which hold the compiled kernel they chose."""
        from fla_cula import routing

        ent = self._kernel(name)
        bad = set(knobs) - {f.name for f in dataclasses.fields(ent.config_cls)}
        if bad:
            raise ValueError(f"unknown {ent.config_cls.__name__} fields {sorted(bad)}")
        ent.knobs.clear()
        ent.knobs.update(knobs)
        routing.clear_plans()

    def knobs(self, name: str) -> dict:
        return dict(self._kernel(name).knobs)

    def get(self, name: str, cfg):
        """The compiled TVM-FFI callable for `cfg` with the kernel's knobs applied."""
        from fla_cula.jit import get_compiled

        ent = self._kernel(name)
        if ent.knobs:
            cfg = dataclasses.replace(cfg, **ent.knobs)
        fn = ent.compiled.get(cfg)
        if fn is None:
            fn = ent.compiled[cfg] = get_compiled(ent.spec_of(cfg))
        return fn

    def compiled_configs(self, name: str) -> list:
        """The configs (knobs applied) this process has compiled or loaded for a kernel."""
        return list(self._kernel(name).compiled)


TUNING = Tuning()
