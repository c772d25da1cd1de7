"""GPU tests of ``dspark_cute.RowNorm``: bit for bit ``dspark_core.spec.layers.RMSNorm``
run on the same CUDA device, for every variant (no weight, BF16/FP16/FP32
weight, gain center 0 or 1, weight before or after the norm, eps, BF16/FP32
input, BF16/FP16/FP32 output), many row counts, special values, with and
without PDL, and inside a CUDA graph. Outputs are poisoned before each launch
(a NaN pattern, then a finite one) so an unwritten element shows."""

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

from dspark_core.contracts.constants import row_norm_constants
from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H = 8192
NORMS = GPU_NORMS
ROWS = [1, 2, 7, 16, 132, 133, 1000, 4096]


def check(norm, x: torch.Tensor, what: str, pdl: bool | None = None) -> None:
    from dspark_cute import RowNorm

    kernel = RowNorm(row_norm_constants(norm, norm.hidden_size, x.dtype), norm.weight, pdl=pdl)
    kernel.prepare()
    assert kernel.takes(x)
    expected = norm(x)
    out = torch.empty_like(expected)
    check_poisoned(lambda: kernel.run(x, out), [out], [expected], what)
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


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(
    "case,in_dtype,out_dtype",
    [(NORMS[1], BF16, BF16), (NORMS[4], FP32, FP16), (NORMS[6], BF16, FP32)],
    ids=["bf16-bf16", "fp32-fp16", "bf16-fp32"],
)
def test_row_counts(m, case, in_dtype, out_dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(case, H, gen, out_dtype=out_dtype)
    check(norm, random_rows(gen, m, H, in_dtype, "cuda"), f"{norm_name(case)} m={m}")


@pytest.mark.parametrize("h", [2048, 6144, 16384])
def test_hidden_sizes(h, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(NORMS[2], h, gen, out_dtype=BF16)
    check(norm, random_rows(gen, 9, h, BF16, "cuda"), f"H={h}")


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


def test_without_pdl(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(NORMS[3], H, gen, out_dtype=BF16)
    for m in (1, 133):
        check(norm, random_rows(gen, m, H, BF16, "cuda"), f"no PDL m={m}", pdl=False)


def test_cuda_graph(seed):
    from dspark_cute import RowNorm

    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm(NORMS[2], H, gen, out_dtype=BF16)
    kernel = RowNorm(row_norm_constants(norm, H, BF16), norm.weight)
    kernel.prepare()
    x = random_rows(gen, 16, H, BF16, "cuda")
    out = torch.empty((16, H), dtype=BF16, device="cuda")
    graph = capture_calls(lambda: kernel.run(x, out))
    for _ in range(2):
        x.copy_(random_rows(gen, 16, H, BF16, "cuda"))
        expected = norm(x)
        check_poisoned(graph.replay, [out], [expected], "graph replay")
        assert_replays_repeat(graph, [out])


def test_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.norms.row_norm import RowNorm

    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = make_norm((BF16, 0.5, False, 3e-4), H, gen, out_dtype=BF16)  # constants no other test compiles
    kernel = RowNorm(row_norm_constants(norm, H, BF16), norm.weight)
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
    kernel = RowNorm(row_norm_constants(norm, H, BF16), norm.weight)
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
