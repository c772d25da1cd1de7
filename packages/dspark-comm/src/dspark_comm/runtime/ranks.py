"""One process per rank on one host: the set-up every multi-GPU entry point of
dspark-comm shares (the two-GPU test workers, the TP benchmarks, the TP2
demo), written once.

- ``MULTICAST_OFF``: the environment each rank sets before NCCL starts:
  NVLink multicast (NVLS) off for NCCL, PyTorch symmetric memory and
  NVSHMEM (the device machines this project runs on lend GPUs without it;
  the mailbox never uses multicast either).
- ``init_rank(rank, world, init_file, timeout_s, one_gpu=False)``: sets
  ``MULTICAST_OFF``, makes GPU ``rank`` the current device and joins the
  world process group (NCCL, rendezvous through the file ``init_file``,
  collectives timing out after ``timeout_s``); returns the rank's device.
  With ``one_gpu`` every rank runs on GPU 0 and the group is gloo (NCCL
  refuses two ranks on one GPU): the rank group of a machine with one GPU,
  whose processes time-slice it while the mailbox's CUDA IPC buffers (one
  device, other processes) and kernels are the real ones.
- ``finish_rank()``: leaves the process group where one was joined.
- ``spawn_ranks(fn, world, *args, timeout_s)``: runs ``fn(rank, world,
  init_file, *args)`` in ``world`` spawned processes (``init_file`` a fresh
  path in a temporary folder), waits for them until ``timeout_s`` and kills
  any rank still alive then. Returns None where every rank ended cleanly,
  else the reason in words (a rank raised or exited non-zero, or the time
  ran out); the caller reads what the ranks recorded either way.
- ``spawn_for_results(fn, world, results_path, *args, timeout_s)``:
  ``spawn_ranks`` after removing a stale ``results_path``, then the JSON the
  ranks wrote there: ``(results or None, reason or None)``.
- ``tp2_benchmark(what, fn, out, results_file, *args, timeout_s)``: the TP2
  benchmarks' driver: ``spawn_for_results`` on two GPUs (or, with fewer,
  says that ``what`` needs two and returns ``(None, 0)``), printing the
  reason where no rank recorded and the seconds taken; returns ``(results,
  exit status)``.

Nothing here imports the CuTe DSL.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from datetime import timedelta

import torch

from dspark_core import checks
from dspark_core.switches import flag

log = logging.getLogger("dspark.ranks")
# The most ranks a group may have (a TP group of more GPUs than this is no deployment of a draft).
MAX_WORLD = 1024

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def init_rank(rank: int, world: int, init_file: str, timeout_s: float = 120.0, one_gpu: bool = False) -> torch.device:
    """Join the NCCL world group as rank ``rank`` of ``world`` on GPU
    ``rank``, or with ``one_gpu`` the gloo group on GPU 0 (module
    docstring). TypeError or ValueError, before any GPU is asked, for a
    world that is no int from 1 to ``MAX_WORLD``, a rank outside ``[0,
    world)``, a timeout that is no number of seconds from 1 ms to a day
    (``checks.duration``), an ``init_file`` that is no non-empty path of a
    file (an existing directory is none), a ``one_gpu`` that is no bool;
    ValueError for a machine with fewer GPUs than that needs."""
    world = checks.integer("the group size world", world, 1, MAX_WORLD)
    rank = checks.integer("the rank", rank)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} of a group of {world}")
    timeout_s = checks.duration("the collectives' timeout timeout_s", timeout_s, 1e-3, 86400.0)
    one_gpu = flag(one_gpu, "one_gpu")
    if not isinstance(init_file, (str, os.PathLike)) or not str(init_file) or os.path.isdir(init_file):
        raise ValueError(f"init_file must be the path of a rendezvous file, not {init_file!r}")
    have = torch.cuda.device_count()
    if one_gpu and have < 1:
        raise ValueError(f"{world} ranks on one GPU need a CUDA GPU; this machine has none")
    if not one_gpu and have < world:
        raise ValueError(f"{world} ranks need {world} CUDA GPUs; this machine has {have}")
    os.environ.update(MULTICAST_OFF)
    import torch.distributed as dist

    device = torch.device("cuda", 0 if one_gpu else rank)
    torch.cuda.set_device(device)
    if one_gpu:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=device, timeout=timedelta(seconds=timeout_s))
    return device


def finish_rank() -> None:
    """Leave the world process group (where one was joined)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def spawn_ranks(fn, world: int, *args, timeout_s: float = 600.0) -> str | None:
    """Run ``fn(rank, world, init_file, *args)`` on ``world`` spawned ranks
    (module docstring): None where all ended cleanly, else why not. ``fn``
    must be importable by the spawned processes (a module-level function).
    TypeError or ValueError for an ``fn`` that is not callable, a world that
    is no int from 1 to ``MAX_WORLD`` or a timeout that is no number of
    seconds from 1 ms to a day, before any process is spawned."""
    if not callable(fn):
        raise TypeError(f"the ranks' function fn must be callable, not {checks.shown(fn)}")
    world = checks.integer("the group size world", world, 1, MAX_WORLD)
    timeout_s = checks.duration("the ranks' timeout timeout_s", timeout_s, 1e-3, 86400.0)
    import torch.multiprocessing as mp

    error = None
    with tempfile.TemporaryDirectory(prefix="dspark-ranks-") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(fn, args=(world, init_file, *args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            # join() returns False each time one process of several has ended.
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() > deadline:
                    error = f"the ranks were still running after {timeout_s:.0f} s (killed)"
                    break
        except Exception as e:  # a rank raised or exited non-zero (the others are ended by join)
            error = f"a rank failed: {e}"
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    if error is not None:
        log.warning(error)
    return error


def spawn_for_results(fn, world: int, results_path: str, *args, timeout_s: float = 600.0):
    """``spawn_ranks(fn, world, *args)`` with a fresh ``results_path`` (a
    stale file is removed first), then the JSON the ranks wrote there:
    ``(results, error)``, ``results`` None where no rank wrote it and
    ``error`` ``spawn_ranks``'s reason (None where every rank ended cleanly)."""
    import json

    if os.path.exists(results_path):
        os.remove(results_path)
    error = spawn_ranks(fn, world, *args, timeout_s=timeout_s)
    if not os.path.exists(results_path):
        return None, error or f"no rank wrote {results_path}"
    with open(results_path) as f:
        return json.load(f), error


def tp2_benchmark(what: str, fn, out: str, results_file: str, *args, timeout_s: float = 180.0):
    """``spawn_for_results(fn, 2, out/results_file, *args)`` for the TP2
    benchmark ``what`` (e.g. "the TP2 draft benchmark"): with fewer than two
    CUDA GPUs it logs that ``what`` needs two (WARNING, ``dspark.ranks``)
    and returns ``(None, 0)``; where no rank recorded a result it logs why
    and returns ``(None, 1)``; else ``(results, 0 where every rank ended
    cleanly, else 1)``, the seconds taken logged (INFO). Creates ``out``."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        log.warning("%s needs two CUDA GPUs; skipped", what)
        return None, 0
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    raw, error = spawn_for_results(fn, 2, os.path.join(out, results_file), *args, timeout_s=timeout_s)
    if raw is None:
        log.warning("the ranks of %s recorded no result (%s)", what, error)
        return None, 1
    log.info("%s took %.1f s", what, time.monotonic() - t0)
    return raw, 0 if error is None else 1


def record_case(results: dict, key: str, measure) -> None:
    """``results[key] = measure()``, or, where it raises, the words
    ``"failed: <type>: <message>"`` (200 characters at most): one benchmark
    case failing is reported in its cell and keeps the others running."""
    try:
        results[key] = measure()
    except Exception as e:  # noqa: BLE001 (reported in the table, not hidden)
        results[key] = f"failed: {type(e).__name__}: {e}"[:200]


def slower_rank(raw: list[dict], key: str, fmt: str = "{:.2f}") -> tuple[float | None, str]:
    """The cell of ``key`` over the ranks' results ``raw``: ``(the largest
    value, its text)``, or ``(None, the first rank's failure words)`` where a
    rank recorded a failure (a string) instead of a time."""
    vals = [r[key] for r in raw]
    failed = first_failure(vals)
    if failed is not None:
        return None, failed
    return max(vals), fmt.format(max(vals))


def first_failure(values: list) -> str | None:
    """The first of the ranks' ``values`` that is a failure (a string), or None."""
    return next((v for v in values if isinstance(v, str)), None)


__all__ = ["MULTICAST_OFF", "finish_rank", "first_failure", "init_rank", "record_case", "slower_rank",
           "spawn_for_results", "spawn_ranks", "tp2_benchmark"]
