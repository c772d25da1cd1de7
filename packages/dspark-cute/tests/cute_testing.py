"""Helpers of the dspark-cute GPU tests: random rows with special values,
poisoned outputs and the bitwise comparison (``dspark_core.tools.compare``)."""

from __future__ import annotations

import re

import pytest
import torch

from dspark_core.contracts.constants import HEAD_DIM
from dspark_core.spec.layers import HeadNorm, RMSNorm, kv_insert, qk_norm_rope
from dspark_core.tools.compare import assert_bitwise

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (run with nox -s tests-sm90 on a device machine)",
)

# Two poisons per dtype: a NaN pattern, then a finite one, so an element the
# kernel leaves unwritten shows even where the expected value is a NaN.
POISONS = {
    torch.bfloat16: (0x7FBF, 0x4B4B),
    torch.float16: (0x7FBF, 0x4B4B),
    torch.float32: (0xFFC0FFEE - 2**32, 0x4B4B4B4B),
}
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def poison(t: torch.Tensor, which: int) -> torch.Tensor:
    """Fill ``t`` with poison pattern ``which`` (0: NaN, 1: finite); returns ``t``."""
    t.view(_INT[t.dtype]).fill_(POISONS[t.dtype][which])
    return t


def check_poisoned(launch, outputs: list, expected: list, what: str) -> None:
    """Poison ``outputs`` with each pattern, call ``launch()`` (which writes
    them), and compare each to its expected tensor bit for bit (NaN == NaN)."""
    for which in (0, 1):
        for t in outputs:
            poison(t, which)
        launch()
        torch.cuda.synchronize()
        for i, (actual, exp) in enumerate(zip(outputs, expected)):
            assert_bitwise(actual, exp, f"{what} output {i} (poison {which})")


def capture_calls(fn, calls: int = 3) -> torch.cuda.CUDAGraph:
    """``fn()`` once on a fresh stream (warm-up outside the capture), then a
    CUDA graph of ``calls`` calls of it captured on that stream; synced."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return graph


def assert_replays_repeat(graph, outputs: list) -> None:
    """One more replay of ``graph`` writes the same bits into ``outputs``."""
    first = [t.clone() for t in outputs]
    graph.replay()
    torch.cuda.synchronize()
    for a, t in zip(first, outputs):
        assert torch.equal(a.view(torch.int16), t.view(torch.int16)), "replays differ"


def random_rows(gen: torch.Generator, m: int, h: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[m, h]`` of ``dtype``: normal values scaled by powers of two in
    [2^-12, 2^12] per element (a wide exponent range, so roundings matter)."""
    x = torch.randn((m, h), generator=gen, device=device, dtype=torch.float32)
    scale = torch.randint(-12, 13, (m, h), generator=gen, device=device).to(torch.float32)
    return (x * torch.exp2(scale)).to(dtype)


def special_rows(h: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Rows of special values (``dtype`` bf16 or fp32), one case a row:

    0 all -0.0; 1 all the smallest subnormal; 2 subnormals of both signs;
    3 normal values with one +inf; 4 with one -inf; 5 with one NaN;
    6 normal values with -0.0 and subnormals mixed in; 7 huge values whose
    squares overflow; 8 tiny normal values whose squares underflow;
    9 +0.0 everywhere."""
    finfo = torch.finfo(dtype)
    sub = finfo.smallest_normal / 4
    tiny = finfo.smallest_normal
    col = torch.arange(h, device=device, dtype=torch.float32)
    normal = torch.sin(col * 0.37) * 3.0
    rows = torch.zeros((10, h), device=device, dtype=torch.float32)
    rows[0] = -0.0
    rows[1] = tiny / 2 ** (8 if dtype == torch.bfloat16 else 23)
    rows[2] = torch.where(col % 2 == 0, sub, -sub)
    rows[3] = normal
    rows[3, 5] = float("inf")
    rows[4] = normal
    rows[4, h - 1] = float("-inf")
    rows[5] = normal
    rows[5, h // 2] = float("nan")
    rows[6] = torch.where(col % 3 == 0, -0.0, torch.where(col % 3 == 1, sub, normal))
    rows[7] = finfo.max / 2 * torch.sign(normal + 0.5)
    rows[8] = tiny * 3
    out = rows.to(dtype)
    # Subnormals of the dtype itself (a float32 subnormal is no bf16 one).
    out[1] = torch.full((h,), 1, dtype=torch.int16 if dtype == torch.bfloat16 else torch.int32,
                        device=device).view(dtype)
    return out


__all__ = ["assert_bitwise", "check_poisoned", "poison", "random_rows", "requires_cuda", "special_rows"]


def audit_forbidden(body: str, *, no_rcp: bool = False, explicit_rounding: bool = False) -> None:
    """What no DSpark elementwise or norm kernel's PTX ``body`` may contain:
    ``fma`` (the specs have none), ``.ftz``, ``rsqrt`` or ``.approx`` (and
    ``rcp`` where ``no_rcp``), a saturating conversion, local memory
    (spills); where ``explicit_rounding``, every FP32 add/sub/mul/div must
    carry ``.rn``."""
    assert not re.search(r"\bfma\b|fma\.", body), "an FMA in a kernel whose spec has none"
    assert ".ftz" not in body, "a flush-to-zero instruction"
    approx = r"rsqrt|\.approx|\brcp\." if no_rcp else r"rsqrt|\.approx"
    assert not re.search(approx, body), "an approximate instruction"
    assert "satfinite" not in body, "a saturating conversion (the spec rounds to inf)"
    assert not re.search(r"\b(ld|st)\.local", body), "local memory (register spills)"
    if explicit_rounding:
        for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
            assert ".rn." in op, f"an FP32 operation without an explicit rounding: {op}"


def norm_name(case) -> str:
    """A test id for a ``GPU_NORMS`` case."""
    w, center, before, eps = case
    dtype = str(w).replace("torch.", "") if w is not None else "noweight"
    return f"{dtype}-c{center}-{'before' if before else 'after'}-eps{eps}"


def make_norm(case, h: int, gen: torch.Generator, special_weight: bool = False, out_dtype=torch.bfloat16):
    """The stock ``RMSNorm`` of a ``GPU_NORMS`` case, output ``out_dtype``,
    on CUDA, with a random weight (around 1 for center 0, around 0 for
    center 1); with ``special_weight`` some entries -0.0, subnormal, large or
    cancelling the center."""
    w_dtype, center, before, eps = case
    norm = RMSNorm(h, eps, has_weight=w_dtype is not None, weight_dtype=w_dtype or torch.bfloat16,
                   gain_center=center, weight_before_norm=before, out_dtype=out_dtype).cuda()
    if w_dtype is not None:
        w = torch.randn(h, generator=gen, device="cuda") * 0.25 + (1.0 - center)
        if special_weight:
            w[0::97] = -0.0
            w[1::97] = torch.finfo(w_dtype).smallest_normal / 2
            w[2::97] = 300.0
            w[3::97] = -1.0 - center
        norm.weight.data.copy_(w.to(w_dtype))
    return norm


def has_f32_constant(ptx: str, bits: int) -> bool:
    """Whether the PTX materializes the FP32 constant of these bits: as a hex
    float immediate (``0f80000000``, CuTe DSL 4.3) or as a ``mov.b32`` of the
    signed decimal integer (``-2147483648``, CuTe DSL 4.8)."""
    signed = bits - (1 << 32) if bits & 0x80000000 else bits
    return f"0f{bits:08x}" in ptx.lower() or re.search(rf"mov\.b32\s+%r\d+, {signed};", ptx) is not None


# The norm variants the compile tests cover: (weight dtype name or None,
# weight before the norm); ``norm_constants(i)`` adds an eps and a gain center.
WEIGHT_KINDS = [
    (None, False),
    ("bf16", False),
    ("bf16", True),
    ("fp16", False),
    ("fp16", True),
    ("fp32", False),
    ("fp32", True),
]
# 16-byte accesses per 8-column fragment, by weight dtype name.
WORDS = {"bf16": 1, "fp16": 1, "fp32": 2}


def norm_constants(i: int):
    """``NormConstants`` of variant ``i`` of ``WEIGHT_KINDS``."""
    from dspark_core.contracts.constants import NormConstants

    dtype, before = WEIGHT_KINDS[i]
    return NormConstants(
        eps=(1e-6, 1e-5, 0.1)[i % 3], weight_dtype=dtype, gain_center=float(i % 2), weight_before_norm=before
    )


# The norm variants the GPU tests run: (weight dtype or None, gain center,
# weight before the norm, eps).
GPU_NORMS = [
    (None, 0.0, False, 1e-6),
    (torch.bfloat16, 0.0, False, 1e-6),
    (torch.bfloat16, 1.0, True, 1e-5),
    (torch.float16, 1.0, False, 1e-6),
    (torch.float16, 0.0, True, 0.1),
    (torch.float32, 0.0, True, 1e-6),
    (torch.float32, 1.0, False, 1e-5),
]


def stock_attention(config, gen: torch.Generator):
    """A stock ``DraftAttention`` of ``config`` on CUDA with random weights
    (the QKV projection N(0, 1/H); a q-norm weight around 1 with -0.0 and -1.5
    planted) and its RoPE table, ``(attn, cos_sin or None)``."""
    from dspark_core.reference.model import DraftAttention
    from dspark_core.spec.layers import Rotary

    bf16 = torch.bfloat16
    table_dtype = torch.float32 if config.rope_table_dtype == "fp32" else bf16
    rotary = (Rotary(config.head_dim, config.max_position, config.rope_theta, table_dtype).cuda()
              if config.use_rope else None)
    attn = DraftAttention(config, rotary).cuda()
    w = torch.randn(attn.qkv_proj.shape, generator=gen, device="cuda") / config.hidden_size**0.5
    attn.qkv_proj.data.copy_(w.to(bf16))
    if attn.q_norm.weight is not None:
        qw = 1.0 + 0.2 * torch.randn(64, generator=gen, device="cuda")
        qw[5], qw[17] = -0.0, -1.5
        attn.q_norm.weight.data.copy_(qw.to(bf16))
    return attn, (rotary.cos_sin if rotary is not None else None)


def refuse(kernel, *operands, **options) -> None:
    """ValueError with ``kernel.problem(*operands)``'s sentence where the
    kernel does not take the operands (the host classes' contract), else
    nothing: the operand checks alone, with no launch."""
    problem = kernel.problem(*operands, **options)
    if problem is not None:
        raise ValueError(problem)


def qkv_epilogue_spec(s, qkv: torch.Tensor, pos, slots, cache: torch.Tensor) -> None:
    """The spec's QKV epilogue on CUDA, in place on ``qkv`` (rows ``[q | k |
    v | ...]`` of ``s.nq`` q heads, ``s.kv`` KV heads) and ``cache``: q and k
    heads ``qk_norm_rope`` (``s.q_eps``, ``s.k_eps``, ``s.rotary``), then
    ``kv_insert`` of k and v at ``slots``. ``s``: a QKV test setup."""
    m = qkv.shape[0]
    q = qkv[:, : s.q_size].reshape(m, s.nq, HEAD_DIM)
    k = qkv[:, s.q_size : s.q_size + s.kv_size].reshape(m, s.kv, HEAD_DIM)
    v = qkv[:, s.q_size + s.kv_size : s.q_size + 2 * s.kv_size].reshape(m, s.kv, HEAD_DIM)
    q = qk_norm_rope(q, HeadNorm(HEAD_DIM, s.q_eps), pos, s.rotary)
    k = qk_norm_rope(k, HeadNorm(HEAD_DIM, s.k_eps), pos, s.rotary)
    kv_insert(cache, k, v, slots)
    qkv[:, : s.q_size] = q.reshape(m, -1)
    qkv[:, s.q_size : s.q_size + s.kv_size] = k.reshape(m, -1)


def qkv_epilogue_stock(s, ops, qkv: torch.Tensor, pos, slots, cache: torch.Tensor, block: int) -> None:
    """vLLM's stock ``fused_muse_spark_qknorm_rope_kv_insert`` (``ops``,
    ``stock.py``'s launcher), in place on ``qkv`` and ``cache`` (blocks of
    ``block`` slots), with ``s``'s heads, eps and RoPE table (None: no RoPE)."""
    if s.q_eps != s.k_eps:
        raise ValueError("the stock takes one eps for q and k")
    rope = s.table is not None
    ops.stock_qknorm_rope_kv_insert(qkv, pos, s.nq, s.kv, HEAD_DIM, s.q_eps, s.table if rope else None,
                                    HEAD_DIM if rope else 0, slots, cache, block)


# Physical orders the insert tests write through, by vLLM 0.33.0's
# KVCacheLayout names: the two layer-outermost ones (LBNHC, vLLM's default on
# sm_90; LBHNC) and a block-outermost one, BLNHC, where another layer's rows
# lie between this layer's blocks (a block stride of two layers' pages).
CACHE_LAYOUTS = ("LBHNC", "LBNHC", "BLNHC")


def layout_cache(layout: str, num_blocks: int, kv_heads: int, block_size: int, device="cuda") -> torch.Tensor:
    """The logical BF16 view ``[num_blocks, kv_heads, block_size, 128]`` of
    one layer's cache in ``layout``'s physical order (with BLNHC the second
    of two interleaved layers), uninitialized; ``whole(view)`` is the
    allocation (to poison and compare every byte, the other layer's
    included)."""
    w = 2 * HEAD_DIM
    if layout == "LBHNC":
        return torch.empty((num_blocks, kv_heads, block_size, w), dtype=torch.bfloat16, device=device)
    if layout == "LBNHC":
        phys = torch.empty((num_blocks, block_size, kv_heads, w), dtype=torch.bfloat16, device=device)
        return phys.permute(0, 2, 1, 3)
    if layout == "BLNHC":
        phys = torch.empty((num_blocks, 2, block_size, kv_heads, w), dtype=torch.bfloat16, device=device)
        return phys[:, 1].permute(0, 2, 1, 3)
    raise ValueError(f"no test layout {layout!r}")


def whole(t: torch.Tensor) -> torch.Tensor:
    """The allocation a view ``t`` lies in (``t`` where it is one)."""
    return t if t._base is None else t._base
