"""The executor: ``DraftDecode`` runs a draft's forward part by part as its
plan says, each fused part on its kernel and each refused part on the
model's own stock modules, over the model-neutral ``DraftDescription``
(``dspark_core.runtime.description``), so it runs any model an adapter
describes.

The order of one step (``run(hidden_states, *step)``, ``*step`` being what
the model's forward takes after its hidden states):

1. the stream (FP32, or BF16 embeddings as they are) and the first layer's
   input norm of its BF16 copy;
2. per layer: the attention branch (the stock QKV projection with the QKV
   epilogue kernel, else the model's stock QK-norm, RoPE and insert
   (``front_from``); attention;
   the o-norm and gate; the output projection), its residual boundary, the MLP
   branch (gate-up projection, activation, down projection) and its boundary
   into the next layer's input norm or the final norm;
3. at TP each branch's partial goes to the fused all-reduce boundary
   (``AllReduceBoundaries``) where it takes the call, else the model's stock
   all-reduce, then the boundary.

Kernels come from the installed backends (``contracts.kernels.kernel_class``)
or a ``kernels`` mapping (name -> host class) the caller passes. ``prepare``
compiles every variant ``run`` may launch before any CUDA graph is captured.
A call a bound kernel does not take at run time (rows beyond what it covers, a
strided operand) runs that part's stock modules and logs why, once per decode
at WARNING (``dspark.decode``). Opt-in kernels that sum a projection in their
own order (the one-token GEMV, the package GEMM) make the
decode follow the stock tokens, not its bits; without them it is bit for bit
the stock forward. The ordered GEMM (on by default at TP1) sums each
projection in cuBLAS's own order where its build-time check (``gemm_check``)
finds that order, so it keeps the stock bits, and runs a row count only
where its timing against cuBLAS on this GPU (``gemm_decide``) finds it
faster.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch

from dspark_core import checks
from dspark_core.contracts.kernels import kernel_class, rows_taken
from dspark_core.planner import policy
from dspark_core.planner.plan import DraftPlan, Part
from dspark_core.runtime import gemm_check
from dspark_core.runtime.description import Attention, Boundary, DraftDescription
from dspark_core.spec.layers import capturing

log = logging.getLogger("dspark.decode")

# Bytes a row of each GEMM weight the L2 prefetch brings in while the small
# kernels before that GEMM run (the benchmarks' results give the measurement).
DEFAULT_PREFETCH = {"qkv_proj": 256, "o_proj": 256, "gate_up": 256, "down": 512}


class AllReduceBoundaries(Protocol):
    """What the executor needs of a fused all-reduce boundary (dspark-comm):
    ``takes`` decides from the row count alone (the same on every rank);
    ``run`` all-reduces the partial and runs boundary ``index`` on the sum;
    ``all_reduce`` is the stock all-reduce for the calls it does not take;
    ``project(index, x, weight) -> (partial, published)`` is the branch GEMM,
    which may publish the partial into the mailbox itself (``run(...,
    published=True)`` then only consumes it); ``prepare(failed=None)`` is
    collective."""

    tp: int

    def takes(self, partial: torch.Tensor) -> bool: ...

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor: ...

    def project(self, index: int, x: torch.Tensor, weight: torch.Tensor) -> tuple: ...

    def run(self, index: int, partial, stream: torch.Tensor, store_stream: bool, published: bool = False): ...

    def prepare(self, failed: BaseException | None = None) -> None: ...


class DraftDecode:
    """The draft's forward with its fused parts, as ``plan`` says (module
    docstring). Build with ``build_draft_decode``; ``prepare`` binds and
    compiles the kernels."""

    def __init__(self, draft: DraftDescription, plan: DraftPlan, all_reduce: AllReduceBoundaries | None = None,
                 prefetch: dict[str, int] | None = None, kernels: Mapping[str, type] | None = None,
                 step_rows=None) -> None:
        if plan.draft_reason is not None:
            raise ValueError(f"the plan keeps the whole draft stock ({plan.draft_reason}): nothing to run fused")
        if draft.tp > 1 and all_reduce is None:
            raise ValueError(f"a TP{draft.tp} shard of the draft needs its all-reduce boundaries (all_reduce=...)")
        if all_reduce is not None and draft.tp > 1 and all_reduce.tp != draft.tp:
            raise ValueError(f"TP{all_reduce.tp} all-reduce boundaries for a TP{draft.tp} shard")
        if len(plan.boundaries) != 2 * len(draft.layers):
            raise ValueError(f"a plan of {len(plan.boundaries)} boundaries for a draft of {len(draft.layers)} layers")
        tp = all_reduce.tp if all_reduce is not None else draft.tp
        if plan.target.tp != tp:
            raise ValueError(f"a plan made for TP{plan.target.tp} for a draft run at TP{tp}")
        if plan.hidden_size is not None and plan.hidden_size != draft.hidden_size:
            raise ValueError(f"a plan made for a hidden size of {plan.hidden_size} for a draft of {draft.hidden_size}")
        self.draft, self.plan, self.all_reduce = draft, plan, all_reduce
        # The row counts the deployment's steps have (None: any): the ordered
        # GEMMs are checked and timed at those alone.
        self.step_rows = None if step_rows is None else frozenset(
            checks.integer("a step's row count (step_rows)", m, 1) for m in step_rows)
        self.layers = draft.layers
        self.bounds = draft.boundaries()
        self.dtype = draft.compute_dtype
        self._kernels = kernels
        self._prefetch_bytes = prefetch or None
        self.prefetcher = None
        # Bound kernels per part (prepare); None keeps the stock modules.
        self.input_norm = None
        self.boundaries: list = []
        self.epilogues: list = []
        self.attentions: list = []
        self.o_gates: list = []
        self.activations: list = []
        self.gemvs: dict = {}  # (layer, role) -> bound one-token GEMV
        self.ordered: dict = {}  # (layer, role) -> bound ordered GEMM (its orders checked against cuBLAS)
        self.order_checks: dict = {}  # (layer, role) -> gemm_check.CheckResult
        self.decisions: dict = {}  # (layer, role) -> gemm_decide.GemmDecision
        self._gemv_weights: set = set()  # their weights' addresses: the prefetch skips them at m = 1
        self._one_row = False
        self._rows = 0  # the running step's rows
        self.context = None
        self.prepared = False
        self._logged: set[str] = set()  # what this decode has logged (once each)

    # -- binding -------------------------------------------------------------
    def _log_once(self, level: int, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.log(level, message)

    def stock_inserts(self, reason: str, plan: DraftPlan | None = None) -> list[str]:
        """Run every part that writes the KV cache on its stock code from now
        on (the context K/V chain, the QKV epilogues), for ``reason`` (a
        layout of the bound cache the kernels do not take, found after the
        build; the caller logs it); the names of the parts that were fused.
        A step then takes the model's own K/V insert (its attention reads the
        cache the stock insert wrote). ``plan``: the plan that says so (the
        deployment's, made anew), kept as this executor's."""
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"the reason must be a non-empty string, not {reason!r}")
        names = [f"layer {i}'s QKV epilogue" for i, e in enumerate(self.epilogues) if e is not None]
        if self.context is not None:
            names.insert(0, "the context K/V chain")
        self.context = None
        self.epilogues = [None] * len(self.epilogues)
        if plan is not None:
            self.plan = plan
        return names

    def _class(self, part: Part | None, kernel: str):
        """The host class of ``kernel`` for a fused ``part``; None for a stock part."""
        if part is None or not part.fused:
            return None
        if self._kernels is not None:
            return self._kernels[kernel]
        return kernel_class(kernel)

    def prepare(self) -> None:
        """Bind every planned part to its kernel and compile the variants
        ``run`` launches: the first norm; every boundary with the stream it
        gets (the first on an FP32 and a BF16 stream: BF16 embeddings are the
        stream as they are), storing the new stream except the last; each
        layer's QKV epilogue, attention, o-gate, MLP activation and
        GEMVs; the context chain; the weight prefetch."""
        plan, draft = self.plan, self.draft
        cls = self._class(plan.input_norm, policy.ROW_NORM)
        if cls is not None:
            self.input_norm = cls(plan.input_norm.constants, draft.first_norm.weight)
            self.input_norm.prepare()
        self.boundaries = []
        last = len(self.bounds) - 1
        for index, (part, b) in enumerate(zip(plan.boundaries, self.bounds)):
            cls = self._class(part, policy.BOUNDARY)
            if cls is None:
                self.boundaries.append(None)
                continue
            fused = cls(part.constants, b.connection.alpha, b.connection.beta, b.post.weight, b.pre.weight)
            dtypes = (torch.float32, torch.bfloat16) if index == 0 else (torch.float32,)
            fused.prepare(stream_dtypes=dtypes, store_stream=(index != last,))
            self.boundaries.append(fused)
        bound = [self._bind_layer(i) for i in range(len(self.layers))]
        self.epilogues, self.attentions, self.o_gates, self.activations = (
            [b[k] for b in bound] for k in range(4)
        )
        self.gemvs = self._bind_gemvs()
        self._gemv_weights = {g.weight.data_ptr() for g in self.gemvs.values()}
        self.ordered = self._bind_ordered()
        self.context = self._bind_context()
        if self._prefetch_bytes:
            self.prefetcher = self._class(Part("the weight prefetch", object()), policy.WEIGHT_PREFETCH)(
                self._prefetch_bytes, draft.device)
            self.prefetcher.prepare()
        self.prepared = True

    def _bind_layer(self, index: int) -> tuple:
        """Layer ``index``'s kernels, compiled (None where a part stays stock):
        the QKV epilogue, the attention (whose staged variant
        takes the o-gate into its epilogue where the plan says so), the o-gate
        and the MLP activation."""
        plan, attn = self.plan, self.layers[index].attention
        epilogue, attention, gate, activation = (
            parts[index] for parts in (plan.qkv_epilogues, plan.attentions, plan.o_gates, plan.mlp_activations))
        table = attn.rope.table if attn.rope is not None else None
        kernels = []
        cls = self._class(epilogue, policy.QKV_EPILOGUE)
        kernels.append(cls and cls(epilogue.constants, attn.q_norm.weight, table))
        cls = self._class(attention, policy.ATTENTION)
        kernels.append(cls and cls(attention.constants))
        cls = self._class(gate, policy.O_GATE) if gate.via is None else None
        kernels.append(cls and cls(gate.constants))
        cls = self._class(activation, policy.MLP_ACTIVATION)
        kernels.append(cls and cls(activation.constants))
        for kernel in kernels:
            if kernel is not None:
                kernel.prepare()
        return tuple(kernels)

    def _bind_gemvs(self) -> dict:
        gemvs = {}
        roles = policy.GEMV_ROLES
        for n, part in enumerate(self.plan.gemvs):  # per layer, in GEMV_ROLES order
            layer, role = n // len(roles), roles[n % len(roles)]
            cls = self._class(part, policy.GEMV)
            if cls is not None:
                gemvs[(layer, role)] = cls(part.constants, policy.gemv_weight(self.layers[layer], role))
                gemvs[(layer, role)].prepare()
        return gemvs

    def _stock_projection(self, layer: int, role: str):
        """The model's stock call of ``layer``'s projection ``role``."""
        lay = self.layers[layer]
        return {"qkv_proj": lay.attention.project_qkv, "o_proj": lay.attention.project_out,
                "gate_up": lay.mlp.project_gate_up, "down": lay.mlp.project_down}[role]

    def _bind_ordered(self) -> dict:
        """The ordered GEMMs of the plan, each bound to the row counts the
        build-time check (``gemm_check.check_projection``: the model's own
        stock projection, i.e. the live cuBLAS, against the kernel) found
        cuBLAS's order for, then, where the host class can time
        (``decide``), only those where one of its kernels measured faster
        than cuBLAS on this GPU (``gemm_decide``); compiled. Per projection,
        the findings and the decision are logged once. Weights off CUDA are
        not checked (no row count bound), unless the host class says it
        checks there (``CHECK_OFF_CUDA``: a CPU stand-in whose ``run_order``
        runs on the CPU); a host class's ``ORDER_CHECK`` holds its search
        settings (``check_projection``'s keywords), if any; its
        ``candidate_rows`` (default 1 .. ``max_rows``) the row counts
        checked, those of ``step_rows`` alone where the deployment said
        which its steps have (other row counts then run cuBLAS: never a step
        of this deployment)."""
        bound = {}
        roles = policy.ordered_gemm_roles(self.plan.target.tp)
        for n, part in enumerate(self.plan.ordered_gemms):
            layer, role = n // len(roles), roles[n % len(roles)]
            cls = self._class(part, policy.ORDERED_GEMM)
            if cls is None:
                continue
            weight = policy.gemv_weight(self.layers[layer], role)
            gemm = cls(part.constants, weight)
            if getattr(weight, "is_cuda", False) or getattr(cls, "CHECK_OFF_CUDA", False):
                stock = self._stock_projection(layer, role)
                rows = getattr(gemm, "candidate_rows", range(1, gemm.max_rows + 1))
                rows = [m for m in rows if self.step_rows is None or m in self.step_rows]
                result = gemm_check.check_projection(
                    weight, rows, gemm.run_order, gemm_check.SEED,
                    reference=lambda x, _w, stock=stock: stock(x), **getattr(cls, "ORDER_CHECK", {}))
                gemm.bind_orders(result.orders, result.refused)
                self.order_checks[(layer, role)] = result
                self._log_once(logging.INFO, f"layer {layer}'s {role} projection on the ordered GEMM where the "
                               f"check against cuBLAS found its order: {result.summary()}")
                if hasattr(gemm, "decide"):
                    decision = gemm.decide()
                    self.decisions[(layer, role)] = decision
                    self._log_once(logging.INFO, f"layer {layer}'s {role} projection, decided by timing: "
                                   f"{decision.summary()}")
            gemm.prepare()
            bound[(layer, role)] = gemm
        return bound

    def _bind_context(self):
        part, context = self.plan.context, self.draft.context
        cls = self._class(part, policy.CONTEXT_CHAIN)
        if cls is None:
            return None
        pre = [layer.input_norm.weight for layer in self.layers]
        chain = cls(part.constants, context.hidden_norm.weight, None if pre[0] is None else pre,
                    context.stacked_kv_weight, context.rope.table if context.rope is not None else None)
        chain.prepare()
        return chain

    @property
    def max_rows(self) -> int | None:
        """The most rows a step takes on every kernel bound for the step
        (``contracts.kernels.rows_taken`` of each): the first norm, the
        boundaries, the QKV epilogues, the attentions, the o-gates
        and the MLP activations. A step of more rows runs some part stock.
        Read from the bound kernels' constants alone, so every TP rank of one
        plan gets the same. Not counted: the one-token GEMVs (bound for
        one-row steps; other steps take the stock projection by design), the
        context chain (no step's rows) and the weight prefetch. None before
        ``prepare`` or where no step kernel is bound."""
        if not self.prepared:
            return None
        bound = [(policy.ROW_NORM, self.input_norm)]
        for name, kernels in ((policy.BOUNDARY, self.boundaries),
                              (policy.QKV_EPILOGUE, self.epilogues), (policy.ATTENTION, self.attentions),
                              (policy.O_GATE, self.o_gates), (policy.MLP_ACTIVATION, self.activations)):
            bound.extend((name, kernel) for kernel in kernels)
        return min((rows_taken(name, kernel) for name, kernel in bound if kernel is not None), default=None)

    # -- the forward ---------------------------------------------------------
    def _first_norm(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.input_norm
        if kernel is not None:
            if kernel.takes(x):
                return kernel.launch(x)
            self._log_once(logging.WARNING, f"the draft's first norm ran stock: {kernel.problem(x)}")
        return self.draft.first_norm.stock(x, self.dtype)

    def _stock_boundary(self, b: Boundary, branch: torch.Tensor, stream: torch.Tensor) -> tuple:
        """The boundary on the model's modules: the post-norm's BF16 output,
        the connection's FP32 stream, the pre-norm of its BF16 copy."""
        new_stream = b.connection.stock(stream, b.post.stock(branch, torch.bfloat16))
        return new_stream, b.pre.stock(new_stream.to(self.dtype), self.dtype)

    def _boundary(self, index: int, branch, stream: torch.Tensor, store: bool, published: bool = False):
        """Boundary ``index`` of ``branch`` (at TP this rank's partial: fused
        with its all-reduce where the adapter takes the call, else the
        model's stock all-reduce first); ``(new_stream or None, out)``."""
        if self.all_reduce is not None:
            if published or self.all_reduce.takes(branch):
                return self.all_reduce.run(index, branch, stream, store, published=published)
            branch = self.all_reduce.all_reduce(branch)
        fused = self.boundaries[index] if self.boundaries else None
        if fused is not None:
            if fused.takes(branch, stream):
                return fused.launch(branch, stream, store)
            self._log_once(logging.WARNING, f"{self.bounds[index].name} ran stock: {fused.problem(branch, stream)}")
        return self._stock_boundary(self.bounds[index], branch, stream)

    def _project(self, index: int, x: torch.Tensor, weight: torch.Tensor, role: str, stock) -> tuple:
        """Boundary ``index``'s branch GEMM, ``(partial, published)``: at TP
        the adapter's projection (it may publish into the mailbox), else the
        layer's ``role`` projection on its GEMV or the model's stock one
        (``stock``)."""
        if self.all_reduce is not None:
            return self.all_reduce.project(index, x, weight)
        return self._linear(index // 2, role, x, stock), False

    def _linear(self, layer: int, role: str, x: torch.Tensor, stock) -> torch.Tensor:
        """A projection on the one-token GEMV where bound and where it takes
        ``x`` (one row), else on the ordered GEMM where bound and where it
        takes ``x`` (a row count its check found cuBLAS's order for), else
        the model's stock projection ``stock``."""
        gemv = self.gemvs.get((layer, role))
        if gemv is not None:
            if gemv.takes(x):
                return gemv.launch(x)
            self._log_once(logging.INFO, f"layer {layer}'s {role} GEMV ran stock: {gemv.problem(x)}")
        gemm = self.ordered.get((layer, role))
        if gemm is not None:
            if gemm.takes(x):
                return gemm.launch(x)
            self._log_once(logging.INFO, f"layer {layer}'s {role} projection keeps cuBLAS for some row counts "
                           f"(the first: {gemm.problem(x)})")
        return stock(x)

    def _attention(self, index: int, x: torch.Tensor, step: tuple):
        """Layer ``index``'s attention branch, ``(partial, published)``."""
        attn = self.layers[index].attention
        kv_cache, slots = attn.cache(*step) if self.epilogues[index] is not None else (None,) * 2
        positions = self.draft.positions(*step)
        self._join()
        q, og = self._queries_and_gate(index, attn, x, positions, slots, kv_cache, step)
        gated = self._gated(index, attn, q, og, step)
        self._join()
        return self._project(2 * index, gated, attn.o_proj_weight, "o_proj", attn.project_out)

    def _queries_and_gate(self, index: int, attn: Attention, x, positions, slots, kv_cache, step):
        """``(q, og)`` from the stock QKV projection (or its GEMV), then the
        QKV epilogue kernel where bound and where it takes the call, else the
        model's stock QK-norm, RoPE and insert."""
        epilogue = self.epilogues[index] if self.epilogues else None
        qkv = self._linear(index, "qkv_proj", x, attn.project_qkv)
        self._fork(attn.o_proj_weight, "o_proj")
        if epilogue is not None:
            if epilogue.takes(qkv, positions, slots, kv_cache):
                q = epilogue.launch(qkv, positions, slots, kv_cache)
                self._kick()
                return q, attn.split_qkv(qkv)[3]
            self._log_once(logging.WARNING, f"layer {index}'s QKV epilogue ran stock: "
                           f"{epilogue.problem(qkv, positions, slots, kv_cache)}")
        out = attn.front_from(qkv, *step)
        self._kick()
        return out

    def _gated(self, index: int, attn: Attention, q, og, step: tuple) -> torch.Tensor:
        """Attention, then the o-norm and gate, on their kernels where bound
        and where they take the operands: ``[m, q_size]``."""
        kernel = self.attentions[index] if self.attentions else None
        out = None
        if kernel is not None:
            cache, attn_slots = attn.attention_operands(*step)
            if not getattr(kernel, "takes_strided_q", False):
                q = q.contiguous()  # the QKV epilogue's q is a strided view of the projection
            gate = og if getattr(kernel, "gated", False) and og is not None else None
            problem = kernel.problem(q, cache, attn_slots, gate=gate)
            if problem is None:
                out = kernel.launch(q, cache, attn_slots, gate=gate)
                if gate is not None:  # the o-gate ran in the attention's epilogue
                    return out.reshape(out.shape[0], attn.q_size)
            else:
                self._log_once(logging.WARNING, f"layer {index}'s attention ran stock: {problem}")
        if out is None:
            out = attn.attend(q, *step)
        if og is not None:
            gate = self.o_gates[index] if self.o_gates else None
            if gate is not None and gate.takes(out, og):
                out = gate.launch(out, og)
            else:
                if gate is not None:
                    self._log_once(logging.WARNING, f"layer {index}'s o-gate ran stock: {gate.problem(out, og)}")
                out = attn.gate(out, og)
        return out.reshape(out.shape[0], attn.q_size)

    def _activation(self, index: int, gu: torch.Tensor) -> torch.Tensor:
        kernel = self.activations[index] if self.activations else None
        if kernel is not None:
            if kernel.takes(gu):
                return kernel.launch(gu)
            self._log_once(logging.WARNING, f"layer {index}'s MLP activation ran stock: {kernel.problem(gu)}")
        return self.layers[index].mlp.activation(gu)

    def _fork(self, weight: torch.Tensor, role: str) -> None:
        """Name the next GEMM's ``weight`` to the prefetch, where it is on."""
        if self.prefetcher is not None and not (self._one_row and weight.data_ptr() in self._gemv_weights) \
                and not self._ordered_streams(weight):
            # (A one-token GEMV or an ordered GEMM streams its own weight before its PDL wait.)
            self.prefetcher.fork(weight, role)

    def _ordered_streams(self, weight: torch.Tensor) -> bool:
        """Whether an ordered GEMM bound to ``weight`` takes this step's rows."""
        return any(g.weight is weight and self._rows in g.orders for g in self.ordered.values())

    def _kick(self) -> None:
        """Right after the first small kernel past a GEMM: the forked prefetch starts."""
        if self.prefetcher is not None:
            self.prefetcher.kick()

    def _join(self) -> None:
        """Before a GEMM: nothing of the prefetch stays pending."""
        if self.prefetcher is not None:
            self.prefetcher.join()

    @torch.no_grad()
    def run(self, hidden_states: torch.Tensor, *step) -> torch.Tensor:
        """The model's forward after its embedding, ``forward(hidden_states,
        *step)``, with the fused parts (module docstring): BF16 ``[m, H]``."""
        if not self.prepared:
            raise RuntimeError("DraftDecode.prepare() has not run")
        draft = self.draft
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"the draft takes hidden states as a tensor, not {type(hidden_states).__name__}")
        if hidden_states.dtype not in (self.dtype, torch.float32):
            raise TypeError(f"the draft takes hidden states of {self.dtype} or torch.float32, "
                            f"not {hidden_states.dtype}")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != draft.hidden_size:
            raise ValueError(f"the draft takes hidden states of [m, {draft.hidden_size}], "
                             f"not {list(hidden_states.shape)}")
        if draft.check_step is not None and not capturing():
            # Where kernels that would skip bad rows are bound, the range
            # errors of the stock QK-norm/RoPE/insert and attention are checked first.
            draft.check_step(*step, any(k is not None for k in [*self.epilogues, *self.attentions]))
        # A BF16 row round-trips through the FP32 stream unchanged: the first
        # boundary reads it as is.
        stream = hidden_states if hidden_states.dtype == self.dtype else hidden_states.to(torch.float32)
        self._one_row = hidden_states.shape[0] == 1
        self._rows = hidden_states.shape[0]
        last = len(self.layers) - 1
        try:
            if self.layers:  # the first QKV weight, while the first norm runs
                self._fork(self.layers[0].attention.qkv_weight, "qkv_proj")
            x = self._first_norm(stream.to(self.dtype).contiguous())
            self._kick()
            for i, layer in enumerate(self.layers):
                mlp = layer.mlp
                attn_out, published = self._attention(i, x, step)
                self._fork(mlp.gate_up_weight, "gate_up")
                stream, ffn_in = self._boundary(2 * i, attn_out, stream, True, published)
                self._kick()
                self._join()
                gate_up = self._linear(i, "gate_up", ffn_in, mlp.project_gate_up)
                self._fork(mlp.down_weight, "down")
                hidden = self._activation(i, gate_up)
                self._kick()
                self._join()
                ffn_out, published = self._project(2 * i + 1, hidden, mlp.down_weight, "down", mlp.project_down)
                if i != last:
                    self._fork(self.layers[i + 1].attention.qkv_weight, "qkv_proj")
                stream, x = self._boundary(2 * i + 1, ffn_out, stream, i != last, published)
                self._kick()
        finally:
            self._join()  # no prefetch outlives the step (a capture must end joined)
        return x

    def store_context_kv(self, context_states: torch.Tensor, positions: torch.Tensor, *args) -> bool:
        """The model's ``precompute_and_store_context_kv(context_states,
        positions, *args)`` on the fused chain; False (nothing done) where it
        does not cover the call (the caller then runs the stock method)."""
        if self.context is None:
            return False
        context = self.draft.context
        if self.draft.check_context is not None and not capturing():
            # The stock chain raises for slots beyond a cache and positions
            # beyond the RoPE table; the kernel skips such rows: check first.
            self.draft.check_context(positions, *args)
        caches, slots = context.caches(*args), context.slots(*args)
        problem = self.context.problem(context_states, positions, caches, slots)
        if problem is not None:
            self._log_once(logging.WARNING, f"the context K/V chain ran stock: {problem}")
            return False
        self.context.launch(context_states, positions, caches, slots)
        return True


__all__ = ["DEFAULT_PREFETCH", "AllReduceBoundaries", "DraftDecode"]
