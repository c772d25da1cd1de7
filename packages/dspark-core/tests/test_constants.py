"""The kernels' constants builders over the model-neutral description: what
each takes, and the refusal (``Unsupported``, a ValueError) for what it does
not reproduce."""

from __future__ import annotations

import pytest
import torch

from dspark_core.contracts.constants import (
    MlpActivationConstants,
    OGateConstants,
    mlp_activation_constants,
    o_gate_constants,
)
from dspark_core.errors import Unsupported
from dspark_core.runtime.description import MLP, HeadNorm


def _mlp(intermediate: int, unsupported: str | None = None) -> MLP:
    def unused(x):
        raise AssertionError("a constants builder runs no stock call")

    return MLP(None, None, intermediate, unused, unused, unused, unused, unsupported)


def test_activation_constants():
    assert mlp_activation_constants(_mlp(16384)) == MlpActivationConstants(16384)
    assert hash(MlpActivationConstants(8192)) == hash(MlpActivationConstants(8192))
    assert MlpActivationConstants(8192).key() != MlpActivationConstants(16384).key()
    with pytest.raises(Unsupported, match="multiple of 8"):
        mlp_activation_constants(_mlp(100))
    with pytest.raises(Unsupported, match="an MLP other than the stock gated one"):
        mlp_activation_constants(_mlp(16384, "an MLP other than the stock gated one (Linear)"))


def test_o_gate_constants():
    c = o_gate_constants(HeadNorm(64, 1e-5), 32)
    assert c == OGateConstants(32, 1e-5) and c != OGateConstants(32, 1e-6) and c != OGateConstants(64, 1e-5)
    assert OGateConstants(8, 0.0) != OGateConstants(8, -0.0)  # bit-exact equality, like the others
    with pytest.raises(Unsupported, match="weight"):
        o_gate_constants(HeadNorm(64, 1e-6, torch.ones(64)), 32)
    with pytest.raises(Unsupported, match="not 64"):
        o_gate_constants(HeadNorm(128, 1e-6), 32)
    with pytest.raises(Unsupported, match="at least one"):
        o_gate_constants(HeadNorm(64, 1e-6), 0)
    with pytest.raises(Unsupported, match="stock head norm"):
        o_gate_constants(HeadNorm(64, 1e-6, unsupported="a head norm other than the stock head norm"), 32)
    assert issubclass(Unsupported, ValueError)
