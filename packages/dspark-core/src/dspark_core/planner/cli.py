"""``dspark-plan`` / ``python -m dspark_core.planner``: print which parts of a
draft run fused on a target, and why any part stays stock.

    dspark-plan [CONFIG.json] [--tp N] [--arch sm_90a|sm_100a] [--num-sms N]
                [--kernels installed|all|a,b] [--attention staged|direct]
                [--front] [--gemv] [--package-gemm] [--print-config]

Planning reads the config only: the reference draft is described on the
meta device, with no weights, so any config plans at once. As the decode
plans, the opt-in kernels are declined unless their flag asks for them. A
user error prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_core.planner import policy
from dspark_core.planner.plan import DraftPlan, plan_draft


def positive_int(text: str) -> int:
    """argparse's type for a positive integer (ArgumentTypeError otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="a DraftConfig JSON file (default: the reference draft)")
    p.add_argument("--tp", type=positive_int, default=1, help="the tensor-parallel size (default 1)")
    p.add_argument("--arch", default="sm_90a", choices=policy.ARCHS, help="the GPU architecture (default sm_90a)")
    p.add_argument("--num-sms", type=positive_int, default=132, help="the GPU's SM count (default 132, an H200)")
    p.add_argument("--kernels", default="installed",
                   help="'installed' (what the installed backends provide, the default), 'all' (every kernel "
                        "of the design) or a comma-separated list of kernel names")
    p.add_argument("--attention", default="staged", choices=policy.ATTENTION_VARIANTS,
                   help="the attention kernel's variant (default staged)")
    p.add_argument("--front", action="store_true", help="plan with the opt-in fused QKV front")
    p.add_argument("--gemv", action="store_true", help="plan with the opt-in one-token GEMV projections")
    p.add_argument("--package-gemm", action="store_true", help="plan with the opt-in package GEMM (TP > 1)")
    p.add_argument("--print-config", action="store_true", help="print the config's JSON first")
    return p


def _kernels(text: str) -> frozenset[str]:
    if text == "installed":
        return policy.installed_kernels()
    if text == "all":
        return policy.ALL_KERNELS
    names = frozenset(k.strip() for k in text.split(",") if k.strip())
    unknown = names - policy.ALL_KERNELS
    if unknown:
        raise ValueError(f"--kernels names unknown kernels {sorted(unknown)}; the kernels are "
                         f"{', '.join(sorted(policy.ALL_KERNELS))}")
    return names


def plan_config(args) -> tuple[object, DraftPlan]:
    """``(config, plan)`` of the parsed arguments; ValueError, TypeError or
    OSError for a bad config or target."""
    from dspark_core.reference.adapter import describe
    from dspark_core.reference.config import DraftConfig
    from dspark_core.reference.model import DraftModel
    from dspark_core.reference.tp import check_tp

    config = DraftConfig.from_json(args.config) if args.config else DraftConfig()
    check_tp(config, args.tp)
    target = policy.Target("cuda", args.arch, args.num_sms, args.tp, _kernels(args.kernels), attention=args.attention)
    target = target.opt_in(policy.asked_opt_ins(args.front, args.gemv, args.package_gemm))
    return config, plan_draft(describe(DraftModel(config, device="meta")), target)


def print_plan(plan: DraftPlan, out=None) -> None:
    """Print a plan (``DraftPlan.format``)."""
    print(plan.format(), file=out or sys.stdout)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config, plan = plan_config(args)
    except (ValueError, TypeError, OSError, json.JSONDecodeError) as error:
        print(f"dspark-plan: error: {error}", file=sys.stderr)
        return 2
    try:
        if args.print_config:
            print(config.to_json())
        print_plan(plan)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `dspark-plan | head`: the reader has all it wanted
        sys.stdout = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
