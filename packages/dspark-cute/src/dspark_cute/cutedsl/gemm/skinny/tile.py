"""The traced pieces the ring main loops (lane copies, ``ring``; row copies,
``rows``) and their kernels' epilogues share: the prologue's copy order, the
accumulators, one step's MMAs, the warp partials through shared memory and
their fold by halves (``config`` holds the index maps)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.skinny.config import (
    MMA_TILES,
    SkinnyConfig,
    a_fragment,
    acc_coords,
    b_fragment,
    red_offset,
)


def prologue(slots: int, copy_weight, copy_x, x_regs: bool, before_x) -> None:
    """The ring main loops' prologue over the first ``slots`` ring slots
    (steps; pairs of steps under row copies): ``copy_weight(p)`` for every
    slot (constant data: before the PDL wait; with ``x_regs`` one commit
    group each), then ``before_x()``, then ``copy_x(p)`` for every slot
    (without ``x_regs`` one commit group each, the first also holding every
    prologue weight copy)."""
    for p in range(slots):
        copy_weight(p)
        if x_regs:
            ptx.cp_async_commit()
    if before_x is not None:
        before_x()
    for p in range(slots):
        copy_x(p)
        if not x_regs:
            ptx.cp_async_commit()


def zero_accumulators(cfg: SkinnyConfig) -> list:
    """``acc[i][n_tile]``: 4 FP32 +0.0 each, the start of every chain."""
    zero = ptx.f32_const(0.0)
    return [[[zero] * 4 for _ in range(cfg.n_tiles)] for _ in range(MMA_TILES)]


def step_mmas(cfg: SkinnyConfig, words: list, acc: list) -> None:
    """One step's MMAs on its copied ``words`` into ``acc`` (in place): half
    0 then half 1, MMA tiles ``i`` in order, token tiles in order."""
    for half in range(2):
        for i in range(MMA_TILES):
            for nt in range(cfg.n_tiles):
                acc[i][nt] = ptx.mma_bf16(a_fragment(words, i, half), b_fragment(words, nt, half), acc[i][nt])


def min_i32(a, b):
    """``min`` of two Int32 (traced)."""
    return cutlass.min(Int32(a), Int32(b))


def store_partials(cfg: SkinnyConfig, acc: list, red, warp, lane) -> None:
    """Write this warp's accumulators to the partials (shared, Int32 ``red``,
    ``cfg.red_bytes``, aliasing the ring), between two CTA barriers: the first
    keeps every thread's last ring reads before the overwrite, the second
    makes the partials visible."""
    cute.arch.barrier()
    for i in range(MMA_TILES):
        for nt in range(cfg.n_tiles):
            for reg in range(4):
                row, tok = acc_coords(lane, i, nt, reg)
                ptx.st_shared_f32(Int32(red) + Int32(red_offset(warp, tok, row)) * 4, acc[i][nt][reg])
    cute.arch.barrier()


def reduced_pair(cfg: SkinnyConfig, red, token, lane) -> tuple:
    """The FP32 sums of rows ``2 lane`` and ``2 lane + 1`` for ``token``
    (Int32, < 8 n_tiles): the W_K partials folded by halves (step 2)."""
    pairs = [ptx.ld_shared_v2_f32(Int32(red) + Int32(red_offset(w, token, 2 * lane)) * 4) for w in range(cfg.k_warps)]
    return ptx.fold_halves([p[0] for p in pairs]), ptx.fold_halves([p[1] for p in pairs])


__all__ = ["min_i32", "prologue", "reduced_pair", "step_mmas", "store_partials", "zero_accumulators"]
