"""The skinny GEMM main loops (1 to 16 rows of x, BF16 tensor cores, FP32
sums): ``config`` (``SkinnyConfig``, index maps, the error bound), ``tile``
(the traced pieces the ring loops share), ``ring`` (the shared-memory ring,
lane copies), ``rows`` (the ring with row copies) and ``direct`` (the
register-direct loop)."""
