"""The fused context K/V chain of a DSpark draft: ``ContextNorms``, the stock
K/V projection and ``ContextKvStore``, bit for bit
``dspark_core.reference.model.DraftModel.precompute_and_store_context_kv``.

- ``ContextNorms`` (``context_norms``): the hidden norm and every layer's
  input norm of BF16 context rows, one kernel, BF16 ``[L, T, H]``;
- the projection stays the stock ``torch.bmm(normed, W^T)`` with ``W`` the
  model's ``stacked_kv_weight()`` (a device GEMM: the spec does not fix its
  bits, the same call on the same device does);
- ``ContextKvStore`` (``context_store``): the weightless K-norm, GPT-J RoPE
  and the paged-cache insert of K and V, one kernel per 8 layers.

``ContextChain`` binds the three to one model; ``store_context_kv`` is the
one-call form.
"""

from __future__ import annotations

import torch

from dspark_core.contracts.constants import (
    ContextConstants,
    ContextNormConstants,
    context_store_constants,
    norm_constants,
)
from dspark_core.planner.plan import context_unsupported
from dspark_cute.cutedsl.context.store import MAX_LAYERS_PER_LAUNCH, ContextKvStore, compile_context_store
from dspark_cute.cutedsl.norms.context_norms import ContextNorms, compile_context_norms


def context_constants(model) -> ContextConstants:
    """The kernels' constants of ``model``'s context chain, or ValueError
    with the planner's sentence where the fused chain is not bitwise the
    stock one (``dspark_core.planner.plan.context_unsupported``)."""
    reason = context_unsupported(model)
    if reason is not None:
        raise ValueError(f"the context K/V chain does not fuse: {reason}")
    h = model.config.hidden_size
    norms = ContextNormConstants(
        h, len(model.layers), norm_constants(model.hidden_norm, h), norm_constants(model.layers[0].input_norm, h)
    )
    attn = model.layers[0].self_attn
    return ContextConstants(norms, context_store_constants(attn.k_norm, model.config.num_kv_heads, attn.rotary))


class ContextChain:
    """The fused context chain of one CUDA ``DraftModel``: ``run(context_states,
    positions, caches, slots)`` leaves the caches with the same bits as
    ``model.precompute_and_store_context_kv`` with the same arguments, in
    three steps: ``ContextNorms`` (BF16 ``[L, T, H]``), ``torch.bmm`` with
    the stacked K/V weight transposed, ``ContextKvStore``.

    The chain holds snapshots of the weights it stacks (the layers' input-norm
    weights and their K/V projection rows) and reads the hidden norm's weight
    and the RoPE table in place; ``refresh()`` copies the stacks again after
    the model's weights change (in place, so captured graphs stay valid).
    ``pdl``: programmatic dependent launch (default: where supported). Call
    ``prepare()`` before CUDA graph capture."""

    def __init__(self, model, pdl: bool | None = None) -> None:
        self.model = model
        self.constants = context_constants(model)
        self.kv_weight = model.stacked_kv_weight()
        if self.kv_weight.device.type != "cuda":
            raise ValueError(f"the fused context chain runs on a CUDA model, not one on {self.kv_weight.device}")
        hidden = model.hidden_norm.weight
        self.pre_weights = self._stack_pre_weights()
        self.norms = ContextNorms(self.constants.norms, hidden, self.pre_weights, pdl=pdl)
        rotary = model.layers[0].self_attn.rotary
        self.store = ContextKvStore(
            self.constants.store, rotary.cos_sin if rotary is not None else None, pdl=pdl
        )

    def _stack_pre_weights(self) -> torch.Tensor | None:
        weights = [layer.input_norm.weight for layer in self.model.layers]
        if weights[0] is None:
            return None
        return torch.stack(weights).contiguous()

    def refresh(self) -> None:
        """Copy the model's input-norm weights and K/V projection rows into
        the chain's stacks again (in place)."""
        if self.pre_weights is not None:
            self.pre_weights.copy_(self._stack_pre_weights())
        self.kv_weight.copy_(self.model.stacked_kv_weight())

    def prepare(self) -> None:
        """Compile both kernels (before CUDA graph capture)."""
        compile_context_norms(self.constants.norms, self.norms.pdl)
        compile_context_store(self.constants.store, self.store.pdl)

    def run(self, context_states: torch.Tensor, positions: torch.Tensor, caches, slots) -> None:
        """The context chain of BF16 ``[T, H]`` context states at int64
        ``positions`` (``[T]``) into ``caches`` (one per layer: tensors or
        ``PagedKVCache``) at ``slots`` (one int64 tensor for every layer, or a
        list with one per layer, None storing nothing); ValueError where a
        kernel does not take its operands (``ContextNorms.takes``,
        ``ContextKvStore.problem``). T = 0 stores nothing."""
        h = self.constants.norms.hidden_size
        if (
            isinstance(context_states, torch.Tensor)
            and context_states.dim() == 2
            and tuple(context_states.shape) == (0, h)
        ):
            return
        normed = self.norms.run(context_states)
        kv = torch.bmm(normed, self.kv_weight.transpose(1, 2))
        self.store.run(kv, positions, caches, slots)


def store_context_kv(model, context_states: torch.Tensor, positions: torch.Tensor, caches, slots) -> None:
    """``model.precompute_and_store_context_kv(context_states, positions,
    caches, slots)`` run fused, the same cache bits: a fresh
    ``ContextChain(model).run(...)`` (it stacks the weights anew each call;
    hold a ``ContextChain`` to repeat it or to capture it in a CUDA graph).
    ValueError where the chain does not fuse or its operands are not taken."""
    ContextChain(model).run(context_states, positions, caches, slots)


__all__ = [
    "MAX_LAYERS_PER_LAUNCH",
    "ContextChain",
    "ContextKvStore",
    "ContextNorms",
    "context_constants",
    "store_context_kv",
]
