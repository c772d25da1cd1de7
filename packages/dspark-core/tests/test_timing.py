"""CPU checks of ``dspark_core.tools.timing``: the median's bookkeeping (with fake
CUDA events) and the draft step's GEMM weight bytes (on the meta device). The
capture helpers need a GPU; the benchmarks run them."""

from __future__ import annotations

import statistics

import pytest
import torch

from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel
from dspark_core.reference.tp import shard_draft
from dspark_core.tools import timing


class _Clock:
    """Fake CUDA events: ``record`` reads a clock the replays advance (ms)."""

    def __init__(self, durations):
        self.now = 0.0
        self.durations = iter(durations)
        self.log = []
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self):
                self.at = clock.now
                clock.log.append("record")

            def synchronize(self):
                clock.log.append("sync")

            def elapsed_time(self, other):
                return other.at - self.at

        self.Event = Event

    def replay(self):
        self.log.append("replay")
        self.now += next(self.durations)


def test_median_us_bookkeeping(monkeypatch):
    ms = [8.0, 8.0, 0.5, 0.25, 0.375, 0.125]  # two warm-ups, then four timed replays (exact in binary)
    clock = _Clock(ms)
    monkeypatch.setattr(torch.cuda, "Event", clock.Event)
    before = []
    us = timing.median_us(clock.replay, 4, warmup=2, calls=2, before=lambda: before.append(clock.log.count("replay")))
    assert us == statistics.median([t * 1000.0 / 2 for t in ms[2:]])
    assert before == [2, 3, 4, 5]  # once ahead of each timed replay, outside the events
    assert clock.log[:2] == ["replay", "replay"]  # no sync after the warm-ups
    assert clock.log[2:7] == ["record", "replay", "record", "sync", "record"]


def test_median_us_defaults(monkeypatch):
    clock = _Clock([0.25, 0.75, 0.5])
    monkeypatch.setattr(torch.cuda, "Event", clock.Event)
    assert timing.median_us(clock.replay, 3) == 500.0
    assert clock.log.count("replay") == 3


def _bytes_by_hand(model) -> int:
    total = 0
    for layer in model.layers:
        for w in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            total += w.numel() * w.element_size()
    return total


def test_gemm_weight_bytes_and_floor():
    model = DraftModel(DraftConfig(), device="meta")
    assert timing.gemm_weight_bytes(model) == _bytes_by_hand(model) > 0
    assert timing.weight_floor_us(model, 3.35e12) == _bytes_by_hand(model) / 3.35e12 * 1e6
    if not torch.cuda.is_available():  # no card, no floor: never another card's figure
        with pytest.raises(ValueError, match="needs bytes_per_s"):
            timing.weight_floor_us(model)
    shard = shard_draft(model, 0, 2)
    assert timing.gemm_weight_bytes(shard) == _bytes_by_hand(shard) == timing.gemm_weight_bytes(model) // 2


def test_step_case_is_a_block_step_after_the_context():
    from dspark_core.reference.config import small_config
    from dspark_core.reference.model import StepInputs

    model = DraftModel(small_config(num_layers=2))
    x, step, caches = timing.step_case(model, 3, 40, device="cpu")
    want = StepInputs.block(40, 3, span=43)
    assert torch.equal(x, model.embed_tokens(torch.arange(3)))
    for got, ref in ((step.positions, want.positions), (step.slots, want.slots), (step.attn_slots, want.attn_slots)):
        assert torch.equal(got, ref)
    bs = model.config.kv_block_size
    assert len(caches) == 2 and caches[0].num_slots == (43 // bs + 2) * bs
