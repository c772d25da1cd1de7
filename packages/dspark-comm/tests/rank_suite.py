"""The frame of every two-GPU suite of dspark-comm (``test_comm_multigpu.py``,
``test_package_gemm_multigpu.py``, ``test_draft_multigpu.py``): one process
per rank runs a list of named checks in order (``run_checks``), recording
each check's JSON result in ``rank<r>.json`` as it ends, so a crash or a kill
keeps the earlier ones; the pytest side spawns the ranks once per module
(``run_suite``) and each test asserts on one check's results from every rank
(``results_of``). The process plumbing is ``dspark_comm.runtime.ranks``."""

from __future__ import annotations

import json
import os
import time
import traceback

import pytest
import torch

WORLD = 2


class Ctx:
    """What one rank's checks share (attributes set by the checks)."""


class Results:
    """One rank's ``rank<r>.json``: ``run(name, fn, ctx)`` runs ``fn(ctx)``
    and records its dict (or the traceback) with ``ok`` and ``seconds``."""

    def __init__(self, out_dir: str, rank: int) -> None:
        self.path = os.path.join(out_dir, f"rank{rank}.json")
        self.data: dict = {}

    def run(self, name: str, fn, ctx) -> None:
        t0 = time.monotonic()
        try:
            value = fn(ctx) or {}
            value["ok"] = True
        except Exception:
            value = {"ok": False, "error": traceback.format_exc()[-4000:]}
        value["seconds"] = round(time.monotonic() - t0, 3)
        self.data[name] = value
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)
        print(f"[rank {ctx.rank}] {name}: {json.dumps(value, default=str)[:300]}", flush=True)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_checks(rank: int, world: int, init_file: str, out_dir: str, cfg: dict, checks, *,
               needed=(), skip=(), cleanup=None, timeout_s: float = 120.0, one_gpu: bool = False) -> None:
    """One rank: join the NCCL group (``dspark_comm.runtime.ranks.init_rank``), run
    ``checks`` (``(name, fn)`` pairs) in order except those in ``skip``, stop
    after a failed check named in ``needed`` (the later ones need what it
    built), then ``cleanup(ctx, results)`` (e.g. close a mailbox a failed run
    left open; its error is printed, not raised) and leave the group."""
    from dspark_comm.runtime.ranks import finish_rank, init_rank

    init_rank(rank, world, init_file, timeout_s, one_gpu)
    c = Ctx()
    c.rank, c.world, c.cfg = rank, world, cfg
    results = Results(out_dir, rank)
    for name, fn in checks:
        if name in skip:
            continue
        # The ranks start each check together: one rank's slower compiles in
        # the previous check must not count against a peer's poll timeout.
        _barrier()
        results.run(name, fn, c)
        if name in needed and not results.data[name]["ok"]:
            break
    if cleanup is not None:
        try:
            cleanup(c, results)
        except Exception as e:
            print(f"[rank {rank}] cleanup failed: {type(e).__name__}: {e}", flush=True)
    finish_rank()


def replay_stress(body, calls_per_graph: int, eager: int, target: int, t0: float, cap_s: float, batch: int) -> int:
    """The graph half of a stress check: ``body()`` (``calls_per_graph``
    calls) captured in a CUDA graph, entered from a side stream, then
    replayed ``batch`` times at a go until ``eager`` plus the replayed calls
    reach ``target`` or ``cap_s`` seconds since ``t0`` have passed on any
    rank (agreed by an all-reduce, so both ranks replay equally often);
    synced. Returns the replays. Collective."""
    import torch.distributed as dist

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        body()
    torch.cuda.current_stream().wait_stream(side)
    replays = 0
    while eager + replays * calls_per_graph < target:
        for _ in range(batch):
            graph.replay()
        replays += batch
        torch.cuda.synchronize()
        stop = torch.tensor([int(time.monotonic() - t0 >= cap_s)], device="cuda")
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if int(stop.item()):
            break
    torch.cuda.synchronize()
    return replays


def run_suite(tmp_path_factory, worker, name: str, cfg: dict, timeout_s: float, keep_as: str | None = None,
              world: int = WORLD, one_gpu: bool = False) -> dict:
    """Spawn ``worker(rank, WORLD, init_file, out_dir, cfg)`` on ``WORLD``
    ranks (skip the module with fewer GPUs), ``cfg`` with ``"seed"`` added
    (``DSPARK_SEED``, else fresh; printed; the checks add it to every
    generator's seed), wait up to ``timeout_s``, and return ``{"seed": the
    seed, "ranks": [rank r's recorded checks], "timed_out": bool,
    "error": why the ranks did not all end cleanly, or None}``; with
    ``DSPARK_COMM_OUT`` set, the results are also written there as
    ``keep_as``."""
    need = 1 if one_gpu else world
    if not torch.cuda.is_available() or torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} CUDA GPU(s) (this machine has {torch.cuda.device_count()}); "
                    "run nox -s tests-multigpu on a two-GPU device machine")
    from dspark_comm.runtime.ranks import spawn_ranks

    # Fresh inputs every run: one seed for both ranks (cfg is shared, so
    # generators seeded alike on both ranks stay alike), printed.
    seed = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
    print(f"{name} suite: seed {seed} (set DSPARK_SEED={seed} to repeat)")
    cfg = {**cfg, "seed": seed}
    out = tmp_path_factory.mktemp(name)
    error = spawn_ranks(worker, world, str(out), cfg, timeout_s=timeout_s)
    if error is not None:
        print(error)
    results = []
    for r in range(world):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    print(json.dumps(results, indent=1)[:20000])
    suite = {"seed": seed, "ranks": results, "timed_out": error is not None and "still running" in error,
             "error": error}
    keep = os.environ.get("DSPARK_COMM_OUT")  # a folder to keep the raw results in
    if keep and keep_as:
        with open(os.path.join(keep, keep_as), "w") as f:
            json.dump(suite, f, indent=1)
    return suite


def results_of(suite: dict, check: str) -> list[dict]:
    """Every rank's result of ``check``; fails the test where a rank has
    none or its check raised."""
    got = [r.get(check) for r in suite["ranks"]]
    for rank, g in enumerate(got):
        if g is None:
            pytest.fail(f"rank {rank} recorded no result for {check}"
                        + (f" ({suite['error']})" if suite.get("error") else ""))
        assert g["ok"], f"rank {rank}, {check}:\n{g.get('error')}"
    return got
