"""Hypothesis property tests of the spec.

Random configurations (widths H a multiple of 2048 up to 16384, rows, eps,
weight dtypes, gain centers, weight before/after the norm, input and output
dtypes, data kinds with special values sprinkled in): the spec equals the
independent NumPy implementation bit for bit. And exact properties of the
norm that follow from its definition, checked on the spec:

- sign symmetry: ``norm(-x) == -norm(x)`` bit for bit (every step is odd or
  even in x under round to nearest), for all inputs;
- power-of-two scale invariance: with ``eps = 0`` (or an eps below half an
  ulp of both variances) and no overflow/underflow anywhere (all squares
  normal), ``norm(2**k x) == norm(x)`` bit for bit: every square scales by
  4**k, every rounded sum and the division by H commute with that scaling,
  ``sqrt`` gives 2**k, ``1 / sqrt`` 2**-k, and ``(2**k x) (2**-k r)`` is the
  same real number as ``x r`` before its rounding. (With a relevant eps it
  fails: ``v + eps`` does not scale.) This needs the spec's square root to
  commute with scaling by 4**k, which the CPU torch.sqrt does as well;
- the row tree's symmetries: XOR-ing the thread index (the butterflies pair
  t with t ^ 16, ..., the warp fold w with w ^ 4, ...), XOR-ing the element
  index within a fragment, and swapping fragments 0 and 1 of every thread
  permute the columns without changing any sum, so the norm commutes with
  that column permutation (weight permuted alike);
- a unit gain is exact; rows are independent; RoPE at position 0 is the
  identity on finite nonzero values.

The Hypothesis seed is the session's DSPARK_SEED (conftest.py); each example's
data comes from a NumPy generator seeded by a drawn integer (in the
falsifying example Hypothesis prints).
"""

from __future__ import annotations

import os

import _independent as I
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from dspark_core.spec import layers as L
from dspark_core.spec import numerics as N

SEED = int(os.environ.get("DSPARK_SEED", "0"))
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

pytestmark = pytest.mark.usefixtures("seed")  # prints DSPARK_SEED with a failure


def props(n: int):
    """Settings and the session seed for one property."""

    def wrap(f):
        f = settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])(f)
        return hypothesis_seed(SEED)(f)

    return wrap


widths = st.sampled_from(list(range(2048, 16385, 2048)))
rows = st.integers(1, 4)
eps_st = st.one_of(
    st.sampled_from([0.0, 1e-6, 1e-5, 1e-12, 3e-7, 0.1, 2.0**-149]),
    st.floats(0.0, 1e-2, allow_nan=False, allow_subnormal=False),
)
centers = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0**-24]),
    st.floats(-4.0, 4.0, width=32, allow_nan=False, allow_subnormal=False),
)
fmts = st.sampled_from(["bf16", "fp16", "fp32"])
weights = st.sampled_from([None, "bf16", "fp16", "fp32"])
kinds = st.sampled_from(["normal", "wide", "mixed", "tiny"])
data_seeds = st.integers(0, 2**63 - 1)

SPECIALS = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 2.0**-149, -(2.0**-133), 2.0**-126], dtype=np.float32)


def sprinkle(rng: np.random.Generator, x: np.ndarray, fmt: str, rate: float) -> np.ndarray:
    """Put special values at a fraction ``rate`` of the positions of ``x``."""
    if rate == 0:
        return x
    x = x.copy()
    mask = rng.random(x.shape) < rate
    x[mask] = rng.choice(SPECIALS, int(mask.sum()))
    return I.round_to(x, fmt)


def build_norm(rng, h, wdt, center, before, out, eps):
    norm = L.RMSNorm(
        h, eps, has_weight=wdt is not None, weight_dtype=DT[wdt or "bf16"], gain_center=center,
        weight_before_norm=before and wdt is not None, out_dtype=DT[out],
    )
    w = None
    if wdt is not None:
        w = I.random_in(rng, h, wdt, "normal")
        norm.weight.copy_(I.to_torch(w, wdt))
    return norm, w


def np_norm(norm, w, x, out, sqrt=None):
    return I.rmsnorm(
        x, w, eps=norm.eps, gain_center=norm.gain_center, weight_before=norm.weight_before_norm, out=out, sqrt=sqrt
    )


# ---------------------------------------------------------------------------
# The spec against the independent implementation.


@props(60)
@given(h=widths, m=rows, eps=eps_st, wdt=weights, center=centers, before=st.booleans(), out=fmts, in_fmt=fmts,
       kind=kinds, rate=st.sampled_from([0.0, 0.0, 0.001, 0.05]), ds=data_seeds)
def test_rmsnorm_equals_independent(h, m, eps, wdt, center, before, out, in_fmt, kind, rate, ds):
    rng = np.random.default_rng(ds)
    norm, w = build_norm(rng, h, wdt, center, before, out, eps)
    x = sprinkle(rng, I.random_in(rng, (m, h), in_fmt, kind), in_fmt, rate)
    I.assert_same_bits(norm(I.to_torch(x, in_fmt)), np_norm(norm, w, x, out), "RMSNorm")


@props(30)
@given(h=widths, m=rows, post_w=weights, pre_w=weights, post_center=centers, pre_center=centers,
       post_before=st.booleans(), pre_before=st.booleans(), eps=eps_st, s_fmt=st.sampled_from(["bf16", "fp32"]),
       out=fmts, rate=st.sampled_from([0.0, 0.01]), ds=data_seeds)
def test_residual_boundary_equals_independent(h, m, post_w, pre_w, post_center, pre_center, post_before, pre_before,
                                              eps, s_fmt, out, rate, ds):
    rng = np.random.default_rng(ds)
    post, w_post = build_norm(rng, h, post_w, post_center, post_before, "fp32", eps)
    pre, w_pre = build_norm(rng, h, pre_w, pre_center, pre_before, out, 1e-6)
    conn = L.GatedResidual(h)
    alpha, beta = I.random_in(rng, h, "fp32", "normal"), I.random_in(rng, h, "fp32", "normal")
    conn.alpha.copy_(torch.from_numpy(alpha))
    conn.beta.copy_(torch.from_numpy(beta))
    branch = sprinkle(rng, I.random_in(rng, (m, h), "bf16", "wide"), "bf16", rate)
    stream = sprinkle(rng, I.random_in(rng, (m, h), s_fmt, "normal"), s_fmt, rate)
    new_stream, y = L.residual_boundary(post, conn, pre, I.to_torch(branch, "bf16"), I.to_torch(stream, s_fmt),
                                        out_dtype=DT[out])
    kw = lambda n, w: dict(weight=w, eps=n.eps, gain_center=n.gain_center, weight_before=n.weight_before_norm)  # noqa: E731
    e_stream, e_out = I.residual_boundary(branch, stream, kw(post, w_post), kw(pre, w_pre), alpha, beta, out=out)
    I.assert_same_bits(new_stream, e_stream, "boundary new_stream")
    I.assert_same_bits(y, e_out, "boundary out")


@props(40)
@given(h=widths, m=rows, kind=kinds, rate=st.sampled_from([0.0, 0.01]), ds=data_seeds)
def test_row_sum_equals_independent(h, m, kind, rate, ds):
    rng = np.random.default_rng(ds)
    v = sprinkle(rng, I.random_f32(rng, (m, h), kind), "fp32", rate)
    I.assert_same_bits(N.row_sum(torch.from_numpy(v)), I.cta_row_sum(v), "row_sum")


@props(40)
@given(log_d=st.integers(1, 8), weight=st.booleans(), eps=eps_st, in_fmt=fmts, kind=kinds,
       rate=st.sampled_from([0.0, 0.02]), ds=data_seeds)
def test_headnorm_equals_independent(log_d, weight, eps, in_fmt, kind, rate, ds):
    rng = np.random.default_rng(ds)
    d = 2**log_d
    norm = L.HeadNorm(d, eps, has_weight=weight)
    w = None
    if weight:
        w = I.random_in(rng, d, "bf16", "normal")
        norm.weight.copy_(I.to_torch(w, "bf16"))
    x = sprinkle(rng, I.random_in(rng, (3, 4, d), in_fmt, kind), in_fmt, rate)
    I.assert_same_bits(norm(I.to_torch(x, in_fmt)), I.headnorm(x, w, eps=eps), "HeadNorm")


@props(40)
@given(half=st.integers(1, 64), table=st.sampled_from(["bf16", "fp32"]), theta=st.sampled_from([1e4, 5e5, 1e6]),
       in_fmt=st.sampled_from(["bf16", "fp32"]), rate=st.sampled_from([0.0, 0.02]), ds=data_seeds)
def test_rope_equals_independent(half, table, theta, in_fmt, rate, ds):
    rng = np.random.default_rng(ds)
    d, p = 2 * half, 512
    r = L.Rotary(d, p, theta, table_dtype=DT[table])
    m = int(rng.integers(1, 6))
    x = sprinkle(rng, I.random_in(rng, (m, 3, d), in_fmt, "normal"), in_fmt, rate)
    pos = rng.integers(0, p, m)
    I.assert_same_bits(r(I.to_torch(x, in_fmt), torch.from_numpy(pos)), I.rope(x, pos, I.to_np(r.cos_sin)), "RoPE")


@props(40)
@given(ds=data_seeds, lo=st.floats(-120, 100), width=st.floats(0.001, 200))
def test_exp_sigmoid_silu_equal_independent(ds, lo, width):
    rng = np.random.default_rng(ds)
    x = rng.uniform(lo, lo + width, 4000).astype(np.float32)
    bits = I.from_f32_bits(rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32))
    x = np.concatenate([x, bits]).astype(np.float32)
    xt = torch.from_numpy(x)
    I.assert_same_bits(N.exp_rn(xt), I.exp(x), "exp_rn")
    I.assert_same_bits(N.sigmoid_rn(xt), I.sigmoid(x), "sigmoid_rn")
    I.assert_same_bits(N.silu_rn(xt), I.silu(x), "silu_rn")


# ---------------------------------------------------------------------------
# Exact properties of the norm.


@props(40)
@given(h=widths, m=rows, eps=eps_st, wdt=weights, center=centers, before=st.booleans(), out=fmts, in_fmt=fmts,
       kind=kinds, rate=st.sampled_from([0.0, 0.01]), ds=data_seeds)
def test_rmsnorm_sign_symmetry(h, m, eps, wdt, center, before, out, in_fmt, kind, rate, ds):
    rng = np.random.default_rng(ds)
    norm, _ = build_norm(rng, h, wdt, center, before, out, eps)
    x = sprinkle(rng, I.random_in(rng, (m, h), in_fmt, kind), in_fmt, rate)
    y = I.to_np(norm(I.to_torch(x, in_fmt)))
    y_neg = norm(I.to_torch(-x, in_fmt))
    I.assert_same_bits(y_neg, -y, "norm(-x) vs -norm(x)")


def scale_invariance_case(rng, h, m, in_fmt, wdt, center, before):
    """x with magnitudes in [2**-20, 2**20] (and some exact zeros): every
    square of x and of 2**k x (|k| <= 10), and of x * g, is normal."""
    sign = np.where(rng.random((m, h)) < 0.5, -1.0, 1.0)
    x = sign * np.exp2(rng.uniform(-20, 20, (m, h)))
    x[rng.random((m, h)) < 0.02] = 0.0
    x = I.round_to(I.f32(x), in_fmt)
    norm, w = build_norm(rng, h, wdt, center, before, "fp32", 0.0)
    if w is not None:  # gains with magnitudes in [2**-8, 2**8] keep x * g and y * g normal
        g = np.where(rng.random(h) < 0.5, -1.0, 1.0) * np.exp2(rng.uniform(-8, 8, h))
        w = I.round_to(I.f32(g - np.float32(center)), wdt)
        norm.weight.copy_(I.to_torch(w, wdt))
        gain = I.to_np(norm.gain())
        assume(np.all((np.abs(gain) >= 2.0**-10) & (np.abs(gain) <= 2.0**10)))
    return norm, x


@props(40)
@given(h=widths, m=rows, k=st.sampled_from([k for k in range(-10, 11) if k]), wdt=weights,
       center=st.sampled_from([0.0, 1.0]), before=st.booleans(), out=fmts, in_fmt=st.sampled_from(["bf16", "fp32"]),
       ds=data_seeds)
def test_rmsnorm_power_of_two_scale_invariance_eps0(h, m, k, wdt, center, before, out, in_fmt, ds):
    rng = np.random.default_rng(ds)
    norm, x = scale_invariance_case(rng, h, m, in_fmt, wdt, center, before)
    xs = I.round_to(x * np.float32(2.0**k), in_fmt)
    assert np.array_equal(xs, x * np.float32(2.0**k))  # exact
    for o in ("fp32", out):
        y = norm(I.to_torch(x, in_fmt), out_dtype=DT[o])
        I.assert_same_bits(norm(I.to_torch(xs, in_fmt), out_dtype=DT[o]), I.to_np(y), f"scale 2**{k}")


@props(30)
@given(h=widths, m=rows, k=st.sampled_from([k for k in range(-6, 7) if k]), eps=st.sampled_from([1e-6, 1e-5, 1e-12]),
       in_fmt=st.sampled_from(["bf16", "fp32"]), ds=data_seeds)
def test_rmsnorm_scale_invariance_with_negligible_eps(h, m, k, eps, in_fmt, ds):
    """With eps > 0 the property holds exactly when ``v + eps`` rounds to
    ``v`` for both variances v (eps below half an ulp of each): assumed."""
    rng = np.random.default_rng(ds)
    norm, x = scale_invariance_case(rng, h, m, in_fmt, None, 0.0, False)
    norm.eps = float(eps)
    xs = I.round_to(x * np.float32(2.0**k), in_fmt)
    for v in (x, xs):
        var = I._div(I.cta_row_sum(I._mul(v, v)), np.float32(h))
        assume(np.array_equal(I._add(var, I.f32(eps)), var))
    y = norm(I.to_torch(x, in_fmt), out_dtype=torch.float32)
    I.assert_same_bits(norm(I.to_torch(xs, in_fmt), out_dtype=torch.float32), I.to_np(y), f"scale 2**{k}, eps {eps}")


def test_rmsnorm_scale_invariance_fails_with_relevant_eps():
    """The counterpart: with eps comparable to the variance, scaling changes
    the output (so the property above is not vacuous)."""
    h = 2048
    x = np.full((1, h), 2.0**-10, dtype=np.float32)
    norm = L.RMSNorm(h, 1e-6, has_weight=False, out_dtype=torch.float32)
    y1 = norm(I.to_torch(x, "bf16"))
    y2 = norm(I.to_torch(x * 4, "bf16"))
    assert not torch.equal(y1, y2)


def tree_permutation(h: int, ct: int, cj: int, swap01: bool) -> np.ndarray:
    """``src`` with ``x_perm[:, i] = x[:, src[i]]``: column k*2048 + t*8 + j
    comes from fragment swap(k), thread t ^ ct, element j ^ cj."""
    i = np.arange(h)
    k, t, j = i // 2048, (i // 8) % 256, i % 8
    if swap01 and h >= 4096:
        k = np.where(k == 0, 1, np.where(k == 1, 0, k))
    return k * 2048 + (t ^ ct) * 8 + (j ^ cj)


@props(40)
@given(h=widths, m=rows, ct=st.integers(0, 255), cj=st.integers(0, 7), swap01=st.booleans(), eps=eps_st,
       wdt=weights, center=centers, before=st.booleans(), out=fmts, kind=kinds, ds=data_seeds)
def test_rmsnorm_commutes_with_the_tree_symmetries(h, m, ct, cj, swap01, eps, wdt, center, before, out, kind, ds):
    rng = np.random.default_rng(ds)
    norm, w = build_norm(rng, h, wdt, center, before, out, eps)
    x = I.random_in(rng, (m, h), "bf16", kind)
    src = tree_permutation(h, ct, cj, swap01)
    assert np.array_equal(np.sort(src), np.arange(h))
    y = I.to_np(norm(I.to_torch(x, "bf16")))
    if w is not None:
        norm.weight.copy_(I.to_torch(w[src], wdt))
    y_perm = norm(I.to_torch(x[:, src], "bf16"))
    I.assert_same_bits(y_perm, y[:, src], f"tree symmetry ct={ct} cj={cj} swap01={swap01}")
    I.assert_same_bits(N.row_sum(torch.from_numpy(x[:, src])), I.to_np(N.row_sum(torch.from_numpy(x))), "row_sum")


@props(30)
@given(h=widths, m=rows, eps=eps_st, wdt=st.sampled_from(["bf16", "fp16", "fp32"]), before=st.booleans(), out=fmts,
       kind=kinds, rate=st.sampled_from([0.0, 0.01]), ds=data_seeds)
def test_rmsnorm_unit_gain_is_exact_and_rows_independent(h, m, eps, wdt, before, out, kind, rate, ds):
    rng = np.random.default_rng(ds)
    x = sprinkle(rng, I.random_in(rng, (m, h), "bf16", kind), "bf16", rate)
    xt = I.to_torch(x, "bf16")
    plain = L.RMSNorm(h, eps, has_weight=False, out_dtype=DT[out])
    ones = L.RMSNorm(h, eps, weight_dtype=DT[wdt], weight_before_norm=before, out_dtype=DT[out])
    centered = L.RMSNorm(h, eps, weight_dtype=DT[wdt], gain_center=1.0, weight_before_norm=before, out_dtype=DT[out])
    centered.weight.zero_()
    y = I.to_np(plain(xt))
    I.assert_same_bits(ones(xt), y, "weight of ones")
    I.assert_same_bits(centered(xt), y, "zero weight + center 1")
    for i in range(m):
        I.assert_same_bits(plain(xt[i : i + 1]), y[i : i + 1], f"row {i} alone")


@props(30)
@given(half=st.integers(1, 64), table=st.sampled_from(["bf16", "fp32"]), in_fmt=st.sampled_from(["bf16", "fp32"]),
       ds=data_seeds)
def test_rope_position_zero_is_identity(half, table, in_fmt, ds):
    """c = 1, s = +0: ``a*1 - b*0 = a`` and ``b*1 + a*0 = b`` exactly for
    finite nonzero a, b; the output is x rounded to BF16."""
    rng = np.random.default_rng(ds)
    d = 2 * half
    r = L.Rotary(d, 8, table_dtype=DT[table])
    x = I.random_in(rng, (3, 2, d), in_fmt, "wide")
    assume(np.all(x != 0))
    y = r(I.to_torch(x, in_fmt), torch.zeros(3, dtype=torch.long))
    I.assert_same_bits(y, I.round_bf16(x), "position 0")
