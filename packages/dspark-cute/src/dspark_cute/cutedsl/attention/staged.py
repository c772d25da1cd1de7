"""The staged decode attention kernel: the direct kernel's bits (``direct``)
with fewer memory round trips, a strided ``q`` and an optional o-gate, for
constants with ``staged_slots`` and / or ``o_gate_eps``
(``AttentionConstants``). Both kernels call the traced pieces of ``common``
(the score, the pass-2 step, the folds, the cache addressing; the passes over
global memory, the CTA max, the folds and output), so that both run the same
instructions on the same values.

Layout: as the default kernel (one CTA of 128 threads per token and query
head; the spec's lane ``t`` is the thread of warp ``t % 4`` and lane ``t //
4``; thread ``t`` walks the slots ``j = t, t + 128, ...``; the same max, the
same exp, the same lane sums and folds, so the bits are the default's).
What changes is where the K and V rows come from:

0. the q row (eight 16-byte loads from ``q + token * q_stride``: any row
   stride, a multiple of 8 elements) and, with the o-gate, lane ``l``'s gate
   word are loaded first;
1. the slot table: thread ``t`` loads the entries ``t + 128 k`` (``k <
   staged_slots / 128``, all loads in flight together) into shared memory as
   32-bit entries (the slot where ``0 <= slot < num_slots``, else
   ``num_slots``: masked);
2. the copies (one memory round trip): the K and V rows of the first
   ``min(S, staged_slots)`` slots, 16 bytes per ``cp.async.cg``, 8 threads
   per 128-byte row (coalesced), into shared memory at ``j * 256`` (K, then
   V at ``+ 128``), 16-byte chunk ``k`` of row ``j`` at position ``k ^ ((j >>
   2) & 7)`` (a swizzle: the 8 lanes of a quarter warp read 8 different bank
   groups); ``cp.async.wait_all`` and a CTA barrier;
3. pass 1 over the staged chunks (unrolled: at most ``staged_slots / 128``)
   reads K from shared memory, their scores stay in registers; pass 2 reads
   V from shared memory;
4. slots past ``staged_slots`` (S above the cap) take the default kernel's
   path inside the kernel: L2 prefetches, K from global memory in pass 1
   (scores kept in shared memory for the first ``STAGED_SCORE_CHUNKS`` chunks,
   recomputed past them), V from global memory in pass 2. No refusal: any S
   works, the slots past the cap only run slower;
5. the folds and ``div.rn`` as the default (``common.finish``);
   then either the BF16 store, or the o-gate epilogue (the CTA owns the
   whole head: warp 0's lane ``l`` holds columns ``2l``, ``2l + 1``):
   ``x = round_bf16(a / l)``, then the stock o-gate of ``o_gate_arch``
   (``dspark_cute.cutedsl.gating.o_gate``, the head as 32 lanes of 2
   columns: ``common.o_gate_pair``): ``layers.o_gate(paged_attention(...),
   gate, HeadNorm(64, eps), o_gate_arch)`` bit for bit. ``o_gate_arch`` is
   a compile-time setting of the kernel (the constants carry only the
   o-norm's eps).

``staged_slots = 0`` (``o_gate_eps`` alone) runs every slot through step 4.

Shared memory (bytes): the staged rows ``staged_slots * 256``, the scores
``STAGED_SCORE_CHUNKS * 512``, the slot table ``staged_slots * 4``, the whole
region reused by the fold (``128 * 68 * 4`` at least), then 1056 for the
maxima and warp sums: 102.5 KB at the default cap of 384 slots (2 CTAs per
H200 SM; 71.7 KB, 3 per SM, at 256), at most 200 KB (768 slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from dspark_core.contracts.constants import HEAD_DIM, AttentionConstants
from dspark_core.spec.attention import LANES
from dspark_cute import ptx
from dspark_cute.cutedsl.attention.common import (
    PREFETCH_GROUP,
    ROW_BYTES,
    ROW_WORDS,
    SLOT_BYTES,
    WARPS,
    SlotWalk,
    add_slot,
    cache_row,
    check_constants,
    cta_max,
    finish,
    lane_sums,
    load_row,
    pass1_global,
    pass2_global,
    prefetch_rows,
    score,
)
from dspark_cute.cutedsl.gating.o_gate import check_arch
from dspark_cute.runtime.host import fake_stream, jit_cache, smem_allocator

# Chunks of 128 slots past the staged ones whose scores pass 1 keeps in
# shared memory (later ones are recomputed in pass 2, as the default does
# past its SCORE_CHUNKS).
STAGED_SCORE_CHUNKS = 8
# Rows copied per step of the copy loop (8 threads per 128-byte row), and
# steps whose table entries are read before their copies are issued.
COPY_ROWS = LANES // 8
COPY_GROUP = 4
STAGED_ROW_BYTES = 2 * ROW_BYTES  # K then V
FOLD_BYTES = 4 * LANES * ROW_WORDS
TAIL_BYTES = 4 * (2 * WARPS + WARPS * HEAD_DIM)


@dataclass(frozen=True)
class Layout:
    """Byte offsets in the kernel's shared memory."""

    scores: int
    table: int
    tail: int
    total: int


def smem_layout(c: AttentionConstants) -> Layout:
    """The shared memory of the variant of ``c`` (module docstring)."""
    stage = c.staged_slots * STAGED_ROW_BYTES
    scores = stage
    table = scores + STAGED_SCORE_CHUNKS * LANES * 4
    tail = max(table + 4 * c.staged_slots, FOLD_BYTES)
    return Layout(scores=scores, table=table, tail=tail, total=tail + TAIL_BYTES)


def check_staged_constants(c: AttentionConstants) -> None:
    """``attention.check_constants`` plus: an option on (else the default
    kernel is the one to use)."""
    check_constants(c)
    if c.is_default:
        raise ValueError("StagedAttentionKernel runs staged or o-gated variants; the default constants compile "
                         "DirectAttentionKernel")


# ---------------------------------------------------------------- traced pieces


def staged_offset(row, chunk: int):
    """The byte offset of 16-byte chunk ``chunk`` (0-7) of staged row ``row``
    within its 128-byte half: position ``chunk ^ ((row >> 2) & 7)``."""
    return (((Int32(row) >> 2) & 7) ^ chunk) * 16


def load_staged(half, row) -> list:
    """The 32 words of a staged 128-byte row half (K at ``row * 256``, V at
    ``+ 128``; ``half`` its shared byte address), in column order."""
    words = []
    for k in range(ROW_BYTES // 16):
        words += ptx.ld_shared_v4(Int32(half) + staged_offset(row, k))
    return words


# ---------------------------------------------------------------- the kernel


class StagedAttentionKernel:
    """The traced staged / o-gated attention of one ``AttentionConstants``
    (an option on); ``pdl``: launched with programmatic dependent launch.
    Call: ``(q, q_stride, cache, slots, out, gate, gate_stride, m, s_len,
    num_slots, stream)``: byte addresses (Int64) of ``q``'s first row
    (16-byte aligned; row ``i`` at element ``i * q_stride``, a multiple of
    8), the cache tensor (16-byte aligned), ``attn_slots``, ``out``
    (contiguous, 4-byte aligned) and the gate's first row (4-byte aligned,
    row ``i`` at element ``i * gate_stride``; unused without the o-gate);
    ``m`` and ``s_len`` (Int32), ``num_slots`` (Int64). ``o_gate_arch``:
    the stock o-gate whose arithmetic the epilogue runs (``ARCHS`` of
    ``dspark_cute.cutedsl.gating.o_gate``; unused without the o-gate)."""

    def __init__(self, constants: AttentionConstants, pdl: bool, o_gate_arch: str = "sm_90a") -> None:
        check_staged_constants(constants)
        self.constants = constants
        self.pdl = pdl
        self.o_gate_arch = check_arch(o_gate_arch)

    @cute.jit
    def __call__(self, q: Int64, q_stride: Int64, cache: Int64, slots: Int64, out: Int64, gate: Int64,
                 gate_stride: Int64, m: Int32, s_len: Int32, num_slots: Int64, stream):
        self.kernel(q, q_stride, cache, slots, out, gate, gate_stride, s_len, num_slots).launch(
            grid=[self.constants.num_heads, m, 1], block=[LANES, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, q: Int64, q_stride: Int64, cache: Int64, slots: Int64, out: Int64, gate: Int64,
               gate_stride: Int64, s_len: Int32, num_slots: Int64):
        c = self.constants
        lay = smem_layout(c)
        wide = c.slot_dtype == "int64"
        width = SLOT_BYTES[c.slot_dtype]
        group = c.num_heads // c.kv_heads
        bs = c.block_size
        cap = c.staged_slots
        capc = cap // LANES
        tidx, _, _ = cute.arch.thread_idx()
        head, token, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        lane_t = Int32(lane) * WARPS + Int32(warp)  # the spec's lane of this thread

        # Shared memory: the staged rows, scores and slot table (passes 0-2),
        # then the lane sums [128][68]; the maxima and warp sums after them.
        base = Int32(smem_allocator().allocate(lay.total, 128).toint())
        own = base + lay.scores + Int32(tidx) * 4  # this thread's score of chunk 0
        table = base + lay.table
        maxes = base + lay.tail
        lsums = maxes + 4 * WARPS
        wsums = lsums + 4 * WARPS

        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
        q_row = Int64(q) + Int64(token) * Int64(q_stride) * 2 + Int64(head) * ROW_BYTES
        q_words = load_row(q_row)
        gate_word = None  # finish reads it only with the o-gate
        if cutlass.const_expr(c.o_gate_eps is not None):
            gate_row = Int64(gate) + (Int64(token) * Int64(gate_stride) + Int64(head) * HEAD_DIM) * 2
            gate_word = ptx.ld_global_b32(gate_row + Int64(lane) * 4)
        slot_row = Int64(slots) + Int64(token) * Int64(s_len) * width
        kv_head = Int64(Uint32(head) // Uint32(group))
        chunks = (Int32(s_len) + (LANES - 1)) // LANES
        ns = Int32(num_slots)  # < 2^31
        walk = SlotWalk(c, cache, slot_row, kv_head, lane_t, s_len, num_slots, chunks, own, STAGED_SCORE_CHUNKS)

        if cutlass.const_expr(capc > 0):
            # The slot table: every load in flight (indices clamped below S), then the stores.
            last = Int32(s_len) - 1
            entries = [ptx.ld_global_slot(slot_row + Int64(cutlass.min(Int32(tidx) + k * LANES, last)) * width, wide)
                       for k in range(capc)]
            for e in cutlass.range_constexpr(capc):
                ptx.st_shared_b32(table + (Int32(tidx) + e * LANES) * 4, ptx.slot_entry(entries[e], num_slots))
            cute.arch.barrier()
            # The copies: COPY_GROUP steps of COPY_ROWS rows at a time (their
            # entries read first), 8 threads per row, 16 bytes of K and of V each.
            staged = cutlass.min(Int32(s_len), cap)
            sub = Int32(tidx) // 8
            part = Int32(tidx) % 8
            per = COPY_GROUP * COPY_ROWS
            for grp in cutlass.range((staged + (per - 1)) // per, unroll=1):
                rows = [grp * per + k * COPY_ROWS + sub for k in range(COPY_GROUP)]
                ents = [ptx.ld_shared_s32(table + row * 4) for row in rows]
                for i in cutlass.range_constexpr(COPY_GROUP):
                    src = cache_row(cache, ents[i], kv_head, c.kv_heads, bs) + Int64(part) * 16
                    dst = base + rows[i] * STAGED_ROW_BYTES + staged_offset(rows[i], part)
                    ptx.cp_async_16_if(dst, src, rows[i], staged, ents[i], ns)
                    ptx.cp_async_16_if(dst + ROW_BYTES, src + ROW_BYTES, rows[i], staged, ents[i], ns)
        # Slots past the cap (all of them unstaged): the default's L2
        # prefetches (the slot entries, then K and V rows PREFETCH_GROUP
        # chunks at a time) while the copies fly.
        for ch in cutlass.range(capc, chunks, unroll=1):
            ptx.prefetch_l2(slot_row + Int64(cutlass.min(ch * LANES + lane_t, s_len - 1)) * width)
        rest = cutlass.max(chunks - capc, 0)
        for pgrp in cutlass.range((rest + PREFETCH_GROUP - 1) // PREFETCH_GROUP, unroll=1):
            prefetch_rows(c, cache, slot_row, (capc + pgrp * PREFETCH_GROUP) * LANES + lane_t, s_len, num_slots,
                          kv_head)
        if cutlass.const_expr(capc > 0):
            ptx.cp_async_wait_all()
            cute.arch.barrier()

        qf = ptx.widen_bf16(q_words)
        mx = cute.make_rmem_tensor(1, Float32)
        mx[0] = ptx.f32_const(-math.inf)
        sc = cute.make_rmem_tensor(max(capc, 1), Float32)
        # Pass 1, staged chunks: K from shared memory, the scores in registers.
        for sch in cutlass.range_constexpr(capc):
            sj = sch * LANES + lane_t
            if sj < s_len:
                if ptx.ld_shared_s32(table + sj * 4) < ns:
                    sc[sch] = score(qf, load_staged(base + sj * STAGED_ROW_BYTES, sj))
                    mx[0] = ptx.max_nan(mx[0], sc[sch])
        # Pass 1 past the cap: the default's.
        pass1_global(walk, qf, mx, capc)
        top = cta_max(mx[0], maxes, warp, lane)
        acc, lsum = lane_sums()
        # Pass 2, staged chunks: V from shared memory.
        for vch in cutlass.range_constexpr(capc):
            vj = vch * LANES + lane_t
            if vj < s_len:
                if ptx.ld_shared_s32(table + vj * 4) < ns:
                    add_slot(acc, lsum, sc[vch], top, load_staged(base + vj * STAGED_ROW_BYTES + ROW_BYTES, vj))
        # Pass 2 past the cap: the default's.
        pass2_global(walk, acc, lsum, top, q_row, capc)
        # The staged rows, scores and table are dead once every thread is past
        # pass 2 (finish's first barrier); the fold reuses them.
        finish(c, self.pdl, acc, lsum, base, lsums, wsums, out, token, head, tidx, warp, lane, gate_word,
               self.o_gate_arch)


def fake_staged_args(constants: AttentionConstants) -> tuple:
    """The compile signature of ``StagedAttentionKernel`` (no GPU memory needed)."""
    return (Int64(0), Int64(constants.num_heads * HEAD_DIM), Int64(0), Int64(0), Int64(0), Int64(0),
            Int64(constants.num_heads * HEAD_DIM), Int32(1), Int32(1), Int64(1), fake_stream())


__all__ = [
    "COPY_GROUP",
    "COPY_ROWS",
    "STAGED_SCORE_CHUNKS",
    "Layout",
    "StagedAttentionKernel",
    "check_staged_constants",
    "compile_staged_attention",
    "fake_staged_args",
    "load_staged",
    "smem_layout",
]


@jit_cache("PagedAttention (staged / o-gate)")
def compile_staged_attention(constants: AttentionConstants, pdl: bool, o_gate_arch: str = "sm_90a"):
    """The compiled ``StagedAttentionKernel`` of ``constants``, ``pdl`` and
    ``o_gate_arch``."""
    return StagedAttentionKernel(constants, pdl, o_gate_arch), fake_staged_args(constants)
