"""A small evaluator of straight-line inline-PTX blocks (the ``asm`` texts of
``dspark_cute.ptx.markov``) on NumPy arrays, so a CPU test can run them on
many inputs and compare with the spec.

Registers hold unsigned 64-bit NumPy arrays of bit patterns (an FP32 value
as its 32 bits). FP32 ``add``/``sub``/``mul`` ``.rn`` are NumPy's float32
operations (IEEE, nearest even); ``fma.rn[.ftz]`` is the spec's exact
``numerics.fma_rn`` (no flushing: the callers' operands are normal);
``ex2.approx.ftz`` and ``rcp.approx.ftz`` are the spec's CPU stand-ins.
Operands ``$0``, ``$1``, ... are the asm's; ``evaluate`` returns ``$0``.
Only the instructions these blocks use are known; another one raises."""

from __future__ import annotations

import re

import numpy as np
import torch

from dspark_core.spec import numerics

M32 = np.uint64(0xFFFFFFFF)


def _f(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint64) & M32).astype(np.uint32).view(np.float32)


def _b(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)


def _torch_op(fn, *xs) -> np.ndarray:
    out = fn(*(torch.from_numpy(np.ascontiguousarray(_f(x))) for x in xs))
    return _b(out.numpy())


def _imm(tok: str):
    tok = tok.strip()
    if re.fullmatch(r"0[fF][0-9A-Fa-f]{8}", tok):
        return np.uint64(int(tok[2:], 16))
    if re.fullmatch(r"-?\d+", tok):
        return np.uint64(int(tok) & 0xFFFFFFFF)
    if re.fullmatch(r"0x[0-9A-Fa-f]+", tok):
        return np.uint64(int(tok, 16))
    return None


def evaluate(text: str, inputs: list, n: int) -> np.ndarray:
    """``$0`` of the asm ``text`` with ``$1``, ``$2``, ... = ``inputs`` (bit
    arrays, broadcast to ``n`` elements)."""
    regs: dict[str, np.ndarray] = {f"${k + 1}": np.broadcast_to(np.asarray(v, dtype=np.uint64), (n,)).copy()
                                   for k, v in enumerate(inputs)}

    def val(tok: str) -> np.ndarray:
        c = _imm(tok)
        return np.full(n, c, dtype=np.uint64) if c is not None else regs[tok.strip()]

    body = text.strip()
    body = body[1:-1] if body.startswith("{") and body.endswith("}") else body
    for stmt in body.split(";"):
        s = stmt.strip()
        if not s or s.startswith(".reg"):
            continue
        pred = None
        m = re.match(r"@(!?)(\w+)\s+(.*)", s)
        if m:
            pred = (m.group(1) == "!", m.group(2))
            s = m.group(3)
        op, _, rest = s.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]
        dest, src = args[0], args[1:]
        if dest.startswith("{"):  # mov.b64 {lo, hi}, x
            lo, hi = (r.strip() for r in dest.strip("{}").split(","))
            x = val(src[0])
            regs[lo], regs[hi] = x & M32, x >> np.uint64(32)
            continue
        if src and src[0].startswith("{"):  # mov.b64 d, {lo, hi}
            lo, hi = (val(r) for r in src[0].strip("{}").split(","))
            out = (lo & M32) | ((hi & M32) << np.uint64(32))
        elif op in ("mov.b32", "mov.b64", "mov.f32"):
            out = val(src[0])
        elif op == "cvt.u32.u64":
            out = val(src[0]) & M32
        elif op == "mul.lo.u32":
            out = (val(src[0]) * val(src[1])) & M32
        elif op == "mad.lo.u32":
            out = (val(src[0]) * val(src[1]) + val(src[2])) & M32
        elif op == "shf.l.wrap.b32":
            a, k = val(src[0]), int(src[2])
            out = ((a << np.uint64(k)) | (a >> np.uint64(32 - k))) & M32
        elif op in ("xor.b32", "and.b32", "or.b32"):
            f = {"xor.b32": np.bitwise_xor, "and.b32": np.bitwise_and, "or.b32": np.bitwise_or}[op]
            out = f(val(src[0]), val(src[1])) & M32
        elif op == "not.b32":
            out = (~val(src[0])) & M32
        elif op == "shr.u32":
            out = val(src[0]) >> np.uint64(int(src[1]))
        elif op in ("add.s32", "sub.s32"):
            a, b = val(src[0]).astype(np.int64), val(src[1]).astype(np.int64)
            out = ((a + b) if op == "add.s32" else (a - b)).astype(np.uint64) & M32
        elif op == "cvt.rn.f32.u32":
            out = _b(val(src[0]).astype(np.float64).astype(np.float32))
        elif op == "cvt.rn.f32.s32":
            out = _b(val(src[0]).astype(np.uint32).view(np.int32).astype(np.float64).astype(np.float32))
        elif op in ("add.rn.f32", "sub.rn.f32", "mul.rn.f32"):
            f = {"add.rn.f32": np.add, "sub.rn.f32": np.subtract, "mul.rn.f32": np.multiply}[op]
            with np.errstate(all="ignore"):
                out = _b(f(_f(val(src[0])), _f(val(src[1]))))
        elif op in ("fma.rn.f32", "fma.rn.ftz.f32"):
            out = _torch_op(numerics.fma_rn, val(src[0]), val(src[1]), val(src[2]))
        elif op == "ex2.approx.ftz.f32":
            out = _torch_op(numerics.ex2_approx_ftz, val(src[0]))
        elif op == "rcp.approx.ftz.f32":
            out = _torch_op(numerics.rcp_approx_ftz, val(src[0]))
        elif op == "neg.f32":
            out = val(src[0]) ^ np.uint64(0x80000000)
        elif op == "abs.f32":
            out = val(src[0]) & np.uint64(0x7FFFFFFF)
        elif op == "copysign.f32":  # d = src[1] with the sign of src[0]
            out = (val(src[1]) & np.uint64(0x7FFFFFFF)) | (val(src[0]) & np.uint64(0x80000000))
        elif op == "max.f32":
            out = _b(np.fmax(_f(val(src[0])), _f(val(src[1]))))
        elif op in ("setp.lt.f32", "setp.gt.f32", "setp.ge.f32", "setp.lt.u32", "setp.eq.b32", "setp.nan.f32"):
            a, b = val(src[0]), val(src[1])
            if op == "setp.lt.u32":
                out = a < b
            elif op == "setp.eq.b32":
                out = a == b
            elif op == "setp.nan.f32":
                out = np.isnan(_f(a)) | np.isnan(_f(b))
            else:
                cmp = {"setp.lt.f32": np.less, "setp.gt.f32": np.greater, "setp.ge.f32": np.greater_equal}[op]
                out = cmp(_f(a), _f(b))
        elif op in ("selp.f32", "selp.b32"):
            out = np.where(regs[src[2]], val(src[0]), val(src[1]))
        elif op == "shr.s32":
            out = (val(src[0]).astype(np.uint32).view(np.int32) >> int(src[1])).astype(np.int64).astype(np.uint64) & M32
        else:
            raise NotImplementedError(f"ptx_eval does not know {op}")
        if pred is not None:
            take = regs[pred[1]] if not pred[0] else ~regs[pred[1]]
            out = np.where(take, out, regs[dest])
        regs[dest] = out
    return regs["$0"]


__all__ = ["evaluate"]
