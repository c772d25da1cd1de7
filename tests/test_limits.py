"""Every kernel's limits (``dspark_core.contracts.limits.LIMITS``) walked
inside, at and past each bound through the three places that decide on
them, which must agree, in the same words:

- the contract (``limits.unsupported``: what the planner's builders end with);
- the kernel's host class in dspark-cute (what the plugin's build
  constructs): its ``check_constants`` or constructor, on the CPU (the limit
  checks come before any operand needs a GPU);
- the planner (``plan_draft``) and the vLLM plan (``dspark_vllm.planning.
  plan_vllm``, every kernel taken as checked) on a draft whose sizes cross
  the bound, where a draft's config can cross it.

The Markov steps on vLLM's real draft (``python -m dspark_vllm.plan``'s
line and the plugin's build): ``packages/dspark-vllm/tests/
test_vllm_markov.py``. And ``docs/limits.md`` is ``limits_doc.markdown()``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dspark_core.contracts import constants as K
from dspark_core.contracts import limits, limits_doc
from dspark_core.contracts.markov import markov_constants, markov_sample_constants
from dspark_core.errors import Unsupported
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel

ROOT = Path(__file__).resolve().parents[1]
NORM = K.NormConstants(1e-6, None, 0.0, False)
# A valid constants object of every class LIMITS names.
BASES = {
    "NormConstants": K.NormConstants(1e-6, "bf16", 0.0, False),
    "RowNormConstants": K.RowNormConstants(2048, NORM, "bf16", "bf16"),
    "BoundaryConstants": K.BoundaryConstants(2048, NORM, NORM),
    "ContextNormConstants": K.ContextNormConstants(2048, 2, NORM, NORM),
    "ContextStoreConstants": K.ContextStoreConstants(2, 1e-6, True, "bf16"),
    "QKVEpilogueConstants": K.QKVEpilogueConstants(2048, 8, 2, False, 1e-6, 1e-6, True, "bf16"),
    "AttentionConstants": K.AttentionConstants(8, 2, 64, 16),
    "OGateConstants": K.OGateConstants(8, 1e-6),
    "MlpActivationConstants": K.MlpActivationConstants(1024),
    "MarkovConstants": markov_constants(384, 64, 1.0, None, True),
    "MarkovSampleConstants": markov_sample_constants(384, 512, 64, 1.0, None),
    "PackageGemmConstants": K.PackageGemmConstants("o_proj", 2048, 1024, 64, 1, 16),
    "GemvConstants": K.GemvConstants("o_proj", 64, 256),
    "OrderedGemmConstants": K.OrderedGemmConstants("o_proj", 64, 256),
}


def _meta_weight(n: int, k: int) -> torch.Tensor:
    """A BF16 ``[n, k]`` weight on the meta device (any size, nothing allocated)."""
    return torch.empty(n, k, dtype=torch.bfloat16, device="meta")


def _hosts() -> dict:
    """Per constants class, the host-class check the plugin's build runs (a
    tuple: each of the host classes that take them). The GEMMs' host classes
    are constructed over a meta weight: their limit checks come first, then
    the weight's refusal as no CUDA operand (a ValueError: taken here)."""
    from dspark_comm.cutedsl.package_gemm import PackageGemm
    from dspark_comm.cutedsl.package_gemv import PackageGemvKernel
    from dspark_cute.cutedsl.attention import common as attention
    from dspark_cute.cutedsl.context import store
    from dspark_cute.cutedsl.gating import mlp_activation, o_gate
    from dspark_cute.cutedsl.gemm.gemv import Gemv
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemm
    from dspark_cute.cutedsl.markov import greedy, sample
    from dspark_cute.cutedsl.norms import context_norms
    from dspark_cute.cutedsl.norms.boundary import DraftBoundary
    from dspark_cute.cutedsl.norms.row_norm import RowNorm
    from dspark_cute.cutedsl.qkv import epilogue

    gate = torch.ones(2048, dtype=torch.float32)
    return {
        "NormConstants": lambda c: context_norms.check_constants(K.ContextNormConstants(2048, 1, c, c)),
        "RowNormConstants": lambda c: RowNorm(c, None),
        "BoundaryConstants": lambda c: DraftBoundary(c, gate, gate, None, None),
        "ContextNormConstants": context_norms.check_constants,
        "ContextStoreConstants": store.check_constants,
        "QKVEpilogueConstants": epilogue.check_constants,
        "AttentionConstants": attention.check_constants,
        "OGateConstants": o_gate.check_constants,
        "MlpActivationConstants": mlp_activation.check_constants,
        "MarkovConstants": greedy.check_constants,
        "MarkovSampleConstants": sample.check_constants,
        "PackageGemmConstants": lambda c: PackageGemm(c, _meta_weight(c.hidden_size, c.k_shard), pdl=False),
        "GemvConstants": (lambda c: Gemv(c, _meta_weight(c.n, c.k), pdl=False),
                          lambda c: PackageGemvKernel(c, "plain", None, 0, False)),
        "OrderedGemmConstants": lambda c: OrderedGemm(c, _meta_weight(c.n, c.k), pdl=False, sms=132),
    }


def _own_checks() -> dict:
    """Per GEMM constants class, whether the kernel's own checks, without
    the contract, take the constants: the main loops and kernel classes the
    host class builds, at its default launch settings, and the weight checks
    it runs (the package GEMM: ``SkinnyConfig`` at ``4 * split_k`` warps
    and 16 tokens, ``PackageGemmKernel`` of ``tile_n`` rows a CTA; the GEMV:
    ``spec.gemv.gemv_unsupported`` of its weight; the ordered GEMM:
    ``OrderedGemmKernel``'s K and its host class's weight check). A
    ValueError (``Unsupported`` included) or TypeError is a refusal."""
    from dspark_comm.cutedsl import package_gemm as pg
    from dspark_core.contracts.constants import ordered_gemm_unsupported
    from dspark_core.spec.gemv import gemv_unsupported
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemmKernel
    from dspark_cute.cutedsl.gemm.skinny import config as sg

    def package(c) -> bool:
        cfg = sg.SkinnyConfig(c.k_shard, 4 * c.split_k, 1, 2)
        pg.PackageGemmKernel(c.hidden_size, cfg, "plain", None, 0, False, tile_rows=c.tile_n)
        return 1 <= c.max_rows <= sg.MAX_TOKENS

    def ordered(c) -> bool:
        OrderedGemmKernel(c.k, 1, 1, 2, False)
        return ordered_gemm_unsupported(_meta_weight(c.n, c.k)) is None

    return {"PackageGemmConstants": package, "OrderedGemmConstants": ordered,
            "GemvConstants": lambda c: gemv_unsupported(_meta_weight(c.n, c.k)) is None}


def probes(limit: limits.Limit, c) -> list[tuple[str, dict, bool]]:
    """``(label, field changes, taken)`` inside, at and past ``limit`` from
    the valid ``c``, derived from the limit's bounds."""
    f = limit.field
    if limit.choices is not None:
        first = limit.choices[0]
        past = (not first) if isinstance(first, bool) else max(limit.choices) + 1 if isinstance(first, int) else "fp8"
        return [*((f"at {v}", {f: v}, True) for v in limit.choices), (f"past: {past}", {f: past}, False)]
    if limit.requires is not None:
        other = getattr(c, limit.requires)
        return [("inside: off", {f: False, limit.requires: None}, True),
                ("at: on, with it", {f: True, limit.requires: other}, True),
                ("past: on, without it", {f: True, limit.requires: None}, False)]
    if limit.at_most is not None:
        top = getattr(c, limit.at_most)
        return [("inside", {f: top - 8}, True), ("at", {f: top}, True), ("past", {f: top + 8}, False)]
    if limit.groups is not None:
        k = getattr(c, limit.groups)
        return [("inside", {f: 4 * k}, True), ("at", {f: k}, True), ("past", {f: k + 1}, False)]
    scale = 1 if limit.per is None else getattr(c, limit.per)  # bounds per unit of another field
    low, high, step = (None if v is None else v * scale for v in (limit.low, limit.high, limit.multiple))
    found = [("at the least", {f: low}, True), ("past the least", {f: low - step}, False)]
    if high is not None and high != low:
        inside = low + step if not limit.power_of_two else 2 * max(low, 1)
        found += [("inside", {f: inside}, True), ("at the most", {f: high}, True),
                  ("past the most", {f: high * 2 if limit.power_of_two else high + step}, False)]
    if step > 1:
        found.append(("past: not a multiple", {f: low + step // 2}, False))
    if limit.power_of_two and high >= 3:
        found.append(("past: not a power of two", {f: 3}, False))
    return found


def related(owner: str, limit: limits.Limit, value) -> dict:
    """The changes that keep ``owner``'s other limits met while ``limit``'s
    field takes ``value`` (only ``limit`` at stake): a field grouped over it
    or bounded by it follows it (to a multiple its own limits take); another
    field bounding it makes room."""
    changes, c, field, others = {}, BASES[owner], limit.field, limits.LIMITS[owner][1]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return changes
    for other in others:
        if other is limit:
            continue
        step = max(o.multiple for o in others if o.field == other.field)
        if other.groups == field:
            changes[other.field] = value
        elif other.at_most == field:
            changes[other.field] = min(getattr(c, other.field), max(step, value - value % step))
        elif other.field == field and other.at_most is not None:
            changes[other.at_most] = max(getattr(c, other.at_most), value)
    return changes


CASES = [(owner, limit, label, {**related(owner, limit, changes.get(limit.field)), **changes}, taken)
         for owner, (_, lims) in limits.LIMITS.items() for limit in lims
         for label, changes, taken in probes(limit, BASES[owner])]


def _refusal(call, *args) -> str | None:
    """``call``'s Unsupported sentence, or None where it took the constants
    (an operand check after the limits may raise something else)."""
    try:
        call(*args)
    except Unsupported as refusal:
        return str(refusal)
    except (ValueError, TypeError, RuntimeError):
        return None
    return None


@pytest.mark.parametrize(("owner", "limit", "label", "changes", "taken"), CASES,
                         ids=[f"{o}.{lim.field}-{label}" for o, lim, label, _, _ in CASES])
def test_every_limit_agrees_between_the_contract_and_the_host_class(owner, limit, label, changes, taken):
    try:
        c = dataclasses.replace(BASES[owner], **changes)
    except Unsupported as refusal:  # beyond _Key's rules (2^31 - 1, MAX_HEADS): no constants, nowhere fused
        assert not taken, refusal
        return
    contract = limits.unsupported(c)
    hosts = _hosts()[owner]
    assert (contract is None) == taken, contract
    for host in hosts if isinstance(hosts, tuple) else (hosts,):
        assert _refusal(host, c) == contract
    if not taken:
        assert f"{owner}.{limit.field})" in contract or f"{limit.field})" in contract


GEMM_CASES = [case for case in CASES if case[0] in ("PackageGemmConstants", "GemvConstants", "OrderedGemmConstants")]


@pytest.mark.parametrize(("owner", "limit", "label", "changes", "taken"), GEMM_CASES,
                         ids=[f"{o}.{lim.field}-{label}" for o, lim, label, _, _ in GEMM_CASES])
def test_every_gemm_limit_is_the_kernels_own(owner, limit, label, changes, taken):
    """The GEMMs' limits, stated in the contract, are their kernels' own:
    inside, at and past each, the kernel's checks without the contract
    (``_own_checks``) take exactly what the contract takes."""
    try:
        c = dataclasses.replace(BASES[owner], **changes)
    except Unsupported:  # beyond _Key's rules: no constants
        assert not taken
        return
    try:
        own = _own_checks()[owner](c)
    except (ValueError, TypeError):
        own = False
    assert own == taken == (limits.unsupported(c) is None)


def test_the_gemm_limits_are_the_kernels_constants():
    """The units the contract states are those the kernels compute with."""
    from dspark_comm.cutedsl import package_gemm as pg
    from dspark_cute.cutedsl.gemm import gemv, ordered
    from dspark_cute.cutedsl.gemm.skinny import config as sg

    assert limits.PACKAGE_GEMM_TILE_N == pg.TILE_ROWS
    assert limits.PACKAGE_GEMM_K_STEP == sg.STEP_K * limits.PACKAGE_GEMM_WARPS
    assert limits.MAX_DECODE_ROWS == sg.MAX_TOKENS
    assert limits.PACKAGE_GEMM_MAX_K * sg.BETA / (16 * limits.PACKAGE_GEMM_WARPS) == 2.0**-10
    assert (limits.GEMV_K_UNIT, limits.GEMV_N_UNIT) == (gemv.FRAGMENT, gemv.WARPS * gemv.ROWS_PER_WARP)
    assert (limits.ORDERED_GEMM_K_UNIT, limits.ORDERED_GEMM_N_UNIT, limits.ORDERED_GEMM_MAX_ROWS) == (
        ordered.CHUNK, ordered.TILE_ROWS, ordered.MAX_ROWS)
    # No fixed rule of where the ordered GEMM is faster: the build decides by timing.
    assert not [name for name in dir(limits) if "FASTER" in name]


def _reasons(model) -> tuple[dict, dict]:
    """The stock parts' reasons of the planner's plan and the vLLM plan (every kernel checked)."""
    from dspark_vllm.planning import plan_vllm

    target, draft = policy.Target(kernels=policy.ALL_KERNELS), describe(model)
    planned = plan_draft(draft, target)
    vllm = plan_vllm(draft, target, exact=policy.ALL_KERNELS)
    return ({p.name: p.reason for p in planned.parts() if not p.fused},
            {p.name: p.reason for p in vllm.parts() if not p.fused})


@pytest.mark.parametrize(("size", "taken"), [(8, True), (16, True), (12, False), (1001, False)])
def test_the_plans_refuse_an_intermediate_size_as_the_activation_kernel(size, taken):
    from dspark_cute.cutedsl.gating.mlp_activation import check_constants

    model = DraftModel(small_config(), device="meta")
    model.layers[1].mlp.intermediate_size = size
    core, vllm = _reasons(model)
    part = "layer 1's MLP activation"
    host = _refusal(check_constants, K.MlpActivationConstants(size))
    assert core.get(part) == vllm.get(part) == host
    assert (host is None) == taken


@pytest.mark.parametrize(("heads", "kv_heads", "taken"), [(8, 2, True), (32, 32, True), (64, 64, False),
                                                          (6, 3, False)])
def test_the_plans_refuse_kv_heads_as_the_context_store(heads, kv_heads, taken):
    from dspark_cute.cutedsl.context.store import check_constants

    core, vllm = _reasons(DraftModel(small_config(num_heads=heads, num_kv_heads=kv_heads), device="meta"))
    part = "the context K/V chain"
    host = _refusal(check_constants, K.ContextStoreConstants(kv_heads, 1e-6, True, "bf16"))
    assert core.get(part) == vllm.get(part) == host
    assert (host is None) == taken


@pytest.mark.parametrize(("head_dim", "taken"), [(64, True), (128, False)])
def test_the_plans_refuse_a_head_width_as_the_attention_kernel(head_dim, taken):
    from dspark_cute.cutedsl.attention.common import check_constants

    heads = 8 * 64 // head_dim
    core, _ = _reasons(DraftModel(small_config(head_dim=head_dim, num_heads=heads), device="meta"))
    host = _refusal(check_constants, K.AttentionConstants(heads, 2, head_dim, 16))
    assert core.get("layer 0's attention") == host
    assert (host is None) == taken


def test_the_staged_slots_unit_is_the_attention_kernels_lanes():
    """``limits.STAGED_SLOTS_UNIT`` (stated where the limits are, below the
    spec) is the lanes of the attention kernel's CTA that stage the slots."""
    from dspark_core.spec.attention import LANES

    assert limits.STAGED_SLOTS_UNIT == LANES


def test_docs_limits_md_is_the_contracts():
    """``docs/limits.md`` is ``limits_doc.markdown()`` (regenerate it with
    ``python -m dspark_core.contracts.limits_doc > docs/limits.md``)."""
    assert (ROOT / "docs" / "limits.md").read_text() == limits_doc.markdown()
