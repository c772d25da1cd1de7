"""CPU tests of ``dspark_cute.runtime.kv_cache``: which cache views the
inserts address through their strides (every physical order vLLM 0.33.0
lays a layer out in, padded block strides, another layer's rows between the
blocks) and which they refuse with a sentence (K|V not contiguous, strides or
address off the store width, overlapping rows, wrong shapes and dtypes), and
that the byte strides they get name the same element as the logical index."""

from __future__ import annotations

import itertools

import pytest
import torch
from cute_testing import CACHE_LAYOUTS, layout_cache

from dspark_cute.runtime.kv_cache import byte_strides, cache_problem

ROW = 128
# vLLM 0.33.0's KVCacheLayout stride permutations of [L, B, H, N, C].
VLLM_LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def vllm_views(order, layers: int, blocks: int, heads: int, bs: int, pad: int = 0) -> list:
    """Each layer's logical ``[B, H, N, C]`` view of one allocation whose
    physical order is ``order`` (as vLLM's ``create_kv_cache_views`` strides
    it), the block stride ``pad`` elements more than the span inside it
    (vLLM's fixed block stride may be padded)."""
    logical = (layers, blocks, heads, bs, ROW)
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        if axis == 1:
            step += pad
        strides[axis] = step
        step *= logical[axis]
    raw = torch.zeros(step + 64, dtype=torch.bfloat16)
    view = raw.as_strided(logical, strides, 32)  # 64 bytes in: 16-byte aligned
    return [view[layer] for layer in range(layers)]


@pytest.mark.parametrize("name", list(VLLM_LAYOUTS))
@pytest.mark.parametrize("align", [4, 16])
def test_every_vllm_layout_is_taken(name, align):
    for pad in (0, 8 * 3):
        for layer, view in enumerate(vllm_views(VLLM_LAYOUTS[name], 3, 5, 4, 16, pad)):
            assert view.shape == (5, 4, 16, ROW)
            assert cache_problem(view, 4, align) is None, (name, pad, layer, view.stride())


def test_byte_strides_address_the_logical_element():
    """``data + b * block + n * token + h * head`` (bytes) is the address of
    ``view[b, h, n, 0]`` for every layout and index."""
    for name, order in VLLM_LAYOUTS.items():
        view = vllm_views(order, 2, 3, 2, 4, pad=16)[1]
        block, token, head = byte_strides(view)
        for b, h, n in itertools.product(range(3), range(2), range(4)):
            at = view.data_ptr() + b * block + n * token + h * head
            assert at == view[b, h, n].data_ptr(), (name, b, h, n)


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_the_test_layouts_are_taken(layout):
    view = layout_cache(layout, 6, 2, 16, "cpu")
    assert cache_problem(view, 2, 16) is None
    assert cache_problem(view[:5], 2, 16) is None  # a prefix of blocks


def test_refusals_name_what_is_expected():
    flat = torch.zeros(4 * 2 * 16 * ROW * 2 + 64, dtype=torch.bfloat16)
    shape = (4, 2, 16, ROW)
    cases = {
        "bfloat16 tensor": [torch.zeros(shape), torch.zeros(4, 2, 16), "a cache"],
        "[num_blocks, 2, block_size, 128], not": [torch.zeros(4, 3, 16, ROW, dtype=torch.bfloat16),
                                                  torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16),
                                                  torch.zeros(0, 2, 16, ROW, dtype=torch.bfloat16)],
        "last dim) must be contiguous": [torch.zeros(4, 2, ROW, 16, dtype=torch.bfloat16).transpose(2, 3)],
        "multiples of 16 bytes": [flat.as_strided(shape, (2 * 16 * 132, 16 * 132, 132, 1)),
                                  flat[4 : 4 + 4 * 2 * 16 * ROW].view(shape)],
        "rows overlap": [flat.as_strided(shape, (2 * 16 * ROW, 0, ROW, 1)),
                         flat.as_strided(shape, (2 * 16 * ROW, 16 * ROW, 64, 1)),
                         flat.as_strided(shape, (ROW, 16 * ROW, ROW * 2, 1))],
    }
    for words, views in cases.items():
        for view in views:
            reason = cache_problem(view, 2, 16)
            assert reason is not None and words in reason, (words, reason)
    # 4-byte stores take what 16-byte stores do not.
    odd = flat.as_strided(shape, (2 * 16 * 130, 16 * 130, 130, 1))
    assert cache_problem(odd, 2, 16) is not None and cache_problem(odd, 2, 4) is None
    assert "multiples of 4 bytes" in cache_problem(flat[1 : 1 + 4 * 2 * 16 * ROW].view(shape), 2, 4)


def test_huge_blocks_and_offsets_are_refused_without_memory():
    """A block of 2^31 slots (the kernels' 32-bit block size), and a block
    stride whose last block lies 2^63 bytes in (the kernels' 64-bit offsets),
    over meta tensors; one element less of each is taken."""
    big = torch.empty((1, 1, 2**31, ROW), dtype=torch.bfloat16, device="meta")
    assert "2^31" in cache_problem(big, 1, 16)
    assert cache_problem(torch.empty((1, 1, 2**31 - 1, ROW), dtype=torch.bfloat16, device="meta"), 1, 16) is None
    far = torch.empty_strided((2, 1, 1, ROW), (2**62, ROW, ROW, 1), dtype=torch.bfloat16, device="meta")
    assert "2^63" in cache_problem(far, 1, 16)
    near = torch.empty_strided((2, 1, 1, ROW), (2**62 - 2 * ROW, ROW, ROW, 1), dtype=torch.bfloat16, device="meta")
    assert cache_problem(near, 1, 16) is None
