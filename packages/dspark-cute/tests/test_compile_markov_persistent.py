"""CPU tests of the greedy Markov loop in one persistent launch
(``dspark_cute.cutedsl.markov.persistent``): it compiles for sm_90a and
sm_100a without a GPU, launched cooperatively, with an audit of its PTX
against its stated arithmetic and movement; the host side's refusals.

The audit, per variant (vocabulary, rank, soft cap, d2t, steps, token
tiles): each step's ``rank / 16 x 2 x n_tiles`` ``mma.sync.m16n8k16`` and
its roundings (the bias step's, ``test_compile_markov_bias_step``), so N
times those; before ``griddepcontrol.wait`` the warp's ``w2`` copies and
nothing else of global memory; after it each step's base-logit loads once
and its embedding copies; per step one ``red.max.u64``, one grid barrier
(``red.release`` on the counter, the ``ld.acquire`` spin, its ``trap``),
one ``ld.relaxed`` of the keys; one count-out ``atom.acq_rel.add`` a
launch; no ``atom.exch``; the d2t load a step only with a d2t; no local
memory."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from ptx_audit import code, count, ptxas_report, skip_audit_off_pin, spill_bytes

from dspark_core.contracts.markov import markov_constants
from dspark_core.errors import Unsupported

ARCHS = ["sm_90a", "sm_100a"]
# (vocab, rank, cap, d2t, steps, n_tiles)
VARIANTS = [(32768, 256, 30.0, True, 4, 1), (32000, 256, None, False, 3, 2), (384, 64, 30.0, True, 8, 4),
            (2048, 128, None, True, 1, 4)]
CP_ASYNC = r"cp\.async\.cg\.shared\.global"


def _kernel(c, steps, n_tiles, wide=True, pdl=True):
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentKernel
    from dspark_cute.runtime.host import cooperative_supported

    if not cooperative_supported():
        with pytest.raises(Unsupported, match="cooperative launch"):
            MarkovPersistentKernel(c, steps, n_tiles, wide, pdl)
        pytest.skip("this CuTe DSL has no cooperative launch: the persistent loop refuses (checked)")
    return MarkovPersistentKernel(c, steps, n_tiles, wide, pdl)


def _compile(kernel, arch, monkeypatch):
    """The PTX, and the launch configurations the trace built."""
    from cutlass.base_dsl.dsl import BaseDSL

    from dspark_cute.cutedsl.markov.persistent import fake_args
    from dspark_cute.runtime.host import compile_ptx

    seen = []

    class Recording(BaseDSL.LaunchConfig):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(BaseDSL, "LaunchConfig", Recording)
    return code(compile_ptx(kernel, *fake_args(), arch=arch)), seen


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("vocab,rank,cap,d2t,steps,n_tiles", VARIANTS)
def test_compiles_cooperative_in_its_stated_order(arch, vocab, rank, cap, d2t, steps, n_tiles, monkeypatch, tmp_path):
    c = markov_constants(vocab, rank, 0.0625, cap, d2t)
    kernel = _kernel(c, steps, n_tiles)
    body, launches = _compile(kernel, arch, monkeypatch)
    assert f".target {arch}" in body
    assert not re.search(r"\.local\b", body)
    assert [(lc.cooperative, lc.use_pdl, list(lc.grid)) for lc in launches] == [(True, True, [kernel.ctas, 1, 1])]
    skip_audit_off_pin("the persistent Markov loop")
    values = 8 * n_tiles
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b") \
        == steps * rank // 16 * 2 * n_tiles
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == steps * (values + values // 2)
    tanh = steps * values if cap is not None else 0
    assert count(body, r"\.approx") == 2 * tanh and count(body, r"\.ftz") == 2 * tanh
    assert count(body, r"\bfma\.") == 6 * tanh
    for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op, f"an FP32 operation without an explicit rounding: {op}"
    wait = body.index("griddepcontrol.wait")
    assert count(body[:wait], CP_ASYNC) == rank // 8  # the warp's 32 w2 rows, once
    assert count(body[:wait], r"\bld\.global") == 0
    copies = -(-8 * n_tiles * rank // 8 // 256)
    assert count(body[wait:], CP_ASYNC) == steps * copies
    assert count(body[wait:], r"ld\.global\.b16") == steps * values
    assert count(body, r"red\.relaxed\.gpu\.global\.max\.u64") == steps
    assert count(body, r"red\.release\.gpu\.global\.add\.u32") == steps
    assert count(body, r"ld\.acquire\.gpu\.global\.u32") == steps and count(body, r"\btrap;") == steps
    assert count(body, r"ld\.relaxed\.gpu\.global\.b64") == steps
    assert count(body, r"atom\.acq_rel\.gpu\.global\.add\.u32") == 1
    assert count(body, r"atom\.\S*exch") == 0
    # The anchors' int64 ids (step 0's embedding copies), then the d2t entry a step.
    assert count(body, r"ld\.global\.s64") == copies + (steps if d2t else 0)
    assert body.index("griddepcontrol.launch_dependents") > body.rindex("red.relaxed.gpu.global.max.u64")
    report = ptxas_report(body, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0, report


def test_refusals():
    from dspark_cute.cutedsl.markov import persistent
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentKernel, persistent_unsupported

    c = markov_constants(32768, 256, 0.5, None, False)
    assert persistent_unsupported(c, 64, sms=132) in (None, persistent_unsupported(c, 64))
    big = markov_constants(202048, 256, 0.5, None, False)
    if persistent_unsupported(big, 8) is None:  # a DSL with cooperative launches
        assert "790 CTAs" in persistent_unsupported(big, 8, sms=132) and "132 SMs" in persistent_unsupported(
            big, 8, sms=132)
    assert "multiple of 16" in persistent_unsupported(markov_constants(40, 64, 0.5, None, False), 1)
    assert "shared memory" in persistent_unsupported(markov_constants(384, 384, 0.5, None, False), 64)
    for steps in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="1 to 16 steps"):
            MarkovPersistentKernel(c, steps, 1, False, True)
    for n_tiles in (3, 8):  # 64 rows would spill: the step loop takes them
        with pytest.raises(ValueError, match="token tiles"):
            MarkovPersistentKernel(c, 2, n_tiles, False, True)
    old = persistent.cooperative_supported
    try:
        persistent.cooperative_supported = lambda: False
        assert "cooperative launch" in persistent_unsupported(c, 1)
        with pytest.raises(Unsupported, match="cooperative launch"):
            MarkovPersistentKernel(c, 2, 1, False, True)
    finally:
        persistent.cooperative_supported = old


def _head(vocab=384, rank=64, d2t=True, rows=500):
    w1 = torch.zeros(rows, rank, dtype=torch.bfloat16)
    w2 = torch.zeros(vocab, rank, dtype=torch.bfloat16)
    m = torch.zeros(vocab, dtype=torch.int64) if d2t else None
    return markov_constants(vocab, rank, 0.5, None, d2t), w1, m, w2


def test_host_refusals_and_bad_operands(monkeypatch):
    from dspark_cute.cutedsl.markov import persistent
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentLoop

    monkeypatch.setattr(persistent, "cooperative_supported", lambda: True)
    c, w1, m, w2 = _head()
    for steps in (0, 17, None):
        with pytest.raises(ValueError, match="1 to 16 steps"):
            MarkovPersistentLoop(c, w1, m, w2, steps)
    for timeout in (0, -1.0, 100, 1e-10, float("inf"), float("nan"), "1", True, None):
        with pytest.raises((ValueError, TypeError), match="timeout"):
            MarkovPersistentLoop(c, w1, m, w2, 2, timeout_s=timeout)
    with pytest.raises(ValueError, match="w2 must be"):
        MarkovPersistentLoop(c, w1, m, w2.float(), 2)
    for rows in (0, 33, 64, True):
        with pytest.raises(ValueError, match="1 to 32 rows"):
            MarkovPersistentLoop(c, w1, m, w2, 2, max_rows=rows)
    for rows in (np.int64(8), np.int32(8)):  # numpy integers are ints (checks.as_int)
        assert MarkovPersistentLoop(c, w1, m, w2, np.int64(2), max_rows=rows).max_rows == 8
    for steps in (2.0, "2", np.float32(2)):
        with pytest.raises(ValueError, match="1 to 16 steps"):
            MarkovPersistentLoop(c, w1, m, w2, steps)
    loop = MarkovPersistentLoop(c, w1, m, w2, 3, max_rows=8)
    assert loop.keys.shape == (3 * 32,) and loop.counters.shape == (2,)
    # bind() names what differs in a MarkovBiasStep it cannot take.
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep

    monkeypatch.setattr(MarkovBiasStep, "prepare", lambda self: None)
    other = MarkovBiasStep(markov_constants(384, 64, 0.25, 30.0, True), w1, m, w2, max_rows=8)
    with pytest.raises(ValueError, match=r"\(its multiplier is 0.25, not 0.5; its soft_cap is 30.0, not None\)"):
        loop.bind(other)
    with pytest.raises(ValueError, match="its w2 is another tensor"):
        loop.bind(MarkovBiasStep(c, w1, m, w2.clone(), max_rows=8))
    with pytest.raises(ValueError, match="binds to a MarkovBiasStep, not"):
        loop.bind("step")
    base = torch.zeros(2, 3, 384, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int64)
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    assert "CUDA" in loop.problem(base, ids, tokens)  # a CPU head: refused before any launch
    assert "[rows, 3, 384]" in loop.problem(base[:, :2], ids, tokens)
    assert "[rows, 3, 384]" in loop.problem(base[0], ids, tokens)
    assert "int64 [2, 3]" in loop.problem(base, ids, tokens[:, :2])
    assert "tokens must be int64" in loop.problem(base, ids, tokens.int())
    assert "bfloat16" in loop.problem(base.float(), ids, tokens)
    odd = torch.zeros(2, 3, 388, dtype=torch.bfloat16)[..., :384]  # a step's rows 1164 elements apart
    assert "row stride that is a multiple" in loop.problem(odd, ids, tokens)
    assert "int32 or int64" in loop.problem(base, ids.float(), tokens)
    assert not loop.takes(base, ids, tokens)
    with pytest.raises(ValueError, match="CUDA"):
        loop.run(base, ids, tokens)
    with pytest.raises(ValueError, match="1 to 8"):
        loop.check(rows=(9,))


def test_op_schema():
    from dspark_cute.cutedsl.markov import persistent  # noqa: F401 (defines the op)
    from dspark_cute.runtime import ops

    schema = str(ops.op("markov_persistent_loop").default._schema)
    assert "Tensor(a!) tokens" in schema and "Tensor base" in schema


def test_probe_unbinds_on_other_tokens_or_a_failed_launch(monkeypatch):
    """``probe``'s decisions, its launch replaced on the CPU: vLLM's tokens
    keep the rows; other tokens or a launch error unbind them all, with the reason."""
    from dspark_core.spec import markov as spec
    from dspark_cute.cutedsl.markov import persistent
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentLoop

    monkeypatch.setattr(persistent, "cooperative_supported", lambda: True)
    gen = torch.Generator().manual_seed(3)
    c = markov_constants(384, 64, 0.5, 30.0, True)
    w1 = torch.randn(500, 64, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(384, 64, generator=gen).to(torch.bfloat16)
    d2t = torch.arange(384) * 0 + 7
    outcome = {"kind": "right"}

    class Loop(MarkovPersistentLoop):
        def prepare(self, prev_dtypes=()) -> None:
            pass

        def _launch_kernel(self, base, prev, tokens) -> None:
            if outcome["kind"] == "raise":
                raise RuntimeError("cudaErrorCooperativeLaunchTooLarge")
            tokens.copy_(spec.greedy_loop(base, prev, self.w1, self.w2, c.multiplier, c.soft_cap, self.d2t))
            if outcome["kind"] == "wrong":
                tokens[-1, -1] += 1

    for kind, words in (("right", None), ("wrong", "other tokens"), ("raise", "CooperativeLaunchTooLarge")):
        outcome["kind"] = kind
        loop = Loop(c, w1, d2t, w2, 3, max_rows=8)
        loop.rows = {1: None, 5: None, 8: None}
        why = loop.probe()
        assert loop.refused == (kind == "raise")
        if words is None:
            assert why is None and set(loop.rows) == {1, 5, 8}
        else:
            assert words in why and not loop.rows and loop.reasons[5] == why
