"""vLLM 0.33.0's Gumbel sampler (``vllm/v1/worker/gpu/sample/gumbel.py``,
``gumbel_sample`` and its Triton ``_gumbel_sample_kernel``, FP32 noise) as
Triton 3.8 compiles it for CUDA, and the probabilistic Markov step that
drafts through it (``DSparkSpeculator._sample_logits`` with
``draft_logits`` set): the spec of a fused probabilistic Markov step.

For ``logits [T, V]`` (BF16 or FP32), per token ``t`` with ``req =
idx_map[t]`` (a row is valid where ``req >= 0``):

1. ``temp = temperature[req]`` (0 for an invalid row); with a logits cache,
   ``cache[req, col, :V] = logits[t]`` (the values *before* temperature, in
   the cache's dtype, which must be the logits'; invalid rows write nothing)
   and the seed is ``spec_step_seed(seeds[req], col) = seed ^ (col << 32)``
   (``seeds[req]``, 0 for an invalid row);
2. ``x = float(logits[t, k])``; where ``temp != 0``: ``x = div.full.f32(x,
   temp)`` (Triton's ``/`` of FP32: the approximate full-range division,
   ``div_full``), ``p = pos[t] + 2^30`` when drafting (``_DRAFT_NOISE_SALT``),
   ``u = uniform32(seed, p, k)`` (``murmur3_uniform32``: the 32-bit
   MurmurHash3 of the seed's two words, the position's low word and the
   column, then ``hi16 * 2^-16 + (lo16 + 0.5) * 2^-32`` rounded once), ``g
   = -logf(-log1p_neg_stable(u))`` and ``x = x + g`` (``add.rn``);
3. ``argmax``: per block of 1024 columns Triton's ``tl.max(...,
   return_indices=True)`` (combine: ``a > b or (a == b and ia < ib)``), then
   ATen's argmax over the block maxima and a gather. Without NaN that is the
   first index of the row's maximum (``-0.0`` ties ``+0.0``); a NaN's fate
   depends on Triton's reduction tree (the combine keeps a NaN only as its
   second operand), which this spec does not describe: ``sample`` raises
   ValueError for NaN logits (the stated exception).

``logf`` is libdevice's ``__nv_logf`` as Triton inlines it (``fma.rn.ftz``:
every argument the sampler passes is a normal number, where ``.ftz``
changes nothing): an argument below 2^-126 is scaled by 2^23 (the outer
call's code; the inner call's argument is at least 2^-24 and Triton drops
that branch there, which changes no result); ``i = bits(x) - 0x3F2AAAAB``,
``e = i & 0xFF800000``, ``m = float(bits(x) - e) - 1``, ``n = float(e as
int32) * 2^-23`` (minus 23 after a scaling), a degree-9 Horner polynomial in
``m`` (``LOGF_POLY``), ``r = fma(n, ln2, fma(m * P, m, m))``; an infinite,
NaN or negative ``x`` gives ``fma(x, inf, inf)``. ``log1p_neg_stable(u)``:
below 0.25 the series ``-(u * fma(u, ... fma(u, 1/8, 1/7) ..., 1))`` (Triton
contracts each Horner step into ``fma.rn``), else ``logf(max(1 - u,
2^-24))``. All of it is exact integer and FP32 arithmetic but ``div_full``,
whose CPU stand-in is the IEEE division (as ``numerics`` does for every
approximate instruction). The FP64 noise (``use_fp64_gumbel``) is not
specified here.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from dspark_core.spec.numerics import F32, fma_rn

DRAFT_NOISE_SALT = 1 << 30
BLOCK = 1024
MASK32 = 0xFFFFFFFF
# libdevice's logf as Triton 3.8 inlines it: Horner coefficients, highest first.
LOGF_POLY = (0xBE055027, 0x3E1039F6, 0xBDF8CDCC, 0x3E0F2955, 0xBE2AD8B9, 0x3E4CED0B, 0xBE7FFF22, 0x3EAAAA78,
             0xBF000000)
LN2 = 0x3F317218
# The Horner constants of _log1p_neg_stable (1/8 .. 1/2, then 1) as FP32.
LOG1P_POLY = tuple(float(np.float32(1.0 / k)) for k in (8, 7, 6, 5, 4, 3, 2, 1))


def _f(word: int) -> float:
    return float(np.array(word, dtype=np.uint32).view(np.float32))


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2^32`` for int64 ``a`` in [0, 2^32) (no int64 overflow)."""
    lo = a * (c & 0xFFFF)
    hi = (a * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & MASK32


def _rotl(x: torch.Tensor, s: int) -> torch.Tensor:
    return ((x << s) | (x >> (32 - s))) & MASK32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(_rotl(_mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl(h ^ key, 13)
    return (_mul32(h, 5) + 0xE6546B64) & MASK32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor, domain: int = 0) -> torch.Tensor:
    """vLLM's ``murmur3_hash32`` (int64 tensors, broadcast): the hash of the
    seed's low and high words, the position's low word and the offset's low
    word from ``h = domain``, finalized with length 16; a uint32 as int64."""
    seed, pos, offset = (torch.as_tensor(t).to(torch.int64) for t in (seed, pos, offset))
    h = torch.full_like(seed, domain)
    h = _mix(h, seed & MASK32)
    h = _mix(h, (seed >> 32) & MASK32)
    h = _mix(h, pos & MASK32)
    h = _mix(h, offset & MASK32)
    return _fmix(h ^ 16)


def uniform32(seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """vLLM's ``murmur3_uniform32``: FP32 ``hi16 * 2^-16 + (lo16 + 0.5) *
    2^-32`` of the hash, both terms exact, one rounding (in (0, 1))."""
    r = murmur3_hash32(seed, pos, offset)
    hi = (r >> 16).to(F32) * 2.0**-16
    lo = ((r & 0xFFFF).to(F32) + 0.5) * 2.0**-32
    return hi + lo


def logf(x: torch.Tensor) -> torch.Tensor:
    """libdevice's ``logf`` as Triton inlines it (module docstring), on FP32
    ``x`` (normal positive arguments; others as stated there)."""
    x = x.to(F32)
    # A subnormal (or zero) argument is scaled by 2^23 first, the exponent by -23 after.
    tiny = x < 2.0**-126
    x = torch.where(tiny, x * 2.0**23, x)
    offset = torch.where(tiny, torch.full_like(x, -23.0), torch.zeros_like(x))
    bits = x.view(torch.int32).to(torch.int64) & MASK32
    e = ((bits - 0x3F2AAAAB) & MASK32) & 0xFF800000
    m_bits = (bits - e) & MASK32
    m = torch.where(m_bits >= 2**31, m_bits - 2**32, m_bits).to(torch.int32).view(F32) - 1.0
    e_signed = torch.where(e >= 2**31, e - 2**32, e)
    n = fma_rn(e_signed.to(F32), torch.full_like(x, 2.0**-23), offset)
    p = torch.full_like(x, _f(LOGF_POLY[0]))
    for c in LOGF_POLY[1:]:
        p = fma_rn(p, m, torch.full_like(x, _f(c)))
    q = fma_rn(m * p, m, m)
    r = fma_rn(n, torch.full_like(x, _f(LN2)), q)
    special = bits >= 0x7F800000  # +inf, NaN, and every negative (sign bit set)
    inf = torch.full_like(x, float("inf"))
    return torch.where(special, fma_rn(x, inf, inf), r)


def log1p_neg_stable(u: torch.Tensor) -> torch.Tensor:
    """vLLM's ``_log1p_neg_stable`` (``log(1 - u)``) as compiled: the series
    below 0.25, else ``logf(max(1 - u, 2^-24))``."""
    u = u.to(F32)
    p = torch.full_like(u, LOG1P_POLY[0])
    for c in LOG1P_POLY[1:]:
        p = fma_rn(u, p, torch.full_like(u, c))
    series = -(u * p)
    direct = logf(torch.clamp(1.0 - u, min=2.0**-24))
    return torch.where(u < 0.25, series, direct)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    """``-logf(-log1p_neg_stable(u))``."""
    return -logf(-log1p_neg_stable(u))


@functools.cache
def _div_full_jit():
    code = ("template <typename T> T dspark_div_full(T a, T b) { float r; "
            "asm(\"div.full.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(a), \"f\"(b)); return r; }")
    return torch.cuda.jiterator._create_jit_fn(code)


def div_full(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``div.full.f32(a, b)`` (Triton's FP32 ``/``): the instruction on a CUDA
    tensor, the IEEE division on a CPU one (its stand-in)."""
    a, b = a.to(F32), torch.as_tensor(b, dtype=F32, device=a.device).expand_as(a)
    return _div_full_jit()(a, b.contiguous()) if a.is_cuda else a / b


def block_argmax(y: torch.Tensor) -> torch.Tensor:
    """Step 3 on FP32 ``[T, V]`` without NaN: the first index of each row's
    maximum (int64). ValueError where a row has a NaN (module docstring)."""
    if torch.isnan(y).any():
        raise ValueError("NaN logits: vLLM's Gumbel argmax then depends on Triton's reduction tree, which the spec "
                         "does not describe")
    top = y.amax(-1, keepdim=True)
    idx = torch.arange(y.shape[-1], device=y.device).expand_as(y)
    return torch.where(y == top, idx, torch.full_like(idx, y.shape[-1])).amin(-1)


def sample(logits: torch.Tensor, idx_map: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
           pos: torch.Tensor, is_drafting: bool, cache: torch.Tensor | None = None, col: int | None = None):
    """``gumbel_sample(logits, idx_map, temperature, seeds, pos,
    apply_temperature=True, is_drafting, logits_cache=cache,
    logits_cache_col=col)`` with FP32 noise (module docstring): the sampled
    columns (int64 ``[T]``); ``cache`` (``[max_reqs, cols, >= V]``, the
    logits' dtype) is written in place."""
    t, v = logits.shape
    if cache is not None and (cache.dtype != logits.dtype or cache.shape[-1] < v or col is None):
        raise ValueError("the logits cache must have the logits' dtype, at least their columns, and a column")
    req = idx_map.to(torch.int64)
    valid = req >= 0
    safe = torch.where(valid, req, torch.zeros_like(req))
    temp = torch.where(valid, temperature.to(F32)[safe], torch.zeros((), dtype=F32, device=logits.device))
    seed = torch.where(valid, seeds.to(torch.int64)[safe], torch.zeros_like(req))
    if cache is not None:
        rows = req[valid]
        cache[rows, col, :v] = logits[valid]
        seed = seed ^ (int(col) << 32)
    x = logits.to(F32)
    noisy = temp != 0
    p = pos.to(torch.int64) + (DRAFT_NOISE_SALT if is_drafting else 0)
    cols = torch.arange(v, device=logits.device)
    u = uniform32(seed[:, None], p[:, None], cols[None, :])
    scaled = div_full(x, temp[:, None].expand_as(x))
    y = torch.where(noisy[:, None], scaled + gumbel_noise(u), x)
    return block_argmax(y)


def probabilistic_step(logits: torch.Tensor, scatter_index: torch.Tensor, buf: torch.Tensor, idx_map, temperature,
                       seeds, sample_pos, cache, col: int) -> torch.Tensor:
    """``DSparkSpeculator._sample_logits`` with ``draft_logits`` set and no
    watermarker, after ``apply_output_logit_transform``: the FP32 ``logits
    [R, V]`` cast to ``buf``'s dtype and scattered into ``buf [>= R,
    V_target]`` (-inf elsewhere) at ``scatter_index = arange(V) + d2t``
    (``index_copy_``), then ``sample`` at ``sample_pos - 1`` with the cache
    column ``col`` (the step): the target ids, int64 ``[R]``."""
    rows = buf[: logits.shape[0]]
    rows.index_copy_(1, scatter_index, logits.to(buf.dtype))
    return sample(rows, idx_map, temperature, seeds, sample_pos - 1, True, cache, col)


__all__ = ["BLOCK", "DRAFT_NOISE_SALT", "block_argmax", "div_full", "gumbel_noise", "log1p_neg_stable", "logf",
           "murmur3_hash32", "probabilistic_step", "sample", "uniform32"]
