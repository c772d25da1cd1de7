"""The head of the elementwise kernels (the MLP activation, the o-gate): which
16-byte vector a thread of a 1-D grid handles."""

from __future__ import annotations

import cutlass
from cutlass import Int32, Uint32


def vector_index(tidx, cta, m, vecs: int, threads: int) -> tuple:
    """The vector a thread of a 1-D grid of ``threads``-thread CTAs handles,
    over ``m`` rows of ``vecs`` vectors each: ``total = m * vecs``, ``v =
    cta * threads + tidx``, ``vc = min(v, total - 1)`` (past the end the
    last vector again, in bounds; its store is to be guarded by ``v <
    total``), ``row = vc // vecs`` (unsigned), ``col = vc - row * vecs``; all
    Int32. Returns ``(v, vc, row, col, total)``."""
    total = Int32(m) * vecs
    v = Int32(cta) * threads + Int32(tidx)
    vc = cutlass.min(v, total - 1)
    # (Unsigned: vc >= 0, so a plain division by the constant, no floor fix-up.)
    row = Int32(Uint32(vc) // vecs)
    col = vc - row * vecs
    return v, vc, row, col, total


__all__ = ["vector_index"]
