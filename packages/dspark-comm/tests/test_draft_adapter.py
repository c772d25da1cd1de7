"""``DraftAllReduce`` on the CPU: the kernels are stand-ins that compute the
spec (the ranks are threads, the all-reduce ``dspark_core.reference.tp.LocalGroup``'s
rank-order sum, NCCL's BF16 sum at TP2), so what is checked is which
boundary is bound to which constants and weights, which calls fuse and which
take the stock all-reduce, and that ``DraftDecode`` (dspark-core's executor,
over the shard's description) with the adapter gives the bits of the stock
TP2 forward (``TPDraftModel.forward``)."""

from __future__ import annotations

import logging

import pytest
import torch

from dspark_comm.draft import DraftAllReduce
from dspark_comm.protocol import MailboxLayout
from dspark_comm.runtime.group import TPGroup
from dspark_core.contracts import constants as K
from dspark_core.contracts.constants import FP32_RANK_ORDER
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft as plan_description
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.reference.tp import LocalGroup, shard_draft
from dspark_core.runtime.build import build_draft_decode
from dspark_core.runtime.decode import DraftDecode
from dspark_core.tools.compare import assert_bitwise

# Only the parts the adapter binds fuse; the others keep their stock modules.
TP2 = policy.Target(kernels=frozenset({policy.BOUNDARY, policy.ALL_REDUCE_BOUNDARY, policy.PACKAGE_GEMM}), tp=2)


def plan_draft(model, target):
    return plan_description(describe(model), target)


def stock_boundary(b, branch, stream):
    """A described boundary on its stock modules (the executor's order)."""
    new = b.connection.stock(stream, b.post.stock(branch, torch.bfloat16))
    return new, b.pre.stock(new.to(torch.bfloat16), torch.bfloat16)


class FakeGroup(TPGroup):
    """A TP group whose stock all-reduce and gather are the local group's."""

    def __init__(self, local: LocalGroup, rank: int) -> None:
        self.rank, self.size, self.device = rank, local.tp, torch.device("cpu")
        self.reduce = local.all_reduce(rank)
        self.gather = local.all_gather(rank)
        self.calls = 0

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return self.gather(bytes(data))

    def all_reduce_(self, t):
        self.calls += 1
        return t.copy_(self.reduce(t))


class FakeMailbox:
    def __init__(self, group: FakeGroup, hidden: int, capacity: int = 16) -> None:
        self.group, self.rank, self.device = group, group.rank, group.device
        self.layout = MailboxLayout(group.size, hidden, capacity)
        self.published: list = []  # what the package GEMM stand-in published


def fake_boundary(model):
    """A stand-in for ``AllReduceBoundary``: records its binding, sums the
    partial over the mailbox's group, then runs the stock boundary of the
    modules its gates belong to."""
    by_alpha = {id(b.connection.alpha): b for b in describe(model).boundaries()}

    class FakeAllReduceBoundary:
        def __init__(self, mailbox, constants, alpha, beta, post_weight, pre_weight, sum_order):
            self.args = (mailbox, constants, alpha, beta, post_weight, pre_weight, sum_order)
            self.modules = by_alpha[id(alpha)]
            self.mailbox = mailbox
            self.calls, self.prepared = [], []

        def prepare(self, stream_dtypes, store_stream, published=(False,)):
            self.prepared.append((tuple(stream_dtypes), tuple(store_stream)) + (
                (tuple(published),) if published != (False,) else ()))

        def run(self, partial, stream, store_stream, published=False):
            if published:  # the package GEMM stand-in left this rank's partial
                partial = self.mailbox.published.pop()
            self.calls.append((partial.shape[0], stream.dtype, store_stream) + (("published",) if published else ()))
            summed = self.mailbox.group.reduce(partial)  # the mailbox's sum, not the group's all_reduce_
            new, out = stock_boundary(self.modules, summed, stream)
            return (new if store_stream else None), out

    return FakeAllReduceBoundary


class FakeUnfused:
    """``DraftBoundary`` stand-in (after the stock all-reduce), as the
    executor builds it from the plan's constants and the gates and weights."""

    def __init__(self, constants, alpha, beta, post_weight, pre_weight):
        self.alpha, self.calls = alpha, 0

    def prepare(self, **variants):
        pass

    def problem(self, branch, stream):
        return None if branch.shape[0] <= 16 else f"{branch.shape[0]} rows"

    def takes(self, branch, stream):
        return self.problem(branch, stream) is None

    def launch(self, branch, stream, store):
        self.calls += 1
        new, out = stock_boundary(self.bound, branch, stream)
        return (new if store else None), out


class FakeGemm:
    """A ``PackageGemm`` stand-in: publishing leaves ``x @ W^T`` (the stock
    GEMM's partial) in the fake mailbox for the boundary to consume."""

    def __init__(self, constants, weight, mailbox, rank):
        self.constants, self.weight, self.mailbox, self.rank = constants, weight, mailbox, rank
        self.calls, self.prepared = [], 0

    def prepare(self):
        self.prepared += 1

    def run(self, x, publish=False):
        assert publish
        self.calls.append(x.shape[0])
        self.mailbox.published.append(torch.matmul(x, self.weight.t()))


def _rank(model, local, rank, capacity=16, gemm=None):
    shard = shard_draft(model, rank, local.tp, all_reduce=local.all_reduce(rank))
    draft = describe(shard)
    plan = plan_description(draft, TP2)
    mailbox = FakeMailbox(FakeGroup(local, rank), model.config.hidden_size, capacity)
    adapter = DraftAllReduce(mailbox, plan, draft, rank, boundary=fake_boundary(shard), gemm=gemm,
                             package_gemm=gemm is not None)
    decode = DraftDecode(draft, plan, adapter, kernels={policy.BOUNDARY: FakeUnfused})
    decode.prepare()
    by_alpha = {id(b.connection.alpha): b for b in draft.boundaries()}
    for fused in decode.boundaries:
        fused.bound = by_alpha[id(fused.alpha)]
    return shard, plan, adapter, decode


def test_each_boundary_is_bound_to_its_constants_and_weights_in_order():
    local = LocalGroup(2)
    shard, plan, adapter, _ = _rank(DraftModel(small_config(num_layers=3)), local, 1)
    bounds = shard.boundaries()
    assert adapter.tp == 2 and adapter.rank == 1 and len(adapter.boundaries) == 6
    for i, (b, part, (post, conn, pre)) in enumerate(zip(adapter.boundaries, plan.boundaries, bounds)):
        mailbox, constants, alpha, beta, post_w, pre_w, order = b.args
        assert mailbox is adapter.mailbox
        assert constants is part.constants, i
        assert alpha is conn.alpha and beta is conn.beta, i  # the shard's own tensors
        assert post_w is post.weight and pre_w is pre.weight, i
        assert order == FP32_RANK_ORDER
    # The feed-forward boundary of layer i pre-norms into layer i+1's input norm.
    assert adapter.boundaries[1].args[5] is shard.layers[1].input_norm.weight
    assert adapter.boundaries[5].args[5] is shard.norm.weight


def test_prepare_compiles_what_the_executor_launches():
    local = LocalGroup(2, timeout_s=30)
    model = DraftModel(small_config())
    adapters = [_rank(model, local, r)[2] for r in range(2)]
    local.run(lambda r: adapters[r].prepare())  # collective: every rank prepares
    f32, bf16 = torch.float32, torch.bfloat16
    for adapter in adapters:
        assert [b.prepared for b in adapter.boundaries] == [
            [((f32, bf16), (True,))], [((f32,), (True,))], [((f32,), (True,))], [((f32,), (False,))]]


@pytest.mark.parametrize("where", ["boundary", "decode"])
def test_prepare_fails_on_every_rank_when_one_rank_fails(where):
    """A compile error on rank 1 alone, in one of its boundaries or earlier
    in the decode (``failed=``, as build_draft_decode passes it): both ranks
    raise (none is left to wait for it in a mailbox call), rank 1 with its
    own error chained."""
    local = LocalGroup(2, timeout_s=30)
    model = DraftModel(small_config())
    adapters = [_rank(model, local, r)[2] for r in range(2)]

    def broken(**kwargs):
        raise ValueError("no kernel for this shape")

    if where == "boundary":
        adapters[1].boundaries[2].prepare = broken
    errors = [None, None]

    def prepare(r):
        try:
            if where == "decode" and r == 1:
                adapters[r].prepare(failed=ValueError("no kernel for this shape"))
            else:
                adapters[r].prepare()
        except RuntimeError as e:
            errors[r] = e

    local.run(prepare)
    for r, e in enumerate(errors):
        assert isinstance(e, RuntimeError), r
        assert "failed on rank(s) [1]" in str(e) and "DraftAllReduce.prepare" in str(e)
    assert errors[0].__cause__ is None
    assert isinstance(errors[1].__cause__, ValueError) and "no kernel" in str(errors[1].__cause__)


@pytest.mark.parametrize("capacity, fused", [(16, [False, True, True, True, True, False]),
                                             (4, [False, True, True, True, False, False])])
def test_takes_decides_on_the_row_count_alone(capacity, fused):
    local = LocalGroup(2)
    _, _, adapter, _ = _rank(DraftModel(small_config(num_layers=1)), local, 0, capacity)
    got = [adapter.takes(torch.empty(m, 2048, dtype=torch.bfloat16)) for m in (0, 1, 2, 4, 16, 17)]
    assert got[:4] == fused[:4] and got[4:] == fused[4:]
    # A strided or FP32 partial decides the same: the rows alone.
    assert adapter.takes(torch.empty(2048, 3).t()) == (capacity >= 3)


@pytest.mark.parametrize("m", [1, 2, 7, 16, 17])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
def test_the_decode_over_the_adapter_is_the_stock_tp2_forward(m, hidden_dtype, caplog):
    model = DraftModel(small_config())
    local = LocalGroup(2, timeout_s=60)
    ranks = [_rank(model, local, r) for r in range(2)]
    hidden = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to(hidden_dtype)
    step = StepInputs.block(3, m)

    def both(r):
        shard, _, _, decode = ranks[r]
        ref_caches, got_caches = shard.make_caches(4), shard.make_caches(4)
        ref = shard(hidden, step, ref_caches)
        got = decode.run(hidden, step, got_caches)
        return ref, got, ref_caches, got_caches

    with caplog.at_level(logging.INFO, logger="dspark.decode"):
        results = local.run(both)
    for r, (ref, got, ref_caches, got_caches) in enumerate(results):
        assert_bitwise(got, ref, f"rank {r} decode vs stock TP2")
        for layer in range(2):
            assert_bitwise(got_caches[layer].tensor, ref_caches[layer].tensor, f"rank {r} cache {layer}")
        _, _, adapter, decode = ranks[r]
        fused_calls = [len(b.calls) for b in adapter.boundaries]
        if m <= 16:
            assert fused_calls == [1, 1, 1, 1] and adapter.mailbox.group.calls == 0
            assert [b.calls[0] for b in adapter.boundaries] == [
                (m, hidden_dtype, True), (m, torch.float32, True), (m, torch.float32, True),
                (m, torch.float32, False)]
        else:  # above the mailbox: NCCL then the unfused boundary, every rank alike
            assert fused_calls == [0, 0, 0, 0] and adapter.mailbox.group.calls == 4
            assert [b.calls for b in decode.boundaries] == [0, 0, 0, 0]  # 17 rows: stock boundary too
    assert_bitwise(results[1][1], results[0][1], "rank 1 vs rank 0")
    if m > 16:
        assert "layer 0's attention boundary ran stock: 17 rows" in caplog.text


def test_the_stock_all_reduce_sums_a_copy():
    local = LocalGroup(2)
    ranks = [_rank(DraftModel(small_config(num_layers=1)), local, r) for r in range(2)]
    parts = [torch.full((2, 2048), float(r + 1), dtype=torch.bfloat16) for r in range(2)]
    outs = local.run(lambda r: ranks[r][2].all_reduce(parts[r]))
    assert all(torch.equal(o, torch.full((2, 2048), 3.0, dtype=torch.bfloat16)) for o in outs)
    assert float(parts[0][0, 0]) == 1.0 and float(parts[1][0, 0]) == 2.0


def test_the_adapter_refuses_what_it_cannot_run():
    local = LocalGroup(2)
    model = DraftModel(small_config(num_layers=1))
    shard = shard_draft(model, 0, 2, all_reduce=local.all_reduce(0))
    mailbox = FakeMailbox(FakeGroup(local, 0), 2048)
    fake = fake_boundary(shard)
    no_kernel = plan_draft(shard, TP2.replace(kernels=TP2.kernels - {policy.ALL_REDUCE_BOUNDARY}))
    with pytest.raises(ValueError, match="keeps the all-reduce stock: the installed backends do not provide "
                                         "the all_reduce_boundary kernel"):
        DraftAllReduce(mailbox, no_kernel, describe(shard), 0, boundary=fake)
    # A shard plans at its own TP size only (the planner refuses the others).
    for tp in (1, 4):
        with pytest.raises(ValueError, match=f"a TP2 shard of the draft cannot be planned for TP{tp}"):
            plan_draft(shard, TP2.replace(tp=tp))
    whole_at_tp4 = plan_draft(DraftModel(small_config(num_layers=1, num_kv_heads=4)), TP2.replace(tp=4))
    with pytest.raises(ValueError, match="a TP4 plan on a mailbox of TP2"):
        DraftAllReduce(mailbox, whole_at_tp4, describe(shard), 0, boundary=fake)
    with pytest.raises(ValueError, match="rank 1 on the mailbox of rank 0"):
        DraftAllReduce(mailbox, plan_draft(shard, TP2), describe(shard), 1, boundary=fake)
    with pytest.raises(ValueError, match="a TP1 shard of the draft for a TP2 plan"):
        DraftAllReduce(mailbox, plan_draft(shard, TP2), describe(model), 0, boundary=fake)
    with pytest.raises(ValueError, match="keeps the whole draft stock"):
        DraftAllReduce(mailbox, plan_draft(shard, TP2.replace(platform="cpu")), describe(shard), 0, boundary=fake)


def test_build_draft_decode_wants_the_all_reduce_of_a_tp_shard():
    local = LocalGroup(2)
    shard = shard_draft(DraftModel(small_config(num_layers=1)), 0, 2, all_reduce=local.all_reduce(0))
    draft = describe(shard)
    with pytest.raises(ValueError, match="a TP2 shard of the draft needs its all-reduce boundaries"):
        build_draft_decode(draft)

    class TP4:
        tp = 4

    with pytest.raises(ValueError, match="TP4 all-reduce boundaries for a TP2 shard"):
        build_draft_decode(draft, all_reduce=TP4())
    adapter = DraftAllReduce(FakeMailbox(FakeGroup(local, 0), 2048), plan_draft(shard, TP2), draft, 0,
                             boundary=fake_boundary(shard), package_gemm=False)
    assert build_draft_decode(draft, all_reduce=adapter, kernels={}) is None  # on a CPU: "not CUDA"


@pytest.mark.parametrize("m", [2, 17])
def test_published_partials_run_on_the_package_gemm_and_are_only_consumed(m):
    """With the plan's package GEMMs bound, each branch GEMM publishes and its
    boundary consumes (the stand-in GEMM computes the stock partial, so the
    result is still the stock TP2 forward's bits); above the mailbox both fall
    back to the stock GEMM and all-reduce."""
    model = DraftModel(small_config())
    local = LocalGroup(2, timeout_s=60)
    ranks = [_rank(model, local, r, gemm=FakeGemm) for r in range(2)]
    hidden = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    step = StepInputs.block(3, m)

    def both(r):
        shard, _, _, decode = ranks[r]
        return shard(hidden, step, shard.make_caches(4)), decode.run(hidden, step, shard.make_caches(4))

    results = local.run(both)
    for r, (ref, got) in enumerate(results):
        assert_bitwise(got, ref, f"rank {r}")
        _, _, adapter, _ = ranks[r]
        shard = ranks[r][0]
        weights = [w for layer in shard.layers for w in (layer.self_attn.o_proj, layer.mlp.down)]
        assert [g.weight for g in adapter.gemms] == weights and all(g.rank == r for g in adapter.gemms)
        if m <= 16:
            assert [g.calls for g in adapter.gemms] == [[m]] * 4
            assert all(b.calls[0][-1] == "published" for b in adapter.boundaries)
        else:
            assert [g.calls for g in adapter.gemms] == [[]] * 4
            assert all(b.calls == [] for b in adapter.boundaries)
        assert adapter.mailbox.published == []
    local.run(lambda r: ranks[r][2].prepare())  # collective
    adapter = ranks[0][2]
    assert [g.prepared for g in adapter.gemms] == [1] * 4
    assert adapter.boundaries[1].prepared == [((torch.float32,), (True,), (False, True))]
    with pytest.raises(ValueError, match="bound to another weight"):
        adapter.project(0, torch.zeros(1, 256, dtype=torch.bfloat16), ranks[0][0].layers[0].mlp.down)


@pytest.mark.parametrize("one_row", [False, True])
def test_one_row_gemv_reaches_every_package_gemm(one_row):
    """``one_row_gemv=True`` builds every package GEMM with it (the opt-in
    one-row GEMV path); by default none is asked for it."""
    model = DraftModel(small_config())
    local = LocalGroup(2)
    shard = shard_draft(model, 0, 2, all_reduce=local.all_reduce(0))
    built = []

    def gemm(constants, weight, mailbox, rank, **kwargs):
        built.append(kwargs)
        return FakeGemm(constants, weight, mailbox, rank)

    DraftAllReduce(FakeMailbox(FakeGroup(local, 0), 2048), plan_draft(shard, TP2), describe(shard), 0,
                   boundary=fake_boundary(shard), gemm=gemm, one_row_gemv=one_row)
    assert built == [{"one_row_gemv": True} if one_row else {}] * 4


class FakeExact:
    """An ``OrderedPackageGemm`` stand-in: ``check`` binds the row counts
    its rank's entry of ``BOUND`` names (a rank's check may find fewer);
    publishing leaves the stock partial in the fake mailbox."""

    BOUND: dict[int, set] = {}

    def __init__(self, role, weight, mailbox):
        self.role, self.weight, self.mailbox = role, weight, mailbox
        self.orders: dict = {}
        self.calls, self.checked = [], None
        self.max_rows = 64

    def check(self, rows):
        self.checked = list(rows)
        self.orders = {m: "order" for m in self.checked if m in self.BOUND[self.mailbox.rank]}

    def run(self, x, publish=True):
        assert publish and x.shape[0] in self.orders
        self.calls.append(x.shape[0])
        self.mailbox.published.append(torch.matmul(x, self.weight.t()))


class NoRows:
    """An ordered GEMM stand-in for QKV and gate_up that binds no row (off CUDA nothing is checked)."""

    def __init__(self, constants, weight):
        self.weight, self.orders = weight, {}

    def prepare(self):
        pass

    def problem(self, x):
        return "no order bound"

    def takes(self, x):
        return False


def test_the_exact_package_gemm_publishes_only_where_every_rank_bound_the_row_count():
    """The ordered GEMM opt-in plans each branch projection on the exact
    package GEMM: ``prepare`` checks 1 .. capacity rows on every rank and
    keeps the row counts every rank bound; those publish and are consumed,
    the others run the stock GEMM, then the fused all-reduce; either way the
    stock TP2 forward's bits."""
    model = DraftModel(small_config())
    local = LocalGroup(2, timeout_s=60)
    FakeExact.BOUND = {0: {1, 2, 4, 8}, 1: {1, 2, 3, 8}}
    target = TP2.replace(kernels=(TP2.kernels | {policy.ORDERED_GEMM}) - {policy.PACKAGE_GEMM})
    ranks = []
    for r in range(2):
        shard = shard_draft(model, r, 2, all_reduce=local.all_reduce(r))
        draft = describe(shard)
        plan = plan_description(draft, target)
        assert all(isinstance(p.constants, K.OrderedGemmConstants) for p in plan.package_gemms), plan.format()
        mailbox = FakeMailbox(FakeGroup(local, r), 2048, capacity=8)
        adapter = DraftAllReduce(mailbox, plan, draft, r, boundary=fake_boundary(shard), exact=FakeExact,
                                 package_gemm=False)
        ranks.append((shard, adapter, DraftDecode(draft, plan, adapter, kernels={
            policy.BOUNDARY: FakeUnfused, policy.ORDERED_GEMM: NoRows})))
    for _, _, decode in ranks:
        decode.prepare()
    local.run(lambda r: ranks[r][1].prepare())  # collective, as build_draft_decode calls it
    for _, adapter, decode in ranks:
        by_alpha = {id(b.connection.alpha): b for b in decode.draft.boundaries()}
        for fused in decode.boundaries:
            fused.bound = by_alpha[id(fused.alpha)]
        assert adapter.exact == {0, 1, 2, 3}
        assert [g.role for g in adapter.gemms] == ["o_proj", "down"] * 2
        assert all(g.checked == list(range(1, 9)) for g in adapter.gemms)
        assert adapter.exact_rows == [frozenset({1, 2, 8})] * 4
    for m in (2, 3, 9):
        hidden = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        step = StepInputs.block(3, m)

        def both(r, hidden=hidden, step=step):
            shard, _, decode = ranks[r]
            return shard(hidden, step, shard.make_caches(4)), decode.run(hidden, step, shard.make_caches(4))

        for r, (ref, got) in enumerate(local.run(both)):
            assert_bitwise(got, ref, f"rank {r}, m = {m}")
            adapter = ranks[r][1]
            assert [g.calls.count(m) for g in adapter.gemms] == [1 if m in (1, 2, 8) else 0] * 4
            assert adapter.mailbox.published == []
