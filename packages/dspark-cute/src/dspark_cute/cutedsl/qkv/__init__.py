"""The QKV kernel: ``epilogue`` (``QKVEpilogue``: vLLM's fused QK-norm, RoPE
and KV insert after the stock projection). The fused QKV front (the
projection on the skinny GEMM with that epilogue) was removed on 2026-12-03:
on an H200 (2026-12-01) it took 47-48 µs at m = 1, 4 and 16 against 43.2 µs
for cuBLAS's projection alone (plus the epilogue's ~1.3 µs), and it summed
the projection in its own order, so it was neither faster nor exact."""
