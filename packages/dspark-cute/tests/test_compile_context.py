"""CPU tests of the context kernels: they compile for sm_90a and sm_100a
without a GPU, a PTX audit of what they compile to, and the host-side
refusals.

Compiled here (each for sm_90a and for sm_100a):

- the context norms: every norm kind (no weight; BF16, FP16, FP32 weights,
  each before and after the norm) on the hidden side and on the input-norm
  side (7 pairs, each kind once per side), with 1, 2, 3, 5 or 9 layers and
  H of 2048, 8192 or 16384, with PDL; and one without PDL;
- the context store: 1, 2, 4, 8, 16 and 32 KV heads, each with a BF16 RoPE
  table, an FP32 table and no RoPE, with PDL; and one without PDL.

The audit: no ``fma`` (the spec has none), no ``.ftz``, no ``rsqrt`` or
``.approx``, no local memory (spills). The norms kernel: every global access
a 16-byte ``ld/st.global.v4.b32``, their counts those of the layout (weights,
rows, outputs), the weight loads (only) before ``griddepcontrol.wait``, two
barriers, 10 butterfly shuffles, 4 divisions and 2 square roots. The store
kernel: per head one 4-byte load and store each of K and V, 5 shuffles, 2
divisions and 1 square root; the slot (and position) loads; nothing loaded
before the PDL wait.
"""

from __future__ import annotations

import re

import pytest
import torch
from cute_testing import WORDS, audit_forbidden, has_f32_constant
from cute_testing import norm_constants as norm
from ptx_audit import code, count

from dspark_core.contracts.constants import ContextNormConstants, ContextStoreConstants, NormConstants

ARCHS = ["sm_90a", "sm_100a"]
# (hidden kind, input-norm kind, layers, H, pdl): each kind once per side.
NORM_VARIANTS = [
    (i, (i + 3) % 7, (1, 2, 3, 5, 9, 2, 2)[i], (8192, 8192, 2048, 8192, 16384, 8192, 8192)[i], True)
    for i in range(7)
] + [(1, 2, 2, 8192, False)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hidden,pre,layers,h,pdl", NORM_VARIANTS)
def test_context_norms_compile(arch, hidden, pre, layers, h, pdl):
    from dspark_cute.cutedsl.norms.context_norms import ContextNormsKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c = ContextNormConstants(hidden_size=h, num_layers=layers, hidden=norm(hidden), pre=norm(pre))
    body = code(compile_ptx(ContextNormsKernel(c, pdl), *fake_args(c), arch=arch))
    assert f".target {arch}" in body
    audit_forbidden(body)
    frags = h // 2048
    weights = sum(frags * WORDS[n.weight_dtype] for n in (c.hidden, c.pre) if n.weight_dtype)
    global_ops = re.findall(r"\b(?:ld|st)\.global[.\w]*", body)
    assert set(global_ops) <= {"ld.global.v4.b32", "st.global.v4.b32"}, global_ops
    assert count(body, r"\bld\.global\.v4\.b32") == weights + frags
    assert count(body, r"\bst\.global\.v4\.b32") == frags
    assert count(body, r"\bbar\.sync\b") == 2
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 10
    assert count(body, r"\bdiv\.rn\.f32") == 4
    assert count(body, r"\bsqrt\.rn\.f32") == 2
    # BF16 rounding of the hidden norm (4 words per fragment) and of the output.
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32") == 8 * frags
    if pdl:
        head, sep, _ = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert count(head, r"\bld\.global") == weights, "only the weights load before the wait"
        assert "griddepcontrol.launch_dependents" in body
    else:
        assert "griddepcontrol" not in body


# (kv heads, rope, table dtype, pdl)
STORE_VARIANTS = [
    (kv, rope, table, True)
    for kv in (1, 2, 4, 8, 16, 32)
    for rope, table in ((True, "bf16"), (True, "fp32"), (False, "bf16"))
] + [(8, True, "bf16", False)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv,rope,table,pdl", STORE_VARIANTS)
def test_context_store_compile(arch, kv, rope, table, pdl):
    from dspark_cute.cutedsl.context.store import ContextStoreKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c = ContextStoreConstants(kv_heads=kv, k_eps=1e-6, rope=rope, table_dtype=table)
    body = code(compile_ptx(ContextStoreKernel(c, pdl), *fake_args(c), arch=arch))
    assert f".target {arch}" in body
    audit_forbidden(body)
    table_loads = {"bf16": (0, 2), "fp32": (2, 0)}[table] if rope else (0, 0)
    assert count(body, r"\bld\.global\.b32\b") == 2 * kv + table_loads[0]
    assert count(body, r"\bld\.global\.b16\b") == table_loads[1]
    assert count(body, r"\bld\.global\.s64\b") == (2 if rope else 1)
    assert count(body, r"\bst\.global\.b32\b") == 2 * kv
    assert set(re.findall(r"\b(?:ld|st)\.global[.\w]*", body)) <= {
        "ld.global.b32", "ld.global.b16", "ld.global.s64", "st.global.b32"
    }
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 5 * kv
    assert count(body, r"\bdiv\.rn\.f32") == 2 * kv
    assert count(body, r"\bsqrt\.rn\.f32") == kv
    # RoPE: 4 products, one difference and one sum per pair; none without it.
    assert count(body, r"\bsub\.rn\.f32") == (kv if rope else 0)
    assert count(body, r"\bmul\.rn\.f32") == kv * (2 + 2 + (4 if rope else 0))
    if pdl:
        head, sep, _ = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert not re.search(r"\bld\.global", head), "a load before the PDL wait"
    else:
        assert "griddepcontrol" not in body


@pytest.mark.compile
def test_signed_zero_center_compiles_apart():
    """A -0.0 gain center keeps a -0.0 weight where 0.0 does not: the two
    must be separate variants with their own constant."""
    from dspark_cute.cutedsl.norms.context_norms import ContextNormsKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    plus = ContextNormConstants(2048, 2, NormConstants(1e-6, "bf16", 0.0, False), norm(0))
    minus = ContextNormConstants(2048, 2, NormConstants(1e-6, "bf16", -0.0, False), norm(0))
    assert plus.key() != minus.key()
    ptx_plus = compile_ptx(ContextNormsKernel(plus, True), *fake_args(plus), arch="sm_90a")
    ptx_minus = compile_ptx(ContextNormsKernel(minus, True), *fake_args(minus), arch="sm_90a")
    assert has_f32_constant(ptx_plus, 0x00000000) and has_f32_constant(ptx_minus, 0x80000000)
    assert not has_f32_constant(ptx_plus, 0x80000000)


def test_norms_refuse_bad_constants_and_weights():
    from dspark_cute.cutedsl.norms.context_norms import ContextNorms

    c = ContextNormConstants(8192, 2, norm(1), norm(5))
    with pytest.raises(ValueError, match="ContextNormConstants"):
        ContextNorms(norm(1), None, None)
    with pytest.raises(ValueError, match="2048"):
        ContextNorms(ContextNormConstants(3000, 2, norm(0), norm(0)), None, None)
    with pytest.raises(ValueError, match="at least one layer"):
        ContextNorms(ContextNormConstants(8192, 0, norm(0), norm(0)), None, None)
    with pytest.raises(ValueError, match="contiguous CUDA"):  # weights on the CPU
        ContextNorms(c, torch.ones(8192, dtype=torch.bfloat16), torch.ones(2, 8192))
    with pytest.raises(ValueError, match="no weight"):
        ContextNorms(ContextNormConstants(8192, 2, norm(0), norm(0)), torch.ones(8192), None)


def test_store_refuses_bad_constants_and_operands():
    from dspark_cute.cutedsl.context.store import ContextKvStore

    with pytest.raises(ValueError, match="power of two"):
        ContextKvStore(ContextStoreConstants(3, 1e-6, False, "bf16"))
    with pytest.raises(ValueError, match="power of two"):
        ContextKvStore(ContextStoreConstants(64, 1e-6, False, "bf16"))
    with pytest.raises(ValueError, match="table"):
        ContextKvStore(ContextStoreConstants(8, 1e-6, False, "fp16"))
    with pytest.raises(ValueError, match="RoPE table"):  # a CPU table
        ContextKvStore(ContextStoreConstants(8, 1e-6, True, "bf16"), torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no RoPE"):
        ContextKvStore(ContextStoreConstants(8, 1e-6, False, "bf16"), torch.zeros(16, 64, dtype=torch.bfloat16))
    store = ContextKvStore(ContextStoreConstants(2, 1e-6, False, "bf16"))
    kv = torch.zeros(1, 4, 256, dtype=torch.bfloat16)  # on the CPU
    caches = [torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)]
    reason = store.problem(kv, None, caches, torch.zeros(4, dtype=torch.int64))
    assert reason is not None and "CUDA" in reason
    assert not store.takes(kv, None, [], None)
    with pytest.raises(ValueError, match="CUDA"):
        store.run(kv, None, [], None)


def test_chain_refuses_what_does_not_fuse():
    from dspark_core.errors import Unsupported
    from dspark_core.planner.plan import context_constants
    from dspark_core.reference.adapter import describe
    from dspark_core.reference.config import small_config
    from dspark_core.reference.model import DraftModel
    from dspark_cute.cutedsl.context.chain import ContextChain

    model = DraftModel(small_config())
    draft = describe(model)
    c = context_constants(draft)
    assert c.norms.num_layers == 2 and c.store.kv_heads == 2 and c.store.rope
    with pytest.raises(ValueError, match="CUDA"):
        ContextChain.of_draft(draft)
    with pytest.raises(ValueError, match="ContextConstants"):
        ContextChain(c.norms, None, None, draft.context.stacked_kv_weight, None)
    differing = DraftModel(small_config(norm_overrides={"layers.1.input_norm": {"eps": 1e-5}}), device="meta")
    with pytest.raises(Unsupported, match="differ"):
        context_constants(describe(differing))


def test_compile_refused_during_capture(monkeypatch):
    from dspark_cute.cutedsl.context.store import compile_context_store
    from dspark_cute.cutedsl.norms.context_norms import compile_context_norms

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="prepare"):
        compile_context_norms(ContextNormConstants(2048, 1, norm(3), norm(4)), True)
    with pytest.raises(RuntimeError, match="prepare"):
        compile_context_store(ContextStoreConstants(4, 3e-5, True, "fp32"), True)
