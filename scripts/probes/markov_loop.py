"""Probe (not part of any package): the greedy Markov stage alone, N steps
in one CUDA graph, on the reference head (V_draft 32768, V_target 202752,
rank 256, d2t, soft cap 30): DSpark's fused step after cuBLAS's bias GEMM
(``markov.loop.run_greedy_loop``: 1 + 2N launches) against the step with
its bias GEMM (``markov.bias_step``: N launches) and the N steps in one
cooperative launch (``markov.persistent``, up to 32 requests, CuTe DSL 4.8),
with and without PDL, the tokens compared (issue 33's Markov target); with
``--sample`` also the probabilistic stage after cuBLAS's GEMM against the
step with its bias GEMM (``markov.bias_sample``), tokens and logits cache
compared. Numbers of 2026-12-04 (H200): ``docs/gemm-order.md``.

``python scripts/probes/markov_loop.py [--rows 1,4,16,64] [--steps 4] [--sample]``
prints one line per row count and a table last."""
import argparse
import statistics
import sys
import time


def main() -> int:
    import torch

    from dspark_core.contracts.markov import markov_constants
    from dspark_core.tools.timing import capture, median_us
    from dspark_cute.cutedsl.markov.bias_step import MarkovBiasStep, run_fused_greedy_loop
    from dspark_cute.cutedsl.markov.greedy import MarkovStep
    from dspark_cute.cutedsl.markov.loop import run_greedy_loop
    from dspark_cute.cutedsl.markov.persistent import MAX_LOOP_ROWS, MarkovPersistentLoop, persistent_unsupported

    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sample", action="store_true", help="also the probabilistic stage (markov_bias_sample)")
    p.add_argument("--seed", type=int, default=time.time_ns() % 2**31)
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    n, vocab, vt, rank = a.steps, 32768, 202752, 256
    print(f"seed {a.seed}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    bf16 = torch.bfloat16
    w1 = (torch.randn(vt, rank, generator=gen, device="cuda") * 0.05).to(bf16)
    w2 = (torch.randn(vocab, rank, generator=gen, device="cuda") * 0.05).to(bf16)
    ids = torch.randperm(vt, generator=gen, device="cuda")[:vocab].sort().values
    d2t = ids - torch.arange(vocab, device="cuda")
    c = markov_constants(vocab, rank, 0.0625, 30.0, True)
    step = MarkovStep(c, w1, d2t, max_rows=512)
    step.prepare()
    variants = {}
    for pdl in (True, False):
        fused = MarkovBiasStep(c, w1, d2t, w2, max(rows), pdl=pdl)
        fused.check(rows)
        variants[f"with its bias GEMM (N launches), PDL {'on' if pdl else 'off'}"] = fused
    small = [r for r in rows if r <= MAX_LOOP_ROWS]
    why = persistent_unsupported(c, max(small, default=1), torch.cuda.get_device_properties(0).multi_processor_count)
    if why is not None or not small:
        print(f"the persistent loop is not measured: {why or 'no row count up to 32'}", flush=True)
    else:
        for pdl in (True, False):
            loop = MarkovPersistentLoop(c, w1, d2t, w2, n, max(small), pdl=pdl)
            loop.check(small)
            print(f"persistent loop, PDL {'on' if pdl else 'off'}: probe {loop.probe() or 'passed'}", flush=True)
            variants[f"in one launch (persistent), PDL {'on' if pdl else 'off'}"] = loop
    embed = torch.empty(max(rows), rank, dtype=bf16, device="cuda")

    def timed(fn) -> float:
        replay = capture(fn)
        return statistics.median(median_us(replay, 5, warmup=1, calls=1) for _ in range(7))

    lines = []
    for r in rows:
        base = (torch.randn(r * n, vocab, generator=gen, device="cuda") * 4).to(bf16).view(r, n, vocab)
        prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
        ref = torch.empty(r, n, dtype=torch.int64, device="cuda")
        t_ref = timed(lambda b=base, pv=prev, rf=ref: run_greedy_loop(step, b, pv, w2, rf, embed))
        cells = [f"{t_ref:.1f}"]
        for fused in variants.values():
            if r not in fused.rows:
                cells.append("-")
                continue
            tokens = torch.full((r, n), -1, dtype=torch.int64, device="cuda")
            if isinstance(fused, MarkovPersistentLoop):
                t = timed(lambda f=fused, b=base, pv=prev, tk=tokens: f.launch(b, pv, tk))
            else:
                t = timed(lambda f=fused, b=base, pv=prev, tk=tokens: run_fused_greedy_loop(f, b, pv, tk))
            same = torch.equal(tokens, ref)
            cells.append(f"{t:.1f}{'' if same else ' TOKENS DIFFER'}")
        line = f"| {r} | " + " | ".join(cells) + " |"
        print(line, flush=True)
        lines.append(line)
    sampled = sample_lines(rows, n, w1, w2, d2t, variants, gen, timed) if a.sample else []
    print(f"\nMarkov stage, N = {n}, {torch.cuda.get_device_name()}, seed {a.seed}; µs per loop (CUDA graph, median)")
    print("| requests | after cuBLAS's bias GEMM (1 + 2N launches) | " + " | ".join(variants) + " |")
    print("\n".join(lines))
    if sampled:
        print("\nprobabilistic (draft_logits set, temperature 0.7 but one greedy request), same head")
        print("| requests | after cuBLAS's bias GEMM (1 + 2N launches) | with its bias GEMM (N launches), PDL on |")
        print("\n".join(sampled))
    return 0


def sample_lines(rows, n, w1, w2, d2t, variants, gen, timed) -> list:
    """The probabilistic stage: ``MarkovSampleStep`` after cuBLAS's GEMM
    against ``MarkovBiasSampleStep`` bound by the greedy check (PDL on),
    tokens and the whole logits cache compared; one table line a row count."""
    import torch

    from dspark_core.contracts.markov import markov_sample_constants
    from dspark_cute.cutedsl.markov.bias_sample import (
        MAX_SAMPLE_ROWS,
        MarkovBiasSampleStep,
        run_fused_probabilistic_loop,
    )
    from dspark_cute.cutedsl.markov.loop import run_probabilistic_loop
    from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

    vocab, vt, rank = w2.shape[0], w1.shape[0], w1.shape[1]
    c = markov_sample_constants(vocab, vt, rank, 0.0625, 30.0)
    sample = MarkovSampleStep(c, w1, d2t, max_rows=max(rows))
    sample.prepare()
    greedy = next(v for k, v in variants.items() if "N launches" in k and "PDL on" in k)
    fused = MarkovBiasSampleStep(c, w1, d2t, w2, min(max(rows), MAX_SAMPLE_ROWS))
    fused.bind(greedy)
    embed = torch.empty(max(rows), rank, dtype=torch.bfloat16, device="cuda")
    out = []
    for r in rows:
        base = (torch.randn(r * n, vocab, generator=gen, device="cuda") * 4).to(torch.bfloat16).view(r, n, vocab)
        prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
        idx_map = torch.arange(r, device="cuda")[:, None].expand(r, n).contiguous()
        temperature = torch.full((r,), 0.7, device="cuda")
        temperature[0] = 0.0
        seeds = torch.randint(0, 2**62, (r,), generator=gen, device="cuda")
        pos = torch.randint(1, 10**6, (r, n), generator=gen, device="cuda")
        caches = [torch.zeros(r, n, vt, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        toks = [torch.full((r, n), -1, dtype=torch.int64, device="cuda") for _ in range(2)]
        ref_args = (base, prev, w2, toks[0], embed, idx_map, temperature, seeds, pos, caches[0])
        t_ref = timed(lambda a=ref_args: run_probabilistic_loop(sample, *a))
        cells = [f"{t_ref:.1f}"]
        if r in fused.rows:
            args = (base, prev, toks[1], idx_map, temperature, seeds, pos, caches[1])
            t = timed(lambda a=args: run_fused_probabilistic_loop(fused, *a))
            same = torch.equal(toks[0], toks[1]) and torch.equal(caches[0].view(torch.int16),
                                                                 caches[1].view(torch.int16))
            cells.append(f"{t:.1f}{'' if same else ' DIFFERS'}")
        else:
            cells.append("-")
        out.append(f"| {r} | " + " | ".join(cells) + " |")
        print(out[-1], flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
