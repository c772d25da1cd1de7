"""CPU tests of the decode attention kernel (``dspark_cute.attention``): it
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
PTX without spills (the register count is printed)."""

from __future__ import annotations

import re

import pytest
import torch
from cute_testing import audit_forbidden, has_f32_constant

from dspark_core.constants import AttentionConstants
from dspark_cute.attention import PREFETCH_GROUP
from dspark_cute.ptx_audit import code, count, ptxas_report

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
    from dspark_cute.attention import PagedAttentionKernel, fake_args
    from dspark_cute.host import compile_ptx

    h, kv, bs, slot, pdl = variant
    c = AttentionConstants(num_heads=h, kv_heads=kv, head_dim=64, block_size=bs, slot_dtype=slot)
    ptx = compile_ptx(PagedAttentionKernel(c, pdl), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    audit(code(ptx), slot, pdl)
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert "0 bytes spill stores" in report and "0 bytes spill loads" in report, report
        registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
        print(f"{_name(variant)} {arch}: {registers} registers")
        assert registers and max(registers) <= MAX_REGISTERS, report


# ---------------------------------------------------------------- host checks (no GPU needed)


def test_constants_compare_by_value():
    a = AttentionConstants(64, 8, 64, 16, "int64")
    assert a == AttentionConstants(64, 8, 64, 16, "int64") and hash(a) == hash(AttentionConstants(64, 8, 64, 16))
    assert a != AttentionConstants(64, 8, 64, 16, "int32") and a.key() != AttentionConstants(32, 4, 64, 16).key()


def test_constructor_refuses():
    from dspark_cute.attention import PagedAttention, PagedAttentionKernel

    with pytest.raises(ValueError, match="groups over 3 KV heads"):
        PagedAttention(64, 3)
    with pytest.raises(ValueError, match="groups over 0 KV heads"):
        PagedAttention(64, 0)
    with pytest.raises(ValueError, match="heads of 64 columns, not 128"):
        PagedAttention(64, 8, head_dim=128)
    with pytest.raises(ValueError, match="block size of 0"):
        PagedAttention(64, 8, block_size=0)
    with pytest.raises(ValueError, match="int32 or torch.int64"):
        PagedAttention(64, 8, slot_dtype=torch.float32)
    with pytest.raises(ValueError, match="AttentionConstants"):
        PagedAttentionKernel((64, 8), True)
    with pytest.raises(ValueError, match="int32 or int64"):
        PagedAttentionKernel(AttentionConstants(64, 8, 64, 16, "int16"), True)


def test_operands_refused_without_a_gpu():
    """Every operand check runs before any launch; CPU tensors are refused
    with a sentence naming what was expected."""
    from dspark_cute.attention import PagedAttention

    attn = PagedAttention(64, 8, pdl=False)
    q = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16)
    slots = torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous CUDA torch.bfloat16 tensor of \\(2, 64, 64\\)"):
        attn(q, cache, slots)
    with pytest.raises(ValueError, match="q of bf16 \\[m, 64, 64\\] with m >= 1"):
        attn(q[0], cache, slots)
    with pytest.raises(ValueError, match="m >= 1"):
        attn(q[:0], cache, slots)
    with pytest.raises(ValueError, match="q must be a contiguous CUDA"):
        attn(q.to(torch.float16), cache, slots)
    with pytest.raises(ValueError, match="q must be"):
        attn(torch.zeros(2, 32, 64, dtype=torch.bfloat16), cache, slots)


def test_cache_slot_and_out_checks(monkeypatch):
    """The cache, slot and output checks, with the CUDA, device and
    alignment conditions waived (no GPU here): each refusal's sentence."""
    from dspark_cute import attention as mod

    original = mod._check

    def cpu_check(t, shape, dtype, align, device, name):
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype
                and t.is_contiguous()):
            original(t, shape, dtype, align, device, name)

    monkeypatch.setattr(mod, "_check", cpu_check)
    attn = mod.PagedAttention(64, 8, pdl=False)
    q = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16)
    slots = torch.zeros(2, 5, dtype=torch.int64)
    attn.check(q, cache, slots)
    attn.check(q, cache, slots, torch.zeros_like(q))
    with pytest.raises(ValueError, match="the cache must be a PagedKVCache or a bf16 tensor"):
        attn.check(q, torch.zeros(4, 8, 16), slots)
    with pytest.raises(ValueError, match="the cache must be a contiguous CUDA torch.bfloat16 tensor of "
                                         "\\(4, 8, 16, 128\\)"):
        attn.check(q, torch.zeros(4, 8, 8, 128, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="\\(4, 8, 16, 128\\)"):
        attn.check(q, torch.zeros(4, 4, 16, 128, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="1 to 2\\^31 - 1 slots, not 0"):
        attn.check(q, torch.zeros(0, 8, 16, 128, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="attn_slots must be a contiguous CUDA torch.int64 tensor of \\(2, 5\\)"):
        attn.check(q, cache, slots.to(torch.int32))
    with pytest.raises(ValueError, match="attn_slots must be a contiguous CUDA torch.int64"):
        attn.check(q, cache, slots.t().contiguous().t())
    with pytest.raises(ValueError, match="attn_slots must be a torch.int64 tensor of \\[2, S\\] with S >= 1"):
        attn.check(q, cache, torch.zeros(2, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="attn_slots must be a contiguous CUDA torch.int64 tensor of \\(2, 5\\)"):
        attn.check(q, cache, slots.float())
    with pytest.raises(ValueError, match="out must be a contiguous CUDA torch.bfloat16 tensor of \\(2, 64, 64\\)"):
        attn.check(q, cache, slots, torch.zeros(2, 64, 63, dtype=torch.bfloat16))
    # The int32 variant insists on int32 slots.
    attn32 = mod.PagedAttention(64, 8, slot_dtype=torch.int32, pdl=False)
    attn32.check(q, cache, slots.to(torch.int32))
    with pytest.raises(ValueError, match="torch.int32"):
        attn32.check(q, cache, slots)
