"""The kernels dspark-cute provides (the ``dspark.kernels`` entry point):
read by the planner without importing the CuTe DSL."""

KERNELS = (
    "row_norm", "boundary", "context_norms", "context_store", "qkv_front", "qkv_epilogue",
    "o_gate", "mlp_activation", "attention", "gemv",
)
