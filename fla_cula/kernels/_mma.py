# CuTe DSL evaluates annotations at trace time: no `from __future__ import annotations` here.
"""Warp-level TF32 tensor-core MMAs (mma.sync, SM80+) on explicit per-lane fragments, and the 3xTF32
split that gives them float32 accuracy.

The fragments are the PTX ISA's (lane = 4 g + t, g = groupID, t = threadID_in_group):

  m16n8k8  A (16 x 8, row):  a0 (g, t)   a1 (g+8, t)   a2 (g, t+4)   a3 (g+8, t+4)
           B (8 x 8, col):   b0 (t, g)   b1 (t+4, g)
           C/D (16 x 8):     c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)
  m16n8k4  A (16 x 4):       a0 (g, t)   a1 (g+8, t)
           B (4 x 8):        b0 (t, g)
           C/D as above.

3xTF32: x = hi + lo with hi = x with its 13 low mantissa bits cleared (exact split: lo = x - hi is a
float32); a product x y is taken as hi_x hi_y + lo_x hi_y + hi_x lo_y. TF32 operands keep 10 explicit
mantissa bits and the tensor core ignores the low 13 bits of each 32-bit register, so lo is truncated
there: the dropped terms are below 2^-20 |x y| (float32 rounding is 2^-24).
"""

from cutlass import Float32, Int32
from cutlass._mlir.dialects import arith, llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_HI_MASK = -8192  # 0xFFFFE000 as int32: sign, exponent and the 10 TF32 mantissa bits


@dsl_user_op
def tf32_split(x, *, loc=None, ip=None):
    """(hi, lo) of a float32 as TF32 operand registers (Int32 bit patterns), x == hi + lo exactly."""
    xv = Float32(x).ir_value(loc=loc, ip=ip)
    bits = llvm.bitcast(T.i32(), xv, loc=loc, ip=ip)
    hi = arith.andi(bits, Int32(_HI_MASK).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    lo = arith.subf(xv, llvm.bitcast(T.f32(), hi, loc=loc, ip=ip), loc=loc, ip=ip)
    return Int32(hi), Int32(llvm.bitcast(T.i32(), lo, loc=loc, ip=ip))


def _mma(shape, a, b, c, loc, ip):
    na, nb = len(a), len(b)
    regs = ",".join(f"${i}" for i in range(4))
    ra = ",".join(f"${4 + i}" for i in range(na))
    rb = ",".join(f"${4 + na + i}" for i in range(nb))
    rc = ",".join(f"${4 + na + nb + i}" for i in range(4))
    asm = (f"mma.sync.aligned.{shape}.row.col.f32.tf32.tf32.f32 "
           f"{{{regs}}}, {{{ra}}}, {{{rb}}}, {{{rc}}};")
    cons = ",".join(["=f"] * 4 + ["r"] * (na + nb) + ["f"] * 4)
    ops = ([Int32(x).ir_value(loc=loc, ip=ip) for x in (*a, *b)]
           + [Float32(x).ir_value(loc=loc, ip=ip) for x in c])
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * 4), ops, asm, cons,
                          has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def mma_m16n8k8_tf32(a, b, c, *, loc=None, ip=None):
    """d = A B + C for one m16n8k8 tile: a = 4 TF32 registers, b = 2, c = 4 float32; returns d (4)."""
    return _mma("m16n8k8", a, b, c, loc, ip)


@dsl_user_op
def mma_m16n8k4_tf32(a, b, c, *, loc=None, ip=None):
    """d = A B + C for one m16n8k4 tile: a = 2 TF32 registers, b = 1, c = 4 float32; returns d (4)."""
    return _mma("m16n8k4", a, b, c, loc, ip)


def mma3_m16n8k8(a_hi, a_lo, b_hi, b_lo, c):
    """3xTF32 m16n8k8: A B + C with float32-class accuracy (the small terms first)."""
    d = mma_m16n8k8_tf32(a_lo, b_hi, c)
    d = mma_m16n8k8_tf32(a_hi, b_lo, d)
    return mma_m16n8k8_tf32(a_hi, b_hi, d)


def mma3_m16n8k4(a_hi, a_lo, b_hi, b_lo, c):
    """3xTF32 m16n8k4."""
    d = mma_m16n8k4_tf32(a_lo, b_hi, c)
    d = mma_m16n8k4_tf32(a_hi, b_lo, d)
    return mma_m16n8k4_tf32(a_hi, b_hi, d)


__all__ = ["mma3_m16n8k4", "mma3_m16n8k8", "mma_m16n8k4_tf32", "mma_m16n8k8_tf32", "tf32_split"]
