"""Package metadata for the packages' ``src/`` folders on a machine where they
are put on ``PYTHONPATH`` instead of installed (the device machines have no
network, so nothing is pip-installed there).

DSpark finds its kernel backends and TP demos through entry points
(``dspark.kernels``, ``dspark.tp_demos``), which ``importlib.metadata`` reads
from installed distributions. This writes one minimal ``*.dist-info`` folder
per package (``METADATA`` and ``entry_points.txt``, from its
``pyproject.toml``) into a folder; with that folder on ``PYTHONPATH`` too,
the entry points resolve as if the packages were installed.

    python scripts/dev_entry_points.py OUT_DIR     # prints OUT_DIR
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def write(out: Path) -> Path:
    """Write the metadata of every package under ``packages/`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        name = project["name"]
        init = pyproject.parent / "src" / name.replace("-", "_") / "__init__.py"
        found = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M)
        version = project.get("version") or (found.group(1) if found else "0")
        info = out / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = []
        for group, entries in project.get("entry-points", {}).items():
            lines.append(f"[{group}]")
            lines += [f"{key} = {value}" for key, value in entries.items()]
            lines.append("")
        (info / "entry_points.txt").write_text("\n".join(lines))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(write(Path(sys.argv[1])))
