"""The KV cache layout in the plugin, against the real vLLM 0.33.0: the
layout is read from the bound cache (each draft layer's ``attn.kv_cache``,
views ``create_kv_cache_views`` makes for each of vLLM's ``KVCacheLayout``
orders), never from ``VLLM_KV_CACHE_LAYOUT``; the DSpark inserts take every
one of them through its strides, so the plan fuses them without knowing
the layout at build; at the first call with a bound cache the plugin names
the layout, and where the inserts do not take the bound cache (here: views
off the 16-byte store width) it makes them stock with a reason naming the
layout found, once, and the step equals vLLM's forward."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
import _stubs  # noqa: E402
import test_executor  # noqa: E402
from test_executor import CTX, GPU, M, _assert_same, _specialized  # noqa: E402

from dspark_core.planner import policy  # noqa: E402
from dspark_vllm import deployment, planning  # noqa: E402
from dspark_vllm.adapter import describe_vllm  # noqa: E402

# test_executor's fixtures (module-scoped: built again for this module): the
# checkpoint, vLLM's stock draft with its block, and the plugin's log lines.
dirs, stock, vllm_log = test_executor.dirs, test_executor.stock, test_executor.vllm_log

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
INSERTS = ["the context K/V chain", "layer 0's QKV epilogue", "layer 1's QKV epilogue"]


def test_the_names_are_vllms():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert set(deployment.VLLM_LAYOUTS) == set(LAYOUTS) == {layout.name for layout in KVCacheLayout}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layout_is_read_from_the_bound_cache(stock, layout, monkeypatch):
    """Each of vLLM's layouts, bound as vLLM binds it, is named from the views
    alone (the environment says another) and taken by the inserts."""
    built, _ = stock
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBHNC" if layout != "LBHNC" else "LBNHC")
    caches = _draft.kv_caches(built.model, built.config, layout=layout)
    try:
        assert deployment.kv_cache_layout(caches) == layout
        assert deployment.bound_layout_unsupported(caches, built.model.model._num_kv_heads) is None
    finally:
        _draft.kv_caches(built.model, built.config)  # the module's other tests bind LBNHC


def test_a_cache_the_inserts_do_not_address_is_refused_naming_its_layout(stock):
    built, _ = stock
    caches = _draft.kv_caches(built.model, built.config, layout="BLNHC", offset=8)  # 8 bytes off the 16-byte rows
    try:
        why = deployment.bound_layout_unsupported(caches, built.model.model._num_kv_heads)
        assert why.startswith("the bound KV cache (layout BLNHC) is not one the DSpark inserts address: ")
        assert "multiples of 16 bytes" in why
    finally:
        _draft.kv_caches(built.model, built.config)


def test_the_plan_fuses_the_inserts_without_a_layout(stock, monkeypatch):
    built, _ = stock
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")  # vLLM's sm_90 default: no longer a refusal
    draft = describe_vllm(built.model.model)
    plan = planning.plan_vllm(draft, GPU, exact=policy.ALL_KERNELS)
    assert plan.fused_count() == (12, 14)
    assert all(p.fused for p in [plan.context, *plan.qkv_epilogues])
    for name in ("LBNHC", "NHD", "HND", "BHLNC"):  # a layout the plan CLI is given by name
        named = planning.plan_vllm(describe_vllm(built.model.model, kv_cache_layout=name), GPU,
                                   exact=policy.ALL_KERNELS)
        assert named.fused_count() == (12, 14), name
    odd = planning.plan_vllm(describe_vllm(built.model.model, kv_cache_layout="LNBHC"), GPU, exact=policy.ALL_KERNELS)
    reasons = {p.name: p.reason for p in odd.parts() if not p.fused}
    assert [reasons[n] for n in INSERTS] == ["the KV cache layout 'LNBHC' is none of vLLM 0.33.0's (LBHNC, LBNHC, "
                                             "LHBNC, BLHNC, BLNHC, BHLNC, or the legacy NHD, HND)"] * 3


def test_restock_inserts_names_what_it_changed(stock):
    built, _ = stock
    plan = planning.plan_vllm(describe_vllm(built.model.model), GPU, exact=policy.ALL_KERNELS)
    fused = plan.fused_count()
    restocked, names = planning.restock_inserts(plan, "a reason")
    assert names == INSERTS and plan.fused_count() == fused  # a new plan: the one given is left as it was
    assert restocked.fused_count() == (9, 14)
    assert all(p.reason == "a reason" for p in [restocked.context, *restocked.qkv_epilogues])
    again, names = planning.restock_inserts(restocked, "another")
    assert names == [] and again.context.reason == "a reason"  # stock parts keep their reason


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_the_plugin_fuses_the_inserts_on_the_bound_layout(dirs, stock, monkeypatch, vllm_log, layout):
    """The plugin's class over caches vLLM lays out in ``layout``: the inserts
    run fused (the stubs write through the strides as the kernels do), the
    layout is said once, and the step is vLLM's forward, caches included."""
    built = _specialized(dirs, monkeypatch, policy.ALL_KERNELS)
    monkeypatch.setattr(_draft, "kv_caches", _with_layout(_draft.kv_caches, layout))
    want = _draft.run_block(stock[0].model, stock[0].config, CTX, M)
    _stubs.CALLS.clear()
    _assert_same(_draft.run_block(built.model, built.config, CTX, M), want)
    kinds = [c[0] for c in _stubs.CALLS]
    assert kinds.count("context_chain") == 1 and kinds.count("qkv_epilogue") == 2
    assert vllm_log.count(f"INFO The DSpark KV inserts write the bound {layout} KV cache through its strides.") == 1
    _draft.run_block(built.model, built.config, CTX, M)
    assert sum("KV inserts write the bound" in line for line in vllm_log) == 1  # read once
    monkeypatch.undo()
    _draft.kv_caches(stock[0].model, stock[0].config)


def test_the_plugin_makes_the_inserts_stock_where_the_bound_cache_is_not_taken(dirs, stock, monkeypatch, vllm_log):
    built = _specialized(dirs, monkeypatch, policy.ALL_KERNELS)
    monkeypatch.setattr(_draft, "kv_caches", _with_layout(_draft.kv_caches, "LBNHC", offset=8))
    want = _draft.run_block(stock[0].model, stock[0].config, CTX, M)
    _stubs.CALLS.clear()
    _assert_same(_draft.run_block(built.model, built.config, CTX, M), want)
    kinds = [c[0] for c in _stubs.CALLS]
    assert "context_chain" not in kinds and "qkv_epilogue" not in kinds and "row_norm" in kinds
    plan = built.model.dspark.plan
    why = plan.context.reason
    assert why.startswith("the bound KV cache (layout LBNHC) is not one the DSpark inserts address")
    assert [p.reason for p in plan.qkv_epilogues] == [why, why]
    assert vllm_log.count(f"INFO The DSpark draft keeps vLLM's stock code for {', '.join(INSERTS)}: {why}.") == 1
    monkeypatch.undo()
    _draft.kv_caches(stock[0].model, stock[0].config)


def _with_layout(kv_caches, layout: str, offset: int = 0):
    return lambda model, config, num_blocks=4: kv_caches(model, config, num_blocks, layout, offset)
