"""On a GPU: dspark-core's spec, run on CUDA, against vLLM 0.33.0's stock
kernels (the carried binaries of compile_stock.py, launched by
launch_stock.py) on the same operands, bit for bit; prints one line per
(op, variant, rows) with the mismatch count, and a summary last.

    python scripts/stock/check_spec.py [--rows 1,2,7,16,133,4096] [--seed N]

Operands: fresh random rows (the seed printed) with special rows planted
(-0.0, subnormals, +-inf, NaN, near-overflow values) and outputs poisoned
with NaN before each launch. Mismatches compare bit patterns; two NaNs of
any payload count as equal (the spec promises only that a NaN is a NaN).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch_stock as S  # noqa: E402

from dspark_core.spec import layers as L  # noqa: E402
from dspark_core.spec.layers import HeadNorm, RMSNorm, Rotary  # noqa: E402

H = 8192
RESULTS: list[tuple[str, int, int]] = []


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{a.shape} {a.dtype} vs {b.shape} {b.dtype}")
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    same = a.view(bits) == b.view(bits)
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return int((~(same | both_nan)).sum())


def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    bad = mismatches(got, want)
    RESULTS.append((name, bad, got.numel()))
    print(f"{name:<64} {bad:>9} of {got.numel()}", flush=True)


def special_rows(x: torch.Tensor) -> torch.Tensor:
    """Plant special values in the first rows of ``x`` (float rows)."""
    m = x.shape[0]
    specials = [0.0, -0.0, 1e-40, -1e-40, float("inf"), float("-inf"), float("nan"), 3.0e38]
    if m >= 3:
        x[1, ::7] = -0.0
        x[2, ::5] = 1e-39  # subnormal in FP32, flushed in BF16? (BF16 keeps FP32's exponent range)
    if m >= 7:
        x[3, 0] = float("inf")
        x[4, 5] = float("nan")
        x[5, :] = 3.0e38  # near overflow: squares overflow
        x[6, :] = 0.0
    if m == 2:
        x[1, : len(specials)] = torch.tensor(specials)
    return x


def rand(m: int, n: int, gen, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.randn(m, n, generator=gen, device="cuda") * scale
    return special_rows(x).to(dtype)


def check_rmsnorm(rows, gen) -> None:
    for wd in ("bf16", "fp32", "none"):
        for input_scale in (False, True):
            if input_scale and wd == "none":
                continue
            for out in (torch.bfloat16, torch.float32):
                if out == torch.float32 and input_scale:
                    continue
                for center in (0.0, 1.0):
                    if center and wd == "none":
                        continue
                    for m in rows:
                        x = rand(m, H, gen)
                        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(wd)
                        w = None if wd == "none" else (torch.randn(H, generator=gen, device="cuda") * 0.1 + 1).to(dt)
                        if w is not None:
                            w[:4] = torch.tensor([-0.0, 0.0, 1e-40, -2.0])
                        eps = 1e-6
                        want = S.stock_rmsnorm(x, w, eps, gain_center=center, input_scale=input_scale,
                                               out_dtype=out)
                        norm = RMSNorm(H, eps, has_weight=w is not None, weight_dtype=dt or torch.bfloat16,
                                       gain_center=center, weight_before_norm=input_scale, out_dtype=out,
                                       arch="sm_90a").cuda()
                        if w is not None:
                            norm.weight.data = w
                        got = norm(x)
                        record(f"rmsnorm w-{wd} is{int(input_scale)} y-{str(out)[6:]} gc{center} m={m}", got, want)


def check_qknorm_rope(rows, gen) -> None:
    nh, nkv, d = 8, 2, 64
    for table_dtype in (torch.float32, torch.bfloat16):
        for rope in (True, False):
            for m in rows:
                if m > 256:
                    continue
                rotary = Rotary(d, 8192, table_dtype=table_dtype).cuda()
                qkv = rand(m, (2 * nh + 2 * nkv) * d, gen)
                positions = torch.randint(0, 8192, (m,), generator=gen, device="cuda")
                blocks, bs = (m + 15) // 16 + 1, 16
                cache = torch.full((blocks, nkv, bs, 2 * d), float("nan"), dtype=torch.bfloat16, device="cuda")
                slots = torch.randperm(blocks * bs, generator=gen, device="cuda")[:m]
                stock_qkv = qkv.clone()
                S.stock_qknorm_rope_kv_insert(stock_qkv, positions, nh, nkv, d, 1e-6,
                                              rotary.cos_sin if rope else None, d if rope else 0, slots,
                                              cache, bs)
                norm = HeadNorm(d, 1e-6)
                q = qkv[:, : nh * d].reshape(m, nh, d)
                k = qkv[:, nh * d:(nh + nkv) * d].reshape(m, nkv, d)
                v = qkv[:, (nh + nkv) * d:(nh + 2 * nkv) * d].reshape(m, nkv, d)
                q_s = L.qk_norm_rope(q, norm, positions, rotary if rope else None)
                k_s = L.qk_norm_rope(k, norm, positions, rotary if rope else None)
                name = f"qk-norm rope{int(rope)} cs-{str(table_dtype)[6:]} m={m}"
                record(name + " q", stock_qkv[:, : nh * d].reshape(m, nh, d), q_s)
                record(name + " k", stock_qkv[:, nh * d:(nh + nkv) * d].reshape(m, nkv, d), k_s)
                ref = torch.full_like(cache, float("nan"))
                L.kv_insert(ref, k_s, v, slots)
                record(name + " cache", cache, ref)


def check_context(rows, gen) -> None:
    kvh, d = 8, 64
    rotary = Rotary(d, 8192).cuda()
    for m in rows:
        k = rand(m * 2, kvh * d, gen).reshape(m * 2, kvh, d)
        norm = HeadNorm(d, 1e-6)
        # The stock's ATen chain, run by this machine's torch.
        kf = k.float()
        stock = (kf * torch.rsqrt(kf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        record(f"context K-norm (this torch's ATen) m={2 * m}", L.k_norm_context(k, norm), stock)
        positions = torch.randint(0, 8192, (2 * m,), generator=gen, device="cuda")
        table = rotary.context_table()
        kk = stock.clone()
        S.stock_rotary(positions, kk.reshape(2 * m, -1), None, d, table)
        record(f"context RoPE (bf16 table) m={2 * m}", kk, rotary(stock, positions, table))


def check_silu(rows, gen) -> None:
    for i in (1024, 16384):
        for m in rows:
            gu = rand(m, 2 * i, gen, scale=4.0)
            record(f"silu_and_mul I={i} m={m}", L.silu_and_mul(gu, i), S.stock_silu_and_mul(gu))


def check_o_gate(rows, gen) -> None:
    nh, d = 64, 64
    for m in rows:
        if m > 256:
            continue
        attn = rand(m, nh * d, gen).reshape(m, nh, d)
        qkv = rand(m, 3 * nh * d, gen, scale=3.0)
        og = qkv[:, nh * d: 2 * nh * d].reshape(m, nh, d)
        want = S.stock_o_gate(attn.clone(), og, 1e-6)
        record(f"o-gate (FLA) H={nh} m={m}", L.o_gate(attn, og, HeadNorm(d, 1e-6), "sm_90a"), want)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,7,16,133,4096")
    p.add_argument("--seed", type=int, default=int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31)))
    p.add_argument("--only", default="rmsnorm,qk,context,silu,ogate")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"seed {args.seed}; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    checks = {"rmsnorm": check_rmsnorm, "qk": check_qknorm_rope, "context": check_context, "silu": check_silu,
              "ogate": check_o_gate}
    for name in args.only.split(","):
        try:
            checks[name](rows, gen)
        except Exception as error:  # noqa: BLE001 (reported in the table; the other checks still run)
            RESULTS.append((f"{name}: {type(error).__name__}: {error}"[:200], -1, 0))
            print(RESULTS[-1][0], flush=True)
    torch.cuda.synchronize()
    bad = [r for r in RESULTS if r[1] != 0]
    print(f"\n== summary: {len(RESULTS)} checks, {len(bad)} with mismatches or errors ==")
    for name, n, total in bad:
        print(f"  {name}: {n} of {total}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
