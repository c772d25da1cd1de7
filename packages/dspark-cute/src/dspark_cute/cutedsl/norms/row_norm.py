"""The row norm kernel: one ``dspark_core.spec.layers.RMSNorm`` over rows, bit for
bit (the stock Triton norm ``fused_rmsnorm_fwd`` on the constants' ``arch``).

Layout (the stock norm's CTA, ``dspark_core.spec.numerics``): one CTA of 256
threads per row; thread ``t`` holds fragment ``k`` = the 8 columns
``t * 8 + k * 2048 .. + 7`` for ``k < H / 2048``, read and written with
16-byte vector accesses (one per BF16/FP16 fragment, two per FP32 fragment).
Per row: the weight's fragments (before the PDL wait), the row's, then
``rms_norm_fragments``: the gains ``w + c``, the stock tree of
``norm.arch`` (sm_90a: fma leaves, pairwise; sm_100a: even and odd
pairwise trees), the warp butterfly and the CTA fold,
``rsqrt.approx.ftz(fma(s, 1/H, eps))``, the products, one rounding at the
store. The row count is a runtime argument (grid = rows), so one compile
serves every ``m``.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64

from dspark_core.contracts.constants import RowNormConstants, within_limits
from dspark_cute import ptx
from dspark_cute.cutedsl.norms.rms import (
    check_arch,
    fragment_columns,
    load_weight_words,
    rms_norm_fragments,
)
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    ELEMENT_BYTES,
    TORCH_DTYPES,
    LazyPdl,
    check_operand,
    current_stream,
    describe,
    fake_ptr,
    fake_stream,
    is_operand,
    jit_cache,
    ptr,
    smem_allocator,
)

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
        sums = smem_allocator().allocate_array(Float32, ptx.WARPS)
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
        # Released before the wait: the GEMM after this norm launches during
        # the tail of the grid before it and streams its weight meanwhile
        # (it still waits for this grid's end before it reads `out`).
        ptx.pdl_launch_dependents()
        ptx.pdl_wait()
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


@jit_cache("RowNorm")
def compile_row_norm(constants: RowNormConstants, pdl: bool):
    """The compiled ``RowNormKernel`` of ``constants`` and ``pdl``."""
    return RowNormKernel(constants, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("row_norm", "(str handle, Tensor x, Tensor(a!) out) -> ()")


class RowNorm(LazyPdl):
    """``dspark_core.spec.layers.RMSNorm`` of ``constants`` bound to its weight,
    as one kernel launch: ``run(x)`` returns the same bits as the stock
    norm's ``forward(x)`` for rows ``takes(x)`` accepts.

    ``weight``: the norm's ``[H]`` weight of ``constants.norm.weight_dtype``
    (a contiguous CUDA tensor, 16-byte aligned), or None for a weightless
    norm. ``pdl``: launch with programmatic dependent launch (default: where
    the device supports it, sm_90+). Call ``prepare()`` before CUDA graph
    capture; ``run`` and ``launch`` are graph-capturable once prepared.
    Traced by torch.compile, a launch is the op ``torch.ops.dspark.row_norm``."""

    OP = "row_norm"

    def __init__(
        self, constants: RowNormConstants, weight: torch.Tensor | None, pdl: bool | None = None
    ) -> None:
        if not isinstance(constants, RowNormConstants):
            raise ValueError(f"RowNorm takes RowNormConstants, not {type(constants).__name__}")
        within_limits(constants)
        check_arch(constants.norm)
        h = constants.hidden_size
        wdtype = constants.norm.weight_dtype
        if wdtype is None:
            if weight is not None:
                raise ValueError("a weightless norm's constants were given a weight")
        else:
            check_operand(weight, (h,), TORCH_DTYPES[wdtype], 16, "the norm weight")
        self.constants = constants
        self.weight = weight
        self.in_dtype = TORCH_DTYPES[constants.in_dtype]
        self.out_dtype = TORCH_DTYPES[constants.out_dtype]
        self.device = weight.device if weight is not None else None
        self._pdl = pdl
        self.op_handle = ops.register(self)

    def prepare(self) -> None:
        """Compile this norm's kernel (every variant it launches: there is one
        per constants and PDL setting). Call before CUDA graph capture."""
        compile_row_norm(self.constants, self.pdl)

    def problem(self, x, out=None) -> str | None:
        """Why the kernel does not take ``x`` (and ``out``), or None: ``x`` a
        contiguous CUDA tensor of the constants' input dtype, ``[..., H]``
        with at least one row, 16-byte aligned, on the weight's device; ``out``
        (if given) a contiguous aligned tensor of ``x``'s shape in the output
        dtype on that device."""
        h = self.constants.hidden_size
        if not (
            isinstance(x, torch.Tensor)
            and x.dim() >= 1
            and x.shape[-1] == h
            and x.numel() >= h
            and is_operand(x, self.in_dtype, x.shape, 16, self.device)
        ):
            return (f"RowNorm takes a contiguous, 16-byte aligned CUDA {self.in_dtype} tensor of [..., {h}] with "
                    f"at least one row on the weight's device, not {describe(x)}")
        if out is not None and not is_operand(out, self.out_dtype, x.shape, 16, x.device):
            return (f"RowNorm writes a contiguous, 16-byte aligned {self.out_dtype} output of x's shape, "
                    f"not {describe(out)}")
        return None

    def takes(self, x, out=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(x, out) is None

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of ``x`` (``[..., H]``) in the output dtype, written into
        ``out`` if given; ValueError with ``problem``'s sentence otherwise."""
        reason = self.problem(x, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(x, out)

    def launch(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without its operand checks (for operands checked by
        ``takes``)."""
        if out is None:
            out = torch.empty(x.shape, dtype=self.out_dtype, device=x.device)
        ops.launch(self, x, out)
        return out

    def _launch_kernel(self, x: torch.Tensor, out: torch.Tensor) -> None:
        m = x.numel() // self.constants.hidden_size
        kernel = compile_row_norm(self.constants, self.pdl)
        weight = self.weight if self.weight is not None else x
        kernel(ptr(x), ptr(weight), ptr(out), Int32(m), current_stream())


__all__ = [
    "RowNorm",
    "RowNormKernel",
    "compile_row_norm",
    "fake_args",
]
