"""Traced PTX primitives of the mailbox kernels that ``dspark_cute.ptx`` lacks.

Like ``dspark_cute.ptx``, every helper emits inline PTX while a
``@cute.kernel`` is traced; addresses are ``Int64`` byte addresses in the
global space (a peer's buffer is mapped into this process, so its addresses
are ordinary global addresses reached over NVLink).

- ``globaltimer()``: the GPU's nanosecond clock (``%globaltimer``);
- ``deadline(status, timeout_ns)``: ``globaltimer() + timeout_ns`` on a healthy
  mailbox, 0 (every poll gives up at once) once its status word is set;
- ``ld_u64``, ``ld_relaxed_u32``: an address-table entry, a header word;
- ``encode(word)``: the mailbox encoding (``protocol.encode_words``): a word
  equal to the empty marker 0xFFFFFFFF becomes 0xFFFF7FFF;
- ``push_v4(addr, words)``: a 16-byte ``st.relaxed.sys`` (a peer polls it);
- ``poll_fragments(addr, count, stride, deadline)``: ``count`` 16-byte
  ``ld.relaxed.sys`` loads at ``addr + i * stride``, repeated until no word of
  any of them is the marker or the deadline passes; returns the words and a
  timed-out flag (1 or 0);
- ``clear_fragments(addr, count, stride)``: the marker stored back over them;
- ``store_u32_if(flag, addr, value)``: a ``st.relaxed.gpu`` of a 32-bit word
  where ``flag`` (a Uint32) is non-zero (or zero);
- ``advance(epoch)``: ``(epoch + 1) % EPOCHS``.

Memory order: each 32-bit mailbox word is its own flag (the data *is* the
signal), so no acquire is needed to make other data visible behind it: a
system-scope strong load sees either the marker or the whole word a peer
stored with a system-scope strong store (single-copy atomicity of aligned
32-bit accesses, also as elements of a vector access). The loads are
``.relaxed.sys`` (never served from a stale L1 line) and the stores
``.relaxed.sys`` (morally strong with the peer's loads).
"""

from __future__ import annotations

from cutlass import Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dspark_comm.protocol import EPOCHS, ESCAPE, MARKER
from dspark_cute import ptx


def _asm(result_type, operands, text: str, constraints: str, loc, ip):
    """``dspark_cute.ptx._asm`` with side effects."""
    return ptx._asm(result_type, operands, text, constraints, True, loc, ip)


def _l(value, loc, ip):
    return Int64(value).ir_value(loc=loc, ip=ip)


def _u(value, loc, ip):
    return Uint32(value).ir_value(loc=loc, ip=ip)


def _words(result, count: int, loc, ip) -> list:
    return [Uint32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(count)]


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """The global nanosecond timer (``mov.u64 %globaltimer``)."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", loc, ip))


@dsl_user_op
def deadline(status, timeout_ns, *, loc=None, ip=None) -> Int64:
    """``globaltimer + timeout_ns`` where ``status`` is 0, else 0."""
    return Int64(_asm(
        T.i64(), [_u(status, loc, ip), _l(timeout_ns, loc, ip)],
        "{ .reg .pred p; .reg .u64 t; mov.u64 t, %globaltimer; add.u64 t, t, $2; "
        "setp.eq.u32 p, $1, 0; selp.u64 $0, t, 0, p; }",
        "=l,r,l", loc, ip,
    ))


@dsl_user_op
def ld_u64(addr, *, loc=None, ip=None) -> Int64:
    """The 64-bit word at global ``addr`` (a weak load: constant data)."""
    return Int64(_asm(T.i64(), [_l(addr, loc, ip)], "ld.global.b64 $0, [$1];", "=l,l", loc, ip))


@dsl_user_op
def ld_relaxed_u32(addr, *, loc=None, ip=None) -> Uint32:
    """The 32-bit word at global ``addr`` (``ld.relaxed.gpu``)."""
    return Uint32(_asm(T.i32(), [_l(addr, loc, ip)], "ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", loc, ip))


@dsl_user_op
def encode(word, *, loc=None, ip=None) -> Uint32:
    """The mailbox word of data word ``word``: ``ESCAPE`` for ``MARKER``,
    else ``word`` (``setp`` + ``selp``)."""
    return Uint32(_asm(
        T.i32(), [_u(word, loc, ip)],
        f"{{ .reg .pred p; setp.eq.u32 p, $1, {MARKER:#x}; selp.b32 $0, {ESCAPE:#x}, $1, p; }}",
        "=r,r", loc, ip,
    ))


@dsl_user_op
def push_v4(addr, words, *, loc=None, ip=None) -> None:
    """Store four words at 16-byte aligned ``addr`` (``st.relaxed.sys.v4``)."""
    _asm(None, [_l(addr, loc, ip)] + [_u(w, loc, ip) for w in words],
         "st.relaxed.sys.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", loc, ip)


@dsl_user_op
def poll_fragments(addr, count: int, stride: int, limit, *, loc=None, ip=None) -> tuple:
    """``([4 words] * count, timed_out)``: the 16-byte vectors at ``addr +
    i * stride`` (i < ``count``), loaded with ``ld.relaxed.sys`` again and
    again until none of their words is ``MARKER``, or until ``%globaltimer``
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
        [f"setp.eq.u32 p, $0, {MARKER:#x};"] + [f"setp.eq.or.u32 p, ${j}, {MARKER:#x}, p;" for j in range(1, n)]
    )
    text = (
        "{\n.reg .pred p, q;\n.reg .u64 t;\nPOLL:\n"
        f"{loads}\n{checks}\nmov.u32 ${n}, 0;\n@!p bra DONE;\n"
        f"mov.u64 t, %globaltimer;\nsetp.lt.u64 q, t, ${n + 2};\n@q bra POLL;\nmov.u32 ${n}, 1;\n"
        "DONE:\n}"
    )
    constraints = ",".join(["=r"] * (n + 1) + ["l", "l"])
    result = _asm(llvm.StructType.get_literal([T.i32()] * (n + 1)),
                  [_l(addr, loc, ip), _l(limit, loc, ip)], text, constraints, loc, ip)
    words = _words(result, n + 1, loc, ip)
    return [words[4 * i: 4 * i + 4] for i in range(count)], words[n]


@dsl_user_op
def clear_fragments(addr, count: int, stride: int, *, loc=None, ip=None) -> None:
    """Store ``MARKER`` over the ``count`` 16-byte vectors at ``addr + i *
    stride`` (``st.relaxed.sys.v4``)."""
    text = "\n".join(
        f"st.relaxed.sys.global.v4.b32 [$0+{i * stride}], {{m, m, m, m}};" for i in range(count)
    )
    _asm(None, [_l(addr, loc, ip)], f"{{\n.reg .b32 m;\nmov.b32 m, {MARKER:#x};\n{text}\n}}", "l", loc, ip)


@dsl_user_op
def store_u32_if(flag, addr, value, *, when_zero: bool = False, loc=None, ip=None) -> None:
    """Store 32-bit ``value`` at global ``addr`` (``st.relaxed.gpu``) where
    ``flag`` is non-zero (``when_zero``: where it is zero)."""
    cmp = "eq" if when_zero else "ne"
    _asm(None, [_u(flag, loc, ip), _l(addr, loc, ip), _u(value, loc, ip)],
         f"{{ .reg .pred p; setp.{cmp}.u32 p, $0, 0; @p st.relaxed.gpu.global.b32 [$1], $2; }}",
         "r,l,r", loc, ip)


@dsl_user_op
def advance(epoch, *, loc=None, ip=None) -> Uint32:
    """The epoch after ``epoch``: ``(epoch + 1) % EPOCHS``."""
    return Uint32(_asm(
        T.i32(), [_u(epoch, loc, ip)],
        f"{{ .reg .pred p; add.u32 $0, $1, 1; setp.ge.u32 p, $0, {EPOCHS}; @p mov.u32 $0, 0; }}",
        "=r,r", loc, ip,
    ))


__all__ = [
    "advance",
    "clear_fragments",
    "deadline",
    "encode",
    "globaltimer",
    "ld_relaxed_u32",
    "ld_u64",
    "poll_fragments",
    "push_v4",
    "store_u32_if",
]
