"""CPU tests of the package GEMM (``dspark_comm.cutedsl.package_gemm``):

- the epilogue's index maps: every (token, column) of the output written by
  exactly one lane of one CTA, and the publish epilogue's word offsets equal
  ``protocol.MailboxLayout.slot_offset(epoch, rank, token) + 2 * column``;
- an emulation of the publish epilogue over 2-8 ranks: the kernel's index
  maps scatter each rank's BF16 partial, encoded as the mailbox encodes
  (``protocol.encode_words``), into every rank's buffer at the rows' epochs;
  a consumer reading the slots as the published all-reduce does finds no
  empty word (all 65536 BF16 patterns and the marker's pattern included),
  touches nothing else, and sums bit for bit what ``reference_sum`` gives on
  the partials themselves;
- compiles for sm_90a and sm_100a in both modes with a PTX audit: the weight
  streamed with 16-byte ``cp.async`` copies only (steps x loads per thread),
  the MMA count, no ``fma``/``.ftz``/approximation/local memory, every FP32
  add ``.rn``; publish: exactly ``rounds x tp`` ``st.relaxed.sys.global.b32``
  and no weak global store, the epochs read with ``ld.relaxed.gpu`` after the
  PDL wait, the address table before it, the escape word in the encoding;
  plain: ``rounds`` ``st.global.b32`` and no mailbox access;
- the host: refusals with sentences, the compile cache keyed by the
  constants, no compile during CUDA graph capture.
"""

from __future__ import annotations

import re
import types

import pytest
import torch
from ptx_audit import code, count, ptxas_report, spill_bytes

from dspark_comm.cutedsl import package_gemm as pg
from dspark_comm.protocol import (
    ESCAPE,
    HEADER_BYTES,
    MARKER,
    MailboxLayout,
    bf16_words,
    encode_words,
    is_empty,
    reference_sum,
    words_bf16,
)
from dspark_core.contracts.constants import FP32_RANK_ORDER, PackageGemmConstants
from dspark_core.planner.policy import DRAFT_GEMMS, draft_gemm_shape
from dspark_core.tools.compare import mismatches
from dspark_cute.cutedsl.gemm.skinny import config as sg

ARCHS = ["sm_90a", "sm_100a"]


def _constants(role: str, hidden: int, k: int, **over) -> PackageGemmConstants:
    """The policy's constants of ``role`` at shard ``k`` on the ring main
    loop (tile_n 64, the policy's split_k there: ``draft_gemm_shape``)."""
    shape = DRAFT_GEMMS[role]
    fields = dict(role=role, hidden_size=hidden, k_shard=k, tile_n=shape.tile_n,
                  split_k=draft_gemm_shape(role, k).split_k, max_rows=shape.max_rows)
    fields.update(over)
    return PackageGemmConstants(**fields)


# ---------------------------------------------------------------- index maps


def _epilogue_words(cfg: sg.SkinnyConfig, n: int, m: int):
    """(tile, warp, round, lane, token, column) of every store the epilogue
    makes (tokens below m), from the kernel's index maps."""
    for tile in range(n // sg.TILE_ROWS):
        for warp in range(cfg.k_warps):
            for rnd in range(pg.epilogue_rounds(cfg)):
                tok = pg.epilogue_token(cfg, warp, rnd)
                if tok >= m:
                    continue
                for lane in range(32):
                    yield tile, warp, rnd, lane, tok, pg.output_column(tile, lane)


@pytest.mark.parametrize("k_warps,n_tiles", [(1, 1), (2, 2), (4, 1), (4, 2), (8, 2), (16, 1), (16, 2)])
def test_epilogue_covers_every_output_once(k_warps, n_tiles):
    n = 1024
    cfg = sg.SkinnyConfig(k=32 * k_warps * 2, k_warps=k_warps, stages=1, n_tiles=n_tiles)
    m = 8 * n_tiles
    seen = torch.zeros(m, n, dtype=torch.int64)
    for _, _, _, _, tok, col in _epilogue_words(cfg, n, m):
        seen[tok, col] += 1
        seen[tok, col + 1] += 1
        # reduced_pair's rows are the two columns of the word.
        assert col % 2 == 0
    assert (seen == 1).all()
    # Plain output offsets: the row-major [m, n] BF16 layout.
    assert pg.plain_offset(n, 3, 130) == (3 * n + 130) * 2


@pytest.mark.parametrize("tp,capacity,hidden", [(2, 16, 2048), (4, 5, 4096), (8, 16, 2048), (2, 128, 8192)])
def test_publish_offsets_are_the_protocols_slots(tp, capacity, hidden):
    layout = MailboxLayout(tp, hidden, capacity)
    for epoch in range(3):
        for src in range(tp):
            for tok in {0, 1, capacity - 1}:
                for col in (0, 2, 64, hidden - 2):
                    assert pg.publish_offset(layout, epoch, src, tok, col) == \
                        layout.slot_offset(epoch, src, tok) + 2 * col
    last = pg.publish_offset(layout, 2, tp - 1, capacity - 1, hidden - 2)
    assert last + 4 == layout.total_bytes and pg.publish_offset(layout, 0, 0, 0, 0) == HEADER_BYTES


def _patterns_rows(m: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """m rows cycling through every BF16 pattern (shuffled), the marker's
    pattern as whole words and lone halves, and signed zeros."""
    p = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    p = p[torch.randperm(p.numel(), generator=gen)]
    flat = p.repeat(-(-m * hidden // p.numel()))[: m * hidden].clone()
    flat[0:8] = -1          # the marker's pattern as whole words
    flat[9] = -1            # a lone 0xFFFF half
    flat[16:20] = -32768    # -0.0
    return flat.view(torch.bfloat16).reshape(m, hidden)


@pytest.mark.parametrize("tp,m,k_warps,n_tiles", [(2, 16, 4, 2), (4, 7, 8, 1), (8, 13, 16, 2), (2, 1, 4, 1)])
def test_publish_epilogue_emulated(tp, m, k_warps, n_tiles, seed):
    hidden, capacity = 2048, 16
    layout = MailboxLayout(tp, hidden, capacity)
    cfg = sg.SkinnyConfig(k=32 * k_warps, k_warps=k_warps, stages=1, n_tiles=n_tiles)
    gen = torch.Generator().manual_seed(seed)
    if m > 8 * n_tiles:
        pytest.skip("more rows than the variant's tokens")
    partials = [_patterns_rows(m, hidden, gen) if r % 2 == 0 else
                (torch.randn(m, hidden, generator=gen) * 100).to(torch.bfloat16) for r in range(tp)]
    # The rows' epochs: the same on every rank (the protocol's invariant).
    epochs = torch.randint(0, 3, (capacity,), generator=gen).tolist()
    words_per_buffer = layout.total_bytes // 4
    buffers = [torch.full((words_per_buffer,), MARKER, dtype=torch.int64) for _ in range(tp)]
    for rank in range(tp):
        data = bf16_words(partials[rank])  # [m, hidden / 2] words
        enc = encode_words(data)
        for _tile, _warp, _rnd, _lane, tok, col in _epilogue_words(cfg, hidden, m):
            for peer in range(tp):
                off = pg.publish_offset(layout, epochs[tok], rank, tok, col)
                assert off % 4 == 0 and HEADER_BYTES <= off < layout.total_bytes
                assert is_empty(buffers[peer][off // 4]), "a store into a slot already written"
                buffers[peer][off // 4] = enc[tok, col // 2]
    for peer in range(tp):
        got = []
        touched = torch.zeros(words_per_buffer, dtype=torch.bool)
        for src in range(tp):
            rows = []
            for tok in range(m):
                start = layout.slot_offset(epochs[tok], src, tok) // 4
                w = buffers[peer][start: start + hidden // 2]
                touched[start: start + hidden // 2] = True
                assert not is_empty(w).any(), "a published word looks empty"
                rows.append(w)
            words = torch.stack(rows)
            # Every word is the data word, or the escape of the marker's pattern.
            data = bf16_words(partials[src])
            assert torch.equal(words, torch.where(data == MARKER, torch.full_like(data, ESCAPE), data))
            got.append(words_bf16(words))
        assert is_empty(buffers[peer][~touched]).all(), "a word outside the call's slots was written"
        assert int(mismatches(reference_sum(got, FP32_RANK_ORDER),
                              reference_sum(partials, FP32_RANK_ORDER)).sum()) == 0


# ---------------------------------------------------------------- compiles and the PTX audit


def audit(body: str, cfg: sg.SkinnyConfig, mode: str, tp: int, pdl: bool) -> None:
    assert not re.search(r"\bfma\b|\bfma\.", body), "an FMA (the MMAs are the only multiply-adds)"
    assert ".ftz" not in body, "a flush-to-zero instruction"
    assert not re.search(r"rsqrt|\.approx|rcp\.", body), "an approximate instruction"
    assert not re.search(r"\b(ld|st)\.local", body), "local memory (register spills)"
    assert "multimem" not in body
    for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op, f"an FP32 operation without an explicit rounding: {op}"
    assert count(body, r"\badd\.rn\.f32") == (cfg.k_warps - 1) * 2 * pg.epilogue_rounds(cfg)
    # The weight (and x, unless x_regs) stream: 16-byte cp.async copies only.
    copies = re.findall(r"\bcp\.async[.\w:]*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(\d+);", body)
    assert copies and all(size == "16" for size in copies), "a cp.async other than 16 bytes"
    assert len(copies) == cfg.steps * cfg.ring_loads
    hint = rf"\.L2::{cfg.l2_prefetch}B" if cfg.l2_prefetch else ""
    assert count(body, rf"\bcp\.async\.cg\.shared\.global{hint}\s") == cfg.steps * cfg.ring_loads
    # Row copies: the warp meets twice a pair of steps (the copies visible, the slot read).
    assert count(body, r"\bbar\.warp\.sync\b") == (cfg.steps if cfg.copy == "rows" else 0)
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == (
        cfg.steps * 2 * sg.MMA_TILES * cfg.n_tiles)
    assert count(body, r"\bbar\.sync\b") == 2
    rounds = pg.epilogue_rounds(cfg)
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32") == rounds
    stores = re.findall(r"\bst\.[\w.]*global[\w.]*", body)
    loads = re.findall(r"\bld\.[\w.]*global[\w.]*", body)
    x_loads = cfg.steps * cfg.n_tiles if cfg.x_regs else 0  # x's 16-byte loads into registers
    assert loads.count("ld.global.v4.b32") == x_loads
    loads = [op for op in loads if op != "ld.global.v4.b32"]
    if mode == "publish":
        assert stores == ["st.relaxed.sys.global.b32"] * (rounds * tp), stores
        assert sorted(set(loads)) == ["ld.global.b64", "ld.relaxed.gpu.global.b32"], loads
        assert loads.count("ld.global.b64") == tp and loads.count("ld.relaxed.gpu.global.b32") == rounds
        # The encoding: the marker compared, the escape word selected.
        assert re.search(r"setp\.eq\.u32\s+\S+,\s*\S+,\s*(-1|0xffffffff|0xFFFFFFFF|4294967295)\b", body)
        assert re.search(rf"selp\.b32\s+\S+,\s*({ESCAPE}|{ESCAPE - 2**32}|{ESCAPE:#x}|0x{ESCAPE:X}|0x{ESCAPE:08X})",
                         body)
    else:
        assert stores == ["st.global.b32"] * rounds, stores
        assert not loads and ".sys" not in body
    if pdl:
        head, sep, tail = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert count(head, r"\bcp\.async\.cg") == sg.W_LOADS * cfg.stages, "not exactly the weight prologue"
        # (x_regs: each prologue step's weight, or pair's under row copies, is its own commit group.)
        groups = cfg.stages // 2 if cfg.copy == "rows" else cfg.stages
        assert count(head, r"\bcp\.async\.commit_group") == (groups if cfg.x_regs else 0)
        assert "ld.relaxed" not in head and count(head, r"\bld\.global\.v4\b") == 0
        assert count(head, r"\bld\.global\.b64") == (tp if mode == "publish" else 0)
        _, sep, after = tail.rpartition("mma.sync")
        assert sep and "griddepcontrol.launch_dependents" in after.partition("bar.sync")[0]
    else:
        assert "griddepcontrol" not in body


# Spills ptxas (CUDA 13.0) makes in a variant's PTX from a given CuTe DSL: (label, arch, DSL major.minor) ->
# bytes. CuTe DSL 4.8's PTX of the 8-token K = 2048 ring variant with x in token rows (x_copy "rows")
# spills 16 bytes at 72 registers, although the 16-token one takes 108 without a spill; 4.3.5's PTX
# (the one the H200 runs validated) does not spill, nor 4.8's at K = 4096 or 8192 (measured 2026-11-30).
KNOWN_SPILLS = {("o_proj-tp2-k2048-pub-nt1", "sm_90a", "4.8"): 16}


def check_spills(ptx: str, arch: str, tmp_path, label: str = "") -> None:
    """ptxas (where installed) spills no more in ``ptx`` than ``KNOWN_SPILLS``
    allows variant ``label`` under the installed CuTe DSL (none unless listed).
    sm_90a only: sm_100a's ptxas spills 8 bytes in the 8-warp K = 8192 variant."""
    from importlib.metadata import version

    report = ptxas_report(ptx, arch, tmp_path)
    if report and arch == "sm_90a":
        dsl = ".".join(version("nvidia-cutlass-dsl").split(".")[:2])
        assert spill_bytes(report) <= KNOWN_SPILLS.get((label, arch, dsl), 0), report


# (label, constants, k_warps or None, stages or None, n_tiles, mode, tp, rank, pdl)
VARIANTS = [
    ("o_proj-tp8-k512-plain", _constants("o_proj", 8192, 512), None, None, 2, "plain", 2, 0, True),
    ("o_proj-tp2-k2048-pub", _constants("o_proj", 8192, 2048), None, None, 2, "publish", 2, 1, True),
    ("o_proj-tp2-k2048-pub-nt1", _constants("o_proj", 8192, 2048), None, None, 1, "publish", 2, 0, True),
    ("down-tp8-k2048-pub-tp8", _constants("down_proj", 8192, 2048), None, None, 2, "publish", 8, 5, True),
    ("down-tp2-k8192-pub", _constants("down_proj", 8192, 8192), None, None, 2, "publish", 2, 0, True),
    ("k1024-kw4-plain-nopdl", _constants("o_proj", 2048, 1024), 4, 2, 1, "plain", 2, 0, False),
    ("k1024-kw16-pub-tp4", _constants("o_proj", 2048, 1024), 16, 2, 2, "publish", 4, 3, False),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_package_gemm_compiles(arch, variant, tmp_path):
    from dspark_cute.runtime.host import compile_ptx

    label, c, kw, st, nt, mode, tp, rank, pdl = variant
    kw, st = pg.default_shape(c, kw, st, nt)
    cfg = pg.ring_config(c.k_shard, kw, st, nt)
    layout = MailboxLayout(tp, c.hidden_size, 16) if mode == "publish" else None
    ptx = compile_ptx(pg.PackageGemmKernel(c.hidden_size, cfg, mode, layout, rank, pdl), *pg.fake_args(),
                      arch=arch)
    assert f".target {arch}" in ptx
    audit(code(ptx), cfg, mode, tp, pdl)
    check_spills(ptx, arch, tmp_path, label)


# x through registers (SkinnyConfig.x_regs): (label, constants, stages or None, n_tiles, mode, pdl)
X_REGS = [
    ("down-tp2-k8192-pub-st6", _constants("down_proj", 8192, 8192), None, 2, "publish", True),
    ("o_proj-tp2-k4096-plain-nt1", _constants("o_proj", 8192, 4096), None, 1, "plain", True),
    ("o_proj-k2048-plain-nopdl", _constants("o_proj", 8192, 2048), 4, 2, "plain", False),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", X_REGS, ids=[v[0] for v in X_REGS])
def test_x_through_registers_compiles(arch, variant, tmp_path):
    """The ring main loop with x loaded into registers: the weight's copies
    alone in the ring, x's ``ld.global.v4`` loads after the PDL wait, the
    same MMAs and stores as with x in the ring (``audit``), and the room for
    more stages: 6 of 8 warps at 16 tokens (5 with x in the ring)."""
    from dspark_cute.runtime.host import compile_ptx

    _, c, st, nt, mode, pdl = variant
    kw, st = pg.default_shape(c, None, st, nt, x_regs=True)
    cfg = pg.ring_config(c.k_shard, kw, st, nt, x_regs=True)
    assert cfg.smem_bytes <= pg.MAX_SMEM_BYTES
    layout = MailboxLayout(2, c.hidden_size, 16) if mode == "publish" else None
    ptx = compile_ptx(pg.PackageGemmKernel(c.hidden_size, cfg, mode, layout, 0, pdl), *pg.fake_args(), arch=arch)
    audit(code(ptx), cfg, mode, 2, pdl)
    check_spills(ptx, arch, tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("x_copy", ["lane", "rows"])
def test_row_copies_compile(arch, x_copy, tmp_path):
    """Row copies (``SkinnyConfig.copy`` "rows", the ring's default), x
    copied by lanes or in token rows (``x_copy``; the package GEMM's is
    ``RING_X_COPY``): the whole audit (the same MMAs, copies, epilogue), no
    spills."""
    import dataclasses

    from dspark_cute.runtime.host import compile_ptx

    c = _constants("down_proj", 8192, 8192)
    kw, st = pg.default_shape(c)
    cfg = dataclasses.replace(pg.ring_config(c.k_shard, kw, st, 2), x_copy=x_copy)
    assert cfg.copy == "rows" and st % 2 == 0
    layout = MailboxLayout(2, c.hidden_size, 16)
    ptx = compile_ptx(pg.PackageGemmKernel(c.hidden_size, cfg, "publish", layout, 1, True), *pg.fake_args(),
                      arch=arch)
    audit(code(ptx), cfg, "publish", 2, True)
    check_spills(ptx, arch, tmp_path)


def test_x_through_registers_shapes():
    """x_regs leaves the ring to the weight (W_LOADS copies a step), so the
    default depth goes deeper where x's copies made it stop short (8 warps,
    16 tokens, row copies: 6 stages of 32 KB within MAX_SMEM_BYTES, against 4
    of 40 KB); the register-direct loop refuses it."""
    c = _constants("down_proj", 8192, 8192)
    assert pg.MAX_SMEM_BYTES == 227 * 1024
    assert pg.default_shape(c) == (8, 4) and pg.default_shape(c, x_regs=True) == (8, 6)
    cfg = sg.SkinnyConfig(8192, 8, 6, 2, x_regs=True)
    assert cfg.ring_loads == sg.W_LOADS and cfg.loads == sg.W_LOADS + 2
    assert cfg.ring_bytes == 6 * sg.W_LOADS * 256 * 16
    assert sg.ring_offset(cfg, 255, 5, sg.W_LOADS - 1) + 16 == cfg.ring_bytes
    with pytest.raises(ValueError, match="x_regs is True or False"):
        sg.SkinnyConfig(512, 1, 1, 2, x_regs=1)
    with pytest.raises(ValueError, match="x_regs is the ring main loop's"):
        pg.PackageGemm(_constants("o_proj", 8192, 1024, tile_n=16), torch.zeros(8192, 1024, dtype=torch.bfloat16),
                       x_regs=True)


def test_default_shapes_of_the_policy():
    """The policy's shapes at the draft's shards (draft_gemm_shape's split_k,
    4 warps each): the ring main loop up to RING_DEPTH stages within the
    shared-memory cap, for either token tile."""
    for role, k, kw in (("o_proj", 2048, 4), ("o_proj", 4096, 8), ("o_proj", 512, 4), ("down_proj", 4096, 8),
                        ("down_proj", 8192, 8), ("down_proj", 2048, 8), ("o_proj", 8192, 8)):
        for nt in (1, 2):
            got_kw, st = pg.default_shape(_constants(role, 8192, k), n_tiles=nt)
            assert got_kw == kw
            cfg = pg.ring_config(k, kw, st, nt)
            assert 1 <= st <= min(pg.RING_DEPTH[nt], cfg.steps) and cfg.smem_bytes <= pg.MAX_SMEM_BYTES
            # Row copies wherever the warp's steps are even (all of these): stages in pairs.
            assert cfg.copy == pg.RING_COPY == "rows" and st % 2 == 0 and cfg.l2_prefetch == pg.RING_L2_PREFETCH
    # The measured choices (the module comments): 6 stages of 4 warps at K = 2048; 8 warps at K = 4096 and
    # 8192, where the cap (MAX_SMEM_BYTES) leaves 6 stages for 8 tokens, 4 (pairs) for 16.
    assert pg.default_shape(_constants("o_proj", 8192, 2048)) == (4, 6)
    assert pg.default_shape(_constants("o_proj", 8192, 2048), n_tiles=1) == (4, 6)
    for role, k in (("o_proj", 4096), ("down_proj", 8192)):
        assert pg.default_shape(_constants(role, 8192, k)) == (8, 4)
        assert pg.default_shape(_constants(role, 8192, k), n_tiles=1) == (8, 6)
    # An odd number of steps per warp: lane copies, any depth.
    odd = pg.ring_config(4096 + 128, 4, 5, 2)
    assert odd.copy == "lane" and odd.l2_prefetch == pg.LANE_L2_PREFETCH
    # (17 steps a warp: the cap's 5 stages of 8 warps for 16 tokens, not rounded down to pairs)
    assert pg.default_shape(_constants("o_proj", 8192, 4096 + 256), k_warps=8) == (8, 5)
    assert pg.ring_config(4096, 4, 5, 2).copy == "lane"  # an odd depth given: lane copies
    # (lane copies: any depth; 8 warps at K = 4096 fit 5 stages for 16 tokens)
    assert pg.default_shape(_constants("down_proj", 8192, 4096), copy="lane") == (8, 5)
    with pytest.raises(ValueError, match="copy is None"):
        pg.ring_config(4096, 4, 6, 2, copy="tma")
    with pytest.raises(ValueError, match="row copies take two contiguous steps"):
        pg.ring_config(4096, 4, 5, 2, copy="rows")
    with pytest.raises(ValueError, match="copy is the ring main loop's"):
        pg.PackageGemm(_constants("o_proj", 8192, 1024, tile_n=16), torch.zeros(8192, 1024, dtype=torch.bfloat16),
                       copy="rows")
    # x's copies: RING_X_COPY under row copies where x goes through the ring; none with x_regs.
    assert pg.ring_config(4096, 4, 6, 2).x_copy == pg.RING_X_COPY == "rows"
    assert pg.ring_config(4096, 4, 6, 2, x_regs=True).x_copy == "lane"
    assert pg.ring_config(4096, 4, 6, 2, copy="lane").x_copy == "lane"
    with pytest.raises(ValueError, match="x_copy is 'lane', or 'rows' with row copies"):
        sg.SkinnyConfig(4096, 4, 6, 2, x_copy="rows")
    with pytest.raises(ValueError, match="n_tiles 1 or 2"):
        pg.default_shape(_constants("o_proj", 8192, 4096), n_tiles=3)


def test_shape_names_are_reexported():
    """package_gemm re-exports every launch-shape name of package_gemm_shape (the same objects)."""
    from dspark_comm.cutedsl import package_gemm_shape as shape

    for name in shape.__all__:
        assert name in pg.__all__ and getattr(pg, name) is getattr(shape, name), name


def test_policy_shape_by_shard():
    """draft_gemm_shape: the register-direct tile with the role's split_k for
    shards of at most DIRECT_MAX_STEPS steps per warp (o_proj, 4 warps: K <=
    1024; down_proj, 8 warps: K <= 2048), the ring tile above with
    RING_SPLIT_K's split_k (1 up to K = 2048, else 2 where 8 warps' steps
    divide K); a role without a package GEMM is refused."""
    from dspark_core.planner import policy

    assert policy.DIRECT_MAX_STEPS == 8
    assert policy.RING_SPLIT_K == ((2048, 1), (None, 2))
    for k, split in ((1536, 1), (2048, 1), (2560, 2), (4096, 2), (8192, 2), (16384, 2), (2176, 1), (4224, 1)):
        assert policy.ring_split_k(k) == split  # (2176 and 4224: 17 and 33 steps of 128, not of 256)
    for role, last in (("o_proj", 1024), ("down_proj", 2048)):
        base = policy.DRAFT_GEMMS[role]
        assert policy.direct_steps(role, last) == policy.DIRECT_MAX_STEPS
        for k in (512, last):
            shape = policy.draft_gemm_shape(role, k)
            assert (shape.tile_n, shape.split_k, shape.max_rows) == (16, base.split_k, base.max_rows)
        for k in (last + 512, 2 * last, 4096, 8192):
            shape = policy.draft_gemm_shape(role, k)
            assert (shape.tile_n, shape.split_k, shape.max_rows) == (64, policy.ring_split_k(k), base.max_rows)
    with pytest.raises(ValueError, match="not 'qkv_proj'"):
        policy.draft_gemm_shape("qkv_proj", 1024)


# ---------------------------------------------------------------- host (no GPU needed)


def _fake_mailbox(tp: int = 2, hidden: int = 8192, rank: int = 0, capacity: int = 16):
    return types.SimpleNamespace(layout=MailboxLayout(tp, hidden, capacity), rank=rank,
                                 device=torch.device("cpu"), check_open=lambda: None, table=None)


def test_constants_refused_with_sentences():
    w = torch.zeros(8192, 1024, dtype=torch.bfloat16)
    cases = [
        (dict(tile_n=128), "tile_n 64"),
        (dict(hidden_size=8100), r"positive multiple of its tile_n, not 8100 \(tile_n 64\)"),
        (dict(max_rows=17), "1 to 16 rows"),
        (dict(max_rows=0), "1 to 16 rows"),
        (dict(split_k=3), r"\(split_k\), not 3"),
        (dict(k_shard=1000), "positive multiple of 128"),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            pg.PackageGemm(_constants("o_proj", 8192, 1024, **over), w)
    with pytest.raises(ValueError, match="PackageGemmConstants"):
        pg.PackageGemm((8192, 1024), w)
    with pytest.raises(ValueError, match="does not split into"):
        pg.PackageGemm(_constants("down_proj", 8192, 1024), w, k_warps=1)
    with pytest.raises(ValueError, match="stated error bound"):
        pg.PackageGemm(_constants("o_proj", 8192, 2**17), w, k_warps=4, stages=1)


def test_operands_refused_with_sentences():
    c = _constants("o_proj", 8192, 1024)
    with pytest.raises(ValueError, match="contiguous CUDA"):
        pg.PackageGemm(c, torch.zeros(8192, 1024, dtype=torch.bfloat16))  # not on a GPU
    with pytest.raises(ValueError, match="mailbox of 4096 columns"):
        pg.PackageGemm(c, torch.zeros(8192, 1024, dtype=torch.bfloat16), _fake_mailbox(hidden=4096))
    with pytest.raises(ValueError, match="rank 1 given"):
        pg.PackageGemm(c, torch.zeros(8192, 1024, dtype=torch.bfloat16), _fake_mailbox(), rank=1)
    with pytest.raises(ValueError, match="Mailbox"):
        pg.PackageGemm(c, torch.zeros(8192, 1024, dtype=torch.bfloat16), object())
    with pytest.raises(ValueError, match="without a mailbox"):
        pg.PackageGemm(c, torch.zeros(8192, 1024, dtype=torch.bfloat16), None, rank=1)


def _bound_gemm(mailbox=None, max_rows=16):
    """A PackageGemm over a CPU weight (its constructor's CUDA check skipped):
    the row and operand logic of ``takes``/``run`` without a GPU."""
    g = object.__new__(pg.PackageGemm)
    g.constants = _constants("o_proj", 8192, 1024, max_rows=max_rows)
    g.mailbox, g.layout = mailbox, (mailbox.layout if mailbox is not None else None)
    g.device, g.rank = torch.device("cpu"), 0
    return g


def test_takes_and_run_refuse():
    g = _bound_gemm(_fake_mailbox(capacity=8))
    assert g.takes_rows(1) and g.takes_rows(16) and not g.takes_rows(0) and not g.takes_rows(17)
    assert g.takes_rows(8, publish=True) and not g.takes_rows(9, publish=True)
    x = torch.zeros(4, 1024, dtype=torch.bfloat16)
    assert not g.takes(x)  # a CPU tensor
    with pytest.raises(ValueError, match="bf16 \\[m, 1024\\]"):
        g.run(x)
    with pytest.raises(ValueError, match="capacity of 8"):
        g.run(torch.zeros(9, 1024, dtype=torch.bfloat16), publish=True)
    with pytest.raises(ValueError, match="not an output tensor"):
        g.run(x, torch.zeros(4, 8192, dtype=torch.bfloat16), publish=True)
    plain = _bound_gemm(None)
    with pytest.raises(ValueError, match="no mailbox"):
        plain.run(x, publish=True)
    with pytest.raises(ValueError, match="this package GEMM's mailbox"):
        g.run_boundary(x, types.SimpleNamespace(mailbox=None), torch.zeros(4, 8192), True)


def test_kernel_refuses():
    cfg = sg.SkinnyConfig(1024, 4, 2, 2)
    with pytest.raises(ValueError, match="mode"):
        pg.PackageGemmKernel(8192, cfg, "reduce", None, 0, True)
    with pytest.raises(ValueError, match="multiple of 64"):
        pg.PackageGemmKernel(8200, cfg, "plain", None, 0, True)
    with pytest.raises(ValueError, match="MailboxLayout"):
        pg.PackageGemmKernel(8192, cfg, "publish", None, 0, True)
    with pytest.raises(ValueError, match="mailbox of 4096"):
        pg.PackageGemmKernel(8192, cfg, "publish", MailboxLayout(2, 4096, 16), 0, True)
    with pytest.raises(ValueError, match="rank 2"):
        pg.PackageGemmKernel(8192, cfg, "publish", MailboxLayout(2, 8192, 16), 2, True)


# (label, constants, n_tiles, tp, rank, pdl): the early-epochs publish variant
EARLY = [
    ("o_proj-tp2-k1024-nt2", _constants("o_proj", 8192, 1024), 2, 2, 1, True),
    ("o_proj-tp2-k1024-nt1", _constants("o_proj", 8192, 1024), 1, 2, 0, True),
    ("down-tp2-k8192-nt2", _constants("down_proj", 8192, 8192), 2, 2, 0, True),
    ("o_proj-tp4-k2048-nopdl", _constants("o_proj", 8192, 2048), 2, 4, 3, False),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", EARLY, ids=[v[0] for v in EARLY])
def test_early_epochs_are_loaded_before_the_main_loop(arch, variant, tmp_path):
    """``early_epochs``: the same kernel (the whole audit above) with every
    round's epoch load after the PDL wait and before the first MMA, so its
    latency hides behind the main loop."""
    from dspark_cute.runtime.host import compile_ptx

    _, c, nt, tp, rank, pdl = variant
    kw, st = pg.default_shape(c, n_tiles=nt)
    cfg = pg.ring_config(c.k_shard, kw, st, nt)
    kernel = pg.PackageGemmKernel(c.hidden_size, cfg, "publish", MailboxLayout(tp, c.hidden_size, 16), rank, pdl,
                                  early_epochs=True)
    assert kernel.early_epochs
    ptx = compile_ptx(kernel, *pg.fake_args(), arch=arch)
    body = code(ptx)
    audit(body, cfg, "publish", tp, pdl)
    before_mma = body.partition("mma.sync")[0]
    assert count(before_mma, r"\bld\.relaxed\.gpu\.global\.b32") == pg.epilogue_rounds(cfg)
    if pdl:
        assert count(before_mma.partition("griddepcontrol.wait")[2], r"\bld\.relaxed\.gpu") == pg.epilogue_rounds(cfg)
    check_spills(ptx, arch, tmp_path)
    # Plain mode has no epochs: the flag is ignored there.
    assert not pg.PackageGemmKernel(c.hidden_size, cfg, "plain", None, 0, pdl, early_epochs=True).early_epochs


def test_compile_cache_keyed_by_constants(monkeypatch):
    built = []

    def fake_compile(obj, *args, what=None):
        from dspark_cute.runtime.host import assert_not_capturing

        assert_not_capturing(what)
        built.append(obj)
        return object()

    from dspark_cute.runtime import host

    monkeypatch.setattr(host, "compile_kernel", fake_compile)
    monkeypatch.setattr(pg._compile_package_gemm, "cache", {})
    a = _constants("o_proj", 8192, 1024)
    cfg = sg.SkinnyConfig(1024, 4, 4, 2)
    layout = MailboxLayout(2, 8192, 16)
    k1 = pg.compile_package_gemm(a, cfg, "plain", None, 0, True)
    k2 = pg.compile_package_gemm(_constants("o_proj", 8192, 1024), cfg, "plain", None, 0, True)
    assert k1 is k2 and len(built) == 1
    pg.compile_package_gemm(a, cfg, "publish", layout, 0, True)
    pg.compile_package_gemm(a, cfg, "publish", layout, 1, True)
    pg.compile_package_gemm(_constants("o_proj", 8192, 1024, max_rows=8), cfg, "plain", None, 0, True)
    assert len(built) == 4
    pg.compile_package_gemm(a, cfg, "publish", layout, 0, True, early_epochs=True)  # its own variant
    pg.compile_package_gemm(a, cfg, "plain", None, 0, True, early_epochs=True)  # plain: the same kernel
    assert len(built) == 5 and built[-1].early_epochs
    # During CUDA graph capture a new variant is refused (prepare() first).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="prepare"):
        pg.compile_package_gemm(a, cfg, "plain", None, 0, False)
    assert pg.compile_package_gemm(a, cfg, "plain", None, 0, True) is k1  # compiled ones still serve


def test_error_bound_is_the_skinny_gemms():
    assert pg.error_bound is sg.output_error_bound
    assert pg.projection_error_bound is sg.projection_error_bound
