"""The reference DSpark draft's configuration: shapes, eps values, norm
variants and dtypes, readable from and writable to JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_core import checks
from dspark_core.contracts.constants import MAX_SIZE
from dspark_core.errors import listed

INT64_MAX = 2**63 - 1
# The most layers a draft config (or a target, whose layers a draft reads)
# may have: drafts have a few and the largest models a few hundred; planning
# builds every layer's modules (linear in the count: 1024 layers take about
# 60 MB and 4 s, the 65536 once allowed 3.6 GB and minutes), so more is
# refused rather than planned.
MAX_LAYERS = 1 << 10
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The norm variant keys a config may set, globally or per norm (norm_overrides).
NORM_KEYS = ("has_weight", "weight_dtype", "gain_center", "weight_before_norm", "eps")
_NORM_TYPES = {"has_weight": bool, "weight_dtype": str, "gain_center": float, "weight_before_norm": bool,
               "eps": float}
# The norms of each layer, as norm_overrides names them.
LAYER_NORMS = ("input_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm")


def _check_type(name: str, value: Any, kind: type) -> Any:
    """``value`` where it is a ``kind``, else TypeError: no silent conversion
    of a mistyped config value. An int or a float is ``checks.integer``'s and
    ``checks.fp32_number``'s (a numpy number taken as the Python one, a bool
    refused), returned as the Python number; any other kind by isinstance."""
    if kind is int:
        return checks.integer(name, value)
    if kind is float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float, not {checks.shown(value)}")
        return float(value)
    if not isinstance(value, kind):
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise TypeError(f"{name} must be {article} {kind.__name__}, not {checks.shown(value)}")
    return value


@dataclass(frozen=True)
class DraftConfig:
    """A DSpark draft. The defaults are the reference draft: hidden 8192, KV
    heads of 64 columns, a power-of-two number of KV heads, the o-gate, BF16
    compute and an FP32 residual stream.

    ``norm_overrides`` maps a norm's name (``hidden_norm``, ``norm``,
    ``layers.<i>.<input_norm|post_attn_norm|pre_ffn_norm|post_ffn_norm>``) to
    the variant keys ``NORM_KEYS`` that differ from the global ones.
    ``connection_overrides`` maps a boundary's connection
    (``layers.<i>.<add_attn|add_ffn>``) to ``{"dtype": "bf16"}`` for a
    connection whose coefficients are not FP32 (a part the kernels refuse).
    """

    hidden_size: int = 8192
    num_layers: int = 2
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 16384
    vocab_size: int = 8192
    max_position: int = 8192
    rope_theta: float = 10000.0
    rope_table_dtype: str = "fp32"
    use_rope: bool = True
    use_o_gate: bool = True
    rms_norm_eps: float = 1e-6
    head_norm_eps: float = 1e-6
    # The global norm variant (every RMSNorm unless overridden).
    norm_has_weight: bool = True
    norm_weight_dtype: str = "bf16"
    norm_gain_center: float = 0.0
    norm_weight_before_norm: bool = False
    compute_dtype: str = "bf16"
    residual_dtype: str = "fp32"
    kv_block_size: int = 16
    seed: int = 0
    norm_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    connection_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            # A numpy int or float is kept as the Python one (the config is written back as JSON).
            object.__setattr__(self, f.name, _check_type(f.name, getattr(self, f.name), _FIELD_TYPES[f.name]))
        for name in ("rope_table_dtype", "norm_weight_dtype", "compute_dtype", "residual_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}, not {getattr(self, name)!r}")
        positive = ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size", "max_position", "kv_block_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        for name in positive:
            if getattr(self, name) > MAX_SIZE:
                raise ValueError(f"{name} must be at most {MAX_SIZE} (the kernels index with 32-bit integers), "
                                 f"not {getattr(self, name)}")
        if not 0 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers must be from 0 to {MAX_LAYERS}, not {self.num_layers}")
        if self.q_size > MAX_SIZE:
            raise ValueError(f"num_heads * head_dim must be at most {MAX_SIZE}, not {self.q_size}")
        rows = max(2 * self.q_size + 2 * self.kv_size, 2 * self.intermediate_size, self.vocab_size)
        if rows * self.hidden_size > INT64_MAX:
            raise ValueError(f"a weight of {rows} x {self.hidden_size} elements: more than a tensor holds (2^63 - 1)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        checks.fp32_number("rope_theta", self.rope_theta, above=1.0)
        for name in ("rms_norm_eps", "head_norm_eps"):
            checks.fp32_number(name, getattr(self, name), low="non-negative")
        checks.fp32_number("norm_gain_center", self.norm_gain_center)
        norms = self.norm_names()
        for name, keys in self.norm_overrides.items():
            if name not in norms:
                raise ValueError(f"norm_overrides names {name!r}, not a norm of this draft; its norms are hidden_norm, "
                                 f"norm and layers.<i>.<{'|'.join(LAYER_NORMS)}> for i < {self.num_layers}")
            if not isinstance(keys, dict):
                raise TypeError(f"norm_overrides[{name!r}] must be a dict of {NORM_KEYS}, not {type(keys).__name__}")
            unknown = set(keys) - set(NORM_KEYS)
            if unknown:
                raise ValueError(f"norm_overrides[{name!r}] has unknown keys {listed(unknown)}; known: {NORM_KEYS}")
            self.norm_variant(name)  # checks each value
        connections = {f"layers.{i}.{c}" for i in range(self.num_layers) for c in ("add_attn", "add_ffn")}
        for name, keys in self.connection_overrides.items():
            if name not in connections:
                raise ValueError(f"connection_overrides names {name!r}, not a connection of this draft; its "
                                 f"connections are layers.<i>.<add_attn|add_ffn> for i < {self.num_layers}")
            if not isinstance(keys, dict) or set(keys) - {"dtype"} or keys.get("dtype", "fp32") not in DTYPES:
                raise ValueError(f"connection_overrides[{name!r}] must be {{'dtype': one of {sorted(DTYPES)}}}, "
                                 f"not {keys!r}")

    def norm_names(self) -> list[str]:
        """The names of this draft's norms, as ``norm_overrides`` takes them."""
        return ["hidden_norm", "norm"] + [f"layers.{i}.{n}" for i in range(self.num_layers) for n in LAYER_NORMS]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def norm_variant(self, name: str) -> dict[str, Any]:
        """The RMSNorm keyword arguments of the norm called ``name``."""
        variant = {
            "has_weight": self.norm_has_weight,
            "weight_dtype": self.norm_weight_dtype,
            "gain_center": self.norm_gain_center,
            "weight_before_norm": self.norm_weight_before_norm,
            "eps": self.rms_norm_eps,
        }
        variant.update(self.norm_overrides.get(name, {}))
        for key, value in variant.items():
            variant[key] = _check_type(f"{name}'s {key}", value, _NORM_TYPES[key])
        if variant["weight_dtype"] not in DTYPES:
            raise ValueError(f"{name}: weight_dtype must be one of {sorted(DTYPES)}, not {variant['weight_dtype']!r}")
        checks.fp32_number(f"{name}'s gain_center", variant["gain_center"])
        checks.fp32_number(f"{name}'s eps", variant["eps"], low="non-negative")
        variant["weight_dtype"] = DTYPES[variant["weight_dtype"]]
        return variant

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftConfig:
        if "architectures" in data:
            # A checkpoint's config.json (vLLM's draft): its plan is dspark-vllm's, over vLLM's own modules.
            raise ValueError(f"a checkpoint config (architectures {data['architectures']}), not a DraftConfig: "
                             "plan a vLLM draft checkpoint with python -m dspark_vllm.plan <its folder>")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown DraftConfig keys {listed(unknown)}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> DraftConfig:
        return cls.from_dict(read_json_object(path, "DraftConfig fields"))


# A config file larger than this is refused unread (a config is a few KB).
MAX_JSON_BYTES = 1 << 24


def _json_int(text: str) -> int:
    value = int(text)
    if abs(value) > INT64_MAX:
        raise ValueError(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} does not fit in 64 bits")
    return value


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is not finite in a float")
    return value


def _json_constant(text: str):
    raise ValueError(f"{text} is not a JSON number")


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) < len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"an object repeats the keys {listed({k for k in keys if keys.count(k) > 1})} (which "
                         "one counts is the reader's choice: write each once)")
    return data


# What a path that is no regular file is, by its stat.S_IS* test.
_FILE_KINDS = (("a directory", stat.S_ISDIR), ("a FIFO", stat.S_ISFIFO), ("a socket", stat.S_ISSOCK),
               ("a character device", stat.S_ISCHR), ("a block device", stat.S_ISBLK))


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``what``: what it should hold,
    for the error). ValueError, naming the path, for an empty path or one
    ending in a slash (a directory's), what is no regular file (a
    directory, a device, a FIFO: never read, and said which), a file over
    ``MAX_JSON_BYTES``, text that is not UTF-8 or not strict JSON (NaN and
    Infinity, numbers that overflow a float, integers beyond int64, a key
    repeated in an object, nesting deeper than Python's recursion limit) and
    JSON that is no object; TypeError for a path that is no ``str`` or
    ``os.PathLike`` of one; OSError for a path that cannot be read."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TypeError(f"the path of {what} must be a str or a pathlib.Path, not {checks.shown(path)}")
    if isinstance(path, str) and (not path or path.endswith("/")):
        raise ValueError(f"the path of {what} must name a JSON file, not {path!r}"
                         + (" (a trailing slash names a directory)" if path else ""))
    path = Path(path)
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for name, test in _FILE_KINDS if test(st.st_mode)), "no regular file")
        raise ValueError(f"{path} is {kind}, not a regular file of {what}")
    if st.st_size > MAX_JSON_BYTES:
        raise ValueError(f"{path} holds {st.st_size} bytes, more than a config's {MAX_JSON_BYTES}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_int=_json_int, parse_float=_json_float,
                          parse_constant=_json_constant, object_pairs_hook=_json_pairs)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error.reason} at byte {error.start}") from None
    except RecursionError:
        raise ValueError(f"{path} nests its JSON too deeply") from None
    except ValueError as error:  # json.JSONDecodeError and the hooks' refusals
        raise ValueError(f"{path} is not JSON {what} can hold: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object of {what}, not {type(data).__name__}")
    return data


# Each field's type, from its annotation: the config refuses any other.
_FIELD_TYPES = {f.name: {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, dict)
                for f in dataclasses.fields(DraftConfig)}


def small_config(**changes: Any) -> DraftConfig:
    """A draft small enough for CPU tests, with the reference's structure:
    hidden 2048, 8 heads of 64, 2 KV heads, 2 layers."""
    base = dict(
        hidden_size=2048,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=512,
        max_position=1024,
    )
    base.update(changes)
    return DraftConfig(**base)
