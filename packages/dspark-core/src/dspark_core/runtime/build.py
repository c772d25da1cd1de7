"""Building the executor: ``build_draft_decode`` plans a draft for the
device it lives on (``draft_plan``), logs every stock part once with its
reason, binds and compiles every kernel (``DraftDecode.prepare``, then at TP
the all-reduce boundaries', collectively: ``prepare_collectively``) and
returns the ``DraftDecode`` (``dspark_core.runtime.decode``), or None where
the draft keeps its stock layers."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from dspark_core import switches
from dspark_core.planner import policy
from dspark_core.planner.plan import DraftPlan, plan_draft
from dspark_core.runtime.decode import DEFAULT_PREFETCH, AllReduceBoundaries, DraftDecode
from dspark_core.runtime.description import DraftDescription, check_draft

log = logging.getLogger("dspark.decode")


def draft_plan(draft: DraftDescription, tp: int = 1, exclude=frozenset(), attention: str = "staged",
               gemv: bool = False, package_gemm: bool = False,
               kernels: frozenset[str] | None = None, ordered_gemm: bool | None = None) -> DraftPlan:
    """The plan ``build_draft_decode`` runs: ``draft`` at TP size ``tp`` for
    the device it lives on, the installed kernels (or ``kernels``) less
    ``exclude`` (which the plan's reasons call excluded), the opt-in kernels
    declined unless asked for (the ordered GEMM, where ``ordered_gemm`` is
    None: ``policy.ordered_gemm_default(tp)``), and the ``attention`` kernel
    variant."""
    check_draft(draft)
    unknown = set(exclude) - policy.ALL_KERNELS
    if unknown:
        raise ValueError(f"exclude names unknown kernels {sorted(unknown)}; the kernels are "
                         f"{', '.join(sorted(policy.ALL_KERNELS))}")
    target = policy.device_target(draft.device, tp, kernels)
    if ordered_gemm is None:
        ordered_gemm = policy.ordered_gemm_default(tp)
    target = target.without(exclude).opt_in(policy.asked_opt_ins(gemv, package_gemm, ordered_gemm))
    return plan_draft(draft, target.replace(attention=attention))


def prepare_collectively(decode: DraftDecode | None, all_reduce: AllReduceBoundaries | None,
                         error: BaseException | None = None) -> BaseException | None:
    """Compile ``decode``'s kernels (``DraftDecode.prepare``, unless
    ``error``: this rank already failed, e.g. building ``decode``), then, at
    TP, its all-reduce boundaries' (``all_reduce.prepare``: collective, so it
    runs even after this rank failed, told so, and every rank fails instead
    of waiting for this one). Returns this rank's error, or None; another
    rank's failure comes back as the RuntimeError of the boundaries' agreement."""
    if error is None:
        try:
            decode.prepare()
        except Exception as e:  # noqa: BLE001 (returned: the caller raises it or keeps the stock path)
            error = e
    if all_reduce is not None:
        if error is None:
            try:
                all_reduce.prepare()
            except Exception as e:  # noqa: BLE001 (returned, as above)
                error = e
        else:
            try:
                all_reduce.prepare(failed=error)
            except RuntimeError:
                pass  # the other ranks now fail too; this rank's own error is returned
    return error


def build_draft_decode(
    draft: DraftDescription,
    all_reduce: AllReduceBoundaries | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
    attention_variant: str | None = None,
    prefetch: dict[str, int] | bool | None = None,
    gemv: bool | None = None,
    package_gemm: bool | None = None,
    kernels: Mapping[str, type] | None = None,
    ordered_gemm: bool | None = None,
    step_rows=None,
) -> DraftDecode | None:
    """The draft's specialized decode, prepared, or None where it keeps its
    stock layers; every stock part is logged with its reason.

    ``exclude``: kernel names not to use (ValueError for an unknown name).
    ``gemv`` (default ``DSPARK_GEMV``), ``package_gemm`` (default
    ``DSPARK_PACKAGE_GEMM``): the opt-in kernels (module docstring);
    ``ordered_gemm`` (default ``DSPARK_ORDERED_GEMM``, else on at TP1:
    ``policy.ordered_gemm_default``): the ordered GEMM, which keeps the stock
    bits and runs a row count only where it is also faster (``_bind_ordered``). ``attention_variant`` (default
    ``DSPARK_ATTENTION`` or "staged"): ``policy.ATTENTION_VARIANTS``.
    ``prefetch`` (default: on at TP1, off with ``all_reduce``;
    ``DSPARK_PREFETCH``, a ``dspark_core.switches`` word, overrides; a dict: bytes a row per weight
    role) turns on the L2 prefetch of each GEMM's weight during the kernels
    before it (it changes no value). ``kernels``: host classes by kernel name
    instead of the installed backends'. ``step_rows``: the row counts the
    deployment's steps have (``DraftDecode``'s: the ordered GEMMs are
    checked and timed at those alone; default any).

    A rank's shard (``draft.tp > 1``) needs ``all_reduce`` of its TP size.
    ``all_reduce.prepare()`` runs after the decode's; it is collective, and a
    rank whose own prepare failed still calls it (``failed=``) before raising,
    so no rank waits for another."""
    check_draft(draft)
    if draft.tp > 1 and all_reduce is None:
        raise ValueError(f"a TP{draft.tp} shard of the draft needs its all-reduce boundaries (all_reduce=...)")
    if all_reduce is not None and draft.tp > 1 and all_reduce.tp != draft.tp:
        raise ValueError(f"TP{all_reduce.tp} all-reduce boundaries for a TP{draft.tp} shard")
    variant = attention_variant
    if variant is None:
        variant = switches.env_choice("DSPARK_ATTENTION", policy.ATTENTION_VARIANTS, "staged")
    if variant not in policy.ATTENTION_VARIANTS:
        raise ValueError(f"an attention variant is one of {policy.ATTENTION_VARIANTS}, not {variant!r}")
    if prefetch is not None and not isinstance(prefetch, (bool, dict)):
        raise TypeError(f"prefetch must be None, True, False or a dict of bytes per role, not {prefetch!r}")
    names = frozenset(kernels) if kernels is not None else None
    tp = all_reduce.tp if all_reduce is not None else 1
    plan = draft_plan(draft, tp, exclude, variant,
                      switches.switch(gemv, "DSPARK_GEMV"),
                      switches.switch(package_gemm, "DSPARK_PACKAGE_GEMM"), names,
                      switches.switch(ordered_gemm, "DSPARK_ORDERED_GEMM", policy.ordered_gemm_default(tp)))
    if prefetch is None:
        prefetch = switches.env_flag("DSPARK_PREFETCH", all_reduce is None)
    if plan.draft_reason is not None:
        log.warning("the DSpark draft keeps its stock layers: %s", plan.draft_reason)
        return None
    if prefetch is True:
        prefetch = DEFAULT_PREFETCH
    decode = DraftDecode(draft, plan, all_reduce, prefetch=prefetch or None, kernels=kernels, step_rows=step_rows)
    for reason in dict.fromkeys(p.reason for p in plan.parts() if not p.fused and not p.declined):
        names_ = [p.name for p in plan.parts() if p.reason == reason]
        decode._log_once(logging.WARNING, f"{', '.join(names_)} keep their stock modules: {reason}")
    for reason in dict.fromkeys(p.reason for p in plan.parts() if p.declined):
        decode._log_once(logging.INFO, reason)
    error = prepare_collectively(decode, all_reduce)
    if error is not None:
        raise error
    fused, total = plan.fused_count()
    decode._log_once(logging.INFO, f"the DSpark draft runs {fused} of {total} planned parts fused")
    return decode


__all__ = ["build_draft_decode", "draft_plan", "prepare_collectively"]
