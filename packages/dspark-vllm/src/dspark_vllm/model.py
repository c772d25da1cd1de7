"""The draft class the plugin registers for ``"MuseSparkDSparkModel"``.

``DSparkMuseSparkDSparkForCausalLM(vllm_config=..., prefix=...)`` reads
``additional_config["decode_backend"]`` once (``deployment.decode_backend``):

- ``"auto"`` (the default): the object built is vLLM's own
  ``MuseSparkDSparkForCausalLM``, constructed as vLLM constructs it, so
  nothing of the plugin runs for it;
- ``"latency_specialized"``: an instance of this subclass. Its constructor
  runs the deployment check (``deployment.check_deployment``: every missing
  requirement in one ValueError, collective over the TP group), then vLLM's;
  ``process_weights_after_loading`` (vLLM's model-level hook after
  ``load_weights``, before memory profiling and graph capture) builds the
  specialized decode (``runtime.SpecializedDecode``); ``forward`` and
  ``precompute_and_store_context_kv`` run it where it takes the call and
  vLLM's stock methods otherwise;
- anything else: ValueError naming the accepted values.
"""

from __future__ import annotations

import torch
from vllm.models.muse_spark.common.dspark import MuseSparkDSparkForCausalLM

from dspark_vllm import deployment
from dspark_vllm.runtime import SpecializedDecode, logger


class DSparkMuseSparkDSparkForCausalLM(MuseSparkDSparkForCausalLM):
    """vLLM's Muse Spark DSpark draft with DSpark's specialized decode
    (module docstring)."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config")
        if vllm_config is not None and deployment.decode_backend(vllm_config) == deployment.AUTO:
            # Exactly vLLM's class: Python skips this class's __init__ for an
            # object of another class, so vLLM's runs here, as vLLM calls it.
            model = MuseSparkDSparkForCausalLM.__new__(MuseSparkDSparkForCausalLM)
            model.__init__(*args, **kwargs)
            return model
        return super().__new__(cls)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        self.decode_backend = deployment.decode_backend(vllm_config)
        deployment.check_deployment(vllm_config)
        logger.info("decode_backend=latency_specialized: the deployment check passed; the DSpark draft decode is "
                    "planned and built once the draft's weights are loaded.")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.dspark = SpecializedDecode(self, vllm_config)

    def process_weights_after_loading(self) -> None:
        """Build the specialized decode over the loaded weights (compiles every kernel it binds)."""
        self.dspark.build()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        out = self.dspark.forward(input_ids, positions, inputs_embeds)
        return super().forward(input_ids, positions, inputs_embeds) if out is None else out

    def precompute_and_store_context_kv(self, context_states: torch.Tensor, context_positions: torch.Tensor,
                                        context_slot_mapping=None) -> None:
        if not self.dspark.store_context(context_states, context_positions, context_slot_mapping):
            super().precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)


__all__ = ["DSparkMuseSparkDSparkForCausalLM"]
