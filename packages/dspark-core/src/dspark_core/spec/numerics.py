"""The arithmetic of vLLM 0.33.0's stock kernels, as PyTorch functions.

Every function computes on FP32 tensors. Plain ``+``, ``-``, ``*`` and ``/``
of float32 tensors and the conversions ``.to(bfloat16)`` / ``.to(float16)``
round once to nearest even on CPU and CUDA alike (each is its own eager
kernel, so nothing contracts). On top of them:

- ``fma_rn(a, b, c)``: one rounding of ``a * b + c`` (``fma.rn.f32``),
  computed exactly on any device (the product in FP64, the sum rounded to
  odd at 53 bits, then to FP32);
- the approximate instructions the stock kernels use, named after them:
  ``rsqrt_approx_ftz`` (``rsqrt.approx.ftz.f32``, MUFU.RSQ),
  ``rsqrt_approx`` (``rsqrtf``: MUFU.RSQ with its subnormal scaling),
  ``sqrt_approx_ftz``, ``rcp_full`` (``div.full.f32(1, x)``), ``ex2_approx`` /
  ``ex2_approx_ftz``, ``rcp_approx_ftz`` and ``expf`` (CUDA's accurate
  ``expf``, itself built on MUFU.EX2). On a CUDA tensor each runs that very
  instruction (one NVRTC-compiled elementwise kernel with inline PTX,
  ``torch.cuda.jiterator``); on a CPU tensor it runs the IEEE operation the
  instruction approximates (square roots correctly rounded, through FP64:
  the CPU ``torch.sqrt`` of FP32 is not), which may differ from the GPU in
  the last bits.

So the spec is **bit for bit the stock on CUDA**, and on a CPU bit for bit
except where an approximate instruction enters (a norm's reciprocal square
root, the o-gate's sigmoid, the activation's exponential): the CPU tests pin
everything around those, and the GPU tests compare against the stock kernels
themselves. NaN results promise only to be NaN (their payloads are the
device's).

The row norm's summation tree (``row_sum_of_squares``), the stock Triton
norm at 8192 columns (``fused_rmsnorm_fwd``: one row per CTA of 8 warps):
thread ``t`` (0..255) holds the columns ``8t + j + 2048r`` (``r < D/2048``,
``j < 8``), its elements in the order ``e_(8r+j)``. The thread's sum depends
on the architecture Triton 3.8 compiles for:

- sm_90a: leaves ``fma(e_2k, e_2k, RN(e_(2k+1)^2))``, then a pairwise tree
  over the leaves in order;
- sm_100a: every square rounded, the even-index and the odd-index squares
  each summed by a pairwise tree, then ``even + odd``; for a norm that scales
  its input by the weight first, leaves ``fma(e_4j, e_4j, RN(e_(4j+2)^2))``
  (even) and ``fma(e_(4j+1), e_(4j+1), RN(e_(4j+3)^2))`` (odd) instead.

Then a warp butterfly (xor 16, 8, 4, 2, 1) and the 8 warp sums folded by
halves (``fold_halves``): ``((W0+W4)+(W2+W6)) + ((W1+W5)+(W3+W7))``.

These trees are the stock's for BF16 rows (every norm of the draft takes BF16
rows), read from the compiled PTX of each variant. There the square of an
element is exact, so an fma leaf ``fma(a, a, RN(b^2))`` has the bits of
``RN(RN(a^2) + RN(b^2))``: Triton's other packing of an FP32-weight norm on
sm_100a (fma leaves of elements 4j and 4j + 2 without input scaling) gives
the rounded-squares tree's bits. Triton reduces FP32 and FP16 rows in other
layouts and orders, which the spec does not describe (it applies the same
trees to them).
A tree over a count that is not a power of two is padded with +0.0 (what
Triton's masked loads give), which changes no value.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from dspark_core import checks
from dspark_core.checks import ARCHS  # noqa: F401 (re-exported)

# The stock norm's CTA: THREADS threads, VEC consecutive columns a chunk, CHUNK columns a chunk row.
THREADS = 256
VEC = 8
WARP = 32
WARPS = THREADS // WARP
CHUNK = THREADS * VEC

F32 = torch.float32
F64 = torch.float64


def check_row_width(h: int, name: str = "the row width H") -> int:
    """``h`` where it is an int (``checks.integer``) and a positive multiple
    of ``CHUNK``; TypeError or ValueError naming ``name`` otherwise."""
    h = checks.integer(name, h)
    if h <= 0 or h % CHUNK:
        raise ValueError(f"{name}: a DSpark row norm takes rows of a positive multiple of {CHUNK} columns, not {h}")
    return h


def check_head_width(d: int, name: str = "the head width head_dim") -> int:
    """``d`` where it is an int (``checks.integer``) and a power of two of
    at least 2; TypeError or ValueError naming ``name`` otherwise."""
    d = checks.integer(name, d)
    if d < 2 or d & (d - 1):
        raise ValueError(f"{name}: a DSpark head norm takes heads of a power of two (>= 2) columns, not {d}")
    return d


def check_arch(arch) -> str:
    """``arch`` in its one spelling (``checks.arch``: ``SM_90A`` and
    ``(9, 0)`` are ``sm_90a``), one of ``ARCHS``; TypeError or
    ValueError naming the architectures the spec describes."""
    return checks.arch("arch (the GPU whose stock the spec describes)", arch)


def f32(value: float) -> float:
    """``value`` rounded to FP32 (nearest even), as a Python float."""
    return float(np.float32(value))


def _pad_pow2(v: torch.Tensor) -> torch.Tensor:
    n = v.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size == n:
        return v
    pad = torch.zeros(*v.shape[:-1], size - n, dtype=v.dtype, device=v.device)
    return torch.cat([v, pad], dim=-1)


def fold_halves(v: torch.Tensor) -> torch.Tensor:
    """Sum the last dim by folding halves, ``v[:n/2] + v[n/2:]`` until one is
    left: what a ``shfl.bfly`` butterfly with offsets n/2, ..., 1 leaves in
    every lane (a + b == b + a bit for bit)."""
    v = _pad_pow2(v)
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def pairwise(v: torch.Tensor) -> torch.Tensor:
    """Sum the last dim by a pairwise tree of neighbours, ``v[0::2] + v[1::2]``
    until one is left (a tree over elements in order; a butterfly with
    ascending offsets 1, 2, 4, ... leaves the same)."""
    v = _pad_pow2(v)
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def fma_rn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of FP32 operands rounded once to FP32 (``fma.rn.f32``),
    exactly on any device: the product is exact in FP64; the FP64 sum is made
    round-to-odd with its exact error (TwoSum), which then rounds to FP32 as
    the exact sum would (53 >= 24 + 2 bits). Infinities and NaN follow IEEE."""
    a, b, c = (torch.as_tensor(t, dtype=F32) for t in (a, b, c))
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    finite = torch.isfinite(s) & torch.isfinite(err)
    odd = (s.view(torch.int64) & 1) == 1
    toward = torch.nextafter(s, torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf)))
    s = torch.where(finite & (err != 0) & ~odd, toward, s)
    return s.to(F32)


# -- the approximate instructions -------------------------------------------------
# Each CUDA implementation is one instruction in inline PTX (NVRTC, no fast math).
_PTX = {
    "rsqrt_approx_ftz": "asm(\"rsqrt.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x));",
    "sqrt_approx_ftz": "asm(\"sqrt.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x));",
    "ex2_approx": "asm(\"ex2.approx.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x));",
    "ex2_approx_ftz": "asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x));",
    "rcp_approx_ftz": "asm(\"rcp.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x));",
    "rcp_full": "asm(\"div.full.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(1.0f), \"f\"(x));",
    "rsqrt_approx": "r = rsqrtf(x);",
    "expf": "r = expf(x);",
}


@functools.cache
def _jit(name: str):
    body = _PTX[name]
    code = f"template <typename T> T dspark_{name}(T x) {{ float r; {body} return r; }}"
    return torch.cuda.jiterator._create_jit_fn(code)


def _device_op(name: str, x: torch.Tensor, cpu) -> torch.Tensor:
    x = x.to(F32)
    if x.is_cuda:
        return _jit(name)(x)
    return cpu(x)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The IEEE (correctly rounded) FP32 square root: the FP64 root rounded
    to FP32 (exact rounding: 53 >= 2 * 24 + 2). The CPU ``torch.sqrt`` of an
    FP32 tensor is not correctly rounded (about 9 % of [1, 2) one ulp off,
    torch 2.13 CPU, AVX512)."""
    return torch.sqrt(x.double()).to(F32)


def _flush(x: torch.Tensor) -> torch.Tensor:
    """``.ftz``: a subnormal input is read as zero of its sign."""
    tiny = torch.abs(x) < 2.0**-126
    return torch.where(tiny, torch.copysign(torch.zeros_like(x), x), x)


def rsqrt_approx_ftz(x: torch.Tensor) -> torch.Tensor:
    """``rsqrt.approx.ftz.f32`` (MUFU.RSQ; CPU: IEEE ``1 / sqrt`` of the flushed input)."""
    return _device_op("rsqrt_approx_ftz", x, lambda v: 1.0 / _sqrt_rn(_flush(v)))


def rsqrt_approx(x: torch.Tensor) -> torch.Tensor:
    """CUDA's ``rsqrtf`` (MUFU.RSQ, a subnormal input scaled by 2^24 first and
    the result by 2^12; the same as the ftz form on normal inputs; CPU: IEEE
    ``1 / sqrt``). ``torch.rsqrt`` on CUDA is this."""
    return _device_op("rsqrt_approx", x, lambda v: 1.0 / _sqrt_rn(v))


def sqrt_approx_ftz(x: torch.Tensor) -> torch.Tensor:
    """``sqrt.approx.ftz.f32`` (MUFU.SQRT; CPU: IEEE ``sqrt`` of the flushed input)."""
    return _device_op("sqrt_approx_ftz", x, lambda v: _sqrt_rn(_flush(v)))


def rcp_full(x: torch.Tensor) -> torch.Tensor:
    """``div.full.f32(1, x)`` (MUFU.RCP with its range fix-ups; CPU: IEEE ``1 / x``)."""
    return _device_op("rcp_full", x, lambda v: 1.0 / v)


def rcp_approx_ftz(x: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` (MUFU.RCP; CPU: IEEE ``1 / x`` of the flushed input)."""
    return _device_op("rcp_approx_ftz", x, lambda v: 1.0 / _flush(v))


def ex2_approx(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.f32`` (MUFU.EX2; CPU: ``2 ** x`` rounded from FP64)."""
    return _device_op("ex2_approx", x, lambda v: torch.exp2(v.double()).to(F32))


def ex2_approx_ftz(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz.f32`` (CPU: ``2 ** x`` of the flushed input, the result flushed)."""
    return _device_op("ex2_approx_ftz", x, lambda v: _flush(torch.exp2(_flush(v).double()).to(F32)))


def expf(x: torch.Tensor) -> torch.Tensor:
    """CUDA's accurate ``expf`` (libdevice: a Cody-Waite reduction and MUFU.EX2;
    CPU: ``e ** x`` rounded from FP64, within its 2 ulp)."""
    return _device_op("expf", x, lambda v: torch.exp(v.double()).to(F32))


# -- the stock row norm's tree ------------------------------------------------------
def thread_elements(v: torch.Tensor) -> torch.Tensor:
    """FP32 ``[..., D]`` to ``[..., 256, D/256]``: thread ``t``'s elements in
    the order ``e_(8r+j)`` = column ``8t + j + 2048r``."""
    d = v.shape[-1]
    check_row_width(d)
    chunks = v.reshape(*v.shape[:-1], d // CHUNK, THREADS, VEC)
    return chunks.movedim(-3, -2).reshape(*v.shape[:-1], THREADS, d // THREADS)


def thread_sum_of_squares(e: torch.Tensor, arch: str, input_scaled: bool = False) -> torch.Tensor:
    """One thread's sum of the squares of its elements ``e`` ``[..., n]``
    (module docstring) on ``arch`` (``check_arch``'s spelling)."""
    arch = check_arch(arch)
    if arch == "sm_90a":
        return pairwise(fma_rn(e[..., 0::2], e[..., 0::2], e[..., 1::2] * e[..., 1::2]))
    if input_scaled:
        even = fma_rn(e[..., 0::4], e[..., 0::4], e[..., 2::4] * e[..., 2::4])
        odd = fma_rn(e[..., 1::4], e[..., 1::4], e[..., 3::4] * e[..., 3::4])
        return pairwise(even) + pairwise(odd)
    q = e * e
    return pairwise(q[..., 0::2]) + pairwise(q[..., 1::2])


def reduce_threads(t: torch.Tensor) -> torch.Tensor:
    """The 256 thread sums ``[..., 256]`` to the row sum: each warp's
    butterfly, then the 8 warp sums folded by halves."""
    return fold_halves(fold_halves(t.reshape(*t.shape[:-1], WARPS, WARP)))


def row_sum_of_squares(v: torch.Tensor, arch: str = "sm_90a", input_scaled: bool = False) -> torch.Tensor:
    """The stock norm's sum of squares of FP32 ``[..., D]`` rows: ``[...]``."""
    return reduce_threads(thread_sum_of_squares(thread_elements(v), arch, input_scaled))


def inv_rms(total: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """The stock norm's ``rsqrt(total * (1/n) + eps)``: ``fma.rn(total,
    f32(1/n), f32(eps))``, then ``rsqrt.approx.ftz.f32``."""
    scale = torch.full_like(total, f32(1.0 / n))
    return rsqrt_approx_ftz(fma_rn(total, scale, torch.full_like(total, f32(eps))))


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (nearest even) and read back as FP32."""
    return x.to(dtype).to(F32)


# -- the reference draft's own attention (not a stock kernel: see spec.attention) -----
# exp_rn: Cody-Waite reduction by ln 2 and a degree-6 Taylor polynomial, every
# step a rounded FP32 operation, so it is device independent.
_LOG2E = 1.44269502162933349609375
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
_EXP_COEFFS = (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0)
EXP_OVERFLOW = 88.72283935546875
EXP_UNDERFLOW = -104.0


def _pow2(n: torch.Tensor) -> torch.Tensor:
    return ((n.to(torch.int32) + 127) << 23).view(F32)


def exp_rn(x: torch.Tensor) -> torch.Tensor:
    """``e ** x`` of FP32 ``x`` from rounded FP32 operations, the same bits on
    every device: ``n = rint(x * LOG2E)``; ``r = (x - n * LN2_HI) - n *
    LN2_LO``; Horner over ``1/k!``; ``p * 2**floor(n/2) * 2**(n - floor(n/2))``;
    +inf above ``EXP_OVERFLOW``, +0.0 below ``EXP_UNDERFLOW``, NaN stays NaN."""
    x = x.to(F32)
    clamped = torch.clamp(x, EXP_UNDERFLOW, EXP_OVERFLOW)
    clamped = torch.where(torch.isnan(x), torch.zeros_like(x), clamped)
    n = torch.round(clamped * f32(_LOG2E))
    r = (clamped - n * f32(_LN2_HI)) - n * f32(_LN2_LO)
    p = torch.full_like(r, f32(_EXP_COEFFS[0]))
    for c in _EXP_COEFFS[1:]:
        p = p * r + f32(c)
    n1 = torch.floor(n * 0.5)
    out = p * _pow2(n1) * _pow2(n - n1)
    out = torch.where(x > EXP_OVERFLOW, torch.full_like(x, math.inf), out)
    out = torch.where(x < EXP_UNDERFLOW, torch.zeros_like(x), out)
    return torch.where(torch.isnan(x), x, out)
