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

The rows one call takes (a draft step's ``m``; the context chain's ``T``):
``MAX_ROWS[name]`` by design, or a host class's own ``max_rows`` where its
constants allow fewer (``rows_taken``). ``problem`` refuses a call beyond it.

The constructors the executor calls, per kernel name (``KERNEL_SIGNATURES``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from dspark_core.contracts.constants import MAX_DECODE_ROWS, ORDERED_GEMM_MAX_ROWS
from dspark_core.contracts.limits import (
    ATTENTION,
    BOUNDARY,
    CONTEXT_CHAIN,
    GEMV,
    MLP_ACTIVATION,
    O_GATE,
    ORDERED_GEMM,
    PACKAGE_GEMM,
    QKV_EPILOGUE,
    ROW_NORM,
)

# Every fused kernel the design has (the planner's names): those above named
# where their limits are stated (``contracts.limits``), and these.
WEIGHT_PREFETCH = "weight_prefetch"
ALL_REDUCE_BOUNDARY = "all_reduce_boundary"

# The constructor each host class takes (documentation the tests check
# against the installed backends).
KERNEL_SIGNATURES = {
    ROW_NORM: "RowNorm(constants: RowNormConstants, weight: Tensor | None)",
    BOUNDARY: "DraftBoundary(constants: BoundaryConstants, alpha, beta, post_weight, pre_weight)",
    CONTEXT_CHAIN: "ContextChain(constants: ContextConstants, hidden_weight, pre_weights, kv_weight, table)",
    QKV_EPILOGUE: "QKVEpilogue(constants: QKVEpilogueConstants, q_norm_weight, table)",
    ATTENTION: "PagedAttention(constants: AttentionConstants)",
    O_GATE: "OGate(constants: OGateConstants)",
    MLP_ACTIVATION: "MlpActivation(constants: MlpActivationConstants)",
    GEMV: "Gemv(constants: GemvConstants, weight)",
    WEIGHT_PREFETCH: "WeightPrefetcher(bytes_per_row: dict[str, int], device)",
    ALL_REDUCE_BOUNDARY: "AllReduceBoundary(mailbox, constants, alpha, beta, post_weight, pre_weight, sum_order)",
    PACKAGE_GEMM: "PackageGemm(constants: PackageGemmConstants, weight, mailbox, rank)",
    ORDERED_GEMM: "OrderedGemm(constants: OrderedGemmConstants, weight)",
}
ALL_KERNELS = frozenset(KERNEL_SIGNATURES)

# A row count that is a runtime argument of the kernel (no row tile compiled
# in): any count up to the CUDA grid's x limit, one CTA (or CTA row) a row.
ANY_ROWS = 2**31 - 1
# The most rows one call of each kernel takes, by design. The row norm, the
# boundary, the context chain, the QKV epilogue, the o-gate and the MLP
# activation take the row count at run time; the o-gate and the MLP
# activation state a lower ``max_rows`` where their Int32 vector index over
# a wide row runs out first; the ordered GEMM takes up to 8 token tiles of 8
# (and, within them, the row counts its build-time check found an order for). The package GEMM's token tile and the
# mailbox's default capacity are MAX_DECODE_ROWS; the
# attention's grid y is the query row (65535 at most); the weight prefetch
# takes no rows (None).
MAX_ROWS: dict[str, int | None] = {
    ROW_NORM: ANY_ROWS,
    BOUNDARY: ANY_ROWS,
    CONTEXT_CHAIN: ANY_ROWS,
    QKV_EPILOGUE: ANY_ROWS,
    ATTENTION: 65535,
    O_GATE: ANY_ROWS,
    MLP_ACTIVATION: ANY_ROWS,
    GEMV: 1,
    WEIGHT_PREFETCH: None,
    ALL_REDUCE_BOUNDARY: MAX_DECODE_ROWS,
    PACKAGE_GEMM: MAX_DECODE_ROWS,
    ORDERED_GEMM: ORDERED_GEMM_MAX_ROWS,
}


def rows_taken(name: str, kernel: Any = None) -> int | None:
    """The most rows one call of kernel ``name`` takes: ``kernel.max_rows``
    where the bound host class ``kernel`` states one, else ``MAX_ROWS[name]``
    (None: the kernel takes no rows). KeyError for an unknown name."""
    stated = getattr(kernel, "max_rows", None) if kernel is not None else None
    if stated is not None:
        if isinstance(stated, bool) or not isinstance(stated, int) or stated < 1:
            raise TypeError(f"the {name} kernel's max_rows must be a positive int, not {stated!r}")
        return stated
    return MAX_ROWS[name]


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


__all__ = ["ALL_KERNELS", "ANY_ROWS", "FusedKernel", "KERNELS_ENTRY_POINTS", "KERNEL_SIGNATURES", "MAX_DECODE_ROWS",
           "MAX_ROWS", "installed_kernels", "kernel_class", "rows_taken"]
