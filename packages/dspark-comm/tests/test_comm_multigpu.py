"""The two-GPU suite (``comm_workers.py``): one process per rank, spawned
once for every test here; each test asserts on its check's results from
both ranks. Skipped with fewer than two GPUs.

Bit for bit against ``torch.distributed`` NCCL all-reduce (at TP2 NCCL's
BF16 sum is one rounded add, which both sum orders reproduce) and, for the
boundary, NCCL followed by ``dspark_core.spec.layers.residual_boundary``."""

from __future__ import annotations

import os

import pytest
from rank_suite import WORLD, results_of, run_suite

pytestmark = pytest.mark.multigpu

SUITE_TIMEOUT_S = float(os.environ.get("DSPARK_COMM_SUITE_TIMEOUT", "200"))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    import comm_workers

    cfg = {
        "stress_calls": int(os.environ.get("DSPARK_COMM_STRESS_CALLS", "100000")),
        "stress_seconds": float(os.environ.get("DSPARK_COMM_STRESS_SECONDS", "45")),
        "skip": [s for s in os.environ.get("DSPARK_COMM_SKIP", "").split(",") if s],
    }
    return run_suite(tmp_path_factory, comm_workers.worker, "comm", cfg, SUITE_TIMEOUT_S, "multigpu_results.json")


def ranks(suite, check: str) -> list[dict]:
    return results_of(suite, check)


def zero_mismatches(results: list[dict], key: str = "mismatches") -> None:
    for rank, r in enumerate(results):
        bad = {k: v for k, v in r[key].items() if v}
        assert not bad, f"rank {rank}: {bad}"


def test_env(suite):
    for r in ranks(suite, "env"):
        assert r["devices"] >= WORLD and r["peer_access"]
        assert r["nvls_env"] == "0"


def test_mailbox_setup(suite):
    for r in ranks(suite, "mailbox"):
        assert r["status"] == 0 and r["header_zero"] and r["data_empty"] and r["ptrs_distinct"]


@pytest.mark.parametrize("check", ["allreduce_fp32", "allreduce_bf16"])
def test_allreduce_matches_nccl(suite, check):
    for rank, r in enumerate(ranks(suite, check)):
        assert sorted(int(m) for m in r["vs_nccl"]) == list(range(1, 17))
        assert not any(r["vs_nccl"].values()), f"rank {rank} vs NCCL: {r['vs_nccl']}"
        assert not any(r["vs_reference_sum"].values()), f"rank {rank}: {r['vs_reference_sum']}"
        assert r["unwritten"] == 0


def test_special_values(suite):
    for r in ranks(suite, "special"):
        assert r["mismatches"]["identity_non_nan_exact"] == 0
        zero_mismatches([r])


def test_boundary_matches_nccl_then_spec(suite):
    results = ranks(suite, "boundary")
    zero_mismatches(results)
    assert all(r["ranks_differ"] == 0 for r in results)
    assert len(results[0]["mismatches"]) == 16 * 2 + 2 + 1


def test_positive_zero(suite):
    """The zero-sign option: -0.0 sums (planted) come out +0.0, every other
    bit as the reference; the plain kernel keeps those -0.0."""
    results = ranks(suite, "positive_zero")
    zero_mismatches(results)
    for r in results:
        assert r["negative_plain"] > 0 and r["negative_fused"] == 0, r


def test_published_partials(suite):
    zero_mismatches(ranks(suite, "published"))


def test_another_models_epilogue(suite):
    zero_mismatches(ranks(suite, "bias_epilogue"))


def test_rows_above_capacity_fall_back(suite):
    results = ranks(suite, "fallback")
    zero_mismatches(results)
    for r in results:
        assert any("above the mailbox's capacity of 16" in msg for msg in r["logged"]), r["logged"]


def test_stress(suite):
    for rank, r in enumerate(ranks(suite, "stress")):
        assert r["mismatches_allreduce"] == 0 and r["mismatches_boundary"] == 0, r
        assert r["status"] == 0
        assert r["graph_replays"] > 0
        print(f"rank {rank}: {r['calls']} calls ({r['eager_calls']} eager, "
              f"{r['graph_replays']} replays of {r['calls_per_graph']}) in {r['wall_s']} s")
    if os.environ.get("DSPARK_COMM_STRESS_CALLS", "100000") == "100000":
        assert ranks(suite, "stress")[0]["calls"] >= 100_000


def test_other_backend(suite):
    zero_mismatches(ranks(suite, "other_backend"))


def test_cupy_nccl_group(suite):
    for r in suite["ranks"]:
        env = r.get("env", {})
        if not env.get("cupy"):
            pytest.skip("cupy is not installed on this machine")
    results = ranks(suite, "cupy_group")
    zero_mismatches(results)
    assert [r["rank"] for r in results] == [0, 1]


def test_absent_peer_times_out(suite):
    r0, r1 = ranks(suite, "timeout")
    assert r0["before"] == 0 and r1["before"] == 0
    assert r0["raised"] and "gave up waiting" in r0["raised"] and "from rank 1" in r0["raised"]
    assert r0["poll_raised"] is None and "gave up waiting" in (r0["poll_raised_later"] or "")
    assert 0.2 <= r0["first_call_s"] < 5.0, r0
    assert r0["second_call_s"] < 0.2, r0
    for r in (r0, r1):
        assert r["status_after_reset"] == 0 and r["after_reset"] == 0


def test_close(suite):
    assert all(r["closed"] for r in ranks(suite, "close"))
