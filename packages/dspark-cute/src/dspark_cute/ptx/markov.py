"""The Markov step's primitives (``dspark_cute.cutedsl.markov``): CUDA's
accurate ``tanhf``, the argmax keys and the grid-wide reduction's atomics.

An argmax key is a 64-bit unsigned integer whose maximum over a row is
ATen's CUDA argmax (``dspark_core.spec.markov.argmax``): the high word orders
the values (NaN above +inf, -0.0 read as +0.0, so the two tie), the low word
is the column's complement, so of equal values the lower column is larger.
The order is total, so any reduction tree gives the same key."""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline import asm, f32, i32, i64, u32

# CUDA 13's tanhf (spec.markov.tanhf, its constants' bit patterns there): every
# operation with an explicit rounding so that ptxas contracts nothing.
_TANHF = (
    "{ .reg .pred p1, p2; .reg .f32 a, t, r, big, q, p, small;"
    " abs.f32 a, $1;"
    " mul.rn.f32 t, a, 0f4038AA3B;"
    " ex2.approx.ftz.f32 t, t;"
    " add.rn.f32 t, t, 0f3F800000;"
    " rcp.approx.ftz.f32 r, t;"
    " fma.rn.f32 big, r, 0fC0000000, 0f3F800000;"
    " setp.ge.f32 p1, a, 0f41102CB4;"
    " selp.f32 big, 0f3F800000, big, p1;"
    " copysign.f32 big, $1, big;"
    " mul.rn.f32 q, $1, $1;"
    " fma.rn.f32 p, 0f3C80F082, q, 0fBD563CAE;"
    " fma.rn.f32 p, p, q, 0f3E085941;"
    " fma.rn.f32 p, p, q, 0fBEAAA9ED;"
    " fma.rn.f32 p, p, q, 0f00000000;"
    " fma.rn.f32 small, p, $1, $1;"
    " setp.ge.f32 p2, a, 0f3F19999A;"
    " selp.f32 $0, big, small, p2; }"
)


@dsl_user_op
def tanhf(x, *, loc=None, ip=None) -> Float32:
    """CUDA's accurate ``tanhf`` of FP32 ``x`` (``torch.tanh`` on CUDA), the
    instruction sequence of ``dspark_core.spec.markov.tanhf``."""
    return Float32(asm(T.f32(), [f32(x, loc, ip)], _TANHF, "=f,f", False, loc, ip))


@dsl_user_op
def argmax_key(value, column, *, loc=None, ip=None) -> Int64:
    """The key of FP32 ``value`` at ``column`` (Int32, non-negative):
    high word ``0xFFFFFFFF`` for NaN, else the value's bits (``-0.0`` as
    ``+0.0``) with the sign bit set for a positive value and every bit
    flipped for a negative one; low word ``~column``."""
    return Int64(asm(
        T.i64(), [f32(value, loc, ip), i32(column, loc, ip)],
        "{ .reg .pred pz, pn; .reg .b32 b, m, lo;"
        " mov.b32 b, $1;"
        " setp.eq.b32 pz, b, 0x80000000; selp.b32 b, 0, b, pz;"
        " shr.s32 m, b, 31; or.b32 m, m, 0x80000000; xor.b32 b, b, m;"
        " setp.nan.f32 pn, $1, $1; selp.b32 b, 0xFFFFFFFF, b, pn;"
        " not.b32 lo, $2;"
        " mov.b64 $0, {lo, b}; }",
        "=l,f,r", False, loc, ip,
    ))


@dsl_user_op
def max_u64(a, b, *, loc=None, ip=None) -> Int64:
    """The larger of two keys (``max.u64``)."""
    return Int64(asm(T.i64(), [i64(a, loc, ip), i64(b, loc, ip)], "max.u64 $0, $1, $2;", "=l,l,l", False, loc, ip))


@dsl_user_op
def key_column(key, *, loc=None, ip=None) -> Int32:
    """The column of a key (the complement of its low word)."""
    return Int32(asm(T.i32(), [i64(key, loc, ip)], "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; not.b32 $0, lo; }",
                     "=r,l", False, loc, ip))


@dsl_user_op
def warp_key_max(key, *, loc=None, ip=None) -> Int64:
    """The warp's largest key in every lane (``shfl.sync.bfly`` of both
    words with offsets 16, 8, 4, 2, 1, ``max.u64`` after each)."""
    text = "{ .reg .b32 lo, hi, slo, shi; .reg .b64 k, o; mov.b64 k, $1;"
    for offset in (16, 8, 4, 2, 1):
        text += (f" mov.b64 {{lo, hi}}, k; shfl.sync.bfly.b32 slo, lo, {offset}, 0x1f, 0xffffffff;"
                 f" shfl.sync.bfly.b32 shi, hi, {offset}, 0x1f, 0xffffffff; mov.b64 o, {{slo, shi}}; max.u64 k, k, o;")
    text += " mov.b64 $0, k; }"
    return Int64(asm(T.i64(), [i64(key, loc, ip)], text, "=l,l", True, loc, ip))


@dsl_user_op
def red_max_u64(addr, key, *, loc=None, ip=None) -> None:
    """``red.relaxed.gpu.global.max.u64 [addr], key``."""
    asm(None, [i64(addr, loc, ip), i64(key, loc, ip)], "red.relaxed.gpu.global.max.u64 [$0], $1;", "l,l", True,
        loc, ip)


@dsl_user_op
def fence_acq_rel_gpu(*, loc=None, ip=None) -> None:
    """``fence.acq_rel.gpu``: this thread's memory operations before it are
    ordered before those after it at GPU scope."""
    asm(None, [], "fence.acq_rel.gpu;", "", True, loc, ip)


@dsl_user_op
def atom_add_acq_rel_u32(addr, value, *, loc=None, ip=None) -> Uint32:
    """``atom.acq_rel.gpu.global.add.u32``: the old value."""
    return Uint32(asm(T.i32(), [i64(addr, loc, ip), u32(value, loc, ip)],
                      "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r", True, loc, ip))


@dsl_user_op
def atom_exch_u64(addr, value, *, loc=None, ip=None) -> Int64:
    """``atom.relaxed.gpu.global.exch.b64``: the old value; ``value`` stays."""
    return Int64(asm(T.i64(), [i64(addr, loc, ip), i64(value, loc, ip)],
                     "atom.relaxed.gpu.global.exch.b64 $0, [$1], $2;", "=l,l,l", True, loc, ip))


@dsl_user_op
def st_global_b64(addr, value, *, loc=None, ip=None) -> None:
    """Store the 64-bit ``value`` at the 8-byte aligned global ``addr``."""
    asm(None, [i64(addr, loc, ip), i64(value, loc, ip)], "st.global.b64 [$0], $1;", "l,l", True, loc, ip)


__all__ = ["argmax_key", "atom_add_acq_rel_u32", "atom_exch_u64", "fence_acq_rel_gpu", "key_column", "max_u64",
           "red_max_u64", "st_global_b64", "tanhf", "warp_key_max"]
