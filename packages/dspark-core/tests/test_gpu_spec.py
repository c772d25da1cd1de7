"""The spec gives the same bits on CPU and on CUDA (NaN payloads excepted):
every layer of dspark_core.spec.layers run on both devices over fresh random data
and rows of special values."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dspark_core.spec.layers import GatedResidual, HeadNorm, PagedKVCache, RMSNorm, Rotary, o_gate, residual_boundary
from dspark_core.spec.numerics import exp_rn, sigmoid_rn, silu_rn
from dspark_core.tools.compare import assert_bitwise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nox -s tests-sm90)"),
]

SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
print(f"DSPARK_SEED={SEED}")
SPECIALS = [0.0, -0.0, 1e-40, -1e-40, 1.4e-45, 3e38, -3e38, float("inf"), float("-inf"), float("nan")]


def _rows(m: int, h: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """m rows: random normals, the last rows seeded with special values."""
    x = torch.randn(m, h, generator=gen) * scale
    if m >= 3:
        x[-1, : len(SPECIALS)] = torch.tensor(SPECIALS)
        x[-2] = torch.randn(h, generator=gen) * 1e-39  # a subnormal-only row
        x[-3] = -0.0
    return x


def _both(fn, *args):
    cpu = fn(*args)
    cuda = fn(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
    return cpu, cuda


def _norm(h, gen, **kw) -> RMSNorm:
    norm = RMSNorm(h, **kw)
    if norm.weight is not None:
        norm.weight.data = (1 + 0.2 * torch.randn(h, generator=gen)).to(norm.weight.dtype)
    return norm


@pytest.mark.parametrize("h", [2048, 6144, 8192])
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"has_weight": False},
        {"weight_dtype": torch.float32, "gain_center": 1.0},
        {"weight_dtype": torch.float16, "weight_before_norm": True},
        {"eps": 1e-5, "out_dtype": torch.float32},
        {"out_dtype": torch.float16},
    ],
)
def test_rmsnorm_cpu_equals_cuda(h, variant):
    gen = torch.Generator().manual_seed(SEED)
    norm = _norm(h, gen, **variant)
    for x in (_rows(7, h, gen).to(torch.bfloat16), _rows(5, h, gen, 1e3)):
        cpu = norm(x)
        cuda = norm.cuda()(x.cuda())
        norm.cpu()
        assert_bitwise(cuda.cpu(), cpu, f"RMSNorm {variant}")


@pytest.mark.parametrize("stream_dtype", [torch.float32, torch.bfloat16])
def test_boundary_cpu_equals_cuda(stream_dtype):
    h = 8192
    gen = torch.Generator().manual_seed(SEED + 1)
    post, pre = _norm(h, gen), _norm(h, gen, weight_dtype=torch.float32, gain_center=1.0)
    conn = GatedResidual(h)
    conn.alpha.data = torch.rand(h, generator=gen) + 0.5
    conn.beta.data = torch.rand(h, generator=gen)
    branch = _rows(16, h, gen).to(torch.bfloat16)
    stream = _rows(16, h, gen, 10.0).to(stream_dtype)
    cpu = residual_boundary(post, conn, pre, branch, stream)
    mods = [post.cuda(), conn.cuda(), pre.cuda()]
    cuda = residual_boundary(*mods, branch.cuda(), stream.cuda())
    assert_bitwise(cuda[0].cpu(), cpu[0], "new stream")
    assert_bitwise(cuda[1].cpu(), cpu[1], "boundary output")


def test_head_norm_rope_o_gate_cpu_equals_cuda():
    gen = torch.Generator().manual_seed(SEED + 2)
    x = _rows(12, 8 * 64, gen).view(12, 8, 64).to(torch.bfloat16)
    g = _rows(12, 8 * 64, gen, 8.0).view(12, 8, 64).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (12,), generator=gen)
    norm = HeadNorm(64, has_weight=True)
    norm.weight.data = (1 + 0.1 * torch.randn(64, generator=gen)).bfloat16()
    for table in (torch.bfloat16, torch.float32):
        rope = Rotary(64, 4096, table_dtype=table)
        cpu = rope(norm(x), positions)
        cuda = rope.cuda()(norm.cuda()(x.cuda()), positions.cuda())
        norm.cpu()
        assert_bitwise(cuda.cpu(), cpu, f"QK-norm + RoPE ({table})")
    plain = HeadNorm(64)
    assert_bitwise(o_gate(x.cuda(), g.cuda(), plain).cpu(), o_gate(x, g, plain), "o-gate")


def test_exp_sigmoid_silu_cpu_equal_cuda():
    gen = torch.Generator().manual_seed(SEED + 3)
    x = torch.cat([torch.randn(1 << 20, generator=gen) * 40, torch.tensor(SPECIALS),
                   torch.linspace(-110, 95, 1 << 16)])
    for fn in (exp_rn, sigmoid_rn, silu_rn):
        cpu, cuda = _both(fn, x)
        assert_bitwise(cuda.cpu(), cpu, fn.__name__)


def test_kv_insert_cpu_equals_cuda():
    gen = torch.Generator().manual_seed(SEED + 4)
    k = torch.randn(9, 4, 64, generator=gen).bfloat16()
    v = torch.randn(9, 4, 64, generator=gen).bfloat16()
    slots = torch.tensor([3, -1, 17, 0, 31, -5, 8, 9, 30])
    caches = []
    for dev in ("cpu", "cuda"):
        cache = PagedKVCache(4, 4, 8, 64, device=dev)
        cache.tensor.fill_(float("nan"))  # poisoned: unwritten slots stay NaN
        cache.insert(k.to(dev), v.to(dev), slots.to(dev))
        caches.append(cache.tensor.cpu())
    assert_bitwise(caches[1], caches[0], "KV cache")


@pytest.mark.parametrize("s", [1, 129, 700])
def test_attention_cpu_equals_cuda(s):
    from dspark_core.spec.attention import paged_attention

    gen = torch.Generator().manual_seed(SEED + 5 + s)
    m, heads, kv, blocks = 3, 16, 2, s // 16 + 3
    tensors = {}
    for dev in ("cpu", "cuda"):
        cache = PagedKVCache(blocks, kv, 16, 64, device=dev)
        tensors[dev] = cache
    kvals = torch.randn(blocks, kv, 16, 128, generator=gen) * 3
    kvals[0, 0, :2, :10] = torch.tensor(SPECIALS[:10]).clamp(-1e4, 1e4)  # -0.0, subnormals
    q = (torch.randn(m, heads, 64, generator=gen) * 2).bfloat16()
    slots = torch.stack([torch.randperm(blocks * 16, generator=gen)[:s] for _ in range(m)])
    slots[torch.rand(m, s, generator=gen) < 0.2] = -1
    outs = []
    for dev, cache in tensors.items():
        cache.tensor.copy_(kvals.bfloat16())
        outs.append(paged_attention(q.to(dev), cache, slots.to(dev), kv).cpu())
    assert_bitwise(outs[1], outs[0], f"attention S={s}")
