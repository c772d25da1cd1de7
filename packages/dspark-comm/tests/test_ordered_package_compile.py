"""CPU tests of the exact package GEMM (``dspark_comm.cutedsl.ordered_package``):
the publishing ordered GEMM compiles for sm_90a and sm_100a with the ordered
GEMM's sums unchanged (the same MMAs, split-K ``add.rn`` and one
``cvt.rn.bf16x2.f32`` per word as ``OrderedGemmKernel``'s PTX) and its one
store replaced: every output word encoded (the escape word in it) and stored
``tp`` times with ``st.relaxed.sys.global.b32``, no weak global store of an
output, the epochs read with ``ld.relaxed.gpu`` after the PDL wait; and the
host's refusals."""

from __future__ import annotations

import re

import pytest
from ptx_audit import code, count, ptxas_report, spill_bytes

from dspark_comm.protocol import ESCAPE, MailboxLayout

ARCHS = ["sm_90a", "sm_100a"]
# (K, token tiles, warps, stages, chunk, tp): row-parallel shards (o_proj and down at TP2 .. TP8).
VARIANTS = [(2048, 1, 4, 6, 64, 2), (4096, 2, 8, 4, 128, 4), (2048, 1, 2, 8, 256, 8)]


def _ptx(variant, arch, publish=True):
    from dspark_comm.cutedsl.ordered_package import OrderedPublishKernel
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemmKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    k, n_tiles, warps, stages, chunk, tp = variant
    kernel = (OrderedPublishKernel(k, n_tiles, warps, stages, True, chunk, 0, MailboxLayout(tp, 8192, 16), tp - 1)
              if publish else OrderedGemmKernel(k, n_tiles, warps, stages, True, chunk, 0))
    return code(compile_ptx(kernel, *fake_args(), arch=arch))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "k{}_t{}_w{}_s{}_c{}_tp{}".format(*v))
def test_publishes_the_ordered_sums(arch, variant, tmp_path):
    tp = variant[-1]
    plain, body = _ptx(variant, arch, publish=False), _ptx(variant, arch)
    for op in (r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b", r"\badd\.rn\.f32\b",
               r"\bcvt\.rn\.bf16x2\.f32\b", r"\bld\.global\.cg\.v2\.f32\b", r"\bst\.global\.v2\.f32\b"):
        assert count(body, op) == count(plain, op), op
    words = count(plain, r"\bst\.global\.b32\b") - 1  # the counter's reset is the one other b32 store
    assert words >= 2
    assert count(body, r"\bst\.relaxed\.sys\.global\.b32\b") == tp * words
    assert count(body, r"\bst\.global\.b32\b") == 1
    assert not re.search(r"\bfma\b|\.ftz\b|\.approx\b|\.local\b", body)
    assert hex(ESCAPE) in body or str(ESCAPE) in body
    wait = body.index("griddepcontrol.wait")
    assert count(body[:wait], r"\bld\.relaxed\.gpu") == 0 and count(body[wait:], r"\bld\.relaxed\.gpu") >= 1
    report = ptxas_report(body, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0, report


def test_refusals():
    import torch

    from dspark_comm.cutedsl.ordered_package import OrderedPackageGemm, OrderedPublishKernel

    with pytest.raises(ValueError, match="MailboxLayout"):
        OrderedPublishKernel(2048, 1, 4, 6, True, 64, 0, None, 0)
    with pytest.raises(ValueError, match="rank"):
        OrderedPublishKernel(2048, 1, 4, 6, True, 64, 0, MailboxLayout(2, 8192, 16), 2)
    with pytest.raises(ValueError, match="mailbox"):
        OrderedPackageGemm("down", torch.zeros(8192, 2048, dtype=torch.bfloat16), None)
