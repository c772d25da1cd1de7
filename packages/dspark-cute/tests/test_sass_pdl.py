"""What ptxas keeps before the PDL wait, in the machine code (sm_90a).

Several kernels state that they issue loads of constant operands (weights,
norm gains) before ``griddepcontrol.wait``, so that they overlap the kernel
before them; the PTX audits check the PTX's order. ptxas (CUDA 13.x, as the
compile tests run it) may still move a load across the wait, which appears
in the machine code as ``ACQBULK``: it keeps ``cp.async`` copies
(``LDGSTS``), TMA copies (``UTMALDG``), L2 prefetches (``CCTL.E.PF2``) and
plain global loads before it, and it moves non-coherent register loads
(``ld.global.nc``) after it when it schedules for registers.

These tests disassemble each kernel (``ptx_audit.sass_around_wait``: ptxas
and nvdisasm from the CUDA wheels) and count what stays before the wait.
The register-loading loops (the one-token GEMV, the register-direct skinny
loop) therefore issue their first weight loads as coherent
``ld.global.L1::no_allocate`` (``ptx.weight_first``), the rest as
``ld.global.nc``. Skipped where no ptxas or nvdisasm is installed."""

from __future__ import annotations

import pytest
from ptx_audit import census_or_skip, ops_like

from dspark_core.contracts.markov import markov_constants, markov_sample_constants

ARCH = "sm_90a"


def census(kernel, args, tmp_path) -> tuple[dict, dict]:
    from dspark_cute.runtime.host import compile_ptx

    return census_or_skip(compile_ptx(kernel, *args, arch=ARCH), ARCH, tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("n_tiles", [1, 4])
def test_markov_bias_step_copies_w2_and_loads_base_before_the_wait(n_tiles, tmp_path):
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasKernel, fake_args

    c = markov_constants(32768, 256, 0.0625, 30.0, True)
    before, after = census(MarkovBiasKernel(c, n_tiles, True, True), fake_args(), tmp_path)
    assert ops_like(before, "LDGSTS") >= 256 // 8  # the warp's w2 rows: rank / 8 pieces a lane
    assert ops_like(before, "LDG.E.U16") == 8 * n_tiles  # the base logits after the loop's first step
    assert ops_like(before, "STG") == ops_like(before, "RED") == ops_like(before, "ATOM") == 0
    assert ops_like(after, "HMMA") == 256 // 16 * 2 * n_tiles


@pytest.mark.compile
def test_markov_bias_sample_keeps_its_constant_loads_before_the_wait(tmp_path):
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleKernel, fake_args

    c = markov_sample_constants(32768, 202048, 256, 0.0625, 30.0)
    before, after = census(MarkovBiasSampleKernel(c, 1, True, True), fake_args(), tmp_path)
    assert ops_like(before, "LDGSTS") >= 256 // 8
    assert ops_like(before, "LDG.E.U16") == 8
    assert before.get("LDG.E", 0) + before.get("LDG.E.64", 0) == 4  # the d2t entries of its 4 draft columns
    assert ops_like(before, "STG") == 0  # the cache is written only after the wait
    assert ops_like(after, "STG.E.U16") == 8 + 8  # its values and the fill's -inf


@pytest.mark.compile
def test_markov_persistent_loop_copies_w2_before_the_wait(tmp_path):
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentKernel, fake_args
    from dspark_cute.runtime.host import cooperative_supported

    if not cooperative_supported():
        pytest.skip("this CuTe DSL has no cooperative launch: the persistent loop refuses it")
    c = markov_constants(32768, 256, 0.0625, 30.0, True)
    before, _ = census(MarkovPersistentKernel(c, 4, 1, True, True), fake_args(), tmp_path)
    assert ops_like(before, "LDGSTS") == 256 // 8
    assert ops_like(before, "LDG") - ops_like(before, "LDGSTS") - ops_like(before, "LDGDEPBAR") == 0


@pytest.mark.compile
def test_ordered_gemm_keeps_its_weight_prologue_and_l2_prefetch_before_the_wait(tmp_path):
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemmKernel, fake_args

    # K 8192, one token tile, 4 warps, 4 stages of 64 columns, 4 chunks into L2.
    before, after = census(OrderedGemmKernel(8192, 1, 4, 4, True, 64, 4), fake_args(), tmp_path)
    assert ops_like(before, "LDGSTS") > 0 and ops_like(before, "CCTL.E.PF2") > 0
    assert ops_like(before, "HMMA") == 0 and ops_like(before, "STG") == 0
    assert ops_like(after, "HMMA") > 0


@pytest.mark.compile
def test_streamed_gemm_issues_its_weight_boxes_before_the_wait(tmp_path):
    from dspark_cute.cutedsl.gemm.streamed import StreamedGemmKernel, fake_args

    before, _ = census(StreamedGemmKernel(8192, 8, 1, 1, 3, True, 128, True), fake_args(), tmp_path)
    assert ops_like(before, "UTMALDG") > 0 and ops_like(before, "STG") == 0


@pytest.mark.compile
@pytest.mark.parametrize("rows,depth", [(2, 4), (4, 2)])
def test_gemv_weight_loads_stay_before_the_wait(rows, depth, tmp_path):
    """The first ``depth`` fragments' weight loads (``ld.global.L1::no_allocate``:
    as ``ld.global.nc`` ptxas moved all of them after the wait)."""
    from dspark_core.contracts.constants import GemvConstants
    from dspark_cute.cutedsl.gemm.gemv import GemvKernel, fake_args

    before, after = census(GemvKernel(GemvConstants("gate_up", 32768, 8192), True, rows, depth), fake_args(),
                           tmp_path)
    assert before.get("LDG.E.NA.128", 0) == rows * depth
    assert ops_like(before, "LDG") == rows * depth  # x's loads after the wait
    assert after.get("LDG.E.NA.128", 0) == 0
