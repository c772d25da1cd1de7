"""``scripts/bad_inputs.py``'s families of silent accepts and unclear refusals."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import test_entry_properties as props
import torch

from bad_input_families.common import (
    HOME,
    Case,
    _draw_refused,
    _entries,
    _entry_case,
    _garbled_arch,
    _scratch,
    _short,
    captured_log,
    refusal,
    refused,
    run_cli,
)
from dspark_core import checks, switches
from dspark_core.contracts import markov as KM
from dspark_core.planner import policy
from dspark_core.reference.config import MAX_LAYERS, DraftConfig, small_config


def _huge_change(rng) -> dict:
    """Sizes below 2^31 whose layer weights no GPU holds (an independent count: above 400 GB in BF16)."""
    kind = rng.choice(["hidden", "heads", "layers", "intermediate"])
    c = {"hidden_size": 2048, "num_layers": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
         "intermediate_size": 1024}
    if kind == "hidden":
        c["hidden_size"] = 2048 * rng.randint(2**12, 2**20 - 1)
        c["intermediate_size"] = 8 * rng.randint(2**9, 2**12)
    elif kind == "heads":
        c["num_heads"] = c["num_kv_heads"] = 2 ** rng.randint(16, 20)
    elif kind == "layers":
        c["num_layers"], c["intermediate_size"] = rng.randint(300, MAX_LAYERS), 8 * rng.randint(2**14, 2**18)
    else:
        c["intermediate_size"] = 8 * rng.randint(2**24, 2**27)

    def weight_bytes(c) -> int:
        q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
        per_layer = c["hidden_size"] * (2 * q + 2 * kv + q) + 3 * c["hidden_size"] * c["intermediate_size"]
        return 2 * c["num_layers"] * per_layer

    while weight_bytes(c) < 4e11:
        c["num_layers"] = min(MAX_LAYERS, 2 * c["num_layers"])
        c["intermediate_size"] *= 2
    return c


def fam_silent_huge(rng):
    change = _huge_change(rng)

    def run():
        from dspark_core.planner.plan import plan_draft
        from dspark_core.reference.adapter import describe
        from dspark_core.reference.model import DraftModel

        try:
            config = small_config(**change)
            plan = plan_draft(describe(DraftModel(config, device="meta")), policy.Target(kernels=policy.ALL_KERNELS))
        except Exception as error:  # noqa: BLE001
            return refusal(error, list(change))
        if plan.fused_count()[0]:
            return "wrong", f"{plan.fused_count()[0]} parts planned fused"
        return "clear", _short(plan.draft_reason or plan.refused()[0])

    return Case("silent", f"plan_draft of a draft no GPU holds: {change}", run)


def fam_silent_cache_path(rng):
    """DSPARK_KERNEL_CACHE naming the home directory or one above it, spelled with doubled slashes, dots,
    trailing slashes."""
    parts = [p for p in HOME.split("/") if p]
    depth = rng.randint(0, len(parts))
    pieces = parts[:depth]
    sep = lambda: rng.choice(["/", "//", "///", "/./", "/.//"])  # noqa: E731
    text = sep() + sep().join(pieces) if pieces else sep()
    if rng.random() < 0.5:
        text += rng.choice(["/", "//", "/.", "/./", "/x/..", "/x/../", "//x//..//"])
    if depth == len(parts) and rng.random() < 0.4:
        text = "~" + rng.choice(["/", "//", "/.", "/./", "//.//", "/x/.."])
    env = {"DSPARK_KERNEL_CACHE": text}
    return Case("silent", f"DSPARK_KERNEL_CACHE={text!r}",
                lambda: refused(lambda: switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d/k"), env),
                                ["DSPARK_KERNEL_CACHE"]))


def fam_silent_config_path(rng):
    """A config path that is empty, ends in a slash (a file's or a folder's) or doubles its slashes into a
    folder."""
    kind = rng.choice(["empty", "a file with a trailing slash", "a folder with a trailing slash", "a folder"])
    how = rng.choice(["DraftConfig.from_json", "read_json_object"])

    def run():
        from dspark_core.reference.config import read_json_object

        with _scratch() as tmp:
            (tmp / "c.json").write_text(small_config().to_json())
            (tmp / "d").mkdir()
            path = {"empty": "", "a file with a trailing slash": f"{tmp}/c.json/",
                    "a folder with a trailing slash": f"{tmp}//d/", "a folder": f"{tmp}//d"}[kind]
            call = (lambda: DraftConfig.from_json(path)) if how == "DraftConfig.from_json" else \
                (lambda: read_json_object(path, "a draft config"))
            return refused(call, ["path", "directory", "JSON file", "regular file", "config"])

    return Case("silent", f"{how}: {kind}", run)


class _Extra:
    def __init__(self, extra):
        self.additional_config = extra


def fam_silent_additional_config(rng):
    """``additional_config`` that is no mapping, or a key that misses one DSpark reads: said in the log."""
    from dspark_vllm import options

    if rng.random() < 0.5:
        extra = rng.choice([["decode_backend"], "latency_specialized", 7, ("ordered_gemm", True), b"{}", 1.5,
                            [("decode_backend", "auto")]])
        words, label = ["additional_config"], f"additional_config={extra!r}"
    else:
        key = rng.choice(options.KEYS)
        miss = rng.choice([key.upper(), key.replace("_", "-"), f" {key}", f"{key} ", key[:-1], key + "s",
                           key.title(), key.replace("_", ""), key[0].upper() + key[1:]])
        extra, words, label = {miss: rng.choice([True, "auto"])}, [repr(miss), miss], f"the key {miss!r}"
    # (a near miss is said where the key it misses is read)
    read = rng.choice(options.KEYS) if isinstance(extra, (list, str, int, tuple, bytes, float)) else key

    def run():
        options._said.clear()  # each case says it afresh
        with captured_log("vllm.dspark") as said:
            try:
                if read == options.DECODE_BACKEND:
                    options.read(_Extra(extra), read, "auto")
                else:
                    options.switch(_Extra(extra), read)
            except Exception as error:  # noqa: BLE001 (a refusal naming it is clear too)
                return refusal(error, words)
        hits = [m for m in said if any(w in m for w in words)]
        return ("clear", _short(hits[0])) if hits else ("wrong", "read without a word")

    return Case("silent", f"options.read({read!r}) with {label}", run)


def fam_silent_duplicate_keys(rng):
    base = json.loads(small_config().to_json())
    key = rng.choice(sorted(base))
    other = rng.choice([base[key], 1, "x", None, [1], {"a": 1}])
    fields = [f'"{k}": {json.dumps(v)}' for k, v in base.items()]
    at = rng.randrange(len(fields) + 1)
    fields.insert(at, f'"{key}": {json.dumps(other)}')
    text = "{" + ", ".join(fields) + "}"
    how = rng.choice(["DraftConfig.from_json", "dspark-plan"])

    def run():
        with _scratch() as tmp:
            path = tmp / "dup.json"
            path.write_text(text)
            if how == "dspark-plan":
                from dspark_core.planner import cli

                return run_cli(cli.main, [str(path)])
            return refused(lambda: DraftConfig.from_json(str(path)), [repr(key), "repeats"])

    return Case("silent", f"{how}: the key {key!r} twice", run)


def fam_silent_dtype(rng):
    """Inputs of a dtype a layer would cast (integers, FP64), or slots that are no integers."""
    from dspark_core.spec import layers as L

    dtype = rng.choice([torch.int32, torch.int64, torch.float64, torch.int8, torch.uint8, torch.bool,
                        torch.complex64])
    kind = rng.choice(["RMSNorm", "HeadNorm rows", "silu_and_mul", "insert K", "insert slots", "GatedResidual"])
    m, half = rng.randint(1, 4), rng.choice([0.0, 0.5])

    def run():
        x = torch.ones(m, 2048).to(dtype)
        if kind == "RMSNorm":
            return refused(lambda: L.RMSNorm(2048)(x), ["input", "norm"])
        if kind == "HeadNorm rows":
            return refused(lambda: L.qk_norm_rope(torch.ones(m, 2, 64).to(dtype), L.HeadNorm(64)),
                           ["input", "heads", "rows", "norm"])
        if kind == "silu_and_mul":
            return refused(lambda: L.silu_and_mul(torch.ones(m, 16).to(dtype), 8), ["gate-up", "rows", "activation"])
        if kind == "GatedResidual":
            return refused(lambda: L.GatedResidual(2048)(x, x), ["stream", "branch", "residual"])
        cache = L.PagedKVCache(2, 1, 16, 64)
        k = torch.zeros(m, 1, 64, dtype=torch.bfloat16)
        if kind == "insert K":
            return refused(lambda: cache.insert(k.to(dtype), k, torch.arange(m)), ["K", "inserted K"])
        slots = torch.arange(m).to(dtype) if dtype != torch.bool else torch.ones(m, dtype=torch.bool)
        if dtype in (torch.int32, torch.int64, torch.int8, torch.uint8):
            slots = torch.arange(m, dtype=torch.float32) + half
        return refused(lambda: cache.insert(k, k, slots), ["slots"])

    return Case("silent", f"{kind} given {dtype}", run)


def fam_silent_bool_int(rng):
    pairs = _entries(props.Int)

    def draw(rng, p):
        return rng.choice([True, False, np.bool_(True), np.bool_(False)])

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("silent", entry, param, value, "a bool as an int")


def fam_silent_huge_int(rng):
    pairs = _entries(props.Int, lambda p: p.high is not None)

    def draw(rng, p):
        v = p.high + 1 + rng.randrange(10**rng.randint(0, 18))
        return np.int64(v) if rng.random() < 0.2 and v < 2**63 else v

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("silent", entry, param, value, "beyond what it takes")


def fam_silent_allreduce(rng):
    from dspark_vllm import allreduce

    kind = rng.choice(["tp", "rows", "backend"])
    if kind == "backend":
        var = rng.choice(["VLLM_FLASHINFER_ALLREDUCE_BACKEND", "VLLM_CUSTOM_ALLREDUCE_ALGO"])
        value = rng.choice(["nccl", "MNNVL", " auto", "trtllm ", "", "1stage ", "ONESHOT", "custom", "3stage"])
        return Case("silent", f"all-reduce switches: {var}={value!r}",
                    lambda: refused(lambda: allreduce.switches({var: value}), [var]))
    value = rng.choice([True, False, 10**6 + rng.randrange(10**9), 0, -rng.randint(1, 10**6), 2.0]) if kind == "tp" \
        else rng.choice([0, -rng.randint(1, 10**6), allreduce.MAX_MESSAGE_ROWS + rng.randint(1, 10**8), True, 4.0])
    kwargs = {"tp": 2, "rows": 4, "hidden_size": 8192, "arch": "sm_90a", kind: value}
    return Case("silent", f"allreduce.resolve({kind}={value!r})",
                lambda: refused(lambda: allreduce.resolve(**kwargs), ["TP size", "tp", "row count", "rows"]))


def fam_unclear_types(rng):
    """Values of another type than a parameter takes: the refusal must name it where it enters."""
    pairs = [(e, p) for e in props.ENTRIES for p in e.params]

    def draw(rng, p):
        return rng.choice([None, "8", "", "٣", [8], (8,), {"x": 1}, object(), b"8", 8j, torch.bfloat16,
                           np.array([1, 2]), math.nan, Path("/"), slice(1), "x" * rng.randint(100, 100000)])

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("unclear", entry, param, value, "a value of another type")


def fam_unclear_arch(rng):
    from dspark_core.contracts import constants as K

    text = _garbled_arch(rng)
    calls = {
        "checks.arch": lambda: checks.arch("arch", text),
        "Target": lambda: policy.Target(arch=text),
        "NormConstants": lambda: K.NormConstants(1e-6, "bf16", 0.0, False, text),
        "o-gate constants (OGateConstants)": lambda: K.OGateConstants(8, 1e-6, text),
    }
    # A target of another well-formed architecture (sm_80) is planned all stock, by design: only
    # malformed names are bad there.
    well_formed = bool(re.fullmatch(r"sm_\d+a?", text.strip().lower()))
    name = rng.choice([n for n in sorted(calls) if not (well_formed and n == "Target")])
    return Case("unclear", f"{name}: the architecture {text!r}",
                lambda: refused(calls[name], ["arch", "architecture", "stock norm tree", "stock o-gate"]))


def fam_unclear_objects(rng):
    """An object of another kind where an entry takes a draft, a config, a tensor or constants."""
    from dspark_core.planner.plan import plan_draft
    from dspark_core.reference.adapter import describe
    from dspark_core.reference.config import read_json_object
    from dspark_core.reference.model import DraftModel, StepInputs
    from dspark_core.runtime.build import build_draft_decode
    from dspark_core.spec import layers as L
    from dspark_core.spec import markov as SM
    from dspark_core.spec.attention import paged_attention

    value = rng.choice([None, "x", 5, 2.5, [1, 2], np.zeros(4, dtype=np.float32), {}, b"x", object()])
    i64 = torch.zeros(2, dtype=torch.int64)
    base = torch.zeros(2, 16, dtype=torch.bfloat16)

    def markov_step(*args):
        from dspark_cute.cutedsl.markov.greedy import MarkovStep

        return MarkovStep(*args)

    calls = {
        "plan_draft(draft)": (lambda: plan_draft(value), ["draft"]),
        "describe(model)": (lambda: describe(value), ["model", "DraftModel"]),
        "DraftModel(config)": (lambda: DraftModel(value), ["DraftConfig", "config"]),
        "DraftConfig.from_json(path)": (lambda: DraftConfig.from_json(value), ["path"]),
        "read_json_object(path)": (lambda: read_json_object(value, "a config"), ["path"]),
        "StepInputs(positions)": (lambda: StepInputs(value, i64, torch.zeros(2, 2, dtype=torch.int64)),
                                  ["positions"]),
        "paged_attention(q)": (lambda: paged_attention(value, L.PagedKVCache(1, 1, 16, 64),
                                                       torch.zeros(2, 1, dtype=torch.int64), 1),
                               ["q", "queries"]),
        "greedy_step(base)": (lambda: SM.greedy_step(value, base, 1.0, None, None), ["base", "logits"]),
        "RMSNorm(x)": (lambda: L.RMSNorm(2048)(value), ["input", "norm"]),
        "build_draft_decode(draft)": (lambda: build_draft_decode(value), ["draft"]),
        "check_d2t(d2t)": (lambda: SM.check_d2t(value, 8, 8), ["d2t"]),
        "MarkovStep(constants)": (lambda: markov_step(value, torch.zeros(8, 8, dtype=torch.bfloat16), None),
                                  ["MarkovConstants", "constants"]),
        "MarkovStep(w1)": (lambda: markov_step(KM.markov_constants(8, 8, 1.0, None, False), value, None),
                           ["w1"]),
    }
    name = rng.choice(sorted(calls))
    call, words = calls[name]
    return Case("unclear", f"{name} given {_short(value, 40)}", lambda: refused(call, words))


def fam_unclear_special_file(rng):
    """A config path that is a directory or a FIFO named config.json: said what it is, never read."""
    kind = rng.choice(["directory", "FIFO"])
    how = rng.choice(["DraftConfig.from_json", "dspark-plan"])

    def run():
        with _scratch() as tmp:
            path = tmp / "config.json"
            path.mkdir() if kind == "directory" else os.mkfifo(path)
            if how == "dspark-plan":
                from dspark_core.planner import cli

                return run_cli(cli.main, [str(path)])
            return refused(lambda: DraftConfig.from_json(str(path)), [kind, f"a {kind}"])

    return Case("unclear", f"{how}: config.json is a {kind}", run)


def fam_unclear_unknown_keys(rng):
    n = rng.choice([rng.randint(11, 1000), rng.randint(1000, 200000)])
    prefix = rng.choice(["k", "hidden_", "num_", "x" * 50])

    def run():
        data = {**json.loads(small_config().to_json()), **{f"{prefix}{i}": i for i in range(n)}}
        return refused(lambda: DraftConfig.from_dict(data), ["unknown"])

    return Case("unclear", f"DraftConfig.from_dict with {n} unknown keys", run)


def fam_unclear_tp_table(rng):
    """All-reduce table entries vLLM's tables lack (TP16 on sm_100a had a bare KeyError): answered, no order."""
    from dspark_vllm import allreduce

    tp = rng.choice([16, 32, 64, 12, 6, 3, 5, 7, 128])
    arch = rng.choice(["sm_100a", "sm_90a", "SM_100A", (10, 0)])
    which, rows = rng.choice(["resolve", "decode_order"]), rng.randint(1, 64)

    def run():
        try:
            if which == "resolve":
                got = allreduce.resolve(tp, rows, 8192, arch)
            else:
                got = allreduce.decode_order(tp, arch)
        except Exception as error:  # noqa: BLE001
            return refusal(error, ["TP", "tp", "TP size"])
        if got.sum_order is None and got.why:
            return "clear", f"no order: {_short(got.why)}"
        return "clear", f"order {got.sum_order}"

    return Case("unclear", f"allreduce.{which}(tp={tp}, arch={arch!r})", run)


# -- command lines -------------------------------------------------------------




def fam_unclear_markov_loop_operands(rng):
    """A bad operand for the greedy Markov loops with their bias GEMM (one launch a step,
    ``MarkovBiasStep``; the N steps in one launch, ``MarkovPersistentLoop``), built on the CPU:
    ``run`` must refuse it naming the operand before it asks for a GPU."""
    from dspark_core.contracts.markov import markov_constants
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep
    from dspark_cute.cutedsl.markov.persistent import MarkovPersistentLoop, persistent_unsupported

    vocab, rank, rows, steps = 384, 64, rng.randint(1, 8), rng.randint(1, 4)
    c = markov_constants(vocab, rank, 0.5, None, True)
    w1, w2 = torch.zeros(500, rank, dtype=torch.bfloat16), torch.zeros(vocab, rank, dtype=torch.bfloat16)
    d2t = torch.zeros(vocab, dtype=torch.int64)
    loop = persistent_unsupported(c, 8) is None and rng.random() < 0.5
    bf16 = torch.bfloat16
    base = torch.zeros(rows, steps, vocab, dtype=bf16) if loop else torch.zeros(rows, vocab, dtype=bf16)
    prev = torch.zeros(rows, dtype=rng.choice([torch.int32, torch.int64]))
    tokens = torch.zeros(rows, steps, dtype=torch.int64) if loop else torch.zeros(rows, dtype=torch.int64)
    kinds = {
        "base logits in float32": (lambda: (base.float(), prev, tokens), ["bfloat16", "base logits"]),
        "base logits of another vocabulary": (lambda: (base[..., :vocab - 8], prev, tokens), ["base logits"]),
        "base logits of no rows": (lambda: (base[:0], prev[:0], tokens[:0]), ["rows", "base logits"]),
        "base logits past the rows": (
            lambda: (torch.zeros((9,) + tuple(base.shape[1:]), dtype=bf16), torch.zeros(9, dtype=prev.dtype),
                     torch.zeros((9,) + tuple(tokens.shape[1:]), dtype=torch.int64)), ["rows", "base logits"]),
        "base logits with an odd row stride": (
            lambda: (torch.zeros(tuple(base.shape[:-1]) + (vocab + 4,), dtype=bf16)[..., :vocab], prev, tokens),
            ["row stride", "base logits"]),
        "previous ids in float32": (lambda: (base, prev.float(), tokens), ["previous ids", "int32 or int64"]),
        "previous ids of another count": (lambda: (base, torch.zeros(rows + 1, dtype=prev.dtype), tokens),
                                          ["previous ids"]),
        "tokens in int32": (lambda: (base, prev, tokens.int()), ["tokens", "int64"]),
        "tokens of another shape": (lambda: (base, prev, tokens[..., :0] if loop else tokens[:0]), ["tokens"]),
    }
    if loop:
        kinds["base logits of another step count"] = (
            lambda: (torch.zeros(rows, steps + 1, vocab, dtype=bf16), prev, tokens), ["base logits"])
        kinds["base logits of one step, 2-D"] = (lambda: (base[:, 0], prev, tokens), ["base logits"])
    kind = rng.choice(sorted(kinds))
    make, words = kinds[kind]
    name = "MarkovPersistentLoop" if loop else "MarkovBiasStep"

    def run():
        host = (MarkovPersistentLoop(c, w1, d2t, w2, steps, max_rows=8) if loop
                else MarkovBiasStep(c, w1, d2t, w2, max_rows=8))
        return refused(lambda: host.run(*make()), words)

    return Case("unclear", f"{name}.run: {kind}", run)


def fam_unclear_markov_bias_sample_operands(rng):
    """A bad sampling operand for the probabilistic Markov step with its bias GEMM
    (``MarkovBiasSampleStep``), built on the CPU: ``run`` must refuse it naming the operand
    before it asks for a GPU."""
    from dspark_core.contracts.markov import markov_sample_constants
    from dspark_cute.cutedsl.markov.bias_sample import MarkovBiasSampleStep

    vocab, target, rank, rows, steps = 384, 512, 64, rng.randint(1, 8), rng.randint(1, 4)
    c = markov_sample_constants(vocab, target, rank, 0.5, None)
    w1, w2 = torch.zeros(target, rank, dtype=torch.bfloat16), torch.zeros(vocab, rank, dtype=torch.bfloat16)
    d2t = torch.zeros(vocab, dtype=torch.int64)  # targets 0 .. vocab - 1
    base, ids = torch.zeros(rows, vocab, dtype=torch.bfloat16), torch.zeros(rows, dtype=torch.int64)
    temperature, seeds = torch.ones(rows + 1), torch.zeros(rows + 1, dtype=torch.int64)
    cache = torch.zeros(rows + 1, steps, target, dtype=torch.bfloat16)
    ok = dict(base=base, prev=ids, tokens=ids.clone(), idx_map=ids.clone(), temperature=temperature, seeds=seeds,
              pos=ids.clone(), cache=cache, col=steps - 1)
    kinds = {
        "idx_map in int32": ({"idx_map": ids.int()}, ["idx_map", "int64"]),
        "pos of another count": ({"pos": torch.zeros(rows + 1, dtype=torch.int64)}, ["pos"]),
        "temperature in float64": ({"temperature": temperature.double()}, ["temperature"]),
        "seeds strided": ({"seeds": torch.zeros(2 * rows + 2, dtype=torch.int64)[::2]}, ["seeds", "contiguous"]),
        "a float32 logits cache": ({"cache": cache.float()}, ["logits cache", "bfloat16"]),
        "a cache narrower than the target vocabulary": ({"cache": cache[..., :target - 8]}, ["logits cache"]),
        "a step past the cache": ({"col": steps}, ["col", "step"]),
        "a step given as a bool": ({"col": True}, ["col", "step"]),
        "previous ids in float32": ({"prev": ids.float()}, ["previous ids", "int32 or int64"]),
    }
    kind = rng.choice(sorted(kinds))
    change, words = kinds[kind]

    def run():
        host = MarkovBiasSampleStep(c, w1, d2t, w2, max_rows=8)
        return refused(lambda: host.run(**{**ok, **change}), words)

    return Case("unclear", f"MarkovBiasSampleStep.run: {kind}", run)
