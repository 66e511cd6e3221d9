# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""FLA's `causal_conv1d_update` (the decode step of `ShortConvolution`) on a CuTe DSL kernel.

One token per sequence n, D channels, a depthwise causal convolution of width W (FLA's kernel, same math):
    window[n, d, :] = [cache[n, d, 1:W], x[n, d]]        (the cache shifted left by one, the new token last)
    y[n, d]         = act(sum_w window[n, d, w] weight[d, w] + bias[d]) + residual[n, d]     (fp32; act = silu or none)
    cache[n, d, :]  = window[n, d, :]                      (in place)
y is rounded to x's dtype, the window to the cache's. Layouts (all contiguous, as FLA's kernel indexes them):
x, y and residual [N, D] (or [N, 1, D] / [1, N, D]), cache [N, D, W], weight [D, W], bias [D].

One thread owns 8 consecutive channels of one sequence: its x, y, bias and residual elements and its 8 W cache and
weight elements are contiguous, so every access is a 16-byte vector and a warp's accesses are coalesced. The op is
memory-bound (the cache is read and written once); FLA's Triton kernel takes ~10 us per call at B=128, D=2048, W=4
on the H200 against ~1-2 us for its 4 MB of traffic (docs/model_benchmark.md).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from fla_cula.jit import KernelSpec, register_kernel
from fla_cula.kernels._dsl import DT, assume_align, sigmoid
from fla_cula.kernels._host import FLOAT, I31, aligned, launch
from fla_cula.kernels._tuning import TUNING
from fla_cula.kernels.probe import LDG128, STG128  # 16-byte global loads / stores, as PTX spells them

VEC = 8          # channels per thread
THREADS = 128
MAX_W = 8


@dataclass(frozen=True)
class ConvUpdateConfig:
    """The static specialization: dtypes (bias / residual "none" when absent), silu or none, the width W, and how
    x is shaped: rank 2 ([N, D]) or 3, with the sequences along dim n_dim ([N, 1, D]: 0, [1, N, D]: 1)."""

    x_dtype: str = "bfloat16"
    cache_dtype: str = "bfloat16"
    w_dtype: str = "bfloat16"
    bias_dtype: str = "none"
    res_dtype: str = "none"
    silu: bool = True
    W: int = 4
    x_rank: int = 3
    n_dim: int = 0

    def key(self) -> tuple:
        return tuple(sorted(vars(self).items()))


def make_launcher(cfg: ConvUpdateConfig):
    W, XT, CT = cfg.W, DT[cfg.x_dtype], DT[cfg.cache_dtype]
    HAS_B, HAS_R = cfg.bias_dtype != "none", cfg.res_dtype != "none"

    def row(m: cute.Tensor, n):
        """Row n of an activation tensor as a 1-D (D,) view."""
        if cutlass.const_expr(cfg.x_rank == 2):
            return m[n, None]
        if cutlass.const_expr(cfg.n_dim == 0):
            return m[n, 0, None]
        return m[0, n, None]

    def vec(t: cute.Tensor, j):
        """Elements [8 j, 8 j + 8) of a 1-D row, 16-byte aligned (the host checks it)."""
        return assume_align(cute.local_tile(t, (VEC,), (j,)), 16)

    @cute.kernel
    def conv1d_update_kernel(mX: cute.Tensor, mC: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mR: cute.Tensor,
               mY: cute.Tensor, nvec: Int32, total: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        i = bid * THREADS + tidx
        if i < total:
            n = i // nvec
            j = i - n * nvec
            gx, gy = vec(row(mX, n), j), vec(row(mY, n), j)
            gc = assume_align(cute.local_tile(mC[n, None, None], (VEC, W), (j, 0)), 16)   # (8, W), W contiguous
            gw = assume_align(cute.local_tile(mW, (VEC, W), (j, 0)), 16)
            rx, rc, rw = cute.make_fragment_like(gx), cute.make_fragment_like(gc), cute.make_fragment_like(gw)
            cute.autovec_copy(gx, rx)
            cute.autovec_copy(gc, rc)
            cute.autovec_copy(gw, rw)
            fx = cute.make_rmem_tensor((VEC,), Float32)
            fx.store(rx.load().to(Float32))
            fc = cute.make_fragment_like(rc, Float32)
            fc.store(rc.load().to(Float32))
            fw = cute.make_fragment_like(rw, Float32)
            fw.store(rw.load().to(Float32))
            fy = cute.make_rmem_tensor((VEC,), Float32)
            fn = cute.make_fragment_like(rc, Float32)   # the new window
            for c in cutlass.range_constexpr(VEC):
                for w in cutlass.range_constexpr(W - 1):
                    fn[c, w] = fc[c, w + 1]
                fn[c, W - 1] = fx[c]
                acc = fn[c, 0] * fw[c, 0]
                for w in cutlass.range_constexpr(1, W):
                    acc = acc + fn[c, w] * fw[c, w]
                fy[c] = acc
            if cutlass.const_expr(HAS_B):
                gb = vec(mB, j)
                rb = cute.make_fragment_like(gb)
                cute.autovec_copy(gb, rb)
                fy.store(fy.load() + rb.load().to(Float32))
            if cutlass.const_expr(cfg.silu):
                for c in cutlass.range_constexpr(VEC):
                    fy[c] = fy[c] * sigmoid(fy[c])
            if cutlass.const_expr(HAS_R):
                gr = vec(row(mR, n), j)
                rr = cute.make_fragment_like(gr)
                cute.autovec_copy(gr, rr)
                fy.store(fy.load() + rr.load().to(Float32))
            ry = cute.make_fragment_like(gy)
            ry.store(fy.load().to(XT))
            cute.autovec_copy(ry, gy)
            rc.store(fn.load().to(CT))
            cute.autovec_copy(rc, gc)

    @cute.jit
    def launch_fn(mX: cute.Tensor, mC: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mR: cute.Tensor,
                  mY: cute.Tensor, stream):
        nvec = mC.shape[1] // VEC
        total = mC.shape[0] * nvec
        conv1d_update_kernel(mX, mC, mW, mB, mR, mY, nvec, total).launch(
            grid=[(total + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return launch_fn


def _fake_args(cfg: ConvUpdateConfig):
    """Compact fake tensors with symbolic N and D (D a multiple of 8)."""
    N, D = cute.sym_int32(), cute.sym_int32(divisibility=VEC)

    def act(dtype):
        shape = (N, D) if cfg.x_rank == 2 else ((N, 1, D) if cfg.n_dim == 0 else (1, N, D))
        return make_fake_compact_tensor(DT[dtype], shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                        assumed_align=16, use_32bit_stride=True)

    x, y = act(cfg.x_dtype), act(cfg.x_dtype)
    cache = make_fake_compact_tensor(DT[cfg.cache_dtype], (N, D, cfg.W), stride_order=(2, 1, 0), assumed_align=16,
                                     use_32bit_stride=True)
    w = make_fake_compact_tensor(DT[cfg.w_dtype], (D, cfg.W), stride_order=(1, 0), assumed_align=16,
                                 use_32bit_stride=True)
    b = None if cfg.bias_dtype == "none" else make_fake_compact_tensor(DT[cfg.bias_dtype], (D,), assumed_align=16)
    r = None if cfg.res_dtype == "none" else act(cfg.res_dtype)
    return x, cache, w, b, r, y, make_fake_stream(use_tvm_ffi_env_stream=True)


def spec_of(cfg: ConvUpdateConfig) -> KernelSpec:
    return KernelSpec("conv_update", cfg.key(), lambda: (make_launcher(cfg), _fake_args(cfg)),
                      expect_ptx=(LDG128, STG128))


TUNING.add("conv_update", ConvUpdateConfig, spec_of)


def representative_configs() -> list[ConvUpdateConfig]:
    """What CI compiles for sm_90a: FLA's KDA layer ([B, 1, D] bf16, silu, W 4) and every optional input."""
    C = ConvUpdateConfig
    return [C(), C(x_rank=2), C(x_rank=3, n_dim=1, W=3, silu=False),
            C(x_dtype="float32", cache_dtype="float32", w_dtype="float32", bias_dtype="float32",
              res_dtype="float32", W=2),
            C(x_dtype="float16", cache_dtype="float16", w_dtype="float16", bias_dtype="float16",
              res_dtype="float16")]


@register_kernel("conv_update")
def _specs() -> list[KernelSpec]:
    return [spec_of(c) for c in representative_configs()]


# ---------------------------------------------------------------------------------------------
def _float_reason(name, t) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor"
    if t.dtype not in FLOAT:
        return f"{name} dtype {t.dtype}: kernel supports bf16/fp16/fp32"
    return None


def check(x, cache, residual, weight, bias, activation) -> tuple[str | None, ConvUpdateConfig | None]:
    """(reason the call stays on FLA, None) or (None, config). x is already flattened to [..., D] as FLA does."""
    for name, t in (("x", x), ("cache", cache), ("weight", weight)):
        r = _float_reason(name, t)
        if r:
            return (r if t is not None else f"{name} is None: FLA's kernel without it"), None
    if weight.ndim != 2 or not weight.is_contiguous():
        return f"weight shape {tuple(weight.shape)} strides {weight.stride()}: expected contiguous [D, W]", None
    D, W = weight.shape
    if not 1 <= W <= MAX_W:
        return f"kernel width {W}: kernel supports 1..{MAX_W}", None
    if x.shape[-1] != D or D % VEC:
        return f"x channels {x.shape[-1]}, weight [{D}, {W}]: kernel needs equal channel counts, a multiple of 8", None
    if x.ndim == 2:
        N, n_dim = x.shape[0], 0
    elif x.ndim == 3 and x.shape[0] == 1:
        N, n_dim = x.shape[1], 1
    elif x.ndim == 3 and x.shape[1] == 1:
        N, n_dim = x.shape[0], 0
    else:
        return f"x shape {tuple(x.shape)}: kernel serves [N, D], [N, 1, D] and [1, N, D]", None
    if N < 1:
        return "no sequences", None
    if tuple(cache.shape) != (N, D, W):
        return f"cache shape {tuple(cache.shape)}: expected [{N}, {D}, {W}]", None
    opt = {}
    for name, t, shape in (("bias", bias, (D,)), ("residual", residual, tuple(x.shape))):
        if t is None:
            opt[name] = "none"
            continue
        r = _float_reason(name, t)
        if r:
            return r, None
        if tuple(t.shape) != shape:
            return f"{name} shape {tuple(t.shape)}: expected {list(shape)}", None
        opt[name] = FLOAT[t.dtype]
    dev = x.device
    for name, t in (("x", x), ("cache", cache), ("weight", weight), ("bias", bias), ("residual", residual)):
        if t is None:
            continue
        if t.device != dev:
            return f"{name} on {t.device}, x on {dev}", None
        if not t.is_contiguous():
            return f"{name} not contiguous", None
        if not aligned(t):
            return f"{name} not 16-byte aligned", None
        if t.numel() >= I31:
            return f"{name} has >= 2^31 elements", None
    return None, ConvUpdateConfig(
        x_dtype=FLOAT[x.dtype], cache_dtype=FLOAT[cache.dtype], w_dtype=FLOAT[weight.dtype],
        bias_dtype=opt["bias"], res_dtype=opt["residual"], silu=activation in ("silu", "swish"), W=W,
        x_rank=x.ndim, n_dim=n_dim)


def flat_x(x, weight):
    """FLA's reshape: activations with head dims [B, T, H, Dh] become [B, T, H Dh] when the weight is per channel."""
    if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.ndim >= 1 and x.ndim > 3 \
            and x.shape[-1] != weight.shape[0]:
        return x.reshape(*x.shape[:2], -1)
    return x


def plan(x, cache, residual, weight, bias, activation):
    """check(), then the compiled kernel for this signature: (reason, None), or (None, go) where go(args) runs any
    call with the same signature and returns FLA's (y, cache): y a new tensor of x's shape, cache updated in place."""
    xf = flat_x(x, weight)
    r, cfg = check(xf, cache, residual, weight, bias, activation)
    if r:
        return r, None
    fn = TUNING.get("conv_update", cfg)
    reshape = xf is not x
    dev = x.device

    def go(args):
        """args: (x, cache, residual, weight, bias, activation), as check takes them."""
        x, cache, residual, weight, bias = args[:5]
        xf = x.reshape(*x.shape[:2], -1) if reshape else x
        y = torch.empty_like(xf)
        launch(fn, dev, xf, cache, weight, bias, residual, y)
        return (y.view(x.shape) if reshape else y), cache

    return None, go


def run(x, cache, residual=None, weight=None, bias=None, activation=None):
    """The kernel alone (tests and tools): FLA's causal_conv1d_update arguments; raises where it cannot serve."""
    args = (x, cache, residual, weight, bias, activation)
    r, go = plan(*args)
    if r:
        raise ValueError(f"conv_update: {r}")
    return go(args)
