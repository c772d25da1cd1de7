"""Bulk copies and the shared-memory barriers they complete on (sm_90+):
``cp.async.bulk`` (the copy engine: one contiguous run of bytes, no tensor
map) and ``cp.async.bulk.tensor`` (a box of a tensor map), ``mbarrier``
initialisation, arrivals (with an expected byte count or without), and the
parity wait; and the few scalar accesses of the streamed GEMM's epilogue.

Addresses as in ``memory``: global ones ``Int64`` byte addresses, shared
ones ``Int32`` byte addresses in the shared window. Every statement is a
side-effecting asm statement (kept in program order).
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline import asm, f32, i32, i64, u32

# ---------------------------------------------------------------- mbarrier


@dsl_user_op
def mbarrier_init(bar, count: int, *, loc=None, ip=None) -> None:
    """``mbarrier.init.shared::cta.b64 [bar], count``: phase 0 pending, ``count`` arrivals expected."""
    asm(None, [i32(bar, loc, ip)], f"mbarrier.init.shared::cta.b64 [$0], {int(count)};", "r", True, loc, ip)


@dsl_user_op
def fence_mbarrier_init(*, loc=None, ip=None) -> None:
    """``fence.mbarrier_init.release.cluster``: the initialisations before it
    are visible to the copy engine's ``complete_tx`` and to other threads'
    waits after a barrier."""
    asm(None, [], "fence.mbarrier_init.release.cluster;", "", True, loc, ip)


@dsl_user_op
def mbarrier_arrive_expect_tx(bar, nbytes, *, loc=None, ip=None) -> None:
    """``mbarrier.arrive.expect_tx``: one arrival on ``bar``'s current phase,
    which then also waits for ``nbytes`` (Int32) of bulk copies to complete on it."""
    asm(None, [i32(bar, loc, ip), i32(nbytes, loc, ip)],
        "{ .reg .b64 st; mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [$0], $1; }", "r,r", True, loc, ip)


@dsl_user_op
def mbarrier_wait(bar, parity, *, loc=None, ip=None) -> None:
    """Spin on ``mbarrier.try_wait.parity`` until the phase of ``parity``
    (Int32, 0 or 1) of ``bar`` has completed: the bytes copied under it are
    then visible to this thread (acquire at CTA scope). The label is local to
    the braces' scope, so the statement may be inlined any number of times."""
    asm(None, [i32(bar, loc, ip), i32(parity, loc, ip)],
        "{ .reg .pred p; WAIT: mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [$0], $1; "
        "@!p bra WAIT; }", "r,r", True, loc, ip)


# ---------------------------------------------------------------- bulk copies


@dsl_user_op
def bulk_copy_if(dst, src, nbytes: int, bar, a, b, *, loc=None, ip=None) -> None:
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes``
    of ``nbytes`` (a multiple of 16; both addresses 16-byte aligned) from
    global ``src`` to shared ``dst``, completing on ``bar``, where ``a < b``
    (Int32; a skipped copy reads and signals nothing)."""
    asm(None, [i32(dst, loc, ip), i64(src, loc, ip), i32(bar, loc, ip), i32(a, loc, ip), i32(b, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $3, $4; "
        f"@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {int(nbytes)}, [$2]; }}",
        "r,l,r,r,r", True, loc, ip)


@dsl_user_op
def tma_load_2d(dst, tensormap, column, row, bar, *, loc=None, ip=None) -> None:
    """``cp.async.bulk.tensor.2d`` (tile mode) of the box at ``(column,
    row)`` (Int32, the innermost coordinate first) of the tensor map at the
    global address ``tensormap`` (Int64) into shared ``dst`` (aligned as
    the map's swizzle needs: 1024 bytes for 128-byte swizzle), completing on
    ``bar``."""
    asm(None, [i32(dst, loc, ip), i64(tensormap, loc, ip), i32(column, loc, ip), i32(row, loc, ip),
               i32(bar, loc, ip)],
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [$0], [$1, {$2, $3}], [$4];",
        "r,l,r,r,r", True, loc, ip)


@dsl_user_op
def mbarrier_arrive(bar, *, loc=None, ip=None) -> None:
    """``mbarrier.arrive.release.cta``: one arrival on ``bar``'s current phase."""
    asm(None, [i32(bar, loc, ip)], "{ .reg .b64 st; mbarrier.arrive.release.cta.shared::cta.b64 st, [$0]; }", "r",
        True, loc, ip)


# ---------------------------------------------------------------- epilogue scalars


@dsl_user_op
def st_global_bf16_rn_if(addr, value, token, m, *, loc=None, ip=None) -> None:
    """Round FP32 ``value`` to BF16 (``cvt.rn.bf16x2.f32``, the rounding of
    the packed stores elsewhere, NaN included) and store it at the 2-byte
    aligned global ``addr`` if ``token < m`` (Int32)."""
    asm(None, [i64(addr, loc, ip), f32(value, loc, ip), i32(token, loc, ip), i32(m, loc, ip)],
        "{ .reg .b32 w; .reg .b16 lo, hi; .reg .pred p; setp.lt.s32 p, $2, $3; cvt.rn.bf16x2.f32 w, $1, $1; "
        "mov.b32 {lo, hi}, w; @p st.global.b16 [$0], lo; }", "l,f,r,r", True, loc, ip)


@dsl_user_op
def st_global_f32_if(addr, value, token, m, *, loc=None, ip=None) -> None:
    """Store FP32 ``value`` at the 4-byte aligned global ``addr`` if ``token < m`` (Int32)."""
    asm(None, [i64(addr, loc, ip), f32(value, loc, ip), i32(token, loc, ip), i32(m, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p st.global.f32 [$0], $1; }", "l,f,r,r", True, loc, ip)


@dsl_user_op
def ld_global_cg_f32(addr, *, loc=None, ip=None) -> Float32:
    """One FP32 at the 4-byte aligned global ``addr``, read at L2 (``ld.global.cg``)."""
    return Float32(asm(T.f32(), [i64(addr, loc, ip)], "ld.global.cg.f32 $0, [$1];", "=f,l", True, loc, ip))


@dsl_user_op
def shfl_idx_u32(value, lane: int, *, loc=None, ip=None) -> Uint32:
    """``shfl.sync.idx.b32`` over the full warp: ``value`` of ``lane``."""
    return Uint32(asm(T.i32(), [u32(value, loc, ip)], f"shfl.sync.idx.b32 $0, $1, {int(lane)}, 0x1f, 0xffffffff;",
                      "=r,r", True, loc, ip))


@dsl_user_op
def warp_ticket(counter, lane, *, loc=None, ip=None) -> Uint32:
    """Lane 0 adds 1 to the global u32 ``counter`` (``atom.acq_rel.gpu``);
    every lane gets the old value (``shfl.sync.idx``): the warp's place among
    those that took a ticket."""
    return Uint32(asm(T.i32(), [i64(counter, loc, ip), i32(lane, loc, ip)],
                      "{ .reg .pred p; .reg .b32 o; mov.b32 o, 0; setp.eq.s32 p, $2, 0; "
                      "@p atom.acq_rel.gpu.global.add.u32 o, [$1], 1; shfl.sync.idx.b32 $0, o, 0, 0x1f, 0xffffffff; }",
                      "=r,l,r", True, loc, ip))


__all__ = ["bulk_copy_if", "fence_mbarrier_init", "ld_global_cg_f32", "mbarrier_arrive", "mbarrier_arrive_expect_tx",
           "mbarrier_init",
           "mbarrier_wait", "shfl_idx_u32", "st_global_bf16_rn_if", "st_global_f32_if", "tma_load_2d", "warp_ticket"]
