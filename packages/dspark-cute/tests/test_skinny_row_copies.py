"""The skinny main loop's row copies (``SkinnyConfig.copy`` "rows"): the
warp's cooperative 128-byte row copies put into the ring exactly the words
each lane then reads for its MMAs (``weight_offset``'s), every ring byte of a
pair written once, and neither the copies nor the reads have shared-memory
bank conflicts. Pure index arithmetic (no GPU, no compile)."""

from __future__ import annotations

import pytest

from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.cutedsl.gemm.skinny import rows as sr


def _phases_conflict_free(offsets: list[int]) -> bool:
    """A 16-byte-per-lane shared access is served a quarter-warp (8 lanes) at
    a time; it is conflict-free when each quarter's 8 chunks fall on 8
    different 16-byte bank groups (offset / 16 mod 8)."""
    return all(len({(o // 16) % 8 for o in offsets[q * 8:(q + 1) * 8]}) == 8 for q in range(4))


@pytest.mark.parametrize("k,k_warps,stages", [(1024, 4, 4), (4096, 4, 6), (8192, 8, 4), (512, 2, 2), (2048, 16, 2)])
def test_row_copies_feed_every_lane_its_words(k, k_warps, stages):
    cfg = sg.SkinnyConfig(k, k_warps, stages, 2, copy="rows")
    lane_cfg = sg.SkinnyConfig(k, k_warps, stages, 2)
    pair_bytes = k_warps * sg.TILE_ROWS * sr.PAIR_ROW_BYTES
    for warp in {0, k_warps - 1}:
        for pair in {0, 1, cfg.steps // 2 - 1}:
            ps = pair % (stages // 2)
            ring: dict[int, int] = {}  # ring byte offset of a chunk -> the tile element offset it holds
            for q in range(sr.PAIR_COPIES):
                offsets = []
                for lane in range(32):
                    row, chunk, off = sr.row_copy(cfg, warp, lane, pair, q)
                    dst = sr.rows_ring_offset(cfg, warp, ps, row, chunk)
                    assert dst % 16 == 0 and ps * pair_bytes <= dst < (ps + 1) * pair_bytes
                    assert dst not in ring, "two copies into one ring chunk"
                    ring[dst] = off
                    offsets.append(dst)
                assert _phases_conflict_free(offsets), "a bank conflict in the row copies"
                # 4 rows x 128 contiguous bytes per instruction: whole L2 lines.
                rows = {}
                for lane in range(32):
                    row, _, off = sr.row_copy(cfg, warp, lane, pair, q)
                    rows.setdefault(row, []).append(off)
                assert len(rows) == 4 and all(sorted(v) == list(range(min(v), min(v) + 64, 8)) for v in rows.values())
            assert len(ring) == sg.TILE_ROWS * sr.PAIR_ROW_BYTES // 16
            for s in (2 * pair, 2 * pair + 1):
                for load in range(sg.W_LOADS):
                    offsets = []
                    for lane in range(32):
                        src = sr.rows_read_offset(cfg, warp, lane, s, load, ps)
                        assert ring[src] == sg.weight_offset(lane_cfg, warp, lane, s, load)
                        offsets.append(src)
                    assert _phases_conflict_free(offsets), "a bank conflict in the fragment reads"


def test_row_copies_keep_x_slots_apart():
    cfg = sg.SkinnyConfig(4096, 4, 6, 2, copy="rows")
    weight = cfg.stages * sg.W_LOADS * cfg.threads * 16
    slots = {sg.ring_offset(cfg, tid, st, sg.W_LOADS + nt)
             for tid in range(cfg.threads) for st in range(cfg.stages) for nt in range(cfg.n_tiles)}
    assert len(slots) == cfg.threads * cfg.stages * cfg.n_tiles
    assert min(slots) == weight and max(slots) + 16 == cfg.ring_bytes


@pytest.mark.parametrize("k,k_warps,stages,n_tiles,m", [(4096, 4, 6, 2, 16), (8192, 8, 4, 2, 11), (8192, 8, 6, 1, 5),
                                                         (1024, 4, 4, 1, 8), (512, 2, 2, 2, 9)])
def test_x_row_copies_feed_every_lane_its_words(k, k_warps, stages, n_tiles, m):
    """``x_copy`` "rows": the warp's 128-byte token-row copies put into x's
    region exactly the words (clamped tokens included) each lane's own copy
    would have (``x_offset`` of ``x_token``), once each, inside x's region,
    and neither copies nor reads have bank conflicts."""
    cfg = sg.SkinnyConfig(k, k_warps, stages, n_tiles, copy="rows", x_copy="rows")
    lane_cfg = sg.SkinnyConfig(k, k_warps, stages, n_tiles)
    weight = stages * sg.W_LOADS * cfg.threads * 16
    assert weight + stages // 2 * k_warps * 8 * n_tiles * sr.PAIR_ROW_BYTES == cfg.ring_bytes
    owner: dict[int, tuple] = {}  # ring chunk -> the (warp, pair stage) whose x it holds
    for warp in range(k_warps):
        for pair in {0, 1, cfg.steps // 2 - 1}:
            ps = pair % (stages // 2)
            ring: dict[int, int] = {}
            for q in range(2 * n_tiles):
                offsets, rows = [], {}
                for lane in range(32):
                    slot, chunk, off = sr.x_row_copy(cfg, warp, lane, pair, q, m)
                    dst = sr.x_rows_offset(cfg, warp, ps, slot, chunk)
                    assert dst % 16 == 0 and weight <= dst < cfg.ring_bytes
                    assert dst not in ring, "two copies into one ring chunk"
                    ring[dst] = off
                    offsets.append(dst)
                    rows.setdefault(slot, []).append(off)
                assert _phases_conflict_free(offsets), "a bank conflict in the x row copies"
                # 4 token slots x 128 contiguous bytes per instruction (a clamped slot repeats row m - 1's).
                assert len(rows) == 4 and all(sorted(v) == list(range(min(v), min(v) + 64, 8)) for v in rows.values())
            assert len(ring) == 8 * n_tiles * sr.PAIR_ROW_BYTES // 16
            for dst in ring:
                assert owner.setdefault(dst, (warp, ps)) == (warp, ps), "two warps' x in one chunk"
            for s in (2 * pair, 2 * pair + 1):
                for nt in range(n_tiles):
                    offsets = []
                    for lane in range(32):
                        src = sr.x_rows_read_offset(cfg, warp, lane, s, nt, ps)
                        assert ring[src] == sg.x_offset(lane_cfg, warp, lane, s, sg.x_token(lane, nt, m))
                        offsets.append(src)
                    assert _phases_conflict_free(offsets), "a bank conflict in the x fragment reads"


@pytest.mark.parametrize("kwargs", [{"copy": "lane", "x_copy": "rows"}, {"x_regs": True, "x_copy": "rows"},
                                    {"x_copy": "tma"}])
def test_x_row_copies_refuse(kwargs):
    args = {"k": 4096, "k_warps": 4, "stages": 4, "n_tiles": 2, "copy": "rows", **kwargs}
    with pytest.raises(ValueError, match="x_copy"):
        sg.SkinnyConfig(**args)


@pytest.mark.parametrize("kwargs", [{"stages": 3}, {"k": 4096 + 32 * 4}, {"copy": "tma"}])
def test_row_copies_refuse(kwargs):
    args = {"k": 4096, "k_warps": 4, "stages": 4, "n_tiles": 2, "copy": "rows", **kwargs}
    with pytest.raises(ValueError):
        sg.SkinnyConfig(**args)
