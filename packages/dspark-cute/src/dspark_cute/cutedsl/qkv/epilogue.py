"""The QKV epilogue kernel: ``dspark_core.reference.model.DraftAttention.front`` after
its projection, bit for bit, in one launch.

Input: ``qkv``, the stock projection ``linear(x, attn.qkv_proj)``, BF16
``[m, rows]`` (rows: q ``heads * 64``, k ``kv * 64``, v ``kv * 64``, then,
with the o-gate, ``heads * 64`` o-gate rows the kernel never reads). For
every token ``t`` (any m >= 1) and every q, k and v head, with lane ``j``
of a warp holding the head's GPT-J pair ``(a, b) = (x_2j, x_2j+1)`` widened
exactly to FP32 (the QKV front's epilogue, ``dspark_cute.cutedsl.qkv.front``, whose
traced helpers this kernel calls):

1. q heads: ``HeadNorm`` (``heads.head_norm_pair``): ``s = a*a + b*b``
   (each square and the sum rounded), the head tree (the warp butterfly with
   offsets 16, 8, 4, 2, 1), ``r = 1 / sqrt(s / 64 + q_eps)`` (``div.rn``,
   ``add.rn``, ``sqrt.rn``, ``div.rn``), ``(a*r, b*r)``, times the BF16
   q-norm weight pair if any, rounded to BF16; then, with RoPE
   (``heads.rope_pair``), ``c, s`` the table's cos and sin of pair ``j``
   at ``positions[t]`` (``heads.load_cos_sin``; BF16 or FP32,
   widened exactly): ``a' = a*c - b*s``, ``b' = b*c + a*s`` (each product,
   the difference and the sum rounded once, no FMA), rounded to BF16;
2. k heads: the same with ``k_eps`` and no weight;
3. the insert (``dspark_core.spec.layers.kv_insert``): for ``s = slots[t] >= 0``,
   the k result and the v head's projected bits as they are written to the
   K and V halves of ``cache[s // bs, head, s % bs]``
   (``heads.cache_row_address``);
4. the output ``q`` BF16 ``[m, heads, 64]``: a new tensor (or the caller's
   ``out``), never ``qkv``; the o-gate stays in ``qkv``'s o-gate columns,
   where ``DraftAttention.split_qkv`` views it.

Every FP32 operation is an IEEE ``*.rn.f32`` (``dspark_cute.ptx``), so the
result is the stock ``HeadNorm`` / ``Rotary`` / ``PagedKVCache.insert``
chain on the same projection, bit for bit.

Layout: one CTA of ``WARPS`` warps per (token, group of ``GROUP_HEADS``
consecutive heads of the row q, k, v). Each thread copies 16 bytes of the
group into shared memory (one ``ld.global.v4``); after a barrier, warp
``w`` norms and rotates heads ``w, w + WARPS, ...`` in place there (lane
``j`` reading and writing its pair's 32-bit word); after a second barrier,
each thread writes its 16 bytes out (one ``st.global.v4``): a q head's to
``q``, a k or v head's to its half of the cache row. All global traffic is
16-byte accesses.

Out-of-range operands: the host (``__call__`` outside CUDA graph capture)
raises ValueError as the stock front does for a position outside
``[0, max_position)`` (with RoPE), a slot of ``num_blocks * bs`` or more and
a repeated non-negative slot. Inside capture nothing is read on the host;
the kernel then skips a slot outside ``[0, num_blocks * bs)`` (nothing
inserted) and a token whose position lies outside the table (neither its q
row nor its K/V written); a repeated slot is written by each of its tokens
in an unspecified order. With ``pdl`` every global load follows the PDL
wait (``qkv`` comes from the previous kernel) and the next grid is released
right after it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as cu_utils
import torch
from cutlass import Int32, Int64

from dspark_core.contracts.constants import HEAD_DIM, QKVFrontConstants
from dspark_core.errors import Unsupported
from dspark_core.spec.layers import capturing
from dspark_cute import ptx
from dspark_cute.cutedsl.heads import cache_row_address, head_norm_pair, load_cos_sin, rope_pair
from dspark_cute.runtime.host import (
    LazyPdl,
    cache_tensor,
    current_stream,
    describe,
    fake_stream,
    is_operand,
    jit_cache,
)

# Warps per CTA and heads per CTA (each thread copies 16 bytes of a 128-byte head).
WARPS = 4
HEAD_BYTES = 2 * HEAD_DIM
PARTS = HEAD_BYTES // 16
GROUP_HEADS = ptx.WARP * WARPS // PARTS
GROUP_BYTES = GROUP_HEADS * HEAD_BYTES
TABLE_DTYPES = ("bf16", "fp32")


def check_constants(c: QKVFrontConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (a QKVFrontConstants): at
    least one q head and one KV head, a BF16 or FP32 RoPE table."""
    if not isinstance(c, QKVFrontConstants):
        raise ValueError(f"QKVEpilogue takes QKVFrontConstants, not {type(c).__name__}")
    if c.num_heads < 1 or c.kv_heads < 1:
        raise Unsupported(f"the QKV epilogue takes at least one q head and one KV head, not {c.num_heads} "
                         f"and {c.kv_heads}")
    if c.table_dtype not in TABLE_DTYPES:
        raise Unsupported(f"the QKV epilogue reads a bf16 or fp32 RoPE table, not {c.table_dtype}")


# ---------------------------------------------------------------- the kernel


class QKVEpilogueKernel:
    """The traced QKV epilogue of one ``QKVFrontConstants``; ``pdl``:
    launched with programmatic dependent launch.

    Call: ``(qkv, out, q_weight, table, positions, slots, cache, row_elems,
    num_slots, block_size, max_position, m, stream)``: byte addresses (Int64)
    of ``qkv`` (BF16 ``[m, row_elems]``, 16-byte aligned), ``out`` (BF16
    ``[m, heads, 64]``, 16-byte aligned), the BF16 ``[64]`` q-norm weight,
    the ``[P, 64]`` table, the int64 ``[m]`` positions and slots and the
    cache (BF16 ``[num_blocks, kv, bs, 128]``, 16-byte aligned; an operand
    the constants do not read may be any address); ``row_elems`` (Int32),
    ``num_slots = num_blocks * bs`` (Int64), ``bs`` (Int32), ``P`` (Int64)
    and ``m`` (Int32, the grid's x)."""

    def __init__(self, constants: QKVFrontConstants, pdl: bool) -> None:
        self.c = constants
        self.pdl = pdl
        self.heads = constants.num_heads + 2 * constants.kv_heads
        self.groups = -(-self.heads // GROUP_HEADS)

    @cute.jit
    def __call__(self, qkv: Int64, out: Int64, q_weight: Int64, table: Int64, positions: Int64, slots: Int64,
                 cache: Int64, row_elems: Int32, num_slots: Int64, block_size: Int32, max_position: Int64,
                 m: Int32, stream):
        self.kernel(qkv, out, q_weight, table, positions, slots, cache, row_elems, num_slots, block_size,
                    max_position).launch(grid=[m, self.groups, 1], block=[ptx.WARP * WARPS, 1, 1],
                                         stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, qkv: Int64, out: Int64, q_weight: Int64, table: Int64, positions: Int64, slots: Int64,
               cache: Int64, row_elems: Int32, num_slots: Int64, block_size: Int32, max_position: Int64):
        c = self.c
        nq, kv = c.num_heads, c.kv_heads
        tidx, _, _ = cute.arch.thread_idx()
        tok, group, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        buf = cu_utils.SmemAllocator().allocate(GROUP_BYTES, 16).toint()
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
            ptx.pdl_launch_dependents()
        first = Int32(group) * GROUP_HEADS
        # The head and 16-byte part this thread copies in and out.
        head = first + Int32(tidx) // PARTS
        part = Int32(tidx) % PARTS
        mine = Int32(buf) + Int32(tidx) * 16
        if head < self.heads:
            src = Int64(qkv) + (Int64(tok) * Int64(row_elems) + Int64(head) * HEAD_DIM + Int64(part) * 8) * 2
            ptx.st_shared_v4(mine, ptx.ld_global_v4(src))
        pos = Int64(0)
        live = Int32(1)
        if cutlass.const_expr(c.rope):
            pos = ptx.ld_global_s64(Int64(positions) + Int64(tok) * 8)
            # One unsigned compare: a negative position is a huge unsigned one.
            if cutlass.Uint64(pos) >= cutlass.Uint64(max_position):
                live = Int32(0)
                pos = Int64(0)
        # Per token and lane: the q-norm weight pair and the cos/sin of pair `lane`.
        w = ptx.ld_global_b32(Int64(q_weight) + Int64(lane) * 4) if c.q_weight else None
        cos_sin = load_cos_sin(c.table_dtype, table, pos, lane) if c.rope else None
        cute.arch.barrier()
        for r in cutlass.range_constexpr(GROUP_HEADS // WARPS):
            h = first + Int32(warp) + WARPS * r
            at = Int32(buf) + (Int32(warp) + WARPS * r) * HEAD_BYTES + Int32(lane) * 4
            if h < nq + kv:
                a, b = ptx.bf16x2_to_f32(ptx.ld_shared_b32(at))
                if h < nq:
                    ptx.st_shared_b32(at, self._norm_rope(a, b, c.q_eps, w, cos_sin))
                else:
                    ptx.st_shared_b32(at, self._norm_rope(a, b, c.k_eps, None, cos_sin))
        cute.arch.barrier()
        if head < self.heads:
            if live != Int32(0):
                words = ptx.ld_shared_v4(mine)
                if head < nq:
                    dst = Int64(out) + ((Int64(tok) * nq + Int64(head)) * HEAD_DIM + Int64(part) * 8) * 2
                    ptx.st_global_v4(dst, words)
                else:
                    slot = ptx.ld_global_s64(Int64(slots) + Int64(tok) * 8)
                    # A negative slot is a huge unsigned one: skipped with the rest.
                    if cutlass.Uint64(slot) < cutlass.Uint64(num_slots):
                        # K heads nq .. nq+kv-1 (half 0), V heads after them (half 1).
                        is_v = Int32(head >= nq + kv)
                        row = cache_row_address(cache, slot, kv, head - nq - is_v * kv, block_size)
                        ptx.st_global_v4(row + Int64(is_v) * HEAD_BYTES + Int64(part) * 16, words)

    def _norm_rope(self, a, b, eps, weight_word, cos_sin):
        """``HeadNorm`` then (with RoPE) the rotation by ``cos_sin``: the QKV
        front's helpers; the packed BF16 pair."""
        word, na, nb = head_norm_pair(a, b, eps, weight_word)
        if cutlass.const_expr(cos_sin is None):
            return word
        return ptx.pack_bf16x2_rn(*rope_pair(na, nb, *cos_sin))


def fake_args(constants: QKVFrontConstants) -> tuple:
    """The compile signature of ``QKVEpilogueKernel`` (no GPU memory needed)."""
    return tuple(Int64(0) for _ in range(7)) + (
        Int32(1), Int64(1), Int32(1), Int64(1), Int32(1), fake_stream(),
    )


@jit_cache("QKVEpilogue")
def compile_qkv_epilogue(constants: QKVFrontConstants, pdl: bool):
    """The compiled ``QKVEpilogueKernel`` of ``constants`` and ``pdl``."""
    return QKVEpilogueKernel(constants, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API


class QKVEpilogue(LazyPdl):
    """``DraftAttention.front`` after the projection for ``constants``
    (module docstring): ``q = epilogue(qkv, positions, slots, cache)``
    returns BF16 ``[m, heads, 64]``, the stock front's q bit for bit, and
    writes the stock front's K/V into ``cache`` at ``slots``; the o-gate is
    ``qkv``'s o-gate columns (``attn.split_qkv(qkv)[3]``).

    ``q_norm_weight``: the q-norm's BF16 ``[64]`` weight (None without one,
    as ``constants.q_weight`` says); ``cos_sin``: the ``Rotary`` table
    ``[max_position, 64]`` of ``constants.table_dtype`` (None without RoPE),
    contiguous CUDA tensors on one device. ``constants.hidden_size`` is not
    read (the projection is done). ``pdl``: launch with programmatic
    dependent launch (default: where the device supports it, sm_90+). Call
    ``prepare()`` before CUDA graph capture; ``__call__`` and ``launch`` are
    graph-capturable once prepared (the operands' addresses are captured)."""

    def __init__(self, constants: QKVFrontConstants, q_norm_weight: torch.Tensor | None = None,
                 cos_sin: torch.Tensor | None = None, pdl: bool | None = None) -> None:
        check_constants(constants)
        c = constants
        device = None
        if c.q_weight:
            if not is_operand(q_norm_weight, torch.bfloat16, (HEAD_DIM,), 4):
                raise ValueError(f"the q-norm weight must be a contiguous CUDA bfloat16 tensor of [{HEAD_DIM}], "
                                 f"not {describe(q_norm_weight)}")
            device = q_norm_weight.device
        elif q_norm_weight is not None:
            raise ValueError("the constants have no q-norm weight, yet one was given")
        if c.rope:
            dtype = torch.bfloat16 if c.table_dtype == "bf16" else torch.float32
            rows = cos_sin.shape[0] if isinstance(cos_sin, torch.Tensor) and cos_sin.dim() == 2 else 0
            if not (rows >= 1 and is_operand(cos_sin, dtype, (rows, HEAD_DIM), 4, device)):
                raise ValueError(f"the RoPE table must be a contiguous CUDA {dtype} tensor of [max_position, "
                                 f"{HEAD_DIM}] on the q-norm weight's device, not {describe(cos_sin)}")
            device = cos_sin.device
        elif cos_sin is not None:
            raise ValueError("the constants have no RoPE, yet a table was given")
        self.constants = c
        self.q_norm_weight = q_norm_weight
        self.cos_sin = cos_sin
        self.device = device
        self._pdl = pdl
        self.q_size = c.num_heads * HEAD_DIM
        self.kv_size = c.kv_heads * HEAD_DIM

    def prepare(self) -> None:
        """Compile the kernel this object launches (one per constants and PDL
        setting). Call before CUDA graph capture."""
        compile_qkv_epilogue(self.constants, self.pdl)

    def problem(self, qkv, positions, slots, cache, out=None) -> str | None:
        """Why the kernel does not take these operands (a sentence), or None:
        ``qkv`` BF16 ``[m, rows]`` (m >= 1; rows ``q + 2 kv`` or, with the
        o-gate, ``2 q + 2 kv``), ``positions`` and ``slots`` int64 ``[m]``,
        ``cache`` (a tensor or a ``PagedKVCache``) BF16 ``[num_blocks, kv,
        bs, 128]``, ``out`` (if given) BF16 ``[m, heads, 64]``: contiguous
        CUDA tensors on one device (the weight's and table's), ``qkv``,
        ``cache`` and ``out`` 16-byte aligned."""
        c = self.constants
        widths = (self.q_size + 2 * self.kv_size, 2 * self.q_size + 2 * self.kv_size)
        if not (isinstance(qkv, torch.Tensor) and qkv.dim() == 2 and 1 <= qkv.shape[0] < 2**31
                and qkv.shape[1] in widths):
            return (f"qkv must be a bfloat16 projection of [m, {widths[0]}] or [m, {widths[1]}] (m >= 1), "
                    f"not {describe(qkv)}")
        m = qkv.shape[0]
        device = self.device or qkv.device
        if not is_operand(qkv, torch.bfloat16, qkv.shape, 16, device):
            return f"qkv must be a contiguous, 16-byte aligned CUDA bfloat16 tensor on {device}, not {describe(qkv)}"
        for name, t in (("positions", positions), ("slots", slots)):
            if not is_operand(t, torch.int64, (m,), 8, device):
                return f"{name} must be a contiguous CUDA int64 tensor of [{m}] on {device}, not {describe(t)}"
        t = cache_tensor(cache)
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else None
        if not (shape and shape[0] >= 1 and shape[2] >= 1 and shape[1:2] + shape[3:] == (c.kv_heads, HEAD_BYTES)
                and is_operand(t, torch.bfloat16, shape, 16, device)):
            return (f"the cache must be a contiguous, 16-byte aligned CUDA bfloat16 tensor of [num_blocks, "
                    f"{c.kv_heads}, block_size, {HEAD_BYTES}] on {device}, not {describe(t)}")
        if shape[2] >= 2**31:
            return "a cache block of 2^31 slots or more"
        if out is not None and not is_operand(out, torch.bfloat16, (m, c.num_heads, HEAD_DIM), 16, device):
            return (f"out must be a contiguous, 16-byte aligned CUDA bfloat16 tensor of [{m}, {c.num_heads}, "
                    f"{HEAD_DIM}] on {device}, not {describe(out)}")
        return None

    def takes(self, qkv, positions, slots, cache, out=None) -> bool:
        """Whether the kernel covers these operands (``problem`` says why not)."""
        return self.problem(qkv, positions, slots, cache, out) is None

    def run(self, qkv, positions, slots, cache, out=None) -> torch.Tensor:
        """q BF16 ``[m, heads, 64]`` (``out`` if given), K/V inserted into
        ``cache``. ValueError with ``problem``'s sentence unless it takes the
        operands; outside CUDA graph capture also the stock front's
        ValueErrors, read on the host: a position outside ``[0,
        max_position)`` (with RoPE), a slot beyond the cache, a repeated
        non-negative slot."""
        reason = self.problem(qkv, positions, slots, cache, out)
        if reason is not None:
            raise ValueError(reason)
        if not capturing():  # no host reads in a capture or while torch.compile traces
            self._check_ranges(positions, slots, cache)
        return self.launch(qkv, positions, slots, cache, out)

    def _check_ranges(self, positions, slots, cache) -> None:
        if self.constants.rope and (int(positions.min()) < 0 or int(positions.max()) >= self.cos_sin.shape[0]):
            raise ValueError(f"RoPE positions must lie in [0, {self.cos_sin.shape[0]})")
        t = cache_tensor(cache)
        num_slots = t.shape[0] * t.shape[2]
        kept = slots[slots >= 0]
        if kept.numel() and int(kept.max()) >= num_slots:
            raise ValueError(f"a slot beyond the cache's {num_slots} slots")
        if torch.unique(kept).numel() != kept.numel():
            raise ValueError("the KV insert takes distinct slots; a non-negative slot repeats")

    def launch(self, qkv, positions, slots, cache, out=None) -> torch.Tensor:
        """``run`` without its checks (for operands ``takes`` accepts and
        in-range positions and slots; the kernel skips others, module
        docstring)."""
        c = self.constants
        m = qkv.shape[0]
        if out is None:
            out = torch.empty((m, c.num_heads, HEAD_DIM), dtype=torch.bfloat16, device=qkv.device)
        t = cache_tensor(cache)
        nb, _, bs, _ = t.shape
        table = Int64(self.cos_sin.data_ptr() if c.rope else 0)
        max_position = Int64(self.cos_sin.shape[0] if c.rope else 1)
        qw = Int64(self.q_norm_weight.data_ptr() if c.q_weight else 0)
        compile_qkv_epilogue(c, self.pdl)(
            Int64(qkv.data_ptr()), Int64(out.data_ptr()), qw, table, Int64(positions.data_ptr()),
            Int64(slots.data_ptr()), Int64(t.data_ptr()), Int32(qkv.shape[1]), Int64(nb * bs), Int32(bs),
            max_position, Int32(m), current_stream(),
        )
        return out


__all__ = [
    "GROUP_HEADS",
    "WARPS",
    "QKVEpilogue",
    "QKVEpilogueKernel",
    "check_constants",
    "compile_qkv_epilogue",
    "fake_args",
]
