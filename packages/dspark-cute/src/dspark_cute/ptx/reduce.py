"""The row tree of ``dspark_core.spec.numerics`` and the other fixed-order
folds the kernels share, traced from the primitives beside this module.

A "fragment" is a list of 8 ``Float32``: the 8 consecutive columns one thread
of the reference CTA holds (``cta``; the row tree's step 1).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

from .arith import add_rn, div_rn, f32_const, max_nan, mul_rn, sqrt_rn
from .cta import WARPS
from .memory import ld_shared_f32, st_shared_f32_if_lane0


def fold_halves(values: list) -> Float32:
    """``values`` (a power-of-two count) folded by halves: ``v_k + v_(k+n/2)``
    (each ``add.rn``), repeated down to one value."""
    while len(values) > 1:
        half = len(values) // 2
        values = [add_rn(values[k], values[k + half]) for k in range(half)]
    return values[0]


def fragment_sum(v: list) -> Float32:
    """Row tree step 2: ``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))``."""
    pairs = [add_rn(v[2 * i], v[2 * i + 1]) for i in range(4)]
    return add_rn(add_rn(pairs[0], pairs[1]), add_rn(pairs[2], pairs[3]))


def thread_sum(fragment_sums: list) -> Float32:
    """Row tree step 3: ``((f_0 + f_1) + f_2) + ...`` in order of ``k``."""
    total = fragment_sums[0]
    for f in fragment_sums[1:]:
        total = add_rn(total, f)
    return total


def warp_fold(value) -> Float32:
    """Row tree step 4: the warp butterfly ``s + shfl.bfly(s, o)`` for
    ``o`` = 16, 8, 4, 2, 1; every lane ends with the warp's sum (lane ``l``
    adds ``s_l + s_(l^o)``, bitwise the spec's ``s_l + s_(l+o)``)."""
    s = Float32(value)
    for offset in (16, 8, 4, 2, 1):
        s = add_rn(s, cute.arch.shuffle_sync_bfly(s, offset=offset))
    return s


def warp_max(value) -> Float32:
    """The warp's ``max.NaN`` (butterfly 16, 8, 4, 2, 1), in every lane."""
    v = Float32(value)
    for offset in (16, 8, 4, 2, 1):
        v = max_nan(v, cute.arch.shuffle_sync_bfly(v, offset=offset))
    return v


def cta_fold(warp_sum, sums_addr, warp, lane) -> Float32:
    """Row tree step 5: lane 0 of each warp stores its warp sum at
    ``sums_addr + 4 * warp`` (shared memory, 8 FP32 reserved for this fold
    alone), a CTA barrier, then every thread reads the 8 sums and folds them
    by halves: ``(w0 + w4, w1 + w5, w2 + w6, w3 + w7)``, then 2, then 1."""
    st_shared_f32_if_lane0(lane, Int32(sums_addr) + Int32(warp) * 4, warp_sum)
    cute.arch.barrier()
    return fold_halves([ld_shared_f32(Int32(sums_addr) + 4 * i) for i in range(WARPS)])


def row_sum(fragments: list, sums_addr, warp, lane) -> Float32:
    """The row tree (``dspark_core.spec.numerics.row_sum``) of the squares of one
    thread's ``fragments`` (a list per ``k`` of 8 FP32): each value squared
    (``mul.rn``), steps 2-5; the row's sum of squares, in every thread.
    ``sums_addr``: 8 FP32 of shared memory for this sum alone."""
    sums = [fragment_sum([mul_rn(v, v) for v in f]) for f in fragments]
    return cta_fold(warp_fold(thread_sum(sums)), sums_addr, warp, lane)


def inv_rms(total, n: int, eps: float) -> Float32:
    """``dspark_core.spec.numerics.inv_rms``: ``1 / sqrt(total / n + eps)`` as
    ``div.rn``, ``add.rn``, ``sqrt.rn``, ``div.rn`` (``n`` and ``eps`` FP32
    constants, rounded to nearest even)."""
    var = add_rn(div_rn(total, f32_const(float(n))), f32_const(eps))
    return div_rn(f32_const(1.0), sqrt_rn(var))


__all__ = [
    "cta_fold",
    "fold_halves",
    "fragment_sum",
    "inv_rms",
    "row_sum",
    "thread_sum",
    "warp_fold",
    "warp_max",
]
