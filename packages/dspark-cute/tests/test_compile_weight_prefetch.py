"""CPU tests of the L2 weight prefetch (``dspark_cute.cutedsl.prefetch``): it
compiles for sm_90a and sm_100a without a GPU, a PTX audit (it only
prefetches: no global load or store, no shared memory, no barrier, no
spills), and the host-side refusals.

The audit: the one ``prefetch.global.L2::evict_last`` sits in the inner
(per-line) loop, whose address advances by 128 bytes; the outer loop
strides rows by the grid's thread count; no ``ld.global``/``st.global``, no
``ld.local``/``st.local`` (spills), no ``bar.sync``, no ``griddepcontrol``
in the plain variant; the PDL variant triggers its dependents
before its first prefetch and waits for its primary after its last one.
"""

from __future__ import annotations

import re

import pytest
import torch
from ptx_audit import code, count, ptxas_report, spill_bytes

ARCHS = ["sm_90a", "sm_100a"]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ctas,threads", [(32, 256), (8, 128), (132, 512)])
def test_weight_prefetch_compiles_and_only_prefetches(arch, ctas, threads, tmp_path):
    from dspark_cute.cutedsl.prefetch import WeightPrefetchKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    ptx = compile_ptx(WeightPrefetchKernel(ctas, threads), *fake_args(), arch=arch)
    body = code(ptx)
    assert f".target {arch}" in body
    assert f".reqntid {threads}, 1, 1" in body
    assert count(body, r"\bprefetch\.global\.L2::evict_last\b") == 1
    assert not re.search(r"\b(?:ld|st)\.(?:global|local|shared)", body)
    assert count(body, r"\bbar\.sync\b") == 0
    assert "griddepcontrol" not in body
    # Lines 128 bytes apart; rows strided by every thread of the grid.
    assert re.search(r"add\.s64\s+%rd\d+, %rd\d+, 128;", body)
    assert re.search(rf"add\.s32\s+%r\d+, %r\d+, {ctas * threads};", body)
    report = ptxas_report(ptx, arch, tmp_path)
    if report:
        assert spill_bytes(report) == 0, report


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_inline_prefetch_triggers_first_and_waits_last(arch):
    """The PDL variant: ``launch_dependents`` before the first prefetch (the
    next kernel may start while this one issues), ``wait`` after the last
    one (this grid completes only after its primary), each exactly once, and
    otherwise the same body as the plain variant."""
    from dspark_cute.cutedsl.prefetch import WeightPrefetchKernel, fake_args
    from dspark_cute.runtime.host import compile_ptx

    body = code(compile_ptx(WeightPrefetchKernel(pdl=True), *fake_args(), arch=arch))
    assert count(body, r"\bgriddepcontrol\.launch_dependents\b") == 1
    assert count(body, r"\bgriddepcontrol\.wait\b") == 1
    trigger = body.index("griddepcontrol.launch_dependents")
    wait = body.index("griddepcontrol.wait")
    prefetch = [mo.start() for mo in re.finditer(r"prefetch\.global\.L2::evict_last", body)]
    assert len(prefetch) == 1 and trigger < prefetch[0] < wait
    assert not re.search(r"\b(?:ld|st)\.(?:global|local|shared)", body)
    assert count(body, r"\bbar\.sync\b") == 0


def test_prefetch_lines_clamps_to_the_row_and_refuses_bad_operands():
    from dspark_cute.cutedsl.prefetch import LINE, prefetch_lines

    w = torch.empty(4, 100, dtype=torch.bfloat16)  # 200-byte rows, on the CPU
    with pytest.raises(ValueError, match="multiple of 128"):
        prefetch_lines(w, 100)
    with pytest.raises(ValueError, match="multiple of 128"):
        prefetch_lines(w, True)
    with pytest.raises(ValueError, match="2-D weight"):
        prefetch_lines(torch.empty(8, dtype=torch.bfloat16), LINE)
    with pytest.raises(ValueError, match="contiguous rows"):
        prefetch_lines(torch.empty(64, 4, dtype=torch.bfloat16).t(), LINE)
    with pytest.raises(ValueError, match="1 to"):
        prefetch_lines(torch.empty(0, 64, dtype=torch.bfloat16), LINE)
    with pytest.raises(ValueError, match="CUDA weight"):
        prefetch_lines(w, LINE)


def test_prefetch_lines_counts_whole_lines_within_the_row(monkeypatch):
    """On a (meta) weight that claims to be on CUDA: the lines a row gets are
    the requested bytes clamped to the row, rounded down to whole lines."""
    from dspark_cute.cutedsl import prefetch as wp

    class Cuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    def weight(rows, cols, dtype=torch.bfloat16):
        return torch.empty(rows, cols, dtype=dtype, device="meta").as_subclass(Cuda)

    assert wp.prefetch_lines(weight(9216, 8192), 256) == 2
    assert wp.prefetch_lines(weight(8192, 16384), 512) == 4
    assert wp.prefetch_lines(weight(8, 100), 256) == 1  # a 200-byte row: one whole line
    assert wp.prefetch_lines(weight(8, 32), 256) == 0  # a 64-byte row: nothing to prefetch
    assert wp.prefetch_lines(weight(8, 64, torch.float32), 1024) == 2


def test_the_prefetcher_checks_its_roles_and_sizes():
    from dspark_cute.cutedsl.prefetch import WeightPrefetch, WeightPrefetcher

    with pytest.raises(ValueError, match="prefetch roles"):
        WeightPrefetcher({"embed": 256}, "cpu")
    for bad in (0, 64, 200, -128, 256.0, True):
        with pytest.raises(ValueError, match="multiple of 128 bytes"):
            WeightPrefetcher({"o_proj": bad}, "cpu")
    with pytest.raises(RuntimeError, match="prepare"):
        WeightPrefetcher({"o_proj": 256}, "cpu").fork(torch.empty(4, 64), "o_proj")
    assert WeightPrefetcher({"o_proj": 256}, "cpu").kernel.pdl  # the PDL variant
    with pytest.raises(ValueError, match="CTAs"):
        WeightPrefetch(ctas=0)
    with pytest.raises(ValueError, match="CTAs"):
        WeightPrefetch(threads=100)
