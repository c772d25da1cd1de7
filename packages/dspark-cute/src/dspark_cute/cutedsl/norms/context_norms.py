"""The context norms kernel: ``dspark_core.reference.model.DraftModel.context_norms`` in
one launch, bit for bit.

For BF16 context rows ``x`` (``[T, H]``, H a multiple of 2048) and ``L``
layers it writes BF16 ``[L, T, H]``:
``out[l, t] = input_norm_l(round_bf16(hidden_norm(x[t])))``, every norm the
stock ``RMSNorm`` (``dspark_core.spec.layers``; the stock Triton norm of
``precompute_and_store_context_kv``) of the constants' variant: no weight, or
a BF16/FP16/FP32 weight with its gain center, applied before or after the
normalisation, with its eps, its squares summed by the stock tree of its
``arch`` and ``rsqrt.approx.ftz(fma(s, 1/H, eps))``.

Layout: one CTA of 256 threads per (row, layer) pair, in a 1-D grid of
``T * L`` CTAs ordered row-major (CTA ``b`` is row ``b // L``, layer
``b % L``), so the ``L`` CTAs of one row run next to each other and the
row's second and later reads come from L2. Each CTA computes the hidden
norm of its row (the same bits in each of the L CTAs), rounds it to BF16 and
applies its layer's input norm. Thread ``t`` holds the 8-column fragments
``t * 8 + k * 2048`` (the stock norm's CTA: ``dspark_core.spec.numerics``),
read and written with 16-byte vector accesses; the two norms fold
their warp sums through separate shared-memory slots, so there is one
barrier per norm. The row count is a runtime argument (one compile serves
every ``T``); ``H`` and ``L`` are compile-time constants.

With ``pdl`` the weights (constants of the model) are read before the
programmatic-dependent-launch wait, the rows after it.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64

from dspark_core.contracts.constants import ContextNormConstants, within_limits
from dspark_cute import ptx
from dspark_cute.cutedsl.norms.rms import (
    fragment_columns,
    load_weight_words,
    rms_norm_fragments,
)
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    ELEMENT_BYTES,
    TORCH_DTYPES,
    LazyPdl,
    check_operand,
    current_stream,
    describe,
    fake_ptr,
    fake_stream,
    is_operand,
    jit_cache,
    ptr,
    smem_allocator,
)

# The grid is 1-D: T * L CTAs must fit a signed 32-bit count.
MAX_CTAS = 2**31 - 1


def check_constants(c: ContextNormConstants) -> None:
    """Unsupported unless the kernel takes ``c``: its limits
    (``dspark_core.contracts.limits``: H a positive multiple of 2048, at
    least one layer, norms the norm kernels take)."""
    if not isinstance(c, ContextNormConstants):
        raise ValueError(f"ContextNorms takes ContextNormConstants, not {type(c).__name__}")
    within_limits(c)


# ---------------------------------------------------------------- the kernel


class ContextNormsKernel:
    """The traced context norms of one ``ContextNormConstants``; ``pdl``:
    launched with programmatic dependent launch. Call: ``(x, hidden_w, pre_w,
    out, m, stream)``: global pointers to the BF16 ``[m, H]`` rows, the
    hidden norm's ``[H]`` weight, the input norms' ``[L, H]`` weights (any
    pointer where a norm has no weight: it is not read), the BF16
    ``[L, m, H]`` output; ``m`` Int32 (``m * L`` CTAs)."""

    def __init__(self, constants: ContextNormConstants, pdl: bool) -> None:
        self.constants = constants
        self.pdl = pdl

    @cute.jit
    def __call__(
        self, x: cute.Pointer, hidden_w: cute.Pointer, pre_w: cute.Pointer, out: cute.Pointer,
        m: Int32, stream,
    ):
        self.kernel(x, hidden_w, pre_w, out, m).launch(
            grid=[m * self.constants.num_layers, 1, 1], block=[ptx.THREADS, 1, 1],
            stream=stream, use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self, x: cute.Pointer, hidden_w: cute.Pointer, pre_w: cute.Pointer, out: cute.Pointer,
        m: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # Two folds (hidden, input norm), each its own 8 slots: no barrier between.
        sums = smem_allocator().allocate_array(Float32, 2 * ptx.WARPS)
        _context_norms_body(
            self.constants, self.pdl, tidx, cta, m, warp, lane, sums.toint(),
            x.toint(), hidden_w.toint(), pre_w.toint(), out.toint(),
        )


def _context_norms_body(
    c: ContextNormConstants, pdl: bool, tidx, cta, m, warp, lane, sums, x, hidden_w, pre_w, out
) -> None:
    h = c.hidden_size
    layers = c.num_layers
    # CTA b: row b // L, layer b % L (unsigned division by a constant).
    b = cute.arch.make_warp_uniform(cta)
    row = Int64(b // layers)
    layer = Int64(b) - row * layers
    columns = fragment_columns(tidx, h)
    hidden_words = pre_words = None
    # Constant operands (the model's weights): read before the wait.
    if c.hidden.weight_dtype is not None:
        hidden_words = [load_weight_words(c.hidden.weight_dtype, hidden_w, col) for col in columns]
    if c.pre.weight_dtype is not None:
        pre_row = Int64(pre_w) + layer * (h * ELEMENT_BYTES[c.pre.weight_dtype])
        pre_words = [load_weight_words(c.pre.weight_dtype, pre_row, col) for col in columns]
    if pdl:
        ptx.pdl_wait()
        # Dependents still wait for this grid's end before they read `out`.
        ptx.pdl_launch_dependents()
    x_row = Int64(x) + row * (2 * h)
    frags = [ptx.ld_row8("bf16", x_row, col) for col in columns]
    # 1. the hidden norm, rounded to BF16 (the stock chain's hidden states).
    y = rms_norm_fragments(c.hidden, h, frags, hidden_words, sums, warp, lane)
    z = [ptx.round_bf16(f) for f in y]
    # 2. this layer's input norm, rounded to BF16 at the store.
    o = rms_norm_fragments(c.pre, h, z, pre_words, Int32(sums) + 4 * ptx.WARPS, warp, lane)
    out_row = Int64(out) + (layer * Int64(m) + row) * (2 * h)
    for col, f in zip(columns, o):
        ptx.st_row8("bf16", out_row, col, f)


def fake_args(c: ContextNormConstants) -> tuple:
    """The compile signature of ``ContextNormsKernel`` (no GPU memory needed)."""
    return (
        fake_ptr("bf16"),
        fake_ptr(c.hidden.weight_dtype or "bf16"),
        fake_ptr(c.pre.weight_dtype or "bf16"),
        fake_ptr("bf16"),
        Int32(1),
        fake_stream(),
    )


@jit_cache("ContextNorms")
def compile_context_norms(constants: ContextNormConstants, pdl: bool):
    """The compiled ``ContextNormsKernel`` of ``constants`` and ``pdl``."""
    return ContextNormsKernel(constants, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("context_norms", "(str handle, Tensor x, Tensor(a!) out) -> ()")


class ContextNorms(LazyPdl):
    """``DraftModel.context_norms`` of ``constants`` bound to its weights, as
    one kernel launch: ``run(x)`` returns the same bits as
    ``stack([input_norm_l(hidden_norm(x, out_dtype=bf16), out_dtype=bf16)
    for l])`` for rows ``takes(x)`` accepts.

    ``hidden_weight``: the hidden norm's ``[H]`` weight of
    ``constants.hidden.weight_dtype``, or None for a weightless hidden norm;
    ``pre_weights``: the layers' input-norm weights stacked ``[L, H]`` of
    ``constants.pre.weight_dtype`` (or None), each a contiguous CUDA tensor,
    16-byte aligned, on one device. The kernel reads the tensors given here
    at every launch (a change in place shows; a new tensor needs a new
    ContextNorms). ``pdl``: launch with programmatic dependent launch
    (default: where the device supports it, sm_90+). Call ``prepare()``
    before CUDA graph capture; ``run`` and ``launch`` are graph-capturable
    once prepared. Traced by torch.compile, a launch is the op
    ``torch.ops.dspark.context_norms``."""

    OP = "context_norms"

    def __init__(
        self,
        constants: ContextNormConstants,
        hidden_weight: torch.Tensor | None,
        pre_weights: torch.Tensor | None,
        pdl: bool | None = None,
    ) -> None:
        check_constants(constants)
        h, layers = constants.hidden_size, constants.num_layers
        device = None
        for norm, weight, shape, name in (
            (constants.hidden, hidden_weight, (h,), "hidden norm"),
            (constants.pre, pre_weights, (layers, h), "input norms"),
        ):
            if norm.weight_dtype is None:
                if weight is not None:
                    raise ValueError(f"the {name}' constants have no weight, yet one was given")
                continue
            check_operand(weight, shape, TORCH_DTYPES[norm.weight_dtype], 16, f"the {name} weight")
            if device is not None and weight.device != device:
                raise ValueError("the hidden and input norm weights must be on one device")
            device = weight.device
        self.constants = constants
        self.hidden_weight = hidden_weight
        self.pre_weights = pre_weights
        self.device = device
        self._pdl = pdl
        self.op_handle = ops.register(self)

    def prepare(self) -> None:
        """Compile the kernel this object launches (one per constants and PDL
        setting). Call before CUDA graph capture."""
        compile_context_norms(self.constants, self.pdl)

    def problem(self, x, out=None) -> str | None:
        """Why the kernel does not take ``x`` (and ``out``), or None: ``x`` a
        contiguous, 16-byte aligned CUDA BF16 ``[T, H]`` tensor, T >= 1 and
        ``T * L`` below 2^31, on the weights' device; ``out`` (if given) a
        contiguous, aligned BF16 ``[L, T, H]`` tensor on that device."""
        h, layers = self.constants.hidden_size, self.constants.num_layers
        if not (
            isinstance(x, torch.Tensor)
            and x.dim() == 2
            and x.shape[1] == h
            and 1 <= x.shape[0] <= MAX_CTAS // layers
            and is_operand(x, torch.bfloat16, x.shape, 16, self.device)
        ):
            return (f"ContextNorms takes a contiguous, 16-byte aligned CUDA bfloat16 tensor of [T, {h}] with "
                    f"1 <= T <= {MAX_CTAS // layers} on the weights' device, not {describe(x)}")
        if out is not None and not is_operand(out, torch.bfloat16, (layers, x.shape[0], h), 16, x.device):
            return (f"ContextNorms writes a contiguous, 16-byte aligned bfloat16 output of [{layers}, T, {h}], "
                    f"not {describe(out)}")
        return None

    def takes(self, x, out=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(x, out) is None

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The BF16 ``[L, T, H]`` context norms of ``x`` (BF16 ``[T, H]``),
        written into ``out`` if given; ValueError with ``problem``'s sentence
        otherwise."""
        reason = self.problem(x, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(x, out)

    def launch(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without its operand checks (for operands checked by
        ``takes``)."""
        c = self.constants
        m = x.shape[0]
        if out is None:
            out = torch.empty((c.num_layers, m, c.hidden_size), dtype=torch.bfloat16, device=x.device)
        ops.launch(self, x, out)
        return out

    def _launch_kernel(self, x: torch.Tensor, out: torch.Tensor) -> None:
        m = x.shape[0]
        kernel = compile_context_norms(self.constants, self.pdl)
        kernel(
            ptr(x),
            ptr(self.hidden_weight if self.hidden_weight is not None else x),
            ptr(self.pre_weights if self.pre_weights is not None else x),
            ptr(out),
            Int32(m),
            current_stream(),
        )


__all__ = [
    "ContextNorms",
    "ContextNormsKernel",
    "check_constants",
    "compile_context_norms",
    "fake_args",
]
