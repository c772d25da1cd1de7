"""A pytest plugin for refactoring kernels without a GPU: it records a sha256
of every PTX the compile tests produce (``dspark_cute.runtime.host.compile_ptx``),
per test, with kernel symbols and comments normalised, into the JSON file
named by ``PTXPIN_OUT``. Run the compile tests before and after a change and
compare the two files: equal hashes mean byte-identical PTX, so the GPU
validation of the kernels still holds.

    PTXPIN_OUT=before.json PYTHONPATH=scripts:packages/dspark-comm/tests \\
        python -m pytest -q -p ptx_pin -m compile packages/dspark-cute/tests packages/dspark-comm/tests
    # ... change, then the same with PTXPIN_OUT=after.json, then:
    python scripts/ptx_pin.py before.json after.json
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
from collections import Counter

RESULTS: dict[str, str] = {}
_current = {"id": None, "n": 0}


def normalised(ptx: str) -> str:
    """``ptx`` without comments, its kernel symbols (they carry the Python
    module's and object's names) replaced by ``K``."""
    body = re.sub(r"kernel_cutlass_kernel_\w+", "K", ptx)
    return "\n".join(line.split("//")[0] for line in body.splitlines())


def pytest_configure(config) -> None:
    if not os.environ.get("PTXPIN_OUT"):
        return
    import dspark_cute.runtime.host as host

    real = host.compile_ptx

    def recording(obj, *args, **kwargs):
        ptx = real(obj, *args, **kwargs)
        _current["n"] += 1
        key = f"{_current['id']}#{_current['n']}"
        RESULTS[key] = hashlib.sha256(normalised(ptx).encode()).hexdigest()[:16]
        return ptx

    host.compile_ptx = recording


def pytest_runtest_setup(item) -> None:
    _current["id"], _current["n"] = item.nodeid, 0


def pytest_unconfigure(config) -> None:
    out = os.environ.get("PTXPIN_OUT")
    if out and RESULTS:
        # Under pytest-xdist every worker records its own tests: one file each.
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(f"{out}.{worker}" if worker else out, "w") as f:
            json.dump(RESULTS, f, indent=0, sort_keys=True)


def load(path: str) -> dict[str, str]:
    """A recording: ``path`` itself, or the per-worker files ``path.gw*``."""
    merged: dict[str, str] = {}
    for name in [path] if os.path.exists(path) else sorted(glob.glob(path + ".gw*")):
        with open(name) as f:
            merged.update(json.load(f))
    if not merged:
        raise SystemExit(f"no recording at {path}")
    return merged


def main(argv: list[str]) -> int:
    """Compare two recordings: print the PTX that differ by test; then, for
    tests that were moved or renamed, whether the two recordings hold the
    same PTX at all (the multiset of hashes). Exit 1 if the PTX differ."""
    before, after = (load(path) for path in argv[1:3])
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    print(f"{len(before)} before, {len(after)} after, {len(changed)} differ under the same test")
    for key in changed:
        print(f"  {key}: {before[key]} -> {after[key]}")
    gone = Counter(before.values()) - Counter(after.values())
    new = Counter(after.values()) - Counter(before.values())
    print(f"{sum(gone.values())} PTX only before, {sum(new.values())} only after (by hash, whatever the test)")
    for digest in sorted(gone):
        print(f"  only before: {digest} ({', '.join(k for k, v in before.items() if v == digest)})")
    for digest in sorted(new):
        print(f"  only after: {digest} ({', '.join(k for k, v in after.items() if v == digest)})")
    return 1 if changed or gone or new else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
