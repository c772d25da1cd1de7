"""The kernels dspark-comm provides (the ``dspark.kernels`` entry point):
read by the planner without importing the CuTe DSL.

What ran on two H200s (2026-11-30):

- the fused all-reduce boundary: its whole TP2 suite, 14 passed
  (``tests/test_comm_multigpu.py``: bit for bit NCCL then the spec's boundary
  for m = 1..16, special values, published partials, the fallback, the
  absent-peer timeout, and the stress run of 100,000 back-to-back calls with
  graph replays);
- the package GEMM: 5 passed (``tests/test_package_gemm_multigpu.py``: the
  plain GEMM within its stated bound against float64, publish + consume bit
  for bit plain GEMM + the pushing all-reduce / boundary and NCCL, the stress
  run of interleaved published and pushed calls with per-rank delays and
  graph replays); ``benchmarks/bench_package_gemm.py`` ran (GEMM + publish +
  fused boundary 9.8-43.0 us against cuBLAS alone 5.3-34.8 us: faster than
  cuBLAS + the fused boundary, not yet as fast as cuBLAS alone);
- the TP2 draft: 13 passed (``tests/test_draft_multigpu.py``: bit for bit
  the stock TP2 forward with the package GEMM off, the same greedy tokens
  with it on).

So both are advertised: the planner runs a TP draft's o_proj and down_proj
on the package GEMM where the all-reduce fuses. The package GEMM sums in its
own order (within its bound, not cuBLAS's bits), so a decode that must be bit
for bit the stock TP forward excludes it (``exclude={"package_gemm"}``)."""

KERNELS: dict[str, str] = {
    "all_reduce_boundary": "dspark_comm.cutedsl.all_reduce_boundary:AllReduceBoundary",
    "package_gemm": "dspark_comm.cutedsl.package_gemm:PackageGemm",
}
