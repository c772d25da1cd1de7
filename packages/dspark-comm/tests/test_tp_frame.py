"""CPU tests of the multi-GPU frame: ``dspark_comm.runtime.ranks`` (spawning ranks,
a failing rank, a rank past the time limit, the refusals of ``init_rank``),
``dspark_comm.tp_draft.greedy`` (on a small draft on the CPU: two equal
paths agree bit for bit; a path that flips a token is caught at that step,
teacher forcing goes on, near ties and decisive steps are counted), the TP2 demo's entry in ``dspark_core.demo``
(dspark-comm imported lazily; fewer than two GPUs run the TP1 demo; a
missing dspark-comm named) and the TP2 benchmark's report."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspark_comm.runtime import ranks
from dspark_comm.tp_draft import greedy, time_replays
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel


def _write(rank: int, world: int, init_file: str, out: str) -> None:
    Path(out, f"rank{rank}.txt").write_text(f"{rank}/{world} {os.environ.get('NCCL_NVLS_ENABLE')}")


def _fail_on_rank_1(rank: int, world: int, init_file: str) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


def _sleep(rank: int, world: int, init_file: str) -> None:
    time.sleep(60)


def test_spawn_ranks_runs_every_rank(tmp_path):
    assert ranks.spawn_ranks(_write, 2, str(tmp_path), timeout_s=120) is None
    assert sorted(p.read_text().split()[0] for p in tmp_path.glob("rank*.txt")) == ["0/2", "1/2"]


def test_spawn_ranks_reports_a_failing_rank():
    error = ranks.spawn_ranks(_fail_on_rank_1, 2, timeout_s=120)
    assert error is not None and "rank 1 fails on purpose" in error


def test_spawn_ranks_kills_ranks_past_the_limit():
    t0 = time.monotonic()
    error = ranks.spawn_ranks(_sleep, 2, timeout_s=4)
    assert error is not None and "still running after 4 s" in error
    assert time.monotonic() - t0 < 40


def _results(rank: int, world: int, init_file: str, path: str, fail: bool) -> None:
    if rank == 0:
        Path(path + ".part").write_text(json.dumps([{"rank": r} for r in range(world)]))
        os.replace(path + ".part", path)  # whole when it appears
    if fail and rank == 1:
        # After rank 0 wrote (a failing rank ends the others: without the wait
        # rank 0 could be ended first on a loaded machine).
        deadline = time.monotonic() + 60
        while not Path(path).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("rank 1 fails after rank 0 wrote")


def test_spawn_for_results_reads_what_the_ranks_wrote(tmp_path):
    path = tmp_path / "raw.json"
    path.write_text("stale")  # removed before the ranks start
    assert ranks.spawn_for_results(_results, 2, str(path), str(path), False, timeout_s=120) == (
        [{"rank": 0}, {"rank": 1}], None)
    raw, error = ranks.spawn_for_results(_results, 2, str(path), str(path), True, timeout_s=120)
    assert raw == [{"rank": 0}, {"rank": 1}] and "rank 1 fails after rank 0 wrote" in error
    raw, error = ranks.spawn_for_results(_fail_on_rank_1, 2, str(path), timeout_s=120)
    assert raw is None and "rank 1 fails on purpose" in error and not path.exists()


def test_init_rank_refusals():
    with pytest.raises(ValueError, match="rank 2 of a group of 2"):
        ranks.init_rank(2, 2, "/nonexistent")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="64 ranks need 64 CUDA GPUs"):
            ranks.init_rank(0, 64, "/nonexistent")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="8 ranks on one GPU need a CUDA GPU; this machine has none"):
            ranks.init_rank(0, 8, "/nonexistent", one_gpu=True)
    with pytest.raises(ValueError, match="rank 8 of a group of 8"):
        ranks.init_rank(8, 8, "/nonexistent", one_gpu=True)
    with pytest.raises(ValueError):
        ranks.spawn_ranks(_write, 0)
    # Every argument checked before a GPU is asked or a process spawned.
    for args, kwargs, kind, words in (
            ((True, 2, "/nonexistent"), {}, TypeError, "rank"), ((0, 2.0, "/nonexistent"), {}, TypeError, "world"),
            ((0, 2**40, "/nonexistent"), {}, ValueError, "world"),
            ((0, 2, "/nonexistent"), {"timeout_s": float("nan")}, ValueError, "timeout"),
            ((0, 2, "/nonexistent"), {"timeout_s": -1}, ValueError, "timeout"),
            ((0, 2, "/nonexistent"), {"timeout_s": "5"}, TypeError, "timeout"),
            ((0, 2, None), {}, ValueError, "init_file"), ((0, 2, ""), {}, ValueError, "init_file"),
            ((0, 2, "/tmp"), {}, ValueError, "init_file"),
            ((0, 2, "/nonexistent"), {"one_gpu": "no"}, TypeError, "one_gpu")):
        with pytest.raises(kind, match=words):
            ranks.init_rank(*args, **kwargs)
    for args, kwargs, kind in (((None, 2), {}, TypeError), ((_write, True), {}, TypeError),
                               ((_write, 2), {"timeout_s": float("inf")}, ValueError)):
        with pytest.raises(kind):
            ranks.spawn_ranks(*args, **kwargs)
    with pytest.raises(ValueError):
        time_replays(lambda: None, 0)


@pytest.fixture(scope="module")
def small():
    return DraftModel(small_config(num_layers=1))


def _caches(model, span: int):
    states = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    positions = torch.arange(8)
    caches = model.make_caches(span // model.config.kv_block_size + 1)
    model.precompute_and_store_context_kv(states, positions, caches, positions)
    return caches


def test_greedy_of_two_equal_paths_agrees_bit_for_bit(small):
    span = 8 + 6 * 2
    res = greedy(small, small.forward, small.forward, _caches(small, span), _caches(small, span),
                 torch.tensor([3, 5]), 8, 6, span)
    assert res["agreed"] == 6 and res["differ"] == [] and res["hidden_mismatches"] == 0
    assert res["decisive"] + res["near_ties"] == 6 and res["decisive_agreed"] == res["decisive"]
    assert res["tokens"] == res["fused_tokens"] and len(res["tokens"]) == 6
    assert all(len(t) == 2 for t in res["tokens"]) and res["max_logit_diff"] == 0.0
    assert res["min_margin"] >= 0 and set(res["step_ms"]) == {"stock", "fused"}


def test_greedy_teacher_forces_past_a_flipped_token(small):
    calls = []
    span = 8 + 5

    def flipped(x, step, caches):
        """The stock forward, whose output at the third step is replaced by
        the hidden state of another token (so its argmax changes; its K/V go
        to spare caches, so later steps are the stock ones)."""
        out = small.forward(x, step, caches)
        calls.append(1)
        if len(calls) == 3:
            other = small.forward(small.embed_tokens(torch.tensor([7])), step, _caches(small, span))
            return other.expand_as(out).clone()
        return out

    res = greedy(small, small.forward, flipped, _caches(small, span), _caches(small, span), torch.tensor([1]),
                 8, 5, span, margin=0.0)
    stock = greedy(small, small.forward, small.forward, _caches(small, span), _caches(small, span),
                   torch.tensor([1]), 8, 5, span)
    assert res["tokens"] == stock["tokens"]  # the stock path's tokens are fed to both
    if res["fused_tokens"][2] == res["tokens"][2]:  # token 7's state happened to pick the same token
        pytest.skip("the substituted state picked the stock token")
    assert [i for i, _ in res["differ"]] == [2] and res["agreed"] == 4 and res["differ"][0][1] >= 0
    # A margin of 0 makes every step decisive: the flipped one is counted as such.
    assert res["decisive"] == 5 and res["decisive_agreed"] == 4 and res["near_ties"] == 0
    assert res["hidden_mismatches"] > 0 and res["max_logit_diff"] > 0
    loose = greedy(small, small.forward, flipped, _caches(small, span), _caches(small, span), torch.tensor([1]),
                   8, 5, span, margin=1e9)
    assert loose["near_ties"] == 5 and loose["decisive"] == 0
    with pytest.raises(ValueError):
        greedy(small, small.forward, small.forward, [], [], torch.tensor([1]), 8, 0, span)


def test_the_demo_imports_dspark_comm_only_for_tp():
    code = "import sys, dspark_core.demo; print('dspark_comm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_demo_tp2_on_the_cpu_runs_the_tp1_demo(tmp_path, capsys):
    """``--tp 2 --device cpu`` spawns no rank (they are one per CUDA GPU),
    whatever the machine has: the TP1 demo, and what a rank would run."""
    from dspark_core import demo

    cfg = tmp_path / "small.json"
    cfg.write_text(small_config(num_layers=1).to_json())
    assert demo.main(["--tp", "2", "--config", str(cfg), "--steps", "1", "--context", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "--tp 2 needs 2 CUDA GPUs and --device cpu asks for none: running the TP1 demo" in out
    assert "spec path, dspark-core's spec of vLLM's arithmetic (eager PyTorch): 1 greedy steps of 1 token(s)" in out
    assert "What a rank of TP2 would run with the installed backends:" in out


def test_demo_tp_names_dspark_comm_when_no_backend_provides_it(monkeypatch, capsys, tmp_path):
    """With two GPUs but no installed TP demo (the ``dspark.tp_demos`` entry
    point), the demo says which package to install, in one line, exit 2."""
    from dspark_core import demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(demo, "entry_points", lambda group: [])
    cfg = tmp_path / "small.json"
    cfg.write_text(small_config(num_layers=1).to_json())
    assert demo.main(["--tp", "2", "--config", str(cfg)]) == 2
    assert "pip install ./packages/dspark-comm" in capsys.readouterr().err


def test_the_tp_demo_is_found_through_its_entry_point():
    from importlib.metadata import entry_points

    from dspark_comm.demo_tp2 import run_tp2_demo

    demos = [ep for ep in entry_points(group="dspark.tp_demos") if ep.name == "comm"]
    assert demos and demos[0].load() is run_tp2_demo


def test_run_tp2_demo_refusals():
    from dspark_comm.demo_tp2 import run_tp2_demo

    with pytest.raises(ValueError, match="block"):
        run_tp2_demo(small_config(), 1, 17, 4)
    with pytest.raises(ValueError, match="TP2 does not divide"):
        run_tp2_demo(small_config(num_kv_heads=1), 1, 1, 4)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs 2 CUDA GPUs"):
            run_tp2_demo(small_config(), 1, 1, 4)


def _benchmark(name: str):
    """The benchmark script ``name`` of dspark-comm, imported as a module."""
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_bench_draft_tp2_report(tmp_path):
    bench = _benchmark("bench_draft_tp2")
    raw = []
    for r in range(2):
        res = {"build_s": 9.0, "prepare_s": 20.0, "floor": 238.4, "device": "NVIDIA H200", "status": 0,
               "layers": 2}
        for i, m in enumerate(bench.ROWS):
            res.update({f"stock/{m}": 400.0 + i + r, f"spec/{m}": 300.0 + i, f"gemms/{m}": 250.0 + i,
                        f"package/{m}": "failed to capture: RuntimeError: boom", f"one_row/{m}": 290.0 + i})
        raw.append(res)
    text = bench._report(raw, str(tmp_path), 50, ["o_gate"])
    assert (tmp_path / "draft_tp2.md").read_text() == text.split("\n(matplotlib")[0]
    assert "| 1 | 401.0 | 300.0 | failed to capture | 290.0 | 250.0 | 238.4 | 1.34x | - | 1.38x |" in text
    assert "Failures: failed to capture: RuntimeError: boom" in text and "excluded: o_gate" in text
    json.dumps(raw)  # the raw results are JSON as the ranks write them


def test_bench_package_gemm_report_judges_the_publish_kernel(tmp_path):
    bench = _benchmark("bench_package_gemm")
    raw = []
    for r in range(2):
        res = {f"shape/{k}": "k_warps 4, stages 4" for k in bench.KS}
        for k in bench.KS:
            for m in bench.ROWS:
                res.update({f"{key}/{k}/{m}": 10.0 + r for _, key in bench.CASES})
                res[f"cublas/{k}/{m}"] = 5.0
                res[f"publish_kernel/{k}/{m}"] = 4.0 if m < 16 else 6.0 + r
                res[f"publish_graph/{k}/{m}"] = 4.5 if k != 8192 else 5.0 + r
                res[f"gemm_kernel/{k}/{m}"] = 12.0 if m == 1 else 9.0
                # Rounds: cuBLAS 5.0 throughout; the publish 4.9 but for one round (5.2, rank 1 only)
                # at m = 16, and slower in every round at K = 4096, m = 4; one rank failed at K 8192 m 1.
                res[f"rounds_cublas/{k}/{m}"] = [5.0] * 5
                res[f"rounds_publish/{k}/{m}"] = [4.9, 4.9, 5.2 if (m == 16 and r) else 4.9, 4.9, 4.9]
                if (k, m) == (4096, 4):
                    res[f"rounds_publish/{k}/{m}"] = [5.1] * 5
                # The warp-count twin: not run at K = 1024 ("-"); 4.8 (faster than both) but 5.3 at m = 16.
                res[f"rounds_publish_kw/{k}/{m}"] = "-" if k == 1024 else [4.8, 4.8, 4.8, 4.8, 5.3 if m == 16 else 4.8]
        res["rounds_cublas/8192/1"] = "failed: RuntimeError: boom" if r else [5.0] * 5
        raw.append(res)
    text = bench._report(raw, str(tmp_path))
    # The slower rank's figure, and the target judged on the publish kernel alone.
    assert ("| package GEMM with publish: its kernel alone (profiler; epochs before the main loop, the default) "
            "| 4.00 | 4.00 | 7.00 |") in text
    # Per call in a graph: 4.5 (K < 8192) and 6.0 (the slower rank at K = 8192) against cuBLAS's 5.0.
    assert "no slower than cuBLAS alone: met at 6 of 9 (K, m) per call in a CUDA graph (the draft's setting); " \
           "by the median over the alternating rounds:" in text
    assert " rounds; met at 6 of 9 (K, m) by the publish-mode kernel's own time;" in text
    # The rounds: the slower rank per round, the median over the rounds (4.90 at m = 16: one round of 5).
    assert ("| package GEMM with publish alone, alternating rounds (median over the rounds) "
            "| 4.90 | 4.90 | 4.90 | 4.90 | 5.10 | 4.90 | 4.90 | 4.90 | 4.90 |") in text
    assert "| cuBLAS, alternating rounds (median over the rounds) | failed: RuntimeError: boom |" not in text
    assert "| 5.00 | 5.00 | 5.00 | failed: RuntimeError: boom | 5.00 | 5.00 |" in text
    assert ("by the median over the alternating rounds: met at 7 of 9 (K, m); the publish no slower in "
            "K 1024 m 1: 5 of 5, K 1024 m 4: 5 of 5, K 1024 m 16: 4 of 5, K 4096 m 1: 5 of 5, K 4096 m 4: 0 of 5, "
            "K 4096 m 16: 4 of 5, K 8192 m 1: failed, K 8192 m 4: 5 of 5, K 8192 m 16: 4 of 5 rounds;") in text
    # The twin: "-" at K = 1024 (the policy's publish counts there); 4.8 everywhere by the median, so it meets
    # the target where the publish (5.1 at K 4096 m 4) did not; K 8192 m 1 has no cuBLAS rounds (failed).
    assert ("| the same at the other warp count (4 <-> 8; the ring only), alternating rounds "
            "| - | - | - | 4.80 |") in text
    assert ("at the other warp count (the ring's shards): by the median over the rounds met at 8 of 9 (K, m) "
            "(the policy's publish where it has no twin); no slower than the policy's publish in K 4096 m 1: 5 of 5, "
            "K 4096 m 4: 5 of 5, K 4096 m 16: 4 of 5, K 8192 m 1: 5 of 5, K 8192 m 4: 5 of 5, "
            "K 8192 m 16: 4 of 5 rounds.") in text
    assert "(a stricter reading): met at 0 of 9 (K, m)" in text
    # Like for like: the publish kernel (4.0 / 7.0) against cuBLAS's own device time (10.0 / 11.0 here);
    # the plain kernel (12.0 at m = 1, else 9.0) likewise.
    assert "both profiled): met at 9 of 9 (K, m); the plain kernel's: 6 of 9;" in text
    # The one-row GEMV's row (10.0 / 11.0 at m = 1) replaces the publish kernel there: m = 1 then misses.
    assert "(one_row_gemv=True; the policy's kernel above): met at 3 of 9 (K, m)" in text


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="a two-GPU machine runs them")
@pytest.mark.parametrize("name", ["bench_allreduce_boundary", "bench_package_gemm", "bench_draft_tp2"])
def test_tp2_benchmarks_say_they_need_two_gpus(name, tmp_path, caplog, monkeypatch):
    """With fewer than two GPUs each TP2 benchmark says so (a warning of
    ``dspark.ranks``) and exits 0, spawning nothing and writing no result file."""
    monkeypatch.setattr(sys, "argv", [name, "--out", str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="dspark.ranks"):
        assert _benchmark(name).main() == 0
    assert "needs two CUDA GPUs; skipped" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_bench_draft_tp2_graphs_several_steps():
    """``_steps``: the step run ``count`` times on the same inputs, the last
    output returned (several steps per timed graph amortize the ranks' skew)."""
    bench = _benchmark("bench_draft_tp2")
    calls = []

    def step(hidden, s, caches):
        calls.append((hidden, s, caches))
        return len(calls)

    assert bench._steps(step, 4)("h", "s", "c") == 4
    assert calls == [("h", "s", "c")] * 4
    assert bench._steps(step, 1)("h", "s", "c") == 5


def test_record_case_and_slower_rank():
    """A benchmark case that raises leaves its words in its cell, the others
    run; a table cell is the slower rank's time, or the first failure."""
    from dspark_comm.runtime.ranks import record_case, slower_rank

    results = {}
    record_case(results, "a", lambda: 3.5)
    record_case(results, "b", lambda: 1 / 0)
    record_case(results, "c", lambda: (_ for _ in ()).throw(RuntimeError("x" * 500)))
    assert results["a"] == 3.5
    assert results["b"] == "failed: ZeroDivisionError: division by zero"
    assert results["c"].startswith("failed: RuntimeError: xxx") and len(results["c"]) == 200
    assert slower_rank([{"k": 2.0}, {"k": 2.25}], "k") == (2.25, "2.25")
    assert slower_rank([{"k": 2.0}, {"k": "failed: boom"}], "k") == (None, "failed: boom")
    assert slower_rank([{"k": 1.0}], "k", "{:.1f}") == (1.0, "1.0")
