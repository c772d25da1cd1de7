"""The tensor-parallel draft on the CPU: sharding round trips, the TP forward
against the unsharded one, its plan, and validation.

The TP group is ``LocalGroup``: the ranks are threads of this process and the
all-reduce sums their BF16 partials in rank order in FP32 and rounds once
(``rank_order_sum``), which at TP2 is NCCL's BF16 sum (one correctly rounded
``bf16(a + b)``). One test runs the default ``torch.distributed`` all-reduce
over gloo with two spawned processes."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch

from dspark_core.contracts import constants as K
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft as plan_description
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig, small_config
from dspark_core.reference.model import DraftModel, StepInputs, attend
from dspark_core.reference.tp import (
    LocalGroup,
    TPDraftModel,
    gather_parameter,
    gemm_error_bound,
    rank_order_sum,
    shard_config,
    shard_draft,
    shard_parameter,
)
from dspark_core.spec.layers import linear, o_gate, residual_boundary
from dspark_core.tools.compare import assert_bitwise

ALL = policy.Target(kernels=policy.ALL_KERNELS)


def plan_draft(model, target=None):
    """The plan of a reference draft: the planner over its description."""
    return plan_description(describe(model), target)


def _shards(model, tp):
    group = LocalGroup(tp, timeout_s=60)
    return group, [shard_draft(model, r, tp, all_reduce=group.all_reduce(r)) for r in range(tp)]


def _hidden(gen, m, h, dtype=torch.bfloat16):
    return torch.randn(m, h, generator=gen).to(dtype)


# ---------------------------------------------------------------- (a) sharding


@pytest.mark.parametrize("tp, changes", [(1, {}), (2, {}), (4, {"num_kv_heads": 4}),
                                         (2, {"use_o_gate": False}), (8, {"num_kv_heads": 8})])
def test_concatenating_the_shards_gives_the_original_weights(tp, changes):
    model = DraftModel(small_config(**changes))
    shards = [shard_draft(model, r, tp, all_reduce=lambda t: t) for r in range(tp)]
    named = [dict(s.named_parameters()) for s in shards]
    for name, p in model.named_parameters():
        got = gather_parameter(name, [n[name] for n in named], model.config)
        assert got.dtype == p.dtype
        assert_bitwise(got, p, name)
        for r in range(tp):
            assert_bitwise(named[r][name], shard_parameter(name, p, model.config, r, tp), f"rank {r} {name}")


def test_a_shard_has_the_ranks_heads_and_features():
    c = small_config()  # hidden 2048, 8 heads of 64, 2 KV heads, intermediate 1024
    model = DraftModel(c)
    s = shard_draft(model, 1, 2, all_reduce=lambda t: t)
    assert isinstance(s, DraftModel) and s.rank == 1 and s.tp == 2 and s.full_config == c
    assert (s.config.num_heads, s.config.num_kv_heads, s.config.intermediate_size) == (4, 1, 512)
    attn, full = s.layers[0].self_attn, model.layers[0].self_attn
    q, kv = c.q_size, c.kv_size
    # q, k, v and o-gate rows of rank 1's heads, in the stock order.
    rows = torch.cat([torch.arange(q // 2, q), q + torch.arange(kv // 2, kv), q + kv + torch.arange(kv // 2, kv),
                      q + 2 * kv + torch.arange(q // 2, q)])
    assert_bitwise(attn.qkv_proj, full.qkv_proj[rows], "qkv rows")
    assert_bitwise(attn.o_proj, full.o_proj[:, q // 2:], "o_proj columns")
    i = c.intermediate_size
    assert_bitwise(s.layers[0].mlp.gate_up, model.layers[0].mlp.gate_up[torch.cat(
        [torch.arange(i // 2, i), i + torch.arange(i // 2, i)])], "gate_up rows")
    assert_bitwise(s.layers[0].mlp.down, model.layers[0].mlp.down[:, i // 2:], "down columns")
    # Replicated: norms, connections, embeddings, the RoPE table (shared).
    assert_bitwise(s.layers[1].add_ffn.alpha, model.layers[1].add_ffn.alpha, "alpha")
    assert_bitwise(s.lm_head, model.lm_head, "lm_head")
    assert s.rotary is model.rotary and attn.rotary is model.rotary
    assert s.make_caches(2)[0].tensor.shape[1] == 1  # the rank's KV heads


def test_a_draft_on_meta_shards_on_meta():
    s = shard_draft(DraftModel(DraftConfig(), device="meta"), 0, 2)
    assert s.layers[0].self_attn.o_proj.device.type == "meta"
    assert tuple(s.layers[0].self_attn.o_proj.shape) == (8192, 2048)
    assert tuple(s.layers[0].mlp.down.shape) == (8192, 8192)
    assert tuple(s.layers[0].self_attn.qkv_proj.shape) == (2 * 2048 + 2 * 256, 8192)


# ---------------------------------------------------------------- (b) the TP forward


def _split_k_forward(model, hidden, step, caches, tp):
    """The unsharded draft's forward with o_proj and down computed as ``tp``
    BF16 partials over K blocks summed in rank order: what the TP forward
    computes, written on the whole draft's modules."""

    def split_k(x, w):
        return rank_order_sum([linear(xb, wb) for xb, wb in zip(x.chunk(tp, dim=1), w.chunk(tp, dim=1))])

    stream, x = model.first_norm(hidden)
    bounds = model.boundaries()
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        q, og = a.front(x, step, caches[i])
        o = attend(q, caches[i], step.attn_slots, a.num_kv_heads)
        if og is not None:
            o = o_gate(o, og, a.o_norm)
        attn_out = split_k(o.reshape(o.shape[0], a.q_size), a.o_proj)
        stream, ffn_in = residual_boundary(*bounds[2 * i], attn_out, stream)
        ffn_out = split_k(layer.mlp.activation(linear(ffn_in, layer.mlp.gate_up)), layer.mlp.down)
        stream, x = residual_boundary(*bounds[2 * i + 1], ffn_out, stream)
    return x


def test_tp1_is_the_stock_forward_bit_for_bit(gen):
    model = DraftModel(small_config())
    shard = shard_draft(model, 0, 1, all_reduce=lambda t: t)
    hidden = _hidden(gen, 5, 2048, torch.float32)
    ref = model(hidden, StepInputs.block(3, 5), model.make_caches(4))
    assert_bitwise(shard(hidden, StepInputs.block(3, 5), shard.make_caches(4)), ref, "TP1 forward")


@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_tp2_forward_is_the_split_k_forward_and_near_the_unsharded_one(gen, m):
    """Bit for bit the whole draft with split-K o_proj/down (on this CPU's
    BLAS, whose row-split and column-split GEMMs give the same bits per
    element as the whole ones: the caches check it), the same on both ranks,
    and within a bf16 tolerance of the unsharded forward."""
    model = DraftModel(small_config(num_layers=3))
    group, shards = _shards(model, 2)
    hidden = _hidden(gen, m, 2048)
    step = StepInputs.block(4, m)
    ref_caches = model.make_caches(4)
    ref = model(hidden, step, ref_caches)
    split_caches = model.make_caches(4)
    split = _split_k_forward(model, hidden, step, split_caches, 2)
    caches = [s.make_caches(4) for s in shards]
    outs = group.run(lambda r: shards[r](hidden, step, caches[r]))
    assert group.calls == 2 * 3
    assert_bitwise(outs[1], outs[0], "rank 1 vs rank 0")
    assert_bitwise(outs[0], split, "TP2 vs split-K forward")
    for layer in range(3):
        for r in range(2):
            kv_heads = split_caches[layer].tensor.shape[1] // 2
            assert_bitwise(caches[r][layer].tensor, split_caches[layer].tensor[:, r * kv_heads:(r + 1) * kv_heads],
                           f"layer {layer} rank {r} cache")
    # Against the unsharded forward: not bitwise (K is split, partials are
    # rounded), and ~1 BF16 ulp per row-parallel GEMM propagates through the
    # norms. Measured over 48 seeded cases: max error <= 2^-6.4 of the largest
    # output, mean error <= 2^-7 of the mean output; a wrong shard errs O(1).
    err = (outs[0].float() - ref.float()).abs()
    scale = ref.float().abs()
    assert float(err.max()) <= 2.0**-4 * float(scale.max()), float(err.max())
    assert float(err.mean()) <= 2.0**-5 * float(scale.mean()), float(err.mean())


@pytest.mark.parametrize("role", ["o_proj", "down"])
def test_a_row_parallel_projection_is_within_the_bf16_gemm_bound(gen, role):
    model = DraftModel(small_config(num_kv_heads=4))
    w = model.layers[0].self_attn.o_proj if role == "o_proj" else model.layers[0].mlp.down
    for tp in (2, 4):
        shards = [shard_parameter(f"layers.0.{'self_attn' if role == 'o_proj' else 'mlp'}.{role}", w,
                                  model.config, r, tp) for r in range(tp)]
        x = torch.randn(16, w.shape[1], generator=gen).bfloat16()
        got = rank_order_sum([linear(xb, s) for xb, s in zip(x.chunk(tp, dim=1), shards)])
        whole = linear(x, w)
        bound = gemm_error_bound(x, w, tp)
        excess = (got.double() - whole.double()).abs() - bound
        assert float(excess.max()) <= 0.0, f"TP{tp}: {float(excess.max())}"


def test_rank_order_sum_is_the_correctly_rounded_bf16_sum_at_tp2(gen):
    a = (torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-20, 20, (4096,), generator=gen).float()))
    b = (torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-20, 20, (4096,), generator=gen).float()))
    a, b = a.bfloat16(), b.bfloat16()
    exact = a.double() + b.double()  # exact: two BF16 values
    assert_bitwise(rank_order_sum([a, b]), exact.to(torch.bfloat16), "a + b")


def test_the_shard_plans_as_the_draft_does():
    full = DraftModel(DraftConfig(), device="meta")
    shard = shard_draft(full, 1, 2)
    target = ALL.replace(tp=2)
    plan, whole = plan_draft(shard, target), plan_draft(full, target)
    assert plan.draft_reason is None
    assert {p.name: p.reason for p in plan.parts() if not p.fused} == {}
    assert [b.constants.key() for b in plan.boundaries] == [b.constants.key() for b in whole.boundaries]
    assert plan.all_reduce.constants == K.AllReduceConstants(2)
    assert [f.constants.num_heads for f in plan.qkv_epilogues] == [32, 32]
    assert [f.constants.kv_heads for f in plan.qkv_epilogues] == [4, 4]
    assert plan.context.fused
    assert [p.constants.role for p in plan.package_gemms] == ["o_proj", "down_proj"] * 2
    # The whole draft planned at TP2 already has the ranks' shards (K / tp).
    assert [p.constants.k_shard for p in whole.package_gemms] == [2048, 8192] * 2


def test_the_shards_package_gemms_take_the_shards_k():
    whole = DraftModel(DraftConfig(), device="meta")
    shard = shard_draft(whole, 0, 2)
    plan = plan_draft(shard, ALL.replace(tp=2))
    assert [p.constants.k_shard for p in plan.package_gemms] == [2048, 8192] * 2
    # The whole draft planned at TP2 gets the same shards.
    assert [p.constants for p in plan_draft(whole, ALL.replace(tp=2)).package_gemms] == [
        p.constants for p in plan.package_gemms
    ]
    with pytest.raises(ValueError, match="TP2 shard of the draft cannot be planned for TP4"):
        plan_draft(shard, ALL.replace(tp=4))


# ---------------------------------------------------------------- (c) validation


@pytest.mark.parametrize("changes, tp, rank, match", [
    ({}, 3, 0, "TP3 does not divide the draft's 8 heads"),
    ({}, 4, 0, "TP4 does not divide the draft's 2 KV heads"),
    ({"intermediate_size": 1001}, 2, 0, "TP2 does not divide the draft's 1001 intermediate features"),
    ({}, 0, 0, "a TP size is a positive integer, not 0"),
    ({}, 2, 2, r"a rank of a TP2 group is an integer in \[0, 2\), not 2"),
    ({}, 2, -1, r"a rank of a TP2 group is an integer in \[0, 2\), not -1"),
])
def test_tp_sizes_and_ranks_that_cannot_shard_raise(changes, tp, rank, match):
    model = DraftModel(small_config(**changes), device="meta")
    with pytest.raises(ValueError, match=match):
        shard_draft(model, rank, tp)


def test_only_a_whole_draft_shards():
    shard = shard_draft(DraftModel(small_config(), device="meta"), 0, 2)
    with pytest.raises(ValueError, match="takes a whole DraftModel, not TPDraftModel"):
        shard_draft(shard, 0, 1)
    with pytest.raises(ValueError, match="TP2 does not divide the draft's 1 KV heads"):
        shard_config(shard.config, 2)
    with pytest.raises(ValueError, match="differs on rank 1"):
        gather_parameter("norm.weight", [torch.zeros(4), torch.ones(4)], small_config())


def test_a_failing_rank_does_not_hang_the_local_group():
    group = LocalGroup(2, timeout_s=10)

    def fn(rank):
        if rank == 1:
            raise RuntimeError("rank 1 failed")
        return group.all_reduce(0)(torch.zeros(2, dtype=torch.bfloat16))

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        group.run(fn)


# ---------------------------------------------------------------- the default all-reduce


def _gloo_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from dspark_core.reference.config import small_config
    from dspark_core.reference.model import DraftModel, StepInputs
    from dspark_core.reference.tp import shard_draft

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        model = DraftModel(small_config(num_layers=2))
        shard = shard_draft(model, rank, world)  # the default: torch.distributed.all_reduce
        hidden = torch.randn(3, 2048, generator=torch.Generator().manual_seed(7)).bfloat16()
        out = shard(hidden, StepInputs.block(2, 3), shard.make_caches(4))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_default_all_reduce_over_gloo_matches_the_local_group(tmp_path):
    """Two spawned processes, gloo over a file rendezvous: the default
    ``torch.distributed.all_reduce`` gives the bits of the rank-order sum
    (at TP2 gloo's BF16 sum is one rounded add too)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")
    try:
        done = False
        for _ in range(120):
            if ctx.join(timeout=1.0):
                done = True
                break
        assert done, "the gloo ranks did not finish in 120 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = DraftModel(small_config(num_layers=2))
    group, shards = _shards(model, 2)
    hidden = torch.randn(3, 2048, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = group.run(lambda r: shards[r](hidden, StepInputs.block(2, 3), shards[r].make_caches(4)))
    assert_bitwise(outs[0], ref[0], "gloo rank 0")
    assert_bitwise(outs[1], ref[0], "gloo rank 1")


def test_isinstance_and_names():
    assert issubclass(TPDraftModel, DraftModel)
    assert math.isfinite(float(gemm_error_bound(torch.ones(1, 4), torch.ones(2, 4), 2).max()))
