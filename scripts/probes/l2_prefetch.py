"""Probe (not part of any package): does prefetching the first bytes of each
weight row into L2, while latency-bound kernels run, shorten the next cuBLAS
GEMM at m = 1? Each case is a CUDA graph of [a 256 MB GEMM that flushes L2, a
~4 us one-CTA "small kernel" (that also issues the prefetches), the GEMM];
the GEMM's share is the graph's time minus the graph without it.

Measured on an H200 (2026-11-30, weights of the reference draft):
per-line ``prefetch.global.L2::evict_last`` from 32 CTAs saved 1.4-3.0 us per
GEMM (QKV 43.5 -> 41.6, o_proj 19.3 -> 17.0, gate_up 127.6 -> 124.6, down
66.7 -> 65.3), best at 256-512 bytes a row (what lands in the ~4 us window);
larger chunks and ``cp.async.bulk.prefetch.L2`` from one CTA made the GEMM
slower. Raw CUDA through cupy, for a quick answer; a product version would
be CuTe DSL. Run on one GPU with dspark-core importable, e.g.
``PYTHONPATH=packages/dspark-core/src python scripts/probes/l2_prefetch.py``."""
import functools

import cupy as cp
import torch

from dspark_core.tools.timing import capture, median_us

SRC = r'''
extern "C" __global__ void prefetch_rows(const char* w, long long row_bytes, int rows, int chunk, long long spin) {
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
        const char* a = w + (long long)r * row_bytes;
        if (chunk > 0)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(chunk) : "memory");
    }
    if (spin > 0 && threadIdx.x == 0) {
        long long t0 = clock64();
        while (clock64() - t0 < spin) {}
    }
}
extern "C" __global__ void prefetch_lines(const char* w, long long row_bytes, int rows, int chunk, long long spin) {
    // plain per-line prefetch.global.L2 (128 B lines)
    int lines = chunk / 128;
    long long total = (long long)rows * lines;
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        long long r = i / lines, l = i % lines;
        const char* a = w + r * row_bytes + l * 128;
        asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(a) : "memory");
    }
    if (spin > 0 && threadIdx.x == 0) {
        long long t0 = clock64();
        while (clock64() - t0 < spin) {}
    }
}
'''
mod = cp.RawModule(code=SRC, options=("-arch=sm_90a",))
K_ROWS = mod.get_function("prefetch_rows")
K_LINES = mod.get_function("prefetch_lines")


def launch(kernel, w, chunk, spin, grid=1, block=256):
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # torch's stream
    with stream:
        kernel((grid,), (block,), (cp.uint64(w.data_ptr()), cp.int64(w.stride(0) * 2), cp.int32(w.shape[0]),
                                   cp.int32(chunk), cp.int64(spin)))


def timed(fn, reps=200):
    """Median microseconds of a CUDA graph of one ``fn()`` (dspark_core.tools.timing)."""
    return median_us(capture(fn, side_stream=True), reps, warmup=10)


def _graph_body(flush, xf, kern, w, x, chunk, spin, grid, gemm: bool) -> None:
    """One case: the flushing GEMM, the small kernel (with its prefetches), and the GEMM."""
    xf @ flush.t()
    launch(kern, w, chunk, spin, grid)
    if gemm:
        x @ w.t()


def main():
    torch.manual_seed(0)
    dev = "cuda"
    flush = torch.randn(16384, 8192, device=dev, dtype=torch.bfloat16)  # 256 MB between uses
    xf = torch.randn(1, 8192, device=dev, dtype=torch.bfloat16)
    shapes = {"qkv 9216x8192": (9216, 8192), "o 8192x4096": (8192, 4096), "gate_up 32768x8192": (32768, 8192),
              "down 8192x16384": (8192, 16384)}
    spin = 1980 * 4  # ~4 us at 1.98 GHz
    print("| weight | chunk B/row | kernel | flush+spin+GEMM (us) | minus flush+spin | GEMM alone (us) |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)

        def case(kern, chunk, grid, gemm=True, w=w, x=x):
            return timed(functools.partial(_graph_body, flush, xf, kern, w, x, chunk, spin, grid, gemm))

        base = case(K_ROWS, 0, 1, gemm=False)
        alone = case(K_ROWS, 0, 1) - base
        for kname, kern, grid in (("bulk", K_ROWS, 1), ("bulk", K_ROWS, 8), ("lines", K_LINES, 32)):
            for chunk in (256, 512, 1024, 2048):
                t = case(kern, chunk, grid)
                print(f"| {name} | {chunk} | {kname} x{grid} | {t:.1f} | {t - base:.1f} | {alone:.1f} |")
        t = case(K_ROWS, 1024, 8, gemm=False)  # the prefetching kernel alone: its cost past its spin
        print(f"| {name} | 1024 | bulk x8, no GEMM | {t:.1f} | {t - base:.1f} | - |")


if __name__ == "__main__":
    main()
