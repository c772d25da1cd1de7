"""The residual boundary kernel: ``dspark_core.spec.layers.residual_boundary`` in
one launch, bit for bit.

Per row (one CTA of 256 threads, thread ``t`` holding the 8-column fragments
``t * 8 + k * 2048``, as the row norm):

1. ``p = post(branch)`` (``rms_norm_fragments`` of the BF16 branch read as is,
   the post-norm's row sum in shared-memory slot 0, the stock tree of its
   ``arch``), rounded to BF16;
2. ``new = alpha * stream + beta * p`` in FP32: two ``mul.rn`` and one
   ``add.rn`` per column (``alpha * stream``, which needs no norm, is taken
   before step 1 where the gates load early); stored as FP32 rows when
   ``store_stream``;
3. ``out = pre(new rounded to BF16)`` (row sum in slot 1), rounded to BF16.

The gates (``alpha``, ``beta``) and the norm weights are constants of the
boundary: ``late_gates=False`` reads them before the PDL wait (they overlap
the previous kernel; for up to one row per SM), ``late_gates=True`` after
the rows, each fragment's just before its use (fewer live registers, so more
CTAs per SM when there are many rows). With ``pdl`` each CTA releases its
dependents right after the wait; a dependent waits for this grid's end
before it reads the outputs.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64

from dspark_core.contracts.constants import BoundaryConstants, within_limits
from dspark_core.switches import flag
from dspark_cute import ptx
from dspark_cute.cutedsl.norms.rms import (
    check_arch,
    fragment_columns,
    gate_words,
    gated_residual_of,
    load_weight_words,
    rms_norm_fragments,
    stream_products,
)
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    TORCH_DTYPES,
    check_operand,
    current_stream,
    describe,
    fake_ptr,
    fake_stream,
    is_operand,
    jit_cache,
    pdl_supported,
    ptr,
    sm_count,
    smem_allocator,
)


class BoundaryKernel:
    """The traced boundary of one ``BoundaryConstants`` and variant.
    Call: ``(branch, stream, alpha, beta, post_w, pre_w, new_stream, out, m,
    cu_stream)``, global pointers: the BF16 ``[m, H]`` branch, the ``[m, H]``
    stream (BF16 if ``stream_bf16``, else FP32), the FP32 ``[H]`` gates, the
    ``[H]`` norm weights (any pointer where a norm has none: not read), the
    FP32 ``[m, H]`` new stream (any pointer without ``store_stream``: not
    written), the BF16 ``[m, H]`` output; ``m`` Int32."""

    def __init__(
        self, constants: BoundaryConstants, stream_bf16: bool, store_stream: bool,
        late_gates: bool, pdl: bool,
    ) -> None:
        self.constants = constants
        self.stream_bf16 = stream_bf16
        self.store_stream = store_stream
        self.late_gates = late_gates
        self.pdl = pdl

    @cute.jit
    def __call__(
        self, branch: cute.Pointer, stream: cute.Pointer, alpha: cute.Pointer,
        beta: cute.Pointer, post_w: cute.Pointer, pre_w: cute.Pointer,
        new_stream: cute.Pointer, out: cute.Pointer, m: Int32, cu_stream,
    ):
        self.kernel(branch, stream, alpha, beta, post_w, pre_w, new_stream, out).launch(
            grid=[m, 1, 1], block=[ptx.THREADS, 1, 1], stream=cu_stream, use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self, branch: cute.Pointer, stream: cute.Pointer, alpha: cute.Pointer,
        beta: cute.Pointer, post_w: cute.Pointer, pre_w: cute.Pointer,
        new_stream: cute.Pointer, out: cute.Pointer,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # Two folds (post, pre), each with its own 8 slots: no barrier between.
        smem = smem_allocator()
        sums = smem.allocate_array(Float32, 2 * ptx.WARPS)
        _boundary_body(
            self, tidx, warp, lane, sums.toint(),
            (branch.toint(), stream.toint(), alpha.toint(), beta.toint(),
             post_w.toint(), pre_w.toint(), new_stream.toint(), out.toint()),
        )


def _boundary_body(k: BoundaryKernel, tidx, warp, lane, sums, addrs) -> None:
    c = k.constants
    h = c.hidden_size
    branch, stream, alpha, beta, post_w, pre_w, new_stream, out = addrs
    row, _, _ = cute.arch.block_idx()
    columns = fragment_columns(tidx, h)
    gates = None
    if not k.late_gates:
        gates = [gate_words(c, alpha, beta, post_w, pre_w, col) for col in columns]
    if k.pdl:
        # Released before the wait: the GEMM after a boundary launches during
        # the tail of the branch GEMM before it and streams its weight
        # meanwhile (it still waits for this grid's end before reading).
        ptx.pdl_launch_dependents()
        ptx.pdl_wait()
    x = [ptx.ld_row8("bf16", Int64(branch) + Int64(row) * (2 * h), col) for col in columns]
    s_dtype = "bf16" if k.stream_bf16 else "fp32"
    s_row = Int64(stream) + Int64(row) * (h * (2 if k.stream_bf16 else 4))
    s = [ptx.ld_row8(s_dtype, s_row, col) for col in columns]
    a_s = None
    if k.late_gates:
        # Only the post-norm weight is needed before the first row sum.
        post_words = [
            load_weight_words(c.post.weight_dtype, post_w, col) if c.post.weight_dtype else None
            for col in columns
        ]
    else:
        post_words = [g[2] for g in gates]
        # alpha * stream needs no norm: before the post-norm (off its critical path).
        a_s = [stream_products(g[0], f) for g, f in zip(gates, s)]
    # 1. the post-norm, rounded to BF16.
    y = rms_norm_fragments(
        c.post, h, x, post_words if c.post.weight_dtype else None, sums, warp, lane
    )
    new_row = Int64(new_stream) + Int64(row) * (4 * h)
    z = []
    pre_words = []
    for i, col in enumerate(columns):
        if k.late_gates:
            products = stream_products(load_weight_words("fp32", alpha, col), s[i])
            b_words = load_weight_words("fp32", beta, col)
            pre_words.append(
                load_weight_words(c.pre.weight_dtype, pre_w, col) if c.pre.weight_dtype else None
            )
        else:
            products, b_words = a_s[i], gates[i][1]
            pre_words.append(gates[i][3])
        # 2. the gated FP32 residual (stored if asked), rounded to BF16 for the pre-norm.
        z.append(gated_residual_of(y[i], products, b_words, new_row, col, k.store_stream))
    # 3. the pre-norm of the BF16-rounded stream, rounded to BF16.
    o = rms_norm_fragments(
        c.pre, h, z, pre_words if c.pre.weight_dtype else None,
        Int32(sums) + 4 * ptx.WARPS, warp, lane,
    )
    out_row = Int64(out) + Int64(row) * (2 * h)
    for col, f in zip(columns, o):
        ptx.st_row8("bf16", out_row, col, f)


def fake_args(c: BoundaryConstants, stream_bf16: bool) -> tuple:
    """The compile signature of ``BoundaryKernel`` (no GPU memory needed)."""
    return (
        fake_ptr("bf16"),
        fake_ptr("bf16" if stream_bf16 else "fp32"),
        fake_ptr("fp32"),
        fake_ptr("fp32"),
        fake_ptr(c.post.weight_dtype or "bf16"),
        fake_ptr(c.pre.weight_dtype or "bf16"),
        fake_ptr("fp32"),
        fake_ptr("bf16"),
        Int32(1),
        fake_stream(),
    )


@jit_cache("DraftBoundary")
def compile_boundary(c: BoundaryConstants, stream_bf16: bool, store_stream: bool, late_gates: bool, pdl: bool):
    """The compiled ``BoundaryKernel`` of one variant."""
    return BoundaryKernel(c, stream_bf16, store_stream, late_gates, pdl), fake_args(c, stream_bf16)


ops.define(
    "boundary",
    "(str handle, Tensor branch, Tensor stream, bool store_stream, Tensor(a!) out, Tensor(b!)? new_stream) -> ()",
)


class DraftBoundary:
    """One residual boundary ``post -> GatedResidual -> pre`` bound to its
    constant operands: ``alpha``, ``beta`` (contiguous CUDA FP32 ``[H]``) and
    the norm weights (``[H]`` of the constants' weight dtypes, or None where
    a norm has none), each 16-byte aligned.

    ``run(branch, stream, store_stream)`` returns ``(new_stream or None,
    out)``: the FP32 ``alpha * stream + beta * post(branch)`` and the BF16
    ``pre(new_stream.to(bf16))``, the same bits as
    ``dspark_core.spec.layers.residual_boundary``. A launch of more than
    ``late_rows`` rows (default: the device's SM count) loads the constants
    after the PDL wait (``late_gates``). ``pdl``: programmatic dependent
    launch (default: where the device supports it). Call ``prepare()``
    before CUDA graph capture. Traced by torch.compile, a launch is the op
    ``torch.ops.dspark.boundary``."""

    OP = "boundary"

    def __init__(
        self,
        constants: BoundaryConstants,
        alpha: torch.Tensor,
        beta: torch.Tensor,
        post_weight: torch.Tensor | None,
        pre_weight: torch.Tensor | None,
        *,
        pdl: bool | None = None,
        late_rows: int | None = None,
    ) -> None:
        if not isinstance(constants, BoundaryConstants):
            raise ValueError(
                f"DraftBoundary takes BoundaryConstants, not {type(constants).__name__}"
            )
        h = constants.hidden_size
        within_limits(constants)
        check_arch(constants.post)
        check_arch(constants.pre)
        check_operand(alpha, (h,), torch.float32, 16, "the residual alpha")
        check_operand(beta, (h,), torch.float32, 16, "the residual beta")
        for norm, weight, name in (
            (constants.post, post_weight, "post-norm"),
            (constants.pre, pre_weight, "pre-norm"),
        ):
            if norm.weight_dtype is None:
                if weight is not None:
                    raise ValueError(f"the {name} has no weight in its constants, yet one was given")
            else:
                check_operand(weight, (h,), TORCH_DTYPES[norm.weight_dtype], 16, f"the {name} weight")
                if weight.device != alpha.device:
                    raise ValueError(f"the {name} weight is not on the gates' device")
        if beta.device != alpha.device:
            raise ValueError("alpha and beta must be on one device")
        self.constants = constants
        self.alpha, self.beta = alpha, beta
        self.post_weight, self.pre_weight = post_weight, pre_weight
        self.device = alpha.device
        self.pdl = pdl_supported(self.device) if pdl is None else flag(pdl, "pdl")
        # Up to one row per SM the constants load before the PDL wait.
        self.late_rows = sm_count(self.device) if late_rows is None else int(late_rows)
        self.op_handle = ops.register(self)

    def variant(self, m: int, stream_dtype: torch.dtype, store_stream: bool) -> tuple:
        """``(stream_bf16, store_stream, late_gates, pdl)`` of a launch of ``m`` rows."""
        return (stream_dtype == torch.bfloat16, bool(store_stream), m > self.late_rows, self.pdl)

    def prepare(self, stream_dtypes=(torch.float32, torch.bfloat16), store_stream=(False, True)):
        """Compile every variant these calls may launch (both gate timings,
        each stream dtype and store flag given). Call before CUDA graph
        capture."""
        for dtype in stream_dtypes:
            for store in store_stream:
                for late in (False, True):
                    compile_boundary(self.constants, dtype == torch.bfloat16, store, late, self.pdl)

    def problem(self, branch, stream, store_stream: bool = False, out=None, new_stream=None) -> str | None:
        """Why the kernel does not take these operands (a sentence), or None:
        a contiguous, 16-byte aligned BF16 ``[m, H]`` branch (m >= 1) and an
        FP32 or BF16 stream of its shape, both on the gates' device; ``out`` /
        ``new_stream`` (if given) contiguous, aligned BF16 / FP32 of the
        branch's shape, ``new_stream`` only with ``store_stream``."""
        h = self.constants.hidden_size
        if not (
            isinstance(branch, torch.Tensor)
            and isinstance(stream, torch.Tensor)
            and branch.dim() == 2
            and branch.shape[0] >= 1
            and branch.shape[1] == h
            and branch.dtype == torch.bfloat16
            and branch.is_contiguous()
            and branch.device == self.device
            and branch.data_ptr() % 16 == 0
            and stream.shape == branch.shape
            and stream.dtype in (torch.float32, torch.bfloat16)
            and stream.is_contiguous()
            and stream.device == self.device
            and stream.data_ptr() % 16 == 0
        ):
            return (f"DraftBoundary takes a contiguous, 16-byte aligned BF16 [m, {h}] branch (m >= 1) and an "
                    f"FP32 or BF16 stream of its shape on {self.device}, not {describe(branch)} and "
                    f"{describe(stream)}")
        shape = tuple(branch.shape)
        if out is not None and not is_operand(out, torch.bfloat16, shape, 16, self.device):
            return f"the boundary output must be a contiguous, aligned bfloat16 {list(shape)}, not {describe(out)}"
        if new_stream is not None:
            if not store_stream:
                return "a new_stream buffer was given with store_stream=False"
            if not is_operand(new_stream, torch.float32, shape, 16, self.device):
                return f"the new stream must be a contiguous, aligned float32 {list(shape)}, not {describe(new_stream)}"
        return None

    def takes(self, branch, stream, store_stream: bool = False, out=None, new_stream=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(branch, stream, store_stream, out, new_stream) is None

    def run(
        self, branch: torch.Tensor, stream: torch.Tensor, store_stream: bool,
        out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(new_stream or None, out)`` of operands the kernel takes, written
        into ``out`` / ``new_stream`` where given; ValueError with
        ``problem``'s sentence otherwise."""
        reason = self.problem(branch, stream, store_stream, out, new_stream)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(branch, stream, store_stream, out, new_stream)

    def launch(
        self, branch: torch.Tensor, stream: torch.Tensor, store_stream: bool,
        out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``run`` without its operand checks (for operands ``takes``)."""
        if out is None:
            out = torch.empty(branch.shape, dtype=torch.bfloat16, device=branch.device)
        if store_stream and new_stream is None:
            new_stream = torch.empty(branch.shape, dtype=torch.float32, device=branch.device)
        ops.launch(self, branch, stream, store_stream, out, new_stream)
        return (new_stream if store_stream else None), out

    def _launch_kernel(self, branch: torch.Tensor, stream: torch.Tensor, store_stream: bool, out: torch.Tensor,
                       new_stream: torch.Tensor | None) -> None:
        m = branch.shape[0]
        kernel = compile_boundary(self.constants, *self.variant(m, stream.dtype, store_stream))
        kernel(
            ptr(branch),
            ptr(stream),
            ptr(self.alpha),
            ptr(self.beta),
            ptr(self.post_weight if self.post_weight is not None else branch),
            ptr(self.pre_weight if self.pre_weight is not None else branch),
            ptr(new_stream if store_stream else self.alpha),
            ptr(out),
            Int32(m),
            current_stream(),
        )


__all__ = ["BoundaryKernel", "DraftBoundary", "compile_boundary", "fake_args"]
