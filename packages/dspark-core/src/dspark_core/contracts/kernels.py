"""The kernel contract: what every fused kernel's host class offers, and how
the executor finds the installed ones.

A backend package (dspark-cute, dspark-comm, or any other) declares its
kernels under the entry-point group ``dspark.kernels``: each entry loads a
dict ``{kernel name: "module:HostClass"}`` naming host classes inside that
backend. The planner reads only the names (``installed_kernels``: no backend
module is imported); the executor loads a class when it binds a part
(``kernel_class``).

Every host class is built from its frozen constants (``contracts.constants``)
and the tensors it binds, and has the same verbs:

- ``prepare()``: compile every variant it may launch (a compile during CUDA
  graph capture raises RuntimeError);
- ``problem(*operands) -> str | None``: why it does not take these operands;
- ``takes(*operands) -> bool``: ``problem(...) is None``;
- ``run(*operands)``: checked (ValueError with ``problem``'s sentence), then
  ``launch``;
- ``launch(*operands)``: unchecked, for operands the caller has checked;
  while torch.compile or torch.export traces, one ``torch.library`` custom op
  (with its fake; dspark-cute's ``runtime.ops``), so a traced graph holds one
  opaque node per launch.

The constructors the executor calls, per kernel name (``KERNEL_SIGNATURES``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

# Every fused kernel the design has (the planner's names).
ROW_NORM = "row_norm"
BOUNDARY = "boundary"
CONTEXT_CHAIN = "context_chain"
QKV_FRONT = "qkv_front"
QKV_EPILOGUE = "qkv_epilogue"
ATTENTION = "attention"
O_GATE = "o_gate"
MLP_ACTIVATION = "mlp_activation"
GEMV = "gemv"
WEIGHT_PREFETCH = "weight_prefetch"
ALL_REDUCE_BOUNDARY = "all_reduce_boundary"
PACKAGE_GEMM = "package_gemm"

# The constructor each host class takes (documentation the tests check
# against the installed backends).
KERNEL_SIGNATURES = {
    ROW_NORM: "RowNorm(constants: RowNormConstants, weight: Tensor | None)",
    BOUNDARY: "DraftBoundary(constants: BoundaryConstants, alpha, beta, post_weight, pre_weight)",
    CONTEXT_CHAIN: "ContextChain(constants: ContextConstants, hidden_weight, pre_weights, kv_weight, table)",
    QKV_FRONT: "QKVFront(constants: QKVFrontConstants, qkv_weight, q_norm_weight, table)",
    QKV_EPILOGUE: "QKVEpilogue(constants: QKVFrontConstants, q_norm_weight, table)",
    ATTENTION: "PagedAttention(constants: AttentionConstants)",
    O_GATE: "OGate(constants: OGateConstants)",
    MLP_ACTIVATION: "MlpActivation(constants: MlpActivationConstants)",
    GEMV: "Gemv(constants: GemvConstants, weight)",
    WEIGHT_PREFETCH: "WeightPrefetcher(bytes_per_row: dict[str, int], device)",
    ALL_REDUCE_BOUNDARY: "AllReduceBoundary(mailbox, constants, alpha, beta, post_weight, pre_weight, sum_order)",
    PACKAGE_GEMM: "PackageGemm(constants: PackageGemmConstants, weight, mailbox, rank)",
}
ALL_KERNELS = frozenset(KERNEL_SIGNATURES)

KERNELS_ENTRY_POINTS = "dspark.kernels"


@runtime_checkable
class FusedKernel(Protocol):
    """The verbs of every host class (module docstring)."""

    def prepare(self) -> None: ...

    def problem(self, *operands: Any) -> str | None: ...

    def takes(self, *operands: Any) -> bool: ...

    def run(self, *operands: Any) -> Any: ...

    def launch(self, *operands: Any) -> Any: ...


def _provided() -> dict[str, str]:
    """Every installed backend's ``{kernel name: "module:HostClass"}``, merged
    in entry-point order (a name two backends provide keeps the first)."""
    found: dict[str, str] = {}
    for ep in sorted(entry_points(group=KERNELS_ENTRY_POINTS), key=lambda e: e.name):
        provided = ep.load()
        if not isinstance(provided, dict):
            raise TypeError(f"the {KERNELS_ENTRY_POINTS} entry point {ep.name!r} must load a dict of kernel "
                            f"names to 'module:HostClass', not {type(provided).__name__}")
        for name, target in provided.items():
            found.setdefault(name, target)
    return found


def installed_kernels() -> frozenset[str]:
    """The names of the kernels the installed backends provide."""
    return frozenset(_provided()) & ALL_KERNELS


def kernel_class(name: str) -> type:
    """The host class of kernel ``name`` from the installed backend that
    provides it (imported now). LookupError where none does."""
    target = _provided().get(name)
    if target is None:
        raise LookupError(f"no installed backend provides the {name} kernel")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["ALL_KERNELS", "FusedKernel", "KERNELS_ENTRY_POINTS", "KERNEL_SIGNATURES", "installed_kernels",
           "kernel_class"]
