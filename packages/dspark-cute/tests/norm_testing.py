"""Helpers of the norm-family and context tests (the row norm, the boundary,
the context norms and store, dspark-comm's all-reduce boundary): constants
built from the spec's modules for an architecture, rows with special values
planted, the stock kernels' chains (``stock.py``'s binaries), and the PTX
audit of a kernel's norms.

The GPU tests compare each kernel with the spec run on the same CUDA device
(``arch`` set on the spec's modules, so both trees run on an H200) and, where
vLLM 0.33.0 has the variant (sm_90a, H = 8192, BF16 rows, a BF16 / FP32 /
no weight, BF16 / FP32 out), with the stock kernel itself.
"""

from __future__ import annotations

import re

import torch
from stock import stock_or_skip  # re-exported: the norm GPU tests' stock launcher or a skip

from dspark_core.contracts.constants import (
    BoundaryConstants,
    ContextNormConstants,
    NormConstants,
    RowNormConstants,
    boundary_constants,
    norm_constants,
    row_norm_constants,
)
from dspark_core.reference.adapter import norm_description
from dspark_core.runtime import description as D

ARCHS = ("sm_90a", "sm_100a")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# The row width vLLM 0.33.0's carried stock norms were compiled for.
STOCK_H = 8192
STOCK_DTYPES = {None: "none", BF16: "bf16", FP32: "fp32"}
# Row counts every stock comparison runs.
STOCK_ROWS = (1, 2, 7, 16, 133, 4096)


# ---------------------------------------------------------------- constants


def with_arch(norm, arch: str):
    """The spec module ``norm`` (an ``RMSNorm``) set to follow ``arch``'s tree."""
    norm.arch = arch
    return norm


def norm_consts(norm, arch: str) -> NormConstants:
    """The planner's ``NormConstants`` of the spec ``RMSNorm`` on ``arch``."""
    return norm_constants(norm_description("a norm", norm, norm.hidden_size), norm.hidden_size, arch)


def row_consts(norm, in_dtype: torch.dtype, arch: str) -> RowNormConstants:
    """The planner's ``RowNormConstants`` of the spec ``RMSNorm`` on ``arch``."""
    return row_norm_constants(norm_description("a norm", norm, norm.hidden_size), norm.hidden_size, in_dtype, arch)


def boundary_consts(post, conn, pre, arch: str) -> BoundaryConstants:
    """The planner's ``BoundaryConstants`` of spec modules on ``arch``."""
    h = post.hidden_size
    boundary = D.Boundary(
        "a boundary",
        norm_description("the post-norm", post, h),
        D.Connection("the connection", lambda s, b: conn(s, b), conn.alpha, conn.beta),
        norm_description("the pre-norm", pre, h),
    )
    return boundary_constants(boundary, h, arch)


def context_norm_consts(hidden, pre, layers: int, arch: str) -> ContextNormConstants:
    """``ContextNormConstants`` of a hidden norm and the layers' input norm
    (``pre``, one of them: the others differ in their weights alone)."""
    return ContextNormConstants(hidden.hidden_size, layers, norm_consts(hidden, arch), norm_consts(pre, arch))


def leaves(norm: NormConstants, h: int) -> int:
    """The ``fma.rn.f32`` leaves of one norm's thread sum over rows of ``h``
    (``spec.numerics.thread_sum_of_squares``): 16 per 2048 columns, none for
    sm_100a's rounded squares."""
    scaled = norm.weight_dtype is not None and norm.weight_before_norm
    if norm.arch == "sm_100a" and not scaled:
        return 0
    return 4 * (h // 2048)


def norm_muls(norm: NormConstants, h: int) -> int:
    """The ``mul.rn.f32`` of one norm per thread: the leaves' products
    (sm_100a unscaled: every square), ``r * x``, and the weight's products."""
    frags = h // 2048
    squares = 8 * frags if leaves(norm, h) == 0 else 4 * frags
    return squares + 8 * frags + (8 * frags if norm.weight_dtype is not None else 0)


# ---------------------------------------------------------------- rows

# The order special rows are planted in (``cute_testing.special_rows``' row
# numbers), so a few rows already hold NaN, infinities, overflowing squares,
# subnormals and -0.0.
SPECIAL_ORDER = (5, 3, 7, 2, 6, 0, 4, 1, 8, 9)


def planted_rows(gen: torch.Generator, m: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """``random_rows`` with special rows planted: rows ``1 .. min(m - 1, 10)``
    are ``special_rows`` in ``SPECIAL_ORDER`` (NaN, +inf, overflowing
    squares, subnormals, -0.0 mixed in, all -0.0, -inf, ...); row 0 stays
    random but holds a -0.0 and a subnormal."""
    from cute_testing import random_rows, special_rows

    x = random_rows(gen, m, h, dtype, "cuda")
    specials = special_rows(h, dtype, "cuda")
    for i in range(1, min(m, 1 + len(SPECIAL_ORDER))):
        x[i] = specials[SPECIAL_ORDER[i - 1]]
    x[0, 3] = -0.0
    x[0, 4] = specials[2, 0]
    return x


# ---------------------------------------------------------------- the stock


def stock_has(norm, x_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether the carried stock binaries hold this norm's variant."""
    w = norm.weight.dtype if norm.weight is not None else None
    return (norm.hidden_size == STOCK_H and x_dtype == BF16 and w in STOCK_DTYPES
            and out_dtype in (BF16, FP32))


def stock_norm(stock, norm, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """vLLM's ``fused_rmsnorm_fwd`` (the carried Triton 3.8 binary) with the
    spec module's weight, eps, gain center and input scale."""
    out_dtype = out_dtype or norm.out_dtype
    if not stock_has(norm, x.dtype, out_dtype):
        raise ValueError("no stock binary of this norm variant")
    center = norm.gain_center if norm.weight is not None else 0.0
    return stock.stock_rmsnorm(x, norm.weight, norm.eps, gain_center=center,
                               input_scale=norm.weight_before_norm, out_dtype=out_dtype)


def stock_boundary(stock, post, conn, pre, branch: torch.Tensor, stream: torch.Tensor) -> tuple:
    """The stock draft layer's boundary chain on the device: the stock post
    norm, ATen's ``alpha * stream + beta * p`` in FP32 (each op its own
    kernel), the stock pre-norm of the new stream rounded to BF16;
    ``(new_stream, out)``."""
    p = stock_norm(stock, post, branch, BF16)
    new = conn.alpha * stream.to(FP32) + conn.beta * p.to(FP32)
    return new, stock_norm(stock, pre, new.to(BF16), BF16)


def stock_k_norm(k: torch.Tensor, eps: float) -> torch.Tensor:
    """The context chain's K-norm as the stock runs it (ATen on this device):
    ``k.float() * rsqrt(k.float().pow(2).mean(-1) + eps)`` to BF16."""
    kf = k.float()
    return (kf * torch.rsqrt(kf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(BF16)


# ---------------------------------------------------------------- PTX audit


def code(ptx: str) -> str:
    return "\n".join(line.split("//")[0] for line in ptx.splitlines())


def count(body: str, pattern: str) -> int:
    return len(re.findall(pattern, body, flags=re.MULTILINE))


def audit_norm_ptx(body: str, norms: list, h: int, extra_muls: int = 0) -> None:
    """The PTX ``body`` (comments removed) of a kernel holding the row norms
    ``norms`` (NormConstants, in order) over rows of ``h``: per norm one
    ``rsqrt.approx.ftz.f32`` and one ``fma.rn.f32`` (the eps) besides its
    leaves; ``mul.rn.f32`` those of the norms (``norm_muls``) plus
    ``extra_muls``; no other approximate, flushing, dividing or square-root
    instruction, no FMA of another rounding, every FP32 add/sub/mul with an
    explicit ``.rn``, no saturating conversion, no local memory."""
    assert count(body, r"\brsqrt\.approx\.ftz\.f32\b") == len(norms)
    assert count(body, r"\.approx") == len(norms), "an approximate instruction besides the norms' rsqrt"
    assert count(body, r"\.ftz") == len(norms), "a flush-to-zero instruction besides the norms' rsqrt"
    assert count(body, r"\bfma\.rn\.f32\b") == sum(leaves(n, h) + 1 for n in norms)
    assert count(body, r"\bfma\b|fma\.") == count(body, r"\bfma\.rn\.f32\b"), "an FMA of another rounding"
    assert count(body, r"\bmul\.rn\.f32\b") == sum(norm_muls(n, h) for n in norms) + extra_muls
    assert not re.search(r"\bdiv\.(rn|full|approx)|\bsqrt\.|\brcp\.|\bex2\.|\blg2\.|\bsin\.|\bcos\.|\btanh\.", body)
    for op in re.findall(r"\b(?:add|sub|mul)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op, f"an FP32 operation without an explicit rounding: {op}"
    assert "satfinite" not in body, "a saturating conversion"
    assert not re.search(r"\b(ld|st)\.local", body), "local memory (register spills)"


__all__ = [
    "ARCHS",
    "STOCK_H",
    "STOCK_ROWS",
    "audit_norm_ptx",
    "boundary_consts",
    "context_norm_consts",
    "leaves",
    "norm_consts",
    "norm_muls",
    "planted_rows",
    "row_consts",
    "stock_boundary",
    "stock_has",
    "stock_k_norm",
    "stock_norm",
    "stock_or_skip",
    "with_arch",
]
