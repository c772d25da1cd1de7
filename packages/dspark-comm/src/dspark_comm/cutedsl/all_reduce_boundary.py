"""The draft's residual boundary as an epilogue of the mailbox all-reduce:
the branch's all-reduce and ``dspark_core.spec.layers.residual_boundary`` in one
kernel, bit for bit the stock all-reduce followed by the stock boundary.

The all-reduce kernel's CTA for a row holds the whole summed row in the
layout of the stock norm's CTA (thread ``t``: fragments ``t * 8 + k *
2048``, ``dspark_core.spec.numerics``), so the boundary runs on it exactly as
``dspark_cute``'s ``DraftBoundary`` runs on a loaded branch, with its
building blocks (``rms_norm_fragments``, ``gate_words``, ``stream_products``,
``gated_residual_of``):
each norm's thread sum is the stock tree of its constants' ``arch`` over the
thread's own fragments (sm_90a: per fragment ``(p0 + p1) + (p2 + p3)``, ``p_k
= fma(e_2k, e_2k, e_(2k+1)^2)``, pairwise over the fragments; sm_100a: even
and odd partials per fragment, each pairwise over the fragments, then their
sum), the warp butterfly, the CTA fold of the 8 warp sums in shared memory,
``rsqrt.approx.ftz(fma(s, 1/H, eps))``:

1. ``p = post(branch)``, ``branch`` the all-reduce's BF16 output (the sum of
   the mailbox's sum order, rounded to BF16), the post-norm's row sum in
   shared-memory words 0-7; ``p`` rounded to BF16;
2. ``new = alpha * stream + beta * p`` in FP32 (two ``mul.rn``, one
   ``add.rn`` per column; ``alpha * stream`` taken in ``late``, before the
   peers' partials are polled), stored as FP32 rows when ``store_stream``;
3. ``out = pre(new rounded to BF16)`` (row sum in words 8-15), rounded to BF16.

The gates and norm weights load before the PDL wait (``early``), the stream
after it but before the peers' partials are polled (``late``), so both
overlap the wait for the peers.
"""

from __future__ import annotations

import logging

import torch
from cutlass import Int32, Int64

from dspark_comm.cutedsl.allreduce import Epilogue, FusedAllReduce, RowContext, zero_sign_epilogue
from dspark_comm.protocol import fallback_reason
from dspark_core.contracts.constants import FP32_RANK_ORDER, BoundaryConstants
from dspark_cute import ptx
from dspark_cute.cutedsl.norms.boundary import DraftBoundary
from dspark_cute.cutedsl.norms.rms import gate_words, gated_residual_of, rms_norm_fragments, stream_products
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import check_operand

log = logging.getLogger("dspark.comm")


class BoundaryEpilogue(Epilogue):
    """The residual boundary of ``constants`` over the summed branch row.
    Operands: the ``[m, H]`` stream (BF16 if ``stream_bf16``, else FP32),
    the FP32 ``[H]`` alpha and beta, the ``[H]`` post and pre norm weights
    (any address where a norm has none: not read), the FP32 ``[m, H]`` new
    stream (any address without ``store_stream``: not written) and the BF16
    ``[m, H]`` output."""

    operands = ("stream", "alpha", "beta", "post_weight", "pre_weight", "new_stream", "out")

    def __init__(self, constants: BoundaryConstants, stream_bf16: bool, store_stream: bool) -> None:
        if not isinstance(constants, BoundaryConstants):
            raise ValueError(f"the boundary epilogue takes BoundaryConstants, not {type(constants).__name__}")
        self.constants = constants
        self.stream_bf16 = bool(stream_bf16)
        self.store_stream = bool(store_stream)

    def key(self) -> tuple:
        return ("boundary", self.constants.key(), self.stream_bf16, self.store_stream)

    def early(self, ctx: RowContext):
        _, alpha, beta, post_w, pre_w, _, _ = ctx.operands[:7]
        return [gate_words(self.constants, alpha, beta, post_w, pre_w, col) for col in ctx.columns]

    def late(self, ctx: RowContext, gates):
        h = ctx.hidden_size
        dtype = "bf16" if self.stream_bf16 else "fp32"
        s_row = Int64(ctx.operands[0]) + Int64(ctx.row) * (h * (2 if self.stream_bf16 else 4))
        s = [ptx.ld_row8(dtype, s_row, col) for col in ctx.columns]
        # alpha * stream needs no norm: taken while the peers' partials arrive.
        return gates, [stream_products(g[0], f) for g, f in zip(gates, s)]

    def finish(self, ctx: RowContext, state, values: list) -> None:
        c = self.constants
        h = ctx.hidden_size
        gates, a_s = state
        new_stream, out = ctx.operands[5], ctx.operands[6]
        # 1. the post-norm of the all-reduced branch, rounded to BF16.
        y = rms_norm_fragments(
            c.post, h, values, [g[2] for g in gates] if c.post.weight_dtype else None,
            ctx.smem, ctx.warp, ctx.lane,
        )
        new_row = Int64(new_stream) + Int64(ctx.row) * (4 * h)
        # 2. the gated FP32 residual (stored if asked), rounded to BF16 for the pre-norm.
        z = [
            gated_residual_of(y[i], a_s[i], g[1], new_row, col, self.store_stream)
            for i, (col, g) in enumerate(zip(ctx.columns, gates))
        ]
        # 3. the pre-norm of the BF16-rounded stream, rounded to BF16.
        o = rms_norm_fragments(
            c.pre, h, z, [g[3] for g in gates] if c.pre.weight_dtype else None,
            Int32(ctx.smem) + 4 * ptx.WARPS, ctx.warp, ctx.lane,
        )
        out_row = Int64(out) + Int64(ctx.row) * (2 * h)
        for col, f in zip(ctx.columns, o):
            ptx.st_row8("bf16", out_row, col, f)


ops.define(
    "all_reduce_boundary",
    "(str handle, Tensor? partial, Tensor stream, bool store_stream, Tensor(a!) out, Tensor(b!)? new_stream, "
    "bool published, Tensor(c!) mailbox) -> ()",
)


class AllReduceBoundary:
    """One residual boundary whose branch arrives as per-rank partials: the
    TP all-reduce (the mailbox, in ``sum_order``; a -0.0 sum as +0.0 where
    ``positive_zero``, ``protocol``) and the boundary ``post ->
    GatedResidual -> pre`` of ``constants`` in one kernel, bound to its
    constant operands (as ``dspark_cute.DraftBoundary``: ``alpha``, ``beta``
    contiguous CUDA FP32 ``[H]``, the norm weights or None).

    ``run(partial, stream, store_stream)`` returns ``(new_stream or None,
    out)``, the bits of the stock all-reduce of the partials followed by
    ``dspark_core.spec.layers.residual_boundary`` on the BF16 sum. Calls of more
    rows than the mailbox holds take the group's stock all-reduce and then
    ``DraftBoundary`` (logged once per reason); every rank decides on the row
    count alone. With ``published=True`` the partials are already in the
    mailbox (the package GEMM's publish epilogue) and ``partial`` is None.
    ``prepare()`` compiles every variant before CUDA graph capture. Traced
    by torch.compile, a fused call is the op
    ``torch.ops.dspark.all_reduce_boundary``, which names this rank's mailbox
    among what it writes (the package GEMM's publish writes it too)."""

    OP = "all_reduce_boundary"

    def __init__(self, mailbox, constants: BoundaryConstants, alpha: torch.Tensor, beta: torch.Tensor,
                 post_weight: torch.Tensor | None, pre_weight: torch.Tensor | None,
                 sum_order: str = FP32_RANK_ORDER, *, positive_zero: bool = False,
                 pdl: bool | None = None) -> None:
        if not isinstance(constants, BoundaryConstants):
            raise ValueError(f"AllReduceBoundary takes BoundaryConstants, not {type(constants).__name__}")
        if constants.hidden_size != mailbox.layout.hidden_size:
            raise ValueError(
                f"a boundary over {constants.hidden_size} columns on a mailbox of "
                f"{mailbox.layout.hidden_size}"
            )
        # The unfused path; its constructor checks the constant operands.
        self.unfused = DraftBoundary(constants, alpha, beta, post_weight, pre_weight, pdl=pdl)
        if alpha.device != mailbox.device:
            raise ValueError(f"the gates are on {alpha.device}, the mailbox on {mailbox.device}")
        self.mailbox, self.constants, self.sum_order = mailbox, constants, sum_order
        self.positive_zero = bool(positive_zero)
        self.alpha, self.beta = alpha, beta
        self.post_weight, self.pre_weight = post_weight, pre_weight
        self.pdl = self.unfused.pdl
        self.op_handle = ops.register(self)
        self._fused: dict[tuple, FusedAllReduce] = {}
        self._logged: set[str] = set()

    def fused(self, stream_bf16: bool, store_stream: bool, published: bool = False) -> FusedAllReduce:
        """The fused all-reduce of one variant."""
        key = (bool(stream_bf16), bool(store_stream), bool(published))
        if key not in self._fused:
            self._fused[key] = FusedAllReduce(
                self.mailbox,
                zero_sign_epilogue(BoundaryEpilogue(self.constants, key[0], key[1]), self.positive_zero),
                self.sum_order,
                published=key[2], pdl=self.pdl,
            )
        return self._fused[key]

    def prepare(self, stream_dtypes=(torch.float32, torch.bfloat16), store_stream=(False, True),
                published=(False,)) -> None:
        """Compile the fused variants these calls may launch, and the
        unfused boundary of the fallback."""
        for dtype in stream_dtypes:
            for store in store_stream:
                for pub in published:
                    self.fused(dtype == torch.bfloat16, store, pub).prepare()
        self.unfused.prepare(stream_dtypes=stream_dtypes, store_stream=store_stream)

    def takes_rows(self, m: int) -> bool:
        """Whether a call of ``m`` rows runs fused (the row count alone)."""
        return self.fused(False, False).takes_rows(m)

    def problem(self, partial: torch.Tensor | None, stream: torch.Tensor, store_stream: bool = False,
                out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None,
                published: bool = False) -> str | None:
        """Why ``run`` does not take these operands (a sentence), or None: an
        FP32 or BF16 ``[m, H]`` stream on the mailbox's device, the BF16
        partial of its shape (None when ``published``, which also needs ``m``
        within the mailbox), ``out`` / ``new_stream`` (if given) BF16 / FP32
        of that shape (``new_stream`` only with ``store_stream``); all
        contiguous and 16-byte aligned."""
        try:
            self._check_operands(partial, stream, store_stream, out, new_stream, published)
        except ValueError as error:
            return str(error)
        return None

    def _check_operands(self, partial, stream, store_stream, out, new_stream, published) -> None:
        h = self.constants.hidden_size
        dev = self.mailbox.device
        if not (isinstance(stream, torch.Tensor) and stream.dim() == 2 and stream.shape[1] == h
                and stream.dtype in (torch.float32, torch.bfloat16)):
            raise ValueError(f"the boundary takes an FP32 or BF16 [m, {h}] stream")
        m = stream.shape[0]
        shape = (m, h)
        check_operand(stream, shape, stream.dtype, 16, "the stream")
        if stream.device != dev:
            raise ValueError(f"the stream is on {stream.device}, the mailbox on {dev}")
        if published:
            if partial is not None:
                raise ValueError("a published boundary reads its partials from the mailbox, not a tensor")
            if not self.takes_rows(m):
                raise ValueError(f"no published call of {m} rows: {fallback_reason(m, self.mailbox.layout.capacity)}")
        else:
            check_operand(partial, shape, torch.bfloat16, 16, "the branch partial")
        if out is not None:
            check_operand(out, shape, torch.bfloat16, 16, "the boundary output")
        if new_stream is not None:
            if not store_stream:
                raise ValueError("a new_stream buffer was given with store_stream=False")
            check_operand(new_stream, shape, torch.float32, 16, "the new stream")
        for t, name in ((out, "output"), (new_stream, "new stream")):
            if t is not None and t.device != dev:
                raise ValueError(f"the boundary's {name} is on {t.device}, the mailbox on {dev}")

    def takes(self, partial, stream, store_stream: bool = False, out=None, new_stream=None,
              published: bool = False) -> bool:
        """Whether ``run`` takes these operands (``problem`` is None)."""
        return self.problem(partial, stream, store_stream, out, new_stream, published) is None

    def run(self, partial: torch.Tensor | None, stream: torch.Tensor, store_stream: bool,
            out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None,
            published: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(new_stream or None, out)`` (class docstring); ValueError with
        ``problem``'s sentence for operands it does not take."""
        reason = self.problem(partial, stream, store_stream, out, new_stream, published)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(partial, stream, store_stream, out, new_stream, published)

    def launch(self, partial: torch.Tensor | None, stream: torch.Tensor, store_stream: bool,
               out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None,
               published: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``run`` without its checks: fused where the row count fits the
        mailbox, else the group's stock all-reduce and the unfused boundary
        (logged once per reason)."""
        dev = self.mailbox.device
        shape = tuple(stream.shape)
        m = shape[0]
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        if store_stream and new_stream is None:
            new_stream = torch.empty(shape, dtype=torch.float32, device=dev)
        fused = self.fused(stream.dtype == torch.bfloat16, store_stream, published)
        if not fused.takes_rows(m):
            reason = fallback_reason(m, fused.capacity)
            if reason not in self._logged:
                self._logged.add(reason)
                log.warning("dspark-comm: the all-reduce boundary of %s runs the stock all-reduce", reason)
            if m == 0:
                return (new_stream if store_stream else None), out
            branch = partial.clone()
            self.mailbox.group.all_reduce_(branch)
            return self.unfused.launch(branch, stream, store_stream, out, new_stream)
        # The mailbox view only for a traced graph's dependencies (the kernel reads the peer table).
        ops.launch(self, partial, stream, store_stream, out, new_stream, published,
                   self.mailbox.words() if ops.tracing() else None)
        return (new_stream if store_stream else None), out

    def _launch_kernel(self, partial: torch.Tensor | None, stream: torch.Tensor, store_stream: bool,
                       out: torch.Tensor, new_stream: torch.Tensor | None, published: bool,
                       mailbox: torch.Tensor | None) -> None:
        fused = self.fused(stream.dtype == torch.bfloat16, store_stream, published)
        spare = self.alpha  # the address of an operand the variant does not read
        fused.launch(stream.shape[0], partial, (
            stream, self.alpha, self.beta,
            self.post_weight if self.post_weight is not None else spare,
            self.pre_weight if self.pre_weight is not None else spare,
            new_stream if store_stream else spare, out,
        ))


__all__ = ["AllReduceBoundary", "BoundaryEpilogue"]
