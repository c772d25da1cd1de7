"""vLLM's adapter: ``describe_vllm(model)`` is the model-neutral
``DraftDescription`` of vLLM 0.33.0's ``MuseSparkDSparkModel`` (the draft
backbone inside ``MuseSparkDSparkForCausalLM``), over its own modules and
tensors; the sibling of ``dspark_core.reference.adapter``.

A step is what the model's forward takes after its hidden states,
``(positions,)``: each layer reads its KV cache (``attn.kv_cache``, which vLLM
rebinds between the memory profile and the real run) and its slot mapping
from vLLM's forward context when called. The context chain's calls take
``(slots,)``, what ``precompute_and_store_context_kv`` takes after its
states and positions.

The stock calls run vLLM's modules and functions, split where the executor
splits the layer: the QKV projection; QK-norm, RoPE and the KV insert
(``_qk_norm_rope_kv_insert``, then vLLM's insert op where the layer does not
insert in it); attention through the layer's ``Attention`` with the cache
already written; the o-norm and gate on the function vLLM's forward picks;
the output projection's GEMM (the all-reduce is the executor's). Each
refusal is a sentence. Attention always stays stock: vLLM's backend
(FlashAttention) runs it and no DSpark kernel reproduces it.
"""

from __future__ import annotations

import torch
import vllm.models.muse_spark.nvidia.model as muse_nv
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.forward_context import get_forward_context
from vllm.lora.layers.base import BaseLayerWithLoRA
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention.attention import Attention as VllmAttention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.fusion.fused_act_quant import maybe_fused_act_quant
from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.models.llama import LlamaMLP
from vllm.models.muse_spark.common.dspark import MuseSparkDSparkDecoderLayer, MuseSparkDSparkModel
from vllm.models.muse_spark.common.layers import (
    MuseSpark1xNormPreservingResidualConnection,
    MuseSpark1xResidualConnection,
    MuseSpark1xRMSNorm,
    MuseSpark1xRMSNormWithInputScale,
)

from dspark_core.runtime import description as D
from dspark_core.switches import env_flag
from dspark_vllm.deployment import layout_unsupported

STOCK_NORMS = (MuseSpark1xRMSNorm, MuseSpark1xRMSNormWithInputScale)
# KV cache dtypes whose cache holds the model's BF16 K/V as they are.
BF16_CACHE_DTYPES = ("auto", "bfloat16")


def _overridden(obj, base: type, *names: str) -> list[str]:
    return [n for n in names if getattr(type(obj), n, None) is not getattr(base, n, None)]


def norm_unsupported(norm, hidden_size: int) -> str | None:
    """Why the fused norms do not take ``norm`` as vLLM's stock one, or None:
    one of the two stock classes (the weight after or before the norm), its
    variance over all ``hidden_size`` columns."""
    if type(norm) not in STOCK_NORMS:
        changed = _overridden(norm, MuseSpark1xRMSNorm, "forward", "forward_native", "supports_fused_kernel")
        how = f", overriding {', '.join(changed)}" if changed else ""
        return f"a norm other than vLLM's stock MuseSpark1xRMSNorm ({type(norm).__name__}{how})"
    if norm.variance_size_override is not None:
        return (f"a norm whose variance runs over {norm.variance_size_override} of its {norm.hidden_size} columns "
                "(variance_size_override)")
    if norm.hidden_size != hidden_size:
        return f"a norm over {norm.hidden_size} columns, not the rows' {hidden_size}"
    return None


def norm_description(name: str, norm, hidden_size: int, dtype: torch.dtype) -> D.Norm:
    """One of vLLM's norms: its weight, eps and the gain center its fused
    Triton kernel adds (``fused_gain_center``)."""
    return D.Norm(
        name=name,
        stock=lambda x, out_dtype=None: norm(x, out_dtype=out_dtype),
        hidden_size=int(getattr(norm, "hidden_size", hidden_size)),
        eps=float(getattr(norm, "variance_epsilon", 0.0)),
        weight=norm.weight if getattr(norm, "has_weight", False) else None,
        gain_center=float(getattr(norm, "fused_gain_center", 0.0)),
        weight_before_norm=bool(getattr(norm, "applies_weight_before_norm", False)),
        out_dtype=dtype,
        unsupported=norm_unsupported(norm, hidden_size),
    )


def _connection(name: str, conn, residual_dtype: torch.dtype) -> D.Connection:
    unsupported = None
    if type(conn) is MuseSpark1xResidualConnection:
        unsupported = "a plain residual sum (use_residual_gate false), not the gated connection the boundary takes"
    elif type(conn) is not MuseSpark1xNormPreservingResidualConnection:
        unsupported = f"a residual connection other than vLLM's norm-preserving one ({type(conn).__name__})"
    elif not getattr(conn, "_coefficients_ready", False):
        unsupported = "residual coefficients not materialized (the weights are not loaded)"
    ready = unsupported is None
    return D.Connection(
        name,
        # The model's stream is residual_dtype (FP32); the executor's first one is the BF16 embedding.
        lambda stream, branch: conn(stream=stream.to(residual_dtype), branch=branch),
        conn.alpha if ready and isinstance(conn.alpha, torch.Tensor) else None,
        conn.beta if ready else None,
        unsupported,
    )


def _gemm_backend(layer) -> str | None:
    """Why vLLM runs a projection of decoder ``layer`` on another GEMM than
    this platform's default (``UnquantizedLinearMethod`` picks its GEMM when
    made: ``--linear-backend`` can pick FlashInfer's mm_bf16 on CUDA, where
    the default is the ``F.linear`` the ordered GEMM is checked and timed
    against), or None."""
    from vllm.model_executor.layers.utils import default_unquantized_gemm, dispatch_unquantized_gemm

    auto = dispatch_unquantized_gemm()
    for linear in (getattr(layer.self_attn, "qkv_proj", None), getattr(layer.self_attn, "o_proj", None),
                   getattr(layer.feed_forward, "gate_up_proj", None), getattr(layer.feed_forward, "down_proj", None)):
        gemm = getattr(getattr(linear, "quant_method", None), "_gemm_impl", auto)
        if gemm is not auto and gemm is not default_unquantized_gemm:
            return (f"vLLM runs the layer's projections on {getattr(gemm, '__name__', type(gemm).__name__)} "
                    "(--linear-backend), not the F.linear the ordered GEMM is checked and timed against")
    return None


def _plain_linear(linear) -> str | None:
    if isinstance(linear, BaseLayerWithLoRA):
        return f"a LoRA-wrapped projection ({type(linear).__name__})"
    if not isinstance(getattr(linear, "quant_method", None), UnquantizedLinearMethod):
        return f"a quantized projection ({type(getattr(linear, 'quant_method', None)).__name__})"
    if getattr(linear, "bias", None) is not None:
        return "a projection with a bias"
    if linear.weight.dtype != torch.bfloat16:
        return f"a projection weight of {linear.weight.dtype}, not bfloat16"
    return None


def plain_row_parallel(linear, tp: int, width: int) -> str | None:
    """Why ``linear`` is not vLLM's stock RowParallelLinear over a BF16 GEMM
    without bias into ``width`` features, all-reduced over the TP group; None
    where it is."""
    if type(linear) is not RowParallelLinear or _overridden(linear, RowParallelLinear, "forward"):
        return f"an output projection other than vLLM's RowParallelLinear ({type(linear).__name__})"
    why = _plain_linear(linear)
    if why:
        return why
    if not (linear.input_is_parallel and linear.reduce_results and linear.tp_size == tp
            and linear.output_size == width):
        return "a row-parallel projection that is not all-reduced over the TP group into every feature"
    return None


def partial(linear, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection's GEMM before its all-reduce (what its forward runs first)."""
    return linear.quant_method.apply(linear, x, None)


def rope_unsupported(rope) -> str | None:
    """Why the kernels' GPT-J RoPE over the whole head is not this
    RotaryEmbedding's, or None (``_stock_rope``'s question)."""
    if type(rope) is not RotaryEmbedding:
        return f"a RoPE other than vLLM's RotaryEmbedding ({type(rope).__name__})"
    if rope.is_neox_style:
        return "NeoX RoPE (rotate-half pairs); the kernels rotate GPT-J pairs"
    if rope.rotary_dim != rope.head_size:
        return f"a partial RoPE over {rope.rotary_dim} of {rope.head_size} columns"
    forward = getattr(rope, "_forward_method", None)
    if getattr(forward, "__func__", None) is not RotaryEmbedding.forward_cuda:
        return "vLLM dispatches this RoPE to another forward than its CUDA op (custom op disabled)"
    return None


def _rope(rope) -> D.Rope | None:
    if rope is None:
        return None
    return D.Rope(rope.cos_sin_cache, int(rope.head_size), rope_unsupported(rope))


def _structure_unsupported(model, layers) -> str | None:
    """Why the executor's split of a layer is not vLLM's layer, or None."""
    if type(model) is not MuseSparkDSparkModel:
        return f"a draft backbone other than vLLM's MuseSparkDSparkModel ({type(model).__name__})"
    if not getattr(model, "do_not_compile", False):
        return ("the draft is torch.compiled (compilation mode other than NONE): the kernels reproduce its eager "
                "layers, not Inductor's code")
    if not hasattr(model, "_stacked_kv_weight"):
        return "the draft's context K/V buffers are not built (its weights are not loaded)"
    lora = [name for name, m in model.named_modules() if isinstance(m, BaseLayerWithLoRA)]
    if lora:
        return f"LoRA-wrapped modules ({lora[0]}): the kernels bind the base weights only"
    for i, layer in enumerate(layers):
        if type(layer) is not MuseSparkDSparkDecoderLayer:
            return f"layer {i} is not vLLM's MuseSparkDSparkDecoderLayer ({type(layer).__name__})"
        attn, mlp = layer.self_attn, layer.feed_forward
        changed = _overridden(attn, muse_nv.MuseSpark1xAttention, "forward", "_qk_norm_rope_kv_insert",
                              "_project_output")
        if not isinstance(attn, muse_nv.MuseSpark1xAttention) or changed:
            return f"layer {i}'s attention is not vLLM's MuseSpark1xAttention ({type(attn).__name__})"
        if attn.is_sequence_parallel_output:
            return f"layer {i}'s attention output is sequence-parallel"
        inner = attn.attn
        if type(inner) is not VllmAttention or inner.kv_sharing_target_layer_name is not None:
            return f"layer {i}'s attention layer is not vLLM's own Attention over its own KV cache"
        if inner.attn_backend.forward_includes_kv_cache_update:
            return (f"vLLM's {inner.attn_backend.get_name()} backend writes the KV cache inside its forward; the "
                    "executor inserts before attending")
        if type(mlp) is not LlamaMLP or _overridden(mlp, LlamaMLP, "forward"):
            return f"layer {i}'s feed-forward is not a dense LlamaMLP ({type(mlp).__name__}, e.g. MoE)"
        for what, linear in (("output", attn.o_proj), ("down", mlp.down_proj)):
            if not (type(linear) is RowParallelLinear and not _overridden(linear, RowParallelLinear, "forward")
                    and linear.input_is_parallel and linear.reduce_results and linear.bias is None):
                return (f"layer {i}'s {what} projection is not a bias-free RowParallelLinear all-reduced over the TP "
                        "group, which the executor's branch all-reduce assumes")
    return None


def _attention_unsupported(attn, layout_why: str | None) -> str | None:
    """Why the QKV epilogue does not take this layer, or None."""
    if attn.attn.kv_cache_dtype not in BF16_CACHE_DTYPES:
        return f"a KV cache of {attn.attn.kv_cache_dtype}: the kernels insert BF16 K and V"
    if layout_why is not None:
        return layout_why
    if attn.use_attn_temperature_tuning:
        return "attention temperature tuning (a per-position query scale the kernels do not apply)"
    if not attn.fused_qk_norm_rope_kv_insert:
        return ("vLLM runs this layer's QK-norm, RoPE and KV insert unfused (fused_qk_norm_rope_kv_insert is off), "
                "which the QKV epilogue does not reproduce")
    return _plain_linear(attn.qkv_proj)


def _insert(attn, k: torch.Tensor, v: torch.Tensor) -> None:
    """The KV insert vLLM's Attention.forward runs before attending (its backend keeps it out of forward)."""
    inner = attn.attn
    unified_kv_cache_update(k.view(-1, inner.num_kv_heads, inner.head_size),
                            v.view(-1, inner.num_kv_heads, inner.head_size), inner.layer_name)


def _gate(attn, out: torch.Tensor, og: torch.Tensor) -> torch.Tensor:
    """The o-norm and sigmoid gate on the function vLLM's forward picks for the layer."""
    if attn.fuse_o_norm_gate:
        if attn.cute_o_norm_gate:
            out = out.contiguous()
            muse_nv.o_norm_sigmoid_gate(out, og, attn.rms_norm_eps, enable_pdl=True)
            return out
        return muse_nv.rms_norm_gated(out, og, None, None, "sigmoid", eps=attn.rms_norm_eps)
    if attn.use_o_norm:
        out = attn.o_norm(out.reshape(-1, attn.head_dim)).reshape(out.shape)
    return og.sigmoid() * out


def _slots(attn):
    return _slots_of(attn.attn.layer_name)


def _head_norm(norm, head_dim: int, what: str) -> D.HeadNorm:
    if norm is None:
        return D.HeadNorm(head_dim, 0.0, None, f"no {what}")
    stock = type(norm) is MuseSpark1xRMSNorm and not norm.has_weight
    unsupported = None if stock else f"a {what} other than vLLM's weightless head norm ({type(norm).__name__})"
    return D.HeadNorm(int(norm.hidden_size), float(norm.variance_epsilon), None, unsupported)


def _attention(attn, block_size: int, backend: str | None, layout_why: str | None) -> D.Attention:
    m_heads, d = attn.num_heads, attn.head_dim

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], m_heads, d)

    def front_from(qkv, positions):
        q, k, v, og = attn._qk_norm_rope_kv_insert(qkv, positions)
        if not attn.fused_qk_norm_rope_kv_insert:
            _insert(attn, k, v)
        return heads(q), None if og is None else heads(og)

    def attend(q, positions):
        # The cache holds this step's K/V already: vLLM's decoder backends read
        # the cache only (key and value serve the insert, and DCP, refused).
        out = attn.attn(q.reshape(q.shape[0], m_heads * d), None, None, output_dtype=q.dtype)
        return heads(out)

    if attn.use_o_gate and attn.use_o_norm:
        o_norm = D.HeadNorm(d, float(attn.rms_norm_eps))
    elif attn.use_o_gate:
        o_norm = D.HeadNorm(d, float(attn.rms_norm_eps), None, "an o-gate without an o-norm (use_attn_o_norm false)")
    else:
        o_norm = None
    qk = _head_norm(attn.qk_norm, d, "QK-norm")
    backend = backend or attn.attn.attn_backend.get_name()
    return D.Attention(
        qkv_weight=attn.qkv_proj.weight,
        o_proj_weight=attn.o_proj.weight,
        num_heads=m_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=d,
        use_o_gate=attn.use_o_gate,
        q_norm=qk,
        k_norm=qk,
        o_norm=o_norm,
        rope=_rope(attn.rotary_emb),
        kv_block_size=block_size,
        forward=lambda x, positions: attn(positions=positions, hidden_states=x),
        project_qkv=lambda x: attn.qkv_proj(x)[0],
        front_from=front_from,
        attend=attend,
        gate=lambda out, og: heads(_gate(attn, out, og)),
        project_out=lambda gated: partial(attn.o_proj, gated),
        cache=lambda positions: (attn.attn.kv_cache, _slots(attn)),
        attention_operands=None,
        unsupported=_attention_unsupported(attn, layout_why),
        attention_unsupported=f"vLLM's {backend} attention backend runs it; no DSpark kernel reproduces that "
                              "backend's arithmetic",
    )


def activation_unsupported(act_fn) -> str | None:
    """Why the MLP activation kernel is not ``act_fn`` as vLLM dispatches it,
    or None: vLLM's ``SiluAndMul`` on its platform op (``forward_cuda`` on
    CUDA), not ``forward_native`` or its torch.compile (the custom op
    disabled: custom ops 'none' under Inductor, or '-silu_and_mul')."""
    if type(act_fn) is not SiluAndMul:
        return f"an activation other than SiluAndMul ({type(act_fn).__name__})"
    forward = getattr(act_fn._forward_method, "__func__", None)
    if forward is None or forward is SiluAndMul.forward_native:
        return "vLLM dispatches this SiluAndMul to its PyTorch-native forward (custom op disabled), not its CUDA op"
    return None


def _mlp(mlp, tp: int, hidden: int) -> D.MLP:
    why = (_plain_linear(mlp.gate_up_proj) or plain_row_parallel(mlp.down_proj, tp, hidden)
           or activation_unsupported(mlp.act_fn))
    return D.MLP(
        gate_up_weight=mlp.gate_up_proj.weight,
        down_weight=mlp.down_proj.weight,
        intermediate_size=int(mlp.down_proj.input_size_per_partition),
        forward=mlp,
        project_gate_up=lambda x: mlp.gate_up_proj(x)[0],
        # LlamaMLP's activation: fused with the down projection's input quantization where that applies.
        activation=lambda gu: maybe_fused_act_quant(mlp.act_fn, gu, mlp.down_proj),
        project_down=lambda h: partial(mlp.down_proj, h),
        unsupported=why,
    )


def _context(model, dtype: torch.dtype, layout_why: str | None) -> D.Context:
    attns = [layer.self_attn for layer in model.layers]
    unsupported = next((f"a KV cache of {a.attn.kv_cache_dtype}: the context store inserts BF16 K and V"
                        for a in attns if a.attn.kv_cache_dtype not in BF16_CACHE_DTYPES), layout_why)
    return D.Context(
        hidden_norm=norm_description("the hidden norm", model.hidden_norm, model.config.hidden_size, dtype),
        stacked_kv_weight=lambda: model._stacked_kv_weight,
        # The context keys' K-norm: weightless, the layers' QK-norm eps (_rms_norm_eps).
        k_norm=D.HeadNorm(int(model._head_dim), float(model._rms_norm_eps)),
        rope=_rope(model._rotary_emb),
        num_kv_heads=int(model._num_kv_heads),
        head_dim=int(model._head_dim),
        stock=model.precompute_and_store_context_kv,
        caches=lambda slots: [attn.kv_cache for attn in model._attn_layers],
        slots=lambda slots: slots,
        unsupported=unsupported,
    )


# The debug switch under which the executor checks the per-step indices vLLM
# hands the draft (vLLM's contract, unchecked otherwise): one host read a step.
CHECK_STEPS = "DSPARK_CHECK_STEPS"


def step_checker(model: MuseSparkDSparkModel):
    """``check(positions, fused)``, the executor's ``check_step`` under
    ``DSPARK_CHECK_STEPS=1`` (outside graph capture): ValueError unless the
    step's positions are integers in ``[0, rows)`` of the draft's RoPE
    table and each layer's slots (vLLM's forward context) integers below its
    cache's slots (negative: a padded row, not written)."""
    rows = int(model._rotary_emb.cos_sin_cache.shape[0])

    def check(positions: torch.Tensor, fused: bool = False) -> None:
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
            raise ValueError(f"{CHECK_STEPS}: the positions must be an integer tensor, not "
                             f"{getattr(positions, 'dtype', type(positions).__name__)}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= rows):
            raise ValueError(f"{CHECK_STEPS}: the positions must lie in [0, {rows}), not "
                             f"{int(positions.min())} to {int(positions.max())}")
        for attn in model._attn_layers:
            slots, cache = _slots_of(attn.layer_name), attn.kv_cache
            if slots is None or not isinstance(cache, torch.Tensor) or not cache.numel():
                continue
            if slots.is_floating_point() or slots.is_complex():
                raise ValueError(f"{CHECK_STEPS}: {attn.layer_name}'s slots must be integers, not {slots.dtype}")
            capacity = cache.numel() // (2 * attn.num_kv_heads * attn.head_size)
            if slots.numel() and int(slots.max()) >= capacity:
                raise ValueError(f"{CHECK_STEPS}: {attn.layer_name}'s slot {int(slots.max())} lies beyond its "
                                 f"cache's {capacity} slots")

    return check


def _slots_of(layer_name: str):
    mapping = get_forward_context().slot_mapping
    return mapping.get(layer_name) if isinstance(mapping, dict) else None


def describe_vllm(model: MuseSparkDSparkModel, block_size: int = 16,
                  attention_backend: str | None = None, kv_cache_layout: str | None = None) -> D.DraftDescription:
    """The model-neutral description of vLLM's draft backbone ``model``
    (module docstring), read after its weights are loaded. ``block_size``:
    the KV cache's block size (the cache config's); ``attention_backend``:
    the backend's name in the attention's refusal (default: the layer's);
    ``kv_cache_layout``: a layout name the caller knows (the plan CLI's), or
    None: not known yet (at build vLLM has not resolved or bound the cache;
    the plugin reads the bound cache's layout at its first call,
    ``deployment.bound_layout_unsupported``). The QKV epilogue and the
    context chain insert into the KV cache through its strides: a named
    layout refuses them only where it is none of vLLM's
    (``deployment.layout_unsupported``)."""
    if not isinstance(model, MuseSparkDSparkModel):
        raise TypeError(f"describe_vllm takes vLLM's MuseSparkDSparkModel, not {type(model).__name__}")
    config = model.config
    h = config.hidden_size
    dtype = model.default_dtype
    layers = list(model.layers)
    structure = _structure_unsupported(model, layers)
    try:
        layout_why = layout_unsupported(kv_cache_layout)
    except ValueError as error:  # a layout none of vLLM's: the inserts stay stock, with the reason
        layout_why = str(error)
    tp = layers[0].self_attn.o_proj.tp_size if layers else 1
    final = norm_description("the final norm", model.norm, h, dtype)
    inputs = [norm_description(f"layer {i}'s input norm", layer.self_attn.pre_qkv_proj_norm, h, dtype)
              for i, layer in enumerate(layers)]
    described = []
    for i, layer in enumerate(layers):
        residual = layer.residual_dtype
        attention_boundary = D.Boundary(
            f"layer {i}'s attention boundary",
            norm_description(f"layer {i}'s post-attention norm", layer.post_attn_norm, h, dtype),
            _connection(f"layer {i}'s attention connection", layer.add_attn, residual),
            norm_description(f"layer {i}'s pre-FFN norm", layer.pre_ffn_norm, h, dtype),
        )
        ffn_boundary = D.Boundary(
            f"layer {i}'s feed-forward boundary",
            norm_description(f"layer {i}'s post-FFN norm", layer.post_ffn_norm, h, dtype),
            _connection(f"layer {i}'s feed-forward connection", layer.add_ffn, residual),
            inputs[i + 1] if i + 1 < len(layers) else final,
        )
        attention = (_attention(layer.self_attn, block_size, attention_backend, layout_why) if structure is None
                     else None)
        mlp = _mlp(layer.feed_forward, tp, h) if structure is None else None
        described.append(D.Layer(i, inputs[i], attention, attention_boundary, mlp, ffn_boundary,
                                 _gemm_backend(layer)))
    if structure is not None:
        # The executor cannot split these layers: the plan keeps the whole draft stock.
        described = []
    return D.DraftDescription(
        name=type(model).__name__,
        hidden_size=h,
        compute_dtype=dtype,
        residual_dtype=config.residual_dtype,
        device=model.norm.weight.device if model.norm.weight is not None else next(model.parameters()).device,
        layers=described,
        final_norm=final,
        context=_context(model, dtype, layout_why) if described else None,
        tp=tp,
        all_reduce=tensor_model_parallel_all_reduce if tp > 1 else None,
        positions=lambda positions: positions,
        check_step=step_checker(model) if described and env_flag(CHECK_STEPS, False) else None,
        unsupported=structure,
    )


__all__ = ["describe_vllm", "norm_description", "norm_unsupported", "partial", "plain_row_parallel",
           "rope_unsupported"]
