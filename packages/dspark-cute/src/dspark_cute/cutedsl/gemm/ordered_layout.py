"""The ordered GEMM's launch layout and index maps
(``dspark_cute.cutedsl.gemm.ordered``): the shared-memory layout of a
launch variant (``OrderedLayout``), the copies, the swizzle and the
``ldmatrix`` rows of the MMA fragments, the split chunks of an order, and
the launch settings (speed only: every setting gives the same bits). Plain
integer arithmetic: traced in the kernel, evaluated on Python ints by the
CPU tests, which emulate ``ldmatrix`` and the MMA fragments from it."""

from __future__ import annotations

from dataclasses import dataclass

from dspark_core import checks
from dspark_core.contracts.limits import ORDERED_GEMM_K_UNIT, ORDERED_GEMM_MAX_ROWS, ORDERED_GEMM_N_UNIT
from dspark_core.errors import Unsupported
from dspark_core.spec.split_order import SplitOrder

# The contract's limits (``dspark_core.contracts.limits``), which these state:
CHUNK = ORDERED_GEMM_K_UNIT  # K columns of the narrowest ring stage (every order's bounds are multiples)
CHUNKS = (64, 128, 256)  # the ring stage widths (a launch setting: the same bits)
MAX_ROWS = ORDERED_GEMM_MAX_ROWS  # 8 token tiles of 8
TILE_ROWS = ORDERED_GEMM_N_UNIT  # weight rows per warp (one MMA tile)
N_TILES = (1, 2, 4, 8)
WARPS = (1, 2, 4, 8)
SMEM_LIMIT = 227 * 1024  # the most shared memory one sm_90 / sm_100 CTA may take


def n_tiles_for(m: int) -> int:
    """The 8-token MMA tiles a call of ``m`` rows needs (1, 2, 4 or 8).
    TypeError or ValueError for a row count that is no int from 1 to
    ``8 N_TILES[-1]`` (64)."""
    m = checks.integer("the row count m", m, 1, 8 * N_TILES[-1])
    return next(t for t in N_TILES if m <= 8 * t)


@dataclass(frozen=True)
class OrderedLayout:
    """Shared memory of one variant (bytes): the weight ring, the x ring, the
    epilogue's FP32 tile (aliasing the rings) and the last-CTA flag."""

    warps: int
    n_tiles: int
    stages: int
    chunk: int = CHUNK

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def row_bytes(self) -> int:
        """One weight or x row of a chunk: ``chunk / 8`` pieces of 16 bytes."""
        return 2 * self.chunk

    @property
    def steps(self) -> int:
        """16-column MMA steps per chunk."""
        return self.chunk // 16

    @property
    def w_copies(self) -> int:
        """16-byte weight copies per thread and chunk (16 warps rows x chunk / 8 pieces over 32 warps threads)."""
        return self.chunk // 16

    @property
    def rows(self) -> int:
        return TILE_ROWS * self.warps

    @property
    def w_stage(self) -> int:
        return self.rows * self.row_bytes

    @property
    def x_stage(self) -> int:
        return 8 * self.n_tiles * self.row_bytes

    @property
    def x_ring(self) -> int:
        return self.stages * self.w_stage

    @property
    def e_stride(self) -> int:
        """Floats per token row of the epilogue tile (even: 8-byte pairs)."""
        return self.rows + 4

    @property
    def flag(self) -> int:
        rings = self.stages * (self.w_stage + self.x_stage)
        tile = 8 * self.n_tiles * self.e_stride * 4
        return max(rings, tile)

    @property
    def total(self) -> int:
        return self.flag + 16

    @property
    def x_copies(self) -> int:
        """16-byte x copies per thread and chunk (the last round partly idle)."""
        return -(-8 * self.n_tiles * self.chunk // 8 // self.threads)

    @property
    def x_pieces(self) -> int:
        """16-byte pieces of x a chunk has."""
        return 8 * self.n_tiles * self.chunk // 8


def check_settings(n_tiles: int, warps: int, stages: int, chunk: int = CHUNK) -> OrderedLayout:
    """The layout of a launch variant; ValueError for settings it does not have."""
    if checks.as_int(n_tiles) not in N_TILES:
        raise ValueError(f"the ordered GEMM's token tiles are one of {N_TILES}, not {n_tiles!r}")
    if checks.as_int(warps) not in WARPS:
        raise ValueError(f"the ordered GEMM's CTAs have one of {WARPS} warps, not {warps!r}")
    if checks.as_int(stages) is None or not 2 <= stages <= 16:
        raise ValueError(f"the ordered GEMM's ring holds 2 to 16 stages, not {stages!r}")
    if checks.as_int(chunk) not in CHUNKS:
        raise ValueError(f"the ordered GEMM's ring stages are one of {CHUNKS} columns wide, not {chunk!r}")
    lay = OrderedLayout(warps, n_tiles, stages, chunk)
    if lay.total > SMEM_LIMIT:
        raise ValueError(f"{stages} stages of {chunk} columns, {warps} warps and {n_tiles} token tiles take "
                         f"{lay.total} bytes of shared memory, more than {SMEM_LIMIT}")
    return lay


# ---------------------------------------------------------------- index maps


def swizzle(lay: OrderedLayout, row, piece):
    """Byte offset in a ring stage of 16-byte ``piece`` (0 .. chunk / 8 - 1)
    of ``row``: each 128-byte group's 8 pieces XOR-permuted by ``row & 7``
    (the 8 rows an ldmatrix phase reads hit 8 different bank groups)."""
    return row * lay.row_bytes + ((piece ^ (row & 7)) * 16)


def w_copy(lay: OrderedLayout, tid, j: int) -> tuple:
    """``(row, piece)`` of weight copy ``j`` (0 .. w_copies - 1) of thread ``tid``."""
    idx = tid + lay.threads * j
    per_row = lay.chunk // 8
    return idx // per_row, idx % per_row


def x_copy(lay: OrderedLayout, tid, j: int) -> tuple:
    """``(index, token, piece)`` of x copy ``j`` of thread ``tid`` (the copy
    happens where ``index < x_pieces``)."""
    idx = tid + lay.threads * j
    per_row = lay.chunk // 8
    return idx, idx // per_row, idx % per_row


def a_address(lay: OrderedLayout, warp, lane, kk: int):
    """Byte offset in a weight stage of the row this lane gives the A
    ``ldmatrix.x4`` of 16-column step ``kk``: matrix ``q = lane >> 3`` is
    rows ``+8 (q & 1)``, columns ``+8 (q >> 1)``: registers a0..a3 of the
    m16n8k16 A fragment."""
    q = lane >> 3
    row = TILE_ROWS * warp + (q & 1) * 8 + (lane & 7)
    return swizzle(lay, row, 2 * kk + (q >> 1))


def b_address(lay: OrderedLayout, lane, kk: int, pair: int):
    """Byte offset in an x stage of the row this lane gives the B
    ``ldmatrix.x4`` of step ``kk`` and token tiles ``2 pair``, ``2 pair + 1``:
    matrix ``q`` is tokens ``16 pair + 8 (q >> 1)``, columns ``+8 (q & 1)``
    (registers b0, b1 of tile ``2 pair``, then of ``2 pair + 1``). With one
    token tile (``ldmatrix.x2``) lanes 0-15 give tokens 0-7 of both halves."""
    q = lane >> 3
    token = 16 * pair + (q >> 1) * 8 + (lane & 7)
    return swizzle(lay, token, 2 * kk + (q & 1))


def acc_coords(warp, lane, n_tile: int, reg: int) -> tuple:
    """``(row in the CTA tile, token)`` of accumulator ``reg`` (c0..c3) of token tile ``n_tile``."""
    g, t = lane >> 2, lane & 3
    return TILE_ROWS * warp + g + 8 * (reg >> 1), 8 * n_tile + 2 * t + (reg & 1)


def split_chunks(k: int, tile_chunks, splits, s, minimum=min, chunk: int = CHUNK) -> tuple:
    """``(first chunk, chunk count)`` of split ``s`` (``SplitOrder.bounds``
    in ``chunk``-column chunks: ``tile_chunks`` chunks a tile)."""
    tiles = (k // chunk) // tile_chunks
    q = tiles // splits
    r = tiles - q * splits
    first = s * q + minimum(s, r)
    stop = (s + 1) * q + minimum(s + 1, r)
    return first * tile_chunks, (stop - first) * tile_chunks


# ---------------------------------------------------------------- launch settings


# The L2 prefetch before the PDL wait covers about this many bytes over the
# whole grid (a part of the 50 MB L2 the next kernel's inputs do not need).
L2_PREFETCH_BYTES = 12 << 20


def launch_settings(n: int, splits: int, m: int, sms: int = 132, chunk: int = CHUNK) -> tuple:
    """``(n_tiles, warps, stages, chunk, l2_chunks)`` of a launch of
    ``splits`` splits and ``m`` rows over ``n`` outputs on ``sms`` SMs
    (speed only: every setting gives the same bits). Warps: 8 a CTA where
    that still gives 1.5 CTAs an SM, else 4 where it gives 0.9, else 2 or 1;
    stages: as many (up to 8) as the CTAs each SM then holds leave shared
    memory for; ``chunk``-column stages (narrower where an order's bounds
    need it: ``fit_chunk``); ``l2_chunks``: the chunks past the ring each
    CTA prefetches into L2 before the wait, about ``L2_PREFETCH_BYTES`` in
    all (the measured sweep: ``bench_ordered_gemm --sweep``)."""
    n_tiles = n_tiles_for(m)

    def ctas(w: int) -> int:
        return n // (TILE_ROWS * w) * splits if n % (TILE_ROWS * w) == 0 else 0

    warps = next((w for w, share in ((8, 1.5), (4, 0.9), (2, 0.0)) if ctas(w) >= share * sms), 1)
    per_sm = -(-ctas(warps) // max(1, sms))
    stages = 8
    while stages > 2 and per_sm * OrderedLayout(warps, n_tiles, stages, chunk).total > SMEM_LIMIT:
        stages -= 1
    per_cta = L2_PREFETCH_BYTES // max(1, ctas(warps))
    l2_chunks = max(0, min(16, per_cta // OrderedLayout(warps, n_tiles, stages, chunk).w_stage))
    return n_tiles, warps, stages, chunk, l2_chunks


def chunk_tiles(order: SplitOrder, k: int, chunk: int) -> int | None:
    """The order's tile in ``chunk``-column chunks such that ``split_chunks``
    gives its bounds: its own tile where ``chunk`` divides it, ``K / splits``
    where the splits are even and ``chunk`` divides that; else None."""
    if order.tile % chunk == 0:
        return order.tile // chunk
    if (k // order.tile) % order.splits == 0 and (k // order.splits) % chunk == 0:
        return k // order.splits // chunk
    return None


def fit_chunk(order: SplitOrder, k: int, chunk: int) -> tuple[int, int]:
    """``(chunk, tile_chunks)``: the widest stage width up to ``chunk`` that
    divides ``k`` and expresses the order (``chunk_tiles``); 64 always does."""
    while chunk > CHUNK and (k % chunk or chunk_tiles(order, k, chunk) is None):
        chunk //= 2
    return chunk, chunk_tiles(order, k, chunk)


def check_k(k: int, chunk: int, what: str) -> None:
    """``Unsupported`` unless ``k`` is a positive multiple of ``CHUNK``,
    ValueError unless ``chunk``-column stages divide it (``what``: the
    kernel's name in the messages)."""
    if k <= 0 or k % CHUNK:
        raise Unsupported(f"{what} takes K a positive multiple of {CHUNK}, not {k}")
    if k % chunk:
        raise ValueError(f"{chunk}-column stages do not divide K = {k}")


def order_problem(order, k: int) -> str | None:
    """Why the kernel cannot run ``order`` over ``k`` columns (a sentence), or None."""
    if not isinstance(order, SplitOrder):
        return f"an order is a SplitOrder, not {type(order).__name__}"
    if order.tile % CHUNK:
        return f"the ordered GEMM runs orders of {CHUNK}-column multiples as tiles, not {order.tile}"
    return order.problem(k)


__all__ = ["CHUNK", "CHUNKS", "L2_PREFETCH_BYTES", "MAX_ROWS", "N_TILES", "OrderedLayout", "SMEM_LIMIT", "TILE_ROWS",
           "WARPS", "a_address", "acc_coords", "b_address", "check_k", "check_settings", "chunk_tiles", "fit_chunk",
           "launch_settings", "n_tiles_for", "order_problem", "split_chunks", "swizzle", "w_copy", "x_copy"]
