"""Probe (not part of any package): how close to the HBM roofline do the
decode's weight-streaming GEMMs get at m = 1 (and the TP shard's m = 16), and
what load pattern gets there?

For each weight shape of the reference draft (and the TP8 shard 8192 x 1024),
timed per call in a CUDA graph of back-to-back calls that rotate over enough
weight copies that every call streams its weight from HBM (>= 320 MB a cycle):

- cuBLAS ``x @ W.t()``;
- the skinny main loop (``dspark_comm.PackageGemm``, plain epilogue, no PDL)
  for several ``(k_warps, stages)``;
- raw CUDA-core GEMVs (m = 1 only, through cupy): a warp per ``R`` rows over
  the whole K, each lane loading 16 contiguous bytes (a warp 512 contiguous
  bytes a row) ``U`` times per row per iteration with ``ld.global.nc``.

Measured on an H200 (2026-11-30, us per call, weights streamed from HBM):

| weight | cuBLAS | skinny kw4 st8 | same, permuted weight | raw GEMV (best R, U) |
|---|---|---|---|---|
| qkv 9216 x 8192 | 43.4 | 47.6 | 44.5 | 37.6 (R2 U4) |
| o_proj 8192 x 4096 | 19.1 | 22.7 | 21.4 | 18.1 (R2 U4) |
| gate_up 32768 x 8192 | 128.8 | 134.7 | 130.5 | 124.4 (R4 U4) |
| down 8192 x 16384 | 66.5 | 91.9 | 67.7 | 64.4 (R2 U4) |
| 8192 x 1024 (m = 1) | 6.7 | 9.4 | 8.4 | 5.8 (R2 U4) |

The warp-per-row GEMV (a warp reads 512 contiguous bytes of a row per load)
beat cuBLAS everywhere at m = 1: that became ``dspark_cute.cutedsl.gemm.gemv``. The skinny
MMA main loop's 8-rows-by-64-bytes loads trail it; pre-permuting the weight
so each warp load is 512 contiguous bytes closed most of the gap (down:
91.9 -> 67.7) without changing its sums.

Prints a table (us, and TB/s of weight). Run on one GPU with the packages on
PYTHONPATH (as ``scripts/gpu-check.sh`` sets it):
``python scripts/probes/skinny_sweep.py``."""
import sys

import cupy as cp
import torch

from dspark_core.tools.timing import capture, median_us

SRC = r'''
template <int R, int U>
__global__ void gemv(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                     unsigned short* __restrict__ y, int n, int k) {
    int lane = threadIdx.x & 31;
    int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (row0 >= n) return;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int k0 = lane * 8; k0 < k; k0 += 256 * U) {
        uint4 wv[R][U];
        uint4 xv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4* p = reinterpret_cast<const uint4*>(w + (long long)(row0 + r) * k + k0 + 256 * u);
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(wv[r][u].x), "=r"(wv[r][u].y), "=r"(wv[r][u].z), "=r"(wv[r][u].w) : "l"(p));
            }
            xv[u] = *reinterpret_cast<const uint4*>(x + k0 + 256 * u);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            unsigned xs[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                unsigned ws[4] = {wv[r][u].x, wv[r][u].y, wv[r][u].z, wv[r][u].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[r] += __uint_as_float(ws[j] << 16) * __uint_as_float(xs[j] << 16);
                    acc[r] += __uint_as_float(ws[j] & 0xffff0000u) * __uint_as_float(xs[j] & 0xffff0000u);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float v = acc[r];
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) y[row0 + r] = (unsigned short)(__float_as_uint(v) >> 16);
    }
}
'''
GEMV_SHAPES = [(1, 4), (2, 4), (4, 2), (4, 4), (8, 2), (2, 8)]
SKINNY = [(4, 4), (4, 8)]
SHAPES = {  # name: (N, K, rows)
    "qkv 9216x8192": (9216, 8192, (1,)),
    "o_proj 8192x4096": (8192, 4096, (1,)),
    "gate_up 32768x8192": (32768, 8192, (1,)),
    "down 8192x16384": (8192, 16384, (1,)),
    "tp8 shard 8192x1024": (8192, 1024, (1, 16)),
    "tp2 o_proj shard 8192x4096": (8192, 4096, (16,)),
}


def permuted_offset(cfg, warp, lane, step: int, load: int):
    """The permuted layout's weight_offset: a warp's copies of one step and
    load are 512 contiguous bytes, its whole K-slice one contiguous run."""
    from dspark_cute.cutedsl.gemm.skinny import config as sg

    return ((warp * cfg.steps + step) * sg.W_LOADS + load) * 256 + lane * 8


def permute_weight(w, kw):
    """W [N, K] rearranged so that ``permuted_offset`` reads what
    ``skinny_gemm.weight_offset`` reads in the plain layout."""
    n, k = w.shape
    steps = k // (32 * kw)
    v = w.view(n // 64, 4, 2, 8, kw, steps, 4, 8)  # tile, i, h, g | warp, step, t, e
    return v.permute(0, 4, 5, 1, 2, 3, 6, 7).contiguous().view(n, k)


def compiled(g, m, permuted):
    """Compile ``g``'s plain kernel for ``m`` rows, with the permuted map if asked."""
    from dspark_cute.cutedsl.gemm.skinny import config as sg

    plain = sg.weight_offset
    if permuted:
        sg.weight_offset = permuted_offset
    try:
        g._kernel(m, False)
    finally:
        sg.weight_offset = plain


def case(name, n, k, m, ws, mod, names, rows):
    """Every kernel on one (weight shape, m); appends ``(name, m, kernel, us, rel. error)`` to rows."""
    from dspark_comm.cutedsl.package_gemm import PackageGemm
    from dspark_core.contracts.constants import PackageGemmConstants

    copies = len(ws)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ ws[0].double().t()

    def timed(fn):
        replay = capture(lambda: [fn(i) for i in range(copies)], calls=4)
        return median_us(replay, 30, warmup=3, calls=4 * copies)

    def row(kind, us, err):
        rows.append((name, m, kind, us, err))
        print(f"{name} m={m} {kind}: {us:.2f} us {n * k * 2 / us / 1e6:.2f} TB/s rel.err {err:.2e}", flush=True)

    def err_of(o):
        return float((o.double() - ref).abs().max() / ref.abs().max())

    row("cuBLAS", timed(lambda i: torch.matmul(x, ws[i].t(), out=out)), err_of(x @ ws[0].t()))
    for kw, st in SKINNY:
        for permuted in (False, True):
            role = "probe-permuted" if permuted else "probe"
            c = PackageGemmConstants(role=role, hidden_size=n, k_shard=k, tile_n=64, split_k=1, max_rows=16)
            try:
                gs = [PackageGemm(c, permute_weight(w, kw) if permuted else w, k_warps=kw, stages=st, pdl=False)
                      for w in ws]
                compiled(gs[0], m, permuted)
            except Exception as e:  # noqa: BLE001 - a probe: note and go on
                print(f"skip skinny kw{kw} st{st}: {type(e).__name__}: {e}")
                continue
            err = err_of(gs[0].run(x))
            kind = f"skinny kw{kw} st{st}{' permuted' if permuted else ''}"
            row(kind, timed(lambda i, gs=gs: gs[i].launch(x, out)), err)
            del gs
    if m != 1:
        return
    block = 256
    for (r, u), nm in zip(GEMV_SHAPES, names):
        if k % (256 * u):  # the raw kernel reads whole 256 * U column blocks
            continue
        try:
            fn = mod.get_function(nm)
        except Exception as e:  # noqa: BLE001 - a probe: note and go on
            print(f"raw gemv {nm} does not build: {e}")
            return
        grid = -(-(n // r) * 32 // block)

        def go(i, fn=fn, grid=grid):
            # torch's current stream at call time (the capture's stream inside capture())
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn((grid,), (block,), (cp.uint64(x.data_ptr()), cp.uint64(ws[i].data_ptr()),
                                       cp.uint64(out.data_ptr()), cp.int32(n), cp.int32(k)))
        go(0)
        torch.cuda.synchronize()
        err = err_of(out.clone())  # of ws[0], before the timed calls overwrite out
        row(f"raw gemv R{r} U{u}", timed(go), err)


def main():
    seed = int(torch.randint(0, 2**31, (1,)).item())
    torch.manual_seed(seed)
    print(f"seed {seed}")
    names = [f"gemv<{r},{u}>" for r, u in GEMV_SHAPES]
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90a", "-std=c++17"), name_expressions=names)
    rows = []
    for name, (n, k, ms) in SHAPES.items():
        copies = max(2, -(-200 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in ms:
            case(name, n, k, m, ws, mod, names, rows)
        del ws
        torch.cuda.empty_cache()
    print()
    print("| weight | m | kernel | us | TB/s |")
    print("|---|---|---|---|---|")
    for name, m, kind, us, _ in rows:
        n, k, _ = SHAPES[name]
        print(f"| {name} | {m} | {kind} | {us:.2f} | {n * k * 2 / us / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
