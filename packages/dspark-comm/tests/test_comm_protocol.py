"""CPU tests of the mailbox protocol (``dspark_comm.protocol``): the layout,
the encoding over every 32-bit word, the sum orders and their stock
equivalents, the capacity decision and the Lamport model over 2 to 8 ranks."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from dspark_comm import protocol
from dspark_comm.protocol import (
    EPOCHS,
    ESCAPE,
    HEADER_BYTES,
    MARKER,
    STATUS_OFFSET,
    LamportModel,
    MailboxLayout,
    ProtocolViolation,
)
from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER
from dspark_core.tools.compare import mismatches

H = 8192


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_layout_slots_tile_the_buffer(tp):
    layout = MailboxLayout(tp, 2048, 5)
    starts = sorted(
        layout.slot_offset(e, s, r) for e in range(EPOCHS) for s in range(tp) for r in range(5)
    )
    assert starts[0] == HEADER_BYTES
    assert all(b - a == layout.row_bytes for a, b in zip(starts, starts[1:]))
    assert starts[-1] + layout.row_bytes == layout.total_bytes
    assert all(o % 16 == 0 for o in starts)
    # The epoch words and the status fit the header apart.
    assert layout.epoch_offset(4) + 4 <= STATUS_OFFSET < HEADER_BYTES


@pytest.mark.parametrize(
    "args,match",
    [
        ((1, H, 16), "power-of-two"),
        ((3, H, 16), "power-of-two"),
        ((6, H, 16), "power-of-two"),
        ((2, 3000, 16), "multiple of 2048"),
        ((2, 0, 16), "multiple of 2048"),
        ((2, H, 0), "1 to 128 rows"),
        ((2, H, 129), "1 to 128 rows"),
    ],
)
def test_layout_refuses(args, match):
    with pytest.raises(ValueError, match=match):
        MailboxLayout(*args)


def test_layout_refuses_bad_slots():
    layout = MailboxLayout(2, H, 4)
    for bad in [(EPOCHS, 0, 0), (0, 2, 0), (0, 0, 4), (-1, 0, 0)]:
        with pytest.raises(ValueError):
            layout.slot_offset(*bad)


def test_epochs_rotate():
    seen = [0]
    for _ in range(2 * EPOCHS):
        seen.append(protocol.next_epoch(seen[-1]))
    assert seen == [i % EPOCHS for i in range(2 * EPOCHS + 1)]


# ---------------------------------------------------------------- encoding


# Partners of every pattern in the other half of a word: zeros of both signs,
# the NaN and infinity patterns, the extremes of each class and the marker's
# own half with its neighbours.
PARTNERS = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
            0x7F81, 0x7FC0, 0x7FFF, 0xFFC0, 0xFFFE, 0xFFFF, 0x3F80, 0xBF80]


def test_encoding_of_every_pattern_in_either_half():
    """Each of the 65536 BF16 patterns in the low and in the high column of
    a word, beside each partner: no word encodes to the marker, every word
    but the marker travels unchanged, the marker travels as ESCAPE."""
    patterns = torch.arange(0, 1 << 16, dtype=torch.int64)
    for partner in PARTNERS:
        for w in (patterns | (partner << 16), (patterns << 16) | partner):
            enc = protocol.encode_words(w)
            assert not bool(protocol.is_empty(enc).any())
            dec = protocol.decode_words(enc)
            changed = dec != w
            expected = int(partner == 0xFFFF)
            assert int(changed.sum()) == expected
            if expected:
                assert w[changed].tolist() == [MARKER] and dec[changed].tolist() == [ESCAPE]


def test_encoding_of_int32_words():
    """Words given as int32 (a BF16 tensor's view) encode alike."""
    w = torch.tensor([-1, 0, -(2**31), 2**31 - 1, -2], dtype=torch.int32)
    assert protocol.encode_words(w).tolist() == [ESCAPE, 0, 2**31, 2**31 - 1, 2**32 - 2]


def test_escape_is_a_pair_of_nans():
    pair = protocol.words_bf16(torch.tensor([ESCAPE, MARKER]))
    assert bool(torch.isnan(pair).all())


def test_bf16_words_round_trip_every_pattern():
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    words = protocol.bf16_words(patterns)
    assert words.shape == (2**15,)
    back = protocol.words_bf16(words)
    assert torch.equal(back.view(torch.int16), patterns.view(torch.int16))
    # Column 2i in the low half of word i.
    lo = (words & 0xFFFF).to(torch.int32)
    assert torch.equal(lo, patterns.view(torch.int16)[0::2].to(torch.int32) & 0xFFFF)


def test_escaped_word_sums_to_the_same_bits():
    """Against every BF16 pattern of a second rank, a word of two 0xFFFF NaNs
    and its escape sum to NaN alike, in both orders (no output bit changes)."""
    other = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    marker = protocol.words_bf16(torch.full((2**15,), MARKER))
    escaped = protocol.words_bf16(protocol.encode_words(protocol.bf16_words(marker)))
    assert not torch.equal(marker.view(torch.int16), escaped.view(torch.int16))
    for order in protocol.SUM_ORDERS:
        for parts in ([marker, other], [other, marker]):
            a = protocol.reference_sum(parts, order)
            b = protocol.reference_sum([escaped if p is marker else p for p in parts], order)
            assert int(mismatches(a, b).sum()) == 0
            assert bool(torch.isnan(a).all())


# ---------------------------------------------------------------- sum orders


def _bf16_rn(x: np.ndarray) -> np.ndarray:
    """float64 values rounded to the nearest BF16 (ties to even), directly:
    no intermediate FP32 rounding."""
    out = np.empty_like(x)
    finite = np.isfinite(x)
    xf = x[finite]
    _, e = np.frexp(xf)
    quantum = np.exp2(np.maximum(e - 8, -133).astype(np.float64))
    r = np.rint(xf / quantum) * quantum
    r[np.abs(r) >= 2.0**128] = np.inf * np.sign(r[np.abs(r) >= 2.0**128])
    out[finite] = r
    out[~finite] = x[~finite]
    return out


def _random_bf16(gen: torch.Generator, n: int) -> torch.Tensor:
    """Random BF16 bit patterns: uniform over all 65536 (every exponent,
    subnormals, infinities and NaN), half of them then pulled close in
    exponent to their neighbour so that sums cancel and round."""
    bits = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    near = x.float() * torch.exp2(torch.randint(-3, 4, (n,), generator=gen).float())
    pick = torch.rand(n, generator=gen) < 0.5
    return torch.where(pick, near.to(torch.bfloat16), x)


def test_tp2_orders_agree_and_round_once(seed):
    """At TP2 both orders are one correctly rounded BF16 add: FP32 then BF16
    has no double-rounding error (checked against a direct rounding of the
    exact float64 sum), so they equal NCCL's BF16 sum."""
    gen = torch.Generator().manual_seed(seed)
    a, b = _random_bf16(gen, 1 << 20), _random_bf16(gen, 1 << 20)
    fp32 = protocol.reference_sum([a, b], FP32_RANK_ORDER)
    bf16 = protocol.reference_sum([a, b], BF16_RANK_ORDER)
    assert int(mismatches(fp32, bf16).sum()) == 0
    # The other rank order: a + b == b + a.
    assert int(mismatches(fp32, protocol.reference_sum([b, a], FP32_RANK_ORDER)).sum()) == 0
    with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as in FP32
        exact = a.double().numpy() + b.double().numpy()
    direct = torch.from_numpy(_bf16_rn(exact)).float().to(torch.bfloat16)
    assert int(mismatches(fp32, direct).sum()) == 0


def test_orders_differ_beyond_two_ranks():
    """At TP4 the orders are distinct stock all-reduces: the FP32 sum keeps
    what each BF16-rounded add loses."""
    one, eps = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0**-8], dtype=torch.bfloat16)
    parts = [one, eps, eps, torch.tensor([0.0], dtype=torch.bfloat16)]
    fp32 = protocol.reference_sum(parts, FP32_RANK_ORDER)
    bf16 = protocol.reference_sum(parts, BF16_RANK_ORDER)
    assert fp32.item() == 1.0 + 2.0**-7 and bf16.item() == 1.0
    assert set(protocol.STOCK_EQUIVALENTS) == set(protocol.SUM_ORDERS)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("order", [FP32_RANK_ORDER, BF16_RANK_ORDER])
def test_positive_zero_changes_only_a_negative_zero_sum(tp, order, seed):
    """``positive_zero``: the sum with every -0.0 partial first turned into
    +0.0 (what a Lamport all-reduce whose marker is -0.0 sends), equal to
    the plain sum with only its -0.0 results turned into +0.0. Rows where
    every rank's partial is -0.0 are planted (the only -0.0 sums), and
    zeros of both signs elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 << 16
    parts = [_random_bf16(gen, n) for _ in range(tp)]
    neg, pos = torch.tensor(-0.0, dtype=torch.bfloat16), torch.tensor(0.0, dtype=torch.bfloat16)
    all_neg = torch.rand(n, generator=gen) < 0.05
    for r, p in enumerate(parts):
        p[all_neg] = neg
        some = torch.rand(n, generator=gen) < 0.1
        p[some & ~all_neg] = neg if r % 2 else pos
    plain = protocol.reference_sum(parts, order)
    lamport = protocol.reference_sum([torch.where(p.view(torch.int16) == -32768, pos, p) for p in parts], order)
    positive = protocol.reference_sum(parts, order, positive_zero=True)
    assert int(mismatches(positive, lamport).sum()) == 0
    plain_bits = plain.view(torch.int16)
    negative_zero = plain_bits == -32768
    assert int(negative_zero.sum()) >= int(all_neg.sum()) > 0  # the planted rows sum to -0.0 in the plain order
    assert bool((positive.view(torch.int16)[negative_zero] == 0).all())
    assert int(mismatches(positive[~negative_zero], plain[~negative_zero]).sum()) == 0


def test_reference_sum_refuses():
    x = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sum order"):
        protocol.reference_sum([x, x], "fp16_tree")
    with pytest.raises(ValueError, match="two ranks"):
        protocol.reference_sum([x], FP32_RANK_ORDER)
    with pytest.raises(ValueError, match="BF16 tensors"):
        protocol.reference_sum([x, x.float()], FP32_RANK_ORDER)


# ---------------------------------------------------------------- the decision


@pytest.mark.parametrize("m,capacity,fused", [(1, 16, True), (16, 16, True), (17, 16, False),
                                              (0, 16, False), (64, 64, True), (65, 64, False)])
def test_row_count_decides(m, capacity, fused):
    assert protocol.takes(m, capacity) is fused
    reason = protocol.fallback_reason(m, capacity)
    assert (reason is None) is fused
    if m > capacity:
        assert f"capacity of {capacity}" in reason


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("published", [False, True])
@pytest.mark.parametrize("epochs", [EPOCHS, 2])
def test_model_never_overwrites_or_reads_stale(tp, published, epochs, seed):
    rng = random.Random(seed)
    for trial in range(6):
        calls = [rng.choice([1, 1, 2, 3, 4]) for _ in range(40)]
        model = LamportModel(tp, capacity=4, epochs=epochs, published=published, seed=seed + trial)
        assert model.run(calls) > 0


@pytest.mark.parametrize("published", [False, True])
def test_model_catches_a_single_epoch(published, seed):
    """One buffer set is not enough (a fast rank overwrites a slow rank's
    unread slot): the model must see it, or it proves nothing."""
    caught = 0
    for trial in range(40):
        model = LamportModel(2, capacity=2, epochs=1, published=published, seed=seed * 41 + trial)
        try:
            model.run([2] * 30)
        except ProtocolViolation:
            caught += 1
    assert caught > 0


def test_model_refuses():
    with pytest.raises(ValueError):
        LamportModel(1, 4)
    with pytest.raises(ValueError, match="does not fit"):
        LamportModel(2, 4).run([5])


def test_constants_are_consistent():
    assert MARKER == 0xFFFFFFFF and ESCAPE != MARKER
    assert math.log2(protocol.MAX_CAPACITY).is_integer()
    assert 4 * protocol.MAX_CAPACITY <= STATUS_OFFSET < HEADER_BYTES
