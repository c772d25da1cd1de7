"""The reference draft's adapter: ``describe(model)`` is the model-neutral
``DraftDescription`` of a ``DraftModel`` (or of a rank's ``TPDraftModel``),
over its own modules and tensors.

A step of the reference draft is what ``DraftModel.forward`` takes after the
hidden states, ``(step: StepInputs, caches)``; the context chain's is what
``precompute_and_store_context_kv`` takes after the states and positions,
``(caches, slots)``. The description's stock calls run the model's modules:
the executor's stock parts are the reference forward itself.
"""

from __future__ import annotations

import torch

from dspark_core.errors import quoted
from dspark_core.reference.model import DraftAttention, DraftModel, attend, check_inputs
from dspark_core.runtime import description as D
from dspark_core.spec.layers import GatedMLP, GatedResidual, HeadNorm, RMSNorm, Rotary, linear, o_gate


def norm_description(name: str, norm, hidden_size: int) -> D.Norm:
    """The description of one of the reference draft's norms."""
    unsupported = None if type(norm) is RMSNorm else f"a norm other than the stock RMSNorm ({type(norm).__name__})"
    return D.Norm(
        name=name,
        stock=lambda x, out_dtype=None: norm(x, out_dtype=out_dtype),
        hidden_size=getattr(norm, "hidden_size", hidden_size),
        eps=float(getattr(norm, "eps", 0.0)),
        weight=getattr(norm, "weight", None),
        gain_center=float(getattr(norm, "gain_center", 0.0)),
        weight_before_norm=bool(getattr(norm, "weight_before_norm", False)),
        out_dtype=getattr(norm, "out_dtype", torch.bfloat16),
        unsupported=unsupported,
    )


def _connection(name: str, conn) -> D.Connection:
    unsupported = (None if type(conn) is GatedResidual
                   else f"a residual connection other than the stock gated one ({type(conn).__name__})")
    return D.Connection(name, lambda stream, branch: conn(stream, branch), getattr(conn, "alpha", None),
                        getattr(conn, "beta", None), unsupported)


def _head_norm(norm) -> D.HeadNorm:
    unsupported = None if type(norm) is HeadNorm else f"a head norm other than the stock one ({type(norm).__name__})"
    return D.HeadNorm(norm.head_dim, float(norm.eps), norm.weight, unsupported)


def _rope(rotary) -> D.Rope | None:
    if rotary is None:
        return None
    unsupported = None if type(rotary) is Rotary else "a RoPE other than the stock GPT-J rotation over the whole head"
    return D.Rope(rotary.cos_sin, rotary.head_dim, unsupported)


def _context_rope(rotary) -> D.Rope | None:
    rope = _rope(rotary)
    if rope is not None:
        rope.table = rotary.context_table()
    return rope


def _attention(model: DraftModel, i: int, attn: DraftAttention) -> D.Attention:
    stock = type(attn) is DraftAttention
    unsupported = None if stock else f"an attention other than the stock one ({type(attn).__name__})"

    def forward(x, step, caches):
        return model.reduce_branch(attn(x, step, caches[i]))

    return D.Attention(
        qkv_weight=attn.qkv_proj,
        o_proj_weight=attn.o_proj,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        use_o_gate=attn.use_o_gate,
        q_norm=_head_norm(attn.qk_norm),
        k_norm=_head_norm(attn.qk_norm),
        o_norm=_head_norm(attn.o_norm) if attn.use_o_gate else None,
        rope=_rope(attn.rotary),
        kv_block_size=model.config.kv_block_size,
        forward=forward,
        project_qkv=lambda x: linear(x, attn.qkv_proj),
        front_from=lambda qkv, step, caches: attn.front_from(qkv, step, caches[i]),
        attend=lambda q, step, caches: attend(q, caches[i], step.attn_slots, attn.num_kv_heads),
        gate=lambda out, og: o_gate(out, og, attn.o_norm),
        project_out=lambda gated: linear(gated, attn.o_proj),
        cache=lambda step, caches: (caches[i].tensor, step.slots),
        attention_operands=(lambda step, caches: (caches[i], step.attn_slots)) if stock else None,
        unsupported=unsupported,
        attention_unsupported=unsupported,
    )


def _mlp(model: DraftModel, mlp) -> D.MLP:
    unsupported = None if type(mlp) is GatedMLP else f"an MLP other than the stock gated one ({type(mlp).__name__})"
    gate_up, down = getattr(mlp, "gate_up", None), getattr(mlp, "down", None)
    return D.MLP(
        gate_up_weight=gate_up,
        down_weight=down,
        intermediate_size=getattr(mlp, "intermediate_size", 0),
        forward=lambda x: model.reduce_branch(mlp(x)),
        project_gate_up=lambda x: linear(x, mlp.gate_up),
        activation=getattr(mlp, "activation", None),
        project_down=lambda h: linear(h, mlp.down),
        unsupported=unsupported,
    )


def describe(model: DraftModel) -> D.DraftDescription:
    """The model-neutral description of ``model`` (module docstring);
    TypeError for anything but a ``DraftModel``."""
    if not isinstance(model, DraftModel):
        raise TypeError(f"describe takes the reference draft's model (a DraftModel), not "
                        f"{type(model).__name__} {quoted(model)}")
    h = model.config.hidden_size
    layers = list(model.layers)
    final = norm_description("the final norm", model.norm, h)
    inputs = [norm_description(f"layer {i}'s input norm", layer.input_norm, h) for i, layer in enumerate(layers)]
    described = []
    for i, layer in enumerate(layers):
        attention_boundary = D.Boundary(
            f"layer {i}'s attention boundary",
            norm_description(f"layer {i}'s post-attention norm", layer.post_attn_norm, h),
            _connection(f"layer {i}'s attention connection", layer.add_attn),
            norm_description(f"layer {i}'s pre-FFN norm", layer.pre_ffn_norm, h),
        )
        ffn_boundary = D.Boundary(
            f"layer {i}'s feed-forward boundary",
            norm_description(f"layer {i}'s post-FFN norm", layer.post_ffn_norm, h),
            _connection(f"layer {i}'s feed-forward connection", layer.add_ffn),
            inputs[i + 1] if i + 1 < len(layers) else final,
        )
        described.append(D.Layer(i, inputs[i], _attention(model, i, layer.self_attn), attention_boundary,
                                 _mlp(model, layer.mlp), ffn_boundary))
    tp = getattr(model, "tp", 1)
    return D.DraftDescription(
        name=type(model).__name__,
        hidden_size=h,
        compute_dtype=model.default_dtype,
        residual_dtype=model.residual_dtype,
        device=next(model.parameters()).device,
        layers=described,
        final_norm=final,
        context=_context(model) if layers else None,
        tp=tp,
        all_reduce=model.reduce_branch if tp > 1 else None,
        positions=lambda step, caches: step.positions,
        check_step=lambda step, caches, fused: _check_step(model, step, caches, fused),
        check_context=lambda positions, caches, slots: check_inputs(model, positions, caches, slots),
    )


def _check_step(model: DraftModel, step, caches, fused: bool) -> None:
    """The stock forward's ValueErrors: one cache per layer; where fused
    kernels would skip bad rows instead of raising, the range and
    distinct-slot checks too (one host read)."""
    if len(caches) != len(model.layers):
        raise ValueError(f"the draft takes one KV cache per layer ({len(model.layers)}), not {len(caches)}")
    if fused:
        check_inputs(model, step.positions, caches, step.slots, step.attn_slots, distinct=True)


def _context(model: DraftModel) -> D.Context:
    attn = model.layers[0].self_attn
    unsupported = None
    if not all(type(layer.self_attn) is DraftAttention for layer in model.layers):
        unsupported = "a layer whose attention is not the stock one"
    elif not all(type(layer.self_attn.qk_norm) is HeadNorm and layer.self_attn.qk_norm.weight is None
                 and layer.self_attn.qk_norm.eps == attn.qk_norm.eps for layer in model.layers):
        unsupported = "a K-norm other than the stock weightless head norm"
    return D.Context(
        hidden_norm=norm_description("the hidden norm", model.hidden_norm, model.config.hidden_size),
        stacked_kv_weight=model.stacked_kv_weight,
        k_norm=_head_norm(attn.qk_norm),
        # The context chain rotates with the table cast to BF16 (Rotary.context_table).
        rope=_context_rope(attn.rotary),
        num_kv_heads=model.config.num_kv_heads,
        head_dim=model.config.head_dim,
        stock=model.precompute_and_store_context_kv,
        caches=lambda caches, slots: [c.tensor if hasattr(c, "tensor") else c for c in caches],
        slots=lambda caches, slots: slots,
        unsupported=unsupported,
    )


__all__ = ["describe", "norm_description"]
