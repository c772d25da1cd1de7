"""CPU tests of the one-token GEMV (``dspark_cute.cutedsl.gemm.gemv``): compiles for sm_90a
and sm_100a without a GPU of the reference draft's four projections (and a
small shape, other launch settings, with and without PDL), with a PTX audit:
no ``fma`` (every product ``mul.rn.f32``, every sum ``add.rn.f32``), no
``.ftz``, no local memory; the weight streamed with exactly ``K/256 *
rows_per_warp`` 16-byte loads per thread (non-coherent, but the first
``depth`` fragments' under PDL: coherent, so that ptxas keeps them before the
wait, ``test_sass_pdl.py``), x with ``K/256`` 16-byte loads; the PDL wait
after exactly the first ``depth`` fragments' weight loads and before any x
load, the dependents released right after it;
the arithmetic counts of the stated order; plus the host-side checks."""

from __future__ import annotations

import re

import pytest
import torch
from ptx_audit import code, count, ptxas_report, spill_bytes

from dspark_core.contracts.constants import GemvConstants, gemv_constants

ARCHS = ["sm_90a", "sm_100a"]
SHAPES = {"qkv_proj": (9216, 8192), "o_proj": (8192, 4096), "gate_up": (32768, 8192), "down": (8192, 16384),
          "small": (16, 256)}
NC_LOAD = r"\bld\.global\.nc\.L1::no_allocate\.v4\.b32\b"
NA_LOAD = r"\bld\.global\.L1::no_allocate\.v4\.b32\b"  # the weight loads before a PDL wait (kept there)
W_LOAD = r"\bld\.global(?:\.nc)?\.L1::no_allocate\.v4\.b32\b"
X_LOAD = r"\bld\.global\.v4\.b32\b"


def _ptx(constants, pdl, arch, rows=2, depth=4):
    from dspark_cute.cutedsl.gemm.gemv import GemvKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    return compile_ptx(GemvKernel(constants, pdl, rows, depth), *fake_args(), arch=arch)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("role", list(SHAPES))
def test_gemv_compiles_in_its_stated_order(arch, role, tmp_path):
    n, k = SHAPES[role]
    frags = k // 256
    ptx = _ptx(GemvConstants(role, n, k), True, arch)
    body = code(ptx)
    assert f".target {arch}" in body
    assert ".reqntid 256, 1, 1" in body
    assert not re.search(r"\bfma\b|\.ftz\b|\.approx\b|\.local\b", body)
    assert count(body, W_LOAD) == 2 * frags
    assert count(body, X_LOAD) == frags
    # Step 1: 8 products per fragment and row; steps 2-4: 7 per fragment,
    # frags - 1 along the lane's chain, 5 in the butterfly, per row.
    assert count(body, r"\bmul\.rn\.f32\b") == 2 * 8 * frags
    assert count(body, r"\badd\.rn\.f32\b") == 2 * (7 * frags + frags - 1 + 5)
    assert count(body, r"\bshfl\.sync\.bfly\.b32\b") == 2 * 5
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == 1
    assert count(body, r"\bst\.global\.b32\b") == 1
    assert count(body, r"\bbar\.sync\b") == 0
    # PDL: the first 4 fragments' weight loads (two rows each) before the
    # wait, x after it, the dependents released right after the wait.
    wait = body.index("griddepcontrol.wait")
    launch = body.index("griddepcontrol.launch_dependents")
    assert count(body, r"\bgriddepcontrol\.wait\b") == 1 and wait < launch
    assert count(body[:wait], NA_LOAD) == count(body, NA_LOAD) == 2 * min(4, frags)
    assert count(body[:wait], NC_LOAD) == 0
    assert count(body[:wait], X_LOAD) == 0 and count(body[:launch], X_LOAD) == 0
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0, report


@pytest.mark.compile
@pytest.mark.parametrize("rows,depth", [(4, 2), (8, 1), (2, 16)])
def test_gemv_settings_and_the_plain_launch_compile(rows, depth):
    k = 4096
    body = code(_ptx(GemvConstants("o_proj", 8192, k), False, "sm_90a", rows, depth))
    assert "griddepcontrol" not in body
    assert count(body, NC_LOAD) == rows * (k // 256)
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == rows // 2
    assert not re.search(r"\bfma\b|\.ftz\b", body)


def test_gemv_refuses_what_it_does_not_cover():
    from dspark_cute.cutedsl.gemm.gemv import Gemv, GemvKernel, check_settings

    good = GemvConstants("o_proj", 64, 256)
    for bad, words in [(GemvConstants("o_proj", 8, 256), "multiple of 16"),
                       (GemvConstants("o_proj", 64, 300), "multiple of 256"),
                       ("o_proj", "GemvConstants")]:
        with pytest.raises(ValueError, match=words):
            check_settings(bad)
    with pytest.raises(ValueError, match="2, 4 or 8 rows"):
        GemvKernel(good, True, rows_per_warp=3)
    with pytest.raises(ValueError, match="1 to 16 fragments"):
        GemvKernel(good, True, depth=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        check_settings(GemvConstants("o_proj", 48, 256), rows_per_warp=8)
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        Gemv(good, w)
    with pytest.raises(ValueError, match="2-D bf16"):
        Gemv(good, w.float())
    with pytest.raises(ValueError):
        Gemv(good, torch.zeros(64, 512, dtype=torch.bfloat16))  # not the constants' shape


def test_gemv_constants_say_why_not():
    assert gemv_constants("down", torch.zeros(32, 512, dtype=torch.bfloat16)) == GemvConstants("down", 32, 512)
    with pytest.raises(ValueError, match="input features"):
        gemv_constants("down", torch.zeros(32, 500, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="output features"):
        gemv_constants("down", torch.zeros(40, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D bf16"):
        gemv_constants("down", torch.zeros(32, 512, dtype=torch.float16))
