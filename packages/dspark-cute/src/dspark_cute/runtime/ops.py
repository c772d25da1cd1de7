"""The kernels as ``torch.library`` custom ops: ``torch.ops.dspark.<kernel>``.

Each kernel module defines its op once (``define(name, schema)``): the
schema's first argument is the host's handle (a string), the rest are the
launch's tensors and values, the tensors it writes marked ``(a!)`` (outputs,
KV caches, tensors updated in place). Every op returns nothing: a launch
writes into tensors its host allocated before the call, so the op's fake
writes nothing either and fake-tensor propagation, functionalization and
torch.compile's graphs run without a GPU.

A host class takes a handle at construction (``register(host)``): the
class name and a random suffix, unique in the process and never reused, so
a graph traced elsewhere finds no host (RuntimeError) rather than another
host's weights. Its ``launch`` calls ``launch(host, *args)``: while
torch.compile or torch.export traces (``tracing()``) that records
``torch.ops.dspark.<host.OP>(handle, *args)``, one opaque node; otherwise it
calls ``host._launch_kernel(*args)`` directly (no dispatcher on the eager
path). The op's CUDA implementation is the same ``_launch_kernel`` of the
host found by its handle.

An op that writes nothing torch can see (the weight prefetch: it only warms
L2) has no user in a traced graph, so a compiler may drop it; that changes
no result.
"""

from __future__ import annotations

import uuid
import weakref

import torch

NAMESPACE = "dspark"
_library = torch.library.Library(NAMESPACE, "FRAGMENT")
_hosts: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_schemas: dict[str, str] = {}


def tracing() -> bool:
    """Whether torch.compile (Dynamo) or torch.export is tracing this call."""
    return torch.compiler.is_compiling()


def register(host) -> str:
    """A new handle naming ``host`` (kept weakly: the op of a collected host
    raises instead of launching)."""
    handle = f"{type(host).__name__}:{uuid.uuid4().hex}"
    _hosts[handle] = host
    return handle


def host_of(handle: str):
    """The live host of ``handle``; RuntimeError where there is none (a
    handle from another process, or a host that was collected)."""
    host = _hosts.get(handle)
    if host is None:
        raise RuntimeError(
            f"no live DSpark kernel host has the handle {handle!r}: a graph traced in another process, "
            "or a host that no longer exists (rebuild the host and trace again)"
        )
    return host


def _implementation(handle: str, *args) -> None:
    host_of(handle)._launch_kernel(*args)


def _fake(handle: str, *args) -> None:
    return None


def define(name: str, schema: str) -> str:
    """Define ``dspark::<name>`` with ``schema`` (its arguments, e.g.
    ``"(str handle, Tensor x, Tensor(a!) out) -> ()"``): the CUDA
    implementation launches the host's kernel, the fake writes nothing.
    Defining a name again with the same schema is a no-op (a module
    reloaded); with another schema, a ValueError."""
    if not schema.startswith("(str handle") or not schema.endswith("-> ()"):
        raise ValueError(f"a DSpark op's schema takes the host handle first and returns (), not {schema!r}")
    known = _schemas.get(name)
    if known is not None:
        if known != schema:
            raise ValueError(f"dspark::{name} is defined as {known}, not {schema}")
        return name
    _library.define(name + schema)
    _library.impl(name, _implementation, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}", _fake, lib=_library)
    _schemas[name] = schema
    return name


def op(name: str):
    """The op packet ``torch.ops.dspark.<name>``."""
    return getattr(getattr(torch.ops, NAMESPACE), name)


def launch(host, *args) -> None:
    """Launch ``host``'s kernel on ``args``: through ``torch.ops.dspark.
    <host.OP>`` while tracing, else ``host._launch_kernel(*args)``."""
    if tracing():
        op(host.OP)(host.op_handle, *args)
    else:
        host._launch_kernel(*args)


def defined() -> dict[str, str]:
    """Every op defined so far: name -> schema."""
    return dict(_schemas)


__all__ = ["NAMESPACE", "define", "defined", "host_of", "launch", "op", "register", "tracing"]
