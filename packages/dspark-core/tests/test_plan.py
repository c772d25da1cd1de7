"""The planner: one test per refusal reason, the fused plan of the reference
draft, determinism, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dspark_core.contracts import constants as K
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft as plan_description
from dspark_core.planner.policy import Target
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig, small_config
from dspark_core.reference.model import DraftAttention, DraftModel
from dspark_core.reference.tp import shard_draft
from dspark_core.spec.layers import GatedResidual, HeadNorm, RMSNorm, Rotary


def plan_draft(model, target=None):
    """The plan of a reference draft: the planner over its description."""
    return plan_description(describe(model), target)

ALL = Target(kernels=policy.ALL_KERNELS)


def meta(**changes) -> DraftModel:
    return DraftModel(small_config(**changes), device="meta")


def reasons(plan) -> dict[str, str]:
    return {p.name: p.reason for p in plan.parts() if not p.fused}


def test_reference_plan_fuses_every_part_at_tp1():
    plan = plan_draft(DraftModel(DraftConfig(), device="meta"), ALL)
    assert plan.draft_reason is None
    assert reasons(plan) == {}
    assert plan.all_reduce is None  # TP1 has no all-reduce: no part for it
    assert len(plan.boundaries) == 4 and len(plan.qkv_epilogues) == 2
    assert all(isinstance(b.constants, K.BoundaryConstants) for b in plan.boundaries)
    assert plan.input_norm.constants.hidden_size == 8192


def test_reference_plan_at_tp2_fuses_the_all_reduce_and_package_gemms():
    plan = plan_draft(DraftModel(DraftConfig(), device="meta"), ALL.replace(tp=2))
    assert reasons(plan) == {}
    assert plan.all_reduce.constants == K.AllReduceConstants(2)
    roles = [p.constants.role for p in plan.package_gemms]
    assert roles == ["o_proj", "down_proj"] * 2
    # o_proj takes the rank's shard of the heads, down_proj of the MLP.
    assert plan.package_gemms[0].constants.k_shard == 64 * 64 // 2
    assert plan.package_gemms[1].constants.k_shard == 16384 // 2
    # Shards this wide run on the ring main loop (policy.draft_gemm_shape).
    assert {p.constants.tile_n for p in plan.package_gemms} == {64}


def test_reference_plan_at_tp8_puts_short_shards_on_the_direct_main_loop():
    plan = plan_draft(DraftModel(DraftConfig(), device="meta"), ALL.replace(tp=8))
    assert reasons(plan) == {}
    shapes = {(p.constants.role, p.constants.k_shard, p.constants.tile_n) for p in plan.package_gemms}
    # o_proj's shard (512: 4 steps of 4 warps) and down_proj's (2048: 8 steps
    # of 8 warps) are within policy.DIRECT_MAX_STEPS.
    assert shapes == {("o_proj", 512, 16), ("down_proj", 2048, 16)}


@pytest.mark.parametrize(
    "target, why",
    [
        (Target(platform="cpu"), "not CUDA"),
        (Target(arch="sm_80"), "architecture sm_80, not one of sm_90a, sm_100a"),
    ],
)
def test_whole_draft_refusals_by_target(target, why):
    plan = plan_draft(meta(), target)
    assert plan.draft_reason == why
    assert plan.parts() == []
    assert plan.refused() == [f"the whole draft keeps its stock layers: {why}"]


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"compute_dtype": "fp16"}, "compute dtype torch.float16, not bfloat16"),
        ({"residual_dtype": "bf16"}, "residual dtype torch.bfloat16, not float32"),
    ],
)
def test_whole_draft_refusals_by_dtype(changes, why):
    assert plan_draft(meta(**changes), ALL).draft_reason == why


def test_boundary_refuses_a_non_fp32_connection():
    model = meta(connection_overrides={"layers.1.add_attn": {"dtype": "bf16"}})
    r = reasons(plan_draft(model, ALL))
    assert r["layer 1's attention boundary"] == "a residual alpha other than a contiguous FP32 [2048] vector"
    assert "layer 0's attention boundary" not in r


def test_boundary_refuses_a_connection_subclass():
    class Scaled(GatedResidual):
        def forward(self, stream, branch):
            return super().forward(stream, branch) * 2

    model = meta()
    model.layers[0].add_ffn = Scaled(2048).to_empty(device="meta")
    r = reasons(plan_draft(model, ALL))
    assert r["layer 0's feed-forward boundary"] == "a residual connection other than the stock gated one (Scaled)"


def test_boundary_refuses_a_norm_subclass():
    class LayerNormish(RMSNorm):
        pass

    model = meta()
    model.layers[1].pre_ffn_norm = LayerNormish(2048).to_empty(device="meta")
    r = reasons(plan_draft(model, ALL))
    assert r["layer 1's attention boundary"] == "a norm other than the stock RMSNorm (LayerNormish)"


def test_boundary_refuses_a_float64_weight_and_a_strided_weight():
    model = meta()
    model.layers[0].post_attn_norm.weight = nn.Parameter(torch.empty(2048, dtype=torch.float64, device="meta"))
    model.layers[1].post_attn_norm.weight = nn.Parameter(
        torch.empty(4096, dtype=torch.bfloat16, device="meta")[::2], requires_grad=False
    )
    r = reasons(plan_draft(model, ALL))
    assert r["layer 0's attention boundary"] == "a norm weight of torch.float64, not BF16, FP16 or FP32"
    assert r["layer 1's attention boundary"] == "a norm weight other than a contiguous [2048] vector"


def test_boundary_refuses_a_pre_norm_that_outputs_fp32():
    model = meta()
    model.norm.out_dtype = torch.float32
    r = reasons(plan_draft(model, ALL))
    assert r["layer 1's feed-forward boundary"] == "a next pre-norm that outputs torch.float32, not BF16"


def test_first_norm_refuses_an_fp32_output():
    model = meta()
    model.layers[0].input_norm.out_dtype = torch.float32
    r = reasons(plan_draft(model, ALL))
    assert r["the draft's first norm"] == "an input norm that outputs fp32, not bf16"


@pytest.mark.parametrize(
    "kernels, part, kernel",
    [
        ({"row_norm"}, "layer 0's attention boundary", "boundary"),
        ({"boundary"}, "the draft's first norm", "row_norm"),
        ({"boundary"}, "the context K/V chain", "context_chain"),
        (set(), "layer 0's QKV epilogue", "qkv_epilogue"),
        ({"o_gate"}, "layer 1's attention", "attention"),
        ({"attention"}, "layer 0's o-gate", "o_gate"),
        ({"attention"}, "layer 1's MLP activation", "mlp_activation"),
    ],
)
def test_parts_refuse_a_kernel_the_backends_lack(kernels, part, kernel):
    r = reasons(plan_draft(meta(), Target(kernels=frozenset(kernels))))
    assert r[part] == f"the installed backends do not provide the {kernel} kernel"


def test_an_excluded_kernel_is_said_to_be_excluded():
    target = Target(kernels=policy.ALL_KERNELS - {"qkv_epilogue"}, excluded=frozenset({"qkv_epilogue"}))
    r = reasons(plan_draft(meta(), target))
    assert r["layer 0's QKV epilogue"] == "the caller excluded the qkv_epilogue kernel"
    assert target.key() != Target(kernels=policy.ALL_KERNELS - {"qkv_epilogue"}).key()


def test_context_refuses_input_norms_that_differ_beyond_weights():
    model = meta(norm_overrides={"layers.1.input_norm": {"eps": 1e-5}})
    r = reasons(plan_draft(model, ALL))
    assert r["the context K/V chain"] == "layer input norms that differ in more than their weights"


def test_context_and_epilogue_refuse_non_power_of_two_kv_heads():
    r = reasons(plan_draft(meta(num_heads=6, num_kv_heads=3), ALL))
    assert r["the context K/V chain"] == ("the context_chain kernel takes a power of two of KV heads up to 32, not 3 "
                                          "(ContextStoreConstants.kv_heads)")
    assert r["layer 0's QKV epilogue"] == "3 KV heads, not a power of two up to 32"


def test_context_and_epilogue_refuse_128_wide_heads():
    r = reasons(plan_draft(meta(head_dim=128, num_heads=4), ALL))
    assert r["the context K/V chain"] == "128-wide KV heads, not 64"
    assert r["layer 1's QKV epilogue"] == "128-wide heads, not 64"


class WeightedHeadNorm(HeadNorm):
    """A head norm with a weight: no stock kernel of the draft has one."""

    def __init__(self, head_dim: int = 64, eps: float = 1e-6) -> None:
        super().__init__(head_dim, eps)
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=torch.bfloat16), requires_grad=False)


def test_context_and_epilogue_refuse_a_weighted_qk_norm():
    model = meta()
    model.layers[0].self_attn.qk_norm = WeightedHeadNorm()
    r = reasons(plan_draft(model, ALL))
    assert r["the context K/V chain"] == "a K-norm other than the stock weightless head norm"
    assert r["layer 0's QKV epilogue"] == "a head norm other than the stock one (WeightedHeadNorm)"
    assert "layer 1's QKV epilogue" not in r


def test_context_refuses_a_qk_norm_in_a_later_layer_that_differs():
    model = meta()
    model.layers[1].self_attn.qk_norm = HeadNorm(64, 1e-5)
    r = reasons(plan_draft(model, ALL))
    assert r["the context K/V chain"] == "a K-norm other than the stock weightless head norm"
    assert "layer 1's QKV epilogue" not in r  # its own eps is the epilogue's constant


def test_context_refuses_no_layers():
    r = reasons(plan_draft(meta(num_layers=0), ALL))
    assert r["the context K/V chain"] == "no layers"


def test_context_and_epilogue_refuse_a_non_stock_rope():
    class NeoX(Rotary):
        pass

    model = meta()
    rope = NeoX(64, 16)
    for layer in model.layers:
        layer.self_attn._rotary[0] = rope
    r = reasons(plan_draft(model, ALL))
    assert r["the context K/V chain"] == "a RoPE other than the stock GPT-J rotation over the whole head"
    assert r["layer 0's QKV epilogue"] == "a RoPE other than the stock GPT-J rotation over the whole head"


def test_epilogue_refuses_no_o_gate_and_a_non_bf16_weight_and_a_subclass():
    r = reasons(plan_draft(meta(use_o_gate=False), ALL))
    assert r["layer 0's QKV epilogue"] == "no o-gate rows in the QKV projection"

    class Other(DraftAttention):
        pass

    model = meta()
    model.layers[0].self_attn.qkv_proj = nn.Parameter(
        model.layers[0].self_attn.qkv_proj.to(torch.float16), requires_grad=False
    )
    other = Other(model.config, model.rotary).to_empty(device="meta")
    model.layers[1].self_attn = other
    r = reasons(plan_draft(model, ALL))
    assert r["layer 0's QKV epilogue"] == "a QKV weight of torch.float16, not bfloat16"
    assert r["layer 1's QKV epilogue"] == "an attention other than the stock one (Other)"


def test_layer_kernels_fuse_in_the_reference_plan():
    """The staged attention (the default) carries the o-gate in its
    epilogue: its constants say so, and the o-gate part names the attention
    part whose kernel runs it; the direct variant keeps both apart."""
    model = DraftModel(DraftConfig(), device="meta")
    plan = plan_draft(model, ALL)
    staged = K.AttentionConstants(64, 8, 64, 16, "int64", staged_slots=policy.DEFAULT_STAGED_SLOTS, o_gate_eps=1e-6)
    assert [p.constants for p in plan.attentions] == [staged] * 2
    assert [p.constants for p in plan.o_gates] == [K.OGateConstants(64, 1e-6)] * 2
    assert [(p.fused, p.via) for p in plan.o_gates] == [(True, "layer 0's attention"), (True, "layer 1's attention")]
    assert [p.constants for p in plan.mlp_activations] == [K.MlpActivationConstants(16384)] * 2
    assert f"fused into layer 0's attention's kernel (OGateConstants {K.OGateConstants(64, 1e-6).key()})" \
        in plan.format()
    assert f"fused (AttentionConstants {staged.key()})" in plan.format()
    direct = plan_draft(model, ALL.replace(attention="direct"))
    assert [p.constants for p in direct.attentions] == [K.AttentionConstants(64, 8, 64, 16, "int64")] * 2
    assert [(p.fused, p.via) for p in direct.o_gates] == [(True, None)] * 2
    assert "fused into" not in direct.format()
    assert plan.fused_count() == direct.fused_count()
    assert ALL.key() != ALL.replace(attention="direct").key()


def test_the_staged_attention_takes_the_o_gate_only_where_it_fuses():
    no_gate = plan_draft(meta(), ALL.without({policy.O_GATE}))
    assert [p.constants.o_gate_eps for p in no_gate.attentions] == [None, None]
    assert [p.constants.staged_slots for p in no_gate.attentions] == [policy.DEFAULT_STAGED_SLOTS] * 2
    assert reasons(no_gate)["layer 0's o-gate"] == "the caller excluded the o_gate kernel"
    weighted = meta()
    weighted.layers[0].self_attn.o_norm = WeightedHeadNorm()
    plan = plan_draft(weighted, ALL)
    assert [p.constants.o_gate_eps for p in plan.attentions] == [None, 1e-6]
    assert [p.via for p in plan.o_gates] == [None, "layer 1's attention"]
    no_attention = plan_draft(meta(), ALL.without({policy.ATTENTION}))
    assert [(p.fused, p.via) for p in no_attention.o_gates] == [(True, None)] * 2
    with pytest.raises(ValueError, match="attention variant"):
        Target(attention="fast")


def test_a_declined_opt_in_kernel_says_it_is_opt_in():
    target = ALL.decline({policy.GEMV})
    r = reasons(plan_draft(meta(), target))
    assert r["layer 0's down GEMV"] == policy.OPT_IN[policy.GEMV]
    assert "layer 0's QKV epilogue" not in r  # the bit-for-bit epilogue still fuses
    assert target.key() != ALL.without({policy.GEMV}).key() != ALL.key()
    with pytest.raises(ValueError, match="opt-in kernels"):
        Target(declined=frozenset({policy.BOUNDARY}))
    # The switches name the opt-in kernels they ask for; opt_in declines the rest.
    assert policy.asked_opt_ins() == frozenset()
    assert policy.asked_opt_ins(gemv=True, package_gemm=True, ordered_gemm=True) == frozenset(policy.OPT_IN)
    assert ALL.opt_in(policy.asked_opt_ins(gemv=True)).declined == {policy.PACKAGE_GEMM, policy.ORDERED_GEMM}
    assert "qkv_front" not in policy.ALL_KERNELS
    assert set(policy.OPT_IN) == {policy.GEMV, policy.PACKAGE_GEMM, policy.ORDERED_GEMM}
    with pytest.raises(TypeError, match="ordered_gemm"):
        policy.asked_opt_ins(ordered_gemm=1)


def test_attention_refuses_wide_heads_and_a_subclass():
    r = reasons(plan_draft(meta(head_dim=128, num_heads=4), ALL))
    assert r["layer 0's attention"] == ("the attention kernel takes heads of 64 columns, not 128 "
                                        "(AttentionConstants.head_dim)")
    assert r["layer 0's o-gate"] == "128-wide heads, not 64"

    class Other(DraftAttention):
        pass

    model = meta()
    model.layers[1].self_attn = Other(model.config, model.rotary).to_empty(device="meta")
    r = reasons(plan_draft(model, ALL))
    assert r["layer 1's attention"] == "an attention other than the stock one (Other)"
    assert "layer 0's attention" not in r


def test_o_gate_and_activation_refusals():
    r = reasons(plan_draft(meta(use_o_gate=False), ALL))
    assert r["layer 0's o-gate"] == "the layer has no o-gate"
    assert "layer 0's attention" not in r
    model = meta()
    model.layers[0].self_attn.o_norm = WeightedHeadNorm()
    model.layers[1].mlp.intermediate_size = 1001
    r = reasons(plan_draft(model, ALL))
    assert r["layer 0's o-gate"] == "a head norm other than the stock one (WeightedHeadNorm)"
    assert r["layer 1's MLP activation"] == ("the mlp_activation kernel takes an intermediate size that is a positive "
                                             "multiple of 8, not 1001 (MlpActivationConstants.intermediate_size)")


def test_context_refuses_a_non_bf16_kv_weight():
    model = meta()
    attn = model.layers[1].self_attn
    attn.qkv_proj = nn.Parameter(attn.qkv_proj.to(torch.float16), requires_grad=False)
    r = reasons(plan_draft(model, ALL))
    assert r["the context K/V chain"] == "a K/V projection weight other than bfloat16"


def test_all_reduce_refusals():
    wide = meta(num_heads=64, num_kv_heads=16, intermediate_size=4096)
    assert reasons(plan_draft(wide, ALL.replace(tp=16)))["the fused all-reduce"] == (
        "TP16, not one of the mailbox's TP sizes (2, 4, 8)"
    )
    model = meta(num_kv_heads=8, connection_overrides={"layers.0.add_ffn": {"dtype": "bf16"}})
    assert reasons(plan_draft(model, ALL.replace(tp=4)))["the fused all-reduce"] == (
        "layer 0's feed-forward boundary keeps its stock modules (every rank must fuse every boundary)"
    )
    model = meta()
    model.layers[1].mlp.down = nn.Parameter(model.layers[1].mlp.down.to(torch.float16), requires_grad=False)
    assert reasons(plan_draft(model, ALL.replace(tp=2)))["the fused all-reduce"] == (
        "layer 1: a weight that is not a plain row-parallel bf16 projection into 2048 features"
    )

    class MoE(nn.Module):
        pass

    model = meta(num_kv_heads=8)
    model.layers[0].mlp = MoE()
    model.layers[0].mlp.down = model.layers[1].mlp.down
    assert reasons(plan_draft(model, ALL.replace(tp=8)))["the fused all-reduce"] == (
        "layer 0: an MLP other than the stock gated one (MoE)"
    )
    assert reasons(plan_draft(meta(), Target(tp=2, kernels=policy.ALL_KERNELS - {"all_reduce_boundary"})))[
        "the fused all-reduce"
    ] == "the installed backends do not provide the all_reduce_boundary kernel"


def test_a_tp_size_that_does_not_split_the_draft_is_an_error():
    with pytest.raises(ValueError, match="TP3 cannot split the draft's 8 query heads"):
        plan_draft(meta(), ALL.replace(tp=3))
    with pytest.raises(ValueError, match="TP16 cannot split the draft's 2 KV heads"):
        plan_draft(meta(num_heads=16), ALL.replace(tp=16))


def test_package_gemm_refusals():
    wide = meta(num_heads=64, num_kv_heads=16, intermediate_size=4096)
    r = reasons(plan_draft(wide, ALL.replace(tp=16)))
    assert r["layer 0's o_proj package GEMM"] == "TP16 runs its branch GEMMs on cuBLAS"
    model = meta(connection_overrides={"layers.0.add_ffn": {"dtype": "bf16"}})
    r = reasons(plan_draft(model, ALL.replace(tp=2)))
    assert r["layer 1's down_proj package GEMM"] == "the all-reduce is not fused (nothing to publish into)"
    # A shard the kernel's warps cannot step through (down_proj's 8 warps: 256 features a step).
    r = reasons(plan_draft(meta(num_kv_heads=8, intermediate_size=4 * 1000), ALL.replace(tp=4)))
    assert r["layer 0's down_proj package GEMM"] == (
        "a shard of 1000 input features is not a multiple of 256 (the steps of the package GEMM's 8 warps, "
        "32 features each)")
    assert "layer 0's o_proj package GEMM" not in r
    r = reasons(plan_draft(meta(), Target(tp=2, kernels=policy.ALL_KERNELS - {"package_gemm", "ordered_gemm"})))
    assert r["layer 0's o_proj package GEMM"] == "the installed backends do not provide the package_gemm kernel"


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_ordered_gemm_opt_in_plans_the_exact_package_gemm(tp):
    """Without the package GEMM, the ordered GEMM opt-in publishes each
    rank's o_proj and down shard on the ordered GEMM (cuBLAS's order): the
    part holds the shard's OrderedGemmConstants, whether the whole draft is
    planned for TP or a rank's shard is."""
    model = meta(num_kv_heads=8)
    target = Target(tp=tp, kernels=policy.ALL_KERNELS).opt_in({"ordered_gemm"})
    for draft in (model, shard_draft(model, 0, tp)):
        parts = plan_draft(draft, target).package_gemms
        whole = describe(model).layers
        want = [K.OrderedGemmConstants(role, *w.shape[:1], w.shape[1] // tp) for layer in whole
                for role, w in (("o_proj", layer.attention.o_proj_weight), ("down", layer.mlp.down_weight))]
        assert [p.constants for p in parts] == want
    declined = plan_draft(model, Target(tp=tp, kernels=policy.ALL_KERNELS).opt_in(set())).package_gemms
    assert all(p.declined and not p.fused for p in declined)
    model = meta(num_kv_heads=8, connection_overrides={"layers.0.add_ffn": {"dtype": "bf16"}})
    r = reasons(plan_draft(model, target))
    assert r["layer 1's down_proj package GEMM"] == "the all-reduce is not fused (nothing to publish into)"
    # A layer on another GEMM backend: the exact package GEMM (F.linear's bits) is not its projection's.
    draft = describe(meta(num_kv_heads=8))
    draft.layers[1] = dataclasses.replace(draft.layers[1], gemm_unsupported="another backend")
    r = reasons(plan_description(draft, target))
    assert r["layer 1's o_proj package GEMM"] == r["layer 1's down_proj package GEMM"] == "another backend"
    assert "layer 0's o_proj package GEMM" not in r


def test_meta_and_real_drafts_plan_alike():
    config = small_config(num_layers=1)
    real, fake = DraftModel(config), DraftModel(config, device="meta")
    for tp in (1, 2):
        a, b = plan_draft(real, ALL.replace(tp=tp)), plan_draft(fake, ALL.replace(tp=tp))
        assert [(p.name, p.constants, p.reason) for p in a.parts()] == [
            (p.name, p.constants, p.reason) for p in b.parts()
        ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hidden=st.sampled_from([2048, 4096, 6144]),
    layers=st.integers(0, 3),
    kv=st.sampled_from([1, 2, 3, 4, 8]),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([32, 64, 128]),
    weight_dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
    has_weight=st.booleans(),
    before=st.booleans(),
    center=st.sampled_from([0.0, 1.0]),
    tp=st.sampled_from([1, 2, 4, 8]),
    platform=st.sampled_from(["cuda", "cpu"]),
)
def test_random_configs_plan_consistently(
    hidden, layers, kv, group, head_dim, weight_dtype, has_weight, before, center, tp, platform
):
    config = DraftConfig(
        hidden_size=hidden, num_layers=layers, num_heads=kv * group, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=512, vocab_size=64, max_position=64, norm_weight_dtype=weight_dtype,
        norm_has_weight=has_weight, norm_weight_before_norm=before and has_weight, norm_gain_center=center,
    )
    model = DraftModel(config, device="meta")
    target = Target(platform=platform, tp=tp, kernels=policy.ALL_KERNELS)
    if layers and ((kv * group) % tp or kv % tp):
        with pytest.raises(ValueError, match=f"TP{tp} cannot split"):
            plan_draft(model, target)
        return
    plan = plan_draft(model, target)
    again = plan_draft(DraftModel(config, device="meta"), target)
    assert plan.format() == again.format()
    if platform == "cpu":
        assert plan.draft_reason == "not CUDA"
        return
    # Every stock part says why; every fused part's constants rebuild equal.
    assert all(p.reason for p in plan.parts() if not p.fused)
    assert all(b.fused for b in plan.boundaries)  # every variant of this space is covered
    for boundary, b in zip(describe(model).boundaries(), plan.boundaries):
        assert b.constants == K.boundary_constants(boundary, hidden)
    epilogue_ok = head_dim == 64 and kv & (kv - 1) == 0
    assert all(p.fused == epilogue_ok for p in plan.qkv_epilogues)
    assert (plan.all_reduce is None) == (tp == 1)
    assert tp == 1 or plan.all_reduce.fused


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dspark_core.planner", *args], capture_output=True, text=True)


def test_cli_prints_the_reference_plan():
    out = _cli("--kernels", "all")
    assert out.returncode == 0, out.stderr
    assert "DSpark plan for TP1: one GPU of sm_90a (132 SMs)" in out.stdout
    assert "layer 1's feed-forward boundary" in out.stdout and "fused (BoundaryConstants" in out.stdout
    assert "all-reduce" not in out.stdout
    assert "14 of 14 parts fused" in out.stdout


def test_cli_declines_the_opt_in_kernels_unless_asked():
    out = _cli("--kernels", "all")
    # Each opt-in said once, with how many parts it would take.
    assert out.stdout.count(policy.OPT_IN[policy.GEMV]) == 1
    assert "not asked for (8 parts): " + policy.OPT_IN[policy.GEMV] in out.stdout
    assert "QKV front" not in out.stdout
    assert _cli("--kernels", "all", "--front").returncode == 2  # the fused QKV front is gone
    # The ordered GEMM is on by default at TP1, its projections never called fused: the build decides.
    assert policy.OPT_IN[policy.ORDERED_GEMM] not in out.stdout
    assert "fused (OrderedGemmConstants" not in out.stdout
    line = next(line for line in out.stdout.splitlines() if "layer 1's o_proj projection" in line)
    assert line.split()[4:13] == ["decided", "at", "build:", "DSpark's", "ordered", "GEMM", "or", "cuBLAS", "per"]
    assert "(OrderedGemmConstants" in line
    assert "14 of 14 parts fused; 8 projections decided at build" in out.stdout
    assert "decided at build (8 projections): a row count runs DSpark's ordered GEMM only where the check " \
           "against the live cuBLAS finds cuBLAS's order" in out.stdout
    off = _cli("--kernels", "all", "--no-ordered-gemm")
    assert off.returncode == 0, off.stderr
    assert "not asked for (8 parts): " + policy.OPT_IN[policy.ORDERED_GEMM] in off.stdout
    assert "decided at build" not in off.stdout and "14 of 14 parts fused\n" in off.stdout
    out = _cli("--kernels", "all", "--gemv", "--ordered-gemm")
    assert out.returncode == 0, out.stderr
    assert "opt-in" not in out.stdout
    assert "layer 1's down GEMV" in out.stdout and "fused (GemvConstants" in out.stdout
    assert "22 of 22 parts fused; 8 projections decided at build" in out.stdout
    # At TP > 1 the ordered GEMM is opt-in.
    tp2 = _cli("--kernels", "all", "--tp", "2")
    assert policy.OPT_IN[policy.ORDERED_GEMM] in tp2.stdout and "decided at build" not in tp2.stdout
    tp2 = _cli("--kernels", "all", "--tp", "2", "--ordered-gemm")
    assert "decided at build (" in tp2.stdout and "fused (OrderedGemmConstants" not in tp2.stdout


def test_cli_prints_reasons_of_a_refusing_config(tmp_path):
    path = tmp_path / "draft.json"
    path.write_text(json.dumps({"num_heads": 48, "num_kv_heads": 6}))
    out = _cli(str(path), "--tp", "2", "--kernels", "all")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    epilogue = next(line for line in lines if line.strip().startswith("layer 0's QKV epilogue"))
    number = epilogue.split("reason ")[1].rstrip(")")
    assert f"  reason {number}: 6 KV heads, not a power of two up to 32" in lines
    assert out.stdout.count("6 KV heads, not a power of two up to 32") == 1  # each reason once


def test_cli_rejects_a_bad_config(tmp_path):
    path = tmp_path / "draft.json"
    path.write_text(json.dumps({"hidden": 8192}))
    out = _cli(str(path))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "dspark-plan: error: unknown DraftConfig keys ['hidden']"
    assert "Traceback" not in _cli("--tp", "3").stderr
    path.write_text(json.dumps({"architectures": ["MuseSparkDSparkModel"], "hidden_size": 8192}))
    out = _cli(str(path))
    assert out.returncode == 2 and out.stderr.strip() == (
        "dspark-plan: error: a checkpoint config (architectures ['MuseSparkDSparkModel']), not a DraftConfig: plan "
        "a vLLM draft checkpoint with python -m dspark_vllm.plan <its folder>")


def test_a_target_without_kernels_calls_them_excluded():
    """``Target.without``: the kernels leave the target and join its
    excluded ones (so a refusal says "excluded", not "not installed")."""
    t = policy.Target(kernels=policy.ALL_KERNELS, excluded=frozenset({policy.PACKAGE_GEMM}))
    u = t.without({policy.GEMV})
    assert u.kernels == policy.ALL_KERNELS - {policy.GEMV}
    assert u.excluded == {policy.PACKAGE_GEMM, policy.GEMV}
    assert t.kernels == policy.ALL_KERNELS  # frozen: t itself is unchanged
    assert t.without(()) == t


def test_device_target_on_a_cpu():
    t = policy.device_target(torch.device("cpu"), tp=2)
    assert (t.platform, t.tp, t.kernels) == ("cpu", 2, policy.installed_kernels())
    assert policy.device_target(torch.device("cpu"), kernels={"boundary"}).kernels == {"boundary"}


def test_constants_keys_are_memoized_per_object_and_outside_it():
    """``key()``, the hash and equality are computed once per constants
    object, kept outside the instance (``Cls(**c.__dict__)`` still copies it:
    its ``__dict__`` is its fields) and dropped with the object; equal
    constants agree, and -0.0 still differs from 0.0."""
    import gc

    a = K.AttentionConstants(64, 8, 64, 16, "int64", staged_slots=384, o_gate_eps=1e-6)
    b = K.AttentionConstants(**a.__dict__)
    assert set(a.__dict__) == {f.name for f in dataclasses.fields(a)}
    assert a == b and hash(a) == hash(b) and a.key() == b.key() and a is not b
    assert set(a.__dict__) == {f.name for f in dataclasses.fields(a)}  # the memo is not in the instance
    assert id(a) in K._MEMO and id(b) in K._MEMO
    held = id(b)
    del b
    gc.collect()
    assert held not in K._MEMO
    zero, negative = K.OGateConstants(64, 0.0), K.OGateConstants(64, -0.0)
    assert zero != negative and zero.key() != negative.key()
    assert K.AttentionConstants(64, 8, 64, 16, "int64").key() != a.key()


def test_cli_takes_options_only_as_written_and_once():
    """No abbreviations, no repeated option, no two options of one setting:
    each a usage error naming them (exit 2), never the last one kept."""
    from dspark_core.planner.cli import main

    for argv, words in ((["--ordered-gem"], "unrecognized arguments: --ordered-gem"),
                        (["--ord"], "unrecognized arguments: --ord"),
                        (["--num-sm", "100"], "unrecognized arguments: --num-sm"),
                        (["--tp", "1", "--tp", "2"], "--tp given twice"),
                        (["--tp=1", "--tp", "2"], "--tp given twice"),
                        (["--ordered-gemm", "--no-ordered-gemm"], "--ordered-gemm and --no-ordered-gemm both given")):
        out = _cli(*argv)
        assert out.returncode == 2 and words in out.stderr, (argv, out.stderr)
    with pytest.raises(SystemExit):
        main(["--gemv", "--gemv"])


def test_a_layer_on_another_gemm_backend_keeps_its_projections_off_the_ordered_gemm():
    """``Layer.gemm_unsupported`` (the model runs its projections on another
    GEMM than the F.linear the ordered GEMM is checked and timed against):
    that layer's ordered-GEMM parts are stock with the reason, the other
    layer's are planned as before."""
    draft = describe(meta())
    why = "vLLM runs the layer's projections on cuda_flashinfer_bf16_gemm (--linear-backend)"
    draft.layers[0] = dataclasses.replace(draft.layers[0], gemm_unsupported=why)
    plan = plan_description(draft, ALL)
    roles = policy.ordered_gemm_roles(1)
    first, second = plan.ordered_gemms[:len(roles)], plan.ordered_gemms[len(roles):]
    assert first and all(not p.fused and p.reason == why for p in first)
    assert second and all(p.fused for p in second)


def test_target_unchecked_is_kernel_reason_pairs():
    """``Target.unchecked``: (kernel, reason) pairs of known kernels, sorted
    into one spelling; a malformed entry, an unknown kernel, an empty reason
    or a kernel twice is a TypeError naming the field."""
    t = Target(unchecked=(("row_norm", "b"), ("boundary", "a")))
    assert t.unchecked == (("boundary", "a"), ("row_norm", "b")) and Target(unchecked={"row_norm": "b"}).unchecked
    for bad in ((("row_norm", "a", "b"),), (("nope", "a"),), (("row_norm", ""),), "row_norm",
                (("row_norm", "a"), ("row_norm", "b")), ((1, "a"),)):
        with pytest.raises(TypeError, match="Target.unchecked"):
            Target(unchecked=bad)
    plan = plan_draft(meta(), Target(kernels=policy.ALL_KERNELS, unchecked=(("row_norm", "not checked here"),)))
    assert plan.input_norm.reason == "not checked here"
