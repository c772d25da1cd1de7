"""The draft's Markov stage against vLLM 0.33.0's own code on the CPU: the
spec (``dspark_core.spec.markov``) against vLLM's functions, and the plugin's
``sample_sequential`` hook (``dspark_vllm.markov.MarkovStage``) inside vLLM's
real ``DSparkSpeculator._sample_sequential``.

Real: vLLM's draft class built by its loader (``_draft``), its
``markov_embed``, ``markov_bias``, ``compute_draft_logits``,
``apply_output_logit_transform`` and ``map_draft_to_target``, and the
speculator (``DSparkSpeculator`` constructed on the CPU) whose loop and hook
lookup run unchanged. Stand-in: the CuTe kernel (``CpuStep``: dspark-cute's
``MarkovStep`` host class with its launch computing the spec's greedy step
on the CPU), since a CPU runs no CUDA kernel; the GPU suite
(``test_gpu_markov.py``) checks the kernel's bits.

On a CPU vLLM's soft cap divides (ATen's CUDA multiplies by the reciprocal)
and its ``torch.tanh`` is not CUDA's ``tanhf``, so the exact comparisons use
a draft without a soft cap (the metap multiplier stays); with the cap the
transform is compared within 4 ulp. Base logits get NaN, -inf rows and ties
planted (``compute_draft_logits`` wrapped on the instance)."""

from __future__ import annotations

import logging
import os
import time
import zlib

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
import torch  # noqa: E402

from dspark_core.spec import gumbel  # noqa: E402
from dspark_core.spec import markov as spec  # noqa: E402
from dspark_vllm import markov as hook  # noqa: E402
from dspark_vllm import markov_plan as stage_plan  # noqa: E402

R = 5
SEED = int(os.environ.get("DSPARK_SEED", "") or time.time_ns() % (2**31 - 1))


@pytest.fixture
def seed(request) -> int:
    """The session seed (``DSPARK_SEED`` or the clock) mixed with the test's name, printed."""
    value = (SEED + zlib.crc32(request.node.name.encode())) % 2**31
    print(f"seed {value} (DSPARK_SEED={SEED})")
    return value


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from dspark_vllm.plugin import register

    register()
    return _draft.build(*_draft.checkpoint_dir(tmp_path_factory, "markov", output_soft_cap_temp=None), "auto")


def speculator(built):
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    with set_current_vllm_config(built.config):
        s = DSparkSpeculator(built.config, torch.device("cpu"))
    s.model = built.model
    return s


def planted(gen, n_rows: int, vocab: int) -> torch.Tensor:
    """BF16 logits ``[n_rows, vocab]`` with NaN, an all -inf row, half -inf, repeated maxima."""
    x = (torch.randn(max(n_rows, 5), vocab, generator=gen) * 3).to(torch.bfloat16)
    x[1, [7, 100]] = float("nan")
    x[2] = float("-inf")
    x[3, ::2] = float("-inf")
    x[4, [3, 50, vocab - 1]] = 60.0
    return x[:n_rows]


def prime(s, gen, num_reqs: int) -> torch.Tensor:
    """Fill the speculator's inputs for ``num_reqs`` requests; the backbone's head hidden states."""
    n = s.num_speculative_steps
    s.sample_indices[: num_reqs * n] = torch.arange(num_reqs * n)
    anchors = torch.randint(0, _draft.VOCAB, (num_reqs,), generator=gen, dtype=torch.int32)
    s.input_buffers.input_ids[s._anchor_idx[:num_reqs]] = anchors
    s.draft_tokens.fill_(-7)
    return torch.randn(num_reqs * n + 3, _draft.HIDDEN, generator=gen).to(torch.bfloat16)


def with_planted_base(model, gen, monkeypatch, nan: bool = True):
    original = model.compute_draft_logits
    plants = {}

    def compute(hidden):
        out = original(hidden).clone()
        p = plants.setdefault(out.shape, planted(gen, out.shape[0], out.shape[1]))
        if not nan:  # (vLLM's Gumbel argmax of NaN depends on Triton's reduction tree: the stated exception)
            p = torch.where(torch.isnan(p), torch.full_like(p, 1.5), p)
        out[: min(5, out.shape[0])] = p[: min(5, out.shape[0])]
        return out

    monkeypatch.setattr(model, "compute_draft_logits", compute)


# ---------------------------------------------------------------- the spec against vLLM's functions


def test_spec_steps_are_vllms_functions(built, seed):
    gen = torch.Generator().manual_seed(seed)
    model = built.model
    v = model.config.draft_vocab_size
    prev = torch.randint(0, _draft.VOCAB, (R,), generator=gen)
    e = model.markov_embed(prev)
    w1, w2 = model.model.markov_head.markov_w1.weight, model.model.markov_head.markov_w2.weight
    assert torch.equal(e.view(torch.int16), torch.nn.functional.embedding(prev, w1).view(torch.int16))
    bias = model.markov_bias(e)
    assert bias.dtype == torch.bfloat16 and tuple(bias.shape) == (R, v)
    base = planted(gen, R, v)
    logits = base + bias
    assert torch.equal(spec.add_bias(base, bias).view(torch.int16), logits.view(torch.int16))
    y = model.apply_output_logit_transform(logits)
    want = spec.output_transform(logits, model.output_multiplier, model.output_soft_cap_temp)
    assert model.output_soft_cap_temp is None and model.output_multiplier != 1.0
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))
    d = y.argmax(dim=-1)
    assert torch.equal(d, spec.argmax(want)) and d[2] == 0 and d[1] == 7
    d2t = model.draft_id_to_target_id
    assert torch.equal(model.map_draft_to_target(d), spec.map_draft_to_target(d, d2t))
    # The F.linear the spec states for CUDA: vLLM's CPU GEMM agrees within one BF16 step here.
    ref = spec.markov_bias(e, w2, v).float()
    assert (ref - bias.float()).abs().max() <= ref.abs().max() * 2**-7


def test_soft_cap_transform_within_4_ulp(built, seed):
    """vLLM's transform with its cap (CPU: true division, the CPU tanh) against the spec's CUDA arithmetic."""
    gen = torch.Generator().manual_seed(seed)
    model = built.model
    x = (torch.randn(64, 384, generator=gen) * 40).to(torch.bfloat16)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    old = model.output_soft_cap_temp
    model.output_soft_cap_temp = 30.0
    try:
        got = model.apply_output_logit_transform(x)
    finally:
        model.output_soft_cap_temp = old
    want = spec.output_transform(x, model.output_multiplier, 30.0)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    ulp = (want[ok].view(torch.int32).long() - got[ok].view(torch.int32).long()).abs()
    assert ulp.max() <= 4 and torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


def test_vllms_loop_is_the_spec_loop(built, seed, monkeypatch):
    """vLLM's own ``_sample_sequential`` (greedy, no hook) drafts the spec's tokens, planted specials included."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    gen = torch.Generator().manual_seed(seed)
    model = built.model
    s = speculator(built)
    with_planted_base(model, gen, monkeypatch)
    hidden = prime(s, gen, R)
    with torch.inference_mode():
        DSparkSpeculator._sample_sequential(s, R, hidden)
        n = s.num_speculative_steps
        base = model.compute_draft_logits(hidden[s.sample_indices[: R * n]]).view(R, n, -1)
        prev = s.input_buffers.input_ids[s._anchor_idx[:R]]
        want = spec.greedy_loop(base, prev, model.model.markov_head.markov_w1.weight, None,
                                model.output_multiplier, None, model.draft_id_to_target_id,
                                bias_fn=model.markov_bias)
    assert torch.equal(s.draft_tokens[:R], want)
    assert (s.draft_tokens[R:] == -7).all()


# ---------------------------------------------------------------- the hook


class CpuStep:
    """dspark-cute's ``MarkovStep`` with the CUDA device check and compile skipped and its launch computing the
    spec's greedy step on the CPU (the kernel's contract: tokens, then w1 of them into embed)."""

    launches = 0

    def __new__(cls, *args, **kwargs):
        from dspark_cute.cutedsl.markov.greedy import MarkovStep

        class Step(MarkovStep):
            def prepare(self) -> None:
                pass

            def _check_device(self) -> None:
                pass

            def _launch_kernel(self, base, bias, tokens, embed, gather) -> None:
                c = self.constants
                CpuStep.launches += 1
                t = spec.greedy_step(base, bias, c.multiplier, c.soft_cap, self.d2t)
                tokens.copy_(t)
                if gather:
                    embed.copy_(self.w1[t])

        return Step(*args, **kwargs)


class CpuSampleStep:
    """dspark-cute's ``MarkovSampleStep`` with its launch computing the spec's probabilistic step on the CPU."""

    launches = 0

    def __new__(cls, *args, **kwargs):
        from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

        class Step(MarkovSampleStep):
            def prepare(self) -> None:
                pass

            def _launch_kernel(self, base, bias, tokens, embed, gather, idx_map, temperature, seeds, pos, cache,
                               col) -> None:
                c = self.constants
                CpuSampleStep.launches += 1
                y = spec.markov_logits(base, bias, c.multiplier, c.soft_cap)
                buf = torch.full((base.shape[0], c.target_vocab), float("-inf"), dtype=torch.bfloat16)
                scatter = torch.arange(c.vocab) + self.d2t
                t = gumbel.probabilistic_step(y, scatter, buf, idx_map, temperature, seeds, pos, cache, col)
                tokens.copy_(t)
                if gather:
                    embed.copy_(self.w1[t])

        return Step(*args, **kwargs)


def fused_stage(built, monkeypatch) -> hook.MarkovStage:
    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)  # the CPU platform's GEMM dispatch
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             checked=frozenset({"sm_90a"}), sample_class=CpuSampleStep)
    stage.build()
    assert stage.step is not None, stage.reason
    return stage


def stock_and_twin(built, seed, monkeypatch, num_reqs: int) -> tuple:
    """``(stock, twin, hidden)``: a speculator that has run vLLM's loop over
    ``num_reqs`` primed requests (planted base logits) and a twin with the
    same inputs and poisoned draft tokens, for the hook to run."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    gen = torch.Generator().manual_seed(seed)
    with_planted_base(built.model, gen, monkeypatch)
    stock = speculator(built)
    hidden = prime(stock, gen, num_reqs)
    s = speculator(built)
    s.input_buffers.input_ids.copy_(stock.input_buffers.input_ids)
    s.sample_indices.copy_(stock.sample_indices)
    s.draft_tokens.fill_(-7)
    with torch.inference_mode():
        DSparkSpeculator._sample_sequential(stock, num_reqs, hidden)
    return stock, s, hidden


def run_hook(model, stage, s, num_reqs: int, hidden, monkeypatch, counted) -> tuple:
    """vLLM's ``_sample_sequential`` on ``s`` with ``stage``'s hook set on
    ``model``: the launches each class of ``counted`` made (``launches``)."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    monkeypatch.setattr(model, "sample_sequential", stage.sample_sequential, raising=False)
    before = [cls.launches for cls in counted]
    with torch.inference_mode():
        DSparkSpeculator._sample_sequential(s, num_reqs, hidden)
    return tuple(cls.launches - b for cls, b in zip(counted, before))


@pytest.mark.parametrize("num_reqs", [1, R, 8])
def test_hook_drafts_vllms_tokens(built, seed, monkeypatch, num_reqs):
    stock, s, hidden = stock_and_twin(built, seed, monkeypatch, num_reqs)
    with torch.inference_mode():
        stage = fused_stage(built, monkeypatch)
    done = run_hook(built.model, stage, s, num_reqs, hidden, monkeypatch, (CpuStep,))
    assert done == (s.num_speculative_steps,)  # the hook ran the loop
    assert torch.equal(s.draft_tokens, stock.draft_tokens)


def probabilistic_twin(built, seed, monkeypatch, num_reqs: int) -> tuple:
    """``(s, hidden, want, want_cache)``: a speculator primed for ``num_reqs``
    requests with ``draft_logits`` set (vLLM's per-request sampling buffers
    filled, one request greedy), and the tokens and logits cache of vLLM's
    loop on it (its own embed, bias, transform, scatter and
    ``_sample_logits`` arguments) with the spec's ``gumbel.sample`` standing
    in for the Triton ``gumbel_sample`` (test_vllm_gumbel.py compares those
    two)."""
    gen = torch.Generator().manual_seed(seed)
    model = built.model
    with_planted_base(model, gen, monkeypatch, nan=False)
    s = speculator(built)
    hidden = prime(s, gen, num_reqs)
    n = s.num_speculative_steps
    slots = torch.randperm(8, generator=gen)[:num_reqs]
    s.sample_idx_mapping[: num_reqs * n] = slots.repeat_interleave(n)
    s.sample_pos[: num_reqs * n] = torch.randint(1, 10**5, (num_reqs * n,), generator=gen)
    s.temperature.copy_(torch.rand(8, generator=gen) + 0.5)
    s.temperature[slots[0]] = 0.0
    s.seeds.copy_(torch.randint(-(2**62), 2**62, (8,), generator=gen))
    s.draft_logits = torch.full((8, n, s.vocab_size), 7.0, dtype=torch.bfloat16)
    s._d2t_scatter_index = torch.arange(model.config.draft_vocab_size) + model.draft_id_to_target_id
    want_cache = s.draft_logits.clone()
    with torch.inference_mode():
        n_samples = num_reqs * n
        base = model.compute_draft_logits(hidden[s.sample_indices[:n_samples]]).view(num_reqs, n, -1)
        prev = s.input_buffers.input_ids[s._anchor_idx[:num_reqs]]
        idx = s.sample_idx_mapping[:n_samples].view(num_reqs, n)
        pos = s.sample_pos[:n_samples].view(num_reqs, n)
        want = torch.empty(num_reqs, n, dtype=torch.int64)
        buf = torch.full((8, s.vocab_size), float("-inf"), dtype=torch.bfloat16)
        for i in range(n):
            logits = model.apply_output_logit_transform(base[:, i] + model.markov_bias(model.markov_embed(prev)))
            rows = buf[:num_reqs]
            rows.index_copy_(1, s._d2t_scatter_index, logits.to(buf.dtype))
            want[:, i] = gumbel.sample(rows, idx[:, i], s.temperature, s.seeds, pos[:, i] - 1, True, want_cache, i)
            prev = want[:, i]
    return s, hidden, want, want_cache


def test_hook_drafts_probabilistically_as_vllms_loop_with_the_spec_sampler(built, seed, monkeypatch):
    """With ``draft_logits`` set: the hook's tokens and logits cache are vLLM's loop's (``probabilistic_twin``)."""
    num_reqs = 3
    s, hidden, want, want_cache = probabilistic_twin(built, seed, monkeypatch, num_reqs)
    with torch.inference_mode():
        stage = fused_stage(built, monkeypatch)
    assert stage.sample is not None, stage.sample_reason
    done = run_hook(built.model, stage, s, num_reqs, hidden, monkeypatch, (CpuSampleStep,))
    assert done == (s.num_speculative_steps,)
    assert torch.equal(s.draft_tokens[:num_reqs], want)
    assert torch.equal(s.draft_logits.view(torch.int16), want_cache.view(torch.int16))


def test_hook_declines_what_it_does_not_cover(built, seed, monkeypatch, caplog):
    gen = torch.Generator().manual_seed(seed)
    stage = fused_stage(built, monkeypatch)
    s = speculator(built)
    hidden = prime(s, gen, 2)
    s._d2t_scatter_index = torch.arange(built.model.config.draft_vocab_size) + built.model.draft_id_to_target_id
    cases = [
        ("_draft_topk", 4, "top-k Markov loop"),
        ("draft_logits", torch.zeros(8, 4, 512), "a logits cache of torch.float32"),
        ("use_fp64_gumbel", True, "FP64 Gumbel noise"),
        ("draft_watermarker", object(), "watermarker"),
        ("use_confidence_head", True, "confidence head"),
        ("acceptance_estimator", object(), "acceptance estimator"),
    ]
    caplog.set_level(logging.INFO, logger="vllm.dspark")
    for attr, value, words in cases:
        old = getattr(s, attr)
        setattr(s, attr, value)
        if attr == "use_fp64_gumbel":
            s.draft_logits = torch.zeros(8, 4, 512, dtype=torch.bfloat16)
        try:
            for _ in range(2):
                assert stage.sample_sequential(s, 2, hidden) is False
        finally:
            setattr(s, attr, old)
            s.draft_logits = None
        assert (s.draft_tokens == -7).all()
        assert sum(words in r.getMessage() for r in caplog.records) == 1, words  # logged once
    assert stage.sample_sequential(s, 9, hidden) is False  # more requests than max_num_seqs (8)
    assert any("9 requests: the fused steps take 1 to 8" in r.getMessage() for r in caplog.records)


def test_build_reasons(built, caplog):
    caplog.set_level(logging.INFO, logger="vllm.dspark")
    cases = [
        ({"arch": None}, "no CUDA GPU"),
        ({"arch": "sm_100a"}, "not yet checked bit for bit against vLLM 0.33.0's greedy Markov loop on an sm_100a"),
        ({"arch": "sm_100a", "checked": frozenset({"sm_90a"})}, "on an sm_100a GPU"),
        # The CPU platform dispatches vLLM's unquantized GEMMs to its own cpu_linear, not F.linear.
        ({"arch": "sm_90a", "checked": frozenset({"sm_90a"})}, "another backend than F.linear"),
    ]
    for kwargs, words in cases:
        stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, **kwargs)
        stage.build()
        assert stage.step is None and words in stage.reason
        assert stage.sample_sequential(object(), 1, torch.zeros(1)) is False
        assert any(words in r.getMessage() and "keeps vLLM's Markov loop" in r.getMessage() for r in caplog.records)


def test_the_default_checks_fuse_on_sm_90a_only(built, monkeypatch, caplog):
    """By default (MARKOV_CHECKED, SAMPLE_CHECKED: both checked against
    vLLM's loop on an H200) an sm_90a GPU fuses the greedy and the
    probabilistic steps; sm_100a fuses neither; a probabilistic step whose
    arch is not in its own set keeps vLLM's loop, saying why once."""
    caplog.set_level(logging.INFO, logger="vllm.dspark")
    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)  # the CPU platform's GEMM dispatch
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             sample_class=CpuSampleStep)
    stage.build()
    assert stage.step is not None and stage.reason is None
    assert stage.sample is not None and stage.sample_reason is None
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_100a",
                             sample_class=CpuSampleStep)
    stage.build()
    assert stage.step is None and stage.sample is None and "on an sm_100a GPU" in stage.reason
    monkeypatch.setattr(stage_plan, "SAMPLE_CHECKED", frozenset())
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             sample_class=CpuSampleStep)
    stage.build()
    assert stage.step is not None and stage.sample is None
    assert "not yet against vLLM 0.33.0's Triton gumbel_sample on an sm_90a" in stage.sample_reason
    assert sum("keeps vLLM's Markov loop for probabilistic drafting" in r.getMessage() for r in caplog.records) == 1


def test_build_refuses_a_head_the_kernel_does_not_take(built, monkeypatch):
    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)
    monkeypatch.setattr(built.model.config, "draft_vocab_size", 383)
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             checked=frozenset({"sm_90a"}))
    stage.build()
    assert stage.step is None and "multiple of 8, not 383" in stage.reason


def test_the_plugin_class_answers_the_hook():
    from dspark_vllm.model import DSparkMuseSparkDSparkForCausalLM

    class Fake:
        def __init__(self):
            self.markov = type("M", (), {"sample_sequential": lambda _, *a: ("called", a)})()

    got = DSparkMuseSparkDSparkForCausalLM.sample_sequential(Fake(), "spec", 3, "hidden")
    assert got == ("called", ("spec", 3, "hidden"))


# ---------------------------------------------------------------- the plan line


def test_plan_line(built, monkeypatch):
    model = built.model
    key = stage_plan.head_constants(model).key()
    assert stage_plan.plan_line(model, "sm_100a") == (
        "Markov stage: vLLM's loop: the DSpark markov_step kernel is not yet checked bit for bit against vLLM "
        "0.33.0's greedy Markov loop on an sm_100a GPU")
    # The defaults: both steps checked on sm_90a; this draft's Markov rank (32) is below the bias step's unit.
    rank_reason = ("the step after vLLM's bias GEMM (the fused bias step takes a Markov rank that is a multiple of 64 "
                   "(the build-time check's unit), not 32)")
    assert stage_plan.plan_line(model, "sm_90a").startswith(
        f"Markov stage: greedy drafting fused (markov_step {key}) for 1 to 128 requests, {rank_reason}; probabilistic "
        "drafting fused (markov_sample ")
    monkeypatch.setattr(stage_plan, "SAMPLE_CHECKED", frozenset())
    assert stage_plan.plan_line(model, "sm_90a").startswith(
        f"Markov stage: greedy drafting fused (markov_step {key}) for 1 to 128 requests, {rank_reason}; probabilistic "
        "drafting in vLLM's loop (the DSpark markov_sample kernel is checked against dspark-core's spec of vLLM's "
        "Gumbel sampler, not yet against vLLM 0.33.0's Triton gumbel_sample on an sm_90a GPU)")
    monkeypatch.undo()
    monkeypatch.setattr(stage_plan, "fused_bias_reason", lambda constants, rows: None)  # a head the bias step takes
    monkeypatch.setattr(stage_plan, "PERSISTENT_CHECKED", frozenset())
    line = stage_plan.plan_line(model, "sm_90a", frozenset({"sm_90a"}), rows=8)
    assert line.startswith(f"Markov stage: greedy drafting fused (markov_step {key}) for 1 to 8 requests, the bias "
                           "GEMM in the step (markov_bias_step) at the request counts up to 64 where the build-time "
                           "check finds cuBLAS's one-split order; probabilistic drafting fused (markov_sample ")
    assert "markov_persistent_loop" not in line  # where the loop is not checked
    # the kernel's own limits
    assert "multiple of 64" in stage_plan.persistent_reason(stage_plan.head_constants(model), 8)
    monkeypatch.setattr(stage_plan, "PERSISTENT_CHECKED", frozenset({"sm_90a"}))
    monkeypatch.setattr(stage_plan, "persistent_reason", lambda constants, rows: None)
    line = stage_plan.plan_line(model, "sm_90a", frozenset({"sm_90a"}), rows=8)
    assert ("cuBLAS's one-split order, all N steps in one launch (markov_persistent_loop) at those up to 32 where "
            "its build-time probe agrees with vLLM's loop; probabilistic") in line
    monkeypatch.setattr(stage_plan, "persistent_reason", lambda constants, rows: "no cooperative launch")
    line = stage_plan.plan_line(model, "sm_90a", frozenset({"sm_90a"}), rows=8)
    assert "one-split order, one launch a step (no cooperative launch); probabilistic" in line
    monkeypatch.setattr(stage_plan, "BIAS_CHECKED", frozenset())
    line = stage_plan.plan_line(model, "sm_90a", frozenset({"sm_90a"}), rows=8)
    assert "the step after vLLM's bias GEMM (the DSpark markov_bias_step kernel is not yet checked" in line
    assert "markov_persistent_loop" not in line
    monkeypatch.undo()
    assert line.endswith("; vLLM's loop for the top-k loop, a watermarker, FP64 Gumbel noise, the confidence head and "
                         "adaptive verification")
    monkeypatch.setattr(model, "output_soft_cap_temp", 30.0)
    assert stage_plan.head_constants(model).key() != key  # the cap is compiled in
    monkeypatch.setattr(model.config, "draft_vocab_size", 100)
    assert stage_plan.plan_line(model, "sm_90a", frozenset({"sm_90a"})).endswith(
        "a draft vocabulary below 2^31 that is a positive multiple of 8, not 100 (MarkovConstants.vocab)")


def test_the_plan_cli_prints_the_markov_line(built, capsys):
    from dspark_vllm.plan import main

    draft_dir = built.config.speculative_config.draft_model_config.model
    assert main([draft_dir, "--exact", "all"]) == 0
    assert "\nMarkov stage: greedy drafting fused (markov_step " in capsys.readouterr().out
    assert main([draft_dir, "--arch", "sm_100a"]) == 0
    assert "\nMarkov stage: vLLM's loop: the DSpark markov_step kernel is not yet checked bit for bit against " \
           "vLLM 0.33.0's greedy Markov loop on an sm_100a GPU\n" in capsys.readouterr().out


# ---------------------------------------------------------------- every limit: contract, plan line, build

# (label, Markov rank, draft vocabulary, target vocabulary, max_num_seqs, greedy taken, probabilistic taken):
# each limit of the Markov steps (dspark_core.contracts.limits, markov_rows) inside, at and past.
LIMIT_CASES = [
    ("rank inside", 16, None, None, 8, True, True),
    ("rank at the least", 8, None, None, 8, True, True),
    ("rank at the most", 2048, None, None, 8, True, True),
    ("rank past the most", 2056, None, None, 8, False, False),
    ("rank not a multiple of 8", 12, None, None, 8, False, False),
    ("rank past the least", 0, None, None, 8, False, False),
    ("draft vocabulary not a multiple of 8", 64, 383, None, 8, False, False),
    ("target vocabulary inside", 64, None, 512, 8, True, True),
    ("target vocabulary at the draft's", 64, None, 384, 8, True, True),
    ("target vocabulary past the draft's", 64, None, 376, 8, True, False),
    ("target vocabulary not a multiple of 8", 64, None, 390, 8, True, False),
    ("rows at the least", 64, None, None, 1, True, True),
    ("rows at the most", 64, None, None, 65535, True, True),
    ("rows past the most", 64, None, None, 65536, False, False),
]


@pytest.mark.parametrize(("label", "rank", "vocab", "target", "rows", "greedy", "sampled"), LIMIT_CASES,
                         ids=[case[0] for case in LIMIT_CASES])
def test_every_markov_limit_agrees_between_the_contract_the_plan_line_and_the_build(
        built, monkeypatch, label, rank, vocab, target, rows, greedy, sampled):
    """The contract (``markov_constants``, ``markov_sample_constants``,
    ``markov_rows``), ``python -m dspark_vllm.plan``'s line and the plugin's
    build (dspark-cute's real host classes, CPU launches) fuse and refuse
    the same, with the same reason: no plan line says fused where the build
    keeps vLLM's loop (the Markov rank the kernel gathers, a draft
    vocabulary larger than the target's, ``max_num_seqs`` past a grid's y)."""
    model = built.model
    head = model.model.markov_head
    # (Parameters set and restored by hand: monkeypatch's undo loses a module's Parameter.)
    saved = [(head.markov_w1, "weight"), (head.markov_w2, "weight"), (model, "draft_id_to_target_id")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    try:
        for owner, name, old in saved[:2]:
            setattr(owner, name, torch.nn.Parameter(torch.randn(old.shape[0], rank).to(torch.bfloat16),
                                                    requires_grad=False))
        # An identity map: distinct target ids below every target vocabulary tried.
        d2t = torch.zeros(vocab or model.config.draft_vocab_size, dtype=torch.int64)
        model.draft_id_to_target_id = torch.nn.Parameter(d2t, requires_grad=False)
        _walk_markov_limit(built, monkeypatch, rank, vocab, target, rows, greedy, sampled)
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


def _walk_markov_limit(built, monkeypatch, rank, vocab, target, rows, greedy, sampled) -> None:
    from dspark_core.contracts.markov import markov_constants, markov_rows, markov_sample_constants

    model = built.model
    if vocab is not None:
        monkeypatch.setattr(model.config, "draft_vocab_size", vocab)
    if target is not None:
        monkeypatch.setattr(model.config, "vocab_size", target)
    monkeypatch.setattr(built.config.scheduler_config, "max_num_seqs", rows)
    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)  # the CPU platform's GEMM dispatch

    v, vt, m = model.config.draft_vocab_size, model.config.vocab_size, float(model.output_multiplier)
    try:
        c = markov_constants(v, rank, m, None, True)
        markov_rows(rows)
        contract = True
    except (ValueError, TypeError):
        contract = False
    try:
        markov_sample_constants(v, vt, rank, m, None)
        contract_sampled = contract
    except (ValueError, TypeError):
        contract_sampled = False
    line = stage_plan.plan_line(model, "sm_90a", frozenset({"sm_90a"}), rows)
    stage = hook.MarkovStage(model, built.config, step_class=CpuStep, arch="sm_90a",
                             checked=frozenset({"sm_90a"}), sample_class=CpuSampleStep)
    stage.build()
    assert contract == ("greedy drafting fused" in line) == (stage.step is not None) == greedy, (line, stage.reason)
    assert contract_sampled == ("probabilistic drafting fused" in line) == (stage.sample is not None) == sampled, \
        (line, stage.sample_reason)
    if greedy:
        assert stage.step.constants == c and f"(markov_step {c.key()}) for 1 to {rows} requests" in line
    else:
        assert line == f"Markov stage: vLLM's loop: {stage.reason}"
    if greedy and not sampled:
        assert f"probabilistic drafting in vLLM's loop ({stage.sample_reason})" in line


def test_a_failure_while_the_step_is_built_keeps_vllms_loop(built, monkeypatch, caplog):
    """Any exception while the step is built or compiled (not only a
    refusal) keeps vLLM's loop with its reason logged, never out of model
    loading."""
    caplog.set_level(logging.INFO, logger="vllm.dspark")
    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)

    def failing(*args, **kwargs):
        raise RuntimeError("no compiler on this host")

    stage = hook.MarkovStage(built.model, built.config, step_class=failing, arch="sm_90a",
                             checked=frozenset({"sm_90a"}))
    stage.build()
    assert stage.step is None and stage.reason == "RuntimeError: no compiler on this host"
    assert any("keeps vLLM's Markov loop: RuntimeError: no compiler on this host" in r.getMessage()
               for r in caplog.records)
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             checked=frozenset({"sm_90a"}), sample_class=failing)
    stage.build()
    assert stage.step is not None and stage.sample is None
    assert stage.sample_reason == "RuntimeError: no compiler on this host"


def test_the_plan_cli_plans_the_markov_stage_for_max_num_seqs(built, capsys):
    from dspark_vllm.plan import main

    draft_dir = built.config.speculative_config.draft_model_config.model
    assert main([draft_dir, "--exact", "all", "--max-num-seqs", "65535"]) == 0
    assert ") for 1 to 65535 requests, " in capsys.readouterr().out
    assert main([draft_dir, "--exact", "all", "--max-num-seqs", "65536"]) == 0
    assert ("\nMarkov stage: vLLM's loop: the fused Markov step takes 1 to 65535 requests a step (a CUDA grid's y): "
            "vLLM's max_num_seqs of 65536\n") in capsys.readouterr().out
