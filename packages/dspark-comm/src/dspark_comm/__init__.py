"""dspark-comm: the mailbox all-reduce and the package GEMM (not implemented yet)."""

__version__ = "0.1.0"
