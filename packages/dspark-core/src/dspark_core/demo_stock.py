"""The demo's stock path: vLLM 0.33.0's draft step from its own binaries.

``scripts/stock/stock_step.py`` (``StockStep``) assembles vLLM's draft step
from the binaries ``scripts/stock/compile_stock.py`` builds (vLLM's Triton
kernels compiled by Triton 3.8.0, its CUDA kernels taken from its library;
cuBLAS through torch for the GEMMs); ``scripts/stock/launch_stock.py``
launches them from a folder (``manifest.json`` and the kernels). Both live in
the repository, not in this package: they are loaded by path, and only when
the demo asks for the stock path, so importing dspark-core never imports
``scripts/`` or a kernel backend.

The attention is the one thing vLLM's step would take from elsewhere (its
FlashAttention 3, not on the device machine): the stock step runs the
installed backend's paged decode attention (``policy.ATTENTION``, its default
direct variant), whose bits are the spec attention's, as the specialized
decode's attention kernel (any variant) is.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import torch

from dspark_core.contracts.constants import AttentionConstants
from dspark_core.contracts.kernels import kernel_class
from dspark_core.planner import policy
from dspark_core.tools.timing import capture

ROOT = Path(__file__).resolve().parents[4]  # the repository, where this file is in a checkout
SCRIPTS = ROOT / "scripts" / "stock"
STOCK_DIR_ENV = "DSPARK_STOCK_DIR"
BUILD = (".nox/tests-vllm/bin/python scripts/stock/compile_stock.py --out DIR (on any machine with vLLM 0.33.0's "
         "environment), then --stock DIR or DSPARK_STOCK_DIR=DIR")


def in_checkout() -> bool:
    """Whether this module runs from a repository checkout (the stock
    step's scripts beside it)."""
    return (SCRIPTS / "stock_step.py").is_file() and (SCRIPTS / "launch_stock.py").is_file()


def default_stock_dir() -> Path | None:
    """``DSPARK_STOCK_DIR`` where set (and not blank), else ``.device/stock``
    of the repository when the demo runs from a checkout, else None."""
    env = os.environ.get(STOCK_DIR_ENV, "").strip()
    if env:
        return Path(env)
    return ROOT / ".device" / "stock" if in_checkout() else None


def missing_reason(stock_dir: Path | None) -> str | None:
    """None where the stock step can be loaded from ``stock_dir``, else one
    line saying why not and how to build the binaries."""
    if not in_checkout():
        return (f"the stock step's scripts ({SCRIPTS / 'stock_step.py'}) are not here: run the demo from a "
                "checkout of the repository")
    if stock_dir is None:
        return f"no folder of stock binaries named; build them with {BUILD}"
    if not (Path(stock_dir) / "manifest.json").is_file():
        return f"the stock binaries are not staged in {stock_dir} (no manifest.json); build them with {BUILD}"
    return None


def load_script(name: str):
    """``scripts/stock/<name>.py`` as a module, imported once per process
    (registered in ``sys.modules`` under its own name, so its dataclasses
    resolve and every caller shares one copy). The one loader of those
    scripts: the demo, the benchmarks (``benchmarks/stock_scripts.py``) and
    the GPU tests (``tests/stock.py``) call it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class _Rooted:
    """``launch_stock``'s ``stock_*`` functions with ``root=`` bound to one
    folder of binaries (the module's own default is read once, at import)."""

    def __init__(self, module, root: Path) -> None:
        self._module, self._root = module, Path(root)

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        return functools.partial(fn, root=self._root) if name.startswith("stock_") else fn


def paged_attention(config):
    """``(attention(q, cache, attn_slots), name)`` of the installed backend's
    paged decode attention for ``config``, compiled now (before any
    capture). LookupError where no backend provides it."""
    kernel = kernel_class(policy.ATTENTION)(AttentionConstants(config.num_heads, config.num_kv_heads,
                                                               config.head_dim, config.kv_block_size))
    kernel.prepare()
    return (lambda q, cache, slots: kernel.launch(q, cache, slots)), f"{type(kernel).__name__} (direct variant)"


def stock_step(model, stock_dir: Path | None = None, kernels=None, attention=None, pdl: bool = True):
    """``(StockStep, attention name)``: vLLM's step over ``model`` (its
    backbone: no head, no fc) on the binaries in ``stock_dir`` through
    ``launch_stock`` or on ``kernels`` (a stand-in with its functions, e.g.
    ``stock_step.SpecKernels`` for a CPU dry run), with ``attention``
    (``(fn, name)``; default ``paged_attention``). ``pdl``: the stock norms
    and QK kernel launched with programmatic dependent launch as vLLM does
    on sm_90+; where a captured launch with it fails, they run without
    (said once)."""
    module = load_script("stock_step")
    if kernels is None:
        kernels = _Rooted(load_script("launch_stock"), stock_dir)
    fn, name = attention if attention is not None else paged_attention(model.config)
    stock = module.StockStep(model, None, None, kernels, fn, pdl=False)
    # One eager launch first: binaries that do not load on this device fail here, not inside a capture.
    probe = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16, device=model.embed.device)
    stock.norm(probe, model.norm)
    if pdl:
        stock.pdl = True
        try:
            capture(lambda: stock.norm(probe, model.norm))()
            torch.cuda.synchronize()
        except RuntimeError as error:
            print(f"the stock kernels run without PDL (a captured launch with it failed: {error})")
            stock.pdl = False
    return stock, name


__all__ = ["default_stock_dir", "in_checkout", "load_script", "missing_reason", "paged_attention", "stock_step"]
