"""Host emulation of the skinny GEMM's fragment layouts for the CPU tests:
one m16n8k16 MMA from the 32 lanes' registers (``mma_emulated``) and every
lane's copied words of one step as a main loop's index maps read them
(``emulated_lane_words``), in float64 NumPy."""

from __future__ import annotations

from dspark_cute.cutedsl.gemm.skinny.config import W_LOADS, SkinnyConfig, weight_offset, x_offset, x_token


def mma_emulated(lane_a: list, lane_b: list):
    """``A @ B`` of one m16n8k16 from the 32 lanes' registers (each register a
    (lo, hi) pair), by the PTX ISA's layouts: A reg r holds row g + 8 (r & 1),
    columns 2t + 8 (r >> 1) + {0, 1}; B reg r holds rows (k) 2t + 8 r + {0, 1}
    of column g. Returns D [32 lanes, 4]: c_r is row g + 8 (r >> 1), column
    2t + (r & 1). Host code for the CPU tests' emulation of the main loops
    (float64 NumPy, exact on small integers)."""
    import numpy as np

    a = np.full((16, 16), np.nan)
    b = np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r in range(4):
            for e in range(2):
                a[g + 8 * (r & 1), 2 * t + e + 8 * (r >> 1)] = lane_a[lane][r][e]
        for r in range(2):
            for e in range(2):
                b[2 * t + e + 8 * r, g] = lane_b[lane][r][e]
    if np.isnan(a).any() or np.isnan(b).any():
        raise ValueError("the lanes' registers leave a fragment element unheld")
    d = a @ b
    return np.array([[d[lane // 4 + 8 * (r >> 1), 2 * (lane % 4) + (r & 1)] for r in range(4)] for lane in range(32)])


def emulated_lane_words(cfg: SkinnyConfig, w, x, m: int, warp: int, step: int, offset=None, loads: int = W_LOADS,
                        copies=None) -> list:
    """Every lane's copied words of one step, as a main loop's index maps
    read them from the host arrays ``w`` (the tile) and ``x`` (NumPy):
    ``loads`` weight copies at ``offset(cfg, warp, lane, step, load)``
    (default ``weight_offset``), then one x copy per n_tile; each word a
    (lo, hi) pair. ``copies`` (an array shaped like ``w``), where given,
    counts each weight element copied."""
    offset = offset or weight_offset
    wf, xf = w.ravel(), x.ravel()

    def words(flat, at: int) -> list:
        v = flat[at : at + 8]
        return [(v[2 * q], v[2 * q + 1]) for q in range(4)]

    lanes = []
    for lane in range(32):
        lw = []
        for load in range(loads):
            at = offset(cfg, warp, lane, step, load)
            if copies is not None:
                copies.flat[at : at + 8] += 1
            lw.append(words(wf, at))
        for nt in range(cfg.n_tiles):
            lw.append(words(xf, x_offset(cfg, warp, lane, step, x_token(lane, nt, m))))
        lanes.append(lw)
    return lanes


__all__ = ["emulated_lane_words", "mma_emulated"]
