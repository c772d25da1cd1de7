"""The reference draft on the CPU: deterministic weights, its stock forward
and context chain built from the spec's layers (each part against the
independent implementation of the stock kernels), decode steps over the paged
cache, and the forward's composition of the spec's layers. Data comes from the
conftest's seeded fixtures; the module's model from the same session seed."""

from __future__ import annotations

import os

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.reference.config import DraftConfig, small_config
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.spec.attention import paged_attention
from dspark_core.spec.layers import k_norm_context, linear, residual_boundary
from dspark_core.tools.compare import assert_bitwise, bits

SEED = int(os.environ["DSPARK_SEED"])  # the session seed (conftest.py sets and prints it)


@pytest.fixture(scope="module")
def model():
    return DraftModel(small_config(seed=SEED % 1000))


def _context(model, t, gen):
    c = model.config
    caches = model.make_caches(16)
    states = torch.randn(t, c.hidden_size, generator=gen).to(torch.bfloat16)
    positions = torch.arange(t)
    model.precompute_and_store_context_kv(states, positions, caches, positions)
    return caches, states


def test_weights_come_from_the_seed():
    a, b = DraftModel(small_config(num_layers=1, seed=3)), DraftModel(small_config(num_layers=1, seed=3))
    c = DraftModel(small_config(num_layers=1, seed=4))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert_bitwise(pa.data, pb.data, name)
        assert not torch.equal(pa.data, pc.data), name


def _np_norm(norm, x, out="bf16"):
    """The independent stock norm with a reference RMSNorm's settings (CPU: sm_90a)."""
    w = None if norm.weight is None else I.to_np(norm.weight)
    return I.rmsnorm(x, w, arch="sm_90a", eps=norm.eps, gain_center=norm.gain_center,
                     weight_before=norm.weight_before_norm, out=out)


def test_context_store_writes_normed_roped_keys_and_raw_values(model, gen):
    """The context chain against the independent implementation: the hidden
    norm and each layer's input norm (the stock Triton norm's tree, BF16 in
    and out), the stacked K/V projection (a device GEMM, taken from torch),
    ATen's K-norm, RoPE on the BF16 keys with the BF16 table, the insert."""
    t = 37
    caches, states = _context(model, t, gen)
    c = model.config
    normed = model.context_norms(states)
    assert normed.shape == (c.num_layers, t, c.hidden_size) and normed.dtype == torch.bfloat16
    h = _np_norm(model.hidden_norm, I.to_np(states))
    for i, layer in enumerate(model.layers):
        I.assert_same_bits(normed[i], _np_norm(layer.input_norm, h), f"layer {i} context norm")
    kv = torch.bmm(normed, model.stacked_kv_weight().transpose(1, 2)).view(c.num_layers, t, 2, c.num_kv_heads, 64)
    positions = np.arange(t)
    for i, layer in enumerate(model.layers):
        k_cache, v_cache = caches[i].gather(torch.arange(t))
        attn = layer.self_attn
        k = I.k_norm_context(I.to_np(kv[i, :, 0]), eps=attn.qk_norm.eps)
        expected = I.rope(k, positions, I.to_np(attn.rotary.context_table()))
        I.assert_same_bits(k_cache, expected, f"layer {i} keys")
        spec = attn.rotary(k_norm_context(kv[i, :, 0], attn.qk_norm), torch.arange(t), attn.rotary.context_table())
        assert_bitwise(k_cache, spec, f"layer {i} keys (spec layers)")
        assert_bitwise(v_cache, kv[i, :, 1], f"layer {i} values")
        # Slots past the context are untouched.
        rest_k, rest_v = caches[i].gather(torch.arange(t, caches[i].num_slots))
        assert int(bits(rest_k).abs().sum()) == 0 and int(bits(rest_v).abs().sum()) == 0


def test_attention_front_is_the_fused_qk_norm_rope(model, gen):
    """The decode front of every layer: q and k through the fused QK-norm
    and RoPE with the FP32 table (the independent implementation), the raw V
    and the normed K inserted at the step's slots; the o-gate's input rows
    pass through."""
    c = model.config
    m = 5
    caches = model.make_caches(4)
    step = StepInputs.block(11, m)
    x = torch.randn(m, c.hidden_size, generator=gen).to(torch.bfloat16)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        qkv = linear(x, attn.qkv_proj)
        q, og = attn.front_from(qkv, step, caches[i])
        rq, rk, rv, rog = (I.to_np(t) for t in attn.split_qkv(qkv))
        pos = step.positions.numpy()
        table = I.to_np(attn.rotary.cos_sin)
        assert attn.rotary.cos_sin.dtype == torch.float32
        I.assert_same_bits(q, I.qk_norm_rope(rq, eps=attn.qk_norm.eps, positions=pos, table=table), f"layer {i} q")
        I.assert_same_bits(og, rog, f"layer {i} o-gate rows")
        k_cache, v_cache = caches[i].gather(step.slots)
        I.assert_same_bits(k_cache, I.qk_norm_rope(rk, eps=attn.qk_norm.eps, positions=pos, table=table),
                           f"layer {i} k")
        I.assert_same_bits(v_cache, rv, f"layer {i} v")


def test_attention_back_and_mlp_use_the_stock_o_gate_and_activation(model, gen):
    """``gated``: the reference attention, then the o-norm and sigmoid gate
    as FLA's kernel computes it (CPU: sm_90a; independent implementation);
    the MLP's activation is SiluAndMul's."""
    c = model.config
    m = 3
    caches, _ = _context(model, 9, gen)
    step = StepInputs.block(9, m)
    x = torch.randn(m, c.hidden_size, generator=gen).to(torch.bfloat16)
    layer = model.layers[0]
    q, og = layer.self_attn.front(x, step, caches[0])
    got = layer.self_attn.gated(q, og, step, caches[0])
    attn = paged_attention(q, caches[0], step.attn_slots, c.num_kv_heads)
    expect = I.o_gate(I.to_np(attn), I.to_np(og), eps=layer.self_attn.o_norm.eps, arch="sm_90a")
    I.assert_same_bits(got, expect.reshape(m, c.q_size), "o-gate")
    gu = linear(x, layer.mlp.gate_up)
    I.assert_same_bits(layer.mlp.activation(gu), I.silu_and_mul(I.to_np(gu), c.intermediate_size), "activation")


def test_context_store_per_layer_slots_and_skips(model, gen):
    c = model.config
    states = torch.randn(4, c.hidden_size, generator=gen).to(torch.bfloat16)
    caches = model.make_caches(4)
    slots = torch.tensor([5, -1, 9, 2])
    model.precompute_and_store_context_kv(states, torch.arange(4), caches, [slots, None])
    k0, _ = caches[0].gather(torch.tensor([5, 9, 2]))
    assert bits(k0).abs().sum() > 0
    # Layer 1 stores nothing; the skipped row of layer 0 leaves slot 0 (its clamp) empty.
    assert int(bits(caches[1].tensor).abs().sum()) == 0
    assert int(bits(caches[0].gather(torch.tensor([0]))[0]).abs().sum()) == 0
    with pytest.raises(ValueError, match="one slot mapping per layer"):
        model.precompute_and_store_context_kv(states, torch.arange(4), caches, [slots])


def test_decode_steps_run_and_repeat_bit_for_bit(model, seed):
    c = model.config
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(seed + 2)
        caches, _ = _context(model, 20, gen)
        tokens = torch.tensor([1, 2, 3])
        outs = []
        pos = 20
        for _ in range(4):
            step = StepInputs.block(pos, 3)
            hidden = model(model.embed_tokens(tokens), step, caches)
            assert hidden.shape == (3, c.hidden_size) and hidden.dtype == torch.bfloat16
            assert torch.isfinite(hidden.float()).all()
            tokens = model.logits(hidden).argmax(-1)
            outs.append(hidden)
            pos += 3
        runs.append(torch.stack(outs))
    assert_bitwise(runs[0], runs[1], "two identical decodes")


def test_forward_is_the_spec_layers_composed(model, seed):
    """One step by hand: first norm, per layer attention, two boundaries, MLP."""
    c = model.config
    gen = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(2, c.hidden_size, generator=gen)  # an FP32 stream in
    caches_a, _ = _context(model, 8, torch.Generator().manual_seed(seed + 4))
    caches_b, _ = _context(model, 8, torch.Generator().manual_seed(seed + 4))
    step = StepInputs.block(8, 2)
    got = model(x, step, caches_a)

    stream = x
    h = model.layers[0].input_norm(x.to(torch.bfloat16))
    bounds = model.boundaries()
    for i, layer in enumerate(model.layers):
        a = layer.self_attn(h, step, caches_b[i])
        stream, f = residual_boundary(*bounds[2 * i], a, stream)
        stream, h = residual_boundary(*bounds[2 * i + 1], layer.mlp(f), stream)
    assert_bitwise(got, h, "forward")
    assert_bitwise(caches_a[1].tensor, caches_b[1].tensor, "cache")


def test_boundaries_are_the_stock_norms_and_connection(model, gen):
    """Every residual boundary of the draft (post-norm to BF16, the gated
    residual in FP32, the next pre-norm of the stream rounded to BF16)
    against the independent implementation, with the draft's own weights."""
    c = model.config
    for i, (post, conn, pre) in enumerate(model.boundaries()):
        branch = torch.randn(3, c.hidden_size, generator=gen).to(torch.bfloat16)
        stream = torch.randn(3, c.hidden_size, generator=gen) * 4
        new_stream, out = residual_boundary(post, conn, pre, branch, stream)

        def kw(n):
            return dict(weight=None if n.weight is None else I.to_np(n.weight), eps=n.eps,
                        gain_center=n.gain_center, weight_before=n.weight_before_norm)

        e_stream, e_out = I.residual_boundary(I.to_np(branch), I.to_np(stream), kw(post), kw(pre),
                                              I.to_np(conn.alpha), I.to_np(conn.beta))
        I.assert_same_bits(new_stream, e_stream, f"boundary {i} stream")
        I.assert_same_bits(out, e_out, f"boundary {i} out")


def test_step_inputs_block_is_causal():
    step = StepInputs.block(5, 3)
    assert step.positions.tolist() == [5, 6, 7]
    assert step.slots.tolist() == [5, 6, 7]
    assert step.attn_slots.tolist() == [
        [0, 1, 2, 3, 4, 5, -1, -1],
        [0, 1, 2, 3, 4, 5, 6, -1],
        [0, 1, 2, 3, 4, 5, 6, 7],
    ]


def test_model_rejects_bad_inputs(model):
    caches = model.make_caches(2)
    step = StepInputs.block(0, 1)
    with pytest.raises(ValueError, match=r"hidden states of \[m, 2048\]"):
        model(torch.zeros(1, 1024), step, caches)
    with pytest.raises(ValueError, match="one KV cache per layer"):
        model(torch.zeros(1, 2048), step, caches[:1])


def test_check_inputs_raises_the_stock_errors_in_one_host_read(model, monkeypatch):
    """``check_inputs`` raises what the stock forward raises for each
    out-of-range input (and nothing for good ones), reading the device once."""
    from dspark_core.reference.model import check_inputs

    hidden = torch.zeros(2, model.config.hidden_size, dtype=torch.bfloat16)
    slots_total = 4 * model.config.kv_block_size
    cases = [
        ("attn_slots", slots_total, "an attention slot beyond the cache's"),
        ("slots", slots_total, "a slot beyond the cache's"),
        ("positions", model.rotary.max_position, "RoPE positions must lie in"),
        ("positions", -1, "RoPE positions must lie in"),
        ("slots", None, "distinct slots"),  # the second row takes the first's slot
    ]
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    for field, value, message in cases:
        step = StepInputs.block(3, 2)
        if value is None:
            step.slots[1] = step.slots[0]
        else:
            getattr(step, field).view(-1)[0] = value
        with pytest.raises(ValueError, match=message):
            model(hidden, step, model.make_caches(4))
        reads.clear()
        with pytest.raises(ValueError, match=message):
            check_inputs(model, step.positions, model.make_caches(4), step.slots, step.attn_slots, distinct=True)
        assert len(reads) == 1
    step = StepInputs.block(3, 2)
    step.slots[1] = -1  # a skipped row, and a repeated skip, are fine
    step.slots[0] = -1
    check_inputs(model, step.positions, model.make_caches(4), step.slots, step.attn_slots, distinct=True)
    caches = model.make_caches(4)
    per_layer = [torch.tensor([0, slots_total - 1]), torch.tensor([slots_total, 1])]
    with pytest.raises(ValueError, match=f"a slot beyond the cache's {slots_total} slots"):
        check_inputs(model, torch.tensor([0, 1]), caches, per_layer)
    check_inputs(model, torch.tensor([0, 1]), caches, [per_layer[0], per_layer[0]])


def test_config_json_round_trip_and_validation(tmp_path):
    config = small_config(norm_overrides={"norm": {"has_weight": False}})
    path = tmp_path / "c.json"
    path.write_text(config.to_json())
    assert DraftConfig.from_json(path) == config
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        DraftConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        DraftConfig(compute_dtype="fp8")
    with pytest.raises(ValueError, match="unknown keys"):
        DraftConfig(norm_overrides={"norm": {"bias": True}})
