"""TP2 benchmark of the fused all-reduce boundary (two GPUs, one process each).

For m in {1, 4, 16, 64} rows of H = 8192, each case timed in a CUDA graph of
``--iters`` back-to-back calls (median over ``--reps`` replays, both ranks
released together by a barrier before each replay; the table shows the
slower rank's median per call):

- ``fused all-reduce + boundary``: ``dspark_comm.AllReduceBoundary`` (one kernel);
- ``NCCL all-reduce + boundary``: ``torch.distributed.all_reduce`` then
  ``dspark_cute.DraftBoundary``;
- ``symm-mem one-shot + boundary``: ``torch.ops.symm_mem.one_shot_all_reduce_out``
  (PyTorch symmetric memory, multicast off) then ``DraftBoundary``;
- the three all-reduces alone (the mailbox with its plain BF16 epilogue).

The mailbox here holds 64 rows (``capacity=64``) so that m = 64 runs fused
too; the draft's default capacity is 16 (``MAX_DECODE_ROWS``). Writes
``allreduce_boundary_tp2.md`` and ``allreduce_boundary_tp2.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

H = 8192
ROWS = (1, 4, 16, 64)
TARGET_US = 6.0
CASES = [
    ("fused all-reduce + boundary", "fused"),
    ("NCCL all-reduce + boundary", "nccl_bd"),
    ("symm-mem one-shot + boundary", "symm_bd"),
    ("mailbox all-reduce alone", "mailbox"),
    ("NCCL all-reduce alone", "nccl"),
    ("symm-mem one-shot alone", "symm"),
]


def _calls(m, gen, group, fused, plain, unfused, symm, one_shot) -> dict:
    """The timed call of each case over ``m`` rows (operands allocated once)."""
    x = (torch.randn((m, H), generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    stream = torch.randn((m, H), generator=gen, device="cuda")
    out = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
    new = torch.empty((m, H), dtype=torch.float32, device="cuda")
    ar_out = torch.empty_like(out)
    scratch = x.clone()  # NCCL reduces in place (its values grow; the timing does not)
    name = group.group_name
    if symm is None:
        sx = None

        def one_shot(*args):
            raise RuntimeError("no symmetric memory")
    else:
        sx = symm[: m * H].view(m, H)
        sx.copy_(x)
    return {
        "fused": lambda: fused.run(x, stream, True, out, new),
        "nccl_bd": lambda: (dist.all_reduce(scratch), unfused.run(scratch, stream, True, out, new)),
        "symm_bd": lambda: (one_shot(sx, "sum", name, ar_out), unfused.run(ar_out, stream, True, out, new)),
        "mailbox": lambda: plain.run(x, ar_out),
        "nccl": lambda: dist.all_reduce(scratch),
        "symm": lambda: one_shot(sx, "sum", name, ar_out),
    }


def _worker(rank: int, world: int, init: str, out: str, iters: int, reps: int) -> None:
    from dspark_comm.runtime.ranks import init_rank, record_case

    init_rank(rank, world, init, timeout_s=60.0)
    import torch.distributed._symmetric_memory as symm_mem

    from dspark_comm.cutedsl.all_reduce_boundary import AllReduceBoundary
    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.runtime.group import TorchGroup
    from dspark_comm.runtime.mailbox import Mailbox
    from dspark_comm.tp_draft import time_replays
    from dspark_core.contracts.constants import boundary_constants
    from dspark_core.reference.adapter import norm_description
    from dspark_core.runtime import description as D
    from dspark_core.spec.layers import GatedResidual, RMSNorm, stock_arch
    from dspark_core.tools.timing import capture
    from dspark_cute.cutedsl.norms.boundary import DraftBoundary

    group = TorchGroup()
    mb = Mailbox(group, H, max(ROWS), timeout_s=5.0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    post = RMSNorm(H, weight_dtype=torch.bfloat16).cuda()
    pre = RMSNorm(H, weight_dtype=torch.bfloat16).cuda()
    conn = GatedResidual(H).cuda()
    # The constants as the planner builds them, with the device's stock tree.
    described = D.Boundary("the boundary", norm_description("the post-norm", post, H),
                           D.Connection("the connection", conn, conn.alpha, conn.beta),
                           norm_description("the pre-norm", pre, H))
    c = boundary_constants(described, H, stock_arch("cuda"))
    fused = AllReduceBoundary(mb, c, conn.alpha, conn.beta, post.weight, pre.weight)
    plain = MailboxAllReduce(mb)
    unfused = DraftBoundary(c, conn.alpha, conn.beta, post.weight, pre.weight)
    try:
        symm = symm_mem.empty(max(ROWS) * H, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(symm, group.group_name)
        one_shot = torch.ops.symm_mem.one_shot_all_reduce_out
    except Exception as e:  # its cases report the failure
        print(f"rank {rank}: PyTorch symmetric memory is not available: {e}")
        symm, one_shot = None, None
    results = {}
    for m in ROWS:
        fns = _calls(m, gen, group, fused, plain, unfused, symm, one_shot)
        for _, key in CASES:
            record_case(results, f"{key}/{m}",
                        lambda fn=fns[key]: time_replays(capture(fn, iters, side_stream=True), reps, calls=iters))
            mb.check()
    gathered = group.all_gather_object(results)
    if rank == 0:
        with open(os.path.join(out, "raw.json"), "w") as f:
            json.dump(gathered, f, indent=1)
    mb.close()
    dist.destroy_process_group()


def _report(raw: list[dict], out: str) -> str:
    from dspark_comm.runtime.ranks import slower_rank

    lines = [
        "TP2 on two H200s (NVLink), H = 8192, BF16 partials, FP32 rank-order sum; microseconds per "
        "call, median of CUDA-graph replays, the slower rank.",
        "",
        "| case | " + " | ".join(f"m = {m}" for m in ROWS) + " |",
        "| --- |" + " --- |" * len(ROWS),
    ]
    series = {}
    for label, key in CASES:
        row = []
        for m in ROWS:
            value, text = slower_rank(raw, f"{key}/{m}")
            row.append(text)
            series.setdefault(label, []).append(value)
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    fused = series[CASES[0][0]]
    met = all(v is not None and v <= TARGET_US for m, v in zip(ROWS, fused) if m <= 16)
    lines += ["", f"Target: fused all-reduce + boundary at m <= 16 in <= {TARGET_US} us: "
              + ("met" if met else "not met") + "."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "allreduce_boundary_tp2.md"), "w") as f:
        f.write(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, values in series.items():
            pts = [(m, v) for m, v in zip(ROWS, values) if v is not None]
            style = "-o" if "boundary" in label else "--x"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.axhline(TARGET_US, color="grey", lw=0.8, ls=":", label=f"target {TARGET_US} us (m <= 16)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ROWS, [str(m) for m in ROWS])
        ax.set_xlabel("rows m")
        ax.set_ylabel("us per call")
        ax.set_title("TP2 all-reduce + residual boundary, H = 8192 (2x H200)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "allreduce_boundary_tp2.png"), dpi=120)
    except ImportError:
        text += "\n(matplotlib is not installed: no plot)\n"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before the ranks are killed")
    args = parser.parse_args()
    from dspark_comm.runtime.ranks import tp2_benchmark

    logging.basicConfig(level=logging.INFO, format="%(message)s")

    raw, status = tp2_benchmark("the TP2 all-reduce boundary benchmark", _worker, args.out, "raw.json", args.out,
                                args.iters, args.reps, timeout_s=args.timeout)
    if raw is not None:
        print(_report(raw, args.out))
    return status


if __name__ == "__main__":
    sys.exit(main())
