"""Benchmark of the one-token GEMV (``dspark_cute.cutedsl.gemm.gemv.Gemv``) on the
reference draft's four projections (QKV 9216 x 8192, o_proj 8192 x 4096,
gate_up 32768 x 8192, down 8192 x 16384; BF16, m = 1), beside cuBLAS
(``torch.mm(x, W.t())``).

Each case is timed in a CUDA graph of back-to-back calls that cycle over
enough copies of the weight (>= 200 MB) that every call streams its weight
from HBM, as a draft step does (median of trials, microseconds per call).
Launch settings: the default (2 rows a warp, 4 fragments in flight) and
``--sweep`` others (they change no bit). The weight bandwidth is its bytes
over the time. Writes ``gemv.md`` and ``gemv.png`` into ``--out`` (default
``bench-results/``, or ``DSPARK_BENCH_OUT``). Ran on an H200 (2026-11-30,
``--sweep``; µs, QKV / o_proj / gate_up / down): cuBLAS 41.5 / 18.4 / 123.1 /
65.3; the default (2 rows, depth 4) 41.6 / 19.4 / 119.4 / 61.3; 2 rows,
depth 8: 36.4 / 17.3 / 117.9 / 62.8; 4 rows, depth 4: 40.7 / 16.7 / 119.3 /
61.1. The probe ``scripts/probes/skinny_sweep.py`` measured the default
design at 37.6 / 18.1 / 124.4 / 64.4 µs against cuBLAS's 43.4 / 19.1 / 128.8
/ 66.5 in an earlier session: runs differ by up to 10%, so one run does not
move the default."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import torch

SHAPES = {"qkv_proj": (9216, 8192), "o_proj": (8192, 4096), "gate_up": (32768, 8192), "down": (8192, 16384)}
SETTINGS = [(2, 4)]
SWEEP = [(2, 8), (4, 4), (4, 2), (8, 2)]


def time_graph(calls: list, launches: int, replays: int = 10, trials: int = 7) -> float:
    """Median microseconds per call of ``calls`` (cycled, ``launches`` in one
    CUDA graph) over ``trials`` timings of ``replays`` replays each."""
    from dspark_core.tools.timing import capture_on_side_stream, median_us

    replay = capture_on_side_stream(calls, launches, wait=False)
    return median_us(lambda: [replay() for _ in range(replays)], trials, calls=replays * launches)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    parser.add_argument("--sweep", action="store_true", help="also time other launch settings")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA GPU, nothing to time")
        return 0
    from dspark_core.contracts.constants import GemvConstants
    from dspark_cute.cutedsl.gemm.gemv import Gemv

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    settings = SETTINGS + (SWEEP if args.sweep else [])
    rows = []
    for role, (n, k) in SHAPES.items():
        copies = max(2, -(-200 * 2**20 // (n * k * 2)))
        ws = [(torch.randn((n, k), generator=gen, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn((1, k), generator=gen, device="cuda").to(torch.bfloat16)
        outs = [torch.empty((1, n), dtype=torch.bfloat16, device="cuda") for _ in ws]
        row = {"role": role, "n": n, "k": k,
               "cuBLAS": time_graph([functools.partial(torch.mm, x, w.t(), out=o) for w, o in zip(ws, outs)],
                                    launches=4 * copies)}
        for rows_per_warp, depth in settings:
            gemvs = [Gemv(GemvConstants(role, n, k), w, rows_per_warp=rows_per_warp, depth=depth) for w in ws]
            gemvs[0].prepare()
            calls = [functools.partial(g.launch, x, o) for g, o in zip(gemvs, outs)]
            row[f"GEMV r{rows_per_warp} d{depth}"] = time_graph(calls, launches=4 * copies)
        rows.append(row)
        del ws
        torch.cuda.empty_cache()
    names = ["cuBLAS"] + [f"GEMV r{r} d{d}" for r, d in settings]
    lines = [f"One-token projections on {torch.cuda.get_device_name()}, µs per call (TB/s of weight), "
             "weights streamed from HBM, CUDA graphs", "",
             "| projection | " + " | ".join(names) + " | GEMV (default) vs cuBLAS |",
             "|---|" + "---|" * (len(names) + 1)]
    for r in rows:
        nbytes = r["n"] * r["k"] * 2
        cells = [f"{r[name]:.1f} ({nbytes / r[name] / 1e6:.2f})" for name in names]
        lines.append(f"| {r['role']} {r['n']} x {r['k']} | " + " | ".join(cells)
                     + f" | {r['cuBLAS'] / r[names[1]]:.2f}x |")
    table = "\n".join(lines) + "\n"
    print(table)
    (out_dir / "gemv.md").write_text(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(rows))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar([x + i * width for x in xs], [r[name] for r in rows], width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in xs], [r["role"] for r in rows])
        ax.set_ylabel("µs per call (m = 1)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "gemv.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
