"""vLLM 0.33.0's Muse Spark DSpark draft step, assembled from vLLM's own
binaries (the carried Triton and CUDA kernels of ``launch_stock``), cuBLAS
through torch for the GEMMs and ATen where vLLM runs ATen, over the reference
draft's weights (``dspark_core.reference``) and a stated head.

One step, as the speculator's FULL CUDA graph records it
(``DFlashSpeculator._prepare_graph_forward`` then
``DSparkSpeculator._generate_draft``), for R requests of N query tokens:

1. ``combine``: ``combine_hidden_states`` of the staged target features
   (``[R (N + 1), aux]`` BF16: the fc GEMM; its ``.to(fc dtype)`` is a no-op
   on BF16), copied into the speculator's hidden-state buffer;
2. ``context``: ``precompute_and_store_context_kv`` of those rows
   (``dspark.py``): the hidden norm and each layer's input norm (Triton),
   ``torch.stack``, ``torch.bmm`` against the K/V rows stacked once at load,
   the ``permute(...).contiguous()`` copy, the ATen K-norm (float, pow, mean,
   add, rsqrt, mul, to), ``positions.repeat(L)``, vLLM's rotary kernel with
   the BF16 table and one ``reshape_and_cache_flash`` per layer;
3. ``embed``: ``F.embedding(input_ids.long())`` then the FP32 stream cast;
4. per layer (``MuseSparkDSparkDecoderLayer.forward``): the stream cast to
   BF16 and the input norm (layer 0; later layers' are in the boundary
   before), the QKV GEMM, ``fused_muse_spark_qknorm_rope_kv_insert`` (in
   place, FP32 table), the attention (the caller's, the same on both sides),
   FLA's o-norm and sigmoid gate, o_proj, the attention boundary (post-norm,
   the gated residual's ATen cast, mul, mul, add, the BF16 cast and the
   pre-FFN norm), gate_up, ``act_and_mul_kernel``, down and the feed-forward
   boundary into the next layer's input norm or the final norm;
5. ``lm_head``: the gather of the sample rows and the LM head GEMM
   (``compute_draft_logits``: the logits processor's F.linear, scale 1);
6. ``markov``: ``_sample_sequential``'s greedy loop, per step: the Markov
   embedding of the previous token (``markov_w1``), the bias GEMM with
   ``markov_w2``, the add to the step's base logits, the float cast, the
   output multiplier (and soft cap where set), argmax, the draft-to-target
   id map (gather, add) and the copy into ``draft_tokens``.

Each part is a method whose tensors come in as arguments and whose results
(including tensors it writes in place) come back as a tuple, so a caller can
run, compare and time any part alone; ``StockStep.step`` runs them all in
order through ``run(part, *args)``, which a caller may replace to record
each part's operands.

``SpecKernels`` stands in for ``launch_stock`` on a CPU (a dry run): the
same signatures over dspark-core's spec, whose bits are those of the stock
kernels where no approximate instruction enters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_core.reference.model import StepInputs
from dspark_core.spec import layers as L

BF16, F32 = torch.bfloat16, torch.float32


@dataclass
class Head:
    """The draft's head as vLLM 0.33.0's Muse Spark DSpark runs it: the LM
    head ``[V_draft, H]``, ``markov_w1`` ``[V_target, r]`` (an
    ``nn.Embedding``), ``markov_w2`` ``[V_draft, r]``, the draft-to-target
    offsets ``d2t`` (int64 ``[V_draft]``: target id = draft id + d2t[id]),
    the output multiplier and soft-cap temperature (None: off)."""

    lm_head: torch.Tensor
    markov_w1: torch.Tensor
    markov_w2: torch.Tensor
    d2t: torch.Tensor
    output_multiplier: float = 1.0
    soft_cap: float | None = None

    @classmethod
    def random(cls, hidden: int, draft_vocab: int, target_vocab: int, rank: int, device, gen) -> Head:
        """Weights N(0, 1/fan_in) drawn on ``device``; d2t maps the draft
        vocabulary onto sorted distinct target ids."""
        if not 1 <= draft_vocab <= target_vocab:
            raise ValueError(f"a draft vocabulary of 1 to {target_vocab} ids, not {draft_vocab}")

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen, device=device) / cols ** 0.5).to(BF16)

        ids = torch.randperm(target_vocab, generator=gen, device=device)[:draft_vocab].sort().values
        return cls(weight(draft_vocab, hidden), weight(target_vocab, rank), weight(draft_vocab, rank),
                   ids - torch.arange(draft_vocab, device=device))


@dataclass
class StepBatch:
    """One draft step's operands: ``requests`` requests of ``n`` query
    tokens each after ``context`` cached tokens, request r's slots ``base_r +
    position`` (``base_r = r * slots_per_request``, whole blocks). The
    context rows stored this step are the last ``n + 1`` positions before the
    queries (the previous verify's tokens), the queries attend causally."""

    requests: int
    n: int
    context: int
    input_ids: torch.Tensor  # int32 [m]
    anchor_idx: torch.Tensor  # int64 [R]: the first query row of each request
    sample_indices: torch.Tensor  # int64 [m]
    step: StepInputs
    ctx_positions: torch.Tensor  # int64 [T]
    ctx_slots: torch.Tensor  # int64 [T]
    aux: torch.Tensor  # bf16 [T, aux width]
    num_blocks: int

    @property
    def rows(self) -> int:
        return self.requests * self.n

    @classmethod
    def make(cls, requests: int, n: int, context: int, block_size: int, aux_width: int, vocab: int,
             device, gen) -> StepBatch:
        if requests < 1 or n < 1 or context < n + 1:
            raise ValueError(f"a step of >= 1 request of >= 1 token after >= n + 1 cached ones, not "
                             f"{requests} x {n} after {context}")
        per = -(-(context + n) // block_size) * block_size
        r = torch.arange(requests, device=device)
        base = (r * per)[:, None]
        q_pos = context + torch.arange(n, device=device)[None, :].expand(requests, n)
        positions = q_pos.reshape(-1).clone()
        slots = (base + q_pos).reshape(-1)
        span = torch.arange(context + n, device=device)
        attn = (base[:, :, None] + span[None, None, :]).expand(requests, n, context + n).clone()
        attn[span[None, None, :].expand_as(attn) > q_pos[:, :, None]] = -1
        c_pos = (context - n - 1 + torch.arange(n + 1, device=device))[None, :].expand(requests, n + 1)
        return cls(
            requests, n, context,
            input_ids=torch.randint(0, vocab, (requests * n,), generator=gen, device=device).to(torch.int32),
            anchor_idx=r * n, sample_indices=torch.arange(requests * n, device=device),
            step=StepInputs(positions, slots, attn.reshape(requests * n, context + n)),
            ctx_positions=c_pos.reshape(-1).clone(), ctx_slots=(base + c_pos).reshape(-1),
            aux=torch.randn(requests * (n + 1), aux_width, generator=gen, device=device).to(BF16),
            num_blocks=requests * per // block_size + 1)


def cache_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)`` ``[blocks, block_size, kv_heads, D]``
    views of a logical ``[blocks, kv_heads, block_size, 2D]`` cache, as the
    attention backends hand them to ``reshape_and_cache_flash``."""
    d = cache.shape[-1] // 2
    return cache[..., :d].permute(0, 2, 1, 3), cache[..., d:].permute(0, 2, 1, 3)


class StockStep:
    """vLLM's draft step over ``model`` (a reference ``DraftModel``),
    ``head`` (``Head``) and the fc weight ``fc`` ``[H, aux]`` (both may be
    None for ``forward`` alone, the backbone: what a demo compares), on the stock
    kernels ``kernels`` (``launch_stock`` or ``SpecKernels``) and the
    caller's ``attention(q, cache, attn_slots)`` (q ``[m, heads, 64]``
    contiguous). ``pdl``: the stock norms and QK kernel launched with
    programmatic dependent launch, as vLLM does on sm_90+ (no value changes).
    Module docstring."""

    def __init__(self, model, head: Head, fc: torch.Tensor, kernels, attention, pdl: bool = True) -> None:
        c = model.config
        self.model, self.head, self.fc, self.S, self.attend, self.pdl = model, head, fc, kernels, attention, pdl
        self.config = c
        self.layers = list(model.layers)
        self.bounds = model.boundaries()
        # vLLM stacks the K/V rows once after loading (_build_fused_kv_buffers).
        self.stacked_kv = model.stacked_kv_weight().contiguous()
        self.table = model.rotary.cos_sin if model.rotary is not None else None
        self.context_table = model.rotary.context_table() if model.rotary is not None else None

    # -- the stock ops -------------------------------------------------------
    def norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        """``MuseSpark1xRMSNorm`` of BF16 rows: the Triton kernel, BF16 out."""
        return self.S.stock_rmsnorm(x, norm.weight, norm.eps, gain_center=norm.gain_center,
                                    input_scale=norm.weight_before_norm, out_dtype=BF16, pdl=self.pdl)

    @staticmethod
    def gated_residual(conn, stream: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """``MuseSpark1xNormPreservingResidualConnection.forward``: the branch
        cast to the stream's dtype, ``alpha * stream + beta * branch``."""
        return conn.alpha * stream + conn.beta * branch.to(stream.dtype)

    # -- the parts (module docstring) -----------------------------------------
    def combine(self, aux: torch.Tensor, hidden_buf: torch.Tensor) -> tuple:
        rows = aux.shape[0]
        hidden_buf[:rows].copy_(F.linear(aux, self.fc))
        return (hidden_buf[:rows],)

    def context(self, states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, caches: list) -> tuple:
        c, layers = self.config, len(self.layers)
        t = states.shape[0]
        h = self.norm(states, self.model.hidden_norm)
        normed = torch.stack([self.norm(h, layer.input_norm) for layer in self.layers], dim=0)
        kv = torch.bmm(normed, self.stacked_kv.transpose(1, 2))
        kv = kv.view(layers, t, 2, c.num_kv_heads, c.head_dim).permute(2, 0, 1, 3, 4).contiguous()
        k, v = kv[0], kv[1]
        eps = self.layers[0].self_attn.qk_norm.eps
        aten_k_norm = getattr(self.S, "aten_k_norm", None)
        if aten_k_norm is not None:
            # A CPU dry run (SpecKernels): these ATen ops on a CPU reduce in
            # another order than on CUDA, so the stand-in gives CUDA's.
            k = aten_k_norm(k, eps)
        else:
            kf = k.float()
            variance = kf.pow(2).mean(dim=-1, keepdim=True)
            k = (kf * torch.rsqrt(variance + eps)).to(k.dtype)
        flat = k.view(layers * t, c.num_kv_heads, c.head_dim)
        if self.context_table is not None:
            self.S.stock_rotary(positions.repeat(layers), flat, None, c.head_dim, self.context_table)
        k = flat.view(layers, t, c.num_kv_heads, c.head_dim)
        for i, cache in enumerate(caches):
            key_cache, value_cache = cache_views(cache)
            self.S.stock_reshape_and_cache_flash(k[i], v[i], key_cache, value_cache, slots)
        return tuple(caches)

    def embed(self, input_ids: torch.Tensor) -> tuple:
        return (F.embedding(input_ids.long(), self.model.embed).to(self.model.residual_dtype),)

    def input_norm(self, stream: torch.Tensor) -> tuple:
        first = self.layers[0].input_norm if self.layers else self.model.norm
        return (self.norm(stream.to(BF16), first),)

    def qkv_gemm(self, i: int, x: torch.Tensor) -> tuple:
        return (F.linear(x, self.layers[i].self_attn.qkv_proj),)

    def qk_front(self, i: int, qkv: torch.Tensor, positions, slots, cache: torch.Tensor) -> tuple:
        c = self.config
        eps = self.layers[i].self_attn.qk_norm.eps
        self.S.stock_qknorm_rope_kv_insert(qkv, positions, c.num_heads, c.num_kv_heads, c.head_dim, eps,
                                           self.table, c.head_dim if self.table is not None else 0, slots,
                                           cache, c.kv_block_size, pdl=self.pdl)
        return qkv, cache

    def attention(self, qkv: torch.Tensor, cache: torch.Tensor, attn_slots: torch.Tensor) -> tuple:
        c = self.config
        q = qkv[:, :c.q_size].reshape(qkv.shape[0], c.num_heads, c.head_dim)
        return (self.attend(q.contiguous(), cache, attn_slots),)

    def o_gate(self, i: int, attn: torch.Tensor, qkv: torch.Tensor) -> tuple:
        c = self.config
        og = self.o_gate_view(qkv)
        out = self.S.stock_o_gate(attn, og, self.layers[i].self_attn.o_norm.eps)
        return (out.reshape(out.shape[0], c.q_size),)

    def o_gate_view(self, qkv: torch.Tensor) -> torch.Tensor:
        """The o-gate rows of the projection, ``[m, heads, D]`` (a strided view)."""
        c = self.config
        start = c.q_size + 2 * c.kv_size
        return qkv[:, start:start + c.q_size].view(qkv.shape[0], c.num_heads, c.head_dim)

    def o_proj(self, i: int, gated: torch.Tensor) -> tuple:
        return (F.linear(gated, self.layers[i].self_attn.o_proj),)

    def boundary(self, j: int, branch: torch.Tensor, stream: torch.Tensor) -> tuple:
        """Boundary ``j`` (layer j // 2's attention boundary for even j, its
        feed-forward one for odd j): ``(new_stream, out)``."""
        post, conn, pre = self.bounds[j]
        new = self.gated_residual(conn, stream, self.norm(branch, post))
        return new, self.norm(new.to(BF16), pre)

    def gate_up(self, i: int, x: torch.Tensor) -> tuple:
        return (F.linear(x, self.layers[i].mlp.gate_up),)

    def activation(self, i: int, gu: torch.Tensor) -> tuple:
        return (self.S.stock_silu_and_mul(gu),)

    def down(self, i: int, h: torch.Tensor) -> tuple:
        return (F.linear(h, self.layers[i].mlp.down),)

    def lm_head(self, hidden: torch.Tensor, sample_indices: torch.Tensor) -> tuple:
        return (F.linear(hidden[sample_indices], self.head.lm_head),)

    def markov(self, logits: torch.Tensor, input_ids: torch.Tensor, anchor_idx: torch.Tensor, n: int,
               draft_tokens: torch.Tensor) -> tuple:
        head = self.head
        base = logits.view(anchor_idx.shape[0], n, logits.shape[-1])
        prev = input_ids[anchor_idx]
        for i in range(n):
            bias = F.linear(F.embedding(prev, head.markov_w1), head.markov_w2)
            step_logits = (base[:, i] + bias).float() * head.output_multiplier
            if head.soft_cap is not None:
                step_logits = head.soft_cap * torch.tanh(step_logits / head.soft_cap)
            ids = step_logits.argmax(dim=-1)
            mapped = ids + head.d2t[ids]
            draft_tokens[:, i] = mapped
            prev = mapped
        return (draft_tokens,)

    # -- the whole step --------------------------------------------------------
    @staticmethod
    def run(part: str, fn, *args) -> tuple:
        """One part's call (``step`` calls every part through it; replace it
        to record the operands)."""
        return fn(*args)

    def backbone(self, stream: torch.Tensor, st: StepInputs, caches: list, run=None) -> torch.Tensor:
        """The layers and the final norm over the residual ``stream`` (step 4
        of the module docstring): BF16 ``[m, H]``."""
        run = run or self.run
        (x,) = run("input norm (layer 0)", self.input_norm, stream)
        last = len(self.layers) - 1
        for i in range(len(self.layers)):
            (qkv,) = run(f"L{i} QKV GEMM", self.qkv_gemm, i, x)
            run(f"L{i} QK-norm/RoPE/insert", self.qk_front, i, qkv, st.positions, st.slots, caches[i])
            (attn,) = run(f"L{i} attention", self.attention, qkv, caches[i], st.attn_slots)
            (gated,) = run(f"L{i} o-norm/gate", self.o_gate, i, attn, qkv)
            (attn_out,) = run(f"L{i} o_proj", self.o_proj, i, gated)
            stream, ffn_in = run(f"L{i} attention boundary", self.boundary, 2 * i, attn_out, stream)
            (gu,) = run(f"L{i} gate_up", self.gate_up, i, ffn_in)
            (h,) = run(f"L{i} activation", self.activation, i, gu)
            (ffn_out,) = run(f"L{i} down", self.down, i, h)
            into = "final norm" if i == last else f"L{i + 1} input norm"
            stream, x = run(f"L{i} FFN boundary + {into}", self.boundary, 2 * i + 1, ffn_out, stream)
        return x

    def forward(self, hidden_states: torch.Tensor, step: StepInputs, caches: list) -> torch.Tensor:
        """``DraftModel.forward``'s call on the stock ops: the embeddings cast
        to the residual dtype (``MuseSparkDSparkModel.forward``), then
        ``backbone``; ``caches`` the layers' ``PagedKVCache`` or tensors."""
        stream = hidden_states.to(self.model.residual_dtype)
        return self.backbone(stream, step, [getattr(c, "tensor", c) for c in caches])

    def step(self, batch: StepBatch, caches: list, hidden_buf: torch.Tensor, draft_tokens: torch.Tensor,
             run=None) -> tuple:
        """The whole step (module docstring) into ``caches`` (the layers'
        cache tensors) and ``draft_tokens`` (int64 ``[R, N]``):
        ``(backbone output, base logits, draft_tokens)``. ``run(part_name,
        fn, *args)`` (default ``StockStep.run``) makes every part's call."""
        run = run or self.run
        st = batch.step
        (states,) = run("combine (fc)", self.combine, batch.aux, hidden_buf)
        run("context K/V store", self.context, states, batch.ctx_positions, batch.ctx_slots, caches)
        (stream,) = run("embed", self.embed, batch.input_ids)
        x = self.backbone(stream, st, caches, run)
        (logits,) = run("LM head", self.lm_head, x, batch.sample_indices)
        run("Markov loop (N steps)", self.markov, logits, batch.input_ids, batch.anchor_idx, batch.n, draft_tokens)
        return x, logits, draft_tokens


class SpecKernels:
    """``launch_stock``'s functions over dspark-core's spec, for a CPU dry
    run of the step's plumbing (``rotary``: the draft's ``Rotary``)."""

    def __init__(self, rotary) -> None:
        self.rotary = rotary

    @staticmethod
    def stock_rmsnorm(x, w, eps, gain_center=0.0, input_scale=False, out_dtype=None, pdl=False):
        norm = L.RMSNorm(x.shape[-1], eps, has_weight=w is not None, weight_dtype=w.dtype if w is not None else BF16,
                         gain_center=gain_center, weight_before_norm=input_scale, out_dtype=out_dtype or x.dtype,
                         arch="sm_90a")
        if w is not None:
            norm.weight.data = w
        return norm(x)

    @staticmethod
    def stock_o_gate(attn, og, eps):
        return L.o_gate(attn, og, L.HeadNorm(attn.shape[-1], eps), "sm_90a")

    @staticmethod
    def stock_silu_and_mul(x):
        return L.silu_and_mul(x, x.shape[-1] // 2)

    @staticmethod
    def aten_k_norm(k, eps):
        """The context chain's K-norm as CUDA ATen computes it (``spec.layers.k_norm_context``:
        ``kf.pow(2).mean(-1)`` and ``torch.rsqrt`` on a CPU differ from it in rare elements)."""
        d = k.shape[-1]
        return L.k_norm_context(k.reshape(-1, k.shape[-2], d), L.HeadNorm(d, eps)).view_as(k)

    def stock_rotary(self, positions, query, key, head_size, table):
        q = query.view(positions.shape[0], -1, head_size)
        q.copy_(self.rotary(q, positions, table))

    def stock_qknorm_rope_kv_insert(self, qkv, positions, nh, nkv, d, eps, table, rotary_dim, slots, cache,
                                    block_size, pdl=False):
        m = qkv.shape[0]
        norm = L.HeadNorm(d, eps)
        rot = self.rotary if table is not None else None
        q = qkv[:, :nh * d].view(m, nh, d)
        k = qkv[:, nh * d:(nh + nkv) * d].view(m, nkv, d)
        v = qkv[:, (nh + nkv) * d:(nh + 2 * nkv) * d].view(m, nkv, d)
        q.copy_(L.qk_norm_rope(q, norm, positions, rot))
        k.copy_(L.qk_norm_rope(k, norm, positions, rot))
        L.kv_insert(cache, k, v, slots)

    @staticmethod
    def stock_reshape_and_cache_flash(key, value, key_cache, value_cache, slots):
        keep = slots >= 0
        bs = key_cache.shape[1]
        blocks, pages = slots[keep] // bs, slots[keep] % bs
        key_cache[blocks, pages] = key[keep]
        value_cache[blocks, pages] = value[keep]


__all__ = ["Head", "SpecKernels", "StepBatch", "StockStep", "cache_views"]
