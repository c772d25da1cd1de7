"""The draft's Markov stage as vLLM 0.33.0 runs it on CUDA: the spec of the
fused Markov step (``dspark_cute.cutedsl.markov``).

After the backbone, ``DSparkSpeculator._sample_sequential``
(``vllm/v1/worker/gpu/spec_decode/dspark/speculator.py``) drafts the N
tokens of each of R requests left to right. With the base logits ``base``
(``model.compute_draft_logits`` of the N sampled hidden states per request,
viewed ``[R, N, V]``, the head's dtype; V the draft vocabulary) and ``prev``
the anchor token of each request, step ``i`` (0..N-1) is, in vLLM's order:

1. ``e = markov_w1[prev]`` (``Qwen3DSparkForCausalLM.markov_embed``: an
   ``nn.Embedding`` gather, a copy; ``prev`` are target-vocabulary ids);
2. ``b = logits_processor(markov_w2, e)`` (``DSparkMarkovHead.bias``):
   ``LogitsProcessor._apply_head`` with the head's dtype equal to ``e``'s is
   ``F.linear(e, markov_w2)``, one cuBLAS GEMM ``[R, r] x [r, Vpad]`` whose
   output has ``e``'s dtype (FP32 accumulation, cuBLAS's order and one
   rounding); with an FP32 head over BF16 weights it is ``torch.mm(...,
   out_dtype=float32)`` on CUDA. Then ``[..., :V]`` drops the vocabulary
   padding (``ParallelLMHead`` pads rows to 64), with no soft cap and scale
   1 (the Muse Spark draft's ``LogitsProcessor(draft_vocab_size)``). The
   spec takes this GEMM as the stock's: ``markov_bias`` calls the same torch
   function, so on CUDA it *is* cuBLAS's result;
3. ``l = base[:, i] + b``: ATen's add of two tensors of the head's dtype,
   computed in FP32 and rounded once to that dtype (``add_bias``);
4. ``apply_output_logit_transform`` (``MuseSparkDSparkForCausalLM``):
   ``x = l.float() * M`` with ``M = f32(output_multiplier)`` (ATen's mul by
   a Python scalar takes it as FP32), then, with a soft cap ``c``,
   ``y = C * tanhf(x * J)`` with ``C = f32(c)`` and ``J = f32(1 / C)``: on
   CUDA, ATen divides by a CPU scalar as a multiplication by its FP32
   reciprocal (``div_true_kernel_cuda``), ``torch.tanh`` is CUDA's accurate
   ``tanhf`` (``tanhf`` below), the last product ``mul.rn``. Without a soft
   cap ``y = x`` (the multiply by M happens even for M = 1);
5. greedy (``draft_logits is None``, ``DSparkSpeculator._sample_logits``):
   ``d = y.argmax(-1)``, ATen's CUDA argmax: the first NaN if the row has
   one, else the first index of the row's maximum (``-0.0 == +0.0``, so a
   tie between them goes to the lower index; an all ``-inf`` row gives 0)
   (``argmax``); then ``t = d + d2t[d]`` (``map_draft_to_target``: int64;
   identity without a d2t);
6. ``draft_tokens[:R, i] = t`` (int64) and ``prev = t``.

Nothing else is written on the greedy path. The probabilistic path
(``draft_logits`` set) casts ``y`` to the cache's dtype, scatters it to its
target ids and draws with vLLM's Triton ``gumbel_sample``, which also writes
the logits cache: ``spec.gumbel.probabilistic_step``. The spec is bit for bit vLLM's loop on CUDA,
where ``ex2_approx_ftz`` and ``rcp_approx_ftz`` inside ``tanhf`` run the GPU
instructions; on a CPU every step but those two instructions (soft-capped
values of magnitude at least 0.6 before the cap) is exact.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dspark_core import checks
from dspark_core.spec import numerics
from dspark_core.spec.numerics import F32, f32, fma_rn

HEAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# CUDA 13's accurate tanhf (nvcc 13.0, sm_90a and sm_100a, no fast math), read
# from the compiled PTX: the constants by their FP32 bit patterns.
TANH_TWO_LOG2E = 0x4038AA3B  # 2 / ln 2, the ex2 argument's scale
TANH_SATURATE = 0x41102CB4  # |x| at or above this (9.0109) gives +-1
TANH_SMALL = 0x3F19999A  # below 0.6 the odd polynomial
TANH_POLY = (0x3C80F082, 0xBD563CAE, 0x3E085941, 0xBEAAA9ED)  # Horner, highest first, then + 0


def _bits(word: int) -> float:
    return float(np.array(word, dtype=np.uint32).view(np.float32))


def _full(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(x, value)


def check_head_dtype(dtype: torch.dtype, what: str = "the logits") -> None:
    if dtype not in HEAD_DTYPES:
        raise ValueError(f"{what} must be bfloat16, float16 or float32, not {dtype}")


def transform_constants(multiplier: float, soft_cap: float | None) -> tuple[float, float | None, float | None]:
    """``(M, C, J)`` of step 4: the FP32 multiplier, the FP32 soft cap and
    its FP32 reciprocal (``1.0f / C``, one IEEE division), or None for both
    without a cap. Both are checked once rounded (``checks.fp32_number``):
    TypeError for a non-number; ValueError for a multiplier that is not
    finite in FP32 or that a non-zero value rounds to 0 in FP32 (1e39 would
    make every logit inf or NaN, 1e-46 every logit 0: draft id 0 at every
    step), and for a cap that is not positive once rounded or whose FP32
    reciprocal is not finite (1e39, 1e-46 and 1e-39 all give NaN logits)."""
    m = f32(checks.fp32_number("the output multiplier", multiplier, nonzero=True))
    if soft_cap is None:
        return m, None, None
    c = np.float32(checks.fp32_number("the soft cap (None or a number)", soft_cap, low="positive",
                                      reciprocal=True))
    return m, float(c), float(np.float32(1.0) / c)


def tanhf(x: torch.Tensor) -> torch.Tensor:
    """CUDA's accurate ``tanhf`` of FP32 ``x`` (what ``torch.tanh`` runs on
    CUDA), in its instruction order: with ``a = |x|``,

    - ``a >= 0.6``: ``e = ex2.approx.ftz(a * 2/ln2)``, ``r =
      rcp.approx.ftz(e + 1)``, ``s = fma(r, -2, 1)``; ``s = 1`` where ``a >=
      9.0109`` (``TANH_SATURATE``); the sign of ``x`` copied onto ``s``;
    - else: ``q = x * x``, ``p = fma(fma(fma(fma(P0, q, P1), q, P2), q, P3),
      q, 0)``, the result ``fma(p, x, x)`` (so ``tanhf(-0.0) = -0.0``).

    NaN stays NaN; ``+-inf`` gives ``+-1``."""
    x = x.to(F32)
    a = torch.abs(x)
    # Looked up per call so that a test can replace the approximate instructions.
    e = numerics.ex2_approx_ftz(a * _bits(TANH_TWO_LOG2E))
    r = numerics.rcp_approx_ftz(e + 1.0)
    big = fma_rn(r, _full(r, -2.0), _full(r, 1.0))
    big = torch.where(a >= _bits(TANH_SATURATE), _full(big, 1.0), big)
    big = torch.copysign(big, x)
    q = x * x
    p = _full(q, _bits(TANH_POLY[0]))
    for c in (*TANH_POLY[1:], 0):
        p = fma_rn(p, q, _full(q, _bits(c) if c else 0.0))
    small = fma_rn(p, x, x)
    return torch.where(a >= _bits(TANH_SMALL), big, small)


def add_bias(base: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Step 3: ``base + bias`` of two tensors of the head's dtype, the sum in
    FP32 rounded once to that dtype (ATen's add)."""
    for name, t in (("the base logits", base), ("the Markov bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, not {type(t).__name__}")
        check_head_dtype(t.dtype, name)
    if base.dtype != bias.dtype or base.shape != bias.shape:
        raise ValueError(f"the base logits and the Markov bias must have one dtype and shape, not "
                         f"{base.dtype} {list(base.shape)} and {bias.dtype} {list(bias.shape)}")
    return (base.to(F32) + bias.to(F32)).to(base.dtype)


def output_transform(logits: torch.Tensor, multiplier: float, soft_cap: float | None) -> torch.Tensor:
    """Step 4, FP32: ``l.float() * M``, then ``C * tanhf(x * J)`` with a cap."""
    m, c, j = transform_constants(multiplier, soft_cap)
    x = logits.to(F32) * m
    if c is None:
        return x
    return tanhf(x * j) * c


def argmax(y: torch.Tensor) -> torch.Tensor:
    """Step 5's argmax of FP32 ``[..., V]`` rows, int64 ``[...]``: the first
    NaN where a row has one, else the first index of the row's maximum
    (ATen's ``argmax`` on CUDA: NaN compares greater than everything, ties go
    to the lower index, so the result does not depend on the reduction's
    order)."""
    if y.shape[-1] < 1:
        raise ValueError("an argmax needs at least one column")
    nan = torch.isnan(y)
    idx = torch.arange(y.shape[-1], device=y.device).expand_as(y)
    last = y.shape[-1]
    first_nan = torch.where(nan, idx, torch.full_like(idx, last)).amin(-1)
    clean = torch.where(nan, torch.full_like(y, -torch.inf), y)
    top = clean.amax(-1, keepdim=True)
    first_top = torch.where(clean == top, idx, torch.full_like(idx, last)).amin(-1)
    return torch.where(first_nan < last, first_nan, first_top)


def check_d2t(d2t: torch.Tensor, vocab: int, targets: int, distinct: bool = False) -> torch.Tensor:
    """The target id of every draft id, ``arange(vocab) + d2t`` (int64
    ``[vocab]``), where the map is an operand a step can follow: an int64
    ``[vocab]`` tensor whose every target id lies in ``[0, targets)``
    (``targets``: the rows of the first Markov factor ``w1`` that the next
    step gathers, or the target vocabulary a step scatters to) and, with
    ``distinct``, no two draft ids share one. Constant for a checkpoint, so
    checked once where a step is built (one host read); TypeError or
    ValueError naming ``d2t``, the first offending draft id and its target."""
    if not isinstance(d2t, torch.Tensor) or d2t.dtype != torch.int64 or tuple(d2t.shape) != (vocab,):
        what = f"{d2t.dtype} {list(d2t.shape)}" if isinstance(d2t, torch.Tensor) else type(d2t).__name__
        raise TypeError(f"d2t must be an int64 [{vocab}] tensor (a draft vocabulary of {vocab}), not {what}")
    target = torch.arange(vocab, device=d2t.device) + d2t
    bad = ((target < 0) | (target >= targets)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"d2t maps draft id {i} to target id {int(target[i])}, outside [0, {targets}) (the rows "
                         f"a step reads or writes); {bad.numel()} draft ids do")
    if distinct and target.unique().numel() != vocab:
        raise ValueError(f"d2t must map the draft ids to distinct target ids; {vocab - target.unique().numel()} "
                         "of them repeat one")
    return target


def map_draft_to_target(ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """``ids + d2t[ids]`` (int64), or ``ids`` without a d2t."""
    return ids if d2t is None else ids + d2t[ids]


def markov_bias(embed: torch.Tensor, w2: torch.Tensor, vocab: int,
                head_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Step 2 as ``LogitsProcessor._apply_head`` computes it for the Markov
    head (unquantized ``markov_w2`` ``[Vpad, r]``): ``F.linear(embed, w2)``
    where the head's dtype is the embedding's (or None); on CUDA with an FP32
    head, ``torch.mm(embed, w2.t(), out_dtype=float32)``; elsewhere both cast
    to the head's dtype first. Then the first ``vocab`` columns."""
    if head_dtype is None or head_dtype == embed.dtype:
        out = F.linear(embed, w2)
    elif head_dtype == torch.float32 and embed.is_cuda:
        out = torch.mm(embed.reshape(-1, embed.shape[-1]), w2.t(), out_dtype=head_dtype)
    else:
        out = F.linear(embed.to(head_dtype), w2.to(head_dtype))
    return out[..., :vocab]


def markov_logits(base: torch.Tensor, bias: torch.Tensor, multiplier: float, soft_cap: float | None) -> torch.Tensor:
    """Steps 3-4 for one step's ``[R, V]`` base logits and bias: FP32 ``y``."""
    return output_transform(add_bias(base, bias), multiplier, soft_cap)


def greedy_step(base: torch.Tensor, bias: torch.Tensor, multiplier: float, soft_cap: float | None,
                d2t: torch.Tensor | None) -> torch.Tensor:
    """Steps 3-5 of one greedy step: the target ids ``t`` (int64 ``[R]``)."""
    return map_draft_to_target(argmax(markov_logits(base, bias, multiplier, soft_cap)), d2t)


def greedy_loop(base: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, multiplier: float,
                soft_cap: float | None, d2t: torch.Tensor | None, head_dtype: torch.dtype | None = None,
                bias_fn=None) -> torch.Tensor:
    """The whole greedy Markov stage: ``base`` ``[R, N, V]``, ``prev`` the
    anchors (``[R]`` ids), ``w1`` ``[V_target, r]``, ``w2`` ``[Vpad, r]``;
    the drafted target ids, int64 ``[R, N]`` (what vLLM writes into
    ``draft_tokens[:R]``). ``bias_fn(e)`` replaces step 2 (default
    ``markov_bias``). ``d2t`` is checked first (``check_d2t`` against
    ``w1``'s rows; without it the vocabulary must not exceed them)."""
    if base.dim() != 3:
        raise ValueError(f"the base logits must be [requests, steps, vocab], not {list(base.shape)}")
    r, n, v = base.shape
    if d2t is not None:
        check_d2t(d2t, v, w1.shape[0])
    elif v > w1.shape[0]:
        raise ValueError(f"without a d2t map the draft ids are target ids: a vocabulary of {v}, more than w1's "
                         f"{w1.shape[0]} rows")
    if bias_fn is None:
        def bias_fn(e):
            return markov_bias(e, w2, v, head_dtype)
    tokens = torch.empty(r, n, dtype=torch.int64, device=base.device)
    for i in range(n):
        e = F.embedding(prev, w1)
        t = greedy_step(base[:, i], bias_fn(e), multiplier, soft_cap, d2t)
        tokens[:, i] = t
        prev = t
    return tokens


__all__ = ["HEAD_DTYPES", "add_bias", "argmax", "check_d2t", "check_head_dtype", "greedy_loop", "greedy_step",
           "map_draft_to_target", "markov_bias", "markov_logits", "output_transform", "tanhf",
           "transform_constants"]
