"""The skinny GEMM main loop: ``x[m, K] @ W[N, K]^T`` for 1 <= m <= 16 rows of
``x``, streaming the BF16 weight once with 16-byte ``cp.async`` loads into a
shared-memory ring (thread-private with lane copies, warp-private with row
copies), on BF16 tensor cores with FP32 accumulation. A kernel built on it
owns whole 64-row tiles of ``W`` (one CTA each), so its epilogue sees
finished rows (a package GEMM stores them): the epilogue is the caller's
code, run after ``store_partials`` on the values ``reduced_pair`` returns.

Layout of one CTA (``SkinnyConfig``; ``k_warps`` = W_K warps, 32 * W_K
threads). Warp ``w`` owns the K-slice ``[w * K / W_K, (w + 1) * K / W_K)`` of
all 64 rows; lane ``l`` has ``g = l >> 2`` and ``t = l & 3``. In step ``s``
(``K / (32 W_K)`` steps) the warp covers the 32 columns ``k0 + 32 s`` ..
``+ 31`` (``k0`` the slice start): the lane loads, with one 16-byte copy
each, the 8 columns ``k0 + 32 s + 8 t .. + 7`` of the weight rows ``16 i + g``
and ``16 i + g + 8`` (``i`` = 0..3, the four 16-row MMA tiles) and of the x
rows (tokens) ``g`` and (``n_tiles`` = 2) ``g + 8``, clamped to ``m - 1``.
Those words are exactly an ``mma.m16n8k16`` A and B fragment after a
permutation of K applied to both operands: the logical column pairs
``2t, 2t + 1`` and ``2t + 8, 2t + 9`` of MMA ``half`` (0, 1) are the physical
columns ``8t + 4 half + {0, 1}`` and ``8t + 4 half + {2, 3}``. So the weight
goes from global memory to the tensor cores without a shuffle or a CTA
barrier: each thread reads back only what it copied itself (``cp.async.wait_group``).
The ring holds ``stages`` steps per thread; a step's slot is refilled with the
step ``stages`` later as soon as its MMAs are issued. With ``copy`` "rows"
(``dspark_cute.cutedsl.gemm.skinny.rows``; the package GEMM's ring) the warp copies the
same words two steps at a time in whole 128-byte row pieces (full-line L2
requests instead of half lines) and each lane reads its own words back after
a ``bar.warp.sync``: the same MMAs on the same words. ``l2_prefetch``
sets the copies' L2 prefetch hint. With ``x_regs`` (the
package GEMM's one-row calls) the x words skip the ring: each is loaded with
``ld.global.v4`` (through L1) when its step's weight copies are issued, held
in registers until that step's MMAs, which read the same values either way.
Before the first x load the caller's ``before_x`` runs (the PDL wait: the weight prologue overlaps the
previous kernel).

Summation order of one output ``y[n, r] = sum_k x[n, k] W[r, k]``:

1. warp ``w`` accumulates its slice in FP32 starting from +0.0, one
   ``mma.sync.m16n8k16`` (16 products) after another: step ``s``, half 0
   then half 1 (columns ``k0 + 32 s + 8 t + 4 half + {0..3}``, t = 0..3,
   ``k0 = w K / W_K``: the warp's contiguous slice); the order of the 16
   products and the accumulator inside one MMA is the tensor core's
   (undocumented; not IEEE);
2. the W_K warp partials are folded by halves with ``add.rn.f32``:
   ``p_w + p_(w + W_K/2)``, then the same on the halves, down to one;
3. the sum is rounded to BF16 (``cvt.rn.bf16x2.f32``) by the epilogue.

Error bound against the exact (float64) ``y``, with ``T = sum_k |x_k w_k|``,
``L = K / (16 W_K)`` MMAs per warp, ``d = log2 W_K``, ``u = 2^-24``:
assume each MMA returns ``c + sum of its 16 products`` within
``beta * (|c| + sum |p|)``, ``beta = 2^-18`` (the products of BF16 are exact;
at most two internal passes, each aligning at most 17 addends to the largest
with at least 23 fraction bits and truncating, then normalizing: per pass at
most ``18 * 2^-23`` of its addends' magnitude sum; this is a model of
undocumented hardware, which the GPU tests check). By induction the chain's
error is at most ``L * beta * (1 + beta)^L * T``; the fold adds at most
``((1 + u)^d - 1) * sum |p_w|``. For ``L * beta <= 2^-10`` (``K <= 4096 *
W_K``):

    |y_fp32 - y| <= E = (L * beta + d * u) * (1 + 2^-9) * T + K * 2^-125

(the last term: products and partial sums that underflow FP32's normal range
may be flushed). The BF16 result ``out`` adds its rounding:
``|out - y| <= E + 2^-8 * |out| + 2^-134`` (half an ulp of ``out``, or of the
smallest subnormal). For K = 8192 that is ``E ~ 2^-11 * T`` (W_K = 4) or
``2^-12 * T`` (W_K = 8), well inside the usual ``K * 2^-24 * T`` of a
sequential FP32 dot product.
``projection_error_bound`` computes it. Tensor-core MMAs are the only
multiply-adds: the PTX has no ``fma``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_core.errors import Unsupported

TILE_ROWS = 64  # weight rows per CTA (four 16-row MMA tiles)
MMA_TILES = TILE_ROWS // 16
W_LOADS = 2 * MMA_TILES  # 16-byte weight copies per thread and step
STEP_K = 32  # columns per warp and step
RED_STRIDE = TILE_ROWS + 4  # floats per token row of the partials (bank spread)
MAX_TOKENS = 16
BETA = 2.0**-18  # the assumed per-MMA relative error (module docstring)
L2_PREFETCH = (0, 64, 128, 256)
COPIES = ("lane", "rows")


@dataclass(frozen=True)
class SkinnyConfig:
    """The compile-time shape of the main loop: ``k`` columns, ``k_warps``
    warps splitting them, ``stages`` steps in flight per thread, ``n_tiles``
    8-token MMA tiles (1: m <= 8, 2: m <= 16)."""

    k: int
    k_warps: int = 4
    stages: int = 4
    n_tiles: int = 2
    # x through registers (the package GEMM's ring main loop): each step's x
    # words are loaded with ``ld.global.v4`` (through L1) ``stages`` steps
    # ahead instead of copied into the ring, which then holds the weight only
    # (so more stages fit). The same MMAs on the same values: the same bits.
    x_regs: bool = False
    # The cp.async copies' L2 prefetch size in bytes (0: no hint); bits unchanged.
    l2_prefetch: int = 256
    # Who copies a weight word: "lane", the lane that reads it (one step at a
    # time; 8 rows x 64 bytes per warp instruction); "rows", the warp, two
    # steps at a time in 128-byte row pieces (4 rows x 128 bytes per
    # instruction: whole-line L2 requests) into a swizzled ring read back
    # after the wait and a __syncwarp. The same words reach the same MMAs.
    copy: str = "lane"
    # Row copies only: who copies x's words where they go through the ring:
    # "lane", the lane that reads them (8 tokens x 64 bytes per instruction);
    # "rows", the warp, a pair of steps at a time in 128-byte token rows (4
    # tokens x 128 bytes per instruction: half the L2 requests), into a
    # swizzled region read back like the weight's. The same words.
    x_copy: str = "lane"

    def __post_init__(self) -> None:
        if self.k_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"the skinny GEMM splits K over 1, 2, 4, 8 or 16 warps, not {self.k_warps}")
        if self.k <= 0 or self.k % (STEP_K * self.k_warps):
            raise Unsupported(
                f"the skinny GEMM takes K a positive multiple of {STEP_K * self.k_warps} "
                f"(32 columns per step and warp), not {self.k}"
            )
        if self.n_tiles not in (1, 2):
            raise ValueError(f"the skinny GEMM covers 8 or 16 tokens (n_tiles 1 or 2), not {self.n_tiles}")
        if not 1 <= self.stages <= self.steps:
            raise ValueError(f"{self.stages} stages for {self.steps} steps")
        if not isinstance(self.x_regs, bool):
            raise ValueError(f"x_regs is True or False, not {self.x_regs!r}")
        if self.l2_prefetch not in L2_PREFETCH:
            raise ValueError(f"l2_prefetch is one of {L2_PREFETCH} bytes, not {self.l2_prefetch!r}")
        if self.copy not in COPIES:
            raise ValueError(f"copy is one of {', '.join(COPIES)}, not {self.copy!r}")
        if self.copy == "rows" and (self.stages % 2 or self.steps % 2):
            raise ValueError(f"row copies take two contiguous steps at a time: an even number of stages and "
                             f"steps, not {self.stages} stages, {self.steps} steps")
        if self.x_copy not in COPIES or (self.x_copy == "rows" and (self.copy != "rows" or self.x_regs)):
            raise ValueError(f"x_copy is 'lane', or 'rows' with row copies of the weight and x through the "
                             f"ring, not {self.x_copy!r} with {self.copy} copies and x_regs {self.x_regs}")
        if self.mmas_per_warp * BETA > 2.0**-10:
            raise Unsupported(f"K = {self.k} over {self.k_warps} warps is beyond the stated error bound")

    @property
    def threads(self) -> int:
        return 32 * self.k_warps

    @property
    def steps(self) -> int:
        return self.k // (STEP_K * self.k_warps)

    @property
    def loads(self) -> int:
        """16-byte copies per thread and step (weight, then x)."""
        return W_LOADS + self.n_tiles

    @property
    def mmas_per_warp(self) -> int:
        """MMAs in one output's accumulation chain: L = K / (16 W_K)."""
        return self.k // (16 * self.k_warps)

    @property
    def ring_loads(self) -> int:
        """16-byte copies per thread and step into the ring: the weight's,
        and x's unless ``x_regs``."""
        return W_LOADS if self.x_regs else self.loads

    @property
    def ring_bytes(self) -> int:
        return self.stages * self.ring_loads * self.threads * 16

    @property
    def weight_ring_bytes(self) -> int:
        """The ring's weight copies (``W_LOADS`` a thread and step); under
        row copies x's slots follow them."""
        return self.stages * W_LOADS * self.threads * 16

    @property
    def red_bytes(self) -> int:
        return self.k_warps * MAX_TOKENS * RED_STRIDE * 4

    @property
    def smem_bytes(self) -> int:
        """Shared memory: the ring, later reused for the warp partials."""
        return max(self.ring_bytes, self.red_bytes)


# ---------------------------------------------------------------- index maps
# Plain integer arithmetic, traced in the kernel and evaluated on Python ints
# by the CPU tests (which emulate the whole tile from them).


def lane_coords(lane):
    """``(g, t)`` of an MMA lane: ``(lane >> 2, lane & 3)``."""
    return lane >> 2, lane & 3


def step_column(cfg: SkinnyConfig, warp, step: int):
    """The first of the 32 columns warp ``warp`` covers in ``step``: ``w K /
    W_K + 32 s``."""
    return warp * (cfg.k // cfg.k_warps) + STEP_K * step


def weight_offset(cfg: SkinnyConfig, warp, lane, step: int, load: int):
    """Element offset in the tile (rows of ``cfg.k``) of weight copy ``load``
    (``2 i + h``: row ``16 i + g + 8 h``) of ``step`` for this thread:
    ``step_column + 8 t`` in its row."""
    g, t = lane_coords(lane)
    i, h = divmod(load, 2)
    # (Summed in this order the slices' PTX is the one the GPU suites validated.)
    k0 = warp * (cfg.k // cfg.k_warps) + 8 * t
    return (16 * i + 8 * h + g) * cfg.k + k0 + STEP_K * step


def x_token(lane, n_tile: int, m, minimum=min):
    """The x row (token) this lane copies for ``n_tile``: ``g + 8 n_tile``,
    clamped to ``m - 1`` (a clamped copy only feeds MMA columns no one reads)."""
    g, _ = lane_coords(lane)
    return minimum(g + 8 * n_tile, m - 1)


def x_offset(cfg: SkinnyConfig, warp, lane, step: int, token):
    """Element offset in x (rows of ``cfg.k``) of this thread's copy of ``token``."""
    _, t = lane_coords(lane)
    return token * cfg.k + warp * (cfg.k // cfg.k_warps) + 8 * t + STEP_K * step


def ring_offset(cfg: SkinnyConfig, tid, stage: int, load: int):
    """Byte offset in the ring of a thread's 16-byte slot (a warp's 32 slots
    are contiguous: conflict-free). Under row copies only x's slots (loads
    ``W_LOADS`` ..) are the thread's, after the weight's rows (``x_copy``
    "rows": the region of ``rows.x_rows_offset`` instead)."""
    if cfg.copy == "rows":
        return cfg.weight_ring_bytes + ((stage * cfg.n_tiles + load - W_LOADS) * cfg.threads + tid) * 16
    return ((stage * cfg.ring_loads + load) * cfg.threads + tid) * 16


def a_fragment(words: list, i: int, half: int) -> list:
    """The 4 A registers of MMA tile ``i``, ``half`` from a step's copied
    words (``words[load][0..3]``): rows ``g`` / ``g + 8``, logical column
    pairs ``2t`` (words ``2 half``) and ``2t + 8`` (words ``2 half + 1``)."""
    r0, r1 = words[2 * i], words[2 * i + 1]
    return [r0[2 * half], r1[2 * half], r0[2 * half + 1], r1[2 * half + 1]]


def b_fragment(words: list, n_tile: int, half: int, loads: int = W_LOADS) -> list:
    """The 2 B registers of ``n_tile``, ``half``: the x words matching
    ``a_fragment``'s columns (after the step's ``loads`` weight words)."""
    xw = words[loads + n_tile]
    return [xw[2 * half], xw[2 * half + 1]]


def acc_coords(lane, i: int, n_tile: int, reg: int):
    """``(row, token)`` of accumulator register ``reg`` (c0..c3) of MMA tile
    ``i`` and ``n_tile``: rows ``16 i + g (+ 8)``, tokens ``8 n_tile + 2t (+ 1)``."""
    g, t = lane_coords(lane)
    return 16 * i + g + 8 * (reg >> 1), 8 * n_tile + 2 * t + (reg & 1)


def red_offset(warp, token, row):
    """Float index of a warp's partial of ``(token, row)`` in the partials."""
    return (warp * MAX_TOKENS + token) * RED_STRIDE + row


# ---------------------------------------------------------------- the stated bound (host)


def projection_error_bound(x: torch.Tensor, weight: torch.Tensor, k_warps: int) -> torch.Tensor:
    """``E`` of the module docstring per output ``[m, N]`` (float64, on x's
    device): ``(L * beta + d * u) * (1 + 2^-9) * T + K * 2^-125``."""
    k = weight.shape[1]
    cfg = SkinnyConfig(k=k, k_warps=k_warps, stages=1, n_tiles=1)
    t = x.double().abs() @ weight.double().abs().t()
    d = k_warps.bit_length() - 1
    coeff = (cfg.mmas_per_warp * BETA + d * 2.0**-24) * (1 + 2.0**-9)
    return coeff * t + k * 2.0**-125


def output_error_bound(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, k_warps: int) -> torch.Tensor:
    """The bound on ``|out - y|`` of the rounded BF16 ``out``:
    ``E + 2^-8 |out| + 2^-134`` (float64)."""
    return projection_error_bound(x, weight, k_warps) + out.double().abs() * 2.0**-8 + 2.0**-134


__all__ = [
    "BETA",
    "COPIES",
    "L2_PREFETCH",
    "MAX_TOKENS",
    "MMA_TILES",
    "RED_STRIDE",
    "STEP_K",
    "SkinnyConfig",
    "TILE_ROWS",
    "W_LOADS",
    "a_fragment",
    "acc_coords",
    "b_fragment",
    "lane_coords",
    "output_error_bound",
    "projection_error_bound",
    "red_offset",
    "ring_offset",
    "step_column",
    "weight_offset",
    "x_offset",
    "x_token",
]
