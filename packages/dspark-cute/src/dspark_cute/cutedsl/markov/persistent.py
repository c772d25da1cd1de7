"""vLLM's greedy Markov loop in one launch: the N steps of
``bias_step.run_fused_greedy_loop`` (each ``bias_step``'s arithmetic, bit
for bit) in one persistent, cooperative grid, ``w2`` held on chip for all
of them.

For R rows (1 <= R <= 32) and steps ``i = 0 .. N-1``, per row ``r``:

1. the embedding ``e[r] = w1[p]``: ``p`` the anchor ``prev[r]`` (int32 or
   int64, any stride, clamped to w1's rows) at step 0, else step ``i-1``'s
   token of the row;
2. ``bias = cvt.rn.bf16(s)``, ``s`` one FP32 accumulator from +0.0 and one
   ``mma.sync.m16n8k16`` per 16 of the ``rank`` columns in increasing order
   (cuBLAS's one-split order, as ``bias_step``);
3. ``greedy.step_values`` of ``base[r, i, k]`` and ``bias``;
4. the row's argmax key over the grid, ``t = d + d2t[d]`` (``d`` without a
   d2t) stored at ``tokens[r, i]`` (any strides) and kept for step ``i+1``.

Grid: one CTA per 256 draft columns, all of them resident at once (a
cooperative launch, which the driver refuses rather than run a grid that
does not fit; the host refuses more CTAs than SMs first). Each CTA copies
its 256 rows of ``w2`` once, before ``griddepcontrol.wait`` (w2 is
constant), and keeps them in shared memory for the N steps. Per step, each
CTA folds its key of row ``r`` into ``keys[32 i + r]`` (``red.max.u64``,
then ``fence.acq_rel.gpu``); after a CTA barrier thread 0 adds 1 to the
arrival counter (``counters[0]``, release) and waits (acquire) until it
reaches ``ctas (i + 1)``: every CTA's key of step ``i`` is in. Then every
CTA reads the grid's keys (``ld.relaxed.gpu``) and derives the tokens
itself (CTA 0 stores them), so no launch and no second barrier sits between
two steps. The next step's base logits are loaded before the barrier's
wait. Up to 32 rows: at 64 the registers spill (``bias_step``'s loop, one
launch a step, takes them).

Each step has its own key words, so none is reset while another CTA may
still read it: after the last step every CTA counts itself out
(``counters[1]``), and the last one resets the key words of the R rows and
both counters to 0, as the host allocated them (one launch at a time on
these words). A barrier that waits longer than ``timeout_ns`` (not possible
while the grid is resident) ends the kernel with ``trap``: a CUDA error,
never a hang or a token from a partial fold.
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
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.ordered_layout import SMEM_LIMIT
from dspark_cute.cutedsl.markov.bias_step import (
    THREADS,
    BiasStepLayout,
    BiasStepParts,
    MarkovBiasStep,
    bound_rows,
    check_bind,
    check_max_rows,
    fused_unsupported,
    n_tiles_for,
)
from dspark_cute.cutedsl.markov.greedy import check_constants, check_logits, count_in, target_id
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    cooperative_supported,
    current_stream,
    describe,
    fake_stream,
    jit_cache,
    sm_count,
)

MAX_LOOP_ROWS = 32  # rows one launch takes: at 64 its registers spill (the step loop takes those)
LOOP_TILES = (1, 2, 4)  # token tiles of 8 rows
KEY_ROWS = MAX_LOOP_ROWS  # key words a step
MAX_STEPS = 16  # steps one launch takes (unrolled: each its own code)
TIMEOUT_S = 5.0  # a grid barrier's wait before ``trap`` (the mailbox's poll default: a context switched out by
# time-slicing must not trap)


class PersistentLayout(BiasStepLayout):
    """``BiasStepLayout`` and the rows' tokens of the step before (8 bytes a
    row) after it."""

    def __init__(self, rank: int, n_tiles: int) -> None:
        super().__init__(rank, n_tiles)
        self.tok = self.total
        self.total = self.tok + 8 * 8 * n_tiles


def persistent_unsupported(c: MarkovConstants, max_rows: int, sms: int | None = None) -> str | None:
    """Why one persistent launch does not take ``c`` at up to ``max_rows``
    rows on a GPU of ``sms`` SMs (None: not asked), or None: the bias step's
    limits (``bias_step.fused_unsupported``), the CuTe DSL's cooperative
    launch, and one resident CTA per 256 draft columns; at most
    ``MAX_LOOP_ROWS`` rows (the bias step takes more)."""
    why = fused_unsupported(c, max_rows)
    if why is not None:
        return why
    if max_rows > MAX_LOOP_ROWS:
        return (f"the persistent Markov loop takes 1 to {MAX_LOOP_ROWS} requests (its tokens' tiles on chip): "
                f"{max_rows} asked")
    need = PersistentLayout(c.rank, n_tiles_for(max_rows)).total
    if need > SMEM_LIMIT:
        return (f"the persistent Markov loop keeps 256 rows of w2 and the rows' tokens in shared memory: a rank of "
                f"{c.rank} at {max_rows} rows takes {need} bytes, more than {SMEM_LIMIT}")
    if not cooperative_supported():
        return ("the persistent Markov loop needs a cooperative launch, which this CuTe DSL does not have "
                "(4.8 does)")
    ctas = -(-c.vocab // 256)
    if sms is not None and ctas > sms:
        return (f"the persistent Markov loop holds w2 on chip in one CTA per 256 draft columns: {ctas} CTAs for a "
                f"vocabulary of {c.vocab}, more than this GPU's {sms} SMs")
    return None


class MarkovPersistentKernel(BiasStepParts):
    """The traced loop of one ``MarkovConstants``: ``steps`` steps, up to
    ``8 n_tiles`` rows, ``prev`` int64 (``wide``) or int32, ``pdl``. Call:
    ``(base, base_row, base_step, prev, prev_stride, w1, w1_rows, w2, d2t,
    tokens, tokens_row, tokens_step, keys, counters, m, timeout_ns,
    stream)``: byte addresses and ``w1_rows``, ``timeout_ns`` (Int64),
    strides in elements and ``m`` (Int32)."""

    def __init__(self, constants: MarkovConstants, steps: int, n_tiles: int, wide: bool, pdl: bool) -> None:
        check_constants(constants)
        if checks.as_int(n_tiles) not in LOOP_TILES:
            raise ValueError(f"the persistent Markov loop's token tiles are one of {LOOP_TILES}, not {n_tiles!r}")
        if checks.as_int(steps) is None or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"the persistent Markov loop takes 1 to {MAX_STEPS} steps, not {steps!r}")
        steps, n_tiles = int(steps), int(n_tiles)
        why = persistent_unsupported(constants, 8 * n_tiles)
        if why is not None:
            raise Unsupported(why)
        self.constants, self.steps, self.wide, self.pdl = constants, steps, bool(wide), bool(pdl)
        self.lay = PersistentLayout(constants.rank, n_tiles)
        self.ctas = -(-constants.vocab // self.lay.columns)

    @cute.jit
    def __call__(self, base: Int64, base_row: Int32, base_step: Int32, prev: Int64, prev_stride: Int32, w1: Int64,
                 w1_rows: Int64, w2: Int64, d2t: Int64, tokens: Int64, tokens_row: Int32, tokens_step: Int32,
                 keys: Int64, counters: Int64, m: Int32, timeout_ns: Int64, stream):
        self.kernel(base, base_row, base_step, prev, prev_stride, w1, w1_rows, w2, d2t, tokens, tokens_row,
                    tokens_step, keys, counters, m, timeout_ns).launch(
            grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl, cooperative=True)

    @cute.kernel
    def kernel(self, base: Int64, base_row: Int32, base_step: Int32, prev: Int64, prev_stride: Int32, w1: Int64,
               w1_rows: Int64, w2: Int64, d2t: Int64, tokens: Int64, tokens_row: Int32, tokens_step: Int32,
               keys: Int64, counters: Int64, m: Int32, timeout_ns: Int64):
        c, lay = self.constants, self.lay
        tidx, cta, warp, lane, smem, wbase, col0, g, t4 = self.frame()
        tok = smem + lay.tok

        # The warp's w2 rows, once and before the wait: w2 is constant.
        self.copy_w2(w2, wbase, col0, lane)
        ptx.cp_async_commit()
        words = [cute.make_rmem_tensor(4 * lay.a_tiles * lay.n_tiles, cutlass.Uint32) for _ in range(2)]
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
        self.load_base(words[0], base, base_row, col0, g, t4, m)
        for i in cutlass.range_constexpr(self.steps):
            if cutlass.const_expr(i == 0):
                self.copy_embedding(smem, tidx, m, w1, lambda r: ptx.ld_global_clamped_slot(
                    Int64(prev) + Int64(r) * Int64(prev_stride) * (8 if self.wide else 4), self.wide,
                    Int64(w1_rows) - 1))
            else:
                self.copy_embedding(smem, tidx, m, w1, lambda r: ptx.ld_shared_u64(tok + r * 8))
            ptx.cp_async_commit()
            ptx.cp_async_wait_all()
            cute.arch.barrier()
            self.warp_keys(smem, wbase, col0, warp, lane, m, words[i % 2], Int64(0))
            cute.arch.barrier()
            slot = Int64(keys) + (Int64(KEY_ROWS * i) + Int64(tidx)) * 8
            if Int32(tidx) < m:
                best = self.cta_key(smem, Int32(tidx))
                ptx.red_max_u64(slot, best)
                ptx.fence_acq_rel_gpu()
            if cutlass.const_expr(i + 1 < self.steps):
                # The next step's base logits, while the other CTAs arrive.
                self.load_base(words[(i + 1) % 2], Int64(base) + Int64(i + 1) * Int64(base_step) * 2, base_row,
                               col0, g, t4, m)
            if cutlass.const_expr(i + 1 == self.steps and self.pdl):
                # The next kernel reads the tokens only after its wait (this grid's end).
                ptx.pdl_launch_dependents()
            cute.arch.barrier()
            if tidx == 0:
                ptx.grid_arrive_wait(Int64(counters), Uint32(self.ctas * (i + 1)), ptx.globaltimer() + timeout_ns)
            cute.arch.barrier()
            if Int32(tidx) < m:
                t = target_id(c, ptx.ld_relaxed_u64(slot), d2t)
                ptx.st_shared_b64(tok + Int32(tidx) * 8, t)
                if cta == 0:
                    ptx.st_global_b64(Int64(tokens) + (Int64(tidx) * Int64(tokens_row)
                                                       + Int64(i) * Int64(tokens_step)) * 8, t)
            cute.arch.barrier()
        # Count out; the last CTA (all others past every read of the keys) resets the words.
        flag = smem + lay.flag
        count_in(tidx, Int64(counters) + 4, self.ctas, flag)
        if ptx.ld_shared_b32(flag) != Uint32(0):
            if Int32(tidx) < m:
                for i in cutlass.range_constexpr(self.steps):
                    ptx.st_global_b64(Int64(keys) + (Int64(KEY_ROWS * i) + Int64(tidx)) * 8, Int64(0))
            if tidx == 0:
                ptx.st_global_b32(Int64(counters), Uint32(0))
                ptx.st_global_b32(Int64(counters) + 4, Uint32(0))


def fake_args() -> tuple:
    """The compile signature of ``MarkovPersistentKernel`` (no GPU memory needed)."""
    return (Int64(0), Int32(0), Int32(0), Int64(0), Int32(1), Int64(0), Int64(1), Int64(0), Int64(0), Int64(0),
            Int32(0), Int32(0), Int64(0), Int64(0), Int32(1), Int64(0), fake_stream())


@jit_cache("MarkovPersistentLoop")
def compile_persistent(constants: MarkovConstants, steps: int, n_tiles: int, wide: bool, pdl: bool):
    """The compiled ``MarkovPersistentKernel`` of one variant."""
    return MarkovPersistentKernel(constants, steps, n_tiles, bool(wide), bool(pdl)), fake_args()


# ---------------------------------------------------------------- host API

ops.define("markov_persistent_loop", "(str handle, Tensor base, Tensor prev, Tensor(a!) tokens) -> ()")


class MarkovPersistentLoop(MarkovBiasStep):
    """``MarkovBiasStep``'s head, ``w2`` and build-time check (the same row
    counts, where cuBLAS sums the bias GEMM in one split), and the loop of
    ``steps`` steps in one launch (module docstring), for 1 to ``max_rows``
    (at most 32) rows; or ``bind(step)``: the rows a ``MarkovBiasStep`` of
    the same head found. ``probe()`` then launches it once against vLLM's
    loop in torch ops before anything is bound for good.

    ``run(base, prev, tokens)``: ``base`` BF16 ``[R, steps, vocab]`` (each
    step's view as ``MarkovBiasStep.run`` takes it), ``prev`` int32/int64
    ``[R]`` (any stride), ``tokens`` int64 ``[R, steps]`` (any strides).
    ``timeout_s``: a grid barrier's longest wait before the kernel traps.
    Traced by torch.compile it is ``torch.ops.dspark.markov_persistent_loop``."""

    OP = "markov_persistent_loop"

    def __init__(self, constants: MarkovConstants, w1: torch.Tensor, d2t: torch.Tensor | None, w2: torch.Tensor,
                 steps: int, max_rows: int = MAX_LOOP_ROWS, *, pdl: bool | None = None,
                 timeout_s: float = TIMEOUT_S) -> None:
        max_rows = check_max_rows(max_rows, MAX_LOOP_ROWS, "the persistent Markov loop")
        super().__init__(constants, w1, d2t, w2, max_rows, pdl=pdl)
        if checks.as_int(steps) is None or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"the persistent Markov loop takes 1 to {MAX_STEPS} steps, not steps={steps!r}")
        steps = int(steps)
        timeout_s = checks.duration("the barrier timeout timeout_s", timeout_s, 1e-3, 60.0)
        sms = sm_count(self.device) if self.device.type == "cuda" else None
        why = persistent_unsupported(constants, max_rows, sms)
        if why is not None:
            raise Unsupported(why)
        self.steps, self.timeout_ns = steps, int(timeout_s * 1e9)
        self.refused = False  # whether the last probe's launch or capture raised
        self.keys = torch.zeros(steps * KEY_ROWS, dtype=torch.int64, device=self.device)
        self.counters = torch.zeros(2, dtype=torch.int32, device=self.device)

    def bind(self, step: MarkovBiasStep) -> None:
        """Take the row counts (up to ``max_rows``) that ``step``'s build-time
        check bound, instead of checking again: the same head and ``w2``, so
        the same question to cuBLAS; then compile."""
        check_bind("the persistent Markov loop", step, self.w2, self.constants,
                   ("vocab", "rank", "multiplier", "soft_cap", "d2t"))
        self.rows, self.reasons = bound_rows(step, self.max_rows)
        self.prepare()

    def probe(self, seed: int = gemm_check.SEED) -> str | None:
        """One launch at the smallest and at the largest bound row count on
        seeded operands (base logits ``N(0, 16)`` in BF16 with a NaN, a row
        of -inf and a tie planted; anchors over w1's rows, int64), its
        tokens compared with vLLM's greedy loop in torch ops
        (``spec.greedy_loop``: ``F.embedding``, the bias on the live cuBLAS
        ``F.linear``, the output transform, ``argmax``, d2t); on CUDA then
        the same launch captured in a CUDA graph and replayed (``captured``:
        vLLM captures the draft's step), its tokens compared again. The
        launch is new to the driver (cooperative, with PDL where set, in a
        graph), so a deployment asks once before it binds: where the tokens
        differ or a launch or the capture raises, every row count is unbound
        (the step loop then runs) and the reason is returned, ``refused``
        set where something raised; None where all agreed. Run it before the
        deployment's graph capture, after ``check`` or ``bind``."""
        from dspark_core.spec import markov as spec

        self.refused = False
        if not self.rows:
            return None
        c, n = self.constants, self.steps
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for rows in sorted({min(self.rows), max(self.rows)}):
            base = (torch.randn(rows * n, c.vocab, generator=gen, device=self.device) * 4).to(torch.bfloat16)
            base[0, 5] = float("nan")
            base[-1] = float("-inf")
            base[rows * n // 2, :2] = 1e4  # a tie at the soft cap's saturation (or of equal values)
            base = base.view(rows, n, c.vocab)
            prev = torch.randint(0, self.w1.shape[0], (rows,), generator=gen, device=self.device)
            tokens = torch.full((rows, n), -1, dtype=torch.int64, device=self.device)
            try:
                self.launch(base, prev, tokens)  # (operands built to the loop's contract)
                want = spec.greedy_loop(base, prev, self.w1, self.w2, c.multiplier, c.soft_cap, self.d2t)
                same = torch.equal(tokens, want)
                if same and self.device.type == "cuda":
                    tokens.fill_(-1)
                    self.captured(base, prev, tokens)
                    same = torch.equal(tokens, want)
            except Exception as error:  # noqa: BLE001 (a launch the driver refuses unbinds the loop, with the reason)
                self.refused = True
                why = f"the persistent loop's probe launch at {rows} rows failed ({type(error).__name__}: {error})"
            else:
                why = None if same else (f"the persistent loop's probe at {rows} rows drafted other tokens than "
                                         "vLLM's greedy loop")
            if why is not None:
                self.reasons = {m: why for m in range(1, self.max_rows + 1)}
                self.rows = {}
                return why
        return None

    def captured(self, base, prev, tokens) -> None:
        """One launch captured in a CUDA graph and replayed, synchronized
        (``probe``'s second question: whether the driver takes the launch in
        a graph)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.launch(base, prev, tokens)
        graph.replay()
        torch.cuda.synchronize(self.device)

    def prepare(self, prev_dtypes=(torch.int32, torch.int64)) -> None:
        """Compile every variant the bound rows launch, for ``prev`` of each of ``prev_dtypes``."""
        for nt in sorted({n_tiles_for(m) for m in self.rows}):
            for dtype in prev_dtypes:
                compile_persistent(self.constants, self.steps, nt, dtype == torch.int64, self.pdl)

    def problem(self, base, prev, tokens) -> str | None:
        """Why the loop does not take these operands (a sentence), or None."""
        steps, vocab = self.steps, self.constants.vocab
        if not isinstance(base, torch.Tensor) or base.dtype != torch.bfloat16 or base.dim() != 3 \
                or tuple(base.shape[1:]) != (steps, vocab):
            return f"the base logits must be bfloat16 [rows, {steps}, {vocab}], not {describe(base)}"
        rows = base.shape[0]
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tuple(tokens.shape) != (rows, steps):
            return f"the tokens must be int64 [{rows}, {steps}], not {describe(tokens)}"
        for i in range(steps):  # each step's view as the bias step reads it
            try:
                check_logits(vocab, self.max_rows, base[:, i])
            except ValueError as error:
                return f"{error} (step {i}'s view of the base logits {describe(base)})"
        return super().problem(base[:, 0], prev, tokens[:, 0])

    def takes(self, base, prev, tokens) -> bool:
        return self.problem(base, prev, tokens) is None

    def run(self, base, prev, tokens) -> None:
        reason = self.problem(base, prev, tokens)
        if reason is not None:
            raise ValueError(reason)
        self.launch(base, prev, tokens)

    def launch(self, base, prev, tokens) -> None:
        """``run`` without its operand checks (for operands ``takes``)."""
        ops.launch(self, base, prev, tokens)

    def _launch_kernel(self, base, prev, tokens) -> None:
        m = base.shape[0]
        kernel = compile_persistent(self.constants, self.steps, n_tiles_for(m), prev.dtype == torch.int64, self.pdl)
        d2t = self.d2t.data_ptr() if self.d2t is not None else 0
        kernel(Int64(base.data_ptr()), Int32(base.stride(0)), Int32(base.stride(1)), Int64(prev.data_ptr()),
               Int32(prev.stride(0)), Int64(self.w1.data_ptr()), Int64(self.w1.shape[0]), Int64(self.w2.data_ptr()),
               Int64(d2t), Int64(tokens.data_ptr()), Int32(tokens.stride(0)), Int32(tokens.stride(1)),
               Int64(self.keys.data_ptr()), Int64(self.counters.data_ptr()), Int32(m), Int64(self.timeout_ns),
               current_stream())


__all__ = ["MAX_LOOP_ROWS", "MAX_STEPS", "MarkovPersistentKernel", "MarkovPersistentLoop", "PersistentLayout",
           "compile_persistent", "persistent_unsupported"]
