# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""A tiny internal CuTe DSL kernel that proves the compile/cache/launch path end to end.

    y[i] = a * x[i] + y[i]     x, y: 1-D bf16 (or fp32), length symbolic

Used by `python -m fla_cula info`, the CI compile test and the GPU smoke test; not a public op.
Each thread moves 8 contiguous elements as one 16-byte vector (bf16), so the PTX holds 128-bit
global loads/stores (`ld.global.v4` / `st.global.v4`).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from fla_cula.jit import KernelSpec, get_compiled, register_kernel

_THREADS = 128
# 128-bit global accesses, as PTX spells them (4 x 32-bit or 2 x 64-bit vectors)
LDG128 = r"ld\.global(\.\w+)*\.v(4\.[bfsu]32|2\.[bfsu]64)"
STG128 = r"st\.global(\.\w+)*\.v(4\.[bfsu]32|2\.[bfsu]64)"


@dataclass(frozen=True)
class ProbeConfig:
    dtype: str = "bfloat16"  # static: element type

    @property
    def vec(self) -> int:  # elements per 16-byte vector
        return 8 if self.dtype == "bfloat16" else 4


class ScaleAdd:
    """Static config + @cute.jit launcher + @cute.kernel body (the layout every kernel follows)."""

    def __init__(self, cfg: ProbeConfig):
        self.cfg = cfg

    def jit_fn(self):
        vec = self.cfg.vec

        @cute.kernel
        def kernel(gx: cute.Tensor, gy: cute.Tensor, a: cutlass.Float32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            # (vec, nvec) view: thread i of the grid owns column i, one 16-byte vector
            tx = cute.zipped_divide(gx, (vec,))
            ty = cute.zipped_divide(gy, (vec,))
            i = bidx * _THREADS + tidx
            if i < cute.size(tx, mode=[1]):
                rx = cute.make_rmem_tensor((vec,), gx.element_type)
                ry = cute.make_rmem_tensor((vec,), gy.element_type)
                cute.autovec_copy(tx[None, i], rx)
                cute.autovec_copy(ty[None, i], ry)
                r = a * rx.load().to(cutlass.Float32) + ry.load().to(cutlass.Float32)
                ry.store(r.to(gy.element_type))
                cute.autovec_copy(ry, ty[None, i])

        @cute.jit
        def launch(gx: cute.Tensor, gy: cute.Tensor, a: cutlass.Float32, stream):
            nvec = cute.size(gx) // vec
            kernel(gx, gy, a).launch(grid=[(nvec + _THREADS - 1) // _THREADS, 1, 1],
                                     block=[_THREADS, 1, 1], stream=stream)

        return launch

    def spec(self) -> KernelSpec:
        def build():
            dt = cutlass.BFloat16 if self.cfg.dtype == "bfloat16" else cutlass.Float32
            n = cute.sym_int32(divisibility=self.cfg.vec)  # symbolic length
            x = make_fake_compact_tensor(dt, (n,), assumed_align=16)
            y = make_fake_compact_tensor(dt, (n,), assumed_align=16)
            return self.jit_fn(), (x, y, cutlass.Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))

        return KernelSpec("probe_scale_add", (("dtype", self.cfg.dtype),), build,
                          expect_ptx=(LDG128, STG128))


@register_kernel("probe_scale_add")
def _specs() -> list[KernelSpec]:
    return [ScaleAdd(ProbeConfig(d)).spec() for d in ("bfloat16", "float32")]


def scale_add_(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    """y += a * x in place on y's device and current stream. Validates; needs a CUDA SM90 GPU."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(f"expected tensors, got {type(x).__name__} and {type(y).__name__}")
    if x.dtype != y.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"expected matching bfloat16/float32 tensors, got {x.dtype} and {y.dtype}")
    cfg = ProbeConfig("bfloat16" if x.dtype == torch.bfloat16 else "float32")
    if x.shape != y.shape or x.ndim != 1 or x.numel() % cfg.vec:
        raise ValueError(f"expected 1-D tensors of equal length divisible by {cfg.vec}, got "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if not (x.is_contiguous() and y.is_contiguous()) or x.data_ptr() % 16 or y.data_ptr() % 16:
        raise ValueError("expected contiguous, 16-byte aligned tensors")
    if x.device.type != "cuda" or y.device != x.device:
        raise ValueError(f"expected CUDA tensors on one device, got {x.device} and {y.device}")
    fn = get_compiled(ScaleAdd(cfg).spec())
    with torch.cuda.device(x.device):
        fn(x, y, a)
    return y
