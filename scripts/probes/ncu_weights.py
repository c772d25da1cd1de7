"""Probe (not part of any package): why tiled GEMMs stream a large weight at
4.0-4.3 TB/s where a row-per-program GEMV reaches 4.4-4.5 (issue 33).
Hardware counters, at m = 1, of three kernels over each of two draft weights
(gate_up [32768, 8192], down [8192, 16384]): cuBLAS (``F.linear``), the
ordered GEMM (its order found against cuBLAS, the default kernel: cp.async at
these sizes) and a plain Triton GEMV, one weight row a program, under Nsight
Compute.

``python scripts/probes/ncu_weights.py run`` warms every kernel, then launches
each once between ``cudaProfilerStart`` / ``Stop`` and writes the labels to
``$OUT/ncu_labels.json``; run it under ``ncu --profile-from-start off --csv
--page raw --metrics $(python scripts/probes/ncu_weights.py metrics)`` into
``$OUT/ncu.csv``; ``report`` prints one row per kernel (``ncu_gemm.report``'s
table with these metrics)."""
import os
import sys

import ncu_gemm  # (this folder: sys.path[0] when run as a script)

# ncu_gemm's duration, DRAM, launch-shape and register counters, then these.
METRICS = ncu_gemm.METRICS[:6] + [
    "launch__waves_per_multiprocessor",
    "lts__t_sector_op_read_hit_rate.pct",
    "lts__t_sectors_srcunit_tex_op_read.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__warps_issue_stalled_long_scoreboard_per_warp_active.pct",
    "dram__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "lts__d_sectors_fill_device.sum",
]
ncu_gemm.METRICS[:] = METRICS


def run() -> None:
    import torch
    import triton
    import triton.language as tl

    from dspark_core.contracts.constants import ordered_gemm_constants
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemm

    @triton.jit
    def gemv_rows(x, w, y, K: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            acc += tl.load(w + row.to(tl.int64) * K + cols).to(tl.float32) * tl.load(x + cols).to(tl.float32)
        tl.store(y + row, tl.sum(acc).to(tl.bfloat16))

    gen = torch.Generator(device="cuda").manual_seed(7)
    launches = []
    for role, n, k in (("gate_up", 32768, 8192), ("down", 8192, 16384)):
        w = (torch.randn((n, k), generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        x = torch.randn((1, k), generator=gen, device="cuda").to(torch.bfloat16)
        y = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")
        g = OrderedGemm(ordered_gemm_constants(role, w), w)
        result = g.check((1,))
        print(f"{role}: {result.summary()}", flush=True)
        gb = 2 * n * k / 1e9
        launches.append((f"cublas {role} ({gb:.2f} GB)", lambda x=x, w=w, y=y: torch.matmul(x, w.t(), out=y)))
        if 1 in g.orders:
            launches.append((f"ordered {role}", lambda x=x, y=y, g=g: g.launch(x, y)))
        launches.append((f"triton rows {role}",
                         lambda x=x, w=w, y=y, n=n, k=k: gemv_rows[(n,)](x, w, y, K=k, BLOCK_K=1024, num_warps=4)))
    for _, fn in launches:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in launches:
        torch.cuda._sleep(1000)  # a gap: the L2 holds nothing of the previous weight that matters at these sizes
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    import json

    with open(os.path.join(os.environ.get("OUT", "bench-results"), "ncu_labels.json"), "w") as f:
        json.dump([label for label, _ in launches], f)


if __name__ == "__main__":
    if sys.argv[1:] == ["run"]:
        run()
    elif sys.argv[1:] == ["report"]:
        ncu_gemm.report()
    elif sys.argv[1:] == ["metrics"]:
        print(",".join(METRICS))
    else:
        sys.exit("usage: ncu_weights.py run | report | metrics")
