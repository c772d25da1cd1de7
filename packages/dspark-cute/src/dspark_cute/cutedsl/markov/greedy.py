"""The fused greedy Markov step: ``dspark_core.spec.markov`` steps 3-6 and
the next step's step 1, one launch after the stock bias GEMM, bit for bit
vLLM 0.33.0's greedy loop (``DSparkSpeculator._sample_sequential``).

For R rows (requests) of BF16 base logits ``base [R, V]`` (step i's view of
``compute_draft_logits``' output: rows strided) and the stock GEMM's BF16
bias ``bias [R, V]`` (a view of ``[R, Vpad]``), per row ``r``:

1. per column ``k``: ``l = cvt.rn.bf16(add.rn(base, bias))`` widened back;
   ``x = mul.rn(l, M)``; with a soft cap ``y = mul.rn(tanhf(mul.rn(x, J)),
   C)`` (``ptx.tanhf``: CUDA 13's instruction sequence), else ``y = x``;
2. ``d``: the argmax of the row's ``y`` under ATen's rule (the first NaN,
   else the first maximum, -0.0 tying +0.0): the maximum of the argmax keys
   (``ptx.argmax_key``, a total order, so the reduction's order is free);
3. ``t = d + d2t[d]`` (int64; ``t = d`` without a d2t), stored at
   ``tokens + 8 r s`` (``s`` the tokens' row stride: ``draft_tokens[:R,
   i]``);
4. with ``gather``: the BF16 row ``w1[t]`` (``rank`` columns) copied to
   ``embed [R, rank]`` row ``r``: the next step's ``markov_embed``.

Grid ``(ctas, R)``: CTA ``j`` of row ``r`` takes columns ``2048 j ..
2048 j + 2047`` (256 threads of one 16-byte vector each; a thread past the
row's end redoes its last vector, which leaves the maximum unchanged). Each
thread reduces its 8 keys, each warp its 32 (``ptx.warp_key_max``), and
lane 0 of each warp folds the warp's key into the row's word ``keys[r]``
(``red.max.u64``), then ``fence.acq_rel.gpu``; after a CTA barrier thread 0
counts the CTA in ``counters[r]`` (``atom.acq_rel.gpu.add``); the CTA that
counts last reads the row's key and resets it to 0 (``atom.exch``), resets
the counter, and does steps 3-4. Both words are 0 between launches (the host
allocates them zeroed; every launch that completes leaves them so), so one
pair serves every launch on a stream; two launches must not run
concurrently on the same host's words. Every key is above 0 (a -inf has high
word 0x007FFFFF).

No PDL: the kernel reads the GEMM's output at once and the next GEMM reads
``embed``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from dspark_core.contracts.constants import within_limits
from dspark_core.contracts.markov import (
    MARKOV_THREADS,
    MARKOV_VEC,
    MarkovConstants,
    markov_rows,
)
from dspark_core.spec.markov import check_d2t, transform_constants
from dspark_cute import ptx
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import current_stream, describe, fake_stream, jit_cache, smem_allocator

THREADS = MARKOV_THREADS
VEC = MARKOV_VEC


def check_constants(c: MarkovConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (a MarkovConstants): its
    limits (``dspark_core.contracts.limits``, which ``markov_constants``
    ends with: vocabulary and rank positive multiples of 8, the rank at most
    ``MARKOV_MAX_RANK``, one vector of the embedding row a thread)."""
    constants_of(c, MarkovConstants, "MarkovStep")


# ---------------------------------------------------------------- the steps' checks
# Written once for the greedy step (``MarkovStep``) and the probabilistic one
# (``sample.MarkovSampleStep``), which shares its head, its logits, its
# outputs and its grid-wide fold.


def constants_of(c, cls: type, host: str) -> None:
    """ValueError unless ``c`` is a ``cls``; Unsupported unless within its
    kernel's limits (``contracts.limits``)."""
    if not isinstance(c, cls):
        raise ValueError(f"{host} takes {cls.__name__}, not {type(c).__name__}")
    within_limits(c)


def check_w1(w1, rank: int, at_least: int | None = None) -> None:
    """ValueError unless ``w1`` (the first Markov factor) is a contiguous,
    16-byte aligned BF16 ``[rows, rank]`` tensor, of at least ``at_least``
    rows where given."""
    if not isinstance(w1, torch.Tensor) or w1.dtype != torch.bfloat16 or w1.dim() != 2 or w1.shape[1] != rank \
            or (at_least is not None and w1.shape[0] < at_least):
        rows = "target vocab" if at_least is None else f">= {at_least}"
        raise ValueError(f"w1 must be a bfloat16 [{rows}, {rank}] tensor, not {describe(w1)}")
    if not w1.is_contiguous() or w1.data_ptr() % 16:
        raise ValueError(f"w1 must be contiguous and aligned to 16 bytes, not {describe(w1)}")


def check_head(constants, w1, d2t) -> None:
    """ValueError unless ``w1`` (``check_w1``) and ``d2t`` are a greedy
    step's head for ``constants``: with a d2t map an int64 ``[vocab]`` on
    w1's device whose target ids are rows of w1 (the next step embeds w1 at
    them); without one, None and a vocabulary within w1's rows."""
    check_w1(w1, constants.rank)
    if constants.d2t:
        check_d2t_tensor(d2t, constants.vocab, w1.device)
        check_d2t(d2t, constants.vocab, w1.shape[0])
    elif d2t is not None:
        raise ValueError("these constants have no d2t map: pass d2t=None")
    elif constants.vocab > w1.shape[0]:
        raise ValueError(f"without a d2t map the draft ids are target ids: a draft vocabulary of "
                         f"{constants.vocab}, more than w1's {w1.shape[0]} rows")


def check_d2t_tensor(d2t, vocab: int, device: torch.device, contiguous: bool = True) -> None:
    """ValueError unless ``d2t`` is an int64 ``[vocab]`` tensor on
    ``device`` (contiguous where the kernel reads it); its values are
    ``spec.markov.check_d2t``'s."""
    if not isinstance(d2t, torch.Tensor) or d2t.dtype != torch.int64 or tuple(d2t.shape) != (vocab,) \
            or (contiguous and not d2t.is_contiguous()) or d2t.device != device:
        what = "a contiguous int64" if contiguous else "an int64"
        raise ValueError(f"d2t must be {what} [{vocab}] tensor on {device}, not {describe(d2t)}")


def row_words(max_rows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, counters)``: the grid-wide fold's zeroed words, one pair a
    row for ``max_rows`` rows (``markov_rows``: 1 to ``MARKOV_MAX_ROWS``)."""
    max_rows = markov_rows(max_rows)
    return (torch.zeros(max_rows, dtype=torch.int64, device=device),
            torch.zeros(max_rows, dtype=torch.int32, device=device))


def check_logits(vocab: int, max_rows: int, base, bias=None) -> None:
    """ValueError unless ``base`` and ``bias`` (None: the base alone) are
    BF16 ``[R, vocab]`` (1 <= R <= max_rows) the kernel reads."""
    logits = (("the base logits", base),) + ((("the Markov bias", bias),) if bias is not None else ())
    for name, t in logits:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != vocab:
            raise ValueError(f"{name} must be bfloat16 [rows, {vocab}], not {describe(t)}")
        if t.stride(1) != 1 or t.stride(0) % VEC or t.data_ptr() % 16:
            raise ValueError(f"{name} must have unit column stride, a row stride that is a multiple of {VEC} "
                             f"and a 16-byte aligned start, not {describe(t)}")
    rows = base.shape[0]
    if bias is None and not 1 <= rows <= max_rows:
        raise ValueError(f"the base logits must have 1 to {max_rows} rows, not {rows}")
    if bias is not None and (not 1 <= rows <= max_rows or bias.shape[0] != rows):
        raise ValueError(f"the base logits and the bias must have the same 1 to {max_rows} rows, not "
                         f"{base.shape[0]} and {bias.shape[0]}")


def check_tokens(rows: int, tokens) -> None:
    """ValueError unless ``tokens`` is an int64 ``[rows]`` tensor (any stride)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tuple(tokens.shape) != (rows,):
        raise ValueError(f"the tokens must be int64 [{rows}], not {describe(tokens)}")


def check_outputs(rank: int, rows: int, tokens, embed, gather) -> None:
    """ValueError unless ``tokens`` (``check_tokens``), ``embed`` and ``gather`` are the kernel's."""
    check_tokens(rows, tokens)
    if not isinstance(embed, torch.Tensor) or embed.dtype != torch.bfloat16 \
            or tuple(embed.shape) != (rows, rank) or not embed.is_contiguous() or embed.data_ptr() % 16:
        raise ValueError(f"the embedding output must be a contiguous bfloat16 [{rows}, {rank}] aligned to 16 "
                         f"bytes, not {describe(embed)}")
    if not isinstance(gather, bool):
        raise ValueError(f"gather must be a bool, not {gather!r}")


def check_on(device: torch.device, operands) -> None:
    """ValueError unless every ``(name, tensor)`` of ``operands`` is on ``device``."""
    for name, t in operands:
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, not {t.device}")


def check_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"the fused Markov step runs on CUDA: w1 is on {device}")


# ---------------------------------------------------------------- the kernel


class MarkovGreedyKernel:
    """The traced step of one ``MarkovConstants``. Call: ``(base,
    base_stride, bias, bias_stride, d2t, w1, embed, tokens, tokens_stride,
    keys, counters, gather, m, stream)``: byte addresses (Int64) and row
    strides in elements (Int32), ``gather`` (Int32, 0 or 1), ``m`` the rows
    (Int32, at least 1)."""

    def __init__(self, constants: MarkovConstants) -> None:
        check_constants(constants)
        self.constants = constants

    @cute.jit
    def __call__(self, base: Int64, base_stride: Int32, bias: Int64, bias_stride: Int32, d2t: Int64, w1: Int64,
                 embed: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64, gather: Int32,
                 m: Int32, stream):
        self.kernel(base, base_stride, bias, bias_stride, d2t, w1, embed, tokens, tokens_stride, keys, counters,
                    gather).launch(grid=[self.constants.ctas, m, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, base: Int64, base_stride: Int32, bias: Int64, bias_stride: Int32, d2t: Int64, w1: Int64,
               embed: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64, gather: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, row, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        # Shared: the last-CTA flag, then the token.
        shared = Int32(smem_allocator().allocate(16, 16).toint())
        key = row_key(self.constants, tidx, cta, row, base, base_stride, bias, bias_stride)
        finish(self.constants, key, tidx, lane, row, shared, d2t, w1, embed, tokens, tokens_stride, keys, counters,
               gather)


def step_values(c: MarkovConstants, b: list, s: list) -> list:
    """Step 1 for one vector (or any even count of columns): base and bias
    values (FP32 widened from BF16) to the transformed FP32 ``y``."""
    pairs = [ptx.add_rn(b[j], s[j]) for j in range(len(b))]
    mult = ptx.f32_const(c.multiplier)
    y = [ptx.mul_rn(v, mult) for v in ptx.round_bf16(pairs)]
    if c.soft_cap is not None:
        cap = ptx.f32_const(c.soft_cap)
        inv = ptx.f32_const(transform_constants(c.multiplier, c.soft_cap)[2])
        y = [ptx.mul_rn(ptx.tanhf(ptx.mul_rn(v, inv)), cap) for v in y]
    return y


def row_key(c: MarkovConstants, tidx, cta, row, base, base_stride, bias, bias_stride) -> Int64:
    """The largest key of this thread's vector (step 2's first fold)."""
    v = Int32(cta) * THREADS + Int32(tidx)
    vc = cutlass.min(v, Int32(c.vocab // VEC - 1))
    col = vc * VEC
    b = ptx.ld_bf16x8(Int64(base) + (Int64(row) * Int64(base_stride) + Int64(col)) * 2)
    s = ptx.ld_bf16x8(Int64(bias) + (Int64(row) * Int64(bias_stride) + Int64(col)) * 2)
    key = None
    for j, y in enumerate(step_values(c, b, s)):
        k = ptx.argmax_key(y, col + j)
        key = k if key is None else ptx.max_u64(key, k)
    return key


@cute.jit
def count_in(tidx, counter, ctas: cutlass.Constexpr, flag) -> None:
    """Thread 0 counts this CTA in at the global ``counter``
    (``atom.acq_rel.gpu.add``) and stores at the shared ``flag`` whether it
    counted last of ``ctas`` (1) or not (0); then a CTA barrier, after which
    every thread may read ``flag``."""
    if tidx == 0:
        old = ptx.atom_add_acq_rel_u32(counter, Uint32(1))
        if old == Uint32(ctas - 1):
            ptx.st_shared_b32(flag, Uint32(1))
        else:
            ptx.st_shared_b32(flag, Uint32(0))
    cute.arch.barrier()


@cute.jit
def finish(c: MarkovConstants, key, tidx, lane, row, shared, d2t, w1, embed, tokens, tokens_stride, keys, counters,
           gather) -> None:
    """Step 2's grid-wide fold, then steps 3-4 in the row's last CTA (module docstring)."""
    key_addr = Int64(keys) + Int64(row) * 8
    count_addr = Int64(counters) + Int64(row) * 4
    wkey = ptx.warp_key_max(key)
    if lane == 0:
        ptx.red_max_u64(key_addr, wkey)
        ptx.fence_acq_rel_gpu()
    cute.arch.barrier()
    count_in(tidx, count_addr, c.ctas, shared)
    if ptx.ld_shared_b32(shared) != Uint32(0):
        if tidx == 0:
            best = ptx.atom_exch_u64(key_addr, Int64(0))
            ptx.st_global_b32(count_addr, Uint32(0))
            t = target_id(c, best, d2t)
            ptx.st_global_b64(Int64(tokens) + Int64(row) * Int64(tokens_stride) * 8, t)
            ptx.st_shared_b32(shared + 4, Uint32(Int32(t)))
        cute.arch.barrier()
        if gather != 0:
            t = Int64(ptx.ld_shared_s32(shared + 4))
            if tidx < c.rank // VEC:
                words = ptx.ld_global_v4(Int64(w1) + t * (c.rank * 2) + Int64(tidx) * 16)
                ptx.st_global_v4(Int64(embed) + Int64(row) * (c.rank * 2) + Int64(tidx) * 16, words)


def target_id(c: MarkovConstants, key, d2t) -> Int64:
    """Step 3 of the row whose grid-wide largest key is ``key``: its column
    ``d``, then ``t = d + d2t[d]`` (the int64 at ``d2t + 8 d``), or ``d``
    where the constants have no d2t (traced inline)."""
    d = Int64(ptx.key_column(key))
    return d + ptx.ld_global_s64(Int64(d2t) + d * 8) if c.d2t else d


def fake_args(constants: MarkovConstants) -> tuple:
    """The compile signature of ``MarkovGreedyKernel`` (no GPU memory needed)."""
    return (Int64(0), Int32(0), Int64(0), Int32(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(0), Int64(0),
            Int64(0), Int32(0), Int32(1), fake_stream())


@jit_cache("MarkovStep")
def compile_markov_step(constants: MarkovConstants):
    """The compiled ``MarkovGreedyKernel`` of ``constants``."""
    return MarkovGreedyKernel(constants), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("markov_step", "(str handle, Tensor base, Tensor bias, Tensor(a!) tokens, Tensor(b!) embed, bool gather)"
                          " -> ()")


class MarkovStep:
    """One greedy Markov step after the stock bias GEMM (module docstring):
    ``run(base, bias, tokens, embed, gather)`` writes the drafted target ids
    into ``tokens`` and, with ``gather``, ``w1`` of them into ``embed``,
    the same bits as ``dspark_core.spec.markov`` (and vLLM's loop).

    Built from ``MarkovConstants``, ``w1`` (BF16 ``[V_target, rank]``,
    contiguous, 16-byte aligned; a launch needs it on CUDA), ``d2t`` (int64 ``[vocab]``,
    contiguous, on ``w1``'s device; None where the constants have no d2t)
    and ``max_rows`` (``markov_rows``: 1 to 65535; its key and counter words). Operands:
    ``base`` and ``bias`` BF16 ``[R, vocab]`` with unit column stride, row
    strides multiples of 8 and 16-byte aligned starts; ``tokens`` int64
    ``[R]`` (any stride: a column of ``draft_tokens``); ``embed`` BF16 ``[R,
    rank]`` contiguous, 16-byte aligned; all on ``w1``'s device, R from 1 to
    ``max_rows``. One compile serves every R: ``prepare()`` before CUDA
    graph capture (a compile during capture raises RuntimeError). Traced by
    torch.compile, a launch is the op ``torch.ops.dspark.markov_step``."""

    OP = "markov_step"

    def __init__(self, constants: MarkovConstants, w1: torch.Tensor, d2t: torch.Tensor | None,
                 max_rows: int = 512) -> None:
        check_constants(constants)
        check_head(constants, w1, d2t)
        self.keys, self.counters = row_words(max_rows, w1.device)
        self.constants = constants
        self.w1, self.d2t, self.max_rows = w1, d2t, max_rows
        self.device = w1.device
        self.op_handle = ops.register(self)

    def prepare(self) -> None:
        """Compile the kernel (one variant: R and ``gather`` are runtime
        arguments). Call before CUDA graph capture."""
        compile_markov_step(self.constants)

    def problem(self, base, bias, tokens, embed, gather: bool = True) -> str | None:
        """Why the kernel does not take these operands (class docstring), a sentence, or None."""
        try:
            self._check_operands(base, bias, tokens, embed, gather)
        except ValueError as error:
            return str(error)
        return None

    def _check_operands(self, base, bias, tokens, embed, gather) -> None:
        c = self.constants
        check_logits(c.vocab, self.max_rows, base, bias)
        check_outputs(c.rank, base.shape[0], tokens, embed, gather)
        check_on(self.device, (("the base logits", base), ("the Markov bias", bias), ("the tokens", tokens),
                               ("the embedding output", embed)))
        self._check_device()

    def _check_device(self) -> None:
        check_cuda(self.device)

    def takes(self, base, bias, tokens, embed, gather: bool = True) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(base, bias, tokens, embed, gather) is None

    def run(self, base, bias, tokens, embed, gather: bool = True) -> None:
        """Steps 1-4 (module docstring); ValueError with ``problem``'s sentence
        for operands the kernel does not take."""
        reason = self.problem(base, bias, tokens, embed, gather)
        if reason is not None:
            raise ValueError(reason)
        self.launch(base, bias, tokens, embed, gather)

    def launch(self, base, bias, tokens, embed, gather: bool = True) -> None:
        """``run`` without its operand checks (for operands ``takes``)."""
        ops.launch(self, base, bias, tokens, embed, gather)

    def _launch_kernel(self, base, bias, tokens, embed, gather) -> None:
        kernel = compile_markov_step(self.constants)
        d2t = self.d2t.data_ptr() if self.d2t is not None else 0
        kernel(Int64(base.data_ptr()), Int32(base.stride(0)), Int64(bias.data_ptr()), Int32(bias.stride(0)),
               Int64(d2t), Int64(self.w1.data_ptr()), Int64(embed.data_ptr()), Int64(tokens.data_ptr()),
               Int32(tokens.stride(0)), Int64(self.keys.data_ptr()), Int64(self.counters.data_ptr()),
               Int32(1 if gather else 0), Int32(base.shape[0]), current_stream())


__all__ = ["MarkovGreedyKernel", "MarkovStep", "THREADS", "check_constants", "check_cuda", "check_d2t_tensor",
           "check_head", "check_logits", "check_on", "check_outputs", "check_tokens", "check_w1", "compile_markov_step",
           "constants_of", "fake_args", "row_key", "row_words", "step_values", "target_id"]
