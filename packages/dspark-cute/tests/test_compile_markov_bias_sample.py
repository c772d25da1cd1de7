"""CPU tests of the probabilistic Markov step with its bias GEMM
(``dspark_cute.cutedsl.markov.bias_sample``): it compiles for sm_90a and
sm_100a without a GPU, with an audit of its PTX against its stated
arithmetic and movement; the reasoning that lets one key a row stand for
every unmapped column, checked on the spec; the host side's refusals and
binding.

The audit, per variant (vocabulary, target vocabulary, rank, soft cap, token
tiles), ``v = 8 n_tiles`` values a thread: ``rank / 16 x 2 x n_tiles``
``mma.sync.m16n8k16``; ``v + 1`` ``div.full`` (each value's, the unmapped
key's) and as many noises (two libdevice ``logf`` of 12 ``fma.rn.ftz``
each); per value the bias's ``cvt.rn``, per pair the logit's and ``x``'s,
and one ``cvt.rn`` a cache store of ``x``; ``v`` stores of ``x`` and 8 of
``-inf`` a fill pass (the row loop not unrolled); with a cap one ``tanhf`` a
value; no other approximate instruction; before ``griddepcontrol.wait`` the
warp's ``w2`` copies, the d2t entries and one set of base-logit loads, the
fill and the embedding copies after it; one ``red.max.u64``, one counter
``atom``, one ``atom.exch``; no local memory, no spill (ptxas where
installed)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from ptx_audit import code, count, ptxas_report, skip_audit_off_pin, spill_bytes

from dspark_core.contracts.markov import markov_constants, markov_sample_constants
from dspark_core.errors import Unsupported
from dspark_core.spec import gumbel

ARCHS = ["sm_90a", "sm_100a"]
# (vocab, target vocab, rank, cap, n_tiles)
VARIANTS = [(32768, 202048, 256, 30.0, 1), (32000, 202752, 256, None, 4), (384, 512, 64, 30.0, 2),
            (2048, 4096, 128, None, 1)]
CP_ASYNC = r"cp\.async\.cg\.shared\.global"


def _ptx(c, n_tiles, arch):
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    return compile_ptx(MarkovBiasSampleKernel(c, n_tiles, True, True), *fake_args(), arch=arch)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("vocab,target,rank,cap,n_tiles", VARIANTS)
def test_compiles_in_its_stated_order(arch, vocab, target, rank, cap, n_tiles, tmp_path):
    from dspark_cute.cutedsl.markov.bias_sample import FILL_COLUMNS, MarkovBiasSampleKernel

    c = markov_sample_constants(vocab, target, rank, 0.0625, cap)
    ptx = _ptx(c, n_tiles, arch)
    body = code(ptx)
    assert f".target {arch}" in body
    assert not re.search(r"\.local\b", body)
    skip_audit_off_pin("the probabilistic Markov bias step")
    values = 8 * n_tiles
    passes = MarkovBiasSampleKernel(c, n_tiles, True, True).passes
    assert passes == -(-target // (-(-vocab // 256) * FILL_COLUMNS))
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b") == rank // 16 * 2 * n_tiles
    assert count(body, r"div\.full\.f32") == values + 1
    assert count(body, r"fma\.rn\.ftz\.f32") == (values + 1) * 2 * 12
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == values + values // 2 + values // 2 + values
    assert count(body, r"st\.global\.b16") == values + 8 * passes
    tanh = values if cap is not None else 0
    assert count(body, r"ex2\.approx\.ftz\.f32") == tanh and count(body, r"rcp\.approx\.ftz\.f32") == tanh
    assert count(body, r"\.approx") == 2 * tanh
    for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op or op.startswith("div.full"), f"an FP32 operation without an explicit rounding: {op}"
    wait = body.index("griddepcontrol.wait")
    assert count(body[:wait], CP_ASYNC) == rank // 8  # the warp's 32 w2 rows: rank / 8 pieces a lane
    assert count(body[wait:], CP_ASYNC) == -(-8 * n_tiles * rank // 8 // 256)
    assert count(body[:wait], r"ld\.global\.b16") == values and count(body[wait:], r"ld\.global\.b16") == values
    assert count(body[:wait], r"ld\.global\.s64") == 4  # the d2t entries of the thread's 4 draft columns
    assert count(body[:wait], r"st\.global") == 0  # nothing is written before the previous grid's end
    assert count(body, r"red\.relaxed\.gpu\.global\.max\.u64") == 1
    assert count(body, r"atom\.acq_rel\.gpu\.global\.add\.u32") == 1
    assert count(body, r"atom\.relaxed\.gpu\.global\.exch\.b64") == 1
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == spill_bytes(report, "spill loads") == 0, report


@pytest.mark.compile
def test_sixty_four_rows_are_refused_for_their_spills(tmp_path):
    """At 8 token tiles ptxas spills the step's registers: the host class
    takes at most 32 rows, the kernel at most 4 tiles (the greedy bias step
    takes those rows without the noise)."""
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleKernel, MarkovBiasSampleStep

    c = markov_sample_constants(32768, 202048, 256, 0.0625, 30.0)
    with pytest.raises(ValueError, match="token tiles"):
        MarkovBiasSampleKernel(c, 8, True, True)
    w1, w2 = torch.zeros(202048, 256, dtype=torch.bfloat16), torch.zeros(32768, 256, dtype=torch.bfloat16)
    d2t = torch.arange(32768) * 6 - torch.arange(32768)
    with pytest.raises(ValueError, match="1 to 32 rows"):
        MarkovBiasSampleStep(c, w1, d2t, w2, max_rows=64)


def test_noise_is_finite_over_every_uniform():
    """The module docstring's premise: ``gumbel_noise`` is finite for every
    value ``gumbel_uniform`` can take (the smallest hash, the largest, which
    rounds to 1.0, both sides of the series' 0.25 and 2^20 hashes spread
    over the whole range), so ``div.full(-inf, temp) + noise`` is the same
    for every unmapped column of a row."""
    hashes = torch.cat([torch.tensor([0, 1, 0xFFFF, 0x3FFFFFFF, 0x40000000, 0xFFFFFFFE, 0xFFFFFFFF]),
                        torch.linspace(0, 2**32 - 1, 2**20, dtype=torch.float64).to(torch.int64)])
    hi = (hashes >> 16).to(torch.float32) * 2.0**-16
    lo = ((hashes & 0xFFFF).to(torch.float32) + 0.5) * 2.0**-32
    u = hi + lo
    assert float(u.min()) == 2.0**-33 and float(u.max()) == 1.0
    noise = gumbel.gumbel_noise(u)
    assert torch.isfinite(noise).all()


@pytest.mark.parametrize("temp", [0.0, -0.0, 0.7, 1e-40, 3e38, -2.0, float("inf")])
def test_one_key_stands_for_the_unmapped_columns(seed, temp):
    """The step's argmax over the target columns equals the argmax over the
    mapped columns and the first unmapped one alone (the spec's sampler,
    IEEE division standing in for ``div.full`` on the CPU): the kernel's
    decomposition, for temperatures zero, positive, subnormal, huge,
    negative and infinite (where ``-inf / temp`` is NaN: compared as keys,
    the first NaN)."""
    from test_compile_markov import _keys

    gen = torch.Generator().manual_seed(seed)
    vocab, target = 64, 512
    d2t = torch.randperm(target, generator=gen)[:vocab].sort().values - torch.arange(vocab)
    scatter = torch.arange(vocab) + d2t
    logits = (torch.randn(3, vocab, generator=gen) * 4).to(torch.bfloat16)
    logits[1, 5] = float("-inf")
    row = torch.full((3, target), float("-inf"), dtype=torch.bfloat16)
    row.index_copy_(1, scatter, logits)
    seed_words = torch.randint(-(2**62), 2**62, (3,), generator=gen)
    pos = torch.randint(1, 10**6, (3,), generator=gen) + gumbel.DRAFT_NOISE_SALT
    cols = torch.arange(target)
    u = gumbel.uniform32(seed_words[:, None], pos[:, None], cols[None, :])
    x = row.float()
    z = torch.where(torch.tensor(temp) != 0, x / torch.tensor(temp, dtype=torch.float32) + gumbel.gumbel_noise(u), x)
    keys = _keys(z.numpy())
    whole = keys.max(-1)
    unmapped = np.ones(target, dtype=bool)
    unmapped[scatter.numpy()] = False
    spare = int(np.flatnonzero(unmapped)[0])
    parts = np.maximum(keys[:, scatter.numpy()].max(-1), keys[:, spare])
    assert np.array_equal(whole, parts)
    if not torch.isnan(z).any():
        assert np.array_equal(0xFFFFFFFF - (whole & 0xFFFFFFFF), gumbel.block_argmax(z).numpy())


def _head(vocab=384, target=512, rank=64):
    gen = torch.Generator().manual_seed(3)
    w1 = torch.zeros(target, rank, dtype=torch.bfloat16)
    w2 = torch.zeros(vocab, rank, dtype=torch.bfloat16)
    d2t = torch.randperm(target, generator=gen)[:vocab].sort().values - torch.arange(vocab)
    return markov_sample_constants(vocab, target, rank, 0.5, None), w1, d2t, w2


def _bias_step(c, w1, d2t, w2, rows):
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep

    step = MarkovBiasStep(markov_constants(c.vocab, c.rank, 0.5, None, True), w1, d2t, w2, max_rows=8)
    step.rows = {m: None for m in rows}
    step.reasons = {m: f"refused {m}" for m in range(1, 9) if m not in rows}
    return step


def test_host_refusals_and_binding(monkeypatch):
    from dspark_cute.cutedsl.markov import bias_sample
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleStep

    c, w1, d2t, w2 = _head()
    with pytest.raises(Unsupported, match="rank that is a multiple of 64"):
        MarkovBiasSampleStep(markov_sample_constants(384, 512, 32, 0.5, None), w1[:, :32], d2t, w2[:, :32])
    with pytest.raises(ValueError, match="w2 must be"):
        MarkovBiasSampleStep(c, w1, d2t, w2[:100])
    with pytest.raises(ValueError, match="w1 must be"):
        MarkovBiasSampleStep(c, w1[:300], d2t, w2)
    with pytest.raises(ValueError, match="distinct target ids"):
        MarkovBiasSampleStep(c, w1, torch.zeros(384, dtype=torch.int64) - torch.arange(384) + 7, w2)
    with pytest.raises(ValueError, match="MarkovSampleConstants"):
        MarkovBiasSampleStep(markov_constants(384, 64, 0.5, None, True), w1, d2t, w2)
    monkeypatch.setattr(bias_sample, "compile_bias_sample", lambda *args: None)
    step = MarkovBiasSampleStep(c, w1, d2t, w2, max_rows=4)
    unmapped = torch.ones(512, dtype=torch.bool)
    unmapped[torch.arange(384) + d2t] = False
    assert step.spare == int(unmapped.nonzero()[0, 0])
    assert not step.rows and "not bound" in step.reasons[1]
    with pytest.raises(ValueError, match="differs [(]its w2 is another tensor[)]"):
        step.bind(_bias_step(c, w1, d2t, w2.clone(), (1, 2)))  # another w2: another GEMM
    with pytest.raises(ValueError, match="binds to a MarkovBiasStep, not"):
        step.bind(object())
    step.bind(_bias_step(c, w1, d2t, w2, (1, 2, 6)))
    assert set(step.rows) == {1, 2} and step.reasons[3] == "refused 3" and 6 not in step.reasons


def test_problem_names_bad_operands(monkeypatch):
    from dspark_cute.cutedsl.markov import bias_sample
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleStep

    monkeypatch.setattr(bias_sample, "compile_bias_sample", lambda *args: None)
    c, w1, d2t, w2 = _head()
    step = MarkovBiasSampleStep(c, w1, d2t, w2, max_rows=4)
    step.bind(_bias_step(c, w1, d2t, w2, (1, 2)))
    base = torch.zeros(2, 384, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int64)
    temperature, seeds = torch.ones(5), torch.zeros(5, dtype=torch.int64)
    cache = torch.zeros(5, 4, 512, dtype=torch.bfloat16)
    ok = (base, ids, ids.clone(), ids.clone(), temperature, seeds, ids.clone(), cache, 1)
    assert "CUDA" in step.problem(*ok)  # a CPU head: refused before any launch
    assert "int32 or int64" in step.problem(base, ids.float(), *ok[2:])
    assert "tokens must be int64" in step.problem(base, ids, ids.int(), *ok[3:])
    assert "idx_map must be int64" in step.problem(*ok[:3], ids[:1], *ok[4:])
    assert "temperature must be" in step.problem(*ok[:4], temperature.double(), *ok[5:])
    assert "logits cache" in step.problem(*ok[:7], cache[..., :500], 1)
    assert "col must be a step" in step.problem(*ok[:8], 4)
    assert "col must be a step" in step.problem(*ok[:8], True)
    assert "first must be a bool" in step.problem(*ok, first=1)
    with pytest.raises(ValueError):
        step.run(*ok)
    monkeypatch.setattr(bias_sample, "check_cuda", lambda device: None)  # past the device checks: the bound rows
    assert step.problem(*ok) is None
    ids3 = torch.zeros(3, dtype=torch.int64)
    assert step.problem(torch.zeros(3, 384, dtype=torch.bfloat16), ids3, ids3.clone(), ids3.clone(), temperature,
                        seeds, ids3.clone(), cache, 1) == "refused 3"


def test_op_schema():
    from dspark_cute.cutedsl.markov import bias_sample  # noqa: F401 (defines the op)
    from dspark_cute.runtime import ops

    schema = str(ops.op("markov_bias_sample").default._schema)
    assert "Tensor(a!) tokens" in schema and "Tensor(b!) cache" in schema and "bool first" in schema
