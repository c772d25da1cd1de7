"""The summation order of cuBLAS's BF16 projections on the draft's shapes, as
a model with two integers: ``SplitOrder(tile, splits)``.

What vLLM runs for every projection of the draft (``F.linear`` of a BF16
activation ``x[m, K]`` and weight ``W[N, K]``, no bias; cuBLAS through torch)
computes, for the skinny row counts a decode step has, each output
``y[r, n] = sum_k x[r, k] W[n, k]`` as:

1. ``K`` cut into ``K / tile`` tiles of ``tile`` columns, the tiles dealt to
   ``splits`` contiguous K-splits in order, the first ``(K / tile) mod
   splits`` splits one tile longer than the rest (``SplitOrder.bounds``);
2. per split, one FP32 accumulator from +0.0, the tensor-core MMA of each
   16-column step of the split (``mma`` with K = 16: its 16 products and the
   accumulator summed in the hardware's fixed way, which ``mma.sync`` and
   ``wgmma`` share on sm_90) chained over the split's columns in increasing
   order;
3. the splits' FP32 partials added in split order with ``add.rn.f32``
   (``p_0 + p_1``, then ``+ p_2``, ...; nothing is added to ``p_0`` first);
4. one rounding of that sum to BF16 (``cvt.rn.bf16.f32``).

``splits = 1`` is the non-split GEMM (step 3 empty). The model holds per
(shape, row count, cuBLAS build): cuBLAS picks its kernel and split by
heuristics, so ``(tile, splits)`` is found against the live library at build
(``dspark_core.runtime.gemm_check``), never assumed; ``docs/gemm-order.md``
has what was measured and the commands. This module states the model and its
candidates; no CPU reproduces step 2's MMA (its inner additions are the
hardware's), so the CPU tests pin the bounds and the search, and the GPU
tests the bits.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from dspark_core.checks import integer

# The MMA's K: the columns one tensor-core step sums.
MMA_K = 16
# The tile widths the search tries (cuBLAS's K tiles on sm_90: 64 and 128
# measured; 256 for completeness) and the most splits it tries.
TILES = (64, 128, 256)
MAX_SPLITS = 64
# What candidate_orders takes: K up to 2^24 columns, up to 1024 splits.
MAX_K = 1 << 24
MAX_SEARCH_SPLITS = 1024


def _positive_int(value, name: str) -> int:
    """``checks.integer`` of a positive count (a numpy integer is taken as its int)."""
    return integer(name, value, 1)


@dataclass(frozen=True, order=True)
class SplitOrder:
    """``splits`` contiguous K-splits of ``tile``-column tiles, the first
    ``(K / tile) mod splits`` one tile longer (module docstring)."""

    tile: int
    splits: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile", _positive_int(self.tile, "a split order's tile"))
        object.__setattr__(self, "splits", _positive_int(self.splits, "a split order's splits (its split count)"))
        if self.tile % MMA_K:
            raise ValueError(f"a split order's tile is a multiple of {MMA_K} columns, not {self.tile}")

    def problem(self, k) -> str | None:
        """Why this order does not apply to ``K = k`` columns (a sentence), or None."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            return f"K (k) must be a positive int, not {k!r}"
        k = int(k)
        if k % self.tile:
            return f"K = {k} is no multiple of the {self.tile}-column tile"
        if k // self.tile < self.splits:
            return f"K = {k} has {k // self.tile} tiles of {self.tile} columns, fewer than {self.splits} splits"
        return None

    def bounds(self, k: int) -> tuple[tuple[int, int], ...]:
        """The splits' column ranges ``(start, stop)`` in order; ValueError
        where the order does not apply to ``k`` (``problem``)."""
        why = self.problem(k)
        if why is not None:
            raise ValueError(why)
        tiles = k // self.tile
        q, r = divmod(tiles, self.splits)
        out, start = [], 0
        for s in range(self.splits):
            stop = start + (q + (1 if s < r else 0)) * self.tile
            out.append((start, stop))
            start = stop
        return tuple(out)

    def describe(self) -> str:
        if self.splits == 1:
            return "one K-split (no split-K reduce)"
        return f"{self.splits} K-splits of {self.tile}-column tiles"


def candidate_orders(k: int, tiles: tuple[int, ...] = TILES, max_splits: int = MAX_SPLITS,
                     first: SplitOrder | None = None) -> list[SplitOrder]:
    """Every ``SplitOrder`` of ``tiles`` and 1 to ``max_splits`` splits that
    applies to ``k``, one per distinct ``bounds`` (the smallest tile kept),
    ``first`` (where it applies) leading, then by split count, then tile.
    ``k`` from 1 to ``MAX_K``, ``max_splits`` from 1 to ``MAX_SEARCH_SPLITS``
    (ValueError beyond, TypeError for a non-integer)."""
    k = integer("K (k)", k, 1, MAX_K)
    max_splits = integer("the most splits (max_splits)", max_splits, 1, MAX_SEARCH_SPLITS)
    seen: dict[tuple, SplitOrder] = {}
    # No order of more splits than the narrowest tile gives K applies.
    for splits in range(1, min(max_splits, k // min(tiles)) + 1):
        for tile in sorted(tiles):
            order = SplitOrder(tile, splits)
            if order.problem(k) is None:
                seen.setdefault(order.bounds(k), order)
    orders = list(seen.values())
    if first is not None and first.problem(k) is None:
        lead = seen.get(first.bounds(k))
        if lead is not None:
            orders.remove(lead)
            orders.insert(0, lead)
    return orders


def model_sum(x, weight, order: SplitOrder, mma=None):
    """The order's steps 1-4 in torch on any device, with ``mma(acc, x16,
    w16)`` for step 2's 16-column step (FP32 ``acc [m, N]``, BF16 ``x16
    [m, 16]`` and ``w16 [N, 16]``; default: the products summed in FP64 and
    added to ``acc`` with one FP32 rounding, a stand-in for the hardware's
    MMA, exact where every partial sum is representable). BF16 ``[m, N]``.
    The CPU tests use it where the values make the stand-in exact (small
    integers), so the split bounds, the chain and the reduce are checked
    without a GPU."""
    import torch

    k = x.shape[1]
    if mma is None:
        def mma(acc, xs, ws):
            return (acc.double() + xs.double() @ ws.double().t()).float()
    total = None
    for start, stop in order.bounds(k):
        acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        for c in range(start, stop, MMA_K):
            acc = mma(acc, x[:, c:c + MMA_K], weight[:, c:c + MMA_K])
        total = acc if total is None else total + acc
    return total.to(torch.bfloat16)


__all__ = ["MAX_SPLITS", "MMA_K", "SplitOrder", "TILES", "candidate_orders", "model_sum"]
