"""The tensor-parallel group a mailbox is built over.

A ``TPGroup`` is what the mailbox needs of its group: the rank, the size,
the CUDA device, a byte all-gather and a barrier for the collective set-up
(the rendezvous of the buffers' IPC handles runs over this group, never over
the world), and the group's stock all-reduce (the fallback for calls the
mailbox does not take). Two implementations:

- ``TorchGroup(pg)``: a ``torch.distributed`` process group (default: the
  world); the stock all-reduce is ``torch.distributed.all_reduce`` (NCCL on
  CUDA tensors);
- ``CupyNcclGroup(comm)``: a ``cupy.cuda.nccl.NcclCommunicator`` (the NCCL
  bindings of deployments that keep their own communicator); the stock
  all-reduce is its ``allReduce`` on torch's current stream.
"""

from __future__ import annotations

import pickle

import torch

# ncclDataType_t and ncclRedOp_t values (nccl.h), for communicators whose
# Python bindings predate a name.
_NCCL_DTYPES = {
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
_NCCL_SUM = 0


class TPGroup:
    """The interface (module docstring). ``rank`` and ``size`` are the
    rank in and the size of the TP group; ``device`` the rank's GPU."""

    rank: int
    size: int
    device: torch.device

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (collective)."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Return once every rank has entered (collective)."""
        self.all_gather_bytes(b"")

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """The stock sum all-reduce of ``t`` in place, on torch's current
        stream (collective); returns ``t``."""
        raise NotImplementedError

    def agree(self, ok: bool, what: str) -> None:
        """Collective: raise RuntimeError on every rank unless ``ok`` holds on
        every rank (so one rank's failure cannot leave the others waiting)."""
        flags = self.all_gather_bytes(b"1" if ok else b"0")
        failed = [r for r, f in enumerate(flags) if f != b"1"]
        if failed:
            raise RuntimeError(f"{what} failed on rank(s) {failed} of the TP group")

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (collective)."""
        return [pickle.loads(b) for b in self.all_gather_bytes(pickle.dumps(obj))]


class TorchGroup(TPGroup):
    """A ``torch.distributed`` process group (``pg``; None: the world) whose
    ranks each own one CUDA device (``device``; default: the current one)."""

    def __init__(self, pg=None, device: torch.device | int | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("a TorchGroup needs an initialized torch.distributed process group")
        self.pg = pg if pg is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.pg)
        self.size = dist.get_world_size(self.pg)
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)

    @property
    def group_name(self) -> str:
        return self.pg.group_name

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, bytes(data), group=self.pg)
        return [bytes(b) for b in out]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg)
        return t


class CupyNcclGroup(TPGroup):
    """A cupy NCCL communicator (``comm``, a
    ``cupy.cuda.nccl.NcclCommunicator``) whose rank owns ``device`` (default:
    the communicator's device). Collectives run on torch's current stream."""

    def __init__(self, comm, device: torch.device | int | None = None) -> None:
        self.comm = comm
        self.rank = int(comm.rank_id())
        self.size = int(comm.size())
        if device is None:
            device = int(comm.device_id())
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = torch.empty(self.size, dtype=torch.int64, device=self.device)
        self.comm.allGather(n.data_ptr(), sizes.data_ptr(), 1, _NCCL_DTYPES[torch.int64], self._stream())
        lengths = [int(v) for v in sizes.cpu()]
        width = max(max(lengths), 1)
        send = torch.zeros(width, dtype=torch.uint8)
        if data:
            send[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        send = send.to(self.device)
        recv = torch.empty(self.size * width, dtype=torch.uint8, device=self.device)
        self.comm.allGather(send.data_ptr(), recv.data_ptr(), width, _NCCL_DTYPES[torch.uint8], self._stream())
        host = recv.cpu().numpy().tobytes()
        return [host[r * width: r * width + lengths[r]] for r in range(self.size)]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in _NCCL_DTYPES or not t.is_contiguous() or t.device != self.device:
            raise ValueError(f"the NCCL all-reduce takes a contiguous tensor on {self.device}")
        self.comm.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), _NCCL_DTYPES[t.dtype], _NCCL_SUM,
                            self._stream())
        return t


__all__ = ["CupyNcclGroup", "TPGroup", "TorchGroup"]
