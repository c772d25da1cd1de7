"""fc and the LM head on the ordered GEMM (``dspark_vllm.projections``),
on the CPU with vLLM's own unquantized methods and a stand-in ordered GEMM:
installed only where the decode's plan runs the ordered GEMM, each call
routed to the GEMM only at a bound row count without a bias (vLLM's own
method otherwise, the method's class kept), and every refusal said once
with its reason."""

from __future__ import annotations

import logging
import random
import types

import pytest
import torch

pytest.importorskip("vllm")

import _stubs  # noqa: E402

from dspark_vllm import projections  # noqa: E402

SEED = random.randrange(2**31)
print(f"seed {SEED}")


class StandIn(_stubs.OrderedGemm):
    """The plugin tests' ordered-GEMM stub that launches: ``launch`` marks
    its output (all 7.0), so a test sees which path ran."""

    max_rows = 64
    built: list = []

    def __init__(self, constants, weight):
        super().__init__(constants, weight)
        self.constants = constants
        StandIn.built.append(self)

    def launch(self, x, out=None):
        return torch.full((x.shape[0], self.constants.n), 7.0, dtype=x.dtype)


def _layer(n, k, quantized=False):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    gen = torch.Generator().manual_seed(SEED)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(n, k, generator=gen).to(torch.bfloat16), requires_grad=False)
    from vllm.model_executor.layers.utils import default_unquantized_gemm

    layer.quant_method = object() if quantized else UnquantizedLinearMethod()
    if not quantized:
        layer.quant_method._gemm_impl = default_unquantized_gemm  # what "auto" chooses on CUDA
    return layer


def _model(fc, lm_head):
    return types.SimpleNamespace(model=types.SimpleNamespace(fc=fc), lm_head=lm_head)


def _plan(ordered=True, reason=None):
    return types.SimpleNamespace(draft_reason=reason, ordered_gemms=[types.SimpleNamespace(fused=ordered)])


@pytest.fixture
def bound(monkeypatch):
    """The check binds rows 4 and 8 (the others refused), whatever the
    weight; gemm_reason passes the CPU weights."""
    checked = []

    def check(weight, rows, run_order, seed, reference=None, **kw):
        checked.append((tuple(weight.shape), list(rows)))
        x = torch.randn(3, weight.shape[1]).to(torch.bfloat16)
        assert torch.equal(reference(x, weight), torch.nn.functional.linear(x, weight))  # vLLM's own call
        return types.SimpleNamespace(orders={4: "order", 8: "order"}, refused={1: "refused at 1"},
                                     summary=lambda: "bound 4, 8")

    monkeypatch.setattr(projections.gemm_check, "check_projection", check)
    monkeypatch.setattr(projections, "gemm_reason", lambda layer, what: None)
    StandIn.built = []
    return checked


def test_calls_route_to_the_gemm_at_bound_rows_only(bound, caplog):
    fc, head = _layer(64, 192), _layer(128, 64)
    outer = projections.OuterProjections(_model(fc, head), StandIn, step_rows=range(4, 65, 4))
    with caplog.at_level(logging.INFO, logger="dspark.vllm"):
        outer.build(_plan())
    assert set(outer.gemms) == {"fc", "lm_head"} and not outer.reasons
    # fc is checked at 1 to 64 rows (its context tokens), the head at the step's rows.
    assert bound == [((64, 192), list(range(1, 65))), ((128, 64), list(range(4, 65, 4)))]
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    for layer, k in ((fc, 192), (head, 64)):
        method = layer.quant_method
        assert type(method) is UnquantizedLinearMethod  # isinstance checks of vLLM's still hold
        for m in (1, 3, 4, 8, 9):
            x = torch.randn(m, k).to(torch.bfloat16)
            y = method.apply(layer, x)
            marked = bool((y == 7.0).all())
            assert marked == (m in (4, 8)), m
            if not marked:
                assert torch.equal(y, torch.nn.functional.linear(x, layer.weight))
        bias = torch.zeros(layer.weight.shape[0], dtype=torch.bfloat16)
        x = torch.randn(4, k).to(torch.bfloat16)
        assert not bool((method.apply(layer, x, bias) == 7.0).all())  # a bias: vLLM's own
    assert UnquantizedLinearMethod().apply.__func__ is UnquantizedLinearMethod.apply  # the class is untouched
    assert sum("decided" in r.getMessage() or "found its order" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(("plan", "words"), [
    (None, "the DSpark decode is not built"),
    (_plan(reason="not CUDA"), "the DSpark decode is not built"),
    (_plan(ordered=False), "runs no projection on the ordered GEMM"),
])
def test_no_ordered_gemm_in_the_plan_keeps_vllms_gemm(bound, caplog, plan, words):
    fc, head = _layer(64, 192), _layer(128, 64)
    outer = projections.OuterProjections(_model(fc, head), StandIn)
    with caplog.at_level(logging.INFO, logger="dspark.vllm"):
        outer.build(plan)
    assert not outer.gemms and not StandIn.built and all(words in r for r in outer.reasons.values())
    assert "apply" not in vars(fc.quant_method) and "apply" not in vars(head.quant_method)
    assert sum(words in r.getMessage() for r in caplog.records) == 2


def test_refusals_keep_that_projection_on_vllms_gemm(bound, monkeypatch):
    class Refusing(StandIn):
        def __init__(self, constants, weight):
            if constants.role == "fc":
                raise ValueError("the stand-in refuses fc")
            super().__init__(constants, weight)

    fc, head = _layer(64, 192), _layer(128, 64)
    outer = projections.OuterProjections(_model(fc, head), Refusing)
    outer.build(_plan())
    assert set(outer.gemms) == {"lm_head"} and outer.reasons == {"fc": "the stand-in refuses fc"}

    def none_bound(weight, rows, run_order, seed, reference=None, **kw):
        return types.SimpleNamespace(orders={}, refused={}, summary=lambda: "none")

    monkeypatch.setattr(projections.gemm_check, "check_projection", none_bound)
    outer = projections.OuterProjections(_model(_layer(64, 192), _layer(128, 64)), StandIn)
    outer.build(_plan())
    assert not outer.gemms and all("no row count" in r for r in outer.reasons.values())


def test_gemm_reason_names_what_vllm_runs_instead():
    assert "has no fc" in projections.gemm_reason(None, "fc")
    assert "quantized" in projections.gemm_reason(_layer(64, 64, quantized=True), "fc")
    assert "CUDA weight" in projections.gemm_reason(_layer(64, 64), "fc")  # a CPU weight
    other = _layer(64, 64)
    other.quant_method._gemm_impl = lambda layer, x, weight, bias=None: x  # --linear-backend's choice
    assert "another backend than F.linear" in projections.gemm_reason(other, "fc")
    assert projections.layer_of(_model(1, 2), "model.fc") == 1 and projections.layer_of(_model(1, 2), "x.y") is None


def test_the_kernel_missing_is_a_reason(bound, monkeypatch):
    def missing(name):
        raise LookupError("no installed backend provides the ordered_gemm kernel")

    monkeypatch.setattr("dspark_core.contracts.kernels.kernel_class", missing)
    outer = projections.OuterProjections(_model(_layer(64, 192), _layer(128, 64)))
    outer.build(_plan())
    assert not outer.gemms and all("no installed backend" in r for r in outer.reasons.values())


def test_the_adapter_names_a_layer_whose_projections_run_another_gemm():
    """``adapter._gemm_backend``: a decoder layer whose linear methods chose
    another GEMM than F.linear when made (``--linear-backend``) is described
    with the reason, so the plan keeps its projections off the ordered GEMM."""
    from vllm.model_executor.layers.utils import dispatch_unquantized_gemm

    from dspark_vllm.adapter import _gemm_backend

    def layer(impl=None):
        linears = {name: _layer(16, 64) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
        for linear in linears.values():
            linear.quant_method._gemm_impl = dispatch_unquantized_gemm()  # this platform's default
        if impl is not None:
            linears["down_proj"].quant_method._gemm_impl = impl
        return types.SimpleNamespace(
            self_attn=types.SimpleNamespace(qkv_proj=linears["qkv_proj"], o_proj=linears["o_proj"]),
            feed_forward=types.SimpleNamespace(gate_up_proj=linears["gate_up_proj"], down_proj=linears["down_proj"]))

    assert _gemm_backend(layer()) is None

    def cuda_flashinfer_bf16_gemm(layer, x, weight, bias=None):
        return x

    assert "cuda_flashinfer_bf16_gemm (--linear-backend)" in _gemm_backend(layer(cuda_flashinfer_bf16_gemm))


def test_a_failure_while_binding_keeps_vllms_gemm_and_a_rebuild_starts_clean(bound):
    """Any exception while a projection is bound (a failed compile, an out
    of memory) keeps vLLM's GEMM for it with the reason, never an exception
    out of model loading; a second build first removes what the first
    installed, so a refusal then leaves vLLM's own call."""
    fc, head = _layer(64, 192), _layer(128, 64)
    model = _model(fc, head)
    outer = projections.OuterProjections(model, StandIn)
    outer.build(_plan())
    assert "apply" in vars(fc.quant_method) and set(outer.gemms) == {"fc", "lm_head"}

    class Failing(StandIn):
        def bind_orders(self, orders, reasons=None):
            raise RuntimeError("ptxas: out of resources")

    again = projections.OuterProjections(model, Failing)
    again.build(_plan())
    assert not again.gemms and all("RuntimeError: ptxas: out of resources" in r for r in again.reasons.values())
    assert "apply" not in vars(fc.quant_method) and "apply" not in vars(head.quant_method)
    outer.build(_plan(ordered=False))  # the first object rebuilt: its state starts over
    assert not outer.gemms and set(outer.reasons) == {"fc", "lm_head"}
