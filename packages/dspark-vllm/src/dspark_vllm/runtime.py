"""The specialized decode of one vLLM draft model: built once its weights
are loaded, then asked per call whether it takes the call.

``SpecializedDecode.build()`` (from the model's ``process_weights_after_
loading``, before vLLM profiles memory or captures a graph): the RoPE tables
cast to the dtype vLLM's first calls would cast them to (``pin_rope_tables``),
the description (``adapter.describe_vllm``), the plan (``planning.plan_vllm``),
the TP ranks' agreement on it, every stock part logged once with its reason,
then, where any part fuses, dspark-core's ``DraftDecode`` over vLLM's modules
with every kernel bound and compiled (``prepare``) and, at TP > 1, the
all-reduce boundaries' kernels compiled collectively
(``dspark_core.runtime.build.prepare_collectively``, as ``build_draft_decode``
does) and the mailbox checked. Any exception while the
kernels are bound or compiled, on any rank, keeps vLLM's stock forward on
every rank with the reason logged: never an exception out of model loading.

``forward`` and ``store_context`` return None / False where the call is not
taken (the model then runs vLLM's stock method): no decode, the memory
profiling run (no attention metadata, no KV cache), or a step of more rows
than every bound kernel takes (``max_rows``: ``DraftDecode.max_rows``, from
the bound kernels' constants; any step vLLM captures, up to 512 rows, where
the bound kernels are the row norm, boundary, QKV epilogue, o-gate and MLP
activation). The warmup and capture runs of vLLM's CUDA graphs carry
attention metadata (PAD slots) and run fused, as do eager steps. These
decisions read the row count and host state every TP rank shares. Logs go
through vLLM's logger (``vllm.dspark``); the executor's ``dspark.decode``
logger is forwarded there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from vllm.logger import init_logger

from dspark_core.contracts.kernels import kernel_class
from dspark_core.contracts.limits import ORDERED_GEMM_MAX_ROWS
from dspark_core.planner.plan import DraftPlan
from dspark_core.runtime.build import prepare_collectively
from dspark_core.runtime.decode import DraftDecode
from dspark_vllm import allreduce, deployment, planning
from dspark_vllm.adapter import describe_vllm, partial

logger = init_logger("vllm.dspark")
CORE_LOGGER = "dspark.decode"


class _Forward(logging.Handler):
    """Re-emits the executor's records through vLLM's logger (its handlers and format)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logger.isEnabledFor(record.levelno):
            copy = logging.makeLogRecord(record.__dict__)
            copy.name = f"{logger.name}.decode"
            logger.handle(copy)


def forward_core_logs() -> None:
    """Forward ``dspark.decode`` to vLLM's logger (once per process): the
    executor's INFO records too, which the root logger's level would drop."""
    core = logging.getLogger(CORE_LOGGER)
    if not any(isinstance(h, _Forward) for h in core.handlers):
        core.addHandler(_Forward())
    if core.level == logging.NOTSET or core.level > logging.INFO:
        core.setLevel(logging.INFO)


def pin_rope_tables(model) -> None:
    """Cast each RoPE table to the compute dtype where vLLM's stock path does
    on its first call (``_match_cos_sin_cache_dtype``): the context chain's
    (layer 0's module) and, on layers without the fused QK-norm/RoPE/insert,
    each layer's. The memory profiling run makes the same casts before any
    real step; made now, the tables the kernels bind are the ones the stock
    path reads from then on."""
    modules = [model._rotary_emb] + [layer.self_attn.rotary_emb for layer in model.layers
                                     if not layer.self_attn.fused_qk_norm_rope_kv_insert]
    for rope in modules:
        if rope is not None:
            rope._match_cos_sin_cache_dtype(torch.empty(0, dtype=model.default_dtype,
                                                        device=rope.cos_sin_cache.device))


def kernel_classes(names) -> dict[str, type]:
    """The installed backends' host class of each kernel in ``names``."""
    return {name: kernel_class(name) for name in names}


def fused_kernels(plan: DraftPlan) -> frozenset[str]:
    """The kernels the plan's fused parts run on."""
    used = set()
    for attr, kernel in planning.PART_KERNELS:
        value = getattr(plan, attr)
        parts = value if isinstance(value, list) else [value]
        used.update(planning.part_kernel(kernel, p) for p in parts if p is not None and p.fused and p.via is None)
    return frozenset(used)


def step_rows(vllm_config) -> range | None:
    """The row counts of the draft's steps under ``vllm_config``: vLLM's
    DSpark speculator drafts N tokens a request (``num_query_per_req``), so
    a step has requests x N rows, and the graphs it captures are of such
    sizes too: the multiples of N, here up to the most rows the ordered GEMM
    takes (``ORDERED_GEMM_MAX_ROWS``; larger steps run cuBLAS whatever they
    are). None (any row count) where the config names no N. The ordered
    GEMMs are checked and timed at these alone (``DraftDecode(step_rows=
    ...)``): a quarter of the build's checks at N = 4."""
    n = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None
    return range(n, ORDERED_GEMM_MAX_ROWS + 1, n)


class StockAllReduce:
    """The executor's all-reduce boundaries (``AllReduceBoundaries``) at
    TP > 1 that take no call: each branch's GEMM is its RowParallelLinear's
    (``partial``), its sum vLLM's ``tensor_model_parallel_all_reduce``."""

    def __init__(self, model, tp: int) -> None:
        from vllm.distributed import tensor_model_parallel_all_reduce

        self.tp = tp
        self._reduce = tensor_model_parallel_all_reduce
        self._linears = [linear for layer in model.layers
                         for linear in (layer.self_attn.o_proj, layer.feed_forward.down_proj)]

    def takes(self, partial_sum: torch.Tensor) -> bool:
        return False

    def all_reduce(self, partial_sum: torch.Tensor) -> torch.Tensor:
        return self._reduce(partial_sum)

    def project(self, index: int, x: torch.Tensor, weight: torch.Tensor) -> tuple:
        return partial(self._linears[index], x), False

    def run(self, *args, **kwargs):
        raise RuntimeError("StockAllReduce takes no boundary (takes() is False)")

    def prepare(self, failed: BaseException | None = None) -> None:
        pass


def all_reduce_boundaries(model, draft, plan, order: allreduce.AllReduceOrder, vllm_config=None):
    """The executor's all-reduce boundaries of a TP > 1 draft: an
    ``allreduce.MailboxBoundaries`` where ``plan`` fuses the all-reduce (the
    branch GEMM the RowParallelLinear's own, ``adapter.partial``), else
    ``StockAllReduce`` (vLLM's all-reduce, then the boundary)."""
    part = plan.all_reduce
    if part is not None and part.fused:
        return allreduce.MailboxBoundaries(model, draft, plan, order.for_hidden(draft.hidden_size),
                                           branch_gemm=partial,
                                           package_gemm=allreduce.package_gemm_asked(vllm_config))
    return StockAllReduce(model, draft.tp)


def _log_plan(plan: DraftPlan) -> None:
    """Each stock part's reason once, with the parts it keeps stock."""
    if plan.draft_reason is not None:
        logger.warning("The DSpark draft keeps vLLM's stock forward: %s.", plan.draft_reason)
        return
    reasons: dict[str, list[str]] = {}
    for part in plan.parts():
        if not part.fused and not part.declined:
            reasons.setdefault(part.reason, []).append(part.name)
    for reason, names in reasons.items():
        logger.info("The DSpark draft keeps vLLM's stock code for %s: %s.", ", ".join(names), reason)


class SpecializedDecode:
    """The latency_specialized path of ``model`` (a MuseSparkDSparkForCausalLM)
    under ``vllm_config`` (module docstring). ``kernels``: host classes by
    kernel name instead of the installed backends' (tests)."""

    def __init__(self, model, vllm_config, kernels: Mapping[str, type] | None = None) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.kernels = kernels
        self.draft = None
        self.plan: DraftPlan | None = None
        self.decode: DraftDecode | None = None
        self.max_rows = 0  # the most rows a step takes fused (build)
        self._refusal_logged = False
        self._layout_read = False

    def build(self) -> None:
        """Describe, plan, agree and (where any part fuses) bind and compile."""
        forward_core_logs()
        backbone = self.model.model
        pin_rope_tables(backbone)
        block_size = int(getattr(self.vllm_config.cache_config, "block_size", 16) or 16)
        # The KV cache layout is read from the bound cache (_read_bound_layout): vLLM resolves it after this.
        self.draft = draft = describe_vllm(backbone, block_size)
        # The opt-ins additional_config asks for (each declined otherwise).
        target = planning.vllm_target(draft.device, draft.tp,
                                      package_gemm=allreduce.package_gemm_asked(self.vllm_config),
                                      ordered_gemm=planning.ordered_gemm_asked(self.vllm_config, draft.tp))
        order = None
        if draft.tp > 1 and target.arch in allreduce.CAPABILITY:  # another GPU: planned stock (plan_draft says why)
            order = deployment.stock_all_reduce(draft.tp, target.arch,
                                                self.vllm_config.parallel_config.disable_custom_all_reduce)
        self.plan = plan = planning.plan_vllm(draft, target, order)
        _log_plan(plan)
        signature = planning.plan_signature(plan)
        low, high = deployment.collective_min([signature, -signature])
        if (low, -high) != (signature, signature):
            logger.warning("The DSpark draft keeps vLLM's stock forward: the TP ranks planned different parts.")
            return
        fused, total = plan.fused_count()
        if plan.draft_reason is not None or fused == 0:
            logger.warning("The DSpark draft runs vLLM's stock forward: 0 of %d planned parts fused.", total)
            return
        names = fused_kernels(plan)
        kernels = dict(self.kernels) if self.kernels is not None else kernel_classes(names)
        all_reduce = all_reduce_boundaries(backbone, draft, plan, order, self.vllm_config) if draft.tp > 1 else None
        decode, error = None, None
        try:
            decode = DraftDecode(draft, plan, all_reduce, prefetch=None, kernels=kernels,
                                 step_rows=step_rows(self.vllm_config))
        except Exception as e:  # noqa: BLE001 (a refusal at build keeps vLLM's stock forward, below)
            error = e
        # The kernels, then (collective) the all-reduce boundaries' kernels, every rank taking part.
        error = prepare_collectively(decode, all_reduce, error)
        if error is None and all_reduce is not None and hasattr(all_reduce, "check"):
            try:
                all_reduce.check()  # a sync point: every rank's mailbox healthy after the agreement
            except Exception as e:  # noqa: BLE001 (as above)
                error = e
        (ok,) = deployment.collective_min([0 if error else 1])
        if error is not None or not ok:
            self._keep_stock(error)
            return
        self.decode = decode
        self.max_rows = decode.max_rows or 0
        if self.max_rows:
            logger.info("The DSpark draft runs %d of %d planned parts fused (kernels %s), for steps of 1 to %d rows; "
                        "other steps run vLLM's stock forward.", fused, total, ", ".join(sorted(names)), self.max_rows)
        else:
            logger.info("The DSpark draft runs %d of %d planned parts fused (kernels %s): the context K/V store; "
                        "every step runs vLLM's stock forward.", fused, total, ", ".join(sorted(names)))

    @staticmethod
    def _keep_stock(error: BaseException | None) -> None:
        """Log why the draft keeps vLLM's stock forward after a failed bind
        or compile: ``error`` (this rank's: a refusal's sentence, any other
        exception with its traceback) or another rank's failure (None)."""
        if error is None:
            logger.warning("The DSpark draft keeps vLLM's stock forward: another tensor-parallel rank failed to "
                           "bind or compile its kernels.")
        elif isinstance(error, (ValueError, TypeError)):
            logger.warning("The DSpark draft keeps vLLM's stock forward: binding its kernels refused the plan: %s.",
                           error)
        else:
            logger.warning("The DSpark draft keeps vLLM's stock forward: binding or compiling its kernels failed "
                           "(%s: %s).", type(error).__name__, error, exc_info=error)

    def _read_bound_layout(self) -> None:
        """Once, at the first call with every draft layer's KV cache bound
        (vLLM resolves the layout and binds the cache after ``build``; the
        memory-profiling cache has the real one's layout): where the DSpark
        inserts do not take the bound caches
        (``deployment.bound_layout_unsupported``, naming the layout found),
        the plan's insert parts turn stock with that reason, logged once, and
        the executor drops their kernels. Every TP rank binds the layout vLLM
        resolved once for all, so the ranks keep one plan without a
        collective (this may run inside a graph capture)."""
        caches = [attn.kv_cache for attn in self.model.model._attn_layers]
        if self._layout_read or not caches or any(c.numel() == 0 for c in caches):
            return
        self._layout_read = True
        layout = deployment.kv_cache_layout(caches)
        why = deployment.bound_layout_unsupported(caches, int(self.model.model._num_kv_heads))
        if why is None:
            logger.info("The DSpark KV inserts write the bound %s KV cache through its strides.", layout)
            return
        self.plan, names = planning.restock_inserts(self.plan, why)
        self.decode.stock_inserts(why, self.plan)
        if names:
            logger.info("The DSpark draft keeps vLLM's stock code for %s: %s.", ", ".join(names), why)

    def _real_step(self) -> bool:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        return is_forward_context_available() and get_forward_context().attn_metadata is not None

    def forward(self, input_ids, positions, inputs_embeds=None):
        """The draft backbone's output on the decode, or None where it does
        not take the call (module docstring)."""
        if self.decode is None or not self._real_step():
            return None
        self._read_bound_layout()
        rows = positions.shape[0]
        if not 1 <= rows <= self.max_rows:
            if self.max_rows and not self._refusal_logged:
                self._refusal_logged = True
                logger.info("A DSpark draft step of %d rows runs vLLM's stock forward: the kernels take 1 to %d rows "
                            "a call (said once; every larger step runs stock too).", rows, self.max_rows)
            return None
        poll = getattr(self.decode.all_reduce, "poll", None)
        if poll is not None:  # a mailbox kernel that gave up on a peer raises here, a few steps later
            poll()
        backbone = self.model.model
        hidden = backbone.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.decode.run(hidden, positions)

    def store_context(self, states, positions, slots) -> bool:
        """The context K/V store on the fused chain; False where it does not
        take the call (no slots: the profiling and dummy runs; no KV cache
        bound yet)."""
        if self.decode is None or self.decode.context is None or slots is None:
            return False
        if any(attn.kv_cache.numel() == 0 for attn in self.model.model._attn_layers):
            return False
        self._read_bound_layout()
        if self.decode.context is None:
            return False
        return self.decode.store_context_kv(states, positions, slots)


__all__ = ["SpecializedDecode", "StockAllReduce", "all_reduce_boundaries", "forward_core_logs", "fused_kernels",
           "kernel_classes", "pin_rope_tables"]
