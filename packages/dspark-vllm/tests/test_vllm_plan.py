"""The description and the plan over vLLM's real modules (the draft built
from the test checkpoint by vLLM's loader, ``_draft``): the description binds
the model's own parameters after load; with no kernel checked every part
stays stock with the not-yet-checked reason; with the kernels checked on an H200
(and with every kernel) the parts the kernels reproduce fuse, on sm_100a
none; one test per refusal (each
change made to the built modules, and undone); the CLI."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
import torch  # noqa: E402

from dspark_core.planner import policy  # noqa: E402
from dspark_vllm import deployment, planning  # noqa: E402
from dspark_vllm.adapter import describe_vllm  # noqa: E402
from dspark_vllm.runtime import fused_kernels, pin_rope_tables  # noqa: E402

GPU = policy.Target(kernels=policy.ALL_KERNELS).opt_in(frozenset())  # sm_90a, every kernel installed


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from dspark_vllm.plugin import register

    register()
    b = _draft.build(*_draft.checkpoint_dir(tmp_path_factory, "plan"), "auto")
    pin_rope_tables(b.model.model)
    return b


def _plan(built, exact=policy.ALL_KERNELS, target=GPU, layout="LBHNC", **kw):
    return planning.plan_vllm(describe_vllm(built.model.model, kv_cache_layout=layout), target, exact=exact, **kw)


def _reasons(plan) -> dict[str, str]:
    return {p.name: p.reason for p in plan.parts() if not p.fused and not p.declined}


def test_the_description_binds_the_models_own_parameters_after_load(built):
    """Every tensor the kernels would bind is the loaded model's own
    parameter (the same object), holding the checkpoint's values in vLLM's
    row order; the residual coefficients are vLLM's materialized ones; the
    gain centres are those of the draft's residual indices (target layers
    4 + i); the RoPE tables are the modules' (the context's cast to BF16)."""
    backbone, w = built.model.model, built.weights
    draft = describe_vllm(backbone)
    assert draft.tp == 1 and draft.compute_dtype == torch.bfloat16 and draft.residual_dtype == torch.float32
    for i, (layer, vl) in enumerate(zip(draft.layers, backbone.layers)):
        p = f"layers.{i}"
        attn, mlp = layer.attention, layer.mlp
        assert attn.qkv_weight is vl.self_attn.qkv_proj.weight and mlp.down_weight is vl.feed_forward.down_proj.weight
        assert torch.equal(attn.qkv_weight, torch.cat([w[f"{p}.self_attn.{n}_proj.weight"]
                                                      for n in ("q", "k", "v", "o_gate")]))
        assert torch.equal(attn.o_proj_weight, w[f"{p}.self_attn.o_proj.weight"])
        assert torch.equal(mlp.gate_up_weight, torch.cat([w[f"{p}.feed_forward.gate_proj.weight"],
                                                          w[f"{p}.feed_forward.up_proj.weight"]]))
        assert torch.equal(layer.input_norm.weight, w[f"{p}.self_attn.pre_qkv_proj_norm.weight"])
        assert layer.input_norm.weight is vl.self_attn.pre_qkv_proj_norm.weight
        post, post_ffn = layer.attention_boundary.post, layer.ffn_boundary.post
        assert torch.equal(post.weight, w[f"{p}.post_attn_norm.weight"]) and post.eps == 1e-6
        assert post.gain_center == 1.0 / (2 * (4 + i) + 2) and post_ffn.gain_center == 1.0 / (2 * (4 + i) + 3)
        assert post_ffn.weight_before_norm and not post.weight_before_norm and layer.input_norm.gain_center == 1.0
        conn = layer.attention_boundary.connection
        gate = w[f"{p}.add_attn.gate"].float() / 0.3
        beta = torch.sigmoid(gate)
        assert conn.alpha is vl.add_attn.alpha and torch.equal(conn.beta, beta)
        assert torch.equal(conn.alpha, torch.sqrt(torch.clamp(torch.sigmoid(-gate) * (1 + beta), min=1e-3)))
        assert attn.rope.table is vl.self_attn.rotary_emb.cos_sin_cache
        assert attn.q_norm.weight is None and attn.q_norm.eps == 1e-5 and attn.o_norm.eps == 1e-5
    assert draft.layers[0].attention.rope.table.dtype == torch.bfloat16  # cast by the context chain's first call
    assert draft.layers[1].attention.rope.table.dtype == torch.float32  # read as is by the fused insert
    context = draft.context
    assert context.stacked_kv_weight() is backbone._stacked_kv_weight
    assert torch.equal(context.stacked_kv_weight()[1], torch.cat([w["layers.1.self_attn.k_proj.weight"],
                                                                   w["layers.1.self_attn.v_proj.weight"]]))
    assert torch.equal(context.hidden_norm.weight, w["hidden_norm.weight"])
    assert context.rope.table.dtype == torch.bfloat16
    assert torch.equal(draft.final_norm.weight, w["norm.weight"])


def test_with_no_kernel_checked_against_vllm_every_part_stays_stock(built):
    plan = _plan(built, exact=frozenset())
    assert plan.fused_count() == (0, 14)
    reasons = _reasons(plan)
    assert reasons["layer 0's attention boundary"] == planning.unchecked_reason(policy.BOUNDARY)
    assert reasons["layer 1's QKV epilogue"].startswith("the DSpark qkv_epilogue kernel is not yet checked bit for "
                                                        "bit against vLLM 0.33.0's fused_muse_spark_qknorm_rope")
    assert all(r.startswith("the DSpark ") for n, r in reasons.items() if not n.endswith("attention"))
    assert reasons["layer 0's attention"].endswith("attention backend runs it; no DSpark kernel reproduces that "
                                                   "backend's arithmetic")


def test_on_an_h200_the_gpu_checked_kernels_fuse_and_on_sm100_none(built):
    checked = planning.exact_kernels("sm_90a")
    assert policy.ATTENTION not in checked and policy.GEMV not in checked
    plan = _plan(built, exact=None)
    assert plan.fused_count() == (12, 14)
    assert set(_reasons(plan)) == {"layer 0's attention", "layer 1's attention"}
    assert all(p.fused and p.via is None for p in plan.o_gates)  # their own kernel beside vLLM's attention
    assert planning.exact_kernels("sm_100a") == frozenset()
    sm100 = _plan(built, exact=None, target=GPU.replace(arch="sm_100a"))
    reasons = _reasons(sm100)
    assert sm100.fused_count() == (0, 14)
    assert reasons["layer 0's feed-forward boundary"] == planning.unchecked_reason(policy.BOUNDARY, "sm_100a")
    assert reasons["layer 0's feed-forward boundary"].endswith("on an sm_100a GPU (compile-checked only)")


def test_with_every_kernel_checked_the_reproduced_parts_fuse(built):
    plan = _plan(built)
    assert plan.fused_count() == (12, 14)
    assert set(_reasons(plan)) == {"layer 0's attention", "layer 1's attention"}
    assert all(p.declined for p in plan.gemvs)
    first = plan.qkv_epilogues[0].constants
    assert (first.table_dtype, plan.qkv_epilogues[1].constants.table_dtype) == ("bf16", "fp32")
    assert plan.context.constants.store.table_dtype == "bf16" and plan.o_gates[0].via is None


def test_a_compiled_draft_keeps_every_part_stock(built, monkeypatch):
    monkeypatch.setattr(built.model.model, "do_not_compile", False)
    assert _plan(built).draft_reason.startswith("the draft is torch.compiled")


def test_neox_rope_refuses_the_parts_that_rotate(built, monkeypatch):
    monkeypatch.setattr(built.model.model.layers[1].self_attn.rotary_emb, "is_neox_style", True)
    reasons = _reasons(_plan(built))
    assert reasons["layer 1's QKV epilogue"] == "NeoX RoPE (rotate-half pairs); the kernels rotate GPT-J pairs"
    assert "layer 0's QKV epilogue" not in reasons and "the context K/V chain" not in reasons
    monkeypatch.setattr(built.model.model.layers[0].self_attn.rotary_emb, "is_neox_style", True)
    assert _reasons(_plan(built))["the context K/V chain"].startswith("NeoX RoPE")


def test_an_fp8_kv_cache_refuses_the_inserts(built, monkeypatch):
    for layer in built.model.model.layers:
        monkeypatch.setattr(layer.self_attn.attn, "kv_cache_dtype", "fp8")
    reasons = _reasons(_plan(built))
    assert reasons["layer 0's QKV epilogue"] == "a KV cache of fp8: the kernels insert BF16 K and V"
    assert reasons["the context K/V chain"] == "a KV cache of fp8: the context store inserts BF16 K and V"
    assert not any("boundary" in name for name in reasons)


def test_norm_variants_the_kernels_lack_refuse_their_boundaries(built, monkeypatch):
    backbone = built.model.model
    monkeypatch.setattr(backbone.layers[0].post_attn_norm, "variance_size_override", 1024)
    norm_cls = type(backbone.norm)
    subclass = type("ScaledNorm", (norm_cls,), {"forward": lambda self, x, residual=None, out_dtype=None:
                                                 norm_cls.forward(self, x, residual, out_dtype)})
    monkeypatch.setattr(backbone.norm, "__class__", subclass)
    reasons = _reasons(_plan(built))
    assert reasons["layer 0's attention boundary"] == ("a norm whose variance runs over 1024 of its 2048 columns "
                                                       "(variance_size_override)")
    assert reasons["layer 1's feed-forward boundary"] == ("a norm other than vLLM's stock MuseSpark1xRMSNorm "
                                                          "(ScaledNorm, overriding forward)")
    assert "layer 0's feed-forward boundary" not in reasons and "the draft's first norm" not in reasons


def test_lora_wrapped_modules_keep_every_part_stock(built):
    from vllm.lora.layers.base import BaseLayerWithLoRA

    class WrappedForTest(BaseLayerWithLoRA):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

    mlp = built.model.model.layers[0].feed_forward
    down = mlp.down_proj
    mlp.down_proj = WrappedForTest(down)  # (monkeypatch would delete a submodule on undo)
    try:
        assert _plan(built).draft_reason == ("LoRA-wrapped modules (layers.0.feed_forward.down_proj): the kernels "
                                             "bind the base weights only")
    finally:
        mlp.down_proj = down


def test_at_tp_gt1_the_all_reduce_fuses_where_the_mailbox_reproduces_vllms(built):
    """The description as a TP4 rank's (its tp fact set to 4; the test
    draft's shapes split over 4), planned with vLLM's all-reduce as
    allreduce.stock_all_reduce resolves it (dspark-vllm's test_allreduce
    holds the decision table): stock where it is not known, fused with the
    stock it reproduces named where it is, stock while unchecked on a GPU."""
    from dspark_core.contracts.constants import FP32_RANK_ORDER
    from dspark_vllm.allreduce import Topology

    draft = dataclasses.replace(describe_vllm(built.model.model, kv_cache_layout="LBHNC"), tp=4)
    tp4 = GPU.replace(tp=4)
    unknown = deployment.stock_all_reduce(4, "sm_90a", env={}, topology=Topology())
    plan = planning.plan_vllm(draft, tp4, unknown, policy.ALL_KERNELS)
    assert plan.all_reduce.reason.startswith("vLLM's all-reduce at TP4 is not known here: it depends on the GPUs'")
    assert all(b.fused for b in plan.boundaries)  # the boundaries still fuse after vLLM's own all-reduce
    hgx = Topology(multicast=True, fully_connected=True)
    custom = deployment.stock_all_reduce(4, "sm_90a", env={"VLLM_ALLREDUCE_USE_FLASHINFER": "0"}, topology=hgx)
    plan = planning.plan_vllm(draft, tp4, custom, policy.ALL_KERNELS)
    assert plan.all_reduce.fused and plan.all_reduce.constants.sum_order == FP32_RANK_ORDER
    assert "vLLM's custom one-stage all-reduce" in plan.all_reduce.name
    two = deployment.stock_all_reduce(2, "sm_90a", env={}, topology=Topology())
    plan = planning.plan_vllm(dataclasses.replace(draft, tp=2), GPU.replace(tp=2), two, policy.ALL_KERNELS)
    assert plan.all_reduce.fused and "-0.0 sum as +0.0" in plan.all_reduce.name
    plan = planning.plan_vllm(draft, tp4, custom)
    assert plan.all_reduce.reason == planning.unchecked_reason(policy.ALL_REDUCE_BOUNDARY)
    # The ordered GEMM opt-in at TP: o_proj and down on the exact package GEMM, checked as the
    # ordered GEMM's kernel (the own-order package GEMM is never among the exact kernels).
    ordered = policy.Target(kernels=policy.ALL_KERNELS, tp=4).opt_in({policy.ORDERED_GEMM})
    exact = policy.ALL_KERNELS - {policy.PACKAGE_GEMM, policy.GEMV}
    plan = planning.plan_vllm(draft, ordered, custom, exact)
    assert plan.all_reduce.fused and plan.package_gemms and all(p.fused for p in plan.package_gemms)
    assert [p.constants.role for p in plan.package_gemms] == ["o_proj", "down"] * (len(plan.package_gemms) // 2)
    assert planning.part_kernel(policy.PACKAGE_GEMM, plan.package_gemms[0]) == policy.ORDERED_GEMM
    assert policy.ORDERED_GEMM in fused_kernels(plan) and policy.PACKAGE_GEMM not in fused_kernels(plan)
    plan = planning.plan_vllm(draft, ordered, custom, exact - {policy.ORDERED_GEMM})
    assert all(p.reason == planning.unchecked_reason(policy.ORDERED_GEMM) for p in plan.package_gemms)


def test_the_plan_cli_prints_the_plan_and_the_deployment_check(built, capsys):
    from dspark_vllm.plan import main

    draft_dir = built.config.speculative_config.draft_model_config.model
    target_dir = built.config.model_config.model
    assert main([draft_dir, "--target", target_dir, "--exact", "all", "--kernels", "all", "--kv-cache-layout",
                 "LBHNC"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("DSpark plan for TP1: one GPU of sm_90a (132 SMs)")
    assert "12 of 14 parts fused" in out and "FLASH_ATTN attention backend runs it" in out
    assert "the deployment check passes (sm_90a, TP1, eager layers, FULL decode graphs)" in out
    assert main([draft_dir, "--tp", "4", "--kv-cache-dtype", "fp8", "--kernels", "all"]) == 0
    out = capsys.readouterr().out
    assert "(the fused path has never run on sm_90a at TP4: compile-checked only)" in out
    assert "9 of 15 parts fused" in out and "a KV cache of fp8: the context store inserts BF16 K and V" in out
    assert "needs:\n  - a bfloat16 model and a bfloat16 KV cache" in out
    assert main(["/nonexistent"]) == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("isa", ["none", "avx512"])
def test_the_plan_of_an_fp8_cache_does_not_depend_on_the_host_cpu(built, capsys, monkeypatch, isa):
    """vLLM's CPU attention backend refuses an fp8 KV cache on an x86 CPU
    without AVX-512 or AMX; the plan of an H200 deployment is the same
    whatever ISA the host that prints it reports."""
    import torch

    from dspark_vllm.plan import main

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: isa == "avx512")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    draft_dir = built.config.speculative_config.draft_model_config.model
    assert main([draft_dir, "--kv-cache-dtype", "fp8", "--kernels", "all"]) == 0
    out = capsys.readouterr().out
    assert "a KV cache of fp8: the context store inserts BF16 K and V" in out
    assert "a KV cache of fp8: the kernels insert BF16 K and V" in out
    assert main([draft_dir, "--kv-cache-dtype", "fp9"]) == 2
    assert "fp9" in capsys.readouterr().err


def test_the_ordered_gemm_is_planned_where_additional_config_asks_for_it():
    """``additional_config["ordered_gemm"]`` switches the ordered GEMM
    (vLLM's bits where its build-time check finds cuBLAS's order, at the row
    counts its timing finds faster): absent, on at TP1 and declined at TP >
    1; false declines it; anything but a bool is refused."""
    import types

    import torch

    def config(extra):
        return types.SimpleNamespace(additional_config=extra)

    assert planning.ordered_gemm_asked(config({"ordered_gemm": True})) is True
    assert planning.ordered_gemm_asked(config({})) is True  # on by default at TP1
    assert planning.ordered_gemm_asked(config(None)) is True
    assert planning.ordered_gemm_asked(config({}), 2) is False  # opt-in at TP > 1
    assert planning.ordered_gemm_asked(config({"ordered_gemm": False})) is False
    with pytest.raises(TypeError, match="ordered_gemm"):
        planning.ordered_gemm_asked(config({"ordered_gemm": "yes"}))
    cpu = torch.device("cpu")
    asked = planning.vllm_target(cpu, 1, policy.ALL_KERNELS, ordered_gemm=True)
    assert policy.ORDERED_GEMM not in asked.declined
    assert policy.ORDERED_GEMM not in planning.vllm_target(cpu, 1, policy.ALL_KERNELS).declined
    assert policy.ORDERED_GEMM in planning.vllm_target(cpu, 2, policy.ALL_KERNELS).declined
    assert policy.ORDERED_GEMM in planning.vllm_target(cpu, 1, policy.ALL_KERNELS, ordered_gemm=False).declined
