"""The on-disk cache of compiled kernels behind ``host.jit_cache`` (opt-in).

``DSPARK_KERNEL_CACHE=1`` (or a directory) turns it on; the default
directory is ``$XDG_CACHE_HOME/dspark/kernels`` (``~/.cache/dspark/kernels``).
A compile then looks for ``<dir>/<key>.o`` first and loads it
(``cutlass.cute.runtime.load_module``) instead of tracing and compiling; a
miss compiles and writes the object (``dump_to_object``: the host launcher
and the cubin) for the next process, so TP ranks and restarts compile each
variant once.

The key is the SHA-256 of: the compile function (module and name), its
settings (constants by their stable ``key()``, dataclasses field by field,
flags; a setting with no stable form, such as an object that prints its
address, keeps that variant out of the disk cache), the sources of every
installed DSpark kernel package (any edit misses), the CuTe DSL and Python
versions, and the target (``CUTE_DSL_ARCH``, the current GPU's compute
capability).

An object file is code this process will run, so a directory or file that is
not this user's or that group or others may write is refused (logged once;
the variant compiles in memory). A file that fails to load is logged and
compiled over. The cache never turns a compile into an error.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import stat
import struct
import sys
from pathlib import Path

import torch

log = logging.getLogger("dspark.cute")
_PACKAGES = ("dspark_core", "dspark_cute", "dspark_comm")
_warned: set[str] = set()


class _Unstable(Exception):
    """A compile setting with no form that is the same in another process."""


def directory() -> Path | None:
    """The cache directory, or None where ``DSPARK_KERNEL_CACHE`` is unset,
    empty or "0"."""
    value = os.environ.get("DSPARK_KERNEL_CACHE", "").strip()
    if value in ("", "0"):
        return None
    if value != "1":
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspark" / "kernels"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("dspark kernel cache: %s", message)


def _stable(value):
    """``value`` in a form that prints the same in every process."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return ("f64", struct.unpack("<q", struct.pack("<d", value))[0])
    if isinstance(value, (tuple, list)):
        return tuple(_stable(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    key = getattr(value, "key", None)
    if callable(key):
        return (type(value).__qualname__, _stable(key()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                tuple((f.name, _stable(getattr(value, f.name))) for f in dataclasses.fields(value)))
    raise _Unstable(type(value).__qualname__)


@functools.lru_cache(maxsize=1)
def _fingerprint() -> str:
    """The hash of every DSpark kernel package's sources, the CuTe DSL's and
    Python's versions."""
    import importlib.metadata
    import importlib.util

    try:
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:  # a DSL on the path, not installed (a device machine)
        import cutlass

        dsl = getattr(cutlass, "__version__", "unknown")
    h = hashlib.sha256(f"py{sys.version_info[:2]} nvidia-cutlass-dsl {dsl}".encode())
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            h.update(f"{name}/{path.relative_to(root).as_posix()}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _target() -> tuple:
    capability = None
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    return os.environ.get("CUTE_DSL_ARCH", ""), capability


def key(fn, settings: tuple) -> str | None:
    """The cache key of ``fn``'s compile of ``settings``, or None where a
    setting has no stable form."""
    try:
        parts = (fn.__module__, fn.__qualname__, _stable(settings), _target())
    except _Unstable as unstable:
        _warn_once(f"{fn.__qualname__} takes a {unstable} setting with no stable form: compiled in memory only")
        return None
    return hashlib.sha256(repr((_fingerprint(), parts)).encode()).hexdigest()


def _private(path: Path, is_dir: bool) -> str | None:
    """Why ``path`` may not be trusted (None: it may)."""
    st = path.lstat()
    kind = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
    if not kind:
        return f"{path} is not a {'directory' if is_dir else 'regular file'} (a link is not followed)"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to another user"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"group or others may write {path}"
    return None


def _root() -> Path | None:
    """The cache directory, created private, or None where the cache is off
    or the directory may not be trusted (logged once)."""
    root = directory()
    if root is None:
        return None
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _private(root, True)
    except OSError as error:
        why = f"cannot create {root}: {error}"
    if why:
        _warn_once(f"{why}; compiling in memory")
        return None
    return root


def load(cache_key: str):
    """The compiled kernel stored under ``cache_key``, or None (a miss, an
    untrusted or unreadable file: logged)."""
    root = _root()
    if root is None:
        return None
    path = root / f"{cache_key}.o"
    try:
        why = _private(path, False)
    except FileNotFoundError:
        return None
    except OSError as error:
        why = f"cannot read {path}: {error}"
    if why:
        _warn_once(f"{why}; compiling in memory")
        return None
    try:
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(path))
        return getattr(module, _prefix(cache_key))
    except Exception as error:  # a torn, foreign or stale object: compile over it
        _warn_once(f"{path.name} did not load ({type(error).__name__}: {error}); compiling it again")
        return None


def store(cache_key: str, compiled) -> None:
    """Write ``compiled`` under ``cache_key`` (atomically; failures logged)."""
    root = _root()
    if root is None:
        return
    path = root / f"{cache_key}.o"
    tmp = root / f".{cache_key}.{os.getpid()}.tmp"
    try:
        data = compiled.dump_to_object(_prefix(cache_key))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except Exception as error:
        _warn_once(f"could not write {path.name} ({type(error).__name__}: {error})")
        tmp.unlink(missing_ok=True)


def _prefix(cache_key: str) -> str:
    return f"dspark_{cache_key[:24]}"


__all__ = ["directory", "key", "load", "store"]
