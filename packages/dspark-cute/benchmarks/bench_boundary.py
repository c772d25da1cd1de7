"""Benchmark of the fused boundary and row norm against the stock chain.

Times, in CUDA graphs (each graph holds ``--reps`` back-to-back launches;
the median over ``--replays`` replays, divided by ``--reps``), for H = 8192
and each row count ``m``:

- ``DraftBoundary`` (FP32 stream, new stream stored, BF16 weights; its
  default variant) and ``RowNorm`` (BF16 in/out, BF16 weight);
- the stock eager chain (``dspark_core.spec.layers``: ``residual_boundary``, and
  ``RMSNorm``), captured in a graph too;
- the same chains under ``torch.compile`` (Inductor, dynamic shapes; skip
  with ``--no-inductor``);
- an empty CuTe kernel (the launch floor) and a device-to-device copy (the
  bandwidth ceiling); at large m the kernels' bandwidth against it.

Prints a markdown table and writes ``bench_boundary.md`` and
``bench_boundary.png`` into ``--out`` (default ``$DSPARK_BENCH_OUT`` or
``bench-results/``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import cutlass.cute as cute
import torch

H = 8192
ROWS = [1, 4, 16, 64, 1024, 4096]


def time_graph(fn, reps: int, replays: int) -> float:
    """Microseconds per call of ``fn``: a graph of ``reps`` calls, replayed."""
    from dspark_core.tools.timing import capture_on_side_stream, median_us

    return median_us(capture_on_side_stream([fn], reps), replays, calls=reps)


class Empty:
    """A kernel of one CTA of 32 threads that does nothing (the launch floor)."""

    @cute.jit
    def __call__(self, stream):
        self.kernel().launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self):
        pass


def empty_kernel():
    """The compiled ``Empty`` kernel, as a callable on the current stream."""
    from dspark_cute.runtime.host import compile_kernel, current_stream, fake_stream

    compiled = compile_kernel(Empty(), fake_stream())
    return lambda: compiled(current_stream())


def build(gen):
    from dspark_core.contracts.constants import boundary_constants, row_norm_constants
    from dspark_core.reference.adapter import norm_description
    from dspark_core.runtime import description as D
    from dspark_core.spec.layers import GatedResidual, RMSNorm, stock_arch
    from dspark_cute import DraftBoundary, RowNorm

    post = RMSNorm(H, 1e-6).cuda()
    pre = RMSNorm(H, 1e-6).cuda()
    for norm in (post, pre):
        norm.weight.data.copy_((torch.randn(H, generator=gen, device="cuda") * 0.1 + 1).bfloat16())
    conn = GatedResidual(H).cuda()
    conn.alpha.data.copy_(torch.rand(H, generator=gen, device="cuda") + 0.5)
    conn.beta.data.copy_(torch.randn(H, generator=gen, device="cuda"))
    # The constants as the planner builds them, with the device's stock tree.
    arch = stock_arch("cuda")
    post_d, pre_d = norm_description("the post-norm", post, H), norm_description("the pre-norm", pre, H)
    described = D.Boundary("the boundary", post_d, D.Connection("the connection", conn, conn.alpha, conn.beta), pre_d)
    boundary = DraftBoundary(
        boundary_constants(described, H, arch), conn.alpha, conn.beta, post.weight, pre.weight
    )
    boundary.prepare(stream_dtypes=(torch.float32,), store_stream=(True,))
    row_norm = RowNorm(row_norm_constants(pre_d, H, torch.bfloat16, arch), pre.weight)
    row_norm.prepare()
    return post, conn, pre, boundary, row_norm


def copy_bandwidth(replays: int) -> float:
    """GB/s of a device-to-device copy of 256 MiB (bytes read + written)."""
    src = torch.empty(128 * 2**20, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda: dst.copy_(src), 4, replays)
    return 2 * src.numel() * src.element_size() / us / 1e3


def time_rows(m, gen, args, boundary, row_norm, stock_boundary, stock_norm, compiled_boundary,
              compiled_norm) -> dict:
    """The timings of every method at ``m`` rows (us) and the fused kernels'
    bandwidth (GB/s of row operands; the constants, a few hundred KB, are
    left out)."""
    branch = torch.randn((m, H), generator=gen, device="cuda").bfloat16()
    stream = torch.randn((m, H), generator=gen, device="cuda")
    out = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
    new_stream = torch.empty((m, H), dtype=torch.float32, device="cuda")
    norm_out = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
    row = {"m": m, "variant": boundary.variant(m, stream.dtype, True)}
    row["boundary"] = time_graph(
        lambda: boundary.launch(branch, stream, True, out, new_stream), args.reps, args.replays
    )
    row["norm"] = time_graph(lambda: row_norm.launch(branch, norm_out), args.reps, args.replays)
    reps = max(2, args.reps // 4)
    row["eager_boundary"] = time_graph(lambda: stock_boundary(branch, stream), reps, args.replays)
    row["eager_norm"] = time_graph(lambda: stock_norm(branch), reps, args.replays)
    if compiled_boundary is not None:
        t0 = time.time()
        row["inductor_boundary"] = time_graph(
            lambda: compiled_boundary(branch, stream), args.reps, args.replays
        )
        row["inductor_norm"] = time_graph(lambda: compiled_norm(branch), args.reps, args.replays)
        print(f"m={m}: Inductor timed (with any compile) in {time.time() - t0:.1f} s", flush=True)
    row["boundary_gbs"] = m * H * (2 + 4 + 4 + 2) / row["boundary"] / 1e3
    row["norm_gbs"] = m * H * (2 + 2) / row["norm"] / 1e3
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--replays", type=int, default=25)
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_boundary: no CUDA GPU here; nothing to time", file=sys.stderr)
        return 0
    os.makedirs(args.out, exist_ok=True)
    from dspark_core.spec.layers import residual_boundary

    gen = torch.Generator(device="cuda").manual_seed(0)
    post, conn, pre, boundary, row_norm = build(gen)
    floor = time_graph(empty_kernel(), args.reps, args.replays)

    def stock_boundary(b, s):
        return residual_boundary(post, conn, pre, b, s)

    def stock_norm(x):
        return pre(x)

    compiled_boundary = compiled_norm = None
    if not args.no_inductor:
        compiled_boundary = torch.compile(stock_boundary, dynamic=True)
        compiled_norm = torch.compile(stock_norm, dynamic=True)

    copy_bw = copy_bandwidth(args.replays)
    results = []
    for m in args.rows:
        row = time_rows(m, gen, args, boundary, row_norm, stock_boundary, stock_norm,
                        compiled_boundary, compiled_norm)
        results.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()

    table = render(results, floor, copy_bw)
    print(table)
    with open(os.path.join(args.out, "bench_boundary.md"), "w") as f:
        f.write(table + "\n")
    plot(results, floor, os.path.join(args.out, "bench_boundary.png"))
    return 0


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(results, floor: float, copy_bw: float) -> str:
    name = torch.cuda.get_device_name()
    lines = [
        f"H = {H}, {name}; CUDA graphs, median us per call. Empty kernel: {floor:.2f} us. "
        f"D2D copy: {copy_bw:.0f} GB/s.",
        "",
        "| m | boundary | eager | Inductor | vs eager | vs Inductor | GB/s (% copy) "
        "| row norm | eager | Inductor | vs Inductor | GB/s (% copy) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ib, inorm = r.get("inductor_boundary"), r.get("inductor_norm")
        vs_ib = "-" if ib is None else f"{ib / r['boundary']:.2f}x"
        vs_inorm = "-" if inorm is None else f"{inorm / r['norm']:.2f}x"
        lines.append(
            f"| {r['m']} | {_fmt(r['boundary'])} | {_fmt(r['eager_boundary'])} "
            f"| {_fmt(ib)} "
            f"| {r['eager_boundary'] / r['boundary']:.1f}x | {vs_ib} "
            f"| {r['boundary_gbs']:.0f} ({100 * r['boundary_gbs'] / copy_bw:.0f}%) "
            f"| {_fmt(r['norm'])} | {_fmt(r['eager_norm'])} | {_fmt(inorm)} | {vs_inorm} "
            f"| {r['norm_gbs']:.0f} ({100 * r['norm_gbs'] / copy_bw:.0f}%) |"
        )
    return "\n".join(lines)


def plot(results, floor: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot", file=sys.stderr)
        return
    ms = [r["m"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("boundary", "norm")):
        keys = [(kind, "CuTe (fused)"), (f"eager_{kind}", "eager"), (f"inductor_{kind}", "Inductor")]
        for key, label in keys:
            if all(key in r for r in results):
                ax.plot(ms, [r[key] for r in results], marker="o", label=label)
        ax.axhline(floor, color="gray", linestyle=":", label="empty kernel")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows m")
        ax.set_ylabel("us per call (CUDA graph)")
        ax.set_title(f"{'residual boundary' if kind == 'boundary' else 'row norm'}, H = {H}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
