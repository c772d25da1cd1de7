"""CPU tests of the elementwise activation kernels (``dspark_cute.cutedsl.gating.mlp_activation``
and ``dspark_cute.cutedsl.gating.o_gate``): they compile for sm_90a and sm_100a without a
GPU, a PTX audit of what they compile to, and the host-side refusals.

Compiled here (each for sm_90a and for sm_100a):

- the gated SiLU activation: I of 16384 (the reference draft), 8192 (TP2),
  11008, 24 and 8 (one vector a row), with PDL; and one without;
- the o-gate: 64 heads (the reference draft), 32 (TP2), 40, 5 and 1, eps of
  1e-6, 1e-5 and 0.0, with PDL; and one without.

The audit: no ``fma`` (the spec has none), no ``.ftz``, no ``rsqrt``,
``.approx`` or ``rcp``, no saturating conversion, no local memory (spills);
every FP32 add/sub/mul/div with ``.rn``; per thread two 16-byte loads
(``ld.global.v4.b32``) and one predicated 16-byte store, no other global
access; the spec's ``exp_rn`` once per element: 8 ``cvt.rni.f32.f32`` (rint),
8 ``cvt.rmi.f32.f32`` (floor), its constants as exact FP32 immediates, and
per element one ``div.rn.f32`` (the sigmoid's quotient); the exact counts of
the rounded products and sums; the o-gate's head tree (12 butterflies: 4 each
over lanes 4, 2, 1 apart), its ``inv_rms`` (2 more divisions, 1 square
root) and its 8 BF16 pair roundings; nothing loaded before the PDL wait.
Where ``ptxas`` is installed it must accept the PTX without spills.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from cute_testing import audit_forbidden, has_f32_constant
from ptx_audit import code, count, ptxas_report, spill_bytes

from dspark_core.contracts.constants import (
    MlpActivationConstants,
    OGateConstants,
)

ARCHS = ["sm_90a", "sm_100a"]
# Per element of exp_rn: products x*log2e, n*hi, n*lo, 6 Horner, n*0.5, two
# powers of two; sums: 6 Horner; differences: 2 Cody-Waite, n - n1.
EXP_MULS, EXP_ADDS, EXP_SUBS = 12, 6, 3

# (I, pdl)
MLP_VARIANTS = [(16384, True), (8192, True), (11008, True), (24, True), (8, True), (16384, False)]
# (heads, eps, pdl)
OGATE_VARIANTS = [(64, 1e-6, True), (32, 1e-6, True), (40, 1e-5, True), (5, 0.0, True), (1, 1e-6, True),
                  (64, 1e-6, False)]


def audit_common(body: str) -> None:
    """What neither kernel may contain, and its memory accesses."""
    audit_forbidden(body, no_rcp=True, explicit_rounding=True)
    global_ops = re.findall(r"\b(?:ld|st)\.global[.\w]*", body)
    assert sorted(global_ops) == ["ld.global.v4.b32", "ld.global.v4.b32", "st.global.v4.b32"], global_ops
    # The tail guard is a predicate on the store, not a branch around the work.
    assert re.search(r"@p st\.global\.v4\.b32", body)
    assert count(body, r"\bbar\.sync\b") == 0
    # exp_rn once per element: rint, floor, its clamp/NaN selections.
    assert count(body, r"\bcvt\.rni\.f32\.f32\b") == 8
    assert count(body, r"\bcvt\.rmi\.f32\.f32\b") == 8
    assert count(body, r"\bcvt\.rzi\.s32\.f32\b") == 16
    assert count(body, r"\bsetp\.nan\.f32\b") == 8
    assert count(body, r"\bneg\.f32\b") == 8
    assert not re.search(r"\b(?:min|max)\.f32\b", body), "a min/max would turn a NaN into the bound"


def audit_constants(ptx: str) -> None:
    """The spec's exp_rn constants appear as exact FP32 immediates."""
    from dspark_cute.ptx.math import EXP_BITS

    for name in ("log2e", "ln2_hi", "ln2_lo", "overflow", "underflow"):
        assert has_f32_constant(ptx, EXP_BITS[name]), name
    for bits in EXP_BITS["coeffs"]:
        assert has_f32_constant(ptx, bits), hex(bits)


def audit_pdl(body: str, pdl: bool) -> None:
    if pdl:
        head, sep, tail = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert not re.search(r"\bld\.global", head), "a load before the PDL wait"
        assert "griddepcontrol.launch_dependents" in tail
    else:
        assert "griddepcontrol" not in body


def compile_audited(kernel, args, arch: str, pdl: bool) -> tuple[str, str]:
    """``kernel`` compiled for ``arch`` and put through the audits both
    kernels share (target, ``audit_common``, constants, PDL); (PTX, code)."""
    from dspark_cute.runtime.host import compile_ptx

    ptx = compile_ptx(kernel, *args, arch=arch)
    body = code(ptx)
    assert f".target {arch}" in body
    audit_common(body)
    audit_constants(ptx)
    audit_pdl(body, pdl)
    return ptx, body


def check_ptxas(ptx: str, arch: str, tmp_path) -> None:
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0, report
        print(re.findall(r"Used \d+ registers", report))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("i,pdl", MLP_VARIANTS)
def test_mlp_activation_compiles(arch, i, pdl, tmp_path):
    from dspark_cute.cutedsl.gating.mlp_activation import MlpActivationKernel, fake_args

    c = MlpActivationConstants(intermediate_size=i)
    ptx, body = compile_audited(MlpActivationKernel(c, pdl), fake_args(c), arch, pdl)
    # Per element: exp_rn, 1 + e, 1 / (1 + e), g * s, s * u.
    assert count(body, r"\bdiv\.rn\.f32") == 8
    assert count(body, r"\bmul\.rn\.f32") == 8 * (EXP_MULS + 2)
    assert count(body, r"\badd\.rn\.f32") == 8 * (EXP_ADDS + 1)
    assert count(body, r"\bsub\.rn\.f32") == 8 * EXP_SUBS
    assert count(body, r"\bsqrt\.") == 0
    assert count(body, r"\bshfl\.") == 0
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32") == 4
    check_ptxas(ptx, arch, tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads,eps,pdl", OGATE_VARIANTS)
def test_o_gate_compiles(arch, heads, eps, pdl, tmp_path):
    from dspark_cute.cutedsl.gating.o_gate import OGateKernel, fake_args
    from dspark_cute.ptx import f32_bits

    c = OGateConstants(num_heads=heads, eps=eps)
    ptx, body = compile_audited(OGateKernel(c, pdl), fake_args(c), arch, pdl)
    # The head tree: 4 pair sums, each folded over lanes 4, 2, 1 apart.
    shuffles = re.findall(r"\bshfl\.sync\.bfly\.b32\s+%\w+, %\w+, (\d+), 31, -1;", body)
    assert sorted(shuffles) == sorted(["4"] * 4 + ["2"] * 4 + ["1"] * 4), shuffles
    assert count(body, r"\bshfl\.") == 12
    # inv_rms (2) and the 8 sigmoids' quotients.
    assert count(body, r"\bdiv\.rn\.f32") == 2 + 8
    assert count(body, r"\bsqrt\.rn\.f32") == 1
    # 8 squares, 8 x * r, 8 exp_rn, 8 n * sigmoid.
    assert count(body, r"\bmul\.rn\.f32") == 8 + 8 + 8 * EXP_MULS + 8
    # 4 pair sums, 12 folds, 3 in-thread folds, + eps, 8 exp_rn, 8 (1 + e).
    assert count(body, r"\badd\.rn\.f32") == 4 + 12 + 3 + 1 + 8 * (EXP_ADDS + 1)
    assert count(body, r"\bsub\.rn\.f32") == 8 * EXP_SUBS
    # The normed head rounded to BF16 (4 words), then the output (4 words).
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32") == 8
    assert has_f32_constant(ptx, f32_bits(64.0))
    assert has_f32_constant(ptx, f32_bits(eps))
    check_ptxas(ptx, arch, tmp_path)


@pytest.mark.compile
def test_o_gate_eps_compiles_apart():
    """eps is a compile-time constant: two values, two variants, each with its
    own FP32 immediate."""
    from dspark_cute.cutedsl.gating.o_gate import OGateKernel, fake_args
    from dspark_cute.ptx import f32_bits
    from dspark_cute.runtime.host import compile_ptx

    a, b = OGateConstants(8, 1e-6), OGateConstants(8, 1e-5)
    assert a.key() != b.key() and a != b
    ptx_a = compile_ptx(OGateKernel(a, True), *fake_args(a), arch="sm_90a")
    ptx_b = compile_ptx(OGateKernel(b, True), *fake_args(b), arch="sm_90a")
    assert has_f32_constant(ptx_a, f32_bits(1e-6)) and not has_f32_constant(ptx_a, f32_bits(1e-5))
    assert has_f32_constant(ptx_b, f32_bits(1e-5)) and not has_f32_constant(ptx_b, f32_bits(1e-6))


# ---------------------------------------------------------------- constants and host checks (no GPU needed)


def test_mlp_activation_refuses_bad_settings():
    from dspark_core.errors import Unsupported
    from dspark_cute.cutedsl.gating.mlp_activation import MAX_VECTORS, MlpActivation

    for bad in (0, 12, -8, 4):
        with pytest.raises(Unsupported, match="multiple of 8"):
            MlpActivation(MlpActivationConstants(bad))
    for bad in (True, 16384.0, "16384"):
        with pytest.raises(ValueError, match="multiple of 8"):
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
    from dspark_cute.cutedsl.gating.o_gate import OGate

    with pytest.raises(Unsupported, match="at least one head"):
        OGate(OGateConstants(0, 1e-6))
    with pytest.raises(Unsupported, match="at least one head, not 32.0"):
        OGate(OGateConstants(32.0, 1e-6))
    with pytest.raises(ValueError, match="OGateConstants"):
        OGate(32)
    for eps in (-1e-6, math.nan):
        with pytest.raises(Unsupported, match="eps"):
            OGate(OGateConstants(32, eps))
    og = OGate(OGateConstants(32, 1e-5), pdl=False)
    assert og.constants == OGateConstants(32, 1e-5) and og.width == 2048 and og.pdl is False
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
