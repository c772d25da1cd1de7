"""The QKV front kernel: ``dspark_core.reference.model.DraftAttention.front`` for 1 to 16
tokens in one launch.

For ``x`` BF16 ``[m, H]`` (1 <= m <= 16) and the QKV weight ``W`` BF16
``[rows, H]`` (rows: q ``heads * 64``, k ``kv * 64``, v ``kv * 64``, o-gate
``heads * 64``), one CTA per 64-row head tile ``hd``:

1. the projection ``p = x @ W[64 hd : 64 hd + 64]^T`` on the skinny GEMM main
   loop (``dspark_cute.cutedsl.gemm.skinny.config``: its docstring states the summation
   order and the error bound against float64; tensor-core MMAs, the only
   multiply-adds of the kernel), rounded to BF16 (``cvt.rn.bf16x2.f32``);
2. per token, one warp per (token, head), lane ``j`` holding the GPT-J pair
   ``(p_2j, p_2j+1)`` of the step-1 BF16 projection (a packed word):

   - q and k heads: vLLM's fused QK-norm (``heads.qk_norm_pair``: the
     stock's 8 lanes of 8 elements are lanes ``4l .. 4l+3`` here; each lane
     gathers its four words and runs the sequential chain ``fma(e_8l+7,
     e_8l+7, ... fma(e_8l, e_8l, +0.0))`` itself, the eight chains fold by
     the butterfly xor 16, 8, 4; ``r = rsqrt.approx.f32(fma(S, 1/64,
     eps))``, ``q_eps`` for q heads, ``k_eps`` for k heads; ``(a, b) =
     (p_2j * r, p_2j+1 * r)`` in FP32), then, with RoPE, ``c, s`` = the
     table row ``positions[token]`` at columns ``j`` and ``32 + j``: ``a' =
     fma(c, a, -(s * b))``, ``b' = fma(s, a, c * b)`` (``heads.rope_fma``),
     one rounding to BF16; a k head's result is also written to the K half
     of the cache row of ``slots[token]``;
   - v heads: the projection as is, also written to the V half of that row;
   - o-gate heads: the projection as is;

   every other FP32 operation ``mul.rn`` / ``add.rn`` (``dspark_cute.ptx``),
   so step 2 is bit for bit vLLM's ``fused_muse_spark_qknorm_rope_kv_insert``
   (``dspark_core.spec.layers.qk_norm_rope`` and ``kv_insert``) applied to
   the kernel's step-1 projection;
3. ``out[token, 64 hd + 2j .. + 1]`` = the pair (q and k rows normed and
   rotated, v and o-gate rows projected): the stock op's ``qkv`` after it
   ran in place.

The cache is ``[num_blocks, kv, block_size, 128]`` BF16 (K then V); slot
``s`` is row ``s % block_size`` of block ``s // block_size``; a negative slot
(or one beyond the cache) writes nothing. Positions outside the table are
clamped into it for memory safety (the stock ``Rotary`` raises there).

With ``raw=True`` the kernel stops after step 1 and writes the BF16
projection of every row (the test mode that exposes step 1's values). With
``pdl`` the weight copies of the first pipeline stages are issued before the
PDL wait (they overlap the previous kernel); x, positions and slots are read
after it, and the next grid is released once the main loop is done.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as cu_utils
import torch
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_ptr

from dspark_core.contracts.constants import HEAD_DIM, MAX_DECODE_ROWS, QKVFrontConstants
from dspark_core.errors import Unsupported
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.cutedsl.gemm.skinny.ring import mainloop as ring_mainloop
from dspark_cute.cutedsl.gemm.skinny.tile import reduced_pair, store_partials
from dspark_cute.cutedsl.heads import cache_row_address, head_eps, load_cos_sin, qk_norm_pair, rope_fma
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    cache_tensor,
    check_operand,
    current_stream,
    describe,
    fake_ptr,
    fake_stream,
    is_operand,
    jit_cache,
    pdl_supported,
    ptr,
)


def check_constants(c: QKVFrontConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (a QKVFrontConstants): at
    least one q head, 1 to 32 KV heads (a power of two), no q-norm weight
    (the stock fused QK-norm is weightless), a BF16 or FP32 RoPE table."""
    if not isinstance(c, QKVFrontConstants):
        raise ValueError(f"QKVFront takes QKVFrontConstants, not {type(c).__name__}")
    kv = c.kv_heads
    if c.num_heads < 1 or kv < 1 or kv & (kv - 1) or kv > 32:
        raise Unsupported(f"the QKV front takes at least one head and 1 to 32 KV heads (a power of two), "
                         f"not {c.num_heads} and {kv}")
    if c.q_weight:
        raise Unsupported("a q-norm weight (the stock fused QK-norm is weightless)")
    if c.table_dtype not in ("bf16", "fp32"):
        raise Unsupported(f"the QKV front reads a bf16 or fp32 RoPE table, not {c.table_dtype}")


class QKVFrontKernel:
    """The traced QKV front of one ``QKVFrontConstants`` and variant
    (``SkinnyConfig`` ``cfg``, ``raw``, ``pdl``). Call: ``(x, weight,
    table, positions, slots, cache, out, m, num_slots, block_size, max_pos,
    stream)``: global pointers (a pointer whose operand
    the variant does not read may be any), ``m``, ``block_size`` and
    ``max_pos`` Int32, ``num_slots`` Int64."""

    def __init__(self, constants: QKVFrontConstants, cfg: sg.SkinnyConfig, raw: bool, pdl: bool) -> None:
        if cfg.x_regs:
            raise ValueError("the QKV front runs the ring main loop with x in the ring (x_regs False): x "
                             "through registers is the package GEMM's")
        check_constants(constants)
        self.c = constants
        self.cfg = cfg
        self.raw = raw
        self.pdl = pdl
        self.rows = (2 * constants.num_heads + 2 * constants.kv_heads) * HEAD_DIM

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, table: cute.Pointer,
                 positions: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, out: cute.Pointer,
                 m: Int32, num_slots: Int64, block_size: Int32, max_pos: Int32, stream):
        self.kernel(x, weight, table, positions, slots, cache, out, m, num_slots, block_size,
                    max_pos).launch(grid=[self.rows // sg.TILE_ROWS, 1, 1], block=[self.cfg.threads, 1, 1],
                                    stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, table: cute.Pointer,
               positions: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, out: cute.Pointer,
               m: Int32, num_slots: Int64, block_size: Int32, max_pos: Int32):
        c, cfg = self.c, self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        hd, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        ring = cu_utils.SmemAllocator().allocate(cfg.smem_bytes, 128).toint()
        tile = Int64(weight.toint()) + Int64(hd) * (sg.TILE_ROWS * cfg.k * 2)
        acc = ring_mainloop(cfg, tile, x.toint(), m, ring, tidx, warp, lane,
                          before_x=ptx.pdl_wait if self.pdl else None)
        if cutlass.const_expr(self.pdl):
            # Release the next grid only now: released at the start, its CTAs
            # compete with this grid's for SM slots (the package's README).
            ptx.pdl_launch_dependents()
        store_partials(cfg, acc, ring, warp, lane)
        heads, kv = c.num_heads, c.kv_heads
        eps = head_eps(c.q_eps, c.k_eps, hd, heads)  # the CTA's head is uniform
        for r in cutlass.range_constexpr(_rounds(cfg)):
            tok = Int32(warp) + cfg.k_warps * r
            a, b = reduced_pair(cfg, ring, tok, lane)
            word = ptx.pack_bf16x2_rn(a, b)
            o_addr = Int64(out.toint()) + (Int64(tok) * self.rows + Int64(hd) * HEAD_DIM + Int64(lane) * 2) * 2
            if cutlass.const_expr(self.raw):
                ptx.st_global_b32_if(o_addr, word, tok, m)
            else:
                tok_c = cutlass.min(tok, m - 1)
                # One warp per (token, head); the branches are CTA-uniform.
                if hd < heads + kv:
                    res = self._norm_rope(word, eps, table, positions, tok_c, max_pos, lane)
                    ptx.st_global_b32_if(o_addr, res, tok, m)
                    if hd >= heads:
                        self._insert(res, 0, hd - heads, slots, cache, tok, tok_c, m, num_slots, block_size, lane)
                else:
                    ptx.st_global_b32_if(o_addr, word, tok, m)
                    if hd < heads + 2 * kv:
                        self._insert(word, 1, hd - heads - kv, slots, cache, tok, tok_c, m, num_slots,
                                     block_size, lane)

    def _norm_rope(self, word, eps, table, positions, tok_c, max_pos, lane):
        """The fused QK-norm (with ``eps``) and, with RoPE, the rotation of
        the q or k head whose pair ``word`` this lane holds: the packed BF16
        result."""
        c = self.c
        na, nb = qk_norm_pair(word, lane, eps)
        if cutlass.const_expr(not c.rope):
            return ptx.pack_bf16x2_rn(na, nb)
        pos = ptx.ld_global_clamped_s64(Int64(positions.toint()) + Int64(tok_c) * 8, Int64(0), Int64(max_pos) - 1)
        cos, sin = load_cos_sin(c.table_dtype, table.toint(), pos, lane)
        return ptx.pack_bf16x2_rn(*rope_fma(na, nb, cos, sin))

    def _insert(self, word, half: int, kv_head, slots, cache, tok, tok_c, m, num_slots, block_size, lane):
        slot = ptx.ld_global_s64(Int64(slots.toint()) + Int64(tok_c) * 8)
        row = cache_row_address(cache.toint(), slot, self.c.kv_heads, kv_head, block_size)
        addr = row + half * (2 * HEAD_DIM) + Int64(lane) * 4
        ptx.st_global_b32_if_slot(addr, word, tok, m, slot, num_slots)


def _rounds(cfg: sg.SkinnyConfig) -> int:
    """Epilogue rounds: warp ``w`` takes tokens ``w + W_K * r`` below ``8 n_tiles``."""
    return -(-8 * cfg.n_tiles // cfg.k_warps)


def _int64_ptr(address: int):
    return make_ptr(Int64, address, cute.AddressSpace.gmem, assumed_align=8)


def fake_args(constants: QKVFrontConstants) -> tuple:
    """The compile signature of ``QKVFrontKernel`` (no GPU memory needed)."""
    table = constants.table_dtype if constants.rope else "bf16"
    # Alignments as `launch` passes them: x and the weight 16 bytes (16-byte
    # copies), the 4-byte-accessed operands 4, positions and slots 8.
    return (
        fake_ptr("bf16", 16), fake_ptr("bf16", 16), fake_ptr(table, 4),
        _int64_ptr(0), _int64_ptr(0), fake_ptr("bf16", 4), fake_ptr("bf16", 4),
        Int32(1), Int64(1), Int32(1), Int32(1), fake_stream(),
    )


@jit_cache("QKVFront")
def compile_qkv_front(constants: QKVFrontConstants, cfg: sg.SkinnyConfig, raw: bool, pdl: bool):
    """The compiled ``QKVFrontKernel`` of one variant."""
    return QKVFrontKernel(constants, cfg, raw, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("qkv_front",
           "(str handle, Tensor x, Tensor positions, Tensor slots, Tensor(a!) cache, Tensor(b!) out) -> ()")


def _i64_ptr(t: torch.Tensor):
    return _int64_ptr(t.data_ptr())


class QKVFront:
    """``DraftAttention.front`` of ``constants`` bound to its weights, as one
    kernel launch (module docstring): ``run(x, positions, slots, cache)``
    returns ``out`` BF16 ``[m, rows]`` (q and k rows normed and rotated as
    vLLM's fused QK-norm / RoPE / KV insert leaves them in its ``qkv``, v and
    o-gate rows projected) and writes K and V into ``cache`` at ``slots``;
    bit for bit that stock op applied to the kernel's projection, which is
    ``x @ W^T`` up to the summation order stated in
    ``dspark_cute.cutedsl.gemm.skinny.config``.

    ``weight``: the QKV projection, BF16 ``[rows, H]``, contiguous, on CUDA,
    16-byte aligned; ``q_norm_weight``: must be None (the stock fused
    QK-norm is weightless; the argument stays for the host contract's
    signature); ``rope_table``: the
    ``Rotary.cos_sin`` table ``[max_position, 64]`` of
    ``constants.table_dtype`` on the weight's device (None without RoPE).
    ``k_warps`` and ``stages``: the main loop's shape (``SkinnyConfig``);
    ``pdl``: launch with programmatic dependent launch (default: sm_90+);
    ``copy``: who copies the weight (``SkinnyConfig.copy``: "lane" or the
    warp's 128-byte "rows"; the same bits).
    Call ``prepare()`` before CUDA graph capture. Traced by torch.compile,
    a launch is the op ``torch.ops.dspark.qkv_front``."""

    OP = "qkv_front"

    def __init__(
        self,
        constants: QKVFrontConstants,
        weight: torch.Tensor,
        q_norm_weight: torch.Tensor | None = None,
        rope_table: torch.Tensor | None = None,
        *,
        k_warps: int = 4,
        stages: int = 4,
        pdl: bool | None = None,
        copy: str = "lane",
    ) -> None:
        check_constants(constants)
        c = constants
        kv = c.kv_heads
        # SkinnyConfig raises Unsupported for a hidden size it cannot split.
        self.configs = {nt: sg.SkinnyConfig(c.hidden_size, k_warps, stages, nt, copy=copy) for nt in (1, 2)}
        self.rows = (2 * c.num_heads + 2 * kv) * HEAD_DIM
        check_operand(weight, (self.rows, c.hidden_size), torch.bfloat16, 16, "the QKV weight")
        device = weight.device
        if q_norm_weight is not None:
            raise ValueError("the QKV front's QK-norm is weightless (the stock fused QK-norm), yet a q-norm "
                             "weight was given")
        if c.rope:
            dtype = torch.bfloat16 if c.table_dtype == "bf16" else torch.float32
            ok = isinstance(rope_table, torch.Tensor) and rope_table.dim() == 2
            positions = rope_table.shape[0] if ok else 0
            if not (1 <= positions < 2**31 and is_operand(rope_table, dtype, (positions, HEAD_DIM), 4, device)):
                raise ValueError(f"the RoPE table must be a contiguous {dtype} tensor of [max_position, "
                                 f"{HEAD_DIM}] on the QKV weight's device")
        elif rope_table is not None:
            raise ValueError("constants without RoPE were given a RoPE table")
        self.constants = c
        self.weight = weight
        self.q_norm_weight = None
        self.rope_table = rope_table
        self.device = device
        self.pdl = pdl_supported(device) if pdl is None else bool(pdl)
        self.op_handle = ops.register(self)

    def _kernel(self, m: int, raw: bool = False):
        return compile_qkv_front(self.constants, self.configs[1 if m <= 8 else 2], raw, self.pdl)

    def prepare(self, project: bool = False) -> None:
        """Compile every variant ``run`` launches (m <= 8 and m <= 16), and
        with ``project`` those of ``project``. Call before CUDA graph capture."""
        for m in (1, MAX_DECODE_ROWS):
            self._kernel(m)
            if project:
                self._kernel(m, raw=True)

    def problem(self, x, positions, slots, cache, out=None) -> str | None:
        """Why the kernel does not take these operands (a sentence), or None:
        ``x`` BF16 ``[m, H]`` with 1 <= m <= 16, 16-byte aligned;
        ``positions`` and ``slots`` int64 ``[m]``; ``cache`` (a tensor or a
        ``PagedKVCache``) BF16 ``[num_blocks, kv, block_size, 128]``; ``out``
        (if given) BF16 ``[m, rows]``; all contiguous CUDA tensors on the
        weight's device."""
        c = self.constants
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and 1 <= x.shape[0] <= MAX_DECODE_ROWS
                and is_operand(x, torch.bfloat16, (x.shape[0], c.hidden_size), 16, self.device)):
            return (f"QKVFront takes x of bf16 [m, {c.hidden_size}] (1 <= m <= {MAX_DECODE_ROWS}), contiguous, "
                    f"16-byte aligned, on the weight's device, not {describe(x)}")
        m = x.shape[0]
        for name, t in (("positions", positions), ("slots", slots)):
            if not is_operand(t, torch.int64, (m,), 8, self.device):
                return f"QKVFront takes {name} of int64 [{m}] on the weight's device, not {describe(t)}"
        cache = cache_tensor(cache)
        if not (isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.numel() > 0
                and is_operand(cache, torch.bfloat16, (cache.shape[0], c.kv_heads, cache.shape[2], 2 * HEAD_DIM), 4,
                               self.device)
                and cache.shape[2] < 2**31):
            return (f"QKVFront takes a contiguous bf16 cache of [num_blocks, {c.kv_heads}, block_size, "
                    f"{2 * HEAD_DIM}] on the weight's device, not {describe(cache)}")
        if out is not None and not is_operand(out, torch.bfloat16, (m, self.rows), 4, self.device):
            return f"QKVFront writes a contiguous bf16 output of [{m}, {self.rows}], not {describe(out)}"
        return None

    def takes(self, x, positions, slots, cache, out=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(x, positions, slots, cache, out) is None

    def run(self, x, positions, slots, cache, out=None) -> torch.Tensor:
        """The front of ``x`` at ``positions``, K/V inserted into ``cache`` at
        ``slots`` (negative: skipped); returns ``out``. ValueError with
        ``problem``'s sentence unless it takes the operands."""
        reason = self.problem(x, positions, slots, cache, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(x, positions, slots, cache, out)

    def launch(self, x, positions, slots, cache, out=None) -> torch.Tensor:
        """``run`` without its operand checks (for operands ``takes``)."""
        if out is None:
            out = torch.empty((x.shape[0], self.rows), dtype=torch.bfloat16, device=x.device)
        ops.launch(self, x, positions, slots, cache_tensor(cache), out)
        return out

    def _launch_kernel(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                       out: torch.Tensor) -> None:
        m = x.shape[0]
        nb, _, bs, _ = cache.shape
        table = self.rope_table if self.rope_table is not None else self.weight
        self._kernel(m)(
            ptr(x), ptr(self.weight), ptr(table, 4), _i64_ptr(positions), _i64_ptr(slots),
            ptr(cache, 4), ptr(out, 4), Int32(m), Int64(nb * bs), Int32(bs), Int32(table.shape[0]),
            current_stream(),
        )

    def project(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Step 1 alone (the ``raw`` variant): the BF16 projection ``[m,
        rows]`` of ``x``, the exact values the front's epilogue starts from."""
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and 1 <= x.shape[0] <= MAX_DECODE_ROWS
                and is_operand(x, torch.bfloat16, (x.shape[0], self.constants.hidden_size), 16, self.device)):
            raise ValueError(f"QKVFront.project takes x of bf16 [m, {self.constants.hidden_size}] "
                             f"(1 <= m <= {MAX_DECODE_ROWS}), contiguous, 16-byte aligned, on the weight's device")
        m = x.shape[0]
        if out is None:
            out = torch.empty((m, self.rows), dtype=torch.bfloat16, device=x.device)
        elif not is_operand(out, torch.bfloat16, (m, self.rows), 4, self.device):
            raise ValueError(f"QKVFront.project writes a contiguous bf16 [{m}, {self.rows}] CUDA output")
        w = self.weight
        self._kernel(m, raw=True)(
            ptr(x), ptr(w), ptr(w, 4), _int64_ptr(x.data_ptr()), _int64_ptr(x.data_ptr()),
            ptr(w, 4), ptr(out, 4), Int32(m), Int64(0), Int32(1), Int32(1), current_stream(),
        )
        return out


__all__ = ["QKVFront", "QKVFrontKernel", "compile_qkv_front", "fake_args"]
