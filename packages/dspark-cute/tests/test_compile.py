"""CPU tests: the norm kernels compile for sm_90a and sm_100a without a GPU,
a PTX audit of what they compile to, their register use (ptxas, where
installed), the host-side operand checks; and the kernels' own tree code run
on CPU tensors against the spec.

Compiled here, each for sm_90a and for sm_100a, each with the stock tree of
that arch (the constants' ``arch``):

- the row norm: every variant (no weight; BF16, FP16 and FP32 weights, each
  before and after the norm; input BF16 and FP32; output BF16, FP16, FP32),
  with PDL, and one without; other widths (2048, 6144, 16384);
- the boundary: all 16 flag sets (stream BF16/FP32, store stream, late
  gates, PDL) for two norm pairs, and every norm kind on each side (7 post,
  7 pre) with the flags rotating through the 16; one pair of mixed archs.

The audit, per kernel (``norm_testing.audit_norm_ptx``): per norm one
``rsqrt.approx.ftz.f32`` and ``1 + leaves`` ``fma.rn.f32`` (the leaves: 16
per 2048 columns on sm_90a and for an input-scaled norm on sm_100a, none for
sm_100a's rounded squares), the ``mul.rn.f32`` of its tree and products, no
other approximate, flushing, dividing or square-root instruction, explicit
``.rn`` on every FP32 add/mul; every global load and store a 16-byte
``ld/st.global.v4.b32`` and their counts those of the layout; no local
memory; per norm one barrier and 5 butterfly shuffles; the PDL wait placed
after the constant loads (early gates) or before every load (late gates);
no spills (ptxas).

The tree check: ``ptx.reduce.thread_sum_of_squares`` (the code that traces
the kernels' thread sum) run with CPU tensors standing in for its FP32
values, against ``spec.numerics.thread_sum_of_squares``, for 1 to 8 chunks,
both archs, input-scaled or not, on random and special values.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from cute_testing import WEIGHT_KINDS, WORDS, has_f32_constant
from cute_testing import norm_constants as kind_constants
from norm_testing import audit_norm_ptx, code, count
from ptx_audit import ptxas_report, spill_bytes

from dspark_core.contracts.constants import BoundaryConstants, NormConstants, RowNormConstants
from dspark_core.spec import numerics

pytestmark = pytest.mark.compile

ARCHS = ["sm_90a", "sm_100a"]
H = 8192
FRAGS = H // 2048


def norm_constants(i: int, arch: str) -> NormConstants:
    """``cute_testing.norm_constants(i)`` on ``arch``."""
    return dataclasses.replace(kind_constants(i), arch=arch)


def audit(ptx: str, norms: list, h: int, loads: int, stores: int, early_loads: int | None,
          extra_muls: int = 0) -> None:
    """The PTX audit (module docstring); ``early_loads``: global loads
    expected before ``griddepcontrol.wait`` (None: no PDL)."""
    body = code(ptx)
    audit_norm_ptx(body, norms, h, extra_muls)
    global_ops = re.findall(r"\b(?:ld|st)\.global[.\w]*", body)
    assert all(op in ("ld.global.v4.b32", "st.global.v4.b32") for op in global_ops), global_ops
    assert count(body, r"\bld\.global\.v4\.b32") == loads
    assert count(body, r"\bst\.global\.v4\.b32") == stores
    assert count(body, r"\bbar\.sync\b") == len(norms)
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 5 * len(norms)
    assert "barrier.cluster" not in body and "shared::cluster" not in body
    if early_loads is None:
        assert "griddepcontrol" not in body
    else:
        head, sep, _ = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert count(head, r"\bld\.global") == early_loads
        assert "griddepcontrol.launch_dependents" in body


def no_spills(ptx: str, arch: str, tmp_path) -> None:
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0 and spill_bytes(report, "stack frame") == 0, report


def _weight_loads(norm: NormConstants, frags: int = FRAGS) -> int:
    return frags * WORDS[norm.weight_dtype] if norm.weight_dtype else 0


ROW_VARIANTS = [
    (w, i, o, True)
    for w, i, o in itertools.product(range(len(WEIGHT_KINDS)), ("bf16", "fp32"), ("bf16", "fp16", "fp32"))
] + [(2, "bf16", "bf16", False)]


def _row_norm_ptx(c: RowNormConstants, pdl: bool, arch: str) -> str:
    from dspark_cute.cutedsl.norms.row_norm import RowNormKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    ptx = compile_ptx(RowNormKernel(c, pdl), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    return ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("w,in_dtype,out_dtype,pdl", ROW_VARIANTS)
def test_row_norm_compiles(arch, w, in_dtype, out_dtype, pdl, tmp_path):
    c = RowNormConstants(hidden_size=H, norm=norm_constants(w, arch), in_dtype=in_dtype, out_dtype=out_dtype)
    ptx = _row_norm_ptx(c, pdl, arch)
    weight = _weight_loads(c.norm)
    audit(ptx, [c.norm], H, loads=weight + FRAGS * WORDS[in_dtype], stores=FRAGS * WORDS[out_dtype],
          early_loads=weight if pdl else None)
    if out_dtype == "bf16" and in_dtype == "bf16":
        no_spills(ptx, arch, tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h,w", [(2048, 1), (6144, 2), (16384, 6)])
def test_row_norm_widths_compile(arch, h, w, tmp_path):
    """Other widths: 1, 3 (a chunk count that is no power of two: the tree
    pads with +0.0) and 8 chunks per thread."""
    c = RowNormConstants(hidden_size=h, norm=norm_constants(w, arch), in_dtype="bf16", out_dtype="bf16")
    ptx = _row_norm_ptx(c, True, arch)
    frags = h // 2048
    weight = _weight_loads(c.norm, frags)
    audit(ptx, [c.norm], h, loads=weight + frags, stores=frags, early_loads=weight)
    no_spills(ptx, arch, tmp_path)


FLAGS = list(itertools.product((False, True), repeat=4))  # stream_bf16, store, late, pdl
BOUNDARY_VARIANTS = (
    [(2, 1, f) for f in FLAGS]
    + [(6, 5, f) for f in FLAGS]
    + [(p, (p + 3) % 7, FLAGS[(3 * p) % 16]) for p in range(7)]
    + [((q + 2) % 7, q, FLAGS[(5 * q + 1) % 16]) for q in range(7)]
)


def _boundary_ptx(c: BoundaryConstants, flags, arch: str) -> str:
    from dspark_cute.cutedsl.norms.boundary import BoundaryKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    stream_bf16, store, late, pdl = flags
    ptx = compile_ptx(BoundaryKernel(c, stream_bf16, store, late, pdl), *fake_args(c, stream_bf16), arch=arch)
    assert f".target {arch}" in ptx
    return ptx


def _audit_boundary(ptx: str, c: BoundaryConstants, flags) -> None:
    stream_bf16, store, late, pdl = flags
    gates = 2 * FRAGS * WORDS["fp32"] + _weight_loads(c.post) + _weight_loads(c.pre)
    rows = FRAGS * WORDS["bf16"] + FRAGS * WORDS["bf16" if stream_bf16 else "fp32"]
    audit(
        ptx, [c.post, c.pre], H,
        loads=gates + rows,
        stores=FRAGS * WORDS["bf16"] + (FRAGS * WORDS["fp32"] if store else 0),
        early_loads=(0 if late else gates) if pdl else None,
        extra_muls=2 * 8 * FRAGS,  # alpha * stream and beta * p per column
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("post,pre,flags", BOUNDARY_VARIANTS)
def test_boundary_compiles(arch, post, pre, flags, tmp_path):
    c = BoundaryConstants(hidden_size=H, post=norm_constants(post, arch), pre=norm_constants(pre, arch))
    ptx = _boundary_ptx(c, flags, arch)
    _audit_boundary(ptx, c, flags)
    if flags[3]:  # the PDL variants (every launch on sm_90+)
        no_spills(ptx, arch, tmp_path)


def test_boundary_of_two_trees_compiles():
    """Each norm follows its own constants' arch (the planner gives both the
    target's; the kernel does not assume it)."""
    c = BoundaryConstants(hidden_size=H, post=norm_constants(2, "sm_100a"), pre=norm_constants(1, "sm_90a"))
    flags = (False, True, False, True)
    _audit_boundary(_boundary_ptx(c, flags, "sm_90a"), c, flags)


def test_fma_leaves_follow_the_arch_not_the_target():
    """The tree is the constants' (compile-time), whatever GPU the PTX targets."""
    for arch in ARCHS:
        c = RowNormConstants(H, norm_constants(1, arch), "bf16", "bf16")
        body = code(_row_norm_ptx(c, True, "sm_90a"))
        assert count(body, r"\bfma\.rn\.f32\b") == (17 if arch == "sm_90a" else 1)


def test_compile_cache_keys_keep_signed_zero_apart():
    """Constants that differ only in a -0.0 gain center must not share a
    kernel: w + (-0.0) keeps a -0.0 weight, w + 0.0 does not."""
    a = RowNormConstants(H, NormConstants(1e-6, "bf16", 0.0, False), "bf16", "bf16")
    b = RowNormConstants(H, NormConstants(1e-6, "bf16", -0.0, False), "bf16", "bf16")
    assert a.key() != b.key()
    ptx_a = _row_norm_ptx(a, True, "sm_90a")
    ptx_b = _row_norm_ptx(b, True, "sm_90a")
    assert has_f32_constant(ptx_a, 0x00000000) and has_f32_constant(ptx_b, 0x80000000)
    assert not has_f32_constant(ptx_a, 0x80000000)


def test_compile_cache_keys_keep_archs_apart():
    a = RowNormConstants(H, NormConstants(1e-6, "bf16", 0.0, False, "sm_90a"), "bf16", "bf16")
    b = RowNormConstants(H, NormConstants(1e-6, "bf16", 0.0, False, "sm_100a"), "bf16", "bf16")
    assert a.key() != b.key() and a != b


def test_host_refuses_bad_operands():
    from dspark_core.errors import Unsupported
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
    with pytest.raises(Unsupported, match="sm_80"):
        RowNorm(RowNormConstants(H, NormConstants(1e-6, None, 0.0, False, "sm_80"), "bf16", "bf16"), None)
    bc = BoundaryConstants(H, c.norm, c.norm)
    with pytest.raises(ValueError, match="alpha"):
        DraftBoundary(bc, torch.ones(H), torch.ones(H), None, None)
    with pytest.raises(ValueError, match="BoundaryConstants"):
        DraftBoundary(c, torch.ones(H), torch.ones(H), None, None)
    with pytest.raises(Unsupported, match="sm_120a"):
        DraftBoundary(BoundaryConstants(H, c.norm, dataclasses.replace(c.norm, arch="sm_120a")),
                      torch.ones(H), torch.ones(H), None, None)


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


# ---------------------------------------------------------------- the kernels' tree on the CPU


@pytest.fixture
def cpu_tree(monkeypatch):
    """``ptx.reduce`` with its FP32 instructions replaced by their CPU
    tensor forms (``add.rn``/``mul.rn``: torch's FP32 ops; ``fma.rn``: the
    spec's exact ``fma_rn``; a padding +0.0 a tensor), so the code that
    traces the kernels' thread sum computes on tensors."""
    from dspark_cute.ptx import reduce, stock

    monkeypatch.setattr(reduce, "add_rn", torch.add)
    monkeypatch.setattr(reduce, "mul_rn", torch.mul)
    monkeypatch.setattr(reduce, "fma_rn", numerics.fma_rn)
    monkeypatch.setattr(stock, "add_rn", torch.add)
    monkeypatch.setattr(stock, "Float32", lambda v: torch.tensor(v, dtype=torch.float32))
    return reduce


def _thread_elements(gen: torch.Generator, chunks: int, special: bool) -> torch.Tensor:
    """``[rows, 8 * chunks]`` FP32 thread elements: values of a wide exponent
    range rounded to BF16 (the draft's rows), or FP32 with -0.0, subnormals,
    infinities, NaN, overflowing and underflowing squares mixed in."""
    n = 8 * chunks
    x = torch.randn(4096, n, generator=gen) * torch.exp2(torch.randint(-20, 21, (4096, n), generator=gen).float())
    if not special:
        return x.to(torch.bfloat16).float()
    pick = torch.randint(0, 12, x.shape, generator=gen)
    values = [-0.0, 0.0, 1e-40, -3e-42, float("inf"), float("-inf"), float("nan"), 3e38, -2e19, 1e-30]
    for i, v in enumerate(values):
        x = torch.where(pick == i, torch.full_like(x, v), x)
    return x


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "input_scaled"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
def test_kernel_thread_tree_is_the_spec(cpu_tree, arch, scaled, chunks, special, seed):
    """The kernels' ``thread_sum_of_squares`` (chunk partials, pairwise over
    the chunks; per parity on sm_100a) is ``spec.numerics.thread_sum_of_squares``
    bit for bit (NaN as NaN)."""
    from dspark_core.tools.compare import assert_bitwise

    gen = torch.Generator().manual_seed(seed)
    e = _thread_elements(gen, chunks, special)
    fragments = [[e[:, 8 * r + j] for j in range(8)] for r in range(chunks)]
    got = cpu_tree.thread_sum_of_squares(fragments, arch, scaled)
    assert_bitwise(got, numerics.thread_sum_of_squares(e, arch, scaled), f"{arch} scaled={scaled} chunks={chunks}")


def test_chunk_partials_refuse_an_unknown_arch(cpu_tree):
    e = [torch.ones(1) for _ in range(8)]
    with pytest.raises(ValueError, match="sm_80"):
        cpu_tree.chunk_partials(e, "sm_80")
