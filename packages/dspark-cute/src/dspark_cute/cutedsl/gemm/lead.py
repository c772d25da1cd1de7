"""The latency-bound part a projection follows in the draft step, as the
build-time timing (``decide.gpu_sides``) puts it before every call it times.

In DSpark's step every projection follows a small part (a norm, the QKV
epilogue, attention, a gate, a boundary) that releases its PDL dependents
early (``griddepcontrol.launch_dependents``): a GEMM launched with PDL
starts while that part runs and has its weight prologue in flight before its
``griddepcontrol.wait``; cuBLAS's kernel starts when the part ends. Timed
back to back, one GEMM after another, the candidates miss that difference
(on an H100 the 14 projections chained ran 1.062x cuBLAS all on DSpark's
kernels, 1.044x as decided one projection at a time). ``LeadPart`` is the
part's stand-in: one warp that releases its dependents at its start
(``release``), then spins ``ns`` nanoseconds on ``%globaltimer``. It reads
and writes no memory, so it moves no value of the GEMM after it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64

from dspark_cute import ptx


class LeadPart:
    """One CTA of one warp: ``griddepcontrol.launch_dependents`` first where
    ``release``, then a spin of ``ns`` nanoseconds (``ptx.spin_ns``).
    Call: ``(ns, stream)``."""

    def __init__(self, release: bool = True) -> None:
        if not isinstance(release, bool):
            raise TypeError(f"release must be a bool, not {type(release).__name__}")
        self.release = release

    @cute.jit
    def __call__(self, ns: Int64, stream):
        self.kernel(ns).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ns: Int64):
        if cutlass.const_expr(self.release):
            ptx.pdl_launch_dependents()
        ptx.spin_ns(ns)


def compile_lead(release: bool = True):
    """``(kernel, fake_args)`` for ``compile_kernel``/``compile_ptx``."""
    from dspark_cute.runtime.host import fake_stream

    return LeadPart(release), (Int64(0), fake_stream())


_compiled: dict = {}


def lead_launcher(release: bool = True):
    """A function ``run(ns)`` that launches the compiled ``LeadPart`` on
    torch's current stream (compiled once a process and device, never
    during a capture)."""
    import torch

    from dspark_cute.runtime.host import compile_kernel, current_stream

    key = (release, torch.cuda.current_device())
    compiled = _compiled.get(key)
    if compiled is None:
        kernel, _ = compile_lead(release)
        compiled = _compiled[key] = compile_kernel(kernel, Int64(0), current_stream(), what="the lead part")

    def run(ns: int) -> None:
        compiled(Int64(int(ns)), current_stream())

    return run


__all__ = ["LeadPart", "compile_lead", "lead_launcher"]
