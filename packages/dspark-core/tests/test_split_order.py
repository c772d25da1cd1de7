"""The split-order model (``dspark_core.spec.split_order``) and the build-time
check's search (``dspark_core.runtime.gemm_check``) on the CPU: the bounds,
the candidates, the model on values where its stand-in MMA is exact, and the
check's decisions against stand-ins for cuBLAS whose order is known (a
coarse accumulator, so every order gives other bits), unknown (none of the
candidates), or per output tile (a slice agrees, the whole weight does not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_core.runtime import gemm_check
from dspark_core.spec.split_order import SplitOrder, candidate_orders, model_sum
from dspark_core.tools.compare import bits


def fp32_mma(acc, xs, ws):
    """A stand-in MMA whose roundings show in BF16 outputs even on a few
    outputs: the step's exact sum added to the accumulator, rounded to BF16
    (a coarse accumulator, so every split order gives other bits)."""
    return (acc.double() + xs.double() @ ws.double().t()).to(torch.bfloat16).float()


def stand_in(order):
    return lambda x, w: model_sum(x, w, order, fp32_mma)


def test_bounds_deal_tiles_in_order_the_first_splits_longer():
    assert SplitOrder(64, 1).bounds(256) == ((0, 256),)
    assert SplitOrder(64, 3).bounds(512) == ((0, 192), (192, 384), (384, 512))
    assert SplitOrder(128, 5).bounds(8192) == ((0, 1664), (1664, 3328), (3328, 4992), (4992, 6656), (6656, 8192))
    for k in (256, 1024, 3072, 8192, 24576):
        for order in candidate_orders(k):
            b = order.bounds(k)
            assert b[0][0] == 0 and b[-1][1] == k and all(x[1] == y[0] for x, y in zip(b, b[1:]))
            sizes = [stop - start for start, stop in b]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= order.tile
            assert all(s % order.tile == 0 for s in sizes)


def test_problems_and_refusals():
    assert "multiple of the 64-column tile" in SplitOrder(64, 1).problem(100)
    assert "fewer than 5 splits" in SplitOrder(256, 5).problem(1024)
    assert "positive int" in SplitOrder(64, 1).problem(True)
    with pytest.raises(ValueError, match="fewer than"):
        SplitOrder(256, 5).bounds(1024)
    for bad in (0, -64):
        with pytest.raises(ValueError, match="tile must be an int that is positive"):
            SplitOrder(bad, 1)
    for bad in (1.5, True, "64", None):
        with pytest.raises(TypeError, match="tile must be an int"):
            SplitOrder(bad, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        SplitOrder(24, 1)
    with pytest.raises(ValueError, match=r"K \(k\) must be an int from 1 to"):
        candidate_orders(0)
    # numpy integers are ints, kept as Python ints
    order = SplitOrder(np.int64(64), np.int32(2))
    assert order == SplitOrder(64, 2) and type(order.tile) is int and type(order.splits) is int
    assert order.problem(np.int64(8192)) is None
    assert candidate_orders(np.int64(1024), max_splits=np.int16(4)) == candidate_orders(1024, max_splits=4)
    # bounded: no search of 2^62 splits or columns
    with pytest.raises(ValueError, match="max_splits"):
        candidate_orders(1024, max_splits=2**62)
    with pytest.raises(ValueError, match=r"K \(k\)"):
        candidate_orders(2**62)


def test_candidates_are_distinct_and_lead_with_the_hint():
    k = 8192
    orders = candidate_orders(k)
    assert orders[0] == SplitOrder(64, 1)
    assert len({o.bounds(k) for o in orders}) == len(orders)
    # Equal bounds keep the smallest tile: 2 splits of 64 = 2 splits of 128.
    assert SplitOrder(64, 2) in orders and SplitOrder(128, 2) not in orders
    assert candidate_orders(k, first=SplitOrder(128, 5))[0] == SplitOrder(128, 5)
    assert candidate_orders(k, first=SplitOrder(128, 2))[0] == SplitOrder(64, 2)  # the same bounds
    assert candidate_orders(k, first=SplitOrder(256, 64)) == orders  # not applicable: no hint
    assert max(o.splits for o in orders) == 64


def test_the_model_on_small_integers_is_the_product(gen):
    x = torch.randint(-8, 9, (5, 512), generator=gen).to(torch.bfloat16)
    w = torch.randint(-8, 9, (48, 512), generator=gen).to(torch.bfloat16)
    want = (x.double() @ w.double().t()).to(torch.bfloat16)
    for order in (SplitOrder(64, 1), SplitOrder(64, 3), SplitOrder(128, 4)):
        assert torch.equal(bits(model_sum(x, w, order)), bits(want))


def test_the_check_finds_the_stand_ins_order(gen):
    k = 1024
    w = (torch.randn(32, k, generator=gen) / 32).to(torch.bfloat16)
    for truth in (SplitOrder(64, 1), SplitOrder(64, 3), SplitOrder(128, 3), SplitOrder(64, 7)):
        ref = stand_in(truth)
        found = gemm_check.find_order(lambda x, ref=ref: ref(x, w), lambda x, o: model_sum(x, w, o, fp32_mma), k,
                                      gemm_check.probes(2, k, "cpu", 7))
        assert found.order is not None and found.order.bounds(k) == truth.bounds(k), (truth, found)
        assert found.reason is None and found.tried >= 1


def test_a_reference_no_order_reproduces_is_refused_with_the_reason(gen):
    k = 512
    w = (torch.randn(16, k, generator=gen) / 16).to(torch.bfloat16)
    exact = lambda x: (x.double() @ w.double().t()).to(torch.bfloat16)  # noqa: E731 (no FP32 partials at all)
    found = gemm_check.find_order(exact, lambda x, o: model_sum(x, w, o, fp32_mma), k,
                                  gemm_check.probes(3, k, "cpu", 1), max_splits=4)
    assert found.order is None and found.tried == len(candidate_orders(k, max_splits=4))
    assert "gives cuBLAS's bits at m = 3" in found.reason


def test_confirm_rejections_keep_the_search_going(gen):
    k = 512
    w = (torch.randn(16, k, generator=gen) / 16).to(torch.bfloat16)
    truth = SplitOrder(64, 2)
    ref = stand_in(truth)
    seen = []

    def confirm(order):
        seen.append(order)
        return "rejected for the test"

    found = gemm_check.find_order(lambda x: ref(x, w), lambda x, o: model_sum(x, w, o, fp32_mma), k,
                                  gemm_check.probes(1, k, "cpu", 3), confirm=confirm, max_splits=4)
    assert found.order is None and seen and seen[0].bounds(k) == truth.bounds(k)
    assert "rejected for the test" in found.reason


def test_check_projection_refuses_an_order_that_holds_on_a_slice_only(gen):
    """A stand-in that sums its first 256 outputs in one order and the rest
    in another (as cuBLAS may per output tile on a shard): refused at every
    row count, the reason naming the whole weight."""
    k = 512
    w = (torch.randn(320, k, generator=gen) / 16).to(torch.bfloat16)
    a, b = SplitOrder(64, 2), SplitOrder(64, 4)

    def tiled(x, weight):
        return torch.cat([model_sum(x, weight[:256], a, fp32_mma), model_sum(x, weight[256:], b, fp32_mma)], 1)

    result = gemm_check.check_projection(w, (1, 2), lambda x, wt, o: model_sum(x, wt, o, fp32_mma), 5,
                                         reference=tiled, max_splits=4)
    assert not result.orders and set(result.refused) == {1, 2}
    assert "differ on the whole weight" in result.refused[1]
    uniform = gemm_check.check_projection(w, (1, 2, 3), lambda x, wt, o: model_sum(x, wt, o, fp32_mma), 5,
                                          reference=lambda x, wt: model_sum(x, wt, b, fp32_mma), max_splits=4)
    assert {m: o.bounds(k) for m, o in uniform.orders.items()} == {m: b.bounds(k) for m in (1, 2, 3)}
    assert uniform.summary() == "m = 1-3: 4 K-splits of 64-column tiles"


def test_probes_hold_the_special_values_and_replay():
    named = gemm_check.probes(4, 512, "cpu", 11)
    assert [n for n, _ in named] == ["normal", "spread", "special", "inf and nan"]
    assert all(x.dtype == torch.bfloat16 and x.shape == (4, 512) for _, x in named)
    special = named[2][1]
    assert bool((bits(special) == bits(torch.tensor(-0.0, dtype=torch.bfloat16))).any())
    sub = (special != 0) & (special.abs() < torch.finfo(torch.bfloat16).tiny)
    assert bool(sub.any())
    nonfinite = named[3][1]
    assert bool(torch.isinf(nonfinite).any()) and bool(torch.isnan(nonfinite).any())
    again = gemm_check.probes(4, 512, "cpu", 11)
    assert all(torch.equal(bits(x), bits(y)) for (_, x), (_, y) in zip(named, again))
    with pytest.raises(ValueError, match="rows"):
        gemm_check.probes(0, 512, "cpu", 1)
    with pytest.raises(ValueError, match="columns"):
        gemm_check.probes(1, True, "cpu", 1)


def test_the_summary_groups_row_ranges():
    r = gemm_check.CheckResult(256, 0)
    for m in (1, 2, 3):
        r.findings[m] = gemm_check.Finding(m, SplitOrder(64, 2), 1)
    r.findings[4] = gemm_check.Finding(4, None, 9, "none")
    r.findings[5] = gemm_check.Finding(5, SplitOrder(64, 1), 2)
    assert r.summary() == ("m = 1-3: 2 K-splits of 64-column tiles; m = 4: cuBLAS (no order found); "
                           "m = 5: one K-split (no split-K reduce)")
    assert set(r.orders) == {1, 2, 3, 5} and r.refused == {4: "none"}


def test_row_ranges():
    from dspark_core.errors import ranges, spans

    assert ranges([16, 1, 3, 2, 4, 8, 4]) == "1-4, 8, 16" and ranges([]) == ""
    # A run breaks at a gap and where the key changes.
    assert spans([1, 2, 3, 5, 6], lambda m: m < 3) == [(1, 2, True), (3, 3, False), (5, 6, False)]


def test_the_check_refuses_weights_seeds_and_settings_it_cannot_take():
    """``check_projection`` and ``probes``: a weight that is no non-empty
    2-D bf16 tensor, a seed that is no int from 0 to 2^63 - 1, a
    ``search_rows`` or ``min_compared`` below 1: a ValueError or TypeError
    naming it, before anything runs."""
    import torch

    from dspark_core.runtime import gemm_check

    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    run = lambda x, w_, o: None  # noqa: E731 (never reached)
    for weight in (torch.zeros(64, dtype=torch.bfloat16), torch.zeros(2, 16, 64, dtype=torch.bfloat16),
                   torch.zeros(16, 64), torch.zeros(0, 64, dtype=torch.bfloat16), None):
        with pytest.raises(ValueError, match="non-empty 2-D bfloat16 weight"):
            gemm_check.check_projection(weight, [1], run, 1)
    for seed, kind in ((None, TypeError), (1.5, TypeError), ("7", TypeError), (2**64, ValueError), (-1, ValueError)):
        with pytest.raises(kind, match="seed"):
            gemm_check.check_projection(w, [1], run, seed)
        with pytest.raises(kind, match="seed"):
            gemm_check.probes(1, 64, "cpu", seed)
    for name in ("search_rows", "min_compared"):
        for bad, kind in ((0, ValueError), (-1, ValueError), (float("nan"), TypeError)):
            with pytest.raises(kind, match=name):
                gemm_check.check_projection(w, [1], run, 1, **{name: bad})
