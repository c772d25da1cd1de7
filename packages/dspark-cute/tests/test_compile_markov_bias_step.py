"""CPU tests of the greedy Markov step with its bias GEMM
(``dspark_cute.cutedsl.markov.bias_step``): it compiles for sm_90a and
sm_100a without a GPU, with an audit of its PTX against its stated
arithmetic and movement; the host side's decisions (the rows the build-time
check's findings bind) and refusals.

The audit, per variant (vocabulary, rank, soft cap, d2t, token tiles):
``rank / 16 x 2 x n_tiles`` ``mma.sync.m16n8k16`` BF16 -> FP32 (the bias
sums: nothing else adds them); per value one ``cvt.rn.bf16x2`` (the bias's
rounding) and per pair one more (the logit's); with a cap one ``tanhf`` a
value (``ex2``/``rcp.approx.ftz``, 6 ``fma.rn``), no other approximate,
flushed or fused instruction; every other FP32 add/mul explicitly rounded;
before ``griddepcontrol.wait`` the warp's ``w2`` copies and one set of the
base-logit loads (the other set after it), the embedding copies after it;
one ``red.max.u64``, one counter ``atom.acq_rel.add``, one ``atom.exch``,
the d2t load only with a d2t; no local memory."""

from __future__ import annotations

import re

import pytest
import torch
from cutlass import Int64
from ptx_audit import code, count, skip_audit_off_pin

from dspark_core.contracts.markov import markov_constants
from dspark_core.errors import Unsupported
from dspark_core.runtime.gemm_check import CheckResult, Finding
from dspark_core.spec.split_order import SplitOrder

ARCHS = ["sm_90a", "sm_100a"]
# (vocab, rank, cap, d2t, n_tiles)
VARIANTS = [(32768, 256, 30.0, True, 1), (32000, 256, None, False, 2), (384, 64, 30.0, True, 8),
            (202048, 256, 30.0, True, 4), (2048, 128, None, True, 1)]
CP_ASYNC = r"cp\.async\.cg\.shared\.global"


def _ptx(c, n_tiles, arch, wide=False):
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    return code(compile_ptx(MarkovBiasKernel(c, n_tiles, wide, True), *fake_args(), arch=arch))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("vocab,rank,cap,d2t,n_tiles", VARIANTS)
def test_compiles_in_its_stated_order(arch, vocab, rank, cap, d2t, n_tiles):
    c = markov_constants(vocab, rank, 0.0625, cap, d2t)
    body = _ptx(c, n_tiles, arch, wide=True)
    assert f".target {arch}" in body
    assert not re.search(r"\.local\b", body)
    skip_audit_off_pin("the Markov bias step")
    values = 8 * n_tiles  # a thread's outputs: 2 weight tiles x 2 row halves x 2 tokens a token tile
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b") == rank // 16 * 2 * n_tiles
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == values + values // 2
    tanh = values if cap is not None else 0
    assert count(body, r"ex2\.approx\.ftz\.f32") == tanh and count(body, r"rcp\.approx\.ftz\.f32") == tanh
    assert count(body, r"\.approx") == 2 * tanh and count(body, r"\.ftz") == 2 * tanh
    assert count(body, r"\bfma\.") == 6 * tanh
    for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op, f"an FP32 operation without an explicit rounding: {op}"
    wait = body.index("griddepcontrol.wait")
    assert count(body[:wait], CP_ASYNC) == rank // 8  # the warp's 32 w2 rows: rank / 8 pieces a lane
    assert count(body[wait:], CP_ASYNC) == -(-8 * n_tiles * rank // 8 // 256)
    assert count(body[:wait], r"ld\.global\.b16") == values and count(body[wait:], r"ld\.global\.b16") == values
    assert count(body, r"red\.relaxed\.gpu\.global\.max\.u64") == 1
    assert count(body, r"atom\.acq_rel\.gpu\.global\.add\.u32") == 1
    assert count(body, r"atom\.relaxed\.gpu\.global\.exch\.b64") == 1
    # One int64 id a copy of the embedding (wide ids), the d2t entry with a d2t.
    copies = -(-8 * n_tiles * rank // 8 // 256)
    assert count(body, r"ld\.global\.s64") == copies + (1 if d2t else 0)


@pytest.mark.compile
@pytest.mark.parametrize("n_tiles", [1, 8])
def test_the_bias_storing_test_variant_adds_only_its_stores(n_tiles):
    """``MarkovBiasStoreKernel`` (test-only) is the step with one predicated
    ``st.global.b16`` (and its ``cvt.rn``) a value more: nothing else of
    the deployed kernel's code changes."""
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasKernel, MarkovBiasStoreKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c = markov_constants(32768, 256, 0.0625, 30.0, True)
    args = fake_args()
    deployed = code(compile_ptx(MarkovBiasKernel(c, n_tiles, True, False), *args, arch="sm_90a"))
    stored = code(compile_ptx(MarkovBiasStoreKernel(c, n_tiles, True, False), *args[:-1], Int64(0), args[-1],
                              arch="sm_90a"))
    skip_audit_off_pin("the Markov bias step's test variant")
    values = 8 * n_tiles
    assert count(deployed, r"st\.global\.b16") == 0 and count(stored, r"st\.global\.b16") == values
    assert count(stored, r"\bcvt\.rn\.bf16x2\.f32\b") == count(deployed, r"\bcvt\.rn\.bf16x2\.f32\b") + values
    for pattern in (r"\bmma\.sync", r"red\.relaxed\.gpu\.global\.max\.u64", r"atom\.", r"\.approx", r"\bfma\."):
        assert count(stored, pattern) == count(deployed, pattern), pattern


def _result(orders: dict, refused: dict) -> CheckResult:
    result = CheckResult(k=256, seed=1)
    for m, order in orders.items():
        result.findings[m] = Finding(m, order, 3)
    for m, why in refused.items():
        result.findings[m] = Finding(m, None, 9, why)
    return result


def test_one_split_rows_bind_only_cublas_one_split_order():
    from dspark_cute.cutedsl.markov.bias_step import one_split_rows

    result = _result({1: SplitOrder(64, 1), 2: SplitOrder(128, 1), 3: SplitOrder(64, 2)}, {4: "no order matched"})
    taken, refused = one_split_rows(result, (1, 2, 3, 4, 5))
    assert set(taken) == {1, 2}
    assert "2 splits" in refused[3] and refused[4] == "no order matched" and "no order" in refused[5]


def _head(vocab=384, rank=64, d2t=True, rows=500):
    w1 = torch.zeros(rows, rank, dtype=torch.bfloat16)
    w2 = torch.zeros(vocab, rank, dtype=torch.bfloat16)
    m = torch.zeros(vocab, dtype=torch.int64) if d2t else None
    return markov_constants(vocab, rank, 0.5, None, d2t), w1, m, w2


def test_host_refusals():
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasKernel, MarkovBiasStep

    c, w1, m, w2 = _head()
    with pytest.raises(Unsupported, match="multiple of 16"):
        MarkovBiasStep(markov_constants(40, 64, 0.5, None, False), w1, None, w2[:40])
    with pytest.raises(Unsupported, match="rank that is a multiple of 64"):
        MarkovBiasStep(markov_constants(384, 32, 0.5, None, False), w1[:, :32], None, w2[:, :32])
    with pytest.raises(ValueError, match="token tiles"):
        MarkovBiasKernel(c, 3, False, True)
    big = markov_constants(384, 384, 0.5, None, False)
    w1b, w2b = torch.zeros(500, 384, dtype=torch.bfloat16), torch.zeros(384, 384, dtype=torch.bfloat16)
    with pytest.raises(Unsupported, match="shared memory"):
        MarkovBiasStep(big, w1b, None, w2b, max_rows=64)
    with pytest.raises(Unsupported, match="shared memory"):
        MarkovBiasKernel(big, 8, False, True)
    MarkovBiasStep(big, w1b, None, w2b, max_rows=8)  # one token tile: it fits
    with pytest.raises(ValueError, match="w2 must be"):
        MarkovBiasStep(c, w1, m, w2[:100])
    with pytest.raises(ValueError, match="w2 must be"):
        MarkovBiasStep(c, w1, m, w2.float())
    for rows in (0, 65, True):
        with pytest.raises(ValueError, match="1 to 64"):
            MarkovBiasStep(c, w1, m, w2, max_rows=rows)
    with pytest.raises(ValueError, match="d2t"):
        MarkovBiasStep(c, w1, None, w2)


def test_problem_before_the_check_and_bad_operands():
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep

    c, w1, m, w2 = _head()
    step = MarkovBiasStep(c, w1, m, w2, max_rows=8)
    base = torch.zeros(2, 384, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int64)
    assert "CUDA" in step.problem(base, ids, ids.clone())  # a CPU head: refused before any launch
    assert "int32 or int64" in step.problem(base, ids.float(), ids.clone())
    assert "tokens must be int64" in step.problem(base, ids, ids.int())
    assert "bfloat16" in step.problem(base.float(), ids, ids.clone())
    assert "first must be a bool" in step.problem(base, ids, ids.clone(), first=1)
    assert step.reasons[2] == "the build-time check has not run"
    with pytest.raises(ValueError):
        step.run(base, ids, ids.clone())
    with pytest.raises(ValueError, match="1 to 8"):
        step.check(rows=(9,))


def test_op_schema():
    from dspark_cute.cutedsl.markov import bias_step  # noqa: F401 (defines the op)
    from dspark_cute.runtime import ops

    schema = str(ops.op("markov_bias_step").default._schema)
    assert "Tensor(a!) tokens" in schema and "bool first" in schema
