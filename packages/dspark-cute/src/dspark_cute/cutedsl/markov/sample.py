"""The fused probabilistic Markov step: ``dspark_core.spec.markov`` steps 3-4
and ``dspark_core.spec.gumbel.probabilistic_step`` (vLLM 0.33.0's
``_sample_logits`` with ``draft_logits`` set, no watermarker, FP32 noise),
then the next step's embedding gather, in one launch after the stock bias
GEMM.

For step ``i`` and R rows, per row ``r`` (``req = idx_map[r]``, valid where
``req >= 0``; ``temp``, ``seed`` from ``temperature`` and ``seeds`` at
``req``, 0 for an invalid row; ``seed ^= i << 32``; ``p = pos[r] - 1 +
2^30``) and target column ``c`` (``d = t2d[c]``: the draft column mapped to
``c``, or -1):

1. ``x``: where ``d >= 0``, the greedy step's transformed ``y`` of draft
   column ``d`` (``greedy.step_values``) rounded to BF16 (``cvt.rn``; the
   cast into the scatter buffer); elsewhere -inf;
2. with a valid row, ``cache[req, i, c] = x`` (BF16, 16-byte stores);
3. ``z = div.full(x, temp) + gumbel_noise(gumbel_uniform(seed, p, c))``
   where ``temp != 0``, else ``z = x``;
4. the argmax of ``z`` over the target columns (``ptx.argmax_key``: the
   first maximum; a NaN first, where vLLM's Triton argmax depends on its
   reduction tree: the stated exception) is the token ``t``, stored at
   ``tokens + 8 r s``; with ``gather``, ``w1[t]`` into ``embed[r]``
   (``greedy.finish``, the same grid-wide fold).

Grid ``(ceil(V_target / 2048), R)``: each thread takes 8 consecutive target
columns (two 16-byte loads of ``t2d``, two 2-byte loads of base and bias a
mapped column). No PDL.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from dspark_core.contracts.markov import MarkovSampleConstants
from dspark_core.spec.markov import check_d2t
from dspark_cute import ptx
from dspark_cute.cutedsl.markov.greedy import (
    THREADS,
    VEC,
    check_cuda,
    check_d2t_tensor,
    check_logits,
    check_on,
    check_outputs,
    check_w1,
    constants_of,
    finish,
    row_words,
    step_values,
)
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import current_stream, describe, fake_stream, jit_cache, smem_allocator

NEG_INF_BF16 = 0xFF80


def check_constants(c: MarkovSampleConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (a MarkovSampleConstants):
    its limits (``dspark_core.contracts.limits``, which
    ``markov_sample_constants`` ends with: the greedy step's, and a target
    vocabulary that is a positive multiple of 8 no smaller than the draft's)."""
    constants_of(c, MarkovSampleConstants, "MarkovSampleStep")


def check_sampling(c: MarkovSampleConstants, rows: int, idx_map, temperature, seeds, pos, cache, col) -> None:
    """ValueError unless a step of ``rows`` rows takes these sampling
    operands (``MarkovSampleStep``'s docstring): ``idx_map`` and ``pos``
    int64 ``[rows]`` (any stride), ``temperature`` FP32 and ``seeds`` int64
    contiguous vectors, the BF16 logits ``cache [requests, steps, >=
    target_vocab]`` with unit column stride, row strides multiples of 8 and a
    16-byte aligned start, ``col`` one of its steps."""
    for name, t in (("idx_map", idx_map), ("pos", pos)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (rows,):
            raise ValueError(f"{name} must be int64 [{rows}], not {describe(t)}")
    for name, t, dtype in (("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} vector, not {describe(t)}")
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.bfloat16 or cache.dim() != 3 \
            or cache.shape[2] < c.target_vocab or cache.stride(2) != 1 or cache.stride(1) % VEC \
            or cache.stride(0) % VEC or cache.data_ptr() % 16:
        raise ValueError(f"the logits cache must be bfloat16 [requests, steps, >= {c.target_vocab}] with unit "
                         f"column stride, row strides multiples of {VEC}, 16-byte aligned, not {describe(cache)}")
    if isinstance(col, bool) or not isinstance(col, int) or not 0 <= col < cache.shape[1]:
        raise ValueError(f"col must be a step of the cache, 0 to {cache.shape[1] - 1}, not {col!r}")


def inverse_d2t(c: MarkovSampleConstants, d2t: torch.Tensor) -> torch.Tensor:
    """``t2d``: int32 ``[target_vocab]`` on d2t's device, the draft column
    each target column is mapped from, -1 where none (``d2t`` as
    ``MarkovSampleStep`` takes it: distinct targets below target_vocab)."""
    target = check_d2t(d2t, c.vocab, c.target_vocab, distinct=True)
    t2d = torch.full((c.target_vocab,), -1, dtype=torch.int32, device=d2t.device)
    t2d[target] = torch.arange(c.vocab, dtype=torch.int32, device=d2t.device)
    return t2d


class MarkovSampleKernel:
    """The traced probabilistic step of one ``MarkovSampleConstants``. Call:
    ``(base, base_stride, bias, bias_stride, t2d, w1, embed, tokens,
    tokens_stride, keys, counters, gather, idx_map, idx_stride, temperature,
    seeds, pos, pos_stride, cache, cache_s0, cache_s1, col, m, stream)``:
    byte addresses (Int64), strides in elements (Int32), ``gather`` and the
    step ``col`` (Int32), ``m`` the rows."""

    def __init__(self, constants: MarkovSampleConstants) -> None:
        check_constants(constants)
        self.constants = constants

    @cute.jit
    def __call__(self, base: Int64, base_stride: Int32, bias: Int64, bias_stride: Int32, t2d: Int64, w1: Int64,
                 embed: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64, gather: Int32,
                 idx_map: Int64, idx_stride: Int32, temperature: Int64, seeds: Int64, pos: Int64, pos_stride: Int32,
                 cache: Int64, cache_s0: Int64, cache_s1: Int64, col: Int32, m: Int32, stream):
        self.kernel(base, base_stride, bias, bias_stride, t2d, w1, embed, tokens, tokens_stride, keys, counters,
                    gather, idx_map, idx_stride, temperature, seeds, pos, pos_stride, cache, cache_s0, cache_s1,
                    col).launch(grid=[self.constants.ctas, m, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, base: Int64, base_stride: Int32, bias: Int64, bias_stride: Int32, t2d: Int64, w1: Int64,
               embed: Int64, tokens: Int64, tokens_stride: Int32, keys: Int64, counters: Int64, gather: Int32,
               idx_map: Int64, idx_stride: Int32, temperature: Int64, seeds: Int64, pos: Int64, pos_stride: Int32,
               cache: Int64, cache_s0: Int64, cache_s1: Int64, col: Int32):
        c = self.constants
        tidx, _, _ = cute.arch.thread_idx()
        cta, row, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        shared = Int32(smem_allocator().allocate(16, 16).toint())
        key = sample_key(c, tidx, cta, row, base, base_stride, bias, bias_stride, t2d, idx_map, idx_stride,
                         temperature, seeds, pos, pos_stride, cache, cache_s0, cache_s1, col)
        finish(c, key, tidx, lane, row, shared, Int64(0), w1, embed, tokens, tokens_stride, keys, counters, gather)


def _bf16_at(base, row, stride, column) -> Float32:
    """The BF16 at element ``column`` of row ``row`` (2-byte load), widened."""
    word = ptx.ld_global_u16(Int64(base) + (Int64(row) * Int64(stride) + Int64(column)) * 2)
    return ptx.as_f32(Uint32(word) << Uint32(16))


def row_sampling(row, idx_map, idx_stride, temperature, seeds, pos, pos_stride, col) -> tuple:
    """Row ``row``'s sampling operands at step ``col`` (module docstring):
    ``(valid, reqc, temp, seed, p)``: whether ``idx_map[row] >= 0``, the
    request clamped to 0, its temperature and ``seed ^ (col << 32)`` (0 and
    ``col << 32`` for an invalid row), and ``pos[row] - 1 + 2^30``. The
    noise applies where ``temp != 0``."""
    req = ptx.ld_global_s64(Int64(idx_map) + Int64(row) * Int64(idx_stride) * 8)
    valid = req >= Int64(0)
    reqc = cutlass.max(req, Int64(0))
    temp = ptx.as_f32(ptx.ld_global_b32(Int64(temperature) + reqc * 4))
    seed = ptx.ld_global_s64(Int64(seeds) + reqc * 8)
    zero = ptx.f32_const(0.0)
    temp = cutlass.select_(valid, temp, zero)
    seed = cutlass.select_(valid, seed, Int64(0)) ^ (Int64(col) << 32)
    p = ptx.ld_global_s64(Int64(pos) + Int64(row) * Int64(pos_stride) * 8) - 1 + (1 << 30)
    return valid, reqc, temp, seed, p


def sample_key(c: MarkovSampleConstants, tidx, cta, row, base, base_stride, bias, bias_stride, t2d, idx_map,
               idx_stride, temperature, seeds, pos, pos_stride, cache, cache_s0, cache_s1, col) -> Int64:
    """Steps 1-3 and the thread's first fold of step 4 (module docstring)."""
    v = Int32(cta) * THREADS + Int32(tidx)
    vc = cutlass.min(v, Int32(c.target_vocab // VEC - 1))
    c0 = vc * VEC
    # The row's request, temperature, seed and position (every thread loads them: cached).
    valid, reqc, temp, seed, p = row_sampling(row, idx_map, idx_stride, temperature, seeds, pos, pos_stride, col)
    words = ptx.ld_global_v4(Int64(t2d) + Int64(c0) * 4) + ptx.ld_global_v4(Int64(t2d) + Int64(c0) * 4 + 16)
    b, s = [], []
    for w in words:
        d = cutlass.max(Int32(w), Int32(0))  # an unmapped column reads column 0, then -inf replaces it
        b.append(_bf16_at(base, row, base_stride, d))
        s.append(_bf16_at(bias, row, bias_stride, d))
    y = ptx.round_bf16(step_values(c, b, s))
    neg_inf = ptx.as_f32(Uint32(NEG_INF_BF16 << 16))
    x = [cutlass.select_(Int32(w) >= Int32(0), yk, neg_inf) for w, yk in zip(words, y)]
    # Stored where the row is valid (index 0 < 1), skipped otherwise (1 < 1 fails).
    ptx.st_global_v4_if(Int64(cache) + (reqc * Int64(cache_s0) + Int64(col) * Int64(cache_s1) + Int64(c0)) * 2,
                        [ptx.pack_bf16x2_rn(x[k], x[k + 1]) for k in range(0, VEC, 2)],
                        cutlass.select_(valid, Int32(0), Int32(1)), Int32(1))
    noisy = temp != ptx.f32_const(0.0)
    key = Int64(0)
    for k in range(VEC):
        g = ptx.gumbel_noise(ptx.gumbel_uniform(seed, p, c0 + k))
        z = cutlass.select_(noisy, ptx.add_rn(ptx.div_full(x[k], temp), g), x[k])
        kk = ptx.argmax_key(z, c0 + k)
        key = kk if k == 0 else ptx.max_u64(key, kk)
    return key


def fake_args(constants: MarkovSampleConstants) -> tuple:
    """The compile signature of ``MarkovSampleKernel`` (no GPU memory needed)."""
    return (Int64(0), Int32(0), Int64(0), Int32(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(0), Int64(0),
            Int64(0), Int32(0), Int64(0), Int32(0), Int64(0), Int64(0), Int64(0), Int32(0), Int64(0), Int64(0),
            Int64(0), Int32(0), Int32(1), fake_stream())


@jit_cache("MarkovSampleStep")
def compile_markov_sample(constants: MarkovSampleConstants):
    """The compiled ``MarkovSampleKernel`` of ``constants``."""
    return MarkovSampleKernel(constants), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("markov_sample", "(str handle, Tensor base, Tensor bias, Tensor(a!) tokens, Tensor(b!) embed, bool gather, "
                            "Tensor idx_map, Tensor temperature, Tensor seeds, Tensor pos, Tensor(c!) cache, int col)"
                            " -> ()")


class MarkovSampleStep:
    """One probabilistic Markov step after the stock bias GEMM (module
    docstring): ``run(base, bias, tokens, embed, gather, idx_map,
    temperature, seeds, pos, cache, col)`` writes the sampled target ids into
    ``tokens``, the step's BF16 logits into ``cache[:, col]`` of the valid
    rows and, with ``gather``, ``w1`` of the ids into ``embed``: the bits of
    ``dspark_core.spec.gumbel.probabilistic_step`` (NaN logits aside).

    Built from ``MarkovSampleConstants``, ``w1`` (BF16 ``[target_vocab,
    rank]``, contiguous, 16-byte aligned), ``d2t`` (int64 ``[vocab]`` on
    ``w1``'s device, distinct targets below ``target_vocab``; the host builds
    its inverse ``t2d``) and ``max_rows``. Operands beyond the greedy step's
    (``greedy.MarkovStep``): ``idx_map`` and ``pos`` int64 ``[R]`` (any
    stride: columns of vLLM's ``[R, N]`` views), ``temperature`` FP32 and
    ``seeds`` int64 (``[max_reqs]``, contiguous), ``cache`` BF16 ``[max_reqs,
    N, >= target_vocab]`` with unit column stride, row strides multiples of 8
    and a 16-byte aligned start, ``col`` the step (0 to N - 1). A row's
    ``idx_map`` must be below ``cache``'s first dimension. ``prepare()``
    before CUDA graph capture."""

    OP = "markov_sample"

    def __init__(self, constants: MarkovSampleConstants, w1: torch.Tensor, d2t: torch.Tensor,
                 max_rows: int = 512) -> None:
        check_constants(constants)
        check_w1(w1, constants.rank, constants.target_vocab)
        # (d2t is read here, the kernel reads its inverse t2d: any strides)
        check_d2t_tensor(d2t, constants.vocab, w1.device, contiguous=False)
        self.t2d = inverse_d2t(constants, d2t)
        self.keys, self.counters = row_words(max_rows, w1.device)
        self.constants, self.w1, self.d2t, self.max_rows = constants, w1, d2t, max_rows
        self.device = w1.device
        self.op_handle = ops.register(self)

    def prepare(self) -> None:
        """Compile the kernel (one variant). Call before CUDA graph capture."""
        compile_markov_sample(self.constants)

    def problem(self, base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col) -> str | None:
        """Why the kernel does not take these operands (class docstring), a sentence, or None."""
        try:
            self._check_operands(base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col)
        except ValueError as error:
            return str(error)
        return None

    def _check_operands(self, base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col):
        c = self.constants
        check_logits(c.vocab, self.max_rows, base, bias)
        rows = base.shape[0]
        check_outputs(c.rank, rows, tokens, embed, gather)
        check_sampling(c, rows, idx_map, temperature, seeds, pos, cache, col)
        check_on(self.device, (("the base logits", base), ("the Markov bias", bias), ("the tokens", tokens),
                               ("the embedding output", embed), ("idx_map", idx_map), ("temperature", temperature),
                               ("seeds", seeds), ("pos", pos), ("the logits cache", cache)))
        check_cuda(self.device)

    def run(self, base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col) -> None:
        """The module docstring's step; ValueError with ``problem``'s sentence for operands it does not take."""
        reason = self.problem(base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col)
        if reason is not None:
            raise ValueError(reason)
        self.launch(base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col)

    def launch(self, base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col) -> None:
        """``run`` without its operand checks."""
        ops.launch(self, base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col)

    def _launch_kernel(self, base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache, col):
        kernel = compile_markov_sample(self.constants)
        kernel(Int64(base.data_ptr()), Int32(base.stride(0)), Int64(bias.data_ptr()), Int32(bias.stride(0)),
               Int64(self.t2d.data_ptr()), Int64(self.w1.data_ptr()), Int64(embed.data_ptr()),
               Int64(tokens.data_ptr()), Int32(tokens.stride(0)), Int64(self.keys.data_ptr()),
               Int64(self.counters.data_ptr()), Int32(1 if gather else 0), Int64(idx_map.data_ptr()),
               Int32(idx_map.stride(0)), Int64(temperature.data_ptr()), Int64(seeds.data_ptr()),
               Int64(pos.data_ptr()), Int32(pos.stride(0)), Int64(cache.data_ptr()), Int64(cache.stride(0)),
               Int64(cache.stride(1)), Int32(col), Int32(base.shape[0]), current_stream())


__all__ = ["MarkovSampleKernel", "MarkovSampleStep", "check_constants", "check_sampling", "compile_markov_sample",
           "fake_args", "inverse_d2t", "row_sampling", "sample_key"]
