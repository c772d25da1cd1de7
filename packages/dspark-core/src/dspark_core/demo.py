"""The DSpark demo: build the reference draft, print its plan with every
reason, store a context's K/V and run greedy decode steps on the stock path,
timing each step.

    python -m dspark_core.demo [--config CONFIG.json] [--steps 8] [--block 4]

On a machine with a CUDA GPU it runs there; the executor that runs the fused
plan (DraftDecode) plugs in here once a backend provides it, and the demo then
runs both paths and says whether they match bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time

import torch

from . import policy
from .config import DraftConfig
from .model import DraftModel, StepInputs
from .plan import plan_draft

log = logging.getLogger("dspark.demo")


def _target(device: torch.device) -> policy.Target:
    if device.type != "cuda":
        return policy.Target(platform="cpu", kernels=policy.installed_kernels())
    major, minor = torch.cuda.get_device_capability(device)
    arch = {9: "sm_90a", 10: "sm_100a"}.get(major, f"sm_{major}{minor}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return policy.Target("cuda", arch, sms, 1, policy.installed_kernels())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(config: DraftConfig, steps: int, block: int, context: int, device: torch.device) -> dict:
    """Build, plan and decode; returns the tokens and step times."""
    t0 = time.perf_counter()
    model = DraftModel(config, device=device)
    print(f"built the reference draft ({config.num_layers} layers, hidden {config.hidden_size}) "
          f"on {device} in {time.perf_counter() - t0:.1f} s")
    plan = plan_draft(model, _target(device))
    plans = [plan]
    if device.type != "cuda":
        # What the same draft gets on one H200 with the installed backends.
        plans.append(plan_draft(model, policy.Target(kernels=policy.installed_kernels())))
    for p in plans:
        print(p.format())
        for line in p.refused():
            print(f"  why: {line}")

    gen = torch.Generator().manual_seed(config.seed + 1)
    blocks = (context + steps * block) // config.kv_block_size + 2
    caches = model.make_caches(blocks, device)
    states = torch.randn(context, config.hidden_size, generator=gen).to(torch.bfloat16).to(device)
    positions = torch.arange(context, device=device)
    model.precompute_and_store_context_kv(states, positions, caches, positions)
    print(f"stored the K/V of {context} context tokens in {len(caches)} paged caches")

    tokens = torch.randint(0, config.vocab_size, (block,), generator=gen).to(device)
    out, times = [], []
    pos = context
    with torch.no_grad():
        for _ in range(steps):
            step = StepInputs.block(pos, block, device)
            _sync(device)
            start = time.perf_counter()
            hidden = model(model.embed_tokens(tokens), step, caches)
            tokens = model.logits(hidden).argmax(-1)
            _sync(device)
            times.append(time.perf_counter() - start)
            out.append(tokens.tolist())
            pos += block
    print(f"stock path: {steps} steps of {block} token(s); greedy tokens:")
    for i, (t, dt) in enumerate(zip(out, times)):
        print(f"  step {i}: {t}  ({dt * 1e3:.2f} ms)")
    fused_backend = importlib.util.find_spec("dspark_cute") is not None
    if device.type == "cuda" and fused_backend:
        print("the specialized decode (DraftDecode) is not built yet: only the stock path ran")
    elif device.type != "cuda":
        print("no CUDA GPU here: the plan is for a GPU, the stock path ran on the CPU")
    return {"tokens": out, "times": times, "plan": plan}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_core.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a DraftConfig JSON file (default: the reference draft)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--block", type=int, default=1, help="tokens per step (1 to 16)")
    parser.add_argument("--context", type=int, default=64, help="context tokens stored first")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not 1 <= args.block <= policy.MAX_DECODE_ROWS:
        print(f"error: --block must lie in [1, {policy.MAX_DECODE_ROWS}]", file=sys.stderr)
        return 2
    config = DraftConfig.from_json(args.config) if args.config else DraftConfig()
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    run_demo(config, args.steps, args.block, args.context, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
