"""The traced RMSNorm pieces the norm kernels share (the row norm, the
boundary, the context norms, and dspark-comm's all-reduce boundary), in the
layout of the stock norm's CTA (``ptx.cta``, ``dspark_core.spec.numerics``):
thread ``t`` holds fragment ``k`` = the 8 columns ``t * 8 + k * 2048 .. + 7``.
Each norm sums its squares with the stock tree of its constants' ``arch``
(sm_90a or sm_100a, chosen when the kernel is traced).

- ``fragment_columns(tidx, h)``: the first column of each of its fragments;
- ``load_weight_words(dtype, base, column)``: a weight fragment's raw words;
- ``gains(norm, words)``: ``g = w + gain_center`` per column, FP32;
- ``rms_norm_fragments(norm, h, x, words, sums, warp, lane)``: the RMSNorm
  of one thread's fragments (weight before or after the norm, or none; the
  tree of ``norm.arch``);
- ``gate_words``, ``stream_products`` and ``gated_residual(_of)``: the
  residual boundary's gates and its FP32 ``alpha * stream + beta *
  post(branch)`` (``alpha * stream`` computable before the post-norm).
"""

from __future__ import annotations

from cutlass import Int64

from dspark_core.contracts.constants import BoundaryConstants, NormConstants
from dspark_core.errors import Unsupported
from dspark_core.spec.numerics import ARCHS
from dspark_cute import ptx
from dspark_cute.runtime.host import ELEMENT_BYTES


def check_arch(norm: NormConstants) -> None:
    """Unsupported unless a stock row tree is known for ``norm.arch``."""
    if norm.arch not in ARCHS:
        raise Unsupported(f"no stock norm tree is known for {norm.arch!r} (only {', '.join(ARCHS)})")


def fragment_columns(tidx, h: int) -> list:
    """The first column of each of thread ``tidx``'s fragments: ``t * 8 + k *
    2048`` for ``k < h / 2048`` (Int64)."""
    return [Int64(tidx) * ptx.VEC + k * ptx.CHUNK for k in range(h // ptx.CHUNK)]


def load_weight_words(dtype: str, base, column) -> list:
    """The raw 32-bit words of the 8 weight values from ``column`` of a
    ``dtype`` weight at byte address ``base``: 4 words (BF16/FP16 pairs) or 8
    (FP32). Kept packed until ``gains`` widens them (fewer live registers)."""
    addr = Int64(base) + Int64(column) * ELEMENT_BYTES[dtype]
    words = ptx.ld_global_v4(addr)
    if dtype == "fp32":
        words = words + ptx.ld_global_v4(addr + 16)
    return words


def gains(norm: NormConstants, words: list) -> list:
    """The 8 gains ``g = w + gain_center`` of a weight fragment's raw words:
    ``w`` widened to FP32 exactly, then one ``add.rn`` (always performed, so
    a -0.0 weight with a 0.0 center gives +0.0 as the spec does)."""
    dtype = norm.weight_dtype
    if dtype == "fp32":
        w = [ptx.as_f32(word) for word in words]
    else:
        unpack = ptx.bf16x2_to_f32 if dtype == "bf16" else ptx.f16x2_to_f32
        w = []
        for word in words:
            w.extend(unpack(word))
    center = ptx.f32_const(norm.gain_center)
    return [ptx.add_rn(v, center) for v in w]


def rms_norm_fragments(
    norm: NormConstants, h: int, x: list, weight_words: list | None, sums_addr, warp, lane,
) -> list:
    """``dspark_core.spec.layers.RMSNorm.forward`` over one thread's fragments
    ``x`` (lists of 8 FP32, the row widened exactly), before the output
    rounding, with the tree of ``norm.arch``. With ``g = gains(weight_words[k])``:

    - weight before the norm: ``v = g * x``; ``s = row_sum_of_squares(v)``
      (the input-scaled leaves on sm_100a); ``r = row_inv_rms(s, h, eps)``;
      ``y = r * v``;
    - otherwise ``s = row_sum_of_squares(x)``, ``y = r * x``, then ``y = g *
      y`` with a weight;

    each product ``mul.rn``; ``row_inv_rms`` is ``rsqrt.approx.ftz(fma.rn(s,
    1/h, eps))``. ``sums_addr``: 8 FP32 of shared memory reserved for this
    norm's cross-warp fold. Returns the ``y`` fragments (FP32)."""
    check_arch(norm)
    has_weight = norm.weight_dtype is not None
    scaled = has_weight and norm.weight_before_norm
    if scaled:
        x = [
            [ptx.mul_rn(g, v) for v, g in zip(f, gains(norm, words))]
            for f, words in zip(x, weight_words)
        ]
    total = ptx.row_sum_of_squares(x, norm.arch, scaled, sums_addr, warp, lane)
    r = ptx.row_inv_rms(total, h, norm.eps)
    y = [[ptx.mul_rn(r, v) for v in f] for f in x]
    if has_weight and not scaled:
        y = [
            [ptx.mul_rn(g, v) for v, g in zip(f, gains(norm, words))]
            for f, words in zip(y, weight_words)
        ]
    return y


def gate_words(c: BoundaryConstants, alpha, beta, post_w, pre_w, column) -> tuple:
    """The raw words of the fragment at ``column``: alpha's, beta's (8 FP32
    each), then the post-norm's and the pre-norm's weights (None where a
    norm has no weight), loaded in that order (``load_weight_words``)."""

    def weight(norm: NormConstants, base):
        if norm.weight_dtype is None:
            return None
        return load_weight_words(norm.weight_dtype, base, column)

    return (
        load_weight_words("fp32", alpha, column),
        load_weight_words("fp32", beta, column),
        weight(c.post, post_w),
        weight(c.pre, pre_w),
    )


def stream_products(a_words: list, s: list) -> list:
    """Step 2's first products for one fragment: ``RN(alpha * stream)`` per
    column (``alpha`` from its raw words, ``s`` the stream widened), which
    need no norm: the boundaries compute them as soon as both are loaded."""
    return [ptx.mul_rn(ptx.as_f32(a), sv) for a, sv in zip(a_words, s)]


def gated_residual_of(y: list, a_s: list, b_words: list, new_row, column, store: bool) -> list:
    """Step 2 for the fragment at ``column`` from its ``stream_products``
    ``a_s``, and step 3's input: ``p`` = the post-norm's ``y`` (8 FP32)
    rounded to BF16; ``new = a_s + beta * p`` per column (``beta`` from its
    raw words ``b_words``; the product ``mul.rn``, then the ``add.rn``),
    stored as FP32 into the row at byte address ``new_row`` when ``store``;
    returns ``new`` rounded to BF16 (the pre-norm's input)."""
    p = ptx.round_bf16(y)
    new = [ptx.add_rn(av, ptx.mul_rn(ptx.as_f32(b), pv)) for av, b, pv in zip(a_s, b_words, p)]
    if store:
        ptx.st_row8("fp32", new_row, column, new)
    return ptx.round_bf16(new)


def gated_residual(y: list, s: list, a_words: list, b_words: list, new_row, column, store: bool) -> list:
    """``gated_residual_of`` with the stream products taken here: ``new =
    alpha * s + beta * p`` (the two products ``mul.rn``, then their
    ``add.rn``)."""
    return gated_residual_of(y, stream_products(a_words, s), b_words, new_row, column, store)


__all__ = ["check_arch", "fragment_columns", "gains", "gate_words", "gated_residual",
           "gated_residual_of", "load_weight_words", "rms_norm_fragments", "stream_products"]
