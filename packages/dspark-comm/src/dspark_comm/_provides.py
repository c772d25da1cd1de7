"""The kernels dspark-comm provides (the ``dspark.kernels`` entry point):
read by the planner without importing the CuTe DSL.

Empty for now: on two H200s (2026-11-30) the fused all-reduce boundary passed
its bit-for-bit checks (NCCL then the spec's boundary, m = 1..16, special
values, published partials, the fallback), but the stress run of the TP2
suite (100,000 back-to-back calls with graph replays) has not run yet, so the
suite has not passed whole. Add "all_reduce_boundary" here once it has."""

KERNELS: tuple[str, ...] = ()
