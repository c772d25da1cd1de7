"""GPU tests of the greedy Markov loop in one persistent launch
(``dspark_cute.cutedsl.markov.persistent``): its tokens bit for bit against
vLLM 0.33.0's greedy loop in its own torch ops on CUDA
(``test_gpu_markov.stock_loop``, the bias GEMM on the live cuBLAS), the
spec's loop and the one-launch-a-step loop (``bias_step``), where the
build-time check found cuBLAS summing the bias in one split.

- whole loops of ``test_gpu_markov_bias_step.LOOPS`` whose draft columns fit
  one CTA per SM and 32 rows (the others: the refusal says why), with and without
  PDL: planted NaN, -inf rows and saturation ties, special w1 rows, int32
  and int64 anchors, tokens a poisoned strided view;
- ties across CTAs with a zero ``w2``;
- the same loop launched again and again (the fold's words and both
  counters left 0 after every launch), and a CUDA graph replayed on new
  data.

Fresh seeded random data: the seed is printed (repeat with DSPARK_SEED)."""

from __future__ import annotations

import pytest
import torch
from cute_testing import requires_cuda
from test_gpu_markov import MULT, POISON, check_graph_replays, make_head, planted_base, stock_loop
from test_gpu_markov_bias_step import LOOPS, check_crafted_ties, plant_w1, run_loop

from dspark_core.contracts.markov import markov_constants
from dspark_core.errors import Unsupported
from dspark_core.spec import markov as spec

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
RANK = 256


def make_loop(vocab, cap, w1, w2, d2t, rows, steps, pdl=None):
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentLoop

    loop = MarkovPersistentLoop(markov_constants(vocab, w1.shape[1], MULT, cap, d2t is not None), w1, d2t, w2,
                                steps, max_rows=max(rows), pdl=pdl)
    result = loop.check(rows)
    print(f"the bias GEMM [{w2.shape[0]}, {w1.shape[1]}]: {result.summary()}")
    assert set(loop.rows) == set(rows), loop.reasons
    assert loop.probe() is None  # the build's launch against vLLM's loop
    assert set(loop.rows) == set(rows)
    return loop


def run_persistent(loop, base, prev):
    r, n = base.shape[:2]
    wide = torch.full((64, n + 3), POISON, dtype=torch.int64, device="cuda")
    tokens = wide[:r, 1:n + 1]
    loop.run(base, prev, tokens)
    torch.cuda.synchronize()
    assert (wide[:, 0] == POISON).all() and (wide[:, n + 1:] == POISON).all() and (wide[r:] == POISON).all()
    return tokens


def _fits(vocab: int) -> bool:
    return -(-vocab // 256) <= torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("r,n,vocab,vpad,cap,d2t,anchors,rank", LOOPS)
def test_loop_matches_stock_spec_and_the_step_loop(seed, pdl, r, n, vocab, vpad, cap, d2t, anchors, rank):
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, w2, m = make_head(gen, vocab + 1000, vocab, vpad, rank, d2t)
    plant_w1(w1)
    if r > 32:
        with pytest.raises(ValueError, match="1 to 32 rows"):
            make_loop(vocab, cap, w1, w2, m, (r,), n, pdl)
        return
    if not _fits(vocab):
        with pytest.raises(Unsupported, match="SMs"):
            make_loop(vocab, cap, w1, w2, m, (r,), n, pdl)
        return
    loop = make_loop(vocab, cap, w1, w2, m, (r,), n, pdl)
    base = planted_base(gen, r, n, vocab, vpad)
    prev = torch.randint(0, vocab + 1000, (r,), generator=gen, device="cuda")
    prev[: min(r, 3)] = torch.tensor([1, 2, 0], device="cuda")[: min(r, 3)]
    prev = prev.to(anchors)
    tokens = run_persistent(loop, base, prev)
    want = stock_loop(base, prev.long(), w1, w2, MULT, cap, m)
    assert torch.equal(tokens, want), (tokens, want)
    assert torch.equal(want, spec.greedy_loop(base, prev.long(), w1, w2, MULT, cap, m))
    step = MarkovBiasStep(loop.constants, w1, m, w2, max_rows=r)
    step.check((r,))
    assert torch.equal(run_loop(step, base, prev, n), tokens)
    assert not loop.keys.any() and not loop.counters.any()


@pytest.mark.parametrize("d2t", [True, False])
def test_crafted_ties_with_a_zero_bias(seed, d2t):
    check_crafted_ties(seed, d2t, lambda vocab, w1, w2, m, base, prev: run_persistent(
        make_loop(vocab, 30.0, w1, w2, m, (8,), 1), base, prev))


def test_launches_in_a_row_and_rows_that_change(seed):
    """Each launch leaves its words 0 for the next, whatever its rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, vocab = 4, 32768
    w1, w2, m = make_head(gen, vocab + 10, vocab, vocab, RANK, True)
    loop = make_loop(vocab, 30.0, w1, w2, m, (1, 3, 8, 32), n)
    for r in (1, 32, 3, 8, 32, 1):
        base = planted_base(gen, r, n, vocab, vocab)
        prev = torch.randint(0, vocab + 10, (r,), generator=gen, device="cuda")
        tokens = run_persistent(loop, base, prev)
        assert torch.equal(tokens, stock_loop(base, prev, w1, w2, MULT, 30.0, m)), r
        assert not loop.keys.any() and not loop.counters.any()


def test_loop_cuda_graph(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r, n, vocab = 4, 4, 32768
    w1, w2, m = make_head(gen, vocab + 10, vocab, vocab, RANK, True)
    loop = make_loop(vocab, 30.0, w1, w2, m, (r,), n)
    base = planted_base(gen, r, n, vocab, vocab)
    prev = torch.randint(0, vocab + 10, (r,), generator=gen, device="cuda")
    tokens = torch.full((r, n), POISON, dtype=torch.int64, device="cuda")
    check_graph_replays(gen, lambda: loop.launch(base, prev, tokens), loop, base, prev, tokens, (w1, w2, m))
