"""What the plugin asks of vLLM's compilation, graph and parallel settings,
against vLLM 0.33.0's real objects (``VllmConfig``, its loader,
``support_torch_compile``'s ``do_not_compile``, ``CustomOp`` dispatch):

- the deployment check accepts every compilation mode, ``enforce_eager`` and
  every CUDA graph mode (the draft's steps are FULL_DECODE_ONLY graphs or
  eager: ``DFlashSpeculator.init_cudagraph_manager``), the target's expert
  and data parallelism and EPLB (``dspark/utils.py`` copies them into the
  dense draft's config);
- under any mode the plugin's draft is built as vLLM builds it under mode
  NONE (``model.eager_draft_config``): its backbone uncompiled
  (``do_not_compile``) and its ``SiluAndMul`` / ``RotaryEmbedding`` on their
  platform kernels, while vLLM's own draft under VLLM_COMPILE is compiled and
  dispatches them to ``forward_native``; the config the target reads is
  untouched;
- ``process_weights_after_loading`` runs a base class's hook first;
  ``collective_min`` sends a CPU tensor whatever the default device.

The configs are made as a GPU deployment has them after vLLM's own
post-init (a CPU config forces mode NONE through ``enforce_eager``): mode,
custom ops and graph mode written in, as ``test_deployment`` writes the
graph mode."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
import torch  # noqa: E402

from dspark_vllm import deployment, runtime  # noqa: E402

H200 = (9, 0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from dspark_vllm.plugin import register

    register()
    return _draft.checkpoint_dir(tmp_path_factory, "compilation")


def _as_on_a_gpu(config, mode, graphs, eager: bool = False):
    """``config`` with the compilation settings vLLM's post-init gives a GPU
    deployment of ``mode`` (custom ops 'none' under Inductor) and ``graphs``."""
    from vllm.config import CompilationMode, CUDAGraphMode

    cc = config.compilation_config
    cc.mode = CompilationMode(mode)
    cc.custom_ops = ["none"] if cc.mode != CompilationMode.NONE and cc.backend == "inductor" else ["all"]
    cc.cudagraph_mode = CUDAGraphMode.NONE if eager else CUDAGraphMode[graphs]
    config.model_config.enforce_eager = eager
    return config


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("graphs", ["NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_any_compilation_and_graph_mode_is_accepted(dirs, mode, graphs):
    config = _as_on_a_gpu(_draft.vllm_config(*dirs[:2], "latency_specialized"), mode, graphs)
    assert deployment.unsupported(config, H200) == []


def test_enforce_eager_and_the_targets_expert_and_data_parallelism_are_accepted(dirs):
    config = _as_on_a_gpu(_draft.vllm_config(*dirs[:2], "latency_specialized"), 3, "NONE", eager=True)
    parallel = config.parallel_config
    parallel.enable_expert_parallel = True
    parallel.data_parallel_size = 2
    parallel.enable_eplb = True
    assert deployment.unsupported(config, H200) == []
    parallel.tensor_parallel_size = 4  # the draft shards over the target's TP group
    config.speculative_config.draft_tensor_parallel_size = 4
    assert deployment.unsupported(config, H200) == []
    config.speculative_config.draft_tensor_parallel_size = 1  # vLLM still builds it over the TP4 group
    assert [m.split(" (")[0] for m in deployment.unsupported(config, H200)] == [
        "the draft at the target's tensor-parallel size, one of 1, 2, 4, 8"]


def _build(dirs, backend, mode, monkeypatch):
    """vLLM's load_dspark_model under a VLLM_COMPILE-like config (``mode``),
    as ``_draft.build`` does, the deployment check passed (it refuses this
    CPU) and every kernel stock (no decode bound)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    _draft.apply_cpu_patches()
    monkeypatch.setattr(deployment, "check_deployment", lambda config: None)
    config = _as_on_a_gpu(_draft.vllm_config(*dirs[:2], backend), mode, "FULL_AND_PIECEWISE")
    _draft.init_dist(config)
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        fake = _draft.FakeTarget()
    with set_current_vllm_config(config):
        model = load_dspark_model(fake, config)
    return model, config


def _on_platform_kernel(module) -> bool:
    """Whether vLLM dispatched this CustomOp to its platform method: on this
    CPU platform ``forward_cpu`` (on CUDA ``forward_cuda``), not
    ``forward_native`` or its torch.compile."""
    return getattr(module._forward_method, "__func__", None) is type(module).forward_cpu


def test_the_plugin_keeps_its_draft_uncompiled_on_its_platform_kernels_and_the_target_as_configured(
        dirs, monkeypatch):
    from vllm.config import CompilationMode

    from dspark_vllm.adapter import activation_unsupported

    stock, _ = _build(dirs, "auto", 3, monkeypatch)
    backbone = stock.model
    # vLLM's own draft under VLLM_COMPILE: compiled, its custom ops native (SiluAndMul's torch.compiled).
    assert backbone.do_not_compile is False
    act_fn = backbone.layers[0].feed_forward.act_fn
    assert not _on_platform_kernel(act_fn) and not hasattr(act_fn._forward_method, "__func__")
    assert activation_unsupported(act_fn).startswith("vLLM dispatches this SiluAndMul to its PyTorch-native")
    assert backbone._rotary_emb._forward_method.__func__ is type(backbone._rotary_emb).forward_native

    ours, config = _build(dirs, "latency_specialized", 3, monkeypatch)
    backbone = ours.model
    assert backbone.do_not_compile is True
    for layer in backbone.layers:
        assert _on_platform_kernel(layer.feed_forward.act_fn) and _on_platform_kernel(layer.self_attn.rotary_emb)
        assert activation_unsupported(layer.feed_forward.act_fn) is None
    assert backbone.vllm_config.compilation_config.mode == CompilationMode.NONE
    # The config vLLM's runner and the target read keeps its mode and custom ops, and the
    # draft's attention layers registered in its static forward context.
    # (vLLM's CPU platform turns VLLM_COMPILE into DYNAMO_TRACE_ONCE when load_dspark_model re-runs the post-init.)
    assert config.compilation_config.mode in (CompilationMode.VLLM_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE)
    assert "none" in config.compilation_config.custom_ops
    names = ours.get_draft_kv_cache_layer_names()
    assert all(config.compilation_config.static_forward_context[n] is a
               for n, a in zip(names, ours.model._attn_layers))
    assert ours.dspark.plan is not None and ours.dspark.decode is None  # planned; no kernel on a CPU


def test_eager_draft_config_keeps_the_configured_custom_op_switches(dirs):
    from vllm.config import CompilationMode

    from dspark_vllm.model import eager_draft_config

    config = _as_on_a_gpu(_draft.vllm_config(*dirs[:2], "latency_specialized"), 3, "FULL_AND_PIECEWISE")
    config.compilation_config.custom_ops = ["none", "+silu_and_mul", "-rotary_embedding"]
    eager = eager_draft_config(config)
    assert eager.compilation_config.custom_ops == ["all", "+silu_and_mul", "-rotary_embedding"]
    assert eager.compilation_config.mode == CompilationMode.NONE
    assert config.compilation_config.custom_ops == ["none", "+silu_and_mul", "-rotary_embedding"]
    assert eager.compilation_config.static_forward_context is config.compilation_config.static_forward_context
    assert eager.parallel_config is config.parallel_config and eager.model_config is config.model_config


def test_process_weights_after_loading_runs_a_base_hook_first(dirs, monkeypatch):
    from vllm.models.muse_spark.common.dspark import MuseSparkDSparkForCausalLM

    from dspark_vllm.model import DSparkMuseSparkDSparkForCausalLM

    # vLLM 0.33.0's classes above the plugin's define no model-level hook (the loader's
    # process_weights_after_loading does the per-layer work before calling it).
    assert not any("process_weights_after_loading" in vars(c) for c in MuseSparkDSparkForCausalLM.__mro__)
    order = []
    monkeypatch.setattr(MuseSparkDSparkForCausalLM, "process_weights_after_loading",
                        lambda self: order.append("base"), raising=False)
    monkeypatch.setattr(runtime.SpecializedDecode, "build", lambda self: order.append("dspark"))
    model = DSparkMuseSparkDSparkForCausalLM.__new__(DSparkMuseSparkDSparkForCausalLM)
    torch.nn.Module.__init__(model)
    model.dspark = runtime.SpecializedDecode(model, None)
    model.markov = type("NoMarkov", (), {"build": lambda self: order.append("markov")})()
    model.outer = type("NoOuter", (), {"build": lambda self, plan: order.append(("outer", plan))})()
    model.process_weights_after_loading()
    # fc and the LM head last, told there is no decode (build stubbed: nothing bound).
    assert order == ["base", "dspark", "markov", ("outer", None)]


def test_collective_min_sends_a_cpu_tensor_under_a_cuda_like_default_device(monkeypatch):
    import torch.distributed as dist
    import vllm.distributed as vdist

    sent = []

    def all_reduce(t, op=None, group=None):
        sent.append(t.device.type)
        t.copy_(torch.tensor([1, -5], device="cpu"))

    monkeypatch.setattr(deployment, "tp_group_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(vdist, "get_tp_group", lambda: type("G", (), {"cpu_group": None})())
    with torch.device("meta"):  # vLLM loads models under torch.device(cuda)
        assert deployment.collective_min([3, 4]) == [1, -5]
    assert sent == ["cpu"]
