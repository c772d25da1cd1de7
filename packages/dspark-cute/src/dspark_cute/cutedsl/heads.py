"""Traced pieces of a 64-wide head that a warp holds one GPT-J pair per lane
(lane ``j``: columns ``2j``, ``2j + 1``), shared by the QKV front and
epilogue and the context K/V store: ``HeadNorm``, RoPE, the RoPE table's
cos and sin, the paged cache's row address."""

from __future__ import annotations

from cutlass import Int64, Uint32

from dspark_core.contracts.constants import HEAD_DIM
from dspark_cute import ptx


def head_norm_pair(a, b, eps: float, weight_word=None) -> tuple:
    """``HeadNorm`` of the head whose pair ``(a, b)`` (FP32) this lane holds:
    ``s = a*a + b*b`` (each rounded), the head tree (the warp butterfly 16 ..
    1), ``r = inv_rms(s, 64, eps)``, ``(a*r, b*r)`` (times the BF16 weight
    pair ``weight_word`` if given), rounded to BF16. Returns ``(word, a',
    b')``: the packed pair and its two values widened back."""
    s = ptx.warp_fold(ptx.add_rn(ptx.mul_rn(a, a), ptx.mul_rn(b, b)))
    r = ptx.inv_rms(s, HEAD_DIM, eps)
    ya, yb = ptx.mul_rn(a, r), ptx.mul_rn(b, r)
    if weight_word is not None:
        wa, wb = ptx.bf16x2_to_f32(weight_word)
        ya, yb = ptx.mul_rn(ya, wa), ptx.mul_rn(yb, wb)
    word = ptx.pack_bf16x2_rn(ya, yb)
    return (word, *ptx.bf16x2_to_f32(word))


def rope_pair(a, b, c, s) -> tuple:
    """GPT-J RoPE of one pair, no FMA: ``(a * c - b * s, b * c + a * s)``,
    each product and the difference/sum rounded once (FP32)."""
    return (
        ptx.sub_rn(ptx.mul_rn(a, c), ptx.mul_rn(b, s)),
        ptx.add_rn(ptx.mul_rn(b, c), ptx.mul_rn(a, s)),
    )


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


__all__ = ["cache_row_address", "head_norm_pair", "load_cos_sin", "rope_pair"]
