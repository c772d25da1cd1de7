"""A PTX dataflow reader for the audit of the QKV epilogue's fused QK-norm
(``test_compile_qkv_epilogue``): it follows each
register to the instruction that wrote it and reads back, from the PTX alone,
what the norm computes and in what order.

``head_norms(body)`` finds every stock QK-norm in a kernel's PTX (after
``ptx_audit.code``): a chain of 8 ``fma.rn.f32`` squares starting from +0.0,
and follows it through the butterfly, ``fma(S, 1/64, eps)``,
``rsqrt.approx.f32``, the ``mul.rn.f32`` by ``r``, RoPE and the BF16
packing. Each ``Norm`` says which 16-bit half of which word each chain
element is (``Norm.elements``), the butterfly's offsets, the eps operand,
the normalized values and how each pair was rotated and packed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+([^;]*);", re.MULTILINE)
_REG = re.compile(r"^%[a-z]+\d+$")
ZERO = "0f00000000"
ONE_64TH = "0f3C800000"


def _operands(text: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def imm(text: str):
    """A 32-bit immediate as ``0fXXXXXXXX`` (PTX writes FP32 constants as
    ``0f`` hex or, moved as bits, as integers), or None."""
    t = text.strip()
    try:
        if t[:2] in ("0f", "0F"):
            value = int(t[2:], 16)
        elif t[:2] in ("0x", "0X"):
            value = int(t[2:], 16)
        else:
            value = int(t)
    except ValueError:
        return None
    return f"0f{value & 0xFFFFFFFF:08X}"


def _regs(group: str) -> list:
    return [r.strip() for r in group.strip("{}").split(",")]


class Flow:
    """The instructions of a PTX body: ``defs[reg]`` is ``(opcode, operands,
    index)`` of the instruction that writes ``reg`` (``index``: its place in
    a vector destination); ``uses(opcode)`` the instructions of an opcode."""

    def __init__(self, body: str) -> None:
        self.instrs = [(op, _operands(args)) for op, args in _INSTR.findall(body)]
        self.defs: dict = {}
        self.multiple: set = set()
        for op, ops in self.instrs:
            if not ops or op.startswith(("st.", "bra", "ret", "bar.", "griddepcontrol", "cp.async")):
                continue
            dsts = _regs(ops[0]) if ops[0].startswith("{") else [ops[0]]
            for i, d in enumerate(dsts):
                if _REG.match(d):
                    if d in self.defs:
                        self.multiple.add(d)
                    self.defs[d] = (op, ops[1:], i)

    def resolve(self, reg: str) -> str:
        """``reg`` through its register moves (``mov`` of a register)."""
        seen = set()
        while reg in self.defs and reg not in seen:
            seen.add(reg)
            op, ops, _ = self.defs[reg]
            if op.startswith("mov.") and len(ops) == 1 and _REG.match(ops[0]):
                reg = ops[0]
            elif op.startswith("mov.") and len(ops) == 1 and imm(ops[0]):
                return imm(ops[0])
            else:
                break
        return imm(reg) or reg

    def op(self, reg: str):
        """``(opcode, resolved operands, index)`` writing ``reg`` (after moves), or None."""
        reg = self.resolve(reg)
        if reg not in self.defs:
            return None
        op, ops, i = self.defs[reg]
        return op, [self.resolve(o) if _REG.match(o) else o for o in ops], i

    def each(self, prefix: str) -> list:
        """``(opcode, operands)`` of every instruction whose opcode starts with ``prefix``."""
        return [(op, ops) for op, ops in self.instrs if op.startswith(prefix)]


@dataclass
class Norm:
    """One traced stock QK-norm (module docstring)."""

    flow: Flow
    chain: list  # the 8 fma destinations, in order
    values: list  # the squared value of each chain step
    elements: list  # per chain step: (half "lo"/"hi", word register) of its BF16, or None
    offsets: list = field(default_factory=list)  # the butterfly's shfl.bfly offsets, in order
    scale: str = ""  # the fma(S, scale, eps) operand
    eps: tuple = ()  # ("const", bits), ("selp", bits_a, bits_b) or ("reg", register)
    r: str = ""  # the rsqrt.approx.f32 destination
    normed: list = field(default_factory=list)  # (value register, mul.rn(value, r) destination)


def half(flow: Flow, reg: str):
    """``("lo", word)`` for ``shl.b32 word, 16``, ``("hi", word)`` for
    ``and.b32 word, -65536`` (a BF16 of a packed word widened to FP32),
    else None."""
    d = flow.op(reg)
    if d is None:
        return None
    op, ops, _ = d
    if op == "shl.b32" and ops[1] == "16":
        return "lo", ops[0]
    if op == "and.b32" and ops[1] in ("-65536", "0xFFFF0000", "4294901760"):
        return "hi", ops[0]
    return None


def _constant(flow: Flow, reg: str) -> tuple:
    reg = flow.resolve(reg)
    if reg.startswith("0f"):
        return ("const", reg)
    d = flow.op(reg)
    if d and d[0].startswith("selp.") and imm(d[1][0]) and imm(d[1][1]):
        return ("selp", imm(d[1][0]), imm(d[1][1]))
    return ("reg", reg)


def head_norms(body: str) -> list:
    """Every stock QK-norm of ``body`` (``Norm``), in program order of its chain."""
    flow = Flow(body)
    fmas = {ops[0]: [flow.resolve(o) for o in ops[1:]] for op, ops in flow.each("fma.rn.f32")}
    squares = {dst: (a, c) for dst, (a, b, c) in fmas.items() if a == b}
    by_addend: dict = {}
    for dst, (_, c) in squares.items():
        by_addend.setdefault(c, []).append(dst)
    shfls = {ops[0]: (flow.resolve(ops[1]), int(ops[2])) for op, ops in flow.each("shfl.sync.bfly")}
    adds = [(ops[0], {flow.resolve(ops[1]), flow.resolve(ops[2])}) for op, ops in flow.each("add.rn.f32")]
    norms = []
    for start, (_, c) in squares.items():
        if c != ZERO:
            continue
        chain = [start]
        while len(by_addend.get(chain[-1], [])) == 1:
            chain.append(by_addend[chain[-1]][0])
        values = [squares[d][0] for d in chain]
        n = Norm(flow, chain, values, [half(flow, v) for v in values])
        # The butterfly: s' = add.rn(s, shfl.bfly(s, o)), while there is one.
        s = chain[-1]
        while True:
            nxt = [(d, o) for d, (src, o) in shfls.items() if src == s]
            step = [dst for dst, srcs in adds if len(nxt) == 1 and srcs == {s, nxt[0][0]}]
            if len(step) != 1:
                break
            n.offsets.append(nxt[0][1])
            s = step[0]
        v = [dst for dst, (x, _, _) in fmas.items() if x == s]
        if len(v) == 1:
            _, n.scale, eps = fmas[v[0]]
            n.eps = _constant(flow, eps)
            r = [ops[0] for op, ops in flow.each("rsqrt.approx.f32") if flow.resolve(ops[1]) == v[0]]
            if len(r) == 1:
                n.r = r[0]
                n.normed = [(flow.resolve(ops[1]), ops[0]) for op, ops in flow.each("mul.rn.f32")
                            if flow.resolve(ops[2]) == n.r]
        norms.append(n)
    order = {ops[0]: i for i, (op, ops) in enumerate(flow.instrs) if ops}
    norms.sort(key=lambda n: order.get(n.chain[0], 0))
    return norms


def normed_pairs(n: Norm) -> list:
    """The GPT-J pairs ``(x, y)`` of ``n``'s normalized values: per packed
    word whose two halves were normalized (in the order of first use), the
    normalized low half and high half."""
    flow = n.flow
    halves = {}
    words = []
    for src, dst in n.normed:
        h = half(flow, src)
        if h is None:
            continue
        halves[h] = dst
        if h[1] not in words:
            words.append(h[1])
    return [(halves.get(("lo", w)), halves.get(("hi", w))) for w in words]


def rotation(n: Norm, x: str, y: str):
    """``(c, s, x', y')`` where the PTX turns the pair ``(x, y)`` into ``x' =
    fma(c, x, neg.f32(mul.rn(s, y)))`` and ``y' = fma(s, x, mul.rn(c, y))``,
    else None."""
    flow = n.flow
    fmas = {ops[0]: [flow.resolve(o) for o in ops[1:]] for op, ops in flow.each("fma.rn.f32")}
    for xd, (c, x1, neg) in fmas.items():
        d = flow.op(neg)
        if x1 != x or not d or d[0] != "neg.f32":
            continue
        m = flow.op(d[1][0])
        if not m or m[0] != "mul.rn.f32" or m[1][1] != y:
            continue
        s = m[1][0]
        for yd, (s2, x2, prod) in fmas.items():
            p = flow.op(prod)
            if s2 == s and x2 == x and p and p[0] == "mul.rn.f32" and p[1] == [c, y]:
                return c, s, xd, yd
    return None


def packed(flow: Flow, lo: str, hi: str) -> list:
    """The ``cvt.rn.bf16x2.f32`` destinations packing ``lo`` (low half) and
    ``hi`` (high half)."""
    return [ops[0] for op, ops in flow.each("cvt.rn.bf16x2.f32")
            if flow.resolve(ops[2]) == lo and flow.resolve(ops[1]) == hi]
