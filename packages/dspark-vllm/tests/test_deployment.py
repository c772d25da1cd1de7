"""The deployment check (``deployment.unsupported``) over real VllmConfigs
of DSpark speculative decoding: on this CPU, then as on an sm_90 GPU
(the compute capability passed in, the FULL decode graphs a CPU config cannot
set written into its compilation config), one requirement broken at a time
(the compilation, graph and parallel settings the check accepts:
``test_compilation.py``);
the collective verdict over the TP group's gloo CPU group; and the
all-reduce facts that decide the fused all-reduce at TP > 1."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402

from dspark_vllm import deployment  # noqa: E402

H200 = (9, 0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from dspark_vllm.plugin import register

    register()
    return _draft.checkpoint_dir(tmp_path_factory, "deployment")[:2]


def _gpu_like(dirs):
    """A config as a GPU deployment would have it: eager layers with FULL decode graphs."""
    from vllm.config import CUDAGraphMode

    config = _draft.vllm_config(*dirs, "latency_specialized")
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    return config


def test_on_this_cpu_it_needs_a_gpu(dirs):
    missing = deployment.unsupported(_draft.vllm_config(*dirs, "latency_specialized"))
    assert [m.split(" (")[0] for m in missing] == ["an sm_90 or sm_100 GPU"]


def test_a_gpu_deployment_meets_every_requirement(dirs):
    assert deployment.unsupported(_gpu_like(dirs), H200) == []
    assert deployment.unsupported(_gpu_like(dirs), (10, 0)) == []
    assert deployment.unsupported(_gpu_like(dirs), (8, 0))[0].startswith("an sm_90 or sm_100 GPU")


@pytest.mark.parametrize("what, change, needs", [
    ("fp8 KV cache", lambda c: setattr(c.cache_config, "cache_dtype", "fp8"), "a bfloat16 model and a bfloat16 KV"),
    ("LoRA", lambda c: setattr(c, "lora_config", object()), "no LoRA"),
    ("sleep mode", lambda c: setattr(c.model_config, "enable_sleep_mode", True), "no sleep mode"),
    ("TP3", lambda c: setattr(c.parallel_config, "tensor_parallel_size", 3), "the draft at the target's tensor"),
    ("draft TP1 under TP2", lambda c: (setattr(c.parallel_config, "tensor_parallel_size", 2),
                                       setattr(c.speculative_config, "draft_tensor_parallel_size", 1)),
     "the draft at the target's tensor"),
    ("pipeline parallel", lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2),
     "the draft at the target's tensor"),
    ("attention backend", lambda c: setattr(c.speculative_config, "attention_backend", "TRITON_ATTN"),
     "the draft's default attention backend"),
])
def test_each_missing_requirement_is_named(dirs, what, change, needs):
    config = _gpu_like(dirs)
    change(config)
    missing = deployment.unsupported(config, H200)
    assert len(missing) == 1 and missing[0].startswith(needs), (what, missing)


def test_environment_and_versions(dirs, monkeypatch):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLNHC")  # any layout: the inserts take the bound cache's strides
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setattr(deployment, "installed_versions",
                        lambda: {"vllm": "0.33.0", "flashinfer-python": "0.7.3", "nvidia-cutlass-dsl": None})
    missing = deployment.unsupported(_gpu_like(dirs), H200)
    assert [m.split(" (")[0] for m in missing] == [
        "no LoRA, KV transfer, watermarking or batch invariance",
        "flashinfer-python==0.7.2.post1", "nvidia-cutlass-dsl==4.8.0"]
    assert "(found 0.7.3)" in missing[1] and "(found none)" in missing[2]


def test_the_verdict_is_collective_and_lists_everything(dirs, monkeypatch):
    """At TP1 over gloo the MIN over the TP CPU group is this rank's verdict;
    a rank whose own list is empty still raises where another rank misses
    a requirement."""
    config = _draft.vllm_config(*dirs, "latency_specialized")
    _draft.init_dist(config)
    with pytest.raises(ValueError, match=r"^decode_backend=latency_specialized needs an sm_90 or sm_100 GPU "
                                         r"\(CUDA compute capability 9\.x or 10\.x: [^;]*\.$"):
        deployment.check_deployment(config)
    monkeypatch.setattr(deployment, "unsupported", lambda c: [])
    deployment.check_deployment(config)  # passes
    monkeypatch.setattr(deployment, "collective_min", lambda values: [0])  # another rank misses one
    with pytest.raises(ValueError, match="needs every other tensor-parallel rank to support it"):
        deployment.check_deployment(config)


def test_decode_backend_reads_additional_config(dirs):
    assert deployment.decode_backend(_draft.vllm_config(*dirs, None)) == "auto"
    assert deployment.decode_backend(_draft.vllm_config(*dirs, "latency_specialized")) == "latency_specialized"
    with pytest.raises(ValueError, match=r"one of auto, latency_specialized .*not 'latency'"):
        deployment.decode_backend(_draft.vllm_config(*dirs, "latency"))


def test_the_all_reduce_facts_are_allreduces():
    """deployment re-exports the all-reduce table (dspark_vllm.allreduce; its
    tests in test_allreduce): outside a TP group of that size the GPUs'
    facts are unknown, so at TP4 FlashInfer's backend is."""
    from dspark_vllm import allreduce

    assert deployment.stock_all_reduce is allreduce.stock_all_reduce
    assert deployment.AllReduceOrder is allreduce.AllReduceOrder
    four = deployment.stock_all_reduce(4, "sm_90a", env={})
    assert four.sum_order is None and "multicast" in four.why
    assert deployment.stock_all_reduce(1, None).backend == "none"
