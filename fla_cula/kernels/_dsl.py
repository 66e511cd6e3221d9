# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""CuTe DSL device helpers shared by the decode kernels (recurrent_decode, recurrent_decode_mma).

- `fexp`, `sigmoid`: exp through ex2.approx and the logistic built on it.
- `make_decay(cfg)`, `make_seq_span(cfg)`: per-config device functions for the KDA gate and a
  sequence's token range (cu_seqlens values clamped, never trusted).
- `assume_align`, `vec4`: vector views of global / shared memory with a declared alignment.
- `decode_fake_args(cfg)`: the compile signature (fake tensors, symbolic sizes) both kernels take.

A config here is anything with DecodeConfig's dtype / optional-input field names (mode, K, V,
state_v_first, *_dtype, has_h0, has_ht, varlen, pool, spec, gate_in_kernel, has_A, has_bias,
has_lower_bound).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

DT = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
}


def fexp(x):
    """exp(x) through ex2.approx (fast path; x <= 0 for decays)."""
    return cute.math.exp2(x * LOG2E, fastmath=True)


def sigmoid(x):
    return Float32(1.0) / (Float32(1.0) + fexp(-x))


def make_decay(cfg):
    """decay(g, dt_bias, exp(A_log), lower_bound) -> exp(a) of one K position, for a config's gate:
    precomputed log decay g, or FLA's in-kernel gate on g + dt_bias (softplus form, or lower_bound x
    sigmoid)."""
    f32 = Float32

    @cute.jit
    def decay(gi, bi, aexp, lower_bound):
        """exp(gate) of one K position: precomputed g, or computed in kernel from g + dt_bias."""
        if cutlass.const_expr(cfg.gate_in_kernel):
            gi = gi + bi
            if cutlass.const_expr(cfg.has_lower_bound):
                gi = lower_bound * sigmoid(aexp * gi)
            else:
                sp = gi
                if gi <= f32(20.0):  # FLA's softplus threshold
                    sp = cute.math.log2(f32(1.0) + fexp(gi), fastmath=True) * LN2
                gi = -aexp * sp
        return fexp(gi)

    return decay


def make_seq_span(cfg):
    """seq_span(mQ, mCu, n) -> (batch row b, first token bos, length Tn) of sequence n; varlen
    cu_seqlens values are clamped to the token range (never trusted, no host sync)."""

    @cute.jit
    def seq_span(mQ: cute.Tensor, mCu: cute.Tensor, n):
        Ttot = mQ.shape[1]
        b = n
        bos = Int32(0)
        Tn = Ttot
        if cutlass.const_expr(cfg.varlen):
            b = Int32(0)
            s0 = Int32(mCu[n])
            s1 = Int32(mCu[n + 1])
            s0 = cutlass.max(cutlass.min(s0, Ttot), Int32(0))
            s1 = cutlass.max(cutlass.min(s1, Ttot), s0)
            bos = s0
            Tn = s1 - s0
        return b, bos, Tn

    return seq_span


def assume_align(t, nbytes):
    """The same tensor with its pointer declared `nbytes`-aligned (the host checks guarantee it:
    16-byte aligned bases, strides that are multiples of the vector)."""
    p = t.iterator
    return cute.make_tensor(cute.make_ptr(t.element_type, p.toint(), p.memspace,
                                          assumed_align=nbytes), t.layout)


def vec4(row, i):
    """Elements [4i, 4i+4) of a 1-D row as one aligned vector view."""
    tile = cute.local_tile(row, (4,), (i,))
    return assume_align(tile, min(16, 4 * row.element_type.width // 8))


def _rm(dtype, shape, assumed_align=None):
    """Row-major (last dim contiguous) fake tensor; 32-bit strides (the host checks numel < 2^31)."""
    n = len(shape)
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(n - 1, -1, -1)),
                                    assumed_align=assumed_align, use_32bit_stride=True)


def decode_fake_args(c):
    """Fake tensors with symbolic sizes: the compile signature of a decode kernel (the 13 tensors, scale,
    lower_bound, stream) for a config with DecodeConfig's dtype / optional-input fields."""
    K, V = c.K, c.V
    B = cute.sym_int32()
    T = cute.sym_int32()
    H = cute.sym_int32()
    HV = cute.sym_int32()
    dt = DT
    q = _rm(dt[c.qk_dtype], (B, T, H, K), assumed_align=16)
    k = _rm(dt[c.qk_dtype], (B, T, H, K), assumed_align=16)
    if c.mode == "kda":
        v = _rm(dt[c.v_dtype], (B, T, HV, V), assumed_align=16)
        o = _rm(dt[c.o_dtype], (B, T, HV, V), assumed_align=16)
        g = _rm(dt[c.g_dtype], (B, T, HV, K), assumed_align=16)
        beta = _rm(dt[c.beta_dtype], (B, T, HV))
    else:
        v = _rm(dt[c.v_dtype], (B, T, H, V), assumed_align=16)
        o = _rm(dt[c.o_dtype], (B, T, H, V), assumed_align=16)
        g = _rm(cutlass.Float32, (H,))   # g_gamma [H] fp32
        beta = None
    A = dt_bias = None
    if c.mode == "kda" and c.gate_in_kernel:
        if c.has_A:
            A = _rm(dt[c.a_dtype], (HV,))
        if c.has_bias:
            dt_bias = _rm(dt[c.bias_dtype], (cute.sym_int32(divisibility=K),), assumed_align=16)
    inner = (V, K) if c.state_v_first else (K, V)
    h0 = ht = None
    if c.has_h0:
        P = cute.sym_int32()
        sp = cute.sym_int64(divisibility=4)
        h0 = make_fake_tensor(cutlass.Float32, (P, HV, *inner), (sp, K * V, inner[1], 1),
                              assumed_align=16)
    if c.pool == 0 and c.has_ht:
        NS = cute.sym_int32()
        ht = make_fake_tensor(cutlass.Float32, (NS, HV, *inner),
                              (cute.sym_int64(divisibility=4), K * V, inner[1], 1),
                              assumed_align=16)
    cu = _rm(dt[c.cu_dtype], (cute.sym_int32(),)) if c.varlen else None
    idx = na = None
    if c.pool == 1:
        idx = _rm(dt[c.idx_dtype], (cute.sym_int32(),))
    elif c.pool == 2:
        idx = make_fake_tensor(dt[c.idx_dtype], (cute.sym_int32(), cute.sym_int32()),
                               (cute.sym_int32(), 1))
    if c.pool and c.spec:
        na = _rm(dt[c.na_dtype], (cute.sym_int32(),))
    return (q, k, v, g, beta, A, dt_bias, h0, ht, o, cu, idx, na,
            Float32(1.0), Float32(-1.0), make_fake_stream(use_tvm_ffi_env_stream=True))
