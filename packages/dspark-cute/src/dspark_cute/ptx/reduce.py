"""The stock row norm's tree (``dspark_core.spec.numerics.row_sum_of_squares``,
per architecture) and the other fixed-order folds the kernels share, traced
from the primitives beside this module.

A "fragment" is a list of 8 ``Float32``: the 8 consecutive columns one thread
of the reference CTA holds (``cta``): fragment ``r`` of thread ``t`` holds
columns ``8t + 2048r .. + 7``, the spec's thread elements ``e_(8r) ..
e_(8r+7)``.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

from .arith import add_rn, f32_const, max_nan, mul_rn
from .cta import WARPS
from .memory import ld_shared_f32, st_shared_f32_if_lane0
from .stock import fma_rn, pairwise, rsqrt_approx_ftz


def fold_halves(values: list) -> Float32:
    """``values`` (a power-of-two count) folded by halves: ``v_k + v_(k+n/2)``
    (each ``add.rn``), repeated down to one value."""
    while len(values) > 1:
        half = len(values) // 2
        values = [add_rn(values[k], values[k + half]) for k in range(half)]
    return values[0]


def fragment_sum(v: list) -> Float32:
    """``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`` (the GEMV's
    fragment sum; ``stock.pairwise`` of 8)."""
    pairs = [add_rn(v[2 * i], v[2 * i + 1]) for i in range(4)]
    return add_rn(add_rn(pairs[0], pairs[1]), add_rn(pairs[2], pairs[3]))


def warp_fold(value) -> Float32:
    """The warp butterfly ``s + shfl.bfly(s, o)`` for ``o`` = 16, 8, 4, 2, 1;
    every lane ends with the warp's sum (lane ``l`` adds ``s_l + s_(l^o)``,
    bitwise the spec's ``fold_halves``)."""
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
    """The CTA step of the row tree: lane 0 of each warp stores its warp sum
    at ``sums_addr + 4 * warp`` (shared memory, 8 FP32 reserved for this fold
    alone), a CTA barrier, then every thread reads the 8 sums and folds them
    by halves, ``((W0 + W4) + (W2 + W6)) + ((W1 + W5) + (W3 + W7))`` (the
    stock's butterfly 4, 2, 1 over the warp sums, bit for bit)."""
    st_shared_f32_if_lane0(lane, Int32(sums_addr) + Int32(warp) * 4, warp_sum)
    cute.arch.barrier()
    return fold_halves([ld_shared_f32(Int32(sums_addr) + 4 * i) for i in range(WARPS)])


# -- the stock row norm's tree (dspark_core.spec.numerics.row_sum_of_squares) ------


def chunk_partials(e: list, arch: str, input_scaled: bool = False) -> tuple:
    """One chunk's part of ``spec.numerics.thread_sum_of_squares``: ``e`` the
    8 FP32 of fragment ``r`` (the thread's elements ``e_(8r) .. e_(8r+7)``).

    - sm_90a: ``(c,)``, ``c = (p0 + p1) + (p2 + p3)``, ``p_k = fma(e_2k,
      e_2k, e_(2k+1) * e_(2k+1))`` (the product rounded);
    - sm_100a: ``(even, odd)``: every square rounded, ``even = (q0 + q2) +
      (q4 + q6)``, ``odd = (q1 + q3) + (q5 + q7)``; input-scaled: ``even =
      fma(e0, e0, e2 * e2) + fma(e4, e4, e6 * e6)``, ``odd = fma(e1, e1, e3
      * e3) + fma(e5, e5, e7 * e7)``.

    The thread's sum is ``pairwise`` over its chunks of these (per parity
    on sm_100a, then ``even + odd``): ``thread_sum_of_squares``."""
    if arch == "sm_90a":
        return (pairwise([fma_rn(e[2 * k], e[2 * k], mul_rn(e[2 * k + 1], e[2 * k + 1])) for k in range(4)]),)
    if arch != "sm_100a":
        raise ValueError(f"no stock row tree is known for {arch!r} (sm_90a, sm_100a)")
    if input_scaled:
        leaf = [fma_rn(e[i], e[i], mul_rn(e[i + 2], e[i + 2])) for i in (0, 1, 4, 5)]
        return add_rn(leaf[0], leaf[2]), add_rn(leaf[1], leaf[3])
    q = [mul_rn(v, v) for v in e]
    return pairwise(q[0::2]), pairwise(q[1::2])


def thread_sum_of_squares(fragments: list, arch: str, input_scaled: bool = False) -> Float32:
    """``spec.numerics.thread_sum_of_squares`` of one thread's ``fragments``
    (a list per chunk ``r`` of 8 FP32): ``chunk_partials`` of each, summed
    pairwise over the chunks (sm_100a: per parity, then ``even + odd``)."""
    parts = [chunk_partials(f, arch, input_scaled) for f in fragments]
    if arch == "sm_90a":
        return pairwise([p[0] for p in parts])
    return add_rn(pairwise([p[0] for p in parts]), pairwise([p[1] for p in parts]))


def row_sum_of_squares(fragments: list, arch: str, input_scaled: bool, sums_addr, warp, lane) -> Float32:
    """``spec.numerics.row_sum_of_squares`` on ``arch``: the thread sum of
    ``fragments``, the warp butterfly (``warp_fold``), the CTA fold of the 8
    warp sums (``cta_fold``); the row's sum in every thread. ``sums_addr``:
    8 FP32 of shared memory for this sum alone."""
    return cta_fold(warp_fold(thread_sum_of_squares(fragments, arch, input_scaled)), sums_addr, warp, lane)


def row_inv_rms(total, n: int, eps: float) -> Float32:
    """``spec.numerics.inv_rms``: ``rsqrt.approx.ftz.f32(fma.rn.f32(total,
    f32(1/n), f32(eps)))`` (``n`` and ``eps`` FP32 constants, rounded to
    nearest even)."""
    return rsqrt_approx_ftz(fma_rn(total, f32_const(1.0 / n), f32_const(eps)))


__all__ = [
    "chunk_partials",
    "cta_fold",
    "fold_halves",
    "fragment_sum",
    "row_inv_rms",
    "row_sum_of_squares",
    "thread_sum_of_squares",
    "warp_fold",
    "warp_max",
]
