"""Where a draft step's GPU time goes: the specialized decode and the stock
forward at m = 1, 4, 16 under torch.profiler, as bench_decode times them:
replays of a captured CUDA graph of the step (``--eager``: eager steps,
which also run the host-side input checks' kernels). Where the profiler
records no kernel inside the graph replays, the path is profiled eagerly
and its heading says so. Prints each path's kernels grouped by name with
their summed device time per step (the GEMMs marked), so the non-GEMM share
can be attributed to parts (``--gemv``: also the decode with the one-token
GEMV at m = 1). Writes profile_decode.md into --out."""

from __future__ import annotations

import argparse
import functools
import sys
from collections import defaultdict
from pathlib import Path

import torch

from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel
from dspark_core.runtime.build import build_draft_decode as _build
from dspark_core.tools.graphs import StepGraph
from dspark_core.tools.timing import step_case

CONTEXT = 256
STEPS = 5


# Name fragments of the GEMM kernels: cuBLAS's (with its split-K reduction),
# the package GEMM and the one-token GEMV. Not "cutlass": every
# CuTe DSL kernel's name has it, the norms and attention too.
GEMM_NAMES = ("gemm", "sm90_xmma", "nvjet", "splitkreduce", "skinny", "gemvkernel")


def _gemm(name: str) -> bool:
    lowered = name.lower()
    return any(k in lowered for k in GEMM_NAMES)


def _profile(run) -> dict[str, tuple[int, float]]:
    """The kernels of ``STEPS`` calls of ``run()`` (after 3 warm-up calls):
    name -> (launches per call, device µs per call)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            run()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per[evt.name][0] += 1
            per[evt.name][1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    return {k: (v[0] // STEPS, v[1] / STEPS) for k, v in per.items()}


def build_draft_decode(model, **options):
    """core's executor over the reference draft's description (dspark-cute's kernels)."""
    return _build(describe(model), **options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="profile eager steps instead of graph replays")
    parser.add_argument("--gemv", action="store_true",
                        help="also profile the decode with the one-token GEMV projections (gemv=True)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: no CUDA GPU")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = DraftModel(DraftConfig(num_layers=args.layers), device="cuda")
    decode = build_draft_decode(model)
    with_gemv = build_draft_decode(model, gemv=True) if args.gemv and decode is not None else None
    lines = []
    for m in (1, 4, 16):
        x, step, caches = step_case(model, m, CONTEXT)
        paths = {"stock": model.forward}
        if decode is not None:
            paths["specialized"] = decode.run
        if with_gemv is not None and m == 1:  # the GEMV runs one-token steps only
            paths["specialized with the GEMV"] = with_gemv.run
        for name, fn in paths.items():
            kernels, how = {}, "eager"
            if not args.eager:
                try:
                    graph = StepGraph(fn, x, step, caches)
                    kernels, how = _profile(graph.graph.replay), "graph replays"
                    if not kernels:  # this profiler saw nothing inside the graph
                        how = "eager (the profiler recorded no kernel in graph replays)"
                except Exception as error:  # said in the heading, not hidden
                    kernels, how = {}, f"eager (graph replays failed: {type(error).__name__}: {error})"[:160]
            if not kernels:
                kernels = _profile(functools.partial(fn, x, step, caches))
            total = sum(t for _, t in kernels.values())
            gemm = sum(t for k, (_, t) in kernels.items() if _gemm(k))
            launches = sum(n for n, _ in kernels.values())
            lines.append(f"\n### m={m} {name} ({how}): {total:.1f} us of kernels per step, {launches} launches, "
                         f"GEMMs {gemm:.1f} us, rest {total - gemm:.1f} us")
            lines.append("| us/step | launches | kernel |")
            lines.append("|---|---|---|")
            for k, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]:
                lines.append(f"| {t:.1f} | {n} | {'[GEMM] ' if _gemm(k) else ''}{k[:110]} |")
    text = "\n".join(lines)
    print(text)
    (out / "profile_decode.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
