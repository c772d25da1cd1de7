"""CPU tests of the stock layers (``dspark_core.spec.layers``): each BIT FOR BIT
against the independent NumPy implementation (``_independent.py``), on special
rows, against float64 mathematics within derived bounds, and on every
ValueError it raises. ``u = 2**-24``.

Where a layer meets an approximate GPU instruction (the norms' reciprocal
square roots, the o-gate's sqrt / ex2 / reciprocals, the activation's
``expf``) the CPU runs the documented IEEE stand-in; each such layer is
checked twice: with the stand-in (the independent implementation computes the
same stand-in), and with a perturbed instruction injected into the spec and
the independent implementation alike (``approx`` fixture), its inputs recorded
and compared bit for bit, so everything around the instruction is pinned
whatever the GPU returns.
"""

from __future__ import annotations

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.contracts.constants import norm_constants as _norm_constants
from dspark_core.reference.adapter import norm_description
from dspark_core.spec import layers as L

ARCHS = ["sm_90a", "sm_100a"]
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
U = 2.0**-24
INF, NAN = float("inf"), float("nan")
# Input dtype -> the kind of random data it gets (FP16 cannot hold 'wide').
IN_KINDS = {"bf16": "wide", "fp16": "normal", "fp32": "mixed"}


def t32(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True))


def make_norm(rng, h, *, arch="sm_90a", has_weight=True, wdt="bf16", center=0.0, before=False, out="bf16",
              eps=1e-6, wkind="normal"):
    """A spec RMSNorm with a random weight, and that weight as float32 values."""
    norm = L.RMSNorm(
        h, eps, has_weight=has_weight, weight_dtype=DT[wdt], gain_center=center, weight_before_norm=before,
        out_dtype=DT[out], arch=arch,
    )
    w = None
    if has_weight:
        w = I.random_in(rng, h, wdt, wkind)
        norm.weight.copy_(I.to_torch(w, wdt))
    return norm, w


def np_norm(norm: L.RMSNorm, w, x, out=None, ops=I.STANDIN):
    """The independent RMSNorm with ``norm``'s settings."""
    return I.rmsnorm(
        x, w, arch=norm.arch, eps=norm.eps, gain_center=norm.gain_center, weight_before=norm.weight_before_norm,
        out=out or I.fmt_of(torch.empty(0, dtype=norm.out_dtype)), ops=ops,
    )


# ---------------------------------------------------------------------------
# RMSNorm: bitwise against the independent CTA.

NORM_VARIANTS = [
    dict(has_weight=False),
    dict(wdt="bf16", center=0.0, before=False),
    dict(wdt="bf16", center=1.0, before=False),
    dict(wdt="bf16", center=1.0, before=True),
    dict(wdt="fp16", center=0.0, before=True),
    dict(wdt="fp32", center=1.0, before=True, eps=1e-5),
    dict(wdt="fp32", center=0.5, before=False, eps=1e-5),
    dict(wdt="bf16", center=-1.0, before=True, eps=0.0),
]


@pytest.mark.parametrize("variant", range(len(NORM_VARIANTS)))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h", [2048, 6144, 8192])
def test_rmsnorm_matches_independent(h, arch, variant, rng):
    for out, (in_fmt, kind) in zip(("bf16", "fp16", "fp32"), IN_KINDS.items()):
        norm, w = make_norm(rng, h, arch=arch, out=out, **NORM_VARIANTS[variant])
        m = int(rng.integers(1, 4))
        x = I.random_in(rng, (m, h), in_fmt, kind)
        got = norm(I.to_torch(x, in_fmt))
        assert got.dtype == DT[out] and got.shape == (m, h)
        I.assert_same_bits(got, np_norm(norm, w, x), f"RMSNorm H={h} {arch} {NORM_VARIANTS[variant]} in={in_fmt}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", [0, 1, 3, 5])
def test_rmsnorm_special_rows(arch, variant, rng):
    """Rows of -0.0 (and +0.0), subnormals, +-inf, NaN, near-overflow values
    (their squares overflow: s = inf, r = rsqrt(inf) = +0), all -0.0; the
    weight holds -0.0, +0.0, a subnormal and -2."""
    h = 8192
    norm, w = make_norm(rng, h, arch=arch, **NORM_VARIANTS[variant])
    if w is not None:
        w[:4] = I.round_to(np.float32([-0.0, 0.0, 2.0**-130, -2.0]), I.fmt_of(norm.weight))
        norm.weight.copy_(I.to_torch(w, I.fmt_of(norm.weight)))
    x = I.special_rows(rng, 8, h, "bf16")
    x[2] = I.random_in(rng, h, "bf16", "normal")
    x[2, 100] = INF  # away from the special weights
    y = norm(I.to_torch(x, "bf16"))
    I.assert_same_bits(y, np_norm(norm, w, x), f"special rows {arch} {NORM_VARIANTS[variant]}")
    yv = I.to_np(y)
    assert np.isnan(yv[3]).all()  # a NaN makes its row NaN
    assert not np.isnan(yv[0]).any() and not np.isnan(yv[1]).any()
    assert np.count_nonzero(yv[1]) > h // 2  # subnormal inputs are scaled, not flushed
    assert np.all(I.torch_bits(y[5]) & 0x7FFF == 0)  # an all -0.0 row: zeros
    # an infinity: s = inf, r = +0: NaN at it (inf * 0), zeros elsewhere
    assert np.isnan(yv[2]).sum() == 1 and np.isnan(yv[2, 100]) and np.all(np.delete(yv[2], 100) == 0)
    if not norm.weight_before_norm:  # near overflow: the squares overflow, r = +0, zeros
        assert np.all(yv[4] == 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_rmsnorm_gain_center_turns_negative_zero_weights_positive(arch):
    """``g = w + gain_center`` is added at run time also for center 0.0: a
    -0.0 weight becomes +0.0, so a negative x gives -0.0 and a positive x
    +0.0 (the raw -0.0 weight would flip both signs); center -0.0 keeps
    -0.0; ``-1 + 1 = +0``."""
    h = 2048
    x = np.ones((1, h), dtype=np.float32)
    x[0, 1::2] = -3.0
    xt = I.to_torch(x, "bf16")
    neg_signs = np.signbit(x[0])
    for center, w_val, gain_bits in [(0.0, -0.0, 0), (-0.0, -0.0, 0x80000000), (1.0, -1.0, 0), (0.0, 0.0, 0)]:
        for before in (False, True):
            for wdt in (torch.bfloat16, torch.float16, torch.float32):
                norm = L.RMSNorm(h, gain_center=center, weight_before_norm=before, weight_dtype=wdt,
                                 out_dtype=torch.float32, arch=arch)
                norm.weight.fill_(w_val)
                assert np.all(I.torch_bits(norm.gain()) == gain_bits), (center, w_val)
                y = norm(xt)
                # after: g * (r x); before: v = g x (zeros), s = 0, y = r v: either way zeros of sign(g) ^ sign(x)
                expect = np.where(neg_signs ^ bool(gain_bits), 0x80000000, 0).astype(np.uint32)
                assert np.array_equal(I.torch_bits(y[0]), expect), (center, w_val, before)
                I.assert_same_bits(y, np_norm(norm, I.to_np(norm.weight), x), "gain center")


def test_rmsnorm_gain_rounds_the_center_to_fp32_first():
    """``c`` is an FP32 runtime parameter: with w = 1 and c = 2**-24 +
    2**-80, c rounds to 2**-24 and 1 + 2**-24 ties to 1.0."""
    norm = L.RMSNorm(2048, weight_dtype=torch.float32, gain_center=2.0**-24 + 2.0**-80)
    assert norm.gain()[0].item() == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_rmsnorm_eps_and_ftz(arch):
    """``eps`` is rounded to FP32 once and added inside the fma; eps = 0 on a
    zero row gives NaN (0 * rsqrt(+0) = 0 * inf); a row whose ``fma(s, 1/H,
    eps)`` is subnormal is flushed by rsqrt.approx.ftz: +inf, so its nonzero
    entries become +-inf and its zeros NaN."""
    h = 8192
    z = L.RMSNorm(h, 0.0, has_weight=False, out_dtype=torch.float32, arch=arch)
    assert torch.isnan(z(torch.zeros(1, h, dtype=torch.bfloat16))).all()
    x = np.zeros((1, h), dtype=np.float32)
    x[0, :4] = [2.0**-60, -(2.0**-60), 2.0**-62, 0.0]  # s ~ 2**-119, s / 8192 ~ 2**-132: subnormal
    y = z(I.to_torch(x, "bf16")).numpy()
    assert y[0, 0] == INF and y[0, 1] == -INF and y[0, 2] == INF and np.isnan(y[0, 3])
    e = L.RMSNorm(h, 1e-6, has_weight=False, out_dtype=torch.float32, arch=arch)
    one = np.zeros((1, h), dtype=np.float32)
    one[0, 0] = 1.0  # s = 1: v = fma(1, 2**-13, f32(1e-6))
    got = e(I.to_torch(one, "bf16"))[0, 0].item()
    v = I.fma(np.float32(1.0), np.float32(2.0**-13), I.f32(1e-6))
    assert got == float(I.STANDIN.rsqrt_approx_ftz(v))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", [0, 2, 3, 6])
def test_rmsnorm_around_an_injected_rsqrt(arch, variant, rng, approx):
    """A perturbed rsqrt.approx.ftz injected into both implementations: the
    spec calls it once, on exactly ``fma(s, 1/H, eps)`` of the stock tree,
    and everything after it matches bit for bit."""
    ops, record = I.perturbed(), {}
    approx(ops, record)
    h = 8192
    norm, w = make_norm(rng, h, arch=arch, **NORM_VARIANTS[variant])
    x = np.concatenate([I.random_in(rng, (3, h), "bf16", "normal"), I.special_rows(rng, 7, h, "bf16")])
    y = norm(I.to_torch(x, "bf16"))
    I.assert_same_bits(y, np_norm(norm, w, x, ops=ops), f"injected rsqrt {arch}")
    assert list(record) == ["rsqrt_approx_ftz"] and len(record["rsqrt_approx_ftz"]) == 1
    g = None if w is None else I._add(w, I.f32(norm.gain_center))
    scaled = g is not None and norm.weight_before_norm
    v = I._mul(g, x) if scaled else x
    s = I.row_sum_of_squares(v, arch, scaled)
    I.assert_same_bits(t32(record["rsqrt_approx_ftz"][0]), I.fma(s, I.f32(1.0 / h), I.f32(norm.eps)),
                       "rsqrt's input")


def _tree_telling_rows(h: int) -> torch.Tensor:
    """BF16 rows built so the two archs' row trees round differently (no
    luck involved): in every thread's 32 elements the first (even) one is
    ``1 + k/128`` and every odd one is ``2^-12`` (square ``2^-24``, half an
    ulp of 1). sm_90a's leaves ``fma(e0, e0, e1^2)`` absorb each small
    square into the big one, sm_100a sums the odd squares apart first and
    keeps them, so each thread's sum, and the row's, differ by an ulp;
    the rsqrt and the scaling keep that difference in some of the 16 rows."""
    col = torch.arange(h)
    idx = 8 * (col // 2048) + col % 8  # the thread's element index (numerics.thread_elements)
    rows = torch.zeros(16, h)
    rows[:, idx % 2 == 1] = 2.0 ** -12
    rows[:, idx == 0] = (1 + torch.arange(16) / 128)[:, None]
    return rows.to(torch.bfloat16)


def test_rmsnorm_arch_follows_the_device_and_changes_bits(rng):
    """``arch=None`` follows the input's device (a CPU tensor: sm_90a) on
    random rows; the two archs' trees give different bits on rows built to
    tell them apart (``_tree_telling_rows``)."""
    h = 8192
    x = I.to_torch(I.random_in(rng, (64, h), "bf16", "normal"), "bf16")
    auto, a90, a100 = (L.RMSNorm(h, has_weight=False, out_dtype=torch.float32, arch=a)
                       for a in (None, "sm_90a", "sm_100a"))
    assert L.stock_arch("cpu") == "sm_90a"
    assert torch.equal(auto(x).view(torch.int32), a90(x).view(torch.int32))
    built = _tree_telling_rows(h)
    assert torch.equal(auto(built).view(torch.int32), a90(built).view(torch.int32))
    assert (a90(built).view(torch.int32) != a100(built).view(torch.int32)).any()


def test_rmsnorm_forward_out_dtype_and_leading_shape(rng):
    h = 4096
    norm, w = make_norm(rng, h, center=1.0)
    x = I.random_in(rng, (2, 3, h), "bf16", "normal")
    got = norm(I.to_torch(x, "bf16"), out_dtype=torch.float32)
    assert got.shape == (2, 3, h) and got.dtype == torch.float32
    I.assert_same_bits(got, np_norm(norm, w, x.reshape(6, h), out="fp32").reshape(2, 3, h), "leading shape")
    I.assert_same_bits(norm(I.to_torch(x[1, 2:3], "bf16")), np_norm(norm, w, x[1, 2:3]), "one row")
    I.assert_same_bits(norm(I.to_torch(x[0, 0], "bf16")), np_norm(norm, w, x[0, :1])[0], "1-D")


def test_rmsnorm_strided_inputs_and_many_rows(rng):
    """Layout does not matter: a column slice of a wider tensor, a transposed
    view and 133 rows give the bits of the contiguous rows."""
    h = 2048
    norm, w = make_norm(rng, h, wdt="fp32", center=1.0, before=True, out="fp32")
    big = I.random_in(rng, (133, 2 * h), "bf16", "wide")
    x = big[:, h:]
    expect = np_norm(norm, w, np.ascontiguousarray(x))
    I.assert_same_bits(norm(I.to_torch(big, "bf16")[:, h:]), expect, "column slice, 133 rows")
    xt = I.to_torch(np.ascontiguousarray(x[:5].T), "bf16").t()
    assert not xt.is_contiguous()
    I.assert_same_bits(norm(xt), expect[:5], "transposed view")


def rmsnorm_bound(h: int, before: bool) -> float:
    """The relative error bound (CPU stand-in) of the FP32 ``y`` against
    float64 math on the same inputs, gain and eps: the tree has at most
    d = log2(H/256) + 10 roundings per term (test_numerics), the fma one
    more, the IEEE square root halves that and adds u, the reciprocal adds u:
    (d + 1)/2 u + 2u; ``x * r`` and ``* g`` add u each. Weight before: ``g *
    x`` rounds each entry (u, moving the normalized value by <= 2u) and no
    final product. ``1.001`` covers second-order terms."""
    d = int(np.log2(h // 256)) + 10
    return ((d + 1) / 2 + (6 if before else 4)) * U * 1.001


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", [0, 2, 5])
def test_rmsnorm_accuracy(arch, variant, rng):
    """``|y - y64| <= B |y64|`` (FP32 out) and within ``half_ulp_bf16 +
    B`` for BF16 out."""
    h = 8192
    for out in ("fp32", "bf16"):
        norm, w = make_norm(rng, h, arch=arch, out=out, **NORM_VARIANTS[variant])
        before = norm.weight_before_norm
        x = I.random_in(rng, (4, h), "bf16", "normal")
        y = I.to_np(norm(I.to_torch(x, "bf16"))).astype(np.float64)
        xd = x.astype(np.float64)
        g = None if w is None else I.to_np(norm.gain()).astype(np.float64)
        if g is not None and before:
            xd = xd * g
        y64 = xd / np.sqrt(np.mean(xd * xd, axis=1, keepdims=True) + float(np.float32(norm.eps)))
        if g is not None and not before:
            y64 = y64 * g
        b = rmsnorm_bound(h, before)
        bound = b * np.abs(y64) + (I.half_ulp(np.abs(y64) * (1 + b), out) if out != "fp32" else 0)
        err = np.abs(y - y64)
        assert np.all(err <= bound), float((err / np.maximum(bound, 1e-300)).max())


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


def test_rmsnorm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="a weightless norm cannot scale its input by a weight"):
        L.RMSNorm(2048, has_weight=False, weight_before_norm=True)
    with pytest.raises(ValueError, match=r"spec describes\) must be one of sm_90a, sm_100a, not sm_80"):
        L.RMSNorm(2048, arch="sm_80")
    norm = L.RMSNorm(4096)
    with pytest.raises(ValueError, match=r"RMSNorm\(4096\) takes rows of 4096 columns, not 2048"):
        norm(torch.zeros(2, 2048, dtype=torch.bfloat16))
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(ValueError, match="output dtype"):
            norm(torch.ones(1, 4096, dtype=torch.bfloat16), out_dtype=dtype)


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_norms_reject_a_negative_or_nan_eps(eps):
    with pytest.raises(ValueError, match="non-negative"):
        L.RMSNorm(2048, eps=eps)
    with pytest.raises(ValueError, match="non-negative"):
        L.HeadNorm(64, eps=eps)


def test_norm_constants_separate_the_gain_center_signs():
    """Equal NormConstants must mean equal bits: centers 0.0 and -0.0 give
    different bits for -0.0 weights (g = +0 vs -0), so their constants
    differ; equal centers give equal constants and bits."""
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
# GatedResidual and the residual boundary.


def random_residual(rng, h):
    conn = L.GatedResidual(h)
    alpha = I.random_in(rng, h, "fp32", "normal")
    beta = I.random_in(rng, h, "fp32", "wide")
    conn.alpha.copy_(t32(alpha))
    conn.beta.copy_(t32(beta))
    return conn, alpha, beta


def test_gated_residual_matches_independent(rng):
    h = 8192
    conn, alpha, beta = random_residual(rng, h)
    for s_fmt, b_fmt in [("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "fp32")]:
        stream = I.sprinkle(rng, I.random_in(rng, (3, h), s_fmt, "mixed"), s_fmt, 0.01)
        branch = I.sprinkle(rng, I.random_in(rng, (3, h), b_fmt, "mixed"), b_fmt, 0.01)
        got = conn(I.to_torch(stream, s_fmt), I.to_torch(branch, b_fmt))
        assert got.dtype == torch.float32
        I.assert_same_bits(got, I.gated_residual(stream, branch, alpha, beta), f"GatedResidual {s_fmt}/{b_fmt}")


def test_gated_residual_special_values():
    """Zeros' signs (``-0 + -0 = -0``, ``-0 + +0 = +0``), ``0 * inf = NaN``,
    ``inf - inf = NaN``, subnormal products kept, the sum overflowing."""
    h = 2048
    conn = L.GatedResidual(h)
    stream = np.zeros((1, h), dtype=np.float32)
    branch = np.zeros((1, h), dtype=np.float32)
    stream[0, 0], branch[0, 0] = -0.0, -0.0
    stream[0, 1], branch[0, 1] = -0.0, 0.0
    stream[0, 2], branch[0, 2] = INF, -INF
    stream[0, 3], branch[0, 3] = 2.0**-140, 2.0**-133
    conn.alpha.data[4] = 0.0
    stream[0, 4] = INF
    conn.alpha.data[5] = 2.0**-100
    stream[0, 5] = 2.0**-30
    stream[0, 6], branch[0, 6] = 3.0e38, 3.0e38  # overflows to +inf
    y = conn(t32(stream), I.to_torch(I.round_bf16(branch), "bf16"))
    yb = I.torch_bits(y)[0]
    assert yb[0] == 0x80000000 and yb[1] == 0
    assert np.isnan(y[0, 2].item()) and np.isnan(y[0, 4].item()) and y[0, 6].item() == INF
    assert y[0, 3].item() == 2.0**-140 + 2.0**-133 and y[0, 5].item() == 2.0**-130
    I.assert_same_bits(y, I.gated_residual(stream, I.round_bf16(branch), I.to_np(conn.alpha), I.to_np(conn.beta)),
                       "GatedResidual specials")


def test_gated_residual_rejects_mismatched_shapes():
    conn = L.GatedResidual(2048)
    with pytest.raises(ValueError, match="one shape"):
        conn(torch.zeros(2, 2048), torch.zeros(3, 2048))
    with pytest.raises(ValueError, match="one shape"):
        conn(torch.zeros(2, 1024), torch.zeros(2, 1024))


BOUNDARY_CASES = [
    # post variant, pre variant, stream fmt, out fmt
    (dict(wdt="bf16"), dict(wdt="bf16"), "fp32", "bf16"),
    (dict(wdt="bf16", center=1.0), dict(wdt="fp32", center=1.0, before=True), "bf16", "bf16"),
    (dict(has_weight=False), dict(wdt="fp16", eps=1e-5), "fp32", "fp32"),
    (dict(wdt="fp32", before=True, eps=0.0), dict(has_weight=False), "bf16", "fp16"),
]


def make_boundary(rng, h, arch, post_cfg, pre_cfg):
    post, w_post = make_norm(rng, h, arch=arch, out="fp32", **post_cfg)  # its out dtype is overridden to BF16
    pre, w_pre = make_norm(rng, h, arch=arch, **pre_cfg)
    conn, alpha, beta = random_residual(rng, h)
    post_kw = dict(weight=w_post, eps=post.eps, gain_center=post.gain_center, weight_before=post.weight_before_norm)
    pre_kw = dict(weight=w_pre, eps=pre.eps, gain_center=pre.gain_center, weight_before=pre.weight_before_norm)
    return (post, conn, pre), (post_kw, pre_kw, alpha, beta)


@pytest.mark.parametrize("case", range(len(BOUNDARY_CASES)))
@pytest.mark.parametrize("arch", ARCHS)
def test_residual_boundary_matches_independent(arch, case, rng):
    h = 8192
    post_cfg, pre_cfg, s_fmt, out = BOUNDARY_CASES[case]
    mods, (post_kw, pre_kw, alpha, beta) = make_boundary(rng, h, arch, post_cfg, pre_cfg)
    m = int(rng.integers(1, 4))
    branch = np.concatenate([I.random_in(rng, (m, h), "bf16", "wide"), I.special_rows(rng, 7, h, "bf16")])
    stream = I.sprinkle(rng, I.random_in(rng, (m + 7, h), s_fmt, "normal"), s_fmt, 0.001)
    new_stream, y = L.residual_boundary(*mods, I.to_torch(branch, "bf16"), I.to_torch(stream, s_fmt),
                                        out_dtype=DT[out])
    e_stream, e_out = I.residual_boundary(branch, stream, post_kw, pre_kw, alpha, beta, out=out, arch=arch)
    assert new_stream.dtype == torch.float32 and y.dtype == DT[out]
    I.assert_same_bits(new_stream, e_stream, "boundary new_stream")
    I.assert_same_bits(y, e_out, "boundary out")


@pytest.mark.parametrize("arch", ARCHS)
def test_residual_boundary_around_injected_rsqrts(arch, rng, approx):
    """Both norms' rsqrt.approx.ftz perturbed: two calls, on the post-norm's
    and the pre-norm's ``fma(s, 1/H, eps)``; the boundary matches."""
    ops, record = I.perturbed(), {}
    approx(ops, record)
    h = 8192
    mods, (post_kw, pre_kw, alpha, beta) = make_boundary(rng, h, arch, *BOUNDARY_CASES[1][:2])
    branch = I.random_in(rng, (4, h), "bf16", "normal")
    stream = I.random_in(rng, (4, h), "bf16", "normal")
    new_stream, y = L.residual_boundary(*mods, I.to_torch(branch, "bf16"), I.to_torch(stream, "bf16"))
    e_stream, e_out = I.residual_boundary(branch, stream, post_kw, pre_kw, alpha, beta, arch=arch, ops=ops)
    assert len(record["rsqrt_approx_ftz"]) == 2
    I.assert_same_bits(new_stream, e_stream, "new_stream")
    I.assert_same_bits(y, e_out, "out")


def test_residual_boundary_special_values(rng):
    """BF16 branch read as is: an infinity in the branch makes the post-norm
    NaN at that column (and +-0 elsewhere), the new stream NaN there only,
    and the whole pre-norm row NaN; a NaN in the stream does the same; -0.0
    branch and stream rows give a -0.0 stream."""
    h = 2048
    mods, (post_kw, pre_kw, alpha, beta) = make_boundary(rng, h, "sm_90a", dict(wdt="bf16"), dict(wdt="bf16"))
    mods[0].weight.copy_(mods[0].weight.abs() + 0.5)  # positive post gains: -0.0 stays -0.0
    post_kw["weight"] = I.to_np(mods[0].weight)
    mods[1].alpha.fill_(1.0)
    mods[1].beta.fill_(1.0)
    alpha, beta = np.ones(h, np.float32), np.ones(h, np.float32)
    branch = I.random_in(rng, (4, h), "bf16", "normal")
    stream = I.random_in(rng, (4, h), "fp32", "normal")
    branch[0, 10] = INF
    stream[1, 20] = NAN
    branch[2] = -0.0
    stream[2] = -0.0
    branch[3] = I.round_bf16(np.full(h, 2.0**-130))
    stream[3] = 0.0
    new_stream, y = L.residual_boundary(*mods, I.to_torch(branch, "bf16"), t32(stream))
    ns = new_stream.numpy()
    assert np.isnan(ns[0, 10]) and np.isfinite(np.delete(ns[0], 10)).all() and torch.isnan(y[0]).all()
    assert np.isnan(ns[1, 20]) and torch.isnan(y[1]).all()
    assert np.all(I.f32_bits(ns[2]) == 0x80000000)
    assert np.all(ns[3] != 0)  # the subnormal branch was normalized (x * rsqrt(eps)), not flushed
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
    assert r.cos_sin.dtype == torch.float32  # the default: vLLM's rope_use_fp32_in_outer_product
    x = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    for bad in ([-1, 0], [0, 16], [3, 100]):
        with pytest.raises(ValueError, match=r"RoPE positions must lie in \[0, 16\)"):
            r(x, torch.tensor(bad))
    with pytest.raises(ValueError, match="positions must be integers"):
        r(x, torch.tensor([1.7, 0.0]))
    with pytest.raises(ValueError, match="one position per row"):
        r(x, torch.tensor([1]))
    r(x, torch.tensor([0, 15]))
    assert r(x[:0], torch.tensor([], dtype=torch.long)).shape == (0, 1, 64)


@pytest.mark.parametrize("table", ["bf16", "fp32"])
def test_rope_table_layout_and_accuracy(table):
    """``[max_position, D]``: cos in columns j < D/2, sin in D/2 + j; row 0 is
    exactly (1, ..., 1, 0, ..., 0); every entry within half an ulp of the
    table format plus half an FP32 ulp (the BF16 table goes through FP32)
    plus 2**-40 of the float64 values."""
    d, p, theta = 64, 4096, 10000.0
    r = L.Rotary(d, p, theta, table_dtype=DT[table])
    tab = r.cos_sin
    assert tab.shape == (p, d) and tab.dtype == DT[table] and tab.is_contiguous()
    t = I.to_np(tab).astype(np.float64)
    assert np.all(t[0, : d // 2] == 1.0) and np.all(I.torch_bits(tab[0, d // 2 :]) == 0)
    ref = I.rope_table_f64(d, p, theta)
    slack = I.half_ulp(ref, table) + (I.half_ulp(ref, "fp32") if table == "bf16" else 0) + 2.0**-40
    assert np.all(np.abs(t - ref) <= slack)


def test_rope_bf16_table_and_the_context_table_round_through_fp32():
    """A BF16 table is float64 -> FP32 -> BF16 (two roundings: at [1247, 59]
    sin = 0.501953140203 is stored as 0.5, once-rounded it would be
    0.50390625); ``context_table`` (the stock rotary op's cast of the FP32
    cache to the keys' BF16) is the same bits."""
    d, p = 64, 4096
    r16 = L.Rotary(d, p, table_dtype=torch.bfloat16)
    r32 = L.Rotary(d, p)
    j = torch.arange(d // 2, dtype=torch.float64)
    angles = torch.arange(p, dtype=torch.float64)[:, None] * (10000.0 ** (-2.0 * j / d))[None, :]
    f64 = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).numpy()  # torch's own float64 values
    twice = I.round_once_f64(I.round_once_f64(f64, "fp32").astype(np.float64), "bf16")
    I.assert_same_bits(r16.cos_sin, twice, "BF16 table vs float64 rounded to FP32 then BF16")
    assert r16.cos_sin[1247, 59].item() == 0.5
    ctx = r32.context_table()
    assert ctx.dtype == torch.bfloat16
    I.assert_same_bits(ctx, twice, "context table")
    I.assert_same_bits(r16.context_table(), twice, "context table of a BF16 table")


@pytest.mark.parametrize("table", ["bf16", "fp32"])
@pytest.mark.parametrize("d", [2, 8, 64, 128])
def test_rope_matches_independent(d, table, rng):
    """``rotate``: ``x' = fma(c, x, -RN(s y))``, ``y' = fma(s, x, RN(c y))``
    in FP32; ``forward`` rounds it to BF16; an explicit table overrides."""
    p = 3000
    r = L.Rotary(d, p, theta=500000.0 if d == 128 else 10000.0, table_dtype=DT[table])
    tab = I.to_np(r.cos_sin)
    for in_fmt in ("bf16", "fp32"):
        m = int(rng.integers(1, 9))
        x = I.sprinkle(rng, I.random_in(rng, (m, 4, d), in_fmt, "normal"), in_fmt, 0.02)
        pos = rng.integers(0, p, m)
        pos[0], pos[-1] = 0, p - 1
        xt, pt = I.to_torch(x, in_fmt), torch.from_numpy(pos)
        rot = r.rotate(xt, pt)
        assert rot.dtype == torch.float32
        I.assert_same_bits(rot, I.rotate(x, pos, tab), f"rotate D={d} table={table} in={in_fmt}")
        I.assert_same_bits(r(xt, pt), I.rope(x, pos, tab), f"RoPE D={d} table={table} in={in_fmt}")
        I.assert_same_bits(r(xt, pt.int()), I.rope(x, pos, tab), "int32 positions")
    other = L.Rotary(d, p, table_dtype=torch.bfloat16).cos_sin
    I.assert_same_bits(r.rotate(xt, pt, other), I.rotate(x, pos, I.to_np(other)), "explicit table")


def test_rope_is_the_fma_form(rng):
    """The fma form differs from the plainly rounded ``a c - b s`` in some
    FP32 outputs (so the comparison above has teeth)."""
    d, p = 64, 4096
    r = L.Rotary(d, p)
    x = I.random_in(rng, (64, 8, d), "fp32", "normal")
    pos = rng.integers(0, p, 64)
    rot = r.rotate(t32(x), torch.from_numpy(pos)).numpy()
    tab = I.to_np(r.cos_sin)[pos]
    c, s = tab[:, None, : d // 2], tab[:, None, d // 2 :]
    plain = I._sub(I._mul(c, x[..., 0::2]), I._mul(s, x[..., 1::2]))
    assert (I.f32_bits(plain) != I.f32_bits(rot[..., 0::2])).mean() > 0.01


@pytest.mark.parametrize("table", ["bf16", "fp32"])
def test_rope_accuracy(table, rng):
    """Against float64 rotation by the exact angle: ``|a' - a'64| <=
    (|a| + |b|)(dt + 3u)(1 + 2**-8) + half_ulp_bf16(|a'64| + (|a|+|b|)(dt+3u))``
    with dt the table's relative error (2**-9 + 2**-25 for BF16, 2**-24 for
    FP32, plus 2**-40 for the float64 angles)."""
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
    zeros: (-0, -0) -> (+0, -0), (-0, +0) -> (-0, +0), (+0, -0) -> (+0, +0);
    an infinity's partner becomes inf * 0 = NaN. At a position with c, s != 0
    an infinity gives two infinities; NaN spreads to its pair; BF16
    subnormals are rotated, not flushed."""
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


# ---------------------------------------------------------------------------
# The head norms: the fused QK-norm + RoPE, the context K-norm, the o-gate.


def test_headnorm_is_weightless_and_validated():
    norm = L.HeadNorm(64, 1e-5)
    assert norm.weight is None and norm.head_dim == 64 and norm.eps == 1e-5
    with pytest.raises(ValueError, match="a DSpark head norm takes heads of .*not 48"):
        L.HeadNorm(48)
    x = torch.zeros(2, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the QK-norm takes heads of 64 columns, not 32"):
        L.qk_norm_rope(x, norm)
    with pytest.raises(ValueError, match="the K-norm takes heads of 64 columns, not 32"):
        L.k_norm_context(x, norm)
    with pytest.raises(ValueError, match="the o-norm takes heads of 64 columns, not 32"):
        L.o_gate(x, x, norm)
    y = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the o-gate takes a gate of the attention's shape"):
        L.o_gate(y, y[:1], norm)
    with pytest.raises(ValueError, match="the GPU whose stock the spec describes"):
        L.o_gate(y, y, norm, arch="sm_89")


def special_heads(rng, m, heads, d=64) -> np.ndarray:
    """BF16 heads: random, with one head each of -0.0 (and +0.0), subnormals,
    an infinity, NaN, near-overflow values, and a one-hot."""
    x = I.random_in(rng, (m, heads, d), "bf16", "normal")
    if m * heads >= 6:
        flat = x.reshape(-1, d)
        flat[0, ::2] = -0.0
        flat[0, 1::2] = 0.0
        flat[1] = I.round_bf16(np.exp2(rng.uniform(-133, -127, d)) * np.where(rng.random(d) < 0.5, -1, 1))
        flat[2, 5] = INF
        flat[3, 17] = NAN
        flat[4] = I.round_bf16(np.full(d, 3.0e38) * np.where(rng.random(d) < 0.5, -1, 1))
        flat[5] = 0.0
        flat[5, 9] = -2.0
    return x


@pytest.mark.parametrize("table", [None, "fp32", "bf16"])
def test_qk_norm_rope_matches_independent(table, rng):
    """Lanes of 8 with a sequential fma chain, the 8-lane butterfly, ``fma(S,
    1/64, eps)``, rsqrtf, ``x * r`` in FP32, RoPE on the FP32 values (fma
    form), one BF16 rounding."""
    d, p = 64, 4096
    norm = L.HeadNorm(d, 1e-6)
    rotary = None if table is None else L.Rotary(d, p, table_dtype=DT[table])
    for m, heads in ((1, 8), (7, 2), (16, 10)):
        x = special_heads(rng, m, heads)
        pos = rng.integers(0, p, m)
        got = L.qk_norm_rope(I.to_torch(x, "bf16"), norm, torch.from_numpy(pos), rotary)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        tab = None if rotary is None else I.to_np(rotary.cos_sin)
        I.assert_same_bits(got, I.qk_norm_rope(x, eps=1e-6, positions=pos, table=tab), f"QK-norm table={table}")


def test_qk_norm_rope_special_heads(rng):
    """-0.0 stays -0.0 (x * r, r > 0); a subnormal head's squares underflow
    (S = 0, r = rsqrt(eps)) and it is scaled, not flushed; an infinity makes
    S = inf, r = +0: NaN at it, zeros elsewhere; NaN makes its head NaN; a
    near-overflow head's squares overflow: all zeros."""
    norm = L.HeadNorm(64, 1e-6)
    x = special_heads(rng, 1, 6)
    y = I.to_np(L.qk_norm_rope(I.to_torch(x, "bf16"), norm))[0]
    yb = I.bf16_bits(y)
    assert np.array_equal(yb[0], np.where(np.signbit(x[0, 0]), 0x8000, 0))
    assert np.all(y[1] != 0) and np.array_equal(np.signbit(y[1]), np.signbit(x[0, 1]))
    assert np.isnan(y[2, 5]) and np.all(np.delete(y[2], 5) == 0)
    assert np.isnan(y[3]).all() and np.all(y[4] == 0)
    assert y[5, 9] < -7.0 and np.all(np.delete(y[5], 9) == 0)  # one-hot: -2 * rsqrt(4/64) = -8 (rounded)


def test_qk_norm_rope_around_an_injected_rsqrtf(rng, approx):
    """A perturbed rsqrtf: one call per QK-norm, on exactly the fma chain's
    ``fma(S, 1/64, eps)``, which differs from other summation orders (a
    pairwise tree of rounded squares) in many heads; the output matches."""
    ops, record = I.perturbed(), {}
    approx(ops, record)
    d, p, m, heads = 64, 512, 16, 8
    norm, rotary = L.HeadNorm(d, 1e-5), L.Rotary(d, p)
    x = I.random_in(rng, (m, heads, d), "bf16", "normal")
    pos = rng.integers(0, p, m)
    got = L.qk_norm_rope(I.to_torch(x, "bf16"), norm, torch.from_numpy(pos), rotary)
    I.assert_same_bits(got, I.qk_norm_rope(x, eps=1e-5, positions=pos, table=I.to_np(rotary.cos_sin), ops=ops),
                       "QK-norm, injected rsqrtf")
    assert list(record) == ["rsqrt_approx"]
    v = record["rsqrt_approx"][0]
    chain = np.zeros((m, heads, 8), np.float32)
    for j in range(8):
        e = x[..., np.arange(8) * 8 + j]
        chain = I.fma(e, e, chain)
    s = chain
    for off in (4, 2, 1):
        s = I._add(s, s[..., np.arange(8) ^ off])
    I.assert_same_bits(t32(v), I.fma(s[..., 0], np.float32(1 / 64), I.f32(1e-5)), "rsqrtf's input")
    other = I._tree([I._mul(x[..., i], x[..., i]) for i in range(d)])
    assert (I.f32_bits(I.fma(other, np.float32(1 / 64), I.f32(1e-5))) != I.f32_bits(v)).mean() > 0.05


def test_qk_norm_rope_rotates_fp32_values(rng):
    """RoPE acts on the FP32 normalized values: rounding them to BF16 first
    (what a separate norm and rotary kernel would do) changes some outputs."""
    d, p = 64, 4096
    norm, rotary = L.HeadNorm(d), L.Rotary(d, p)
    x = I.random_in(rng, (64, 8, d), "bf16", "normal")
    pos = torch.from_numpy(rng.integers(0, p, 64))
    fused = L.qk_norm_rope(I.to_torch(x, "bf16"), norm, pos, rotary)
    split = rotary(L.qk_norm_rope(I.to_torch(x, "bf16"), norm), pos)
    assert (fused.view(torch.int16) != split.view(torch.int16)).any()


def test_k_norm_context_matches_independent(rng):
    """ATen's K-norm: ``q = k k``; ``s_l = q_l + q_(l+32)``; shfl_down 16 ..
    1; ``* 2^-6``; ``+ eps``; rsqrtf; ``k r`` rounded to BF16."""
    norm = L.HeadNorm(64, 1e-6)
    for shape in ((1, 1), (7, 2), (37, 4)):
        k = special_heads(rng, *shape)
        got = L.k_norm_context(I.to_torch(k, "bf16"), norm)
        assert got.dtype == torch.bfloat16
        I.assert_same_bits(got, I.k_norm_context(k, eps=1e-6), f"K-norm {shape}")


def test_k_norm_context_around_an_injected_rsqrtf(rng, approx):
    """A perturbed rsqrtf: its input is ATen's ``RN(RN(t * 2^-6) + eps)``
    over ATen's tree, which differs from the fused QK-norm's fma chain in
    many heads; the output matches."""
    ops, record = I.perturbed(), {}
    approx(ops, record)
    norm = L.HeadNorm(64, 1e-5)
    k = I.random_in(rng, (32, 4, 64), "bf16", "normal")
    got = L.k_norm_context(I.to_torch(k, "bf16"), norm)
    I.assert_same_bits(got, I.k_norm_context(k, eps=1e-5, ops=ops), "K-norm, injected rsqrtf")
    v = record["rsqrt_approx"][0]
    q = I._mul(k, k)
    s = I._add(q[..., :32], q[..., 32:])
    for half in (16, 8, 4, 2, 1):
        s = I._add(s[..., :half], s[..., half : 2 * half])
    I.assert_same_bits(t32(v), I._add(I._mul(s[..., 0], np.float32(2.0**-6)), I.f32(1e-5)), "rsqrtf's input")
    chain = {}
    approx(I.STANDIN, chain)
    L.qk_norm_rope(I.to_torch(k, "bf16"), norm)
    assert (I.f32_bits(chain["rsqrt_approx"][0]) != I.f32_bits(v)).mean() > 0.05


def test_head_norm_scale_and_eps_rounding():
    """Where the two roundings differ from one fma (a subnormal mean, eps =
    2**-149): three elements 2**-72 give S = 3 * 2**-144, S / 64 = 1.5 *
    2**-149. The context K-norm (ATen: the mean, then ``+ eps``) rounds the
    mean to 2 * 2**-149 first and adds: 3 * 2**-149; the fused QK-norm's
    ``fma(S, 1/64, eps)`` rounds 2.5 * 2**-149 once: 2 * 2**-149."""
    k = np.zeros((1, 1, 64), np.float32)
    k[0, 0, [0, 9, 40]] = 2.0**-72
    norm = L.HeadNorm(64, 2.0**-149)
    for fn, v in ((L.k_norm_context, 3), (L.qk_norm_rope, 2)):
        y = fn(I.to_torch(k, "bf16"), norm)
        r = I.STANDIN.rsqrt_approx(np.float32(v * 2.0**-149))
        assert I.to_np(y)[0, 0, 0] == I.round_bf16(I._mul(np.float32(2.0**-72), r)), fn.__name__
    I.assert_same_bits(L.k_norm_context(I.to_torch(k, "bf16"), norm), I.k_norm_context(k, eps=2.0**-149), "K")
    I.assert_same_bits(L.qk_norm_rope(I.to_torch(k, "bf16"), norm), I.qk_norm_rope(k, eps=2.0**-149), "QK")


def test_context_rope_uses_the_bf16_table_on_bf16_keys(rng):
    """The context chain rotates the BF16 normalized keys with the BF16 cast
    of the table (``context_table``), then rounds to BF16."""
    d, p = 64, 4096
    rotary = L.Rotary(d, p)
    k = L.k_norm_context(I.to_torch(I.random_in(rng, (40, 2, d), "bf16", "normal"), "bf16"), L.HeadNorm(d))
    pos = rng.integers(0, p, 40)
    got = rotary(k, torch.from_numpy(pos), rotary.context_table())
    expect = I.rope(I.to_np(k), pos, I.to_np(rotary.context_table()))
    I.assert_same_bits(got, expect, "context RoPE")
    assert (I.bf16_bits(expect) != I.torch_bits(rotary(k, torch.from_numpy(pos)))).any()  # the FP32 table differs


O_GATE_SHAPES = [(1, 8), (4, 64), (5, 52), (16, 17)]  # rows m * heads: 8, 256, 260, 272


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", O_GATE_SHAPES)
def test_o_gate_matches_independent(arch, shape, rng):
    """FLA's kernel (sm_90a) and FlashInfer's (sm_100a, 32 lanes x 2 up to
    256 rows, 8 x 8 above), with special heads and gates."""
    m, heads = shape
    attn = special_heads(rng, m, heads)
    gate = I.random_in(rng, (m, heads, 64), "bf16", "normal") * np.float32(8)
    gate.reshape(-1)[:8] = [INF, -INF, NAN, -0.0, -100.0, 100.0, 2.0**-130, -200.0]
    norm = L.HeadNorm(64, 1e-6)
    y = L.o_gate(I.to_torch(attn, "bf16"), I.to_torch(gate, "bf16"), norm, arch=arch)
    assert y.dtype == torch.bfloat16 and y.shape == attn.shape
    I.assert_same_bits(y, I.o_gate(attn, gate, eps=1e-6, arch=arch), f"o_gate {arch} {shape}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", [(2, 8), (5, 60)])
def test_o_gate_around_injected_instructions(arch, shape, rng, approx):
    """Every approximate instruction of the o-gate perturbed: the spec calls
    exactly the documented ones on the documented inputs (the norm's
    ``fma(S, 1/64, eps)``, the gate's ``RN(g * -log2e)``) and matches."""
    ops, record = I.perturbed(), {}
    approx(ops, record)
    attn = I.random_in(rng, shape + (64,), "bf16", "normal")
    gate = I.random_in(rng, shape + (64,), "bf16", "normal") * np.float32(4)
    y = L.o_gate(I.to_torch(attn, "bf16"), I.to_torch(gate, "bf16"), L.HeadNorm(64, 1e-5), arch=arch)
    I.assert_same_bits(y, I.o_gate(attn, gate, eps=1e-5, arch=arch, ops=ops), f"o_gate {arch}, injected")
    z = I._mul(gate, I.NEG_LOG2E)
    if arch == "sm_90a":
        assert sorted(record) == ["ex2_approx", "rcp_full", "sqrt_approx_ftz"] and len(record["rcp_full"]) == 2
        I.assert_same_bits(t32(record["ex2_approx"][0]), z, "ex2's input")
    else:
        assert sorted(record) == ["ex2_approx_ftz", "rcp_approx_ftz", "rsqrt_approx_ftz"]
        I.assert_same_bits(t32(record["ex2_approx_ftz"][0]), z, "ex2's input")
        I.assert_same_bits(t32(record["rcp_approx_ftz"][0]), I._add(ops.ex2_approx_ftz(z), np.float32(1)), "rcp's")


def test_o_gate_trees(rng, approx):
    """The norm's sum (the recorded rsqrt / sqrt input) per arch: FLA's
    (16 lanes of fma leaves, folded) differs from FlashInfer's in many heads;
    FlashInfer's two layouts (32 x 2 up to 256 rows, 8 x 8 above) are one
    tree: an in-thread pairwise sum of contiguous columns, then ascending
    butterflies, is the pairwise tree over the 64 columns in order."""
    attn = I.random_in(rng, (33, 8, 64), "bf16", "normal")
    g = np.zeros_like(attn)
    sums = {}
    for arch, rows in (("sm_90a", 33), ("sm_100a", 32), ("sm_100a", 33)):
        record = {}
        approx(I.STANDIN, record)
        L.o_gate(I.to_torch(attn[:rows], "bf16"), I.to_torch(g[:rows], "bf16"), L.HeadNorm(64), arch=arch)
        key = "sqrt_approx_ftz" if arch == "sm_90a" else "rsqrt_approx_ftz"
        sums[(arch, rows)] = I.f32_bits(record[key][0]).reshape(rows, 8)[:32]
    pairwise = I._tree([I._mul(attn[:32, :, i], attn[:32, :, i]) for i in range(64)])
    expect = I.f32_bits(I.fma(pairwise, np.float32(1 / 64), I.f32(1e-6)))
    assert np.array_equal(sums[("sm_100a", 32)], expect) and np.array_equal(sums[("sm_100a", 33)], expect)
    assert (sums[("sm_90a", 33)] != expect).mean() > 0.05


def test_o_gate_arch_follows_the_device(rng):
    attn = I.to_torch(I.random_in(rng, (3, 4, 64), "bf16", "normal"), "bf16")
    gate = I.to_torch(I.random_in(rng, (3, 4, 64), "bf16", "normal"), "bf16")
    norm = L.HeadNorm(64)
    assert torch.equal(L.o_gate(attn, gate, norm).view(torch.int16),
                       L.o_gate(attn, gate, norm, arch="sm_90a").view(torch.int16))


# ---------------------------------------------------------------------------
# The activation.


def test_silu_and_mul_matches_independent(rng):
    inter = 512
    gu = I.random_in(rng, (6, 2 * inter), "bf16", "normal") * np.float32(4)
    gu[0, :8] = [INF, -INF, NAN, -0.0, -100.0, 2.0**-130, 100.0, -89.0]
    gu[1, inter : inter + 4] = [INF, 0.0, -0.0, NAN]
    gu[2, :inter] = 1.0
    gu[2, inter:] = -0.0
    got = L.silu_and_mul(I.to_torch(gu, "bf16"), inter)
    assert got.dtype == torch.bfloat16 and got.shape == (6, inter)
    I.assert_same_bits(got, I.silu_and_mul(gu, inter), "silu_and_mul")
    y = I.to_np(got)
    assert np.isnan(y[0, 1]) and np.isnan(y[0, 2])  # -inf / (inf + 1) = NaN; NaN
    assert np.all(I.torch_bits(got[2]) == 0)  # silu(1) * (-0.0 + 0.0) = +0.0, not -0.0
    mlp = L.GatedMLP(2048, inter)
    I.assert_same_bits(mlp.activation(I.to_torch(gu, "bf16")), I.silu_and_mul(gu, inter), "GatedMLP.activation")


def test_silu_and_mul_around_an_injected_expf(rng, approx):
    ops, record = I.perturbed(), {}
    approx(ops, record)
    inter = 256
    gu = I.random_in(rng, (8, 2 * inter), "bf16", "normal") * np.float32(4)
    got = L.silu_and_mul(I.to_torch(gu, "bf16"), inter)
    I.assert_same_bits(got, I.silu_and_mul(gu, inter, ops=ops), "silu_and_mul, injected expf")
    assert list(record) == ["expf"]
    I.assert_same_bits(t32(record["expf"][0]), -gu[:, :inter], "expf's input")


def test_silu_and_mul_every_bf16_gate():
    """Every BF16 gate value (all 65536 patterns: zeros, subnormals,
    infinities, NaNs), with up 1.0, -0.0 and -3.5: the spec equals the
    independent ``bf16(RN(x / RN(expf(-x) + 1)))`` times ``RN(up + 0.0)``."""
    x = I.bf16_value(np.arange(2**16, dtype=np.uint32).astype(np.uint16))
    for up in (1.0, -0.0, -3.5):
        gu = np.stack([x, np.full_like(x, up)]).reshape(1, -1)
        got = L.silu_and_mul(I.to_torch(gu, "bf16"), x.size)
        I.assert_same_bits(got, I.silu_and_mul(gu, x.size), f"every BF16 gate, up {up}")


def test_silu_and_mul_rejects_shape():
    with pytest.raises(ValueError, match=r"the activation takes gate-up rows of 2 \* intermediate = 1024 columns"):
        L.silu_and_mul(torch.zeros(2, 1000, dtype=torch.bfloat16), 512)


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
    L.kv_insert(cache, k, v, torch.tensor([-1, 2, -1]))  # repeated negative slots write nothing
    pc.tensor.view(torch.int16).fill_(POISON)
    pc.insert(k, v, torch.tensor([-1, -1, -1]))
    assert np.all(I.torch_bits(pc.tensor) == POISON)
