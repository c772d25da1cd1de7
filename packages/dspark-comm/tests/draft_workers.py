"""The TP2 draft end to end on two GPUs, run by ``test_draft_multigpu.py``:
one process per rank (spawn, a file rendezvous, NCCL). WRITTEN, NOT YET RUN
on a device (the session that wrote it had no GPU left).

Each rank builds the reference draft (hidden 8192, seeded, the same bits on
both ranks), takes its shard (``dspark_core.tp.shard_draft``: the stock
forward all-reduces with ``torch.distributed.all_reduce`` over NCCL), a
mailbox over the world group, ``DraftAllReduce`` and the specialized decode
with the QKV front off (the front is equal only up to its projection's
summation order) and no package GEMM (not provided: the branches' GEMMs are
the stock ``linear``). Then, per step of m rows, the stock TP2 forward and
the decode on fresh caches holding a 200-token context (the stock chain vs
the decode's), compared bit for bit (NaN payloads excepted): the outputs and
every layer's cache. Results go to ``rank<r>.json``."""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

H = 8192
ROWS = (1, 2, 7, 16)
CONTEXT = 200  # context tokens stored before each step (16 blocks of 16 slots hold 256)


def _record(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _check(rank: int, world: int, cfg: dict) -> dict:
    from dspark_comm.draft import DraftAllReduce
    from dspark_comm.group import TorchGroup
    from dspark_comm.mailbox import Mailbox
    from dspark_core.compare import mismatches
    from dspark_core.config import DraftConfig
    from dspark_core.model import DraftModel, StepInputs
    from dspark_core.plan import plan_draft
    from dspark_core.tp import shard_draft
    from dspark_cute.decode import build_draft_decode, device_target

    dev = torch.device("cuda", rank)
    out: dict = {"rank": rank}
    t0 = time.monotonic()
    model = DraftModel(DraftConfig(num_layers=cfg.get("layers", 2))).to(dev)
    shard = shard_draft(model, rank, world)  # stock: NCCL all-reduce
    del model
    torch.cuda.empty_cache()
    out["build_s"] = round(time.monotonic() - t0, 2)

    group = TorchGroup()
    mailbox = Mailbox(group, H, 16, timeout_s=5.0)
    exclude = frozenset({"qkv_front", "package_gemm"})
    target = device_target(dev, world)
    plan = plan_draft(shard, target.replace(kernels=target.kernels - exclude))
    out["plan"] = plan.format()
    out["all_reduce_fused"] = plan.all_reduce.fused
    out["refused"] = plan.refused()
    adapter = DraftAllReduce(mailbox, plan, shard, rank)
    decode = build_draft_decode(shard, all_reduce=adapter, exclude=exclude)
    if decode is None:
        raise RuntimeError("build_draft_decode returned None on a GPU")
    out["fused_parts"] = list(decode.plan.fused_count())

    def bad(a, b) -> int:
        return int(mismatches(a, b).sum())

    cases = [(m, torch.bfloat16) for m in ROWS] + [(7, torch.float32), (17, torch.bfloat16)]
    mism: dict = {}
    for m, dtype in cases:
        gen = torch.Generator(device=dev).manual_seed(1000 + m)
        hidden = torch.randn(m, H, generator=gen, device=dev).to(dtype)
        step = StepInputs.block(CONTEXT, m, device=dev, span=CONTEXT + 32)
        ref_caches, got_caches = shard.make_caches(16, dev), shard.make_caches(16, dev)
        # A context first: the stock chain on the stock path, the decode's
        # (fused where planned) on the other.
        ctx_states = torch.randn(CONTEXT, H, generator=gen, device=dev).bfloat16()
        ctx_pos = torch.arange(CONTEXT, device=dev)
        shard.precompute_and_store_context_kv(ctx_states, ctx_pos, ref_caches, ctx_pos)
        out["context_fused"] = decode.store_context_kv(ctx_states, ctx_pos, got_caches, ctx_pos)
        if not out["context_fused"]:
            shard.precompute_and_store_context_kv(ctx_states, ctx_pos, got_caches, ctx_pos)
        with torch.no_grad():
            ref = shard(hidden, step, ref_caches)
            got = decode.run(hidden, step, got_caches)
        torch.cuda.synchronize()
        key = f"m{m}_{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
        mism[key] = bad(got, ref) + sum(bad(g.tensor, r.tensor) for g, r in zip(got_caches, ref_caches))
        # Both ranks hold the same output.
        other = got.clone()
        dist.broadcast(other, src=0)
        mism[key + "_vs_rank0"] = bad(got, other)
    out["mismatches"] = mism

    # A CUDA graph of one fused step (m = 7), replayed: the same bits as eager.
    m = 7
    gen = torch.Generator(device=dev).manual_seed(77)
    hidden = torch.randn(m, H, generator=gen, device=dev).bfloat16()
    step = StepInputs.block(0, m, device=dev, span=16)
    caches = shard.make_caches(4, dev)
    with torch.no_grad():
        eager = decode.run(hidden, step, caches).clone()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            decode.run(hidden, step, caches)  # warm up off the default stream
        torch.cuda.current_stream(dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = decode.run(hidden, step, caches)
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    out["graph_mismatches"] = bad(static, eager)
    mailbox.check()
    out["status"] = mailbox.status()
    mailbox.close()
    return out


def worker(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v  # multicast stays off on these machines
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank), timeout=timedelta(seconds=120))
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        result = _check(rank, world, cfg)
        result["ok"] = True
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()[-4000:]}
    _record(path, result)
    print(f"[rank {rank}] {json.dumps(result, default=str)[:2000]}", flush=True)
    dist.destroy_process_group()
