"""The specialized decode on one GPU: the whole draft forward of the
reference config (hidden 8192) bit for bit the stock forward, eagerly and
in whole-step CUDA graphs; refused parts still bit for bit; the fused context
chain; the caches in vLLM's default layout (LBNHC, strided views); with the
one-token GEMV, the same greedy tokens over a 64-step decode."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.runtime.build import build_draft_decode as build_description
from dspark_core.tools.compare import assert_bitwise
from dspark_core.tools.graphs import StepGraph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nox -s tests-sm90)"),
]

SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
print(f"DSPARK_SEED={SEED}")
CONTEXT = 300
SPAN = 512  # attn_slots width: every step of a test shares one graph shape


def build_draft_decode(model, **options):
    """The specialized decode of a reference draft: core's executor over its
    description, with the installed kernels (dspark-cute's)."""
    return build_description(describe(model), **options)


def _reference(**changes) -> DraftModel:
    config = DraftConfig(**{"num_layers": 3, "intermediate_size": 8192, "seed": SEED % 10_000, **changes})
    return DraftModel(config, device="cuda")


@pytest.fixture(scope="module")
def model():
    return _reference()


def _with_context(model, decode=None, layout: str = "LBHNC"):
    gen = torch.Generator().manual_seed(SEED + 7)
    states = torch.randn(CONTEXT, model.config.hidden_size, generator=gen).to(torch.bfloat16).cuda()
    positions = torch.arange(CONTEXT, device="cuda")
    caches = model.make_caches(SPAN // model.config.kv_block_size + 1, "cuda", layout)
    for cache in caches:
        cache.tensor.fill_(float("nan"))  # poisoned: a slot nobody wrote shows
    if decode is None or not decode.store_context_kv(states, positions, caches, positions):
        model.precompute_and_store_context_kv(states, positions, caches, positions)
    return caches


def _hidden(model, m, dtype):
    gen = torch.Generator().manual_seed(SEED + m)
    x = torch.randn(m, model.config.hidden_size, generator=gen)
    if m >= 2:
        x[-1, :4] = torch.tensor([-0.0, 1e-40, 65504.0, -3.0e4])
    return x.to(dtype).cuda()


@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_forward_is_the_stock_forward(model, m, dtype):
    decode = build_draft_decode(model)  # the default: the opt-in kernels declined
    assert decode is not None and all(e is not None for e in decode.epilogues)
    fused, _ = decode.plan.fused_count()
    assert fused >= 1 + len(model.boundaries())
    ref_caches, got_caches = _with_context(model), _with_context(model, decode)
    for c_ref, c_got in zip(ref_caches, got_caches):
        assert_bitwise(c_got.tensor, c_ref.tensor, "context caches")
    _two_steps_bitwise(model, decode, _hidden(model, m, dtype), ref_caches, got_caches, f"draft forward m={m}")


@pytest.mark.parametrize("m", [1, 16])
def test_whole_forward_on_vllms_default_kv_layout(model, m):
    """The caches in LBNHC (vLLM's default on sm_90: each layer's [blocks,
    kv_heads, block_size, 128] view strided): the context chain and the QKV
    epilogues write them through their strides, bit for bit the stock
    forward's caches and output (the fused paged attention takes contiguous
    caches only: it runs stock there, logged)."""
    decode = build_draft_decode(model)
    ref_caches, got_caches = _with_context(model, layout="LBNHC"), _with_context(model, decode, "LBNHC")
    assert not got_caches[0].tensor.is_contiguous()
    for c_ref, c_got in zip(ref_caches, got_caches):
        assert_bitwise(c_got.tensor, c_ref.tensor, "context caches (LBNHC)")
    _two_steps_bitwise(model, decode, _hidden(model, m, torch.bfloat16), ref_caches, got_caches, f"LBNHC m={m}")


def _two_steps_bitwise(model, decode, x, ref_caches, got_caches, what: str, graph=None) -> None:
    """Two steps of ``x`` (the second reads the first's K/V): the decode's
    output and caches bit for bit the stock forward's; the second step's
    ``graph`` replay too, where given (its capture ran the first step)."""
    m = x.shape[0]
    for start in (CONTEXT, CONTEXT + m):
        step = StepInputs.block(start, m, "cuda", span=SPAN)
        ref = model(x, step, ref_caches)
        assert_bitwise(decode.run(x, step, got_caches), ref, f"{what} at {start}")
        for c_ref, c_got in zip(ref_caches, got_caches):
            assert_bitwise(c_got.tensor, c_ref.tensor, f"{what}: caches after the step")
        if graph is not None and start != CONTEXT:
            assert_bitwise(graph.replay(x, step), ref, f"{what}: graph replay")


@pytest.mark.parametrize("m", [1, 7, 16])
def test_direct_attention_variant_is_the_stock_forward(model, m):
    """The "direct" attention variant (K/V read from global memory, a
    contiguous q, the o-gate a kernel of its own) keeps the whole forward bit
    for bit, eagerly and in a graph replay."""
    decode = build_draft_decode(model, attention_variant="direct")
    assert all(k is not None and not k.gated for k in decode.attentions)
    staged = build_draft_decode(model, attention_variant="staged")
    assert all(k is not None and k.gated for k in staged.attentions)
    ref_caches, got_caches = _with_context(model), _with_context(model, decode)
    x = _hidden(model, m, torch.bfloat16)
    step = StepInputs.block(CONTEXT, m, "cuda", span=SPAN)
    assert_bitwise(decode.run(x, step, got_caches), model(x, step, ref_caches), f"direct attention m={m}")
    graph_caches = _with_context(model)
    decode.run(x, step, graph_caches)  # the first step's K/V, as ref_caches hold it
    step1 = StepInputs.block(CONTEXT + m, m, "cuda", span=SPAN)
    graph = StepGraph(decode.run, x, step1, graph_caches)
    assert_bitwise(graph.replay(x, step1), model(x, step1, ref_caches), "direct attention graph replay")


@pytest.mark.parametrize("m", [1, 16])
def test_the_weight_prefetch_changes_no_bit(model, m):
    """With the L2 weight prefetch on (a PDL dependent of the small kernel
    after each GEMM that completes only after it), the forward is still the
    stock forward bit for bit, eagerly and in a graph replay (the capture ends
    with nothing pending)."""
    decode = build_draft_decode(model, prefetch=True)
    assert decode.prefetcher is not None
    ref_caches, got_caches = _with_context(model), _with_context(model, decode)
    x = _hidden(model, m, torch.bfloat16)
    step = StepInputs.block(CONTEXT, m, "cuda", span=SPAN)
    assert_bitwise(decode.run(x, step, got_caches), model(x, step, ref_caches), f"prefetch m={m}")
    assert not decode.prefetcher.pending
    graph_caches = _with_context(model)
    decode.run(x, step, graph_caches)
    step1 = StepInputs.block(CONTEXT + m, m, "cuda", span=SPAN)
    graph = StepGraph(decode.run, x, step1, graph_caches)
    assert_bitwise(graph.replay(x, step1), model(x, step1, ref_caches), "prefetch graph replay")


@pytest.mark.parametrize("pdl", [False, True])
def test_the_weight_prefetch_kernel_stays_inside_odd_weights(pdl):
    """Prefetches (either variant) of weights whose rows are not whole lines,
    a row-slice view, one row, and more rows than the grid has threads, each
    at the end of an allocation: no fault, and no byte of the weights
    changes."""
    from dspark_cute.cutedsl.prefetch import WeightPrefetch

    prefetch = WeightPrefetch(pdl=pdl)
    prefetch.prepare()
    weights = [
        torch.randn(3, 100, device="cuda"),  # 400-byte rows: 3 lines a row at most
        torch.randn(1, 8192, device="cuda").to(torch.bfloat16),
        torch.randn(9000, 72, device="cuda").to(torch.bfloat16),  # 144-byte rows, 9000 > 8192 threads
        torch.randn(64, 256, device="cuda").to(torch.bfloat16)[5:37],  # a row-slice view
    ]
    before = [w.clone() for w in weights]
    for w in weights:
        for nbytes in (128, 256, 4096):
            prefetch.run(w, nbytes)
    torch.cuda.synchronize()
    for w, b in zip(weights, before):
        assert_bitwise(w, b, "a prefetched weight")


@pytest.mark.parametrize("m", [1, 16])
def test_whole_step_graph_replays_are_the_eager_step(model, m):
    decode = build_draft_decode(model)
    eager_caches, graph_caches = _with_context(model), _with_context(model)
    x = _hidden(model, m, torch.bfloat16)
    step0 = StepInputs.block(CONTEXT, m, "cuda", span=SPAN)
    graph = StepGraph(decode.run, x, step0, graph_caches)
    # The graph's warm-up wrote the first step's K/V already; so does eager.
    decode.run(x, step0, eager_caches)
    for i in range(3):
        step = StepInputs.block(CONTEXT + i * m, m, "cuda", span=SPAN)
        want = decode.run(x, step, eager_caches)
        got = graph.replay(x, step)
        assert_bitwise(got, want, f"graph replay {i}")
        stock = model(x, step, _with_context(model)) if i == 0 else None
        if stock is not None:
            assert_bitwise(got, stock, "graph replay vs stock")


def test_refused_parts_are_still_the_stock_bits():
    model = _reference(
        num_layers=2,
        connection_overrides={"layers.0.add_ffn": {"dtype": "bf16"}},
        norm_overrides={"layers.1.pre_ffn_norm": {"weight_dtype": "fp16", "gain_center": 1.0}},
    )
    decode = build_draft_decode(model)
    assert decode.boundaries[1] is None and decode.boundaries[2] is not None
    caches_ref, caches_got = _with_context(model), _with_context(model, decode)
    x = _hidden(model, 5, torch.bfloat16)
    step = StepInputs.block(CONTEXT, 5, "cuda", span=SPAN)
    assert_bitwise(decode.run(x, step, caches_got), model(x, step, caches_ref), "refused boundary")


def test_a_non_power_of_two_kv_head_count_keeps_attention_stock():
    model = _reference(num_layers=1, num_heads=48, num_kv_heads=6)
    decode = build_draft_decode(model)  # the QKV epilogue refuses 6 KV heads too
    assert decode.epilogues == [None] and decode.context is None
    caches_ref, caches_got = _with_context(model), _with_context(model, decode)
    x = _hidden(model, 3, torch.bfloat16)
    step = StepInputs.block(CONTEXT, 3, "cuda", span=SPAN)
    assert_bitwise(decode.run(x, step, caches_got), model(x, step, caches_ref), "6 KV heads")


@pytest.mark.parametrize("options", [{"gemv": True}], ids=["gemv"])
def test_greedy_tokens_with_every_fused_part_follow_stock(model, options):
    """64 greedy steps with every fused part, the one-token GEMV projections
    included, both
    decodes fed the stock path's token (teacher forcing; each keeps its own
    caches). The GEMV's projection differs from cuBLAS in its summation
    order (within its stated bound), so the logits are not bitwise: at every
    step where the stock top-two logits are at least ``MARGIN`` apart the
    fused decode must pick the stock token; a step inside the margin (a near
    tie that such an error may flip: the top two of a random draft's 8192
    logits of about N(0, 1) lie within 0.1 about a third of the time) is
    exempt but counted, and at least 32 of the 64 steps must be decisive so
    the test cannot pass vacuously."""
    margin = 0.1
    decode = build_draft_decode(model, **options)
    if "gemv" in options:
        assert len(decode.gemvs) == 4 * len(model.layers)
    caches = {name: _with_context(model, decode if name == "fused" else None) for name in ("stock", "fused")}
    tok = torch.tensor([11], device="cuda")
    agreed, near_ties, worst = 0, 0, 0.0
    for i in range(64):
        step = StepInputs.block(CONTEXT + i, 1, "cuda", span=SPAN)
        x = model.embed_tokens(tok)
        stock = model.logits(model(x, step, caches["stock"]))[0].float()
        fused = model.logits(decode.run(x, step, caches["fused"]))[0].float()
        worst = max(worst, float((stock - fused).abs().max()))
        top2 = stock.topk(2).values
        if float(top2[0] - top2[1]) < margin:
            near_ties += 1
        else:
            assert int(stock.argmax()) == int(fused.argmax()), f"step {i}: tokens differ at a stock margin of {top2}"
            agreed += 1
        tok = stock.argmax().view(1)
    print(f"greedy: {agreed} decisive steps agreed, {near_ties} near ties exempt; max |logit diff| {worst:.4f}")
    assert agreed >= 32, f"only {agreed} of 64 steps were decisive (margin {margin})"


def _gemv_stock(monkeypatch):
    """The stock forward with every one-row projection computed by the
    GEMV's spec (``dspark_core.spec.gemv.gemv``) instead of cuBLAS."""
    from dspark_core.reference import adapter as adapter_module
    from dspark_core.reference import model as model_module
    from dspark_core.spec import gemv as spec
    from dspark_core.spec import layers

    stock = layers.linear

    def linear(x, weight):
        if x.shape[0] == 1 and spec.gemv_unsupported(weight) is None:
            return spec.gemv(x.to(weight.dtype), weight)
        return stock(x, weight)

    monkeypatch.setattr(layers, "linear", linear)
    monkeypatch.setattr(model_module, "linear", linear)
    monkeypatch.setattr(adapter_module, "linear", linear)


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_decode_is_the_stock_forward_with_gemv_projections(model, m, monkeypatch):
    """With ``gemv=True`` a one-token step is bit for bit the stock forward
    whose projections are the GEMV's spec (eagerly and in a whole-step CUDA
    graph); a step of more tokens is bit for bit the plain stock forward."""
    decode = build_draft_decode(model, gemv=True)
    assert len(decode.gemvs) == 4 * len(model.layers) and decode.prefetcher is not None
    ref_caches, got_caches, graph_caches = _with_context(model), _with_context(model, decode), _with_context(model)
    x = _hidden(model, m, torch.bfloat16)
    graph = StepGraph(decode.run, x, StepInputs.block(CONTEXT, m, "cuda", span=SPAN), graph_caches)
    if m == 1:
        _gemv_stock(monkeypatch)
    _two_steps_bitwise(model, decode, x, ref_caches, got_caches, f"gemv decode m={m}", graph)
