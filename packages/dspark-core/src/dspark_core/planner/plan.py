"""The planner: which parts of a DSpark draft run fused, and why any part
keeps its stock modules.

``plan_draft(model, target)`` asks, per part, the questions a fused kernel
must answer yes to before it may replace the stock modules bit for bit: the
whole draft (platform, dtypes), each residual boundary, the first layer's
input norm, the context K/V chain, each layer's QKV front (or, where the
front does not run, its QKV epilogue after the stock projection), attention,
o-gate and MLP activation, the fused all-reduce and each branch's package GEMM, and at TP1 each layer's
projections on the one-token GEMV. A refused part keeps its stock
modules and the plan says why, in words. The plan reads the configuration and
the modules' types, shapes and dtypes only (a draft on the meta device
plans), so every rank of a TP group makes the same plan.

The attention part carries the constants of the kernel variant the target
names (``Target.attention``): the staged variant's constants include the
o-gate's eps where the o-gate fuses, and that o-gate part then says it runs
in the attention's kernel (``Part.via``).

Run ``python -m dspark_core.planner [CONFIG.json] [--tp N] [--arch sm_90a]
[--attention staged|direct] [--front] [--gemv]`` to print a plan and every
reason: as ``build_draft_decode`` plans, the opt-in kernels (``policy.OPT_IN``)
are declined unless their flag asks for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field

import torch

from dspark_core.contracts import constants as K
from dspark_core.planner import policy
from dspark_core.planner.policy import Target
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftAttention, DraftModel
from dspark_core.spec.layers import GatedMLP, HeadNorm


@dataclass(frozen=True)
class Part:
    """One planned part: ``fused`` with its kernel's ``constants``, or stock
    with the ``reason`` in words. ``via``: the name of the fused part whose
    kernel runs this one in its epilogue (its ``constants`` then say how),
    or None where this part has a kernel of its own."""

    name: str
    constants: object | None = None
    reason: str | None = None
    via: str | None = None

    @property
    def fused(self) -> bool:
        return self.reason is None

    @property
    def declined(self) -> bool:
        """Stock only because the caller did not opt in to its kernel (``policy.OPT_IN``)."""
        return self.reason in policy.OPT_IN.values()

    @property
    def refusal(self) -> str:
        """Why a stock part is stock, as a sentence."""
        return f"{self.name} keeps its stock modules: {self.reason}"


@dataclass
class DraftPlan:
    """The draft's fused forward as planned for ``target``. ``draft_reason``
    is set where no part fuses (the draft keeps its stock layers)."""

    target: Target
    draft_reason: str | None = None
    input_norm: Part | None = None
    boundaries: list[Part] = field(default_factory=list)
    context: Part | None = None
    qkv_fronts: list[Part] = field(default_factory=list)
    qkv_epilogues: list[Part] = field(default_factory=list)
    attentions: list[Part] = field(default_factory=list)
    o_gates: list[Part] = field(default_factory=list)
    mlp_activations: list[Part] = field(default_factory=list)
    all_reduce: Part | None = None
    package_gemms: list[Part] = field(default_factory=list)
    # At TP1, per layer, one per policy.GEMV_ROLES role in that order.
    gemvs: list[Part] = field(default_factory=list)

    def parts(self) -> list[Part]:
        single = [p for p in (self.input_norm, self.context, self.all_reduce) if p is not None]
        return [*single, *self.boundaries, *self.qkv_fronts, *self.qkv_epilogues, *self.attentions, *self.o_gates,
                *self.mlp_activations, *self.package_gemms, *self.gemvs]

    def refused(self) -> list[str]:
        """Every stock part with its reason, as sentences."""
        if self.draft_reason is not None:
            return [f"the whole draft keeps its stock layers: {self.draft_reason}"]
        return [p.refusal for p in self.parts() if not p.fused]

    def fused_count(self) -> tuple[int, int]:
        parts = self.parts()
        return sum(p.fused for p in parts), len(parts)

    def format(self) -> str:
        t = self.target
        lines = [f"DSpark plan for {t.platform} {t.arch} ({t.num_sms} SMs), TP{t.tp}"]
        if self.draft_reason is not None:
            lines.append(f"  stock draft: {self.draft_reason}")
            return "\n".join(lines)
        for p in self.parts():
            what = f"fused ({type(p.constants).__name__} {p.constants.key()})" if p.fused else f"stock: {p.reason}"
            if p.fused and p.via is not None:
                what = f"fused into {p.via}'s kernel ({type(p.constants).__name__} {p.constants.key()})"
            lines.append(f"  {p.name:<36} {what}")
        fused, total = self.fused_count()
        lines.append(f"  {fused} of {total} parts fused")
        return "\n".join(lines)


def _kernel_missing(target: Target, *kernels: str) -> str | None:
    for kernel in kernels:
        if kernel in target.declined:
            return policy.OPT_IN[kernel]
        if kernel in target.excluded:
            return f"the caller excluded the {kernel} kernel"
        if kernel not in target.kernels:
            return f"the installed backends do not provide the {kernel} kernel"
    return None


def _try(name: str, build, *args, **kwargs) -> Part:
    """``Part(name, build(...))``, or the refusal with the ValueError's words."""
    try:
        return Part(name, build(*args, **kwargs))
    except ValueError as error:
        return Part(name, reason=str(error))


def _with_kernels(part: Part, target: Target, *kernels: str) -> Part:
    missing = _kernel_missing(target, *kernels)
    if part.fused and missing:
        return Part(part.name, reason=missing)
    return part


def draft_unsupported(model: DraftModel, target: Target) -> str | None:
    """Why no part of the draft runs fused, or None: it needs a CUDA target
    of a supported architecture, BF16 compute and an FP32 residual stream."""
    if target.platform != "cuda":
        return "not CUDA"
    if target.arch not in policy.ARCHS:
        return f"architecture {target.arch}, not one of {', '.join(policy.ARCHS)}"
    if model.default_dtype != torch.bfloat16:
        return f"compute dtype {model.default_dtype}, not bfloat16"
    if model.residual_dtype != torch.float32:
        return f"residual dtype {model.residual_dtype}, not float32"
    return None


def _boundary_names(model: DraftModel) -> list[str]:
    return [f"layer {i}'s {kind} boundary" for i in range(len(model.layers)) for kind in ("attention", "feed-forward")]


def context_unsupported(model: DraftModel) -> str | None:
    """Why the fused context K/V chain is not bitwise the stock one, or None."""
    return _context_part(model).reason


def _context_part(model: DraftModel) -> Part:
    name = "the context K/V chain"
    if not model.layers:
        return Part(name, reason="no layers")
    h = model.config.hidden_size
    try:
        hidden = K.norm_constants(model.hidden_norm, h)
        pres = [K.norm_constants(layer.input_norm, h) for layer in model.layers]
        if len(set(pres)) != 1:
            raise ValueError("layer input norms that differ in more than their weights")
        norms = K.ContextNormConstants(h, len(model.layers), hidden, pres[0])
        if model.layers[0].input_norm.out_dtype != torch.bfloat16:
            raise ValueError("layer input norms that output other than bf16")
        attn = model.layers[0].self_attn
        store = K.context_store_constants(attn.k_norm, model.config.num_kv_heads, attn.rotary)
        for layer in model.layers:
            a = layer.self_attn
            if type(a) is not DraftAttention or type(a.k_norm) is not HeadNorm or a.k_norm.weight is not None:
                raise ValueError("a layer whose attention or K-norm is not the stock one")
            if a.qkv_proj.dtype != torch.bfloat16:
                raise ValueError("a K/V projection weight other than bfloat16")
    except ValueError as error:
        return Part(name, reason=str(error))
    return Part(name, K.ContextConstants(norms, store))


def qkv_front_unsupported(attn: DraftAttention) -> str | None:
    """Why this layer's QKV projection, QK-norm, RoPE and KV insert may not
    run as the fused QKV front (1 to 16 tokens), or None."""
    return _try("", K.qkv_front_constants, attn).reason


def _projection_unsupported(weight: torch.Tensor, hidden: int) -> str | None:
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] != hidden:
        return f"a weight that is not a plain row-parallel bf16 projection into {hidden} features"
    return None


def plan_draft(model: DraftModel, target: Target | None = None) -> DraftPlan:
    """Plan every part of ``model`` for ``target`` (default: one H200)."""
    target = target or Target()
    plan = DraftPlan(target)
    reason = draft_unsupported(model, target)
    if reason is not None:
        plan.draft_reason = reason
        return plan
    # A rank's shard (dspark_core.reference.tp.TPDraftModel) plans at its own TP size.
    model_tp = getattr(model, "tp", 1)
    sharded = model_tp > 1
    if sharded and model_tp != target.tp:
        raise ValueError(f"a TP{model_tp} shard of the draft cannot be planned for TP{target.tp}")
    h = model.config.hidden_size

    for name, (post, conn, pre) in zip(_boundary_names(model), model.boundaries()):
        part = _try(name, K.boundary_constants, post, conn, pre, h)
        plan.boundaries.append(_with_kernels(part, target, policy.BOUNDARY))

    first = model.layers[0].input_norm if model.layers else model.norm
    part = _try("the draft's first norm", K.row_norm_constants, first, h)
    if part.fused and part.constants.out_dtype != "bf16":
        part = Part(part.name, reason=f"an input norm that outputs {part.constants.out_dtype}, not bf16")
    plan.input_norm = _with_kernels(part, target, policy.ROW_NORM)

    plan.context = _with_kernels(_context_part(model), target, policy.CONTEXT_NORMS, policy.CONTEXT_STORE)

    for i, layer in enumerate(model.layers):
        part = _try(f"layer {i}'s QKV front", K.qkv_front_constants, layer.self_attn)
        plan.qkv_fronts.append(_with_kernels(part, target, policy.QKV_FRONT))
        # The same constants: QK-norm, RoPE and the insert on the stock
        # projection's output (bit for bit the stock front), for the calls the
        # fused front does not take or where it is not used.
        part = _try(f"layer {i}'s QKV epilogue", K.qkv_front_constants, layer.self_attn)
        plan.qkv_epilogues.append(_with_kernels(part, target, policy.QKV_EPILOGUE))
        gate = _with_kernels(_o_gate_part(i, layer.self_attn), target, policy.O_GATE)
        attention = _with_kernels(_attention_part(i, layer.self_attn, model.config), target, policy.ATTENTION)
        if attention.fused and target.attention == "staged":
            # The staged kernel (the executor's default) takes the o-gate into
            # its epilogue where the o-gate fuses: its constants say so.
            eps = gate.constants.eps if gate.fused else None
            attention = Part(attention.name, dataclasses.replace(
                attention.constants, staged_slots=policy.DEFAULT_STAGED_SLOTS, o_gate_eps=eps))
            if gate.fused:
                gate = Part(gate.name, gate.constants, via=attention.name)
        plan.attentions.append(attention)
        plan.o_gates.append(gate)
        part = _try(f"layer {i}'s MLP activation", K.mlp_activation_constants, layer.mlp)
        plan.mlp_activations.append(_with_kernels(part, target, policy.MLP_ACTIVATION))

    if target.tp == 1:  # at TP the branch GEMMs feed the all-reduce (the package GEMM's parts)
        for i, layer in enumerate(model.layers):
            for role in policy.GEMV_ROLES:
                plan.gemvs.append(_gemv_part(i, role, policy.gemv_weight(layer, role), target))

    plan.all_reduce = _with_kernels(_all_reduce_part(model, plan), target, policy.ALL_REDUCE_BOUNDARY)
    if target.tp > 1:
        for i, layer in enumerate(model.layers):
            for role, weight in (("o_proj", layer.self_attn.o_proj), ("down_proj", layer.mlp.down)):
                plan.package_gemms.append(_package_gemm_part(i, role, weight, h, plan, sharded))
    return plan


def _gemv_part(i: int, role: str, weight, target: Target) -> Part:
    """Layer ``i``'s ``role`` projection on the one-token GEMV (``dspark_core.spec.gemv``)."""
    name = f"layer {i}'s {role} GEMV"
    return _with_kernels(_try(name, K.gemv_constants, role, weight), target, policy.GEMV)


def _attention_part(i: int, attn, config: DraftConfig) -> Part:
    """Layer ``i``'s attention over the paged cache (``attention.paged_attention``)."""
    name = f"layer {i}'s attention"
    if type(attn) is not DraftAttention:
        return Part(name, reason=f"an attention other than the stock one ({type(attn).__name__})")
    if attn.head_dim != K.HEAD_DIM:
        return Part(name, reason=f"{attn.head_dim}-wide heads, not {K.HEAD_DIM}")
    if attn.num_kv_heads < 1 or attn.num_heads % attn.num_kv_heads:
        return Part(name, reason=f"{attn.num_heads} query heads do not group over {attn.num_kv_heads} KV heads")
    return Part(name, K.AttentionConstants(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                           config.kv_block_size, "int64"))


def _o_gate_part(i: int, attn) -> Part:
    """Layer ``i``'s o-norm with its sigmoid o-gate (``layers.o_gate``)."""
    name = f"layer {i}'s o-gate"
    if not getattr(attn, "use_o_gate", False):
        return Part(name, reason="the layer has no o-gate")
    return _try(name, K.o_gate_constants, attn.o_norm, attn.num_heads)


def _all_reduce_part(model: DraftModel, plan: DraftPlan) -> Part:
    name = "the fused all-reduce"
    tp = plan.target.tp
    if tp == 1:
        return Part(name, reason="TP1: there is no all-reduce")
    if tp not in policy.FUSED_TPS:
        return Part(name, reason=f"TP{tp}, not one of the mailbox's TP sizes {policy.FUSED_TPS}")
    for b in plan.boundaries:
        if not b.fused:
            return Part(name, reason=f"{b.name} keeps its stock modules (every rank must fuse every boundary)")
    h = model.config.hidden_size
    for i, layer in enumerate(model.layers):
        if type(layer.mlp) is not GatedMLP:
            return Part(name, reason=f"layer {i}: a feed-forward other than the stock MLP")
        for weight in (layer.self_attn.o_proj, layer.mlp.down):
            why = _projection_unsupported(weight, h)
            if why:
                return Part(name, reason=f"layer {i}: {why}")
    return Part(name, K.AllReduceConstants(tp))


def _package_gemm_part(
    i: int, role: str, weight: torch.Tensor, hidden: int, plan: DraftPlan, sharded: bool
) -> Part:
    name = f"layer {i}'s {role} package GEMM"
    tp = plan.target.tp
    if tp not in policy.PACKAGE_GEMM_TPS:
        return Part(name, reason=f"TP{tp} runs its branch GEMMs on cuBLAS")
    if not plan.all_reduce.fused:
        return Part(name, reason="the all-reduce is not fused (nothing to publish into)")
    why = _projection_unsupported(weight, hidden)
    if why:
        return Part(name, reason=why)
    k = weight.shape[1]
    if sharded:  # a rank's shard (dspark_core.reference.tp): its weight holds K / tp already
        k_shard = k
    elif k % tp:
        return Part(name, reason=f"{k} input features do not split over TP{tp}")
    else:
        k_shard = k // tp
    shape = policy.draft_gemm_shape(role, k_shard)
    unit = policy.gemm_step_unit(shape.split_k)
    if k_shard % unit:
        return Part(name, reason=f"a shard of {k_shard} input features is not a multiple of {unit} (the steps "
                                 f"of the package GEMM's {4 * shape.split_k} warps, 32 features each)")
    constants = K.PackageGemmConstants(role, hidden, k_shard, shape.tile_n, shape.split_k, shape.max_rows)
    return _with_kernels(Part(name, constants), plan.target, policy.PACKAGE_GEMM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_core.planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="a DraftConfig JSON file (default: the reference draft)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--platform", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--num-sms", type=int, default=132)
    parser.add_argument(
        "--kernels",
        default="installed",
        help="'installed' (what the installed backends provide), 'all' (the whole design) "
        "or a comma-separated list of kernel names",
    )
    parser.add_argument("--attention", default="staged", choices=policy.ATTENTION_VARIANTS,
                        help="the attention kernel's variant (default: staged)")
    parser.add_argument("--front", action="store_true", help="plan with the opt-in fused QKV front")
    parser.add_argument("--gemv", action="store_true", help="plan with the opt-in one-token GEMV projections")
    parser.add_argument("--print-config", action="store_true", help="print the config's JSON too")
    args = parser.parse_args(argv)
    try:
        config = DraftConfig.from_json(args.config) if args.config else DraftConfig()
        if args.kernels == "installed":
            kernels = policy.installed_kernels()
        elif args.kernels == "all":
            kernels = policy.ALL_KERNELS
        else:
            kernels = frozenset(k for k in args.kernels.split(",") if k)
        target = Target(args.platform, args.arch, args.num_sms, args.tp, kernels, attention=args.attention)
        target = target.opt_in(policy.asked_opt_ins(args.front, args.gemv))
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.to_json())
    plan = plan_draft(DraftModel(config, device="meta"), target)
    print(plan.format())
    refused = plan.refused()
    if refused:
        print("Why:")
        for line in refused:
            print(f"  - {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
