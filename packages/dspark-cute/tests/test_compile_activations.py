"""CPU tests of the elementwise kernels (``dspark_cute.cutedsl.gating.mlp_activation``
and ``dspark_cute.cutedsl.gating.o_gate``) and of ``dspark_cute.ptx.math.expf``:
they compile for sm_90a and sm_100a without a GPU, a PTX audit of what they
compile to, and the host-side refusals.

Compiled here (each for sm_90a and for sm_100a):

- the gated SiLU activation: I of 16384 (the reference draft), 8192 (TP2),
  11008, 24 and 8 (one vector a row), with PDL; and one without;
- the o-gate, in each stock arithmetic (FLA's, ``arch="sm_90a"``, and
  FlashInfer's, ``arch="sm_100a"``): 64 heads (the reference draft), 32
  (TP2), 40, 5 and 1, eps of 1e-6, 1e-5 and 0.0, with PDL; and one without.

The audits:

- the expression each kernel stores (``trace``: a symbolic evaluation of the
  PTX, register names and instruction order aside) is, node for node, the one
  the spec describes, built here independently (``expected_activation``,
  ``expected_o_gate``): every operation, its rounding, its operands' order
  where it matters, the butterflies' offsets;
- ``expf``'s PTX computes the same expression as CUDA's own ``expf``: the
  lowering of CuTe DSL's ``cute.math.exp(x, fastmath=False)`` (libdevice's
  ``__nv_expf``) and, where ``nvcc`` is installed, nvcc's ``expf``;
- the instruction counts: exactly the approximate instructions and fused
  multiply-adds the stock has (the activation: 8 ``ex2.approx.ftz``, 24
  ``fma.rn``, 8 ``fma.rm``; the o-gate per arch) and nothing else
  approximate, flushed or fused; every other FP32 add/sub/mul/div with an
  explicit rounding (so ptxas contracts nothing); no saturating conversion
  but expf's ``cvt.sat``; no local memory; per thread two 16-byte loads and
  one predicated 16-byte store; nothing loaded before the PDL wait;
- ``ptxas`` (the first one found that reads the PTX's version) accepts the
  PTX without spills.

Also (no compile): the spec's sm_100a o-gate has the same bits for heads
FlashInfer lays out as 32 lanes of 2 (up to 256 rows) and as 8 lanes of 8
(more rows), which is why the kernel has one path.
"""

from __future__ import annotations

import math
import re
import sys

import cutlass.cute as cute
import pytest
import torch
from cute_testing import audit_forbidden, has_f32_constant
from cutlass import Int64
from ptx_audit import code, count, nvcc_ptx, ptxas_report, spill_bytes

from dspark_core.contracts.constants import (
    MlpActivationConstants,
    OGateConstants,
)

ARCHS = ["sm_90a", "sm_100a"]

# (I, pdl)
MLP_VARIANTS = [(16384, True), (8192, True), (11008, True), (24, True), (8, True), (16384, False)]
# (heads, eps, pdl)
OGATE_VARIANTS = [(64, 1e-6, True), (32, 1e-6, True), (40, 1e-5, True), (5, 0.0, True), (1, 1e-6, True),
                  (64, 1e-6, False)]


# ---------------------------------------------------------------- a symbolic PTX evaluator


def _imm(tok: str):
    """An immediate operand as its 32-bit pattern (``0fXXXXXXXX`` or a
    decimal integer), or None."""
    tok = tok.strip()
    if re.fullmatch(r"0[fF][0-9A-Fa-f]{8}", tok):
        return ("imm", int(tok[2:], 16))
    if re.fullmatch(r"-?\d+", tok):
        return ("imm", int(tok) & 0xFFFFFFFF)
    return None


def imm(bits: int) -> tuple:
    return ("imm", bits & 0xFFFFFFFF)


def f32imm(value: float) -> tuple:
    from dspark_cute.ptx import f32_bits

    return imm(f32_bits(value))


def lo16(node) -> tuple:
    """The low BF16 of a 32-bit word widened (``shl 16``)."""
    return ("lo16", node)


def hi16(node) -> tuple:
    """The high BF16 of a 32-bit word widened (``and 0xFFFF0000``)."""
    return ("hi16", node)


# FP32 ops: opcode -> the normalized name (the type dropped, the rounding kept).
def _fp_name(op: str) -> str:
    return ".".join(p for p in op.split(".") if p not in ("f32",))


def trace(ptx: str, plain_is_rn: bool = False) -> list:
    """The values a thread stores to global memory, in program order, each
    a list of nodes (one per stored word), from a symbolic evaluation of the
    first ``.entry`` of ``ptx`` as straight-line code (branches, labels and
    predicates ignored; a register holds its last definition in text
    order). Nodes: ``("ld", k, i)`` word ``i`` of the ``k``-th global load;
    ``("smem", n)``; ``("imm", bits)``; ``("lo16" | "hi16", w)`` a BF16 half
    of a word widened; ``("bfly", offset, v)``; ``("bf16x2", hi, lo)``;
    ``(op, *args)`` for FP32 ops (``add.rn``, ``fma.rm``, ``div.full``,
    ``ex2.approx.ftz``, ``cvt.sat``, ``neg``, ...: the opcode without its
    type); ``("shl", v, n)``; ``("in", reg)`` a register defined outside
    (a parameter, an index). ``plain_is_rn``: read ``add.f32`` / ``mul.f32``
    / ``sub.f32`` (round to nearest, contractible) as their ``.rn`` forms."""
    start = ptx.index("{", ptx.index(".entry"))
    body = re.sub(r"//[^\n]*", "", ptx[start:])
    env: dict[str, object] = {}
    loads = 0
    smem = 0
    stores: list = []

    def val(tok: str):
        tok = tok.strip()
        c = _imm(tok)
        if c is not None:
            return c
        return env.get(tok, ("in", tok))

    for stmt in body.split(";"):
        s = stmt.replace("{", " { ").replace("}", " } ").strip()
        # Drop scope braces around asm blocks (not the vector operand braces).
        s = re.sub(r"^(\s*[{}]\s*)+", "", s).strip()
        if not s or s.startswith(".") or s.endswith(":"):
            continue
        s = re.sub(r"^\$\S+:\s*", "", s)  # a label before the instruction
        m = re.match(r"(@!?%?\w+\s+)?([\w.:]+)\s*(.*)", s, flags=re.S)
        if not m:
            continue
        op, args = m.group(2), " ".join(m.group(3).split())
        if op.startswith(("bra", "ret", "bar", "griddepcontrol", "exit", "prefetch", "cp.async")):
            continue
        if op.startswith("ld.global"):
            dest = args.split("[", 1)[0]
            regs = re.findall(r"%\w+", dest)
            for i, r in enumerate(regs):
                env[r] = ("ld", loads, i)
            loads += 1
            continue
        if op.startswith("ld.shared"):
            for r in re.findall(r"%\w+", args.split("[", 1)[0]):
                env[r] = ("smem", smem)
                smem += 1
            continue
        if op.startswith("st.global"):
            vals = args.split("]", 1)[1]
            stores.append([val(r) for r in re.findall(r"%\w+|\b0[fF][0-9A-Fa-f]{8}\b", vals)])
            continue
        if op.startswith(("st.", "ld.")):
            continue
        parts = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        dest, srcs = parts[0], parts[1:]
        if op in ("mov.b32", "mov.f32", "mov.u32") and not dest.startswith("{") and len(srcs) == 1:
            env[dest] = val(srcs[0])
        elif op == "shl.b32" and srcs[1] == "16":
            env[dest] = lo16(val(srcs[0]))
        elif op == "and.b32" and _imm(srcs[1]) == imm(0xFFFF0000):
            env[dest] = hi16(val(srcs[0]))
        elif op == "shl.b32":
            env[dest] = ("shl", val(srcs[0]), int(srcs[1]))
        elif op.startswith("shfl.sync.bfly"):
            env[dest] = ("bfly", int(srcs[1]), val(srcs[0]))
        elif op.startswith("cvt.rn.bf16x2.f32"):
            env[dest] = ("bf16x2", val(srcs[0]), val(srcs[1]))
        elif op.endswith(".f32") and op.split(".")[0] in ("add", "sub", "mul", "div", "fma", "neg", "cvt", "ex2",
                                                          "rsqrt", "sqrt", "rcp"):
            name = _fp_name(op)
            if plain_is_rn and name in ("add", "sub", "mul"):
                name += ".rn"
            env[dest] = (name, *[val(x) for x in srcs])
        elif not dest.startswith("{"):
            env[dest] = ("int", op)
    return stores


def check_ptxas(ptx: str, arch: str, tmp_path) -> None:
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == spill_bytes(report, "spill loads") == 0, report
        print(re.findall(r"Used \d+ registers", report))


# ---------------------------------------------------------------- the expected expressions

EXPF = {"log2e_252": 0x3BBB989D, "half": 0x3F000000, "scale": 0x437C0000, "magic": 0x4B400001,
        "unbias": 0xCB40007F, "log2e_hi": 0x3FB8AA3B, "log2e_lo": 0x32A57060}
ONE = imm(0x3F800000)


def expected_expf(x) -> tuple:
    """CUDA's ``expf(x)`` as libdevice computes it (``__nv_expf``, no FTZ),
    the final product ``mul.rn``."""
    t = ("cvt.sat", ("fma.rn", x, imm(EXPF["log2e_252"]), imm(EXPF["half"])))
    j = ("fma.rm", t, imm(EXPF["scale"]), imm(EXPF["magic"]))
    f = ("neg", ("add.rn", j, imm(EXPF["unbias"])))
    u = ("fma.rn", x, imm(EXPF["log2e_lo"]), ("fma.rn", x, imm(EXPF["log2e_hi"]), f))
    return ("mul.rn", ("ex2.approx.ftz", u), ("shl", j, 23))


def expected_activation() -> list:
    """The 4 words lane 0 stores (``silu_and_mul``): gate words are load 0,
    up words load 1."""
    g = [f(("ld", 0, i)) for i in range(4) for f in (lo16, hi16)]
    u = [f(("ld", 1, i)) for i in range(4) for f in (lo16, hi16)]
    s = [("div.rn", x, ("add.rn", expected_expf(("neg", x)), ONE)) for x in g]
    a = []
    for k in range(0, 8, 2):
        word = ("bf16x2", s[k + 1], s[k])
        a += [lo16(word), hi16(word)]
    h = [("mul.rn", ak, ("add.rn", uk, imm(0))) for ak, uk in zip(a, u)]
    return [("bf16x2", h[k + 1], h[k]) for k in range(0, 8, 2)]


NEG_LOG2E = imm(0xBFB8AA3B)
INV_64 = imm(0x3C800000)


def expected_o_gate_words(x: list, g: list, eps: float, arch: str) -> list:
    """The output words of a lane holding columns ``x`` (8 or 2 consecutive,
    FP32 nodes) of a head and its gate values ``g``, in ``arch``'s stock
    arithmetic (``dspark_core.spec.layers.o_gate``'s description): sm_90a
    FLA's lanes of 4 folded by halves, sm_100a the pairwise tree."""
    n = len(x)
    if arch == "sm_90a":
        leaves = [("fma.rn", x[k], x[k], ("mul.rn", x[k + 1], x[k + 1])) for k in range(0, n, 2)]
        if n == 2:  # an FLA lane over two threads: butterfly 1, then FLA's 8, 4, 2, 1 over lanes 16 .. 2
            s = ("add.rn", leaves[0], ("bfly", 1, leaves[0]))
            for off in (16, 8, 4, 2):
                s = ("add.rn", s, ("bfly", off, s))
        else:  # two FLA lanes a thread: FLA's 8, 4, 2 over lanes 4, 2, 1, its 1 in the thread
            f = [("add.rn", leaves[0], leaves[1]), ("add.rn", leaves[2], leaves[3])]
            for off in (4, 2, 1):
                f = [("add.rn", v, ("bfly", off, v)) for v in f]
            s = ("add.rn", f[0], f[1])
        v = ("fma.rn", s, INV_64, f32imm(eps))
        scale = ("div.full", ONE, ("sqrt.approx.ftz", v))
        sig = [("div.full", ONE, ("add.rn", ("ex2.approx", ("mul.rn", gc, NEG_LOG2E)), ONE)) for gc in g]
        y = [("mul.rn", ("mul.rn", xc, scale), sc) for xc, sc in zip(x, sig)]
    else:
        q = [("mul.rn", v, v) for v in x]
        while len(q) > 1:
            q = [("add.rn", q[2 * i], q[2 * i + 1]) for i in range(len(q) // 2)]
        s = q[0]
        off = 1
        while off < 64 // n:
            s = ("add.rn", s, ("bfly", off, s))
            off *= 2
        v = ("fma.rn", s, INV_64, f32imm(eps))
        scale = ("rsqrt.approx.ftz", v)
        sig = [("rcp.approx.ftz", ("add.rn", ("ex2.approx.ftz", ("mul.rn", gc, NEG_LOG2E)), ONE)) for gc in g]
        y = [("mul.rn", sc, ("mul.rn", xc, scale)) for xc, sc in zip(x, sig)]
    return [("bf16x2", y[k + 1], y[k]) for k in range(0, n, 2)]


def expected_o_gate(eps: float, arch: str) -> list:
    """The 4 words lane 0 of the o-gate kernel stores: attention words are
    load 0, gate words load 1."""
    x = [f(("ld", 0, i)) for i in range(4) for f in (lo16, hi16)]
    g = [f(("ld", 1, i)) for i in range(4) for f in (lo16, hi16)]
    return expected_o_gate_words(x, g, eps, arch)


# ---------------------------------------------------------------- instruction audits


def without(body: str, pattern: str, expected: int) -> str:
    """``body`` with the ``expected`` matches of ``pattern`` removed (there
    must be exactly that many)."""
    found = count(body, pattern)
    assert found == expected, f"{found} matches of {pattern}, not {expected}"
    return re.sub(pattern, "", body, flags=re.MULTILINE)


def audit_common(body: str) -> None:
    """What neither kernel may contain (after its allowed instructions are
    taken out), and its memory accesses."""
    audit_forbidden(body, no_rcp=True, explicit_rounding=True)
    global_ops = re.findall(r"\b(?:ld|st)\.global[.\w]*", body)
    assert sorted(global_ops) == ["ld.global.v4.b32", "ld.global.v4.b32", "st.global.v4.b32"], global_ops
    # The tail guard is a predicate on the store, not a branch around the work.
    assert re.search(r"@p st\.global\.v4\.b32", body)
    assert count(body, r"\bbar\.sync\b") == 0
    assert not re.search(r"\b(?:min|max)\.f32\b", body)


def audit_pdl(body: str, pdl: bool, early_release: bool = False) -> None:
    """No global load before the PDL wait; the dependents released after it,
    or (``early_release``: the MLP activation, whose dependent is the down
    GEMM) before it."""
    if pdl:
        head, sep, tail = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert not re.search(r"\bld\.global", head), "a load before the PDL wait"
        assert "griddepcontrol.launch_dependents" in (head if early_release else tail)
        assert body.count("griddepcontrol.launch_dependents") == 1
    else:
        assert "griddepcontrol" not in body


def compile_for(kernel, args, arch: str) -> tuple[str, str]:
    from dspark_cute.runtime.host import compile_ptx

    ptx = compile_ptx(kernel, *args, arch=arch)
    body = code(ptx)
    assert f".target {arch}" in body
    return ptx, body


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("i,pdl", MLP_VARIANTS)
def test_mlp_activation_compiles(arch, i, pdl, tmp_path):
    from dspark_cute.cutedsl.gating.mlp_activation import MlpActivationKernel, fake_args
    from dspark_cute.ptx.math import _EXPF_ASM

    c = MlpActivationConstants(intermediate_size=i)
    ptx, body = compile_for(MlpActivationKernel(c, pdl), fake_args(c), arch)
    stores = trace(body)
    assert len(stores) == 1 and stores[0] == expected_activation(), "the stored expression is not the spec's"
    audit_pdl(body, pdl, early_release=True)
    # expf: one block per element, its approximate ex2 and fused multiply-adds.
    block = r"%\w+".join(re.escape(piece) for piece in re.split(r"\$\d", _EXPF_ASM))
    rest = without(body, block, 8)
    for op, n in ((r"\bex2\.", 8), (r"\bfma\.rn\.f32", 24), (r"\bfma\.rm\.f32", 8), (r"\bcvt\.sat\.f32\.f32", 8)):
        assert count(body, op) == n, op
    # Outside expf: -x, 1 + e, x / d, u + 0, a * u; the BF16 roundings of a and of the output.
    assert count(rest, r"\bneg\.f32") == 8
    assert count(rest, r"\badd\.rn\.f32") == 16
    assert count(rest, r"\bdiv\.rn\.f32") == 8
    assert count(rest, r"\bmul\.rn\.f32") == 8
    assert count(rest, r"\bcvt\.rn\.bf16x2\.f32") == 8
    assert count(rest, r"\bshfl\.") == 0
    audit_common(rest)
    assert has_f32_constant(ptx, 0x3F800000) and has_f32_constant(ptx, 0x00000000)
    check_ptxas(ptx, arch, tmp_path)


# The o-gate's own instructions per thread (8 columns), by arch: pattern -> count.
OGATE_ALLOWED = {
    "sm_90a": {r"\bfma\.rn\.f32\b": 5, r"\bsqrt\.approx\.ftz\.f32\b": 1, r"\bdiv\.full\.f32\b": 9,
               r"\bex2\.approx\.f32\b": 8},
    "sm_100a": {r"\bfma\.rn\.f32\b": 1, r"\brsqrt\.approx\.ftz\.f32\b": 1, r"\bex2\.approx\.ftz\.f32\b": 8,
                r"\brcp\.approx\.ftz\.f32\b": 8},
}
# Rounded products and sums per thread: sm_90a 4 squares, 8 x * rstd, 8 z, 8 h * sig; 2 lane sums,
# 6 butterfly sums, 1 last fold, 8 (e + 1). sm_100a 8 squares, 8, 8, 8; 7 in the thread, 3 butterfly sums, 8.
OGATE_ROUNDED = {"sm_90a": (28, 17), "sm_100a": (32, 18)}
OGATE_SHUFFLES = {"sm_90a": ["4", "4", "2", "2", "1", "1"], "sm_100a": ["1", "2", "4"]}


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("og_arch", ARCHS)
@pytest.mark.parametrize("heads,eps,pdl", OGATE_VARIANTS)
def test_o_gate_compiles(arch, og_arch, heads, eps, pdl, tmp_path):
    """The o-gate of ``og_arch``'s stock arithmetic compiled for ``arch``
    (each arithmetic runs on any sm_90+ GPU)."""
    from dspark_cute.cutedsl.gating.o_gate import OGateKernel, fake_args
    from dspark_cute.ptx import f32_bits

    c = OGateConstants(num_heads=heads, eps=eps, arch=og_arch)
    ptx, body = compile_for(OGateKernel(c, pdl), fake_args(c), arch)
    stores = trace(body)
    assert len(stores) == 1 and stores[0] == expected_o_gate(eps, og_arch), "the stored expression is not the spec's"
    audit_pdl(body, pdl)
    shuffles = re.findall(r"\bshfl\.sync\.bfly\.b32\s+%\w+, %\w+, (\d+), 31, -1;", body)
    assert shuffles == OGATE_SHUFFLES[og_arch], shuffles
    rest = body
    for pattern, n in OGATE_ALLOWED[og_arch].items():
        rest = without(rest, pattern, n)
    muls, adds = OGATE_ROUNDED[og_arch]
    assert count(rest, r"\bmul\.rn\.f32") == muls
    assert count(rest, r"\badd\.rn\.f32") == adds
    assert count(rest, r"\b(?:div|sub|sqrt)\.rn\.f32") == 0
    assert count(rest, r"\bcvt\.rn\.bf16x2\.f32") == 4
    audit_common(rest)
    assert "cvt.sat" not in rest
    for bits in (0x3C800000, 0xBFB8AA3B, 0x3F800000, f32_bits(eps)):
        assert has_f32_constant(ptx, bits), hex(bits)
    check_ptxas(ptx, arch, tmp_path)


@pytest.mark.compile
def test_o_gate_eps_and_arch_compile_apart():
    """eps and arch are compile-time: two values of each, four variants,
    each eps its own FP32 immediate, each arch its own instructions."""
    from dspark_cute.cutedsl.gating.o_gate import OGateKernel, fake_args
    from dspark_cute.ptx import f32_bits
    from dspark_cute.runtime.host import compile_ptx

    a, b = OGateConstants(8, 1e-6), OGateConstants(8, 1e-5)
    assert a.key() != b.key() and a != b
    assert OGateConstants(8, 1e-6, "sm_100a").key() != a.key()
    ptx_a = compile_ptx(OGateKernel(a, True), *fake_args(a), arch="sm_90a")
    ptx_b = compile_ptx(OGateKernel(b, True), *fake_args(b), arch="sm_90a")
    assert has_f32_constant(ptx_a, f32_bits(1e-6)) and not has_f32_constant(ptx_a, f32_bits(1e-5))
    assert has_f32_constant(ptx_b, f32_bits(1e-5)) and not has_f32_constant(ptx_b, f32_bits(1e-6))
    c = OGateConstants(8, 1e-6, "sm_100a")
    ptx_c = compile_ptx(OGateKernel(c, True), *fake_args(c), arch="sm_90a")
    assert "rsqrt.approx.ftz" in ptx_c and "sqrt.approx.ftz" not in ptx_c.replace("rsqrt", "")
    assert "div.full" in ptx_a and "div.full" not in ptx_c


# ---------------------------------------------------------------- expf is CUDA's expf


class ExpProbe:
    """``y[0] = op(x[0])`` of one FP32 word (the other three words copied):
    ``op`` ``dspark_cute.ptx.math.expf`` (``which="ours"``) or CuTe DSL's
    ``cute.math.exp(x, fastmath=False)`` (``"dsl"``). Call: ``(x, y,
    stream)``."""

    def __init__(self, which: str) -> None:
        self.which = which

    @cute.jit
    def __call__(self, x: cute.Pointer, y: cute.Pointer, stream):
        self.kernel(x, y).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, y: cute.Pointer):
        _exp_probe_body(self.which, x.toint(), y.toint())


def _exp_probe_body(which: str, x, y) -> None:
    from dspark_cute import ptx

    w = ptx.ld_global_v4(Int64(x))
    v = ptx.as_f32(w[0])
    e = ptx.expf(v) if which == "ours" else cute.math.exp(v, fastmath=False)
    ptx.st_global_v4(Int64(y), [ptx.as_u32(e), w[1], w[2], w[3]])


def _probe_expression(which: str, arch: str):
    from dspark_cute.runtime.host import compile_ptx, fake_ptr, fake_stream

    ptx = compile_ptx(ExpProbe(which), fake_ptr("fp32"), fake_ptr("fp32"), fake_stream(), arch=arch)
    stores = trace(code(ptx), plain_is_rn=True)
    assert len(stores) == 1
    return stores[0][0]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_expf_is_libdevice_expf(arch):
    """``ptx.math.expf`` and CuTe DSL's non-fast-math ``exp`` (libdevice's
    ``__nv_expf``) compute the same expression: the one written out here."""
    x = ("ld", 0, 0)
    assert _probe_expression("ours", arch) == expected_expf(x)
    assert _probe_expression("dsl", arch) == expected_expf(x)


@pytest.mark.compile
def test_expf_is_nvcc_expf(tmp_path):
    """nvcc's ``expf`` (no fast math, the stock activation's build) computes
    the same expression as ``ptx.math.expf``; skipped without nvcc."""
    ptx = nvcc_ptx("o[threadIdx.x] = expf(i[threadIdx.x]);", tmp_path)
    if ptx is None:
        pytest.skip("no nvcc")
    stores = trace(ptx, plain_is_rn=True)
    assert stores == [[expected_expf(("ld", 0, 0))]]


def test_expf_constants():
    """The constants of ``ptx.math.expf``: log2(e) / 252, log2(e) in two
    FP32 parts, the magic integers."""
    import numpy as np

    from dspark_cute.ptx.math import EXPF_BITS

    assert EXPF_BITS == EXPF
    f = {k: float(np.array(v, dtype=np.uint32).view(np.float32)) for k, v in EXPF_BITS.items()}
    assert f["half"] == 0.5 and f["scale"] == 252.0
    assert f["magic"] == 1.5 * 2**23 + 1 and f["unbias"] == -(1.5 * 2**23 + 127)
    assert f["log2e_hi"] == float(np.float32(1 / math.log(2)))
    assert abs(f["log2e_hi"] + f["log2e_lo"] - 1 / math.log(2)) < 2**-50
    assert abs(f["log2e_252"] - 1 / math.log(2) / 252) < 2**-30


# ---------------------------------------------------------------- the spec's sm_100a layouts


def test_sm100_layouts_share_one_tree():
    """FlashInfer's two layouts of a head (32 lanes of 2 columns up to 256
    rows, 8 lanes of 8 above) give the spec's sm_100a o-gate the same bits:
    heads computed among 257 rows equal the same heads among 256 or fewer."""
    from dspark_core.spec.layers import HeadNorm, o_gate

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(257, 1, 64, generator=gen) * torch.exp2(torch.randint(-12, 13, (257, 1, 64), generator=gen))
         ).to(torch.bfloat16)
    g = (torch.randn(257, 1, 64, generator=gen) * 4).to(torch.bfloat16)
    x[0, 0, ::3] = -0.0
    x[1, 0, 5] = float("inf")
    x[2, 0] = 3e38
    x[3, 0] = torch.full((64,), 1, dtype=torch.int16).view(torch.bfloat16)
    norm = HeadNorm(64, 1e-6)
    wide = o_gate(x, g, norm, "sm_100a")  # 257 rows: 8 lanes of 8
    narrow = torch.cat([o_gate(x[:256], g[:256], norm, "sm_100a"), o_gate(x[256:], g[256:], norm, "sm_100a")])
    assert torch.equal(wide.view(torch.int16), narrow.view(torch.int16))


# ---------------------------------------------------------------- constants and host checks (no GPU needed)


def test_mlp_activation_refuses_bad_settings():
    from dspark_core.errors import Unsupported
    from dspark_cute.cutedsl.gating.mlp_activation import MAX_VECTORS, MlpActivation

    for bad in (0, 12, -8, 4):
        with pytest.raises(Unsupported, match="multiple of 8"):
            MlpActivation(MlpActivationConstants(bad))
    for bad in (True, 16384.0, "16384"):
        with pytest.raises(TypeError, match="intermediate_size must be an int"):
            MlpActivation(MlpActivationConstants(bad))
    with pytest.raises(ValueError, match="MlpActivationConstants"):
        MlpActivation(16384)
    act = MlpActivation(MlpActivationConstants(16384), pdl=False)
    assert act.max_rows == MAX_VECTORS // 2048 and act.pdl is False
    assert MlpActivation(MlpActivationConstants(8192)).intermediate_size == 8192
    # Refused before anything compiles.
    for bad in (0, act.max_rows + 1):
        with pytest.raises(ValueError, match="rows"):
            act.prepare(bad)


def test_mlp_activation_refuses_bad_operands():
    from dspark_cute.cutedsl.gating.mlp_activation import MlpActivation

    i = 64
    act = MlpActivation(MlpActivationConstants(i), pdl=False)
    gu = torch.zeros(3, 2 * i, dtype=torch.bfloat16)
    cases = [
        ([[1.0]], "torch tensor"),
        (gu.float(), "bfloat16"),
        (gu[:, : 2 * i - 8], r"\[\.\.\., 128\]"),
        (gu[:0], "1 to"),
        (torch.zeros(3, 4 * i, dtype=torch.bfloat16)[:, ::2], "contiguous"),
        (torch.zeros(3 * 2 * i + 8, dtype=torch.bfloat16)[1 : 1 + 3 * 2 * i].view(3, 2 * i), "aligned"),
        (gu, "CUDA"),  # a CPU tensor: the device is checked last
    ]
    for t, match in cases:
        with pytest.raises(ValueError, match=match):
            act.run(t)
        assert not act.takes(t) and re.search(match, act.problem(t))
    # (out is checked after gu: on a CPU machine gu fails first, so check out's
    # sentences through a gu that passes everything but the device.)
    with pytest.raises(ValueError, match="CUDA"):
        act.run(gu, torch.zeros(3, i, dtype=torch.bfloat16))


def test_o_gate_refuses_bad_settings():
    from dspark_core.errors import Unsupported
    from dspark_cute.cutedsl.gating.o_gate import OGate, OGateKernel

    with pytest.raises(Unsupported, match="at least one head"):
        OGate(OGateConstants(0, 1e-6))
    with pytest.raises(TypeError, match="OGateConstants.num_heads must be an int, not float 32.0"):
        OGate(OGateConstants(32.0, 1e-6))
    with pytest.raises(ValueError, match="OGateConstants"):
        OGate(32)
    for eps in (-1e-6, math.nan):
        with pytest.raises(Unsupported, match="eps"):
            OGate(OGateConstants(32, eps))
    for arch in ("sm_80", "sm_90", None):
        with pytest.raises(Unsupported, match="no stock o-gate is known"):
            OGate(OGateConstants(32, 1e-6, arch))
        with pytest.raises(Unsupported, match="no stock o-gate is known"):
            OGateKernel(OGateConstants(32, 1e-6, arch), True)
    og = OGate(OGateConstants(32, 1e-5), pdl=False)
    assert og.constants == OGateConstants(32, 1e-5) and og.width == 2048 and og.pdl is False
    assert og.arch == "sm_90a" and OGate(OGateConstants(32, 1e-5, "sm_100a")).arch == "sm_100a"
    for bad in (0, og.max_rows + 1):
        with pytest.raises(ValueError, match="rows"):
            og.prepare(bad)


def test_o_gate_refuses_bad_operands():
    from dspark_cute.cutedsl.gating.o_gate import OGate

    heads, kv = 4, 1
    w = heads * 64
    og = OGate(OGateConstants(heads, 1e-6), pdl=False)
    m = 3
    qkv = torch.zeros(m, 2 * w + 2 * kv * 64, dtype=torch.bfloat16)
    gate = qkv[:, w + 2 * kv * 64 :]
    attn = torch.zeros(m, w, dtype=torch.bfloat16)
    assert og.gate_stride(gate) == qkv.shape[1]
    assert og.gate_stride(gate.reshape(m, heads, 64)) == qkv.shape[1]
    assert og.gate_stride(gate[:1]) == w  # a single row's stride is never used
    wide = torch.zeros(m, w + 12, dtype=torch.bfloat16)
    cases = [
        (("x", gate), "torch tensor"),
        ((attn.float(), gate), "bfloat16"),
        ((attn, gate.float()), "bfloat16"),
        ((attn[:, :64], gate[:, :64]), r"\[m, 256\]"),
        ((attn, gate[:2]), "shape"),
        ((attn[:0], gate[:0]), "1 to"),
        ((torch.zeros(w, m, dtype=torch.bfloat16).t(), gate), "contiguous"),
        ((attn, wide[:, :w]), "multiple of 8"),  # row stride 268 elements
        ((attn, torch.zeros(m, 2 * w, dtype=torch.bfloat16)[:, ::2]), "rows must be contiguous"),
        ((attn, torch.zeros(2 * w, m, dtype=torch.bfloat16).t()[:, :w]), "rows must be contiguous"),
        ((attn, qkv[:, 4 : 4 + w]), "aligned"),  # a column offset of 4 elements
        ((attn, gate), "CUDA"),  # CPU tensors: the device is checked last
    ]
    for (a, g), match in cases:
        with pytest.raises(ValueError, match=match):
            og.run(a, g)
        assert not og.takes(a, g) and re.search(match, og.problem(a, g))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
