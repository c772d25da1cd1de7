"""Probe (not part of any package): hardware counters of the package GEMM's
ring main loop against cuBLAS at N = 8192, K in {4096, 8192}, m in {1, 16}
(plain epilogue, no PDL), on one GPU under Nsight Compute.

``python scripts/probes/ncu_gemm.py run``: warms every kernel up, then
launches each once between ``cudaProfilerStart`` / ``Stop`` and writes the
launch labels to ``$OUT/ncu_labels.json``. ``bash`` side (gpu-check.sh
``ncu``): ``ncu --profile-from-start off --csv --metrics ... python
scripts/probes/ncu_gemm.py run > $OUT/ncu.csv``, then ``python
scripts/probes/ncu_gemm.py report`` prints one row per launch: its label,
kernel, grid, block, registers, duration, DRAM read bytes and throughput, L2
read requests and sectors from L1 (request size), L2 hit rate."""
import csv
import io
import json
import os
import sys

METRICS = [
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
    "lts__t_requests_srcunit_tex_op_read.sum",
    "lts__t_sectors_srcunit_tex_op_read.sum",
    "lts__t_sector_op_read_hit_rate.pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__warps_issue_stalled_long_scoreboard_per_warp_active.pct",
    "smsp__warps_issue_stalled_barrier_per_warp_active.pct",
]
H = 8192


def run() -> None:
    import torch
    from package_gemm_sweep import copies_configs  # (this folder: sys.path[0] when run as a script)

    from dspark_comm.cutedsl import package_gemm as pg
    from dspark_core.contracts.constants import PackageGemmConstants

    gen = torch.Generator(device="cuda").manual_seed(5)
    launches = []
    for k in (4096, 8192):
        kw = 4 if k == 4096 else 8
        w = (torch.randn((H, k), generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        c = PackageGemmConstants("o_proj", H, k, 64, kw // 4, 16)
        variants = {}
        for xc, pf, cp in (("lane", 256, "lane"), ("lane", 128, "rows"), ("rows", 128, "rows")):
            g = pg.PackageGemm(c, w, pdl=False)
            g.configs = copies_configs(g.configs, xc, pf, cp)
            g.prepare(publish=(False,))
            variants[f"x-{xc}/{pf}/{cp}"] = g
        for m in (1, 16):
            x = torch.randn((m, k), generator=gen, device="cuda").to(torch.bfloat16)
            y = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
            launches.append((f"cublas K{k} m{m}", lambda x=x, y=y, w=w: torch.matmul(x, w.t(), out=y)))
            for name, g in variants.items():
                launches.append((f"ring {name} K{k} m{m}", lambda x=x, y=y, g=g: g.launch(x, y)))
    for _, fn in launches:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in launches:
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    with open(os.path.join(os.environ.get("OUT", "bench-results"), "ncu_labels.json"), "w") as f:
        json.dump([label for label, _ in launches], f)


def report() -> None:
    out = os.environ.get("OUT", "bench-results")
    labels = json.load(open(os.path.join(out, "ncu_labels.json")))
    text = open(os.path.join(out, "ncu.csv")).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    rows = [r for r in rows if r.get("ID", "").isdigit()]
    # A launch may be more than one kernel (cuBLAS split-K): the labels are listed in launch order.
    print(f"{len(rows)} kernels profiled for {len(labels)} launches: " + "; ".join(labels))
    short = {m: m.split("__")[1].split(".")[0][:28] for m in METRICS}
    print("| # | kernel | " + " | ".join(short[m] for m in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for i, r in enumerate(rows):
        print(f"| {i} | {r.get('Kernel Name', '?')[:70]} | " + " | ".join(r.get(m, "n/a") for m in METRICS) + " |")


if __name__ == "__main__":
    if sys.argv[1:] == ["run"]:
        run()
    elif sys.argv[1:] == ["report"]:
        report()
    elif sys.argv[1:] == ["metrics"]:
        print(",".join(METRICS))
    else:
        sys.exit("usage: ncu_gemm.py run | report | metrics")
