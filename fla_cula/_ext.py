"""Python side of the CUDA C++ extension ``fla_cula._C`` (built from csrc/ by setup.py).

The extension does not link libtorch. Its kernels take torch tensors directly: C++ reads them
through DLPack (torch's C exchange API, bound here once at load), checks dtype, shape, strides
and device, and launches on the caller's current stream of the tensors' device
(csrc/common/dlpack_tensor.h). The package works without the extension; ``available()`` says
whether it is there and, when not, why. A kernel's Python module (e.g.
``fla_cula.kernels.varlen_schedule``) raises ImportError with that reason, which the kernel
registry reports as the routing reason of its ops.

Build facts for ``fla_cula info``: ``cpp_kernels()`` lists the C++ kernel families with each
specialization's CTA size and dynamic shared memory (from ``_C.kernels()``) and, where cuobjdump is
found (triton's wheel, or PATH), registers, stack/local bytes (spills) and static shared memory
read from the built module's SASS (``cuobjdump -res-usage``); no GPU needed.
"""

import functools
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import torch

# Must match kApiVersion in csrc/bindings.cpp; a mismatch means the .so is stale (rebuild it).
_API_VERSION = 12


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        from fla_cula import _C
    except ImportError as exc:
        return None, (
            f"fla_cula._C is not built ({exc}); build it with `pip install -e . --no-build-isolation` "
            "(needs nvcc >= 12 and the build requirements of pyproject.toml, see docs/build.md)"
        )
    api = _C.api_version()
    if api != _API_VERSION:
        return None, (
            f"fla_cula._C is stale: API version {api}, this fla_cula expects {_API_VERSION} "
            f"(built from fla_cula {_C.version()}); rebuild it"
        )
    _dlpack_status[0] = _C.init_dlpack(torch.Tensor)
    return _C, ""


# Why torch's DLPack C exchange API is not used ("" when it is): tensors then go through __dlpack__.
_dlpack_status = [""]


def available() -> tuple[bool, str]:
    """(True, "") when the extension imports and matches this package; else (False, reason)."""
    mod, why = _load()
    return mod is not None, why


def info() -> dict[str, str]:
    """Build facts of the extension (empty when unavailable)."""
    mod, _ = _load()
    if mod is None:
        return {}
    return {
        "version": mod.version(),
        "arch": mod.built_arch(),
        "cuda": mod.cuda_version(),
        "path": mod.__file__,
        "dlpack": _dlpack_status[0] or "C exchange API",
    }


def require() -> ModuleType:
    """The loaded extension; RuntimeError with the reason when it is unavailable."""
    mod, why = _load()
    if mod is None:
        raise RuntimeError(why)
    return mod


# ---------------------------------------------------------------------------------------------
# What the built module holds (cuobjdump; CPU only, no GPU needed)
# ---------------------------------------------------------------------------------------------


def cuobjdump() -> str | None:
    """cuobjdump from triton's wheel, else from PATH; None when neither has it."""
    try:
        import triton
    except ImportError:
        triton = None
    if triton is not None:
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if tool.is_file():
            return str(tool)
    return shutil.which("cuobjdump")


def cutlass_include() -> Path | None:
    """The CUTLASS/CuTe C++ headers the extension is built against (as setup.py finds them): $CUTLASS_HOME/include,
    else the nvidia-cutlass wheel's; None when neither has cute/tensor.hpp (tests that compile C++ at run time)."""
    import os

    home = os.environ.get("CUTLASS_HOME")
    if home and (Path(home) / "include" / "cute" / "tensor.hpp").is_file():
        return Path(home) / "include"
    try:
        import cutlass_library
    except ImportError:
        return None
    inc = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    return inc if (inc / "cute" / "tensor.hpp").is_file() else None


def demangle(symbols: list[str]) -> dict[str, str]:
    """symbol -> demangled name (c++filt); the symbol itself where c++filt is missing."""
    tool = shutil.which("c++filt")
    if tool is None or not symbols:
        return {s: s for s in symbols}
    out = subprocess.run([tool], input="\n".join(symbols), capture_output=True, text=True, check=True).stdout
    names = out.splitlines()
    return dict(zip(symbols, names, strict=True)) if len(names) == len(symbols) else {s: s for s in symbols}


_RES_FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
_RES_FIELD = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")


def _cuobjdump_text(flag: str, path: str, tool: str | None) -> str:
    tool = tool or cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found (neither in triton's wheel nor on PATH)")
    return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def resource_usage(path: str, tool: str | None = None) -> list[dict]:
    """Per kernel in the binary at `path`: symbol, arch, registers, stack, local (bytes; non-zero
    means spills or local arrays), shared (static bytes) from ``cuobjdump -res-usage``."""
    text = _cuobjdump_text("-res-usage", path, tool)
    rows, arch, symbol = [], None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            arch = m.group(1)
            continue
        m = _RES_FUNCTION.match(line)
        if m:
            symbol = m.group(1)
            continue
        if symbol is not None and "REG:" in line:
            fields = {k: int(v) for k, v in _RES_FIELD.findall(line)}
            rows.append(
                {
                    "symbol": symbol,
                    "arch": arch,
                    "registers": fields.get("REG", 0),
                    "stack": fields.get("STACK", 0),
                    "local": fields.get("LOCAL", 0),
                    "shared": fields.get("SHARED", 0),
                }
            )
            symbol = None
    return rows


_SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
# "/*0a40*/  @!P0 HGMMA.64x128x16.F32.BF16 ..." -> the opcode with its modifiers
_SASS_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def sass_opcodes(path: str, tool: str | None = None) -> dict[str, tuple[str, set[str]]]:
    """symbol -> (arch, set of SASS opcodes with modifiers, e.g. "HGMMA.64x128x16.F32.BF16")."""
    text = _cuobjdump_text("-sass", path, tool)
    out: dict[str, tuple[str, set[str]]] = {}
    arch, ops = None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            arch = m.group(1)
            continue
        m = _SASS_FUNCTION.match(line)
        if m:
            ops = set()
            out[m.group(1)] = (arch, ops)
            continue
        if ops is not None:
            m = _SASS_INSTR.match(line)
            if m:
                ops.add(m.group(1))
    return out


@functools.cache
def cpp_kernels() -> list[dict]:
    """The C++ kernel families of the built module (empty when it is unavailable), for ``info``:
    name, arch, and per specialization its CTA size, dynamic shared memory and, where cuobjdump is
    found, registers / stack / local / static shared bytes from the SASS ("resources" holds why not)."""
    mod, _ = _load()
    if mod is None:
        return []
    families = [dict(f) for f in mod.kernels()]
    try:
        usage = resource_usage(mod.__file__)
        why = ""
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        usage, why = [], str(exc)
    for fam in families:
        fam["arch"] = mod.built_arch()
        fam["resources"] = why or "cuobjdump -res-usage"
        specs = []
        for spec in fam["specializations"]:
            spec = dict(spec)
            for row in usage:
                if fam["symbol"] in row["symbol"] and spec["symbol"] in row["symbol"]:
                    spec.update({k: row[k] for k in ("registers", "stack", "local", "shared")})
            specs.append(spec)
        fam["specializations"] = specs
    return families
