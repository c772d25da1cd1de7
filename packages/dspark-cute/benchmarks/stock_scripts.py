"""``scripts/stock``'s modules (vLLM 0.33.0's stock from its own binaries)
loaded by path for the benchmarks, written once: ``load(name)`` (each module
once per process, registered in ``sys.modules`` so its dataclasses resolve)
and ``binaries_missing()`` (the sentence to print where ``.device/stock``
is not staged, else None)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STOCK = ROOT / "scripts" / "stock"


def load(name: str):
    """The module ``scripts/stock/<name>.py``, imported once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, STOCK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def binaries_missing() -> str | None:
    """Why the stock binaries cannot run here (a sentence), or None."""
    folder = Path(load("launch_stock").DEFAULT_DIR)
    if (folder / "manifest.json").is_file():
        return None
    return f"no stock binaries in {folder}: run scripts/stock/compile_stock.py and carry .device/stock"
