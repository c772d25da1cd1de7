"""The floating-point expression trees a straight-line PTX kernel computes.

An importable audit helper (``ptx_trace.py`` prints with it; the dspark-core
test ``test_stock_recompile.py`` compares its trees with the spec's). It
evaluates the f32 / f32x2 arithmetic of a branch-free (Triton) PTX entry
symbolically, per thread, and records what the thread stores and where it
calls an approximate instruction.

Nodes are tuples, ``(op, *args)``:

- ``("ld", param, k, i)``: 32-bit lane ``i`` of the ``k``-th ``ld.global``
  whose address derives from kernel parameter ``param`` (the pointer's
  provenance is followed through the integer address arithmetic);
  ``("half", node, "lo" | "hi")``: a 16-bit half of such a lane (memory
  order: ``lo`` first); ``("smem", n)``: the ``n``-th ``ld.shared``;
  ``("param", n)``: a scalar kernel parameter; ``("const", value)``: an
  immediate (a Python float for ``0f...`` literals); ``("reg", name)``: a
  register the evaluator does not model; ``("lane", node, i)``: lane ``i``
  of an f32x2 value it did not see packed;
- arithmetic, the opcode normalized (``norm_op``): ``("add", a, b)``,
  ``("mul", a, b)``, ``("sub", a, b)``, ``("fma", a, b, c)`` (round to
  nearest; ``.ftz`` or another rounding mode kept in the name, e.g.
  ``"add.ftz"``), ``("div.full", a, b)``, ``("rsqrt.approx.ftz", a)``,
  ``("sqrt.approx.ftz", a)``, ``("ex2.approx", a)``, ...;
- ``("bfly", offset, node)``: ``node`` as lane ``tid ^ offset`` holds it
  (``shfl.sync.bfly``); ``("bf16x2", hi, lo)``: ``cvt.rn.bf16x2.f32`` (the
  low half, first in memory, is its last operand); ``("bf16", a)``.

Widening conversions (``cvt.f32.bf16``, ``cvt.f32.f16``) are exact and left
out of the trees.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

Node = tuple

_APPROX = ("rsqrt", "sqrt", "ex2", "rcp", "lg2", "sin", "cos", "tanh")
_TYPES = {"f32", "f32x2", "bf16", "f16", "bf16x2", "f16x2", "b32", "b64", "s32", "u32", "f64"}


def norm_op(op: str) -> str:
    """``add.f32`` / ``add.rn.f32`` / ``add.rn.f32.bf16`` / ``add.f32x2`` ->
    ``add``; ``add.ftz.f32`` -> ``add.ftz``; ``fma.rn.f32`` -> ``fma``;
    ``div.full.f32`` -> ``div.full``; ``rsqrt.approx.ftz.f32`` ->
    ``rsqrt.approx.ftz``. (An ``add``/``mul`` without a rounding modifier may
    be contracted by ptxas into an fma with its neighbour: PTX alone cannot
    say; check the SASS.)"""
    parts = op.split(".")
    base, mods = parts[0], [p for p in parts[1:] if p not in _TYPES]
    if base in _APPROX or base == "div":
        return ".".join([base, *mods])
    mods = [m for m in mods if m != "rn"]
    return ".".join([base, *mods])


@dataclass
class Trace:
    """One thread's view of a kernel: ``shared_stores`` (each ``st.shared``
    value, in order; a vector store gives one entry per lane),
    ``global_stores`` (per ``st.global``: its parameter and lane values),
    ``calls`` (opcode -> the argument nodes of each approximate instruction
    or division, in order), and ``ops`` (every floating opcode seen, with
    counts)."""

    shared_stores: list[Node] = field(default_factory=list)
    global_stores: list[tuple[int | None, list[Node]]] = field(default_factory=list)
    calls: dict[str, list[tuple[Node, ...]]] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    loads: dict[int | None, int] = field(default_factory=dict)


def _const(tok: str):
    tok = tok.strip()
    if tok.startswith("0f") and len(tok) == 10:
        return ("const", struct.unpack(">f", bytes.fromhex(tok[2:]))[0])
    if re.fullmatch(r"-?\d+(\.\d+)?", tok):
        return ("const", float(tok))
    return None


def trace(ptx: str) -> Trace:
    """Evaluate the first ``.entry`` of ``ptx`` (straight-line code; branches
    and predicates are ignored: a predicated instruction counts as taken)."""
    start = ptx.index("{", ptx.index(".entry"))
    body = ptx[start:]
    env: dict[str, object] = {}
    taint: dict[str, int] = {}  # register -> the pointer parameter it derives from
    out = Trace()
    n_smem = 0

    def val(tok: str):
        tok = tok.strip()
        c = _const(tok)
        if c is not None:
            return c
        return env.get(tok, ("reg", tok))

    for raw in body.splitlines():
        line = raw.split("//")[0].strip().rstrip(";")
        if not line or line.startswith((".", "$", "{", "}")):
            continue
        m = re.match(r"(@!?%p\d+\s+)?([\w.:]+)\s+(.*)", line)
        if not m:
            continue
        op, args = m.group(2), m.group(3)
        if op.startswith("ld.param"):
            dest, src = [a.strip() for a in args.split(",", 1)]
            idx = int(re.search(r"_param_(\d+)", src).group(1))
            env[dest] = ("param", idx)
            taint[dest] = idx
            continue
        if op.startswith(("ld.global", "ld.shared")):
            dest, addr = args.split("[", 1)
            regs = re.findall(r"%r\d+", dest)
            if op.startswith("ld.global"):
                base = re.match(r"\s*(%rd\d+)", addr)
                param = taint.get(base.group(1)) if base else None
                k = out.loads.get(param, 0)
                out.loads[param] = k + 1
                for i, r in enumerate(regs):
                    env[r] = ("ld", param, k, i)
            else:
                for r in regs:
                    env[r] = ("smem", n_smem)
                    n_smem += 1
            continue
        if op.startswith("st.shared"):
            vals = args.split(",", 1)[1]
            out.shared_stores.extend(val(r) for r in re.findall(r"%r\d+|0f[0-9A-Fa-f]{8}", vals))
            continue
        if op.startswith("st.global"):
            addr, vals = args.split("]", 1)
            base = re.search(r"(%rd\d+)", addr)
            param = taint.get(base.group(1)) if base else None
            out.global_stores.append((param, [val(r) for r in re.findall(r"%r\d+", vals)]))
            continue
        parts = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        dest = parts[0]
        srcs = parts[1:]
        # Pointer provenance through integer address arithmetic.
        if not dest.startswith("{"):
            for s in srcs:
                if s in taint:
                    taint[dest] = taint[s]
                    break
        if op == "mov.b32" and dest.startswith("{"):  # unpack two 16-bit halves
            lo, hi = re.findall(r"%rs\d+", dest)
            v = val(srcs[0])
            env[lo], env[hi] = ("half", v, "lo"), ("half", v, "hi")
        elif op == "mov.b64" and dest.startswith("{"):  # unpack an f32x2 pair
            a, b = re.findall(r"%r\d+", dest)
            v = env.get(srcs[0])
            env[a], env[b] = v if isinstance(v, list) else (("lane", v, 0), ("lane", v, 1))
        elif op == "mov.b64" and srcs and srcs[0].startswith("{"):  # pack an f32x2 pair
            a, b = re.findall(r"%r\d+", srcs[0])
            env[dest] = [val(a), val(b)]
        elif op.endswith("f32x2"):
            pairs = [env.get(p) if isinstance(env.get(p), list) else [("lane", val(p), 0), ("lane", val(p), 1)]
                     for p in srcs]
            name = norm_op(op)
            out.ops[name + ".x2"] = out.ops.get(name + ".x2", 0) + 1
            env[dest] = [(name, *[p[i] for p in pairs]) for i in range(2)]
        elif op.startswith(("cvt.f32.bf16", "cvt.f32.f16")) or op in ("mov.b32", "mov.u32", "mov.f32"):
            env[dest] = val(srcs[0])
        elif op.startswith("cvt.rn.bf16.f32"):
            env[dest] = ("bf16", val(srcs[0]))
        elif op.startswith("cvt.rn.bf16x2.f32"):
            env[dest] = ("bf16x2", val(srcs[0]), val(srcs[1]))
            out.ops["cvt.bf16x2"] = out.ops.get("cvt.bf16x2", 0) + 1
        elif op.startswith("shfl.sync.bfly"):
            env[dest] = ("bfly", int(srcs[1]), val(srcs[0]))
        elif op.split(".")[0] in ("add", "sub", "mul", "fma", "div", *_APPROX) and (
                ".f32" in op or op.endswith(".f32")):
            name = norm_op(op)
            node = (name, *[val(s) for s in srcs])
            env[dest] = node
            out.ops[name] = out.ops.get(name, 0) + 1
            if name.split(".")[0] in (*_APPROX, "div"):
                out.calls.setdefault(name, []).append(node[1:])
    return out


def fmt(node) -> str:
    """A node as text (``ptx_trace.py``'s notation: ``L0.0lo`` for lane 0's
    low half of the first load, ``SMEM.0``, ``bfly16[...]``, ``%r59``)."""
    if isinstance(node, list):
        return "(" + ", ".join(fmt(n) for n in node) + ")"
    kind = node[0]
    if kind == "ld":
        return f"L{node[2]}.{node[3]}" if node[1] is None else f"P{node[1]}L{node[2]}.{node[3]}"
    if kind == "half":
        return f"{fmt(node[1])}{node[2]}"
    if kind == "smem":
        return f"SMEM.{node[1]}"
    if kind == "param":
        return f"param{node[1]}"
    if kind == "const":
        return repr(node[1])
    if kind == "reg":
        return node[1]
    if kind == "lane":
        return f"{fmt(node[1])}.{'xy'[node[2]]}"
    if kind == "bfly":
        return f"bfly{node[1]}[{fmt(node[2])}]"
    if kind == "bf16x2":
        return f"bf16x2({fmt(node[1])},{fmt(node[2])})"
    args = [fmt(a) for a in node[1:]]
    if kind in _INFIX and len(args) == 2:
        return f"({args[0]}{_INFIX[kind]}{args[1]})"
    return f"{kind}({','.join(args)})"


_INFIX = {"add": "+", "sub": "-", "mul": "*"}


_COMMUTATIVE = {"add", "mul", "add.ftz", "mul.ftz"}


def canon(node):
    """``node`` with the operands of every commutative operation (``add``,
    ``mul``, and the two factors of ``fma``) in a fixed order, so that trees
    equal up to commutation (which changes no bits, NaN payloads aside) are
    equal."""
    if isinstance(node, list):
        return [canon(n) for n in node]
    if not isinstance(node, tuple) or node[0] in ("ld", "smem", "param", "const", "reg"):
        return node
    if node[0] in ("half", "lane", "bfly"):
        return (node[0], canon(node[1]), node[2]) if node[0] != "bfly" else ("bfly", node[1], canon(node[2]))
    args = [canon(a) for a in node[1:]]
    if node[0] in _COMMUTATIVE:
        args.sort(key=repr)
    elif node[0].split(".")[0] == "fma":
        args[:2] = sorted(args[:2], key=repr)
    return (node[0], *args)
