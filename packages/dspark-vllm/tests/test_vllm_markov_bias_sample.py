"""The plugin's probabilistic Markov stage with the bias GEMM in its step
(``dspark_vllm.markov.MarkovStage`` with dspark-cute's
``MarkovBiasSampleStep``), on vLLM's real draft class on the CPU
(``test_vllm_markov``'s model and speculators, ``test_vllm_markov_bias``'s
bias step with its simulated check):

- on an architecture of ``BIAS_SAMPLE_CHECKED`` the hook drafts vLLM's
  tokens and logits cache with ``draft_logits`` set through
  ``run_fused_probabilistic_loop`` at the request counts the bias step's
  check bound (the host class's launch computing the spec's step on the
  CPU, the bias from ``w1`` at the previous ids), and through the step
  after vLLM's bias GEMM at a count it refused;
- on an architecture outside ``BIAS_SAMPLE_CHECKED`` the step runs after
  vLLM's bias GEMM, with the reason logged; so it
  does where the greedy bias step is not built, or where building raises.

The kernel runs on the GPU: dspark-cute's ``test_gpu_markov_bias_sample.py``."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import test_vllm_markov as markov_tests  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_vllm_markov import CpuSampleStep, CpuStep, probabilistic_twin, run_hook  # noqa: E402
from test_vllm_markov_bias import SPLIT_ROWS, CpuBiasStep  # noqa: E402

from dspark_core.spec import gumbel  # noqa: E402
from dspark_core.spec import markov as spec  # noqa: E402
from dspark_vllm import markov as hook  # noqa: E402
from dspark_vllm import markov_plan as stage_plan  # noqa: E402

built = markov_tests.built
seed = markov_tests.seed


class CpuBiasSample:
    """dspark-cute's ``MarkovBiasSampleStep`` without its compile, its launch
    computing the spec's probabilistic step on the CPU with the bias GEMM
    of ``w1`` at the previous ids."""

    launches = 0
    fail = False

    def __new__(cls, *args, **kwargs):
        from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleStep

        class Step(MarkovBiasSampleStep):
            def prepare(self, prev_dtypes=()) -> None:
                if CpuBiasSample.fail:
                    raise RuntimeError("the probabilistic bias step's compile failed")

            def _launch_kernel(self, base, prev, tokens, idx_map, temperature, seeds, pos, cache, col, first) -> None:
                c = self.constants
                CpuBiasSample.launches += 1
                y = spec.markov_logits(base, F.linear(self.w1[prev.long()], self.w2)[:, :c.vocab], c.multiplier,
                                       c.soft_cap)
                buf = torch.full((base.shape[0], c.target_vocab), float("-inf"), dtype=torch.bfloat16)
                scatter = torch.arange(c.vocab) + self.d2t
                tokens.copy_(gumbel.probabilistic_step(y, scatter, buf, idx_map, temperature, seeds, pos, cache, col))

        return Step(*args, **kwargs)


def sample_stage(built, monkeypatch, checked=frozenset({"sm_90a"})) -> hook.MarkovStage:
    from dspark_cute.cutedsl.markov import bias_sample, bias_step

    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)  # the CPU platform's GEMM dispatch
    # The test draft's Markov rank (32) is below the kernels' unit (64); the
    # launches here are the spec's on the CPU, the kernels' limits the GPU tests'.
    monkeypatch.setattr(bias_step, "fused_unsupported", lambda constants, max_rows=1: None)
    monkeypatch.setattr(bias_sample, "fused_unsupported", lambda constants, max_rows=1: None)
    monkeypatch.setattr(stage_plan, "BIAS_SAMPLE_CHECKED", checked)
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             checked=frozenset({"sm_90a"}), sample_class=CpuSampleStep, bias_class=CpuBiasStep,
                             bias_sample_class=CpuBiasSample)
    stage.build()
    assert stage.step is not None and stage.sample is not None and stage.bias_step is not None
    return stage


@pytest.mark.parametrize("num_reqs", [1, SPLIT_ROWS, 5])
def test_hook_drafts_vllms_tokens_and_cache_with_the_bias_in_the_step(built, seed, monkeypatch, num_reqs):
    s, hidden, want, want_cache = probabilistic_twin(built, seed, monkeypatch, num_reqs)
    with torch.inference_mode():
        stage = sample_stage(built, monkeypatch)
    assert stage.bias_sample is not None, stage.bias_sample_reason
    assert set(stage.bias_sample.rows) == {m for m in stage.bias_step.rows if m <= 32}
    assert "2 splits" in stage.bias_sample.reasons[SPLIT_ROWS]
    done = run_hook(built.model, stage, s, num_reqs, hidden, monkeypatch, (CpuBiasSample, CpuSampleStep))
    n = s.num_speculative_steps
    # At the count the check refused: the step after vLLM's bias GEMM.
    assert done == ((0, n) if num_reqs == SPLIT_ROWS else (n, 0))
    assert torch.equal(s.draft_tokens[:num_reqs], want)
    assert torch.equal(s.draft_logits.view(torch.int16), want_cache.view(torch.int16))


def test_build_keeps_the_step_after_vllms_gemm_with_the_reason(built, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=hook.logger.name)
    stage = sample_stage(built, monkeypatch, checked=frozenset())
    assert stage.bias_sample is None and "markov_bias_sample" in stage.bias_sample_reason
    assert "sm_90a" in stage.bias_sample_reason
    monkeypatch.setattr(CpuBiasSample, "fail", True)
    stage = sample_stage(built, monkeypatch)
    assert stage.bias_sample is None
    assert stage.bias_sample_reason == "RuntimeError: the probabilistic bias step's compile failed"
    monkeypatch.setattr(CpuBiasSample, "fail", False)
    monkeypatch.setattr(stage_plan, "BIAS_CHECKED", frozenset())  # no greedy bias step: nothing to bind to
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             checked=frozenset({"sm_90a"}), sample_class=CpuSampleStep, bias_class=CpuBiasStep,
                             bias_sample_class=CpuBiasSample)
    stage.build()
    assert stage.sample is not None and stage.bias_step is None and stage.bias_sample is None
    assert "not both built" in stage.bias_sample_reason
    assert any("probabilistic Markov stage runs its step after vLLM's bias GEMM" in r.getMessage()
               for r in caplog.records)


def test_plan_line_names_the_probabilistic_bias_step(built, monkeypatch):
    from dspark_cute.cutedsl.markov import bias_step

    monkeypatch.setattr(bias_step, "fused_unsupported", lambda constants, max_rows=1: None)
    monkeypatch.setattr(stage_plan, "BIAS_SAMPLE_CHECKED", frozenset())
    line = stage_plan.plan_line(built.model, "sm_90a", rows=8)
    assert "markov_bias_sample" not in line  # where the kernel is not checked
    monkeypatch.setattr(stage_plan, "BIAS_SAMPLE_CHECKED", frozenset({"sm_90a"}))
    line = stage_plan.plan_line(built.model, "sm_90a", rows=8)
    assert "the bias GEMM in the step (markov_bias_sample)" in line
    assert "markov_bias_sample" not in stage_plan.plan_line(built.model, "sm_100a", frozenset({"sm_100a"}), rows=8)
