"""Helpers for auditing the PTX of DSpark kernels (and of other kernels built
on dspark-cute): the text without comments, pattern counts, and ptxas's
resource report. ``host.compile_ptx`` gives the PTX on a CPU machine."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def code(ptx: str) -> str:
    """``ptx`` with its ``//`` comments removed (so a comment cannot match)."""
    return "\n".join(line.split("//")[0] for line in ptx.splitlines())


def count(body: str, pattern: str) -> int:
    """How many times the regular expression ``pattern`` matches ``body``
    (multi-line mode)."""
    return len(re.findall(pattern, body, flags=re.MULTILINE))


def ptxas_report(ptx: str, arch: str, workdir: str | Path) -> str:
    """ptxas's verbose report (registers, spills) of ``ptx`` for ``arch``, or
    "" where ptxas is not installed. Raises RuntimeError if ptxas rejects it."""
    if shutil.which("ptxas") is None:
        return ""
    workdir = Path(workdir)
    src = workdir / f"k_{arch}.ptx"
    src.write_text(ptx)
    r = subprocess.run(["ptxas", "-v", f"-arch={arch}", str(src), "-o", str(workdir / "k.cubin")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas rejected the PTX: {r.stderr}")
    return r.stderr


# What a ptxas -v report counts in bytes per function (spill_bytes).
REPORT_BYTES = ("spill stores", "spill loads", "stack frame")


def spill_bytes(report: str, what: str = "spill stores") -> int:
    """The most bytes of ``what`` (``REPORT_BYTES``: spill stores, spill
    loads, stack frame) of any function in a ptxas ``-v`` report
    (``ptxas_report``; 0 for an empty one). Parsed, not matched as text:
    "160 bytes spill stores" contains "0 bytes spill stores"."""
    if what not in REPORT_BYTES:
        raise ValueError(f"a ptxas report counts the bytes of {', '.join(REPORT_BYTES)}, not {what!r}")
    return max((int(b) for b in re.findall(rf"(\d+) bytes {what}", report)), default=0)
