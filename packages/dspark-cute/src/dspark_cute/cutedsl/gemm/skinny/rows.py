"""Row copies for the skinny GEMM's ring main loop (``SkinnyConfig.copy``
"rows"; ``ring.mainloop`` runs ``mainloop`` here for them).

With lane copies each lane copies the 16 bytes it later reads: one warp
instruction covers 8 weight rows x 64 bytes, so the L2 sees 64-byte requests
(half lines). With row copies the warp copies two steps (64 columns) of its
K-slice at a time, as whole 128-byte row pieces: copy ``q`` of lane ``l``
takes tile row ``4 q + (l >> 3)``, 16-byte chunk ``l & 7`` (``row_copy``), so
one instruction covers 4 rows x 128 bytes and every request is a full line.
The ring then holds ``stages / 2`` pairs of steps per warp, each 64 rows of
128 bytes, chunk ``c`` of row ``r`` stored at chunk ``c ^ 4 (r & 1)``
(``rows_ring_offset``): a copy's 8 lanes of one row and a fragment read's
quarter-warp (rows ``g``, ``g + 1``, chunks ``t``) each cover all 32 banks.
A lane then reads the chunk ``4 (s & 1) + t`` of rows ``16 i + 8 h + g``
(``rows_read_offset``): exactly the words lane copies would have given it,
so the MMAs, their operands and their order are those of lane copies (the
same bits). Copies of other lanes become visible through
``cp.async.wait_group`` and then ``bar.warp.sync``; a second
``bar.warp.sync`` after a pair's MMAs keeps any lane from refilling a slot
another lane still reads. x is copied (or, ``x_regs``, loaded) per lane as
with lane copies, or (``x_copy`` "rows") by the warp like the weight: copy
``q`` of lane ``l`` takes token slot ``4 q + (l >> 3)`` (x's row
``min(slot, m - 1)``, the row a lane copy of that slot takes), chunk ``l &
7`` of the pair's 64 columns (``x_row_copy``), into 128-byte slot rows
swizzled the same way (``x_rows_offset``); a lane reads chunk ``4 (s & 1) +
t`` of slot ``8 n_tile + g``: its lane copy's words. One instruction then
covers 4 tokens x 128 bytes instead of 8 tokens x 64 bytes, halving x's L2
requests (at m = 16 x's 16 rows are a fifth of the copied bytes). Needs an
even number of steps and stages (``SkinnyConfig`` refuses others).
"""

from __future__ import annotations

from cutlass import Int32, Int64

from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.skinny.config import (
    STEP_K,
    TILE_ROWS,
    W_LOADS,
    SkinnyConfig,
    lane_coords,
    ring_offset,
    step_column,
    x_token,
)
from dspark_cute.cutedsl.gemm.skinny.tile import min_i32, prologue, step_mmas, zero_accumulators

PAIR_ROW_BYTES = 2 * STEP_K * 2  # a weight row's two steps in the ring: one 128-byte line
PAIR_COPIES = TILE_ROWS * PAIR_ROW_BYTES // (32 * 16)  # 16-byte copies per lane and pair of steps


def _line_copy(cfg: SkinnyConfig, warp, lane, pair: int, q: int, source_row=None) -> tuple:
    """``(line, chunk, offset)`` of a lane's 16-byte copy ``q`` of a pair of
    steps, 4 lines x 128 bytes per warp instruction: line ``4 q + lane >>
    3``, chunk ``lane & 7`` of the pair's 64 columns, at element ``offset``
    of a matrix of ``cfg.k`` columns, in its row ``source_row`` (default:
    the line)."""
    line, chunk = 4 * q + (lane >> 3), lane & 7
    row = line if source_row is None else source_row(line)
    return line, chunk, row * cfg.k + step_column(cfg, warp, 2 * pair) + 8 * chunk


def _swizzle(line, chunk):
    """Byte offset of ``chunk`` within its 128-byte ``line`` in the ring: it is
    stored at chunk ``c ^ 4 (line & 1)``, so two neighbouring lines, read by
    one quarter-warp, use all 32 banks (a copy's 8 chunks of a line do)."""
    return (chunk ^ ((line & 1) * 4)) * 16


def row_copy(cfg: SkinnyConfig, warp, lane, pair: int, q: int) -> tuple:
    """Row copies (``copy`` "rows"): ``(row, chunk, offset)`` of this lane's
    copy ``q`` (of ``PAIR_COPIES``) of ``pair`` (steps ``2 pair``, ``+ 1``):
    tile row ``4 q + lane >> 3``, 16-byte chunk ``lane & 7`` of the row's 64
    columns, at element ``offset`` of the tile."""
    return _line_copy(cfg, warp, lane, pair, q)


def rows_ring_offset(cfg: SkinnyConfig, warp, pair_stage: int, row, chunk):
    """Byte offset in the row-copy ring of a row's 16-byte chunk: 128-byte
    rows, chunks swizzled (``_swizzle``)."""
    return ((pair_stage * cfg.k_warps + warp) * TILE_ROWS + row) * PAIR_ROW_BYTES + _swizzle(row, chunk)


def rows_read_offset(cfg: SkinnyConfig, warp, lane, step: int, load: int, pair_stage: int):
    """The ring offset holding ``weight_offset(cfg, warp, lane, step, load)``'s
    16 bytes under row copies: row ``16 i + 8 h + g``, chunk ``4 (step & 1) + t``."""
    g, t = lane_coords(lane)
    i, h = divmod(load, 2)
    return rows_ring_offset(cfg, warp, pair_stage, 16 * i + 8 * h + g, 4 * (step % 2) + t)


def x_row_copy(cfg: SkinnyConfig, warp, lane, pair: int, q: int, m, minimum=min) -> tuple:
    """x row copies (``x_copy`` "rows"): ``(slot, chunk, offset)`` of this
    lane's copy ``q`` (of ``2 n_tiles``) of ``pair``: token slot ``4 q + lane
    >> 3``, 16-byte chunk ``lane & 7``, at element ``offset`` of x (row
    ``min(slot, m - 1)``: a clamped slot only feeds MMA columns no one reads)."""
    return _line_copy(cfg, warp, lane, pair, q, lambda slot: minimum(slot, m - 1))


def x_rows_offset(cfg: SkinnyConfig, warp, pair_stage: int, slot, chunk):
    """Byte offset of an x slot row's 16-byte chunk under ``x_copy`` "rows":
    after the weight's rows, ``8 n_tiles`` 128-byte slot rows per warp and
    pair stage, chunks swizzled as the weight's (``_swizzle``)."""
    line = (pair_stage * cfg.k_warps + warp) * 8 * cfg.n_tiles + slot
    return cfg.weight_ring_bytes + line * PAIR_ROW_BYTES + _swizzle(slot, chunk)


def x_rows_read_offset(cfg: SkinnyConfig, warp, lane, step: int, n_tile: int, pair_stage: int):
    """The ring offset holding this lane's x words of ``n_tile`` in ``step``
    under ``x_copy`` "rows": slot ``8 n_tile + g``, chunk ``4 (step & 1) + t``."""
    g, t = lane_coords(lane)
    return x_rows_offset(cfg, warp, pair_stage, 8 * n_tile + g, 4 * (step % 2) + t)


def _x_offset(cfg: SkinnyConfig, warp, lane, step: int, token):
    """``config.x_offset``'s value, summed as ``step_column + 8 t`` (the
    order of the row-copy kernels the GPU runs validated)."""
    _, t = lane_coords(lane)
    return token * cfg.k + step_column(cfg, warp, step) + 8 * t


def mainloop(cfg: SkinnyConfig, w_tile, x, m, ring, tid, warp, lane, before_x) -> list:
    """``ring.mainloop`` with row copies (``copy`` "rows"): the ring holds
    ``stages / 2`` pairs of steps; a pair's weight is copied by the warp in
    128-byte row pieces (``row_copy``), one commit group per pair (with its
    steps' x copies), waited for and then shared by a ``sync_warp``. The
    same MMAs on the same words in the same order as ``mainloop``."""
    tokens = [x_token(lane, nt, m, minimum=min_i32) for nt in range(cfg.n_tiles)]
    x_words: dict = {}
    pairs, depth = cfg.steps // 2, cfg.stages // 2

    def copy_weight(pair: int, pair_stage: int) -> None:
        for q in range(PAIR_COPIES):
            row, chunk, off = row_copy(cfg, warp, lane, pair, q)
            ptx.cp_async_16(Int32(ring) + rows_ring_offset(cfg, warp, pair_stage, row, chunk),
                        Int64(w_tile) + Int64(off) * 2, cfg.l2_prefetch)

    def copy_x(pair: int) -> None:
        if cfg.x_copy == "rows":
            for q in range(2 * cfg.n_tiles):
                slot, chunk, off = x_row_copy(cfg, warp, lane, pair, q, m, minimum=min_i32)
                ptx.cp_async_16(Int32(ring) + x_rows_offset(cfg, warp, pair % depth, slot, chunk),
                            Int64(x) + Int64(off) * 2, cfg.l2_prefetch)
            return
        for step in (2 * pair, 2 * pair + 1):
            for nt, tok in enumerate(tokens):
                src = Int64(x) + Int64(_x_offset(cfg, warp, lane, step, tok)) * 2
                if cfg.x_regs:
                    x_words.setdefault(step, []).append(ptx.ld_global_v4(src))
                else:
                    ptx.cp_async_16(Int32(ring) + ring_offset(cfg, tid, step % cfg.stages, W_LOADS + nt), src,
                                cfg.l2_prefetch)

    def refill(p: int, ps: int) -> None:
        ptx.sync_warp()  # every lane's reads of the slot before any lane refills it
        if p + depth < pairs:
            copy_weight(p + depth, ps)
            copy_x(p + depth)
        ptx.cp_async_commit()

    def words_of(s: int, ps: int) -> list:
        words = [ptx.ld_shared_v4(Int32(ring) + rows_read_offset(cfg, warp, lane, s, load, ps))
                 for load in range(W_LOADS)]
        if cfg.x_regs:
            return words + x_words.pop(s)
        if cfg.x_copy == "rows":
            return words + [ptx.ld_shared_v4(Int32(ring) + x_rows_read_offset(cfg, warp, lane, s, nt, ps))
                            for nt in range(cfg.n_tiles)]
        return words + [ptx.ld_shared_v4(Int32(ring) + ring_offset(cfg, tid, s % cfg.stages, W_LOADS + nt))
                        for nt in range(cfg.n_tiles)]

    prologue(depth, lambda p: copy_weight(p, p), copy_x, cfg.x_regs, before_x)
    acc = zero_accumulators(cfg)
    for p in range(pairs):
        ps = p % depth
        ptx.cp_async_wait(depth - 1)
        ptx.sync_warp()  # the other lanes' copies of this pair are visible after it
        for e in range(2):
            step_mmas(cfg, words_of(2 * p + e, ps), acc)
        refill(p, ps)
    ptx.cp_async_wait(0)
    return acc


__all__ = [
    "PAIR_COPIES",
    "PAIR_ROW_BYTES",
    "mainloop",
    "row_copy",
    "rows_read_offset",
    "rows_ring_offset",
    "x_row_copy",
    "x_rows_offset",
    "x_rows_read_offset",
]
