"""The TP2 demo (``python -m dspark_core.demo --tp 2``): the reference draft
sharded over two GPUs of this host, one spawned process per rank
(``dspark_comm.ranks``), each rank a ``dspark_comm.tp_draft.TPDraftRank``.

Rank 0 prints the TP2 plan of a rank's shard with every reason. Both ranks
store a context's K/V (random BF16 hidden states, seeded) and run greedy
decode steps (``tp_draft.greedy``: the stock TP2 forward's tokens fed to both
paths, teacher forcing) of two specialized decodes beside the stock TP2 forward
(``TPDraftModel.forward``, NCCL all-reduce):

- **package GEMM off** (the branch GEMMs on cuBLAS): every fused part is
  bit for bit the stock layers, so the
  demo says whether the hidden states of every step are bit for bit equal
  and whether the tokens are;
- **package GEMM on**: o_proj and down_proj on the package GEMM, which sums
  in its own order (within its stated bound), so the demo says at which
  steps the tokens are equal, whether any that differ was a near tie (stock
  top-two logits within ``MARGIN``) and how many hidden-state elements
  differ.

Per path it prints the eager wall time of a greedy step (rank 0's median)
and the step time as the median of whole-step CUDA graph replays
(``StepGraph``) with both ranks released together before each, the slower
rank's. Rank 0 prints everything; the ranks' tokens are compared too.
"""

from __future__ import annotations

import json
import logging
import sys

import torch

WORLD = 2
MARGIN = 0.1  # the stock top-two logit gap below which a flipped token is a near tie (the tests' rule)


def _worker(rank: int, world: int, init_file: str, config_json: str, steps: int, block: int,
            context: int) -> None:
    from dspark_comm.runtime.ranks import finish_rank, init_rank

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank {rank}] %(name)s: %(message)s")
    init_rank(rank, world, init_file)
    torch.set_grad_enabled(False)  # inference only (the stock forward's graphs too)
    try:
        _demo(rank, world, config_json, steps, block, context)
    finally:
        finish_rank()


def _demo(rank: int, world: int, config_json: str, steps: int, block: int, context: int) -> None:
    from dspark_comm.tp_draft import PACKAGE_GEMM, TPDraftRank, greedy
    from dspark_core.planner.cli import print_plan
    from dspark_core.reference.config import DraftConfig

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    config = DraftConfig.from_dict(json.loads(config_json))
    tp = TPDraftRank(rank, world, config)
    say(f"built the reference draft ({config.num_layers} layers, hidden {config.hidden_size}) and rank 0's "
        f"TP{world} shard on {tp.device} in {tp.build_s:.1f} s")
    off = {PACKAGE_GEMM}
    paths = {"package GEMM off": tp.decode(off)[0], "package GEMM on": tp.decode(off - {PACKAGE_GEMM})[0]}
    if rank == 0:
        print_plan(paths["package GEMM on"].plan)
    gen = torch.Generator().manual_seed(config.seed + 1)
    first = torch.randint(0, config.vocab_size, (block,), generator=gen).to(tp.device)
    ctx = tp.context(context, config.seed + 2)
    span = context + (steps + 1) * block
    times = {"stock TP2": _step_time(tp, tp.shard.forward, ctx, span, block, context + steps * block)}
    for name, decode in paths.items():
        res = greedy(tp.shard, tp.shard.forward, decode.run, tp.caches(ctx, span), tp.caches(ctx, span, decode),
                     first, context, steps, span, MARGIN)
        times[name] = _step_time(tp, decode.run, ctx, span, block, context + steps * block)
        ranks_tokens = tp.group.all_gather_object(res["tokens"])
        say(f"specialized, {name}: {res['steps']} greedy steps of {block} token(s) beside the stock TP2 forward")
        for i, t in enumerate(res["tokens"]):
            say(f"  step {i}: {t}")
        if not res["differ"]:
            tokens = f"tokens equal at all {steps} steps"
        else:
            flips = ", ".join(f"step {i} (stock top-two margin {gap:.4f})" for i, gap in res["differ"])
            decisive = res["decisive"] - res["decisive_agreed"]
            tokens = (f"tokens equal at {res['agreed']} of {steps} steps, differ at {flips}: "
                      + ("all near ties" if decisive == 0 else f"{decisive} of them decisive")
                      + f" (margin {MARGIN})")
        if res["hidden_mismatches"] == 0:
            hidden = f"hidden states bit for bit equal at all {steps} steps"
        else:
            hidden = f"hidden states NOT bit for bit: {res['hidden_mismatches']} elements differ over {steps} steps"
        why = ""
        if name == "package GEMM on" and res["hidden_mismatches"]:
            why = " (expected: the package GEMM sums in its own order)"
        same = all(t == ranks_tokens[0] for t in ranks_tokens)
        say(f"  vs stock TP2: {hidden}{why}; {tokens}; both ranks' tokens {'equal' if same else 'DIFFER'}")
        say(f"  eager wall time per step (median, rank 0, synced): stock TP2 {res['step_ms']['stock']:.2f} ms, "
            f"specialized {res['step_ms']['fused']:.2f} ms")
    status = tp.close()
    slow = {k: max(v) for k, v in zip(times, zip(*tp.group.all_gather_object(list(times.values()))))}
    say(f"step time ({block} token(s), whole-step CUDA graph, median, slower rank):")
    for name, us in slow.items():
        say(f"  {name:<18} {us:8.1f} us" + (f"  ({slow['stock TP2'] / us:.2f}x the stock TP2 step)"
                                             if name != "stock TP2" else ""))
    say(f"mailbox status at the end: {status} (0: healthy)")


def _step_time(tp, fn, ctx, span: int, block: int, start: int) -> float:
    """Microseconds per step of ``fn`` as a whole-step CUDA graph (median of
    50 replays, the ranks released together; collective)."""
    from dspark_comm.tp_draft import time_replays
    from dspark_core.reference.model import StepInputs
    from dspark_core.tools.graphs import StepGraph

    caches = tp.caches(ctx, span)
    x = tp.shard.embed_tokens(torch.zeros(block, dtype=torch.int64, device=tp.device))
    graph = StepGraph(fn, x, StepInputs.block(start, block, tp.device, span=span), caches)
    return time_replays(graph.replay, 50)


def run_tp2_demo(config, steps: int, block: int, context: int, timeout_s: float = 600.0) -> int:
    """Spawn the two ranks of the demo (module docstring); 0 where both ended
    cleanly, else 1 with the reason printed. ValueError for bad arguments."""
    from dspark_comm.runtime.ranks import spawn_ranks
    from dspark_core.reference.tp import check_tp

    check_tp(config, WORLD)
    if steps < 1 or context < 1 or not 1 <= block <= 16:
        raise ValueError(f"steps {steps} and context {context} are at least 1, block {block} in [1, 16]")
    if torch.cuda.device_count() < WORLD:
        raise ValueError(f"the TP{WORLD} demo needs {WORLD} CUDA GPUs; this machine has {torch.cuda.device_count()}")
    print(f"spawning {WORLD} ranks (one process per GPU, NCCL)", flush=True)
    config_json = config.to_json()
    error = spawn_ranks(_worker, WORLD, config_json, steps, block, context, timeout_s=timeout_s)
    if error is not None:
        print(f"the TP{WORLD} demo did not finish: {error}", file=sys.stderr)
        return 1
    return 0


__all__ = ["run_tp2_demo"]
