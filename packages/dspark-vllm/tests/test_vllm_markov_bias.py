"""The plugin's greedy Markov stage with the bias GEMM in its step
(``dspark_vllm.markov.MarkovStage`` with dspark-cute's ``MarkovBiasStep``),
on vLLM's real draft class on the CPU (``test_vllm_markov``'s model and
speculators):

- the hook drafts vLLM's tokens through ``run_fused_greedy_loop`` at the
  request counts the build-time check bound (the host class's launch
  computing the spec's step on the CPU, the bias from ``w1`` at the previous
  ids), and through the step after vLLM's bias GEMM at a count it refused;
- the build keeps the step after vLLM's bias GEMM, with the reason logged,
  on an architecture outside ``BIAS_CHECKED``, where the check binds no
  request count, and where building raises.

The check itself (against the live cuBLAS) and the kernel run on the GPU:
dspark-cute's ``test_gpu_markov_bias_step.py``."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import test_vllm_markov as markov_tests  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_vllm_markov import CpuStep, run_hook, stock_and_twin  # noqa: E402

from dspark_core.runtime.gemm_check import CheckResult, Finding  # noqa: E402
from dspark_core.spec import markov as spec  # noqa: E402
from dspark_core.spec.split_order import SplitOrder  # noqa: E402
from dspark_vllm import markov as hook  # noqa: E402
from dspark_vllm import markov_plan as stage_plan  # noqa: E402

# test_vllm_markov's fixtures: vLLM's draft built on the CPU, the printed seed.
built = markov_tests.built
seed = markov_tests.seed
# The request count the fake check finds cuBLAS splitting (the stage then runs the step after vLLM's GEMM).
SPLIT_ROWS = 3


class CpuBiasStep:
    """dspark-cute's ``MarkovBiasStep`` with its check simulated (cuBLAS's
    order one split at every request count but ``SPLIT_ROWS``, bound by the
    real ``one_split_rows``), no compile, and its launch computing the spec's
    step on the CPU: ``w1`` at the previous ids, the bias GEMM, the step."""

    launches = 0
    fail = False

    def __new__(cls, *args, **kwargs):
        from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep, one_split_rows

        class Step(MarkovBiasStep):
            def check(self, rows=None, reference=None, seed=0):
                if CpuBiasStep.fail:
                    raise RuntimeError("the check's probe failed")
                rows = tuple(range(1, self.max_rows + 1))
                result = CheckResult(k=self.constants.rank, seed=seed)
                for m in rows:
                    result.findings[m] = Finding(m, SplitOrder(64, 2 if m == SPLIT_ROWS else 1), 1)
                self.rows, refused = one_split_rows(result, rows)
                self.reasons = refused
                return result

            def _launch_kernel(self, base, prev, tokens, first) -> None:
                c = self.constants
                CpuBiasStep.launches += 1
                bias = F.linear(self.w1[prev.long()], self.w2)[:, :c.vocab]
                tokens.copy_(spec.greedy_step(base, bias, c.multiplier, c.soft_cap, self.d2t))

        return Step(*args, **kwargs)


def bias_stage(built, monkeypatch, arch="sm_90a", checked=frozenset({"sm_90a"})) -> hook.MarkovStage:
    from dspark_cute.cutedsl.markov import bias_step

    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)  # the CPU platform's GEMM dispatch
    # The test draft's Markov rank (32) is below the kernel's unit (64); the
    # launch here is the spec's on the CPU, the kernel's limits are the GPU
    # tests' (test_gpu_markov_bias_step.py).
    monkeypatch.setattr(bias_step, "fused_unsupported", lambda constants, max_rows=1: None)
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch=arch, checked=checked,
                             bias_class=CpuBiasStep)
    stage.build()
    assert stage.step is not None, stage.reason
    return stage


@pytest.mark.parametrize("num_reqs", [1, SPLIT_ROWS, 5])
def test_hook_drafts_vllms_tokens_with_the_bias_in_the_step(built, seed, monkeypatch, num_reqs):
    stock, s, hidden = stock_and_twin(built, seed, monkeypatch, num_reqs)
    with torch.inference_mode():
        stage = bias_stage(built, monkeypatch)
    assert stage.bias_step is not None and SPLIT_ROWS not in stage.bias_step.rows, stage.bias_reason
    assert "2 splits" in stage.bias_step.reasons[SPLIT_ROWS]
    done = run_hook(built.model, stage, s, num_reqs, hidden, monkeypatch, (CpuBiasStep, CpuStep))
    n = s.num_speculative_steps
    # At the count the check refused: the step after vLLM's bias GEMM.
    assert done == ((0, n) if num_reqs == SPLIT_ROWS else (n, 0))
    assert torch.equal(s.draft_tokens, stock.draft_tokens)


def test_build_keeps_the_step_after_vllms_gemm_with_the_reason(built, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=hook.logger.name)
    stage = hook.MarkovStage(built.model, built.config, step_class=CpuStep, arch="sm_90a",
                             checked=frozenset({"sm_90a"}), bias_class=CpuBiasStep)
    monkeypatch.setattr(stage_plan, "bias_gemm_reason", lambda model: None)
    stage.build()  # the real kernel limits: this draft's rank 32 is refused, the step kept after vLLM's GEMM
    assert stage.step is not None and stage.bias_step is None and "multiple of 64" in stage.bias_reason
    stage = bias_stage(built, monkeypatch, arch="sm_100a", checked=frozenset({"sm_100a"}))
    assert stage.bias_step is None and "markov_bias_step" in stage.bias_reason and "sm_100a" in stage.bias_reason
    monkeypatch.setattr(CpuBiasStep, "fail", True)
    stage = bias_stage(built, monkeypatch)
    assert stage.bias_step is None and "RuntimeError: the check's probe failed" in stage.bias_reason
    monkeypatch.setattr(CpuBiasStep, "fail", False)
    monkeypatch.setattr(stage_plan, "BIAS_CHECKED", frozenset())
    stage = bias_stage(built, monkeypatch)
    assert stage.bias_step is None and "not yet checked" in stage.bias_reason
    assert any("runs its step after vLLM's bias GEMM" in r.getMessage() for r in caplog.records)
