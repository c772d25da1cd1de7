"""Helpers for auditing the PTX of DSpark kernels (and of other kernels built
on dspark-cute): the text without comments, pattern counts, ptxas's
resource report, and the machine code's instructions on either side of the
PDL wait (``sass_around_wait``). ``host.compile_ptx`` gives the PTX on a CPU
machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def skip_audit_off_pin(what: str) -> None:
    """Skip the rest of a PTX audit written against CuTe DSL 4.8's code
    generation (vLLM 0.33.0's pin, the DSL of every GPU run) under another
    DSL of the supported range (the compile-cute sessions: 4.3.5), once the
    kernel has compiled there, which is what those sessions check. Under
    4.3.5 the newer kernels' PTX differs in shape (a parameter loaded twice,
    another compare for the last CTA, the zero-sign add not in the form the
    audit reads), not checked on a GPU."""
    from importlib.metadata import version

    import pytest

    found = version("nvidia-cutlass-dsl")
    if not found.startswith("4.8."):
        pytest.skip(f"{what}: its PTX is audited under CuTe DSL 4.8 (vLLM 0.33.0's pin); {found} compiled it")


def code(ptx: str) -> str:
    """``ptx`` with its ``//`` comments removed (so a comment cannot match)."""
    return "\n".join(line.split("//")[0] for line in ptx.splitlines())


def count(body: str, pattern: str) -> int:
    """How many times the regular expression ``pattern`` matches ``body``
    (multi-line mode)."""
    return len(re.findall(pattern, body, flags=re.MULTILINE))


def ptxas_candidates() -> list[str]:
    """Every ptxas this interpreter can reach: ``DSPARK_PTXAS``, the CUDA
    wheels' (``nvidia-cuda-nvcc``: CuTe DSL 4.8 writes PTX 9.4, which the
    CUDA 13.0 toolkit's ptxas cannot read), Triton's, then ``PATH``'s."""
    found = [os.environ.get("DSPARK_PTXAS")]
    for site in map(Path, sys.path):
        found += sorted(str(p) for p in site.glob("nvidia/cu*/bin/ptxas"))
        found += sorted(str(p) for p in site.glob("nvidia/cuda_nvcc/bin/ptxas"))
        found.append(str(site / "triton" / "backends" / "nvidia" / "bin" / "ptxas-blackwell"))
    found.append(shutil.which("ptxas"))
    return list(dict.fromkeys(exe for exe in found if exe and Path(exe).is_file()))


def ptxas_report(ptx: str, arch: str, workdir: str | Path) -> str:
    """ptxas's verbose report (registers, spills) of ``ptx`` for ``arch``
    from the first ptxas (``ptxas_candidates``) that reads the PTX's
    ``.version``; "" where none is installed. RuntimeError if every one
    rejects it, or one rejects it for another reason."""
    workdir = Path(workdir)
    src = workdir / f"k_{arch}.ptx"
    src.write_text(ptx)
    rejected = []
    for exe in ptxas_candidates():
        r = subprocess.run([exe, "-v", f"-arch={arch}", str(src), "-o", str(workdir / "k.cubin")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return r.stderr
        if "Unsupported .version" in r.stderr or "not defined for" in r.stderr:
            rejected.append(f"{exe}: {r.stderr.strip().splitlines()[0]}")
            continue
        raise RuntimeError(f"{exe} rejected the PTX: {r.stderr}")
    if rejected:
        raise RuntimeError("no installed ptxas reads this PTX (pip install nvidia-cuda-nvcc): " + "; ".join(rejected))
    return ""


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


def assert_strides_address(body: str, params: list[int], what: str) -> None:
    """Each kernel parameter in ``params`` (by index: the cache's byte
    strides) is loaded once and enters 64-bit address arithmetic (an operand
    of ``mad.lo.s64``, ``mul.lo.s64``, ``add.s64`` or ``shl.b64``): the cache
    is addressed through its strides, not a layout fixed at compile time."""
    for index in params:
        loads = re.findall(rf"ld\.param\.\w+\s+(%rd\d+),\s*\[\w+_param_{index}\]", body)
        assert len(loads) == 1, f"{what}: parameter {index} loaded {len(loads)} times"
        uses = re.findall(rf"\b(?:mad\.lo\.s64|mul\.lo\.s64|add\.s64|shl\.b64)\s+[^;]*{re.escape(loads[0])}\b",
                          body)
        assert uses, f"{what}: stride parameter {index} ({loads[0]}) enters no address"


def nvcc_ptx(body: str, workdir: str | Path, arch: str = "sm_90a") -> str | None:
    """The PTX nvcc (no fast math) writes for the kernel ``extern "C"
    __global__ void k(float* o, const float* i) { body }``, or None where no
    nvcc is installed (``PATH``, then ``/usr/local/cuda*``)."""
    nvcc = shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
    if nvcc is None:
        return None
    workdir = Path(workdir)
    src, out = workdir / "k.cu", workdir / "k.ptx"
    src.write_text('extern "C" __global__ void k(float* o, const float* i) { ' + body + " }\n")
    r = subprocess.run([nvcc, f"-arch={arch}", "-ptx", str(src), "-o", str(out)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed: {r.stderr}")
    return out.read_text()



def nvdisasm() -> str | None:
    """An ``nvdisasm`` this interpreter can reach (``nvidia-cuda-nvdisasm``'s, Triton's, ``PATH``'s), or None."""
    found = []
    for site in map(Path, sys.path):
        found += sorted(str(p) for p in site.glob("nvidia/cu*/bin/nvdisasm"))
        found += sorted(str(p) for p in site.glob("nvidia/cuda_nvdisasm/bin/nvdisasm"))
        found.append(str(site / "triton" / "backends" / "nvidia" / "bin" / "nvdisasm"))
    found.append(shutil.which("nvdisasm"))
    return next((exe for exe in found if exe and Path(exe).is_file()), None)


def sass_around_wait(ptx: str, arch: str, workdir: str | Path) -> tuple[dict, dict] | None:
    """The machine code ptxas makes of ``ptx`` for ``arch`` (``ptxas_report``'s
    ptxas), its instructions counted by opcode (with their modifiers, e.g.
    ``LDGSTS.E.BYPASS.128``) before and after the first ``ACQBULK``
    (``griddepcontrol.wait``); None where no ptxas or nvdisasm is installed.
    What matters for PDL is where ptxas put a load, not where the PTX did: it
    may move a load across the wait."""
    exe = nvdisasm()
    if exe is None or not ptxas_report(ptx, arch, workdir):
        return None
    out = subprocess.run([exe, "-c", str(Path(workdir) / "k.cubin")], capture_output=True, text=True, check=True)
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", out.stdout)]
    if "ACQBULK" not in ops:
        raise RuntimeError("no griddepcontrol.wait (ACQBULK) in the machine code")
    cut = ops.index("ACQBULK")
    before, after = {}, {}
    for i, op in enumerate(ops):
        side = before if i < cut else after
        side[op] = side.get(op, 0) + 1
    return before, after


def ops_like(census: dict, prefix: str) -> int:
    """How many instructions of ``census`` (``sass_around_wait``) have an opcode starting with ``prefix``."""
    return sum(n for op, n in census.items() if op.startswith(prefix))


def census_or_skip(ptx: str, arch: str, workdir: str | Path) -> tuple[dict, dict]:
    """``sass_around_wait`` of a kernel that has compiled, in a test: skipped
    off CuTe DSL 4.8 (``skip_audit_off_pin``) and where no ptxas or nvdisasm
    is installed."""
    import pytest

    skip_audit_off_pin("the machine-code audit")
    found = sass_around_wait(ptx, arch, workdir)
    if found is None:
        pytest.skip("no ptxas or nvdisasm installed (pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm)")
    return found
