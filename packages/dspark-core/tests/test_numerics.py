"""CPU tests of ``dspark_core.spec.numerics`` and ``dspark_core.tools.compare``.

Every numeric function is checked BIT FOR BIT against the independent NumPy
implementation in ``_independent.py`` (float64 operations each rounded to
float32, the trees run as a 256-thread CTA / one warp would run them), against
float64 mathematics within bounds derived in the docstrings, and on special
values. ``u = 2**-24`` is the unit roundoff of FP32 throughout.

The CPU ``torch.sqrt`` of this project's torch builds is not correctly
rounded (found by these tests; the spec now corrects it in
``numerics.sqrt_rn``, which is tested exhaustively over two binades here).
"""

from __future__ import annotations

import math

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.spec import numerics as N
from dspark_core.tools.compare import assert_bitwise, bits, mismatches

WIDTHS = [2048, 4096, 6144, 8192]
KINDS = ["normal", "wide", "mixed"]
U = 2.0**-24
F32_MAX = float(np.finfo(np.float32).max)


def t32(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True))


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of k
    rounded additions of non-negative terms."""
    return k * U / (1 - k * U)


def all_f32_classes(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniformly random float32 bit patterns (every class: zeros, subnormals,
    normals, infinities, NaNs of both signs) plus the named specials."""
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-149, -(2.0**-149), 2.0**-126, F32_MAX, -F32_MAX, 1.0, -1.0],
        dtype=np.float32,
    )
    return np.concatenate([I.from_f32_bits(u), specials])


# ---------------------------------------------------------------------------
# The host.


def test_host_keeps_subnormals():
    """The independent implementation (and the spec) need a host that neither
    flushes subnormal results nor treats subnormal inputs as zero."""
    tiny = np.float32(2.0**-140)
    assert I._mul(tiny, np.float32(0.5)) == np.float32(2.0**-141)
    assert (t32([2.0**-140]) * 0.5).item() == 2.0**-141
    assert (t32([2.0**-149]) + t32([2.0**-149])).item() == 2.0**-148


def test_cta_geometry():
    assert (N.THREADS, N.VEC, N.WARP, N.WARPS, N.CHUNK) == (256, 8, 32, 8, 2048)
    assert (I.THREADS, I.VEC, I.WARP, I.CHUNK) == (256, 8, 32, 2048)


# ---------------------------------------------------------------------------
# Input validation.


@pytest.mark.parametrize("h", [0, -2048, 1000, 2049, 3072, 2048 + 8])
def test_row_width_rejected(h):
    with pytest.raises(ValueError, match=rf"positive multiple of 2048 columns, not {h}"):
        N.check_row_width(h)


@pytest.mark.parametrize("h", [1000, 3072])
def test_row_tree_rejects_width(h):
    with pytest.raises(ValueError, match="positive multiple of 2048"):
        N.row_sum(torch.zeros(2, h))
    with pytest.raises(ValueError, match="positive multiple of 2048"):
        N.thread_sums(torch.zeros(2, h))


@pytest.mark.parametrize("h", [2048, 4096, 16384])
def test_row_width_accepted(h):
    N.check_row_width(h)


@pytest.mark.parametrize("d", [0, 1, 3, 6, 48, 96, -2])
def test_head_width_rejected(d):
    with pytest.raises(ValueError, match=rf"a DSpark head norm takes heads of .*columns, not {d}$"):
        N.check_head_width(d)


@pytest.mark.parametrize("d", [2, 64, 128, 256])
def test_head_width_accepted(d):
    N.check_head_width(d)


def test_head_sum_rejects_width():
    with pytest.raises(ValueError, match="a DSpark head norm takes heads of"):
        N.head_sum(torch.zeros(3, 12))


@pytest.mark.parametrize("n", [3, 6, 12])
def test_fold_halves_rejects_non_power_of_two(n):
    with pytest.raises(ValueError, match=f"power-of-two width, not {n}"):
        N.fold_halves(torch.zeros(2, n))


# ---------------------------------------------------------------------------
# The row tree.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("h", WIDTHS)
def test_row_sum_matches_cta(h, kind, rng):
    m = int(rng.integers(1, 7))
    v = I.random_f32(rng, (m, h), kind)
    I.assert_same_bits(N.row_sum(t32(v)), I.cta_row_sum(v), f"row_sum H={h} {kind}")


@pytest.mark.parametrize("h", WIDTHS)
def test_thread_sums_and_reduce_threads_match_cta(h, rng):
    v = I.random_f32(rng, (5, h), "wide")
    ts = N.thread_sums(t32(v))
    I.assert_same_bits(ts, I.cta_thread_sums(v), "thread_sums")
    ref, lanes, _ = I.cta_row_sum(v, return_lanes=True)
    I.assert_same_bits(N.reduce_threads(ts), ref, "reduce_threads")


@pytest.mark.parametrize("h", WIDTHS + [16384])
def test_cluster_layout_is_the_same_tree(h, rng):
    """The numerics docstring: one fragment per hardware thread, emulated
    thread t reading fragments t, t+256, ... reproduces the tree exactly."""
    v = I.random_f32(rng, (4, h), "wide")
    I.assert_same_bits(N.row_sum(t32(v)), I.cluster_row_sum(v), "cluster layout")


def test_butterfly_leaves_the_sum_in_every_lane(rng):
    """The docstring's claim that the shfl.bfly butterfly leaves the fold's
    value in every lane (a + b == b + a bit for bit)."""
    v = I.random_f32(rng, (6, 8192), "wide")
    total, lanes, lanes8 = I.cta_row_sum(v, return_lanes=True)
    warp_lane0 = lanes[:, ::32]
    for w in range(8):
        lane0 = np.repeat(I.f32_bits(warp_lane0[:, w : w + 1]), 32, 1)
        assert np.array_equal(I.f32_bits(lanes[:, w * 32 : (w + 1) * 32]), lane0)
    assert np.array_equal(I.f32_bits(lanes8), np.repeat(I.f32_bits(total[:, None]), 8, 1))
    # and the warp butterflies are the documented fold by halves:
    ts = I.cta_thread_sums(v).reshape(6, 8, 32)
    fold = ts
    while fold.shape[-1] > 1:
        half = fold.shape[-1] // 2
        fold = I._add(fold[..., :half], fold[..., half:])
    assert np.array_equal(I.f32_bits(fold[..., 0]), I.f32_bits(warp_lane0))


def test_row_tree_has_teeth(rng):
    """The bitwise agreement means something: on wide-range data the row tree
    differs from other summation orders (sequential, NumPy's pairwise sum,
    one fold by halves over all H columns) in some rows."""
    m, h = 64, 4096
    v = I.random_f32(rng, (m, h), "wide")
    tree = N.row_sum(t32(v)).numpy()
    seq = v[:, 0].copy()
    for c in range(1, h):
        seq = I._add(seq, v[:, c])
    fold = v
    while fold.shape[-1] > 1:
        half = fold.shape[-1] // 2
        fold = I._add(fold[:, :half], fold[:, half:])
    for name, other in [("sequential", seq), ("numpy", v.sum(axis=1, dtype=np.float32)), ("fold", fold[:, 0])]:
        assert (I.f32_bits(other) != I.f32_bits(tree)).any(), name


def test_fragment_sum_and_fold_halves_orders(rng):
    v = I.random_f32(rng, (50, 8), "wide")
    r = [v[:, j] for j in range(8)]
    expect = I._add(I._add(I._add(r[0], r[1]), I._add(r[2], r[3])), I._add(I._add(r[4], r[5]), I._add(r[6], r[7])))
    I.assert_same_bits(N.fragment_sum(t32(v)), expect, "fragment_sum")
    w = I.random_f32(rng, (50, 16), "wide")
    a = w
    while a.shape[1] > 1:
        a = I._add(a[:, : a.shape[1] // 2], a[:, a.shape[1] // 2 :])
    I.assert_same_bits(N.fold_halves(t32(w)), a[:, 0], "fold_halves")
    I.assert_same_bits(N.fold_halves(t32(w[:, :1])), w[:, 0], "fold_halves of one")


def test_row_sum_special_values(rng):
    h = 4096
    rows = np.abs(I.random_f32(rng, (8, h), "normal"))
    rows[0, 5] = np.inf  # +inf
    rows[1, 7] = -np.inf  # -inf
    rows[2, 3], rows[2, 4000] = np.inf, -np.inf  # inf - inf: NaN
    rows[3, 100] = np.nan
    rows[4] = -0.0  # all -0.0: -0 + -0 = -0
    rows[5] = 0.0
    rows[5, 17] = -0.0  # +0 + -0 = +0
    rows[6] = 2.0**-149  # subnormals add exactly: 4096 * 2**-149 = 2**-137
    rows[7] = F32_MAX  # overflows to +inf
    s = N.row_sum(t32(rows))
    I.assert_same_bits(s, I.cta_row_sum(rows), "row_sum specials")
    got = s.numpy()
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2]) and np.isnan(got[3])
    assert I.f32_bits(got[4]) == 0x80000000 and I.f32_bits(got[5]) == 0
    assert got[6] == np.float32(2.0**-137) and got[7] == np.inf


@pytest.mark.parametrize("h", WIDTHS + [16384])
def test_row_sum_accuracy(h, rng):
    """For non-negative terms every partial sum is a rounded sum of
    non-negatives, and each term passes through d = 3 (fragment) + (K - 1)
    (thread, K = H / 2048) + 5 (warp) + 3 (CTA) = K + 10 additions, so
    ``|s - sum| <= gamma_(K+10) * sum`` (Higham, Thm 4.3 on the tree)."""
    k = h // 2048
    v = np.abs(I.random_f32(rng, (16, h), "wide"))
    s = N.row_sum(t32(v)).numpy().astype(np.float64)
    exact = np.array([math.fsum(row) for row in v.astype(np.float64)])
    assert np.all(np.abs(s - exact) <= gamma(k + 10) * exact)


# ---------------------------------------------------------------------------
# The head tree.


@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 64, 128, 256])
def test_head_sum_matches_warp(d, rng):
    v = I.random_f32(rng, (5, 7, d), "mixed")
    I.assert_same_bits(N.head_sum(t32(v)), I.warp_head_sum(v), f"head_sum D={d}")


def test_head_sum_order_is_pairs_then_halves():
    """D = 8, values chosen so each order gives different bits: the pairs
    (v0+v1), (v2+v3), ..., then (p0+p2), (p1+p3), then the last add."""
    v = np.array([1.0, 2.0**-24, 2.0**-24, 0.0, 2.0**-24, 0.0, 0.0, 0.0], dtype=np.float32)
    # pairs: 1 (1 + 2**-24 ties to even), 2**-24, 2**-24, 0; halves: 1 + 2**-24 -> 1, 2**-24; then 1 + 2**-24 -> 1
    assert N.head_sum(t32(v)).item() == 1.0
    assert I.warp_head_sum(v) == np.float32(1.0)
    # sequential order would give 1 + 2**-24 + 2**-24 = 1 (ties) as well; a different order
    # ((v1 + v2) + v4) + v0 = 1 + 2**-23 shows the value depends on the order:
    assert I._add(I._add(I._add(v[1], v[2]), v[4]), v[0]) != np.float32(1.0)


@pytest.mark.parametrize("d", [2, 8, 64])
def test_head_sum_accuracy(d, rng):
    """Non-negative terms, log2(D) additions on every path: gamma_log2(D)."""
    v = np.abs(I.random_f32(rng, (200, d), "wide"))
    s = N.head_sum(t32(v)).numpy().astype(np.float64)
    exact = np.array([math.fsum(r) for r in v.astype(np.float64)])
    assert np.all(np.abs(s - exact) <= gamma(int(math.log2(d))) * exact)


# ---------------------------------------------------------------------------
# inv_rms.

INV_RMS_CASES = [(2048, 1e-6), (6144, 1e-5), (16384, 0.0), (64, 1e-6), (2, 3e-7)]


def test_sqrt_rn_is_ieee_exhaustively_on_two_binades():
    """Every float32 in [1, 4) (all 2**23 significands with both exponent
    parities, which is all a square root sees): ``sqrt_rn`` equals the float64
    square root rounded once (correct rounding). The CPU ``torch.sqrt`` it
    corrects is wrong on millions of these (printed, not asserted)."""
    wrong = 0
    for lo in (1.0, 2.0):
        u0 = int(np.float32(lo).view(np.uint32))
        x = I.from_f32_bits(np.arange(u0, u0 + 2**23, dtype=np.uint32))
        I.assert_same_bits(N.sqrt_rn(t32(x)), I.sqrt_rn(x), f"sqrt_rn on [{lo}, {2 * lo})")
        wrong += int((I.f32_bits(I.torch_sqrt(x)) != I.f32_bits(I.sqrt_rn(x))).sum())
    print(f"torch.sqrt misrounds {wrong} of 2**24 float32 in [1, 4); sqrt_rn none")


def test_sqrt_rn_special_and_random_values(rng):
    """Every class: random bit patterns (negatives give NaN), wide random
    values, subnormals (whose roots are normal), zeros of both signs (sqrt(-0)
    = -0), inf, FLT_MAX (the upper neighbour of its root is finite), powers
    of two, perfect squares, and 54543.043 (0x47550f0b), which torch.sqrt
    rounds to 0x43698b65 instead of 0x43698b66."""
    sub = I.from_f32_bits(rng.integers(1, 2**23, 200000, dtype=np.uint64).astype(np.uint32))
    x = np.concatenate([
        all_f32_classes(rng, 200000), np.abs(I.random_f32(rng, 200000, "wide")), sub,
        np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, F32_MAX, 54543.043, 1.5625 / 2048 + 1e-6]),
        np.exp2(np.arange(-149, 128)).astype(np.float32), (np.arange(1, 4097, dtype=np.float32) ** 2),
    ]).astype(np.float32)
    got = N.sqrt_rn(t32(x))
    I.assert_same_bits(got, I.sqrt_rn(x), "sqrt_rn")
    g = got.numpy()
    assert I.f32_bits(N.sqrt_rn(t32([-0.0])).numpy())[0] == 0x80000000  # sqrt(-0.0) = -0.0
    assert np.array_equal(g[-4096:], np.arange(1, 4097, dtype=np.float32))
    assert I.f32_bits(N.sqrt_rn(t32([54543.043])).numpy())[0] == 0x43698B66


@pytest.mark.parametrize("n,eps", INV_RMS_CASES)
def test_inv_rms_matches_independent(n, eps, rng):
    """Bitwise: the division by n (a division, not a product with 1/n), the
    addition of eps rounded to FP32, the IEEE square root, the reciprocal."""
    total = np.abs(I.random_f32(rng, 20000, "wide")) * np.float32(n)
    total = np.concatenate([total, [0.0, 2.0**-149, 2.0**-130, 1e30, F32_MAX, 1.5625]]).astype(np.float32)
    I.assert_same_bits(N.inv_rms(t32(total), n, eps), I.inv_rms(total, n, eps), f"inv_rms n={n}")


def test_inv_rms_regression_torch_sqrt():
    """The case that exposed the CPU torch.sqrt: total = 1.5625 (a one-hot
    row of 1.25), n = 2048, eps = 1e-6 gave 0x4210b87c; IEEE is 0x4210b87d."""
    assert I.f32_bits(N.inv_rms(t32([1.5625]), 2048, 1e-6).numpy())[0] == 0x4210B87D
    assert I.f32_bits(I.inv_rms(np.float32([1.5625]), 2048, 1e-6))[0] == 0x4210B87D


def test_inv_rms_divides_by_n(rng):
    """``total / n`` is an IEEE division: pick totals where the division and
    the product with the rounded 1/6144 differ, and check the spec divides."""
    n = 6144
    total = np.abs(I.random_f32(rng, 50000, "normal")) * np.float32(n)
    div = I._div(total, np.float32(n))
    mul = I._mul(total, I._div(np.float32(1.0), np.float32(n)))
    pick = I.f32_bits(div) != I.f32_bits(mul)
    assert pick.sum() > 100
    eps = 0.0
    r = N.inv_rms(t32(total[pick]), n, eps)
    I.assert_same_bits(r, I._div(np.float32(1.0), I.sqrt_rn(div[pick])), "division")


def test_inv_rms_special_values():
    inf, nan = float("inf"), float("nan")
    assert N.inv_rms(t32([0.0]), 2048, 0.0).item() == inf  # 1 / sqrt(0)
    assert N.inv_rms(t32([inf]), 2048, 1e-6).item() == 0.0  # 1 / inf = +0
    assert I.f32_bits(N.inv_rms(t32([inf]), 2048, 1e-6).numpy()) == 0
    assert math.isnan(N.inv_rms(t32([nan]), 2048, 1e-6).item())
    # eps = 1e-6 is rounded to FP32 once: a zero total gives 1 / sqrt(f32(1e-6))
    expect = I._div(np.float32(1), I.sqrt_rn(np.float32([1e-6])))
    I.assert_same_bits(N.inv_rms(t32([0.0]), 2048, 1e-6), expect, "eps")
    # a subnormal variance is not flushed: 2**-130 / 2048 = 2**-141 (subnormal, exact), eps = 0
    r = N.inv_rms(t32([2.0**-130]), 2048, 0.0)
    assert np.isfinite(r.item()) and r.item() > 2.0**70
    I.assert_same_bits(r, I.inv_rms(np.float32([2.0**-130]), 2048, 0.0), "subnormal variance")
    # exact case: total 2**-140, n = 1: sqrt(2**-140) = 2**-70, r = 2**70 exactly
    assert N.inv_rms(t32([2.0**-140]), 1, 0.0).item() == 2.0**70


@pytest.mark.parametrize("n,eps", INV_RMS_CASES)
def test_inv_rms_accuracy(n, eps, rng):
    """Against ``1 / sqrt(total / n + f32(eps))`` in float64 on the same FP32
    total: division (u) and addition of non-negatives (u) give 2u; the IEEE
    square root halves it and adds u; the reciprocal adds u: ``3u`` to first
    order (``1.001`` covers the second-order terms)."""
    total = np.abs(I.random_f32(rng, 50000, "wide")) * np.float32(n)
    r = N.inv_rms(t32(total), n, eps).numpy().astype(np.float64)
    ref = 1.0 / np.sqrt(total.astype(np.float64) / n + float(np.float32(eps)))
    rel = np.abs(r - ref) / ref
    assert rel.max() <= 3 * U * 1.001, rel.max() / U


# ---------------------------------------------------------------------------
# round_to.


def test_round_to_bf16_is_rne_on_the_bits(rng):
    x = all_f32_classes(rng, 200000)
    ties = I.from_f32_bits(
        np.array(
            [0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000, 0x3F807FFF, 0x00008000, 0x00018000, 0x80018000,
             0x7F7F8000, 0x7F7FFFFF, 0x7F7F7FFF, 0x0000FFFF, 0x007FFFFF],
            dtype=np.uint32,
        )
    )
    x = np.concatenate([x, ties]).astype(np.float32)
    got = N.round_to(t32(x), torch.bfloat16)
    I.assert_same_bits(got, I.round_bf16(x), "round_to bf16")
    expect_bits = {0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0xBF808000: 0xBF80, 0x3F80C000: 0x3F81, 0x3F807FFF: 0x3F80,
                   0x00008000: 0x0000, 0x00018000: 0x0002, 0x80018000: 0x8002, 0x7F7F8000: 0x7F80, 0x7F7FFFFF: 0x7F80,
                   0x7F7F7FFF: 0x7F7F, 0x0000FFFF: 0x0001, 0x007FFFFF: 0x0080}
    for src, dst in expect_bits.items():
        val = I.from_f32_bits(np.array([src], dtype=np.uint32))
        assert I.torch_bits(t32(val).to(torch.bfloat16))[0] == dst, hex(src)


def test_round_to_fp16_matches_numpy(rng):
    x = all_f32_classes(rng, 200000)
    x = np.concatenate([x, np.float32([65504.0, 65520.0, 65519.996, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26])])
    got = N.round_to(t32(x), torch.float16)
    I.assert_same_bits(got, I.round_fp16(x), "round_to fp16")
    assert got[-7:].tolist()[:3] == [65504.0, float("inf"), 65504.0]
    assert got[-4:].tolist() == [2.0**-24, 0.0, 2.0**-24, 0.0]  # ties to even at the subnormal bottom


# ---------------------------------------------------------------------------
# exp_rn, sigmoid_rn, silu_rn.


def exp_grid(rng) -> np.ndarray:
    dense = np.linspace(-110.0, 95.0, 400001, dtype=np.float64).astype(np.float32)
    edges = (88.72283935546875, -104.0, -103.972, -87.3365)
    near = np.concatenate([np.arange(-5, 6) * np.float32(2.0**-17) + np.float32(v) for v in edges])
    return np.concatenate([dense, near.astype(np.float32), all_f32_classes(rng, 100000)]).astype(np.float32)


def test_exp_constants_are_the_documented_ones():
    assert I.f32_bits(np.float32(N._f32(N._LN2_HI))) == 0x3F317200
    assert I.f32_bits(np.float32(N._f32(N._LN2_LO))) == 0x35BFBE8E
    assert N._f32(N._LOG2E) == float(np.float32(math.log2(math.e))) == float(I.LOG2E)
    assert (0x3F317200 & 0x1FF) == 0  # 15 fraction bits + 1: n * LN2_HI exact for |n| < 2**8
    assert abs(float(I.LN2_HI) + float(I.LN2_LO) - math.log(2)) < 2.0**-44
    assert [N._f32(c) for c in N._EXP_COEFFS] == [float(c) for c in I.EXP_COEFFS]
    # EXP_OVERFLOW is the smallest float32 whose exact exp rounds to +inf (> 2**128 - 2**103):
    limit = 2.0**128 - 2.0**103
    below = float(np.nextafter(np.float32(N.EXP_OVERFLOW), np.float32(0)))
    assert math.exp(N.EXP_OVERFLOW) > limit > math.exp(below)
    # below EXP_UNDERFLOW the exact exp is under half the smallest subnormal (2**-150): +0.0
    assert math.exp(N.EXP_UNDERFLOW) < 2.0**-150


def test_exp_rn_matches_independent(rng):
    x = exp_grid(rng)
    I.assert_same_bits(N.exp_rn(t32(x)), I.exp(x), "exp_rn")


def test_exp_rn_rounds_half_to_even():
    """``n = rint(x * LOG2E)`` rounds half to even: the 289 float32 x whose
    rounded product is an exact half-integer (found by search near
    (k + 1/2) / LOG2E); rounding those halves away from zero instead would
    change 132 of the results."""
    xs = []
    for k in range(-151, 129):
        c = np.float32((k + 0.5) / float(I.LOG2E))
        cand = I.from_f32_bits((c.view(np.uint32).astype(np.int64) + np.arange(-64, 65)).astype(np.uint32))
        xs.append(cand[I._mul(cand, I.LOG2E) == np.float32(k + 0.5)])
    x = np.concatenate(xs)
    assert len(x) > 200
    I.assert_same_bits(N.exp_rn(t32(x)), I.exp(x), "exp_rn at exact halves")


def test_exp_rn_accuracy(rng):
    """``|exp_rn(x) - e**x| <= 4 ulp(e**x)`` for x in [EXP_UNDERFLOW,
    EXP_OVERFLOW] (ulp of FP32 at the true value, 2**-149 in the subnormal
    range). Derivation: ``n * LN2_HI`` and ``x - n * LN2_HI`` are exact, the
    rounding of ``r`` costs <= 2**-26 absolute (|r| < 0.35), i.e. <= 0.3 ulp
    of ``e**r``; LN2_HI + LN2_LO misses ln 2 by < 2**-44 (times |n| <= 150);
    the degree-6 Taylor remainder is ``|r|**7 / 7! <= 1.2e-7``, which is 2.0
    ulp of ``e**r`` in [0.707, 1) and 1.4 ulp in [1, 1.415); the Horner
    roundings add <= 1.3 ulp (dominated by the last two steps); the scaling by
    ``2**n1`` is exact and by ``2**n2`` rounds once (subnormal results: <= 0.5
    subnormal ulp more). Total < 3.7 ulp; the docstring says 'about 2 ulp'
    (the largest error seen is about 2.95 ulp, at x = -78.672)."""
    top = float(np.nextafter(np.float32(N.EXP_OVERFLOW), np.float32(0)))  # EXP_OVERFLOW itself overflows
    x = np.concatenate([np.linspace(-104.0, top, 1_000_001).astype(np.float32),
                        rng.uniform(-104.0, 88.72, 200000).astype(np.float32)])
    y = N.exp_rn(t32(x)).numpy().astype(np.float64)
    ref = np.exp(x.astype(np.float64))
    err = np.abs(y - ref) / I.ulp_f32(ref)
    assert err.max() <= 4.0, (err.max(), x[err.argmax()])


def test_exp_rn_special_values():
    inf, nan = float("inf"), float("nan")
    x = t32([inf, -inf, nan, 0.0, -0.0, 2.0**-149, -(2.0**-149), 1.0, -104.0, -104.5, -1000.0, 1000.0,
             N.EXP_OVERFLOW, float(np.nextafter(np.float32(N.EXP_OVERFLOW), np.float32(0))), -100.0])
    y = N.exp_rn(x)
    got = y.tolist()
    assert got[0] == inf
    assert got[1] == 0.0 and I.f32_bits(y.numpy()[1]) == 0  # +0.0
    assert math.isnan(got[2])
    assert got[3] == 1.0 and got[4] == 1.0 and got[5] == 1.0 and got[6] == 1.0
    assert got[7] == float(np.float32(math.e))
    assert I.f32_bits(y.numpy()[8:11]).tolist() == [0, 0, 0]  # +0.0 at and below the underflow limit
    assert got[11] == inf and got[12] == inf
    assert 3.4e38 < got[13] <= F32_MAX
    # exp(-100) = 26.55 * 2**-149: the subnormal 27 * 2**-149, not flushed
    assert I.f32_bits(y.numpy()[14]) == 27
    I.assert_same_bits(y, I.exp(x.numpy()), "exp_rn specials")


def test_exp_rn_widens_narrow_inputs(rng):
    x = I.random_in(rng, 5000, "bf16", "wide")
    xb = I.to_torch(x, "bf16")
    I.assert_same_bits(N.exp_rn(xb), I.exp(x), "exp_rn of bf16")
    xh = I.random_in(rng, 5000, "fp16", "normal") * np.float32(8)
    I.assert_same_bits(N.exp_rn(I.to_torch(xh, "fp16")), I.exp(xh), "exp_rn of fp16")


def test_sigmoid_and_silu_match_independent(rng):
    x = exp_grid(rng)
    I.assert_same_bits(N.sigmoid_rn(t32(x)), I.sigmoid(x), "sigmoid_rn")
    I.assert_same_bits(N.silu_rn(t32(x)), I.silu(x), "silu_rn")
    xb = I.random_in(rng, 5000, "bf16", "wide")
    I.assert_same_bits(N.silu_rn(I.to_torch(xb, "bf16")), I.silu(xb), "silu_rn of bf16")


def _edge() -> np.ndarray:
    """FP32 ``-EXP_OVERFLOW`` (where ``exp_rn(-x)`` first overflows: a
    uniform draw lands on it about once in a hundred runs) and its neighbour
    above, as float32."""
    edge = np.float32(-N.EXP_OVERFLOW)
    return np.array([edge, np.nextafter(edge, np.float32(0))], dtype=np.float32)


def test_sigmoid_rn_accuracy(rng):
    """``e = exp_rn(-x)`` is within 4 ulp <= 8u relative; ``1 + e`` rounds
    (u) and carries e's error scaled by ``e / (1 + e) <= 1``: <= 9u; the
    division adds u: ``|sigmoid_rn(x) - s| <= 10u * s + 2**-150`` (the last
    term: half a subnormal ulp) for ``x > -EXP_OVERFLOW``. At and below
    it, ``exp_rn(-x) = inf`` (EXP_OVERFLOW itself overflows) and
    ``sigmoid_rn(x) = +0`` while ``s < e**x < 2**-128``: the spec flushes the
    subnormal sigmoid of x <= -88.72 to zero. The boundary and its neighbour
    are always among the inputs."""
    x = np.concatenate([np.linspace(-120.0, 120.0, 600001), rng.uniform(-100, 30, 200000), _edge()]).astype(np.float32)
    y = N.sigmoid_rn(t32(x)).numpy().astype(np.float64)
    xd = x.astype(np.float64)
    s = 1.0 / (1.0 + np.exp(-xd))
    ok_range = xd > -N.EXP_OVERFLOW
    assert np.all(np.abs(y - s)[ok_range] <= 10 * U * s[ok_range] + 2.0**-150)
    assert np.all(y[~ok_range] == 0.0) and np.all(s[~ok_range] < 2.0**-128)


def test_silu_rn_accuracy(rng):
    """``silu_rn(x) = RN(x * sigmoid_rn(x))``: ``<= 11u * |x s| + |x| 2**-149``
    for ``x > -EXP_OVERFLOW`` (the second term: below about -87 the sigmoid
    is an FP32 subnormal, exact only to its quantum 2**-149, which x scales);
    at and below it, ``-0.0`` against a true value of
    magnitude ``|x| e**x <= 88.73 * 2**-128 < 2**-121``."""
    x = np.concatenate([np.linspace(-120.0, 120.0, 600001), rng.uniform(-100, 30, 200000), _edge()]).astype(np.float32)
    y = N.silu_rn(t32(x)).numpy().astype(np.float64)
    xd = x.astype(np.float64)
    s = xd / (1.0 + np.exp(-xd))
    ok_range = xd > -N.EXP_OVERFLOW
    bound = 11 * U * np.abs(s) + np.abs(xd) * 2.0**-149
    assert np.all((np.abs(y - s) <= bound)[ok_range])
    assert np.all(I.f32_bits(y[~ok_range].astype(np.float32)) == 0x80000000)
    assert np.all(np.abs(s[~ok_range]) < 2.0**-121)


def test_sigmoid_silu_special_values():
    """The values the formulas imply, including two that are not the limits
    of the mathematical functions: ``silu_rn(-inf) = -inf * 0 = NaN`` (the
    limit is -0) and ``silu_rn(-100) = -0.0`` (the true value is the FP32
    subnormal -3.7e-42)."""
    inf, nan = float("inf"), float("nan")
    x = t32([inf, -inf, nan, 0.0, -0.0, -100.0, -88.0, 100.0, 2.0**-149, -(2.0**-149)])
    s = N.sigmoid_rn(x)
    si = N.silu_rn(x)
    sb, sib = I.f32_bits(s.numpy()), I.f32_bits(si.numpy())
    assert s[0].item() == 1.0 and sb[1] == 0 and math.isnan(s[2].item())
    assert s[3].item() == 0.5 and s[4].item() == 0.5
    assert sb[5] == 0  # flushed: 1 / (1 + inf)
    assert 0 < s[6].item() < 2.0**-126  # a subnormal sigmoid, kept
    assert s[7].item() == 1.0
    assert si[0].item() == inf and math.isnan(si[1].item()) and math.isnan(si[2].item())
    assert sib[3] == 0 and sib[4] == 0x80000000  # +-0 * 0.5 keeps the sign
    assert sib[5] == 0x80000000  # -100 * 0 = -0.0
    assert sib[8] == 0 and sib[9] == 0x80000000  # 2**-149 * 0.5 ties to even: +-0
    assert si[7].item() == 100.0
    I.assert_same_bits(s, I.sigmoid(x.numpy()), "sigmoid specials")
    I.assert_same_bits(si, I.silu(x.numpy()), "silu specials")


# ---------------------------------------------------------------------------
# compare.py


def test_assert_bitwise_nan_exception_only():
    a = torch.tensor([1.0, float("nan"), -0.0, 2.0**-149, float("inf")])
    b = a.clone()
    b.view(torch.int32)[1] = -1  # a different NaN payload and sign: 0xffffffff
    assert_bitwise(a, b)
    assert not mismatches(a, b).any()
    for i, other in [(2, 0.0), (3, 0.0), (4, -float("inf")), (0, float(np.nextafter(np.float32(1), np.float32(2))))]:
        c = a.clone()
        c[i] = other
        with pytest.raises(AssertionError, match="1 of 5 elements differ in bits"):
            assert_bitwise(c, a, "x")
    c = a.clone()
    c[0] = float("nan")  # NaN against a number differs
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(c, a)


def test_bits_views():
    assert bits(torch.tensor([-0.0])).item() == -(2**31)
    assert bits(torch.tensor([1.0], dtype=torch.bfloat16)).item() == 0x3F80
    assert bits(torch.tensor([1.0], dtype=torch.float16)).item() == 0x3C00
    assert bits(torch.tensor([1.0], dtype=torch.float64)).item() == 0x3FF0000000000000


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.bool, torch.float8_e4m3fn])
def test_bits_rejects_non_float(dtype):
    with pytest.raises(ValueError, match="bits takes a floating tensor of 16, 32 or 64 bits"):
        bits(torch.zeros(2, dtype=dtype))


def test_mismatches_rejects_dtype_and_shape():
    with pytest.raises(ValueError, match="bitwise comparison needs one dtype and shape"):
        mismatches(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bitwise comparison needs one dtype and shape"):
        mismatches(torch.zeros(2), torch.zeros(3))
