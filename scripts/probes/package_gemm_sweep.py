"""Probe (not part of any package): which main-loop shape of the package GEMM
(plain epilogue) is fastest at the TP shards of issue 6 (N = 8192, K in
{1024, 2048, 4096, 8192}, m in {1, 2, 4, 16}), against cuBLAS, on one GPU.

Variants: the ring main loop (tile_n 64) for ``k_warps`` in {4, 8, 16} and
``stages`` up to 8 (shared memory up to 227 KB); the register-direct one
(tile_n 16) for the same ``k_warps`` and in-flight depths
(``skinny.direct.mainloop``); the ring with x through
registers (``SkinnyConfig.x_regs``) for 4 and 8 warps; and at m = 1 the
one-row GEMV path (``one_row_gemv=True``), checked bit for bit against
``dspark_core.spec.gemv.gemv``. ``--quick`` (about 3 minutes): K >= 2048, m in
{1, 4, 16}, the ring at the policy's ``k_warps`` (4 and 8) with x in the
ring and in registers, and the GEMV. ``k_warps`` is part of the sum order;
every variant of one ``k_warps`` must give the same bits, which the probe
checks on the GPU (m = 1 and m = 16, against the first ring variant of that
``k_warps``). ``--deep``: K = 8192, the ring of 8 warps deeper than the
package's shared-memory cap allows (``DEEP_RING``).

Measured on an H200 (2026-11-30; us, L2 timing, plain epilogue; full sweep):

| K | m | cuBLAS | best ring (kw, st) | best direct (kw, st, group) | one-row GEMV |
|---|---|---|---|---|---|
| 1024 | 1 / 4 / 16 | 5.50 / 5.07 / 4.88 | 5.64 / 4.99 / 4.71 (16, 2) | 3.41 / 3.54 / 4.23 (kw 4) | 3.28 |
| 2048 | 1 / 4 / 16 | 7.80 / 7.45 / 7.02 | 8.29 / 7.38 / 6.91 | 5.80 / 5.96 / 6.36 | 8.09 |
| 4096 | 1 / 4 / 16 | 18.68 / 18.86 / 19.14 | 20.81 / 18.62 / 18.97 | 19.98 / 20.22 / 21.26 | 18.24 |
| 8192 | 1 / 4 / 16 | 34.20 / 34.37 / 34.11 | 35.86 / 34.10 / 34.90 | 44.21 / 44.58 / 42.24 | 35.98 |

HBM timings matched L2 ones from K = 4096 on (the weight no longer fits in
L2); at K = 2048 from HBM the direct loop wins at 8 warps (8 steps a warp),
not at 4 (16 steps): ``policy.DIRECT_MAX_STEPS``. Refill bursts (the direct
loop's ``group``, since removed) did not help it. Rotated K-slices (CTA c's warp w on slice (w + c) mod
W_K, since removed) did not remove the ring's m = 1 penalty; x through
registers did (``--quick``, m = 1, K = 2048 / 4096 / 8192: 6.13 / 18.65 /
35.26 against the ring's 8.68 / 20.78 / 38.53; at m = 16 it is slower,
43.68 against 34.53 at K = 8192): ``package_gemm.RING_X_DEPTH``.

``--copies`` (about 2.5 minutes): K = 4096 (4 warps) and 8192 (8 warps), m
in {1, 4, 16}, HBM timing: who copies the weight (``SkinnyConfig.copy``:
each lane its own 16 bytes, or the warp's 128-byte row pieces), who copies
x (``SkinnyConfig.x_copy``) and the copies' L2 prefetch size; all the same
bits (checked), and against float64. Measured before x rows existed (one
H200, m = 1 / 4 / 16, us): K = 4096: lane copies 20.83 / 19.64 / 19.38,
row copies with a 128-byte prefetch 18.50 / 18.10 / 18.13, cuBLAS 18.78 /
18.93 / 19.23; K = 8192: 35.21 / 35.03 / 35.42, 32.22 / 32.76 / 33.22,
cuBLAS 33.98 / 33.30 / 33.32: ``package_gemm_shape.RING_COPY``. (Warps
summing interleaved steps instead of contiguous slices, a different sum
order once measured here, were slower: 23.17 / 18.67 / 18.69 and 34.30 /
32.98 / 33.63; removed.) ``--xregs``: row copies with x through
registers for every call (slower at m = 16: 20.47 against 18.66 at K = 4096).
Row copies refilling a pair's slot before its MMAs (``SkinnyConfig.refill``,
since removed) were a little faster on one H200, not at TP2 (the package's
README). ``--depth`` (about 2
minutes): the ring's warps and depth side by side at K = 4096 and 8192
(``DEPTHS``), medians of alternating rounds. Measured (one H200, m = 1 / 4
/ 16, us): K = 4096: 8 warps 16.81 / 17.17 / 18.27, 4 warps 18.96 / 17.98
/ 18.49 (8 / 6 / 6 stages; 8 / 8 / 8 and 12 / 12 / 10 no better), cuBLAS
19.17 / 18.87 / 19.13; K = 8192: 8 warps 33.26 / 33.56 / 34.56, 4 warps
with 8 / 8 / 8 stages 32.65 / 33.55 / 34.25, cuBLAS 34.29 / 34.09 / 34.13.
At TP2 4 warps lost at K = 8192 (``dspark_core.planner.policy.RING_SPLIT_K``).

Two timings per call, CUDA graphs of back-to-back calls: ``l2``, the same
weight every call (as ``bench_package_gemm``: a K = 1024 shard stays in
L2), and ``hbm``, rotating over weight copies of >= 320 MB a cycle.

Prints the best of each loop per (K, m, timing) and writes every row to
``$OUT/package_gemm_sweep.json``. Run on one GPU with the packages on
PYTHONPATH (as ``scripts/gpu-check.sh`` sets it):
``python scripts/probes/package_gemm_sweep.py [--quick | --deep | --copies |
--xregs | --depth]``."""
import dataclasses
import json
import os
import sys
import time

import torch

from dspark_comm.cutedsl import package_gemm as pg
from dspark_comm.cutedsl import package_gemm_shape as pgs
from dspark_core.contracts.constants import PackageGemmConstants
from dspark_core.spec.gemv import gemv as gemv_spec
from dspark_core.tools.timing import capture_on_side_stream, median_us

H = 8192
KS = (1024, 2048, 4096, 8192)
ROWS = (1, 2, 4, 16)
KWS = (4, 8, 16)
RING_STAGES = (2, 4, 6, 8)
DIRECT = ((4, 1), (8, 1))  # (stages, group: 1, the refill burst since removed)
CALLS = 20
HBM_BYTES = 320 << 20


# The ring main loop with x through registers (SkinnyConfig.x_regs): (k_warps, stages).
X_REGS = ((4, 4), (4, 6), (4, 8), (8, 4), (8, 5), (8, 6))
# --quick: the policy's k_warps (4: o_proj, 8: down_proj) on the ring, plain and x_regs.
QUICK_KS = (2048, 4096, 8192)
QUICK_ROWS = (1, 4, 16)
QUICK_RING = ((4, 4), (4, 6), (8, 4))
# --deep: K = 8192's 8 warps deeper than MAX_SMEM_BYTES allows (None: the most
# within the probe's 227 KB per token tile, 6 / 5 stages for 8 / 16 tokens).
DEEP_RING = ((8, 4), (8, 5), (8, None), (4, 6))


def variants(k: int, quick: bool, deep: bool = False):
    """(loop, k_warps, stages, group, x_regs, constants) of every variant at ``k``."""
    def ring(kw, st, x_regs=False):
        return ("ring x_regs" if x_regs else "ring", kw, st, 1, x_regs,
                PackageGemmConstants("o_proj", H, k, 64, kw // 4, 16))

    if deep:
        yield from (ring(kw, st) for kw, st in DEEP_RING)
        return
    if quick:
        yield from (ring(kw, st) for kw, st in QUICK_RING)
    else:
        for kw in KWS:
            for st in RING_STAGES:
                yield ring(kw, st)
            for st, grp in DIRECT:
                yield ("direct", kw, st, grp, False, PackageGemmConstants("o_proj", H, k, 16, kw // 4, 16))
    yield from (ring(kw, st, True) for kw, st in X_REGS)


# --copies: who copies x where it goes through a row-copy ring
# (SkinnyConfig.x_copy), the cp.async L2 prefetch size and who copies the
# weight (SkinnyConfig.copy; row copies take an even number of stages: the
# default rounded down), at the policy's k_warps, HBM timing:
# (k, k_warps, x_copy, l2_prefetch, copy).
COPIES = [(k, kw, xc, pf, cp) for k, kw in ((4096, 4), (8192, 8))
          for xc, pf, cp in (("lane", 256, "lane"), ("lane", 128, "rows"), ("rows", 128, "rows"),
                             ("rows", 256, "rows"), ("rows", 0, "rows"))]


# --xregs: (k, k_warps) of its side-by-side runs.
SIDE_BY_SIDE = ((4096, 4), (8192, 8))
# --xregs: x in the ring (the default) against x through registers for every
# call. (label, PackageGemm arguments, SkinnyConfig changes)
XREGS = [("row copies, x in the ring", {}, {}), ("row copies, x_regs", {"x_regs": True}, {})]


def side_by_side(seed: int, variants: list) -> int:
    """Time each of ``variants`` (the default depths), m = 1 / 4 / 16, HBM
    timing, against cuBLAS, at each ``SIDE_BY_SIDE`` shape; every variant's
    bits against the first's (the same MMAs). Prints a table as it goes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bad = 0
    print("| K | variant | m 1 | m 4 | m 16 |\n| --- | --- | --- | --- | --- |", flush=True)
    for k, kw in SIDE_BY_SIDE:
        ws, xs, ys = operands(gen, k, QUICK_ROWS)
        cub = [cublas_us(ws, xs[m], ys[m]) for m in QUICK_ROWS]
        print(f"| {k} | cuBLAS | " + " | ".join(f"{t:.2f}" for t in cub) + " |", flush=True)
        c = PackageGemmConstants("o_proj", H, k, 64, kw // 4, 16)
        ref = {}
        for label, kwargs, changes in variants:
            gemms = [pg.PackageGemm(c, w, k_warps=kw, **kwargs) for w in ws]
            for g in gemms:
                g.configs = {t: dataclasses.replace(cfg, **changes) for t, cfg in g.configs.items()}
            gemms[0].prepare(publish=(False,))
            us = []
            for m in QUICK_ROWS:
                bits = gemms[0].run(xs[m]).view(torch.int16)
                if not torch.equal(ref.setdefault(m, bits.clone()), bits):
                    bad += 1
                    print(f"  MISMATCH {label} K{k} m{m}", flush=True)
                us.append(timed([lambda g=g, x=xs[m], y=ys[m]: g.launch(x, y) for g in gemms]))
            st = "/".join(str(gemms[0].configs[t].stages) for t in (0, 1, 2))
            print(f"| {k} | kw{kw} {label}, st {st} | " + " | ".join(f"{t:.2f}" for t in us) + " |", flush=True)
        ws = gemms = None
        torch.cuda.empty_cache()
    print(f"\nbit mismatches: {bad}")
    return 1 if bad else 0


def copies_configs(configs: dict, x_copy: str, l2_prefetch: int, copy: str) -> dict:
    """A ``PackageGemm``'s ``configs`` with the probe's copy knobs (not
    ``PackageGemm`` arguments): who copies x (lanes where x goes through
    registers), the L2 prefetch size, who copies the weight (row copies: the
    default depth rounded down to pairs). The same bits as the defaults."""
    return {t: dataclasses.replace(cfg, x_copy="lane" if cfg.x_regs else x_copy, l2_prefetch=l2_prefetch, copy=copy,
                                   stages=cfg.stages - (cfg.stages % 2 if copy == "rows" else 0))
            for t, cfg in configs.items()}


def variant_bad(name: str, k: int, m: int, got, x, w, k_warps: int, ref: dict) -> int:
    """1 (and a printed line) where variant ``name``'s output ``got`` of ``x
    @ w.T`` lies outside ``pg.error_bound`` of float64 anywhere or differs in
    its bits from the first variant of its ``k_warps`` at ``m`` (``ref``,
    which the first fills); else 0."""
    exact = x.double() @ w.double().t()
    over = int(((got.double() - exact).abs() > pg.error_bound(got, x, w, k_warps)).sum())
    bits = got.view(torch.int16)
    same = ref.setdefault((k_warps, m), bits.clone())
    if over or not torch.equal(same, bits):
        print(f"  BAD {name} K{k} m{m}: {over} outside the bound, {int((same != bits).sum())} words differ from "
              f"the first variant of its k_warps", flush=True)
        return 1
    return 0


def copies_sweep(seed: int) -> int:
    """``--copies``: time each ``COPIES`` variant against cuBLAS (m = 1 / 4
    / 16, weight copies of >= 320 MB a cycle), check that every variant of a
    k_warps gives the same bits and each is within ``pg.error_bound`` of
    float64."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, bad = [], 0
    for k in sorted({v[0] for v in COPIES}):
        ws, xs, ys = operands(gen, k, QUICK_ROWS)
        for m in QUICK_ROWS:
            rows.append({"k": k, "m": m, "variant": "cublas", "us": cublas_us(ws, xs[m], ys[m])})
        ref = {}
        for _, kw, xc, pf, cp in [v for v in COPIES if v[0] == k]:
            c = PackageGemmConstants("o_proj", H, k, 64, kw // 4, 16)
            gemms = [pg.PackageGemm(c, w, k_warps=kw) for w in ws]
            for g in gemms:
                g.configs = copies_configs(g.configs, xc, pf, cp)
            name = f"kw{kw} x-{xc} pf{pf} {cp} st" + "/".join(str(g.configs[t].stages) for t in (0, 1, 2))
            gemms[0].prepare(publish=(False,))
            for m in QUICK_ROWS:
                bad += variant_bad(name, k, m, gemms[0].run(xs[m]), xs[m], ws[0], kw, ref)
                fns = [lambda g=g, x=xs[m], y=ys[m]: g.launch(x, y) for g in gemms]
                rows.append({"k": k, "m": m, "variant": name, "us": timed(fns)})
            print(f"  K {k} {name}: " + " / ".join(f"{r['us']:.2f}" for r in rows[-3:]), flush=True)
        _save(seed, rows)
        ws = gemms = None
        torch.cuda.empty_cache()
    print("\n| K | variant | " + " | ".join(f"m {m}" for m in QUICK_ROWS) + " |\n| --- | --- |" + " --- |" * 3)
    for k in sorted({v[0] for v in COPIES}):
        names = list(dict.fromkeys(r["variant"] for r in rows if r["k"] == k))
        for name in names:
            us = {r["m"]: r["us"] for r in rows if r["k"] == k and r["variant"] == name}
            print(f"| {k} | {name} | " + " | ".join(f"{us[m]:.2f}" for m in QUICK_ROWS) + " |")
    print(f"\nbad variants: {bad}")
    return 1 if bad else 0


# --depth: the ring's warps and depth at the shards whose m = 16 cell is
# closest to cuBLAS: (k, k_warps, {n_tiles: ring depth cap}, x_regs depth cap);
# None: the package's defaults. Fewer warps have half the bytes a step, so
# the same shared memory holds twice the steps (row copies: an even number).
DEPTHS = [(8192, 8, None, None), (8192, 4, None, None), (8192, 4, {1: 8, 2: 8}, 8),
          (8192, 4, {1: 12, 2: 10}, 12), (4096, 4, None, None), (4096, 4, {1: 8, 2: 8}, 8),
          (4096, 4, {1: 12, 2: 10}, 12), (4096, 8, None, None)]
DEPTH_ROUNDS = 5


def depth_sweep(seed: int) -> int:
    """``--depth``: each ``DEPTHS`` variant against cuBLAS, m = 1 / 4 / 16,
    HBM timing, in ``DEPTH_ROUNDS`` rounds whose order reverses every other
    round (clock drift favours no variant); medians over rounds. Every
    variant within ``pg.error_bound`` of float64, and of one k_warps the
    same bits."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bad, table = 0, []
    for k in sorted({v[0] for v in DEPTHS}):
        ws, xs, ys = operands(gen, k, QUICK_ROWS)
        fns = {("cuBLAS", m): [lambda w=w, x=xs[m], y=ys[m]: torch.matmul(x, w.t(), out=y) for w in ws]
               for m in QUICK_ROWS}
        ref = {}
        for _, kw, ring_depth, x_depth in [v for v in DEPTHS if v[0] == k]:
            saved = dict(pgs.RING_DEPTH), pgs.RING_X_DEPTH
            if ring_depth is not None:  # read by default_shape while PackageGemm is built
                pgs.RING_DEPTH.update(ring_depth)
                pgs.RING_X_DEPTH = x_depth
            try:
                gemms = [pg.PackageGemm(PackageGemmConstants("o_proj", H, k, 64, kw // 4, 16), w, k_warps=kw)
                         for w in ws]
            finally:
                pgs.RING_DEPTH.update(saved[0])
                pgs.RING_X_DEPTH = saved[1]
            name = f"kw{kw} st " + "/".join(str(gemms[0].stages_by_tiles[t]) for t in (0, 1, 2))
            gemms[0].prepare(publish=(False,))
            for m in QUICK_ROWS:
                bad += variant_bad(name, k, m, gemms[0].run(xs[m]), xs[m], ws[0], kw, ref)
                fns[name, m] = [lambda g=g, x=xs[m], y=ys[m]: g.launch(x, y) for g in gemms]
        replays = {key: capture_on_side_stream(f, CALLS) for key, f in fns.items()}
        times = {key: [] for key in replays}
        for rnd in range(DEPTH_ROUNDS):
            for key in (list(replays) if rnd % 2 == 0 else list(replays)[::-1]):
                times[key].append(median_us(replays[key], 30, warmup=2, calls=CALLS))
        for name in dict.fromkeys(n for n, _ in replays):
            med = [sorted(times[name, m])[DEPTH_ROUNDS // 2] for m in QUICK_ROWS]
            table.append(f"| {k} | {name} | " + " | ".join(f"{t:.2f}" for t in med) + " |")
            print(table[-1], flush=True)
        ws = gemms = fns = replays = None
        torch.cuda.empty_cache()
    print(f"\n| K | variant (medians of {DEPTH_ROUNDS} rounds, HBM) | m 1 | m 4 | m 16 |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(table))
    print(f"\nbad variants: {bad}")
    return 1 if bad else 0


def _save(seed: int, rows: list) -> None:
    out_dir = os.environ.get("OUT", "bench-results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "package_gemm_sweep.json"), "w") as f:
        json.dump({"seed": seed, "rows": rows}, f, indent=0)


def timed(fns) -> float:
    replay = capture_on_side_stream(fns, CALLS)
    return median_us(replay, 30, warmup=2, calls=CALLS)


def operands(gen, k: int, rows) -> tuple:
    """``(ws, xs, ys)`` at ``k``: BF16 weight copies ``[H, k]`` of at least
    ``HBM_BYTES`` a cycle (at least two), x ``[m, k]`` and an output ``[m, H]``
    for each ``m`` of ``rows`` (drawn in that order)."""
    copies = max(2, -(-HBM_BYTES // (H * k * 2)))
    ws = [(torch.randn((H, k), generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
    xs = {m: torch.randn((m, k), generator=gen, device="cuda").to(torch.bfloat16) for m in rows}
    ys = {m: torch.empty((m, H), dtype=torch.bfloat16, device="cuda") for m in xs}
    return ws, xs, ys


def cublas_us(ws, x, y) -> float:
    """cuBLAS ``x @ W^T`` into ``y``, rotating over the weight copies ``ws`` (HBM timing)."""
    return timed([lambda w=w: torch.matmul(x, w.t(), out=y) for w in ws])


def main() -> int:
    quick, deep = "--quick" in sys.argv[1:], "--deep" in sys.argv[1:]
    ks, rows_m = ((8192,), QUICK_ROWS) if deep else (QUICK_KS, QUICK_ROWS) if quick else (KS, ROWS)
    pgs.MAX_SMEM_BYTES = 227 * 1024  # the probe may go past the package's own cap (read there)
    seed = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
    print(f"seed {seed}; {torch.cuda.get_device_name()}", flush=True)
    if "--copies" in sys.argv[1:]:
        return copies_sweep(seed)
    if "--depth" in sys.argv[1:]:
        return depth_sweep(seed)
    if "--xregs" in sys.argv[1:]:
        return side_by_side(seed, XREGS)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    mismatches = 0
    t0 = time.time()
    for k in ks:
        ws, xs, ys = operands(gen, k, set(rows_m) | {1, 16})
        for m in rows_m:
            x, y = xs[m], ys[m]
            fn = [lambda w=w, x=x, y=y: torch.matmul(x, w.t(), out=y) for w in ws]
            for mode, fns in (("l2", fn[:1]), ("hbm", fn)):
                us = timed(fns)
                rows.append({"k": k, "m": m, "timing": mode, "loop": "cublas", "us": us})
        ref = {}
        for loop, kw, st, grp, x_regs, c in variants(k, quick, deep):
            try:
                gemms = [pg.PackageGemm(c, w, k_warps=kw, stages=st, x_regs=x_regs) for w in ws]
                gemms[0].prepare(publish=(False,))
            except ValueError as e:  # a shape the loop cannot take (K, stages, smem)
                print(f"  skip {loop} kw{kw} st{st} g{grp} K{k}: {e}", flush=True)
                continue
            except Exception as e:  # a compile failure is a finding, not the end of the sweep
                print(f"  FAIL {loop} kw{kw} st{st} g{grp} K{k}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if st is None:  # the label of the depths the cap gave (8 / 16 tokens)
                st = f"{gemms[0].stages_by_tiles[1]}/{gemms[0].stages_by_tiles[2]}"
            for mc in (1, 16):  # both token tiles
                bits = gemms[0].run(xs[mc]).view(torch.int16)
                if (kw, mc) not in ref:
                    ref[kw, mc] = bits.clone()
                elif not torch.equal(ref[kw, mc], bits):
                    mismatches += 1
                    print(f"  MISMATCH {loop} kw{kw} st{st} g{grp} K{k} m{mc}: "
                          f"{int((ref[kw, mc] != bits).sum())} BF16 words differ", flush=True)
            for m in rows_m:
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
                print(f"  MISMATCH one-row gemv K{k}: not dspark_core.spec.gemv's bits", flush=True)
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
          "best ring x_regs (kw, st) | ring x_regs kw4 / kw8 | one-row GEMV |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in ks:
        for m in rows_m:
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

                xr = [r for r in sel if r["loop"] == "ring x_regs"]
                by_kw = " / ".join(fmt([r for r in xr if r["k_warps"] == kw], ("stages",)) for kw in (4, 8))

                print(f"| {k} | {m} | {mode} | {cub:.2f} | {fmt(ring, ('k_warps', 'stages'))} | "
                      f"{fmt(direct, ('k_warps', 'stages', 'group'))} | {fmt(d4, ('stages', 'group'))} | "
                      f"{fmt(xr, ('k_warps', 'stages'))} | {by_kw} | {gemv_cell} |")
    print(f"\nbit mismatches within a k_warps: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
