"""The plugin's registration and its switch, over vLLM's real
MuseSparkDSparkForCausalLM built from a small checkpoint at TP1 over gloo
(``_draft``; its docstring lists the CPU patches): the ``vllm.general_plugins``
entry point registers the class; ``auto`` builds exactly vLLM's class, whose
outputs equal the stock class's; any other value is refused;
``latency_specialized`` on a CPU fails at build with every missing
requirement."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
import torch  # noqa: E402

from dspark_vllm import deployment  # noqa: E402
from dspark_vllm.plugin import ARCHITECTURE, MODEL_CLASS  # noqa: E402


def _load_plugin():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dspark"]
    ep.load()()
    return ep


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    _load_plugin()
    return _draft.checkpoint_dir(tmp_path_factory, "plugin")


def test_the_entry_point_registers_the_draft_class_lazily_and_idempotently():
    from vllm import ModelRegistry

    ep = _load_plugin()
    assert ep.value == "dspark_vllm.plugin:register"
    entry = ModelRegistry.models[ARCHITECTURE]
    assert f"{entry.module_name}:{entry.class_name}" == MODEL_CLASS
    _load_plugin()
    assert f"{ModelRegistry.models[ARCHITECTURE].module_name}:{entry.class_name}" == MODEL_CLASS


def test_auto_builds_vllms_own_class_with_the_stock_outputs(checkpoint, tmp_path_factory):
    """The plugin's class resolves for the draft; with ``auto`` (and with no
    decode_backend at all) the object is vLLM's class itself. Its outputs
    equal those of vLLM's class registered without the plugin (a second
    checkpoint path, so the registry resolves it afresh)."""
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.models.muse_spark.common.dspark import MuseSparkDSparkForCausalLM

    built = _draft.build(*checkpoint, "auto")
    arch, _ = get_model_architecture(built.config.speculative_config.draft_model_config)
    assert arch.__module__ == "dspark_vllm.model"
    assert type(built.model) is MuseSparkDSparkForCausalLM and not hasattr(built.model, "dspark")
    assert type(_draft.build(*checkpoint, None).model) is MuseSparkDSparkForCausalLM

    stock_dirs = _draft.checkpoint_dir(tmp_path_factory, "stock")
    ModelRegistry.register_model(ARCHITECTURE, "vllm.models.muse_spark.common.dspark:MuseSparkDSparkForCausalLM")
    try:
        stock = _draft.build(*stock_dirs, "auto")
    finally:
        _load_plugin()
    ours = _draft.run_block(built.model, built.config, 7, 4)
    theirs = _draft.run_block(stock.model, stock.config, 7, 4)
    assert torch.equal(ours[0], theirs[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
    with torch.inference_mode():
        assert torch.equal(built.model.compute_draft_logits(ours[0]), stock.model.compute_draft_logits(theirs[0]))


def test_another_decode_backend_is_refused_with_the_accepted_ones(checkpoint):
    with pytest.raises(ValueError, match="decode_backend must be one of auto, latency_specialized"):
        _draft.build(*checkpoint, "fast")


def test_latency_specialized_on_a_cpu_fails_at_build_with_every_missing_requirement(checkpoint):
    config = _draft.vllm_config(*checkpoint[:2], "latency_specialized")
    missing = deployment.unsupported(config)
    assert missing[0].startswith("an sm_90 or sm_100 GPU")
    with pytest.raises(ValueError) as error:
        _draft.build(*checkpoint, "latency_specialized")
    assert str(error.value) == f"decode_backend=latency_specialized needs {'; '.join(missing)}."
