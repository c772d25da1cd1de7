"""Probe (not part of any package): which main-loop shape of the package GEMM
(plain epilogue) is fastest at the TP shards of issue 6 (N = 8192, K in
{1024, 4096, 8192}, m in {1, 4, 16}), against cuBLAS, on one GPU.

Variants: the ring main loop (tile_n 64) for ``k_warps`` in {4, 8, 16} and
``stages`` up to 8 (shared memory up to 227 KB); the register-direct one
(tile_n 16) for the same ``k_warps``, ``(stages, group)`` in-flight depths
and refill bursts (``skinny_direct.mainloop``); a few of both with rotated
K-slices (``SkinnyConfig.rotate``: does the ring's m = 1 penalty come from
every CTA reading the same x line at once?); and at m = 1 the one-row GEMV
path (``one_row_gemv=True``), checked bit for bit against
``dspark_core.gemv.gemv``. ``k_warps`` is part of the
sum order; every variant of one ``k_warps`` must give the same bits, which
the probe checks on the GPU (m = 16, against the ring loop of that
``k_warps``).

Measured on an H200 (2026-11-30, before K = 2048, m = 2 and the rotated
variants were added; us, L2 timing, plain epilogue):

| K | m | cuBLAS | best ring (kw, st) | best direct (kw, st, group) |
|---|---|---|---|---|
| 1024 | 1 / 4 / 16 | 5.34 / 4.97 / 4.76 | 5.63 / 4.97 / 4.73 (16, 2) | 3.49 / 3.55 / 4.23 (kw 4-8) |
| 4096 | 1 / 4 / 16 | 18.78 / 18.68 / 18.93 | 21.27 / 18.78 / 18.90 (4, 6) | 20.01 / 20.23 / 21.08 |
| 8192 | 1 / 4 / 16 | 34.16 / 33.77 / 34.16 | 35.43 / 34.78 (8, 4) / 34.22 (4, 6) | 44.75 / 45.18 / 42.64 |

HBM timings matched L2 ones from K = 4096 on; at K = 1024 cuBLAS took 6.8
from HBM. Refill bursts did not help the direct loop. The ring is slower
at m = 1 than at m = 4 with the same kernel (21.3 against 18.8 at K =
4096), which the direct loop (x through L1) is not.

Two timings per call, CUDA graphs of back-to-back calls: ``l2``, the same
weight every call (as ``bench_package_gemm``: a K = 1024 shard stays in
L2), and ``hbm``, rotating over weight copies of >= 320 MB a cycle.

Prints the best of each loop per (K, m, timing) and writes every row to
``$OUT/package_gemm_sweep.json``. Run on one GPU with the packages on
PYTHONPATH (as ``scripts/gpu-check.sh`` sets it):
``python scripts/probes/package_gemm_sweep.py``."""
import json
import os
import sys
import time

import torch

from dspark_comm import package_gemm as pg
from dspark_core.constants import PackageGemmConstants
from dspark_core.gemv import gemv as gemv_spec
from dspark_core.timing import capture_on_side_stream, median_us

H = 8192
KS = (1024, 2048, 4096, 8192)
ROWS = (1, 2, 4, 16)
KWS = (4, 8, 16)
RING_STAGES = (2, 4, 6, 8)
DIRECT = ((4, 1), (8, 1), (8, 2), (8, 4), (4, 2))  # (stages, group)
CALLS = 20
HBM_BYTES = 320 << 20


# Rotated K-slices (SkinnyConfig.rotate), tried on these shapes: (loop, k_warps, stages).
ROTATED = (("ring", 4, 6), ("ring", 8, 4), ("direct", 4, 8), ("direct", 4, 4))


def variants(k: int):
    for kw in KWS:
        split = kw // 4
        for st in RING_STAGES:
            yield ("ring", kw, st, 1, False, PackageGemmConstants("o_proj", H, k, 64, split, 16))
        for st, grp in DIRECT:
            yield ("direct", kw, st, grp, False, PackageGemmConstants("o_proj", H, k, 16, split, 16))
    for loop, kw, st in ROTATED:
        yield (loop, kw, st, 1, True, PackageGemmConstants("o_proj", H, k, 64 if loop == "ring" else 16, kw // 4, 16))


def _save(seed: int, rows: list) -> None:
    out_dir = os.environ.get("OUT", "bench-results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "package_gemm_sweep.json"), "w") as f:
        json.dump({"seed": seed, "rows": rows}, f, indent=0)


def timed(fns) -> float:
    replay = capture_on_side_stream(fns, CALLS)
    return median_us(replay, 30, warmup=2, calls=CALLS)


def main() -> int:
    pg.MAX_SMEM_BYTES = 227 * 1024  # the probe may go past the package's own cap
    seed = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
    print(f"seed {seed}; {torch.cuda.get_device_name()}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    mismatches = 0
    t0 = time.time()
    for k in KS:
        copies = max(2, -(-HBM_BYTES // (H * k * 2)))
        ws = [(torch.randn((H, k), generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        xs = {m: (torch.randn((m, k), generator=gen, device="cuda")).to(torch.bfloat16) for m in ROWS}
        ys = {m: torch.empty((m, H), dtype=torch.bfloat16, device="cuda") for m in ROWS}
        for m in ROWS:
            x, y = xs[m], ys[m]
            fn = [lambda w=w, x=x, y=y: torch.matmul(x, w.t(), out=y) for w in ws]
            for mode, fns in (("l2", fn[:1]), ("hbm", fn)):
                us = timed(fns)
                rows.append({"k": k, "m": m, "timing": mode, "loop": "cublas", "us": us})
        ref = {}
        for loop, kw, st, grp, rot, c in variants(k):
            loop = loop + (" rotated" if rot else "")
            try:
                gemms = [pg.PackageGemm(c, w, k_warps=kw, stages=st, group=grp, rotate=rot) for w in ws]
                gemms[0].prepare(publish=(False,))
            except ValueError as e:  # a shape the loop cannot take (K, stages, smem)
                print(f"  skip {loop} kw{kw} st{st} g{grp} K{k}: {e}", flush=True)
                continue
            except Exception as e:  # a compile failure is a finding, not the end of the sweep
                print(f"  FAIL {loop} kw{kw} st{st} g{grp} K{k}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            out = gemms[0].run(xs[16])
            torch.cuda.synchronize()
            bits = out.view(torch.int16)
            if kw not in ref:
                ref[kw] = bits.clone()
            elif not torch.equal(ref[kw], bits):
                mismatches += 1
                print(f"  MISMATCH {loop} kw{kw} st{st} g{grp} K{k}: "
                      f"{int((ref[kw] != bits).sum())} BF16 words differ", flush=True)
            for m in ROWS:
                x, y = xs[m], ys[m]
                for mode, gs in (("l2", gemms[:1]), ("hbm", gemms)):
                    us = timed([lambda g=g, x=x, y=y: g.launch(x, y) for g in gs])
                    rows.append({"k": k, "m": m, "timing": mode, "loop": loop, "k_warps": kw, "stages": st,
                                 "group": grp, "us": us})
        # The one-row GEMV path (one_row_gemv=True) at m = 1: the spec's bits, and its time.
        gemvs = []
        try:  # a failure of this (newer) path is a finding, not the end of the sweep
            gemvs = [pg.PackageGemm(PackageGemmConstants("o_proj", H, k, 64, 1, 16), w, one_row_gemv=True)
                     for w in ws]
            gemvs[0].prepare(publish=(False,))
            got = gemvs[0].run(xs[1])
            if not torch.equal(got.view(torch.int16), gemv_spec(xs[1], ws[0]).view(torch.int16)):
                mismatches += 1
                print(f"  MISMATCH one-row gemv K{k}: not dspark_core.gemv's bits", flush=True)
            for mode, gs in (("l2", gemvs[:1]), ("hbm", gemvs)):
                us = timed([lambda g=g, x=xs[1], y=ys[1]: g.launch(x, y) for g in gs])
                rows.append({"k": k, "m": 1, "timing": mode, "loop": "gemv", "k_warps": 0, "stages": 0,
                             "group": 1, "us": us})
        except Exception as e:
            print(f"  FAIL one-row gemv K{k}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        print(f"K {k} done ({time.time() - t0:.0f} s)", flush=True)
        _save(seed, rows)  # after every K: a sweep cut short keeps what it measured
        ws = gemms = gemvs = None  # free this K's copies before the next
        torch.cuda.empty_cache()
    print("\n| K | m | timing | cuBLAS | best ring (kw, st) | best direct (kw, st, group) | best direct kw4 | "
          "ring kw4 st6: plain / rotated | direct kw4 st8: plain / rotated | one-row GEMV |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in KS:
        for m in ROWS:
            for mode in ("l2", "hbm"):
                sel = [r for r in rows if r["k"] == k and r["m"] == m and r["timing"] == mode]
                cub = next(r["us"] for r in sel if r["loop"] == "cublas")

                def fmt(rs, keys):
                    if not rs:
                        return "-"
                    b = min(rs, key=lambda row: row["us"])
                    return f"{b['us']:.2f} ({', '.join(str(b[q]) for q in keys)})"

                ring = [r for r in sel if r["loop"] == "ring"]
                direct = [r for r in sel if r["loop"] == "direct"]
                d4 = [r for r in direct if r["k_warps"] == 4]

                gemv_cell = next((f"{r['us']:.2f}" for r in sel if r["loop"] == "gemv"), "-")

                def pair(loop, st, sel=sel):
                    got = [next((f"{r['us']:.2f}" for r in sel if r["loop"] == name and r["k_warps"] == 4
                                 and r["stages"] == st and r["group"] == 1), "-")
                           for name in (loop, loop + " rotated")]
                    return " / ".join(got)

                print(f"| {k} | {m} | {mode} | {cub:.2f} | {fmt(ring, ('k_warps', 'stages'))} | "
                      f"{fmt(direct, ('k_warps', 'stages', 'group'))} | {fmt(d4, ('stages', 'group'))} | "
                      f"{pair('ring', 6)} | {pair('direct', 8)} | {gemv_cell} |")
    print(f"\nbit mismatches within a k_warps: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
