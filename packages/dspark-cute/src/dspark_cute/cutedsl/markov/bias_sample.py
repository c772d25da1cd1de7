"""The probabilistic Markov step with its bias GEMM: ``sample.MarkovSampleStep``'s
step (vLLM 0.33.0's ``_sample_logits`` with ``draft_logits`` set, FP32
noise, ``dspark_core.spec.gumbel.probabilistic_step``) in one launch with the
bias GEMM, summed in cuBLAS's one-split order as ``bias_step`` sums it, where
the greedy step's build-time check found cuBLAS summing in one split
(``MarkovBiasSampleStep.bind``).

For R rows (1 <= R <= 32: at 64 its registers spill) at step ``i``, per row ``r`` (``req = idx_map[r]``,
valid where ``req >= 0``; ``temp``, ``seed ^ (i << 32)`` and ``p = pos[r] - 1
+ 2^30``: ``sample.row_sampling``):

1. ``e[r] = w1[prev[r]]`` (as ``bias_step``: the anchors at the first step,
   the previous step's tokens after it, clamped to w1's rows);
2. per draft column ``d``: the bias ``cvt.rn.bf16`` of one FP32 chain of
   ``mma.sync.m16n8k16`` over the rank in increasing order, then
   ``greedy.step_values`` and ``x = cvt.rn.bf16(y)`` (the cast into vLLM's
   scatter buffer), at the target column ``c = d + d2t[d]``;
3. with a valid row, ``cache[req, i, c] = x`` for the mapped columns and
   ``-inf`` for the others (BF16);
4. ``z = div.full(x, temp) + gumbel_noise(gumbel_uniform(seed, p, c))``
   where ``temp != 0``, else ``z = x``; the token is the argmax of ``z``
   over the target columns (``ptx.argmax_key``: the first maximum, the
   first NaN: ``sample``'s stated exception), stored at ``tokens + 8 r s``.

The unmapped columns' keys need no per-column work: there ``x = -inf``, so
``div.full(-inf, temp)`` is one of ``-inf``, ``+inf`` or NaN for every
nonzero ``temp``, and the noise is always finite (``gumbel_uniform`` is at
least ``2^-33`` and at most 1, and ``log1p_neg_stable`` clamps ``1 - u`` to
``2^-24``), so every unmapped column of a row has the same ``z``, whose
largest key is that of the first unmapped column (``spare``, found on the
host; the target vocabulary where none): one key a row, added by the last
CTA.

Grid: ``bias_step``'s (one CTA per 256 draft columns, every CTA all R rows;
``w2`` and, after the loop's first step, the base logits copied before
``griddepcontrol.wait``, and the thread's d2t entries too). After the wait
each CTA also writes the ``-inf`` of its share of the unmapped columns
(2048 target columns a pass, a warp's stores 64 contiguous bytes each),
while its embedding copies are in flight; each value of step 2 is stored
with a 2-byte store at its target column. The keys fold as in
``bias_step`` (``red.max.u64`` into ``keys[r]``, the last CTA derives the
token and resets the words).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from dspark_core.contracts.markov import MarkovSampleConstants
from dspark_core.errors import Unsupported
from dspark_core.switches import flag
from dspark_cute import ptx
from dspark_cute.cutedsl.markov.bias_step import (
    THREADS,
    BiasStepParts,
    MarkovBiasStep,
    bound_rows,
    check_bind,
    check_max_rows,
    check_prev,
    check_w2,
    fused_unsupported,
    n_tiles_for,
)
from dspark_cute.cutedsl.markov.greedy import (
    check_cuda,
    check_d2t_tensor,
    check_logits,
    check_on,
    check_tokens,
    check_w1,
    row_words,
)
from dspark_cute.cutedsl.markov.sample import check_constants, check_sampling, inverse_d2t, row_sampling
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import LazyPdl, current_stream, fake_stream, jit_cache

MAX_SAMPLE_ROWS = 32  # at 64 rows (8 token tiles) its registers spill: those counts keep the step after the GEMM
SAMPLE_TILES = (1, 2, 4)
FILL_COLUMNS = 8 * THREADS  # target columns a CTA writes -inf to per pass: 8 a thread, lanes adjacent
NEG_INF = -float("inf")
NEG_INF_BF16 = 0xFF80


class MarkovBiasSampleKernel(BiasStepParts):
    """The traced step of one ``MarkovSampleConstants`` for up to ``8
    n_tiles`` rows, ``prev`` read as int64 (``wide``) or int32, ``pdl``.
    Call: ``(base, base_stride, prev, prev_stride, w1, w1_rows, w2, d2t,
    t2d, tokens, tokens_stride, keys, counters, first, m, idx_map,
    idx_stride, temperature, seeds, pos, pos_stride, cache, cache_s0,
    cache_s1, col, spare, stream)``: byte addresses, ``w1_rows`` and the
    cache's strides (Int64), other strides in elements, ``first``, ``m``,
    the step ``col`` and the first unmapped target column ``spare`` (Int32)."""

    def __init__(self, constants: MarkovSampleConstants, n_tiles: int, wide: bool, pdl: bool) -> None:
        check_constants(constants)
        self.setup(constants, n_tiles, SAMPLE_TILES, wide, pdl, "the probabilistic bias step")
        self.passes = -(-constants.target_vocab // (self.ctas * FILL_COLUMNS))

    def token_key(self, tok, cols, ys, m, ctx) -> Int64:
        """Steps 3-4 of token ``tok`` at draft columns ``cols``, ``ctx`` the
        thread's target columns (in ``cols``' order) and the sampling
        operands: each ``x`` stored in the cache where the row is valid,
        below ``m`` and the column below the vocabulary, then its key by
        target column (0 past the vocabulary)."""
        c = self.constants
        targets, (idx_map, idx_stride, temperature, seeds, pos, pos_stride, cache, s0, s1, col) = ctx
        valid, reqc, temp, seed, p = row_sampling(cutlass.min(tok, m - 1), idx_map, idx_stride, temperature, seeds,
                                                  pos, pos_stride, col)
        noisy = temp != ptx.f32_const(0.0)
        skip = cutlass.select_(valid, Int32(0), Int32(1)) | cutlass.select_(tok < m, Int32(0), Int32(1))
        row = Int64(cache) + (reqc * Int64(s0) + Int64(col) * Int64(s1)) * 2
        key = None
        for d, x, t in zip(cols, ptx.round_bf16(ys), targets):
            ptx.st_global_bf16_rn_if(row + Int64(t) * 2, x, skip | cutlass.select_(d < Int32(c.vocab), Int32(0),
                                                                                     Int32(1)), Int32(1))
            g = ptx.gumbel_noise(ptx.gumbel_uniform(seed, p, t))
            z = cutlass.select_(noisy, ptx.add_rn(ptx.div_full(x, temp), g), x)
            k = ptx.key_below(ptx.argmax_key(z, t), d, Int32(c.vocab))
            key = k if key is None else ptx.max_u64(key, k)
        return key

    def targets(self, d2t, col0, g) -> list:
        """This thread's target columns ``d + d2t[d]`` (Int32), ``d`` its
        draft columns in ``warp_keys``' order (the last column past the
        vocabulary)."""
        c, lay, out = self.constants, self.lay, []
        for at in range(lay.a_tiles):
            for half in range(2):
                d = cutlass.min(col0 + 16 * at + 8 * half + g, Int32(c.vocab - 1))
                out.append(Int32(Int64(d) + ptx.ld_global_s64(Int64(d2t) + Int64(d) * 8)))
        return out

    @cute.jit
    def fill_unmapped(self, cta, warp, lane, t2d, m, idx_map, idx_stride, cache, s0, s1, col) -> None:
        """Step 3's ``-inf`` at this thread's unmapped target columns, for
        each valid row below ``m``: per pass the CTA's 2048 columns, warp
        ``w``'s 256 from ``256 w``, lane ``l``'s ``l + 32 k`` (k < 8)."""
        c = self.constants
        for j in cutlass.range_constexpr(self.passes):
            first = (Int32(j * self.ctas) + Int32(cta)) * FILL_COLUMNS + Int32(warp) * 256 + lane
            cols, skips = [], []
            for k in cutlass.range_constexpr(8):
                cc = first + 32 * k
                mapped = Int32(ptx.ld_global_b32(Int64(t2d) + Int64(cutlass.min(cc, Int32(c.target_vocab - 1))) * 4))
                cols.append(cc)
                skips.append(cutlass.select_(cc < Int32(c.target_vocab),
                                             cutlass.select_(mapped < Int32(0), Int32(0), Int32(1)), Int32(1)))
            for r in cutlass.range(m, unroll=1):
                req = ptx.ld_global_s64(Int64(idx_map) + Int64(r) * Int64(idx_stride) * 8)
                bad = cutlass.select_(req >= Int64(0), Int32(0), Int32(1))
                row = Int64(cache) + (cutlass.max(req, Int64(0)) * Int64(s0) + Int64(col) * Int64(s1)) * 2
                for k in cutlass.range_constexpr(8):
                    ptx.st_global_b16_if(row + Int64(cols[k]) * 2, Uint32(NEG_INF_BF16), skips[k] | bad, Int32(1))

    @cute.jit
    def __call__(self, base: Int64, base_stride: Int32, prev: Int64, prev_stride: Int32, w1: Int64, w1_rows: Int64,
                 w2: Int64, d2t: Int64, t2d: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64,
                 counters: Int64, first: Int32, m: Int32, idx_map: Int64, idx_stride: Int32, temperature: Int64,
                 seeds: Int64, pos: Int64, pos_stride: Int32, cache: Int64, cache_s0: Int64, cache_s1: Int64,
                 col: Int32, spare: Int32, stream):
        self.kernel(base, base_stride, prev, prev_stride, w1, w1_rows, w2, d2t, t2d, tokens, tokens_stride, keys,
                    counters, first, m, idx_map, idx_stride, temperature, seeds, pos, pos_stride, cache, cache_s0,
                    cache_s1, col, spare).launch(grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                                 use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, base: Int64, base_stride: Int32, prev: Int64, prev_stride: Int32, w1: Int64, w1_rows: Int64,
               w2: Int64, d2t: Int64, t2d: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64,
               first: Int32, m: Int32, idx_map: Int64, idx_stride: Int32, temperature: Int64, seeds: Int64,
               pos: Int64, pos_stride: Int32, cache: Int64, cache_s0: Int64, cache_s1: Int64, col: Int32,
               spare: Int32):
        c, lay = self.constants, self.lay
        tidx, cta, warp, lane, smem, wbase, col0, g, t4 = self.frame()

        # Before the wait: the d2t entries, w2 (constant while the loop runs)
        # and, after the loop's first step, the base logits (that grid wrote none).
        targets = self.targets(d2t, col0, g)
        words = cute.make_rmem_tensor(4 * lay.a_tiles * lay.n_tiles, cutlass.Uint32)
        self.prologue(w2, wbase, col0, lane, g, t4, words, base, base_stride, first, m)
        self.copy_embedding(smem, tidx, m, w1, lambda r: ptx.ld_global_clamped_slot(
            Int64(prev) + Int64(r) * Int64(prev_stride) * (8 if self.wide else 4), self.wide, Int64(w1_rows) - 1))
        ptx.cp_async_commit()
        # The unmapped columns' -inf while the embedding rows arrive.
        self.fill_unmapped(cta, warp, lane, t2d, m, idx_map, idx_stride, cache, cache_s0, cache_s1, col)
        ptx.cp_async_wait_all()
        cute.arch.barrier()
        self.warp_keys(smem, wbase, col0, warp, lane, m, words, Int64(0),
                       (targets, (idx_map, idx_stride, temperature, seeds, pos, pos_stride, cache, cache_s0,
                                  cache_s1, col)))
        self.fold(smem, tidx, m, keys, counters)
        if ptx.ld_shared_b32(smem + lay.flag) != Uint32(0):
            if Int32(tidx) < m:
                # Step 4 in the last CTA: the grid's key of row tidx (reset to 0) and the unmapped columns' key.
                ptx.fence_acq_rel_gpu()
                best = ptx.atom_exch_u64(Int64(keys) + Int64(tidx) * 8, Int64(0))
                _, _, temp, seed, p = row_sampling(Int32(tidx), idx_map, idx_stride, temperature, seeds, pos,
                                                   pos_stride, col)
                noisy, neg_inf = temp != ptx.f32_const(0.0), ptx.f32_const(NEG_INF)
                noise = ptx.gumbel_noise(ptx.gumbel_uniform(seed, p, spare))
                z = cutlass.select_(noisy, ptx.add_rn(ptx.div_full(neg_inf, temp), noise), neg_inf)
                best = ptx.max_u64(best, ptx.key_below(ptx.argmax_key(z, spare), spare, Int32(c.target_vocab)))
                ptx.st_global_b64(Int64(tokens) + Int64(tidx) * Int64(tokens_stride) * 8,
                                  Int64(ptx.key_column(best)))
            if tidx == 0:
                ptx.st_global_b32(Int64(counters), Uint32(0))


def fake_args() -> tuple:
    """The compile signature of ``MarkovBiasSampleKernel`` (no GPU memory needed)."""
    return (Int64(0), Int32(0), Int64(0), Int32(1), Int64(0), Int64(1), Int64(0), Int64(0), Int64(0), Int64(0),
            Int32(0), Int64(0), Int64(0), Int32(0), Int32(1), Int64(0), Int32(1), Int64(0), Int64(0), Int64(0),
            Int32(1), Int64(0), Int64(0), Int64(0), Int32(0), Int32(0), fake_stream())


@jit_cache("MarkovBiasSample")
def compile_bias_sample(constants: MarkovSampleConstants, n_tiles: int, wide: bool, pdl: bool):
    """The compiled ``MarkovBiasSampleKernel`` of one variant."""
    return MarkovBiasSampleKernel(constants, n_tiles, bool(wide), bool(pdl)), fake_args()


# ---------------------------------------------------------------- host API

ops.define("markov_bias_sample", "(str handle, Tensor base, Tensor prev, Tensor(a!) tokens, Tensor idx_map, "
                                 "Tensor temperature, Tensor seeds, Tensor pos, Tensor(b!) cache, int col, "
                                 "bool first) -> ()")


class MarkovBiasSampleStep(LazyPdl):
    """The probabilistic Markov step with its bias GEMM (module docstring),
    bound to ``w1`` (BF16 ``[>= target_vocab, rank]``), ``d2t`` (int64
    ``[vocab]``, distinct targets below ``target_vocab``) and ``w2`` (BF16
    ``[Vpad >= vocab, rank]``, contiguous, 16-byte aligned), for 1 to
    ``max_rows`` (at most 32: at 64 rows ptxas spills its registers) rows.

    ``bind(step)``: takes the request counts that ``step`` (the greedy
    ``MarkovBiasStep`` on the same ``w2``, its build-time check run) bound,
    those where cuBLAS sums the bias GEMM in one split, and compiles; none
    before it. ``run(base, prev, tokens, idx_map, temperature, seeds, pos,
    cache, col, first)``: ``base``, ``prev``, ``tokens`` and ``first`` as
    ``MarkovBiasStep.run`` takes them, the sampling operands as
    ``MarkovSampleStep.run`` (``sample.check_sampling``). ``launch`` runs
    without the checks; traced by torch.compile it is
    ``torch.ops.dspark.markov_bias_sample``."""

    OP = "markov_bias_sample"

    def __init__(self, constants: MarkovSampleConstants, w1: torch.Tensor, d2t: torch.Tensor, w2: torch.Tensor,
                 max_rows: int = MAX_SAMPLE_ROWS, *, pdl: bool | None = None) -> None:
        check_constants(constants)
        max_rows = check_max_rows(max_rows, MAX_SAMPLE_ROWS, "the probabilistic bias step")
        why = fused_unsupported(constants, max_rows)
        if why is not None:
            raise Unsupported(why)
        check_w1(w1, constants.rank, constants.target_vocab)
        check_d2t_tensor(d2t, constants.vocab, w1.device)
        check_w2(constants, w2, w1.device)
        self.t2d = inverse_d2t(constants, d2t)
        unmapped = (self.t2d < 0).nonzero()
        self.spare = int(unmapped[0, 0]) if unmapped.numel() else constants.target_vocab
        self.constants, self.w1, self.d2t, self.w2, self.max_rows = constants, w1, d2t, w2, max_rows
        self.device = w1.device
        self._pdl = None if pdl is None else flag(pdl, "pdl")
        self.keys, self.counters = row_words(max_rows, w1.device)
        self.rows: dict[int, None] = {}
        self.reasons: dict[int, str] = {m: "not bound to the greedy step's build-time check"
                                        for m in range(1, max_rows + 1)}
        self.op_handle = ops.register(self)

    def bind(self, step: MarkovBiasStep) -> None:
        """Take the request counts up to ``max_rows`` that ``step`` bound
        (its check of the same GEMM: the same ``w2`` tensor, vocabulary and
        rank), the others with its reasons, and compile."""
        check_bind("the probabilistic bias step", step, self.w2, self.constants, ("vocab", "rank"))
        self.rows, self.reasons = bound_rows(step, self.max_rows)
        self.prepare()

    def prepare(self, prev_dtypes=(torch.int32, torch.int64)) -> None:
        """Compile every variant the bound rows launch, for ``prev`` of each of ``prev_dtypes``."""
        for nt in sorted({n_tiles_for(m) for m in self.rows}):
            for dtype in prev_dtypes:
                compile_bias_sample(self.constants, nt, dtype == torch.int64, self.pdl)

    def problem(self, base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first: bool = True) \
            -> str | None:
        """Why the step does not take these operands (a sentence), or None."""
        c = self.constants
        try:
            check_logits(c.vocab, self.max_rows, base)
            rows = base.shape[0]
            check_tokens(rows, tokens)
            check_prev(rows, prev)
            check_sampling(c, rows, idx_map, temperature, seeds, pos, cache, col)
            if not isinstance(first, bool):
                raise ValueError(f"first must be a bool, not {first!r}")
            check_on(self.device, (("the base logits", base), ("the previous ids", prev), ("the tokens", tokens),
                                   ("idx_map", idx_map), ("temperature", temperature), ("seeds", seeds),
                                   ("pos", pos), ("the logits cache", cache)))
            check_cuda(self.device)
        except ValueError as error:
            return str(error)
        if rows not in self.rows:
            return self.reasons.get(rows, f"{rows} rows: the fused bias step takes 1 to {self.max_rows}")
        return None

    def takes(self, *operands, **named) -> bool:
        return self.problem(*operands, **named) is None

    def run(self, base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first: bool = True) -> None:
        """The module docstring's step; ValueError with ``problem``'s sentence for operands it does not take."""
        reason = self.problem(base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first)
        if reason is not None:
            raise ValueError(reason)
        self.launch(base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first)

    def launch(self, base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first: bool = True) -> None:
        """``run`` without its operand checks (for operands ``takes``)."""
        ops.launch(self, base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first)

    def _launch_kernel(self, base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first) -> None:
        m = base.shape[0]
        kernel = compile_bias_sample(self.constants, n_tiles_for(m), prev.dtype == torch.int64, self.pdl)
        kernel(Int64(base.data_ptr()), Int32(base.stride(0)), Int64(prev.data_ptr()), Int32(prev.stride(0)),
               Int64(self.w1.data_ptr()), Int64(self.w1.shape[0]), Int64(self.w2.data_ptr()),
               Int64(self.d2t.data_ptr()), Int64(self.t2d.data_ptr()), Int64(tokens.data_ptr()),
               Int32(tokens.stride(0)), Int64(self.keys.data_ptr()), Int64(self.counters.data_ptr()),
               Int32(1 if first else 0), Int32(m), Int64(idx_map.data_ptr()), Int32(idx_map.stride(0)),
               Int64(temperature.data_ptr()), Int64(seeds.data_ptr()), Int64(pos.data_ptr()), Int32(pos.stride(0)),
               Int64(cache.data_ptr()), Int64(cache.stride(0)), Int64(cache.stride(1)), Int32(col),
               Int32(self.spare), current_stream())


def run_fused_probabilistic_loop(step: MarkovBiasSampleStep, base: torch.Tensor, prev: torch.Tensor,
                                 tokens: torch.Tensor, idx_map: torch.Tensor, temperature: torch.Tensor,
                                 seeds: torch.Tensor, sample_pos: torch.Tensor, cache: torch.Tensor) -> None:
    """vLLM's probabilistic loop (``loop.run_probabilistic_loop``'s tokens
    and logits cache) in N launches of ``step`` for ``base`` ``[R, N,
    vocab]``, the anchors ``prev`` ``[R]``, ``tokens`` ``[R, N]`` and vLLM's
    ``[R, N]`` views ``idx_map`` and ``sample_pos``: step ``i`` embeds ``w1``
    at the anchors (``i = 0``) or at step ``i - 1``'s tokens. Operands as
    ``step.takes`` them (not checked here: a graph replays it)."""
    n = base.shape[1]
    for i in range(n):
        step.launch(base[:, i], prev if i == 0 else tokens[:, i - 1], tokens[:, i], idx_map[:, i], temperature,
                    seeds, sample_pos[:, i], cache, i, i == 0)


__all__ = ["FILL_COLUMNS", "MAX_SAMPLE_ROWS", "SAMPLE_TILES", "MarkovBiasSampleKernel", "MarkovBiasSampleStep",
           "compile_bias_sample", "fake_args", "run_fused_probabilistic_loop"]
