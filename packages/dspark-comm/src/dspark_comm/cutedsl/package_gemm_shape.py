"""The package GEMM's launch shapes (``dspark_comm.cutedsl.package_gemm``): which
constants its kernel covers (``check_constants``), the main loop's default
``(k_warps, stages)`` per token tile (``default_shape``), the shared memory a
CTA takes (``smem_bytes``) and its cap (``MAX_SMEM_BYTES``); the
measurements behind each default are in the package's README. Host code only: nothing here traces a
kernel. ``package_gemm`` re-exports every name; code that overrides the cap
(``scripts/probes/package_gemm_sweep.py``) sets it here, where it is read."""

from __future__ import annotations

from dspark_core.contracts.constants import PackageGemmConstants, within_limits
from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.cutedsl.gemm.skinny import direct as sd

# Output features per CTA: 64 (the ring main loop) or 16 (the register-direct one).
TILE_ROWS = (sg.TILE_ROWS, sd.TILE_ROWS)
# Default steps in flight (stages) per n_tiles (1: m <= 8, 2: m <= 16): the
# register-direct main loop's per lane, the ring's at most (within
# MAX_SMEM_BYTES). The measurements: the package's README.
DIRECT_DEPTH = {1: 8, 2: 4}
RING_DEPTH = {1: 6, 2: 6}
# The ring main loop with x through registers (SkinnyConfig.x_regs), which
# PackageGemm runs for one-row calls: steps in flight at most.
RING_X_DEPTH = 8
# Shared memory a CTA may take (one CTA per SM: 128 tiles for H = 8192): the
# sm_90 / sm_100 opt-in maximum, 227 KB.
MAX_SMEM_BYTES = 227 * 1024
# How the ring main loop copies the weight (SkinnyConfig.copy, l2_prefetch):
# the warp's 128-byte row pieces, two steps at a time, with a 128-byte L2
# prefetch, wherever a warp's steps are even (stages then even too); else each
# lane its own 16 bytes with a 256-byte prefetch. The same MMAs on the same
# words: the same bits.
RING_COPY = "rows"
RING_L2_PREFETCH = 128
# Under row copies where x goes through the ring (m > 1), x is copied in
# 128-byte token rows (SkinnyConfig.x_copy "rows"): the same words as lane
# copies, half the L2 requests.
RING_X_COPY = "rows"
LANE_L2_PREFETCH = 256


def check_loop_options(tile_rows: int, x_regs: bool = False) -> None:
    """ValueError unless the main loop of ``tile_rows`` output features per
    CTA takes ``x_regs`` (the ring's: the register-direct loop always loads x
    into registers)."""
    if x_regs and tile_rows == sd.TILE_ROWS:
        raise ValueError(f"x_regs is the ring main loop's (tile_n {sg.TILE_ROWS}); the register-direct one "
                         f"(tile_n {tile_rows}) always loads x into registers")


def ring_config(k_shard: int, k_warps: int, stages: int, n_tiles: int, x_regs: bool = False,
                copy: str | None = None) -> sg.SkinnyConfig:
    """The ring main loop's ``SkinnyConfig``. ``copy`` None: row copies
    (``RING_COPY``) where ``k_shard / (32 k_warps)`` steps and ``stages`` are
    both even, else lane copies (the same bits either way); "rows" or "lane":
    that one. Under row copies x goes through the ring in token rows
    (``RING_X_COPY``) unless ``x_regs``. Unsupported / ValueError
    (``SkinnyConfig``) for a shape the loop cannot take."""
    if copy not in (None, *sg.COPIES):
        raise ValueError(f"copy is None, {' or '.join(map(repr, sg.COPIES))}, not {copy!r}")
    steps = sg.SkinnyConfig(k_shard, k_warps, 1, n_tiles).steps
    if copy is None:
        copy = RING_COPY if steps % 2 == 0 and stages % 2 == 0 else "lane"
    if copy == "rows":
        return sg.SkinnyConfig(k_shard, k_warps, stages, n_tiles, x_regs=x_regs, copy="rows",
                               l2_prefetch=RING_L2_PREFETCH, x_copy="lane" if x_regs else RING_X_COPY)
    return sg.SkinnyConfig(k_shard, k_warps, stages, n_tiles, x_regs=x_regs, l2_prefetch=LANE_L2_PREFETCH)


def smem_bytes(cfg: sg.SkinnyConfig, tile_rows: int) -> int:
    """Shared memory of a CTA: the ring main loop's ring (reused for the
    partials), or the register-direct one's partials alone."""
    return sd.red_bytes(cfg) if tile_rows == sd.TILE_ROWS else cfg.smem_bytes


def check_constants(constants) -> None:
    """Unsupported with a sentence unless the kernel covers ``constants``:
    its limits (``dspark_core.contracts.limits``: tile_n 64 or 16, split_k
    1, 2 or 4, 1 to 16 rows, N a positive multiple of tile_n, the K shard a
    positive multiple of 128 per K-slice and at most 16384 per K-slice,
    what ``SkinnyConfig`` takes at the default ``4 * split_k`` warps)."""
    if not isinstance(constants, PackageGemmConstants):
        raise ValueError(f"PackageGemm takes PackageGemmConstants, not {type(constants).__name__}")
    within_limits(constants)


def default_shape(constants: PackageGemmConstants, k_warps: int | None = None,
                  stages: int | None = None, n_tiles: int = 2, x_regs: bool = False,
                  copy: str | None = None) -> tuple[int, int]:
    """``(k_warps, stages)`` of the main loop for ``n_tiles`` (1: m <= 8, 2:
    m <= 16): ``k_warps`` (default ``4 * split_k``) a multiple of
    ``split_k``; ``stages`` (default: the ring main loop up to
    ``RING_DEPTH[n_tiles]``, as many as the steps and ``MAX_SMEM_BYTES`` allow
    (with ``x_regs`` the ring holds the weight only), an even number where
    the warp's steps are even, unless ``copy`` is "lane" (row copies:
    ``ring_config``); the
    register-direct one, ``tile_n`` 16, ``DIRECT_DEPTH[n_tiles]`` steps in
    flight, at most the steps; with ``x_regs``, the ring up to ``RING_X_DEPTH``)."""
    check_constants(constants)
    kw = 4 * constants.split_k if k_warps is None else k_warps
    if not isinstance(kw, int) or kw % constants.split_k:
        raise ValueError(f"k_warps {kw} does not split into the constants' {constants.split_k} K-slices")
    if n_tiles not in (1, 2):
        raise ValueError(f"the package GEMM covers 8 or 16 tokens (n_tiles 1 or 2), not {n_tiles}")
    steps = sg.SkinnyConfig(constants.k_shard, kw, 1, n_tiles).steps  # raises for a K it cannot split
    if stages is None and constants.tile_n == sd.TILE_ROWS:
        stages = min(DIRECT_DEPTH[n_tiles], steps)
    if stages is None:
        stages = 1
        for s in range(min(RING_X_DEPTH if x_regs else RING_DEPTH[n_tiles], steps), 0, -1):
            if (copy or RING_COPY) == "rows" and steps % 2 == 0 and s % 2 and s > 1:
                continue  # row copies take pairs of steps
            if ring_config(constants.k_shard, kw, s, n_tiles, x_regs, copy).smem_bytes <= MAX_SMEM_BYTES:
                stages = s
                break
    return kw, stages


__all__ = [
    "DIRECT_DEPTH",
    "LANE_L2_PREFETCH",
    "MAX_SMEM_BYTES",
    "RING_COPY",
    "RING_DEPTH",
    "RING_L2_PREFETCH",
    "RING_X_COPY",
    "RING_X_DEPTH",
    "TILE_ROWS",
    "check_constants",
    "check_loop_options",
    "default_shape",
    "ring_config",
    "smem_bytes",
]
