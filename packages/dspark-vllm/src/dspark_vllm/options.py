"""``additional_config`` as DSpark reads it: vLLM's free-form mapping of
platform options (``--additional-config '{...}'``), where DSpark reads the
keys ``KEYS`` and nothing else.

``read(vllm_config, key, default)`` is the value of ``key``, ``default``
where absent. What would otherwise pass without a word is said once in
vLLM's log (``vllm.dspark``), never refused (the mapping is vLLM's and other
plugins'): an ``additional_config`` that is no mapping (vLLM also takes an
object with ``compute_hash``: DSpark reads none of its keys), and the keys
that miss one of ``KEYS`` by case, dashes, blanks or a letter or two
(``Decode-Backend``, ``"ordered_gemm "``, ``ordered_gem``: no switch, the
key DSpark reads keeps its default). ``switch(vllm_config, key, default)``
is a switch: a bool, ``default`` where absent (False: an opt-in),
TypeError for anything else.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping

from dspark_core.errors import listed

DECODE_BACKEND = "decode_backend"
PACKAGE_GEMM = "package_gemm"
ORDERED_GEMM = "ordered_gemm"
KEYS = (DECODE_BACKEND, PACKAGE_GEMM, ORDERED_GEMM)
# How close a key must come to one of KEYS (difflib's ratio, after case,
# dashes and blanks are folded) to be a near miss: a letter or two in a key
# of a dozen.
NEAR = 0.85

log = logging.getLogger("vllm.dspark")
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning("%s", message)


def near_miss(key: object) -> str | None:
    """The key of ``KEYS`` that ``key`` misses (by case, dashes, blanks or a
    letter or two), or None: for ``KEYS`` themselves, a key that is not a
    string, and one near none of them."""
    if not isinstance(key, str) or key in KEYS or len(key) > 4 * max(map(len, KEYS)):
        return None
    folded = "".join(key.split()).lower().replace("-", "_")
    close = difflib.get_close_matches(folded, KEYS, n=1, cutoff=NEAR)
    return close[0] if close else None


def read(vllm_config, key: str, default: object) -> object:
    """``additional_config[key]`` of ``vllm_config``, ``default`` where
    absent or where ``additional_config`` is no mapping (said once), the
    near misses of ``key`` said once (module docstring)."""
    extra = getattr(vllm_config, "additional_config", None)
    if extra is None:
        return default
    if not isinstance(extra, Mapping):
        _say_once(f"additional_config is a {type(extra).__name__}, not a mapping: the DSpark plugin reads none "
                  f"of its keys ({', '.join(KEYS)} stay their defaults)")
        return default
    value = extra.get(key, default)
    misses = [k for k in extra if near_miss(k) == key]
    if misses:
        _say_once(f"additional_config has the key {listed(misses)}, not {key!r}: the DSpark plugin does not "
                  f"read it ({key} stays {value!r}); write {key!r} exactly")
    return value


def switch(vllm_config, key: str, default: bool = False) -> bool:
    """``additional_config[key]`` of ``vllm_config`` as a switch (``read``):
    ``default`` where absent (or no mapping), TypeError for anything but a
    bool."""
    value = read(vllm_config, key, default)
    if not isinstance(value, bool):
        raise TypeError(f"additional_config['{key}'] must be true or false, not {value!r}")
    return value


__all__ = ["DECODE_BACKEND", "KEYS", "NEAR", "ORDERED_GEMM", "PACKAGE_GEMM", "near_miss", "read", "switch"]
