"""The kernels dspark-comm provides (the ``dspark.kernels`` entry point):
read by the planner without importing the CuTe DSL.

The fused all-reduce boundary passed its whole TP2 suite on two H200s
(2026-11-30: bit for bit NCCL then the spec's boundary for m = 1..16, special
values, published partials, the fallback, the absent-peer timeout, and the
stress run of 100,000 back-to-back calls with graph replays)."""

KERNELS: tuple[str, ...] = ("all_reduce_boundary",)
