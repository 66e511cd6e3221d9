"""The CUDA C++ extension fla_cula._C on the CPU machine: build facts, the tensor ABI's checks
(csrc/common/dlpack_tensor.h: every check runs before any CUDA call, so CPU tensors exercise
them), the SASS/resource check CI runs, and the build requirements declared once.
The work-list kernel against FLA runs on the GPU: tests/gpu/test_varlen_schedule.py."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fla_cula import _ext

ROOT = Path(__file__).resolve().parent.parent


def _nvcc_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(shutil.which("nvcc") or (home and Path(home, "bin", "nvcc").is_file()))


@pytest.fixture(scope="module")
def ext():
    """The built module. nvcc present but no module is a failure (the build broke or was skipped)
    unless FLA_CULA_NO_EXT=1 says the skip was intended."""
    ok, why = _ext.available()
    if ok:
        return _ext.require()
    if os.environ.get("FLA_CULA_NO_EXT") == "1":
        pytest.skip(f"FLA_CULA_NO_EXT=1: {why}")
    if not _nvcc_present():
        pytest.skip(f"no nvcc on this machine, extension not built: {why}")
    pytest.fail(f"nvcc is present but the extension is unavailable: {why}")


@pytest.fixture(scope="module")
def cuobjdump(ext):
    tool = _ext.cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (neither in triton's wheel nor on PATH)")
    return tool


# ---------------------------------------------------------------------------------------------
# Build facts
# ---------------------------------------------------------------------------------------------


def test_available_reports_tuple():
    ok, why = _ext.available()
    assert isinstance(ok, bool) and isinstance(why, str)
    assert ok == (why == ""), f"available() must give a reason exactly when unavailable: {(ok, why)}"


def test_module_metadata(ext):
    import fla_cula

    assert ext.built_arch() == "sm_90a"
    assert ext.version() == fla_cula.__version__
    assert ext.api_version() == _ext._API_VERSION
    assert re.fullmatch(r"\d+\.\d+", ext.cuda_version())
    info = _ext.info()
    assert info["arch"] == "sm_90a"
    # torch >= 2.10 has the DLPack C exchange API; older ones go through __dlpack__ (and say why)
    if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        assert info["dlpack"] == "C exchange API"


def test_sass_is_sm90a_only(ext, cuobjdump):
    sass = _ext.sass_opcodes(ext.__file__)
    assert {arch for arch, _ in sass.values()} == {"sm_90a"}
    names = _ext.demangle(list(sass))
    families = ("varlen_schedule_kernel", "kda_fwd_kernel", "kda_prep_kernel", "kda_state_kernel",
                "kda_state_rs_kernel", "kda_combine_kernel", "kda_bwd_wy_kernel", "kda_bwd_intra_kernel",
                "kda_bwd_gate_kernel", "kda_bwd_dv_kernel", "kda_roles_kernel")
    assert all(any(f in n for f in families) for n in names.values()), names
    varlen = [s for s, n in names.items() if "varlen_schedule_kernel" in n]
    assert len(varlen) == 2, f"expected the two varlen_schedule specializations, got {list(names.values())}"
    for s in varlen:  # the rows are written as one 8-byte store per (sequence, chunk)
        assert any(op.startswith("STG.E.64") for op in sass[s][1]), sorted(sass[s][1])


def test_no_libtorch_or_libcudart_dependency(ext):
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("ldd not found")
    out = subprocess.run([ldd, ext.__file__], capture_output=True, text=True, check=True).stdout
    for lib in ("libtorch", "libc10", "libcudart", "libcuda.so"):
        assert lib not in out, f"{ext.__file__} must not depend on {lib}:\n{out}"


def test_cpp_kernels_listed_with_resources(ext, cuobjdump):
    from fla_cula.kernels import varlen_schedule

    (fam,) = varlen_schedule.cpp_kernels_info()
    assert fam["name"] == "varlen_schedule" and fam["arch"] == "sm_90a"
    assert fam["resources"] == "cuobjdump -res-usage"
    assert [s["max_seqs"] for s in fam["specializations"]] == [512, varlen_schedule.MAX_SEQUENCES]
    for s in fam["specializations"]:
        assert 0 < s["registers"] <= 255 and s["smem_bytes"] > 0
        assert s["stack"] == 0 and s["local"] == 0, f"spills or local memory: {s}"
    # the 512-thread CTA needs more than 48 KiB of dynamic shared memory (the launcher opts in)
    assert fam["specializations"][1]["smem_bytes"] > 48 * 1024


# ---------------------------------------------------------------------------------------------
# scripts/check_cpp_sass.py (CI runs it after the install)
# ---------------------------------------------------------------------------------------------


def _check_sass(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_cpp_sass.py"), *args],
        capture_output=True, text=True, cwd=ROOT,
    )


def test_check_cpp_sass_passes_and_prints_resources(ext, cuobjdump):
    r = _check_sass()
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("varlen_schedule_kernel<")]
    assert len(rows) == 2, r.stdout
    assert re.search(r"sm_90a\s+\d+\s+0\s+0\s+\d+\s+\d+", rows[0]), rows[0]  # regs, stack, local, smem, dyn


def test_check_cpp_sass_fails_on_a_missing_opcode(ext, cuobjdump):
    r = _check_sass("--manifest", json.dumps({"varlen_schedule_kernel": ["HGMMA"]}))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "HGMMA:MISSING" in r.stdout
    assert re.search(r"varlen_schedule_kernel<.*>: expected HGMMA in its SASS, found none", r.stdout), r.stdout


def test_check_cpp_sass_fails_on_a_kernel_not_in_the_manifest(ext, cuobjdump):
    r = _check_sass("--manifest", json.dumps({"some_other_kernel": []}))
    assert r.returncode == 1
    assert "not in the manifest" in r.stdout


def test_check_cpp_sass_opcode_match_takes_modifiers(ext, cuobjdump):
    # an opcode present in this SASS ("STG.E.64" as "STG") passes; the check is not vacuous
    r = _check_sass("--manifest", json.dumps({"varlen_schedule_kernel": ["STG", "BAR"], "kda_": []}))
    assert r.returncode == 0, r.stdout
    assert "BAR:ok, STG:ok" in r.stdout


# ---------------------------------------------------------------------------------------------
# The tensor ABI (C++ checks on CPU tensors: every check runs before any CUDA call)
# ---------------------------------------------------------------------------------------------


def _ws(n=2, rows=100):
    return (
        torch.empty(rows, 2, dtype=torch.int32),
        torch.empty((), dtype=torch.int32),
        torch.empty(n + 1, dtype=torch.int32),
    )


CU = torch.tensor([0, 5, 9], dtype=torch.int32)


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((CU, *_ws()), ValueError, r"^cu_seqlens: expected a CUDA tensor, got cpu$"),
        ((CU.float(), *_ws()), TypeError, r"^cu_seqlens: expected dtype int32 or int64, got float32$"),
        ((CU.to(torch.int16), *_ws()), TypeError, r"^cu_seqlens: expected dtype int32 or int64, got int16$"),
        ((CU.view(3, 1), *_ws()), ValueError, r"^cu_seqlens: expected a 1-D tensor, got shape \(3, 1\)$"),
        ((CU[::2], *_ws(1)), ValueError,
         r"^cu_seqlens: expected a contiguous tensor, got shape \(2,\) strides \(2,\)$"),
        ((CU[:0], *_ws()), ValueError, r"^cu_seqlens: expected at least 1 entry"),
        (([0, 5, 9], *_ws()), TypeError, r"^cu_seqlens: expected a tensor \(DLPack\), got list$"),
        ((CU, _ws()[0].float(), *_ws()[1:]), TypeError, r"^chunk_indices: expected dtype int32, got float32$"),
        ((CU, _ws(rows=1)[0], *_ws()[1:]), ValueError,
         r"^chunk_indices: expected shape \(R, 2\) with R >= total_tokens // chunk_size \+ N = 2, got \(1, 2\)$"),
        ((CU, _ws()[0].t().contiguous().t(), *_ws()[1:]), ValueError,
         r"^chunk_indices: expected a contiguous tensor, got shape \(100, 2\) strides \(1, 100\)$"),
        ((CU, _ws()[0], torch.empty(1, dtype=torch.int32), _ws()[2]), ValueError,
         r"^num_chunks: expected shape \(\) \(a scalar\), got \(1,\)$"),
        ((CU, *_ws()[:2], torch.empty(2, dtype=torch.int32)), ValueError,
         r"^chunk_offsets: expected shape \(3,\) \(N\+1, as cu_seqlens\), got \(2,\)$"),
        ((CU, *_ws()[:2], torch.empty(3, dtype=torch.int64)), TypeError,
         r"^chunk_offsets: expected dtype int32, got int64$"),
        ((torch.zeros(3, dtype=torch.int32, device="meta"), *_ws()), TypeError,
         r"^cu_seqlens: cannot read this Tensor as DLPack: \w+Error: .*meta"),
    ],
    ids=["cpu", "float", "int16", "2d", "strided", "empty", "list", "idx-float", "idx-short", "idx-colmajor",
         "count-1d", "offsets-short", "offsets-int64", "meta"],
)
def test_abi_errors_name_expected_and_actual(ext, args, err, match):
    with pytest.raises(err, match=match):
        ext.varlen_schedule(*args, 9, 64)


def test_abi_scalar_arguments(ext):
    with pytest.raises(ValueError, match=r"^chunk_size: expected 1 <= chunk_size <= 2\^20, got 0$"):
        ext.varlen_schedule(CU, *_ws(), 9, 0)
    with pytest.raises(ValueError, match=r"^total_tokens: expected 0 <= total_tokens <= 2\^31-1, got -1$"):
        ext.varlen_schedule(CU, *_ws(), -1, 64)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected at most 8192 sequences, got 8193$"):
        ext.varlen_schedule(torch.zeros(8194, dtype=torch.int32), *_ws(8193, rows=9000), 0, 64)


def test_abi_reads_tensors_that_require_grad(ext):
    # read as any other tensor (where the exchange API refuses one, the __dlpack__ path detaches it)
    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"^cu_seqlens: expected dtype int32 or int64, got float32$"):
        ext.varlen_schedule(x, *_ws(), 9, 64)


def test_abi_same_device_is_checked_after_the_first_tensor(ext):
    # every tensor is on the CPU here: the first device check names cu_seqlens
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected a CUDA tensor, got cpu$"):
        ext.varlen_schedule(CU.to(torch.int64), *_ws(), 9, 32)


def test_call_signature_still_works(ext):
    assert ext.init_call_signature(torch.Tensor) == _ext.info()["dlpack"].replace("C exchange API", "")
    if _ext.info()["dlpack"] != "C exchange API":
        pytest.skip("no DLPack C exchange API in this torch")
    t = torch.zeros(2, 3, dtype=torch.float16)
    sig = ext.call_signature((t, 7, None), lambda x: "slow")
    assert sig[1:] == (7, None) and isinstance(sig[0], bytes) and len(sig[0]) == 8 * (4 + 2 * 2)
    assert ext.call_signature((torch.zeros(2, device="meta"),), lambda x: "slow") == ("slow",)


# ---------------------------------------------------------------------------------------------
# The Python wrapper (fla_cula.kernels.varlen_schedule)
# ---------------------------------------------------------------------------------------------


def test_wrapper_validates_before_allocating(ext):
    from fla_cula.kernels.varlen_schedule import chunk_schedule

    with pytest.raises(TypeError, match=r"^cu_seqlens: expected a torch.Tensor, got list$"):
        chunk_schedule([0, 4], 4)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected shape \(N\+1,\) with N >= 0, got \(2, 2\)$"):
        chunk_schedule(torch.zeros(2, 2, dtype=torch.int32), 4)
    with pytest.raises(TypeError, match=r"^total_tokens: expected an int, got float$"):
        chunk_schedule(CU, 9.0)
    with pytest.raises(TypeError, match=r"^chunk_size: expected an int, got bool$"):
        chunk_schedule(CU, 9, True)
    with pytest.raises(ValueError, match=r"^chunk_size: expected a positive int, got -64$"):
        chunk_schedule(CU, 9, -64)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected a CUDA tensor, got cpu$"):
        chunk_schedule(CU, 9)  # the C++ checks: one set of messages for every C++ kernel


# ---------------------------------------------------------------------------------------------
# Build requirements: declared once (pyproject [build-system] requires), installed by README's line
# ---------------------------------------------------------------------------------------------


def _readme_install_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Install\n.*?^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert m, "README.md: no ```bash block under '## Install'"
    return [line.split("#", 1)[0].strip() for line in m.group(1).splitlines() if line.strip()]


def test_readme_build_deps_line_is_pyproject_build_requires():
    tomllib = pytest.importorskip("tomllib")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    lines = [c for c in _readme_install_commands() if "pybind11" in c]
    assert len(lines) == 1, f"expected one build-deps line in README's Install, got {lines}"
    import shlex

    words = shlex.split(lines[0])
    assert words[:2] == ["pip", "install"], lines[0]
    assert words[2:] == requires, f"README's build deps {words[2:]} != pyproject [build-system] requires {requires}"


def test_setup_py_build_imports_are_build_requirements():
    # what setup.py needs at build time, by distribution name: each must be in [build-system] requires
    tomllib = pytest.importorskip("tomllib")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    names = {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() for r in requires}
    for dist in ("setuptools", "wheel", "pybind11", "nvidia-cutlass", "apache-tvm-ffi"):
        assert dist in names, f"{dist} (needed by setup.py) is not in [build-system] requires: {requires}"


def test_ci_installs_exactly_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    installs = [line for line in ci.splitlines() if re.search(r"\bpip\b.*\binstall\b", line)]
    # the only install command in .ci/run is the CPU torch pin that replaces README's `pip install torch`
    assert [line.strip() for line in installs if "README" not in line and "torch==" not in line] == [], installs
    assert "README.md" in ci and 'eval "$cmd"' in ci
