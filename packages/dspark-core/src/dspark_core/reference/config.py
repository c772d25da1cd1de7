"""The reference DSpark draft's configuration: shapes, eps values, norm
variants and dtypes, readable from and writable to JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark_core.contracts.constants import FP32_OVERFLOW, MAX_SIZE

INT64_MAX = 2**63 - 1
# The most layers a draft config may have: drafts have a few; planning builds
# every layer's modules (linear in the count), so a config of millions of
# layers is refused rather than planned for minutes.
MAX_LAYERS = 1 << 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The norm variant keys a config may set, globally or per norm (norm_overrides).
NORM_KEYS = ("has_weight", "weight_dtype", "gain_center", "weight_before_norm", "eps")
_NORM_TYPES = {"has_weight": bool, "weight_dtype": str, "gain_center": float, "weight_before_norm": bool,
               "eps": float}
# The norms of each layer, as norm_overrides names them.
LAYER_NORMS = ("input_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm")


def _fp32_finite(value: float) -> bool:
    """Whether ``value`` is finite once rounded to FP32, as the stock rounds
    eps, gain centers and the RoPE base (1e300 is finite here, inf there)."""
    return abs(value) < FP32_OVERFLOW


def _check_type(name: str, value: Any, kind: type) -> None:
    """TypeError unless ``value`` is a ``kind`` (an int is a float; a bool is
    no int): no silent conversion of a mistyped config value."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
          else isinstance(value, int) and not isinstance(value, bool) if kind is int
          else isinstance(value, kind))
    if not ok:
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise TypeError(f"{name} must be {article} {kind.__name__}, not {type(value).__name__} {value!r}")


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
            _check_type(f.name, getattr(self, f.name), _FIELD_TYPES[f.name])
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
        if not (_fp32_finite(self.rope_theta) and self.rope_theta > 1.0):
            raise ValueError(f"rope_theta must be a finite number above 1 (finite in FP32), not {self.rope_theta}")
        for name in ("rms_norm_eps", "head_norm_eps"):
            if not (_fp32_finite(getattr(self, name)) and getattr(self, name) >= 0.0):
                raise ValueError(f"{name} must be a finite non-negative number (finite in FP32), "
                                 f"not {getattr(self, name)}")
        if not _fp32_finite(self.norm_gain_center):
            raise ValueError(f"norm_gain_center must be finite (in FP32), not {self.norm_gain_center}")
        norms = self.norm_names()
        for name, keys in self.norm_overrides.items():
            if name not in norms:
                raise ValueError(f"norm_overrides names {name!r}, not a norm of this draft; its norms are hidden_norm, "
                                 f"norm and layers.<i>.<{'|'.join(LAYER_NORMS)}> for i < {self.num_layers}")
            if not isinstance(keys, dict):
                raise TypeError(f"norm_overrides[{name!r}] must be a dict of {NORM_KEYS}, not {type(keys).__name__}")
            unknown = set(keys) - set(NORM_KEYS)
            if unknown:
                raise ValueError(f"norm_overrides[{name!r}] has unknown keys {sorted(unknown)}; known: {NORM_KEYS}")
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
            _check_type(f"{name}'s {key}", value, _NORM_TYPES[key])
        if variant["weight_dtype"] not in DTYPES:
            raise ValueError(f"{name}: weight_dtype must be one of {sorted(DTYPES)}, not {variant['weight_dtype']!r}")
        if not _fp32_finite(variant["gain_center"]) or not (_fp32_finite(variant["eps"]) and variant["eps"] >= 0):
            raise ValueError(f"{name}: gain_center and eps must be finite (in FP32; eps non-negative), not "
                             f"{variant['gain_center']} and {variant['eps']}")
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
            raise ValueError(f"unknown DraftConfig keys {sorted(unknown)}")
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


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``what``: what it should hold,
    for the error). ValueError, naming the path, for what is no regular
    file (a directory, a device, a FIFO: never read), a file over
    ``MAX_JSON_BYTES``, text that is not UTF-8 or not strict JSON (NaN and
    Infinity, numbers that overflow a float, integers beyond int64, nesting
    deeper than Python's recursion limit) and JSON that is no object; OSError
    for a path that cannot be read."""
    path = Path(path)
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if st.st_size > MAX_JSON_BYTES:
        raise ValueError(f"{path} holds {st.st_size} bytes, more than a config's {MAX_JSON_BYTES}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_int=_json_int, parse_float=_json_float,
                          parse_constant=_json_constant)
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
