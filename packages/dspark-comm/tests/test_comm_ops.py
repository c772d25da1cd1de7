"""dspark-comm's kernels as ``torch.library`` custom ops (``dspark_cute.runtime.ops``):
the fused all-reduce, the fused all-reduce boundary and the package GEMM are
each one op whose schema marks what it writes, this rank's mailbox included
(so a traced graph keeps a publishing GEMM before the boundary that consumes
it). A CPU machine checks the schemas, the fakes and the eager launches'
plumbing (each tensor in its kernel argument, over a mailbox's host side);
the launches themselves are the multi-GPU suites'."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dspark_comm.cutedsl import all_reduce_boundary, allreduce, package_gemm
from dspark_cute.runtime import ops

OPS = {
    "all_reduce": (["partial", "out", "mailbox"], {"out", "mailbox"}),
    "all_reduce_boundary": (
        ["partial", "stream", "store_stream", "out", "new_stream", "published", "mailbox"],
        {"out", "new_stream", "mailbox"},
    ),
    "package_gemm": (["x", "out", "mailbox", "publish"], {"out", "mailbox"}),
}
HOSTS = {
    "all_reduce": allreduce.MailboxAllReduce,
    "all_reduce_boundary": all_reduce_boundary.AllReduceBoundary,
    "package_gemm": package_gemm.PackageGemm,
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_comm_op_schemas(name):
    assert HOSTS[name].OP == name and callable(HOSTS[name]._launch_kernel)
    schema = ops.op(name).default._schema
    names, writes = OPS[name]
    assert schema.arguments[0].name == "handle"
    assert [a.name for a in schema.arguments[1:]] == names
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == writes
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dspark::{name}", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dspark::{name}", "Meta")


def test_comm_fakes_write_nothing():
    with FakeTensorMode():
        words = torch.empty(1024, dtype=torch.int32, device="cuda")
        x = torch.empty(2, 512, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(2, 1024, dtype=torch.bfloat16, device="cuda")
        stream = torch.empty(2, 1024, dtype=torch.float32, device="cuda")
        assert ops.op("package_gemm")("PackageGemm:x", x, None, words, True) is None
        assert ops.op("all_reduce_boundary")("AllReduceBoundary:x", None, stream, True, out, stream.clone(), True,
                                             words) is None
        assert ops.op("all_reduce")("MailboxAllReduce:x", out, out.clone(), words) is None


class _Mailbox:
    """A mailbox's host side on the CPU: its layout, rank, device, peer
    table and timeout (no buffers: no kernel runs)."""

    def __init__(self, hidden: int, capacity: int = 16) -> None:
        from dspark_comm.protocol import MailboxLayout

        self.layout = MailboxLayout(2, hidden, capacity)
        self.rank, self.device = 0, torch.device("cpu")
        self.table = torch.tensor([4096, 8192], dtype=torch.int64)
        self.timeout_ns = 5 * 10**9

    def check_open(self) -> None:
        pass

    def words(self) -> torch.Tensor:
        return torch.zeros(8, dtype=torch.int32)


def _record(monkeypatch, module, name, seen):
    monkeypatch.setattr(module, name, lambda *settings: lambda *args: seen.append((name, args)))


def _named(kernel_cls, args) -> dict:
    names = list(inspect.signature(kernel_cls.__call__).parameters)[1:]
    assert len(names) == len(args)
    return {n: (v if isinstance(v, str) else int(v)) for n, v in zip(names, args)}


def test_comm_launches_pass_each_tensor_to_its_kernel_argument(monkeypatch):
    """The host-to-kernel plumbing of the plain all-reduce, the all-reduce
    boundary and the package GEMM's publish-then-boundary on a CPU (a mailbox's
    host side, operand checks relaxed, compile functions recording), against
    the kernels' launch signatures: the partial, the peer table and each
    epilogue operand in its slot."""
    from dspark_core.contracts.constants import BoundaryConstants, NormConstants, PackageGemmConstants
    from dspark_cute.cutedsl.norms import boundary as boundary_module

    h = 2048
    mb = _Mailbox(h)
    seen = []
    for module in (allreduce, package_gemm):
        monkeypatch.setattr(module, "current_stream", lambda: "stream")
    _record(monkeypatch, allreduce, "compile_all_reduce", seen)
    for module in (boundary_module, all_reduce_boundary, package_gemm):
        monkeypatch.setattr(module, "check_operand", lambda *args, **kwargs: None)
    monkeypatch.setattr(package_gemm, "is_operand", lambda *args, **kwargs: True)

    plain = allreduce.MailboxAllReduce(mb, pdl=False)
    partial, out = torch.randn(3, h).bfloat16(), torch.empty(3, h, dtype=torch.bfloat16)
    plain.launch(partial, out)
    got = _named(allreduce.AllReduceKernel, seen.pop()[1])
    assert got == {"partial": partial.data_ptr(), "table": mb.table.data_ptr(), "timeout_ns": mb.timeout_ns,
                   "o0": out.data_ptr(), **{f"o{i}": 0 for i in range(1, 8)}, "m": 3, "stream": "stream"}

    norm = NormConstants(1e-6, "bf16", 0.0, False)
    alpha, beta = torch.rand(h), torch.randn(h)
    post, pre = torch.randn(h).bfloat16(), torch.randn(h).bfloat16()
    bd = all_reduce_boundary.AllReduceBoundary(mb, BoundaryConstants(h, norm, norm), alpha, beta, post, pre,
                                               pdl=False)
    stream, new = torch.randn(3, h), torch.empty(3, h)
    assert bd.launch(partial, stream, True, out, new) == (new, out)
    expected = {"partial": partial.data_ptr(), "table": mb.table.data_ptr(), "timeout_ns": mb.timeout_ns,
                **dict(zip((f"o{i}" for i in range(7)), (t.data_ptr() for t in (stream, alpha, beta, post, pre, new,
                                                                                 out)))),
                "o7": 0, "m": 3, "stream": "stream"}
    assert _named(allreduce.AllReduceKernel, seen.pop()[1]) == expected

    weight = torch.randn(h, 512).bfloat16()
    gemm = package_gemm.PackageGemm(PackageGemmConstants("o_proj", h, 512, 64, 1, 16), weight, mb, pdl=False)
    monkeypatch.setattr(gemm, "_kernel", lambda m, publish: lambda *args: seen.append(("gemm", (m, publish), args)))
    x = torch.randn(3, 512).bfloat16()
    assert gemm.run_boundary(x, bd, stream, True, out, new) == (new, out)
    (_, variant, gemm_args), (_, boundary_args) = seen
    assert variant == (3, True)
    assert _named(package_gemm.PackageGemmKernel, gemm_args) == {
        "x": x.data_ptr(), "weight": weight.data_ptr(), "out": 0, "table": mb.table.data_ptr(), "m": 3,
        "stream": "stream"}
    assert _named(allreduce.AllReduceKernel, boundary_args) == {**expected, "partial": 0}
    # The boundary's own checks refuse before anything is published.
    seen.clear()
    with pytest.raises(ValueError, match="x's 3 rows"):
        gemm.run_boundary(x, bd, torch.randn(2, h), True)
    assert not seen
