"""The on-disk cache of compiled kernels behind ``host.jit_cache`` (opt-in).

``DSPARK_KERNEL_CACHE`` turns it on (``dspark_core.switches.cache_setting``):
unset, empty, ``0``, ``false``, ``off`` or ``no`` leave it off; ``1``,
``true``, ``on`` or ``yes`` use the default directory,
``$XDG_CACHE_HOME/dspark/kernels`` where ``XDG_CACHE_HOME`` is an absolute
path (the XDG rule: a relative one is ignored), else
``~/.cache/dspark/kernels``; an absolute path or ``~/dir`` names the
directory. Any other value (``~`` alone, a relative path, another word) is a
ValueError at the first compile. A compile then looks for ``<dir>/<key>.o``
first and loads it (``cutlass.cute.runtime.load_module``) instead of tracing
and compiling; a miss compiles and writes the object (``dump_to_object``: the
host launcher and the cubin) for the next process, so TP ranks and restarts
compile each variant once.

The key is the SHA-256 of: the compile function (module and name), its
settings (constants by their stable ``key()``, dataclasses field by field,
flags; a setting with no stable form, such as an object that prints its
address, keeps that variant out of the disk cache), the sources of every
installed DSpark kernel package (any edit misses), the CuTe DSL and Python
versions, and the target (``CUTE_DSL_ARCH``, the current GPU's compute
capability).

An object file is code this process will run, so the cache trusts only
what this user alone controls:

- the directory and every file in it must be this user's, a real directory
  or regular file (a link is not followed), and not writable by group or
  others;
- every directory above it (its real path, up to ``/``) must belong to this
  user or root and not be writable by group or others, unless it has the
  sticky bit (``/tmp``: others may create entries there but not rename or
  remove this user's, so the private directory inside stays this user's);
- each object's SHA-256 is written beside it (``<key>.sha256``, after the
  object, both atomically) and checked against the object's bytes before it
  is loaded: a truncated, torn or bit-flipped file is refused and compiled
  over. (The digest is a check against damage, not against this user: who
  may write the directory may write both files.)

A refusal is logged once with its reason and the variant compiles in memory
(or over the refused file). Apart from a malformed ``DSPARK_KERNEL_CACHE``,
the cache never turns a compile into an error.
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

from dspark_core import switches

log = logging.getLogger("dspark.cute")
_PACKAGES = ("dspark_core", "dspark_cute", "dspark_comm")
_warned: set[str] = set()


class _Unstable(Exception):
    """A compile setting with no form that is the same in another process."""


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/dspark/kernels`` for an absolute ``XDG_CACHE_HOME``,
    else ``~/.cache/dspark/kernels`` (``switches.cache_home``)."""
    return switches.cache_home("kernels")


def directory() -> Path | None:
    """The cache directory named by ``DSPARK_KERNEL_CACHE`` (module
    docstring), or None where the cache is off; ValueError for a value that
    is neither a switch word nor an absolute directory."""
    return switches.cache_setting("DSPARK_KERNEL_CACHE", default_directory())


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


def _parents_unsafe(root: Path) -> str | None:
    """Why a directory above ``root`` (its real path) lets another user
    replace ``root`` (None: none does): owned by someone other than this
    user or root, or writable by group or others without the sticky bit."""
    for parent in (root.parent.resolve(), *root.parent.resolve().parents):
        st = parent.stat()
        if st.st_uid not in (0, os.geteuid()):
            return f"{parent}, above the cache, belongs to another user"
        if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"group or others may write {parent}, above the cache (and it is not sticky)"
    return None


def _root() -> Path | None:
    """The cache directory, created private, or None where the cache is off
    or the directory may not be trusted (logged once)."""
    root = directory()
    if root is None:
        return None
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _private(root, True) or _parents_unsafe(root)
    except OSError as error:
        why = f"cannot create {root}: {error}"
    if why:
        _warn_once(f"{why}; compiling in memory")
        return None
    return root


def _read_trusted(path: Path) -> bytes | None:
    """``path``'s bytes, or None where it is missing (a miss); a reason
    (``_Refused``) where it may not be trusted or read."""
    try:
        why = _private(path, False)
    except FileNotFoundError:
        return None
    except OSError as error:
        why = f"cannot read {path}: {error}"
    if why:
        raise _Refused(why)
    try:
        return path.read_bytes()
    except FileNotFoundError:  # removed since the check: a miss
        return None
    except OSError as error:
        raise _Refused(f"cannot read {path}: {error}") from None


class _Refused(Exception):
    """A cache file that may not be loaded, with the reason."""


def load(cache_key: str):
    """The compiled kernel stored under ``cache_key``, or None (a miss; an
    untrusted, unreadable, damaged or unloadable file: logged once)."""
    root = _root()
    if root is None:
        return None
    path = root / f"{cache_key}.o"
    try:
        data = _read_trusted(path)
        if data is None:
            return None
        digest = _read_trusted(root / f"{cache_key}.sha256")
        if digest is None or digest.decode("ascii", "replace").strip() != hashlib.sha256(data).hexdigest():
            raise _Refused(f"{path.name} does not match its SHA-256 (damaged or torn)")
    except _Refused as refused:
        _warn_once(f"{refused}; compiling it again")
        return None
    try:
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(path))
        return getattr(module, _prefix(cache_key))
    except Exception as error:  # a foreign or stale object: compile over it
        _warn_once(f"{path.name} did not load ({type(error).__name__}: {error}); compiling it again")
        return None


def _write(root: Path, name: str, data: bytes) -> None:
    """``root/name`` holds ``data`` (written to a private temporary file, then renamed over it)."""
    tmp = root / f".{name}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, root / name)
    finally:
        tmp.unlink(missing_ok=True)


def store(cache_key: str, compiled) -> None:
    """Write ``compiled`` under ``cache_key`` with its SHA-256, each
    atomically (failures logged). The digest is written after the object: a
    reader between the two sees a mismatch and compiles, never a loaded
    object that was not checked."""
    root = _root()
    if root is None:
        return
    try:
        data = compiled.dump_to_object(_prefix(cache_key))
        _write(root, f"{cache_key}.o", data)
        _write(root, f"{cache_key}.sha256", hashlib.sha256(data).hexdigest().encode() + b"\n")
    except Exception as error:
        _warn_once(f"could not write {cache_key}.o ({type(error).__name__}: {error})")


def _prefix(cache_key: str) -> str:
    return f"dspark_{cache_key[:24]}"


__all__ = ["default_directory", "directory", "key", "load", "store"]
