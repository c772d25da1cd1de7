#!/usr/bin/env python
"""Print the floating-point expression a straight-line PTX kernel computes.

Audit helper for the spec's stock numerics (``dspark_core.spec``; the trees come from
``ptx_expr.trace``): prints, for each ``st.shared`` and for the first
instruction whose opcode starts with ``--stop`` (default ``rsqrt.approx``),
the expression tree of its input, e.g.

    st.shared <- ((fma(P0L0.0lo,P0L0.0lo,(P0L0.0hi*P0L0.0hi))+fma(...)) + ...)

Leaves: ``P<p>L<k>.<i>`` is 32-bit lane ``i`` of the ``k``-th ``ld.global``
from kernel parameter ``p`` (``lo``/``hi``: the bf16 halves of that lane, in
memory order); ``SMEM.<n>`` a shared-memory load; ``bfly<N>[e]``: ``e`` from
lane ``tid ^ N``; ``param<n>`` a scalar parameter. Constants print as Python
floats. With ``--stores`` it also prints every ``st.global`` value.
Usage: ``ptx_trace.py kernel.ptx [--stop OPCODE_PREFIX] [--stores]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ptx_expr import fmt  # noqa: E402
from ptx_expr import trace as trace_tree  # noqa: E402


def trace(ptx: str, stop: str = "rsqrt.approx", stores: bool = False) -> list[str]:
    """The printed lines: each ``st.shared`` value, the first ``stop`` call's
    argument, then (``stores``) each ``st.global``'s values."""
    t = trace_tree(ptx)
    out = [f"st.shared <- {fmt(v)}" for v in t.shared_stores]
    for name, calls in t.calls.items():
        if name.startswith(stop) and calls:
            out.append(f"{name} <- {fmt(calls[0][0])}")
            break
    if stores:
        for param, vals in t.global_stores:
            out.append(f"st.global param{param} <- " + ", ".join(fmt(v) for v in vals))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ptx")
    ap.add_argument("--stop", default="rsqrt.approx")
    ap.add_argument("--stores", action="store_true")
    args = ap.parse_args()
    with open(args.ptx) as f:
        for line in trace(f.read(), args.stop, args.stores):
            print(line)


if __name__ == "__main__":
    main()
