"""The o-gate kernel: ``dspark_core.spec.layers.o_gate(attn, gate, norm)`` with the
weightless o-norm, bit for bit.

For the attention output ``attn`` (BF16 ``[m, heads * 64]``, contiguous) and
the o-gate rows of the QKV projection ``gate`` (BF16 ``[m, heads * 64]``, a
column slice with its own row stride) it writes BF16 ``out [m, heads * 64]``
(contiguous), per head of D = 64 columns ``x = attn[i, 64h : 64h + 64]``
and ``g = gate[i, 64h : 64h + 64]``, widened to FP32 exactly:

1. ``HeadNorm`` without a weight: the squares ``x_c * x_c`` (``mul.rn``),
   the head tree (``dspark_core.spec.numerics.head_sum``: pair sums ``p_j =
   x_2j^2 + x_(2j+1)^2``, then folded by halves ``p_j + p_(j+16)``, 8, 4, 2,
   1; each sum ``add.rn``), ``r = inv_rms(s, 64, eps) = 1 / sqrt(s / 64 +
   eps)`` (``div.rn``, ``add.rn``, ``sqrt.rn``, ``div.rn``; 64 and eps FP32
   constants), ``n_c = round_bf16(x_c * r)`` (``mul.rn``,
   ``cvt.rn.bf16x2.f32``);
2. ``out_c = round_bf16(n_c * sigmoid_rn(g_c))``: ``n_c`` widened back
   exactly, ``sigmoid_rn`` the spec's (``dspark_cute.ptx.math``: ``exp_rn``
   operation by operation, ``1 / (1 + e)`` with ``add.rn`` and ``div.rn``),
   the product ``mul.rn``, rounded to BF16 nearest even.

No FMA, no ``.ftz``, no approximate instruction (NaN payloads aside, the
result is a function of the input bits: ``dspark_core.spec.numerics``).

Layout: one thread per 8 consecutive columns (a 16-byte vector), 8 threads
per head: thread ``v = cta * 128 + tid`` of a 1-D grid handles vector ``v``
of the ``m * heads * 8`` vectors (row ``v // (heads * 8)``), so the 8 lanes
``8k .. 8k + 7`` of a warp hold one head, lane ``l`` its pairs ``4 (l % 8)
.. + 3``. The head tree's folds over 16, 8 and 4 pairs are butterflies
between lanes ``l ^ 4``, ``l ^ 2``, ``l ^ 1`` (each of the 4 pair sums a
shuffle), the folds over 2 and 1 pair stay in the thread; every lane ends
with the same sum (``a + b == b + a`` bit for bit). A thread past the end
computes the last vector again (the shuffles need every lane) and its store
is predicated off. ``m`` and the gate's row stride are runtime arguments;
``heads`` and ``eps`` are compile-time. With ``pdl`` the kernel waits for
the previous grid before its loads, then releases the next one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from dspark_core.contracts.constants import HEAD_DIM, OGateConstants
from dspark_core.errors import Unsupported
from dspark_cute import ptx
from dspark_cute.cutedsl.gating.elementwise import vector_index
from dspark_cute.runtime.host import (
    LazyPdl,
    current_stream,
    describe,
    fake_ptr,
    fake_stream,
    jit_cache,
    ptr,
)

# Threads per CTA (each 8 columns; 16 heads per CTA).
THREADS = 128
# Columns per thread (one 16-byte BF16 vector) and threads per head.
VEC = 8
HEAD_THREADS = HEAD_DIM // VEC
# The vector index v = cta * THREADS + tid is an Int32: m * heads * 8 stays below this.
MAX_VECTORS = 2**31 - THREADS


def check_constants(c: OGateConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (an OGateConstants): at
    least one head, a non-negative eps."""
    if not isinstance(c, OGateConstants):
        raise ValueError(f"OGate takes OGateConstants, not {type(c).__name__}")
    if not isinstance(c.num_heads, int) or isinstance(c.num_heads, bool) or c.num_heads < 1:
        raise Unsupported(f"the o-gate takes at least one head, not {c.num_heads}")
    if not c.eps >= 0.0:  # NaN fails too
        raise Unsupported(f"the o-norm's eps must be a non-negative number, not {c.eps}")


# ---------------------------------------------------------------- traced pieces


def head_sum_of_squares(x: list) -> cutlass.Float32:
    """The head tree of the squares of a 64-wide head whose 8-column
    fragment ``x`` (8 FP32) lane ``l`` holds at columns ``8 (l % 8)``: the
    4 pair sums, the butterflies 4, 2, 1 (pairs 16, 8, 4 apart), then
    ``(q0 + q2) + (q1 + q3)`` (pairs 2, then 1 apart). Every lane of the
    head's 8 returns the sum."""
    sq = [ptx.mul_rn(v, v) for v in x]
    q = [ptx.add_rn(sq[2 * j], sq[2 * j + 1]) for j in range(VEC // 2)]
    for offset in (4, 2, 1):
        q = [ptx.add_rn(s, cute.arch.shuffle_sync_bfly(s, offset=offset)) for s in q]
    return ptx.add_rn(ptx.add_rn(q[0], q[2]), ptx.add_rn(q[1], q[3]))


def o_gate_fragment(x: list, g: list, eps: float) -> list:
    """Steps 1-2 of the module docstring for one thread's fragment: the 4
    output words (BF16 pairs) of attention values ``x`` and gate values
    ``g`` (8 FP32 each)."""
    r = ptx.inv_rms(head_sum_of_squares(x), HEAD_DIM, eps)
    n = []
    for j in range(0, VEC, 2):
        n.extend(ptx.round_bf16x2(ptx.mul_rn(x[j], r), ptx.mul_rn(x[j + 1], r)))
    o = [ptx.mul_rn(nc, ptx.sigmoid_rn(gc)) for nc, gc in zip(n, g)]
    return [ptx.pack_bf16x2_rn(o[j], o[j + 1]) for j in range(0, VEC, 2)]


# ---------------------------------------------------------------- the kernel


class OGateKernel:
    """The traced o-gate of one ``OGateConstants``; ``pdl``: launched with
    programmatic dependent launch. Call: ``(attn, gate, out, m,
    gate_stride, stream)``: global pointers to BF16 ``attn [m, W]`` and
    ``out [m, W]`` (contiguous) and to the gate's first row (16-byte
    aligned, row ``i`` at element ``i * gate_stride``, Int64, a multiple
    of 8), W = heads * 64; ``m`` Int32 (at least 1)."""

    def __init__(self, constants: OGateConstants, pdl: bool) -> None:
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
    words = o_gate_fragment(x, g, c.eps)
    ptx.st_global_v4_if(Int64(out) + Int64(vc) * (2 * VEC), words, v, total)


def fake_args(constants: OGateConstants) -> tuple:
    """The compile signature of ``OGateKernel`` (no GPU memory needed)."""
    return (fake_ptr("bf16"), fake_ptr("bf16"), fake_ptr("bf16"), Int32(1), Int64(HEAD_DIM), fake_stream())


@jit_cache("OGate")
def compile_o_gate(constants: OGateConstants, pdl: bool):
    """The compiled ``OGateKernel`` of ``constants`` and ``pdl``."""
    return OGateKernel(constants, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API


class OGate(LazyPdl):
    """``dspark_core.spec.layers.o_gate(attn, gate, norm)`` of ``constants``
    (``num_heads`` heads of 64 columns, a weightless o-norm of ``eps``), as one kernel launch
    (module docstring): ``run(attn, gate)`` returns the same bits as the
    stock function.

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
    raises RuntimeError)."""

    def __init__(self, constants: OGateConstants, *, pdl: bool | None = None) -> None:
        check_constants(constants)
        self.constants = constants
        self.heads = constants.num_heads
        self.head_dim = HEAD_DIM
        self.eps = constants.eps
        self.width = self.heads * HEAD_DIM
        self._pdl = pdl

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
        kernel = compile_o_gate(self.constants, self.pdl)
        kernel(ptr(attn), ptr(gate), ptr(out), Int32(attn.shape[0]), Int64(self._row_stride(gate)),
               current_stream())
        return out


__all__ = [
    "HEAD_THREADS",
    "MAX_VECTORS",
    "OGate",
    "OGateKernel",
    "THREADS",
    "check_constants",
    "compile_o_gate",
    "fake_args",
    "head_sum_of_squares",
    "o_gate_fragment",
]
