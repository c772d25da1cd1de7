"""The one inline-PTX emitter of the package (``asm``) and the conversions of
traced values to the MLIR values it takes. Private to ``dspark_cute.ptx``:
every primitive of the kernels is a function of the modules beside it."""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def asm(result_type, operands, text: str, constraints: str, side_effects: bool, loc, ip):
    """``llvm.inline_asm`` of ``text`` (AT&T dialect, no stack alignment):
    ``result_type`` None for a statement, ``side_effects`` True keeps it in
    program order (every memory access and barrier of the kernels is)."""
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def f32(value, loc, ip):
    return Float32(value).ir_value(loc=loc, ip=ip)


def u32(value, loc, ip):
    return Uint32(value).ir_value(loc=loc, ip=ip)


def i32(value, loc, ip):
    return Int32(value).ir_value(loc=loc, ip=ip)


def i64(value, loc, ip):
    return Int64(value).ir_value(loc=loc, ip=ip)


def words(result, count: int, loc, ip) -> list:
    """The ``count`` 32-bit words of an asm result struct, as ``Uint32``."""
    return [Uint32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(count)]


def floats(result, count: int, loc, ip) -> list:
    """The ``count`` FP32 of an asm result struct, as ``Float32``."""
    return [Float32(llvm.extractvalue(T.f32(), result, [i], loc=loc, ip=ip)) for i in range(count)]
