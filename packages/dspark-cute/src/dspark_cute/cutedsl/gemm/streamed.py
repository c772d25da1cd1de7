"""The streamed ordered GEMM: the ordered GEMM's sums
(``dspark_cute.cutedsl.gemm.ordered``: ``y = x[m, K] @ W[N, K]^T`` in BF16,
1 <= m <= 64, summed in a ``SplitOrder``) with the weight moved by the copy
engine instead of the threads.

**Order** (the same as the ordered GEMM's, so the same bits, and cuBLAS's
where the build-time check found cuBLAS's order): the split ``s`` of CTA row
``blockIdx.y`` covers its ``SplitOrder.bounds`` columns; one FP32
accumulator per output from +0.0, one ``mma.sync.m16n8k16`` (BF16 in, FP32
accumulate) per 16 columns in increasing column order, the MMA's K the
contiguous 16 columns (``ldmatrix``, no permutation of K); one split is
rounded to BF16 (``cvt.rn.bf16x2.f32``); with ``S > 1`` each warp stores its
FP32 partial and the last of the ``S`` warps of an output tile to finish (a
GPU-scope counter per tile) adds the partials in split order (``add.rn.f32``
from ``p_0``), rounds once and resets the counter.

**Movement.** A CTA owns ``warps x 16 a_tiles`` weight rows (each warp
``16 a_tiles`` of them, its MMA tiles) and streams them with the ``m`` rows
of x through a ``stages``-deep shared-memory ring of ``chunk``-column
stages. Warp 0 is also the producer: a stage is ``chunk / 64`` TMA boxes of
the weight (64 columns by the CTA's rows, 128-byte swizzled: a row's eight
16-byte pieces XOR-permuted by ``row & 7``, so the ``ldmatrix`` rows of a
phase fall in 8 different bank groups) and one ``cp.async.bulk`` per x row
(``2 chunk`` bytes at a stride of ``2 chunk + 16``), all completing on the
stage's "full" barrier. Each warp waits on it, runs its MMAs and arrives on
the stage's "empty" barrier; warp 0 waits for every warp's arrival and
refills the stage with the chunk ``stages`` ahead. x's rows past ``m`` are
never copied: the ``ldmatrix`` rows of tokens past ``m`` read row ``m - 1``
(an MMA's output columns are independent, and those outputs are not
stored).

**PDL.** The barriers' initialisation and the weight boxes of the first
``stages`` chunks precede ``griddepcontrol.wait`` (the weight is constant
while a step runs), x's copies follow it; the dependents are released after
the main loop; outputs, partials and counters are written after the wait.

Host side: ``StreamedLayout`` and ``streamed_settings`` (the launch
settings: speed only) here; the weight's tensor map is
``dspark_cute.runtime.tensormap``'s; the launches go through ``ordered``'s
host classes, which choose this kernel or the ``cp.async`` one per row
count.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from dspark_core import checks
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.mma import chunk_mmas, fragment_offsets, warp_epilogue  # noqa: F401 (re-exported)
from dspark_cute.cutedsl.gemm.ordered_layout import CHUNK, MAX_ROWS, SMEM_LIMIT, TILE_ROWS, check_k, split_chunks
from dspark_cute.runtime.host import fake_stream, jit_cache, smem_allocator
from dspark_cute.runtime.tensormap import BOX_COLUMNS

A_TILES = (1, 2, 4)  # 16-row MMA tiles of the weight per warp
STREAMED_CHUNKS = (64, 128, 256, 512, 1024)  # stage widths in columns (chunk / 64 TMA boxes a stage)
X_ROWS = (1, 2, 4, 8, 16, 32, 64)  # x rows a variant's stages hold (m <= x_rows)
WARPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class StreamedLayout:
    """Shared memory of one variant (bytes): ``stages`` stages, each the
    weight's ``chunk / 64`` boxes (``rows`` rows of 128 bytes each) then
    ``x_rows`` x rows of ``x_stride`` bytes, padded to 1024 bytes (the
    128-byte swizzle's period); then the stages' "full" and "empty"
    barriers (8 bytes each)."""

    warps: int
    a_tiles: int
    x_rows: int
    stages: int
    chunk: int

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def n_tiles(self) -> int:
        """8-token MMA tiles (the B operand) per step."""
        return -(-self.x_rows // 8)

    @property
    def w_rows(self) -> int:
        """Weight rows (outputs) of a warp."""
        return TILE_ROWS * self.a_tiles

    @property
    def rows(self) -> int:
        """Weight rows (outputs) of a CTA: a TMA box's rows."""
        return self.w_rows * self.warps

    @property
    def boxes(self) -> int:
        return self.chunk // BOX_COLUMNS

    @property
    def box_bytes(self) -> int:
        return self.rows * 2 * BOX_COLUMNS

    @property
    def copy_bytes(self) -> int:
        """One row's bytes per stage."""
        return 2 * self.chunk

    @property
    def x_stride(self) -> int:
        """An x row's bytes in a stage: its copy and 16 bytes of padding."""
        return self.copy_bytes + 16

    @property
    def x_offset(self) -> int:
        return self.boxes * self.box_bytes

    @property
    def stage(self) -> int:
        return -(-(self.x_offset + self.x_rows * self.x_stride) // 1024) * 1024

    @property
    def bars(self) -> int:
        return self.stages * self.stage

    @property
    def total(self) -> int:
        return self.bars + 16 * self.stages

    @property
    def steps(self) -> int:
        return self.chunk // 16


def streamed_layout(warps: int, a_tiles: int, x_rows: int, stages: int, chunk: int) -> StreamedLayout:
    """The layout of a launch variant; ValueError for settings it does not have."""
    for name, value, allowed in (("warps", warps, WARPS), ("a_tiles", a_tiles, A_TILES), ("x_rows", x_rows, X_ROWS),
                                 ("chunk", chunk, STREAMED_CHUNKS)):
        if checks.as_int(value) not in allowed:
            raise ValueError(f"the streamed GEMM's {name} is one of {allowed}, not {value!r}")
    if checks.as_int(stages) is None or not 2 <= stages <= 16:
        raise ValueError(f"the streamed GEMM's rings hold 2 to 16 stages, not {stages!r}")
    lay = StreamedLayout(warps, a_tiles, x_rows, stages, chunk)
    if lay.rows > 256:
        raise ValueError(f"a TMA box has at most 256 rows: {warps} warps of {a_tiles} weight tiles have {lay.rows}")
    if lay.total > SMEM_LIMIT:
        raise ValueError(f"{warps} warps of {stages} stages of {chunk} columns ({a_tiles} weight tiles, {x_rows} x "
                         f"rows) take {lay.total} bytes of shared memory, more than {SMEM_LIMIT}")
    return lay


def x_rows_for(m: int) -> int:
    """The x rows of the variant that runs ``m`` rows (the next power of two)."""
    return next(r for r in X_ROWS if m <= r)


def _min(a, b):
    return cutlass.min(Int32(a), Int32(b))


class StreamedGemmKernel:
    """The traced GEMM of K = ``k`` columns (module docstring) with the
    layout of ``warps``, ``a_tiles``, ``x_rows``, ``stages``, ``chunk`` and
    ``pdl``. Call: ``(x, tensormap, out, part, counters, m, n, tile_chunks,
    splits, stream)`` as ``OrderedGemmKernel``'s but the weight given by the
    global address of its tensor map (``weight_tensormap(weight, rows)``),
    ``m`` at most ``x_rows``, ``n`` a multiple of the CTA's rows; counters:
    one int32 per ``16 a_tiles`` outputs, zero between launches."""

    def __init__(self, k: int, warps: int, a_tiles: int, x_rows: int, stages: int, pdl: bool,
                 chunk: int = CHUNK, early: bool = False) -> None:
        self.lay = streamed_layout(warps, a_tiles, x_rows, stages, chunk)
        self.early = bool(early)
        check_k(k, chunk, "the streamed GEMM")
        self.k, self.pdl = k, bool(pdl)

    @cute.jit
    def __call__(self, x: Int64, tensormap: Int64, out: Int64, part: Int64, counters: Int64, m: Int32, n: Int32,
                 tile_chunks: Int32, splits: Int32, stream):
        self.kernel(x, tensormap, out, part, counters, m, n, tile_chunks, splits).launch(
            grid=[n // self.lay.rows, splits, 1], block=[self.lay.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: Int64, tensormap: Int64, out: Int64, part: Int64, counters: Int64, m: Int32, n: Int32,
               tile_chunks: Int32, splits: Int32):
        lay, k = self.lay, self.k
        bx, s, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = Int32(cute.arch.lane_idx())
        base = Int32(smem_allocator().allocate(lay.total, 1024).toint())
        chunk0, nchunks = split_chunks(k, Int32(tile_chunks), Int32(splits), Int32(s), _min, lay.chunk)
        tile = Int64(bx) * lay.warps + Int64(warp)  # this warp's output tile
        cta_row = Int32(bx) * lay.rows
        full = base + lay.bars
        empty = full + 8 * lay.stages
        nbytes = (lay.rows + Int32(m)) * lay.copy_bytes
        col0 = Int32(chunk0) * lay.chunk

        # Warp 0's x copies: rows lane, lane + 32 (those below m).
        x_src, x_dst, x_tok = [], [], []
        for j in cutlass.range_constexpr(-(-lay.x_rows // 32)):
            t = lane + 32 * j
            tc = _min(t, Int32(m) - 1)
            x_src.append(Int64(x) + (Int64(tc) * k + Int64(col0)) * 2)
            x_dst.append(base + lay.x_offset + tc * lay.x_stride)
            x_tok.append(t)

        if warp == 0:
            if lane == 0:
                for st in cutlass.range_constexpr(lay.stages):
                    ptx.mbarrier_init(full + 8 * st, 1)
                    ptx.mbarrier_init(empty + 8 * st, lay.warps)
                ptx.fence_mbarrier_init()
        cute.arch.barrier()
        if cutlass.const_expr(self.pdl and self.early):
            # One wave: every CTA of this grid is resident, so the next
            # kernel's CTAs take only the slots this grid's CTAs leave and
            # stream their weight while its last CTAs finish.
            ptx.pdl_launch_dependents()
        # Prologue: the first stages' weight boxes, the PDL wait, x's copies.
        if warp == 0:
            if lane == 0:
                for c in cutlass.range_constexpr(lay.stages):
                    if Int32(c) < nchunks:
                        ptx.mbarrier_arrive_expect_tx(full + 8 * c, nbytes)
                        for b in cutlass.range_constexpr(lay.boxes):
                            ptx.tma_load_2d(base + c * lay.stage + b * lay.box_bytes, tensormap,
                                            col0 + c * lay.chunk + b * BOX_COLUMNS, cta_row, full + 8 * c)
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
        if warp == 0:
            for c in cutlass.range_constexpr(lay.stages):
                if Int32(c) < nchunks:
                    for j in cutlass.range_constexpr(len(x_src)):
                        ptx.bulk_copy_if(x_dst[j] + c * lay.stage, x_src[j] + c * lay.copy_bytes, lay.copy_bytes,
                                         full + 8 * c, x_tok[j], m)

        a_off, pieces, b_off = fragment_offsets(lay, Int32(warp), lane, Int32(m))
        acc = cute.make_rmem_tensor(4 * lay.n_tiles * lay.a_tiles, cutlass.Float32)
        zero = ptx.f32_const(0.0)
        for i in cutlass.range_constexpr(4 * lay.n_tiles * lay.a_tiles):
            acc[i] = zero
        for i in cutlass.range(nchunks, unroll=1):
            slot = i % lay.stages
            parity = (i // lay.stages) & 1
            ptx.mbarrier_wait(full + 8 * slot, parity)
            chunk_mmas(lay, acc, a_off, pieces, b_off, base + slot * lay.stage)
            ptx.sync_warp()  # every lane's reads of the slot are done
            if lane == 0:
                ptx.mbarrier_arrive(empty + 8 * slot)
            nxt = i + lay.stages
            if warp == 0:
                if nxt < nchunks:
                    ptx.mbarrier_wait(empty + 8 * slot, parity)
                    if lane == 0:
                        ptx.mbarrier_arrive_expect_tx(full + 8 * slot, nbytes)
                        for b in cutlass.range_constexpr(lay.boxes):
                            ptx.tma_load_2d(base + slot * lay.stage + b * lay.box_bytes, tensormap,
                                            col0 + nxt * lay.chunk + b * BOX_COLUMNS, cta_row, full + 8 * slot)
                    for j in cutlass.range_constexpr(len(x_src)):
                        ptx.bulk_copy_if(x_dst[j] + slot * lay.stage, x_src[j] + Int64(nxt) * lay.copy_bytes,
                                         lay.copy_bytes, full + 8 * slot, x_tok[j], m)
        if cutlass.const_expr(self.pdl and not self.early):
            # Dependents still wait for this grid's end before reading y.
            ptx.pdl_launch_dependents()

        warp_epilogue(lay, acc, out, part, counters, tile, lane, m, n, s, splits)


def fake_args() -> tuple:
    """The compile signature of ``StreamedGemmKernel`` (no GPU memory needed)."""
    return (Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), Int32(64), Int32(1), Int32(1), fake_stream())


@jit_cache("StreamedGemm")
def compile_streamed_gemm(k: int, warps: int, a_tiles: int, x_rows: int, stages: int, pdl: bool,
                          chunk: int = CHUNK, early: bool = False):
    """The compiled ``StreamedGemmKernel`` of one variant."""
    return StreamedGemmKernel(k, warps, a_tiles, x_rows, stages, bool(pdl), chunk, bool(early)), fake_args()


# ---------------------------------------------------------------- launch settings

# Weight bytes in flight an SM aims for (rings full): enough to cover HBM's
# latency at the SM's share of the bandwidth several times over.
IN_FLIGHT = 192 * 1024


def streamed_settings(n: int, splits: int, m: int, sms: int = 132, chunk: int = 256) -> tuple | None:
    """``("streamed", warps, a_tiles, x_rows, stages, chunk, early)`` for a launch
    of ``splits`` splits and ``m`` rows over ``n`` outputs on ``sms`` SMs, or
    None where ``n`` has no whole tile (speed only: every setting gives the
    same bits). Weight tiles: 1 a warp up to 16 rows, 2 up to 32, else 4;
    warps: the most (8 down to 1, a CTA at most 256 rows) that still give
    every SM a CTA, else the most that divide ``n``; chunk: the widest (up
    to ``chunk``) whose three stages fit the CTAs an SM then holds; stages:
    as many (2 to 8) as keep them within shared memory and about
    ``IN_FLIGHT`` bytes of weight in flight; early: the dependents released
    at the start (PDL) where every CTA is resident at once (one wave)."""
    if m > MAX_ROWS:
        return None
    a_tiles = 1 if m <= 16 else 2 if m <= 32 else 4
    x_rows = x_rows_for(m)
    fits = [w for w in (8, 4, 2, 1) if w * a_tiles * TILE_ROWS <= 256 and n % (TILE_ROWS * a_tiles * w) == 0]
    if not fits:
        return None
    warps = next((w for w in fits if n // (TILE_ROWS * a_tiles * w) * splits >= sms), fits[-1])
    ctas = n // (TILE_ROWS * a_tiles * warps) * splits
    per_sm = -(-ctas // max(1, sms))
    while chunk > CHUNK and per_sm * StreamedLayout(warps, a_tiles, x_rows, 3, chunk).total > SMEM_LIMIT:
        chunk //= 2
    rows = TILE_ROWS * a_tiles * warps
    stages = 8
    while stages > 2 and (per_sm * StreamedLayout(warps, a_tiles, x_rows, stages, chunk).total > SMEM_LIMIT
                          or per_sm * stages * rows * 2 * chunk > IN_FLIGHT):
        stages -= 1
    while StreamedLayout(warps, a_tiles, x_rows, stages, chunk).total > SMEM_LIMIT and chunk > CHUNK:
        chunk //= 2
    resident = SMEM_LIMIT // StreamedLayout(warps, a_tiles, x_rows, stages, chunk).total
    return ("streamed", warps, a_tiles, x_rows, stages, chunk, ctas <= resident * sms)


__all__ = ["A_TILES", "IN_FLIGHT", "STREAMED_CHUNKS", "StreamedGemmKernel", "StreamedLayout", "X_ROWS",
           "chunk_mmas", "compile_streamed_gemm", "fake_args", "fragment_offsets", "streamed_layout",
           "streamed_settings", "warp_epilogue", "x_rows_for"]
