"""The draft-step benchmark's attention, the same on both sides
(``bench_draft_step.py --attention``): DSpark's paged decode kernel, vLLM's
Triton ``unified_attention`` binary (its ``TRITON_ATTN`` backend), or
dspark-core's spec in torch ops (the dry run)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import attend


class _CacheView:
    """A cache tensor as the spec's attention reads it (the dry run)."""

    from dspark_core.spec.layers import PagedKVCache as _P
    gather = _P.gather

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.block_size, self.head_dim = tensor, tensor.shape[2], tensor.shape[3] // 2
        self.num_slots = tensor.shape[0] * tensor.shape[2]


class TritonAttention:
    """vLLM's TRITON_ATTN decode as the benchmark's ``attention(q, cache,
    attn_slots)``: ``launch_stock.unified_attention`` (the carried
    ``kernel_unified_attention`` / ``reduce_segments`` binaries, vLLM's 2D or
    3D choice) with the arguments ``TritonAttentionImpl.forward`` passes for
    the draft: the K and V views of the logical ``[blocks, kv_heads,
    block_size, 2D]`` cache (its ``transpose(1, 2).split(D)``: the benchmark's
    cache is read in place, no copy), scale ``D^-0.5``, causal, no window,
    softcap 0, the layer's K/V scales (1.0) expanded to ``[requests,
    kv_heads]``, the metadata builder's scratch (``unified_attention_scratch``
    for ``num_speculative_tokens``), out a fresh ``[m, heads, D]``.

    ``bind(attn_slots)`` derives the step's ``query_start_loc``, ``seq_lens``
    and block table from the spec's operand once, on the host, before any
    graph (``launch_stock.paged_metadata``: causal requests over whole pages,
    the table ``max_position / block_size`` pages wide like vLLM's); a call
    then takes the same ``attn_slots`` (its shape is checked, not its
    values)."""

    def __init__(self, kernels, config: DraftConfig, num_speculative_tokens: int, device) -> None:
        self.S, self.config = kernels, config
        self.scratch = kernels.unified_attention_scratch(config.num_heads, config.num_kv_heads, config.head_dim,
                                                         num_speculative_tokens, device)
        self.unit_scale = torch.ones((), dtype=torch.float32, device=device)  # layer._k_scale, layer._v_scale
        self.shape, self.meta = None, None

    def bind(self, attn_slots: torch.Tensor) -> None:
        c = self.config
        width = -(-max(c.max_position, attn_slots.shape[1]) // c.kv_block_size)
        self.meta = self.S.paged_metadata(attn_slots, c.kv_block_size, width)
        self.descale = self.unit_scale.expand(self.meta["seqused_k"].shape[0], c.num_kv_heads)
        self.shape = tuple(attn_slots.shape)

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, attn_slots: torch.Tensor) -> torch.Tensor:
        if tuple(attn_slots.shape) != self.shape:
            raise ValueError(f"TritonAttention is bound to attn_slots {self.shape}, not {tuple(attn_slots.shape)}")
        meta, d = self.meta, self.config.head_dim
        key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        return self.S.unified_attention(q, key_cache, value_cache, out, meta["cu_seqlens_q"], meta["max_seqlen_q"],
                                        meta["seqused_k"], meta["max_seqlen_k"], d ** -0.5, True, (-1, -1),
                                        meta["block_table"], 0, None, self.descale, self.descale, **self.scratch)



def step_attention(name: str, kernels, config: DraftConfig, n: int, device):
    """``attention(q, cache, attn_slots)`` for ``name`` ("dspark", "triton"
    or "spec"), or None (said) where the carried binaries lack vLLM's
    unified attention."""
    if name == "spec":
        return lambda q, cache, slots: attend(q, _CacheView(cache), slots, config.num_kv_heads)
    if name == "triton":
        if not json.loads((Path(kernels.DEFAULT_DIR) / "manifest.json").read_text()).get("unified_attention"):
            print(f"no unified attention in {kernels.DEFAULT_DIR}: run scripts/stock/compile_stock.py --parts "
                  "attention and carry .device/stock")
            return None
        return TritonAttention(kernels, config, n, device)
    from dspark_core.contracts.constants import AttentionConstants
    from dspark_cute.cutedsl.attention.paged import PagedAttention

    kernel = PagedAttention(AttentionConstants(config.num_heads, config.num_kv_heads, config.head_dim,
                                               config.kv_block_size))
    kernel.prepare()
    return lambda q, cache, slots: kernel.launch(q, cache, slots)
