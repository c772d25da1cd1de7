"""On an H200: the DSpark plugin's whole draft step against vLLM 0.33.0's,
assembled from its own binaries (benchmarks/bench_draft_step.py at a few row
counts, fresh weights and operands each run): every part DSpark runs its own
kernel on, and the whole step (backbone output, base logits, draft tokens, KV
caches), bit for bit, with vLLM's Markov loop and with the fused one."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from stock import stock_or_skip

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_draft_step.py"
OWN_KERNELS = {"embed", "input_norm", "qk_front", "o_gate", "boundary", "activation"}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_draft_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_draft_step"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("markov", ["stock", "fused"])
def test_the_plugins_step_is_vllms_bit_for_bit(tmp_path, seed, markov):
    stock_or_skip()
    bench = _bench()
    # 1 request of 1 token, 3 and 33 requests of 4 (odd counts: partial tiles).
    rc = bench.main(["--rows", "1,12,132", "--context", "40", "--replays", "2", "--rounds", "1", "--markov", markov,
                     "--seed", str(seed), "--out", str(tmp_path)])
    data = json.loads((tmp_path / "draft_step.json").read_text())
    assert [r["m"] for r in data["results"]] == [1, 12, 132]
    for r in data["results"]:
        compared = {p["kind"] for p in r["parts"] if p["differing"] is not None}
        assert compared == OWN_KERNELS | {"context"} | ({"markov"} if markov == "fused" else set())
        bad = {p["part"]: p["differing"] for p in r["parts"] if p["differing"]}
        assert not bad, f"m={r['m']}: differing elements {bad}"
        for what, (count, total) in r["whole_step_differing"].items():
            assert total > 0 and count == 0, f"m={r['m']}: {what}: {count} of {total} differ"
    assert "Fallbacks: none." in data["meta"]["notes"]
    assert rc == 0
