"""The DSpark demo: build the reference draft, print its plan with every
reason, store a context's K/V and run greedy decode steps on the stock path
and, on a GPU with a kernel backend installed, on the specialized decode,
saying whether they match bit for bit and how long a step takes.

    python -m dspark_core.demo [--config CONFIG.json] [--steps 8] [--block 4] [--tp 2]

The executor comes from the installed backend (the ``dspark.executors``
entry point: dspark-cute's ``build_draft_decode``), so this package needs no
GPU stack. ``--tp 2`` runs the draft sharded over two GPUs of this host
(``dspark_comm.demo_tp2``, imported only then: it needs dspark-comm); on a
machine with fewer than two GPUs it says so and runs the TP1 demo.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from importlib.metadata import entry_points

import torch

from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.reference.tp import shard_draft
from dspark_core.tools.compare import mismatches
from dspark_core.tools.graphs import StepGraph
from dspark_core.tools.timing import median_us

log = logging.getLogger("dspark.demo")


def print_plan(plan) -> None:
    """Print a ``DraftPlan`` and, for every part it keeps stock, why."""
    print(plan.format())
    for line in plan.refused():
        print(f"  why: {line}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


EXECUTORS_ENTRY_POINTS = "dspark.executors"


def executor_builder():
    """The installed backend's ``build(model, qkv_front=) -> decode or None``
    (the ``dspark.executors`` entry point), or None where no backend
    provides one."""
    for ep in entry_points(group=EXECUTORS_ENTRY_POINTS):
        return ep.load()
    try:  # dspark-cute importable from the path but not installed
        from dspark_cute.decode import build_draft_decode
    except ImportError:
        return None
    return build_draft_decode


def _context(model, states, positions, decode, blocks, device):
    caches = model.make_caches(blocks, device)
    if decode is None or not decode.store_context_kv(states, positions, caches, positions):
        model.precompute_and_store_context_kv(states, positions, caches, positions)
    return caches


def _decode(model, fn, caches, tokens, start, steps, block, span, device):
    """Greedy steps: returns each step's tokens and hidden states."""
    toks, hiddens = [], []
    for i in range(steps):
        step = StepInputs.block(start + i * block, block, device, span=span)
        hidden = fn(model.embed_tokens(tokens), step, caches)
        tokens = model.logits(hidden).argmax(-1)
        toks.append(tokens.tolist())
        hiddens.append(hidden.clone())
    return toks, hiddens


def _time_step(fn, model, caches, block, start, span, device, reps: int = 50) -> float:
    """Seconds per step: a CUDA graph's median replay on a GPU, eager wall
    time on a CPU."""
    x = model.embed_tokens(torch.zeros(block, dtype=torch.int64, device=device))
    step = StepInputs.block(start, block, device, span=span)
    if device.type != "cuda":
        begin = time.perf_counter()
        fn(x, step, caches)
        return time.perf_counter() - begin
    graph = StepGraph(fn, x, step, caches)
    return median_us(graph.replay, reps) * 1e-6


@torch.no_grad()
def run_demo(
    config: DraftConfig, steps: int, block: int, context: int, device: torch.device, front: bool = False,
    gemv: bool = False,
) -> dict:
    """Build, plan and decode on the stock path and, where a backend provides
    it on this device, the specialized decode; compare and time them."""
    t0 = time.perf_counter()
    model = DraftModel(config, device=device)
    print(f"built the reference draft ({config.num_layers} layers, hidden {config.hidden_size}) "
          f"on {device} in {time.perf_counter() - t0:.1f} s")
    # The QKV front's projection sums in its own order (not cuBLAS's): it is
    # opt-in (--front); without it the specialized decode is bit for bit.
    # Likewise the one-token GEMV projections (--gemv: the spec's stated order).
    asked = policy.asked_opt_ins(front, gemv)
    build = executor_builder() if device.type == "cuda" else None
    options = {"qkv_front": front, **({"gemv": True} if gemv else {})}
    decode = build(model, **options) if build is not None else None
    # The plan printed is the one the decode runs, where there is one.
    plans = [decode.plan if decode is not None else plan_draft(model, policy.device_target(device).opt_in(asked))]
    if device.type != "cuda":
        # What the same draft gets on one H200 with the installed backends.
        plans.append(plan_draft(model, policy.Target(kernels=policy.installed_kernels()).opt_in(asked)))
    for p in plans:
        print_plan(p)
    if device.type == "cuda" and decode is None:
        print("no specialized decode on this device (see the log above): the stock path runs alone")

    gen = torch.Generator().manual_seed(config.seed + 1)
    span = context + (steps + 1) * block
    blocks = span // config.kv_block_size + 2
    states = torch.randn(context, config.hidden_size, generator=gen).to(torch.bfloat16).to(device)
    positions = torch.arange(context, device=device)
    first = torch.randint(0, config.vocab_size, (block,), generator=gen).to(device)
    paths = {"stock": model.forward}
    if decode is not None:
        paths["specialized"] = decode.run
    results = {}
    for name, fn in paths.items():
        caches = _context(model, states, positions, decode if name != "stock" else None, blocks, device)
        toks, hiddens = _decode(model, fn, caches, first, context, steps, block, span, device)
        seconds = _time_step(fn, model, caches, block, context + steps * block, span, device)
        results[name] = (toks, hiddens, seconds)
        print(f"{name} path: {steps} steps of {block} token(s), {seconds * 1e6:.1f} us per step "
              f"({'CUDA graph, median' if device.type == 'cuda' else 'eager wall time'})")
        for i, t in enumerate(toks):
            print(f"  step {i}: {t}")
    if "specialized" in results:
        (st, sh, ss), (ft, fh, fs) = results["stock"], results["specialized"]
        bad = sum(int(mismatches(a, b).sum()) for a, b in zip(fh, sh))
        same = "bit for bit equal" if bad == 0 else f"NOT equal: {bad} elements differ"
        if bad and (front or gemv):
            same += " (expected: --front/--gemv sum projections in their own order, not cuBLAS's)"
        print(f"specialized vs stock hidden states over {steps} steps: {same}; "
              f"tokens {'equal' if ft == st else 'differ'}; step time {ss / fs:.2f}x faster")
    elif device.type != "cuda":
        print("no CUDA GPU here: the plan is for a GPU, the stock path ran on the CPU")
    return {name: r[0] for name, r in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_core.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a DraftConfig JSON file (default: the reference draft)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--block", type=int, default=1, help="tokens per step (1 to 16)")
    parser.add_argument("--context", type=int, default=64, help="context tokens stored first")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    parser.add_argument(
        "--front",
        action="store_true",
        help="also run the fused QKV front (exact up to its projection's summation order, so not bitwise)",
    )
    parser.add_argument(
        "--gemv",
        action="store_true",
        help="run the projections of one-token steps on the GEMV (the spec's stated order, not cuBLAS's bits)",
    )
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor-parallel size (2: two GPUs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not 1 <= args.block <= policy.MAX_DECODE_ROWS:
        print(f"error: --block must lie in [1, {policy.MAX_DECODE_ROWS}]", file=sys.stderr)
        return 2
    config = DraftConfig.from_json(args.config) if args.config else DraftConfig()
    if args.tp > 1:
        if args.gemv:
            print("--gemv: the one-token GEMV runs at TP1 only (at TP the branch GEMMs feed the all-reduce)")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus >= args.tp:
            return _run_tp(config, args)
        print(f"--tp {args.tp} needs {args.tp} CUDA GPUs and this machine has {gpus}: running the TP1 demo instead")
        print(f"What a rank of TP{args.tp} on H200s would run with the installed backends:")
        shard = shard_draft(DraftModel(config, device="meta"), 0, args.tp)
        print_plan(plan_draft(shard, policy.Target(tp=args.tp, kernels=policy.installed_kernels())))
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    run_demo(config, args.steps, args.block, args.context, device, args.front, args.gemv)
    return 0


def _run_tp(config: DraftConfig, args) -> int:
    """The TP demo from dspark-comm, imported here only (module docstring)."""
    try:
        from dspark_comm.demo_tp2 import run_tp2_demo
    except ImportError as error:
        print(f"error: --tp {args.tp} needs dspark-comm: pip install dspark-comm "
              f"(or pip install ./packages/dspark-comm) ({error})", file=sys.stderr)
        return 2
    try:
        return run_tp2_demo(config, args.steps, args.block, args.context, args.front)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
