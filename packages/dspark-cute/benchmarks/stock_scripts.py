"""``scripts/stock``'s modules (vLLM 0.33.0's stock from its own binaries)
for the benchmarks: ``load(name)`` (``dspark_core.demo_stock.load_script``,
the one loader of those scripts: each module once per process, registered
in ``sys.modules`` so its dataclasses resolve) and ``binaries_missing()``
(the sentence to print where ``.device/stock`` is not staged, else None)."""

from __future__ import annotations

from pathlib import Path

from dspark_core.demo_stock import load_script as load


def binaries_missing() -> str | None:
    """Why the stock binaries cannot run here (a sentence), or None."""
    folder = Path(load("launch_stock").DEFAULT_DIR)
    if (folder / "manifest.json").is_file():
        return None
    return f"no stock binaries in {folder}: run scripts/stock/compile_stock.py and carry .device/stock"
