"""The deployment check of ``decode_backend=latency_specialized`` and the
facts it reads: which decode backend a config asks for, what this deployment
misses (which all-reduce vLLM's row-parallel layers run at TP > 1 is
``dspark_vllm.allreduce``'s, re-exported here).

``decode_backend(vllm_config)`` reads ``additional_config["decode_backend"]``:
``"auto"`` (the default) or ``"latency_specialized"``; anything else is a
ValueError naming both. ``unsupported(vllm_config)`` lists every requirement
of the specialized decode that the deployment misses, in words.
``check_deployment(vllm_config)`` raises one ValueError with all of them;
at TP > 1 the verdict is a MIN over the TP group's CPU group first, so every
rank raises if one rank misses a requirement (the GPU and the installed
versions are per-process facts) and no rank runs fused while another runs
stock.
"""

from __future__ import annotations

import importlib.metadata

import torch

from dspark_core import checks
from dspark_vllm import options
from dspark_vllm.allreduce import AllReduceOrder, stock_all_reduce  # noqa: F401 (moved there; re-exported)

# The versions the adapter was written against (read from their source).
VLLM_VERSION = "0.33.0"
FLASHINFER_VERSION = "0.7.2.post1"
CUTLASS_DSL_VERSION = "4.8.0"
PINNED_VERSIONS = {"vllm": VLLM_VERSION, "flashinfer-python": FLASHINFER_VERSION,
                   "nvidia-cutlass-dsl": CUTLASS_DSL_VERSION}

AUTO = "auto"
LATENCY_SPECIALIZED = "latency_specialized"
DECODE_BACKENDS = (AUTO, LATENCY_SPECIALIZED)

# TP sizes the executor takes: one GPU, or the mailbox's TP sizes (whose
# fused all-reduce may still stay stock, see stock_all_reduce).
SUPPORTED_TPS = (1, 2, 4, 8)
# The compute capabilities (major) the kernels are compiled for.
SUPPORTED_MAJORS = {9: "sm_90a", 10: "sm_100a"}
# vLLM 0.33.0's KV cache layouts (vllm/v1/kv_cache_layout.py, KVCacheLayout):
# the physical order of [L, B, H, N, C] (layers, blocks, KV heads, tokens of
# a block, K|V). Every one keeps C innermost, so each layer's logical [B, H,
# N, C] view has contiguous K|V rows and the DSpark inserts address any of
# them through its block, token and head strides.
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# The legacy names vLLM takes for two of them (VLLM_KV_CACHE_LAYOUT).
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
# The store width of the strictest insert (the QKV epilogue's 16-byte rows;
# the context store writes 4 bytes): the alignment the bound cache needs.
INSERT_ALIGN = 16


def layout_unsupported(name: str | None) -> str | None:
    """Why the DSpark KV inserts (the QKV epilogue, the context chain) do not
    take a KV cache layout given by name (legacy names resolved), or None:
    every layout of vLLM 0.33.0 is taken (their K|V rows are contiguous; the
    inserts take the strides). None for ``None`` (not known yet: the plugin
    reads the bound cache, ``bound_layout_unsupported``). TypeError for a
    name that is no string, ValueError for a name none of vLLM's (no layout
    vLLM binds: a misspelling, refused where it enters)."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"a KV cache layout name must be a string or None, not {checks.shown(name)}")
    layout = LAYOUT_ALIASES.get(name, name)
    if layout in VLLM_LAYOUTS:
        return None
    quoted = repr(name) if len(name) <= checks.SHOWN else checks.shown(name)
    raise ValueError(f"the KV cache layout {quoted} is none of vLLM 0.33.0's ({', '.join(VLLM_LAYOUTS)}, or the "
                     f"legacy {', '.join(LAYOUT_ALIASES)})")


def kv_cache_layout(caches) -> str:
    """The layout name of the bound per-layer caches ``caches`` (logical
    ``[B, H, N, C]`` views of one or more allocations), read from their
    strides and addresses, never from the environment: the axes by
    decreasing stride, L placed by the distance between the first two
    layers' caches (outermost with one layer, or where two layers' caches do
    not interleave). One of ``VLLM_LAYOUTS`` for vLLM's views; another order
    is named the same way."""
    first = caches[0]
    size = first.element_size()
    strides = {"B": first.stride(0), "H": first.stride(1), "N": first.stride(2)}
    extent = sum((n - 1) * st for n, st in zip(first.shape, first.stride())) + 1
    layer = None
    if len(caches) > 1:
        gap = abs(caches[1].data_ptr() - first.data_ptr()) // size
        layer = gap if gap < extent else None
    order = sorted(strides, key=lambda axis: -strides[axis])
    if layer is None:
        return "L" + "".join(order) + "C"
    # Between the first axis whose stride is below the layer distance and the rest.
    inner = [axis for axis in order if strides[axis] < layer]
    return "".join([axis for axis in order if axis not in inner] + ["L"] + inner) + "C"


def bound_layout_unsupported(caches, kv_heads: int) -> str | None:
    """Why the DSpark inserts do not take the bound caches ``caches`` (the
    draft's layers' ``attn.kv_cache``), naming the layout found
    (``kv_cache_layout``), or None: each cache as the kernels address it
    (``dspark_cute.runtime.kv_cache.cache_problem``), all of one shape and
    strides."""
    from dspark_cute.runtime.kv_cache import cache_problem

    layout = kv_cache_layout(caches)
    first = caches[0]
    for cache in caches:
        why = cache_problem(cache, kv_heads, INSERT_ALIGN)
        if why is None and (cache.shape != first.shape or cache.stride() != first.stride()):
            why = "the layers' caches differ in shape or strides"
        if why is not None:
            return f"the bound KV cache (layout {layout}) is not one the DSpark inserts address: {why}"
    return None


def decode_backend(vllm_config) -> str:
    """The decode backend the config asks for (``DECODE_BACKENDS``):
    ``additional_config["decode_backend"]``, ``"auto"`` when absent.
    ValueError for any other value (naming the backend meant where only the
    case differs). A key that misses ``decode_backend`` by case, a dash,
    blanks or a letter or two (``Decode-Backend``, ``"decode_backend "``),
    and an ``additional_config`` that is no mapping, are no switch: the
    plugin stays off, and says so once in vLLM's log (``options.read``)."""
    backend = options.read(vllm_config, options.DECODE_BACKEND, AUTO)
    if backend not in DECODE_BACKENDS:
        meant = [b for b in DECODE_BACKENDS if isinstance(backend, str) and backend.strip().lower() == b]
        hint = f" (did you mean {meant[0]!r}? the value is case-sensitive)" if meant else ""
        raise ValueError(f"decode_backend must be one of {', '.join(DECODE_BACKENDS)} (the DSpark vLLM plugin), "
                         f"not {backend!r}{hint}")
    return backend


def installed_versions() -> dict[str, str | None]:
    """The installed version of each pinned distribution (None: not installed)."""
    found = {}
    for name in PINNED_VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_capability() -> tuple[int, int] | None:
    """This process's CUDA compute capability as vLLM's platform reports it,
    or None off CUDA."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def arch_of(capability: tuple[int, int] | None) -> str | None:
    """The kernels' architecture name for a compute capability (None: not one they are compiled for)."""
    return None if capability is None else SUPPORTED_MAJORS.get(capability[0])


def _draft_architectures(spec) -> list[str]:
    config = getattr(spec, "draft_model_config", None)
    return list(getattr(config, "architectures", None) or [])


def unsupported(vllm_config, capability: tuple[int, int] | None | str = "probe") -> list[str]:
    """Every requirement of the specialized decode this deployment misses,
    each a phrase that completes "decode_backend=latency_specialized needs
    ...". ``capability``: the GPU's compute capability (default: this
    process's, ``gpu_capability``)."""
    import vllm.envs as envs

    if capability == "probe":
        capability = gpu_capability()
    parallel = vllm_config.parallel_config
    spec = vllm_config.speculative_config
    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    versions = installed_versions()
    # vLLM builds the draft's layers over the process's TP group, which the
    # target's parallel config sized (the draft's own config only copies it).
    target_parallel = getattr(spec, "target_parallel_config", None) or parallel
    tp = target_parallel.tensor_parallel_size
    requirements = {
        "an sm_90 or sm_100 GPU (CUDA compute capability 9.x or 10.x: the kernels are compiled for sm_90a "
        "and sm_100a)": arch_of(capability) is not None,
        "Model Runner V2": bool(getattr(vllm_config, "use_v2_model_runner", False)),
        "DSpark speculative decoding with the Muse Spark draft (speculative method dspark, MuseSparkDSparkModel)": (
            spec is not None and spec.method == "dspark" and "MuseSparkDSparkModel" in _draft_architectures(spec)
        ),
        # Only what the draft runs: it is dense, so the target's expert
        # parallelism, EPLB and data parallelism leave it as it is (each DP
        # rank runs its own draft on its own TP group).
        f"the draft at the target's tensor-parallel size, one of {', '.join(map(str, SUPPORTED_TPS))} "
        "(draft_tensor_parallel_size unset or equal to it), without pipeline or context parallelism or "
        "micro-batching": (
            tp in SUPPORTED_TPS
            and spec is not None
            and spec.draft_tensor_parallel_size in (None, tp)
            and target_parallel.pipeline_parallel_size == 1
            and parallel.decode_context_parallel_size == 1
            and parallel.prefill_context_parallel_size == 1
            and not target_parallel.use_ubatching
        ),
        "a bfloat16 model and a bfloat16 KV cache for the draft (--kv-cache-dtype auto, no speculative "
        "kv_cache_dtype)": (
            model_config.dtype == torch.bfloat16
            and cache.cache_dtype in ("auto", "bfloat16")
            and (spec is None or spec.kv_cache_dtype in (None, "auto", "bfloat16"))
        ),
        "the draft's default attention backend (no speculative attention_backend)": (
            spec is not None and spec.attention_backend is None
        ),
        # The bound kernels keep the weights' addresses.
        "no sleep mode (the kernels bind the weights' addresses)": not model_config.enable_sleep_mode,
        "no LoRA, KV transfer, watermarking or batch invariance": (
            vllm_config.lora_config is None
            and vllm_config.kv_transfer_config is None
            and getattr(vllm_config, "watermark_config", None) is None
            and not envs.VLLM_BATCH_INVARIANT
        ),
    }
    for name, pinned in PINNED_VERSIONS.items():
        requirements[f"{name}=={pinned} (found {versions[name] or 'none'})"] = versions[name] == pinned
    return [need for need, ok in requirements.items() if not ok]


def tp_group_size() -> int:
    """The TP group's size where vLLM's model parallel state is initialized, else 1."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    return get_tensor_model_parallel_world_size() if model_parallel_is_initialized() else 1


def collective_min(values: list[int]) -> list[int]:
    """The element-wise MIN of ``values`` over the TP group's CPU group
    (``values`` as they are at TP1 or without a TP group)."""
    if tp_group_size() <= 1:
        return list(values)
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    # On the CPU explicitly: vLLM loads models under a CUDA default device,
    # and the gloo CPU group takes CPU tensors only.
    t = torch.tensor(values, dtype=torch.int64, device="cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return t.tolist()


def check_deployment(vllm_config) -> None:
    """Raise ValueError listing every missing requirement (``unsupported``)
    where this rank or any other TP rank misses one; collective at TP > 1."""
    missing = unsupported(vllm_config)
    (supported,) = collective_min([0 if missing else 1])
    if not supported:
        reason = "; ".join(missing) or "every other tensor-parallel rank to support it, which one does not"
        raise ValueError(f"decode_backend=latency_specialized needs {reason}.")


__all__ = ["AUTO", "AllReduceOrder", "DECODE_BACKENDS", "LATENCY_SPECIALIZED", "PINNED_VERSIONS", "SUPPORTED_TPS",
           "arch_of", "check_deployment", "collective_min", "decode_backend", "gpu_capability", "installed_versions",
           "stock_all_reduce", "tp_group_size", "unsupported"]
