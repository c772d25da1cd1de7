"""Builds vLLM 0.33.0's real MuseSparkDSparkForCausalLM on a CPU, from a
small checkpoint written here (config.json and random safetensors; no hub),
at TP1 over gloo, through vLLM's own ``load_dspark_model``.

The checkpoint: a Llama target (config only: 4 layers, hidden 2048) and a
Muse Spark DSpark draft of 2 layers, hidden 2048 (the fused norms' row
width), 8 query heads and 4 KV heads of 64, MLP 1024, vocab 512 with a
reduced draft vocab of 384 (so d2t), zero-centred gains, post-norm gain
centres by residual index, the input-scale post-FFN norm, the gated FP32
residual, QK-norm, o-norm and o-gate, GPT-J RoPE with an FP32 table, metap
and a soft cap. ``draft_config(**changes)`` varies it.

CPU patches (``apply_cpu_patches``, once per process; each stands in for a
GPU kernel the CUDA wheel has no CPU path for):

1. ``MuseSpark1xRMSNorm.forward`` -> ``forward_native`` for CPU tensors
   (``forward`` always takes the Triton ``fused_rmsnorm_fwd``);
2. ``RotaryEmbedding.forward_cuda`` / ``forward_cpu`` -> an FP32 torch
   GPT-J/NeoX rotation with the cache cast to the query's dtype (the
   ``vllm._C`` rotary op is absent);
3. ``nvidia.model.rms_norm_gated`` -> torch (FLA's Triton o-norm + gate);
4. ``nvidia.model.supports_qk_norm`` -> False (the CuTe DSL QK-norm kernel);
5. ``nvidia.model.supports_fused_kv_insert`` -> vLLM's own condition with
   FlashAttention's two backend flags (no KV write in forward, the bypass
   supported), so the layers take the fused QK-norm/RoPE/insert path a GPU
   deployment takes; and ``_custom_ops.fused_muse_spark_qknorm_rope_kv_insert``
   -> a torch stand-in (QK-norm, RoPE in FP32, one BF16 rounding, the
   insert);
6. ``CPUAttentionBackend.get_impl_cls`` -> ``RefAttnImpl``, a reference
   attention over vLLM's cache layout (CPU_ATTN needs ``vllm._C`` CPU ops).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from vllm.v1.attention.backend import AttentionImpl

from dspark_vllm.plan import _free_port

VOCAB, DRAFT_VOCAB, HIDDEN, TARGET_LAYERS = 512, 384, 2048, 4
N_LAYERS, N_HEADS, N_KV, HEAD_DIM, INTER = 2, 8, 4, 64, 1024
MARKOV_RANK, TARGET_LAYER_IDS, N_SPEC, BLOCK = 32, [0, 2], 4, 16
MASK_ID = VOCAB - 1


def draft_config(**changes) -> dict:
    config = {
        "model_type": "muse_spark_dspark", "architectures": ["MuseSparkDSparkModel"], "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV, "head_dim": HEAD_DIM,
        "ffn_dim_multiplier": INTER / HIDDEN, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rms_post_norm_eps": 1e-6, "norm_affine": True, "post_norm_affine": True, "norm_zero_centered_gamma": True,
        "post_norm_gain_center_type": "inverse_residual_index_v2", "output_norm_gain_center_type": "zero",
        "use_ffn_learnable_scales": True, "use_residual_gate": True, "use_qk_norm": True, "use_attn_o_gate": True,
        "use_attn_o_norm": True, "residual_dtype": "fp32", "use_rope": True, "rope_theta": 500000.0,
        "rope_use_fp32_in_outer_product": True,
        # MoEArgs.is_enabled defaults to True, which would make every draft layer MoE.
        "moe": {"is_enabled": False},
        "metap": {"use_metap": True, "metap_mode": "mup", "base_width": 128}, "output_soft_cap_temp": 30.0,
        # Read by attribute only (not declared by the config class).
        "target_layer_ids": TARGET_LAYER_IDS, "target_hidden_size": HIDDEN, "mask_token_id": MASK_ID,
        "markov_rank": MARKOV_RANK, "enable_confidence_head": False, "block_size": N_SPEC,
    }
    config.update(changes)
    return config


def target_config() -> dict:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": 1024, "num_hidden_layers": TARGET_LAYERS,
        "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV, "head_dim": HEAD_DIM,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1,
    }


def draft_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor ``load_weights`` needs, by its HF name."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    def gain(n):  # zero-centred: offsets around the gain centre
        return (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)

    q, kv = N_HEADS * HEAD_DIM, N_KV * HEAD_DIM
    w = {
        "fc.weight": rnd(HIDDEN, HIDDEN * len(TARGET_LAYER_IDS)), "hidden_norm.weight": gain(HIDDEN),
        "norm.weight": gain(HIDDEN), "markov_head.markov_w1.weight": rnd(VOCAB, MARKOV_RANK),
        "markov_head.markov_w2.weight": rnd(DRAFT_VOCAB, MARKOV_RANK), "lm_head.weight": rnd(DRAFT_VOCAB, HIDDEN),
        "d2t": torch.arange(DRAFT_VOCAB) * (VOCAB - 1) // (DRAFT_VOCAB - 1) - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool),
    }
    for i in range(N_LAYERS):
        p = f"layers.{i}"
        w |= {
            f"{p}.self_attn.q_proj.weight": rnd(q, HIDDEN), f"{p}.self_attn.k_proj.weight": rnd(kv, HIDDEN),
            f"{p}.self_attn.v_proj.weight": rnd(kv, HIDDEN), f"{p}.self_attn.o_gate_proj.weight": rnd(q, HIDDEN),
            f"{p}.self_attn.o_proj.weight": rnd(HIDDEN, q), f"{p}.self_attn.pre_qkv_proj_norm.weight": gain(HIDDEN),
            f"{p}.feed_forward.gate_proj.weight": rnd(INTER, HIDDEN),
            f"{p}.feed_forward.up_proj.weight": rnd(INTER, HIDDEN),
            f"{p}.feed_forward.down_proj.weight": rnd(HIDDEN, INTER), f"{p}.pre_ffn_norm.weight": gain(HIDDEN),
            f"{p}.post_attn_norm.weight": gain(HIDDEN), f"{p}.post_ffn_norm.weight": gain(HIDDEN),
            f"{p}.add_attn.gate": (torch.randn(HIDDEN, generator=gen) * 0.5).to(torch.bfloat16),
            f"{p}.add_ffn.gate": (torch.randn(HIDDEN, generator=gen) * 0.5).to(torch.bfloat16),
        }
    return w


def write_checkpoint(root: Path, **changes) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """``(target_dir, draft_dir, weights)`` under ``root``; ``changes`` go into the draft's config.json."""
    from safetensors.torch import save_file

    target, draft = root / "target", root / "draft"
    target.mkdir(parents=True, exist_ok=True)
    draft.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(target_config(), indent=1))
    (draft / "config.json").write_text(json.dumps(draft_config(**changes), indent=1))
    weights = draft_weights()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(draft / "model.safetensors"))
    return target, draft, weights


def vllm_config(target: Path, draft: Path, decode_backend: str | None = "auto", **compilation):
    """A real VllmConfig of DSpark speculative decoding on the CPU (eager)."""
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model = ModelConfig(model=str(target), tokenizer=str(target), skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="dspark", model=str(draft), num_speculative_tokens=N_SPEC,
                             target_model_config=model, target_parallel_config=parallel)
    extra = {} if decode_backend is None else {"decode_backend": decode_backend}
    return VllmConfig(model_config=model, speculative_config=spec, parallel_config=parallel,
                      device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(block_size=BLOCK),
                      load_config=LoadConfig(),
                      scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                                                       is_encoder_decoder=False),
                      compilation_config=CompilationConfig(**compilation), additional_config=extra)


def init_dist(config) -> None:
    """TP1 over gloo, once per process."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)


class FakeTarget(torch.nn.Module):
    """What load_dspark_model reads of the target: ``model.embed_tokens`` (shared into the draft) and ``lm_head``."""

    def __init__(self):
        super().__init__()
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        self.model = torch.nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            self.model.embed_tokens.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.02)


@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    target: FakeTarget
    config: object
    weights: dict


def build(target: Path, draft: Path, weights: dict, decode_backend: str | None = "auto", **compilation) -> Built:
    """vLLM's own load_dspark_model over the checkpoint (registry, loader, load_weights, post-load hooks)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    apply_cpu_patches()
    config = vllm_config(target, draft, decode_backend, **compilation)
    init_dist(config)
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        fake = FakeTarget()
    with set_current_vllm_config(config):
        model = load_dspark_model(fake, config)
    return Built(model, fake, config, weights)


# ----------------------------------------------------------------- CPU patches
def _rope(self, positions, query, key=None):
    """RotaryEmbedding as the CUDA op computes it (read): the cache cast to the query's dtype and kept so, the
    rotation in FP32, one rounding."""
    cache = self._match_cos_sin_cache_dtype(query)
    cos, sin = cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rot(x):
        shape = x.shape
        x = x.view(positions.numel(), -1, self.head_size)
        r = x[..., : self.rotary_dim].float()
        if self.is_neox_style:
            a, b = r.chunk(2, dim=-1)
            o = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        else:
            a, b = r[..., 0::2], r[..., 1::2]
            o = torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
        return torch.cat((o.to(x.dtype), x[..., self.rotary_dim:]), -1).reshape(shape)

    return rot(query), (None if key is None else rot(key))


def _rms_norm_gated(x, g, weight, bias, activation="swish", eps=1e-6, **kw):
    """FLA's layer_norm_gated (RMS, no weight, sigmoid gate) in torch."""
    if weight is not None or bias is not None or activation != "sigmoid":
        raise NotImplementedError("the CPU o-gate stand-in takes the draft's weightless sigmoid gate only")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * torch.sigmoid(g.float())).to(x.dtype)


def insert_rows(kv_cache, k, v, slots) -> None:
    """Write K and V rows into vLLM's per-layer cache ``[blocks, kv_heads, block, 2D]`` at ``slots`` (-1 skips)."""
    n = slots.shape[0]
    keep = slots >= 0
    s = slots[keep].long()
    d = k.shape[-1]
    bs = kv_cache.shape[2]
    kv_cache[s // bs, :, s % bs, :d] = k[:n][keep].to(kv_cache.dtype)
    kv_cache[s // bs, :, s % bs, d:] = v[:n][keep].to(kv_cache.dtype)


def fused_qknorm_rope_insert(qkv, positions, num_heads, num_kv_heads, head_dim, eps, cos_sin_cache=None,
                             rotary_dim=0, slot_mapping=None, kv_cache=None, block_size=0, kv_cache_dtype="auto",
                             k_scale=None, v_scale=None, q_fp8_out=None, q_scale=None):
    """``fused_muse_spark_qknorm_rope_kv_insert`` in torch, in place on ``qkv``: weightless QK RMSNorm and GPT-J
    RoPE in FP32 with one BF16 rounding, K and V written at the slots."""
    if q_fp8_out is not None or kv_cache_dtype not in ("auto", "bfloat16"):
        raise NotImplementedError("the CPU stand-in takes a BF16 cache and BF16 q only")
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    for start, heads in ((0, num_heads), (q_size, num_kv_heads)):
        x = qkv[:, start:start + heads * head_dim].float().view(t, heads, head_dim)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if cos_sin_cache is not None:
            cos, sin = cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)
            cos, sin = cos[:, None, :], sin[:, None, :]
            a, b = x[..., 0::2], x[..., 1::2]
            x = torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
        qkv[:, start:start + heads * head_dim] = x.reshape(t, heads * head_dim).to(qkv.dtype)
    if kv_cache is not None and slot_mapping is not None:
        k = qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:q_size + 2 * kv_size].view(t, num_kv_heads, head_dim)
        insert_rows(kv_cache, k, v, slot_mapping)


class RefAttnImpl(AttentionImpl):
    """A reference attention impl over FlashAttention's per-layer cache
    ``[blocks, kv_heads, block, 2D]`` (K then V), causal, FP32 softmax, with
    the test's metadata ``{"query_start_loc", "seq_lens", "block_table"}``."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", *args, **kwargs):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        self.attn_type = "decoder"

    def process_weights_after_loading(self, act_dtype):
        pass

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        insert_rows(kv_cache, key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # the profiling run: backends return zeros
            return output.zero_()
        d, md = self.head_size, attn_metadata
        rep = self.num_heads // self.num_kv_heads
        bs = kv_cache.shape[2]
        for r in range(len(md["seq_lens"])):
            q0, q1, n = md["query_start_loc"][r], md["query_start_loc"][r + 1], md["seq_lens"][r]
            pos = torch.arange(n)
            kv = kv_cache[md["block_table"][r][pos // bs], :, pos % bs, :]
            k = kv[..., :d].float().repeat_interleave(rep, dim=1)
            v = kv[..., d:].float().repeat_interleave(rep, dim=1)
            qpos = torch.arange(n - (q1 - q0), n)
            s = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * self.scale
            s = s.masked_fill(~(pos[None, :] <= qpos[:, None])[None], float("-inf"))
            output[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(output.dtype)
        return output


_PATCHED: list[str] = []


def apply_cpu_patches() -> list[str]:
    """The module docstring's patches, once per process; their descriptions."""
    if _PATCHED:
        return _PATCHED
    import vllm._custom_ops as ops
    import vllm.models.muse_spark.nvidia.model as muse_nv
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.models.muse_spark.common.layers import MuseSpark1xRMSNorm
    from vllm.models.muse_spark.common.ops.fused_qk_norm_rope_kv import SUPPORTED_KV_CACHE_DTYPES
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    native = MuseSpark1xRMSNorm.forward

    def rms_forward(self, x, residual=None, out_dtype=None):
        return native(self, x, residual, out_dtype) if x.is_cuda else self.forward_native(x, residual, out_dtype)

    MuseSpark1xRMSNorm.forward = rms_forward
    RotaryEmbedding.forward_cuda = _rope
    RotaryEmbedding.forward_cpu = _rope
    muse_nv.rms_norm_gated = _rms_norm_gated
    muse_nv.supports_qk_norm = lambda dtype, head_dim: False
    muse_nv.supports_fused_kv_insert = lambda attn: (attn.kv_sharing_target_layer_name is None
                                                     and attn.kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES)
    ops.fused_muse_spark_qknorm_rope_kv_insert = fused_qknorm_rope_insert
    CPUAttentionBackend.get_impl_cls = staticmethod(lambda: RefAttnImpl)
    _PATCHED.extend([
        "MuseSpark1xRMSNorm.forward -> forward_native on CPU tensors (Triton fused_rmsnorm_fwd)",
        "RotaryEmbedding.forward_cuda/forward_cpu -> FP32 torch rotation (the vllm._C rotary op)",
        "nvidia.model.rms_norm_gated -> torch (FLA's Triton o-norm + gate)",
        "nvidia.model.supports_qk_norm -> False (the CuTe DSL QK-norm kernel)",
        "nvidia.model.supports_fused_kv_insert -> FlashAttention's flags; _custom_ops.fused_muse_spark_qknorm_rope_"
        "kv_insert -> torch (the vllm._C op)",
        "CPUAttentionBackend.get_impl_cls -> RefAttnImpl (CPU_ATTN needs vllm._C CPU ops)",
    ])
    return _PATCHED


# ----------------------------------------------------------------- steps
def kv_caches(model, config, num_blocks: int = 4, layout: str = "LBNHC", offset: int = 0):
    """Zeroed per-layer caches in vLLM's ``layout`` (default LBNHC, its default on sm_90; one int8 allocation
    viewed by create_kv_cache_views with the layer and block strides of that layout, the views ``offset`` bytes
    in), bound to the draft's attention layers as vLLM's bind_kv_cache does."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    attns = [layer.self_attn.attn for layer in model.model.layers]
    names = model.get_draft_kv_cache_layer_names()
    spec = attns[0].get_kv_cache_spec(config)
    order = KVCacheLayout[layout]
    layer_stride, block_stride = compute_layout_strides(spec, num_blocks, len(attns), order)[:2]
    raw = torch.zeros(spec.page_size_bytes * num_blocks * len(attns) + offset, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=names, layer_stride=layer_stride, block_stride=block_stride,
                           offset=offset)
    caches = create_kv_cache_views(raw, spec, num_blocks, order, tensor)
    for attn, kv in zip(attns, caches):
        attn.bind_kv_cache(kv)
    return caches


BLOCK_TABLE = torch.tensor([[1, 2, 3]])  # block 0 is the null block


def slot(p: int) -> int:
    return int(BLOCK_TABLE[0][p // BLOCK]) * BLOCK + p % BLOCK


def context_states(model, n: int, seed: int = 2) -> torch.Tensor:
    """The draft's context states of ``n`` tokens from random target aux hidden states (combine_hidden_states)."""
    g = torch.Generator().manual_seed(seed)
    return model.combine_hidden_states(torch.randn(n, HIDDEN * len(TARGET_LAYER_IDS), generator=g))


def step(model, config, ids: torch.Tensor, start: int):
    """A forward context for one query block of ``len(ids)`` tokens at positions ``start..``, one request."""
    from vllm.forward_context import set_forward_context

    m = ids.shape[0]
    names = model.get_draft_kv_cache_layer_names()
    slots = torch.tensor([slot(p) for p in range(start, start + m)])
    md = {"query_start_loc": [0, m], "seq_lens": [start + m], "block_table": BLOCK_TABLE}
    return set_forward_context({n: md for n in names}, config, num_tokens=m, slot_mapping={n: slots for n in names})


def query_ids(m: int, anchor: int = 42) -> torch.Tensor:
    return torch.tensor([anchor] + [MASK_ID] * (m - 1))


def context_slots(n: int) -> torch.Tensor:
    return torch.tensor([slot(p) for p in range(n)])


def run_block(model, config, ctx: int, m: int, seed: int = 2):
    """Fresh caches, the context K/V of ``ctx`` tokens, then one query block of ``m`` tokens: ``(hidden, caches)``."""
    caches = kv_caches(model, config)
    with torch.inference_mode():
        states = context_states(model, ctx, seed)
        model.precompute_and_store_context_kv(states, torch.arange(ctx), context_slots(ctx))
        with step(model, config, query_ids(m), ctx):
            hidden = model(input_ids=query_ids(m), positions=torch.arange(ctx, ctx + m), inputs_embeds=None)
    return hidden, [c.clone() for c in caches]


def checkpoint_dir(tmp_path_factory, name: str, **changes):
    root = tmp_path_factory.mktemp(name)
    return write_checkpoint(Path(root), **changes)


__all__ = ["Built", "apply_cpu_patches", "build", "checkpoint_dir", "draft_config", "kv_caches", "run_block",
           "step", "write_checkpoint"]
