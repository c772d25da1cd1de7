"""CPU tests of ``dspark_vllm.allreduce``: the thresholds against the
installed vLLM 0.33.0's (and FlashInfer 0.7.2.post1's) own tables and gates,
the decision table one row per case, the plan it gives, the refusals, and
``MailboxBoundaries`` over a gloo group of 2 and 4 CPU processes (the
ranks' agreement, the row count deciding, the fallback to vLLM's all-reduce,
the package GEMM opt-in), with stand-ins for the mailbox and its kernels."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import multiprocessing
import types

import pytest
import torch

pytest.importorskip("vllm")

from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER  # noqa: E402
from dspark_vllm import allreduce as ar  # noqa: E402
from dspark_vllm.allreduce import Switches, Topology  # noqa: E402

H = 8192
HGX = Topology(multicast=True, fully_connected=True)  # an NVSwitch node
NO_MC = Topology(multicast=False, fully_connected=True)  # NVLink everywhere, no multicast


# ---------------------------------------------------------------- vLLM's own tables and gates


def _module_constant(module: str, name: str):
    """A literal module-level constant of an installed module, read from its
    source (the module itself does not import on vLLM's CPU platform)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin).read())
    for node in tree.body:
        target = getattr(node, "target", None) or (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name:
            return ast.literal_eval(node.value)
    raise LookupError(f"{module} has no constant {name}")


def test_thresholds_are_the_installed_vllms():
    from flashinfer.comm import trtllm_ar
    from vllm.distributed.device_communicators import all_reduce_utils as utils
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce
    from vllm.distributed.device_communicators.symm_mem import SymmMemCommunicator

    fi_max_mb = _module_constant("vllm.compilation.passes.fusion.allreduce_rms_fusion",
                                 "FI_ALLREDUCE_FUSION_MAX_SIZE_MB")
    for cap, key in (("9.0", 90), ("10.0", 100)):
        assert ar.FI_MAX_MB[cap] == fi_max_mb[key]
        assert ar.CUSTOM_SYMM_MAX[cap] == {tp: utils.CUSTOM_ALL_REDUCE_MAX_SIZES[cap][tp] for tp in (2, 4, 8)}
        assert ar.SYMM_MAX[cap] == {tp: utils.SYMM_MEM_ALL_REDUCE_MAX_SIZES[cap][tp] for tp in (2, 4, 8)}
        assert ar.SYMM_MULTIMEM[cap] == tuple(SymmMemCommunicator._WORLD_SIZES_MULTIMEM[cap])
    one_node = {(f"{c // 10}.{c % 10}", tp): mb for (c, tp, nodes), mb in utils.FI_MNNVL_ALLREDUCE_MAX_SIZE_MB.items()
                if nodes == 1 and f"{c // 10}.{c % 10}" in ar.CAPABILITY.values()}
    assert ar.FI_MNNVL_TUNED_MB == one_node
    config = utils.NCCL_SYMM_MEM_ALL_REDUCE_CONFIG
    assert ar.NCCL_SYMM_MIN_TP == config["min_world_size"] and config["always_use_above_world_size"] == 8
    assert ar.NCCL_SYMM_PREFERRED == config["custom_ar_preferred_ranges"]
    assert tuple(CustomAllreduce._SUPPORTED_WORLD_SIZES) == ar.CUSTOM_TPS
    assert inspect.signature(CustomAllreduce.__init__).parameters["max_size"].default == ar.CUSTOM_MAX_BYTES
    assert trtllm_ar._use_oneshot_heuristics == ar.TRTLLM_ONESHOT_MB


def test_switch_defaults_are_vllms(monkeypatch):
    import vllm.envs as envs

    names = ("VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_FLASHINFER_ALLREDUCE_BACKEND", "VLLM_ALLREDUCE_USE_SYMM_MEM",
             "VLLM_USE_NCCL_SYMM_MEM", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", "VLLM_BATCH_INVARIANT")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    sw = ar.switches({})
    got = [envs.environment_variables[n]() for n in names]
    assert got == [sw.flashinfer, sw.fi_backend, sw.symm_mem, sw.nccl_symm_mem, sw.fi_pcie_ipc, sw.batch_invariant]
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER", "0")
    assert envs.environment_variables["VLLM_ALLREDUCE_USE_FLASHINFER"]() is ar.switches().flashinfer is False


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("symm", [False, True])
def test_custom_gate_is_vllms(tp, symm):
    """``CustomAllreduce.should_custom_ar`` itself (on a stand-in instance
    with the max size vLLM gives it) against the table's custom verdict, at
    sizes around every threshold."""
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    max_size = min(ar.CUSTOM_SYMM_MAX["9.0"][tp], ar.CUSTOM_MAX_BYTES) if symm else ar.CUSTOM_MAX_BYTES
    comm = types.SimpleNamespace(disabled=False, world_size=tp, fully_connected=True, max_size=max_size,
                                 batch_invariant=False)
    sw = Switches(flashinfer=False, symm_mem=symm)
    for rows in (1, 15, 16, 17, 31, 32, 33, 511, 512, 513):
        x = torch.empty(rows, H, dtype=torch.bfloat16)
        theirs = CustomAllreduce.should_custom_ar(comm, x)
        mine = ar._custom(tp, x.nbytes, "9.0", sw, False, symm, True)
        assert theirs == (mine is not None), (rows, theirs, mine)


@pytest.mark.parametrize("tp", [4, 8])
def test_nccl_symmetric_memory_gate_is_vllms(tp, monkeypatch):
    from vllm.distributed.device_communicators.all_reduce_utils import should_nccl_symm_mem_allreduce

    monkeypatch.setenv("VLLM_USE_NCCL_SYMM_MEM", "1")
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER", "0")  # FlashInfer, where it takes a message, comes first
    sw = ar.switches()
    for rows in (1, 2, 3, 7, 8, 9, 31, 32, 33):
        x = torch.empty(rows, 2048, dtype=torch.bfloat16)
        theirs = should_nccl_symm_mem_allreduce(tp, x)
        mine = ar.resolve(tp, rows, 2048, "sm_90a", sw, False, HGX)
        assert theirs == (mine.backend == "nccl_symm_mem"), (rows, mine.backend)
        if not theirs:
            assert mine.backend == "custom", rows  # the custom all-reduce's range


# ---------------------------------------------------------------- the decision table, one row per case

FI_OFF = {"VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
ONE_STAGE = {**FI_OFF, "VLLM_CUSTOM_ALLREDUCE_ALGO": "1stage"}
NO_SYMM = {**ONE_STAGE, "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
TRTLLM = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}
MNNVL = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "mnnvl"}

# (id, tp, arch, env, disable_custom, topology, backend, kernel, sum_order, positive_zero, rows fused of 16)
TABLE = [
    ("tp2-default", 2, "sm_90a", {}, False, Topology(), "flashinfer", "mnnvl", FP32_RANK_ORDER, True, 16),
    ("tp2-default-no-multicast", 2, "sm_90a", {}, False, NO_MC, "flashinfer", "trtllm one-shot",
     FP32_RANK_ORDER, True, 16),
    ("tp2-sm100", 2, "sm_100a", {}, False, HGX, "flashinfer", "mnnvl", FP32_RANK_ORDER, True, 16),
    ("tp2-custom", 2, "sm_90a", FI_OFF, False, Topology(), "custom", "one-stage", FP32_RANK_ORDER, False, 16),
    ("tp2-custom-two-stage", 2, "sm_90a", {**FI_OFF, "VLLM_CUSTOM_ALLREDUCE_ALGO": "twoshot"}, False, Topology(),
     "custom", "two-stage", FP32_RANK_ORDER, False, 16),
    ("tp2-nccl", 2, "sm_90a", FI_OFF, True, NO_MC, "nccl", "", FP32_RANK_ORDER, False, 16),
    ("tp2-nccl-or-symm-two-shot", 2, "sm_90a", FI_OFF, True, Topology(), "unknown", "", None, False, 0),
    ("tp4-default-unknown", 4, "sm_90a", {}, False, Topology(), "unknown", "", None, False, 0),
    ("tp4-default-hgx", 4, "sm_90a", {}, False, HGX, "flashinfer", "mnnvl", FP32_RANK_ORDER, True, 16),
    ("tp4-default-no-multicast", 4, "sm_90a", {}, False, NO_MC, "flashinfer", "trtllm one-shot",
     BF16_RANK_ORDER, True, 16),
    ("tp4-trtllm", 4, "sm_90a", TRTLLM, False, Topology(), "flashinfer", "trtllm one-shot", BF16_RANK_ORDER, True, 16),
    ("tp4-mnnvl-no-multicast", 4, "sm_90a", MNNVL, False, Topology(False, True), "custom", "one-stage",
     FP32_RANK_ORDER, False, 16),
    ("tp4-custom", 4, "sm_90a", FI_OFF, False, HGX, "custom", "one-stage", FP32_RANK_ORDER, False, 16),
    ("tp4-custom-two-stage", 4, "sm_90a", {**FI_OFF, "VLLM_CUSTOM_ALLREDUCE_ALGO": "2stage"}, False, HGX,
     "custom", "two-stage", None, False, 0),
    ("tp4-pcie", 4, "sm_90a", FI_OFF, False, Topology(True, False), "torch_symm_mem", "multimem", None, False, 0),
    ("tp4-nccl", 4, "sm_90a", FI_OFF, True, NO_MC, "nccl", "", None, False, 0),
    ("tp4-nccl-symm", 4, "sm_90a", {**FI_OFF, "VLLM_USE_NCCL_SYMM_MEM": "1"}, False, HGX, "nccl_symm_mem", "",
     None, False, 0),
    ("tp4-sm100-hgx", 4, "sm_100a", {}, False, HGX, "flashinfer", "mnnvl", FP32_RANK_ORDER, True, 16),
    ("tp8-default-hgx", 8, "sm_90a", {}, False, HGX, "flashinfer", "mnnvl", FP32_RANK_ORDER, True, 16),
    ("tp8-trtllm", 8, "sm_90a", TRTLLM, False, HGX, "flashinfer", "trtllm one-shot", BF16_RANK_ORDER, True, 16),
    ("tp8-custom", 8, "sm_90a", FI_OFF, False, HGX, "custom", "one-stage", FP32_RANK_ORDER, False, 15),
    ("tp8-custom-1stage", 8, "sm_90a", ONE_STAGE, False, HGX, "custom", "one-stage", FP32_RANK_ORDER, False, 15),
    ("tp8-custom-1stage-no-symm", 8, "sm_90a", NO_SYMM, False, HGX, "custom", "one-stage", FP32_RANK_ORDER,
     False, 16),
    ("tp8-sm100-custom", 8, "sm_100a", FI_OFF, False, HGX, "custom", "one-stage", FP32_RANK_ORDER, False, 15),
    ("batch-invariant", 2, "sm_90a", {"VLLM_BATCH_INVARIANT": "1"}, False, HGX, "refused", "", None, False, 0),
    ("pcie-ipc", 2, "sm_90a", {**FI_OFF, "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "1"}, False, HGX,
     "flashinfer_pcie_ipc", "", None, False, 0),
    ("no-gpu", 2, None, {}, False, HGX, "none", "", None, False, 0),
    ("tp1", 1, "sm_90a", {}, False, HGX, "none", "", FP32_RANK_ORDER, False, 0),
]


@pytest.mark.parametrize("row", TABLE, ids=[r[0] for r in TABLE])
def test_decision_table(row):
    _, tp, arch, env, disable, topology, backend, kernel, order, zero, rows = row
    got = ar.stock_all_reduce(tp, arch, disable, env=env, hidden_size=H, topology=topology)
    assert (got.backend, got.kernel, got.sum_order, got.positive_zero, got.rows) == (
        backend, kernel, order, zero, rows), got.why
    assert got.why
    if order is not None and tp > 1:
        assert got.why.startswith(f"vLLM's all-reduce at TP{tp} is") and got.describe().endswith(f"1-{rows} rows")
    if rows and rows < 16:
        assert f"steps of {rows + 1} rows and more take vLLM's all-reduce" in got.why


def test_tp8_sixteen_rows_go_elsewhere_and_why():
    """The row that ends TP8's fused rows (16 rows of 8192 = 256 KiB): the
    torch symmetric memory with multicast, the two-stage kernel without."""
    sw = ar.switches(FI_OFF)
    assert ar.resolve(8, 16, H, "sm_90a", sw, False, HGX).kernel == "multimem"
    two = ar.resolve(8, 16, H, "sm_90a", sw, False, NO_MC)
    assert two.kernel == "two-stage" and two.sum_order is None and "starting from that rank" in two.why
    assert ar.resolve(8, 15, H, "sm_90a", sw, False, NO_MC).kernel == "one-stage"


def test_trtllm_one_shot_limit_is_flashinfers():
    """Where FlashInfer's trtllm all-reduce leaves its one-shot (Lamport,
    +0.0) kernel for the two-shot one (the sign of zero kept): its own
    ``_should_use_oneshot`` decides the same."""
    from flashinfer.comm.trtllm_ar import _should_use_oneshot

    sw = ar.switches({**TRTLLM})
    for tp, hidden in ((2, 8192), (4, 4096), (8, 2048)):
        for rows in (1, 64, 127, 128, 129, 168, 169, 512, 1024):
            r = ar.resolve(tp, rows, hidden, "sm_100a", sw, False, HGX)
            if r.backend != "flashinfer":
                continue
            assert (r.kernel == "trtllm one-shot") == _should_use_oneshot(rows, hidden, torch.bfloat16, tp), (tp, rows)
            assert r.positive_zero == (r.kernel == "trtllm one-shot")


def test_unknown_facts_are_named():
    r = ar.resolve(4, 1, H, "sm_90a", ar.switches({}), False, Topology())
    assert r.sum_order is None and "multicast" in r.why and "FlashInfer's mnnvl" in r.why and "trtllm" in r.why
    # A fact both answers share does not matter: TP2 over either FlashInfer backend.
    assert ar.resolve(2, 1, H, "sm_90a", ar.switches({}), False, Topology()).sums == (FP32_RANK_ORDER, True)


def test_order_for_another_hidden_size():
    order = ar.stock_all_reduce(8, "sm_90a", env=FI_OFF, topology=HGX)
    assert order.hidden_size is None and order.rows == 15  # the reference width, 8192
    assert order.for_hidden(4096).rows == 16 and order.for_hidden(4096).hidden_size == 4096
    assert order.for_hidden(16384).rows == 7  # 8 rows of 16384 are 256 KiB


@pytest.mark.parametrize("env,match", [
    ({"VLLM_ALLREDUCE_USE_FLASHINFER": "yes"}, "VLLM_ALLREDUCE_USE_FLASHINFER must be an integer"),
    ({"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "nccl"}, "VLLM_FLASHINFER_ALLREDUCE_BACKEND must be one of"),
    ({"VLLM_CUSTOM_ALLREDUCE_ALGO": "3stage"}, "VLLM_CUSTOM_ALLREDUCE_ALGO must be one of"),
])
def test_bad_switches_refused(env, match):
    with pytest.raises(ValueError, match=match):
        ar.stock_all_reduce(2, "sm_90a", env=env, hidden_size=H, topology=HGX)


@pytest.mark.parametrize("args, error, match", [
    ((0, 1, H), ValueError, "the TP size must be an int from 1 to 1024, not 0"),
    ((10**6, 1, H), ValueError, "the TP size must be an int from 1 to 1024, not 1000000"),
    ((2.0, 1, H), TypeError, "the TP size must be an int, not float 2.0"),
    ((True, 1, H), TypeError, "the TP size must be an int, not bool True"),
    ((2, 0, H), ValueError, "the row count must be an int from 1 to"),
    ((2, -5, H), ValueError, "the row count must be an int from 1 to"),
    ((2, 1, 0), ValueError, "the hidden size must be an int from 1 to"),
])
def test_resolve_refuses(args, error, match):
    with pytest.raises(error, match=match):
        ar.resolve(*args, "sm_90a", ar.switches({}))


def test_the_decision_table_refuses_what_it_cannot_answer_where_it_enters():
    """Unknown backend names in the switches, decode row counts beyond the
    mailbox's (ten million once looped for a minute), an architecture in
    another case (the same answer); and TP16 on sm_100a, where FlashInfer's
    trtllm one-shot table has no 16 (a bare KeyError once): no mailbox order."""
    with pytest.raises(ValueError, match="Switches.fi_backend must be one of auto, trtllm, mnnvl, not str 'nccl'"):
        ar.Switches(fi_backend="nccl")
    with pytest.raises(ValueError, match="Switches.custom_algo must be None or one of one-stage, two-stage"):
        ar.Switches(custom_algo="3stage")
    with pytest.raises(TypeError, match="Switches.flashinfer must be True or False, not int 1"):
        ar.Switches(flashinfer=1)
    with pytest.raises(ValueError, match=r"max_rows \(the decode rows the mailbox takes\) must be an int from 1 to 16"):
        ar.decode_order(2, "sm_90a", H, 10**7, ar.switches({}), topology=HGX)
    assert ar.resolve(4, 1, H, "SM_90A", ar.switches({}), False, HGX) == ar.resolve(4, 1, H, "sm_90a",
                                                                                     ar.switches({}), False, HGX)
    r = ar.resolve(16, 1, H, "sm_100a", ar.switches(TRTLLM), False, HGX)
    assert r.sum_order is None and "has no threshold for 16 ranks" in r.why


def test_package_gemm_opt_in():
    cfg = types.SimpleNamespace(additional_config={"package_gemm": True})
    assert ar.package_gemm_asked(cfg) is True
    assert ar.package_gemm_asked(types.SimpleNamespace(additional_config=None)) is False
    with pytest.raises(TypeError, match="package_gemm'] must be true or false, not 'yes'"):
        ar.package_gemm_asked(types.SimpleNamespace(additional_config={"package_gemm": "yes"}))


# ---------------------------------------------------------------- the plan


def _tp_draft(tp: int):
    from dspark_core.reference.adapter import describe
    from dspark_core.reference.config import small_config
    from dspark_core.reference.model import DraftModel
    from dspark_core.reference.tp import shard_draft

    torch.manual_seed(0)
    model = DraftModel(small_config(num_kv_heads=4))
    return describe(shard_draft(model, 0, tp, all_reduce=lambda t: t))


def _plan(draft, order):
    from dspark_core.planner import policy
    from dspark_vllm import planning

    target = policy.Target(kernels=policy.ALL_KERNELS, tp=draft.tp).opt_in(frozenset())
    return planning.plan_vllm(draft, target, order, policy.ALL_KERNELS)


def test_plan_names_the_stock_it_reproduces():
    draft = _tp_draft(4)
    plan = _plan(draft, ar.stock_all_reduce(4, "sm_90a", env=TRTLLM, topology=HGX))
    part = plan.all_reduce
    assert part.fused and part.constants.sum_order == BF16_RANK_ORDER
    assert "vLLM's flashinfer trtllm one-shot all-reduce" in part.name and "-0.0 sum as +0.0" in part.name
    assert "1-16 rows" in part.name  # 2048 columns: every decode step fits the one-shot kernel
    stock = _plan(draft, ar.stock_all_reduce(4, "sm_90a", env={}, topology=Topology()))
    assert not stock.all_reduce.fused and "depends on the GPUs' multicast" in stock.all_reduce.reason
    assert all(not p.fused for p in stock.package_gemms)


# ---------------------------------------------------------------- the binding over gloo


class _Mailbox:
    def __init__(self, group, hidden: int, capacity: int) -> None:
        from dspark_comm.protocol import MailboxLayout

        self.group, self.rank, self.device = group, group.rank, group.device
        self.layout = MailboxLayout(group.size, hidden, capacity)


class _Boundary:
    """A stand-in for AllReduceBoundary that records how it was bound."""

    made: list = []

    def __init__(self, mailbox, constants, alpha, beta, post, pre, sum_order, positive_zero=False):
        self.sum_order, self.positive_zero = sum_order, positive_zero
        _Boundary.made.append(self)


def _linear(weight):
    return types.SimpleNamespace(weight=weight, quant_method=types.SimpleNamespace(
        apply=lambda layer, x, bias: x @ layer.weight.T))


def _rank(rank: int, tp: int, port: int, env: dict, queue) -> None:
    import torch.distributed as dist

    from dspark_comm.runtime.group import TorchGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        group = TorchGroup(device="cpu")
        draft = _tp_draft(tp)
        order = ar.stock_all_reduce(tp, "sm_90a", env=env.get(rank, env.get("all", {})), hidden_size=2048,
                                    topology=HGX)
        plan = _plan(draft, order)
        reduced = []
        layers = [types.SimpleNamespace(self_attn=types.SimpleNamespace(o_proj=_linear(lay.attention.o_proj_weight)),
                                        feed_forward=types.SimpleNamespace(down_proj=_linear(lay.mlp.down_weight)))
                  for lay in draft.layers]
        try:
            binding = ar.MailboxBoundaries(types.SimpleNamespace(layers=layers), draft, plan, order, group=group,
                                           mailbox=_Mailbox(group, draft.hidden_size, max(order.rows, 1)),
                                           reduce=lambda t: reduced.append(t.shape[0]) or t * tp, boundary=_Boundary,
                                           branch_gemm=lambda linear, x: linear.quant_method.apply(linear, x, None))
        except ValueError as e:
            queue.put((rank, "refused", str(e)))
            return
        binding.check_backend = lambda: True  # FlashInfer's workspace check (its own test) would import vLLM here
        takes = [binding.takes(torch.empty(m, 2048, dtype=torch.bfloat16)) for m in range(1, 21)]
        x = torch.randn(3, draft.layers[0].attention.o_proj_weight.shape[1]).to(torch.bfloat16)
        projected, published = binding.project(0, x, draft.layers[0].attention.o_proj_weight)
        out = binding.all_reduce(torch.ones(17, 2048, dtype=torch.bfloat16))
        queue.put((rank, "bound", (takes, order.rows, [(b.sum_order, b.positive_zero) for b in _Boundary.made],
                                   projected.shape, published, reduced, float(out[0, 0]))))
    finally:
        dist.destroy_process_group()


def _run(tp: int, env: dict) -> dict:
    from dspark_vllm.plan import _free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, tp, port, env, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    results = dict((r, (kind, value)) for r, kind, value in (queue.get(timeout=400) for _ in range(tp)))
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert codes == [0] * tp, codes
    return results


@pytest.mark.parametrize("tp,env,order,zero", [
    (2, {"all": {}}, FP32_RANK_ORDER, True),
    (4, {"all": TRTLLM}, BF16_RANK_ORDER, True),
])
def test_binding_agrees_over_gloo(tp, env, order, zero):
    """Every rank binds a mailbox of the order's rows, each boundary in the
    plan's order and zero sign; the row count alone decides (1-16 fused);
    the branch GEMM is the RowParallelLinear's; the calls it does not take
    go to vLLM's all-reduce (the stand-in)."""
    results = _run(tp, env)
    assert set(results) == set(range(tp))
    for kind, (takes, rows, made, shape, published, reduced, first) in results.values():
        assert kind == "bound" and rows == 16
        assert takes == [m <= 16 for m in range(1, 21)]
        assert made and all(m == (order, zero) for m in made) and len(made) == 4  # two layers, two boundaries
        assert tuple(shape) == (3, 2048) and published is False
        assert reduced == [17] and first == tp


def test_binding_refuses_where_the_ranks_disagree():
    """Rank 1 resolves another all-reduce (its environment pins trtllm):
    every rank refuses, naming what each resolved."""
    results = _run(2, {0: FI_OFF, 1: TRTLLM})
    assert all(kind == "refused" and "the TP ranks resolved different all-reduces" in msg
               for kind, msg in results.values()), results


def test_binding_refuses_an_order_it_does_not_reproduce():
    draft = _tp_draft(4)
    order = ar.stock_all_reduce(4, "sm_90a", env={}, topology=Topology(), hidden_size=2048)
    with pytest.raises(ValueError, match="no mailbox for an all-reduce it does not reproduce"):
        ar.MailboxBoundaries(types.SimpleNamespace(layers=[]), draft, _plan(draft, order), order, branch_gemm=None)
    fused = ar.stock_all_reduce(4, "sm_90a", env=TRTLLM, topology=HGX, hidden_size=2048)
    other = ar.stock_all_reduce(4, "sm_90a", env=FI_OFF, topology=HGX, hidden_size=2048)
    with pytest.raises(ValueError, match="is not the fused fp32_rank_order of the order"):
        ar.MailboxBoundaries(types.SimpleNamespace(layers=[]), draft, _plan(draft, fused), other, branch_gemm=None)


def test_boundaries_are_stock_where_the_plan_is():
    """``runtime.all_reduce_boundaries``: vLLM's all-reduce and the unfused
    boundary (``runtime.StockAllReduce``) where the plan keeps the all-reduce
    stock."""
    from dspark_vllm.runtime import StockAllReduce, all_reduce_boundaries

    draft = _tp_draft(4)
    order = ar.stock_all_reduce(4, "sm_90a", env={}, topology=Topology(), hidden_size=2048)
    layers = [types.SimpleNamespace(self_attn=types.SimpleNamespace(o_proj=None),
                                    feed_forward=types.SimpleNamespace(down_proj=None))]
    got = all_reduce_boundaries(types.SimpleNamespace(layers=layers), draft, _plan(draft, order), order)
    assert isinstance(got, StockAllReduce) and not got.takes(torch.empty(1, 2048))



class _OneProcessGroup:
    """A TP group of ``size`` ranks seen from rank 0 in one process (every rank sends the same)."""

    def __init__(self, size: int) -> None:
        self.rank, self.size, self.device = 0, size, torch.device("cpu")

    def all_gather_object(self, obj) -> list:
        return [obj] * self.size


class _Gemm:
    def __init__(self, constants, weight, mailbox, rank, **extra):
        self.weight, self.published = weight, []

    def run(self, x, publish=False):
        self.published.append((x.shape[0], publish))


def test_package_gemm_offered_as_in_the_standalone_decode():
    """``vllm_target(package_gemm=True)`` plans the package GEMMs where the
    all-reduce fuses; the binding then publishes through them for the rows
    the mailbox takes and runs the RowParallelLinear's GEMM above them."""
    from dspark_core.planner import policy
    from dspark_vllm import planning

    draft = _tp_draft(2)
    order = ar.stock_all_reduce(2, "sm_90a", env=FI_OFF, hidden_size=2048, topology=HGX)
    def target(**asked):  # an H200's target as the CPU plans it (vllm_target's platform is this machine's)
        return planning.vllm_target(torch.device("cpu"), 2, policy.ALL_KERNELS, **asked).replace(platform="cuda")

    plan = planning.plan_vllm(draft, target(package_gemm=True), order, policy.ALL_KERNELS)
    assert plan.all_reduce.fused and plan.package_gemms and all(p.fused for p in plan.package_gemms)
    declined = planning.plan_vllm(draft, target(), order, policy.ALL_KERNELS)
    assert all(p.declined for p in declined.package_gemms)
    group = _OneProcessGroup(2)
    weight = draft.layers[0].attention.o_proj_weight
    layers = [types.SimpleNamespace(self_attn=types.SimpleNamespace(o_proj=_linear(lay.attention.o_proj_weight)),
                                    feed_forward=types.SimpleNamespace(down_proj=_linear(lay.mlp.down_weight)))
              for lay in draft.layers]
    binding = ar.MailboxBoundaries(types.SimpleNamespace(layers=layers), draft, plan, order, package_gemm=True,
                                   group=group, mailbox=_Mailbox(group, 2048, order.rows), reduce=lambda t: t,
                                   branch_gemm=lambda linear, x: linear.quant_method.apply(linear, x, None),
                                   boundary=_Boundary, gemm=_Gemm)
    x = torch.zeros(4, weight.shape[1], dtype=torch.bfloat16)
    assert binding.project(0, x, weight) == (None, True)
    assert binding.inner.gemms[0].published == [(4, True)]
    big = torch.zeros(order.rows + 1, weight.shape[1], dtype=torch.bfloat16)
    out, published = binding.project(0, big, weight)
    assert published is False and tuple(out.shape) == (order.rows + 1, 2048)
    assert binding.inner.gemms[0].published == [(4, True)]  # nothing published for the stock call


def test_live_topology_reads_vllms_communicator(monkeypatch):
    """Multicast where vLLM's torch symmetric memory came up, full
    connectivity as its custom all-reduce found it; unknown where either is
    off, and outside a TP group of that size."""
    import vllm.distributed as distributed
    from vllm.distributed import parallel_state

    def comm(symm, ca):
        return types.SimpleNamespace(world_size=4, device_communicator=types.SimpleNamespace(
            symm_mem_comm=symm, ca_comm=ca))

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    up = types.SimpleNamespace(disabled=False, fully_connected=True)
    cases = [(comm(types.SimpleNamespace(disabled=False), up), Topology(True, True)),
             (comm(types.SimpleNamespace(disabled=True), types.SimpleNamespace(disabled=True)), Topology(False, None)),
             (comm(None, None), Topology())]
    for group, expected in cases:
        monkeypatch.setattr(distributed, "get_tp_group", lambda group=group: group)
        assert ar.live_topology(4) == expected
    assert ar.live_topology(8) == Topology()  # a group of another size


def test_check_refuses_a_flashinfer_workspace_of_another_backend(monkeypatch):
    from vllm.distributed.device_communicators import flashinfer_all_reduce as fi

    order = ar.stock_all_reduce(4, "sm_90a", env={}, topology=HGX, hidden_size=2048)  # mnnvl
    checked = []
    binding = object.__new__(ar.MailboxBoundaries)
    binding.order, binding.mailbox = order, types.SimpleNamespace(check=lambda: checked.append(1))
    binding.inner = types.SimpleNamespace(takes=lambda partial: True)
    binding._backend_known = False
    monkeypatch.setattr(fi, "_fi_ar_workspace", None)
    binding.check()  # no workspace yet: nothing to compare
    assert binding.takes(torch.empty(1, 2048)) and binding._backend_known is False
    monkeypatch.setattr(fi, "_fi_ar_workspace", types.SimpleNamespace(backend="mnnvl"))
    binding.check()
    monkeypatch.setattr(fi, "_fi_ar_workspace", types.SimpleNamespace(backend="trtllm"))
    with pytest.raises(RuntimeError, match="VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm"):
        binding.check()
    with pytest.raises(RuntimeError, match="but vLLM created its trtllm workspace"):
        binding.takes(torch.empty(1, 2048))  # the first call after the workspace exists
    monkeypatch.setattr(fi, "_fi_ar_workspace", types.SimpleNamespace(backend="mnnvl"))
    assert binding.takes(torch.empty(1, 2048)) and binding._backend_known is True
    assert checked == [1, 1, 1]
    # At TP2 the trtllm one-shot kernel sums as mnnvl does: no refusal.
    binding.order = ar.stock_all_reduce(2, "sm_90a", env={}, topology=Topology(), hidden_size=2048)
    monkeypatch.setattr(fi, "_fi_ar_workspace", types.SimpleNamespace(backend="trtllm"))
    assert binding.order.kernel == "mnnvl" and binding.check_backend()
    monkeypatch.setattr(fi, "_fi_ar_workspace", None)
    monkeypatch.setattr(fi, "_fi_ar_workspace_failed", True)
    with pytest.raises(RuntimeError, match="could not create FlashInfer's workspace"):
        binding.check_backend()
