"""Benchmark: DSpark's ordered GEMM (``dspark_cute.cutedsl.gemm.ordered``)
against cuBLAS (``F.linear``, what vLLM calls) on the reference draft's
projections, in CUDA graphs with weights streamed from HBM.

For each projection (fc, QKV, o_proj, gate_up, down, LM head, Markov bias;
``--tp N`` their TP-N shards) and row count (``--rows``): the build-time
check (``dspark_core.runtime.gemm_check.check_projection``) finds cuBLAS's
split order; both sides are then timed in a graph of back-to-back calls that
cycle over enough weight copies (>= 256 MB) that every call reads its weight
from HBM (median of trials, µs per call), each side's weight bandwidth (its
bytes over its time) and the ratio. The chain of the step's 14 projections
(fc, 2 x (QKV, o_proj, gate_up, down), LM head, 4 Markov bias GEMMs; every
weight its own, so nothing stays in L2) is timed as one graph per side at
m = 1, 4 and 16, with its fraction of this card's HBM peak
(``dspark_core.tools.card``), both kernels forced and as the build decides
(``OrderedGemm.decide``: each shape's row counts timed against cuBLAS on
this card, DSpark's kernel only where faster; the decision's cost, cold and
from the cache, is printed).
``--kernels`` adds cuBLAS's kernel names and grids per shape and row count
(``torch.profiler``) for ``docs/gemm-order.md``; ``--sweep`` times the
streamed GEMM's launch settings (warps, weight tiles, chunk, stages; no bit
changes) beside its default at m = 1 and 16.

Writes ``ordered_gemm.md``, ``.json`` and ``.png`` into ``--out`` and prints
the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    "fc": (8192, 24576), "qkv_proj": (9216, 8192), "o_proj": (8192, 4096), "gate_up": (32768, 8192),
    "down": (8192, 16384), "lm_head": (32768, 8192), "markov_bias": (32768, 256),
}
ROW_PARALLEL = ("fc", "o_proj", "down")
CHAIN = ["fc"] + ["qkv_proj", "o_proj", "gate_up", "down"] * 2 + ["lm_head"] + ["markov_bias"] * 4
PEAK = None  # this card's HBM peak (main() reads it: dspark_core.tools.card)
MIN_BYTES = 256 << 20
# --sweep: the row counts the streamed kernel's settings (STREAMED_SWEEP) are timed at.
SWEEP_ROWS = (1,)


def shard(role: str, tp: int) -> tuple[int, int]:
    n, k = SHAPES[role]
    if tp == 1 or role == "markov_bias":
        return n, k
    return (n, k // tp) if role in ROW_PARALLEL else (n // tp, k)


def _weights(n: int, k: int, copies: int, gen) -> list[torch.Tensor]:
    return [(torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]


def time_calls(fns: list, trials: int = 7, replays: int = 5) -> float:
    """Median µs per call of ``fns`` captured back to back in one graph."""
    from dspark_core.tools.timing import capture, median_us

    def all_calls():
        for fn in fns:
            fn()

    replay = capture(all_calls)
    return statistics.median(median_us(replay, replays, warmup=1, calls=len(fns)) for _ in range(trials))


def _gemm(role, weight, settings=None):
    from dspark_core.contracts.constants import ordered_gemm_constants
    from dspark_cute.cutedsl.gemm.ordered import OrderedGemm

    # Every row count (the comparison), not only where the default is faster than cuBLAS.
    return OrderedGemm(ordered_gemm_constants(role, weight), weight, settings=settings)


def check(role, weight, rows, seed):
    """The build-time check of ``role``'s ``weight`` at ``rows`` (``OrderedGemm.check``)."""
    return _gemm(role, weight).check(rows, seed=seed)


def bound(role, weight, result, settings=None, only=None):
    """An ordered GEMM on ``weight`` bound to ``result``'s orders (each weight
    copy has the one check's orders: its shape's; ``only``: that row count's
    alone), compiled."""
    gemm = _gemm(role, weight, settings)
    orders = result.orders if only is None else {only: result.orders[only]}
    gemm.bind_orders(orders, result.refused)
    gemm.prepare()
    return gemm


# --sweep: the streamed kernel's settings (warps, weight tiles, chunk columns, stages).
STREAMED_SWEEP = [(8, 1, 128, 3), (4, 1, 256, 3), (1, 1, 1024, 3), (1, 1, 512, 6), (2, 1, 512, 3), (2, 1, 1024, 2),
                  (4, 1, 512, 2), (1, 1, 1024, 2), (2, 1, 512, 2), (1, 1, 512, 3), (8, 1, 512, 1 + 1), (1, 2, 1024, 2)]


def streamed_choice(n: int, early: bool | None = None):
    """The streamed kernel's default settings per (row count, order) for
    ``n`` outputs (``early``: force the PDL release at the start or end)."""
    from dspark_cute.cutedsl.gemm.streamed import streamed_settings
    from dspark_cute.runtime.host import sm_count

    sms = sm_count()

    def choose(m, o):
        settings = streamed_settings(n, o.splits, m, sms)
        return settings if early is None else settings[:-1] + (early,)

    return choose


def x_rows_for(m: int) -> int:
    from dspark_cute.cutedsl.gemm.streamed import x_rows_for as rows_for

    return rows_for(m)


def streamed_total(settings: tuple) -> int:
    from dspark_cute.cutedsl.gemm.streamed import StreamedLayout

    return StreamedLayout(*settings[1:6]).total


def bitwise(gemm, x, reference) -> bool:
    """Whether ``gemm``'s output on ``x`` equals ``reference`` (cuBLAS's) bit for bit."""
    y = torch.full_like(reference, float("nan"))
    gemm.launch(x, y)
    torch.cuda.synchronize()
    return bool(torch.equal(y.view(torch.int16), reference.view(torch.int16)))


def measure_shape(role, n, k, rows, seed, gen, sweep=False) -> list[dict]:
    copies = max(1, -(-MIN_BYTES // (n * k * 2)))
    weights = _weights(n, k, copies, gen)
    result = check(role, weights[0], rows, seed)
    out = []
    for m in rows:
        row = {"role": role, "n": n, "k": k, "m": m, "copies": copies}
        order = result.orders.get(m)
        row["order"] = None if order is None else [order.tile, order.splits]
        row["refused"] = result.refused.get(m)
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in weights]
        row["cublas_us"] = time_calls([lambda w=w, x=x: F.linear(x, w) for w in weights])
        if order is not None:
            reference = F.linear(x, weights[0])
            gemms = [bound(role, w, result) for w in weights]
            row["dspark_us"] = time_calls([lambda g=g, y=y, x=x: g.launch(x, y) for g, y in zip(gemms, ys)])
            row["settings"] = list(gemms[0]._settings[m])
            row["dspark_bitwise"] = bitwise(gemms[0], x, reference)
            gemms = [bound(role, w, result, streamed_choice(n)) for w in weights]
            row["streamed_us"] = time_calls([lambda g=g, y=y, x=x: g.launch(x, y) for g, y in zip(gemms, ys)])
            row["streamed_settings"] = list(gemms[0]._settings[m])
            row["streamed_bitwise"] = bitwise(gemms[0], x, reference)
            if sweep and m in SWEEP_ROWS:
                row["streamed_sweep"] = {}
                for warps, a_tiles, chunk, stages in STREAMED_SWEEP:
                    fixed = ("streamed", warps, a_tiles, x_rows_for(m), stages, chunk, False)
                    if n % (16 * a_tiles * warps) or k % chunk or streamed_total(fixed) > 227 * 1024:
                        continue
                    gs = [bound(role, w, result, lambda mm, o, f_=fixed: f_, only=m) for w in weights]
                    row["streamed_sweep"][f"{warps}w {a_tiles}a {chunk}c {stages}s"] = time_calls(
                        [lambda g=g, y=y, x=x: g.launch(x, y) for g, y in zip(gs, ys)], trials=3)
                    if not bitwise(gs[0], x, reference):
                        row["streamed_sweep_mismatch"] = f"{warps}w {a_tiles}a {chunk}c {stages}s"
        byte = n * k * 2
        row["cublas_tbs"] = byte / row["cublas_us"] / 1e6
        for side in ("dspark", "streamed"):
            if f"{side}_us" in row:
                row[f"{side}_tbs"] = byte / row[f"{side}_us"] / 1e6
        out.append(row)
        print(json.dumps({k_: v for k_, v in row.items() if k_ != "sweep"}), flush=True)
        if "streamed_sweep" in row:
            ranked = sorted(row["streamed_sweep"].items(), key=lambda kv: kv[1])
            print(f"   streamed sweep {role} m={m} (default {row.get('streamed_settings')} "
                  f"{row.get('streamed_us', 0):.2f}): " + ", ".join(f"{name} {us:.2f}" for name, us in ranked),
                  flush=True)
    del weights
    torch.cuda.empty_cache()
    return out


def measure_chain(rows, seed, gen, tp: int = 1) -> list[dict]:
    """The 14 projections of a step, each its own weight, one graph per side."""
    weights = [_weights(*shard(role, tp), 1, gen)[0] for role in CHAIN]
    results = {}
    for role, w in zip(CHAIN, weights):
        if role not in results:
            results[role] = check(role, w, rows, seed)
    total = sum(w.numel() * 2 for w in weights)
    # As the build decides: each weight bound to its check's orders, then timed
    # against cuBLAS on this card (one decision a shape; the rest from the cache).
    t0 = time.perf_counter()
    decided = [bound(role, w, results[role]) for role, w in zip(CHAIN, weights)]
    for g in decided:
        g.decide()
    decide_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    bound(CHAIN[0], weights[0], results[CHAIN[0]]).decide()
    warm_s = time.perf_counter() - t0
    print(f"the build's decisions: {decide_s:.1f} s cold (with the compiles), {warm_s:.2f} s for one from the "
          f"cache", flush=True)
    for d in dict.fromkeys(g.decision.summary() for g in decided):
        print(f"  {d}", flush=True)
    out = []
    for m in rows:
        xs = [torch.randn(m, w.shape[1], generator=gen, device="cuda").to(torch.bfloat16) for w in weights]
        ys = [torch.empty(m, w.shape[0], dtype=torch.bfloat16, device="cuda") for w in weights]
        stock = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]
        gemms = [bound(role, w, results[role]) for role, w in zip(CHAIN, weights)]
        ours = []
        for g, x, y, f in zip(gemms, xs, ys, stock):
            ours.append((lambda g=g, x=x, y=y: g.launch(x, y)) if g.takes(x, y) else f)
        owned = sum(g.takes(x, y) for g, x, y in zip(gemms, xs, ys))
        streamed = [bound(role, w, results[role], streamed_choice(w.shape[0])) for role, w in zip(CHAIN, weights)]
        ours_s = [(lambda g=g, x=x, y=y: g.launch(x, y)) if g.takes(x, y) else f
                  for g, x, y, f in zip(streamed, xs, ys, stock)]
        exact = all(bitwise(g, x, f()) for g, x, y, f in zip(streamed, xs, ys, stock) if g.takes(x, y))
        late = [bound(role, w, results[role], streamed_choice(w.shape[0], False)) for role, w in zip(CHAIN, weights)]
        ours_l = [(lambda g=g, x=x, y=y: g.launch(x, y)) if g.takes(x, y) else f
                  for g, x, y, f in zip(late, xs, ys, stock)]
        t_stock = time_calls(stock) * len(stock)
        t_ours = time_calls(ours) * len(ours)
        t_streamed = time_calls(ours_s) * len(ours_s)
        t_late = time_calls(ours_l) * len(ours_l)
        ours_d = [(lambda g=g, x=x, y=y: g.launch(x, y)) if g.takes(x, y) else f
                  for g, x, y, f in zip(decided, xs, ys, stock)]
        decided_exact = all(bitwise(g, x, f()) for g, x, y, f in zip(decided, xs, ys, stock) if g.takes(x, y))
        t_decided = time_calls(ours_d) * len(ours_d)
        row = {"m": m, "tp": tp, "bytes": total, "cublas_us": t_stock, "dspark_us": t_ours, "owned": owned,
               "cublas_peak": total / (t_stock * 1e-6) / PEAK, "dspark_peak": total / (t_ours * 1e-6) / PEAK,
               "streamed_us": t_streamed, "streamed_peak": total / (t_streamed * 1e-6) / PEAK,
               "streamed_bitwise": exact, "streamed_late_us": t_late,
               "decided_us": t_decided, "decided_peak": total / (t_decided * 1e-6) / PEAK,
               "decided_owned": sum(g.takes(x, y) for g, x, y in zip(decided, xs, ys)),
               "decided_bitwise": decided_exact, "decide_s": decide_s, "decide_warm_s": warm_s,
               "decided": {role: ("DSpark " + g.decision.rows[m].kernel if g.decision.rows[m].kernel else "cuBLAS")
                           for role, g in zip(CHAIN, decided) if g.decision and m in g.decision.rows}}
        print(json.dumps(row), flush=True)
        out.append(row)
    del weights
    torch.cuda.empty_cache()
    return out


def cublas_kernels(rows, tp: int = 1) -> list[dict]:
    """cuBLAS's kernels (name, grid, block) for one ``F.linear`` per shape and row count."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for role in SHAPES:
        n, k = shard(role, tp)
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            F.linear(x, w)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                F.linear(x, w)
                torch.cuda.synchronize()
            path = f"/tmp/trace_{role}_{m}.json"
            prof.export_chrome_trace(path)
            events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
            kernels = [{"name": e["name"][:90], "grid": e.get("args", {}).get("grid"),
                        "block": e.get("args", {}).get("block")} for e in events]
            out.append({"role": role, "n": n, "k": k, "m": m, "kernels": kernels})
        del w
    return out


def _side(r: dict, side: str) -> str:
    if f"{side}_us" not in r:
        return "- | - | cuBLAS kept"
    exact = "" if r.get(f"{side}_bitwise", True) else " (bits differ)"
    return f"{r[f'{side}_us']:.2f} | {r[f'{side}_tbs']:.2f} | {r['cublas_us'] / r[f'{side}_us']:.3f}x{exact}"


def table(shape_rows, chain_rows, meta) -> str:
    lines = [f"# The ordered GEMMs against cuBLAS ({meta['device']}, {meta['date']}, seed {meta['seed']})", "",
             meta["setup"], "",
             "cp.async: the ordered GEMM (threads copy the weight); streamed: the streamed GEMM (bulk copies, "
             "a pipeline per warp). Each side's output is compared with cuBLAS's bit for bit on the timed "
             "operands (\"bits differ\" where it is not).", "",
             "| projection | N x K | m | cuBLAS's order (tile, splits) | cuBLAS µs | TB/s | cp.async µs | TB/s | "
             "cuBLAS / cp.async | streamed µs | TB/s | cuBLAS / streamed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in shape_rows:
        order = "not found" if r["order"] is None else f"{r['order'][0]}, {r['order'][1]}"
        lines.append(f"| {r['role']} | {r['n']} x {r['k']} | {r['m']} | {order} | {r['cublas_us']:.2f} | "
                     f"{r['cublas_tbs']:.2f} | {_side(r, 'dspark')} | {_side(r, 'streamed')} |")
    if chain_rows:
        lines += ["", "The step's 14 projections chained in one graph (each weight its own):", "",
                  "| TP | m | bytes | cuBLAS µs | of HBM peak | cp.async µs | of HBM peak | streamed µs | of HBM peak "
                  "| owned | cuBLAS / streamed | as decided µs | of HBM peak | DSpark's of 14 | cuBLAS / decided |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in chain_rows:
            exact = "" if r.get("streamed_bitwise", True) else " (bits differ)"
            lines.append(f"| {r['tp']} | {r['m']} | {r['bytes'] / 1e9:.3f} GB | {r['cublas_us']:.1f} | "
                         f"{100 * r['cublas_peak']:.1f}% | {r['dspark_us']:.1f} | {100 * r['dspark_peak']:.1f}% | "
                         f"{r['streamed_us']:.1f} | {100 * r['streamed_peak']:.1f}% | {r['owned']} of 14 | "
                         f"{r['cublas_us'] / r['streamed_us']:.3f}x{exact} | {r['decided_us']:.1f} | "
                         f"{100 * r['decided_peak']:.1f}% | {r['decided_owned']} | "
                         f"{r['cublas_us'] / r['decided_us']:.3f}x"
                         f"{'' if r.get('decided_bitwise', True) else ' (bits differ)'} |")
        r = chain_rows[0]
        lines += ["", f"The build's decisions (bound orders, then timing on this card): {r['decide_s']:.1f} s for "
                  f"the {len(CHAIN)} weights cold (the kernels' compiles included), {r['decide_warm_s']:.2f} s "
                  "for one from the cache. Per projection at each m: " + "; ".join(
                      f"m = {c['m']}: " + ", ".join(f"{k} {v}" for k, v in c["decided"].items())
                      for c in chain_rows)]
    return "\n".join(lines)


def plot(shape_rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    roles = list(dict.fromkeys(r["role"] for r in shape_rows))
    if not roles:
        return
    fig, axes = plt.subplots(1, len(roles), figsize=(3 * len(roles), 3), sharey=True)
    for ax, role in zip(axes if len(roles) > 1 else [axes], roles):
        rs = [r for r in shape_rows if r["role"] == role]
        ax.plot([r["m"] for r in rs], [r["cublas_tbs"] for r in rs], "o-", label="cuBLAS")
        ax.plot([r["m"] for r in rs if "dspark_tbs" in r], [r["dspark_tbs"] for r in rs if "dspark_tbs" in r],
                "s-", label="DSpark ordered")
        ax.axhline(PEAK / 1e12, color="gray", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_title(role, fontsize=9)
        ax.set_xlabel("m")
    if not roles:
        return
    (axes[0] if len(roles) > 1 else axes).set_ylabel("weight TB/s")
    (axes[0] if len(roles) > 1 else axes).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    p.add_argument("--name", default="ordered_gemm")
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--chain-rows", default="1,4,16")
    p.add_argument("--roles", default=",".join(SHAPES))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kernels", default="", help="row counts to list cuBLAS's kernels for (empty: none)")
    p.add_argument("--sweep", action="store_true",
                   help="time the streamed GEMM's settings of STREAMED_SWEEP at m = 1 and 16")
    p.add_argument("--seed", type=int, default=int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31)))
    args = p.parse_args(argv)
    try:
        rows = [int(v) for v in args.rows.split(",") if v]
        chain_rows = [int(v) for v in args.chain_rows.split(",") if v]
        kernel_rows = [int(v) for v in args.kernels.split(",") if v]
        roles = [r for r in args.roles.split(",") if r]
        if any(r not in SHAPES for r in roles) or not all(1 <= m <= 64 for m in rows + chain_rows):
            raise ValueError("roles are " + ", ".join(SHAPES) + "; rows 1 to 64")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_ordered_gemm: no CUDA GPU, nothing to time")
        return 0
    print(f"seed {args.seed}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    global PEAK
    from dspark_core.tools.card import card_facts

    card = card_facts()
    PEAK = card.hbm_peak or float("nan")
    meta = {"device": card.describe(), "card": card.as_dict(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seed": args.seed, "torch": torch.__version__,
            "setup": (f"TP{args.tp} shards of the reference draft's projections; BF16; cuBLAS through torch "
                      f"{torch.__version__} (F.linear, as vLLM calls it); CUDA graphs of back-to-back "
                      f"calls over weight copies of >= 256 MB; HBM peak of this card "
                      f"{PEAK / 1e12:.2f} TB/s.")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape_rows = []
    for role in roles:
        n, k = shard(role, args.tp)
        shape_rows += measure_shape(role, n, k, rows, args.seed, gen, args.sweep)
    chain_rows = measure_chain(chain_rows, args.seed, gen, args.tp) if chain_rows else []
    kernels = cublas_kernels(kernel_rows, args.tp) if kernel_rows else []
    text = table(shape_rows, chain_rows, meta)
    (out / f"{args.name}.md").write_text(text + "\n")
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "shapes": shape_rows, "chain": chain_rows,
                                                      "cublas_kernels": kernels}, indent=1))
    plot(shape_rows, out / f"{args.name}.png")
    for kr in kernels:
        print(f"{kr['role']} m={kr['m']}: " + "; ".join(f"{x['name']} grid {x['grid']}" for x in kr["kernels"]))
    print(text)
    missing = [(r["role"], r["m"]) for r in shape_rows if r["order"] is None]
    if missing:
        print(f"no order found for {missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
