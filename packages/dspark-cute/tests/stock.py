"""The stock vLLM 0.33.0 kernels for the GPU tests: ``scripts/stock/launch_stock.py``
over the binaries ``scripts/stock/compile_stock.py`` writes (``.device/stock``,
or ``DSPARK_STOCK_DIR``), so each fused kernel is compared with the real stock
kernel on the same operands, not only with the spec.

``stock_ops()`` is that module (loaded once, by ``dspark_core.demo_stock.
load_script``: the one loader of ``scripts/stock``), or None where the binaries are
absent; ``stock_or_skip()`` is it or a skip saying how to build them (and,
with ``sm90``, a skip off an sm_90 GPU: the carried binaries are sm_90a's);
the ``stock`` fixture is ``stock_or_skip(sm90=False)``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from dspark_core.demo_stock import load_script

ROOT = Path(__file__).resolve().parents[3]


def stock_dir() -> Path:
    return Path(os.environ.get("DSPARK_STOCK_DIR", ROOT / ".device" / "stock"))


@functools.cache
def stock_ops():
    """``launch_stock`` (its ``stock_*`` functions), or None without the binaries."""
    if not (stock_dir() / "manifest.json").is_file():
        return None
    return load_script("launch_stock")


def stock_manifest(part: str) -> list[dict] | None:
    """The manifest's entries of ``part`` (``gumbel``, ``unified_attention``), or None where the binaries lack them."""
    path = stock_dir() / "manifest.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(part)


def stock_part_or_skip(part: str, what: str, parts_arg: str):
    """``stock_or_skip()``, or a skip where the binaries lack ``part`` (``what``, built by
    ``compile_stock.py --parts parts_arg``)."""
    ops = stock_or_skip()
    if not stock_manifest(part):
        pytest.skip(f"{stock_dir()} has no {what}: run scripts/stock/compile_stock.py --parts {parts_arg} with "
                    "vLLM 0.33.0's venv and carry .device/stock")
    return ops


def load_compile_stock():
    """``scripts/stock/compile_stock.py`` (``load_script``); its import sets
    CUDA_VISIBLE_DEVICES where unset (for vLLM's Triton), undone here."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        return load_script("compile_stock")
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


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
