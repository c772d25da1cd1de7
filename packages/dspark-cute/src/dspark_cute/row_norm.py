"""The row norm kernel: one ``dspark_core.spec.layers.RMSNorm`` over rows, bit for bit.

Layout (the reference CTA of ``dspark_core.spec.numerics``): one CTA of 256
threads per row; thread ``t`` holds fragment ``k`` = the 8 columns
``t * 8 + k * 2048 .. + 7`` for ``k < H / 2048``, read and written with
16-byte vector accesses (one per BF16/FP16 fragment, two per FP32 fragment).
The row count is a runtime argument (grid = rows), so one compile serves
every ``m``.

The norm machinery is shared (the boundary and the context norms use it):

- ``load_weight_words(dtype, base, column)``: a weight fragment's raw words;
- ``gains(norm, dtype, words)``: ``g = w + gain_center`` per column, FP32;
- ``rms_norm_fragments(norm, h, x, g, sums, warp, lane)``: the RMSNorm of
  one thread's fragments (weight before or after the norm, or none).
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils as cu_utils
import torch
from cutlass import Float32, Int32, Int64

from dspark_core.contracts.constants import NormConstants, RowNormConstants
from dspark_core.spec.numerics import check_row_width
from dspark_cute import ptx
from dspark_cute.host import (
    ELEMENT_BYTES,
    TORCH_DTYPES,
    CompileCache,
    LazyPdl,
    check_operand,
    compile_once,
    current_stream,
    fake_ptr,
    fake_stream,
    is_operand,
    ptr,
)

# ---------------------------------------------------------------- traced norm pieces


def fragment_columns(tidx, h: int) -> list:
    """The first column of each of thread ``tidx``'s fragments: ``t * 8 + k *
    2048`` for ``k < h / 2048`` (Int64)."""
    return [Int64(tidx) * ptx.VEC + k * ptx.CHUNK for k in range(h // ptx.CHUNK)]


def load_weight_words(dtype: str, base, column) -> list:
    """The raw 32-bit words of the 8 weight values from ``column`` of a
    ``dtype`` weight at byte address ``base``: 4 words (BF16/FP16 pairs) or 8
    (FP32). Kept packed until ``gains`` widens them (fewer live registers)."""
    addr = Int64(base) + Int64(column) * ELEMENT_BYTES[dtype]
    words = ptx.ld_global_v4(addr)
    if dtype == "fp32":
        words = words + ptx.ld_global_v4(addr + 16)
    return words


def gains(norm: NormConstants, words: list) -> list:
    """The 8 gains ``g = w + gain_center`` of a weight fragment's raw words:
    ``w`` widened to FP32 exactly, then one ``add.rn`` (always performed, so
    a -0.0 weight with a 0.0 center gives +0.0 as the spec does)."""
    dtype = norm.weight_dtype
    if dtype == "fp32":
        w = [ptx.as_f32(word) for word in words]
    else:
        unpack = ptx.bf16x2_to_f32 if dtype == "bf16" else ptx.f16x2_to_f32
        w = []
        for word in words:
            w.extend(unpack(word))
    center = ptx.f32_const(norm.gain_center)
    return [ptx.add_rn(v, center) for v in w]


def rms_norm_fragments(
    norm: NormConstants, h: int, x: list, weight_words: list | None, sums_addr, warp, lane,
    sum_squares=None,
) -> list:
    """``dspark_core.spec.layers.RMSNorm.forward`` over one thread's fragments
    ``x`` (lists of 8 FP32, the row widened exactly), before the output
    rounding. With ``g = gains(weight_words[k])``:

    - weight before the norm: ``x = x * g``; ``s = row_sum(x * x)``;
      ``r = inv_rms(s, h, eps)``; ``y = x * r``;
    - otherwise ``y = x * r``, then ``y = y * g`` with a weight;

    each product ``mul.rn``. ``sums_addr``: 8 FP32 of shared memory reserved
    for this norm's cross-warp fold. ``sum_squares(x)``, if given, replaces
    ``ptx.row_sum(x, sums_addr, warp, lane)`` (the row sum of the squares of
    the fragments, e.g. over a cluster). Returns the ``y`` fragments (FP32)."""
    has_weight = norm.weight_dtype is not None
    if has_weight and norm.weight_before_norm:
        x = [
            [ptx.mul_rn(v, g) for v, g in zip(f, gains(norm, words))]
            for f, words in zip(x, weight_words)
        ]
    if sum_squares is None:
        total = ptx.row_sum(x, sums_addr, warp, lane)
    else:
        total = sum_squares(x)
    r = ptx.inv_rms(total, h, norm.eps)
    y = [[ptx.mul_rn(v, r) for v in f] for f in x]
    if has_weight and not norm.weight_before_norm:
        y = [
            [ptx.mul_rn(v, g) for v, g in zip(f, gains(norm, words))]
            for f, words in zip(y, weight_words)
        ]
    return y


# ---------------------------------------------------------------- the kernel


class RowNormKernel:
    """The traced row norm of one ``RowNormConstants``; ``pdl``: launched with
    programmatic dependent launch (the weight is read before the wait, the
    rows after it). Call: ``(x, weight, out, m, stream)``: global pointers to
    the ``[m, H]`` rows, the ``[H]`` weight (any pointer where the norm has
    none: it is not read), the ``[m, H]`` output; ``m`` Int32."""

    def __init__(self, constants: RowNormConstants, pdl: bool) -> None:
        self.constants = constants
        self.pdl = pdl

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer, m: Int32, stream):
        self.kernel(x, weight, out).launch(
            grid=[m, 1, 1], block=[ptx.THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        sums = cu_utils.SmemAllocator().allocate_array(Float32, ptx.WARPS)
        _row_norm_body(
            self.constants, self.pdl, tidx, row, warp, lane, sums.toint(),
            x.toint(), weight.toint(), out.toint(),
        )


def _row_norm_body(c: RowNormConstants, pdl: bool, tidx, row, warp, lane, sums, x, w, out) -> None:
    h = c.hidden_size
    columns = fragment_columns(tidx, h)
    words = None
    if c.norm.weight_dtype is not None:
        # Constant operands: read before the wait, overlapping the previous kernel.
        words = [load_weight_words(c.norm.weight_dtype, w, col) for col in columns]
    if pdl:
        ptx.pdl_wait()
        # Dependents still wait for this grid's end before they read `out`.
        ptx.pdl_launch_dependents()
    x_row = Int64(x) + Int64(row) * (h * ELEMENT_BYTES[c.in_dtype])
    frags = [ptx.ld_row8(c.in_dtype, x_row, col) for col in columns]
    y = rms_norm_fragments(c.norm, h, frags, words, sums, warp, lane)
    out_row = Int64(out) + Int64(row) * (h * ELEMENT_BYTES[c.out_dtype])
    for col, f in zip(columns, y):
        ptx.st_row8(c.out_dtype, out_row, col, f)


def fake_args(constants: RowNormConstants) -> tuple:
    """The compile signature of ``RowNormKernel`` (no GPU memory needed)."""
    weight = constants.norm.weight_dtype or constants.in_dtype
    return (
        fake_ptr(constants.in_dtype),
        fake_ptr(weight),
        fake_ptr(constants.out_dtype),
        Int32(1),
        fake_stream(),
    )


_CACHE = CompileCache()


def compile_row_norm(constants: RowNormConstants, pdl: bool):
    """The compiled ``RowNormKernel`` of ``constants`` and ``pdl``, compiled
    once per process (RuntimeError during CUDA graph capture)."""
    return compile_once(_CACHE, "row_norm", RowNormKernel, constants, pdl, fake_args, "RowNorm")


# ---------------------------------------------------------------- host API


class RowNorm(LazyPdl):
    """``dspark_core.spec.layers.RMSNorm`` of ``constants`` bound to its weight,
    as one kernel launch: ``run(x)`` returns the same bits as the stock
    norm's ``forward(x)`` for rows ``takes(x)`` accepts.

    ``weight``: the norm's ``[H]`` weight of ``constants.norm.weight_dtype``
    (a contiguous CUDA tensor, 16-byte aligned), or None for a weightless
    norm. ``pdl``: launch with programmatic dependent launch (default: where
    the device supports it, sm_90+). Call ``prepare()`` before CUDA graph
    capture; ``run`` and ``launch`` are graph-capturable once prepared."""

    def __init__(
        self, constants: RowNormConstants, weight: torch.Tensor | None, pdl: bool | None = None
    ) -> None:
        if not isinstance(constants, RowNormConstants):
            raise ValueError(f"RowNorm takes RowNormConstants, not {type(constants).__name__}")
        check_row_width(constants.hidden_size)
        if constants.in_dtype not in ("bf16", "fp32"):
            raise ValueError(f"the row norm reads bf16 or fp32 rows, not {constants.in_dtype}")
        if constants.out_dtype not in TORCH_DTYPES:
            raise ValueError(f"the row norm writes bf16, fp16 or fp32, not {constants.out_dtype}")
        h = constants.hidden_size
        wdtype = constants.norm.weight_dtype
        if wdtype is None:
            if weight is not None:
                raise ValueError("a weightless norm's constants were given a weight")
        else:
            if wdtype not in TORCH_DTYPES:
                raise ValueError(f"a norm weight of bf16, fp16 or fp32, not {wdtype}")
            check_operand(weight, (h,), TORCH_DTYPES[wdtype], 16, "the norm weight")
        self.constants = constants
        self.weight = weight
        self.in_dtype = TORCH_DTYPES[constants.in_dtype]
        self.out_dtype = TORCH_DTYPES[constants.out_dtype]
        self.device = weight.device if weight is not None else None
        self._pdl = pdl

    def prepare(self) -> None:
        """Compile this norm's kernel (every variant it launches: there is one
        per constants and PDL setting). Call before CUDA graph capture."""
        compile_row_norm(self.constants, self.pdl)

    def takes(self, x: torch.Tensor, out: torch.Tensor | None = None) -> bool:
        """Whether the kernel covers ``x``: a contiguous CUDA tensor of the
        constants' input dtype, ``[..., H]`` with at least one row, 16-byte
        aligned, on the weight's device; and ``out`` (if given) a contiguous
        aligned tensor of ``x``'s shape in the output dtype on that device."""
        h = self.constants.hidden_size
        ok = (
            isinstance(x, torch.Tensor)
            and x.dim() >= 1
            and x.shape[-1] == h
            and x.numel() >= h
            and is_operand(x, self.in_dtype, x.shape, 16, self.device)
        )
        if ok and out is not None:
            ok = is_operand(out, self.out_dtype, x.shape, 16, x.device)
        return bool(ok)

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of ``x`` (``[..., H]``) in the output dtype, written into
        ``out`` if given; ValueError unless ``takes(x, out)``."""
        if not self.takes(x, out):
            raise ValueError(
                f"RowNorm takes a contiguous, 16-byte aligned CUDA {self.in_dtype} tensor of "
                f"[..., {self.constants.hidden_size}] with at least one row (and an output of its "
                f"shape in {self.out_dtype}) on the weight's device"
            )
        return self.launch(x, out)

    def launch(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without its operand checks (for operands checked by
        ``takes``)."""
        if out is None:
            out = torch.empty(x.shape, dtype=self.out_dtype, device=x.device)
        m = x.numel() // self.constants.hidden_size
        kernel = compile_row_norm(self.constants, self.pdl)
        weight = self.weight if self.weight is not None else x
        kernel(ptr(x), ptr(weight), ptr(out), Int32(m), current_stream())
        return out


__all__ = [
    "RowNorm",
    "RowNormKernel",
    "compile_row_norm",
    "fake_args",
    "fragment_columns",
    "gains",
    "load_weight_words",
    "rms_norm_fragments",
]
