"""The kernels' ``torch.library`` custom ops (``dspark_cute.runtime.ops``), on
a CPU: every launch of a host class is one op whose schema marks the
tensors it writes; the fakes propagate; torch.compile traces a launch into
one opaque node without a graph break; the eager path never goes through the
dispatcher and hands each tensor to the kernel argument of its name (the
kernels' launch signatures; hosts that bind weights built over CPU tensors
with their CUDA checks relaxed); a handle without a live host raises. (That
each op's CUDA implementation gives the direct launch's bits is
``test_gpu_ops.py``.)"""

from __future__ import annotations

import gc
import importlib
import inspect

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
    "attention": (["q", "cache", "attn_slots", "out", "gate"], {"out"}),
    "o_gate": (["attn", "gate", "out"], {"out"}),
    "mlp_activation": (["gu", "out"], {"out"}),
    "gemv": (["x", "out"], {"out"}),
    "ordered_gemm": (["x", "out"], {"out"}),
}
# The ops are defined when their kernel modules import: every one imported
# here, so no test depends on what another test (or xdist worker) imported.
for _target in _provides.KERNELS.values():
    importlib.import_module(_target.split(":")[0])
for _module in ("dspark_cute.cutedsl.context.store", "dspark_cute.cutedsl.norms.context_norms"):
    importlib.import_module(_module)

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


def _value(v):
    """A launch argument as a plain value: a DSL scalar's int, a tuple of
    them as a tuple of ints; pointer and stream stand-ins as they are."""
    if isinstance(v, str) or (isinstance(v, tuple) and v[:1] == ("ptr",)):
        return v
    return tuple(int(x) for x in v) if isinstance(v, tuple) else int(v)


def _named(kernel_cls, args) -> dict:
    """A launch's arguments by the names of ``kernel_cls.__call__`` (one each)."""
    names = list(inspect.signature(kernel_cls.__call__).parameters)[1:]
    assert len(names) == len(args)
    return {n: _value(v) for n, v in zip(names, args)}


def _recorded_call(monkeypatch, module, compile_name, kernel_cls, host, *args):
    """Launch ``host`` eagerly with its compile function replaced by a
    recorder (pointers as ``("ptr", address)``): the kernel's arguments by
    the names of ``kernel_cls.__call__``."""
    seen = []
    monkeypatch.setattr(module, "ptr", lambda t, align=16: ("ptr", t.data_ptr()))
    monkeypatch.setattr(module, "current_stream", lambda: "stream")
    monkeypatch.setattr(module, compile_name, lambda *settings: lambda *a: seen.append(a))
    host.launch(*args)
    (call,) = seen
    return _named(kernel_cls, call)


def test_eager_launches_pass_each_tensor_to_its_kernel_argument(monkeypatch):
    """The host-to-kernel plumbing of the hosts a CPU can build, against the
    names of their kernels' launch signatures."""
    from dspark_cute.cutedsl.attention import direct, staged
    from dspark_cute.cutedsl.attention import paged as paged_module
    from dspark_cute.cutedsl.gating import mlp_activation as act_module
    from dspark_cute.cutedsl.gating import o_gate as gate_module

    act, gate, attn = _hosts()
    gu, out = torch.randn(3, 512).bfloat16(), torch.empty(3, 256, dtype=torch.bfloat16)
    got = _recorded_call(monkeypatch, act_module, "compile_mlp_activation", act_module.MlpActivationKernel, act,
                         gu, out)
    assert got == {"gu": ("ptr", gu.data_ptr()), "out": ("ptr", out.data_ptr()), "m": 3, "stream": "stream"}

    qkv = torch.randn(2, 3 * 256).bfloat16()
    a, g, o = torch.randn(2, 256).bfloat16(), qkv[:, 512:], torch.empty(2, 256, dtype=torch.bfloat16)
    got = _recorded_call(monkeypatch, gate_module, "compile_o_gate", gate_module.OGateKernel, gate, a, g, o)
    assert got == {"attn": ("ptr", a.data_ptr()), "gate": ("ptr", g.data_ptr()), "out": ("ptr", o.data_ptr()),
                   "m": 2, "gate_stride": 768, "stream": "stream"}

    q = torch.randn(2, 8, 64).bfloat16()
    cache = torch.randn(5, 2, 16, 128).bfloat16()
    slots = torch.zeros(2, 7, dtype=torch.int64)
    out = torch.empty_like(q)
    monkeypatch.setattr(paged_module, "current_stream", lambda: "stream")
    seen = []
    monkeypatch.setattr(attn, "_compiled", lambda: lambda *args: seen.append(args))
    attn.launch(q, cache, slots, out)
    kernel_cls = staged.StagedAttentionKernel if attn.takes_strided_q else direct.DirectAttentionKernel
    got = _named(kernel_cls, seen[0])
    expected = {"q": q.data_ptr(), "cache": cache.data_ptr(), "slots": slots.data_ptr(), "out": out.data_ptr(),
                "m": 2, "s_len": 7, "num_slots": 5 * 16, "stream": "stream"}
    if attn.takes_strided_q:
        expected.update(q_stride=512, gate=0, gate_stride=0)
    assert got == expected


def _cpu_operands(monkeypatch, module):
    """Let ``module``'s host class take CPU tensors (its operand checks
    are CUDA-only; what they check is the GPU suites')."""
    monkeypatch.setattr(module, "check_operand", lambda *args, **kwargs: None)
    if hasattr(module, "is_operand"):
        monkeypatch.setattr(module, "is_operand", lambda *args, **kwargs: True)


def test_eager_launches_of_bound_hosts_pass_their_tensors(monkeypatch):
    """The plumbing of the hosts that bind weights (row norm, boundary,
    context norms, QKV epilogue, GEMV), built over CPU tensors with their
    CUDA checks relaxed, against their kernels' launch signatures."""
    from dspark_core.contracts.constants import (
        BoundaryConstants,
        ContextNormConstants,
        GemvConstants,
        NormConstants,
        QKVEpilogueConstants,
        RowNormConstants,
    )
    from dspark_cute.cutedsl.gemm import gemv as gemv_module
    from dspark_cute.cutedsl.norms import boundary as boundary_module
    from dspark_cute.cutedsl.norms import context_norms as context_module
    from dspark_cute.cutedsl.norms import row_norm as row_module
    from dspark_cute.cutedsl.qkv import epilogue as epilogue_module

    h = 2048
    norm = NormConstants(1e-6, "bf16", 0.0, False)
    w = torch.randn(h).bfloat16()
    x = torch.randn(3, h).bfloat16()

    _cpu_operands(monkeypatch, row_module)
    row = row_module.RowNorm(RowNormConstants(h, norm, "bf16", "bf16"), w, pdl=False)
    out = torch.empty_like(x)
    got = _recorded_call(monkeypatch, row_module, "compile_row_norm", row_module.RowNormKernel, row, x, out)
    assert got == {"x": ("ptr", x.data_ptr()), "weight": ("ptr", w.data_ptr()), "out": ("ptr", out.data_ptr()),
                   "m": 3, "stream": "stream"}

    _cpu_operands(monkeypatch, boundary_module)
    alpha, beta, w2 = torch.rand(h), torch.randn(h), torch.randn(h).bfloat16()
    bd = boundary_module.DraftBoundary(BoundaryConstants(h, norm, norm), alpha, beta, w, w2, pdl=False)
    stream, out, new = torch.randn(3, h), torch.empty_like(x), torch.empty(3, h)
    got = _recorded_call(monkeypatch, boundary_module, "compile_boundary", boundary_module.BoundaryKernel, bd,
                         x, stream, True, out, new)
    assert got == {"branch": ("ptr", x.data_ptr()), "stream": ("ptr", stream.data_ptr()),
                   "alpha": ("ptr", alpha.data_ptr()), "beta": ("ptr", beta.data_ptr()),
                   "post_w": ("ptr", w.data_ptr()), "pre_w": ("ptr", w2.data_ptr()),
                   "new_stream": ("ptr", new.data_ptr()), "out": ("ptr", out.data_ptr()), "m": 3,
                   "cu_stream": "stream"}

    _cpu_operands(monkeypatch, context_module)
    pres = torch.randn(2, h).bfloat16()
    ctx = context_module.ContextNorms(ContextNormConstants(h, 2, norm, norm), w, pres, pdl=False)
    out = torch.empty(2, 3, h, dtype=torch.bfloat16)
    got = _recorded_call(monkeypatch, context_module, "compile_context_norms", context_module.ContextNormsKernel,
                         ctx, x, out)
    assert got == {"x": ("ptr", x.data_ptr()), "hidden_w": ("ptr", w.data_ptr()), "pre_w": ("ptr", pres.data_ptr()),
                   "out": ("ptr", out.data_ptr()), "m": 3, "stream": "stream"}

    monkeypatch.setattr(epilogue_module, "is_operand", lambda *args, **kwargs: True)
    table = torch.randn(100, 64).bfloat16()
    epi = epilogue_module.QKVEpilogue(QKVEpilogueConstants(h, 4, 2, False, 1e-6, 1e-6, True, "bf16"), None, table,
                                      pdl=False)
    qkv = torch.randn(3, (2 * 4 + 2 * 2) * 64).bfloat16()
    positions, slots = torch.arange(3), torch.arange(3)
    cache = torch.zeros(6, 16, 2, 128).bfloat16().permute(0, 2, 1, 3)  # LBNHC: [block][token][head] rows
    seen = []
    monkeypatch.setattr(epilogue_module, "current_stream", lambda: "stream")
    monkeypatch.setattr(epilogue_module, "compile_qkv_epilogue", lambda *settings: lambda *a: seen.append(a))
    q = epi.launch(qkv, positions, slots, cache)
    assert _named(epilogue_module.QKVEpilogueKernel, seen[0]) == {
        "qkv": qkv.data_ptr(), "table": table.data_ptr(), "positions": positions.data_ptr(),
        "slots": slots.data_ptr(), "cache": cache.data_ptr(), "row_elems": qkv.shape[1], "num_slots": 6 * 16,
        "block_size": 16, "max_position": 100, "m": 3, "block_stride": 16 * 2 * 128 * 2, "token_stride": 2 * 128 * 2,
        "head_stride": 128 * 2, "stream": "stream"}
    assert q.shape == (3, 4, 64) and q.data_ptr() == qkv.data_ptr()

    weight = torch.randn(1024, h).bfloat16()
    monkeypatch.setattr(gemv_module, "gemv_unsupported", lambda w: None)
    _cpu_operands(monkeypatch, gemv_module)
    gv = gemv_module.Gemv(GemvConstants("o_proj", 1024, h), weight, pdl=False)
    xo, out = torch.randn(1, h).bfloat16(), torch.empty(1, 1024, dtype=torch.bfloat16)
    seen = []
    monkeypatch.setattr(gemv_module, "current_stream", lambda: "stream")
    monkeypatch.setattr(gv, "_kernel", lambda: lambda *a: seen.append(a))
    gv.launch(xo, out)
    assert _named(gemv_module.GemvKernel, seen[0]) == {
        "x": xo.data_ptr(), "weight": weight.data_ptr(), "out": out.data_ptr(), "stream": "stream"}


def test_eager_launches_of_the_context_store_pass_their_tensors(monkeypatch):
    """The same for the context store (its per-layer address tuples, padded
    to ``MAX_LAYERS_PER_LAUNCH``, a layer without slots left out)."""
    from dspark_core.contracts.constants import ContextStoreConstants
    from dspark_cute.cutedsl.context import store as store_module

    monkeypatch.setattr(store_module, "_is_cuda_tensor", lambda t, dtype, device: isinstance(t, torch.Tensor))
    table = torch.randn(50, 64).bfloat16()
    store = store_module.ContextKvStore(ContextStoreConstants(2, 1e-6, True, "bf16"), table, pdl=False)
    layers, t = 3, 5
    kv = torch.randn(layers, t, 2 * 2 * 64).bfloat16()
    caches = [torch.zeros(4, 2, 16, 128).bfloat16() for _ in range(layers)]  # LBHNC: contiguous
    per_layer = [torch.arange(t), None, torch.arange(2)]
    positions = torch.arange(t)
    seen = []
    monkeypatch.setattr(store_module, "current_stream", lambda: "stream")
    monkeypatch.setattr(store_module, "compile_context_store", lambda *settings: lambda *a: seen.append(a))
    store.launch(kv, positions, caches, per_layer)
    (call,) = seen
    got = _named(store_module.ContextStoreKernel, call)
    pad = store_module.MAX_LAYERS_PER_LAUNCH - 2
    layer_bytes = t * 2 * 2 * store_module.HEAD_BYTES
    assert got == {
        "positions": positions.data_ptr(), "table": table.data_ptr(),
        "kv": (kv.data_ptr(), kv.data_ptr() + 2 * layer_bytes) + (0,) * pad,
        "caches": (caches[0].data_ptr(), caches[2].data_ptr()) + (0,) * pad,
        "slots": (per_layer[0].data_ptr(), per_layer[2].data_ptr()) + (0,) * pad,
        "rows": (t, 2) + (0,) * pad, "num_slots": 4 * 16, "block_size": 16, "max_position": 50,
        "groups": -(-t // store_module.WARPS_PER_CTA), "layers": 2, "block_stride": 2 * 16 * 128 * 2,
        "token_stride": 128 * 2, "head_stride": 16 * 128 * 2, "stream": "stream"}
