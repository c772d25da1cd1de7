"""The TP group and its buffers: ``group`` (torch.distributed or a cupy NCCL
communicator), ``mailbox`` (the symmetric buffers over CUDA IPC) and
``ranks`` (spawning rank processes)."""
