"""The model-neutral description of a DSpark draft: what the planner asks
about and what the executor binds and runs, for any model.

A model adapter (the reference draft's is ``dspark_core.reference.adapter``;
vLLM's is in dspark-vllm) builds one ``DraftDescription`` per draft. It
carries, per part,

- the facts a fused kernel's constants are built from (eps values, dtypes,
  sizes) and the tensors it binds (weights, gates, tables), read from the
  model's modules without copying them;
- ``unsupported``: the adapter's sentence where the model's module is not the
  stock one the kernels reproduce (another class, an overridden forward), or
  None;
- the stock calls the executor falls back to for that part, which run the
  model's own modules.

The stock calls take an opaque ``*step``: whatever the model's forward takes
after its hidden states (the reference draft: ``(StepInputs, caches)``;
vLLM: ``(positions,)``, its layers read the rest from the forward context).
The executor passes it through untouched; ``DraftDescription.positions(*step)``
gives the step's positions. The context chain's calls likewise take what the
model's ``precompute_and_store_context_kv`` takes after its states and
positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark_core.errors import quoted

Tensor = torch.Tensor


@dataclass
class Norm:
    """One RMSNorm over rows of ``hidden_size`` columns: ``stock(x,
    out_dtype)`` runs the model's module. ``weight`` (None: weightless) is
    the module's own tensor; ``gain_center`` is added to the widened weight;
    ``weight_before_norm``: the weight scales the input (else the output);
    ``out_dtype``: the dtype the module returns by default."""

    name: str
    stock: Callable[[Tensor, torch.dtype | None], Tensor]
    hidden_size: int
    eps: float
    weight: Tensor | None
    gain_center: float = 0.0
    weight_before_norm: bool = False
    out_dtype: torch.dtype = torch.bfloat16
    unsupported: str | None = None


@dataclass
class Connection:
    """The gated residual ``alpha * stream + beta * branch`` in FP32:
    ``stock(stream, branch)`` runs the module; ``alpha``, ``beta`` are its
    materialized coefficients (None where it has none)."""

    name: str
    stock: Callable[[Tensor, Tensor], Tensor]
    alpha: Tensor | None
    beta: Tensor | None
    unsupported: str | None = None


@dataclass
class Boundary:
    """A residual boundary: ``post`` norm of the branch, the connection, the
    next ``pre`` norm of the new stream (the next layer's input norm, or the
    final norm)."""

    name: str
    post: Norm
    connection: Connection
    pre: Norm


@dataclass
class HeadNorm:
    """A per-head RMSNorm over ``head_dim`` columns (QK-norm, K-norm, o-norm)."""

    head_dim: int
    eps: float
    weight: Tensor | None = None
    unsupported: str | None = None


@dataclass
class Rope:
    """The rotary embedding the layer applies: ``table`` is ``[max_position,
    head_dim]`` (cos then sin columns), GPT-J pairs over the whole head."""

    table: Tensor
    head_dim: int
    unsupported: str | None = None


@dataclass
class Attention:
    """A layer's attention branch: the QKV projection (rows q, k, v and, with
    ``use_o_gate``, the o-gate), QK-norm, RoPE, the KV insert, attention, the
    o-norm with its sigmoid gate and the output projection.

    Stock calls (the model's modules):
    ``forward(x, *step)``: the whole branch, returning what its boundary
    reads (at TP the all-reduced sum);
    ``project_qkv(x)``: the QKV projection;
    ``front_from(qkv, *step) -> (q, og)``: QK-norm, RoPE and insert after the
    projection (``q``, ``og`` ``[m, heads, D]``; og None without the o-gate);
    ``attend(q, *step)``: attention over the cache, ``[m, heads, D]``;
    ``gate(attn, og)``: the o-norm and gate, ``[m, heads, D]``;
    ``project_out(gated)``: the output projection of ``[m, q_size]`` (at TP
    this rank's partial, before the all-reduce).
    ``cache(*step) -> (kv_cache, slots)``: the layer's cache tensor
    ``[blocks, kv_heads, block_size, 2 * D]`` and this step's slots, where a
    fused QKV epilogue inserts; ``attention_operands(*step) ->
    (kv_cache, attn_slots)`` for the fused paged attention, or None where the
    model's attention is not the one that kernel reproduces
    (``attention_unsupported`` then says why)."""

    qkv_weight: Tensor
    o_proj_weight: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    use_o_gate: bool
    q_norm: HeadNorm
    k_norm: HeadNorm
    o_norm: HeadNorm | None
    rope: Rope | None
    kv_block_size: int
    forward: Callable[..., Tensor]
    project_qkv: Callable[[Tensor], Tensor]
    front_from: Callable[..., tuple]
    attend: Callable[..., Tensor]
    gate: Callable[[Tensor, Tensor], Tensor]
    project_out: Callable[[Tensor], Tensor]
    cache: Callable[..., tuple]
    attention_operands: Callable[..., tuple] | None = None
    unsupported: str | None = None
    attention_unsupported: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def split_qkv(self, qkv: Tensor) -> tuple:
        """``(q, k, v, og)`` views ``[m, heads, D]`` of the projection's rows
        (og None without the o-gate)."""
        m, d = qkv.shape[0], self.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size] + ([self.q_size] if self.use_o_gate else [])
        parts = qkv.split(sizes, dim=-1)
        og = parts[3].reshape(m, self.num_heads, d) if self.use_o_gate else None
        return (parts[0].reshape(m, self.num_heads, d), parts[1].reshape(m, self.num_kv_heads, d),
                parts[2].reshape(m, self.num_kv_heads, d), og)


@dataclass
class MLP:
    """A layer's gated MLP: ``project_gate_up(x)`` (gate rows, then up rows),
    ``activation(gu)``, ``project_down(h)`` (at TP this rank's partial),
    ``forward(x)`` the whole branch as its boundary reads it. A weight is
    None where the module has no such projection (``unsupported`` then says
    why the MLP is not the stock one)."""

    gate_up_weight: Tensor | None
    down_weight: Tensor | None
    intermediate_size: int
    forward: Callable[[Tensor], Tensor]
    project_gate_up: Callable[[Tensor], Tensor]
    activation: Callable[[Tensor], Tensor]
    project_down: Callable[[Tensor], Tensor]
    unsupported: str | None = None


@dataclass
class Layer:
    """One draft layer: its input norm, attention branch and boundary, MLP
    branch and boundary (whose pre-norm is the next layer's input norm or the
    final norm). ``gemm_unsupported``: why the layer's projections are not
    the BF16 ``F.linear`` (cuBLAS) the ordered GEMM is checked and timed
    against (another GEMM backend of the model's), or None."""

    index: int
    input_norm: Norm
    attention: Attention
    attention_boundary: Boundary
    mlp: MLP
    ffn_boundary: Boundary
    gemm_unsupported: str | None = None


@dataclass
class Context:
    """The context K/V chain (``precompute_and_store_context_kv``): the
    hidden norm, every layer's input norm of its output (stacked), one
    batched K/V projection against ``stacked_kv_weight`` ``[L, 2 * kv, H]``,
    the weightless K-norm, RoPE and each layer's cache insert.
    ``stock(states, positions, *args)`` runs the model's method;
    ``caches(*args)`` gives the layers' cache tensors and ``slots(*args)``
    the slot mapping (one tensor for every layer, or a list with one per
    layer, None storing nothing)."""

    hidden_norm: Norm
    stacked_kv_weight: Callable[[], Tensor]
    k_norm: HeadNorm
    rope: Rope | None
    num_kv_heads: int
    head_dim: int
    stock: Callable[..., None]
    caches: Callable[..., Sequence[Tensor]]
    slots: Callable[..., Any]
    unsupported: str | None = None


@dataclass
class DraftDescription:
    """A whole draft as the planner and the executor read it (module
    docstring). ``device``: where its weights live; ``tp``: the TP size of
    this rank's shard (1: the whole draft); ``all_reduce(partial)``: the
    model's stock all-reduce of a row-parallel partial (TP > 1);
    ``positions(*step)``: a step's positions;
    ``check_step(*step, fused)`` and ``check_context(positions, *args)``:
    the ValueErrors the stock forward and context chain raise for bad step
    inputs (with ``fused``, also those of out-of-range integer inputs that
    fused kernels would skip instead of raising; None: nothing to check)."""

    name: str
    hidden_size: int
    compute_dtype: torch.dtype
    residual_dtype: torch.dtype
    device: torch.device
    layers: list[Layer]
    final_norm: Norm
    context: Context | None = None
    tp: int = 1
    all_reduce: Callable[[Tensor], Tensor] | None = None
    positions: Callable[..., Tensor] | None = None
    check_step: Callable[..., None] | None = None
    check_context: Callable[..., None] | None = None
    unsupported: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def first_norm(self) -> Norm:
        """The norm the first layer's input goes through (the final norm for a draft without layers)."""
        return self.layers[0].input_norm if self.layers else self.final_norm

    def boundaries(self) -> list[Boundary]:
        """Every residual boundary in order: layer i's attention boundary
        (2i), then its feed-forward boundary (2i + 1)."""
        return [b for layer in self.layers for b in (layer.attention_boundary, layer.ffn_boundary)]


def check_draft(draft: object, name: str = "draft") -> DraftDescription:
    """``draft`` where it is a ``DraftDescription``; TypeError naming ``name``
    otherwise (a model or a config is described first: the reference
    draft's ``reference.adapter.describe``, vLLM's ``dspark_vllm.adapter.
    describe_vllm``)."""
    if not isinstance(draft, DraftDescription):
        raise TypeError(f"{name} must be a DraftDescription (describe the model first), not "
                        f"{type(draft).__name__} {quoted(draft)}")
    return draft


__all__ = ["Attention", "Boundary", "Connection", "Context", "DraftDescription", "HeadNorm", "Layer", "MLP",
           "Norm", "Rope", "check_draft"]
