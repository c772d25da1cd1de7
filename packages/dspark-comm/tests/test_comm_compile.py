"""CPU tests: the mailbox kernels compile for sm_90a and sm_100a without a
GPU, a PTX audit of what they compile to, ``ptxas`` accepts them where it is
installed, and the host side refuses bad calls before any launch.

The audit, per all-reduce kernel: exactly one 16-byte ``ld.relaxed.sys``
per fragment and polled rank (all inside the bounded poll loops, each loop
reading ``%globaltimer``), one ``st.relaxed.sys`` per fragment and peer
(push) and per fragment and polled rank (clear), the status and epoch read
after the PDL wait, the address table before it; ``add.rn.f32`` and
``cvt.rn.bf16x2.f32`` counts of the sum order; no FMA, ``.ftz``,
approximation, multicast (``multimem``) or local memory, except in the
boundary epilogue's norms: there the row norms' audit
(``norm_testing.audit_norm_ptx``: the stock tree of the constants' arch, one
``rsqrt.approx.ftz`` per norm, nothing else approximate).
"""

from __future__ import annotations

import re
import types

import pytest
import torch
from norm_testing import audit_norm_ptx
from ptx_audit import code, count, ptxas_report, skip_audit_off_pin, spill_bytes

from dspark_comm.protocol import MailboxLayout
from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER, BoundaryConstants, NormConstants

ARCHS = ["sm_90a", "sm_100a"]
H = 8192
FRAGS = H // 2048


def audit(ptx: str, tp: int, order: str, published: bool, adds_per_column: int | None = None,
          norms: list | None = None) -> None:
    """The all-reduce audit (module docstring); with ``norms`` (the boundary
    epilogue's NormConstants) the norms' audit (``norm_testing.audit_norm_ptx``)
    in place of "no FMA and no approximation"."""
    body = code(ptx)
    polled = tp if published else tp - 1
    pushes = 0 if published else FRAGS * (tp - 1)
    if norms is None:
        assert not re.search(r"\bfma\b|fma\.", body), "an FMA"
        assert ".ftz" not in body and not re.search(r"rsqrt|\.approx", body)
    else:
        audit_norm_ptx(body, norms, H, extra_muls=2 * 8 * FRAGS)  # alpha * stream, beta * p per column
    assert "multimem" not in body, "a multicast access"
    assert not re.search(r"\b(ld|st)\.local", body), "local memory"
    assert count(body, r"ld\.relaxed\.sys\.global\.v4\.b32") == FRAGS * polled
    assert count(body, r"st\.relaxed\.sys\.global\.v4\.b32") == pushes + FRAGS * polled
    assert count(body, r"%globaltimer") == polled + 1  # the deadline, then one per poll loop
    head, sep, tail = body.partition("griddepcontrol.wait")
    assert sep, "no PDL wait"
    assert count(head, r"ld\.global\.b64") == tp and "ld.relaxed" not in head
    assert "griddepcontrol.launch_dependents" in tail
    if adds_per_column is not None:
        assert count(body, r"add\.rn\.f32") == adds_per_column * H // 256
    cvts = count(body, r"cvt\.rn\.bf16x2\.f32")
    rounds = (tp - 1) if order == BF16_RANK_ORDER else 1
    assert cvts >= rounds * 4 * FRAGS


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("order", [FP32_RANK_ORDER, BF16_RANK_ORDER])
@pytest.mark.parametrize("published", [False, True])
def test_all_reduce_compiles(arch, tp, order, published, tmp_path):
    from dspark_comm.cutedsl.allreduce import AllReduceKernel, StoreEpilogue, all_reduce_fake_args
    from dspark_cute.runtime.host import compile_ptx

    layout = MailboxLayout(tp, H, 16)
    rank = tp - 1
    ptx = compile_ptx(AllReduceKernel(layout, rank, order, StoreEpilogue(), published, True),
                      *all_reduce_fake_args(), arch=arch)
    assert f".target {arch}" in ptx
    audit(ptx, tp, order, published, adds_per_column=tp - 1)
    # The plain epilogue stores the row once: 16-byte weak stores.
    assert count(code(ptx), r"st\.global\.v4\.b32") == FRAGS
    report = ptxas_report(ptx, arch, tmp_path)
    if report and tp == 2:
        assert spill_bytes(report) == 0, report


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree", ARCHS)
@pytest.mark.parametrize(
    "tp,order,stream_bf16,store,post,pre",
    [
        (2, FP32_RANK_ORDER, False, True, ("bf16", False, 0.0), ("fp32", True, 1.0)),
        (2, BF16_RANK_ORDER, True, False, (None, False, 0.0), ("fp16", False, 0.0)),
        (4, FP32_RANK_ORDER, False, False, ("fp32", False, 1.0), (None, False, 0.0)),
        (8, BF16_RANK_ORDER, True, True, ("bf16", True, 0.0), ("bf16", False, 1.0)),
    ],
)
def test_boundary_compiles(arch, tree, tp, order, stream_bf16, store, post, pre, tmp_path):
    """The boundary epilogue with the stock tree of ``tree`` (the constants'
    arch) for each target: its norms as the row norms' (one
    ``rsqrt.approx.ftz`` and the tree's ``fma.rn`` leaves each)."""
    from dspark_comm.cutedsl.all_reduce_boundary import BoundaryEpilogue
    from dspark_comm.cutedsl.allreduce import AllReduceKernel, all_reduce_fake_args
    from dspark_cute.runtime.host import compile_ptx

    c = BoundaryConstants(H, NormConstants(1e-6, post[0], post[2], post[1], tree),
                          NormConstants(1e-5, pre[0], pre[2], pre[1], tree))
    layout = MailboxLayout(tp, H, 16)
    ptx = compile_ptx(AllReduceKernel(layout, 0, order, BoundaryEpilogue(c, stream_bf16, store), False, True),
                      *all_reduce_fake_args(), arch=arch)
    audit(ptx, tp, order, False, norms=[c.post, c.pre])
    body = code(ptx)
    # Two norms: one barrier each, one more before the epoch advances.
    assert count(body, r"\bbar\.sync\b") == 3
    assert count(body, r"shfl\.sync\.bfly\.b32") == 10
    gates = 2 * FRAGS * 2 + sum(FRAGS * {"bf16": 1, "fp16": 1, "fp32": 2}[n[0]] for n in (post, pre) if n[0])
    head = body.partition("griddepcontrol.wait")[0]
    assert count(head, r"ld\.global\.v4\.b32") == gates, "the gates load before the PDL wait"
    assert count(body, r"st\.global\.v4\.b32") == FRAGS + (2 * FRAGS if store else 0)
    report = ptxas_report(ptx, arch, tmp_path)
    if report and tp == 2:
        assert spill_bytes(report) == 0, report


def _zero_adds(body: str) -> list[int]:
    """Where the PTX adds +0.0: ``add.rn.f32`` whose last operand is the
    literal 0f00000000 or a register moved from 0 (``mov.b32 %r, 0``)."""
    zero_regs = set(re.findall(r"mov\.b32\s+(%r\d+),\s*0;", body))
    found = []
    for m in re.finditer(r"add\.rn\.f32\s+%\w+,\s*%\w+,\s*(%\w+|0f00000000);", body):
        if m.group(1) == "0f00000000" or m.group(1) in zero_regs:
            found.append(m.start())
    return found


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,order", [(2, FP32_RANK_ORDER), (4, BF16_RANK_ORDER), (8, FP32_RANK_ORDER)])
def test_positive_zero_compiles(arch, tp, order, tmp_path):
    """``PositiveZero``: one more ``add.rn.f32`` per column, its operand
    +0.0; the rest as the plain kernel's audit. Wrapped boundary epilogue: the
    norms' audit unchanged."""
    from dspark_comm.cutedsl.all_reduce_boundary import BoundaryEpilogue
    from dspark_comm.cutedsl.allreduce import (
        AllReduceKernel,
        PositiveZero,
        StoreEpilogue,
        all_reduce_fake_args,
        zero_sign_epilogue,
    )
    from dspark_cute.runtime.host import compile_ptx

    layout = MailboxLayout(tp, H, 16)
    ptx = compile_ptx(AllReduceKernel(layout, 1, order, PositiveZero(StoreEpilogue()), False, True),
                      *all_reduce_fake_args(), arch=arch)
    audit(ptx, tp, order, False, adds_per_column=tp)
    skip_audit_off_pin("positive_zero")
    body = code(ptx)
    zeros = _zero_adds(body)
    assert len(zeros) == H // 256, "one + 0.0 per column of the thread"
    assert count(body, r"st\.global\.v4\.b32") == FRAGS
    ptxas_report(ptx, arch, tmp_path)
    assert zero_sign_epilogue(StoreEpilogue(), False).key() == StoreEpilogue().key()
    assert PositiveZero(StoreEpilogue()).key() != StoreEpilogue().key(), "a kernel of its own in the jit cache"
    c = BoundaryConstants(H, NormConstants(1e-6, "bf16", 0.0, False, arch), NormConstants(1e-5, "bf16", 0.0, False,
                                                                                           arch))
    wrapped, plain = (
        compile_ptx(AllReduceKernel(layout, 0, order, e, False, True), *all_reduce_fake_args(), arch=arch)
        for e in (PositiveZero(BoundaryEpilogue(c, False, True)), BoundaryEpilogue(c, False, True))
    )
    audit(wrapped, tp, order, False, norms=[c.post, c.pre])
    assert len(_zero_adds(code(wrapped))) - len(_zero_adds(code(plain))) == H // 256
    with pytest.raises(ValueError, match="wraps one plain Epilogue"):
        PositiveZero(PositiveZero(StoreEpilogue()))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_publish_and_example_compile(arch, tmp_path):
    from bias_epilogue import AddBiasEpilogue
    from publisher import PublishKernel, publish_fake_args

    from dspark_comm.cutedsl.allreduce import AllReduceKernel, all_reduce_fake_args
    from dspark_cute.runtime.host import compile_ptx

    layout = MailboxLayout(4, H, 16)
    ptx = compile_ptx(PublishKernel(layout, 1, True), *publish_fake_args(), arch=arch)
    body = code(ptx)
    assert count(body, r"st\.relaxed\.sys\.global\.v4\.b32") == 4 * FRAGS  # every rank, itself included
    assert "ld.relaxed.sys" not in body and "%globaltimer" not in body
    ptxas_report(ptx, arch, tmp_path)
    ptx = compile_ptx(AllReduceKernel(layout, 2, FP32_RANK_ORDER, AddBiasEpilogue(), False, True),
                      *all_reduce_fake_args(), arch=arch)
    audit(ptx, 4, FP32_RANK_ORDER, False, adds_per_column=3 + 1)
    ptxas_report(ptx, arch, tmp_path)


@pytest.mark.compile
def test_kernel_refuses():
    from dspark_comm.cutedsl.allreduce import MAX_OPERANDS, AllReduceKernel, Epilogue, StoreEpilogue

    layout = MailboxLayout(2, H, 16)
    with pytest.raises(ValueError, match="sum order"):
        AllReduceKernel(layout, 0, "tree", StoreEpilogue(), False, True)
    with pytest.raises(ValueError, match="rank 2"):
        AllReduceKernel(layout, 2, FP32_RANK_ORDER, StoreEpilogue(), False, True)

    class Greedy(Epilogue):
        operands = tuple(f"o{i}" for i in range(MAX_OPERANDS + 1))

    with pytest.raises(ValueError, match="at most"):
        AllReduceKernel(layout, 0, FP32_RANK_ORDER, Greedy(), False, True)


def _fake_mailbox(capacity: int = 16):
    return types.SimpleNamespace(
        layout=MailboxLayout(2, H, capacity), rank=0, device=torch.device("cpu"),
        check_open=lambda: None, group=None,
    )


def test_host_refuses_bad_calls():
    """Refusals before any compile or launch (no GPU needed)."""
    from dspark_comm.cutedsl.allreduce import FusedAllReduce, StoreEpilogue

    fused = FusedAllReduce(_fake_mailbox(), StoreEpilogue())
    assert fused.takes_rows(16) and not fused.takes_rows(17) and not fused.takes_rows(0)
    with pytest.raises(ValueError, match="capacity of 16"):
        fused.run(17, None, (0,))
    with pytest.raises(ValueError, match="operands"):
        fused.run(4, None, ())
    with pytest.raises(ValueError, match="contiguous CUDA"):
        fused.run(4, torch.zeros(4, H, dtype=torch.bfloat16), (0,))
    assert not fused.takes(4, torch.zeros(4, H, dtype=torch.bfloat16), (0,))
    published = FusedAllReduce(_fake_mailbox(), StoreEpilogue(), published=True)
    with pytest.raises(ValueError, match="published"):
        published.run(4, torch.zeros(4, H, dtype=torch.bfloat16), (0,))
    with pytest.raises(ValueError, match="sum order"):
        FusedAllReduce(_fake_mailbox(), StoreEpilogue(), "fp16")
    with pytest.raises(ValueError, match="Epilogue"):
        FusedAllReduce(_fake_mailbox(), object())
