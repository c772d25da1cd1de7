"""The GPU architectures each fused Markov kernel was checked on, bit for bit
against vLLM 0.33.0's loop (and, where it replaces a faster path, measured
faster), with the reason a deployment elsewhere keeps the kernel's
predecessor. The plugin's plan (``dspark_vllm.markov_plan``) and the
benchmarks (``bench_draft_step --markov auto``) read the same sets, so a
benchmark runs what a user's server runs. Each entry names its run."""

from __future__ import annotations

# GPU architectures on which the greedy step was checked bit for bit against
# vLLM's greedy loop: dspark-cute's test_gpu_markov.py (against the loop in its
# own torch ops) and bench_draft_step (inside the draft step from vLLM's
# binaries), both on an H200 on 2026-12-03.
MARKOV_CHECKED: frozenset[str] = frozenset({"sm_90a"})
MARKOV_UNCHECKED = ("the DSpark markov_step kernel is not yet checked bit for bit against vLLM 0.33.0's greedy "
                    "Markov loop on an {arch} GPU")
# GPU architectures on which the probabilistic step was checked bit for bit
# against vLLM's loop with its own Triton gumbel_sample binary (compiled with
# Triton 3.8.0 by scripts/stock/compile_stock.py): dspark-cute's
# test_gpu_markov_stock.py, tokens and the whole logits cache, on an H200 on
# 2026-12-03 (NaN logits excepted, the spec's stated exception).
SAMPLE_CHECKED: frozenset[str] = frozenset({"sm_90a"})
SAMPLE_UNCHECKED = ("the DSpark markov_sample kernel is checked against dspark-core's spec of vLLM's Gumbel sampler, "
                    "not yet against vLLM 0.33.0's Triton gumbel_sample on an {arch} GPU")
# GPU architectures on which the greedy step with its bias GEMM was checked
# bit for bit against vLLM's greedy loop in its own torch ops (cuBLAS's bias
# GEMM): dspark-cute's test_gpu_markov_bias_step.py and bench_draft_step, on
# an H200 on 2026-12-04. Where it runs, a build-time check against the live
# cuBLAS still decides each request count.
BIAS_CHECKED: frozenset[str] = frozenset({"sm_90a"})
BIAS_UNCHECKED = ("the DSpark markov_bias_step kernel is not yet checked bit for bit against vLLM 0.33.0's greedy loop "
                  "on an {arch} GPU")
# GPU architectures on which the greedy loop in one persistent launch was
# checked bit for bit against vLLM's greedy loop (dspark-cute's
# test_gpu_markov_persistent.py: 20 passed on an H100, 2026-12-07, main at
# df5b210) and measured faster than the one-launch-a-step loop it replaces
# (scripts/probes/markov_loop.py, the same H100: one request of 4 tokens 21.7
# µs against the bias step's 29.5, vLLM's loop 110; 32 requests 34.6 against
# 42.8). Where it runs, the build's probe launch (also captured in a CUDA
# graph) must agree with vLLM's loop first.
PERSISTENT_CHECKED: frozenset[str] = frozenset({"sm_90a"})
PERSISTENT_UNCHECKED = ("the DSpark markov_persistent_loop kernel is not yet checked bit for bit against vLLM 0.33.0's "
                        "greedy loop and measured on an {arch} GPU")
# GPU architectures on which the probabilistic step with its bias GEMM was
# checked bit for bit against the probabilistic step after cuBLAS's bias GEMM,
# the spec's loop and vLLM's gumbel_sample binary (dspark-cute's
# test_gpu_markov_bias_sample.py: 9 passed on an H100, 2026-12-07, main at
# df5b210) and measured faster than the step after cuBLAS's GEMM it replaces
# (scripts/probes/markov_loop.py --sample, an H100, 2026-12-07 19:08 UTC: N =
# 4, 35.3 against 46.6 µs at one request, 39.2 against 60.9 at 4, 120.0
# against 201.5 at 32).
BIAS_SAMPLE_CHECKED: frozenset[str] = frozenset({"sm_90a"})
BIAS_SAMPLE_UNCHECKED = ("the DSpark markov_bias_sample kernel is not yet checked bit for bit against vLLM 0.33.0's "
                         "probabilistic loop on an {arch} GPU")


__all__ = ["BIAS_CHECKED", "BIAS_SAMPLE_CHECKED", "BIAS_SAMPLE_UNCHECKED", "BIAS_UNCHECKED", "MARKOV_CHECKED",
           "MARKOV_UNCHECKED", "PERSISTENT_CHECKED", "PERSISTENT_UNCHECKED", "SAMPLE_CHECKED", "SAMPLE_UNCHECKED"]
