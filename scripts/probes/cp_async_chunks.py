"""Probe (not part of any package): the ordered GEMM's cp.async kernel at
64-, 128- and 256-column ring stages (a warp's copy instruction then covers
four rows x 128 bytes, two rows x 256 bytes or one row x 512 bytes) against
cuBLAS, per projection at m = 1 and 4, weights from HBM, bits checked (issue
33: whether longer contiguous runs per copy instruction stream faster).
``python scripts/probes/cp_async_chunks.py``; prints one line per case."""
import sys
import time

sys.path.insert(0, "packages/dspark-cute/benchmarks")
import bench_ordered_gemm as b
import torch
import torch.nn.functional as F

from dspark_cute.cutedsl.gemm.ordered_layout import SMEM_LIMIT, OrderedLayout, launch_settings

seed = time.time_ns() % 2**31
print("seed", seed, flush=True)
gen = torch.Generator(device="cuda").manual_seed(seed)
rows = [1, 4]
out = []
for role in ["gate_up", "down", "fc", "qkv_proj", "lm_head", "o_proj"]:
    n, k = b.SHAPES[role]
    copies = max(1, -(-b.MIN_BYTES // (n * k * 2)))
    ws = b._weights(n, k, copies, gen)
    res = b.check(role, ws[0], rows, seed)
    for m in rows:
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in ws]
        ref = F.linear(x, ws[0])
        tc = b.time_calls([lambda w=w, x=x: F.linear(x, w) for w in ws])
        cells = [f"cuBLAS {tc:.1f}"]
        gs = [b.bound(role, w, res, only=m) for w in ws]
        t = b.time_calls([lambda g=g, y=y, x=x: g.launch(x, y) for g, y in zip(gs, ys)])
        cells.append(f"default {gs[0]._settings[m]}: {t:.1f} ({tc/t:.3f}x)")
        for chunk in (64, 128, 256):
            for warps in (8, 4, 16) if chunk == 256 else (8,):
                if warps == 16:
                    continue
                base = launch_settings(n, res.orders[m].splits, m, 132, chunk)
                nt, w0, st, ch, l2 = base
                w_ = warps
                ctas = n // (16 * w_) * res.orders[m].splits
                per_sm = -(-ctas // 132)
                st = 8
                while st > 2 and per_sm * OrderedLayout(w_, nt, st, ch).total > SMEM_LIMIT:
                    st -= 1
                if OrderedLayout(w_, nt, st, ch).total > SMEM_LIMIT:
                    continue
                s = (nt, w_, st, ch, 0)
                gs = [b.bound(role, w, res, lambda mm, o, s=s: s, only=m) for w in ws]
                t = b.time_calls([lambda g=g, y=y, x=x: g.launch(x, y) for g, y in zip(gs, ys)])
                ok = b.bitwise(gs[0], x, ref)
                cells.append(f"c{ch} w{w_} s{st}: {t:.1f} ({n*k*2/t/1e6:.2f} TB/s, {tc/t:.3f}x){'' if ok else ' BITS'}")
        line = f"{role} m={m}: " + " | ".join(cells)
        print(line, flush=True)
        out.append(line)
    del ws
    torch.cuda.empty_cache()
print("\n".join(out))
