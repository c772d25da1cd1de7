"""The gated SiLU activation kernel: ``dspark_core.spec.layers.silu_and_mul``
(``GatedMLP.activation``, vLLM's ``SiluAndMul``), bit for bit the stock
``act_and_mul_kernel``.

For the gate-up projection's output ``gu`` (BF16 ``[m, 2I]``, rows
contiguous, the I gate columns first, then the I up columns) it writes BF16
``h [m, I]``, per element ``c`` of row ``i``:

1. ``x = gu[i, c]`` and ``u = gu[i, I + c]`` widened to FP32 exactly;
2. ``e = expf(neg(x))``: CUDA's accurate ``expf`` (``dspark_cute.ptx.math.expf``,
   libdevice's instruction sequence: a Cody-Waite reduction with ``fma.rn``,
   ``cvt.sat`` and ``fma.rm``, ``ex2.approx.ftz.f32``, the power of two from
   its bits, ``mul.rn``); the negation exact;
3. ``a = div.rn(x, add.rn(e, 1))`` (IEEE division), rounded to BF16
   (``cvt.rn.bf16x2.f32``) and widened back: the stock's ``silu_kernel``
   returns a BF16;
4. ``h[i, c] = cvt.rn.bf16(mul.rn(a, add.rn(u, 0.0)))`` (``u + 0.0`` turns a
   -0.0 up into +0.0, as the stock's ``up + up_offset`` does).

The approximate ``ex2`` inside ``expf`` is the only approximate instruction,
its ``fma``s the only fused multiply-adds (the stock contracts ``1 +
expf(-x)`` into expf's last product instead: the same bits, see
``dspark_cute.ptx.math``). Subnormals are kept; BF16 overflow rounds to inf.

Layout: one thread per 8 consecutive columns (a 16-byte vector): thread
``v = cta * 128 + tid`` of a 1-D grid handles vector ``v`` of the ``m * I /
8`` output vectors (row ``v // (I/8)``), reading its gate and up vectors
with one 16-byte load each and writing 16 bytes; a thread past the end
computes the last vector again and its store is predicated off (no branch).
``m`` is a runtime argument (one compile serves every row count); ``I`` (a
multiple of 8) is compile-time. With ``pdl`` the kernel waits for the
previous grid before its loads and then releases the next one (every operand
comes from the previous kernel: nothing to read before the wait).
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64

from dspark_core.contracts.constants import MlpActivationConstants, within_limits
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

# Threads per CTA (each 8 columns).
THREADS = 128
# Columns per thread: one 16-byte BF16 vector.
VEC = 8
# The vector index v = cta * THREADS + tid is an Int32: m * I / 8 stays below this.
MAX_VECTORS = 2**31 - THREADS


def check_constants(c: MlpActivationConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (a MlpActivationConstants):
    its limits (``dspark_core.contracts.limits``: I a positive multiple of 8)."""
    if not isinstance(c, MlpActivationConstants):
        raise ValueError(f"MlpActivation takes MlpActivationConstants, not {type(c).__name__}")
    within_limits(c)


# ---------------------------------------------------------------- the kernel


class MlpActivationKernel:
    """The traced activation of one ``MlpActivationConstants``; ``pdl``:
    launched with programmatic dependent launch. Call: ``(gu, out, m,
    stream)``: global pointers to BF16 ``gu [m, 2I]`` and ``out [m, I]``
    (both contiguous, 16-byte aligned), ``m`` Int32 (at least 1)."""

    def __init__(self, constants: MlpActivationConstants, pdl: bool) -> None:
        self.constants = constants
        self.pdl = pdl

    @cute.jit
    def __call__(self, gu: cute.Pointer, out: cute.Pointer, m: Int32, stream):
        vecs = self.constants.intermediate_size // VEC
        self.kernel(gu, out, m).launch(
            grid=[(m * vecs + (THREADS - 1)) // THREADS, 1, 1], block=[THREADS, 1, 1],
            stream=stream, use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, gu: cute.Pointer, out: cute.Pointer, m: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        _activation_body(self.constants.intermediate_size, self.pdl, tidx, cta, m, gu.toint(), out.toint())


def silu_bf16(x) -> Float32:
    """Steps 2-3 of the module docstring for one FP32 gate value ``x``:
    ``div.rn(x, add.rn(expf(-x), 1))``, not yet rounded to BF16."""
    e = ptx.expf(ptx.neg_f32(x))
    return ptx.div_rn(x, ptx.add_rn(e, ptx.f32_const(1.0)))


def activation_words(g: list, u: list) -> list:
    """Steps 2-4 for the FP32 gate values ``g`` and up values ``u`` of one
    fragment (an even count, column order): the output words (BF16 pairs)."""
    a = ptx.round_bf16([silu_bf16(x) for x in g])
    zero = ptx.f32_const(0.0)
    h = [ptx.mul_rn(ak, ptx.add_rn(uk, zero)) for ak, uk in zip(a, u)]
    return [ptx.pack_bf16x2_rn(h[k], h[k + 1]) for k in range(0, len(h), 2)]


def _activation_body(i: int, pdl: bool, tidx, cta, m, gu, out) -> None:
    # Past the end: redo the last vector (in bounds), the store is skipped.
    v, vc, row, col, total = vector_index(tidx, cta, m, i // VEC, THREADS)
    if pdl:
        # Released before the wait: the down projection launches during the
        # gate-up GEMM's tail and streams its weight meanwhile (it still
        # waits for this grid's end before it reads `out`).
        ptx.pdl_launch_dependents()
        ptx.pdl_wait()
    g_addr = Int64(gu) + Int64(row) * (4 * i) + Int64(col) * (2 * VEC)
    g = ptx.ld_bf16x8(g_addr)
    u = ptx.ld_bf16x8(g_addr + 2 * i)
    words = activation_words(g, u)
    # out is [m, I] contiguous: vector vc of the flat output.
    ptx.st_global_v4_if(Int64(out) + Int64(vc) * (2 * VEC), words, v, total)


def fake_args(constants: MlpActivationConstants) -> tuple:
    """The compile signature of ``MlpActivationKernel`` (no GPU memory needed)."""
    return (fake_ptr("bf16"), fake_ptr("bf16"), Int32(1), fake_stream())


@jit_cache("MlpActivation")
def compile_mlp_activation(constants: MlpActivationConstants, pdl: bool):
    """The compiled ``MlpActivationKernel`` of ``constants`` and ``pdl``."""
    return MlpActivationKernel(constants, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("mlp_activation", "(str handle, Tensor gu, Tensor(a!) out) -> ()")


class MlpActivation(LazyPdl):
    """``silu_and_mul(gu, I)`` (``GatedMLP.activation``) for
    ``intermediate_size`` I, as one kernel launch (module docstring):
    ``run(gu)`` returns the same bits as the spec and vLLM's stock
    ``SiluAndMul``.

    ``gu``: BF16 ``[..., 2I]`` (gate columns, then up columns), contiguous,
    16-byte aligned, on CUDA, with at least one row and at most
    ``max_rows`` rows; ``out`` (optional): BF16 ``[..., I]`` of ``gu``'s
    leading shape, contiguous, 16-byte aligned, on ``gu``'s device.
    ``pdl``: launch with programmatic dependent launch (default: where the
    device supports it, sm_90+). One compile serves every row count: call
    ``prepare()`` before CUDA graph capture; a call is graph-capturable once
    prepared (a compile during capture raises RuntimeError). Traced by
    torch.compile, a launch is the op ``torch.ops.dspark.mlp_activation``."""

    OP = "mlp_activation"

    def __init__(self, constants: MlpActivationConstants, *, pdl: bool | None = None) -> None:
        check_constants(constants)
        self.constants = constants
        self.intermediate_size = constants.intermediate_size
        self._pdl = pdl
        self.op_handle = ops.register(self)

    @property
    def max_rows(self) -> int:
        """The most rows one call takes (the Int32 vector index)."""
        return MAX_VECTORS // (self.intermediate_size // VEC)

    def prepare(self, max_rows: int | None = None) -> None:
        """Compile the kernel (the one variant of these constants and PDL
        setting: ``m`` is a runtime argument). ``max_rows``, if given, is the
        most rows the caller will pass: ValueError above ``self.max_rows``.
        Call before CUDA graph capture."""
        if max_rows is not None and not 1 <= max_rows <= self.max_rows:
            raise ValueError(f"MlpActivation takes 1 to {self.max_rows} rows, not {max_rows}")
        compile_mlp_activation(self.constants, self.pdl)

    def problem(self, gu, out=None) -> str | None:
        """Why the kernel does not take ``gu`` and ``out`` (class docstring),
        a sentence, or None."""
        try:
            self._check_operands(gu, out)
        except ValueError as error:
            return str(error)
        return None

    def _check_operands(self, gu, out) -> None:
        i = self.intermediate_size
        if not isinstance(gu, torch.Tensor):
            raise ValueError(f"the gate-up input must be a torch tensor, not {type(gu).__name__}")
        if gu.dtype != torch.bfloat16:
            raise ValueError(f"the gate-up input must be bfloat16, not {gu.dtype}")
        if gu.dim() < 1 or gu.shape[-1] != 2 * i:
            raise ValueError(f"the gate-up input must be [..., {2 * i}] (gate then up), not {list(gu.shape)}")
        rows = gu.numel() // (2 * i)
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"the gate-up input must have 1 to {self.max_rows} rows, not {rows}")
        if not gu.is_contiguous():
            raise ValueError(f"the gate-up input must be contiguous, not {describe(gu)}")
        if gu.data_ptr() % 16:
            raise ValueError("the gate-up input must be aligned to 16 bytes")
        if not gu.is_cuda:
            raise ValueError(f"the gate-up input must be a CUDA tensor, not on {gu.device}")
        if out is None:
            return
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"the output must be a torch tensor, not {type(out).__name__}")
        shape = (*gu.shape[:-1], i)
        if out.dtype != torch.bfloat16 or tuple(out.shape) != shape:
            raise ValueError(f"the output must be bfloat16 {list(shape)}, not {describe(out)}")
        if not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError(f"the output must be contiguous and aligned to 16 bytes, not {describe(out)}")
        if out.device != gu.device:
            raise ValueError(f"the output must be on the input's device {gu.device}, not {out.device}")

    def takes(self, gu, out=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(gu, out) is None

    def run(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``silu_and_mul(gu, I)`` of ``gu`` (BF16 ``[..., 2I]``), BF16
        ``[..., I]``, written into ``out`` if given; ValueError with
        ``problem``'s sentence otherwise."""
        reason = self.problem(gu, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(gu, out)

    def launch(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without its operand checks (for operands ``takes``)."""
        i = self.intermediate_size
        if out is None:
            out = torch.empty((*gu.shape[:-1], i), dtype=torch.bfloat16, device=gu.device)
        ops.launch(self, gu, out)
        return out

    def _launch_kernel(self, gu: torch.Tensor, out: torch.Tensor) -> None:
        kernel = compile_mlp_activation(self.constants, self.pdl)
        kernel(ptr(gu), ptr(out), Int32(gu.numel() // (2 * self.intermediate_size)), current_stream())


__all__ = [
    "MAX_VECTORS",
    "MlpActivation",
    "MlpActivationKernel",
    "THREADS",
    "activation_words",
    "check_constants",
    "compile_mlp_activation",
    "fake_args",
    "silu_bf16",
]
