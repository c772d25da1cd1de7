"""CPU tests: the kernels compile for sm_90a and sm_100a without a GPU, and a
PTX audit of what they compile to; plus the host-side operand checks.

Compiled here (each for sm_90a and for sm_100a):

- the row norm: every variant (no weight; BF16, FP16 and FP32 weights, each
  before and after the norm; input BF16 and FP32; output BF16, FP16, FP32),
  with PDL, and one without;
- the boundary: a representative subset, since the full matrix (49 norm
  pairs x 16 flag sets) takes minutes: all 16 flag sets (stream BF16/FP32,
  store stream, late gates, PDL) for two norm pairs, and every norm kind on
  each side (7 post, 7 pre) with the flags rotating through the 16;

The audit, per kernel: no ``fma`` (the spec has none), no ``.ftz``, no
``rsqrt``/``.approx``; every global load and store a 16-byte
``ld/st.global.v4.b32`` and their counts those of the layout; no local
memory (spills); per norm one barrier, 5 butterfly shuffles, 2 divisions and
1 square root; the PDL wait placed after the constant loads (early gates)
or before every load (late gates).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from cute_testing import WEIGHT_KINDS, WORDS, audit_forbidden, has_f32_constant, norm_constants
from ptx_audit import count, spill_bytes

from dspark_core.contracts.constants import BoundaryConstants, NormConstants, RowNormConstants

pytestmark = pytest.mark.compile

ARCHS = ["sm_90a", "sm_100a"]
H = 8192
FRAGS = H // 2048
def audit(ptx: str, loads: int, stores: int, norms: int, early_loads: int | None) -> None:
    """The PTX audit (module docstring); ``early_loads``: global loads
    expected before ``griddepcontrol.wait`` (None: no PDL)."""
    body = "\n".join(line.split("//")[0] for line in ptx.splitlines())
    audit_forbidden(body)
    global_ops = re.findall(r"\b(?:ld|st)\.global[.\w]*", body)
    assert all(op in ("ld.global.v4.b32", "st.global.v4.b32") for op in global_ops), global_ops
    assert count(body, r"\bld\.global\.v4\.b32") == loads
    assert count(body, r"\bst\.global\.v4\.b32") == stores
    assert count(body, r"\bbar\.sync\b") == norms
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 5 * norms
    assert count(body, r"\bdiv\.rn\.f32") == 2 * norms
    assert count(body, r"\bsqrt\.rn\.f32") == norms
    assert "barrier.cluster" not in body and "shared::cluster" not in body
    if early_loads is None:
        assert "griddepcontrol" not in body
    else:
        head, sep, _ = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert count(head, r"\bld\.global") == early_loads
        assert "griddepcontrol.launch_dependents" in body


def _weight_loads(norm: NormConstants) -> int:
    return FRAGS * WORDS[norm.weight_dtype] if norm.weight_dtype else 0


ROW_VARIANTS = [
    (w, i, o, True)
    for w, i, o in itertools.product(range(len(WEIGHT_KINDS)), ("bf16", "fp32"), ("bf16", "fp16", "fp32"))
] + [(2, "bf16", "bf16", False)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("w,in_dtype,out_dtype,pdl", ROW_VARIANTS)
def test_row_norm_compiles(arch, w, in_dtype, out_dtype, pdl):
    from dspark_cute.cutedsl.norms.row_norm import RowNormKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c = RowNormConstants(hidden_size=H, norm=norm_constants(w), in_dtype=in_dtype, out_dtype=out_dtype)
    ptx = compile_ptx(RowNormKernel(c, pdl), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    weight = _weight_loads(c.norm)
    audit(
        ptx,
        loads=weight + FRAGS * WORDS[in_dtype],
        stores=FRAGS * WORDS[out_dtype],
        norms=1,
        early_loads=weight if pdl else None,
    )


FLAGS = list(itertools.product((False, True), repeat=4))  # stream_bf16, store, late, pdl
BOUNDARY_VARIANTS = (
    [(2, 1, f) for f in FLAGS]
    + [(6, 5, f) for f in FLAGS]
    + [(p, (p + 3) % 7, FLAGS[(3 * p) % 16]) for p in range(7)]
    + [((q + 2) % 7, q, FLAGS[(5 * q + 1) % 16]) for q in range(7)]
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("post,pre,flags", BOUNDARY_VARIANTS)
def test_boundary_compiles(arch, post, pre, flags):
    from dspark_cute.cutedsl.norms.boundary import BoundaryKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    stream_bf16, store, late, pdl = flags
    c = BoundaryConstants(hidden_size=H, post=norm_constants(post), pre=norm_constants(pre))
    ptx = compile_ptx(BoundaryKernel(c, stream_bf16, store, late, pdl), *fake_args(c, stream_bf16), arch=arch)
    assert f".target {arch}" in ptx
    gates = 2 * FRAGS * WORDS["fp32"] + _weight_loads(c.post) + _weight_loads(c.pre)
    rows = FRAGS * WORDS["bf16"] + FRAGS * WORDS["bf16" if stream_bf16 else "fp32"]
    audit(
        ptx,
        loads=gates + rows,
        stores=FRAGS * WORDS["bf16"] + (FRAGS * WORDS["fp32"] if store else 0),
        norms=2,
        early_loads=(0 if late else gates) if pdl else None,
    )


def test_compile_cache_keys_keep_signed_zero_apart():
    """Constants that differ only in a -0.0 gain center must not share a
    kernel: w + (-0.0) keeps a -0.0 weight, w + 0.0 does not."""
    from dspark_cute.cutedsl.norms.row_norm import RowNormKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    a = RowNormConstants(H, NormConstants(1e-6, "bf16", 0.0, False), "bf16", "bf16")
    b = RowNormConstants(H, NormConstants(1e-6, "bf16", -0.0, False), "bf16", "bf16")
    assert a.key() != b.key()
    ptx_a = compile_ptx(RowNormKernel(a, True), *fake_args(a), arch="sm_90a")
    ptx_b = compile_ptx(RowNormKernel(b, True), *fake_args(b), arch="sm_90a")
    assert has_f32_constant(ptx_a, 0x00000000) and has_f32_constant(ptx_b, 0x80000000)
    assert not has_f32_constant(ptx_a, 0x80000000)


def test_host_refuses_bad_operands():
    from dspark_cute import DraftBoundary, RowNorm

    c = RowNormConstants(H, NormConstants(1e-6, "bf16", 0.0, False), "bf16", "bf16")
    with pytest.raises(ValueError, match="contiguous CUDA"):
        RowNorm(c, torch.ones(H, dtype=torch.bfloat16))  # not on a GPU
    with pytest.raises(ValueError, match="weightless"):
        RowNorm(RowNormConstants(H, NormConstants(1e-6, None, 0.0, False), "bf16", "bf16"),
                torch.ones(H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="RowNormConstants"):
        RowNorm(c.norm, None)
    with pytest.raises(ValueError, match="2048"):
        RowNorm(RowNormConstants(3000, c.norm, "bf16", "bf16"), None)
    bc = BoundaryConstants(H, c.norm, c.norm)
    with pytest.raises(ValueError, match="alpha"):
        DraftBoundary(bc, torch.ones(H), torch.ones(H), None, None)
    with pytest.raises(ValueError, match="BoundaryConstants"):
        DraftBoundary(c, torch.ones(H), torch.ones(H), None, None)


def test_compile_refuses_capture(monkeypatch):
    from dspark_cute.runtime import host

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="prepare"):
        host.compile_kernel(object())


def test_spill_bytes_reads_the_largest_spill_of_a_report():
    """``spill_bytes``: the most spill-store bytes over a report's functions
    (a ptxas ``-v`` report of two functions here), 0 without any line."""
    report = ("ptxas info    : Function properties for k_a\n"
              "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
              "ptxas info    : Function properties for k_b\n"
              "    16 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads\n")
    assert spill_bytes(report) == 16
    assert spill_bytes(report.replace("16 bytes spill stores", "0 bytes spill stores")) == 8
    assert spill_bytes(report, "spill loads") == 12 and spill_bytes(report, "stack frame") == 16
    # A substring check would read "160 bytes spill stores" as none.
    assert spill_bytes(report.replace("16 bytes spill stores", "160 bytes spill stores")) == 160
    assert spill_bytes("") == 0
    with pytest.raises(ValueError, match="not 'registers'"):
        spill_bytes(report, "registers")
