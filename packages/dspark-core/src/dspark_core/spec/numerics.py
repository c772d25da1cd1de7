"""The arithmetic rules of the DSpark spec, as PyTorch functions.

Every function here computes on FP32 tensors with operations that IEEE 754
defines to round once, to nearest even: ``+``, ``-``, ``*``, ``/`` of float32
tensors, the square root ``sqrt_rn``, and the conversions ``.to(bfloat16)`` /
``.to(float16)`` (round to nearest even, subnormals kept) and from them (exact).
PyTorch runs each of these as its own elementwise kernel, on CPU (SSE/AVX
``addps``/``mulps``/``divps``) and on CUDA (``add.rn``/``mul.rn``/``div.rn``/
``sqrt.rn``, the defaults of a build without fast math), so no two of them are
contracted into a fused multiply-add and none flushes subnormals. (A CPU
``torch.sqrt`` may be 1 ulp off: ``sqrt_rn`` corrects it exactly; and a CUDA
division by a Python scalar is a multiplication by its reciprocal, so every
divisor here is a tensor.)
The result is therefore a function of the input bits alone: **the same bits on
CPU and on CUDA**, and the fused kernels reproduce it with the same PTX
instructions (``*.rn.f32``, no ``.ftz``, ``cvt.rn.bf16.f32``).

The one exception is NaN: IEEE 754 leaves a NaN result's payload and sign to
the implementation (x86 propagates an operand's payload, NVIDIA GPUs return
the canonical ``0x7fffffff``, and torch's CPU bf16 conversion keeps the sign
bit), so the spec promises only that a NaN result is a NaN.
``dspark_core.tools.compare.assert_bitwise`` compares every other bit pattern exactly
(-0.0, subnormals and infinities included) and NaN against NaN.

No function here uses ``torch.rsqrt``, ``torch.exp``, ``torch.sigmoid`` or a
``torch.sum``/``mean``: their results differ between devices (approximate
instructions, unspecified reduction orders). Sums follow the trees below and
the exponential is ``exp_rn``, built from rounded operations only.

The row tree (``row_sum``), the contract of every row norm of H columns, H a
multiple of ``CHUNK`` = 2048 (``THREADS`` = 256 threads x ``VEC`` = 8 columns):

1. column ``c = k * 2048 + t * 8 + j`` belongs to thread ``t`` (0..255),
   fragment ``k`` (0..H/2048-1), lane-element ``j`` (0..7);
2. each fragment's 8 values ``v_j`` (squares, for a norm) are added pairwise:
   ``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))``;
3. each thread adds its fragment sums in order of ``k``:
   ``((f_0 + f_1) + f_2) + ...`` (a single fragment is its own sum);
4. the 32 threads of each warp ``w = t // 32`` fold by halves: the sum at lane
   ``l`` becomes ``s_l + s_(l+16)`` for l < 16, then ``+ s_(l+8)`` for l < 8,
   then 4, 2, 1 (exactly what a ``shfl.bfly`` butterfly with offsets 16, 8, 4,
   2, 1 leaves in every lane, since a + b == b + a bit for bit);
5. the 8 warp sums fold by halves the same way: ``w_i + w_(i+4)``, then 2, 1.

A layout with one 8-column fragment per thread over a cluster of CTAs (the
fused all-reduce boundary) reproduces the same tree exactly: each thread forms
step 2 for its own fragment; the fragment sums are exchanged through
distributed shared memory; thread ``t`` of the 256-thread reference is then
emulated by reading fragments ``t, t + 256, t + 512, ...`` (step 3, in that
order), and steps 4 and 5 are the same butterflies over those emulated
threads. Nothing in the tree depends on which hardware thread holds what.

The head tree (``head_sum``), for per-head norms over D columns (D a power of
two, at least 2; the fused kernels take D = 64): pair ``p_j = v_(2j) + v_(2j+1)`` (the GPT-J pair lane j
holds), then the D/2 pair sums fold by halves (``p_j + p_(j+D/4)``, ...), the
butterfly of one warp whose lane j holds pair j.

The reciprocal RMS (``inv_rms``): ``1 / sqrt(sum / n + eps)`` as IEEE division,
IEEE addition, IEEE square root and IEEE division, each rounded once. IEEE
sqrt and division are correctly rounded by definition, where reciprocal
square root instructions (``rsqrtps``, ``rsqrt.approx``) are approximations
that differ between devices (the spec's ``sqrt_rn`` corrects a CPU
``torch.sqrt`` that is not correctly rounded); ``sum / n`` is a division, not a multiplication by
``1/n``, so H need not be a power of two.
"""

from __future__ import annotations

import numpy as np
import torch

# The reference CTA: THREADS threads, each holding VEC consecutive columns per
# fragment; CHUNK columns per fragment row of the CTA.
THREADS = 256
VEC = 8
WARP = 32
WARPS = THREADS // WARP
CHUNK = THREADS * VEC

F32 = torch.float32


def check_row_width(h: int) -> None:
    """Raise ValueError unless ``h`` is a positive multiple of ``CHUNK``."""
    if h <= 0 or h % CHUNK:
        raise ValueError(
            f"a DSpark row norm takes rows of a positive multiple of {CHUNK} "
            f"columns, not {h}"
        )


def check_head_width(d: int) -> None:
    """Raise ValueError unless ``d`` is a power of two of at least 2."""
    if d < 2 or d & (d - 1):
        raise ValueError(f"a DSpark head norm takes heads of a power of two (>= 2) columns, not {d}")


def fold_halves(v: torch.Tensor) -> torch.Tensor:
    """Sum the last dim (a power of two) by folding halves: ``v[:n/2] +
    v[n/2:]`` until one value is left (a warp butterfly's order)."""
    n = v.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fold_halves takes a power-of-two width, not {n}")
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def fragment_sum(v: torch.Tensor) -> torch.Tensor:
    """The pairwise sum of the last dim's 8 values:
    ``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))``."""
    v = v[..., 0::2] + v[..., 1::2]
    v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0] + v[..., 1]


def thread_sums(v: torch.Tensor) -> torch.Tensor:
    """Steps 1-3 of the row tree: FP32 ``[..., H]`` to the 256 thread sums
    ``[..., 256]``."""
    h = v.shape[-1]
    check_row_width(h)
    frags = fragment_sum(v.reshape(*v.shape[:-1], h // CHUNK, THREADS, VEC))
    total = frags[..., 0, :]
    for k in range(1, h // CHUNK):
        total = total + frags[..., k, :]
    return total


def reduce_threads(t: torch.Tensor) -> torch.Tensor:
    """Steps 4-5 of the row tree: the 256 thread sums ``[..., 256]`` to the
    row sum ``[...]`` (warp butterflies, then the warp sums folded)."""
    warp_sums = fold_halves(t.reshape(*t.shape[:-1], WARPS, WARP))
    return fold_halves(warp_sums)


def row_sum(v: torch.Tensor) -> torch.Tensor:
    """The row tree over FP32 ``[..., H]`` (module docstring): ``[...]``."""
    return reduce_threads(thread_sums(v))


def head_sum(v: torch.Tensor) -> torch.Tensor:
    """The head tree over FP32 ``[..., D]``: pair sums, then folded halves."""
    check_head_width(v.shape[-1])
    return fold_halves(v[..., 0::2] + v[..., 1::2])


def inv_rms(total: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """``1 / sqrt(total / n + eps)``, four IEEE operations each rounded once
    (``eps`` as FP32)."""
    # A tensor divisor: CUDA torch turns a division by a Python scalar into a
    # multiplication by its reciprocal, which rounds differently.
    var = total / torch.full_like(total, float(n)) + _f32(eps)
    return torch.reciprocal(sqrt_rn(var))


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded FP32 square root (IEEE ``sqrt``, nearest even).

    ``torch.sqrt`` of a CPU float32 tensor may be 1 ulp off (some builds
    vectorize it with an approximation), so its result ``s`` is corrected:
    with ``lo``/``hi`` the FP32 neighbours of ``s``, the midpoints ``(lo +
    s) / 2`` and ``(s + hi) / 2`` are exact in float64 (25 significant bits)
    and so are their squares (50 bits); ``v`` below the lower midpoint's
    square gives ``lo``, above the upper one's gives ``hi``, else ``s``.
    A square root is never exactly a midpoint, so no tie arises. On CUDA
    ``torch.sqrt`` is already ``sqrt.rn`` and the correction changes nothing.
    """
    s = torch.sqrt(v)
    lo = torch.nextafter(s, torch.zeros_like(s))
    hi = torch.nextafter(s, torch.full_like(s, float("inf")))
    s64, v64 = s.double(), v.double()
    below = (lo.double() + s64) * 0.5
    above = (s64 + hi.double()) * 0.5
    out = torch.where(v64 < below * below, lo, s)
    return torch.where(v64 > above * above, hi, out)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (nearest even) and read back as FP32: the
    value a kernel holds after storing and reloading it."""
    return x.to(dtype).to(F32)


# exp_rn: Cody-Waite reduction by ln 2 and a degree-6 Taylor polynomial, every
# step a rounded FP32 operation, so it is device independent (its accuracy,
# about 2 ulp, is not what the spec is for; its bits are).
_LOG2E = 1.44269502162933349609375  # FP32 log2(e)
_LN2_HI = 0.693145751953125  # 0x3f317200: 16 significant bits, n * hi exact
_LN2_LO = 1.428606765330187e-06  # 0x35bfbe8e
_EXP_COEFFS = (
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
)
EXP_OVERFLOW = 88.72283935546875  # above: +inf
EXP_UNDERFLOW = -104.0  # below: +0.0


def _f32(value: float) -> float:
    """``value`` rounded to FP32 (nearest even), as a Python float: plain
    host arithmetic, so ``torch.compile`` traces through it."""
    return float(np.float32(value))


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """``2**n`` of integral FP32 ``n`` in [-126, 127], built from its bits."""
    return ((n.to(torch.int32) + 127) << 23).view(F32)


def exp_rn(x: torch.Tensor) -> torch.Tensor:
    """``e ** x`` of FP32 ``x`` from rounded FP32 operations, in this order:

    1. ``n = rint(x * LOG2E)`` (round half to even; an exact integer in FP32);
    2. ``r = (x - n * LN2_HI) - n * LN2_LO``;
    3. ``p = ((((((c6 * r + c5) * r + c4) * r + c3) * r + c2) * r + c1) * r +
       c0)`` with ``c_k = 1/k!`` in FP32 (Horner, each product and sum rounded);
    4. ``p * 2**n1 * 2**n2`` with ``n1 = floor(n / 2)`` and ``n2 = n - n1``
       (the first product exact, the second rounds once, subnormals included);
    5. ``x > EXP_OVERFLOW`` gives +inf, ``x < EXP_UNDERFLOW`` gives +0.0, NaN
       stays NaN (selected after the arithmetic).
    """
    x = x.to(F32)
    clamped = torch.clamp(x, EXP_UNDERFLOW, EXP_OVERFLOW)
    clamped = torch.where(torch.isnan(x), torch.zeros_like(x), clamped)
    n = torch.round(clamped * _f32(_LOG2E))
    r = (clamped - n * _f32(_LN2_HI)) - n * _f32(_LN2_LO)
    p = torch.full_like(r, _f32(_EXP_COEFFS[0]))
    for c in _EXP_COEFFS[1:]:
        p = p * r + _f32(c)
    n1 = torch.floor(n * 0.5)
    n2 = n - n1
    out = p * _pow2(n1) * _pow2(n2)
    out = torch.where(x > EXP_OVERFLOW, torch.full_like(x, float("inf")), out)
    out = torch.where(x < EXP_UNDERFLOW, torch.zeros_like(x), out)
    return torch.where(torch.isnan(x), x, out)


def sigmoid_rn(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp_rn(-x))``: negate (exact), ``exp_rn``, add, divide."""
    return 1.0 / (1.0 + exp_rn(-x.to(F32)))


def silu_rn(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid_rn(x)``, the product rounded once."""
    x = x.to(F32)
    return x * sigmoid_rn(x)
