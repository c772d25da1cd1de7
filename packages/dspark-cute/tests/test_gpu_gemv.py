"""GPU tests of the one-token GEMV (``dspark_cute.cutedsl.gemm.gemv.Gemv``): bit for bit
``dspark_core.spec.gemv.gemv`` (the spec, run on the same device, and on the CPU
for a small shape: its device-independent bits), compared with
``dspark_core.tools.compare.assert_bitwise`` (any NaN equals any NaN):

- the reference draft's four projections (QKV 9216 x 8192, o_proj 8192 x
  4096, gate_up 32768 x 8192, down 8192 x 16384) and small shapes, on random
  data over a wide exponent range, with and without PDL, other launch
  settings (which must not change a bit);
- special values: -0.0, subnormal and underflowing products, overflow to
  inf, inf * 0, NaN;
- within the spec's stated bound of the exact (float64) product, beside
  cuBLAS's error on the same bound;
- a CUDA graph replay on new data gives the eager bits; a compile during
  capture raises RuntimeError; operands it does not take are ValueErrors.

Every output is poisoned (a NaN pattern, then a finite one) before each
launch. Fresh seeded data: the seed is printed (repeat with DSPARK_SEED)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from cute_testing import check_poisoned, requires_cuda

from dspark_core.contracts.constants import GemvConstants
from dspark_core.spec import gemv as G
from dspark_core.tools.compare import assert_bitwise
from dspark_cute.cutedsl.gemm.gemv import Gemv

pytestmark = [pytest.mark.gpu, requires_cuda]

SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
print(f"DSPARK_SEED={SEED}")
BF16 = torch.bfloat16
SHAPES = [(9216, 8192), (8192, 4096), (32768, 8192), (8192, 16384), (16, 256), (48, 768)]


def _wide(gen, shape, spread=20) -> torch.Tensor:
    mant = torch.rand(shape, generator=gen, device="cuda") + 0.5
    exp = torch.randint(-spread, spread, shape, generator=gen, device="cuda").float()
    sign = torch.where(torch.rand(shape, generator=gen, device="cuda") < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(exp)).to(BF16)


def _gen(salt: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(SEED + salt)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("pdl", [True, False])
def test_gemv_is_the_spec_bit_for_bit(n, k, pdl):
    gen = _gen(n + k)
    w, x = _wide(gen, (n, k)), _wide(gen, (1, k))
    gemv = Gemv(GemvConstants("probe", n, k), w, pdl=pdl)
    gemv.prepare()
    out = torch.empty(1, n, dtype=BF16, device="cuda")
    check_poisoned(lambda: gemv.run(x, out), [out], [G.gemv(x, w)], f"gemv {n}x{k}")


@pytest.mark.parametrize("rows,depth", [(4, 2), (8, 1), (2, 16)])
def test_launch_settings_change_no_bit(rows, depth):
    n, k = 8192, 4096
    gen = _gen(rows * 100 + depth)
    w, x = _wide(gen, (n, k)), _wide(gen, (1, k))
    gemv = Gemv(GemvConstants("probe", n, k), w, rows_per_warp=rows, depth=depth)
    out = torch.empty(1, n, dtype=BF16, device="cuda")
    check_poisoned(lambda: gemv.run(x, out), [out], [G.gemv(x, w)], f"gemv rows {rows} depth {depth}")


def test_gemv_is_the_spec_run_on_the_cpu():
    gen = _gen(3)
    n, k = 64, 1024
    w, x = _wide(gen, (n, k), 60), _wide(gen, (1, k), 60)
    got = Gemv(GemvConstants("probe", n, k), w).run(x)
    assert_bitwise(got.cpu(), G.gemv(x.cpu(), w.cpu()), "gemv vs the CPU spec")


def test_special_values():
    k = 512
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0**-133, -(2.0**-126),
                             2.0**127, -(2.0**100), 1.0, 3.0, 2.0**-100])
    gen = _gen(5)
    w = _wide(gen, (64, k))
    x = _wide(gen, (1, k))
    idx = torch.randint(0, k, (64, 6), generator=gen, device="cuda")
    choice = torch.randint(0, len(specials), (64, 6), generator=gen, device="cuda")
    w.scatter_(1, idx, specials.cuda()[choice].to(BF16))
    w[:8] = 0.0
    w[:8, :16] = specials.cuda()[torch.arange(16, device="cuda") % len(specials)].to(BF16)
    w[0].fill_(-0.0)  # an all -0.0 row times a finite x: -0.0 * x is +-0.0 and they add to +0.0 or -0.0
    x[0, 200:220] = specials[torch.arange(20) % 4].to(BF16).cuda()  # +-0.0, +-inf on some columns
    gemv = Gemv(GemvConstants("probe", 64, k), w)
    out = torch.empty(1, 64, dtype=BF16, device="cuda")
    check_poisoned(lambda: gemv.run(x, out), [out], [G.gemv(x, w)], "special values")
    finite = x.clone()
    finite[0, 200:220] = 1.0
    check_poisoned(lambda: gemv.run(finite, out), [out], [G.gemv(finite, w)], "special weights")
    assert_bitwise(out.cpu(), G.gemv(finite.cpu(), w.cpu()), "special weights vs the CPU spec")


@pytest.mark.parametrize("n,k", [(9216, 8192), (8192, 16384)])
def test_gemv_within_its_bound_beside_cublas(n, k):
    gen = _gen(7)
    w = torch.randn(n, k, generator=gen, device="cuda").to(BF16)
    x = torch.randn(1, k, generator=gen, device="cuda").to(BF16)
    out = Gemv(GemvConstants("probe", n, k), w).run(x)
    exact = x.double() @ w.double().t()
    bound = G.error_bound(x, w, out)
    assert bool(((out.double() - exact).abs() <= bound).all())
    cublas = x @ w.t()
    ratio = float(((out.double() - exact).abs() / bound).max())
    ratio_cublas = float(((cublas.double() - exact).abs() / G.error_bound(x, w, cublas)).max())
    print(f"{n}x{k}: max error / bound: gemv {ratio:.3f}, cuBLAS {ratio_cublas:.3f}")


def test_graph_replays_are_the_eager_bits():
    n, k = 9216, 8192
    gen = _gen(11)
    w, x = _wide(gen, (n, k)), _wide(gen, (1, k))
    gemv = Gemv(GemvConstants("probe", n, k), w)
    gemv.prepare()
    out = torch.empty(1, n, dtype=BF16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemv.run(x, out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            gemv.launch(x, out)
            gemv.launch(x, out)
    torch.cuda.synchronize()
    for salt in range(3):
        x.copy_(_wide(_gen(100 + salt), (1, k)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, G.gemv(x, w), f"replay {salt}")


def test_operands_it_does_not_take_are_value_errors():
    w = torch.zeros(64, 512, dtype=BF16, device="cuda")
    gemv = Gemv(GemvConstants("probe", 64, 512), w)
    assert gemv.takes(torch.zeros(1, 512, dtype=BF16, device="cuda"))
    for x in (torch.zeros(2, 512, dtype=BF16, device="cuda"), torch.zeros(1, 512, device="cuda"),
              torch.zeros(1, 1024, dtype=BF16, device="cuda")[:, ::2], torch.zeros(1, 512, dtype=BF16)):
        assert not gemv.takes(x)
        with pytest.raises(ValueError, match=r"takes x of bf16 \[1, 512\]"):
            gemv.run(x)
    with pytest.raises(ValueError, match="output"):
        gemv.run(torch.zeros(1, 512, dtype=BF16, device="cuda"), torch.empty(1, 32, dtype=BF16, device="cuda"))


def test_compile_refused_during_capture():
    w = torch.zeros(16, 4352, dtype=BF16, device="cuda")  # a shape no other test compiles
    gemv = Gemv(GemvConstants("probe", 16, 4352), w)
    x = torch.zeros(1, 4352, dtype=BF16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="captur"):
            with torch.cuda.graph(graph, stream=stream):
                gemv.launch(x)
