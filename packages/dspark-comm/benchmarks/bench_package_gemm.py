"""TP2 benchmark of the package GEMM (two GPUs, one process each).

Ran on two H200s (2026-11-30; 2026-12-01 with the warp-count twin), every
row, the rounds too (the table is in the package's README).

For K in {1024, 4096, 8192} (the rank's shard) and m in {1, 4, 16} rows,
N = H = 8192 output features, each case timed in a CUDA graph of ``--iters``
back-to-back calls (median over ``--reps`` replays, both ranks released by a
barrier before each replay; the table shows the slower rank's median):

- ``package GEMM``: ``PackageGemm.run(x, out)`` (plain epilogue) at the
  policy's shape (``policy.draft_gemm_shape``: the register-direct main loop
  for shards of at most ``DIRECT_MAX_STEPS`` steps per warp, the ring above), with its publish kernel
  alone (profiler);
- the one-row GEMV path (``one_row_gemv=True``, m = 1): plain, and its
  publish kernel alone (profiler);
- ``cuBLAS``: ``torch.matmul(x, W.T, out=...)``; and its kernels' own
  device time per call (profiler), to set beside the publish kernel's own
  device time (also profiled): the like-for-like reading of the target;
  and beside the plain kernel's (profiled, no PDL);
- ``package GEMM with publish alone``: ``PackageGemm.run(x, publish=True)``
  back to back in a graph (the same partials into the same slots; one
  consuming ``AllReduceBoundary.run(None, ..., published=True)`` frees them
  afterwards, untimed): the target's reading in the draft's setting;
- the target's pair again in ``--rounds`` alternating rounds (cuBLAS, then
  the publish alone; the next round the other way round), each round the
  median of ``--reps`` replays of a graph captured once: the median over
  the rounds, and in how many rounds the publish was no slower. One
  round's medians move by some tenths of a microsecond between runs, as
  much as the margin at m = 16, so the verdict rests on the rounds; a third
  contender in the rounds where the policy takes the ring: the publish at
  the other ring warp count (8 warps where the policy takes 4, else 4; its
  own sums, so its own bits), for the policy's choice (``RING_SPLIT_K``);
- ``package GEMM + publish + fused boundary``: ``PackageGemm.run_boundary``
  (the GEMM publishing into the mailbox, then ``AllReduceBoundary`` with
  ``published=True``);
- ``package GEMM + fused boundary``: the plain GEMM, then the pushing
  ``AllReduceBoundary``;
- ``cuBLAS + fused boundary``: cuBLAS, then the pushing ``AllReduceBoundary``;
- ``cuBLAS + NCCL + boundary``: cuBLAS, ``torch.distributed.all_reduce``,
  ``dspark_cute.DraftBoundary``.

Target (issue 6): the GEMM with its publish and the fused boundary no slower
than cuBLAS alone (the all-reduce's data movement hidden in the GEMM).
Writes ``package_gemm_tp2.md``, ``package_gemm_tp2.png`` and
``package_gemm_raw.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys

import torch
import torch.distributed as dist

H = 8192
KS = (1024, 4096, 8192)
ROWS = (1, 4, 16)
CASES = [
    ("package GEMM (the policy's main loop: policy.draft_gemm_shape)", "gemm"),
    ("cuBLAS", "cublas"),
    ("package GEMM + publish + fused boundary", "publish_bd"),
    ("package GEMM + fused boundary", "gemm_bd"),
    ("cuBLAS + fused boundary", "cublas_bd"),
    ("cuBLAS + NCCL + boundary", "cublas_nccl_bd"),
    ("package GEMM with publish: its kernel alone (profiler; epochs before the main loop, the default)",
     "publish_kernel"),
    ("cuBLAS: its kernels alone (profiler; device time per call)", "cublas_kernel"),
    ("package GEMM with publish alone (graph, PDL; the mailbox consumed once after)", "publish_graph"),
    ("package GEMM, plain: its kernel alone (profiler, no PDL)", "gemm_kernel"),
    ("package GEMM with the one-row GEMV (one_row_gemv=True; m = 1 only)", "gemm_gemv"),
    ("its publish kernel alone (profiler; the one-row GEMV)", "publish_kernel_gemv"),
]
# The rows of the one-row GEMV path (m = 1 only; more rows run the skinny loop, timed above).
ONE_ROW = {"gemm_gemv", "publish_kernel_gemv"}
# The row that issue 6's target names ("the GEMM with its publish no slower
# than cuBLAS alone"): the publish-mode GEMM kernel's own device time. It is
# profiled on a twin built without PDL: with PDL the kernel starts early and
# its device time would include its wait for the previous call's boundary,
# which itself waits for the peer (measured so: 200-330 us on eager calls).
PUBLISH_KERNEL = "PackageGemmKernel"
# The profiled rows: the call (of ``_calls``) each profiles.
PROFILED = {"gemm_kernel": "gemm_no_pdl",
            "publish_kernel": "publish_bd_no_pdl",
            "publish_kernel_gemv": "publish_bd_gemv_no_pdl"}
# Rows that publish without consuming: one consuming call follows them (untimed).
PUBLISH_ONLY = {"publish_graph", "publish_graph_kw"}
# The target's pair, timed again in alternating rounds: (label, key of the round's values, the call).
ROUNDS = [("cuBLAS, alternating rounds (median over the rounds)", "rounds_cublas", "cublas"),
          ("package GEMM with publish alone, alternating rounds (median over the rounds)", "rounds_publish",
           "publish_graph"),
          ("the same at the other warp count (4 <-> 8; the ring only), alternating rounds", "rounds_publish_kw",
           "publish_graph_kw")]


def _profiled(fn, name: str, calls: int) -> list[float]:
    """Device times (µs; CUPTI through torch.profiler) of every kernel whose
    name contains ``name`` over ``calls`` eager calls of ``fn`` (after 3
    untimed ones). Collective: every rank makes the same calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    durations = [e.time_range.elapsed_us() for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and name in e.name]
    if not durations:
        raise RuntimeError(f"no {name or 'CUDA'} kernel in the profile")
    return durations


def _kernel_us(fn, name: str, calls: int = 30) -> float:
    """Median device time (µs) of the kernels named ``name`` (``_profiled``)."""
    return float(statistics.median(_profiled(fn, name, calls)))


def _device_us_per_call(fn, calls: int = 30) -> float:
    """Device time (µs) per call of ``fn``: all its kernels' times over
    ``calls`` calls, divided by ``calls`` (cuBLAS may launch more than one:
    a split-K reduction)."""
    return float(sum(_profiled(fn, "", calls)) / calls)


def _calls(gen, m: int, k: int, gemm, w, fused, unfused, gemm_no_pdl, one_row, kw_twin) -> dict:
    """The timed call of each case over ``m`` rows (operands allocated once);
    ``one_row``: the one-row GEMV twins ``(with PDL, without)``, or None;
    ``kw_twin``: the publish twin at the other ring warp count, or None."""
    x = torch.randn((m, k), generator=gen, device="cuda").to(torch.bfloat16)
    y = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
    stream = torch.randn((m, H), generator=gen, device="cuda")
    o = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
    new = torch.empty((m, H), dtype=torch.float32, device="cuda")
    return {
        "gemm": lambda: gemm.run(x, y),
        "gemm_no_pdl": lambda: gemm_no_pdl.run(x, y),
        "publish_graph": lambda: gemm.run(x, publish=True),
        "consume": lambda: fused.run(None, stream, True, o, new, published=True),
        "cublas": lambda: torch.matmul(x, w.t(), out=y),
        "publish_bd": lambda: gemm.run_boundary(x, fused, stream, True, o, new),
        "publish_bd_no_pdl": lambda: gemm_no_pdl.run_boundary(x, fused, stream, True, o, new),
        "gemm_bd": lambda: (gemm.run(x, y), fused.run(y, stream, True, o, new)),
        "cublas_bd": lambda: (torch.matmul(x, w.t(), out=y), fused.run(y, stream, True, o, new)),
        "cublas_nccl_bd": lambda: (torch.matmul(x, w.t(), out=y), dist.all_reduce(y),
                                   unfused.run(y, stream, True, o, new)),
        **({} if kw_twin is None else {"publish_graph_kw": lambda: kw_twin.run(x, publish=True)}),
        **({} if one_row is None else {
            "gemm_gemv": lambda: one_row[0].run(x, y),
            "publish_bd_gemv_no_pdl": lambda: one_row[1].run_boundary(x, fused, stream, True, o, new)}),
    }


def _free_slots(fns: dict) -> None:
    """After replays that published without consuming (the same partials
    into the same slots): once every rank is done, one consuming call frees
    the slots. Collective."""
    torch.cuda.synchronize()
    dist.barrier()
    fns["consume"]()
    torch.cuda.synchronize()


def _rounds(fns: dict, iters: int, reps: int, rounds: int) -> dict:
    """The target's pair (``ROUNDS``) timed in ``rounds`` alternating
    rounds, each graph captured once: ``{key: [one median per round]}``.
    Round r times them in ``ROUNDS``'s order where r is even, in reverse
    where it is odd, so a drift of the clocks favours none; a contender
    without its call in ``fns`` is left out. Collective."""
    from dspark_comm.tp_draft import time_replays
    from dspark_core.tools.timing import capture

    pairs = [(key, call) for _, key, call in ROUNDS if call in fns]
    graphs = {}
    for key, call in pairs:
        graphs[key] = capture(fns[call], iters, side_stream=True)
        if call in PUBLISH_ONLY:
            _free_slots(fns)
    values = {key: [] for key, _ in pairs}
    for r in range(rounds):
        for key, call in (pairs if r % 2 == 0 else pairs[::-1]):
            values[key].append(time_replays(graphs[key], reps, calls=iters))
            if call in PUBLISH_ONLY:
                _free_slots(fns)
    return values


def _worker(rank: int, world: int, init: str, out: str, iters: int, reps: int, rounds: int) -> None:
    from dspark_comm.runtime.ranks import init_rank, record_case

    init_rank(rank, world, init, timeout_s=60.0)
    from dspark_comm.cutedsl.all_reduce_boundary import AllReduceBoundary
    from dspark_comm.cutedsl.package_gemm import PackageGemm
    from dspark_comm.runtime.group import TorchGroup
    from dspark_comm.runtime.mailbox import Mailbox
    from dspark_comm.tp_draft import time_replays
    from dspark_core.contracts.constants import PackageGemmConstants, boundary_constants
    from dspark_core.planner.policy import draft_gemm_shape
    from dspark_core.reference.adapter import norm_description
    from dspark_core.runtime import description as D
    from dspark_core.spec.layers import GatedResidual, RMSNorm, stock_arch
    from dspark_core.tools.timing import capture
    from dspark_cute.cutedsl.norms.boundary import DraftBoundary

    group = TorchGroup()
    mb = Mailbox(group, H, max(ROWS), timeout_s=5.0)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    post = RMSNorm(H, weight_dtype=torch.bfloat16).cuda()
    pre = RMSNorm(H, weight_dtype=torch.bfloat16).cuda()
    conn = GatedResidual(H).cuda()
    # The constants as the planner builds them, with the device's stock tree.
    described = D.Boundary("the boundary", norm_description("the post-norm", post, H),
                           D.Connection("the connection", conn, conn.alpha, conn.beta),
                           norm_description("the pre-norm", pre, H))
    c = boundary_constants(described, H, stock_arch("cuda"))
    fused = AllReduceBoundary(mb, c, conn.alpha, conn.beta, post.weight, pre.weight)
    fused.prepare(published=(False, True))
    unfused = DraftBoundary(c, conn.alpha, conn.beta, post.weight, pre.weight)
    results = {}
    for k in KS:
        role = "o_proj" if k < 8192 else "down_proj"
        s = draft_gemm_shape(role, k)
        w = (torch.randn((H, k), generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        constants = PackageGemmConstants(role, H, k, s.tile_n, s.split_k, s.max_rows)
        gemm = PackageGemm(constants, w, mb)
        gemm_no_pdl = PackageGemm(constants, w, mb, pdl=False)
        try:  # the one-row GEMV twins (opt-in path; ValueError where the GEMV cannot take the weight)
            one_row = (PackageGemm(constants, w, mb, one_row_gemv=True),
                       PackageGemm(constants, w, mb, pdl=False, one_row_gemv=True))
        except ValueError as e:
            one_row, one_row_why = None, f"failed: {e}"[:200]
        # The publish at the other ring warp count (the ring only; its own sums).
        kw_twin = (PackageGemm(constants, w, mb, k_warps=8 if gemm.k_warps == 4 else 4)
                   if s.tile_n == 64 else None)
        for g in (gemm, gemm_no_pdl, *(one_row or ()), *([kw_twin] if kw_twin else [])):
            g.prepare()
        results[f"shape/{k}"] = (f"tile_n {s.tile_n}, k_warps {gemm.k_warps}, stages "
                                 f"{gemm.stages_by_tiles[0]} / {gemm.stages_by_tiles[1]} / {gemm.stages_by_tiles[2]}"
                                 f" (m = 1{', x through registers' if gemm.configs[0].x_regs else ''} / <= 8 / <= 16)"
                                 + (f", {gemm.configs[2].copy.rstrip('s')} copies; its twin k_warps "
                                    f"{kw_twin.k_warps}, stages " + " / ".join(
                                        str(kw_twin.stages_by_tiles[t]) for t in (0, 1, 2))
                                    if kw_twin else ""))
        for m in ROWS:
            fns = _calls(gen, m, k, gemm, w, fused, unfused, gemm_no_pdl, one_row, kw_twin)
            for _, key in CASES:
                if key in ONE_ROW and (m != 1 or one_row is None):
                    results[f"{key}/{k}/{m}"] = "-" if m != 1 else one_row_why
                    continue
                if key == "cublas_kernel":  # like for like with the publish kernel's own time
                    measure = lambda fn=fns["cublas"]: _device_us_per_call(fn)  # noqa: E731
                elif key == "publish_kernel_gemv":
                    measure = lambda fn=fns[PROFILED[key]]: _kernel_us(fn, "PackageGemvKernel")  # noqa: E731
                elif key in PROFILED:
                    measure = lambda fn=fns[PROFILED[key]]: _kernel_us(fn, PUBLISH_KERNEL)  # noqa: E731
                else:
                    measure = lambda fn=fns[key]: time_replays(  # noqa: E731
                        capture(fn, iters, side_stream=True), reps, calls=iters)
                record_case(results, f"{key}/{k}/{m}", measure)
                if key in PUBLISH_ONLY:
                    _free_slots(fns)
                mb.check()
            try:
                got = _rounds(fns, iters, reps, rounds)
                for _, key, _ in ROUNDS:
                    results[f"{key}/{k}/{m}"] = got.get(key, "-")
            except Exception as e:  # noqa: BLE001 (reported in the table, not hidden)
                for _, key, _ in ROUNDS:
                    results[f"{key}/{k}/{m}"] = f"failed: {type(e).__name__}: {e}"[:200]
            mb.check()
    gathered = group.all_gather_object(results)
    if rank == 0:
        with open(os.path.join(out, "package_gemm_raw.json"), "w") as f:
            json.dump(gathered, f, indent=1)
    mb.close()
    dist.destroy_process_group()


def _per_round(raw: list[dict], key: str) -> tuple[list[float] | None, str]:
    """``key``'s rounds over the ranks ``raw``: ``(the slower rank's value
    in each round, None)``, or ``(None, the first rank's failure words)``."""
    from dspark_comm.runtime.ranks import first_failure

    vals = [r[key] for r in raw]
    failed = first_failure(vals)
    if failed is not None:
        return None, failed
    return [max(per_rank) for per_rank in zip(*vals)], ""


def _report(raw: list[dict], out: str) -> str:
    from dspark_comm.runtime.ranks import slower_rank

    cols = [(k, m) for k in KS for m in ROWS]
    lines = [
        "TP2 on two H200s (NVLink), N = H = 8192, BF16, K the rank's shard; microseconds per call, "
        "median of CUDA-graph replays, the slower rank. Main-loop shapes: "
        + "; ".join(f"K = {k}: {raw[0].get(f'shape/{k}')}" for k in KS) + ".",
        "",
        "| case | " + " | ".join(f"K {k}, m {m}" for k, m in cols) + " |",
        "| --- |" + " --- |" * len(cols),
    ]
    series = {}
    for label, key in CASES:
        row = []
        for k, m in cols:
            value, text = slower_rank(raw, f"{key}/{k}/{m}")
            row.append(text)
            series.setdefault(label, []).append(value)
        lines.append(f"| {label} | " + " | ".join(row) + " |")

    def rounds_won(a: str, b: str) -> str:
        """In how many rounds ``a`` was no slower than ``b``, per (K, m)
        where both ran ("-": a contender that does not run there)."""
        said = []
        for k, m in cols:
            (ra, fa), (rb, fb) = _per_round(raw, f"{a}/{k}/{m}"), _per_round(raw, f"{b}/{k}/{m}")
            if "-" in (fa, fb):
                continue
            said.append(f"K {k} m {m}: " + ("failed" if ra is None or rb is None else
                                            f"{sum(x <= y for x, y in zip(ra, rb))} of {len(ra)}"))
        return ", ".join(said)

    for label, key, _ in ROUNDS:
        row = []
        for k, m in cols:
            values, failed = _per_round(raw, f"{key}/{k}/{m}")
            row.append(failed or f"{statistics.median(values):.2f}")
            series.setdefault(label, []).append(None if values is None else statistics.median(values))
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    cub = series[CASES[1][0]]

    def verdict(values) -> str:
        hits = [p is not None and c is not None and p <= c for p, c in zip(values, cub)]
        return "met at every K and m" if all(hits) else f"met at {sum(hits)} of {len(hits)} (K, m)"

    label = {key: name for name, key in CASES}
    cub_kernel = series[label["cublas_kernel"]]
    with_gemv = [g if m == 1 else p for (_, m), g, p in
                 zip(cols, series[label["publish_kernel_gemv"]], series[label["publish_kernel"]])]
    like = [p is not None and c is not None and p <= c for p, c in zip(series[label["publish_kernel"]], cub_kernel)]
    plain_like = [p is not None and c is not None and p <= c
                  for p, c in zip(series[label["gemm_kernel"]], cub_kernel)]
    round_label = {key: name for name, key, _ in ROUNDS}

    def by_rounds(values) -> str:
        """``verdict`` against cuBLAS's median over the rounds."""
        hits = [p is not None and c is not None and p <= c
                for p, c in zip(values, series[round_label["rounds_cublas"]])]
        return f"met at {sum(hits)} of {len(hits)} (K, m)"

    lines += ["", "Target (issue 6): the GEMM with its publish no slower than cuBLAS alone: "
              + verdict(series[label["publish_graph"]]) + " per call in a CUDA graph (the draft's setting); "
              "by the median over the alternating rounds: " + by_rounds(series[round_label["rounds_publish"]]) + "; "
              "the publish no slower in " + rounds_won("rounds_publish", "rounds_cublas") + " rounds; "
              + verdict(series[label["publish_kernel"]]) + " by the publish-mode kernel's own time;",
              "with the consuming fused boundary too (a stricter reading): "
              + verdict(series[label["publish_bd"]]) + ";",
              f"like for like (the publish kernel's device time against cuBLAS's, both profiled): met at "
              f"{sum(like)} of {len(like)} (K, m); the plain kernel's: {sum(plain_like)} of {len(plain_like)};",
              "with the one-row GEMV at m = 1 (one_row_gemv=True; the policy's kernel above): "
              + verdict(with_gemv) + ";",
              "at the other warp count (the ring's shards): by the median over the rounds "
              + by_rounds([t if t is not None else p for t, p in zip(series[round_label["rounds_publish_kw"]],
                                                                     series[round_label["rounds_publish"]])])
              + " (the policy's publish where it has no twin); no slower than the policy's publish in "
              + rounds_won("rounds_publish_kw", "rounds_publish") + " rounds."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "package_gemm_tp2.md"), "w") as f:
        f.write(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(KS), figsize=(12, 4.2), sharey=True)
        for ax, k in zip(axes, KS):
            for label, values in series.items():
                pts = [(m, v) for (kk, m), v in zip(cols, values) if kk == k and v is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o" if "boundary" in label else "--x",
                        label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ROWS, [str(m) for m in ROWS])
            ax.set_xlabel("rows m")
            ax.set_title(f"K = {k}")
        axes[0].set_ylabel("us per call")
        axes[-1].legend(fontsize=7)
        fig.suptitle("TP2 package GEMM (+ all-reduce boundary), N = 8192 (2x H200)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "package_gemm_tp2.png"), dpi=120)
    except ImportError:
        text += "\n(matplotlib is not installed: no plot)\n"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of the target's pair")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before the ranks are killed")
    args = parser.parse_args()
    from dspark_comm.runtime.ranks import tp2_benchmark

    logging.basicConfig(level=logging.INFO, format="%(message)s")

    raw, status = tp2_benchmark("the TP2 package GEMM benchmark", _worker, args.out, "package_gemm_raw.json",
                                args.out, args.iters, args.reps, args.rounds, timeout_s=args.timeout)
    if raw is not None:
        print(_report(raw, args.out))
    return status


if __name__ == "__main__":
    sys.exit(main())
