"""CPU tests of the stock layers (``dspark_core.spec.layers``): each one BIT FOR BIT
against the independent NumPy implementation (``_independent.py``), against
float64 mathematics within derived bounds, on special values, and on every
ValueError it raises. ``u = 2**-24``.

Spec problems these tests found were xfails until the spec closed them (commit
c3db4f1): the RoPE BF16 table's two roundings and the FP32 table's dependence
on torch's float64 math library (now documented), the gain center rounded to
FP32 before its addition (documented), ``RMSNorm.forward(out_dtype=...)``
unvalidated, float RoPE positions truncated, repeated KV slots (now refused).
"""

from __future__ import annotations

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.contracts.constants import norm_constants as _norm_constants
from dspark_core.reference.adapter import norm_description
from dspark_core.spec import layers as L

WIDTHS = [2048, 4096, 6144, 8192]
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
U = 2.0**-24
INF, NAN = float("inf"), float("nan")
# Input dtype -> the kind of random data it gets (FP16 cannot hold 'wide').
IN_KINDS = {"bf16": "wide", "fp16": "normal", "fp32": "mixed"}


def t32(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True))


def make_norm(rng, h, *, has_weight=True, wdt="bf16", center=0.0, before=False, out="bf16", eps=1e-6, wkind="normal"):
    """A spec RMSNorm with a random weight, and that weight as float32 values."""
    norm = L.RMSNorm(
        h, eps, has_weight=has_weight, weight_dtype=DT[wdt], gain_center=center, weight_before_norm=before,
        out_dtype=DT[out],
    )
    w = None
    if has_weight:
        w = I.random_in(rng, h, wdt, wkind)
        norm.weight.copy_(I.to_torch(w, wdt))
    return norm, w


def np_norm(norm: L.RMSNorm, w, x, out=None, sqrt=None):
    """The independent RMSNorm with ``norm``'s settings."""
    return I.rmsnorm(
        x, w, eps=norm.eps, gain_center=norm.gain_center, weight_before=norm.weight_before_norm,
        out=out or I.fmt_of(torch.empty(0, dtype=norm.out_dtype)), sqrt=sqrt,
    )


# ---------------------------------------------------------------------------
# RMSNorm: bitwise against the independent implementation.

NORM_VARIANTS = [
    dict(has_weight=False),
    dict(wdt="bf16", center=0.0, before=False),
    dict(wdt="bf16", center=1.0, before=False),
    dict(wdt="fp16", center=0.0, before=True),
    dict(wdt="fp32", center=1.0, before=True),
    dict(wdt="fp32", center=0.5, before=False, eps=1e-5),
    dict(wdt="bf16", center=-1.0, before=True, eps=0.0),
]


@pytest.mark.parametrize("out", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("variant", range(len(NORM_VARIANTS)))
@pytest.mark.parametrize("h", WIDTHS)
def test_rmsnorm_matches_independent(h, variant, out, rng):
    norm, w = make_norm(rng, h, out=out, **NORM_VARIANTS[variant])
    for in_fmt, kind in IN_KINDS.items():
        m = int(rng.integers(1, 5))
        x = I.random_in(rng, (m, h), in_fmt, kind)
        got = norm(I.to_torch(x, in_fmt))
        assert got.dtype == DT[out] and got.shape == (m, h)
        I.assert_same_bits(got, np_norm(norm, w, x), f"RMSNorm H={h} {NORM_VARIANTS[variant]} in={in_fmt} out={out}")


def test_rmsnorm_forward_out_dtype_and_leading_shape(rng):
    h = 4096
    norm, w = make_norm(rng, h, center=1.0)
    x = I.random_in(rng, (2, 3, h), "bf16", "normal")
    got = norm(I.to_torch(x, "bf16"), out_dtype=torch.float32)
    assert got.shape == (2, 3, h) and got.dtype == torch.float32
    I.assert_same_bits(got, np_norm(norm, w, x.reshape(6, h), out="fp32").reshape(2, 3, h), "leading shape")
    # rows are independent: one row alone gives the same bits
    I.assert_same_bits(norm(I.to_torch(x[1, 2:3], "bf16")), np_norm(norm, w, x[1, 2:3]), "one row")
    # a 1-D input is one row
    I.assert_same_bits(norm(I.to_torch(x[0, 0], "bf16")), np_norm(norm, w, x[0, :1])[0], "1-D")


def test_rmsnorm_strided_inputs_and_many_rows(rng):
    """Layout does not matter: a column slice of a wider tensor, a transposed
    view and 257 rows give the bits of the contiguous rows."""
    h = 4096
    norm, w = make_norm(rng, h, wdt="fp32", center=1.0, before=True, out="fp32")
    big = I.random_in(rng, (257, 2 * h), "bf16", "wide")
    x = big[:, h:]
    expect = np_norm(norm, w, np.ascontiguousarray(x))
    I.assert_same_bits(norm(I.to_torch(big, "bf16")[:, h:]), expect, "column slice, 257 rows")
    xt = I.to_torch(np.ascontiguousarray(x[:5].T), "bf16").t()  # a transposed (column-major) view
    assert not xt.is_contiguous()
    I.assert_same_bits(norm(xt), expect[:5], "transposed view")


# ---------------------------------------------------------------------------
# RMSNorm: accuracy.


def rmsnorm_bound(h: int, before: bool) -> float:
    """The relative error bound of the FP32 result ``y`` (before the output
    rounding) against float64 math on the same FP32 inputs, gain and eps.

    With K = H / 2048 the tree has d = K + 10 additions on every path, so
    with the squares ``s`` has relative error <= gamma_(d+1); ``s / H`` and
    ``+ eps`` (non-negative) add 2u: (d + 3)u; the square root halves that
    and adds u (``sqrt_rn`` is IEEE); the reciprocal adds u: (d + 3)/2 u +
    2u. ``x * r`` and ``* g`` add u each: (d + 11)/2 u. Weight before the
    norm: ``x * g`` rounds each entry (u), which moves the exact normalized
    value by <= 2u, and there is no final ``* g``: (d + 13)/2 u. ``1.001``
    covers second-order terms."""
    d = h // 2048 + 10
    return (d + (13 if before else 11)) / 2 * U * 1.001


@pytest.mark.parametrize("out", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("variant", [0, 2, 4, 5])
@pytest.mark.parametrize("h", [2048, 8192, 16384])
def test_rmsnorm_accuracy(h, variant, out, rng):
    """``|y_out - y64| <= half_ulp_out(|y64| (1 + B)) + B |y64|`` with B of
    ``rmsnorm_bound`` and half_ulp_out the output format's rounding error
    (half a BF16/FP16 ulp, subnormal spacing included; 0 for FP32 out).
    For BF16 out that is within one BF16 ulp."""
    cfg = NORM_VARIANTS[variant]
    norm, w = make_norm(rng, h, out=out, **cfg)
    before = norm.weight_before_norm
    x = I.random_in(rng, (8, h), "bf16", "normal")
    y = I.to_np(norm(I.to_torch(x, "bf16"))).astype(np.float64)
    xd = x.astype(np.float64)
    g = None if w is None else I.to_np(norm.gain()).astype(np.float64)
    eps = float(np.float32(norm.eps))
    if g is not None and before:
        xd = xd * g
    y64 = xd / np.sqrt(np.mean(xd * xd, axis=1, keepdims=True) + eps)
    if g is not None and not before:
        y64 = y64 * g
    b = rmsnorm_bound(h, before)
    bound = b * np.abs(y64)
    if out != "fp32":
        bound = bound + I.half_ulp(np.abs(y64) * (1 + b), out)
    err = np.abs(y - y64)
    assert np.all(err <= bound), float((err / np.maximum(bound, 1e-300)).max())


# ---------------------------------------------------------------------------
# RMSNorm: special values.


def test_rmsnorm_inf_in_a_row():
    """A row holding +inf (or -inf): ``s = inf``, ``r = 1 / sqrt(inf) = +0``,
    so ``y = x * 0``: NaN at the infinity (inf * 0) and a zero of x's sign
    (times g's sign) everywhere else. The row is not all NaN; other rows are
    untouched."""
    h = 2048
    norm = L.RMSNorm(h, out_dtype=torch.float32)
    x = np.ones((3, h), dtype=np.float32)
    x[:, 1::2] = -2.0
    x[0, 5] = INF
    x[1, 6] = -INF
    y = norm(I.to_torch(x, "bf16"))
    yb = I.torch_bits(y)
    assert np.isnan(y[0, 5].item()) and np.isnan(y[1, 6].item())
    for row, col in [(0, 5), (1, 6)]:
        rest = np.delete(yb[row], col)
        signs = np.delete(np.signbit(x[row]), col)
        assert np.array_equal(rest, np.where(signs, 0x80000000, 0).astype(np.uint32))
    assert np.all(np.isfinite(y[2].numpy())) and np.all(y[2].numpy() != 0)
    I.assert_same_bits(y, np_norm(norm, None, x), "inf rows")


def test_rmsnorm_nan_in_a_row():
    h = 4096
    norm = L.RMSNorm(h)
    x = np.ones((2, h), dtype=np.float32)
    x[0, 100] = NAN
    y = norm(I.to_torch(x, "bf16"))
    assert torch.isnan(y[0]).all() and not torch.isnan(y[1]).any()


def test_rmsnorm_finite_row_overflowing_its_squares():
    """No scaling in the spec: a finite row whose sum of squares overflows
    FP32 (|x| = 2**64: x * x = 2**128 = inf) gives the same zeros as a row
    with an infinity (float64 math would give +-1). Just below, 2**58 over
    2048 columns sums to 2**127 and normalizes exactly to +-1."""
    h = 2048
    norm = L.RMSNorm(h, out_dtype=torch.float32)
    x = np.full((2, h), 2.0**64, dtype=np.float32)
    x[:, ::3] *= -1
    x[1] = np.sign(x[1]) * 2.0**58
    y = norm(I.to_torch(x, "bf16"))
    assert np.array_equal(I.torch_bits(y[0]), np.where(x[0] < 0, 0x80000000, 0).astype(np.uint32))
    assert np.array_equal(y[1].numpy(), np.sign(x[1]))


def test_rmsnorm_negative_zero(rng):
    """``x * r`` with ``r > 0`` keeps x's sign: -0.0 in gives -0.0 out; an
    all -0.0 row has ``s = +0``, ``r = 1 / sqrt(eps)``, output all -0.0."""
    h = 2048
    norm, w = make_norm(rng, h, wkind="normal")
    norm.weight.copy_(norm.weight.abs() + 0.5)  # positive gains
    x = np.ones((2, h), dtype=np.float32)
    x[0, ::7] = -0.0
    x[1] = -0.0
    y = norm(I.to_torch(x, "bf16"))
    yb = I.torch_bits(y)
    assert np.all(yb[0, ::7] == 0x8000) and np.all(yb[1] == 0x8000)
    w = I.to_np(norm.weight)
    I.assert_same_bits(y, I.rmsnorm(x, w, eps=norm.eps), "-0.0")


def test_rmsnorm_gain_center_turns_negative_zero_weight_positive():
    """``g = w + gain_center``: with center 0.0 a -0.0 weight becomes +0.0
    (-0 + +0 = +0 under round to nearest), so a negative x gives -0.0 and a
    positive x +0.0, where ``x * r * w`` with the raw -0.0 weight would flip
    both signs; center -0.0 keeps -0.0 (-0 + -0 = -0); ``-1 + 1 = +0``."""
    h = 2048
    x = np.ones((1, h), dtype=np.float32)
    x[0, 1::2] = -3.0
    xt = I.to_torch(x, "bf16")
    neg_signs = np.signbit(x[0])
    for center, w_val, expect_gain_bits in [(0.0, -0.0, 0), (-0.0, -0.0, 0x80000000), (1.0, -1.0, 0), (0.0, 0.0, 0)]:
        for before in (False, True):
            norm = L.RMSNorm(h, gain_center=center, weight_before_norm=before, out_dtype=torch.float32)
            norm.weight.fill_(w_val)
            assert np.all(I.torch_bits(norm.gain()) == expect_gain_bits), (center, w_val)
            y = norm(xt)
            g_neg = bool(expect_gain_bits)
            expect = np.where(neg_signs ^ g_neg, 0x80000000, 0).astype(np.uint32)
            assert np.array_equal(I.torch_bits(y[0]), expect), (center, w_val, before)
            I.assert_same_bits(y, np_norm(norm, I.to_np(norm.weight), x), "gain center")


def test_rmsnorm_subnormal_row_is_not_flushed(rng):
    """A row of BF16 subnormals: the squares underflow to 0, so ``s = 0``,
    ``r = 1 / sqrt(f32(eps))`` and ``y = x * r``: nonzero, not flushed. With
    eps = 0 the row is 0 * inf in the zero columns (NaN) and +-inf elsewhere."""
    h = 2048
    x = I.round_bf16((rng.integers(1, 128, (1, h)) * np.where(rng.random((1, h)) < 0.5, -1, 1)) * 2.0**-133)
    assert np.all(np.abs(x) < 2.0**-126) and np.all(x != 0)
    norm = L.RMSNorm(h, 1e-6, has_weight=False, out_dtype=torch.float32)
    y = norm(I.to_torch(x, "bf16"))
    r = I._div(np.float32(1), I.sqrt_rn(np.float32(1e-6)))
    assert np.array_equal(I.torch_bits(y), I.f32_bits(I._mul(x, r)))
    assert np.all(y.numpy() != 0)
    norm0 = L.RMSNorm(h, 0.0, has_weight=False, out_dtype=torch.float32)
    y0 = norm0(I.to_torch(x, "bf16")).numpy()
    assert np.all(np.isinf(y0)) and np.array_equal(np.signbit(y0), np.signbit(x))


def test_rmsnorm_subnormal_squares_are_not_flushed():
    """|x| = 2**-70: every square is the subnormal 2**-140 (exact), the tree
    sums them exactly, ``s / H = 2**-140``, ``sqrt = 2**-70`` and with eps = 0
    the output is exactly +-1. A flush-to-zero implementation gives +-inf."""
    h = 4096
    x = np.full((1, h), 2.0**-70, dtype=np.float32)
    x[0, ::5] *= -1
    norm = L.RMSNorm(h, 0.0, has_weight=False, out_dtype=torch.float32)
    y = norm(I.to_torch(x, "bf16"))
    assert np.array_equal(y.numpy(), np.sign(x))


def test_rmsnorm_subnormal_outputs_are_kept(rng):
    """A tiny FP32 weight (2**-130) makes every output subnormal in FP32 and
    in BF16 (same exponent range; BF16 subnormals are multiples of 2**-133):
    kept, not flushed."""
    h = 2048
    x = I.random_in(rng, (2, h), "bf16", "normal")
    for out in ("fp32", "bf16"):
        norm = L.RMSNorm(h, weight_dtype=torch.float32, out_dtype=DT[out])
        norm.weight.fill_(2.0**-130)
        y = norm(I.to_torch(x, "bf16"))
        yv = I.to_np(y)
        assert np.all(np.abs(yv) < 2.0**-126) and np.count_nonzero(yv) > 0.9 * yv.size
        I.assert_same_bits(y, np_norm(norm, I.to_np(norm.weight), x), f"subnormal out {out}")


def test_rmsnorm_zero_row_with_zero_eps_is_nan():
    norm = L.RMSNorm(2048, 0.0)
    y = norm(torch.zeros(1, 2048, dtype=torch.bfloat16))
    assert torch.isnan(y).all()  # 0 * (1 / sqrt(0)) = 0 * inf


def test_rmsnorm_infinite_weight():
    """``g = inf``: ``y * inf`` is +-inf, and NaN where ``y`` is 0."""
    h = 2048
    norm = L.RMSNorm(h, out_dtype=torch.float32)
    norm.weight.fill_(INF)
    x = np.ones((1, h), dtype=np.float32)
    x[0, 3] = 0.0
    x[0, 4] = -1.0
    y = norm(I.to_torch(x, "bf16"))[0]
    assert y[0].item() == INF and y[4].item() == -INF and np.isnan(y[3].item())


# ---------------------------------------------------------------------------
# RMSNorm: validation, and the gain center's problems.


@pytest.mark.parametrize("h", [0, 1000, 3072, -2048])
def test_rmsnorm_rejects_width(h):
    with pytest.raises(ValueError, match=f"positive multiple of 2048 columns, not {h}"):
        L.RMSNorm(h)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_rmsnorm_rejects_dtypes(dtype):
    with pytest.raises(ValueError, match=r"the norm's output dtype must be one of bfloat16, float16, float32, not"):
        L.RMSNorm(2048, out_dtype=dtype)
    with pytest.raises(ValueError, match=r"the norm weight's dtype must be one of bfloat16, float16, float32, not"):
        L.RMSNorm(2048, weight_dtype=dtype)
    L.RMSNorm(2048, has_weight=False, weight_dtype=dtype)  # no weight: its dtype is not read


def test_rmsnorm_rejects_weight_before_without_weight():
    with pytest.raises(ValueError, match="a weightless norm cannot scale its input by a weight"):
        L.RMSNorm(2048, has_weight=False, weight_before_norm=True)


def test_rmsnorm_rejects_row_width():
    norm = L.RMSNorm(4096)
    with pytest.raises(ValueError, match=r"RMSNorm\(4096\) takes rows of 4096 columns, not 2048"):
        norm(torch.zeros(2, 2048, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_rmsnorm_forward_rejects_out_dtype(dtype):
    norm = L.RMSNorm(2048)
    with pytest.raises(ValueError, match="output dtype"):
        norm(torch.ones(1, 2048, dtype=torch.bfloat16), out_dtype=dtype)
    conn = L.GatedResidual(2048)
    with pytest.raises(ValueError, match="output dtype"):  # the boundary passes its out_dtype through
        L.residual_boundary(norm, conn, norm, torch.ones(1, 2048, dtype=torch.bfloat16), torch.ones(1, 2048),
                            out_dtype=dtype)


def test_rmsnorm_gain_rounds_the_center_to_fp32_first():
    """The docstring: ``c`` rounds to FP32 first, then one FP32 addition. With
    w = 1 and c = 2**-24 + 2**-80, c rounds to 2**-24 and 1 + 2**-24 ties to
    1.0 (0x3f800000); rounding the exact sum once would give 1 + 2**-23."""
    norm = L.RMSNorm(2048, weight_dtype=torch.float32, gain_center=2.0**-24 + 2.0**-80)
    assert norm.gain()[0].item() == 1.0


def test_norm_constants_separate_the_gain_center_signs():
    """Equal NormConstants must mean equal bits. Centers 0.0 and -0.0 give
    different bits for -0.0 weights (g = +0 vs -0), so their constants must
    differ (they compared and hashed equal before commit 95b9787, since
    -0.0 == 0.0 in Python); equal centers give equal constants and bits."""
    h = 2048
    x = torch.ones(1, h, dtype=torch.bfloat16)
    a, b, c = L.RMSNorm(h, gain_center=0.0), L.RMSNorm(h, gain_center=-0.0), L.RMSNorm(h, gain_center=0.0)
    for n in (a, b, c):
        n.weight.fill_(-0.0)
    ca, cb, cc = (_norm_constants(norm_description("a norm", n, h), h) for n in (a, b, c))
    assert I.torch_bits(a(x))[0, 0] != I.torch_bits(b(x))[0, 0]
    assert ca != cb and ca.key() != cb.key()
    assert ca == cc and hash(ca) == hash(cc) and ca.key() == cc.key()
    assert np.array_equal(I.torch_bits(a(x)), I.torch_bits(c(x)))


# ---------------------------------------------------------------------------
# HeadNorm.


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 64, 128])
def test_headnorm_matches_independent(d, weight, rng):
    for eps, in_fmt in [(1e-6, "bf16"), (1e-5, "fp32"), (0.0, "bf16")]:
        norm = L.HeadNorm(d, eps, has_weight=weight)
        w = None
        if weight:
            w = I.random_in(rng, d, "bf16", "normal")
            norm.weight.copy_(I.to_torch(w, "bf16"))
        x = I.random_in(rng, (3, 5, d), in_fmt, IN_KINDS[in_fmt])
        y = norm(I.to_torch(x, in_fmt))
        assert y.dtype == torch.bfloat16
        I.assert_same_bits(y, I.headnorm(x, w, eps=eps), f"HeadNorm D={d} eps={eps} in={in_fmt}")


@pytest.mark.parametrize("d", [2, 64, 128])
def test_headnorm_accuracy(d, rng):
    """BF16 out: ``|y - y64| <= half_ulp_bf16(|y64|(1+B)) + B |y64|`` with
    the head tree's log2(D) additions: B = (log2 D + 11)/2 u (as for the
    row norm, weight after, with d = log2 D)."""
    norm = L.HeadNorm(d, 1e-6, has_weight=True)
    w = I.random_in(rng, d, "bf16", "normal")
    norm.weight.copy_(I.to_torch(w, "bf16"))
    x = I.random_in(rng, (64, 4, d), "bf16", "normal")
    y = I.to_np(norm(I.to_torch(x, "bf16"))).astype(np.float64)
    xd = x.astype(np.float64)
    y64 = xd / np.sqrt(np.mean(xd * xd, axis=-1, keepdims=True) + float(np.float32(1e-6))) * w
    b = (np.log2(d) + 11) / 2 * U * 1.001
    assert np.all(np.abs(y - y64) <= b * np.abs(y64) + I.half_ulp(np.abs(y64) * (1 + b), "bf16"))


def test_headnorm_special_values():
    """Per head: an infinity makes its own head NaN at the infinity and +-0
    elsewhere; a NaN makes its head all NaN; -0.0 stays -0.0; other heads of
    the same row are untouched."""
    d = 64
    norm = L.HeadNorm(d)
    x = np.ones((1, 4, d), dtype=np.float32)
    x[0, :, 1::2] = -1.0
    x[0, 0, 3] = INF
    x[0, 1, 7] = NAN
    x[0, 2, :] = -0.0
    y = norm(I.to_torch(x, "bf16"))
    yb = I.torch_bits(y)[0]
    assert np.isnan(y[0, 0, 3].item()) and np.all(np.delete(yb[0], 3) == np.delete(np.where(x[0, 0] < 0, 0x8000, 0), 3))
    assert torch.isnan(y[0, 1]).all()
    assert np.all(yb[2] == 0x8000)
    assert np.all(np.abs(I.to_np(y[0, 3])) == 1.0)
    I.assert_same_bits(y, I.headnorm(x, eps=1e-6), "HeadNorm specials")


def test_headnorm_validation():
    with pytest.raises(ValueError, match="a DSpark head norm takes heads of .*not 48"):
        L.HeadNorm(48)
    norm = L.HeadNorm(64)
    with pytest.raises(ValueError, match=r"HeadNorm\(64\) takes heads of 64, not 32"):
        norm(torch.zeros(2, 32))


# ---------------------------------------------------------------------------
# GatedResidual.


def random_residual(rng, h):
    conn = L.GatedResidual(h)
    alpha = I.random_in(rng, h, "fp32", "normal")
    beta = I.random_in(rng, h, "fp32", "wide")
    conn.alpha.copy_(t32(alpha))
    conn.beta.copy_(t32(beta))
    return conn, alpha, beta


@pytest.mark.parametrize("h", WIDTHS)
def test_gated_residual_matches_independent(h, rng):
    conn, alpha, beta = random_residual(rng, h)
    for s_fmt, b_fmt in [("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "fp32")]:
        stream = I.random_in(rng, (3, h), s_fmt, "mixed")
        branch = I.random_in(rng, (3, h), b_fmt, "mixed")
        got = conn(I.to_torch(stream, s_fmt), I.to_torch(branch, b_fmt))
        assert got.dtype == torch.float32
        I.assert_same_bits(got, I.gated_residual(stream, branch, alpha, beta), f"GatedResidual {s_fmt}/{b_fmt}")


def test_gated_residual_coefficients_rounded_once():
    conn = L.GatedResidual(2048, alpha=0.1, beta=1.0 / 3.0)
    assert conn.alpha.dtype == torch.float32 and conn.alpha[0].item() == float(np.float32(0.1))
    assert conn.beta[5].item() == float(np.float32(1.0 / 3.0))


def test_gated_residual_special_values():
    """Zeros' signs (``-0 + -0 = -0``, ``-0 + +0 = +0``), ``0 * inf = NaN``,
    ``inf - inf = NaN``, subnormal products kept."""
    h = 2048
    conn = L.GatedResidual(h)
    stream = np.zeros((1, h), dtype=np.float32)
    branch = np.zeros((1, h), dtype=np.float32)
    stream[0, 0], branch[0, 0] = -0.0, -0.0  # -0 + -0
    stream[0, 1], branch[0, 1] = -0.0, 0.0  # -0 + +0
    stream[0, 2], branch[0, 2] = INF, -INF
    stream[0, 3], branch[0, 3] = 2.0**-140, 2.0**-133  # subnormal sum (2**-133: the least BF16 subnormal)
    conn.alpha.data[4] = 0.0
    stream[0, 4] = INF  # 0 * inf
    conn.alpha.data[5] = 2.0**-100
    stream[0, 5] = 2.0**-30  # product 2**-130: subnormal
    y = conn(t32(stream), I.to_torch(I.round_bf16(branch), "bf16"))
    yb = I.torch_bits(y)[0]
    assert yb[0] == 0x80000000 and yb[1] == 0
    assert np.isnan(y[0, 2].item()) and np.isnan(y[0, 4].item())
    assert y[0, 3].item() == 2.0**-140 + 2.0**-133 and y[0, 5].item() == 2.0**-130
    I.assert_same_bits(y, I.gated_residual(stream, I.round_bf16(branch), I.to_np(conn.alpha), I.to_np(conn.beta)),
                       "GatedResidual specials")


# ---------------------------------------------------------------------------
# residual_boundary.

BOUNDARY_CASES = [
    # post variant, pre variant, stream fmt, out fmt
    (dict(wdt="bf16"), dict(wdt="bf16"), "fp32", "bf16"),
    (dict(wdt="bf16", center=1.0), dict(wdt="fp32", center=1.0, before=True), "bf16", "bf16"),
    (dict(has_weight=False), dict(wdt="fp16", eps=1e-5), "fp32", "fp32"),
    (dict(wdt="fp32", before=True, eps=0.0), dict(has_weight=False), "bf16", "fp16"),
]


def make_boundary(rng, h, post_cfg, pre_cfg):
    post, w_post = make_norm(rng, h, out="fp32", **post_cfg)  # its out dtype is overridden to BF16
    pre, w_pre = make_norm(rng, h, **pre_cfg)
    conn, alpha, beta = random_residual(rng, h)
    post_kw = dict(weight=w_post, eps=post.eps, gain_center=post.gain_center, weight_before=post.weight_before_norm)
    pre_kw = dict(weight=w_pre, eps=pre.eps, gain_center=pre.gain_center, weight_before=pre.weight_before_norm)
    return (post, conn, pre), (post_kw, pre_kw, alpha, beta)


@pytest.mark.parametrize("case", range(len(BOUNDARY_CASES)))
@pytest.mark.parametrize("h", WIDTHS)
def test_residual_boundary_matches_independent(h, case, rng):
    post_cfg, pre_cfg, s_fmt, out = BOUNDARY_CASES[case]
    mods, (post_kw, pre_kw, alpha, beta) = make_boundary(rng, h, post_cfg, pre_cfg)
    m = int(rng.integers(1, 5))
    branch = I.random_in(rng, (m, h), "bf16", "wide")
    stream = I.random_in(rng, (m, h), s_fmt, "normal")
    new_stream, y = L.residual_boundary(*mods, I.to_torch(branch, "bf16"), I.to_torch(stream, s_fmt), out_dtype=DT[out])
    e_stream, e_out = I.residual_boundary(branch, stream, post_kw, pre_kw, alpha, beta, out=out)
    assert new_stream.dtype == torch.float32 and y.dtype == DT[out]
    I.assert_same_bits(new_stream, e_stream, "boundary new_stream")
    I.assert_same_bits(y, e_out, "boundary out")


def test_residual_boundary_special_values(rng):
    """BF16 branch read as is: an infinity in the branch makes the post-norm
    NaN at that column (and +-0 elsewhere), the new stream NaN there only,
    and the whole pre-norm row NaN; a NaN in the stream does the same; -0.0
    branch rows give -0.0 post outputs; subnormal branch rows are not
    flushed."""
    h = 2048
    mods, (post_kw, pre_kw, alpha, beta) = make_boundary(rng, h, dict(wdt="bf16"), dict(wdt="bf16"))
    mods[0].weight.copy_(mods[0].weight.abs() + 0.5)  # positive post gains: -0.0 stays -0.0
    post_kw["weight"] = I.to_np(mods[0].weight)
    mods[1].alpha.fill_(1.0)
    mods[1].beta.fill_(1.0)
    alpha, beta = np.ones(h, np.float32), np.ones(h, np.float32)
    branch = I.random_in(rng, (5, h), "bf16", "normal")
    stream = I.random_in(rng, (5, h), "fp32", "normal")
    branch[0, 10] = INF
    stream[1, 20] = NAN
    branch[2] = -0.0
    stream[2] = -0.0
    branch[3] = I.round_bf16(np.full(h, 2.0**-130))
    stream[3] = 0.0
    branch[4, ::2] = -INF
    new_stream, y = L.residual_boundary(*mods, I.to_torch(branch, "bf16"), t32(stream))
    ns = new_stream.numpy()
    assert np.isnan(ns[0, 10]) and np.isfinite(np.delete(ns[0], 10)).all() and torch.isnan(y[0]).all()
    assert np.isnan(ns[1, 20]) and torch.isnan(y[1]).all()
    assert np.all(I.f32_bits(ns[2]) == 0x80000000)  # -0 + -0
    assert np.all(I.torch_bits(y[2]) & 0x7FFF == 0)  # zeros (of the pre gain's sign flipped by -0)
    assert np.all(ns[3] != 0)  # the subnormal branch was normalized (x / sqrt(eps)), not flushed
    assert torch.isnan(y[4]).all()
    e_stream, e_out = I.residual_boundary(branch, stream, post_kw, pre_kw, alpha, beta)
    I.assert_same_bits(new_stream, e_stream, "boundary specials new_stream")
    I.assert_same_bits(y, e_out, "boundary specials out")


# ---------------------------------------------------------------------------
# Rotary.


def test_rope_validation():
    with pytest.raises(ValueError, match="GPT-J RoPE takes an even head size, not 63"):
        L.Rotary(63, 16)
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(ValueError, match=r"the RoPE table's dtype must be one of bfloat16, float32, not"):
            L.Rotary(64, 16, table_dtype=dtype)
    r = L.Rotary(64, 16)
    x = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    for bad in ([-1, 0], [0, 16], [3, 100]):
        with pytest.raises(ValueError, match=r"RoPE positions must lie in \[0, 16\)"):
            r(x, torch.tensor(bad))
    r(x, torch.tensor([0, 15]))
    assert r(x[:0], torch.tensor([], dtype=torch.long)).shape == (0, 1, 64)


@pytest.mark.parametrize("table", ["bf16", "fp32"])
def test_rope_table_layout_and_accuracy(table):
    """``[max_position, D]``: cos in columns j < D/2, sin in D/2 + j; row 0 is
    exactly (1, ..., 1, 0, ..., 0); every entry within half an ulp of the
    table format plus half an FP32 ulp (the BF16 table goes through FP32)
    plus 2**-40 of the float64 values (libm and angle rounding) of
    cos/sin(p * theta**(-2j/D))."""
    d, p, theta = 64, 4096, 10000.0
    r = L.Rotary(d, p, theta, table_dtype=DT[table])
    tab = r.cos_sin
    assert tab.shape == (p, d) and tab.dtype == DT[table] and tab.is_contiguous()
    t = I.to_np(tab).astype(np.float64)
    assert np.all(t[0, : d // 2] == 1.0) and np.all(I.torch_bits(tab[0, d // 2 :]) == 0)
    ref = I.rope_table_f64(d, p, theta)
    slack = I.half_ulp(ref, table) + (I.half_ulp(ref, "fp32") if table == "bf16" else 0) + 2.0**-40
    assert np.all(np.abs(t - ref) <= slack)


def test_rope_bf16_table_is_rounded_through_fp32():
    """The docstring: float64 -> FP32 -> BF16, two roundings (at [1247, 59]
    sin = 0.501953140203 is stored as 0.5; once-rounded it would be 0.50390625)."""
    d, p = 64, 4096
    r = L.Rotary(d, p)
    j = torch.arange(d // 2, dtype=torch.float64)
    angles = torch.arange(p, dtype=torch.float64)[:, None] * (10000.0 ** (-2.0 * j / d))[None, :]
    f64 = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).numpy()  # torch's own float64 values
    twice = I.round_once_f64(I.round_once_f64(f64, "fp32").astype(np.float64), "bf16")
    I.assert_same_bits(r.cos_sin, twice, "BF16 table vs float64 rounded to FP32 then BF16")
    assert r.cos_sin[1247, 59].item() == 0.5


def test_rope_fp32_table_is_the_formula_up_to_the_math_library():
    """The table's bits are torch's CPU float64 math library's (the docstring):
    against NumPy's, every entry within 2**-24 (one FP32 ulp at 1; angles up
    to 6.5e4 rad carry about 1e-11 of float64 error, several ulps of a value
    near a zero of cos or sin), and a rebuild gives the same bits."""
    d, p = 64, 65536
    r = L.Rotary(d, p, table_dtype=torch.float32)
    ref = I.round_once_f64(I.rope_table_f64(d, p, 10000.0), "fp32").astype(np.float64)
    got = I.to_np(r.cos_sin).astype(np.float64)
    assert np.abs(got - ref).max() <= 2.0**-24
    I.assert_same_bits(L.Rotary(d, p, table_dtype=torch.float32).cos_sin, got.astype(np.float32), "rebuilt table")


@pytest.mark.parametrize("table", ["bf16", "fp32"])
@pytest.mark.parametrize("d", [2, 8, 64, 128])
def test_rope_matches_independent(d, table, rng):
    p = 3000
    r = L.Rotary(d, p, theta=500000.0 if d == 128 else 10000.0, table_dtype=DT[table])
    tab = I.to_np(r.cos_sin)
    for in_fmt in ("bf16", "fp32"):
        m = int(rng.integers(1, 9))
        x = I.random_in(rng, (m, 4, d), in_fmt, "normal")
        pos = rng.integers(0, p, m)
        pos[0] = 0
        pos[-1] = p - 1
        y = r(I.to_torch(x, in_fmt), torch.from_numpy(pos))
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        I.assert_same_bits(y, I.rope(x, pos, tab), f"RoPE D={d} table={table} in={in_fmt}")
    pos32 = torch.from_numpy(pos.astype(np.int32))  # int32 positions work the same
    I.assert_same_bits(r(I.to_torch(x, in_fmt), pos32), I.rope(x, pos, tab), "int32 positions")


@pytest.mark.parametrize("table", ["bf16", "fp32"])
def test_rope_accuracy(table, rng):
    """Against float64 rotation by the exact angle: ``|a' - a'64| <=
    (|a| + |b|)(dt + 3u)(1 + 2**-8) + half_ulp_bf16(|a'64| + (|a|+|b|)(dt+3u))``
    with dt the table's relative error (half a BF16 ulp plus half an FP32 ulp
    for BF16: 2**-9 + 2**-25; 2**-24 for FP32, plus 2**-40 absolute for the
    float64 angles); 3u: two products and the sum, each rounded once."""
    d, p = 64, 4096
    r = L.Rotary(d, p, table_dtype=DT[table])
    x = I.random_in(rng, (256, 2, d), "bf16", "normal")
    pos = rng.integers(0, p, 256)
    y = I.to_np(r(I.to_torch(x, "bf16"), torch.from_numpy(pos))).astype(np.float64)
    ref_tab = I.rope_table_f64(d, p, 10000.0)[pos]
    c, s = ref_tab[:, None, : d // 2], ref_tab[:, None, d // 2 :]
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    ea, eb = a * c - b * s, b * c + a * s
    dt = (2.0**-9 + 2.0**-25 if table == "bf16" else 2.0**-24) + 2.0**-40
    mag = (np.abs(a) + np.abs(b)) * (dt + 3 * U)
    for got, exp in ((y[..., 0::2], ea), (y[..., 1::2], eb)):
        assert np.all(np.abs(got - exp) <= mag * (1 + 2.0**-8) + I.half_ulp(np.abs(exp) + mag, "bf16"))


def test_rope_special_values():
    """At position 0 (c = 1, s = +0): finite nonzero pairs come out unchanged;
    zeros: a' = a*1 - b*0, so (-0, -0) -> (+0, -0), (-0, +0) -> (-0, +0),
    (+0, -0) -> (+0, +0); an infinity's partner becomes inf * 0 = NaN. At a
    position with c, s != 0 an infinity gives two infinities; NaN spreads to
    both of its pair; BF16 subnormals are rotated, not flushed."""
    d = 8
    r = L.Rotary(d, 64, table_dtype=torch.float32)
    x = np.array(
        [
            [[-0.0, -0.0, -0.0, 0.0, 0.0, -0.0, 1.5, -2.0]],
            [[INF, 1.0, 1.0, -INF, NAN, 1.0, 2.0**-130, 2.0**-133]],
            [[INF, 1.0, 1.0, -INF, NAN, 1.0, 2.0**-130, 2.0**-133]],
        ],
        dtype=np.float32,
    )
    pos = np.array([0, 0, 1])
    y = r(I.to_torch(x, "bf16"), torch.from_numpy(pos))
    yb = I.torch_bits(y)
    assert yb[0, 0, :6].tolist() == [0x0000, 0x8000, 0x8000, 0x0000, 0x0000, 0x0000]
    assert I.to_np(y[0, 0, 6:]).tolist() == [1.5, -2.0]
    row = I.to_np(y[1, 0])
    assert row[0] == INF and np.isnan(row[1]) and np.isnan(row[2]) and row[3] == -INF
    assert np.isnan(row[4]) and np.isnan(row[5])
    assert row[6] == np.float32(2.0**-130) and row[7] == np.float32(2.0**-133)
    row = I.to_np(y[2, 0])
    assert np.all(np.isinf(row[:4])) and np.isnan(row[4]) and np.isnan(row[5])
    assert np.all(row[6:] != 0) and np.all(np.abs(row[6:]) < 2.0**-126)
    I.assert_same_bits(y, I.rope(x, pos, I.to_np(r.cos_sin)), "RoPE specials")


def test_rope_rejects_float_positions():
    r = L.Rotary(64, 16)
    with pytest.raises(ValueError, match="positions must be integers"):
        r(torch.zeros(1, 1, 64), torch.tensor([1.7]))


# ---------------------------------------------------------------------------
# The paged KV cache.

POISON = 0x1A2B  # a BF16 pattern no test writes


def kv_data(gen, m, heads, d):
    k = torch.randn(m, heads, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(m, heads, d, generator=gen).to(torch.bfloat16)
    specials = torch.tensor([-0.0, 2.0**-133, INF, -INF, NAN], dtype=torch.bfloat16)
    k.view(-1)[: specials.numel()] = specials
    v.view(-1)[-specials.numel() :] = specials
    return k, v


def expected_cache(cache_bits: np.ndarray, k, v, slots) -> np.ndarray:
    """The insert in NumPy, slot by slot on the bit patterns."""
    out = cache_bits.copy()
    bs = out.shape[2]
    kb, vb = I.torch_bits(k), I.torch_bits(v)
    for i, s in enumerate(np.asarray(slots).tolist()):
        if s < 0:
            continue
        out[s // bs, :, s % bs, : kb.shape[-1]] = kb[i]
        out[s // bs, :, s % bs, kb.shape[-1] :] = vb[i]
    return out


@pytest.mark.parametrize("shape", [(4, 2, 16, 64), (3, 8, 1, 8), (2, 1, 4, 2)])
def test_kv_insert_layout_and_skips(shape, gen):
    """``[num_blocks, kv_heads, block_size, 2D]``, K then V; slot s at block
    s // bs, row s % bs; negative slots skip; every other byte untouched (the
    cache is poisoned first). ``PagedKVCache.insert`` writes ``tensor``
    exactly as ``kv_insert`` does, and ``gather`` returns what was inserted."""
    nb, heads, bs, d2 = shape
    d = d2 // 2
    num_slots = nb * bs
    perm = torch.randperm(num_slots, generator=gen)
    m = min(num_slots, 6)
    slots = perm[:m].clone()
    slots[::3] = -1 - torch.arange(len(slots[::3]))  # skipped rows (-1, -2, ...)
    k, v = kv_data(gen, m, heads, d)
    cache = torch.full(shape, 0, dtype=torch.int16).fill_(POISON).view(torch.bfloat16)
    before = I.torch_bits(cache).copy()
    L.kv_insert(cache, k, v, slots)
    assert np.array_equal(I.torch_bits(cache), expected_cache(before, k, v, slots))

    pc = L.PagedKVCache(nb, heads, bs, d)
    assert pc.tensor.shape == shape and pc.tensor.dtype == torch.bfloat16 and pc.num_slots == num_slots
    pc.tensor.view(torch.int16).fill_(POISON)
    pc.insert(k, v, slots)
    assert np.array_equal(I.torch_bits(pc.tensor), I.torch_bits(cache))
    keep = slots >= 0
    gk, gv = pc.gather(slots[keep])
    assert np.array_equal(I.torch_bits(gk), I.torch_bits(k[keep]))
    assert np.array_equal(I.torch_bits(gv), I.torch_bits(v[keep]))
    gk2, _ = pc.gather(slots[keep].reshape(1, -1))  # any leading shape
    assert gk2.shape == (1, int(keep.sum()), heads, d)


def test_kv_insert_all_skipped_and_empty(gen):
    cache = torch.zeros(2, 2, 4, 16, dtype=torch.int16).fill_(POISON).view(torch.bfloat16)
    k, v = kv_data(gen, 3, 2, 8)
    L.kv_insert(cache, k, v, torch.tensor([-1, -7, -1]))
    L.kv_insert(cache, k[:0], v[:0], torch.tensor([], dtype=torch.long))
    assert np.all(I.torch_bits(cache) == POISON)
    pc = L.PagedKVCache(2, 2, 4, 8)
    pc.tensor.view(torch.int16).fill_(POISON)
    pc.insert(k, v, torch.tensor([-1, -1, -3]))
    assert np.all(I.torch_bits(pc.tensor) == POISON)


def test_kv_insert_last_slot_and_beyond(gen):
    cache = torch.zeros(2, 2, 4, 16, dtype=torch.bfloat16)
    k, v = kv_data(gen, 2, 2, 8)
    L.kv_insert(cache, k, v, torch.tensor([7, -100]))  # 7 = the last slot; a far negative one skips
    assert np.array_equal(I.torch_bits(cache[1, :, 3, :8]), I.torch_bits(k[0]))
    pc = L.PagedKVCache(2, 2, 4, 8)
    for insert in (lambda *a: L.kv_insert(cache, *a), pc.insert):
        with pytest.raises(ValueError, match="a slot beyond the cache's 8 slots"):
            insert(k, v, torch.tensor([8, 0]))
        with pytest.raises(ValueError, match="a slot beyond the cache's 8 slots"):
            insert(k, v, torch.tensor([-1, 1000]))


def test_kv_insert_shape_validation(gen):
    cache = torch.zeros(2, 2, 4, 16, dtype=torch.bfloat16)
    pc = L.PagedKVCache(2, 2, 4, 8)
    k, v = kv_data(gen, 3, 2, 8)
    bad = [
        (k[:, :1], v[:, :1], torch.tensor([0, 1, 2])),  # heads
        (k[..., :4], v[..., :4], torch.tensor([0, 1, 2])),  # D
        (k, v[:2], torch.tensor([0, 1, 2])),  # v's shape
        (k, v, torch.tensor([0, 1])),  # slots' shape
        (k, v, torch.tensor([[0, 1, 2]])),
    ]
    for insert in (lambda *a: L.kv_insert(cache, *a), pc.insert):
        for args in bad:
            with pytest.raises(ValueError, match=r"the KV insert takes k and v of \[m, 2, 8\] and slots of \[m\]"):
                insert(*args)


def test_kv_insert_rejects_duplicate_slots(gen):
    cache = torch.zeros(2, 2, 4, 16, dtype=torch.bfloat16)
    k, v = kv_data(gen, 3, 2, 8)
    with pytest.raises(ValueError, match="distinct slots"):
        L.kv_insert(cache, k, v, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="distinct slots"):
        L.kv_insert(cache, k, v, torch.tensor([5, -1, 5]))
    pc = L.PagedKVCache(2, 2, 4, 8)
    with pytest.raises(ValueError, match="distinct slots"):
        pc.insert(k, v, torch.tensor([0, 7, 0]))
    # Repeated negative slots are fine: they write nothing.
    L.kv_insert(cache, k, v, torch.tensor([-1, 2, -1]))
    pc.tensor.view(torch.int16).fill_(POISON)
    pc.insert(k, v, torch.tensor([-1, -1, -1]))
    assert np.all(I.torch_bits(pc.tensor) == POISON)


# ---------------------------------------------------------------------------
# o_gate and the MLP activation.


@pytest.mark.parametrize("weight", [False, True])
def test_o_gate_matches_independent(weight, rng):
    d = 64
    norm = L.HeadNorm(d, 1e-6, has_weight=weight)
    w = None
    if weight:
        w = I.random_in(rng, d, "bf16", "normal")
        norm.weight.copy_(I.to_torch(w, "bf16"))
    attn = I.random_in(rng, (5, 8, d), "bf16", "wide")
    gate = I.random_in(rng, (5, 8, d), "bf16", "normal") * np.float32(8)
    gate[0, 0, :5] = [INF, -INF, NAN, -0.0, -100.0]
    y = L.o_gate(I.to_torch(attn, "bf16"), I.to_torch(gate, "bf16"), norm)
    assert y.dtype == torch.bfloat16
    I.assert_same_bits(y, I.o_gate(attn, gate, w), "o_gate")


def test_mlp_activation_matches_independent(rng):
    inter = 512
    mlp = L.GatedMLP(2048, inter)
    gu = I.random_in(rng, (6, 2 * inter), "bf16", "normal") * np.float32(4)
    gu[0, :6] = [INF, -INF, NAN, -0.0, -100.0, 2.0**-130]
    gu[1, inter : inter + 3] = [INF, 0.0, -0.0]
    y = mlp.activation(I.to_torch(gu, "bf16"))
    assert y.dtype == torch.bfloat16 and y.shape == (6, inter)
    I.assert_same_bits(y, I.mlp_activation(gu, inter), "GatedMLP.activation")
    assert np.isnan(I.to_np(y)[0, 1])  # silu_rn(-inf) = -inf * 0 = NaN


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_norms_reject_a_negative_or_nan_eps(eps):
    with pytest.raises(ValueError, match="non-negative"):
        L.RMSNorm(2048, eps=eps)
    with pytest.raises(ValueError, match="non-negative"):
        L.HeadNorm(64, eps=eps)


def test_gated_residual_rejects_mismatched_shapes():
    conn = L.GatedResidual(2048)
    with pytest.raises(ValueError, match="one shape"):
        conn(torch.zeros(2, 2048), torch.zeros(3, 2048))
    with pytest.raises(ValueError, match="one shape"):
        conn(torch.zeros(2, 1024), torch.zeros(2, 1024))
