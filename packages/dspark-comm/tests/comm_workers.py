"""The two-GPU suite of dspark-comm, run by ``test_comm_multigpu.py``: one
process per rank (torch.multiprocessing spawn, a file rendezvous on
localhost, NCCL), every check in one pair of processes so the kernels
compile once. Each check records a JSON result per rank after it ends (a
crash or a kill keeps the earlier ones); the tests assert on them.

The frame (recording, spawning) is ``rank_suite``. A check computes
mismatch counts without raising where it can, so both ranks stay in the
same sequence of collectives; "bit for bit" is
``dspark_core.tools.compare.mismatches`` (NaN equals NaN, every other pattern
exact)."""

from __future__ import annotations

import logging
import os
import random
import time

import torch
import torch.distributed as dist

H = 8192
CAPACITY = 16
BF16, FP32 = torch.bfloat16, torch.float32


def nccl(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def bad(a: torch.Tensor, b: torch.Tensor) -> int:
    from dspark_core.tools.compare import mismatches

    return int(mismatches(a, b).sum())


def random_rows(gen: torch.Generator, m: int, dtype=BF16) -> torch.Tensor:
    """Normal values scaled by 2^-12 .. 2^12 per element (roundings matter)."""
    x = torch.randn((m, H), generator=gen, device="cuda")
    scale = torch.randint(-12, 13, (m, H), generator=gen, device="cuda").float()
    return (x * torch.exp2(scale)).to(dtype)


def all_patterns(gen: torch.Generator | None = None) -> torch.Tensor:
    """The 65536 BF16 bit patterns as 8 rows of H (shuffled with ``gen``)."""
    p = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
    if gen is not None:
        p = p[torch.randperm(p.numel(), generator=gen, device="cuda")]
    return p.view(BF16).reshape(8, H)


def special_rows(gen: torch.Generator, rank: int) -> torch.Tensor:
    """8 rows of special values (different per rank): zeros of both signs,
    subnormals, infinities, a NaN, the 0xFFFF pair (the empty marker's
    pattern), huge and tiny values."""
    col = torch.arange(H, device="cuda", dtype=FP32)
    normal = torch.sin(col * (0.37 + rank)) * 3.0
    fin = torch.finfo(BF16)
    rows = torch.empty((8, H), device="cuda", dtype=FP32)
    rows[0] = -0.0 if rank == 0 else 0.0
    rows[1] = torch.where(col % 2 == 0, fin.smallest_normal / 4, -fin.smallest_normal / 8)
    rows[2] = normal
    rows[2, 5 + rank] = float("inf")
    rows[3] = normal
    rows[3, H - 1] = float("-inf") if rank else float("inf")
    rows[4] = torch.where(col % 3 == 0, -0.0, normal)
    rows[5] = fin.max / 2 * torch.sign(normal + 0.5)
    rows[6] = fin.smallest_normal * (3 + rank)
    rows[7] = normal
    out = rows.to(BF16)
    out[7, 100 + rank] = float("nan")
    # Whole words equal to the marker (two 0xFFFF NaNs) and lone 0xFFFF halves.
    bits = out.view(torch.int16)
    bits[7, 0:2] = -1
    bits[7, 2 + 2 * rank] = -1
    bits[1, 64:128] = -1 if rank == 1 else 0
    return out


# ---------------------------------------------------------------- checks


def check_env(c):
    info = {
        "devices": torch.cuda.device_count(),
        "name": torch.cuda.get_device_name(c.rank),
        "capability": list(torch.cuda.get_device_capability(c.rank)),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "peer_access": torch.cuda.can_device_access_peer(c.rank, 1 - c.rank),
        "nvls_env": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    try:
        import cupy  # noqa: F401

        info["cupy"] = True
    except Exception:
        info["cupy"] = False
    return info


def check_mailbox(c):
    from dspark_comm.protocol import HEADER_BYTES
    from dspark_comm.runtime.group import TorchGroup
    from dspark_comm.runtime.mailbox import Mailbox

    c.group = TorchGroup()
    c.ars = {}  # the fused all-reduces per sum order (_allreduce)
    c.mb = Mailbox(c.group, H, CAPACITY, timeout_s=2.0, backend="auto")
    words = c.mb.words()
    return {
        "backend": c.mb.backend,
        "bytes": c.mb.layout.total_bytes,
        "status": c.mb.status(),
        "header_zero": bool((words[: HEADER_BYTES // 4] == 0).all()),
        "data_empty": bool((words[HEADER_BYTES // 4:] == -1).all()),
        "ptrs_distinct": len(set(c.mb.ptrs)) == 2,
    }


def _allreduce(c, order):
    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.protocol import reference_sum

    ar = MailboxAllReduce(c.mb, order)
    ar.prepare()
    c.ars[order] = ar
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 1000 + c.rank)
    vs_nccl, vs_ref, unwritten = {}, {}, 0
    for _rep in range(2):
        for m in range(1, CAPACITY + 1):
            x = random_rows(gen, m)
            out = torch.empty_like(x)
            out.view(torch.int16).fill_(0x4B4B)  # a finite poison: an unwritten column shows
            ar.run(x, out)
            ref = nccl(x)
            parts = [torch.empty_like(x) for _ in range(c.world)]
            dist.all_gather(parts, x)
            vs_nccl[m] = vs_nccl.get(m, 0) + bad(out, ref)
            vs_ref[m] = vs_ref.get(m, 0) + bad(out, reference_sum(parts, order))
            unwritten += int((out.view(torch.int16) == 0x4B4B).sum() - (ref.view(torch.int16) == 0x4B4B).sum())
    c.mb.check()
    return {"vs_nccl": vs_nccl, "vs_reference_sum": vs_ref, "unwritten": unwritten,
            "calls": 2 * CAPACITY}


def check_allreduce_fp32(c):
    from dspark_core.contracts.constants import FP32_RANK_ORDER

    return _allreduce(c, FP32_RANK_ORDER)


def check_allreduce_bf16(c):
    from dspark_core.contracts.constants import BF16_RANK_ORDER

    return _allreduce(c, BF16_RANK_ORDER)


def check_special(c):
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 77)  # the same on both ranks
    patterns = all_patterns()
    shuffled = all_patterns(gen)
    zeros = torch.zeros((8, H), dtype=BF16, device="cuda")
    neg_zeros = torch.full((8, H), -0.0, dtype=BF16, device="cuda")
    marker = torch.full((8, H), -1, dtype=torch.int16, device="cuda").view(BF16)
    r = c.rank
    cases = {
        "patterns_vs_shuffled": torch.cat([patterns if r == 0 else shuffled, special_rows(gen, r)]),
        "patterns_plus_neg_zero": torch.cat([patterns if r == 0 else neg_zeros, neg_zeros]),
        "neg_zero_plus_patterns": torch.cat([neg_zeros if r == 0 else patterns, patterns]),
        "marker_words": torch.cat([marker, marker if r == 0 else patterns]),
        "signed_zeros": torch.cat([neg_zeros, neg_zeros if r == 0 else zeros]),
    }
    result = {}
    for order, ar in c.ars.items():
        for name, x in cases.items():
            out = ar.run(x)
            result[f"{order}/{name}"] = bad(out, nccl(x))
    # The identity cases move every pattern through the mailbox: all but NaNs exact.
    x = cases["patterns_plus_neg_zero"]
    out = c.ars[next(iter(c.ars))].run(x)
    nan = torch.isnan(patterns.float())
    # Rank 0's patterns plus -0.0: every non-NaN pattern arrives unchanged on both ranks.
    result["identity_non_nan_exact"] = int((out[:8].view(torch.int16) != patterns.view(torch.int16))[~nan].sum())
    c.mb.check()
    return {"mismatches": result}


def _boundary_modules(gen):
    from dspark_core.spec.layers import GatedResidual, RMSNorm

    post = RMSNorm(H, 1e-6, weight_dtype=BF16).cuda()
    pre = RMSNorm(H, 1e-5, weight_dtype=FP32, gain_center=1.0, weight_before_norm=True).cuda()
    post.weight.data.copy_((torch.randn(H, generator=gen, device="cuda") * 0.25 + 1.0).to(BF16))
    pre.weight.data.copy_(torch.randn(H, generator=gen, device="cuda") * 0.25)
    conn = GatedResidual(H).cuda()
    conn.alpha.data.copy_(torch.rand(H, generator=gen, device="cuda") + 0.5)
    conn.beta.data.copy_(torch.randn(H, generator=gen, device="cuda") * 0.5)
    conn.alpha.data[0::101] = -0.0
    conn.beta.data[3::101] = -0.0
    return post, conn, pre


def check_boundary(c):
    from norm_testing import boundary_consts

    from dspark_comm.cutedsl.all_reduce_boundary import AllReduceBoundary
    from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary, stock_arch

    shared = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 5)  # weights and streams: replicated
    c.modules = post, conn, pre = _boundary_modules(shared)
    # The device's stock tree, as the spec modules (arch None) follow it.
    constants = boundary_consts(post, conn, pre, stock_arch("cuda"))
    c.bds = {
        order: AllReduceBoundary(c.mb, constants, conn.alpha, conn.beta, post.weight, pre.weight, order)
        for order in (FP32_RANK_ORDER, BF16_RANK_ORDER)
    }
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 2000 + c.rank)
    res, same = {}, 0
    for order, bd in c.bds.items():
        rows = range(1, CAPACITY + 1) if order == FP32_RANK_ORDER else (1, 16)
        for m in rows:
            for stream_dtype, store in ((FP32, True), (BF16, False)):
                if order == BF16_RANK_ORDER and stream_dtype == BF16:
                    continue
                x = random_rows(gen, m)
                stream = random_rows(shared, m, FP32).to(stream_dtype)
                new, out = bd.run(x, stream, store)
                exp_new, exp_out = residual_boundary(post, conn, pre, nccl(x), stream)
                key = f"{order}/m{m}/{'fp32' if stream_dtype == FP32 else 'bf16'}"
                res[key] = bad(out, exp_out) + (bad(new, exp_new) if store else 0)
                both = [torch.empty_like(out) for _ in range(c.world)]
                dist.all_gather(both, out)
                same += bad(both[0], both[1])
    # Special partials (one row of each kind), FP32 order, FP32 stream stored.
    bd = c.bds[FP32_RANK_ORDER]
    x = torch.cat([special_rows(gen, c.rank), all_patterns(shared)[:4], random_rows(gen, 4)])
    stream = random_rows(shared, x.shape[0], FP32)
    new, out = bd.run(x, stream, True)
    exp_new, exp_out = residual_boundary(post, conn, pre, nccl(x), stream)
    res["special"] = bad(out, exp_out) + bad(new, exp_new)
    c.mb.check()
    return {"mismatches": res, "ranks_differ": same}


def check_positive_zero(c):
    """``positive_zero=True`` (the stock of a Lamport all-reduce whose empty
    marker is -0.0): the plain all-reduce in both orders against
    ``reference_sum(..., positive_zero=True)`` of the gathered partials,
    with rows of -0.0 on both ranks planted (the plain kernel must give
    -0.0 there, this one +0.0), and the boundary on that sum against the
    spec. Both kernels compiled on both ranks before the first call."""
    from dspark_comm.cutedsl.all_reduce_boundary import AllReduceBoundary
    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary

    post, conn, pre = c.modules
    fp32_bd = c.bds[FP32_RANK_ORDER]
    ars = {o: MailboxAllReduce(c.mb, o, positive_zero=True) for o in (FP32_RANK_ORDER, BF16_RANK_ORDER)}
    bd = AllReduceBoundary(c.mb, fp32_bd.constants, conn.alpha, conn.beta, post.weight, pre.weight,
                           FP32_RANK_ORDER, positive_zero=True)
    for ar in ars.values():
        ar.prepare()
    bd.prepare(stream_dtypes=(FP32,), store_stream=(True,))
    c.group.barrier()
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 3000 + c.rank)
    shared = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 3001)
    neg = torch.full((4, H), -0.0, dtype=BF16, device="cuda")
    res, negative_plain, negative_fused = {}, 0, 0
    for m in (1, 5, 16):
        x = torch.cat([neg, special_rows(gen, c.rank), random_rows(gen, m)])[:m]
        x[:, 1::7] = -0.0  # columns of -0.0 on both ranks in every row
        parts = [torch.empty_like(x) for _ in range(c.world)]
        dist.all_gather(parts, x)
        for order, ar in ars.items():
            out = ar.run(x)
            res[f"{order}/m{m}"] = bad(out, reference_sum(parts, order, positive_zero=True))
            negative_fused += int((out.view(torch.int16) == -32768).sum())
            negative_plain += int((c.ars[order].run(x).view(torch.int16) == -32768).sum())
        stream = random_rows(shared, m, FP32)
        new, out = bd.run(x, stream, True)
        exp_new, exp_out = residual_boundary(post, conn, pre, reference_sum(parts, FP32_RANK_ORDER, True), stream)
        res[f"boundary/m{m}"] = bad(out, exp_out) + bad(new, exp_new)
    c.mb.check()
    return {"mismatches": res, "negative_plain": negative_plain, "negative_fused": negative_fused}


def check_published(c):
    from publisher import Publisher

    from dspark_comm.cutedsl.allreduce import FusedAllReduce, StoreEpilogue
    from dspark_core.contracts.constants import FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary

    pub = Publisher(c.mb)
    consume = FusedAllReduce(c.mb, StoreEpilogue(), FP32_RANK_ORDER, published=True)
    ar = c.ars[FP32_RANK_ORDER]
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 3000 + c.rank)
    shared = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 6)
    post, conn, pre = c.modules
    res = {}
    for m in (1, 5, 16, 2, 16):
        x = random_rows(gen, m)
        out = torch.empty_like(x)
        pub.publish(x)
        consume.launch(m, None, (out,))
        res[f"published/m{m}"] = res.get(f"published/m{m}", 0) + bad(out, nccl(x))
        y = random_rows(gen, m)  # a pushed call between published ones
        res[f"pushed/m{m}"] = res.get(f"pushed/m{m}", 0) + bad(ar.run(y), nccl(y))
    for m in (3, 16):
        x = random_rows(gen, m)
        stream = random_rows(shared, m, FP32)
        pub.publish(x)
        new, out = c.bds[FP32_RANK_ORDER].run(None, stream, True, published=True)
        exp_new, exp_out = residual_boundary(post, conn, pre, nccl(x), stream)
        res[f"boundary/m{m}"] = bad(out, exp_out) + bad(new, exp_new)
    c.mb.check()
    return {"mismatches": res}


def check_bias_epilogue(c):
    from bias_epilogue import AddBiasEpilogue

    from dspark_comm.cutedsl.allreduce import FusedAllReduce

    fused = FusedAllReduce(c.mb, AddBiasEpilogue())
    bias = random_rows(torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 8), 1)[0].contiguous()
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 4000 + c.rank)
    res = {}
    for m in (1, 8, 16):
        x = random_rows(gen, m)
        out = torch.empty_like(x)
        fused.launch(m, x, (bias, out))
        res[m] = bad(out, (nccl(x).float() + bias.float()).to(BF16))
    c.mb.check()
    return {"mismatches": res}


def check_fallback(c):
    from dspark_core.contracts.constants import FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("dspark.comm").addHandler(handler)
    try:
        gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 5000 + c.rank)
        shared = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 9)
        res = {}
        for m in (17, 40):
            x = random_rows(gen, m)
            res[f"allreduce/m{m}"] = bad(c.ars[FP32_RANK_ORDER].run(x), nccl(x))
        post, conn, pre = c.modules
        x = random_rows(gen, 20)
        stream = random_rows(shared, 20, FP32)
        new, out = c.bds[FP32_RANK_ORDER].run(x, stream, True)
        exp_new, exp_out = residual_boundary(post, conn, pre, nccl(x), stream)
        res["boundary/m20"] = bad(out, exp_out) + bad(new, exp_new)
        # The mailbox is untouched by the fallback: a fused call still works.
        y = random_rows(gen, 16)
        res["fused_after"] = bad(c.ars[FP32_RANK_ORDER].run(y), nccl(y))
    finally:
        logging.getLogger("dspark.comm").removeHandler(handler)
    c.mb.check()
    return {"mismatches": res, "logged": records}


def check_other_backend(c):
    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.runtime.mailbox import Mailbox

    backend = "torch_symm" if c.mb.backend == "cuda_ipc" else "cuda_ipc"
    mb = Mailbox(c.group, H, CAPACITY, timeout_s=2.0, backend=backend)
    try:
        ar = MailboxAllReduce(mb)
        gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 6000 + c.rank)
        res = {}
        for m in (1, 16, 7):
            x = random_rows(gen, m)
            res[m] = bad(ar.run(x), nccl(x))
        mb.check()
    finally:
        mb.close()
    return {"backend": backend, "mismatches": res}


def check_cupy_group(c):
    import cupy
    from cupy.cuda import nccl as cnccl

    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.runtime.group import CupyNcclGroup
    from dspark_comm.runtime.mailbox import Mailbox

    uid = [cnccl.get_unique_id() if c.rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    with cupy.cuda.Device(c.rank):
        comm = cnccl.NcclCommunicator(c.world, uid[0], c.rank)
    group = CupyNcclGroup(comm)
    mb = Mailbox(group, H, CAPACITY, timeout_s=2.0, backend="cuda_ipc")
    try:
        ar = MailboxAllReduce(mb)
        gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 7000 + c.rank)
        res = {}
        for m in (1, 16, 20):  # 20: the fallback through cupy's NCCL
            x = random_rows(gen, m)
            res[m] = bad(ar.run(x), nccl(x))
        mb.check()
    finally:
        mb.close()
    return {"rank": group.rank, "size": group.size, "mismatches": res}


def check_stress(c):
    """Back-to-back calls of random row counts (the same sequence on both
    ranks), plain all-reduces and boundaries interleaved on one mailbox,
    random per-rank GPU delays before calls; eagerly, then a CUDA graph of
    ``G`` calls replayed until ``target`` calls or the time cap. The inputs
    of the plain calls flip sign at each replay (the references with them),
    so a value read from an earlier replay shows."""
    from rank_suite import replay_stress

    from dspark_core.contracts.constants import FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary
    from dspark_core.tools.compare import mismatches

    target, cap_s = c.cfg.get("stress_calls", 100_000), c.cfg.get("stress_seconds", 45.0)
    ar, bd = c.ars[FP32_RANK_ORDER], c.bds[FP32_RANK_ORDER]
    post, conn, pre = c.modules
    G = 64
    shared = random.Random(11)
    own = random.Random(100 + c.rank)
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 8000 + c.rank)
    sgen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 12)
    xs = torch.stack([random_rows(gen, CAPACITY) for _ in range(G)])
    # No zero partials, so a sign flip flips every sum but exact cancellations
    # (CUDA randn returns exact zeros now and then).
    xs.masked_fill_(xs == 0, 1.0)
    streams = torch.stack([random_rows(sgen, CAPACITY, FP32) for _ in range(G)])
    ref = torch.stack([nccl(x) for x in xs])
    ref_new, ref_out = zip(*(residual_boundary(post, conn, pre, ref[i], streams[i]) for i in range(G)))
    ref_new, ref_out = torch.stack(ref_new), torch.stack(ref_out)
    plan = [(shared.randint(1, CAPACITY), "bd" if j % 4 == 3 else "ar") for j in range(G)]
    delays = [own.choice([0, 0, 0, 2000, 10000, 40000]) for _ in range(G)]
    out = torch.empty((CAPACITY, H), dtype=BF16, device="cuda")
    new = torch.empty((CAPACITY, H), dtype=FP32, device="cuda")
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")

    def call(j: int) -> None:
        m, kind = plan[j]
        if delays[j]:
            torch.cuda._sleep(delays[j])
        if kind == "ar":
            ar.run(xs[j, :m], out[:m])
            counts[0] += mismatches(out[:m], ref[j, :m]).sum()
        else:
            bd.run(xs[j, :m], streams[j, :m], True, out[:m], new[:m])
            counts[1] += mismatches(out[:m], ref_out[j, :m]).sum() + mismatches(new[:m], ref_new[j, :m]).sum()

    def flip() -> None:
        # -a + -b rounds to -(a + b), except an exact cancellation: +0 both ways.
        for j in range(G):
            if plan[j][1] == "ar":
                torch.neg(xs[j], out=xs[j])
                torch.neg(ref[j], out=ref[j])
                ref[j].masked_fill_(ref[j] == 0, 0.0)

    t0 = time.monotonic()
    eager = 0
    for _rep in range(8):
        for j in range(G):
            call(j)
            eager += 1
            if own.random() < 0.02:
                time.sleep(own.random() * 0.002)  # host-side skew between the ranks
        flip()
    torch.cuda.synchronize()
    eager_bad = counts.tolist()

    def body() -> None:
        flip()
        for j in range(G):
            call(j)

    replays = replay_stress(body, G, eager, target, t0, cap_s, batch=50)
    c.mb.check()
    return {
        "calls": eager + replays * G, "eager_calls": eager, "graph_replays": replays,
        "calls_per_graph": G, "mismatches_allreduce": int(counts[0]), "mismatches_boundary": int(counts[1]),
        "eager_mismatches": eager_bad, "status": c.mb.status(),
        "wall_s": round(time.monotonic() - t0, 2),
    }


def _raised(fn) -> str | None:
    """``fn()``'s ``MailboxTimeoutError`` message, or None."""
    from dspark_comm.runtime.mailbox import MailboxTimeoutError

    try:
        fn()
    except MailboxTimeoutError as e:
        return str(e)
    return None


def timeout_probe(c, reference, timeout_s: float = 0.25) -> dict:
    """The last rank never arrives: every other rank's call gives up after
    ``timeout_s``, flags the mailbox (``check`` raises) and its next call
    returns at once; a collective reset makes the mailbox whole again.
    ``reference(x)``: the all-reduce the calls before and after must give
    (NCCL at TP2, the gathered partials' reference sum on one GPU)."""
    from dspark_comm.cutedsl.allreduce import MailboxAllReduce
    from dspark_comm.runtime.mailbox import Mailbox

    mb = Mailbox(c.group, H, 4, timeout_s=timeout_s, backend=c.mb.backend)
    res = {"timeout_s": timeout_s}
    try:
        ar = MailboxAllReduce(mb)
        ar.prepare()
        c.group.barrier()
        gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 9000 + c.rank)
        x = random_rows(gen, 2)
        res["before"] = bad(ar.run(x), reference(x))
        mb.poll()
        torch.cuda.synchronize()
        mb.poll()  # the first poll's copy, complete: healthy, so nothing raised
        c.group.barrier()
        if c.rank != c.world - 1:
            t0 = time.monotonic()
            ar.run(x)
            torch.cuda.synchronize()
            res["first_call_s"] = round(time.monotonic() - t0, 3)
            t0 = time.monotonic()
            ar.run(x)
            torch.cuda.synchronize()
            res["second_call_s"] = round(time.monotonic() - t0, 3)
            torch.cuda.synchronize()  # the copy poll() made above has landed: it read 0
            res["poll_raised"] = _raised(mb.poll)  # saw 0, copies the status again
            torch.cuda.synchronize()
            res["poll_raised_later"] = _raised(mb.poll)  # that copy: the flag
            res["raised"] = _raised(mb.check)
        c.group.barrier()
        mb.reset()
        mb.poll()
        torch.cuda.synchronize()
        res["poll_after_reset"] = _raised(mb.poll)
        res["status_after_reset"] = mb.status()
        y = random_rows(gen, 3)
        res["after_reset"] = bad(ar.run(y), reference(y))
        mb.check()
    finally:
        mb.close()
    return res


def check_timeout(c):
    """Rank 1 never arrives (``timeout_probe`` against NCCL)."""
    return timeout_probe(c, nccl)


def check_close(c):
    c.mb.close()
    c.mb.close()  # idempotent
    return {"closed": c.mb.closed}


CHECKS = [
    ("env", check_env),
    ("mailbox", check_mailbox),
    ("allreduce_fp32", check_allreduce_fp32),
    ("allreduce_bf16", check_allreduce_bf16),
    ("special", check_special),
    ("boundary", check_boundary),
    ("positive_zero", check_positive_zero),
    ("published", check_published),
    ("bias_epilogue", check_bias_epilogue),
    ("fallback", check_fallback),
    ("stress", check_stress),
    ("other_backend", check_other_backend),
    ("cupy_group", check_cupy_group),
    ("timeout", check_timeout),
    ("close", check_close),
]


def worker(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    from rank_suite import run_checks

    # Nothing runs without the mailbox.
    run_checks(rank, world, init_file, out_dir, cfg, CHECKS, needed=("mailbox",), skip=set(cfg.get("skip", ())),
               timeout_s=60.0)
