"""The stock vLLM 0.33.0 kernels for the GPU tests: ``scripts/stock/launch_stock.py``
over the binaries ``scripts/stock/compile_stock.py`` writes (``.device/stock``,
or ``DSPARK_STOCK_DIR``), so each fused kernel is compared with the real stock
kernel on the same operands, not only with the spec.

``stock_ops()`` is that module, or None where the binaries are absent; the
``stock`` fixture skips the test then, saying how to build them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LAUNCHER = ROOT / "scripts" / "stock" / "launch_stock.py"


def stock_dir() -> Path:
    return Path(os.environ.get("DSPARK_STOCK_DIR", ROOT / ".device" / "stock"))


def stock_ops():
    """``launch_stock`` (its ``stock_*`` functions), or None without the binaries."""
    if not (stock_dir() / "manifest.json").is_file():
        return None
    spec = importlib.util.spec_from_file_location("launch_stock", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def stock():
    ops = stock_ops()
    if ops is None:
        pytest.skip(f"no stock binaries in {stock_dir()}: run scripts/stock/compile_stock.py with vLLM 0.33.0's "
                    "venv and carry .device/stock")
    return ops
