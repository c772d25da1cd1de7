"""The paged KV cache's physical layouts (``spec.layers.PagedKVCache``,
``CACHE_LAYOUTS``): LBHNC (each layer's ``[blocks, kv_heads, block_size,
2D]`` contiguous) and LBNHC (vLLM 0.33.0's default on sm_90: ``[block][token]
[head]`` rows, the logical view strided) hold the same logical cache after
the same inserts, each in its own physical order, with the scratch block and
every unnamed row untouched."""

from __future__ import annotations

import pytest
import torch

from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel
from dspark_core.spec.layers import CACHE_LAYOUTS, PagedKVCache, kv_insert

POISON = 0x1A2B  # a BF16 pattern no insert writes


def test_layouts_hold_the_same_logical_cache(gen):
    nb, heads, bs, d = 5, 3, 4, 8
    slots = torch.randperm(nb * bs, generator=gen)[:9]
    slots[::4] = -1
    k = torch.randn(9, heads, d, generator=gen).bfloat16()
    v = torch.randn(9, heads, d, generator=gen).bfloat16()
    k.view(-1)[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    caches = {}
    for layout in CACHE_LAYOUTS:
        cache = PagedKVCache(nb, heads, bs, d, layout=layout)
        cache._storage.view(torch.int16).fill_(POISON)
        cache.insert(k, v, slots)
        caches[layout] = cache
    expected = torch.full((nb, heads, bs, 2 * d), 0, dtype=torch.int16).fill_(POISON).view(torch.bfloat16)
    kv_insert(expected, k, v, slots)
    for layout, cache in caches.items():
        assert cache.layout == layout and cache.tensor.shape == (nb, heads, bs, 2 * d)
        assert torch.equal(cache.tensor.view(torch.int16), expected.view(torch.int16)), layout
        scratch = cache._storage[nb].view(torch.int16)
        assert scratch.shape == (heads, bs, 2 * d)  # the negative slots' rows went here, outside ``tensor``
    assert caches["LBHNC"].tensor.is_contiguous()
    strided = caches["LBNHC"].tensor
    assert strided.stride() == (bs * heads * 2 * d, 2 * d, heads * 2 * d, 1)
    # The physical order: token-major rows in a block, heads inside.
    physical = strided.permute(0, 2, 1, 3)
    assert physical.is_contiguous() and torch.equal(physical.view(torch.int16),
                                                    expected.permute(0, 2, 1, 3).view(torch.int16))


def test_unknown_layouts_are_refused():
    for layout in ("BLNHC", "NHD", "", None):
        with pytest.raises(ValueError, match="LBHNC, LBNHC"):
            PagedKVCache(2, 1, 4, 8, layout=layout)


def test_make_caches_takes_the_layout():
    model = DraftModel(small_config(), device="meta")
    caches = model.make_caches(3, "meta", "LBNHC")
    assert len(caches) == len(model.layers) and all(c.layout == "LBNHC" for c in caches)
    assert not caches[0].tensor.is_contiguous()
    assert all(c.layout == "LBHNC" for c in model.make_caches(3, "meta"))
