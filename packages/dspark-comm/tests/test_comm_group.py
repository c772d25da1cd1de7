"""CPU tests of the TP group (``dspark_comm.runtime.group``) over two gloo processes
(one per rank, a file rendezvous, spawned by ``dspark_comm.runtime.ranks.spawn_ranks``):
the byte all-gather, the barrier, the collective agreement that fails on
every rank when one fails, the stock all-reduce; and the mailbox's refusals, which come before any GPU work."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

WORLD = 2


def _worker(rank: int, world: int, init: str, out: str) -> None:
    from dspark_comm.runtime.group import TorchGroup
    from dspark_comm.runtime.mailbox import Mailbox

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    result = {}
    try:
        group = TorchGroup(device="cpu")
        result["rank_size"] = [group.rank, group.size]
        result["gather"] = [b.decode() for b in group.all_gather_bytes(f"rank{rank}".encode() * (rank + 1))]
        result["objects"] = group.all_gather_object({"r": rank})
        group.barrier()
        try:
            group.agree(rank == 0, "the test step")
            result["agree"] = "no error"
        except RuntimeError as e:
            result["agree"] = str(e)
        group.agree(True, "a step that succeeds everywhere")
        t = torch.tensor([1.5 * (rank + 1)])
        result["sum"] = group.all_reduce_(t).item()
        refusals = {}
        for name, kwargs in [
            ("backend", {"backend": "nvls"}),
            ("timeout", {"timeout_s": 0}),
            ("capacity", {"capacity": 500}),
            ("device", {}),
        ]:
            try:
                Mailbox(group, 8192, **kwargs)
                refusals[name] = "accepted"
            except ValueError as e:
                refusals[name] = str(e)
        try:
            Mailbox(object(), 8192)
        except ValueError as e:
            refusals["group"] = str(e)
        result["refusals"] = refusals
    except Exception as e:  # reported to the test, not raised in the child
        result["error"] = repr(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dspark_comm.runtime.ranks import spawn_ranks

    out = tmp_path_factory.mktemp("group")
    error = spawn_ranks(_worker, WORLD, str(out), timeout_s=120)
    assert error is None, error
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_group_basics(results):
    for rank, r in enumerate(results):
        assert "error" not in r, r["error"]
        assert r["rank_size"] == [rank, WORLD]
        assert r["gather"] == ["rank0", "rank1rank1"]
        assert r["objects"] == [{"r": 0}, {"r": 1}]
        assert r["sum"] == 1.5 + 3.0


def test_agreement_fails_everywhere(results):
    for r in results:
        assert "failed on rank(s) [1]" in r["agree"]


def test_mailbox_refusals(results):
    for r in results:
        ref = r["refusals"]
        assert "backend is one of" in ref["backend"]
        assert "the poll timeout timeout_s must be a number of seconds from" in ref["timeout"]
        assert "1 to 128 rows" in ref["capacity"]
        assert "CUDA device" in ref["device"]
        assert "TPGroup" in ref["group"]
