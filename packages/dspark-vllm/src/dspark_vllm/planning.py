"""The plan of a vLLM draft: dspark-core's plan over the adapter's
description, then the vLLM-side refusals core cannot know.

``plan_vllm(draft, target, all_reduce)`` is ``dspark_core.planner.plan.
plan_draft`` followed by, in order:

1. every fused part whose kernel is not in ``exact_kernels(target.arch)``
   (kernels proven bit for bit equal to vLLM 0.33.0's stock op on a GPU of
   that architecture) made stock, with the sentence ``unchecked_reason``
   gives;
2. at TP > 1, the fused all-reduce made stock where the mailbox does not
   reproduce the all-reduce vLLM runs on the draft's steps
   (``allreduce.decode_order`` for the draft's hidden size) or where a
   boundary stays stock; where it does, the part is named after the stock
   it reproduces (backend, order, zero sign, rows) and its constants carry
   that sum order; the package GEMMs follow a stock all-reduce.

``vllm_target`` is the planner's target as the plugin asks for it: the
device's architecture, the opt-in kernels declined (each sums a projection in
its own order, never vLLM's cuBLAS bits).
"""

from __future__ import annotations

import dataclasses

from dspark_core import checks
from dspark_core.contracts.constants import OrderedGemmConstants
from dspark_core.planner import policy
from dspark_core.planner.plan import DraftPlan, Part, plan_draft
from dspark_core.planner.policy import Target
from dspark_core.runtime.description import DraftDescription
from dspark_vllm import options
from dspark_vllm.allreduce import AllReduceOrder, stock_all_reduce

# Per architecture, the kernels (dspark_core.contracts.kernels) run on a GPU
# of it against vLLM 0.33.0's stock binaries on the same operands, every bit
# equal (scripts/gpu-check.sh: the norms, qkv and gating suites, H200). The
# attention keeps vLLM's backend (no DSpark kernel reproduces it); the GEMV
# and the package GEMM sum their projections in their own order; the ordered
# GEMM ran against cuBLAS on an H200 (the ordered suite, 2026-12-04) and,
# in every deployment, takes only the row counts its build-time check finds
# cuBLAS's order for (dspark_core.runtime.gemm_check);
# the mailbox all-reduce boundary has not run against vLLM's all-reduce on
# GPUs (allreduce.MailboxBoundaries). sm_100a has no GPU run yet:
# every part stays stock there.
VLLM_EXACT_KERNELS: dict[str, frozenset[str]] = {
    "sm_90a": frozenset({policy.ROW_NORM, policy.BOUNDARY, policy.CONTEXT_CHAIN, policy.QKV_EPILOGUE,
                         policy.O_GATE, policy.MLP_ACTIVATION, policy.ORDERED_GEMM}),
}


def exact_kernels(arch: str) -> frozenset[str]:
    """The kernels checked bit for bit against vLLM's stock on a GPU of
    ``arch`` (none for an unchecked arch); ``arch`` normalised first
    (``checks.arch``: ``SM_90A`` and ``(9, 0)`` are sm_90a; TypeError or
    ValueError for what names no architecture)."""
    return VLLM_EXACT_KERNELS.get(checks.arch("the GPU architecture", arch, known=False), frozenset())


# The stock op of vLLM 0.33.0 each kernel stands in for (what its GPU check compares it with).
STOCK_OPS = {
    policy.ROW_NORM: "MuseSpark1xRMSNorm (Triton fused_rmsnorm_fwd)",
    policy.BOUNDARY: "post-norm, norm-preserving residual and next pre-norm (Triton fused_rmsnorm_fwd and ATen)",
    policy.CONTEXT_CHAIN: "precompute_and_store_context_kv (Triton norms, torch.bmm, ATen K-norm, rotary_embedding, "
                          "the backend's KV insert)",
    policy.QKV_EPILOGUE: "fused_muse_spark_qknorm_rope_kv_insert",
    policy.ATTENTION: "attention backend (FlashAttention)",
    policy.O_GATE: "o-norm and sigmoid o-gate (FLA layer_norm_gated on sm_90, FlashInfer rmsnorm_sigmoid_gate on "
                   "sm_100)",
    policy.MLP_ACTIVATION: "SiluAndMul (act_and_mul_kernel)",
    policy.GEMV: "cuBLAS projection",
    policy.ALL_REDUCE_BOUNDARY: "tensor_model_parallel_all_reduce and the boundary after it",
    policy.PACKAGE_GEMM: "row-parallel cuBLAS projection",
    policy.ORDERED_GEMM: "cuBLAS projection (F.linear), its order checked at build",
}
# The plan's part lists and the kernel each runs on.
PART_KERNELS = (
    ("input_norm", policy.ROW_NORM),
    ("context", policy.CONTEXT_CHAIN),
    ("boundaries", policy.BOUNDARY),
    ("qkv_epilogues", policy.QKV_EPILOGUE),
    ("attentions", policy.ATTENTION),
    ("o_gates", policy.O_GATE),
    ("mlp_activations", policy.MLP_ACTIVATION),
    ("gemvs", policy.GEMV),
    ("all_reduce", policy.ALL_REDUCE_BOUNDARY),
    ("package_gemms", policy.PACKAGE_GEMM),
    ("ordered_gemms", policy.ORDERED_GEMM),
)


def unchecked_reason(kernel: str, arch: str = "sm_90a") -> str:
    """Why a part on ``kernel`` stays stock on ``arch`` (normalised, as in
    ``exact_kernels``) while the kernel is not checked there."""
    arch = checks.arch("the GPU architecture", arch, known=False)
    where = "" if arch in VLLM_EXACT_KERNELS else f" on an {arch} GPU (compile-checked only)"
    return (f"the DSpark {kernel} kernel is not yet checked bit for bit against vLLM 0.33.0's "
            f"{STOCK_OPS[kernel]}{where}")


def vllm_target(device, tp: int = 1, kernels: frozenset[str] | None = None, package_gemm: bool = False,
                ordered_gemm: bool | None = None) -> Target:
    """The planner's target for ``device`` at TP ``tp``: the installed
    kernels (or ``kernels``), the opt-in ones declined but the package GEMM
    where ``package_gemm`` (``allreduce.package_gemm_asked``) and the
    ordered GEMM where ``ordered_gemm`` (``ordered_gemm_asked``; None:
    ``policy.ordered_gemm_default(tp)``, on at TP1)."""
    if ordered_gemm is None:
        ordered_gemm = policy.ordered_gemm_default(tp)
    return policy.device_target(device, tp, kernels).opt_in(policy.asked_opt_ins(False, package_gemm, ordered_gemm))


def ordered_gemm_asked(vllm_config, tp: int = 1) -> bool:
    """Whether the ordered GEMM runs (the layers' projections in cuBLAS's
    own order where the build-time check finds it, so vLLM's bits, at the
    row counts where it then measures faster than cuBLAS on this GPU):
    ``additional_config["ordered_gemm"]``, by default on at TP1 and off at
    TP ``tp`` > 1 (``policy.ordered_gemm_default``). TypeError for anything
    but a bool; near misses of the key said once (``options.switch``)."""
    return options.switch(vllm_config, options.ORDERED_GEMM, policy.ordered_gemm_default(tp))


def _restock(part: Part | None, reason: str) -> Part | None:
    return part if part is None or not part.fused else Part(part.name, reason=reason)


def part_kernel(kernel: str, part: Part | None) -> str:
    """The kernel ``part`` of a ``PART_KERNELS`` list on ``kernel`` runs on:
    a package GEMM part holding ``OrderedGemmConstants`` is the exact package
    GEMM, the ordered GEMM's kernel publishing (``dspark_comm.cutedsl.ordered_package``)."""
    if kernel == policy.PACKAGE_GEMM and part is not None and isinstance(part.constants, OrderedGemmConstants):
        return policy.ORDERED_GEMM
    return kernel


def _all_reduce_part(plan: DraftPlan, order: AllReduceOrder) -> Part:
    part = plan.all_reduce
    if order.sum_order is None or order.rows < 1:
        return Part(part.name, reason=order.why)
    stock = next((b for b in plan.boundaries if not b.fused), None)
    if stock is not None:
        return Part(part.name, reason=f"{stock.name} keeps its stock modules (every rank must fuse every boundary)")
    constants = dataclasses.replace(part.constants, sum_order=order.sum_order)
    return Part(f"{part.name} ({order.describe()})", constants)


def plan_vllm(draft: DraftDescription, target: Target, all_reduce: AllReduceOrder | None = None,
              exact: frozenset[str] | None = None) -> DraftPlan:
    """The plan of vLLM's draft ``draft`` for ``target`` (module docstring).
    ``all_reduce``: vLLM's all-reduce at ``target.tp`` (default:
    ``stock_all_reduce`` of the environment); ``exact``: the kernels proven
    exact (default ``exact_kernels(target.arch)``, read at call time)."""
    exact = exact_kernels(target.arch) if exact is None else frozenset(exact)
    # The kernels not checked on this architecture go to the planner with their reasons, so the plan is made once.
    target = target.replace(unchecked=tuple((k, unchecked_reason(k, target.arch)) for _, k in PART_KERNELS
                                            if k not in exact))
    plan = plan_draft(draft, target)
    if plan.draft_reason is not None:
        return plan
    if plan.all_reduce is not None and plan.all_reduce.fused:
        order = all_reduce or stock_all_reduce(target.tp, target.arch, hidden_size=draft.hidden_size)
        plan.all_reduce = _all_reduce_part(plan, order.for_hidden(draft.hidden_size))
    if plan.all_reduce is not None and not plan.all_reduce.fused:
        plan.package_gemms = [_restock(p, "the all-reduce is not fused (nothing to publish into)")
                              for p in plan.package_gemms]
    return plan


# The plan's parts that write the KV cache (its layout is known only once
# vLLM binds the cache, after the plan is made).
INSERT_PARTS = ("context", "qkv_epilogues")


def restock_inserts(plan: DraftPlan, reason: str) -> tuple[DraftPlan, list[str]]:
    """A new plan: ``plan`` (left as it is) with its fused parts that insert
    into the KV cache (``INSERT_PARTS``: the context chain, the QKV
    epilogues) stock for ``reason`` (the bound cache's layout, found after
    the build: ``deployment.bound_layout_unsupported``); and the names of
    the parts it changed."""
    changed, fields = [], {}
    for attr in INSERT_PARTS:
        value = getattr(plan, attr)
        parts = value if isinstance(value, list) else [value]
        changed += [p.name for p in parts if p is not None and p.fused]
        fields[attr] = [_restock(p, reason) for p in value] if isinstance(value, list) else _restock(value, reason)
    return dataclasses.replace(plan, **fields), changed


def plan_signature(plan: DraftPlan) -> int:
    """A 62-bit number that differs between plans fusing different parts
    (what the TP ranks compare before any of them runs fused)."""
    text = repr([(p.name, p.fused, None if p.constants is None else p.constants.key()) for p in plan.parts()])
    text += repr(plan.draft_reason)
    value = 0
    for ch in text.encode():
        value = (value * 131 + ch) % (1 << 62)
    return value


__all__ = ["INSERT_PARTS", "PART_KERNELS", "STOCK_OPS", "VLLM_EXACT_KERNELS", "exact_kernels",
           "plan_signature", "plan_vllm", "restock_inserts", "unchecked_reason", "vllm_target"]
