"""The QKV epilogue kernel: vLLM's ``fused_muse_spark_qknorm_rope_kv_insert``
after the stock QKV projection, bit for bit (``dspark_core.spec.layers.qk_norm_rope``
and ``kv_insert``; ``DraftAttention.front_from``), in place, in one launch.

Input: ``qkv``, the stock projection ``linear(x, attn.qkv_proj)``, BF16
``[m, rows]`` (rows: q ``heads * 64``, k ``kv * 64``, v ``kv * 64``, then,
with the o-gate, ``heads * 64`` o-gate rows the kernel never reads or
writes). For every token ``t`` (any m >= 1) and every q, k and v head, the
head's 8 lanes as the stock's: lane ``l`` holds the head's elements ``e_8l
.. e_8l+7`` (one 16-byte load), widened exactly to FP32:

1. q and k heads: the stock QK-norm (``heads.qk_norm_lane8``): ``L_l =
   fma(e_8l+7, e_8l+7, ... fma(e_8l, e_8l, +0.0))``, the 8 lane sums folded
   by halves (the group's butterfly xor 4, 2, 1), ``r =
   rsqrt.approx.f32(fma(S, 1/64, eps))`` (``q_eps`` for q heads, ``k_eps``
   for k heads), ``n_i = e_i * r`` in FP32; then, with RoPE, each GPT-J pair
   ``(x, y) = (n_2i, n_2i+1)``, ``i = 4l .. 4l+3``, with ``c, s`` the
   table's columns ``i`` and ``32 + i`` at ``positions[t]``
   (``heads.load_cos_sin_quad``; BF16 or FP32, widened exactly): ``x' =
   fma(c, x, -(s * y))``, ``y' = fma(s, x, c * y)`` (``heads.rope_fma``);
   one rounding to BF16; written back over the head in ``qkv``;
2. the insert: for ``s = slots[t] >= 0``, the k head's result and the v
   head's projected bits as they are, to the K and V halves of ``cache[s //
   bs, head, s % bs]``, addressed through the cache's block, token and head
   strides (``heads.strided_row_address``; ``runtime.kv_cache``: any
   physical order vLLM lays the cache out in, LBNHC and LBHNC alike); the v
   rows of ``qkv`` stay as they are.

Every other FP32 operation is ``mul.rn`` / ``add.rn`` (``dspark_cute.ptx``),
so the result is the stock kernel's on the same ``qkv``, bit for bit.

Layout: a CTA of ``THREADS`` threads per (token, group of ``GROUP_HEADS``
consecutive heads of the row q, k, v); every access of ``qkv`` and
the cache is 16 bytes (``ld.global.v4`` / ``st.global.v4``). The threads of
heads past the row's last compute on a clamped copy and write nothing.

Out-of-range operands: the host (``run`` outside CUDA graph capture) raises
ValueError as the stock QK-norm/RoPE/insert (``front_from``) does for a
position outside ``[0, max_position)`` (with RoPE), a slot of ``num_blocks
* bs`` or more and a repeated non-negative slot. Inside capture nothing is read on the host; the
kernel then skips a slot outside ``[0, num_blocks * bs)`` (nothing inserted)
and a token whose position lies outside the table (neither its q and k rows
nor its K/V written); a repeated slot is written by each of its tokens in an
unspecified order. With ``pdl`` every global load follows the PDL wait
(``qkv`` comes from the previous kernel) and the next grid is released right
after it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from dspark_core.contracts.constants import HEAD_DIM, QKVEpilogueConstants, within_limits
from dspark_core.spec.layers import capturing
from dspark_cute import ptx
from dspark_cute.cutedsl.heads import (
    LANE_ELEMS,
    LANE_PAIRS,
    LANES,
    head_eps,
    load_cos_sin_quad,
    qk_norm_lane8,
    rope_fma,
    strided_row_address,
)
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    LazyPdl,
    cache_tensor,
    current_stream,
    describe,
    fake_stream,
    is_operand,
    jit_cache,
)
from dspark_cute.runtime.kv_cache import MAX_SLOTS, byte_strides, cache_problem

# The two grids (8 lanes a head, as the stock). Per-token: a CTA of THREADS
# threads per (token, group of GROUP_HEADS heads). Flat: CTAs of
# FLAT_THREADS threads over the (token, head) list, as the stock's grid.
THREADS = 128
GROUP_HEADS = THREADS // LANES
FLAT_THREADS = 256
FLAT_HEADS = FLAT_THREADS // LANES
# The host launches the flat grid above this many (token, head) pairs, the
# per-token grid up to it: on an H200 the per-token grid was the faster up to
# 256 tokens of the reference draft's 80 heads, the flat one at 512
# (benchmarks/results/qkv_epilogue_design.md; the kernel as it runs: qkv_epilogue.md).
FLAT_ABOVE = 256 * 80
HEAD_BYTES = 2 * HEAD_DIM


def check_constants(c: QKVEpilogueConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (a QKVEpilogueConstants):
    its limits (``dspark_core.contracts.limits``: at least one q head and one
    KV head, no q-norm weight, the stock fused QK-norm being weightless, a
    BF16 or FP32 RoPE table)."""
    if not isinstance(c, QKVEpilogueConstants):
        raise ValueError(f"QKVEpilogue takes QKVEpilogueConstants, not {type(c).__name__}")
    within_limits(c)


# ---------------------------------------------------------------- the kernel


class QKVEpilogueKernel:
    """The traced QKV epilogue of one ``QKVEpilogueConstants``; ``pdl``:
    launched with programmatic dependent launch.

    Call: ``(qkv, table, positions, slots, cache, row_elems, num_slots,
    block_size, max_position, m, block_stride, token_stride, head_stride,
    stream)``: byte addresses (Int64) of ``qkv`` (BF16 ``[m, row_elems]``,
    16-byte aligned; read and written in place), the ``[P, 64]`` table
    (16-byte aligned), the int64 ``[m]`` positions and slots and the cache
    (the BF16 view ``[num_blocks, kv, bs, 128]``, rows contiguous, 16-byte
    aligned; an operand the constants do not read may be any address);
    ``row_elems`` (Int32), ``num_slots = num_blocks * bs`` (Int64, below
    2^31), ``bs`` (Int32), ``P`` (Int64), ``m`` (Int32) and the cache's
    block, token and head strides in bytes (Int64, multiples of 16).
    ``flat``: the flat grid (``m * heads`` below 2^31), else the per-token
    one (module constants); the same arithmetic per head either way."""

    def __init__(self, constants: QKVEpilogueConstants, pdl: bool, flat: bool = False) -> None:
        check_constants(constants)
        self.c = constants
        self.pdl = pdl
        self.flat = flat
        self.threads = FLAT_THREADS if flat else THREADS
        self.heads = constants.num_heads + 2 * constants.kv_heads
        self.groups = -(-self.heads // GROUP_HEADS)

    @cute.jit
    def __call__(self, qkv: Int64, table: Int64, positions: Int64, slots: Int64, cache: Int64, row_elems: Int32,
                 num_slots: Int64, block_size: Int32, max_position: Int64, m: Int32, block_stride: Int64,
                 token_stride: Int64, head_stride: Int64, stream):
        if cutlass.const_expr(self.flat):
            grid = [(Int32(m) * self.heads + (FLAT_HEADS - 1)) // FLAT_HEADS, 1, 1]
        else:
            grid = [m, self.groups, 1]
        self.kernel(qkv, table, positions, slots, cache, row_elems, num_slots, block_size, max_position,
                    block_stride, token_stride, head_stride, m).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, qkv: Int64, table: Int64, positions: Int64, slots: Int64, cache: Int64, row_elems: Int32,
               num_slots: Int64, block_size: Int32, max_position: Int64, block_stride: Int64, token_stride: Int64,
               head_stride: Int64, m: Int32):
        c = self.c
        nq, kv = c.num_heads, c.kv_heads
        tidx, _, _ = cute.arch.thread_idx()
        bx, group, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
            ptx.pdl_launch_dependents()
        lane = Int32(tidx) % LANES
        if cutlass.const_expr(self.flat):
            # The (token, head) list flattened; past its end: the last
            # token's work on a clamped copy, nothing written.
            index = cutlass.Uint32(Int32(bx) * FLAT_HEADS + Int32(tidx) // LANES)
            t32 = index // cutlass.Uint32(self.heads)
            head = Int32(index - t32 * cutlass.Uint32(self.heads))
            writes = Int32(t32) < Int32(m)
            tok = cutlass.min(Int32(t32), Int32(m) - 1)
            h = head
        else:
            tok = Int32(bx)
            head = Int32(group) * GROUP_HEADS + Int32(tidx) // LANES
            writes = head < self.heads
            # Past the row's last head: the same work on a clamped copy (the
            # group's butterfly needs all 8 lanes), nothing written.
            h = cutlass.min(head, Int32(self.heads - 1))
        at = Int64(qkv) + (Int64(tok) * Int64(row_elems) + Int64(h) * HEAD_DIM + Int64(lane) * LANE_ELEMS) * 2
        raw = ptx.ld_global_v4(at)
        slot = ptx.ld_global_s64(Int64(slots) + Int64(tok) * 8)
        live = Int32(1)
        cos = sin = None
        if cutlass.const_expr(c.rope):
            pos = ptx.ld_global_s64(Int64(positions) + Int64(tok) * 8)
            # One unsigned compare: a negative position is a huge unsigned one.
            if cutlass.Uint64(pos) >= cutlass.Uint64(max_position):
                live = Int32(0)
                pos = Int64(0)
            cos, sin = load_cos_sin_quad(c.table_dtype, table, pos, lane)
        eps = head_eps(c.q_eps, c.k_eps, h, nq)
        n = qk_norm_lane8([v for w in raw for v in ptx.bf16x2_to_f32(w)], eps)
        pairs = [(n[2 * i], n[2 * i + 1]) for i in range(LANE_PAIRS)]
        if cutlass.const_expr(c.rope):
            pairs = [rope_fma(x, y, cos[i], sin[i]) for i, (x, y) in enumerate(pairs)]
        normed = [ptx.pack_bf16x2_rn(x, y) for x, y in pairs]
        if writes:
            if live != Int32(0):
                if head < nq + kv:
                    ptx.st_global_v4(at, normed)  # q and k heads, in place
                if head >= nq:
                    # A negative slot is a huge unsigned one: skipped with the rest.
                    if cutlass.Uint64(slot) < cutlass.Uint64(num_slots):
                        # Slots fit 31 bits (the host refuses larger caches).
                        s32 = cutlass.Uint32(slot)
                        b32 = s32 // cutlass.Uint32(block_size)
                        block, page = Int64(b32), Int64(s32 - b32 * cutlass.Uint32(block_size))
                        if head < nq + kv:
                            row = strided_row_address(cache, block, page, head - nq, block_stride, token_stride,
                                                      head_stride)
                            ptx.st_global_v4(row + Int64(lane) * 16, normed)
                        else:
                            row = strided_row_address(cache, block, page, head - nq - kv, block_stride,
                                                      token_stride, head_stride)
                            ptx.st_global_v4(row + HEAD_BYTES + Int64(lane) * 16, raw)


def fake_args(constants: QKVEpilogueConstants) -> tuple:
    """The compile signature of ``QKVEpilogueKernel`` (no GPU memory needed)."""
    return tuple(Int64(0) for _ in range(5)) + (
        Int32(1), Int64(1), Int32(1), Int64(1), Int32(1), Int64(0), Int64(0), Int64(0), fake_stream(),
    )


@jit_cache("QKVEpilogue")
def compile_qkv_epilogue(constants: QKVEpilogueConstants, pdl: bool, flat: bool = False):
    """The compiled ``QKVEpilogueKernel`` of ``constants``, ``pdl`` and ``flat``."""
    return QKVEpilogueKernel(constants, pdl, flat), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("qkv_epilogue", "(str handle, Tensor(a!) qkv, Tensor positions, Tensor slots, Tensor(b!) cache) -> ()")


class QKVEpilogue(LazyPdl):
    """``DraftAttention.front_from`` for ``constants`` as vLLM's fused
    QK-norm / RoPE / KV insert runs it (module docstring): ``q =
    run(qkv, positions, slots, cache)`` norms and rotates the q and k rows
    of ``qkv`` in place, writes the K/V into ``cache`` at ``slots`` and
    returns ``q``, the view ``[m, heads, 64]`` of ``qkv``'s q rows (row
    stride ``rows``), bit for bit the stock ``front_from``'s q; the o-gate is
    ``qkv``'s o-gate rows, untouched (``attn.split_qkv(qkv)[3]``).

    ``q_norm_weight``: must be None (the stock fused QK-norm is weightless;
    the argument stays for the host contract's signature); ``cos_sin``: the
    ``Rotary`` table ``[max_position, 64]`` of ``constants.table_dtype``
    (None without RoPE), a contiguous, 16-byte aligned CUDA tensor.
    ``constants.hidden_size`` is not read (the projection is done). ``pdl``:
    launch with programmatic dependent launch (default: where the device
    supports it, sm_90+). Call ``prepare()`` before CUDA graph capture;
    ``run`` and ``launch`` are graph-capturable once prepared (the operands'
    addresses are captured). Traced by torch.compile, a launch is the op
    ``torch.ops.dspark.qkv_epilogue``."""

    OP = "qkv_epilogue"

    def __init__(self, constants: QKVEpilogueConstants, q_norm_weight: torch.Tensor | None = None,
                 cos_sin: torch.Tensor | None = None, pdl: bool | None = None) -> None:
        check_constants(constants)
        c = constants
        device = None
        if q_norm_weight is not None:
            raise ValueError("the QKV epilogue's QK-norm is weightless (the stock fused QK-norm), yet a q-norm "
                             "weight was given")
        if c.rope:
            dtype = torch.bfloat16 if c.table_dtype == "bf16" else torch.float32
            rows = cos_sin.shape[0] if isinstance(cos_sin, torch.Tensor) and cos_sin.dim() == 2 else 0
            if not (rows >= 1 and is_operand(cos_sin, dtype, (rows, HEAD_DIM), 16)):
                raise ValueError(f"the RoPE table must be a contiguous, 16-byte aligned CUDA {dtype} tensor of "
                                 f"[max_position, {HEAD_DIM}], not {describe(cos_sin)}")
            device = cos_sin.device
        elif cos_sin is not None:
            raise ValueError("the constants have no RoPE, yet a table was given")
        self.constants = c
        self.q_norm_weight = None
        self.cos_sin = cos_sin
        self.device = device
        self._pdl = pdl
        self.q_size = c.num_heads * HEAD_DIM
        self.kv_size = c.kv_heads * HEAD_DIM
        self.heads = c.num_heads + 2 * c.kv_heads
        # Above this many (token, head) pairs a call launches the flat grid
        # (the benchmark sets it to time either grid alone).
        self.flat_above = FLAT_ABOVE
        self.op_handle = ops.register(self)

    @property
    def max_rows(self) -> int:
        """The most rows one call takes (the flat grid's Int32 index over the
        (token, head) list: ``m * heads`` below 2^31)."""
        return (2**31 - 1) // self.heads

    def prepare(self) -> None:
        """Compile the kernels this object launches (the two grids, one pair
        per constants and PDL setting). Call before CUDA graph capture."""
        for flat in (False, True):
            compile_qkv_epilogue(self.constants, self.pdl, flat)

    def problem(self, qkv, positions, slots, cache) -> str | None:
        """Why the kernel does not take these operands (a sentence), or None:
        ``qkv`` BF16 ``[m, rows]`` (m >= 1, ``m * (q + 2 kv)`` heads below
        2^31; rows ``q + 2 kv`` or, with the o-gate, ``2 q + 2 kv``) and
        ``positions`` and ``slots`` int64 ``[m]``, contiguous; ``cache`` (a
        tensor or a ``PagedKVCache``) the BF16 view ``[num_blocks, kv, bs,
        128]`` of fewer than 2^31 slots in any physical order whose rows are
        contiguous and 16-byte aligned (``runtime.kv_cache.cache_problem``);
        all CUDA tensors on one device (the table's), ``qkv`` 16-byte
        aligned."""
        c = self.constants
        widths = (self.q_size + 2 * self.kv_size, 2 * self.q_size + 2 * self.kv_size)
        if not (isinstance(qkv, torch.Tensor) and qkv.dim() == 2 and 1 <= qkv.shape[0] < 2**31
                and qkv.shape[1] in widths):
            return (f"qkv must be a bfloat16 projection of [m, {widths[0]}] or [m, {widths[1]}] (m >= 1), "
                    f"not {describe(qkv)}")
        m = qkv.shape[0]
        device = self.device or qkv.device
        if m > self.max_rows:
            return f"qkv of 2^31 heads or more ({m} tokens of {self.heads}; max_rows {self.max_rows})"
        if not is_operand(qkv, torch.bfloat16, qkv.shape, 16, device):
            return f"qkv must be a contiguous, 16-byte aligned CUDA bfloat16 tensor on {device}, not {describe(qkv)}"
        for name, t in (("positions", positions), ("slots", slots)):
            if not is_operand(t, torch.int64, (m,), 8, device):
                return f"{name} must be a contiguous CUDA int64 tensor of [{m}] on {device}, not {describe(t)}"
        t = cache_tensor(cache)
        if not (isinstance(t, torch.Tensor) and t.is_cuda and t.device == device):
            return f"the cache must be a CUDA tensor on {device}, not {describe(t)}"
        if t.dim() == 4 and t.shape[0] * t.shape[2] >= MAX_SLOTS:
            return f"a KV cache of 2^31 slots or more ({t.shape[0]} blocks of {t.shape[2]})"
        return cache_problem(t, c.kv_heads, 16)

    def takes(self, qkv, positions, slots, cache) -> bool:
        """Whether the kernel covers these operands (``problem`` says why not)."""
        return self.problem(qkv, positions, slots, cache) is None

    def run(self, qkv, positions, slots, cache) -> torch.Tensor:
        """q (the view of ``qkv``'s q rows, normed and rotated in place; k
        rows likewise), K/V inserted into ``cache``. ValueError with
        ``problem``'s sentence unless it takes the operands; outside CUDA
        graph capture also the stock ``front_from``'s ValueErrors, read on the host
        before anything is written: a position outside ``[0,
        max_position)`` (with RoPE), a slot beyond the cache, a repeated
        non-negative slot."""
        reason = self.problem(qkv, positions, slots, cache)
        if reason is not None:
            raise ValueError(reason)
        if not capturing():  # no host reads in a capture or while torch.compile traces
            self._check_ranges(positions, slots, cache)
        return self.launch(qkv, positions, slots, cache)

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

    def launch(self, qkv, positions, slots, cache) -> torch.Tensor:
        """``run`` without its checks (for operands ``takes`` accepts and
        in-range positions and slots; the kernel skips others, module
        docstring)."""
        ops.launch(self, qkv, positions, slots, cache_tensor(cache))
        c = self.constants
        return qkv[:, : self.q_size].unflatten(1, (c.num_heads, HEAD_DIM))

    def _launch_kernel(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       t: torch.Tensor) -> None:
        c = self.constants
        m = qkv.shape[0]
        nb, _, bs, _ = t.shape
        table = Int64(self.cos_sin.data_ptr() if c.rope else 0)
        max_position = Int64(self.cos_sin.shape[0] if c.rope else 1)
        strides = tuple(Int64(b) for b in byte_strides(t))
        flat = m * self.heads > self.flat_above  # from the row count alone
        compile_qkv_epilogue(c, self.pdl, flat)(
            Int64(qkv.data_ptr()), table, Int64(positions.data_ptr()), Int64(slots.data_ptr()),
            Int64(t.data_ptr()), Int32(qkv.shape[1]), Int64(nb * bs), Int32(bs), max_position, Int32(m), *strides,
            current_stream(),
        )


__all__ = [
    "FLAT_ABOVE",
    "FLAT_THREADS",
    "GROUP_HEADS",
    "THREADS",
    "QKVEpilogue",
    "QKVEpilogueKernel",
    "check_constants",
    "compile_qkv_epilogue",
    "fake_args",
]
