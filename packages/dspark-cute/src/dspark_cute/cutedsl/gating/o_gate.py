"""The o-gate kernel: ``dspark_core.spec.layers.o_gate(attn, gate, norm, arch)``
with the weightless o-norm, bit for bit the stock o-gate of ``arch``.

For the attention output ``attn`` (BF16 ``[m, heads * 64]``, contiguous) and
the o-gate rows of the QKV projection ``gate`` (BF16 ``[m, heads * 64]``, a
column slice with its own row stride) it writes BF16 ``out [m, heads * 64]``
(contiguous), per head of D = 64 columns ``x = attn[i, 64h : 64h + 64]``
and ``g = gate[i, 64h : 64h + 64]``, widened to FP32 exactly. The
arithmetic is the one of the constants' ``arch``, chosen at compile time:

- ``sm_90a``, FLA's Triton ``layer_norm_gated_fwd_kernel``:

  1. ``S``: the leaves ``fma.rn(x_4j, x_4j, mul.rn(x_4j+1, x_4j+1))`` and
     ``fma.rn(x_4j+2, x_4j+2, mul.rn(x_4j+3, x_4j+3))``, their sum ``F_j``
     (``add.rn``; FLA's lane ``j`` of 16), the 16 ``F_j`` folded by halves
     (``F_j + F_j+8``, then 4, 2, 1);
  2. ``v = fma.rn(S, 2^-6, eps)``, ``rstd = div.full(1,
     sqrt.approx.ftz(v))``;
  3. per column ``h = mul.rn(x, rstd)``, ``z = mul.rn(g, -log2 e)``
     (``0xBFB8AA3B``), ``sig = div.full(1, add.rn(ex2.approx(z), 1))``,
     ``out = cvt.rn.bf16(mul.rn(h, sig))``;

- ``sm_100a``, FlashInfer's ``rmsnorm_sigmoid_gate``:

  1. ``S``: the 64 squares ``mul.rn(x_c, x_c)`` summed by the pairwise tree
     of neighbours in column order (``add.rn``);
  2. ``v = fma.rn(S, 2^-6, eps)``, ``inv = rsqrt.approx.ftz(v)``;
  3. per column ``z = mul.rn(g, -log2 e)``, ``sig =
     rcp.approx.ftz(add.rn(ex2.approx.ftz(z), 1))``, ``out =
     cvt.rn.bf16(mul.rn(sig, mul.rn(x, inv)))``.

  FlashInfer lays a head over 32 lanes of 2 columns up to 256 rows (``m *
  heads``) and over 8 lanes of 8 above, each lane's squares summed
  pairwise, the lane sums by ascending butterflies: both are the pairwise
  tree over the 64 squares, so the kernel has one path for every row count.

These are the only approximate instructions and the only fused
multiply-adds (NaN payloads aside, the result is a function of the input
bits: ``dspark_core.spec.numerics`` runs the same instructions on CUDA).

Layout: one thread per 8 consecutive columns (a 16-byte vector), 8 threads
per head: thread ``v = cta * 128 + tid`` of a 1-D grid handles vector ``v``
of the ``m * heads * 8`` vectors (row ``v // (heads * 8)``), so the 8 lanes
``8k .. 8k + 7`` of a warp hold one head, lane ``l`` its columns ``8 (l %
8) .. + 7`` (``head_sum_of_squares``: on sm_90a FLA's lanes ``2l`` and ``2l
+ 1``, their folds 8, 4, 2 the butterflies ``l ^ 4``, ``l ^ 2``, ``l ^ 1``
and the last fold in the thread; on sm_100a the thread's pairwise tree,
then the butterflies ``l ^ 1``, ``l ^ 2``, ``l ^ 4``); every lane ends
with the same sum (``a + b == b + a`` bit for bit). A thread past the end
computes the last vector again (the shuffles need every lane) and its store
is predicated off. ``m`` and the gate's row stride are runtime arguments;
``heads``, ``eps`` and ``arch`` are compile-time. With ``pdl`` the kernel
waits for the previous grid before its loads, then releases the next one.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from dspark_core import checks
from dspark_core.contracts.constants import HEAD_DIM, OGateConstants, stock_arch, within_limits
from dspark_cute import ptx
from dspark_cute.cutedsl.gating.elementwise import vector_index
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    LazyPdl,
    current_stream,
    describe,
    fake_ptr,
    fake_stream,
    jit_cache,
    ptr,
)

# The stock o-gates this kernel reproduces: FLA's Triton kernel (sm_90a) and
# FlashInfer's CuTe kernel (sm_100a).
ARCHS = checks.ARCHS
# Threads per CTA (each 8 columns; 16 heads per CTA).
THREADS = 128
# Columns per thread (one 16-byte BF16 vector) and threads per head.
VEC = 8
HEAD_THREADS = HEAD_DIM // VEC
# The vector index v = cta * THREADS + tid is an Int32: m * heads * 8 stays below this.
MAX_VECTORS = 2**31 - THREADS
# -log2(e) rounded to FP32 (both stock kernels' sigmoid scale) and 1/64.
NEG_LOG2E_BITS = 0xBFB8AA3B
INV_D_BITS = 0x3C800000
# FLA's lanes: 4 columns each, 16 a head.
FLA_COLUMNS = 4


def check_arch(arch) -> str:
    """``arch`` in its one spelling if a stock o-gate of it is known
    (``dspark_core.contracts.constants.stock_arch``), else Unsupported."""
    return stock_arch(arch, "stock o-gate")


def check_constants(c: OGateConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (an OGateConstants): its
    limits (``dspark_core.contracts.limits``: at least one head) and an arch
    of ``ARCHS``; its eps is checked where the constants are built
    (``contracts.constants._Key``: non-negative, finite in FP32)."""
    if not isinstance(c, OGateConstants):
        raise ValueError(f"OGate takes OGateConstants, not {type(c).__name__}")
    within_limits(c)
    check_arch(c.arch)


# ---------------------------------------------------------------- traced pieces
# Shared with the staged attention's o-gate epilogue (which holds a head as
# 32 lanes of 2 columns).


def _bfly(value, offset: int) -> Float32:
    return cute.arch.shuffle_sync_bfly(value, offset=offset)


def head_sum_of_squares(x: list, arch: str) -> Float32:
    """The stock o-norm's sum of squares of a 64-wide head held by
    ``64 / n`` consecutive lanes (aligned to their count), lane ``l`` of
    them columns ``n l .. n l + n - 1`` as ``x`` (``n`` FP32, a power of two
    from 2 to 64); every lane of the head returns it:

    - sm_90a: FLA's lane sums ``F_j = fma(x0, x0, x1 * x1) + fma(x2, x2,
      x3 * x3)`` over its lanes of 4 columns, folded by halves; a fold over
      FLA lanes that lie in other threads is a butterfly (offset the FLA
      offset times the threads per FLA lane, or over the FLA lanes per
      thread), the ones within the thread are sums in it; with 2 columns a
      thread holds one leaf and the butterfly 1 makes ``F_j``;
    - sm_100a: the squares rounded, summed pairwise in the thread, then the
      butterflies 1, 2, 4, ... over the lanes (the pairwise tree of the 64)."""
    n = len(x)
    lanes = HEAD_DIM // n
    if arch == "sm_90a":
        leaves = [ptx.fma_rn(x[k], x[k], ptx.mul_rn(x[k + 1], x[k + 1])) for k in range(0, n, 2)]
        if n < FLA_COLUMNS:
            # Two threads per FLA lane: its two leaves, then the folds 8 .. 1.
            s = ptx.add_rn(leaves[0], _bfly(leaves[0], 1))
            for offset in (8, 4, 2, 1):
                s = ptx.add_rn(s, _bfly(s, offset * (FLA_COLUMNS // n)))
            return s
        f = [ptx.add_rn(leaves[2 * j], leaves[2 * j + 1]) for j in range(n // FLA_COLUMNS)]
        per = len(f)  # FLA lanes in this thread
        for offset in (8, 4, 2, 1):
            if offset >= per:
                f = [ptx.add_rn(v, _bfly(v, offset // per)) for v in f]
            else:
                f = [ptx.add_rn(f[j], f[j + offset]) for j in range(offset)]
        return f[0]
    s = ptx.pairwise([ptx.mul_rn(v, v) for v in x])
    offset = 1
    while offset < lanes:
        s = ptx.add_rn(s, _bfly(s, offset))
        offset *= 2
    return s


def o_norm_scale(total, eps: float, arch: str) -> Float32:
    """The o-norm's factor of the sum of squares ``total``: ``v =
    fma.rn(total, 2^-6, eps)``, then ``div.full(1, sqrt.approx.ftz(v))``
    (sm_90a) or ``rsqrt.approx.ftz(v)`` (sm_100a)."""
    v = ptx.fma_rn(total, ptx.as_f32(Uint32(INV_D_BITS)), ptx.f32_const(eps))
    if arch == "sm_90a":
        return ptx.rcp_full(ptx.sqrt_approx_ftz(v))
    return ptx.rsqrt_approx_ftz(v)


def gate_sigmoid(g, arch: str) -> Float32:
    """The stock sigmoid of the gate value ``g``: ``z = mul.rn(g, -log2
    e)``, then ``div.full(1, add.rn(ex2.approx(z), 1))`` (sm_90a) or
    ``rcp.approx.ftz(add.rn(ex2.approx.ftz(z), 1))`` (sm_100a)."""
    z = ptx.mul_rn(g, ptx.as_f32(Uint32(NEG_LOG2E_BITS)))
    one = ptx.f32_const(1.0)
    if arch == "sm_90a":
        return ptx.rcp_full(ptx.add_rn(ptx.ex2_approx(z), one))
    return ptx.rcp_approx_ftz(ptx.add_rn(ptx.ex2_approx_ftz(z), one))


def gated(x, scale, g, arch: str) -> Float32:
    """One output value before its BF16 rounding: ``mul.rn(mul.rn(x,
    scale), gate_sigmoid(g))`` (sm_90a: ``h * sig``; sm_100a: ``sig * h``,
    the same product)."""
    h = ptx.mul_rn(x, scale)
    sig = gate_sigmoid(g, arch)
    return ptx.mul_rn(h, sig) if arch == "sm_90a" else ptx.mul_rn(sig, h)


def o_gate_fragment(x: list, g: list, eps: float, arch: str) -> list:
    """The module docstring's steps for one thread's fragment: the output
    words (BF16 pairs, column order) of attention values ``x`` and gate
    values ``g`` (FP32 each, ``len(x)`` consecutive columns of a head held
    as ``head_sum_of_squares`` says)."""
    scale = o_norm_scale(head_sum_of_squares(x, arch), eps, arch)
    y = [gated(xc, scale, gc, arch) for xc, gc in zip(x, g)]
    return [ptx.pack_bf16x2_rn(y[j], y[j + 1]) for j in range(0, len(y), 2)]


# ---------------------------------------------------------------- the kernel


class OGateKernel:
    """The traced o-gate of one ``OGateConstants``; ``pdl``: launched with
    programmatic dependent launch. Call: ``(attn, gate, out, m,
    gate_stride, stream)``: global pointers to BF16 ``attn [m, W]`` and
    ``out [m, W]`` (contiguous) and to the gate's first row (16-byte
    aligned, row ``i`` at element ``i * gate_stride``, Int64, a multiple
    of 8), W = heads * 64; ``m`` Int32 (at least 1)."""

    def __init__(self, constants: OGateConstants, pdl: bool) -> None:
        check_constants(constants)
        self.constants = constants
        self.pdl = pdl

    @cute.jit
    def __call__(self, attn: cute.Pointer, gate: cute.Pointer, out: cute.Pointer, m: Int32, gate_stride: Int64,
                 stream):
        vecs = self.constants.num_heads * HEAD_THREADS
        self.kernel(attn, gate, out, m, gate_stride).launch(
            grid=[(m * vecs + (THREADS - 1)) // THREADS, 1, 1], block=[THREADS, 1, 1],
            stream=stream, use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, attn: cute.Pointer, gate: cute.Pointer, out: cute.Pointer, m: Int32, gate_stride: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        _o_gate_body(self.constants, self.pdl, tidx, cta, m, gate_stride, attn.toint(), gate.toint(), out.toint())


def _o_gate_body(c: OGateConstants, pdl: bool, tidx, cta, m, gate_stride, attn, gate, out) -> None:
    # Past the end: redo the last vector (a whole head: total is a multiple
    # of 8), the store is skipped; every lane takes part in the shuffles.
    v, vc, row, col, total = vector_index(tidx, cta, m, c.num_heads * HEAD_THREADS, THREADS)
    if pdl:
        ptx.pdl_wait()
        # Dependents still wait for this grid's end before they read `out`.
        ptx.pdl_launch_dependents()
    x = ptx.ld_bf16x8(Int64(attn) + Int64(vc) * (2 * VEC))
    g = ptx.ld_bf16x8(Int64(gate) + (Int64(row) * Int64(gate_stride) + Int64(col) * VEC) * 2)
    words = o_gate_fragment(x, g, c.eps, c.arch)
    ptx.st_global_v4_if(Int64(out) + Int64(vc) * (2 * VEC), words, v, total)


def fake_args(constants: OGateConstants) -> tuple:
    """The compile signature of ``OGateKernel`` (no GPU memory needed)."""
    return (fake_ptr("bf16"), fake_ptr("bf16"), fake_ptr("bf16"), Int32(1), Int64(HEAD_DIM), fake_stream())


@jit_cache("OGate")
def compile_o_gate(constants: OGateConstants, pdl: bool):
    """The compiled ``OGateKernel`` of ``constants`` and ``pdl``."""
    return OGateKernel(constants, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("o_gate", "(str handle, Tensor attn, Tensor gate, Tensor(a!) out) -> ()")


class OGate(LazyPdl):
    """``dspark_core.spec.layers.o_gate(attn, gate, norm, arch)`` of
    ``constants`` (``num_heads`` heads of 64 columns, a weightless o-norm of
    ``eps``, the stock arithmetic of ``arch``), as one kernel launch (module
    docstring): ``run(attn, gate)`` returns the same bits as the spec and
    the stock kernel of ``arch`` (the arithmetic runs on any sm_90+ GPU).

    ``attn``: BF16 ``[m, heads * 64]`` or ``[m, heads, 64]``, contiguous,
    16-byte aligned, on CUDA, 1 <= m <= ``max_rows``; ``gate``: BF16 of the
    same shape whose last dimension(s) are contiguous (strides ``[S, 1]`` or
    ``[S, 64, 1]``) with any row stride ``S`` that is a multiple of 8
    elements (16 bytes; e.g. the column slice ``qkv[:, q + 2 kv:]`` of the
    QKV projection), its data 16-byte aligned, on ``attn``'s device; ``out``
    (optional): BF16 of ``attn``'s shape, contiguous, 16-byte aligned, on
    that device. ``pdl``: launch with programmatic dependent launch
    (default: where the device supports it, sm_90+). One compile serves every
    row count and gate stride: call ``prepare()`` before CUDA graph capture;
    a call is graph-capturable once prepared (a compile during capture
    raises RuntimeError). Traced by torch.compile, a launch is the op
    ``torch.ops.dspark.o_gate``."""

    OP = "o_gate"

    def __init__(self, constants: OGateConstants, *, pdl: bool | None = None) -> None:
        check_constants(constants)
        self.constants = constants
        self.heads = constants.num_heads
        self.head_dim = HEAD_DIM
        self.eps = constants.eps
        self.arch = constants.arch
        self.width = self.heads * HEAD_DIM
        self._pdl = pdl
        self.op_handle = ops.register(self)

    @property
    def max_rows(self) -> int:
        """The most rows one call takes (the Int32 vector index)."""
        return MAX_VECTORS // (self.heads * HEAD_THREADS)

    def prepare(self, max_rows: int | None = None) -> None:
        """Compile the kernel (the one variant of these constants and PDL
        setting: ``m`` and the gate stride are runtime arguments).
        ``max_rows``, if given, is the most rows the caller will pass:
        ValueError above ``self.max_rows``. Call before CUDA graph capture."""
        if max_rows is not None and not 1 <= max_rows <= self.max_rows:
            raise ValueError(f"OGate takes 1 to {self.max_rows} rows, not {max_rows}")
        compile_o_gate(self.constants, self.pdl)

    def _shape_ok(self, t: torch.Tensor) -> bool:
        return (t.dim() == 2 and t.shape[1] == self.width) or (
            t.dim() == 3 and tuple(t.shape[1:]) == (self.heads, HEAD_DIM)
        )

    def gate_stride(self, gate: torch.Tensor) -> int:
        """The gate's row stride in elements (its inner dimensions must be
        contiguous: ValueError otherwise)."""
        inner = (1,) if gate.dim() == 2 else (HEAD_DIM, 1)
        # (A dimension of size 1 may carry any stride: it is never stepped.)
        inner_ok = all(n == 1 or s == e for n, s, e in zip(gate.shape[1:], gate.stride()[1:], inner))
        single = gate.shape[0] == 1
        if not inner_ok or not (single or (gate.stride(0) % VEC == 0 and gate.stride(0) >= self.width)):
            raise ValueError(
                f"the gate's rows must be contiguous (strides [S, {', '.join(map(str, inner))}]) with a row "
                f"stride S of at least {self.width} and a multiple of {VEC} elements, not {describe(gate)}"
            )
        return self._row_stride(gate)

    def _row_stride(self, gate: torch.Tensor) -> int:
        """The row stride the kernel takes, unchecked (``gate_stride`` checks)."""
        return self.width if gate.shape[0] == 1 else gate.stride(0)  # a single row's stride is never used

    def problem(self, attn, gate, out=None) -> str | None:
        """Why the kernel does not take ``attn``, ``gate`` and ``out`` (class
        docstring), a sentence, or None."""
        try:
            self._check_operands(attn, gate, out)
        except ValueError as error:
            return str(error)
        return None

    def _check_operands(self, attn, gate, out) -> None:
        w, h = self.width, self.heads
        for t, name in ((attn, "the attention output"), (gate, "the gate")):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch tensor, not {type(t).__name__}")
            if t.dtype != torch.bfloat16:
                raise ValueError(f"{name} must be bfloat16, not {t.dtype}")
            if not self._shape_ok(t):
                raise ValueError(f"{name} must be [m, {w}] or [m, {h}, {HEAD_DIM}], not {list(t.shape)}")
        if tuple(gate.shape) != tuple(attn.shape):
            raise ValueError(f"the gate must have the attention output's shape {list(attn.shape)}, "
                             f"not {list(gate.shape)}")
        m = attn.shape[0]
        if not 1 <= m <= self.max_rows:
            raise ValueError(f"the o-gate takes 1 to {self.max_rows} rows, not {m}")
        if not attn.is_contiguous():
            raise ValueError(f"the attention output must be contiguous, not {describe(attn)}")
        self.gate_stride(gate)
        if attn.data_ptr() % 16 or gate.data_ptr() % 16:
            raise ValueError("the attention output and the gate must be aligned to 16 bytes "
                             "(the gate's column offset a multiple of 8 elements)")
        if not attn.is_cuda or gate.device != attn.device:
            raise ValueError(f"the attention output and the gate must be CUDA tensors on one device, "
                             f"not on {attn.device} and {gate.device}")
        if out is None:
            return
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"the output must be a torch tensor, not {type(out).__name__}")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(attn.shape):
            raise ValueError(f"the output must be bfloat16 {list(attn.shape)}, not {describe(out)}")
        if not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError(f"the output must be contiguous and aligned to 16 bytes, not {describe(out)}")
        if out.device != attn.device:
            raise ValueError(f"the output must be on the inputs' device {attn.device}, not {out.device}")

    def takes(self, attn, gate, out=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(attn, gate, out) is None

    def run(self, attn: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The o-normed, gated ``attn`` (BF16, ``attn``'s shape), written into
        ``out`` if given; ValueError with ``problem``'s sentence otherwise."""
        reason = self.problem(attn, gate, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(attn, gate, out)

    def launch(self, attn: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without its operand checks (for operands ``takes``)."""
        if out is None:
            out = torch.empty(attn.shape, dtype=torch.bfloat16, device=attn.device)
        ops.launch(self, attn, gate, out)
        return out

    def _launch_kernel(self, attn: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> None:
        kernel = compile_o_gate(self.constants, self.pdl)
        kernel(ptr(attn), ptr(gate), ptr(out), Int32(attn.shape[0]), Int64(self._row_stride(gate)),
               current_stream())


__all__ = [
    "ARCHS",
    "HEAD_THREADS",
    "MAX_VECTORS",
    "NEG_LOG2E_BITS",
    "OGate",
    "OGateKernel",
    "THREADS",
    "check_arch",
    "check_constants",
    "compile_o_gate",
    "fake_args",
    "gate_sigmoid",
    "gated",
    "head_sum_of_squares",
    "o_gate_fragment",
    "o_norm_scale",
]
