"""The contracts between the planner and the kernel backends: frozen,
hashable compile-time constants of each fused kernel, built from the spec's
modules. A backend compiles one variant per distinct constants value (their
``key()`` names it), so equal constants always mean the same machine code.

Every ``*_constants`` function takes the model-neutral description of its
part (``dspark_core.runtime.description``) and raises ``Unsupported`` with a
sentence where the kernel does not reproduce the part bit for bit or its
constants break the kernel's limits (``within_limits``: ``contracts.limits``,
which the host classes read too); the planner turns that sentence into its
refusal.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from dspark_core.checks import FP32_OVERFLOW  # noqa: F401 (re-exported)
from dspark_core.checks import arch as _arch
from dspark_core.checks import fp32_number as _fp32_number
from dspark_core.checks import integer as _integer
from dspark_core.checks import shown as _shown
from dspark_core.contracts.limits import (  # noqa: F401 (re-exported: stated in contracts.limits)
    HEAD_DIM,
    MAX_DECODE_ROWS,
    MAX_HEADS,
    MAX_KV_HEADS,
    MAX_SIZE,
    ORDERED_GEMM_K_UNIT,
    ORDERED_GEMM_MAX_ROWS,
    ORDERED_GEMM_N_UNIT,
)
from dspark_core.contracts.limits import check as within_limits
from dspark_core.errors import Unsupported, quoted
from dspark_core.runtime.description import MLP, Attention, Boundary, Connection, HeadNorm, Norm, Rope
from dspark_core.spec.gemv import gemv_unsupported
from dspark_core.spec.numerics import ARCHS

# The dtype names the constants carry (strings keep them hashable and printable).
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _identity(value):
    """``value`` with every float replaced by its FP64 bit pattern: -0.0 and
    0.0 (a gain center) give different bits, so they must not compare equal."""
    if isinstance(value, float):
        return ("f64", struct.unpack("<q", struct.pack("<d", value))[0])
    if isinstance(value, tuple):
        return tuple(_identity(v) for v in value)
    return value


# (a weak reference, fields, hash, key) of each live constants object, by id:
# a launch looks its compiled kernel up by these, and computing them takes
# 3-15 us a time. Kept outside the instance, whose __dict__ is exactly its
# fields (Cls(**c.__dict__) copies one); an entry goes with its object.
_MEMO: dict[int, tuple] = {}


def _forget(ident: int, _ref) -> None:
    _MEMO.pop(ident, None)


def _memo(obj) -> tuple:
    entry = _MEMO.get(id(obj))
    if entry is None or entry[0]() is not obj:
        fields = obj._fields()
        name = type(obj).__name__
        ref = weakref.ref(obj, functools.partial(_forget, id(obj)))
        entry = (ref, fields, hash((name, fields)), hashlib.sha256(repr((name, fields)).encode()).hexdigest()[:16])
        _MEMO[id(obj)] = entry
    return entry


_HEAD_FIELDS = ("num_heads", "kv_heads")
_EPS_FIELDS = ("eps", "q_eps", "k_eps", "o_gate_eps")
_CHECKS: dict[type, list] = {}
_NAMES: dict[type, tuple] = {}


def fp32_number(what: str, value, non_negative: bool = False) -> float:
    """``checks.fp32_number`` with the contracts' refusal, ``Unsupported``:
    ``value`` as a float if it is a number finite in FP32 (and with
    ``non_negative`` not below 0); TypeError for a non-number."""
    return _fp32_number(what, value, low="non-negative" if non_negative else None, error=Unsupported)


def stock_arch(arch, what: str = "stock norm tree") -> str:
    """``arch`` in its one spelling (``checks.arch``: ``SM_90A`` and
    ``(9, 0)`` are sm_90a) where a stock ``what`` is known for it (one of
    ``ARCHS``); Unsupported naming ``what`` for anything else (None, sm_80,
    sm_90 without the suffix)."""
    try:
        return _arch("the architecture", arch)
    except (TypeError, ValueError):
        raise Unsupported(f"no {what} is known for {quoted(arch)} (only {', '.join(ARCHS)})") from None


def _field_checks(cls: type) -> list:
    checks = _CHECKS.get(cls)
    if checks is None:
        checks = []
        for f in dataclasses.fields(cls):
            if f.type == "int":
                checks.append((f.name, "int", MAX_HEADS if f.name in _HEAD_FIELDS else MAX_SIZE))
            elif f.name in _EPS_FIELDS:
                checks.append((f.name, "eps", None))
            elif f.name == "gain_center":
                checks.append((f.name, "number", None))
            elif f.name in ("arch", "o_gate_arch"):
                what = "stock norm tree" if cls.__name__ == "NormConstants" else "stock o-gate"
                checks.append((f.name, "arch", what))
            elif f.name == "sum_order":
                checks.append((f.name, "word", SUM_ORDERS))
            elif f.type == "bool":
                checks.append((f.name, "bool", None))
        _CHECKS[cls] = checks
    return checks


class _Key:
    """Equality, hash and ``key()`` by the exact bits of every field (the
    dataclasses below are declared ``eq=False`` to use them), each computed
    once per object (the dataclasses are frozen).

    Construction checks what every kernel needs of its constants, whoever
    builds them (the planner or a caller by hand): an ``int`` field is an int
    (``checks.integer``: a numpy int is kept as the Python one; a bool is
    refused with a TypeError) of at most ``MAX_SIZE`` (heads:
    ``MAX_HEADS``); an eps is a non-negative number finite in FP32 (NaN
    refused); a gain center a number finite in FP32; an architecture one of
    ``ARCHS`` in its one spelling (``stock_arch``: ``SM_90A`` is kept as
    sm_90a); a sum order one of ``SUM_ORDERS`` (ValueError); a ``bool`` field
True or False (a numpy bool kept as the Python one; 1, "yes" or None
refused with a TypeError).
    Values out of range raise ``Unsupported`` (the planner's refusal; a
    ValueError to any other caller). Each kernel's other limits (lower
    bounds, head widths, multiples, dtypes) are stated once in
    ``contracts.limits``: every builder below ends with ``within_limits``
    and each host class's ``check_constants`` calls it."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field, kind, extra in _field_checks(type(self)):
            value = getattr(self, field)
            what = f"{name}.{field}"
            if kind == "int":
                value = _integer(what, value)
                object.__setattr__(self, field, value)  # a numpy int as the Python one
                if value > extra:
                    raise Unsupported(f"{what} of {value}, more than the kernels take ({extra})")
            elif kind == "eps":
                if value is not None or field != "o_gate_eps":  # None: no o-gate (the one optional eps)
                    fp32_number(what, value, non_negative=True)
            elif kind == "number":
                fp32_number(what, value)
            elif kind == "bool":
                if not isinstance(value, (bool, np.bool_)):
                    raise TypeError(f"{what} must be True or False, not {_shown(value)}")
                object.__setattr__(self, field, bool(value))
            elif kind == "word":
                if not isinstance(value, str) or value not in extra:
                    raise ValueError(f"{what} must be one of {', '.join(extra)}, not {_shown(value)}")
            else:
                object.__setattr__(self, field, stock_arch(value, extra))

    def _fields(self) -> tuple:
        # dataclasses.astuple's value (nested constants as the tuple of their
        # fields), without its deep copy: a plan builds thousands of these.
        names = _NAMES.get(type(self))
        if names is None:
            names = _NAMES[type(self)] = tuple(f.name for f in dataclasses.fields(self))
        return tuple(_memo(v)[1] if isinstance(v, _Key) else _identity(v) for v in map(self.__getattribute__, names))

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and _memo(self)[1] == _memo(other)[1]

    def __hash__(self) -> int:
        return _memo(self)[2]

    def key(self) -> str:
        """A short stable hash of the constants (the compiled variant's name):
        the first 16 hex digits of the SHA-256 of ``repr((type name, fields))``."""
        return _memo(self)[3]


@dataclass(frozen=True, eq=False)
class NormConstants(_Key):
    """What a fused kernel reads of one ``RMSNorm`` besides its weight tensor."""

    eps: float
    # None: the norm has no weight; else "bf16", "fp16" or "fp32".
    weight_dtype: str | None
    gain_center: float
    # The weight scales the input before the norm (else the output after it).
    weight_before_norm: bool
    # The GPU whose stock tree the norm follows (spec.numerics: sm_90a or sm_100a).
    arch: str = "sm_90a"


@dataclass(frozen=True, eq=False)
class RowNormConstants(_Key):
    """The row norm / first layer's input norm kernel: one ``RMSNorm`` of BF16
    (or FP32) rows of ``hidden_size`` columns into ``out_dtype``."""

    hidden_size: int
    norm: NormConstants
    in_dtype: str
    out_dtype: str


@dataclass(frozen=True, eq=False)
class BoundaryConstants(_Key):
    """The residual boundary kernel: post-norm, gated FP32 residual, pre-norm."""

    hidden_size: int
    post: NormConstants
    pre: NormConstants


@dataclass(frozen=True, eq=False)
class ContextNormConstants(_Key):
    """The context norms kernel: the hidden norm, then each of ``num_layers``
    input norms (same constants, own weights), stacked ``[L, T, H]``."""

    hidden_size: int
    num_layers: int
    hidden: NormConstants
    pre: NormConstants


@dataclass(frozen=True, eq=False)
class ContextStoreConstants(_Key):
    """The context K/V store kernel: weightless K-norm, GPT-J RoPE and the
    insert of ``kv_heads`` heads of ``HEAD_DIM`` per layer."""

    kv_heads: int
    k_eps: float
    rope: bool
    table_dtype: str


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise Unsupported(reason)


def norm_constants(norm: Norm, hidden_size: int, arch: str = "sm_90a") -> NormConstants:
    """The constants of a stock norm over ``hidden_size`` columns on
    ``arch`` (its tree), or Unsupported where the fused norms do not
    reproduce it."""
    _refuse(norm.unsupported)
    arch = stock_arch(arch)
    hidden_size = _integer("the rows' hidden_size", hidden_size, 1, MAX_SIZE)
    if norm.hidden_size != hidden_size:
        raise Unsupported(f"a norm over {norm.hidden_size} columns, not the rows' hidden_size {hidden_size}")
    weight_dtype = None
    if norm.weight is not None:
        if norm.weight.dtype not in DTYPE_NAMES:
            raise Unsupported(f"a norm weight of {norm.weight.dtype}, not BF16, FP16 or FP32")
        if tuple(norm.weight.shape) != (hidden_size,) or not norm.weight.is_contiguous():
            raise Unsupported(f"a norm weight other than a contiguous [{hidden_size}] vector")
        weight_dtype = DTYPE_NAMES[norm.weight.dtype]
    return NormConstants(
        eps=float(norm.eps),
        weight_dtype=weight_dtype,
        gain_center=float(norm.gain_center),
        weight_before_norm=bool(norm.weight is not None and norm.weight_before_norm),
        arch=arch,
    )


def connection_unsupported(conn: Connection, hidden_size: int) -> str | None:
    """Why the fused boundary does not take this residual connection, or None:
    the stock gated connection with contiguous FP32 ``[H]`` coefficients."""
    if conn.unsupported is not None:
        return conn.unsupported
    for name in ("alpha", "beta"):
        t = getattr(conn, name)
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype == torch.float32
            and tuple(t.shape) == (hidden_size,)
            and t.is_contiguous()
        ):
            return f"a residual {name} other than a contiguous FP32 [{hidden_size}] vector"
    return None


def boundary_constants(boundary: Boundary, hidden_size: int, arch: str = "sm_90a") -> BoundaryConstants:
    """The constants of the boundary ``post -> connection -> pre``, or
    Unsupported. The pre-norm must produce BF16 (the next layer's input)."""
    _refuse(connection_unsupported(boundary.connection, hidden_size))
    post_c = norm_constants(boundary.post, hidden_size, arch)
    pre_c = norm_constants(boundary.pre, hidden_size, arch)
    if boundary.pre.out_dtype != torch.bfloat16:
        raise Unsupported(f"a next pre-norm that outputs {boundary.pre.out_dtype}, not BF16")
    return within_limits(BoundaryConstants(hidden_size=hidden_size, post=post_c, pre=pre_c))


def row_norm_constants(norm: Norm, hidden_size: int, in_dtype: torch.dtype = torch.bfloat16,
                       arch: str = "sm_90a") -> RowNormConstants:
    """The constants of the row norm kernel for ``norm`` on ``in_dtype``
    rows, or Unsupported (the dtypes the kernel reads and writes are its
    limits)."""
    return within_limits(RowNormConstants(
        hidden_size=hidden_size,
        norm=norm_constants(norm, hidden_size, arch),
        in_dtype=DTYPE_NAMES.get(in_dtype, str(in_dtype)),
        out_dtype=DTYPE_NAMES.get(norm.out_dtype, str(norm.out_dtype)),
    ))


def _rope_facts(rope: Rope | None) -> tuple[bool, str]:
    if rope is None:
        return False, "bf16"
    _refuse(rope.unsupported)
    if rope.head_dim != HEAD_DIM:
        raise Unsupported(f"a RoPE over {rope.head_dim} columns, not the whole {HEAD_DIM}-wide head")
    if rope.table.dtype not in (torch.bfloat16, torch.float32):
        raise Unsupported(f"a RoPE table of {rope.table.dtype}, not BF16 or FP32")
    return True, DTYPE_NAMES[rope.table.dtype]


def _kv_heads(kv_heads: int) -> int:
    """``kv_heads`` where the stock fused QK-norm/RoPE/insert op takes them
    (a power of two up to ``MAX_KV_HEADS``, as the context store kernel:
    ``contracts.limits``), else Unsupported."""
    if kv_heads < 1 or kv_heads & (kv_heads - 1) or kv_heads > MAX_KV_HEADS:
        raise Unsupported(f"{kv_heads} KV heads, not a power of two up to {MAX_KV_HEADS}")
    return kv_heads


def context_store_constants(k_norm: HeadNorm, kv_heads: int, rope: Rope | None) -> ContextStoreConstants:
    """The constants of the context K/V store, or Unsupported."""
    _refuse(k_norm.unsupported)
    if k_norm.weight is not None:
        raise Unsupported("a K-norm with a weight (the context store takes the weightless one)")
    if k_norm.head_dim != HEAD_DIM:
        raise Unsupported(f"{k_norm.head_dim}-wide KV heads, not {HEAD_DIM}")
    rotates, table_dtype = _rope_facts(rope)
    return within_limits(ContextStoreConstants(kv_heads=kv_heads, k_eps=float(k_norm.eps), rope=rotates,
                                               table_dtype=table_dtype))


@dataclass(frozen=True, eq=False)
class QKVEpilogueConstants(_Key):
    """The QKV epilogue kernel: vLLM's fused QK-norm, GPT-J RoPE and K/V
    insert on the stock QKV projection's output (q, k, v, o-gate rows;
    ``hidden_size`` the projection's input width)."""

    hidden_size: int
    num_heads: int
    kv_heads: int
    q_weight: bool
    q_eps: float
    k_eps: float
    rope: bool
    table_dtype: str


def qkv_epilogue_constants(attn: Attention) -> QKVEpilogueConstants:
    """The constants of the QKV epilogue for a layer's
    attention, or Unsupported where they do not reproduce its stock
    projection's epilogue."""
    _refuse(attn.unsupported)
    if not attn.use_o_gate:
        raise Unsupported("no o-gate rows in the QKV projection")
    if attn.head_dim != HEAD_DIM:
        raise Unsupported(f"{attn.head_dim}-wide heads, not {HEAD_DIM}")
    kv = _kv_heads(attn.num_kv_heads)
    if attn.qkv_weight.dtype != torch.bfloat16:
        raise Unsupported(f"a QKV weight of {attn.qkv_weight.dtype}, not bfloat16")
    for norm in (attn.q_norm, attn.k_norm):
        _refuse(norm.unsupported)
        if norm.head_dim != HEAD_DIM:
            raise Unsupported(f"a QK-norm over {norm.head_dim} columns, not {HEAD_DIM}")
    if attn.q_norm.weight is not None or attn.k_norm.weight is not None:
        raise Unsupported("a QK-norm with a weight (the stock fused QK-norm is weightless)")
    rotates, table_dtype = _rope_facts(attn.rope)
    return within_limits(QKVEpilogueConstants(
        hidden_size=attn.qkv_weight.shape[1],
        num_heads=attn.num_heads,
        kv_heads=kv,
        q_weight=attn.q_norm.weight is not None,
        q_eps=float(attn.q_norm.eps),
        k_eps=float(attn.k_norm.eps),
        rope=rotates,
        table_dtype=table_dtype,
    ))


@dataclass(frozen=True, eq=False)
class ContextConstants(_Key):
    """The fused context K/V chain: its norms kernel and its store kernel."""

    norms: ContextNormConstants
    store: ContextStoreConstants


# The sum orders of an all-reduce (which stock all-reduce a mailbox reproduces).
FP32_RANK_ORDER = "fp32_rank_order"
BF16_RANK_ORDER = "bf16_rank_order"
SUM_ORDERS = (FP32_RANK_ORDER, BF16_RANK_ORDER)


@dataclass(frozen=True, eq=False)
class AllReduceConstants(_Key):
    """The fused all-reduce boundary: the TP size and the sum order
    (``FP32_RANK_ORDER``: ranks' BF16 partials widened and added in FP32 in
    rank order 0, 1, ..., then rounded to BF16 once, as a one-shot all-reduce
    does; ``BF16_RANK_ORDER``: each add rounded to BF16)."""

    tp: int
    sum_order: str = FP32_RANK_ORDER


@dataclass(frozen=True, eq=False)
class PackageGemmConstants(_Key):
    """One branch's package GEMM: ``x[m, k_shard] @ W[hidden, k_shard]^T``
    at its role's launch shape."""

    role: str
    hidden_size: int
    k_shard: int
    tile_n: int
    split_k: int
    max_rows: int


def package_gemm_constants(role: str, hidden_size: int, k_shard: int, tile_n: int, split_k: int,
                           max_rows: int = MAX_DECODE_ROWS) -> PackageGemmConstants:
    """The package GEMM's constants, or Unsupported with the first of its
    limits (``contracts.limits``) they break."""
    return within_limits(PackageGemmConstants(role, hidden_size, k_shard, tile_n, split_k, max_rows))


@dataclass(frozen=True, eq=False)
class GemvConstants(_Key):
    """The one-token projection of one weight in the stated order
    (``dspark_core.spec.gemv``): BF16 ``x [1, k] @ W[n, k]^T``; ``role`` names the
    projection (``qkv_proj``, ``o_proj``, ``gate_up``, ``down``)."""

    role: str
    n: int
    k: int


def gemv_constants(role: str, weight: torch.Tensor) -> GemvConstants:
    """The GEMV's constants for ``weight`` (BF16 ``[N, K]``), or Unsupported
    with the reason (``dspark_core.spec.gemv.gemv_unsupported``)."""
    _refuse(gemv_unsupported(weight))
    return within_limits(GemvConstants(role, int(weight.shape[0]), int(weight.shape[1])))


@dataclass(frozen=True, eq=False)
class OrderedGemmConstants(_Key):
    """A projection on the ordered GEMM (``dspark_core.spec.split_order``):
    BF16 ``x [m, k] @ W[n, k]^T`` in the split order the build-time check
    finds for each row count; ``role`` names the projection."""

    role: str
    n: int
    k: int


def ordered_gemm_unsupported(weight) -> str | None:
    """Why the ordered GEMM does not take ``weight`` (a sentence), or None:
    it takes a 2-D BF16 weight ``[n, k]`` with contiguous rows, ``k`` a
    multiple of 64 and ``n`` of 16, both below 2^31."""
    if not isinstance(weight, torch.Tensor):
        return f"the ordered GEMM takes a 2-D bfloat16 torch tensor as its weight, not {type(weight).__name__}"
    if weight.layout != torch.strided:
        return f"the ordered GEMM takes a dense weight, not a {weight.layout} one"
    if weight.dim() != 2:
        return f"the ordered GEMM takes a 2-D weight, not one of shape {list(weight.shape)}"
    if weight.dtype != torch.bfloat16:
        return f"the ordered GEMM takes a bfloat16 weight, not {weight.dtype}"
    if not weight.is_contiguous():
        return (f"the ordered GEMM takes a weight with contiguous rows (strides (k, 1)), not strides "
                f"{tuple(weight.stride())} (a transposed or sliced view: pass .contiguous())")
    n, k = (int(v) for v in weight.shape)
    if not (0 < k < 2**31 and k % ORDERED_GEMM_K_UNIT == 0):
        return f"the ordered GEMM takes K a positive multiple of {ORDERED_GEMM_K_UNIT} below 2^31, not {k}"
    if not (0 < n < 2**31 and n % ORDERED_GEMM_N_UNIT == 0):
        return f"the ordered GEMM takes N a positive multiple of {ORDERED_GEMM_N_UNIT} below 2^31, not {n}"
    if n * k >= 2**62:
        return f"the ordered GEMM takes weights of fewer than 2^62 elements, not {n} x {k}"
    return None


# The draft's projections the ordered GEMM takes (``role`` names the weight in
# logs and plans; "down" also as the plan's "down_proj"): the layers', fc, the
# LM head and the Markov bias.
ORDERED_GEMM_PROJECTIONS = ("fc", "qkv_proj", "o_proj", "gate_up", "down", "lm_head", "markov_bias")


def ordered_gemm_constants(role: str, weight) -> OrderedGemmConstants:
    """The ordered GEMM's constants for ``weight`` of projection ``role`` (one
    of ``ORDERED_GEMM_PROJECTIONS``: ValueError otherwise), or Unsupported
    with the reason (``ordered_gemm_unsupported``)."""
    if not isinstance(role, str) or role not in ORDERED_GEMM_PROJECTIONS:
        raise ValueError(f"the ordered GEMM's role must be one of {', '.join(ORDERED_GEMM_PROJECTIONS)}, not "
                         f"{role!r}"[:300])
    _refuse(ordered_gemm_unsupported(weight))
    return within_limits(OrderedGemmConstants(role, int(weight.shape[0]), int(weight.shape[1])))


@dataclass(frozen=True, eq=False)
class MlpActivationConstants(_Key):
    """The gated SiLU activation kernel (``GatedMLP.activation``): BF16
    ``gu [m, 2I]`` to BF16 ``h [m, I]``, I = ``intermediate_size``."""

    intermediate_size: int


@dataclass(frozen=True, eq=False)
class OGateConstants(_Key):
    """The o-norm and sigmoid o-gate kernel (``layers.o_gate``):
    ``num_heads`` heads of ``HEAD_DIM``, the weightless o-norm's ``eps``, and
    the GPU whose stock arithmetic it follows (FLA's Triton kernel on
    sm_90a, FlashInfer's on sm_100a)."""

    num_heads: int
    eps: float
    arch: str = "sm_90a"


def mlp_activation_constants(mlp: MLP) -> MlpActivationConstants:
    """The constants of the activation kernel for a layer's MLP, or
    Unsupported (the kernel's limits: I a positive multiple of 8, 16-byte
    vectors)."""
    _refuse(mlp.unsupported)
    return within_limits(MlpActivationConstants(intermediate_size=mlp.intermediate_size))


def o_gate_constants(norm: HeadNorm, num_heads: int, arch: str = "sm_90a") -> OGateConstants:
    """The constants of the o-gate kernel for the o-norm ``norm`` over
    ``num_heads`` heads, or Unsupported (a weightless o-norm of ``HEAD_DIM``)."""
    _refuse(norm.unsupported)
    if norm.weight is not None:
        raise Unsupported("an o-norm with a weight (the fused o-gate takes a weightless one)")
    if norm.head_dim != HEAD_DIM:
        raise Unsupported(f"{norm.head_dim}-wide heads, not {HEAD_DIM}")
    arch = stock_arch(arch, "stock o-gate")
    return within_limits(OGateConstants(num_heads=num_heads, eps=float(norm.eps), arch=arch))


@dataclass(frozen=True, eq=False)
class AttentionConstants(_Key):
    """The decode attention kernel (``attention.paged_attention``):
    ``num_heads`` query heads over ``kv_heads`` KV heads of ``head_dim``
    columns, a paged cache of ``block_size`` slots per block, ``attn_slots``
    of ``slot_dtype`` ("int32" or "int64").

    The opt-in variant's options (both off: the default kernel, whose
    equality, hash and ``key()`` are those of the five fields above alone):
    ``staged_slots``, the slots whose K and V rows the kernel stages in
    shared memory (0: none); ``o_gate_eps``, None or the eps of the
    weightless o-norm whose o-gate the kernel applies to its output
    (``layers.o_gate(paged_attention(...), gate, HeadNorm(D, eps), arch)``)
    in the stock o-gate arithmetic of ``o_gate_arch``."""

    num_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    slot_dtype: str = "int64"
    staged_slots: int = 0
    o_gate_eps: float | None = None
    o_gate_arch: str = "sm_90a"

    @property
    def is_default(self) -> bool:
        """Whether these are the default kernel's constants (no option on)."""
        return self.staged_slots == 0 and self.o_gate_eps is None

    def _fields(self) -> tuple:
        fields = super()._fields()
        if self.is_default:
            return fields[:5]
        return fields if self.o_gate_eps is not None else fields[:7]
