"""The kernels' ``torch.library`` custom ops (``dspark_cute.runtime.ops``), on
a CPU: every launch of a host class is one op whose schema marks the
tensors it writes; the fakes propagate; torch.compile traces a launch into
one opaque node without a graph break; the eager path never goes through the
dispatcher; a handle without a live host raises. (That each op's CUDA
implementation gives the direct launch's bits is ``test_gpu_ops.py``.)"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

from dspark_core.contracts.constants import AttentionConstants, MlpActivationConstants, OGateConstants
from dspark_cute import _provides
from dspark_cute.runtime import ops

# Every op: its arguments after the handle, and which of them it writes.
OPS = {
    "row_norm": (["x", "out"], {"out"}),
    "context_norms": (["x", "out"], {"out"}),
    "boundary": (["branch", "stream", "store_stream", "out", "new_stream"], {"out", "new_stream"}),
    "context_store": (["kv", "positions", "caches", "slots"], {"caches"}),
    "qkv_epilogue": (["qkv", "positions", "slots", "cache"], {"qkv", "cache"}),
    "qkv_front": (["x", "positions", "slots", "cache", "out"], {"cache", "out"}),
    "attention": (["q", "cache", "attn_slots", "out", "gate"], {"out"}),
    "o_gate": (["attn", "gate", "out"], {"out"}),
    "mlp_activation": (["gu", "out"], {"out"}),
    "gemv": (["x", "out"], {"out"}),
}
# Host classes without an op of their own: the chain is two ops around a
# torch.bmm; the prefetch writes nothing a graph could keep.
COMPOSITE = {"context_chain", "weight_prefetch"}


def _host_classes():
    for name, target in _provides.KERNELS.items():
        module, cls = target.split(":")
        yield name, getattr(importlib.import_module(module), cls)


def test_every_kernel_has_its_op():
    hosts = dict(_host_classes())
    for name, cls in hosts.items():
        if name in COMPOSITE:
            assert not hasattr(cls, "OP"), name
            continue
        assert cls.OP in ops.defined(), name
        assert callable(getattr(cls, "_launch_kernel", None)), name
    # ContextKvStore and ContextNorms are the chain's two ops.
    from dspark_cute.cutedsl.context.store import ContextKvStore
    from dspark_cute.cutedsl.norms.context_norms import ContextNorms

    assert (ContextNorms.OP, ContextKvStore.OP) == ("context_norms", "context_store")
    assert set(OPS) <= set(ops.defined())  # (dspark-comm's ops too where it is imported)


@pytest.mark.parametrize("name", sorted(OPS))
def test_schemas_mark_what_each_op_writes(name):
    schema = ops.op(name).default._schema
    args = schema.arguments
    assert args[0].name == "handle" and str(args[0].type) == "str"
    names, writes = OPS[name]
    assert [a.name for a in args[1:]] == names
    written = {a.name for a in args if a.alias_info is not None and a.alias_info.is_write}
    assert written == writes
    assert len(schema.returns) == 0
    # The CUDA implementation and the fake (Meta) are registered, nothing for the CPU.
    qualified = f"dspark::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Meta")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")


def test_define_refuses_a_changed_schema_and_a_bad_one():
    schema = ops.defined()["gemv"]
    assert ops.define("gemv", schema) == "gemv"  # a module reloaded: no-op
    with pytest.raises(ValueError, match="is defined as"):
        ops.define("gemv", "(str handle, Tensor x) -> ()")
    with pytest.raises(ValueError, match="handle first"):
        ops.define("not_an_op", "(Tensor x, Tensor(a!) out) -> ()")


def test_fakes_write_nothing_on_fake_cuda_tensors():
    with FakeTensorMode():
        gu = torch.empty(3, 2 * 256, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
        assert ops.op("mlp_activation")("MlpActivation:x", gu, out) is None
        cache = torch.empty(4, 8, 16, 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(2, 3, 2 * 8 * 64, dtype=torch.bfloat16, device="cuda")
        slots = torch.empty(3, dtype=torch.int64, device="cuda")
        assert ops.op("context_store")("ContextKvStore:x", kv, None, [cache, cache], [slots, None]) is None


def _hosts():
    from dspark_cute import MlpActivation, OGate, PagedAttention

    act = MlpActivation(MlpActivationConstants(256), pdl=False)
    gate = OGate(OGateConstants(4, 1e-6), pdl=False)
    attn = PagedAttention(AttentionConstants(8, 2, 64, 16, "int64"), pdl=False)
    return act, gate, attn


class _Traced(Exception):
    pass


def test_torch_compile_sees_one_opaque_op_per_launch():
    act, gate, attn = _hosts()
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)

        def never(*args):
            raise _Traced()

        return never

    def step(gu, g, q, cache, slots):
        a = act.launch(gu)  # [m, 256]
        o = attn.launch(q, cache, slots)  # [m, 8, 64]
        return gate.launch(o.flatten(1)[:, :256], g) + a

    m = 3
    gu = torch.randn(m, 512).bfloat16()
    g = torch.randn(m, 256).bfloat16()
    q = torch.randn(m, 8, 64).bfloat16()
    cache = torch.randn(5, 2, 16, 128).bfloat16()
    slots = torch.zeros(m, 7, dtype=torch.int64)
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=compiler), fullgraph=True)
    with pytest.raises(_Traced):
        compiled(gu, g, q, cache, slots)
    assert len(graphs) == 1
    # Each launch is one op, under auto_functionalized (it writes its preallocated output).
    called = []
    for n in graphs[0].graph.nodes:
        if n.op != "call_function":
            continue
        target = n.args[0] if n.args and isinstance(n.args[0], torch._ops.OpOverload) else n.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "dspark":
            called.append((target, n.kwargs.get("handle")))
    assert called == [(ops.op(name).default, host.op_handle)
                      for name, host in (("mlp_activation", act), ("attention", attn), ("o_gate", gate))]


def test_eager_launches_call_the_kernel_directly(monkeypatch):
    act, _, _ = _hosts()
    seen = []
    monkeypatch.setattr(act, "_launch_kernel", lambda *args: seen.append(args))

    def no_dispatch(*args, **kwargs):
        raise AssertionError("an eager launch went through the dispatcher")

    monkeypatch.setattr(ops, "op", no_dispatch)
    gu = torch.randn(2, 512).bfloat16()
    out = act.launch(gu)
    assert len(seen) == 1 and seen[0][0] is gu and seen[0][1] is out
    assert out.shape == (2, 256) and out.dtype == torch.bfloat16


def test_the_op_implementation_launches_the_host_of_its_handle(monkeypatch):
    act, gate, _ = _hosts()
    assert act.op_handle != MlpActivation_again().op_handle  # never reused
    seen = []
    monkeypatch.setattr(act, "_launch_kernel", lambda *args: seen.append(("act", args)))
    monkeypatch.setattr(gate, "_launch_kernel", lambda *args: seen.append(("gate", args)))
    x = torch.zeros(1)
    ops._implementation(gate.op_handle, x, x, x)
    ops._implementation(act.op_handle, x, x)
    assert [s[0] for s in seen] == ["gate", "act"]
    assert ops.host_of(act.op_handle) is act


def MlpActivation_again():
    from dspark_cute import MlpActivation

    return MlpActivation(MlpActivationConstants(256), pdl=False)


def test_a_handle_without_a_live_host_raises():
    host = MlpActivation_again()
    handle = host.op_handle
    assert handle.startswith("MlpActivation:")
    del host
    gc.collect()
    with pytest.raises(RuntimeError, match="no live DSpark kernel host"):
        ops.host_of(handle)
    with pytest.raises(RuntimeError, match="another process"):
        ops._implementation("RowNorm:from-another-process", torch.zeros(1), torch.zeros(1))
