"""Which all-reduce vLLM 0.33.0 runs on the draft's branch sums at TP > 1,
in what order it sums, and the binding of dspark-comm's mailbox to vLLM's
TP group where the mailbox reproduces that all-reduce bit for bit.

**The dispatch** (``CudaCommunicator.all_reduce``, read from vLLM 0.33.0's
source; the custom kernels' choice from its compiled ``_C_stable_libtorch``
and the public ``csrc/custom_all_reduce.cuh``; FlashInfer 0.7.2.post1's
kernels from the sources it ships). ``RowParallelLinear`` sums a BF16
``[rows, hidden]`` partial of ``rows * hidden * 2`` bytes; the first
backend that takes it runs:

1. FlashInfer's ``allreduce_fusion`` (``VLLM_ALLREDUCE_USE_FLASHINFER``, on
   by default): for messages up to ``FI_MAX_MB`` (per compute capability
   and TP; ``FI_MNNVL_TUNED_MB`` where the backend resolves to mnnvl). Its
   backend (``VLLM_FLASHINFER_ALLREDUCE_BACKEND``): ``auto`` on one node is
   mnnvl, falling back to trtllm where NVLink multicast is missing
   (resolved when the first all-reduce creates the workspace);
   - mnnvl (one- and two-shot alike): FP32 sums from +0.0 over ranks 0, 1,
     ... and one BF16 rounding, every -0.0 partial sent as +0.0:
     ``FP32_RANK_ORDER`` with ``positive_zero``;
   - trtllm without ``fp32_acc`` (vLLM passes none): each add rounded to
     BF16 in rank order (``BF16_RANK_ORDER``); one-shot (Lamport, while
     ``rows * hidden * 2 * tp * 2`` bytes stay within ``TRTLLM_ONESHOT_MB``)
     sends -0.0 as +0.0 (``positive_zero``); two-shot keeps the sign;
   - NCCL symmetric memory (``VLLM_USE_NCCL_SYMM_MEM``, off by default) at
     4 or more ranks outside ``NCCL_SYMM_PREFERRED``, before FlashInfer only
     where FlashInfer does not take the message: no fixed order;
2. vLLM's custom all-reduce (unless ``disable_custom_all_reduce``; at TP > 2
   only over fully NVLink-connected GPUs): messages under 8 MiB (under
   ``CUSTOM_SYMM_MAX`` where torch symmetric memory is up, which needs
   NVLink multicast and ``VLLM_ALLREDUCE_USE_SYMM_MEM``, on by default),
   16-byte multiples. Its kernel (``VLLM_CUSTOM_ALLREDUCE_ALGO`` forces
   one): at TP2 one-stage; at TP4 one-stage under 512 KiB, at TP8 under
   256 KiB, else two-stage. One-stage: every rank widens the partials of
   ranks 0, 1, ... to FP32, adds them in that order starting from rank 0's,
   rounds once (``FP32_RANK_ORDER``, the sign of a zero kept). Two-stage:
   rank ``r``'s chunk is summed starting from rank ``r`` (rotated order);
3. torch symmetric memory (where up, messages up to ``SYMM_MAX``): NVLink
   SHARP ``multimem`` reductions at the TP sizes of ``SYMM_MULTIMEM``
   (summed in the switch), PyTorch's two-shot kernel otherwise;
4. NCCL (pynccl).

At TP2 every backend adds two BF16 values with one rounding (``a + b`` is
commutative and FP32 then BF16 has no double-rounding error), so both
mailbox orders and every backend give the same bits except for the sign
of a zero sum (NaN payloads excepted everywhere); a TP2 order is written
``FP32_RANK_ORDER``.

``resolve`` answers for one message, ``decode_order`` for the draft's
decode steps of 1 to ``max_rows`` rows (the mailbox fuses the rows from 1
up to the last row count whose stock all-reduce is the same reproducible
one; rows above take vLLM's all-reduce, the row count deciding on every
rank), ``stock_all_reduce`` from the environment. Facts a CPU cannot settle
(NVLink multicast, full connectivity) are ``Topology`` inputs; unknown,
both answers are tried and only an agreement fuses.

``MailboxBoundaries`` is the executor's ``AllReduceBoundaries`` in vLLM
where the plan fuses the all-reduce (the mailbox over
``get_tp_group().cpu_group`` for the CUDA IPC handles, allocated when the
decode is built, before vLLM profiles memory; vLLM's
``tensor_model_parallel_all_reduce`` for the calls it does not take);
``runtime.all_reduce_boundaries`` picks it or ``runtime.StockAllReduce``.
This module imports nothing of the plugin's above ``dspark_vllm``'s
foundations (``deployment`` re-exports ``stock_all_reduce`` from it), so the
branch GEMM (``adapter.partial``) comes from the caller.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from dspark_core import checks
from dspark_core.contracts.constants import BF16_RANK_ORDER, FP32_RANK_ORDER, MAX_SIZE
from dspark_core.planner.policy import MAX_DECODE_ROWS, MAX_TP
from dspark_core.switches import flag
from dspark_vllm import options

log = logging.getLogger("vllm.dspark")

KiB = 1024
MiB = 1024 * KiB
# The most rows of one message ``resolve`` takes (vLLM's largest batch is far below).
MAX_MESSAGE_ROWS = 1 << 20
# The compute capability vLLM's tables key on, per kernel architecture.
CAPABILITY = {"sm_90a": "9.0", "sm_100a": "10.0"}
# vllm/compilation/passes/fusion/allreduce_rms_fusion.py FI_ALLREDUCE_FUSION_MAX_SIZE_MB (keys 90, 100).
FI_MAX_MB = {"9.0": {2: 64, 4: 2, 8: 0.5}, "10.0": {2: 64, 4: 32, 8: 1, 16: 64}}
# all_reduce_utils.FI_MNNVL_ALLREDUCE_MAX_SIZE_MB on one node: (capability, tp) -> MB.
FI_MNNVL_TUNED_MB = {("10.0", 8): 128}
# flashinfer/comm/trtllm_ar.py _use_oneshot_heuristics (MB of rows * hidden * 2 * tp * 2 bytes).
TRTLLM_ONESHOT_MB = {2: 512, 4: 64, 8: 42}
# all_reduce_utils.NCCL_SYMM_MEM_ALL_REDUCE_CONFIG: custom all-reduce preferred strictly between.
NCCL_SYMM_MIN_TP = 4
NCCL_SYMM_PREFERRED = {4: (16 * KiB, 512 * KiB), 8: (16 * KiB, 128 * KiB)}
# CustomAllreduce's default max_size, and all_reduce_utils.CUSTOM_ALL_REDUCE_MAX_SIZES (symmetric memory up).
CUSTOM_MAX_BYTES = 8 * MiB
CUSTOM_SYMM_MAX = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 8: 256 * KiB},
                   "10.0": {2: 2 * MiB, 4: 2 * MiB, 8: 1 * MiB}}
CUSTOM_TPS = (2, 4, 6, 8, 16)
# csrc/custom_all_reduce.cuh (0x7ffff / 0x3ffff in 0.33.0's binary): one-stage strictly below.
CUSTOM_ONE_STAGE_BELOW = {4: 512 * KiB, 8: 256 * KiB}
# all_reduce_utils.SYMM_MEM_ALL_REDUCE_MAX_SIZES and symm_mem.SymmMemCommunicator._WORLD_SIZES_MULTIMEM.
SYMM_MAX = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 8: 64 * MiB}, "10.0": {2: 8 * MiB, 4: 32 * MiB, 8: 128 * MiB}}
SYMM_MULTIMEM = {"9.0": (4, 6, 8), "10.0": (6, 8)}
FI_BACKENDS = ("auto", "trtllm", "mnnvl")
CUSTOM_ALGOS = {"1stage": "one-stage", "oneshot": "one-stage", "2stage": "two-stage", "twoshot": "two-stage"}
ORDER_WORDS = {FP32_RANK_ORDER: "FP32 adds in rank order from rank 0's partial, one BF16 rounding",
               BF16_RANK_ORDER: "adds in rank order, each rounded to BF16"}


@dataclass(frozen=True)
class Switches:
    """The environment switches vLLM 0.33.0 reads for its all-reduce, parsed as it parses them."""

    flashinfer: bool = True
    fi_backend: str = "auto"
    fi_pcie_ipc: bool = False
    symm_mem: bool = True
    nccl_symm_mem: bool = False
    batch_invariant: bool = False
    custom_algo: str | None = None

    def __post_init__(self) -> None:
        """Each switch a bool, ``fi_backend`` one of ``FI_BACKENDS`` and
        ``custom_algo`` None or a kernel of ``CUSTOM_ALGOS``: TypeError or
        ValueError naming the field (an unknown backend would otherwise be
        resolved as some other one)."""
        for f in dataclasses.fields(self):
            if f.type == "bool":
                flag(getattr(self, f.name), f"Switches.{f.name}")
        if self.fi_backend not in FI_BACKENDS:
            raise ValueError(f"Switches.fi_backend must be one of {', '.join(FI_BACKENDS)}, not "
                             f"{checks.shown(self.fi_backend)}")
        kernels = sorted(set(CUSTOM_ALGOS.values()))
        if self.custom_algo is not None and self.custom_algo not in kernels:
            raise ValueError(f"Switches.custom_algo must be None or one of {', '.join(kernels)}, not "
                             f"{checks.shown(self.custom_algo)}")


def _flag(env: Mapping[str, str], name: str, default: str) -> bool:
    value = env.get(name, default)
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{name} must be an integer (vLLM reads it as bool(int(...))), not {value!r}") from None


def switches(env: Mapping[str, str] | None = None) -> Switches:
    """The ``Switches`` of ``env`` (default ``os.environ``); ValueError for a
    value vLLM (or its custom all-reduce op) would refuse."""
    env = os.environ if env is None else env
    backend = env.get("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "auto")
    if backend not in FI_BACKENDS:
        raise ValueError(f"VLLM_FLASHINFER_ALLREDUCE_BACKEND must be one of {', '.join(FI_BACKENDS)}, not {backend!r}")
    algo = env.get("VLLM_CUSTOM_ALLREDUCE_ALGO")
    if algo is not None and algo not in CUSTOM_ALGOS:
        raise ValueError(f"VLLM_CUSTOM_ALLREDUCE_ALGO must be one of {', '.join(CUSTOM_ALGOS)}, not {algo!r}")
    return Switches(
        flashinfer=_flag(env, "VLLM_ALLREDUCE_USE_FLASHINFER", "1"), fi_backend=backend,
        fi_pcie_ipc=_flag(env, "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", "0"),
        symm_mem=_flag(env, "VLLM_ALLREDUCE_USE_SYMM_MEM", "1"),
        nccl_symm_mem=_flag(env, "VLLM_USE_NCCL_SYMM_MEM", "0"),
        batch_invariant=_flag(env, "VLLM_BATCH_INVARIANT", "0"),
        custom_algo=None if algo is None else CUSTOM_ALGOS[algo],
    )


@dataclass(frozen=True)
class Topology:
    """What the TP group's GPUs offer (None: not known here): ``multicast``,
    NVLink multicast usable by the group (FlashInfer's mnnvl workspace and
    vLLM's torch symmetric memory need it); ``fully_connected``, NVLink
    between every pair (vLLM's custom all-reduce at TP > 2 needs it)."""

    multicast: bool | None = None
    fully_connected: bool | None = None


@dataclass(frozen=True)
class Resolved:
    """The all-reduce vLLM runs on one message: ``backend`` and ``kernel``
    by name; ``sum_order`` (``FP32_RANK_ORDER`` / ``BF16_RANK_ORDER``, the
    mailbox's orders) or None where no mailbox order is its; whether a -0.0
    sum comes out as +0.0 (``positive_zero``); ``why`` in words."""

    backend: str
    kernel: str
    sum_order: str | None
    positive_zero: bool
    why: str

    @property
    def sums(self) -> tuple:
        """What the mailbox must match: the order and the zero sign (None: nothing it can)."""
        return None if self.sum_order is None else (self.sum_order, self.positive_zero)


def _order(tp: int, backend: str, kernel: str, order: str, positive_zero: bool, what: str) -> Resolved:
    if tp == 2:
        order = FP32_RANK_ORDER  # one rounded add of two values: both orders are the same bits
    zero = "; a -0.0 sum comes out +0.0" if positive_zero else ""
    return Resolved(backend, kernel, order, positive_zero, f"{what} ({ORDER_WORDS[order]}{zero})")


def _unfixed(backend: str, kernel: str, what: str) -> Resolved:
    return Resolved(backend, kernel, None, False, what)


def _flashinfer(tp, rows, hidden, cap, sw: Switches, multicast: bool) -> Resolved | None:
    """FlashInfer's all-reduce where it takes the message, else None."""
    if not sw.flashinfer or tp not in FI_MAX_MB.get(cap, {}):
        return None
    resolved = "mnnvl" if sw.fi_backend == "auto" else sw.fi_backend  # one node: mnnvl first
    max_bytes = int(FI_MAX_MB[cap][tp] * MiB)
    if resolved == "mnnvl" and (cap, tp) in FI_MNNVL_TUNED_MB:
        max_bytes = FI_MNNVL_TUNED_MB[cap, tp] * MiB
    backend = resolved
    if resolved == "mnnvl" and not multicast:
        if sw.fi_backend != "auto":
            return None  # an mnnvl workspace without multicast fails; FlashInfer stays off
        backend = "trtllm"
    nbytes = rows * hidden * 2
    if nbytes > max_bytes or rows > max_bytes // (hidden * 2):
        return None
    if backend == "mnnvl":
        return _order(tp, "flashinfer", "mnnvl", FP32_RANK_ORDER, True,
                      f"FlashInfer's mnnvl all-reduce ({nbytes} bytes at TP{tp})")
    if tp not in TRTLLM_ONESHOT_MB:  # FlashInfer itself raises KeyError there (its _use_oneshot_heuristics)
        return _unfixed("flashinfer", "trtllm", f"FlashInfer's trtllm all-reduce at TP{tp}, whose one-shot table "
                        f"has no threshold for {tp} ranks (it takes TP {', '.join(map(str, TRTLLM_ONESHOT_MB))})")
    if rows * hidden * 2 * tp * 2 <= TRTLLM_ONESHOT_MB[tp] * MiB:
        return _order(tp, "flashinfer", "trtllm one-shot", BF16_RANK_ORDER, True,
                      f"FlashInfer's trtllm one-shot Lamport all-reduce ({nbytes} bytes at TP{tp})")
    return _order(tp, "flashinfer", "trtllm two-shot", BF16_RANK_ORDER, False,
                  f"FlashInfer's trtllm two-shot all-reduce ({nbytes} bytes at TP{tp})")


def _custom(tp, nbytes, cap, sw: Switches, disable: bool, multicast: bool, fully_connected: bool):
    """vLLM's custom all-reduce where it takes the message, else None."""
    if disable or tp not in CUSTOM_TPS or (tp > 2 and not fully_connected):
        return None
    max_size = CUSTOM_MAX_BYTES
    if _symm_up(tp, cap, sw, multicast) and tp in CUSTOM_SYMM_MAX.get(cap, {}):
        max_size = min(CUSTOM_SYMM_MAX[cap][tp], max_size)
    if nbytes % 16 or nbytes >= max_size:
        return None
    kernel = sw.custom_algo
    if kernel is None:
        one = tp == 2 or nbytes < CUSTOM_ONE_STAGE_BELOW.get(tp, 0)
        kernel = "one-stage" if one else "two-stage"
    what = f"vLLM's custom {kernel} all-reduce ({nbytes} bytes at TP{tp})"
    if kernel == "one-stage" or tp == 2:
        return _order(tp, "custom", kernel, FP32_RANK_ORDER, False, what)
    return _unfixed("custom", kernel, f"{what}, which sums each rank's chunk starting from that rank")


def _symm_up(tp, cap, sw: Switches, multicast: bool) -> bool:
    return sw.symm_mem and multicast and tp in SYMM_MAX.get(cap, {})


def _resolve_known(tp, rows, hidden, cap, sw: Switches, disable: bool, multicast: bool,
                   fully_connected: bool) -> Resolved:
    nbytes = rows * hidden * 2
    if sw.batch_invariant:
        return _unfixed("refused", "", "VLLM_BATCH_INVARIANT=1 (the deployment check refuses batch invariance)")
    fi = _flashinfer(tp, rows, hidden, cap, sw, multicast)
    if fi is None and sw.nccl_symm_mem and tp >= NCCL_SYMM_MIN_TP:
        low, high = NCCL_SYMM_PREFERRED.get(tp, (0, 0))
        if (nbytes <= low or nbytes >= high) if tp in NCCL_SYMM_PREFERRED else tp > 8:
            return _unfixed("nccl_symm_mem", "", f"NCCL's symmetric-memory all-reduce ({nbytes} bytes at TP{tp}, "
                            "VLLM_USE_NCCL_SYMM_MEM=1), whose order NCCL chooses")
    if sw.fi_pcie_ipc:
        return _unfixed("flashinfer_pcie_ipc", "", "FlashInfer's PCIe IPC all-reduce "
                        "(VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1), whose order is not read")
    if fi is not None:
        return fi
    custom = _custom(tp, nbytes, cap, sw, disable, multicast, fully_connected)
    if custom is not None:
        return custom
    if _symm_up(tp, cap, sw, multicast) and nbytes <= SYMM_MAX[cap][tp] and nbytes % 4 == 0:
        if tp in SYMM_MULTIMEM.get(cap, ()):
            return _unfixed("torch_symm_mem", "multimem", f"torch symmetric memory's multimem all-reduce "
                            f"({nbytes} bytes at TP{tp}), summed by the NVLink switch")
        return _unfixed("torch_symm_mem", "two-shot", f"torch symmetric memory's two-shot all-reduce "
                        f"({nbytes} bytes at TP{tp}), whose zero sign is not read")
    if tp == 2:
        return _order(tp, "nccl", "", FP32_RANK_ORDER, False, f"NCCL's all-reduce ({nbytes} bytes at TP2: one add)")
    return _unfixed("nccl", "", f"NCCL's all-reduce ({nbytes} bytes at TP{tp}), whose order NCCL chooses")


def check_message(tp, rows, hidden_size, arch) -> tuple[int, int, int, str | None]:
    """``(tp, rows, hidden_size, arch)`` of one all-reduce message, checked
    (``dspark_core.checks``): the TP size an int from 1 to
    ``policy.MAX_TP`` (not a bool), the rows from 1 to ``MAX_MESSAGE_ROWS``
    and the hidden size from 1 to ``MAX_SIZE``; the architecture None (no
    GPU: no order) or, in its one spelling (``SM_90A`` is sm_90a), one these
    tables know (``CAPABILITY``: another, such as sm_80, is refused here, not
    answered). TypeError or ValueError naming the parameter."""
    checked = (checks.integer("the TP size", tp, 1, MAX_TP), checks.integer("the row count", rows, 1, MAX_MESSAGE_ROWS),
               checks.integer("the hidden size", hidden_size, 1, MAX_SIZE))
    if arch is not None:
        arch = checks.arch("the architecture arch", arch, known=False)
        if arch not in CAPABILITY:
            raise ValueError(f"the architecture arch must be None or one of {', '.join(CAPABILITY)} (vLLM's "
                             f"all-reduce tables as read here), not {arch}")
    return (*checked, arch)


def resolve(tp: int, rows: int, hidden_size: int, arch: str | None, sw: Switches | None = None,
            disable_custom_all_reduce: bool = False, topology: Topology = Topology()) -> Resolved:
    """The all-reduce vLLM 0.33.0 runs on one BF16 ``[rows, hidden_size]``
    message at TP ``tp`` on ``arch`` (module docstring). A ``topology``
    fact that is None is tried both ways; where the answers differ, the
    result has no order and ``why`` names the fact. The inputs are checked
    first (``check_message``)."""
    tp, rows, hidden_size, arch = check_message(tp, rows, hidden_size, arch)
    if tp == 1:
        return Resolved("none", "", FP32_RANK_ORDER, False, "TP1 has no all-reduce")
    if arch is None:
        return _unfixed("none", "", f"no GPU the kernels are compiled for ({arch})")
    sw = switches() if sw is None else sw
    facts = {name: [value] if value is not None else [True, False]
             for name, value in (("multicast", topology.multicast), ("fully_connected", topology.fully_connected))}
    answers = {(m, f): _resolve_known(tp, rows, hidden_size, CAPABILITY[arch], sw, disable_custom_all_reduce, m, f)
               for m, f in itertools.product(facts["multicast"], facts["fully_connected"])}
    first = next(iter(answers.values()))
    if len({a.sums for a in answers.values()}) == 1:
        return first  # the same bits whichever the facts (the backends may differ)
    unknown = [n.replace("_", " ") for n, v in facts.items() if len(v) > 1]
    options = "; ".join(f"with {'NVLink multicast' if m else 'no multicast'} and "
                        f"{'full' if f else 'partial'} connectivity: {a.why}" for (m, f), a in answers.items())
    return _unfixed("unknown", "", f"not known here: it depends on the GPUs' {' and '.join(unknown)} ({options})")


@dataclass(frozen=True)
class AllReduceOrder:
    """vLLM's all-reduce over the draft's decode steps (``decode_order``):
    ``backend`` of its one-row message; ``sum_order`` and ``positive_zero``
    the mailbox reproduces for steps of 1 to ``rows`` rows (None and 0
    where not even one row); ``why`` in words, with the reason the rows
    above ``rows`` stay stock; ``inputs`` to re-resolve for another hidden
    size (``for_hidden``)."""

    backend: str
    sum_order: str | None
    why: str
    positive_zero: bool = False
    rows: int = 0
    hidden_size: int | None = None
    inputs: tuple | None = None
    kernel: str = ""

    def for_hidden(self, hidden_size: int) -> AllReduceOrder:
        """The same deployment's order for a draft of ``hidden_size`` columns."""
        if self.inputs is None or hidden_size == self.hidden_size:
            return self
        return decode_order(*self.inputs[:2], hidden_size, *self.inputs[2:])

    def describe(self) -> str:
        """The stock all-reduce the fused one reproduces, in words (for the plan)."""
        zero = ", a -0.0 sum as +0.0" if self.positive_zero else ""
        name = f"{self.backend} {self.kernel}".strip()
        return f"vLLM's {name} all-reduce: {ORDER_WORDS.get(self.sum_order, '')}{zero}; steps of 1-{self.rows} rows"


# A draft width for orders asked without one (the reference draft's); plans re-resolve with their draft's.
DEFAULT_HIDDEN = 8192


def decode_order(tp: int, arch: str | None, hidden_size: int | None = None, max_rows: int = MAX_DECODE_ROWS,
                 sw: Switches | None = None, disable_custom_all_reduce: bool = False,
                 topology: Topology = Topology()) -> AllReduceOrder:
    """The order the mailbox must reproduce for decode steps of 1 to
    ``max_rows`` rows of ``hidden_size`` columns (module docstring): the
    one of one row, fused up to the last row count before the first that
    resolves otherwise. The row count alone decides, the same on every rank.
    ``max_rows``: an int from 1 to ``MAX_DECODE_ROWS`` (the mailbox's rows;
    each is resolved); ``arch`` as ``check_message`` takes it (checked first)."""
    check_message(1, 1, 1, arch)
    checks.integer("max_rows (the decode rows the mailbox takes)", max_rows, 1, MAX_DECODE_ROWS)
    sw = switches() if sw is None else sw
    h = DEFAULT_HIDDEN if hidden_size is None else hidden_size
    inputs = (tp, arch, max_rows, sw, disable_custom_all_reduce, topology)
    first = resolve(tp, 1, h, arch, sw, disable_custom_all_reduce, topology)
    if tp == 1 or first.sums is None:
        why = first.why if tp == 1 else f"vLLM's all-reduce at TP{tp} is {first.why}"
        return AllReduceOrder(first.backend, first.sum_order, why, first.positive_zero, 0, hidden_size, inputs,
                              first.kernel)
    rows, above = 1, None
    for m in range(2, max_rows + 1):
        r = resolve(tp, m, h, arch, sw, disable_custom_all_reduce, topology)
        if r.sums != first.sums:
            above = f"steps of {m} rows and more take vLLM's all-reduce: there it is {r.why}"
            break
        rows = m
    why = f"vLLM's all-reduce at TP{tp} is {first.why}" + (f"; {above}" if above else "")
    return AllReduceOrder(first.backend, first.sum_order, why, first.positive_zero, rows, hidden_size, inputs,
                          first.kernel)


def stock_all_reduce(tp: int, arch: str | None, disable_custom_all_reduce: bool = False,
                     env: Mapping[str, str] | None = None, hidden_size: int | None = None,
                     max_rows: int = MAX_DECODE_ROWS, topology: Topology | None = None) -> AllReduceOrder:
    """``decode_order`` from the environment switches (``env``, default
    ``os.environ``). ``topology`` None: vLLM's live communicator's facts
    where a vLLM TP group of ``tp`` ranks exists here (``live_topology``),
    else unknown. ``tp`` is checked first (``check_message``'s rule)."""
    if topology is None:
        topology = live_topology(checks.integer("the TP size", tp, 1, MAX_TP))
    return decode_order(tp, arch, hidden_size, max_rows, switches(env), disable_custom_all_reduce, topology)


def live_topology(tp: int) -> Topology:
    """The facts vLLM's TP communicator settled at start-up (collectively,
    so the same on every rank): multicast where its torch symmetric memory
    came up (its rendezvous needs a multicast address), full connectivity
    as its custom all-reduce found it. Unknown outside such a group."""
    try:
        from vllm.distributed import get_tp_group
        from vllm.distributed.parallel_state import model_parallel_is_initialized

        if tp < 2 or not model_parallel_is_initialized() or get_tp_group().world_size != tp:
            return Topology()
        comm = get_tp_group().device_communicator
    except (ImportError, AssertionError):
        return Topology()
    symm = getattr(comm, "symm_mem_comm", None)
    ca = getattr(comm, "ca_comm", None)
    multicast = None if symm is None else not symm.disabled
    fully = getattr(ca, "fully_connected", None) if ca is not None and not ca.disabled else None
    return Topology(multicast, fully)


def package_gemm_asked(vllm_config) -> bool:
    """Whether ``additional_config["package_gemm"]`` opts in to the package
    GEMM (the branch GEMM publishing each rank's partial into the mailbox:
    its own summation order, so the draft follows the stock tokens but not
    its bits). TypeError for anything but a bool; near misses of the key
    said once (``options.switch``)."""
    return options.switch(vllm_config, options.PACKAGE_GEMM)


class MailboxBoundaries:
    """The executor's ``AllReduceBoundaries`` at TP > 1 where the plan fuses
    the all-reduce: dspark-comm's ``DraftAllReduce`` over a mailbox of
    ``order.rows`` rows on vLLM's TP group, summing in the plan's order with
    ``order.positive_zero``.

    Built from ``SpecializedDecode.build`` (collective: every TP rank, after
    the weights load, before memory profiling and graph capture): the ranks
    first agree on the order, its rows and the zero sign (all-gathered over
    ``get_tp_group().cpu_group``; ValueError on every rank where any
    differs), then allocate the mailbox (its CUDA IPC handles exchanged over
    the same group). ``takes(partial)``: the row count alone, ``1 <= rows <=
    order.rows``; ``all_reduce`` (the calls it does not take) is vLLM's
    ``tensor_model_parallel_all_reduce``; ``project`` is the layer's
    RowParallelLinear GEMM, or the package GEMM where the plan runs one
    (``package_gemm_asked``); ``takes`` also compares, on host state
    alone, FlashInfer's workspace (once vLLM's first all-reduces created it)
    with the order's backend (``check_backend``); the stand-ins of the tests replace
    ``group``, ``mailbox``, ``reduce``, ``boundary`` and ``gemm``;
    ``branch_gemm(linear, x)`` is the layer's GEMM without its all-reduce
    (the plugin passes ``adapter.partial``). ``check()`` (outside CUDA graphs: it
    synchronizes) raises ``MailboxTimeoutError`` where a kernel gave up on a
    peer, and RuntimeError where FlashInfer's workspace, once vLLM created
    it, is not the backend the order was resolved for; ``poll()`` raises the
    same timeout from an earlier asynchronous copy of the mailbox's status,
    never waiting (``SpecializedDecode`` calls ``check()`` once the build's
    collective agreement passed, ``poll()`` on every call it takes outside
    a graph capture). ``close()`` is collective."""

    def __init__(self, model, draft, plan, order: AllReduceOrder, *, branch_gemm, package_gemm: bool = False,
                 group=None, mailbox=None, reduce=None, boundary=None, gemm=None) -> None:
        from dspark_comm.draft import DraftAllReduce

        if order.sum_order is None or order.rows < 1:
            raise ValueError(f"no mailbox for an all-reduce it does not reproduce: {order.why}")
        part = plan.all_reduce
        if part is None or not part.fused or part.constants.sum_order != order.sum_order:
            raise ValueError(f"the plan's all-reduce ({part}) is not the fused {order.sum_order} of the order")
        if group is None:
            from vllm.distributed import get_tp_group

            from dspark_comm import TorchGroup

            group = TorchGroup(get_tp_group().cpu_group, device=draft.device)
        if group.size != draft.tp:
            raise ValueError(f"a TP{draft.tp} draft over a group of {group.size} ranks")
        mine = (order.backend, order.sum_order, order.positive_zero, order.rows, draft.hidden_size, package_gemm)
        seen = group.all_gather_object(mine)
        if any(s != mine for s in seen):
            raise ValueError(f"the TP ranks resolved different all-reduces (backend, order, -0.0 as +0.0, rows, "
                             f"hidden size, package GEMM): {seen}")
        if mailbox is None:
            from dspark_comm import Mailbox

            mailbox = Mailbox(group, draft.hidden_size, order.rows)
        if reduce is None:
            from vllm.distributed import tensor_model_parallel_all_reduce as reduce
        self.tp, self.order, self.group, self.mailbox = draft.tp, order, group, mailbox
        self._reduce, self._branch_gemm = reduce, branch_gemm
        self._logged: set[int] = set()
        self._backend_known = False
        self._linears = [linear for layer in model.layers
                         for linear in (layer.self_attn.o_proj, layer.feed_forward.down_proj)]
        extra = {k: v for k, v in (("boundary", boundary), ("gemm", gemm)) if v is not None}
        self.inner = DraftAllReduce(mailbox, plan, draft, group.rank, package_gemm=package_gemm,
                                    positive_zero=order.positive_zero, **extra)

    def takes(self, partial) -> bool:
        if not self._backend_known:  # the first calls after vLLM's own all-reduces created FlashInfer's workspace
            self._backend_known = self.check_backend()
        if self.inner.takes(partial):
            return True
        rows = int(partial.shape[0])
        if rows not in self._logged:
            self._logged.add(rows)
            above = self.order.why.partition("; steps of ")[2]
            log.info("A DSpark draft step of %d rows takes vLLM's all-reduce, then the boundary: the mailbox "
                     "reproduces vLLM's all-reduce for 1 to %d rows%s.", rows, self.order.rows,
                     f" (steps of {above})" if above else "")
        return False

    def all_reduce(self, partial):
        return self._reduce(partial)

    def project(self, index: int, x, weight) -> tuple:
        if self.inner.gemms[index] is not None and self.inner.takes(x):
            return self.inner.project(index, x, weight)
        return self._branch_gemm(self._linears[index], x), False

    def run(self, index: int, partial, stream, store_stream: bool, published: bool = False):
        return self.inner.run(index, partial, stream, store_stream, published)

    def prepare(self, failed: BaseException | None = None) -> None:
        self.inner.prepare(failed)

    def check(self) -> None:
        self.mailbox.check()
        self.check_backend()

    def poll(self) -> None:
        """``check()`` without waiting for the device (``Mailbox.poll``: a
        kernel that gave up shows a few calls later); nothing during a CUDA
        graph capture."""
        self.mailbox.poll()

    def check_backend(self) -> bool:
        """Host state only: RuntimeError where vLLM created FlashInfer's
        workspace for another backend than the order's; True once it is
        known to be the order's (or the order is not FlashInfer's)."""
        if self.order.backend != "flashinfer":
            return True
        from vllm.distributed.device_communicators import flashinfer_all_reduce as fi

        workspace = fi._fi_ar_workspace
        kernel = self.order.kernel.split(" ")[0]  # mnnvl, trtllm
        if workspace is None and fi._fi_ar_workspace_failed:
            raise RuntimeError(f"the DSpark mailbox reproduces FlashInfer's {kernel} all-reduce, but vLLM could not "
                               "create FlashInfer's workspace and runs its next all-reduce backend: restart with "
                               "VLLM_ALLREDUCE_USE_FLASHINFER=0 (or without decode_backend=latency_specialized)")
        if workspace is None:
            return False
        built = getattr(workspace, "backend", None)
        if built != kernel and not self._same_sums(built):
            raise RuntimeError(f"the DSpark mailbox reproduces FlashInfer's {kernel} all-reduce, but vLLM created "
                               f"its {built} workspace: set VLLM_FLASHINFER_ALLREDUCE_BACKEND={built} and restart")
        return True

    def _same_sums(self, backend) -> bool:
        """Whether FlashInfer's ``backend`` sums the order's rows as the
        order's kernel does (at TP2 mnnvl and the trtllm one-shot kernel do)."""
        if backend not in FI_BACKENDS or self.order.inputs is None:
            return False
        tp, arch, max_rows, sw, disable, topology = self.order.inputs
        alt = decode_order(tp, arch, self.order.hidden_size, max_rows, dataclasses.replace(sw, fi_backend=backend),
                           disable, Topology(backend == "mnnvl", topology.fully_connected))
        o = self.order
        return (alt.sum_order, alt.positive_zero, alt.rows) == (o.sum_order, o.positive_zero, o.rows)

    def close(self) -> None:
        self.mailbox.close()


__all__ = ["AllReduceOrder", "CAPABILITY", "MailboxBoundaries", "Resolved", "Switches", "Topology",
           "decode_order", "live_topology", "package_gemm_asked", "resolve", "stock_all_reduce",
           "switches"]
