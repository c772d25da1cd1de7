"""GPU tests of ``dspark_cute.cutedsl.gating.mlp_activation.MlpActivation`` and
``dspark_cute.cutedsl.gating.o_gate.OGate``: bit for bit the spec
(``dspark_core.spec.layers.silu_and_mul`` and ``o_gate``, run on the same CUDA
device, where it runs the stock's own approximate instructions) and vLLM
0.33.0's stock kernels (the carried binaries, ``stock.py``: ``act_and_mul_kernel``
and FLA's ``layer_norm_gated_fwd_kernel``), compared with
``dspark_core.tools.compare.assert_bitwise`` (any NaN equals any NaN).

- ``dspark_cute.ptx.math`` alone, FP32 in and out (a probe kernel): its
  ``expf`` against the spec's ``expf`` on CUDA (CUDA's own ``expf``) and its
  ``exp_rn`` against the spec's, on 2^24 random FP32 bit patterns, 2^24
  values spread over the exponential's range (its subnormal results and
  overflow included) and every BF16 pattern and its negation;
- the activation: every one of the 65536 BF16 gate patterns, each paired
  with every special up value (+-0, +-inf, NaN, subnormals, the largest
  finite, ...), with 1.0 and with random values, against the spec and the
  stock; random rows with special rows planted (-0.0, subnormals, +-inf,
  NaN, near-overflow) for m in {1, 2, 7, 16, 133, 4096} at I = 16384 and
  8192, against the spec and the stock; gates where expf over- and
  underflows; I of 8, 24, 11008; leading dimensions; without PDL;
- the o-gate in FLA's arithmetic (``arch="sm_90a"``, the H200's stock),
  against the spec and the stock, and in FlashInfer's (``"sm_100a"``, the
  B200's stock: the same instructions run here, so against the spec on this
  GPU): every BF16 gate pattern (a column slice of a wider QKV-like tensor)
  with random and special attention rows; random rows with special ones
  planted for m in {1, 2, 7, 16, 133, 4096} at 64 and 32 heads (rows = m *
  heads on both sides of FlashInfer's 256-row layout switch), eps 1e-6 and
  1e-5; special heads (zeros with eps 0, one inf, huge squares that
  overflow, tiny ones that underflow); 1, 5 and 40 heads; a single row;
  ``[m, heads, 64]`` views; without PDL;
- a CUDA graph capture replayed on new data gives the eager bits; a compile
  during capture raises RuntimeError (last in the file).

Every output is poisoned (a NaN pattern, then a finite one) before each
launch, so an element the kernel leaves unwritten shows. Fresh seeded random
data: the seed is printed (repeat with DSPARK_SEED)."""

from __future__ import annotations

import cutlass.cute as cute
import pytest
import torch
from cute_testing import assert_replays_repeat, capture_calls, check_poisoned, random_rows, requires_cuda, special_rows
from cutlass import Int32, Int64

from dspark_core.contracts.constants import MlpActivationConstants, OGateConstants
from dspark_core.spec import numerics
from dspark_core.spec.layers import HeadNorm, o_gate, silu_and_mul
from dspark_core.tools.compare import assert_bitwise
from dspark_cute import ptx
from dspark_cute.ptx import math as ptx_math
from dspark_cute.runtime.host import compile_kernel, current_stream, fake_ptr, fake_stream, ptr

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
ROWS = [1, 2, 7, 16, 133, 4096]
# (intermediate size I, heads, KV heads): the reference draft and its TP2 shard.
SIZES = [(16384, 64, 8), (8192, 32, 4)]
ARCHS = ["sm_90a", "sm_100a"]
# BF16 bit patterns paired with every gate pattern: +-0, +-inf, NaN (both
# signs), the smallest subnormals, a subnormal, the smallest normal, the
# largest finite values, 1, -1, 3.140625, 2^-100.
SPECIAL_BITS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x8001, 0x0055, 0x0080, 0x7F7F,
                0xFF7F, 0x3F80, 0xBF80, 0x4049, 0x0D80]


@pytest.fixture(scope="module")
def stock_kernels():
    """``stock.py``'s launcher of vLLM 0.33.0's carried stock binaries
    (``stock_silu_and_mul``, ``stock_o_gate``), or a skip saying how to build
    them; the binaries compared here are the sm_90 ones (an H100/H200)."""
    from stock import stock_or_skip

    return stock_or_skip()


def bf16_bits(values, device="cuda") -> torch.Tensor:
    """BF16 tensor of the given 16-bit patterns."""
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values], dtype=torch.int16,
                        device=device).view(BF16)


def all_bf16(device="cuda") -> torch.Tensor:
    """Every BF16 bit pattern once, ``[65536]``."""
    return torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(BF16)


def planted_rows(gen: torch.Generator, m: int, h: int) -> torch.Tensor:
    """Random BF16 rows ``[m, h]`` (a wide exponent range) with the special
    rows of ``cute_testing.special_rows`` planted over the first ones (as
    many as fit), and for m of 2 to 9 single special values planted in row 1
    (-0.0, subnormals, +-inf, NaN, near-overflow)."""
    x = random_rows(gen, m, h, BF16, "cuda")
    specials = special_rows(h, BF16, "cuda")
    k = min(m, specials.shape[0]) if m >= 10 else 0
    x[:k] = specials[:k]
    if 2 <= m < 10:
        x[1, : len(SPECIAL_BITS)] = bf16_bits(SPECIAL_BITS)
        x[1, len(SPECIAL_BITS) :: 7] = -0.0
    return x


# ---------------------------------------------------------------- ptx_math alone (FP32 bits)


_PROBE_OPS = {"exp_rn": ptx_math.exp_rn, "expf": ptx_math.expf}
_SPEC_OPS = {"exp_rn": numerics.exp_rn, "expf": numerics.expf}


class MathProbe:
    """A test kernel: ``y = op(x)`` over FP32 ``[n]`` (n a multiple of 512),
    4 values per thread, ``op`` one of ``dspark_cute.ptx.math``'s ``exp_rn``
    and ``expf``. Call: ``(x, y, n, stream)``."""

    def __init__(self, op: str) -> None:
        self.op = op

    @cute.jit
    def __call__(self, x: cute.Pointer, y: cute.Pointer, n: Int32, stream):
        self.kernel(x, y).launch(grid=[n // 512, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, y: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        _probe_body(_PROBE_OPS[self.op], tidx, cta, x.toint(), y.toint())


def _probe_body(fn, tidx, cta, x, y) -> None:
    offset = (Int64(cta) * 128 + Int64(tidx)) * 16
    words = ptx.ld_global_v4(Int64(x) + offset)
    ptx.st_global_v4(Int64(y) + offset, [ptx.as_u32(fn(ptx.as_f32(w))) for w in words])


def _probe(op: str):
    return compile_kernel(MathProbe(op), fake_ptr("fp32"), fake_ptr("fp32"), Int32(512), fake_stream(),
                          what="the ptx_math probe")


def probe_inputs(gen: torch.Generator) -> torch.Tensor:
    """FP32 ``[2^25 + 2^17]``: random bit patterns (every class: NaNs,
    infinities, subnormals, both signs), values uniform in [-110, 110] (the
    exponentials' overflow near 88.72 and their subnormal results below
    -87.3), and every BF16 pattern widened, and negated."""
    bits = torch.randint(-2**31, 2**31, (2**24,), generator=gen, device="cuda", dtype=torch.int64)
    spread = torch.rand(2**24, generator=gen, device="cuda") * 220.0 - 110.0
    every = all_bf16().float()
    return torch.cat([bits.to(torch.int32).view(torch.float32), spread, every, -every])


@pytest.mark.parametrize("op", ["expf", "exp_rn"])
def test_ptx_math_fp32_bits(op, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = probe_inputs(gen)
    y = torch.empty_like(x)
    _probe(op)(ptr(x), ptr(y), Int32(x.numel()), current_stream())
    torch.cuda.synchronize()
    assert_bitwise(y, _SPEC_OPS[op](x), f"ptx_math {op}")


# ---------------------------------------------------------------- the gated SiLU activation


def _act(i: int, **options):
    from dspark_cute.cutedsl.gating.mlp_activation import MlpActivation

    act = MlpActivation(MlpActivationConstants(i), **options)
    act.prepare()
    return act


def check_activation(act, gu: torch.Tensor, what: str, stock=None) -> torch.Tensor:
    """The kernel's output on ``gu`` (poisoned twice) against the spec on
    the same device and, given ``stock`` (``stock.py``'s launcher), against
    vLLM's stock ``SiluAndMul`` on the same operands; returns the expected
    bits."""
    i = act.intermediate_size
    expected = silu_and_mul(gu, i)
    assert act.takes(gu)
    out = torch.empty(expected.shape, dtype=BF16, device="cuda")
    check_poisoned(lambda: act.run(gu, out), [out], [expected], what)
    assert_bitwise(act.run(gu), expected, f"{what} (allocated output)")
    if stock is not None:
        flat = gu.reshape(-1, 2 * i)
        assert_bitwise(out.reshape(-1, i), stock.stock_silu_and_mul(flat), f"{what} vs the stock kernel")
    return expected


def exhaustive_gu(i: int, gen: torch.Generator) -> torch.Tensor:
    """``gu [4 P, 2I]``: P copies of every gate pattern (``[4, I]`` each when
    I = 16384), copy ``c < len(SPECIAL_BITS)`` paired with the specials
    shifted by ``c`` (so every gate meets every special), then with 1.0, then
    with random up values."""
    g = all_bf16().reshape(-1, i)
    specials = bf16_bits(SPECIAL_BITS)
    idx = torch.arange(g.numel(), device="cuda").reshape(g.shape)
    ups = [specials[(idx + c) % len(SPECIAL_BITS)] for c in range(len(SPECIAL_BITS))]
    ups.append(torch.ones_like(g))
    ups.append(random_rows(gen, g.shape[0], i, BF16, "cuda"))
    gate = g.repeat(len(ups), 1)
    return torch.cat([gate, torch.cat(ups, dim=0)], dim=1).contiguous()


def test_activation_exhaustive_gate(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(16384)
    check_activation(act, exhaustive_gu(16384, gen), "every gate pattern")


def test_activation_exhaustive_gate_vs_stock(stock_kernels, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(16384)
    check_activation(act, exhaustive_gu(16384, gen), "every gate pattern", stock_kernels)


@pytest.mark.parametrize("i", [s[0] for s in SIZES])
@pytest.mark.parametrize("m", ROWS)
def test_activation_rows(i, m, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(i)
    check_activation(act, planted_rows(gen, m, 2 * i), f"I={i} m={m}")


@pytest.mark.parametrize("i", [s[0] for s in SIZES])
@pytest.mark.parametrize("m", ROWS)
def test_activation_rows_vs_stock(i, m, stock_kernels, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(i)
    gu = planted_rows(gen, m, 2 * i)
    # Larger gates too (x4): more of them where expf's reduction and the division's range matter.
    gu[m // 2 :, :i] = (gu[m // 2 :, :i].float() * 4).to(BF16)
    check_activation(act, gu, f"I={i} m={m}", stock_kernels)


@pytest.mark.parametrize("i", [8, 24, 11008])
def test_activation_odd_sizes(i, seed):
    """I of one vector a row, of three, and one not a power of two: the tail
    guard and the row split of the flat vector index."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(i)
    for m in (1, 5, 133):
        check_activation(act, planted_rows(gen, m, 2 * i), f"I={i} m={m}")


@pytest.mark.parametrize("i", [8, 24, 11008])
def test_activation_odd_sizes_vs_stock(i, stock_kernels, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(i)
    for m in (1, 5, 133):
        check_activation(act, planted_rows(gen, m, 2 * i), f"I={i} m={m}", stock_kernels)


def expf_edges(i: int) -> torch.Tensor:
    """Gates ``[2, I]`` where expf(-x) over- and underflows (x near -88.7
    and 87.3 .. 104), around its range switches, huge and subnormal."""
    edges = torch.tensor([88.0, 88.75, 89.0, 95.0, 100.0, 103.5, 104.0, 105.0, 87.5, 87.25, 126.0, 127.0,
                          -88.0, -88.5, -88.75, -89.0, -103.5, -104.0, -104.5, -126.0, 1e30, -1e30, 3.3e38,
                          -3.3e38, 60.0, -60.0, 1e-40, -1e-40, 0.5, -0.5, 2.0**-130, -(2.0**-130)], device="cuda")
    return edges.repeat(2 * i // edges.numel() + 1)[: 2 * i].reshape(2, i).to(BF16)


def test_activation_special_values(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    i = 8192
    act = _act(i)
    rows = special_rows(2 * i, BF16, "cuda")  # specials in the gate and in the up half
    check_activation(act, rows, "special rows")
    # Special gates against random ups, random gates against special ups.
    rnd = random_rows(gen, rows.shape[0], 2 * i, BF16, "cuda")
    check_activation(act, torch.cat([rows[:, :i], rnd[:, i:]], dim=1).contiguous(), "special gates")
    check_activation(act, torch.cat([rnd[:, :i], rows[:, i:]], dim=1).contiguous(), "special ups")
    u = random_rows(gen, 2, i, BF16, "cuda")
    u[1, ::3] = -0.0  # a -0.0 up: up + 0.0 is +0.0
    check_activation(act, torch.cat([expf_edges(i), u], dim=1).contiguous(), "expf's range edges")


def test_activation_special_values_vs_stock(stock_kernels, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    i = 8192
    act = _act(i)
    rows = special_rows(2 * i, BF16, "cuda")
    rnd = random_rows(gen, rows.shape[0], 2 * i, BF16, "cuda")
    u = random_rows(gen, 2, i, BF16, "cuda")
    u[:, ::3] = -0.0
    for name, gu in (
        ("special rows", rows),
        ("special gates", torch.cat([rows[:, :i], rnd[:, i:]], dim=1)),
        ("special ups", torch.cat([rnd[:, :i], rows[:, i:]], dim=1)),
        ("expf's range edges", torch.cat([expf_edges(i), u], dim=1)),
    ):
        check_activation(act, gu.contiguous(), name, stock_kernels)


def test_activation_leading_dims(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(8192)
    gu = random_rows(gen, 6, 2 * 8192, BF16, "cuda").reshape(2, 3, 2 * 8192)
    expected = check_activation(act, gu, "[2, 3, 2I]")
    assert expected.shape == (2, 3, 8192)


def test_activation_without_pdl(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(16384, pdl=False)
    assert act.pdl is False
    for m in (1, 133):
        check_activation(act, random_rows(gen, m, 2 * 16384, BF16, "cuda"), f"no PDL m={m}")


def test_activation_refuses_bad_operands(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    i = 8192
    act = _act(i)
    good = random_rows(gen, 4, 2 * i, BF16, "cuda")
    assert act.takes(good)
    for gu in (
        good.float(),
        good[:, :i].contiguous(),  # the wrong width
        torch.zeros(4, 4 * i, dtype=BF16, device="cuda")[:, ::2],  # not contiguous
        good.flatten()[4 : 4 + 2 * 2 * i].view(2, 2 * i),  # 8 bytes off alignment
        good[:0],  # no rows
    ):
        with pytest.raises(ValueError):
            act.run(gu)
    for out in (
        torch.empty(4, i, dtype=torch.float32, device="cuda"),
        torch.empty(4, i - 8, dtype=BF16, device="cuda"),
        torch.empty(i, 4, dtype=BF16, device="cuda").t(),
        torch.empty(4, i, dtype=BF16),
    ):
        with pytest.raises(ValueError):
            act.run(good, out)


# ---------------------------------------------------------------- the o-gate


def _og(heads: int, eps: float = 1e-6, arch: str = "sm_90a", **options):
    from dspark_cute.cutedsl.gating.o_gate import OGate

    og = OGate(OGateConstants(heads, eps, arch), **options)
    og.prepare()
    return og


def qkv_gate(gen: torch.Generator, m: int, heads: int, kv: int, gate=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random QKV-like projection ``[m, (2 heads + 2 kv) 64]`` and its o-gate
    column slice ``qkv[:, q + 2 kv:]`` (row stride = the projection's width);
    the slice's values are ``gate`` where given."""
    q, k = heads * 64, kv * 64
    qkv = random_rows(gen, m, 2 * q + 2 * k, BF16, "cuda")
    if gate is not None:
        qkv[:, q + 2 * k :] = gate
    return qkv, qkv[:, q + 2 * k :]


def check_o_gate(og, attn: torch.Tensor, gate: torch.Tensor, what: str, stock=None) -> torch.Tensor:
    """The kernel's output (poisoned twice) against the spec's ``o_gate`` of
    the kernel's arch with a weightless ``HeadNorm(64, eps)`` on the same
    device and, given ``stock``, against FLA's stock kernel (sm_90a) on the
    same operands (the gate the same strided view)."""
    m, heads = attn.shape[0], og.heads
    norm = HeadNorm(64, og.eps)
    a3, g3 = attn.reshape(m, heads, 64), gate.reshape(m, heads, 64)
    expected = o_gate(a3, g3, norm, og.arch).reshape(attn.shape)
    assert og.takes(attn, gate)
    out = torch.empty(attn.shape, dtype=BF16, device="cuda")
    check_poisoned(lambda: og.run(attn, gate, out), [out], [expected], f"{what} [{og.arch}]")
    assert_bitwise(og.run(attn, gate), expected, f"{what} [{og.arch}] (allocated output)")
    if stock is not None:
        assert og.arch == "sm_90a"
        want = stock.stock_o_gate(a3.clone(), g3, og.eps).reshape(attn.shape)
        assert_bitwise(out, want, f"{what} vs FLA's stock kernel")
    return expected


def planted_heads(gen: torch.Generator, m: int, heads: int) -> torch.Tensor:
    """``planted_rows`` of ``[m, heads * 64]`` with, where m > 1, special
    heads in row 0: zeros, one +inf, one -inf, one NaN, all near overflow
    (3e38: the squares overflow), all tiny (their squares underflow), all
    the smallest subnormal, -0.0 and subnormals mixed in."""
    x = planted_rows(gen, m, heads * 64)
    if m > 1 and heads >= 8:
        h = x[0].view(heads, 64)
        h[0] = 0.0
        h[1, 7] = float("inf")
        h[2, 63] = float("-inf")
        h[3, 0] = float("nan")
        h[4] = 3e38
        h[5] = 1e-38
        h[6] = bf16_bits([0x0001]).float()
        h[7, ::2] = -0.0
    return x


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads,kv", [s[1:] for s in SIZES])
@pytest.mark.parametrize("m", ROWS)
def test_o_gate_rows(arch, heads, kv, m, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for eps in (1e-6, 1e-5):
        og = _og(heads, eps, arch)
        gates = (random_rows(gen, m, heads * 64, BF16, "cuda").float() * 8).to(BF16)
        _, gate = qkv_gate(gen, m, heads, kv, gates)
        assert gate.stride(0) == (2 * heads + 2 * kv) * 64 or m == 1
        check_o_gate(og, planted_heads(gen, m, heads), gate, f"heads={heads} m={m} eps={eps}")


@pytest.mark.parametrize("heads,kv", [s[1:] for s in SIZES])
@pytest.mark.parametrize("m", ROWS)
def test_o_gate_rows_vs_stock(heads, kv, m, stock_kernels, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for eps in (1e-6, 1e-5):
        og = _og(heads, eps)
        gates = (random_rows(gen, m, heads * 64, BF16, "cuda").float() * 8).to(BF16)
        _, gate = qkv_gate(gen, m, heads, kv, gates)
        check_o_gate(og, planted_heads(gen, m, heads), gate, f"heads={heads} m={m} eps={eps}", stock_kernels)


def _every_gate(gen, heads: int, kv: int):
    """Every BF16 gate pattern once (16 rows of 64 heads) as the column slice
    of a wider tensor; random attention rows and special ones."""
    patterns = all_bf16().reshape(16, heads * 64)
    _, gate = qkv_gate(gen, 16, heads, kv, patterns)
    specials = special_rows(heads * 64, BF16, "cuda")
    return gate, random_rows(gen, 16, heads * 64, BF16, "cuda"), specials.repeat(2, 1)[:16].contiguous()


@pytest.mark.parametrize("arch", ARCHS)
def test_o_gate_exhaustive_gate(arch, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = _og(64, 1e-6, arch)
    gate, rnd, special = _every_gate(gen, 64, 8)
    check_o_gate(og, rnd, gate, "every gate pattern")
    check_o_gate(og, special, gate, "every gate pattern, special attention rows")
    # The [m, heads, 64] views of the same operands.
    check_o_gate(og, special.reshape(16, 64, 64), gate.reshape(16, 64, 64), "[m, heads, 64] views")


def test_o_gate_exhaustive_gate_vs_stock(stock_kernels, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = _og(64)
    gate, rnd, special = _every_gate(gen, 64, 8)
    check_o_gate(og, rnd, gate, "every gate pattern", stock_kernels)
    check_o_gate(og, special, gate, "every gate pattern, special attention rows", stock_kernels)


def _special_cases(gen, heads: int, kv: int):
    attn = special_rows(heads * 64, BF16, "cuda")
    extra = planted_heads(gen, 2, heads)
    extra[1].view(heads, 64)[:, ::2] = -0.0
    attn = torch.cat([attn, extra], dim=0).contiguous()
    m = attn.shape[0]
    for name, gate_rows in (
        ("random gates", random_rows(gen, m, heads * 64, BF16, "cuda")),
        ("special gates", special_rows(heads * 64, BF16, "cuda").repeat(2, 1)[:m]),
        ("special pattern gates", bf16_bits(SPECIAL_BITS).repeat(m * heads * 64 // len(SPECIAL_BITS) + 1)[
            : m * heads * 64].reshape(m, -1)),
    ):
        _, gate = qkv_gate(gen, m, heads, kv, gate_rows)
        yield name, attn, gate


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_o_gate_special_values(arch, eps, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = _og(32, eps, arch)
    for name, attn, gate in _special_cases(gen, 32, 4):
        check_o_gate(og, attn, gate, f"special attention rows, {name}, eps={eps}")


@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_o_gate_special_values_vs_stock(eps, stock_kernels, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = _og(32, eps)
    for name, attn, gate in _special_cases(gen, 32, 4):
        check_o_gate(og, attn, gate, f"special attention rows, {name}, eps={eps}", stock_kernels)


@pytest.mark.parametrize("arch", ARCHS)
def test_o_gate_small_shapes(arch, seed):
    """Head counts whose rows do not fill a CTA (the tail guard), a single
    row with an arbitrary stride, a gate stride other than the QKV's."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for heads in (1, 5, 40):
        og = _og(heads, 1e-6, arch)
        for m in (1, 3, 133):
            _, gate = qkv_gate(gen, m, heads, 1)
            check_o_gate(og, random_rows(gen, m, heads * 64, BF16, "cuda"), gate, f"heads={heads} m={m}")
    og = _og(5, 1e-6, arch)
    wide = random_rows(gen, 7, 5 * 64 + 24, BF16, "cuda")
    check_o_gate(og, random_rows(gen, 7, 5 * 64, BF16, "cuda"), wide[:, 8 : 8 + 5 * 64], "row stride 344")
    one = random_rows(gen, 1, 4096, BF16, "cuda")[:, 1024 : 1024 + 5 * 64]
    check_o_gate(og, random_rows(gen, 1, 5 * 64, BF16, "cuda"), one, "a single row")


def test_o_gate_small_heads_vs_stock(stock_kernels, seed):
    """8 heads (FLA's own row-count specializations: rows a multiple of 16
    or not) and 16, against the stock."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for heads in (8, 16):
        og = _og(heads)
        for m in (1, 2, 3, 133):
            _, gate = qkv_gate(gen, m, heads, 2)
            check_o_gate(og, planted_heads(gen, m, heads), gate, f"heads={heads} m={m}", stock_kernels)


@pytest.mark.parametrize("arch", ARCHS)
def test_o_gate_without_pdl(arch, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = _og(64, 1e-6, arch, pdl=False)
    assert og.pdl is False
    for m in (1, 133):
        _, gate = qkv_gate(gen, m, 64, 8)
        check_o_gate(og, random_rows(gen, m, 4096, BF16, "cuda"), gate, f"no PDL m={m}")


def test_o_gate_refuses_bad_operands(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = _og(32)
    qkv, gate = qkv_gate(gen, 4, 32, 4)
    attn = random_rows(gen, 4, 2048, BF16, "cuda")
    assert og.takes(attn, gate)
    for a, g in (
        (attn, qkv[:, 4 : 4 + 2048]),  # the gate 8 bytes off alignment
        (attn, qkv[:, ::2][:, :2048]),  # the gate's columns not contiguous
        (attn.flatten()[4 : 4 + 2048 * 3].view(3, 2048), gate[:3]),  # attn 8 bytes off alignment
        (attn.float(), gate),
        (attn, gate.cpu()),
    ):
        with pytest.raises(ValueError):
            og.run(a, g)
    with pytest.raises(ValueError):
        og.run(attn, gate, torch.empty(4, 2048, dtype=torch.float32, device="cuda"))


# ---------------------------------------------------------------- CUDA graphs


def test_activation_cuda_graph(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(16384)
    gu = random_rows(gen, 16, 2 * 16384, BF16, "cuda")
    out = torch.empty((16, 16384), dtype=BF16, device="cuda")
    graph = capture_calls(lambda: act.run(gu, out))
    for _ in range(2):
        gu.copy_(planted_rows(gen, 16, 2 * 16384))
        expected = silu_and_mul(gu, 16384)
        check_poisoned(graph.replay, [out], [expected], "graph replay")
        assert_replays_repeat(graph, [out])


@pytest.mark.parametrize("arch", ARCHS)
def test_o_gate_cuda_graph(arch, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv, m = 64, 8, 16
    og = _og(heads, 1e-6, arch)
    qkv, gate = qkv_gate(gen, m, heads, kv)
    attn = random_rows(gen, m, heads * 64, BF16, "cuda")
    out = torch.empty_like(attn)
    graph = capture_calls(lambda: og.run(attn, gate, out))
    norm = HeadNorm(64, 1e-6)
    for _ in range(2):
        qkv.copy_(qkv_gate(gen, m, heads, kv)[0])
        attn.copy_(planted_heads(gen, m, heads))
        expected = o_gate(attn.view(m, heads, 64), gate.reshape(m, heads, 64), norm, arch).reshape(m, -1)
        check_poisoned(graph.replay, [out], [expected], "graph replay")
        assert_replays_repeat(graph, [out])


# ---------------------------------------------------------------- last: refused captures


def test_activation_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.gating.mlp_activation import MlpActivation

    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = MlpActivation(MlpActivationConstants(40))  # constants no other test compiles
    gu = random_rows(gen, 2, 80, BF16, "cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            act.run(gu)


def test_o_gate_compile_refused_during_capture(seed):
    from dspark_cute.cutedsl.gating.o_gate import OGate

    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = OGate(OGateConstants(3, 3e-4))  # constants no other test compiles
    _, gate = qkv_gate(gen, 2, 3, 1)
    attn = random_rows(gen, 2, 3 * 64, BF16, "cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            og.run(attn, gate)
