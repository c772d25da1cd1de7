"""CPU tests of the one-token GEMV's spec (``dspark_core.spec.gemv``): ``gemv``
equals, bit for bit, a scalar emulation of the stated order written out here
independently (NumPy FP32 scalars, one rounding per operation); it is within
its stated bound of the exact product; special values (-0.0, subnormal
products, overflow to inf, inf * 0, NaN) come out as the order says; the
chunked evaluation does not change a bit; bad operands are ValueErrors; and
the planner's GEMV parts (fused, declined, refused at TP, refused for a
weight it does not cover). Fresh seeded data (the seed is printed)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft as plan_description
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel
from dspark_core.spec import gemv as G
from dspark_core.tools.compare import assert_bitwise

SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
print(f"DSPARK_SEED={SEED}")


def plan_draft(model, target=None):
    """The plan of a reference draft: the planner over its description."""
    return plan_description(describe(model), target)


def _emulate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The order of the module docstring, one NumPy FP32 scalar op at a time."""
    f32 = np.float32
    xs = x.reshape(-1).float().numpy()
    ws = w.float().numpy()
    n, k = ws.shape
    out = np.empty(n, dtype=np.float32)
    with np.errstate(all="ignore"):
        for r in range(n):
            lanes = []
            for lane in range(32):
                total = None
                for f in range(k // 256):
                    p = [f32(ws[r, 256 * f + 8 * lane + j]) * f32(xs[256 * f + 8 * lane + j]) for j in range(8)]
                    s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
                    total = s if total is None else f32(total + s)
                lanes.append(total)
            while len(lanes) > 1:
                half = len(lanes) // 2
                lanes = [f32(lanes[i] + lanes[i + half]) for i in range(half)]
            out[r] = lanes[0]
    return torch.from_numpy(out).to(torch.bfloat16).reshape(1, n)


def _wide(gen, shape) -> torch.Tensor:
    """BF16 values over a wide exponent range, signs random."""
    mant = torch.rand(shape, generator=gen) + 0.5
    exp = torch.randint(-30, 30, shape, generator=gen).float()
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(exp)).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(16, 256), (32, 768), (48, 1024)])
def test_gemv_is_the_stated_order(n, k):
    gen = torch.Generator().manual_seed(SEED + n + k)
    x, w = _wide(gen, (1, k)), _wide(gen, (n, k))
    assert_bitwise(G.gemv(x, w), _emulate(x, w), "gemv vs scalar emulation")
    assert_bitwise(G.gemv(x.reshape(k), w, rows_per_chunk=5), G.gemv(x, w), "chunked gemv")


def test_gemv_is_within_its_bound_and_near_the_library_gemm():
    gen = torch.Generator().manual_seed(SEED)
    n, k = 64, 4096
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    out = G.gemv(x, w)
    exact = x.double() @ w.double().t()
    err = (out.double() - exact).abs()
    bound = G.error_bound(x, w, out)
    assert bool((err <= bound).all()), float((err / bound).max())
    # The bound is tight enough to mean something: of the order of the BF16 rounding.
    assert float((bound / (out.double().abs() + 1e-30)).median()) < 2.0**-6


def test_gemv_special_values():
    k = 256
    w = torch.zeros(16, k)
    x = torch.zeros(1, k)
    x[0, :5] = torch.tensor([1.0, -0.0, 2.0**-100, 2.0**100, 3.0])
    w[0, 0] = -0.0  # row 0: -0.0 * 1.0 among +0.0 products: +0.0 (+0.0 + -0.0 = +0.0)
    w[1, 2] = 2.0**-100  # row 1: 2^-200 underflows to +0.0
    w[2, 3] = 2.0**100  # row 2: 2^200 overflows to +inf
    w[3, 3] = -(2.0**100)  # row 3: -inf ...
    w[3, 4] = 2.0**127  # ... with a finite 2^128.58 that overflows to +inf: NaN
    w[4, 2] = 2.0**-27  # row 4: 2^-127, a subnormal product, kept
    w[5, 0] = -1.0  # row 5: -1.0 exactly
    w[6, 0], w[6, 4] = 3.0, -1.0  # row 6: 3 - 3 = +0.0
    got = G.gemv(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()[0]
    assert got[0].item() == 0.0 and not torch.signbit(got[0])
    assert got[1].item() == 0.0
    assert got[2].item() == float("inf")
    assert torch.isnan(got[3])
    assert got[4].item() == 2.0**-127
    assert got[5].item() == -1.0
    assert got[6].item() == 0.0 and not torch.signbit(got[6])
    assert_bitwise(G.gemv(x.to(torch.bfloat16), w.to(torch.bfloat16)),
                   _emulate(x.to(torch.bfloat16), w.to(torch.bfloat16)), "special values")
    # An infinite input: inf * 0 is NaN in every row whose weight there is 0.
    x[0, 7] = float("inf")
    w[7, 7] = 1.0
    got = G.gemv(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()[0]
    assert got[7].item() == float("inf") and bool(torch.isnan(got[:7]).all())


def test_gemv_refuses_operands_it_does_not_cover():
    w = torch.zeros(16, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one bf16 row of 256"):
        G.gemv(torch.zeros(2, 256, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="one bf16 row"):
        G.gemv(torch.zeros(1, 256), w)
    with pytest.raises(ValueError, match="multiple of 256"):
        G.gemv(torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(16, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        G.gemv(torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(8, 256, dtype=torch.bfloat16))
    assert G.gemv_unsupported(w) is None
    assert "2-D bf16" in G.gemv_unsupported(w.half())


def _small():
    return DraftModel(small_config())


def test_the_plan_has_a_gemv_part_per_projection():
    model = _small()
    plan = plan_draft(model, policy.Target())
    roles = list(policy.GEMV_ROLES)
    assert [p.name for p in plan.gemvs] == [f"layer {i}'s {r} GEMV" for i in range(2) for r in roles]
    assert all(p.fused for p in plan.gemvs)
    c = plan.gemvs[2].constants  # layer 0's gate_up
    assert (c.role, c.n, c.k) == ("gate_up", 2 * model.config.intermediate_size, model.config.hidden_size)
    declined = plan_draft(model, policy.Target().decline({policy.GEMV}))
    assert all(p.declined and p.reason == policy.OPT_IN[policy.GEMV] for p in declined.gemvs)
    tp2 = plan_draft(model, policy.Target(tp=2))
    assert tp2.gemvs == []  # at TP the branch GEMMs feed the all-reduce
    excluded = plan_draft(model, policy.Target().without({policy.GEMV}))
    assert all(p.reason == "the caller excluded the gemv kernel" for p in excluded.gemvs)


def test_a_weight_the_gemv_does_not_cover_keeps_the_stock_projection():
    model = _small()
    with torch.no_grad():
        model.layers[1].mlp.down = torch.nn.Parameter(model.layers[1].mlp.down[:, :-8].contiguous(),
                                                      requires_grad=False)
    model.layers[1].mlp.intermediate_size -= 4
    plan = plan_draft(model, policy.Target())
    down = plan.gemvs[-1]
    assert down.name == "layer 1's down GEMV" and not down.fused
    assert "input features, not a positive multiple of 256" in down.reason
    assert all(p.fused for p in plan.gemvs[:-1])
