"""CPU tests of the QKV front (``dspark_cute.cutedsl.qkv.front``) and its skinny GEMM
main loop (``dspark_cute.cutedsl.gemm.skinny.config``):

- the main loop's index maps, emulated: every thread's 16-byte copies,
  fragments, MMAs (the PTX ISA's m16n8k16 fragment layouts, written out here
  independently), partials and their fold give exactly ``x @ W^T`` on
  integer data, and each weight element is copied exactly once;
- compiles for sm_90a and sm_100a of the production variants (m <= 8 and
  m <= 16, with and without a q-norm weight, RoPE with a BF16 or FP32 table
  or none, PDL or not), the raw projection variant and other main-loop
  shapes, with a PTX audit: no ``fma`` anywhere (the tensor-core MMAs are
  the main loop's only multiply-adds; the norm and RoPE epilogue is
  ``*.rn.f32`` arithmetic only), every FP32 add/sub/mul/div with ``.rn``, no
  ``.ftz``/approximations/local memory; the weight streamed with 16-byte
  ``cp.async`` copies (count = steps x 8 per thread), x likewise; the MMA
  count; per head norm 5 butterflies, 2 divisions and 1 square root; the
  PDL wait after exactly the weight prologue's copies and before any x copy
  or global load;
- the host-side operand checks and the error-bound helper.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from ptx_audit import count
from skinny_emulation import emulated_lane_words, mma_emulated

from dspark_core.contracts.constants import QKVFrontConstants
from dspark_cute.cutedsl.gemm.skinny import config as sg

ARCHS = ["sm_90a", "sm_100a"]


# ---------------------------------------------------------------- index-map emulation


def emulate_tile(cfg: sg.SkinnyConfig, w: np.ndarray, x: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile's sums ``[8 n_tiles, 64]`` as the kernel's index maps compute
    them (exact on integer data), and how often each weight element is copied."""
    copies = np.zeros(w.shape, dtype=np.int64)
    red = np.full(cfg.k_warps * sg.MAX_TOKENS * sg.RED_STRIDE, np.nan)
    for warp in range(cfg.k_warps):
        acc = {(i, nt): np.zeros((32, 4)) for i in range(sg.MMA_TILES) for nt in range(cfg.n_tiles)}
        for s in range(cfg.steps):
            lane_words = emulated_lane_words(cfg, w, x, m, warp, s, copies=copies)
            for half in range(2):
                for i in range(sg.MMA_TILES):
                    for nt in range(cfg.n_tiles):
                        a = [sg.a_fragment(lw, i, half) for lw in lane_words]
                        b = [sg.b_fragment(lw, nt, half) for lw in lane_words]
                        acc[i, nt] += mma_emulated(a, b)
        for lane in range(32):
            for (i, nt), v in acc.items():
                for reg in range(4):
                    row, tok = sg.acc_coords(lane, i, nt, reg)
                    red[sg.red_offset(warp, tok, row)] = v[lane, reg]
    out = np.zeros((8 * cfg.n_tiles, sg.TILE_ROWS))
    for tok in range(8 * cfg.n_tiles):
        for lane in range(32):
            for e in range(2):
                parts = [red[sg.red_offset(wp, tok, 2 * lane + e)] for wp in range(cfg.k_warps)]
                while len(parts) > 1:
                    h = len(parts) // 2
                    parts = [parts[j] + parts[j + h] for j in range(h)]
                out[tok, 2 * lane + e] = parts[0]
    return out, copies


@pytest.mark.parametrize(
    "k,k_warps,n_tiles,m",
    [(512, 1, 1, 1), (512, 2, 1, 3), (512, 4, 2, 16), (512, 8, 2, 9), (512, 16, 1, 8), (1024, 8, 1, 5)],
)
def test_index_maps_give_the_product(k, k_warps, n_tiles, m):
    rng = np.random.default_rng(k + 7 * k_warps + 31 * m)
    cfg = sg.SkinnyConfig(k=k, k_warps=k_warps, stages=1, n_tiles=n_tiles)
    w = rng.integers(-8, 9, size=(sg.TILE_ROWS, k)).astype(np.float64)
    x = rng.integers(-8, 9, size=(m, k)).astype(np.float64)
    out, copies = emulate_tile(cfg, w, x, m)
    assert (copies == 1).all(), "a weight element copied other than once"
    np.testing.assert_array_equal(out[:m], x @ w.T)


def test_skinny_config_refuses():
    for kwargs in ({"k": 8192, "k_warps": 3}, {"k": 100}, {"k": 8192, "n_tiles": 3},
                   {"k": 256, "k_warps": 8, "stages": 2}, {"k": 2**17, "k_warps": 8},
                   {"k": 256, "copy": "tma"}, {"k": 256, "l2_prefetch": 512}):
        with pytest.raises(ValueError):
            sg.SkinnyConfig(**kwargs)


def test_error_bound_formula():
    """The bound of the docstring: K = 8192, 8 warps: (64 * 2^-18 + 3 * 2^-24)(1 + 2^-9) T."""
    x = torch.ones(1, 8192, dtype=torch.bfloat16)
    w = torch.full((2, 8192), -0.5, dtype=torch.bfloat16)
    e = sg.projection_error_bound(x, w, 8)
    expected = (64 * 2.0**-18 + 3 * 2.0**-24) * (1 + 2.0**-9) * 4096 + 8192 * 2.0**-125
    assert torch.allclose(e, torch.full((1, 2), expected, dtype=torch.float64), rtol=1e-15, atol=0)
    out = torch.tensor([[3.0, -1.0]], dtype=torch.bfloat16)
    b = sg.output_error_bound(out, x, w, 8)
    assert math.isclose(b[0, 0].item(), expected + 3 * 2.0**-8 + 2.0**-134, rel_tol=1e-15)


# ---------------------------------------------------------------- compiles and the PTX audit

REF = QKVFrontConstants(hidden_size=8192, num_heads=64, kv_heads=8, q_weight=True, q_eps=1e-6, k_eps=1e-6,
                        rope=True, table_dtype="bf16")
SMALL = QKVFrontConstants(hidden_size=2048, num_heads=8, kv_heads=1, q_weight=False, q_eps=1e-5, k_eps=0.1,
                          rope=True, table_dtype="fp32")
NOROPE = QKVFrontConstants(hidden_size=4096, num_heads=4, kv_heads=2, q_weight=True, q_eps=1e-6, k_eps=1e-6,
                           rope=False, table_dtype="bf16")
# (constants, k_warps, stages, n_tiles, raw, pdl)
VARIANTS = [
    (REF, 8, 2, 1, False, True),
    (REF, 8, 2, 2, False, True),
    (REF, 8, 2, 2, True, True),
    (REF, 8, 2, 2, False, False),
    (REF, 4, 4, 2, False, True),
    (SMALL, 8, 2, 1, False, True),
    (SMALL, 8, 2, 2, True, False),
    (NOROPE, 8, 2, 2, False, True),
    (NOROPE, 16, 1, 1, False, True),
]


def _name(v) -> str:
    c, kw, st, nt, raw, pdl = v
    return f"H{c.hidden_size}-h{c.num_heads}-kv{c.kv_heads}-kw{kw}-st{st}-nt{nt}{'-raw' if raw else ''}" \
        f"{'-pdl' if pdl else ''}{'-qw' if c.q_weight else ''}-{c.table_dtype if c.rope else 'norope'}"


def audit(body: str, c: QKVFrontConstants, cfg: sg.SkinnyConfig, raw: bool, pdl: bool) -> None:
    assert not re.search(r"\bfma\b|\bfma\.", body), "an FMA (the MMAs are the only multiply-adds)"
    assert ".ftz" not in body, "a flush-to-zero instruction"
    assert not re.search(r"rsqrt|\.approx|rcp\.", body), "an approximate instruction"
    assert not re.search(r"\b(ld|st)\.local", body), "local memory (register spills)"
    for op in re.findall(r"\b(?:add|sub|mul|div)(?:\.\w+)*\.f32\b", body):
        assert ".rn." in op, f"an FP32 operation without an explicit rounding: {op}"
    copies = re.findall(r"\bcp\.async[.\w:]*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(\d+);", body)
    assert copies and all(size == "16" for size in copies), "a cp.async other than 16 bytes"
    assert all("cp.async.cg.shared.global.L2::256B" in line for line in body.splitlines() if "cp.async.c" in line
               and "commit" not in line)
    assert len(copies) == cfg.steps * cfg.loads
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == (
        cfg.steps * 2 * sg.MMA_TILES * cfg.n_tiles)
    assert count(body, r"\bld\.shared\.v4\.b32") == cfg.steps * cfg.loads
    assert count(body, r"\bbar\.sync\b") == 2
    rounds = -(-8 * cfg.n_tiles // cfg.k_warps)
    norms = 0 if raw else 2 * rounds  # a q and a k branch per round
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 5 * norms
    assert count(body, r"\bdiv\.rn\.f32") == 2 * norms
    assert count(body, r"\bsqrt\.rn\.f32") == norms
    # Global loads happen only in the epilogue: the positions and slots, the
    # q-norm weight and the RoPE table.
    loads = re.findall(r"\bld\.global[.\w]*", body)
    assert set(loads) <= {"ld.global.s64", "ld.global.b32", "ld.global.b16"}, set(loads)
    if raw:
        assert not loads
    stores = re.findall(r"\bst\.global[.\w]*", body)
    assert set(stores) == {"st.global.b32"}
    assert len(stores) == rounds * (1 if raw else 5)  # q, k + K insert, o-gate/v + V insert
    if pdl:
        head, sep, tail = body.partition("griddepcontrol.wait")
        assert sep, "no PDL wait"
        assert count(head, r"\bcp\.async\.cg") == sg.W_LOADS * cfg.stages, "not exactly the weight prologue"
        assert "ld.global" not in head and "commit_group" not in head
        # The next grid is released after the main loop (after the last MMA),
        # before the epilogue's barriers.
        _, sep, after = tail.rpartition("mma.sync")
        assert sep and "griddepcontrol.launch_dependents" in after.partition("bar.sync")[0]
    else:
        assert "griddepcontrol" not in body


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_qkv_front_compiles(arch, variant):
    from dspark_cute.cutedsl.qkv.front import QKVFrontKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c, kw, st, nt, raw, pdl = variant
    cfg = sg.SkinnyConfig(c.hidden_size, kw, st, nt)
    ptx = compile_ptx(QKVFrontKernel(c, cfg, raw, pdl), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    body = "\n".join(line.split("//")[0] for line in ptx.splitlines())
    audit(body, c, cfg, raw, pdl)
    if c.rope and not raw:
        # The table's cos/sin loads: 16-bit for BF16, 32-bit for FP32.
        width = "b16" if c.table_dtype == "bf16" else "b32"
        assert count(body, rf"\bld\.global\.{width}\b") >= 4


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_tiles", [1, 2])
def test_qkv_front_row_copies_compile(arch, n_tiles):
    """Row copies (``SkinnyConfig.copy`` "rows"): the same audit (MMAs,
    epilogue, 16-byte copies), plus the warp's two meetings a pair of steps."""
    from dspark_cute.cutedsl.qkv.front import QKVFrontKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    cfg = sg.SkinnyConfig(REF.hidden_size, 4, 4, n_tiles, copy="rows")
    ptx = compile_ptx(QKVFrontKernel(REF, cfg, False, True), *fake_args(REF), arch=arch)
    body = "\n".join(line.split("//")[0] for line in ptx.splitlines())
    audit(body, REF, cfg, False, True)
    assert count(body, r"\bbar\.warp\.sync\b") == cfg.steps


# ---------------------------------------------------------------- host checks (no GPU needed)


@pytest.mark.parametrize("extra", [{"x_regs": True}])
def test_front_refuses_the_package_gemm_loop_options(extra):
    """x through registers is the package GEMM's; the front's kernel (ring
    main loop, head epilogue) refuses it rather than ignore it."""
    from dspark_cute.cutedsl.qkv.front import QKVFrontKernel

    cfg = sg.SkinnyConfig(REF.hidden_size, 8, 2, 2, **extra)
    with pytest.raises(ValueError, match="the package GEMM's"):
        QKVFrontKernel(REF, cfg, False, True)


def test_host_refuses_bad_operands():
    from dspark_cute.cutedsl.qkv.front import QKVFront

    w = torch.zeros((REF.num_heads * 2 + REF.kv_heads * 2) * 64, REF.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous CUDA"):
        QKVFront(REF, w, torch.ones(64, dtype=torch.bfloat16), None)  # not on a GPU
    with pytest.raises(ValueError, match="QKVFrontConstants"):
        QKVFront(REF.hidden_size, w)
    bad_kv = QKVFrontConstants(8192, 64, 3, True, 1e-6, 1e-6, True, "bf16")
    with pytest.raises(ValueError, match="KV heads"):
        QKVFront(bad_kv, w)
    bad_h = QKVFrontConstants(1000, 64, 8, True, 1e-6, 1e-6, True, "bf16")
    with pytest.raises(ValueError, match="positive multiple of 128"):
        QKVFront(bad_h, w)
    bad_table = QKVFrontConstants(8192, 64, 8, True, 1e-6, 1e-6, True, "fp16")
    with pytest.raises(ValueError, match="RoPE table"):
        QKVFront(bad_table, w)
