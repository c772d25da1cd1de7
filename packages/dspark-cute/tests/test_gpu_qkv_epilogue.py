"""GPU tests of ``dspark_cute.cutedsl.qkv.epilogue.QKVEpilogue``, bit for bit
against dspark-core's spec run on CUDA (``spec.layers.qk_norm_rope`` on the
q and k heads, ``kv_insert``: what ``DraftAttention.front_from`` computes)
and against vLLM 0.33.0's own ``fused_muse_spark_qknorm_rope_kv_insert``
(the carried stock binary, fixture ``stock``; skipped without it) on the
same operands, each in place on its own copy of ``qkv``.

Compared bit for bit (NaN payloads aside): every row of ``qkv`` after the
call (q and k rows normed and rotated; v and o-gate rows untouched) and the
whole cache allocation, poisoned first with a NaN pattern and then a finite
one, with a scratch block past the cache tensor that no insert may touch;
the cache in each physical order of ``cute_testing.CACHE_LAYOUTS`` (LBHNC
contiguous; LBNHC, vLLM's default on sm_90, and BLNHC, another layer's rows
between the blocks, through their strides), the same logical places
written as the spec's and the stock's inserts write;
the returned q is the view of ``qkv``'s q rows. For m in {1, 2, 7, 16, 133};
RoPE with the FP32 table (every layer but the first), the BF16 table (layer
0 in decode) and none; 1 to 32 KV heads (powers of two); eps 0 and a q eps
other than the k eps (spec only: the stock takes one eps); qkv without the
o-gate rows; random rows and rows of special values (-0.0, subnormals, +-inf,
NaN, near-overflow, squares that overflow and underflow, a zero head with
eps 0); negative slots skipped; each of the kernel's two grids forced (per-token,
flat) and the host's choice by row count (m = 256, 257, 512 of the
reference draft, with the grid it launched); PDL on and off; CUDA graph
replays; the host's refusal of 2^31 heads or slots; the
host's ValueErrors for out-of-range positions and slots outside capture and
the kernel's skips inside it. Fresh seeded random data: the seed is printed
(repeat with DSPARK_SEED)."""

from __future__ import annotations

import functools

import pytest
import stock as stock_binaries
import torch
from cute_testing import (
    CACHE_LAYOUTS,
    assert_replays_repeat,
    capture_calls,
    layout_cache,
    poison,
    qkv_epilogue_spec,
    qkv_epilogue_stock,
    random_rows,
    requires_cuda,
    special_rows,
    whole,
)

from dspark_core.contracts.constants import HEAD_DIM, QKVEpilogueConstants
from dspark_core.spec.layers import Rotary
from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture(scope="session")
def stock():
    """vLLM 0.33.0's stock kernels (``tests/stock.py``; skips without the binaries)."""
    return stock_binaries.stock_or_skip(sm90=False)

BF16 = torch.bfloat16
ROWS = [1, 2, 7, 16, 133]
NUM_BLOCKS, BLOCK = 72, 16
# The kernel's grids, forced through the host's threshold of (token, head)
# pairs above which it launches the flat one ("auto": the host's choice).
GRIDS = {"per-token": 2**31, "flat": -1}
MAX_POSITION = 4096
# name: (q heads, KV heads, table "fp32"/"bf16"/None, q_eps, k_eps, o-gate rows)
CASES = {
    "ref-fp32": (64, 8, "fp32", 1e-6, 1e-6, True),
    "ref-bf16": (64, 8, "bf16", 1e-6, 1e-6, True),
    "ref-norope": (64, 8, None, 1e-6, 1e-6, True),
    "kv1-fp32": (8, 1, "fp32", 1e-6, 1e-6, True),
    "kv2-bf16": (4, 2, "bf16", 1e-5, 1e-5, True),
    "kv4-norope": (32, 4, None, 1e-6, 1e-6, True),
    "kv16-fp32": (16, 16, "fp32", 1e-6, 1e-6, True),
    "kv32-bf16": (64, 32, "bf16", 1e-6, 1e-6, True),
    "eps0-fp32": (8, 2, "fp32", 0.0, 0.0, True),
    "no-ogate-fp32": (64, 8, "fp32", 1e-6, 1e-6, False),
    "two-eps-bf16": (16, 4, "bf16", 1e-5, 0.1, True),  # the spec alone: the stock takes one eps
}


@functools.cache
def rotary(table: str) -> Rotary:
    """The ``Rotary`` of ``table``'s dtype on CUDA (one per dtype)."""
    return Rotary(HEAD_DIM, MAX_POSITION, table_dtype=torch.float32 if table == "fp32" else BF16).cuda()


class Setup:
    """One case: its constants, table and epilogue; operands and the two references."""

    def __init__(self, case: str, pdl=None, layout: str = "LBHNC", grid: str = "auto"):
        from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

        self.layout = layout
        self.nq, self.kv, table, self.q_eps, self.k_eps, self.ogate = CASES[case]
        self.rotary = rotary(table) if table else None
        self.constants = QKVEpilogueConstants(hidden_size=8192, num_heads=self.nq, kv_heads=self.kv, q_weight=False,
                                           q_eps=self.q_eps, k_eps=self.k_eps, rope=table is not None,
                                           table_dtype=table or "bf16")
        self.table = self.rotary.cos_sin if self.rotary is not None else None
        self.epi = QKVEpilogue(self.constants, None, self.table, pdl=pdl)
        self.epi.flat_above = GRIDS[grid] if grid in GRIDS else self.epi.flat_above
        self.epi.prepare()
        self.q_size, self.kv_size = self.nq * HEAD_DIM, self.kv * HEAD_DIM
        self.rows = 2 * self.q_size + 2 * self.kv_size if self.ogate else self.q_size + 2 * self.kv_size

    def step(self, m: int, gen) -> tuple:
        """Random positions and distinct slots, some negative."""
        pos = torch.randint(0, MAX_POSITION, (m,), generator=gen, device="cuda")
        slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen, device="cuda")[:m].clone()
        if m >= 2:
            slots[0] = -1
        if m >= 7:
            slots[m - 2] = -7
        return pos, slots

    def qkv(self, m: int, gen, special: bool = False) -> torch.Tensor:
        """Random rows; with ``special``, special heads in token 0 and rows of
        special values (``cute_testing.special_rows``) in tokens 1 .. 9."""
        qkv = random_rows(gen, m, self.rows, BF16, "cuda")
        if special:
            heads = qkv[0, : self.q_size + 2 * self.kv_size].view(-1, HEAD_DIM)
            tiny = torch.tensor(1, dtype=torch.int16, device="cuda").view(BF16)  # the smallest subnormal
            big = torch.finfo(BF16).max
            plants = [
                lambda h: h.fill_(-0.0),
                lambda h: h.fill_(0.0),  # S = 0: r = rsqrt(eps) (inf with eps 0: 0 * inf = NaN)
                lambda h: h.copy_(tiny.expand(HEAD_DIM)),  # squares underflow to 0
                lambda h: h.fill_(big),  # squares overflow: S = inf, r = 0
                lambda h: h.__setitem__(slice(0, HEAD_DIM, 7), float("inf")),
                lambda h: h.__setitem__(11, float("-inf")),
                lambda h: h.__setitem__(33, float("nan")),
                # Squares that are FP32 subnormals (2^-128, 2^-140).
                lambda h: h.copy_(torch.where(torch.arange(HEAD_DIM, device="cuda") % 2 == 0, 2.0**-64,
                                              -(2.0**-70)).to(BF16)),
                lambda h: h.fill_(2.0**-64),  # S = 2^-122: v = 2^-128, a subnormal, where eps is 0
            ]
            for i, plant in enumerate(plants):
                for start in (0, self.nq, self.nq + self.kv):  # a q, a k and a v head
                    if start + i < heads.shape[0]:
                        plant(heads[start + i])
            n = min(m, 10) - 1
            if n > 0:
                qkv[1 : 1 + n] = special_rows(self.rows, BF16, "cuda")[:n]
        return qkv

    def storage(self, which: int) -> torch.Tensor:
        """A cache storage of ``NUM_BLOCKS + 1`` blocks (the last a scratch
        block past the cache tensor ``storage[:NUM_BLOCKS]``) in the setup's
        layout, its whole allocation poisoned (``whole(storage)``)."""
        t = layout_cache(self.layout, NUM_BLOCKS + 1, self.kv, BLOCK)
        poison(whole(t), which)
        return t

    def spec(self, qkv: torch.Tensor, pos, slots, storage: torch.Tensor) -> None:
        """The spec on CUDA, in place on ``qkv`` and ``storage[:NUM_BLOCKS]``."""
        qkv_epilogue_spec(self, qkv, pos, slots, storage[:NUM_BLOCKS])

    def stock(self, ops, qkv: torch.Tensor, pos, slots, storage: torch.Tensor) -> None:
        """vLLM's stock kernel, in place on ``qkv`` and ``storage[:NUM_BLOCKS]``."""
        qkv_epilogue_stock(self, ops, qkv, pos, slots, storage[:NUM_BLOCKS], BLOCK)


def check(s: Setup, qkv0: torch.Tensor, pos, slots, what: str, ops=None) -> None:
    """The epilogue on a copy of ``qkv0`` against the spec (and, with
    ``ops``, the stock) on copies of it, for both cache poisons."""
    m = qkv0.shape[0]
    for which in (0, 1):
        qkv, storage = qkv0.clone(), s.storage(which)
        q = s.epi.run(qkv, pos, slots, storage[:NUM_BLOCKS])
        exp_qkv, exp_storage = qkv0.clone(), s.storage(which)
        s.spec(exp_qkv, pos, slots, exp_storage)
        if ops is not None:
            st_qkv, st_storage = qkv0.clone(), s.storage(which)
            s.stock(ops, st_qkv, pos, slots, st_storage)
        torch.cuda.synchronize()
        assert q.shape == (m, s.nq, HEAD_DIM) and q.data_ptr() == qkv.data_ptr()
        assert q.stride()[1:] == (HEAD_DIM, 1) and (m == 1 or q.stride(0) == s.rows), "not the view of the q rows"
        assert_bitwise(q, exp_qkv[:, : s.q_size].reshape(m, s.nq, HEAD_DIM), f"{what}: q (poison {which})")
        rest = s.q_size + s.kv_size
        assert_bitwise(qkv[:, rest:], qkv0[:, rest:], f"{what}: v and o-gate rows untouched (poison {which})")
        assert_bitwise(qkv, exp_qkv, f"{what}: qkv vs the spec (poison {which})")
        assert_bitwise(whole(storage), whole(exp_storage), f"{what}: cache vs the spec (poison {which})")
        if ops is not None:
            assert_bitwise(qkv, st_qkv, f"{what}: qkv vs the stock kernel (poison {which})")
            assert_bitwise(whole(storage), whole(st_storage), f"{what}: cache vs the stock kernel (poison {which})")
            assert_bitwise(st_qkv, exp_qkv, f"{what}: the stock kernel vs the spec (poison {which})")


STOCK_CASES = [case for case, c in CASES.items() if c[3] == c[4]]


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", ROWS)
def test_matches_spec(case, m, layout, grid, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup(case, layout=layout, grid=grid)
    pos, slots = s.step(m, gen)
    check(s, s.qkv(m, gen), pos, slots, f"{case} m={m} random")
    check(s, s.qkv(m, gen, special=True), pos, slots, f"{case} m={m} special")


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("case", STOCK_CASES)
@pytest.mark.parametrize("m", ROWS)
def test_matches_stock(case, m, layout, grid, seed, stock):
    """The same operands through vLLM's stock kernel too (and the spec), the
    cache in each layout (the stock takes its block, token and head strides)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup(case, layout=layout, grid=grid)
    pos, slots = s.step(m, gen)
    check(s, s.qkv(m, gen), pos, slots, f"{case} m={m} random", stock)
    check(s, s.qkv(m, gen, special=True), pos, slots, f"{case} m={m} special", stock)


@pytest.mark.parametrize("case", ["ref-fp32", "ref-bf16", "eps0-fp32"])
def test_pdl_off(case, seed, stock):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup(case, pdl=False, layout="LBNHC")
    assert not s.epi.pdl
    for m in (1, 16, 133):
        pos, slots = s.step(m, gen)
        check(s, s.qkv(m, gen, special=True), pos, slots, f"{case} pdl off m={m}", stock)


@pytest.mark.parametrize("m", [256, 257, 512])
def test_host_grid_by_rows(m, seed, monkeypatch):
    """The host launches the per-token grid up to ``FLAT_ABOVE`` (token,
    head) pairs and the flat one above (the reference draft's 80 heads:
    flat above 256 tokens), either bit for bit the spec's (each grid
    against the stock: ``test_matches_stock``); the cache in vLLM's default
    layout, a negative slot."""
    from dspark_cute.cutedsl.qkv import epilogue as qe

    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref-fp32", layout="LBNHC")
    assert s.epi.flat_above == qe.FLAT_ABOVE == 256 * 80
    launched = []
    real = qe.compile_qkv_epilogue
    monkeypatch.setattr(qe, "compile_qkv_epilogue",
                        lambda c, pdl, flat=False: launched.append(flat) or real(c, pdl, flat))
    pos = torch.randint(0, MAX_POSITION, (m,), generator=gen, device="cuda")
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen, device="cuda")[:m].clone()
    slots[m // 2] = -1
    check(s, s.qkv(m, gen, special=True), pos, slots, f"host grid m={m}")
    assert launched and set(launched) == {m > 256}, launched


def test_refuses_2_31_heads_or_slots(seed):
    """``m * heads`` of 2^31 or more (the flat grid's 32-bit index) and a
    cache of 2^31 slots or more (the 32-bit slot division): refused with
    the reason (views over small allocations, no kernel launched)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref-fp32")
    qkv = s.qkv(2, gen)
    pos, slots = s.step(2, gen)
    cache = s.storage(0)[:NUM_BLOCKS]
    assert s.epi.takes(qkv, pos, slots, cache)
    big = cache[:1].expand(2**31 // BLOCK, -1, -1, -1)
    assert "2^31 slots" in s.epi.problem(qkv, pos, slots, big)
    m = -(-(2**31) // (s.nq + 2 * s.kv))
    wide = torch.empty(1, s.rows, dtype=BF16, device="cuda").expand(m, -1)
    many = torch.zeros(1, dtype=torch.int64, device="cuda").expand(m)
    assert "2^31 heads" in s.epi.problem(wide, many, many, cache)
    with pytest.raises(ValueError, match="2\\^31 heads"):
        s.epi.run(wide, many, many, cache)


def test_host_raises_out_of_range(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref-fp32")
    qkv0 = s.qkv(4, gen)
    pos, slots = s.step(4, gen)
    storage = s.storage(1)
    before = whole(storage).clone()
    bad = [
        (pos.clone().fill_(MAX_POSITION), slots, "RoPE positions"),
        (pos.clone().fill_(-1), slots, "RoPE positions"),
        (pos, torch.tensor([1, 2, NUM_BLOCKS * BLOCK, -1], device="cuda"), "beyond the cache"),
        (pos, torch.tensor([5, 5, 6, -1], device="cuda"), "distinct slots"),
    ]
    qkv = qkv0.clone()
    for p, sl, match in bad:
        with pytest.raises(ValueError, match=match):
            s.epi.run(qkv, p, sl, storage[:NUM_BLOCKS])
    buf = torch.empty(qkv.numel() + 8, dtype=BF16, device="cuda")
    shifted = buf[4 : 4 + qkv.numel()].view(qkv.shape)  # 8-byte aligned only
    with pytest.raises(ValueError, match="16-byte aligned"):
        s.epi.run(shifted, pos, slots, storage[:NUM_BLOCKS])
    torch.cuda.synchronize()
    assert_bitwise(whole(storage), before, "cache after refused calls")
    assert_bitwise(qkv, qkv0, "qkv after refused calls")


def graph_replays(s: Setup, gen, ops=None) -> None:
    """A captured epilogue (each call on a fresh copy of the projection, as
    the draft's projection rewrites it every step) replays bit for bit the
    spec (and, with ``ops``, the stock) on new projections and positions."""
    m = 16
    src, qkv = s.qkv(m, gen), torch.empty((m, s.rows), dtype=BF16, device="cuda")
    pos, slots = s.step(m, gen)
    storage = s.storage(0)

    def call():
        qkv.copy_(src)
        s.epi.run(qkv, pos, slots, storage[:NUM_BLOCKS])

    graph = capture_calls(call)
    for special in (False, True):
        src.copy_(s.qkv(m, gen, special))
        pos.copy_(s.step(m, gen)[0])
        for which in (0, 1):
            poison(whole(storage), which)
            graph.replay()
            exp_qkv, exp_storage = src.clone(), s.storage(which)
            s.spec(exp_qkv, pos, slots, exp_storage)
            if ops is not None:
                st_qkv, st_storage = src.clone(), s.storage(which)
                s.stock(ops, st_qkv, pos, slots, st_storage)
            torch.cuda.synchronize()
            assert_bitwise(qkv, exp_qkv, f"graph replay qkv vs the spec (poison {which})")
            assert_bitwise(whole(storage), whole(exp_storage), f"graph replay cache vs the spec (poison {which})")
            if ops is not None:
                assert_bitwise(qkv, st_qkv, f"graph replay qkv vs the stock (poison {which})")
                assert_bitwise(whole(storage), whole(st_storage), f"graph replay cache vs the stock (poison {which})")
        assert_replays_repeat(graph, [qkv, whole(storage)])


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_cuda_graph(layout, grid, seed):
    graph_replays(Setup("ref-fp32", layout=layout, grid=grid), torch.Generator(device="cuda").manual_seed(seed))


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_cuda_graph_stock(layout, seed, stock):
    graph_replays(Setup("ref-bf16", layout=layout), torch.Generator(device="cuda").manual_seed(seed), stock)


@pytest.mark.parametrize("grid", list(GRIDS))
def test_capture_skips_out_of_range(grid, seed):
    """Inside capture nothing is read on the host: the kernel skips a slot
    beyond the cache (token 1) and a token whose position lies outside the
    table (token 2: neither its q and k rows nor its K/V written); the cache
    in vLLM's default layout (LBNHC)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref-fp32", layout="LBNHC", grid=grid)
    qkv0 = s.qkv(3, gen)
    pos = torch.tensor([3, 4, MAX_POSITION + 5], device="cuda")
    slots = torch.tensor([10, NUM_BLOCKS * BLOCK + 3, 20], device="cuda")
    storage = s.storage(1)
    qkv = qkv0.clone()
    with pytest.raises(ValueError):  # outside capture the host reads and refuses them
        s.epi.run(qkv, pos, slots, storage[:NUM_BLOCKS])
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        s.epi.run(qkv, pos, slots, storage[:NUM_BLOCKS])  # no host reads inside capture
    torch.cuda.synchronize()
    qkv.copy_(qkv0)
    poison(whole(storage), 1)
    graph.replay()
    torch.cuda.synchronize()
    exp_qkv, exp_storage = qkv0[:2].clone(), s.storage(1)
    s.spec(exp_qkv, pos[:2], torch.tensor([10, -1], device="cuda"), exp_storage)
    assert_bitwise(qkv[:2], exp_qkv, "in-range tokens")
    assert_bitwise(qkv[2], qkv0[2], "the skipped token's rows")
    assert_bitwise(whole(storage), whole(exp_storage), "cache after skipped slots and positions")


def test_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("kv4-norope")
    c = s.constants
    other = type(c)(**{**c.__dict__, "k_eps": 3e-4})  # constants no other test compiles
    epi = QKVEpilogue(other, None, None)
    qkv = s.qkv(2, gen)
    pos, slots = s.step(2, gen)
    storage = s.storage(0)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            epi.run(qkv, pos, slots, storage[:NUM_BLOCKS])


def test_takes(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("ref-fp32")
    qkv = s.qkv(4, gen)
    pos, slots = s.step(4, gen)
    cache = s.storage(0)[:NUM_BLOCKS]
    e = s.epi
    assert e.takes(qkv, pos, slots, cache)
    assert e.takes(qkv[:, : s.q_size + 2 * s.kv_size].contiguous(), pos, slots, cache)  # no o-gate rows
    for layout in CACHE_LAYOUTS:  # through the strides
        assert e.takes(qkv, pos, slots, layout_cache(layout, NUM_BLOCKS, s.kv, BLOCK))
    row = 2 * HEAD_DIM
    flat = torch.empty(NUM_BLOCKS * s.kv * BLOCK * row * 2, dtype=BF16, device="cuda")
    bad_caches = [
        # K|V not contiguous in the last dim
        torch.empty((NUM_BLOCKS, s.kv, row, BLOCK), dtype=BF16, device="cuda").transpose(2, 3),
        # a token stride of 132 elements (264 bytes): rows not 16-byte aligned
        flat.as_strided((NUM_BLOCKS, s.kv, BLOCK, row), (s.kv * BLOCK * 132, BLOCK * 132, 132, 1)),
        # every head on one row (stride 0): rows overlap
        flat.as_strided((NUM_BLOCKS, s.kv, BLOCK, row), (s.kv * BLOCK * row, 0, row, 1)),
        flat[4 : 4 + NUM_BLOCKS * s.kv * BLOCK * row].view(NUM_BLOCKS, s.kv, BLOCK, row),  # 8-byte aligned
    ]
    bad = [*[(qkv, pos, slots, c) for c in bad_caches],
        (qkv.float(), pos, slots, cache),
        (qkv[:, :-64].contiguous(), pos, slots, cache),
        (qkv[:, :-64], pos, slots, cache),  # strided
        (qkv, pos.int(), slots, cache),
        (qkv, pos, slots[:3], cache),
        (qkv, pos, slots, cache[:, :1].contiguous()),
        (qkv, pos, slots, cache.float()),
        (qkv.cpu(), pos, slots, cache),
    ]
    for args in bad:
        assert not e.takes(*args)
        with pytest.raises(ValueError):
            e.run(*args)
