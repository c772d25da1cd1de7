"""The executor (``dspark_core.runtime.decode``) on the CPU, over the
reference draft's description: every kernel is a stand-in that follows the
kernel contract (built from its constants and bound tensors, ``prepare`` /
``problem`` / ``takes`` / ``run`` / ``launch``) and computes the spec from
those alone, so what is checked is that the plan's constants and the
description carry everything a kernel needs, which part runs where, and that
the result is the stock forward's bits."""

from __future__ import annotations

import logging

import pytest
import torch

from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.runtime import decode as decode_module
from dspark_core.runtime.build import build_draft_decode, draft_plan
from dspark_core.runtime.decode import DraftDecode
from dspark_core.spec import gemv as gemv_spec
from dspark_core.spec import split_order
from dspark_core.spec.attention import paged_attention
from dspark_core.spec.layers import (
    GatedResidual,
    HeadNorm,
    RMSNorm,
    Rotary,
    k_norm_context,
    kv_insert,
    o_gate,
    qk_norm_rope,
    residual_boundary,
    silu_and_mul,
)
from dspark_core.tools.compare import assert_bitwise

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL = policy.Target(kernels=policy.ALL_KERNELS)
ALL = FULL.opt_in(set())  # as build_draft_decode plans: the opt-in kernels declined
CALLS: list[tuple] = []  # (kernel, detail) of every launch of a stand-in


def _norm(c, h, weight, out_dtype="bf16") -> RMSNorm:
    norm = RMSNorm(h, c.eps, has_weight=weight is not None, weight_dtype=DTYPES[c.weight_dtype or "bf16"],
                   gain_center=c.gain_center, weight_before_norm=c.weight_before_norm, out_dtype=DTYPES[out_dtype],
                   arch=c.arch)
    if weight is not None:
        norm.weight.data = weight
    return norm


class Kernel:
    """The contract's verbs over ``_problem`` and ``_launch``; ``rows`` caps
    the rows a stand-in takes (to exercise run-time fallbacks)."""

    rows = 16
    name = "kernel"

    def prepare(self, **variants):
        self.prepared = variants

    def problem(self, *operands, **kw):
        m = operands[0].shape[0]
        return f"{m} rows, more than {self.rows}" if m > self.rows else None

    def takes(self, *operands, **kw):
        return self.problem(*operands, **kw) is None

    def run(self, *operands, **kw):
        why = self.problem(*operands, **kw)
        if why:
            raise ValueError(why)
        return self.launch(*operands, **kw)


class FakeRowNorm(Kernel):
    def __init__(self, constants, weight):
        self.norm = _norm(constants.norm, constants.hidden_size, weight, constants.out_dtype)

    def launch(self, x):
        CALLS.append(("row_norm", x.shape[0]))
        return self.norm(x)


class FakeBoundary(Kernel):
    def __init__(self, constants, alpha, beta, post_weight, pre_weight):
        h = constants.hidden_size
        self.post, self.pre = _norm(constants.post, h, post_weight), _norm(constants.pre, h, pre_weight)
        self.conn = GatedResidual(h)
        self.conn.alpha.data, self.conn.beta.data = alpha, beta

    def launch(self, branch, stream, store):
        CALLS.append(("boundary", branch.shape[0], store, stream.dtype))
        new_stream, out = residual_boundary(self.post, self.conn, self.pre, branch, stream)
        return (new_stream if store else None), out


def _head_norms(c, q_weight):
    assert q_weight is None and not c.q_weight  # the stock QK-norm is weightless
    return HeadNorm(64, c.q_eps), HeadNorm(64, c.k_eps)


def _rope(table):
    rope = Rotary(64, table.shape[0], table_dtype=table.dtype)
    rope.cos_sin = table
    return rope


def _epilogue(c, q_norm, k_norm, rope, qkv, positions, slots, cache):
    q_size, kv_size = c.num_heads * 64, c.kv_heads * 64
    q, k, v = (t.reshape(qkv.shape[0], -1, 64) for t in qkv.split([q_size, kv_size, kv_size, q_size], -1)[:3])
    q, k = qk_norm_rope(q, q_norm, positions, rope), qk_norm_rope(k, k_norm, positions, rope)
    kv_insert(cache, k, v, slots)
    return q


class FakeEpilogue(Kernel):
    def __init__(self, constants, q_norm_weight, table):
        self.c = constants
        self.q_norm, self.k_norm = _head_norms(constants, q_norm_weight)
        self.rope = _rope(table) if constants.rope else None

    def launch(self, qkv, positions, slots, cache):
        CALLS.append(("qkv_epilogue", qkv.shape[0]))
        return _epilogue(self.c, self.q_norm, self.k_norm, self.rope, qkv, positions, slots, cache)


class FakeAttention(Kernel):
    def __init__(self, constants):
        self.c = constants
        self.gated = self.takes_strided_q = constants.o_gate_eps is not None

    def problem(self, q, cache, attn_slots, gate=None):
        if not self.takes_strided_q and not q.is_contiguous():
            return "q must be contiguous"
        if (gate is not None) != self.gated:
            return "a gate exactly when the kernel applies the o-gate"
        return super().problem(q)

    def launch(self, q, cache, attn_slots, gate=None):
        CALLS.append(("attention", q.shape[0], gate is not None))
        out = paged_attention(q, cache, attn_slots, self.c.kv_heads)
        return o_gate(out, gate, HeadNorm(64, self.c.o_gate_eps), "sm_90a") if gate is not None else out


class FakeOGate(Kernel):
    def __init__(self, constants):
        self.norm, self.arch = HeadNorm(64, constants.eps), constants.arch

    def launch(self, attn, gate):
        CALLS.append(("o_gate", attn.shape[0]))
        return o_gate(attn, gate, self.norm, self.arch)


class FakeActivation(Kernel):
    def __init__(self, constants):
        self.i = constants.intermediate_size

    def launch(self, gu):
        CALLS.append(("mlp_activation", gu.shape[0]))
        return silu_and_mul(gu, self.i)


class FakeGemv(Kernel):
    rows = 1

    def __init__(self, constants, weight):
        self.role, self.weight = constants.role, weight

    def launch(self, x):
        CALLS.append(("gemv", self.role))
        return gemv_spec.gemv(x, self.weight)


def coarse_mma(acc, xs, ws):
    """A stand-in MMA with a BF16 accumulator: every split order gives other bits."""
    return (acc.double() + xs.double() @ ws.double().t()).to(torch.bfloat16).float()


class FakeOrderedGemm(Kernel):
    """The ordered GEMM's stand-in: ``run_order`` is the split model with
    ``coarse_mma``; no check runs off CUDA unless a
    subclass says ``CHECK_OFF_CUDA``."""

    max_rows = 4

    def __init__(self, constants, weight):
        self.role, self.weight, self.orders, self.reasons = constants.role, weight, {}, {}

    @staticmethod
    def run_order(x, weight, order):
        return split_order.model_sum(x, weight, order, coarse_mma)

    def bind_orders(self, orders, reasons=None):
        self.orders, self.reasons = dict(orders), dict(reasons or {})

    def problem(self, x, out=None):
        m = x.shape[0]
        return None if m in self.orders else self.reasons.get(m, f"no order for m = {m}")

    def launch(self, x, out=None):
        CALLS.append(("ordered_gemm", self.role, x.shape[0]))
        return split_order.model_sum(x, self.weight, self.orders[x.shape[0]], coarse_mma)


class FakeContextChain(Kernel):
    def __init__(self, constants, hidden_weight, pre_weights, kv_weight, table):
        c = constants
        h = c.norms.hidden_size
        self.hidden = _norm(c.norms.hidden, h, hidden_weight)
        self.pres = [_norm(c.norms.pre, h, w) for w in (pre_weights or [None] * c.norms.num_layers)]
        self.kv_weight, self.store = kv_weight, c.store
        self.rope = _rope(table) if c.store.rope else None

    def problem(self, states, positions, caches, slots):
        return None if states.dim() == 2 else "states of [T, H]"

    def launch(self, states, positions, caches, slots):
        CALLS.append(("context_chain", states.shape[0]))
        h = self.hidden(states, out_dtype=torch.bfloat16)
        kv = torch.bmm(torch.stack([pre(h) for pre in self.pres]), self.kv_weight().transpose(1, 2))
        per_layer = slots if isinstance(slots, (list, tuple)) else [slots] * len(caches)
        kv = kv.view(len(caches), kv.shape[1], 2, self.store.kv_heads, 64)
        for i, cache in enumerate(caches):
            if per_layer[i] is None:
                continue
            k = k_norm_context(kv[i, :, 0], HeadNorm(64, self.store.k_eps))
            if self.rope is not None:
                k = self.rope(k, positions)
            rows = per_layer[i].shape[0]
            kv_insert(cache, k[:rows], kv[i, :rows, 1], per_layer[i])


class FakePrefetcher:
    def __init__(self, bytes_per_row, device):
        self.bytes_per_row, self.pending = bytes_per_row, False

    def prepare(self):
        pass

    def fork(self, weight, role):
        CALLS.append(("fork", role))
        self.pending = True

    def kick(self):
        CALLS.append(("kick",))

    def join(self):
        if self.pending:
            CALLS.append(("join",))
            self.pending = False


KERNELS = {
    policy.ROW_NORM: FakeRowNorm, policy.BOUNDARY: FakeBoundary,
    policy.QKV_EPILOGUE: FakeEpilogue, policy.ATTENTION: FakeAttention, policy.O_GATE: FakeOGate,
    policy.MLP_ACTIVATION: FakeActivation, policy.GEMV: FakeGemv, policy.CONTEXT_CHAIN: FakeContextChain,
    policy.WEIGHT_PREFETCH: FakePrefetcher, policy.ORDERED_GEMM: FakeOrderedGemm,
}


def _decode(model, target=ALL, **options) -> DraftDecode:
    draft = describe(model)
    decode = DraftDecode(draft, plan_draft(draft, target), kernels=KERNELS, **options)
    decode.prepare()
    CALLS.clear()
    return decode


def _both(model, decode, m, gen, hidden_dtype=torch.bfloat16):
    """``(stock, fused)`` outputs and caches of one step of ``m`` tokens."""
    hidden = torch.randn(m, model.config.hidden_size, generator=gen).to(hidden_dtype)
    outs = []
    for fn in (model.forward, decode.run):
        caches = model.make_caches(4)
        outs.append((fn(hidden, StepInputs.block(3, m), caches), caches))
    return outs


def _assert_same(outs):
    (ref, ref_caches), (got, got_caches) = outs
    assert_bitwise(got, ref, "decode output")
    for a, b in zip(got_caches, ref_caches):
        assert_bitwise(a.tensor, b.tensor, "KV cache")


def test_on_a_cpu_the_build_says_not_cuda_and_returns_none(caplog):
    draft = describe(DraftModel(small_config(num_layers=1)))
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        assert build_draft_decode(draft, kernels=KERNELS) is None
    assert "the DSpark draft keeps its stock layers: not CUDA" in caplog.text


def test_fused_parts_run_their_kernels_and_match_the_stock_forward(gen):
    model = DraftModel(small_config())
    decode = _decode(model)
    _assert_same(_both(model, decode, 3, gen))
    boundaries = [c for c in CALLS if c[0] == "boundary"]
    # The first boundary reads the BF16 embedding as its stream; the last stores none.
    assert boundaries == [("boundary", 3, True, torch.bfloat16), ("boundary", 3, True, torch.float32),
                          ("boundary", 3, True, torch.float32), ("boundary", 3, False, torch.float32)]
    kinds = [c[0] for c in CALLS]
    assert kinds.count("row_norm") == 1 and kinds.count("qkv_epilogue") == 2
    # The staged attention takes the o-gate into its epilogue: no o-gate launch of its own.
    assert [c for c in CALLS if c[0] == "attention"] == [("attention", 3, True)] * 2
    assert "o_gate" not in kinds and kinds.count("mlp_activation") == 2


def test_the_direct_attention_and_its_own_o_gate(gen):
    model = DraftModel(small_config())
    decode = _decode(model, ALL.replace(attention="direct"))
    _assert_same(_both(model, decode, 2, gen))
    assert [c for c in CALLS if c[0] in ("attention", "o_gate")] == [("attention", 2, False), ("o_gate", 2)] * 2


def test_the_opt_in_gemv_runs_where_asked(gen):
    model = DraftModel(small_config(num_layers=1))
    decode = _decode(model, FULL.opt_in({policy.GEMV}))
    _assert_same(_both(model, decode, 2, gen))  # two rows: no GEMV
    assert ("qkv_epilogue", 2) in CALLS and not any(c[0] == "gemv" for c in CALLS)
    CALLS.clear()
    hidden = torch.randn(1, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    decode.run(hidden, StepInputs.block(3, 1), model.make_caches(4))
    assert [c[1] for c in CALLS if c[0] == "gemv"] == ["qkv_proj", "o_proj", "gate_up", "down"]


def test_parts_the_plan_refuses_run_their_stock_modules(gen):
    model = DraftModel(small_config(connection_overrides={"layers.1.add_attn": {"dtype": "bf16"}}))
    target = ALL.without({policy.ATTENTION, policy.MLP_ACTIVATION, policy.ROW_NORM})
    decode = _decode(model, target)
    assert decode.boundaries[2] is None and decode.input_norm is None and decode.attentions == [None, None]
    _assert_same(_both(model, decode, 2, gen, torch.float32))
    assert len([c for c in CALLS if c[0] == "boundary"]) == 3
    assert [c for c in CALLS if c[0] == "o_gate"] == [("o_gate", 2)] * 2  # the o-gate fuses on its own now


def test_rows_a_kernel_does_not_take_fall_back_and_say_so_once(caplog, gen, monkeypatch):
    model = DraftModel(small_config(num_layers=1))
    decode = _decode(model)
    monkeypatch.setattr(Kernel, "rows", 4)
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        _assert_same(_both(model, decode, 6, gen))
        _assert_same(_both(model, decode, 6, gen))
    assert [c for c in CALLS if c[0] != "gemv"] == []
    assert caplog.text.count("layer 0's attention boundary ran stock: 6 rows, more than 4") == 1
    # Another decode logs its own fallbacks again.
    other = _decode(model)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        _both(model, other, 6, gen)
    assert "layer 0's attention boundary ran stock" in caplog.text


def test_a_tp_boundary_the_mailbox_does_not_take_all_reduces_stock(gen):
    class Identity:
        tp = 2

        def __init__(self):
            self.reduced = 0

        def takes(self, partial):
            return False

        def all_reduce(self, partial):
            self.reduced += 1
            return partial

        def project(self, index, x, weight):
            return torch.matmul(x, weight.t()), False

        def run(self, *args, **kwargs):
            raise AssertionError("not taken")

    model = DraftModel(small_config(num_layers=1))
    decode = _decode(model)
    decode.all_reduce = Identity()
    _assert_same(_both(model, decode, 2, gen))
    assert decode.all_reduce.reduced == 2


def test_the_context_chain_runs_fused_and_matches_the_stock_one(gen):
    model = DraftModel(small_config())
    decode = _decode(model)
    states = torch.randn(5, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    positions = torch.arange(5)
    stock, fused = model.make_caches(4), model.make_caches(4)
    model.precompute_and_store_context_kv(states, positions, stock, positions)
    assert decode.store_context_kv(states, positions, fused, positions)
    for a, b in zip(fused, stock):
        assert_bitwise(a.tensor, b.tensor, "context caches")
    assert CALLS == [("context_chain", 5)]
    with pytest.raises(ValueError, match="a slot beyond the cache"):
        decode.store_context_kv(states, positions, fused, positions + 10_000)


def test_stock_inserts_sends_the_cache_writers_stock(gen):
    """``DraftDecode.stock_inserts``: the context chain and the QKV
    epilogues run their stock code from then on (a bound cache layout the
    kernels do not take), the step still equal to the stock forward; the
    names of what was fused are returned once; a reason is required."""
    model = DraftModel(small_config())
    decode = _decode(model)
    with pytest.raises(TypeError, match="non-empty string"):
        decode.stock_inserts("")
    names = decode.stock_inserts("a layout the kernels do not take")
    assert names[0] == "the context K/V chain" and "layer 0's QKV epilogue" in names
    assert decode.stock_inserts("again") == []
    states = torch.randn(5, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    positions = torch.arange(5)
    CALLS.clear()
    assert not decode.store_context_kv(states, positions, model.make_caches(4), positions)
    assert CALLS == []


def test_the_prefetch_forks_kicks_and_joins_around_every_gemm(gen):
    model = DraftModel(small_config(num_layers=1))
    decode = _decode(model, prefetch=decode_module.DEFAULT_PREFETCH)
    _assert_same(_both(model, decode, 3, gen))
    events = [c for c in CALLS if c[0] in ("fork", "kick", "join", "row_norm", "qkv_epilogue", "boundary",
                                            "mlp_activation")]
    names = [e[0] if e[0] != "fork" else f"fork {e[1]}" for e in events]
    assert names == ["fork qkv_proj", "row_norm", "kick", "join", "fork o_proj", "qkv_epilogue", "kick", "join",
                     "fork gate_up", "boundary", "kick", "join", "fork down", "mlp_activation", "kick", "join",
                     "boundary", "kick"]
    assert not decode.prefetcher.pending


def test_the_opt_in_kernels_are_declined_unless_asked_and_exclude_is_checked():
    draft = describe(DraftModel(small_config(), device="meta"))
    plan = draft_plan(draft, kernels=policy.ALL_KERNELS)
    assert plan.draft_reason == "not CUDA"
    plan = plan_draft(draft, ALL)
    assert all(p.declined for p in plan.gemvs)
    assert plan.fused_count() == (14, 14)  # the declined opt-ins are not counted
    with pytest.raises(ValueError, match=r"unknown kernels \['boundry'\]"):
        draft_plan(draft, exclude={"boundry"})


def test_the_executor_refuses_bad_use(gen):
    model = DraftModel(small_config(num_layers=1))
    draft = describe(model)
    with pytest.raises(ValueError, match="keeps the whole draft stock"):
        DraftDecode(draft, plan_draft(draft, policy.Target(platform="cpu")), kernels=KERNELS)
    decode = DraftDecode(draft, plan_draft(draft, ALL), kernels=KERNELS)
    with pytest.raises(RuntimeError, match="prepare"):
        decode.run(torch.zeros(1, 2048), StepInputs.block(0, 1), model.make_caches(1))
    decode.prepare()
    with pytest.raises(ValueError, match=r"hidden states of \[m, 2048\]"):
        decode.run(torch.zeros(1, 4096), StepInputs.block(0, 1), model.make_caches(1))
    with pytest.raises(TypeError, match="as a tensor"):
        decode.run([0.0], StepInputs.block(0, 1), model.make_caches(1))
    with pytest.raises(ValueError, match="one KV cache per layer"):
        decode.run(torch.zeros(1, 2048), StepInputs.block(0, 1), [])
    with pytest.raises(ValueError, match="attention variant"):
        build_draft_decode(draft, attention_variant="fast", kernels=KERNELS)


def test_bound_kernels_keep_the_stock_range_errors():
    """Where kernels that would skip bad slots are bound, ``run`` raises the
    stock forward's ValueErrors first."""
    model = DraftModel(small_config())
    decode = _decode(model)
    hidden = torch.zeros(2, model.config.hidden_size, dtype=torch.bfloat16)
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
                fn(hidden, step, model.make_caches(4))
    step = StepInputs.block(3, 2)
    step.slots[1] = step.slots[0]
    with pytest.raises(ValueError, match="distinct slots"):
        decode.run(hidden, step, model.make_caches(4))


def test_a_bug_in_a_constants_builder_is_not_a_refusal(monkeypatch):
    """Only ``Unsupported`` becomes a stock part; another exception propagates."""
    from dspark_core.contracts import constants as K

    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(K, "mlp_activation_constants", broken)
    with pytest.raises(KeyError, match="a bug"):
        plan_draft(describe(DraftModel(small_config(), device="meta")), ALL)


class CheckedOrderedGemm(FakeOrderedGemm):
    CHECK_OFF_CUDA = True
    ORDER_CHECK = {"min_compared": 1}  # one round of probes: the stand-in's orders differ in most outputs
    max_rows = 2


def test_the_ordered_gemm_takes_the_rows_its_check_found_an_order_for(caplog, gen):
    """The executor checks each bound ordered GEMM against the model's own
    stock projection and runs it where an order was found: here the stock
    QKV, gate-up and down projections sum in split orders (a CPU stand-in
    for cuBLAS), o_proj in the CPU's own order, which no split order
    reproduces (its rows stay stock, with the check's reason)."""
    model = DraftModel(small_config())
    draft = describe(model)
    orders = {"qkv_proj": split_order.SplitOrder(64, 2), "gate_up": split_order.SplitOrder(128, 3),
              "down": split_order.SplitOrder(64, 1)}
    for layer in draft.layers:
        a, mlp = layer.attention, layer.mlp
        a.project_qkv = lambda x, w=a.qkv_weight: split_order.model_sum(x, w, orders["qkv_proj"], coarse_mma)
        mlp.project_gate_up = lambda x, w=mlp.gate_up_weight: split_order.model_sum(x, w, orders["gate_up"],
                                                                                     coarse_mma)
        mlp.project_down = lambda x, w=mlp.down_weight: split_order.model_sum(x, w, orders["down"], coarse_mma)
    kernels = dict(KERNELS, **{policy.ORDERED_GEMM: CheckedOrderedGemm})
    decode = DraftDecode(draft, plan_draft(draft, FULL.opt_in({policy.ORDERED_GEMM})), kernels=kernels)
    with caplog.at_level(logging.INFO, logger="dspark.decode"):
        decode.prepare()
    for (_layer, role), gemm in decode.ordered.items():
        k = gemm.weight.shape[1]
        if role == "o_proj":
            assert not gemm.orders and "none of" in gemm.reasons[1], gemm.reasons
        else:
            assert {m: o.bounds(k) for m, o in gemm.orders.items()} == {m: orders[role].bounds(k) for m in (1, 2)}
    assert "layer 0's qkv_proj projection on the ordered GEMM where the check against cuBLAS found its order: " \
           "m = 1-2: 2 K-splits of 64-column tiles" in caplog.text
    CALLS.clear()
    hidden = torch.randn(2, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    got = decode.run(hidden, StepInputs.block(3, 2), model.make_caches(4))
    assert [c[1] for c in CALLS if c[0] == "ordered_gemm"] == ["qkv_proj", "gate_up", "down"] * 2
    # The stock forward with the same projections: the same bits.
    ref = DraftDecode(draft, plan_draft(draft, policy.Target(kernels=frozenset())), kernels=KERNELS)
    ref.prepare()
    assert_bitwise(got, ref.run(hidden, StepInputs.block(3, 2), model.make_caches(4)), "decode output")
    CALLS.clear()
    decode.run(hidden.repeat(2, 1)[:3], StepInputs.block(3, 3), model.make_caches(4))  # 3 rows: no order bound
    assert not [c for c in CALLS if c[0] == "ordered_gemm"]


class _Recorder:
    def __init__(self, calls, name, fail=None):
        self.calls, self.name, self.fail = calls, name, fail

    def prepare(self, **kwargs):
        self.calls.append((self.name, kwargs))
        if self.fail is not None:
            raise self.fail


def test_prepare_collectively_always_reaches_the_all_reduce():
    """``prepare_collectively``: the decode's kernels, then the all-reduce
    boundaries' (collective); after this rank's failure the boundaries are
    still prepared, told of it, and this rank's error is returned (another
    rank's RuntimeError then swallowed); an error from the boundaries
    themselves is returned too."""
    from dspark_core.runtime.build import prepare_collectively

    calls = []
    assert prepare_collectively(_Recorder(calls, "decode"), _Recorder(calls, "all_reduce")) is None
    assert calls == [("decode", {}), ("all_reduce", {})]
    calls.clear()
    broken = ValueError("a refusal")
    got = prepare_collectively(_Recorder(calls, "decode", broken), _Recorder(calls, "all_reduce",
                                                                            RuntimeError("others fail")))
    assert got is broken and calls == [("decode", {}), ("all_reduce", {"failed": broken})]
    calls.clear()
    assert prepare_collectively(None, _Recorder(calls, "all_reduce"), broken) is broken  # failed building
    assert calls == [("all_reduce", {"failed": broken})]
    calls.clear()
    late = RuntimeError("the boundaries' compile")
    assert prepare_collectively(_Recorder(calls, "decode"), _Recorder(calls, "all_reduce", late)) is late
    assert prepare_collectively(_Recorder([], "decode"), None) is None


class DecidingOrderedGemm(CheckedOrderedGemm):
    """A stand-in whose timing (``decide``) finds cuBLAS faster at 2 rows."""

    def decide(self):
        from dspark_core.runtime import gemm_decide
        from dspark_core.tools.card import CardFacts

        card = CardFacts("a stand-in GPU", (9, 0), 132, "0", "0", "0", None)
        times = {1: (10.0, 9.0), 2: (10.0, 12.0)}
        decision = gemm_decide.GemmDecision(f"the {self.role} weight", card.describe())
        for m in list(self.orders):
            cublas, ours = times[m]
            decision.rows[m] = row = gemm_decide.decide_row(m, cublas, {"stand-in": ours})
            if row.kernel is None:
                del self.orders[m]
                self.reasons[m] = row.reason()
        return decision


def _qkv_in_split_order():
    """``(model, draft)``: a small draft whose stock QKV projections sum in
    a split order (a CPU stand-in for cuBLAS's), the others in the CPU's."""
    model = DraftModel(small_config())
    draft = describe(model)
    order = split_order.SplitOrder(64, 2)
    for layer in draft.layers:
        a = layer.attention
        a.project_qkv = lambda x, w=a.qkv_weight: split_order.model_sum(x, w, order, coarse_mma)
    return model, draft


def test_the_ordered_gemm_runs_only_the_rows_its_timing_kept(caplog, gen):
    """After the order check, the executor asks the host class to decide by
    timing (``decide``) and logs the decision: the row count cuBLAS won
    runs the stock projection, the other the ordered GEMM, the bits the
    stock's either way."""
    model, draft = _qkv_in_split_order()
    kernels = dict(KERNELS, **{policy.ORDERED_GEMM: DecidingOrderedGemm})
    decode = DraftDecode(draft, plan_draft(draft, FULL.opt_in({policy.ORDERED_GEMM})), kernels=kernels)
    with caplog.at_level(logging.INFO, logger="dspark.decode"):
        decode.prepare()
    gemm = decode.ordered[(0, "qkv_proj")]
    assert sorted(gemm.orders) == [1] and "cuBLAS kept at m = 2" in gemm.reasons[2]
    assert decode.decisions[(0, "qkv_proj")].dspark_rows == {1: "stand-in"}
    assert "layer 0's qkv_proj projection, decided by timing: the qkv_proj weight on a stand-in GPU" in caplog.text
    assert "m = 1: DSpark (stand-in) (1.11x); m = 2: cuBLAS (0.83x)" in caplog.text
    ref = DraftDecode(draft, plan_draft(draft, policy.Target(kernels=frozenset())), kernels=KERNELS)
    ref.prepare()
    for m in (1, 2):
        CALLS.clear()
        hidden = torch.randn(m, model.config.hidden_size, generator=gen).to(torch.bfloat16)
        got = decode.run(hidden, StepInputs.block(3, m), model.make_caches(4))
        ran = [c[1] for c in CALLS if c[0] == "ordered_gemm"]
        assert ("qkv_proj" in ran) == (m == 1), (m, ran)
        assert_bitwise(got, ref.run(hidden, StepInputs.block(3, m), model.make_caches(4)), f"decode output m={m}")


def test_the_ordered_gemm_is_checked_at_the_deployments_row_counts_alone():
    """``step_rows``: the ordered GEMMs are checked (and timed) at the row
    counts the deployment's steps have, no others; bad row counts refused."""
    model, draft = _qkv_in_split_order()
    kernels = dict(KERNELS, **{policy.ORDERED_GEMM: CheckedOrderedGemm})
    plan = plan_draft(draft, FULL.opt_in({policy.ORDERED_GEMM}))
    decode = DraftDecode(draft, plan, kernels=kernels, step_rows=range(2, 65, 2))
    decode.prepare()
    assert sorted(decode.ordered[(0, "qkv_proj")].orders) == [2]
    assert sorted(decode.order_checks[(0, "qkv_proj")].findings) == [2]
    for bad, kind in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(kind, match="step_rows"):
            DraftDecode(draft, plan, kernels=kernels, step_rows=[4, bad])
