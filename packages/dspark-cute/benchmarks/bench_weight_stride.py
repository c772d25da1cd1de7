"""Experiment: does the weight's row stride hold the tiled GEMMs at 4.0-4.2 TB/s?

The draft's weights have power-of-two row strides (8192 columns: 16 KB), and
a tiled skinny GEMM reads, at any moment, the same 128-byte column piece of
thousands of rows: addresses that differ only in the bits above the stride.
If the memory system's channel hash leaves those requests on few channels,
padding the rows (a stride that is not a power of two) streams faster. The
streamed GEMM (``dspark_cute.cutedsl.gemm.streamed``) reads the weight only
through its tensor map, so the same kernel runs on a row-padded copy.

For gate_up [32768 x 8192] and o_proj [8192 x 4096]
at m = 1: the streamed GEMM on weights whose rows are padded by 0, 64, 128
and 512 columns (CUDA graphs of back-to-back calls over >= 256 MB of
copies, weights from HBM), each output compared with cuBLAS's on the
unpadded weight (one split of 64-column tiles: cuBLAS's order there), and
cuBLAS itself on the contiguous weight. Prints a table; writes
``weight_stride.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"gate_up": (32768, 8192), "o_proj": (8192, 4096)}
PADS = (0, 64, 128, 512)
MIN_BYTES = 256 << 20


def _time(fns) -> float:
    from bench_ordered_gemm import time_calls

    return time_calls(fns)


def measure(name: str, n: int, k: int, gen) -> list[str]:
    from cutlass import Int32, Int64

    from dspark_cute.cutedsl.gemm.streamed import compile_streamed_gemm, streamed_settings
    from dspark_cute.runtime.host import current_stream
    from dspark_cute.runtime.tensormap import weight_tensormap

    m = 1
    settings = streamed_settings(n, 1, m)
    _, warps, a_tiles, x_rows, stages, chunk, early = settings
    kernel = compile_streamed_gemm(k, warps, a_tiles, x_rows, stages, True, chunk, early)
    rows = 16 * a_tiles * warps
    copies = max(1, -(-MIN_BYTES // (n * k * 2)))
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    part = torch.empty(1, dtype=torch.float32, device="cuda")
    counters = torch.zeros(n // 16, dtype=torch.int32, device="cuda")
    lines = []
    dense = [(torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
    t_cublas = _time([lambda w=w: F.linear(x, w) for w in dense])
    lines.append(f"| {name} | cuBLAS, contiguous | {t_cublas:.2f} | {n * k * 2 / t_cublas / 1e6:.2f} | - |")
    reference = F.linear(x, dense[0])
    for pad in PADS:
        ws = []
        for w in dense:
            buf = torch.empty(n, k + pad, dtype=torch.bfloat16, device="cuda")
            buf[:, :k].copy_(w)
            ws.append(buf[:, :k])
        maps = [weight_tensormap(w, rows) for w in ws]
        ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in ws]

        def call(t, y):
            kernel(Int64(x.data_ptr()), Int64(t.data_ptr()), Int64(y.data_ptr()), Int64(part.data_ptr()),
                   Int64(counters.data_ptr()), Int32(m), Int32(n), Int32(1), Int32(1), current_stream())

        call(maps[0], ys[0])
        torch.cuda.synchronize()
        exact = torch.equal(ys[0].view(torch.int16), reference.view(torch.int16))
        t = _time([lambda t_=t_, y=y: call(t_, y) for t_, y in zip(maps, ys)])
        lines.append(f"| {name} | streamed, rows padded by {pad} | {t:.2f} | {n * k * 2 / t / 1e6:.2f} | "
                     f"{'yes' if exact else 'NO'} |")
        print(lines[-1], flush=True)
        del ws, maps, ys
        torch.cuda.empty_cache()
    del dense
    torch.cuda.empty_cache()
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    p.add_argument("--seed", type=int, default=int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31)))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_weight_stride: no CUDA GPU, nothing to time")
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    print(f"seed {args.seed}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    lines = [f"# Weight row stride and streaming ({torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, seed {args.seed})", "",
             "m = 1; µs per call, weights from HBM; bitwise: the streamed output equals cuBLAS's on the "
             "unpadded weight.", "", "| weight | kernel | µs | TB/s | bitwise |", "| --- | --- | --- | --- | --- |"]
    for name, (n, k) in SHAPES.items():
        lines += measure(name, n, k, gen)
    text = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_stride.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
