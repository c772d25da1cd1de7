"""The DSpark side of ``bench_draft_step``: the plugin's step beside the
stock one (``DSparkStep``: its ``DraftDecode``, fc and the LM head on the
ordered GEMM where the plugin puts them, its Markov stage, each part's DSpark
call and the whole step), the draft's description over the stock ops
(``stock_description``) and the step's shape (``shape_of``)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from step_markov import _project, fused_markov, ordered_projection

from dspark_core.contracts.kernels import kernel_class
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.adapter import describe
from dspark_core.runtime.decode import DraftDecode

BF16 = torch.bfloat16


def shape_of(m: int, n: int) -> tuple[int, int]:
    """``(requests, N)`` of a step of ``m`` rows: one request of one token
    for m = 1, else m / n requests of n tokens."""
    if m == 1:
        return 1, 1
    if m < 1 or m % n:
        raise ValueError(f"rows must be 1 or a multiple of N = {n}, not {m}")
    return m // n, n


class DSparkStep:
    """The plugin's step (module docstring) beside ``stock`` (a
    ``StockStep``): its ``DraftDecode``, its per-part calls and its whole
    step."""

    def __init__(self, model, stock, device, kernels: frozenset[str], target=None, markov: str = "auto",
                 asked: frozenset[str] = frozenset(), steps: int = 4, outside: bool = False,
                 step_rows=None) -> None:
        self.model, self.stock = model, stock
        draft = stock_description(model, stock)
        target = target or policy.device_target(device, 1, kernels)
        self.plan = plan_draft(draft, target.opt_in(asked))
        self.decode = DraftDecode(draft, self.plan, None, prefetch=None,
                                  kernels={k: kernel_class(k) for k in kernels}, step_rows=step_rows)
        self.decode.prepare()
        ordered = (policy.ORDERED_GEMM in kernels and policy.ORDERED_GEMM in asked and device.type == "cuda"
                   and any(p.fused for p in self.plan.ordered_gemms))
        # fc and the LM head on the ordered GEMM where its check and timing chose
        # it, as the plugin runs them (dspark_vllm.projections: where the decode
        # runs it); the Markov bias of the loop after the bias step too where
        # ``outside`` (beyond the plugin). fc's rows: the step's context tokens.
        rows = None if step_rows is None else sorted(m for m in step_rows if m <= 64)
        self.fc = ordered_projection("fc", stock.fc, rows) if ordered else None
        self.lm = ordered_projection("lm_head", stock.head.lm_head, rows) if ordered else None
        bias_rows = None if rows is None else sorted({shape_of(m, steps)[0] for m in rows})  # requests
        bias = ordered_projection("markov_bias", stock.head.markov_w2, bias_rows) if ordered and outside else None
        self.markov, self.markov_label = fused_markov(stock, markov, bias, steps)
        self.last = 2 * len(model.layers) - 1

    def decisions(self) -> list:
        """The build's timing decisions (``gemm_decide.GemmDecision``) of
        every projection the DSpark side put on the ordered GEMM, one a shape."""
        gemms = list(self.decode.ordered.values()) + [g for g in (self.fc, self.lm) if g is not None]
        seen, out = set(), []
        for g in gemms:
            d = getattr(g, "decision", None)
            if d is not None and d.what not in seen:
                seen.add(d.what)
                out.append(d)
        return out

    def part(self, kind: str):
        """``(prep, fn)`` of the DSpark call of a stock part of ``kind`` (a
        ``StockStep`` method's name), or None where both sides run the same
        op: ``prep(args)`` adapts the stock operands once, outside timing."""
        d, st = self.decode, self.stock
        same = None
        keep = lambda args: args  # noqa: E731

        def refused(kernel, name: str, *operands) -> None:
            if kernel is not None:
                d._log_once(logging.WARNING, f"{name} ran stock: {kernel.problem(*operands)}")
        if kind == "context":
            if d.context is None:
                return same
            return keep, lambda states, pos, slots, caches: (
                _stored(d.store_context_kv(states, pos, caches, slots), st, states, pos, slots, caches))
        if kind == "embed":
            return keep, lambda ids: (F.embedding(ids.long(), self.model.embed),)
        if kind == "input_norm":
            return (lambda args: (args[0].to(BF16),)), lambda x: (d._first_norm(x),)
        if kind == "qk_front":  # as DraftDecode runs the epilogue (its takes, else the stock op, logged)
            def front(i, qkv, positions, slots, cache):
                kernel = d.epilogues[i]
                if kernel is None or not kernel.takes(qkv, positions, slots, cache):
                    refused(kernel, f"layer {i}'s QKV epilogue", qkv, positions, slots, cache)
                    return st.qk_front(i, qkv, positions, slots, cache)
                kernel.launch(qkv, positions, slots, cache)
                return qkv, cache
            return keep, front
        if kind == "o_gate":
            def gate(i, attn, qkv):
                kernel, og = d.o_gates[i], st.o_gate_view(qkv)
                if kernel is None or not kernel.takes(attn, og):
                    refused(kernel, f"layer {i}'s o-gate", attn, og)
                    return st.o_gate(i, attn, qkv)
                out = kernel.launch(attn, og)
                return (out.reshape(out.shape[0], -1),)
            return keep, gate
        if kind == "boundary":
            def prep(args):
                j, branch, stream = args
                return (j, branch, stream.to(BF16) if j == 0 else stream)
            return prep, lambda j, branch, stream: d._boundary(j, branch, stream, j != self.last)
        if kind == "activation":
            return keep, lambda i, gu: (d._activation(i, gu),)
        gemms = {"qkv_gemm": ("qkv_proj", st.qkv_gemm), "o_proj": ("o_proj", st.o_proj),
                 "gate_up": ("gate_up", st.gate_up), "down": ("down", st.down)}
        if kind in gemms and d.ordered:
            role, stock_fn = gemms[kind]
            return keep, lambda i, x: (d._linear(i, role, x, lambda v: stock_fn(i, v)[0]),)
        if kind == "combine" and self.fc is not None:
            return keep, lambda aux, buf: (self.combine(aux, buf),)
        if kind == "lm_head" and self.lm is not None:
            return keep, lambda h, idx: (_project(self.lm, h[idx], st.head.lm_head),)
        if kind == "markov" and self.markov is not None:
            return keep, self.markov
        return same

    def combine(self, aux, hidden_buf):
        """``StockStep.combine`` with fc on the ordered GEMM where it takes
        the rows, written straight into the buffer (the stock copies
        ``F.linear``'s output in)."""
        rows = aux.shape[0]
        out = hidden_buf[:rows]
        if self.fc.takes(aux, out):
            return self.fc.launch(aux, out)
        out.copy_(F.linear(aux, self.stock.fc))
        return out

    def step(self, batch, caches, hidden_buf, draft_tokens) -> tuple:
        """The whole step: the same combine, the context chain, the embedding
        as the BF16 stream, the decode, the same LM head, the Markov loop."""
        st = self.stock
        states = self.combine(batch.aux, hidden_buf) if self.fc is not None else st.combine(batch.aux, hidden_buf)[0]
        tensors = [c.tensor for c in caches]
        if not self.decode.store_context_kv(states, batch.ctx_positions, caches, batch.ctx_slots):
            st.context(states, batch.ctx_positions, batch.ctx_slots, tensors)
        x = F.embedding(batch.input_ids.long(), self.model.embed)
        h = self.decode.run(x, batch.step, caches)
        if self.lm is not None:
            logits = _project(self.lm, h[batch.sample_indices], st.head.lm_head)
        else:
            (logits,) = st.lm_head(h, batch.sample_indices)
        (self.markov or st.markov)(logits, batch.input_ids, batch.anchor_idx, batch.n, draft_tokens)
        return h, logits, draft_tokens




def _stored(fused: bool, stock, states, positions, slots, caches) -> tuple:
    if not fused:
        stock.context(states, positions, slots, caches)
    return tuple(caches)


def stock_description(model, stock):
    """``describe(model)`` with every stock call on vLLM's stock ops
    (``stock``), so the executor's unfused parts and fallbacks run what the
    STOCK side runs."""
    draft = describe(model)
    tensor = lambda c: getattr(c, "tensor", c)  # noqa: E731
    norms = {id(n): n for n in [draft.final_norm, draft.context.hidden_norm]
             + [x for layer in draft.layers for b in (layer.attention_boundary, layer.ffn_boundary)
                for x in (b.post, b.pre)] + [layer.input_norm for layer in draft.layers]}
    for norm in norms.values():
        norm.stock = lambda x, out_dtype=None, norm=norm: stock.norm(x, norm)
    for b in draft.boundaries():
        b.connection.stock = lambda stream, branch, c=b.connection: stock.gated_residual(c, stream, branch)
    for i, layer in enumerate(draft.layers):
        a, mlp = layer.attention, layer.mlp
        a.project_qkv = lambda x, i=i: stock.qkv_gemm(i, x)[0]

        def front_from(qkv, step, caches, i=i, a=a):
            stock.qk_front(i, qkv, step.positions, step.slots, tensor(caches[i]))
            q, _, _, og = a.split_qkv(qkv)
            return q, og
        a.front_from = front_from
        a.attend = lambda q, step, caches, i=i: stock.attend(q.contiguous(), tensor(caches[i]), step.attn_slots)
        a.gate = lambda out, og, i=i: stock.S.stock_o_gate(out, og, stock.layers[i].self_attn.o_norm.eps)
        a.project_out = lambda g, i=i: stock.o_proj(i, g)[0]
        a.cache = lambda step, caches, i=i: (tensor(caches[i]), step.slots)
        mlp.project_gate_up = lambda x, i=i: stock.gate_up(i, x)[0]
        mlp.activation = lambda gu, i=i: stock.activation(i, gu)[0]
        mlp.project_down = lambda h, i=i: stock.down(i, h)[0]
    draft.context.stock = lambda states, positions, caches, slots: stock.context(
        states, positions, slots, [tensor(c) for c in caches])
    return draft


__all__ = ["DSparkStep", "shape_of", "stock_description"]
