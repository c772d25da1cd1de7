"""Issue 35's target, measured: a fresh, seeded set of bad inputs of the
issue's classes, thrown at the four packages' public entries (the API, the
planner's command line, ``python -m dspark_vllm.plan`` where vLLM is
installed, the demo's), each outcome classified:

- ``clear``: refused where it enters: a ValueError or TypeError (the
  project's ``Unsupported`` is one) whose message names the parameter or
  what was expected (cut below 2,000 characters), or the system's OSError
  naming the file for a path that does not exist; a command line's exit
  code 2 with an error line and no traceback; a plan that keeps the part
  stock with the reason; a warning in the log where the issue asks for one
  (a non-mapping ``additional_config``, a near-miss key);
- ``unclear``: another exception, or a message naming nothing of it;
- ``wrong``: taken where it should not be (a plan line that says fused for
  what the build refuses is one);
- ``traceback``: a command line that ended in an exception (or a worker
  that died);
- ``hang``: no outcome within the per-case timeout.

    python scripts/bad_inputs.py [--seed N] [--count N] [--timeout S] [--show wrong,unclear,...]

The cases are drawn with ``random.Random(seed)`` (the seed is printed; the
default is a fresh one), round robin over the families of ``FAMILIES`` (so
any count of at least their number covers each), and run one at a time in a
forked worker process that is replaced after a hang. The entries' lists are
the property tests' (``packages/dspark-vllm/tests/test_entry_properties.py``:
``ENTRIES``, what each parameter takes, the words naming it, ``run_cli``)
and the limit test's host-class checks (``tests/test_limits.py``). Prints the
seed, a table per class and the total; exits 0 (the measurement is the
output; ``tests/test_bad_inputs.py`` asserts on it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import multiprocessing
import random
import sys
import time
from collections import Counter
from pathlib import Path

# The families' package beside this script (an import of the script by path finds it too).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bad_input_families.cli import (  # noqa: E402
    fam_cli_demo,
    fam_cli_planner,
    fam_cli_vllm_plan,
    fam_silent_unicode_cli,
)
from bad_input_families.common import CLASSES, OUTCOMES, Case, Result, _short, has_vllm  # noqa: E402
from bad_input_families.contracts import (  # noqa: E402
    fam_config_fp32,
    fam_d2t_host,
    fam_d2t_spec,
    fam_entry_fp32,
    fam_index_tokens_slots,
    fam_markov_fp32,
    fam_plan_config,
    fam_plan_markov_contract,
    fam_plan_markov_vllm,
    fam_plan_vllm_cli,
    fam_spec_empty_rows,
    fam_spec_layers,
)
from bad_input_families.silent import (  # noqa: E402
    fam_silent_additional_config,
    fam_silent_allreduce,
    fam_silent_bool_int,
    fam_silent_cache_path,
    fam_silent_config_path,
    fam_silent_dtype,
    fam_silent_duplicate_keys,
    fam_silent_huge,
    fam_silent_huge_int,
    fam_unclear_arch,
    fam_unclear_markov_bias_sample_operands,
    fam_unclear_markov_loop_operands,
    fam_unclear_objects,
    fam_unclear_special_file,
    fam_unclear_tp_table,
    fam_unclear_types,
    fam_unclear_unknown_keys,
)

FAMILIES = [
    ("plan", fam_plan_markov_contract, False), ("plan", fam_plan_markov_vllm, True), ("plan", fam_plan_config, False),
    ("plan", fam_plan_vllm_cli, True),
    ("fp32", fam_entry_fp32, False), ("fp32", fam_config_fp32, False), ("fp32", fam_markov_fp32, False),
    ("index", fam_d2t_host, False), ("index", fam_d2t_spec, False), ("index", fam_index_tokens_slots, False),
    ("spec", fam_spec_layers, False), ("spec", fam_spec_empty_rows, False),
    ("silent", fam_silent_huge, False), ("silent", fam_silent_cache_path, False),
    ("silent", fam_silent_config_path, False), ("silent", fam_silent_additional_config, False),
    ("silent", fam_silent_duplicate_keys, False), ("silent", fam_silent_dtype, False),
    ("silent", fam_silent_bool_int, False), ("silent", fam_silent_huge_int, False),
    ("silent", fam_silent_allreduce, False), ("silent", fam_silent_unicode_cli, False),
    ("unclear", fam_unclear_types, False), ("unclear", fam_unclear_arch, False),
    ("unclear", fam_unclear_markov_loop_operands, False),
    ("unclear", fam_unclear_markov_bias_sample_operands, False),
    ("unclear", fam_unclear_objects, False),
    ("unclear", fam_unclear_special_file, False), ("unclear", fam_unclear_unknown_keys, False),
    ("unclear", fam_unclear_tp_table, False),
    ("cli", fam_cli_planner, False), ("cli", fam_cli_demo, False), ("cli", fam_cli_vllm_plan, True),
]


def generate(seed: int, count: int, vllm: bool | None = None) -> list[Case]:
    """``count`` cases drawn with ``seed``, round robin over ``FAMILIES``
    (those needing vLLM only where it is installed, or where ``vllm``)."""
    vllm = has_vllm() if vllm is None else vllm
    families = [f for f in FAMILIES if vllm or not f[2]]
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        cls, family, _ = families[i % len(families)]
        case = family(rng)
        assert case.cls == cls, (family.__name__, case.cls)
        cases.append(case)
    return cases


# -- the runner: one case at a time in a forked worker, replaced after a hang ----


def _worker(cases: list[Case], conn) -> None:
    torch.set_num_threads(1)
    from dspark_core import demo

    # The demo's run is stubbed: a case that reaches it was taken (and is wrong), not run for minutes.
    demo.run_demo = lambda *args: None
    demo._run_tp = lambda *args: None
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("vllm.dspark").setLevel(logging.WARNING)
    while True:
        index = conn.recv()
        if index is None:
            return
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                outcome, detail = cases[index].run()
        except BaseException as error:  # noqa: BLE001 (a case that escaped its own classification)
            outcome, detail = "unclear", f"{type(error).__name__}: {_short(str(error))}"
        conn.send((outcome, detail))


def run_cases(cases: list[Case], timeout: float = 60.0, progress=None) -> list[Result]:
    """Each case's ``Result``, run one at a time in a forked worker: a case
    with no outcome in ``timeout`` seconds is a hang (the worker killed and
    replaced), a worker that dies a traceback. ``progress(result)`` after
    each, where given."""
    ctx = multiprocessing.get_context("fork")
    results: list[Result] = []
    worker = conn = None
    for index, case in enumerate(cases):
        if worker is None:
            conn, child = ctx.Pipe()
            worker = ctx.Process(target=_worker, args=(cases, child), daemon=True)
            worker.start()
            child.close()
        start = time.monotonic()
        conn.send(index)
        if conn.poll(timeout):
            try:
                outcome, detail = conn.recv()
            except EOFError:
                worker.join(5)
                outcome, detail = "traceback", f"the worker died (exit code {worker.exitcode})"
                worker = None
        else:
            outcome, detail = "hang", f"no outcome in {timeout:g} s"
        if outcome in ("hang",) or (worker is not None and not worker.is_alive()):
            worker.kill()
            worker.join()
            worker = None
        results.append(Result(case, outcome, detail, time.monotonic() - start))
        if progress is not None:
            progress(results[-1])
    if worker is not None:
        conn.send(None)
        worker.join(10)
    return results


# -- the report ----------------------------------------------------------------


def table(results: list[Result]) -> str:
    counts = {cls: Counter() for cls in CLASSES}
    for r in results:
        counts[r.case.cls][r.outcome] += 1
    total = Counter()
    rows = [f"| class | cases | {' | '.join(OUTCOMES)} | % clear |", "|---|---:|" + "---:|" * (len(OUTCOMES) + 1)]
    for cls, title in CLASSES.items():
        c = counts[cls]
        n = sum(c.values())
        total.update(c)
        if n:
            rows.append(f"| {title} | {n} | {' | '.join(str(c[o]) for o in OUTCOMES)} | {100 * c['clear'] / n:.1f} |")
    n = sum(total.values())
    rows.append(f"| **total** | {n} | {' | '.join(str(total[o]) for o in OUTCOMES)} | "
                f"{100 * total['clear'] / max(n, 1):.1f} |")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="the draw's seed (default: a fresh one, printed)")
    p.add_argument("--count", type=int, default=360, help="how many cases (default 360)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it is a hang")
    p.add_argument("--show", default="unclear,wrong,traceback,hang",
                   help="the outcomes whose cases are listed (comma-separated; 'none' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    vllm = has_vllm()
    print(f"seed {seed}; {args.count} cases; vLLM {'installed' if vllm else 'not installed (its cases left out)'}")
    if vllm:
        import vllm  # noqa: F401 (imported before the worker forks: once, not per worker)

        import dspark_vllm.plan  # noqa: F401
    cases = generate(seed, args.count, vllm)
    start = time.monotonic()
    results = run_cases(cases, args.timeout)
    print(f"ran in {time.monotonic() - start:.0f} s\n")
    print(table(results))
    show = set() if args.show == "none" else set(args.show.split(","))
    listed = [r for r in results if r.outcome in show]
    if listed:
        print()
    for r in listed:
        print(f"- {r.outcome} [{CLASSES[r.case.cls]}] {r.case.label}: {r.detail}")
    return 0


__all__ = ["CLASSES", "FAMILIES", "OUTCOMES", "Case", "Result", "generate", "run_cases", "table"]

if __name__ == "__main__":
    sys.exit(main())
