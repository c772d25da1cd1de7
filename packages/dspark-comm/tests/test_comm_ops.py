"""dspark-comm's kernels as ``torch.library`` custom ops (``dspark_cute.runtime.ops``):
the fused all-reduce, the fused all-reduce boundary and the package GEMM are
each one op whose schema marks what it writes, this rank's mailbox included
(so a traced graph keeps a publishing GEMM before the boundary that consumes
it). A CPU machine checks the schemas and the fakes; the ops' launches are
the multi-GPU suites'."""

from __future__ import annotations

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
