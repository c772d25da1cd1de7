"""Benchmark: one draft step (the reference draft's forward over m tokens) in
CUDA graphs, for the stock layers, torch.compile (Inductor) of the stock
layers where it compiles, and the specialized decode; beside the step's GEMMs
alone and its floor (its weight bytes at this card's HBM peak). Prints a markdown table
and writes it with a PNG plot into --out.

The "specialized" column is ``build_draft_decode``'s default (bit for bit:
cuBLAS + the QKV epilogue, the staged attention, the inline L2 prefetch).
Extra columns of variants, side by side in the same run: ``--direct`` (the
direct attention variant), ``--prefetch`` (the prefetch off), ``--gemv``
(the one-token GEMV for the projections at m = 1: not cuBLAS's bits; its
steps of more tokens are the default's). ``--m``
picks the token counts, ``--no-compile`` skips the Inductor column."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel
from dspark_core.runtime.build import build_draft_decode as _build
from dspark_core.tools.graphs import StepGraph
from dspark_core.tools.timing import gemms_replay, median_us, step_case, weight_floor_us

CONTEXT = 256


def _median_us(replay, reps: int = 200) -> float:
    return median_us(replay, reps, warmup=10)


def build_draft_decode(model, **options):
    """core's executor over the reference draft's description (dspark-cute's kernels)."""
    return _build(describe(model), **options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--m", default="1,4,16", help="comma-separated tokens per step")
    parser.add_argument("--direct", action="store_true",
                        help="also time the decode with the direct attention variant")
    parser.add_argument("--prefetch", action="store_true",
                        help="also time the decode without the L2 weight prefetch")
    parser.add_argument("--gemv", action="store_true",
                        help="also time the decode with the one-token GEMV projections (m = 1; not cuBLAS's bits)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA GPU, nothing to time")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = DraftModel(DraftConfig(num_layers=args.layers), device="cuda")
    decode = build_draft_decode(model)
    floor_us = weight_floor_us(model)
    # Inputs per m; the slow column (Inductor compiles per shape) is timed last
    # and the table is written after every column, so a time limit still leaves
    # the columns already measured.
    cases = {m: step_case(model, m, CONTEXT) for m in (int(v) for v in args.m.split(","))}
    rows = [{"m": m, "floor": floor_us, "gemms": _median_us(gemms_replay(model, m))} for m in cases]
    paths = {"stock": model.forward}
    if decode is not None:
        paths["specialized"] = decode.run
    if not args.no_compile:
        paths["inductor"] = None  # compiled per m below
    if decode is not None:
        # Variants of the specialized decode, for side-by-side ratios.
        variants = {
            "direct": args.direct and {"attention_variant": "direct"},
            "no-prefetch": args.prefetch and {"prefetch": False},
            "gemv": args.gemv and {"gemv": True},
        }
        for name, options in variants.items():
            if options:
                paths[name] = build_draft_decode(model, **options).run
    for name, fn in paths.items():
        for row in rows:
            x, step, caches = cases[row["m"]]
            if name == "inductor":
                # One static-shape compile per m: a recompile with automatic
                # dynamic shapes failed inside Dynamo (torch 2.11) at m = 16.
                torch._dynamo.reset()
                fn = torch.compile(model.forward, dynamic=False)
            try:
                graph = StepGraph(fn, x, step, caches)
                row[name] = _median_us(graph.replay)
            except Exception as error:  # report, do not hide: the column says why
                row[name] = float("nan")
                print(f"m={row['m']} {name}: did not run in a CUDA graph: {type(error).__name__}: {error}")
                traceback.print_exc()
        _write_table(rows, args.layers, out)
    _plot(rows, floor_us, out)
    return 0


NAMES = ("stock", "inductor", "specialized", "direct", "no-prefetch", "gemv")
FUSED = NAMES[2:]


def _write_table(rows, layers: int, out: Path) -> None:
    names = [n for n in NAMES if any(n in r for r in rows)]
    head = "| m | " + " | ".join(f"{n} (us)" for n in names) + " | GEMMs alone (us) | floor (us) |"
    head += " specialized vs inductor | non-GEMM share of specialized | fastest fused vs inductor |"
    lines = [head, "|" + "---|" * (len(names) + 6)]
    for r in rows:
        cells = [f"{r.get(n, float('nan')):.1f}" for n in names]
        spec, ind = r.get("specialized", float("nan")), r.get("inductor", float("nan"))
        share = (spec - r["gemms"]) / spec if spec == spec else float("nan")
        fused = [(r[n], n) for n in FUSED if n in r and r[n] == r[n]]  # measured (not NaN)
        best = f"{ind / min(fused)[0]:.2f}x ({min(fused)[1]})" if fused else "-"
        lines.append(f"| {r['m']} | " + " | ".join(cells)
                     + f" | {r['gemms']:.1f} | {r['floor']:.1f} | {ind / spec:.2f}x | {share:.0%} | {best} |")
    table = "\n".join(lines)
    print(f"\nDraft step, {layers} layers of the reference draft, {torch.cuda.get_device_name()}, CUDA graphs")
    print(table)
    (out / "decode.md").write_text(table + "\n")


def _plot(rows, floor_us: float, out: Path) -> None:
    names = [n for n in NAMES if any(n in r for r in rows)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for n in [*names, "gemms"]:
            ax.plot([r["m"] for r in rows], [r.get(n, float("nan")) for r in rows], marker="o", label=n)
        ax.axhline(floor_us, color="gray", linestyle="--", label="weight floor")
        ax.set_xlabel("tokens per step (m)")
        ax.set_ylabel("us per draft step")
        ax.set_xscale("log", base=2)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "decode.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    sys.exit(main())
