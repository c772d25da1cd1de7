"""CPU tests of the ordered GEMM (``dspark_cute.cutedsl.gemm.ordered``):
compiles for sm_90a and sm_100a without a GPU, for the draft's K widths and
every token-tile count, with a PTX audit: the tensor cores are the only
arithmetic of the sums (``mma.sync.m16n8k16`` BF16 -> FP32, no ``fma``, no
``.ftz``, no approximate instruction), the split-K reduce is ``add.rn.f32``
alone and the one rounding is ``cvt.rn.bf16x2.f32``; per chunk one
``ldmatrix.x4`` of the weight and of x per step (x2 for one token tile) and
``n_tiles`` MMAs per step; no local memory; PDL: only weight copies (and the
L2 prefetch of the next chunks) before ``griddepcontrol.wait``, the
dependents released after the main loop."""

from __future__ import annotations

import re

import pytest
from ptx_audit import code, count, ptxas_report, skip_audit_off_pin, spill_bytes

ARCHS = ["sm_90a", "sm_100a"]
# (K, token tiles, warps, stages): the draft's widths (fc 24576, the layers'
# 4096 / 8192 / 16384, the Markov bias 256, TP shards 512 and 1024).
VARIANTS = [(24576, 1, 4, 8, 64, 0), (8192, 2, 4, 6, 128, 3), (4096, 1, 2, 8, 256, 0), (16384, 4, 4, 4, 64, 5),
            (256, 8, 4, 3, 128, 0), (512, 2, 1, 8, 64, 2), (1024, 8, 8, 2, 256, 1)]
WEIGHT_COPY = r"cp\.async\.cg\.shared\.global\.L2::256B"
X_COPY = r"@p cp\.async\.cg\.shared\.global \["


def _ptx(k, n_tiles, warps, stages, pdl, arch, chunk=64, l2_chunks=0):
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemmKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    return compile_ptx(OrderedGemmKernel(k, n_tiles, warps, stages, pdl, chunk, l2_chunks), *fake_args(), arch=arch)


def _loop(body: str) -> str:
    """The main loop's text: from the first ``cp.async.wait_group`` to the
    dependents' release (the last MMA is before it)."""
    start = body.index("cp.async.wait_group")
    return body[start:body.index("griddepcontrol.launch_dependents")]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "k{}_t{}_w{}_s{}_c{}_l{}".format(*v))
def test_compiles_in_its_stated_order(arch, variant, tmp_path):
    k, n_tiles, warps, stages, chunk, l2_chunks = variant
    steps = chunk // 16
    body = code(_ptx(k, n_tiles, warps, stages, True, arch, chunk, l2_chunks))
    assert f".target {arch}" in body
    assert f".reqntid {32 * warps}, 1, 1" in body
    assert not re.search(r"\bfma\b|\.ftz\b|\.approx\b|\.local\b|\bmul\.f32\b|\bmul\.rn\.f32\b", body)
    # The sums: MMAs, the reduce's add.rn (one per split past the first, two
    # outputs a word), the one rounding per output word.
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b") == steps * n_tiles
    assert count(body, r"\badd\.rn\.f32\b") == 2 * 2 * n_tiles
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == 2 * 2 * n_tiles
    skip_audit_off_pin("the ordered GEMM")
    loop = _loop(body)
    assert count(loop, r"\bldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16\b") == steps * (1 + n_tiles // 2)
    assert count(loop, r"\bldmatrix\.sync\.aligned\.m8n8\.x2\.shared\.b16\b") == (steps if n_tiles == 1 else 0)
    assert count(loop, WEIGHT_COPY) == steps
    assert count(loop, r"\bbar\.sync\b") == 1
    # PDL: the prologue's weight copies, then the wait, then x's copies.
    wait = body.index("griddepcontrol.wait")
    assert count(body[:wait], WEIGHT_COPY) == steps * (stages - 1)
    assert count(body[:wait], r"@p prefetch\.global\.L2 \[") == steps * l2_chunks
    assert count(body[wait:], r"prefetch\.global") == 0
    assert count(body[:wait], X_COPY) == 0
    assert count(body, r"\bgriddepcontrol\.wait\b") == 1
    assert wait < body.index("griddepcontrol.launch_dependents")
    # The split-K handshake: partials, a GPU-scope fence, one acq_rel add.
    assert count(body, r"\bfence\.acq_rel\.gpu\b") == 1
    assert count(body, r"\batom\.acq_rel\.gpu\.global\.add\.u32\b") == 1
    assert count(body, r"\bld\.global\.cg\.v2\.f32\b") == 2 * 2 * n_tiles
    report = ptxas_report(body, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0, report


@pytest.mark.compile
def test_without_pdl_no_griddepcontrol():
    body = code(_ptx(8192, 1, 4, 4, False, "sm_90a"))
    assert "griddepcontrol" not in body


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("release", [True, False])
def test_lead_part_ptx(arch, release):
    """The build-time timing's lead part (``gemm.lead``): the dependents'
    release first (where asked), then the ``%globaltimer`` spin; it touches
    no global or shared memory, so it moves no value of the GEMM after it."""
    from dspark_cute.cutedsl.gemm.lead import compile_lead
    from dspark_cute.runtime.host import compile_ptx

    kernel, args = compile_lead(release)
    body = code(compile_ptx(kernel, *args, arch=arch))
    assert count(body, r"%globaltimer") == 2
    assert count(body, r"griddepcontrol\.launch_dependents") == int(release)
    if release:
        assert body.index("griddepcontrol.launch_dependents") < body.index("%globaltimer")
    assert count(body, r"\b(ld|st)\.(global|shared)|cp\.async|\batom\.|\bred\.") == 0
    assert count(body, r"griddepcontrol\.wait") == 0


def test_lead_part_refuses_a_non_bool():
    from dspark_cute.cutedsl.gemm.lead import LeadPart

    with pytest.raises(TypeError, match="release must be a bool"):
        LeadPart("yes")
