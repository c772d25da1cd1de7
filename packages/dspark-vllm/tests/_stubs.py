"""Stand-ins for the DSpark kernels' host classes (the kernel contract of
``dspark_core.contracts.kernels``: built from their constants and the tensors
the executor binds; ``prepare`` / ``problem`` / ``takes`` / ``run`` /
``launch``), each computing vLLM 0.33.0's stock op for its part with vLLM's
own modules and functions, configured from the constants alone:

- row norm, boundary, context norms: ``MuseSpark1xRMSNorm`` (or its
  input-scale subclass) built from the norm constants, its weight the bound
  tensor; the boundary's connection a ``MuseSpark1xNormPreservingResidual
  Connection`` whose coefficients are the bound alpha and beta;
- QKV epilogue: ``_custom_ops.fused_muse_spark_qknorm_rope_kv_insert`` (on
  the CPU the tests' torch stand-in) over the bound RoPE table;
- o-gate: ``nvidia.model.rms_norm_gated`` (FLA's, on the CPU the torch stand-in);
- MLP activation: ``SiluAndMul.forward_native``;
- context chain: the stock chain's steps (norms, ``torch.bmm`` against the
  bound stacked K/V weight, the ATen K-norm, the rotary op over the bound
  table, the backend's insert);
- ordered GEMM: bound to no row count (its check needs the live cuBLAS),
  so vLLM's projections run.

So a decode over them is vLLM's forward exactly where the constants and the
bound tensors carry everything the part needs. Each takes the rows the kernel
contract states for its kernel (``contracts.kernels.MAX_ROWS``), or fewer
where a test caps it (``capped``). ``CALLS`` records launches.
"""

from __future__ import annotations

import types

import torch
import vllm._custom_ops as ops
import vllm.models.muse_spark.nvidia.model as muse_nv
from _draft import insert_rows
from torch import nn
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.models.muse_spark.common.layers import (
    MuseSpark1xNormPreservingResidualConnection,
    MuseSpark1xRMSNorm,
    MuseSpark1xRMSNormWithInputScale,
)

from dspark_core.contracts.kernels import MAX_ROWS
from dspark_core.planner import policy

CALLS: list[tuple] = []
D = 64


def vllm_norm(c, hidden: int, weight) -> nn.Module:
    """vLLM's norm for NormConstants ``c``: the gain centre always added, as its Triton kernel adds it."""
    cls = MuseSpark1xRMSNormWithInputScale if c.weight_before_norm else MuseSpark1xRMSNorm
    norm = cls(hidden, eps=c.eps, has_weight=weight is not None, zero_centered_gamma=True)
    norm.gain_center = c.gain_center
    if weight is not None:
        norm.weight = nn.Parameter(weight, requires_grad=False)
    return norm


class Kernel:
    """The contract's verbs; a call of more rows than ``max_rows`` (the
    contract's for ``NAME``) is not taken."""

    NAME = ""

    @property
    def max_rows(self) -> int:
        return MAX_ROWS[self.NAME]

    def prepare(self, **variants):
        self.prepared = variants

    def problem(self, *operands, **kw):
        m = operands[0].shape[0]
        return f"{m} rows, more than {self.max_rows}" if m > self.max_rows else None

    def takes(self, *operands, **kw):
        return self.problem(*operands, **kw) is None

    def run(self, *operands, **kw):
        why = self.problem(*operands, **kw)
        if why:
            raise ValueError(why)
        return self.launch(*operands, **kw)


def capped(cls: type, rows: int) -> type:
    """The stand-in ``cls`` taking at most ``rows`` rows a call (its ``max_rows``)."""
    return type(f"Capped{cls.__name__}", (cls,), {"max_rows": rows})


class RowNorm(Kernel):
    NAME = policy.ROW_NORM

    def __init__(self, constants, weight):
        self.norm = vllm_norm(constants.norm, constants.hidden_size, weight)

    def launch(self, x):
        CALLS.append(("row_norm", x.shape[0]))
        return self.norm(x, out_dtype=torch.bfloat16)


class Boundary(Kernel):
    NAME = policy.BOUNDARY

    def __init__(self, constants, alpha, beta, post_weight, pre_weight):
        h = constants.hidden_size
        self.post, self.pre = vllm_norm(constants.post, h, post_weight), vllm_norm(constants.pre, h, pre_weight)
        self.conn = MuseSpark1xNormPreservingResidualConnection(h)
        self.conn.alpha, self.conn.beta, self.conn._coefficients_ready = alpha, beta, True

    def launch(self, branch, stream, store):
        CALLS.append(("boundary", branch.shape[0], store))
        new = self.conn(stream=stream.float(), branch=self.post(branch, out_dtype=torch.bfloat16))
        return (new if store else None), self.pre(new.to(torch.bfloat16), out_dtype=torch.bfloat16)


class QKVEpilogue(Kernel):
    NAME = policy.QKV_EPILOGUE

    def __init__(self, constants, q_norm_weight, table):
        self.c, self.table = constants, table

    def problem(self, qkv, positions, slots, cache):
        if slots is None or cache.numel() == 0:
            return "no KV cache bound"
        return super().problem(qkv)

    def launch(self, qkv, positions, slots, cache):
        CALLS.append(("qkv_epilogue", qkv.shape[0]))
        c = self.c
        ops.fused_muse_spark_qknorm_rope_kv_insert(
            qkv, positions, c.num_heads, c.kv_heads, D, c.q_eps, cos_sin_cache=self.table if c.rope else None,
            rotary_dim=D if c.rope else 0, slot_mapping=slots, kv_cache=cache, block_size=cache.shape[2])
        return qkv[:, : c.num_heads * D].reshape(qkv.shape[0], c.num_heads, D)


class OGate(Kernel):
    NAME = policy.O_GATE

    def __init__(self, constants):
        self.c = constants

    def launch(self, out, og):
        CALLS.append(("o_gate", out.shape[0]))
        return muse_nv.rms_norm_gated(out, og, None, None, "sigmoid", eps=self.c.eps)


class MlpActivation(Kernel):
    NAME = policy.MLP_ACTIVATION

    def __init__(self, constants):
        self.c = constants

    def launch(self, gu):
        CALLS.append(("mlp_activation", gu.shape[0]))
        return SiluAndMul.forward_native(gu)


class ContextChain(Kernel):
    NAME = policy.CONTEXT_CHAIN

    def __init__(self, constants, hidden_weight, pre_weights, kv_weight, table):
        c = constants
        h, n = c.norms.hidden_size, c.norms.num_layers
        self.hidden = vllm_norm(c.norms.hidden, h, hidden_weight)
        self.pres = [vllm_norm(c.norms.pre, h, w) for w in (pre_weights or [None] * n)]
        self.kv_weight, self.store, self.table = kv_weight, c.store, table

    def problem(self, states, positions, caches, slots):
        return None if states.dim() == 2 and slots is not None else "states of [T, H] and slots"

    def launch(self, states, positions, caches, slots):
        CALLS.append(("context_chain", states.shape[0]))
        L, t, kvh = len(self.pres), states.shape[0], self.store.kv_heads
        h = self.hidden(states)
        kv = torch.bmm(torch.stack([pre(h) for pre in self.pres]), self.kv_weight().transpose(1, 2))
        kv = kv.view(L, t, 2, kvh, D).permute(2, 0, 1, 3, 4).contiguous()
        k, v = kv[0], kv[1]
        kf = k.float()
        k = (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + self.store.k_eps)).to(k.dtype)
        if self.store.rope:
            rope = types.SimpleNamespace(head_size=D, rotary_dim=D, is_neox_style=False,
                                         _match_cos_sin_cache_dtype=lambda q: self.table)
            k, _ = RotaryEmbedding.forward_cuda(rope, positions.repeat(L), k.reshape(L * t, kvh, D), None)
            k = k.view(L, t, kvh, D)
        per_layer = slots if isinstance(slots, (list, tuple)) else [slots] * L
        for i, cache in enumerate(caches):
            if per_layer[i] is not None:
                insert_rows(cache, k[i], v[i], per_layer[i])


class OrderedGemm(Kernel):
    """The ordered GEMM's stand-in: on a CPU weight the executor runs no
    build-time check (that needs the live cuBLAS), so no row count is bound
    and every projection stays vLLM's; ``bind_orders`` still records what a
    test gives it."""

    def __init__(self, constants, weight):
        self.role, self.weight, self.orders, self.reasons = constants.role, weight, {}, {}

    @staticmethod
    def run_order(x, weight, order):
        raise AssertionError("no build-time check runs on a CPU weight")

    def bind_orders(self, orders, reasons=None):
        self.orders, self.reasons = dict(orders), dict(reasons or {})

    def problem(self, x, out=None):
        m = x.shape[0]
        return None if m in self.orders else self.reasons.get(m, f"no order for m = {m}")

    def launch(self, x, out=None):
        raise AssertionError("the stand-in binds no row count")


KERNELS = {policy.ROW_NORM: RowNorm, policy.BOUNDARY: Boundary, policy.QKV_EPILOGUE: QKVEpilogue,
           policy.O_GATE: OGate, policy.MLP_ACTIVATION: MlpActivation, policy.CONTEXT_CHAIN: ContextChain,
           policy.ORDERED_GEMM: OrderedGemm}
