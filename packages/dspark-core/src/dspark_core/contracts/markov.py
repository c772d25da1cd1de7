"""The compile-time constants of the fused greedy Markov step
(``dspark_cute.cutedsl.markov``), the kernel that follows the stock bias
GEMM in each of the draft's sequential Markov steps (``spec.markov``).

``markov_constants`` raises ``Unsupported`` with a sentence where the kernel
does not reproduce vLLM's greedy step bit for bit or cannot take the head's
shapes; the caller (the plugin's ``sample_sequential`` hook, the planner)
keeps vLLM's loop and reports it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark_core.contracts.constants import _Key
from dspark_core.errors import Unsupported
from dspark_core.spec.markov import transform_constants

# Columns per CTA: 256 threads of one 16-byte BF16 vector.
MARKOV_THREADS = 256
MARKOV_VEC = 8
MARKOV_TILE = MARKOV_THREADS * MARKOV_VEC
# vLLM captures up to 512 requests; the kernel takes as many rows as a grid's y.
MARKOV_MAX_ROWS = 65535


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

    @property
    def ctas(self) -> int:
        """CTAs per row: one per ``MARKOV_TILE`` columns."""
        return -(-self.vocab // MARKOV_TILE)


def markov_constants(vocab: int, rank: int, multiplier: float, soft_cap: float | None, d2t: bool,
                     head_dtype: torch.dtype = torch.bfloat16) -> MarkovConstants:
    """The kernel's constants for a draft head, or Unsupported: the head's
    dtype must be BF16 (the base logits and the bias), ``vocab`` and ``rank``
    positive multiples of 8 (16-byte vectors), ``vocab`` below 2^31."""
    if head_dtype != torch.bfloat16:
        raise Unsupported(f"the fused Markov step takes a bfloat16 head, not {head_dtype}")
    for name, n in (("draft vocabulary", vocab), ("Markov rank", rank)):
        if not isinstance(n, int) or n < MARKOV_VEC or n % MARKOV_VEC:
            raise Unsupported(f"the fused Markov step takes a {name} that is a positive multiple of {MARKOV_VEC}, "
                              f"not {n}")
    if vocab >= 2**31:
        raise Unsupported(f"the fused Markov step takes a draft vocabulary below 2^31, not {vocab}")
    if not isinstance(multiplier, float) or not math.isfinite(multiplier):
        raise ValueError(f"the output multiplier must be a finite float, not {multiplier!r}")
    m, c, _ = transform_constants(multiplier, soft_cap)
    return MarkovConstants(vocab=vocab, rank=rank, multiplier=m, soft_cap=c, d2t=bool(d2t))


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

    @property
    def ctas(self) -> int:
        """CTAs per row: one per ``MARKOV_TILE`` target columns."""
        return -(-self.target_vocab // MARKOV_TILE)


def markov_sample_constants(vocab: int, target_vocab: int, rank: int, multiplier: float, soft_cap: float | None,
                            head_dtype: torch.dtype = torch.bfloat16) -> MarkovSampleConstants:
    """The probabilistic step's constants, or Unsupported (``markov_constants``'
    refusals, and a target vocabulary that is a multiple of 8 below 2^31)."""
    c = markov_constants(vocab, rank, multiplier, soft_cap, True, head_dtype)
    if not isinstance(target_vocab, int) or target_vocab < MARKOV_VEC or target_vocab % MARKOV_VEC \
            or target_vocab >= 2**31:
        raise Unsupported(f"the fused Markov step takes a target vocabulary that is a positive multiple of "
                          f"{MARKOV_VEC} below 2^31, not {target_vocab}")
    return MarkovSampleConstants(vocab=vocab, target_vocab=target_vocab, rank=rank, multiplier=c.multiplier,
                                 soft_cap=c.soft_cap)


__all__ = ["MARKOV_MAX_ROWS", "MARKOV_THREADS", "MARKOV_TILE", "MARKOV_VEC", "MarkovConstants",
           "MarkovSampleConstants", "markov_constants", "markov_sample_constants"]
