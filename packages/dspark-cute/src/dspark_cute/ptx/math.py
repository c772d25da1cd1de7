"""Traced PTX of the exponentials: ``exp_rn`` (the reference attention's,
``dspark_core.spec.numerics.exp_rn``) and ``expf`` (CUDA's accurate
``expf``, ``dspark_core.spec.numerics.expf``: the stock activation's), each
bit for bit.

- ``exp_rn(x)``: one asm block per value, every FP32 operation with an
  explicit ``.rn`` and no ``.ftz`` (nothing contracted, flushed or
  approximated), in the spec's order:

  1. the clamp: ``c = x``, then ``-104`` where ``x < -104``, ``88.72283935546875``
     where ``x > 88.72283935546875`` (``setp`` + ``selp``: ordered
     comparisons, false for NaN), then ``0`` where ``x`` is NaN (``min``/``max``
     would turn a NaN into the bound instead: the spec replaces it by 0);
  2. ``n = cvt.rni(mul.rn(c, LOG2E))`` (round half to even);
  3. ``r = sub.rn(sub.rn(c, mul.rn(n, LN2_HI)), mul.rn(n, LN2_LO))``;
  4. Horner: ``p = c6``, then ``p = add.rn(mul.rn(p, r), c_k)`` for
     ``c5 .. c0``;
  5. ``n1 = cvt.rmi(mul.rn(n, 0.5))`` (floor), ``n2 = sub.rn(n, n1)``; each
     ``2**n_i`` built from its bits, ``((int(n_i) + 127) << 23)``
     (``cvt.rzi.s32.f32`` of an integral value, exact); ``p = mul.rn(mul.rn(p,
     2**n1), 2**n2)`` (the second product may round to a subnormal, as the
     spec's does);
  6. the selection after the arithmetic: ``+inf`` where ``x > 88.72...``,
     ``+0.0`` where ``x < -104``, ``x`` itself where ``x`` is NaN.

  The constants are the spec's own (``dspark_core.spec.numerics``) rounded to FP32
  on the host and written as exact hex immediates (``0fXXXXXXXX``).

- ``expf(x)``: one asm block per value, the instruction sequence of
  libdevice's ``__nv_expf`` as CUDA compiles ``expf`` without fast math
  (``__CUDA_FTZ`` 0: what nvcc emits for vLLM's ``silu_kernel``, what NVRTC
  emits for the spec's ``expf`` on CUDA, and what CuTe DSL's
  ``cute.math.exp(x, fastmath=False)`` lowers to), in this order:

  1. ``t = cvt.sat(fma.rn(x, 0x3BBB989D, 0.5))`` (``log2 e / 252``; the
     saturation clamps to [0, 1], a NaN to +0);
  2. ``j = fma.rm(t, 252, 12582913)`` (``floor(252 t)`` in the low
     mantissa bits of ``1.5 * 2^23 + 1``);
  3. ``f = add.rn(j, -12583039)`` (the integer ``k = floor(252 t) - 126``,
     exact), ``u = fma.rn(x, 0x3FB8AA3B, -f)`` then ``u = fma.rn(x,
     0x32A57060, u)`` (``x log2 e - k``, log2 e in two parts);
  4. ``s = bits(j) << 23`` (``2^k``, k in [-126, 126]);
  5. ``e = mul.rn(ex2.approx.ftz(u), s)``.

  The stock kernel has ``1 + expf(-x)`` contracted into step 5 (``fma(s,
  p, 1)``); ``mul.rn`` here keeps ``expf`` a function of its own, and
  ``add.rn(expf(-x), 1)`` gives the same bits: ``s * p`` is exact unless
  it is below 2^-126 (where both sums round to 1) or overflows (both inf).
"""

from __future__ import annotations

from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from dspark_core.spec import numerics as spec

from .arith import f32_bits
from .inline import asm, f32


def _hex(value: float) -> str:
    """The PTX immediate of ``value`` rounded to FP32: ``0fXXXXXXXX``."""
    return f"0f{f32_bits(value):08X}"


# The spec's constants (FP32 bit patterns), read from dspark_core.spec.numerics so
# that the kernel cannot drift from it.
EXP_BITS = {
    "log2e": f32_bits(spec._LOG2E),
    "ln2_hi": f32_bits(spec._LN2_HI),
    "ln2_lo": f32_bits(spec._LN2_LO),
    "overflow": f32_bits(spec.EXP_OVERFLOW),
    "underflow": f32_bits(spec.EXP_UNDERFLOW),
    "coeffs": tuple(f32_bits(c) for c in spec._EXP_COEFFS),
}


def _exp_asm() -> str:
    """The asm text of ``exp_rn`` (module docstring): ``$0`` the result,
    ``$1`` the FP32 argument."""
    lo, hi = _hex(spec.EXP_UNDERFLOW), _hex(spec.EXP_OVERFLOW)
    c = [_hex(v) for v in spec._EXP_COEFFS]
    lines = [
        "{",
        ".reg .f32 c, n, r, p, t, n1, n2;",
        ".reg .b32 e;",
        ".reg .pred under, over, isnan;",
        # 1. the clamp, NaN replaced by 0 (selected by predicates, no min/max).
        f"setp.lt.f32 under, $1, {lo};",
        f"setp.gt.f32 over, $1, {hi};",
        "setp.nan.f32 isnan, $1, $1;",
        f"selp.f32 c, {lo}, $1, under;",
        f"selp.f32 c, {hi}, c, over;",
        "selp.f32 c, 0f00000000, c, isnan;",
        # 2. n = rint(c * log2e), half to even.
        f"mul.rn.f32 t, c, {_hex(spec._LOG2E)};",
        "cvt.rni.f32.f32 n, t;",
        # 3. Cody-Waite: r = (c - n * hi) - n * lo.
        f"mul.rn.f32 t, n, {_hex(spec._LN2_HI)};",
        "sub.rn.f32 r, c, t;",
        f"mul.rn.f32 t, n, {_hex(spec._LN2_LO)};",
        "sub.rn.f32 r, r, t;",
        # 4. Horner from c6: p = p * r + c_k, each rounded.
        f"mov.f32 p, {c[0]};",
    ]
    for ck in c[1:]:
        lines += ["mul.rn.f32 p, p, r;", f"add.rn.f32 p, p, {ck};"]
    lines += [
        # 5. n1 = floor(n / 2), n2 = n - n1; p * 2^n1 * 2^n2 (2^k from its bits).
        "mul.rn.f32 t, n, 0f3F000000;",
        "cvt.rmi.f32.f32 n1, t;",
        "sub.rn.f32 n2, n, n1;",
        "cvt.rzi.s32.f32 e, n1;",
        "add.s32 e, e, 127;",
        "shl.b32 e, e, 23;",
        "mov.b32 t, e;",
        "mul.rn.f32 p, p, t;",
        "cvt.rzi.s32.f32 e, n2;",
        "add.s32 e, e, 127;",
        "shl.b32 e, e, 23;",
        "mov.b32 t, e;",
        "mul.rn.f32 p, p, t;",
        # 6. the selection after the arithmetic.
        "selp.f32 p, 0f7F800000, p, over;",
        "selp.f32 p, 0f00000000, p, under;",
        "selp.f32 $0, $1, p, isnan;",
        "}",
    ]
    return " ".join(lines)


_EXP_ASM = _exp_asm()


@dsl_user_op
def exp_rn(x, *, loc=None, ip=None) -> Float32:
    """``dspark_core.spec.numerics.exp_rn(x)`` of FP32 ``x`` (module docstring)."""
    return Float32(asm(T.f32(), [f32(x, loc, ip)], _EXP_ASM, "=f,f", False, loc, ip))


# CUDA's expf (libdevice __nv_expf without FTZ): its constants' FP32 bits.
EXPF_BITS = {
    "log2e_252": 0x3BBB989D,  # log2(e) / 252
    "half": 0x3F000000,  # 0.5
    "scale": 0x437C0000,  # 252.0
    "magic": 0x4B400001,  # 12582913.0 = 1.5 * 2^23 + 1
    "unbias": 0xCB40007F,  # -12583039.0 = -(1.5 * 2^23 + 127)
    "log2e_hi": 0x3FB8AA3B,  # log2(e) rounded to FP32
    "log2e_lo": 0x32A57060,  # log2(e) - log2e_hi
}

# (The PTX of __nv_expf, with explicit .rn on the add and the final product.)
_EXPF_ASM = " ".join([
    "{",
    ".reg .f32 t, j, f, u, p, s;",
    ".reg .b32 b;",
    f"fma.rn.f32 t, $1, 0f{EXPF_BITS['log2e_252']:08X}, 0f{EXPF_BITS['half']:08X};",
    "cvt.sat.f32.f32 t, t;",
    f"fma.rm.f32 j, t, 0f{EXPF_BITS['scale']:08X}, 0f{EXPF_BITS['magic']:08X};",
    f"add.rn.f32 f, j, 0f{EXPF_BITS['unbias']:08X};",
    "neg.f32 f, f;",
    f"fma.rn.f32 u, $1, 0f{EXPF_BITS['log2e_hi']:08X}, f;",
    f"fma.rn.f32 u, $1, 0f{EXPF_BITS['log2e_lo']:08X}, u;",
    "mov.b32 b, j;",
    "shl.b32 b, b, 23;",
    "mov.b32 s, b;",
    "ex2.approx.ftz.f32 p, u;",
    "mul.rn.f32 $0, p, s;",
    "}",
])


@dsl_user_op
def expf(x, *, loc=None, ip=None) -> Float32:
    """CUDA's accurate ``expf(x)`` of FP32 ``x``
    (``dspark_core.spec.numerics.expf`` on CUDA; module docstring)."""
    return Float32(asm(T.f32(), [f32(x, loc, ip)], _EXPF_ASM, "=f,f", False, loc, ip))


__all__ = ["EXPF_BITS", "EXP_BITS", "exp_rn", "expf"]
