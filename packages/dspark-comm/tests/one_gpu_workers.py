"""The rank group on one GPU (``test_comm_one_gpu.py``): 2, 4 or 8 processes
on GPU 0 (``ranks.init_rank(one_gpu=True)``: a gloo group for the set-up
and the references, CUDA IPC between the processes for the mailbox), each
running dspark-comm's own kernels and protocol, not a copy.

How the ranks run: their contexts time-slice the GPU (no MPS), so a kernel
polling for a peer's partial spins until the peer's context gets the GPU;
an exchange takes milliseconds, not microseconds, and this mode shows every
bit, epoch, timeout and race the protocol has on one device's memory, never
NVLink's timing or its ordering between devices.

References are computed in torch from every rank's inputs, gathered over
gloo through the CPU: ``protocol.reference_sum`` in the sum order the
kernel claims (FP32 in rank order: vLLM's custom one-stage all-reduce;
BF16 after each add), with its zero sign (``positive_zero``), and the
boundary as ``dspark_core.spec.layers.residual_boundary`` on that sum. The
helpers of rows and special values are the two-GPU suite's
(``comm_workers``)."""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist
from comm_workers import BF16, FP32, H, _boundary_modules, all_patterns, bad, check_close, random_rows, special_rows

from dspark_comm.tp_draft import gather_through_host as gather

CAPACITY = 16




def check_env(c):
    import os

    return {"world": c.world, "backend": dist.get_backend(), "device": torch.cuda.get_device_name(0),
            "devices": torch.cuda.device_count(), "nvls_env": os.environ.get("NCCL_NVLS_ENABLE"),
            "torch": torch.__version__}


def check_mailbox(c):
    from dspark_comm.protocol import HEADER_BYTES
    from dspark_comm.runtime.group import TorchGroup
    from dspark_comm.runtime.mailbox import Mailbox

    c.group = TorchGroup()
    c.ars = {}
    c.mb = Mailbox(c.group, H, CAPACITY, timeout_s=c.cfg.get("poll_timeout_s", 20.0), backend="cuda_ipc")
    words = c.mb.words()
    return {"backend": c.mb.backend, "bytes": c.mb.layout.total_bytes, "status": c.mb.status(),
            "header_zero": bool((words[: HEADER_BYTES // 4] == 0).all()),
            "data_empty": bool((words[HEADER_BYTES // 4:] == -1).all()),
            "ptrs_distinct": len(set(c.mb.ptrs)) == c.world}


def _allreduce(c, order):
    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.protocol import reference_sum

    ar = MailboxAllReduce(c.mb, order)
    ar.prepare()
    c.ars[order] = ar
    c.group.barrier()
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 1000 + c.rank)
    vs_ref, unwritten, t0 = {}, 0, time.monotonic()
    for m in range(1, CAPACITY + 1):
        x = random_rows(gen, m)
        out = torch.empty_like(x)
        out.view(torch.int16).fill_(0x4B4B)  # a finite poison: an unwritten column shows
        ar.run(x, out)
        ref = reference_sum(gather(x), order)
        vs_ref[m] = bad(out, ref)
        unwritten += int((out.view(torch.int16) == 0x4B4B).sum() - (ref.view(torch.int16) == 0x4B4B).sum())
    c.mb.check()
    return {"vs_reference_sum": vs_ref, "unwritten": unwritten, "ms_per_call": 1e3 * (time.monotonic() - t0) / 16}


def check_allreduce_fp32(c):
    from dspark_core.contracts.constants import FP32_RANK_ORDER

    return _allreduce(c, FP32_RANK_ORDER)


def check_allreduce_bf16(c):
    from dspark_core.contracts.constants import BF16_RANK_ORDER

    return _allreduce(c, BF16_RANK_ORDER)


def check_special(c):
    """Every BF16 pattern, -0.0, the empty marker's words, infinities, NaN,
    subnormals, each rank its own mix, in both orders."""
    from dspark_comm.protocol import reference_sum

    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 77)  # the same on every rank
    patterns, shuffled = all_patterns(), all_patterns(gen)
    neg_zeros = torch.full((8, H), -0.0, dtype=BF16, device="cuda")
    marker = torch.full((8, H), -1, dtype=torch.int16, device="cuda").view(BF16)
    r = c.rank
    cases = {
        "patterns_vs_shuffled": torch.cat([patterns if r == 0 else shuffled, special_rows(gen, r)]),
        "patterns_plus_neg_zero": torch.cat([patterns if r == 0 else neg_zeros, neg_zeros]),
        "marker_words": torch.cat([marker, marker if r % 2 == 0 else patterns]),
        "signed_zeros": torch.cat([neg_zeros, neg_zeros if r % 2 == 0 else torch.zeros_like(neg_zeros)]),
    }
    result = {}
    for order, ar in c.ars.items():
        for name, x in cases.items():
            result[f"{order}/{name}"] = bad(ar.run(x), reference_sum(gather(x), order))
    c.mb.check()
    return {"mismatches": result}


def check_boundary(c):
    from norm_testing import boundary_consts

    from dspark_comm.cutedsl.all_reduce_boundary import AllReduceBoundary
    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary, stock_arch

    shared = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 5)  # weights and streams: replicated
    c.modules = post, conn, pre = _boundary_modules(shared)
    constants = boundary_consts(post, conn, pre, stock_arch("cuda"))
    c.bds = {order: AllReduceBoundary(c.mb, constants, conn.alpha, conn.beta, post.weight, pre.weight, order)
             for order in (FP32_RANK_ORDER, BF16_RANK_ORDER)}
    for bd in c.bds.values():
        bd.prepare(stream_dtypes=(FP32,), store_stream=(True, False))
    c.group.barrier()
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 2000 + c.rank)
    res, differ = {}, 0
    for order, bd in c.bds.items():
        for m in (1, 2, 5, 16):
            x = random_rows(gen, m)
            stream = random_rows(shared, m, FP32)
            new, out = bd.run(x, stream, True)
            exp_new, exp_out = residual_boundary(post, conn, pre, reference_sum(gather(x), order), stream)
            res[f"{order}/m{m}"] = bad(out, exp_out) + bad(new, exp_new)
            outs = gather(out)
            differ += sum(bad(o, outs[0]) for o in outs[1:])
    x = torch.cat([special_rows(gen, c.rank), random_rows(gen, 8)])
    stream = random_rows(shared, x.shape[0], FP32)
    new, out = c.bds[FP32_RANK_ORDER].run(x, stream, True)
    exp_new, exp_out = residual_boundary(post, conn, pre, reference_sum(gather(x), FP32_RANK_ORDER), stream)
    res["special"] = bad(out, exp_out) + bad(new, exp_new)
    c.mb.check()
    return {"mismatches": res, "ranks_differ": differ}


def check_positive_zero(c):
    """The zero-sign option (FlashInfer's Lamport one-shot stock: -0.0 sums
    come out +0.0) in both orders, rows and columns of -0.0 on every rank."""
    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER

    ars = {o: MailboxAllReduce(c.mb, o, positive_zero=True) for o in (FP32_RANK_ORDER, BF16_RANK_ORDER)}
    for ar in ars.values():
        ar.prepare()
    c.group.barrier()
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 3000 + c.rank)
    neg = torch.full((4, H), -0.0, dtype=BF16, device="cuda")
    res, negative = {}, 0
    for m in (1, 5, 16):
        x = torch.cat([neg, special_rows(gen, c.rank), random_rows(gen, m)])[:m]
        x[:, 1::7] = -0.0
        parts = gather(x)
        for order, ar in ars.items():
            out = ar.run(x)
            res[f"{order}/m{m}"] = bad(out, reference_sum(parts, order, positive_zero=True))
            negative += int((out.view(torch.int16) == -32768).sum())
    c.mb.check()
    return {"mismatches": res, "negative_zeros_out": negative}


def check_graphs(c):
    """A CUDA graph of calls of several row counts, replayed on fresh inputs
    (epochs run on across replays): every replay's outputs as the references."""
    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import FP32_RANK_ORDER

    ar = c.ars[FP32_RANK_ORDER]
    rows = (1, 3, 16, 7)
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 4000 + c.rank)
    xs = [random_rows(gen, m) for m in rows]
    outs = [torch.empty_like(x) for x in xs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        for x, o in zip(xs, outs):
            ar.launch(x, o)
    torch.cuda.current_stream().wait_stream(side)
    c.group.barrier()
    res = 0
    for _ in range(c.cfg.get("graph_replays", 4)):
        for x in xs:
            x.copy_(random_rows(gen, x.shape[0]))
        for o in outs:
            o.view(torch.int16).fill_(0x4B4B)
        torch.cuda.synchronize()
        c.group.barrier()
        graph.replay()
        torch.cuda.synchronize()
        res += sum(bad(o, reference_sum(gather(x), FP32_RANK_ORDER)) for x, o in zip(xs, outs))
    c.mb.check()
    return {"mismatches": res}


def check_stress(c):
    """``stress_calls`` calls of random row counts (the same sequence on
    every rank), plain all-reduces and boundaries on one mailbox, random
    per-rank GPU delays before calls; the outputs against references of a
    pool of inputs computed once."""
    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary

    calls = c.cfg.get("stress_calls", 400)
    ar, bd = c.ars[FP32_RANK_ORDER], c.bds[FP32_RANK_ORDER]
    post, conn, pre = c.modules
    pool = 8
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 8000 + c.rank)
    sgen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 12)
    xs = [random_rows(gen, CAPACITY) for _ in range(pool)]
    streams = [random_rows(sgen, CAPACITY, FP32) for _ in range(pool)]
    refs = [reference_sum(gather(x), FP32_RANK_ORDER) for x in xs]
    shared, own = random.Random(c.cfg["seed"] + 11), random.Random(c.cfg["seed"] + 100 + c.rank)
    out = torch.empty((CAPACITY, H), dtype=BF16, device="cuda")
    bad_calls, t0 = 0, time.monotonic()
    c.group.barrier()
    for j in range(calls):
        m, i, kind = shared.randint(1, CAPACITY), shared.randrange(pool), "bd" if j % 4 == 3 else "ar"
        delay = own.choice([0, 0, 0, 2000, 10000, 40000])
        if delay:
            torch.cuda._sleep(delay)
        if kind == "ar":
            ar.run(xs[i][:m], out[:m])
            bad_calls += int(bad(out[:m], refs[i][:m]) > 0)
        else:
            new, y = bd.run(xs[i][:m], streams[i][:m], True)
            exp_new, exp_out = residual_boundary(post, conn, pre, refs[i][:m], streams[i][:m])
            bad_calls += int(bad(y, exp_out) + bad(new, exp_new) > 0)
    torch.cuda.synchronize()
    c.mb.check()
    return {"calls": calls, "bad_calls": bad_calls, "ms_per_call": 1e3 * (time.monotonic() - t0) / calls}


def check_timeout(c):
    """The last rank never arrives (``comm_workers.timeout_probe``: the others
    give up after the poll timeout, a reset recovers), against the reference
    sum of the gathered partials."""
    from comm_workers import timeout_probe

    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import FP32_RANK_ORDER

    return timeout_probe(c, lambda x: reference_sum(gather(x), FP32_RANK_ORDER), c.cfg.get("timeout_probe_s", 0.5))


def check_exact_package(c):
    """The exact package GEMM (``ordered_package``): each rank's shard of
    down (``[H, 16384 / tp]``) on the ordered GEMM, its order checked against
    ``F.linear`` (cuBLAS) at 1, 2, 4, 8 and 16 rows, published into the
    mailbox and consumed by the published all-reduce (FP32 in rank order):
    against ``reference_sum`` of every rank's cuBLAS partial, i.e. vLLM's
    TP branch. Each rank's partials: the check's special probes' kind
    (values spread over 2^-12 .. 2^12) and one row of -0.0, inf, NaN."""
    import torch.nn.functional as F

    from dspark_comm.cutedsl.allreduce import FusedAllReduce, StoreEpilogue
    from dspark_comm.cutedsl.ordered_package import OrderedPackageGemm
    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import FP32_RANK_ORDER
    from dspark_core.runtime import gemm_check

    k = 16384 // c.world
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 3000 + c.rank)
    weight = (torch.randn(H, k, generator=gen, device="cuda") / k**0.5).to(BF16)
    gemm = OrderedPackageGemm("down", weight, c.mb)
    result = gemm.check((1, 2, 4, 8, 16), seed=c.cfg["seed"])
    consume = FusedAllReduce(c.mb, StoreEpilogue(), FP32_RANK_ORDER, published=True)
    consume.prepare()
    bound = sorted(gemm.orders)
    everyone = [None] * c.world
    dist.all_gather_object(everyone, bound)
    common = sorted(set.intersection(*(set(b) for b in everyone)))
    mismatches = {}
    for m in common:
        for name, x in gemm_check.probes(m, k, "cuda", c.cfg["seed"] + 31 * m + c.rank):
            out = torch.empty(m, H, dtype=BF16, device="cuda")
            out.view(torch.int16).fill_(0x4B4B)
            gemm.run(x, publish=True)
            consume.launch(m, None, (out,))
            mismatches[f"m{m}/{name}"] = bad(out, reference_sum(gather(F.linear(x, weight)), FP32_RANK_ORDER))
    c.mb.check()
    return {"bound": bound, "common": common, "refused": {str(m): r for m, r in result.refused.items()},
            "mismatches": mismatches}


CHECKS = [
    ("env", check_env),
    ("mailbox", check_mailbox),
    ("exact_package", check_exact_package),
    ("allreduce_fp32", check_allreduce_fp32),
    ("allreduce_bf16", check_allreduce_bf16),
    ("special", check_special),
    ("boundary", check_boundary),
    ("positive_zero", check_positive_zero),
    ("graphs", check_graphs),
    ("stress", check_stress),
    ("timeout", check_timeout),
    ("close", check_close),
]


def worker(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    from rank_suite import run_checks

    run_checks(rank, world, init_file, out_dir, cfg, CHECKS, needed=("mailbox",), skip=set(cfg.get("skip", ())),
               timeout_s=300.0, one_gpu=True)
