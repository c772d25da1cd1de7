"""The greedy Markov step with its bias GEMM: ``dspark_core.spec.markov``
steps 1-5 in one launch, bit for bit vLLM 0.33.0's greedy loop where the
build-time check found cuBLAS summing the bias GEMM in one split
(``MarkovBiasStep.check``).

For R rows (requests, 1 <= R <= 64), per row ``r`` and draft column ``k``:

1. the embedding ``e[r] = w1[prev[r]]`` (BF16; ``prev`` int32 or int64, any
   stride: the anchors at the first step, the previous step's tokens after
   it; clamped to w1's rows);
2. ``bias = cvt.rn.bf16(s)`` where ``s`` is one FP32 accumulator from +0.0
   and one ``mma.sync.m16n8k16`` (BF16 in, FP32 accumulate) per 16 of the
   ``rank`` columns in increasing order (the MMA's K the contiguous 16
   columns: cuBLAS's order with one split, ``docs/gemm-order.md``);
3. ``greedy.step_values`` of ``base[r, k]`` and ``bias``: the logit rounded
   to BF16, the multiplier and the soft cap, in the greedy step's
   arithmetic;
4. the argmax of the row under ATen's rule (the maximum argmax key,
   ``ptx.argmax_key``), ``t = d + d2t[d]`` (``d`` alone without d2t) stored
   at ``tokens + 8 r s`` (``s`` the tokens' stride).

The next step embeds ``w1`` at the tokens itself, so no embedding is
written (vLLM's ``markov_embed`` is ``F.embedding(prev, w1)``, a copy).

Grid: one CTA per 256 draft columns (8 warps, each the MMA's A operand of
32 of ``w2``'s rows: two 16-row tiles), every CTA all R rows (the B
operand: ``n_tiles`` token tiles of 8). Each warp copies its rows of ``w2``
(``rank`` columns, 128-byte swizzled in 64-column boxes) into shared memory
with ``cp.async`` before ``griddepcontrol.wait`` (w2 is constant), and its
base logits too unless the launch is the loop's first (the launch before it,
the previous step, writes none of them); the CTA copies the R embedding
rows after the wait. A warp's keys fold over the lanes of a token
(butterflies 16, 8, 4), the CTA's over its warps in shared memory, the
grid's by ``red.max.u64`` into ``keys[r]``; the CTA that counts last
(``counters[0]``) does step 4 for every row and leaves the words zero. The
dependents are released after the CTA's count (they read the tokens after
their wait: this grid's end).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from dspark_core import checks
from dspark_core.contracts.markov import MarkovConstants
from dspark_core.errors import Unsupported
from dspark_core.runtime import gemm_check
from dspark_core.switches import flag
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.mma import chunk_mmas, fragment_offsets
from dspark_cute.cutedsl.gemm.ordered_layout import SMEM_LIMIT
from dspark_cute.cutedsl.markov.greedy import (
    check_constants,
    check_cuda,
    check_head,
    check_logits,
    check_on,
    check_tokens,
    count_in,
    row_words,
    step_values,
    target_id,
)
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import LazyPdl, current_stream, describe, fake_stream, jit_cache, smem_allocator

WARPS = 8
THREADS = 32 * WARPS
A_TILES = 2  # 16-row MMA tiles of w2 (draft columns) a warp owns (1 was no faster: scripts/probes/markov_loop.py)
MAX_ROWS = 64  # rows (requests) one step takes: 8 token tiles of 8
N_TILES = (1, 2, 4, 8)


def n_tiles_for(rows: int) -> int:
    return next(t for t in N_TILES if rows <= 8 * t)


def fused_unsupported(c: MarkovConstants, max_rows: int = 1) -> str | None:
    """Why the fused step does not take ``c`` for up to ``max_rows`` rows (a
    sentence), or None: the vocabulary a multiple of 16 (whole MMA tiles),
    the rank a multiple of 64 (the K unit of the ordered GEMM, whose
    candidates the build-time check runs to find cuBLAS's order: without
    them no order can be confirmed), and the CTA's ``w2`` rows, embedding
    rows and keys within a CTA's shared memory (a rank of 256 takes any
    row count, 320 at most)."""
    if c.vocab % 16:
        return f"the fused bias step takes a draft vocabulary that is a multiple of 16, not {c.vocab}"
    if c.rank % 64:
        return (f"the fused bias step takes a Markov rank that is a multiple of 64 (the build-time check's unit), "
                f"not {c.rank}")
    need = BiasStepLayout(c.rank, n_tiles_for(max_rows)).total
    if need > SMEM_LIMIT:
        return (f"the fused bias step's CTA keeps 256 rows of w2 in shared memory: a Markov rank of {c.rank} at "
                f"{max_rows} rows takes {need} bytes, more than {SMEM_LIMIT}")
    return None


class BiasStepLayout:
    """The fragment maps' view of one variant (``mma.fragment_offsets``
    and ``chunk_mmas``): ``a_tiles`` 16-row weight tiles a warp (its
    ``w_rows`` draft columns), boxes of 64 columns by ``w_rows`` rows
    (128 bytes a row), the embedding rows ``2 rank + 16`` bytes apart; and the shared memory
    (bytes): the warps' ``w2`` rows, the embedding rows, the warps' keys and
    the last-CTA flag."""

    x_offset = 0

    def __init__(self, rank: int, n_tiles: int, a_tiles: int = A_TILES) -> None:
        self.rank, self.n_tiles, self.a_tiles = rank, n_tiles, a_tiles
        self.w_rows = 16 * a_tiles
        self.columns = WARPS * self.w_rows  # draft columns a CTA owns
        self.steps = rank // 16
        self.box_bytes = self.w_rows * 128
        self.warp_bytes = -(-rank // 64) * self.box_bytes
        self.x_stride = 2 * rank + 16
        self.x_base = WARPS * self.warp_bytes
        self.keys = self.x_base + 8 * n_tiles * self.x_stride
        self.keys = -(-self.keys // 8) * 8
        self.flag = self.keys + WARPS * 8 * n_tiles * 8
        self.total = self.flag + 16

    def word(self, nt: int, par: int, at: int, half: int) -> int:
        """A thread's base-logit register of token tile ``nt``, token parity
        ``par``, weight tile ``at`` and row half ``half``."""
        return ((nt * 2 + par) * self.a_tiles + at) * 2 + half


class BiasStepParts:
    """The pieces of a step that both fused loops trace (this module's step,
    one launch a step, and ``persistent``'s, the N steps in one launch), for
    ``constants`` and ``lay`` (a ``BiasStepLayout``): the warp's ``w2`` rows,
    the thread's base logits, the embedding rows, the bias sums with their
    keys, and the CTA's key of a row."""

    constants: MarkovConstants
    lay: BiasStepLayout
    store_bias = False  # the test variant's: each bias value stored too (``MarkovBiasStoreKernel``)

    def setup(self, constants, n_tiles: int, tiles: tuple, wide: bool, pdl: bool, what: str) -> None:
        """A variant's settings (``constants`` already checked): ValueError
        for token tiles outside ``tiles``, Unsupported where the step does not
        take ``constants`` at ``8 n_tiles`` rows (``fused_unsupported``); the
        layout and one CTA per 256 draft columns."""
        if n_tiles not in tiles:
            raise ValueError(f"{what}'s token tiles are one of {tiles}, not {n_tiles!r}")
        why = fused_unsupported(constants, 8 * n_tiles)
        if why is not None:
            raise Unsupported(why)
        self.constants, self.wide, self.pdl = constants, bool(wide), bool(pdl)
        self.lay = BiasStepLayout(constants.rank, n_tiles)
        self.ctas = -(-constants.vocab // self.lay.columns)

    def frame(self) -> tuple:
        """Where this thread sits: ``(tidx, cta, warp, lane, smem, wbase,
        col0, g, t4)``: the shared memory's base (the layout's ``total``
        bytes), this warp's ``w2`` rows in it, its first draft column, the
        lane's MMA group and thread in the group."""
        lay = self.lay
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = Int32(cute.arch.lane_idx())
        smem = Int32(smem_allocator().allocate(lay.total, 1024).toint())
        wbase = smem + Int32(warp) * lay.warp_bytes
        col0 = Int32(cta) * lay.columns + Int32(warp) * lay.w_rows
        return tidx, cta, warp, lane, smem, wbase, col0, lane >> 2, lane & 3

    def copy_w2(self, w2, wbase, col0, lane) -> None:
        """``cp.async`` of this warp's ``w2`` rows (``col0`` on, those below
        the vocabulary; ``rank`` columns, 128-byte swizzled in 64-column
        boxes) to ``wbase``; not committed."""
        c, lay = self.constants, self.lay
        pieces = c.rank // 8  # 16-byte pieces of a row
        for j in range(lay.w_rows * pieces // 32):
            idx = lane + 32 * j
            r, p = idx // pieces, idx % pieces
            dst = wbase + (p >> 3) * lay.box_bytes + r * 128 + (((p & 7) ^ (r & 7)) * 16)
            src = Int64(w2) + (Int64(col0 + r) * c.rank + Int64(p) * 8) * 2
            ptx.cp_async_16_if(dst, src, col0 + r, Int32(c.vocab), Int32(0), Int32(1))

    def copy_embedding(self, smem, tidx, m, w1, token_of) -> None:
        """``cp.async`` of the R embedding rows ``w1[token_of(r)]`` (``r``
        clamped to ``m - 1``; rows past ``m`` not copied) to the layout's
        ``x_base``; not committed."""
        c, lay = self.constants, self.lay
        pieces = c.rank // 8
        for j in range(-(-8 * lay.n_tiles * pieces // THREADS)):
            idx = Int32(tidx) + THREADS * j
            r, p = idx // pieces, idx % pieces
            t = token_of(cutlass.min(r, m - 1))
            ptx.cp_async_16_if(smem + lay.x_base + r * lay.x_stride + p * 16,
                               Int64(w1) + (t * c.rank + Int64(p) * 8) * 2, r, m, Int32(0), Int32(1))

    @cute.jit
    def load_base(self, words, base, base_stride, col0, g, t4, m) -> None:
        """This thread's base logits, zero-extended BF16 words: token ``8 nt
        + 2 t4 + par`` (row ``m - 1`` past ``m``), column ``col0 + 16 at +
        8 half + g`` (the last column past the vocabulary)."""
        c, lay = self.constants, self.lay
        for nt in cutlass.range_constexpr(lay.n_tiles):
            for par in cutlass.range_constexpr(2):
                tc = cutlass.min(8 * nt + 2 * t4 + par, m - 1)
                for at in cutlass.range_constexpr(lay.a_tiles):
                    for half in cutlass.range_constexpr(2):
                        cc = cutlass.min(col0 + 16 * at + 8 * half + g, Int32(c.vocab - 1))
                        words[lay.word(nt, par, at, half)] = ptx.ld_global_u16(
                            Int64(base) + (Int64(tc) * Int64(base_stride) + Int64(cc)) * 2)

    def token_key(self, tok, cols, ys, m, ctx) -> Int64:
        """The largest argmax key of token ``tok``'s values ``ys`` at draft
        columns ``cols`` (the greedy step: the keys of ``y`` by draft
        column; a tile past the vocabulary, whole since vocab % 16 == 0,
        keys 0, below every key). ``ctx`` is the kernel's (``warp_keys``):
        none here."""
        c, key = self.constants, None
        for col, y in zip(cols, ys):
            k = ptx.key_below(ptx.argmax_key(y, col), col, Int32(c.vocab))
            key = k if key is None else ptx.max_u64(key, k)
        return key

    @cute.jit
    def warp_keys(self, smem, wbase, col0, warp, lane, m, words, bias_out, ctx=None) -> None:
        """Steps 2-3 of the warp's columns, its embedding rows and w2 rows in
        shared memory: the bias sums (``chunk_mmas``), each token's largest
        key over its values (``token_key``, given the kernel's ``ctx``), the
        largest per token over the warp, stored at the layout's ``keys``
        (warp-major). With ``store_bias`` each bias value of a row
        below ``m`` and a column below the vocabulary is also stored, BF16,
        at ``bias_out + 2 (vocab row + column)``."""
        c, lay = self.constants, self.lay
        g, t4 = lane >> 2, lane & 3
        a_off, a_pieces, b_off = fragment_offsets(lay, Int32(0), lane, m)
        acc = cute.make_rmem_tensor(4 * lay.a_tiles * lay.n_tiles, cutlass.Float32)
        zero = ptx.f32_const(0.0)
        for i in cutlass.range_constexpr(4 * lay.a_tiles * lay.n_tiles):
            acc[i] = zero
        chunk_mmas(lay, acc, a_off, a_pieces, b_off, wbase, smem + lay.x_base)
        for nt in cutlass.range_constexpr(lay.n_tiles):
            for par in cutlass.range_constexpr(2):
                tok = 8 * nt + 2 * t4 + par
                cols, bs, biases = [], [], []
                for at in cutlass.range_constexpr(lay.a_tiles):
                    for half in cutlass.range_constexpr(2):
                        s = acc[(at * lay.n_tiles + nt) * 4 + 2 * half + par]
                        cols.append(col0 + 16 * at + 8 * half + g)
                        bs.append(ptx.bf16x2_to_f32(words[lay.word(nt, par, at, half)])[0])
                        biases.append(ptx.round_bf16x2(s, s)[0])  # the GEMM's BF16 output
                        if cutlass.const_expr(self.store_bias):
                            past = (col0 + 16 * at - c.vocab) >> 31  # -1 below the vocabulary, 0 past it
                            ptx.st_global_bf16_rn_if(Int64(bias_out) + (Int64(tok) * c.vocab + Int64(cols[-1])) * 2,
                                                     s, tok + 64 * (1 + past), m)
                key = self.token_key(tok, cols, step_values(c, bs, biases), m, ctx)
                wkey = ptx.warp_key_max(key, (16, 8, 4))
                if g == 0:
                    ptx.st_shared_b64(smem + lay.keys + (Int32(warp) * (8 * lay.n_tiles) + tok) * 8, wkey)

    @cute.jit
    def prologue(self, w2, wbase, col0, lane, g, t4, words, base, base_stride, first, m) -> None:
        """The step's loads up to the PDL wait: the warp's ``w2`` rows
        (``copy_w2``, committed) and the thread's base logits into ``words``
        (``load_base``) before the wait where ``first`` is 0 (the launch
        before this one, the loop's previous step, wrote none of them), after
        it otherwise."""
        self.copy_w2(w2, wbase, col0, lane)
        ptx.cp_async_commit()
        if first == 0:
            self.load_base(words, base, base_stride, col0, g, t4, m)
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
        if first != 0:
            self.load_base(words, base, base_stride, col0, g, t4, m)

    @cute.jit
    def fold(self, smem, tidx, m, keys, counters) -> None:
        """After ``warp_keys``: each row's CTA key (``cta_key``) into the
        grid's word ``keys[r]`` (``red.max.u64``, then ``fence.acq_rel.gpu``),
        then this CTA counted in at ``counters[0]`` (``count_in``: the
        layout's ``flag`` says whether it was the last) and, with PDL, the
        dependents released (they read this step's tokens only after their
        wait: this grid's end)."""
        cute.arch.barrier()
        if Int32(tidx) < m:
            best = self.cta_key(smem, Int32(tidx))
            ptx.red_max_u64(Int64(keys) + Int64(tidx) * 8, best)
            ptx.fence_acq_rel_gpu()
        cute.arch.barrier()
        count_in(tidx, Int64(counters), self.ctas, smem + self.lay.flag)
        if cutlass.const_expr(self.pdl):
            ptx.pdl_launch_dependents()

    def cta_key(self, smem, row) -> Int64:
        """The CTA's largest key of ``row``: the warps' (``warp_keys``, after
        a CTA barrier) folded."""
        lay = self.lay
        rows_here = 8 * lay.n_tiles
        best = ptx.ld_shared_u64(smem + lay.keys + row * 8)
        for w in range(1, WARPS):
            best = ptx.max_u64(best, ptx.ld_shared_u64(smem + lay.keys + (w * rows_here + row) * 8))
        return best


class MarkovBiasKernel(BiasStepParts):
    """The traced step of one ``MarkovConstants`` for up to ``8 n_tiles``
    rows, ``prev`` read as int64 (``wide``) or int32, ``pdl``. Call: ``(base, base_stride, prev,
    prev_stride, w1, w1_rows, w2, d2t, tokens, tokens_stride, keys,
    counters, first, m, stream)``: byte addresses (Int64), strides in
    elements (Int32), ``w1_rows`` (Int64), ``first`` (Int32: 0 where the
    launch before this one is the loop's previous step, which wrote nothing
    of ``base``), ``m`` the rows (Int32)."""

    def __init__(self, constants: MarkovConstants, n_tiles: int, wide: bool, pdl: bool) -> None:
        check_constants(constants)
        self.setup(constants, n_tiles, N_TILES, wide, pdl, "the fused bias step")

    @cute.jit
    def __call__(self, base: Int64, base_stride: Int32, prev: Int64, prev_stride: Int32, w1: Int64, w1_rows: Int64,
                 w2: Int64, d2t: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64,
                 first: Int32, m: Int32, stream):
        self.kernel(base, base_stride, prev, prev_stride, w1, w1_rows, w2, d2t, tokens, tokens_stride, keys, counters,
                    first, m).launch(grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, base: Int64, base_stride: Int32, prev: Int64, prev_stride: Int32, w1: Int64, w1_rows: Int64,
               w2: Int64, d2t: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64,
               first: Int32, m: Int32):
        self.body(base, base_stride, prev, prev_stride, w1, w1_rows, w2, d2t, tokens, tokens_stride, keys, counters,
                  first, m, Int64(0))

    @cute.jit
    def body(self, base: Int64, base_stride: Int32, prev: Int64, prev_stride: Int32, w1: Int64, w1_rows: Int64,
             w2: Int64, d2t: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64,
             first: Int32, m: Int32, bias_out: Int64):
        c, lay = self.constants, self.lay
        tidx, cta, warp, lane, smem, wbase, col0, g, t4 = self.frame()

        # w2 (constant while the loop runs) and the base logits, around the wait.
        words = cute.make_rmem_tensor(4 * lay.a_tiles * lay.n_tiles, cutlass.Uint32)
        self.prologue(w2, wbase, col0, lane, g, t4, words, base, base_stride, first, m)
        # The R embedding rows w1[prev[r]], after the wait (the previous step wrote prev).
        self.copy_embedding(smem, tidx, m, w1, lambda r: ptx.ld_global_clamped_slot(
            Int64(prev) + Int64(r) * Int64(prev_stride) * (8 if self.wide else 4), self.wide, Int64(w1_rows) - 1))
        ptx.cp_async_commit()
        ptx.cp_async_wait_all()
        cute.arch.barrier()
        self.warp_keys(smem, wbase, col0, warp, lane, m, words, bias_out)
        self.fold(smem, tidx, m, keys, counters)
        if ptx.ld_shared_b32(smem + lay.flag) != Uint32(0):
            if Int32(tidx) < m:
                # Step 4 in the last CTA: the grid's key of row tidx (reset to 0), its token.
                ptx.fence_acq_rel_gpu()
                best = ptx.atom_exch_u64(Int64(keys) + Int64(tidx) * 8, Int64(0))
                t = target_id(c, best, d2t)
                ptx.st_global_b64(Int64(tokens) + Int64(tidx) * Int64(tokens_stride) * 8, t)
            if tidx == 0:
                ptx.st_global_b32(Int64(counters), Uint32(0))


class MarkovBiasStoreKernel(MarkovBiasKernel):
    """Test-only: ``MarkovBiasKernel`` that also stores every bias value it
    sums (BF16 ``[m, vocab]`` at ``bias_out``, the call's argument after
    ``m``), so a GPU test compares the GEMM's bits with cuBLAS's directly,
    not only through the tokens. The deployed kernel is the parent's, whose
    code this flag leaves as it is."""

    store_bias = True

    @cute.jit
    def __call__(self, base: Int64, base_stride: Int32, prev: Int64, prev_stride: Int32, w1: Int64, w1_rows: Int64,
                 w2: Int64, d2t: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64,
                 first: Int32, m: Int32, bias_out: Int64, stream):
        self.kernel(base, base_stride, prev, prev_stride, w1, w1_rows, w2, d2t, tokens, tokens_stride, keys, counters,
                    first, m, bias_out).launch(grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                               use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, base: Int64, base_stride: Int32, prev: Int64, prev_stride: Int32, w1: Int64, w1_rows: Int64,
               w2: Int64, d2t: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64,
               first: Int32, m: Int32, bias_out: Int64):
        self.body(base, base_stride, prev, prev_stride, w1, w1_rows, w2, d2t, tokens, tokens_stride, keys, counters,
                  first, m, bias_out)


def fake_args() -> tuple:
    """The compile signature of ``MarkovBiasKernel`` (no GPU memory needed)."""
    return (Int64(0), Int32(0), Int64(0), Int32(1), Int64(0), Int64(1), Int64(0), Int64(0), Int64(0), Int32(0),
            Int64(0), Int64(0), Int32(0), Int32(1), fake_stream())


@jit_cache("MarkovBiasStep")
def compile_bias_step(constants: MarkovConstants, n_tiles: int, wide: bool, pdl: bool):
    """The compiled ``MarkovBiasKernel`` of one variant."""
    return MarkovBiasKernel(constants, n_tiles, bool(wide), bool(pdl)), fake_args()


@jit_cache("MarkovBiasStore")
def compile_bias_store(constants: MarkovConstants, n_tiles: int, wide: bool):
    """The compiled test variant ``MarkovBiasStoreKernel`` (PDL off)."""
    args = fake_args()
    return MarkovBiasStoreKernel(constants, n_tiles, bool(wide), False), args[:-1] + (Int64(0), args[-1])


# ---------------------------------------------------------------- host API

ops.define("markov_bias_step", "(str handle, Tensor base, Tensor prev, Tensor(a!) tokens, bool first) -> ()")


def one_split_rows(result: gemm_check.CheckResult, rows) -> tuple[dict[int, None], dict[int, str]]:
    """``(taken, refused)`` of the build-time check's ``result`` on the bias
    GEMM: the row counts where it found cuBLAS summing in one split (the
    fused step's order), and the others with the reason."""
    taken, refused = {}, {}
    for m in rows:
        order = result.orders.get(m)
        if order is not None and order.splits == 1:
            taken[m] = None
        elif order is not None:
            refused[m] = (f"cuBLAS sums the Markov bias GEMM at {m} rows in {order.splits} splits; the fused step sums "
                          "in one")
        else:
            refused[m] = result.refused.get(m, f"the build-time check found no order at {m} rows")
    return taken, refused


def check_w2(constants, w2, device) -> None:
    """ValueError unless ``w2`` (the stock's ``markov_w2``) is a contiguous,
    16-byte aligned BF16 ``[Vpad >= vocab, rank]`` tensor on ``device``."""
    if not (isinstance(w2, torch.Tensor) and w2.dtype == torch.bfloat16 and w2.dim() == 2
            and w2.shape[0] >= constants.vocab and w2.shape[1] == constants.rank and w2.is_contiguous()
            and w2.data_ptr() % 16 == 0 and w2.device == device):
        raise ValueError(f"w2 must be a contiguous, 16-byte aligned bfloat16 [>= {constants.vocab}, "
                         f"{constants.rank}] tensor on {device}, not {describe(w2)}")


def check_max_rows(max_rows, limit: int = MAX_ROWS, what: str = "the fused bias step") -> int:
    """``max_rows`` as a Python int (a numpy integer taken) where it is one
    from 1 to ``limit`` (the rows ``what`` takes), else ValueError."""
    rows = checks.as_int(max_rows)
    if rows is None or not 1 <= rows <= limit:
        raise ValueError(f"{what} takes 1 to {limit} rows, not max_rows={max_rows!r}")
    return rows


def check_bind(host: str, step, w2: torch.Tensor, constants, fields: tuple[str, ...]) -> None:
    """ValueError unless ``step`` is a ``MarkovBiasStep`` over the tensor
    ``w2`` whose constants agree with ``constants`` in ``fields`` (what
    ``host`` binds to: the same question to cuBLAS); the message names each
    difference."""
    if not isinstance(step, MarkovBiasStep):
        raise ValueError(f"{host} binds to a MarkovBiasStep, not {describe(step)}")
    differs = [] if step.w2 is w2 else ["its w2 is another tensor"]
    differs += [f"its {f} is {getattr(step.constants, f)!r}, not {getattr(constants, f)!r}" for f in fields
                if getattr(step.constants, f) != getattr(constants, f)]
    if differs:
        raise ValueError(f"{host} binds to a MarkovBiasStep of the same w2 and {', '.join(fields)}: this one differs "
                         f"({'; '.join(differs)})")


def bound_rows(step, max_rows: int) -> tuple[dict[int, None], dict[int, str]]:
    """``(rows, reasons)`` of a host bound to ``step``'s build-time check (a
    ``MarkovBiasStep`` of the same w2: the same question to cuBLAS): the row
    counts up to ``max_rows`` it bound, and every other count from 1 with
    its reason."""
    rows = {m: None for m in step.rows if m <= max_rows}
    return rows, {m: step.reasons.get(m, "not checked") for m in range(1, max_rows + 1) if m not in rows}


def check_prev(rows: int, prev) -> None:
    """ValueError unless ``prev`` (the previous ids) is an int32 or int64 ``[rows]`` tensor (any stride)."""
    if not isinstance(prev, torch.Tensor) or prev.dtype not in (torch.int32, torch.int64) \
            or tuple(prev.shape) != (rows,):
        raise ValueError(f"the previous ids must be int32 or int64 [{rows}], not {describe(prev)}")


class MarkovBiasStep(LazyPdl):
    """The greedy Markov step with its bias GEMM (module docstring), bound
    to ``w1`` (BF16 ``[V_target, rank]``), ``d2t`` (int64 ``[vocab]`` or
    None, as ``greedy.MarkovStep``'s) and ``w2`` (BF16 ``[Vpad >= vocab,
    rank]``, contiguous, 16-byte aligned: the stock's ``markov_w2``), for 1
    to ``max_rows`` (at most 64) rows.

    ``check(rows, reference)``: the build-time check of the bias GEMM
    (``gemm_check.check_projection`` of ``w2`` against ``reference(e, w2)``,
    default ``F.linear``: the live cuBLAS vLLM calls); the step takes the row
    counts where cuBLAS sums in one split (``reasons`` says why not the
    others), and compiles. None before it. ``run(base, prev, tokens,
    first)``: ``base`` BF16 ``[R, vocab]`` (as ``MarkovStep``'s), ``prev``
    int32/int64 ``[R]`` (any stride: the anchors, or the previous step's
    column of the tokens), ``tokens`` int64 ``[R]`` (any stride), ``first``
    False only where the launch before it on the stream is the loop's
    previous step (``base`` is then read before the PDL wait). ``launch``
    runs without the checks; traced by torch.compile it is
    ``torch.ops.dspark.markov_bias_step``."""

    OP = "markov_bias_step"

    def __init__(self, constants: MarkovConstants, w1: torch.Tensor, d2t: torch.Tensor | None, w2: torch.Tensor,
                 max_rows: int = MAX_ROWS, *, pdl: bool | None = None) -> None:
        check_constants(constants)
        max_rows = check_max_rows(max_rows)
        why = fused_unsupported(constants, max_rows)
        if why is not None:
            raise Unsupported(why)
        check_head(constants, w1, d2t)
        check_w2(constants, w2, w1.device)
        self.constants, self.w1, self.d2t, self.w2, self.max_rows = constants, w1, d2t, w2, max_rows
        self.device = w1.device
        self._pdl = None if pdl is None else flag(pdl, "pdl")
        self.keys, self.counters = row_words(max_rows, w1.device)
        self.rows: dict[int, None] = {}
        self.reasons: dict[int, str] = {m: "the build-time check has not run" for m in range(1, max_rows + 1)}
        self.op_handle = ops.register(self)

    def check(self, rows=None, reference=None, seed: int = gemm_check.SEED) -> gemm_check.CheckResult:
        """The build-time check (class docstring) at ``rows`` (default 1 ..
        max_rows); binds the row counts it finds in one split and compiles."""
        from dspark_cute.cutedsl.gemm.ordered import candidate_run

        rows = tuple(range(1, self.max_rows + 1)) if rows is None else tuple(rows)
        bad = [m for m in rows if checks.as_int(m) is None or not 1 <= m <= self.max_rows]
        if bad:
            raise ValueError(f"the fused bias step is checked at 1 to {self.max_rows} rows, not {bad}")
        rows = tuple(int(m) for m in rows)
        result = gemm_check.check_projection(self.w2, rows, candidate_run, seed, reference)
        self.rows, refused = one_split_rows(result, rows)
        self.reasons = {m: refused.get(m, "not checked") for m in range(1, self.max_rows + 1) if m not in self.rows}
        self.prepare()
        return result

    def prepare(self, prev_dtypes=(torch.int32, torch.int64)) -> None:
        """Compile every variant the bound rows launch, for ``prev`` of each of ``prev_dtypes``."""
        for nt in sorted({n_tiles_for(m) for m in self.rows}):
            for dtype in prev_dtypes:
                compile_bias_step(self.constants, nt, dtype == torch.int64, self.pdl)

    def problem(self, base, prev, tokens, first: bool = True) -> str | None:
        """Why the step does not take these operands (a sentence), or None."""
        c = self.constants
        try:
            check_logits(c.vocab, self.max_rows, base)
            rows = base.shape[0]
            check_tokens(rows, tokens)
            check_prev(rows, prev)
            if not isinstance(first, bool):
                raise ValueError(f"first must be a bool, not {first!r}")
            check_on(self.device, (("the base logits", base), ("the previous ids", prev), ("the tokens", tokens)))
            check_cuda(self.device)
        except ValueError as error:
            return str(error)
        if rows not in self.rows:
            return self.reasons.get(rows, f"{rows} rows: the fused bias step takes 1 to {self.max_rows}")
        return None

    def takes(self, base, prev, tokens, first: bool = True) -> bool:
        return self.problem(base, prev, tokens, first) is None

    def run(self, base, prev, tokens, first: bool = True) -> None:
        reason = self.problem(base, prev, tokens, first)
        if reason is not None:
            raise ValueError(reason)
        self.launch(base, prev, tokens, first)

    def launch(self, base, prev, tokens, first: bool = True) -> None:
        """``run`` without its operand checks (for operands ``takes``)."""
        ops.launch(self, base, prev, tokens, first)

    def _launch_kernel(self, base, prev, tokens, first) -> None:
        m = base.shape[0]
        kernel = compile_bias_step(self.constants, n_tiles_for(m), prev.dtype == torch.int64, self.pdl)
        d2t = self.d2t.data_ptr() if self.d2t is not None else 0
        kernel(Int64(base.data_ptr()), Int32(base.stride(0)), Int64(prev.data_ptr()), Int32(prev.stride(0)),
               Int64(self.w1.data_ptr()), Int64(self.w1.shape[0]), Int64(self.w2.data_ptr()), Int64(d2t),
               Int64(tokens.data_ptr()), Int32(tokens.stride(0)), Int64(self.keys.data_ptr()),
               Int64(self.counters.data_ptr()), Int32(1 if first else 0), Int32(m), current_stream())


def step_with_bias(step: MarkovBiasStep, base, prev, tokens) -> torch.Tensor:
    """Test-only: one step of ``step`` on ``MarkovBiasStoreKernel`` (the
    operands as ``step.run`` takes them, ``first``), its tokens in
    ``tokens``; returns the bias it summed, BF16 ``[R, vocab]`` (compiled
    here: not during graph capture)."""
    reason = step.problem(base, prev, tokens)
    if reason is not None:
        raise ValueError(reason)
    m, c = base.shape[0], step.constants
    bias = torch.empty(m, c.vocab, dtype=torch.bfloat16, device=base.device)
    kernel = compile_bias_store(c, n_tiles_for(m), prev.dtype == torch.int64)
    d2t = step.d2t.data_ptr() if step.d2t is not None else 0
    kernel(Int64(base.data_ptr()), Int32(base.stride(0)), Int64(prev.data_ptr()), Int32(prev.stride(0)),
           Int64(step.w1.data_ptr()), Int64(step.w1.shape[0]), Int64(step.w2.data_ptr()), Int64(d2t),
           Int64(tokens.data_ptr()), Int32(tokens.stride(0)), Int64(step.keys.data_ptr()),
           Int64(step.counters.data_ptr()), Int32(1), Int32(m), Int64(bias.data_ptr()), current_stream())
    return bias


def run_fused_greedy_loop(step: MarkovBiasStep, base: torch.Tensor, prev: torch.Tensor,
                          tokens: torch.Tensor) -> None:
    """vLLM's greedy loop (``loop.run_greedy_loop``'s tokens) in N launches
    of ``step`` for ``base`` ``[R, N, vocab]``, the anchors ``prev``
    ``[R]`` and ``tokens`` ``[R, N]``: step ``i`` embeds ``w1`` at the
    anchors (``i = 0``) or at step ``i - 1``'s tokens. Operands as
    ``step.takes`` them (not checked here: a graph replays it)."""
    n = base.shape[1]
    for i in range(n):
        step.launch(base[:, i], prev if i == 0 else tokens[:, i - 1], tokens[:, i], i == 0)


__all__ = ["A_TILES", "MAX_ROWS", "MarkovBiasKernel", "MarkovBiasStep", "bound_rows", "check_bind", "check_max_rows",
           "check_prev",
           "check_w2",
           "compile_bias_step", "fused_unsupported", "n_tiles_for", "one_split_rows", "run_fused_greedy_loop"]
