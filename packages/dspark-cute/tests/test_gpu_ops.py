"""GPU tests of the kernels' custom ops (``torch.ops.dspark.*``): on real
operands ``torch.library.opcheck`` accepts each op (schema, fake against
the real launch, functionalized dispatch), and a function calling the host
classes compiled by torch.compile (Inductor, full graph) writes the same
bits into its outputs as the eager launches, the outputs poisoned before
each call (a NaN pattern, then a finite one)."""

from __future__ import annotations

import pytest
import torch
from cute_testing import GPU_NORMS, check_poisoned, make_norm, requires_cuda
from norm_testing import row_consts

from dspark_core.contracts.constants import MlpActivationConstants, OGateConstants
from dspark_cute.runtime import ops

pytestmark = [pytest.mark.gpu, requires_cuda]

H, I, HEADS = 8192, 2048, 16


def _hosts(gen):
    from dspark_cute import MlpActivation, OGate, RowNorm

    norm = make_norm(GPU_NORMS[1], H, gen)
    row = RowNorm(row_consts(norm, torch.bfloat16, "sm_90a"), norm.weight)
    act = MlpActivation(MlpActivationConstants(I))
    gate = OGate(OGateConstants(HEADS, 1e-6))
    for host in (row, act, gate):
        host.prepare()
    return row, act, gate


@pytest.fixture
def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("m", [1, 7, 16])
def test_opcheck_accepts_each_op(m, gen):
    row, act, gate = _hosts(gen)
    x = torch.randn(m, H, generator=gen, device="cuda").bfloat16()
    gu = torch.randn(m, 2 * I, generator=gen, device="cuda").bfloat16()
    attn = torch.randn(m, HEADS * 64, generator=gen, device="cuda").bfloat16()
    g = torch.randn(m, HEADS * 64, generator=gen, device="cuda").bfloat16()
    cases = [
        ("row_norm", row, (x, torch.empty_like(x))),
        ("mlp_activation", act, (gu, torch.empty(m, I, dtype=torch.bfloat16, device="cuda"))),
        ("o_gate", gate, (attn, g, torch.empty_like(attn))),
    ]
    for name, host, args in cases:
        torch.library.opcheck(ops.op(name).default, (host.op_handle, *args))


@pytest.mark.parametrize("m", [1, 7, 16])
def test_compiled_launches_write_the_eager_bits(m, gen):
    row, act, gate = _hosts(gen)

    def step(x, gu, attn, g, outs):
        row.launch(x, outs[0])
        act.launch(gu, outs[1])
        gate.launch(attn, g, outs[2])

    x = torch.randn(m, H, generator=gen, device="cuda").bfloat16()
    gu = torch.randn(m, 2 * I, generator=gen, device="cuda").bfloat16()
    attn = torch.randn(m, HEADS * 64, generator=gen, device="cuda").bfloat16()
    g = torch.randn(m, HEADS * 64, generator=gen, device="cuda").bfloat16()
    expected = [torch.empty_like(x), torch.empty(m, I, dtype=torch.bfloat16, device="cuda"), torch.empty_like(attn)]
    step(x, gu, attn, g, expected)
    outs = [torch.empty_like(t) for t in expected]
    compiled = torch.compile(step, fullgraph=True)
    check_poisoned(lambda: compiled(x, gu, attn, g, outs), outs, expected, f"compiled against eager, m={m}")
