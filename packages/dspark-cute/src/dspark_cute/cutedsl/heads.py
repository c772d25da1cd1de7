"""Traced pieces of a 64-wide head shared by the head kernels: the stock fused
QK-norm (``dspark_core.spec.layers.qk_norm_rope``) in two lane layouts, its
RoPE, the RoPE table's cos and sin, and the paged cache's row addresses.

The stock fused QK-norm of one head ``e_0 .. e_63`` (BF16 widened to FP32):
stock lane ``l`` of 8 sums its elements ``8l .. 8l+7`` as the chain
``L_l = fma(e_(8l+7), e_(8l+7), ... fma(e_8l, e_8l, +0.0))``; the eight
``L_l`` fold by halves (``(L_0 + L_4) + (L_2 + L_6)`` plus ``(L_1 + L_5) +
(L_3 + L_7)``, each ``add.rn``); ``r = rsqrt.approx.f32(fma(S, 1/64,
eps))`` (CUDA's ``rsqrtf``, subnormals kept); ``n_i = e_i * r``
(``mul.rn``). Two layouts compute it:

- ``qk_norm_lane8``: the stock's own, lane ``l`` of an 8-lane group (lanes
  ``8g .. 8g+7`` of a warp) holding ``e_8l .. e_8l+7``; the fold is the
  butterfly xor 4, 2, 1 inside the group;
- ``qk_norm_pair``: a warp per head, lane ``j`` holding the GPT-J pair
  ``(e_2j, e_2j+1)`` as a packed BF16 word: stock lane ``l`` is lanes ``4l
  .. 4l+3``; each of them gathers those four words (``shfl.sync.idx``) and
  runs stock lane ``l``'s chain itself, and the butterfly xor 16, 8, 4 folds
  the eight chains in the stock's order.

RoPE (``rope_fma``): the pair ``(x, y)`` of the FP32 ``n`` with ``c, s``
turns into ``x' = fma(c, x, -(s * y))``, ``y' = fma(s, x, c * y)``, each
product ``mul.rn`` (the stock CUDA rotary kernels' form).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
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


def qk_norm_pair(word, lane, eps) -> tuple:
    """The stock QK-norm (module docstring) of the head this warp holds, lane
    ``lane`` holding the BF16 pair ``(e_2j, e_2j+1)`` packed in ``word``
    (``j = lane``): the normalized FP32 pair ``(n_2j, n_2j+1)``. Each lane
    gathers the words of lanes ``4l .. 4l+3`` (``l = lane // 4``), runs the
    chain of ``e_8l .. e_8l+7`` and folds by the butterfly xor 16, 8, 4 (lane
    ``lane ^ 4k`` holds stock lane ``l ^ k``). Every lane of the warp must
    call it. ``eps``: as ``qk_rsqrt``."""
    first = Int32(lane) & Int32(ptx.WARP - LANE_PAIRS)
    group = [cute.arch.shuffle_sync(Uint32(word), offset=first | Int32(i)) for i in range(LANE_PAIRS)]
    total = square_chain([v for w in group for v in ptx.bf16x2_to_f32(w)])
    for offset in (16, 8, 4):
        total = ptx.add_rn(total, cute.arch.shuffle_sync_bfly(total, offset=offset))
    r = qk_rsqrt(total, eps)
    a, b = ptx.bf16x2_to_f32(word)
    return ptx.mul_rn(a, r), ptx.mul_rn(b, r)


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


# ---------------------------------------------------------------- shared by every head kernel


def load_cos_sin(table_dtype: str, table, position, lane) -> tuple:
    """``(cos, sin)`` of pair ``lane`` at ``position`` (Int64, inside the
    table) of the ``[P, 64]`` table at byte address ``table`` (columns
    ``lane`` and ``32 + lane``), widened to FP32 exactly."""
    if table_dtype == "fp32":
        at = Int64(table) + Int64(position) * (4 * HEAD_DIM) + Int64(lane) * 4
        return ptx.as_f32(ptx.ld_global_b32(at)), ptx.as_f32(ptx.ld_global_b32(at + 2 * HEAD_DIM))
    at = Int64(table) + Int64(position) * (2 * HEAD_DIM) + Int64(lane) * 2
    # A BF16 is the high half of the FP32 of the same value.
    c = ptx.as_f32(ptx.ld_global_u16(at) << Uint32(16))
    s = ptx.as_f32(ptx.ld_global_u16(at + HEAD_DIM) << Uint32(16))
    return c, s


def cache_row_address(cache, slot, kv_heads: int, kv_head, block_size):
    """The byte address (Int64) of the cache row of ``slot`` (Int64, not
    negative) and KV head ``kv_head`` in the BF16 cache ``[num_blocks,
    kv_heads, block_size, 128]`` at byte address ``cache``: block ``slot //
    block_size``, row ``slot % block_size``; its K half is the first 128
    bytes, its V half the next 128."""
    bs = Int64(block_size)
    row = (slot // bs * kv_heads + Int64(kv_head)) * bs + slot % bs
    return Int64(cache) + row * (4 * HEAD_DIM)


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
    "cache_row_address",
    "ld_global_v2",
    "load_cos_sin",
    "load_cos_sin_quad",
    "qk_norm_lane8",
    "qk_norm_pair",
    "qk_rsqrt",
    "rope_fma",
    "square_chain",
    "strided_row_address",
]
