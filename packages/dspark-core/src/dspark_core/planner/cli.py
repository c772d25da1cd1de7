"""``dspark-plan`` / ``python -m dspark_core.planner``: print which parts of a
draft run fused on a target, and why any part stays stock.

    dspark-plan [CONFIG.json] [--tp N] [--arch sm_90a|sm_100a] [--num-sms N]
                [--kernels installed|all|a,b] [--attention staged|direct]
                [--gemv] [--package-gemm] [--ordered-gemm | --no-ordered-gemm]
                [--print-config]

Planning reads the config only: the reference draft is described on the
meta device, with no weights, so any config plans at once. As the decode
plans, the opt-in kernels are declined unless their flag asks for them
(``--gemv`` at TP1 only, ``--package-gemm`` at TP > 1 only); the ordered
GEMM is on at TP1 unless ``--no-ordered-gemm`` (its projections are then
"decided at build": no plan sees the live cuBLAS) and opt-in at TP > 1
(``--ordered-gemm``). A user error
prints one line on stderr and exits 2; an output that cannot be written (a
full disk) one line and 1; a closed pipe ends it quietly.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
from pathlib import Path

from dspark_core import checks
from dspark_core.errors import listed
from dspark_core.planner import policy
from dspark_core.planner.plan import DraftPlan, plan_draft


class StrictParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` for DSpark's command lines that takes an option
    only as written (no abbreviations: ``--ordered-gem`` is no
    ``--ordered-gemm``) and once: an option given twice, or two options of
    one setting (``--ordered-gemm --no-ordered-gemm``), is a usage error
    naming them, not the last one silently kept."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        seen: dict[str, str] = {}
        for arg in argv:
            if arg == "--":
                break
            option = arg.split("=", 1)[0] if arg.startswith("--") else arg
            action = self._option_string_actions.get(option)
            if action is None or action.dest == "help":
                continue
            if action.dest in seen:
                same = seen[action.dest] == option
                self.error(f"{option} given twice" if same else f"{seen[action.dest]} and {option} both given "
                           "(one setting: give one)")
            seen[action.dest] = option
        return super().parse_known_args(argv, namespace)


def int_in(low: int, high: int | None = None):
    """argparse's type for an integer from ``low`` to ``high`` (None: no
    upper bound), written in ASCII digits with an optional sign and blanks
    around (Python's ``int`` also reads other scripts' digits and
    underscores, which no command line means); ArgumentTypeError naming the
    range otherwise."""
    expected = "a positive integer" if low == 1 and high is None else (
        f"an integer of at least {low}" if high is None else f"an integer from {low} to {high}")

    def parse(text: str) -> int:
        if not _DECIMAL.fullmatch(text.strip()):
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, not {value}")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = int_in(1)
# A decimal integer in ASCII digits, with an optional sign.
_DECIMAL = re.compile(r"[+-]?[0-9]+")


def arch_name(text: str) -> str:
    """argparse's type for a GPU architecture: ``checks.arch``'s one spelling
    (``SM_90A`` is sm_90a), one of ``policy.ARCHS``; ArgumentTypeError
    naming them otherwise."""
    try:
        return checks.arch("the architecture", text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def folder(text: str) -> Path:
    """argparse's type for a folder's path; ArgumentTypeError for an empty
    one (which ``Path`` would read as the working directory)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder's path, not ''")
    return Path(text)


def kernel_names(text: str, flag: str = "--kernels") -> frozenset[str]:
    """The kernels of a comma-separated list: ValueError for an empty list,
    an empty or repeated entry, or an unknown name (naming the kernels)."""
    entries = [k.strip() for k in text.split(",")]
    known = f"the kernels are {', '.join(sorted(policy.ALL_KERNELS))}"
    if not any(entries):
        raise ValueError(f"{flag} names no kernel; {known}")
    if "" in entries:
        raise ValueError(f"{flag} {text!r} has an empty entry; write names separated by single commas")
    repeated = {k for k in entries if entries.count(k) > 1}
    if repeated:
        raise ValueError(f"{flag} names {listed(repeated)} more than once")
    unknown = set(entries) - policy.ALL_KERNELS
    if unknown:
        raise ValueError(f"{flag} names unknown kernels {listed(unknown)}; {known}")
    return frozenset(entries)


def check_opt_in_tp(tp: int, gemv: bool, package_gemm: bool) -> None:
    """ValueError for an opt-in flag the TP size leaves nothing to do:
    ``--gemv`` runs at TP1 only (at TP the branch GEMMs feed the
    all-reduce), ``--package-gemm`` at TP > 1 only (it publishes into the
    all-reduce)."""
    if gemv and tp > 1:
        raise ValueError(f"--gemv runs at TP1 only (at TP{tp} the branch GEMMs feed the all-reduce)")
    if package_gemm and tp == 1:
        raise ValueError("--package-gemm runs at TP > 1 only (it publishes into the all-reduce; TP1 has none)")


def release_stdout() -> None:
    """Flush stdout; where it cannot take more (a closed pipe, a full disk),
    point it at the null device so that nothing fails again at exit."""
    try:
        sys.stdout.flush()
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def write_out(text: str, prog: str) -> int:
    """Print ``text`` to stdout: 0, also where the reader closed the pipe
    (``| head``: it has all it wanted); 1 after one line on stderr where
    stdout fails otherwise (ENOSPC: a full disk)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        release_stdout()
        return 0
    except OSError as error:
        release_stdout()
        print(f"{prog}: error: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = StrictParser(prog="dspark-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="a DraftConfig JSON file (default: the reference draft)")
    p.add_argument("--tp", type=int_in(1, policy.MAX_TP), default=1, help="the tensor-parallel size (default 1)")
    p.add_argument("--arch", default="sm_90a", type=arch_name,
                   help=f"the GPU architecture: {' or '.join(policy.ARCHS)} (default sm_90a)")
    p.add_argument("--num-sms", type=int_in(1, policy.MAX_SMS), default=132,
                   help="the GPU's SM count (default 132, an H200)")
    p.add_argument("--kernels", default="installed",
                   help="'installed' (what the installed backends provide, the default), 'all' (every kernel "
                        "of the design) or a comma-separated list of kernel names")
    p.add_argument("--attention", default="staged", choices=policy.ATTENTION_VARIANTS,
                   help="the attention kernel's variant (default staged)")
    p.add_argument("--gemv", action="store_true", help="plan with the opt-in one-token GEMV projections")
    p.add_argument("--package-gemm", action="store_true", help="plan with the opt-in package GEMM (TP > 1)")
    p.add_argument("--ordered-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="the ordered GEMM (cuBLAS's order, checked and timed at build: the stock bits); default: "
                        "on at TP1, off at TP > 1")
    p.add_argument("--print-config", action="store_true", help="print the config's JSON first")
    return p


def _kernels(text: str) -> frozenset[str]:
    if text == "installed":
        return policy.installed_kernels()
    if text == "all":
        return policy.ALL_KERNELS
    return kernel_names(text)


def plan_config(args) -> tuple[object, DraftPlan]:
    """``(config, plan)`` of the parsed arguments; ValueError, TypeError or
    OSError for a bad config or target."""
    from dspark_core.reference.adapter import describe
    from dspark_core.reference.config import DraftConfig
    from dspark_core.reference.model import DraftModel
    from dspark_core.reference.tp import check_tp

    config = DraftConfig.from_json(args.config) if args.config is not None else DraftConfig()
    check_tp(config, args.tp)
    check_opt_in_tp(args.tp, args.gemv, args.package_gemm)
    target = policy.Target("cuda", args.arch, args.num_sms, args.tp, _kernels(args.kernels), attention=args.attention)
    ordered = policy.ordered_gemm_default(args.tp) if args.ordered_gemm is None else args.ordered_gemm
    target = target.opt_in(policy.asked_opt_ins(args.gemv, args.package_gemm, ordered))
    return config, plan_draft(describe(DraftModel(config, device="meta")), target)


def print_plan(plan: DraftPlan, out=None) -> None:
    """Print a plan (``DraftPlan.format``)."""
    print(plan.format(), file=out or sys.stdout)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    gc.disable()  # the draft's modules are long-lived: collecting while building them is wasted time
    try:
        config, plan = plan_config(args)
    except (ValueError, TypeError, OSError) as error:
        print(f"dspark-plan: error: {error}", file=sys.stderr)
        return 2
    finally:
        gc.enable()
    text = plan.format()
    if args.print_config:
        text = f"{config.to_json()}\n{text}"
    return write_out(text, "dspark-plan")


if __name__ == "__main__":
    sys.exit(main())
