"""GPU tests of ``dspark_cute.QKVFront`` against the stock
``DraftAttention.front`` chain (``dspark_core``), for m in {1, 2, 7, 16}:

(a) the epilogue bit for bit: the front's ``out`` and cache equal the stock
    q-norm, k-norm, RoPE and ``kv_insert`` applied to the kernel's own BF16
    projection (``QKVFront.project``, the raw variant: the same main loop
    without the epilogue); so the v and o-gate rows equal the projection;
(b) the projection against a float64 ``x @ W^T`` within the bound stated in
    ``dspark_cute.cutedsl.gemm.skinny.config`` (``output_error_bound``), cuBLAS against
    float64 within the same bound, and the two against each other within the
    sum of both;

negative slots leave the (poisoned) cache rows untouched, outputs are
poisoned (a NaN pattern, then a finite one) before each launch, graph
replays give the same bits, special values in x (the epilogue still bit for
bit), several constants (q-norm weight or not, BF16/FP32/no RoPE table, head
counts, hidden sizes), main-loop shapes and PDL off. Fresh seeded random data:
the seed is printed (repeat with DSPARK_SEED)."""

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

from dspark_core.contracts.constants import qkv_front_constants
from dspark_core.reference.config import DraftConfig
from dspark_core.spec.layers import kv_insert, linear
from dspark_core.tools.compare import assert_bitwise
from dspark_cute.cutedsl.gemm.skinny import config as sg

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
ROWS = [1, 2, 7, 16]
NUM_BLOCKS, BLOCK = 64, 16
# name: DraftConfig changes
CASES = {
    "ref": {},
    "small-noqw-fp32": dict(hidden_size=2048, num_heads=8, num_kv_heads=1, q_norm_weight=False,
                            rope_table_dtype="fp32", head_norm_eps=1e-5, max_position=512),
    "norope": dict(hidden_size=4096, num_heads=4, num_kv_heads=2, use_rope=False),
}


class Setup:
    """A stock attention on CUDA with random weights and its fused front."""

    def __init__(self, case: str, gen: torch.Generator, **front_options):
        from dspark_cute.cutedsl.qkv.front import QKVFront

        cfg = DraftConfig(**CASES[case])
        attn, self.table = stock_attention(cfg, gen)
        self.cfg, self.attn, self.gen = cfg, attn, gen
        self.constants = qkv_front_constants(attn)
        # The front's defaults unless a test names its main-loop shape or PDL.
        self.front = QKVFront(self.constants, attn.qkv_proj, attn.q_norm.weight, self.table, **front_options)
        self.front.prepare(project=True)

    def step(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random positions and distinct slots, some negative."""
        pos = torch.randint(0, self.cfg.max_position, (m,), generator=self.gen, device="cuda")
        slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=self.gen, device="cuda")[:m].clone()
        if m >= 2:
            slots[0] = -1
        if m >= 7:
            slots[m - 2] = -7
        return pos, slots

    def cache(self) -> torch.Tensor:
        return torch.empty((NUM_BLOCKS, self.cfg.num_kv_heads, BLOCK, 128), dtype=BF16, device="cuda")

    def expected(self, raw: torch.Tensor, pos, slots, cache: torch.Tensor):
        """The stock chain (``DraftAttention.front`` after its projection)
        on the projection ``raw``: ``(out, cache after the insert)``."""
        attn = self.attn
        q, k, v, og = attn.split_qkv(raw)
        q, k = attn.q_norm(q), attn.k_norm(k)
        if attn.rotary is not None:
            q, k = attn.rotary(q, pos), attn.rotary(k, pos)
        cache = cache.clone()
        kv_insert(cache, k, v, slots)
        m = raw.shape[0]
        return torch.cat([t.reshape(m, -1) for t in (q, k, v, og)], dim=1), cache


def check_epilogue(s: Setup, x: torch.Tensor, what: str) -> torch.Tensor:
    """(a): out and cache bit for bit the stock chain on the kernel's own
    projection, each output poisoned with both patterns first. Returns the
    projection."""
    m = x.shape[0]
    pos, slots = s.step(m)
    raw = torch.empty((m, s.front.rows), dtype=BF16, device="cuda")
    out = torch.empty_like(raw)
    cache = s.cache()
    for which in (0, 1):
        poison(raw, which)
        s.front.project(x, raw)
        poison(out, which)
        poison(cache, which)
        exp_out, exp_cache = s.expected(raw, pos, slots, cache)
        s.front.run(x, pos, slots, cache, out)
        torch.cuda.synchronize()
        assert_bitwise(out, exp_out, f"{what} out (poison {which})")
        assert_bitwise(cache, exp_cache, f"{what} cache (poison {which})")
        # (Rows of negative slots keep their poison in exp_cache: a write
        # anywhere in the cache other than the stock insert's shows.)
    # The allocating path and a second projection give the same bits.
    assert_bitwise(s.front.project(x), raw, f"{what} projection repeat")
    return raw


def check_bound(s: Setup, x: torch.Tensor, raw: torch.Tensor, what: str, rows=None) -> float:
    """(b): kernel and cuBLAS projections vs float64; returns the largest
    |err| / bound of the kernel."""
    w = s.attn.qkv_proj
    rows = slice(None) if rows is None else rows
    x, raw = x[rows], raw[rows]
    y = x.double() @ w.double().t()
    ours = sg.output_error_bound(raw, x, w, s.front.configs[1].k_warps)
    err = (raw.double() - y).abs()
    worst = float((err / ours).max())
    assert (err <= ours).all(), f"{what}: projection beyond the bound (max ratio {worst:.3g})"
    ref = linear(x, w)
    theirs = sg.output_error_bound(ref, x, w, s.front.configs[1].k_warps)
    assert ((ref.double() - y).abs() <= theirs).all(), f"{what}: cuBLAS beyond the stated bound"
    assert ((raw.double() - ref.double()).abs() <= ours + theirs).all(), f"{what}: kernel vs cuBLAS"
    print(f"{what}: max |err| / bound = {worst:.3g}")
    return worst


@pytest.fixture
def ref_setup(seed):
    """The reference shape (H 8192, 64 heads, 8 KV heads), weights from the
    test's printed seed."""
    return Setup("ref", torch.Generator(device="cuda").manual_seed(seed))


@pytest.mark.parametrize("m", ROWS)
def test_reference_shape(ref_setup, m, seed):
    s = ref_setup
    x = random_rows(s.gen, m, s.cfg.hidden_size, BF16, "cuda")
    raw = check_epilogue(s, x, f"ref m={m}")
    check_bound(s, x, raw, f"ref m={m}")


@pytest.mark.parametrize("m", ROWS)
def test_unit_scale_data(ref_setup, m, seed):
    """x of unit scale (the draft's normed inputs): bound and epilogue."""
    s = ref_setup
    x = torch.randn((m, s.cfg.hidden_size), generator=s.gen, device="cuda").to(BF16)
    raw = check_epilogue(s, x, f"unit m={m}")
    check_bound(s, x, raw, f"unit m={m}")


@pytest.mark.parametrize("case", ["small-noqw-fp32", "norope"])
@pytest.mark.parametrize("m", ROWS)
def test_other_constants(case, m, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup(case, gen)
    x = random_rows(gen, m, s.cfg.hidden_size, BF16, "cuda")
    raw = check_epilogue(s, x, f"{case} m={m}")
    check_bound(s, x, raw, f"{case} m={m}")


@pytest.mark.parametrize("k_warps,stages,pdl", [(8, 2, True), (4, 4, False)])
def test_main_loop_shapes(k_warps, stages, pdl, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("small-noqw-fp32", gen, k_warps=k_warps, stages=stages, pdl=pdl)
    for m in (3, 16):
        x = random_rows(gen, m, s.cfg.hidden_size, BF16, "cuda")
        raw = check_epilogue(s, x, f"kw{k_warps} st{stages} m={m}")
        check_bound(s, x, raw, f"kw{k_warps} st{stages} m={m}")


def test_row_copies_same_bits(seed):
    """Row copies (the warp's 128-byte row pieces) feed the same MMAs the
    same words as lane copies: the same raw projection and outputs, bit for
    bit, for both token tiles."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lane = Setup("small-noqw-fp32", gen, k_warps=4, stages=4)
    rows = Setup("small-noqw-fp32", torch.Generator(device="cuda").manual_seed(seed), k_warps=4, stages=4,
                 copy="rows")
    assert rows.front.configs[2].copy == "rows" and lane.front.configs[2].copy == "lane"
    for m in (1, 5, 16):
        x = random_rows(gen, m, lane.cfg.hidden_size, BF16, "cuda")
        a = check_epilogue(lane, x, f"lane m={m}")
        b = check_epilogue(rows, x, f"rows m={m}")
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"m={m}: row copies changed the projection"


def test_special_values(ref_setup, seed):
    """Rows of -0.0, subnormals, inf, -inf, NaN, huge and tiny values (plus
    random rows up to 16): the epilogue bit for bit on whatever the
    projection gives; the finite, non-overflowing rows within the bound."""
    s = ref_setup
    h = s.cfg.hidden_size
    x = torch.cat([special_rows(h, BF16, "cuda"), random_rows(s.gen, 6, h, BF16, "cuda")])
    raw = check_epilogue(s, x, "special")
    finite = [0, 1, 2, 6, 8, 9, 10, 11, 12, 13, 14, 15]
    check_bound(s, x, raw, "special", rows=finite)
    # A NaN in x makes every output of its row NaN; an infinity, NaN or inf.
    assert torch.isnan(raw[5]).all()
    assert (~torch.isfinite(raw[[3, 4]])).all()


def test_slots_beyond_the_cache_write_nothing(ref_setup, seed):
    s = ref_setup
    x = random_rows(s.gen, 4, s.cfg.hidden_size, BF16, "cuda")
    pos, _ = s.step(4)
    slots = torch.tensor([NUM_BLOCKS * BLOCK, NUM_BLOCKS * BLOCK + 17, -1, -2**40], device="cuda")
    cache = poison(s.cache(), 1)
    before = cache.clone()
    s.front.run(x, pos, slots, cache)
    torch.cuda.synchronize()
    assert_bitwise(cache, before, "cache after out-of-range slots")


def test_cuda_graph(ref_setup, seed):
    s = ref_setup
    m = 16
    x = random_rows(s.gen, m, s.cfg.hidden_size, BF16, "cuda")
    pos, slots = s.step(m)
    out = torch.empty((m, s.front.rows), dtype=BF16, device="cuda")
    cache = s.cache()
    graph = capture_calls(lambda: s.front.run(x, pos, slots, cache, out))
    for _ in range(2):
        x.copy_(random_rows(s.gen, m, s.cfg.hidden_size, BF16, "cuda"))
        pos.copy_(s.step(m)[0])
        raw = s.front.project(x)
        for which in (0, 1):
            poison(out, which)
            poison(cache, which)
            exp_out, exp_cache = s.expected(raw, pos, slots, cache)
            graph.replay()
            torch.cuda.synchronize()
            assert_bitwise(out, exp_out, f"graph replay out (poison {which})")
            assert_bitwise(cache, exp_cache, f"graph replay cache (poison {which})")
        assert_replays_repeat(graph, [out])


def test_positions_beyond_the_table_are_clamped(ref_setup, seed):
    s = ref_setup
    x = random_rows(s.gen, 2, s.cfg.hidden_size, BF16, "cuda")
    slots = torch.tensor([-1, -1], device="cuda")
    last = s.cfg.max_position - 1
    a = s.front.run(x, torch.tensor([last, 0], device="cuda"), slots, s.cache())
    b = s.front.run(x, torch.tensor([last + 100, -3], device="cuda"), slots, s.cache())
    assert_bitwise(b, a, "clamped positions")


def test_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.qkv.front import QKVFront

    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = Setup("norope", gen)
    c = s.constants
    other = type(c)(**{**c.__dict__, "k_eps": 3e-4})  # constants no other test compiles
    front = QKVFront(other, s.attn.qkv_proj, s.attn.q_norm.weight, None)
    x = random_rows(gen, 2, s.cfg.hidden_size, BF16, "cuda")
    pos, slots = s.step(2)
    cache = s.cache()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            front.run(x, pos, slots, cache)


def test_refuses_bad_operands(ref_setup, seed):
    s = ref_setup
    h = s.cfg.hidden_size
    x = random_rows(s.gen, 4, h, BF16, "cuda")
    pos, slots = s.step(4)
    cache = s.cache()
    f = s.front
    assert f.takes(x, pos, slots, cache)
    bad = [
        (x.float(), pos, slots, cache),
        (random_rows(s.gen, 17, h, BF16, "cuda"), pos, slots, cache),  # too many rows
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
