"""The decode attention's host class: ``PagedAttention`` launches the direct
kernel (``direct``: K and V read from global memory) or, with an option of its
constants on, the staged one (``staged``: K and V staged in shared memory, a
row-strided ``q``, the o-gate fused); the same bits either way."""

from __future__ import annotations

import torch
from cutlass import Int32, Int64

from dspark_core.contracts.constants import HEAD_DIM, AttentionConstants
from dspark_cute.cutedsl.attention.common import SLOT_BYTES, SLOT_DTYPES, check_constants
from dspark_cute.cutedsl.attention.direct import compile_direct_attention
from dspark_cute.cutedsl.attention.staged import compile_staged_attention
from dspark_cute.cutedsl.gating.o_gate import check_arch
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import LazyPdl, cache_tensor, current_stream, stream_capturing


def compile_attention(constants: AttentionConstants, pdl: bool, o_gate_arch: str = "sm_90a"):
    """The compiled kernel of ``constants`` and ``pdl``: the direct one for
    the default constants, the staged one where an option is on, its o-gate
    epilogue (where ``o_gate_eps`` is set) in the arithmetic of
    ``o_gate_arch`` (ignored without it: one compile per ungated setting)."""
    if constants.is_default:
        return compile_direct_attention(constants, pdl)
    if constants.o_gate_eps is None:
        return compile_staged_attention(constants, pdl)
    return compile_staged_attention(constants, pdl, o_gate_arch)


ops.define("attention", "(str handle, Tensor q, Tensor cache, Tensor attn_slots, Tensor(a!) out, Tensor? gate) -> ()")


class PagedAttention(LazyPdl):
    """``dspark_core.spec.attention.paged_attention(q, cache, attn_slots,
    kv_heads)`` of ``constants`` as one kernel launch, bit for bit (NaN
    payloads aside, as ``dspark_core.tools.compare`` allows): ``num_heads``
    query heads over ``kv_heads`` KV heads of 64 columns, a cache of
    ``block_size`` slots per block, ``attn_slots`` of ``slot_dtype`` ("int64"
    or "int32"). With ``staged_slots`` (a multiple of 128 up to 768) the K
    and V rows of the first that many slots are staged in shared memory (one
    memory round trip; later slots take the direct path inside the kernel);
    with ``o_gate_eps`` the output is ``layers.o_gate(., gate, HeadNorm(64,
    o_gate_eps), o_gate_arch)`` (the stock o-gate of ``o_gate_arch``,
    "sm_90a" or "sm_100a"; default: the constants' ``o_gate_arch``, which
    the planner sets from its target) and the calls take ``gate=``. Either option launches the
    staged kernel, which also takes ``q`` as a row-strided view
    (``takes_strided_q``). ``pdl``: programmatic dependent launch (default:
    where the device supports it, sm_90+). Call ``prepare()`` before CUDA
    graph capture; ``launch`` is graph-capturable once prepared. Traced by
    torch.compile, a launch is the op ``torch.ops.dspark.attention``."""

    OP = "attention"

    def __init__(self, constants: AttentionConstants, *, pdl: bool | None = None,
                 o_gate_arch: str | None = None) -> None:
        check_constants(constants)
        self.constants = constants
        self.slot_dtype = SLOT_DTYPES[constants.slot_dtype]
        self._pdl = pdl
        self._o_gate_arch = None if o_gate_arch is None else check_arch(o_gate_arch)
        self.op_handle = ops.register(self)

    @property
    def o_gate_arch(self) -> str | None:
        """The stock o-gate whose arithmetic the epilogue runs (None without
        the o-gate): the constructor's, else the constants' (the planner's
        target)."""
        if not self.gated:
            return None
        return self._o_gate_arch or self.constants.o_gate_arch

    def _compiled(self):
        if self.gated:
            return compile_attention(self.constants, self.pdl, self.o_gate_arch)
        return compile_attention(self.constants, self.pdl)

    def prepare(self) -> None:
        """Compile the kernel this object launches (one per constants, PDL
        setting and o-gate arch). Call before CUDA graph capture."""
        self._compiled()

    @property
    def takes_strided_q(self) -> bool:
        """Whether ``q`` may be a row-strided view (an option is on)."""
        return not self.constants.is_default

    @property
    def gated(self) -> bool:
        """Whether the kernel applies the o-gate (the calls take ``gate=``)."""
        return self.constants.o_gate_eps is not None

    def problem(self, q, cache, attn_slots, out=None, gate=None) -> str | None:
        """Why the kernel does not take these operands (a sentence), or None:
        ``q`` BF16 ``[m, heads, 64]`` (m >= 1), 16-byte aligned (with an
        option on: strides ``(S, 64, 1)``, S a multiple of 8); ``cache`` a
        ``PagedKVCache`` or its tensor, BF16 ``[num_blocks, kv_heads,
        block_size, 128]`` with 1 to 2^31 - 1 slots, 16-byte aligned;
        ``attn_slots`` ``[m, S]`` (S >= 1, m * S < 2^31) of the slot dtype;
        ``out`` (if given) BF16 ``[m, heads, 64]``, 4-byte aligned; every one a
        contiguous CUDA tensor on ``q``'s device; with the o-gate, ``gate``
        BF16 ``[m, heads, 64]`` or ``[m, heads * 64]`` with contiguous rows
        of a row stride that is a multiple of 8, 16-byte aligned, on that
        device (without it, ``gate`` must be None). The slot values are not
        read (``run`` does, outside graph capture)."""
        try:
            self._check_operands(q, cache, attn_slots, out, gate)
        except ValueError as error:
            return str(error)
        return None

    def takes(self, q, cache, attn_slots, out=None, gate=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(q, cache, attn_slots, out, gate) is None

    def _check_operands(self, q, cache, attn_slots, out, gate) -> None:
        c = self.constants
        if not (isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] >= 1):
            raise ValueError(f"the attention takes q of bf16 [m, {c.num_heads}, {c.head_dim}] with m >= 1")
        m = q.shape[0]
        device = q.device
        if self.takes_strided_q:
            row_stride(q, [(m, c.num_heads, c.head_dim)], "q")
            _check_place(q, 16, device, "q")
        else:
            _check(q, (m, c.num_heads, c.head_dim), torch.bfloat16, 16, device, "q")
        tensor = cache_tensor(cache)
        if not (isinstance(tensor, torch.Tensor) and tensor.dim() == 4):
            raise ValueError(f"the cache must be a PagedKVCache or a bf16 tensor of [num_blocks, {c.kv_heads}, "
                             f"{c.block_size}, {2 * c.head_dim}]")
        _check(tensor, (tensor.shape[0], c.kv_heads, c.block_size, 2 * c.head_dim), torch.bfloat16, 16, device,
               "the cache")
        slots = tensor.shape[0] * c.block_size
        if not 1 <= slots < 2**31:
            raise ValueError(f"the cache must hold 1 to 2^31 - 1 slots, not {slots}")
        if not (isinstance(attn_slots, torch.Tensor) and attn_slots.dim() == 2 and attn_slots.shape[1] >= 1):
            raise ValueError(f"attn_slots must be a {self.slot_dtype} tensor of [{m}, S] with S >= 1")
        _check(attn_slots, (m, attn_slots.shape[1]), self.slot_dtype, SLOT_BYTES[c.slot_dtype], device,
               "attn_slots")
        if attn_slots.numel() >= 2**31 or m > 65535:
            raise ValueError(f"attn_slots of [{m}, {attn_slots.shape[1]}]: at most 65535 tokens and "
                             f"2^31 - 1 entries")
        if out is not None:
            _check(out, tuple(q.shape), torch.bfloat16, 4, device, "out")
        if self.gated:
            row_stride(gate, [(m, c.num_heads, c.head_dim), (m, c.num_heads * c.head_dim)], "the gate")
            _check_place(gate, 16, device, "the gate")
        elif gate is not None:
            raise ValueError("this attention applies no o-gate (construct it with o_gate_eps): gate must be None")


    def run(self, q, cache, attn_slots, out=None, gate=None) -> torch.Tensor:
        """The attention of ``q`` over ``cache`` at ``attn_slots`` (negative:
        masked), BF16 ``[m, heads, 64]``, written into ``out`` if given (and
        returned). ValueError with ``problem``'s sentence and, outside
        CUDA-graph capture, for a slot at or past the cache's slot count (the
        spec's check; it reads the slots on the host). Inside a capture such
        a slot is masked by the kernel. With the o-gate, ``gate`` is the
        gate and the result is ``o_gate(attention, gate, HeadNorm(64,
        o_gate_eps), o_gate_arch)``."""
        reason = self.problem(q, cache, attn_slots, out, gate)
        if reason is not None:
            raise ValueError(reason)
        tensor = cache_tensor(cache)
        num_slots = tensor.shape[0] * self.constants.block_size
        if not stream_capturing() and int(attn_slots.max()) >= num_slots:
            raise ValueError(f"an attention slot beyond the cache's {num_slots} slots")
        return self.launch(q, tensor, attn_slots, out, gate)

    def launch(self, q, cache, attn_slots, out=None, gate=None) -> torch.Tensor:
        """``run`` without its checks (for operands ``takes``)."""
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        ops.launch(self, q, cache_tensor(cache), attn_slots, out, gate)
        return out

    def _launch_kernel(self, q: torch.Tensor, cache: torch.Tensor, attn_slots: torch.Tensor, out: torch.Tensor,
                       gate: torch.Tensor | None) -> None:
        m, s_len = attn_slots.shape
        kernel = self._compiled()
        if self.takes_strided_q:
            g, g_stride = (gate.data_ptr(), gate.stride(0)) if gate is not None else (0, 0)
            kernel(Int64(q.data_ptr()), Int64(q.stride(0)), Int64(cache.data_ptr()), Int64(attn_slots.data_ptr()),
                   Int64(out.data_ptr()), Int64(g), Int64(g_stride), Int32(m), Int32(s_len),
                   Int64(cache.shape[0] * self.constants.block_size), current_stream())
            return
        kernel(Int64(q.data_ptr()), Int64(cache.data_ptr()), Int64(attn_slots.data_ptr()), Int64(out.data_ptr()),
               Int32(m), Int32(s_len), Int64(cache.shape[0] * self.constants.block_size), current_stream())


def _check(t, shape: tuple, dtype, align: int, device, name: str) -> None:
    if not (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype
            and t.is_contiguous() and t.is_cuda and t.device == device and t.data_ptr() % align == 0):
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a contiguous CUDA {dtype} tensor of {tuple(shape)} aligned to {align} "
                         f"bytes on q's device, not {got}")


def row_stride(t, shapes: list, name: str) -> int:
    """The row stride (elements) of BF16 ``t`` of one of ``shapes`` whose
    rows are contiguous (strides ``(S, 64, 1)`` or ``(S, 1)``), S a positive
    multiple of 8 (any for a single row); ValueError otherwise."""
    ok = isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and tuple(t.shape) in [tuple(s) for s in shapes]
    if ok:
        inner = (HEAD_DIM, 1)[3 - t.dim():]
        # (A dimension of size 1 may carry any stride: it is never stepped.)
        ok = all(n == 1 or st == e for n, st, e in zip(t.shape[1:], t.stride()[1:], inner))
        ok = ok and (t.shape[0] == 1 or (t.stride(0) > 0 and t.stride(0) % 8 == 0))
    if not ok:
        got = (f"{t.dtype} {tuple(t.shape)} with strides {t.stride()}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{name} must be a bf16 tensor of {' or '.join(str(tuple(s)) for s in shapes)} with "
                         f"contiguous rows and a row stride that is a multiple of 8 elements, not {got}")
    return t.stride(0)


def _check_place(t, align: int, device, name: str) -> None:
    if not (t.is_cuda and t.device == device and t.data_ptr() % align == 0):
        raise ValueError(f"{name} must be a CUDA tensor on {device} aligned to {align} bytes, not on {t.device} "
                         f"at {t.data_ptr() % align} bytes past alignment")


__all__ = ["PagedAttention", "compile_attention", "row_stride"]
