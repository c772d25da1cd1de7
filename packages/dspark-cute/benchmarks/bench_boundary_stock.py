"""Benchmark: DSpark's residual boundary against vLLM 0.33.0's own, side by
side in one run, on the real stock binaries (scripts/stock/compile_stock.py,
``.device/stock`` or ``DSPARK_STOCK_DIR``).

For H = 8192 and each row count ``m`` (FP32 stream, BF16 weights, per-channel
FP32 gates, the new stream stored), in CUDA graphs (each graph ``--reps``
back-to-back boundaries; the median over ``--replays`` replays, per call),
in ``--rounds`` rounds alternating the order:

- ``stock chain``: the boundary as vLLM's draft layer runs it
  (``MuseSparkDSparkDecoderLayer.forward``): the stock Triton norm of the
  branch, the gated residual's ATen kernels (the branch widened, ``alpha *
  stream``, ``beta * branch``, their sum), the stream cast to BF16 and the
  stock Triton norm of it;
- ``vLLM one-kernel``: vLLM's ``fused_norm_residual_norm_fwd`` (Triton), a
  one-kernel boundary its draft does not run (not bit for bit the chain);
- ``DSpark``: ``DraftBoundary``, bit for bit the stock chain.

Each column's bits are compared with the stock chain's (mismatching elements
of ``out`` and of the new stream). Writes ``bench_boundary_stock.md`` and
``.png`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stock_scripts  # noqa: E402

H = 8192
ROWS = [1, 4, 16, 64, 1024, 4096]
ROOT = Path(__file__).resolve().parents[3]


def _stock():
    """``scripts/stock/launch_stock.py`` (``stock_scripts``)."""
    return stock_scripts.load("launch_stock")


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    from dspark_core.tools.compare import mismatches

    return int(mismatches(a, b).sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--reps", type=int, default=20, help="boundaries per graph")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark times GPU kernels; no GPU here")
        return 0
    stock = _stock()
    missing = stock_scripts.binaries_missing()
    if missing:
        print(missing)
        return 0
    from dspark_core.contracts.constants import BoundaryConstants, NormConstants
    from dspark_core.spec.layers import stock_arch
    from dspark_core.tools.timing import capture_on_side_stream, times_us
    from dspark_cute.cutedsl.norms.boundary import DraftBoundary

    dev = torch.device("cuda")
    arch = stock_arch(dev)
    gen = torch.Generator(device=dev).manual_seed(int(os.environ.get("DSPARK_SEED", "1")))
    post_w = (torch.randn(H, generator=gen, device=dev) * 0.1 + 1).bfloat16()
    pre_w = (torch.randn(H, generator=gen, device=dev) * 0.1 + 1).bfloat16()
    alpha = torch.rand(H, generator=gen, device=dev) + 0.5
    beta = torch.rand(H, generator=gen, device=dev) + 0.25
    eps = 1e-6
    norm = NormConstants(eps=eps, weight_dtype="bf16", gain_center=0.0, weight_before_norm=False, arch=arch)
    fused = DraftBoundary(BoundaryConstants(hidden_size=H, post=norm, pre=norm), alpha, beta, post_w, pre_w)
    fused.prepare(stream_dtypes=(torch.float32,), store_stream=(True,))

    rows = [int(r) for r in args.rows.split(",")]
    table = []
    for m in rows:
        branch = torch.randn(m, H, generator=gen, device=dev).bfloat16()
        stream = torch.randn(m, H, generator=gen, device=dev)

        def chain(branch=branch, stream=stream):
            post = stock.stock_rmsnorm(branch, post_w, eps)
            new = alpha * stream + beta * post.to(torch.float32)
            return stock.stock_rmsnorm(new.to(torch.bfloat16), pre_w, eps), new

        def one_kernel(branch=branch, stream=stream):
            return stock.stock_norm_residual_norm(branch, stream, post_w, pre_w, eps, eps, alpha, beta)

        def dspark(branch=branch, stream=stream):
            new, out = fused.launch(branch, stream, True)
            return out, new

        want_out, want_new = chain()
        bits = {}
        for name, fn in (("vLLM one-kernel", one_kernel), ("DSpark", dspark)):
            out, new = fn()
            bits[name] = (_mismatches(out, want_out), _mismatches(new, want_new))
        paths = {"stock chain": chain, "vLLM one-kernel": one_kernel, "DSpark": dspark}
        replays = {name: capture_on_side_stream([fn], args.reps) for name, fn in paths.items()}
        samples = {name: [] for name in paths}
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                samples[name].append(statistics.median(times_us(replays[name], args.replays, 3, calls=args.reps)))
        med = {name: statistics.median(v) for name, v in samples.items()}
        table.append((m, med, bits))
        print(f"m={m}: " + ", ".join(f"{k} {v:.2f} us" for k, v in med.items()), flush=True)

    lines = [f"# Residual boundary, H = {H}, {torch.cuda.get_device_name()} ({arch}), CUDA graphs, "
             f"medians of {args.rounds} alternating rounds, us per boundary", "",
             "| m | stock chain (vLLM's draft layer) | vLLM one-kernel (Triton) | DSpark | DSpark vs chain | "
             "DSpark vs one-kernel | elements differing from the chain (out / new stream): one-kernel; DSpark |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for m, med, bits in table:
        c, o, d = med["stock chain"], med["vLLM one-kernel"], med["DSpark"]
        lines.append(f"| {m} | {c:.2f} | {o:.2f} | {d:.2f} | {c / d:.2f}x | {o / d:.2f}x | "
                     f"{bits['vLLM one-kernel'][0]} / {bits['vLLM one-kernel'][1]}; "
                     f"{bits['DSpark'][0]} / {bits['DSpark'][1]} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "bench_boundary_stock.md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in ("stock chain", "vLLM one-kernel", "DSpark"):
            ax.plot([t[0] for t in table], [t[1][name] for t in table], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows m")
        ax.set_ylabel("us per boundary")
        ax.set_title(f"residual boundary, H = {H}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(args.out, "bench_boundary_stock.png"), dpi=120)
    except ImportError:
        pass
    return 1 if any(bits["DSpark"] != (0, 0) for _, _, bits in table) else 0


if __name__ == "__main__":
    sys.exit(main())
