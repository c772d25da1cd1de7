"""The spec on CUDA (GPU tests; ``nox -s tests-sm90`` / ``tests-sm100``).

1. The approximate instructions (``numerics.rsqrt_approx_ftz`` and the
   others) run as themselves on CUDA (NVRTC inline PTX through
   ``torch.cuda.jiterator``): near the IEEE value, their ``.ftz`` behaviour,
   and not the IEEE stand-in the CPU runs.
2. The spec on CUDA equals the spec on the CPU bit for bit (NaN payloads
   excepted) wherever no approximate instruction enters (``fma_rn``, the row
   trees of both architectures, RoPE, the gated residual, the KV insert, the
   reference attention and ``exp_rn``); where one enters (every norm, the
   o-gate, the activation), the CPU spec with the GPU's instruction injected
   (each call sent to CUDA and back) equals the CUDA spec bit for bit: the
   only CPU/CUDA difference is the instruction itself.
3. When the stock binaries are at hand (``scripts/stock/compile_stock.py``'s
   output in ``DSPARK_STOCK_DIR`` or ``.device/stock``), the spec on CUDA
   against vLLM 0.33.0's stock kernels on the same operands (special rows
   planted), through ``scripts/stock/check_spec.py``: zero mismatches.

Fresh random data every run (the session seed, printed, from conftest.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import _independent as I
import numpy as np
import pytest
import torch

from dspark_core.spec import layers as L
from dspark_core.spec import numerics as N
from dspark_core.spec.attention import paged_attention
from dspark_core.tools.compare import assert_bitwise, mismatches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nox -s tests-sm90)"),
]

REPO = Path(__file__).resolve().parents[3]
SPECIALS = [0.0, -0.0, 1e-40, -1e-40, 1.4e-45, 3e38, -3e38, float("inf"), float("-inf"), float("nan")]
APPROX = ("rsqrt_approx_ftz", "rsqrt_approx", "sqrt_approx_ftz", "rcp_full", "rcp_approx_ftz", "ex2_approx",
          "ex2_approx_ftz", "expf")


def _rows(m: int, h: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """m rows: random normals, the last rows seeded with special values."""
    x = torch.randn(m, h, generator=gen) * scale
    if m >= 4:
        x[-1, : len(SPECIALS)] = torch.tensor(SPECIALS)
        x[-2] = torch.randn(h, generator=gen) * 1e-39  # a subnormal-only row
        x[-3] = -0.0
        x[-4] = 3e38 * torch.sign(torch.randn(h, generator=gen))  # squares overflow
    return x


@pytest.fixture
def gpu_instructions(monkeypatch):
    """On a CPU tensor, each approximate instruction runs on the GPU (a copy
    sent there and back); on a CUDA tensor it is itself."""
    for name in APPROX:
        real = getattr(N, name)

        def via_gpu(x, _real=real):
            return _real(x) if x.is_cuda else _real(x.cuda()).cpu()

        for module in (N, L):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, via_gpu)


# ---------------------------------------------------------------------------
# 1. The instructions themselves.


def _inputs(gen) -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    return torch.cat([bits.view(torch.float32), torch.tensor(SPECIALS),
                      torch.linspace(-140.0, 130.0, 1 << 16)])


# name: (max relative error against the FP64 function on normal finite results, FP64 function)
BOUNDS = {
    "rsqrt_approx_ftz": (2.0**-21, lambda v: 1 / torch.sqrt(v)),
    "rsqrt_approx": (2.0**-21, lambda v: 1 / torch.sqrt(v)),
    "sqrt_approx_ftz": (2.0**-21, torch.sqrt),
    "rcp_full": (2.0**-21, lambda v: 1 / v),
    "rcp_approx_ftz": (2.0**-21, lambda v: 1 / v),
    "ex2_approx": (2.0**-20, torch.exp2),
    "ex2_approx_ftz": (2.0**-20, torch.exp2),
    "expf": (2.0**-21, torch.exp),
}


@pytest.mark.parametrize("name", APPROX)
def test_instruction_is_near_its_function_and_runs_on_the_gpu(name, gen):
    x = _inputs(gen)
    fn = getattr(N, name)
    gpu = fn(x.cuda()).cpu()
    cpu = fn(x)
    bound, exact = BOUNDS[name]
    ref = exact(x.double())
    ok = torch.isfinite(ref) & (ref.abs() >= 2.0**-126) & (ref.abs() <= 3e38) & (x.abs() >= 2.0**-126)
    rel = ((gpu.double() - ref).abs() / ref.abs())[ok]
    assert float(rel.max()) <= bound, (name, float(rel.max()))
    same = (gpu.view(torch.int32) == cpu.view(torch.int32)) | (torch.isnan(gpu) & torch.isnan(cpu))
    print(f"{name}: {int((~same).sum())} of {x.numel()} differ from the CPU stand-in; max rel {float(rel.max()):.3g}")
    if name in ("rsqrt_approx_ftz", "rsqrt_approx", "ex2_approx", "ex2_approx_ftz", "rcp_approx_ftz"):
        assert (~same).any(), f"{name} on CUDA gives the IEEE stand-in's bits everywhere: not the instruction?"


def test_instruction_ftz_behaviour():
    sub = 2.0**-130

    def on_gpu(name, v):
        return getattr(N, name)(torch.tensor([v], device="cuda")).item()

    assert on_gpu("rsqrt_approx_ftz", sub) == math.inf and on_gpu("rsqrt_approx_ftz", -sub) == -math.inf
    assert math.isclose(on_gpu("rsqrt_approx", sub), 2.0**65, rel_tol=2.0**-20)  # rsqrtf scales subnormals
    assert on_gpu("sqrt_approx_ftz", sub) == 0.0 and on_gpu("rcp_approx_ftz", sub) == math.inf
    assert math.isclose(on_gpu("rcp_full", 2.0**-127), 2.0**127, rel_tol=2.0**-20)
    assert on_gpu("ex2_approx_ftz", -130.0) == 0.0 and math.isclose(on_gpu("ex2_approx", -130.0), sub, rel_tol=2**-8)
    assert on_gpu("rsqrt_approx_ftz", math.inf) == 0.0 and on_gpu("expf", -math.inf) == 0.0
    assert math.isnan(on_gpu("rsqrt_approx", -1.0)) and on_gpu("rsqrt_approx", 0.0) == math.inf


# ---------------------------------------------------------------------------
# 2a. CPU == CUDA where no approximate instruction enters.


def test_fma_rn_and_row_trees_cpu_equal_cuda(gen):
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 1 << 20), generator=gen, dtype=torch.int64).to(torch.int32)
    a, b, c = bits.view(torch.float32)
    assert_bitwise(N.fma_rn(a.cuda(), b.cuda(), c.cuda()).cpu(), N.fma_rn(a, b, c), "fma_rn")
    x = _rows(16, 8192, gen, 10.0)
    for arch in N.ARCHS:
        for scaled in (False, True):
            assert_bitwise(N.row_sum_of_squares(x.cuda(), arch, scaled).cpu(), N.row_sum_of_squares(x, arch, scaled),
                           f"row sum {arch} scaled={scaled}")


def test_rope_residual_insert_cpu_equal_cuda(gen):
    x = _rows(12, 8 * 64, gen).view(12, 8, 64)
    positions = torch.randint(0, 4096, (12,), generator=gen)
    for table in (torch.bfloat16, torch.float32):
        rope = L.Rotary(64, 4096, table_dtype=table)
        cpu = rope.rotate(x, positions)
        assert_bitwise(rope.cuda().rotate(x.cuda(), positions.cuda()).cpu(), cpu, f"RoPE ({table})")
        rope.cpu()
    conn = L.GatedResidual(8192)
    conn.alpha.data = torch.rand(8192, generator=gen) + 0.5
    conn.beta.data = torch.rand(8192, generator=gen)
    s, br = _rows(8, 8192, gen, 10.0), _rows(8, 8192, gen).to(torch.bfloat16)
    cpu = conn(s, br)
    assert_bitwise(conn.cuda()(s.cuda(), br.cuda()).cpu(), cpu, "gated residual")
    k = torch.randn(9, 4, 64, generator=gen).bfloat16()
    v = torch.randn(9, 4, 64, generator=gen).bfloat16()
    slots = torch.tensor([3, -1, 17, 0, 31, -5, 8, 9, 30])
    caches = []
    for dev in ("cpu", "cuda"):
        cache = L.PagedKVCache(4, 4, 8, 64, device=dev)
        cache.tensor.fill_(float("nan"))  # poisoned: unwritten slots stay NaN
        cache.insert(k.to(dev), v.to(dev), slots.to(dev))
        caches.append(cache.tensor.cpu())
    assert_bitwise(caches[1], caches[0], "KV cache")


@pytest.mark.parametrize("s", [1, 129, 700])
def test_attention_and_exp_rn_cpu_equal_cuda(s, gen):
    x = torch.cat([torch.randn(1 << 18, generator=gen) * 40, torch.tensor(SPECIALS)])
    assert_bitwise(N.exp_rn(x.cuda()).cpu(), N.exp_rn(x), "exp_rn")
    m, heads, kv, blocks = 3, 16, 2, s // 16 + 3
    kvals = torch.randn(blocks, kv, 16, 128, generator=gen) * 3
    kvals[0, 0, :2, :10] = torch.tensor(SPECIALS[:10]).clamp(-1e4, 1e4)
    q = (torch.randn(m, heads, 64, generator=gen) * 2).bfloat16()
    slots = torch.stack([torch.randperm(blocks * 16, generator=gen)[:s] for _ in range(m)])
    slots[torch.rand(m, s, generator=gen) < 0.2] = -1
    outs = []
    for dev in ("cpu", "cuda"):
        cache = L.PagedKVCache(blocks, kv, 16, 64, device=dev)
        cache.tensor.copy_(kvals.bfloat16())
        outs.append(paged_attention(q.to(dev), cache, slots.to(dev), kv, empty_rows="nan").cpu())
    assert_bitwise(outs[1], outs[0], f"attention S={s}")


# ---------------------------------------------------------------------------
# 2b. Where an approximate instruction enters: CPU with the GPU's instruction == CUDA.


def _norm(h, gen, **kw) -> L.RMSNorm:
    norm = L.RMSNorm(h, **kw)
    if norm.weight is not None:
        norm.weight.data = (1 + 0.2 * torch.randn(h, generator=gen)).to(norm.weight.dtype)
        norm.weight.data[:3] = torch.tensor([-0.0, 0.0, -2.0])
    return norm


NORM_VARIANTS = [
    {},
    {"has_weight": False},
    {"weight_dtype": torch.float32, "gain_center": 1.0},
    {"weight_dtype": torch.bfloat16, "gain_center": 1.0, "weight_before_norm": True},
    {"weight_dtype": torch.float16, "weight_before_norm": True, "eps": 1e-5},
    {"out_dtype": torch.float32},
]


@pytest.mark.parametrize("arch", N.ARCHS)
@pytest.mark.parametrize("variant", range(len(NORM_VARIANTS)))
def test_rmsnorm_cpu_with_gpu_rsqrt_equals_cuda(arch, variant, gen, gpu_instructions):
    h = 8192
    norm = _norm(h, gen, arch=arch, **NORM_VARIANTS[variant])
    for x in (_rows(7, h, gen).to(torch.bfloat16), _rows(5, h, gen, 1e3)):
        cpu = norm(x)
        cuda = norm.cuda()(x.cuda())
        norm.cpu()
        assert_bitwise(cuda.cpu(), cpu, f"RMSNorm {arch} {NORM_VARIANTS[variant]}")


@pytest.mark.parametrize("arch", N.ARCHS)
def test_boundary_cpu_with_gpu_rsqrt_equals_cuda(arch, gen, gpu_instructions):
    h = 8192
    post, pre = _norm(h, gen, arch=arch), _norm(h, gen, weight_dtype=torch.float32, gain_center=1.0, arch=arch)
    conn = L.GatedResidual(h)
    conn.alpha.data = torch.rand(h, generator=gen) + 0.5
    conn.beta.data = torch.rand(h, generator=gen)
    branch = _rows(16, h, gen).to(torch.bfloat16)
    for stream in (_rows(16, h, gen, 10.0), _rows(16, h, gen, 10.0).to(torch.bfloat16)):
        cpu = L.residual_boundary(post, conn, pre, branch, stream)
        cuda = L.residual_boundary(post.cuda(), conn.cuda(), pre.cuda(), branch.cuda(), stream.cuda())
        for mod in (post, conn, pre):
            mod.cpu()
        assert_bitwise(cuda[0].cpu(), cpu[0], "new stream")
        assert_bitwise(cuda[1].cpu(), cpu[1], "boundary output")


def test_head_norms_cpu_with_gpu_instructions_equal_cuda(gen, gpu_instructions):
    x = _rows(40, 8 * 64, gen).view(40, 8, 64).to(torch.bfloat16)
    g = _rows(40, 8 * 64, gen, 8.0).view(40, 8, 64).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (40,), generator=gen)
    norm = L.HeadNorm(64, 1e-6)
    for table in (torch.bfloat16, torch.float32):
        rope = L.Rotary(64, 4096, table_dtype=table)
        cpu = L.qk_norm_rope(x, norm, positions, rope)
        cuda = L.qk_norm_rope(x.cuda(), norm, positions.cuda(), rope.cuda())
        assert_bitwise(cuda.cpu(), cpu, f"QK-norm + RoPE ({table})")
    assert_bitwise(L.k_norm_context(x.cuda(), norm).cpu(), L.k_norm_context(x, norm), "K-norm")
    for arch in N.ARCHS:
        for rows in (8, 40):  # 64 and 320 rows: both FlashInfer layouts
            cpu = L.o_gate(x[:rows], g[:rows], norm, arch)
            assert_bitwise(L.o_gate(x[:rows].cuda(), g[:rows].cuda(), norm, arch).cpu(), cpu, f"o-gate {arch}")


def test_silu_and_mul_cpu_with_gpu_expf_equals_cuda(gen, gpu_instructions):
    gu = (_rows(16, 2 * 4096, gen) * 4).to(torch.bfloat16)
    gu[0, 4096:4100] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")])
    assert_bitwise(L.silu_and_mul(gu.cuda(), 4096).cpu(), L.silu_and_mul(gu, 4096), "SiluAndMul")


def test_the_cpu_standins_differ_from_the_gpu_only_at_the_instructions(gen):
    """Without the injection the CPU spec may differ from CUDA (the stand-in
    is not MUFU.RSQ), in few outputs: a row's scale differs in its last bits,
    which moves only the outputs near a BF16 rounding boundary (counted,
    printed; NaN payloads excepted)."""
    h = 8192
    norm = _norm(h, gen)
    x = _rows(64, h, gen).to(torch.bfloat16)
    diff = int(mismatches(norm(x), norm.cuda()(x.cuda()).cpu()).sum())
    print(f"RMSNorm CPU stand-in vs CUDA: {diff} of {x.numel()} outputs differ")
    assert diff < x.numel() // 1000


# ---------------------------------------------------------------------------
# 3. The spec on CUDA against vLLM 0.33.0's stock binaries.


def _stock_dir() -> Path | None:
    import os

    root = Path(os.environ.get("DSPARK_STOCK_DIR", REPO / ".device" / "stock"))
    return root if (root / "manifest.json").is_file() else None


@pytest.fixture(scope="module")
def check_spec():
    if _stock_dir() is None:
        pytest.skip("no stock binaries (run scripts/stock/compile_stock.py; carry .device/stock)")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("check_spec compares against the sm_90 stock (FLA's o-gate, the sm_90 cubins)")
    sys.path.insert(0, str(REPO / "scripts" / "stock"))
    try:
        import check_spec as C
    finally:
        sys.path.pop(0)
    return C


@pytest.mark.parametrize("part", ["rmsnorm", "qknorm_rope", "context", "silu", "o_gate"])
def test_spec_on_cuda_equals_the_stock_kernels(part, check_spec, seed):
    check_spec.RESULTS.clear()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    getattr(check_spec, f"check_{part}")([1, 2, 7, 16, 133], gen)
    torch.cuda.synchronize()
    assert check_spec.RESULTS, part
    bad = [(name, n, total) for name, n, total in check_spec.RESULTS if n != 0]
    assert not bad, f"{part}: the spec differs from the stock in {bad}"


def test_independent_matches_cuda_spec_on_normal_rows(gen):
    """The chain closes: the independent NumPy implementation, with the GPU's
    rsqrt.approx.ftz injected, equals the spec run on CUDA for the row norm
    (both archs)."""

    def gpu_rsqrt(v):
        return N.rsqrt_approx_ftz(torch.from_numpy(np.ascontiguousarray(v)).cuda()).cpu().numpy()

    ops = I.Approx(rsqrt_approx_ftz=gpu_rsqrt)
    x = I.random_in(np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen))), (4, 8192), "bf16",
                    "normal")
    for arch in N.ARCHS:
        norm = L.RMSNorm(8192, has_weight=False, arch=arch).cuda()
        got = norm(I.to_torch(x, "bf16").cuda()).cpu()
        I.assert_same_bits(got, I.rmsnorm(x, None, arch=arch, ops=ops), f"independent vs CUDA {arch}")
