"""GPU tests of ``dspark_cute.cutedsl.gating.mlp_activation.MlpActivation`` and
``dspark_cute.cutedsl.gating.o_gate.OGate``: bit for bit the stock ``GatedMLP.activation``
and ``o_gate`` (``dspark_core.spec.layers``, run on the same CUDA device; compared
with ``dspark_core.tools.compare.assert_bitwise``: any NaN equals any NaN).

- ``dspark_cute.ptx.math`` alone, FP32 in and out (a probe kernel): its
  ``exp_rn``, ``sigmoid_rn`` and ``silu_rn`` against the spec's on 2^24
  random FP32 bit patterns, 2^24 values spread over the exponential's range
  (its subnormal results included) and every BF16 pattern: the FP32 bits,
  which the BF16 outputs below mostly hide (a 1-ulp error of ``exp_rn``
  rarely moves a BF16 rounding);
- the activation: every one of the 65536 BF16 gate patterns, each paired
  with every special up value (0, -0, +-inf, NaN, subnormals, the largest
  finite, ...), with 1.0 and with random values; also against the spec run
  on the CPU (the spec's claim of device-independent bits, for this op);
- the o-gate: every BF16 gate pattern (given as a column slice of a wider
  QKV-like tensor, row stride = its width) with random attention rows;
- random rows (a wide exponent range) for m in {1, 2, 7, 16, 133, 1000},
  the reference sizes (I = 16384, 64 heads) and their TP2 shards (8192, 32);
- special rows (-0.0, subnormals, +-inf, NaN, huge squares that overflow,
  tiny ones that underflow, zero heads with eps 0);
- ``[m, heads, 64]`` views, leading dimensions, a single row, without PDL;
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
from dspark_core.spec.layers import GatedMLP, HeadNorm, o_gate
from dspark_core.tools.compare import assert_bitwise
from dspark_cute import ptx
from dspark_cute.ptx import math as ptx_math
from dspark_cute.runtime.host import compile_kernel, current_stream, fake_ptr, fake_stream, ptr

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16 = torch.bfloat16
ROWS = [1, 2, 7, 16, 133, 1000]
# (intermediate size I, heads, KV heads): the reference draft and its TP2 shard.
SIZES = [(16384, 64, 8), (8192, 32, 4)]
# BF16 bit patterns paired with every gate pattern: +-0, +-inf, NaN (both
# signs), the smallest subnormals, a subnormal, the smallest normal, the
# largest finite values, 1, -1, 3.140625, 2^-100.
SPECIAL_BITS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x8001, 0x0055, 0x0080, 0x7F7F,
                0xFF7F, 0x3F80, 0xBF80, 0x4049, 0x0D80]


def bf16_bits(values, device="cuda") -> torch.Tensor:
    """BF16 tensor of the given 16-bit patterns."""
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values], dtype=torch.int16,
                        device=device).view(BF16)


def all_bf16(device="cuda") -> torch.Tensor:
    """Every BF16 bit pattern once, ``[65536]``."""
    return torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(BF16)


# ---------------------------------------------------------------- ptx_math alone (FP32 bits)


_PROBE_OPS = {"exp": ptx_math.exp_rn, "sigmoid": ptx_math.sigmoid_rn, "silu": ptx_math.silu_rn}


class MathProbe:
    """A test kernel: ``y = op(x)`` over FP32 ``[n]`` (n a multiple of 512),
    4 values per thread, ``op`` one of ``dspark_cute.ptx.math``'s
    ``exp_rn``, ``sigmoid_rn``, ``silu_rn``. Call: ``(x, y, n, stream)``."""

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
    """FP32 ``[2^25 + 2^16]``: random bit patterns (every class: NaNs,
    infinities, subnormals, both signs), values uniform in [-110, 110] (the
    exponential's clamps at -104 and 88.72 and its subnormal results for
    arguments below -87.3), and every BF16 pattern widened."""
    bits = torch.randint(-2**31, 2**31, (2**24,), generator=gen, device="cuda", dtype=torch.int64)
    spread = torch.rand(2**24, generator=gen, device="cuda") * 220.0 - 110.0
    return torch.cat([bits.to(torch.int32).view(torch.float32), spread, all_bf16().float()])


@pytest.mark.parametrize("op", ["exp", "sigmoid", "silu"])
def test_ptx_math_fp32_bits(op, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = probe_inputs(gen)
    y = torch.empty_like(x)
    _probe(op)(ptr(x), ptr(y), Int32(x.numel()), current_stream())
    spec = {"exp": numerics.exp_rn, "sigmoid": numerics.sigmoid_rn, "silu": numerics.silu_rn}[op]
    torch.cuda.synchronize()
    assert_bitwise(y, spec(x), f"ptx_math {op}_rn")


# ---------------------------------------------------------------- the gated SiLU activation


def _act(i: int, **options):
    from dspark_cute.cutedsl.gating.mlp_activation import MlpActivation

    act = MlpActivation(MlpActivationConstants(i), **options)
    act.prepare()
    return act


def check_activation(act, gu: torch.Tensor, what: str) -> torch.Tensor:
    """The kernel's output on ``gu`` (poisoned twice) against the stock
    activation on the same device; returns the expected bits."""
    expected = GatedMLP(8, act.intermediate_size).activation(gu)
    assert act.takes(gu)
    out = torch.empty(expected.shape, dtype=BF16, device="cuda")
    check_poisoned(lambda: act.run(gu, out), [out], [expected], what)
    assert_bitwise(act.run(gu), expected, f"{what} (allocated output)")
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


def test_activation_exhaustive_matches_cpu_spec(seed):
    """The kernel against the spec run on the CPU (the spec promises the same
    bits there): every gate pattern with every special up value."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(16384)
    gu = exhaustive_gu(16384, gen)
    expected = GatedMLP(8, 16384).activation(gu.cpu())
    assert_bitwise(act.run(gu).cpu(), expected, "every gate pattern vs the CPU spec")


@pytest.mark.parametrize("i", [s[0] for s in SIZES])
@pytest.mark.parametrize("m", ROWS)
def test_activation_rows(i, m, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(i)
    check_activation(act, random_rows(gen, m, 2 * i, BF16, "cuda"), f"I={i} m={m}")


@pytest.mark.parametrize("i", [8, 24, 11008])
def test_activation_odd_sizes(i, seed):
    """I of one vector a row, of three, and one not a power of two: the tail
    guard and the row split of the flat vector index."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    act = _act(i)
    for m in (1, 5, 133):
        check_activation(act, random_rows(gen, m, 2 * i, BF16, "cuda"), f"I={i} m={m}")


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
    # Gates at the exp_rn branch points (-x > 88.72 overflows, -x < -104 underflows).
    # Gates in (87.3, 104) give subnormal exponentials (the split 2^n1 * 2^n2).
    edges = torch.tensor([88.0, 88.75, 89.0, 95.0, 100.0, 103.5, 104.0, 105.0, -88.75, -89.0, -103.5, -104.0,
                          -104.5, 1e30, -1e30, 60.0], device="cuda")
    g = edges.repeat(i // edges.numel() * 2)[: 2 * i].reshape(2, i).to(BF16)
    u = random_rows(gen, 2, i, BF16, "cuda")
    check_activation(act, torch.cat([g, u], dim=1).contiguous(), "exp branch points")


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


def _og(heads: int, eps: float = 1e-6, **options):
    from dspark_cute.cutedsl.gating.o_gate import OGate

    og = OGate(OGateConstants(heads, eps), **options)
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


def check_o_gate(og, attn: torch.Tensor, gate: torch.Tensor, what: str) -> torch.Tensor:
    """The kernel's output (poisoned twice) against the stock ``o_gate`` with a
    weightless ``HeadNorm(64, eps)`` on the same device."""
    m, heads = attn.shape[0], og.heads
    norm = HeadNorm(64, og.eps, has_weight=False)
    expected = o_gate(attn.reshape(m, heads, 64), gate.reshape(m, heads, 64), norm).reshape(attn.shape)
    assert og.takes(attn, gate)
    out = torch.empty(attn.shape, dtype=BF16, device="cuda")
    check_poisoned(lambda: og.run(attn, gate, out), [out], [expected], what)
    assert_bitwise(og.run(attn, gate), expected, f"{what} (allocated output)")
    return expected


@pytest.mark.parametrize("heads,kv", [s[1:] for s in SIZES])
@pytest.mark.parametrize("m", ROWS)
def test_o_gate_rows(heads, kv, m, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for eps in (1e-6, 1e-5):
        og = _og(heads, eps)
        _, gate = qkv_gate(gen, m, heads, kv)
        assert gate.stride(0) == (2 * heads + 2 * kv) * 64 or m == 1
        attn = random_rows(gen, m, heads * 64, BF16, "cuda")
        check_o_gate(og, attn, gate, f"heads={heads} m={m} eps={eps}")


def test_o_gate_exhaustive_gate(seed):
    """Every BF16 gate pattern once (16 rows of 64 heads), as the column slice
    of a wider tensor, with random attention rows and with special ones."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv = 64, 8
    og = _og(heads)
    patterns = all_bf16().reshape(16, heads * 64)
    _, gate = qkv_gate(gen, 16, heads, kv, patterns)
    check_o_gate(og, random_rows(gen, 16, heads * 64, BF16, "cuda"), gate, "every gate pattern")
    specials = special_rows(heads * 64, BF16, "cuda")
    attn = specials.repeat(2, 1)[:16].contiguous()
    check_o_gate(og, attn, gate, "every gate pattern, special attention rows")
    # The [m, heads, 64] views of the same operands.
    check_o_gate(og, attn.reshape(16, heads, 64), gate.reshape(16, heads, 64), "[m, heads, 64] views")


@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_o_gate_special_values(eps, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv = 32, 4
    og = _og(heads, eps)
    attn = special_rows(heads * 64, BF16, "cuda")
    m = attn.shape[0]
    # Heads of one kind each: zeros (eps 0: 0 * inf = NaN), one inf, one NaN,
    # all huge (the squares overflow: r = 0), all tiny (they underflow).
    extra = random_rows(gen, 2, heads * 64, BF16, "cuda").reshape(2, heads, 64)
    extra[0, 0] = 0.0
    extra[0, 1, 7] = float("inf")
    extra[0, 2, 63] = float("-inf")
    extra[0, 3, 0] = float("nan")
    extra[0, 4] = 3e38
    extra[0, 5] = 1e-38
    extra[0, 6] = bf16_bits([0x0001]).float()
    extra[1, :, ::2] = -0.0
    attn = torch.cat([attn, extra.reshape(2, -1)], dim=0).contiguous()
    m = attn.shape[0]
    for name, gate_rows in (
        ("random gates", random_rows(gen, m, heads * 64, BF16, "cuda")),
        ("special gates", special_rows(heads * 64, BF16, "cuda").repeat(2, 1)[:m]),
        ("special pattern gates", bf16_bits(SPECIAL_BITS).repeat(m * heads * 64 // len(SPECIAL_BITS) + 1)[
            : m * heads * 64].reshape(m, -1)),
    ):
        _, gate = qkv_gate(gen, m, heads, kv, gate_rows)
        check_o_gate(og, attn, gate, f"special attention rows, {name}, eps={eps}")


def test_o_gate_small_shapes(seed):
    """Head counts whose rows do not fill a CTA (the tail guard), a single
    row with an arbitrary stride, a gate stride other than the QKV's."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for heads in (1, 5, 40):
        og = _og(heads)
        for m in (1, 3, 133):
            _, gate = qkv_gate(gen, m, heads, 1)
            check_o_gate(og, random_rows(gen, m, heads * 64, BF16, "cuda"), gate, f"heads={heads} m={m}")
    og = _og(5)
    wide = random_rows(gen, 7, 5 * 64 + 24, BF16, "cuda")
    check_o_gate(og, random_rows(gen, 7, 5 * 64, BF16, "cuda"), wide[:, 8 : 8 + 5 * 64], "row stride 344")
    one = random_rows(gen, 1, 4096, BF16, "cuda")[:, 1024 : 1024 + 5 * 64]
    check_o_gate(og, random_rows(gen, 1, 5 * 64, BF16, "cuda"), one, "a single row")


def test_o_gate_without_pdl(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    og = _og(64, pdl=False)
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
    mlp = GatedMLP(8, 16384)
    for _ in range(2):
        gu.copy_(random_rows(gen, 16, 2 * 16384, BF16, "cuda"))
        expected = mlp.activation(gu)
        check_poisoned(graph.replay, [out], [expected], "graph replay")
        assert_replays_repeat(graph, [out])


def test_o_gate_cuda_graph(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv, m = 64, 8, 16
    og = _og(heads)
    qkv, gate = qkv_gate(gen, m, heads, kv)
    attn = random_rows(gen, m, heads * 64, BF16, "cuda")
    out = torch.empty_like(attn)
    graph = capture_calls(lambda: og.run(attn, gate, out))
    norm = HeadNorm(64, 1e-6)
    for _ in range(2):
        qkv.copy_(qkv_gate(gen, m, heads, kv)[0])
        attn.copy_(random_rows(gen, m, heads * 64, BF16, "cuda"))
        expected = o_gate(attn.view(m, heads, 64), gate.reshape(m, heads, 64), norm).reshape(m, -1)
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
