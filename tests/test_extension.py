"""The CUDA C++ extension fla_cula._C: build facts (CPU), argument validation (CPU), and the
state_gather kernel against torch indexing (GPU, marker ``gpu``)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fla_cula import _ext

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _nvcc_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(shutil.which("nvcc") or (home and Path(home, "bin", "nvcc").is_file()))


@pytest.fixture(scope="module")
def ext():
    """The built module. nvcc present but no module is a failure (the build broke or was skipped)
    unless FLA_CULA_NO_EXT=1 says the skip was intended."""
    ok, why = _ext.available()
    if ok:
        from fla_cula import _C

        return _C
    if os.environ.get("FLA_CULA_NO_EXT") == "1":
        pytest.skip(f"FLA_CULA_NO_EXT=1: {why}")
    if not _nvcc_present():
        pytest.skip(f"no nvcc on this machine, extension not built: {why}")
    pytest.fail(f"nvcc is present but the extension is unavailable: {why}")


def _cuobjdump() -> str | None:
    try:
        import triton
    except ImportError:
        triton = None
    if triton is not None:
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if tool.is_file():
            return str(tool)
    return shutil.which("cuobjdump")


# ---------------------------------------------------------------------------------------------
# Build facts (CPU)
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
    assert _ext.info()["arch"] == "sm_90a"


def test_sass_is_sm90a_with_128bit_copies(ext):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (neither in triton's wheel nor on PATH)")
    sass = subprocess.run([tool, "-sass", ext.__file__], capture_output=True, text=True, check=True).stdout
    arches = set(re.findall(r"arch = (sm_\w+)", sass))
    assert arches == {"sm_90a"}, f"expected only sm_90a device code, got {arches}"
    kernels = re.findall(r"Function : (\S+)", sass)
    assert len(kernels) == 4, f"expected 4 state_gather specializations (vec16/vec4 x int32/int64), got {kernels}"
    assert all("state_gather_kernel" in k for k in kernels)
    # the 16-byte path: vectorized global loads and stores
    assert "LDG.E.128" in sass and "STG.E.128" in sass, "16-byte specialization lost its LDG.128/STG.128"


def test_no_libtorch_or_libcudart_dependency(ext):
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("ldd not found")
    out = subprocess.run([ldd, ext.__file__], capture_output=True, text=True, check=True).stdout
    for lib in ("libtorch", "libc10", "libcudart", "libcuda.so"):
        assert lib not in out, f"{ext.__file__} must not depend on {lib}:\n{out}"


# ---------------------------------------------------------------------------------------------
# Validation (CPU): checked before anything touches a device
# ---------------------------------------------------------------------------------------------


def _args(
    device="cpu", n=3, pool=5, row=(2, 8), dst_dtype=torch.float32, src_dtype=torch.float32, idx_dtype=torch.int32
):
    dst = torch.empty((n, *row), dtype=dst_dtype, device=device)
    src = torch.empty((pool, *row), dtype=src_dtype, device=device)
    idx = torch.zeros(n, dtype=idx_dtype, device=device)
    return dst, src, idx


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_tensors_rejected(device):
    with pytest.raises(ValueError, match=rf"dst: expected a CUDA tensor, got device {device}"):
        _ext.state_gather(*_args(device))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dst_dtype=torch.bfloat16), r"dst: expected dtype torch.float32, got torch.bfloat16"),
        (dict(src_dtype=torch.float16), r"src: expected dtype torch.float32, got torch.float16"),
        (dict(idx_dtype=torch.float32), r"idx: expected dtype torch.int32 or torch.int64, got torch.float32"),
        (dict(idx_dtype=torch.int16), r"idx: expected dtype torch.int32 or torch.int64, got torch.int16"),
    ],
    ids=["dst-bf16", "src-fp16", "idx-float", "idx-int16"],
)
def test_dtype_rejected(kw, match):
    with pytest.raises(TypeError, match=match):
        _ext.state_gather(*_args("meta", **kw))


def test_non_tensor_rejected():
    dst, src, _ = _args("meta")
    with pytest.raises(TypeError, match=r"idx: expected a torch.Tensor, got list"):
        _ext.state_gather(dst, src, [0, 1, 2])


def test_shape_and_layout_rejected():
    dst, src, idx = _args("meta")
    with pytest.raises(ValueError, match=r"dst: expected 4 rows \(len\(idx\)\), got shape \(3, 2, 8\)"):
        _ext.state_gather(dst, src, torch.zeros(4, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"src: expected row shape \(2, 8\) \(as dst\), got \(8, 2\)"):
        _ext.state_gather(dst, torch.empty(5, 8, 2, device="meta"), idx)
    with pytest.raises(ValueError, match=r"idx: expected a 1-D tensor, got shape \(3, 1\)"):
        _ext.state_gather(dst, src, idx.view(3, 1))
    with pytest.raises(ValueError, match=r"src: expected a contiguous tensor"):
        _ext.state_gather(dst, torch.empty(5, 8, 2, device="meta").transpose(1, 2), idx)


def test_launcher_rejects_bad_arguments(ext):
    with pytest.raises(ValueError, match=r"idx_bytes must be 4 \(int32\) or 8 \(int64\), got 2"):
        ext.state_gather(256, 512, 1024, 4, 8, 16, 2, 0)
    with pytest.raises(ValueError, match=r"n must be >= 0, got -1"):
        ext.state_gather(256, 512, 1024, -1, 8, 16, 4, 0)
    with pytest.raises(ValueError, match=r"dst and idx must not be null"):
        ext.state_gather(0, 512, 1024, 4, 8, 16, 4, 0)
    with pytest.raises(ValueError, match=r"idx pointer is not aligned"):
        ext.state_gather(256, 512, 1026, 4, 8, 16, 8, 0)
    ext.state_gather(0, 0, 0, 0, 0, 16, 4, 0)  # nothing to do: returns without touching CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the launch error path on a machine without a GPU")
def test_launch_failure_becomes_runtime_error(ext):
    # No usable GPU/driver here: the launch fails and the launcher's post-launch check reports it.
    with pytest.raises(RuntimeError, match=r"launch of state_gather_kernel failed: cudaError\w+ \("):
        ext.state_gather(256, 512, 1024, 4, 8, 16, 4, 0)


# ---------------------------------------------------------------------------------------------
# Correctness (GPU)
# ---------------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs a CUDA SM90 device")


def _reference(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    out = dst.clone()
    valid = (idx >= 0) & (idx < src.shape[0])
    out[valid] = src[idx[valid].long()]
    return out


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["idx-int32", "idx-int64"])
@pytest.mark.parametrize(
    "row",
    [(32, 128, 128), (4, 64, 64), (1, 7, 3), (1000,), (4100,)],
    ids=["kda-32x128x128", "4x64x64", "odd-21-elems", "1000-elems", "4100-elems-residue"],
)
@pytest.mark.gpu
@needs_sm90
def test_state_gather_matches_indexing(row, idx_dtype, ext):
    torch.manual_seed(0)
    pool, n = 11, 9
    src = torch.randn(pool, *row, device="cuda")
    idx = torch.tensor([3, -1, 0, 10, 3, -5, 7, pool, 2**20], dtype=idx_dtype, device="cuda")
    dst = torch.full((n, *row), float("nan"), device="cuda")
    expected = _reference(dst, src, idx)
    out = _ext.state_gather(dst, src, idx)
    torch.cuda.synchronize()
    assert out is dst
    # bitwise: a copy; NaN rows (negative / out-of-pool indices) must stay NaN
    assert torch.equal(dst.nan_to_num(123.0), expected.nan_to_num(123.0))
    assert torch.isnan(dst[[1, 5, 7, 8]]).all()


@pytest.mark.gpu
@needs_sm90
def test_state_gather_unaligned_and_side_stream(ext):
    # src starts 4 bytes past a 16-byte boundary: the launcher must take the 4-byte path.
    base = torch.randn(6 * 256 + 1, device="cuda")
    src = base[1:].view(6, 256)
    assert src.data_ptr() % 16 != 0
    idx = torch.tensor([5, 0, -1, 2], dtype=torch.int64, device="cuda")
    dst = torch.zeros(4, 256, device="cuda")
    expected = _reference(dst, src, idx)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _ext.state_gather(dst, src, idx)
    stream.synchronize()
    assert torch.equal(dst, expected)


@pytest.mark.gpu
@needs_sm90
def test_state_gather_rejects_overlap_and_mixed_devices(ext):
    pool = torch.randn(8, 64, device="cuda")
    idx = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="overlap"):
        _ext.state_gather(pool[:2], pool, idx)
    with pytest.raises(ValueError, match=r"idx: expected a CUDA tensor, got device cpu"):
        _ext.state_gather(torch.empty(2, 64, device="cuda"), pool, idx.cpu())
