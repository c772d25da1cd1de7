"""dspark-core's spec of vLLM 0.33.0's Gumbel sampler (``spec.gumbel``)
against an independent Python version written from its docstring and
Triton 3.8's PTX: the hash in plain Python integers, ``logf`` and the series
with ``_independent.fma`` (exact integer arithmetic). vLLM's own functions
(Triton's interpreter) are compared in dspark-vllm's ``test_gumbel.py``."""

from __future__ import annotations

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.spec import gumbel

F32 = np.float32
M = 0xFFFFFFFF


def _rotl(x, s):
    return ((x << s) | (x >> (32 - s))) & M


def _mix(h, k):
    k = (k * 0xCC9E2D51) & M
    k = (_rotl(k, 15) * 0x1B873593) & M
    h = _rotl(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & M


def py_hash(seed: int, pos: int, off: int) -> int:
    s = seed & 0xFFFFFFFFFFFFFFFF
    h = 0
    for k in (s & M, s >> 32, pos & M, off & M):
        h = _mix(h, k)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def _c(word):
    return np.array(word, dtype=np.uint32).view(F32)[()]


def py_logf(x: np.ndarray) -> np.ndarray:
    """The Triton-inlined libdevice logf, from its PTX (normal positive x)."""
    x = np.asarray(x, dtype=F32)
    tiny = x < F32(2.0**-126)
    x = np.where(tiny, x * F32(2.0**23), x).astype(F32)  # exact
    bits = x.view(np.uint32).astype(np.int64)
    e = ((bits - 0x3F2AAAAB) & M) & 0xFF800000
    m = I._sub(((bits - e) & M).astype(np.uint32).view(F32), F32(1.0))
    n = (np.where(e >= 2**31, e - 2**32, e).astype(np.float64) * 2.0**-23 - 23.0 * tiny).astype(F32)  # exact
    p = np.full_like(m, _c(0xBE055027))
    for w in (0x3E1039F6, 0xBDF8CDCC, 0x3E0F2955, 0xBE2AD8B9, 0x3E4CED0B, 0xBE7FFF22, 0x3EAAAA78, 0xBF000000):
        p = I.fma(p, m, _c(w))
    q = I.fma(I._mul(m, p), m, m)
    return I.fma(n, _c(0x3F317218), q)


def test_hash_is_murmur3_of_the_words(rng):
    seeds = rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64)
    seeds[:3] = [0, -1, 2**63 - 1]
    pos = rng.integers(0, 2**40, 500)
    off = rng.integers(0, 2**20, 500)
    got = gumbel.murmur3_hash32(torch.from_numpy(seeds), torch.from_numpy(pos), torch.from_numpy(off))
    want = [py_hash(int(s), int(p), int(o)) for s, p, o in zip(seeds, pos, off)]
    assert got.tolist() == want


def test_uniform_is_the_hash_halves(rng):
    seeds = torch.from_numpy(rng.integers(-(2**62), 2**62, 2000, dtype=np.int64))
    pos, off = torch.arange(2000), torch.arange(2000) * 7
    h = gumbel.murmur3_hash32(seeds, pos, off).numpy()
    want = ((h >> 16).astype(np.float64) * 2.0**-16 + ((h & 0xFFFF) + 0.5) * 2.0**-32).astype(F32)
    assert np.array_equal(gumbel.uniform32(seeds, pos, off).numpy(), want)  # one rounding of an exact sum


def test_logf_and_the_series_are_the_ptxs(rng):
    x = np.concatenate([rng.uniform(2.0**-24, 1.0, 3000), rng.uniform(1.0, 24.0, 1000),
                        [2.0**-24, 0.5, 0.75, 1.0, 2.0, 2.0**-10, 1e-40, 2.0**-149, 1.1e-38]]).astype(F32)
    _same = np.array_equal
    assert _same(gumbel.logf(torch.from_numpy(x)).numpy().view(np.uint32), py_logf(x).view(np.uint32))
    u = rng.uniform(2.0**-33, 1.0, 4000).astype(F32)
    p = np.full_like(u, F32(1 / 8))
    for k in (7, 6, 5, 4, 3, 2, 1):
        p = I.fma(u, p, F32(1.0 / k))
    want = np.where(u < 0.25, -I._mul(u, p), py_logf(np.maximum(I._sub(F32(1.0), u), F32(2.0**-24))))
    assert _same(gumbel.log1p_neg_stable(torch.from_numpy(u)).numpy().view(np.uint32), want.view(np.uint32))


def test_block_argmax_rule_and_refusal():
    y = torch.tensor([[1.0, 3.0, 3.0, -1.0], [-0.0, 0.0, -1.0, float("-inf")], [float("-inf")] * 4])
    assert gumbel.block_argmax(y).tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match="reduction tree"):
        gumbel.block_argmax(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="logits cache"):
        gumbel.sample(torch.zeros(1, 4), torch.tensor([0]), torch.ones(1), torch.ones(1, dtype=torch.long),
                      torch.zeros(1, dtype=torch.long), True, torch.zeros(1, 1, 4, dtype=torch.bfloat16), 0)


def test_probabilistic_step_scatters_then_samples(rng):
    """At temperature 0 the step is the argmax of the BF16-cast logits scattered to their target ids."""
    v, vt = 6, 12
    d2t = torch.tensor([0, 1, 3, 3, 4, 6])  # target ids 0, 2, 5, 6, 8, 11
    logits = torch.tensor([[0.1, 2.0, 0.3, 2.0, -1.0, 0.0], [0.0] * 6])
    buf = torch.full((4, vt), float("-inf"), dtype=torch.bfloat16)
    cache = torch.zeros(3, 2, vt, dtype=torch.bfloat16)
    got = gumbel.probabilistic_step(logits, torch.arange(v) + d2t, buf, torch.tensor([2, 0]), torch.zeros(3),
                                    torch.zeros(3, dtype=torch.long), torch.tensor([5, 6]), cache, 1)
    assert got.tolist() == [2, 0]
    assert torch.equal(cache[2, 1], buf[0]) and cache[2, 1, 1] == float("-inf") and cache[2, 1, 2] == 2.0
    assert (cache[:, 0] == 0).all() and (cache[1] == 0).all()
