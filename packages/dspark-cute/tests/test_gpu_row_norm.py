"""GPU tests of ``dspark_cute.RowNorm``: bit for bit ``dspark_core.spec.layers.RMSNorm``
run on the same CUDA device with the same arch's tree (sm_90a and sm_100a
both run on an H200: the tree is the constants', the instructions the
device's), and bit for bit vLLM 0.33.0's stock ``fused_rmsnorm_fwd`` (the
carried Triton 3.8 binaries, ``stock.py``) where it has the variant.

Against the spec: every variant (no weight, BF16/FP16/FP32 weight, gain
center 0 or 1, weight before or after the norm, eps, BF16/FP32 input,
BF16/FP16/FP32 output) on sm_90a, every weight kind on sm_100a, many row
counts, other widths, special values, with and without PDL, inside a CUDA
graph. Against the stock (sm_90a, H = 8192, BF16 rows): every weight kind it
has (BF16, FP32, none; input-scaled or not; center 0 or 1), BF16 and FP32
out, m in {1, 2, 7, 16, 133, 4096}, with special rows planted. Outputs are
poisoned before each launch (a NaN pattern, then a finite one) so an
unwritten element shows."""

from __future__ import annotations

import pytest
import torch
from cute_testing import (
    GPU_NORMS,
    assert_replays_repeat,
    capture_calls,
    check_poisoned,
    make_norm,
    norm_name,
    random_rows,
    requires_cuda,
    special_rows,
)
from norm_testing import STOCK_ROWS, planted_rows, row_consts, stock_norm, stock_or_skip, with_arch

from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H = 8192
NORMS = GPU_NORMS
ROWS = [1, 2, 7, 16, 132, 133, 1000, 4096]
ARCHS = ["sm_90a", "sm_100a"]


def row_norm(norm, in_dtype, arch: str, pdl=None):
    from dspark_cute import RowNorm

    kernel = RowNorm(row_consts(norm, in_dtype, arch), norm.weight, pdl=pdl)
    kernel.prepare()
    return kernel


def check(norm, x: torch.Tensor, what: str, pdl: bool | None = None, arch: str = "sm_90a",
          stock_out: torch.Tensor | None = None) -> None:
    """The kernel of ``norm`` on ``arch`` against the spec with that arch's
    tree on ``x`` (and against the stock kernel's ``stock_out``, if given),
    outputs poisoned."""
    kernel = row_norm(norm, x.dtype, arch, pdl)
    assert kernel.takes(x)
    expected = with_arch(norm, arch)(x)
    out = torch.empty_like(expected)
    what = f"{what} [{arch}]"
    check_poisoned(lambda: kernel.run(x, out), [out], [expected], what)
    if stock_out is not None:
        assert_bitwise(out, stock_out, f"{what} against the stock kernel")
    # The allocating path writes the same bits.
    assert_bitwise(kernel.run(x), expected, f"{what} (allocated output)")


@pytest.mark.parametrize("case", NORMS, ids=norm_name)
@pytest.mark.parametrize("out_dtype", [BF16, FP16, FP32], ids=["out_bf16", "out_fp16", "out_fp32"])
@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=["in_bf16", "in_fp32"])
def test_every_variant(case, out_dtype, in_dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(case, H, gen, out_dtype=out_dtype)
    for m in (1, 7, 133):
        check(norm, random_rows(gen, m, H, in_dtype, "cuda"), f"{norm_name(case)} m={m}")


@pytest.mark.parametrize("case", NORMS, ids=norm_name)
def test_sm100a_tree(case, seed):
    """The sm_100a tree (even and odd pairwise trees; input-scaled leaves) of
    every weight kind, random and special rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(case, H, gen, out_dtype=BF16)
    for m in (1, 7, 133):
        check(norm, planted_rows(gen, m, H, BF16), f"{norm_name(case)} m={m}", arch="sm_100a")
    special = make_norm(case, H, gen, special_weight=True, out_dtype=BF16)
    check(special, special_rows(H, BF16, "cuda"), f"special {norm_name(case)}", arch="sm_100a")


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(
    "case,in_dtype,out_dtype,arch",
    [(NORMS[1], BF16, BF16, "sm_90a"), (NORMS[4], FP32, FP16, "sm_90a"), (NORMS[6], BF16, FP32, "sm_90a"),
     (NORMS[2], BF16, BF16, "sm_100a")],
    ids=["bf16-bf16", "fp32-fp16", "bf16-fp32", "bf16-bf16-sm100a"],
)
def test_row_counts(m, case, in_dtype, out_dtype, arch, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(case, H, gen, out_dtype=out_dtype)
    check(norm, random_rows(gen, m, H, in_dtype, "cuda"), f"{norm_name(case)} m={m}", arch=arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h", [2048, 6144, 16384])
def test_hidden_sizes(h, arch, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(NORMS[2], h, gen, out_dtype=BF16)
    check(norm, planted_rows(gen, 9, h, BF16), f"H={h}", arch=arch)


def test_leading_dims(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(NORMS[1], H, gen, out_dtype=BF16)
    check(norm, random_rows(gen, 6, H, BF16, "cuda").view(2, 3, H), "[2, 3, H]")


@pytest.mark.parametrize("case", NORMS, ids=norm_name)
@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=["in_bf16", "in_fp32"])
def test_special_values(case, in_dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for out_dtype in (BF16, FP16):
        norm = make_norm(case, H, gen, special_weight=True, out_dtype=out_dtype)
        check(norm, special_rows(H, in_dtype, "cuda"), f"special {norm_name(case)} -> {out_dtype}")


# Every variant the stock has (sm_90a, H = 8192, BF16 rows): (weight dtype or
# None, gain center, input scale); each with BF16 and FP32 out.
STOCK_NORMS = [
    (w, center, scale)
    for w in (BF16, FP32, None)
    for center in ((0.0, 1.0) if w is not None else (0.0,))
    for scale in ((False, True) if w is not None else (False,))
]


def _stock_name(case) -> str:
    w, center, scale = case
    return f"{str(w).replace('torch.', '') if w else 'noweight'}-c{center}-{'is1' if scale else 'is0'}"


@pytest.mark.parametrize("out_dtype", [BF16, FP32], ids=["out_bf16", "out_fp32"])
@pytest.mark.parametrize("case", STOCK_NORMS, ids=_stock_name)
def test_against_the_stock(case, out_dtype, seed):
    """The kernel (sm_90a) against vLLM 0.33.0's own norm on the same
    operands, and against the spec, m in {1, 2, 7, 16, 133, 4096}, special
    rows planted; the weight with -0.0, subnormal, large and center-cancelling
    entries."""
    stock = stock_or_skip()
    w, center, scale = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm((w, center, scale, 1e-6), H, gen, special_weight=True, out_dtype=out_dtype)
    for m in STOCK_ROWS:
        x = planted_rows(gen, m, H, BF16)
        check(norm, x, f"stock {_stock_name(case)} -> {out_dtype} m={m}", stock_out=stock_norm(stock, norm, x))


def test_without_pdl(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(NORMS[3], H, gen, out_dtype=BF16)
    for m in (1, 133):
        check(norm, random_rows(gen, m, H, BF16, "cuda"), f"no PDL m={m}", pdl=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph(arch, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = with_arch(make_norm(NORMS[2], H, gen, out_dtype=BF16), arch)
    kernel = row_norm(norm, BF16, arch)
    x = random_rows(gen, 16, H, BF16, "cuda")
    out = torch.empty((16, H), dtype=BF16, device="cuda")
    graph = capture_calls(lambda: kernel.run(x, out))
    for _ in range(2):
        x.copy_(planted_rows(gen, 16, H, BF16))
        expected = norm(x)
        check_poisoned(graph.replay, [out], [expected], f"graph replay [{arch}]")
        assert_replays_repeat(graph, [out])


def test_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.norms.row_norm import RowNorm

    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm((BF16, 0.5, False, 3e-4), H, gen, out_dtype=BF16)  # constants no other test compiles
    kernel = RowNorm(row_consts(norm, BF16, "sm_90a"), norm.weight)
    x = random_rows(gen, 2, H, BF16, "cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            kernel.run(x)


def test_refuses_bad_operands(seed):
    from dspark_cute import RowNorm

    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(NORMS[1], H, gen, out_dtype=BF16)
    kernel = RowNorm(row_consts(norm, BF16, "sm_90a"), norm.weight)
    good = random_rows(gen, 4, H, BF16, "cuda")
    bad = [
        good.float(),  # the wrong input dtype
        good[:, : H // 2].contiguous(),  # the wrong width
        good.t(),  # not contiguous
        good.flatten()[4 : 4 + 3 * H].view(3, H),  # misaligned (16 bytes)
        good[:0],  # no rows
        good.cpu(),
    ]
    for x in bad:
        assert not kernel.takes(x)
        with pytest.raises(ValueError):
            kernel.run(x)
    with pytest.raises(ValueError):
        kernel.run(good, torch.empty((4, H), dtype=FP32, device="cuda"))
