"""The direct decode attention kernel (K and V read from global memory):
``dspark_core.spec.attention.paged_attention(q, cache, attn_slots,
num_kv_heads)``, bit for bit.

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
   exp_rn(sub.rn(s_j, mx))`` (``dspark_cute.ptx.math.exp_rn``, the spec's
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

Constants with ``staged_slots`` or ``o_gate_eps`` launch the staged kernel
instead (``staged``: K and V staged in shared memory, a row-strided ``q``,
the o-gate fused; the same bits). Both kernels call the traced pieces of
``common`` (the score, the pass-2 step, the folds; passes 1 and 2 over global
memory, the CTA max, steps 4-5), so that both run the same instructions on the
same values.
"""

from __future__ import annotations

import math

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
    check_constants,
    cta_max,
    finish,
    lane_sums,
    load_row,
    pass1_global,
    pass2_global,
    prefetch_rows,
)
from dspark_cute.runtime.host import (
    fake_stream,
    jit_cache,
    smem_allocator,
)

# Slots whose scores pass 1 keeps in shared memory (per thread: one FP32 per
# chunk of 128 slots); later slots recompute their score in pass 2.
SCORE_CHUNKS = 32
SMEM_BYTES = 4 * (LANES * ROW_WORDS + 2 * WARPS + WARPS * HEAD_DIM)
assert SCORE_CHUNKS * LANES <= LANES * ROW_WORDS
# ---------------------------------------------------------------- the kernel


class DirectAttentionKernel:
    """The traced attention of one ``AttentionConstants``; ``pdl``: launched
    with programmatic dependent launch. Call: ``(q, cache, slots, out, m,
    s_len, num_slots, stream)``: byte addresses (Int64) of ``q`` (16-byte
    aligned), the cache tensor (16-byte aligned), ``attn_slots`` and ``out``
    (4-byte aligned); ``m`` and ``s_len`` (Int32) the token and slot-column
    counts, ``num_slots`` (Int64) the cache's slot count."""

    def __init__(self, constants: AttentionConstants, pdl: bool) -> None:
        check_constants(constants)
        if not constants.is_default:
            raise ValueError("staged or o-gated constants compile staged.StagedAttentionKernel")
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
        red = Int32(smem_allocator().allocate(SMEM_BYTES, 16).toint())
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
        # l_t, a_t[d]), then the folds and the output (common).
        pass1_global(walk, qf, mx, 0)
        top = cta_max(mx[0], maxes, warp, lane)
        acc, lsum = lane_sums()
        pass2_global(walk, acc, lsum, top, q_row, 0)
        # The scores are dead once every thread is past pass 2 (finish's first barrier).
        finish(c, self.pdl, acc, lsum, red, lsums, wsums, out, token, head, tidx, warp, lane)


def fake_args(constants: AttentionConstants) -> tuple:
    """The compile signature of ``DirectAttentionKernel`` (no GPU memory needed)."""
    return (Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), Int32(1), Int64(1), fake_stream())


@jit_cache("PagedAttention")
def compile_direct_attention(constants: AttentionConstants, pdl: bool):
    """The compiled ``DirectAttentionKernel`` of ``constants`` and ``pdl``."""
    return DirectAttentionKernel(constants, pdl), fake_args(constants)


__all__ = ["SCORE_CHUNKS", "DirectAttentionKernel", "compile_direct_attention", "fake_args"]
