"""CPU tests of the streamed ordered GEMM
(``dspark_cute.cutedsl.gemm.streamed``): compiles for sm_90a and sm_100a
without a GPU, with a PTX audit of its stated order and movement: the tensor
cores are the only arithmetic of the sums (``mma.sync.m16n8k16`` BF16 ->
FP32, no ``fma``, no ``.ftz``, no approximate instruction), the split-K
reduce is ``add.rn.f32`` alone and the one rounding ``cvt.rn.bf16x2.f32``;
per chunk ``steps x a_tiles x n_tiles`` MMAs and ``chunk / 64`` TMA boxes;
before ``griddepcontrol.wait`` only the weight's boxes (x's bulk copies
after it); the dependents released at the start (``early``) or after the
main loop; no local memory, no spills. And the launch settings: every row
count and split of the draft's shards gets a layout that fits, and
``choose_settings`` picks the streamed kernel only where stated."""

from __future__ import annotations

import re

import pytest
from ptx_audit import code, count, ptxas_report, skip_audit_off_pin, spill_bytes

ARCHS = ["sm_90a", "sm_100a"]
# (K, warps, weight tiles, x rows, stages, chunk, early): the draft's widths.
VARIANTS = [(8192, 8, 1, 1, 3, 128, True), (24576, 4, 1, 2, 3, 256, False), (4096, 2, 1, 4, 6, 256, True),
            (256, 8, 2, 32, 2, 64, False), (16384, 1, 4, 64, 2, 128, True), (8192, 1, 1, 1, 3, 1024, False)]
TENSOR_COPY = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes"
X_COPY = r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes"


def _ptx(variant, arch, pdl=True):
    from dspark_cute.cutedsl.gemm.streamed import StreamedGemmKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    k, warps, a_tiles, x_rows, stages, chunk, early = variant
    return compile_ptx(StreamedGemmKernel(k, warps, a_tiles, x_rows, stages, pdl, chunk, early), *fake_args(),
                       arch=arch)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "k{}_w{}_a{}_x{}_s{}_c{}_e{:d}".format(*v))
def test_compiles_in_its_stated_order(arch, variant, tmp_path):
    k, warps, a_tiles, x_rows, stages, chunk, early = variant
    n_tiles = -(-x_rows // 8)
    steps, boxes, values = chunk // 16, chunk // 64, 4 * a_tiles * n_tiles
    body = code(_ptx(variant, arch))
    assert f".target {arch}" in body
    assert f".reqntid {32 * warps}, 1, 1" in body
    assert not re.search(r"\bfma\b|\.ftz\b|\.approx\b|\.local\b|\bmul\.f32\b|\bmul\.rn\.f32\b", body)
    assert count(body, r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b") == steps * a_tiles * n_tiles
    # The reduce's add.rn (one per output value, in the split loop); the
    # rounding of the one-split store and of the reduce's.
    assert count(body, r"\badd\.rn\.f32\b") == values
    assert count(body, r"\bcvt\.rn\.bf16x2\.f32\b") == 2 * values
    skip_audit_off_pin("the streamed GEMM")
    wait = body.index("griddepcontrol.wait")
    # Prologue: every stage's weight boxes before the wait, x after it; the loop refills one stage.
    assert count(body[:wait], TENSOR_COPY) == stages * boxes
    assert count(body[wait:], TENSOR_COPY) == boxes
    assert count(body[:wait], X_COPY) == 0
    assert count(body[wait:], X_COPY) == (stages + 1) * -(-x_rows // 32)
    assert count(body, r"\bgriddepcontrol\.wait\b") == 1
    # (The compiler may duplicate the release into branches: every copy on its side of the wait.)
    releases = [r.start() for r in re.finditer(r"\bgriddepcontrol\.launch_dependents\b", body)]
    assert releases and all((r < wait) == early for r in releases)
    # The split-K handshake: one GPU-scope fence before the ticket, one after.
    assert count(body, r"\batom\.acq_rel\.gpu\.global\.add\.u32\b") == 1
    assert count(body, r"\bfence\.acq_rel\.gpu\b") == 2
    assert count(body, r"\bld\.global\.cg\.f32\b") == 2 * values
    report = ptxas_report(body, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0, report


@pytest.mark.compile
def test_without_pdl_no_griddepcontrol():
    body = code(_ptx((8192, 8, 1, 1, 3, 128, True), "sm_90a", pdl=False))
    assert "griddepcontrol" not in body


SHAPES = {"fc": (8192, 24576), "qkv_proj": (9216, 8192), "o_proj": (8192, 4096), "gate_up": (32768, 8192),
          "down": (8192, 16384), "lm_head": (32768, 8192), "markov_bias": (32768, 256)}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_settings_fit_every_shard_and_row_count(tp):
    from dspark_cute.cutedsl.gemm.ordered_layout import SMEM_LIMIT
    from dspark_cute.cutedsl.gemm.streamed import streamed_layout, streamed_settings

    for role, (n, _) in SHAPES.items():
        if role not in ("fc", "o_proj", "down", "markov_bias"):
            n //= tp
        for splits in (1, 2, 3, 5, 8):
            for m in range(1, 65):
                settings = streamed_settings(n, splits, m)
                assert settings is not None, (role, tp, splits, m)
                kind, warps, a_tiles, x_rows, stages, chunk, early = settings
                lay = streamed_layout(warps, a_tiles, x_rows, stages, chunk)
                assert kind == "streamed" and m <= x_rows and n % lay.rows == 0 and lay.total <= SMEM_LIMIT
                assert isinstance(early, bool)


def test_layout_refusals():
    from dspark_cute.cutedsl.gemm.streamed import streamed_layout

    for args, what in [((3, 1, 1, 3, 128), "warps"), ((8, 4, 1, 3, 128), "256 rows"), ((8, 1, 3, 3, 128), "x_rows"),
                       ((8, 1, 1, 1, 128), "stages"), ((8, 1, 1, 3, 96), "chunk"), ((8, 1, 64, 8, 1024), "shared")]:
        with pytest.raises(ValueError, match=what):
            streamed_layout(*args)


def test_choose_settings_takes_the_streamed_kernel_where_stated():
    from dspark_cute.cutedsl.gemm.ordered import STREAMED_MAX_BYTES, STREAMED_MAX_ROWS, choose_settings

    assert choose_settings(8192, 4096, 1, 1, 132)[0] == "streamed"  # o_proj: 64 MB
    assert choose_settings(32768, 256, 1, STREAMED_MAX_ROWS, 132)[0] == "streamed"  # the Markov bias
    assert choose_settings(32768, 256, 1, STREAMED_MAX_ROWS + 1, 132)[0] != "streamed"
    assert 2 * 32768 * 8192 > STREAMED_MAX_BYTES and choose_settings(32768, 8192, 1, 1, 132)[0] != "streamed"
