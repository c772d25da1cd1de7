"""The reference DSpark draft model: its stock eager forward over positions
and a paged KV cache, and the context K/V precompute-and-store.

The module tree carries what the planner and the executor read: each layer's
norms (``input_norm``, ``post_attn_norm``, ``pre_ffn_norm``,
``post_ffn_norm``), connections (``add_attn``, ``add_ffn``), attention and
MLP; the model's ``hidden_norm`` (the context chain's), final ``norm``,
``rotary`` table, embedding and LM head. Weights are made from the config's
seed on the CPU (no downloads), so every device gets the same bits.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from dspark_core.reference.config import DTYPES, DraftConfig
from dspark_core.spec.attention import NO_VALID_SLOT, check_some_valid, paged_attention
from dspark_core.spec.layers import (
    GatedMLP,
    GatedResidual,
    HeadNorm,
    PagedKVCache,
    RMSNorm,
    Rotary,
    capturing,
    k_norm_context,
    linear,
    o_gate,
    qk_norm_rope,
    residual_boundary,
)
from dspark_core.spec.numerics import F32


@dataclass
class StepInputs:
    """One decode step of m tokens: ``positions`` and cache ``slots`` (int64
    ``[m]``; a negative slot stores nothing) and ``attn_slots`` (int64
    ``[m, S]``: the cache slots each token attends to, -1 padded)."""

    positions: torch.Tensor
    slots: torch.Tensor
    attn_slots: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("positions", "slots", "attn_slots"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
                raise TypeError(f"StepInputs.{name} must be an int64 tensor, not "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
        m = self.positions.shape[0] if self.positions.dim() == 1 else -1
        if (self.positions.dim() != 1 or self.slots.shape != self.positions.shape or self.attn_slots.dim() != 2
                or self.attn_slots.shape[0] != m):
            raise ValueError(f"StepInputs takes positions and slots of [m] and attn_slots of [m, S], not "
                             f"{list(self.positions.shape)}, {list(self.slots.shape)} and "
                             f"{list(self.attn_slots.shape)}")
        devices = {self.positions.device, self.slots.device, self.attn_slots.device}
        if len(devices) != 1:
            raise ValueError(f"StepInputs' tensors must share one device, not {sorted(map(str, devices))}")

    @classmethod
    def block(cls, start: int, m: int, device=None, span: int | None = None) -> StepInputs:
        """m tokens at positions ``start .. start+m-1`` of one sequence whose
        slot is its position; token i attends causally to slots ``0 ..
        start+i``. ``span`` fixes the width of ``attn_slots`` (default
        ``start + m``), so steps share one shape (a CUDA graph's)."""
        span = start + m if span is None else span
        if span < start + m:
            raise ValueError(f"a span of {span} slots cannot hold positions up to {start + m - 1}")
        positions = torch.arange(start, start + m, dtype=torch.int64, device=device)
        attn = torch.arange(span, dtype=torch.int64, device=device).expand(m, span).clone()
        attn[attn > positions[:, None]] = -1
        return cls(positions, positions.clone(), attn)

    def copy_(self, other: StepInputs) -> StepInputs:
        """Copy ``other``'s values into these tensors (a graph's static inputs)."""
        for mine, theirs in ((self.positions, other.positions), (self.slots, other.slots),
                             (self.attn_slots, other.attn_slots)):
            if mine.shape != theirs.shape:
                raise ValueError(f"a step of shape {tuple(theirs.shape)} into one of {tuple(mine.shape)}")
            mine.copy_(theirs)
        return self


def attend(q: torch.Tensor, cache: PagedKVCache, attn_slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The draft's attention: ``dspark_core.spec.attention.paged_attention`` (its
    exact order: head-tree scores, ``exp_rn``, 128 lane sums folded by
    halves), BF16 ``[m, heads, D]``. ValueError for a row of ``attn_slots``
    with no valid slot (checked outside CUDA-graph capture): its answer would
    be 0 / 0."""
    if not capturing():
        check_some_valid(attn_slots)
    return paged_attention(q, cache, attn_slots, num_kv_heads)


class DraftAttention(nn.Module):
    """The stock draft attention (vLLM's ``MuseSpark1xAttention`` on the
    draft's path): QKV projection (rows q, k, v, o-gate), the fused QK-norm
    and GPT-J RoPE (``qk_norm_rope``: one weightless ``qk_norm`` for q and k),
    the KV insert, attention (the reference draft's own, ``spec.attention``),
    the o-norm with its sigmoid o-gate (``o_gate``) and the output projection."""

    def __init__(self, config: DraftConfig, rotary: Rotary | None) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.use_o_gate = c.use_o_gate
        rows = 2 * c.q_size + 2 * c.kv_size if c.use_o_gate else c.q_size + 2 * c.kv_size
        dtype = DTYPES[c.compute_dtype]
        self.qkv_proj = nn.Parameter(torch.zeros(rows, c.hidden_size, dtype=dtype), requires_grad=False)
        self.o_proj = nn.Parameter(torch.zeros(c.hidden_size, c.q_size, dtype=dtype), requires_grad=False)
        self.qk_norm = HeadNorm(c.head_dim, c.head_norm_eps)
        self.o_norm = HeadNorm(c.head_dim, c.head_norm_eps)
        # Shared with the model (not a child: one table for every layer).
        self._rotary = [rotary]

    @property
    def rotary(self) -> Rotary | None:
        return self._rotary[0]

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, og)`` views ``[m, heads, D]`` of the projection's rows
        (og None without the o-gate)."""
        m = qkv.shape[0]
        sizes = [self.q_size, self.kv_size, self.kv_size]
        if self.use_o_gate:
            sizes.append(self.q_size)
        parts = qkv.split(sizes, dim=-1)
        q = parts[0].reshape(m, self.num_heads, self.head_dim)
        k = parts[1].reshape(m, self.num_kv_heads, self.head_dim)
        v = parts[2].reshape(m, self.num_kv_heads, self.head_dim)
        og = parts[3].reshape(m, self.num_heads, self.head_dim) if self.use_o_gate else None
        return q, k, v, og

    def front(self, x: torch.Tensor, step: StepInputs, cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The QKV front: projection, QK-norm, RoPE at ``step.positions`` and
        the K/V insert at ``step.slots``. Returns ``(q, og)``."""
        return self.front_from(linear(x, self.qkv_proj), step, cache)

    def front_from(
        self, qkv: torch.Tensor, step: StepInputs, cache: PagedKVCache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``front`` after its projection: QK-norm, RoPE and the insert of
        the projection ``qkv`` (BF16 ``[m, rows]``). Returns ``(q, og)``."""
        q, k, v, og = self.split_qkv(qkv)
        q = qk_norm_rope(q, self.qk_norm, step.positions, self.rotary)
        k = qk_norm_rope(k, self.qk_norm, step.positions, self.rotary)
        cache.insert(k, v, step.slots)
        return q, og

    def gated(self, q: torch.Tensor, og: torch.Tensor | None, step: StepInputs, cache: PagedKVCache) -> torch.Tensor:
        """Attention over the cache, then the o-norm and gate: the output
        projection's input (BF16 ``[m, q_size]``)."""
        attn = attend(q, cache, step.attn_slots, self.num_kv_heads)
        if og is not None:
            attn = o_gate(attn, og, self.o_norm)
        return attn.reshape(attn.shape[0], self.q_size)

    def back(self, q: torch.Tensor, og: torch.Tensor | None, step: StepInputs, cache: PagedKVCache) -> torch.Tensor:
        """``gated``, then the output projection (BF16 ``[m, H]``)."""
        return linear(self.gated(q, og, step, cache), self.o_proj)

    def forward(self, x: torch.Tensor, step: StepInputs, cache: PagedKVCache) -> torch.Tensor:
        q, og = self.front(x, step, cache)
        return self.back(q, og, step, cache)


def _connection(config: DraftConfig, name: str) -> GatedResidual:
    conn = GatedResidual(config.hidden_size)
    dtype = config.connection_overrides.get(name, {}).get("dtype")
    if dtype is not None:
        conn.alpha = nn.Parameter(conn.alpha.to(DTYPES[dtype]), requires_grad=False)
        conn.beta = nn.Parameter(conn.beta.to(DTYPES[dtype]), requires_grad=False)
    return conn


class DraftLayer(nn.Module):
    """One draft layer: ``input_norm`` (the pre-QKV norm), attention, the
    attention boundary (``post_attn_norm``, ``add_attn``, ``pre_ffn_norm``),
    the MLP and the feed-forward boundary's ``post_ffn_norm`` and
    ``add_ffn`` (its pre-norm is the next layer's ``input_norm`` or the
    model's final ``norm``)."""

    def __init__(self, config: DraftConfig, index: int, rotary: Rotary | None) -> None:
        super().__init__()
        h = config.hidden_size

        def norm(name: str) -> RMSNorm:
            return RMSNorm(h, **config.norm_variant(f"layers.{index}.{name}"))

        self.input_norm = norm("input_norm")
        self.self_attn = DraftAttention(config, rotary)
        self.post_attn_norm = norm("post_attn_norm")
        self.add_attn = _connection(config, f"layers.{index}.add_attn")
        self.pre_ffn_norm = norm("pre_ffn_norm")
        self.mlp = GatedMLP(h, config.intermediate_size)
        self.post_ffn_norm = norm("post_ffn_norm")
        self.add_ffn = _connection(config, f"layers.{index}.add_ffn")


def check_inputs(model, positions: torch.Tensor, caches, slots, attn_slots: torch.Tensor | None = None,
                 distinct: bool = False) -> None:
    """The ValueErrors the stock draft raises for out-of-range integer inputs,
    for a caller whose kernels would skip such rows instead (the specialized
    decode and context chain), with one host read for all of them. Checked
    in this order, each with the stock module's words: ``positions`` within
    the RoPE table (``Rotary``); each layer's ``slots`` (one tensor for every
    cache, or one per layer) below its cache's slot count (the KV insert);
    with ``distinct``, no non-negative slot of ``slots`` twice (the KV
    insert); ``attn_slots`` below the smallest cache's slot count, and
    every row of them with a valid slot (``paged_attention``). A negative
    slot is a skip, as in the stock."""
    rotary = model.rotary
    per_layer = slots if isinstance(slots, (list, tuple)) else [slots] * len(caches)
    probes: list[torch.Tensor] = []  # int64 scalars on the inputs' device, read once
    if rotary is not None and positions.numel():
        probes += [positions.min().long(), positions.max().long()]
    tensors: dict[int, int] = {}  # a slot tensor shared by layers is probed once
    for layer_slots in per_layer:
        if layer_slots is not None and layer_slots.numel() and id(layer_slots) not in tensors:
            tensors[id(layer_slots)] = len(probes)
            probes.append(layer_slots.max().long())
    repeated = attn_max = None  # their probes' indices, where checked
    if distinct and not isinstance(slots, (list, tuple)) and slots.numel() > 1:
        ordered = slots.reshape(-1).sort().values
        repeated = len(probes)
        probes.append(((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).any().long())
    if attn_slots is not None and attn_slots.numel() and caches:
        attn_max = len(probes)
        probes.append(attn_slots.max().long())
        probes.append((attn_slots < 0).all(dim=1).any().long())
    if not probes:
        return
    values = torch.stack([p.to(probes[0].device) for p in probes]).tolist()  # the one host read
    if rotary is not None and positions.numel() and (values[0] < 0 or values[1] >= rotary.max_position):
        raise ValueError(f"RoPE positions must lie in [0, {rotary.max_position})")
    for cache, layer_slots in zip(caches, per_layer):
        if layer_slots is None or not layer_slots.numel():
            continue
        num_slots = cache.num_slots if hasattr(cache, "num_slots") else cache.shape[0] * cache.shape[2]
        if values[tensors[id(layer_slots)]] >= num_slots:
            raise ValueError(f"a slot beyond the cache's {num_slots} slots")
    if repeated is not None and values[repeated]:
        raise ValueError("the KV insert takes distinct slots; a non-negative slot repeats")
    if attn_max is not None:
        smallest = min(cache.num_slots for cache in caches)
        if values[attn_max] >= smallest:
            raise ValueError(f"an attention slot beyond the cache's {smallest} slots")
        if values[attn_max + 1]:
            raise ValueError(NO_VALID_SLOT)


class DraftModel(nn.Module):
    """The reference DSpark draft (stock eager layers)."""

    def __init__(self, config: DraftConfig, device: torch.device | str | None = None, progress=None) -> None:
        """Build the draft on ``device`` (default: the CPU); on ``"meta"`` it
        has shapes and dtypes but no weights (enough to plan it).
        ``progress(done, total)``: called as the weights are drawn (elements)."""
        super().__init__()
        if not isinstance(config, DraftConfig):
            raise TypeError(f"DraftModel takes a DraftConfig, not {type(config).__name__}")
        meta = device is not None and torch.device(device).type == "meta"
        # On the meta device nothing is allocated, so any config plans at once.
        with torch.device("meta") if meta else contextlib.nullcontext():
            self._build(config)
        if not meta:
            self.init_weights(config.seed, progress)
            if device is not None:
                self.to(device)

    def _build(self, config: DraftConfig) -> None:
        self.config = config
        h = config.hidden_size
        self.default_dtype = DTYPES[config.compute_dtype]
        self.residual_dtype = DTYPES[config.residual_dtype]
        self.rotary = (
            Rotary(config.head_dim, config.max_position, config.rope_theta, DTYPES[config.rope_table_dtype])
            if config.use_rope
            else None
        )
        self.embed = nn.Parameter(torch.zeros(config.vocab_size, h, dtype=self.default_dtype), requires_grad=False)
        self.hidden_norm = RMSNorm(h, **config.norm_variant("hidden_norm"))
        self.layers = nn.ModuleList(DraftLayer(config, i, self.rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(h, **config.norm_variant("norm"))
        self.lm_head = nn.Parameter(torch.zeros(config.vocab_size, h, dtype=self.default_dtype), requires_grad=False)

    # -- weights -------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int, progress=None) -> None:
        """Deterministic weights from ``seed`` (CPU generator, in the order
        of ``named_parameters``): GEMM weights N(0, 1/fan_in), norm weights
        1 + N(0, 0.1^2), residual alpha in [0.5, 1.5) and beta in [0.25, 1.25).
        ``progress(done, total)`` is called after each parameter (elements)."""
        gen = torch.Generator().manual_seed(seed)
        total = sum(p.numel() for p in self.parameters())
        done = 0
        for name, p in self.named_parameters():
            shape = tuple(p.shape)
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "alpha":
                value = torch.rand(shape, generator=gen) + 0.5
            elif leaf == "beta":
                value = torch.rand(shape, generator=gen) + 0.25
            elif p.dim() == 1:
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                value = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
            p.copy_(value.to(p.dtype))
            done += p.numel()
            if progress is not None:
                progress(done, total)

    # -- structure the planner and the executor read ---------------------------
    def boundaries(self) -> list[tuple[RMSNorm, GatedResidual, RMSNorm]]:
        """Every residual boundary ``(post, conn, pre)`` in order: layer i's
        attention boundary (2i), then its feed-forward boundary (2i+1) into
        the next layer's input norm or the final norm."""
        out = []
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            out.append((layer.post_attn_norm, layer.add_attn, layer.pre_ffn_norm))
            out.append((layer.post_ffn_norm, layer.add_ffn, nxt))
        return out

    def make_caches(self, num_blocks: int, device=None, layout: str = "LBHNC") -> list[PagedKVCache]:
        """One paged BF16 cache per layer, in the physical ``layout``
        (``spec.layers.CACHE_LAYOUTS``)."""
        c = self.config
        return [PagedKVCache(num_blocks, c.num_kv_heads, c.kv_block_size, c.head_dim, device, layout)
                for _ in self.layers]

    # -- the stock forward ---------------------------------------------------
    def first_norm(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stream, x)``: the residual stream (FP32, or the BF16 input as
        is: a BF16 row round-trips through FP32 unchanged) and the first
        layer's input norm of its BF16 copy."""
        stream = hidden_states if hidden_states.dtype == self.default_dtype else hidden_states.to(F32)
        first = self.layers[0].input_norm if len(self.layers) else self.norm
        return stream, first(stream.to(self.default_dtype), out_dtype=self.default_dtype)

    def forward(self, hidden_states: torch.Tensor, step: StepInputs, caches: list[PagedKVCache]) -> torch.Tensor:
        """The layers and the final norm over ``hidden_states`` (``[m, H]``,
        BF16 embeddings or an FP32 stream): BF16 ``[m, H]``."""
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.config.hidden_size:
            raise ValueError(f"the draft takes hidden states of [m, {self.config.hidden_size}]")
        if len(caches) != len(self.layers):
            raise ValueError(f"the draft takes one KV cache per layer ({len(self.layers)})")
        stream, x = self.first_norm(hidden_states)
        bounds = self.boundaries()
        for i, layer in enumerate(self.layers):
            attn_out = self.reduce_branch(layer.self_attn(x, step, caches[i]))
            stream, ffn_in = residual_boundary(*bounds[2 * i], attn_out, stream)
            ffn_out = self.reduce_branch(layer.mlp(ffn_in))
            stream, x = residual_boundary(*bounds[2 * i + 1], ffn_out, stream)
        return x

    def reduce_branch(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch's output as its boundary takes it: the whole draft's
        branch, as it is (a TP shard, ``dspark_core.reference.tp.TPDraftModel``,
        all-reduces its partial here)."""
        return branch

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of integer ``tokens`` (ValueError outside the
        vocabulary: a negative id would wrap to the last rows)."""
        if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"tokens must be an integer tensor, not {getattr(tokens, 'dtype', type(tokens).__name__)}")
        vocab = self.config.vocab_size
        if not capturing() and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return self.embed[tokens]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).to(F32)

    # -- the context chain ---------------------------------------------------
    def stacked_kv_weight(self) -> torch.Tensor:
        """``[L, 2 * kv_size, H]``: each layer's K rows then V rows of its
        QKV projection."""
        q, kv = self.config.q_size, self.config.kv_size
        return torch.stack([layer.self_attn.qkv_proj[q : q + 2 * kv] for layer in self.layers])

    def context_norms(self, context_states: torch.Tensor) -> torch.Tensor:
        """BF16 ``[L, T, H]``: ``stack([input_norm_l(hidden_norm(x))])``,
        the hidden norm's output rounded to BF16 first."""
        h = self.hidden_norm(context_states, out_dtype=torch.bfloat16)
        return torch.stack([layer.input_norm(h, out_dtype=torch.bfloat16) for layer in self.layers])

    def context_kv_store(self, kv: torch.Tensor, positions: torch.Tensor, caches, slots) -> None:
        """After the projection ``kv`` (``[L, T, 2 * kv_size]``): per layer the
        ATen K-norm (``k_norm_context``), RoPE at ``positions`` with the BF16
        table (``Rotary.context_table``) and the insert at its slots
        (``slots``: one int64 ``[T]`` for every layer, or a list with one per
        layer, None storing nothing)."""
        c = self.config
        L, t = kv.shape[:2]
        per_layer = slots if isinstance(slots, (list, tuple)) else [slots] * L
        if len(per_layer) != L:
            raise ValueError(f"the context store takes one slot mapping per layer ({L})")
        kv = kv.view(L, t, 2, c.num_kv_heads, c.head_dim)
        for i, layer in enumerate(self.layers):
            if per_layer[i] is None:
                continue
            attn = layer.self_attn
            k = k_norm_context(kv[i, :, 0], attn.qk_norm)
            if attn.rotary is not None:
                k = attn.rotary(k, positions, attn.rotary.context_table())
            rows = per_layer[i].shape[0]
            caches[i].insert(k[:rows], kv[i, :rows, 1], per_layer[i])

    def precompute_and_store_context_kv(
        self, context_states: torch.Tensor, positions: torch.Tensor, caches, slots
    ) -> None:
        """The context K/V chain of target hidden states (BF16 ``[T, H]``):
        ``context_norms``, the stacked K/V projection (one batched matmul, a
        device op), then ``context_kv_store``."""
        normed = self.context_norms(context_states)
        kv = torch.bmm(normed, self.stacked_kv_weight().transpose(1, 2))
        self.context_kv_store(kv, positions, caches, slots)
