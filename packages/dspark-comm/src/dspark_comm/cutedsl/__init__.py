"""The CuTe DSL kernels of dspark-comm: ``allreduce`` (the mailbox
all-reduce with a pluggable epilogue), ``all_reduce_boundary`` (the draft's
residual boundary as its epilogue), ``package_gemm`` (the branch GEMM that
publishes into the mailbox), ``package_gemv`` (its one-row path),
``gemm_epilogue`` (what those two share) and ``package_gemm_shape`` (launch
shapes)."""
