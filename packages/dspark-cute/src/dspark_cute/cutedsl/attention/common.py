"""The traced pieces both decode attention kernels run: the default kernel
(``dspark_cute.cutedsl.attention.paged``) and the staged / o-gated variant
(``dspark_cute.cutedsl.attention.staged``) call the same functions, so that both run the
same instructions on the same values (the steps named below are the default
kernel's, in ``dspark_cute.cutedsl.attention.paged``'s docstring).

The traced math
(the score, the pass-2 step of one slot, the folds, the cache addressing);
the passes over slots whose K and V rows come from global memory (all of the
default kernel's slots, the variant's past its staging cap) and the steps
after them: ``pass1_global``, ``cta_max``, ``pass2_global``, ``finish``.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32, Uint64

from dspark_core.contracts.constants import HEAD_DIM, AttentionConstants, within_limits
from dspark_core.spec.attention import LANES, scale
from dspark_cute import ptx
from dspark_cute.cutedsl.gating.o_gate import o_gate_fragment

WARPS = LANES // ptx.WARP  # 4
# The transposed lane sums: one row of 64 FP32 per thread, padded to 68 words
# so that 8 consecutive lanes' 16-byte stores hit distinct bank groups.
ROW_WORDS = HEAD_DIM + 4
# Chunks whose K and V rows one prefetch step covers (slot loads in flight together).
PREFETCH_GROUP = 4
SLOT_BYTES = {"int32": 4, "int64": 8}
ROW_BYTES = 2 * HEAD_DIM  # one K (or V) row of BF16
SLOT_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def check_constants(c: AttentionConstants) -> None:
    """Unsupported unless the kernels take ``c``: their limits
    (``dspark_core.contracts.limits``: 64-wide heads, query heads a multiple
    of the KV heads, a positive block size, int32 or int64 slots, staged
    slots a multiple of 128 up to 768); the o-norm's eps is checked where
    the constants are built (``contracts.constants._Key``)."""
    if not isinstance(c, AttentionConstants):
        raise ValueError(f"PagedAttention takes AttentionConstants, not {type(c).__name__}")
    within_limits(c)


# ---------------------------------------------------------------- traced math


def load_row(addr) -> list:
    """The 32 words (64 BF16) of a 128-byte row at global ``addr``: eight
    16-byte loads."""
    words = []
    for k in range(ROW_BYTES // 16):
        words += ptx.ld_global_v4(Int64(addr) + 16 * k)
    return words


def score(qf: list, k_words: list) -> Float32:
    """Step 1: ``mul.rn(head_sum(q * k), SCALE)``; ``qf`` the 64 query values
    (FP32), ``k_words`` the K row's 32 packed words."""
    k = ptx.widen_bf16(k_words)
    pairs = [ptx.add_rn(ptx.mul_rn(qf[2 * p], k[2 * p]), ptx.mul_rn(qf[2 * p + 1], k[2 * p + 1]))
             for p in range(HEAD_DIM // 2)]
    return ptx.mul_rn(ptx.fold_halves(pairs), ptx.f32_const(scale(HEAD_DIM)))


def cache_row(cache, slot, kv_head, kv_heads: int, bs: int) -> Int64:
    """The byte address of KV head ``kv_head``'s row of ``slot`` (valid:
    ``0 <= slot < num_slots < 2^31``): row ``slot % bs`` of block ``slot //
    bs``, rows of ``2 * ROW_BYTES`` (K then V). Unsigned 32-bit division by
    the constant ``bs``."""
    s32 = Uint32(slot)
    block, page = s32 // Uint32(bs), s32 % Uint32(bs)
    return Int64(cache) + ((Int64(block) * kv_heads + kv_head) * bs + Int64(page)) * (2 * ROW_BYTES)


def prefetch_rows(c: AttentionConstants, cache, slot_row, j0, s_len, num_slots, kv_head) -> None:
    """L2 prefetches of the K and V rows of slots ``j0 + 128 k`` (``k <
    PREFETCH_GROUP``): the slot loads first (indices clamped below ``s_len``),
    then every row, each slot clamped into ``[0, num_slots)``: branch free,
    so the loads are in flight together."""
    width = SLOT_BYTES[c.slot_dtype]
    last = Int32(s_len) - 1
    slots = [ptx.ld_global_slot(slot_row + Int64(cutlass.min(j0 + k * LANES, last)) * width, width == 8)
             for k in range(PREFETCH_GROUP)]
    for slot in slots:
        clamped = cutlass.min(cutlass.max(slot, Int64(0)), Int64(num_slots) - 1)
        row = cache_row(cache, clamped, kv_head, c.kv_heads, c.block_size)
        ptx.prefetch_l2(row)
        ptx.prefetch_l2(row + ROW_BYTES)


def fill(acc, value) -> None:
    """Every element of the register tensor ``acc`` (64 FP32) set to ``value``."""
    for d in range(HEAD_DIM):
        acc[d] = value


def accumulate(acc, p, v: list) -> None:
    """Step 3 for one slot: ``acc[d] = add.rn(acc[d], mul.rn(p, v[d]))``."""
    for d in range(HEAD_DIM):
        acc[d] = ptx.add_rn(acc[d], ptx.mul_rn(p, v[d]))


def add_slot(acc, lsum, s, top, v_words: list) -> None:
    """Pass 2 for one valid slot of score ``s`` and V row ``v_words`` (32
    packed words): ``p = exp_rn(sub.rn(s, top))``, ``l_t = add.rn(l_t, p)``,
    then ``accumulate`` (``lsum`` a 1-element register tensor)."""
    p = ptx.exp_rn(ptx.sub_rn(s, top))
    lsum[0] = ptx.add_rn(lsum[0], p)
    accumulate(acc, p, ptx.widen_bf16(v_words))


def fold_columns(acc, red, wsums, tidx, warp, lane) -> None:
    """Step 4 for the 64 ``a_t[d]``, after a CTA barrier past pass 2: each
    thread's row to ``red`` (``[128][ROW_WORDS]`` FP32), a barrier, warp
    ``w``'s columns ``2 lane``, ``2 lane + 1`` over its 32 lanes folded in
    the butterfly's order (the spec's +64, +32, +16, +8, +4) into ``wsums``
    (``[4][64]``), a barrier."""
    row = Int32(red) + Int32(tidx) * (ROW_WORDS * 4)
    for k in range(HEAD_DIM // 4):
        ptx.st_shared_v4_f32(row + 16 * k, [acc[4 * k + e] for e in range(4)])
    cute.arch.barrier()
    col = Int32(red) + Int32(warp) * (ptx.WARP * ROW_WORDS * 4) + Int32(lane) * 8
    pairs = [ptx.ld_shared_v2_f32(col + r * (ROW_WORDS * 4)) for r in range(ptx.WARP)]
    w0 = ptx.fold_halves([p[0] for p in pairs])
    w1 = ptx.fold_halves([p[1] for p in pairs])
    ptx.st_shared_v2_f32(wsums + (Int32(warp) * HEAD_DIM + Int32(lane) * 2) * 4, w0, w1)
    cute.arch.barrier()


def quotients(lsums, wsums, lane) -> list:
    """Steps 4-5 in warp 0: ``l`` (the 4 warp sums at ``lsums``, ``(W0 + W2)
    + (W1 + W3)``) and lane ``lane``'s columns ``2 lane``, ``2 lane + 1`` of
    ``a`` (the 4 warp sums at ``wsums``, the same order): ``[div.rn(a, l)]``
    for the two columns."""
    ls = [ptx.ld_shared_f32(lsums + 4 * w) for w in range(WARPS)]
    total = ptx.add_rn(ptx.add_rn(ls[0], ls[2]), ptx.add_rn(ls[1], ls[3]))
    ws = [ptx.ld_shared_v2_f32(wsums + (w * HEAD_DIM) * 4 + Int32(lane) * 8) for w in range(WARPS)]
    res = []
    for e in range(2):
        a = ptx.add_rn(ptx.add_rn(ws[0][e], ws[2][e]), ptx.add_rn(ws[1][e], ws[3][e]))
        res.append(ptx.div_rn(a, total))
    return res


def o_gate_pair(res: list, gate_word, eps: float, arch: str) -> Uint32:
    """The o-gate epilogue of warp 0's lane ``l`` holding the quotients
    ``res`` of columns ``2l``, ``2l + 1`` (the staged kernel's step 5): the
    BF16 output word of ``layers.o_gate(attention, gate, HeadNorm(64,
    eps), arch)`` for the attention output ``x = round_bf16(res)`` and the
    gate pair ``gate_word``, in ``dspark_cute.cutedsl.gating.o_gate``'s
    arithmetic for ``arch`` with the head over 32 lanes of 2 columns
    (``head_sum_of_squares``: on sm_90a FLA's lane ``l // 2`` is lanes ``l``
    and ``l ^ 1``, its folds the butterflies 16, 8, 4, 2; on sm_100a the
    butterflies 1 .. 16), in every lane."""
    x = list(ptx.round_bf16x2(res[0], res[1]))
    g = list(ptx.bf16x2_to_f32(gate_word))
    return o_gate_fragment(x, g, eps, arch)[0]


# ---------------------------------------------------------------- the passes over global memory


class SlotWalk(NamedTuple):
    """One thread's walk over its slots ``j = ch * 128 + lane_t`` (chunk
    ``ch < chunks``), as the passes below read them: ``c`` the constants,
    ``cache`` the cache tensor's byte address, ``slot_row`` the byte address
    of the token's ``attn_slots`` row, ``kv_head`` (Int64), ``lane_t`` the
    spec's lane of the thread, ``s_len`` (Int32), ``num_slots`` (Int64),
    ``chunks`` (Int32, ``ceil(s_len / 128)``), ``own`` the shared byte
    address of the thread's kept score of chunk 0 (chunk ``ch``'s at ``own
    + 512 ch``) and ``kept`` the chunks whose scores pass 1 keeps there."""

    c: AttentionConstants
    cache: Int64
    slot_row: Int64
    kv_head: Int64
    lane_t: Int32
    s_len: Int32
    num_slots: Int64
    chunks: Int32
    own: Int32
    kept: int


@cute.jit
def pass1_global(w: SlotWalk, qf: list, mx, first: int) -> None:
    """Step 1 for chunks ``first`` to ``w.chunks - 1``, one chunk at a time:
    where ``j < s_len``, the slot (``ld_global_slot``); where ``0 <= slot <
    num_slots`` (one unsigned comparison), the K row from global memory,
    ``s = score(qf, k)``, ``mx[0] = max_nan(mx[0], s)`` and, for ``ch <
    kept``, ``s`` stored at ``own + 512 ch``."""
    c = w.c
    for ch in cutlass.range(first, w.chunks, unroll=1):
        j = ch * LANES + w.lane_t
        if j < w.s_len:
            slot = ptx.ld_global_slot(w.slot_row + Int64(j) * SLOT_BYTES[c.slot_dtype], c.slot_dtype == "int64")
            if Uint64(slot) < Uint64(w.num_slots):
                s = score(qf, load_row(cache_row(w.cache, slot, w.kv_head, c.kv_heads, c.block_size)))
                mx[0] = ptx.max_nan(mx[0], s)
                if ch < w.kept:
                    ptx.st_shared_f32(w.own + ch * (LANES * 4), s)


@cute.jit
def cta_max(value, maxes, warp, lane) -> Float32:
    """Step 2: the CTA's ``max.NaN`` of the threads' ``value``: ``warp_max``,
    lane 0 stores its warp's at ``maxes + 4 warp``, a CTA barrier, then
    ``max(max(W0, W2), max(W1, W3))`` (in every thread)."""
    wmax = ptx.warp_max(value)
    if lane == 0:
        ptx.st_shared_f32(maxes + Int32(warp) * 4, wmax)
    cute.arch.barrier()
    m4 = [ptx.ld_shared_f32(maxes + 4 * w) for w in range(WARPS)]
    return ptx.max_nan(ptx.max_nan(m4[0], m4[2]), ptx.max_nan(m4[1], m4[3]))


def lane_sums() -> tuple:
    """The thread's pass-2 sums, both from +0.0: ``acc`` (64 FP32, the
    ``a_t[d]``) and ``lsum`` (1 FP32, ``l_t``), register tensors."""
    acc = cute.make_rmem_tensor(HEAD_DIM, Float32)
    lsum = cute.make_rmem_tensor(1, Float32)
    zero = ptx.f32_const(0.0)
    lsum[0] = zero
    fill(acc, zero)
    return acc, lsum


@cute.jit
def pass2_global(w: SlotWalk, acc, lsum, top, q_row, first: int) -> None:
    """Step 3 for chunks ``first`` to ``w.chunks - 1``, one chunk at a time:
    where ``j < s_len``, the slot; where ``0 <= slot < num_slots``, the V row
    from global memory, the score (for ``ch < kept`` the one pass 1 stored,
    else recomputed: the q row at ``q_row`` and the K row loaded again,
    ``score``), then ``add_slot`` into ``acc`` and ``lsum`` with the CTA max
    ``top``."""
    c = w.c
    sc = cute.make_rmem_tensor(1, Float32)
    for ch in cutlass.range(first, w.chunks, unroll=1):
        j = ch * LANES + w.lane_t
        if j < w.s_len:
            slot = ptx.ld_global_slot(w.slot_row + Int64(j) * SLOT_BYTES[c.slot_dtype], c.slot_dtype == "int64")
            if Uint64(slot) < Uint64(w.num_slots):
                k_row = cache_row(w.cache, slot, w.kv_head, c.kv_heads, c.block_size)
                v_words = load_row(k_row + ROW_BYTES)
                if ch < w.kept:
                    sc[0] = ptx.ld_shared_f32(w.own + ch * (LANES * 4))
                else:
                    sc[0] = score(ptx.widen_bf16(load_row(q_row)), load_row(k_row))
                add_slot(acc, lsum, sc[0], top, v_words)


@cute.jit
def finish(c: AttentionConstants, pdl: bool, acc, lsum, red, lsums, wsums, out, token, head, tidx, warp, lane,
           gate_word=None, o_gate_arch: str = "sm_90a") -> None:
    """Steps 4-5 after pass 2, in this order: with ``pdl`` the release of
    the next grid; ``l``'s warp fold (``ptx.warp_fold``), lane 0 storing its
    warp's at ``lsums + 4 warp``; a CTA barrier (the shared memory before
    ``red + 128 * 68 * 4`` is then free); ``fold_columns`` through ``red``
    into ``wsums``; in warp 0, ``quotients`` and lane ``l``'s output word at
    ``out + ((token * heads + head) * 64 + 2 l) * 2``: the two BF16
    quotients (``cvt.rn``) or, with ``c.o_gate_eps``, ``o_gate_pair`` of them
    and ``gate_word`` in the stock o-gate arithmetic of ``o_gate_arch``."""
    if cutlass.const_expr(pdl):
        # Dependents still wait for this grid's end before they read `out`.
        ptx.pdl_launch_dependents()
    # The fold of l: butterflies (the spec's +64 .. +4), then the warps.
    wl = ptx.warp_fold(lsum[0])
    if lane == 0:
        ptx.st_shared_f32(lsums + Int32(warp) * 4, wl)
    cute.arch.barrier()
    fold_columns(acc, red, wsums, tidx, warp, lane)
    if warp == 0:
        res = quotients(lsums, wsums, lane)
        out_row = Int64(out) + (Int64(token) * c.num_heads + Int64(head)) * ROW_BYTES
        if cutlass.const_expr(c.o_gate_eps is None):
            ptx.st_global_b32(out_row + Int64(lane) * 4, ptx.pack_bf16x2_rn(res[0], res[1]))
        else:
            ptx.st_global_b32(out_row + Int64(lane) * 4, o_gate_pair(res, gate_word, c.o_gate_eps, o_gate_arch))
