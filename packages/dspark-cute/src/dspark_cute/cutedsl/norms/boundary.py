"""The residual boundary kernel: ``dspark_core.spec.layers.residual_boundary`` in
one launch, bit for bit.

Per row (one CTA of 256 threads, thread ``t`` holding the 8-column fragments
``t * 8 + k * 2048``, as the row norm):

1. ``p = post(branch)`` (``rms_norm_fragments`` of the BF16 branch read as is,
   the post-norm's row sum in shared-memory slot 0), rounded to BF16;
2. ``new = alpha * stream + beta * p`` in FP32: two ``mul.rn`` and one
   ``add.rn`` per column; stored as FP32 rows when ``store_stream``;
3. ``out = pre(new rounded to BF16)`` (row sum in slot 1), rounded to BF16.

The gates (``alpha``, ``beta``) and the norm weights are constants of the
boundary: ``late_gates=False`` reads them before the PDL wait (they overlap
the previous kernel; for up to one row per SM), ``late_gates=True`` after
the rows, each fragment's just before its use (fewer live registers, so more
CTAs per SM when there are many rows). With ``pdl`` each CTA releases its
dependents right after the wait; a dependent waits for this grid's end
before it reads the outputs.

``split`` (opt-in, early gates): the row is split over a cluster of
``H / 2048`` CTAs, CTA ``k`` holding fragment ``k`` of every reference thread,
the fragment sums exchanged through distributed shared memory
(``ptx.cluster_row_sum``: the same tree, bit for bit). Measured on an H200
(H = 8192, CUDA graphs) it was no faster than one CTA a row (3.03 against
3.14 us at 1 row, 3.40 against 3.32 at 16, 5.84 against 3.56 at 64), so
``DraftBoundary`` does not split unless asked (``split_rows``).
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils as cu_utils
import torch
from cutlass import Float32, Int32, Int64

from dspark_core.contracts.constants import BoundaryConstants
from dspark_core.spec.numerics import check_row_width
from dspark_cute import ptx
from dspark_cute.cutedsl.norms.rms import (
    fragment_columns,
    gate_words,
    gated_residual,
    load_weight_words,
    rms_norm_fragments,
)
from dspark_cute.runtime.host import (
    TORCH_DTYPES,
    CompileCache,
    check_operand,
    compile_kernel,
    current_stream,
    fake_ptr,
    fake_stream,
    pdl_supported,
    ptr,
    sm_count,
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
        late_gates: bool, pdl: bool, split: bool = False,
    ) -> None:
        if split and (late_gates or split_ranks(constants.hidden_size) == 1):
            raise ValueError("a split boundary loads its gates early and needs 2 to 8 fragments a row")
        self.constants = constants
        self.stream_bf16 = stream_bf16
        self.store_stream = store_stream
        self.late_gates = late_gates
        self.pdl = pdl
        self.split = split
        # CTAs per row: one per fragment when split.
        self.ranks = split_ranks(constants.hidden_size) if split else 1
        self.cluster = [self.ranks, 1, 1] if split else None

    @cute.jit
    def __call__(
        self, branch: cute.Pointer, stream: cute.Pointer, alpha: cute.Pointer,
        beta: cute.Pointer, post_w: cute.Pointer, pre_w: cute.Pointer,
        new_stream: cute.Pointer, out: cute.Pointer, m: Int32, cu_stream,
    ):
        self.kernel(branch, stream, alpha, beta, post_w, pre_w, new_stream, out).launch(
            grid=[m * self.ranks, 1, 1], block=[ptx.THREADS, 1, 1], cluster=self.cluster,
            stream=cu_stream, use_pdl=self.pdl,
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
        # Two folds (post, pre), each with its own 8 slots: no barrier between;
        # split, two arrays of 256 fragment sums (post, pre) follow.
        smem = cu_utils.SmemAllocator()
        sums = smem.allocate_array(Float32, 2 * ptx.WARPS + (2 * ptx.THREADS if self.split else 0))
        _boundary_body(
            self, tidx, warp, lane, sums.toint(),
            (branch.toint(), stream.toint(), alpha.toint(), beta.toint(),
             post_w.toint(), pre_w.toint(), new_stream.toint(), out.toint()),
        )


def split_ranks(h: int) -> int:
    """CTAs per row of a split boundary: one per 2048-column fragment, when
    that is a cluster size every sm_90 GPU launches (2 to 8); else 1."""
    frags = h // ptx.CHUNK
    return frags if 2 <= frags <= 8 else 1


def _boundary_body(k: BoundaryKernel, tidx, warp, lane, sums, addrs) -> None:
    c = k.constants
    h = c.hidden_size
    branch, stream, alpha, beta, post_w, pre_w, new_stream, out = addrs
    post_sum = pre_sum = None
    if k.split:
        row = ptx.cluster_id_x()
        rank = ptx.cluster_rank()
        columns = [Int64(rank) * ptx.CHUNK + Int64(tidx) * ptx.VEC]
        fsums = Int32(sums) + 8 * ptx.WARPS  # after the 16 fold slots
        ranks = k.ranks

        def post_sum(x):
            return ptx.cluster_row_sum(x[0], ranks, fsums, sums, tidx, warp, lane)

        def pre_sum(x):
            total = ptx.cluster_row_sum(
                x[0], ranks, fsums + 4 * ptx.THREADS, Int32(sums) + 4 * ptx.WARPS, tidx, warp, lane
            )
            # This CTA has read the others' pre sums: they may exit once all arrive.
            ptx.cluster_arrive()
            return total
    else:
        row, _, _ = cute.arch.block_idx()
        columns = fragment_columns(tidx, h)
    gates = None
    if not k.late_gates:
        gates = [gate_words(c, alpha, beta, post_w, pre_w, col) for col in columns]
    if k.pdl:
        ptx.pdl_wait()
        ptx.pdl_launch_dependents()
    x = [ptx.ld_row8("bf16", Int64(branch) + Int64(row) * (2 * h), col) for col in columns]
    s_dtype = "bf16" if k.stream_bf16 else "fp32"
    s_row = Int64(stream) + Int64(row) * (h * (2 if k.stream_bf16 else 4))
    s = [ptx.ld_row8(s_dtype, s_row, col) for col in columns]
    if k.late_gates:
        # Only the post-norm weight is needed before the first row sum.
        post_words = [
            load_weight_words(c.post.weight_dtype, post_w, col) if c.post.weight_dtype else None
            for col in columns
        ]
    else:
        post_words = [g[2] for g in gates]
    # 1. the post-norm, rounded to BF16.
    y = rms_norm_fragments(
        c.post, h, x, post_words if c.post.weight_dtype else None, sums, warp, lane, post_sum
    )
    new_row = Int64(new_stream) + Int64(row) * (4 * h)
    z = []
    pre_words = []
    for i, col in enumerate(columns):
        if k.late_gates:
            a_words = load_weight_words("fp32", alpha, col)
            b_words = load_weight_words("fp32", beta, col)
            pre_words.append(
                load_weight_words(c.pre.weight_dtype, pre_w, col) if c.pre.weight_dtype else None
            )
        else:
            a_words, b_words = gates[i][0], gates[i][1]
            pre_words.append(gates[i][3])
        # 2. the gated FP32 residual (stored if asked), rounded to BF16 for the pre-norm.
        z.append(gated_residual(y[i], s[i], a_words, b_words, new_row, col, k.store_stream))
    # 3. the pre-norm of the BF16-rounded stream, rounded to BF16.
    o = rms_norm_fragments(
        c.pre, h, z, pre_words if c.pre.weight_dtype else None,
        Int32(sums) + 4 * ptx.WARPS, warp, lane, pre_sum,
    )
    out_row = Int64(out) + Int64(row) * (2 * h)
    for col, f in zip(columns, o):
        ptx.st_row8("bf16", out_row, col, f)
    if k.split:
        # No CTA leaves while another may still read its shared memory.
        ptx.cluster_wait()


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


_CACHE = CompileCache()


def compile_boundary(
    c: BoundaryConstants, stream_bf16: bool, store_stream: bool, late_gates: bool, pdl: bool,
    split: bool = False,
):
    """The compiled ``BoundaryKernel`` of one variant, compiled once per
    process (RuntimeError during CUDA graph capture)."""
    key = ("boundary", c.key(), stream_bf16, store_stream, late_gates, pdl, split)
    return _CACHE.get(
        key,
        lambda: compile_kernel(
            BoundaryKernel(c, stream_bf16, store_stream, late_gates, pdl, split),
            *fake_args(c, stream_bf16),
            what="DraftBoundary",
        ),
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
    after the PDL wait (``late_gates``); a launch of at most ``split_rows``
    early-gates rows (default 0: never) splits each row over a cluster of
    ``H / 2048`` CTAs (the module docstring says why it is off).
    ``pdl``: launch with programmatic dependent launch (default: where the
    device supports it). Call ``prepare()`` before CUDA graph capture."""

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
        split_rows: int | None = None,
    ) -> None:
        if not isinstance(constants, BoundaryConstants):
            raise ValueError(
                f"DraftBoundary takes BoundaryConstants, not {type(constants).__name__}"
            )
        h = constants.hidden_size
        check_row_width(h)
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
                if norm.weight_dtype not in TORCH_DTYPES:
                    raise ValueError(f"a {name} weight of bf16, fp16 or fp32, not {norm.weight_dtype}")
                check_operand(weight, (h,), TORCH_DTYPES[norm.weight_dtype], 16, f"the {name} weight")
                if weight.device != alpha.device:
                    raise ValueError(f"the {name} weight is not on the gates' device")
        if beta.device != alpha.device:
            raise ValueError("alpha and beta must be on one device")
        self.constants = constants
        self.alpha, self.beta = alpha, beta
        self.post_weight, self.pre_weight = post_weight, pre_weight
        self.device = alpha.device
        self.pdl = pdl_supported(self.device) if pdl is None else bool(pdl)
        # Up to one row per SM the constants load before the PDL wait.
        self.late_rows = sm_count(self.device) if late_rows is None else int(late_rows)
        # Splitting needs 2 to 8 fragments a row (a cluster size every sm_90 launches).
        self.split_rows = int(split_rows or 0) if split_ranks(h) > 1 else 0

    def variant(self, m: int, stream_dtype: torch.dtype, store_stream: bool) -> tuple:
        """``(stream_bf16, store_stream, late_gates, pdl, split)`` of a launch
        of ``m`` rows (a split launch loads its gates early)."""
        late = m > self.late_rows
        split = not late and m <= self.split_rows
        return (stream_dtype == torch.bfloat16, bool(store_stream), late, self.pdl, split)

    def prepare(self, stream_dtypes=(torch.float32, torch.bfloat16), store_stream=(False, True)):
        """Compile every variant these calls may launch (both gate timings
        and the split kernel, each stream dtype and store flag given). Call before CUDA graph
        capture."""
        timings = [(False, False), (True, False)]  # (late gates, split)
        if self.split_rows > 0:
            timings.append((False, True))
        for dtype in stream_dtypes:
            for store in store_stream:
                for late, split in timings:
                    compile_boundary(
                        self.constants, dtype == torch.bfloat16, store, late, self.pdl, split
                    )

    def takes(self, branch: torch.Tensor, stream: torch.Tensor) -> bool:
        """Whether the kernel covers these rows: a contiguous, 16-byte aligned
        BF16 ``[m, H]`` branch (m >= 1) and an FP32 or BF16 stream of its
        shape, both on the gates' device."""
        h = self.constants.hidden_size
        return bool(
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
        )

    def run(
        self, branch: torch.Tensor, stream: torch.Tensor, store_stream: bool,
        out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(new_stream or None, out)`` of rows ``takes`` accepts, written
        into ``out`` / ``new_stream`` where given (contiguous, aligned, BF16
        and FP32 of the branch's shape); ValueError otherwise."""
        h = self.constants.hidden_size
        if not self.takes(branch, stream):
            raise ValueError(
                f"DraftBoundary takes a contiguous, 16-byte aligned BF16 [m, {h}] branch (m >= 1) "
                f"and an FP32 or BF16 stream of its shape on {self.device}"
            )
        shape = tuple(branch.shape)
        if out is not None:
            check_operand(out, shape, torch.bfloat16, 16, "the boundary output")
        if new_stream is not None:
            if not store_stream:
                raise ValueError("a new_stream buffer was given with store_stream=False")
            check_operand(new_stream, shape, torch.float32, 16, "the new stream")
        return self.launch(branch, stream, store_stream, out, new_stream)

    def launch(
        self, branch: torch.Tensor, stream: torch.Tensor, store_stream: bool,
        out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``run`` without its operand checks (for operands checked by
        ``takes``)."""
        m = branch.shape[0]
        kernel = compile_boundary(self.constants, *self.variant(m, stream.dtype, store_stream))
        if out is None:
            out = torch.empty(branch.shape, dtype=torch.bfloat16, device=branch.device)
        if store_stream and new_stream is None:
            new_stream = torch.empty(branch.shape, dtype=torch.float32, device=branch.device)
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
        return (new_stream if store_stream else None), out


__all__ = ["BoundaryKernel", "DraftBoundary", "compile_boundary", "fake_args"]
