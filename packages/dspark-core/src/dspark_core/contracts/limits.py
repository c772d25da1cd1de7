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

    def allows(self, c, value) -> bool:
        """Whether ``value`` of this field, with the other fields of ``c``, is taken."""
        if self.choices is not None:
            return value in self.choices
        if self.requires is not None:
            return not value or getattr(c, self.requires) is not None
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            return False
        if value % self.multiple or (self.power_of_two and (value < 1 or value & (value - 1))):
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
        for other in (self.groups, self.at_most, self.requires):
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



__all__ = ["HEAD_DIM", "LIMITS", "MARKOV_MAX_RANK", "MARKOV_MAX_ROWS", "MARKOV_SAMPLE", "MARKOV_STEP",
           "MARKOV_THREADS", "MARKOV_VEC", "MAX_HEADS", "MAX_KV_HEADS", "MAX_SIZE", "MAX_STAGED_SLOTS",
           "STAGED_SLOTS_UNIT", "Limit",
           "check", "unsupported"]
