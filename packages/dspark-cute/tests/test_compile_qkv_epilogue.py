"""CPU tests of the QKV epilogue (``dspark_cute.cutedsl.qkv.epilogue``):

- compiles for sm_90a and sm_100a (several constants: q-norm weight or not,
  RoPE with a BF16 or FP32 table or none, head counts not a multiple of the
  CTA's head group, PDL or not), with a PTX audit: no ``fma``, ``.ftz``,
  approximation or local memory (``cute_testing.audit_forbidden``), every
  FP32 add/sub/mul/div with ``.rn``; the head norm per warp round (a q and
  a k branch, which the compiler may merge without a q-norm weight): 5
  butterflies, 2 divisions, 1 square root, 2 BF16 pair roundings with RoPE
  (1 without); every access of ``qkv``, ``q`` and the
  cache 16 bytes wide (one ``ld.global.v4`` in, ``st.global.v4`` out: q and
  the cache insert); the table read once per thread; nothing loaded before
  the PDL wait; where ptxas is installed, no spills;
- the QKV front's PTX is not part of this file (``test_compile_qkv_front``
  covers it; the helpers it shares with this kernel were factored with its
  PTX byte-identical under CuTe DSL 4.3.5);
- the host-side ValueErrors that need no GPU.
"""

from __future__ import annotations

import re

import pytest
import torch
from cute_testing import audit_forbidden
from ptx_audit import code, count, ptxas_report, spill_bytes

from dspark_core.contracts.constants import QKVFrontConstants

ARCHS = ["sm_90a", "sm_100a"]

REF = QKVFrontConstants(hidden_size=8192, num_heads=64, kv_heads=8, q_weight=True, q_eps=1e-6, k_eps=1e-6,
                        rope=True, table_dtype="bf16")
SMALL = QKVFrontConstants(hidden_size=2048, num_heads=8, kv_heads=1, q_weight=False, q_eps=1e-5, k_eps=0.1,
                          rope=True, table_dtype="fp32")
NOROPE = QKVFrontConstants(hidden_size=4096, num_heads=4, kv_heads=2, q_weight=True, q_eps=1e-6, k_eps=1e-6,
                           rope=False, table_dtype="bf16")
ODD = QKVFrontConstants(hidden_size=4096, num_heads=20, kv_heads=3, q_weight=False, q_eps=1e-6, k_eps=0.0,
                        rope=True, table_dtype="bf16")
# (constants, pdl)
VARIANTS = [(REF, True), (REF, False), (SMALL, True), (NOROPE, True), (ODD, False)]


def _name(v) -> str:
    c, pdl = v
    return (f"h{c.num_heads}-kv{c.kv_heads}{'-qw' if c.q_weight else ''}-{c.table_dtype if c.rope else 'norope'}"
            f"{'-pdl' if pdl else ''}")


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_qkv_epilogue_compiles(arch, variant, tmp_path):
    from dspark_cute.cutedsl.qkv.epilogue import GROUP_HEADS, WARPS, QKVEpilogueKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c, pdl = variant
    ptx = compile_ptx(QKVEpilogueKernel(c, pdl), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    body = code(ptx)
    audit_forbidden(body, no_rcp=True, explicit_rounding=True)
    # Each warp: GROUP_HEADS / WARPS rounds, each a q branch and a k branch
    # (without a q-norm weight the two differ only in eps: the compiler may
    # merge them into one with the eps selected).
    rounds = GROUP_HEADS // WARPS
    norms = count(body, r"\bsqrt\.rn\.f32")
    assert norms == 2 * rounds or (not c.q_weight and norms == rounds), norms
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 5 * norms
    assert count(body, r"\bdiv\.rn\.f32") == 2 * norms
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32") == norms * (2 if c.rope else 1)
    # 16-byte global traffic: one load of qkv, stores of q and of the cache.
    assert count(body, r"\bld\.global\.v4\.b32") == 1
    assert count(body, r"\bst\.global\.v4\.b32") == 2
    assert set(re.findall(r"\bst\.global[.\w]*", body)) == {"st.global.v4.b32"}
    # Other global loads: the position and the slot (s64), the q-norm
    # weight pair (b32) and the table's cos and sin (b16 or b32), once each.
    assert count(body, r"\bld\.global\.s64") == (2 if c.rope else 1)
    table = 2 if c.rope else 0
    assert count(body, r"\bld\.global\.b16") == (table if c.table_dtype == "bf16" else 0)
    assert count(body, r"\bld\.global\.b32") == (table if c.table_dtype == "fp32" and c.rope else 0) + c.q_weight
    assert count(body, r"\bbar\.sync") == 2
    if pdl:
        head, sep, _ = body.partition("griddepcontrol.wait")
        assert sep and "ld.global" not in head, "a global load before the PDL wait"
        assert "griddepcontrol.launch_dependents" in body
    else:
        assert "griddepcontrol" not in body
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == spill_bytes(report, "stack frame") == 0, report
        print(arch, _name(variant), re.findall(r"Used \d+ registers", report))


def test_one_compile_per_constants(monkeypatch):
    """Equal constants share one compile (the load needs a GPU: stubbed)."""
    from dspark_cute.cutedsl.qkv import epilogue as qe
    from dspark_cute.runtime import host

    built = []
    monkeypatch.setattr(qe.compile_qkv_epilogue, "cache", {})
    monkeypatch.setattr(host, "compile_kernel", lambda obj, *args, what=None: built.append(obj) or object())
    a = qe.compile_qkv_epilogue(NOROPE, False)
    b = qe.compile_qkv_epilogue(QKVFrontConstants(**NOROPE.__dict__), False)
    c = qe.compile_qkv_epilogue(NOROPE, True)
    assert a is b and c is not a and len(built) == 2
    assert isinstance(built[0], qe.QKVEpilogueKernel) and built[1].pdl


# ---------------------------------------------------------------- host checks (no GPU needed)


def test_constructor_refuses():
    from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

    with pytest.raises(ValueError, match="QKVFrontConstants"):
        QKVEpilogue(REF.hidden_size)
    with pytest.raises(ValueError, match="at least one q head"):
        QKVEpilogue(QKVFrontConstants(8192, 0, 8, False, 1e-6, 1e-6, False, "bf16"))
    with pytest.raises(ValueError, match="bf16 or fp32 RoPE table"):
        QKVEpilogue(QKVFrontConstants(8192, 64, 8, False, 1e-6, 1e-6, True, "fp16"))
    table = torch.zeros(16, 64, dtype=torch.bfloat16)
    # CPU tensors: not CUDA.
    with pytest.raises(ValueError, match="q-norm weight must be a contiguous CUDA bfloat16"):
        QKVEpilogue(REF, torch.ones(64, dtype=torch.bfloat16), table)
    with pytest.raises(ValueError, match="q-norm weight must be"):
        QKVEpilogue(REF, None, table)
    with pytest.raises(ValueError, match="RoPE table must be a contiguous CUDA"):
        QKVEpilogue(SMALL, None, table)
    with pytest.raises(ValueError, match="no q-norm weight, yet one was given"):
        QKVEpilogue(SMALL, torch.ones(64, dtype=torch.bfloat16), table)
    with pytest.raises(ValueError, match="no RoPE, yet a table was given"):
        QKVEpilogue(QKVFrontConstants(4096, 4, 2, False, 1e-6, 1e-6, False, "bf16"), None, table)


def test_call_refuses_cpu_operands():
    from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

    c = QKVFrontConstants(4096, 4, 2, False, 1e-6, 1e-6, False, "bf16")
    epi = QKVEpilogue(c, pdl=False)  # no operand on a device yet: nothing to check
    m, rows = 3, (2 * 4 + 2 * 2) * 64
    qkv = torch.zeros(m, rows, dtype=torch.bfloat16)
    pos = torch.zeros(m, dtype=torch.int64)
    cache = torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)
    assert "contiguous, 16-byte aligned CUDA bfloat16" in epi.problem(qkv, pos, pos, cache)
    assert not epi.takes(qkv, pos, pos, cache)
    with pytest.raises(ValueError, match="qkv must be a bfloat16 projection of"):
        epi.run(torch.zeros(m, rows - 64, dtype=torch.bfloat16), pos, pos, cache)
    with pytest.raises(ValueError, match=r"m >= 1"):
        epi.run(torch.zeros(0, rows, dtype=torch.bfloat16), pos[:0], pos[:0], cache)
    with pytest.raises(ValueError, match="CUDA"):
        epi.run(qkv, pos, pos, cache)
