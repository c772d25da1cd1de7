"""CPU tests of the decode attention kernel (``dspark_cute.cutedsl.attention.paged``): it
compiles for sm_90a and sm_100a without a GPU, a PTX audit of what it
compiles to, and the host-side refusals.

Compiled (each for sm_90a and sm_100a): the draft's 64 heads over 8 KV heads
(int64 and int32 slots, PDL and not), its TP2 shard (32 over 4), 8 over 8,
16 over 1, and block sizes 16, 1 and 12.

The audit: no ``fma`` (the spec has none), no ``.ftz``, no ``rsqrt``,
``rcp`` or ``.approx``, no saturating conversion, no local memory; every
FP32 add/sub/mul/div with ``.rn``; ``max.NaN.f32`` for the max (1 per slot,
5 butterflies, 3 for the 4 warps); the global loads all 16-byte
``ld.global.v4.b32`` (q, K, V; q and K again where scores are recomputed)
besides the slot loads (``PREFETCH_GROUP`` for the prefetches, one per
pass), one 4-byte output store per lane; the L2 prefetches (the slot
entries, and K and V rows of ``PREFETCH_GROUP`` chunks);
the instruction counts of the spec's arithmetic (scores twice, one
``exp_rn``, the lane sums, the folds); 10 butterflies, 4 barriers; nothing
loaded before the PDL wait. Where ``ptxas`` is installed it must accept the
PTX without spills (the register count is printed).

The opt-in variant (``dspark_cute.cutedsl.attention.staged``: staged K/V, strided q,
the o-gate epilogue), compiled the same way for 7 settings (caps 0 to 768
slots, with and without the o-gate; the o-gate in each stock arithmetic,
FLA's sm_90a and FlashInfer's sm_100a): the same forbidden-instruction audit
outside the o-gate, its own instruction counts (one score and one pass-2
step per staged chunk on top of the default's; the o-gate's squares, norm
and two sigmoids with exactly its arch's approximate instructions and fused
multiply-adds, its 5 butterflies in its arch's order), the expression the
o-gated kernel stores (``test_compile_activations.trace``) the spec's o-gate
of the two BF16-rounded quotients and the gate word, node for node,
``cp.async.cg`` copies and one ``cp.async.wait_all`` where staged, nothing
(``cp.async`` included) before the PDL wait, its shared memory within a
227 KB CTA, no spills. Host side: the default constants keep their key,
the options' refusals, the strided-q and gate checks, the o-gate arch
setting, the compile dispatch."""

from __future__ import annotations

import re

import pytest
import torch
from cute_testing import audit_forbidden, has_f32_constant, refuse
from ptx_audit import code, count, ptxas_report, spill_bytes

from dspark_core.contracts.constants import AttentionConstants
from dspark_core.planner.policy import DEFAULT_STAGED_SLOTS
from dspark_cute.cutedsl.attention.common import PREFETCH_GROUP

ARCHS = ["sm_90a", "sm_100a"]
# (heads, kv heads, block size, slot dtype, pdl)
VARIANTS = [
    (64, 8, 16, "int64", True),
    (64, 8, 16, "int32", True),
    (64, 8, 16, "int64", False),
    (32, 4, 16, "int64", True),
    (8, 8, 16, "int32", True),
    (16, 1, 1, "int64", True),
    (8, 2, 12, "int32", False),
]
# Registers the draft's variant may use: 3 CTAs of 128 threads per SM.
MAX_REGISTERS = 168


def _name(v) -> str:
    h, kv, bs, slot, pdl = v
    return f"h{h}-kv{kv}-bs{bs}-{slot}{'-pdl' if pdl else ''}"


def audit(body: str, slot: str, pdl: bool) -> None:
    audit_forbidden(body, no_rcp=True, explicit_rounding=True)
    # The max: NaN-propagating, per slot, 5 butterflies, (m0, m2), (m1, m3), the two.
    assert count(body, r"\bmax\.NaN\.f32\b") == 9
    assert not re.search(r"\bmax(\.\w+)*\.f32\b", body.replace("max.NaN.f32", "")), "a max that drops NaN"
    # Global memory: q, K (pass 1), V, and q + K where a score is recomputed,
    # 8 16-byte loads each; one slot load per pass; one 4-byte store per lane.
    assert count(body, r"\bld\.global\.v4\.b32\b") == 5 * 8
    wide = "s64" if slot == "int64" else "s32"
    assert count(body, rf"\bld\.global\.{wide}\b") == 2 + PREFETCH_GROUP
    assert set(re.findall(r"\b(?:ld|st)\.global[.\w]*", body)) == {
        "ld.global.v4.b32", f"ld.global.{wide}", "st.global.b32"
    }
    # L2 prefetches: the slot entries, then each valid slot's K and V rows.
    assert count(body, r"\bprefetch\.global\.L2\b") == 1 + 2 * PREFETCH_GROUP
    assert count(body, r"\bst\.global\.b32\b") == 1
    # Arithmetic: a score is 64 products, 32 pair sums, 31 fold sums and the
    # scale (twice: pass 1 and the recompute); exp_rn 12 products, 6 sums, 3
    # differences; p * v 64 products and 64 sums, l one sum; the folds: l 5 +
    # 3, each of a thread's 2 columns 31, then 3 per output column (2).
    assert count(body, r"\bmul\.rn\.f32\b") == 2 * 65 + 12 + 64
    assert count(body, r"\badd\.rn\.f32\b") == 2 * 63 + 6 + 65 + 8 + 2 * 31 + 2 * 3
    assert count(body, r"\bsub\.rn\.f32\b") == 1 + 3
    assert count(body, r"\bdiv\.rn\.f32\b") == 2
    assert count(body, r"\bcvt\.rni\.f32\.f32\b") == 1 and count(body, r"\bcvt\.rmi\.f32\.f32\b") == 1
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == 1
    assert count(body, r"\bshfl\.sync\.bfly\.b32\b") == 10
    assert count(body, r"\bbar\.sync\b") == 4
    # The lane sums transposed through shared memory: 16 16-byte stores, 32
    # 8-byte loads per thread.
    assert count(body, r"\bst\.shared\.v4\.f32\b") == 16
    assert count(body, r"\bld\.shared\.v2\.f32\b") == 32 + 4
    assert has_f32_constant(body, 0x3E000000), "SCALE = 0.125"
    if pdl:
        head, sep, tail = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert "ld.global" not in head and "prefetch" not in head, "a load before the PDL wait"
        _, sep, after = tail.partition("griddepcontrol.launch_dependents")
        assert sep and "ld.global" not in after, "the next grid released before the last load"
    else:
        assert "griddepcontrol" not in body


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_attention_compiles(arch, variant, tmp_path):
    from dspark_cute.cutedsl.attention.direct import DirectAttentionKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    h, kv, bs, slot, pdl = variant
    c = AttentionConstants(num_heads=h, kv_heads=kv, head_dim=64, block_size=bs, slot_dtype=slot)
    ptx = compile_ptx(DirectAttentionKernel(c, pdl), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    audit(code(ptx), slot, pdl)
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == spill_bytes(report, "spill loads") == 0, report
        registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
        print(f"{_name(variant)} {arch}: {registers} registers")
        assert registers and max(registers) <= MAX_REGISTERS, report


# ---------------------------------------------------------------- host checks (no GPU needed)


def test_constants_compare_by_value():
    a = AttentionConstants(64, 8, 64, 16, "int64")
    assert a == AttentionConstants(64, 8, 64, 16, "int64") and hash(a) == hash(AttentionConstants(64, 8, 64, 16))
    assert a != AttentionConstants(64, 8, 64, 16, "int32") and a.key() != AttentionConstants(32, 4, 64, 16).key()


def test_constructor_refuses():
    from dspark_cute.cutedsl.attention.direct import DirectAttentionKernel
    from dspark_cute.cutedsl.attention.paged import PagedAttention

    with pytest.raises(ValueError, match=r"groups over the KV heads, not 64 \(kv_heads 3\)"):
        PagedAttention(AttentionConstants(64, 3, 64, 16))
    with pytest.raises(ValueError, match="at least one KV head, not 0"):
        PagedAttention(AttentionConstants(64, 0, 64, 16))
    with pytest.raises(ValueError, match="heads of 64 columns, not 128"):
        PagedAttention(AttentionConstants(64, 8, 128, 16))
    with pytest.raises(ValueError, match="block size of 1 or more, not 0"):
        PagedAttention(AttentionConstants(64, 8, 64, 0))
    with pytest.raises(ValueError, match="int32 or int64, not float32"):
        PagedAttention(AttentionConstants(64, 8, 64, 16, "float32"))
    with pytest.raises(ValueError, match="AttentionConstants"):
        PagedAttention((64, 8))
    with pytest.raises(ValueError, match="AttentionConstants"):
        DirectAttentionKernel((64, 8), True)
    with pytest.raises(ValueError, match="int32 or int64"):
        DirectAttentionKernel(AttentionConstants(64, 8, 64, 16, "int16"), True)


def test_operands_refused_without_a_gpu():
    """Every operand check runs before any launch; CPU tensors are refused
    with a sentence naming what was expected."""
    from dspark_cute.cutedsl.attention.paged import PagedAttention

    attn = PagedAttention(AttentionConstants(64, 8, 64, 16), pdl=False)
    q = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16)
    slots = torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous CUDA torch.bfloat16 tensor of \\(2, 64, 64\\)"):
        attn.run(q, cache, slots)
    with pytest.raises(ValueError, match="q of bf16 \\[m, 64, 64\\] with m >= 1"):
        attn.run(q[0], cache, slots)
    with pytest.raises(ValueError, match="m >= 1"):
        attn.run(q[:0], cache, slots)
    with pytest.raises(ValueError, match="q must be a contiguous CUDA"):
        attn.run(q.to(torch.float16), cache, slots)
    with pytest.raises(ValueError, match="q must be"):
        attn.run(torch.zeros(2, 32, 64, dtype=torch.bfloat16), cache, slots)


def test_cache_slot_and_out_checks(monkeypatch):
    """The cache, slot and output checks, with the CUDA, device and
    alignment conditions waived (no GPU here): each refusal's sentence."""
    from dspark_cute.cutedsl.attention import paged as mod

    original = mod._check

    def cpu_check(t, shape, dtype, align, device, name):
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype
                and t.is_contiguous()):
            original(t, shape, dtype, align, device, name)

    monkeypatch.setattr(mod, "_check", cpu_check)
    attn = mod.PagedAttention(AttentionConstants(64, 8, 64, 16), pdl=False)
    q = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16)
    slots = torch.zeros(2, 5, dtype=torch.int64)
    refuse(attn, q, cache, slots)
    refuse(attn, q, cache, slots, torch.zeros_like(q))
    with pytest.raises(ValueError, match="the cache must be a PagedKVCache or a bf16 tensor"):
        refuse(attn, q, torch.zeros(4, 8, 16), slots)
    with pytest.raises(ValueError, match="the cache must be a contiguous CUDA torch.bfloat16 tensor of "
                                         "\\(4, 8, 16, 128\\)"):
        refuse(attn, q, torch.zeros(4, 8, 8, 128, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="\\(4, 8, 16, 128\\)"):
        refuse(attn, q, torch.zeros(4, 4, 16, 128, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="1 to 2\\^31 - 1 slots, not 0"):
        refuse(attn, q, torch.zeros(0, 8, 16, 128, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="attn_slots must be a contiguous CUDA torch.int64 tensor of \\(2, 5\\)"):
        refuse(attn, q, cache, slots.to(torch.int32))
    with pytest.raises(ValueError, match="attn_slots must be a contiguous CUDA torch.int64"):
        refuse(attn, q, cache, slots.t().contiguous().t())
    with pytest.raises(ValueError, match="attn_slots must be a torch.int64 tensor of \\[2, S\\] with S >= 1"):
        refuse(attn, q, cache, torch.zeros(2, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="attn_slots must be a contiguous CUDA torch.int64 tensor of \\(2, 5\\)"):
        refuse(attn, q, cache, slots.float())
    with pytest.raises(ValueError, match="out must be a contiguous CUDA torch.bfloat16 tensor of \\(2, 64, 64\\)"):
        refuse(attn, q, cache, slots, torch.zeros(2, 64, 63, dtype=torch.bfloat16))
    # The int32 variant insists on int32 slots.
    attn32 = mod.PagedAttention(AttentionConstants(64, 8, 64, 16, "int32"), pdl=False)
    refuse(attn32, q, cache, slots.to(torch.int32))
    with pytest.raises(ValueError, match="torch.int32"):
        refuse(attn32, q, cache, slots)


# ---------------------------------------------------------------- the opt-in variant (attention_v2)

# (heads, kv heads, block size, slot dtype, pdl, staged slots, o-gate eps)
V2_VARIANTS = [
    (64, 8, 16, "int64", True, 384, None),
    (64, 8, 16, "int64", True, 384, 1e-6),
    (64, 8, 16, "int32", False, 256, 1e-5),
    (32, 4, 16, "int64", True, 768, None),
    (64, 8, 16, "int64", True, 0, 1e-6),
    (16, 1, 1, "int64", True, 128, 0.0),
    (8, 2, 12, "int32", False, 512, None),
]


def _v2_name(v) -> str:
    h, kv, bs, slot, pdl, staged, eps = v
    return f"h{h}-kv{kv}-bs{bs}-{slot}{'-pdl' if pdl else ''}-staged{staged}-gate{eps}"


# (variant, o-gate arch): every variant, the gated ones in both stock o-gates.
V2_CASES = [(v, og) for v in V2_VARIANTS for og in (["sm_90a", "sm_100a"] if v[-1] is not None else [None])]

# The o-gate epilogue's instructions per lane (2 columns), by arch: its fused
# multiply-adds and approximate instructions (pattern -> count), its rounded
# products and sums, its butterflies in order.
EPILOGUE_ALLOWED = {
    "sm_90a": {r"\bfma\.rn\.f32\b": 2, r"\bsqrt\.approx\.ftz\.f32\b": 1, r"\bdiv\.full\.f32\b": 3,
               r"\bex2\.approx\.f32\b": 2},
    "sm_100a": {r"\bfma\.rn\.f32\b": 1, r"\brsqrt\.approx\.ftz\.f32\b": 1, r"\bex2\.approx\.ftz\.f32\b": 2,
                r"\brcp\.approx\.ftz\.f32\b": 2},
}
# sm_90a: 1 square, 2 x * rstd, 2 z, 2 h * sig; 5 butterfly sums, 2 (e + 1).
# sm_100a: 2 squares, 2, 2, 2; 1 pair sum, 5 butterfly sums, 2.
EPILOGUE_ROUNDED = {"sm_90a": (7, 7), "sm_100a": (8, 8)}
EPILOGUE_SHUFFLES = {"sm_90a": ["1", "16", "8", "4", "2"], "sm_100a": ["1", "2", "4", "8", "16"]}


def _find(node, pred):
    """The first node of the tree ``node`` (depth first) that satisfies ``pred``, or None."""
    seen = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, tuple) or id(n) in seen:
            continue
        seen.add(id(n))
        if pred(n):
            return n
        stack.extend(reversed(n[1:]))
    return None


def _smem(node) -> set:
    """The shared-load indices in the tree ``node``."""
    found, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        if isinstance(n, tuple) and id(n) not in seen:
            seen.add(id(n))
            if n[0] == "smem":
                found.add(n[1])
            else:
                stack.extend(n[1:])
    return found


def audit_epilogue(body: str, eps: float, og_arch: str) -> str:
    """The o-gate epilogue of ``og_arch`` in the variant's PTX: the stored
    word's expression is the spec's o-gate of the BF16-rounded quotients
    ``(R0, R1)`` and the gate word (node for node), the butterflies in its
    order; returns ``body`` without its fused multiply-adds and approximate
    instructions (each counted exactly)."""
    from test_compile_activations import NEG_LOG2E, expected_o_gate_words, hi16, lo16, trace, without

    stores = trace(body)
    assert len(stores) == 1 and len(stores[0]) == 1
    word = stores[0][0]
    x_word = _find(word, lambda n: n[0] == "bf16x2" and all(a[0] == "div.rn" for a in n[1:]))
    z = _find(word, lambda n: n[0] == "mul.rn" and n[2] == NEG_LOG2E)
    assert x_word is not None and z is not None and z[1][0] in ("lo16", "hi16") and z[1][1][0] == "ld"
    gate_word = z[1][1]
    # Column 2l's quotient (the first word of each ld.shared.v2 of the warp
    # sums) is the low half of the rounded pair.
    assert min(_smem(x_word[2][1])) < min(_smem(x_word[1][1])), "the quotients' columns swapped"
    expected = expected_o_gate_words([lo16(x_word), hi16(x_word)], [lo16(gate_word), hi16(gate_word)], eps,
                                     og_arch)
    assert word == expected[0], "the o-gate epilogue's expression is not the spec's"
    shuffles = re.findall(r"\bshfl\.sync\.bfly\.b32\s+%\w+, %\w+, (\d+), 31, -1;", body)
    assert shuffles[-5:] == EPILOGUE_SHUFFLES[og_arch], shuffles
    for pattern, n in EPILOGUE_ALLOWED[og_arch].items():
        body = without(body, pattern, n)
    return body


def audit_v2(body: str, slot: str, pdl: bool, staged: int, eps, og_arch=None) -> None:
    """The variant's PTX: ``audit``'s rules with its counts. ``C`` staged
    chunks (unrolled) and the default's path past them: scores C + 2 (the
    staged ones, the path past the cap, its recompute), pass-2 steps C + 1;
    with the o-gate (``G``) of ``og_arch``: ``audit_epilogue``, then its
    squares, norm and two sigmoids."""
    from dspark_cute.cutedsl.attention.staged import COPY_GROUP

    c, g = staged // 128, int(eps is not None)
    gm, ga = EPILOGUE_ROUNDED[og_arch] if g else (0, 0)
    if g:
        body = audit_epilogue(body, eps, og_arch)
    audit_forbidden(body, no_rcp=True, explicit_rounding=True)
    assert count(body, r"\bmax\.NaN\.f32\b") == c + 9
    assert not re.search(r"\bmax(\.\w+)*\.f32\b", body.replace("max.NaN.f32", "")), "a max that drops NaN"
    # Global memory: q, K and V past the cap, q + K recomputed; the slot
    # table (C), one slot load per pass past the cap, the prefetches'; the
    # gate word; one 4-byte store per lane.
    assert count(body, r"\bld\.global\.v4\.b32\b") == 5 * 8
    wide = "s64" if slot == "int64" else "s32"
    assert count(body, rf"\bld\.global\.{wide}\b") == c + 2 + PREFETCH_GROUP
    assert count(body, r"\bld\.global\.b32\b") == g
    expected = {"ld.global.v4.b32", f"ld.global.{wide}", "st.global.b32"} | ({"ld.global.b32"} if g else set())
    assert set(re.findall(r"\b(?:ld|st)\.global[.\w]*", body)) == expected
    assert count(body, r"\bst\.global\.b32\b") == 1
    assert count(body, r"\bprefetch\.global\.L2\b") == 1 + 2 * PREFETCH_GROUP
    # The staging: COPY_GROUP rows' K and V per copy step, 16 bytes each, one wait.
    assert count(body, r"\bcp\.async\.cg\.shared\.global\b") == (2 * COPY_GROUP if c else 0)
    assert count(body, r"\bcp\.async\.wait_all\b") == (1 if c else 0)
    assert count(body, r"\bld\.shared\.v4\.b32\b") == 16 * c
    assert count(body, r"\bld\.shared\.s32\b") == (COPY_GROUP + 2 * c if c else 0)
    assert count(body, r"\bst\.shared\.b32\b") == c
    # Arithmetic (audit's terms): scores 65 products and 63 sums each;
    # pass-2 steps 76 products, 71 sums, 4 differences; the folds; the
    # o-gate's (EPILOGUE_ROUNDED), no difference, quotient or exp_rn of its own.
    assert count(body, r"\bmul\.rn\.f32\b") == (c + 2) * 65 + (c + 1) * 76 + gm
    assert count(body, r"\badd\.rn\.f32\b") == (c + 2) * 63 + (c + 1) * 71 + 8 + 2 * 31 + 2 * 3 + ga
    assert count(body, r"\bsub\.rn\.f32\b") == 4 * (c + 1)
    assert count(body, r"\bdiv\.rn\.f32\b") == 2
    assert count(body, r"\bsqrt\.rn\.f32\b") == 0
    assert count(body, r"\bcvt\.rni\.f32\.f32\b") == c + 1
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == 1 + g
    assert count(body, r"\bshfl\.sync\.bfly\.b32\b") == 10 + 5 * g
    assert count(body, r"\bbar\.sync\b") == 4 + (2 if c else 0)
    assert count(body, r"\bst\.shared\.v4\.f32\b") == 16
    assert count(body, r"\bld\.shared\.v2\.f32\b") == 32 + 4
    assert has_f32_constant(body, 0x3E000000), "SCALE = 0.125"
    if pdl:
        head, sep, tail = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert not re.search(r"ld\.global|prefetch|cp\.async", head), "a load before the PDL wait"
        _, sep, after = tail.partition("griddepcontrol.launch_dependents")
        assert sep and "ld.global" not in after and "cp.async" not in after, "the next grid released too early"
    else:
        assert "griddepcontrol" not in body


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant,og_arch", V2_CASES, ids=lambda v: _v2_name(v) if isinstance(v, tuple) else str(v))
def test_attention_v2_compiles(arch, variant, og_arch, tmp_path):
    from dspark_cute.cutedsl.attention.staged import StagedAttentionKernel, fake_staged_args, smem_layout
    from dspark_cute.runtime.host import compile_ptx

    h, kv, bs, slot, pdl, staged, eps = variant
    c = AttentionConstants(h, kv, 64, bs, slot, staged_slots=staged, o_gate_eps=eps)
    kernel = StagedAttentionKernel(c, pdl) if og_arch is None else StagedAttentionKernel(c, pdl, og_arch)
    ptx = compile_ptx(kernel, *fake_staged_args(c), arch=arch)
    assert f".target {arch}" in ptx
    audit_v2(code(ptx), slot, pdl, staged, eps, og_arch)
    # The shared memory fits an H200 / B200 CTA (227 KB).
    assert smem_layout(c).total <= 227 * 1024
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == spill_bytes(report, "spill loads") == 0, report
        registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
        print(f"{_v2_name(variant)} {arch}: {registers} registers, {smem_layout(c).total} bytes of shared memory")
        assert registers and max(registers) <= MAX_REGISTERS, report


def test_v2_constants_keep_the_default_key():
    """The options off: the five fields alone decide equality, hash and
    ``key()`` (the key the default had before the options existed)."""
    import hashlib

    a = AttentionConstants(64, 8, 64, 16, "int64")
    old = hashlib.sha256(repr(("AttentionConstants", (64, 8, 64, 16, "int64"))).encode()).hexdigest()[:16]
    assert a.key() == old and a.is_default
    assert a == AttentionConstants(64, 8, 64, 16, "int64", 0, None)
    staged = AttentionConstants(64, 8, 64, 16, "int64", staged_slots=384)
    gated = AttentionConstants(64, 8, 64, 16, "int64", o_gate_eps=1e-6)
    keys = {a.key(), staged.key(), gated.key(), AttentionConstants(64, 8, 64, 16, "int64", 384, 1e-6).key()}
    assert len(keys) == 4 and not staged.is_default and not gated.is_default
    assert gated == AttentionConstants(64, 8, 64, 16, "int64", o_gate_eps=1e-6) and hash(gated) == hash(
        AttentionConstants(64, 8, 64, 16, "int64", o_gate_eps=1e-6))
    assert AttentionConstants(64, 8, 64, 16, o_gate_eps=0.0) != AttentionConstants(64, 8, 64, 16, o_gate_eps=-0.0)


def test_v2_constructor_refuses():
    from dspark_cute.cutedsl.attention.direct import DirectAttentionKernel
    from dspark_cute.cutedsl.attention.paged import PagedAttention
    from dspark_cute.cutedsl.attention.staged import StagedAttentionKernel

    with pytest.raises(ValueError, match="multiple of 128 up to 768, not 200"):
        PagedAttention(AttentionConstants(64, 8, 64, 16, staged_slots=200))
    with pytest.raises(ValueError, match="up to 768, not 896"):
        PagedAttention(AttentionConstants(64, 8, 64, 16, staged_slots=896))
    with pytest.raises(ValueError, match="up to 768, not -128"):
        PagedAttention(AttentionConstants(64, 8, 64, 16, staged_slots=-128))
    with pytest.raises(ValueError, match="non-negative number finite in FP32.*not -1.0"):
        PagedAttention(AttentionConstants(64, 8, 64, 16, o_gate_eps=-1.0))
    with pytest.raises(ValueError, match="non-negative number finite in FP32.*not nan"):
        PagedAttention(AttentionConstants(64, 8, 64, 16, o_gate_eps=float("nan")))
    with pytest.raises(ValueError, match="StagedAttentionKernel"):
        DirectAttentionKernel(AttentionConstants(64, 8, 64, 16, staged_slots=384), True)
    with pytest.raises(ValueError, match="default constants compile DirectAttentionKernel"):
        StagedAttentionKernel(AttentionConstants(64, 8, 64, 16), True)
    k = PagedAttention(AttentionConstants(64, 8, 64, 16, staged_slots=DEFAULT_STAGED_SLOTS))
    assert k.constants.staged_slots == 384 and k.takes_strided_q and not k.gated
    assert not PagedAttention(AttentionConstants(64, 8, 64, 16)).takes_strided_q
    g = PagedAttention(AttentionConstants(64, 8, 64, 16, o_gate_eps=1e-6))
    assert g.constants.staged_slots == 0 and g.gated and g.constants.o_gate_eps == 1e-6


def test_o_gate_arch_setting(monkeypatch):
    """The o-gate epilogue's arch: the constructor's, else the constants'
    (``AttentionConstants.o_gate_arch``, which the planner sets from its
    target); None without the o-gate; anything but sm_90a / sm_100a refused."""
    from dspark_core.errors import Unsupported
    from dspark_cute.cutedsl.attention import paged as mod
    from dspark_cute.cutedsl.attention.staged import StagedAttentionKernel

    gated = AttentionConstants(64, 8, 64, 16, staged_slots=384, o_gate_eps=1e-6)
    assert mod.PagedAttention(gated, o_gate_arch="sm_100a").o_gate_arch == "sm_100a"
    assert mod.PagedAttention(gated, o_gate_arch="sm_90a").o_gate_arch == "sm_90a"
    assert mod.PagedAttention(AttentionConstants(64, 8, 64, 16, staged_slots=384), o_gate_arch="sm_100a"
                              ).o_gate_arch is None
    assert mod.PagedAttention(gated).o_gate_arch == "sm_90a"  # the constants' default
    blackwell = AttentionConstants(64, 8, 64, 16, staged_slots=384, o_gate_eps=1e-6, o_gate_arch="sm_100a")
    assert mod.PagedAttention(blackwell).o_gate_arch == "sm_100a"
    assert blackwell != gated and blackwell.key() != gated.key()
    for bad in ("sm_80", "sm_90", "sm_100"):
        with pytest.raises(Unsupported, match="no stock o-gate is known"):
            mod.PagedAttention(gated, o_gate_arch=bad)
        with pytest.raises(Unsupported, match="no stock o-gate is known"):
            StagedAttentionKernel(gated, True, bad)


def test_v2_operand_checks(monkeypatch):
    """The strided q and the gate (CUDA, device and alignment waived, no GPU
    here): the QKV output's column slices are taken, other layouts refused."""
    from dspark_cute.cutedsl.attention import paged as mod

    original = mod._check

    def cpu_check(t, shape, dtype, align, device, name):
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype
                and t.is_contiguous()):
            original(t, shape, dtype, align, device, name)

    monkeypatch.setattr(mod, "_check", cpu_check)
    monkeypatch.setattr(mod, "_check_place", lambda t, align, device, name: None)
    cache = torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16)
    slots = torch.zeros(2, 5, dtype=torch.int64)
    qkv = torch.zeros(2, 9216, dtype=torch.bfloat16)  # [q 4096 | k 512 | v 512 | gate 4096]
    q = qkv[:, :4096].view(2, 64, 64)
    gate = qkv[:, 5120:]
    staged = mod.PagedAttention(AttentionConstants(64, 8, 64, 16, staged_slots=DEFAULT_STAGED_SLOTS), pdl=False)
    gated = mod.PagedAttention(
        AttentionConstants(64, 8, 64, 16, staged_slots=DEFAULT_STAGED_SLOTS, o_gate_eps=1e-6), pdl=False)
    refuse(staged, q, cache, slots)
    refuse(staged, q.contiguous(), cache, slots, torch.zeros(2, 64, 64, dtype=torch.bfloat16))
    refuse(gated, q, cache, slots, gate=gate)
    refuse(gated, q, cache, slots, gate=gate.view(2, 64, 64))
    refuse(gated, q[:1], cache, slots[:1], gate=gate[:1])
    assert mod.row_stride(q, [(2, 64, 64)], "q") == 9216
    with pytest.raises(ValueError, match="q must be a contiguous CUDA"):
        # The default kernel: contiguous q only.
        refuse(mod.PagedAttention(AttentionConstants(64, 8, 64, 16), pdl=False), q, cache, slots)
    with pytest.raises(ValueError, match="q must be a bf16 tensor of \\(2, 64, 64\\) with contiguous rows"):
        refuse(staged, q.transpose(1, 2), cache, slots)
    with pytest.raises(ValueError, match="row stride that is a multiple of 8"):
        refuse(staged, torch.zeros(2, 9220, dtype=torch.bfloat16)[:, :4096].view(2, 64, 64), cache, slots)
    with pytest.raises(ValueError, match="q must be a bf16 tensor"):
        refuse(staged, q.float(), cache, slots)
    with pytest.raises(ValueError, match="gate must be None"):
        refuse(staged, q, cache, slots, gate=gate)
    with pytest.raises(ValueError, match="the gate must be a bf16 tensor of \\(2, 64, 64\\) or \\(2, 4096\\)"):
        refuse(gated, q, cache, slots)
    with pytest.raises(ValueError, match="the gate must be a bf16 tensor"):
        refuse(gated, q, cache, slots, gate=gate[:, :4032])
    with pytest.raises(ValueError, match="the gate must be a bf16 tensor"):
        refuse(gated, q, cache, slots, gate=gate[:1])
    with pytest.raises(ValueError, match="the gate must be a bf16 tensor"):
        refuse(gated, q, cache, slots, gate=gate.view(2, 64, 64).transpose(1, 2))


def test_compile_dispatch(monkeypatch):
    """``compile_attention`` compiles the direct kernel for the default
    constants and the staged one for an option on, keyed apart (the compile
    itself stubbed: no GPU here)."""
    from dspark_cute.cutedsl.attention import direct
    from dspark_cute.cutedsl.attention import paged as mod
    from dspark_cute.cutedsl.attention import staged as staged_mod
    from dspark_cute.runtime import host

    def fake_compile(obj, *args, what=None, options=None):
        return type(obj).__name__, len(args)

    monkeypatch.setattr(direct.compile_direct_attention, "cache", {})
    monkeypatch.setattr(staged_mod.compile_staged_attention, "cache", {})
    monkeypatch.setattr(host, "compile_kernel", fake_compile)
    default = AttentionConstants(64, 8, 64, 16)
    staged = AttentionConstants(64, 8, 64, 16, staged_slots=384, o_gate_eps=1e-6)
    assert mod.compile_attention(default, True) == ("DirectAttentionKernel", 8)
    assert mod.compile_attention(staged, True) == ("StagedAttentionKernel", 11)
    assert len(direct.compile_direct_attention.cache) == len(staged_mod.compile_staged_attention.cache) == 1
    # The o-gate's arch is a variant of its own; an ungated variant ignores it.
    mod.compile_attention(staged, True, "sm_90a")
    assert len({id(k) for k in staged_mod.compile_staged_attention.cache.values()}) == 1
    mod.compile_attention(staged, True, "sm_100a")
    assert len({id(k) for k in staged_mod.compile_staged_attention.cache.values()}) == 2
    ungated = AttentionConstants(64, 8, 64, 16, staged_slots=384)
    mod.compile_attention(ungated, True, "sm_90a")
    mod.compile_attention(ungated, True, "sm_100a")
    assert len({id(k) for k in staged_mod.compile_staged_attention.cache.values()}) == 3
    built = []
    monkeypatch.setattr(staged_mod.StagedAttentionKernel, "__init__",
                        lambda self, c, pdl, arch="sm_90a": built.append(arch) or None)
    monkeypatch.setattr(staged_mod.compile_staged_attention, "cache", {})
    mod.PagedAttention(staged, pdl=True, o_gate_arch="sm_100a").prepare()
    mod.PagedAttention(ungated, pdl=True, o_gate_arch="sm_100a").prepare()
    assert built == ["sm_100a", "sm_90a"]
