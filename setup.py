"""Build script: the pure-Python package plus the optional CUDA C++ extension ``fla_cula._C``.

Project metadata and dependencies live in pyproject.toml. This file only adds the extension:
a pybind11 module built from ``csrc/`` that does NOT link libtorch (kernels read their tensor
arguments through DLPack, csrc/common/dlpack_tensor.h), so one build serves every torch version.
It must still be built once per Python version (the file name carries the ABI tag).

- ``.cu`` files are compiled by nvcc for sm_90a (in parallel when there are several), ``.cpp``
  files (the pybind11 binding) by the host C++ compiler, and the result is linked against the
  static CUDA runtime, so the module needs neither libtorch nor libcudart at run time.
- CUTLASS/CuTe headers: ``$CUTLASS_HOME/include``, else the ``nvidia-cutlass`` wheel
  (``cutlass_library/source/include``).
- DLPack header (``dlpack/dlpack.h``, >= 1.2): from the ``apache-tvm-ffi`` wheel.
- Every build requirement is listed once, in pyproject.toml ``[build-system] requires`` (README's
  build-deps line installs the same list for ``--no-build-isolation``).
- The extension is skipped, with a message saying why, when ``FLA_CULA_NO_EXT=1``, when nvcc is
  not found (or older than 12.0), or when pybind11 / the CUTLASS headers / dlpack.h are missing. The package
  works without it. ``FLA_CULA_REQUIRE_EXT=1`` turns every skip or build failure into an error
  (CI uses it so a broken build cannot pass silently).

Also installs the start-up hook ``fla_cula_autopatch`` (module + ``.pth`` in site-packages, for
``FLA_CULA_PATCH=1``), in regular and editable installs alike.

Environment: CUDA_HOME / CUDA_PATH (toolkit root; default: derived from nvcc on PATH, then
/usr/local/cuda), CUTLASS_HOME, FLA_CULA_NO_EXT, FLA_CULA_REQUIRE_EXT, MAX_JOBS (parallel nvcc jobs),
FLA_CULA_NVCC_FLAGS (extra nvcc flags, space separated). See docs/build.md.
"""

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Distribution, Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
EXT_NAME = "fla_cula._C"
# Start-up hook (FLA_CULA_PATCH=1): the .pth must land at the top of site-packages, next to its module.
AUTOPATCH_PTH = "fla_cula_autopatch.pth"

# The one place the target architecture is chosen. sm_90a (not sm_90): WGMMA/TMA/setmaxnreg need the
# arch-specific feature set, and sm_90a code runs on compute capability 9.0 only.
BUILT_ARCH = "sm_90a"
GENCODE = ["-gencode=arch=compute_90a,code=sm_90a"]
MIN_NVCC = (12, 0)


def _log(msg: str) -> None:
    print(f"[fla_cula setup] {msg}", flush=True)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if m is None:
        raise RuntimeError("pyproject.toml has no [project] version")
    return m.group(1)


def _find_cuda() -> tuple[str | None, str | None, str]:
    """(nvcc path, CUDA toolkit root, reason when not found)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            nvcc = Path(home) / "bin" / "nvcc"
            if nvcc.is_file():
                return str(nvcc), home, ""
            _log(f"{var}={home} has no bin/nvcc; looking elsewhere")
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if (home / "include" / "cuda_runtime_api.h").is_file() and (home / "bin" / "nvcc").is_file():
            return nvcc or str(home / "bin" / "nvcc"), str(home), ""
    if nvcc:
        return None, None, f"nvcc found at {nvcc} but no CUDA toolkit root (set CUDA_HOME)"
    return None, None, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"


def _nvcc_version(nvcc: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _find_dlpack_include() -> str | None:
    """The DLPack header (>= 1.2, with the C exchange API) shipped by apache-tvm-ffi, a build
    requirement; found without importing it. None when tvm-ffi is not installed at build time."""
    import importlib.util

    spec = importlib.util.find_spec("tvm_ffi")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        inc = Path(loc) / "include"
        if (inc / "dlpack" / "dlpack.h").is_file():
            return str(inc)
    return None


def _find_cutlass_include() -> tuple[str | None, str]:
    home = os.environ.get("CUTLASS_HOME")
    if home:
        inc = Path(home) / "include"
        if (inc / "cute" / "tensor.hpp").is_file():
            return str(inc), ""
        _log(f"CUTLASS_HOME={home} has no include/cute/tensor.hpp; trying the nvidia-cutlass wheel")
    try:
        import cutlass_library  # from the nvidia-cutlass wheel (C++ headers only; not the CuTe DSL)
    except ImportError:
        return None, "CUTLASS headers not found (set CUTLASS_HOME or pip install nvidia-cutlass==4.2.0.0)"
    inc = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if (inc / "cute" / "tensor.hpp").is_file():
        return str(inc), ""
    return None, f"nvidia-cutlass is installed but {inc} has no cute/tensor.hpp"


def _cuda_lib_dirs(cuda_home: str) -> list[str]:
    home = Path(cuda_home)
    dirs = [home / "lib64", home / "targets" / "x86_64-linux" / "lib", home / "targets" / "sbsa-linux" / "lib"]
    return [str(d) for d in dirs if (d / "libcudart_static.a").is_file()]


class BuildExtWithNvcc(build_ext):
    """build_ext that compiles ``.cu`` sources with nvcc and hands the objects to the normal link."""

    def build_extensions(self) -> None:
        self.check_extensions_list(self.extensions)
        failed = []
        for ext in self.extensions:
            try:
                self.build_extension(ext)
            except Exception as exc:  # any build failure (nvcc, host compiler, linker) is reported the same way
                if _truthy("FLA_CULA_REQUIRE_EXT"):
                    raise
                failed.append(ext)
                _log("=" * 78)
                _log(f"building {ext.name} FAILED: {exc}")
                _log("continuing without it: fla_cula works, CUDA C++ kernels are unavailable.")
                _log("Set FLA_CULA_REQUIRE_EXT=1 to make this an error; FLA_CULA_NO_EXT=1 to skip quietly.")
                _log("=" * 78)
        # Forget failed extensions, so that install / editable steps do not look for their outputs.
        for ext in failed:
            self.extensions.remove(ext)

    def build_extension(self, ext: Extension) -> None:
        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        if cu_sources:
            ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
            ext.extra_objects = list(ext.extra_objects or []) + self._compile_cuda(ext, cu_sources)
        super().build_extension(ext)

    def _compile_cuda(self, ext: Extension, sources: list[str]) -> list[str]:
        nvcc = ext.nvcc  # type: ignore[attr-defined]
        flags = list(ext.nvcc_flags)  # type: ignore[attr-defined]
        build_temp = Path(self.build_temp)
        build_temp.mkdir(parents=True, exist_ok=True)
        # Recompile when a source, any header under csrc/, or the flags changed.
        deps_mtime = max(p.stat().st_mtime for p in CSRC.rglob("*") if p.is_file())
        flags_key = hashlib.sha256(" ".join([nvcc, *flags]).encode()).hexdigest()[:16]

        jobs: list[tuple[list[str], Path]] = []
        objects = []
        for src in sources:
            rel = Path(src).resolve().relative_to(ROOT)
            obj = build_temp / rel.with_suffix(f".{flags_key}.o")
            objects.append(str(obj))
            if not self.force and obj.is_file() and obj.stat().st_mtime >= deps_mtime:
                continue
            obj.parent.mkdir(parents=True, exist_ok=True)
            jobs.append(([nvcc, *flags, "-c", str(Path(src).resolve()), "-o", str(obj)], obj))

        if jobs:
            max_jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
            workers = max(1, min(len(jobs), max_jobs))
            _log(f"nvcc: {len(jobs)} file(s), {workers} parallel job(s), {BUILT_ARCH}")
            with ThreadPoolExecutor(workers) as pool:
                for cmd, obj, rc, out in pool.map(self._run_nvcc, jobs):
                    if out.strip():
                        print(out, end="" if out.endswith("\n") else "\n", flush=True)
                    if rc != 0:
                        raise RuntimeError(f"nvcc failed (exit {rc}) on {obj.name}: {shlex.join(cmd)}")
        return objects

    @staticmethod
    def _run_nvcc(job: tuple[list[str], Path]) -> tuple[list[str], Path, int, str]:
        cmd, obj = job
        print(shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 and obj.exists():
            obj.unlink()
        return cmd, obj, proc.returncode, proc.stdout


def _autopatch_data_files() -> list[tuple[str, list[str]]]:
    """Install fla_cula_autopatch.pth into site-packages, where the interpreter reads .pth files at
    start-up. data_files land under the install scheme's data root (the prefix); site-packages is
    that root's purelib subfolder. data_files reach editable installs too (build_py outputs do not)."""
    rel = os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_path("data"))
    if rel.startswith(".."):
        _log(f"not installing {AUTOPATCH_PTH}: site-packages is outside the install prefix; FLA_CULA_PATCH=1 inactive")
        return []
    return [(rel, [AUTOPATCH_PTH])]


class _Distribution(Distribution):
    # setuptools' editable_wheel installs data files only if the distribution has `has_data()`;
    # Distribution names it `has_data_files()`, so without this alias editable installs drop the .pth.
    def has_data(self) -> bool:
        return self.has_data_files()


def _extension() -> list[Extension]:
    def skip(reason: str) -> list[Extension]:
        if _truthy("FLA_CULA_REQUIRE_EXT"):
            raise RuntimeError(f"FLA_CULA_REQUIRE_EXT=1 but {EXT_NAME} cannot be built: {reason}")
        _log(f"skipping the CUDA extension {EXT_NAME}: {reason}. fla_cula works without it.")
        return []

    if _truthy("FLA_CULA_NO_EXT"):
        return skip("FLA_CULA_NO_EXT is set")
    nvcc, cuda_home, why = _find_cuda()
    if nvcc is None or cuda_home is None:
        return skip(why)
    version = _nvcc_version(nvcc)
    if version is None or version < MIN_NVCC:
        return skip(f"{nvcc} reports version {version}; {BUILT_ARCH} needs nvcc >= {MIN_NVCC[0]}.{MIN_NVCC[1]}")
    cutlass_inc, why = _find_cutlass_include()
    if cutlass_inc is None:
        return skip(why)
    try:
        import pybind11
    except ImportError:
        return skip("pybind11 is not installed (pip install 'pybind11>=3.0')")
    dlpack_inc = _find_dlpack_include()
    if dlpack_inc is None:
        return skip(
            "dlpack/dlpack.h not found: apache-tvm-ffi is not installed "
            "(a build requirement, see pyproject.toml [build-system] requires)"
        )
    lib_dirs = _cuda_lib_dirs(cuda_home)
    if not lib_dirs:
        return skip(f"libcudart_static.a not found under {cuda_home}")

    defines = [f'-DFLA_CULA_VERSION="{_version()}"', f'-DFLA_CULA_BUILT_ARCH="{BUILT_ARCH}"']
    nvcc_flags = [
        "-std=c++17",
        "-O3",
        *GENCODE,
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        "-Xcompiler",
        "-fPIC",
        "-Xcompiler",
        "-fvisibility=hidden",
        "-Xptxas=-warn-spills",
        f"-I{cutlass_inc}",
        f"-I{CSRC}",
        *defines,
        *shlex.split(os.environ.get("FLA_CULA_NVCC_FLAGS", "")),
    ]
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob("*.cu"))
    sources += sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob("*.cpp"))
    macros = [("FLA_CULA_VERSION", f'"{_version()}"'), ("FLA_CULA_BUILT_ARCH", f'"{BUILT_ARCH}"')]

    ext = Extension(
        EXT_NAME,
        sources=sources,
        # Every csrc file: a header change relinks (the nvcc objects are tracked by _compile_cuda).
        depends=sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob("*") if p.is_file()),
        include_dirs=[pybind11.get_include(), str(CSRC), dlpack_inc],
        define_macros=macros,
        extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden"],
        library_dirs=lib_dirs,
        # Static CUDA runtime: the module needs no libcudart at run time and never sees libtorch's.
        libraries=["cudart_static", "dl", "pthread", "rt"],
        # Python's CFLAGS carry -g: 4.7 MB of host debug info otherwise (1.2 MB without).
        extra_link_args=["-Wl,--strip-debug"],
        language="c++",
    )
    ext.nvcc = nvcc  # type: ignore[attr-defined]
    ext.nvcc_flags = nvcc_flags  # type: ignore[attr-defined]
    _log(f"building {EXT_NAME} for {BUILT_ARCH} with {nvcc} ({version[0]}.{version[1]}), CUTLASS {cutlass_inc}")
    return [ext]


setup(
    packages=find_packages(include=["fla_cula", "fla_cula.*"]),
    py_modules=["fla_cula_autopatch"],
    data_files=_autopatch_data_files(),
    ext_modules=_extension(),
    cmdclass={"build_ext": BuildExtWithNvcc},
    distclass=_Distribution,
    zip_safe=False,
)
