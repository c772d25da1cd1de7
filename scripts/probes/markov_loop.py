"""Probe (not part of any package): the greedy Markov stage alone, N steps
in one CUDA graph, on the reference head (V_draft 32768, V_target 202752,
rank 256, d2t, soft cap 30): DSpark's fused step after cuBLAS's bias GEMM
(``markov.loop.run_greedy_loop``: 1 + 2N launches) against the step with
its bias GEMM (``markov.bias_step``: N launches) and the N steps in one
cooperative launch (``markov.persistent``, up to 32 requests, CuTe DSL 4.8),
with and without PDL, the tokens compared (issue 33's Markov target). Numbers of 2026-12-04 (H200):
``docs/gemm-order.md``.

``python scripts/probes/markov_loop.py [--rows 1,4,16,64] [--steps 4]``
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
    print(f"\nMarkov stage, N = {n}, {torch.cuda.get_device_name()}, seed {a.seed}; µs per loop (CUDA graph, median)")
    print("| requests | after cuBLAS's bias GEMM (1 + 2N launches) | " + " | ".join(variants) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
