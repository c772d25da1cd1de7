"""GPU tests of ``dspark_cute.cutedsl.qkv.epilogue.QKVEpilogue`` against the stock
``DraftAttention.front`` (``dspark_core``). Passed on an H200 with the rest
of the GPU suite.

Both sides get the same projection: ``qkv = linear(x, attn.qkv_proj)`` is
computed once, and the stock front's own ``linear`` call is replaced by one
that returns exactly that tensor (so special values can be planted in it).
Checked bit for bit (``assert_bitwise``): q, and the whole cache (every
block, poisoned before with a NaN pattern and then a finite one, so rows the
stock insert leaves alone must keep their poison bits; the scratch block past
our cache tensor must stay untouched), for m in {1, 2, 7, 16, 33}, BF16 and
FP32 RoPE tables and no RoPE, the q-norm with and without a weight, special
values in qkv, negative slots, qkv with and without the o-gate rows, a given
``out``; graph capture and replay; the host's ValueErrors for out-of-range
positions and slots outside capture and the kernel's skips inside it; the
compile refused during capture. Fresh seeded random data: the seed is
printed (repeat with DSPARK_SEED)."""

from __future__ import annotations

import pytest
import torch
from cute_testing import (
    assert_replays_repeat,
    capture_calls,
    poison,
    random_rows,
    requires_cuda,
    special_rows,
    stock_attention,
)

import dspark_core.reference.model as model_module
from dspark_core.contracts.constants import qkv_front_constants
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import StepInputs
from dspark_core.spec.layers import PagedKVCache, linear
from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
ROWS = [1, 2, 7, 16, 33]
NUM_BLOCKS, BLOCK = 64, 16
# name: DraftConfig changes
CASES = {
    "ref": {},
    "small-noqw-fp32": dict(hidden_size=2048, num_heads=8, num_kv_heads=1, q_norm_weight=False,
                            rope_table_dtype="fp32", head_norm_eps=1e-5, max_position=512),
    "norope": dict(hidden_size=4096, num_heads=4, num_kv_heads=2, use_rope=False),
    "norope-noqw": dict(hidden_size=2048, num_heads=20, num_kv_heads=4, use_rope=False, q_norm_weight=False),
}


class Setup:
    """A stock attention on CUDA with random weights and its epilogue."""

    def __init__(self, case: str, gen: torch.Generator, pdl=None):
        from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

        cfg = DraftConfig(**CASES[case])
        attn, self.table = stock_attention(cfg, gen)
        self.cfg, self.attn, self.gen = cfg, attn, gen
        self.constants = qkv_front_constants(attn)
        self.epi = QKVEpilogue(self.constants, attn.q_norm.weight, self.table, pdl=pdl)
        self.epi.prepare()

    def step(self, m: int) -> StepInputs:
        """Random positions and distinct slots, some negative."""
        pos = torch.randint(0, self.cfg.max_position, (m,), generator=self.gen, device="cuda")
        slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=self.gen, device="cuda")[:m].clone()
        if m >= 2:
            slots[0] = -1
        if m >= 7:
            slots[m - 2] = -7
        return StepInputs(pos, slots, torch.zeros((m, 1), dtype=torch.int64, device="cuda"))

    def cache(self, which: int) -> PagedKVCache:
        """A cache whose storage (scratch block included) holds poison ``which``."""
        cache = PagedKVCache(NUM_BLOCKS, self.cfg.num_kv_heads, BLOCK, 64, "cuda")
        poison(cache._storage, which)
        return cache

    def qkv(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = random_rows(self.gen, m, self.cfg.hidden_size, BF16, "cuda")
        return x, linear(x, self.attn.qkv_proj)

    def stock(self, x, qkv, step: StepInputs, cache: PagedKVCache, monkeypatch):
        """``attn.front(x, step, cache)`` with its projection returning ``qkv``."""
        attn = self.attn

        def same_projection(a, b):
            assert a is x and b is attn.qkv_proj
            return qkv

        with monkeypatch.context() as mp:
            mp.setattr(model_module, "linear", same_projection)
            return attn.front(x, step, cache)


def check(s: Setup, x, qkv, step: StepInputs, what: str, monkeypatch, out=None) -> None:
    """q, og and the whole cache of the epilogue vs the stock front, for both
    poisons; the scratch block of our cache keeps its poison."""
    for which in (0, 1):
        exp_cache = s.cache(which)
        exp_q, exp_og = s.stock(x, qkv, step, exp_cache, monkeypatch)
        cache = s.cache(which)
        scratch = cache._storage[NUM_BLOCKS:].clone()
        if out is not None:
            poison(out, which)
        q = s.epi.run(qkv, step.positions, step.slots, cache.tensor, out)
        torch.cuda.synchronize()
        assert out is None or q is out
        assert q.shape == exp_q.shape and q.is_contiguous()
        assert_bitwise(q, exp_q, f"{what} q (poison {which})")
        assert_bitwise(cache.tensor, exp_cache.tensor, f"{what} cache (poison {which})")
        assert_bitwise(cache._storage[NUM_BLOCKS:], scratch, f"{what} scratch block (poison {which})")
        if qkv.shape[1] == s.attn.qkv_proj.shape[0]:
            assert_bitwise(s.attn.split_qkv(qkv)[3], exp_og, f"{what} og")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", ROWS)
def test_matches_stock_front(case, m, seed, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup(case, gen)
    x, qkv = s.qkv(m)
    check(s, x, qkv, s.step(m), f"{case} m={m}", monkeypatch)


@pytest.mark.parametrize("m", [1, 16, 33])
def test_given_out_no_ogate_rows_and_pdl_off(m, seed, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref", gen, pdl=False)
    x, qkv = s.qkv(m)
    step = s.step(m)
    out = torch.empty((m, s.cfg.num_heads, 64), dtype=BF16, device="cuda")
    check(s, x, qkv, step, f"out m={m}", monkeypatch, out)
    # Without the o-gate rows: the same q and cache (the kernel never reads them).
    narrow = qkv[:, : s.cfg.q_size + 2 * s.cfg.kv_size].contiguous()
    exp_cache = s.cache(1)
    exp_q, _ = s.stock(x, qkv, step, exp_cache, monkeypatch)
    cache = s.cache(1)
    q = s.epi.run(narrow, step.positions, step.slots, cache.tensor)
    torch.cuda.synchronize()
    assert_bitwise(q, exp_q, "no o-gate rows q")
    assert_bitwise(cache.tensor, exp_cache.tensor, "no o-gate rows cache")


@pytest.mark.parametrize("case", ["ref", "small-noqw-fp32", "norope-noqw"])
def test_special_values(case, seed, monkeypatch):
    """Rows of -0.0, subnormals, +-inf, NaN, huge and tiny values in qkv."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup(case, gen)
    rows = s.attn.qkv_proj.shape[0]
    x, qkv = s.qkv(16)
    qkv[:10] = special_rows(rows, BF16, "cuda")
    check(s, x, qkv, s.step(16), f"{case} special", monkeypatch)


def test_host_raises_out_of_range(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref", gen)
    _, qkv = s.qkv(4)
    step = s.step(4)
    cache = s.cache(1)
    before = cache._storage.clone()
    bad = [
        (step.positions.clone().fill_(s.cfg.max_position), step.slots, "RoPE positions"),
        (step.positions.clone().fill_(-1), step.slots, "RoPE positions"),
        (step.positions, torch.tensor([1, 2, NUM_BLOCKS * BLOCK, -1], device="cuda"), "beyond the cache"),
        (step.positions, torch.tensor([5, 5, 6, -1], device="cuda"), "distinct slots"),
    ]
    for pos, slots, match in bad:
        with pytest.raises(ValueError, match=match):
            s.epi.run(qkv, pos, slots, cache.tensor)
    buf = torch.empty(qkv.numel() + 8, dtype=BF16, device="cuda")
    shifted = buf[4 : 4 + qkv.numel()].view(qkv.shape)  # 8-byte aligned only
    with pytest.raises(ValueError, match="16-byte aligned"):
        s.epi.run(shifted, step.positions, step.slots, cache.tensor)
    torch.cuda.synchronize()
    assert_bitwise(cache._storage, before, "cache after refused calls")


def test_cuda_graph(seed, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref", gen)
    m = 16
    x, qkv = s.qkv(m)
    step = s.step(m)
    out = torch.empty((m, s.cfg.num_heads, 64), dtype=BF16, device="cuda")
    cache = s.cache(0)
    graph = capture_calls(lambda: s.epi.run(qkv, step.positions, step.slots, cache.tensor, out))
    for _ in range(2):
        x2, qkv2 = s.qkv(m)
        qkv.copy_(qkv2)
        step.positions.copy_(s.step(m).positions)
        for which in (0, 1):
            poison(out, which)
            poison(cache._storage, which)
            exp_cache = s.cache(which)
            exp_q, _ = s.stock(x2, qkv2, step, exp_cache, monkeypatch)
            graph.replay()
            torch.cuda.synchronize()
            assert_bitwise(out, exp_q, f"graph replay q (poison {which})")
            assert_bitwise(cache.tensor, exp_cache.tensor, f"graph replay cache (poison {which})")
        assert_replays_repeat(graph, [out])


def test_capture_skips_out_of_range(seed):
    """Inside capture nothing is read on the host: the kernel skips a slot
    beyond the cache (token 1) and a token whose position lies outside the
    table (token 2: neither q nor K/V written)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref", gen)
    _, qkv = s.qkv(3)
    pos = torch.tensor([3, 4, s.cfg.max_position + 5], device="cuda")
    slots = torch.tensor([10, NUM_BLOCKS * BLOCK + 3, 20], device="cuda")
    out = poison(torch.empty((3, s.cfg.num_heads, 64), dtype=BF16, device="cuda"), 1)
    cache = s.cache(1)
    with pytest.raises(ValueError):  # outside capture the host reads and refuses them
        s.epi.run(qkv, pos, slots, cache.tensor, out)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        s.epi.run(qkv, pos, slots, cache.tensor, out)  # no host reads inside capture
    torch.cuda.synchronize()
    poison(out, 1)
    poison(cache._storage, 1)
    graph.replay()
    torch.cuda.synchronize()
    ref_cache = s.cache(1)
    ref_q = s.epi.run(qkv[:2].contiguous(), pos[:2], torch.tensor([10, -1], device="cuda"), ref_cache.tensor)
    torch.cuda.synchronize()
    assert_bitwise(out[:2], ref_q, "in-range tokens' q")
    assert_bitwise(out[2], poison(torch.empty_like(out[2]), 1), "skipped token's q")
    assert_bitwise(cache._storage, ref_cache._storage, "cache after skipped slots and positions")


def test_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("norope", gen)
    c = s.constants
    other = type(c)(**{**c.__dict__, "k_eps": 3e-4})  # constants no other test compiles
    epi = QKVEpilogue(other, s.attn.q_norm.weight, None)
    _, qkv = s.qkv(2)
    step = s.step(2)
    cache = s.cache(0)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            epi.run(qkv, step.positions, step.slots, cache.tensor)


def test_takes(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref", gen)
    _, qkv = s.qkv(4)
    step = s.step(4)
    cache = s.cache(0)
    e = s.epi
    assert e.takes(qkv, step.positions, step.slots, cache.tensor)
    assert e.takes(qkv, step.positions, step.slots, cache)  # a PagedKVCache too
    bad = [
        (qkv.float(), step.positions, step.slots, cache.tensor),
        (qkv[:, :-64].contiguous(), step.positions, step.slots, cache.tensor),
        (qkv, step.positions.int(), step.slots, cache.tensor),
        (qkv, step.positions, step.slots[:3], cache.tensor),
        (qkv, step.positions, step.slots, cache.tensor[:, :1].contiguous()),
        (qkv, step.positions, step.slots, cache.tensor.float()),
        (qkv.cpu(), step.positions, step.slots, cache.tensor),
    ]
    for args in bad:
        assert not e.takes(*args)
        with pytest.raises(ValueError):
            e(*args)
    with pytest.raises(ValueError, match="out must be"):
        e(qkv, step.positions, step.slots, cache.tensor, torch.empty((4, 63, 64), dtype=BF16, device="cuda"))
