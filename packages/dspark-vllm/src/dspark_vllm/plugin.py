"""The ``vllm.general_plugins`` entry point: vLLM calls ``register`` once in
every process that builds configs or models (API server, engine core, each
worker). It only points vLLM's registry entry ``"MuseSparkDSparkModel"`` at
the plugin's draft class, by a lazy ``"module:Class"`` string (no CUDA, no
model import); calling it again is harmless (the registry overwrites)."""

from __future__ import annotations

ARCHITECTURE = "MuseSparkDSparkModel"
MODEL_CLASS = "dspark_vllm.model:DSparkMuseSparkDSparkForCausalLM"


def register() -> None:
    """Register the DSpark draft class under vLLM's Muse Spark DSpark architecture."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


__all__ = ["ARCHITECTURE", "MODEL_CLASS", "register"]
