#!/usr/bin/env python
"""Build carryable binaries of the stock vLLM 0.33.0 kernels the DSpark draft runs.

Run with the vLLM 0.33.0 environment (its pinned Triton 3.8.0), on a CPU-only
machine:

    .nox/tests-vllm/bin/python scripts/stock/compile_stock.py [--out DIR]

It writes, under DIR (default ``.device/stock`` at the repository root):

* ``triton/<variant>.cubin`` + ``triton/<variant>.json``: the Triton kernels
  ``_rmsnorm_fwd_kernel`` (every variant the draft's norms can take) and the FLA
  ``layer_norm_gated_fwd_kernel`` (o-norm + sigmoid o-gate, sm_90 path) and
  the Gumbel sampler ``_gumbel_sample_kernel`` (the draft's probabilistic path)
  and the unified attention of vLLM's TRITON_ATTN backend
  (``kernel_unified_attention`` 2D / 3D and ``reduce_segments``, the
  specialization read off vLLM's own host code run on CPU tensors),
  compiled for each requested arch with the same specialization Triton's JIT
  would derive from the stock launch (pointer alignment, ``T == 1`` /
  ``T % 16 == 0``), plus the launch metadata (grid rule, block, shared memory,
  parameter order/types/offsets, constexprs, scratch sizes).
* ``so/<cubin>.cubin.xz`` + ``so/kernels.json``: the cubins of vLLM's CUDA
  library that hold the fused QK-norm/RoPE/KV-insert kernel, the SiLU-and-mul
  kernel, the RoPE kernel and the KV-cache copy kernel, xz-compressed (the
  11 MB QK cubin packs to about 0.25 MB), with each needed kernel's mangled name
  and its parameter layout read from ``.nv.info`` (EIATTR_KPARAM_INFO).
* ``manifest.json``: an index of all of the above (a run of some ``--parts``
  keeps the other parts' entries of an existing manifest of the same archs).

Nothing of vLLM is copied: the Triton kernels are imported from the installed
vLLM and compiled; the CUDA cubins are extracted from the installed library
with ``cuobjdump``. See README.md next to this file, and
``dspark_core.spec`` for what the kernels compute.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

# vLLM disables Triton when it sees no GPU driver unless the visible-device list
# is explicitly empty (its "distributed" lenient path); the JIT objects must be
# real Triton functions for triton.compile.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

REPO = Path(__file__).resolve().parents[2]
ARCH_NAMES = {90: "sm_90a", 100: "sm_100a"}

# --------------------------------------------------------------------------
# ELF / .nv.info reading (our own minimal parser)
# --------------------------------------------------------------------------
EIATTR = {0x05: "MAX_THREADS", 0x0A: "PARAM_CBANK", 0x10: "REQNTID",
          0x17: "KPARAM_INFO", 0x19: "CBANK_PARAM_SIZE", 0x1B: "MAXREG_COUNT"}


def elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """Section name -> (file offset, size) of an ELF64 little-endian file."""
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not an ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]

    def name(off: int) -> str:
        end = data.index(b"\0", strtab + off)
        return data[strtab + off:end].decode()

    return {name(s[0]): (s[4], s[5]) for s in raw}


def kernel_info(data: bytes, kernel: str) -> dict:
    """Decode the EIATTR records of ``.nv.info.<kernel>`` that a launcher needs."""
    secs = elf_sections(data)
    off, size = secs[".nv.info." + kernel]
    blob = data[off:off + size]
    info: dict = {"params": []}
    i = 0
    while i < len(blob):
        fmt, attr = blob[i], blob[i + 1]
        if fmt == 4:  # EIFMT_SVAL: u16 size, payload
            n, = struct.unpack_from("<H", blob, i + 2)
            payload = blob[i + 4:i + 4 + n]
            i += 4 + n
        else:  # EIFMT_NVAL/BVAL/HVAL: u16 value
            payload = blob[i + 2:i + 4]
            i += 4
        tag = EIATTR.get(attr)
        if tag == "KPARAM_INFO":
            _, ordinal, poff, flags = struct.unpack("<IHHI", payload)
            info["params"].append({"ordinal": ordinal, "offset": poff,
                                   "size": (flags >> 18) & 0x3FFF})
        elif tag == "CBANK_PARAM_SIZE":
            info["param_bytes"], = struct.unpack("<H", payload)
        elif tag == "PARAM_CBANK":
            _, base, nbytes = struct.unpack("<IHH", payload)
            info["param_cbank_offset"] = base
        elif tag in ("MAX_THREADS", "REQNTID"):
            info[tag.lower()] = list(struct.unpack("<III", payload))
        elif tag == "MAXREG_COUNT":
            info["maxreg"], = struct.unpack("<H", payload)
    info["params"].sort(key=lambda p: p["ordinal"])
    if ".nv.shared." + kernel in secs:
        info["static_shared"] = secs[".nv.shared." + kernel][1]
    return info


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------
def _jit(obj):
    import triton
    while not isinstance(obj, triton.runtime.jit.JITFunction):
        if not hasattr(obj, "fn"):
            raise RuntimeError(
                f"{getattr(obj, '__qualname__', obj)!r} is not a Triton kernel: vLLM was imported with Triton "
                "disabled (its TritonPlaceholder, no active GPU driver); import vLLM first with "
                "CUDA_VISIBLE_DEVICES='' (or on a GPU) to compile its kernels")
        obj = obj.fn  # unwrap @triton.heuristics / autotuners
    return obj


# T specializations Triton's JIT makes for an int argument: 1 -> constexpr,
# multiple of 16 -> i32 with tt.divisibility=16, otherwise plain i32.
T_SPECS = ("one", "div16", "any")


def _t_matches(spec: str) -> str:
    return {"one": "T == 1", "div16": "T % 16 == 0 and T > 1", "any": "T % 16 != 0 and T > 1"}[spec]


def rmsnorm_variants(x_dtypes, d: int = 8192):
    """(name, signature, constexprs, aligned args, grid info) of fused_rmsnorm_fwd's launches.

    fused_rmsnorm_fwd (no residual stream) launches with bD = min(next_pow2(D), 8192),
    bT = max(1, next_pow2(8192 // bD)), 8 warps, SINGLE_TILE = bD >= D, KAHAN=True
    and USE_PDL on sm_90+. The unused s/alpha/beta pointers are x itself.
    """
    bd = min(1 << (d - 1).bit_length(), 8192)
    bt = max(1, 1 << ((8192 // bd) - 1).bit_length())
    weights = (("bf16", True), ("fp32", True), ("none", False))
    for xd in x_dtypes:
        for wd, has_w in weights:
            for scale in ((False, True) if has_w else (False,)):
                for yd in ("bf16", "fp32"):
                    for ts in T_SPECS:
                        name = f"rmsnorm_D{d}_x-{xd}_w-{wd}_is{int(scale)}_y-{yd}_T-{ts}"
                        wt = wd if has_w else xd  # w=None: Triton gets a None pointer
                        sig = {"x_ptr": f"*{xd}", "y_ptr": f"*{yd}", "w_ptr": f"*{wt}",
                               "s_ptr": f"*{xd}", "alpha_ptr": f"*{xd}", "beta_ptr": f"*{xd}",
                               "T": "i32", "eps": "fp32", "gain_center": "fp32",
                               "alpha_scalar": "fp32"}
                        const = dict(D=d, HAS_WEIGHT=has_w, INPUT_SCALE=scale, KAHAN=True,
                                     SINGLE_TILE=bd >= d, RESIDUAL=False, GATE_STREAM=False,
                                     PER_CHANNEL=False, bT=bt, bD=bd, USE_PDL=True)
                        if not has_w:
                            sig["w_ptr"] = "constexpr"
                            const["w_ptr"] = None
                        if ts == "one":
                            sig["T"] = "constexpr"
                            const["T"] = 1
                        aligned = ["x_ptr", "y_ptr", "s_ptr", "alpha_ptr", "beta_ptr"]
                        aligned += ["w_ptr"] if has_w else []
                        aligned += ["T"] if ts == "div16" else []
                        grid = {"rule": f"(cdiv(T, {bt}), 1, 1)", "rows_per_program": bt}
                        yield name, sig, const, aligned, grid, 8, _t_matches(ts)


def fla_variants(heads):
    """layer_norm_gated_fwd_kernel as rms_norm_gated(o, og, None, None, 'sigmoid') runs it.

    Rows are tokens * H (H = heads per rank, a constexpr), D = 64, BT = 16, 8 warps;
    the gate is og viewed [tokens, H, 64] inside qkv, so g_stride_n is qkv's row
    stride (a multiple of 64, hence of 16). w, b, residual, residual_out, mean are None.
    launch_pdl is a kernel constexpr (True on sm_90+); the launcher sets no PDL attribute.
    """
    for h in heads:
        for ts in (("div16",) if h % 16 == 0 else ("div16", "any")):
            name = f"fla_gate_H{h}_D64_T-{ts}"
            sig = {"x": "*bf16", "g": "*bf16", "y": "*bf16", "rstd": "*fp32", "eps": "fp32",
                   "T": "i32", "g_stride_n": "i32"}
            const = dict(w=None, b=None, residual=None, residual_out=None, mean=None, H=h, D=64,
                         BT=16, BD=64, ACTIVATION="sigmoid", IS_RMS_NORM=True,
                         STORE_RESIDUAL_OUT=False, HAS_RESIDUAL=False, HAS_WEIGHT=False,
                         HAS_BIAS=False, launch_pdl=True)
            for k in ("w", "b", "residual", "residual_out", "mean", "H", "D", "BT", "BD",
                      "ACTIVATION", "IS_RMS_NORM", "STORE_RESIDUAL_OUT", "HAS_RESIDUAL",
                      "HAS_WEIGHT", "HAS_BIAS", "launch_pdl"):
                sig[k] = "constexpr"
            aligned = ["x", "g", "y", "rstd", "g_stride_n"] + (["T"] if ts == "div16" else [])
            grid = {"rule": "(cdiv(T, 16), 1, 1)", "rows_per_program": 16}
            match = "T % 16 == 0" if ts == "div16" else "T % 16 != 0"
            yield name, sig, const, aligned, grid, 8, match


def boundary_variants(d: int = 8192):
    """``_norm_residual_norm_fwd_kernel`` as ``fused_norm_residual_norm_fwd``
    launches it for the draft's boundary (vLLM's one-kernel boundary, which
    its draft layer does not run; the benchmarks time it beside ours): BF16
    branch, FP32 stream, per-channel FP32 alpha and beta (GATE_STREAM), BF16
    post and pre weights after the norm, BF16 output; bD = next_pow2(D), bT
    = max(1, 8192 // bD), 32 warps at bD >= 8192 (the sm_100 large-T switch
    to bT 2 / 8 warps is not taken on sm_90)."""
    bd = 1 << (d - 1).bit_length()
    bt = max(1, 8192 // bd)
    warps = 32 if bd >= 8192 else (16 if bd >= 4096 else 8)
    for ts in ("div16", "any"):
        name = f"boundary_D{d}_T-{ts}"
        sig = {"branch_ptr": "*bf16", "stream_ptr": "*fp32", "new_stream_ptr": "*fp32", "out_ptr": "*bf16",
               "post_w_ptr": "*bf16", "pre_w_ptr": "*bf16", "alpha_ptr": "*fp32", "beta_ptr": "*fp32",
               "T": "i32", "post_eps": "fp32", "pre_eps": "fp32", "post_gain_center": "fp32",
               "pre_gain_center": "fp32", "alpha_scalar": "fp32"}
        const = dict(D=d, POST_HAS_WEIGHT=True, POST_INPUT_SCALE=False, PRE_HAS_WEIGHT=True,
                     PRE_INPUT_SCALE=False, GATE_STREAM=True, PER_CHANNEL=True, bT=bt, bD=bd)
        aligned = ["branch_ptr", "stream_ptr", "new_stream_ptr", "out_ptr", "post_w_ptr", "pre_w_ptr",
                   "alpha_ptr", "beta_ptr"] + (["T"] if ts == "div16" else [])
        grid = {"rule": f"(cdiv(T, {bt}), 1, 1)", "rows_per_program": bt}
        yield name, sig, const, aligned, grid, warps, _t_matches(ts)


# The int arguments of _gumbel_sample_kernel in order, and the two pointers whose
# 16-byte alignment varies between launches (the rest are fresh allocations or
# whole buffers: always aligned).
GUMBEL_INTS = ("local_argmax_stride", "local_max_stride", "logits_cache_stride_0", "logits_cache_stride_1",
               "logits_cache_source_stride", "logits_stride", "vocab_size")
GUMBEL_PTRS = ("logits_cache_col_ptr", "expanded_idx_mapping_ptr")


def _int_spec(v: int) -> str:
    """Triton's JIT specialization of an int argument: 1 (a constexpr), D (a multiple of 16), x (neither)."""
    return "1" if v == 1 else ("D" if v % 16 == 0 else "x")


def gumbel_ints(vocab: int, steps: int) -> dict:
    """The int arguments of ``gumbel_sample``'s launch on the draft's
    probabilistic path: logits = the BF16 scatter buffer ``[R, vocab]``
    (row stride ``vocab``), the cache ``draft_logits [reqs, steps, vocab]``,
    its source the logits themselves, ``cdiv(vocab, 1024)`` blocks."""
    nb = -(-vocab // 1024)
    return dict(local_argmax_stride=nb, local_max_stride=nb, logits_cache_stride_0=steps * vocab,
                logits_cache_stride_1=vocab, logits_cache_source_stride=vocab, logits_stride=vocab,
                vocab_size=vocab)


def gumbel_variant_name(ints: dict, col_aligned: bool, idx_aligned: bool) -> str:
    """``gumbel_<int specs>_col<a|u>_idx<a|u>``; launch_stock derives the same name from a launch."""
    return (f"gumbel_{''.join(_int_spec(ints[k]) for k in GUMBEL_INTS)}"
            f"_col{'a' if col_aligned else 'u'}_idx{'a' if idx_aligned else 'u'}")


def gumbel_variants(vocabs, steps):
    """``_gumbel_sample_kernel`` as ``DSparkSpeculator._sample_logits`` launches
    it through ``gumbel_sample`` with ``draft_logits`` set: BF16 logits (the
    scatter buffer; the cache's dtype, the head dtype), the logits cache and
    its source (the logits), int32 scalar column ``_step_cols[step]`` (a 0-dim
    view: PER_TOKEN_COL False), int64 ``idx_map`` / ``pos`` / ``seeds``, FP32
    temperature and block maxima, int64 block argmax; BLOCK_SIZE 1024,
    IS_DRAFTING and APPLY_TEMPERATURE True, USE_FP64 False (the default
    ``use_fp64_gumbel``), 4 warps (Triton's default: the host passes none),
    grid ``(T, cdiv(V, 1024))``. One variant per distinct specialization of
    the int arguments over ``vocabs`` x ``steps`` and per alignment of the
    column pointer (``_step_cols`` + 4 * step: 16-aligned at steps 0, 4) and
    of ``idx_map`` (a copy by ``.contiguous()``, but ``idx_map[:, i]`` itself
    where R == 1: aligned at even steps)."""
    seen = set()
    for vocab in vocabs:
        for n in steps:
            ints = gumbel_ints(vocab, n)
            for col_a in (True, False):
                for idx_a in (True, False):
                    name = gumbel_variant_name(ints, col_a, idx_a)
                    if name in seen:
                        continue
                    seen.add(name)
                    sig = {"local_argmax_ptr": "*i64", "local_max_ptr": "*fp32", "logits_cache_ptr": "*bf16",
                           "logits_cache_col_ptr": "*i32", "logits_cache_source_ptr": "*bf16",
                           "logits_ptr": "*bf16", "expanded_idx_mapping_ptr": "*i64", "seeds_ptr": "*i64",
                           "pos_ptr": "*i64", "temp_ptr": "*fp32"}
                    const = dict(BLOCK_SIZE=1024, IS_DRAFTING=True, APPLY_TEMPERATURE=True, USE_FP64=False,
                                 PER_TOKEN_COL=False)
                    aligned = ["local_argmax_ptr", "local_max_ptr", "logits_cache_ptr", "logits_cache_source_ptr",
                               "logits_ptr", "seeds_ptr", "pos_ptr", "temp_ptr"]
                    aligned += ["logits_cache_col_ptr"] if col_a else []
                    aligned += ["expanded_idx_mapping_ptr"] if idx_a else []
                    for k in GUMBEL_INTS:
                        spec = _int_spec(ints[k])
                        if spec == "1":
                            const[k] = 1
                        else:
                            sig[k] = "i32"
                            aligned += [k] if spec == "D" else []
                    grid = {"rule": "(T, cdiv(vocab_size, 1024), 1)", "block": 1024}
                    yield name, sig, const, aligned, grid, 4, f"e.g. vocab {vocab}, {n} steps"


def compile_kernel(fn, sig: dict, const: dict, aligned, warps: int, arch: int):
    """One Triton kernel compiled in memory for ``arch`` (90, 100) with the
    specialization the JIT derives from the stock launch: ``sig`` the
    runtime arguments' types (the rest constexpr), ``const`` the constexprs,
    ``aligned`` the arguments with a 16-divisibility hint. Returns Triton's
    compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arg_names = fn.arg_names
    full_sig = {a: sig.get(a, "constexpr") for a in arg_names}
    attrs = {(arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=full_sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def compile_triton(kind, fn, variants, archs, out: Path, keep_ptx=False) -> list[dict]:
    import triton

    entries = []
    arg_names = fn.arg_names
    for name, sig, const, aligned, grid, warps, match in variants:
        full_sig = {a: sig.get(a, "constexpr") for a in arg_names}
        for arch in archs:
            k = compile_kernel(fn, sig, const, aligned, warps, arch)
            md = k.metadata
            cubin = k.asm["cubin"]
            tag = f"{name}_{ARCH_NAMES[arch]}"
            (out / f"{tag}.cubin").write_bytes(cubin)
            if keep_ptx:
                (out / f"{tag}.ptx").write_text(k.asm["ptx"])
            runtime = [a for a in arg_names if full_sig[a] != "constexpr"]
            kinfo = kernel_info(cubin, md.name)
            params = [{"name": a, "type": full_sig[a]} for a in runtime]
            params += [{"name": "global_scratch", "type": "*i8"},
                       {"name": "profile_scratch", "type": "*i8"}]
            if len(kinfo["params"]) != len(params):
                raise RuntimeError(f"{tag}: {len(kinfo['params'])} cubin params vs {len(params)}")
            for p, kp in zip(params, kinfo["params"]):
                p.update(offset=kp["offset"], size=kp["size"])
            meta = {
                "kind": kind, "variant": name, "arch": ARCH_NAMES[arch],
                "cubin": f"{tag}.cubin", "sha256": sha256(cubin),
                "kernel": md.name, "num_warps": md.num_warps, "threads": 32 * md.num_warps,
                "shared": md.shared, "grid": grid, "use_when": match,
                "params": params, "param_bytes": kinfo.get("param_bytes"),
                "constexprs": {k2: v for k2, v in const.items()},
                "divisibility_16": aligned,
                "global_scratch_size": md.global_scratch_size,
                "global_scratch_align": md.global_scratch_align,
                "profile_scratch_size": md.profile_scratch_size,
                "profile_scratch_align": md.profile_scratch_align,
                "triton": triton.__version__,
            }
            (out / f"{tag}.json").write_text(json.dumps(meta, indent=1, default=str))
            entries.append({"variant": name, "arch": ARCH_NAMES[arch], "json": f"{tag}.json"})
            print(f"  {tag}: {md.name} warps={md.num_warps} shared={md.shared} "
                  f"{len(cubin)} B", flush=True)
    return entries


# --------------------------------------------------------------------------
# vLLM's Triton unified attention (the TRITON_ATTN backend)
# --------------------------------------------------------------------------
# The int arguments of kernel_unified_attention and of reduce_segments, in the
# kernels' order; the letters of their specializations (1 a constexpr, D a
# multiple of 16, x neither) end the variant names. launch_stock.UATTN_INTS and
# UREDUCE_INTS list the same.
UATTN_INTS = ("softcap", "block_table_stride", "query_stride_0", "query_stride_1", "output_stride_0",
              "output_stride_1", "qq_bias_stride_0", "stride_k_cache_0", "stride_k_cache_1", "stride_k_cache_2",
              "stride_v_cache_0", "stride_v_cache_1", "stride_v_cache_2", "num_seqs")
UREDUCE_INTS = ("num_seqs", "output_stride_0", "output_stride_1", "block_table_stride")
# The draft's decode (dspark_core.reference.config.DraftConfig and the benchmark's batch): head 64, KV block 16,
# 256 cached tokens a request, vLLM's block table 8192 / 16 = 512 blocks wide (max_model_len / block_size).
UATTN_DRAFT = {"head_size": 64, "block_size": 16, "context": 256, "table_width": 512}


def uattn_variant_name(const: dict, specs: str) -> str:
    """The variant's name, as ``launch_stock`` derives it from a launch (one naming rule)."""
    return _launcher().uattn_name(const, specs)


def ureduce_variant_name(const: dict, specs: str) -> str:
    """The variant's name, as ``launch_stock`` derives it from a launch (one naming rule)."""
    return _launcher().ureduce_name(const, specs)


def _launcher():
    """``launch_stock`` beside this file (it needs no GPU to be imported)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import launch_stock

    return launch_stock


def uattn_scenarios(head_pairs, rows, ns) -> list[tuple[int, int, int, int]]:
    """``(heads, kv_heads, requests, N)`` of the benchmark's steps: m = 1 is one
    request of one token, else m / N requests of N tokens (where N divides m)."""
    out = []
    for heads, kv in head_pairs:
        for m in rows:
            for n in ns:
                shape = (1, 1) if m == 1 else ((m // n, n) if m % n == 0 else None)
                if shape and (heads, kv, *shape) not in out:
                    out.append((heads, kv, *shape))
    return out


def record_unified_attention(heads: int, kv_heads: int, requests: int, n: int, *, head_size: int = 64,
                             block_size: int = 16, context: int = 256, table_width: int = 512,
                             num_speculative_tokens: int | None = None, seq_threshold_3d: int | None = None):
    """vLLM's own ``unified_attention`` host code, run on CPU tensors shaped as
    ``TritonAttentionImpl.forward`` hands them over for the draft's decode, with
    its two kernels replaced by recorders: ``[(kernel, grid, kwargs)]``.

    The operands: ``requests`` requests of ``n`` query tokens after ``context``
    cached ones (causal, no window, no softcap, no sinks, BF16, "auto" cache);
    q the strided ``[m, heads, D]`` view of the QKV projection's rows (what
    ``Attention.forward`` passes: q, k, v and the o-gate rows), out a fresh
    ``[m, heads, D]``; the cache the logical ``[blocks, kv_heads, block,
    2D]`` (LBHNC) transposed and split into the K and V views as the forward
    does; ``k/v_descale`` the layer's scalar scales expanded to ``[requests,
    kv_heads]``; an int32 block table ``table_width`` wide. The metadata
    builder's scratch (``TritonAttentionMetadataBuilder.__init__``):
    ``seq_threshold_3D`` = ``MIN_LAUNCH_GRID_SIZE_2D // kv_heads`` (the
    nearest CUDA-graph capture size: itself with vLLM's default sizes 1, 2, 4,
    8, 16, ..., which hold 16, 32, 64 and 128), ``NUM_PAR_SOFTMAX_SEGMENTS``
    segments, ``threshold x min(1 + 2 N_spec, MAX_3D_QUERY_LEN)`` rows (DSpark
    drafts in parallel: ``parallel_drafting``), ``N_spec`` =
    ``num_speculative_tokens`` (default ``n``)."""
    from unittest import mock

    import torch
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.attention.ops import triton_unified_attention as tua
    from vllm.v1.kv_cache_interface import KVQuantMode

    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    m = requests * n
    n_spec = n if num_speculative_tokens is None else num_speculative_tokens
    qkv = torch.zeros(m, 2 * heads * head_size + 2 * kv_heads * head_size, dtype=bf16)
    q = qkv[:, :heads * head_size].view(m, heads, head_size)
    out = torch.zeros(m, heads * head_size, dtype=bf16).view(m, heads, head_size)
    cache = torch.zeros(2, kv_heads, block_size, 2 * head_size, dtype=bf16)
    key_cache, value_cache = cache.transpose(1, 2).split(head_size, dim=-1)
    threshold = seq_threshold_3d or triton_attn.MIN_LAUNCH_GRID_SIZE_2D // kv_heads
    segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    rows = threshold * min(1 + 2 * n_spec, tua.MAX_3D_QUERY_LEN)
    padded = 1 << (head_size - 1).bit_length()
    k_scale, v_scale = torch.ones((), dtype=f32), torch.ones((), dtype=f32)
    calls = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda **kwargs: calls.append((self.name, tuple(grid), kwargs))

    with mock.patch.object(tua, "kernel_unified_attention", Recorder("kernel_unified_attention")), \
            mock.patch.object(tua, "reduce_segments", Recorder("reduce_segments")):
        tua.unified_attention(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=torch.arange(requests + 1, dtype=i32) * n,
            max_seqlen_q=n, seqused_k=torch.full((requests,), context + n, dtype=i32), max_seqlen_k=context + n,
            softmax_scale=float(head_size ** -0.5), causal=True, alibi_slopes=None, use_alibi_sqrt=False,
            window_size=(-1, -1), block_table=torch.zeros(requests, table_width, dtype=i32), softcap=0,
            q_descale=None, k_descale=k_scale.expand(requests, kv_heads), v_descale=v_scale.expand(requests, kv_heads),
            seq_threshold_3D=threshold, num_par_softmax_segments=segments,
            softmax_segm_output=torch.zeros(rows, heads, segments, padded, dtype=f32),
            softmax_segm_max=torch.zeros(rows, heads, segments, dtype=f32),
            softmax_segm_expsum=torch.zeros(rows, heads, segments, dtype=f32), sinks=None, output_scale=None,
            mm_prefix_range=None, rswa_prefix_lens=None, rswa_window=None, kv_quant_mode=KVQuantMode.NONE,
            k_scale_cache=None, v_scale_cache=None, chunk_lookback=-1, use_td=False,
            mm_prefix_clamp_sliding_window=False)
    return calls


def jit_specialization(fn, kwargs: dict, arch: int = 90) -> tuple[dict, dict, list, int]:
    """What Triton's JIT derives from a launch of ``fn`` with ``kwargs`` (its
    own binder, ``create_function_from_signature``, and ``_pack_args``, run on
    the CPU for ``arch``): ``(runtime signature {name: type}, constexprs
    {name: value}, the arguments with a 16-divisibility hint, num_warps)``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    kwargs = dict(kwargs, debug=False)  # JITFunction.run's default (knobs.runtime.debug off)
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(**kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    names = fn.arg_names
    sig = {k: v for k, v in signature.items() if v != "constexpr"}
    const = {names[path[0]]: (int(v) if isinstance(v, int) and not isinstance(v, bool) else v)
             for path, v in constexprs.items()}
    aligned = [names[path[0]] for path, a in attrs.items() if a]
    return sig, const, aligned, options.num_warps


def _specs(ints, sig: dict, const: dict, aligned) -> str:
    return "".join("1" if k in const else ("D" if k in aligned else "x") for k in ints if k in sig or k in const)


def uattn_variants(scenarios, draft: dict = UATTN_DRAFT):
    """``(attention variants, reduce variants)`` for ``compile_triton``: each
    distinct specialization of ``kernel_unified_attention`` and
    ``reduce_segments`` that vLLM's host launches over ``scenarios``
    (``record_unified_attention``; the binder's signature, constexprs and
    hints), with the grid rule and when the host picks it."""
    attention, reduce, seen = [], [], set()
    for heads, kv, requests, n in scenarios:
        for kernel, grid, kwargs in record_unified_attention(heads, kv, requests, n, **draft):
            from vllm.v1.attention.ops import triton_unified_attention as tua
            fn = _jit(getattr(tua, kernel))
            sig, const, aligned, warps = jit_specialization(fn, kwargs)
            unaligned = [k for k, t in sig.items() if t.startswith("*") and k not in aligned]
            if unaligned:
                raise RuntimeError(f"{kernel}: unaligned pointers {unaligned} in the recorded launch")
            if kernel == "kernel_unified_attention":
                name = uattn_variant_name(const, _specs(UATTN_INTS, sig, const, aligned))
                rule = ("(num_tokens // BLOCK_Q + num_seqs, num_kv_heads, NUM_SEGMENTS_PER_SEQ)" if const["IS_3D"]
                        else "(num_tokens // BLOCK_Q + num_seqs, num_kv_heads, 1)")
                match = ("num_seqs * cdiv(max_seqlen_q, BLOCK_Q) <= seq_threshold_3D, max_seqlen_q <= "
                         "MAX_3D_QUERY_LEN, causal, scratch rows >= tokens" if const["IS_3D"] else
                         "otherwise (more q blocks than seq_threshold_3D, or no 3D scratch)")
                target = attention
            else:
                name = ureduce_variant_name(const, _specs(UREDUCE_INTS, sig, const, aligned))
                rule, match, target = "(num_tokens, num_query_heads, 1)", "after each 3D launch", reduce
            if name in seen:
                continue
            seen.add(name)
            example = f"e.g. {heads}/{kv} heads, {requests} requests of {n} tokens: grid {grid}"
            target.append((name, sig, const, aligned, {"rule": rule}, warps, f"{match}; {example}"))
    return attention, reduce


# --------------------------------------------------------------------------
# vLLM CUDA library kernels
# --------------------------------------------------------------------------
QK = ("_ZN4vllm20muse_spark_fused_ops38fusedMuseSparkQKNormRopeKVInsertKernelIN3c108BFloat16E"
      "13__nv_bfloat16LNS_18Fp8KVCacheDataTypeE0E{cs}Li{hd}ELi{n}ELb{rope}ELb{ins}EEEvPT_PKT2_"
      "PKlSC_PT0_PKfSG_PhSG_fiiiiNS0_7FastDivElSI_lll")
SO_KERNELS = {
    # template <scalar bf16, cache bf16, kAuto, cos_sin_t, HD, N, HAS_ROPE, INSERT_KV>
    **{f"qknorm_rope_kv_cs-{csn}_hd{hd}_n{n}_rope{r}_ins{i}": QK.format(cs=cs, hd=hd, n=n, rope=r, ins=i)
       for cs, csn in (("f", "fp32"), ("S3_", "bf16")) for hd in (64,) for n in (1, 2, 4)
       for r in (0, 1) for i in (0, 1)},
    # act_and_mul_kernel<bf16, bf16x2, silu, packed_silu, ACT_FIRST, VEC, CLAMP?, 256B>
    "silu_and_mul_bf16_vec16B": "_ZN4vllm18act_and_mul_kernelIN3c108BFloat16E14__nv_bfloat162XadL_"
        "ZNS_11silu_kernelIS2_EET_RKS5_fEEXadL_ZNS_18packed_silu_kernelIS3_EES5_S7_fEELb1ELb1ELb0"
        "ELb0EEEvPS5_PS6_ifff",
    "silu_and_mul_bf16_vec32B": "_ZN4vllm18act_and_mul_kernelIN3c108BFloat16E14__nv_bfloat162XadL_"
        "ZNS_11silu_kernelIS2_EET_RKS5_fEEXadL_ZNS_18packed_silu_kernelIS3_EES5_S7_fEELb1ELb1ELb0"
        "ELb1EEEvPS5_PS6_ifff",
    "silu_and_mul_bf16_scalar": "_ZN4vllm18act_and_mul_kernelIN3c108BFloat16E14__nv_bfloat162XadL_"
        "ZNS_11silu_kernelIS2_EET_RKS5_fEEXadL_ZNS_18packed_silu_kernelIS3_EES5_S7_fEELb1ELb0ELb0"
        "ELb0EEEvPS5_PS6_ifff",
    "rotary_bf16_cs-bf16_gptj": "_ZN4vllm23rotary_embedding_kernelIN3c108BFloat16ES2_Lb0EEEvPKlPT_"
        "S6_PKT0_illliiilb",
    "rotary_bf16_cs-fp32_gptj": "_ZN4vllm23rotary_embedding_kernelIN3c108BFloat16EfLb0EEEvPKlPT_"
        "S6_PKT0_illliiilb",
    "reshape_and_cache_flash_bf16": "_ZN4vllm30reshape_and_cache_flash_kernelI13__nv_bfloat16S1_"
        "LNS_18Fp8KVCacheDataTypeE0EEEvPKT_S5_PT0_S7_PKlllllliiiPKfSB_i",
}
# Parameter names in order (read from the mangled signatures and the SASS; docs/stock-numerics.md).
SO_PARAMS = {
    "qknorm": ["qkv", "cos_sin_cache", "positions", "slot_mapping", "kv_cache", "k_scale",
               "v_scale", "q_fp8_out", "q_scale", "eps", "rotary_dim", "num_tokens",
               "num_heads", "num_kv_heads", "heads_fastdiv", "qkv_token_stride",
               "block_fastdiv", "cache_block_stride", "cache_head_stride", "cache_token_stride"],
    "silu": ["out", "input", "d", "unused_f0", "alpha", "up_offset"],
    "rotary": ["positions", "query", "key", "cos_sin_cache", "rot_dim", "query_stride",
               "key_stride", "head_stride", "num_heads", "num_kv_heads", "head_size",
               "rope_dim_offset", "inverse"],
    "reshape": ["key", "value", "key_cache", "value_cache", "slot_mapping", "block_stride",
                "page_stride", "head_stride", "key_stride", "value_stride", "num_heads",
                "head_size", "block_size", "k_scale", "v_scale", "kv_scale_stride"],
}


def _param_names(label: str) -> list[str]:
    for prefix, names in (("qknorm", "qknorm"), ("silu", "silu"), ("rotary", "rotary"),
                          ("reshape", "reshape")):
        if label.startswith(prefix):
            return SO_PARAMS[names]
    raise KeyError(label)


def so_cubins(so_path: Path, archs, cuobjdump: str, labels=None):
    """Yield ``(arch, cubin_name, cubin_bytes, {label: mangled})`` for each
    cubin of vLLM's CUDA library ``so_path`` (for ``archs``: 90, 100) that
    holds one of the ``SO_KERNELS`` (those named in ``labels``, default all)."""
    listing = subprocess.run([cuobjdump, "-lelf", str(so_path)], check=True,
                             capture_output=True, text=True).stdout
    names = [line.split(":")[-1].strip() for line in listing.splitlines() if line.startswith("ELF")]
    wanted = {k: v.encode() for k, v in SO_KERNELS.items() if labels is None or k in labels}
    for arch in archs:
        suffix = f".sm_{arch}.cubin"
        with tempfile.TemporaryDirectory() as tmp:
            # One call extracts every cubin whose name contains the suffix.
            subprocess.run([cuobjdump, "-xelf", suffix, str(so_path)], check=True, cwd=tmp,
                           capture_output=True)
            for cubin_name in sorted(n for n in names if n.endswith(suffix)):
                path = Path(tmp) / cubin_name
                if not path.exists():
                    continue
                data = path.read_bytes()
                hits = {k: v for k, v in wanted.items() if b"\0" + v + b"\0" in data}
                if hits:
                    yield arch, cubin_name, data, hits


def extract_so(so_path: Path, archs, out: Path, cuobjdump: str) -> list[dict]:
    entries = []
    for arch, cubin_name, data, hits in so_cubins(so_path, archs, cuobjdump):
        packed = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
        (out / f"{cubin_name}.xz").write_bytes(packed)
        for label, mangled in hits.items():
            info = kernel_info(data, mangled.decode())
            pnames = _param_names(label)
            if len(pnames) != len(info["params"]):
                raise RuntimeError(f"{label}: {len(info['params'])} params in the cubin")
            for p, nm in zip(info["params"], pnames):
                p["name"] = nm
            entries.append({"label": label, "arch": f"sm_{arch}", "kernel": mangled.decode(),
                            "cubin": f"{cubin_name}.xz", "cubin_sha256": sha256(data),
                            **info})
        print(f"  {cubin_name}: {len(data)} B -> {len(packed)} B xz, "
              f"{len(hits)} kernels", flush=True)
    found = {(e["label"], e["arch"]) for e in entries}
    for arch in archs:
        for label in SO_KERNELS:
            if (label, f"sm_{arch}") not in found:
                print(f"  warning: {label} not found for sm_{arch}", file=sys.stderr)
    return entries


# --------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / ".device" / "stock")
    ap.add_argument("--arch", default="90,100", help="comma list of 90, 100")
    ap.add_argument("--parts", default="rmsnorm,fla,boundary,gumbel,attention,so",
                    help="comma list of rmsnorm, fla, boundary, gumbel, attention, so")
    ap.add_argument("--x-dtypes", default="bf16", help="rmsnorm input dtypes (bf16[,fp32])")
    ap.add_argument("--hidden", type=int, default=8192, help="rmsnorm D")
    ap.add_argument("--heads", default="64,32,16,8", help="o-gate heads per rank (constexpr H)")
    ap.add_argument("--gumbel-vocabs", default="202752,32768,4096,512",
                    help="target vocabularies of the Gumbel sampler's launches")
    ap.add_argument("--gumbel-steps", default="1,2,3,4,5,6,7,8", help="speculative steps (the cache's stride 0)")
    ap.add_argument("--attn-heads", default="64/8,32/4,16/2,8/1",
                    help="the unified attention's query/KV heads per rank (the draft at TP1, 2, 4, 8)")
    ap.add_argument("--attn-rows", default="1,4,8,16,32,64,128,256,512",
                    help="row counts m = requests x N of the attention's launches (m = 1: one token)")
    ap.add_argument("--attn-n", default="2,4,8", help="query tokens per request N (num_speculative_tokens)")
    ap.add_argument("--so", type=Path, default=None, help="vLLM _C_stable_libtorch.abi3.so")
    ap.add_argument("--keep-ptx", action="store_true", help="also write each Triton kernel's PTX")
    args = ap.parse_args()

    archs = [int(a) for a in args.arch.split(",")]
    parts = set(args.parts.split(","))
    out = args.out.resolve()
    manifest: dict = {"archs": [ARCH_NAMES[a] for a in archs]}
    old = out / "manifest.json"
    if old.is_file() and json.loads(old.read_text()).get("archs") == manifest["archs"]:
        manifest = json.loads(old.read_text())  # a run of some parts keeps the others' entries

    import triton
    import vllm
    vdir = Path(vllm.__file__).parent
    manifest["vllm"] = getattr(vllm, "__version__", "?")
    manifest["triton"] = triton.__version__
    cuobjdump = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")

    if parts & {"rmsnorm", "fla", "boundary", "gumbel", "attention"}:
        (out / "triton").mkdir(parents=True, exist_ok=True)
    if "rmsnorm" in parts:
        from vllm.models.muse_spark.common.ops import fused_rmsnorm
        print("rmsnorm variants:", flush=True)
        manifest["rmsnorm"] = compile_triton(
            "rmsnorm", _jit(fused_rmsnorm._rmsnorm_fwd_kernel),
            rmsnorm_variants(args.x_dtypes.split(","), args.hidden), archs, out / "triton",
            args.keep_ptx)
    if "fla" in parts:
        from vllm.third_party.flash_linear_attention.ops import fused_norm_gate
        print("o-norm + sigmoid gate (FLA) variants:", flush=True)
        heads = [int(h) for h in args.heads.split(",")]
        manifest["fla_gate"] = compile_triton(
            "fla_gate", _jit(fused_norm_gate.layer_norm_gated_fwd_kernel),
            fla_variants(heads), archs, out / "triton", args.keep_ptx)
    if "boundary" in parts:
        from vllm.models.muse_spark.common.ops import fused_rmsnorm
        print("one-kernel boundary (fused_norm_residual_norm_fwd) variants:", flush=True)
        manifest["boundary"] = compile_triton(
            "boundary", _jit(fused_rmsnorm._norm_residual_norm_fwd_kernel), boundary_variants(args.hidden),
            archs, out / "triton", args.keep_ptx)
    if "gumbel" in parts:
        from vllm.v1.worker.gpu.sample import gumbel
        print("Gumbel sampler (_gumbel_sample_kernel, the draft's probabilistic path) variants:", flush=True)
        vocabs = [int(v) for v in args.gumbel_vocabs.split(",")]
        steps = [int(n) for n in args.gumbel_steps.split(",")]
        manifest["gumbel"] = compile_triton(
            "gumbel", _jit(gumbel._gumbel_sample_kernel), gumbel_variants(vocabs, steps), archs,
            out / "triton", args.keep_ptx)
    if "attention" in parts:
        from vllm.v1.attention.ops import triton_unified_attention as tua
        print("unified attention (TRITON_ATTN: kernel_unified_attention, reduce_segments) variants:", flush=True)
        pairs = [tuple(int(x) for x in hp.split("/")) for hp in args.attn_heads.split(",")]
        scenarios = uattn_scenarios(pairs, [int(r) for r in args.attn_rows.split(",")],
                                    [int(n) for n in args.attn_n.split(",")])
        attention, reduce = uattn_variants(scenarios)
        manifest["unified_attention"] = (
            compile_triton("uattn", _jit(tua.kernel_unified_attention), attention, archs, out / "triton", args.keep_ptx)
            + compile_triton("ureduce", _jit(tua.reduce_segments), reduce, archs, out / "triton", args.keep_ptx))
    if "so" in parts:
        so_path = args.so or (vdir / "_C_stable_libtorch.abi3.so")
        (out / "so").mkdir(parents=True, exist_ok=True)
        print(f"CUDA kernels from {so_path}:", flush=True)
        kernels = extract_so(so_path, archs, out / "so", cuobjdump)
        (out / "so" / "kernels.json").write_text(json.dumps(kernels, indent=1))
        manifest["so"] = {"source": str(so_path), "kernels": "so/kernels.json",
                          "count": len(kernels)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({total / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
