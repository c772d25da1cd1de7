"""The package GEMM's launch shapes (``dspark_comm.cutedsl.package_gemm``): which
constants its kernel covers (``check_constants``), the main loop's default
``(k_warps, stages)`` per token tile (``default_shape``), the shared memory a
CTA takes (``smem_bytes``) and its cap (``MAX_SMEM_BYTES``), with the
measurements behind each default. Host code only: nothing here traces a
kernel. ``package_gemm`` re-exports every name; code that overrides the cap
(``scripts/probes/package_gemm_sweep.py``) sets it here, where it is read."""

from __future__ import annotations

from dspark_core.contracts.constants import MAX_DECODE_ROWS, PackageGemmConstants
from dspark_core.errors import Unsupported
from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.cutedsl.gemm.skinny import direct as sd

# Output features per CTA: 64 (the ring main loop, skinny_gemm) or 16 (the
# register-direct one, skinny_direct).
TILE_ROWS = (sg.TILE_ROWS, sd.TILE_ROWS)
# Default steps in flight (stages) per n_tiles (1: m <= 8, 2: m <= 16):
# the register-direct main loop's per lane, the ring's at most (within
# MAX_SMEM_BYTES). Measured on H200s: the direct loop at K = 1024 (8 / 4: 3.50
# / 4.23 us at m = 1 / 16, against 5.91 / 4.68 for 4 / 8;
# scripts/probes/package_gemm_sweep.py); the ring at K = 4096 with 4 warps: 6
# stages 21.3 / 18.8 / 18.9 us at m = 1 / 4 / 16 against 22.6 / 20.0 / 20.4
# for 4 and 21.9 / 19.1 / 19.5 for 8 (bench_package_gemm's publish kernel
# agrees: 21.9 / 19.5 / 20.4 against 22.6 / 20.7 / 20.9). The TP2 draft step
# could not tell 4 from 6: its package GEMM column moved by up to 15 us
# between runs of one build. With row copies and x in token rows, 4 warps
# at K = 8192 (package_gemm_sweep.py --depth, one H200, weight from HBM,
# medians of 5 alternating rounds, m = 1 / 4 / 16): 8 stages for 8 and 16
# tokens 32.65 / 33.55 / 34.25 us against 6's 32.64 / 34.41 / 34.56; at K =
# 4096 8 and 6 tied (18.99 / 17.94 / 18.51 against 18.96 / 17.98 / 18.49).
# The policy gives such shards 8 warps (dspark_core.planner.policy.RING_SPLIT_K),
# whose depth the cap sets, and at TP2 the 4-warp 16-token kernel of 8
# stages took 53 us at K = 8192 whenever a boundary kernel ran between its
# calls, so 6 stays.
DIRECT_DEPTH = {1: 8, 2: 4}
RING_DEPTH = {1: 6, 2: 6}
# The ring main loop with x through registers (SkinnyConfig.x_regs), which
# PackageGemm runs for one-row calls: steps in flight at most (within
# MAX_SMEM_BYTES). Measured on an H200 (package_gemm_sweep.py --quick, m = 1,
# L2 / HBM-cold weight): 4 warps, 8 stages: K = 2048 6.51 / 10.97, K = 4096
# 18.96 / 18.96, K = 8192 35.26 / 34.77 us, against 6.13 / 11.35, 18.65 /
# 18.78, 37.94 / 38.36 for 4; the ring with x in it took 8.68 / 11.92, 20.78
# / 20.81, 38.53 / 38.56 (its best stages) and cuBLAS 8.37 / 10.98, 18.78 /
# 18.84, 34.24 / 34.31. At 4 and 16 rows x in the ring was as fast or faster
# (K = 8192, m = 16: 34.53 against 43.68), so more rows keep it there. 8 warps
# (down_proj) fit 6 stages: K = 8192 35.44 / 35.20 (5: 35.26 / 35.04).
RING_X_DEPTH = 8
# Shared memory a CTA may take (one CTA per SM is the design: 128 tiles for
# H = 8192): the sm_90 / sm_100 opt-in maximum, 227 KB. With row copies
# (stages in pairs) it gives K = 8192's 8 warps 6 / 6 / 4 stages at m = 1 /
# <= 8 / <= 16, the depths measured with them (RING_COPY's comment). With
# lane copies 200 KB was measured (5 stages) against 160 KB (4): m = 1 / 4 /
# 16 35.70 / 34.24 / 34.73 us against 36.01 / 34.46 / 35.68 (one H200).
MAX_SMEM_BYTES = 227 * 1024
# How the ring main loop copies the weight (SkinnyConfig.copy, l2_prefetch):
# the warp's 128-byte row pieces, two steps at a time, with a 128-byte L2
# prefetch, wherever a warp's steps are even (stages then even too); else
# each lane its own 16 bytes with a 256-byte prefetch. The same MMAs on the
# same words: the same bits (GPU-checked). Measured on an H200
# (package_gemm_sweep.py --copies, one run, side by side, weight from HBM, m
# = 1 / 4 / 16, us): K = 4096, 4 warps: row copies 18.50 / 18.10 / 18.13,
# lane copies 20.83 / 19.64 / 19.38, cuBLAS 18.78 / 18.93 / 19.23; K = 8192,
# 8 warps: 32.22 / 32.76 / 33.22 (6 / 6 / 4 stages) against 35.21 / 35.03 /
# 35.42 (7 / 6 / 5) and cuBLAS 33.98 / 33.30 / 33.32. Nsight Compute: lane
# copies make 64-byte L2 requests (2.2 sectors each), row copies and
# cuBLAS's TMA 128-byte ones; at K = 8192, m = 1 the DRAM ran at 81% of
# peak (cuBLAS 81%, lane copies 75%). Without the prefetch hint row copies
# were as fast (32.28 / 32.73 / 33.60); a 256-byte one was slower. At TP2
# (bench_package_gemm, two H200s, graphs with PDL) the publishing kernel took
# 3.60 / 3.73 / 5.31 (K = 1024, the register-direct loop), 18.69 / 18.97 /
# 19.71 (4096) and 33.05 / 34.03 / 34.97 (8192) against cuBLAS's 5.30 / 5.01
# / 5.09, 19.01 / 19.47 / 19.44 and 34.53 / 34.40 / 34.21. Refilling a pair's
# slot before its MMAs (SkinnyConfig.refill "before", not the default) was a
# little faster on one H200 (--refill,
# one run: 17.22 / 17.99 / 18.01 and 31.86 / 32.75 / 33.32 against 18.62 /
# 18.12 / 18.33 and 32.22 / 32.72 / 33.47; cuBLAS 18.79 / 18.72 / 18.90 and
# 33.82 / 33.31 / 33.17; the same bits as lane copies).
RING_COPY = "rows"
RING_L2_PREFETCH = 128
# Who copies x under row copies where x goes through the ring (m > 1;
# SkinnyConfig.x_copy): "lane" (8 tokens x 64 bytes per instruction) or
# "rows" (4 tokens x 128 bytes: half the L2 requests); the same bits (the
# two-GPU suite checks both). Measured on two H200s (bench_package_gemm,
# 2026-11-30, publishing alone in a graph, medians of 7 alternating rounds,
# m = 4 / 16): rows 18.83 / 19.22 (K = 4096) and 33.53 / 34.63 (8192)
# against lanes' 18.93 / 19.46 and 33.80 / 35.01, faster at m = 16 in 7 of 7
# rounds; with rows the default, the next run: 18.85 / 19.26 and 33.50 /
# 34.46 against lanes' 18.98 / 19.51 and 33.77 / 34.98.
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
    """Unsupported with a sentence unless the kernel covers ``constants``."""
    if not isinstance(constants, PackageGemmConstants):
        raise ValueError(f"PackageGemm takes PackageGemmConstants, not {type(constants).__name__}")
    c = constants
    if c.tile_n not in TILE_ROWS:
        raise Unsupported(f"the package GEMM computes 64 output features per CTA (tile_n 64: the ring main loop) "
                         f"or 16 (tile_n 16: the register-direct one), not tile_n {c.tile_n}")
    if c.hidden_size <= 0 or c.hidden_size % c.tile_n:
        raise Unsupported(f"the package GEMM's output features must be a positive multiple of {c.tile_n} (its "
                         f"tile_n), not {c.hidden_size}")
    if not 1 <= c.max_rows <= MAX_DECODE_ROWS:
        raise Unsupported(f"the package GEMM takes 1 to {MAX_DECODE_ROWS} rows per call, not max_rows "
                         f"{c.max_rows}")
    if c.split_k not in (1, 2, 4):
        raise Unsupported(f"the package GEMM splits K into 1, 2 or 4 slices (inside one CTA), not "
                         f"split_k {c.split_k}")


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
