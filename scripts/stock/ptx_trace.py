#!/usr/bin/env python
"""Print the floating-point expression a straight-line PTX kernel computes.

Audit helper for /work/notes/stock-numerics.md: symbolically evaluates the
f32 / f32x2 arithmetic of a (branch-free) Triton PTX file and prints, for each
``st.shared`` and for the first instruction whose opcode starts with
``--stop`` (default ``rsqrt.approx``), the expression tree of its input, e.g.

    st.shared <- ((fma(L0.0lo,L0.0lo,(L0.0hi*L0.0hi))+fma(...)) + ...)

Leaves: ``Lk.i`` is 32-bit lane ``i`` of the k-th ``ld.global`` of the file
(``lo``/``hi``: the bf16 halves of that lane, in memory order); ``SMEM.i`` a
shared-memory load; ``bflyN[e]``: ``e`` from lane ``tid ^ N``. Constants print
as Python floats. Usage: ``ptx_trace.py kernel.ptx [--stop OPCODE_PREFIX]``.
"""

from __future__ import annotations

import argparse
import re
import struct


def trace(ptx: str, stop: str = "rsqrt.approx") -> list[str]:
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    env: dict[str, object] = {}
    out: list[str] = []
    nload = 0

    def val(r: str):
        r = r.strip()
        if r.startswith("0f"):
            return repr(struct.unpack(">f", bytes.fromhex(r[2:]))[0])
        return env.get(r, r)

    for raw in body.splitlines():
        line = raw.split("//")[0].strip().rstrip(";")
        if not line or line.startswith((".", "$", "{", "}")):
            continue
        m = re.match(r"(@%p\d+\s+)?([\w.:]+)\s+(.*)", line)
        if not m:
            continue
        op, args = m.group(2), m.group(3)
        if op.startswith(("ld.global", "ld.shared")):
            dest = args.split("[")[0]
            tag = f"L{nload}" if op.startswith("ld.global") else "SMEM"
            for i, r in enumerate(re.findall(r"%r\d+", dest)):
                env[r] = f"{tag}.{i}"
            nload += op.startswith("ld.global")
            continue
        if op.startswith("st.shared"):
            out.append(f"st.shared <- {val(args.split(',')[-1])}")
            continue
        parts = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        if op == "mov.b32" and parts[0].startswith("{"):  # unpack two 16-bit halves
            lo, hi = re.findall(r"%rs\d+", parts[0])
            v = val(parts[1])
            env[lo], env[hi] = f"{v}lo", f"{v}hi"
        elif op == "mov.b64" and parts[0].startswith("{"):  # unpack an f32x2 pair
            a, b = re.findall(r"%r\d+", parts[0])
            v = env.get(parts[1])
            env[a], env[b] = v if isinstance(v, tuple) else (f"{v}.x", f"{v}.y")
        elif op == "mov.b64" and parts[1].startswith("{"):  # pack an f32x2 pair
            a, b = re.findall(r"%r\d+", parts[1])
            env[parts[0]] = (val(a), val(b))
        elif op.endswith("f32x2"):
            a = [env.get(p, (p + ".x", p + ".y")) for p in parts[1:]]
            kind = op.split(".")[0]
            env[parts[0]] = tuple(
                f"fma({a[0][i]},{a[1][i]},{a[2][i]})" if kind == "fma"
                else f"({a[0][i]}{'+' if kind == 'add' else '*'}{a[1][i]})" for i in range(2))
        elif op.startswith(("cvt.f32.bf16", "cvt.f32.f16")) or op in ("mov.b32", "mov.u32"):
            env[parts[0]] = val(parts[1])
        else:
            d, a = parts[0], [val(p) for p in parts[1:]]
            if op.startswith("mul"):
                env[d] = f"({a[0]}*{a[1]})"
            elif op.startswith("add"):
                env[d] = f"({a[0]}+{a[1]})"
            elif op.startswith("sub"):
                env[d] = f"({a[0]}-{a[1]})"
            elif op.startswith("fma"):
                env[d] = f"fma({a[0]},{a[1]},{a[2]})"
            elif op.startswith("div"):
                env[d] = f"div({a[0]},{a[1]})"
            elif op.startswith("shfl.sync.bfly"):
                env[d] = f"bfly{a[1]}[{a[0]}]"
            elif op.startswith(("rsqrt", "sqrt", "ex2", "rcp")):
                env[d] = f"{op.split('.')[0]}({a[0]})"
            if op.startswith(stop):
                out.append(f"{op} <- {a[0]}")
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ptx")
    ap.add_argument("--stop", default="rsqrt.approx")
    args = ap.parse_args()
    with open(args.ptx) as f:
        for line in trace(f.read(), args.stop):
            print(line)


if __name__ == "__main__":
    main()
