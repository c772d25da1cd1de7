"""The draft-step benchmark's DSpark-side Markov stage and the projections
outside the decode (``bench_draft_step``): fc, the LM head and the Markov
bias on the ordered GEMM where asked (``ordered_projection``), and the
greedy Markov loop on DSpark's kernels (``fused_markov``): the step with its
bias GEMM (``markov.bias_step``) at the request counts its build-time check
binds, else the fused step after the bias GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


def ordered_projection(role: str, weight: torch.Tensor, rows=None):
    """DSpark's ordered GEMM for a projection outside the decode (fc, the LM
    head, the Markov bias), bound where the build-time check found cuBLAS's
    order (``OrderedGemm.check`` against ``F.linear``) and its timing on this
    card found it faster (``OrderedGemm.decide``), as the executor binds the
    layers', at ``rows`` (None: 1 to 64); None where the kernel is not
    installed."""
    try:
        from dspark_core.contracts.constants import ordered_gemm_constants
        from dspark_cute.cutedsl.gemm.ordered import OrderedGemm
    except ImportError:
        return None
    gemm = OrderedGemm(ordered_gemm_constants(role, weight), weight)
    result = gemm.check(rows)
    print(f"{role}: {result.summary()}", flush=True)
    print(f"{role}: {gemm.decide().summary()}", flush=True)
    return gemm


def _project(gemm, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` on ``gemm`` where it takes ``x``, else ``F.linear``."""
    if gemm is not None and gemm.takes(x):
        return gemm.launch(x)
    return F.linear(x, weight)


def fused_markov(stock, mode: str = "auto", bias_gemm=None, steps: int = 4):
    """``(loop, label)``: the DSpark side's Markov loop, or ``(None, why)``
    for vLLM's stock loop. ``mode``: "stock", "fused" (ImportError or
    Unsupported raised: the fused steps, the bias step where its check binds
    the rows), "persistent" (as "fused", and the ``steps`` steps in one
    launch, ``markov.persistent``, at the request counts up to 32 the bias
    step binds) or "auto": what the plugin builds on this GPU, i.e. each
    kernel where this GPU's architecture is in its checked set
    (``dspark_core.contracts.checked``: the bias step, then the persistent
    loop), the fused step where installed. The fallback after a bias step's
    refused count is dspark-cute's ``markov.loop.run_greedy_loop`` (the stock
    first embedding gather and each step's cuBLAS bias GEMM, everything after
    the GEMM on one ``MarkovStep`` launch, the next step's embedding gather
    included)."""
    if mode == "stock":
        return None, "vLLM's stock loop (asked for)"
    try:
        from dspark_core import checks
        from dspark_core.contracts.checked import BIAS_CHECKED, PERSISTENT_CHECKED
        from dspark_core.contracts.markov import markov_constants
        from dspark_core.errors import Unsupported
        from dspark_cute.cutedsl.markov.greedy import MarkovStep
        from dspark_cute.cutedsl.markov.loop import run_greedy_loop
    except ImportError as error:
        if mode == "fused":
            raise
        return None, f"vLLM's stock loop (no fused Markov kernel: {error})"
    head = stock.head
    vocab, rank = head.markov_w2.shape
    try:
        constants = markov_constants(vocab, rank, float(head.output_multiplier), head.soft_cap, True)
    except Unsupported as error:
        if mode == "fused":
            raise
        return None, f"vLLM's stock loop ({error})"
    kernel = MarkovStep(constants, head.markov_w1, head.d2t, max_rows=512)
    kernel.prepare()
    embed = torch.empty(512, rank, dtype=BF16, device=head.markov_w1.device)
    arch = checks.arch("this GPU", torch.cuda.get_device_capability(head.markov_w2.device), known=False) \
        if head.markov_w2.is_cuda else None
    fused = bias_step(constants, head) if mode != "auto" or arch in BIAS_CHECKED else None
    persistent = mode == "persistent" or (mode == "auto" and arch in PERSISTENT_CHECKED)
    loop_one = None
    if persistent and fused is not None:
        try:
            loop_one = persistent_loop(fused, steps)
        except (Unsupported, RuntimeError) as error:  # the plugin logs it and keeps the bias step
            if mode == "persistent":
                raise
            print(f"markov persistent loop refused, the bias step runs: {error}", flush=True)

    bias_fn = None
    if bias_gemm is not None:
        bias_fn = lambda e: _project(bias_gemm, e, head.markov_w2)[:, :vocab]  # noqa: E731

    def loop(logits, input_ids, anchor_idx, n, draft_tokens):
        from dspark_cute.cutedsl.markov.bias_step import run_fused_greedy_loop

        base = logits.view(anchor_idx.shape[0], n, vocab)
        prev = input_ids[anchor_idx]
        if loop_one is not None and anchor_idx.shape[0] in loop_one.rows and n == loop_one.steps:
            loop_one.launch(base, prev, draft_tokens)
        elif fused is not None and anchor_idx.shape[0] in fused.rows:
            run_fused_greedy_loop(fused, base, prev, draft_tokens)
        else:
            run_greedy_loop(kernel, base, prev, head.markov_w2, draft_tokens, embed, bias_fn)
        return (draft_tokens,)

    gemm = ", the bias GEMM on the ordered GEMM" if bias_gemm is not None else ""
    if fused is None:
        return loop, f"DSpark's fused greedy Markov step (run_greedy_loop: 1 + 2N launches{gemm})"
    if loop_one is not None:
        return loop, (f"DSpark's greedy Markov loop in one persistent launch at {_spans(loop_one.rows)} requests, "
                      f"the step with its bias GEMM (N launches) at the other of {_spans(fused.rows)}, else the "
                      f"fused step after the bias GEMM (1 + 2N launches{gemm})")
    return loop, (f"DSpark's greedy Markov step with its bias GEMM (N launches) at {_spans(fused.rows)} requests "
                  f"(one split found against cuBLAS), else the fused step after the bias GEMM (1 + 2N launches{gemm})")


def bias_step(constants, head):
    """The greedy step with its bias GEMM (``markov.bias_step``) bound
    where the build-time check found cuBLAS's one-split order (1 to 64
    requests), or None where it does not take the head."""
    from dspark_core.errors import Unsupported
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep

    try:
        fused = MarkovBiasStep(constants, head.markov_w1, head.d2t, head.markov_w2.contiguous())
    except Unsupported as error:
        print(f"the Markov bias step does not take the head: {error}")
        return None
    result = fused.check()
    print(f"markov bias step: {result.summary()}; taken at {_spans(fused.rows)} requests", flush=True)
    return fused


def persistent_loop(fused, steps: int):
    """The N greedy steps in one launch (``markov.persistent``) at the
    request counts up to 32 that ``fused`` (the bias step) binds; the
    refusal raised (asked for by name)."""
    from dspark_cute.cutedsl.markov.persistent import MAX_LOOP_ROWS, MarkovPersistentLoop

    loop = MarkovPersistentLoop(fused.constants, fused.w1, fused.d2t, fused.w2, steps,
                                min(fused.max_rows, MAX_LOOP_ROWS))
    loop.bind(fused)
    why = loop.probe()
    print(f"markov persistent loop: {steps} steps in one launch at {_spans(loop.rows)} requests"
          + (f" ({why})" if why else ""), flush=True)
    return loop


def _spans(rows) -> str:
    from dspark_core.errors import ranges

    return ranges(rows) or "no"
