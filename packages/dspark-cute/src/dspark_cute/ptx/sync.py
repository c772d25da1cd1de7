"""Ordering between threads, kernels and GPUs: programmatic dependent launch
(PDL), the warp barrier, and the system-scope loads and stores of the
mailbox all-reduce (a peer's buffer is mapped into this process, so its
addresses are ordinary global addresses reached over NVLink).

Mailbox memory order: each 32-bit mailbox word is its own flag (the data *is*
the signal), so no acquire is needed to make other data visible behind it: a
system-scope strong load sees either the empty marker or the whole word a
peer stored with a system-scope strong store (single-copy atomicity of
aligned 32-bit accesses, also as elements of a vector access). The loads are
``.relaxed.sys`` (never served from a stale L1 line) and the stores
``.relaxed.sys`` (morally strong with the peer's loads).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline import asm, i32, i64, u32, words

# ---------------------------------------------------------------- launch order


def pdl_wait() -> None:
    """``griddepcontrol.wait``: block until the grid this launch depends on
    (programmatic dependent launch) has completed and its memory is visible;
    a no-op without a PDL dependency."""
    cute.arch.griddepcontrol_wait()


def pdl_launch_dependents() -> None:
    """``griddepcontrol.launch_dependents``: let the next PDL kernel start
    launching (it must still ``pdl_wait`` before reading what this grid
    writes)."""
    cute.arch.griddepcontrol_launch_dependents()


def weight_first(ahead: int, load_weight, load_x, before_x=None) -> None:
    """The prologue of the main loops that load into registers (the GEMV, the
    register-direct skinny loop): ``load_weight(s, pinned)`` for the first
    ``ahead`` steps (the weight is constant while the decode runs, so its
    loads may precede the PDL wait; ``pinned`` where there is a wait: with a
    load ptxas keeps before it, ``ld_global_na_v4``), then ``before_x()``
    where given (the wait), then
    ``load_x(s)`` for the same steps (x is the previous kernel's output)."""
    for s in range(ahead):
        load_weight(s, before_x is not None)
    if before_x is not None:
        before_x()
    for s in range(ahead):
        load_x(s)


# ---------------------------------------------------------------- warps


@dsl_user_op
def sync_warp(*, loc=None, ip=None) -> None:
    """``bar.warp.sync 0xffffffff``: the warp's lanes meet; their shared-memory
    accesses before it are ordered before those after it."""
    asm(None, [], "bar.warp.sync 0xffffffff;", "", True, loc, ip)


# ---------------------------------------------------------------- the mailbox: clocks, words, epochs


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """The global nanosecond timer (``mov.u64 %globaltimer``)."""
    return Int64(asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", True, loc, ip))


@dsl_user_op
def spin_ns(ns, *, loc=None, ip=None) -> None:
    """Spin until ``%globaltimer`` has advanced by ``ns`` nanoseconds (at
    least: the timer advances in steps of the card's timer resolution)."""
    text = ("{\n.reg .u64 t0, t1;\n.reg .pred p;\nmov.u64 t0, %globaltimer;\nSPIN:\nmov.u64 t1, %globaltimer;\n"
            "sub.u64 t1, t1, t0;\nsetp.lt.u64 p, t1, $0;\n@p bra SPIN;\n}")
    asm(None, [i64(ns, loc, ip)], text, "l", True, loc, ip)


@dsl_user_op
def deadline(status, timeout_ns, *, loc=None, ip=None) -> Int64:
    """``globaltimer + timeout_ns`` where ``status`` is 0, else 0 (every poll
    against it gives up at once)."""
    return Int64(asm(
        T.i64(), [u32(status, loc, ip), i64(timeout_ns, loc, ip)],
        "{ .reg .pred p; .reg .u64 t; mov.u64 t, %globaltimer; add.u64 t, t, $2; "
        "setp.eq.u32 p, $1, 0; selp.u64 $0, t, 0, p; }",
        "=l,r,l", True, loc, ip,
    ))


@dsl_user_op
def encode_word(word, marker: int, escape: int, *, loc=None, ip=None) -> Uint32:
    """The mailbox word of data word ``word``: ``escape`` for ``marker`` (the
    empty word), else ``word`` (``setp`` + ``selp``)."""
    return Uint32(asm(
        T.i32(), [u32(word, loc, ip)],
        f"{{ .reg .pred p; setp.eq.u32 p, $1, {marker:#x}; selp.b32 $0, {escape:#x}, $1, p; }}",
        "=r,r", True, loc, ip,
    ))


@dsl_user_op
def advance_epoch(epoch, epochs: int, *, loc=None, ip=None) -> Uint32:
    """The epoch after ``epoch``: ``(epoch + 1) % epochs``."""
    return Uint32(asm(
        T.i32(), [u32(epoch, loc, ip)],
        f"{{ .reg .pred p; add.u32 $0, $1, 1; setp.ge.u32 p, $0, {epochs}; @p mov.u32 $0, 0; }}",
        "=r,r", True, loc, ip,
    ))


# ---------------------------------------------------------------- the mailbox: system-scope access


@dsl_user_op
def ld_relaxed_u32(addr, *, loc=None, ip=None) -> Uint32:
    """The 32-bit word at global ``addr`` (``ld.relaxed.gpu``: a header word)."""
    return Uint32(asm(T.i32(), [i64(addr, loc, ip)], "ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", True, loc, ip))


@dsl_user_op
def push_v4(addr, values, *, loc=None, ip=None) -> None:
    """Store four words at 16-byte aligned ``addr`` (``st.relaxed.sys.v4``: a
    peer polls them)."""
    asm(None, [i64(addr, loc, ip)] + [u32(w, loc, ip) for w in values],
        "st.relaxed.sys.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", True, loc, ip)


@dsl_user_op
def st_relaxed_sys_b32_if(addr, word, token, m, *, loc=None, ip=None) -> None:
    """Store ``word`` at global ``addr`` (a peer's mapped buffer or the own)
    with ``st.relaxed.sys`` if ``token < m`` (Int32): a strong system-scope
    store that a peer's ``ld.relaxed.sys`` poll sees whole."""
    asm(None, [i64(addr, loc, ip), u32(word, loc, ip), i32(token, loc, ip), i32(m, loc, ip)],
        "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p st.relaxed.sys.global.b32 [$0], $1; }", "l,r,r,r", True, loc, ip)


@dsl_user_op
def store_u32_if(flag, addr, value, *, when_zero: bool = False, loc=None, ip=None) -> None:
    """Store 32-bit ``value`` at global ``addr`` (``st.relaxed.gpu``) where
    ``flag`` is non-zero (``when_zero``: where it is zero)."""
    cmp = "eq" if when_zero else "ne"
    asm(None, [u32(flag, loc, ip), i64(addr, loc, ip), u32(value, loc, ip)],
        f"{{ .reg .pred p; setp.{cmp}.u32 p, $0, 0; @p st.relaxed.gpu.global.b32 [$1], $2; }}", "r,l,r", True, loc, ip)


@dsl_user_op
def poll_fragments(addr, count: int, stride: int, limit, marker: int, *, loc=None, ip=None) -> tuple:
    """``([4 words] * count, timed_out)``: the 16-byte vectors at ``addr +
    i * stride`` (i < ``count``), loaded with ``ld.relaxed.sys`` again and
    again until none of their words is ``marker``, or until ``%globaltimer``
    reaches ``limit`` (then ``timed_out`` is 1 and the words are whatever the
    last loads saw). One loop for all ``count`` vectors, so their loads are
    in flight together."""
    n = 4 * count
    loads = "\n".join(
        f"ld.relaxed.sys.global.v4.b32 {{${4 * i}, ${4 * i + 1}, ${4 * i + 2}, ${4 * i + 3}}}, "
        f"[${n + 1}+{i * stride}];"
        for i in range(count)
    )
    checks = "\n".join(
        [f"setp.eq.u32 p, $0, {marker:#x};"] + [f"setp.eq.or.u32 p, ${j}, {marker:#x}, p;" for j in range(1, n)]
    )
    text = (
        "{\n.reg .pred p, q;\n.reg .u64 t;\nPOLL:\n"
        f"{loads}\n{checks}\nmov.u32 ${n}, 0;\n@!p bra DONE;\n"
        f"mov.u64 t, %globaltimer;\nsetp.lt.u64 q, t, ${n + 2};\n@q bra POLL;\nmov.u32 ${n}, 1;\n"
        "DONE:\n}"
    )
    constraints = ",".join(["=r"] * (n + 1) + ["l", "l"])
    result = asm(llvm.StructType.get_literal([T.i32()] * (n + 1)), [i64(addr, loc, ip), i64(limit, loc, ip)], text,
                 constraints, True, loc, ip)
    values = words(result, n + 1, loc, ip)
    return [values[4 * i: 4 * i + 4] for i in range(count)], values[n]


@dsl_user_op
def clear_fragments(addr, count: int, stride: int, marker: int, *, loc=None, ip=None) -> None:
    """Store ``marker`` over the ``count`` 16-byte vectors at ``addr + i *
    stride`` (``st.relaxed.sys.v4``)."""
    text = "\n".join(f"st.relaxed.sys.global.v4.b32 [$0+{i * stride}], {{m, m, m, m}};" for i in range(count))
    asm(None, [i64(addr, loc, ip)], f"{{\n.reg .b32 m;\nmov.b32 m, {marker:#x};\n{text}\n}}", "l", True, loc, ip)


__all__ = [
    "advance_epoch",
    "clear_fragments",
    "deadline",
    "encode_word",
    "globaltimer",
    "ld_relaxed_u32",
    "pdl_launch_dependents",
    "pdl_wait",
    "poll_fragments",
    "push_v4",
    "spin_ns",
    "st_relaxed_sys_b32_if",
    "store_u32_if",
    "sync_warp",
    "weight_first",
]
