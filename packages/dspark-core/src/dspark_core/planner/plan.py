"""The planner: which parts of a DSpark draft run fused, and why any part
keeps its stock modules.

``plan_draft(draft, target)`` takes a model-neutral ``DraftDescription``
(``dspark_core.runtime.description``; any model's adapter builds one) and
asks, per part, the questions a fused kernel must answer yes to before it may
replace the stock modules bit for bit: the whole draft (platform, dtypes),
the first norm, each residual boundary, the context K/V chain, each layer's
QKV epilogue, attention, o-gate and MLP activation, at TP1 the
opt-in one-token GEMV projections, at TP the fused all-reduce and the opt-in
package GEMMs. A refused part keeps its stock modules and the plan says why,
in words: a constants builder's ``Unsupported`` is a refusal, any other
exception a bug that propagates.

The plan reads sizes, dtypes and the adapter's facts only (a draft on the
meta device plans), so every rank of a TP group makes the same plan. The CLI
is ``dspark_core.planner.cli`` (``python -m dspark_core.planner``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dspark_core.contracts import constants as K
from dspark_core.contracts import limits
from dspark_core.errors import Unsupported, quoted
from dspark_core.planner import policy
from dspark_core.planner.policy import Target
from dspark_core.runtime.description import Attention, DraftDescription, Layer, check_draft


@dataclass(frozen=True)
class Part:
    """One planned part: ``fused`` with its kernel's ``constants``, or stock
    with the ``reason`` in words. ``via``: the name of the fused part whose
    kernel runs this one in its epilogue, or None."""

    name: str
    constants: object | None = None
    reason: str | None = None
    via: str | None = None

    @property
    def fused(self) -> bool:
        return self.reason is None

    @property
    def at_build(self) -> bool:
        """A projection whose row counts the build decides (the ordered
        GEMM's: DSpark's kernel where the check against the live cuBLAS
        finds cuBLAS's order and the timing on the GPU finds it faster,
        cuBLAS elsewhere): no plan sees that, so the plan does not call it
        fused."""
        return self.fused and isinstance(self.constants, K.OrderedGemmConstants)

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
    is set where no part fuses (the draft keeps its stock layers);
    ``hidden_size`` and ``num_layers`` are the planned draft's (the executor
    refuses a plan of another draft)."""

    target: Target
    draft_reason: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    input_norm: Part | None = None
    boundaries: list[Part] = field(default_factory=list)
    context: Part | None = None
    qkv_epilogues: list[Part] = field(default_factory=list)
    attentions: list[Part] = field(default_factory=list)
    o_gates: list[Part] = field(default_factory=list)
    mlp_activations: list[Part] = field(default_factory=list)
    all_reduce: Part | None = None
    package_gemms: list[Part] = field(default_factory=list)
    # At TP1, per layer, one per policy.GEMV_ROLES role in that order.
    gemvs: list[Part] = field(default_factory=list)
    # Per layer, one per policy.ordered_gemm_roles(tp) role in that order.
    ordered_gemms: list[Part] = field(default_factory=list)

    def parts(self) -> list[Part]:
        single = [p for p in (self.input_norm, self.context, self.all_reduce) if p is not None]
        return [*single, *self.boundaries, *self.qkv_epilogues, *self.attentions, *self.o_gates,
                *self.mlp_activations, *self.package_gemms, *self.gemvs, *self.ordered_gemms]

    def refused(self) -> list[str]:
        """Every stock part the caller did not merely decline, with its reason."""
        if self.draft_reason is not None:
            return [f"the whole draft keeps its stock layers: {self.draft_reason}"]
        return [p.refusal for p in self.parts() if not p.fused and not p.declined]

    def fused_count(self) -> tuple[int, int]:
        """``(fused, planned)``: the parts that run fused, of the parts the
        plan was asked for (declined opt-ins are not counted, nor the
        projections decided at build: ``Part.at_build``, ``at_build_count``)."""
        parts = [p for p in self.parts() if not p.declined and not p.at_build]
        return sum(p.fused for p in parts), len(parts)

    def at_build_count(self) -> int:
        """The projections whose row counts the build decides (``Part.at_build``)."""
        return sum(p.at_build for p in self.parts())

    def format(self) -> str:
        """The plan as text: a header naming the target, one line per part,
        each distinct reason once with the parts it keeps stock, each opt-in
        not asked for once."""
        t = self.target
        lines = [f"DSpark plan for {t.describe()}"]
        if not t.validated and t.platform == "cuda":
            lines.append(f"  (the fused path has never run on {t.arch} at TP{t.tp}: compile-checked only)")
        if self.draft_reason is not None:
            lines.append(f"  every part stays stock: {self.draft_reason}")
            return "\n".join(lines)
        reasons: dict[str, list[str]] = {}
        declined: dict[str, list[str]] = {}
        for p in self.parts():
            if p.at_build:
                what = f"{type(p.constants).__name__} {p.constants.key()}"
                lines.append(f"  {p.name:<38} decided at build: DSpark's ordered GEMM or cuBLAS per row count "
                             f"({what})")
            elif p.fused:
                what = f"{type(p.constants).__name__} {p.constants.key()}"
                status = f"fused into {p.via}'s kernel" if p.via else "fused"
                lines.append(f"  {p.name:<38} {status} ({what})")
            elif p.declined:
                declined.setdefault(p.reason, []).append(p.name)
            else:
                lines.append(f"  {p.name:<38} stock (reason {_reason_index(reasons, p)})")
        fused, total = self.fused_count()
        later = self.at_build_count()
        lines.append(f"  {fused} of {total} parts fused" + (f"; {later} projections decided at build" if later else ""))
        for n, reason in enumerate(reasons, 1):
            lines.append(f"  reason {n}: {reason}")
        for reason, names in declined.items():
            lines.append(f"  not asked for ({len(names)} parts): {reason}")
        lines += _checked_at_build(self)
        return "\n".join(lines)


def _checked_at_build(plan: DraftPlan) -> list[str]:
    """The plan's line for the projections it leaves to the build
    (``Part.at_build``; no plan sees the live cuBLAS or times the GPU)."""
    count = plan.at_build_count()
    if not count:
        return []
    margin = limits.ORDERED_GEMM_DECIDE_MARGIN
    return [f"  decided at build ({count} projections): a row count runs DSpark's ordered GEMM only where the "
            "check against the live cuBLAS finds cuBLAS's order (the stock bits) and one of its kernels then "
            f"measures at least {margin:.0%} faster than cuBLAS on the GPU (timed once, cached per card, driver, "
            "cuBLAS, shape and row count); cuBLAS runs every other row count"]


def _reason_index(reasons: dict[str, list[str]], part: Part) -> int:
    reasons.setdefault(part.reason, []).append(part.name)
    return list(reasons).index(part.reason) + 1


def _kernel_missing(target: Target, *kernels: str, unchecked: bool = True) -> str | None:
    """Why the kernels are not there for a part: an opt-in not asked for
    (first, whatever else holds), excluded, not installed, or not checked
    on this target (``target.unchecked``'s reason); None if they are."""
    for kernel in kernels:
        if kernel in target.declined:
            return policy.OPT_IN[kernel]
    reasons = dict(target.unchecked) if unchecked else {}
    for kernel in kernels:
        if kernel in target.excluded:
            return f"the caller excluded the {kernel} kernel"
        if kernel not in target.kernels:
            return f"the installed backends do not provide the {kernel} kernel"
        if kernel in reasons:
            return reasons[kernel]
    return None


def _try(name: str, build: Callable, *args, **kwargs) -> Part:
    """``Part(name, build(...))``, or the refusal with the ``Unsupported``'s
    words (any other exception is a bug and propagates)."""
    try:
        return Part(name, build(*args, **kwargs))
    except Unsupported as refusal:
        return Part(name, reason=str(refusal))


def _with_kernels(part: Part, target: Target, *kernels: str) -> Part:
    """``part`` with its kernels' availability: an opt-in the caller did not
    ask for makes it "not asked for" whether or not it would fuse (so the
    count of parts asked for is the same for every deployment); a kernel
    excluded or not installed makes a fusable part stock."""
    missing = _kernel_missing(target, *kernels)
    if missing is None:
        return part
    stock = Part(part.name, reason=missing)
    return stock if part.fused or stock.declined else part


def layer_weight_bytes(draft: DraftDescription) -> int:
    """The bytes of the draft's layer projections on this rank (QKV, o_proj,
    gate-up and down weights): a lower bound of what its GPU must hold."""
    weights = (w for layer in draft.layers for w in (layer.attention.qkv_weight, layer.attention.o_proj_weight,
                                                     layer.mlp.gate_up_weight, layer.mlp.down_weight))
    return sum(w.numel() * w.element_size() for w in weights if isinstance(w, torch.Tensor))


def sizes_unsupported(draft: DraftDescription) -> str | None:
    """Why the draft's sizes are beyond every kernel or every GPU, or None:
    the hidden and intermediate sizes, a layer's query and QKV rows and its
    KV block at most ``K.MAX_SIZE`` (32-bit indexing), its query and KV heads
    at most ``K.MAX_HEADS``, as are its heads' widths; its layers' weights
    (``layer_weight_bytes``) at most ``policy.MAX_GPU_BYTES`` (sizes below
    2^31 can still be more than a GPU holds: a hidden width of two billion,
    2^20 heads)."""
    if draft.hidden_size > K.MAX_SIZE:
        return f"a hidden size of {draft.hidden_size}, more than the kernels take ({K.MAX_SIZE})"
    nbytes = layer_weight_bytes(draft)
    if nbytes > policy.MAX_GPU_BYTES:
        return (f"{nbytes / 1e9:,.0f} GB of layer weights on a rank, more than a GPU holds "
                f"({policy.MAX_GPU_BYTES / 1e9:,.0f} GB)")
    for layer in draft.layers:
        a = layer.attention
        sizes = (("intermediate size", layer.mlp.intermediate_size, K.MAX_SIZE),
                 ("query heads", a.num_heads, K.MAX_HEADS), ("KV heads", a.num_kv_heads, K.MAX_HEADS),
                 ("columns a head", a.head_dim, K.MAX_HEADS),
                 ("query and o-gate rows", 2 * a.num_heads * a.head_dim, K.MAX_SIZE),
                 ("KV rows", 2 * a.num_kv_heads * a.head_dim, K.MAX_SIZE),
                 ("KV block size", a.kv_block_size, K.MAX_SIZE))
        for what, n, limit in sizes:
            if n > limit:
                return f"layer {layer.index}: {n} {what}, more than the kernels take ({limit})"
    return None


def draft_unsupported(draft: DraftDescription, target: Target) -> str | None:
    """Why no part of the draft runs fused, or None: it needs sizes the
    kernels take (``sizes_unsupported``), a CUDA target of a supported
    architecture, BF16 compute and an FP32 residual stream."""
    if draft.unsupported is not None:
        return draft.unsupported
    sizes = sizes_unsupported(draft)
    if sizes is not None:
        return sizes
    if target.platform != "cuda":
        return "not CUDA"
    if target.arch not in policy.ARCHS:
        return f"architecture {target.arch}, not one of {', '.join(policy.ARCHS)}"
    if draft.compute_dtype != torch.bfloat16:
        return f"compute dtype {draft.compute_dtype}, not bfloat16"
    if draft.residual_dtype != torch.float32:
        return f"residual dtype {draft.residual_dtype}, not float32"
    return None


def check_tp(draft: DraftDescription, tp: int) -> None:
    """ValueError unless a whole draft (``draft.tp == 1``) splits over ``tp``
    ranks: its heads, KV heads and intermediate size divisible by ``tp``. A
    rank's shard must be planned at its own TP size."""
    if draft.tp > 1:
        if draft.tp != tp:
            raise ValueError(f"a TP{draft.tp} shard of the draft cannot be planned for TP{tp}")
        return
    for layer in draft.layers[:1]:
        a = layer.attention
        for what, n in (("query heads", a.num_heads), ("KV heads", a.num_kv_heads),
                        ("intermediate features", layer.mlp.intermediate_size)):
            if n % tp:
                raise ValueError(f"TP{tp} cannot split the draft's {n} {what} evenly over its ranks")


def context_constants(draft: DraftDescription, arch: str = "sm_90a") -> K.ContextConstants:
    """The constants of the fused context K/V chain, or Unsupported where it
    is not bitwise the draft's stock chain."""
    context = draft.context
    if not draft.layers:
        raise Unsupported("no layers")
    if context is None:
        raise Unsupported("the draft has no context K/V chain")
    if context.unsupported is not None:
        raise Unsupported(context.unsupported)
    h = draft.hidden_size
    hidden = K.norm_constants(context.hidden_norm, h, arch)
    pres = [K.norm_constants(layer.input_norm, h, arch) for layer in draft.layers]
    if len(set(pres)) != 1:
        raise Unsupported("layer input norms that differ in more than their weights")
    if draft.layers[0].input_norm.out_dtype != torch.bfloat16:
        raise Unsupported("layer input norms that output other than bf16")
    if any(layer.attention.qkv_weight.dtype != torch.bfloat16 for layer in draft.layers):
        raise Unsupported("a K/V projection weight other than bfloat16")
    norms = K.ContextNormConstants(h, len(draft.layers), hidden, pres[0])
    store = K.context_store_constants(context.k_norm, context.num_kv_heads, context.rope)
    return K.within_limits(K.ContextConstants(norms, store))


def plan_draft(draft: DraftDescription, target: Target | None = None) -> DraftPlan:
    """Plan every part of ``draft`` for ``target`` (default: one H200).
    ValueError where ``target.tp`` cannot split the draft; TypeError for a
    ``draft`` that is no DraftDescription or a ``target`` that is no Target."""
    check_draft(draft)
    target = Target() if target is None else target
    if not isinstance(target, Target):
        raise TypeError(f"target must be a policy.Target, not {type(target).__name__} {quoted(target)}")
    check_tp(draft, target.tp)
    plan = DraftPlan(target, hidden_size=draft.hidden_size, num_layers=len(draft.layers))
    reason = draft_unsupported(draft, target)
    if reason is not None:
        plan.draft_reason = reason
        return plan
    h = draft.hidden_size

    for boundary in draft.boundaries():
        part = _try(boundary.name, K.boundary_constants, boundary, h, target.arch)
        plan.boundaries.append(_with_kernels(part, target, policy.BOUNDARY))

    part = _try("the draft's first norm", K.row_norm_constants, draft.first_norm, h, torch.bfloat16, target.arch)
    if part.fused and part.constants.out_dtype != "bf16":
        part = Part(part.name, reason=f"an input norm that outputs {part.constants.out_dtype}, not bf16")
    plan.input_norm = _with_kernels(part, target, policy.ROW_NORM)

    part = _try("the context K/V chain", context_constants, draft, target.arch)
    plan.context = _with_kernels(part, target, policy.CONTEXT_CHAIN)

    for layer in draft.layers:
        _plan_layer(plan, layer, target)
        for role in policy.ordered_gemm_roles(target.tp):
            plan.ordered_gemms.append(_ordered_gemm_part(layer, role, target))

    if target.tp == 1:
        for layer in draft.layers:
            for role in policy.GEMV_ROLES:
                name = f"layer {layer.index}'s {role} GEMV"
                weight = policy.gemv_weight(layer, role)
                part = (Part(name, reason="the layer has no such projection") if weight is None
                        else _try(name, K.gemv_constants, role, weight))
                plan.gemvs.append(_with_kernels(part, target, policy.GEMV))
    else:
        plan.all_reduce = _with_kernels(_all_reduce_part(draft, plan), target, policy.ALL_REDUCE_BOUNDARY)
        for layer in draft.layers:
            for role, weight in (("o_proj", layer.attention.o_proj_weight), ("down_proj", layer.mlp.down_weight)):
                plan.package_gemms.append(_package_gemm_part(layer.index, role, weight, draft, plan,
                                                             layer.gemm_unsupported))
    return plan


def _plan_layer(plan: DraftPlan, layer: Layer, target: Target) -> None:
    i, attn = layer.index, layer.attention
    # QK-norm, RoPE and the insert on the stock projection's output (bit for
    # bit the model's own, ``Attention.front_from``).
    part = _try(f"layer {i}'s QKV epilogue", K.qkv_epilogue_constants, attn)
    plan.qkv_epilogues.append(_with_kernels(part, target, policy.QKV_EPILOGUE))
    gate = _with_kernels(_o_gate_part(i, attn, target.arch), target, policy.O_GATE)
    attention = _with_kernels(_attention_part(i, attn), target, policy.ATTENTION)
    if attention.fused and target.attention == "staged":
        # The staged kernel takes the o-gate into its epilogue where the
        # o-gate fuses: its constants say so.
        eps = gate.constants.eps if gate.fused else None
        attention = Part(attention.name, dataclasses.replace(
            attention.constants, staged_slots=policy.DEFAULT_STAGED_SLOTS, o_gate_eps=eps,
            o_gate_arch=gate.constants.arch if gate.fused else "sm_90a"))
        if gate.fused:
            gate = Part(gate.name, gate.constants, via=attention.name)
    plan.attentions.append(attention)
    plan.o_gates.append(gate)
    part = _try(f"layer {i}'s MLP activation", K.mlp_activation_constants, layer.mlp)
    plan.mlp_activations.append(_with_kernels(part, target, policy.MLP_ACTIVATION))


def _ordered_gemm_part(layer: Layer, role: str, target: Target) -> Part:
    """Layer ``layer``'s projection ``role`` on the ordered GEMM: cuBLAS's
    own summation order, found for each row count by the build-time check
    (``dspark_core.runtime.gemm_check``) against the live cuBLAS; a row count
    without an order runs the stock projection."""
    name = f"layer {layer.index}'s {role} projection"
    weight = policy.gemv_weight(layer, role)
    if weight is None:
        return Part(name, reason="the layer has no such projection")
    if layer.gemm_unsupported is not None:
        return Part(name, reason=layer.gemm_unsupported)
    return _with_kernels(_try(name, K.ordered_gemm_constants, role, weight), target, policy.ORDERED_GEMM)


def _attention_part(i: int, attn: Attention) -> Part:
    """Layer ``i``'s attention over the paged cache (``spec.attention.paged_attention``)."""
    name = f"layer {i}'s attention"
    if attn.attention_unsupported is not None:
        return Part(name, reason=attn.attention_unsupported)
    if attn.attention_operands is None:
        return Part(name, reason="the model's attention is not the paged attention the kernel reproduces")
    return _try(name, lambda: K.within_limits(K.AttentionConstants(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                                   attn.kv_block_size, "int64")))


def _o_gate_part(i: int, attn: Attention, arch: str) -> Part:
    """Layer ``i``'s o-norm with its sigmoid o-gate."""
    name = f"layer {i}'s o-gate"
    if not attn.use_o_gate or attn.o_norm is None:
        return Part(name, reason="the layer has no o-gate")
    return _try(name, K.o_gate_constants, attn.o_norm, attn.num_heads, arch)


def _projection_unsupported(weight: torch.Tensor, hidden: int) -> str | None:
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] != hidden:
        return f"a weight that is not a plain row-parallel bf16 projection into {hidden} features"
    return None


def _all_reduce_part(draft: DraftDescription, plan: DraftPlan) -> Part:
    name = "the fused all-reduce"
    tp = plan.target.tp
    if tp not in policy.FUSED_TPS:
        return Part(name, reason=f"TP{tp}, not one of the mailbox's TP sizes {policy.FUSED_TPS}")
    for b in plan.boundaries:
        if not b.fused:
            return Part(name, reason=f"{b.name} keeps its stock modules (every rank must fuse every boundary)")
    for layer in draft.layers:
        if layer.mlp.unsupported is not None:
            return Part(name, reason=f"layer {layer.index}: {layer.mlp.unsupported}")
        for weight in (layer.attention.o_proj_weight, layer.mlp.down_weight):
            why = "no output projection" if weight is None else _projection_unsupported(weight, draft.hidden_size)
            if why:
                return Part(name, reason=f"layer {layer.index}: {why}")
    return Part(name, K.AllReduceConstants(tp))


def _package_gemm_part(i: int, role: str, weight: torch.Tensor, draft: DraftDescription, plan: DraftPlan,
                       gemm_unsupported: str | None = None) -> Part:
    """Layer ``i``'s branch projection ``role`` publishing its partial into
    the mailbox: on the package GEMM (its own order) where that opt-in is
    asked, else on the ordered GEMM where the ordered GEMM opt-in is
    (``_exact_package_part``: cuBLAS's order, so vLLM's bits)."""
    name = f"layer {i}'s {role} package GEMM"
    tp, hidden = plan.target.tp, draft.hidden_size
    # Not asked for, excluded or not installed: the exact package GEMM where the ordered GEMM is there.
    missing = _kernel_missing(plan.target, policy.PACKAGE_GEMM, unchecked=False)
    if missing and not _kernel_missing(plan.target, policy.ORDERED_GEMM, unchecked=False):
        if gemm_unsupported is not None:  # the exact package GEMM gives F.linear's bits, not that backend's
            return Part(name, reason=gemm_unsupported)
        return _exact_package_part(name, role, weight, draft, plan)
    if missing:
        return Part(name, reason=missing)
    if tp not in policy.PACKAGE_GEMM_TPS:
        return Part(name, reason=f"TP{tp} runs its branch GEMMs on cuBLAS")
    if not plan.all_reduce.fused:
        return Part(name, reason="the all-reduce is not fused (nothing to publish into)")
    why = "no such projection" if weight is None else _projection_unsupported(weight, hidden)
    if why:
        return Part(name, reason=why)
    k = weight.shape[1]
    # A rank's shard holds K / tp already; a whole draft planned for TP is split.
    k_shard = k if draft.tp > 1 else k // tp
    if draft.tp == 1 and k % tp:
        return Part(name, reason=f"{k} input features do not split over TP{tp}")
    shape = policy.draft_gemm_shape(role, k_shard)
    unit = policy.gemm_step_unit(shape.split_k)
    if k_shard % unit:
        return Part(name, reason=f"a shard of {k_shard} input features is not a multiple of {unit} (the steps "
                                 f"of the package GEMM's {4 * shape.split_k} warps, 32 features each)")
    return _with_kernels(_try(name, K.package_gemm_constants, role, hidden, k_shard, shape.tile_n, shape.split_k,
                              shape.max_rows), plan.target, policy.PACKAGE_GEMM)


def _exact_package_part(name: str, role: str, weight: torch.Tensor, draft: DraftDescription,
                        plan: DraftPlan) -> Part:
    """The exact package GEMM (``dspark_comm.cutedsl.ordered_package``): a
    rank's shard of ``role`` on the ordered GEMM, each row count bound only
    where the build-time check against the live cuBLAS found its order on
    every rank, its BF16 partial (cuBLAS's bits) published into the mailbox;
    other row counts run cuBLAS, then the fused all-reduce."""
    if not plan.all_reduce.fused:
        return Part(name, reason="the all-reduce is not fused (nothing to publish into)")
    if weight is None:
        return Part(name, reason="no such projection")
    n, k = (int(v) for v in weight.shape)
    if draft.tp == 1:  # a whole draft planned for TP: its shard's K (the rows-parallel split of K)
        if k % plan.target.tp:
            return Part(name, reason=f"{k} input features do not split over TP{plan.target.tp}")
        weight = torch.empty(n, k // plan.target.tp, dtype=weight.dtype, device="meta")
    return _with_kernels(_try(name, K.ordered_gemm_constants, "o_proj" if role == "o_proj" else "down", weight),
                         plan.target, policy.ORDERED_GEMM)


__all__ = ["DraftPlan", "Part", "check_tp", "context_constants", "draft_unsupported", "plan_draft",
           "sizes_unsupported"]
