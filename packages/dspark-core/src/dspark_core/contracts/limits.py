"""Every fused kernel's limits on its compile-time constants, stated once.

``LIMITS`` lists them per constants class: a field, what the kernel takes,
in words (``takes``), and the bounds that say it: ``low`` and ``high`` (the
least and the most value), ``multiple`` (a multiple of it), ``power_of_two``,
``choices`` (one of them), ``groups`` (a multiple of another field's value),
``at_most`` (not above another field's value) and ``requires`` (true only
where another field is set). ``check(constants)`` checks a constants object
against its class's limits (and those of the constants nested in it): the
contract's builders (``contracts.constants``, ``contracts.markov``), which
the planner, ``python -m dspark_vllm.plan`` and the plugin's build call, and
the backends' host classes (their ``check_constants``) call it, so all of
them refuse exactly the same, in the same words. The sizes the limits name
are stated here and re-exported by ``constants`` and ``markov``.

Besides these, every constants class refuses (``constants._Key``) an ``int``
field above ``MAX_SIZE`` (heads: ``MAX_HEADS``), an eps that is not a
non-negative number finite in FP32 and an architecture not in ``ARCHS``; the
rows one call takes are ``contracts.kernels.MAX_ROWS`` (the Markov steps':
``markov.markov_rows``). ``contracts.limits_doc`` writes all of it as
``docs/limits.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dspark_core.errors import Unsupported
from dspark_core.spec.gemv import FRAGMENT
from dspark_core.spec.numerics import CHUNK

# The largest size a constants field holds: the kernels index rows, columns,
# features and slots with 32-bit integers.
MAX_SIZE = 2**31 - 1
# The most query or KV heads a kernel takes (a CUDA grid's y extent).
MAX_HEADS = 65535
# The KV head width of every fused attention kernel (one warp, lane j the GPT-J pair j).
HEAD_DIM = 64
# The Markov steps: CTAs of 256 threads, one 16-byte BF16 vector each; the
# embedding gather copies one vector of the Markov rank per thread; one row
# of CTAs a request (a grid's y; vLLM captures up to 512).
MARKOV_THREADS = 256
MARKOV_VEC = 8
MARKOV_MAX_RANK = MARKOV_THREADS * MARKOV_VEC
MARKOV_MAX_ROWS = 65535
# The kernel names (``contracts.kernels``) the limits below belong to, and the
# Markov steps' (dspark-cute's ``markov_step`` and ``markov_sample`` ops; the
# plugin binds them, not the planner).
ROW_NORM, BOUNDARY, CONTEXT_CHAIN, QKV_EPILOGUE = "row_norm", "boundary", "context_chain", "qkv_epilogue"
ATTENTION, O_GATE, MLP_ACTIVATION = "attention", "o_gate", "mlp_activation"
MARKOV_STEP = "markov_step"
MARKOV_SAMPLE = "markov_sample"
# The staged attention kernel's shared-memory slots (256 bytes each), staged
# a slot per thread of its CTA (``spec.attention.LANES`` threads; a test
# checks the two agree).
MAX_STAGED_SLOTS = 768
STAGED_SLOTS_UNIT = 128
# The KV heads of the context store's and the QKV epilogue's stock op.
MAX_KV_HEADS = 32
# The mailbox and the package GEMM take at most this many rows per call (the
# package GEMM's main loop covers 8 or 16 tokens: one or two 8-token MMA tiles).
MAX_DECODE_ROWS = 16
# The package GEMM (dspark-comm): 64 output features per CTA (the ring main
# loop) or 16 (the register-direct one); K split into 1, 2 or 4 K-slices of 4
# warps inside a CTA, each warp a 32-column step at a time, so a shard of K
# is a multiple of PACKAGE_GEMM_K_STEP per K-slice; and at most
# PACKAGE_GEMM_MAX_K per K-slice: a warp's chain of at most 256 MMAs
# (16 columns each), the stated error bound's (``L beta <= 2^-10``, beta =
# 2^-18, ``dspark_cute``'s ``SkinnyConfig``).
PACKAGE_GEMM_TILE_N = (64, 16)
PACKAGE_GEMM_SPLIT_K = (1, 2, 4)
PACKAGE_GEMM_WARPS = 4
PACKAGE_GEMM_K_STEP = 32 * PACKAGE_GEMM_WARPS
PACKAGE_GEMM_MAX_K = 256 * 16 * PACKAGE_GEMM_WARPS
# The one-token GEMV (dspark-cute's ``Gemv``, dspark-comm's one-row package
# GEMV): a warp reads K in fragments of 256 columns (32 lanes x 8); a CTA of 8
# warps owns 16 rows (two a warp, one 32-bit store of a row pair).
GEMV_K_UNIT = FRAGMENT
GEMV_N_UNIT = 16
# The ordered GEMM (dspark-cute's ``OrderedGemm``, its streamed kernel, and
# dspark-comm's exact package GEMM): K in 64-column chunks (the narrowest ring
# stage), N in 16-row MMA tiles, 1 to 64 rows a call (8 token tiles of 8).
# Which row counts it then runs is decided at build on the user's GPU
# (``dspark_core.runtime.gemm_decide``): no fixed rule of row counts or
# sizes, only the margin by which a kernel must beat cuBLAS's median time
# (graph timings from HBM repeat within about half a percent).
ORDERED_GEMM_DECIDE_MARGIN = 0.01
ORDERED_GEMM_K_UNIT = 64
ORDERED_GEMM_N_UNIT = 16
ORDERED_GEMM_MAX_ROWS = 64
# The kernel names of the GEMMs (``contracts.kernels``').
PACKAGE_GEMM, GEMV, ORDERED_GEMM = "package_gemm", "gemv", "ordered_gemm"
# The dtype names of the constants (``constants.DTYPE_NAMES``' values).
FLOAT_DTYPES = ("bf16", "fp16", "fp32")
TABLE_DTYPES = ("bf16", "fp32")
SLOT_DTYPES = ("int32", "int64")


@dataclass(frozen=True)
class Limit:
    """One limit of a kernel on one field of its constants (module docstring)."""

    field: str
    takes: str
    low: int | None = None
    high: int | None = None
    multiple: int = 1
    power_of_two: bool = False
    choices: tuple | None = None
    groups: str | None = None
    at_most: str | None = None
    requires: str | None = None
    # ``low``, ``high`` and ``multiple`` are per unit of another field's value
    # (a package GEMM's K shard: per K-slice, ``split_k``).
    per: str | None = None

    def allows(self, c, value) -> bool:
        """Whether ``value`` of this field, with the other fields of ``c``, is taken."""
        if self.choices is not None:
            return value in self.choices
        if self.requires is not None:
            return not value or getattr(c, self.requires) is not None
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        scale = 1
        if self.per is not None:
            scale = getattr(c, self.per)
            if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
                return False
        low, high = (None if b is None else b * scale for b in (self.low, self.high))
        if (low is not None and value < low) or (high is not None and value > high):
            return False
        if value % (self.multiple * scale) or (self.power_of_two and (value < 1 or value & (value - 1))):
            return False
        if self.groups is not None:
            other = getattr(c, self.groups)
            return isinstance(other, int) and other >= 1 and value % other == 0
        return self.at_most is None or value <= getattr(c, self.at_most)

    def problem(self, kernel: str, c) -> str | None:
        """Why the ``kernel`` kernel does not take ``c``'s value of this field, or None."""
        value = getattr(c, self.field)
        if self.allows(c, value):
            return None
        tail = ""
        for other in (self.groups, self.at_most, self.requires, self.per):
            if other is not None:
                tail = f" ({other} {getattr(c, other)})"
        return f"the {kernel} kernel takes {self.takes}, not {value}{tail} ({type(c).__name__}.{self.field})"


def _multiple(unit: int, high: int = MAX_SIZE) -> int:
    """The largest multiple of ``unit`` up to ``high``."""
    return high - high % unit


_HIDDEN = Limit("hidden_size", f"rows of a positive multiple of {CHUNK} columns", CHUNK, _multiple(CHUNK), CHUNK)
_NORM = (
    Limit("weight_dtype", "a norm weight of bf16, fp16 or fp32 (or none)", choices=(None, *FLOAT_DTYPES)),
    Limit("weight_before_norm", "a weight before the norm only where the norm has a weight",
          requires="weight_dtype"),
)
_VOCAB = Limit("vocab", f"a draft vocabulary below 2^31 that is a positive multiple of {MARKOV_VEC}", MARKOV_VEC,
               _multiple(MARKOV_VEC), MARKOV_VEC)
_RANK = Limit("rank", f"a Markov rank of at most {MARKOV_MAX_RANK} that is a positive multiple of {MARKOV_VEC}",
              MARKOV_VEC, MARKOV_MAX_RANK, MARKOV_VEC)

# Per constants class: the kernel it belongs to and its limits. A class
# whose fields are all free beyond ``_Key``'s rules has none listed.
LIMITS: dict[str, tuple[str, tuple[Limit, ...]]] = {
    "NormConstants": ("norm", _NORM),
    "RowNormConstants": (ROW_NORM, (
        _HIDDEN,
        Limit("in_dtype", "bf16 or fp32 rows", choices=TABLE_DTYPES),
        Limit("out_dtype", "an output of bf16, fp16 or fp32", choices=FLOAT_DTYPES),
    )),
    "BoundaryConstants": (BOUNDARY, (_HIDDEN,)),
    "ContextNormConstants": (CONTEXT_CHAIN, (_HIDDEN, Limit("num_layers", "at least one layer", 1, MAX_SIZE))),
    "ContextStoreConstants": (CONTEXT_CHAIN, (
        Limit("kv_heads", f"a power of two of KV heads up to {MAX_KV_HEADS}", 1, MAX_KV_HEADS, power_of_two=True),
        Limit("table_dtype", "a bf16 or fp32 RoPE table", choices=TABLE_DTYPES),
    )),
    "QKVEpilogueConstants": (QKV_EPILOGUE, (
        Limit("num_heads", "at least one q head", 1, MAX_HEADS),
        Limit("kv_heads", "at least one KV head", 1, MAX_HEADS),
        Limit("q_weight", "a weightless q-norm (the stock fused QK-norm is weightless)", choices=(False,)),
        Limit("table_dtype", "a bf16 or fp32 RoPE table", choices=TABLE_DTYPES),
    )),
    "AttentionConstants": (ATTENTION, (
        Limit("head_dim", f"heads of {HEAD_DIM} columns", HEAD_DIM, HEAD_DIM),
        Limit("kv_heads", "at least one KV head", 1, MAX_HEADS),
        Limit("num_heads", "query heads in whole groups over the KV heads", 1, MAX_HEADS, groups="kv_heads"),
        Limit("block_size", "a KV block size of 1 or more", 1, MAX_SIZE),
        Limit("slot_dtype", "attn_slots of int32 or int64", choices=SLOT_DTYPES),
        Limit("staged_slots", f"staged slots of a multiple of {STAGED_SLOTS_UNIT} up to {MAX_STAGED_SLOTS}", 0,
              MAX_STAGED_SLOTS, STAGED_SLOTS_UNIT),
    )),
    "OGateConstants": (O_GATE, (Limit("num_heads", "at least one head", 1, MAX_HEADS),)),
    "MlpActivationConstants": (MLP_ACTIVATION, (
        Limit("intermediate_size", "an intermediate size that is a positive multiple of 8", 8, _multiple(8), 8),
    )),
    "PackageGemmConstants": (PACKAGE_GEMM, (
        Limit("tile_n", "64 output features per CTA (tile_n 64: the ring main loop) or 16 (tile_n 16: the "
              "register-direct one)", choices=PACKAGE_GEMM_TILE_N),
        Limit("split_k", "K split into 1, 2 or 4 K-slices inside one CTA (split_k)", choices=PACKAGE_GEMM_SPLIT_K),
        Limit("max_rows", f"1 to {MAX_DECODE_ROWS} rows per call (max_rows)", 1, MAX_DECODE_ROWS),
        Limit("hidden_size", "output features that are a positive multiple of its tile_n", 1, MAX_SIZE,
              groups="tile_n"),
        Limit("k_shard", f"a K shard that is a positive multiple of {PACKAGE_GEMM_K_STEP} per K-slice ("
              f"{PACKAGE_GEMM_WARPS} warps of 32-column steps) and at most {PACKAGE_GEMM_MAX_K} per K-slice (the "
              "stated error bound)", PACKAGE_GEMM_K_STEP, PACKAGE_GEMM_MAX_K, PACKAGE_GEMM_K_STEP, per="split_k"),
    )),
    "GemvConstants": (GEMV, (
        Limit("k", f"K a positive multiple of {GEMV_K_UNIT} (fragments of 32 lanes x 8 columns)", GEMV_K_UNIT,
              _multiple(GEMV_K_UNIT), GEMV_K_UNIT),
        Limit("n", f"N a positive multiple of {GEMV_N_UNIT} (CTAs of 8 warps of 2 rows)", GEMV_N_UNIT,
              _multiple(GEMV_N_UNIT), GEMV_N_UNIT),
    )),
    "OrderedGemmConstants": (ORDERED_GEMM, (
        Limit("k", f"K a positive multiple of {ORDERED_GEMM_K_UNIT} below 2^31", ORDERED_GEMM_K_UNIT,
              _multiple(ORDERED_GEMM_K_UNIT), ORDERED_GEMM_K_UNIT),
        Limit("n", f"N a positive multiple of {ORDERED_GEMM_N_UNIT} below 2^31", ORDERED_GEMM_N_UNIT,
              _multiple(ORDERED_GEMM_N_UNIT), ORDERED_GEMM_N_UNIT),
    )),
    "MarkovConstants": (MARKOV_STEP, (_VOCAB, _RANK)),
    "MarkovSampleConstants": (MARKOV_SAMPLE, (
        _VOCAB, _RANK,
        Limit("target_vocab", f"a target vocabulary below 2^31 that is a positive multiple of {MARKOV_VEC}",
              MARKOV_VEC, _multiple(MARKOV_VEC), MARKOV_VEC),
        Limit("vocab", "a draft vocabulary no larger than the target's (each draft id scatters to a distinct "
              "target id)", at_most="target_vocab"),
    )),
}


def unsupported(c) -> str | None:
    """Why the kernel of constants ``c`` (a constants dataclass) does not
    take them (the first limit of ``LIMITS`` they break, nested constants
    first), or None."""
    for name in (f.name for f in dataclasses.fields(c)):
        value = getattr(c, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            reason = unsupported(value)
            if reason is not None:
                return reason
    kernel, limits = LIMITS.get(type(c).__name__, ("", ()))
    for limit in limits:
        reason = limit.problem(kernel, c)
        if reason is not None:
            return reason
    return None


def check(c):
    """``c`` if its kernel takes it, else Unsupported with ``unsupported``'s sentence."""
    reason = unsupported(c)
    if reason is not None:
        raise Unsupported(reason)
    return c



__all__ = ["GEMV", "GEMV_K_UNIT", "GEMV_N_UNIT", "HEAD_DIM", "LIMITS", "MARKOV_MAX_RANK", "MARKOV_MAX_ROWS",
           "MARKOV_SAMPLE", "MARKOV_STEP", "MARKOV_THREADS", "MARKOV_VEC", "MAX_DECODE_ROWS", "MAX_HEADS",
           "MAX_KV_HEADS", "MAX_SIZE", "MAX_STAGED_SLOTS", "ORDERED_GEMM",
           "ORDERED_GEMM_DECIDE_MARGIN", "ORDERED_GEMM_K_UNIT", "ORDERED_GEMM_MAX_ROWS", "ORDERED_GEMM_N_UNIT",
           "PACKAGE_GEMM", "PACKAGE_GEMM_K_STEP", "PACKAGE_GEMM_MAX_K", "PACKAGE_GEMM_SPLIT_K", "PACKAGE_GEMM_TILE_N",
           "PACKAGE_GEMM_WARPS", "STAGED_SLOTS_UNIT", "Limit",
           "check", "unsupported"]
