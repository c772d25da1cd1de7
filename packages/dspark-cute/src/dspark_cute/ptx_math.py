"""Traced PTX of the spec's transcendental chain: ``exp_rn``, ``sigmoid_rn``
and ``silu_rn`` of ``dspark_core.spec.numerics``, bit for bit.

Like ``dspark_cute.ptx``, every helper emits inline PTX while a kernel is
traced, each FP32 operation with an explicit ``.rn`` and without ``.ftz``, so
nothing is contracted into an FMA, flushed or approximated:

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

API summary (all traced): ``neg_f32``, ``exp_rn``, ``sigmoid_rn``,
``silu_rn``; the elementwise kernels' head and tail: ``vector_index`` (a
thread's 16-byte vector, row and column) and ``st_global_v4_if`` (a 16-byte
store guarded by an index); on the host, ``EXP_BITS``: the FP32 bit patterns
of the constants.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from dspark_core.spec import numerics as spec
from dspark_cute import ptx
from dspark_cute.ptx import _asm, _f


def _hex(value: float) -> str:
    """The PTX immediate of ``value`` rounded to FP32: ``0fXXXXXXXX``."""
    return f"0f{ptx.f32_bits(value):08X}"


# The spec's constants (FP32 bit patterns), read from dspark_core.spec.numerics so
# that the kernel cannot drift from it.
EXP_BITS = {
    "log2e": ptx.f32_bits(spec._LOG2E),
    "ln2_hi": ptx.f32_bits(spec._LN2_HI),
    "ln2_lo": ptx.f32_bits(spec._LN2_LO),
    "overflow": ptx.f32_bits(spec.EXP_OVERFLOW),
    "underflow": ptx.f32_bits(spec.EXP_UNDERFLOW),
    "coeffs": tuple(ptx.f32_bits(c) for c in spec._EXP_COEFFS),
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
def neg_f32(a, *, loc=None, ip=None) -> Float32:
    """``-a`` (``neg.f32``: the sign bit flipped, exact; subnormals kept)."""
    return Float32(_asm(T.f32(), [_f(a, loc, ip)], "neg.f32 $0, $1;", "=f,f", False, loc, ip))


@dsl_user_op
def exp_rn(x, *, loc=None, ip=None) -> Float32:
    """``dspark_core.spec.numerics.exp_rn(x)`` of FP32 ``x`` (module docstring)."""
    return Float32(_asm(T.f32(), [_f(x, loc, ip)], _EXP_ASM, "=f,f", False, loc, ip))


def sigmoid_rn(x) -> Float32:
    """``dspark_core.spec.numerics.sigmoid_rn``: ``1 / (1 + exp_rn(-x))``, the
    negation exact, the sum and the quotient each rounded once."""
    one = ptx.f32_const(1.0)
    return ptx.div_rn(one, ptx.add_rn(one, exp_rn(neg_f32(x))))


def silu_rn(x) -> Float32:
    """``dspark_core.spec.numerics.silu_rn``: ``x * sigmoid_rn(x)``, rounded once."""
    return ptx.mul_rn(x, sigmoid_rn(x))


# ---------------------------------------------------------------- the elementwise kernels' head and tail


def vector_index(tidx, cta, m, vecs: int, threads: int) -> tuple:
    """The vector a thread of a 1-D grid of ``threads``-thread CTAs handles,
    over ``m`` rows of ``vecs`` vectors each: ``total = m * vecs``, ``v =
    cta * threads + tidx``, ``vc = min(v, total - 1)`` (past the end the
    last vector again, in bounds; its store is to be guarded by ``v <
    total``), ``row = vc // vecs`` (unsigned), ``col = vc - row * vecs``; all
    Int32. Returns ``(v, vc, row, col, total)``."""
    total = Int32(m) * vecs
    v = Int32(cta) * threads + Int32(tidx)
    vc = cutlass.min(v, total - 1)
    # (Unsigned: vc >= 0, so a plain division by the constant, no floor fix-up.)
    row = Int32(Uint32(vc) // vecs)
    col = vc - row * vecs
    return v, vc, row, col, total


@dsl_user_op
def st_global_v4_if(addr, words, index, limit, *, loc=None, ip=None) -> None:
    """Store four 32-bit words at the 16-byte aligned global byte address
    ``addr`` (one ``st.global.v4.b32``) if ``index < limit`` (Int32, signed):
    the elementwise kernels' tail guard. A predicated store, not a branch, so
    every thread of a warp stays converged (the o-gate's shuffles need all
    32 lanes)."""
    _asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)]
        + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words]
        + [Int32(index).ir_value(loc=loc, ip=ip), Int32(limit).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; setp.lt.s32 p, $5, $6; @p st.global.v4.b32 [$0], {$1, $2, $3, $4}; }",
        "l,r,r,r,r,r,r",
        True,
        loc,
        ip,
    )


__all__ = ["EXP_BITS", "exp_rn", "neg_f32", "sigmoid_rn", "silu_rn", "st_global_v4_if", "vector_index"]
