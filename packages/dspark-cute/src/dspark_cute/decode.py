"""The specialized decode of the reference DSpark draft: ``DraftDecode`` runs
``DraftModel.forward`` part by part as ``dspark_core.planner.plan.DraftPlan`` says,
each fused part on its CuTe kernel and each refused part on its stock
modules, bit for bit the stock forward (the QKV front up to its projection's
summation order).

``build_draft_decode(model)`` plans the draft for the device it lives on and
the kernels this package provides, logs every part that keeps its stock
modules with the reason, and returns the prepared decode, or None (with the
reason logged) where no part fuses, e.g. on a CPU ("not CUDA"). Its default
is bit for bit the stock forward: the fused QKV front (whose projection sums
in its own order) is opt-in (``qkv_front=True``); without it each layer runs
the stock projection and then the QKV epilogue kernel, which measured as fast
on an H200 (faster at m = 1 and 16, 3-5 µs slower at m = 4).

``prepare`` compiles every kernel variant ``run`` may launch before any CUDA
graph is captured; a compile during capture raises (``host.assert_not_capturing``).
A call the bound kernel does not cover at run time (rows beyond what it
takes, a strided operand) runs that part's stock modules and logs why once.

Tensor parallelism plugs in per boundary: ``DraftDecode(..., all_reduce=...)``
takes an object with ``takes(partial)`` and ``run(index, partial, stream,
store_stream)`` (dspark-comm's fused all-reduce boundary); without it the
draft is TP1 and every branch is already whole.

The one-token GEMV (``gemv=True``, opt-in; ``dspark_cute.gemv``) runs each
layer's QKV, o_proj, gate_up and down projections of a one-token step on a
coalesced warp-per-row kernel in the order ``dspark_core.spec.gemv`` states (bit
for bit that spec, not cuBLAS's bits), launched with PDL so its weight
streams while the small kernel before it runs; steps of more tokens keep the
stock projections.

The L2 weight prefetch (``prefetch``; ``dspark_cute.weight_prefetch``; on by
default at TP1 in ``build_draft_decode``)
brings the first bytes of every row of each GEMM's weight into L2 while the
small kernels before that GEMM run. ``prefetch_mode`` "inline" (the default)
launches it on the decode's stream right after the first small kernel that
follows the previous GEMM (the first norm, the QKV epilogue or front, a
boundary, the activation), as a PDL dependent that completes only after that
kernel; "side" forks it onto a side stream right after the previous GEMM and
joins it before the next. ``run`` ends with nothing pending. It changes no
value.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Protocol

import torch

from dspark_core.planner.plan import DraftPlan, plan_draft
from dspark_core.planner.policy import (  # noqa: F401 (ATTENTION_VARIANTS, GEMV and QKV_FRONT re-exported)
    ATTENTION_VARIANTS,
    GEMV,
    QKV_FRONT,
    asked_opt_ins,
    device_target,
)
from dspark_core.reference.model import DraftModel, StepInputs, attend, check_inputs
from dspark_core.spec.layers import capturing, linear, o_gate, residual_boundary

log = logging.getLogger("dspark.decode")
# Bytes a row of each GEMM weight that the L2 prefetch brings in while the
# small kernels before that GEMM run (dspark_cute.weight_prefetch; the H200
# probe's best: 256-512). build_draft_decode turns it on at TP1 (inline: 1-3
# us off a step at m = 1 and 4 on an H200; the side mode was 6-8 us slower);
# DSPARK_PREFETCH=0 turns it off, =1 on (also at TP), =side picks the side mode.
DEFAULT_PREFETCH = {"qkv_proj": 256, "o_proj": 256, "gate_up": 256, "down": 512}
_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def provided_kernels() -> frozenset[str]:
    """The kernels of this package that are implemented (``_provides``)."""
    from dspark_cute._provides import KERNELS

    return frozenset(KERNELS)


class AllReduceBoundaries(Protocol):
    """What the executor needs of a fused all-reduce boundary (dspark-comm):
    ``takes`` decides from the row count alone (the same on every rank),
    ``run`` all-reduces the partial and runs boundary ``index`` on the sum,
    ``all_reduce`` is the stock all-reduce for the calls it does not take.
    An adapter may also have ``project(index, x, weight) -> (partial,
    published)``: the branch GEMM, which may publish the partial into the
    mailbox itself (the package GEMM); ``run(..., published=True)`` then only
    consumes it."""

    tp: int

    def takes(self, partial: torch.Tensor) -> bool: ...

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor: ...

    def run(self, index: int, partial, stream: torch.Tensor, store_stream: bool, published: bool = False): ...


class DraftDecode:
    """The draft's forward with its fused parts, as ``plan`` says. Build with
    ``build_draft_decode``; ``prepare`` binds and compiles the kernels."""

    def __init__(self, model: DraftModel, plan: DraftPlan, all_reduce: AllReduceBoundaries | None = None,
                 prefetch: dict[str, int] | None = None, prefetch_mode: str = "inline") -> None:
        # The plan's attention constants are the variant's (policy.Target.attention).
        self.attention_variant = plan.target.attention
        # Bytes a row per weight role, or None: no prefetch (WeightPrefetcher checks them).
        self.prefetcher = None
        if prefetch:
            from dspark_cute.cutedsl.prefetch import WeightPrefetcher

            self.prefetcher = WeightPrefetcher(prefetch, next(model.parameters()).device)
        if plan.draft_reason is not None:
            raise ValueError(f"the plan keeps the whole draft stock ({plan.draft_reason}): nothing to run fused")
        model_tp = getattr(model, "tp", 1)
        if model_tp > 1 and all_reduce is None:
            # Without it the branches' partials would never be summed.
            raise ValueError(f"a TP{model_tp} shard of the draft needs its all-reduce boundaries (all_reduce=...)")
        if all_reduce is not None and model_tp > 1 and all_reduce.tp != model_tp:
            raise ValueError(f"TP{all_reduce.tp} all-reduce boundaries for a TP{model_tp} shard")
        self.model = model
        self.plan = plan
        self.all_reduce = all_reduce
        self.layers = list(model.layers)
        self.bounds = model.boundaries()
        self.dtype = model.default_dtype
        # Bound kernels per part (prepare); None keeps the stock modules.
        self.input_norm = None
        self.boundaries: list = []
        self.fronts: list = []
        self.epilogues: list = []
        self.attentions: list = []
        self.o_gates: list = []
        self.activations: list = []
        # (layer, role) -> the bound one-token GEMV (policy.GEMV_ROLES), where the plan fuses it.
        self.gemvs: dict = {}
        self._gemv_weights: set = set()  # their weights' addresses: the prefetch skips them at m = 1
        self._one_row = False
        self.context = None
        self.prepared = False

    # -- binding -------------------------------------------------------------
    def prepare(self) -> None:
        """Bind every planned part to its kernel and compile the variants
        ``run`` launches: the first norm; every boundary with the stream it
        gets (the first one on an FP32 and a BF16 stream: BF16 embeddings
        are the stream as they are), storing the new stream except the last,
        both gate timings; each layer's QKV front, attention, o-gate and MLP
        activation; the context chain."""
        from dspark_cute.cutedsl.norms.boundary import DraftBoundary
        from dspark_cute.cutedsl.norms.row_norm import RowNorm

        plan = self.plan
        if plan.input_norm is not None and plan.input_norm.fused:
            norm = self.layers[0].input_norm if self.layers else self.model.norm
            self.input_norm = RowNorm(plan.input_norm.constants, norm.weight)
            self.input_norm.prepare()
        self.boundaries = []
        last = len(self.bounds) - 1
        for index, (part, (post, conn, pre)) in enumerate(zip(plan.boundaries, self.bounds)):
            if not part.fused:
                self.boundaries.append(None)
                continue
            fused = DraftBoundary(part.constants, conn.alpha, conn.beta, post.weight, pre.weight)
            dtypes = (torch.float32, torch.bfloat16) if index == 0 else (torch.float32,)
            fused.prepare(stream_dtypes=dtypes, store_stream=(index != last,))
            self.boundaries.append(fused)
        bound = [self._bind_layer(i) for i in range(len(self.layers))]
        self.fronts, self.epilogues, self.attentions, self.o_gates, self.activations = (
            [b[k] for b in bound] for k in range(5)
        )
        self.gemvs = self._bind_gemvs()
        self._gemv_weights = {g.weight.data_ptr() for g in self.gemvs.values()}
        self.context = self._bind_context(plan.context)
        if self.prefetcher is not None:
            self.prefetcher.prepare()
        self.prepared = True

    def _kernel_class(self, part, module: str, name: str):
        """The class ``dspark_cute.<module>.<name>`` for a fused ``part``; None
        for a stock part, or (logged) where the kernel is not in this build."""
        if part is None or not part.fused:
            return None
        try:
            return getattr(importlib.import_module(f"dspark_cute.{module}"), name)
        except (ImportError, AttributeError) as error:
            _log_once(logging.WARNING, f"{part.name} keeps its stock modules: {error}")
            return None

    def _bind_layer(self, index: int) -> tuple:
        """Layer ``index``'s kernels, compiled (None where a part stays stock):
        the fused QKV front (projection and epilogue), the QKV epilogue (after
        the stock projection), the attention (its "staged" variant takes the
        o-gate into its epilogue where the plan fuses the o-gate), the o-gate
        and the MLP activation."""
        plan, attn = self.plan, self.layers[index].self_attn
        parts = [plan.qkv_fronts, plan.qkv_epilogues, plan.attentions, plan.o_gates, plan.mlp_activations]
        front, epilogue, attention, gate, activation = (p[index] if index < len(p) else None for p in parts)
        table = attn.rotary.cos_sin.to(attn.qkv_proj.device) if attn.rotary is not None else None
        kernels = []
        cls = self._kernel_class(front, "cutedsl.qkv.front", "QKVFront")
        kernels.append(cls and cls(front.constants, attn.qkv_proj, attn.q_norm.weight, table))
        cls = self._kernel_class(epilogue, "cutedsl.qkv.epilogue", "QKVEpilogue")
        kernels.append(cls and cls(epilogue.constants, attn.q_norm.weight, table))
        cls = self._kernel_class(attention, "cutedsl.attention.paged", "PagedAttention")
        if cls is not None:
            # The plan's constants: the staged variant's say how many slots it
            # stages and whether it takes the o-gate into its epilogue.
            kernels.append(cls(attention.constants))
        else:
            kernels.append(None)
        cls = self._kernel_class(gate, "cutedsl.gating.o_gate", "OGate")
        kernels.append(cls and cls(gate.constants))
        cls = self._kernel_class(activation, "cutedsl.gating.mlp_activation", "MlpActivation")
        kernels.append(cls and cls(activation.constants))
        for kernel in kernels:
            if kernel is not None:
                kernel.prepare()
        return tuple(kernels)

    def _bind_gemvs(self) -> dict:
        """The one-token GEMV of every (layer, role) the plan fuses, compiled."""
        from dspark_core.planner.policy import GEMV_ROLES, gemv_weight

        gemvs = {}
        roles = list(GEMV_ROLES)
        for n, part in enumerate(self.plan.gemvs):  # per layer, in GEMV_ROLES order
            layer, role = divmod(n, len(roles))[0], roles[n % len(roles)]
            cls = self._kernel_class(part, "cutedsl.gemm.gemv", "Gemv")
            if cls is not None:
                gemvs[(layer, role)] = cls(part.constants, gemv_weight(self.layers[layer], role))
                gemvs[(layer, role)].prepare()
        return gemvs

    def _linear(self, layer: int, role: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``linear(x, weight)``: on the one-token GEMV where bound and where
        it takes ``x`` (one row), else the stock projection."""
        gemv = self.gemvs.get((layer, role))
        if gemv is not None:
            if gemv.takes(x):
                return gemv.launch(x)
            _log_once(logging.INFO, f"layer {layer}'s {role} GEMV ran stock: it takes one contiguous bf16 row, "
                      f"not {tuple(x.shape)} with strides {x.stride()}")
        return linear(x, weight)

    def _bind_context(self, part):
        cls = self._kernel_class(part, "cutedsl.context.chain", "ContextChain")
        if cls is None:
            return None
        chain = cls(self.model)
        chain.prepare()
        return chain

    # -- the forward ---------------------------------------------------------
    def _first_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_norm is not None and self.input_norm.takes(x):
            return self.input_norm.launch(x)
        if self.input_norm is not None:
            _log_once(logging.INFO, f"the first norm ran stock: rows {tuple(x.shape)} {x.dtype} not covered")
        first = self.layers[0].input_norm if self.layers else self.model.norm
        return first(x, out_dtype=self.dtype)

    def _project(self, index: int, x: torch.Tensor, weight: torch.Tensor):
        """Boundary ``index``'s branch ``x @ weight^T``: ``(partial,
        published)``. With a TP adapter that has a ``project`` (the package
        GEMM), it may publish the partial straight into the mailbox
        (``(None, True)``); otherwise the stock GEMM."""
        project = getattr(self.all_reduce, "project", None)
        if project is not None:
            return project(index, x, weight)
        return self._linear(index // 2, "o_proj" if index % 2 == 0 else "down", x, weight), False

    def _boundary(self, index: int, branch, stream: torch.Tensor, store: bool, published: bool = False):
        if published:  # the package GEMM already pushed this rank's partial
            return self.all_reduce.run(index, None, stream, store, published=True)
        if self.all_reduce is not None:
            if self.all_reduce.takes(branch):
                return self.all_reduce.run(index, branch, stream, store)
            _log_once(logging.INFO, f"boundary {index} all-reduced stock: {branch.shape[0]} rows above the mailbox")
            branch = self.all_reduce.all_reduce(branch)
        fused = self.boundaries[index]
        if fused is not None and fused.takes(branch, stream):
            return fused.launch(branch, stream, store)
        if fused is not None:
            _log_once(logging.INFO, f"boundary {index} ran stock: rows {tuple(branch.shape)} not covered")
        return residual_boundary(*self.bounds[index], branch, stream)

    def _attention(self, index: int, x: torch.Tensor, step: StepInputs, cache):
        """Layer ``index``'s attention branch, ``(partial, published)``
        (``_project``): the fused QKV front where it covers the call, else
        the stock projection with the QKV epilogue or the stock front;
        attention, the o-gate, the output projection. With the prefetch on,
        each GEMM waits for the prefetch of its weight (``_join``) and the
        o_proj weight's prefetch starts right after the QKV GEMM."""
        attn = self.layers[index].self_attn
        front = self.fronts[index] if self.fronts else None
        self._join()
        if front is not None and front.takes(x, step.positions, step.slots, cache.tensor):
            qkv = front.launch(x, step.positions, step.slots, cache.tensor)
            self._fork(attn.o_proj, "o_proj")
            self._kick()
            q, _, _, og = attn.split_qkv(qkv)
        else:
            if front is not None:
                _log_once(logging.INFO, f"layer {index}'s QKV front ran stock: {x.shape[0]} rows not covered")
            q, og = self._stock_projection_front(index, x, step, cache)
        gated = self._gated(index, q, og, step, cache)
        self._join()
        return self._project(2 * index, gated, attn.o_proj)

    def _stock_projection_front(self, index: int, x: torch.Tensor, step: StepInputs, cache):
        """``(q, og)`` of layer ``index`` from the stock QKV projection: the
        QKV epilogue kernel after it where bound and where it takes the
        call, else the stock front; the o_proj prefetch forks right after
        the projection."""
        attn = self.layers[index].self_attn
        epilogue = self.epilogues[index] if self.epilogues else None
        if epilogue is None:
            q, og = attn.front(x, step, cache)
            self._fork(attn.o_proj, "o_proj")
            self._kick()
            return q, og
        qkv = self._linear(index, "qkv_proj", x, attn.qkv_proj)
        self._fork(attn.o_proj, "o_proj")
        if epilogue.takes(qkv, step.positions, step.slots, cache.tensor):
            # run() checked positions and slots (the stock front raises there).
            q = epilogue.launch(qkv, step.positions, step.slots, cache.tensor)
            self._kick()
            return q, attn.split_qkv(qkv)[3]
        _log_once(logging.INFO, f"layer {index}'s QKV epilogue ran stock: "
                  f"{epilogue.problem(qkv, step.positions, step.slots, cache.tensor)}")
        out = attn.front_from(qkv, step, cache)
        self._kick()
        return out

    def _fork(self, weight: torch.Tensor, role: str) -> None:
        """Name the next GEMM's ``weight`` (its ``role``'s bytes a row) to the
        prefetch, where it is on (side mode: it starts now)."""
        if self.prefetcher is not None and not (self._one_row and weight.data_ptr() in self._gemv_weights):
            # (A one-token GEMV streams its own weight before its PDL wait.)
            self.prefetcher.fork(weight, role)

    def _kick(self) -> None:
        """Right after the first small kernel past a GEMM: the inline
        prefetch of the forked weight starts here."""
        if self.prefetcher is not None:
            self.prefetcher.kick()

    def _join(self) -> None:
        """The current stream waits for the pending prefetch (before a GEMM)."""
        if self.prefetcher is not None:
            self.prefetcher.join()

    def _gated(self, index: int, q, og, step: StepInputs, cache) -> torch.Tensor:
        """``DraftAttention.gated``: attention, then the o-norm and gate, on
        their kernels where bound and where they take the operands."""
        attn = self.layers[index].self_attn
        kernel = self.attentions[index] if self.attentions else None
        out = None
        if kernel is not None:
            if not getattr(kernel, "takes_strided_q", False):
                q = q.contiguous()  # the fused front's q is a strided view of its output
            gate = og if getattr(kernel, "gated", False) and og is not None else None
            error = kernel.problem(q, cache, step.attn_slots, gate=gate)
            if error is not None:
                _log_once(logging.INFO, f"layer {index}'s attention ran stock: {error}")
            else:
                # run() checked the slots against the caches (the stock raises there).
                out = kernel.launch(q, cache.tensor, step.attn_slots, gate=gate)
                if gate is not None:  # the o-gate ran in the attention's epilogue
                    return out.reshape(out.shape[0], attn.q_size)
        if out is None:
            out = attend(q, cache, step.attn_slots, attn.num_kv_heads)
        if og is None:
            return out.reshape(out.shape[0], attn.q_size)
        gate = self.o_gates[index] if self.o_gates else None
        if gate is not None and gate.takes(out, og):
            out = gate.launch(out, og)
        else:
            if gate is not None:
                _log_once(logging.INFO, f"layer {index}'s o-gate ran stock: operands {tuple(og.stride())} not covered")
            out = o_gate(out, og, attn.o_norm)
        return out.reshape(out.shape[0], attn.q_size)

    def _activation(self, index: int, gu: torch.Tensor) -> torch.Tensor:
        """``GatedMLP.activation`` on its kernel where bound and where it
        takes ``gu``."""
        kernel = self.activations[index] if self.activations else None
        if kernel is not None and kernel.takes(gu):
            return kernel.launch(gu)
        if kernel is not None:
            _log_once(logging.INFO, f"layer {index}'s MLP activation ran stock: {tuple(gu.shape)} not covered")
        return self.layers[index].mlp.activation(gu)

    @torch.no_grad()
    def run(self, hidden_states: torch.Tensor, step: StepInputs, caches) -> torch.Tensor:
        """``DraftModel.forward(hidden_states, step, caches)`` with the fused
        parts: BF16 ``[m, H]``, the same bits (QKV front: see the module)."""
        if not self.prepared:
            raise RuntimeError("DraftDecode.prepare() has not run")
        model = self.model
        if hidden_states.dim() != 2 or hidden_states.shape[1] != model.config.hidden_size:
            raise ValueError(f"the draft takes hidden states of [m, {model.config.hidden_size}]")
        if len(caches) != len(self.layers):
            raise ValueError(f"the draft takes one KV cache per layer ({len(self.layers)})")
        if any(k is not None for k in [*self.fronts, *self.epilogues, *self.attentions]) and not capturing():
            # The stock front and attention raise for these; the kernels would skip them.
            check_inputs(model, step.positions, caches, step.slots, step.attn_slots, distinct=True)
        # A BF16 row round-trips through the FP32 stream unchanged: the first
        # boundary reads it as is.
        stream = hidden_states if hidden_states.dtype == self.dtype else hidden_states.to(torch.float32)
        self._one_row = hidden_states.shape[0] == 1
        last = len(self.layers) - 1
        try:
            if self.layers:  # the first QKV weight, while the first norm runs
                self._fork(self.layers[0].self_attn.qkv_proj, "qkv_proj")
            x = self._first_norm(stream.to(self.dtype).contiguous())
            self._kick()
            for i, layer in enumerate(self.layers):
                mlp = layer.mlp
                attn_out, published = self._attention(i, x, step, caches[i])
                self._fork(mlp.gate_up, "gate_up")
                stream, ffn_in = self._boundary(2 * i, attn_out, stream, True, published)
                self._kick()
                self._join()
                gate_up = self._linear(i, "gate_up", ffn_in, mlp.gate_up)
                self._fork(mlp.down, "down")
                hidden = self._activation(i, gate_up)
                self._kick()
                self._join()
                ffn_out, published = self._project(2 * i + 1, hidden, mlp.down)
                if i != last:
                    self._fork(self.layers[i + 1].self_attn.qkv_proj, "qkv_proj")
                stream, x = self._boundary(2 * i + 1, ffn_out, stream, i != last, published)
                self._kick()
        finally:
            self._join()  # no fork outlives the step (a capture must end joined)
        return x

    def store_context_kv(self, context_states, positions, caches, slots) -> bool:
        """``DraftModel.precompute_and_store_context_kv`` on the fused chain,
        or False (nothing done) where it does not cover the call."""
        if self.context is None:
            return False
        if not capturing():
            # The stock chain raises for slots beyond a cache and positions
            # beyond the RoPE table; the kernel skips such rows: check first.
            check_inputs(self.model, positions, caches, slots)
        try:
            self.context.run(context_states, positions, caches, slots)
        except ValueError as error:
            _log_once(logging.INFO, f"the context K/V chain ran stock: {error}")
            return False
        return True


def draft_plan(model: DraftModel, tp: int = 1, exclude=frozenset(), attention: str = "staged",
               qkv_front: bool = False, gemv: bool = False) -> DraftPlan:
    """The plan of ``model`` at TP size ``tp`` for the device it lives on,
    the kernels this package provides less ``exclude`` (which the plan's
    reasons call excluded; the QKV front declined unless ``qkv_front``, the
    one-token GEMV unless ``gemv``) and the
    ``attention`` kernel variant (``ATTENTION_VARIANTS``; ValueError for
    another): the plan ``build_draft_decode`` runs, for a TP adapter to bind
    its parts to."""
    target = device_target(next(model.parameters()).device, tp).without(exclude)
    target = target.opt_in(asked_opt_ins(qkv_front, gemv))
    return plan_draft(model, target.replace(attention=attention))


def build_draft_decode(
    model: DraftModel,
    all_reduce: AllReduceBoundaries | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
    attention_variant: str | None = None,
    prefetch: dict[str, int] | bool | None = None,
    prefetch_mode: str | None = None,
    qkv_front: bool | None = None,
    gemv: bool | None = None,
) -> DraftDecode | None:
    """The draft's specialized decode, prepared, or None where it keeps its
    stock layers; every reason is logged. ``exclude`` names kernels not to
    use (e.g. ``{"boundary"}``: the parts they would run stay stock).
    ``qkv_front`` (default: ``DSPARK_QKV_FRONT=1``, else False) uses the
    fused QKV front where the plan allows it: the decode then equals the
    stock forward up to the front's projection summation order (module
    docstring); without it the decode is bit for bit.
    ``gemv`` (default: ``DSPARK_GEMV=1``, else False) runs the four
    projections of every layer at m = 1 on the one-token GEMV
    (``dspark_cute.gemv``): a step of one token then equals the stock forward
    with those projections computed by ``dspark_core.spec.gemv.gemv`` (a stated
    order, not cuBLAS's); steps of more tokens keep the stock projections.
    A GEMV streams its weight before its PDL wait, so a one-token step
    prefetches no weight of a GEMV-run projection into L2.
    ``attention_variant`` (default: ``DSPARK_ATTENTION`` or "staged") picks
    the attention kernel's variant (``ATTENTION_VARIANTS``; the plan carries
    its constants; another name is a ValueError); it is logged.
    ``prefetch`` (default: ``DEFAULT_PREFETCH`` at TP1, off with
    ``all_reduce``; ``DSPARK_PREFETCH=0`` or ``1``/``side`` overrides that
    default; True: ``DEFAULT_PREFETCH``; a dict: bytes a row per weight
    role) turns on the L2 prefetch of each GEMM's weight during the kernels
    before it (``dspark_cute.weight_prefetch``; it changes no value);
    ``prefetch_mode`` (default: "side" where ``DSPARK_PREFETCH=side``, else
    "inline") picks how it overlaps them.

    A rank's shard of a TP draft (``dspark_core.reference.tp.TPDraftModel``, ``tp > 1``)
    needs ``all_reduce`` of its TP size (dspark-comm's ``DraftAllReduce``):
    without it the branches' partials would never be summed (ValueError).
    ``all_reduce.prepare()``, where it has one, runs after the decode's, so
    nothing compiles during CUDA graph capture; it is collective (every rank
    learns of any rank's failure), and a rank whose own prepare failed still
    calls it, with ``failed=``, before raising."""
    model_tp = getattr(model, "tp", 1)
    if model_tp > 1 and all_reduce is None:
        raise ValueError(f"a TP{model_tp} shard of the draft needs its all-reduce boundaries (all_reduce=...)")
    if all_reduce is not None and model_tp > 1 and all_reduce.tp != model_tp:
        raise ValueError(f"TP{all_reduce.tp} all-reduce boundaries for a TP{model_tp} shard")
    variant = attention_variant or os.environ.get("DSPARK_ATTENTION", "staged")
    if qkv_front is None:
        qkv_front = os.environ.get("DSPARK_QKV_FRONT", "0") not in ("", "0")
    if gemv is None:
        gemv = os.environ.get("DSPARK_GEMV", "0") not in ("", "0")
    plan = draft_plan(model, all_reduce.tp if all_reduce is not None else 1, exclude, variant, bool(qkv_front),
                      bool(gemv))
    if plan.draft_reason is not None:
        _log_once(logging.WARNING, f"the DSpark draft keeps its stock layers: {plan.draft_reason}")
        return None
    for part in plan.parts():
        if not part.fused:  # a part the caller did not opt in to is no warning
            _log_once(logging.INFO if part.declined else logging.WARNING, part.refusal)
    env = os.environ.get("DSPARK_PREFETCH", "")
    if prefetch is None:
        # Measured at TP1 only: the TP steps keep it off unless asked for.
        prefetch = env != "0" if env else all_reduce is None
    if prefetch is True:
        prefetch = DEFAULT_PREFETCH
    if prefetch_mode is None:
        prefetch_mode = "side" if env == "side" else "inline"
    decode = DraftDecode(model, plan, all_reduce, prefetch=prefetch or None, prefetch_mode=prefetch_mode)
    if variant != "staged":
        _log_once(logging.INFO, f"the decode attention runs its {variant!r} variant")
    if decode.prefetcher is not None:
        _log_once(logging.INFO, f"the decode prefetches its GEMM weights into L2 ({prefetch_mode}; bytes a row: "
                  f"{decode.prefetcher.bytes_per_row})")
    error = None
    try:
        decode.prepare()
    except Exception as e:  # noqa: BLE001 (re-raised below)
        error = e
    if all_reduce is not None and hasattr(all_reduce, "prepare"):
        # Collective (dspark-comm's DraftAllReduce): it takes part even after
        # this rank failed, so every rank raises instead of waiting for this one.
        if error is None:
            all_reduce.prepare()
        else:
            try:
                all_reduce.prepare(failed=error)
            except RuntimeError:
                pass  # the other ranks now raise too; this rank raises its own error below
    if error is not None:
        raise error
    fused, total = plan.fused_count()
    _log_once(logging.INFO, f"the DSpark draft runs {fused} of {total} parts fused")
    return decode
