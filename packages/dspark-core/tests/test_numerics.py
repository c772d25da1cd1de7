"""CPU tests of ``dspark_core.spec.numerics`` and ``dspark_core.tools.compare``.

The spec's arithmetic is checked BIT FOR BIT against the independent NumPy
implementation (``_independent.py``: exact integer FMA, the CTA's register
file with its butterflies), against float64 mathematics within bounds derived
in the docstrings, and on special values:

- ``fma_rn``: exact, against the integer FMA on random bit patterns of every
  class, exact ties, double-rounding traps, subnormal results, overflow, signed
  zeros, NaN and infinities;
- the stock row norm's tree (``thread_sum_of_squares``, ``reduce_threads``,
  ``row_sum_of_squares``) on sm_90a and sm_100a, input-scaled or not;
- ``inv_rms``: ``fma(total, 1/n, eps)`` then ``rsqrt.approx.ftz``; on a CPU
  that instruction is a documented IEEE stand-in, so the tests pin it both
  ways: against the same stand-in computed by NumPy, and with a perturbed
  instruction injected into the spec and the independent implementation alike
  (its input recorded and compared bit for bit);
- every approximate instruction's CPU stand-in (IEEE; the square roots
  correctly rounded, exhaustively on [1, 4));
- ``exp_rn`` (the reference attention's exponential), ``round_to``,
  ``compare``.

``u = 2**-24`` is the unit roundoff of FP32 throughout.
"""

from __future__ import annotations

import math

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.spec import numerics as N
from dspark_core.tools.compare import assert_bitwise, bits, mismatches

ARCHS = ["sm_90a", "sm_100a"]
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


def exp2i(k) -> np.ndarray:
    return np.ldexp(np.float32(1.0), np.asarray(k)).astype(np.float32)


# ---------------------------------------------------------------------------
# The host and the geometry.


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
    assert N.ARCHS == ("sm_90a", "sm_100a")


@pytest.mark.parametrize("h", [0, -2048, 1000, 2049, 3072, 2048 + 8])
def test_row_width_rejected(h):
    with pytest.raises(ValueError, match=rf"positive multiple of 2048 columns, not {h}"):
        N.check_row_width(h)


@pytest.mark.parametrize("h", [1000, 3072])
def test_row_tree_rejects_width(h):
    with pytest.raises(ValueError, match="positive multiple of 2048"):
        N.row_sum_of_squares(torch.zeros(2, h))
    with pytest.raises(ValueError, match="positive multiple of 2048"):
        N.thread_elements(torch.zeros(2, h))


@pytest.mark.parametrize("d", [0, 1, 3, 6, 48, 96, -2])
def test_head_width_rejected(d):
    with pytest.raises(ValueError, match=rf"a DSpark head norm takes heads of .*columns, not {d}$"):
        N.check_head_width(d)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100", "", "sm90a", (8, 0)])
def test_arch_rejected(arch):
    with pytest.raises(ValueError, match=r"arch \(the GPU whose stock the spec describes\) must be .*sm_90a, sm_100a"):
        N.check_arch(arch)
    with pytest.raises(ValueError, match="the GPU whose stock the spec describes"):
        N.row_sum_of_squares(torch.zeros(1, 2048), arch)


@pytest.mark.parametrize("arch, spelled", [("SM_90A", "sm_90a"), (" sm_100a ", "sm_100a"), ((9, 0), "sm_90a"),
                                           ((10, 0), "sm_100a")])
def test_arch_in_another_spelling_is_the_same_tree(arch, spelled):
    """One normaliser (``checks.arch``): case, blanks and the compute
    capability name the same architecture, whose tree the row sum follows."""
    assert N.check_arch(arch) == spelled
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(0))
    assert torch.equal(N.row_sum_of_squares(x, arch), N.row_sum_of_squares(x, spelled))


def test_f32_rounds_once_to_nearest_even():
    assert N.f32(1.0 + 2.0**-24) == 1.0  # a tie: to even
    assert N.f32(1.0 + 3 * 2.0**-24) == 1.0 + 2.0**-22
    assert N.f32(1e-6) == float(np.float32(1e-6)) and N.f32(-0.0) == 0.0 and math.copysign(1, N.f32(-0.0)) < 0
    with np.errstate(over="ignore"):
        assert N.f32(3.5e38) == math.inf


# ---------------------------------------------------------------------------
# fma_rn.


def test_fma_rn_random_bit_patterns(rng):
    """Every class of operand (random bit patterns: zeros, subnormals,
    normals, infinities, NaN), and magnitudes where the product and the addend
    overlap (so the one rounding matters)."""
    n = 40000
    a, b, c = (all_f32_classes(rng, n) for _ in range(3))
    got = N.fma_rn(t32(a), t32(b), t32(c))
    I.assert_same_bits(got, I.fma(a, b, c), "fma_rn, random bit patterns")
    x, y = I.random_f32(rng, n, "wide"), I.random_f32(rng, n, "wide")
    z = -I._mul(x, y) * np.float32(1 + rng.uniform(-2.0**-20, 2.0**-20, n)).astype(np.float32)  # cancellation
    I.assert_same_bits(N.fma_rn(t32(x), t32(y), t32(z)), I.fma(x, y, z), "fma_rn, cancellation")
    I.assert_same_bits(N.fma_rn(t32(x), t32(x), t32(y)), I.fma(x, x, y), "fma_rn, squares")


def tie_cases(rng, n):
    """Operands whose exact ``a * b + c`` lies exactly halfway between two
    float32: A * B + C an odd integer of 25 bits (A, B odd), scaled by powers
    of two, down into the subnormal range (odd multiples of 2**-150)."""
    a_i = rng.integers(2**11, 2**13, n) | 1
    b_i = rng.integers(2**11, 2**13, n) | 1
    c_i = 2 * rng.integers(-(2**20), 2**20, n)
    c_i[: n // 4] = 0
    prod = a_i * b_i + c_i
    keep = (np.abs(prod) >= 2**24) & (np.abs(prod) < 2**25)
    a_i, b_i, c_i = a_i[keep], b_i[keep], c_i[keep]
    ka = rng.integers(-60, 40, a_i.size)
    kb = rng.integers(-60, 40, a_i.size)
    a = (a_i * np.ldexp(1.0, ka)).astype(np.float32)
    b = (b_i * np.ldexp(1.0, kb)).astype(np.float32)
    c = (c_i * np.ldexp(1.0, ka + kb)).astype(np.float32)
    sub_a = np.array([3, 5, 7, 1, 9, 11], dtype=np.float64)
    sub_b = np.array([1, 3, 5, 7, 3, 13], dtype=np.float64)
    a = np.concatenate([a, (sub_a * 2.0**-75).astype(np.float32)])  # products odd * 2**-150: subnormal ties
    b = np.concatenate([b, (sub_b * 2.0**-75).astype(np.float32)])
    c = np.concatenate([c, np.zeros(6, np.float32)])
    return a, b, c


def test_fma_rn_exact_ties_round_to_even(rng):
    a, b, c = tie_cases(rng, 20000)
    assert a.size > 5000
    got = N.fma_rn(t32(a), t32(b), t32(c))
    I.assert_same_bits(got, I.fma(a, b, c), "fma_rn at exact ties")
    # the results are the even neighbours: their last significand bit is 0
    g = got.numpy()
    normal = np.abs(g) >= 2.0**-126
    assert np.all((I.f32_bits(g[normal]) & 1) == 0)
    # subnormal ties (k + 1/2) * 2**-149 go to the even k or k + 1: 3/2 -> 2, 15/2 -> 8, 35/2 -> 18, ...
    assert I.f32_bits(g[-6:]).tolist() == [2, 8, 18, 4, 14, 72]


def test_fma_rn_double_rounding_traps(rng):
    """``a * b`` exactly a float32 tie, ``c`` far below it: the exact sum is
    just off the tie, so one rounding goes away from the tie, while rounding
    the FP64 sum first (which drops ``c``) then to FP32 would tie to even."""
    a_i = rng.integers(2**11, 2**13, 20000) | 1
    b_i = rng.integers(2**11, 2**13, 20000) | 1
    keep = (a_i * b_i >= 2**24) & (a_i * b_i < 2**25)  # odd products of 25 bits: ties
    k = rng.integers(-40, 40, (2, int(keep.sum())))
    a = (a_i[keep] * np.ldexp(1.0, k[0])).astype(np.float32)
    b = (b_i[keep] * np.ldexp(1.0, k[1])).astype(np.float32)
    prod = a.astype(np.float64) * b.astype(np.float64)
    sign = np.where(rng.random(a.size) < 0.5, -1.0, 1.0)
    c = (sign * np.abs(prod) * 2.0 ** rng.uniform(-70, -56, a.size)).astype(np.float32)
    got = N.fma_rn(t32(a), t32(b), t32(c))
    I.assert_same_bits(got, I.fma(a, b, c), "fma_rn, double rounding traps")
    naive = (prod + c.astype(np.float64)).astype(np.float32)
    assert (I.f32_bits(naive) != I.torch_bits(got)).mean() > 0.3  # where the even neighbour is the far one


def test_fma_rn_special_values():
    inf, nan = math.inf, math.nan
    cases = [
        # a, b, c, expected bits (None: NaN)
        (0.0, 5.0, 0.0, 0x00000000),
        (-0.0, 5.0, -0.0, 0x80000000),  # (-0 * 5) + -0 = -0
        (-0.0, 5.0, 0.0, 0x00000000),  # -0 + +0 = +0
        (0.0, -5.0, -0.0, 0x80000000),
        (-0.0, -5.0, -0.0, 0x00000000),  # +0 + -0 = +0
        (2.0, 3.0, -6.0, 0x00000000),  # exact cancellation: +0
        (-2.0, 3.0, 6.0, 0x00000000),
        (2.0**-100, 2.0**-49, 0.0, 0x00000001),  # 2**-149: the least subnormal
        (2.0**-100, 2.0**-50, 0.0, 0x00000000),  # 2**-150: a tie, to even: +0
        (-(2.0**-100), 2.0**-50, -0.0, 0x80000000),  # -2**-150 -> -0
        (3 * 2.0**-100, 2.0**-50, 0.0, 0x00000002),  # 1.5 * 2**-149 -> 2 * 2**-149
        (2.0**-75, 2.0**-75, 2.0**-149, 0x00000002),  # 2**-150 + 2**-149: a tie between 1 and 2 ulps: 2
        (2.0**64, 2.0**64, 0.0, 0x7F800000),  # 2**128: overflow
        (F32_MAX, 1.0, F32_MAX, 0x7F800000),
        (-F32_MAX, 2.0, F32_MAX, 0xFF7FFFFF),  # -2 max + max = -max: exact
        (1.0, 1.0, F32_MAX, 0x7F7FFFFF),  # 1 + max rounds to max
        (2.0**64, 2.0**64, -F32_MAX, 0x73800000),  # 2**128 - max = 2**104: exact, finite
        (inf, 0.0, 1.0, None),
        (0.0, -inf, 1.0, None),
        (inf, 1.0, -inf, None),
        (inf, -2.0, 1.0, 0xFF800000),
        (1.0, 1.0, -inf, 0xFF800000),
        (nan, 0.0, 1.0, None),
        (1.0, 1.0, nan, None),
        (1.0 + 2.0**-12, 1.0 + 2.0**-12, 0.0, 0x3F801000),  # 1 + 2**-11 + 2**-24: a tie, to even
        (1.0 + 2.0**-12, 1.0 + 2.0**-12, 2.0**-60, 0x3F801001),  # just above the tie
        (1.0 + 2.0**-12, 1.0 + 2.0**-12, -(2.0**-60), 0x3F801000),  # just below
    ]
    a, b, c = (np.array([case[i] for case in cases], dtype=np.float32) for i in range(3))
    got = N.fma_rn(t32(a), t32(b), t32(c))
    I.assert_same_bits(got, I.fma(a, b, c), "fma_rn specials")
    gb = I.torch_bits(got)
    for i, case in enumerate(cases):
        if case[3] is None:
            assert math.isnan(got[i].item()), case
        else:
            assert gb[i] == case[3], (case, hex(gb[i]))


def test_fma_rn_takes_narrow_operands_and_broadcasts(rng):
    """Operands are widened to FP32 exactly (BF16, FP16, Python floats) and
    broadcast."""
    a = I.random_in(rng, (3, 5), "bf16", "normal")
    b = I.random_in(rng, (5,), "fp16", "normal")
    got = N.fma_rn(I.to_torch(a, "bf16"), I.to_torch(b, "fp16"), 0.1)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    I.assert_same_bits(got, I.fma(a, b[None, :], np.float32(0.1)), "fma_rn broadcast")


# ---------------------------------------------------------------------------
# The trees.


def test_pairwise_and_fold_halves_orders(rng):
    """``pairwise``: neighbours first, ``(v0+v1) + (v2+v3)``; ``fold_halves``:
    ``v[:n/2] + v[n/2:]`` (what a butterfly with offsets n/2 .. 1 leaves);
    a count that is not a power of two is padded with +0.0."""
    for n in (1, 2, 3, 8, 12, 16, 32):
        v = I.random_f32(rng, (40, n), "wide")
        lst = [v[:, i] for i in range(n)]
        I.assert_same_bits(N.pairwise(t32(v)), I._tree(lst), f"pairwise {n}")
        pad = 1 << max(n - 1, 0).bit_length()
        w = np.concatenate([v, np.zeros((40, pad - n), np.float32)], axis=1)
        lanes = np.arange(pad)
        off = pad // 2
        while off:
            w = I._add(w, w[:, lanes ^ off])
            off //= 2
        I.assert_same_bits(N.fold_halves(t32(v)), w[:, 0], f"fold_halves {n}")


def test_pairwise_and_fold_halves_differ(rng):
    """The two orders are different trees (so the tests of each have teeth)."""
    v = I.random_f32(rng, (200, 16), "wide")
    assert not torch.equal(N.pairwise(t32(v)), N.fold_halves(t32(v)))


def test_thread_elements_is_the_stock_layout(rng):
    """Thread ``t``'s element ``8r + j`` is column ``8t + j + 2048r``."""
    h = 8192
    x = np.arange(2 * h, dtype=np.float32).reshape(2, h)
    e = N.thread_elements(t32(x)).numpy()
    assert e.shape == (2, 256, 32)
    regs = I.thread_registers(x)
    for k in (0, 1, 7, 8, 15, 31):
        assert np.array_equal(e[:, :, k], regs[k])
    assert e[0, 5, 9] == 2048 * 1 + 8 * 5 + 1 and e[1, 255, 31] == h + 2048 * 3 + 8 * 255 + 7


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h", [2048, 6144, 8192])
def test_thread_sums_and_reduce_threads_match_the_cta(h, arch, scaled, rng):
    x = I.random_f32(rng, (3, h), "wide")
    ts = N.thread_sum_of_squares(N.thread_elements(t32(x)), arch, scaled)
    expect = I.thread_sums(x, arch, scaled)
    I.assert_same_bits(ts, expect, f"thread sums {arch} scaled={scaled}")
    total, warp_lanes, final = I.cta_reduce(expect, return_lanes=True)
    I.assert_same_bits(N.reduce_threads(ts), total, "reduce_threads")
    # every thread of the CTA ends with the same value, and every lane of a warp too
    assert np.array_equal(I.f32_bits(final), np.repeat(I.f32_bits(total)[:, None], 256, 1))
    wl = I.f32_bits(warp_lanes).reshape(3, 8, 32)
    assert np.array_equal(wl, np.repeat(wl[:, :, :1], 32, 2))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h", WIDTHS)
def test_row_sum_of_squares_matches_the_cta(h, arch, kind, rng):
    m = int(rng.integers(1, 4))
    x = I.random_f32(rng, (m, h), kind)
    for scaled in (False, True):
        I.assert_same_bits(N.row_sum_of_squares(t32(x), arch, scaled), I.row_sum_of_squares(x, arch, scaled),
                           f"row sum H={h} {arch} scaled={scaled} {kind}")


def test_the_row_trees_have_teeth(rng):
    """On wide-range data the trees differ from one another and from other
    orders in many rows (normal data: many terms of one size, so every
    addition rounds): sm_90a vs sm_100a; sm_100a input-scaled vs not;
    sm_90a's fma leaves vs rounded squares in the same tree; sequential.
    About 9 % of rows tell the closest pairs apart: 512 rows (about 45
    expected) against a floor of 8 leave no seed that fails by chance; 128
    rows (about 11 expected) fell to 8 on a CI seed."""
    h, m = 8192, 512
    floor = 8
    x = I.random_f32(rng, (m, h), "normal")
    xt = t32(x)
    s90, s100 = N.row_sum_of_squares(xt, "sm_90a"), N.row_sum_of_squares(xt, "sm_100a")
    s100s = N.row_sum_of_squares(xt, "sm_100a", True)
    assert (I.torch_bits(s90) != I.torch_bits(s100)).sum() > floor
    assert (I.torch_bits(s100) != I.torch_bits(s100s)).sum() > floor
    assert torch.equal(N.row_sum_of_squares(xt, "sm_90a", True), s90)  # sm_90a: one tree either way
    e = I.thread_registers(x)
    rounded = I.cta_reduce(I._tree([I._add(I._mul(e[2 * k], e[2 * k]), I._mul(e[2 * k + 1], e[2 * k + 1]))
                                    for k in range(16)]))
    assert (I.f32_bits(rounded) != I.torch_bits(s90)).sum() > floor
    seq = np.zeros(m, np.float32)
    for col in range(h):
        seq = I._add(seq, I._mul(x[:, col], x[:, col]))
    assert (I.f32_bits(seq) != I.torch_bits(s90)).sum() > floor


def test_bf16_rows_make_fma_leaves_exact_sums(rng):
    """The numerics docstring: for BF16 rows every square is exact, so the
    sm_100a fma-leaf tree (elements 4j and 4j + 2) has the rounded-squares
    tree's bits and sm_90a's leaves ``fma(e_2k, e_2k, RN(e_2k+1^2))`` are
    ``RN(q_2k + q_2k+1)``; for FP32 rows (inexact squares) neither holds."""
    h = 8192
    for fmt, same in (("bf16", True), ("fp32", False)):
        x = t32(I.random_in(rng, (128, h), fmt, "normal"))
        fma_tree, rounded = N.row_sum_of_squares(x, "sm_100a", True), N.row_sum_of_squares(x, "sm_100a", False)
        assert torch.equal(fma_tree.view(torch.int32), rounded.view(torch.int32)) is same, fmt
        e = N.thread_elements(x)
        plain = N.reduce_threads(N.pairwise(e * e))
        assert torch.equal(N.row_sum_of_squares(x, "sm_90a").view(torch.int32), plain.view(torch.int32)) is same, fmt


@pytest.mark.parametrize("arch", ARCHS)
def test_row_sum_special_values(arch, rng):
    h = 4096
    rows = I.random_f32(rng, (8, h), "normal")
    rows[0, 5] = np.inf
    rows[1, 7] = -np.inf  # its square: +inf
    rows[2, 3] = np.nan
    rows[3] = -0.0  # squares +0: the sum is +0
    rows[4] = 2.0**-80  # squares underflow to 0 (2**-160): the sum is +0
    rows[5] = 2.0**-70  # squares are the subnormal 2**-140, summed exactly: 4096 * 2**-140 = 2**-128
    rows[6] = 2.0**63  # squares 2**126, summed: overflow to +inf
    rows[7] = 2.0**64  # squares overflow themselves
    xt = t32(rows)
    for scaled in (False, True):
        s = N.row_sum_of_squares(xt, arch, scaled)
        I.assert_same_bits(s, I.row_sum_of_squares(rows, arch, scaled), "row sum specials")
        g = s.numpy()
        assert g[0] == np.inf and g[1] == np.inf and np.isnan(g[2])
        assert I.f32_bits(g[3]) == 0 and I.f32_bits(g[4]) == 0
        assert g[5] == np.float32(2.0**-128) and g[6] == np.inf and g[7] == np.inf


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h", [2048, 8192, 16384])
def test_row_sum_accuracy(h, arch, rng):
    """Non-negative terms: every term passes through its square (and the
    leaf fma), log2(n/2) or log2(n/2) + 1 in-thread additions (n = H/256),
    5 warp and 3 CTA additions: at most log2(n) + 10 roundings, so
    ``|s - sum| <= gamma_(log2(n) + 10) * sum`` (Higham, Thm 4.3 on the tree)."""
    n = h // 256
    x = I.random_f32(rng, (8, h), "wide")
    for scaled in (False, True):
        s = N.row_sum_of_squares(t32(x), arch, scaled).numpy().astype(np.float64)
        exact = np.array([math.fsum(r) for r in x.astype(np.float64) ** 2])
        assert np.all(np.abs(s - exact) <= gamma(int(math.log2(n)) + 10) * exact)


# ---------------------------------------------------------------------------
# inv_rms: fma(total, 1/n, eps), then rsqrt.approx.ftz.

INV_RMS_CASES = [(8192, 1e-6), (6144, 1e-5), (2048, 0.0), (16384, 1e-6)]


def totals(rng, n: int) -> np.ndarray:
    t = np.abs(I.random_f32(rng, 20000, "wide")) * np.float32(n)
    specials = [0.0, 2.0**-149, 2.0**-130, 2.0**-100, 1e30, F32_MAX, np.inf, np.nan, 1.5625]
    return np.concatenate([t, specials]).astype(np.float32)


@pytest.mark.parametrize("n,eps", INV_RMS_CASES)
def test_inv_rms_with_the_cpu_standin(n, eps, rng):
    t = totals(rng, n)
    I.assert_same_bits(N.inv_rms(t32(t), n, eps), I.norm_scale(t, n, eps), f"inv_rms n={n}")


@pytest.mark.parametrize("n,eps", INV_RMS_CASES)
def test_inv_rms_around_an_injected_rsqrt(n, eps, rng, approx):
    """Whatever rsqrt.approx.ftz returns, inv_rms hands it exactly
    ``fma(total, f32(1/n), f32(eps))`` and returns its result unchanged."""
    ops, record = I.perturbed(), {}
    approx(ops, record)
    t = totals(rng, n)
    got = N.inv_rms(t32(t), n, eps)
    assert list(record) == ["rsqrt_approx_ftz"] and len(record["rsqrt_approx_ftz"]) == 1
    v = I.fma(t, I.f32(1.0 / n), I.f32(eps))
    I.assert_same_bits(t32(record["rsqrt_approx_ftz"][0]), v, "rsqrt's input")
    I.assert_same_bits(got, ops.rsqrt_approx_ftz(v), "inv_rms")
    assert (I.f32_bits(ops.rsqrt_approx_ftz(v)) != I.f32_bits(I.STANDIN.rsqrt_approx_ftz(v))).mean() > 0.5


def test_inv_rms_is_one_fma(rng):
    """``fma(total, 1/n, eps)`` rounds once: for n = 6144 (1/n inexact) pick
    totals where ``RN(RN(total * 1/n) + eps)`` differs, and check the spec
    is the fma. (For n = 8192 the product is exact and the two agree.)"""
    n, eps = 6144, 1e-5
    t = np.abs(I.random_f32(rng, 100000, "normal")) * np.float32(1e-3)
    inv, e = I.f32(1.0 / n), I.f32(eps)
    two = I._add(I._mul(t, inv), e)
    one = I.fma(t, inv, e)
    pick = I.f32_bits(two) != I.f32_bits(one)
    assert pick.sum() > 50
    got = N.inv_rms(t32(t[pick]), n, eps)
    I.assert_same_bits(got, I.STANDIN.rsqrt_approx_ftz(one[pick]), "one fma")
    assert (I.torch_bits(got) != I.f32_bits(I.STANDIN.rsqrt_approx_ftz(two[pick]))).any()


def test_inv_rms_special_values():
    inf = math.inf
    assert N.inv_rms(t32([0.0]), 8192, 0.0).item() == inf  # rsqrt(+0)
    assert I.f32_bits(N.inv_rms(t32([inf]), 8192, 1e-6).numpy())[0] == 0  # rsqrt(inf) = +0
    assert math.isnan(N.inv_rms(t32([math.nan]), 8192, 1e-6).item())
    # eps is rounded to FP32 once: a zero total gives rsqrt(f32(1e-6))
    assert N.inv_rms(t32([0.0]), 8192, 1e-6).item() == float(I.STANDIN.rsqrt_approx_ftz(np.float32(1e-6)))
    # .ftz: a subnormal fma result (2**-120 * 2**-13 = 2**-133, eps 0) is read as +0: +inf,
    # where rsqrtf would give 2**66.5
    assert N.inv_rms(t32([2.0**-120]), 8192, 0.0).item() == inf
    assert math.isfinite(N.rsqrt_approx(t32([2.0**-133])).item())
    # and exactly: total 4 * 8192 = 2**15, n = 8192: fma = 4, rsqrt(4) = 0.5
    assert N.inv_rms(t32([2.0**15]), 8192, 0.0).item() == 0.5


# ---------------------------------------------------------------------------
# The approximate instructions' CPU stand-ins.

STANDINS = ["rsqrt_approx_ftz", "rsqrt_approx", "sqrt_approx_ftz", "rcp_full", "rcp_approx_ftz", "ex2_approx",
            "ex2_approx_ftz", "expf"]


@pytest.mark.parametrize("name", STANDINS)
def test_standins_are_the_documented_ieee_operations(name, rng):
    """On a CPU each approximate instruction runs its IEEE counterpart (the
    ``.ftz`` ones flushing subnormal inputs, ``ex2.ftz`` its results):
    bitwise against NumPy on random bit patterns of every class, subnormals
    and a dense range."""
    x = np.concatenate([all_f32_classes(rng, 100000),
                        I.from_f32_bits(rng.integers(1, 2**23, 5000, dtype=np.uint64).astype(np.uint32)),
                        rng.uniform(-150, 130, 50000).astype(np.float32)]).astype(np.float32)
    got = getattr(N, name)(t32(x))
    assert got.dtype == torch.float32
    I.assert_same_bits(got, getattr(I.STANDIN, name)(x), name)
    xb = I.random_in(rng, 2000, "bf16", "wide")  # any float input is widened first
    I.assert_same_bits(getattr(N, name)(I.to_torch(xb, "bf16")), getattr(I.STANDIN, name)(xb), f"{name} of bf16")


@pytest.mark.parametrize("name", ["rsqrt_approx", "sqrt_approx_ftz"])
def test_square_root_standins_are_correctly_rounded_on_two_binades(name):
    """Every float32 in [1, 4) (both exponent parities: all a root sees):
    the stand-ins use the correctly rounded root (the CPU ``torch.sqrt`` of
    FP32, which the spec once used, misrounds about 9 % of these; printed)."""
    u0 = int(np.float32(1.0).view(np.uint32))
    x = I.from_f32_bits(np.arange(u0, u0 + 2**24, dtype=np.uint32))
    got = getattr(N, name)(t32(x))
    I.assert_same_bits(got, getattr(I.STANDIN, name)(x), name)
    wrong = int((torch.sqrt(t32(x)) != torch.from_numpy(I.sqrt_rn(x))).sum())
    print(f"torch.sqrt misrounds {wrong} of 2**24 float32 in [1, 4)")


def test_standin_special_values():
    inf, nan = math.inf, math.nan
    sub = 2.0**-130

    def b(fn, v):
        return int(I.f32_bits(fn(t32([v])).numpy())[0])

    assert N.rsqrt_approx_ftz(t32([4.0])).item() == 0.5 and N.rsqrt_approx(t32([0.25])).item() == 2.0
    assert b(N.rsqrt_approx_ftz, -0.0) == 0xFF800000 and b(N.rsqrt_approx_ftz, inf) == 0
    assert math.isnan(N.rsqrt_approx_ftz(t32([-1.0])).item()) and math.isnan(N.rsqrt_approx(t32([nan])).item())
    assert N.rsqrt_approx_ftz(t32([sub])).item() == inf and b(N.rsqrt_approx_ftz, -sub) == 0xFF800000
    assert N.rsqrt_approx(t32([sub])).item() == 2.0**65  # rsqrtf keeps subnormals
    assert b(N.sqrt_approx_ftz, sub) == 0 and b(N.sqrt_approx_ftz, -sub) == 0x80000000
    assert N.rcp_approx_ftz(t32([sub])).item() == inf and b(N.rcp_approx_ftz, -sub) == 0xFF800000
    assert N.rcp_full(t32([2.0**-127])).item() == 2.0**127  # div.full keeps a subnormal input
    assert N.rcp_full(t32([-0.0])).item() == -inf and N.rcp_full(t32([inf])).item() == 0.0
    assert N.ex2_approx(t32([-130.0])).item() == 2.0**-130 and b(N.ex2_approx_ftz, -130.0) == 0
    assert N.ex2_approx(t32([128.0])).item() == inf and b(N.ex2_approx, -inf) == 0
    assert N.ex2_approx_ftz(t32([-sub])).item() == 1.0 and N.expf(t32([0.0])).item() == 1.0
    assert N.expf(t32([-inf])).item() == 0.0 and N.expf(t32([89.0])).item() == inf


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
# exp_rn (the reference draft's attention).


def exp_grid(rng) -> np.ndarray:
    dense = np.linspace(-110.0, 95.0, 200001, dtype=np.float64).astype(np.float32)
    edges = (88.72283935546875, -104.0, -103.972, -87.3365)
    near = np.concatenate([np.arange(-5, 6) * np.float32(2.0**-17) + np.float32(v) for v in edges])
    return np.concatenate([dense, near.astype(np.float32), all_f32_classes(rng, 100000)]).astype(np.float32)


def test_exp_constants_are_the_documented_ones():
    assert I.f32_bits(np.float32(N.f32(N._LN2_HI))) == 0x3F317200
    assert I.f32_bits(np.float32(N.f32(N._LN2_LO))) == 0x35BFBE8E
    assert N.f32(N._LOG2E) == float(np.float32(math.log2(math.e))) == float(I.LOG2E)
    assert (0x3F317200 & 0x1FF) == 0  # 15 fraction bits + 1: n * LN2_HI exact for |n| < 2**8
    assert abs(float(I.LN2_HI) + float(I.LN2_LO) - math.log(2)) < 2.0**-44
    assert [N.f32(c) for c in N._EXP_COEFFS] == [float(c) for c in I.EXP_COEFFS]
    limit = 2.0**128 - 2.0**103
    below = float(np.nextafter(np.float32(N.EXP_OVERFLOW), np.float32(0)))
    assert math.exp(N.EXP_OVERFLOW) > limit > math.exp(below)
    assert math.exp(N.EXP_UNDERFLOW) < 2.0**-150


def test_exp_rn_matches_independent(rng):
    x = exp_grid(rng)
    I.assert_same_bits(N.exp_rn(t32(x)), I.exp(x), "exp_rn")


def test_exp_rn_rounds_half_to_even():
    """``n = rint(x * LOG2E)`` rounds half to even: the float32 x whose
    rounded product is an exact half-integer."""
    xs = []
    for k in range(-151, 129):
        c = np.float32((k + 0.5) / float(I.LOG2E))
        cand = I.from_f32_bits((c.view(np.uint32).astype(np.int64) + np.arange(-64, 65)).astype(np.uint32))
        xs.append(cand[I._mul(cand, I.LOG2E) == np.float32(k + 0.5)])
    x = np.concatenate(xs)
    assert len(x) > 200
    I.assert_same_bits(N.exp_rn(t32(x)), I.exp(x), "exp_rn at exact halves")


def test_exp_rn_accuracy(rng):
    """``|exp_rn(x) - e**x| <= 4 ulp(e**x)`` on [EXP_UNDERFLOW, EXP_OVERFLOW)
    (the derivation: the Cody-Waite reduction, the degree-6 Taylor remainder
    and the Horner roundings stay below 3.7 ulp)."""
    top = float(np.nextafter(np.float32(N.EXP_OVERFLOW), np.float32(0)))
    x = np.concatenate([np.linspace(-104.0, top, 300001).astype(np.float32),
                        rng.uniform(-104.0, 88.72, 100000).astype(np.float32)])
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
    assert got[1] == 0.0 and I.f32_bits(y.numpy()[1]) == 0
    assert math.isnan(got[2])
    assert got[3] == 1.0 and got[4] == 1.0 and got[5] == 1.0 and got[6] == 1.0
    assert got[7] == float(np.float32(math.e))
    assert I.f32_bits(y.numpy()[8:11]).tolist() == [0, 0, 0]
    assert got[11] == inf and got[12] == inf
    assert 3.4e38 < got[13] <= F32_MAX
    assert I.f32_bits(y.numpy()[14]) == 27  # exp(-100) = 26.55 * 2**-149, not flushed
    I.assert_same_bits(y, I.exp(x.numpy()), "exp_rn specials")


def test_exp_rn_widens_narrow_inputs(rng):
    x = I.random_in(rng, 5000, "bf16", "wide")
    I.assert_same_bits(N.exp_rn(I.to_torch(x, "bf16")), I.exp(x), "exp_rn of bf16")
    xh = I.random_in(rng, 5000, "fp16", "normal") * np.float32(8)
    I.assert_same_bits(N.exp_rn(I.to_torch(xh, "fp16")), I.exp(xh), "exp_rn of fp16")


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
