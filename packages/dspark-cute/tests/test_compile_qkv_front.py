"""CPU tests of the QKV front (``dspark_cute.cutedsl.qkv.front``) and its skinny GEMM
main loop (``dspark_cute.cutedsl.gemm.skinny.config``):

- the main loop's index maps, emulated: every thread's 16-byte copies,
  fragments, MMAs (the PTX ISA's m16n8k16 fragment layouts, written out here
  independently), partials and their fold give exactly ``x @ W^T`` on
  integer data, and each weight element is copied exactly once;
- compiles for sm_90a and sm_100a of the production variants (m <= 8 and
  m <= 16: one and two token tiles; which rows launch which is checked
  too), 1 to 32 KV heads (powers of two), RoPE with a BF16 or FP32 table or
  none, one eps or a q and a k eps, PDL or not, the raw projection variant
  and other main-loop shapes, with a PTX audit: per epilogue round one
  vLLM fused QK-norm read back from the PTX's dataflow
  (``audit_head_norms``: the gather of the 4 words of the stock lane, the
  chain of 8 ``fma.rn.f32`` squares in element order, the butterfly xor 16,
  8, 4, ``fma(S, 1/64, eps)``, ``rsqrt.approx.f32``, the RoPE fma pattern);
  beside the MMAs no multiply-add but those (``9 + 2`` per round with RoPE,
  9 without), no other FP32 arithmetic than ``.rn`` add/mul/fma, no
  ``.ftz``, ``sqrt``, ``div``, ``rcp``, local memory or (ptxas) spills; the
  weight streamed with 16-byte ``cp.async`` copies (count = steps x 8 per
  thread), x likewise; the MMA count; the PDL wait after exactly the weight
  prologue's copies and before any x copy or global load;
- the host-side operand checks and the error-bound helper.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import qkv_ptx
import torch
from ptx_audit import code, count
from skinny_emulation import emulated_lane_words, mma_emulated
from test_compile_qkv_epilogue import assert_no_spills, f32_hex

from dspark_core.contracts.constants import QKVFrontConstants
from dspark_core.errors import Unsupported
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


def constants(kv: int, table: str | None, heads: int, hidden: int = 8192, q_eps: float = 1e-6,
              k_eps: float = 1e-6) -> QKVFrontConstants:
    return QKVFrontConstants(hidden_size=hidden, num_heads=heads, kv_heads=kv, q_weight=False, q_eps=q_eps,
                             k_eps=k_eps, rope=table is not None, table_dtype=table or "bf16")


REF = constants(8, "fp32", 64)
# (constants, k_warps, stages, n_tiles, raw, pdl): the production shape (4 warps, 4 stages) for
# m <= 8 (one token tile) and m <= 16 (two); every KV count, both tables and none; two eps.
VARIANTS = [
    (REF, 4, 4, 1, False, True),
    (REF, 4, 4, 2, False, True),
    (REF, 4, 4, 2, True, True),
    (constants(8, "bf16", 64, q_eps=1e-5, k_eps=0.0), 4, 4, 1, False, False),
    (constants(1, "fp32", 8, hidden=2048, k_eps=0.1), 8, 2, 2, False, True),
    (constants(1, "fp32", 8, hidden=2048, k_eps=0.1), 8, 2, 2, True, False),
    (constants(2, "bf16", 4, hidden=4096), 4, 4, 2, False, True),
    (constants(4, None, 4, hidden=4096), 16, 1, 1, False, True),
    (constants(16, "bf16", 32, hidden=2048), 8, 2, 1, False, True),
    (constants(32, None, 32, hidden=2048), 4, 4, 2, False, False),
]


def _name(v) -> str:
    c, kw, st, nt, raw, pdl = v
    eps = "" if c.q_eps == c.k_eps else f"-eps{c.q_eps:g}-{c.k_eps:g}"
    return f"H{c.hidden_size}-h{c.num_heads}-kv{c.kv_heads}-kw{kw}-st{st}-nt{nt}{'-raw' if raw else ''}" \
        f"{'-pdl' if pdl else ''}-{c.table_dtype if c.rope else 'norope'}{eps}"


def audit_head_norms(body: str, c: QKVFrontConstants, rounds: int) -> None:
    """vLLM's fused QK-norm in the pair layout, read from the PTX's dataflow
    (``qkv_ptx``), once per epilogue round: the lane's packed pair word
    gathered from lanes ``(lane & 28) | i``, i = 0 .. 3 (``shfl.sync.idx``),
    the chain of 8 ``fma.rn.f32`` squares over their halves in element order
    from +0.0, the butterfly xor 16, 8, 4, ``fma(S, 1/64, eps)``,
    ``rsqrt.approx.f32``, the lane's own pair times ``r``, with RoPE
    ``fma(c, x, -(s * y))`` and ``fma(s, x, c * y)``, packed once (``x'``
    low, ``y'`` high)."""
    from qkv_ptx import ONE_64TH, normed_pairs, packed, rotation

    norms = qkv_ptx.head_norms(body)
    assert len(norms) == rounds, f"{len(norms)} head norms in {rounds} rounds"
    for n in norms:
        flow = n.flow
        assert len(n.chain) == 8, f"a chain of {len(n.chain)} squares"
        gathered = [n.elements[2 * i][1] for i in range(4)]
        assert n.elements == [(h, w) for w in gathered for h in ("lo", "hi")], n.elements
        shuffles = [flow.op(w) for w in gathered]
        assert all(s and s[0] == "shfl.sync.idx.b32" for s in shuffles), shuffles
        own = shuffles[0][1][0]
        assert all(s[1][0] == own for s in shuffles), "the gathered words are not one register's"
        for i, s in enumerate(shuffles):
            lane = flow.op(s[1][1])
            assert lane and (lane[0], lane[1][1]) == (("and.b32", "28") if i == 0 else ("or.b32", str(i))), lane
        assert n.offsets == [16, 8, 4]
        assert n.scale == ONE_64TH
        if c.q_eps == c.k_eps:
            assert n.eps == ("const", f32_hex(c.q_eps)), n.eps
        else:
            assert n.eps[0] == "selp" and set(n.eps[1:]) == {f32_hex(c.q_eps), f32_hex(c.k_eps)}, n.eps
        pairs = normed_pairs(n)
        assert len(pairs) == 1 and len(n.normed) == 2, n.normed
        x, y = pairs[0]
        assert x and y and {h[1] for h in (qkv_ptx.half(flow, src) for src, _ in n.normed)} == {own}, \
            "r does not scale the lane's own pair"
        if c.rope:
            rot = rotation(n, x, y)
            assert rot and rot[0] != rot[1], "not fma(c, x, -(s * y)), fma(s, x, c * y)"
            x, y = rot[2:]
        assert len(packed(flow, x, y)) == 1, "the pair not packed once"


def audit(body: str, c: QKVFrontConstants, cfg: sg.SkinnyConfig, raw: bool, pdl: bool) -> None:
    rounds = -(-8 * cfg.n_tiles // cfg.k_warps)
    norms = 0 if raw else rounds  # one q/k branch per round
    # The MMAs aside, the only multiply-adds are the norm's and RoPE's fma.rn.f32.
    assert count(body, r"\bfma\b|\bfma\.") == count(body, r"\bfma\.rn\.f32") == norms * (9 + (2 if c.rope else 0))
    assert ".ftz" not in body, "a flush-to-zero instruction"
    assert count(body, r"\brsqrt\.approx\.f32") == norms
    assert not re.search(r"\bsqrt\.|\bdiv\.(rn|full|approx)|\brcp\.|\bex2\.|\blg2\.", body)
    assert not re.search(r"\b(ld|st)\.local", body), "local memory (register spills)"
    for op in re.findall(r"\b(?:add|sub|mul|div|fma|min|max)(?:\.\w+)*\.f32\b", body):
        assert op in ("add.rn.f32", "mul.rn.f32", "fma.rn.f32"), f"an FP32 operation other than .rn: {op}"
    copies = re.findall(r"\bcp\.async[.\w:]*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(\d+);", body)
    assert copies and all(size == "16" for size in copies), "a cp.async other than 16 bytes"
    assert all("cp.async.cg.shared.global.L2::256B" in line for line in body.splitlines() if "cp.async.c" in line
               and "commit" not in line)
    assert len(copies) == cfg.steps * cfg.loads
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == (
        cfg.steps * 2 * sg.MMA_TILES * cfg.n_tiles)
    assert count(body, r"\bld\.shared\.v4\.b32") == cfg.steps * cfg.loads
    assert count(body, r"\bbar\.sync\b") == 2
    assert count(body, r"\bshfl\.sync\.bfly\.b32") == 3 * norms
    # The gathers: shfl.sync.idx with a lane register (make_warp_uniform's broadcasts take lane 0).
    assert count(body, r"\bshfl\.sync\.idx\.b32\s+%r\d+,\s*%r\d+,\s*%r\d+") == 4 * norms
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32") == rounds + norms
    if not raw:
        audit_head_norms(body, c, rounds)
    # Global loads happen only in the epilogue: the positions and slots and the RoPE table.
    loads = re.findall(r"\bld\.global[.\w]*", body)
    assert set(loads) <= {"ld.global.s64", "ld.global.b32", "ld.global.b16"}, set(loads)
    if raw:
        assert not loads
    elif c.rope:
        width = "b16" if c.table_dtype == "bf16" else "b32"
        assert count(body, rf"\bld\.global\.{width}\b") == 2 * rounds  # cos and sin of the lane's pair
        assert "ld.global.b16" not in body or width == "b16"
    else:
        assert not re.search(r"\bld\.global\.b(16|32)\b", body)
    stores = re.findall(r"\bst\.global[.\w]*", body)
    assert set(stores) == {"st.global.b32"}
    assert len(stores) == rounds * (1 if raw else 4)  # q or k, K insert, o-gate or v, V insert
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
def test_qkv_front_compiles(arch, variant, tmp_path):
    from dspark_cute.cutedsl.qkv.front import QKVFrontKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    c, kw, st, nt, raw, pdl = variant
    cfg = sg.SkinnyConfig(c.hidden_size, kw, st, nt)
    ptx = compile_ptx(QKVFrontKernel(c, cfg, raw, pdl), *fake_args(c), arch=arch)
    assert f".target {arch}" in ptx
    audit(code(ptx), c, cfg, raw, pdl)
    assert_no_spills(ptx, arch, tmp_path, _name(variant))


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
    body = code(ptx)
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
    from dspark_cute.cutedsl.qkv.front import QKVFront, QKVFrontKernel

    w = torch.zeros((REF.num_heads * 2 + REF.kv_heads * 2) * 64, REF.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous CUDA"):
        QKVFront(REF, w, None, None)  # not on a GPU
    with pytest.raises(ValueError, match="QKVFrontConstants"):
        QKVFront(REF.hidden_size, w)
    bad_kv = QKVFrontConstants(8192, 64, 3, False, 1e-6, 1e-6, True, "bf16")
    with pytest.raises(Unsupported, match="KV heads"):
        QKVFront(bad_kv, w)
    bad_h = QKVFrontConstants(1000, 64, 8, False, 1e-6, 1e-6, True, "bf16")
    with pytest.raises(ValueError, match="positive multiple of 128"):
        QKVFront(bad_h, w)
    bad_table = QKVFrontConstants(8192, 64, 8, False, 1e-6, 1e-6, True, "fp16")
    with pytest.raises(Unsupported, match="RoPE table"):
        QKVFront(bad_table, w)
    weighted = QKVFrontConstants(8192, 64, 8, True, 1e-6, 1e-6, True, "fp32")
    with pytest.raises(Unsupported, match="weightless"):
        QKVFront(weighted, w)
    with pytest.raises(Unsupported, match="weightless"):
        QKVFrontKernel(weighted, sg.SkinnyConfig(8192, 4, 4, 1), False, True)


def test_rows_pick_their_token_tiles(monkeypatch):
    """Rows 1 .. 8 launch the one-tile variant, 9 .. 16 the two-tile one
    (the two compiled row variants; the CUDA operands are not needed)."""
    from dspark_cute.cutedsl.qkv import front as qf

    f = qf.QKVFront.__new__(qf.QKVFront)
    f.constants, f.pdl = REF, True
    f.configs = {nt: sg.SkinnyConfig(REF.hidden_size, 4, 4, nt) for nt in (1, 2)}
    asked = []
    monkeypatch.setattr(qf, "compile_qkv_front", lambda c, cfg, raw, pdl: asked.append((cfg.n_tiles, raw)))
    for m in range(1, 17):
        f._kernel(m)
    assert asked == [(1, False)] * 8 + [(2, False)] * 8
