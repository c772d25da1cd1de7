"""The draft-step benchmark (packages/dspark-cute/benchmarks/bench_draft_step.py)
runs where vLLM is not installed, so it names the plugin's sm_90a kernel set
itself: it must be the one the plugin plans with."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dspark_vllm import planning

BENCH = Path(__file__).resolve().parents[2] / "dspark-cute" / "benchmarks" / "bench_draft_step.py"


def test_the_benchmarks_kernel_set_is_the_plugins():
    spec = importlib.util.spec_from_file_location("bench_draft_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.VLLM_EXACT_SM90 == planning.exact_kernels("sm_90a")
    assert module.VLLM_EXACT_SM90  # the plugin fuses something on sm_90a
