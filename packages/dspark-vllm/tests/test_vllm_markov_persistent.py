"""The plugin's greedy Markov stage with all N steps in one launch
(``dspark_vllm.markov.MarkovStage`` with dspark-cute's
``MarkovPersistentLoop``), on vLLM's real draft class on the CPU
(``test_vllm_markov``'s model and speculators, ``test_vllm_markov_bias``'s
bias step with its simulated check):

- on an architecture of ``PERSISTENT_CHECKED`` the hook drafts vLLM's
  tokens in one launch at the request counts the bias step's check bound
  (the host class's launch computing the spec's loop on the CPU), and at a
  count the check refused through the step after vLLM's bias GEMM;
- where the architecture is not in ``PERSISTENT_CHECKED`` the stage
  launches once a step, with the reason logged; a build that
  raises, or whose probe launch drafts other tokens than vLLM's loop, keeps
  one launch a step too.

The kernel runs on the GPU: dspark-cute's ``test_gpu_markov_persistent.py``."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import test_vllm_markov as markov_tests  # noqa: E402
import torch  # noqa: E402
from test_vllm_markov import CpuStep, run_hook, stock_and_twin  # noqa: E402
from test_vllm_markov_bias import SPLIT_ROWS, CpuBiasStep, bias_stage  # noqa: E402

from dspark_core.spec import markov as spec  # noqa: E402
from dspark_vllm import markov as hook  # noqa: E402
from dspark_vllm import markov_plan as stage_plan  # noqa: E402

built = markov_tests.built
seed = markov_tests.seed


class CpuLoop:
    """dspark-cute's ``MarkovPersistentLoop`` without its compile, its launch
    computing the spec's greedy loop on the CPU."""

    launches = 0
    fail = False
    wrong = False
    refuse_pdl = False  # the launch raises with PDL (as a driver that refuses the combination would)

    def __new__(cls, *args, **kwargs):
        from dspark_cute.cutedsl.markov.persistent import MarkovPersistentLoop

        class Loop(MarkovPersistentLoop):
            def prepare(self, prev_dtypes=()) -> None:
                if CpuLoop.fail:
                    raise RuntimeError("the loop's compile failed")

            def _launch_kernel(self, base, prev, tokens) -> None:
                c = self.constants
                if CpuLoop.refuse_pdl and self.pdl:
                    raise RuntimeError("cudaErrorInvalidValue: a cooperative launch with PDL")
                CpuLoop.launches += 1
                tokens.copy_(spec.greedy_loop(base, prev.long(), self.w1, self.w2, c.multiplier, c.soft_cap,
                                              self.d2t))
                if CpuLoop.wrong:
                    tokens[0, 0] += 1

        return Loop(*args, **kwargs)


def loop_stage(built, monkeypatch, checked=frozenset({"sm_90a"})) -> hook.MarkovStage:
    from dspark_cute.cutedsl.markov import persistent

    # The test draft's rank (32) is below the kernels' unit (64), and a CPU
    # has no cooperative launch to ask about: the kernel's limits are the GPU
    # and compile tests'.
    monkeypatch.setattr(persistent, "persistent_unsupported", lambda constants, max_rows, sms=None: None)
    monkeypatch.setattr(stage_plan, "PERSISTENT_CHECKED", checked)
    monkeypatch.setattr(hook, "_persistent_class", lambda: CpuLoop)
    return bias_stage(built, monkeypatch)


@pytest.mark.parametrize("num_reqs", [1, SPLIT_ROWS, 5])
def test_hook_drafts_vllms_tokens_in_one_launch(built, seed, monkeypatch, num_reqs):
    stock, s, hidden = stock_and_twin(built, seed, monkeypatch, num_reqs)
    with torch.inference_mode():
        stage = loop_stage(built, monkeypatch)
    assert stage.loop is not None, stage.loop_reason
    assert stage.loop.steps == s.num_speculative_steps
    assert set(stage.loop.rows) == {m for m in stage.bias_step.rows if m <= 32}
    assert "2 splits" in stage.loop.reasons[SPLIT_ROWS]
    done = run_hook(built.model, stage, s, num_reqs, hidden, monkeypatch, (CpuLoop, CpuBiasStep, CpuStep))
    assert done == ((0, 0, s.num_speculative_steps) if num_reqs == SPLIT_ROWS else (1, 0, 0))
    assert torch.equal(s.draft_tokens, stock.draft_tokens)


def test_build_launches_once_a_step_with_the_reason(built, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=hook.logger.name)
    stage = loop_stage(built, monkeypatch, checked=frozenset())
    assert stage.bias_step is not None and stage.loop is None
    assert "markov_persistent_loop" in stage.loop_reason and "sm_90a" in stage.loop_reason
    monkeypatch.setattr(CpuLoop, "fail", True)
    stage = loop_stage(built, monkeypatch)
    assert stage.bias_step is not None and stage.loop is None
    assert stage.loop_reason == "RuntimeError: the loop's compile failed"
    monkeypatch.setattr(CpuLoop, "fail", False)
    monkeypatch.setattr(CpuLoop, "wrong", True)
    stage = loop_stage(built, monkeypatch)  # the build's probe launch drafts other tokens than vLLM's loop
    assert stage.bias_step is not None and stage.loop is None and "other tokens" in stage.loop_reason
    assert any("launches once a step" in r.getMessage() for r in caplog.records)


def test_a_loop_refused_with_pdl_is_tried_without(built, seed, monkeypatch, caplog):
    """A driver that refuses the cooperative launch with PDL (the probe's
    launch raises): the build probes a loop without PDL and binds that one."""
    from dspark_cute.runtime import host

    caplog.set_level(logging.INFO, logger=hook.logger.name)
    monkeypatch.setattr(host, "pdl_supported", lambda device=None: True)
    monkeypatch.setattr(CpuLoop, "refuse_pdl", True)
    with torch.inference_mode():
        stage = loop_stage(built, monkeypatch)
    assert stage.loop is not None and not stage.loop.pdl, stage.loop_reason
    assert any("tries a launch without PDL" in r.getMessage() for r in caplog.records)
    stock, s, hidden = stock_and_twin(built, seed, monkeypatch, 1)
    done = run_hook(built.model, stage, s, 1, hidden, monkeypatch, (CpuLoop, CpuBiasStep, CpuStep))
    assert done == (1, 0, 0) and torch.equal(s.draft_tokens, stock.draft_tokens)
