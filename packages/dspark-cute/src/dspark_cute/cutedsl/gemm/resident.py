"""The resident-x ordered GEMM: the ordered GEMM's sums
(``dspark_cute.cutedsl.gemm.ordered``: ``y = x[m, K] @ W[N, K]^T`` in BF16,
summed in a ``SplitOrder``) for few rows, with x held whole in shared memory
and every warp streaming its own weight rows, so no warp ever waits for
another while the weight streams.

**Order** (the ordered GEMM's, so the same bits, and cuBLAS's where the
build-time check found cuBLAS's order): warp ``w`` of CTA ``(bx, s)`` owns
the 16 outputs from ``16 (bx warps + w)`` and split ``s``'s
``SplitOrder.bounds`` columns; one FP32 accumulator per output from +0.0,
one ``mma.sync.m16n8k16`` (BF16 in, FP32 accumulate) per 16 columns in
increasing column order, the MMA's K the contiguous 16 columns (``ldmatrix``,
no permutation of K); one split is rounded to BF16 (``cvt.rn.bf16x2.f32``);
with ``S > 1`` each warp stores its FP32 partial and the last of the ``S``
warps of an output tile (a GPU-scope counter per tile) adds the partials in
split order (``add.rn.f32`` from ``p_0``), rounds once and resets the counter
(``streamed.warp_epilogue``).

**Movement.** x's ``m`` rows of the split's columns are copied once into
shared memory (one ``cp.async.bulk`` per row, rows ``2 x_cols + 16`` bytes
apart so the ``ldmatrix`` rows of a phase fall in different bank groups)
and stay there. Each warp has its own ``stages``-deep ring of
``chunk``-column stages of its 16 weight rows (``chunk / 64`` TMA boxes of
16 rows by 64 columns, 128-byte swizzled) and its own "full" barrier per
stage: lane 0 refills a stage with the chunk ``stages`` ahead as soon as the
warp's own MMAs have read it. There is one CTA barrier, after the barriers'
initialisation; the warps of a CTA share only x.

**PDL.** Each warp's first ``stages`` chunks are requested before
``griddepcontrol.wait`` (the weight is constant while a step runs), x's
copies after it; the dependents are released after the main loop; outputs,
partials and counters are written after the wait.

Host side: ``ResidentLayout`` and ``resident_settings`` (the launch
settings: speed only); the launches go through ``ordered``'s host classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.ordered_layout import CHUNK, SMEM_LIMIT, TILE_ROWS, check_k, split_chunks
from dspark_cute.cutedsl.gemm.streamed import chunk_mmas, fake_args, fragment_offsets, warp_epilogue
from dspark_cute.runtime.host import jit_cache, smem_allocator
from dspark_cute.runtime.tensormap import BOX_COLUMNS

RESIDENT_CHUNKS = (64, 128, 256)  # stage widths in columns
RESIDENT_X_ROWS = (1, 2, 4, 8, 16)  # x rows a variant holds (m <= x_rows)
MAX_WARPS = 16
MAX_STAGES = 16
BOX_BYTES = TILE_ROWS * 2 * BOX_COLUMNS  # one warp's TMA box: 16 rows of 128 bytes


@dataclass(frozen=True)
class ResidentLayout:
    """Shared memory of one variant (bytes): the warps' rings (warp ``w``'s
    stage ``t`` at ``(w stages + t) stage``, 1024-byte aligned for the
    128-byte swizzle), then x (``x_rows`` rows of ``x_stride`` bytes), then
    the barriers (8 bytes each: the warps' "full" ones, then x's).
    ``x_cols``: the widest split's columns (x's copy of them)."""

    warps: int
    x_rows: int
    stages: int
    chunk: int
    x_cols: int
    a_tiles: int = 1
    x_offset: int = 0

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def n_tiles(self) -> int:
        return -(-self.x_rows // 8)

    @property
    def w_rows(self) -> int:
        return TILE_ROWS

    @property
    def box_bytes(self) -> int:
        return BOX_BYTES

    @property
    def steps(self) -> int:
        return self.chunk // 16

    @property
    def boxes(self) -> int:
        return self.chunk // BOX_COLUMNS

    @property
    def stage(self) -> int:
        return self.boxes * BOX_BYTES

    @property
    def x_stride(self) -> int:
        return 2 * self.x_cols + 16

    @property
    def x_base(self) -> int:
        return self.warps * self.stages * self.stage

    @property
    def bars(self) -> int:
        return -(-(self.x_base + self.x_rows * self.x_stride) // 8) * 8

    @property
    def total(self) -> int:
        return self.bars + 8 * (self.warps * self.stages + 1)


def resident_layout(warps: int, x_rows: int, stages: int, chunk: int, x_cols: int) -> ResidentLayout:
    """The layout of a launch variant; ValueError for settings it does not have."""
    for name, value, allowed in (("x_rows", x_rows, RESIDENT_X_ROWS), ("chunk", chunk, RESIDENT_CHUNKS)):
        if isinstance(value, bool) or value not in allowed:
            raise ValueError(f"the resident GEMM's {name} is one of {allowed}, not {value!r}")
    for name, value, top in (("warps", warps, MAX_WARPS), ("stages", stages, MAX_STAGES)):
        if isinstance(value, bool) or not isinstance(value, int) or not (2 if name == "stages" else 1) <= value <= top:
            raise ValueError(f"the resident GEMM's {name} is an int up to {top}, not {value!r}")
    if isinstance(x_cols, bool) or not isinstance(x_cols, int) or x_cols <= 0 or x_cols % CHUNK:
        raise ValueError(f"the resident GEMM holds a positive multiple of {CHUNK} x columns, not {x_cols!r}")
    lay = ResidentLayout(warps, x_rows, stages, chunk, x_cols)
    if lay.total > SMEM_LIMIT:
        raise ValueError(f"{warps} warps of {stages} stages of {chunk} columns and {x_rows} x rows of {x_cols} "
                         f"columns take {lay.total} bytes of shared memory, more than {SMEM_LIMIT}")
    return lay


class ResidentGemmKernel:
    """The traced GEMM of K = ``k`` columns (module docstring) with the
    layout of ``warps``, ``x_rows``, ``stages``, ``chunk``, ``x_cols`` and
    ``pdl``. Call: ``(x, tensormap, out, part, counters, m, n, tile_chunks,
    splits, stream)`` as ``StreamedGemmKernel``'s, the tensor map's boxes 16
    rows (``weight_tensormap(weight, 16)``), ``m`` at most ``x_rows``, ``n``
    a multiple of ``16 warps``, every split at most ``x_cols`` columns;
    counters: one int32 per 16 outputs, zero between launches."""

    def __init__(self, k: int, warps: int, x_rows: int, stages: int, chunk: int, x_cols: int, pdl: bool) -> None:
        self.lay = resident_layout(warps, x_rows, stages, chunk, x_cols)
        check_k(k, chunk, "the resident GEMM")
        if x_cols > k:
            raise ValueError(f"the resident GEMM holds at most K = {k} x columns, not {x_cols}")
        self.k, self.pdl = k, bool(pdl)

    @cute.jit
    def __call__(self, x: Int64, tensormap: Int64, out: Int64, part: Int64, counters: Int64, m: Int32, n: Int32,
                 tile_chunks: Int32, splits: Int32, stream):
        self.kernel(x, tensormap, out, part, counters, m, n, tile_chunks, splits).launch(
            grid=[n // (TILE_ROWS * self.lay.warps), splits, 1], block=[self.lay.threads, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: Int64, tensormap: Int64, out: Int64, part: Int64, counters: Int64, m: Int32, n: Int32,
               tile_chunks: Int32, splits: Int32):
        lay, k = self.lay, self.k
        bx, s, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = Int32(cute.arch.lane_idx())
        base = Int32(smem_allocator().allocate(lay.total, 1024).toint())
        chunk0, nchunks = split_chunks(k, Int32(tile_chunks), Int32(splits), Int32(s), _min, lay.chunk)
        tile = Int64(bx) * lay.warps + Int64(warp)  # this warp's 16 outputs
        row = Int32(tile) * TILE_ROWS
        col0 = Int32(chunk0) * lay.chunk
        ring = base + Int32(warp) * (lay.stages * lay.stage)
        full = base + lay.bars + Int32(warp) * (8 * lay.stages)
        x_bar = base + lay.bars + 8 * lay.warps * lay.stages
        xs = base + lay.x_base

        if lane == 0:
            for st in cutlass.range_constexpr(lay.stages):
                ptx.mbarrier_init(full + 8 * st, 1)
            if warp == 0:
                ptx.mbarrier_init(x_bar, 1)
            ptx.fence_mbarrier_init()
        cute.arch.barrier()  # x's barrier is every warp's
        # Prologue: each warp's first stages, the PDL wait, x's rows.
        if lane == 0:
            for c in cutlass.range_constexpr(lay.stages):
                if Int32(c) < nchunks:
                    load_stage(lay, ring + c * lay.stage, full + 8 * c, tensormap, col0 + c * lay.chunk, row)
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
        if warp == 0:
            x_bytes = nchunks * (2 * lay.chunk)
            if lane == 0:
                ptx.mbarrier_arrive_expect_tx(x_bar, Int32(m) * x_bytes)
            ptx.sync_warp()
            for j in cutlass.range_constexpr(-(-lay.x_rows // 32)):
                t = lane + 32 * j
                ptx.bulk_copy_sized_if(xs + t * lay.x_stride, Int64(x) + (Int64(t) * k + Int64(col0)) * 2, x_bytes,
                                       x_bar, t, m)
        ptx.mbarrier_wait(x_bar, 0)

        a_off, pieces, b_off = fragment_offsets(lay, Int32(0), lane, Int32(m))
        acc = cute.make_rmem_tensor(4 * lay.n_tiles, cutlass.Float32)
        zero = ptx.f32_const(0.0)
        for i in cutlass.range_constexpr(4 * lay.n_tiles):
            acc[i] = zero
        for i in cutlass.range(nchunks, unroll=1):
            slot = i % lay.stages
            ptx.mbarrier_wait(full + 8 * slot, (i // lay.stages) & 1)
            chunk_mmas(lay, acc, a_off, pieces, b_off, ring + slot * lay.stage, xs + i * (2 * lay.chunk))
            nxt = i + lay.stages
            if nxt < nchunks:
                ptx.sync_warp()  # every lane's reads of the slot are done
                if lane == 0:
                    load_stage(lay, ring + slot * lay.stage, full + 8 * slot, tensormap, col0 + nxt * lay.chunk, row)
        if cutlass.const_expr(self.pdl):
            # Dependents still wait for this grid's end before reading y.
            ptx.pdl_launch_dependents()
        warp_epilogue(lay, acc, out, part, counters, tile, lane, m, n, s, splits)


def _min(a, b):
    return cutlass.min(Int32(a), Int32(b))


def load_stage(lay: ResidentLayout, dst, bar, tensormap, column, row) -> None:
    """One stage's request (lane 0): ``stage`` bytes expected on ``bar``,
    then the ``chunk / 64`` TMA boxes of 16 rows from ``(column, row)``
    (traced inline)."""
    ptx.mbarrier_arrive_expect_tx(bar, lay.stage)
    for b in range(lay.boxes):
        ptx.tma_load_2d(dst + b * BOX_BYTES, tensormap, column + b * BOX_COLUMNS, row, bar)


@jit_cache("ResidentGemm")
def compile_resident_gemm(k: int, warps: int, x_rows: int, stages: int, chunk: int, x_cols: int, pdl: bool):
    """The compiled ``ResidentGemmKernel`` of one variant."""
    return ResidentGemmKernel(k, warps, x_rows, stages, chunk, x_cols, bool(pdl)), fake_args()


# ---------------------------------------------------------------- launch settings

# Shared memory an SM gives its CTAs (sm_90 / sm_100: 228 KiB, 1 KiB of it reserved per CTA).
SM_SMEM = 228 * 1024


def resident_x_cols(k: int, splits: int, tile: int = 256) -> int:
    """The columns of the widest of ``splits`` splits of ``k`` in tiles of
    at most ``tile`` columns: ``k`` for one split, else at most ``k / splits
    + tile`` (``SplitOrder.bounds``: the splits differ by one tile)."""
    if splits <= 1:
        return k
    return min(k, -(-k // splits // CHUNK) * CHUNK + tile)


def resident_settings(n: int, k: int, splits: int, m: int, sms: int = 132, chunk: int = CHUNK,
                      stages: int | None = None) -> tuple | None:
    """``("resident", warps, x_rows, stages, chunk, x_cols)`` for a launch of
    ``splits`` splits and ``m`` rows over a ``[n, k]`` weight on ``sms`` SMs,
    or None where no variant fits (speed only: every setting gives the same
    bits). Warps: the fewest (1 to 16, dividing ``n / 16``) that need no
    more CTAs than SMs, so every warp of the grid is resident at once and
    each has one tile of one split; else 16. Stages: as many (up to 12, or
    ``stages``) as the CTAs an SM then holds leave shared memory for,
    at least 2."""
    if m > RESIDENT_X_ROWS[-1] or n % TILE_ROWS or k % chunk:
        return None
    x_rows = next(r for r in RESIDENT_X_ROWS if m <= r)
    x_cols = resident_x_cols(k, splits)
    tiles = n // TILE_ROWS
    divisors = [w for w in range(1, MAX_WARPS + 1) if tiles % w == 0]
    warps = next((w for w in divisors if tiles // w * splits <= sms), divisors[-1])
    per_sm = -(-(tiles // warps * splits) // max(1, sms))
    top = stages or 12
    for st in range(top, 1, -1):
        lay = ResidentLayout(warps, x_rows, st, chunk, x_cols)
        if lay.total <= SMEM_LIMIT and per_sm * (lay.total + 1024) <= SM_SMEM:
            return ("resident", warps, x_rows, st, chunk, x_cols)
    return None


__all__ = ["MAX_STAGES", "MAX_WARPS", "RESIDENT_CHUNKS", "RESIDENT_X_ROWS", "ResidentGemmKernel", "ResidentLayout",
           "compile_resident_gemm", "load_stage", "resident_layout", "resident_settings", "resident_x_cols"]
