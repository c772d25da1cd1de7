"""The exact package GEMM: a rank's row-parallel projection on the ordered
GEMM (``dspark_cute.cutedsl.gemm.ordered``: cuBLAS's own summation order,
found and confirmed at build against the live cuBLAS), its BF16 partial
published straight into every rank's mailbox.

vLLM's TP step computes each rank's partial of o_proj and down with cuBLAS
(``F.linear`` on the rank's shard) and all-reduces the BF16 partials (its
custom all-reduce: FP32 in rank order). Where the ordered GEMM reproduces
cuBLAS's order for the shard and row count, the partial it publishes is
cuBLAS's bit for bit, so publish + the consuming
``FusedAllReduce(..., published=True)`` (or ``AllReduceBoundary.run(None,
..., published=True)``) is vLLM's all-reduced branch bit for bit: the
package GEMM without the skinny loop's own order (``package_gemm``, whose
sums differ from cuBLAS's in the last bits).

**Kernel.** ``OrderedPublishKernel`` is the ordered GEMM's ``cp.async``
kernel (the same main loop, split-K reduce and rounding: the same sums) with
its one store replaced: each BF16 pair, encoded with the mailbox's marker
(``encode_word``), goes to slot (epoch, rank, token) of every rank's
mailbox by ``st.relaxed.sys`` stores (``gemm_epilogue.emit_word``), the
epoch read from the own mailbox's header after the PDL wait (the epilogue
runs after the main loop) and never advanced; the launch's ``out`` operand
is the mailbox's address table.

**Host.** ``OrderedPackageGemm(role, weight, mailbox)``: ``check(rows)``
runs the build-time check on the shard (``OrderedGemm.check``: against
``F.linear`` by default) and binds the row counts whose order it confirmed;
``takes(x)`` (a bound row count within the mailbox's capacity);
``run(x, publish=True)`` publishes (every rank the same row count; the next
mailbox call on the stream must consume), ``run(x, publish=False)`` returns
the plain BF16 partial (the ordered GEMM's). ``prepare()`` compiles both.
"""

from __future__ import annotations

import torch
from cutlass import Int32, Int64

from dspark_comm.cutedsl.gemm_epilogue import emit_word
from dspark_comm.protocol import MailboxLayout
from dspark_core.contracts.constants import ordered_gemm_constants
from dspark_core.runtime import gemm_check
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.ordered import (
    OrderedGemm,
    OrderedGemmKernel,
    fake_args,
    fit_chunk,
    launch_settings,
)
from dspark_cute.runtime.host import current_stream, jit_cache


class OrderedPublishKernel(OrderedGemmKernel):
    """``OrderedGemmKernel`` (``k``, ``n_tiles``, ``warps``, ``stages``,
    ``pdl``, ``chunk``, ``l2_chunks``) publishing into a mailbox of
    ``layout`` as ``rank`` (module docstring); ``out`` is the mailbox's
    address table (int64 ``[tp]``)."""

    def __init__(self, k: int, n_tiles: int, warps: int, stages: int, pdl: bool, chunk: int, l2_chunks: int,
                 layout: MailboxLayout, rank: int) -> None:
        super().__init__(k, n_tiles, warps, stages, pdl, chunk, l2_chunks)
        if not isinstance(layout, MailboxLayout) or not 0 <= rank < layout.tp:
            raise ValueError(f"a publishing ordered GEMM needs a MailboxLayout and a rank in it, not {layout!r}, "
                             f"rank {rank!r}")
        # emit_word's view of the kernel: the mode, the mailbox, the rank, the outputs.
        self.mode, self.layout, self.rank, self.n = "publish", layout, rank, layout.hidden_size

    def store_word(self, out, word, tok, tok_c, column, m, n) -> None:
        bases = [ptx.ld_global_u64(Int64(out) + 8 * r) for r in range(self.layout.tp)]
        emit_word(self, bases, out, word, tok, tok_c, column, m)


@jit_cache("OrderedPublish")
def compile_ordered_publish(k: int, n_tiles: int, warps: int, stages: int, pdl: bool, chunk: int, l2_chunks: int,
                            layout: MailboxLayout, rank: int):
    """The compiled ``OrderedPublishKernel`` of one variant."""
    return OrderedPublishKernel(k, n_tiles, warps, stages, bool(pdl), chunk, l2_chunks, layout, rank), fake_args()


class OrderedPackageGemm:
    """One rank's row-parallel projection ``role`` ("o_proj", "down", "fc")
    on the ordered GEMM, bound to its shard ``weight`` (BF16 ``[hidden_size,
    k_shard]``, contiguous, 16-byte aligned, CUDA) and publishing into
    ``mailbox`` (this rank's ``dspark_comm.Mailbox`` of ``hidden_size``
    columns); module docstring."""

    def __init__(self, role: str, weight: torch.Tensor, mailbox, *, pdl: bool | None = None) -> None:
        constants = ordered_gemm_constants(role, weight)  # the weight's refusal first, in its own words
        n = constants.n
        if mailbox is None or n != mailbox.layout.hidden_size:
            raise ValueError(f"an exact package GEMM publishes rows of its weight's {n} outputs into a mailbox of "
                             f"as many columns, not {None if mailbox is None else mailbox.layout.hidden_size}")
        # The cp.async kernel's settings at every row count: the publishing kernel is that one.
        self.gemm = OrderedGemm(constants, weight, pdl=pdl,
                                settings=lambda m, o: launch_settings(n, o.splits, m))
        self.mailbox, self.weight = mailbox, weight

    @property
    def orders(self) -> dict:
        return self.gemm.orders

    @property
    def max_rows(self) -> int:
        return self.gemm.max_rows

    def check(self, rows=None, reference=None, seed: int = gemm_check.SEED) -> gemm_check.CheckResult:
        """The build-time check of the shard (``OrderedGemm.check``) at
        ``rows`` (default 1 .. the mailbox's capacity), the orders bound and
        both kernels compiled."""
        rows = range(1, self.mailbox.layout.capacity + 1) if rows is None else rows
        result = self.gemm.check(rows, reference, seed)
        self.prepare()
        return result

    def problem(self, x, publish: bool = True) -> str | None:
        why = self.gemm.problem(x)
        if why is None and publish and x.shape[0] > self.mailbox.layout.capacity:
            why = f"the mailbox holds {self.mailbox.layout.capacity} rows a call, not {x.shape[0]}"
        return why

    def takes(self, x, publish: bool = True) -> bool:
        return self.problem(x, publish) is None

    def prepare(self) -> None:
        self.gemm.prepare()
        for m in self.gemm.orders:
            self._kernel(m)

    def _kernel(self, m: int) -> tuple:
        n_tiles, warps, stages, chunk, l2_chunks = self.gemm._settings[m]
        order = self.gemm.orders[m]
        chunk, tile_chunks = fit_chunk(order, self.gemm.constants.k, chunk)
        kernel = compile_ordered_publish(self.gemm.constants.k, n_tiles, warps, stages, self.gemm.pdl, chunk,
                                         l2_chunks, self.mailbox.layout, self.mailbox.rank)
        return kernel, tile_chunks, order.splits

    def run(self, x: torch.Tensor, publish: bool = True):
        """Publish ``x @ W^T`` into every rank's mailbox (returns None), or
        (``publish=False``) return it; ValueError with ``problem``'s sentence."""
        reason = self.problem(x, publish)
        if reason is not None:
            raise ValueError(reason)
        if not publish:
            return self.gemm.launch(x)
        self.mailbox.check_open()
        m = x.shape[0]
        kernel, tile_chunks, splits = self._kernel(m)
        ws = self.gemm.workspace
        kernel(Int64(x.data_ptr()), Int64(self.weight.data_ptr()), Int64(self.mailbox.table.data_ptr()),
               Int64(ws.part.data_ptr()), Int64(ws.counters.data_ptr()), Int32(m), Int32(self.gemm.constants.n),
               Int32(tile_chunks), Int32(splits), current_stream())
        return None


__all__ = ["OrderedPackageGemm", "OrderedPublishKernel", "compile_ordered_publish"]
