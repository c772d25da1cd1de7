"""The package GEMM on two GPUs (``dspark_comm.cutedsl.package_gemm``): one process per
rank (spawned once for every test here, the style of ``test_comm_multigpu.py``
and reusing its ``comm_workers`` helpers); each test asserts on its check's
results from both ranks. Skipped with fewer than two GPUs.

Ran on two H200s (2026-11-30): 5 passed, with the publish check comparing
the early-epochs kernel (now the default) with the in-round one, its finite
m = 16 boundary case and its poisoned outputs; again 5 passed with the
one-row GEMV path and the one-row variant with x through registers. Run with (the packages' src/ and
this folder on PYTHONPATH):

    python -m pytest -m multigpu packages/dspark-comm/tests/test_package_gemm_multigpu.py -q -s

Checks:

- ``plain``: the plain GEMM against float64 within ``package_gemm.error_bound``
  for K in {1024, 4096, 8192} and m in 1..16 (zero violations), cuBLAS
  (``x @ W.T``) against the same bound (recorded), the three variants (one
  row, with x through registers on the ring main loop; m <= 8; m <= 16) bit
  for bit on the same rows;
- ``plain`` and ``publish`` also run the register-direct main loop
  (``tile_n`` 16, ``dspark_cute.cutedsl.gemm.skinny.direct``): bit for bit the 64-row
  kernel (passed on two H200s);
- ``publish`` also runs the one-row GEMV path (``one_row_gemv=True``,
  ``dspark_comm.cutedsl.package_gemv``): one row bit for bit
  ``dspark_core.spec.gemv.gemv``, more rows the 64-row kernel's, and its
  published partial consumed bit for bit its plain output pushed;
- ``publish``: publish + ``FusedAllReduce(published=True)`` bit for bit the
  plain GEMM into a buffer + the pushing ``MailboxAllReduce`` (both sum
  orders) and NCCL; publish + ``AllReduceBoundary(published=True)`` bit for
  bit the plain GEMM + the same fused boundary (pushing) and NCCL + the spec's
  boundary, m = 1..16, non-finite inputs included;
- ``stress``: back-to-back calls of random m (the same sequence on both
  ranks), published boundaries, published all-reduces and pushed all-reduces
  interleaved on one mailbox, random per-rank GPU delays, eagerly and as CUDA
  graph replays; zero mismatches, a healthy mailbox.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
import torch
from rank_suite import replay_stress, results_of, run_suite

pytestmark = pytest.mark.multigpu

H = 8192
CAPACITY = 16
BF16, FP32 = torch.bfloat16, torch.float32
SUITE_TIMEOUT_S = float(os.environ.get("DSPARK_GEMM_SUITE_TIMEOUT", "300"))


# ---------------------------------------------------------------- the rank worker


def _operands(gen: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Normal values scaled by 2^-4 .. 2^4 per element, BF16."""
    x = torch.randn((m, k), generator=gen, device="cuda")
    scale = torch.randint(-4, 5, (m, k), generator=gen, device="cuda").float()
    return (x * torch.exp2(scale)).to(BF16)


def _constants(role: str, k: int, tile_n: int | None = None):
    """The role's constants on the ring main loop (tile_n 64) with the
    policy's split_k at shard ``k`` (``draft_gemm_shape``); ``tile_n`` 16:
    the register-direct main loop with the same split_k (the same sums)."""
    from dspark_core.contracts.constants import PackageGemmConstants
    from dspark_core.planner.policy import DRAFT_GEMMS, draft_gemm_shape

    s = DRAFT_GEMMS[role]
    return PackageGemmConstants(role, H, k, tile_n or s.tile_n, draft_gemm_shape(role, k).split_k, s.max_rows)


def check_setup(c):
    from dspark_comm.runtime.group import TorchGroup
    from dspark_comm.runtime.mailbox import Mailbox

    c.group = TorchGroup()
    c.mb = Mailbox(c.group, H, CAPACITY, timeout_s=2.0)
    return {"backend": c.mb.backend, "status": c.mb.status(),
            "devices": torch.cuda.device_count(), "name": torch.cuda.get_device_name(c.rank)}


def check_plain(c):
    from dspark_comm.cutedsl.package_gemm import RING_X_COPY, PackageGemm, error_bound

    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 100 + c.rank)
    res = {}
    for role, k in (("o_proj", 1024), ("o_proj", 4096), ("down_proj", 8192)):
        w = _operands(gen, H, k)
        gemm = PackageGemm(_constants(role, k), w)
        gemm.prepare(publish=(False,))
        # The register-direct main loop (tile_n 16): the same sums, so the same bits.
        direct = PackageGemm(_constants(role, k, tile_n=16), w)
        direct.prepare(publish=(False,))
        # The ring with lane copies (the default copies rows): the same MMAs, so the same bits.
        lane = PackageGemm(_constants(role, k), w, copy="lane")
        lane.prepare(publish=(False,))
        # x copied the other way (SkinnyConfig.x_copy: lanes or token rows): the same words, so the same bits.
        x_other = "rows" if RING_X_COPY == "lane" else "lane"
        x_twin = PackageGemm(_constants(role, k), w)
        x_twin.configs = {t: dataclasses.replace(cfg, x_copy=x_other) if cfg.copy == "rows" and not cfg.x_regs
                          else cfg for t, cfg in x_twin.configs.items()}
        x_twin.prepare(publish=(False,))
        ours_bad = cublas_bad = variant_bad = direct_bad = row_bad = lane_bad = x_twin_bad = 0
        worst_ours = worst_cublas = 0.0
        for m in range(1, CAPACITY + 1):
            x = _operands(gen, m, k)
            out = gemm.run(x)
            exact = x.double() @ w.double().t()
            bound = error_bound(out, x, w, gemm.k_warps)
            err = (out.double() - exact).abs()
            ours_bad += int((err > bound).sum())
            worst_ours = max(worst_ours, float((err / bound).max()))
            cub = x @ w.t()
            cb = error_bound(cub, x, w, gemm.k_warps)
            cerr = (cub.double() - exact).abs()
            cublas_bad += int((cerr > cb).sum())
            worst_cublas = max(worst_cublas, float((cerr / cb).max()))
            if m > 8:  # the 8-token variant on the first 8 rows: the same bits
                variant_bad += bad(gemm.run(x[:8].contiguous()), out[:8])
            if m > 1:  # the one-row variant (x through registers) on row 0: the same bits
                row_bad += bad(gemm.run(x[:1].contiguous()), out[:1])
            # The twins write into NaN-poisoned outputs: an element one leaves unwritten shows.
            direct_bad += bad(direct.run(x, torch.full_like(out, float("nan"))), out)
            lane_bad += bad(lane.run(x, torch.full_like(out, float("nan"))), out)
            x_twin_bad += bad(x_twin.run(x, torch.full_like(out, float("nan"))), out)
        # Non-finite inputs propagate as they do in float64 (NaN where it is NaN).
        x = _operands(gen, 4, k)
        x[0, 0], x[1, 5], x[2, 7] = float("inf"), float("nan"), float("-inf")
        out = gemm.run(x)
        exact = (x.double() @ w.double().t()).to(BF16)
        nonfinite_bad = int((torch.isnan(out) != torch.isnan(exact)).sum()
                            + (torch.isinf(out) != torch.isinf(exact)).sum())
        res[f"{role}/K{k}"] = {
            "k_warps": gemm.k_warps, "stages": gemm.stages,
            "ours_over_bound": ours_bad, "cublas_over_bound": cublas_bad,
            "worst_ours_err_over_bound": worst_ours, "worst_cublas_err_over_bound": worst_cublas,
            "variants_differ": variant_bad + row_bad, "one_row_x_regs": gemm.configs[0].x_regs,
            "nonfinite_mismatch": nonfinite_bad, "direct_differs": direct_bad,
            "copies": [cfg.copy for cfg in gemm.configs.values()], "lane_copies_differ": lane_bad,
            "x_copy_twin": x_other, "x_copy_twin_differs": x_twin_bad,
            "x_copies": [cfg.x_copy for cfg in x_twin.configs.values()],
        }
    return {"cases": res}


def check_publish(c):
    from norm_testing import boundary_consts

    from dspark_comm.cutedsl.all_reduce_boundary import AllReduceBoundary
    from dspark_comm.cutedsl.allreduce import FusedAllReduce, MailboxAllReduce, StoreEpilogue
    from dspark_comm.cutedsl.package_gemm import PackageGemm
    from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER
    from dspark_core.spec.layers import residual_boundary, stock_arch

    shared = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 5)  # weights of the boundary, streams
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 200 + c.rank)
    k = 2048
    w = _operands(gen, H, k)
    c.gemm = gemm = PackageGemm(_constants("o_proj", k), w, c.mb)
    gemm.prepare()
    direct = PackageGemm(_constants("o_proj", k, tile_n=16), w, c.mb)  # the register-direct main loop
    direct.prepare()
    # The one-row GEMV path: one row in dspark_core.spec.gemv's order, more rows as gemm.
    one_row = PackageGemm(_constants("o_proj", k), w, c.mb, one_row_gemv=True)
    one_row.prepare()
    from dspark_core.spec.gemv import gemv as gemv_spec

    post, conn, pre = c.modules = _boundary_modules(shared)
    constants = boundary_consts(post, conn, pre, stock_arch("cuda"))
    c.bd = bd = AllReduceBoundary(c.mb, constants, conn.alpha, conn.beta, post.weight, pre.weight)
    bd.prepare(published=(False, True))
    res = {}
    # Every kernel compiled before the first call that waits on a peer: a
    # rank compiling while its peer polls can outlast the poll timeout (it
    # did on two H200s: a spurious MailboxTimeoutError).
    kernels = {}
    for order in (FP32_RANK_ORDER, BF16_RANK_ORDER):
        kernels[order] = (MailboxAllReduce(c.mb, order), FusedAllReduce(c.mb, StoreEpilogue(), order, published=True))
        for kernel in kernels[order]:
            kernel.prepare()
    torch.distributed.barrier()
    for order, (pushed, consume) in kernels.items():
        for m in range(1, CAPACITY + 1):
            x = _operands(gen, m, k)
            y = gemm.run(x)
            a = pushed.run(y)
            gemm.run(x, publish=True)
            b = torch.full_like(a, 7.0)  # poisoned: an unwritten element shows
            consume.launch(m, None, (b,))
            direct.run(x, publish=True)
            d = torch.full_like(a, 7.0)
            consume.launch(m, None, (d,))
            res[f"allreduce/{order}/m{m}"] = bad(a, b) + bad(b, nccl(y)) + bad(a, d)
            # One row on the GEMV: the spec's bits, published as they are; more rows: gemm's.
            y1 = one_row.run(x, torch.full_like(y, float("nan")))  # poisoned: an unwritten element shows
            a1 = pushed.run(y1)
            one_row.run(x, publish=True)
            g = torch.full_like(a, 7.0)
            consume.launch(m, None, (g,))
            res[f"allreduce/{order}/m{m}"] += bad(y1, gemv_spec(x, w) if m == 1 else y) + bad(a1, g)
    # m = 1..CAPACITY with finite inputs, then CAPACITY rows again with NaN and inf.
    for i, m in enumerate([*range(1, CAPACITY + 1), CAPACITY]):
        for stream_dtype, store in ((FP32, True), (BF16, False)):
            x = _operands(gen, m, k)
            if i == CAPACITY:
                x[3, 11] = float("nan")
                x[5, 0] = float("inf")
            stream = _operands(shared, m, H).float().to(stream_dtype)
            y = gemm.run(x)
            new_a, out_a = bd.run(y, stream, store)
            new_b, out_b = gemm.run_boundary(x, bd, stream, store)
            exp_new, exp_out = residual_boundary(post, conn, pre, nccl(y), stream)
            key = f"boundary/m{m}/{'fp32' if stream_dtype == FP32 else 'bf16'}"
            res[key] = res.get(key, 0) + bad(out_a, out_b) + bad(out_b, exp_out)
            if store:
                res[key] += bad(new_a, new_b) + bad(new_b, exp_new)
    c.mb.check()
    return {"mismatches": res}


def check_stress(c):
    """Random m, per-rank delays, three kinds of calls on one mailbox, eager
    then CUDA graph replays (the references: the plain GEMM + the pushing
    fused paths, computed eagerly once per input)."""
    from dspark_comm.cutedsl.allreduce import FusedAllReduce, MailboxAllReduce, StoreEpilogue
    from dspark_core.contracts.constants import FP32_RANK_ORDER
    from dspark_core.tools.compare import mismatches

    target, cap_s = c.cfg.get("stress_calls", 20_000), c.cfg.get("stress_seconds", 30.0)
    gemm, bd, k = c.gemm, c.bd, c.gemm.constants.k_shard
    pushed = MailboxAllReduce(c.mb, FP32_RANK_ORDER)
    consume = FusedAllReduce(c.mb, StoreEpilogue(), FP32_RANK_ORDER, published=True)
    consume.prepare()
    pushed.prepare()
    G = 48
    shared_rng, own = random.Random(21), random.Random(300 + c.rank)
    gen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 400 + c.rank)
    sgen = torch.Generator(device="cuda").manual_seed(c.cfg["seed"] + 22)
    xs = torch.stack([_operands(gen, CAPACITY, k) for _ in range(G)])
    streams = torch.stack([_operands(sgen, CAPACITY, H).float() for _ in range(G)])
    plan = [(shared_rng.randint(1, CAPACITY), shared_rng.choice(["pub_bd", "pub_ar", "push_ar"])) for _ in range(G)]
    delays = [own.choice([0, 0, 0, 2000, 10000, 40000]) for _ in range(G)]
    ref_out = torch.empty((G, CAPACITY, H), dtype=BF16, device="cuda")
    ref_new = torch.empty((G, CAPACITY, H), dtype=FP32, device="cuda")
    ys = torch.empty((G, CAPACITY, H), dtype=BF16, device="cuda")
    for j, (m, kind) in enumerate(plan):
        ys[j, :m] = gemm.run(xs[j, :m])
        if kind == "pub_bd":
            bd.run(ys[j, :m], streams[j, :m], True, ref_out[j, :m], ref_new[j, :m])
        else:
            pushed.run(ys[j, :m], ref_out[j, :m])
    out = torch.empty((CAPACITY, H), dtype=BF16, device="cuda")
    new = torch.empty((CAPACITY, H), dtype=FP32, device="cuda")
    counts = torch.zeros(3, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.distributed.barrier()  # the references took each rank its own time

    def call(j: int) -> None:
        m, kind = plan[j]
        if delays[j]:
            torch.cuda._sleep(delays[j])
        if kind == "pub_bd":
            gemm.run_boundary(xs[j, :m], bd, streams[j, :m], True, out[:m], new[:m])
            counts[0] += mismatches(out[:m], ref_out[j, :m]).sum() + mismatches(new[:m], ref_new[j, :m]).sum()
        elif kind == "pub_ar":
            gemm.launch(xs[j, :m], None, publish=True)
            consume.launch(m, None, (out[:m],))
            counts[1] += mismatches(out[:m], ref_out[j, :m]).sum()
        else:
            pushed.run(ys[j, :m], out[:m])
            counts[2] += mismatches(out[:m], ref_out[j, :m]).sum()

    t0 = time.monotonic()
    eager = 0
    for _rep in range(4):
        for j in range(G):
            call(j)
            eager += 1
            if own.random() < 0.02:
                time.sleep(own.random() * 0.002)
    torch.cuda.synchronize()
    eager_bad = counts.tolist()

    def body() -> None:
        for j in range(G):
            call(j)

    replays = replay_stress(body, G, eager, target, t0, cap_s, batch=20)
    c.mb.check()
    return {"calls": eager + replays * G, "eager_calls": eager, "graph_replays": replays,
            "mismatches": dict(zip(("pub_bd", "pub_ar", "push_ar"), counts.tolist())),
            "eager_mismatches": eager_bad, "status": c.mb.status(), "wall_s": round(time.monotonic() - t0, 2)}


def check_close(c):
    c.mb.close()
    return {"closed": c.mb.closed}


CHECKS = [("setup", check_setup), ("plain", check_plain), ("publish", check_publish),
          ("stress", check_stress), ("close", check_close)]


def bad(a, b) -> int:
    from comm_workers import bad as _bad

    return _bad(a, b)


def nccl(x):
    from comm_workers import nccl as _nccl

    return _nccl(x)


def _boundary_modules(gen):
    from comm_workers import _boundary_modules as _mods

    return _mods(gen)


def worker(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    from rank_suite import run_checks

    def cleanup(c, results) -> None:
        if "close" not in results.data and getattr(c, "mb", None) is not None:
            c.mb.close()

    # The later checks need what setup and publish built.
    run_checks(rank, world, init_file, out_dir, cfg, CHECKS, needed=("setup", "publish"), cleanup=cleanup)


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    cfg = {
        "stress_calls": int(os.environ.get("DSPARK_GEMM_STRESS_CALLS", "20000")),
        "stress_seconds": float(os.environ.get("DSPARK_GEMM_STRESS_SECONDS", "30")),
    }
    return run_suite(tmp_path_factory, worker, "package_gemm", cfg, SUITE_TIMEOUT_S, "package_gemm_results.json")


def ranks(suite, check: str) -> list[dict]:
    return results_of(suite, check)


def test_setup(suite):
    for r in ranks(suite, "setup"):
        assert r["status"] == 0


def test_plain_gemm_within_the_bound(suite):
    for rank, r in enumerate(ranks(suite, "plain")):
        for case, v in r["cases"].items():
            assert v["ours_over_bound"] == 0, (rank, case, v)
            assert v["variants_differ"] == 0, (rank, case, v)
            assert v["one_row_x_regs"], (rank, case, v)  # (the ring main loop: the default)
            assert v["nonfinite_mismatch"] == 0, (rank, case, v)
            assert v["direct_differs"] == 0, (rank, case, v)
            assert v["lane_copies_differ"] == 0, (rank, case, v)
            assert v["x_copy_twin_differs"] == 0, (rank, case, v)
            if v["copies"][2] == "rows":  # the twin's m > 1 variants copy x the other way (m = 1: registers)
                assert v["x_copies"][1:] == [v["x_copy_twin"]] * 2, (rank, case, v)
            assert v["copies"] == ["rows"] * 3, (rank, case, v)  # (the ring's default)
            print(f"rank {rank} {case}: worst |err| / bound ours {v['worst_ours_err_over_bound']:.3f}, "
                  f"cuBLAS {v['worst_cublas_err_over_bound']:.3f} ({v['cublas_over_bound']} over)")


def test_publish_bit_for_bit(suite):
    for rank, r in enumerate(ranks(suite, "publish")):
        bad_cases = {k: v for k, v in r["mismatches"].items() if v}
        assert not bad_cases, f"rank {rank}: {bad_cases}"
        assert len(r["mismatches"]) == 2 * CAPACITY + 2 * CAPACITY


def test_stress(suite):
    for rank, r in enumerate(ranks(suite, "stress")):
        assert not any(r["mismatches"].values()) and not any(r["eager_mismatches"]), r
        assert r["status"] == 0 and r["graph_replays"] > 0, r
        print(f"rank {rank}: {r['calls']} calls ({r['eager_calls']} eager, {r['graph_replays']} replays) "
              f"in {r['wall_s']} s")


def test_close(suite):
    assert all(r["closed"] for r in ranks(suite, "close"))
