"""An independent NumPy implementation of dspark-core's numeric spec (the
arithmetic of vLLM 0.33.0's stock kernels), and the bit-level helpers the
tests compare with.

Nothing here imports ``dspark_core``: it is written from
``docs/stock-numerics.md`` and the docstrings of ``spec/numerics.py`` and
``spec/layers.py``, in a different style:

- every FP32 ``+ - * /`` and the square root is done in float64 and rounded
  once to float32 (``_add``, ``_sub``, ``_mul``, ``_div``, ``sqrt_rn``): for
  float32 operands that *is* the correctly rounded result (float64 has
  53 >= 2 * 24 + 2 bits, so the double rounding is innocuous; subnormal
  results included);
- ``fma`` is exact integer arithmetic: every float32 is an integer multiple of
  2**-149, so ``a * b + c`` is the Python integer ``A * B + C * 2**149`` in
  units of 2**-298, rounded to nearest even by shifting (``np.frompyfunc``
  over the elements; keep sizes moderate);
- the kernels are run the way their threads run them: the row norm's
  256-thread CTA as a register file ``[rows, 256]`` with ``shfl.bfly``
  butterflies (``tid ^ offset``) and the warp sums through "shared memory";
  the QK-norm's 8 lanes, the ATen reduce's ``shfl_down`` lanes, FLA's 16
  lanes and FlashInfer's 32 or 8 lanes likewise;
- BF16 rounding is integer arithmetic on the float32 bit pattern.

The approximate GPU instructions (``rsqrt.approx.ftz``, ``rsqrtf``,
``sqrt.approx.ftz``, ``div.full``, ``rcp.approx.ftz``, ``ex2.approx[.ftz]``,
CUDA's ``expf``) cannot be reproduced on a CPU; the spec runs their IEEE
counterparts there. ``Approx`` bundles one implementation of each, named after
the spec's functions: ``STANDIN`` is the documented CPU stand-ins (computed
here with NumPy); a test can pass another ``Approx`` (e.g. ``perturbed()``) to
both this module and, monkeypatched, to the spec, so that everything around the
approximate instructions is pinned bit for bit whatever they return.

Values are float32 NumPy arrays; a value "rounded to BF16/FP16" is a float32
array whose values are exactly representable in that format.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

THREADS = 256
VEC = 8
WARP = 32
CHUNK = THREADS * VEC

F32 = np.float32
F64 = np.float64
TINY = 2.0**-126  # the least normal float32

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


def sqrt_rn(a):
    """The IEEE square root of float32 ``a`` (float64 root, rounded once)."""
    with np.errstate(all="ignore"):
        return np.sqrt(_w(a)).astype(F32)


# ---------------------------------------------------------------------------
# The exact fused multiply-add.

_UNIT = 149  # float32 values are integer multiples of 2**-149


def _as_int(v: float) -> int:
    """A finite float32 value (as a Python float) in units of 2**-149 (exact:
    the product has the float's 24 significant bits and stays below 2**278)."""
    return int(v * 2.0**_UNIT)


def _round_units(n: int, units: int) -> float:
    """``n * 2**-units`` (n a nonzero int) rounded to nearest even float32,
    overflow to an infinity of its sign."""
    sign = -1.0 if n < 0 else 1.0
    n = abs(n)
    e = n.bit_length() - 1 - units  # 2**e <= |value| < 2**(e+1)
    qe = max(e, -126) - 23  # the float32 quantum at that magnitude
    shift = qe + units  # > 0 for every value below 2**-149 * 2**units
    m = n >> shift
    rest = n - (m << shift)
    half = 1 << (shift - 1)
    if rest > half or (rest == half and m & 1):
        m += 1
    if m * 2.0**qe >= 2.0**128:
        return sign * math.inf
    return sign * math.ldexp(m, qe)


def _fma1(a, b, c) -> float:
    a, b, c = float(a), float(b), float(c)
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
        with np.errstate(all="ignore"):  # IEEE's special cases: float64 has them all
            return float(np.float64(a) * np.float64(b) + np.float64(c))
    n = _as_int(a) * _as_int(b) + (_as_int(c) << _UNIT)  # units of 2**-298
    if n == 0:
        # An exact zero: -0.0 only for (+-0 * x) + -0.0 with a negative product.
        product_negative = (math.copysign(1.0, a) * math.copysign(1.0, b)) < 0
        both_zero = a * b == 0.0 and c == 0.0
        negative = both_zero and product_negative and math.copysign(1.0, c) < 0
        return -0.0 if negative else 0.0
    return _round_units(n, 2 * _UNIT)


_fma_ufunc = np.frompyfunc(_fma1, 3, 1)


def fma(a, b, c) -> np.ndarray:
    """``a * b + c`` of float32 operands with ONE rounding (broadcasting)."""
    out = _fma_ufunc(np.asarray(a, dtype=F32), np.asarray(b, dtype=F32), np.asarray(c, dtype=F32))
    return np.asarray(out, dtype=F64).astype(F32)


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
# The approximate instructions.


def flush(a) -> np.ndarray:
    """``.ftz`` on an input or result: a subnormal is read as a zero of its sign."""
    a = np.asarray(a, dtype=F32)
    return np.where(np.abs(a) < F32(TINY), np.copysign(F32(0.0), a), a).astype(F32)


def _exp2_f64(a) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.exp2(_w(a)).astype(F32)


def _exp_f64(a) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.exp(_w(a)).astype(F32)


Fn = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Approx:
    """One implementation of each approximate instruction (float32 arrays in
    and out), named after the spec's functions. The defaults are the CPU
    stand-ins the spec documents: the IEEE operation each instruction
    approximates, ``.ftz`` flushing its subnormal inputs (and ``ex2.ftz`` its
    subnormal results)."""

    rsqrt_approx_ftz: Fn = lambda v: _div(F32(1.0), sqrt_rn(flush(v)))  # noqa: E731
    rsqrt_approx: Fn = lambda v: _div(F32(1.0), sqrt_rn(v))  # noqa: E731
    sqrt_approx_ftz: Fn = lambda v: sqrt_rn(flush(v))  # noqa: E731
    rcp_full: Fn = lambda v: _div(F32(1.0), v)  # noqa: E731
    rcp_approx_ftz: Fn = lambda v: _div(F32(1.0), flush(v))  # noqa: E731
    ex2_approx: Fn = _exp2_f64
    ex2_approx_ftz: Fn = lambda v: flush(_exp2_f64(flush(v)))  # noqa: E731
    expf: Fn = _exp_f64

    NAMES = ("rsqrt_approx_ftz", "rsqrt_approx", "sqrt_approx_ftz", "rcp_full", "rcp_approx_ftz", "ex2_approx",
             "ex2_approx_ftz", "expf")


STANDIN = Approx()


def _nudge(fn: Fn, salt: int) -> Fn:
    """``fn`` with every normal result moved by -3 .. +4 ulps, the amount a
    hash of the input's bits (and ``salt``): a stand-in for an approximate
    instruction whose last bits nobody can predict."""

    def nudged(v):
        v = np.asarray(v, dtype=F32)
        r = np.asarray(fn(v), dtype=F32)
        key = ((f32_bits(v).astype(np.uint64) * np.uint64(2654435761) + np.uint64(salt)) >> np.uint64(13)) & 7
        delta = key.astype(np.int64) - 3
        bits = f32_bits(r).astype(np.int64)
        mag = bits & 0x7FFFFFFF
        ok = (mag >= 0x00800000 + 8) & (mag <= 0x7F7FFFFF - 8)  # normal, away from 0 and inf
        moved = (bits & ~0x7FFFFFFF) | (mag + delta)
        return from_f32_bits(np.where(ok, moved, bits).astype(np.uint32))

    return nudged


def perturbed() -> Approx:
    """Every approximate instruction nudged differently (``_nudge``)."""
    return Approx(**{name: _nudge(getattr(STANDIN, name), 7919 * (i + 1)) for i, name in enumerate(Approx.NAMES)})


# ---------------------------------------------------------------------------
# The stock row norm (Triton's _rmsnorm_fwd_kernel) as its 256-thread CTA runs it.


def _tree(vals: list) -> np.ndarray:
    """A pairwise tree over a list in order, ``(v0 + v1) + (v2 + v3) ...``,
    the list padded with +0.0 to a power of two."""
    vals = list(vals)
    size = 1
    while size < len(vals):
        size *= 2
    vals += [np.zeros_like(vals[0])] * (size - len(vals))
    while len(vals) > 1:
        vals = [_add(vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
    return vals[0]


def thread_registers(x) -> list[np.ndarray]:
    """What each thread loads: register ``8r + j`` of thread ``t`` is column
    ``2048 r + 8 t + j`` (16-byte loads of 8 contiguous columns). Returns the
    registers in order, each ``[m, 256]`` (one column per thread)."""
    x = np.asarray(x, dtype=F32)
    m, h = x.shape
    if h <= 0 or h % CHUNK:
        raise ValueError(h)
    tid = np.arange(THREADS)
    return [x[:, r * CHUNK + tid * VEC + j] for r in range(h // CHUNK) for j in range(VEC)]


def thread_sums(x, arch: str, input_scaled: bool = False) -> np.ndarray:
    """Each thread's sum of the squares of its registers, ``[m, 256]``:

    - sm_90a: leaves ``fma(e_2k, e_2k, RN(e_2k+1 ** 2))``, a pairwise tree;
    - sm_100a: squares rounded, the even registers and the odd ones each a
      pairwise tree, then ``even + odd``; input-scaled: even leaves
      ``fma(e_4j, e_4j, RN(e_4j+2 ** 2))``, odd ``fma(e_4j+1, e_4j+1,
      RN(e_4j+3 ** 2))``, a tree over each, then ``even + odd``."""
    e = thread_registers(x)
    n = len(e)
    if arch == "sm_90a":
        return _tree([fma(e[2 * k], e[2 * k], _mul(e[2 * k + 1], e[2 * k + 1])) for k in range(n // 2)])
    if arch != "sm_100a":
        raise ValueError(arch)
    if input_scaled:
        even = _tree([fma(e[4 * j], e[4 * j], _mul(e[4 * j + 2], e[4 * j + 2])) for j in range(n // 4)])
        odd = _tree([fma(e[4 * j + 1], e[4 * j + 1], _mul(e[4 * j + 3], e[4 * j + 3])) for j in range(n // 4)])
        return _add(even, odd)
    squares = [_mul(v, v) for v in e]
    return _add(_tree(squares[0::2]), _tree(squares[1::2]))


def cta_reduce(t, return_lanes: bool = False):
    """The 256 thread sums ``[m, 256]`` to the row sum as the CTA does it:
    each warp ``shfl.bfly`` with offsets 16, 8, 4, 2, 1 (lane t adds lane
    t ^ off); every lane of warp w stores to ``smem[w]``; a barrier; thread
    t loads ``smem[t & 7]`` and butterflies with 4, 2, 1. Returns thread 0's
    value ``[m]`` (with ``return_lanes`` also the 256 values after the warp
    butterflies and the 256 final ones: every thread should agree)."""
    acc = np.asarray(t, dtype=F32)
    tid = np.arange(THREADS)
    for off in (16, 8, 4, 2, 1):
        acc = _add(acc, acc[:, tid ^ off])
    smem = np.zeros((acc.shape[0], THREADS // WARP), dtype=F32)
    for thread in range(THREADS):  # every thread's store, in thread order
        smem[:, thread >> 5] = acc[:, thread]
    v = smem[:, tid & 7]
    for off in (4, 2, 1):
        v = _add(v, v[:, tid ^ off])
    if return_lanes:
        return v[:, 0], acc, v
    return v[:, 0]


def row_sum_of_squares(x, arch: str = "sm_90a", input_scaled: bool = False) -> np.ndarray:
    return cta_reduce(thread_sums(x, arch, input_scaled))


def norm_scale(total, n: int, eps: float, ops: Approx = STANDIN) -> np.ndarray:
    """``rsqrt.approx.ftz(fma(total, 1/n, eps))`` (1/n and eps rounded to FP32)."""
    return ops.rsqrt_approx_ftz(fma(total, f32(1.0 / n), f32(eps)))


def rmsnorm(x, weight=None, *, arch="sm_90a", eps=1e-6, gain_center=0.0, weight_before=False, out="bf16",
            ops: Approx = STANDIN):
    """The stock norm of float32 ``x`` ``[m, H]`` with float32 ``weight``
    ``[H]`` (the stored weight widened) or None: ``g = RN(w + gc)`` (the
    center as FP32, always added); input-scaled ``v = RN(g x)``, ``y = RN(r
    v)``; otherwise ``y = RN(g RN(r x))``; then rounded to ``out``."""
    x = np.asarray(x, dtype=F32)
    g = None if weight is None else _add(weight, f32(gain_center))
    scaled = g is not None and weight_before
    v = _mul(g, x) if scaled else x
    r = norm_scale(row_sum_of_squares(v, arch, scaled), x.shape[-1], eps, ops)[:, None]
    y = _mul(r, v)
    if g is not None and not scaled:
        y = _mul(g, y)
    return round_to(y, out)


# ---------------------------------------------------------------------------
# The residual connection and boundary.


def gated_residual(stream, branch, alpha, beta):
    return _add(_mul(alpha, stream), _mul(beta, branch))


def residual_boundary(branch, stream, post: dict, pre: dict, alpha, beta, out="bf16", arch="sm_90a",
                      ops: Approx = STANDIN):
    """``(new_stream, out)``; ``post``/``pre`` are keyword dicts of
    ``rmsnorm`` (weight, eps, gain_center, weight_before)."""
    p = rmsnorm(branch, **post, arch=arch, out="bf16", ops=ops)
    new_stream = gated_residual(stream, p, alpha, beta)
    return new_stream, rmsnorm(round_bf16(new_stream), **pre, arch=arch, out=out, ops=ops)


# ---------------------------------------------------------------------------
# RoPE: the rotary kernels' fma form.


def rope_table_f64(head_dim: int, max_position: int, theta: float) -> np.ndarray:
    """The GPT-J table in float64 NumPy: ``[cos(p f_j) | sin(p f_j)]``,
    ``f_j = theta ** (-2j / D)``. NumPy's float64 pow/cos/sin are not torch's:
    an entry can differ in its last float64 bit."""
    j = np.arange(head_dim // 2, dtype=F64)
    freqs = float(theta) ** (-2.0 * j / head_dim)
    ang = np.arange(max_position, dtype=F64)[:, None] * freqs[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1)


def round_once_f64(v, fmt: str) -> np.ndarray:
    """float64 ``v`` rounded ONCE (nearest even) to ``fmt`` ('bf16' or
    'fp32'; normal range), as float32 values."""
    v = np.asarray(v, dtype=F64)
    p = {"bf16": 8, "fp32": 24}[fmt]
    m, e = np.frexp(v)
    return np.ldexp(np.rint(np.ldexp(m, p)), e - p).astype(F32)


def rotate(x, positions, table) -> np.ndarray:
    """GPT-J RoPE of float32 ``x`` ``[m, heads, D]`` with the float32 values
    of the ``table`` rows at ``positions``, in FP32: pair ``(a, b) = (x_2i,
    x_2i+1)``, ``c = row[i]``, ``s = row[D/2 + i]``: ``a' = fma(c, a,
    -RN(s b))``, ``b' = fma(s, a, RN(c b))``."""
    x = np.asarray(x, dtype=F32)
    d = x.shape[-1]
    rows = np.asarray(table, dtype=F32)[np.asarray(positions)]
    out = np.empty_like(x)
    for i in range(d // 2):
        c, s = rows[:, None, i], rows[:, None, d // 2 + i]
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = fma(c, a, -_mul(s, b))
        out[..., 2 * i + 1] = fma(s, a, _mul(c, b))
    return out


def rope(x, positions, table):
    """``rotate`` rounded to BF16."""
    return round_bf16(rotate(x, positions, table))


# ---------------------------------------------------------------------------
# The head norms.


def qk_norm_rope(x, *, eps=1e-6, positions=None, table=None, ops: Approx = STANDIN):
    """vLLM's fused QK-norm (+ RoPE) of float32 heads ``x`` ``[m, heads, D]``:
    lane ``l`` of ``D/8`` holds ``x_8l .. x_8l+7`` and chains ``acc =
    fma(e_j, e_j, acc)`` from +0.0 in element order; ``shfl.bfly`` over the
    lanes (offsets D/16 .. 1); ``r = rsqrtf(fma(S, 1/D, eps))``; ``n = RN(x
    r)``; RoPE on the FP32 ``n`` when a table is given; one BF16 rounding."""
    x = np.asarray(x, dtype=F32)
    d = x.shape[-1]
    lanes = np.arange(d // 8)
    acc = np.zeros(x.shape[:-1] + (d // 8,), dtype=F32)
    for j in range(8):
        e = x[..., 8 * lanes + j]
        acc = fma(e, e, acc)
    off = len(lanes) // 2
    while off:
        acc = _add(acc, acc[..., lanes ^ off])
        off //= 2
    r = ops.rsqrt_approx(fma(acc[..., 0], f32(1.0 / d), f32(eps)))
    n = _mul(x, r[..., None])
    if table is not None:
        n = rotate(n, positions, table)
    return round_bf16(n)


def k_norm_context(k, *, eps=1e-6, ops: Approx = STANDIN):
    """The context chain's ATen K-norm of float32 ``k`` ``[..., 64]``:
    ``q = RN(k k)``; ATen's reduce: lane ``l`` of 32 accumulates ``(0 +
    q_l)`` and ``(0 + q_(l+32))``, combines ``((a0 + a1) + 0) + 0``, then
    ``shfl_down`` 16, 8, 4, 2, 1 (a lane past the end keeps its own value);
    lane 0's sum times 2**-6 (the mean), ``+ eps``, ``torch.rsqrt``
    (``rsqrtf``), ``RN(k r)`` rounded to BF16."""
    k = np.asarray(k, dtype=F32)
    if k.shape[-1] != 64:
        raise ValueError(k.shape)
    q = _mul(k, k)
    lanes = np.arange(32)
    zero = F32(0.0)
    a0, a1 = _add(zero, q[..., lanes]), _add(zero, q[..., lanes + 32])
    s = _add(_add(_add(a0, a1), zero), zero)
    for off in (16, 8, 4, 2, 1):
        src = np.where(lanes + off < 32, lanes + off, lanes)
        s = _add(s, s[..., src])
    mean = _mul(s[..., 0], F32(2.0**-6))
    r = ops.rsqrt_approx(_add(mean, f32(eps)))
    return round_bf16(_mul(k, r[..., None]))


NEG_LOG2E = from_f32_bits(np.array(0xBFB8AA3B, dtype=np.uint32))  # -1.44269502 (the kernels' constant)


def o_gate(attn, gate, *, eps=1e-6, arch="sm_90a", ops: Approx = STANDIN):
    """The o-norm and sigmoid o-gate of float32 ``attn``, ``gate`` ``[m,
    heads, 64]`` (BF16 values) as the stock runs it on ``arch``:

    - sm_90a (FLA's Triton kernel): lane ``l`` of 16 holds ``x_4l ..
      x_4l+3``, its sum ``fma(x0, x0, RN(x1^2)) + fma(x2, x2, RN(x3^2))``;
      ``shfl.bfly`` 8, 4, 2, 1; ``v = fma(S, 2^-6, eps)``; ``rstd =
      div.full(1, sqrt.approx.ftz(v))``; ``h = RN(x rstd)``; ``sig =
      div.full(1, RN(ex2.approx(RN(g * -log2e)) + 1))``; ``y = RN(h sig)``;
    - sm_100a (FlashInfer's CuTe kernel): ``m * heads`` rows; up to 256 a
      lane of 32 holds 2 columns, above a lane of 8 holds 8; squares
      rounded, a pairwise sum in the lane, ``shfl.bfly`` 1, 2, 4 (, 8, 16);
      ``inv = rsqrt.approx.ftz(fma(S, 2^-6, eps))``; ``sig =
      rcp.approx.ftz(RN(ex2.approx.ftz(RN(g * -log2e)) + 1))``; ``y = RN(sig
      RN(x inv))``;

    rounded to BF16."""
    x, g = np.asarray(attn, dtype=F32), np.asarray(gate, dtype=F32)
    d = x.shape[-1]
    z = _mul(g, NEG_LOG2E)
    if arch == "sm_90a":
        lanes = np.arange(d // 4)
        c = [x[..., 4 * lanes + i] for i in range(4)]
        s = _add(fma(c[0], c[0], _mul(c[1], c[1])), fma(c[2], c[2], _mul(c[3], c[3])))
        off = len(lanes) // 2
        while off:
            s = _add(s, s[..., lanes ^ off])
            off //= 2
        v = fma(s[..., 0], f32(1.0 / d), f32(eps))[..., None]
        h = _mul(x, ops.rcp_full(ops.sqrt_approx_ftz(v)))
        sig = ops.rcp_full(_add(ops.ex2_approx(z), F32(1.0)))
        return round_bf16(_mul(h, sig))
    if arch != "sm_100a":
        raise ValueError(arch)
    rows = int(np.prod(x.shape[:-1]))
    per = 2 if rows <= 256 else 8
    lanes = np.arange(d // per)
    s = _tree([_mul(x[..., per * lanes + i], x[..., per * lanes + i]) for i in range(per)])
    off = 1
    while off < len(lanes):
        s = _add(s, s[..., lanes ^ off])
        off *= 2
    inv = ops.rsqrt_approx_ftz(fma(s[..., 0], f32(1.0 / d), f32(eps)))[..., None]
    sig = ops.rcp_approx_ftz(_add(ops.ex2_approx_ftz(z), F32(1.0)))
    return round_bf16(_mul(sig, _mul(x, inv)))


def silu_and_mul(gu, intermediate: int, ops: Approx = STANDIN):
    """vLLM's act_and_mul kernel of float32 ``gu`` ``[m, 2I]`` (BF16 values,
    gate first): ``a = bf16(RN(x / RN(expf(-x) + 1)))`` (IEEE division),
    ``out = bf16(RN(a * RN(up + 0.0)))``."""
    gu = np.asarray(gu, dtype=F32)
    x, up = gu[..., :intermediate], gu[..., intermediate:]
    a = round_bf16(_div(x, _add(ops.expf(-_mul(x, F32(1.0))), F32(1.0))))
    return round_bf16(_mul(a, _add(up, F32(0.0))))


# ---------------------------------------------------------------------------
# exp_rn and the reference draft's attention (not stock kernels: spec.attention).

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


def warp_head_sum(v) -> np.ndarray:
    """The attention's head tree of float32 ``v`` ``[..., D]``: lane ``j``
    holds the pair sum ``v[2j] + v[2j+1]``; a butterfly with offsets D/4,
    ..., 1 over the D/2 lanes; lane 0's value."""
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

SPECIALS = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 2.0**-149, -(2.0**-133), 2.0**-126, 3.0e38, -3.0e38],
                    dtype=np.float32)


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


def sprinkle(rng: np.random.Generator, x: np.ndarray, fmt: str, rate: float) -> np.ndarray:
    """Put ``SPECIALS`` at a fraction ``rate`` of the positions of ``x``."""
    if rate == 0:
        return x
    x = x.copy()
    mask = rng.random(x.shape) < rate
    x[mask] = rng.choice(SPECIALS, int(mask.sum()))
    return round_to(x, fmt)


def special_rows(rng: np.random.Generator, m: int, h: int, fmt: str) -> np.ndarray:
    """``m >= 7`` rows of ``h`` values in ``fmt``: random normals, then rows
    of -0.0 (mixed with +0.0), subnormals, an infinity, NaN, near-overflow
    values (whose squares overflow), all -0.0; the rest random."""
    x = random_in(rng, (m, h), fmt, "normal")
    x[0, ::3] = -0.0
    lo, hi = (-24, -15) if fmt == "fp16" else (-133, -127)  # the format's subnormals
    x[1] = round_to(np.exp2(rng.uniform(lo, hi, h)) * np.where(rng.random(h) < 0.5, -1, 1), fmt)
    x[2, int(rng.integers(h))] = np.inf
    x[3, int(rng.integers(h))] = np.nan
    x[4] = round_to(np.where(rng.random(h) < 0.5, -1, 1) * np.float32(3.0e38 if fmt != "fp16" else 6e4), fmt)
    x[5] = -0.0
    x[6, int(rng.integers(h))] = -np.inf
    return round_to(x, fmt)


# ---------------------------------------------------------------------------
# The bridge to torch tensors (bit patterns only; no torch arithmetic).


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
    NaN matches NaN (and the NaN positions must agree)."""
    fmt = fmt_of(actual)
    expected = np.asarray(expected, dtype=F32)
    if tuple(actual.shape) != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} vs {expected.shape}")
    a_bits = torch_bits(actual)
    e_bits = bits_of(expected, fmt)
    a_nan = np.isnan(to_np(actual))
    e_nan = np.isnan(expected)
    if (a_nan != e_nan).any():
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

