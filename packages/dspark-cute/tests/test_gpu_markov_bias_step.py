"""GPU tests of the greedy Markov step with its bias GEMM
(``dspark_cute.cutedsl.markov.bias_step``): its tokens and embeddings bit
for bit against vLLM 0.33.0's greedy loop in its own torch ops on CUDA
(``test_gpu_markov.stock_loop``: ``F.embedding``, ``F.linear`` for the bias
on the live cuBLAS, the add, the output transform, ``argmax``, d2t) and the
spec's loop, where the build-time check found cuBLAS summing the bias in one
split (every row count here: the check's finding is printed and asserted).

- whole loops for R in {1, 2, 4, 5, 7, 9, 16, 64}, N 1 to 8, draft
  vocabularies of 384 to 202048 (padded heads), ranks 64, 128 and 256, soft cap 30 or none, with
  and without d2t, int32 and int64 anchors, planted NaN, -inf rows and
  saturation ties in the base logits, w1 rows of -0.0, subnormals and an
  infinity; the tokens a poisoned view with a column stride (vLLM's
  draft_tokens), its neighbours checked untouched;
- ties across CTAs and -0.0 against +0.0 with a zero ``w2`` (the bias +0.0);
- a CUDA graph of the loop replayed on new data; the fold's words left 0;
- the check's refusals name the reason (a row count it was not asked);
- the bias GEMM's BF16 output itself against ``F.linear`` on the live
  cuBLAS (the test variant that stores it), rows 1 to 64, ranks 64 to 256,
  special and spread values.

Fresh seeded random data: the seed is printed (repeat with DSPARK_SEED)."""

from __future__ import annotations

import pytest
import torch
from cute_testing import requires_cuda
from test_gpu_markov import MULT, POISON, check_graph_replays, crafted_rows, make_head, planted_base, stock_loop

from dspark_core.contracts.markov import markov_constants
from dspark_core.spec import markov as spec

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
RANK = 256


def make_fused(vocab, cap, w1, w2, d2t, rows, max_rows=None):
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep

    rank = w1.shape[1]
    step = MarkovBiasStep(markov_constants(vocab, rank, MULT, cap, d2t is not None), w1, d2t, w2,
                          max_rows=max_rows or max(rows))
    result = step.check(rows)
    print(f"the bias GEMM [{w2.shape[0]}, {rank}]: {result.summary()}")
    assert set(step.rows) == set(rows), step.reasons
    return step


def plant_w1(w1: torch.Tensor) -> None:
    """Special embedding rows: -0.0 and subnormals in row 1, an infinity in row 2."""
    w1[1, ::2] = -0.0
    w1[1, 1::4] = 1e-40
    w1[2, 7] = float("inf")


def run_loop(step, base, prev, n):
    """The loop into poisoned tokens, a view of a wider buffer (the column stride of vLLM's draft_tokens)."""
    from dspark_cute.cutedsl.markov.bias_step import run_fused_greedy_loop

    r = base.shape[0]
    wide = torch.full((64, n + 3), POISON, dtype=torch.int64, device="cuda")
    tokens = wide[:r, 1:n + 1]
    run_fused_greedy_loop(step, base, prev, tokens)
    torch.cuda.synchronize()
    assert (wide[:, 0] == POISON).all() and (wide[:, n + 1:] == POISON).all() and (wide[r:] == POISON).all()
    return tokens


LOOPS = [  # (R, N, vocab, vpad, cap, d2t, anchors, rank)
    (1, 4, 32768, 32768, 30.0, True, torch.int32, 256),
    (4, 4, 32000, 32064, None, True, torch.int64, 256),
    (7, 8, 384, 448, 30.0, False, torch.int32, 256),
    (16, 3, 202048, 202112, None, False, torch.int64, 256),
    (64, 4, 32000, 32000, 30.0, True, torch.int32, 256),
    (2, 1, 384, 384, None, True, torch.int64, 256),
    (5, 4, 2048, 2048, 30.0, True, torch.int64, 64),
    (9, 3, 4096, 4160, None, False, torch.int32, 128),
]


@pytest.mark.parametrize("r,n,vocab,vpad,cap,d2t,anchors,rank", LOOPS)
def test_loop_matches_stock_and_spec(seed, r, n, vocab, vpad, cap, d2t, anchors, rank):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, w2, m = make_head(gen, vocab + 1000, vocab, vpad, rank, d2t)
    plant_w1(w1)
    step = make_fused(vocab, cap, w1, w2, m, (r,))
    base = planted_base(gen, r, n, vocab, vpad)
    prev = torch.randint(0, vocab + 1000, (r,), generator=gen, device="cuda")
    prev[: min(r, 3)] = torch.tensor([1, 2, 0], device="cuda")[: min(r, 3)]  # the planted rows first
    prev = prev.to(anchors)
    assert step.takes(base[:, 0], prev, base.new_zeros(r, dtype=torch.int64), True)
    tokens = run_loop(step, base, prev, n)
    want = stock_loop(base, prev.long(), w1, w2, MULT, cap, m)
    assert torch.equal(tokens, want), (tokens, want)
    assert torch.equal(want, spec.greedy_loop(base, prev.long(), w1, w2, MULT, cap, m))
    assert not step.keys.any() and not step.counters.any()


def check_crafted_ties(seed, d2t, drafted) -> None:
    """Ties across CTAs and -0.0 against +0.0 (``crafted_rows``) with a zero
    ``w2`` (the bias +0.0), one step of 8 rows: ``drafted(vocab, w1, w2, d2t,
    base [8, 1, vocab], prev)``'s tokens against vLLM's loop."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    vocab = 32000
    w1, _, m = make_head(gen, vocab + 100, vocab, vocab, RANK, d2t)
    w2 = torch.zeros(vocab, RANK, dtype=BF16, device="cuda")
    base, _ = crafted_rows(vocab)
    prev = torch.randint(0, vocab + 100, (8,), generator=gen, device="cuda")
    tokens = drafted(vocab, w1, w2, m, base[:, None, :], prev)
    want = stock_loop(base[:, None, :], prev, w1, w2, MULT, 30.0, m)
    assert torch.equal(tokens, want), (tokens, want)


@pytest.mark.parametrize("d2t", [True, False])
def test_crafted_ties_with_a_zero_bias(seed, d2t):
    check_crafted_ties(seed, d2t, lambda vocab, w1, w2, m, base, prev: run_loop(
        make_fused(vocab, 30.0, w1, w2, m, (8,)), base, prev, 1))


def test_loop_cuda_graph(seed):
    from dspark_cute.cutedsl.markov.bias_step import run_fused_greedy_loop

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r, n, vocab = 4, 4, 32768
    w1, w2, m = make_head(gen, vocab + 10, vocab, vocab, RANK, True)
    step = make_fused(vocab, 30.0, w1, w2, m, (r,))
    base = planted_base(gen, r, n, vocab, vocab)
    prev = torch.randint(0, vocab + 10, (r,), generator=gen, device="cuda")
    tokens = torch.full((r, n), POISON, dtype=torch.int64, device="cuda")
    check_graph_replays(gen, lambda: run_fused_greedy_loop(step, base, prev, tokens), step, base, prev, tokens,
                        (w1, w2, m))


BIAS_CASES = [  # (R, vocab, vpad, rank, spread)
    (1, 32768, 32768, 256, False), (3, 32000, 32064, 256, True), (8, 384, 448, 64, True),
    (16, 4096, 4160, 128, False), (64, 32000, 32000, 256, True), (5, 202048, 202112, 256, True),
]


@pytest.mark.parametrize("r,vocab,vpad,rank,spread", BIAS_CASES)
def test_bias_bits_are_cublas(seed, r, vocab, vpad, rank, spread):
    """The bias GEMM's BF16 output itself (the test variant that stores it,
    ``step_with_bias``) against ``F.linear`` on the live cuBLAS, bit for bit
    (NaN payloads excepted), not only through the tokens: the embedding rows
    of -0.0, subnormals and an infinity, w2 with magnitudes spread over
    2^-24 .. 2^24 and 1% -0.0 where ``spread``; the step's tokens as the
    deployed kernel's."""
    import torch.nn.functional as F

    from dspark_core.tools.compare import assert_bitwise
    from dspark_cute.cutedsl.markov.bias_step import step_with_bias

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, w2, m = make_head(gen, vocab + 1000, vocab, vpad, rank, True)
    plant_w1(w1)
    if spread:
        scale = torch.exp2(torch.randint(-24, 25, w2.shape, generator=gen, device="cuda").float())
        w2 = (w2.float() * scale).to(BF16)
        w2[torch.rand(w2.shape, generator=gen, device="cuda") < 0.01] = -0.0
    step = make_fused(vocab, 30.0, w1, w2, m, (r,))
    base = planted_base(gen, r, 1, vocab, vpad)[:, 0]
    prev = torch.randint(0, vocab + 1000, (r,), generator=gen, device="cuda")
    prev[: min(r, 3)] = torch.tensor([1, 2, 0], device="cuda")[: min(r, 3)]
    tokens = torch.full((r,), POISON, dtype=torch.int64, device="cuda")
    bias = step_with_bias(step, base, prev, tokens)
    torch.cuda.synchronize()
    assert_bitwise(bias, F.linear(w1[prev], w2)[:, :vocab], "the bias GEMM's output")
    deployed = torch.full((r,), POISON, dtype=torch.int64, device="cuda")
    step.run(base, prev, deployed)
    torch.cuda.synchronize()
    assert torch.equal(tokens, deployed)
    assert not step.keys.any() and not step.counters.any()


def test_unchecked_rows_say_why(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, w2, m = make_head(gen, 500, 384, 384, RANK, True)
    step = make_fused(384, None, w1, w2, m, (1, 2), max_rows=4)
    base = torch.zeros(3, 384, dtype=BF16, device="cuda")
    ids = torch.zeros(3, dtype=torch.int64, device="cuda")
    why = step.problem(base, ids, ids.clone())
    assert why is not None and "not checked" in why
    with pytest.raises(ValueError, match="not checked"):
        step.run(base, ids, ids.clone())
    with pytest.raises(ValueError, match="int32 or int64"):
        step.run(base[:2], ids[:2].float(), ids[:2].clone())
