"""Traced pieces of a 64-wide head for the head kernels: the stock fused
QK-norm (``dspark_core.spec.layers.qk_norm_rope``) in the stock's lane
layout, its RoPE, the RoPE table's cos and sin, and the paged cache's row
address.

The stock fused QK-norm of one head ``e_0 .. e_63`` (BF16 widened to FP32):
stock lane ``l`` of 8 sums its elements ``8l .. 8l+7`` as the chain
``L_l = fma(e_(8l+7), e_(8l+7), ... fma(e_8l, e_8l, +0.0))``; the eight
``L_l`` fold by halves (``(L_0 + L_4) + (L_2 + L_6)`` plus ``(L_1 + L_5) +
(L_3 + L_7)``, each ``add.rn``); ``r = rsqrt.approx.f32(fma(S, 1/64,
eps))`` (CUDA's ``rsqrtf``, subnormals kept); ``n_i = e_i * r``
(``mul.rn``). ``qk_norm_lane8`` computes it in the stock's own layout, lane
``l`` of an 8-lane group (lanes ``8g .. 8g+7`` of a warp) holding ``e_8l ..
e_8l+7``; the fold is the butterfly xor 4, 2, 1 inside the group.

RoPE (``rope_fma``): the pair ``(x, y)`` of the FP32 ``n`` with ``c, s``
turns into ``x' = fma(c, x, -(s * y))``, ``y' = fma(s, x, c * y)``, each
product ``mul.rn`` (the stock CUDA rotary kernels' form).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dspark_core.contracts.constants import HEAD_DIM
from dspark_cute import ptx
from dspark_cute.ptx.inline import asm, i64, words

# Elements per stock lane, stock lanes per head, GPT-J pairs per stock lane.
LANE_ELEMS = 8
LANES = HEAD_DIM // LANE_ELEMS
LANE_PAIRS = LANE_ELEMS // 2


@dsl_user_op
def ld_global_v2(addr, *, loc=None, ip=None) -> list:
    """Two 32-bit words from the 8-byte aligned global byte address ``addr``
    (one ``ld.global.v2.b32``), kept in program order."""
    pair = asm(llvm.StructType.get_literal([T.i32()] * 2), [i64(addr, loc, ip)], "ld.global.v2.b32 {$0, $1}, [$2];",
               "=r,=r,l", True, loc, ip)
    return words(pair, 2, loc, ip)


# ---------------------------------------------------------------- the stock fused QK-norm


def square_chain(values: list) -> Float32:
    """``fma(v_n, v_n, ... fma(v_1, v_1, fma(v_0, v_0, +0.0)))`` for the FP32
    ``values`` ``v_0 .. v_n`` in order: one stock lane's sum (``fma.rn``)."""
    total = Float32(0.0)
    for v in values:
        total = ptx.fma_rn(v, v, total)
    return total


def qk_rsqrt(total, eps) -> Float32:
    """``rsqrt.approx.f32(fma(total, 1/64, eps))``; ``eps`` a Python number
    (its nearest FP32 taken) or a traced ``Float32``."""
    if isinstance(eps, (int, float)):
        eps = ptx.f32_const(float(eps))
    return ptx.rsqrt_approx(ptx.fma_rn(total, ptx.f32_const(1.0 / HEAD_DIM), eps))


@cute.jit
def head_eps(q_eps: cutlass.Constexpr, k_eps: cutlass.Constexpr, head: Int32, q_heads: cutlass.Constexpr) -> Float32:
    """The QK-norm's eps of ``head`` (uniform across the caller's threads):
    ``q_eps`` for the ``q_heads`` q heads (head index below ``q_heads``),
    ``k_eps`` for the k heads; one constant where the two are equal."""
    if cutlass.const_expr(q_eps == k_eps):
        eps = ptx.f32_const(q_eps)
    else:
        eps = ptx.f32_const(k_eps)
        if head < q_heads:
            eps = ptx.f32_const(q_eps)
    return eps


def qk_norm_lane8(values: list, eps) -> list:
    """The stock QK-norm (module docstring) of the head this thread's 8-lane
    group holds, ``values`` the 8 FP32 ``e_8l .. e_8l+7`` of stock lane ``l
    = lane % 8``: the 8 normalized FP32 ``n_8l .. n_8l+7``. Every lane of the
    warp must call it (the group's butterfly). ``eps``: as ``qk_rsqrt``."""
    total = square_chain(values)
    for offset in (4, 2, 1):
        total = ptx.add_rn(total, cute.arch.shuffle_sync_bfly(total, offset=offset))
    r = qk_rsqrt(total, eps)
    return [ptx.mul_rn(v, r) for v in values]


def rope_fma(x, y, c, s) -> tuple:
    """GPT-J RoPE of the FP32 pair ``(x, y)`` by ``c``, ``s`` as the stock
    rotary kernels compute it: ``(fma(c, x, -(s * y)), fma(s, x, c * y))``,
    each product rounded (``mul.rn``), its negation exact."""
    return (
        ptx.fma_rn(c, x, ptx.neg_f32(ptx.mul_rn(s, y))),
        ptx.fma_rn(s, x, ptx.mul_rn(c, y)),
    )


def load_cos_sin_quad(table_dtype: str, table, position, lane) -> tuple:
    """``(cos, sin)``: lists of the 4 FP32 of pairs ``4 lane .. 4 lane + 3`` at
    ``position`` (Int64, inside the table) of the ``[P, 64]`` table at byte
    address ``table`` (16-byte aligned): columns ``4 lane + i`` and ``32 + 4
    lane + i``, widened exactly (one 16-byte load each for FP32, one 8-byte
    load each for BF16)."""
    if table_dtype == "fp32":
        at = Int64(table) + Int64(position) * (4 * HEAD_DIM) + Int64(lane) * (4 * LANE_PAIRS)
        return ([ptx.as_f32(w) for w in ptx.ld_global_v4(at)],
                [ptx.as_f32(w) for w in ptx.ld_global_v4(at + 2 * HEAD_DIM)])
    at = Int64(table) + Int64(position) * (2 * HEAD_DIM) + Int64(lane) * (2 * LANE_PAIRS)
    return ([v for w in ld_global_v2(at) for v in ptx.bf16x2_to_f32(w)],
            [v for w in ld_global_v2(at + HEAD_DIM) for v in ptx.bf16x2_to_f32(w)])


def strided_row_address(cache, block, page, kv_head, block_stride, token_stride, head_stride):
    """The byte address (Int64) of the cache row of block ``block``, token
    ``page`` of the block and KV head ``kv_head`` in a cache at byte address
    ``cache`` with these byte strides (``dspark_cute.runtime.kv_cache``):
    ``cache + block * block_stride + page * token_stride + kv_head *
    head_stride``, in 64-bit arithmetic; its K half is the first 128 bytes,
    its V half the next 128."""
    return (Int64(cache) + Int64(block) * Int64(block_stride) + Int64(page) * Int64(token_stride)
            + Int64(kv_head) * Int64(head_stride))


__all__ = [
    "LANES",
    "LANE_ELEMS",
    "LANE_PAIRS",
    "ld_global_v2",
    "load_cos_sin_quad",
    "qk_norm_lane8",
    "qk_rsqrt",
    "rope_fma",
    "square_chain",
    "strided_row_address",
]
