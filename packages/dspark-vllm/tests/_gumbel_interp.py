"""Runs vLLM 0.33.0's Gumbel sampler functions under Triton's interpreter on
the CPU (``TRITON_INTERPRET=1``, set before Triton is imported, and
``CUDA_VISIBLE_DEVICES=""`` so vLLM keeps the real Triton functions) for
``test_vllm_gumbel.py``, in a process of its own: the pytest process has imported
vLLM with its placeholder ``triton.jit``.

``python _gumbel_interp.py IN OUT``: ``IN`` a ``torch.save`` of the inputs,
``OUT`` where the outputs go (hash, uniform, noise per element; the sampled
ids and the cache of ``gumbel_sample``)."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import vllm  # noqa: E402,F401
from vllm.v1.worker.gpu.sample import gumbel as g  # noqa: E402


@triton.jit
def _probe(seed_ptr, pos_ptr, off_ptr, hash_ptr, u_ptr, noise_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    seed = tl.load(seed_ptr + i, mask=m, other=0)
    pos = tl.load(pos_ptr + i, mask=m, other=0)
    off = tl.load(off_ptr + i, mask=m, other=0)
    tl.store(hash_ptr + i, g.murmur3_hash32(seed, pos, off).to(tl.int64), mask=m)
    u = g.murmur3_uniform32(seed, pos, off)
    tl.store(u_ptr + i, u, mask=m)
    tl.store(noise_ptr + i, -tl.log(-g._log1p_neg_stable(u)), mask=m)


def main(src: str, dst: str) -> None:
    a = torch.load(src)
    n = a["seed"].numel()
    out = {"hash": torch.zeros(n, dtype=torch.int64), "u": torch.zeros(n), "noise": torch.zeros(n)}
    _probe[(triton.cdiv(n, 256),)](a["seed"], a["pos"], a["off"], out["hash"], out["u"], out["noise"], n, BLOCK=256)
    cache = a["cache"].clone()
    out["sampled"] = g.gumbel_sample(a["logits"], a["idx_map"], a["temperature"], a["seeds"], a["positions"],
                                     apply_temperature=True, is_drafting=True, logits_cache=cache,
                                     logits_cache_col=torch.tensor(a["col"], dtype=torch.int32))
    out["cache"] = cache
    torch.save(out, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
