"""Probe (not part of any package): an exact one-split GEMM with a GEMV's
schedule, against cuBLAS (issue 33's open question: is the schedule what
keeps the tiled exact kernels at 4.0-4.2 TB/s where a row-per-program GEMV
streams 4.4-4.5?).

``y[m, N] = x[m, K] @ W[N, K]^T`` for m <= 8, summed as cuBLAS sums the
one-split projections (o_proj, gate_up, the LM head, the Markov bias;
``docs/gemm-order.md``): one FP32 accumulator per output from +0.0, one
``mma.sync.m16n8k16`` per 16 columns in increasing order, one ``cvt.rn``.
Each warp owns one 16-row MMA tile over the whole of K and loads its
operands straight into registers (no shared memory, no CTA barrier), so the
grid is N / 16 warps in many short CTAs (``warps`` a CTA), as a GEMV's
programs. ``unroll`` MMA steps of loads are issued before their MMAs.

Two operand layouts:

- ``canonical``: lane (g, t) loads the PTX fragment's own columns, 4 bytes
  at a time (columns 2t, 2t + 1 and 2t + 8, 2t + 9 of rows g and g + 8, and
  of x's row g): exact by construction, 6 loads an MMA;
- ``permuted``: lane (g, t) loads columns 4t .. 4t + 3 of each row with one
  8-byte load (3 loads an MMA), so inside each MMA the 16 columns (the same
  contiguous 16) sit at other k positions, in A and B alike. Its bits equal
  cuBLAS's only if the tensor core's sum of one MMA's 16 products does not
  depend on their positions: the probe's bit check answers that.

What ptxas makes of it (its machine code read on the CPU, 2026-12-05): each
warp keeps about four MMA steps of loads in flight (about 2 KB), whatever
``unroll`` is, and whatever distance the source puts between a load and its
MMA (a trace-time unrolled variant that loaded 8 or 16 steps ahead compiled
to the same distance), so the warps an SM holds (``N / 16`` over the SMs:
about 15 for gate_up) carry the memory-level parallelism.

``python scripts/probes/exact_direct_gemm.py`` (on a GPU) prints one line
per case and a table last: µs and TB/s of cuBLAS and of each variant, and
whether its bits are cuBLAS's (the check's probes: spread magnitudes,
-0.0, subnormals, an infinity and a NaN). ``--compile-only`` compiles the
variants for sm_90a on a CPU and prints their load and MMA counts."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from dspark_cute import ptx
from dspark_cute.ptx.inline import asm, i64, words

SHAPES = {"o_proj": (8192, 4096), "gate_up": (32768, 8192), "lm_head": (32768, 8192), "markov_bias": (32768, 256)}


@dsl_user_op
def ld_nc_b32(addr, *, loc=None, ip=None) -> Uint32:
    """``ld.global.nc.b32``: a weight word through the read-only path (the
    other half of its 32-byte sector is the next load's, an L1 hit)."""
    return Uint32(asm(T.i32(), [i64(addr, loc, ip)], "ld.global.nc.b32 $0, [$1];", "=r,l", False, loc, ip))


@dsl_user_op
def ld_nc_v2(addr, *, loc=None, ip=None) -> list:
    """``ld.global.nc.v2.b32``: 8 bytes, two words."""
    from cutlass._mlir.dialects import llvm

    res = asm(llvm.StructType.get_literal([T.i32()] * 2), [i64(addr, loc, ip)],
              "ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", False, loc, ip)
    return words(res, 2, loc, ip)


class DirectExactGemm:
    """The traced kernel for one ``(n, k, warps, unroll, permuted, ahead)``.
    Call: ``(w, x, y, m, stream)``: byte addresses of W ``[n, k]``, x ``[m,
    k]``, y ``[m, n]`` (BF16, contiguous), ``m`` <= 8. With ``ahead`` > 0
    it launches with PDL: each warp first asks L2 for the first ``ahead``
    bytes of each of its 16 weight rows (``prefetch.global.L2``; the weight
    is constant), then waits (``griddepcontrol.wait``) before it loads
    anything (``scripts/probes/pdl_overlap.py``)."""

    def __init__(self, n: int, k: int, warps: int, unroll: int, permuted: bool, ahead: int = 0) -> None:
        if n % (16 * warps) or k % (16 * unroll):
            raise ValueError(f"n {n} must be a multiple of {16 * warps} and k {k} of {16 * unroll}")
        if ahead < 0 or ahead % 256 or ahead > 2 * k:
            raise ValueError(f"ahead must be a multiple of 256 bytes within a row ({2 * k}), not {ahead}")
        self.n, self.k, self.warps, self.unroll, self.permuted = n, k, warps, unroll, permuted
        self.ahead = ahead

    @cute.jit
    def __call__(self, w: Int64, x: Int64, y: Int64, m: Int32, stream):
        self.kernel(w, x, y, m).launch(grid=[self.n // (16 * self.warps), 1, 1], block=[32 * self.warps, 1, 1],
                                       stream=stream, use_pdl=self.ahead > 0)

    @cute.kernel
    def kernel(self, w: Int64, x: Int64, y: Int64, m: Int32):
        k = self.k
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = Int32(cute.arch.lane_idx())
        g, t = lane >> 2, lane & 3
        row0 = (Int32(cta) * self.warps + Int32(warp)) * 16
        w0 = Int64(w) + Int64(row0 + g) * (2 * k)  # row g of the tile
        w1 = w0 + 16 * k  # row g + 8
        xr = Int64(x) + Int64(cutlass.min(g, m - 1)) * (2 * k)  # token g (a clamped row feeds no output read)
        if cutlass.const_expr(self.ahead > 0):
            # 128-byte lines: lane l takes row l % 16, lines l // 16, l // 16 + 2, ...
            for j in cutlass.range_constexpr(self.ahead // 256):
                line = Int64(2 * j) + Int64(lane >> 4)
                ptx.prefetch_l2(Int64(w) + Int64(row0 + (lane & 15)) * (2 * k) + line * 128)
            ptx.pdl_wait()
        acc = cute.make_rmem_tensor(4, cutlass.Float32)
        zero = ptx.f32_const(0.0)
        for i in cutlass.range_constexpr(4):
            acc[i] = zero
        for s in cutlass.range(0, k // 16, self.unroll):
            frags = []
            for u in cutlass.range_constexpr(self.unroll):
                col = Int64(s + u) * 16
                if cutlass.const_expr(self.permuted):
                    c = (col + Int64(4 * t)) * 2
                    r0, r1, xv = ld_nc_v2(w0 + c), ld_nc_v2(w1 + c), ld_nc_v2(xr + c)
                    frags.append(([r0[0], r1[0], r0[1], r1[1]], [xv[0], xv[1]]))
                else:
                    lo, hi = (col + Int64(2 * t)) * 2, (col + Int64(2 * t + 8)) * 2
                    a = [ld_nc_b32(w0 + lo), ld_nc_b32(w1 + lo), ld_nc_b32(w0 + hi), ld_nc_b32(w1 + hi)]
                    frags.append((a, [ptx.ld_global_b32(xr + lo), ptx.ld_global_b32(xr + hi)]))
            for a, b in frags:
                out = ptx.mma_bf16(a, b, [acc[0], acc[1], acc[2], acc[3]])
                for i in cutlass.range_constexpr(4):
                    acc[i] = out[i]
        for reg in cutlass.range_constexpr(4):
            row = row0 + g + 8 * (reg >> 1)
            tok = 2 * t + (reg & 1)
            ptx.st_global_bf16_rn_if(Int64(y) + (Int64(tok) * self.n + Int64(row)) * 2, acc[reg], tok, m)


def graph_time(fns) -> float:
    """µs a call of ``fns`` called in turn in one CUDA graph: the median of five medians of five replays."""
    from dspark_core.tools.timing import capture, median_us

    def calls():
        for fn in fns:
            fn()
    replay = capture(calls)
    return statistics.median(median_us(replay, 5, warmup=1, calls=len(fns)) for _ in range(5))


def fake_args() -> tuple:
    from dspark_cute.runtime.host import fake_stream

    return Int64(0), Int64(0), Int64(0), Int32(1), fake_stream()


def compile_only() -> int:
    import re

    from dspark_cute.runtime.host import compile_ptx

    for permuted in (False, True):
        body = compile_ptx(DirectExactGemm(32768, 8192, 4, 8, permuted), *fake_args(), arch="sm_90a")
        body = "\n".join(line.split("//")[0] for line in body.splitlines())
        print(f"permuted={permuted}: mma {len(re.findall(r'mma.sync', body))}, "
              f"ld.nc.b32 {len(re.findall(r'ld.global.nc.b32', body))}, "
              f"ld.nc.v2 {len(re.findall(r'ld.global.nc.v2', body))}, "
              f"ld.b32 {len(re.findall(r'ld.global.b32', body))}, local {bool(re.search(r'[.]local', body))}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--seed", type=int, default=time.time_ns() % 2**31)
    a = p.parse_args()
    if a.compile_only:
        return compile_only()
    import torch
    import torch.nn.functional as F

    from dspark_core.runtime import gemm_check
    from dspark_core.tools.compare import mismatches
    from dspark_cute.runtime.host import compile_kernel, current_stream

    print(f"seed {a.seed}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    rows = [int(r) for r in a.rows.split(",")]
    lines = []
    compiled = {}

    timed = graph_time
    for role, (n, k) in SHAPES.items():
        copies = max(1, -(-(256 << 20) // (n * k * 2)))  # >= 256 MB: every call reads its weight from HBM
        ws = [(torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            t_ref = timed([lambda w=w, xx=x: F.linear(xx, w) for w in ws])
            cells = [f"{t_ref:.1f} µs {n * k * 2 / t_ref / 1e6:.2f} TB/s"]
            for permuted in (False, True):
                best = None
                for warps in (2, 4, 8):
                    for unroll in (4, 8):
                        if n % (16 * warps) or k % (16 * unroll):
                            continue
                        key = (n, k, warps, unroll, permuted)
                        if key not in compiled:
                            compiled[key] = compile_kernel(DirectExactGemm(*key), *fake_args())
                        kern = compiled[key]
                        ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in ws]

                        def run(w, y, xx=x, kern=kern):
                            kern(Int64(w.data_ptr()), Int64(xx.data_ptr()), Int64(y.data_ptr()), Int32(xx.shape[0]),
                                 current_stream())

                        same = True
                        for _name, probe in gemm_check.probes(m, k, "cuda", a.seed):
                            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                            run(ws[0], out, probe)
                            same = same and not bool(mismatches(out, F.linear(probe, ws[0])).any())
                        t = timed([lambda w=w, y=y: run(w, y) for w, y in zip(ws, ys)])
                        print(f"{role} m={m} permuted={permuted} warps={warps} unroll={unroll}: {t:.1f} µs "
                              f"({t_ref / t:.3f}x cuBLAS), bits {'= cuBLAS' if same else 'DIFFER'}", flush=True)
                        if best is None or t < best[0]:
                            best = (t, warps, unroll, same)
                t, warps, unroll, same = best
                cells.append(f"{t:.1f} µs {n * k * 2 / t / 1e6:.2f} TB/s ({t_ref / t:.3f}x; {warps} warps, "
                             f"unroll {unroll}; bits {'equal' if same else 'DIFFER'})")
            lines.append(f"| {role} | {m} | " + " | ".join(cells) + " |")
    print(f"\nexact one-split GEMM with a GEMV's schedule, {torch.cuda.get_device_name()}, seed {a.seed}, "
          "weights from HBM, CUDA graphs, medians; the fastest settings of each layout")
    print("| projection | m | cuBLAS | canonical (4-byte loads) | permuted (8-byte loads) |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
