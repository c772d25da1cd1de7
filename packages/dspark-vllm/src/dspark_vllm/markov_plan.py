"""The plan of the draft's Markov stage (``dspark_vllm.markov``): which of
dspark-cute's fused Markov kernels the stage builds on a GPU architecture
(the architectures each was checked on, bit for bit against vLLM 0.33.0's
loop), and the reason it keeps vLLM's loop or a kernel's predecessor where
it does not. ``plan_stage`` is the decision the build and the plan line both
read; ``plan_line`` is the line ``python -m dspark_vllm.plan`` prints."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_core import checks
from dspark_core.contracts.checked import (
    BIAS_CHECKED,
    BIAS_SAMPLE_CHECKED,
    BIAS_SAMPLE_UNCHECKED,
    BIAS_UNCHECKED,
    MARKOV_CHECKED,
    MARKOV_UNCHECKED,
    PERSISTENT_CHECKED,
    PERSISTENT_UNCHECKED,
    SAMPLE_CHECKED,
    SAMPLE_UNCHECKED,
)
from dspark_core.contracts.markov import (
    MarkovConstants,
    MarkovSampleConstants,
    markov_constants,
    markov_rows,
    markov_sample_constants,
)
from dspark_core.errors import Unsupported


def bias_gemm_reason(model) -> str | None:
    """Why vLLM's ``markov_bias`` is not the one BF16 ``F.linear`` whose
    output layout the fused step takes, or None (``projections.dispatch_reason``)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from dspark_vllm.projections import dispatch_reason

    method = model.model.markov_head.markov_w2.quant_method
    if not isinstance(method, UnquantizedEmbeddingMethod):  # the fused step takes the embedding's own layout
        return f"the Markov head's GEMM is quantized ({type(method).__name__})"
    return dispatch_reason(method, "the Markov head's GEMM")


def head_constants(model):
    """dspark-core's ``MarkovConstants`` of vLLM's draft ``model``, or
    Unsupported with the reason the fused step does not take its head."""
    head = model.model.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    constants = markov_constants(model.config.draft_vocab_size, w1.shape[1], float(model.output_multiplier),
                                 model.output_soft_cap_temp, model.draft_id_to_target_id is not None,
                                 model.lm_head.weight.dtype)
    if w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise Unsupported(f"the fused Markov step takes bfloat16 Markov weights, not {w1.dtype} and {w2.dtype}")
    return constants


def normalised_archs(arch, checked) -> tuple[str | None, frozenset[str]]:
    """``arch`` (None kept) and the set ``checked`` in the one spelling of
    ``checks.arch``: ``SM_90A`` and ``(9, 0)`` are sm_90a; TypeError for a
    string as the set (no substring matches), ValueError for an empty or
    malformed name."""
    arch = None if arch is None else checks.arch("the GPU architecture", arch, known=False)
    return arch, checks.arch_set("the checked architectures", checked, known=False)


def arch_reason(arch: str | None, checked: frozenset[str]) -> str | None:
    """Why the stage keeps vLLM's loop on ``arch`` (None: no CUDA GPU), or
    None; both normalised first (``normalised_archs``)."""
    arch, checked = normalised_archs(arch, checked)
    if arch is None:
        return "no CUDA GPU of an architecture the kernels are compiled for"
    if arch not in checked:
        return MARKOV_UNCHECKED.format(arch=arch)
    return None


@dataclass(frozen=True)
class StagePlan:
    """What the Markov stage of a draft fuses: the greedy step's
    ``constants`` or the ``reason`` it keeps vLLM's loop, and the
    probabilistic step's ``sample`` constants or its ``sample_reason``."""

    constants: MarkovConstants | None
    reason: str | None
    sample: MarkovSampleConstants | None
    sample_reason: str | None


def plan_stage(model, arch: str | None, rows, checked: frozenset[str], sample_checked: frozenset[str]) -> StagePlan:
    """The Markov stage of ``model`` on an ``arch`` GPU for steps of up to
    ``rows`` requests (vLLM's ``max_num_seqs``), as both the plan
    (``plan_line``) and the build (``MarkovStage.build``) decide it: the
    greedy step where ``arch`` is in ``checked`` and the contract takes the
    head (``head_constants``) and the rows (``markov_rows``); the
    probabilistic step beside it where ``arch`` is in ``sample_checked``, the
    head has a d2t map and the contract takes the target vocabulary
    (``markov_sample_constants``). A refusal (ValueError, TypeError) becomes
    the reason. ``arch`` and both sets are normalised first (``normalised_archs``:
    TypeError or ValueError for what names no architecture)."""
    arch, checked = normalised_archs(arch, checked)
    sample_checked = normalised_archs(None, sample_checked)[1]
    reason, constants = arch_reason(arch, checked), None
    if reason is None:
        try:
            constants = head_constants(model)
            markov_rows(rows, "vLLM's max_num_seqs")
        except (ValueError, TypeError) as refusal:
            reason, constants = str(refusal), None
    if reason is not None:
        return StagePlan(None, reason, None, "the greedy step keeps vLLM's loop")
    c, sample, sample_reason = constants, None, None
    try:
        if arch not in sample_checked:
            raise Unsupported(SAMPLE_UNCHECKED.format(arch=arch))
        if model.draft_id_to_target_id is None:
            raise Unsupported("the probabilistic step scatters through a d2t map and this head has none")
        sample = markov_sample_constants(c.vocab, int(model.config.vocab_size), c.rank, c.multiplier, c.soft_cap,
                                         model.lm_head.weight.dtype)
    except (ValueError, TypeError) as refusal:
        sample_reason = str(refusal)
    return StagePlan(c, None, sample, sample_reason)


def plan_line(model, arch: str, checked: frozenset[str] | None = None, rows=None) -> str:
    """The plan's line for the Markov stage of ``model`` on an ``arch`` GPU
    (``python -m dspark_vllm.plan``) for steps of up to ``rows`` requests
    (default: vLLM's default ``max_num_seqs``), decided by ``plan_stage`` as
    the build decides it: fused with its constants' key and the calls it
    leaves to vLLM, or vLLM's loop with the reason. ``checked`` (default
    ``MARKOV_CHECKED`` for the greedy step, ``SAMPLE_CHECKED`` for the
    probabilistic one) stands for both where given; the bias GEMM in the
    greedy step on ``BIAS_CHECKED``'s architectures (each request count is
    the build-time check's), and the N steps in one launch on
    ``PERSISTENT_CHECKED``'s (each bound count the probe's). The Markov GEMM's dispatch
    (``bias_gemm_reason``) is the serving process's and is checked there."""
    if rows is None:
        from vllm.config import SchedulerConfig

        rows = SchedulerConfig.DEFAULT_MAX_NUM_SEQS
    planned = plan_stage(model, arch, rows, MARKOV_CHECKED if checked is None else checked,
                         SAMPLE_CHECKED if checked is None else checked)
    if planned.reason is not None:
        return f"Markov stage: vLLM's loop: {planned.reason}"
    arch, bias_checked = normalised_archs(arch, BIAS_CHECKED)
    why = fused_bias_reason(planned.constants, rows)
    if planned.sample is not None:
        sampled = f"probabilistic drafting fused (markov_sample {planned.sample.key()}"
        if arch in bias_checked and why is None and arch in normalised_archs(None, BIAS_SAMPLE_CHECKED)[1]:
            sampled += (", the bias GEMM in the step (markov_bias_sample) at those request counts up to 32 where the "
                        "greedy step's check finds cuBLAS's one-split order")
        sampled += ")"
    else:
        sampled = f"probabilistic drafting in vLLM's loop ({planned.sample_reason})"
    if arch in bias_checked and why is None:
        bias = ("the bias GEMM in the step (markov_bias_step) at the request counts up to 64 where the build-time "
                "check finds cuBLAS's one-split order")
        loop_checked = normalised_archs(None, PERSISTENT_CHECKED)[1]
        loop_why = persistent_reason(planned.constants, rows) if arch in loop_checked else None
        if arch in loop_checked and loop_why is None:
            bias += (", all N steps in one launch (markov_persistent_loop) at those up to 32 where its build-time "
                     "probe agrees with vLLM's loop")
        elif arch in loop_checked:
            bias += f", one launch a step ({loop_why})"
    else:
        bias = f"the step after vLLM's bias GEMM ({why or BIAS_UNCHECKED.format(arch=arch)})"
    return (f"Markov stage: greedy drafting fused (markov_step {planned.constants.key()}) for 1 to {rows} requests, "
            f"{bias}; {sampled}; vLLM's loop for the top-k loop, a watermarker, FP64 Gumbel noise, the confidence "
            "head and adaptive verification")


def fused_bias_reason(constants, rows: int) -> str | None:
    """Why the greedy step with its bias GEMM does not take the head of
    ``constants`` for steps of up to ``rows`` requests (it is built for at
    most 64: dspark-cute's ``fused_unsupported``), or None; None too where
    dspark-cute is not installed (the build then says why)."""
    try:
        from dspark_cute.cutedsl.markov.bias_step import MAX_ROWS, fused_unsupported
    except ImportError:
        return None
    return fused_unsupported(constants, min(int(rows), MAX_ROWS))


def persistent_reason(constants, rows: int) -> str | None:
    """Why the N greedy steps in one launch do not take the head of
    ``constants`` for steps of up to ``rows`` requests (built for at most
    32: dspark-cute's ``persistent_unsupported``), or None; None too where
    dspark-cute is not installed (the build then says why)."""
    try:
        from dspark_cute.cutedsl.markov.persistent import MAX_LOOP_ROWS, persistent_unsupported
    except ImportError:
        return None
    return persistent_unsupported(constants, min(int(rows), MAX_LOOP_ROWS))


__all__ = ["BIAS_CHECKED", "BIAS_SAMPLE_CHECKED", "BIAS_SAMPLE_UNCHECKED", "BIAS_UNCHECKED", "MARKOV_CHECKED",
           "MARKOV_UNCHECKED", "PERSISTENT_CHECKED", "PERSISTENT_UNCHECKED", "SAMPLE_CHECKED", "SAMPLE_UNCHECKED",
           "StagePlan",
           "arch_reason", "bias_gemm_reason", "fused_bias_reason", "head_constants", "persistent_reason", "plan_line",
           "normalised_archs", "plan_stage"]
