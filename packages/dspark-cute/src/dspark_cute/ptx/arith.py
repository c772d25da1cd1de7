"""Rounded FP32 arithmetic, bit casts, conversions and the BF16 tensor-core
MMA, each an inline PTX instruction with an explicit rounding mode and no
``.ftz``: the compiler cannot contract a product and a sum into an FMA, flush
subnormals or swap in an approximation, so each is exactly the IEEE operation
``dspark_core.spec.numerics`` specifies."""

from __future__ import annotations

import struct

from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline import asm, f32, floats, i64, u32


def _binary(op: str):
    @dsl_user_op
    def fn(a, b, *, loc=None, ip=None) -> Float32:
        return Float32(
            asm(T.f32(), [f32(a, loc, ip), f32(b, loc, ip)], f"{op}.rn.f32 $0, $1, $2;", "=f,f,f", False, loc, ip)
        )

    fn.__name__ = f"{op}_rn"
    fn.__doc__ = f"``a {op} b`` in FP32 (``{op}.rn.f32``), rounded once to nearest even."
    return fn


add_rn = _binary("add")
sub_rn = _binary("sub")
mul_rn = _binary("mul")
div_rn = _binary("div")


@dsl_user_op
def sqrt_rn(a, *, loc=None, ip=None) -> Float32:
    """``sqrt(a)`` in FP32 (``sqrt.rn.f32``), correctly rounded."""
    return Float32(asm(T.f32(), [f32(a, loc, ip)], "sqrt.rn.f32 $0, $1;", "=f,f", False, loc, ip))


@dsl_user_op
def neg_f32(a, *, loc=None, ip=None) -> Float32:
    """``-a`` (``neg.f32``: the sign bit flipped, exact; subnormals kept)."""
    return Float32(asm(T.f32(), [f32(a, loc, ip)], "neg.f32 $0, $1;", "=f,f", False, loc, ip))


@dsl_user_op
def max_nan(a, b, *, loc=None, ip=None) -> Float32:
    """``max.NaN.f32``: the larger of ``a`` and ``b``, NaN if either is NaN
    (``torch.amax``'s propagation)."""
    return Float32(asm(T.f32(), [f32(a, loc, ip), f32(b, loc, ip)], "max.NaN.f32 $0, $1, $2;", "=f,f,f", False,
                       loc, ip))


# ---------------------------------------------------------------- bits


def f32_bits(value: float) -> int:
    """Host side: the FP32 bit pattern of ``value`` rounded to nearest even
    (the value ``torch.tensor(value, dtype=float32)`` holds)."""
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


@dsl_user_op
def as_f32(word, *, loc=None, ip=None) -> Float32:
    """The 32-bit word ``word`` read as an FP32 (a bit cast)."""
    return Float32(llvm.bitcast(T.f32(), u32(word, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def as_u32(value, *, loc=None, ip=None) -> Uint32:
    """The bit pattern of FP32 ``value`` (a bit cast)."""
    return Uint32(llvm.bitcast(T.i32(), f32(value, loc, ip), loc=loc, ip=ip))


def f32_const(value: float) -> Float32:
    """The FP32 constant nearest ``value`` (ties to even), built from its bits
    so that no compiler rounding of a Python double is involved."""
    return as_f32(Uint32(f32_bits(value)))


# ---------------------------------------------------------------- conversions


def bf16x2_to_f32(word) -> tuple:
    """``(lo, hi)``: the two BF16 of a packed word widened to FP32 exactly
    (their bits shifted into the high half; -0.0, subnormals, inf and NaN
    payloads kept)."""
    w = Uint32(word)
    return as_f32(w << Uint32(16)), as_f32(w & Uint32(0xFFFF0000))


@dsl_user_op
def f16x2_to_f32(word, *, loc=None, ip=None) -> tuple:
    """``(lo, hi)``: the two FP16 of a packed word widened to FP32 exactly
    (``cvt.f32.f16``, no ``.ftz``)."""
    pair = asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [u32(word, loc, ip)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
        "=f,=f,r",
        False,
        loc,
        ip,
    )
    return tuple(floats(pair, 2, loc, ip))


@dsl_user_op
def pack_bf16x2_rn(lo, hi, *, loc=None, ip=None) -> Uint32:
    """``lo`` and ``hi`` each rounded to BF16 (nearest even, subnormals kept,
    overflow to inf) and packed, ``lo`` in the low half
    (``cvt.rn.bf16x2.f32``)."""
    return Uint32(
        asm(T.i32(), [f32(hi, loc, ip), f32(lo, loc, ip)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", False, loc, ip)
    )


@dsl_user_op
def pack_f16x2_rn(lo, hi, *, loc=None, ip=None) -> Uint32:
    """``lo`` and ``hi`` each rounded to FP16 (nearest even, subnormals kept,
    overflow to inf) and packed, ``lo`` in the low half
    (``cvt.rn.f16x2.f32``)."""
    return Uint32(
        asm(T.i32(), [f32(hi, loc, ip), f32(lo, loc, ip)], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", False, loc, ip)
    )


def round_bf16x2(a, b) -> tuple:
    """``(a, b)`` each rounded to BF16 (nearest even) and widened back to
    FP32: ``x.to(bfloat16).to(float32)``."""
    return bf16x2_to_f32(pack_bf16x2_rn(a, b))


def round_bf16(values: list) -> list:
    """``values`` (an even count of FP32) each rounded to BF16 and widened
    back, pair by pair in order (``round_bf16x2``)."""
    out = []
    for j in range(0, len(values), 2):
        out.extend(round_bf16x2(values[j], values[j + 1]))
    return out


def widen_bf16(words: list) -> list:
    """The BF16 pairs of packed ``words`` widened to FP32 exactly, in column
    order (``bf16x2_to_f32`` word by word)."""
    out = []
    for w in words:
        out.extend(bf16x2_to_f32(w))
    return out


# ---------------------------------------------------------------- tensor cores


@dsl_user_op
def mma_bf16(a: list, b: list, c: list, *, loc=None, ip=None) -> list:
    """``d = c + A @ B`` on the tensor cores: ``mma.sync.aligned.m16n8k16``
    row.col, BF16 inputs, FP32 accumulators (fragments as in the PTX ISA;
    the order of the 16 products and the accumulator is the hardware's)."""
    ops = [Uint32(v).ir_value(loc=loc, ip=ip) for v in list(a) + list(b)]
    ops += [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    res = asm(
        llvm.StructType.get_literal([T.f32()] * 4), ops,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", False, loc, ip,
    )
    return floats(res, 4, loc, ip)


__all__ = [
    "add_rn",
    "as_f32",
    "as_u32",
    "bf16x2_to_f32",
    "div_rn",
    "f16x2_to_f32",
    "f32_bits",
    "f32_const",
    "max_nan",
    "mma_bf16",
    "mul_rn",
    "neg_f32",
    "pack_bf16x2_rn",
    "pack_f16x2_rn",
    "round_bf16",
    "round_bf16x2",
    "sqrt_rn",
    "sub_rn",
    "widen_bf16",
]


@dsl_user_op
def slot_entry(slot, num_slots, *, loc=None, ip=None) -> Int32:
    """The low 32 bits of ``slot`` (Int64) where ``0 <= slot < num_slots``
    (one unsigned comparison), else ``num_slots`` (below 2^31): a slot
    table's entry, a masked slot reading as ``num_slots``."""
    return Int32(asm(
        T.i32(), [i64(slot, loc, ip), i64(num_slots, loc, ip)],
        "{ .reg .pred p; .reg .b32 s, n; setp.lt.u64 p, $1, $2; cvt.u32.u64 s, $1; cvt.u32.u64 n, $2; "
        "selp.b32 $0, s, n, p; }",
        "=r,l,l", False, loc, ip,
    ))


__all__ += ["slot_entry"]
