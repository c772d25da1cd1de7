"""Probe (not part of any package): the resident-x ordered GEMM
(``dspark_cute.cutedsl.gemm.resident``: x held in shared memory, every warp
its own weight ring, no CTA barrier in the main loop) against cuBLAS and the
default ordered kernel, per projection and row count, and the step's 14
GEMMs chained (issue 33). Timing and bit checks are
``bench_ordered_gemm``'s (CUDA graphs, weights from HBM, the order found
against the live cuBLAS first).

``python scripts/probes/resident_gemm.py [--rows 1,4] [--roles ...]
[--chain 1,4] [--variants 64:12,128:6]`` prints one line per measurement and
a table last; variants are ``chunk:max_stages`` of the resident settings."""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "packages", "dspark-cute", "benchmarks"))


def main() -> int:
    import bench_ordered_gemm as b
    import torch
    import torch.nn.functional as F

    from dspark_cute.cutedsl.gemm.resident import resident_settings
    from dspark_cute.runtime.host import sm_count

    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4")
    p.add_argument("--roles", default=",".join(b.SHAPES))
    p.add_argument("--chain", default="1,4")
    p.add_argument("--variants", default="64:12,128:6")
    p.add_argument("--seed", type=int, default=time.time_ns() % 2**31)
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",") if r]
    variants = [tuple(int(v) for v in s.split(":")) for s in a.variants.split(",")]
    print(f"seed {a.seed}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    sms = sm_count()

    def resident(n, k, chunk, stages):
        return lambda m, o: resident_settings(n, k, o.splits, m, sms, chunk, stages)

    lines = []
    for role in a.roles.split(","):
        n, k = b.SHAPES[role]
        copies = max(1, -(-b.MIN_BYTES // (n * k * 2)))
        weights = b._weights(n, k, copies, gen)
        result = b.check(role, weights[0], rows, a.seed)
        for m in rows:
            if m not in result.orders:
                print(role, m, "no order", result.refused.get(m), flush=True)
                continue
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in weights]
            reference = F.linear(x, weights[0])
            t_cublas = b.time_calls([lambda w=w, x=x: F.linear(x, w) for w in weights])
            gs = [b.bound(role, w, result, only=m) for w in weights]
            t_default = b.time_calls([lambda g=g, y=y, x=x: g.launch(x, y) for g, y in zip(gs, ys)])
            cells = [f"{t_cublas:.2f}", f"{t_default:.2f}"]
            for chunk, stages in variants:
                choose = resident(n, k, chunk, stages)
                if choose(m, result.orders[m]) is None:
                    cells.append("-")
                    continue
                gs = [b.bound(role, w, result, choose, only=m) for w in weights]
                t = b.time_calls([lambda g=g, y=y, x=x: g.launch(x, y) for g, y in zip(gs, ys)])
                ok = b.bitwise(gs[0], x, reference)
                cells.append(f"{t:.2f} {n * k * 2 / t / 1e6:.2f}TB/s {t_cublas / t:.3f}x"
                             f"{'' if ok else ' BITS DIFFER'} {gs[0]._settings[m][1:4]}")
            line = f"| {role} | {m} | " + " | ".join(cells) + " |"
            print(line, flush=True)
            lines.append(line)
        del weights
        torch.cuda.empty_cache()

    chain_lines = []
    chain_rows = [int(r) for r in a.chain.split(",") if r]
    if chain_rows:
        weights = [b._weights(*b.shard(role, 1), 1, gen)[0] for role in b.CHAIN]
        results = {}
        for role, w in zip(b.CHAIN, weights):
            if role not in results:
                results[role] = b.check(role, w, chain_rows, a.seed)
        total = sum(w.numel() * 2 for w in weights)
        for m in chain_rows:
            xs = [torch.randn(m, w.shape[1], generator=gen, device="cuda").to(torch.bfloat16) for w in weights]
            ys = [torch.empty(m, w.shape[0], dtype=torch.bfloat16, device="cuda") for w in weights]
            stock = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]
            cells = []
            t_stock = b.time_calls(stock) * len(stock)
            cells.append(f"{t_stock:.1f} ({100 * total / (t_stock * 1e-6) / b.PEAK:.1f}%)")
            for chunk, stages in variants:
                gs = [b.bound(role, w, results[role], resident(*w.shape, chunk, stages))
                      for role, w in zip(b.CHAIN, weights)]
                ours = [(lambda g=g, x=x, y=y: g.launch(x, y)) if g.takes(x, y) else f
                        for g, x, y, f in zip(gs, xs, ys, stock)]
                owned = sum(g.takes(x, y) for g, x, y in zip(gs, xs, ys))
                exact = all(b.bitwise(g, x, f()) for g, x, y, f in zip(gs, xs, ys, stock) if g.takes(x, y))
                t = b.time_calls(ours) * len(ours)
                cells.append(f"{t:.1f} ({100 * total / (t * 1e-6) / b.PEAK:.1f}%, {owned}/14"
                             f"{'' if exact else ', BITS DIFFER'})")
            line = f"| chain | {m} | " + " | ".join(cells) + " |"
            print(line, flush=True)
            chain_lines.append(line)

    print(f"\nresident GEMM probe, {torch.cuda.get_device_name()}, seed {a.seed}; µs (TB/s, cuBLAS/ours, settings "
          "warps,x_rows,stages)")
    print("| projection | m | cuBLAS | default ordered | " + " | ".join(f"resident c{c} s<={s}" for c, s in variants)
          + " |")
    print("\n".join(lines + chain_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
