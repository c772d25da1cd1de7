"""Hypothesis property tests of the spec.

Random configurations (architectures, widths H a multiple of 2048, rows,
eps, weight dtypes, gain centers, weight before/after the norm, input and
output dtypes, data kinds with special values sprinkled in): the spec equals
the independent NumPy implementation bit for bit (with the documented CPU
stand-ins for the approximate instructions). And exact properties that follow
from the definitions, checked on the spec:

- ``fma_rn``: commutes in its factors; ``fma(a, b, -0.0) == RN(a b)`` and
  ``fma(a, 1, c) == RN(a + c)`` for every operand, specials included;
- sign symmetry of the norms: ``norm(-x) == -norm(x)`` bit for bit (every
  step is odd or even in x under round to nearest);
- power-of-two scale invariance of the row norm with ``eps = 0`` and no
  overflow/underflow: every square scales by 4**k, the tree, the fma with
  1/H and the (correctly rounded) stand-in root commute with that scaling;
- the row tree's symmetries, per architecture: XOR-ing the thread index (the
  butterflies pair t with t ^ 16 .. 1, the warp fold w with w ^ 4 .. 1), the
  element-index permutations that only swap operands of a sum or of a
  pairwise subtree (they differ per leaf shape: sm_90a's ``fma(e_2k, e_2k,
  RN(e_2k+1^2))`` is not symmetric in its two elements), and swapping the
  first two fragments of every thread, permute the columns without changing
  any sum: the norm commutes with that column permutation;
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


archs = st.sampled_from(["sm_90a", "sm_100a"])
widths = st.sampled_from([2048, 4096, 6144, 8192])
rows = st.integers(1, 3)
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
rates = st.sampled_from([0.0, 0.0, 0.001, 0.05])
data_seeds = st.integers(0, 2**63 - 1)


def build_norm(rng, h, arch, wdt, center, before, out, eps):
    norm = L.RMSNorm(
        h, eps, has_weight=wdt is not None, weight_dtype=DT[wdt or "bf16"], gain_center=center,
        weight_before_norm=before and wdt is not None, out_dtype=DT[out], arch=arch,
    )
    w = None
    if wdt is not None:
        w = I.random_in(rng, h, wdt, "normal")
        norm.weight.copy_(I.to_torch(w, wdt))
    return norm, w


def np_norm(norm, w, x, out):
    return I.rmsnorm(x, w, arch=norm.arch, eps=norm.eps, gain_center=norm.gain_center,
                     weight_before=norm.weight_before_norm, out=out)


# ---------------------------------------------------------------------------
# The spec against the independent implementation.

f32_bits_st = st.integers(0, 2**32 - 1)


@props(40)
@given(ds=data_seeds, mode=st.sampled_from(["bits", "wide", "ties"]))
def test_fma_rn_equals_the_integer_fma(ds, mode):
    rng = np.random.default_rng(ds)
    n = 2000
    if mode == "bits":
        a, b, c = (I.from_f32_bits(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)) for _ in range(3))
    elif mode == "wide":
        a, b = I.random_f32(rng, n, "mixed"), I.random_f32(rng, n, "mixed")
        c = -I._mul(a, b) * np.float32(1 + 2.0**-20 * rng.standard_normal(n)).astype(np.float32)
    else:
        a = (rng.integers(2**11, 2**13, n) | 1).astype(np.float32) * np.float32(2.0 ** rng.integers(-70, 50))
        b = (rng.integers(2**11, 2**13, n) | 1).astype(np.float32) * np.float32(2.0 ** rng.integers(-70, 50))
        c = np.where(rng.random(n) < 0.5, 0, I._mul(a, b) * np.float32(2.0**-30)).astype(np.float32)
    got = N.fma_rn(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c))
    I.assert_same_bits(got, I.fma(a, b, c), f"fma_rn ({mode})")


@props(40)
@given(a=f32_bits_st, b=f32_bits_st, c=f32_bits_st)
def test_fma_rn_identities(a, b, c):
    a, b, c = (torch.from_numpy(I.from_f32_bits(np.array([v], dtype=np.uint32))) for v in (a, b, c))
    nz = torch.tensor([-0.0])
    I.assert_same_bits(N.fma_rn(a, b, c), I.to_np(N.fma_rn(b, a, c)), "fma commutes in a, b")
    I.assert_same_bits(N.fma_rn(a, b, nz), I.to_np(a * b), "fma(a, b, -0) = RN(a b)")
    I.assert_same_bits(N.fma_rn(a, torch.ones(1), c), I.to_np(a + c), "fma(a, 1, c) = RN(a + c)")


@props(30)
@given(h=widths, m=rows, arch=archs, eps=eps_st, wdt=weights, center=centers, before=st.booleans(), out=fmts,
       in_fmt=fmts, kind=kinds, rate=rates, ds=data_seeds)
def test_rmsnorm_equals_independent(h, m, arch, eps, wdt, center, before, out, in_fmt, kind, rate, ds):
    rng = np.random.default_rng(ds)
    norm, w = build_norm(rng, h, arch, wdt, center, before, out, eps)
    x = I.sprinkle(rng, I.random_in(rng, (m, h), in_fmt, kind), in_fmt, rate)
    I.assert_same_bits(norm(I.to_torch(x, in_fmt)), np_norm(norm, w, x, out), "RMSNorm")


@props(15)
@given(m=rows, arch=archs, post_w=weights, pre_w=weights, post_center=centers, pre_center=centers,
       post_before=st.booleans(), pre_before=st.booleans(), eps=eps_st, s_fmt=st.sampled_from(["bf16", "fp32"]),
       out=fmts, rate=st.sampled_from([0.0, 0.01]), ds=data_seeds)
def test_residual_boundary_equals_independent(m, arch, post_w, pre_w, post_center, pre_center, post_before,
                                              pre_before, eps, s_fmt, out, rate, ds):
    rng = np.random.default_rng(ds)
    h = 8192
    post, w_post = build_norm(rng, h, arch, post_w, post_center, post_before, "fp32", eps)
    pre, w_pre = build_norm(rng, h, arch, pre_w, pre_center, pre_before, out, 1e-6)
    conn = L.GatedResidual(h)
    alpha, beta = I.random_in(rng, h, "fp32", "normal"), I.random_in(rng, h, "fp32", "normal")
    conn.alpha.copy_(torch.from_numpy(alpha))
    conn.beta.copy_(torch.from_numpy(beta))
    branch = I.sprinkle(rng, I.random_in(rng, (m, h), "bf16", "wide"), "bf16", rate)
    stream = I.sprinkle(rng, I.random_in(rng, (m, h), s_fmt, "normal"), s_fmt, rate)
    new_stream, y = L.residual_boundary(post, conn, pre, I.to_torch(branch, "bf16"), I.to_torch(stream, s_fmt),
                                        out_dtype=DT[out])

    def kw(n, w):
        return dict(weight=w, eps=n.eps, gain_center=n.gain_center, weight_before=n.weight_before_norm)

    e_stream, e_out = I.residual_boundary(branch, stream, kw(post, w_post), kw(pre, w_pre), alpha, beta, out=out,
                                          arch=arch)
    I.assert_same_bits(new_stream, e_stream, "boundary new_stream")
    I.assert_same_bits(y, e_out, "boundary out")


@props(30)
@given(h=widths, m=rows, arch=archs, scaled=st.booleans(), kind=kinds, rate=st.sampled_from([0.0, 0.01]),
       ds=data_seeds)
def test_row_sum_equals_independent(h, m, arch, scaled, kind, rate, ds):
    rng = np.random.default_rng(ds)
    v = I.sprinkle(rng, I.random_f32(rng, (m, h), kind), "fp32", rate)
    I.assert_same_bits(N.row_sum_of_squares(torch.from_numpy(v), arch, scaled),
                       I.row_sum_of_squares(v, arch, scaled), "row sum")


@props(30)
@given(m=st.integers(1, 9), heads=st.integers(1, 6), eps=eps_st, rope=st.sampled_from([None, "bf16", "fp32"]),
       kind=kinds, rate=st.sampled_from([0.0, 0.02]), ds=data_seeds)
def test_head_norms_equal_independent(m, heads, eps, rope, kind, rate, ds):
    """The fused QK-norm (+ RoPE) and the context K-norm."""
    rng = np.random.default_rng(ds)
    d, p = 64, 256
    norm = L.HeadNorm(d, eps)
    x = I.sprinkle(rng, I.random_in(rng, (m, heads, d), "bf16", kind), "bf16", rate)
    pos = rng.integers(0, p, m)
    rotary = None if rope is None else L.Rotary(d, p, table_dtype=DT[rope])
    got = L.qk_norm_rope(I.to_torch(x, "bf16"), norm, torch.from_numpy(pos), rotary)
    tab = None if rotary is None else I.to_np(rotary.cos_sin)
    I.assert_same_bits(got, I.qk_norm_rope(x, eps=eps, positions=pos, table=tab), "QK-norm")
    I.assert_same_bits(L.k_norm_context(I.to_torch(x, "bf16"), norm), I.k_norm_context(x, eps=eps), "K-norm")


@props(30)
@given(m=st.integers(1, 40), heads=st.sampled_from([1, 2, 8, 16]), arch=archs, eps=eps_st, kind=kinds,
       gate_scale=st.sampled_from([1.0, 16.0, 256.0]), rate=st.sampled_from([0.0, 0.02]), ds=data_seeds)
def test_o_gate_equals_independent(m, heads, arch, eps, kind, gate_scale, rate, ds):
    rng = np.random.default_rng(ds)
    attn = I.sprinkle(rng, I.random_in(rng, (m, heads, 64), "bf16", kind), "bf16", rate)
    gate = I.sprinkle(rng, I.random_in(rng, (m, heads, 64), "bf16", "normal") * np.float32(gate_scale), "bf16",
                      rate)
    y = L.o_gate(I.to_torch(attn, "bf16"), I.to_torch(gate, "bf16"), L.HeadNorm(64, eps), arch=arch)
    I.assert_same_bits(y, I.o_gate(attn, gate, eps=eps, arch=arch), f"o_gate {arch}")


@props(30)
@given(m=st.integers(1, 5), inter=st.sampled_from([8, 64, 512]), scale=st.sampled_from([1.0, 8.0, 64.0]),
       rate=st.sampled_from([0.0, 0.02]), ds=data_seeds)
def test_silu_and_mul_equals_independent(m, inter, scale, rate, ds):
    rng = np.random.default_rng(ds)
    gu = I.sprinkle(rng, I.random_in(rng, (m, 2 * inter), "bf16", "normal") * np.float32(scale), "bf16", rate)
    I.assert_same_bits(L.silu_and_mul(I.to_torch(gu, "bf16"), inter), I.silu_and_mul(gu, inter), "SiluAndMul")


@props(30)
@given(half=st.integers(1, 64), table=st.sampled_from(["bf16", "fp32"]), theta=st.sampled_from([1e4, 5e5, 1e6]),
       in_fmt=st.sampled_from(["bf16", "fp32"]), rate=st.sampled_from([0.0, 0.02]), ds=data_seeds)
def test_rope_equals_independent(half, table, theta, in_fmt, rate, ds):
    rng = np.random.default_rng(ds)
    d, p = 2 * half, 512
    r = L.Rotary(d, p, theta, table_dtype=DT[table])
    m = int(rng.integers(1, 6))
    x = I.sprinkle(rng, I.random_in(rng, (m, 3, d), in_fmt, "normal"), in_fmt, rate)
    pos = rng.integers(0, p, m)
    I.assert_same_bits(r(I.to_torch(x, in_fmt), torch.from_numpy(pos)), I.rope(x, pos, I.to_np(r.cos_sin)), "RoPE")


@props(30)
@given(ds=data_seeds, lo=st.floats(-120, 100), width=st.floats(0.001, 200))
def test_exp_rn_equals_independent(ds, lo, width):
    rng = np.random.default_rng(ds)
    x = rng.uniform(lo, lo + width, 4000).astype(np.float32)
    bits = I.from_f32_bits(rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32))
    x = np.concatenate([x, bits]).astype(np.float32)
    I.assert_same_bits(N.exp_rn(torch.from_numpy(x)), I.exp(x), "exp_rn")


# ---------------------------------------------------------------------------
# Exact properties.


@props(30)
@given(h=widths, m=rows, arch=archs, eps=eps_st, wdt=weights, center=centers, before=st.booleans(), out=fmts,
       in_fmt=fmts, kind=kinds, rate=st.sampled_from([0.0, 0.01]), ds=data_seeds)
def test_rmsnorm_sign_symmetry(h, m, arch, eps, wdt, center, before, out, in_fmt, kind, rate, ds):
    rng = np.random.default_rng(ds)
    norm, _ = build_norm(rng, h, arch, wdt, center, before, out, eps)
    x = I.sprinkle(rng, I.random_in(rng, (m, h), in_fmt, kind), in_fmt, rate)
    y = I.to_np(norm(I.to_torch(x, in_fmt)))
    I.assert_same_bits(norm(I.to_torch(-x, in_fmt)), -y, "norm(-x) vs -norm(x)")


@props(30)
@given(m=st.integers(1, 8), heads=st.integers(1, 4), arch=archs, eps=eps_st, kind=kinds, ds=data_seeds)
def test_head_norms_sign_symmetry(m, heads, arch, eps, kind, ds):
    """The QK-norm (no RoPE), the K-norm and the o-norm (gate fixed) are odd."""
    rng = np.random.default_rng(ds)
    norm = L.HeadNorm(64, eps)
    x = I.random_in(rng, (m, heads, 64), "bf16", kind)
    g = I.to_torch(I.random_in(rng, (m, heads, 64), "bf16", "normal"), "bf16")
    for name, fn in (("QK-norm", lambda t: L.qk_norm_rope(t, norm)), ("K-norm", lambda t: L.k_norm_context(t, norm)),
                     ("o-gate", lambda t: L.o_gate(t, g, norm, arch=arch))):
        I.assert_same_bits(fn(I.to_torch(-x, "bf16")), -I.to_np(fn(I.to_torch(x, "bf16"))), name)


def scale_invariance_case(rng, h, m, arch, in_fmt, wdt, center, before):
    """x with magnitudes in [2**-20, 2**20] (and some exact zeros): every
    square of x and of 2**k x (|k| <= 10), and of x * g, is normal."""
    sign = np.where(rng.random((m, h)) < 0.5, -1.0, 1.0)
    x = sign * np.exp2(rng.uniform(-20, 20, (m, h)))
    x[rng.random((m, h)) < 0.02] = 0.0
    x = I.round_to(I.f32(x), in_fmt)
    norm, w = build_norm(rng, h, arch, wdt, center, before, "fp32", 0.0)
    if w is not None:  # gains with magnitudes in [2**-8, 2**8] keep x * g and y * g normal
        g = np.where(rng.random(h) < 0.5, -1.0, 1.0) * np.exp2(rng.uniform(-8, 8, h))
        w = I.round_to(I.f32(g - np.float32(center)), wdt)
        norm.weight.copy_(I.to_torch(w, wdt))
        gain = I.to_np(norm.gain())
        assume(np.all((np.abs(gain) >= 2.0**-10) & (np.abs(gain) <= 2.0**10)))
    return norm, x


@props(30)
@given(h=widths, m=rows, arch=archs, k=st.sampled_from([k for k in range(-10, 11) if k]), wdt=weights,
       center=st.sampled_from([0.0, 1.0]), before=st.booleans(), out=fmts, in_fmt=st.sampled_from(["bf16", "fp32"]),
       ds=data_seeds)
def test_rmsnorm_power_of_two_scale_invariance_eps0(h, m, arch, k, wdt, center, before, out, in_fmt, ds):
    rng = np.random.default_rng(ds)
    norm, x = scale_invariance_case(rng, h, m, arch, in_fmt, wdt, center, before)
    xs = I.round_to(x * np.float32(2.0**k), in_fmt)
    assert np.array_equal(xs, x * np.float32(2.0**k))  # exact
    for o in ("fp32", out):
        y = norm(I.to_torch(x, in_fmt), out_dtype=DT[o])
        I.assert_same_bits(norm(I.to_torch(xs, in_fmt), out_dtype=DT[o]), I.to_np(y), f"scale 2**{k}")


def test_rmsnorm_scale_invariance_fails_with_relevant_eps():
    """The counterpart: with eps comparable to the mean square, scaling
    changes the output (so the property above is not vacuous)."""
    h = 2048
    x = np.full((1, h), 2.0**-10, dtype=np.float32)
    norm = L.RMSNorm(h, 1e-6, has_weight=False, out_dtype=torch.float32)
    assert not torch.equal(norm(I.to_torch(x, "bf16")), norm(I.to_torch(x * 4, "bf16")))


# Element-index XORs (within a thread's fragment of 8) that only swap operands of
# a sum or of a pairwise subtree, per leaf shape.
SYMMETRIC_CJ = {("sm_90a", False): [0, 2, 4, 6], ("sm_90a", True): [0, 2, 4, 6],
                ("sm_100a", False): list(range(8)), ("sm_100a", True): [0, 1, 4, 5]}


def tree_permutation(h: int, ct: int, cj: int, swap01: bool) -> np.ndarray:
    """``src`` with ``x_perm[:, i] = x[:, src[i]]``: column 2048 r + 8 t + j
    comes from fragment swap(r), thread t ^ ct, element j ^ cj."""
    i = np.arange(h)
    r, t, j = i // 2048, (i // 8) % 256, i % 8
    if swap01 and h >= 4096:
        r = np.where(r == 0, 1, np.where(r == 1, 0, r))
    return r * 2048 + (t ^ ct) * 8 + (j ^ cj)


@props(30)
@given(h=widths, m=rows, arch=archs, ct=st.integers(0, 255), cj_index=st.integers(0, 7), swap01=st.booleans(),
       eps=eps_st, wdt=weights, center=centers, before=st.booleans(), out=fmts, kind=kinds, ds=data_seeds)
def test_rmsnorm_commutes_with_the_tree_symmetries(h, m, arch, ct, cj_index, swap01, eps, wdt, center, before, out,
                                                   kind, ds):
    rng = np.random.default_rng(ds)
    norm, w = build_norm(rng, h, arch, wdt, center, before, out, eps)
    scaled = norm.weight_before_norm
    allowed = SYMMETRIC_CJ[(arch, scaled)]
    cj = allowed[cj_index % len(allowed)]
    x = I.random_in(rng, (m, h), "bf16", kind)
    src = tree_permutation(h, ct, cj, swap01)
    assert np.array_equal(np.sort(src), np.arange(h))
    y = I.to_np(norm(I.to_torch(x, "bf16")))
    if w is not None:
        norm.weight.copy_(I.to_torch(w[src], wdt))
    I.assert_same_bits(norm(I.to_torch(x[:, src], "bf16")), y[:, src], f"tree symmetry ct={ct} cj={cj}")


def test_a_non_symmetry_breaks_the_sm_90a_leaves(rng):
    """Swapping the two elements of an sm_90a leaf (cj = 1) changes sums:
    ``fma(a, a, RN(b^2)) != fma(b, b, RN(a^2))`` in general (so the allowed
    set above is not just everything)."""
    h = 8192
    x = torch.from_numpy(I.random_f32(rng, (64, h), "normal"))
    src = torch.from_numpy(tree_permutation(h, 0, 1, False))
    a, b = N.row_sum_of_squares(x, "sm_90a"), N.row_sum_of_squares(x[:, src], "sm_90a")
    assert (a.view(torch.int32) != b.view(torch.int32)).any()


@props(20)
@given(h=widths, m=rows, arch=archs, eps=eps_st, wdt=st.sampled_from(["bf16", "fp16", "fp32"]), before=st.booleans(),
       out=fmts, kind=kinds, rate=st.sampled_from([0.0, 0.01]), ds=data_seeds)
def test_rmsnorm_unit_gain_is_exact_and_rows_independent(h, m, arch, eps, wdt, before, out, kind, rate, ds):
    rng = np.random.default_rng(ds)
    x = I.sprinkle(rng, I.random_in(rng, (m, h), "bf16", kind), "bf16", rate)
    xt = I.to_torch(x, "bf16")
    plain = L.RMSNorm(h, eps, has_weight=False, out_dtype=DT[out], arch=arch)
    ones = L.RMSNorm(h, eps, weight_dtype=DT[wdt], weight_before_norm=before, out_dtype=DT[out], arch=arch)
    centered = L.RMSNorm(h, eps, weight_dtype=DT[wdt], gain_center=1.0, weight_before_norm=before,
                         out_dtype=DT[out], arch=arch)
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
    """c = 1, s = +0: ``fma(1, a, -(0 b)) = a`` and ``fma(0, a, 1 b) = b``
    exactly for finite nonzero a, b; the output is x rounded to BF16."""
    rng = np.random.default_rng(ds)
    d = 2 * half
    r = L.Rotary(d, 8, table_dtype=DT[table])
    x = I.random_in(rng, (3, 2, d), in_fmt, "wide")
    assume(np.all(x != 0))
    y = r(I.to_torch(x, in_fmt), torch.zeros(3, dtype=torch.long))
    I.assert_same_bits(y, I.round_bf16(x), "position 0")
