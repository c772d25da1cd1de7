"""An independent NumPy implementation of the DSpark numeric spec, and the
bit-level helpers the tests compare with.

Nothing here imports ``dspark_core``: it is written from the contracts in the
docstrings of ``numerics.py`` and ``layers.py`` only, in a different style:

- every FP32 operation is done in float64 and the result rounded to float32
  (``_add``, ``_sub``, ``_mul``, ``_div``, ``_sqrt``). For ``+ - * / sqrt`` of
  float32 operands that *is* the correctly rounded float32 result: float64 has
  53 >= 2 * 24 + 2 significant bits, so the double rounding is innocuous
  (Figueroa), subnormal float32 results included (the float64 intermediate of
  float32 operands is never subnormal, and a float32 subnormal has fewer bits);
- the row tree is run the way a 256-thread CTA runs it: a register file
  ``[rows, 256 threads]``, fragment loads by thread id, ``shfl.bfly`` XOR
  butterflies over lanes, the warp sums through "shared memory" and a last
  butterfly of 8 lanes; the head tree is one warp's butterfly over pair lanes;
- BF16 rounding is integer arithmetic on the FP32 bit pattern (round to
  nearest even; NaN handled separately); FP16 rounding is NumPy's own
  float32 -> float16 cast (round to nearest even, subnormals kept);
- ``exp`` scales by ``np.ldexp`` rather than by building exponent bits.

Values are carried as float32 NumPy arrays; a value "rounded to BF16/FP16" is a
float32 array whose values are exactly representable in that format.
"""

from __future__ import annotations

import numpy as np

THREADS = 256
VEC = 8
WARP = 32
CHUNK = THREADS * VEC

F32 = np.float32
F64 = np.float64

# ---------------------------------------------------------------------------
# Rounded FP32 arithmetic (float64 op, then one rounding to float32).


def f32(x) -> np.ndarray:
    """``x`` (any float array or scalar) rounded once to float32."""
    with np.errstate(all="ignore"):
        return np.asarray(x, dtype=F64).astype(F32)


def _w(x) -> np.ndarray:
    """Widen a float32 operand to float64 (exact)."""
    return np.asarray(x, dtype=F32).astype(F64)


def _add(a, b):
    with np.errstate(all="ignore"):
        return (_w(a) + _w(b)).astype(F32)


def _sub(a, b):
    with np.errstate(all="ignore"):
        return (_w(a) - _w(b)).astype(F32)


def _mul(a, b):
    with np.errstate(all="ignore"):
        return (_w(a) * _w(b)).astype(F32)


def _div(a, b):
    with np.errstate(all="ignore"):
        return (_w(a) / _w(b)).astype(F32)


def _sqrt(a):
    with np.errstate(all="ignore"):
        return np.sqrt(_w(a)).astype(F32)


sqrt_rn = _sqrt  # the IEEE square root (float64 sqrt of a float32, rounded once: exact rounding)


def torch_sqrt(a) -> np.ndarray:
    """``torch.sqrt`` of float32 ``a`` on the CPU: NOT correctly rounded on
    this project's torch builds (about 17 % of inputs 1 ulp off with torch
    2.13.0+cpu), which is why the spec has its own ``numerics.sqrt_rn``."""
    import torch

    a = np.ascontiguousarray(a, dtype=F32)
    return torch.sqrt(torch.from_numpy(a.copy())).numpy()


# ---------------------------------------------------------------------------
# Bit patterns and narrow formats.


def f32_bits(a) -> np.ndarray:
    a = np.asarray(a, dtype=F32)
    return np.ascontiguousarray(a).reshape(a.shape).view(np.uint32)


def from_f32_bits(u) -> np.ndarray:
    u = np.asarray(u, dtype=np.uint32)
    return np.ascontiguousarray(u).reshape(u.shape).view(F32)


def bf16_bits(a) -> np.ndarray:
    """The BF16 bit patterns (uint16) of float32 ``a`` rounded to nearest
    even; NaN becomes the quiet NaN 0x7fc0 (its payload is not part of the
    contract)."""
    a = np.asarray(a, dtype=F32)
    u = f32_bits(a).astype(np.uint64)
    lsb = (u >> 16) & 1
    r = ((u + 0x7FFF + lsb) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), r).astype(np.uint16)


def bf16_value(bits16) -> np.ndarray:
    """The float32 value of BF16 bit patterns (exact: zero-extend)."""
    return from_f32_bits(np.asarray(bits16, dtype=np.uint16).astype(np.uint32) << 16)


def round_bf16(a) -> np.ndarray:
    return bf16_value(bf16_bits(a))


def round_fp16(a) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(a, dtype=F32).astype(np.float16).astype(F32)


def round_to(a, fmt: str) -> np.ndarray:
    """``a`` rounded to ``fmt`` ('bf16', 'fp16', 'fp32'), as float32 values."""
    if fmt == "bf16":
        return round_bf16(a)
    if fmt == "fp16":
        return round_fp16(a)
    if fmt == "fp32":
        return np.asarray(a, dtype=F32).copy()
    raise ValueError(fmt)


def bits_of(a, fmt: str) -> np.ndarray:
    """Bit patterns of float32 values exactly representable in ``fmt``
    (uint16 for bf16/fp16, uint32 for fp32)."""
    a = np.asarray(a, dtype=F32)
    if fmt == "bf16":
        return bf16_bits(a)
    if fmt == "fp16":
        with np.errstate(all="ignore"):
            return a.astype(np.float16).view(np.uint16)
    if fmt == "fp32":
        return f32_bits(a)
    raise ValueError(fmt)


def ulp_f32(v) -> np.ndarray:
    """The float32 ulp at the (float64) magnitude ``v``: 2**(e - 23) for
    |v| in [2**e, 2**(e+1)), and 2**-149 in the subnormal range."""
    v = np.abs(np.asarray(v, dtype=F64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    return np.ldexp(1.0, (np.maximum(e, -126) - 23).astype(np.int64))


def half_ulp(v, fmt: str) -> np.ndarray:
    """Half the ``fmt`` spacing at magnitude ``v`` (float64), the rounding
    error bound of one conversion to ``fmt`` (subnormal spacing included)."""
    p, emin = {"bf16": (8, -126), "fp16": (11, -14), "fp32": (24, -126)}[fmt]
    v = np.abs(np.asarray(v, dtype=F64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    return np.ldexp(1.0, (np.maximum(e, emin) - p).astype(np.int64))


# ---------------------------------------------------------------------------
# The row tree, as a 256-thread CTA runs it.


def cta_row_sum(v, return_lanes: bool = False):
    """The row tree of float32 ``v`` ``[m, H]``.

    Thread ``t`` loads, for fragment ``k``, the 8 columns ``k*2048 + t*8 + j``
    into registers, adds them pairwise and accumulates the fragment sums in
    order of ``k``. Each warp then runs a ``shfl.bfly`` butterfly (every lane
    ``l`` adds the register of lane ``l ^ off``, off = 16, 8, 4, 2, 1); lane 0
    of each warp stores its value to shared memory; 8 lanes read the 8 warp
    sums and butterfly with off = 4, 2, 1. Returns ``[m]`` (lane 0), and with
    ``return_lanes`` also the 256 lanes after the warp butterflies and the 8
    lanes after the last one (every lane should hold the same value)."""
    v = np.asarray(v, dtype=F32)
    m, h = v.shape
    if h <= 0 or h % CHUNK:
        raise ValueError(h)
    tid = np.arange(THREADS)
    acc = None
    for k in range(h // CHUNK):
        r = [v[:, k * CHUNK + tid * VEC + j] for j in range(VEC)]  # registers r0..r7, [m, 256]
        frag = _add(_add(_add(r[0], r[1]), _add(r[2], r[3])), _add(_add(r[4], r[5]), _add(r[6], r[7])))
        acc = frag if acc is None else _add(acc, frag)
    for off in (16, 8, 4, 2, 1):  # shfl.bfly within each warp (t ^ off stays in the warp)
        acc = _add(acc, acc[:, tid ^ off])
    lane = tid % WARP
    smem = acc[:, tid[lane == 0]]  # [m, 8]: lane 0 of warps 0..7
    lanes8 = np.arange(THREADS // WARP)
    s = smem
    for off in (4, 2, 1):
        s = _add(s, s[:, lanes8 ^ off])
    if return_lanes:
        return s[:, 0], acc, s
    return s[:, 0]


def cta_thread_sums(v) -> np.ndarray:
    """Steps 1-3 of the row tree only: ``[m, 256]`` thread sums."""
    v = np.asarray(v, dtype=F32)
    m, h = v.shape
    tid = np.arange(THREADS)
    acc = None
    for k in range(h // CHUNK):
        r = [v[:, k * CHUNK + tid * VEC + j] for j in range(VEC)]
        frag = _add(_add(_add(r[0], r[1]), _add(r[2], r[3])), _add(_add(r[4], r[5]), _add(r[6], r[7])))
        acc = frag if acc is None else _add(acc, frag)
    return acc


def cluster_row_sum(v) -> np.ndarray:
    """The row tree as the cluster layout of numerics.py runs it: one
    8-column fragment per hardware thread (H/8 of them), then emulated thread
    ``t`` reads fragments ``t, t + 256, t + 512, ...`` in that order, then the
    same butterflies. Must equal ``cta_row_sum`` bit for bit."""
    v = np.asarray(v, dtype=F32)
    m, h = v.shape
    nfrag = h // VEC
    frag = np.empty((m, nfrag), dtype=F32)
    for f in range(nfrag):  # hardware thread f: its own fragment
        c = v[:, f * VEC : (f + 1) * VEC]
        frag[:, f] = _add(_add(_add(c[:, 0], c[:, 1]), _add(c[:, 2], c[:, 3])),
                          _add(_add(c[:, 4], c[:, 5]), _add(c[:, 6], c[:, 7])))
    emulated = frag[:, 0:THREADS].copy()
    for f0 in range(THREADS, nfrag, THREADS):
        emulated = _add(emulated, frag[:, f0 : f0 + THREADS])
    tid = np.arange(THREADS)
    for off in (16, 8, 4, 2, 1):
        emulated = _add(emulated, emulated[:, tid ^ off])
    s = emulated[:, ::WARP]
    lanes8 = np.arange(8)
    for off in (4, 2, 1):
        s = _add(s, s[:, lanes8 ^ off])
    return s[:, 0]


def warp_head_sum(v) -> np.ndarray:
    """The head tree of float32 ``v`` ``[..., D]``: lane ``j`` (of one warp
    for D <= 64) holds the pair sum ``v[2j] + v[2j+1]``; a butterfly with
    offsets D/4, ..., 1 over the D/2 lanes; lane 0's value."""
    v = np.asarray(v, dtype=F32)
    d = v.shape[-1]
    if d < 2 or d & (d - 1):
        raise ValueError(d)
    lanes = np.arange(d // 2)
    reg = _add(v[..., 2 * lanes], v[..., 2 * lanes + 1])
    off = d // 4
    while off >= 1:
        reg = _add(reg, reg[..., lanes ^ off])
        off //= 2
    return reg[..., 0]


def inv_rms(total, n: int, eps: float, sqrt=None) -> np.ndarray:
    """``1 / sqrt(total / n + eps)``, four rounded operations, ``eps``
    rounded to FP32 once; ``sqrt`` defaults to the IEEE ``sqrt_rn``."""
    var = _add(_div(total, F32(n)), f32(eps))
    return _div(F32(1.0), (sqrt or sqrt_rn)(var))


# ---------------------------------------------------------------------------
# Layers.


def rmsnorm(x, weight=None, *, eps=1e-6, gain_center=0.0, weight_before=False, out="bf16", sqrt=None):
    """RMSNorm of float32 ``x`` ``[m, H]`` with float32 ``weight`` ``[H]``
    (the stored weight widened) or None. ``gain_center`` is taken as an FP32
    constant (the torch spec rounds it to FP32 before the addition)."""
    x = np.asarray(x, dtype=F32)
    h = x.shape[-1]
    g = None if weight is None else _add(weight, f32(gain_center))
    if g is not None and weight_before:
        x = _mul(x, g)
    r = inv_rms(cta_row_sum(_mul(x, x)), h, eps, sqrt)
    y = _mul(x, r[:, None])
    if g is not None and not weight_before:
        y = _mul(y, g)
    return round_to(y, out)


def headnorm(x, weight=None, *, eps=1e-6, sqrt=None):
    """HeadNorm of float32 ``x`` ``[..., D]``, to BF16 values."""
    x = np.asarray(x, dtype=F32)
    d = x.shape[-1]
    r = inv_rms(warp_head_sum(_mul(x, x)), d, eps, sqrt)
    y = _mul(x, r[..., None])
    if weight is not None:
        y = _mul(y, weight)
    return round_bf16(y)


def gated_residual(stream, branch, alpha, beta):
    return _add(_mul(alpha, stream), _mul(beta, branch))


def residual_boundary(branch, stream, post: dict, pre: dict, alpha, beta, out="bf16"):
    """``(new_stream, out)``; ``post``/``pre`` are keyword dicts of
    ``rmsnorm`` (weight, eps, gain_center, weight_before)."""
    p = rmsnorm(branch, **post, out="bf16")
    new_stream = gated_residual(stream, p, alpha, beta)
    return new_stream, rmsnorm(round_bf16(new_stream), **pre, out=out)


def rope_table_f64(head_dim: int, max_position: int, theta: float) -> np.ndarray:
    """The GPT-J table in float64 NumPy: ``[cos(p f_j) | sin(p f_j)]``,
    ``f_j = theta ** (-2j / D)``. NumPy's float64 pow/cos/sin are not torch's:
    an entry can differ in its last float64 bit (see test_layers)."""
    j = np.arange(head_dim // 2, dtype=F64)
    freqs = float(theta) ** (-2.0 * j / head_dim)
    ang = np.arange(max_position, dtype=F64)[:, None] * freqs[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1)


def round_once_f64(v, fmt: str) -> np.ndarray:
    """float64 ``v`` rounded ONCE (nearest even) to ``fmt`` ('bf16' or
    'fp32'; normal range), as float32 values: the significand scaled to an
    integer of the format's width and ``rint``-ed in float64 (exact)."""
    v = np.asarray(v, dtype=F64)
    p = {"bf16": 8, "fp32": 24}[fmt]
    m, e = np.frexp(v)
    return np.ldexp(np.rint(np.ldexp(m, p)), e - p).astype(F32)


def rope(x, positions, table):
    """Rotate float32 ``x`` ``[m, heads, D]`` pair by pair with the float32
    ``table`` rows of ``positions``; BF16 values out."""
    x = np.asarray(x, dtype=F32)
    d = x.shape[-1]
    out = np.empty_like(x)
    rows = np.asarray(table, dtype=F32)[np.asarray(positions)]
    for j in range(d // 2):
        c = rows[:, None, j]
        s = rows[:, None, d // 2 + j]
        a = x[..., 2 * j]
        b = x[..., 2 * j + 1]
        out[..., 2 * j] = _sub(_mul(a, c), _mul(b, s))
        out[..., 2 * j + 1] = _add(_mul(b, c), _mul(a, s))
    return round_bf16(out)


# ---------------------------------------------------------------------------
# exp / sigmoid / silu.

LOG2E, LN2_HI, LN2_LO = from_f32_bits(np.array([0x3FB8AA3B, 0x3F317200, 0x35BFBE8E], dtype=np.uint32))
EXP_COEFFS = [f32(1.0 / f) for f in (720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0)]  # c6 .. c0
EXP_OVERFLOW = F32(88.72283935546875)
EXP_UNDERFLOW = F32(-104.0)


def exp(x) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    nan = np.isnan(x)
    xc = np.where(nan, F32(0.0), np.clip(x, EXP_UNDERFLOW, EXP_OVERFLOW)).astype(F32)
    n = np.rint(_mul(xc, LOG2E)).astype(F32)  # half to even
    r = _sub(_sub(xc, _mul(n, LN2_HI)), _mul(n, LN2_LO))
    p = np.full_like(r, EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        p = _add(_mul(p, r), c)
    n1 = np.floor(n.astype(F64) / 2.0)
    n2 = n.astype(F64) - n1
    out = _mul(_mul(p, f32(np.ldexp(1.0, n1.astype(np.int64)))), f32(np.ldexp(1.0, n2.astype(np.int64))))
    out = np.where(x > EXP_OVERFLOW, F32(np.inf), out)
    out = np.where(x < EXP_UNDERFLOW, F32(0.0), out)
    return np.where(nan, x, out).astype(F32)


def sigmoid(x) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    return _div(F32(1.0), _add(F32(1.0), exp(-x)))


def silu(x) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    return _mul(x, sigmoid(x))


def o_gate(attn, gate, weight=None, eps=1e-6):
    return round_bf16(_mul(headnorm(attn, weight, eps=eps), sigmoid(gate)))


def mlp_activation(gu, intermediate: int):
    g, u = gu[..., :intermediate], gu[..., intermediate:]
    return round_bf16(_mul(silu(g), u))


def attention(q, k, v, valid, lanes: int = 128):
    """The draft's attention for one token and one head, the way a CTA of
    ``lanes`` threads runs it: float32 ``q`` ``[D]``, ``k``/``v`` ``[S, D]``
    (BF16 values), ``valid`` ``[S]`` bool. Thread ``t`` scores its slots
    ``t, t + lanes, ...`` (the head tree, times fp32(1/sqrt(D))), the CTA max
    (NaN wins), then each thread sums ``exp(s - max)`` and ``p * v`` in slot
    order from +0.0; the thread sums are halved like a butterfly; the output is
    ``round_bf16(a / l)``."""
    s_count, d = k.shape
    scale = f32(1.0 / np.sqrt(d))
    scores = np.full(s_count, F32(-np.inf), dtype=F32)
    for j in range(s_count):
        if valid[j]:
            scores[j] = _mul(warp_head_sum(_mul(q, k[j])), scale)
    live = scores[valid]
    mx = F32(np.nan) if np.isnan(live).any() else (live.max() if live.size else F32(-np.inf))
    l_lane = np.zeros(lanes, dtype=F32)
    a_lane = np.zeros((lanes, d), dtype=F32)
    for t in range(lanes):
        for j in range(t, s_count, lanes):
            if valid[j]:
                p = exp(_sub(scores[j], mx))
                l_lane[t] = _add(l_lane[t], p)
                a_lane[t] = _add(a_lane[t], _mul(p, v[j]))
    width = lanes
    while width > 1:
        width //= 2
        l_lane = _add(l_lane[:width], l_lane[width : 2 * width])
        a_lane = _add(a_lane[:width], a_lane[width : 2 * width])
    return round_bf16(_div(a_lane[0], l_lane[0]))


# ---------------------------------------------------------------------------
# Random data.


def random_f32(rng: np.random.Generator, shape, kind: str = "normal") -> np.ndarray:
    """Random float32 data of a few kinds: 'normal' (N(0,1)), 'wide' (random
    signs, magnitudes 2**U(-30, 30), so sums round a lot and order matters),
    'tiny' (magnitudes 2**U(-75, -60): subnormal squares), 'mixed' (wide plus
    exact zeros of both signs and a few subnormals)."""
    if kind == "normal":
        return rng.standard_normal(shape).astype(F32)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if kind == "wide":
        return f32(sign * np.exp2(rng.uniform(-30, 30, shape)))
    if kind == "tiny":
        return f32(sign * np.exp2(rng.uniform(-75, -60, shape)))
    if kind == "mixed":
        a = sign * np.exp2(rng.uniform(-30, 30, shape))
        u = rng.random(shape)
        a = np.where(u < 0.03, sign * 0.0, a)
        a = np.where((u >= 0.03) & (u < 0.05), sign * np.exp2(rng.uniform(-149, -127, shape)), a)
        return f32(a)
    raise ValueError(kind)


def random_in(rng: np.random.Generator, shape, fmt: str, kind: str = "normal") -> np.ndarray:
    """``random_f32`` rounded to ``fmt`` (float32 values)."""
    return round_to(random_f32(rng, shape, kind), fmt)


# ---------------------------------------------------------------------------
# The bridge to torch tensors (bit patterns only; no torch arithmetic).

_FMT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def fmt_of(t) -> str:
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[t.dtype]


def to_torch(vals, fmt: str):
    """A torch tensor of ``fmt`` holding float32 ``vals`` (which must be
    representable in ``fmt``; checked), built from the bit patterns."""
    import torch

    vals = np.ascontiguousarray(vals, dtype=F32)
    if not np.array_equal(round_to(vals, fmt), vals, equal_nan=True):
        raise ValueError(f"values not representable in {fmt}")
    if fmt == "bf16":
        return torch.from_numpy(bf16_bits(vals).view(np.int16).copy()).view(torch.bfloat16)
    if fmt == "fp16":
        return torch.from_numpy(vals.astype(np.float16).view(np.int16).copy()).view(torch.float16)
    return torch.from_numpy(vals.copy())


def to_np(t) -> np.ndarray:
    """The float32 values of a bf16/fp16/fp32 torch tensor, read from its bits."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return bf16_value(t.view(torch.int16).numpy().view(np.uint16))
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.float16).astype(F32)
    if t.dtype == torch.float32:
        return t.numpy().copy()
    raise TypeError(t.dtype)


def torch_bits(t) -> np.ndarray:
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().view(np.uint32)
    raise TypeError(t.dtype)


def assert_same_bits(actual, expected, what: str = "tensor") -> None:
    """``actual`` (a torch tensor) against ``expected`` (float32 values
    representable in its dtype): the same bit pattern everywhere, except that
    NaN matches NaN (and the NaN counts must agree)."""
    fmt = fmt_of(actual)
    expected = np.asarray(expected, dtype=F32)
    if tuple(actual.shape) != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} vs {expected.shape}")
    a_bits = torch_bits(actual)
    e_bits = bits_of(expected, fmt)
    a_nan = np.isnan(to_np(actual))
    e_nan = np.isnan(expected)
    if a_nan.sum() != e_nan.sum() or (a_nan != e_nan).any():
        idx = np.argwhere(a_nan != e_nan)[:5].tolist()
        raise AssertionError(f"{what}: NaN counts {int(a_nan.sum())} vs {int(e_nan.sum())}; first at {idx}")
    bad = (a_bits != e_bits) & ~a_nan
    if bad.any():
        idx = np.argwhere(bad)[:5]
        av = to_np(actual)
        samples = ", ".join(
            f"{tuple(i.tolist())}: {av[tuple(i)]!r} (0x{int(a_bits[tuple(i)]):x}) vs "
            f"{expected[tuple(i)]!r} (0x{int(e_bits[tuple(i)]):x})"
            for i in idx
        )
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements differ in bits; {samples}")
