"""GPU tests of the fused greedy Markov step (``dspark_cute.cutedsl.markov``):
its tokens and gathered embeddings bit for bit against the spec
(``dspark_core.spec.markov``, run on the same CUDA device, where its
``tanhf`` runs the GPU's own ``ex2.approx.ftz`` and ``rcp.approx.ftz``) and
against vLLM 0.33.0's greedy loop in its own torch ops on CUDA
(``stock_loop``: ``DSparkSpeculator._sample_sequential`` with
``markov_embed``, ``markov_bias``'s ``F.linear``, the add,
``apply_output_logit_transform``'s ``float() * M`` and ``C * tanh(x / C)``,
``argmax`` and ``map_draft_to_target``; vLLM itself is not installed on the
device machine).

- one step on crafted rows (ties in different CTAs, -0.0 against +0.0, NaN
  early and late, all -inf, +inf ties, soft-cap saturation ties) against
  the spec and the stock ops, tokens and the gathered rows poisoned first;
- whole loops for R in {1, 2, 7, 64, 133, 512}, N 1 to 8, draft
  vocabularies of 384, 32000 and 202048 (with a padded Markov head),
  soft cap 30 or none, with and without d2t, planted NaN, -inf rows and
  saturation ties in the base logits;
- the probabilistic step (``MarkovSampleStep``) over whole loops against the
  spec's (``spec.gumbel.probabilistic_step``, its ``div.full`` the GPU's):
  tokens and the whole logits cache bit for bit, rows at temperature 0,
  invalid rows (``idx_map`` -1: nothing cached), -inf rows and saturation
  ties planted (no NaN: vLLM's Triton argmax then depends on its reduction
  tree, the stated exception), target vocabularies of 512, 32768 and 202752;
- the op path (``torch.ops.dspark.markov_step``) gives the direct launch's
  tokens; a CUDA graph of the loop replayed on new data gives the eager
  tokens and leaves the key and counter words at 0; a compile during
  capture raises RuntimeError (last in the file).

Fresh seeded random data: the seed is printed (repeat with DSPARK_SEED).
Run: ``python -m pytest -q packages/dspark-cute/tests/test_gpu_markov.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cute_testing import capture_calls, requires_cuda

from dspark_core.contracts.markov import MARKOV_TILE, markov_constants, markov_sample_constants
from dspark_core.spec import gumbel
from dspark_core.spec import markov as spec

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
MULT = 0.0625  # the metap multiplier of a width-16x draft (mup)
POISON = -7777


def stock_loop(base, prev, w1, w2, mult, cap, d2t):
    """vLLM 0.33.0's greedy Markov loop, op for op as it runs on CUDA (module docstring)."""
    r, n, v = base.shape
    out = torch.empty(r, n, dtype=torch.int64, device=base.device)
    for i in range(n):
        e = F.embedding(prev, w1)
        logits = base[:, i] + F.linear(e, w2)[..., :v]
        logits = logits.float() * mult
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        d = logits.argmax(dim=-1)
        t = d if d2t is None else d + d2t[d]
        out[:, i] = t
        prev = t
    return out


def stock_step(base, bias, mult, cap, d2t):
    logits = (base + bias).float() * mult
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    d = logits.argmax(dim=-1)
    return d if d2t is None else d + d2t[d]


def make_head(gen, v_target, vocab, vpad, rank, d2t: bool):
    w1 = (torch.randn(v_target, rank, generator=gen, device="cuda") * 0.5).to(BF16)
    w2 = (torch.randn(vpad, rank, generator=gen, device="cuda") * 0.5).to(BF16)
    m = None
    if d2t:
        ids = torch.randperm(v_target, generator=gen, device="cuda")[:vocab].sort().values
        m = ids - torch.arange(vocab, device="cuda")
    return w1, w2, m


def sample_requests(gen, r: int, n: int, reqs: int) -> tuple:
    """vLLM's per-request buffers of a probabilistic loop over ``r`` rows of
    ``n`` steps and ``reqs`` requests: ``(idx_map, temperature, seeds,
    sample_pos)``: int64 ``idx_map [r, n]`` (one request a row, one row
    inert (-1) where there are several), FP32 temperatures (a third greedy,
    0.0), int64 seeds and positions."""
    idx_map = torch.randperm(reqs, generator=gen, device="cuda")[:r, None].expand(r, n).contiguous()
    if r > 1:
        idx_map[r // 2] = -1
    temperature = torch.rand(reqs, generator=gen, device="cuda") + 0.2
    temperature[: reqs // 3] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (reqs,), generator=gen, device="cuda")
    sample_pos = torch.randint(1, 10**6, (r, n), generator=gen, device="cuda")
    return idx_map, temperature, seeds, sample_pos


def make_sample_step(gen, vocab, vt, cap, rank=256) -> tuple:
    """``(step, w1, w2, d2t)``: a prepared ``MarkovSampleStep`` over a random
    head of ``vt`` targets with a d2t map (``make_head``'s draws)."""
    from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

    w1, w2, m = make_head(gen, vt, vocab, vocab, rank, True)
    step = MarkovSampleStep(markov_sample_constants(vocab, vt, rank, MULT, cap), w1, m, max_rows=512)
    step.prepare()
    return step, w1, w2, m


def check_sampled_loop(step, base, prev, w2, requests: tuple, cache, want, want_cache) -> None:
    """The probabilistic loop of ``step`` over ``base [r, n, V]`` with vLLM's
    ``requests`` (``sample_requests``) into poisoned tokens, a NaN embedding
    and ``cache``: the tokens ``want``, the cache ``want_cache`` (bits), the
    fold's words reset."""
    from dspark_cute.cutedsl.markov.loop import run_probabilistic_loop

    r, n = base.shape[:2]
    tokens = torch.full((r, n), POISON, dtype=torch.int64, device="cuda")
    embed = torch.full((r, step.constants.rank), float("nan"), dtype=BF16, device="cuda")
    run_probabilistic_loop(step, base, prev, w2, tokens, embed, *requests, cache)
    torch.cuda.synchronize()
    assert torch.equal(tokens, want)
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))
    assert not step.keys.any() and not step.counters.any()


def make_step(vocab, rank, cap, w1, d2t, max_rows=512):
    from dspark_cute.cutedsl.markov.greedy import MarkovStep

    step = MarkovStep(markov_constants(vocab, rank, MULT, cap, d2t is not None), w1, d2t, max_rows)
    step.prepare()
    return step


def planted_base(gen, r, n, vocab, stride, scale=8.0):
    """BF16 ``[r, n, vocab]`` views of a ``[r * n, stride]`` buffer (compute_draft_logits' layout), with
    special rows planted: NaN, all -inf, half -inf, huge values (soft-cap saturation ties) in several CTAs."""
    buf = (torch.randn(r * n, stride, generator=gen, device="cuda") * scale).to(BF16)
    rows = buf[:, :vocab]
    cols = torch.randint(0, vocab, (4,), generator=gen, device="cuda")
    picks = [k * (r * n) // 6 for k in range(6)] if r * n >= 6 else list(range(r * n))
    for kind, k in enumerate(picks):
        if kind == 0:
            rows[k, cols[:2]] = float("nan")
        elif kind == 1:
            rows[k] = float("-inf")
        elif kind == 2:
            rows[k, ::2] = float("-inf")
        elif kind == 3:
            rows[k, cols] = 3e4
        elif kind == 4:
            rows[k, -1] = float("nan")
    return buf.view(r, n, stride)[..., :vocab]


# ---------------------------------------------------------------- one step, crafted rows


def crafted_rows(vocab: int) -> tuple:
    """(base, bias) BF16 ``[8, vocab]`` whose sums hold: ties across CTAs, -0.0 before +0.0 as the maximum,
    NaN late and early, all -inf, +inf ties, -inf mixed, saturating values."""
    base = torch.randn(8, vocab, device="cuda").to(BF16) - 2
    bias = torch.full((8, vocab), -0.0, device="cuda", dtype=BF16)
    far = [c for c in (5, MARKOV_TILE + 1, 2 * MARKOV_TILE + 3, vocab - 1) if c < vocab]
    base[0, far] = 9.0
    base[1] = -(base[1].abs()) - 1
    base[1, far[-1]] = 0.0
    base[1, far[0]] = -0.0  # -0.0 + -0.0 = -0.0 first, +0.0 + -0.0 = +0.0 later: a tie, the first wins
    base[2, far[-1]] = float("nan")
    base[3] = float("-inf")
    base[4, far] = float("inf")
    base[5, ::3] = float("-inf")
    base[6, far] = 3e4  # tanh saturates: C * 1 everywhere there
    base[7, 0] = float("nan")
    return base, bias


@pytest.mark.parametrize("vocab", [384, 2 * MARKOV_TILE + 8, 32000])
@pytest.mark.parametrize("cap", [None, 30.0])
@pytest.mark.parametrize("d2t", [True, False])
@pytest.mark.parametrize("gather", [True, False])
def test_step_crafted_rows(seed, vocab, cap, d2t, gather):
    torch.manual_seed(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, _, m = make_head(gen, vocab + 100, vocab, vocab, 256, d2t)
    step = make_step(vocab, 256, cap, w1, m)
    base, bias = crafted_rows(vocab)
    tokens = torch.full((8, 3), POISON, dtype=torch.int64, device="cuda")
    embed = torch.full((8, 256), float("nan"), dtype=BF16, device="cuda")
    before = embed.clone()
    step.run(base, bias, tokens[:, 1], embed, gather)
    torch.cuda.synchronize()
    want = spec.greedy_step(base, bias, MULT, cap, m)
    assert torch.equal(tokens[:, 1], want), (tokens[:, 1], want)
    assert torch.equal(want, stock_step(base, bias, MULT, cap, m))
    assert (tokens[:, 0] == POISON).all() and (tokens[:, 2] == POISON).all()
    if gather:
        assert torch.equal(embed.view(torch.int16), w1[want].view(torch.int16))
    else:
        assert torch.equal(embed.view(torch.int16), before.view(torch.int16))
    assert not step.keys.any() and not step.counters.any()


# ---------------------------------------------------------------- whole loops


LOOPS = [  # (R, N, vocab, vpad, cap, d2t)
    (1, 4, 32000, 32000, 30.0, True),
    (2, 1, 384, 384, None, True),
    (7, 8, 384, 448, 30.0, False),
    (64, 4, 32000, 32064, None, True),
    (133, 4, 32000, 32000, 30.0, True),
    (512, 4, 32000, 32000, 30.0, True),
    (1, 4, 202048, 202048, 30.0, True),
    (16, 3, 202048, 202112, None, False),
]


@pytest.mark.parametrize("r,n,vocab,vpad,cap,d2t", LOOPS)
def test_loop_matches_spec_and_stock(seed, r, n, vocab, vpad, cap, d2t):
    from dspark_cute.cutedsl.markov.loop import check_loop_operands, run_greedy_loop

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rank = 256
    w1, w2, m = make_head(gen, vocab + 1000, vocab, vpad, rank, d2t)
    step = make_step(vocab, rank, cap, w1, m)
    base = planted_base(gen, r, n, vocab, vpad)
    prev = torch.randint(0, vocab + 1000, (r,), generator=gen, device="cuda")
    tokens = torch.full((512, n), POISON, dtype=torch.int64, device="cuda")[:r]
    embed = torch.full((512, rank), float("nan"), dtype=BF16, device="cuda")
    check_loop_operands(step, base, prev, w2, tokens, embed)
    run_greedy_loop(step, base, prev, w2, tokens, embed)
    torch.cuda.synchronize()
    want = stock_loop(base, prev, w1, w2, MULT, cap, m)
    assert torch.equal(tokens, want)
    assert torch.equal(want, spec.greedy_loop(base, prev, w1, w2, MULT, cap, m))
    assert not step.keys.any() and not step.counters.any()


def spec_probabilistic_loop(base, prev, w1, w2, cap, d2t, idx_map, temperature, seeds, sample_pos, cache, vt):
    """The spec's probabilistic loop: ``_sample_sequential`` with ``draft_logits`` set (module docstring)."""
    r, n, v = base.shape
    out = torch.empty(r, n, dtype=torch.int64, device=base.device)
    buf = torch.full((r, vt), float("-inf"), dtype=BF16, device=base.device)
    scatter = torch.arange(v, device=base.device) + d2t
    for i in range(n):
        y = spec.markov_logits(base[:, i], F.linear(F.embedding(prev, w1), w2)[:, :v], MULT, cap)
        out[:, i] = gumbel.probabilistic_step(y, scatter, buf, idx_map[:, i], temperature, seeds, sample_pos[:, i],
                                              cache, i)
        prev = out[:, i]
    return out


SAMPLES = [(1, 4, 384, 512, 30.0), (7, 4, 32000, 202752, 30.0), (64, 3, 32000, 32768, None), (3, 8, 2048, 4096, 30.0)]


@pytest.mark.parametrize("r,n,vocab,vt,cap", SAMPLES)
def test_probabilistic_loop_matches_spec(seed, r, n, vocab, vt, cap):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    reqs = 2 * r + 1
    step, w1, w2, m = make_sample_step(gen, vocab, vt, cap)
    base = planted_base(gen, r, n, vocab, vocab)
    base = torch.where(torch.isnan(base), torch.full_like(base, 1.0), base)  # (NaN: the stated exception)
    prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
    requests = sample_requests(gen, r, n, reqs)
    cache = torch.full((reqs, n, vt), 7.0, dtype=BF16, device="cuda")
    want_cache = cache.clone()
    want = spec_probabilistic_loop(base, prev, w1, w2, cap, m, *requests, want_cache, vt)
    check_sampled_loop(step, base, prev, w2, requests, cache, want, want_cache)


def test_op_path_gives_the_direct_tokens(seed):
    from dspark_cute.runtime import ops

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, _, m = make_head(gen, 4000, 3000, 3000, 64, True)
    step = make_step(3000, 64, 30.0, w1, m)
    base = (torch.randn(5, 3000, generator=gen, device="cuda") * 8).to(BF16)
    bias = (torch.randn(5, 3000, generator=gen, device="cuda")).to(BF16)
    a = torch.full((5,), POISON, dtype=torch.int64, device="cuda")
    b = a.clone()
    ea = torch.zeros(5, 64, dtype=BF16, device="cuda")
    eb = ea.clone()
    step.run(base, bias, a, ea, True)
    ops.op("markov_step")(step.op_handle, base, bias, b, eb, True)
    torch.cuda.synchronize()
    assert torch.equal(a, b) and torch.equal(ea.view(torch.int16), eb.view(torch.int16))


def test_loop_cuda_graph(seed):
    from dspark_cute.cutedsl.markov.loop import run_greedy_loop

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r, n, vocab, rank = 9, 4, 32000, 256
    w1, w2, m = make_head(gen, vocab + 10, vocab, vocab, rank, True)
    step = make_step(vocab, rank, 30.0, w1, m)
    base = planted_base(gen, r, n, vocab, vocab)
    prev = torch.randint(0, vocab + 10, (r,), generator=gen, device="cuda")
    tokens = torch.full((r, n), POISON, dtype=torch.int64, device="cuda")
    embed = torch.zeros(r, rank, dtype=BF16, device="cuda")
    check_graph_replays(gen, lambda: run_greedy_loop(step, base, prev, w2, tokens, embed), step, base, prev, tokens,
                        (w1, w2, m))


def check_graph_replays(gen, loop, step, base, prev, tokens, head) -> None:
    """``loop`` captured once, then replayed twice on fresh planted base
    logits and anchors (written into ``base`` and ``prev``): each time the
    tokens are vLLM's loop's (soft cap 30) and the fold's words are left 0."""
    w1, w2, m = head
    r, n, vocab = base.shape
    graph = capture_calls(loop, calls=1)
    for _ in range(2):
        base.copy_(planted_base(gen, r, n, vocab, base.stride(1)))
        prev.copy_(torch.randint(0, w1.shape[0], (r,), generator=gen, device="cuda"))
        tokens.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tokens, stock_loop(base, prev, w1, w2, MULT, 30.0, m))
        assert not step.keys.any() and not step.counters.any()


def test_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.markov.greedy import MarkovStep

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1, _, _ = make_head(gen, 100, 40, 40, 24, False)
    step = MarkovStep(markov_constants(40, 24, 0.5, 7.0, False), w1, None)  # constants no other test compiles
    base = torch.zeros(2, 40, dtype=BF16, device="cuda")
    tokens = torch.zeros(2, dtype=torch.int64, device="cuda")
    embed = torch.zeros(2, 24, dtype=BF16, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            step.run(base, base, tokens, embed, True)
