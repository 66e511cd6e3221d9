"""CuTe DSL compile infrastructure: a compile cache in process and on disk, and a kernel registry.

Every CuTe DSL kernel is compiled once per *specialization* (the static config: head dims,
dtypes, flags, target arch). Batch and sequence sizes are symbolic in the compiled function, so
a new batch size never recompiles. The compiled function is exported as an object file (TVM-FFI
entry point: torch tensors go in directly and the launch uses the caller's current stream) and
cached on disk, keyed by the specialization, the target arch, the DSL version and a fingerprint
of fla_cula's kernel sources. A file lock per key serializes compiles across processes, writes
are atomic (temp file + rename) and an entry that fails to load is recompiled.

Environment:
  FLA_CULA_CACHE_DIR   cache root (default: $XDG_CACHE_HOME/fla_cula or ~/.cache/fla_cula)
  FLA_CULA_NO_DISK_CACHE=1   keep compiles in process only
  CUTE_DSL_ARCH        target arch (default sm_90a on a machine without a GPU)
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("fla_cula")

TARGET_ARCH = "sm_90a"
_PKG_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def dsl_available_reason() -> str | None:
    """None when CuTe DSL and TVM-FFI import; otherwise why kernels cannot run."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        return f"CuTe DSL unavailable ({type(e).__name__}: {e})"
    try:
        import tvm_ffi  # noqa: F401
    except Exception as e:  # pragma: no cover
        return f"apache-tvm-ffi unavailable ({type(e).__name__}: {e})"
    return None


@functools.cache
def dsl_version() -> str:
    """nvidia-cutlass-dsl version plus its CUDA library variant (cu12 / cu13 wheels ship different
    runtime libraries that a cached object links against), e.g. "4.8.1-cu13"."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:  # pragma: no cover
        return "unknown"
    libs = []
    for cu in ("cu12", "cu13"):
        try:
            version(f"nvidia-cutlass-dsl-libs-{cu}")
            libs.append(cu)
        except PackageNotFoundError:
            pass
    return "-".join([v, *libs])


@functools.cache
def source_fingerprint() -> str:
    """Hash of every kernel source file: editing a kernel invalidates its disk cache entries."""
    h = hashlib.sha256()
    for sub in ("kernels", "jit"):
        for p in sorted((_PKG_ROOT / sub).rglob("*.py")):
            h.update(p.relative_to(_PKG_ROOT).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("FLA_CULA_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "fla_cula"


def ensure_target_arch() -> str:
    """CuTe DSL picks sm_100a without a GPU; pin sm_90a (our only target) before compiling."""
    os.environ.setdefault("CUTE_DSL_ARCH", TARGET_ARCH)
    return os.environ["CUTE_DSL_ARCH"]


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelSpec:
    """A registered kernel specialization.

    name:      kernel module name ("kda_decode", ...)
    key:       the static specialization as sorted (field, value) pairs - no sizes
    build:     () -> (jit_function, example_args): fake tensors / symbolic sizes to compile with
    expect_ptx: regular expressions the PTX must match (the instructions the kernel is meant to use)
    """

    name: str
    key: tuple[tuple[str, Any], ...]
    build: Callable[[], tuple[Callable, tuple]] = field(compare=False, hash=False)
    expect_ptx: tuple[str, ...] = field(default=(), compare=False, hash=False)

    def digest(self) -> str:
        text = repr((self.name, self.key, ensure_target_arch(), dsl_version(), source_fingerprint()))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


_registry: dict[str, list[Callable[[], list[KernelSpec]]]] = {}


def register_kernel(name: str):
    """Register a function listing the specializations CI must compile for sm_90a."""
    def deco(fn: Callable[[], list[KernelSpec]]):
        _registry.setdefault(name, []).append(fn)
        return fn
    return deco


def registered_specs(strict: bool = True) -> list[KernelSpec]:
    """Every CuTe DSL specialization of every kernel in fla_cula.kernels.registry (their modules register
    them on import). strict: a CuTe DSL kernel module that fails to import raises (CI must see it);
    C++ kernels' modules (the extension may not be built) and stand-ins are not required here."""
    from fla_cula.kernels import registry
    for name, why in registry.import_all().items():
        if why is not None and strict and registry.KERNELS[name].lang == "CuTe DSL":
            raise ImportError(why)
    return [s for fns in _registry.values() for fn in fns for s in fn()]


# ---------------------------------------------------------------------------------------------
_mem: dict[KernelSpec, Callable] = {}
_mem_lock = threading.Lock()
stats = {"compiled": 0, "disk_hits": 0, "mem_hits": 0, "corrupt": 0}


def compile_spec(spec: KernelSpec, *, keep_ptx_dir: str | None = None):
    """Compile a spec with cute.compile (TVM-FFI enabled). Returns the compiled function object."""
    ensure_target_arch()
    import cutlass.cute as cute

    fn, args = spec.build()
    opts = f"--enable-tvm-ffi --gpu-arch {ensure_target_arch()}"
    if keep_ptx_dir is not None:
        opts += f" --keep-ptx --keep-cubin --dump-dir {keep_ptx_dir}"
    stats["compiled"] += 1
    return cute.compile(fn, *args, options=opts)


def _load_object(path: Path, symbol: str):
    import cutlass.runtime as rt
    return getattr(rt.load_module(str(path), enable_tvm_ffi=True), symbol)


def get_compiled(spec: KernelSpec) -> Callable:
    """The callable for a spec: process cache, then disk cache, then compile (and store)."""
    fn = _mem.get(spec)
    if fn is not None:
        stats["mem_hits"] += 1
        return fn
    with _mem_lock:
        fn = _mem.get(spec)
        if fn is None:
            fn = _get_from_disk_or_compile(spec)
            _mem[spec] = fn
    return fn


def _get_from_disk_or_compile(spec: KernelSpec) -> Callable:
    digest = spec.digest()
    symbol = f"fla_cula_{spec.name}_{digest}"
    if os.environ.get("FLA_CULA_NO_DISK_CACHE") == "1":
        return _compile_and_export(spec, None, symbol)
    d = cache_dir() / dsl_version() / ensure_target_arch()
    d.mkdir(parents=True, exist_ok=True)
    obj = d / f"{spec.name}-{digest}.o"
    with open(d / f"{spec.name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if obj.exists():
            try:
                fn = _load_object(obj, symbol)
                stats["disk_hits"] += 1
                return fn
            except Exception as e:
                stats["corrupt"] += 1
                logger.warning("fla_cula: cache entry %s unreadable (%s); recompiling", obj, e)
                obj.unlink(missing_ok=True)
        return _compile_and_export(spec, obj, symbol)


def _compile_and_export(spec: KernelSpec, obj: Path | None, symbol: str) -> Callable:
    compiled = compile_spec(spec)
    if obj is None:
        return compiled
    fd, tmp = tempfile.mkstemp(dir=obj.parent, suffix=".o.tmp")
    os.close(fd)
    try:
        compiled.export_to_c(tmp, function_name=symbol)
        os.replace(tmp, obj)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    try:
        return _load_object(obj, symbol)
    except Exception as e:  # exported but not loadable here: use the in-memory compile
        logger.warning("fla_cula: could not load exported %s (%s); using in-process compile", obj, e)
        return compiled


def missing_ptx(spec: KernelSpec, ptx: str) -> list[str]:
    """The expect_ptx patterns that the PTX does not match (plus the target line)."""
    pats = (rf"\.target {ensure_target_arch()}\b", *spec.expect_ptx)
    return [p for p in pats if not re.search(p, ptx)]


def is_cached_on_disk(spec: KernelSpec) -> bool:
    return (cache_dir() / dsl_version() / ensure_target_arch() / f"{spec.name}-{spec.digest()}.o").exists()


def is_cached_in_process(spec: KernelSpec) -> bool:
    return spec in _mem
