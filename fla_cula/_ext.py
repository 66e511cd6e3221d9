"""Python side of the CUDA C++ extension ``fla_cula._C`` (built from csrc/ by setup.py).

The extension does not link libtorch: this module validates torch tensors and hands their raw
device pointers, sizes and the caller's current CUDA stream to ``_C``. The package works without
the extension; ``available()`` says whether it is there and, when not, why.
"""

import functools
import math
from types import ModuleType

import torch

# Must match kApiVersion in csrc/bindings.cpp; a mismatch means the .so is stale (rebuild it).
_API_VERSION = 2
_INDEX_DTYPES = (torch.int32, torch.int64)


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        from fla_cula import _C
    except ImportError as exc:
        return None, (
            f"fla_cula._C is not built ({exc}); build it with `pip install -e . --no-build-isolation` "
            "(needs nvcc >= 12 and the CUTLASS headers, see docs/build.md)"
        )
    api = _C.api_version()
    if api != _API_VERSION:
        return None, (
            f"fla_cula._C is stale: API version {api}, this fla_cula expects {_API_VERSION} "
            f"(built from fla_cula {_C.version()}); rebuild it"
        )
    return _C, ""


def available() -> tuple[bool, str]:
    """(True, "") when the extension imports and matches this package; else (False, reason)."""
    mod, why = _load()
    return mod is not None, why


def info() -> dict[str, str]:
    """Build facts of the extension (empty when unavailable)."""
    mod, _ = _load()
    if mod is None:
        return {}
    return {"version": mod.version(), "arch": mod.built_arch(), "cuda": mod.cuda_version(), "path": mod.__file__}


def _require() -> ModuleType:
    mod, why = _load()
    if mod is None:
        raise RuntimeError(why)
    return mod


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {expected}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got shape {tuple(t.shape)} stride {t.stride()}")
    return t


def _ranges_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def state_gather(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``dst[i] = src[idx[i]]`` for every i with ``0 <= idx[i] < src.shape[0]``; other rows of dst are
    left untouched (negative indices are the serving engines' padding slots). Returns ``dst``.

    dst: float32 ``[n, *row]``; src: float32 ``[pool, *row]`` (a state pool; must not overlap dst);
    idx: int32 or int64 ``[n]``. All contiguous, CUDA, on one SM90 device. Enqueued on the current
    stream of that device; no host synchronization.
    """
    _check_tensor("dst", dst, (torch.float32,))
    _check_tensor("src", src, (torch.float32,))
    _check_tensor("idx", idx, _INDEX_DTYPES)
    if idx.dim() != 1:
        raise ValueError(f"idx: expected a 1-D tensor, got shape {tuple(idx.shape)}")
    if dst.dim() < 1 or src.dim() < 1:
        raise ValueError(f"dst and src need a leading row dimension, got shapes {tuple(dst.shape)}, {tuple(src.shape)}")
    if dst.shape[0] != idx.shape[0]:
        raise ValueError(f"dst: expected {idx.shape[0]} rows (len(idx)), got shape {tuple(dst.shape)}")
    if dst.shape[1:] != src.shape[1:]:
        raise ValueError(
            f"src: expected row shape {tuple(dst.shape[1:])} (as dst), got {tuple(src.shape[1:])} "
            f"(shape {tuple(src.shape)})"
        )
    for name, t in (("dst", dst), ("src", src), ("idx", idx)):
        if t.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if src.device != dst.device or idx.device != dst.device:
        raise ValueError(f"expected dst, src and idx on one device, got {dst.device}, {src.device}, {idx.device}")
    mod = _require()
    major, minor = torch.cuda.get_device_capability(dst.device)
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"fla_cula._C holds {mod.built_arch()} code, which runs on compute capability 9.0 only; "
            f"{dst.device} has {major}.{minor}"
        )
    if _ranges_overlap(dst, src):
        raise ValueError("dst and src overlap in memory; state_gather needs a separate destination")

    n = dst.shape[0]
    row_elems = math.prod(dst.shape[1:])
    if n == 0 or row_elems == 0:
        return dst
    with torch.cuda.device(dst.device):
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        mod.state_gather(
            dst.data_ptr(),
            src.data_ptr(),
            idx.data_ptr(),
            n,
            src.shape[0],
            row_elems,
            idx.element_size(),
            stream,
        )
    return dst
