"""The pieces every GEMM of cuBLAS's split order is traced from (the
streamed ordered GEMM, the Markov bias steps): the lanes' ``ldmatrix``
addresses in a TMA-swizzled stage (``fragment_offsets``), one stage's
in-order ``mma.sync.m16n8k16`` chain (``chunk_mmas``) and a warp's
epilogue, one rounding or the split-K partials reduced in split order by the
last warp (``warp_epilogue``). Written once here: a kernel that sums in that
order composes them, so the order lives in one place."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from dspark_cute import ptx
from dspark_cute.runtime.tensormap import BOX_COLUMNS


def _min(a, b):
    return cutlass.min(Int32(a), Int32(b))


@cute.jit
def warp_epilogue(lay, acc, out, part, counters, tile, lane, m, n, s, splits) -> None:
    """A warp's stores of its ``16 a_tiles`` outputs (rows from ``tile *
    w_rows``) by ``m`` tokens from ``acc`` (``a_tiles x n_tiles`` MMA
    accumulators of ``lay``): with one split each FP32 sum rounded to BF16
    (``cvt.rn``) into ``y [m, n]`` at ``out``; else its FP32 partials into
    split ``s``'s plane of ``part [splits, m, n]``, a ticket on the tile's
    counter, and the last of the ``splits`` warps adds the planes in split
    order (``add.rn.f32`` from plane 0), rounds once, stores and resets the
    counter."""
    row0 = tile * lay.w_rows
    g, t4 = lane >> 2, lane & 3
    if splits == 1:
        for at in cutlass.range_constexpr(lay.a_tiles):
            for nt in cutlass.range_constexpr(lay.n_tiles):
                for reg in cutlass.range_constexpr(4):
                    row = row0 + Int64(16 * at + 8 * (reg >> 1)) + Int64(g)
                    tok = 8 * nt + (reg & 1) + 2 * t4
                    ptx.st_global_bf16_rn_if(Int64(out) + (Int64(tok) * Int64(n) + row) * 2,
                                             acc[(at * lay.n_tiles + nt) * 4 + reg], tok, m)
    else:
        plane = Int64(m) * Int64(n)
        for at in cutlass.range_constexpr(lay.a_tiles):
            for nt in cutlass.range_constexpr(lay.n_tiles):
                for reg in cutlass.range_constexpr(4):
                    row = row0 + Int64(16 * at + 8 * (reg >> 1)) + Int64(g)
                    tok = 8 * nt + (reg & 1) + 2 * t4
                    dst = Int64(part) + (Int64(s) * plane + Int64(tok) * Int64(n) + row) * 4
                    ptx.st_global_f32_if(dst, acc[(at * lay.n_tiles + nt) * 4 + reg], tok, m)
        ptx.fence_acq_rel_gpu()
        ptx.sync_warp()
        counter = Int64(counters) + tile * 4
        old = ptx.warp_ticket(counter, lane)
        if old == Uint32(splits - 1):
            ptx.fence_acq_rel_gpu()
            if lane == 0:
                ptx.st_global_b32(counter, Uint32(0))
            for at in cutlass.range_constexpr(lay.a_tiles):
                for nt in cutlass.range_constexpr(lay.n_tiles):
                    for reg in cutlass.range_constexpr(4):
                        row = row0 + Int64(16 * at + 8 * (reg >> 1)) + Int64(g)
                        tok = 8 * nt + (reg & 1) + 2 * t4
                        col = Int64(_min(tok, Int32(m) - 1)) * Int64(n) + row
                        red = cute.make_rmem_tensor(1, cutlass.Float32)
                        red[0] = ptx.ld_global_cg_f32(Int64(part) + col * 4)
                        for sp in cutlass.range(1, splits, unroll=1):
                            p_s = ptx.ld_global_cg_f32(Int64(part) + (col + Int64(sp) * plane) * 4)
                            red[0] = ptx.add_rn(red[0], p_s)
                        ptx.st_global_bf16_rn_if(Int64(out) + col * 2, red[0], tok, m)


def fragment_offsets(lay, warp, lane, m) -> tuple:
    """``(a_off, pieces, b_off)``: this lane's ``ldmatrix`` row addresses
    (bytes from a stage's start). The weight's: ``a_off[at] + pieces[kk %
    4]`` in box ``kk // 4`` (``box_bytes`` apart) for 16-column step ``kk``:
    matrix ``q = lane >> 3`` of weight tile ``at`` is rows ``+8 (q & 1)``,
    columns ``+8 (q >> 1)`` (registers a0..a3), its 16-byte piece of the
    128-byte row XOR-permuted by ``row & 7`` (= ``lane & 7``) as TMA's
    128-byte swizzle wrote it. x's: ``b_off[pair] + 32 kk``: tokens ``16
    pair + 8 (q >> 1)``, columns ``+8 (q & 1)`` (b0, b1 of token tile ``2
    pair``, then ``2 pair + 1``), a token past ``m`` reading row ``m - 1``."""
    q = lane >> 3
    a_off = [(warp * lay.w_rows + 16 * at + (q & 1) * 8 + (lane & 7)) * (2 * BOX_COLUMNS)
             for at in range(lay.a_tiles)]
    pieces = [((2 * j + (q >> 1)) ^ (lane & 7)) * 16 for j in range(4)]
    b_off = [lay.x_offset + _min(16 * pr + (q >> 1) * 8 + (lane & 7), m - 1) * lay.x_stride + (q & 1) * 16
             for pr in range(max(1, lay.n_tiles // 2))]
    return a_off, pieces, b_off


def chunk_mmas(lay, acc, a_off: list, pieces: list, b_off: list, stage, x_stage=None) -> None:
    """One chunk's MMAs from the weight stage at shared byte address
    ``stage`` and x's columns at ``x_stage`` (default: the same stage): its
    16-column steps in order; per step the B ``ldmatrix`` (x2 for one token
    tile, else one x4 per tile pair), then per weight tile its A
    ``ldmatrix.x4`` and one MMA per token tile (traced inline)."""
    x_stage = stage if x_stage is None else x_stage
    for kk in range(lay.steps):
        bs = []
        if lay.n_tiles == 1:
            bs.append(ptx.ldmatrix_x2(x_stage + b_off[0] + 32 * kk))
        else:
            for pr in range(lay.n_tiles // 2):
                words = ptx.ldmatrix_x4(x_stage + b_off[pr] + 32 * kk)
                bs += [words[0:2], words[2:4]]
        for at in range(lay.a_tiles):
            a = ptx.ldmatrix_x4(stage + (kk // 4) * lay.box_bytes + a_off[at] + pieces[kk % 4])
            for nt in range(lay.n_tiles):
                i = (at * lay.n_tiles + nt) * 4
                d = ptx.mma_bf16(a, bs[nt], [acc[i + r] for r in range(4)])
                for r in range(4):
                    acc[i + r] = d[r]


__all__ = ["chunk_mmas", "fragment_offsets", "warp_epilogue"]
