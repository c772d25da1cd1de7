"""``python -m dspark_vllm.plan DRAFT_DIR``: which parts of a vLLM Muse Spark
DSpark draft run fused under ``decode_backend=latency_specialized``, why any
part stays stock, and what the deployment check says.

    python -m dspark_vllm.plan DRAFT_DIR [--target DIR | --target-layers N]
        [--tp N] [--arch sm_90a|sm_100a] [--num-sms N]
        [--kernels installed|all|a,b] [--exact checked|all|a,b]
        [--kv-cache-dtype auto|fp8|...] [--kv-cache-layout LBHNC|LBNHC|...]
        [--max-num-seqs N]

It reads the draft's ``config.json`` (no weights): vLLM's own
``MuseSparkDSparkForCausalLM`` is built on the meta device at TP1 (a gloo
group of one; vLLM's CPU platform, so no GPU is touched), its layers' fused
QK-norm/RoPE/insert flag and its RoPE's dispatch set as vLLM sets them on
a GPU with its FlashAttention backend, then described (``adapter.describe_vllm``) and planned
(``planning.plan_vllm``) for ``--arch`` at ``--tp`` (a whole draft split as
the ranks would hold it). The target decides the draft layers' indices (the
post-norms' gain centres): ``--target`` names a checkpoint folder (its
config.json), else a stand-in target of ``--target-layers`` layers is used.
``--exact`` (default ``checked``: ``planning.exact_kernels(arch)``) says which
kernels count as checked against vLLM; ``all`` shows what would fuse once
they are. The deployment check is that of an ``--arch`` GPU running the
config with eager layers and FULL decode graphs. A user error prints one
line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from dspark_core import checks
from dspark_core.contracts.constants import MAX_SIZE
from dspark_core.planner import policy
from dspark_core.planner.cli import StrictParser, arch_name, int_in, kernel_names, write_out
from dspark_core.reference.config import MAX_LAYERS, read_json_object
from dspark_core.switches import flag

# Backend and fused-insert facts of the GPU the plan is made for.
GPU_ATTENTION_BACKEND = "FLASH_ATTN"


def parser() -> argparse.ArgumentParser:
    p = StrictParser(prog="python -m dspark_vllm.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("draft", help="the draft checkpoint folder (its config.json)")
    p.add_argument("--target", help="the target checkpoint folder (its config.json; no weights needed)")
    p.add_argument("--target-layers", type=int_in(1, MAX_LAYERS), default=None,
                   help="the stand-in target's layer count (default: one past the draft's last target_layer_ids)")
    p.add_argument("--tp", type=int_in(1, policy.MAX_TP), default=1, help="the tensor-parallel size (default 1)")
    p.add_argument("--arch", default="sm_90a", type=arch_name,
                   help=f"the GPU architecture: {' or '.join(policy.ARCHS)} (default sm_90a)")
    p.add_argument("--num-sms", type=int_in(1, policy.MAX_SMS), default=132,
                   help="the GPU's SM count (default 132, an H200)")
    p.add_argument("--kernels", default="installed", help="'installed' (default), 'all' or kernel names, a,b")
    p.add_argument("--exact", default="checked",
                   help="kernels taken as checked against vLLM: 'checked' (on a GPU of --arch, default), 'all' or a,b")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (default auto)")
    p.add_argument("--max-num-seqs", type=int_in(1, MAX_SIZE), default=None,
                   help="vLLM's --max-num-seqs, the requests a Markov step takes (default: vLLM's default)")
    p.add_argument("--kv-cache-layout", default=None,
                   help="a KV cache layout of vLLM's to check by name (default: none; the DSpark inserts take "
                        "every vLLM layout through the cache's strides, and the plugin reads the bound cache's)")
    return p


def _names(text: str, default, flag: str) -> frozenset[str]:
    if text == "all":
        return policy.ALL_KERNELS
    if text in ("installed", "checked"):
        return default()
    return kernel_names(text, flag)


# The draft config's sizes: required (vLLM cannot build the draft without
# them) and optional, each a positive integer of at most MAX_SIZE.
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "draft_vocab_size", "max_position_embeddings",
                  "target_hidden_size")


def _size(config: dict, key: str, where: str, high: int = MAX_SIZE) -> int | None:
    """``config[key]`` (None where absent): an int from 1 to ``high``, else
    ValueError naming ``where`` and the key."""
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{where}: {key} must be an integer from 1 to {high}, not {value!r}")
    return value


def check_draft_config(config: dict, where: str, target_layers: int | None) -> None:
    """ValueError, naming ``where`` (the config file) and the key, for a
    draft config vLLM would build into nonsense or fail on with a traceback:
    a missing or non-positive size (``REQUIRED_SIZES``, ``OPTIONAL_SIZES``),
    KV heads that do not divide the heads, a RoPE base or eps that is not a
    number finite in FP32 (the base also positive, eps non-negative), and
    ``target_layer_ids`` that are not a list of integers from 0 to below the
    target's layer count ``target_layers`` (where known)."""
    for key in REQUIRED_SIZES:
        if key not in config:
            raise ValueError(f"{where}: the draft config has no {key}")
    sizes = {key: _size(config, key, where) for key in (*REQUIRED_SIZES, *OPTIONAL_SIZES)}
    if sizes["num_hidden_layers"] > MAX_LAYERS:
        raise ValueError(f"{where}: num_hidden_layers must be at most {MAX_LAYERS}, not {sizes['num_hidden_layers']}")
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    for key, low in (("rope_theta", "positive"), ("rms_norm_eps", "non-negative"),
                     ("rms_post_norm_eps", "non-negative"), ("ffn_dim_multiplier", "positive")):
        if key in config:
            checks.fp32_number(f"{where}: {key}", config[key], low=low)
    if config.get("output_soft_cap_temp") is not None:
        checks.fp32_number(f"{where}: output_soft_cap_temp (null or a number)", config["output_soft_cap_temp"],
                           low="positive", reciprocal=True)
    _check_metap(config.get("metap"), where)
    ids = config.get("target_layer_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"{where}: target_layer_ids must be a non-empty list of integer layer ids, not {ids!r}")
        bad = [i for i in ids if i < 0 or (target_layers is not None and i >= target_layers)]
        if bad:
            span = f"0 to {target_layers - 1}" if target_layers is not None else "0 or more"
            raise ValueError(f"{where}: target_layer_ids {bad} are not layers of the target ({span})")


def _check_metap(metap, where: str) -> None:
    """ValueError or TypeError, naming ``where``, for a ``metap`` section
    vLLM's draft cannot build from: not an object, ``use_metap`` not a
    bool, or, where it is on, a ``metap_mode`` other than mup or sp (vLLM
    asserts) or a ``base_width`` that is not a positive number finite in
    FP32 (vLLM divides the hidden size by it)."""
    if metap is None:
        return
    if not isinstance(metap, dict):
        raise TypeError(f"{where}: metap must be an object, not {checks.shown(metap)}")
    if not flag(metap.get("use_metap", False), f"{where}: metap.use_metap"):
        return
    if metap.get("metap_mode", "mup") not in ("mup", "sp"):
        raise ValueError(f"{where}: metap.metap_mode must be 'mup' or 'sp', not {checks.shown(metap['metap_mode'])}")
    checks.fp32_number(f"{where}: metap.base_width", metap.get("base_width", 256), low="positive")


def _checkpoint(path: str, what: str) -> tuple[Path, dict]:
    """``(folder, config)`` of a checkpoint folder on disk: ValueError naming
    the path where it is empty (not the working directory) or no folder with
    a config.json (never a hub name: the plan reads local folders only), or
    where its config.json is no JSON file (``read_json_object``)."""
    folder = Path(path)
    if not path or not folder.is_dir():
        raise ValueError(f"the {what} {path!r} is not a folder on this machine (the plan reads a local "
                         "checkpoint's config.json; it never downloads one)")
    if not (folder / "config.json").exists():
        raise ValueError(f"the {what} folder {path!r} has no config.json")
    return folder, read_json_object(folder / "config.json", f"the {what}'s config")


def _stand_in_target(draft_config: dict, layers: int | None, root: Path) -> Path:
    ids = draft_config.get("target_layer_ids") or [0]
    hidden = draft_config.get("target_hidden_size") or draft_config["hidden_size"]
    heads = draft_config.get("num_attention_heads", 8)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
              "vocab_size": draft_config.get("vocab_size", 202048), "hidden_size": hidden,
              "intermediate_size": 4 * hidden, "num_hidden_layers": layers or max(ids) + 1,
              "num_attention_heads": heads, "num_key_value_heads": draft_config.get("num_key_value_heads", heads),
              "head_dim": draft_config.get("head_dim", hidden // heads),
              "max_position_embeddings": draft_config.get("max_position_embeddings", 4096)}
    (root / "config.json").write_text(json.dumps(config))
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(draft: Path, target: Path, kv_cache_dtype: str):
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model = ModelConfig(model=str(target), tokenizer=str(target), skip_tokenizer_init=True, dtype="bfloat16",
                        enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="dspark", model=str(draft), target_model_config=model,
                             target_parallel_config=parallel)
    CacheConfig(cache_dtype=kv_cache_dtype)  # vLLM's own check of the name
    # The cache dtype is applied after the build (_as_gpu_cache_dtype): the CPU platform's attention backend
    # would judge an fp8 cache by this host's ISA.
    return VllmConfig(model_config=model, speculative_config=spec, parallel_config=parallel,
                      device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(cache_dtype="auto"),
                      compilation_config=CompilationConfig(mode=0),
                      additional_config={"decode_backend": "latency_specialized"})


def _fused_insert_as_on_gpu(attn) -> bool:
    """``MuseSpark1xAttention.fused_qk_norm_rope_kv_insert`` as vLLM sets it
    with FlashAttention (no KV write in forward, the insert bypass supported)."""
    import torch
    from vllm.models.muse_spark.common.ops.fused_qk_norm_rope_kv import SUPPORTED_KV_CACHE_DTYPES

    return bool(attn.use_qk_norm and attn.qk_norm is not None and not attn.qk_norm.has_weight
                and not attn.use_attn_temperature_tuning and attn.head_dim in (64, 128, 256)
                and attn.default_dtype in (torch.bfloat16, torch.float16)
                and attn.attn.kv_sharing_target_layer_name is None
                and attn.attn.kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES)


def _vllm_build(draft: Path, target: Path, kv_cache_dtype: str):
    """``(config, model)``: vLLM's config and its meta draft (``_config``,
    ``build_meta_draft``). What vLLM raises on a checkpoint it cannot build
    (an incomplete MoE config's AttributeError, a validation error over
    several lines) becomes one ValueError line naming the folder."""
    try:
        config = _config(draft, target, kv_cache_dtype)
        return config, build_meta_draft(config)
    except Exception as error:  # vLLM's own refusal, whatever its type: one line, never a traceback
        text = " ".join(str(error).split())
        text = text if len(text) <= 400 else f"{text[:400]}..."
        raise ValueError(f"vLLM 0.33.0 cannot build the draft {str(draft)!r}: {type(error).__name__}: {text}") \
            from None


def build_meta_draft(config):
    """vLLM's MuseSparkDSparkForCausalLM of ``config`` on the meta device, post-load state built."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.models.muse_spark.common.dspark import MuseSparkDSparkForCausalLM
    from vllm.models.muse_spark.common.layers import materialize_residual_path_constants
    from vllm.utils.torch_utils import set_default_torch_dtype

    from dspark_vllm.runtime import pin_rope_tables

    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel(1, 1)
        with set_default_torch_dtype(torch.bfloat16), torch.device("meta"):
            model = MuseSparkDSparkForCausalLM(vllm_config=config)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                # The CustomOp dispatch of a CUDA platform (forward_native where the op is disabled).
                module._forward_method = module.forward_cuda if type(module).enabled() else module.forward_native
    backbone = model.model
    backbone._build_fused_kv_buffers()
    materialize_residual_path_constants(backbone)
    for layer in backbone.layers:
        layer.self_attn.fused_qk_norm_rope_kv_insert = _fused_insert_as_on_gpu(layer.self_attn)
    pin_rope_tables(backbone)
    return model


def _as_gpu_cache_dtype(model, config, kv_cache_dtype: str) -> None:
    """Give the built draft the KV cache dtype a GPU deployment has. The draft
    is built on vLLM's CPU platform with an ``auto`` cache (``_config``):
    that platform's attention backend refuses an fp8 cache on an x86 CPU
    without AVX-512 or AMX (``cpu_attn._get_attn_isa``), which says nothing
    about an H200. Each attention layer then takes ``kv_cache_dtype`` as its
    ``Attention.__init__`` keeps it, and the cache config too, so the plan
    and the deployment check read the asked dtype on any host."""
    config.cache_config.cache_dtype = kv_cache_dtype
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.attn.kv_cache_dtype = kv_cache_dtype
        attn.fused_qk_norm_rope_kv_insert = _fused_insert_as_on_gpu(attn)


def plan_checkpoint(args):
    """``(plan, missing, markov)`` of the parsed arguments: the DraftPlan, the deployment check's list and
    the Markov stage's line (``markov_plan.plan_line``; ``--exact all`` counts its kernel as checked too)."""
    from vllm.config import CUDAGraphMode

    from dspark_vllm import deployment, markov_plan, planning
    from dspark_vllm.adapter import describe_vllm

    draft_dir, draft_config = _checkpoint(args.draft, "draft")
    target_layers = args.target_layers
    if args.target:
        target_dir, target_config = _checkpoint(args.target, "target")
        if target_dir.resolve() == draft_dir.resolve():
            raise ValueError(f"--target names the draft's own folder {args.target!r}: give the target model's")
        # A target of more layers than any model (or any draft config) has: refused, not planned.
        target_layers = _size(target_config, "num_hidden_layers", str(target_dir / "config.json"), MAX_LAYERS)
    check_draft_config(draft_config, str(draft_dir / "config.json"), target_layers)
    try:
        deployment.layout_unsupported(args.kv_cache_layout)
    except ValueError as error:
        raise ValueError(f"--kv-cache-layout: {error}") from None
    kernels = _names(args.kernels, policy.installed_kernels, "--kernels")
    exact = _names(args.exact, lambda: planning.exact_kernels(args.arch), "--exact")
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(args.target) if args.target else _stand_in_target(draft_config, args.target_layers, Path(tmp))
        config, model = _vllm_build(draft_dir, target, args.kv_cache_dtype)
        _as_gpu_cache_dtype(model, config, args.kv_cache_dtype)
    draft = describe_vllm(model.model, config.cache_config.block_size or 16, GPU_ATTENTION_BACKEND,
                          args.kv_cache_layout)
    target_ = policy.Target("cuda", args.arch, args.num_sms, args.tp, kernels).opt_in(frozenset())
    plan = planning.plan_vllm(draft, target_, deployment.stock_all_reduce(args.tp, args.arch), exact)
    # The deployment check as the GPU sees the config: eager layers, FULL decode graphs, TP as asked.
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    config.parallel_config.tensor_parallel_size = args.tp
    config.speculative_config.draft_tensor_parallel_size = args.tp
    major = {"sm_90a": 9, "sm_100a": 10}[args.arch]
    markov_line = markov_plan.plan_line(model, args.arch, frozenset(policy.ARCHS) if args.exact == "all" else None,
                                   args.max_num_seqs or config.scheduler_config.max_num_seqs)
    return plan, deployment.unsupported(config, (major, 0)), markov_line


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # Checkpoints are local folders: no hub lookups (these machines may be offline, and a hub
    # client retries for minutes before it fails).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = parser().parse_args(argv)
    try:
        plan, missing, markov_line = plan_checkpoint(args)
    except (ValueError, TypeError, OSError, KeyError) as error:
        print(f"python -m dspark_vllm.plan: error: {error}", file=sys.stderr)
        return 2
    lines = [plan.format(), markov_line]
    if missing:
        lines.append(f"decode_backend=latency_specialized on this deployment ({args.arch}, TP{args.tp}) needs:")
        lines += [f"  - {need}" for need in missing]
    else:
        lines.append(f"the deployment check passes ({args.arch}, TP{args.tp}, eager layers, FULL decode graphs)")
    return write_out("\n".join(lines), "python -m dspark_vllm.plan")


if __name__ == "__main__":
    sys.exit(main())
