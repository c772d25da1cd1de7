"""Benchmark: the whole draft step as vLLM 0.33.0 runs it, from its own
binaries, against the DSpark plugin's step, both in CUDA graphs, part by part
and in total, with each part's outputs compared as bits.

- STOCK: ``scripts/stock/stock_step.py`` (vLLM's Triton kernels compiled by
  Triton 3.8.0 and CUDA kernels taken from its library, ``.device/stock``;
  cuBLAS through torch; ATen where vLLM runs ATen).
- DSPARK: dspark-core's ``DraftDecode`` over the reference draft with the
  plugin's kernel set on sm_90a (``VLLM_EXACT_SM90``, the kernels
  ``dspark_vllm.planning.exact_kernels("sm_90a")`` names) and no L2
  prefetch, as the plugin builds it; every part it does not fuse (and any
  call a kernel refuses) runs the same stock ops as the STOCK side. The
  Markov loop is the stock one unless a fused Markov step is installed
  (``fused_markov``; the table says which ran).

Both sides use one attention, DSpark's paged decode attention kernel
(``PagedAttention``, its default direct variant, without the o-gate; vLLM's
FlashAttention 3 is not on the device machine), or with ``--attention
triton`` vLLM's Triton unified attention as its TRITON_ATTN backend launches
it for the draft's decode (``kernel_unified_attention``, 2D or split-softmax
3D plus ``reduce_segments`` as vLLM's host picks, from the binaries
``compile_stock.py --parts attention`` builds; ``TritonAttention``), or with
``--attention spec`` dspark-core's spec attention in torch ops (slow; for a
run without the CuTe DSL).

Rows: m = requests x N (N = ``--n``, 4), m = 1 being one request of one
token. Shapes: the reference draft (``DraftConfig()``: hidden 8192, 2
layers, 64 heads and 8 KV heads of 64, intermediate 16384); the head stated
by ``--draft-vocab`` (32768), ``--target-vocab`` (202752), ``--rank`` (256);
``combine_hidden_states`` over ``--aux-layers`` (3) target layers of
``--target-hidden`` (8192); every request ``--context`` (256) cached tokens,
LBHNC caches. The floor is the bytes of the weights one step reads (each
once: the layers' GEMM weights, the stacked context K/V rows, fc, the LM head,
markov_w2) at this card's HBM peak (``dspark_core.tools.card``: the card's
published figure by name, else its memory clock and bus width; none where
neither is known), and the table names the card, its driver and cuBLAS.

Projections on the DSpark side, as the plugin runs them by default: the
layers', fc and the LM head on the ordered GEMM where the build's order
check against the live cuBLAS and its timing on this card choose it, cuBLAS
elsewhere (``dspark_vllm.projections``); the Markov bias of the loop after
the bias step (at request counts the bias step does not bind) on cuBLAS.
``--ordered`` decides that one the same way too (beyond the plugin);
``--no-ordered`` keeps every projection on cuBLAS. Only the row counts the
bench runs are checked and timed (the plugin: those its steps have).

``--tp N`` times one rank's work of the TP-N step instead
(``tp_rank_setup``: the layers', fc's and the LM head's shards, the Markov
stage whole), with no all-reduce on either side.

Writes ``draft_step.md``, ``.json`` and ``.png`` (``--name``) into ``--out``
and prints one table. ``--dry`` runs the plumbing on the CPU (a
small draft, the spec standing in for the stock kernels, no graphs, no
DSpark kernels); ``--stock-only`` skips the DSpark side.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from dspark_core.planner import policy
from dspark_core.reference.config import DraftConfig, small_config
from dspark_core.reference.model import DraftModel, attend  # noqa: F401 (the CPU tests reach it here)
from dspark_core.tools.card import card_facts
from dspark_core.tools.compare import mismatches
from dspark_core.tools.timing import capture, times_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stock_scripts  # noqa: E402
from draft_step_report import plot, spread, table  # noqa: E402
from step_attention import TritonAttention, _CacheView, step_attention  # noqa: E402,F401 (_CacheView: the CPU tests)
from step_dspark import DSparkStep, shape_of, stock_description  # noqa: E402,F401 (the CPU tests reach them here)

ROOT = Path(__file__).resolve().parents[3]
ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512)
# dspark_vllm.planning.exact_kernels("sm_90a"): the device machine has no vLLM
# to import it from (packages/dspark-vllm/tests/test_bench_kernel_set.py
# holds the two equal).
VLLM_EXACT_SM90 = frozenset({policy.ROW_NORM, policy.BOUNDARY, policy.CONTEXT_CHAIN, policy.QKV_EPILOGUE,
                             policy.O_GATE, policy.MLP_ACTIVATION, policy.ORDERED_GEMM})
# The plugin's opt-in kernels that keep the stock bits (on by default at TP1: the ordered GEMM).
EXACT_OPT_INS = frozenset({policy.ORDERED_GEMM})
PROJECTION_LABELS = {
    "plugin": "the layers', fc and the LM head on the ordered GEMM where the build's order check and timing on "
              "this card chose it (the plugin's default), cuBLAS elsewhere; the Markov bias of the loop after the "
              "bias step on cuBLAS",
    "all": "every projection (the layers', fc, the LM head, the Markov bias) on the ordered GEMM where the build's "
           "order check and timing on this card chose it, cuBLAS elsewhere (the Markov bias beyond the plugin)",
    "cublas": "cuBLAS, as vLLM (--no-ordered)",
}
ATTENTION_NAMES = {"dspark": "DSpark's PagedAttention kernel (direct variant), both sides",
                   "triton": "vLLM 0.33.0's Triton unified_attention (TRITON_ATTN), its binary, both sides",
                   "spec": "dspark-core's spec attention in torch ops, both sides"}
CALLS = 10  # launches of a part per captured graph
BF16 = torch.bfloat16


_load = stock_scripts.load


# ---------------------------------------------------------------- measuring
def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else [x.clone() for x in a] if isinstance(a, list)
                 else a for a in args)


def differing(a, b) -> tuple[int, int]:
    """``(differing elements, elements)`` of two outputs (tuples of tensors,
    None entries skipped): bits for floats (NaN payloads aside; a narrower
    float widened first, exactly), values for integers."""
    bad = total = 0
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        if x.is_floating_point() and x.dtype != y.dtype:
            x, y = (x.to(y.dtype), y) if x.element_size() < y.element_size() else (x, y.to(x.dtype))
        count = mismatches(x, y) if x.is_floating_point() else (x != y)
        bad += int(count.sum())
        total += x.numel()
    return bad, total


def time_fn(fn, replays: int, calls: int = CALLS, dry: bool = False) -> dict:
    """Microseconds per call of ``fn()``: a CUDA graph of ``calls`` calls,
    ``replays`` replays (the wall time of one eager call with ``dry``)."""
    if dry:
        begin = time.perf_counter()
        fn()
        return spread([(time.perf_counter() - begin) * 1e6])
    replay = capture(fn, calls)
    return spread(times_us(replay, replays, warmup=2, calls=calls))


def record_parts(stock, batch, caches, hidden_buf, draft_tokens) -> list:
    """Run the stock step once, recording each part's ``(name, kind, fn,
    operands)`` (operands cloned before the call)."""
    parts = []

    def run(name, fn, *args):
        parts.append((name, fn.__name__, fn, _clone(args)))
        return fn(*args)

    stock.step(batch, caches, hidden_buf, draft_tokens, run=run)
    return parts


def measure_parts(parts, dspark, replays: int, dry: bool) -> list[dict]:
    rows = []
    for name, kind, fn, args in parts:
        row = {"part": name, "kind": kind}
        want = fn(*_clone(args))
        row["stock"] = time_fn(functools.partial(fn, *_clone(args)), replays, dry=dry)
        other = dspark.part(kind) if dspark is not None else None
        if other is None:
            row["dspark"], row["same_op"], row["differing"] = row["stock"], True, None
        else:
            prep, dfn = other
            got = dfn(*prep(_clone(args)))
            row["differing"], row["elements"] = differing(got, want)
            row["dspark"] = time_fn(functools.partial(dfn, *prep(_clone(args))), replays, dry=dry)
            row["same_op"] = False
        rows.append(row)
    return rows


def measure_step(m: int, args, model, stock, dspark, device, gen) -> dict:
    """One row count: the parts recorded, compared and timed; the whole step
    on both sides from the same caches, compared, then timed in alternating
    rounds."""
    requests, n = shape_of(m, args.n)
    c = model.config
    batch = STOCK.StepBatch.make(requests, n, args.context, c.kv_block_size, stock.fc.shape[1], c.vocab_size,
                                 device, gen)
    if isinstance(stock.attend, TritonAttention):
        stock.attend.bind(batch.step.attn_slots)  # both sides call stock.attend
    fresh = torch.randn(batch.num_blocks, c.num_kv_heads, c.kv_block_size, 2 * c.head_dim, generator=gen,
                        device=device).to(BF16)

    def caches():
        out = model.make_caches(batch.num_blocks, device)
        for cache in out:
            cache.tensor.copy_(fresh)
        return out

    def buffers():
        return (caches(), torch.zeros(batch.aux.shape[0], c.hidden_size, dtype=BF16, device=device),
                torch.zeros(requests, n, dtype=torch.int64, device=device))

    replays = args.replays if m <= 64 else max(5, args.replays // 2)
    cs, hidden, tokens = buffers()
    parts = record_parts(stock, batch, [x.tensor for x in cs], hidden, tokens)
    result = {"m": m, "requests": requests, "n": n, "parts": measure_parts(parts, dspark, replays, args.dry)}
    del parts, cs

    s_caches, s_hidden, s_tokens = buffers()
    s_tensors = [x.tensor for x in s_caches]
    s_out = stock.step(batch, s_tensors, s_hidden, s_tokens)
    sides = {"stock": lambda: stock.step(batch, s_tensors, s_hidden, s_tokens)}
    if dspark is not None:
        d_caches, d_hidden, d_tokens = buffers()
        d_out = dspark.step(batch, d_caches, d_hidden, d_tokens)
        result["whole_step_differing"] = {
            "backbone output": differing(d_out[:1], s_out[:1]), "base logits": differing(d_out[1:2], s_out[1:2]),
            "draft tokens": differing(d_out[2:], s_out[2:]),
            "KV caches": differing([x.tensor for x in d_caches], s_tensors)}
        sides["dspark"] = lambda: dspark.step(batch, d_caches, d_hidden, d_tokens)
    reps = args.replays * 2 if m <= 64 else args.replays
    replay = {k: (fn if args.dry else capture(fn)) for k, fn in sides.items()}
    samples: dict[str, list] = {k: [] for k in sides}
    for r in range(1 if args.dry else args.rounds):
        for k in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            if args.dry:
                samples[k].append(time_fn(replay[k], 1, dry=True)["median"])
            else:
                samples[k] += times_us(replay[k], reps, warmup=2)
    result["total"] = {k: spread(v) for k, v in samples.items()}
    result["total"].setdefault("dspark", result["total"]["stock"])
    del replay, sides
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return result


def weight_bytes(model, head, fc, stock) -> int:
    ws = [w for layer in model.layers for w in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up, layer.mlp.down)]
    ws += [stock.stacked_kv, fc, head.lm_head, head.markov_w2]
    return sum(w.numel() * w.element_size() for w in ws)


def gemm_bytes(model, head, fc) -> dict:
    """Weight bytes per table row of the step's projections (summed over the layers)."""
    size = lambda w: w.numel() * w.element_size()  # noqa: E731
    layers = model.layers
    return {"combine (fc)": size(fc),
            "QKV GEMM": sum(size(layer.self_attn.qkv_proj) for layer in layers),
            "o_proj": sum(size(layer.self_attn.o_proj) for layer in layers),
            "gate_up": sum(size(layer.mlp.gate_up) for layer in layers),
            "down": sum(size(layer.mlp.down) for layer in layers),
            "LM head": size(head.lm_head)}


# ---------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("DSPARK_BENCH_OUT", "bench-results"))
    p.add_argument("--name", default="draft_step", help="the output files' stem")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts m = requests x N")
    p.add_argument("--n", type=int, default=4, help="query tokens per request (num_speculative_tokens)")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--draft-vocab", type=int, default=32768)
    p.add_argument("--target-vocab", type=int, default=202752)
    p.add_argument("--rank", type=int, default=256, help="Markov rank")
    p.add_argument("--aux-layers", type=int, default=3, help="target layers combine_hidden_states concatenates")
    p.add_argument("--target-hidden", type=int, default=8192)
    p.add_argument("--replays", type=int, default=20, help="replays per part graph (half above m = 64)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of whole-step replays")
    p.add_argument("--no-stock-pdl", action="store_true", help="launch the stock norms and QK kernel without PDL")
    p.add_argument("--stock-only", action="store_true", help="time the stock step alone")
    p.add_argument("--attention", choices=("dspark", "triton", "spec"), default="dspark",
                   help="the one attention of both sides: DSpark's kernel, vLLM's Triton unified_attention binary "
                        "(TRITON_ATTN), or dspark-core's spec in torch ops")
    p.add_argument("--markov", choices=("auto", "stock", "fused", "persistent"), default="auto",
                   help="the DSpark side's Markov loop: what the plugin builds on this GPU (auto: the bias step "
                        "and the N steps in one launch where their checked sets name the GPU), or as named")
    p.add_argument("--seed", type=int, default=int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31)))
    p.add_argument("--dry", action="store_true", help="the plumbing on the CPU: small draft, spec kernels, no graphs")
    ordered = p.add_mutually_exclusive_group()
    ordered.add_argument("--ordered", action="store_const", dest="projections", const="all", default="plugin",
                         help="the Markov bias of the loop after the bias step on the ordered GEMM too, decided "
                              "as the layers' (beyond the plugin, which runs fc and the LM head on it)")
    ordered.add_argument("--no-ordered", action="store_const", dest="projections", const="cublas",
                         help="every projection on cuBLAS (the plugin's ordered_gemm: false)")
    p.add_argument("--tp", type=int, choices=TP_SIZES, default=1,
                   help="time one rank's work of a TP step (tp_rank_setup): the shards, no all-reduce on either side")
    return p


TP_SIZES = (1, 2, 4, 8)


def tp_rank_setup(config: DraftConfig, tp: int, fc_width: int, draft_vocab: int) -> tuple:
    """One rank's shapes of vLLM's TP-``tp`` draft step: ``(config, fc
    columns, LM-head rows)``. The layers as ``dspark_core.reference.tp``
    shards them (QKV and gate_up by rows, o_proj and down by columns: the
    shard config's heads, KV heads and intermediate size over ``tp``); fc
    (row-parallel) ``fc_width / tp`` columns; the LM head (vocab-parallel)
    ``draft_vocab / tp`` rows; the Markov stage whole (every rank runs it on
    the gathered logits). ValueError where ``tp`` does not divide them."""
    from dspark_core.reference.tp import shard_config

    if fc_width % tp or draft_vocab % tp:
        raise ValueError(f"TP{tp} divides neither fc's {fc_width} columns nor the {draft_vocab} draft ids")
    return shard_config(config, tp), fc_width // tp, draft_vocab // tp


def gathered_lm_head(stock, tp: int):
    """The stock LM head over its shard, its logits repeated ``tp`` times
    (one local ``torch.cat``) where vLLM all-gathers the ranks' logits: the
    Markov stage's full-width operand on both sides, the gather's own time
    excluded."""
    shard = stock.lm_head
    return lambda hidden, sample_indices: (torch.cat(shard(hidden, sample_indices) * tp, dim=1),)


def main(argv=None) -> int:
    global STOCK
    args = parser().parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        for m in rows:
            shape_of(m, args.n)
    except ValueError as error:
        print(f"error: --rows: {error}", file=sys.stderr)
        return 2
    if not args.dry and not torch.cuda.is_available():
        print("bench_draft_step: no CUDA GPU, nothing to time (--dry runs the plumbing on the CPU)")
        return 0
    STOCK = _load("stock_step")
    device = torch.device("cpu" if args.dry else "cuda")
    if args.dry:
        config = small_config()
        args.draft_vocab, args.target_vocab, args.rank, args.target_hidden = 512, 1024, 64, 256
    else:
        config = DraftConfig()
        kernels = _load("launch_stock")
        missing = stock_scripts.binaries_missing()
        if missing:
            print(missing)
            return 1
    fc_width = args.aux_layers * args.target_hidden
    lm_rows = args.draft_vocab
    if args.tp > 1:
        try:
            config, fc_width, lm_rows = tp_rank_setup(config, args.tp, fc_width, args.draft_vocab)
        except ValueError as error:
            print(f"error: --tp: {error}", file=sys.stderr)
            return 2
    print(f"seed {args.seed}", flush=True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    model = DraftModel(config, device=device)
    head = STOCK.Head.random(config.hidden_size, args.draft_vocab, args.target_vocab, args.rank, device, gen)
    head.lm_head = head.lm_head[:lm_rows].contiguous()
    fc = (torch.randn(config.hidden_size, fc_width, generator=gen, device=device) / fc_width ** 0.5).to(BF16)
    if args.dry:
        kernels = STOCK.SpecKernels(model.rotary)
    attention = step_attention("spec" if args.dry else args.attention, kernels, config, args.n, device)
    if attention is None:
        return 1
    stock = STOCK.StockStep(model, head, fc, kernels, attention, pdl=not (args.dry or args.no_stock_pdl))
    if args.tp > 1:
        stock.lm_head = gathered_lm_head(stock, args.tp)
    if stock.pdl:
        try:  # a stock launch with PDL, captured: where the driver refuses it, the stock runs without
            probe = torch.zeros(1, config.hidden_size, dtype=BF16, device=device)
            capture(lambda: stock.norm(probe, model.norm))()
            torch.cuda.synchronize()
        except RuntimeError as error:
            print(f"the stock kernels run without PDL: {error}")
            stock.pdl = False
    fallbacks: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: fallbacks.append(record.getMessage())
    logging.getLogger("dspark.decode").addHandler(handler)
    dspark = None
    if not args.stock_only:
        # The dry run plans for an H200 with no kernel: every part on the stock ops.
        target = policy.Target(kernels=frozenset()) if args.dry else None
        dspark = DSparkStep(model, stock, device, frozenset() if args.dry else VLLM_EXACT_SM90, target,
                            "stock" if args.dry else args.markov,
                            frozenset() if args.projections == "cublas" else EXACT_OPT_INS, args.n,
                            outside=args.projections == "all", step_rows=rows)
        fused, total = dspark.plan.fused_count()
        print(f"DSpark plan: {fused} of {total} parts fused; Markov: {dspark.markov_label}", flush=True)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    attention_name = ATTENTION_NAMES["spec" if args.dry else args.attention]
    card = None if args.dry else card_facts(device)
    peak = card.hbm_peak if card is not None else None
    meta = {
        "device": "CPU (dry run)" if args.dry else card.describe(),
        "hbm_peak": peak, "card": None if card is None else card.as_dict(),
        "decisions": [d.summary() for d in (dspark.decisions() if dspark else [])],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seed": args.seed,
        "floor_us": weight_bytes(model, head, fc, stock) / peak * 1e6 if peak else None,
        "weight_bytes": weight_bytes(model, head, fc, stock),
        "part_bytes": gemm_bytes(model, head, fc),
        "setup": (f"Reference draft (hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads}/"
                  f"{config.num_kv_heads} heads of {config.head_dim}, intermediate {config.intermediate_size}); "
                  f"V_draft {args.draft_vocab}, V_target {args.target_vocab}, Markov rank {args.rank}, greedy; "
                  f"fc {args.aux_layers} x {args.target_hidden}; N = {args.n} (m = 1: one request of one "
                  f"token); {args.context} cached tokens a request; attention: {attention_name}; stock PDL "
                  f"{'on' if stock.pdl else 'off'}; Markov on the DSpark side: "
                  f"{dspark.markov_label if dspark else '-'}; projections on the DSpark side: "
                  f"{PROJECTION_LABELS[args.projections]}."
                  + (f" One rank of TP{args.tp} (tp_rank_setup): {config.num_heads}/{config.num_kv_heads} heads, "
                     f"intermediate {config.intermediate_size}, fc {fc_width} columns, LM head {lm_rows} rows; "
                     f"the all-reduces and the logits' all-gather excluded on both sides (a local concatenation "
                     f"stands in for the gather)." if args.tp > 1 else "")),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for m in rows:
        t0 = time.perf_counter()
        results.append(measure_step(m, args, model, stock, dspark, device, gen))
        tot = results[-1]["total"]
        print(f"m={m}: stock {tot['stock']['median']:.1f} us, DSpark {tot['dspark']['median']:.1f} us "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        meta["notes"] = (
            "Parts are timed alone (a graph of 10 launches each, the median per launch); the whole step is one "
            "graph. 'a -> b (r)': stock us -> DSpark us (stock / DSpark); 'same op': both sides run it. "
            "Differing elements are counted as bits for the parts DSpark runs its own kernels on (0 expected). "
            "Fallbacks: " + ("; ".join(dict.fromkeys(fallbacks)) or "none") + ".")
        text = table(results, meta)  # written after every row count: a time limit keeps the rows done
        (out / f"{args.name}.md").write_text(text + "\n")
        (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(text)
    plot(results, meta["floor_us"], out / f"{args.name}.png")
    bad = [(r["m"], p["part"]) for r in results for p in r["parts"] if p["differing"]]
    bad += [(r["m"], k) for r in results for k, v in r.get("whole_step_differing", {}).items() if v[0]]
    if bad:
        print(f"NOT bit for bit: {bad}")
    return 1 if bad else 0


STOCK = None

if __name__ == "__main__":
    sys.exit(main())
