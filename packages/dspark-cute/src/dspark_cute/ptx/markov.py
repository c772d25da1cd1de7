"""The Markov step's primitives (``dspark_cute.cutedsl.markov``): CUDA's
accurate ``tanhf``, the argmax keys, the grid-wide reduction's atomics, the
persistent loop's grid barrier, and vLLM's Gumbel noise as Triton 3.8 compiles it
(``dspark_core.spec.gumbel``: the MurmurHash3 uniform, ``_log1p_neg_stable``,
libdevice's ``.ftz`` ``logf``, ``div.full``).

An argmax key is a 64-bit unsigned integer whose maximum over a row is
ATen's CUDA argmax (``dspark_core.spec.markov.argmax``): the high word orders
the values (NaN above +inf, -0.0 read as +0.0, so the two tie), the low word
is the column's complement, so of equal values the lower column is larger.
The order is total, so any reduction tree gives the same key."""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from .arith import f32_bits
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


_ARGMAX_KEY = (
    "{ .reg .pred pz, pn; .reg .b32 b, m, lo;"
    " mov.b32 b, $1;"
    " setp.eq.b32 pz, b, 0x80000000; selp.b32 b, 0, b, pz;"
    " shr.s32 m, b, 31; or.b32 m, m, 0x80000000; xor.b32 b, b, m;"
    " setp.nan.f32 pn, $1, $1; selp.b32 b, 0xFFFFFFFF, b, pn;"
    " not.b32 lo, $2;"
    " mov.b64 $0, {lo, b}; }"
)


@dsl_user_op
def argmax_key(value, column, *, loc=None, ip=None) -> Int64:
    """The key of FP32 ``value`` at ``column`` (Int32, non-negative):
    high word ``0xFFFFFFFF`` for NaN, else the value's bits (``-0.0`` as
    ``+0.0``) with the sign bit set for a positive value and every bit
    flipped for a negative one; low word ``~column``."""
    return Int64(asm(T.i64(), [f32(value, loc, ip), i32(column, loc, ip)], _ARGMAX_KEY, "=l,f,r", False, loc, ip))


@dsl_user_op
def max_u64(a, b, *, loc=None, ip=None) -> Int64:
    """The larger of two keys (``max.u64``)."""
    return Int64(asm(T.i64(), [i64(a, loc, ip), i64(b, loc, ip)], "max.u64 $0, $1, $2;", "=l,l,l", False, loc, ip))


@dsl_user_op
def key_below(key, a, b, *, loc=None, ip=None) -> Int64:
    """``key`` where ``a < b`` (Int32), else 0: below every key."""
    return Int64(asm(T.i64(), [i64(key, loc, ip), i32(a, loc, ip), i32(b, loc, ip)],
                     "{ .reg .pred p; setp.lt.s32 p, $2, $3; selp.b64 $0, $1, 0, p; }", "=l,l,r,r", False, loc, ip))


@dsl_user_op
def key_column(key, *, loc=None, ip=None) -> Int32:
    """The column of a key (the complement of its low word)."""
    return Int32(asm(T.i32(), [i64(key, loc, ip)], "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; not.b32 $0, lo; }",
                     "=r,l", False, loc, ip))


@dsl_user_op
def warp_key_max(key, offsets: tuple = (16, 8, 4, 2, 1), *, loc=None, ip=None) -> Int64:
    """The warp's largest key in every lane (``shfl.sync.bfly`` of both
    words with offsets 16, 8, 4, 2, 1, ``max.u64`` after each); with other
    ``offsets``, the largest over the lanes those butterflies join (16, 8,
    4: the lanes of equal ``lane & 3``)."""
    text = "{ .reg .b32 lo, hi, slo, shi; .reg .b64 k, o; mov.b64 k, $1;"
    for offset in offsets:
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


@dsl_user_op
def ld_relaxed_u64(addr, *, loc=None, ip=None) -> Int64:
    """``ld.relaxed.gpu.global.b64``: a word other CTAs fold into (never a
    stale L1 line)."""
    return Int64(asm(T.i64(), [i64(addr, loc, ip)], "ld.relaxed.gpu.global.b64 $0, [$1];", "=l,l", True, loc, ip))


@dsl_user_op
def grid_arrive_wait(addr, target, limit, *, loc=None, ip=None) -> None:
    """One thread's part of a grid barrier on the counter at ``addr``:
    ``red.release.gpu.add.u32`` of 1, then ``ld.acquire.gpu`` of the counter
    again and again until it is at least ``target`` (the CTAs that have
    arrived so far: all of them at this barrier), or until ``%globaltimer``
    reaches ``limit``; there ``trap`` ends the grid with a CUDA error instead
    of a hang (a barrier whose CTAs are not all resident: a cooperative
    launch rules that out)."""
    text = (
        "{\n.reg .pred p, q;\n.reg .u32 c;\n.reg .u64 t;\n"
        "red.release.gpu.global.add.u32 [$0], 1;\n"
        "SPIN:\nld.acquire.gpu.global.u32 c, [$0];\nsetp.ge.u32 p, c, $1;\n@p bra DONE;\n"
        "mov.u64 t, %globaltimer;\nsetp.lt.u64 q, t, $2;\n@q bra SPIN;\ntrap;\nDONE:\n}"
    )
    asm(None, [i64(addr, loc, ip), u32(target, loc, ip), i64(limit, loc, ip)], text, "l,r,l", True, loc, ip)


def _mix(h: str, key: str) -> str:
    return (f" mul.lo.u32 k, {key}, 0xCC9E2D51; shf.l.wrap.b32 k, k, k, 15; mul.lo.u32 k, k, 0x1B873593;"
            f" xor.b32 {h}, {h}, k; shf.l.wrap.b32 {h}, {h}, {h}, 13; mad.lo.u32 {h}, {h}, 5, 0xE6546B64;")


# murmur3_uniform32(seed $1, pos $2, column $3): the hash of the seed's two
# words, the position's low word and the column, finalized with length 16,
# then hi16 * 2^-16 + (lo16 + 0.5) * 2^-32 (the first product exact, one fma).
_UNIFORM = (
    "{ .reg .b32 h, k, sl, sh, pl, t, hi, lo; .reg .f32 fh, fl;"
    " mov.b64 {sl, sh}, $1; cvt.u32.u64 pl, $2; mov.b32 h, 0;"
    + _mix("h", "sl") + _mix("h", "sh") + _mix("h", "pl") + _mix("h", "$3")
    + " xor.b32 h, h, 16;"
    " shr.u32 t, h, 16; xor.b32 h, h, t; mul.lo.u32 h, h, 0x85EBCA6B;"
    " shr.u32 t, h, 13; xor.b32 h, h, t; mul.lo.u32 h, h, 0xC2B2AE35;"
    " shr.u32 t, h, 16; xor.b32 h, h, t;"
    " shr.u32 hi, h, 16; and.b32 lo, h, 65535; cvt.rn.f32.u32 fh, hi; cvt.rn.f32.u32 fl, lo;"
    " add.rn.f32 fl, fl, 0f3F000000; mul.rn.f32 fl, fl, 0f2F800000;"
    " fma.rn.f32 $0, fh, 0f37800000, fl; }"
)
# libdevice's logf as Triton inlines it (spec.gumbel.LOGF_POLY, LN2).
_LOGF_POLY = ("0fBE055027", "0f3E1039F6", "0fBDF8CDCC", "0f3E0F2955", "0fBE2AD8B9", "0f3E4CED0B", "0fBE7FFF22",
              "0f3EAAAA78", "0fBF000000")


def _logf(x: str, out: str, tag: str) -> str:
    """PTX of ``out = logf(x)`` with registers named after ``tag`` (declared here)."""
    i, e, mb, m, n, p, q, s, t, xs, o = (f"{r}{tag}" for r in ("i", "e", "mb", "m", "n", "p", "q", "s", "t", "xs",
                                                               "o"))
    # A subnormal argument scaled by 2^23, the exponent offset -23 (the outer call's code; harmless in the inner).
    text = (f" .reg .b32 {i}, {e}, {mb}; .reg .f32 {m}, {n}, {p}, {q}, {xs}, {o}; .reg .pred {s}, {t};"
            f" setp.lt.f32 {t}, {x}, 0f00800000; mul.rn.f32 {xs}, {x}, 0f4B000000; selp.f32 {xs}, {xs}, {x}, {t};"
            f" selp.f32 {o}, 0fC1B80000, 0f00000000, {t};"
            f" mov.b32 {i}, {xs}; add.s32 {e}, {i}, -1059760811; and.b32 {e}, {e}, -8388608;"
            f" sub.s32 {mb}, {i}, {e}; mov.b32 {m}, {mb}; cvt.rn.f32.s32 {n}, {e};"
            f" fma.rn.ftz.f32 {n}, {n}, 0f34000000, {o}; add.rn.f32 {m}, {m}, 0fBF800000;"
            f" fma.rn.ftz.f32 {p}, {_LOGF_POLY[0]}, {m}, {_LOGF_POLY[1]};")
    for c in _LOGF_POLY[2:]:
        text += f" fma.rn.ftz.f32 {p}, {p}, {m}, {c};"
    text += (f" mul.rn.f32 {q}, {m}, {p}; fma.rn.ftz.f32 {q}, {q}, {m}, {m};"
             f" fma.rn.ftz.f32 {out}, {n}, 0f3F317218, {q};"
             f" setp.lt.u32 {s}, {i}, 2139095040; @!{s} fma.rn.ftz.f32 {out}, {xs}, 0f7F800000, 0f7F800000;")
    return text


def _f32_hex(value: float) -> str:
    return f"0f{f32_bits(value):08X}"


# -logf(-log1p_neg_stable(u $1)): the series below 0.25 (a Horner chain of
# fma.rn from 1/8, then -(u * p)), else logf(max(1 - u, 2^-24)).
_NOISE = (
    "{ .reg .f32 pp, ss, dd, ww, ll; .reg .pred lt;"
    f" fma.rn.f32 pp, $1, {_f32_hex(1 / 8)}, {_f32_hex(1 / 7)};"
    + "".join(f" fma.rn.f32 pp, $1, pp, {_f32_hex(1 / k)};" for k in (6, 5, 4, 3, 2, 1))
    + " mul.rn.f32 ss, $1, pp; neg.f32 ss, ss;"
    " sub.rn.f32 dd, 0f3F800000, $1; max.f32 dd, dd, 0f33800000;"
    + _logf("dd", "dd", "a")
    + " setp.lt.f32 lt, $1, 0f3E800000; selp.f32 ww, ss, dd, lt; neg.f32 ww, ww;"
    + _logf("ww", "ll", "b")
    + " neg.f32 $0, ll; }"
)


@dsl_user_op
def gumbel_uniform(seed, pos, column, *, loc=None, ip=None) -> Float32:
    """vLLM's ``murmur3_uniform32(seed, pos, column)`` (Int64, Int64, Int32)."""
    return Float32(asm(T.f32(), [i64(seed, loc, ip), i64(pos, loc, ip), i32(column, loc, ip)], _UNIFORM,
                       "=f,l,l,r", False, loc, ip))


@dsl_user_op
def gumbel_noise(u, *, loc=None, ip=None) -> Float32:
    """``-logf(-log1p_neg_stable(u))`` as Triton 3.8 compiles vLLM's FP32 noise."""
    return Float32(asm(T.f32(), [f32(u, loc, ip)], _NOISE, "=f,f", False, loc, ip))


@dsl_user_op
def div_full(a, b, *, loc=None, ip=None) -> Float32:
    """``div.full.f32 a, b`` (Triton's FP32 ``/``)."""
    return Float32(asm(T.f32(), [f32(a, loc, ip), f32(b, loc, ip)], "div.full.f32 $0, $1, $2;", "=f,f,f", False,
                       loc, ip))


__all__ = ["argmax_key", "atom_add_acq_rel_u32", "atom_exch_u64", "div_full", "fence_acq_rel_gpu", "grid_arrive_wait",
           "gumbel_noise", "gumbel_uniform", "key_below", "key_column", "ld_relaxed_u64", "max_u64", "red_max_u64",
           "st_global_b64", "tanhf", "warp_key_max"]
