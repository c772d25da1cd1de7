"""The DSpark demo: build the reference draft, print its plan with every
reason, store a context's K/V and run greedy decode steps on a reference path
and, on a GPU with a kernel backend installed, on the specialized decode;
then say what was compared, what matched and how long a step takes.

    python -m dspark_core.demo [--config CONFIG.json] [--steps 4] [--block 1] [--context 64] [--stock DIR] [--tp 2]

The reference path on a GPU is vLLM 0.33.0's draft step from its own
binaries (``dspark_core.demo_stock``: ``scripts/stock`` of a checkout, the
binaries in ``--stock DIR``, default ``DSPARK_STOCK_DIR``, else the
checkout's ``.device/stock``): both paths run in CUDA graphs, their hidden
states and tokens are compared bit for bit and the summary gives the ratio of
their median step times. Where those binaries are not there (or on a CPU),
the reference path is dspark-core's spec in eager PyTorch: its bits are
compared, its time is no baseline, and the demo prints no ratio, saying why.

The kernels come from the installed backends (the ``dspark.kernels`` entry
points), so this package needs no GPU stack. ``--tp 2`` runs the TP2 demo of
an installed backend (the ``dspark.tp_demos`` entry point: dspark-comm's) on
two GPUs of this host; with fewer GPUs it says so and runs the TP1 demo.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from importlib.metadata import entry_points

import torch

from dspark_core import demo_stock
from dspark_core.planner import policy
from dspark_core.planner.cli import StrictParser, folder, int_in, positive_int, print_plan, release_stdout
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.reference.tp import check_tp, shard_draft
from dspark_core.runtime.build import build_draft_decode
from dspark_core.tools.compare import mismatches
from dspark_core.tools.graphs import StepGraph
from dspark_core.tools.timing import times_us

TP_DEMOS_ENTRY_POINTS = "dspark.tp_demos"
TIMED_REPS = 50  # CUDA graph replays timed per path
CPU_TIMED_STEPS = 3  # eager steps timed per path on a CPU


def progress_bar(what: str, stream=None):
    """``progress(done, total)``: a bar redrawn in place for long work on a
    terminal (stderr), or a line at every quarter into a log."""
    stream = stream or sys.stderr
    tty = stream.isatty()
    last = [-1]

    def progress(done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        shown = percent if tty else percent // 25 * 25
        if shown == last[0]:
            return
        last[0] = shown
        if tty:
            stream.write(f"\r{what} [{'#' * (percent // 5):<20}] {percent:3d}%" + ("\n" if done >= total else ""))
        else:
            stream.write(f"{what}: {shown}%\n")
        stream.flush()

    return progress


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _context(model, stock, states, positions, decode, blocks, device, on_stock: bool):
    """The layers' caches with the context's K/V stored (slots = positions):
    by ``decode``'s context chain where given and taken, by vLLM's step
    (``stock.context``) for its path, else by the spec."""
    caches = model.make_caches(blocks, device)
    if not caches:  # a draft without layers has no K/V to store
        return caches
    if on_stock:
        stock.context(states, positions, positions, [c.tensor for c in caches])
    elif decode is None or not decode.store_context_kv(states, positions, caches, positions):
        model.precompute_and_store_context_kv(states, positions, caches, positions)
    return caches


def _decode(model, fn, caches, tokens, start, steps, block, span, device):
    """Greedy steps: each step's tokens and hidden states."""
    toks, hiddens = [], []
    for i in range(steps):
        step = StepInputs.block(start + i * block, block, device, span=span)
        hidden = fn(model.embed_tokens(tokens), step, caches)
        tokens = model.logits(hidden).argmax(-1)
        toks.append(tokens.tolist())
        hiddens.append(hidden.clone())
    return toks, hiddens


def _step_times_us(fn, model, caches, block, start, span, device) -> list[float]:
    """Microseconds per step: CUDA graph replays on a GPU (``TIMED_REPS``),
    eager steps on a CPU (``CPU_TIMED_STEPS``)."""
    x = model.embed_tokens(torch.zeros(block, dtype=torch.int64, device=device))
    step = StepInputs.block(start, block, device, span=span)
    if device.type != "cuda":
        times = []
        for _ in range(CPU_TIMED_STEPS):
            begin = time.perf_counter()
            fn(x, step, caches)
            times.append((time.perf_counter() - begin) * 1e6)
        return times
    graph = StepGraph(fn, x, step, caches)
    return times_us(graph.replay, TIMED_REPS, warmup=3)


def _spread(times: list[float]) -> str:
    return f"{statistics.median(times):.1f} us (min {min(times):.1f}, max {max(times):.1f}, {len(times)} samples)"


def _build_decode(draft, device: torch.device, gemv: bool):
    """The specialized decode where a backend provides kernels on ``device``
    (None elsewhere), its plan printed with every reason."""
    asked = policy.asked_opt_ins(gemv)
    if device.type != "cuda":
        target = policy.Target(kernels=policy.installed_kernels()).opt_in(asked)
        print(f"no GPU here; the plan for {target.describe()} (an H200) with the installed backends would be:")
        print_plan(plan_draft(draft, target))
        return None
    print("planning and compiling the specialized decode's kernels ...", flush=True)
    t0 = time.perf_counter()
    decode = build_draft_decode(draft, gemv=gemv)
    if decode is not None:
        print(f"compiled in {time.perf_counter() - t0:.1f} s")
        print_plan(decode.plan)
    else:
        print_plan(plan_draft(draft, policy.device_target(device).opt_in(asked)))
        print("no specialized decode on this device (the reasons are above): the spec path runs alone")
    return decode


def _stock_path(model, device: torch.device, stock_dir, kernels, attention):
    """``(StockStep, label, None)`` of vLLM's step from its binaries in
    ``stock_dir`` (or on ``kernels``, a stand-in: module ``demo_stock``),
    else ``(None, None, why)``."""
    if kernels is None:
        why = demo_stock.missing_reason(stock_dir)
        if why is None and device.type != "cuda":
            why = "vLLM's binaries run on a CUDA GPU"
        if why is not None:
            return None, None, why
    try:
        stock, attention_name = demo_stock.stock_step(model, stock_dir, kernels, attention,
                                                      pdl=device.type == "cuda")
    except LookupError as error:
        return None, None, f"no paged decode attention installed for vLLM's step ({error}): pip install dspark-cute"
    except Exception as error:  # noqa: BLE001 - any failure to load or launch the binaries: said, then the spec
        return None, None, f"vLLM's binaries in {stock_dir} did not run here ({type(error).__name__}: {error})"
    source = "from its binaries" if kernels is None else "on stand-in kernels"
    return stock, f"vLLM 0.33.0's draft step {source} (attention: {attention_name}, both paths)", None


@torch.no_grad()
def run_demo(config: DraftConfig, steps: int, block: int, context: int, device: torch.device,
             gemv: bool = False, stock_dir=None, stock_kernels=None, stock_attention=None) -> dict:
    """Build, plan and decode on the reference path and, where a backend
    provides kernels on this device, the specialized decode; compare and
    time them. The reference path is vLLM's step from its binaries in
    ``stock_dir`` where they run (``demo_stock``; ``stock_kernels`` and
    ``stock_attention`` stand in for the binaries and the attention kernel
    in a CPU dry run), both paths timed; else dspark-core's spec in eager
    PyTorch, timed only where it runs alone (no speed ratio against it).
    Returns each path's tokens."""
    t0 = time.perf_counter()
    model = DraftModel(config, device=device, progress=progress_bar("drawing the draft's weights"))
    print(f"built the reference draft ({config.num_layers} layers, hidden {config.hidden_size}) on {device} "
          f"in {time.perf_counter() - t0:.1f} s")
    draft = describe(model)
    decode = _build_decode(draft, device, gemv)
    stock, stock_label, why = _stock_path(model, device, stock_dir, stock_kernels, stock_attention) \
        if decode is not None or stock_kernels is not None else (None, None, None)
    if why is not None:
        print(f"no speed ratio: {why}")

    gen = torch.Generator().manual_seed(config.seed + 1)
    span = context + (steps + 1) * block
    blocks = span // config.kv_block_size + 2
    states = torch.randn(context, config.hidden_size, generator=gen).to(torch.bfloat16).to(device)
    positions = torch.arange(context, device=device)
    first = torch.randint(0, config.vocab_size, (block,), generator=gen).to(device)
    paths = {"stock": stock.forward} if stock is not None else {"spec": model.forward}
    if decode is not None:
        paths["specialized"] = decode.run
    labels = {"stock": stock_label, "spec": "dspark-core's spec of vLLM's arithmetic (eager PyTorch)",
              "specialized": "DSpark's specialized decode"}
    results = {}
    for name, fn in paths.items():
        caches = _context(model, stock, states, positions, decode if name == "specialized" else None,
                          blocks, device, name == "stock")
        toks, hiddens = _decode(model, fn, caches, first, context, steps, block, span, device)
        timed = name != "spec" or len(paths) == 1
        times = _step_times_us(fn, model, caches, block, context + steps * block, span, device) if timed else None
        results[name] = (toks, hiddens, times)
        how = "CUDA graph replays" if device.type == "cuda" else "eager steps"
        took = f"; a step takes {_spread(times)} ({how})" if timed else " (not timed)"
        print(f"{name} path, {labels[name]}: {steps} greedy steps of {block} token(s){took}")
        for i, t in enumerate(toks):
            print(f"  step {i}: {t}")
    print(_summary(results, steps, gemv, device))
    return {name: r[0] for name, r in results.items()}


def _summary(results: dict, steps: int, opt_in: bool, device: torch.device) -> str:
    if "specialized" not in results:
        if device.type != "cuda":
            ran = "vLLM's step (on stand-in kernels)" if "stock" in results else "dspark-core's spec"
            return (f"summary: {ran} ran on the CPU. On a GPU with dspark-cute installed the demo also "
                    "runs the specialized decode and, where vLLM's stock binaries are staged (--stock DIR), vLLM's "
                    "draft step from them: it compares their hidden states and tokens bit for bit and times both "
                    "in CUDA graphs.")
        return "summary: the spec path ran alone (no part of the draft fuses on this device)."
    ref = "stock" if "stock" in results else "spec"
    (st, sh, stimes), (ft, fh, ftimes) = results[ref], results["specialized"]
    bad = sum(int(mismatches(a, b).sum()) for a, b in zip(fh, sh))
    total = sum(a.numel() for a in sh)
    same = "bit for bit equal" if bad == 0 else f"NOT bit for bit: {bad} of {total} elements differ"
    if bad and opt_in:
        same += " (expected with --gemv: it sums the projections in its own order)"
    whose = "vLLM's step from its binaries'" if ref == "stock" else "dspark-core's spec's"
    line = (f"summary: over {steps} steps the specialized decode's hidden states are {same} with {whose}; "
            f"tokens {'equal' if ft == st else 'differ'}")
    if ref == "spec":
        return line + "; no speed ratio (vLLM's binaries did not run: the line above says why)."
    how = "CUDA graph replays" if device.type == "cuda" else "eager steps"
    speed = statistics.median(stimes) / statistics.median(ftimes)
    return line + f"; a step is {speed:.2f}x as fast as vLLM's (medians of {how})."


def parser() -> argparse.ArgumentParser:
    p = StrictParser(prog="python -m dspark_core.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a DraftConfig JSON file (default: the reference draft)")
    p.add_argument("--steps", type=positive_int, default=4, help="greedy decode steps per path (default 4)")
    p.add_argument("--block", type=positive_int, default=1, help=f"tokens per step, 1 to {policy.MAX_DECODE_ROWS}")
    p.add_argument("--context", type=positive_int, default=64, help="context tokens stored first (default 64)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run (default auto)")
    p.add_argument("--gemv", action="store_true",
                   help="run one-token steps' projections on the opt-in GEMV (its own stated order)")
    p.add_argument("--stock", metavar="DIR", type=folder, default=None,
                   help="the folder of vLLM's compiled stock binaries (scripts/stock/compile_stock.py --out DIR; "
                        "default DSPARK_STOCK_DIR, else the checkout's .device/stock)")
    # int_in: ASCII digits only (int() would read '١' as 1).
    p.add_argument("--tp", type=int_in(1, 2), default=1, help="tensor-parallel size, 1 or 2 (2: two GPUs)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        if args.block > policy.MAX_DECODE_ROWS:
            raise ValueError(f"--block must lie in [1, {policy.MAX_DECODE_ROWS}], not {args.block}")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch build sees no CUDA GPU")
        config = DraftConfig.from_json(args.config) if args.config is not None else DraftConfig()
        if config.compute_dtype != "bf16":
            # The reference draft's context K/V chain takes BF16 target states into BF16 norms.
            raise ValueError(f"the demo runs drafts of bf16 compute, not {config.compute_dtype!r} (the reference "
                             "draft's context K/V chain is BF16); python -m dspark_core.planner plans any")
        check_tp(config, args.tp)
        if config.max_position < args.context + (args.steps + 1) * args.block:
            raise ValueError(f"the draft's max_position ({config.max_position}) cannot hold {args.context} context "
                             f"tokens and {args.steps} steps of {args.block}")
        if args.tp > 1:
            code = _run_tp(config, args)
            if code is not None:
                return code
        device = torch.device(args.device if args.device != "auto" else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        stock_dir = args.stock if args.stock is not None else demo_stock.default_stock_dir()
        if args.stock is not None and not args.stock.is_dir():
            raise ValueError(f"--stock {str(args.stock)!r}: no such folder (the compiled stock binaries' folder)")
        check_fits(config, device)
        run_demo(config, args.steps, args.block, args.context, device, args.gemv, stock_dir)
    except BrokenPipeError:  # e.g. `python -m dspark_core.demo | head`: the reader has all it wanted
        release_stdout()
        return 0
    except (ValueError, TypeError, OSError) as error:
        release_stdout()  # where the error was stdout's own (a full disk), nothing fails again at exit
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (MemoryError, torch.OutOfMemoryError) as error:  # weights fit, the steps' tensors did not
        release_stdout()
        print(f"error: out of memory running the demo ({type(error).__name__}: {str(error)[:200]})", file=sys.stderr)
        return 1
    return 0


def check_fits(config: DraftConfig, device: torch.device) -> None:
    """ValueError where the draft's weights (its parameters and buffers,
    counted on the meta device) are more than ``device`` holds (a GPU's
    memory, a CPU's physical memory): the demo builds them for real, so a
    size no machine can allocate is refused before it is tried."""
    meta = DraftModel(config, device="meta")
    need = sum(t.numel() * t.element_size() for group in (meta.parameters(), meta.buffers()) for t in group)
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ValueError(f"the draft's weights take {need / 1e9:,.1f} GB, more than this {device.type.upper()}'s "
                         f"{have / 1e9:,.1f} GB of memory")


def _run_tp(config: DraftConfig, args) -> int | None:
    """The TP demo of an installed backend (module docstring), or None where
    this machine has too few GPUs or ``--device cpu`` asks for none (the TP1
    demo runs instead)."""
    # The TP demo spawns one rank per CUDA GPU: --device cpu gives it none to spawn.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and args.device != "cpu" else 0
    if gpus < args.tp:
        where = "--device cpu asks for none" if args.device == "cpu" else f"this machine has {gpus}"
        print(f"--tp {args.tp} needs {args.tp} CUDA GPUs and {where}: running the TP1 demo instead")
        shard = shard_draft(DraftModel(config, device="meta"), 0, args.tp)
        target = policy.Target(tp=args.tp, kernels=policy.installed_kernels()).opt_in(frozenset())
        print(f"What a rank of TP{args.tp} would run with the installed backends:")
        print_plan(plan_draft(describe(shard), target))
        return None
    demos = list(entry_points(group=TP_DEMOS_ENTRY_POINTS))
    if not demos:
        raise ValueError(f"--tp {args.tp} needs a backend with a TP demo: pip install ./packages/dspark-comm")
    if args.stock is not None:
        print(f"--stock: the TP{args.tp} demo compares with its own stock path; vLLM's binaries are the TP1 demo's")
    if args.gemv:
        print("--gemv: the one-token GEMV runs at TP1 only (at TP the branch GEMMs feed the all-reduce)")
    return demos[0].load()(config, args.steps, args.block, args.context)


if __name__ == "__main__":
    sys.exit(main())
