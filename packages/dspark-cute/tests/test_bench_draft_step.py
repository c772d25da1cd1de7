"""The draft-step benchmark's plumbing on a CPU (benchmarks/bench_draft_step.py
and scripts/stock/stock_step.py): the stock step's assembly is the reference
draft's forward and context chain, its Markov loop is the spec's greedy loop,
the step's operands are laid out as stated, the bit counts count bits, and a
dry run compares every part and fails where one differs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dspark_core.demo_stock import load_script
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel
from dspark_core.spec import markov

ROOT = Path(__file__).resolve().parents[3]


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


STOCK = load_script("stock_step")
BENCH = _module("bench_draft_step", ROOT / "packages" / "dspark-cute" / "benchmarks" / "bench_draft_step.py")


@pytest.fixture(scope="module")
def model():
    return DraftModel(small_config(seed=3))


def _parts(model, seed, requests=2, n=3, context=8):
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    head = STOCK.Head.random(c.hidden_size, 256, 1024, 64, "cpu", gen)
    fc = (torch.randn(c.hidden_size, 512, generator=gen) / 512 ** 0.5).to(torch.bfloat16)
    attention = lambda q, cache, slots: BENCH.attend(q, BENCH._CacheView(cache), slots, c.num_kv_heads)  # noqa: E731
    stock = STOCK.StockStep(model, head, fc, STOCK.SpecKernels(model.rotary), attention, pdl=False)
    batch = STOCK.StepBatch.make(requests, n, context, c.kv_block_size, 512, c.vocab_size, "cpu", gen)
    past = torch.randn(batch.num_blocks, c.num_kv_heads, c.kv_block_size, 2 * c.head_dim, generator=gen)
    return stock, batch, past.to(torch.bfloat16)


def _caches(model, batch, past):
    caches = model.make_caches(batch.num_blocks)
    for cache in caches:
        cache.tensor.copy_(past)
    return caches


def test_the_stock_step_is_the_reference_forward_and_context_chain(model, seed):
    stock, batch, past = _parts(model, seed)
    caches = _caches(model, batch, past)
    hidden = torch.zeros(batch.aux.shape[0], model.config.hidden_size, dtype=torch.bfloat16)
    tokens = torch.zeros(batch.requests, batch.n, dtype=torch.int64)
    x, logits, _ = stock.step(batch, [c.tensor for c in caches], hidden, tokens)

    ref = _caches(model, batch, past)
    states = F.linear(batch.aux, stock.fc)
    model.precompute_and_store_context_kv(states, batch.ctx_positions, ref, batch.ctx_slots)
    want = model(model.embed_tokens(batch.input_ids.long()), batch.step, ref)
    assert torch.equal(x.view(torch.int16), want.view(torch.int16))
    for mine, theirs in zip(caches, ref):
        assert torch.equal(mine.tensor.view(torch.int16), theirs.tensor.view(torch.int16))
    assert torch.equal(logits, F.linear(want, stock.head.lm_head))
    # DraftModel.forward's call on the stock ops (the backbone alone, over the caches the step wrote).
    again = stock.forward(model.embed_tokens(batch.input_ids.long()), batch.step, ref)
    assert torch.equal(again.view(torch.int16), want.view(torch.int16))
    # The context rows changed the caches (the comparison above is not of untouched caches).
    assert not torch.equal(ref[0].tensor, past)


def test_the_stock_markov_loop_is_the_specs_greedy_loop(model, seed):
    stock, batch, _ = _parts(model, seed, requests=3, n=4)
    head = stock.head
    gen = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(batch.rows, head.lm_head.shape[0], generator=gen).to(torch.bfloat16)
    logits[0, :5] = 7.0  # a tie the first index wins
    tokens = torch.zeros(batch.requests, batch.n, dtype=torch.int64)
    stock.markov(logits, batch.input_ids, batch.anchor_idx, batch.n, tokens)
    want = markov.greedy_loop(logits.view(batch.requests, batch.n, -1), batch.input_ids[batch.anchor_idx],
                              head.markov_w1, head.markov_w2, head.output_multiplier, head.soft_cap, head.d2t)
    assert torch.equal(tokens, want)
    assert set(tokens.flatten().tolist()) <= set((torch.arange(256) + head.d2t).tolist())


def test_a_steps_operands_are_laid_out_as_stated(seed):
    gen = torch.Generator().manual_seed(seed)
    b = STOCK.StepBatch.make(3, 4, 20, 16, 8, 100, "cpu", gen)
    per = 32  # 24 slots a request, rounded up to whole blocks of 16
    assert b.rows == 12 and b.num_blocks == 3 * per // 16 + 1
    assert b.step.positions.tolist() == [20, 21, 22, 23] * 3
    assert b.step.slots.tolist() == [r * per + p for r in range(3) for p in range(20, 24)]
    for row in range(12):
        r, pos = divmod(row, 4)
        valid = b.step.attn_slots[row][b.step.attn_slots[row] >= 0]
        assert valid.tolist() == [r * per + p for p in range(20 + pos + 1)]
    assert b.ctx_positions.tolist() == [15, 16, 17, 18, 19] * 3
    assert b.ctx_slots.tolist() == [r * per + p for r in range(3) for p in range(15, 20)]
    assert b.anchor_idx.tolist() == [0, 4, 8] and b.aux.shape == (15, 8)
    assert BENCH.shape_of(1, 4) == (1, 1) and BENCH.shape_of(512, 4) == (128, 4)
    with pytest.raises(ValueError, match="multiple of N"):
        BENCH.shape_of(6, 4)
    with pytest.raises(ValueError, match="n \\+ 1 cached"):
        STOCK.StepBatch.make(1, 4, 4, 16, 8, 100, "cpu", gen)


def test_differing_counts_bit_patterns():
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    b = torch.tensor([-0.0, 1.0, float("nan"), 2.0])
    assert BENCH.differing((a,), (b,)) == (1, 4)
    assert BENCH.differing((a.bfloat16(), None), (a, b)) == (0, 4)  # widened exactly; None skipped
    assert BENCH.differing((torch.tensor([1, 2, 3]),), (torch.tensor([1, 0, 3]),)) == (1, 3)


def test_a_dry_run_compares_every_part_and_fails_where_one_differs(tmp_path, monkeypatch, seed):
    args = ["--dry", "--rows", "1,4", "--context", "6", "--seed", str(seed)]
    assert BENCH.main([*args, "--out", str(tmp_path / "a")]) == 0
    data = json.loads((tmp_path / "a" / "draft_step.json").read_text())
    assert [r["m"] for r in data["results"]] == [1, 4]
    for r in data["results"]:
        compared = {p["kind"] for p in r["parts"] if p["differing"] is not None}
        assert compared == {"embed", "input_norm", "qk_front", "o_gate", "boundary", "activation"}
        assert all(p["differing"] == 0 for p in r["parts"] if p["differing"] is not None)
        assert all(v[0] == 0 and v[1] > 0 for v in r["whole_step_differing"].values())
    assert "| **whole step, one graph** |" in (tmp_path / "a" / "draft_step.md").read_text()

    part = BENCH.DSparkStep.part

    def poisoned(self, kind):
        found = part(self, kind)
        if kind != "activation":
            return found
        prep, fn = found
        return prep, lambda i, gu: (fn(i, gu)[0].neg(),)

    monkeypatch.setattr(BENCH.DSparkStep, "part", poisoned)
    assert BENCH.main([*args, "--rows", "4", "--out", str(tmp_path / "b")]) == 1
    text = (tmp_path / "b" / "draft_step.md").read_text()
    assert "differ**" in text


def test_bad_rows_are_refused(capsys):
    assert BENCH.main(["--dry", "--rows", "3"]) == 2
    assert "multiple of N = 4" in capsys.readouterr().err


def test_a_tp_rank_run_times_one_ranks_shards(tmp_path, seed):
    """``--tp 2``: the layers' shards (half the heads, KV heads and
    intermediate size), half of fc's columns and of the LM head's rows, the
    logits gathered back to the full draft vocabulary for the Markov loop;
    bit for bit as at TP1, the setup line saying what is excluded."""
    out = tmp_path / "tp2"
    assert BENCH.main(["--dry", "--tp", "2", "--rows", "4", "--context", "6", "--seed", str(seed),
                       "--out", str(out)]) == 0
    data = json.loads((out / "draft_step.json").read_text())
    assert "One rank of TP2" in data["meta"]["setup"] and "excluded on both sides" in data["meta"]["setup"]
    full = BENCH.small_config()
    config, fc_width, lm_rows = BENCH.tp_rank_setup(full, 2, 3 * 256, 512)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (
        full.num_heads // 2, full.num_kv_heads // 2, full.intermediate_size // 2)
    assert (fc_width, lm_rows) == (384, 256)
    assert all(v[0] == 0 for r in data["results"] for v in r["whole_step_differing"].values())


def test_a_tp_size_that_does_not_divide_is_refused(capsys):
    assert BENCH.main(["--dry", "--tp", "8", "--rows", "4"]) == 2
    assert "TP8 does not divide" in capsys.readouterr().err
