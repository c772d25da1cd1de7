"""The register-direct skinny main loop: the sums of ``ring.mainloop``
(bit for bit, for the same ``k`` and ``k_warps``) over one 16-row MMA tile
per CTA, its operands loaded straight into registers.

A CTA owns 16 rows (``N / 16`` CTAs: four times the ring's grid), each lane
keeps ``stages`` steps of its loads in flight in registers (no shared-memory
ring, no ``cp.async``), and only the warp partials meet in shared memory.
The package GEMM takes it with ``tile_n = 16`` (``PackageGemmConstants``)
for the shards whose warps have all their steps in flight at once
(``dspark_core.planner.policy.draft_gemm_shape``).

Layout (``SkinnyConfig``: ``k``, ``k_warps``, ``stages`` = the register
depth, ``n_tiles``): warp ``w`` owns the K-slice ``[w K / W_K, (w + 1) K /
W_K)`` of the tile's 16 rows; in step ``s`` lane ``(g, t)`` loads the 16
bytes at columns ``k0 + 32 s + 8 t`` .. ``+ 7`` of rows ``g`` (load 0) and
``g + 8`` (load 1), and of x rows ``g`` and ``g + 8`` (clamped to ``m - 1``)
-- ``config``'s map for its MMA tile ``i = 0``, so each MMA gets the
operands the ring loop gives the same rows, in the same order (step, then
half 0 and 1). The accumulation chain of every output is therefore the
same instruction sequence on the same values: the same bits, and the same
summation order and error bound (``config``'s docstring).

After the main loop the warp partials go to shared memory
(``red_offset``); thread ``q`` of round ``r`` then takes output word ``q +
threads r``: token ``word // 8``, rows ``2 (word % 8)`` and ``+ 1``, the
W_K partials folded by halves (``add.rn``), as ``tile.reduced_pair``.
"""

from __future__ import annotations

from cutlass import Int32, Int64

from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.cutedsl.gemm.skinny.tile import min_i32

TILE_ROWS = 16  # one m16n8k16 A tile
W_LOADS = 2  # weight copies per lane and step: rows g and g + 8
RED_STRIDE = TILE_ROWS + 2  # floats per token row of the partials (even: 8-byte pair loads)
WORDS = TILE_ROWS // 2  # BF16x2 output words per token


def weight_offset(cfg: sg.SkinnyConfig, warp, lane, step: int, load: int):
    """Element offset in the 16-row tile (rows of ``cfg.k``) of weight copy
    ``load`` (row ``g + 8 load``) of ``step`` for this lane:
    ``config.weight_offset`` of MMA tile 0."""
    return sg.weight_offset(cfg, warp, lane, step, load)


def red_offset(warp, token, row):
    """Float index of a warp's partial of ``(token, row)`` in the partials."""
    return (warp * sg.MAX_TOKENS + token) * RED_STRIDE + row


def red_bytes(cfg: sg.SkinnyConfig) -> int:
    return cfg.k_warps * sg.MAX_TOKENS * RED_STRIDE * 4


def epilogue_rounds(cfg: sg.SkinnyConfig) -> int:
    """Rounds of the epilogue: ``8 n_tiles`` tokens of ``WORDS`` words over the CTA's threads."""
    return -(-8 * cfg.n_tiles * WORDS // cfg.threads)


def epilogue_word(cfg: sg.SkinnyConfig, tid, rnd: int) -> tuple:
    """``(token, first row)`` of the output word thread ``tid`` takes in round ``rnd``."""
    word = tid + cfg.threads * rnd
    return word // WORDS, 2 * (word % WORDS)


def mainloop(cfg: sg.SkinnyConfig, w_tile, x, m, warp, lane, before_x=None) -> list:
    """Trace the main loop of one 16-row tile: ``w_tile`` the byte address
    (Int64) of its first weight row, ``x`` of x's first row, ``m`` the token
    count (Int32). The weight loads of the first ``cfg.stages`` steps are
    issued first, then ``before_x()`` (the PDL wait), then x's. Each later
    step is loaded ``stages`` steps ahead, right before each step's MMAs. Returns
    ``acc[n_tile]`` (4 FP32 each, ``config.acc_coords`` of tile 0)."""
    tokens = [sg.x_token(lane, nt, m, minimum=min_i32) for nt in range(cfg.n_tiles)]
    w_words: dict = {}
    x_words: dict = {}

    def load_weight(step: int, first: bool = False) -> None:
        ld = ptx.ld_global_na_v4 if first else ptx.ld_global_nc_v4  # (first: before the PDL wait, kept there)
        w_words[step] = [ld(Int64(w_tile) + Int64(weight_offset(cfg, warp, lane, step, load)) * 2)
                         for load in range(W_LOADS)]

    def load_x(step: int) -> None:
        x_words[step] = [ptx.ld_global_v4(Int64(x) + Int64(sg.x_offset(cfg, warp, lane, step, tok)) * 2)
                         for tok in tokens]

    ahead = min(cfg.stages, cfg.steps)
    ptx.weight_first(ahead, load_weight, load_x, before_x)
    zero = ptx.f32_const(0.0)
    acc = [[zero] * 4 for _ in range(cfg.n_tiles)]
    for s in range(cfg.steps):
        if s + cfg.stages < cfg.steps:
            load_weight(s + cfg.stages)
            load_x(s + cfg.stages)
        words = w_words.pop(s) + x_words.pop(s)
        for half in range(2):
            for nt in range(cfg.n_tiles):
                # The fragments of the ring loop's MMA tile 0, x after this step's 2 weight words.
                a, b = sg.a_fragment(words, 0, half), sg.b_fragment(words, nt, half, W_LOADS)
                acc[nt] = ptx.mma_bf16(a, b, acc[nt])
    return acc


def store_partials(cfg: sg.SkinnyConfig, acc: list, red, warp, lane) -> None:
    """This warp's accumulators into the partials (shared, Int32 ``red``,
    ``red_bytes``), then a CTA barrier (the partials visible to all)."""
    import cutlass.cute as cute

    for nt in range(cfg.n_tiles):
        for reg in range(4):
            row, tok = sg.acc_coords(lane, 0, nt, reg)
            ptx.st_shared_f32(Int32(red) + Int32(red_offset(warp, tok, row)) * 4, acc[nt][reg])
    cute.arch.barrier()


def reduced_pair(cfg: sg.SkinnyConfig, red, token, row) -> tuple:
    """The FP32 sums of rows ``row`` and ``row + 1`` (even) for ``token``:
    the W_K partials folded by halves (``ptx.fold_halves``)."""
    pairs = [ptx.ld_shared_v2_f32(Int32(red) + Int32(red_offset(w, token, row)) * 4) for w in range(cfg.k_warps)]
    return ptx.fold_halves([p[0] for p in pairs]), ptx.fold_halves([p[1] for p in pairs])


__all__ = [
    "RED_STRIDE",
    "TILE_ROWS",
    "W_LOADS",
    "WORDS",
    "epilogue_rounds",
    "epilogue_word",
    "mainloop",
    "red_bytes",
    "red_offset",
    "reduced_pair",
    "store_partials",
    "weight_offset",
]
