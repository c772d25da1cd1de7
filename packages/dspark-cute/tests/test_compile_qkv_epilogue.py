"""CPU tests of the QKV epilogue (``dspark_cute.cutedsl.qkv.epilogue``):

- compiles for sm_90a and sm_100a of every variant (RoPE with an FP32 or a
  BF16 table or none; 1 to 32 KV heads, powers of two, and an odd count; one
  eps or a q and a k eps; PDL or not), each in both grids (per-token, flat),
  with a PTX audit of vLLM's fused
  QK-norm read back from the PTX's dataflow (``qkv_ptx``): one head norm,
  its chain of 8 ``fma.rn.f32`` squares from +0.0 over the 16-byte load's
  words in element order (``lo`` then ``hi`` half of words 0 .. 3), the
  butterfly xor 4, 2, 1, ``fma(S, 1/64, eps)`` with eps the FP32 nearest
  (a ``selp`` of the q and k eps where they differ), ``rsqrt.approx.f32``
  (not ``.ftz``), the 8 values times ``r``; with RoPE each pair ``(x, y)``
  as ``fma(c, x, -(s * y))``, ``fma(s, x, c * y)`` with ``c``, ``s`` the
  table's loads (FP32: word ``i`` of the 16-byte cos and sin loads, 128
  bytes apart; BF16: half ``i % 2`` of word ``i // 2`` of the 8-byte loads,
  64 bytes apart); each pair packed once (``cvt.rn.bf16x2.f32``: ``x'``
  low, ``y'`` high); the q/k store writes those words back where they were
  loaded, the K insert the same words, the V insert the loaded words; no
  other FP32 arithmetic (no ``sqrt.rn``, ``div``, ``rcp``, ``.ftz``, local
  memory); the cache's K and V rows addressed through its block, token and
  head strides (runtime parameters); nothing loaded before the PDL wait;
  where ptxas is installed, no spills;
- the host-side refusals that need no GPU.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch
from ptx_audit import assert_strides_address, code, count, ptxas_report, skip_audit_off_pin, spill_bytes
from qkv_ptx import ONE_64TH, half, head_norms, normed_pairs, packed, rotation

from dspark_core.contracts.constants import QKVEpilogueConstants
from dspark_core.errors import Unsupported

ARCHS = ["sm_90a", "sm_100a"]


def constants(kv: int, table: str | None, heads: int | None = None, q_eps: float = 1e-6, k_eps: float = 1e-6,
              hidden: int = 8192) -> QKVEpilogueConstants:
    """Constants of ``kv`` KV heads (``heads`` q heads, default 8 per KV
    head up to 64), RoPE with a ``table`` ("fp32", "bf16") or none."""
    if heads is None:
        heads = min(64, 8 * kv)
    return QKVEpilogueConstants(hidden_size=hidden, num_heads=heads, kv_heads=kv, q_weight=False, q_eps=q_eps,
                             k_eps=k_eps, rope=table is not None, table_dtype=table or "bf16")


# (constants, pdl): every KV count with each table (and none), one eps and two.
VARIANTS = [
    *[(constants(kv, table), True) for kv in (1, 2, 4, 8, 16, 32) for table in ("fp32", "bf16", None)],
    (constants(8, "fp32", q_eps=1e-5, k_eps=0.0), False),
    (constants(4, "bf16", heads=20, q_eps=0.1, k_eps=1e-6), True),
    (constants(3, None, heads=6, k_eps=0.0), False),
]


def _name(v) -> str:
    c, pdl = v
    eps = "" if c.q_eps == c.k_eps else f"-eps{c.q_eps:g}-{c.k_eps:g}"
    return f"h{c.num_heads}-kv{c.kv_heads}-{c.table_dtype if c.rope else 'norope'}{eps}{'-pdl' if pdl else ''}"


def f32_hex(x: float) -> str:
    return f"0f{struct.unpack('<I', struct.pack('<f', x))[0]:08X}"


def audit_head_norm(body: str, c: QKVEpilogueConstants) -> None:
    """The stock QK-norm's dataflow in the epilogue's PTX (module docstring)."""
    norms = head_norms(body)
    assert len(norms) == 1, f"{len(norms)} head norms"
    n = norms[0]
    flow = n.flow
    assert len(n.chain) == 8, f"a chain of {len(n.chain)} squares"
    load = [ops for op, ops in flow.each("ld.global.v4.b32")][0]
    words = load[0].strip("{}").replace(" ", "").split(",")
    assert n.elements == [(h, w) for w in words for h in ("lo", "hi")], n.elements
    assert n.offsets == [4, 2, 1]
    assert n.scale == ONE_64TH
    if c.q_eps == c.k_eps:
        assert n.eps == ("const", f32_hex(c.q_eps)), n.eps
    else:
        assert n.eps[0] == "selp" and set(n.eps[1:]) == {f32_hex(c.q_eps), f32_hex(c.k_eps)}, n.eps
    assert n.r, "no rsqrt.approx.f32 of fma(S, 1/64, eps)"
    assert [src for src, _ in n.normed] == n.values, "not the 8 values, in order, times r"
    pairs = normed_pairs(n)
    assert len(pairs) == 4 and all(x and y for x, y in pairs)
    out = []
    for i, (x, y) in enumerate(pairs):
        if c.rope:
            rot = rotation(n, x, y)
            assert rot, f"pair {i}: not fma(c, x, -(s * y)), fma(s, x, c * y)"
            cos, sin, x, y = rot
            _audit_table(flow, c.table_dtype, i, cos, sin)
        word = packed(flow, x, y)
        assert len(word) == 1, f"pair {i} packed {len(word)} times"
        out.append(word[0])
    # The stores: q/k back over the loaded head, the K insert the same words,
    # the V insert the loaded words.
    stores = [(ops[0], ops[1].strip("{}").replace(" ", "").split(",")) for op, ops in flow.each("st.global")]
    assert len(stores) == 3, stores
    assert (load[1], out) in stores, "no q/k store of the result over the loaded head"
    assert [w for _, w in stores].count(out) == 2, "the K insert does not store the result"
    assert [w for _, w in stores].count(words) == 1, "the V insert does not store the loaded words"


def _audit_table(flow, table: str, i: int, cos: str, sin: str) -> None:
    """``cos`` and ``sin`` of pair ``i`` (of the lane's 4) are the table's."""
    if table == "fp32":
        c, s = flow.op(cos), flow.op(sin)
        assert c[0] == s[0] == "ld.global.v4.b32" and c[2] == s[2] == i, (c, s)
        step = "128"
    else:
        hc, hs = half(flow, cos), half(flow, sin)
        assert hc and hs and hc[0] == hs[0] == ("lo", "hi")[i % 2], (hc, hs)
        c, s = flow.op(hc[1]), flow.op(hs[1])
        assert c[0] == s[0] == "ld.global.v2.b32" and c[2] == s[2] == i // 2, (c, s)
        step = "64"
    ca, sa = c[1][0].strip("[]"), s[1][0].strip("[]")
    d = flow.op(sa)
    assert d and d[0] == "add.s64" and d[1] == [flow.resolve(ca), step], f"the sin load not {step} bytes past cos"


def assert_no_spills(ptx: str, arch: str, tmp_path, what: str) -> None:
    """No spill and no stack frame in ptxas's report, where the installed
    ptxas reads this PTX's version (a CuTe DSL newer than the CUDA toolkit
    writes a newer PTX ISA: then said and skipped)."""
    try:
        report = ptxas_report(ptx, arch, tmp_path)
    except RuntimeError as e:
        if "Unsupported .version" not in str(e):
            raise
        print(f"{arch} {what}: ptxas too old for this PTX, spills not checked")
        return
    if report:
        assert spill_bytes(report) == spill_bytes(report, "stack frame") == 0, report
        print(arch, what, re.findall(r"Used \d+ registers", report))


@pytest.mark.compile
@pytest.mark.parametrize("flat", [False, True], ids=["per-token", "flat"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_qkv_epilogue_compiles(arch, variant, flat, tmp_path):
    from dspark_cute.cutedsl.qkv.epilogue import FLAT_THREADS, THREADS, QKVEpilogueKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c, pdl = variant
    ptx = compile_ptx(QKVEpilogueKernel(c, pdl, flat), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    assert f".reqntid {FLAT_THREADS if flat else THREADS}, 1, 1" in ptx
    skip_audit_off_pin("qkv_epilogue")
    body = code(ptx)
    audit_head_norm(body, c)
    # Every FP32 operation: the chain, the fold, the scale, the rsqrt, the
    # products and RoPE; nothing else, nothing flushed or approximated otherwise.
    assert count(body, r"\bfma\.rn\.f32") == 8 + 1 + (8 if c.rope else 0)
    assert count(body, r"\bfma\b|\bfma\.") == count(body, r"\bfma\.rn\.f32")
    assert count(body, r"\brsqrt\.approx\.f32") == 1 and "rsqrt.approx.ftz" not in body
    assert count(body, r"\badd\.rn\.f32") == 3
    assert count(body, r"\bmul\.rn\.f32") == 8 + (8 if c.rope else 0)
    assert count(body, r"\bneg\.f32") == (4 if c.rope else 0)
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32") == 4
    for op in re.findall(r"\b(?:add|sub|mul|div|fma|sqrt|rcp|ex2|lg2|rsqrt|min|max)(?:\.\w+)*\.f32\b", body):
        assert op in ("add.rn.f32", "mul.rn.f32", "fma.rn.f32", "rsqrt.approx.f32"), op
    assert ".ftz" not in body and not re.search(r"\bsqrt\.|\bdiv\.(rn|full|approx)|\brcp\.", body)
    assert not re.search(r"\b(ld|st)\.local", body), "local memory (register spills)"
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 3 and "shfl.sync.idx" not in body
    # 16-byte traffic of qkv and the cache; the table's loads; the position and slot.
    assert count(body, r"\bld\.global\.v4\.b32") == 1 + (2 if c.rope and c.table_dtype == "fp32" else 0)
    assert count(body, r"\bld\.global\.v2\.b32") == (2 if c.rope and c.table_dtype == "bf16" else 0)
    assert count(body, r"\bld\.global\.s64") == (2 if c.rope else 1)
    assert set(re.findall(r"\bld\.global[.\w]*", body)) <= {"ld.global.v4.b32", "ld.global.v2.b32",
                                                            "ld.global.s64"}
    assert set(re.findall(r"\bst\.global[.\w]*", body)) == {"st.global.v4.b32"}
    # The slot's block and page: one unsigned 32-bit division, no 64-bit one.
    assert count(body, r"\bdiv\.u32") == 1 and not re.search(r"\b(div|rem)\.[su]64", body)
    assert "bar.sync" not in body and ".shared" not in body
    # The cache's block, token and head strides (the last three parameters).
    assert_strides_address(body, [9, 10, 11], _name(variant))
    if pdl:
        head, sep, _ = body.partition("griddepcontrol.wait")
        assert sep and "ld.global" not in head, "a global load before the PDL wait"
        assert "griddepcontrol.launch_dependents" in body
    else:
        assert "griddepcontrol" not in body
    assert_no_spills(ptx, arch, tmp_path, _name(variant))


def test_one_compile_per_constants(monkeypatch):
    """Equal constants share one compile (the load needs a GPU: stubbed)."""
    from dspark_cute.cutedsl.qkv import epilogue as qe
    from dspark_cute.runtime import host

    built = []
    c = constants(2, None, heads=4)
    monkeypatch.setattr(qe.compile_qkv_epilogue, "cache", {})
    monkeypatch.setattr(host, "compile_kernel", lambda obj, *args, what=None: built.append(obj) or object())
    a = qe.compile_qkv_epilogue(c, False)
    b = qe.compile_qkv_epilogue(QKVEpilogueConstants(**c.__dict__), False)
    d = qe.compile_qkv_epilogue(c, True)
    f = qe.compile_qkv_epilogue(c, False, True)
    assert a is b and d is not a and f not in (a, d) and len(built) == 3
    assert isinstance(built[0], qe.QKVEpilogueKernel) and built[1].pdl and built[2].flat and not built[0].flat
    assert qe.compile_qkv_epilogue(c, False, False) is a


# ---------------------------------------------------------------- host checks (no GPU needed)


def test_constructor_refuses():
    from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue, QKVEpilogueKernel

    ref = constants(8, "fp32")
    with pytest.raises(ValueError, match="QKVEpilogueConstants"):
        QKVEpilogue(ref.hidden_size)
    with pytest.raises(Unsupported, match="at least one q head"):
        QKVEpilogue(QKVEpilogueConstants(8192, 0, 8, False, 1e-6, 1e-6, False, "bf16"))
    with pytest.raises(Unsupported, match="bf16 or fp32 RoPE table"):
        QKVEpilogue(QKVEpilogueConstants(8192, 64, 8, False, 1e-6, 1e-6, True, "fp16"))
    weighted = QKVEpilogueConstants(8192, 64, 8, True, 1e-6, 1e-6, True, "fp32")
    with pytest.raises(Unsupported, match="weightless"):
        QKVEpilogue(weighted)
    with pytest.raises(Unsupported, match="weightless"):
        QKVEpilogueKernel(weighted, False)
    table = torch.zeros(16, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weightless"):
        QKVEpilogue(ref, torch.ones(64, dtype=torch.bfloat16), table)
    # CPU tensors: not CUDA.
    with pytest.raises(ValueError, match="RoPE table must be a contiguous, 16-byte aligned CUDA"):
        QKVEpilogue(ref, None, table)
    with pytest.raises(ValueError, match="RoPE table must be"):
        QKVEpilogue(ref, None, None)
    with pytest.raises(ValueError, match="no RoPE, yet a table was given"):
        QKVEpilogue(constants(2, None), None, table)


def test_max_rows_refused_above():
    """``max_rows``: ``m * heads`` below 2^31 (the flat grid's Int32 index),
    stated for the contract's ``rows_taken``; one row more is refused with
    the reason before any other check (meta tensors: no memory)."""
    from dspark_core.contracts.kernels import QKV_EPILOGUE, rows_taken
    from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

    c = constants(8, None)
    epi = QKVEpilogue(c, pdl=False)
    heads = c.num_heads + 2 * c.kv_heads
    assert epi.max_rows == (2**31 - 1) // heads and rows_taken(QKV_EPILOGUE, epi) == epi.max_rows
    rows = (2 * c.num_heads + 2 * c.kv_heads) * 64
    for m, refused in ((epi.max_rows, False), (epi.max_rows + 1, True)):
        qkv = torch.empty(m, rows, dtype=torch.bfloat16, device="meta")
        reason = epi.problem(qkv, None, None, None)
        assert ("2^31 heads" in reason) is refused, reason


def test_call_refuses_cpu_operands():
    from dspark_cute.cutedsl.qkv.epilogue import QKVEpilogue

    c = constants(2, None, heads=4)
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
