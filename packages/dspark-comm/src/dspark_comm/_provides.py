"""The kernels dspark-comm provides (the ``dspark.kernels`` entry point): each
kernel name of ``dspark_core.contracts.kernels`` mapped to its host class, as
"module:Class". The planner reads the names alone (nothing here imports the
CuTe DSL). The package GEMM sums in its own order (within its bound, not
cuBLAS's bits), so a decode that must be bit for bit the stock TP forward
excludes it; the GPU runs behind both are in the package's README."""

KERNELS: dict[str, str] = {
    "all_reduce_boundary": "dspark_comm.cutedsl.all_reduce_boundary:AllReduceBoundary",
    "package_gemm": "dspark_comm.cutedsl.package_gemm:PackageGemm",
}
