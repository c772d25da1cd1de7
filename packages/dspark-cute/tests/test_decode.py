"""The executor's plan-following and refusal logic on the CPU: kernels are
replaced by recording stand-ins that compute the spec, so what is checked is
which part runs where, and that the result is the stock forward's bits."""

from __future__ import annotations

import logging

import pytest
import torch

from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.spec.attention import paged_attention
from dspark_core.spec.layers import o_gate, residual_boundary
from dspark_core.tools.compare import assert_bitwise
from dspark_cute import decode as decode_module
from dspark_cute.decode import DraftDecode, build_draft_decode

ALL = policy.Target(kernels=policy.ALL_KERNELS)


class FakeBoundary:
    """Computes the spec's boundary; records each launch; covers up to ``rows``."""

    def __init__(self, index, bound, rows=16):
        self.index, self.bound, self.rows, self.calls = index, bound, rows, []

    def takes(self, branch, stream):
        return branch.shape[0] <= self.rows

    def launch(self, branch, stream, store):
        self.calls.append((branch.shape[0], store, stream.dtype))
        new_stream, out = residual_boundary(*self.bound, branch, stream)
        return (new_stream if store else None), out


class FakeNorm:
    def __init__(self, norm):
        self.norm, self.calls = norm, 0

    def takes(self, x):
        return True

    def launch(self, x):
        self.calls += 1
        return self.norm(x, out_dtype=torch.bfloat16)


class FakeAttention:
    """The spec's attention; records each launch (``check`` as the kernel's:
    shapes only). ``norm``: the staged variant with the o-gate in its
    epilogue (it takes a strided q and ``gate=``)."""

    def __init__(self, kv_heads, norm=None):
        self.kv_heads, self.calls, self.norm = kv_heads, [], norm
        self.gated = self.takes_strided_q = norm is not None

    def check(self, q, cache, attn_slots, out=None, gate=None):
        if not self.takes_strided_q and not q.is_contiguous():
            raise ValueError("q must be contiguous")
        if (gate is not None) != self.gated:
            raise ValueError("a gate exactly when the kernel applies the o-gate")

    def launch(self, q, cache_tensor, attn_slots, out=None, gate=None):
        self.calls.append((q.shape[0], q.is_contiguous(), gate is not None))
        cache = next(c for c in self.caches if c.tensor.data_ptr() == cache_tensor.data_ptr())
        out = paged_attention(q, cache, attn_slots, self.kv_heads)
        return o_gate(out, gate, self.norm) if gate is not None else out


class FakeEpilogue:
    """QK-norm, RoPE and the insert of the stock projection (the spec's front
    after ``linear``); records the rows of each launch."""

    def __init__(self, attn, caches_of):
        self.attn, self.caches_of, self.calls = attn, caches_of, []

    def takes(self, qkv, positions, slots, cache_tensor):
        return True

    def launch(self, qkv, positions, slots, cache_tensor):
        self.calls.append(qkv.shape[0])
        cache = next(c for c in self.caches_of() if c.tensor.data_ptr() == cache_tensor.data_ptr())
        step = StepInputs(positions, slots, torch.zeros(qkv.shape[0], 1, dtype=torch.int64))
        return self.attn.front_from(qkv, step, cache)[0]


class FakeOGate:
    def __init__(self, norm, rows=16):
        self.norm, self.rows, self.calls = norm, rows, 0

    def takes(self, attn, gate):
        return attn.shape[0] <= self.rows

    def launch(self, attn, gate):
        self.calls += 1
        return o_gate(attn, gate, self.norm)


class FakeActivation:
    def __init__(self, mlp):
        self.mlp, self.calls = mlp, 0

    def takes(self, gu):
        return True

    def launch(self, gu):
        self.calls += 1
        return self.mlp.activation(gu)


def _decode(model, target=ALL, rows=16):
    plan = plan_draft(model, target)
    decode = DraftDecode(model, plan)
    decode.boundaries = [
        FakeBoundary(i, b, rows) if part.fused else None
        for i, (part, b) in enumerate(zip(plan.boundaries, model.boundaries()))
    ]
    decode.input_norm = FakeNorm(model.layers[0].input_norm) if plan.input_norm.fused else None
    decode.fronts = [None] * len(model.layers)
    decode.epilogues = [None] * len(model.layers)
    layers = list(zip(model.layers, plan.attentions, plan.o_gates, plan.mlp_activations))
    decode.attentions = [FakeAttention(layer.self_attn.num_kv_heads) if a.fused else None for layer, a, _, _ in layers]
    decode.o_gates = [FakeOGate(layer.self_attn.o_norm, rows) if g.fused else None for layer, _, g, _ in layers]
    decode.activations = [FakeActivation(layer.mlp) if f.fused else None for layer, _, _, f in layers]
    decode.prepared = True
    return decode


def _step_both(model, decode, m, hidden_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(m)
    hidden = torch.randn(m, model.config.hidden_size, generator=gen).to(hidden_dtype)
    outs = []
    for fn in (model.forward, decode.run):
        caches = model.make_caches(4)
        for kernel in decode.attentions:
            if kernel is not None:
                kernel.caches = caches
        outs.append((fn(hidden, StepInputs.block(3, m), caches), caches))
    return outs


def test_on_a_cpu_the_build_says_not_cuda_and_returns_none(caplog, monkeypatch):
    monkeypatch.setattr(decode_module, "_logged", set())  # each reason is logged once per process
    model = DraftModel(small_config(num_layers=1))
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        assert build_draft_decode(model) is None
    assert "the DSpark draft keeps its stock layers: not CUDA" in caplog.text


def test_the_fused_qkv_front_is_opt_in(monkeypatch):
    """``draft_plan`` (the plan ``build_draft_decode`` runs) leaves the QKV
    front stock unless asked for it, so the default decode is bit for bit;
    the QKV epilogue then takes each layer's stock projection."""
    model = DraftModel(small_config())
    monkeypatch.setattr(decode_module, "device_target", lambda device, tp: ALL.replace(tp=tp))
    default = decode_module.draft_plan(model)
    assert [p.reason for p in default.qkv_fronts] == [policy.OPT_IN[policy.QKV_FRONT]] * 2
    assert "opt-in (qkv_front=True)" in default.qkv_fronts[0].reason
    assert all(p.fused for p in default.qkv_epilogues)
    opted = decode_module.draft_plan(model, qkv_front=True)
    assert all(p.fused for p in opted.qkv_fronts)
    assert decode_module.draft_plan(model, exclude={"boundary"}, qkv_front=True).target.excluded == {"boundary"}
    excluded = decode_module.draft_plan(model, exclude={policy.QKV_FRONT})  # the caller's word wins
    assert excluded.qkv_fronts[0].reason == "the caller excluded the qkv_front kernel"
    assert excluded.target.declined == {policy.GEMV}


def test_the_one_token_gemv_is_opt_in(monkeypatch):
    """``draft_plan`` declines the GEMV projections unless ``gemv=True``
    (they sum in the spec's stated order, not cuBLAS's); the build on a CPU
    still says "not CUDA"; DSPARK_GEMV=1 asks for them."""
    model = DraftModel(small_config())
    monkeypatch.setattr(decode_module, "device_target", lambda device, tp: ALL.replace(tp=tp))
    default = decode_module.draft_plan(model)
    assert len(default.gemvs) == 8 and all(p.declined for p in default.gemvs)
    assert "opt-in (gemv=True)" in default.gemvs[0].reason
    opted = decode_module.draft_plan(model, gemv=True)
    assert all(p.fused for p in opted.gemvs)
    assert [p.constants.role for p in opted.gemvs[:4]] == list(policy.GEMV_ROLES)
    tp2 = decode_module.draft_plan(model, tp=2, gemv=True)
    assert tp2.gemvs == []  # at TP the branch GEMMs feed the all-reduce


def test_the_gemv_runs_one_row_and_says_why_not_otherwise(monkeypatch, caplog):
    """``DraftDecode._linear``: a bound GEMV takes a one-row operand it
    covers; anything else runs the stock projection, logged with the reason."""
    model = DraftModel(small_config(num_layers=1))
    calls = []

    class FakeGemv:
        def takes(self, x):
            return x.shape[0] == 1 and x.is_contiguous()

        def launch(self, x):
            calls.append(tuple(x.shape))
            return torch.zeros(1, 4)

    monkeypatch.setattr(decode_module, "_logged", set())
    decode = object.__new__(decode_module.DraftDecode)
    decode.gemvs = {(0, "o_proj"): FakeGemv()}
    w = model.layers[0].self_attn.o_proj
    x1 = torch.randn(1, w.shape[1]).to(torch.bfloat16)
    assert decode._linear(0, "o_proj", x1, w).shape == (1, 4) and calls == [(1, w.shape[1])]
    with caplog.at_level(logging.INFO, logger="dspark.decode"):
        x3 = torch.randn(3, w.shape[1]).to(torch.bfloat16)
        assert torch.equal(decode._linear(0, "o_proj", x3, w), torch.matmul(x3, w.t()))
    assert "layer 0's o_proj GEMV ran stock: it takes one contiguous bf16 row, not (3, " in caplog.text
    assert torch.equal(decode._linear(0, "down", x1, w), torch.matmul(x1, w.t()))  # not bound: stock, silent
    assert calls == [(1, w.shape[1])]



def test_a_one_token_step_prefetches_no_gemv_weight():
    """The L2 prefetch skips a weight a bound GEMV streams itself (one-token
    steps only); other weights and steps of more tokens still fork."""
    forks = []

    class FakePrefetcher:
        def fork(self, weight, role):
            forks.append(role)

    decode = object.__new__(decode_module.DraftDecode)
    decode.prefetcher = FakePrefetcher()
    gemv_weight, other = torch.zeros(4, 4), torch.zeros(4, 4)
    decode._gemv_weights = {gemv_weight.data_ptr()}
    decode._one_row = True
    decode._fork(gemv_weight, "o_proj")
    decode._fork(other, "down")
    decode._one_row = False
    decode._fork(gemv_weight, "o_proj")
    assert forks == ["down", "o_proj"]


def test_fused_parts_run_their_kernels_and_match_the_stock_forward():
    model = DraftModel(small_config())
    decode = _decode(model)
    (ref, ref_caches), (got, got_caches) = _step_both(model, decode, 3)
    assert_bitwise(got, ref, "decode output")
    assert_bitwise(got_caches[1].tensor, ref_caches[1].tensor, "cache")
    assert decode.input_norm.calls == 1
    # The first boundary reads the BF16 embedding as its stream; the last stores none.
    calls = [b.calls for b in decode.boundaries]
    assert calls == [[(3, True, torch.bfloat16)], [(3, True, torch.float32)],
                     [(3, True, torch.float32)], [(3, False, torch.float32)]]


def test_layer_kernels_run_where_planned_and_fall_back_where_refused(caplog, monkeypatch):
    monkeypatch.setattr(decode_module, "_logged", set())
    model = DraftModel(small_config())
    decode = _decode(model)
    (ref, _), (got, _) = _step_both(model, decode, 3)
    assert_bitwise(got, ref, "decode output")
    assert [k.calls for k in decode.attentions] == [[(3, True, False)], [(3, True, False)]]
    assert [k.calls for k in decode.o_gates] == [1, 1]
    assert [k.calls for k in decode.activations] == [1, 1]
    # Refused by the plan: the stock modules, the same bits.
    decode = _decode(model, policy.Target(kernels=policy.ALL_KERNELS - {"attention", "o_gate", "mlp_activation"}))
    assert decode.attentions == [None, None] and decode.o_gates == [None, None]
    (ref, _), (got, _) = _step_both(model, decode, 2)
    assert_bitwise(got, ref, "decode output")
    # Rows the o-gate does not take: stock, and said once.
    decode = _decode(model, rows=2)
    with caplog.at_level(logging.INFO, logger="dspark.decode"):
        (ref, _), (got, _) = _step_both(model, decode, 5)
    assert_bitwise(got, ref, "decode output")
    assert "layer 0's o-gate ran stock" in caplog.text


def test_the_staged_attention_takes_the_o_gate_in_its_epilogue():
    model = DraftModel(small_config())
    decode = _decode(model)
    decode.attentions = [FakeAttention(layer.self_attn.num_kv_heads, layer.self_attn.o_norm) for layer in model.layers]
    (ref, _), (got, _) = _step_both(model, decode, 3)
    assert_bitwise(got, ref, "decode output")
    assert [k.calls for k in decode.attentions] == [[(3, True, True)], [(3, True, True)]]
    assert [k.calls for k in decode.o_gates] == [0, 0]  # no separate o-gate launch


def test_the_qkv_epilogue_runs_after_the_stock_projection_where_the_front_does_not():
    model = DraftModel(small_config())
    decode = _decode(model)
    holder = {}
    decode.epilogues = [FakeEpilogue(layer.self_attn, lambda: holder["caches"]) for layer in model.layers]
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    ref_caches, got_caches = model.make_caches(4), model.make_caches(4)
    for kernel in decode.attentions:
        kernel.caches = got_caches
    holder["caches"] = got_caches
    ref = model.forward(hidden, StepInputs.block(3, 3), ref_caches)
    got = decode.run(hidden, StepInputs.block(3, 3), got_caches)
    assert_bitwise(got, ref, "decode output")
    for c_ref, c_got in zip(ref_caches, got_caches):
        assert_bitwise(c_got.tensor, c_ref.tensor, "caches")
    assert [k.calls for k in decode.epilogues] == [[3], [3]]


def test_the_plan_has_a_qkv_epilogue_per_layer():
    plan = plan_draft(DraftModel(small_config(), device="meta"), ALL)
    assert [p.fused for p in plan.qkv_epilogues] == [True, True]
    assert plan.qkv_epilogues[0].constants == plan.qkv_fronts[0].constants
    plan = plan_draft(DraftModel(small_config(), device="meta"), policy.Target(kernels=frozenset()))
    assert plan.qkv_epilogues[1].reason == "the installed backends do not provide the qkv_epilogue kernel"


def test_an_unknown_attention_variant_is_refused():
    model = DraftModel(small_config(num_layers=1))
    with pytest.raises(ValueError, match="attention variant"):
        build_draft_decode(model, attention_variant="fast")
    with pytest.raises(ValueError, match="attention variant"):
        decode_module.draft_plan(model, attention="fast")


@pytest.mark.parametrize("variant", ["staged", "direct"])
def test_the_attention_kernel_is_bound_from_the_plans_constants(monkeypatch, variant):
    """The executor builds its attention kernel from the plan's constants
    (the variant the plan's target names), so the plan says what runs."""
    model = DraftModel(small_config(num_layers=1))
    plan = plan_draft(model, ALL.replace(attention=variant))
    decode = DraftDecode(model, plan)
    assert decode.attention_variant == variant
    from dspark_cute.cutedsl.attention.common import check_constants

    check_constants(plan.attentions[0].constants)  # the kernel takes the plan's constants
    built = {}

    def recorder(name):
        class Recorder:
            def __init__(self, *args, **kwargs):
                built[name] = (args, kwargs)

            def prepare(self):
                pass
        return Recorder

    monkeypatch.setattr(decode, "_kernel_class",
                        lambda part, module, name: recorder(name) if part is not None and part.fused else None)
    decode._bind_layer(0)
    attn = model.layers[0].self_attn
    args, kwargs = built["PagedAttention"]
    assert args == (attn.num_heads, attn.num_kv_heads, attn.head_dim, model.config.kv_block_size, torch.int64)
    if variant == "staged":
        assert kwargs == {"staged": True, "max_staged_slots": policy.DEFAULT_STAGED_SLOTS,
                          "o_gate_eps": attn.o_norm.eps}
    else:
        assert kwargs == {"o_gate_eps": None}


def test_a_refused_boundary_runs_its_stock_modules():
    model = DraftModel(small_config(connection_overrides={"layers.1.add_attn": {"dtype": "bf16"}}))
    decode = _decode(model)
    assert decode.boundaries[2] is None
    (ref, _), (got, _) = _step_both(model, decode, 2, torch.float32)
    assert_bitwise(got, ref, "decode output")
    assert [len(b.calls) if b else None for b in decode.boundaries] == [1, 1, None, 1]


def test_a_refused_first_norm_runs_stock():
    model = DraftModel(small_config())
    decode = _decode(model, policy.Target(kernels=policy.ALL_KERNELS - {"row_norm"}))
    assert decode.input_norm is None
    (ref, _), (got, _) = _step_both(model, decode, 1)
    assert_bitwise(got, ref, "decode output")


def test_rows_a_kernel_does_not_take_fall_back_and_say_so(caplog, monkeypatch):
    monkeypatch.setattr(decode_module, "_logged", set())
    model = DraftModel(small_config(num_layers=1))
    decode = _decode(model, rows=4)
    with caplog.at_level(logging.INFO, logger="dspark.decode"):
        (ref, _), (got, _) = _step_both(model, decode, 6)
    assert_bitwise(got, ref, "decode output")
    assert all(b.calls == [] for b in decode.boundaries)
    assert "boundary 0 ran stock: rows (6, 2048) not covered" in caplog.text


def test_a_tp_boundary_the_mailbox_does_not_take_all_reduces_stock():
    class Identity:
        tp = 2

        def __init__(self):
            self.reduced = 0

        def takes(self, partial):
            return False

        def all_reduce(self, partial):
            self.reduced += 1
            return partial

        def run(self, *args):
            raise AssertionError("not taken")

    model = DraftModel(small_config(num_layers=1))
    decode = _decode(model)
    decode.all_reduce = Identity()
    (ref, _), (got, _) = _step_both(model, decode, 2)
    assert_bitwise(got, ref, "decode output")
    assert decode.all_reduce.reduced == 2


def test_the_executor_refuses_bad_use():
    model = DraftModel(small_config(num_layers=1))
    with pytest.raises(ValueError, match="keeps the whole draft stock"):
        DraftDecode(model, plan_draft(model, policy.Target(platform="cpu")))
    decode = DraftDecode(model, plan_draft(model, ALL))
    with pytest.raises(RuntimeError, match="prepare"):
        decode.run(torch.zeros(1, 2048), StepInputs.block(0, 1), model.make_caches(1))
    decode = _decode(model)
    with pytest.raises(ValueError, match=r"hidden states of \[m, 2048\]"):
        decode.run(torch.zeros(1, 4096), StepInputs.block(0, 1), model.make_caches(1))
    with pytest.raises(ValueError, match="one KV cache per layer"):
        decode.run(torch.zeros(1, 2048), StepInputs.block(0, 1), [])


def test_bound_kernels_keep_the_stock_range_errors():
    """Where kernels that would skip bad slots are bound, ``run`` raises the
    stock forward's ValueErrors first (read once on the host)."""
    model = DraftModel(small_config())
    decode = _decode(model)
    hidden = torch.zeros(2, model.config.hidden_size, dtype=torch.bfloat16)
    caches = model.make_caches(4)
    for kernel in decode.attentions:
        kernel.caches = caches
    cases = [
        ("attn_slots", 4 * model.config.kv_block_size, "an attention slot beyond the cache's"),
        ("slots", 4 * model.config.kv_block_size, "a slot beyond the cache's"),
        ("positions", model.rotary.max_position, "RoPE positions must lie in"),
    ]
    for field, value, message in cases:
        step = StepInputs.block(3, 2)
        getattr(step, field).view(-1)[0] = value
        for fn in (model.forward, decode.run):
            with pytest.raises(ValueError, match=message):
                fn(hidden, step, model.make_caches(4) if fn is model.forward else caches)
    step = StepInputs.block(3, 2)
    step.slots[1] = step.slots[0]
    with pytest.raises(ValueError, match="distinct slots"):
        decode.run(hidden, step, caches)


def test_profile_decode_marks_only_the_gemms():
    """The profile's GEMM/rest split: cuBLAS, its split-K reduction, the
    package GEMM, the QKV front and the one-token GEMV are GEMMs; the other CuTe kernels (whose
    names all carry "cutlass") are not."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        profile = importlib.import_module("profile_decode")
    finally:
        sys.path.pop(0)
    gemms = ["nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float>",
             "kernel_cutlass_kernel_dspark_cuteqkv_frontQKVFrontKernel_object_at_",
             "kernel_cutlass_kernel_dspark_commpackage_gemmPackageGemmKernel_object_at_",
             "kernel_cutlass_kernel_dspark_cutegemvGemvKernel_object_at_"]
    others = ["kernel_cutlass_kernel_dspark_cuteattention_v2PagedAttentionV2Kernel_object_at_",
              "kernel_cutlass_kernel_dspark_cuteboundaryBoundaryKernel_object_at_",
              "kernel_cutlass_kernel_dspark_cutemlp_activationMlpActivationKernel_object_at_",
              "kernel_cutlass_kernel_dspark_cuterow_normRowNormKernel_object_at_",
              "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"]
    assert [profile._gemm(n) for n in gemms] == [True] * len(gemms)
    assert [profile._gemm(n) for n in others] == [False] * len(others)


class FakePrefetcher:
    """Records forks, kicks and joins (a join only where a fork is pending,
    as the real ``WeightPrefetcher``) into a shared event log."""

    def __init__(self, log):
        self.log, self.pending = log, False

    def fork(self, weight, role):
        self.log.append(("fork", role, tuple(weight.shape)))
        self.pending = True

    def kick(self):
        self.log.append(("kick",))

    def join(self):
        if self.pending:
            self.log.append(("join",))
            self.pending = False


def _prefetch_log(model, decode, monkeypatch, epilogues: bool):
    """The event log of one step: forks, kicks, joins, every GEMM the
    executor runs through ``linear`` (the stock front's own GEMM is
    ``("stock front",)``) and the small kernels between them (the first norm,
    the QKV epilogue, the boundaries, the activation)."""
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ref_caches, got_caches = model.make_caches(4), model.make_caches(4)
    ref = model.forward(hidden, StepInputs.block(3, 3), ref_caches)  # before the recording stand-ins
    log = []
    decode.prefetcher = FakePrefetcher(log)
    real_linear = decode_module.linear

    def recording_linear(x, weight):
        log.append(("gemm", tuple(weight.shape)))
        return real_linear(x, weight)

    monkeypatch.setattr(decode_module, "linear", recording_linear)

    def recording(name, method):
        def wrapped(*args, **kwargs):
            out = method(*args, **kwargs)
            log.append((name,) + ((args[0],) if name == "boundary" else ()))
            return out
        return wrapped

    for name, attr in (("first norm", "_first_norm"), ("boundary", "_boundary"), ("activation", "_activation")):
        monkeypatch.setattr(decode, attr, recording(name, getattr(decode, attr)))
    holder = {}
    if epilogues:
        decode.epilogues = [FakeEpilogue(layer.self_attn, lambda: holder["caches"]) for layer in model.layers]
        for epilogue in decode.epilogues:
            epilogue.launch = recording("epilogue", epilogue.launch)
    else:
        for layer in model.layers:
            real_front = layer.self_attn.front

            def front(x, step, cache, real_front=real_front):
                log.append(("stock front",))
                return real_front(x, step, cache)

            monkeypatch.setattr(layer.self_attn, "front", front)
    for kernel in decode.attentions:
        kernel.caches = got_caches
    holder["caches"] = got_caches
    got = decode.run(hidden, StepInputs.block(3, 3), got_caches)
    assert_bitwise(got, ref, "decode output with the prefetch on")
    return log


@pytest.mark.parametrize("epilogues", [True, False])
def test_the_prefetch_forks_after_each_gemm_kicks_after_the_next_small_kernel_and_joins(monkeypatch, epilogues):
    """Each GEMM's weight is named to the prefetch right after the previous
    GEMM (the first QKV weight at the step's start), kicked right after the
    first small kernel that follows (the first norm, the QKV epilogue or
    stock front, a boundary, the activation: where the inline mode
    launches), joined before its GEMM; nothing is left pending at the step's
    end, and the result is the stock forward's bits."""
    model = DraftModel(small_config())
    decode = _decode(model)
    log = _prefetch_log(model, decode, monkeypatch, epilogues)
    assert not decode.prefetcher.pending
    shapes = {}
    for i, layer in enumerate(model.layers):
        a, mlp = layer.self_attn, layer.mlp
        shapes[i] = {r: tuple(w.shape) for r, w in
                     (("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up", mlp.gate_up), ("down", mlp.down))}
    expected = []
    for i in range(len(model.layers)):
        s = shapes[i]
        if i == 0:
            expected += [("fork", "qkv_proj", s["qkv_proj"]), ("first norm",), ("kick",)]
        expected.append(("join",))
        if epilogues:
            expected += [("gemm", s["qkv_proj"]), ("fork", "o_proj", s["o_proj"]), ("epilogue",)]
        else:
            expected += [("stock front",), ("fork", "o_proj", s["o_proj"])]
        expected += [("kick",), ("join",), ("gemm", s["o_proj"]), ("fork", "gate_up", s["gate_up"]),
                     ("boundary", 2 * i), ("kick",),
                     ("join",), ("gemm", s["gate_up"]), ("fork", "down", s["down"]), ("activation",), ("kick",),
                     ("join",), ("gemm", s["down"])]
        if i + 1 < len(model.layers):
            expected.append(("fork", "qkv_proj", shapes[i + 1]["qkv_proj"]))
        expected += [("boundary", 2 * i + 1), ("kick",)]
    assert log == expected


def test_the_prefetch_is_opt_in_and_checked():
    model = DraftModel(small_config(num_layers=1))
    plan = plan_draft(model, ALL)
    assert DraftDecode(model, plan).prefetcher is None
    from dspark_cute.cutedsl.prefetch import WeightPrefetcher

    decode = DraftDecode(model, plan, prefetch=decode_module.DEFAULT_PREFETCH)
    assert isinstance(decode.prefetcher, WeightPrefetcher)
    assert decode.prefetcher.bytes_per_row == decode_module.DEFAULT_PREFETCH
    assert decode.prefetcher.mode == "inline"
    assert DraftDecode(model, plan, prefetch={"down": 512}, prefetch_mode="side").prefetcher.mode == "side"
    with pytest.raises(ValueError, match="prefetch mode"):
        DraftDecode(model, plan, prefetch={"down": 512}, prefetch_mode="eager")
    with pytest.raises(ValueError, match="prefetch roles"):
        DraftDecode(model, plan, prefetch={"lm_head": 256})
    with pytest.raises(ValueError, match="multiple of 128 bytes"):
        DraftDecode(model, plan, prefetch={"down": 100})
