"""What the package GEMM's kernels share (the skinny ones, ``package_gemm``,
and the one-row GEMV, ``package_gemv``): the modes, the output index maps,
the prologue (the mailbox's address table before the PDL wait, the epochs
after it) and the store of one output word (plain, or encoded into every
rank's mailbox), and the launch signature."""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64

from dspark_comm.protocol import ESCAPE, HEADER_BYTES, MARKER, MailboxLayout
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.runtime.host import fake_stream

MODES = ("plain", "publish")


def output_column(tile, lane):
    """The first of the two output columns (rows of W) lane ``lane`` of CTA
    ``tile`` writes: ``64 tile + 2 lane`` (``reduced_pair``'s rows)."""
    return sg.TILE_ROWS * tile + 2 * lane


def plain_offset(n: int, token, column):
    """Byte offset of ``out[token, column]`` in a BF16 ``[m, n]`` output."""
    return (token * n + column) * 2


def publish_offset(layout: MailboxLayout, epoch, src: int, token, column):
    """Byte offset, in any rank's mailbox buffer, of the word holding columns
    ``column`` and ``column + 1`` of ``token``'s row in slot (``epoch``,
    ``src``, ``token``): ``protocol.MailboxLayout.slot_offset + 2 column``."""
    return HEADER_BYTES + ((epoch * layout.tp + src) * layout.capacity + token) * layout.row_bytes + 2 * column


def check_mode(n: int, mode: str, layout: MailboxLayout | None, rank: int) -> None:
    """ValueError with a sentence unless a package GEMM kernel of ``n``
    output features can run in ``mode``: plain, or publishing into a mailbox
    of ``layout`` (``n`` columns) as ``rank`` of its TP group."""
    if mode not in MODES:
        raise ValueError(f"a package GEMM mode is one of {', '.join(MODES)}, not {mode!r}")
    if mode == "publish":
        if not isinstance(layout, MailboxLayout):
            raise ValueError("a publishing package GEMM needs the mailbox's MailboxLayout")
        if layout.hidden_size != n:
            raise ValueError(f"a package GEMM of {n} output features cannot publish into a mailbox of "
                             f"{layout.hidden_size} columns")
        if not 0 <= rank < layout.tp:
            raise ValueError(f"rank {rank} is outside a TP group of {layout.tp}")


def kernel_prologue(k, table, m, rounds: int, token_of) -> tuple:
    """``(bases, early, before_x)`` of every package GEMM kernel (both main
    loops here, the one-row GEMV in ``package_gemv``): the mailbox's address
    table (publishing; constant, so read before the PDL wait); the list that
    ``before_x`` fills with each epilogue round's epoch (early epochs: round
    ``r``'s token ``token_of(r)``, clamped to ``m - 1``); ``before_x`` (the
    PDL wait, then those loads), or None where neither applies."""
    bases = [ptx.ld_global_u64(Int64(table) + 8 * r) for r in range(k.layout.tp)] if k.mode == "publish" else None
    early: list = []

    def before_x() -> None:
        if k.pdl:
            ptx.pdl_wait()
        if k.early_epochs:
            for rnd in range(rounds):
                tok_c = cutlass.min(token_of(rnd), m - 1)
                early.append(ptx.ld_relaxed_u32(bases[k.rank] + Int64(tok_c) * 4))

    return bases, early, before_x if k.pdl or k.early_epochs else None


def emit_word(k, bases, out, word, tok, tok_c, col, m, epoch=None) -> None:
    """Store ``word`` (columns ``col``, ``col + 1`` of token ``tok``) if
    ``tok < m``: plain, at ``out[tok_c, col]``; publishing, encoded into slot
    (epoch, rank, ``tok_c``) of every rank's mailbox, the epoch the row's
    (read now from the own mailbox's header, never advanced, unless given:
    the early epochs)."""
    if k.mode == "publish":
        if epoch is None:
            epoch = ptx.ld_relaxed_u32(bases[k.rank] + Int64(tok_c) * 4)
        encoded = ptx.encode_word(word, MARKER, ESCAPE)
        for peer in range(k.layout.tp):
            addr = bases[peer] + publish_offset(k.layout, Int64(epoch), k.rank, Int64(tok_c), col)
            ptx.st_relaxed_sys_b32_if(addr, encoded, tok, m)
    else:
        ptx.st_global_b32_if(Int64(out) + plain_offset(k.n, Int64(tok_c), col), word, tok, m)


def fake_args() -> tuple:
    """The compile signature of ``PackageGemmKernel`` (no GPU memory needed)."""
    return (Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), fake_stream())


__all__ = ["MODES", "check_mode", "emit_word", "fake_args", "kernel_prologue", "output_column", "plain_offset",
           "publish_offset"]
