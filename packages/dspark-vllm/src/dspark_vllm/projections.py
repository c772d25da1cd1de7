"""DSpark's ordered GEMM on the draft's two projections outside its decode:
``fc`` (the target's concatenated hidden states to the draft's width, in
``combine_hidden_states``) and the LM head (``compute_draft_logits``).

Each runs, as the decode's layer projections do, at the row counts where the
build-time check finds cuBLAS's own split order against vLLM's own call (the
layer's ``quant_method.apply``: for these unquantized BF16 weights the live
cuBLAS's ``F.linear``) and where the build's timing on this GPU finds one of
DSpark's kernels faster (``OrderedGemm.check``/``decide``); every other call
(another row count, a bias, an operand the kernel does not take) runs
vLLM's own. So the bits are vLLM's at every row count.

How it is installed: the layer's own ``quant_method`` object gets an
``apply`` of its instance that runs the ordered GEMM where it takes the call
and vLLM's method otherwise. vLLM reaches both GEMMs through that one call
(``ReplicatedLinear.forward``; ``LogitsProcessor._apply_head`` where the
head's dtype is the hidden states'), and the method keeps its class, so
every ``isinstance`` check of vLLM's still sees an unquantized layer.

Where it runs: where the decode runs the ordered GEMM for its layers (the
plan fuses it: TP1, on by default, its kernel installed and checked on this
architecture), and each layer's GEMM is the plain BF16 ``F.linear``
(``gemm_reason``). The row counts: fc's are the context tokens of a step
(1 to 64 checked); the LM head's are the step's rows (``step_rows``)."""

from __future__ import annotations

import logging
import types

import torch

from dspark_core.contracts.constants import ordered_gemm_constants
from dspark_core.errors import Unsupported
from dspark_core.planner import policy
from dspark_core.runtime import gemm_check

logger = logging.getLogger("dspark.vllm")

# (role, where vLLM keeps the layer on the draft model, what it is in words)
PROJECTIONS = (("fc", "model.fc", "fc (the target's hidden states to the draft's width)"),
               ("lm_head", "lm_head", "the LM head (the draft logits)"))


def layer_of(model, path: str):
    """The module at ``path`` (dotted) of ``model``, or None."""
    obj = model
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def dispatch_reason(method, what: str) -> str | None:
    """Why vLLM's call of ``method`` (a layer's ``quant_method``) is not the
    plain BF16 ``F.linear``, or None: an unquantized linear or embedding
    method, no batch-invariant kernel, and vLLM's default dispatch (for a
    linear layer, the one its method chose when made)."""
    from vllm import envs
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import default_unquantized_gemm, dispatch_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
        return f"{what} is quantized ({type(method).__name__})"
    if envs.VLLM_BATCH_INVARIANT:
        return f"VLLM_BATCH_INVARIANT runs {what} through vLLM's batch-invariant kernel"
    # A linear layer's GEMM is chosen when its method is made (--linear-backend: FlashInfer's mm_bf16 on
    # CUDA where asked); an embedding's (the LM head's, the Markov head's) at each call.
    gemm = getattr(method, "_gemm_impl", None) if isinstance(method, UnquantizedLinearMethod) \
        else dispatch_unquantized_gemm()
    if gemm is not default_unquantized_gemm:
        return f"vLLM dispatches {what} to another backend than F.linear ({getattr(gemm, '__name__', gemm)})"
    return None


def gemm_reason(layer, what: str) -> str | None:
    """Why vLLM's GEMM of ``layer`` is not the one BF16 ``F.linear`` the
    ordered GEMM is checked against, or None: ``dispatch_reason`` of its
    method, a 2-D BF16 CUDA weight, one rank's."""
    if layer is None:
        return f"the draft has no {what}"
    why = dispatch_reason(getattr(layer, "quant_method", None), what)
    if why is not None:
        return why
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.bfloat16 \
            or not weight.is_cuda:
        return f"{what} has no 2-D bfloat16 CUDA weight ({None if weight is None else weight.dtype})"
    if getattr(layer, "tp_size", 1) != 1:
        return f"{what} is split over {layer.tp_size} ranks (the whole weight on one GPU is what is checked)"
    return None


def _ordered_apply(method, gemm):
    """An ``apply`` for the instance ``method``: ``gemm.launch(x)`` where
    there is no bias and ``gemm`` takes ``x``, else the method's own."""
    own = type(method).apply

    def apply(self, layer, x, bias=None):
        if bias is None and gemm.takes(x):
            return gemm.launch(x)
        return own(self, layer, x, bias)

    return types.MethodType(apply, method)


class OuterProjections:
    """fc and the LM head of vLLM's draft ``model`` on the ordered GEMM
    (module docstring). ``gemm_class``: the ordered GEMM's host class
    (default: the installed backend's); ``step_rows``: the LM head's row
    counts (None: 1 to 64)."""

    def __init__(self, model, gemm_class=None, step_rows=None) -> None:
        self.model = model
        self.gemm_class = gemm_class
        self.step_rows = step_rows
        self.gemms: dict[str, object] = {}  # role -> the bound host, where installed
        self.reasons: dict[str, str] = {}  # role -> why vLLM's own GEMM runs every call

    def build(self, plan) -> None:
        """Check, time and install each projection where ``plan`` (the
        decode's, or None where it was not built) runs the ordered GEMM;
        each outcome logged once. A refusal keeps vLLM's GEMM for that
        projection alone."""
        self.gemms, self.reasons = {}, {}
        why = self._plan_reason(plan)
        for role, path, what in PROJECTIONS:
            layer = layer_of(self.model, path)
            method = getattr(layer, "quant_method", None)
            if method is not None and "apply" in vars(method):  # a build before: vLLM's own call again first
                del method.apply
            reason = why or gemm_reason(layer, what)
            if reason is None:
                try:
                    reason = self._install(role, layer, what)
                except (Unsupported, LookupError, ValueError, TypeError) as error:
                    reason = str(error)
                except Exception as error:  # noqa: BLE001 (a failed compile or an OOM keeps vLLM's GEMM, not a crash)
                    reason = f"binding it failed ({type(error).__name__}: {error})"
            if reason is not None:
                self.reasons[role] = reason
                logger.info("DSpark keeps vLLM's GEMM for %s: %s.", what, reason)

    @staticmethod
    def _plan_reason(plan) -> str | None:
        if plan is None or plan.draft_reason is not None:
            return "the DSpark decode is not built"
        if not any(p.fused for p in plan.ordered_gemms):
            return "the decode runs no projection on the ordered GEMM (off, at TP > 1, or not installed here)"
        return None

    def _class(self):
        if self.gemm_class is not None:
            return self.gemm_class
        from dspark_core.contracts.kernels import kernel_class

        return kernel_class(policy.ORDERED_GEMM)

    def _install(self, role: str, layer, what: str) -> str | None:
        method = layer.quant_method
        stock = type(method).apply
        gemm = self._class()(ordered_gemm_constants(role, layer.weight), layer.weight)
        rows = range(1, gemm.max_rows + 1) if role == "fc" or self.step_rows is None else \
            [m for m in self.step_rows if 1 <= m <= gemm.max_rows]

        def reference(x, _weight=None):  # vLLM's own call, so the check compares with what vLLM runs
            return stock(method, layer, x, None)

        result = gemm_check.check_projection(layer.weight, list(rows), gemm.run_order, gemm_check.SEED,
                                             reference=reference)
        gemm.bind_orders(result.orders, result.refused)
        logger.info("DSpark's ordered GEMM for %s where the check against cuBLAS found its order: %s.", what,
                    result.summary())
        # Timed against F.linear over copies of the weight (each call from HBM): what gemm_reason found
        # vLLM dispatches to; back to back (lead_us=0): in vLLM a torch op, which releases no PDL dependents
        # early, comes before each of these two projections.
        decision = gemm.decide(lead_us=0) if hasattr(gemm, "decide") else None
        if decision is not None:
            logger.info("%s, decided by timing: %s.", what, decision.summary())
        if not gemm.orders:
            return "no row count is both in cuBLAS's order and faster on DSpark's kernels here"
        method.apply = _ordered_apply(method, gemm)
        self.gemms[role] = gemm
        return None


__all__ = ["PROJECTIONS", "OuterProjections", "dispatch_reason", "gemm_reason", "layer_of"]
