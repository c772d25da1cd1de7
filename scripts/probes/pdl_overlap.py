"""Probe (not part of any package): can a projection DSpark owns keep HBM
streaming through the latency-bound part before it? Issue 33's whole step at
>= 88% of HBM peak needs a GEMM's weight bytes in flight while the norm,
attention or boundary before it runs; a cuBLAS launch cannot start before
its predecessor ends, so HBM idles through those parts (about 78 µs of the
step at m = 1).

The latency-bound part's stand-in: dspark-cute's ``gemm.lead.LeadPart`` (one
warp spinning T µs on ``%globaltimer``, which releases its PDL dependents at
its start where the GEMM after it launches with PDL; the build-time timing
puts the same part before every call it times). Then one one-split projection ``y = x W^T``
(o_proj 8192 x 4096, gate_up 32768 x 8192, m rows):

- cuBLAS (``F.linear``), launched as usual: it starts when the part ends;
- ``exact_direct_gemm``'s exact one-split kernel (cuBLAS's bits) without PDL;
- the same with PDL: before its ``griddepcontrol.wait`` each warp asks L2
  for the first ``ahead`` bytes of each of its 16 weight rows.

Every pair (part, GEMM) is timed in a CUDA graph over enough weight copies
that each GEMM reads its weight from HBM; a line per case gives µs a pair
and the part's time hidden: ``t(part) + t(GEMM alone) - t(pair)``, a table
last; the PDL variant's bits are compared with cuBLAS's once a case.

``python scripts/probes/pdl_overlap.py [--rows 1,4] [--spin 3,6,12] [--ahead 512,2048,8192]``
on a GPU; ``--compile-only`` compiles the kernels for sm_90a on a CPU."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cutlass import Int32, Int64

from dspark_cute.cutedsl.gemm.lead import LeadPart

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_direct_gemm import DirectExactGemm, graph_time  # noqa: E402
from exact_direct_gemm import fake_args as fake_gemm_args  # noqa: E402

SHAPES = {"o_proj": (8192, 4096), "gate_up": (32768, 8192)}
WARPS, UNROLL = 4, 8  # the direct kernel's settings (exact_direct_gemm sweeps them)


def compile_only(aheads) -> int:
    import re

    from dspark_cute.runtime.host import compile_ptx, fake_stream

    for release in (False, True):
        body = compile_ptx(LeadPart(release), Int64(0), fake_stream(), arch="sm_90a")
        print(f"spin release={release}: globaltimer reads {len(re.findall('globaltimer', body))}, "
              f"launch_dependents {len(re.findall('griddepcontrol.launch_dependents', body))}")
    for ahead in aheads:
        body = compile_ptx(DirectExactGemm(32768, 8192, WARPS, UNROLL, False, ahead), *fake_gemm_args(),
                           arch="sm_90a")
        code = "\n".join(line.split("//")[0] for line in body.splitlines())
        wait = code.index("griddepcontrol.wait")
        before = code[:wait]
        print(f"direct ahead={ahead}: prefetches before the wait {len(re.findall('prefetch.global.L2', before))}, "
              f"loads before it {len(re.findall(r'ld[.]global', before))}, mma {len(re.findall('mma.sync', code))}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--spin", default="3,6,12", help="the latency-bound part's µs")
    p.add_argument("--ahead", default="512,2048,8192", help="bytes of each weight row asked of L2 before the wait")
    p.add_argument("--seed", type=int, default=time.time_ns() % 2**31)
    a = p.parse_args()
    aheads = [int(v) for v in a.ahead.split(",")]
    if a.compile_only:
        return compile_only(aheads)
    import torch
    import torch.nn.functional as F

    from dspark_core.tools.compare import mismatches
    from dspark_cute.runtime.host import compile_kernel, current_stream

    print(f"seed {a.seed}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    spins = {r: compile_kernel(LeadPart(r), Int64(0), current_stream()) for r in (False, True)}

    timed = graph_time
    lines = []
    for role, (n, k) in SHAPES.items():
        copies = max(1, -(-(256 << 20) // (n * k * 2)))  # >= 256 MB: every GEMM reads its weight from HBM
        ws = [(torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
        kernels = {ahead: compile_kernel(DirectExactGemm(n, k, WARPS, UNROLL, False, ahead), *fake_gemm_args())
                   for ahead in [0] + [v for v in aheads if v <= 2 * k]}
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

            def direct(w, ahead, xx=x, yy=y, ks=kernels):
                ks[ahead](Int64(w.data_ptr()), Int64(xx.data_ptr()), Int64(yy.data_ptr()), Int32(xx.shape[0]),
                          current_stream())

            def part(us, release):
                spins[release](Int64(int(us * 1000)), current_stream())

            gemms = {"cuBLAS": (lambda w, xx=x: F.linear(xx, w), False), "direct": (lambda w: direct(w, 0), False)}
            for ahead in kernels:
                if ahead:
                    gemms[f"direct PDL ahead {ahead}"] = (lambda w, ah=ahead: direct(w, ah), True)
            alone = {name: timed([lambda w=w, f=f: f(w) for w in ws]) for name, (f, _) in gemms.items()}
            for ahead in (v for v in kernels if v):
                part(6, True)
                direct(ws[0], ahead)
                same = not bool(mismatches(y, F.linear(x, ws[0])).any())
                print(f"{role} m={m} PDL ahead {ahead}: bits {'= cuBLAS' if same else 'DIFFER'}", flush=True)
            for us in (float(v) for v in a.spin.split(",")):
                t_part = timed([lambda us=us: part(us, False)])
                cells = []
                for name, (f, release) in gemms.items():
                    t = timed([lambda w=w, f=f, us=us, r=release: (part(us, r), f(w)) for w in ws])
                    hidden = t_part + alone[name] - t
                    cells.append(f"{t:.1f} ({hidden:+.1f})")
                    print(f"{role} m={m} part {t_part:.1f} µs, {name}: alone {alone[name]:.1f}, pair {t:.1f}, "
                          f"hidden {hidden:+.1f} µs", flush=True)
                lines.append((role, m, t_part, list(gemms), cells, alone))
    print(f"\na latency-bound part, then one projection, {torch.cuda.get_device_name()}, seed {a.seed}, weights "
          "from HBM, CUDA graphs, medians; µs a pair (µs of the part hidden)")
    for role, m, t_part, names, cells, alone in lines:
        print(f"\n{role}, m = {m}, part {t_part:.1f} µs; alone: "
              + ", ".join(f"{name} {alone[name]:.1f}" for name in names))
        print("| " + " | ".join(names) + " |")
        print("| " + " | ".join("---" for _ in names) + " |")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
