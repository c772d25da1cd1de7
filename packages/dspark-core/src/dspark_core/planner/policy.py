"""The planner's policy: the deployment facts the plan is made for (the
``Target``) and the fixed choices of what may fuse where."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

# Every fused kernel the design has; a backend says which it provides.
ROW_NORM = "row_norm"
BOUNDARY = "boundary"
CONTEXT_NORMS = "context_norms"
CONTEXT_STORE = "context_store"
QKV_FRONT = "qkv_front"
ALL_REDUCE_BOUNDARY = "all_reduce_boundary"
PACKAGE_GEMM = "package_gemm"
ATTENTION = "attention"
O_GATE = "o_gate"
MLP_ACTIVATION = "mlp_activation"
QKV_EPILOGUE = "qkv_epilogue"
GEMV = "gemv"
ALL_KERNELS = frozenset(
    {ROW_NORM, BOUNDARY, CONTEXT_NORMS, CONTEXT_STORE, QKV_FRONT, ALL_REDUCE_BOUNDARY, PACKAGE_GEMM,
     ATTENTION, O_GATE, MLP_ACTIVATION, QKV_EPILOGUE, GEMV}
)

# Backends advertise the kernels they provide under this entry-point group,
# each entry a list of names from ALL_KERNELS (read without importing the
# backend's kernels, so planning needs no GPU stack).
KERNELS_ENTRY_POINTS = "dspark.kernels"


# DSpark's own backends, found by module where they are importable but not
# installed (a device machine that puts the packages' src/ on PYTHONPATH).
FIRST_PARTY_KERNELS = ("dspark_cute._provides", "dspark_comm._provides")


def installed_kernels() -> frozenset[str]:
    """The kernels the installed backend packages provide (entry points),
    and those of DSpark's own backends importable from the path."""
    import importlib
    import importlib.util
    from importlib.metadata import entry_points

    found: set[str] = set()
    for ep in entry_points(group=KERNELS_ENTRY_POINTS):
        found.update(ep.load())
    for name in FIRST_PARTY_KERNELS:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # its package is absent
            continue
        if spec is not None:
            found.update(importlib.import_module(name).KERNELS)
    return frozenset(found) & ALL_KERNELS


# The architectures the kernels are compiled for.
ARCHS = ("sm_90a", "sm_100a")
# TP sizes whose boundaries fuse their branch's all-reduce (a Lamport mailbox
# over peer-to-peer stores): every power of two the mailbox is written for.
FUSED_TPS = (2, 4, 8)
# TP sizes whose o_proj and down_proj run on the package GEMM, publishing their
# partial into the boundary's mailbox.
PACKAGE_GEMM_TPS = (2, 4, 8)
# The decode attention kernel's variants: "staged" (the default: the K/V rows
# of the first DEFAULT_STAGED_SLOTS slots staged in shared memory, q read as a
# strided view, the o-gate in its epilogue where the o-gate fuses) and
# "direct" (K/V read from global memory, the o-gate a kernel of its own). Both
# are bit for bit the spec; the staged one measured faster on an H200.
ATTENTION_VARIANTS = ("staged", "direct")
DEFAULT_STAGED_SLOTS = 384
# Kernels that run only where the caller asks for them, with the plan's reason
# where it does not (Target.declined): the fused QKV front sums its projection
# in its own order, so the default decode keeps the bit-for-bit front.
OPT_IN = {
    QKV_FRONT: "the fused QKV front is opt-in (qkv_front=True): it sums its projection in its own order, "
               "and the stock projection with the QKV epilogue kernel is bit for bit",
    GEMV: "the one-token GEMV is opt-in (gemv=True): it sums the projection in the order dspark_core.spec.gemv "
          "states, not the stock cuBLAS order",
}
# The projections the one-token GEMV may take over, per layer, with their
# module attribute paths (the GEMV runs at TP1 only: at TP the branch GEMMs
# feed the all-reduce and were not measured on it).
GEMV_ROLES = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj", "gate_up": "mlp.gate_up",
              "down": "mlp.down"}


def gemv_weight(layer, role: str):
    """The weight of ``layer``'s projection ``role`` (``GEMV_ROLES``)."""
    obj = layer
    for name in GEMV_ROLES[role].split("."):
        obj = getattr(obj, name)
    return obj
# Rows per call of the QKV front and of the mailbox (a draft proposes 1 to 16
# tokens); calls with more rows take the unfused path.
MAX_DECODE_ROWS = 16


@dataclass(frozen=True)
class GemmShape:
    """A draft GEMM's launch shape: ``x[m <= max_rows, K] @ W[N, K]^T`` with
    ``tile_n`` output features per CTA and ``split_k`` K-slices."""

    tile_n: int
    split_k: int
    max_rows: int = MAX_DECODE_ROWS


# The package GEMM's launch shape per projection role (``tile_n`` 64: the
# ring main loop; ``draft_gemm_shape`` narrows it for short shards, which
# keep the role's split_k, and sets the ring's split_k by shard).
DRAFT_GEMMS = {
    "o_proj": GemmShape(tile_n=64, split_k=1),
    "down_proj": GemmShape(tile_n=64, split_k=2),
}
# Shards whose K-slices take at most this many 32-column steps per warp
# (``k_shard / (32 * 4 * split_k)``: 4 warps per K-slice of split_k) run on
# the register-direct main loop (tile_n 16), which keeps all of a warp's steps
# in flight at once. Measured on an H200 (scripts/probes/package_gemm_sweep.py,
# N = 8192; us, weight L2-resident / HBM-cold; m = 1 / 4 / 16): 8 steps win --
# K = 1024, 4 warps: 3.41 / 3.54 / 4.23 against the ring's 5.64 / 4.99 / 4.71
# and cuBLAS's 5.50 / 5.07 / 4.88; K = 2048, 8 warps: 5.80 / 6.14 / 7.16 and
# 11.43 / 11.56 / 11.72 against 8.71 / 7.72 / 7.49 and 12.86 / 11.91 / 11.49
# (cuBLAS 7.80 / 7.45 / 7.02 and 10.74 / 10.70 / 10.74). 16 steps lose from
# HBM -- K = 2048, 4 warps: 12.69 / 12.79 / 13.63 against 11.97 / 11.22 /
# 10.85 -- and K = 4096 on either loses by 7-50%.
DIRECT_MAX_STEPS = 8


def direct_steps(role: str, k_shard: int) -> int:
    """32-column steps per warp of ``role``'s K-slices at a shard of
    ``k_shard`` input features (4 warps per K-slice, ``split_k`` slices)."""
    return k_shard // gemm_step_unit(DRAFT_GEMMS[role].split_k)


# The ring main loop's K-slices (split_k, 4 warps each) by shard, whatever
# the role: ``(largest k_shard, split_k)`` in order, None for any larger.
# Measured at TP2 (bench_package_gemm, two H200s, 2026-12-01, publishing
# alone in a graph, medians of 7 alternating rounds, m = 1 / 4 / 16, us):
# K = 4096: 8 warps 16.92 / 17.35 / 18.19 against 4 warps' 18.13 / 18.51 /
# 19.00 (cuBLAS 18.96 / 19.32 / 19.22), faster in 7 of 7 rounds at each m;
# K = 8192: 8 warps 31.76 / 32.33 / 33.81 against 4 warps' 31.96 / 32.67 /
# 34.02 (cuBLAS 33.85 / 33.97 / 33.91), faster in 7 of 7 rounds. One H200
# had found 4 warps faster at K = 8192 (package_gemm_sweep.py --depth); and
# at TP2 the 4-warp 16-token kernel (8 stages) took 53 us there whenever a
# boundary kernel ran between its calls (33.5 alone). K = 2048 (the draft's
# o_proj at TP2) keeps 4 warps; 8 were not measured there.
RING_SPLIT_K = ((2048, 1), (None, 2))


def ring_split_k(k_shard: int) -> int:
    """``split_k`` of the ring main loop at a shard of ``k_shard`` input
    features: ``RING_SPLIT_K``'s, or 1 where its warps' 32-feature steps do
    not divide the shard."""
    split = next(s for top, s in RING_SPLIT_K if top is None or k_shard <= top)
    return split if k_shard % gemm_step_unit(split) == 0 else 1


def gemm_step_unit(split_k: int) -> int:
    """The input features one step of every warp covers at ``split_k``
    K-slices of 4 warps (32 each): a package GEMM's shard is a multiple."""
    return 32 * 4 * split_k


def draft_gemm_shape(role: str, k_shard: int) -> GemmShape:
    """The package GEMM's launch shape for ``role`` (``DRAFT_GEMMS``) at a
    rank's shard of ``k_shard`` input features: the role's, with ``tile_n``
    16 (the register-direct main loop: the same sums as tile_n 64 of the
    same split_k) where ``direct_steps(role, k_shard) <= DIRECT_MAX_STEPS``
    (o_proj: K <= 1024; down_proj: K <= 2048); above, the ring main loop
    with ``ring_split_k(k_shard)`` K-slices (4 warps up to K = 2048, else
    8 where they divide it). ValueError for a role the policy has no package GEMM
    for."""
    if role not in DRAFT_GEMMS:
        raise ValueError(f"the package GEMM runs {', '.join(DRAFT_GEMMS)}, not {role!r}")
    shape = DRAFT_GEMMS[role]
    if 0 < k_shard and direct_steps(role, k_shard) <= DIRECT_MAX_STEPS:
        return dataclasses.replace(shape, tile_n=16)
    return dataclasses.replace(shape, split_k=ring_split_k(k_shard))


@dataclass(frozen=True)
class Target:
    """Where the plan runs: ``platform`` ("cuda" or "cpu"), the GPU ``arch``
    (``ARCHS``), its SM count, the TP size, the kernels the installed
    backends provide (``excluded``: those the caller chose not to use, kept
    apart so a refusal can say so; ``declined``: opt-in kernels the caller did
    not ask for, ``OPT_IN``) and the ``attention`` kernel's variant
    (``ATTENTION_VARIANTS``). Frozen and hashable; ``key()`` names it."""

    platform: str = "cuda"
    arch: str = "sm_90a"
    num_sms: int = 132
    tp: int = 1
    kernels: frozenset[str] = field(default=ALL_KERNELS)
    excluded: frozenset[str] = field(default=frozenset())
    attention: str = "staged"
    declined: frozenset[str] = field(default=frozenset())

    def __post_init__(self) -> None:
        if not set(self.declined) <= set(OPT_IN):
            raise ValueError(f"only the opt-in kernels {sorted(OPT_IN)} can be declined, not {sorted(self.declined)}")
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(f"an attention variant is one of {ATTENTION_VARIANTS}, not {self.attention!r}")
        if self.platform not in ("cuda", "cpu"):
            raise ValueError(f"a target platform is 'cuda' or 'cpu', not {self.platform!r}")
        if self.tp < 1:
            raise ValueError(f"a TP size is at least 1, not {self.tp}")
        unknown = set(self.kernels) - ALL_KERNELS
        if unknown:
            raise ValueError(f"unknown kernels {sorted(unknown)}; known: {sorted(ALL_KERNELS)}")

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch: on every supported architecture."""
        return self.arch in ARCHS

    def key(self) -> str:
        text = repr((self.platform, self.arch, self.num_sms, self.tp, sorted(self.kernels), sorted(self.excluded),
                     self.attention, sorted(self.declined)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def replace(self, **changes) -> Target:
        return dataclasses.replace(self, **changes)

    def decline(self, kernels) -> Target:
        """This target less the opt-in ``kernels`` (``OPT_IN``), which the
        plan's reasons then call opt-in."""
        kernels = frozenset(kernels)
        return self.replace(kernels=self.kernels - kernels, declined=self.declined | kernels)

    def opt_in(self, asked) -> Target:
        """This target with every opt-in kernel (``OPT_IN``) that ``asked``
        does not name declined, except those the caller excluded (whose
        reason stays "excluded")."""
        return self.decline(set(OPT_IN) - set(asked) - self.excluded)

    def without(self, kernels) -> Target:
        """This target less ``kernels``, which the plan's reasons then call
        excluded by the caller (not "not installed")."""
        kernels = frozenset(kernels)
        return self.replace(kernels=self.kernels - kernels, excluded=self.excluded | kernels)


def asked_opt_ins(qkv_front: bool = False, gemv: bool = False) -> frozenset[str]:
    """The opt-in kernels (``OPT_IN``) a caller's switches ask for: the fused
    QKV front and the one-token GEMV (``Target.opt_in`` declines the rest)."""
    return frozenset(k for k, yes in ((QKV_FRONT, qkv_front), (GEMV, gemv)) if yes)


def device_target(device, tp: int = 1) -> Target:
    """The planner's target for the torch ``device``: its platform,
    architecture and SM count, the TP size ``tp`` and the installed kernels
    (``installed_kernels``)."""
    import torch

    if device.type != "cuda":
        return Target(platform="cpu", tp=tp, kernels=installed_kernels())
    major, minor = torch.cuda.get_device_capability(device)
    arch = {9: "sm_90a", 10: "sm_100a"}.get(major, f"sm_{major}{minor}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return Target("cuda", arch, sms, tp, installed_kernels())
