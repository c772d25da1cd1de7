"""Benchmark of the QKV front (``dspark_cute.QKVFront``) at the reference shape:
H 8192, 64 heads, 8 KV heads, head_dim 64 (QKV weight 9216 x 8192 BF16,
151 MB), m in {1, 4, 16} tokens.

Timed (median of trials, microseconds per call):

- the front, in a CUDA graph (with PDL, the default; and without);
- the cuBLAS projection alone (``torch.mm(x, W.t())``), in a CUDA graph;
- the stock unfused chain ``DraftAttention.front`` (projection, QK-norm,
  RoPE, K/V insert), eager: its host-side range checks synchronize, so it
  cannot be captured in a graph.

Each graph alternates two copies of the weight, so no call finds its weight
in L2 (50 MB) from the call before. The weight bandwidth is 151 MB / time.
``--sweep`` also times other main-loop shapes (k_warps, stages). Writes
``qkv_front.md`` (markdown tables) and ``qkv_front.png`` into ``--out``
(default ``bench-results/``, or ``DSPARK_BENCH_OUT``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from pathlib import Path

import torch

HBM_TBS = 4.3
ROWS_M = (1, 4, 16)


def time_graph(calls: list, launches: int = 24, replays: int = 10, trials: int = 7) -> float:
    """Median microseconds per call of ``calls`` (cycled) replayed in a graph."""
    from dspark_core.tools.timing import capture_on_side_stream

    replay = capture_on_side_stream(calls, launches, wait=False)
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (replays * launches))
    return statistics.median(times)


def front_calls(fronts: list, x, step, cache, outs: list) -> list:
    """One launch per front (weight copy), each into its own output."""
    return [functools.partial(f.launch, x, step.positions, step.slots, cache.tensor, o) for f, o in zip(fronts, outs)]


def time_eager(calls: list, iters: int = 60, trials: int = 5) -> float:
    for f in calls:
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            calls[i % len(calls)]()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    parser.add_argument("--sweep", action="store_true", help="also time other main-loop shapes")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from dspark_core.contracts.constants import QKVFrontConstants
    from dspark_core.reference.config import DraftConfig
    from dspark_core.reference.model import DraftAttention, StepInputs
    from dspark_core.spec.layers import PagedKVCache, Rotary
    from dspark_cute.cutedsl.qkv.front import QKVFront

    cfg = DraftConfig()
    gen = torch.Generator(device="cuda").manual_seed(0)
    # On the GPU, so the stock chain does not copy the table each call.
    rotary = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta, torch.bfloat16).cuda()
    table = rotary.cos_sin
    attns = []
    for _ in range(2):
        attn = DraftAttention(cfg, rotary).cuda()
        w = torch.randn(attn.qkv_proj.shape, generator=gen, device="cuda") / cfg.hidden_size**0.5
        attn.qkv_proj.data.copy_(w.to(torch.bfloat16))
        attns.append(attn)
    weight_bytes = attns[0].qkv_proj.numel() * 2
    eps = cfg.head_norm_eps
    constants = QKVFrontConstants(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                  q_weight=False, q_eps=eps, k_eps=eps, rope=True, table_dtype="bf16")
    device = torch.cuda.get_device_name()

    def fronts(**kw):
        fs = [QKVFront(constants, a.qkv_proj, None, table, **kw) for a in attns]
        for f in fs:
            f.prepare()
        return fs

    default = fronts()
    no_pdl = fronts(pdl=False)
    cache = PagedKVCache(64, cfg.num_kv_heads, cfg.kv_block_size, cfg.head_dim, "cuda")
    rows = []
    for m in ROWS_M:
        x = torch.randn((m, cfg.hidden_size), generator=gen, device="cuda").to(torch.bfloat16)
        step = StepInputs.block(100, m, "cuda")
        outs = [torch.empty((m, default[0].rows), dtype=torch.bfloat16, device="cuda") for _ in range(2)]

        t_front = time_graph(front_calls(default, x, step, cache, outs))
        t_nopdl = time_graph(front_calls(no_pdl, x, step, cache, outs))
        t_cublas = time_graph([functools.partial(torch.mm, x, a.qkv_proj.t(), out=o) for a, o in zip(attns, outs)])
        t_stock = time_eager([functools.partial(a.front, x, step, cache) for a in attns])
        rows.append((m, t_front, t_nopdl, t_cublas, t_stock))
        print(f"m={m}: front {t_front:.1f} us, no PDL {t_nopdl:.1f}, cuBLAS {t_cublas:.1f}, stock {t_stock:.1f}",
              flush=True)

    def tbs(t: float) -> float:
        return weight_bytes / (t * 1e-6) / 1e12

    lines = [
        f"# QKV front, {device}",
        "",
        f"H {cfg.hidden_size}, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}: "
        f"weight {default[0].rows} x {cfg.hidden_size} BF16 ({weight_bytes / 1e6:.0f} MB). Median us per call; "
        "graphs alternate two weight copies (no L2 reuse). Bandwidth = weight bytes / time; "
        f"% of {HBM_TBS} TB/s HBM.",
        "",
        "| m | front (graph, PDL) | front (graph, no PDL) | cuBLAS projection (graph) | stock chain (eager) "
        "| front / cuBLAS | front TB/s | % HBM | cuBLAS TB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, tf, tn, tc, ts in rows:
        lines.append(
            f"| {m} | {tf:.1f} | {tn:.1f} | {tc:.1f} | {ts:.1f} | {tf / tc:.3f} | {tbs(tf):.2f} | "
            f"{100 * tbs(tf) / HBM_TBS:.1f} | {tbs(tc):.2f} |"
        )

    # Written now and again after the sweep (so a cut-short sweep keeps the main table).
    (out_dir / "qkv_front.md").write_text("\n".join(lines) + "\n")
    if args.sweep:
        lines += ["", "## Main-loop shapes (graph, PDL)", "",
                  "| k_warps | stages | copies | smem KB (m<=16) | m | us | TB/s |", "|---|---|---|---|---|---|---|"]
        for kw, st, cp in ((8, 2, "lane"), (4, 4, "lane"), (4, 5, "lane"), (4, 4, "rows"), (4, 6, "rows")):
            fs = fronts(k_warps=kw, stages=st, copy=cp)
            for m in ROWS_M:
                x = torch.randn((m, cfg.hidden_size), generator=gen, device="cuda").to(torch.bfloat16)
                step = StepInputs.block(100, m, "cuda")
                outs = [torch.empty((m, fs[0].rows), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
                t = time_graph(front_calls(fs, x, step, cache, outs))
                lines.append(f"| {kw} | {st} | {cp} | {fs[0].configs[2].smem_bytes / 1024:.0f} | {m} | {t:.1f} | "
                             f"{tbs(t):.2f} |")
                print(lines[-1], flush=True)

    text = "\n".join(lines) + "\n"
    (out_dir / "qkv_front.md").write_text(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ["front (PDL)", "front (no PDL)", "cuBLAS projection", "stock chain (eager)"]
    width = 0.2
    for i, label in enumerate(labels):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[i + 1] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [f"m={r[0]}" for r in rows])
    ax.set_ylabel("us per call")
    ax.set_yscale("log")
    ax.set_title(f"QKV front, 9216 x 8192 BF16 weight ({device})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "qkv_front.png", dpi=120)


if __name__ == "__main__":
    main()
