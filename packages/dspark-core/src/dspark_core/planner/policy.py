"""The planner's policy: the deployment facts the plan is made for (the
``Target``) and the fixed choices of what may fuse where."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from dspark_core import checks
from dspark_core.contracts.constants import MAX_DECODE_ROWS  # noqa: F401 (re-exported)

# The kernel names (dspark_core.contracts.kernels), re-exported for the planner's callers.
from dspark_core.contracts.kernels import (  # noqa: F401
    ALL_KERNELS,
    ALL_REDUCE_BOUNDARY,
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
    WEIGHT_PREFETCH,
    installed_kernels,
)
from dspark_core.switches import flag

# The architectures the kernels are compiled for (dspark_core.checks.ARCHS).
ARCHS = checks.ARCHS
# The largest SM count and TP size a target may name (an H200 has 132 SMs, a
# B200 148; a TP group of more GPUs than this is no deployment of a draft).
MAX_SMS = 1024
MAX_TP = 1024
# The most bytes of weights a GPU the kernels are built for holds (a B200's
# 192 GB of HBM; an H200 has 141 GB): a draft whose layer weights on a rank
# are more is planned stock with that reason.
MAX_GPU_BYTES = 192 * 10**9
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
# where it does not (Target.declined): the GEMV and the package GEMM sum a
# projection in their own order, so the default decode stays bit for bit the
# stock forward; the ordered GEMM sums in cuBLAS's order and is asked for by
# default at TP1 (``ordered_gemm_default``).
OPT_IN = {
    GEMV: "the one-token GEMV is opt-in (gemv=True): it sums the projection in the order dspark_core.spec.gemv "
          "states, not the stock cuBLAS order",
    PACKAGE_GEMM: "the package GEMM is opt-in (package_gemm=True): it sums the branch projection in its own "
                  "order, so the draft follows the stock tokens but not its bits",
    ORDERED_GEMM: "the ordered GEMM is off: turned off (ordered_gemm=False), or at TP > 1, where it is opt-in "
                  "(ordered_gemm=True: its row counts are timed on each rank, and the exact package GEMM it brings "
                  "must be chosen alike on every rank)",
}
# The projections the one-token GEMV may take over, per layer (it runs at TP1
# only: at TP the branch GEMMs feed the all-reduce).
GEMV_ROLES = ("qkv_proj", "o_proj", "gate_up", "down")


def gemv_weight(layer, role: str):
    """The weight of ``layer``'s projection ``role`` (``GEMV_ROLES``) in a
    ``dspark_core.runtime.description.Layer``."""
    weights = {
        "qkv_proj": layer.attention.qkv_weight,
        "o_proj": layer.attention.o_proj_weight,
        "gate_up": layer.mlp.gate_up_weight,
        "down": layer.mlp.down_weight,
    }
    if role not in weights:
        raise ValueError(f"a GEMV role is one of {GEMV_ROLES}, not {role!r}")
    return weights[role]


# The projections the ordered GEMM may take over, per layer: every one at
# TP1; at TP > 1 the column-parallel ones (the row-parallel o_proj and down
# feed the all-reduce, whose binding runs their GEMM).
ORDERED_GEMM_ROLES = GEMV_ROLES
ORDERED_GEMM_TP_ROLES = ("qkv_proj", "gate_up")


def ordered_gemm_roles(tp: int) -> tuple[str, ...]:
    """The projections a layer plans on the ordered GEMM at TP size ``tp``
    (an int from 1 to ``MAX_TP``), in order."""
    tp = checks.integer("the TP size tp", tp, 1, MAX_TP)
    return ORDERED_GEMM_ROLES if tp == 1 else ORDERED_GEMM_TP_ROLES


# Where the fused path has run end to end and been checked bit for bit: the
# plan marks parts planned for any other (arch, TP size) as never run there.
VALIDATED = {("sm_90a", 1), ("sm_90a", 2)}


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
    # Kernels the deployment has not checked bit for bit on this target,
    # each with the reason its parts stay stock: ``(kernel, reason)`` pairs.
    unchecked: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        """Each field checked and normalised where it enters (``dspark_core.
        checks``): the platform and the attention variant one of theirs; the
        TP size an int from 1 to ``MAX_TP`` and the SM count one from 1 to
        ``MAX_SMS`` (numpy ints taken, bools refused); the architecture in
        its one spelling (``checks.arch``: ``SM_90A``, ``(9, 0)`` are
        sm_90a; another one, like sm_80, is kept for the plan to refuse);
        ``kernels``, ``excluded`` and ``declined`` sets of kernel names (a
        string is no set), ``declined`` of opt-in ones. TypeError or
        ValueError naming the field."""
        def put(name: str, value) -> None:
            object.__setattr__(self, name, value)

        if self.platform not in ("cuda", "cpu"):
            raise ValueError(f"a target platform is 'cuda' or 'cpu', not {checks.shown(self.platform)}")
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(f"an attention variant is one of {ATTENTION_VARIANTS}, not {checks.shown(self.attention)}")
        put("tp", checks.integer("Target.tp (the TP size)", self.tp, 1, MAX_TP))
        put("num_sms", checks.integer("Target.num_sms (the SM count)", self.num_sms, 1, MAX_SMS))
        put("arch", checks.arch("Target.arch", self.arch, known=False))
        for name in ("kernels", "excluded"):
            put(name, checks.name_set(f"Target.{name}", getattr(self, name), ALL_KERNELS))
        put("declined", checks.name_set("Target.declined (opt-in kernels only)", self.declined, frozenset(OPT_IN)))
        items = list(self.unchecked.items()) if isinstance(self.unchecked, dict) else self.unchecked
        ok = isinstance(items, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and p[0] in ALL_KERNELS
            and isinstance(p[1], str) and p[1] for p in items)
        if not ok or len({p[0] for p in items}) != len(items):
            raise TypeError("Target.unchecked must be (kernel name, reason) pairs, one a known kernel, not "
                            f"{checks.shown(self.unchecked)}")
        put("unchecked", tuple(sorted((k, r) for k, r in items)))

    def describe(self) -> str:
        """The target in words: its platform, architecture, SMs and TP size."""
        if self.platform != "cuda":
            return f"the CPU (TP{self.tp})"
        gpus = "one GPU" if self.tp == 1 else f"{self.tp} GPUs"
        return f"TP{self.tp}: {gpus} of {self.arch} ({self.num_sms} SMs)"

    @property
    def validated(self) -> bool:
        """Whether the fused path has run and been checked on this (arch, TP
        size) (``VALIDATED``)."""
        return (self.arch, self.tp) in VALIDATED

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch: on every supported architecture."""
        return self.arch in ARCHS

    def key(self) -> str:
        text = repr((self.platform, self.arch, self.num_sms, self.tp, sorted(self.kernels), sorted(self.excluded),
                     self.attention, sorted(self.declined), self.unchecked))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def replace(self, **changes) -> Target:
        return dataclasses.replace(self, **changes)

    def decline(self, kernels) -> Target:
        """This target less the opt-in ``kernels`` (``OPT_IN``), which the
        plan's reasons then call opt-in."""
        kernels = checks.name_set("the declined kernels", kernels, frozenset(OPT_IN))
        return self.replace(kernels=self.kernels - kernels, declined=self.declined | kernels)

    def opt_in(self, asked) -> Target:
        """This target with every opt-in kernel (``OPT_IN``) that ``asked``
        does not name declined, except those the caller excluded (whose
        reason stays "excluded"). ``asked``: a set of opt-in kernel names."""
        asked = checks.name_set("the opt-in kernels asked for", asked, frozenset(OPT_IN))
        return self.decline(set(OPT_IN) - asked - self.excluded)

    def without(self, kernels) -> Target:
        """This target less ``kernels``, which the plan's reasons then call
        excluded by the caller (not "not installed")."""
        kernels = checks.name_set("the excluded kernels", kernels, ALL_KERNELS)
        return self.replace(kernels=self.kernels - kernels, excluded=self.excluded | kernels)


def ordered_gemm_default(tp: int) -> bool:
    """Whether the ordered GEMM is on when the caller does not say: at TP1,
    where each projection's row counts are decided at build by the order
    check and then by timing against cuBLAS on the user's GPU (every row
    count keeps cuBLAS's bits either way); not at TP > 1 (``OPT_IN``'s
    reason)."""
    return checks.integer("the TP size tp", tp, 1, MAX_TP) == 1


def asked_opt_ins(gemv: bool = False, package_gemm: bool = False, ordered_gemm: bool = False) -> frozenset[str]:
    """The opt-in kernels (``OPT_IN``) a caller's switches ask for: the
    one-token GEMV, the package GEMM and the ordered GEMM (``Target.opt_in``
    declines the rest; a caller that has no word of the ordered GEMM passes
    ``ordered_gemm_default(tp)``). TypeError for a switch that is not a bool."""
    switched = ((GEMV, flag(gemv, "gemv")), (PACKAGE_GEMM, flag(package_gemm, "package_gemm")),
                (ORDERED_GEMM, flag(ordered_gemm, "ordered_gemm")))
    return frozenset(k for k, yes in switched if yes)


def device_target(device, tp: int = 1, kernels: frozenset[str] | None = None) -> Target:
    """The planner's target for the torch ``device``: its platform,
    architecture and SM count, the TP size ``tp`` and ``kernels`` (default:
    the installed ones, ``installed_kernels``)."""
    import torch

    kernels = installed_kernels() if kernels is None else frozenset(kernels)
    if device.type != "cuda":
        return Target(platform="cpu", tp=tp, kernels=kernels)
    major, minor = torch.cuda.get_device_capability(device)
    arch = {9: "sm_90a", 10: "sm_100a"}.get(major, f"sm_{major}{minor}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return Target("cuda", arch, sms, tp, kernels)
