"""The draft's Markov stage on DSpark's fused step: the plugin's side of
vLLM 0.33.0's ``sample_sequential`` hook.

``DSparkSpeculator._sample_sequential`` asks the draft model first
(``getattr(self.model, "sample_sequential", None)``); a True answer skips
vLLM's loop, False (having done nothing) runs it. ``MarkovStage`` answers:

- ``build()`` (from the model's ``process_weights_after_loading``, before
  graph capture) decides once whether the stage can run fused at all and,
  if so, builds and compiles dspark-cute's ``MarkovStep`` (the greedy step
  after the stock bias GEMM, bit for bit vLLM's loop:
  ``dspark_core.spec.markov``), its ``MarkovSampleStep`` (the probabilistic
  step: vLLM's Gumbel sampler and logits cache, ``dspark_core.spec.gumbel``;
  where the head has a d2t map and the kernel takes it) and their embedding
  buffer. It logs one plan
  line: the fused stage with its constants' key, or vLLM's loop with the
  reason (no CUDA GPU; a GPU architecture the kernel is not checked on
  against vLLM's loop, ``MARKOV_CHECKED``; a quantized or non-default Markov
  GEMM; a head or a ``max_num_seqs`` the kernel refuses: ``plan_stage``,
  which ``plan_line`` reads too; any refusal while the step is built and
  compiled: never an exception out of model loading);
- ``sample_sequential(spec, num_reqs, head_hidden)``: False, with its reason
  logged once, for what the fused steps do not cover: the top-k loop
  (``dspark_draft_topk``), a draft watermarker, FP64 Gumbel noise, a logits
  cache the sample step does not take, the confidence head, adaptive
  verification's acceptance estimator (each reads every step's logits or
  embeddings), a request count above the steps' rows, a base-logit layout
  the kernels do not read. Otherwise it runs vLLM's loop with the fused step
  (``dspark_cute.cutedsl.markov.loop.run_greedy_loop`` or, with
  ``draft_logits`` set, ``run_probabilistic_loop``): the base logits from the
  model's own ``compute_draft_logits``, the first embedding gather, then per
  step vLLM's own ``markov_bias`` and one launch, which writes
  ``spec.draft_tokens[:num_reqs, i]`` (and the logits cache's column ``i``);
  and returns True. Greedy, at the request counts where the build-time check
  found cuBLAS summing the bias GEMM in one split (``MarkovBiasStep``, built
  beside the step on the architectures of ``BIAS_CHECKED``), one launch a
  step does the bias GEMM too (``bias_step.run_fused_greedy_loop``); on
  those of ``PERSISTENT_CHECKED`` (sm_90a), at those counts up to 32 one
  launch does all N steps (``persistent.MarkovPersistentLoop``). With
  ``draft_logits`` set, on those of ``BIAS_SAMPLE_CHECKED`` (sm_90a), at
  those counts up to 32 one launch a step does the bias GEMM and the
  probabilistic step (``bias_sample.run_fused_probabilistic_loop``).

Every decision reads host state only (no device sync), so the hook is
capturable in vLLM's FULL CUDA graph.
"""

from __future__ import annotations

import torch

from dspark_core.errors import Unsupported, ranges
from dspark_vllm import deployment
from dspark_vllm import markov_plan as plan
from dspark_vllm.runtime import logger


def _step_class():
    from dspark_cute.cutedsl.markov.greedy import MarkovStep

    return MarkovStep


def _sample_class():
    from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

    return MarkovSampleStep


def _bias_class():
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep

    return MarkovBiasStep


def _persistent_class():
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentLoop

    return MarkovPersistentLoop


def _bias_sample_class():
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleStep

    return MarkovBiasSampleStep



def refusal_reason(error: Exception) -> str:
    """A build-time exception as the reason the stage keeps vLLM's loop: a
    refusal's (ValueError, TypeError) sentence, any other exception's type
    and message."""
    return str(error) if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {error}"


def attempt(what: str, make) -> tuple:
    """``make()``'s ``(host, reason)`` at build, or ``(None, reason)`` for
    an exception it raised (``refusal_reason``), logged with its traceback
    where it is no refusal (not a ValueError or TypeError): a build never
    raises out of model loading; ``what`` names the host in that log."""
    try:
        return make()
    except Exception as error:  # noqa: BLE001 (a refusal at build keeps the path before it, with its reason)
        if not isinstance(error, (ValueError, TypeError)):
            logger.warning("Building %s failed.", what, exc_info=error)
        return None, refusal_reason(error)


class MarkovStage:
    """The fused Markov stage of ``model`` (vLLM's Muse Spark DSpark draft)
    under ``vllm_config`` (module docstring). ``step_class`` and ``arch``
    replace dspark-cute's ``MarkovStep`` and the GPU's architecture (tests),
    as ``sample_class``, ``bias_class``, ``persistent_class`` and
    ``bias_sample_class`` replace ``MarkovSampleStep``, ``MarkovBiasStep``,
    ``MarkovPersistentLoop`` and ``MarkovBiasSampleStep``; ``checked``
    (default ``markov_plan.MARKOV_CHECKED``) the architectures the greedy
    step fuses on, and the probabilistic step's too where given (else
    ``markov_plan.SAMPLE_CHECKED``)."""

    def __init__(self, model, vllm_config, step_class=None, arch: str | None = "probe",
                 checked: frozenset[str] | None = None, sample_class=None, bias_class=None,
                 persistent_class=None, bias_sample_class=None) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.step_class = step_class
        self.sample_class = sample_class
        self.bias_class = bias_class
        self.persistent_class = persistent_class
        self.bias_sample_class = bias_sample_class
        self.bias_sample = None
        self.bias_sample_reason: str | None = "not built"
        self.bias_step = None
        self.bias_reason: str | None = "not built"
        self.loop = None
        self.loop_reason: str | None = "not built"
        self.arch = arch
        self.checked = plan.MARKOV_CHECKED if checked is None else checked
        self.sample_checked = plan.SAMPLE_CHECKED if checked is None else checked
        self.resolved_arch: str | None = None
        self.step = None
        self.sample = None
        self.sample_reason: str | None = "not built"
        self.embed: torch.Tensor | None = None
        self.reason: str | None = "not built"
        self._logged: set[str] = set()

    def _plan(self) -> plan.StagePlan:
        """``plan_stage`` on this GPU for ``max_num_seqs`` requests, then the
        Markov GEMM's dispatch (``bias_gemm_reason``) where it fuses."""
        arch = deployment.arch_of(deployment.gpu_capability()) if self.arch == "probe" else self.arch
        self.resolved_arch = arch
        planned = plan.plan_stage(self.model, arch, self.vllm_config.scheduler_config.max_num_seqs, self.checked,
                             self.sample_checked)
        reason = planned.reason or plan.bias_gemm_reason(self.model)
        return planned if reason is None else plan.StagePlan(None, reason, None, "the greedy step keeps vLLM's loop")

    def build(self) -> None:
        """Decide (``plan_stage``), build and compile (module docstring); logs
        the plan line. Any exception while the steps are built, compiled or
        their layouts checked keeps vLLM's loop with its reason logged."""
        model = self.model
        w1 = model.model.markov_head.markov_w1.weight
        planned = self._plan()
        reason, step = planned.reason, None

        def make():
            d2t = model.draft_id_to_target_id
            cls = self.step_class or _step_class()
            step = cls(planned.constants, w1.data, None if d2t is None else d2t.data,
                       self.vllm_config.scheduler_config.max_num_seqs)
            step.prepare()
            self.embed = torch.zeros(step.max_rows, w1.shape[1], dtype=w1.dtype, device=w1.device)
            self._check_layouts(step)
            return step, None

        if reason is None:
            step, reason = attempt("the DSpark Markov step", make)
            if step is None:
                self.embed = None
        self.reason = reason
        if reason is not None:
            logger.info("The DSpark draft keeps vLLM's Markov loop: %s.", reason)
            return
        self.step = step
        logger.info("The DSpark draft runs its greedy Markov stage fused (markov_step %s: one launch a step after "
                    "vLLM's bias GEMM, bit for bit its loop) for 1 to %d requests; other calls run vLLM's loop.",
                    step.constants.key(), step.max_rows)
        self._build_bias_step(step)
        self._build_sample(step, planned)
        self._build_bias_sample()

    def _gated(self, checked, unchecked: str, what: str, make, refused: str, reason: str | None = None) -> tuple:
        """``(host, reason)`` of one of the stage's optional hosts: ``reason``
        where given (a prerequisite missing), else ``unchecked`` (formatted
        with the GPU's architecture) outside ``checked``, else ``attempt(what,
        make)``; a reason is logged with ``refused`` (a ``%s`` format)."""
        if reason is None:
            arch, checked = plan.normalised_archs(self.resolved_arch, checked)
            reason = None if arch in checked else unchecked.format(arch=arch)
        host = None
        if reason is None:
            host, reason = attempt(what, make)
        if reason is not None:
            logger.info(refused, reason)
        return host, reason

    def _build_bias_step(self, step) -> None:
        """The greedy step with its bias GEMM beside ``step`` (``bias_step``),
        bound by its build-time check against the live cuBLAS at 1 to
        ``min(max_num_seqs, 64)`` requests (the request counts where cuBLAS
        sums the bias in one split), or its reason (logged once): an
        architecture outside ``BIAS_CHECKED``, no request count bound, or any
        exception while it is built, checked and compiled."""

        def make():
            cls = self.bias_class or _bias_class()
            w2 = self.model.model.markov_head.markov_w2.weight.data
            fused = cls(step.constants, step.w1, step.d2t, w2, min(step.max_rows, 64))  # the fused step's MAX_ROWS
            fused.check()
            if not fused.rows:
                return None, "the build-time check bound no request count: " + "; ".join(
                    sorted(set(fused.reasons.values())))
            return fused, None

        fused, reason = self._gated(plan.BIAS_CHECKED, plan.BIAS_UNCHECKED, "the DSpark Markov bias step", make,
                                    "The DSpark greedy Markov stage runs its step after vLLM's bias GEMM: %s.")
        self.bias_step, self.bias_reason = fused, reason
        if reason is not None:
            return
        logger.info("The DSpark greedy Markov stage runs the bias GEMM in its step (markov_bias_step: cuBLAS's order, "
                    "found by the build-time check) at %s requests; at other counts the step runs after vLLM's bias "
                    "GEMM.", ranges(fused.rows))
        self._build_persistent(fused)

    def _build_persistent(self, fused) -> None:
        """The N greedy steps in one persistent launch beside ``fused`` (the
        bias step: the loop takes the request counts, up to 32, that its
        check bound, then launches against vLLM's loop in torch ops, eagerly
        and in a CUDA graph, ``probe``; where a launch raised with PDL, once
        more without), or its reason (logged once): an architecture outside
        ``PERSISTENT_CHECKED``, a probe that failed, or any exception while
        it is built and compiled."""

        def make():
            from dspark_cute.cutedsl.markov.persistent import MAX_LOOP_ROWS

            cls = self.persistent_class or _persistent_class()
            steps = int(self.vllm_config.speculative_config.num_speculative_tokens)
            rows = min(fused.max_rows, MAX_LOOP_ROWS)
            loop = cls(fused.constants, fused.w1, fused.d2t, fused.w2, steps, rows)
            loop.bind(fused)
            if not loop.rows:
                return None, "the build-time check bound no request count up to the loop's rows"
            why = loop.probe()
            if why is not None and loop.refused and loop.pdl:
                # A driver that refuses the cooperative launch with PDL may take it without.
                logger.info("The DSpark persistent Markov loop tries a launch without PDL: %s.", why)
                loop = cls(fused.constants, fused.w1, fused.d2t, fused.w2, steps, rows, pdl=False)
                loop.bind(fused)
                why = loop.probe()
            return (None, why) if why is not None else (loop, None)

        loop, reason = self._gated(plan.PERSISTENT_CHECKED, plan.PERSISTENT_UNCHECKED,
                                   "the DSpark persistent Markov loop", make,
                                   "The DSpark greedy Markov stage launches once a step: %s.")
        self.loop, self.loop_reason = loop, reason
        if reason is not None:
            return
        logger.info("The DSpark greedy Markov stage runs its %d steps in one launch (markov_persistent_loop) at %s "
                    "requests.", loop.steps, ranges(loop.rows))

    def _build_sample(self, step, planned: plan.StagePlan) -> None:
        """The probabilistic step beside the greedy one (``planned.sample``),
        or its reason (logged once): the plan's, or any exception while it is
        built and compiled."""
        reason = planned.sample_reason

        def make():
            cls = self.sample_class or _sample_class()
            sample = cls(planned.sample, step.w1, self.model.draft_id_to_target_id.data, step.max_rows)
            sample.prepare()
            return sample, None

        if reason is None:
            sample, reason = attempt("the DSpark probabilistic Markov step", make)
        if reason is not None:
            self.sample_reason = reason
            logger.info("The DSpark draft keeps vLLM's Markov loop for probabilistic drafting: %s.", reason)
            return
        self.sample, self.sample_reason = sample, None
        logger.info("The DSpark draft runs its probabilistic Markov stage fused (markov_sample %s: vLLM's Gumbel "
                    "sample and logits cache in the same launch, bit for bit but for NaN logits).",
                    sample.constants.key())

    def _build_bias_sample(self) -> None:
        """The probabilistic step with its bias GEMM, where both the greedy
        bias step and the probabilistic step are built: bound to the request
        counts up to 32 that the bias step's build-time check bound
        (``MarkovBiasSampleStep.bind``), or its reason (logged once): either
        step missing, an architecture outside ``BIAS_SAMPLE_CHECKED``, no
        count bound, or any exception while it is built and compiled."""

        def make():
            from dspark_cute.cutedsl.markov.bias_sample import MAX_SAMPLE_ROWS

            cls = self.bias_sample_class or _bias_sample_class()
            bias = self.bias_step
            fused = cls(self.sample.constants, bias.w1, self.sample.d2t, bias.w2, min(bias.max_rows, MAX_SAMPLE_ROWS))
            fused.bind(bias)
            if not fused.rows:
                return None, "the build-time check bound no request count up to 32"
            return fused, None

        missing = None if self.sample is not None and self.bias_step is not None else (
            "it needs the probabilistic step and the greedy step with its bias GEMM, not both built")
        fused, reason = self._gated(plan.BIAS_SAMPLE_CHECKED, plan.BIAS_SAMPLE_UNCHECKED,
                                    "the DSpark probabilistic Markov bias step", make,
                                    "The DSpark probabilistic Markov stage runs its step after vLLM's bias GEMM: %s.",
                                    missing)
        self.bias_sample, self.bias_sample_reason = fused, reason
        if reason is not None:
            return
        logger.info("The DSpark probabilistic Markov stage runs the bias GEMM in its step (markov_bias_sample) at %s "
                    "requests.", ranges(fused.rows))

    def _check_layouts(self, step) -> None:
        """Unsupported unless the step takes the layouts of vLLM's
        ``markov_bias`` output (run here on 1 and 2 zero embeddings, 2 where
        the step takes 2 rows: its row stride does not depend on the row
        count beyond that) and of ``compute_draft_logits``' ``[R * N, Vpad]``
        output viewed ``[R, N, V]`` (``base_layout_reason`` checks the real
        one per call)."""
        model, n = self.model, int(self.vllm_config.speculative_config.num_speculative_tokens)
        vocab, rows = step.constants.vocab, model.lm_head.weight.shape[0]
        for r in range(1, min(2, step.max_rows) + 1):
            e = self.embed[:r]
            with torch.no_grad():
                bias = model.markov_bias(e)
            base = torch.zeros(r * n, rows, dtype=torch.bfloat16, device=e.device)[:, :vocab].view(r, n, vocab)
            tokens = torch.zeros(r, n, dtype=torch.int64, device=e.device)
            reason = step.problem(base[:, 0], bias, tokens[:, 0], e, True)
            if reason is not None:
                raise Unsupported(reason)

    @staticmethod
    def base_layout_reason(base: torch.Tensor) -> str | None:
        """Why the base logits ``[R, N, V]`` (a view of ``compute_draft_logits``' output) are not in a layout the
        fused step reads, or None: BF16, unit column stride, row strides multiples of 8, 16-byte aligned."""
        if base.dtype != torch.bfloat16 or base.stride(2) != 1 or base.stride(1) % 8 or base.stride(0) % 8 \
                or base.data_ptr() % 16:
            return (f"the base logits' layout ({base.dtype}, strides {tuple(base.stride())}) is not one the fused "
                    "step reads")
        return None

    def call_reason(self, spec, num_reqs: int) -> str | None:
        """Why this call runs vLLM's loop (module docstring), or None."""
        if self.step is None:
            return self.reason
        if getattr(spec, "_draft_topk", None) is not None:
            return "the top-k Markov loop (dspark_draft_topk) is not fused"
        if spec.draft_watermarker is not None:
            return "a draft watermarker samples the draft tokens"
        if spec.draft_logits is not None:
            reason = self._sample_reason(spec)
            if reason is not None:
                return f"probabilistic drafting (draft_sample_method='probabilistic'): {reason}"
        if spec.use_confidence_head:
            return "the confidence head reads every step's Markov embedding"
        if getattr(spec, "acceptance_estimator", None) is not None:
            return "adaptive verification's acceptance estimator reads every step's logits"
        if not 1 <= num_reqs <= self.step.max_rows:
            return f"{num_reqs} requests: the fused steps take 1 to {self.step.max_rows}"
        return None

    def _sample_reason(self, spec) -> str | None:
        """Why the probabilistic step does not take this speculator's sampling, or None."""
        if self.sample is None:
            return self.sample_reason
        if getattr(spec, "use_fp64_gumbel", False):
            return "FP64 Gumbel noise (use_fp64_gumbel) is not fused"
        if getattr(spec, "_d2t_scatter_index", None) is None:
            return "vLLM samples without the d2t scatter"
        cache, vt = spec.draft_logits, self.sample.constants.target_vocab
        if spec.vocab_size != vt or cache.dtype != torch.bfloat16 or cache.dim() != 3 or cache.shape[2] != vt \
                or not cache.is_contiguous() or cache.data_ptr() % 16:
            return (f"a logits cache of {cache.dtype} {list(cache.shape)} (the fused step writes a contiguous "
                    f"bfloat16 [requests, steps, {vt}])")
        return None

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("A DSpark draft step runs vLLM's Markov loop: %s.", reason)

    def sample_sequential(self, spec, num_reqs: int, head_hidden: torch.Tensor) -> bool:
        """vLLM's hook (module docstring): True after the fused loop wrote
        ``spec.draft_tokens[:num_reqs]``, False (nothing done) otherwise."""
        from dspark_cute.cutedsl.markov.loop import run_greedy_loop, run_probabilistic_loop

        if self.step is None:  # (build logged why)
            return False
        reason = self.call_reason(spec, num_reqs)
        if reason is not None:
            self._log_once(reason)
            return False
        model, n = self.model, spec.num_speculative_steps
        base = model.compute_draft_logits(head_hidden[spec.sample_indices[:num_reqs * n]])
        base = base.view(num_reqs, n, base.shape[-1])
        reason = self.base_layout_reason(base)
        if reason is not None:
            # (vLLM's loop computes the base logits again: nothing else was done.)
            self._log_once(reason)
            return False
        prev = spec.input_buffers.input_ids[spec._anchor_idx[:num_reqs]]
        w2, tokens = model.model.markov_head.markov_w2.weight, spec.draft_tokens[:num_reqs]
        if spec.draft_logits is None and self.loop is not None and num_reqs in self.loop.rows \
                and n == self.loop.steps:
            self.loop.launch(base, prev, tokens)
        elif spec.draft_logits is None and self.bias_step is not None and num_reqs in self.bias_step.rows:
            from dspark_cute.cutedsl.markov.bias_step import run_fused_greedy_loop

            run_fused_greedy_loop(self.bias_step, base, prev, tokens)
        elif spec.draft_logits is None:
            run_greedy_loop(self.step, base, prev, w2, tokens, self.embed, bias_fn=model.markov_bias)
        else:
            idx_map = spec.sample_idx_mapping[:num_reqs * n].view(num_reqs, n)
            pos = spec.sample_pos[:num_reqs * n].view(num_reqs, n)
            if self.bias_sample is not None and num_reqs in self.bias_sample.rows:
                from dspark_cute.cutedsl.markov.bias_sample import run_fused_probabilistic_loop

                run_fused_probabilistic_loop(self.bias_sample, base, prev, tokens, idx_map, spec.temperature,
                                             spec.seeds, pos, spec.draft_logits)
            else:
                run_probabilistic_loop(self.sample, base, prev, w2, tokens, self.embed, idx_map, spec.temperature,
                                       spec.seeds, pos, spec.draft_logits, bias_fn=model.markov_bias)
        return True


__all__ = ["MarkovStage", "attempt", "refusal_reason"]
