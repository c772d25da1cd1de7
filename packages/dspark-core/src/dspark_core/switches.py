"""DSpark's switches, parsed strictly: a switch means what it says or is refused.

A Python switch (``build_draft_decode(gemv=...)``, ``package_gemm=...``) is a
``bool``: any other value, the string ``"0"`` or ``"no"`` included, is a
TypeError (a non-empty string is truthy, so ``gemv="0"`` would turn the GEMV
on). An environment switch (``DSPARK_GEMV``, ``DSPARK_PREFETCH``, ...) is one
of the words in ``ON`` or ``OFF`` (case and surrounding blanks ignored); unset
or empty leaves the caller's default; anything else is a ValueError naming the
accepted words. ``DSPARK_KERNEL_CACHE`` (``cache_setting``) also takes a
directory, written as an absolute path or ``~/...``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dspark_core.errors import quoted

ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no")


def flag(value: object, name: str) -> bool:
    """``value`` if it is a bool; TypeError naming ``name`` otherwise."""
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be True or False, not {type(value).__name__} {quoted(value)}")


def _words() -> str:
    return f"one of {', '.join(ON)} (on) or {', '.join(OFF)} (off)"


def _text(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The variable's value stripped, or None where it is unset or empty;
    TypeError naming it where ``environ`` holds no string there (the
    environment's values are strings)."""
    text = (os.environ if environ is None else environ).get(name)
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{name} must be set to a string, not {type(text).__name__} {quoted(text)}")
    if text is None or not text.strip():
        return None
    return text.strip()


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """The environment switch ``name``: True for ``ON``'s words, False for
    ``OFF``'s, ``default`` where unset or empty; ValueError otherwise."""
    text = _text(name, environ)
    if text is None:
        return default
    if text.lower() in ON:
        return True
    if text.lower() in OFF:
        return False
    raise ValueError(f"{name} must be {_words()}, not {quoted(text)}")


def switch(value: object, env: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """A caller's switch ``value`` (a bool; None: the environment's ``env``,
    else ``default``)."""
    if value is None:
        return env_flag(env, default, environ)
    return flag(value, env.removeprefix("DSPARK_").lower())


def env_choice(name: str, choices: tuple[str, ...], default: str, environ: Mapping[str, str] | None = None) -> str:
    """The environment setting ``name``: one of ``choices`` (exactly as
    written, surrounding blanks ignored), ``default`` where unset or empty;
    ValueError otherwise."""
    text = _text(name, environ)
    if text is None:
        return default
    if text not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {quoted(text)}")
    return text


def cache_setting(name: str, default: Path, environ: Mapping[str, str] | None = None) -> Path | None:
    """A cache switch that also takes a directory: None (off) where ``name``
    is unset, empty or one of ``OFF``'s words; ``default`` for ``ON``'s words;
    the directory for an absolute path or ``~/...``, normalized (``.`` and
    doubled slashes; a path with ``..`` is read with its links resolved, as
    the system reads it) before any rule. ValueError for a relative path
    or any other word (a word is not a directory name, and a relative one
    would follow the working directory), a NUL byte, and for the home
    directory or any directory above it (``~``, ``~/.``, ``/``, ``//``, a
    link to one of them: the rule reads the path with its links resolved): a
    cache writes its files into a directory of its own."""
    text = _text(name, environ)
    if text is None or text.lower() in OFF:
        return None
    if text.lower() in ON:
        return default
    raw = None
    if text.startswith("~/"):
        raw = os.path.expanduser("~") + "/" + text[2:]
    elif os.path.isabs(text):
        raw = text
    if raw is None or "\0" in text:
        raise ValueError(f"{name} must be {_words()}, or an absolute directory (or ~/dir), not {quoted(text)}")
    # A ".." after a link names the link target's parent (as the system reads
    # it), not the link's folder: the path up to its last ".." is taken with
    # its links resolved, the rest as written (a last link stays a link, which
    # the cache refuses).
    parts = Path(raw).parts
    if ".." in parts:
        last = len(parts) - 1 - parts[::-1].index("..")
        raw = os.path.join(os.path.realpath(os.path.join(*parts[:last + 1])), *parts[last + 1:])
    path = _absolute(raw)
    # The rule reads the path with its links resolved (a link to / is /).
    real = Path(os.path.realpath(path))
    if Path(os.path.realpath(os.path.expanduser("~"))).is_relative_to(real):
        really = "" if real == path else f" (really {real})"
        raise ValueError(f"{name} names {path}{really}, the home directory or one above it; name a directory "
                         "of its own (for instance ~/.cache/dspark/kernels)")
    return path


def cache_home(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/dspark/<parts>`` for an absolute ``XDG_CACHE_HOME``
    (the XDG rule: a relative one is ignored), else
    ``~/.cache/dspark/<parts>``: where DSpark's caches live by default."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "dspark", *parts)


def _absolute(text: str) -> Path:
    """The absolute path ``text`` normalised: ``.``, ``..`` and doubled
    slashes removed, a leading ``//`` too (which POSIX's ``normpath`` keeps,
    and which names ``/``). Links are kept (the cache refuses a linked
    directory itself)."""
    return Path("/" + os.path.normpath(text).lstrip("/"))


__all__ = ["OFF", "ON", "cache_home", "cache_setting", "env_choice", "env_flag", "flag", "switch"]
