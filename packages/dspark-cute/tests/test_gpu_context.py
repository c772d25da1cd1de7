"""GPU tests of the context kernels, bit for bit against the stock chain run
on the same CUDA device (``dspark_core.reference.model.DraftModel``'s own
``context_norms``, ``context_kv_store`` and
``precompute_and_store_context_kv``, the spec) and against vLLM 0.33.0's
own kernels on the same operands (``stock.py``: the stock Triton norm's
binaries, the device's ATen K-norm, vLLM's rotary kernel with the BF16
table, vLLM's ``reshape_and_cache_flash`` on the cache's key and value
views as its attention backends hand them over):

- ``ContextNorms``: every norm kind on each side (no weight, BF16/FP16/FP32
  weights before or after the norm, gain centers 0 and 1, several eps), T in
  {1, 2, 7, 16, 133, 1000}, L in {1, 2, 5, 9}, rows of special values (-0.0,
  subnormals, +-inf, NaN, overflowing and underflowing squares), other H,
  without PDL, the sm_100a tree; against the stock's norms (BF16, FP32 or no
  weight) T in {1, 2, 7, 16, 133, 4096};
- ``ContextKvStore``: 1, 2, 8 and 32 KV heads, BF16 and FP32 RoPE tables and
  no RoPE, L up to 9 (two launches), special values in K and V, negative
  slots, per-layer slot lists (None, shorter), out-of-range slots and
  positions (skipped); against ATen's K-norm and vLLM's rotary kernel, T in
  {1, 2, 7, 16, 133, 4096};
- the whole chain (``ContextChain``), against the stock chain too, and its
  CUDA graph replay.

Outputs and caches are poisoned before each launch (a NaN pattern, then a
finite one) so unwritten elements show, and cache rows no slot names must
keep the poison's exact bits. The store and the chain write caches in both
layer-outermost layouts (``PagedKVCache``'s LBHNC, contiguous, and LBNHC,
vLLM's default on sm_90, through its strides), to the same logical places
as the stock chain's insert. Data is fresh per run from the printed seed
(``DSPARK_SEED`` repeats it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cute_testing import (
    GPU_NORMS,
    POISONS,
    assert_replays_repeat,
    check_poisoned,
    make_norm,
    norm_name,
    poison,
    random_rows,
    requires_cuda,
    special_rows,
)
from norm_testing import (
    STOCK_H,
    STOCK_ROWS,
    context_norm_consts,
    planted_rows,
    stock_has,
    stock_k_norm,
    stock_norm,
    stock_or_skip,
    with_arch,
)

from dspark_core.contracts.constants import ContextStoreConstants
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel
from dspark_core.spec.layers import HeadNorm, PagedKVCache, Rotary
from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H = 8192
D = 64
BLOCK = 16
NORMS = GPU_NORMS
ROWS = [1, 2, 7, 16, 133, 1000]


def context_rows(gen: torch.Generator, t: int, h: int) -> torch.Tensor:
    """BF16 ``[t, h]`` random rows with special rows planted
    (``norm_testing.planted_rows``); with 20 rows or more the last 10 are the
    special rows of ``cute_testing.special_rows`` too."""
    x = planted_rows(gen, t, h, BF16)
    if t >= 20:
        x[-10:] = special_rows(h, BF16, "cuda")
    return x


def stock_context_norms(stock, hidden, pres, x: torch.Tensor) -> torch.Tensor:
    """The stock chain's norms (``dspark.py``'s hidden norm, then each layer's
    ``pre_qkv_proj_norm`` of its BF16 output), the stock kernel each."""
    h = stock_norm(stock, hidden, x, BF16)
    return torch.stack([stock_norm(stock, p, h, BF16) for p in pres])


def check_norms(hidden_case, pre_case, layers: int, rows: list, h: int, gen, special_weight=False,
                pdl=None, specials_only=False, arch: str = "sm_90a", stock=None) -> None:
    """The kernel of the norms of these cases on ``arch`` against the spec
    with that arch's tree (and against the ``stock`` kernels, if given), T
    in ``rows`` (special rows planted)."""
    from dspark_cute.cutedsl.norms.context_norms import ContextNorms

    hidden = with_arch(make_norm(hidden_case, h, gen, special_weight), arch)
    pres = [with_arch(make_norm(pre_case, h, gen, special_weight), arch) for _ in range(layers)]
    model = SimpleNamespace(hidden_norm=hidden, layers=[SimpleNamespace(input_norm=p) for p in pres])
    c = context_norm_consts(hidden, pres[0], layers, arch)
    pre_weights = torch.stack([p.weight for p in pres]) if pres[0].weight is not None else None
    kernel = ContextNorms(c, hidden.weight, pre_weights, pdl=pdl)
    kernel.prepare()
    for t in rows:
        x = special_rows(h, BF16, "cuda") if specials_only else context_rows(gen, t, h)
        t = x.shape[0]
        assert kernel.takes(x)
        expected = DraftModel.context_norms(model, x)
        out = torch.empty((layers, t, h), dtype=BF16, device="cuda")
        what = f"norms {norm_name(hidden_case)} / {norm_name(pre_case)} L={layers} T={t} H={h} [{arch}]"
        check_poisoned(lambda x=x, out=out: kernel.run(x, out), [out], [expected], what)
        if stock is not None:
            assert_bitwise(out, stock_context_norms(stock, hidden, pres, x), f"{what} against the stock kernels")
        assert_bitwise(kernel.run(x), expected, f"{what} (allocated output)")


@pytest.mark.parametrize("i", range(len(NORMS)), ids=[norm_name(n) for n in NORMS])
def test_norms_every_variant(i, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    check_norms(NORMS[i], NORMS[(i + 3) % 7], 2, ROWS, H, gen)


@pytest.mark.parametrize("layers", [1, 5, 9])
@pytest.mark.parametrize("pair", [(1, 1), (6, 0)], ids=["bf16-bf16", "fp32-noweight"])
def test_norms_layer_counts(layers, pair, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    check_norms(NORMS[pair[0]], NORMS[pair[1]], layers, ROWS, H, gen)


@pytest.mark.parametrize("i", range(len(NORMS)), ids=[norm_name(n) for n in NORMS])
def test_norms_special_values(i, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    check_norms(NORMS[i], NORMS[(i + 3) % 7], 2, [10], H, gen, special_weight=True, specials_only=True)


@pytest.mark.parametrize("h", [2048, 6144, 16384])
def test_norms_hidden_sizes(h, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    check_norms(NORMS[2], NORMS[5], 3, [1, 7, 133], h, gen)


def test_norms_without_pdl(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    check_norms(NORMS[3], NORMS[1], 2, [1, 133], H, gen, pdl=False)


@pytest.mark.parametrize("i", range(len(NORMS)), ids=[norm_name(n) for n in NORMS])
def test_norms_sm100a_tree(i, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    check_norms(NORMS[i], NORMS[(i + 2) % 7], 2, [1, 7, 133], H, gen, arch="sm_100a")
    check_norms(NORMS[i], NORMS[(i + 2) % 7], 2, [10], H, gen, special_weight=True, specials_only=True,
                arch="sm_100a")


# (hidden, input norm) cases the stock has: BF16, FP32 or no weight, input-scaled or not.
STOCK_NORM_PAIRS = [(1, 5), (6, 0), (0, 2), (5, 6), (2, 1)]


@pytest.mark.parametrize("pair", STOCK_NORM_PAIRS, ids=lambda p: f"{norm_name(NORMS[p[0]])}__{norm_name(NORMS[p[1]])}")
def test_norms_against_the_stock(pair, seed):
    """The kernel (sm_90a) against the stock chain's Triton norms on the same
    rows (special rows planted, special weights), T in {1, 2, 7, 16, 133,
    4096}, two layers."""
    stock = stock_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden, pre = NORMS[pair[0]], NORMS[pair[1]]
    assert all(stock_has(make_norm(case, STOCK_H, gen), BF16, BF16) for case in (hidden, pre))
    check_norms(hidden, pre, 2, list(STOCK_ROWS), STOCK_H, gen, special_weight=True, stock=stock)


# ---------------------------------------------------------------- the store


def stock_store_model(kv_heads: int, layers: int, eps: float, rotary: Rotary | None):
    """The parts of a DraftModel that ``DraftModel.context_kv_store`` reads."""
    attn = SimpleNamespace(qk_norm=HeadNorm(D, eps), rotary=rotary)
    return SimpleNamespace(
        config=SimpleNamespace(num_kv_heads=kv_heads, head_dim=D),
        layers=[SimpleNamespace(self_attn=attn) for _ in range(layers)],
    )


def projected_kv(gen: torch.Generator, layers: int, t: int, kv_heads: int) -> torch.Tensor:
    """BF16 ``[L, T, 2 * kv * 64]`` random, with special heads in K and V of
    the first rows: -0.0, subnormals, one +inf, one NaN, one -inf, squares
    that overflow or underflow."""
    width = 2 * kv_heads * D
    kv = random_rows(gen, layers * t, width, BF16, "cuda").view(layers, t, 2, kv_heads, D)
    tiny = torch.finfo(BF16).smallest_normal
    signs = torch.where(torch.arange(D, device="cuda") % 3 == 0, -1.0, 1.0)
    # Each sets one head (``[L, 64]``: every layer's head of that row).
    special = [
        lambda head: head.fill_(-0.0),
        lambda head: head.copy_((signs * tiny / 8).expand_as(head)),  # subnormals of both signs
        lambda head: head[:, 5].fill_(float("inf")),
        lambda head: head[:, 17].fill_(float("nan")),
        lambda head: head.fill_(3e38),  # squares overflow
        lambda head: head.fill_(tiny * 3),  # squares underflow
        lambda head: head[:, 40].fill_(float("-inf")),
    ]
    for r in range(min(t, len(special))):
        special[r](kv[:, r, 0, r % kv_heads])
        special[(r + 3) % len(special)](kv[:, r, 1, (r + 1) % kv_heads])
    return kv.view(layers, t, width)


def make_slots(gen: torch.Generator, rows: int, num_slots: int) -> torch.Tensor:
    """Distinct random int64 slots in [0, num_slots) for ``rows`` rows, about
    one in eight negative (-1 or a large negative value)."""
    slots = torch.randperm(num_slots, generator=gen, device="cuda")[:rows].to(torch.int64)
    negative = torch.rand(rows, generator=gen, device="cuda") < 0.125
    if rows > 2:
        negative[1] = True
    big = torch.where(torch.arange(rows, device="cuda") % 2 == 0, -1, -(2**40))
    return torch.where(negative, big, slots).contiguous()


LAYOUTS = ("LBHNC", "LBNHC")


def make_caches(layers: int, kv_heads: int, num_blocks: int, layout: str = "LBHNC") -> list:
    return [PagedKVCache(num_blocks, kv_heads, BLOCK, D, "cuda", layout) for _ in range(layers)]


def assert_untouched(cache: torch.Tensor, slots, pattern: int, what: str) -> None:
    """Every cache row (block, page) no non-negative slot names still holds
    the poison ``pattern`` bit for bit."""
    num_blocks, heads, bs, width = cache.shape
    written = torch.zeros(num_blocks * bs, dtype=torch.bool, device=cache.device)
    if slots is not None:
        keep = slots[(slots >= 0) & (slots < num_blocks * bs)]
        written[keep] = True
    rows = cache.permute(0, 2, 1, 3).reshape(num_blocks * bs, heads * width).view(torch.int16)
    bad = (rows[~written] != pattern).sum().item()
    assert bad == 0, f"{what}: {bad} elements of unwritten cache rows lost their poison"


def check_store(store, stock, kv, positions, slots, layers, kv_heads, num_blocks, what: str,
                layout: str = "LBHNC") -> None:
    """Poison two sets of caches in ``layout`` alike (twice: a NaN and a
    finite pattern), store with the stock chain into one and the kernel into
    the other, and compare every cache bit for bit; unwritten rows must keep
    the poison."""
    per_layer = slots if isinstance(slots, list) else [slots] * layers
    for which in (0, 1):
        ours = make_caches(layers, kv_heads, num_blocks, layout)
        ref = make_caches(layers, kv_heads, num_blocks, layout)
        for cache in ours + ref:
            poison(cache.tensor, which)
        DraftModel.context_kv_store(stock, kv, positions, ref, slots)
        store.run(kv, positions, ours, slots)
        torch.cuda.synchronize()
        pattern = POISONS[BF16][which]
        for i in range(layers):
            assert_bitwise(ours[i].tensor, ref[i].tensor, f"{what} layer {i} cache (poison {which})")
            assert_untouched(ours[i].tensor, per_layer[i], pattern, f"{what} layer {i}")


STORES = [  # (kv heads, layers, table dtype or None, eps)
    (1, 1, BF16, 1e-6),
    (2, 2, FP32, 1e-5),
    (8, 5, BF16, 1e-6),
    (32, 9, FP32, 1e-6),
    (8, 9, None, 0.1),
    (32, 2, BF16, 1e-5),
    (1, 9, FP32, 1e-6),
    (2, 5, None, 1e-6),
]


def _store_name(case) -> str:
    kv, layers, table, eps = case
    return f"kv{kv}-L{layers}-{str(table).replace('torch.', '') if table else 'norope'}-eps{eps}"


def make_store(case, max_position: int = 4096, pdl=None):
    from dspark_cute.cutedsl.context.store import ContextKvStore

    kv_heads, layers, table, eps = case
    rotary = Rotary(D, max_position, table_dtype=table).cuda() if table is not None else None
    c = ContextStoreConstants(kv_heads, eps, table is not None, "fp32" if table == FP32 else "bf16")
    store = ContextKvStore(c, rotary.cos_sin if rotary is not None else None, pdl=pdl)
    store.prepare()
    return store, stock_store_model(kv_heads, layers, eps, rotary)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", STORES, ids=_store_name)
def test_store(case, layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_heads, layers = case[0], case[1]
    store, stock = make_store(case)
    for t in ROWS:
        kv = projected_kv(gen, layers, t, kv_heads)
        positions = torch.randint(0, 4096, (t,), generator=gen, device="cuda")
        num_blocks = (t + 40) // BLOCK + 2
        slots = make_slots(gen, t, num_blocks * BLOCK)
        assert store.takes(kv, positions, make_caches(layers, kv_heads, num_blocks, layout), slots)
        check_store(store, stock, kv, positions, slots, layers, kv_heads, num_blocks,
                    f"{_store_name(case)} {layout} T={t}", layout)
        # The 5-D view of the same projection is taken too.
        view = kv.view(layers, t, 2, kv_heads, D)
        assert store.takes(view, positions, make_caches(layers, kv_heads, num_blocks), slots)


@pytest.mark.parametrize("case", [STORES[3], STORES[4]], ids=_store_name)
def test_store_per_layer_slots(case, seed):
    """One slot list per layer: None (nothing stored), shorter than T (only
    the first rows stored), all negative, and full ones; 9 layers, 2 launches."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_heads, layers = case[0], case[1]
    store, stock = make_store(case)
    t = 133
    kv = projected_kv(gen, layers, t, kv_heads)
    positions = torch.randint(0, 4096, (t,), generator=gen, device="cuda")
    num_blocks = 16
    slots = [make_slots(gen, (t, 50, 1, 0, t)[i % 5], num_blocks * BLOCK) for i in range(layers)]
    slots[2] = None
    slots[4] = torch.full((t,), -1, dtype=torch.int64, device="cuda")
    for layout in LAYOUTS:
        check_store(store, stock, kv, positions, slots, layers, kv_heads, num_blocks,
                    f"{_store_name(case)} lists {layout}", layout)


def test_store_skips_out_of_range(seed):
    """A slot beyond the cache and a position beyond the table: the stock
    chain raises there; the kernel writes nothing for that row."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    case = (8, 2, BF16, 1e-6)
    store, stock = make_store(case, max_position=256)
    t, num_blocks = 16, 4
    kv = projected_kv(gen, 2, t, 8)
    positions = torch.randint(0, 256, (t,), generator=gen, device="cuda")
    slots = make_slots(gen, t, num_blocks * BLOCK)
    good = slots.clone()
    slots[3], positions[5] = num_blocks * BLOCK, 256
    good[3] = good[5] = -1
    caches = make_caches(2, 8, num_blocks)
    ref = make_caches(2, 8, num_blocks)
    for cache in caches + ref:
        poison(cache.tensor, 1)
    store.run(kv, positions, caches, slots)
    positions[5] = 0
    DraftModel.context_kv_store(stock, kv, positions, ref, good)
    torch.cuda.synchronize()
    for i in range(2):
        assert_bitwise(caches[i].tensor, ref[i].tensor, f"out-of-range rows, layer {i}")
        assert_untouched(caches[i].tensor, good, POISONS[BF16][1], f"out-of-range rows, layer {i}")


def stock_context_store(stock, kv, positions, caches, slots, kv_heads: int, eps: float, table) -> None:
    """The stock chain's store after the projection ``kv`` ``[L, T, 2 * kv *
    64]``: the K-norm of every layer's K at once (ATen on this device:
    ``pow(2).mean(-1)``, ``+ eps``, ``rsqrt``, ``* k``, BF16), vLLM's rotary
    kernel in place on all of them (``positions.repeat(L)``, the BF16
    ``table``), then each layer's insert of its first ``len(slots_l)`` rows
    by vLLM's ``reshape_and_cache_flash`` binary on the ``[blocks,
    block_size, kv_heads, 64]`` key and value views of the cache (as vLLM's
    FlashAttention backend splits it; the kernel takes their strides, so any
    layout)."""
    layers, t = kv.shape[:2]
    kv = kv.view(layers, t, 2, kv_heads, D)
    k = stock_k_norm(kv[:, :, 0].contiguous(), eps)
    if table is not None:
        stock.stock_rotary(positions.repeat(layers), k.view(layers * t, kv_heads * D), None, D, table)
    per_layer = slots if isinstance(slots, list) else [slots] * layers
    for i in range(layers):
        if per_layer[i] is not None:
            rows = per_layer[i].shape[0]
            key_cache, value_cache = (t.permute(0, 2, 1, 3) for t in caches[i].tensor.split(D, dim=-1))
            stock.stock_reshape_and_cache_flash(k[i, :rows], kv[i, :rows, 1], key_cache, value_cache, per_layer[i])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [STORES[2], STORES[3], STORES[1], STORES[4]], ids=_store_name)
def test_store_against_the_stock(case, layout, seed):
    """The kernel against the stock's own kernels on the same projection:
    ATen's K-norm, vLLM's ``rotary_embedding_kernel`` with the table cast to
    BF16, the insert; T in {1, 2, 7, 16, 133, 4096}, special heads, negative
    slots; the caches poisoned, in ``layout``."""
    stock = stock_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_heads, layers, table_dtype, eps = case
    store, model = make_store(case)
    rotary = model.layers[0].self_attn.rotary
    table = rotary.context_table().contiguous() if rotary is not None else None
    for t in STOCK_ROWS:
        kv = projected_kv(gen, layers, t, kv_heads)
        positions = torch.randint(0, 4096, (t,), generator=gen, device="cuda")
        num_blocks = (t + 40) // BLOCK + 2
        slots = make_slots(gen, t, num_blocks * BLOCK)
        what = f"{_store_name(case)} {layout} T={t}"
        for which in (0, 1):
            ours = make_caches(layers, kv_heads, num_blocks, layout)
            ref = make_caches(layers, kv_heads, num_blocks, layout)
            spec = make_caches(layers, kv_heads, num_blocks, layout)
            for cache in ours + ref + spec:
                poison(cache.tensor, which)
            stock_context_store(stock, kv, positions, ref, slots, kv_heads, eps, table)
            DraftModel.context_kv_store(model, kv, positions, spec, slots)
            store.run(kv, positions, ours, slots)
            torch.cuda.synchronize()
            for i in range(layers):
                assert_bitwise(ours[i].tensor, ref[i].tensor, f"{what} layer {i} against the stock (poison {which})")
                assert_bitwise(ours[i].tensor, spec[i].tensor, f"{what} layer {i} against the spec (poison {which})")
                assert_untouched(ours[i].tensor, slots, POISONS[BF16][which], f"{what} layer {i}")


def test_store_without_pdl(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    case = (8, 2, FP32, 1e-6)
    store, stock = make_store(case, pdl=False)
    t, num_blocks = 133, 12
    kv = projected_kv(gen, 2, t, 8)
    positions = torch.randint(0, 4096, (t,), generator=gen, device="cuda")
    check_store(store, stock, kv, positions, make_slots(gen, t, num_blocks * BLOCK), 2, 8, num_blocks, "no PDL")


# ---------------------------------------------------------------- the chain


CHAINS = {
    "small": dict(),
    "h8192-fp32w-before-fp32rope": dict(
        hidden_size=8192, num_heads=16, num_kv_heads=8, max_position=4096, rope_table_dtype="fp32",
        norm_weight_dtype="fp32", norm_gain_center=1.0, norm_weight_before_norm=True, rms_norm_eps=1e-5,
    ),
    "L9-kv32-noweight-norope": dict(
        num_layers=9, num_heads=32, num_kv_heads=32, use_rope=False, norm_has_weight=False,
        norm_overrides={"hidden_norm": {"has_weight": True, "weight_dtype": "fp16"}},
    ),
}


def chain_model(name: str, seed: int) -> DraftModel:
    return DraftModel(small_config(seed=seed % 2**31, **CHAINS[name]), device="cuda")


def chain_inputs(model, gen, t: int):
    c = model.config
    states = context_rows(gen, t, c.hidden_size)
    positions = torch.randint(0, c.max_position, (t,), generator=gen, device="cuda")
    num_blocks = (t + 40) // BLOCK + 2
    slots = make_slots(gen, t, num_blocks * BLOCK)
    return states, positions, slots, num_blocks


def compare_chain(model, run_fused, states, positions, slots, num_blocks, what: str, layout: str = "LBHNC") -> None:
    for which in (0, 1):
        ours, ref = model.make_caches(num_blocks, "cuda", layout), model.make_caches(num_blocks, "cuda", layout)
        for cache in ours + ref:
            poison(cache.tensor, which)
        model.precompute_and_store_context_kv(states, positions, ref, slots)
        run_fused(states, positions, ours, slots)
        torch.cuda.synchronize()
        for i in range(len(ours)):
            assert_bitwise(ours[i].tensor, ref[i].tensor, f"{what} layer {i} (poison {which})")
            assert_untouched(ours[i].tensor, slots, POISONS[BF16][which], f"{what} layer {i}")


@pytest.mark.parametrize("name", list(CHAINS))
def test_chain_matches_precompute(name, seed):
    from dspark_core.reference.adapter import describe
    from dspark_cute.cutedsl.context.chain import ContextChain

    gen = torch.Generator(device="cuda").manual_seed(seed)
    model = chain_model(name, seed)
    chain = ContextChain.of_draft(describe(model))
    chain.prepare()
    for t in (1, 16, 133):
        states, positions, slots, num_blocks = chain_inputs(model, gen, t)
        compare_chain(model, lambda *a: ContextChain.of_draft(describe(model)).run(*a), states, positions, slots,
                      num_blocks, f"{name} a fresh ContextChain T={t}")
        for layout in LAYOUTS:
            compare_chain(model, chain.run, states, positions, slots, num_blocks, f"{name} ContextChain {layout} T={t}",
                          layout)


def stock_chain(stock, model, states, positions, caches, slots) -> None:
    """The stock ``precompute_and_store_context_kv`` from vLLM's kernels: the
    stock norms, ``torch.bmm`` against the stacked K/V rows,
    ``stock_context_store`` (layer 0's eps and BF16 table)."""
    normed = stock_context_norms(stock, model.hidden_norm, [layer.input_norm for layer in model.layers], states)
    kv = torch.bmm(normed, model.stacked_kv_weight().transpose(1, 2))
    attn = model.layers[0].self_attn
    table = attn.rotary.context_table().contiguous() if attn.rotary is not None else None
    stock_context_store(stock, kv, positions, caches, slots, model.config.num_kv_heads, attn.qk_norm.eps, table)


def test_chain_against_the_stock(seed):
    """The whole chain (H = 8192, FP32 weights before the norm, the FP32 RoPE
    table) against the stock chain of vLLM's kernels, T in {1, 2, 7, 16, 133,
    4096}, special rows planted."""
    from dspark_core.reference.adapter import describe
    from dspark_cute.cutedsl.context.chain import ContextChain

    stock = stock_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    model = chain_model("h8192-fp32w-before-fp32rope", seed)
    chain = ContextChain.of_draft(describe(model), arch="sm_90a")
    chain.prepare()
    for t, layout in [(t, layout) for t in STOCK_ROWS for layout in LAYOUTS]:
        states, positions, slots, num_blocks = chain_inputs(model, gen, t)
        for which in (0, 1):
            ours = model.make_caches(num_blocks, "cuda", layout)
            ref = model.make_caches(num_blocks, "cuda", layout)
            for cache in ours + ref:
                poison(cache.tensor, which)
            stock_chain(stock, model, states, positions, ref, slots)
            chain.run(states, positions, ours, slots)
            torch.cuda.synchronize()
            for i in range(len(ours)):
                what = f"chain {layout} T={t} layer {i}"
                assert_bitwise(ours[i].tensor, ref[i].tensor, f"{what} against the stock (poison {which})")
                assert_untouched(ours[i].tensor, slots, POISONS[BF16][which], what)


def test_chain_refresh(seed):
    from dspark_core.reference.adapter import describe
    from dspark_cute.cutedsl.context.chain import ContextChain

    gen = torch.Generator(device="cuda").manual_seed(seed)
    model = chain_model("small", seed)
    chain = ContextChain.of_draft(describe(model))
    with torch.no_grad():
        for layer in model.layers:
            layer.input_norm.weight.mul_(1.5)
            layer.self_attn.qkv_proj.mul_(-0.75)
    chain.refresh()
    states, positions, slots, num_blocks = chain_inputs(model, gen, 16)
    compare_chain(model, chain.run, states, positions, slots, num_blocks, "after refresh")


def test_chain_cuda_graph(seed):
    from dspark_core.reference.adapter import describe
    from dspark_cute.cutedsl.context.chain import ContextChain

    gen = torch.Generator(device="cuda").manual_seed(seed)
    model = chain_model("small", seed)
    chain = ContextChain.of_draft(describe(model))
    chain.prepare()
    t = 133
    states, positions, slots, num_blocks = chain_inputs(model, gen, t)
    caches = model.make_caches(num_blocks, "cuda", "LBNHC")  # vLLM's default layout
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain.run(states, positions, caches, slots)  # warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            chain.run(states, positions, caches, slots)
    torch.cuda.synchronize()
    for replay in range(2):
        new_states, new_positions, new_slots, _ = chain_inputs(model, gen, t)
        states.copy_(new_states)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        ref = model.make_caches(num_blocks, "cuda", "LBNHC")
        for which in (0, 1):
            for cache in caches + ref:
                poison(cache.tensor, which)
            model.precompute_and_store_context_kv(states, positions, ref, slots)
            graph.replay()
            torch.cuda.synchronize()
            for i in range(len(caches)):
                assert_bitwise(caches[i].tensor, ref[i].tensor, f"graph replay {replay} layer {i} (poison {which})")
        assert_replays_repeat(graph, [c.tensor for c in caches])


def test_refuses_bad_operands(seed):
    from dspark_cute.cutedsl.norms.context_norms import ContextNorms

    gen = torch.Generator(device="cuda").manual_seed(seed)
    store, _ = make_store((8, 2, BF16, 1e-6))
    t = 7
    kv = projected_kv(gen, 2, t, 8)
    positions = torch.arange(t, device="cuda")
    caches = make_caches(2, 8, 4)
    slots = torch.arange(t, device="cuda")
    assert store.takes(kv, positions, caches, slots)
    assert store.takes(kv, positions, make_caches(2, 8, 4, "LBNHC"), slots)
    bad = [
        (kv.float(), positions, caches, slots),  # the wrong dtype
        (projected_kv(gen, 2, t, 4), positions, caches, slots),  # other KV heads
        (kv, positions.int(), caches, slots),  # int32 positions
        (kv, positions, caches[:1], slots),  # a cache short
        (kv, positions, [caches[0], make_caches(1, 8, 5)[0]], slots),  # caches of two shapes
        (kv, positions, caches, torch.arange(t + 1, device="cuda")),  # more slots than rows
        (kv, positions, caches, [slots]),  # one slot list for two layers
        (kv.transpose(0, 1), positions, caches, slots),  # not contiguous
        # caches of one shape but two layouts (the kernel takes one set of strides)
        (kv, positions, [caches[0], make_caches(1, 8, 4, "LBNHC")[0]], slots),
        # K|V not contiguous in the last dim
        (kv, positions, [torch.empty((4, 8, 128, BLOCK), dtype=BF16, device="cuda").transpose(2, 3)] * 2, slots),
    ]
    for args in bad:
        assert not store.takes(*args)
        with pytest.raises(ValueError):
            store.run(*args)
    hidden = make_norm(NORMS[1], H, gen)
    c = context_norm_consts(hidden, hidden, 2, "sm_90a")
    norms = ContextNorms(c, hidden.weight, torch.stack([hidden.weight, hidden.weight]))
    x = context_rows(gen, 4, H)
    for x_bad in (x.float(), x[:, : H // 2].contiguous(), x[:0], x.flatten()[4 : 4 + 3 * H].view(3, H), x.cpu()):
        assert not norms.takes(x_bad)
        with pytest.raises(ValueError):
            norms.run(x_bad)
    with pytest.raises(ValueError):
        norms.run(x, torch.empty((1, 4, H), dtype=BF16, device="cuda"))


def test_compile_refused_during_capture(seed):
    """Last: a refused capture. Constants no other test compiles."""
    from dspark_cute.cutedsl.context.store import ContextKvStore

    store = ContextKvStore(ContextStoreConstants(4, 2.5e-4, False, "bf16"))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = projected_kv(gen, 1, 3, 4)
    caches = make_caches(1, 4, 2)
    slots = torch.arange(3, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            store.run(kv, None, caches, slots)
