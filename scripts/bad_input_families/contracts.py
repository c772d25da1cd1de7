"""``scripts/bad_inputs.py``'s families against the contracts: plan lines against the build, FP32
constants, out-of-bounds index operands, the spec layers against ``DraftConfig``."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import test_entry_properties as props
import torch

from bad_input_families.common import (
    Case,
    _draw_refused,
    _entries,
    _entry_case,
    _fp32_overflow,
    _fp32_zero,
    _scratch,
    _short,
    cli_output,
    named,
    refusal,
    refused,
    run_cli_outcome,
)
from dspark_core.contracts import markov as KM
from dspark_core.planner import policy
from dspark_core.reference.config import DraftConfig, small_config


def fam_entry_fp32(rng):
    pairs = _entries(props.Num, lambda p: p.fp32)

    def draw(rng, p):
        return _fp32_zero(rng) if p.positive and rng.random() < 0.3 else _fp32_overflow(rng)

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("fp32", entry, param, value, "not finite (or 0) in FP32")


def fam_config_fp32(rng):
    field_, value = rng.choice([("rope_theta", None), ("rms_norm_eps", None), ("norm_gain_center", None),
                                ("norm_overrides", "eps"), ("norm_overrides", "gain_center")])
    number = _fp32_overflow(rng, sign=field_ != "rms_norm_eps")
    if field_ == "norm_overrides":
        change = {"norm_overrides": {"norm": {value: number}}}
        words = [value]
    else:
        change, words = {field_: number}, [field_]
    base = json.loads(small_config().to_json())
    return Case("fp32", f"DraftConfig.from_dict({_short(change, 80)})",
                lambda: refused(lambda: DraftConfig.from_dict({**base, **change}), words))


def fam_markov_fp32(rng):
    from dspark_core.spec import markov as SM

    which = rng.choice(["multiplier", "soft_cap"])
    if which == "multiplier":
        mult, cap = rng.choice([_fp32_overflow(rng), _fp32_zero(rng)]), 30.0
    else:
        mult = 1.0
        cap = rng.choice([_fp32_overflow(rng, sign=False), _fp32_zero(rng), rng.uniform(1e-44, 2.9e-39),
                          -rng.uniform(0, 100), 0.0])
    words = ["multiplier", "output multiplier"] if which == "multiplier" else ["soft cap", "soft_cap"]
    base = torch.zeros(2, 16, dtype=torch.bfloat16)
    calls = {
        "transform_constants": lambda: SM.transform_constants(mult, cap),
        "markov_constants": lambda: KM.markov_constants(4096, 256, mult, cap, False),
        "markov_sample_constants": lambda: KM.markov_sample_constants(64, 128, 16, mult, cap),
        "output_transform": lambda: SM.output_transform(base, mult, cap),
        "greedy_step": lambda: SM.greedy_step(base, base, mult, cap, None),
    }
    name = rng.choice(sorted(calls))
    return Case("fp32", f"{name}(multiplier={mult!r}, soft_cap={cap!r})", lambda: refused(calls[name], words))


def _stub_head(vocab: int, target: int, rank: int, mult=0.0625, cap=30.0, dtype=torch.bfloat16, d2t=True):
    """vLLM's draft as ``dspark_vllm.markov_plan.plan_stage`` reads it (the Markov
    head's weights, the vocabularies, the output transform, the d2t map)."""
    w1 = torch.zeros(max(vocab, target), rank, dtype=torch.bfloat16)
    ids = torch.arange(vocab) * max(1, target // max(vocab, 1))
    m = (ids.clamp(max=target - 1) - torch.arange(vocab)) if d2t else None
    head = SimpleNamespace(markov_w1=SimpleNamespace(weight=w1),
                           markov_w2=SimpleNamespace(weight=torch.zeros(vocab, rank, dtype=torch.bfloat16)))
    return SimpleNamespace(model=SimpleNamespace(markov_head=head),
                           config=SimpleNamespace(draft_vocab_size=vocab, vocab_size=target),
                           output_multiplier=mult, output_soft_cap_temp=cap, draft_id_to_target_id=m,
                           lm_head=SimpleNamespace(weight=torch.zeros(1, 1, dtype=dtype)))


def _build_markov(constants, w1, d2t, rows, sample: bool) -> str | None:
    """The host class's refusal of what a plan fused (dspark-cute's MarkovStep / MarkovSampleStep on the CPU:
    their checks come before any launch), or None where it takes it."""
    from dspark_cute.cutedsl.markov.greedy import MarkovStep
    from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

    try:
        (MarkovSampleStep if sample else MarkovStep)(constants, w1, d2t, rows)
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def fam_plan_markov_contract(rng):
    """The Markov contract (what the planner and the plugin's plan read) against the host class (the build)."""
    kind = rng.choice(["rank past 2048", "rank not a multiple of 8", "vocab not a multiple of 8",
                       "target vocab below the draft's", "target vocab not a multiple of 8"])
    vocab, rank = 8 * rng.randint(1, 64), 8 * rng.randint(1, 32)
    target = vocab + 8 * rng.randint(0, 64)
    if kind == "rank past 2048":
        rank = 8 * rng.randint(257, 1024)
    elif kind == "rank not a multiple of 8":
        rank = rng.choice([r for r in range(1, 2049) if r % 8])
    elif kind == "vocab not a multiple of 8":
        vocab = rng.randint(1, 4096) | 1
        target = max(target, vocab + 7)
    elif kind == "target vocab below the draft's":
        vocab = 8 * rng.randint(2, 64)
        target = vocab - 8 * rng.randint(1, vocab // 8 - 1)
    else:
        target = vocab + rng.randint(1, 7)
    sample = kind.startswith("target") or rng.random() < 0.3
    words = ["rank", "Markov rank", "vocab", "vocabulary", "target vocabulary"]

    def run():
        try:
            if sample:
                c = KM.markov_sample_constants(vocab, target, rank, 1.0, None)
            else:
                c = KM.markov_constants(vocab, rank, 1.0, None, True)
        except Exception as error:  # noqa: BLE001
            return refusal(error, words)
        w1 = torch.zeros(max(vocab, target), rank, dtype=torch.bfloat16)
        d2t = torch.zeros(vocab, dtype=torch.int64)
        built = _build_markov(c, w1, d2t, 4, sample)
        if built is not None:
            return "wrong", f"the contract takes it, the build refuses: {_short(built)}"
        return "wrong", "taken by the contract and the build"

    step = "markov_sample_constants" if sample else "markov_constants"
    return Case("plan", f"{step}: {kind} (vocab {vocab}, target {target}, rank {rank})", run)


def fam_plan_markov_vllm(rng):
    """``dspark_vllm.markov_plan.plan_stage`` (the plan line's and the build's decision) on a head past a limit,
    then the host classes on whatever it fuses."""
    kind = rng.choice(["rows", "checked as a string", "draft vocab above the target's", "rank past 2048",
                       "soft cap not finite in FP32", "multiplier not finite in FP32", "FP16 head"])
    vocab, rank = 8 * rng.randint(2, 48), 8 * rng.randint(1, 32)
    target, rows, checked, sample = vocab + 8 * rng.randint(0, 16), rng.randint(1, 512), {"sm_90a"}, False
    mult, cap, dtype = 0.0625, 30.0, torch.bfloat16
    if kind == "rows":
        rows = rng.choice([0, -rng.randint(1, 10**6), KM.MARKOV_MAX_ROWS + rng.randint(1, 10**7), True, 2.5, "8",
                           np.float32(4)])
    elif kind == "checked as a string":
        checked = rng.choice(["sm_90a", "sm_90a, sm_100a", "sm_90a sm_100a", "{'sm_90a'}"])
    elif kind == "draft vocab above the target's":
        target, sample = vocab - 8 * rng.randint(1, vocab // 8 - 1), True
    elif kind == "rank past 2048":
        rank = 8 * rng.randint(257, 600)
    elif kind == "soft cap not finite in FP32":
        cap = rng.choice([_fp32_overflow(rng, sign=False), _fp32_zero(rng), rng.uniform(1e-44, 2.9e-39)])
    elif kind == "multiplier not finite in FP32":
        mult = rng.choice([_fp32_overflow(rng), _fp32_zero(rng)])
    else:
        dtype = torch.float16
    words = ["checked", "architectures", "max_num_seqs", "rows"]

    def run():
        from dspark_vllm.markov_plan import plan_stage

        model = _stub_head(vocab, target, rank, mult, cap, dtype)
        try:
            planned = plan_stage(model, "sm_90a", rows, checked, checked)
        except Exception as error:  # noqa: BLE001
            return refusal(error, words)
        if sample:
            if planned.sample_reason is not None:
                return "clear", f"probabilistic step: {_short(planned.sample_reason)}"
            built = _build_markov(planned.sample, model.model.markov_head.markov_w1.weight,
                                  model.draft_id_to_target_id, 4, True)
            return "wrong", f"planned fused; the build: {_short(built or 'takes it')}"
        if planned.reason is not None:
            return "clear", _short(planned.reason)
        built = _build_markov(planned.constants, model.model.markov_head.markov_w1.weight,
                              model.draft_id_to_target_id, rows if isinstance(rows, int) else 4, False)
        return "wrong", f"planned fused; the build: {_short(built or 'takes it')}"

    return Case("plan", f"plan_stage: {kind} (vocab {vocab}, target {target}, rank {rank}, rows {rows!r}, "
                        f"checked {checked!r})", run)


def fam_plan_vllm_cli(rng):
    """``python -m dspark_vllm.plan``'s Markov line on a draft or a row count past a Markov step's limit: the
    line must keep vLLM's loop for what the build refuses (or the command refuse it)."""
    kind = rng.choice(["--max-num-seqs past the rows", "Markov rank past 2048", "Markov rank not a multiple of 8",
                       "draft vocab above the target's"])
    argv, change, sampled = [], {}, False
    if kind.startswith("--max-num-seqs"):
        argv = [f"--max-num-seqs={KM.MARKOV_MAX_ROWS + 1 + rng.randrange(2**31 - 1 - KM.MARKOV_MAX_ROWS - 1)}"]
    elif kind == "Markov rank past 2048":
        change = {"markov_rank": 8 * rng.randint(257, 1024)}
    elif kind == "Markov rank not a multiple of 8":
        change = {"markov_rank": rng.choice([r for r in range(1, 2049) if r % 8])}
    else:
        change, sampled = {"draft_vocab_size": 512 + 8 * rng.randint(1, 64)}, True
    argv += rng.choice([[], ["--exact=all"]])

    def run():
        import _draft

        from dspark_vllm import plan

        with _scratch() as tmp:
            folder = tmp / "draft"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(_draft.draft_config(**change)))
            code, out, err = cli_output(plan.main, [str(folder), *argv])
        if code == "traceback" or "Traceback" in err:
            return "traceback", _short(err[-300:])
        if code == 2:
            return run_cli_outcome(code, err)
        line = next((x for x in out.splitlines() if x.startswith("Markov stage:")), "")
        fused = "probabilistic drafting fused" if sampled else "greedy drafting fused"
        if code != 0 or not line:
            return "unclear", f"exit {code}: {_short(err[-200:])}"
        return ("wrong", _short(line)) if fused in line else ("clear", _short(line))

    return Case("plan", f"python -m dspark_vllm.plan: {kind} {change or argv}", run)


def _plan_and_hosts(model):
    """``(core plan, vLLM plan, host refusals of fused parts)`` of the reference draft ``model``."""
    from test_limits import _hosts

    from dspark_core.errors import Unsupported
    from dspark_core.planner.plan import plan_draft
    from dspark_core.reference.adapter import describe
    from dspark_vllm.planning import plan_vllm

    draft = describe(model)
    target = policy.Target(kernels=policy.ALL_KERNELS)
    core, vllm = plan_draft(draft, target), plan_vllm(draft, target, exact=policy.ALL_KERNELS)
    hosts, refusals = _hosts(), []
    for part in core.parts():
        host = hosts.get(type(part.constants).__name__) if part.fused else None
        if host is not None:
            try:
                host(part.constants)
            except Unsupported as error:
                refusals.append(f"{part.name}: {error}")
            except (ValueError, TypeError, RuntimeError):  # an operand the limit test's call leaves out
                pass
    return core, vllm, refusals


def fam_plan_config(rng):
    """A reference draft past a kernel's limit: the planner, the vLLM plan and the host classes must agree,
    and the part stay stock with the reason."""
    kind = rng.choice(["intermediate size", "head width", "KV heads", "hidden width"])
    change = {"num_layers": 1}
    if kind == "intermediate size":
        change["intermediate_size"] = rng.randint(1, 20000) | rng.choice([1, 2, 4])
    elif kind == "head width":
        d = rng.choice([8, 16, 32, 48, 80, 96, 128, 256])
        change.update(head_dim=d, num_heads=8, num_kv_heads=2)
    elif kind == "KV heads":
        kv = rng.choice([3, 5, 6, 7, 12, 24, 48, 64])
        change.update(num_kv_heads=kv, num_heads=kv * rng.choice([1, 2]))
    else:
        change["hidden_size"] = 2048 * rng.randint(1, 3) + 8 * rng.randint(1, 255)
    fields = [k for k in change if k != "num_layers"]

    def run():
        from dspark_core.reference.model import DraftModel

        try:
            model = DraftModel(small_config(**change), device="meta")
        except Exception as error:  # noqa: BLE001
            return refusal(error, fields)
        core, vllm, refusals = _plan_and_hosts(model)
        if refusals:
            return "wrong", f"planned fused, refused by the host class: {_short(refusals[0])}"
        core_reasons = {p.name: p.reason for p in core.parts()}
        vllm_reasons = {p.name: p.reason for p in vllm.parts()}
        differ = [n for n in core_reasons if n in vllm_reasons and core_reasons[n] != vllm_reasons[n]]
        if differ:
            return "wrong", f"the planner and the vLLM plan disagree on {differ[0]}"
        stock = core.refused()
        if not stock:
            return "wrong", "every part planned fused"
        return "clear", _short(stock[0])

    return Case("plan", f"plan_draft vs build: {kind} {change}", run)


def fam_d2t_host(rng):
    """A d2t map pointing past (or before) the first Markov factor, or repeating a target (sampling)."""
    sample = rng.random() < 0.5
    vocab, rank = 8 * rng.randint(2, 64), 8 * rng.randint(1, 8)
    target = vocab + 8 * rng.randint(0, 32)
    ids = torch.tensor(sorted(rng.sample(range(target), vocab)), dtype=torch.int64)
    d2t = ids - torch.arange(vocab)
    i = rng.randrange(vocab)
    kind = rng.choice(["past", "before", "repeat"] if sample else ["past", "before"])
    if kind == "past":
        d2t[i] = target - i + rng.randrange(10**rng.randint(0, 9))
    elif kind == "before":
        d2t[i] = -i - 1 - rng.randrange(10**rng.randint(0, 9))
    else:
        j = (i + 1 + rng.randrange(vocab - 1)) % vocab
        d2t[j] = int(ids[i]) - j

    def run():
        w1 = torch.zeros(target, rank, dtype=torch.bfloat16)
        if sample:
            c = KM.markov_sample_constants(vocab, target, rank, 1.0, None)
        else:
            c = KM.markov_constants(vocab, rank, 1.0, None, True)
        built = _build_markov(c, w1, d2t, 4, sample)
        return ("clear", _short(built)) if built and named(built, ["d2t"]) else \
            ("unclear", _short(built)) if built else ("wrong", "the build takes it")

    return Case("index", f"{'MarkovSampleStep' if sample else 'MarkovStep'}: d2t {kind} (draft id {i}, "
                         f"vocab {vocab}, target {target})", run)


def fam_d2t_spec(rng):
    from dspark_core.spec import markov as SM

    vocab, targets = 8 * rng.randint(1, 8), 8 * rng.randint(1, 8)
    d2t = torch.zeros(vocab, dtype=torch.int64)
    i = rng.randrange(vocab)
    d2t[i] = rng.choice([targets - i + rng.randrange(1000), -i - 1 - rng.randrange(1000)])
    kind = rng.choice(["greedy_loop", "check_d2t"])

    def run():
        if kind == "check_d2t":
            return refused(lambda: SM.check_d2t(d2t, vocab, targets), ["d2t"])
        base = torch.zeros(2, 3, vocab, dtype=torch.bfloat16)
        w1 = torch.zeros(targets, 8, dtype=torch.bfloat16)
        w2 = torch.zeros(vocab, 8, dtype=torch.bfloat16)
        return refused(lambda: SM.greedy_loop(base, torch.tensor([0, 1]), w1, w2, 1.0, None, d2t), ["d2t"])

    return Case("index", f"spec.markov.{kind}: d2t[{i}] = {int(d2t[i])} (vocab {vocab}, {targets} targets)", run)


_MODELS: dict = {}


def _tiny_model(vocab: int):
    from dspark_core.reference.model import DraftModel

    if vocab not in _MODELS:
        _MODELS[vocab] = DraftModel(small_config(num_layers=0, vocab_size=vocab))
    return _MODELS[vocab]


def fam_index_tokens_slots(rng):
    from dspark_core.spec import layers as L
    from dspark_core.spec.attention import paged_attention

    kind = rng.choice(["token ids", "insert slots", "attention slots", "RoPE positions"])
    n = rng.randint(1, 6)
    if kind == "token ids":
        vocab = 8 * rng.randint(1, 8)
        bad, at = rng.choice([vocab + rng.randrange(10**6), -1 - rng.randrange(10**6)]), rng.randrange(n)

        def run():
            ids = torch.arange(n) % vocab
            ids[at] = bad
            return refused(lambda: _tiny_model(vocab).embed_tokens(ids), ["token ids"])

        return Case("index", f"DraftModel.embed_tokens: id {bad} of a vocabulary of {vocab}", run)
    blocks, bs = rng.randint(1, 4), rng.choice([1, 16])
    bad = blocks * bs + rng.randrange(10**rng.randint(0, 8))
    at, col = rng.randrange(n), rng.randrange(3)
    if kind == "insert slots":
        def run():
            cache = L.PagedKVCache(blocks, 1, bs, 64)
            k = torch.zeros(n, 1, 64, dtype=torch.bfloat16)
            slots = torch.full((n,), -1, dtype=torch.int64)
            slots[at] = bad
            return refused(lambda: cache.insert(k, k, slots), ["slot", "slots"])

        return Case("index", f"PagedKVCache.insert: slot {bad} of {blocks * bs}", run)
    if kind == "attention slots":
        def run():
            cache = L.PagedKVCache(blocks, 1, bs, 64)
            q = torch.zeros(n, 1, 64, dtype=torch.bfloat16)
            slots = torch.zeros(n, 3, dtype=torch.int64)
            slots[at, col] = bad
            return refused(lambda: paged_attention(q, cache, slots, 1), ["slot", "attn_slots"])

        return Case("index", f"paged_attention: attention slot {bad} of {blocks * bs}", run)
    max_pos = rng.randint(1, 256)
    pos = rng.choice([max_pos + rng.randrange(10**6), -1 - rng.randrange(10**6)])

    def run():
        rotary = L.Rotary(64, max_pos)
        x = torch.zeros(n, 2, 64, dtype=torch.bfloat16)
        positions = torch.zeros(n, dtype=torch.int64)
        positions[at] = pos
        return refused(lambda: rotary(x, positions), ["positions", "RoPE positions"])

    return Case("index", f"Rotary: position {pos} of a table of {max_pos}", run)


def fam_spec_layers(rng):
    """Parameters DraftConfig refuses, given to the spec's layers (which returned NaN for them)."""
    from dspark_core.spec import layers as L

    kind = rng.choice(["gain centre", "eps", "RoPE base", "residual scale"])
    if kind == "gain centre":
        v = rng.choice([math.nan, _fp32_overflow(rng)])
        return Case("spec", f"RMSNorm(gain_center={v!r})",
                    lambda: refused(lambda: L.RMSNorm(2048, gain_center=v), ["gain center", "gain_center"]))
    if kind == "eps":
        v = rng.choice([math.nan, -rng.uniform(1e-9, 1.0), _fp32_overflow(rng)])
        layer = rng.choice(["RMSNorm", "HeadNorm"])
        make = (lambda: L.RMSNorm(2048, eps=v)) if layer == "RMSNorm" else (lambda: L.HeadNorm(64, eps=v))
        return Case("spec", f"{layer}(eps={v!r})", lambda: refused(make, ["eps"]))
    if kind == "RoPE base":
        v = rng.choice([0.0, 1.0, rng.uniform(-1e6, 1.0), -0.0, math.nan, _fp32_overflow(rng, sign=False)])
        return Case("spec", f"Rotary(theta={v!r})",
                    lambda: refused(lambda: L.Rotary(64, 16, v), ["theta", "RoPE base"]))
    name = rng.choice(["alpha", "beta"])
    v = rng.choice([math.nan, _fp32_overflow(rng)])
    return Case("spec", f"GatedResidual({name}={v!r})",
                lambda: refused(lambda: L.GatedResidual(2048, **{name: v}), [name]))


def fam_spec_empty_rows(rng):
    from dspark_core.spec import layers as L
    from dspark_core.spec.attention import paged_attention

    m, s = rng.randint(1, 6), rng.randint(1, 5)
    empty = rng.randrange(m)

    def run():
        cache = L.PagedKVCache(2, 1, 16, 64)
        q = torch.zeros(m, 1, 64, dtype=torch.bfloat16)
        slots = torch.randint(0, 32, (m, s))
        slots[empty] = -torch.randint(1, 5, (s,))
        return refused(lambda: paged_attention(q, cache, slots, 1), ["attn_slots", "slot"])

    return Case("spec", f"paged_attention: row {empty} of {m} with no valid slot", run)


