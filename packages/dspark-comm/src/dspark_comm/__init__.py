"""DSpark's tensor-parallel pieces: the Lamport mailbox all-reduce over
peer-to-peer stores, with fused epilogues (the draft's residual boundary
among them).

Modules: ``protocol`` (layout, encoding, epochs, capacity, sum orders, a
model of the protocol; pure Python), ``group`` (the TP group: torch.distributed
or a cupy NCCL communicator), ``mailbox`` (the symmetric buffers over CUDA
IPC), ``device`` (traced PTX primitives of the mailbox), ``allreduce`` (the
CuTe DSL kernel with a pluggable epilogue, ``MailboxAllReduce``),
``boundary`` (``AllReduceBoundary``: all-reduce + residual boundary in one
kernel) and ``examples`` (an epilogue another model brings).

The kernel classes are imported lazily, so ``import dspark_comm`` loads
neither the CuTe DSL nor a GPU stack.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "TorchGroup": "dspark_comm.group",
    "CupyNcclGroup": "dspark_comm.group",
    "TPGroup": "dspark_comm.group",
    "Mailbox": "dspark_comm.mailbox",
    "MailboxTimeoutError": "dspark_comm.mailbox",
    "Epilogue": "dspark_comm.allreduce",
    "FusedAllReduce": "dspark_comm.allreduce",
    "MailboxAllReduce": "dspark_comm.allreduce",
    "Publisher": "dspark_comm.allreduce",
    "AllReduceBoundary": "dspark_comm.boundary",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dspark_comm' has no attribute {name!r}")
