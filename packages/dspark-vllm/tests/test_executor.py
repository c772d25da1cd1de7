"""dspark-core's executor (``DraftDecode``) over vLLM's own module objects,
and the plugin's class that runs it, on the CPU.

What is stubbed: the DSpark kernels (their host classes, ``_stubs``: each
built from its constants and the tensors the executor binds, computing
vLLM's stock op for its part with vLLM's modules), and the GPU kernels vLLM
itself has no CPU path for (``_draft``'s CPU patches). What is real: vLLM's
draft class, loader, layers, linear layers, embedding, forward context, KV
cache views, and dspark-core's executor, planner and constants. So a decode
equal to vLLM's forward here shows that the description's stock calls are
vLLM's layer split exactly and that the constants and bound tensors carry
everything each part needs; it says nothing of the CuTe kernels' numerics
(the GPU suites check those) or of a GPU."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
import _stubs  # noqa: E402
import torch  # noqa: E402

from dspark_core.errors import Unsupported  # noqa: E402
from dspark_core.planner import policy  # noqa: E402
from dspark_core.runtime.decode import DraftDecode  # noqa: E402
from dspark_vllm import deployment, planning, runtime  # noqa: E402
from dspark_vllm.adapter import describe_vllm  # noqa: E402

GPU = policy.Target(kernels=policy.ALL_KERNELS).opt_in(frozenset())
CTX, M = 7, 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from dspark_vllm.plugin import register

    register()
    return _draft.checkpoint_dir(tmp_path_factory, "executor")


@pytest.fixture(scope="module")
def stock(dirs):
    built = _draft.build(*dirs, "auto")
    runtime.pin_rope_tables(built.model.model)  # (what the stock profiling run does first)
    return built, _draft.run_block(built.model, built.config, CTX, M)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def vllm_log():
    records, log = Records(), logging.getLogger("vllm.dspark")
    level = log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    yield records.lines
    log.removeHandler(records)
    log.setLevel(level)


def _decode_block(built, decode, m=M):
    """One block through ``decode``: the context chain (fused where it takes it), then ``decode.run``."""
    model = built.model
    caches = _draft.kv_caches(model, built.config)
    with torch.inference_mode():
        states, positions, slots = _draft.context_states(model, CTX), torch.arange(CTX), _draft.context_slots(CTX)
        if not decode.store_context_kv(states, positions, slots):
            model.precompute_and_store_context_kv(states, positions, slots)
        with _draft.step(model, built.config, _draft.query_ids(m), CTX):
            hidden = decode.run(model.model.embed_input_ids(_draft.query_ids(m)), torch.arange(CTX, CTX + m))
    return hidden, [c.clone() for c in caches]


def _assert_same(got, want):
    assert torch.equal(got[0], want[0]), (got[0].float() - want[0].float()).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_the_executors_stock_calls_are_vllms_forward(stock):
    """Every part stock: the executor's split (projection, QK-norm/RoPE/insert,
    attention over the cache, o-gate, output GEMM, boundaries, MLP) over
    vLLM's modules gives vLLM's forward and KV cache bit for bit."""
    built, want = stock
    draft = describe_vllm(built.model.model, kv_cache_layout="LBHNC")
    decode = DraftDecode(draft, planning.plan_vllm(draft, GPU, exact=frozenset()), kernels={})
    decode.prepare()
    _assert_same(_decode_block(built, decode), want)


def test_the_fused_path_with_stub_kernels_is_vllms_forward(stock):
    built, want = stock
    draft = describe_vllm(built.model.model, kv_cache_layout="LBHNC")
    plan = planning.plan_vllm(draft, GPU, exact=policy.ALL_KERNELS)
    decode = DraftDecode(draft, plan, kernels=_stubs.KERNELS)
    decode.prepare()
    _stubs.CALLS.clear()
    _assert_same(_decode_block(built, decode), want)
    kinds = [c[0] for c in _stubs.CALLS]
    assert kinds[:2] == ["context_chain", "row_norm"]
    assert {k: kinds.count(k) for k in set(kinds)} == {"context_chain": 1, "row_norm": 1, "boundary": 4,
                                                       "qkv_epilogue": 2, "o_gate": 2, "mlp_activation": 2}
    assert ("boundary", M, False) == _stubs.CALLS[-1]  # the last boundary stores no stream


def test_rows_a_kernel_does_not_take_run_that_part_stock_and_say_so_once(stock, caplog):
    built, _ = stock
    draft = describe_vllm(built.model.model, kv_cache_layout="LBHNC")
    kernels = {**_stubs.KERNELS, policy.BOUNDARY: _stubs.capped(_stubs.Boundary, 16)}
    decode = DraftDecode(draft, planning.plan_vllm(draft, GPU, exact=policy.ALL_KERNELS), kernels=kernels)
    decode.prepare()
    assert decode.max_rows == 16
    m = 17
    want = _draft.run_block(built.model, built.config, CTX, m)
    _stubs.CALLS.clear()
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        _assert_same(_decode_block(built, decode, m), want)
        _decode_block(built, decode, m)
    kinds = [c[0] for c in _stubs.CALLS]
    assert "boundary" not in kinds and kinds.count("context_chain") == 2 and kinds.count("mlp_activation") == 4
    # (Counted on dspark.decode itself: where the plugin ran before, vLLM's logger has the forwarded copy too.)
    said = [r for r in caplog.records if r.name == "dspark.decode"
            and r.getMessage() == f"layer 0's attention boundary ran stock: {m} rows, more than 16"]
    assert len(said) == 1


def test_the_executors_log_reaches_vllms_logger(vllm_log):
    runtime.forward_core_logs()
    runtime.forward_core_logs()  # once per process
    logging.getLogger("dspark.decode").info("layer 0's o-gate ran stock: a test record")
    assert vllm_log.count("INFO layer 0's o-gate ran stock: a test record") == 1


def _specialized(dirs, monkeypatch, exact, stubs=None):
    """The plugin's class with latency_specialized, as on a GPU deployment:
    the deployment check passed (it refuses this CPU), the plan's target an
    H200 with every kernel, the given kernels taken as checked against vLLM,
    the kernels the stubs (``stubs``: others by name)."""
    stubs = {**_stubs.KERNELS, **(stubs or {})}
    monkeypatch.setattr(deployment, "check_deployment", lambda config: None)
    monkeypatch.setattr(planning, "vllm_target", lambda device, tp=1, kernels=None, **asked: GPU.replace(tp=tp))
    monkeypatch.setattr(planning, "VLLM_EXACT_KERNELS", {GPU.arch: exact})
    monkeypatch.setattr(runtime, "kernel_classes", lambda names: {n: stubs[n] for n in names})
    return _draft.build(*dirs, "latency_specialized")


def test_the_plugin_class_runs_the_decode_where_it_takes_the_call(dirs, stock, monkeypatch, vllm_log):
    from vllm.forward_context import set_forward_context

    from dspark_vllm.model import DSparkMuseSparkDSparkForCausalLM

    built = _specialized(dirs, monkeypatch, policy.ALL_KERNELS)
    model = built.model
    assert type(model) is DSparkMuseSparkDSparkForCausalLM and model.dspark.decode is not None
    assert model.dspark.draft.layers[0].attention.qkv_weight is model.model.layers[0].self_attn.qkv_proj.weight
    _stubs.CALLS.clear()
    _assert_same(_draft.run_block(model, built.config, CTX, M), stock[1])
    assert len(_stubs.CALLS) == 12  # the context chain and the 11 fused launches of the block
    # The memory-profiling run (no attention metadata, no cache bound): vLLM's forward.
    _stubs.CALLS.clear()
    ids, positions = torch.full((8,), _draft.MASK_ID), torch.arange(8)
    with torch.inference_mode(), set_forward_context(None, built.config, num_tokens=8):
        model.precompute_and_store_context_kv(_draft.context_states(model, 8), positions)
        model(input_ids=ids, positions=positions, inputs_embeds=None)
    assert _stubs.CALLS == []
    # A step above the mailbox's 16 rows: fused too (the bound kernels take any count).
    m = 17
    _assert_same(_draft.run_block(model, built.config, CTX, m), _draft.run_block(stock[0].model, stock[0].config,
                                                                                  CTX, m))
    assert len(_stubs.CALLS) == 12 and model.dspark.max_rows == 2**31 - 1
    assert "INFO The DSpark draft keeps vLLM's stock code for layer 0's attention, layer 1's attention: vLLM's " \
           "CPU_ATTN attention backend runs it; no DSpark kernel reproduces that backend's arithmetic." in vllm_log
    assert any(line.startswith("INFO The DSpark draft runs 12 of 14 planned parts fused (kernels boundary, "
                               "context_chain, mlp_activation, o_gate, qkv_epilogue, row_norm), for steps of 1 to "
                               "2147483647 rows") for line in vllm_log)
    assert not any("runs vLLM's stock forward" in line for line in vllm_log)


def test_steps_above_a_bound_kernels_rows_run_vllms_forward_said_once(dirs, stock, monkeypatch, vllm_log):
    """A kernel that takes fewer rows (its max_rows) bounds the steps the
    decode takes: up to it fused, above it vLLM's whole forward (one line
    for the first refused count, none for the next)."""
    built = _specialized(dirs, monkeypatch, policy.ALL_KERNELS,
                         {policy.MLP_ACTIVATION: _stubs.capped(_stubs.MlpActivation, 6)})
    model = built.model
    assert model.dspark.max_rows == 6
    assert any(line.endswith("for steps of 1 to 6 rows; other steps run vLLM's stock forward.") for line in vllm_log)
    for m, fused in ((6, True), (7, False), (9, False)):
        _stubs.CALLS.clear()
        _assert_same(_draft.run_block(model, built.config, CTX, m),
                     _draft.run_block(stock[0].model, stock[0].config, CTX, m))
        assert len(_stubs.CALLS) == (12 if fused else 1), m  # (the context chain takes the call either way)
    assert [line for line in vllm_log if "runs vLLM's stock forward:" in line] == [
        "INFO A DSpark draft step of 7 rows runs vLLM's stock forward: the kernels take 1 to 6 rows a call (said "
        "once; every larger step runs stock too)."]


def test_with_no_kernel_checked_the_plugin_class_keeps_vllms_forward(dirs, stock, monkeypatch, vllm_log):
    built = _specialized(dirs, monkeypatch, frozenset())
    assert built.model.dspark.decode is None and built.model.dspark.plan.fused_count() == (0, 14)
    _assert_same(_draft.run_block(built.model, built.config, CTX, M), stock[1])
    assert "WARNING The DSpark draft runs vLLM's stock forward: 0 of 14 planned parts fused." in vllm_log
    assert any("the DSpark boundary kernel is not yet checked bit for bit against vLLM 0.33.0's" in line
               for line in vllm_log)


def test_the_build_passes_the_opt_ins_additional_config_asks_for(dirs, monkeypatch):
    """``SpecializedDecode.build`` plans with the package GEMM and the ordered
    GEMM where ``additional_config`` asks for them (read by
    ``allreduce.package_gemm_asked`` and ``planning.ordered_gemm_asked``)."""
    from dspark_vllm import allreduce

    seen = []

    def target(device, tp=1, kernels=None, **asked):
        seen.append(asked)
        return GPU.replace(tp=tp)

    monkeypatch.setattr(deployment, "check_deployment", lambda config: None)
    monkeypatch.setattr(planning, "vllm_target", target)
    monkeypatch.setattr(planning, "VLLM_EXACT_KERNELS", {GPU.arch: frozenset()})
    monkeypatch.setattr(allreduce, "package_gemm_asked", lambda config: True)
    monkeypatch.setattr(planning, "ordered_gemm_asked", lambda config, tp: tp == 1)
    _draft.build(*dirs, "latency_specialized")
    assert seen == [{"package_gemm": True, "ordered_gemm": True}]  # TP1: on by default


@pytest.mark.parametrize(("error", "words"), [
    (lambda: Unsupported("the mlp_activation kernel takes less"),
     "binding its kernels refused the plan: the mlp_activation kernel takes less."),
    (lambda: RuntimeError("no compiler on this host"),
     "binding or compiling its kernels failed (RuntimeError: no compiler on this host)."),
])
def test_a_failure_while_the_kernels_are_bound_keeps_vllms_forward(dirs, stock, monkeypatch, vllm_log, error, words):
    """Any exception while ``SpecializedDecode.build`` binds or compiles the
    kernels (a host class's refusal or anything else) keeps vLLM's stock
    forward with the reason logged, never an exception out of model loading."""

    class Failing(_stubs.MlpActivation):
        def __init__(self, constants):
            raise error()

    built = _specialized(dirs, monkeypatch, policy.ALL_KERNELS, {policy.MLP_ACTIVATION: Failing})
    assert built.model.dspark.decode is None
    _assert_same(_draft.run_block(built.model, built.config, CTX, M), stock[1])
    assert f"WARNING The DSpark draft keeps vLLM's stock forward: {words}" in vllm_log


def test_the_steps_row_counts_are_the_multiples_of_n():
    """``runtime.step_rows``: vLLM's DSpark speculator drafts N tokens a
    request, so the ordered GEMMs are checked at the multiples of N up to
    their 64 rows; no N, no restriction."""
    import types

    from dspark_vllm.runtime import step_rows

    def config(n):
        return types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=n))

    assert list(step_rows(config(4))) == list(range(4, 65, 4))
    assert list(step_rows(config(1))) == list(range(1, 65))
    assert list(step_rows(config(8))) == [8, 16, 24, 32, 40, 48, 56, 64]
    for n in (None, 0, True, "4"):
        assert step_rows(config(n)) is None
    assert step_rows(types.SimpleNamespace()) is None
