"""The Lamport one-shot all-reduce as a CuTe DSL kernel with a pluggable,
traced epilogue (``protocol`` describes the mailbox and the call).

Layout: one CTA of 256 threads per row (grid = the row count ``m``, the
same launch on every rank); thread ``t`` holds the 8-column fragments
``t * 8 + k * 2048`` (``k < H / 2048``), the reference CTA of the row tree
(``dspark_core.spec.numerics``), so an epilogue can run the row norms of
``dspark_cute`` on the summed row directly.

Per CTA, in this order: the epilogue's ``early`` loads (constants, before the
PDL wait); the PDL wait; the mailbox status and the row's epoch ``e``; the
deadline; the rank's own partial row (16-byte loads); the encoded partial
pushed into slot (``e``, rank, row) of every peer (``st.relaxed.sys``); the
epilogue's ``late`` loads (inputs of the previous kernels, overlapping the
wait for the peers); then for each rank ``r`` in rank order 0, 1, ...: its
row (the own partial, or the peer's slot polled until full, then cleared),
added into the sum of ``sum_order``:

- ``FP32_RANK_ORDER``: ``s = x_0``, ``s = s + x_r`` (``add.rn.f32``), then one
  ``cvt.rn.bf16x2.f32`` at the end;
- ``BF16_RANK_ORDER``: the same adds, each result rounded to BF16.

The epilogue's ``finish`` then receives the summed row: per fragment 8 FP32
values, exactly the BF16 all-reduce output widened. A barrier, and thread 0
advances the row's epoch.

A poll that reaches the deadline (``Mailbox.timeout_s`` after the CTA
started) gives up: the CTA writes the mailbox's status word (``protocol``)
and ends its row with whatever it read; once the status is set, every later
call gives up at once (deadline 0), so nothing hangs; ``Mailbox.check()``
raises ``MailboxTimeoutError``.

````published``: the partials were already stored into every rank's mailbox,
own rank included, by a producer kernel (the package GEMM's publish
epilogue): the kernel pushes nothing and polls every rank's slot.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from dspark_comm.protocol import (
    EPOCHS,
    ESCAPE,
    HEADER_BYTES,
    MARKER,
    STATUS_OFFSET,
    STATUS_TIMEOUT,
    MailboxLayout,
    check_sum_order,
    fallback_reason,
    takes,
)
from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER
from dspark_core.switches import flag
from dspark_cute import ptx
from dspark_cute.cutedsl.norms.row_norm import fragment_columns
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    check_operand,
    current_stream,
    describe,
    fake_stream,
    jit_cache,
    pdl_supported,
    smem_allocator,
)

log = logging.getLogger("dspark.comm")

# Shared memory every all-reduce kernel reserves for its epilogue (FP32 words).
SMEM_FLOATS = 64
# Operand addresses an epilogue may take per call.
MAX_OPERANDS = 8
# Byte distance between a thread's consecutive fragments (2048 BF16 columns).
FRAGMENT_STRIDE = 2 * ptx.CHUNK


@dataclass
class RowContext:
    """What an epilogue sees of its CTA while traced: thread, row, warp and
    lane indices; ``columns``, the first column of each of the thread's
    fragments (Int64); ``hidden_size``; ``smem``, the shared-memory byte
    address (Int32) of ``SMEM_FLOATS`` FP32 words; ``operands``, the call's
    operand addresses (Int64, in the epilogue's ``operands`` order); the
    rank and the TP size."""

    tidx: object
    row: object
    warp: object
    lane: object
    columns: list
    hidden_size: int
    smem: object
    operands: tuple
    rank: int
    tp: int


class Epilogue:
    """A traced epilogue of the mailbox all-reduce: what a model does with
    its summed rows inside the all-reduce kernel. Subclasses set
    ``operands`` (names of the per-call global addresses it reads or writes,
    at most ``MAX_OPERANDS``), return a hashable ``key()`` covering every
    compile-time constant they trace with, and override:

    - ``early(ctx)``: loads before the PDL wait (constant operands only; the
      previous kernel may still be writing the others); returns a state;
    - ``late(ctx, state)``: loads after the wait, issued before the peers'
      partials are polled (so they overlap the wait); returns a state;
    - ``finish(ctx, state, values)``: ``values[k]`` is the list of 8 FP32 of
      fragment ``k`` (columns ``ctx.columns[k]`` ..  + 7): the BF16
      all-reduce output widened exactly. Nothing is written unless it writes.
    """

    operands: tuple[str, ...] = ()

    def key(self) -> tuple:
        return (type(self).__module__, type(self).__qualname__)

    def early(self, ctx: RowContext):
        return None

    def late(self, ctx: RowContext, state):
        return state

    def finish(self, ctx: RowContext, state, values: list) -> None:
        raise NotImplementedError


class StoreEpilogue(Epilogue):
    """The plain all-reduce: the summed row stored as BF16 into ``out``
    (``[m, H]``, row-major)."""

    operands = ("out",)

    def finish(self, ctx: RowContext, state, values: list) -> None:
        out_row = Int64(ctx.operands[0]) + Int64(ctx.row) * (2 * ctx.hidden_size)
        for col, v in zip(ctx.columns, values):
            ptx.st_row8("bf16", out_row, col, v)


class PositiveZero(Epilogue):
    """``inner`` on the summed row with every -0.0 turned into +0.0: each
    value gets ``add.rn.f32(v, +0.0)`` before ``inner.finish`` sees it, which
    changes -0.0 and no other value (NaN payloads excepted). The sum of a
    Lamport all-reduce whose empty marker is -0.0 (``protocol``: the sign
    of a zero sum). ``inner``'s operands, loads and key, the option added."""

    def __init__(self, inner: Epilogue) -> None:
        if not isinstance(inner, Epilogue) or isinstance(inner, PositiveZero):
            raise ValueError(f"PositiveZero wraps one plain Epilogue, not {type(inner).__name__}")
        self.inner = inner
        self.operands = inner.operands

    def key(self) -> tuple:
        return ("positive_zero", self.inner.key())

    def early(self, ctx: RowContext):
        return self.inner.early(ctx)

    def late(self, ctx: RowContext, state):
        return self.inner.late(ctx, state)

    def finish(self, ctx: RowContext, state, values: list) -> None:
        zero = Float32(0.0)
        self.inner.finish(ctx, state, [[ptx.add_rn(v, zero) for v in f] for f in values])


def zero_sign_epilogue(epilogue: Epilogue, positive_zero: bool) -> Epilogue:
    """``epilogue``, wrapped in ``PositiveZero`` where ``positive_zero``."""
    return PositiveZero(epilogue) if positive_zero else epilogue


class AllReduceKernel:
    """The traced all-reduce of one layout, rank, sum order, epilogue and
    variant. Call: ``(partial, table, timeout_ns, o0, ..., o7, m, stream)``:
    the BF16 ``[m, H]`` partial's address (unused when ``published``), the
    address of the mailbox's table (``tp`` Int64: every rank's buffer as
    mapped here), the poll timeout in ns (Int64), the epilogue's operand
    addresses (unused ones 0), ``m`` Int32 (1 .. capacity)."""

    def __init__(self, layout: MailboxLayout, rank: int, sum_order: str, epilogue: Epilogue,
                 published: bool, pdl: bool) -> None:
        check_sum_order(sum_order)
        if not 0 <= rank < layout.tp:
            raise ValueError(f"rank {rank} is outside a TP group of {layout.tp}")
        if len(epilogue.operands) > MAX_OPERANDS:
            raise ValueError(f"an epilogue takes at most {MAX_OPERANDS} operands")
        self.layout, self.rank, self.sum_order = layout, rank, sum_order
        self.epilogue, self.published, self.pdl = epilogue, published, pdl

    @cute.jit
    def __call__(self, partial: Int64, table: Int64, timeout_ns: Int64, o0: Int64, o1: Int64,
                 o2: Int64, o3: Int64, o4: Int64, o5: Int64, o6: Int64, o7: Int64, m: Int32, stream):
        self.kernel(partial, table, timeout_ns, o0, o1, o2, o3, o4, o5, o6, o7).launch(
            grid=[m, 1, 1], block=[ptx.THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, partial: Int64, table: Int64, timeout_ns: Int64, o0: Int64, o1: Int64,
               o2: Int64, o3: Int64, o4: Int64, o5: Int64, o6: Int64, o7: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        smem = smem_allocator().allocate_array(Float32, SMEM_FLOATS)
        ctx = RowContext(
            tidx, row, warp, lane, fragment_columns(tidx, self.layout.hidden_size),
            self.layout.hidden_size, smem.toint(), (o0, o1, o2, o3, o4, o5, o6, o7),
            self.rank, self.layout.tp,
        )
        _all_reduce_body(self, ctx, partial, table, timeout_ns)


def _slot(layout: MailboxLayout, base, epoch, src: int, row, tidx):
    """This thread's first fragment in slot (``epoch``, ``src``, ``row``) of
    the buffer at ``base``."""
    per_epoch = layout.tp * layout.capacity * layout.row_bytes
    return (
        Int64(base) + HEADER_BYTES + Int64(epoch) * per_epoch
        + (src * layout.capacity) * layout.row_bytes + Int64(row) * layout.row_bytes
        + Int64(tidx) * (2 * ptx.VEC)
    )


def _all_reduce_body(k: AllReduceKernel, ctx: RowContext, partial, table, timeout_ns) -> None:
    layout, rank, tp = k.layout, k.rank, k.layout.tp
    frags = layout.hidden_size // ptx.CHUNK
    # The address table is constant: read before the wait.
    bases = [ptx.ld_global_u64(Int64(table) + 8 * r) for r in range(tp)]
    state = k.epilogue.early(ctx)
    if k.pdl:
        ptx.pdl_wait()
    local = bases[rank]
    status = ptx.ld_relaxed_u32(local + STATUS_OFFSET)
    epoch = ptx.ld_relaxed_u32(local + Int64(ctx.row) * 4)
    limit = ptx.deadline(status, timeout_ns)
    own = None
    if not k.published:
        row_addr = Int64(partial) + Int64(ctx.row) * layout.row_bytes + Int64(ctx.tidx) * (2 * ptx.VEC)
        own = [ptx.ld_global_v4(row_addr + i * FRAGMENT_STRIDE) for i in range(frags)]
        pushed = [[ptx.encode_word(w, MARKER, ESCAPE) for w in f] for f in own]
        for peer in range(tp):
            if peer != rank:
                dst = _slot(layout, bases[peer], epoch, rank, ctx.row, ctx.tidx)
                for i in range(frags):
                    ptx.push_v4(dst + i * FRAGMENT_STRIDE, pushed[i])
    if k.pdl:
        # Dependents still wait for this grid's end before they read its output.
        ptx.pdl_launch_dependents()
    state = k.epilogue.late(ctx, state)
    acc = None
    for src in range(tp):
        if src == rank and not k.published:
            words = own
        else:
            slot = _slot(layout, local, epoch, src, ctx.row, ctx.tidx)
            words, timed_out = ptx.poll_fragments(slot, frags, FRAGMENT_STRIDE, limit, MARKER)
            ptx.clear_fragments(slot, frags, FRAGMENT_STRIDE, MARKER)
            code = Uint32(STATUS_TIMEOUT | src) | (Uint32(ctx.row) << Uint32(8))
            ptx.store_u32_if(timed_out, local + STATUS_OFFSET, code)
        x = [ptx.widen_bf16(f) for f in words]
        if acc is None:
            acc = x
        else:
            acc = [[ptx.add_rn(a, b) for a, b in zip(fa, fb)] for fa, fb in zip(acc, x)]
            if k.sum_order == BF16_RANK_ORDER:
                acc = [ptx.round_bf16(f) for f in acc]
    if k.sum_order == FP32_RANK_ORDER:
        acc = [ptx.round_bf16(f) for f in acc]
    k.epilogue.finish(ctx, state, acc)
    # Every thread has read the epoch; thread 0 advances it.
    cute.arch.barrier()
    ptx.store_u32_if(Uint32(ctx.tidx), local + Int64(ctx.row) * 4, ptx.advance_epoch(epoch, EPOCHS), when_zero=True)


def all_reduce_fake_args() -> tuple:
    """The compile signature of ``AllReduceKernel`` (no GPU memory needed)."""
    return (Int64(0),) * (3 + MAX_OPERANDS) + (Int32(1), fake_stream())


@jit_cache("MailboxAllReduce")
def compile_all_reduce(layout: MailboxLayout, rank: int, sum_order: str, epilogue: Epilogue,
                       published: bool, pdl: bool):
    """The compiled ``AllReduceKernel`` of one variant."""
    return AllReduceKernel(layout, rank, sum_order, epilogue, published, pdl), all_reduce_fake_args()


def _address(value, name: str) -> int:
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(f"the operand {name} must be a tensor or a non-negative address, not {type(value).__name__}")


class FusedAllReduce:
    """The mailbox all-reduce of ``mailbox`` with ``epilogue`` fused in.

    A call of ``m`` rows (``takes_rows(m)``, the same on every rank):
    ``partial`` a contiguous, 16-byte aligned BF16 ``[m, H]`` CUDA tensor
    (None when ``published``), ``operands`` the epilogue's tensors or
    addresses in its ``operands`` order. ``run`` checks them (ValueError with
    ``problem``'s sentence), ``launch`` does not. Every rank must make the
    same sequence of calls over one mailbox. ``prepare()`` compiles before
    CUDA graph capture; ``launch`` is capturable."""

    def __init__(self, mailbox, epilogue: Epilogue, sum_order: str = FP32_RANK_ORDER, *,
                 published: bool = False, pdl: bool | None = None) -> None:
        check_sum_order(sum_order)
        if not isinstance(epilogue, Epilogue):
            raise ValueError(f"an epilogue is an Epilogue, not {type(epilogue).__name__}")
        self.mailbox, self.epilogue, self.sum_order = mailbox, epilogue, sum_order
        self.published = bool(published)
        self.pdl = pdl_supported(mailbox.device) if pdl is None else flag(pdl, "pdl")

    @property
    def capacity(self) -> int:
        return self.mailbox.layout.capacity

    def takes_rows(self, m: int) -> bool:
        """Whether a call of ``m`` rows runs fused (the row count alone)."""
        return takes(m, self.capacity)

    def kernel(self):
        mb = self.mailbox
        return compile_all_reduce(mb.layout, mb.rank, self.sum_order, self.epilogue, self.published, self.pdl)

    def prepare(self) -> None:
        """Compile the kernel (before CUDA graph capture)."""
        self.kernel()

    def problem(self, m: int, partial: torch.Tensor | None, operands: Sequence = ()) -> str | None:
        """Why the kernel does not take this call (a sentence), or None."""
        mb = self.mailbox
        if not self.takes_rows(m):
            return f"the fused all-reduce does not take this call: {fallback_reason(m, self.capacity)}"
        if len(operands) != len(self.epilogue.operands):
            return f"the epilogue takes the operands {self.epilogue.operands}, not {len(operands)} values"
        try:
            if self.published:
                if partial is not None:
                    return "a published all-reduce reads its partials from the mailbox, not a tensor"
            else:
                check_operand(partial, (m, mb.layout.hidden_size), torch.bfloat16, 16, "the partial")
                if partial.device != mb.device:
                    return f"the partial is on {partial.device}, the mailbox on {mb.device}"
            for v, n in zip(operands, self.epilogue.operands):
                _address(v, n)
        except ValueError as error:
            return str(error)
        return None

    def takes(self, m: int, partial: torch.Tensor | None, operands: Sequence = ()) -> bool:
        """Whether the kernel takes this call (``problem`` is None)."""
        return self.problem(m, partial, operands) is None

    def run(self, m: int, partial: torch.Tensor | None, operands: Sequence = ()) -> None:
        """``launch`` after ``problem``'s checks (ValueError with its sentence)."""
        reason = self.problem(m, partial, operands)
        if reason is not None:
            raise ValueError(reason)
        self.launch(m, partial, operands)

    def launch(self, m: int, partial: torch.Tensor | None, operands: Sequence = ()) -> None:
        """One call of ``m`` rows, unchecked (MailboxTimeoutError where the
        mailbox gave up waiting before)."""
        mb = self.mailbox
        mb.check_open()
        src = 0 if partial is None else partial.data_ptr()
        addrs = [_address(v, n) for v, n in zip(operands, self.epilogue.operands)]
        addrs += [0] * (MAX_OPERANDS - len(addrs))
        self.kernel()(
            Int64(src), Int64(mb.table.data_ptr()), Int64(mb.timeout_ns),
            *[Int64(a) for a in addrs], Int32(m), current_stream(),
        )


ops.define("all_reduce", "(str handle, Tensor partial, Tensor(a!) out, Tensor(b!) mailbox) -> ()")


class MailboxAllReduce:
    """The plain all-reduce over a mailbox's TP group: ``run(partial)``
    returns the BF16 sum of every rank's ``[m, H]`` partial in ``sum_order``
    (``protocol``; -0.0 sums as +0.0 where ``positive_zero``): fused when ``1 <= m <= capacity``, else the group's stock
    all-reduce (NCCL), logged once per reason. Every rank must call it with
    the same row count. Traced by torch.compile, a fused call is the op
    ``torch.ops.dspark.all_reduce`` (this rank's mailbox among what it
    writes)."""

    OP = "all_reduce"

    def __init__(self, mailbox, sum_order: str = FP32_RANK_ORDER, *, positive_zero: bool = False,
                 pdl: bool | None = None) -> None:
        self.fused = FusedAllReduce(mailbox, zero_sign_epilogue(StoreEpilogue(), positive_zero), sum_order, pdl=pdl)
        self.mailbox = mailbox
        self._logged: set[str] = set()
        self.op_handle = ops.register(self)

    def takes_rows(self, m: int) -> bool:
        """Whether a call of ``m`` rows runs fused (the row count alone)."""
        return self.fused.takes_rows(m)

    def prepare(self) -> None:
        self.fused.prepare()

    def problem(self, partial, out=None) -> str | None:
        """Why ``run`` does not take these operands (a sentence), or None: a
        BF16 ``[m, H]`` partial (the fused path's checks where ``m`` fits the
        mailbox), ``out`` (if given) a contiguous, aligned BF16 tensor of its
        shape."""
        h = self.mailbox.layout.hidden_size
        if not (isinstance(partial, torch.Tensor) and partial.dim() == 2 and partial.shape[1] == h):
            return f"the all-reduce takes a BF16 [m, {h}] partial, not {describe(partial)}"
        if out is not None:
            try:
                check_operand(out, tuple(partial.shape), torch.bfloat16, 16, "the all-reduce output")
            except ValueError as error:
                return str(error)
        m = partial.shape[0]
        if self.takes_rows(m):
            return self.fused.problem(m, partial, (partial if out is None else out,))
        return None

    def takes(self, partial, out=None) -> bool:
        """Whether ``run`` takes these operands (``problem`` is None)."""
        return self.problem(partial, out) is None

    def run(self, partial: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum (into ``out`` if given); ValueError with ``problem``'s sentence."""
        reason = self.problem(partial, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(partial, out)

    def launch(self, partial: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without its checks: fused where the row count fits, else
        the group's stock all-reduce (logged once per reason)."""
        m = partial.shape[0]
        if out is None:
            out = torch.empty_like(partial)
        if not self.takes_rows(m):
            reason = fallback_reason(m, self.fused.capacity)
            if reason not in self._logged:
                self._logged.add(reason)
                log.warning("dspark-comm: the all-reduce of %s takes the stock all-reduce", reason)
            out.copy_(partial)
            if m:
                self.mailbox.group.all_reduce_(out)
            return out
        ops.launch(self, partial, out, self.mailbox.words() if ops.tracing() else None)
        return out

    def _launch_kernel(self, partial: torch.Tensor, out: torch.Tensor, mailbox: torch.Tensor | None) -> None:
        self.fused.launch(partial.shape[0], partial, (out,))


__all__ = [
    "AllReduceKernel",
    "EPOCHS",
    "Epilogue",
    "FusedAllReduce",
    "MAX_OPERANDS",
    "MailboxAllReduce",
    "PositiveZero",
    "RowContext",
    "SMEM_FLOATS",
    "StoreEpilogue",
    "all_reduce_fake_args",
    "compile_all_reduce",
    "zero_sign_epilogue",
]
