"""The TP2 draft end to end on two GPUs, run by ``test_draft_multigpu.py``:
one process per rank (``rank_suite``: spawn, a file rendezvous, NCCL), each
check's result recorded in ``rank<r>.json`` as it ends.

Each rank builds ``dspark_comm.tp_draft.TPDraftRank``: the reference draft
(hidden 8192, seeded, the same bits on both ranks), its shard (the stock
forward all-reduces with ``torch.distributed.all_reduce`` over NCCL) and a
mailbox of 16 rows over the world group. Two specialized decodes share them:

- the **bitwise** decode, every installed kernel but the package GEMM
  (``BITWISE_EXCLUDE``: it sums its projection in its own order, so it is
  exact only up to it): the fused all-reduce boundaries,
  the fused first norm and context chain, and whatever else the installed
  backends advertise as bit for bit;
- the **package** decode, everything (``PACKAGE_EXCLUDE`` empty):
  the same, with each layer's o_proj and down_proj on the package GEMM
  publishing its partial into the mailbox.

``DSPARK_DRAFT_TP_EXCLUDE`` (comma-separated kernel names) excludes more from
both, to isolate a failure.

Checks, in order:

- ``setup``: the rank, the bitwise decode and its plan;
- ``bitwise``: per step of m rows, the stock TP2 forward and the bitwise
  decode on fresh caches holding a 200-token context (the stock chain vs the
  decode's), mismatches counted bit for bit (NaN payloads excepted): the
  outputs and every layer's cache, and this rank's output against rank 0's;
- ``graph``: a CUDA graph of one bitwise step (m = 7) replayed 3 times
  against the eager step;
- ``package_setup``: the package decode; its plan's package GEMM parts and
  which boundaries the adapter bound a package GEMM to;
- ``greedy``: ``tp_draft.greedy``, 64 single-token steps of the package
  decode beside the stock TP2 forward after the 200-token context, the stock
  token fed to both (teacher forcing), the LM head's argmax compared per
  step, each step classed decisive or a near tie by its stock top-two
  margin (``MARGIN``); every rank's tokens (both paths') gathered;
- ``package_graph``: a CUDA graph of one package step (m = 7) replayed 3
  times against the eager step;
- ``close``: the mailbox checked (healthy) and closed.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dspark_core.planner.policy import PACKAGE_GEMM

H = 8192
ROWS = (1, 2, 7, 16)
CONTEXT = 200  # context tokens stored before each step (16 blocks of 16 slots hold 256)
GREEDY_STEPS = 64
GREEDY_SPAN = CONTEXT + GREEDY_STEPS + 8
# The rule of dspark-cute's single-GPU greedy test: logits here are about
# N(0, 1); a step whose stock top-two logits lie within MARGIN is a near tie
# (about a third of the steps), exempt but counted; every other step must
# agree, and at least DECISIVE_MIN of the 64 must be decisive.
MARGIN = 0.1
DECISIVE_MIN = 32
BITWISE_EXCLUDE = frozenset({PACKAGE_GEMM})
PACKAGE_EXCLUDE: frozenset[str] = frozenset()


def _extra_exclude(c) -> frozenset:
    return frozenset(c.cfg.get("exclude", ()))


def bad(a, b) -> int:
    from dspark_core.tools.compare import mismatches

    return int(mismatches(a, b).sum())


def check_setup(c):
    from dspark_comm.tp_draft import TPDraftRank
    from dspark_core.reference.config import DraftConfig

    one_gpu = bool(c.cfg.get("one_gpu"))
    c.tp = TPDraftRank(c.rank, c.world, DraftConfig(num_layers=c.cfg.get("layers", 2)), capacity=16,
                       timeout_s=30.0 if one_gpu else 5.0, one_gpu=one_gpu)
    c.decode, c.adapter = c.tp.decode(BITWISE_EXCLUDE | _extra_exclude(c))
    plan = c.decode.plan
    return {"build_s": c.tp.build_s, "plan": plan.format(), "all_reduce_fused": plan.all_reduce.fused,
            "refused": plan.refused(), "fused_parts": list(plan.fused_count()),
            "package_gemms_bound": sum(g is not None for g in c.adapter.gemms)}


def _from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` (NCCL on the GPU, gloo through the CPU)."""
    if dist.get_backend() == "gloo":
        host = t.detach().cpu()
        dist.broadcast(host, src=0)
        return host.to(t.device)
    other = t.clone()
    dist.broadcast(other, src=0)
    return other


def check_bitwise(c, decode=None):
    from dspark_core.reference.model import StepInputs

    shard, decode, dev = c.tp.shard, decode or c.decode, c.tp.device
    cases = [(m, torch.bfloat16) for m in ROWS] + [(7, torch.float32), (17, torch.bfloat16)]
    mism: dict = {}
    for m, dtype in cases:
        gen = torch.Generator(device=dev).manual_seed(c.cfg["seed"] + 1000 + m)
        hidden = torch.randn(m, H, generator=gen, device=dev).to(dtype)
        step = StepInputs.block(CONTEXT, m, device=dev, span=CONTEXT + 32)
        # A context first: the stock chain on the stock path, the decode's
        # (fused where planned) on the other.
        context = c.tp.context(CONTEXT, c.cfg["seed"] + 2000 + m)
        ref_caches = c.tp.caches(context, CONTEXT + 32)
        got_caches = c.tp.caches(context, CONTEXT + 32, decode)
        with torch.no_grad():
            ref = shard(hidden, step, ref_caches)
            got = decode.run(hidden, step, got_caches)
        torch.cuda.synchronize()
        key = f"m{m}_{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
        mism[key] = bad(got, ref) + sum(bad(g.tensor, r.tensor) for g, r in zip(got_caches, ref_caches))
        # Every rank holds the same output.
        mism[key + "_vs_rank0"] = bad(got, _from_rank0(got))
    return {"mismatches": mism}


def _graph_mismatches(c, decode, seed: int) -> int:
    """A CUDA graph of one step (m = 7) of ``decode`` (``StepGraph``), its
    output poisoned, then replayed 3 times: the output's mismatches against
    the eager step's (the same inputs, caches)."""
    from dspark_core.reference.model import StepInputs
    from dspark_core.tools.graphs import StepGraph

    dev = c.tp.device
    m = 7
    gen = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(m, H, generator=gen, device=dev).bfloat16()
    step = StepInputs.block(0, m, device=dev, span=16)
    caches = c.tp.shard.make_caches(4, dev)
    with torch.no_grad():
        eager = decode.run(hidden, step, caches).clone()
        graph = StepGraph(decode.run, hidden, step, caches, warmup=1)
        graph.output.fill_(7.0)  # poisoned: an element the replays do not write shows
        for _ in range(3):
            static = graph.replay()
    torch.cuda.synchronize()
    return bad(static, eager)


def check_graph(c):
    mismatches = _graph_mismatches(c, c.decode, c.cfg["seed"] + 77)
    c.tp.mailbox.check()
    return {"graph_mismatches": mismatches, "status": c.tp.mailbox.status()}


def check_package_setup(c):
    c.pdecode, c.padapter = c.tp.decode(PACKAGE_EXCLUDE | _extra_exclude(c))
    plan = c.pdecode.plan
    return {"plan": plan.format(), "refused": plan.refused(),
            "package_gemms": [{"name": p.name, "fused": p.fused, "reason": p.reason,
                               "role": getattr(p.constants, "role", None)} for p in plan.package_gemms],
            "bound": [g is not None for g in c.padapter.gemms]}


def check_greedy(c):
    from dspark_comm.tp_draft import greedy

    context = c.tp.context(CONTEXT, c.cfg["seed"] + 3000)
    stock_caches = c.tp.caches(context, GREEDY_SPAN)
    fused_caches = c.tp.caches(context, GREEDY_SPAN, c.pdecode)
    first = torch.tensor([11], device=c.tp.device)
    res = greedy(c.tp.shard, c.tp.shard.forward, c.pdecode.run, stock_caches, fused_caches, first, CONTEXT,
                 GREEDY_STEPS, GREEDY_SPAN, MARGIN)
    res["all_tokens"] = c.tp.group.all_gather_object([res["tokens"], res["fused_tokens"]])
    return res


def check_package_graph(c):
    mismatches = _graph_mismatches(c, c.pdecode, c.cfg["seed"] + 78)
    c.tp.mailbox.check()
    return {"graph_mismatches": mismatches, "status": c.tp.mailbox.status()}


def check_exact_setup(c):
    """The decode with the ordered GEMM opt-in and without the package GEMM:
    each layer's o_proj and down_proj on the exact package GEMM (bound where
    every rank's check against cuBLAS found the order), QKV and gate_up on
    the ordered GEMM where its check binds."""
    c.edecode, c.eadapter = c.tp.decode(BITWISE_EXCLUDE | _extra_exclude(c), ordered_gemm=True)
    plan = c.edecode.plan
    return {"plan": plan.format(), "exact": sorted(c.eadapter.exact),
            "exact_rows": [sorted(r) for r in c.eadapter.exact_rows],
            "roles": [getattr(p.constants, "role", None) for p in plan.package_gemms]}


def check_exact_bitwise(c):
    return check_bitwise(c, c.edecode)


def check_exact_graph(c):
    mismatches = _graph_mismatches(c, c.edecode, c.cfg["seed"] + 79)
    c.tp.mailbox.check()
    return {"graph_mismatches": mismatches, "status": c.tp.mailbox.status()}


def check_plugin(c):
    """dspark-vllm's TP binding (``allreduce.MailboxBoundaries``, what the
    plugin builds on vLLM's TP group) over this gloo group: the order of
    vLLM's custom all-reduce (``decode_order`` with FlashInfer's off: FP32
    in rank order, steps of 1 to 16 rows), the ranks' agreement step (an
    order that differs on one rank is a ValueError on every rank), the
    decode over it bit for bit the stock TP forward (m = 17 takes the stock
    all-reduce, vLLM's path for rows it does not take), ``check()`` at a
    sync point and ``poll()`` healthy."""
    import dataclasses
    from types import SimpleNamespace

    from dspark_comm.runtime.group import TorchGroup
    from dspark_comm.runtime.mailbox import Mailbox
    from dspark_comm.tp_draft import rank_order_all_reduce
    from dspark_core.reference.adapter import describe
    from dspark_core.runtime.build import build_draft_decode, draft_plan
    from dspark_core.spec.layers import linear
    from dspark_vllm.allreduce import MailboxBoundaries, Switches, Topology, decode_order

    order = decode_order(c.world, "sm_90a", H, 16, Switches(flashinfer=False), False, Topology(False, True))
    shard = c.tp.shard
    draft = describe(shard)
    exclude = BITWISE_EXCLUDE | _extra_exclude(c)
    plan = draft_plan(draft, c.world, exclude)
    model = SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(o_proj=layer.self_attn.o_proj),
                                                    feed_forward=SimpleNamespace(down_proj=layer.mlp.down))
                                    for layer in shard.layers])
    group = TorchGroup()

    def gemm(weight, x):
        return linear(x, weight)

    res = {"order": str(order), "rows": order.rows}
    other = dataclasses.replace(order, rows=order.rows - 1) if c.rank == 0 else order
    try:
        MailboxBoundaries(model, draft, plan, other, branch_gemm=gemm, group=group, mailbox=c.tp.mailbox)
        res["disagreement"] = None
    except ValueError as e:
        res["disagreement"] = str(e)
    mailbox = Mailbox(group, H, order.rows, timeout_s=c.tp.mailbox.timeout_s)
    try:
        binding = MailboxBoundaries(model, draft, plan, order, branch_gemm=gemm, group=group, mailbox=mailbox,
                                    reduce=rank_order_all_reduce)
        decode = build_draft_decode(draft, all_reduce=binding, exclude=exclude)
        binding.check()  # after the build's agreement: a sync point
        res["takes"] = {m: binding.takes(torch.empty(m, H, device=c.tp.device)) for m in (1, 16, 17)}
        res.update(check_bitwise(c, decode))
        binding.poll()
        torch.cuda.synchronize()
        binding.poll()
        binding.check()
        res["status"] = mailbox.status()
    finally:
        mailbox.close()
    return res


def check_close(c):
    return {"status": c.tp.close()}


CHECKS = [("setup", check_setup), ("bitwise", check_bitwise), ("graph", check_graph),
          ("package_setup", check_package_setup), ("greedy", check_greedy),
          ("package_graph", check_package_graph), ("close", check_close)]
# As ranks on one GPU: the bitwise decode and the exact package GEMM's, against
# the stock forward whose all-reduce is vLLM's custom one-stage order.
ONE_GPU_CHECKS = [("setup", check_setup), ("bitwise", check_bitwise), ("graph", check_graph),
                  ("exact_setup", check_exact_setup), ("exact_bitwise", check_exact_bitwise),
                  ("exact_graph", check_exact_graph), ("plugin", check_plugin), ("close", check_close)]


def worker(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    from rank_suite import run_checks

    def cleanup(c, results) -> None:
        tp = getattr(c, "tp", None)
        if tp is not None and not tp.mailbox.closed:
            tp.mailbox.close()

    if cfg.get("one_gpu"):
        run_checks(rank, world, init_file, out_dir, cfg, ONE_GPU_CHECKS, needed=("setup", "exact_setup"),
                   cleanup=cleanup, timeout_s=600.0, one_gpu=True)
        return
    # Nothing runs without the rank; the package checks need the package decode.
    run_checks(rank, world, init_file, out_dir, cfg, CHECKS, needed=("setup", "package_setup"), cleanup=cleanup)


def config_from_env() -> dict:
    """The suite's settings: ``DSPARK_DRAFT_TP_LAYERS`` (default 2) and
    ``DSPARK_DRAFT_TP_EXCLUDE``."""
    exclude = [k for k in os.environ.get("DSPARK_DRAFT_TP_EXCLUDE", "").split(",") if k]
    return {"layers": int(os.environ.get("DSPARK_DRAFT_TP_LAYERS", "2")), "exclude": exclude}
