"""GPU test of the opt-in on-disk kernel cache: a process that compiles the
activation, the o-gate and the row norm (writing the cache) and one that
loads them from it (compiling refused) launch on the same operands and write
the same bits, outputs poisoned first, also inside a CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from cute_testing import requires_cuda

from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from cute_testing import GPU_NORMS, make_norm, poison
    from norm_testing import row_consts
    from dspark_core.contracts.constants import MlpActivationConstants, OGateConstants
    from dspark_cute import MlpActivation, OGate, RowNorm
    from dspark_cute.runtime import host

    out_path, refuse = sys.argv[1], sys.argv[2] == "load"
    if refuse:
        def no_compile(*args, **kwargs):
            raise SystemExit("compiled although the cache holds the variant")
        host.compile_kernel = no_compile
    gen = torch.Generator(device="cuda").manual_seed(int(sys.argv[3]))
    norm = make_norm(GPU_NORMS[1], 8192, gen)
    hosts = [RowNorm(row_consts(norm, torch.bfloat16, "sm_90a"), norm.weight),
             MlpActivation(MlpActivationConstants(2048)), OGate(OGateConstants(16, 1e-6))]
    for h in hosts:
        h.prepare()
    m = 7
    x = torch.randn(m, 8192, generator=gen, device="cuda").bfloat16()
    gu = torch.randn(m, 4096, generator=gen, device="cuda").bfloat16()
    attn = torch.randn(m, 1024, generator=gen, device="cuda").bfloat16()
    g = torch.randn(m, 1024, generator=gen, device="cuda").bfloat16()
    outs = [torch.empty_like(x), torch.empty(m, 2048, dtype=torch.bfloat16, device="cuda"), torch.empty_like(attn)]
    def step():
        hosts[0].launch(x, outs[0]); hosts[1].launch(gu, outs[1]); hosts[2].launch(attn, g, outs[2])
    results = []
    for which in (0, 1):
        for t in outs:
            poison(t, which)
        step()
        results.append([t.clone() for t in outs])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in outs:
        poison(t, 0)
    graph.replay()
    results.append([t.clone() for t in outs])
    torch.save([[t.cpu() for t in r] for r in results], out_path)
""")


def test_a_loaded_kernel_writes_the_compiled_bits(tmp_path, seed):
    here = os.path.dirname(__file__)
    env = dict(os.environ, DSPARK_KERNEL_CACHE=str(tmp_path / "kernels"),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    saved = {}
    for mode in ("compile", "load"):
        out = tmp_path / f"{mode}.pt"
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(out), mode, str(seed)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{mode}: {done.stderr[-3000:]}{done.stdout[-2000:]}"
        saved[mode] = torch.load(out)
    assert len(list((tmp_path / "kernels").glob("*.o"))) == 3
    for r, (a_round, b_round) in enumerate(zip(saved["compile"], saved["load"])):
        for a, b, name in zip(a_round, b_round, ("row norm", "activation", "o-gate")):
            assert_bitwise(b, a, f"{name}: loaded against compiled, round {r}")
