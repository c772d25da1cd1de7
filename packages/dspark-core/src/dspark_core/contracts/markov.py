"""The compile-time constants of the fused greedy Markov step
(``dspark_cute.cutedsl.markov``), the kernel that follows the stock bias
GEMM in each of the draft's sequential Markov steps (``spec.markov``).

``markov_constants`` raises ``Unsupported`` with a sentence where the kernel
does not reproduce vLLM's greedy step bit for bit or cannot take the head's
shapes, ``markov_sample_constants`` the same for the probabilistic step and
``markov_rows`` for the requests one step takes; the caller (the plugin's
``sample_sequential`` hook at build, ``python -m dspark_vllm.plan``) keeps
vLLM's loop and reports it. These are the kernels' only limits: dspark-cute's
``MarkovStep`` and ``MarkovSampleStep`` call the same functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_core import checks
from dspark_core.contracts.constants import _Key
from dspark_core.contracts.limits import MARKOV_MAX_RANK, MARKOV_MAX_ROWS, MARKOV_THREADS, MARKOV_VEC, check
from dspark_core.errors import Unsupported
from dspark_core.spec.markov import transform_constants
from dspark_core.switches import flag

# Columns per CTA: 256 threads of one 16-byte BF16 vector (the thread and
# vector counts, the rank and the rows the steps take: ``contracts.limits``).
MARKOV_TILE = MARKOV_THREADS * MARKOV_VEC


def _transform(c) -> None:
    """Check the multiplier and soft cap of hand-built constants as
    ``markov_constants`` does (``spec.markov.transform_constants``: a number
    finite and nonzero in FP32, a positive cap with a finite FP32
    reciprocal, or None), and keep them rounded to FP32 (the values the
    kernel compiles in); TypeError or ValueError naming the field."""
    name = type(c).__name__
    try:
        m, cap, _ = transform_constants(c.multiplier, c.soft_cap)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None
    object.__setattr__(c, "multiplier", m)
    object.__setattr__(c, "soft_cap", cap)


@dataclass(frozen=True, eq=False)
class MarkovConstants(_Key):
    """One greedy Markov step's kernel: BF16 base logits and bias of
    ``vocab`` columns, the Markov embedding of ``rank`` BF16 columns, the
    output transform's FP32 multiplier and soft cap (or None) as
    ``spec.markov.transform_constants`` gives them, and whether a d2t map
    applies (``d2t``)."""

    vocab: int
    rank: int
    multiplier: float
    soft_cap: float | None
    d2t: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        _transform(self)

    @property
    def ctas(self) -> int:
        """CTAs per row: one per ``MARKOV_TILE`` columns."""
        return -(-self.vocab // MARKOV_TILE)


def markov_constants(vocab: int, rank: int, multiplier: float, soft_cap: float | None, d2t: bool,
                     head_dtype: torch.dtype = torch.bfloat16) -> MarkovConstants:
    """The kernel's constants for a draft head, or Unsupported: the head's
    dtype must be BF16 (the base logits and the bias), and the constants
    within the kernel's limits (``contracts.limits``: ``vocab`` and ``rank``
    positive multiples of 8, ``vocab`` below 2^31, ``rank`` at most
    ``MARKOV_MAX_RANK``). ValueError for the multiplier or soft cap
    ``spec.markov.transform_constants`` refuses (not finite in FP32, ...),
    TypeError for one that is no number (a bool, a string) and for a
    non-int size."""
    if head_dtype != torch.bfloat16:
        raise Unsupported(f"the fused Markov step takes a bfloat16 head, not {head_dtype}")
    m, c, _ = transform_constants(multiplier, soft_cap)
    return check(MarkovConstants(vocab=vocab, rank=rank, multiplier=m, soft_cap=c, d2t=flag(d2t, "d2t")))


def markov_rows(rows, what: str = "max_rows") -> int:
    """``rows``, the most requests one fused step is built for (the host
    classes' ``max_rows``; vLLM's ``max_num_seqs``), if the steps take it: an
    int (not a bool) from 1 to ``MARKOV_MAX_ROWS`` (a CUDA grid's y extent,
    one row of CTAs a request; a numpy integer is taken as the int).
    TypeError for a non-int (``checks.integer``), Unsupported for one out of
    that range; both name ``what``."""
    rows = checks.integer(what, rows)
    if not 1 <= rows <= MARKOV_MAX_ROWS:
        raise Unsupported(f"the fused Markov step takes 1 to {MARKOV_MAX_ROWS} requests a step (a CUDA grid's y): "
                          f"{what} of {rows}")
    return rows


@dataclass(frozen=True, eq=False)
class MarkovSampleConstants(_Key):
    """One probabilistic Markov step's kernel (``spec.gumbel.
    probabilistic_step`` after steps 1-4 of ``spec.markov``): the greedy
    step's head facts plus the target vocabulary ``target_vocab`` it samples
    over (the logits cache's columns). A d2t map always applies."""

    vocab: int
    target_vocab: int
    rank: int
    multiplier: float
    soft_cap: float | None

    # The greedy step's finish reads these: no map after the sample (its columns are target ids).
    d2t = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _transform(self)

    @property
    def ctas(self) -> int:
        """CTAs per row: one per ``MARKOV_TILE`` target columns."""
        return -(-self.target_vocab // MARKOV_TILE)


def markov_sample_constants(vocab: int, target_vocab: int, rank: int, multiplier: float, soft_cap: float | None,
                            head_dtype: torch.dtype = torch.bfloat16) -> MarkovSampleConstants:
    """The probabilistic step's constants, or Unsupported (``markov_constants``'
    refusals and the step's limits, ``contracts.limits``: a target vocabulary
    that is a positive multiple of 8 below 2^31 and no smaller than the draft
    vocabulary, each draft id scattering to a distinct target id)."""
    c = markov_constants(vocab, rank, multiplier, soft_cap, True, head_dtype)
    return check(MarkovSampleConstants(vocab=vocab, target_vocab=target_vocab, rank=rank,
                                       multiplier=c.multiplier, soft_cap=c.soft_cap))


__all__ = ["MARKOV_MAX_RANK", "MARKOV_MAX_ROWS", "MARKOV_THREADS", "MARKOV_TILE", "MARKOV_VEC", "MarkovConstants",
           "MarkovSampleConstants", "markov_constants", "markov_rows", "markov_sample_constants"]
