"""Benchmark of the fused context chain against the stock one, in CUDA graphs.

For each context length T (default 1, 16, 1024, 4096) of a draft with L
layers (default 2), hidden size H (8192) and kv KV heads (8), it times:

- ``norms``: ``ContextNorms`` vs the stock ``DraftModel.context_norms``
  (eager, captured) vs ``torch.compile`` of it;
- ``store``: ``ContextKvStore`` vs the stock ``DraftModel.context_kv_store``
  vs ``torch.compile`` of it;
- ``chain``: ``ContextChain.run`` (norms, stock bmm, store) vs the stock
  ``precompute_and_store_context_kv``.

Each variant is captured in a CUDA graph of ``--calls`` calls and the graph
replayed ``--reps`` times; the figure is the median replay time divided by
the calls (microseconds per call). A variant that cannot be captured (a host
read in the stock code, say) is timed eagerly instead and marked so; one that
fails is reported with its error. The fused outputs are checked bit for bit
against the stock ones first. The floor column is the fewest bytes the part
must move (inputs and weights read once, outputs written once; the chain's
includes the K/V projection weight) at ``--bandwidth`` TB/s.

Writes ``context.md`` (a markdown table, also printed) and ``context.png``
into ``--out`` (default ``bench-results/``).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel
from dspark_core.tools.compare import mismatches
from dspark_core.tools.timing import median_us

BLOCK = 16


def time_call(fn, calls: int, reps: int) -> tuple[float, str]:
    """Microseconds per call of ``fn`` (median over ``reps`` replays of a
    graph of ``calls`` calls), and how it was timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture (compiles, handles)
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except Exception as error:  # a host read inside the stock code, typically
        torch.cuda.synchronize()
        mode = f"eager (no capture: {type(error).__name__})"

        def run():
            for _ in range(calls):
                fn()

    run()
    torch.cuda.synchronize()
    return median_us(run, reps, calls=calls), mode


def build(args) -> DraftModel:
    config = DraftConfig(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=16, num_kv_heads=args.kv,
        intermediate_size=1024, vocab_size=512, max_position=max(8192, max(args.rows)),
    )
    return DraftModel(config, device="cuda")


def bench_rows(t: int, model, chain, compiled: dict, args, impls_wanted: tuple, rows_out: list) -> None:
    """Time the ``impls_wanted`` of each part at context length ``t`` into
    the rows of ``rows_out`` (one per part and ``t``; made if missing)."""
    h, layers, kv_heads = args.hidden, args.layers, args.kv
    states = (torch.randn(t, h, device="cuda") * 2.0).to(torch.bfloat16)
    positions = torch.randint(0, model.config.max_position, (t,), device="cuda")
    num_blocks = t // BLOCK + 2
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:t].contiguous()
    caches = model.make_caches(num_blocks, "cuda")
    ref_caches = model.make_caches(num_blocks, "cuda")
    normed = model.context_norms(states)
    kv = torch.bmm(normed, model.stacked_kv_weight().transpose(1, 2))
    out = torch.empty_like(normed)

    # Bit for bit first.
    chain.norms.launch(states, out)
    model.context_kv_store(kv, positions, ref_caches, slots)
    chain.store.launch(kv, positions, caches, slots)
    torch.cuda.synchronize()
    exact = not mismatches(out, normed).any() and all(
        not mismatches(a.tensor, b.tensor).any() for a, b in zip(caches, ref_caches)
    )

    norm_bytes = t * h * 2 + layers * t * h * 2 + (1 + layers) * h * 2  # rows, outputs, weights
    store_bytes = 2 * layers * t * 2 * kv_heads * 64 * 2 + layers * t * 16
    parts = {
        "norms": (norm_bytes, {
            "fused": lambda: chain.norms.launch(states, out),
            "eager": lambda: model.context_norms(states),
            "compile": (lambda: compiled["norms"](states)) if compiled else None,
        }),
        "store": (store_bytes, {
            "fused": lambda: chain.store.launch(kv, positions, caches, slots),
            "eager": lambda: model.context_kv_store(kv, positions, caches, slots),
            "compile": (lambda: compiled["store"](kv, positions, caches, slots)) if compiled else None,
        }),
        # The chain also reads the stacked K/V projection weight [L, 2 * kv * 64, H].
        "chain": (norm_bytes + store_bytes + layers * 2 * kv_heads * 64 * h * 2, {
            "fused": lambda: chain.run(states, positions, caches, slots),
            "eager": lambda: model.precompute_and_store_context_kv(states, positions, caches, slots),
            "compile": None,
        }),
    }
    for part, (nbytes, impls) in parts.items():
        row = next((r for r in rows_out if r["T"] == t and r["part"] == part), None)
        if row is None:
            row = {"T": t, "part": part, "floor": nbytes / (args.bandwidth * 1e6), "exact": exact, "notes": [],
                   "fused": None, "eager": None, "compile": None}
            rows_out.append(row)
        row["exact"] = row["exact"] and exact
        for impl, fn in impls.items():
            if fn is None or impl not in impls_wanted:
                continue
            try:
                us, mode = time_call(fn, args.calls, args.reps)
                row[impl] = us
                if mode != "graph":
                    row["notes"].append(f"{impl}: {mode}")
            except Exception as error:
                torch.cuda.synchronize()
                row[impl] = None
                row["notes"].append(f"{impl} failed: {type(error).__name__}: {str(error).splitlines()[0][:60]}")
        print(f"T={t} {part}: " + ", ".join(f"{k}={row[k]}" for k in ("fused", "eager", "compile")), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results", help="folder for context.md and context.png")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 1024, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--kv", type=int, default=8)
    parser.add_argument("--calls", type=int, default=10, help="calls per captured graph")
    parser.add_argument("--reps", type=int, default=30, help="graph replays timed")
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM TB/s for the floor column")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    args = parser.parse_args()

    from dspark_core.reference.adapter import describe
    from dspark_cute.cutedsl.context.chain import ContextChain

    # The stock code's graph breaks (host reads) would fill the log.
    torch._logging.set_logs(dynamo=logging.ERROR)
    torch.manual_seed(0)
    model = build(args)
    chain = ContextChain.of_draft(describe(model))
    chain.prepare()
    compiled = {}
    if not args.no_compile:
        compiled["norms"] = torch.compile(model.context_norms, dynamic=True)
        compiled["store"] = torch.compile(model.context_kv_store, dynamic=True)
    rows_out: list = []
    os.makedirs(args.out, exist_ok=True)
    # The fused and stock eager figures first, then torch.compile (its warm-up
    # compiles take long): the table is rewritten after each context length.
    phases = [("fused", "eager")] + ([("compile",)] if compiled else [])
    for wanted in phases:
        for t in args.rows:
            bench_rows(t, model, chain, compiled, args, wanted, rows_out)
            write(rows_out, args)
    print(markdown(rows_out, args))


def write(rows: list, args) -> None:
    """``context.md`` and ``context.png`` of the rows so far (so that a run
    stopped in a long torch.compile warm-up still leaves its figures)."""
    with open(os.path.join(args.out, "context.md"), "w") as f:
        f.write(markdown(rows, args))
    plot(rows, os.path.join(args.out, "context.png"), args)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(rows: list, args) -> str:
    name = torch.cuda.get_device_name()
    lines = [
        f"Context chain, H={args.hidden}, L={args.layers}, kv={args.kv}, on {name}: microseconds per call "
        f"(CUDA graph of {args.calls} calls, median of {args.reps} replays).",
        "",
        "| T | part | fused | stock eager | torch.compile | eager / fused | compile / fused | floor "
        "| bitwise | notes |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        fused = r["fused"]
        ratio = [
            f"{r[k] / fused:.1f}x" if fused and r.get(k) else "-" for k in ("eager", "compile")
        ]
        lines.append(
            f"| {r['T']} | {r['part']} | {_fmt(fused)} | {_fmt(r['eager'])} | {_fmt(r['compile'])} | "
            f"{ratio[0]} | {ratio[1]} | {r['floor']:.1f} | {'yes' if r['exact'] else 'NO'} | "
            f"{'; '.join(r['notes'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ["norms", "store", "chain"]
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4))
    for ax, part in zip(axes, parts):
        sel = [r for r in rows if r["part"] == part]
        xs = range(len(sel))
        for i, (impl, label) in enumerate((("fused", "fused"), ("eager", "stock eager"), ("compile", "torch.compile"))):
            ys = [r[impl] if r[impl] is not None else 0.0 for r in sel]
            ax.bar([x + (i - 1) * 0.27 for x in xs], ys, width=0.27, label=label)
        ax.plot(list(xs), [r["floor"] for r in sel], "k_", markersize=20, label="bandwidth floor")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(r["T"]) for r in sel])
        ax.set_yscale("log")
        ax.set_xlabel("context rows T")
        ax.set_ylabel("microseconds per call")
        ax.set_title(part)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"DSpark context chain, H={args.hidden}, L={args.layers}, kv={args.kv}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
