"""DSpark's tensor-parallel pieces: the Lamport mailbox all-reduce over
peer-to-peer stores, with fused epilogues (the draft's residual boundary
among them).

Modules: ``protocol`` (layout, encoding, epochs, capacity, sum orders, a
model of the protocol; pure Python); ``runtime`` (``group``: the TP group,
torch.distributed or a cupy NCCL communicator; ``mailbox``: the symmetric
buffers over CUDA IPC; ``ranks``: rank processes); ``cutedsl`` (the kernels:
``allreduce``, the mailbox all-reduce with a pluggable epilogue;
``all_reduce_boundary``, all-reduce + residual boundary in one kernel;
``package_gemm`` and ``package_gemv``, the branch GEMM that publishes its
partial into the mailbox). Their PTX primitives are ``dspark_cute.ptx``'s.

The kernel classes are imported lazily, so ``import dspark_comm`` loads
neither the CuTe DSL nor a GPU stack.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "TorchGroup": "dspark_comm.runtime.group",
    "CupyNcclGroup": "dspark_comm.runtime.group",
    "TPGroup": "dspark_comm.runtime.group",
    "Mailbox": "dspark_comm.runtime.mailbox",
    "MailboxTimeoutError": "dspark_comm.runtime.mailbox",
    "Epilogue": "dspark_comm.cutedsl.allreduce",
    "FusedAllReduce": "dspark_comm.cutedsl.allreduce",
    "MailboxAllReduce": "dspark_comm.cutedsl.allreduce",
    "AllReduceBoundary": "dspark_comm.cutedsl.all_reduce_boundary",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dspark_comm' has no attribute {name!r}")
