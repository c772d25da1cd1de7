"""GPU tests of ``dspark_cute.cutedsl.attention.paged.PagedAttention``: bit for bit
``dspark_core.spec.attention.paged_attention`` (``empty_rows="nan"``: the
kernels' 0 / 0 for a row without a valid slot) run on the same CUDA tensors
(``dspark_core.tools.compare.assert_bitwise``: NaN equals NaN, every other bit
pattern exact), for m in {1, 2, 7, 16, 33} and S in {1, 2, 127, 128, 129,
300, 1000, 4100} (4100: past the kernel's score cache of 4096 slots, so the
recomputed scores run too); masked slots (causal -1 padding and random
holes); random block tables (non-contiguous slots); heads / KV heads (64, 8),
(32, 4), (8, 8), (16, 1); int32 and int64 slots; PDL on and off; special
values in q, K and V (+-0, subnormals, +-inf, NaN, huge values whose scores
underflow exp, results of -0.0); a row without a valid slot (NaN); outputs
poisoned before each launch (a NaN pattern, then a finite one); a CUDA graph
replayed with new slots equal to eager; a compile during capture refused;
the out-of-range slot ValueError (and, inside a capture, such a slot
masked). Fresh seeded random data: the seed is printed (repeat with
DSPARK_SEED).

The opt-in variant (``dspark_cute.cutedsl.attention.staged``; passed on an H200 with
the rest of the GPU suite): every case above also runs, against the same spec
output, ``PagedAttention(..., staged=True)`` (K and V staged in shared
memory, cap 384 slots: S = 1000 and 4100 run the default's path past it),
``staged=True, max_staged_slots=128`` (the path past the cap from S = 129
on), ``staged=True, o_gate_eps=1e-6`` and ``o_gate_eps=1e-5`` (unstaged),
each with ``q`` a row-strided view of a QKV-like output ``[m, q | k | v |
gate]`` (the K/V columns NaN, never read) and, for the o-gate ones, the gate
its column slice (random values with special ones planted: +-0, +-inf, NaN,
subnormals, the largest finite), compared with ``o_gate(paged_attention(q,
...), gate, HeadNorm(64, eps), arch)`` (the kernel's o-gate arch: the
device's stock, FLA's on an H200); outputs poisoned as above. Also: every
BF16 gate pattern once, also in FlashInfer's arithmetic (``o_gate_arch=
"sm_100a"``, the B200's stock o-gate, whose instructions run here); for m in
{1, 2, 7, 16, 133, 4096} the o-gated variants against FLA's stock kernel
(the carried binary, on the spec's attention output and the same strided
gate) and, in FlashInfer's arithmetic, against the spec's sm_100a o-gate;
the graph replay (also in FlashInfer's arithmetic) and the out-of-range slot
for each variant; a variant's compile during capture refused; its operand
refusals."""

from __future__ import annotations

import pytest
import torch
from cute_testing import check_poisoned, poison, requires_cuda, special_rows

from dspark_core.contracts.constants import AttentionConstants
from dspark_core.planner.policy import DEFAULT_STAGED_SLOTS
from dspark_core.spec.attention import paged_attention
from dspark_core.spec.layers import HeadNorm, PagedKVCache, o_gate
from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
D = 64
BS = 16  # DraftConfig.kv_block_size
ROWS = [1, 2, 7, 16, 33]
SPANS = [1, 2, 127, 128, 129, 300, 1000, 4100]
HEADS = [(64, 8), (32, 4), (8, 8), (16, 1)]

# The opt-in variants every case also runs: name ->
# PagedAttention options.
VARIANTS = {
    "staged": {"staged": True},
    "staged-cap128": {"staged": True, "max_staged_slots": 128},
    "staged-gate": {"staged": True, "o_gate_eps": 1e-6},
    "gate": {"o_gate_eps": 1e-5},
}
# The o-gated variants in FlashInfer's arithmetic (the B200's stock o-gate),
# run by the o-gate tests below.
GATE_ARCH_VARIANTS = {
    "staged-gate-sm100": {"staged": True, "o_gate_eps": 1e-6, "o_gate_arch": "sm_100a"},
    "gate-sm100": {"o_gate_eps": 1e-5, "o_gate_arch": "sm_100a"},
}
# BF16 patterns planted in the gates: +-0, +-inf, NaN (both signs), the
# smallest subnormals, a subnormal, the smallest normal, the largest finite.
GATE_SPECIALS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x8001, 0x0055, 0x0080, 0x7F7F, 0xFF7F]

_KERNELS: dict = {}


def make_attention(heads: int, kv: int, block_size: int = 16, slot_dtype=torch.int64, pdl=None, *,
                    staged: bool = False, max_staged_slots: int = DEFAULT_STAGED_SLOTS, o_gate_eps=None,
                    o_gate_arch=None):
    """``PagedAttention`` of the constants these settings name (the o-gate's
    arch: ``o_gate_arch``, by default the device's stock one)."""
    from dspark_cute.cutedsl.attention.paged import PagedAttention

    names = {torch.int64: "int64", torch.int32: "int32"}
    return PagedAttention(AttentionConstants(heads, kv, D, block_size, names[slot_dtype],
                                             staged_slots=max_staged_slots if staged else 0,
                                             o_gate_eps=o_gate_eps), pdl=pdl, o_gate_arch=o_gate_arch)


def kernel(heads: int, kv: int, slot_dtype=torch.int64, pdl=None, block_size: int = BS, **options):
    """One prepared ``PagedAttention`` per setting (compiled once);
    ``options``: the opt-in variant's (``VARIANTS``)."""

    key = (heads, kv, slot_dtype, pdl, block_size, tuple(sorted(options.items())))
    if key not in _KERNELS:
        k = make_attention(heads, kv, block_size, slot_dtype, pdl, **options)
        k.prepare()
        _KERNELS[key] = k
    return _KERNELS[key]


def variants(k) -> list:
    """``(name, kernel)`` of the opt-in variants of default kernel ``k``'s setting."""
    c = k.constants
    return [(name, kernel(c.num_heads, c.kv_heads, k.slot_dtype, k.pdl, c.block_size, **options))
            for name, options in VARIANTS.items()]


def qkv_views(q: torch.Tensor, kv: int, gen) -> tuple:
    """``q`` copied into a QKV-like output ``[m, q | k | v | gate]`` (K/V
    columns NaN) and a random gate with special values planted: ``(q view,
    gate view)``, both ``[m, heads, 64]`` of row stride ``(2 heads + 2 kv) *
    64``."""
    m, heads, d = q.shape
    width = (2 * heads + 2 * kv) * d
    qkv = torch.full((m, width), float("nan"), dtype=BF16, device="cuda")
    qv = qkv[:, : heads * d].view(m, heads, d)
    qv.copy_(q)
    gate = qkv[:, (heads + 2 * kv) * d :].view(m, heads, d)
    gate.copy_(random_values(gen, (m, heads, d), spread=4))
    bits = gate.view(torch.int16)
    pick = torch.rand(bits.shape, generator=gen, device="cuda") < 0.1
    which = torch.randint(0, len(GATE_SPECIALS), bits.shape, generator=gen, device="cuda")
    specials = torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in GATE_SPECIALS], dtype=torch.int16,
                            device="cuda")
    bits.copy_(torch.where(pick, specials[which], bits))
    return qv, gate


def expected_for(k, attention: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The spec of variant ``k`` given the spec's attention output: with the
    o-gate, ``o_gate(attention, gate, HeadNorm(64, eps), arch)`` of the
    kernel's o-gate arch."""
    if not k.gated:
        return attention
    return o_gate(attention, gate, HeadNorm(D, k.constants.o_gate_eps), k.o_gate_arch)


def check_variants(k, q, cache, slots, expected, what: str) -> None:
    """Every opt-in variant of ``k``'s setting on a strided ``q`` (and gate)
    against the spec output ``expected``, the output poisoned first."""
    gen = torch.Generator(device="cuda").manual_seed(q.shape[0] * 7919 + slots.shape[1])
    qv, gate = qkv_views(q, k.constants.kv_heads, gen)
    for name, kk in variants(k):
        want = expected_for(kk, expected, gate)
        out = torch.empty_like(q)
        g = gate if kk.gated else None
        check_poisoned(lambda kk=kk, out=out, g=g: kk.run(qv, cache, slots, out, gate=g), [out], [want],
                       f"{what} [{name}]")


def random_values(gen, shape, spread: int = 3) -> torch.Tensor:
    """BF16 normal values times powers of two in [2^-spread, 2^spread]."""
    x = torch.randn(shape, generator=gen, device="cuda")
    e = torch.randint(-spread, spread + 1, shape, generator=gen, device="cuda").float()
    return (x * torch.exp2(e)).to(BF16)


def make_cache(gen, kv: int, slots_needed: int, block_size: int = BS, spread: int = 3) -> PagedKVCache:
    """A random cache with at least ``slots_needed`` slots and spare blocks."""
    blocks = -(-slots_needed // block_size) + 3
    cache = PagedKVCache(blocks, kv, block_size, D, device="cuda")
    cache.tensor.copy_(random_values(gen, tuple(cache.tensor.shape), spread))
    return cache


def block_table_slots(gen, cache: PagedKVCache, m: int, s: int, holes: float = 0.0) -> torch.Tensor:
    """``[m, s]`` int64 slots: position p of a sequence whose logical block b
    lives in a random physical block (a random block table), token i
    attending causally to positions ``0 .. s - m + i`` (at least position
    0), -1 past that; a fraction ``holes`` of the rest masked at random."""
    bs = cache.block_size
    blocks = cache.tensor.shape[0]
    table = torch.randperm(blocks, generator=gen, device="cuda")
    pos = torch.arange(s, device="cuda")
    slots = (table[pos // bs] * bs + pos % bs).expand(m, s).clone()
    last = (s - m + torch.arange(m, device="cuda")).clamp_min(0)
    slots[pos[None, :] > last[:, None]] = -1
    if holes:
        drop = torch.rand((m, s), generator=gen, device="cuda") < holes
        slots[drop] = -1
    return slots


def check(k, q, cache, slots, what: str) -> torch.Tensor:
    """The kernel against the spec on the same tensors, the output poisoned
    with both patterns first; then the allocating path; then every opt-in
    variant (``check_variants``). Returns the spec."""
    heads, kv = k.constants.num_heads, k.constants.kv_heads
    expected = paged_attention(q, cache, slots.long() if slots.dtype != torch.int64 else slots, kv,
                               empty_rows="nan")
    assert expected.shape == (q.shape[0], heads, D)
    out = torch.empty_like(q)
    check_poisoned(lambda: k.run(q, cache, slots, out), [out], [expected], what)
    assert_bitwise(k.run(q, cache.tensor, slots), expected, f"{what} (allocated output, cache tensor)")
    check_variants(k, q, cache, slots, expected, what)
    return expected


@pytest.mark.parametrize("s", SPANS)
@pytest.mark.parametrize("m", ROWS)
def test_rows_and_spans(m, s, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = make_cache(gen, 8, s)
    q = random_values(gen, (m, 64, D))
    check(kernel(64, 8), q, cache, block_table_slots(gen, cache, m, s), f"m={m} S={s} causal")
    check(kernel(64, 8), q, cache, block_table_slots(gen, cache, m, s, holes=0.3), f"m={m} S={s} holes")


@pytest.mark.parametrize("heads,kv", HEADS)
def test_head_groups(heads, kv, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for m, s in ((1, 272), (16, 287), (5, 4100)):
        cache = make_cache(gen, kv, s)
        q = random_values(gen, (m, heads, D))
        check(kernel(heads, kv), q, cache, block_table_slots(gen, cache, m, s, holes=0.1), f"{heads}/{kv} m={m}")


def test_int32_slots_pdl_off_and_other_block_sizes(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = make_cache(gen, 8, 700)
    q = random_values(gen, (7, 64, D))
    slots = block_table_slots(gen, cache, 7, 700, holes=0.2)
    check(kernel(64, 8, torch.int32), q, cache, slots.to(torch.int32), "int32 slots")
    check(kernel(64, 8, pdl=False), q, cache, slots, "no PDL")
    for bs in (1, 12):
        c2 = make_cache(gen, 4, 300, block_size=bs)
        q2 = random_values(gen, (3, 32, D))
        check(kernel(32, 4, block_size=bs), q2, c2, block_table_slots(gen, c2, 3, 300, holes=0.1), f"bs={bs}")


def test_random_slots_repeated_and_unordered(seed):
    """Slots in any order, repeated, across the whole cache (no block table)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = make_cache(gen, 8, 2000)
    for m, s in ((1, 300), (16, 1000), (33, 129)):
        slots = torch.randint(-3, cache.num_slots, (m, s), generator=gen, device="cuda")
        q = random_values(gen, (m, 64, D))
        check(kernel(64, 8), q, cache, slots, f"random slots m={m} S={s}")


def _plant(gen, t: torch.Tensor, rows: torch.Tensor, fraction: float) -> None:
    """Overwrite a random ``fraction`` of the 64-wide rows of ``t`` with
    random rows of ``rows`` (special values)."""
    flat = t.view(-1, D)
    pick = (torch.rand(flat.shape[0], generator=gen, device="cuda") < fraction).nonzero().flatten()
    which = torch.randint(0, rows.shape[0], (pick.numel(),), generator=gen, device="cuda")
    flat[pick] = rows[which]


def test_special_values(seed):
    """Special rows (``cute_testing.special_rows``: -0.0, subnormals, +-inf,
    NaN, huge, tiny, +0.0) planted in q, K and V rows: first only the rows
    that keep the scores finite in K and q (so most heads stay finite and
    the specials in V reach the sums), then every kind everywhere."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    special = special_rows(D, BF16, "cuda")
    finite = special[[0, 1, 2, 6, 8, 9]]
    for everything in (False, True):
        for m, s, frac in ((1, 300, 0.05), (7, 129, 0.02), (16, 1000, 0.01), (33, 272, 0.1)):
            cache = make_cache(gen, 8, s)
            kv = cache.tensor.view(-1, 2, D)  # [rows, K/V, D]
            k_rows, v_rows = kv[:, 0].clone(), kv[:, 1].clone()
            _plant(gen, k_rows, special if everything else finite, frac)
            _plant(gen, v_rows, special, frac)
            kv[:, 0] = k_rows
            kv[:, 1] = v_rows
            q = random_values(gen, (m, 64, D))
            _plant(gen, q, special if everything else finite, frac)
            slots = block_table_slots(gen, cache, m, s, holes=0.1)
            check(kernel(64, 8), q, cache, slots, f"special ({'all' if everything else 'finite'}) m={m} S={s}")


def test_underflow_signed_zero_and_no_valid_slot(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = make_cache(gen, 8, 500, spread=6)
    m, s = 9, 500
    # Huge queries: scores thousands apart, exp_rn underflows to +0.0 for
    # most slots (one or a few carry the whole softmax).
    q = (random_values(gen, (m, 64, D), spread=2).float() * 64).to(BF16)
    slots = block_table_slots(gen, cache, m, s, holes=0.2)
    slots[3] = -1  # a row without a valid slot: 0 / 0
    slots[5, 1:] = -1  # a row of one slot: its V row exactly (p = 1)
    slots[5, 0] = 17
    expected = check(kernel(64, 8), q, cache, slots, "underflow")
    assert torch.isnan(expected[3]).all() and not torch.isnan(expected[5]).any()
    # Tiny V of both signs: quotients below half the least BF16 subnormal
    # round to -0.0 / +0.0.
    tiny = torch.full((D,), 1, dtype=torch.int16, device="cuda").view(BF16)
    v = cache.tensor[..., D:]
    v.copy_(torch.where(torch.rand(v.shape, generator=gen, device="cuda") < 0.5, tiny, -tiny))
    # Queries of +-0.0: every score +-0.0, p = 1, out = (sum of +-tiny) / n.
    q2 = torch.where(torch.rand((m, 64, D), generator=gen, device="cuda") < 0.5, 0.0, -0.0).to(BF16)
    slots2 = block_table_slots(gen, cache, m, s)
    expected = check(kernel(64, 8), q2, cache, slots2, "signed zeros")
    bits = expected.view(torch.int16)
    assert (bits == torch.tensor(-32768, dtype=torch.int16, device="cuda")).any(), "no -0.0 result exercised"
    # Scores of -inf everywhere (mx = -inf, -inf - -inf = NaN) and of +inf.
    cache.tensor[..., :D] = torch.finfo(BF16).max
    for sign in (-1.0, 1.0):
        q3 = torch.full((2, 64, D), sign * float(torch.finfo(BF16).max), dtype=BF16, device="cuda")
        check(kernel(64, 8), q3, cache, block_table_slots(gen, cache, 2, 40), f"infinite scores {sign}")


@pytest.mark.parametrize("variant", ["default", *VARIANTS, "staged-gate-sm100"])
def test_cuda_graph_replays_with_new_slots(variant, seed):
    """A captured call replayed on new q, slots (and gate) in place: the
    spec's bits and the eager call's. The variants read q (and the gate) as
    strided views of one QKV-like output."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = kernel(64, 8) if variant == "default" else kernel(64, 8, **{**VARIANTS, **GATE_ARCH_VARIANTS}[variant])
    m, s = 16, 400
    cache = make_cache(gen, 8, s + 200)
    q = random_values(gen, (m, 64, D))
    qv, gate = (q, None) if variant == "default" else qkv_views(q, 8, gen)
    g = gate if k.gated else None
    slots = block_table_slots(gen, cache, m, s, holes=0.1)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        k.run(qv, cache, slots, out, gate=g)  # warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            k.run(qv, cache, slots, out, gate=g)
    torch.cuda.synchronize()
    for step in range(3):
        qv.copy_(random_values(gen, (m, 64, D)))
        if g is not None:
            g.copy_(random_values(gen, (m, 64, D), spread=4))
        slots.copy_(block_table_slots(gen, cache, m, s, holes=0.1 * step))
        expected = expected_for(k, paged_attention(qv.contiguous(), cache, slots, 8, empty_rows="nan"), gate)
        check_poisoned(graph.replay, [out], [expected], f"{variant} graph replay {step}")
        eager = k.run(qv, cache, slots, gate=g)
        assert_bitwise(out, eager, f"{variant} graph replay {step} vs eager")


@pytest.mark.parametrize("variant", ["default", *VARIANTS])
def test_out_of_range_slot(variant, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = kernel(64, 8) if variant == "default" else kernel(64, 8, **VARIANTS[variant])
    cache = make_cache(gen, 8, 100)
    q = random_values(gen, (3, 64, D))
    qv, gate = (q, None) if variant == "default" else qkv_views(q, 8, gen)
    g = gate if k.gated else None
    slots = block_table_slots(gen, cache, 3, 100)
    bad = slots.clone()
    bad[1, 7] = cache.num_slots
    with pytest.raises(ValueError, match="beyond the cache"):
        k.run(qv, cache, bad, gate=g)
    with pytest.raises(ValueError, match="beyond the cache"):
        paged_attention(q, cache, bad, 8)
    # Inside a capture the slots cannot be read: the kernel masks the slot.
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        k.run(qv, cache, bad, out, gate=g)
    poison(out, 0)
    graph.replay()
    torch.cuda.synchronize()
    masked = bad.clone()
    masked[1, 7] = -1
    expected = expected_for(k, paged_attention(q, cache, masked, 8, empty_rows="nan"), gate)
    assert_bitwise(out, expected, f"{variant}: out-of-range slot masked in a graph")


def test_o_gate_every_gate_pattern(seed):
    """The o-gate epilogue over every BF16 gate pattern once (16 tokens x
    64 heads x 64 columns = 65536), staged and not, with random attention."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, s = 16, 300
    cache = make_cache(gen, 8, s)
    q = random_values(gen, (m, 64, D))
    slots = block_table_slots(gen, cache, m, s, holes=0.1)
    qv, gate = qkv_views(q, 8, gen)
    every = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16)
    gate.view(torch.int16).copy_(every[torch.randperm(65536, generator=gen, device="cuda")].view(m, 64, D))
    attention = paged_attention(q, cache, slots, 8, empty_rows="nan")
    for name, options in (*((n, VARIANTS[n]) for n in ("staged-gate", "gate")), *GATE_ARCH_VARIANTS.items()):
        k = kernel(64, 8, **options)
        out = torch.empty_like(q)
        check_poisoned(lambda k=k, out=out: k.run(qv, cache, slots, out, gate=gate), [out],
                       [expected_for(k, attention, gate)], f"every gate pattern [{name}]")


def _gated_operands(gen, m: int, heads: int, kv: int, s: int):
    """q (a strided view of a QKV-like output), its gate (specials planted),
    a cache and slots for ``m`` tokens over ``s`` slot columns (a random
    block table with holes; past 133 tokens random slots, some masked), and
    the spec's attention output."""
    cache = make_cache(gen, kv, max(s, 64))
    q = random_values(gen, (m, heads, D))
    if m <= 133:
        slots = block_table_slots(gen, cache, m, s, holes=0.1)
    else:
        slots = torch.randint(-4, cache.num_slots, (m, s), generator=gen, device="cuda")
    qv, gate = qkv_views(q, kv, gen)
    return qv, gate, cache, slots, paged_attention(q, cache, slots, kv, empty_rows="nan")


# Rows of the o-gate epilogue's stock and arch cases; (heads, kv heads) per row count.
GATE_ROWS = [1, 2, 7, 16, 133, 4096]


def _gate_heads(m: int) -> tuple:
    return (64, 8) if m <= 133 else (8, 2)


@pytest.fixture(scope="module")
def stock_kernels():
    """``stock.py``'s launcher of vLLM 0.33.0's carried stock binaries
    (``stock_o_gate``: FLA's kernel), or a skip saying how to build them;
    the binaries compared here are the sm_90 ones (an H100/H200)."""
    from stock import stock_or_skip

    return stock_or_skip()


@pytest.mark.parametrize("m", GATE_ROWS)
def test_o_gate_epilogue_vs_stock(m, stock_kernels, seed):
    """The o-gated variants (FLA's arithmetic, the H200's stock) bit for bit
    FLA's stock kernel (the carried binary) applied to the spec's attention
    output with the same strided gate, and the spec."""
    stock = stock_kernels
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv = _gate_heads(m)
    qv, gate, cache, slots, attention = _gated_operands(gen, m, heads, kv, 300 if m <= 133 else 40)
    for name in ("staged-gate", "gate"):
        k = kernel(heads, kv, **VARIANTS[name], o_gate_arch="sm_90a")
        want = stock.stock_o_gate(attention.clone(), gate, k.constants.o_gate_eps)
        out = torch.empty_like(attention)
        check_poisoned(lambda k=k, out=out: k.run(qv, cache, slots, out, gate=gate), [out],
                       [expected_for(k, attention, gate)], f"m={m} [{name}]")
        assert_bitwise(out, want, f"m={m} [{name}] vs FLA's stock kernel")


@pytest.mark.parametrize("m", GATE_ROWS)
def test_o_gate_epilogue_sm100_arithmetic(m, seed):
    """The o-gate epilogue in FlashInfer's arithmetic (the B200's stock; its
    instructions run on any sm_90+ GPU) against the spec's sm_100a o-gate on
    this device: rows ``m * heads`` on both sides of FlashInfer's 256-row
    layout switch."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv = _gate_heads(m)
    qv, gate, cache, slots, attention = _gated_operands(gen, m, heads, kv, 300 if m <= 133 else 40)
    for name, options in GATE_ARCH_VARIANTS.items():
        k = kernel(heads, kv, **options)
        assert k.o_gate_arch == "sm_100a"
        out = torch.empty_like(attention)
        check_poisoned(lambda k=k, out=out: k.run(qv, cache, slots, out, gate=gate), [out],
                       [expected_for(k, attention, gate)], f"m={m} [{name}]")


def test_compile_refused_during_capture(seed):

    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = make_attention(24, 3, block_size=8)  # constants no other test compiles
    cache = make_cache(gen, 3, 50, block_size=8)
    q = random_values(gen, (2, 24, D))
    slots = block_table_slots(gen, cache, 2, 50)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            k.run(q, cache, slots)
    # The same for an opt-in variant (constants no other test compiles).
    k2 = make_attention(24, 3, block_size=8, staged=True, max_staged_slots=256, o_gate_eps=1e-6)
    qv, gate = qkv_views(q, 3, gen)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            k2.run(qv, cache, slots, gate=gate)


def test_refuses_bad_operands(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = kernel(64, 8)
    cache = make_cache(gen, 8, 64)
    q = random_values(gen, (2, 64, D))
    slots = block_table_slots(gen, cache, 2, 64)
    with pytest.raises(ValueError, match="attn_slots must be a contiguous CUDA torch.int64"):
        k.run(q, cache, slots.to(torch.int32))
    with pytest.raises(ValueError, match="q must be"):
        k.run(q.transpose(1, 2).contiguous().transpose(1, 2), cache, slots)
    with pytest.raises(ValueError, match="q must be"):
        k.run(q[:, :63].contiguous(), cache, slots)
    with pytest.raises(ValueError, match="the cache must be"):
        k.run(q, make_cache(gen, 4, 64).tensor, slots)
    with pytest.raises(ValueError, match="out must be"):
        k.run(q, cache, slots, torch.empty(2, 64, 64, dtype=torch.float32, device="cuda"))
    with pytest.raises(ValueError, match="q must be"):
        k.run(q.cpu(), cache, slots)
    # The opt-in variants: a strided q (and gate) taken, other layouts refused.
    staged, gated = kernel(64, 8, **VARIANTS["staged"]), kernel(64, 8, **VARIANTS["staged-gate"])
    qv, gate = qkv_views(q, 8, gen)
    with pytest.raises(ValueError, match="q must be a contiguous CUDA"):
        k.run(qv, cache, slots)  # the default kernel takes a contiguous q only
    with pytest.raises(ValueError, match="contiguous rows"):
        staged.run(q.transpose(1, 2).contiguous().transpose(1, 2), cache, slots)
    wide = torch.zeros(2, 4096 + 64, dtype=BF16, device="cuda")
    with pytest.raises(ValueError, match="aligned to 16 bytes"):
        staged.run(wide[:, 4:4100].view(2, 64, 64), cache, slots)  # 8-byte aligned rows
    with pytest.raises(ValueError, match="gate must be None"):
        staged.run(qv, cache, slots, gate=gate)
    with pytest.raises(ValueError, match="the gate must be a bf16 tensor"):
        gated.run(qv, cache, slots)
    with pytest.raises(ValueError, match="the gate must be a CUDA tensor"):
        gated.run(qv, cache, slots, gate=gate.cpu())
    assert_bitwise(staged.run(qv, cache, slots), k.run(q, cache, slots), "staged on a strided q")
