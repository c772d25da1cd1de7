"""dspark-core's spec of vLLM 0.33.0's Gumbel sampler (``spec.gumbel``)
against vLLM's own Triton functions run by Triton's interpreter on the CPU
(``_gumbel_interp.py``, a process of its own).

Exact (bit for bit): the MurmurHash3 words and the uniforms for random
seeds (both words), positions and columns; ``gumbel_sample``'s sampled ids
and its logits cache for rows whose winner leads by more than any noise can
bridge (a planted +200, so the token does not depend on the noise's last
bits), rows at temperature 0 (no noise: ties, -0.0 against +0.0 and -inf
planted), invalid rows (``idx_map`` -1: nothing cached) and -inf columns (the
reduced vocabulary's unmapped target ids). Within 4 ulp (or 2^-21 where the
noise crosses 0 and its last step cancels): the noise, since
the interpreter's ``tl.log`` is NumPy's ``log``, not libdevice's ``logf``
that the spec (and the GPU) computes; the spec's ``logf`` is checked there
against FP64 within 2 ulp. The GPU's ``div.full`` and ``logf`` bits are the
spec's statements from Triton 3.8's PTX, not checked on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark_core.spec import gumbel  # noqa: E402

SEED = int(os.environ.get("DSPARK_SEED", "") or time.time_ns() % (2**31 - 1))
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Inputs drawn from the session seed, vLLM's outputs from the interpreter: ``(inputs, outputs)``."""
    seed = (SEED + zlib.crc32(b"test_gumbel")) % 2**31
    print(f"seed {seed} (DSPARK_SEED={SEED})")
    g = torch.Generator().manual_seed(seed)
    n = 4096
    a = {
        "seed": torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64),
        "pos": torch.randint(0, 2**31, (n,), generator=g, dtype=torch.int64),
        "off": torch.randint(0, 300000, (n,), generator=g, dtype=torch.int64),
    }
    a["seed"][:4] = torch.tensor([0, -1, 2**32, 2**63 - 1])
    t, v, reqs, cols = 9, 2500, 12, 4
    logits = (torch.randn(t, v, generator=g) * 2).to(torch.bfloat16)
    logits[:, ::3] = float("-inf")  # unmapped target columns
    winners = torch.randint(1, v // 3, (t,), generator=g) * 3 + 1
    logits[torch.arange(t), winners] = 200.0
    logits[6] = logits[6].clamp(max=1.0)  # temperature 0: a tie of two maxima, -0.0 before +0.0 below them
    logits[6, [40, 1000]] = 5.0
    logits[7, [10, 20]] = torch.tensor([-0.0, 0.0], dtype=torch.bfloat16)
    logits[7, 10:] = logits[7, 10:].clamp(max=0.0)
    logits[7, :10] = -1.0
    idx = torch.randperm(reqs, generator=g)[:t].to(torch.int32)
    idx[8] = -1
    temperature = torch.rand(reqs, generator=g) + 0.3
    temperature[idx[6]] = temperature[idx[7]] = 0.0
    a |= {"logits": logits, "idx_map": idx, "temperature": temperature,
          "seeds": torch.randint(-(2**62), 2**62, (reqs,), generator=g, dtype=torch.int64),
          "positions": torch.randint(0, 10**6, (t,), generator=g, dtype=torch.int64),
          "cache": torch.full((reqs, cols, v + 8), 7.0, dtype=torch.bfloat16), "col": 2, "winners": winners}
    root = tmp_path_factory.mktemp("gumbel")
    torch.save(a, root / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(HERE / "_gumbel_interp.py"), str(root / "in.pt"), str(root / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return a, torch.load(root / "out.pt")


def test_hash_and_uniform_are_vllms(run):
    a, out = run
    assert torch.equal(gumbel.murmur3_hash32(a["seed"], a["pos"], a["off"]), out["hash"])
    u = gumbel.uniform32(a["seed"], a["pos"], a["off"])
    assert torch.equal(u.view(torch.int32), out["u"].view(torch.int32))
    assert (u > 0).all() and (u < 1).all()
    assert len(set(out["hash"].tolist())) > 4000  # distinct inputs, distinct words (a constant hash fails)


def test_noise_within_4_ulp_of_the_interpreters(run):
    a, out = run
    mine = gumbel.gumbel_noise(gumbel.uniform32(a["seed"], a["pos"], a["off"]))
    ulp = (mine.view(torch.int32).long() - out["noise"].view(torch.int32).long()).abs()
    # Where the noise crosses 0, -log(w) of a w near 1 cancels: there the bound is absolute.
    close = (ulp <= 4) | ((mine - out["noise"]).abs() <= 2.0**-21)
    assert close.all(), (ulp.max(), (mine - out["noise"]).abs().max())


def test_logf_within_2_ulp(run):
    a, _ = run
    x = torch.cat([gumbel.uniform32(a["seed"], a["pos"], a["off"]), torch.tensor([2.0**-24, 1.0, 22.9, 0.75])])
    y = gumbel.logf(x).double()
    exact = torch.log(x.double())
    ulp = torch.from_numpy(np.spacing(np.abs(exact.float().numpy()))).double()
    assert ((y - exact).abs() <= 2 * ulp).all()
    assert gumbel.logf(torch.tensor([1.0])).item() == 0.0
    special = gumbel.logf(torch.tensor([float("inf"), float("nan"), -1.0]))
    assert special[0] == float("inf") and torch.isnan(special[1:]).all()


def test_sample_is_vllms_where_the_noise_cannot_decide(run):
    a, out = run
    cache = a["cache"].clone()
    got = gumbel.sample(a["logits"], a["idx_map"], a["temperature"], a["seeds"], a["positions"], True, cache,
                        a["col"])
    assert torch.equal(got, out["sampled"])
    assert torch.equal(cache.view(torch.int16), out["cache"].view(torch.int16))
    w = a["winners"]
    assert torch.equal(got[[0, 1, 2, 3, 4, 5, 8]], w[[0, 1, 2, 3, 4, 5, 8]])
    assert got[6] == 40 and got[7] == 10  # temperature 0: the first maximum; -0.0 (column 10) ties +0.0
    assert (cache[:, [0, 1, 3]] == 7.0).all()  # only the step's column is written ...
    untouched = sorted(set(range(12)) - set(a["idx_map"][a["idx_map"] >= 0].tolist()))
    assert (cache[untouched] == 7.0).all()  # ... of valid rows


def test_sample_refuses_nan():
    with pytest.raises(ValueError, match="reduction tree"):
        gumbel.sample(torch.tensor([[0.0, float("nan")]]), torch.tensor([0]), torch.tensor([1.0]),
                      torch.tensor([1]), torch.tensor([3]), True)
