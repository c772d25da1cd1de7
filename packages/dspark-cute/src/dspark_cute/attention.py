"""The decode attention kernel: ``dspark_core.spec.attention.paged_attention(q,
cache, attn_slots, num_kv_heads)``, bit for bit.

Operands: ``q`` BF16 ``[m, heads, 64]``; the paged cache BF16 ``[num_blocks,
kv_heads, block_size, 128]`` (K then V; slot ``s`` is row ``s % block_size``
of block ``s // block_size``); ``attn_slots`` int64 (or int32) ``[m, S]``, a
negative slot masked. ``m`` and ``S`` are runtime values: one compile serves
every shape.

Layout: one CTA of 128 threads per (token ``i``, query head ``h``), reading
KV head ``g = h // (heads / kv_heads)``. The spec's lane ``t`` (slot ``j``
belongs to lane ``j % 128``) is the thread of warp ``t % 4`` and lane
``t // 4``, so that the spec's fold by halves (lane ``t`` plus ``t + 64``,
then ``+ 32``, ... ``+ 1``) is first a butterfly inside each warp (offsets
16, 8, 4, 2, 1 are the spec's ``+ 64, + 32, + 16, + 8, + 4``), then the four
warp sums ``(W0 + W2) + (W1 + W3)`` (the spec's ``+ 2``, ``+ 1``). Thread
``t`` walks its slots ``j = t, t + 128, ...`` in increasing order:

0. L2 prefetches (no arithmetic, nothing waits for them): the thread's slot
   entries, then the K and V rows of its slots, ``PREFETCH_GROUP`` chunks'
   slots loaded at once, so that the passes below mostly hit L2;
1. pass 1, per valid slot (``0 <= slot < num_slots``): the K row (eight
   16-byte loads), ``s_j = mul.rn(head_sum(q * k), SCALE)``: 64 exact
   ``mul.rn`` products, the 32 pair sums ``(v0 + v1), (v2 + v3), ...``, folded
   by halves (``p_k + p_(k+16)``, then 8, 4, 2, 1), all ``add.rn``; the
   thread's running ``max.NaN.f32`` (NaN-propagating, as ``torch.amax``;
   from ``-inf``, so no valid slot leaves ``-inf``). Scores of the first
   ``SCORE_CHUNKS`` * 128 slots are kept in shared memory (per thread);
2. the CTA max: ``max.NaN`` butterflies in each warp, then the 4 warp maxima
   through shared memory (max is exact and order free);
3. pass 2, per valid slot: ``s_j`` (from shared memory, or recomputed with
   the same instructions past ``SCORE_CHUNKS``), ``p_j =
   exp_rn(sub.rn(s_j, mx))`` (``dspark_cute.ptx_math.exp_rn``, the spec's
   ``numerics.exp_rn``), ``l_t = add.rn(l_t, p_j)`` from +0.0, the V row,
   ``a_t[d] = add.rn(a_t[d], mul.rn(p_j, v[d]))`` from +0.0 (never fused);
4. the fold of the 128 lane sums by halves: ``l`` by warp butterflies and
   the 4 warp sums; each ``a[d]`` through shared memory (each warp's
   32 x 64 sums transposed, then folded in registers in the butterfly's
   order: lane ``k`` plus ``k + 16``, then 8, 4, 2, 1), then the 4 warp sums;
5. ``out[d] = cvt.rn.bf16(div.rn(a[d], l))``: no valid slot gives 0/0, NaN.

No FMA, no ``.ftz``, no approximation anywhere (``dspark_cute.ptx``'s
``*.rn.f32`` helpers). A slot at or past ``num_slots`` is masked by the
kernel (the host wrapper raises ValueError for one outside CUDA-graph
capture, as the spec does; inside a capture it cannot read the slots, and the
kernel then treats such a slot like a negative one). With ``pdl`` the kernel
waits for the previous grid before any load (every operand may come from
it) and releases the next grid after pass 2.

``PagedAttention(..., staged=True)`` and/or ``o_gate_eps=...`` launch the
opt-in variant instead (``dspark_cute.attention_v2``: K and V staged in
shared memory, a row-strided ``q``, the o-gate fused; the same bits). Both
kernels call the traced pieces of ``dspark_cute.attention_common`` (the
score, the pass-2 step, the folds; passes 1 and 2 over global memory, the
CTA max, steps 4-5), so that both run the same instructions on the same
values; the default kernel above compiles to the same PTX as before those
pieces were factored out of it.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils as cu_utils
import torch
from cutlass import Float32, Int32, Int64, Uint32

from dspark_core.contracts.constants import HEAD_DIM, AttentionConstants
from dspark_core.planner.policy import DEFAULT_STAGED_SLOTS
from dspark_core.spec.attention import LANES
from dspark_cute import ptx
from dspark_cute.attention_common import (
    PREFETCH_GROUP,
    ROW_BYTES,
    ROW_WORDS,
    SLOT_BYTES,
    WARPS,
    SlotWalk,
    cta_max,
    finish,
    lane_sums,
    load_row,
    pass1_global,
    pass2_global,
    prefetch_rows,
    score,
)
from dspark_cute.host import (
    CompileCache,
    LazyPdl,
    cache_tensor,
    compile_once,
    current_stream,
    fake_stream,
    stream_capturing,
)

# Slots whose scores pass 1 keeps in shared memory (per thread: one FP32 per
# chunk of 128 slots); later slots recompute their score in pass 2.
SCORE_CHUNKS = 32
SMEM_BYTES = 4 * (LANES * ROW_WORDS + 2 * WARPS + WARPS * HEAD_DIM)
assert SCORE_CHUNKS * LANES <= LANES * ROW_WORDS
SLOT_DTYPES = {"int32": torch.int32, "int64": torch.int64}
# The staged variant (dspark_cute.attention_v2): slots whose K and V rows it
# stages in shared memory by default (the planner's, dspark_core.planner.policy), and
# at most (256 bytes per slot).
MAX_STAGED_SLOTS = 768


def check_constants(c: AttentionConstants) -> None:
    """ValueError unless the kernel takes ``c``: 64-wide heads, query heads a
    multiple of the KV heads, a positive block size, int32 or int64 slots."""
    if not isinstance(c, AttentionConstants):
        raise ValueError(f"PagedAttention takes AttentionConstants, not {type(c).__name__}")
    if c.head_dim != HEAD_DIM:
        raise ValueError(f"the attention kernel takes heads of {HEAD_DIM} columns, not {c.head_dim}")
    if c.kv_heads < 1 or c.num_heads < 1 or c.num_heads % c.kv_heads:
        raise ValueError(f"{c.num_heads} query heads do not split into groups over {c.kv_heads} KV heads")
    if c.block_size < 1:
        raise ValueError(f"a KV block size of {c.block_size}, not a positive one")
    if c.slot_dtype not in SLOT_DTYPES:
        raise ValueError(f"attn_slots of int32 or int64, not {c.slot_dtype}")
    staged = c.staged_slots
    if not (isinstance(staged, int) and 0 <= staged <= MAX_STAGED_SLOTS and staged % LANES == 0):
        raise ValueError(f"staged slots of a multiple of {LANES} up to {MAX_STAGED_SLOTS}, not {staged}")
    if c.o_gate_eps is not None and not (isinstance(c.o_gate_eps, float) and c.o_gate_eps >= 0.0):
        raise ValueError(f"the o-norm's eps must be a non-negative float, not {c.o_gate_eps}")


# ---------------------------------------------------------------- the kernel


class PagedAttentionKernel:
    """The traced attention of one ``AttentionConstants``; ``pdl``: launched
    with programmatic dependent launch. Call: ``(q, cache, slots, out, m,
    s_len, num_slots, stream)``: byte addresses (Int64) of ``q`` (16-byte
    aligned), the cache tensor (16-byte aligned), ``attn_slots`` and ``out``
    (4-byte aligned); ``m`` and ``s_len`` (Int32) the token and slot-column
    counts, ``num_slots`` (Int64) the cache's slot count."""

    def __init__(self, constants: AttentionConstants, pdl: bool) -> None:
        check_constants(constants)
        if not constants.is_default:
            raise ValueError("staged or o-gated constants compile attention_v2.PagedAttentionV2Kernel")
        self.constants = constants
        self.pdl = pdl

    @cute.jit
    def __call__(self, q: Int64, cache: Int64, slots: Int64, out: Int64, m: Int32, s_len: Int32,
                 num_slots: Int64, stream):
        self.kernel(q, cache, slots, out, s_len, num_slots).launch(
            grid=[self.constants.num_heads, m, 1], block=[LANES, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, q: Int64, cache: Int64, slots: Int64, out: Int64, s_len: Int32, num_slots: Int64):
        c = self.constants
        group = c.num_heads // c.kv_heads
        tidx, _, _ = cute.arch.thread_idx()
        head, token, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        lane_t = Int32(lane) * WARPS + Int32(warp)  # the spec's lane of this thread

        # Shared memory: the scores (pass 1-2), then the lane sums [128][68];
        # the 4 warp maxima, the 4 warp sums of l, the warp sums [4][64].
        red = Int32(cu_utils.SmemAllocator().allocate(SMEM_BYTES, 16).toint())
        maxes = red + LANES * ROW_WORDS * 4
        lsums = maxes + 4 * WARPS
        wsums = lsums + 4 * WARPS
        own = Int32(red) + Int32(tidx) * 4  # this thread's score of chunk 0

        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
        q_row = Int64(q) + (Int64(token) * c.num_heads + Int64(head)) * ROW_BYTES
        slot_row = Int64(slots) + Int64(token) * Int64(s_len) * SLOT_BYTES[c.slot_dtype]
        # KV head g's rows of block b start at (b * kv_heads + g) * bs rows.
        kv_head = Int64(Uint32(head) // Uint32(group))
        chunks = (Int32(s_len) + (LANES - 1)) // LANES
        walk = SlotWalk(c, cache, slot_row, kv_head, lane_t, s_len, num_slots, chunks, own, SCORE_CHUNKS)

        # Prefetches (nothing waits for them): the slot entries, then the K
        # and V rows of PREFETCH_GROUP chunks at a time (their slots loaded
        # together, clamped into the cache: a masked slot prefetches some
        # row, harmlessly), so that the passes' loads hit L2.
        for ch in cutlass.range(chunks, unroll=1):
            ptx.prefetch_l2(slot_row + Int64(cutlass.min(ch * LANES + lane_t, s_len - 1)) * SLOT_BYTES[c.slot_dtype])
        for grp in cutlass.range((chunks + PREFETCH_GROUP - 1) // PREFETCH_GROUP, unroll=1):
            prefetch_rows(c, cache, slot_row, grp * (PREFETCH_GROUP * LANES) + lane_t, s_len, num_slots, kv_head)
        qf = ptx.widen_bf16(load_row(q_row))
        mx = cute.make_rmem_tensor(1, Float32)
        mx[0] = ptx.f32_const(-math.inf)
        # Pass 1 (the scores, the thread's max), the CTA max, pass 2 (p_j,
        # l_t, a_t[d]), then the folds and the output (attention_common).
        pass1_global(walk, qf, mx, 0)
        top = cta_max(mx[0], maxes, warp, lane)
        acc, lsum = lane_sums()
        pass2_global(walk, acc, lsum, top, q_row, 0)
        # The scores are dead once every thread is past pass 2 (finish's first barrier).
        finish(c, self.pdl, acc, lsum, red, lsums, wsums, out, token, head, tidx, warp, lane)


def fake_args(constants: AttentionConstants) -> tuple:
    """The compile signature of ``PagedAttentionKernel`` (no GPU memory needed)."""
    return (Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), Int32(1), Int64(1), fake_stream())


_CACHE = CompileCache()


def compile_attention(constants: AttentionConstants, pdl: bool):
    """The compiled ``PagedAttentionKernel`` of ``constants`` and ``pdl``
    (``attention_v2.PagedAttentionV2Kernel`` where an option is on),
    compiled once per process (RuntimeError during CUDA graph capture)."""
    if not constants.is_default:
        from dspark_cute.attention_v2 import compile_attention_v2

        return compile_attention_v2(constants, pdl, _CACHE)
    return compile_once(_CACHE, "attention", PagedAttentionKernel, constants, pdl, fake_args, "PagedAttention")


# ---------------------------------------------------------------- host API


class PagedAttention(LazyPdl):
    """``dspark_core.spec.attention.paged_attention(q, cache, attn_slots,
    kv_heads)`` as one kernel launch (module docstring), bit for bit (NaN
    payloads aside, as ``dspark_core.tools.compare`` allows).

    ``PagedAttention(heads, kv_heads, head_dim=64, block_size=16,
    slot_dtype=torch.int64, pdl=None)``: ``heads`` query heads over
    ``kv_heads`` KV heads of 64 columns, a cache of ``block_size`` slots per
    block (``DraftConfig.kv_block_size``), ``attn_slots`` of ``slot_dtype``
    (int64, as ``StepInputs`` builds them, or int32); ``pdl``: launch with
    programmatic dependent launch (default: where the device supports it,
    sm_90+). Call ``prepare()`` before CUDA graph capture; the call is
    graph-capturable once prepared (the operands' addresses are captured).

    Opt-in options (keyword only; both off by default, the kernel above):
    ``staged=True`` stages the K and V rows of the first
    ``max_staged_slots`` slots (a multiple of 128 up to 768; slots past it
    run the default's path inside the kernel) in shared memory in one
    memory round trip; ``o_gate_eps`` (a float) applies
    ``layers.o_gate(., gate, HeadNorm(64, o_gate_eps))`` to the output, the
    call then taking ``gate=``. Either option launches
    ``attention_v2.PagedAttentionV2Kernel`` (same bits), which also takes
    ``q`` as a row-strided view (``takes_strided_q``)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int = HEAD_DIM, block_size: int = 16,
                 slot_dtype: torch.dtype = torch.int64, pdl: bool | None = None, *, staged: bool = False,
                 max_staged_slots: int = DEFAULT_STAGED_SLOTS, o_gate_eps: float | None = None) -> None:
        names = {v: k for k, v in SLOT_DTYPES.items()}
        if slot_dtype not in names:
            raise ValueError(f"attn_slots of torch.int32 or torch.int64, not {slot_dtype}")
        if staged and not (isinstance(max_staged_slots, int) and max_staged_slots >= LANES):
            raise ValueError(f"staged=True stages at least {LANES} slots, not {max_staged_slots}")
        constants = AttentionConstants(num_heads=int(heads), kv_heads=int(kv_heads), head_dim=int(head_dim),
                                       block_size=int(block_size), slot_dtype=names[slot_dtype],
                                       staged_slots=max_staged_slots if staged else 0,
                                       o_gate_eps=None if o_gate_eps is None else float(o_gate_eps))
        check_constants(constants)
        self.constants = constants
        self.slot_dtype = slot_dtype
        self._pdl = pdl

    def prepare(self) -> None:
        """Compile the kernel this object launches (one per constants and PDL
        setting). Call before CUDA graph capture."""
        compile_attention(self.constants, self.pdl)

    @property
    def takes_strided_q(self) -> bool:
        """Whether ``q`` may be a row-strided view (an option is on)."""
        return not self.constants.is_default

    @property
    def gated(self) -> bool:
        """Whether the kernel applies the o-gate (the call takes ``gate=``)."""
        return self.constants.o_gate_eps is not None

    def check(self, q, cache, attn_slots, out=None, gate=None) -> None:
        """ValueError with a sentence unless the kernel takes these operands:
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
        read here (``__call__`` does, outside graph capture)."""
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

    def __call__(self, q, cache, attn_slots, out=None, gate=None) -> torch.Tensor:
        """The attention of ``q`` over ``cache`` at ``attn_slots`` (negative:
        masked), BF16 ``[m, heads, 64]``, written into ``out`` if given (and
        returned). ValueError for operands ``check`` refuses and, outside
        CUDA-graph capture, for a slot at or past the cache's slot count (the
        spec's check; it reads the slots on the host). Inside a capture such
        a slot is masked by the kernel. With the o-gate, ``gate`` is the
        gate (``check``) and the result is ``o_gate(attention, gate,
        HeadNorm(64, o_gate_eps))``."""
        self.check(q, cache, attn_slots, out, gate)
        tensor = cache_tensor(cache)
        num_slots = tensor.shape[0] * self.constants.block_size
        if not stream_capturing() and int(attn_slots.max()) >= num_slots:
            raise ValueError(f"an attention slot beyond the cache's {num_slots} slots")
        return self.launch(q, tensor, attn_slots, out, gate)

    def launch(self, q, cache: torch.Tensor, attn_slots, out=None, gate=None) -> torch.Tensor:
        """``__call__`` without its checks (``cache`` the tensor): for operands
        ``check`` accepts."""
        m, s_len = attn_slots.shape
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        kernel = compile_attention(self.constants, self.pdl)
        if self.takes_strided_q:
            g, g_stride = (gate.data_ptr(), gate.stride(0)) if gate is not None else (0, 0)
            kernel(Int64(q.data_ptr()), Int64(q.stride(0)), Int64(cache.data_ptr()), Int64(attn_slots.data_ptr()),
                   Int64(out.data_ptr()), Int64(g), Int64(g_stride), Int32(m), Int32(s_len),
                   Int64(cache.shape[0] * self.constants.block_size), current_stream())
            return out
        kernel(Int64(q.data_ptr()), Int64(cache.data_ptr()), Int64(attn_slots.data_ptr()), Int64(out.data_ptr()),
               Int32(m), Int32(s_len), Int64(cache.shape[0] * self.constants.block_size), current_stream())
        return out


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


__all__ = [
    "DEFAULT_STAGED_SLOTS",
    "MAX_STAGED_SLOTS",
    "SCORE_CHUNKS",
    "PagedAttention",
    "PagedAttentionKernel",
    "check_constants",
    "compile_attention",
    "fake_args",
    "score",
]
