"""TP2 benchmark of one draft step (two GPUs, one process each).

The reference draft (``DraftConfig()``: 2 layers, hidden 8192) sharded over
two ranks with ``dspark_core.reference.tp``; a 256-token context stored first (the
stock chain). Per m in {1, 4, 16} tokens per step, each path captured once as
a CUDA graph of ``--steps-per-graph`` consecutive steps (``dspark_core.tools.graphs.StepGraph``
of a function that runs the step that many times on the same inputs) and timed over
``--reps`` replays, both ranks released by a barrier before each
(``dspark_comm.tp_draft.time_replays``), each replay's time divided by its
steps: the ranks leave the barrier a little apart and the slower rank's first
all-reduce waits for its peer, a skew that several steps per replay amortize
(with one step a replay, run-to-run figures varied by up to 60 us on two
H200s). The table shows the slower rank's median, in microseconds per step:

- ``stock TP2``: ``TPDraftModel.forward`` (the stock layers, each branch's
  partial all-reduced by ``torch.distributed.all_reduce`` over NCCL);
- ``specialized``: the specialized decode with the fused all-reduce
  boundaries, the branch GEMMs on cuBLAS (the package GEMM excluded);
- ``specialized + package GEMM``: the same with each layer's o_proj and
  down_proj on the package GEMM, publishing into the mailbox;
- ``the same, one-row GEMV``: with the package GEMMs' one-row calls on the
  one-token GEMV (``one_row_gemv=True``, opt-in; m = 1 differs, the other
  rows run as the column before);
- ``GEMMs alone``: a graph of the rank's four cuBLAS GEMMs per layer (the
  shard's QKV, o_proj, gate_up and down shapes) and nothing else;
- ``floor``: the rank's GEMM weight bytes read once at 4.3 TB/s.

``--exclude`` (comma-separated kernel names) leaves kernels out of both
specialized paths (e.g. ``o_gate``). A path that fails to build or to
capture on any rank is reported as failed on both and the others still run.
Writes ``draft_tp2.md``, ``draft_tp2.png`` and ``draft_tp2_raw.json`` into
``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

ROWS = (1, 4, 16)
CONTEXT = 256
PATHS = [("stock TP2 (NCCL)", "stock"), ("specialized", "spec"), ("specialized + package GEMM", "package"),
         ("the same, one-row GEMV (opt-in)", "one_row")]


def _steps(fn, count: int):
    """``fn(hidden, step, caches)`` run ``count`` times in a row (the last
    output): several steps per timed graph."""

    def steps(hidden, step, caches):
        for _ in range(count - 1):
            fn(hidden, step, caches)
        return fn(hidden, step, caches)

    return steps


def _worker(rank: int, world: int, init: str, out: str, reps: int, exclude: list, layers: int,
            per_graph: int = 1) -> None:
    from dspark_comm.runtime.ranks import finish_rank, init_rank

    init_rank(rank, world, init, timeout_s=120.0)
    torch.set_grad_enabled(False)  # inference only (the stock forward's graphs too)
    from dspark_comm.tp_draft import PACKAGE_GEMM, TPDraftRank, time_replays
    from dspark_core.reference.config import DraftConfig
    from dspark_core.reference.model import StepInputs
    from dspark_core.tools.graphs import StepGraph
    from dspark_core.tools.timing import gemms_replay, weight_floor_us

    t0 = time.monotonic()
    tp = TPDraftRank(rank, world, DraftConfig(num_layers=layers))
    res: dict = {"build_s": tp.build_s, "floor": weight_floor_us(tp.shard),
                 "device": torch.cuda.get_device_name(tp.device)}
    fns = {"stock": tp.shard.forward}
    for key, ex, one_row in (("spec", {*exclude, PACKAGE_GEMM}, False), ("package", set(exclude), False),
                             ("one_row", set(exclude), True)):
        err = None
        try:
            decode, _ = tp.decode(ex, one_row_gemv=one_row)
            fns[key] = decode.run
            res[f"plan/{key}"] = decode.plan.format()
        except Exception as e:  # compile errors are the same on every rank
            err = f"failed to build: {type(e).__name__}: {e}"[:300]
        errors = [e for e in tp.group.all_gather_object(err) if e]
        if errors:
            fns.pop(key, None)
            res[f"plan/{key}"] = errors[0]
    res["prepare_s"] = round(time.monotonic() - t0, 1)
    context = tp.context(CONTEXT, 5)
    for m in ROWS:
        span = CONTEXT + m
        caches = tp.caches(context, span)
        step = StepInputs.block(CONTEXT, m, tp.device, span=span)
        x = tp.shard.embed_tokens(torch.arange(m, device=tp.device))
        res[f"gemms/{m}"] = time_replays(gemms_replay(tp.shard, m), reps)
        for _, key in PATHS:
            if key not in fns:
                res[f"{key}/{m}"] = res[f"plan/{key}"]
                continue
            graph, err = None, None
            try:
                graph = StepGraph(_steps(fns[key], per_graph), x, step, caches)
            except Exception as e:
                err = f"failed to capture: {type(e).__name__}: {e}"[:300]
            errors = [e for e in tp.group.all_gather_object(err) if e]
            res[f"{key}/{m}"] = errors[0] if errors else time_replays(graph.replay, reps, calls=per_graph)
            del graph
    res["status"] = tp.close()
    raw = tp.group.all_gather_object(res)
    if rank == 0:
        with open(os.path.join(out, "draft_tp2_raw.json"), "w") as f:
            json.dump(raw, f, indent=1)
    finish_rank()


def _cell(raw: list[dict], key: str):
    """(the slower rank's value or None, its text)."""
    from dspark_comm.runtime.ranks import first_failure

    vals = [r.get(key, "missing") for r in raw]
    text = first_failure(vals)
    if text is not None:
        return None, text.split(":")[0]
    return max(vals), f"{max(vals):.1f}"


def _report(raw: list[dict], out: str, reps: int, exclude: list) -> str:
    cols = [*PATHS, ("GEMMs alone (cuBLAS)", "gemms")]
    head = "| m | " + " | ".join(f"{label} (us)" for label, _ in cols) + " | floor (us) | stock / specialized |"
    head += " stock / + package GEMM | stock / + one-row GEMV |"
    lines = [
        f"One step of the reference draft ({raw[0].get('layers', 2)} layers, hidden 8192) at TP2 on "
        f"{raw[0].get('device', 'GPU')} x2: microseconds per step, CUDA graphs of "
        f"{raw[0].get('steps_per_graph', 1)} steps, median of {reps} "
        f"replays, the slower rank; 256-token context; floor = the rank's weight bytes at 4.3 TB/s"
        + (f"; excluded: {', '.join(exclude)}" if exclude else "") + ".",
        "",
        head,
        "|" + " --- |" * (len(cols) + 5),
    ]
    series: dict = {label: [] for label, _ in cols}
    floor = max(r["floor"] for r in raw)
    for m in ROWS:
        row, values = [], {}
        for label, key in cols:
            value, text = _cell(raw, f"{key}/{m}")
            row.append(text)
            values[key] = value
            series[label].append(value)
        ratios = [f"{values['stock'] / values[k]:.2f}x" if values["stock"] and values[k] else "-"
                  for k in ("spec", "package", "one_row")]
        lines.append(f"| {m} | " + " | ".join(row) + f" | {floor:.1f} | " + " | ".join(ratios) + " |")
    failures = sorted({v for r in raw for k, v in r.items() if isinstance(v, str) and v.startswith("failed")})
    if failures:
        lines += ["", "Failures: " + "; ".join(failures)]
    lines += ["", f"Mailbox status at the end: {[r.get('status') for r in raw]} (0: healthy); "
              f"build {max(r['build_s'] for r in raw)} s, prepare {max(r['prepare_s'] for r in raw)} s."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "draft_tp2.md"), "w") as f:
        f.write(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for label, values in series.items():
            pts = [(m, v) for m, v in zip(ROWS, values) if v is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(floor, color="gray", linestyle="--", label="weight floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ROWS, [str(m) for m in ROWS])
        ax.set_xlabel("tokens per step (m)")
        ax.set_ylabel("us per draft step (slower rank)")
        ax.set_title("TP2 draft step (2x H200)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "draft_tp2.png"), dpi=120)
    except ImportError:
        text += "\n(matplotlib is not installed: no plot)\n"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--exclude", default="", help="comma-separated kernels both specialized paths leave out")
    parser.add_argument("--steps-per-graph", type=int, default=4, help="consecutive steps in each timed graph")
    parser.add_argument("--timeout", type=float, default=220.0, help="seconds before the ranks are killed")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.layers < 1 or args.steps_per_graph < 1:
        parser.error("--reps, --layers and --steps-per-graph are at least 1")
    from dspark_comm.runtime.ranks import tp2_benchmark

    logging.basicConfig(level=logging.INFO, format="%(message)s")

    exclude = [k for k in args.exclude.split(",") if k]
    raw, status = tp2_benchmark("the TP2 draft benchmark", _worker, args.out, "draft_tp2_raw.json", args.out,
                                args.reps, exclude, args.layers, args.steps_per_graph, timeout_s=args.timeout)
    if raw is None:
        return status
    for r in raw:
        r["layers"], r["steps_per_graph"] = args.layers, args.steps_per_graph
    print(_report(raw, args.out, args.reps, exclude))
    return status


if __name__ == "__main__":
    sys.exit(main())
