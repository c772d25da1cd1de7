"""The package GEMM's one-row path (opt-in, ``PackageGemm(one_row_gemv=True)``):
``y = x[1, K] @ W[N, K]^T`` on the one-token GEMV's main loop
(``dspark_cute.cutedsl.gemm.gemv.mainloop``: 8 warps a CTA, ``rows_per_warp`` rows a
warp, each warp load 512 contiguous bytes of a row), with the package GEMM's
two epilogues.

It streams a one-row call's weight faster than the tensor-core ring at the TP
shards (the package's README has the measurements).

**Order**: ``dspark_core.spec.gemv``'s (each product ``mul.rn``, a fragment's 8
products pairwise, the fragment sums in order, the warp butterfly), then one
``cvt.rn.bf16x2.f32`` of a row pair: bit for bit ``dspark_core.spec.gemv.gemv``,
within ``dspark_core.spec.gemv.error_bound``. It is not the skinny loop's order,
so with this path a one-row call and the same row in a call of more rows
may differ in the last bits (as cuBLAS's own kernels do between m = 1 and
m > 1); ``PackageGemm`` says so.

**Epilogues** (lane 0 of each warp, one 32-bit word per row pair):

- plain: ``out[0, 2p]``, ``out[0, 2p + 1]`` (``st.global.b32``);
- publish: the word in the mailbox's encoding (``dspark_cute.ptx.encode_word``:
  no value looks empty) with ``st.relaxed.sys.global.b32`` into slot (epoch,
  rank, row 0) of every rank's buffer at ``package_gemm.publish_offset``, the
  epoch row 0's, read (never advanced) from the own buffer's header right
  after the PDL wait. The consuming boundary then runs as after the skinny
  package GEMM.

**PDL**: the first fragments' weight loads before the wait (coherent, so
that ptxas keeps them there: ``dspark_cute.ptx.weight_first``); x and the epoch
after it; dependents released after the main loop (as the skinny package
GEMM: a consumer still waits for this grid's end).
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

# fake_args: the package GEMM's compile signature, which the one-row kernel keeps (re-exported).
from dspark_comm.cutedsl.gemm_epilogue import check_mode, emit_word, fake_args, kernel_prologue
from dspark_comm.protocol import MailboxLayout
from dspark_core.contracts.constants import GemvConstants, PackageGemmConstants
from dspark_core.spec.gemv import gemv_unsupported
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm import gemv as gv
from dspark_cute.runtime.host import jit_cache


def one_row_constants(constants: PackageGemmConstants) -> GemvConstants:
    """The GEMV's constants of a package GEMM's (``N = hidden_size``, ``K =
    k_shard``)."""
    return GemvConstants(constants.role, constants.hidden_size, constants.k_shard)


def one_row_unsupported(constants: PackageGemmConstants, weight: torch.Tensor,
                        rows_per_warp: int = gv.ROWS_PER_WARP, depth: int = gv.DEPTH) -> str | None:
    """Why the one-row GEMV cannot take this package GEMM (a sentence), or
    None: ``dspark_core.spec.gemv.gemv_unsupported`` of the weight, and the
    kernel's launch settings (``dspark_cute.cutedsl.gemm.gemv.check_settings``)."""
    why = gemv_unsupported(weight)
    if why is not None:
        return why
    try:
        gv.check_settings(one_row_constants(constants), rows_per_warp, depth)
    except ValueError as e:
        return str(e)
    return None


def published_columns(n: int, rows_per_warp: int = gv.ROWS_PER_WARP) -> list[int]:
    """The first column of every word the epilogue stores, over the whole
    grid, in (CTA, warp, pair) order: ``row0 + 2 p`` with ``row0 = (8 c +
    w) rows_per_warp`` (the CPU tests check they cover N once)."""
    return [w * rows_per_warp + 2 * p for w in range(n // rows_per_warp) for p in range(rows_per_warp // 2)]


class PackageGemvKernel:
    """The traced one-row package GEMM of one ``GemvConstants``, mode,
    mailbox layout and rank (publish), ``pdl`` and launch settings. Call:
    ``(x, weight, out, table, m, stream)`` as ``PackageGemmKernel`` (``m`` is
    1; the argument keeps one launch signature)."""

    def __init__(self, constants: GemvConstants, mode: str, layout: MailboxLayout | None, rank: int, pdl: bool,
                 rows_per_warp: int = gv.ROWS_PER_WARP, depth: int = gv.DEPTH) -> None:
        gv.check_settings(constants, rows_per_warp, depth)
        check_mode(constants.n, mode, layout, rank)
        self.n, self.k = constants.n, constants.k
        self.mode, self.layout, self.rank, self.pdl = mode, layout, rank, bool(pdl)
        # Row 0's epoch is read right after the PDL wait (package_gemm.kernel_prologue).
        self.early_epochs = mode == "publish"
        self.rows, self.depth = rows_per_warp, depth

    @cute.jit
    def __call__(self, x: Int64, weight: Int64, out: Int64, table: Int64, m: Int32, stream):
        self.kernel(x, weight, out, table).launch(
            grid=[self.n // (gv.WARPS * self.rows), 1, 1], block=[gv.THREADS, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: Int64, weight: Int64, out: Int64, table: Int64):
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        _body(self, x, weight, out, table, Int64(cta) * gv.WARPS + Int64(warp), lane)


def _body(k: PackageGemvKernel, x, weight, out, table, warp_id, lane) -> None:
    # The package GEMM's prologue and stores with one token (row 0) and one
    # epilogue round: the table before the PDL wait, row 0's epoch after it.
    one = Int32(1)
    bases, early, before_x = kernel_prologue(k, table, one, 1, lambda rnd: Int32(0))
    row0, sums = gv.mainloop(k.k, k.rows, k.depth, x, weight, warp_id, lane, before_x=before_x)
    if k.pdl:
        ptx.pdl_launch_dependents()
    for pair in range(k.rows // 2):
        word = ptx.pack_bf16x2_rn(sums[2 * pair], sums[2 * pair + 1])
        # Every lane holds the same sums; lane 0 stores ("token" lane < m = 1).
        emit_word(k, bases, out, word, Int32(lane), 0, row0 + 2 * pair, one, early[0] if k.early_epochs else None)


def compile_package_gemv(constants: PackageGemmConstants, mode: str, layout: MailboxLayout | None, rank: int,
                         pdl: bool, rows_per_warp: int = gv.ROWS_PER_WARP, depth: int = gv.DEPTH):
    """The compiled one-row kernel of one variant (the mailbox and the rank
    count only where it publishes)."""
    publish = mode == "publish"
    return _compile_package_gemv(one_row_constants(constants), mode, layout if publish else None,
                                 rank if publish else 0, bool(pdl), rows_per_warp, depth)


@jit_cache("PackageGemv")
def _compile_package_gemv(g: GemvConstants, mode: str, layout: MailboxLayout | None, rank: int, pdl: bool,
                          rows_per_warp: int, depth: int):
    return PackageGemvKernel(g, mode, layout, rank, pdl, rows_per_warp, depth), fake_args()


__all__ = ["PackageGemvKernel", "compile_package_gemv", "fake_args", "one_row_constants", "one_row_unsupported",
           "published_columns"]
