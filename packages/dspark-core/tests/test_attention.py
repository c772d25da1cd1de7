"""The attention spec (``dspark_core.spec.attention``, the reference draft's
own attention, not a stock kernel): its head tree (``head_sum``) against one
warp's butterfly, the attention bit for bit against the independent NumPy CTA
emulation (``_independent.attention``), close to a float64 softmax, its
special cases (-0.0 terms, masked slots that hold garbage, NaN and infinite
scores, no valid slot) and its ValueErrors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _independent import _add, assert_same_bits, random_f32, random_in, to_np, to_torch, warp_head_sum
from _independent import attention as np_attention

from dspark_core.spec.attention import LANES, head_sum, lane_sums, paged_attention, scale
from dspark_core.spec.layers import PagedKVCache

BLOCK = 16
D = 64


def _setup(rng, m, s, heads, kv_heads, kind="normal", holes=0.0, blocks=None):
    """A cache with random K/V at shuffled slots, BF16 queries, and
    ``attn_slots`` [m, s] naming distinct random slots with some masked."""
    blocks = blocks or (s // BLOCK + 3)
    cache = PagedKVCache(blocks, kv_heads, BLOCK, D)
    kv = random_in(rng, (blocks, kv_heads, BLOCK, 2 * D), "bf16", kind)
    cache.tensor.copy_(to_torch(kv, "bf16"))
    q = to_torch(random_in(rng, (m, heads, D), "bf16", kind), "bf16")
    slots = np.stack([rng.permutation(blocks * BLOCK)[:s] for _ in range(m)]).astype(np.int64)
    slots[rng.random((m, s)) < holes] = -1
    return q, cache, torch.from_numpy(slots)


def _expected(q, cache, attn_slots, kv_heads):
    m, heads, d = q.shape
    group = heads // kv_heads
    qn = to_np(q)
    kv = to_np(cache.tensor)
    slots = attn_slots.numpy()
    out = np.zeros((m, heads, d), dtype=np.float32)
    for i in range(m):
        valid = slots[i] >= 0
        rows = np.where(valid, slots[i], 0)
        for h in range(heads):
            g = h // group
            k = kv[rows // BLOCK, g, rows % BLOCK, :d]
            v = kv[rows // BLOCK, g, rows % BLOCK, d:]
            out[i, h] = np_attention(qn[i, h], k, v, valid)
    return out


@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 64, 128, 256])
def test_head_sum_matches_the_warp(d, rng):
    v = random_f32(rng, (5, 7, d), "mixed")
    assert_same_bits(head_sum(torch.from_numpy(v)), warp_head_sum(v), f"head_sum D={d}")


def test_head_sum_order_is_pairs_then_halves():
    """D = 8, values chosen so each order gives different bits: the pairs
    (v0+v1), (v2+v3), ..., then (p0+p2), (p1+p3), then the last add."""
    v = np.array([1.0, 2.0**-24, 2.0**-24, 0.0, 2.0**-24, 0.0, 0.0, 0.0], dtype=np.float32)
    assert head_sum(torch.from_numpy(v)).item() == 1.0
    assert warp_head_sum(v) == np.float32(1.0)
    # another order, ((v1 + v2) + v4) + v0 = 1 + 2**-23, shows the value depends on it:
    assert _add(_add(_add(v[1], v[2]), v[4]), v[0]) != np.float32(1.0)


def test_head_sum_accuracy(rng):
    """Non-negative terms, log2(D) additions on every path: gamma_log2(D)."""
    u = 2.0**-24
    for d in (2, 8, 64):
        v = np.abs(random_f32(rng, (200, d), "wide"))
        got = head_sum(torch.from_numpy(v)).numpy().astype(np.float64)
        exact = np.array([math.fsum(r) for r in v.astype(np.float64)])
        k = int(math.log2(d))
        assert np.all(np.abs(got - exact) <= k * u / (1 - k * u) * exact)


@pytest.mark.parametrize(
    "m,s,heads,kv_heads,kind,holes",
    [
        (1, 1, 8, 8, "normal", 0.0),
        (2, 127, 8, 2, "normal", 0.1),
        (1, 128, 4, 1, "wide", 0.0),
        (3, 129, 8, 4, "normal", 0.3),
        (1, 300, 16, 2, "mixed", 0.05),
        (1, 260, 2, 1, "tiny", 0.0),
    ],
)
def test_attention_matches_the_independent_cta(rng, seed, m, s, heads, kv_heads, kind, holes):
    print(f"seed {seed}")
    q, cache, attn_slots = _setup(rng, m, s, heads, kv_heads, kind, holes)
    got = paged_attention(q, cache, attn_slots, kv_heads)
    assert_same_bits(got, _expected(q, cache, attn_slots, kv_heads), f"attention {kind}")


def test_attention_is_close_to_float64_softmax(rng, seed):
    print(f"seed {seed}")
    m, s, heads, kv = 2, 333, 8, 2
    q, cache, attn_slots = _setup(rng, m, s, heads, kv, "normal", 0.2)
    got = paged_attention(q, cache, attn_slots, kv).double()
    k, v = cache.gather(attn_slots.clamp_min(0))
    k = k.double().repeat_interleave(heads // kv, dim=2)
    v = v.double().repeat_interleave(heads // kv, dim=2)
    scores = torch.einsum("mhd,mshd->mhs", q.double(), k) / np.sqrt(D)
    scores = scores.masked_fill(~(attn_slots >= 0)[:, None, :], float("-inf"))
    ref = torch.einsum("mhs,mshd->mhd", torch.softmax(scores, -1), v)
    # BF16 output: half an ulp of BF16 (2**-9 relative) plus FP32 noise.
    tol = ref.abs() * 2.0**-8 + 1e-6
    assert bool(((got - ref).abs() <= tol).all()), float(((got - ref).abs() / tol).max())


def test_masked_slots_contribute_nothing(rng):
    """A masked slot's K/V may be anything (inf, NaN): the result is that of
    the valid slots alone."""
    q, cache, attn_slots = _setup(rng, 1, 200, 8, 2)
    attn_slots[0, 1::3] = -1
    attn_slots[attn_slots == 0] = -1  # slot 0 is where masked entries gather from
    clean = paged_attention(q, cache, attn_slots, 2)
    # Poison every row the masked entries would clamp to (slot 0) and the
    # rows of no valid slot.
    used = set(attn_slots[attn_slots >= 0].tolist())
    poison = torch.tensor([s for s in range(cache.num_slots) if s not in used])
    cache.tensor[poison // BLOCK, :, poison % BLOCK] = float("nan")
    cache.tensor[0, :, 0] = float("inf")
    again = paged_attention(q, cache, attn_slots, 2)
    assert torch.equal(clean.view(torch.int16), again.view(torch.int16))


def test_lane_sums_keep_negative_zero_and_order():
    """+0.0 starts each lane, a masked term is skipped: all -0.0 terms sum to
    +0.0 (0.0 + -0.0), and the lane order decides rounding."""
    terms = torch.full((1, 3), -0.0)
    valid = torch.tensor([[True, False, True]])
    assert lane_sums(terms, valid).view(torch.int32).item() == 0
    # 1 + 2**-24 + 2**-24: in one lane sequential (rounds away twice), across
    # lanes folded: lane 0 = 1, lane 1 = 2**-24, lane 2 = 2**-24.
    t = torch.tensor([[1.0, 2.0**-24, 2.0**-24]])
    ok = torch.ones_like(t, dtype=torch.bool)
    folded = lane_sums(t, ok)
    lanes = [1.0, 2.0**-24, 2.0**-24] + [0.0] * (LANES - 3)
    while len(lanes) > 1:
        half = len(lanes) // 2
        lanes = [float(np.float32(a) + np.float32(b)) for a, b in zip(lanes[:half], lanes[half:])]
    assert folded.item() == np.float32(lanes[0])
    # Slot j and slot j + 128 share lane j: sequential there.
    t2 = torch.zeros(1, 129)
    t2[0, 0], t2[0, 128] = 2.0**-24, 1.0
    assert lane_sums(t2, torch.ones_like(t2, dtype=torch.bool)).item() == np.float32(1.0)


def test_special_scores():
    """An infinite score gives NaN (inf - inf); a NaN K gives NaN; no valid
    slot gives the kernels' NaN where asked for (refused by default);
    underflowing probabilities leave the winner alone."""
    cache = PagedKVCache(2, 1, BLOCK, D)
    q = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q[0, 0, 0] = 1.0
    cache.tensor[0, 0, :3, D] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)  # V column 0
    cache.tensor[0, 0, 0, 0] = 1000.0  # slot 0 scores 125; slots 1, 2 score 0
    slots = torch.tensor([[0, 1, 2]])
    out = paged_attention(q, cache, slots, 1)
    assert out[0, 0, 0].item() == 1.0  # exp(-125) underflows against 1
    cache.tensor[0, 0, 1, 0] = float("inf")
    assert torch.isnan(paged_attention(q, cache, slots, 1)[0, 0, 0])
    cache.tensor[0, 0, 1, 0] = float("nan")
    assert torch.isnan(paged_attention(q, cache, slots, 1)).all()
    assert torch.isnan(paged_attention(q, cache, torch.full((1, 3), -1), 1, empty_rows="nan")).all()
    with pytest.raises(ValueError, match="no valid"):  # the default: refused (no result of vLLM's)
        paged_attention(q, cache, torch.full((1, 3), -1), 1)


def test_scale_is_rounded_once():
    assert scale(64) == 0.125
    assert scale(48) == float(np.float32(1.0 / np.sqrt(48.0)))


def test_attention_value_errors():
    cache = PagedKVCache(2, 2, BLOCK, D)
    q = torch.zeros(1, 4, D, dtype=torch.bfloat16)
    slots = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="BF16 queries"):
        paged_attention(q.float(), cache, slots, 2)
    with pytest.raises(ValueError, match="groups"):
        paged_attention(q, cache, slots, 3)
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(q, cache, slots, 4)
    with pytest.raises(ValueError, match="integer attn_slots"):
        paged_attention(q, cache, slots.float(), 2)
    with pytest.raises(ValueError, match="beyond the cache"):
        paged_attention(q, cache, torch.tensor([[0, 2 * BLOCK]]), 2)
