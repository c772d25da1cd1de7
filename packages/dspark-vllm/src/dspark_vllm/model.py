"""The draft class the plugin registers for ``"MuseSparkDSparkModel"``.

``DSparkMuseSparkDSparkForCausalLM(vllm_config=..., prefix=...)`` reads
``additional_config["decode_backend"]`` once (``deployment.decode_backend``):

- ``"auto"`` (the default): the object built is vLLM's own
  ``MuseSparkDSparkForCausalLM``, constructed as vLLM constructs it, so
  nothing of the plugin runs for it;
- ``"latency_specialized"``: an instance of this subclass. Its constructor
  runs the deployment check (``deployment.check_deployment``: every missing
  requirement in one ValueError, collective over the TP group), then vLLM's
  under ``eager_draft_config(vllm_config)``: the draft is built as vLLM
  builds it under compilation mode NONE, whatever mode the target runs
  (its backbone uncompiled, its custom ops on their CUDA kernels), because
  the DSpark kernels reproduce those eager layers; the target keeps its
  configuration. ``process_weights_after_loading`` (vLLM's model-level hook
  after ``load_weights``, before memory profiling and graph capture) builds
  the specialized decode (``runtime.SpecializedDecode``); ``forward`` and
  ``precompute_and_store_context_kv`` run it where it takes the call and
  vLLM's stock methods otherwise; ``sample_sequential`` (vLLM's hook in
  ``DSparkSpeculator._sample_sequential``) runs the greedy Markov stage
  fused where ``markov.MarkovStage`` takes the call, False otherwise; fc
  and the LM head run DSpark's ordered GEMM at the row counts the build
  checked and timed (``projections.OuterProjections``), vLLM's own GEMM
  elsewhere;
- anything else: ValueError naming the accepted values.
"""

from __future__ import annotations

import copy

import torch
from vllm.config import CompilationMode, set_current_vllm_config
from vllm.models.muse_spark.common.dspark import MuseSparkDSparkForCausalLM

from dspark_vllm import deployment
from dspark_vllm.markov import MarkovStage
from dspark_vllm.projections import OuterProjections
from dspark_vllm.runtime import SpecializedDecode, logger, step_rows


def eager_draft_config(vllm_config):
    """``vllm_config`` as the draft sees it under compilation mode NONE: a
    shallow copy (as vLLM copies configs for its drafts) whose compilation
    config, a shallow copy too, has mode NONE and custom ops at the default
    vLLM gives a model under mode NONE (``"all"``: each ``CustomOp`` on its
    platform kernel, not ``forward_native`` or its ``torch.compile``), the
    configured ``+op`` / ``-op`` entries kept. Shallow: the static forward
    context (where the draft's attention layers register) and every other
    config object are the caller's."""
    compilation = copy.copy(vllm_config.compilation_config)
    compilation.mode = CompilationMode.NONE
    compilation.custom_ops = ["all", *(op for op in compilation.custom_ops if op not in ("all", "none"))]
    config = copy.copy(vllm_config)
    config.compilation_config = compilation
    return config


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
        logger.info("decode_backend=latency_specialized: the deployment check passed; the DSpark draft is built "
                    "uncompiled (compilation mode NONE for the draft only); its decode is planned and built once "
                    "its weights are loaded.")
        eager = eager_draft_config(vllm_config)
        # CustomOps dispatch on the current config's compilation config when built.
        with set_current_vllm_config(eager, prefix=prefix):
            super().__init__(vllm_config=eager, prefix=prefix)
        self.dspark = SpecializedDecode(self, vllm_config)
        self.markov = MarkovStage(self, vllm_config)
        self.outer = OuterProjections(self, step_rows=step_rows(vllm_config))

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level hook of a base class, where one has it (none in
        vLLM 0.33.0), then the specialized decode and the Markov stage over
        the loaded weights (each compiles every kernel it binds)."""
        base = getattr(super(), "process_weights_after_loading", None)
        if base is not None:
            base()
        self.dspark.build()
        self.markov.build()
        self.outer.build(self.dspark.plan if self.dspark.decode is not None else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        out = self.dspark.forward(input_ids, positions, inputs_embeds)
        return super().forward(input_ids, positions, inputs_embeds) if out is None else out

    def precompute_and_store_context_kv(self, context_states: torch.Tensor, context_positions: torch.Tensor,
                                        context_slot_mapping=None) -> None:
        if not self.dspark.store_context(context_states, context_positions, context_slot_mapping):
            super().precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)

    def sample_sequential(self, spec, num_reqs: int, head_hidden: torch.Tensor) -> bool:
        """vLLM's Markov hook: True after the fused stage wrote the draft
        tokens, False (nothing done) where vLLM's loop runs."""
        return self.markov.sample_sequential(spec, num_reqs, head_hidden)


__all__ = ["DSparkMuseSparkDSparkForCausalLM", "eager_draft_config"]
