"""The rank group on one GPU (``one_gpu_workers.py``): 2, 4 and 8 processes
on GPU 0, gloo for the set-up and the references, CUDA IPC between the
processes for the mailbox, dspark-comm's own kernels. Each world size spawns
its ranks once; each test asserts on one check's results from every rank.

Bit for bit against ``protocol.reference_sum`` of the gathered partials in
the sum order the kernel claims (FP32 in rank order, BF16 after each add,
the ``positive_zero`` zero sign) and, for the boundary, ``residual_boundary``
on that sum. What this mode cannot show: NVLink's timing and its memory
ordering between devices (the ranks time-slice one GPU)."""

from __future__ import annotations

import os

import pytest
from rank_suite import results_of, run_suite

pytestmark = pytest.mark.gpu

WORLDS = tuple(int(w) for w in os.environ.get("DSPARK_ONE_GPU_WORLDS", "2,4,8").split(","))
SUITE_TIMEOUT_S = float(os.environ.get("DSPARK_ONE_GPU_TIMEOUT", "240"))


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"tp{w}")
def suite(request, tmp_path_factory):
    import one_gpu_workers

    world = request.param
    cfg = {"world": world,
           "stress_calls": int(os.environ.get("DSPARK_ONE_GPU_STRESS_CALLS", str(1600 // world))),
           "skip": [s for s in os.environ.get("DSPARK_COMM_SKIP", "").split(",") if s]}
    return run_suite(tmp_path_factory, one_gpu_workers.worker, f"one_gpu_tp{world}", cfg, SUITE_TIMEOUT_S,
                     f"one_gpu_tp{world}.json", world=world, one_gpu=True)


def zero(results: list[dict], key: str = "mismatches") -> None:
    for rank, r in enumerate(results):
        bad = {k: v for k, v in r[key].items() if v}
        assert not bad, f"rank {rank}: {bad}"


def test_env_and_mailbox(suite):
    for r in results_of(suite, "env"):
        assert r["backend"] == "gloo" and r["nvls_env"] == "0"
    for r in results_of(suite, "mailbox"):
        assert r["backend"] == "cuda_ipc" and r["status"] == 0
        assert r["header_zero"] and r["data_empty"] and r["ptrs_distinct"]


@pytest.mark.parametrize("check", ["allreduce_fp32", "allreduce_bf16"])
def test_allreduce_is_the_reference_sum(suite, check):
    for rank, r in enumerate(results_of(suite, check)):
        assert sorted(int(m) for m in r["vs_reference_sum"]) == list(range(1, 17))
        assert not any(r["vs_reference_sum"].values()), f"rank {rank}: {r['vs_reference_sum']}"
        assert r["unwritten"] == 0


def test_exact_package_gemm_is_vllms_tp_branch(suite):
    """The ordered GEMM's published partials, all-reduced: vLLM's TP branch
    (cuBLAS per rank, FP32 in rank order) bit for bit at every row count
    whose order every rank's check confirmed (most of 1, 2, 4, 8, 16)."""
    results = results_of(suite, "exact_package")
    zero(results)
    for rank, r in enumerate(results):
        print(f"rank {rank}: bound {r['bound']}, refused {r['refused']}")
        assert len(r["common"]) >= 3 and r["mismatches"], r


def test_special_values(suite):
    zero(results_of(suite, "special"))


def test_boundary(suite):
    results = results_of(suite, "boundary")
    zero(results)
    assert all(r["ranks_differ"] == 0 for r in results)


def test_positive_zero(suite):
    results = results_of(suite, "positive_zero")
    zero(results)
    assert all(r["negative_zeros_out"] == 0 for r in results)


def test_graph_replays(suite):
    assert all(r["mismatches"] == 0 for r in results_of(suite, "graphs"))


def test_stress(suite):
    for r in results_of(suite, "stress"):
        assert r["calls"] >= 1 and r["bad_calls"] == 0


def test_a_missing_rank_times_out_then_the_reset_recovers(suite):
    results = results_of(suite, "timeout")
    for rank, r in enumerate(results):
        assert r["before"] == 0 and r["after_reset"] == 0 and r["status_after_reset"] == 0
        assert r["poll_after_reset"] is None
        if rank == len(results) - 1:
            continue  # the absent rank
        assert r["raised"] and "gave up waiting" in r["raised"]
        # poll(): the copy before the timeout said healthy, the one after it raises; none after the reset.
        assert r["poll_raised"] is None and "gave up waiting" in (r["poll_raised_later"] or "")
        # The first call waits the poll timeout (time-sliced contexts add a margin), the next returns at once.
        assert r["first_call_s"] < r["timeout_s"] + 5.0
        assert r["second_call_s"] < 1.0


def test_close(suite):
    assert all(r["closed"] for r in results_of(suite, "close"))
