"""The QKV kernels: ``front`` (``QKVFront``: the projection on the skinny
GEMM with its epilogue) and ``epilogue`` (``QKVEpilogue``: the epilogue after
the stock projection)."""
