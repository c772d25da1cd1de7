"""The paged KV cache as the DSpark inserts (the QKV epilogue, the context
store) address it: through its strides, as vLLM's stock inserts do
(``reshape_and_cache_flash`` and the fused QK-norm/RoPE/insert take the
cache's block, token and head strides).

A cache is the logical BF16 view ``[num_blocks, kv_heads, block_size, 2 *
64]`` of one layer (K in the first 64 columns of the last dim, V in the
next 64), in any physical order: vLLM 0.33.0 allocates one buffer and views
each layer's ``[B, H, N, C]`` through a stride permutation (its
``KVCacheLayout``: LBNHC, its default on sm_90, gives ``[block][token][head]``
rows, LBHNC ``[block][head][token]``; the block stride may be padded). The
row of slot ``s`` and KV head ``h`` starts at byte ``data + (s // bs) *
block_stride + (s % bs) * token_stride + h * head_stride`` (byte strides),
its 128 elements contiguous.

``cache_problem(t, kv_heads, align)`` says why an insert kernel does not take
``t`` (a sentence, None where it does); ``byte_strides(t)`` gives the three
strides the kernels take.
"""

from __future__ import annotations

import torch

from dspark_core.contracts.constants import HEAD_DIM

# Elements of one cache row: K then V.
ROW_ELEMS = 2 * HEAD_DIM
ELEMENT_BYTES = 2
# The kernels' offsets are 64-bit; block sizes and (for the context store's
# 32-bit division) slot counts stay below 2^31.
MAX_OFFSET_BYTES = 2**63
MAX_SLOTS = 2**31


def describe_layout(t: torch.Tensor) -> str:
    """``t``'s shape and strides in words, for the refusals."""
    return f"[num_blocks, kv_heads, block_size, {ROW_ELEMS}] = {list(t.shape)} with strides {list(t.stride())}"


def cache_problem(t, kv_heads: int, align: int) -> str | None:
    """Why a BF16 cache view ``t`` is not one the inserts address (a sentence),
    or None: ``[num_blocks >= 1, kv_heads, block_size >= 1, 128]``, the last
    dim contiguous (stride 1), the block, token and head strides multiples of
    ``align`` bytes as is the data address (``align``: the kernel's store
    width), no two (block, token, head) rows overlapping (each stride, sorted
    ascending over the dims of more than one element, at least the span of
    the dims below it), block_size below 2^31 and the furthest byte below
    2^63 (the kernels' offsets). The device is the caller's to check."""
    if not (isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype == torch.bfloat16):
        return f"the KV cache must be a bfloat16 tensor of [num_blocks, {kv_heads}, block_size, {ROW_ELEMS}]"
    blocks, heads, block_size, width = t.shape
    if blocks < 1 or block_size < 1 or heads != kv_heads or width != ROW_ELEMS:
        return f"the KV cache must be [num_blocks, {kv_heads}, block_size, {ROW_ELEMS}], not {list(t.shape)}"
    if t.stride(3) != 1:
        return f"the KV cache's rows (K then V, the last dim) must be contiguous: {describe_layout(t)}"
    step = align // ELEMENT_BYTES
    if any(t.stride(d) % step for d in range(3)) or t.data_ptr() % align:
        return (f"the KV cache's block, token and head strides and its address must be multiples of {align} bytes: "
                f"{describe_layout(t)} at address {t.data_ptr():#x}")
    span = ROW_ELEMS
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(3) if t.shape[d] > 1):
        if stride < span:
            return f"the KV cache's rows overlap: {describe_layout(t)}"
        span = stride * size
    if block_size >= MAX_SLOTS:
        return f"a KV cache block of 2^31 slots or more ({block_size})"
    furthest = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    if (t.data_ptr() % MAX_OFFSET_BYTES) + furthest * ELEMENT_BYTES >= MAX_OFFSET_BYTES:
        return "a KV cache whose byte offsets reach 2^63"
    return None


def byte_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The (block, token, head) strides of the cache view ``t`` in bytes."""
    return t.stride(0) * ELEMENT_BYTES, t.stride(2) * ELEMENT_BYTES, t.stride(1) * ELEMENT_BYTES


__all__ = ["MAX_SLOTS", "ROW_ELEMS", "byte_strides", "cache_problem", "describe_layout"]
