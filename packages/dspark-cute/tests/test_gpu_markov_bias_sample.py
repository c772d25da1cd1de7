"""GPU tests of the probabilistic Markov step with its bias GEMM
(``dspark_cute.cutedsl.markov.bias_sample``), bound where the greedy bias
step's build-time check found cuBLAS summing the bias in one split (every
row count here: the check's finding is printed and asserted):

- whole loops, R in {1, 2, 5, 16, 32}, N 1 to 8, draft vocabularies 384 to
  32768 over target vocabularies 512 to 202752, ranks 64 to 256, soft cap 30
  or none, int32 and int64 anchors, one inert row (``idx_map`` -1), a third
  of the requests greedy (temperature 0), planted NaN, -inf rows and
  saturation ties in the base logits, w1 rows of -0.0, subnormals and an
  infinity: tokens (a poisoned view with vLLM's column stride, neighbours
  checked untouched) and the whole logits cache (bits, untouched rows
  included) against the probabilistic loop with the stock bias GEMM
  (``loop.run_probabilistic_loop``: cuBLAS's ``F.linear``, then
  ``MarkovSampleStep``, itself checked against vLLM's Triton
  ``gumbel_sample`` binary), and against the spec's loop where no NaN is
  planted (the spec's stated exception);
- temperatures past vLLM's range (subnormal, 3e38, +inf, -0.0), where
  ``-inf / temp`` is -inf, +inf or NaN for the unmapped columns;
- vLLM's own loop with its Triton ``gumbel_sample`` binary, where staged;
- a CUDA graph of the loop replayed on new data; the fold's words left 0.

Fresh seeded random data: the seed is printed (repeat with DSPARK_SEED)."""

from __future__ import annotations

import pytest
import torch
from cute_testing import capture_calls, requires_cuda
from test_gpu_markov import MULT, POISON, make_head, planted_base, sample_requests, spec_probabilistic_loop
from test_gpu_markov_bias_step import plant_w1

from dspark_core.contracts.markov import markov_constants, markov_sample_constants

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16


def make_steps(gen, vocab, vt, cap, rank, rows):
    """``(fused, sample, w1, w2, d2t)``: the probabilistic bias step bound by
    the greedy bias step's check at ``rows`` on a random head with a d2t map,
    and the probabilistic step after the stock GEMM on the same head."""
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleStep
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep
    from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

    w1, w2, m = make_head(gen, vt, vocab, vocab, rank, True)
    plant_w1(w1)
    greedy = MarkovBiasStep(markov_constants(vocab, rank, MULT, cap, True), w1, m, w2, max_rows=max(rows))
    result = greedy.check(rows)
    print(f"the bias GEMM [{w2.shape[0]}, {rank}]: {result.summary()}")
    assert set(greedy.rows) == set(rows), greedy.reasons
    constants = markov_sample_constants(vocab, vt, rank, MULT, cap)
    fused = MarkovBiasSampleStep(constants, w1, m, w2, max_rows=max(rows))
    fused.bind(greedy)
    assert set(fused.rows) == set(rows)
    sample = MarkovSampleStep(constants, w1, m, max_rows=64)
    sample.prepare()
    return fused, sample, w1, w2, m


def run_fused(fused, base, prev, requests, cache):
    """The fused loop into poisoned tokens, a view of a wider buffer (vLLM's draft_tokens' column stride)."""
    from dspark_cute.cutedsl.markov.bias_sample import run_fused_probabilistic_loop

    r, n = base.shape[:2]
    wide = torch.full((40, n + 3), POISON, dtype=torch.int64, device="cuda")
    tokens = wide[:r, 1:n + 1]
    assert fused.takes(base[:, 0], prev, tokens[:, 0], requests[0][:, 0], requests[1], requests[2],
                       requests[3][:, 0], cache, 0, True)
    run_fused_probabilistic_loop(fused, base, prev, tokens, *requests, cache)
    torch.cuda.synchronize()
    assert (wide[:, 0] == POISON).all() and (wide[:, n + 1:] == POISON).all() and (wide[r:] == POISON).all()
    assert not fused.keys.any() and not fused.counters.any()
    return tokens


def stock_gemm_loop(sample, base, prev, w2, requests, cache):
    """The probabilistic loop with cuBLAS's bias GEMM and ``MarkovSampleStep`` (``loop.run_probabilistic_loop``)."""
    from dspark_cute.cutedsl.markov.loop import run_probabilistic_loop

    r, n = base.shape[:2]
    tokens = torch.full((r, n), POISON, dtype=torch.int64, device="cuda")
    embed = torch.full((r, sample.constants.rank), float("nan"), dtype=BF16, device="cuda")
    run_probabilistic_loop(sample, base, prev, w2, tokens, embed, *requests, cache)
    torch.cuda.synchronize()
    return tokens


LOOPS = [  # (R, N, vocab, target vocab, cap, anchors, rank, NaN planted)
    (1, 4, 32768, 202048, 30.0, torch.int32, 256, False),
    (2, 8, 384, 512, None, torch.int64, 64, True),
    (5, 4, 32000, 202752, 30.0, torch.int64, 256, True),
    (16, 3, 2048, 4096, 30.0, torch.int32, 128, False),
    (32, 2, 32000, 32768, None, torch.int64, 256, False),
    (3, 1, 32768, 202048, None, torch.int32, 256, True),
]


@pytest.mark.parametrize("r,n,vocab,vt,cap,anchors,rank,nan", LOOPS)
def test_loop_matches_the_stock_gemm_loop_and_spec(seed, r, n, vocab, vt, cap, anchors, rank, nan):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    reqs = 2 * r + 1
    fused, sample, w1, w2, m = make_steps(gen, vocab, vt, cap, rank, (r,))
    base = planted_base(gen, r, n, vocab, vocab + 64)
    if not nan:
        base = torch.where(torch.isnan(base), torch.full_like(base, 1.0), base)
    prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
    prev[: min(r, 3)] = torch.tensor([1, 2, 0], device="cuda")[: min(r, 3)]  # the planted w1 rows first
    requests = sample_requests(gen, r, n, reqs)
    cache = torch.full((reqs, n, vt), 7.0, dtype=BF16, device="cuda")
    want_cache = cache.clone()
    want = stock_gemm_loop(sample, base, prev.long(), w2, requests, want_cache)
    tokens = run_fused(fused, base, prev.to(anchors), requests, cache)
    assert torch.equal(tokens, want), (tokens, want)
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))
    if not nan:
        spec_cache = torch.full_like(cache, 7.0)
        assert torch.equal(want, spec_probabilistic_loop(base, prev.long(), w1, w2, cap, m, *requests, spec_cache, vt))
        assert torch.equal(spec_cache.view(torch.int16), want_cache.view(torch.int16))


def test_temperatures_past_vllms_range(seed):
    """Subnormal, huge, infinite and negative-zero temperatures: the unmapped
    columns' one key (module docstring) against the step that keys every
    column."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r, n, vocab, vt = 6, 3, 2048, 4096
    fused, sample, w1, w2, m = make_steps(gen, vocab, vt, 30.0, 128, (r,))
    base = planted_base(gen, r, n, vocab, vocab)
    prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
    requests = idx_map, temperature, seeds, sample_pos = sample_requests(gen, r, n, 2 * r + 1)
    specials = torch.tensor([1e-40, 3e38, float("inf"), -0.0, 1e-3, 0.5], device="cuda")
    temperature[idx_map[:, 0].clamp(min=0)] = specials
    cache = torch.full((2 * r + 1, n, vt), 7.0, dtype=BF16, device="cuda")
    want_cache = cache.clone()
    want = stock_gemm_loop(sample, base, prev, w2, requests, want_cache)
    tokens = run_fused(fused, base, prev, requests, cache)
    assert torch.equal(tokens, want), (tokens, want)
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))


def test_loop_matches_vllms_gumbel_binary(seed):
    """vLLM's own loop in its torch ops with its Triton ``gumbel_sample``
    binary (``test_gpu_markov_stock``), where staged."""
    from test_gpu_markov_stock import planted_base as stock_base
    from test_gpu_markov_stock import stock_gumbel_or_skip, stock_probabilistic_loop

    ops = stock_gumbel_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r, n, vocab, vt = 7, 4, 32000, 202752
    fused, _, w1, w2, m = make_steps(gen, vocab, vt, 30.0, 256, (r,))
    base, tie = stock_base(gen, r, n, vocab)
    prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
    requests = idx_map, temperature, seeds, sample_pos = sample_requests(gen, r, n, 2 * r + 1)
    tie_req = int(idx_map[tie // n, 0])
    if tie_req >= 0:
        temperature[tie_req] = 0.0  # plain argmax: the planted ties decide it (first index)
    cols = torch.arange(n, dtype=torch.int32, device="cuda")
    cache = torch.full((2 * r + 1, n, vt), 7.0, dtype=BF16, device="cuda")
    want_cache = cache.clone()
    buf = torch.full((2 * r + 1, vt), float("-inf"), dtype=BF16, device="cuda")
    want = stock_probabilistic_loop(ops, base, prev, w1, w2, 30.0, m, *requests, want_cache, cols, buf)
    tokens = run_fused(fused, base, prev, requests, cache)
    assert torch.equal(tokens, want), (tokens, want)
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))


def test_loop_cuda_graph(seed):
    from dspark_cute.cutedsl.markov.bias_sample import run_fused_probabilistic_loop

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r, n, vocab, vt = 4, 4, 32768, 202048
    fused, sample, w1, w2, m = make_steps(gen, vocab, vt, 30.0, 256, (r,))
    base = planted_base(gen, r, n, vocab, vocab)
    prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
    requests = sample_requests(gen, r, n, 2 * r + 1)
    cache = torch.full((2 * r + 1, n, vt), 7.0, dtype=BF16, device="cuda")
    tokens = torch.full((r, n), POISON, dtype=torch.int64, device="cuda")
    graph = capture_calls(lambda: run_fused_probabilistic_loop(fused, base, prev, tokens, *requests, cache), calls=1)
    for _ in range(2):
        base.copy_(planted_base(gen, r, n, vocab, vocab))
        prev.copy_(torch.randint(0, vt, (r,), generator=gen, device="cuda"))
        requests[3].copy_(torch.randint(1, 10**6, (r, n), generator=gen, device="cuda"))
        tokens.fill_(POISON)
        cache.fill_(7.0)
        want_cache = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = stock_gemm_loop(sample, base, prev, w2, requests, want_cache)
        assert torch.equal(tokens, want)
        assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))
        assert not fused.keys.any() and not fused.counters.any()
