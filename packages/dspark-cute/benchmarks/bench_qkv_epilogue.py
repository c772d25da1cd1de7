"""Benchmark: DSpark's QKV epilogue (``cutedsl.qkv.epilogue.QKVEpilogue``)
against vLLM 0.33.0's ``fused_muse_spark_qknorm_rope_kv_insert`` from its
binary (``scripts/stock/launch_stock.py``, ``.device/stock``), side by side
in one run.

The reference draft's attention (64 q heads, 8 KV heads of 64, BF16 ``qkv``
rows ``[q, k, v, o_gate]``, eps 1e-6), RoPE with the FP32 table (every layer
but the first) and the BF16 one (layer 0), the cache LBHNC (contiguous) and
LBNHC (vLLM's default on sm_90, through its strides), both sides launched
with PDL, in place, for each row count ``m`` of ``--rows``: distinct random
slots, random positions. Each path is a CUDA graph of ``--calls``
back-to-back launches; the median over ``--replays`` replays per round, the
median over ``--rounds`` rounds alternating the order, in us per launch.

Before timing, one call of each path on copies of the same operands:
the elements of ``qkv`` and of the whole cache that differ from the stock's
as bits (0 expected). Columns: ``DSpark`` as the host launches it (the
grid chosen from the row count, ``epilogue.FLAT_ABOVE``), and with
``--grids`` (default) each grid alone, ``per-token`` and ``flat``. The
stock is its binary's one-head-per-8-lanes instance (N = 1) at every m
(``launch_stock``; the stock host picks N = 2 or 4 above about 420
tokens of this draft). Writes ``bench_qkv_epilogue.md`` and
``.png`` into ``--out`` and prints the table; exit status 1 where any bit
differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stock_scripts  # noqa: E402
from bench_boundary_stock import _stock  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LAYOUTS = ("LBHNC", "LBNHC")
TABLES = ("fp32", "bf16")
HEADS, KV, D, EPS = 64, 8, 64, 1e-6
NUM_BLOCKS, BLOCK, MAX_POSITION = 640, 16, 8192


def cache_of(layout: str) -> torch.Tensor:
    """The logical ``[NUM_BLOCKS, KV, BLOCK, 128]`` view in ``layout``'s physical order, zeroed."""
    if layout == "LBHNC":
        return torch.zeros(NUM_BLOCKS, KV, BLOCK, 2 * D, dtype=torch.bfloat16, device="cuda")
    return torch.zeros(NUM_BLOCKS, BLOCK, KV, 2 * D, dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    from dspark_core.tools.compare import mismatches

    return int(mismatches(a, b).sum())


def main(argv=None) -> int:
    from dspark_cute.cutedsl.qkv import epilogue as qe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--calls", type=int, default=100, help="launches per graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-grids", action="store_true", help="time DSpark as launched only, not each grid alone")
    p.add_argument("--seed", type=int, default=int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31)))
    args = p.parse_args(argv)
    # Column name: the threshold of (token, head) pairs above which the flat grid runs.
    grids = {"DSpark": qe.FLAT_ABOVE} if args.no_grids else {"DSpark": qe.FLAT_ABOVE, "per-token": 2**31,
                                                               "flat": -1}
    if not torch.cuda.is_available():
        print("this benchmark times GPU kernels; no GPU here")
        return 0
    stock = _stock()
    missing = stock_scripts.binaries_missing()
    if missing:
        print(missing)
        return 0
    from dspark_core.contracts.constants import QKVEpilogueConstants
    from dspark_core.spec.layers import Rotary
    from dspark_core.tools.timing import capture_on_side_stream, times_us

    print(f"seed {args.seed}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows_w = 2 * HEADS * D + 2 * KV * D
    table, epis = {}, {}
    for t in TABLES:
        table[t] = Rotary(D, MAX_POSITION, table_dtype=torch.float32 if t == "fp32" else torch.bfloat16).cuda().cos_sin
        c = QKVEpilogueConstants(hidden_size=8192, num_heads=HEADS, kv_heads=KV, q_weight=False, q_eps=EPS, k_eps=EPS,
                              rope=True, table_dtype=t)
        for name, above in grids.items():
            e = qe.QKVEpilogue(c, None, table[t], pdl=True)
            e.flat_above = above
            e.prepare()
            epis[t, name] = e
    results = []
    for m in [int(r) for r in args.rows.split(",")]:
        for layout in LAYOUTS:
            for t in TABLES:
                qkv0 = torch.randn(m, rows_w, generator=gen, device="cuda").bfloat16()
                pos = torch.randint(0, MAX_POSITION, (m,), generator=gen, device="cuda")
                slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen, device="cuda")[:m].clone()

                def stock_call(qkv, cache, t=t, pos=pos, slots=slots):
                    stock.stock_qknorm_rope_kv_insert(qkv, pos, HEADS, KV, D, EPS, table[t], D, slots, cache, BLOCK,
                                                      pdl=True)

                paths = {"vLLM": stock_call}
                for name in grids:
                    paths[name] = lambda qkv, cache, e=epis[t, name], pos=pos, slots=slots: e.launch(
                        qkv, pos, slots, cache)
                want_q, want_c = qkv0.clone(), cache_of(layout)
                stock_call(want_q, want_c)
                bits = {}
                for name, fn in paths.items():
                    q, cache = qkv0.clone(), cache_of(layout)
                    fn(q, cache)
                    bits[name] = differing(q, want_q) + differing(cache, want_c)
                work = {name: (qkv0.clone(), cache_of(layout)) for name in paths}
                replays = {name: capture_on_side_stream([lambda fn=fn, w=work[name]: fn(*w)], args.calls)
                           for name, fn in paths.items()}
                samples = {name: [] for name in paths}
                for r in range(args.rounds):
                    for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
                        samples[name].append(statistics.median(times_us(replays[name], args.replays, 3,
                                                                        calls=args.calls)))
                med = {name: statistics.median(s) for name, s in samples.items()}
                results.append((m, layout, t, med, bits))
                print(f"m={m} {layout} {t}: " + ", ".join(f"{k} {v:.3f} us ({bits[k]} bits off)"
                                                         for k, v in med.items()), flush=True)
    names = ["vLLM", *grids]
    lines = [f"# QKV epilogue: 64 q / 8 KV heads of 64, {torch.cuda.get_device_name()}, CUDA graphs of {args.calls} "
             f"launches, PDL, medians of {args.rounds} alternating rounds, us per launch (seed {args.seed})", "",
             "| m | cache | table | " + " | ".join(names) + " | " + " | ".join(f"vLLM / {n}" for n in names[1:])
             + " | elements differing from vLLM |",
             "|" + " --- |" * (4 + 2 * len(names) - 1)]
    for m, layout, t, med, bits in results:
        lines.append(f"| {m} | {layout} | {t} | " + " | ".join(f"{med[n]:.3f}" for n in names) + " | "
                     + " | ".join(f"{med['vLLM'] / med[n]:.3f}x" for n in names[1:]) + " | "
                     + ", ".join(str(bits[n]) for n in names[1:]) + " |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "bench_qkv_epilogue.md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(11, 4), sharey=True)
        for ax, layout in zip(axes, LAYOUTS):
            for n in names:
                for t, style in zip(TABLES, ("-", "--")):
                    pts = [(m, med[n]) for m, lay, tt, med, _ in results if lay == layout and tt == t]
                    ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=f"{n} {t}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("rows m")
            ax.set_title(f"QKV epilogue, {layout} cache")
        axes[0].set_ylabel("us per launch")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(Path(args.out, "bench_qkv_epilogue.png"), dpi=120)
    except ImportError:
        pass
    return 1 if any(any(b for b in bits.values()) for *_, bits in results) else 0


if __name__ == "__main__":
    sys.exit(main())
