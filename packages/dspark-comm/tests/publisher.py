"""A stand-in producer for the published all-reduce (test-only): each row's
encoded BF16 partial stored into slot (``e``, rank, row) of every rank's
mailbox, own rank included, as the package GEMM's publish epilogue does;
``e`` is the row's current epoch, which the consuming
``FusedAllReduce(published=True)`` then advances."""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from dspark_comm.cutedsl.allreduce import FRAGMENT_STRIDE, _slot
from dspark_comm.protocol import ESCAPE, MARKER, MailboxLayout, takes
from dspark_cute import ptx
from dspark_cute.runtime.host import check_operand, current_stream, fake_stream, jit_cache, pdl_supported


class PublishKernel:
    """The producer side alone: each row's encoded BF16 partial stored into
    slot (``e``, rank, row) of every rank's mailbox, own rank included (what
    the package GEMM's epilogue does); ``e`` is the row's current epoch, which
    the consuming ``AllReduceKernel(published=True)`` then advances. Call:
    ``(partial, table, m, stream)``."""

    def __init__(self, layout: MailboxLayout, rank: int, pdl: bool) -> None:
        self.layout, self.rank, self.pdl = layout, rank, pdl

    @cute.jit
    def __call__(self, partial: Int64, table: Int64, m: Int32, stream):
        self.kernel(partial, table).launch(
            grid=[m, 1, 1], block=[ptx.THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, partial: Int64, table: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        _publish_body(self, tidx, row, partial, table)


def _publish_body(k: PublishKernel, tidx, row, partial, table) -> None:
    # A plain function: the DSL rewrites loops only in the kernel itself.
    layout = k.layout
    frags = layout.hidden_size // ptx.CHUNK
    bases = [ptx.ld_global_u64(Int64(table) + 8 * r) for r in range(layout.tp)]
    if k.pdl:
        ptx.pdl_wait()
    epoch = ptx.ld_relaxed_u32(bases[k.rank] + Int64(row) * 4)
    row_addr = Int64(partial) + Int64(row) * layout.row_bytes + Int64(tidx) * (2 * ptx.VEC)
    words = [ptx.ld_global_v4(row_addr + i * FRAGMENT_STRIDE) for i in range(frags)]
    if k.pdl:
        ptx.pdl_launch_dependents()
    pushed = [[ptx.encode_word(w, MARKER, ESCAPE) for w in f] for f in words]
    for peer in range(layout.tp):
        dst = _slot(layout, bases[peer], epoch, k.rank, row, tidx)
        for i in range(frags):
            ptx.push_v4(dst + i * FRAGMENT_STRIDE, pushed[i])


def publish_fake_args() -> tuple:
    """The compile signature of ``PublishKernel``."""
    return (Int64(0), Int64(0), Int32(1), fake_stream())


@jit_cache("MailboxPublish")
def compile_publish(layout: MailboxLayout, rank: int, pdl: bool):
    """The compiled ``PublishKernel``."""
    return PublishKernel(layout, rank, pdl), publish_fake_args()


class Publisher:
    """Publishes BF16 partials into the mailbox (``PublishKernel``) for a
    ``FusedAllReduce(published=True)`` to consume: the stand-in of a GEMM
    whose epilogue publishes."""

    def __init__(self, mailbox, pdl: bool | None = None) -> None:
        self.mailbox = mailbox
        self.pdl = pdl_supported(mailbox.device) if pdl is None else bool(pdl)

    def prepare(self) -> None:
        compile_publish(self.mailbox.layout, self.mailbox.rank, self.pdl)

    def publish(self, partial: torch.Tensor) -> None:
        mb = self.mailbox
        mb.check_open()
        m = partial.shape[0] if isinstance(partial, torch.Tensor) and partial.dim() == 2 else 0
        if not takes(m, mb.layout.capacity):
            raise ValueError(f"cannot publish {m} rows into a mailbox of {mb.layout.capacity}")
        check_operand(partial, (m, mb.layout.hidden_size), torch.bfloat16, 16, "the partial")
        compile_publish(mb.layout, mb.rank, self.pdl)(
            Int64(partial.data_ptr()), Int64(mb.table.data_ptr()), Int32(m), current_stream()
        )
