"""The reference draft on the CPU: deterministic weights, the context K/V
store, decode steps over the paged cache, and the forward's composition of the
spec's layers."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dspark_core.reference.config import DraftConfig, small_config
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.spec.layers import residual_boundary
from dspark_core.tools.compare import assert_bitwise, bits

SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
print(f"DSPARK_SEED={SEED}")


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


def test_context_store_writes_normed_roped_keys_and_raw_values(model):
    gen = torch.Generator().manual_seed(SEED)
    t = 37
    caches, states = _context(model, t, gen)
    c = model.config
    normed = model.context_norms(states)
    assert normed.shape == (c.num_layers, t, c.hidden_size) and normed.dtype == torch.bfloat16
    kv = torch.bmm(normed, model.stacked_kv_weight().transpose(1, 2)).view(c.num_layers, t, 2, c.num_kv_heads, 64)
    for i, layer in enumerate(model.layers):
        k_cache, v_cache = caches[i].gather(torch.arange(t))
        attn = layer.self_attn
        expected_k = attn.rotary(attn.k_norm(kv[i, :, 0]), torch.arange(t))
        assert_bitwise(k_cache, expected_k, f"layer {i} keys")
        assert_bitwise(v_cache, kv[i, :, 1], f"layer {i} values")
        # Slots past the context are untouched.
        rest_k, rest_v = caches[i].gather(torch.arange(t, caches[i].num_slots))
        assert int(bits(rest_k).abs().sum()) == 0 and int(bits(rest_v).abs().sum()) == 0


def test_context_store_per_layer_slots_and_skips(model):
    c = model.config
    gen = torch.Generator().manual_seed(SEED + 1)
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


def test_decode_steps_run_and_repeat_bit_for_bit(model):
    c = model.config
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(SEED + 2)
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


def test_forward_is_the_spec_layers_composed(model):
    """One step by hand: first norm, per layer attention, two boundaries, MLP."""
    c = model.config
    gen = torch.Generator().manual_seed(SEED + 3)
    x = torch.randn(2, c.hidden_size, generator=gen)  # an FP32 stream in
    caches_a, _ = _context(model, 8, torch.Generator().manual_seed(SEED + 4))
    caches_b, _ = _context(model, 8, torch.Generator().manual_seed(SEED + 4))
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
