"""The KDA prefill kernel's warpgroup MMA helper on its own (csrc/kda_sm90/kda_fwd_kernel.cuh ``wg_mma_tn``).

A small CUDA file that includes the kernel header is compiled by nvcc at test time: one warpgroup writes random
A [64, K] and B [BRows, K] tiles into shared memory through the kernel's own ``sw128k`` addressing, runs
``wg_mma_tn<N, K, BRows>`` on the N rows of B starting at row BRows - N, and stores the accumulator through the
mma.sync C-fragment mapping the kernel relies on. The result must equal A @ B[rows]^T in fp32. A wrong
descriptor (swizzle mode, the 32-byte step per 16 columns, the jump to a tile's second 64-column atom) or a wrong
accumulator layout gives O(1) errors here, before the whole kernel is involved (test_kda_prefill.py
``test_wgmma_variant``).
"""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fla_cula import _ext

ROOT = Path(__file__).resolve().parents[2]

SOURCE = r"""
#include "kda_sm90/kda_fwd_kernel.cuh"

using namespace fla_cula::kda_sm90;

template <int N, int K, int BRows>
__global__ void wg_unit(bf16 const* A, bf16 const* B, float* D) {
  extern __shared__ __align__(1024) unsigned char smem[];
  bf16* const sA = reinterpret_cast<bf16*>(smem);  // [64][K]
  bf16* const sB = sA + 64 * K;                     // [BRows][K], 1024-byte aligned (64 K 2 bytes)
  int const tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < 64 * K; e += 128) sA[sw128k<64>(e / K, e % K)] = A[e];
  for (int e = tid; e < BRows * K; e += 128) sB[sw128k<BRows>(e / K, e % K)] = B[e];
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  float acc[N / 8][4];
  for (int nt = 0; nt < N / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  wg_mma_tn<N, K, BRows>(acc, sA, sB + (BRows - N) * 64, lane, warp);
  int const g = lane >> 2, t = lane & 3;
  for (int nt = 0; nt < N / 8; ++nt)
    for (int e = 0; e < 4; ++e) D[(16 * warp + g + (e >> 1) * 8) * N + nt * 8 + 2 * t + (e & 1)] = acc[nt][e];
}

template <int N, int K, int BRows>
int launch(void const* A, void const* B, void* D) {
  int const smem = (64 + BRows) * K * 2;
  auto* k = wg_unit<N, K, BRows>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<1, 128, smem>>>(static_cast<bf16 const*>(A), static_cast<bf16 const*>(B), static_cast<float*>(D));
  return int(cudaGetLastError());
}

// the (N, K, BRows) the kernel instantiates: phase 6 (64, 64, 64), phase 7 (kBV/2, 64, kBV/2) and
// (kBV/2, 128, kBV) for B = S^T's column half, phase 8 (kBV/2, 64, kBV/2) and (kBV, 64, kBV); kBV = 64, 128
extern "C" int run_wg(int N, int K, int BRows, void const* A, void const* B, void* D) {
  if (N == 32 && K == 64 && BRows == 32) return launch<32, 64, 32>(A, B, D);
  if (N == 64 && K == 64 && BRows == 64) return launch<64, 64, 64>(A, B, D);
  if (N == 128 && K == 64 && BRows == 128) return launch<128, 64, 128>(A, B, D);
  if (N == 32 && K == 128 && BRows == 64) return launch<32, 128, 64>(A, B, D);
  if (N == 64 && K == 128 && BRows == 128) return launch<64, 128, 128>(A, B, D);
  if (N == 64 && K == 64 && BRows == 128) return launch<64, 64, 128>(A, B, D);
  return -1;
}
"""

CASES = [(32, 64, 32), (64, 64, 64), (128, 64, 128), (32, 128, 64), (64, 128, 128), (64, 64, 128)]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    nvcc = shutil.which("nvcc") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    inc = _ext.cutlass_include()
    if not Path(nvcc).is_file() or inc is None:
        pytest.skip("nvcc or the CUTLASS headers not found")
    d = tmp_path_factory.mktemp("wg_unit")
    (d / "wg_unit.cu").write_text(SOURCE)
    so = d / "libwg_unit.so"
    r = subprocess.run([nvcc, "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
                        "-shared", "-Xcompiler", "-fPIC", f"-I{inc}", f"-I{ROOT / 'csrc'}", str(d / "wg_unit.cu"),
                        "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return ctypes.CDLL(str(so))


@pytest.mark.parametrize("N,K,BRows", CASES, ids=[f"N{n}-K{k}-rows{b}" for n, k, b in CASES])
def test_wg_mma_tn_matches_matmul(lib, N, K, BRows):
    g = torch.Generator(device="cuda").manual_seed(N * 1000 + K + BRows)
    A = torch.randn(64, K, device="cuda", generator=g).bfloat16()
    B = torch.randn(BRows, K, device="cuda", generator=g).bfloat16()
    D = torch.full((64, N), float("nan"), device="cuda")
    torch.cuda.synchronize()
    rc = lib.run_wg(N, K, BRows, ctypes.c_void_p(A.data_ptr()), ctypes.c_void_p(B.data_ptr()),
                    ctypes.c_void_p(D.data_ptr()))
    torch.cuda.synchronize()
    assert rc == 0, f"launch error {rc}"
    ref = A.double() @ B[BRows - N:].double().T
    err = ((D.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"max error {err:.2e} relative to max |ref|"   # fp32 accumulation of exact bf16 products
