"""The ordered GEMM: ``y = x[m, K] @ W[N, K]^T`` in BF16 for 1 <= m <= 64,
summed in a ``SplitOrder`` (``dspark_core.spec.split_order``: the order
cuBLAS uses on the draft's projections), so that where the build-time check
(``dspark_core.runtime.gemm_check``) has found cuBLAS's order for a row
count, this kernel's output is cuBLAS's, bit for bit.

**Order** of one output ``y[r, n]`` (the spec's steps 1-4): the split ``s``
of CTA row ``blockIdx.y`` covers its ``SplitOrder.bounds`` columns; one FP32
accumulator per output from +0.0, one ``mma.sync.m16n8k16`` (BF16 in, FP32
accumulate) per 16 columns, in increasing column order, the MMA's K the
contiguous 16 columns of the step (``ldmatrix`` gives the PTX fragment
layout, no permutation of K); with one split the sum is rounded to BF16
(``cvt.rn.bf16x2.f32``); with ``S > 1`` every CTA stores its FP32 partial,
and the split's last CTA to finish (a GPU-scope counter per row tile) adds
the ``S`` partials in split order (``add.rn.f32``, from ``p_0``), rounds
once and resets the counter. No other arithmetic touches the values.

**Layout.** A CTA owns ``16 warps`` rows of ``W`` (warp ``w`` the 16 rows
``16 w ..``, one MMA tile) and one split; ``x``'s ``8 n_tiles`` token rows
(rows past ``m`` copy row ``m - 1``, their outputs discarded) are the MMA's
B operand (swap-AB: the weight is A). The split streams through a
``stages``-deep shared-memory ring of 64-column chunks: 16-byte ``cp.async``
copies (a warp copies four whole 128-byte row pieces per instruction),
XOR-swizzled by row so the ``ldmatrix`` reads are conflict-free; one CTA
barrier per chunk. ``stages - 1`` chunks are in flight while one is summed.

**PDL.** The weight copies of the first ``stages - 1`` chunks and an L2
prefetch of the next ``l2_chunks`` (one thread a 128-byte line) are issued
before ``griddepcontrol.wait`` (the weight is constant while a step runs),
x's copies after it; the dependents are released after the main loop. A
launch writes its output, partials and counters only after the wait.

Host side: ``OrderedGemm`` (bound to one weight; its order per row count
set by ``bind_orders``, which the check calls) and ``ordered_gemm`` (one
launch of an explicit order on any weight: the check's candidates). The
layout, the index maps and the launch settings are ``ordered_layout``. Both
launch either this kernel or the streamed one (``streamed``: the same sums,
the weight moved by TMA), by their launch settings (``choose_settings``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from dspark_core import checks
from dspark_core.contracts.constants import OrderedGemmConstants, ordered_gemm_unsupported, within_limits
from dspark_core.errors import Unsupported
from dspark_core.runtime import gemm_check, gemm_decide
from dspark_core.spec.split_order import SplitOrder
from dspark_core.switches import flag
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm import decide as timing
from dspark_cute.cutedsl.gemm.decide import STREAMED_MAX_BYTES, STREAMED_MAX_ROWS, choose_settings
from dspark_cute.cutedsl.gemm.ordered_layout import (  # noqa: F401 (re-exported)
    CHUNK,
    CHUNKS,
    L2_PREFETCH_BYTES,
    MAX_ROWS,
    N_TILES,
    SMEM_LIMIT,
    TILE_ROWS,
    WARPS,
    OrderedLayout,
    a_address,
    acc_coords,
    b_address,
    check_k,
    check_settings,
    chunk_tiles,
    fit_chunk,
    launch_settings,
    n_tiles_for,
    order_problem,
    split_chunks,
    swizzle,
    w_copy,
    x_copy,
)
from dspark_cute.cutedsl.gemm.streamed import compile_streamed_gemm
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import LazyPdl, current_stream, describe, fake_stream, jit_cache, sm_count, smem_allocator
from dspark_cute.runtime.tensormap import weight_tensormap

# ---------------------------------------------------------------- the kernel


def _min(a, b):
    return cutlass.min(Int32(a), Int32(b))


class OrderedGemmKernel:
    """The traced GEMM of K = ``k`` columns, ``n_tiles`` token tiles,
    ``warps`` warps a CTA, a ``stages``-deep ring of ``chunk``-column
    stages, ``l2_chunks`` chunks prefetched into L2 before the PDL wait,
    ``pdl``. Call: ``(x, weight, out, part, counters, m, n, tile_chunks,
    splits, stream)``: the
    byte addresses (Int64) of x (BF16 ``[m, k]``), the weight (BF16 ``[n,
    k]``), y (BF16 ``[m, n]``), the partials (FP32 ``[splits, m, n]``) and
    the counters (int32 ``[n / (16 warps)]``, zero between launches); ``m``
    (1 .. 8 n_tiles), ``n`` (a multiple of 16 warps), the order's tile in
    chunks and its split count (Int32)."""

    def __init__(self, k: int, n_tiles: int, warps: int, stages: int, pdl: bool, chunk: int = CHUNK,
                 l2_chunks: int = 0) -> None:
        self.lay = check_settings(n_tiles, warps, stages, chunk)
        if isinstance(l2_chunks, bool) or not isinstance(l2_chunks, int) or not 0 <= l2_chunks <= 64:
            raise ValueError(f"the ordered GEMM prefetches 0 to 64 chunks into L2, not {l2_chunks!r}")
        self.l2_chunks = l2_chunks
        check_k(k, chunk, "the ordered GEMM")
        self.k, self.pdl = k, bool(pdl)

    @cute.jit
    def __call__(self, x: Int64, weight: Int64, out: Int64, part: Int64, counters: Int64, m: Int32, n: Int32,
                 tile_chunks: Int32, splits: Int32, stream):
        self.kernel(x, weight, out, part, counters, m, n, tile_chunks, splits).launch(
            grid=[n // self.lay.rows, splits, 1], block=[self.lay.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: Int64, weight: Int64, out: Int64, part: Int64, counters: Int64, m: Int32, n: Int32,
               tile_chunks: Int32, splits: Int32):
        lay, k = self.lay, self.k
        tidx, _, _ = cute.arch.thread_idx()
        bx, s, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        base = Int32(smem_allocator().allocate(lay.total, 128).toint())
        chunk0, nchunks = split_chunks(k, Int32(tile_chunks), Int32(splits), Int32(s), _min, lay.chunk)
        row0 = Int64(bx) * lay.rows
        rb = lay.row_bytes

        # Each thread's copy sources (at chunk 0 of its split) and ring offsets.
        w_src, w_dst = [], []
        for j in cutlass.range_constexpr(lay.w_copies):
            r, p = w_copy(lay, Int32(tidx), j)
            w_src.append(Int64(weight) + ((row0 + Int64(r)) * k + Int64(chunk0) * lay.chunk + Int64(p) * 8) * 2)
            w_dst.append(base + swizzle(lay, r, p))
        x_src, x_dst, x_idx = [], [], []
        for j in cutlass.range_constexpr(lay.x_copies):
            idx, tok, p = x_copy(lay, Int32(tidx), j)
            src_tok = _min(tok, Int32(m) - 1)
            x_src.append(Int64(x) + (Int64(src_tok) * k + Int64(chunk0) * lay.chunk + Int64(p) * 8) * 2)
            x_dst.append(base + lay.x_ring + swizzle(lay, tok, p))
            x_idx.append(idx)
        x_limit = lay.x_pieces

        # Prologue: the first stages - 1 chunks' weight, an L2 prefetch of
        # the next l2_chunks (one thread a 128-byte line), the PDL wait,
        # then x's copies.
        for c in cutlass.range_constexpr(lay.stages - 1):
            for j in cutlass.range_constexpr(lay.w_copies):
                ptx.cp_async_16_pred(w_dst[j] + c * lay.w_stage, w_src[j] + c * rb, Int32(c), nchunks)
        for c in cutlass.range_constexpr(lay.stages - 1, lay.stages - 1 + self.l2_chunks):
            for j in cutlass.range_constexpr(lay.w_copies):
                # The thread that copies a 128-byte line's first piece
                # prefetches the line: c + (piece & 7) * nchunks < nchunks
                # holds exactly where piece & 7 == 0 and c < nchunks.
                _, piece = w_copy(lay, Int32(tidx), j)
                ptx.prefetch_l2_if(w_src[j] + c * rb, Int32(c) + (piece & 7) * nchunks, nchunks)
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
        for c in cutlass.range_constexpr(lay.stages - 1):
            for j in cutlass.range_constexpr(lay.x_copies):
                ptx.cp_async_16_if(x_dst[j] + c * lay.x_stage, x_src[j] + c * rb, x_idx[j], x_limit,
                                   Int32(c), nchunks)
            ptx.cp_async_commit()

        a_off, b_off = fragment_offsets(lay, base, Int32(warp), Int32(lane))
        acc = cute.make_rmem_tensor(4 * lay.n_tiles, cutlass.Float32)
        zero = ptx.f32_const(0.0)
        for i in cutlass.range_constexpr(4 * lay.n_tiles):
            acc[i] = zero
        for i in cutlass.range(nchunks, unroll=1):
            # Chunk i has landed (this thread's copies), then every thread's;
            # the slot read in iteration i - 1 is free again.
            ptx.cp_async_wait(lay.stages - 2)
            cute.arch.barrier()
            nxt = i + (lay.stages - 1)
            slot_n = nxt % lay.stages
            for j in cutlass.range_constexpr(lay.w_copies):
                ptx.cp_async_16_pred(w_dst[j] + slot_n * lay.w_stage, w_src[j] + Int64(nxt) * rb, nxt, nchunks)
            for j in cutlass.range_constexpr(lay.x_copies):
                ptx.cp_async_16_if(x_dst[j] + slot_n * lay.x_stage, x_src[j] + Int64(nxt) * rb, x_idx[j],
                                   x_limit, nxt, nchunks)
            ptx.cp_async_commit()
            slot = i % lay.stages
            chunk_mmas(lay, acc, a_off, b_off, slot * lay.w_stage, slot * lay.x_stage)
        ptx.cp_async_wait_all()
        if cutlass.const_expr(self.pdl):
            # Dependents still wait for this grid's end before reading y.
            ptx.pdl_launch_dependents()
        cute.arch.barrier()  # every ring read done: the epilogue tile reuses it

        for nt in cutlass.range_constexpr(lay.n_tiles):
            for reg in cutlass.range_constexpr(4):
                row, tok = acc_coords(Int32(warp), Int32(lane), nt, reg)
                ptx.st_shared_f32(base + (tok * lay.e_stride + row) * 4, acc[4 * nt + reg])
        cute.arch.barrier()

        pairs = lay.rows // 2
        rounds = -(-8 * lay.n_tiles * pairs // lay.threads)
        if splits == 1:
            for j in cutlass.range_constexpr(rounds):
                w = Int32(tidx) + lay.threads * j
                tok, pr = w // pairs, w % pairs
                tc = _min(tok, 8 * lay.n_tiles - 1)
                v = ptx.ld_shared_v2_f32(base + (tc * lay.e_stride + 2 * pr) * 4)
                self.store_word(out, ptx.pack_bf16x2_rn(v[0], v[1]), tok, _min(tok, Int32(m) - 1),
                                row0 + Int64(2 * pr), m, n)
        else:
            for j in cutlass.range_constexpr(rounds):
                w = Int32(tidx) + lay.threads * j
                tok, pr = w // pairs, w % pairs
                tc = _min(tok, 8 * lay.n_tiles - 1)
                v = ptx.ld_shared_v2_f32(base + (tc * lay.e_stride + 2 * pr) * 4)
                dst = Int64(part) + ((Int64(s) * Int64(m) + Int64(tc)) * Int64(n) + row0 + Int64(2 * pr)) * 4
                ptx.st_global_v2_f32_if(dst, v[0], v[1], tok, m)
            ptx.fence_acq_rel_gpu()
            cute.arch.barrier()
            counter = Int64(counters) + Int64(bx) * 4
            flag = base + lay.flag
            if tidx == 0:
                old = ptx.atom_add_acq_rel_u32(counter, Uint32(1))
                if old == Uint32(splits - 1):
                    ptx.st_shared_b32(flag, Uint32(1))
                    ptx.st_global_b32(counter, Uint32(0))
                else:
                    ptx.st_shared_b32(flag, Uint32(0))
            cute.arch.barrier()
            if ptx.ld_shared_b32(flag) != Uint32(0):
                red = cute.make_rmem_tensor(2, cutlass.Float32)
                for j in cutlass.range_constexpr(rounds):
                    w = Int32(tidx) + lay.threads * j
                    tok, pr = w // pairs, w % pairs
                    tc = _min(tok, Int32(m) - 1)  # rows past m read row m - 1 and store nothing
                    col = Int64(tc) * Int64(n) + row0 + Int64(2 * pr)
                    step = Int64(m) * Int64(n) * 4
                    p0 = ptx.ld_global_cg_v2_f32(Int64(part) + col * 4)
                    red[0], red[1] = p0[0], p0[1]
                    for sp in cutlass.range(1, splits, unroll=1):
                        ps = ptx.ld_global_cg_v2_f32(Int64(part) + col * 4 + Int64(sp) * step)
                        red[0] = ptx.add_rn(red[0], ps[0])
                        red[1] = ptx.add_rn(red[1], ps[1])
                    self.store_word(out, ptx.pack_bf16x2_rn(red[0], red[1]), tok, tc, row0 + Int64(2 * pr), m, n)


    def store_word(self, out, word, tok, tok_c, column, m, n) -> None:
        """Store the BF16 pair ``word`` (outputs ``column``, ``column + 1``
        of token ``tok``; ``tok_c`` = ``min(tok, m - 1)``) if ``tok < m``: at
        ``y[tok_c, column]`` of the ``[m, n]`` output at ``out``. A subclass
        may store it elsewhere (``dspark_comm``'s publishing one: into every
        rank's mailbox), the sums unchanged."""
        ptx.st_global_b32_if(Int64(out) + (Int64(tok_c) * Int64(n) + column) * 2, word, tok, m)


def fragment_offsets(lay: OrderedLayout, base, warp, lane) -> tuple:
    """``(a_off, b_off)``: this lane's ldmatrix row addresses in ring slot 0
    for the 16-column steps of a chunk (``b_off[kk]`` one per token
    tile pair; traced inline)."""
    a_off = [base + a_address(lay, warp, lane, kk) for kk in range(lay.steps)]
    b_off = [[base + lay.x_ring + b_address(lay, lane, kk, pr) for pr in range(max(1, lay.n_tiles // 2))]
             for kk in range(lay.steps)]
    return a_off, b_off


def chunk_mmas(lay: OrderedLayout, acc, a_off: list, b_off: list, w_slot, x_slot) -> None:
    """One chunk's MMAs from the ring slot at ``w_slot`` / ``x_slot`` (byte
    offsets): its 16-column steps in order, each the A ``ldmatrix.x4``,
    the B ``ldmatrix`` (x2 for one token tile, else one x4 per tile pair) and
    one MMA per token tile into ``acc`` (traced inline)."""
    for kk in range(lay.steps):
        a = ptx.ldmatrix_x4(a_off[kk] + w_slot)
        bs = []
        if lay.n_tiles == 1:
            bs.append(ptx.ldmatrix_x2(b_off[kk][0] + x_slot))
        else:
            for pr in range(lay.n_tiles // 2):
                words = ptx.ldmatrix_x4(b_off[kk][pr] + x_slot)
                bs += [words[0:2], words[2:4]]
        for nt in range(lay.n_tiles):
            c = [acc[4 * nt + r] for r in range(4)]
            d = ptx.mma_bf16(a, bs[nt], c)
            for r in range(4):
                acc[4 * nt + r] = d[r]


def fake_args() -> tuple:
    """The compile signature of ``OrderedGemmKernel`` (no GPU memory needed)."""
    return (Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), Int32(64), Int32(1), Int32(1), fake_stream())


@jit_cache("OrderedGemm")
def compile_ordered_gemm(k: int, n_tiles: int, warps: int, stages: int, pdl: bool, chunk: int = CHUNK,
                         l2_chunks: int = 0):
    """The compiled ``OrderedGemmKernel`` of one variant."""
    return OrderedGemmKernel(k, n_tiles, warps, stages, bool(pdl), chunk, l2_chunks), fake_args()

# ---------------------------------------------------------------- host API


class OrderedWorkspace:
    """The split-K scratch of a launch: FP32 partials ``[splits, m, n]`` and
    the per-row-tile counters (int32, zero between launches; a launch leaves
    them zero), on ``device``, for up to ``splits`` splits, ``rows`` rows and
    ``n`` outputs in tiles of 16 rows."""

    def __init__(self, n: int, rows: int, splits: int, device) -> None:
        self.n, self.rows, self.splits = n, rows, splits
        self.part = torch.empty(splits * rows * n if splits > 1 else 1, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(1, n // TILE_ROWS), dtype=torch.int32, device=device)

    def takes(self, n: int, m: int, splits: int) -> bool:
        return n <= self.n and (splits == 1 or (m <= self.rows and splits <= self.splits))


def _operand_problem(x, weight, out, device) -> str | None:
    n, k = weight.shape
    m = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    ok = (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
          and x.shape[1] == k and 1 <= m <= MAX_ROWS and x.is_contiguous() and x.data_ptr() % 16 == 0
          and x.device == device)
    ok = ok and (out is None or (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
                                 and tuple(out.shape) == (m, n) and out.is_contiguous()
                                 and out.data_ptr() % 4 == 0 and out.device == device))
    if ok:
        return None
    return (f"the ordered GEMM takes x of bf16 [1..{MAX_ROWS}, {k}] (contiguous, 16-byte aligned) and an output of "
            f"bf16 [m, {n}] (contiguous, 4-byte aligned) on {device}, not x {describe(x)} and out {describe(out)}")


def _variant(settings: tuple, order: SplitOrder, n: int, k: int, m: int, pdl: bool) -> tuple:
    """``(compiled kernel, tile_chunks)`` of a launch of ``order`` with
    ``settings``: ``(n_tiles, warps, stages, chunk, l2_chunks)`` for the
    ``cp.async`` kernel, ``("streamed", warps, a_tiles, x_rows, stages,
    chunk, early)`` for the streamed one (``streamed``). ValueError for settings
    that cannot run ``m`` rows over ``n`` outputs."""
    if settings[0] == "streamed":
        _, warps, a_tiles, x_rows, stages, chunk, early = settings
        if m > x_rows or n % (TILE_ROWS * a_tiles * warps):
            raise ValueError(f"the streamed settings {settings} do not run {m} rows over {n} outputs")
        chunk, tile_chunks = fit_chunk(order, k, chunk)
        return compile_streamed_gemm(k, warps, a_tiles, x_rows, stages, pdl, chunk, early), tile_chunks
    n_tiles, warps, stages, chunk, l2_chunks = settings
    chunk, tile_chunks = fit_chunk(order, k, chunk)
    return compile_ordered_gemm(k, n_tiles, warps, stages, pdl, chunk, l2_chunks), tile_chunks


def _tensormap(weight: torch.Tensor, settings: tuple) -> torch.Tensor:
    """The weight's tensor map for the streamed kernel of ``settings`` (boxes of its CTA's rows)."""
    _, warps, a_tiles = settings[:3]
    return weight_tensormap(weight, TILE_ROWS * a_tiles * warps)


def _launch(x, weight, out, order: SplitOrder, workspace: OrderedWorkspace, pdl: bool, settings=None) -> None:
    n, k = weight.shape
    m = x.shape[0]
    settings = settings or choose_settings(n, k, order.splits, m, sm_count(x.device))
    kernel, tile_chunks = _variant(settings, order, n, k, m, pdl)
    w = weight.data_ptr() if settings[0] != "streamed" else _tensormap(weight, settings).data_ptr()
    kernel(Int64(x.data_ptr()), Int64(w), Int64(out.data_ptr()), Int64(workspace.part.data_ptr()),
           Int64(workspace.counters.data_ptr()), Int32(m), Int32(n), Int32(tile_chunks),
           Int32(order.splits), current_stream())


def ordered_gemm(x: torch.Tensor, weight: torch.Tensor, order: SplitOrder, out: torch.Tensor | None = None,
                 workspace: OrderedWorkspace | None = None, pdl: bool = False, settings=None) -> torch.Tensor:
    """One launch of ``x @ weight^T`` summed in ``order`` (module docstring)
    on any BF16 ``weight [n, k]`` (contiguous, 16-byte aligned, n a
    multiple of 16): the check's candidate runs. ValueError for operands or
    an order it does not take; a workspace is made where none is given."""
    why = ordered_gemm_unsupported(weight)
    if why is None:
        if not (weight.is_cuda and weight.data_ptr() % 16 == 0):
            why = f"the ordered GEMM takes a contiguous, 16-byte aligned CUDA weight, not {describe(weight)}"
    why = why or _operand_problem(x, weight, out, weight.device) or order_problem(order, int(weight.shape[1]))
    if why is not None:
        raise ValueError(why)
    n = int(weight.shape[0])
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
    if workspace is None or not workspace.takes(n, x.shape[0], order.splits):
        workspace = OrderedWorkspace(n, x.shape[0], order.splits, x.device)
    _launch(x, weight, out, order, workspace, pdl, settings)
    return out


# The check's candidate launches: one variant per K and token-tile count
# (a CTA of one warp, 4 stages of 64 columns), whatever the order (settings
# change no bit).
SEARCH_WARPS, SEARCH_STAGES = 1, 4


def candidate_run(x: torch.Tensor, weight: torch.Tensor, order: SplitOrder) -> torch.Tensor:
    """``ordered_gemm`` with the check's fixed launch settings: the
    ``run_order`` of ``dspark_core.runtime.gemm_check.check_projection``."""
    return ordered_gemm(x, weight, order, settings=(n_tiles_for(x.shape[0]), SEARCH_WARPS, SEARCH_STAGES, CHUNK, 0))


ops.define("ordered_gemm", "(str handle, Tensor x, Tensor(a!) out) -> ()")


def check_constants(constants) -> None:
    """Unsupported unless the kernel takes ``constants`` (an
    OrderedGemmConstants): its limits (``dspark_core.contracts.limits``: K
    a positive multiple of ``CHUNK``, N of ``TILE_ROWS``, both below 2^31)."""
    if not isinstance(constants, OrderedGemmConstants):
        raise ValueError(f"the ordered GEMM takes OrderedGemmConstants, not {type(constants).__name__}")
    within_limits(constants)


class OrderedGemm(LazyPdl):
    """The ordered GEMM bound to ``weight`` (BF16 ``[n, k]`` of
    ``constants``, contiguous, 16-byte aligned, on CUDA), taking the row
    counts ``bind_orders`` gave an order (the build-time check's findings;
    none before it) and, once ``decide`` has run, only those where one of
    its kernels measured faster than cuBLAS on this GPU. ``pdl``:
    programmatic dependent launch (default: sm_90+); ``sms``: the SM count
    the launch settings are chosen for; ``settings(m, order)``: a row
    count's launch settings before a decision (default ``choose_settings``:
    the ``cp.async`` or the streamed kernel; speed only: the same bits).

    ``check(rows)`` finds and binds the orders; ``decide()`` times each
    bound row count's candidate kernels against cuBLAS on the bound weight
    (``dspark_cute.cutedsl.gemm.decide``), keeps the faster where it wins by
    ``gemm_decide.MARGIN``, and gives the other row counts back to cuBLAS
    with the times as the reason. ``run(x, out=None)``: BF16 ``x [m, k]`` ->
    ``[m, n]``, summed in the order bound for ``m`` (bit for bit cuBLAS's
    where the check found it); ``problem`` / ``takes`` say whether it takes
    the operands (a row count without an order says the check's or the
    decision's reason), ``launch`` runs without the checks; ``prepare()``
    compiles every variant the bound orders launch. Traced by
    torch.compile, a launch is ``torch.ops.dspark.ordered_gemm``."""

    OP = "ordered_gemm"

    def __init__(self, constants: OrderedGemmConstants, weight: torch.Tensor, *, pdl: bool | None = None,
                 sms: int | None = None, settings=None) -> None:
        check_constants(constants)
        why = ordered_gemm_unsupported(weight)
        if why is not None:
            raise Unsupported(why)
        if tuple(weight.shape) != (constants.n, constants.k):
            raise ValueError(f"the ordered GEMM's constants say [{constants.n}, {constants.k}], the weight is "
                             f"{list(weight.shape)}")
        if not (weight.is_cuda and weight.is_contiguous() and weight.data_ptr() % 16 == 0):
            raise ValueError(f"the ordered GEMM takes a contiguous, 16-byte aligned CUDA weight, not "
                             f"{describe(weight)}")
        self.constants, self.weight, self.device = constants, weight, weight.device
        self._pdl = None if pdl is None else flag(pdl, "pdl")
        self.sms = sms or sm_count(weight.device)
        # (m, order) -> the launch settings (default launch_settings; no bit depends on them).
        self._choose = settings or (lambda m, o: choose_settings(constants.n, constants.k, o.splits, m, self.sms))
        self.orders: dict[int, SplitOrder] = {}
        self.reasons: dict[int, str] = {}
        self.workspace = OrderedWorkspace(constants.n, 1, 1, weight.device)
        self._settings: dict[int, tuple] = {}
        self.decision = None  # gemm_decide.GemmDecision, once decide() ran
        self.op_handle = ops.register(self)

    @property
    def max_rows(self) -> int:
        return MAX_ROWS

    @property
    def candidate_rows(self) -> tuple[int, ...]:
        """The row counts the build-time check tries: 1 .. 64 (the timing
        that follows it decides where DSpark's kernels run)."""
        return tuple(range(1, MAX_ROWS + 1))

    @staticmethod
    def run_order(x: torch.Tensor, weight: torch.Tensor, order: SplitOrder) -> torch.Tensor:
        """One launch of ``order`` on any ``weight`` (``candidate_run``): the
        build-time check's candidates."""
        return candidate_run(x, weight, order)

    def bind_orders(self, orders: dict[int, SplitOrder], reasons: dict[int, str] | None = None) -> None:
        """Take the row counts of ``orders`` in those orders (``reasons``:
        why the others stay stock), sizing the workspace; ``prepare()``
        then compiles what they launch. ValueError for an order the kernel
        cannot run or a row count outside 1 .. 64."""
        k, bound = self.constants.k, {}
        for m, order in orders.items():
            rows = checks.as_int(m)
            if rows is None or not 1 <= rows <= MAX_ROWS:
                raise ValueError(f"the ordered GEMM takes 1 to {MAX_ROWS} rows, not {m!r}")
            why = order_problem(order, k)
            if why is not None:
                raise ValueError(why)
            bound[rows] = order
        orders = bound
        reasons = dict(reasons or {})
        splits = max((o.splits for o in orders.values()), default=1)
        rows = max((m for m, o in orders.items() if o.splits > 1), default=1)
        self.workspace = OrderedWorkspace(self.constants.n, rows, splits, self.device)
        self.orders = dict(orders)
        self.reasons = reasons
        self._settings = {m: self._choose(m, o) for m, o in self.orders.items()}
        self.decision = None

    def check(self, rows=None, reference=None, seed: int = gemm_check.SEED) -> gemm_check.CheckResult:
        """The build-time check (``gemm_check.check_projection``) of this
        weight at ``rows`` (default 1 .. 64) against ``reference(x, weight)``
        (default ``F.linear``: the live cuBLAS), its orders bound
        (``bind_orders``) and compiled (``prepare``); returns the findings.
        ``decide()`` then keeps the row counts where DSpark is faster."""
        rows = self.candidate_rows if rows is None else rows
        result = gemm_check.check_projection(self.weight, rows, self.run_order, seed, reference)
        self.bind_orders(result.orders, result.refused)
        self.prepare()
        return result

    def decide(self, reference=None, cache=timing.DEFAULT, margin: float = gemm_decide.MARGIN,
               rounds: int = gemm_decide.ROUNDS, sides=None, card=None,
               lead_us: float = timing.LEAD_US) -> gemm_decide.GemmDecision:
        """Time every bound row count's candidate kernels against cuBLAS on
        this GPU (``sides``: default ``decide.gpu_sides`` over copies of the
        weight; ``reference(x, weight)``: cuBLAS's call, default ``F.linear``),
        or read the times from ``cache`` (default: the process's
        ``DecisionCache.from_environment()``; None: no cache), and keep each
        row count on its fastest kernel where that beats cuBLAS by ``margin``;
        the others go back to cuBLAS with the times as the reason. ``card``
        (a ``CardFacts``) names the GPU (default ``card_facts``); ``lead_us``:
        the part each call is timed behind (``decide.gpu_sides``; 0 where the
        projection follows no part that releases its PDL dependents early),
        part of the cache key. Returns the decision (also ``self.decision``),
        the kept variants compiled."""
        from dspark_core.tools.card import card_facts
        from dspark_cute.runtime.disk_cache import _fingerprint

        c = self.constants
        card = card or card_facts(self.device)
        cache = timing.default_decision_cache() if cache is timing.DEFAULT else cache
        copies = None
        if sides is None and self.orders:
            copies = timing.weight_copies(self.weight)
            sides = timing.gpu_sides(
                self, copies, lambda x, w, out, order, ws, settings: _launch(x, w, out, order, ws, self.pdl, settings),
                lambda n, m, splits: OrderedWorkspace(n, m, splits, self.device), reference, lead_us=lead_us)
        # How the calls were timed is part of the key: times behind the lead part never stand for back-to-back ones.
        lead = lead_us if lead_us and not timing.lead_failed() else 0
        try:
            what = f"the [{c.n}, {c.k}] {c.role} weight"
            decision = gemm_decide.decide(self.orders, sides or {gemm_decide.CUBLAS: None}, what, card,
                                          f"{_fingerprint()}/lead {lead!r}", (c.n, c.k), cache, margin, rounds)
        finally:
            if copies is not None:  # the weight copies and the timing graphs' pools go back to the driver
                del copies, sides
                torch.cuda.empty_cache()
        for m, row in decision.rows.items():
            if row.kernel is None:
                self.orders.pop(m, None)
                self._settings.pop(m, None)
                self.reasons[m] = row.reason()
            else:
                self._settings[m] = timing.candidates(c.n, self.orders[m].splits, m, self.sms)[row.kernel]
        self.decision = decision
        self.prepare()
        return decision

    def prepare(self) -> None:
        """Compile every variant the bound orders launch (and encode the
        weight's tensor maps the streamed ones read)."""
        for m, settings in self._settings.items():
            _variant(settings, self.orders[m], self.constants.n, self.constants.k, m, self.pdl)
            if settings[0] == "streamed":
                _tensormap(self.weight, settings)

    def problem(self, x, out=None) -> str | None:
        why = _operand_problem(x, self.weight, out, self.device)
        if why is not None:
            return why
        m = x.shape[0]
        if m not in self.orders:
            return self.reasons.get(m, f"the build-time check found no order for m = {m}")
        return None

    def takes(self, x, out=None) -> bool:
        return self.problem(x, out) is None

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        reason = self.problem(x, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(x, out)

    def launch(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty((x.shape[0], self.constants.n), dtype=torch.bfloat16, device=x.device)
        ops.launch(self, x, out)
        return out

    def _launch_kernel(self, x: torch.Tensor, out: torch.Tensor) -> None:
        m = x.shape[0]
        _launch(x, self.weight, out, self.orders[m], self.workspace, self.pdl, self._settings[m])


__all__ = ["CHUNK", "CHUNKS", "L2_PREFETCH_BYTES", "MAX_ROWS", "STREAMED_MAX_BYTES", "STREAMED_MAX_ROWS",
           "OrderedGemm", "OrderedGemmKernel", "OrderedLayout", "OrderedWorkspace", "candidate_run", "check_constants",
           "check_settings",
           "choose_settings", "chunk_tiles", "compile_ordered_gemm", "fake_args", "fit_chunk",
           "launch_settings",
           "n_tiles_for", "order_problem", "ordered_gemm"]
