"""Traced PTX of the spec's transcendental chain: ``exp_rn``, ``sigmoid_rn``
and ``silu_rn`` of ``dspark_core.spec.numerics``, bit for bit.

Each FP32 operation has an explicit ``.rn`` and no ``.ftz``, so nothing is
contracted into an FMA, flushed or approximated:

- ``exp_rn(x)``: one asm block per value, in the spec's order:

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
- ``sigmoid_rn(x)``: ``div.rn(1, add.rn(1, exp_rn(neg(x))))`` (``neg.f32``
  is exact; the spec's ``1.0 / t`` is torch's ``reciprocal(t) * 1.0``, a
  correctly rounded reciprocal times one: the same bits as ``div.rn``);
- ``silu_rn(x)``: ``mul.rn(x, sigmoid_rn(x))``.
"""

from __future__ import annotations

from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from dspark_core.spec import numerics as spec

from .arith import add_rn, div_rn, f32_bits, f32_const, mul_rn, neg_f32
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


def sigmoid_rn(x) -> Float32:
    """``dspark_core.spec.numerics.sigmoid_rn``: ``1 / (1 + exp_rn(-x))``, the
    negation exact, the sum and the quotient each rounded once."""
    one = f32_const(1.0)
    return div_rn(one, add_rn(one, exp_rn(neg_f32(x))))


def silu_rn(x) -> Float32:
    """``dspark_core.spec.numerics.silu_rn``: ``x * sigmoid_rn(x)``, rounded once."""
    return mul_rn(x, sigmoid_rn(x))


__all__ = ["EXP_BITS", "exp_rn", "sigmoid_rn", "silu_rn"]
