"""The kernels dspark-comm provides (the ``dspark.kernels`` entry point):
read by the planner without importing the CuTe DSL. Empty until the fused
all-reduce boundary has passed its two-GPU suite."""

KERNELS: tuple[str, ...] = ()
