"""CPU tests of the fused greedy Markov step (``dspark_cute.cutedsl.markov``):
it compiles for sm_90a and sm_100a without a GPU, an audit of its PTX, its
``tanhf`` against nvcc's, its argmax keys' order against the spec's argmax
rule (emulated bit for bit here), and the host side's refusals.

Compiled (each for both archs): the vocabularies 8 (one vector), 384, 2056
(a second CTA of one vector), 32000, 202048 and 262144; ranks 8, 32, 256 and
2048; soft cap 30 or none; with and without a d2t map.

The audit: with a cap, 8 ``ex2.approx.ftz`` and 8 ``rcp.approx.ftz`` (one
``tanhf`` a column) and no other approximate or flushed instruction, 6
``fma.rn`` a column (tanhf's), none without a cap; every other FP32
add/mul with an explicit rounding (ptxas contracts nothing); 4
``cvt.rn.bf16x2`` (the add's BF16 rounding); one ``red.max.u64``, one
counter ``atom.acq_rel.add``, one ``atom.exch``; the d2t load only with a
d2t; the CTA count of the last-CTA test; no local memory; ptxas accepts it
without spills."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from ptx_audit import code, count, nvcc_ptx, ptxas_report, skip_audit_off_pin, spill_bytes

from dspark_core.contracts.markov import MARKOV_TILE, markov_constants
from dspark_core.errors import Unsupported
from dspark_core.spec import markov as spec

ARCHS = ["sm_90a", "sm_100a"]
# (vocab, rank, cap, d2t)
VARIANTS = [(8, 8, 30.0, True), (384, 32, 30.0, True), (2056, 256, None, False), (32000, 256, 30.0, True),
            (202048, 256, 30.0, True), (262144, 2048, None, True), (32000, 256, None, False)]


def _compile(c, arch):
    from dspark_cute.cutedsl.markov.greedy import MarkovGreedyKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    ptx = compile_ptx(MarkovGreedyKernel(c), *fake_args(c), arch=arch)
    return ptx, code(ptx)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("vocab,rank,cap,d2t", VARIANTS)
def test_markov_step_compiles(arch, vocab, rank, cap, d2t, tmp_path):
    c = markov_constants(vocab, rank, 0.0625, cap, d2t)
    ptx, body = _compile(c, arch)
    assert f".target {arch}" in body
    skip_audit_off_pin("markov_step")
    tanh = 8 if cap is not None else 0
    assert count(body, r"ex2\.approx\.ftz\.f32") == tanh
    assert count(body, r"rcp\.approx\.ftz\.f32") == tanh
    assert count(body, r"\.approx") == 2 * tanh and count(body, r"\.ftz") == 2 * tanh
    assert count(body, r"\bfma\.rn\.f32") == 6 * tanh and count(body, r"\bfma\.") == 6 * tanh
    for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op, f"an FP32 operation without an explicit rounding: {op}"
    assert count(body, r"cvt\.rn\.bf16x2\.f32") == 4
    assert count(body, r"red\.relaxed\.gpu\.global\.max\.u64") == 1
    assert count(body, r"atom\.acq_rel\.gpu\.global\.add\.u32") == 1
    assert count(body, r"atom\.relaxed\.gpu\.global\.exch\.b64") == 1
    assert count(body, r"fence\.acq_rel\.gpu") == 1
    assert count(body, r"ld\.global\.s64") == (1 if d2t else 0)
    assert not re.search(r"\b(ld|st)\.local", body), "local memory"
    assert "griddepcontrol" not in body
    # The last CTA is the one that counts ctas - 1.
    assert re.search(rf"setp\.ne\.(?:b32|s32|u32)\s+%p\d+, %r\d+, {c.ctas - 1};", body)
    # Two 16-byte loads of logits, one of the w1 row, one 16-byte store of it.
    assert count(body, r"ld\.global\.v4\.b32") == 3 and count(body, r"st\.global\.v4\.b32") == 1
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == spill_bytes(report, "spill loads") == 0, report


def _canonical(lines: list[str]) -> list[tuple]:
    """Instructions with registers renamed by definition order and constant movs folded into their uses; plain
    add/mul read as their .rn forms."""
    env: dict[str, str] = {}
    out = []
    for line in lines:
        m = re.match(r"\s*([\w.]+)\s+(.*)", line)
        if not m:
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if op in ("mov.f32", "mov.b32") and re.fullmatch(r"0[fF][0-9A-Fa-f]{8}", args[1]):
            env[args[0]] = args[1].upper().replace("0F", "0f")
            continue
        op = {"add.f32": "add.rn.f32", "mul.f32": "mul.rn.f32"}.get(op, op)
        srcs = [env.get(a, a.upper().replace("0F", "0f") if a.lower().startswith("0f") else a) for a in args[1:]]
        env[args[0]] = f"v{len(out)}"
        out.append((op, *srcs))
    return out


@pytest.mark.compile
def test_tanhf_is_nvcc_tanhf(tmp_path):
    """``ptx.tanhf``'s instructions are nvcc's ``tanhf`` (CUDA's, no fast math: what ``torch.tanh`` runs),
    instruction for instruction; skipped without nvcc."""
    from dspark_cute.ptx.markov import _TANHF

    ptx = nvcc_ptx("o[threadIdx.x] = tanhf(i[threadIdx.x]);", tmp_path)
    if ptx is None:
        pytest.skip("no nvcc")
    text = code(ptx)
    body = text[text.index("ld.global.f32"):text.index("st.global.f32")]
    x = re.search(r"ld\.global\.f32\s+(%f\d+)", text).group(1)
    # The FP32 dataflow only (the store's address arithmetic after the result is not tanhf's).
    lines = [s.replace(x, "$1") for s in body.split(";")[1:] if not re.search(r"\.[su]64\b|\.b64\b|cvta", s)]
    theirs = _canonical(lines)
    mine_lines = [s for s in _TANHF.strip("{} ").split(";") if s.strip() and not s.strip().startswith(".reg")]
    mine = _canonical(mine_lines)
    assert len(theirs) == 17 and theirs == mine


def _keys(y: np.ndarray) -> np.ndarray:
    """``ptx.argmax_key`` emulated on the host (its PTX, word for word)."""
    b = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = np.where(b == 0x80000000, 0, b)
    m = np.where(b >> 31 == 1, 0xFFFFFFFF, 0x80000000).astype(np.uint64)
    hi = np.where(np.isnan(y), 0xFFFFFFFF, b ^ m).astype(np.uint64)
    lo = (~np.arange(y.shape[-1], dtype=np.uint64)) & 0xFFFFFFFF
    return (hi << 32) | lo


def test_argmax_keys_order_is_the_spec_argmax(rng_rows):
    y = rng_rows
    keys = _keys(y)
    got = 0xFFFFFFFF - (keys.max(-1) & 0xFFFFFFFF)
    assert np.array_equal(got.astype(np.int64), spec.argmax(torch.from_numpy(y)).numpy())
    assert (keys > 0).all()  # the reset value 0 is below every key


@pytest.fixture
def rng_rows(seed):
    """Rows with ties in different CTAs, -0.0 vs +0.0, NaN, all -inf, +inf ties."""
    rng = np.random.default_rng(seed)
    v = 3 * MARKOV_TILE + 8
    y = rng.standard_normal((8, v)).astype(np.float32)
    y[1, [5, MARKOV_TILE + 1, 2 * MARKOV_TILE + 3]] = 9.0
    y[2] = -np.abs(y[2]) - 1
    y[2, [MARKOV_TILE * 2 + 1, 7]] = [0.0, -0.0]
    y[3] = -np.inf
    y[4, [v - 1, MARKOV_TILE]] = np.nan
    y[5, [3, v - 2]] = np.inf
    y[6, :] = -0.0
    y[7, rng.choice(v, v // 2, replace=False)] = -np.inf
    return y


def test_markov_constants_refusals():
    assert markov_constants(32000, 256, 1.0, 30.0, True).ctas == 16
    with pytest.raises(Unsupported, match="bfloat16 head"):
        markov_constants(32000, 256, 1.0, None, True, torch.float32)
    with pytest.raises(Unsupported, match="multiple of 8"):
        markov_constants(32001, 256, 1.0, None, True)
    with pytest.raises(Unsupported, match="Markov rank"):
        markov_constants(32000, 4, 1.0, None, True)
    with pytest.raises(ValueError, match="soft cap"):
        markov_constants(32000, 256, 1.0, -1.0, True)
    with pytest.raises(ValueError, match="multiplier"):
        markov_constants(32000, 256, float("nan"), None, True)
    from dspark_cute.cutedsl.markov.greedy import MarkovStep

    with pytest.raises(Unsupported, match="at most 2048"):
        MarkovStep(markov_constants(32000, 4096, 1.0, None, False), torch.zeros(4, 4096, dtype=torch.bfloat16),
                   None)


def test_markov_step_refuses_bad_operands():
    from dspark_cute.cutedsl.markov.greedy import MarkovStep

    c = markov_constants(64, 16, 1.0, None, True)
    w1 = torch.zeros(100, 16, dtype=torch.bfloat16)
    d2t = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(ValueError, match="w1 must be"):
        MarkovStep(c, w1.float(), d2t)
    with pytest.raises(ValueError, match="d2t must be"):
        MarkovStep(c, w1, d2t[:8])
    with pytest.raises(ValueError, match="no d2t"):
        MarkovStep(markov_constants(64, 16, 1.0, None, False), w1, d2t)
    with pytest.raises(ValueError, match="max_rows"):
        MarkovStep(c, w1, d2t, max_rows=0)
    # A map the next step's gather would follow past (or before) w1's 100 rows: refused at build.
    with pytest.raises(ValueError, match=r"d2t maps draft id 63 to target id 100, outside \[0, 100\)"):
        MarkovStep(c, w1, d2t + 37)
    with pytest.raises(ValueError, match=r"d2t maps draft id 0 to target id -1, outside \[0, 100\)"):
        MarkovStep(c, w1, d2t - 1)
    with pytest.raises(ValueError, match="a draft vocabulary of 64, more than w1's 32 rows"):
        MarkovStep(markov_constants(64, 16, 1.0, None, False), w1[:32], None)
    step = MarkovStep(c, w1, d2t, max_rows=8)
    base = torch.zeros(3, 64, dtype=torch.bfloat16)
    tokens = torch.zeros(3, 4, dtype=torch.int64)[:, 1]
    embed = torch.zeros(3, 16, dtype=torch.bfloat16)
    cases = [
        ((base.float(), base, tokens, embed), "base logits must be bfloat16"),
        ((base, base[:, :56], tokens, embed), "Markov bias must be bfloat16"),
        ((torch.zeros(3, 72, dtype=torch.bfloat16)[:, 1:65], base, tokens, embed), "row stride"),
        ((base, base[:2], tokens, embed), "same 1 to 8 rows"),
        ((torch.zeros(9, 64, dtype=torch.bfloat16),) * 2 + (tokens, embed), "same 1 to 8 rows"),
        ((base, base, tokens.int(), embed), "tokens must be int64"),
        ((base, base, tokens, embed[:, :8]), "embedding output"),
        ((base, base, tokens, embed, 1), "gather must be a bool"),
        ((base, base, tokens, embed), "runs on CUDA"),  # CPU tensors: the device is checked last
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            step.run(*args)
        assert not step.takes(*args) and re.search(match, step.problem(*args))


def test_markov_step_op_schema():
    import dspark_cute.cutedsl.markov.greedy  # noqa: F401  (defines the op)
    from dspark_cute.runtime import ops

    schema = ops.op("markov_step").default._schema
    assert [a.name for a in schema.arguments] == ["handle", "base", "bias", "tokens", "embed", "gather"]
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"tokens", "embed"} and len(schema.returns) == 0


# ---------------------------------------------------------------- the probabilistic step

SAMPLE_VARIANTS = [(384, 512, 32, 30.0), (32000, 202752, 256, 30.0), (32000, 32000, 256, None), (8, 2056, 8, None)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("vocab,target,rank,cap", SAMPLE_VARIANTS)
def test_markov_sample_compiles(arch, vocab, target, rank, cap, tmp_path):
    """Per thread: 8 target columns, each with one uniform (10 mul.lo.u32, 8 shf.l.wrap), two logf (12 .ftz fma
    each: libdevice's, as Triton inlines it), one div.full; tanhf only with a cap; the BF16 rounding of the add,
    of y (the scatter buffer's dtype) and the cache words; one predicated cache store and the embedding copy."""
    from dspark_core.contracts.markov import markov_sample_constants
    from dspark_cute.cutedsl.markov.sample import MarkovSampleKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c = markov_sample_constants(vocab, target, rank, 0.0625, cap)
    ptx = compile_ptx(MarkovSampleKernel(c), *fake_args(c), arch=arch)
    body = code(ptx)
    assert f".target {arch}" in body
    skip_audit_off_pin("markov_sample")
    tanh = 8 if cap is not None else 0
    assert count(body, r"div\.full\.f32") == 8
    assert count(body, r"fma\.rn\.ftz\.f32") == 8 * 2 * 12
    assert count(body, r"ex2\.approx\.ftz\.f32") == tanh and count(body, r"rcp\.approx\.ftz\.f32") == tanh
    assert count(body, r"\.approx") == 2 * tanh
    assert count(body, r"mul\.lo\.u32") == 80 and count(body, r"shf\.l\.wrap\.b32") == 64
    assert count(body, r"cvt\.rn\.bf16x2\.f32") == 12
    assert count(body, r"ld\.global\.u16|ld\.global\.b16") == 16
    assert count(body, r"ld\.global\.v4\.b32") == 3 and count(body, r"st\.global\.v4\.b32") == 2
    for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op or op.startswith("div.full"), f"an FP32 operation without an explicit rounding: {op}"
    assert re.search(rf"setp\.ne\.(?:b32|s32|u32)\s+%p\d+, %r\d+, {c.ctas - 1};", body)
    assert not re.search(r"\b(ld|st)\.local", body)
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == spill_bytes(report, "spill loads") == 0, report


def test_markov_sample_refusals():
    from dspark_core.contracts.markov import markov_sample_constants
    from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

    with pytest.raises(Unsupported, match="target vocabulary"):
        markov_sample_constants(64, 100, 16, 1.0, None)
    c = markov_sample_constants(64, 128, 16, 1.0, None)
    w1 = torch.zeros(128, 16, dtype=torch.bfloat16)
    d2t = torch.arange(64)  # targets 0, 2, 4, ..., 126
    with pytest.raises(ValueError, match=r"d2t maps draft id 28 to target id 128, outside \[0, 128\)"):
        MarkovSampleStep(c, w1, torch.zeros(64, dtype=torch.int64) + 100)
    with pytest.raises(ValueError, match="distinct target ids; 32 of them repeat one"):
        MarkovSampleStep(c, w1, -torch.arange(64) + torch.arange(64) // 2)
    with pytest.raises(ValueError, match="w1 must be"):
        MarkovSampleStep(c, w1[:100], d2t)
    step = MarkovSampleStep(c, w1, d2t, max_rows=8)
    assert step.t2d[:6].tolist() == [0, -1, 1, -1, 2, -1] and int((step.t2d >= 0).sum()) == 64
    base = torch.zeros(3, 64, dtype=torch.bfloat16)
    tokens = torch.zeros(3, dtype=torch.int64)
    embed = torch.zeros(3, 16, dtype=torch.bfloat16)
    idx, pos = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    temp, seeds = torch.ones(8), torch.zeros(8, dtype=torch.int64)
    cache = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    ok = (base, base, tokens, embed, True, idx, temp, seeds, pos, cache, 1)
    cases = [
        ({5: idx.int()}, "idx_map must be int64"),
        ({6: temp.double()}, "temperature must be"),
        ({9: cache[..., :120]}, "logits cache must be"),
        ({9: cache.float()}, "logits cache must be"),
        ({10: 4}, "col must be a step"),
        ({2: tokens[:2]}, "tokens must be int64"),
        ({}, "runs on CUDA"),
    ]
    for changes, match in cases:
        args = [changes.get(k, a) for k, a in enumerate(ok)]
        with pytest.raises(ValueError, match=match):
            step.run(*args)
        assert re.search(match, step.problem(*args))


# ---------------------------------------------------------------- the asm texts, run on the CPU


def test_asm_texts_compute_the_spec(seed):
    """``ptx.markov``'s asm blocks, run by ``ptx_eval`` on many inputs (the approximate instructions as the
    spec's CPU stand-ins), give the spec's bits: the Gumbel uniform and noise, tanhf, the argmax keys."""
    from ptx_eval import evaluate

    from dspark_core.spec import gumbel
    from dspark_cute.ptx import markov as asm

    rng = np.random.default_rng(seed)
    n = 3000
    seeds = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    seeds[:3] = [0, -1, 2**63 - 1]
    pos = rng.integers(0, 2**40, n, dtype=np.int64) + (1 << 30)
    cols = rng.integers(0, 2**31 - 1, n, dtype=np.int64)
    got_u = evaluate(asm._UNIFORM, [seeds.view(np.uint64), pos.view(np.uint64), cols.astype(np.uint64)], n)
    want_u = gumbel.uniform32(torch.from_numpy(seeds), torch.from_numpy(pos), torch.from_numpy(cols))
    assert np.array_equal(got_u.astype(np.uint32), want_u.numpy().view(np.uint32))
    u = want_u.numpy()
    u[:6] = [2.0**-33, 0.25, np.nextafter(np.float32(0.25), np.float32(0)), 1 - 2.0**-24, 0.5, 2.0**-20]
    got_g = evaluate(asm._NOISE, [u.view(np.uint32).astype(np.uint64)], n)
    want_g = gumbel.gumbel_noise(torch.from_numpy(u)).numpy()
    assert np.array_equal(got_g.astype(np.uint32), want_g.view(np.uint32))
    x = (rng.standard_normal(n) * rng.choice([1e-3, 0.5, 3.0, 20.0], n)).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, 0.6, -9.0109]
    got_t = evaluate(asm._TANHF, [x.view(np.uint32).astype(np.uint64)], n)
    want_t = spec.tanhf(torch.from_numpy(x)).numpy()
    assert np.array_equal(got_t.astype(np.uint32), want_t.view(np.uint32))
    y = x.copy()
    y[6:9] = [np.nan, -0.0, 0.0]
    got_k = evaluate(asm._ARGMAX_KEY, [y.view(np.uint32).astype(np.uint64), np.arange(n, dtype=np.uint64)], n)
    assert np.array_equal(got_k, _keys(y[None, :])[0])
