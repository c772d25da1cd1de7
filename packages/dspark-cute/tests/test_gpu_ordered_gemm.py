"""The ordered GEMM on the GPU against the live cuBLAS (``F.linear``, what
vLLM calls): the build-time check finds each projection's order at every row
count the kernel takes, the bound kernel then gives cuBLAS's bits on fresh
probes (special values, poisoned outputs), in CUDA graphs with PDL, and on
the TP shards of the draft's projections; in both kernel designs (the
``cp.async`` one and the streamed, TMA one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cute_testing import capture_calls, poison, requires_cuda

from dspark_core.contracts.constants import ordered_gemm_constants
from dspark_core.runtime import gemm_check
from dspark_core.spec.split_order import SplitOrder
from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

# The reference draft's projections [N, K] (hidden 8192, 64 / 8 heads of 64
# with the o-gate rows, intermediate 16384, three target layers into fc,
# V_draft 32768, Markov rank 256).
SHAPES = {
    "fc": (8192, 24576), "qkv_proj": (9216, 8192), "o_proj": (8192, 4096), "gate_up": (32768, 8192),
    "down": (8192, 16384), "lm_head": (32768, 8192), "markov_bias": (32768, 256),
}
# Their shards at TP2 / 4 / 8: column-parallel ones split N, row-parallel ones K.
ROW_PARALLEL = ("fc", "o_proj", "down")
ROWS = (1, 2, 3, 4, 7, 8, 12, 16, 20, 24, 32, 40, 48, 56, 64)


def _weight(n: int, k: int, gen) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16)


def _run(x, weight, order):
    from dspark_cute.cutedsl.gemm.ordered import candidate_run

    return candidate_run(x, weight, order)


# The kernel designs (launch settings: the same sums): the default choice
# (``choose_settings``), the cp.async kernel and the streamed (TMA) one at
# every row count.
DESIGNS = ("default", "cp.async", "streamed")


def _settings(design: str, n: int):
    from dspark_cute.cutedsl.gemm.ordered import launch_settings
    from dspark_cute.cutedsl.gemm.streamed import streamed_settings

    if design == "cp.async":
        return lambda m, o: launch_settings(n, o.splits, m)
    if design == "streamed":
        return lambda m, o: streamed_settings(n, o.splits, m)
    return None


def _bound(role, weight, result, design="default"):
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemm

    gemm = OrderedGemm(ordered_gemm_constants(role, weight), weight, settings=_settings(design, weight.shape[0]))
    gemm.bind_orders(result.orders, result.refused)
    gemm.prepare()
    return gemm


@pytest.mark.parametrize("design", ["cp.async", "streamed"])
@pytest.mark.parametrize("role", list(SHAPES))
def test_orders_found_and_bitwise(role, design, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, k = SHAPES[role]
    weight = _weight(n, k, gen)
    result = gemm_check.check_projection(weight, ROWS, _run, seed)
    print(f"{role} [{n}, {k}]: {result.summary()}")
    assert not result.refused, result.refused
    gemm = _bound(role, weight, result, design)
    for m in ROWS:
        for name, x in gemm_check.probes(m, k, "cuda", seed + 7 * m):
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            for which in (0, 1):
                poison(out, which)
                gemm.run(x, out)
                assert_bitwise(out, F.linear(x, weight), f"{role} m={m} {name} poison {which}")


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("role", ["fc", "qkv_proj", "o_proj", "gate_up", "down", "lm_head"])
def test_tp_shards(role, tp, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, k = SHAPES[role]
    n, k = (n, k // tp) if role in ROW_PARALLEL else (n // tp, k)
    weight = _weight(n, k, gen)
    result = gemm_check.check_projection(weight, (1, 4, 16, 64), _run, seed)
    print(f"TP{tp} {role} [{n}, {k}]: {result.summary()}")
    assert not result.refused, result.refused


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_graph_replays_with_pdl(m, design, seed):
    """A chain x -> qkv -> o_proj-like GEMM -> (an elementwise op) -> qkv
    captured with PDL launches (the second GEMM reads the first's output
    behind its PDL wait; the streamed kernel may release its dependents at
    its start): every replay gives cuBLAS's bits."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, w2 = _weight(2048, 4096, gen), _weight(4096, 2048, gen)
    r1 = gemm_check.check_projection(w1, (m,), _run, seed)
    r2 = gemm_check.check_projection(w2, (m,), _run, seed)
    g1, g2 = _bound("qkv_proj", w1, r1, design), _bound("o_proj", w2, r2, design)
    x = gemm_check.probes(m, 4096, "cuda", seed)[0][1]
    h = torch.empty(m, 2048, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(m, 4096, dtype=torch.bfloat16, device="cuda")
    z = torch.empty(m, 2048, dtype=torch.bfloat16, device="cuda")

    def step():
        g1.launch(x, h)
        g2.launch(h, y)
        y.mul_(2)
        g1.launch(y, z)

    graph = capture_calls(step)
    for _ in range(3):
        poison(y, 0)
        fresh = int(torch.randint(0, 2**30, (1,), generator=gen, device="cuda"))
        x.copy_(gemm_check.probes(m, 4096, "cuda", fresh)[0][1])
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(z, F.linear(F.linear(F.linear(x, w1), w2) * 2, w1), f"replayed chain m={m} {design}")


@pytest.mark.parametrize("design", ["cp.async", "streamed"])
def test_split_reduce_counters_reset(design, seed):
    """Launches of many splits back to back (the counters reset by each
    launch's last CTA or warp) give the same bits every time, on every row
    count, equal across the two kernels."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = _weight(512, 8192, gen)
    from dspark_cute.cutedsl.gemm.ordered import OrderedWorkspace, ordered_gemm

    ws = OrderedWorkspace(512, 64, 16, "cuda")
    order = SplitOrder(128, 7)
    for m in (1, 9, 64):
        x = gemm_check.probes(m, 8192, "cuda", seed + m)[1][1]
        settings = _settings(design, 512)(m, order)
        first = ordered_gemm(x, weight, order, workspace=ws, settings=settings)
        assert_bitwise(first, _run(x, weight, order), f"{design} against the check's kernel m={m}")
        for _ in range(5):
            again = ordered_gemm(x, weight, order, workspace=ws, settings=settings)
            assert_bitwise(again, first, f"split-K relaunch m={m}")
    assert int(ws.counters.abs().sum()) == 0


def test_refused_rows_say_why(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = _weight(256, 1024, gen)
    gemm = _bound("o_proj", weight, gemm_check.check_projection(weight, (1, 2), _run, seed))
    x = torch.zeros(3, 1024, dtype=torch.bfloat16, device="cuda")
    assert "no order for m = 3" in gemm.problem(x)
    with pytest.raises(ValueError, match="no order for m = 3"):
        gemm.run(x)
    assert "takes x of bf16" in gemm.problem(x.float())


def _probes(m: int, k: int, gen) -> list[torch.Tensor]:
    """Spread magnitudes, -0.0 and subnormals, and an infinity and a NaN."""
    spread = torch.randn(m, k, generator=gen, device="cuda") * torch.exp2(
        torch.randint(-20, 21, (m, k), generator=gen, device="cuda").float())
    special = torch.randn(m, k, generator=gen, device="cuda")
    special.view(-1)[::7] = -0.0
    special.view(-1)[3::11] = 2.0**-130
    nonfinite = torch.randn(m, k, generator=gen, device="cuda")
    nonfinite.view(-1)[5] = float("inf")
    nonfinite.view(-1)[k + 3 if m > 1 else 9] = float("nan")
    return [t.to(torch.bfloat16) for t in (spread, special, nonfinite)]


@pytest.mark.parametrize("role", ["o_proj", "markov_bias", "gate_up"])
def test_decide_times_on_this_gpu_and_keeps_the_bits(role, seed, tmp_path):
    """The build's decision on this GPU (``OrderedGemm.decide``): every row
    count the check bound is timed against cuBLAS and kept only where one of
    the kernels won; the kept row counts give cuBLAS's bits (spread
    magnitudes, -0.0, subnormals, inf and NaN, poisoned outputs), the others
    refuse with the times; a second build reads the cache and times nothing,
    within a second."""
    import time

    from dspark_core.runtime.gemm_decide import DecisionCache
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemm

    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, k = SHAPES[role]
    weight = _weight(n, k, gen)
    rows = (1, 3, 4, 16, 33, 64)
    result = gemm_check.check_projection(weight, rows, _run, seed)
    gemm = OrderedGemm(ordered_gemm_constants(role, weight), weight)
    gemm.bind_orders(result.orders, result.refused)
    cache = DecisionCache(tmp_path)
    t0 = time.perf_counter()
    decision = gemm.decide(cache=cache)
    cold = time.perf_counter() - t0
    print(f"{decision.summary()} (cold {cold:.1f} s)")
    assert set(decision.rows) == set(result.orders) and not decision.cached
    for m in rows:
        for x in _probes(m, k, gen):
            if m in decision.dspark_rows:
                y = poison(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), 1)
                gemm.run(x, y)
                assert_bitwise(y, F.linear(x, weight), f"{role} m={m} ({decision.rows[m].kernel})")
            else:
                assert not gemm.takes(x) and gemm.problem(x) == gemm.reasons[m]
        if m in decision.rows and m not in decision.dspark_rows:
            assert "cuBLAS kept at m =" in gemm.reasons[m] and "µs for cuBLAS against" in gemm.reasons[m]
    again = OrderedGemm(ordered_gemm_constants(role, weight), weight)
    again.bind_orders(result.orders, result.refused)
    t0 = time.perf_counter()
    warm = again.decide(cache=cache)
    assert time.perf_counter() - t0 < 1.0 and warm.cached == frozenset(result.orders)
    assert warm.dspark_rows == decision.dspark_rows
