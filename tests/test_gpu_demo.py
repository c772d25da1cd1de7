"""GPU: the demo's comparison with vLLM's draft step from its binaries
(dspark_core.demo on the reference draft's sizes, fresh weights and inputs
per seed): the specialized decode and StockStep on the staged binaries
(.device/stock or DSPARK_STOCK_DIR) give the same hidden states bit for bit
and the same tokens at every step, both timed in CUDA graphs, no part
falling back. Skipped where the binaries are not staged (the reason said)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from dspark_core import demo, demo_stock
from dspark_core.reference.config import DraftConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nox -s tests-sm90)"),
]

SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
print(f"DSPARK_SEED={SEED}")


def test_the_demo_matches_vllms_step_from_its_binaries(capsys, caplog):
    stock_dir = demo_stock.default_stock_dir()
    why = demo_stock.missing_reason(stock_dir)
    if why is not None:
        pytest.skip(why)
    # The stock binaries are compiled for the reference draft's sizes (compile_stock.py's defaults).
    config = DraftConfig(seed=SEED % 10_000)
    block = 4  # steps of 4 rows (the demo step of gpu-check.sh runs 1)
    with caplog.at_level(logging.WARNING, logger="dspark"):
        tokens = demo.run_demo(config, 3, block, 64, torch.device("cuda"), stock_dir=stock_dir)
    out = capsys.readouterr().out
    assert set(tokens) == {"stock", "specialized"}, out[-3000:]
    assert tokens["stock"] == tokens["specialized"]
    summary = out.strip().splitlines()[-1]
    assert "hidden states are bit for bit equal with vLLM's step from its binaries'; tokens equal" in summary, summary
    assert "x as fast as vLLM's (medians of CUDA graph replays)" in summary
    assert "no speed ratio" not in out
    assert not [r.getMessage() for r in caplog.records if "ran stock" in r.getMessage()]
