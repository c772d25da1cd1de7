"""The kernels dspark-cute provides (the ``dspark.kernels`` entry point): each
kernel name of ``dspark_core.contracts.kernels`` mapped to its host class, as
"module:Class". The planner reads the names alone (nothing here imports the
CuTe DSL); the executor imports a class when it binds its part."""

KERNELS: dict[str, str] = {
    "row_norm": "dspark_cute.cutedsl.norms.row_norm:RowNorm",
    "boundary": "dspark_cute.cutedsl.norms.boundary:DraftBoundary",
    "context_chain": "dspark_cute.cutedsl.context.chain:ContextChain",
    "qkv_epilogue": "dspark_cute.cutedsl.qkv.epilogue:QKVEpilogue",
    "attention": "dspark_cute.cutedsl.attention.paged:PagedAttention",
    "o_gate": "dspark_cute.cutedsl.gating.o_gate:OGate",
    "mlp_activation": "dspark_cute.cutedsl.gating.mlp_activation:MlpActivation",
    "gemv": "dspark_cute.cutedsl.gemm.gemv:Gemv",
    "ordered_gemm": "dspark_cute.cutedsl.gemm.ordered:OrderedGemm",
    "weight_prefetch": "dspark_cute.cutedsl.prefetch:WeightPrefetcher",
}
