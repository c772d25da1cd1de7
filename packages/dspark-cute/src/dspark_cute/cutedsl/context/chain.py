"""The fused context K/V chain of a DSpark draft, bit for bit its stock
``precompute_and_store_context_kv``, in three steps:

1. ``ContextNorms``: the hidden norm and every layer's input norm of the BF16
   context rows (the stock Triton norm's tree of the constants' arch), one
   kernel, BF16 ``[L, T, H]``;
2. the stock projection ``torch.bmm(normed, W^T)``, ``W`` the layers' K/V
   projection rows stacked ``[L, 2 * kv_heads * 64, H]`` (a device GEMM: the
   spec does not fix its bits, the same call on the same device does);
3. ``ContextKvStore``: the stock ATen K-norm, vLLM's GPT-J rotary kernel
   with the table in BF16 and the paged-cache insert of K and V, one kernel
   per 8 layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dspark_core.contracts.constants import ContextConstants
from dspark_cute.cutedsl.context.store import MAX_LAYERS_PER_LAUNCH, ContextKvStore
from dspark_cute.cutedsl.norms.context_norms import ContextNorms
from dspark_cute.runtime.host import describe


class ContextChain:
    """The context chain of ``constants`` bound to its weights:
    ``run(context_states, positions, caches, slots)`` leaves the caches with
    the bits of the stock chain with the same arguments.

    ``hidden_weight``: the hidden norm's ``[H]`` weight (or None);
    ``pre_weights``: the layers' input-norm weights, a list of ``[H]`` or one
    ``[L, H]`` tensor (or None); ``kv_weight``: the stacked K/V projection
    ``[L, 2 * kv_heads * 64, H]`` BF16, or a function that returns it;
    ``table``: the RoPE table ``[max_position, 64]`` (None without RoPE); all
    CUDA tensors on one device. A list of input-norm weights and a
    ``kv_weight`` function are stacked here (snapshots: ``refresh()`` stacks
    them again, in place, after the weights change); the hidden weight and
    the table are read in place. ``pdl``: programmatic dependent launch
    (default: where supported). Call ``prepare()`` before CUDA graph
    capture."""

    def __init__(self, constants: ContextConstants, hidden_weight: torch.Tensor | None,
                 pre_weights: Sequence[torch.Tensor] | torch.Tensor | None,
                 kv_weight: torch.Tensor | Callable[[], torch.Tensor], table: torch.Tensor | None,
                 *, pdl: bool | None = None) -> None:
        if not isinstance(constants, ContextConstants):
            raise ValueError(f"ContextChain takes ContextConstants, not {type(constants).__name__}")
        self.constants = constants
        self._pre_list = list(pre_weights) if isinstance(pre_weights, (list, tuple)) else None
        self.pre_weights = self._stack_pre() if self._pre_list is not None else pre_weights
        self._kv_source = kv_weight if callable(kv_weight) else None
        self.kv_weight = kv_weight() if callable(kv_weight) else kv_weight
        if not (isinstance(self.kv_weight, torch.Tensor) and self.kv_weight.is_cuda):
            raise ValueError(f"the fused context chain runs on CUDA weights, not a K/V weight "
                             f"{describe(self.kv_weight)}")
        self.norms = ContextNorms(constants.norms, hidden_weight, self.pre_weights, pdl=pdl)
        self.store = ContextKvStore(constants.store, table, pdl=pdl)

    @classmethod
    def of_draft(cls, draft, pdl: bool | None = None, arch: str | None = None) -> ContextChain:
        """The chain of a ``DraftDescription`` (``dspark_core.runtime.description``):
        its constants from the planner for ``arch`` (the norms' stock tree;
        default: the draft's device's, ``spec.layers.stock_arch``;
        Unsupported where the chain does not reproduce the draft's) and its
        tensors, as the executor binds them."""
        from dspark_core.planner.plan import context_constants
        from dspark_core.spec.layers import stock_arch

        arch = arch or stock_arch(draft.device)
        context = draft.context
        pre = [layer.input_norm.weight for layer in draft.layers]
        return cls(context_constants(draft, arch), context.hidden_norm.weight, None if pre[0] is None else pre,
                   context.stacked_kv_weight, context.rope.table if context.rope is not None else None, pdl=pdl)

    def _stack_pre(self) -> torch.Tensor:
        return torch.stack(list(self._pre_list)).contiguous()

    def refresh(self) -> None:
        """Stack the input-norm weights and the K/V projection again, in place
        (so captured graphs stay valid)."""
        if self._pre_list is not None:
            self.pre_weights.copy_(self._stack_pre())
        if self._kv_source is not None:
            self.kv_weight.copy_(self._kv_source())

    def prepare(self) -> None:
        """Compile both kernels (before CUDA graph capture)."""
        self.norms.prepare()
        self.store.prepare()

    def problem(self, context_states, positions, caches, slots) -> str | None:
        """Why the chain does not take these operands (a sentence), or None:
        BF16 ``[T, H]`` context states (``ContextNorms.problem``; T = 0 stores
        nothing), int64 ``positions`` ``[T]``, one cache per layer, ``slots``
        one int64 tensor for every layer or a list with one per layer, None
        storing nothing (``ContextKvStore.problem``)."""
        if self._empty(context_states):
            return None
        reason = self.norms.problem(context_states)
        if reason is not None:
            return reason
        return self.store.problem_past_kv(self.constants.norms.num_layers, context_states.shape[0],
                                          context_states.device, positions, caches, slots)

    def takes(self, context_states, positions, caches, slots) -> bool:
        """Whether the chain takes these operands (``problem`` is None)."""
        return self.problem(context_states, positions, caches, slots) is None

    def run(self, context_states: torch.Tensor, positions: torch.Tensor, caches, slots) -> None:
        """The chain into ``caches`` (module docstring); ValueError with
        ``problem``'s sentence unless it takes the operands."""
        reason = self.problem(context_states, positions, caches, slots)
        if reason is not None:
            raise ValueError(reason)
        self.launch(context_states, positions, caches, slots)

    def launch(self, context_states: torch.Tensor, positions: torch.Tensor, caches, slots) -> None:
        """``run`` without its checks."""
        if self._empty(context_states):
            return
        normed = self.norms.launch(context_states)
        kv = torch.bmm(normed, self.kv_weight.transpose(1, 2))
        self.store.launch(kv, positions, caches, slots)

    def _empty(self, states) -> bool:
        h = self.constants.norms.hidden_size
        return isinstance(states, torch.Tensor) and states.dim() == 2 and tuple(states.shape) == (0, h)


__all__ = ["MAX_LAYERS_PER_LAUNCH", "ContextChain"]
