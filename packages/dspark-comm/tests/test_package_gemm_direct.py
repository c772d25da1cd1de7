"""CPU tests of the package GEMM on the register-direct main loop
(``dspark_cute.cutedsl.gemm.skinny.direct``, ``tile_n`` 16; its GPU checks are in the
two-GPU suite):

- the index maps, emulated on integer data: every weight element loaded
  exactly once, the tile's sums exactly ``x @ W^T``, and every output's
  MMA sequence (the A and B operands of each MMA, in chain order) exactly
  the one the 64-row ring main loop gives the same rows -- the claim that
  both give the same bits;
- the epilogue's words cover every output of the tile once;
- compiles for sm_90a and sm_100a (plain and publish, PDL or not, early
  epochs, 4 and 8 warps) with a PTX audit: no ``fma``, no ``cp.async`` and
  no shared-memory ring, the weight as ``ld.global.nc`` 16-byte loads (2 per
  step and lane), the first ``stages`` steps' before the PDL wait and no x
  load before it, one CTA barrier, the MMA count; no spills on sm_90a;
- the constants and shapes it takes and refuses."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from ptx_audit import code, count, ptxas_report, spill_bytes
from skinny_emulation import emulated_lane_words, mma_emulated

from dspark_comm.cutedsl import package_gemm as pg
from dspark_comm.protocol import MailboxLayout
from dspark_core.contracts.constants import PackageGemmConstants
from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.cutedsl.gemm.skinny import direct as sd

ARCHS = ["sm_90a", "sm_100a"]


def _direct_chain(cfg, w, x, m):
    """Per warp, the list of (A, B) operand sets of every MMA in chain order
    (per n_tile), the copies count, and the tile's sums [8 n_tiles, 16]."""
    copies = np.zeros(w.shape, dtype=np.int64)
    chains = {}
    red = {}
    for warp in range(cfg.k_warps):
        acc = {nt: np.zeros((32, 4)) for nt in range(cfg.n_tiles)}
        for s in range(cfg.steps):
            lane_words = emulated_lane_words(cfg, w, x, m, warp, s, sd.weight_offset, sd.W_LOADS, copies)
            for half in range(2):
                for nt in range(cfg.n_tiles):
                    a = [sg.a_fragment(lw, 0, half) for lw in lane_words]
                    b = [sg.b_fragment(lw, nt, half, sd.W_LOADS) for lw in lane_words]
                    chains.setdefault((warp, nt), []).append((a, b))
                    acc[nt] += mma_emulated(a, b)
        for lane in range(32):
            for nt, v in acc.items():
                for reg in range(4):
                    row, tok = sg.acc_coords(lane, 0, nt, reg)
                    red[(warp, tok, row)] = v[lane, reg]
    out = np.zeros((8 * cfg.n_tiles, sd.TILE_ROWS))
    for tok in range(8 * cfg.n_tiles):
        for row in range(sd.TILE_ROWS):
            parts = [red[(wp, tok, row)] for wp in range(cfg.k_warps)]
            while len(parts) > 1:
                h = len(parts) // 2
                parts = [parts[j] + parts[j + h] for j in range(h)]
            out[tok, row] = parts[0]
    return chains, copies, out


def _ring_chain(cfg, w64, x, m, tile_i):
    """The ring main loop's (A, B) operands of MMA tile ``tile_i`` in chain order."""
    chains = {}
    for warp in range(cfg.k_warps):
        for s in range(cfg.steps):
            lane_words = emulated_lane_words(cfg, w64, x, m, warp, s)
            for half in range(2):
                for nt in range(cfg.n_tiles):
                    a = [sg.a_fragment(lw, tile_i, half) for lw in lane_words]
                    b = [sg.b_fragment(lw, nt, half) for lw in lane_words]
                    chains.setdefault((warp, nt), []).append((a, b))
    return chains


@pytest.mark.parametrize("k,k_warps,n_tiles,m", [(256, 1, 1, 1), (512, 4, 2, 16), (512, 2, 2, 9), (1024, 8, 1, 5)])
def test_direct_index_maps_give_the_ring_loops_operands(k, k_warps, n_tiles, m):
    rng = np.random.default_rng(k + 7 * k_warps + 31 * m)
    cfg = sg.SkinnyConfig(k=k, k_warps=k_warps, stages=1, n_tiles=n_tiles)
    w64 = rng.integers(-8, 9, size=(sg.TILE_ROWS, k)).astype(np.float64)
    x = rng.integers(-8, 9, size=(m, k)).astype(np.float64)
    for tile_i in range(sg.MMA_TILES):
        w = w64[16 * tile_i : 16 * tile_i + 16]
        chains, copies, out = _direct_chain(cfg, w, x, m)
        assert (copies == 1).all(), "a weight element loaded other than once"
        np.testing.assert_array_equal(out[:m], x @ w.T)
        ring = _ring_chain(cfg, w64, x, m, tile_i)
        for key, seq in chains.items():
            assert len(seq) == len(ring[key])
            for (a, b), (ra, rb) in zip(seq, ring[key]):
                assert a == ra and b == rb, "an MMA operand differs from the ring main loop's"


@pytest.mark.parametrize("k_warps,n_tiles", [(1, 1), (4, 1), (4, 2), (8, 1), (8, 2), (16, 2)])
def test_direct_epilogue_covers_every_output_once(k_warps, n_tiles):
    cfg = sg.SkinnyConfig(k=32 * k_warps, k_warps=k_warps, stages=1, n_tiles=n_tiles)
    seen = {}
    for tid in range(cfg.threads):
        for rnd in range(sd.epilogue_rounds(cfg)):
            tok, row = sd.epilogue_word(cfg, tid, rnd)
            if tok < 8 * n_tiles:
                assert row % 2 == 0 and 0 <= row < sd.TILE_ROWS
                seen[(tok, row)] = seen.get((tok, row), 0) + 1
    assert seen == {(t, r): 1 for t in range(8 * n_tiles) for r in range(0, sd.TILE_ROWS, 2)}


def _direct(role, hidden, k, split_k=1, tile_n=16) -> PackageGemmConstants:
    return PackageGemmConstants(role, hidden, k, tile_n, split_k, 16)


# (label, constants, n_tiles, mode, tp, rank, pdl, early)
VARIANTS = [
    ("o_proj-tp8-k1024-plain", _direct("o_proj", 8192, 1024), 2, "plain", 2, 0, True, False),
    ("o_proj-tp8-k1024-pub", _direct("o_proj", 8192, 1024), 2, "publish", 2, 1, True, True),
    ("o_proj-tp2-k4096-pub-nt1", _direct("o_proj", 8192, 4096), 1, "publish", 2, 0, True, True),
    ("down-tp2-k8192-pub", _direct("down_proj", 8192, 8192, 2), 2, "publish", 2, 0, True, False),
    ("k1024-pub-tp8-nopdl", _direct("o_proj", 2048, 1024), 2, "publish", 8, 5, False, True),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_direct_package_gemm_compiles(arch, variant, tmp_path):
    from dspark_cute.runtime.host import compile_ptx

    _, c, nt, mode, tp, rank, pdl, early = variant
    kw, st = pg.default_shape(c)
    cfg = sg.SkinnyConfig(c.k_shard, kw, st, nt)
    layout = MailboxLayout(tp, c.hidden_size, 16) if mode == "publish" else None
    kernel = pg.PackageGemmKernel(c.hidden_size, cfg, mode, layout, rank, pdl, early, c.tile_n)
    ptx = compile_ptx(kernel, *pg.fake_args(), arch=arch)
    body = code(ptx)
    assert f".target {arch}" in body and f".reqntid {cfg.threads}, 1, 1" in body
    assert not re.search(r"\bfma\b|\.ftz\b|\.local\b|cp\.async", body)
    w_load = r"\bld\.global(?:\.nc)?\.L1::no_allocate\.v4\.b32\b"
    na = r"\bld\.global\.L1::no_allocate\.v4\.b32\b"  # the weight loads before a PDL wait (kept there)
    assert count(body, w_load) == sd.W_LOADS * cfg.steps
    assert count(body, r"\bld\.global\.v4\.b32\b") == cfg.n_tiles * cfg.steps
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16") == 2 * cfg.n_tiles * cfg.steps
    assert count(body, r"\bbar\.sync\b") == 1
    stores = r"\bst\.relaxed\.sys\.global\.b32\b" if mode == "publish" else r"\bst\.global\.b32\b"
    assert count(body, stores) == sd.epilogue_rounds(cfg) * (tp if mode == "publish" else 1)
    if pdl:
        head = body.partition("griddepcontrol.wait")[0]
        assert count(head, na) == count(body, na) == sd.W_LOADS * min(cfg.stages, cfg.steps)
        assert count(head, w_load) == count(head, na)
        assert count(head, r"\bld\.global\.v4\.b32\b") == 0 and "ld.relaxed" not in head
    else:
        assert "griddepcontrol" not in body
    if early:
        before_mma = body.partition("mma.sync")[0]
        assert count(before_mma, r"\bld\.relaxed\.gpu\.global\.b32") == sd.epilogue_rounds(cfg)
    report = ptxas_report(ptx, arch, tmp_path)
    if report and arch == "sm_90a":
        assert spill_bytes(report) == 0, report


def test_direct_shapes_and_refusals():
    c = _direct("o_proj", 8192, 1024)
    # 8 steps a warp: all in flight for 8 tokens, 4 for 16 (DIRECT_DEPTH: measured).
    assert pg.default_shape(c, n_tiles=1) == (4, 8) and pg.default_shape(c) == (4, 4)
    assert pg.default_shape(_direct("o_proj", 8192, 8192)) == (4, pg.DIRECT_DEPTH[2])
    assert pg.default_shape(_direct("o_proj", 8192, 256), n_tiles=1) == (4, 2)  # at most the steps
    assert pg.smem_bytes(sg.SkinnyConfig(1024, 4, 8, 2), 16) == sd.red_bytes(sg.SkinnyConfig(1024, 4, 8, 2))
    with pytest.raises(ValueError, match="tile_n 16"):
        pg.check_constants(PackageGemmConstants("o_proj", 8192, 1024, 32, 1, 16))
    with pytest.raises(ValueError, match=r"positive multiple of its tile_n, not 8200 \(tile_n 16\)"):
        pg.check_constants(PackageGemmConstants("o_proj", 8200, 1024, 16, 1, 16))
    with pytest.raises(ValueError, match="16 output features"):
        pg.PackageGemmKernel(8200, sg.SkinnyConfig(1024, 4, 2, 2), "plain", None, 0, False, False, 16)
    with pytest.raises(ValueError, match="x_regs is the ring main loop's"):  # the direct loop would ignore it
        pg.PackageGemmKernel(8192, sg.SkinnyConfig(1024, 4, 2, 2, x_regs=True), "plain", None, 0, False, False, 16)
    with pytest.raises(ValueError, match="CUDA"):  # the host class checks its weight as for tile_n 64
        pg.PackageGemm(c, torch.zeros(8192, 1024, dtype=torch.bfloat16), pdl=False)


@pytest.mark.compile
def test_direct_package_gemm_weight_loads_stay_before_the_wait_in_the_machine_code(tmp_path):
    """What ptxas keeps before the PDL wait (``ACQBULK``): the first steps'
    weight loads, coherent (``LDG.E.NA.128``: ``dspark_cute.ptx.weight_first``;
    non-coherent ones it moved after the wait, dspark-cute's ``test_sass_pdl.py``)."""
    from ptx_audit import census_or_skip, ops_like

    from dspark_cute.runtime.host import compile_ptx

    c = _direct("o_proj", 8192, 4096)
    kw, st = pg.default_shape(c)
    cfg = sg.SkinnyConfig(c.k_shard, kw, st, 1)
    kernel = pg.PackageGemmKernel(c.hidden_size, cfg, "publish", MailboxLayout(2, c.hidden_size, 16), 0, True, True,
                                  c.tile_n)
    before, after = census_or_skip(compile_ptx(kernel, *pg.fake_args(), arch="sm_90a"), "sm_90a", tmp_path)
    assert before.get("LDG.E.NA.128", 0) == sd.W_LOADS * min(cfg.stages, cfg.steps)
    assert after.get("LDG.E.NA.128", 0) == 0 and ops_like(before, "HMMA") == 0
