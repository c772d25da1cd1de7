"""The context K/V store kernel: ``dspark_core.reference.model.DraftModel.context_kv_store``
after the stock K/V projection, bit for bit (the stock ATen K-norm, vLLM's
rotary kernel with the table cast to BF16, the cache insert).

Input: the projection's BF16 output ``kv`` ``[L, T, 2 * kv_heads * 64]``
(viewed ``[L, T, 2, kv_heads, 64]``: K heads, then V heads). Per (row ``t``,
layer ``l``) whose slot ``s = slots_l[t]`` is non-negative, for every KV head:

1. the K-norm (``dspark_core.spec.layers.k_norm_context``), ``k`` the head
   widened to FP32: ``q_i = k_i * k_i``; ``s_l = q_l + q_(l+32)`` (l < 32),
   the 32 sums folded by halves; ``mean = total * 2^-6``; ``v = mean +
   eps``; ``r = rsqrt.approx.f32(v)`` (CUDA's ``rsqrtf``, ``torch.rsqrt``);
   ``n = k * r`` rounded to BF16 (every FP32 step rounded once);
2. with RoPE (``dspark_core.spec.layers.Rotary.rotate`` with
   ``context_table``), ``c, s`` the table's cos and sin of pair ``j`` at the
   row's position rounded to BF16 (an FP32 table is rounded here, a BF16 one
   read as is) and widened: ``x' = fma(c, x, -(s * y))``, ``y' = fma(s, x,
   c * y)`` (each product rounded) on the BF16 ``n``, rounded to BF16;
3. the insert: K and V (V's bits as projected) written at
   ``cache_l[s // bs, head, s % bs]``, K in the first 64 columns of the last
   dim, V in the next 64, addressed through the caches' block, token and
   head strides (``dspark_cute.runtime.kv_cache``: any physical order vLLM
   lays the caches out in, LBNHC and LBHNC alike).

Layout: one warp per (row, layer); lane ``j`` holds the GPT-J pair
``(2j, 2j + 1)`` of every head (one 32-bit word each of K and V), so every
head's K and V are read and written as 128 contiguous bytes per warp. The
K-norm's sum in that layout (``k_sum_of_squares``): ``s0 = k_2j^2``, ``s1
= k_(2j+1)^2``, each folded by a butterfly (xor 16, 8, 4, 2, 1), then ``s0
+ s1``: the ATen order bit for bit (after xor 16 lane ``j < 16`` holds
``s_2j`` and ``s_(2j+1)``; each later xor is one fold by halves of the
``s_l``; every lane ends with the total). A CTA holds ``WARPS_PER_CTA``
warps, consecutive rows of one layer; the grid is (row groups, layers of this
launch). One launch takes up to ``MAX_LAYERS_PER_LAUNCH`` layers, each its
own ``kv`` row block, cache tensor, slot mapping and row count (the stock
chain inserts the first ``len(slots_l)`` rows); more layers take more
launches.

A negative slot skips its row (nothing of it is read past the slot). So
that no launch writes outside its cache, the kernel also skips a slot of
``num_blocks * bs`` or more and, with RoPE, a position outside the table;
the stock chain raises ValueError there instead (its checks read the slots
and positions on the host, which a graph-capturable launch cannot). With
``pdl`` the kernel waits for the previous grid before any load: every
operand but the table may come from it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from dspark_core.contracts.constants import HEAD_DIM, ContextStoreConstants, within_limits
from dspark_cute import ptx
from dspark_cute.cutedsl.heads import strided_row_address
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import LazyPdl, cache_tensor, current_stream, fake_stream, jit_cache
from dspark_cute.runtime.kv_cache import MAX_SLOTS, byte_strides, cache_problem

# Layers one launch takes (a fixed parameter list: a pointer tuple per operand).
MAX_LAYERS_PER_LAUNCH = 8
# Warps (rows of one layer) per CTA.
WARPS_PER_CTA = 4
# Bytes of one head's K (or V) in the projection output and in the cache.
HEAD_BYTES = 2 * HEAD_DIM


def check_constants(c: ContextStoreConstants) -> None:
    """Unsupported unless the kernel takes ``c`` (a ContextStoreConstants):
    its limits (``dspark_core.contracts.limits``: a power-of-two number of KV
    heads up to 32 and a BF16 or FP32 table)."""
    if not isinstance(c, ContextStoreConstants):
        raise ValueError(f"ContextKvStore takes ContextStoreConstants, not {type(c).__name__}")
    within_limits(c)


# ---------------------------------------------------------------- traced math


def k_sum_of_squares(a, b) -> Float32:
    """The K-norm's sum of squares of the head whose pair ``(a, b)`` (FP32,
    columns ``2j``, ``2j + 1``) lane ``j`` holds, in every lane:
    ``s0 = a * a``, ``s1 = b * b``; ``s += shfl.bfly(s, o)`` for ``o`` = 16,
    8, 4, 2, 1 on each; ``s0 + s1`` (module docstring: the ATen order)."""
    s0, s1 = ptx.mul_rn(a, a), ptx.mul_rn(b, b)
    for offset in (16, 8, 4, 2, 1):
        s0 = ptx.add_rn(s0, cute.arch.shuffle_sync_bfly(s0, offset=offset))
        s1 = ptx.add_rn(s1, cute.arch.shuffle_sync_bfly(s1, offset=offset))
    return ptx.add_rn(s0, s1)


def k_norm_pair(word, eps: float) -> tuple:
    """The K-norm (``spec.layers.k_norm_context``) of the head whose pair this
    lane holds as a packed BF16 ``word``: ``mean = k_sum_of_squares * 2^-6``,
    ``r = rsqrt.approx.f32(mean + eps)``, ``(a * r, b * r)`` rounded to BF16.
    Returns ``(word, a', b')``: the packed pair and its values widened back."""
    a, b = ptx.bf16x2_to_f32(word)
    mean = ptx.mul_rn(k_sum_of_squares(a, b), ptx.f32_const(1.0 / HEAD_DIM))
    r = ptx.rsqrt_approx(ptx.add_rn(mean, ptx.f32_const(eps)))
    out = ptx.pack_bf16x2_rn(ptx.mul_rn(a, r), ptx.mul_rn(b, r))
    return (out, *ptx.bf16x2_to_f32(out))


def rope_pair(x, y, c, s) -> tuple:
    """vLLM's rotary kernel on one GPT-J pair (FP32): ``(fma(c, x, -(s *
    y)), fma(s, x, c * y))``, each product rounded, then one ``fma.rn``."""
    return (
        ptx.fma_rn(c, x, ptx.neg_f32(ptx.mul_rn(s, y))),
        ptx.fma_rn(s, x, ptx.mul_rn(c, y)),
    )


def context_cos_sin(table_dtype: str, table, position, lane) -> tuple:
    """``(cos, sin)`` of pair ``lane`` at ``position`` (Int64, inside the
    table) of the ``[P, 64]`` table at byte address ``table`` (columns
    ``lane`` and ``32 + lane``) as the context chain rotates with them:
    rounded to BF16 (``Rotary.context_table``; a BF16 table's values are
    read as is), widened to FP32."""
    if table_dtype == "fp32":
        at = Int64(table) + Int64(position) * (4 * HEAD_DIM) + Int64(lane) * 4
        c, s = ptx.as_f32(ptx.ld_global_b32(at)), ptx.as_f32(ptx.ld_global_b32(at + 2 * HEAD_DIM))
        return ptx.round_bf16x2(c, s)
    at = Int64(table) + Int64(position) * (2 * HEAD_DIM) + Int64(lane) * 2
    # A BF16 is the high half of the FP32 of the same value.
    return (ptx.as_f32(ptx.ld_global_u16(at) << Uint32(16)),
            ptx.as_f32(ptx.ld_global_u16(at + HEAD_DIM) << Uint32(16)))


def _select(values: tuple, index):
    """``values[index]`` for a warp-uniform runtime ``index`` (a select chain)."""
    out = values[0]
    for i in range(1, len(values)):
        out = cutlass.select_(index == Int32(i), values[i], out)
    return out


def _store_head(cache_row, head_stride, h: int, lane, k_word, v_word) -> None:
    at = Int64(cache_row) + Int64(h) * head_stride + Int64(lane) * 4
    ptx.st_global_b32(at, k_word)
    # V follows K in the cache's last dim.
    ptx.st_global_b32(at + HEAD_BYTES, v_word)


# ---------------------------------------------------------------- the kernel


class ContextStoreKernel:
    """The traced context K/V store of one ``ContextStoreConstants``;
    ``pdl``: launched with programmatic dependent launch.

    Call: ``(positions, table, kv, caches, slots, rows, num_slots,
    block_size, max_position, groups, layers, stream)``: byte addresses
    (Int64) of the int64 ``[T]`` positions and the ``[P, 64]`` table (any
    value without RoPE: not read); tuples of ``MAX_LAYERS_PER_LAUNCH`` per
    launched layer: the address of its ``kv[l]`` (``[T, 2 * kv_heads * 64]``
    BF16), of its cache ``[num_blocks, kv_heads, bs, 128]`` BF16, of its
    int64 slot mapping, and its row count (Int32; unused entries any value);
    the caches' slot count ``num_blocks * bs`` (Int64, below 2^31) and block
    size ``bs`` (Int32), the table's ``P`` (Int64); ``groups`` (Int32) CTAs
    of ``WARPS_PER_CTA`` rows per layer, ``layers`` (Int32) the layers of
    this launch and the caches' block, token and head strides in bytes
    (Int64, even; every cache of the launch has these)."""

    def __init__(self, constants: ContextStoreConstants, pdl: bool) -> None:
        self.constants = constants
        self.pdl = pdl

    @cute.jit
    def __call__(
        self, positions: Int64, table: Int64, kv: tuple, caches: tuple, slots: tuple, rows: tuple,
        num_slots: Int64, block_size: Int32, max_position: Int64, groups: Int32, layers: Int32,
        block_stride: Int64, token_stride: Int64, head_stride: Int64, stream,
    ):
        self.kernel(positions, table, kv, caches, slots, rows, num_slots, block_size, max_position, block_stride,
                    token_stride, head_stride).launch(
            grid=[groups, layers, 1], block=[ptx.WARP * WARPS_PER_CTA, 1, 1], stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self, positions: Int64, table: Int64, kv: tuple, caches: tuple, slots: tuple, rows: tuple,
        num_slots: Int64, block_size: Int32, max_position: Int64, block_stride: Int64, token_stride: Int64,
        head_stride: Int64,
    ):
        c = self.constants
        heads = c.kv_heads
        group, entry, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.pdl):
            ptx.pdl_wait()
            ptx.pdl_launch_dependents()
        kv_l = _select(kv, entry)
        cache_l = _select(caches, entry)
        slots_l = _select(slots, entry)
        rows_l = _select(rows, entry)
        row = Int32(group) * WARPS_PER_CTA + warp
        if row < rows_l:
            slot = ptx.ld_global_s64(Int64(slots_l) + Int64(row) * 8)
            # Every operand of the row is loaded before the arithmetic.
            k_row = Int64(kv_l) + Int64(row) * (2 * heads * HEAD_BYTES) + Int64(lane) * 4
            k_words = [ptx.ld_global_b32(k_row + h * HEAD_BYTES) for h in range(heads)]
            v_words = [ptx.ld_global_b32(k_row + (heads + h) * HEAD_BYTES) for h in range(heads)]
            position = Int64(0)
            if cutlass.const_expr(c.rope):
                position = ptx.ld_global_s64(Int64(positions) + Int64(row) * 8)
            # One unsigned compare: a negative slot is a huge unsigned one.
            if cutlass.Uint64(slot) < cutlass.Uint64(num_slots):
                # Slots fit 32 bits (checked on the host): unsigned 32-bit division.
                s32 = Uint32(slot)
                block = s32 // Uint32(block_size)
                page = s32 - block * Uint32(block_size)
                cache_row = strided_row_address(cache_l, block, page, 0, block_stride, token_stride, head_stride)
                if cutlass.const_expr(c.rope):
                    if cutlass.Uint64(position) < cutlass.Uint64(max_position):
                        cos, sin = context_cos_sin(c.table_dtype, table, position, lane)
                        for h in cutlass.range_constexpr(heads):
                            _, n0, n1 = k_norm_pair(k_words[h], c.k_eps)
                            r0, r1 = rope_pair(n0, n1, cos, sin)
                            _store_head(cache_row, head_stride, h, lane, ptx.pack_bf16x2_rn(r0, r1), v_words[h])
                else:
                    for h in cutlass.range_constexpr(heads):
                        word, _, _ = k_norm_pair(k_words[h], c.k_eps)
                        _store_head(cache_row, head_stride, h, lane, word, v_words[h])


def fake_args(constants: ContextStoreConstants) -> tuple:
    """The compile signature of ``ContextStoreKernel`` (no GPU memory needed)."""
    n = MAX_LAYERS_PER_LAUNCH
    zeros = tuple(Int64(0) for _ in range(n))
    return (
        Int64(0), Int64(0), zeros, zeros, zeros, tuple(Int32(0) for _ in range(n)),
        Int64(1), Int32(1), Int64(1), Int32(1), Int32(1), Int64(0), Int64(0), Int64(0), fake_stream(),
    )


@jit_cache("ContextKvStore")
def compile_context_store(constants: ContextStoreConstants, pdl: bool):
    """The compiled ``ContextStoreKernel`` of ``constants`` and ``pdl``."""
    return ContextStoreKernel(constants, pdl), fake_args(constants)


# ---------------------------------------------------------------- host API

ops.define("context_store", "(str handle, Tensor kv, Tensor? positions, Tensor(a!)[] caches, Tensor?[] slots) -> ()")


def _is_cuda_tensor(t, dtype, device) -> bool:
    return (
        isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == dtype and t.is_contiguous()
        and (device is None or t.device == device)
    )


class ContextKvStore(LazyPdl):
    """``DraftModel.context_kv_store`` of ``constants`` bound to its RoPE
    table: ``run(kv, positions, caches, slots)`` writes the same cache bits
    as the stock ``context_kv_store(kv, positions, caches, slots)`` for
    operands ``takes`` accepts (module docstring: what is computed, and the
    out-of-range slots and positions the kernel skips where the stock chain
    raises).

    ``cos_sin``: the ``Rotary`` table ``[max_position, 64]`` (cos then sin)
    of ``constants.table_dtype``, a contiguous CUDA tensor, with
    ``constants.rope``; None without. ``pdl``: launch with programmatic
    dependent launch (default: where the device supports it, sm_90+). Call
    ``prepare()`` before CUDA graph capture; ``run`` and ``launch`` are
    graph-capturable once prepared (the operands' addresses are captured).
    Traced by torch.compile, a launch is the op
    ``torch.ops.dspark.context_store``."""

    OP = "context_store"

    def __init__(self, constants: ContextStoreConstants, cos_sin: torch.Tensor | None = None,
                 pdl: bool | None = None) -> None:
        check_constants(constants)
        if constants.rope:
            dtype = torch.bfloat16 if constants.table_dtype == "bf16" else torch.float32
            if not (_is_cuda_tensor(cos_sin, dtype, None) and cos_sin.dim() == 2
                    and cos_sin.shape[1] == HEAD_DIM and cos_sin.shape[0] >= 1):
                raise ValueError(
                    f"the RoPE table must be a contiguous CUDA {dtype} tensor of [max_position, {HEAD_DIM}]"
                )
        elif cos_sin is not None:
            raise ValueError("the constants have no RoPE, yet a table was given")
        self.constants = constants
        self.cos_sin = cos_sin
        self.device = cos_sin.device if cos_sin is not None else None
        self._pdl = pdl
        self.op_handle = ops.register(self)

    def prepare(self) -> None:
        """Compile the kernel this object launches (one per constants and PDL
        setting). Call before CUDA graph capture."""
        compile_context_store(self.constants, self.pdl)

    def per_layer_slots(self, slots, layers: int) -> list:
        """``slots`` as one entry per layer: a tensor shared by every layer, or
        a sequence of ``layers`` tensors or None (ValueError otherwise)."""
        if isinstance(slots, torch.Tensor):
            return [slots] * layers
        if not isinstance(slots, (list, tuple)) or len(slots) != layers:
            raise ValueError(f"the context store takes one slot mapping per layer ({layers}), or one tensor")
        return list(slots)

    def problem(self, kv, positions, caches, slots) -> str | None:
        """Why the kernel does not cover these operands (a sentence), or None.

        It covers: ``kv`` a contiguous CUDA BF16 ``[L, T, 2 * kv_heads *
        64]`` (or ``[L, T, 2, kv_heads, 64]``) tensor, 4-byte aligned;
        ``caches`` ``L`` caches (tensors or ``PagedKVCache``), each a CUDA
        BF16 view ``[num_blocks, kv_heads, bs, 128]`` in any physical order
        whose rows are contiguous and 4-byte aligned
        (``runtime.kv_cache.cache_problem``), all of one shape and strides,
        with fewer than 2^31 slots; ``slots`` one
        int64 tensor for every layer or one per layer (None: the layer stores
        nothing), each contiguous, 1-D, of at most T rows; with RoPE
        ``positions`` a contiguous int64 ``[T]`` tensor; all on one device
        (the table's, with RoPE)."""
        c = self.constants
        device = self.device
        width = 2 * c.kv_heads * HEAD_DIM
        if not (_is_cuda_tensor(kv, torch.bfloat16, device) and kv.data_ptr() % 4 == 0):
            return "the projected K/V must be a contiguous, 4-byte aligned CUDA bfloat16 tensor on the table's device"
        shapes = ((kv.shape[0], kv.shape[1], width), (kv.shape[0], kv.shape[1], 2, c.kv_heads, HEAD_DIM))
        if kv.dim() < 3 or tuple(kv.shape) not in shapes:
            return f"the projected K/V must be [L, T, {width}] or [L, T, 2, {c.kv_heads}, {HEAD_DIM}]"
        return self.problem_past_kv(kv.shape[0], kv.shape[1], kv.device, positions, caches, slots)

    def problem_past_kv(self, layers: int, t: int, device, positions, caches, slots) -> str | None:
        """``problem`` of the operands other than the projected K/V, for ``layers``
        layers of ``t`` rows on ``device``."""
        c = self.constants
        if c.rope and not (_is_cuda_tensor(positions, torch.int64, device) and tuple(positions.shape) == (t,)):
            return f"the positions must be a contiguous CUDA int64 tensor of [{t}] on the K/V's device"
        if not isinstance(caches, (list, tuple)) or len(caches) != layers:
            return f"the context store takes one cache per layer ({layers})"
        tensors = [cache_tensor(x) for x in caches]
        first = tensors[0] if tensors else None
        for cache in tensors:
            if not (isinstance(cache, torch.Tensor) and cache.is_cuda and cache.device == device):
                return "every cache must be a CUDA tensor on the K/V's device"
            reason = cache_problem(cache, c.kv_heads, 4)
            if reason is not None:
                return reason
            if cache.shape != first.shape or cache.stride() != first.stride():
                return "every cache must have one shape and one set of strides (the kernel takes them once)"
        if first is not None and first.shape[0] * first.shape[2] >= MAX_SLOTS:
            return "a cache of 2^31 slots or more"
        try:
            per_layer = self.per_layer_slots(slots, layers)
        except ValueError as error:
            return str(error)
        for s in per_layer:
            if s is not None and not (_is_cuda_tensor(s, torch.int64, device) and s.dim() == 1 and s.shape[0] <= t):
                return f"each slot mapping must be a contiguous 1-D CUDA int64 tensor of at most {t} rows"
        return None

    def takes(self, kv, positions, caches, slots) -> bool:
        """Whether the kernel covers these operands (``problem`` gives why not)."""
        return self.problem(kv, positions, caches, slots) is None

    def run(self, kv, positions, caches, slots) -> None:
        """Store the context K/V (module docstring) into ``caches``;
        ValueError with ``problem``'s sentence unless ``takes``."""
        reason = self.problem(kv, positions, caches, slots)
        if reason is not None:
            raise ValueError(reason)
        self.launch(kv, positions, caches, slots)

    def launch(self, kv, positions, caches, slots) -> None:
        """``run`` without its operand checks (for operands ``takes``
        accepts): one launch per ``MAX_LAYERS_PER_LAUNCH`` storing layers."""
        per_layer = self.per_layer_slots(slots, kv.shape[0])
        ops.launch(self, kv, positions if self.constants.rope else None, [cache_tensor(x) for x in caches],
                   per_layer)

    def _launch_kernel(self, kv: torch.Tensor, positions: torch.Tensor | None, tensors: list, slots: list) -> None:
        c = self.constants
        t = kv.shape[1]
        entries = [(i, tensors[i], s) for i, s in enumerate(slots) if s is not None and s.shape[0] > 0]
        if not entries:
            return
        kernel = compile_context_store(c, self.pdl)
        num_blocks, _, block_size, _ = tensors[0].shape
        strides = tuple(Int64(b) for b in byte_strides(tensors[0]))
        layer_bytes = t * 2 * c.kv_heads * HEAD_BYTES
        table = Int64(self.cos_sin.data_ptr() if c.rope else 0)
        max_position = Int64(self.cos_sin.shape[0] if c.rope else 1)
        pos = Int64(positions.data_ptr() if c.rope else 0)
        stream = current_stream()
        n = MAX_LAYERS_PER_LAUNCH
        for start in range(0, len(entries), n):
            chunk = entries[start : start + n]
            pad = n - len(chunk)
            # Every element a DSL scalar: the executor flattens the tuples.
            kv_ptrs = tuple(Int64(kv.data_ptr() + i * layer_bytes) for i, _, _ in chunk) + (Int64(0),) * pad
            cache_ptrs = tuple(Int64(x.data_ptr()) for _, x, _ in chunk) + (Int64(0),) * pad
            slot_ptrs = tuple(Int64(s.data_ptr()) for _, _, s in chunk) + (Int64(0),) * pad
            rows = tuple(Int32(s.shape[0]) for _, _, s in chunk) + (Int32(0),) * pad
            most = max(s.shape[0] for _, _, s in chunk)
            kernel(
                pos, table, kv_ptrs, cache_ptrs, slot_ptrs, rows, Int64(num_blocks * block_size),
                Int32(block_size), max_position, Int32(-(-most // WARPS_PER_CTA)), Int32(len(chunk)), *strides,
                stream,
            )


__all__ = [
    "HEAD_BYTES",
    "MAX_LAYERS_PER_LAUNCH",
    "WARPS_PER_CTA",
    "ContextKvStore",
    "ContextStoreKernel",
    "check_constants",
    "compile_context_store",
    "context_cos_sin",
    "fake_args",
    "k_norm_pair",
    "k_sum_of_squares",
    "rope_pair",
]
