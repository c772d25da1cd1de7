"""GPU tests of ``dspark_cute.QKVFront`` for m in {1, 2, 7, 16} (and 1 .. 16 in
the tile-boundary test):

(a) the epilogue bit for bit: the front's ``out`` and cache equal vLLM's
    fused QK-norm / RoPE / KV insert applied to the kernel's own BF16
    projection (``QKVFront.project``, the raw variant: the same main loop
    without the epilogue), both as dspark-core's spec computes it on CUDA
    (``qk_norm_rope``, ``kv_insert``) and as vLLM 0.33.0's stock kernel does
    (the carried binary, fixture ``stock``; where the q and k eps agree), so
    the v and o-gate rows equal the projection;
(b) the projection against a float64 ``x @ W^T`` within the bound stated in
    ``dspark_cute.cutedsl.gemm.skinny.config`` (``output_error_bound``),
    cuBLAS against float64 within the same bound, and the two against each
    other within the sum of both: the front sums its projection in its own
    order;
(c) against the spec's whole chain (the stock cuBLAS projection, then the
    fused epilogue): every head whose 64 projected values equal cuBLAS's bit
    for bit (most of them) has the chain's outputs and cache rows bit for
    bit;

negative slots leave the (poisoned) cache rows untouched, outputs and caches
are poisoned (a NaN pattern, then a finite one) before each launch, with a
scratch block past the cache that no insert may touch; graph replays give
the same bits; special values in x (the epilogue still bit for bit) and
weights planting special projected heads (zero, overflowing squares,
underflowing squares); several constants (1 to 32 KV heads, BF16/FP32/no
RoPE table, a q and a k eps, hidden sizes), main-loop shapes, row copies
and PDL off. Fresh seeded random data: the seed is printed (repeat with
DSPARK_SEED)."""

from __future__ import annotations

import functools

import pytest
import stock as stock_binaries
import torch
from cute_testing import (
    assert_replays_repeat,
    capture_calls,
    poison,
    qkv_epilogue_spec,
    qkv_epilogue_stock,
    random_rows,
    requires_cuda,
    special_rows,
)

from dspark_core.contracts.constants import HEAD_DIM, QKVFrontConstants
from dspark_core.spec.layers import Rotary, linear
from dspark_core.tools.compare import assert_bitwise, bits
from dspark_cute.cutedsl.gemm.skinny import config as sg

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture(scope="session")
def stock():
    """vLLM 0.33.0's stock kernels (``tests/stock.py``; skips without the binaries)."""
    return stock_binaries.stock_or_skip(sm90=False)

BF16 = torch.bfloat16
ROWS = [1, 2, 7, 16]
NUM_BLOCKS, BLOCK = 64, 16
MAX_POSITION = 4096
# name: (hidden size, q heads, KV heads, table "fp32"/"bf16"/None, q_eps, k_eps)
CASES = {
    "ref-fp32": (8192, 64, 8, "fp32", 1e-6, 1e-6),
    "kv32-bf16": (2048, 32, 32, "bf16", 1e-6, 1e-6),
    "kv1-norope": (2048, 8, 1, None, 1e-5, 1e-5),
    "kv2-bf16-two-eps": (2048, 8, 2, "bf16", 1e-5, 0.1),  # the spec alone: the stock takes one eps
}


@functools.cache
def rotary(table: str) -> Rotary:
    """The ``Rotary`` of ``table``'s dtype on CUDA (one per dtype)."""
    return Rotary(HEAD_DIM, MAX_POSITION, table_dtype=torch.float32 if table == "fp32" else BF16).cuda()


class Setup:
    """A case's constants, random weight (N(0, 1/H); q head 1 and k head 0
    rows zero, q head 2 rows times 2^100, q head 3 rows times 2^-100) and
    its fused front."""

    def __init__(self, case: str, gen: torch.Generator, **front_options):
        from dspark_cute.cutedsl.qkv.front import QKVFront

        self.hidden, self.nq, self.kv, table, self.q_eps, self.k_eps = CASES[case]
        self.gen = gen
        self.rotary = rotary(table) if table else None
        self.table = self.rotary.cos_sin if self.rotary is not None else None
        self.constants = QKVFrontConstants(hidden_size=self.hidden, num_heads=self.nq, kv_heads=self.kv,
                                           q_weight=False, q_eps=self.q_eps, k_eps=self.k_eps,
                                           rope=table is not None, table_dtype=table or "bf16")
        self.q_size, self.kv_size = self.nq * HEAD_DIM, self.kv * HEAD_DIM
        self.rows = 2 * self.q_size + 2 * self.kv_size
        w = torch.randn((self.rows, self.hidden), generator=gen, device="cuda") / self.hidden**0.5
        head = w.view(-1, HEAD_DIM, self.hidden)
        head[1] = 0.0  # a zero q head: S = 0
        head[self.nq] = 0.0  # a zero k head
        head[2] *= 2.0**100  # squares overflow: S = inf
        head[3] *= 2.0**-100  # squares underflow
        self.weight = w.to(BF16)
        # The front's defaults unless a test names its main-loop shape or PDL.
        self.front = QKVFront(self.constants, self.weight, None, self.table, **front_options)
        self.front.prepare(project=True)

    def step(self, m: int) -> tuple:
        """Random positions and distinct slots, some negative."""
        pos = torch.randint(0, MAX_POSITION, (m,), generator=self.gen, device="cuda")
        slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=self.gen, device="cuda")[:m].clone()
        if m >= 2:
            slots[0] = -1
        if m >= 7:
            slots[m - 2] = -7
        return pos, slots

    def x(self, m: int) -> torch.Tensor:
        return random_rows(self.gen, m, self.hidden, BF16, "cuda")

    def storage(self, which: int) -> torch.Tensor:
        """A cache storage of ``NUM_BLOCKS + 1`` blocks (the last a scratch
        block past the cache tensor ``storage[:NUM_BLOCKS]``), poisoned."""
        t = torch.empty((NUM_BLOCKS + 1, self.kv, BLOCK, 2 * HEAD_DIM), dtype=BF16, device="cuda")
        return poison(t, which)

    def spec(self, qkv: torch.Tensor, pos, slots, storage: torch.Tensor) -> None:
        """The spec's fused epilogue on CUDA, in place on the projection
        ``qkv`` and on ``storage[:NUM_BLOCKS]``."""
        qkv_epilogue_spec(self, qkv, pos, slots, storage[:NUM_BLOCKS])

    def stock(self, ops, qkv: torch.Tensor, pos, slots, storage: torch.Tensor) -> None:
        """vLLM's stock kernel, in place on ``qkv`` and ``storage[:NUM_BLOCKS]``."""
        qkv_epilogue_stock(self, ops, qkv, pos, slots, storage[:NUM_BLOCKS], BLOCK)


def check_epilogue(s: Setup, x: torch.Tensor, what: str, ops=None) -> torch.Tensor:
    """(a): out and cache bit for bit the spec's (and, with ``ops``, the
    stock kernel's) epilogue on the kernel's own projection, each output
    poisoned with both patterns first. Returns the projection."""
    m = x.shape[0]
    pos, slots = s.step(m)
    raw = torch.empty((m, s.rows), dtype=BF16, device="cuda")
    out = torch.empty_like(raw)
    for which in (0, 1):
        poison(raw, which)
        s.front.project(x, raw)
        poison(out, which)
        storage = s.storage(which)
        assert s.front.run(x, pos, slots, storage[:NUM_BLOCKS], out) is out
        exp_out, exp_storage = raw.clone(), s.storage(which)
        s.spec(exp_out, pos, slots, exp_storage)
        if ops is not None:
            st_out, st_storage = raw.clone(), s.storage(which)
            s.stock(ops, st_out, pos, slots, st_storage)
        torch.cuda.synchronize()
        assert_bitwise(out, exp_out, f"{what}: out vs the spec on its projection (poison {which})")
        assert_bitwise(storage, exp_storage, f"{what}: cache vs the spec (poison {which})")
        if ops is not None:
            assert_bitwise(out, st_out, f"{what}: out vs the stock kernel on its projection (poison {which})")
            assert_bitwise(storage, st_storage, f"{what}: cache vs the stock kernel (poison {which})")
        # (Rows of negative slots keep their poison in the expected caches: a
        # write anywhere other than the stock insert's shows.)
    # The allocating path and a second projection give the same bits.
    assert_bitwise(s.front.project(x), raw, f"{what}: projection repeat")
    check_chain(s, x, raw, out, pos, slots, what)
    return raw


def check_chain(s: Setup, x, raw, out, pos, slots, what: str) -> None:
    """(c): the heads whose projection equals cuBLAS's bit for bit have the
    spec chain's (cuBLAS, then the epilogue) outputs and cache rows."""
    m = x.shape[0]
    ref = linear(x, s.weight)
    exp, exp_storage = ref.clone(), s.storage(1)
    s.spec(exp, pos, slots, exp_storage)
    storage = s.storage(1)
    got = s.front.run(x, pos, slots, storage[:NUM_BLOCKS])
    torch.cuda.synchronize()
    same = (bits(raw).view(m, -1, HEAD_DIM) == bits(ref).view(m, -1, HEAD_DIM)).all(-1)  # [m, heads]
    heads = got.view(m, -1, HEAD_DIM)[same]
    assert_bitwise(heads, exp.view(m, -1, HEAD_DIM)[same], f"{what}: heads of equal projections vs the chain")
    k0, v0 = s.nq, s.nq + s.kv
    keep = slots >= 0
    for half, first in ((0, k0), (1, v0)):
        rows = same[:, first : first + s.kv] & keep[:, None]  # [m, kv]
        t, h = rows.nonzero(as_tuple=True)
        sl = slots[t]
        cols = slice(half * HEAD_DIM, (half + 1) * HEAD_DIM)
        assert_bitwise(storage[sl // BLOCK, h, sl % BLOCK, cols], exp_storage[sl // BLOCK, h, sl % BLOCK, cols],
                       f"{what}: cache rows of equal projections vs the chain ({'KV'[half]})")
    print(f"{what}: {int(same.sum())} of {same.numel()} heads project bit for bit as cuBLAS")


def check_bound(s: Setup, x: torch.Tensor, raw: torch.Tensor, what: str, rows=None) -> float:
    """(b): kernel and cuBLAS projections vs float64; returns the largest
    |err| / bound of the kernel."""
    w = s.weight
    rows = slice(None) if rows is None else rows
    x, raw = x[rows], raw[rows]
    y = x.double() @ w.double().t()
    k_warps = s.front.configs[1].k_warps
    ours = sg.output_error_bound(raw, x, w, k_warps)
    err = (raw.double() - y).abs()
    worst = float((err / ours).max())
    assert (err <= ours).all(), f"{what}: projection beyond the bound (max ratio {worst:.3g})"
    ref = linear(x, w)
    theirs = sg.output_error_bound(ref, x, w, k_warps)
    assert ((ref.double() - y).abs() <= theirs).all(), f"{what}: cuBLAS beyond the stated bound"
    assert ((raw.double() - ref.double()).abs() <= ours + theirs).all(), f"{what}: kernel vs cuBLAS"
    print(f"{what}: max |err| / bound = {worst:.3g}")
    return worst


@pytest.fixture
def ref_setup(seed):
    """The reference shape (H 8192, 64 heads, 8 KV heads, FP32 table),
    weights from the test's printed seed."""
    return Setup("ref-fp32", torch.Generator(device="cuda").manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", ROWS)
def test_cases(case, m, seed):
    """Every case against the spec: random x, then x of unit scale (the
    draft's normed inputs)."""
    s = Setup(case, torch.Generator(device="cuda").manual_seed(seed))
    x = s.x(m)
    raw = check_epilogue(s, x, f"{case} m={m}")
    check_bound(s, x, raw, f"{case} m={m}")
    x = torch.randn((m, s.hidden), generator=s.gen, device="cuda").to(BF16)
    raw = check_epilogue(s, x, f"{case} unit m={m}")
    check_bound(s, x, raw, f"{case} unit m={m}")


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[4] == v[5]])
@pytest.mark.parametrize("m", ROWS)
def test_cases_stock(case, m, seed, stock):
    """The epilogue against vLLM's stock kernel on the front's own projection."""
    s = Setup(case, torch.Generator(device="cuda").manual_seed(seed))
    check_epilogue(s, s.x(m), f"{case} m={m} stock", stock)


def test_every_row_count(ref_setup, seed, stock):
    """m = 1 .. 16 (both token tiles and their boundary): the epilogue bit
    for bit the stock kernel's on the front's projection."""
    s = ref_setup
    for m in range(1, 17):
        check_epilogue(s, s.x(m), f"m={m}", stock)


@pytest.mark.parametrize("k_warps,stages,pdl", [(8, 2, False)])
def test_main_loop_shape(k_warps, stages, pdl, seed):
    s = Setup("kv2-bf16-two-eps", torch.Generator(device="cuda").manual_seed(seed), k_warps=k_warps,
              stages=stages, pdl=pdl)
    assert s.front.pdl == pdl
    for m in (3, 16):
        x = s.x(m)
        raw = check_epilogue(s, x, f"kw{k_warps} st{stages} m={m}")
        check_bound(s, x, raw, f"kw{k_warps} st{stages} m={m}")


def test_row_copies_same_bits(seed):
    """Row copies (the warp's 128-byte row pieces) feed the same MMAs the
    same words as lane copies: the same raw projection and outputs, bit for
    bit, for both token tiles."""
    lane = Setup("kv1-norope", torch.Generator(device="cuda").manual_seed(seed))
    rows = Setup("kv1-norope", torch.Generator(device="cuda").manual_seed(seed), copy="rows")
    assert rows.front.configs[2].copy == "rows" and lane.front.configs[2].copy == "lane"
    assert torch.equal(bits(lane.weight), bits(rows.weight))
    for m in (1, 5, 16):
        x = lane.x(m)
        a = check_epilogue(lane, x, f"lane m={m}")
        b = check_epilogue(rows, x, f"rows m={m}")
        assert torch.equal(bits(a), bits(b)), f"m={m}: row copies changed the projection"


def test_special_values(ref_setup, seed, stock):
    """Rows of -0.0, subnormals, inf, -inf, NaN, huge and tiny values (plus
    random rows up to 16): the epilogue bit for bit on whatever the
    projection gives; the finite, non-overflowing rows within the bound."""
    s = ref_setup
    x = torch.cat([special_rows(s.hidden, BF16, "cuda"), s.x(6)])
    raw = check_epilogue(s, x, "special", stock)
    finite = [0, 1, 2, 6, 8, 9, 10, 11, 12, 13, 14, 15]
    check_bound(s, x, raw, "special", rows=finite)
    # A NaN in x makes every output of its row NaN; an infinity, NaN or inf
    # (the zero heads aside: 0 * inf is NaN).
    assert torch.isnan(raw[5]).all()
    assert (~torch.isfinite(raw[[3, 4]])).all()


def test_slots_beyond_the_cache_write_nothing(ref_setup, seed):
    s = ref_setup
    x = s.x(4)
    pos, _ = s.step(4)
    slots = torch.tensor([NUM_BLOCKS * BLOCK, NUM_BLOCKS * BLOCK + 17, -1, -2**40], device="cuda")
    storage = s.storage(1)
    before = storage.clone()
    s.front.run(x, pos, slots, storage[:NUM_BLOCKS])
    torch.cuda.synchronize()
    assert_bitwise(storage, before, "cache after out-of-range slots")


def test_cuda_graph(ref_setup, seed, stock):
    s = ref_setup
    m = 16
    x = s.x(m)
    pos, slots = s.step(m)
    out = torch.empty((m, s.rows), dtype=BF16, device="cuda")
    storage = s.storage(0)
    graph = capture_calls(lambda: s.front.run(x, pos, slots, storage[:NUM_BLOCKS], out))
    for _ in range(2):
        x.copy_(s.x(m))
        pos.copy_(s.step(m)[0])
        raw = s.front.project(x)
        for which in (0, 1):
            poison(out, which)
            poison(storage, which)
            graph.replay()
            exp_out, exp_storage = raw.clone(), s.storage(which)
            s.spec(exp_out, pos, slots, exp_storage)
            st_out, st_storage = raw.clone(), s.storage(which)
            s.stock(stock, st_out, pos, slots, st_storage)
            torch.cuda.synchronize()
            assert_bitwise(out, exp_out, f"graph replay out vs the spec (poison {which})")
            assert_bitwise(storage, exp_storage, f"graph replay cache vs the spec (poison {which})")
            assert_bitwise(out, st_out, f"graph replay out vs the stock (poison {which})")
            assert_bitwise(storage, st_storage, f"graph replay cache vs the stock (poison {which})")
        assert_replays_repeat(graph, [out, storage])


def test_positions_beyond_the_table_are_clamped(ref_setup, seed):
    s = ref_setup
    x = s.x(2)
    slots = torch.tensor([-1, -1], device="cuda")
    last = MAX_POSITION - 1
    a = s.front.run(x, torch.tensor([last, 0], device="cuda"), slots, s.storage(0)[:NUM_BLOCKS])
    b = s.front.run(x, torch.tensor([last + 100, -3], device="cuda"), slots, s.storage(0)[:NUM_BLOCKS])
    torch.cuda.synchronize()
    assert_bitwise(b, a, "clamped positions")


def test_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.qkv.front import QKVFront

    s = Setup("kv1-norope", torch.Generator(device="cuda").manual_seed(seed))
    c = s.constants
    other = type(c)(**{**c.__dict__, "k_eps": 3e-4})  # constants no other test compiles
    front = QKVFront(other, s.weight, None, None)
    x = s.x(2)
    pos, slots = s.step(2)
    storage = s.storage(0)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            front.run(x, pos, slots, storage[:NUM_BLOCKS])


def test_refuses_bad_operands(ref_setup, seed):
    s = ref_setup
    h = s.hidden
    x = s.x(4)
    pos, slots = s.step(4)
    cache = s.storage(0)[:NUM_BLOCKS]
    f = s.front
    assert f.takes(x, pos, slots, cache)
    bad = [
        (x.float(), pos, slots, cache),
        (s.x(17), pos, slots, cache),  # too many rows
        (x[:, : h // 2].contiguous(), pos, slots, cache),
        (x.flatten()[4 : 4 + 3 * h].view(3, h), pos[:3], slots[:3], cache),  # 8-byte aligned only
        (x, pos.int(), slots, cache),
        (x, pos, slots[:3], cache),
        (x, pos, slots, cache[:, :1].contiguous()),  # wrong KV heads
        (x, pos, slots, cache.float()),
        (x.cpu(), pos, slots, cache),
    ]
    for args in bad:
        assert not f.takes(*args)
        with pytest.raises(ValueError):
            f.run(*args)
    with pytest.raises(ValueError):
        f.run(x, pos, slots, cache, torch.empty((4, f.rows - 64), dtype=BF16, device="cuda"))
