"""Global and shared memory access: vector and scalar loads and stores (some
predicated), ``cp.async`` copies, L2 prefetches.

Addresses: global ones are byte addresses (``Int64``; a kernel computes them
from a pointer argument's ``toint()``), shared ones byte addresses in the
shared window (``Int32``). Every load is a side-effecting asm statement, so
the compiler keeps it in program order relative to ``pdl_wait`` (a load of
data written by the previous kernel must stay after the wait) and to the
barriers and ``cp.async`` waits around shared memory.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .arith import as_f32, as_u32, bf16x2_to_f32, f16x2_to_f32, pack_bf16x2_rn, pack_f16x2_rn
from .cta import FRAGMENT_BYTES, VEC
from .inline import asm, f32, floats, i32, i64, u32, words

# ---------------------------------------------------------------- global: 16-byte vectors


def _ld_global_v4(opcode: str, addr, loc, ip) -> list:
    result = asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [i64(addr, loc, ip)],
        f"{opcode}.v4.b32 {{$0, $1, $2, $3}}, [$4];",
        "=r,=r,=r,=r,l",
        True,
        loc,
        ip,
    )
    return words(result, 4, loc, ip)


@dsl_user_op
def ld_global_v4(addr, *, loc=None, ip=None) -> list:
    """Four 32-bit words from the 16-byte aligned global byte address
    ``addr`` (one ``ld.global.v4.b32``), kept in program order."""
    return _ld_global_v4("ld.global", addr, loc, ip)


@dsl_user_op
def ld_global_nc_v4(addr, *, loc=None, ip=None) -> list:
    """``ld_global_v4`` through the non-coherent path without an L1 line
    (``ld.global.nc.L1::no_allocate.v4.b32``): for data that no kernel writes
    while this one runs and that is read once (a weight streamed by a GEMV)."""
    return _ld_global_v4("ld.global.nc.L1::no_allocate", addr, loc, ip)


@dsl_user_op
def ld_global_na_v4(addr, *, loc=None, ip=None) -> list:
    """``ld_global_v4`` without an L1 line (``ld.global.L1::no_allocate.v4.b32``):
    a weight load issued before a PDL wait. ptxas keeps a coherent load there
    and may move a non-coherent one (``ld_global_nc_v4``) after the wait
    (``test_sass_pdl.py``)."""
    return _ld_global_v4("ld.global.L1::no_allocate", addr, loc, ip)


@dsl_user_op
def st_global_v4(addr, values, *, loc=None, ip=None) -> None:
    """Store four 32-bit words at the 16-byte aligned global byte address
    ``addr`` (one ``st.global.v4.b32``)."""
    asm(
        None,
        [i64(addr, loc, ip)] + [u32(w, loc, ip) for w in values],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        True,
        loc,
        ip,
    )


@dsl_user_op
def st_global_v4_if(addr, values, index, limit, *, loc=None, ip=None) -> None:
    """``st_global_v4`` if ``index < limit`` (Int32, signed): a predicated
    store, not a branch, so every thread of a warp stays converged (the
    elementwise kernels' tail guard; the o-gate's shuffles need all 32
    lanes)."""
    asm(
        None,
        [i64(addr, loc, ip)] + [u32(w, loc, ip) for w in values] + [i32(index, loc, ip), i32(limit, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $5, $6; @p st.global.v4.b32 [$0], {$1, $2, $3, $4}; }",
        "l,r,r,r,r,r,r",
        True,
        loc,
        ip,
    )


# ---------------------------------------------------------------- global: 8-column fragments


def ld_f32x8(addr) -> list:
    """8 FP32 from ``addr`` (32 bytes: two 16-byte loads)."""
    values = ld_global_v4(addr) + ld_global_v4(Int64(addr) + 16)
    return [as_f32(w) for w in values]


def ld_bf16x8(addr) -> list:
    """8 BF16 from ``addr`` (one 16-byte load), widened to FP32 exactly."""
    out = []
    for w in ld_global_v4(addr):
        out.extend(bf16x2_to_f32(w))
    return out


def ld_f16x8(addr) -> list:
    """8 FP16 from ``addr`` (one 16-byte load), widened to FP32 exactly."""
    out = []
    for w in ld_global_v4(addr):
        out.extend(f16x2_to_f32(w))
    return out


def ld_row8(dtype: str, base, column) -> list:
    """The 8 values of a ``dtype`` ("bf16", "fp16" or "fp32") vector from
    element ``column`` of the array at byte address ``base``, as FP32."""
    size = FRAGMENT_BYTES[dtype] // VEC
    addr = Int64(base) + Int64(column) * size
    return {"bf16": ld_bf16x8, "fp16": ld_f16x8, "fp32": ld_f32x8}[dtype](addr)


def st_f32x8(addr, values) -> None:
    """Store 8 FP32 at ``addr`` (two 16-byte stores)."""
    bits = [as_u32(v) for v in values]
    st_global_v4(addr, bits[:4])
    st_global_v4(Int64(addr) + 16, bits[4:])


def st_bf16x8(addr, values) -> None:
    """Store 8 FP32 rounded to BF16 (nearest even) at ``addr`` (one 16-byte
    store)."""
    st_global_v4(addr, [pack_bf16x2_rn(values[2 * i], values[2 * i + 1]) for i in range(4)])


def st_f16x8(addr, values) -> None:
    """Store 8 FP32 rounded to FP16 (nearest even) at ``addr`` (one 16-byte
    store)."""
    st_global_v4(addr, [pack_f16x2_rn(values[2 * i], values[2 * i + 1]) for i in range(4)])


def st_row8(dtype: str, base, column, values) -> None:
    """Store 8 FP32 ``values`` rounded to ``dtype`` at element ``column`` of
    the array at byte address ``base``."""
    size = FRAGMENT_BYTES[dtype] // VEC
    addr = Int64(base) + Int64(column) * size
    {"bf16": st_bf16x8, "fp16": st_f16x8, "fp32": st_f32x8}[dtype](addr, values)


# ---------------------------------------------------------------- global: scalars


@dsl_user_op
def ld_global_b32(addr, *, loc=None, ip=None) -> Uint32:
    """The 32-bit word at the 4-byte aligned global byte address ``addr``."""
    return Uint32(asm(T.i32(), [i64(addr, loc, ip)], "ld.global.b32 $0, [$1];", "=r,l", True, loc, ip))


@dsl_user_op
def ld_global_u16(addr, *, loc=None, ip=None) -> Uint32:
    """The 16-bit value at the 2-byte aligned global byte address ``addr``,
    zero-extended to 32 bits."""
    return Uint32(asm(T.i32(), [i64(addr, loc, ip)], "{ .reg .b16 h; ld.global.b16 h, [$1]; cvt.u32.u16 $0, h; }",
                      "=r,l", True, loc, ip))


@dsl_user_op
def ld_global_s64(addr, *, loc=None, ip=None) -> Int64:
    """The signed 64-bit integer at the 8-byte aligned global byte address ``addr``."""
    return Int64(asm(T.i64(), [i64(addr, loc, ip)], "ld.global.s64 $0, [$1];", "=l,l", True, loc, ip))


@dsl_user_op
def ld_global_u64(addr, *, loc=None, ip=None) -> Int64:
    """The 64-bit word at global ``addr`` (``ld.global.b64``, a weak load:
    constant data such as an address table)."""
    return Int64(asm(T.i64(), [i64(addr, loc, ip)], "ld.global.b64 $0, [$1];", "=l,l", True, loc, ip))


@dsl_user_op
def ld_global_slot(addr, wide: bool, *, loc=None, ip=None) -> Int64:
    """The slot at global ``addr``: an int64 (``wide``), or an int32
    sign-extended (``ld.global.s32`` + ``cvt.s64.s32``)."""
    a = i64(addr, loc, ip)
    if wide:
        return Int64(asm(T.i64(), [a], "ld.global.s64 $0, [$1];", "=l,l", True, loc, ip))
    return Int64(asm(T.i64(), [a], "{ .reg .s32 v; ld.global.s32 v, [$1]; cvt.s64.s32 $0, v; }", "=l,l", True,
                     loc, ip))


@dsl_user_op
def ld_global_clamped_slot(addr, wide: bool, hi, *, loc=None, ip=None) -> Int64:
    """``ld_global_slot`` (an int64, or an int32 sign-extended) clamped to
    ``[0, hi]`` (Int64)."""
    load = "ld.global.s64 v, [$1];" if wide else "{ .reg .s32 w; ld.global.s32 w, [$1]; cvt.s64.s32 v, w; }"
    return Int64(asm(T.i64(), [i64(addr, loc, ip), i64(hi, loc, ip)],
                     "{ .reg .s64 v; " + load + " max.s64 v, v, 0; min.s64 $0, v, $2; }", "=l,l,l", True, loc, ip))


@dsl_user_op
def ld_global_clamped_s64(addr, lo, hi, *, loc=None, ip=None) -> Int64:
    """The int64 at global ``addr`` clamped to ``[lo, hi]`` (Int64 bounds)."""
    return Int64(asm(
        T.i64(), [i64(addr, loc, ip), i64(lo, loc, ip), i64(hi, loc, ip)],
        "{ .reg .s64 v; ld.global.s64 v, [$1]; max.s64 v, v, $2; min.s64 $0, v, $3; }",
        "=l,l,l,l", True, loc, ip,
    ))


@dsl_user_op
def st_global_b32(addr, word, *, loc=None, ip=None) -> None:
    """Store the 32-bit ``word`` at the 4-byte aligned global byte address ``addr``."""
    asm(None, [i64(addr, loc, ip), u32(word, loc, ip)], "st.global.b32 [$0], $1;", "l,r", True, loc, ip)


@dsl_user_op
def st_global_b32_if(addr, word, token, m, *, loc=None, ip=None) -> None:
    """Store ``word`` at global ``addr`` if ``token < m`` (Int32)."""
    asm(None, [i64(addr, loc, ip), u32(word, loc, ip), i32(token, loc, ip), i32(m, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p st.global.b32 [$0], $1; }", "l,r,r,r", True, loc, ip)


@dsl_user_op
def st_global_b16_if(addr, word, token, m, *, loc=None, ip=None) -> None:
    """Store the low 16 bits of ``word`` at the 2-byte aligned global
    ``addr`` if ``token < m`` (Int32)."""
    asm(None, [i64(addr, loc, ip), u32(word, loc, ip), i32(token, loc, ip), i32(m, loc, ip)],
        "{ .reg .b16 lo, hi; .reg .pred p; setp.lt.s32 p, $2, $3; mov.b32 {lo, hi}, $1; @p st.global.b16 [$0], lo; }",
        "l,r,r,r", True, loc, ip)


@dsl_user_op
def st_global_b32_if_slot(addr, word, token, m, slot, num_slots, *, loc=None, ip=None) -> None:
    """Store ``word`` at global ``addr`` if ``token < m`` and ``0 <= slot <
    num_slots`` (the cache insert's skip rule; a skipped address is never
    dereferenced)."""
    asm(None, [i64(addr, loc, ip), u32(word, loc, ip), i32(token, loc, ip), i32(m, loc, ip), i64(slot, loc, ip),
               i64(num_slots, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $2, $3; setp.ge.and.s64 p, $4, 0, p; "
        "setp.lt.and.s64 p, $4, $5, p; @p st.global.b32 [$0], $1; }",
        "l,r,r,r,l,l", True, loc, ip)


# ---------------------------------------------------------------- shared memory


@dsl_user_op
def st_shared_f32(addr, value, *, loc=None, ip=None) -> None:
    """Store FP32 ``value`` at the shared-memory byte address ``addr``."""
    asm(None, [i32(addr, loc, ip), f32(value, loc, ip)], "st.shared.f32 [$0], $1;", "r,f", True, loc, ip)


@dsl_user_op
def st_shared_f32_if_lane0(lane, addr, value, *, loc=None, ip=None) -> None:
    """``st_shared_f32`` by lane 0 alone (a predicated store: the other lanes
    hold the same value)."""
    asm(None, [i32(lane, loc, ip), i32(addr, loc, ip), f32(value, loc, ip)],
        "{ .reg .pred p; setp.eq.u32 p, $0, 0; @p st.shared.f32 [$1], $2; }", "r,r,f", True, loc, ip)


@dsl_user_op
def ld_shared_f32(addr, *, loc=None, ip=None) -> Float32:
    """The FP32 at the shared-memory byte address ``addr``."""
    return Float32(asm(T.f32(), [i32(addr, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r", True, loc, ip))


@dsl_user_op
def st_shared_v2_f32(addr, a, b, *, loc=None, ip=None) -> None:
    """Store 2 FP32 at the 8-byte aligned shared byte address ``addr``."""
    asm(None, [i32(addr, loc, ip), f32(a, loc, ip), f32(b, loc, ip)], "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f",
        True, loc, ip)


@dsl_user_op
def ld_shared_v2_f32(addr, *, loc=None, ip=None) -> tuple:
    """Two FP32 at the 8-byte aligned shared byte address ``addr``."""
    pair = asm(llvm.StructType.get_literal([T.f32()] * 2), [i32(addr, loc, ip)], "ld.shared.v2.f32 {$0, $1}, [$2];",
               "=f,=f,r", True, loc, ip)
    return tuple(floats(pair, 2, loc, ip))


@dsl_user_op
def st_shared_v4_f32(addr, values, *, loc=None, ip=None) -> None:
    """Store 4 FP32 at the 16-byte aligned shared byte address ``addr``."""
    asm(None, [i32(addr, loc, ip)] + [f32(v, loc, ip) for v in values], "st.shared.v4.f32 [$0], {$1, $2, $3, $4};",
        "r,f,f,f,f", True, loc, ip)


@dsl_user_op
def ld_shared_b32(addr, *, loc=None, ip=None) -> Uint32:
    """The 32-bit word at the shared-memory byte address ``addr``."""
    return Uint32(asm(T.i32(), [i32(addr, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r", True, loc, ip))


@dsl_user_op
def ld_shared_s32(addr, *, loc=None, ip=None) -> Int32:
    """The 32-bit integer at the shared-memory byte address ``addr``."""
    return Int32(asm(T.i32(), [i32(addr, loc, ip)], "ld.shared.s32 $0, [$1];", "=r,r", True, loc, ip))


@dsl_user_op
def st_shared_b32(addr, word, *, loc=None, ip=None) -> None:
    """Store the 32-bit ``word`` at the shared-memory byte address ``addr``."""
    asm(None, [i32(addr, loc, ip), u32(word, loc, ip)], "st.shared.b32 [$0], $1;", "r,r", True, loc, ip)


@dsl_user_op
def st_shared_b64(addr, value, *, loc=None, ip=None) -> None:
    """Store the 64-bit ``value`` at the 8-byte aligned shared ``addr``."""
    asm(None, [i32(addr, loc, ip), i64(value, loc, ip)], "st.shared.b64 [$0], $1;", "r,l", True, loc, ip)


@dsl_user_op
def ld_shared_u64(addr, *, loc=None, ip=None) -> Int64:
    """The 64-bit word at the 8-byte aligned shared ``addr``."""
    return Int64(asm(T.i64(), [i32(addr, loc, ip)], "ld.shared.b64 $0, [$1];", "=l,r", True, loc, ip))


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None) -> list:
    """Four 32-bit words at the 16-byte aligned shared byte address ``addr``,
    kept in program order after the preceding ``cp_async_wait``."""
    result = asm(llvm.StructType.get_literal([T.i32()] * 4), [i32(addr, loc, ip)],
                 "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", True, loc, ip)
    return words(result, 4, loc, ip)


@dsl_user_op
def st_shared_v4(addr, values, *, loc=None, ip=None) -> None:
    """Store four 32-bit words at the 16-byte aligned shared byte address ``addr``."""
    asm(None, [i32(addr, loc, ip)] + [u32(w, loc, ip) for w in values], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r", True, loc, ip)


# ---------------------------------------------------------------- cp.async


@dsl_user_op
def cp_async_16(smem_addr, gmem_addr, prefetch: int = 256, *, loc=None, ip=None) -> None:
    """Copy 16 bytes from global ``gmem_addr`` (16-byte aligned) to shared
    ``smem_addr`` asynchronously, caching in L2 only, with a
    ``prefetch``-byte L2 prefetch hint (``cp.async.cg...L2::256B`` by
    default; 0: no hint)."""
    hint = f".L2::{int(prefetch)}B" if prefetch else ""
    asm(None, [i32(smem_addr, loc, ip), i64(gmem_addr, loc, ip)], f"cp.async.cg.shared.global{hint} [$0], [$1], 16;",
        "r,l", True, loc, ip)


@dsl_user_op
def cp_async_16_if(dst, src, row, rows, entry, num_slots, *, loc=None, ip=None) -> None:
    """``cp.async.cg`` of 16 bytes from global ``src`` to shared ``dst``
    where ``row < rows`` and ``entry < num_slots`` (Int32: a predicated copy,
    a skipped one copies nothing)."""
    asm(None, [i32(dst, loc, ip), i64(src, loc, ip)] + [i32(v, loc, ip) for v in (row, rows, entry, num_slots)],
        "{ .reg .pred p, q; setp.lt.s32 p, $2, $3; setp.lt.s32 q, $4, $5; and.pred p, p, q; "
        "@p cp.async.cg.shared.global [$0], [$1], 16; }",
        "r,l,r,r,r,r", True, loc, ip)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    """``cp.async.commit_group`` (an empty group is legal and completes at once)."""
    asm(None, [], "cp.async.commit_group;", "", True, loc, ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
    """``cp.async.wait_group pending``: this thread's copies of all but the
    newest ``pending`` groups have landed and are visible to it."""
    asm(None, [], f"cp.async.wait_group {int(pending)};", "", True, loc, ip)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """``cp.async.wait_all``: this thread's copies have landed (a CTA barrier
    after it makes every thread's visible to all)."""
    asm(None, [], "cp.async.wait_all;", "", True, loc, ip)


@dsl_user_op
def cp_async_16_pred(smem_addr, gmem_addr, a, b, prefetch: int = 256, *, loc=None, ip=None) -> None:
    """``cp_async_16`` where ``a < b`` (Int32; a skipped copy reads nothing)."""
    hint = f".L2::{int(prefetch)}B" if prefetch else ""
    asm(None, [i32(smem_addr, loc, ip), i64(gmem_addr, loc, ip), i32(a, loc, ip), i32(b, loc, ip)],
        f"{{ .reg .pred p; setp.lt.s32 p, $2, $3; @p cp.async.cg.shared.global{hint} [$0], [$1], 16; }}",
        "r,l,r,r", True, loc, ip)


# ---------------------------------------------------------------- ldmatrix


@dsl_user_op
def ldmatrix_x4(addr, *, loc=None, ip=None) -> list:
    """``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: lanes 8 i .. 8 i + 7 give
    the 16-byte row addresses of 8x8 matrix ``i``; word ``i`` of lane ``l``
    is row ``l >> 2``, elements ``2 (l & 3)`` and ``+ 1`` of matrix ``i``."""
    result = asm(llvm.StructType.get_literal([T.i32()] * 4), [i32(addr, loc, ip)],
                 "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", True, loc, ip)
    return words(result, 4, loc, ip)


@dsl_user_op
def ldmatrix_x2(addr, *, loc=None, ip=None) -> list:
    """``ldmatrix_x4`` of two matrices (lanes 0-15 give the addresses)."""
    result = asm(llvm.StructType.get_literal([T.i32()] * 2), [i32(addr, loc, ip)],
                 "ldmatrix.sync.aligned.m8n8.x2.shared.b16 {$0, $1}, [$2];", "=r,=r,r", True, loc, ip)
    return words(result, 2, loc, ip)


# ---------------------------------------------------------------- FP32 pairs in global memory


@dsl_user_op
def st_global_v2_f32_if(addr, a, b, token, m, *, loc=None, ip=None) -> None:
    """Store FP32 ``a, b`` at the 8-byte aligned global ``addr`` if ``token < m`` (Int32)."""
    asm(None, [i64(addr, loc, ip), f32(a, loc, ip), f32(b, loc, ip), i32(token, loc, ip), i32(m, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $3, $4; @p st.global.v2.f32 [$0], {$1, $2}; }", "l,f,f,r,r", True, loc, ip)


@dsl_user_op
def ld_global_cg_v2_f32(addr, *, loc=None, ip=None) -> tuple:
    """Two FP32 at the 8-byte aligned global ``addr``, read at L2
    (``ld.global.cg``: never a stale L1 line of data other CTAs wrote)."""
    pair = asm(llvm.StructType.get_literal([T.f32()] * 2), [i64(addr, loc, ip)], "ld.global.cg.v2.f32 {$0, $1}, [$2];",
               "=f,=f,l", True, loc, ip)
    return tuple(floats(pair, 2, loc, ip))


# ---------------------------------------------------------------- L2 prefetch


@dsl_user_op
def prefetch_l2(addr, *, loc=None, ip=None) -> None:
    """``prefetch.global.L2``: start bringing the line of global ``addr``
    into L2 (no register written, nothing waits for it)."""
    asm(None, [i64(addr, loc, ip)], "prefetch.global.L2 [$0];", "l", True, loc, ip)


@dsl_user_op
def prefetch_l2_if(addr, a, b, *, loc=None, ip=None) -> None:
    """``prefetch_l2`` where ``a < b`` (Int32)."""
    asm(None, [i64(addr, loc, ip), i32(a, loc, ip), i32(b, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $1, $2; @p prefetch.global.L2 [$0]; }", "l,r,r", True, loc, ip)


@dsl_user_op
def prefetch_l2_evict_last(addr, *, loc=None, ip=None) -> None:
    """``prefetch.global.L2::evict_last``: ``prefetch_l2`` with the line kept
    ahead of streaming lines."""
    asm(None, [i64(addr, loc, ip)], "prefetch.global.L2::evict_last [$0];", "l", True, loc, ip)


__all__ = [
    "cp_async_16",
    "cp_async_16_if",
    "cp_async_16_pred",
    "cp_async_commit",
    "cp_async_wait",
    "cp_async_wait_all",
    "ld_bf16x8",
    "ld_f16x8",
    "ld_f32x8",
    "ld_global_b32",
    "ld_global_cg_v2_f32",
    "ld_global_clamped_s64", "ld_global_clamped_slot",
    "ld_global_na_v4",
    "ld_global_nc_v4",
    "ld_global_s64",
    "ld_global_slot",
    "ld_global_u16",
    "ld_global_u64",
    "ld_global_v4",
    "ld_row8",
    "ld_shared_b32",
    "ld_shared_f32",
    "ld_shared_s32",
    "ld_shared_v2_f32",
    "ld_shared_u64", "ld_shared_v4",
    "ldmatrix_x2",
    "ldmatrix_x4",
    "prefetch_l2",
    "prefetch_l2_evict_last",
    "prefetch_l2_if",
    "st_bf16x8",
    "st_f16x8",
    "st_f32x8",
    "st_global_b32",
    "st_global_b16_if",
    "st_global_b32_if",
    "st_global_b32_if_slot",
    "st_global_v2_f32_if",
    "st_global_v4",
    "st_global_v4_if",
    "st_row8",
    "st_shared_b32",
    "st_shared_f32",
    "st_shared_f32_if_lane0",
    "st_shared_v2_f32",
    "st_shared_b64", "st_shared_v4",
    "st_shared_v4_f32",
]
