"""CPU tests of the package GEMM's one-row path (``dspark_comm.cutedsl.package_gemv``,
``PackageGemm(one_row_gemv=True)``; its GPU checks are in the two-GPU suite,
passed on two H200s): compiles for sm_90a and sm_100a, plain and publishing, with and
without PDL, at TP2 and TP8, with a PTX audit (the GEMV's instruction counts:
no ``fma``; the stores, one word per row pair, ``tp`` relaxed system-scope
stores to publish; the weight prologue before the PDL wait, x and the epoch
after it, the dependents released after the last product; no spills); the
epilogue's columns cover N once and land in slot (epoch, rank, row 0) of the
mailbox layout; the refusals.
"""

from __future__ import annotations

import pytest
import torch
from ptx_audit import code, count, ptxas_report, spill_bytes

from dspark_comm.cutedsl import package_gemm as pg
from dspark_comm.cutedsl import package_gemv as pv
from dspark_comm.protocol import MailboxLayout
from dspark_core.contracts.constants import PackageGemmConstants
from dspark_cute.cutedsl.gemm import gemv as gv

ARCHS = ["sm_90a", "sm_100a"]
NC_LOAD = r"\bld\.global\.nc\.L1::no_allocate\.v4\.b32\b"
NA_LOAD = r"\bld\.global\.L1::no_allocate\.v4\.b32\b"  # the weight loads before a PDL wait (kept there)
W_LOAD = r"\bld\.global(?:\.nc)?\.L1::no_allocate\.v4\.b32\b"
X_LOAD = r"\bld\.global\.v4\.b32\b"


def _constants(n: int, k: int) -> PackageGemmConstants:
    return PackageGemmConstants("o_proj", n, k, 64, 1, 16)


# (id, N, K, mode, tp, rank, pdl)
VARIANTS = [
    ("k4096-pub-tp2", 8192, 4096, "publish", 2, 1, True),
    ("k4096-plain", 8192, 4096, "plain", 2, 0, True),
    ("k8192-pub-tp2-nopdl", 8192, 8192, "publish", 2, 0, False),
    ("k1024-pub-tp8", 2048, 1024, "publish", 8, 5, True),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_one_row_gemv_compiles(arch, variant, tmp_path):
    from dspark_cute.runtime.host import compile_ptx

    _, n, k, mode, tp, rank, pdl = variant
    c = _constants(n, k)
    layout = MailboxLayout(tp, n, 16) if mode == "publish" else None
    kernel = pv.PackageGemvKernel(pv.one_row_constants(c), mode, layout, rank, pdl)
    ptx = compile_ptx(kernel, *pv.fake_args(), arch=arch)
    body = code(ptx)
    frags, rows = k // 256, gv.ROWS_PER_WARP
    assert f".target {arch}" in body and f".reqntid {gv.THREADS}, 1, 1" in body
    assert count(body, r"\bfma\b|\.ftz\b|\.local\b|mma\.sync|cp\.async") == 0
    assert count(body, W_LOAD) == rows * frags
    assert count(body, X_LOAD) == frags
    assert count(body, r"\bmul\.rn\.f32\b") == rows * 8 * frags
    assert count(body, r"\badd\.rn\.f32\b") == rows * (7 * frags + frags - 1 + 5)
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == rows // 2
    if mode == "publish":
        assert count(body, r"\bst\.relaxed\.sys\.global\.b32\b") == rows // 2 * tp
        assert count(body, r"\bst\.global\.b32\b") == 0
        assert count(body, r"\bld\.relaxed\.gpu\.global\.b32\b") == 1  # row 0's epoch
    else:
        assert count(body, r"\bst\.global\.b32\b") == rows // 2
        assert "st.relaxed" not in body and "ld.relaxed" not in body
    if pdl:
        wait = body.index("griddepcontrol.wait")
        launch = body.index("griddepcontrol.launch_dependents")
        assert count(body[:wait], NA_LOAD) == count(body, NA_LOAD) == rows * min(gv.DEPTH, frags)
        assert count(body[:wait], NC_LOAD) == 0
        assert count(body[:wait], X_LOAD) == 0 and "ld.relaxed" not in body[:wait]
        last_product = body.rindex("mul.rn.f32")
        assert wait < last_product < launch  # released after the main loop
    else:
        assert "griddepcontrol" not in body
    report = ptxas_report(ptx, arch, tmp_path)
    if report and arch == "sm_90a" and tp <= 4:
        # (At TP8, CuTe DSL 4.8's PTX makes ptxas spill 12 bytes: eight peers' addresses
        # and stores per row pair; 4.3.5's does not. TP8 is compile-checked only.)
        assert spill_bytes(report) == 0, report


@pytest.mark.parametrize("n, rows", [(8192, 2), (2048, 4), (4096, 8)])
def test_the_epilogue_covers_every_column_once_in_row_0s_slot(n, rows):
    cols = pv.published_columns(n, rows)
    assert sorted(cols) == list(range(0, n, 2))
    layout = MailboxLayout(2, n, 16)
    for epoch in range(3):
        for src in range(2):
            for col in cols[:: max(1, len(cols) // 17)]:
                assert pg.publish_offset(layout, epoch, src, 0, col) == layout.slot_offset(epoch, src, 0) + 2 * col


def test_refusals():
    assert pv.one_row_unsupported(_constants(8192, 4096), torch.zeros(8192, 4096, dtype=torch.bfloat16)) is None
    why = pv.one_row_unsupported(_constants(8192, 1000), torch.zeros(8192, 1000, dtype=torch.bfloat16))
    assert why is not None and "256" in why
    why = pv.one_row_unsupported(_constants(8200, 1024), torch.zeros(8200, 1024, dtype=torch.bfloat16))
    assert why is not None and "16" in why
    g = pv.one_row_constants(_constants(8192, 4096))
    assert (g.n, g.k, g.role) == (8192, 4096, "o_proj")
    with pytest.raises(ValueError, match="MailboxLayout"):
        pv.PackageGemvKernel(g, "publish", None, 0, True)
    with pytest.raises(ValueError, match="mailbox of 4096 columns"):
        pv.PackageGemvKernel(g, "publish", MailboxLayout(2, 4096, 16), 0, True)
    with pytest.raises(ValueError, match="outside a TP group of 2"):
        pv.PackageGemvKernel(g, "publish", MailboxLayout(2, 8192, 16), 2, True)
    with pytest.raises(ValueError, match="mode is one of"):
        pv.PackageGemvKernel(g, "scatter", None, 0, True)
    with pytest.raises(ValueError, match="CUDA"):  # the host class checks its weight first
        pg.PackageGemm(_constants(8192, 4096), torch.zeros(8192, 4096, dtype=torch.bfloat16), one_row_gemv=True)


@pytest.mark.compile
def test_one_row_gemv_weight_loads_stay_before_the_wait_in_the_machine_code(tmp_path):
    """What ptxas keeps before the PDL wait (``ACQBULK``): the first fragments'
    weight loads, coherent (``LDG.E.NA.128``: ``dspark_cute.ptx.weight_first``;
    non-coherent ones it moved after the wait, dspark-cute's ``test_sass_pdl.py``)."""
    from ptx_audit import census_or_skip, ops_like

    from dspark_cute.runtime.host import compile_ptx

    n, k = 8192, 4096
    kernel = pv.PackageGemvKernel(pv.one_row_constants(_constants(n, k)), "publish", MailboxLayout(2, n, 16), 1, True)
    before, after = census_or_skip(compile_ptx(kernel, *pv.fake_args(), arch="sm_90a"), "sm_90a", tmp_path)
    assert before.get("LDG.E.NA.128", 0) == gv.ROWS_PER_WARP * min(gv.DEPTH, k // 256)
    assert after.get("LDG.E.NA.128", 0) == 0 and ops_like(before, "STG") == 0
