"""The Lamport mailbox protocol of the DSpark all-reduce, in pure Python.

Nothing here touches a GPU: the layout, the encoding, the slot rotation, the
capacity decision, the sum orders (with their torch references) and a model
of the protocol that the CPU tests run over any number of ranks.

**The mailbox.** Every rank of a TP group of ``tp`` ranks owns one buffer of
``MailboxLayout.total_bytes`` bytes, mapped into every peer (CUDA IPC):

- a header of ``HEADER_BYTES``: one 32-bit *epoch* word per row slot (the
  buffer set the row uses next, 0 .. ``EPOCHS`` - 1, initially 0) at ``4 *
  row``, and the *status* word at ``STATUS_OFFSET`` (0: healthy; otherwise
  ``STATUS_TIMEOUT | row << 8 | src``, the first row and source rank whose
  partial did not arrive in time);
- ``EPOCHS`` buffer sets of ``tp`` source slots of ``capacity`` rows of
  ``hidden_size`` BF16 columns: the slot of (epoch ``e``, source rank ``s``,
  row ``r``) starts at ``slot_offset(e, s, r)``.

**A call** over ``m`` rows (``1 <= m <= capacity``), on every rank, per row
``r`` (one CTA): read the row's epoch ``e``; store the rank's partial row,
encoded, into slot (``e``, own rank, ``r``) of every peer's buffer
(peer-to-peer stores); poll the own buffer's slots (``e``, ``s``, ``r``) of
every peer ``s`` until no word is empty (``MARKER``); sum the rows in rank
order; write ``MARKER`` back over the slots read; advance the row's epoch to
``(e + 1) % EPOCHS``. Every rank advances every row of the call once, so the
ranks' epochs stay equal without any exchange, in CUDA graph replays too.

**Why no value is read stale or overwritten unread.** A peer stores into
slot (``e``, ``s``, ``r``) of this rank again only ``EPOCHS`` calls over
row ``r`` later; before that it has finished the calls in between, each of
which needed this rank's partial of the same call, which this rank pushes
only after its own previous call (the one that read and cleared the slot) has
completed (stream order). Two epochs would do; three leave a whole call of
slack (``LamportModel`` checks this, and that one epoch is not enough).

**The encoding.** A mailbox word is two BF16 columns; ``MARKER`` =
0xFFFFFFFF (two negative NaNs of full payload) marks it empty. A data word
equal to ``MARKER`` travels as ``ESCAPE`` = 0xFFFF7FFF (its low column's sign
bit cleared: still a NaN); every other word travels unchanged. So no data word
can look empty (-0.0 and NaN payloads included), and the only change is the
sign of one NaN in a word of two NaNs. That changes no output bit: every
output column is a sum over at least two ranks, and an FP32 addition with a
NaN operand returns the canonical NaN on NVIDIA GPUs whatever the payload.
Each 32-bit word is written and read single-copy atomically, so a word is
either the marker or the whole value.

**Sum orders** (``dspark_core.contracts.constants``): ``FP32_RANK_ORDER`` widens the
ranks' BF16 partials to FP32, adds them in rank order 0, 1, ..., each add
rounded to FP32, and rounds to BF16 once: vLLM's one-stage custom all-reduce
(upcast, add in rank order, downcast). ``BF16_RANK_ORDER`` rounds every add
to BF16: PyTorch's symmetric-memory ``one_shot_all_reduce`` (``add_bf16x2``
in rank order). At TP2 both are one rounded add of two BF16 values,
``bf16(a + b)``, which is what NCCL's BF16 sum computes (commutative, so the
rank order does not matter, and the FP32 sum of two BF16 values rounds to
BF16 without a double-rounding error), so at TP2 both orders equal NCCL's
all-reduce bit for bit, NaN payloads excepted.

**The sign of a zero sum.** Both orders start from rank 0's partial, so a sum
is -0.0 exactly where every rank's partial is -0.0 (round to nearest: a sum is
-0.0 only when both operands are; a nonzero sum of BF16 values is at least
BF16's smallest subnormal in magnitude, so no add underflows to a zero).
Lamport all-reduces that use -0.0 as their empty marker (FlashInfer's trtllm
one-shot and mnnvl kernels) turn every -0.0 partial into +0.0 before they
send it, so their sum is never -0.0. ``positive_zero=True`` reproduces that:
``+ 0.0`` after the sum (an FP32 ``add.rn`` on the BF16-rounded sum, before
the epilogue sees it), which changes -0.0 into +0.0 and no other value (NaN
payloads excepted, as above); that equals turning every -0.0 partial into
+0.0, because a sum of partials none of which is -0.0 is never -0.0.

**Capacity.** A call's rows are resident CTAs, so a mailbox holds at most
``MAX_CAPACITY`` rows per call; a caller that needs more (vLLM captures up to
512) sizes the mailbox for the rows its fused path runs and takes the stock
all-reduce above them, decided on the row count alone (``takes``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dspark_core import checks
from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER, MAX_SIZE, SUM_ORDERS
from dspark_core.planner.policy import MAX_DECODE_ROWS
from dspark_core.spec.numerics import CHUNK

MARKER = 0xFFFFFFFF
ESCAPE = 0xFFFF7FFF
EPOCHS = 3
HEADER_BYTES = 4096
STATUS_OFFSET = 2048
STATUS_TIMEOUT = 0x80000000
# Every row of a call is one resident CTA (a CTA polls its row while its
# peers' CTAs of the same row push): at most this many rows per call, fewer
# than the SMs of any supported GPU.
MAX_CAPACITY = 128
# The stock all-reduce each sum order reproduces bit for bit (NaN payloads
# excepted); at TP2 both also equal NCCL's.
STOCK_EQUIVALENTS = {
    FP32_RANK_ORDER: "vLLM's one-stage custom all-reduce (FP32 in rank order, one BF16 rounding)",
    BF16_RANK_ORDER: "PyTorch symmetric-memory one_shot_all_reduce and FlashInfer's trtllm all-reduce without "
                     "fp32_acc (BF16 adds in rank order)",
}


def check_tp(tp: int) -> None:
    """TypeError unless ``tp`` is an int (``checks.integer``), ValueError
    unless a power of two of at least 2."""
    tp = checks.integer("the mailbox's TP size tp", tp)
    if tp < 2 or tp & (tp - 1):
        raise ValueError(f"the mailbox all-reduce takes a power-of-two TP size of at least 2, not {tp}")


def check_sum_order(order: str) -> None:
    """ValueError unless ``order`` is one of ``SUM_ORDERS``."""
    if not isinstance(order, str) or order not in SUM_ORDERS:
        raise ValueError(f"a sum order is one of {', '.join(SUM_ORDERS)}, not {order!r}")


@dataclass(frozen=True)
class MailboxLayout:
    """The byte layout of one rank's mailbox buffer (module docstring)."""

    tp: int
    hidden_size: int
    capacity: int = MAX_DECODE_ROWS

    def __post_init__(self) -> None:
        """Each field an int (``checks.integer``; TypeError naming it), then
        in range (ValueError)."""
        check_tp(self.tp)
        # Stored as Python ints (a numpy uint8's arithmetic overflows).
        object.__setattr__(self, "tp", int(self.tp))
        object.__setattr__(self, "hidden_size", checks.integer("the mailbox's hidden_size", self.hidden_size, None,
                                                               MAX_SIZE))
        object.__setattr__(self, "capacity", checks.integer("the mailbox's capacity", self.capacity))
        if self.hidden_size <= 0 or self.hidden_size % CHUNK:
            raise ValueError(
                f"the mailbox's hidden_size must be a positive multiple of {CHUNK} columns "
                f"(one CTA of 256 threads x 8 columns), not {self.hidden_size}"
            )
        if not 1 <= self.capacity <= MAX_CAPACITY:
            raise ValueError(f"a mailbox holds 1 to {MAX_CAPACITY} rows per call (its capacity), not {self.capacity}")

    @property
    def row_bytes(self) -> int:
        return 2 * self.hidden_size

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + EPOCHS * self.tp * self.capacity * self.row_bytes

    def epoch_offset(self, row: int) -> int:
        """Byte offset of row ``row``'s epoch word."""
        self._check_row(row)
        return 4 * row

    def slot_offset(self, epoch: int, src: int, row: int) -> int:
        """Byte offset of the slot of (``epoch``, source rank ``src``, ``row``)."""
        if not 0 <= epoch < EPOCHS or not 0 <= src < self.tp:
            raise ValueError(f"no slot for epoch {epoch} and source rank {src}")
        self._check_row(row)
        return HEADER_BYTES + ((epoch * self.tp + src) * self.capacity + row) * self.row_bytes

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.capacity:
            raise ValueError(f"row {row} is outside the mailbox's {self.capacity} rows")


def next_epoch(epoch: int) -> int:
    """The epoch a row uses after ``epoch`` (a non-negative int)."""
    return (checks.integer("epoch", epoch, 0) + 1) % EPOCHS


def takes(m: int, capacity: int) -> bool:
    """Whether a call of ``m`` rows runs fused: ``1 <= m <= capacity``. The
    row count alone decides, so every rank decides the same (a rank that
    fused alone would wait for partials that never come)."""
    return 1 <= m <= capacity


def fallback_reason(m: int, capacity: int) -> str | None:
    """Why a call of ``m`` rows takes the stock all-reduce, or None (both
    ints: ``checks.integer``; ``m`` from 0, a call of no rows, to
    ``MAX_SIZE``: a negative row count is refused, not answered)."""
    m = checks.integer("the rows m", m, 0, MAX_SIZE)
    capacity = checks.integer("the mailbox's capacity", capacity, 1, MAX_SIZE)
    if m < 1:
        return f"{m} rows (nothing to reduce in the mailbox)"
    if m > capacity:
        return f"{m} rows, above the mailbox's capacity of {capacity}"
    return None


# ---------------------------------------------------------------- encoding


def encode_words(words: torch.Tensor) -> torch.Tensor:
    """The mailbox words of data words (int64 or int32 tensors holding
    32-bit patterns): ``MARKER`` becomes ``ESCAPE``, every other word stays.
    Returned as int64 in [0, 2**32)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.where(w == MARKER, torch.full_like(w, ESCAPE), w)


def decode_words(words: torch.Tensor) -> torch.Tensor:
    """The data words of mailbox words: the identity (an escaped word is
    read as the NaN pair it is)."""
    return words.to(torch.int64) & 0xFFFFFFFF


def is_empty(words: torch.Tensor) -> torch.Tensor:
    """Which mailbox words are empty (equal to ``MARKER``, compared as bits)."""
    return (words.to(torch.int64) & 0xFFFFFFFF) == MARKER


def bf16_words(x: torch.Tensor) -> torch.Tensor:
    """A BF16 tensor of an even last dim as its 32-bit words (int64): column
    ``2i`` in the low half, ``2i + 1`` in the high half (little endian)."""
    if x.dtype != torch.bfloat16 or x.shape[-1] % 2:
        raise ValueError("bf16_words takes a BF16 tensor of an even last dim")
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def words_bf16(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``bf16_words``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).view(torch.bfloat16)


# ---------------------------------------------------------------- sum orders


def reference_sum(partials: list[torch.Tensor], order: str, positive_zero: bool = False) -> torch.Tensor:
    """The all-reduce of ``order`` over the ranks' BF16 partials, listed in
    rank order, as torch operations (each ``+`` one rounded IEEE add):

    - ``FP32_RANK_ORDER``: ``s = p0.float(); s = s + p_r.float()`` for
      r = 1, 2, ...; then ``s.to(bfloat16)`` once;
    - ``BF16_RANK_ORDER``: ``s = (s + p_r.float()).to(bfloat16).float()``
      after each add;
    - ``positive_zero``: then ``(s.float() + 0.0).to(bfloat16)`` (-0.0
      becomes +0.0, module docstring).

    The unfused stock of the mailbox's sum order, any number of ranks."""
    check_sum_order(order)
    if len(partials) < 2:
        raise ValueError("an all-reduce reference takes the partials of at least two ranks")
    if any(p.dtype != torch.bfloat16 or p.shape != partials[0].shape for p in partials):
        raise ValueError("the partials must be BF16 tensors of one shape")
    acc = partials[0].float()
    for p in partials[1:]:
        acc = acc + p.float()
        if order == BF16_RANK_ORDER:
            acc = acc.to(torch.bfloat16).float()
    out = acc.to(torch.bfloat16)
    if positive_zero:
        out = (out.float() + 0.0).to(torch.bfloat16)
    return out


# ---------------------------------------------------------------- a model of the protocol


class ProtocolViolation(AssertionError):
    """The model saw a store into a slot still holding unread data, or read
    a value other than the one pushed for the call."""


class LamportModel:
    """The mailbox protocol over ``tp`` ranks as a state machine, every row
    of every call one CTA whose steps interleave at random; each rank runs
    its calls in stream order (a call starts once its previous call ended).

    A CTA of call ``n``, row ``r``: read the epoch ``e``; push (a store into
    slot (``e``, own rank, ``r``) of every peer, or of every rank including
    itself when ``published``, as a GEMM that publishes its partial does);
    then, one peer at a time, poll slot (``e``, peer, ``r``) until full, read
    it, clear it; then advance ``e``. A push into a slot that is not empty,
    or a read of any value other than (call ``n``, peer, ``r``), raises
    ``ProtocolViolation``. ``run(calls)`` plays calls of the given row
    counts (the same on every rank) and returns the number of steps."""

    def __init__(self, tp: int, capacity: int, epochs: int = EPOCHS, published: bool = False,
                 seed: int = 0) -> None:
        if tp < 2 or epochs < 1 or capacity < 1:
            raise ValueError("the model takes at least two ranks, one epoch and one row")
        self.tp, self.capacity, self.epochs, self.published = tp, capacity, epochs, published
        self.rng = random.Random(seed)
        # slots[rank][(epoch, src, row)] -> None (empty) or (call, src, row)
        self.slots = [dict() for _ in range(tp)]
        self.epoch = [[0] * capacity for _ in range(tp)]

    def _ctas(self, rank: int, call: int, m: int):
        """The steps of one rank's call as generators, one per row."""
        def cta(row: int):
            e = self.epoch[rank][row]
            targets = range(self.tp) if self.published else (p for p in range(self.tp) if p != rank)
            for peer in targets:
                key = (e, rank, row)
                if self.slots[peer].get(key) is not None:
                    raise ProtocolViolation(
                        f"rank {rank} call {call} row {row} stores into rank {peer}'s unread slot {key}"
                    )
                self.slots[peer][key] = (call, rank, row)
                yield
            sources = range(self.tp) if self.published else (s for s in range(self.tp) if s != rank)
            for src in sources:
                key = (e, src, row)
                while self.slots[rank].get(key) is None:
                    yield "blocked"
                value = self.slots[rank][key]
                if value != (call, src, row):
                    raise ProtocolViolation(f"rank {rank} call {call} row {row} read {value} from slot {key}")
                self.slots[rank][key] = None
                yield
            self.epoch[rank][row] = (e + 1) % self.epochs

        return [cta(r) for r in range(m)]

    def run(self, calls: list[int]) -> int:
        for m in calls:
            if not 1 <= m <= self.capacity:
                raise ValueError(f"a call of {m} rows does not fit {self.capacity}")
        next_call = [0] * self.tp
        running: list[list] = [[] for _ in range(self.tp)]
        steps = 0
        while True:
            for rank in range(self.tp):
                if not running[rank] and next_call[rank] < len(calls):
                    running[rank] = self._ctas(rank, next_call[rank], calls[next_call[rank]])
                    next_call[rank] += 1
            live = [(rank, i) for rank in range(self.tp) for i in range(len(running[rank]))]
            if not live:
                return steps
            self.rng.shuffle(live)
            progressed = False
            for rank, i in live:
                try:
                    state = next(running[rank][i])
                except StopIteration:
                    running[rank][i] = None
                    progressed = True
                    break
                steps += 1
                if state != "blocked":
                    progressed = True
                    break
            for rank in range(self.tp):
                running[rank] = [c for c in running[rank] if c is not None]
            if not progressed:
                raise ProtocolViolation("every CTA is blocked: the model deadlocked")


__all__ = [
    "EPOCHS",
    "ESCAPE",
    "HEADER_BYTES",
    "LamportModel",
    "MARKER",
    "MAX_CAPACITY",
    "MailboxLayout",
    "ProtocolViolation",
    "STATUS_OFFSET",
    "STATUS_TIMEOUT",
    "STOCK_EQUIVALENTS",
    "SUM_ORDERS",
    "bf16_words",
    "check_sum_order",
    "check_tp",
    "decode_words",
    "encode_words",
    "fallback_reason",
    "is_empty",
    "next_epoch",
    "reference_sum",
    "takes",
    "words_bf16",
]
