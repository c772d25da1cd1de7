"""dspark-core's spec of the draft's Markov stage (``spec.markov``) against
an independent NumPy implementation (``_independent``: every rounding done
by hand, the fma exact in integers) written from the spec's docstring and
CUDA 13's ``tanhf`` PTX, on fresh random inputs with planted special
values. The approximate instructions inside ``tanhf`` are nudged the same
way in both (the ``approx`` fixture), so everything around them is pinned.
vLLM's own functions are compared in dspark-vllm's ``test_markov_stock.py``."""

from __future__ import annotations

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.spec import markov

F32 = np.float32
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3.4e38, -3.4e38, 0.6, -0.6, 9.0109,
                    -9.0109, 0.59999996, 9.010899], dtype=F32)


def _bits(t) -> np.ndarray:
    a = np.ascontiguousarray(t.numpy() if isinstance(t, torch.Tensor) else t, dtype=F32)
    return a.view(np.uint32)


def _same(a, b) -> None:
    """Bit for bit, every NaN counting as equal to every NaN (payloads are the device's)."""
    a = np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a, dtype=F32)
    b = np.asarray(b.numpy() if isinstance(b, torch.Tensor) else b, dtype=F32)
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b)), "NaN positions differ"
    diff = np.flatnonzero(_bits(a)[~nan] != _bits(b)[~nan])
    assert diff.size == 0, f"{diff.size} values differ, first {a[~nan][diff[:4]]} vs {b[~nan][diff[:4]]}"


def _bit_const(word: int) -> np.float32:
    return np.array(word, dtype=np.uint32).view(F32)[()]


def independent_tanhf(x, ops: I.Approx = I.STANDIN) -> np.ndarray:
    """CUDA 13's tanhf PTX (nvcc 13.0 -arch=sm_90a, read here independently)."""
    x = np.asarray(x, dtype=F32)
    a = np.abs(x)
    e = ops.ex2_approx_ftz(I._mul(a, _bit_const(0x4038AA3B)))
    r = ops.rcp_approx_ftz(I._add(e, F32(1.0)))
    big = I.fma(r, F32(-2.0), F32(1.0))
    big = np.where(a >= _bit_const(0x41102CB4), F32(1.0), big)
    big = np.copysign(big, x).astype(F32)
    q = I._mul(x, x)
    p = I.fma(_bit_const(0x3C80F082), q, _bit_const(0xBD563CAE))
    p = I.fma(p, q, _bit_const(0x3E085941))
    p = I.fma(p, q, _bit_const(0xBEAAA9ED))
    p = I.fma(p, q, F32(0.0))
    small = I.fma(p, x, x)
    return np.where(a >= _bit_const(0x3F19999A), big, small).astype(F32)


def _values(rng, n: int) -> np.ndarray:
    """Values over every branch of tanhf: tiny, around 0.6, around 9, large; specials planted."""
    scale = rng.choice([1e-3, 0.3, 0.6, 2.0, 9.0, 40.0], size=n)
    x = (rng.standard_normal(n) * scale).astype(F32)
    x[rng.choice(n, SPECIAL.size, replace=False)] = SPECIAL
    return x


@pytest.mark.parametrize("nudged", [False, True])
def test_tanhf_matches_independent(rng, approx, nudged):
    ops = I.perturbed() if nudged else I.STANDIN
    approx(ops)
    x = _values(rng, 4096)
    _same(markov.tanhf(torch.from_numpy(x)), independent_tanhf(x, ops))


def test_tanhf_properties(rng):
    x = _values(rng, 4096)
    y = markov.tanhf(torch.from_numpy(x)).numpy()
    finite = np.isfinite(x)
    # Odd bit for bit, -0.0 kept, the infinities and the saturated range give +-1, NaN stays NaN.
    _same(markov.tanhf(torch.from_numpy(-x)), -y)
    assert _bits(markov.tanhf(torch.tensor([-0.0])))[0] == 0x80000000
    sat = np.abs(x) >= _bit_const(0x41102CB4)
    assert sat.sum() >= 2 and np.array_equal(y[sat], np.sign(x[sat]))
    assert np.isnan(y[np.isnan(x)]).all()
    # Within 2 ulp of tanh where the CPU stand-ins are IEEE (the GPU's ex2/rcp add their own error there).
    exact = np.tanh(x[finite].astype(np.float64))
    err = np.abs(y[finite] - exact) / I.ulp_f32(exact.astype(F32))
    assert err.max() <= 2.0, f"max error {err.max()} ulp"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_bias_rounds_once(gen, dtype):
    a = torch.randn(5, 300, generator=gen) * 4
    b = torch.randn(5, 300, generator=gen) * 4
    a[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-30, 65000.0])
    b[0, :6] = torch.tensor([float("-inf"), 1.0, 0.0, -0.0, -1e-30, 65000.0])
    a, b = a.to(dtype), b.to(dtype)
    got = markov.add_bias(a, b)
    assert got.dtype == dtype
    fmt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    want = I._add(a.float().numpy(), b.float().numpy())
    want = want if fmt == "fp32" else I.round_to(want, fmt)
    _same(got.float(), want)
    assert torch.isnan(got[0, 0]) and got[0, 1] == float("-inf") and _bits(got[0, 3].float())[()] == 0x80000000


@pytest.mark.parametrize("cap", [None, 30.0, 0.7])
@pytest.mark.parametrize("nudged", [False, True])
def test_output_transform(rng, approx, cap, nudged):
    ops = I.perturbed() if nudged else I.STANDIN
    approx(ops)
    mult = float(rng.uniform(0.01, 2.0))
    with np.errstate(over="ignore"):
        raw = I.round_bf16(_values(rng, 2048) * F32(8.0))
    got = markov.output_transform(torch.from_numpy(raw).to(torch.bfloat16), mult, cap)
    x = I._mul(raw, F32(mult))
    if cap is not None:
        c = F32(cap)
        x = I._mul(independent_tanhf(I._mul(x, I._div(F32(1.0), c)), ops), c)
    _same(got, x)


def test_transform_constants_and_refusals():
    m, c, j = markov.transform_constants(1 / 3, 30.0)
    assert (m, c) == (float(F32(1 / 3)), 30.0) and j == float(F32(1.0) / F32(30.0)) and j != 1 / 30
    assert markov.transform_constants(2.0, None) == (2.0, None, None)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="output multiplier"):
            markov.transform_constants(bad, None)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="soft cap"):
            markov.transform_constants(1.0, bad)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        markov.add_bias(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="one dtype and shape"):
        markov.add_bias(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="torch tensor"):
        markov.add_bias([0.0], torch.zeros(1))
    with pytest.raises(ValueError, match="at least one column"):
        markov.argmax(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"\[requests, steps, vocab\]"):
        markov.greedy_loop(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.zeros(4, 2),
                           torch.zeros(3, 2), 1.0, None, None)


def _independent_argmax(y: np.ndarray) -> np.ndarray:
    """A left-to-right scan: a NaN beats everything and the first NaN stays; otherwise strictly greater wins."""
    out = np.zeros(y.shape[0], dtype=np.int64)
    for r, row in enumerate(y):
        best = 0
        for k in range(1, row.size):
            if np.isnan(row[best]):
                break
            if np.isnan(row[k]) or row[k] > row[best]:
                best = k
        out[r] = best
    return out


def _planted_rows(rng, rows: int, v: int) -> np.ndarray:
    """Rows with ties planted: a repeated maximum, -0.0 against +0.0, all -inf, NaN late, NaN twice, -inf mixed."""
    y = rng.standard_normal((rows, v)).astype(F32)
    for r in range(rows):
        kind = r % 7
        if kind == 1:  # the maximum at three places
            top = y[r].max() + 1
            y[r, rng.choice(v, 3, replace=False)] = top
        elif kind == 2:  # -0.0 before +0.0 as the maximum
            y[r] = -np.abs(y[r]) - 1
            i, j = sorted(rng.choice(v, 2, replace=False))
            y[r, i], y[r, j] = -0.0, 0.0
        elif kind == 3:
            y[r] = -np.inf
        elif kind == 4:  # NaN after the maximum, twice
            i, j = sorted(rng.choice(np.arange(1, v), 2, replace=False))
            y[r, 0] = 1e30
            y[r, i] = y[r, j] = np.nan
        elif kind == 5:
            y[r, rng.choice(v, v // 2, replace=False)] = -np.inf
        elif kind == 6:  # +inf ties
            y[r, rng.choice(v, 2, replace=False)] = np.inf
    return y


def test_argmax_tie_and_nan_rule(rng):
    y = _planted_rows(rng, 21, 257)
    got = markov.argmax(torch.from_numpy(y)).numpy()
    assert np.array_equal(got, _independent_argmax(y))
    # torch's CPU argmax follows the same rule (NaN greatest, first index).
    assert np.array_equal(got, torch.from_numpy(y).argmax(-1).numpy())


def _independent_loop(base, prev, w1, w2, mult, cap, d2t, ops=I.STANDIN):
    """The greedy loop with every rounding by hand (BF16 head; the GEMM as float64 dots rounded to BF16, which
    is what F.linear gives on a CPU for these small ranks: exact products, one rounding in float32 first)."""
    rows, n, v = base.shape
    out = np.zeros((rows, n), dtype=np.int64)
    for i in range(n):
        e = w1[prev]  # BF16 values as float32
        bias = torch.from_numpy(e).to(torch.bfloat16) @ torch.from_numpy(w2).to(torch.bfloat16).t()
        bias = bias.float().numpy()[:, :v]
        l = I.round_bf16(I._add(base[:, i], bias))
        x = I._mul(l, F32(mult))
        if cap is not None:
            c = F32(cap)
            x = I._mul(independent_tanhf(I._mul(x, I._div(F32(1.0), c)), ops), c)
        d = _independent_argmax(x)
        t = d + d2t[d]
        out[:, i] = t
        prev = t
    return out


@pytest.mark.parametrize("cap", [None, 20.0])
@pytest.mark.parametrize("rows", [1, 5])
def test_greedy_loop_matches_independent(rng, approx, cap, rows):
    approx(I.perturbed())
    v_target, v, rank, n = 300, 200, 16, 4
    vpad = 256
    w1 = I.round_bf16(rng.standard_normal((v_target, rank)).astype(F32))
    w2 = I.round_bf16(rng.standard_normal((vpad, rank)).astype(F32))
    base = I.round_bf16(rng.standard_normal((rows, n, v)).astype(F32) * 3)
    base[:, 1] = _planted_rows(rng, rows, v)[:, :v] if rows > 1 else base[:, 1]
    base = I.round_bf16(base)
    d2t = (np.sort(rng.choice(v_target, v, replace=False)) - np.arange(v)).astype(np.int64)
    prev = rng.integers(0, v_target, rows)
    got = markov.greedy_loop(torch.from_numpy(base).to(torch.bfloat16), torch.from_numpy(prev),
                             torch.from_numpy(w1).to(torch.bfloat16), torch.from_numpy(w2).to(torch.bfloat16),
                             0.25, cap, torch.from_numpy(d2t))
    want = _independent_loop(base, prev, w1, w2, 0.25, cap, d2t, I.perturbed())
    assert got.dtype == torch.int64 and np.array_equal(got.numpy(), want)
