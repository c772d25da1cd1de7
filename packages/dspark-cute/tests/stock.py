"""The stock vLLM 0.33.0 kernels for the GPU tests: ``scripts/stock/launch_stock.py``
over the binaries ``scripts/stock/compile_stock.py`` writes (``.device/stock``,
or ``DSPARK_STOCK_DIR``), so each fused kernel is compared with the real stock
kernel on the same operands, not only with the spec.

``stock_ops()`` is that module (loaded once), or None where the binaries are
absent; ``stock_or_skip()`` is it or a skip saying how to build them (and,
with ``sm90``, a skip off an sm_90 GPU: the carried binaries are sm_90a's);
the ``stock`` fixture is ``stock_or_skip(sm90=False)``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
LAUNCHER = ROOT / "scripts" / "stock" / "launch_stock.py"


def stock_dir() -> Path:
    return Path(os.environ.get("DSPARK_STOCK_DIR", ROOT / ".device" / "stock"))


@functools.cache
def stock_ops():
    """``launch_stock`` (its ``stock_*`` functions), or None without the binaries."""
    if not (stock_dir() / "manifest.json").is_file():
        return None
    spec = importlib.util.spec_from_file_location("launch_stock", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stock_or_skip(sm90: bool = True):
    """``stock_ops()``, or a skip saying how to build the binaries; with
    ``sm90`` also a skip off an sm_90 GPU (an H100/H200)."""
    ops = stock_ops()
    if ops is None:
        pytest.skip(f"no stock binaries in {stock_dir()}: run scripts/stock/compile_stock.py with vLLM 0.33.0's "
                    "venv and carry .device/stock")
    if sm90 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the stock comparisons run the carried sm_90a binaries (an H100/H200)")
    return ops


@pytest.fixture(scope="session")
def stock():
    return stock_or_skip(sm90=False)
