"""Launch the carried stock vLLM 0.33.0 kernels on torch tensors (GPU side).

Checked on an H200 (``check_spec.py``; ``bench_draft_step.py``, PDL launches
inside CUDA graphs included). Needs torch with CUDA and the NVIDIA driver
(libcuda); no vLLM, Triton or cupy. The kernels come from
``scripts/stock/compile_stock.py`` (default directory ``.device/stock``).

Every launch goes on torch's current stream, so no synchronization is needed
around the calls. Each ``stock_*`` function mirrors the stock op it stands for:

    stock_rmsnorm(x, w, eps, gain_center=0.0, input_scale=False, out_dtype=None)
        = vllm.models.muse_spark.common.ops.fused_rmsnorm.fused_rmsnorm_fwd (no residual)
    stock_o_gate(attn_output, og, eps)      = rms_norm_gated(o, og, None, None, "sigmoid")
    stock_norm_residual_norm(branch, stream, post_w, pre_w, post_eps, pre_eps, alpha, beta)
                                            = fused_norm_residual_norm_fwd (vLLM's one-kernel boundary)
    stock_silu_and_mul(x)                   = SiluAndMul.forward_cuda
    stock_rotary(positions, query, key, head_size, cos_sin_cache, is_neox=False)
                                            = ops.rotary_embedding (in place)
    stock_qknorm_rope_kv_insert(qkv, positions, num_heads, num_kv_heads, head_dim, eps, ...)
                                            = ops.fused_muse_spark_qknorm_rope_kv_insert (in place)
    stock_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping)
                                            = ops.reshape_and_cache_flash ("auto" cache dtype)
    stock_gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature,
                        is_drafting, logits_cache, logits_cache_col)
                                            = vllm.v1.worker.gpu.sample.gumbel.gumbel_sample
                                              (the draft's probabilistic launch only)
    unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                      causal, window_size, block_table, softcap, q_descale, k_descale, v_descale, ...)
                                            = vllm.v1.attention.ops.triton_unified_attention.unified_attention
                                              (TRITON_ATTN; the draft's decode: BF16, causal, no window)

Launch configurations follow what the stock host code does (README.md next to
this file); PDL is off unless ``pdl=True`` (it changes no value).
"""

from __future__ import annotations

import ctypes
import json
import lzma
import math
import os
import struct
from pathlib import Path

import torch

DEFAULT_DIR = Path(os.environ.get("DSPARK_STOCK_DIR",
                                  Path(__file__).resolve().parents[2] / ".device" / "stock"))
_DT = {torch.bfloat16: "bf16", torch.float32: "fp32"}


# --------------------------------------------------------------------------
# Driver API through ctypes
# --------------------------------------------------------------------------
class _Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.modules: dict[str, ctypes.c_void_p] = {}
        self.funcs: dict[tuple[str, str], ctypes.c_void_p] = {}

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA driver error {rc} ({msg.value})")

    def ensure_context(self) -> None:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # makes torch's primary context current
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()),
                       "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def function(self, path: Path, name: str) -> ctypes.c_void_p:
        key = (str(path), name)
        if key in self.funcs:
            return self.funcs[key]
        if str(path) not in self.modules:
            self.ensure_context()
            data = path.read_bytes()
            if path.suffix == ".xz":
                data = lzma.decompress(data)
            mod = ctypes.c_void_p()
            self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data)),
                       f"cuModuleLoadData({path.name})")
            self.modules[str(path)] = mod
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), self.modules[str(path)],
                                                name.encode()), f"cuModuleGetFunction({name})")
        self.funcs[key] = fn
        return fn

    def launch(self, fn, grid, block, shared: int, params: bytes, pdl: bool = False) -> None:
        buf = ctypes.create_string_buffer(params, len(params))
        size = ctypes.c_size_t(len(params))
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if not pdl:
            rc = self.lib.cuLaunchKernel(fn, *[ctypes.c_uint(v) for v in (*grid, *block)],
                                         ctypes.c_uint(shared), stream, None, extra)
            self.check(rc, "cuLaunchKernel")
            return
        # CUlaunchAttribute {id, pad[4], value[64]}: PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1.
        attr = ctypes.create_string_buffer(struct.pack("<Ii", 6, 0) + struct.pack("<i", 1) + b"\0" * 60)
        cfg = ctypes.create_string_buffer(struct.pack("<7I4xQQI4x", *grid, *block, shared,
                                                      stream.value or 0, ctypes.addressof(attr), 1))
        self.check(self.lib.cuLaunchKernelEx(cfg, fn, None, extra), "cuLaunchKernelEx")


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def _arch(device: torch.device) -> int:
    major, _ = torch.cuda.get_device_capability(device)
    return 100 if major == 10 else 90


def _pack(layout: list[dict], values: dict, nbytes: int) -> bytes:
    """Place each parameter at its cubin offset (EIATTR_KPARAM_INFO)."""
    out = bytearray(nbytes)
    for p in layout:
        v = values[p["name"]]
        off, size = p["offset"], p["size"]
        if isinstance(v, torch.Tensor):
            v = v.data_ptr()
        kind = p.get("type", "")
        if isinstance(v, tuple):  # FastDiv {u32 mul, u32 shift, i32 divisor}
            struct.pack_into("<IIi", out, off, *v)
        elif kind == "fp32" or (isinstance(v, float) and size == 4):
            struct.pack_into("<f", out, off, float(v))
        elif size == 8:
            struct.pack_into("<q" if int(v) < 0 else "<Q", out, off, int(v))
        elif size == 4:
            struct.pack_into("<i", out, off, int(v))
        elif size == 1:
            struct.pack_into("<B", out, off, int(bool(v)))
        else:
            raise ValueError(f"cannot pack {p}")
    return bytes(out)


# --------------------------------------------------------------------------
# Triton kernels (compiled by compile_stock.py)
# --------------------------------------------------------------------------
_META: dict[tuple, list[dict]] = {}


def _triton_meta(kind_prefix: str, arch: int, root: Path) -> list[dict]:
    key = (kind_prefix, arch, str(root))
    if key not in _META:
        name = {90: "sm_90a", 100: "sm_100a"}[arch]
        files = sorted((root / "triton").glob(f"{kind_prefix}*_{name}.json"))
        _META[key] = [json.loads(p.read_text()) for p in files]
    return _META[key]


def _t_spec(t: int) -> str:
    return "one" if t == 1 else ("div16" if t % 16 == 0 else "any")


def _launch_triton(meta: dict, root: Path, values: dict, grid, pdl: bool) -> None:
    if meta["global_scratch_size"] or meta["profile_scratch_size"]:
        raise RuntimeError(f"{meta['variant']} needs scratch memory; not supported here")
    values = dict(values, global_scratch=0, profile_scratch=0)
    fn = _driver().function(root / "triton" / meta["cubin"], meta["kernel"])
    _driver().launch(fn, grid, (meta["threads"], 1, 1), meta["shared"],
                     _pack(meta["params"], values, meta["param_bytes"]), pdl)


def _aligned(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.data_ptr() % 16:
            raise ValueError("the carried cubins assume 16-byte aligned pointers")


def stock_rmsnorm(x, w, eps, gain_center=0.0, input_scale=False, out_dtype=None, *,
                  root: Path = DEFAULT_DIR, pdl: bool = False):
    """fused_rmsnorm_fwd without a residual stream: y = rmsnorm(x) (docs/stock-numerics.md, the norms)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    assert x2.is_contiguous()
    t, d = x2.shape
    out_dtype = out_dtype or x.dtype
    y = torch.empty((t, d), dtype=out_dtype, device=x.device)
    wd = "none" if w is None else _DT[w.dtype]
    variant = (f"rmsnorm_D{d}_x-{_DT[x.dtype]}_w-{wd}_is{int(bool(input_scale))}_"
               f"y-{_DT[out_dtype]}_T-{_t_spec(t)}")
    metas = [m for m in _triton_meta("rmsnorm_", _arch(x.device), root) if m["variant"] == variant]
    if not metas:
        raise KeyError(f"{variant} was not compiled (compile_stock.py --hidden/--x-dtypes)")
    meta = metas[0]
    _aligned(x2, y, *([w] if w is not None else []))
    values = {"x_ptr": x2, "y_ptr": y, "w_ptr": w if w is not None else 0, "s_ptr": x2,
              "alpha_ptr": x2, "beta_ptr": x2, "T": t, "eps": float(eps),
              "gain_center": float(gain_center), "alpha_scalar": 1.0}
    bt = meta["grid"]["rows_per_program"]
    _launch_triton(meta, root, values, (math.ceil(t / bt), 1, 1), pdl)
    return y.view(shape)


def stock_norm_residual_norm(branch, stream, post_w, pre_w, post_eps, pre_eps, alpha, beta, *,
                             post_gain_center=0.0, pre_gain_center=0.0, root: Path = DEFAULT_DIR):
    """vLLM's one-kernel boundary ``fused_norm_residual_norm_fwd`` (BF16 branch,
    FP32 stream, FP32 per-channel alpha and beta, BF16 weights after the norms):
    ``(out, new_stream)``. Not the draft layer's stock arithmetic (its own
    sum order): the benchmarks time it beside DSpark's boundary."""
    t, d = branch.shape
    out = torch.empty((t, d), dtype=torch.bfloat16, device=branch.device)
    new_stream = torch.empty((t, d), dtype=torch.float32, device=branch.device)
    variant = f"boundary_D{d}_T-{'div16' if t % 16 == 0 else 'any'}"
    metas = [m for m in _triton_meta("boundary_", _arch(branch.device), root) if m["variant"] == variant]
    if not metas:
        raise KeyError(f"{variant} was not compiled (compile_stock.py --parts boundary)")
    _aligned(branch, stream, out, new_stream, post_w, pre_w, alpha, beta)
    values = {"branch_ptr": branch, "stream_ptr": stream, "new_stream_ptr": new_stream, "out_ptr": out,
              "post_w_ptr": post_w, "pre_w_ptr": pre_w, "alpha_ptr": alpha, "beta_ptr": beta, "T": t,
              "post_eps": float(post_eps), "pre_eps": float(pre_eps), "post_gain_center": float(post_gain_center),
              "pre_gain_center": float(pre_gain_center), "alpha_scalar": 1.0}
    bt = metas[0]["grid"]["rows_per_program"]
    _launch_triton(metas[0], root, values, (math.ceil(t / bt), 1, 1), False)
    return out, new_stream


def stock_o_gate(attn_output, og, eps, *, root: Path = DEFAULT_DIR):
    """rms_norm_gated(attn_output, og, None, None, 'sigmoid', eps=eps) on sm_90 (FLA Triton).

    attn_output: [T, H, 64] bf16 (made contiguous, normalized in place as the stock does);
    og: [T, H, 64] bf16 view whose last two dims are packed (stride(0) = qkv's row stride).
    """
    x = attn_output.contiguous().reshape(-1, attn_output.shape[-1])
    h = og.shape[-2] if og.ndim == 3 else 1
    g = og.view(-1, h, og.shape[-1])
    rows, d = x.shape
    assert d == 64 and g.stride(-1) == 1 and g.stride(-2) == d
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    variant = f"fla_gate_H{h}_D64_T-{'div16' if rows % 16 == 0 else 'any'}"
    metas = [m for m in _triton_meta("fla_gate_", _arch(x.device), root) if m["variant"] == variant]
    if not metas:
        raise KeyError(f"{variant} was not compiled (compile_stock.py --heads)")
    _aligned(x, g, rstd)
    values = {"x": x, "g": g, "y": x, "rstd": rstd, "eps": float(eps), "T": rows,
              "g_stride_n": g.stride(0)}
    _launch_triton(metas[0], root, values, (math.ceil(rows / 16), 1, 1), False)
    return x.view(attn_output.shape)


# --------------------------------------------------------------------------
# vLLM CUDA kernels (extracted by compile_stock.py)
# --------------------------------------------------------------------------
_SO: dict[Path, list[dict]] = {}


def _so_kernel(label: str, device: torch.device, root: Path) -> dict:
    if root not in _SO:
        _SO[root] = json.loads((root / "so" / "kernels.json").read_text())
    arch = f"sm_{_arch(device)}"
    for k in _SO[root]:
        if k["label"] == label and k["arch"] == arch:
            return k
    raise KeyError(f"{label} for {arch} not extracted")


def _launch_so(k: dict, root: Path, values: dict, grid, block, pdl=False) -> None:
    fn = _driver().function(root / "so" / k["cubin"], k["kernel"])
    _driver().launch(fn, grid, block, 0, _pack(k["params"], values, k["param_bytes"]), pdl)


def _fastdiv(d: int) -> tuple[int, int, int]:
    """The host's FastDiv: q = umulhi(n, mul) >> shift, or n itself when d == 1."""
    if d <= 1:
        return (0, 0, 1)
    s = (d - 1).bit_length()  # ceil(log2 d)
    return (((1 << (31 + s)) + d - 1) // d & 0xFFFFFFFF, s - 1, d)


def stock_silu_and_mul(x, *, root: Path = DEFAULT_DIR):
    """SiluAndMul.forward_cuda: out = bf16(bf16(silu(gate)) * up), gate = x[..., :d]."""
    assert x.dtype == torch.bfloat16 and x.is_contiguous()
    d = x.shape[-1] // 2
    tokens = x.numel() // x.shape[-1]
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    use_256b = torch.cuda.get_device_capability(x.device)[0] > 9 and tokens > 128
    elems = (32 if use_256b else 16) // x.element_size()
    if d % elems == 0:
        label = "silu_and_mul_bf16_vec32B" if use_256b else "silu_and_mul_bf16_vec16B"
        block = min(d // elems, 1024)
    else:
        label, block = "silu_and_mul_bf16_scalar", min(d, 1024)
    k = _so_kernel(label, x.device, root)
    values = {"out": out, "input": x, "d": d, "unused_f0": 0.0, "alpha": 1.0, "up_offset": 0.0}
    _launch_so(k, root, values, (tokens, 1, 1), (block, 1, 1))
    return out


def stock_rotary(positions, query, key, head_size, cos_sin_cache, is_neox=False, *,
                 root: Path = DEFAULT_DIR):
    """ops.rotary_embedding for bf16 query/key, GPT-J style, in place; returns (query, key)."""
    assert not is_neox and query.dtype == torch.bfloat16
    tokens = positions.numel()
    label = f"rotary_bf16_cs-{_DT[cos_sin_cache.dtype]}_gptj"
    k = _so_kernel(label, query.device, root)
    q3 = query.view(tokens, -1, head_size)
    nh = q3.shape[1]
    nkv = 0 if key is None else key.view(tokens, -1, head_size).shape[1]
    rot = cos_sin_cache.shape[1]
    values = {"positions": positions, "query": query, "key": 0 if key is None else key,
              "cos_sin_cache": cos_sin_cache, "rot_dim": rot, "query_stride": q3.stride(0),
              "key_stride": 0 if key is None else key.view(tokens, -1, head_size).stride(0),
              "head_stride": q3.stride(1), "num_heads": nh, "num_kv_heads": nkv,
              "head_size": head_size, "rope_dim_offset": 0, "inverse": False}
    prod = max(nh, nkv) * rot
    block = prod // 2 if prod <= 1024 else 512
    _launch_so(k, root, values, (tokens, 1, 1), (block, 1, 1))
    return query, key


def stock_qknorm_rope_kv_insert(qkv, positions, num_heads, num_kv_heads, head_dim, eps,
                                cos_sin_cache=None, rotary_dim=0, slot_mapping=None,
                                kv_cache=None, block_size=0, *, root: Path = DEFAULT_DIR,
                                pdl: bool = False):
    """fused_muse_spark_qknorm_rope_kv_insert (bf16 qkv, "auto" bf16 cache), in place.

    kv_cache is the logical [num_blocks, kv_heads, block_size, 2 * head_dim] view.
    Always uses the one-head-per-8-lanes instance (N = 1); the stock picks N = 2 or 4
    only for large T * heads, with the same per-head arithmetic.
    """
    assert qkv.dtype == torch.bfloat16 and head_dim == 64 and qkv.stride(-1) == 1
    tokens = qkv.shape[0]
    rope = cos_sin_cache is not None
    insert = kv_cache is not None and slot_mapping is not None and kv_cache.numel() > 0
    cs = _DT[cos_sin_cache.dtype] if rope else "fp32"
    label = f"qknorm_rope_kv_cs-{cs}_hd64_n1_rope{int(rope)}_ins{int(insert)}"
    k = _so_kernel(label, qkv.device, root)
    heads = num_heads + num_kv_heads + (num_kv_heads if insert else 0)
    values = {"qkv": qkv, "cos_sin_cache": cos_sin_cache if rope else 0, "positions": positions,
              "slot_mapping": slot_mapping if insert else 0, "kv_cache": kv_cache if insert else 0,
              "k_scale": 0, "v_scale": 0, "q_fp8_out": 0, "q_scale": 0, "eps": float(eps),
              "rotary_dim": rotary_dim if rope else 0, "num_tokens": tokens,
              "num_heads": num_heads, "num_kv_heads": num_kv_heads,
              "heads_fastdiv": _fastdiv(heads), "qkv_token_stride": qkv.stride(0),
              "block_fastdiv": _fastdiv(block_size if insert else 1),
              "cache_block_stride": kv_cache.stride(0) if insert else 0,
              "cache_head_stride": kv_cache.stride(1) if insert else 0,
              "cache_token_stride": kv_cache.stride(2) if insert else 0}
    blocks = (tokens * heads * (head_dim // 8) + 255) // 256
    if blocks:
        _launch_so(k, root, values, (blocks, 1, 1), (256, 1, 1), pdl)


def stock_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, *,
                                  root: Path = DEFAULT_DIR):
    """reshape_and_cache_flash with kv_cache_dtype "auto" (a copy); caches are [nb, bs, kvh, hd]."""
    k = _so_kernel("reshape_and_cache_flash_bf16", key.device, root)
    tokens = slot_mapping.shape[0]
    nh, hd = key.shape[-2], key.shape[-1]
    values = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
              "slot_mapping": slot_mapping, "block_stride": key_cache.stride(0),
              "page_stride": key_cache.stride(1), "head_stride": key_cache.stride(2),
              "key_stride": key.stride(0), "value_stride": value.stride(0), "num_heads": nh,
              "head_size": hd, "block_size": key_cache.shape[1], "k_scale": 0, "v_scale": 0,
              "kv_scale_stride": 0}
    _launch_so(k, root, values, (tokens, 1, 1), (min(nh * hd, 512), 1, 1))


# --------------------------------------------------------------------------
# vLLM's Gumbel sampler (Triton, compiled by compile_stock.py --parts gumbel)
# --------------------------------------------------------------------------
# compile_stock.GUMBEL_INTS: the kernel's int arguments in order (the variant name's letters).
_GUMBEL_INTS = ("local_argmax_stride", "local_max_stride", "logits_cache_stride_0", "logits_cache_stride_1",
                "logits_cache_source_stride", "logits_stride", "vocab_size")


def gumbel_variant(ints: dict, col_ptr: int, idx_ptr: int) -> str:
    """The compiled variant Triton's JIT would pick for a launch with the int
    arguments ``ints`` (1: a constexpr, D: a multiple of 16, x: neither) and
    these column and ``idx_map`` addresses (16-byte aligned or not); the name
    ``compile_stock.gumbel_variant_name`` gives it."""
    spec = "".join("1" if ints[k] == 1 else ("D" if ints[k] % 16 == 0 else "x") for k in _GUMBEL_INTS)
    return f"gumbel_{spec}_col{'a' if col_ptr % 16 == 0 else 'u'}_idx{'a' if idx_ptr % 16 == 0 else 'u'}"


def stock_gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature, is_drafting,
                        logits_cache=None, logits_cache_col=None, use_fp64=False, logits_cache_source=None, *,
                        root: Path = DEFAULT_DIR):
    """``gumbel_sample`` as ``DSparkSpeculator._sample_logits`` calls it with
    ``draft_logits`` set: ``_gumbel_sample_kernel`` on grid ``(T, cdiv(V,
    1024))`` (4 warps) writes each 1024-column block's Gumbel-noised maximum
    and its column (and the cache row ``logits_cache[idx, col, :V] =
    source``), then ATen's ``local_max.argmax(-1)`` and the gather of that
    block's column: the sampled ids, int64 ``[T]``. The variant is the one
    Triton's JIT would pick for these arguments (ints equal to 1, multiples of
    16, the 16-byte alignment of ``idx_map`` and of the column pointer)."""
    if not (apply_temperature and is_drafting) or use_fp64 or logits_cache is None:
        raise ValueError("stock_gumbel_sample: only the draft's probabilistic launch is compiled (apply_temperature "
                         "and is_drafting True, use_fp64 False, a logits cache)")
    if logits_cache_col is None or logits_cache_col.dim() != 0 or logits_cache_col.dtype != torch.int32:
        raise ValueError("stock_gumbel_sample: logits_cache_col must be a 0-dim int32 tensor (_step_cols[step])")
    idx = expanded_idx_mapping.contiguous()
    pos = pos.contiguous()
    source = logits if logits_cache_source is None else logits_cache_source
    if source.stride(-1) != 1:
        source = source.contiguous()
    want = ((logits, torch.bfloat16, "logits"), (logits_cache, torch.bfloat16, "logits_cache"),
            (source, torch.bfloat16, "logits_cache_source"), (idx, torch.int64, "expanded_idx_mapping"),
            (pos, torch.int64, "pos"), (seed, torch.int64, "seed"), (temperature, torch.float32, "temperature"))
    for t, dtype, name in want:
        if t.dtype != dtype:
            raise TypeError(f"stock_gumbel_sample: {name} must be {dtype} (the compiled variant), got {t.dtype}")
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits_cache.dim() != 3 or logits_cache.stride(-1) != 1:
        raise ValueError("stock_gumbel_sample: logits [T, V] and logits_cache [reqs, cols, >= V] with unit last "
                         "strides")
    t, v = logits.shape
    if source.shape != logits.shape or logits_cache.shape[-1] < v:
        raise ValueError("stock_gumbel_sample: the source must match the logits and the cache be at least V wide")
    nb = -(-v // 1024)
    local_argmax = logits.new_empty(t, nb, dtype=torch.int64)
    local_max = logits.new_empty(t, nb, dtype=torch.float32)
    ints = {"local_argmax_stride": nb, "local_max_stride": nb, "logits_cache_stride_0": logits_cache.stride(0),
            "logits_cache_stride_1": logits_cache.stride(1), "logits_cache_source_stride": source.stride(0),
            "logits_stride": logits.stride(0), "vocab_size": v}
    if max(ints.values()) >= 2**31:
        raise ValueError("stock_gumbel_sample: the compiled variants take int32 strides and sizes")
    variant = gumbel_variant(ints, logits_cache_col.data_ptr(), idx.data_ptr())
    metas = [m for m in _triton_meta("gumbel_", _arch(logits.device), root) if m["variant"] == variant]
    if not metas:
        raise KeyError(f"{variant} was not compiled (compile_stock.py --parts gumbel --gumbel-vocabs/--gumbel-steps)")
    _aligned(local_argmax, local_max, logits_cache, source, logits, seed, pos, temperature)
    values = {"local_argmax_ptr": local_argmax, "local_max_ptr": local_max, "logits_cache_ptr": logits_cache,
              "logits_cache_col_ptr": logits_cache_col, "logits_cache_source_ptr": source, "logits_ptr": logits,
              "expanded_idx_mapping_ptr": idx, "seeds_ptr": seed, "pos_ptr": pos, "temp_ptr": temperature, **ints}
    if t:
        _launch_triton(metas[0], root, values, (t, nb, 1), False)
    # The host's reduction over the blocks (first block of the maximum), int64 for later indexing.
    return local_argmax.gather(dim=-1, index=local_max.argmax(dim=-1, keepdim=True)).view(-1)


# --------------------------------------------------------------------------
# vLLM's Triton unified attention (TRITON_ATTN; compile_stock.py --parts attention)
# --------------------------------------------------------------------------
# vLLM 0.33.0's constants: v1/attention/backends/triton_attn.py MIN_LAUNCH_GRID_SIZE_2D and
# NUM_PAR_SOFTMAX_SEGMENTS, v1/attention/ops/triton_unified_attention.py MAX_3D_QUERY_LEN.
UA_MIN_GRID_2D, UA_SEGMENTS, UA_MAX_3D_QUERY_LEN = 128, 16, 8
# compile_stock.UATTN_INTS / UREDUCE_INTS: the kernels' int arguments in order (the variant names' letters);
# the ones annotated tl.int32 / tl.int64 in the kernel never become constexprs (a 1 is a plain int there).
UATTN_INTS = ("softcap", "block_table_stride", "query_stride_0", "query_stride_1", "output_stride_0",
              "output_stride_1", "qq_bias_stride_0", "stride_k_cache_0", "stride_k_cache_1", "stride_k_cache_2",
              "stride_v_cache_0", "stride_v_cache_1", "stride_v_cache_2", "num_seqs")
UREDUCE_INTS = ("num_seqs", "output_stride_0", "output_stride_1", "block_table_stride")
_UNANNOTATED = {("uattn", "softcap"), ("ureduce", "num_seqs")}


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def unified_attention_threshold(num_kv_heads: int, capture_sizes=None) -> int:
    """``TritonAttentionMetadataBuilder``'s ``seq_threshold_3D``: the fewest
    requests whose 2D grid has 128 programs (``128 // num_kv_heads``), moved
    to the nearest CUDA-graph capture size where graphs are captured (vLLM's
    default sizes 1, 2, 4, 8, 16, ... hold 16, 32, 64 and 128 themselves)."""
    threshold = UA_MIN_GRID_2D // num_kv_heads
    if capture_sizes:
        threshold = min(capture_sizes, key=lambda size: abs(size - threshold))
    return threshold


def unified_attention_scratch(num_heads: int, num_kv_heads: int, head_size: int, num_speculative_tokens: int,
                              device, *, max_num_seqs: int | None = None, capture_sizes=None,
                              parallel_drafting: bool = True) -> dict:
    """The split-softmax scratch ``TritonAttentionMetadataBuilder`` allocates
    once (sm_90 and sm_100: 16 segments), as the keyword arguments
    ``unified_attention`` takes: rows for ``min(threshold, max_num_seqs)``
    requests of ``min(1 + N (2 N with parallel drafting, DSpark's), 8)``
    query tokens, FP32 partial outputs (head padded to a power of two), maxima
    and sums."""
    threshold = unified_attention_threshold(num_kv_heads, capture_sizes)
    seqs = threshold if max_num_seqs is None else min(threshold, max_num_seqs)
    rows = seqs * min(1 + num_speculative_tokens * (2 if parallel_drafting else 1), UA_MAX_3D_QUERY_LEN)
    f32 = torch.float32
    return {"seq_threshold_3D": threshold, "num_par_softmax_segments": UA_SEGMENTS,
            "softmax_segm_output": torch.empty(rows, num_heads, UA_SEGMENTS, _next_pow2(head_size), dtype=f32,
                                               device=device),
            "softmax_segm_max": torch.empty(rows, num_heads, UA_SEGMENTS, dtype=f32, device=device),
            "softmax_segm_expsum": torch.empty(rows, num_heads, UA_SEGMENTS, dtype=f32, device=device)}


def unified_attention_plan(num_tokens: int, num_seqs: int, max_seqlen_q: int, num_heads: int, num_kv_heads: int,
                           head_size: int, block_size: int, *, seq_threshold_3D=None, num_segments=None,
                           scratch_rows=None) -> dict:
    """vLLM's launch choice for ``unified_attention`` on the draft's operands
    (BF16, causal, no window, no softcap, sinks, ALiBi, FP8 or batch
    invariance; head size not 256), restated: ``BLOCK_M`` 16 query rows (the
    next power of two above 16 heads a KV head), ``BLOCK_Q = BLOCK_M / (heads
    a KV head)`` tokens a program, an upper bound of ``num_tokens // BLOCK_Q
    + num_seqs`` q blocks; the 3D (split-softmax) kernel where the scratch is
    given and holds the tokens, the longest query has at most 8 tokens and
    ``num_seqs * cdiv(max_seqlen_q, BLOCK_Q) <= seq_threshold_3D``: tile 16
    (BF16), ``num_segments`` segments on grid z, then ``reduce_segments`` on
    ``(num_tokens, num_heads)``; else the 2D kernel, tile 32.
    Returns the constexprs each kernel is compiled with, the grids and
    ``is_3d``."""
    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else _next_pow2(group)
    block_q = block_m // group
    q_blocks = num_tokens // block_q + num_seqs
    use_3d = (seq_threshold_3D is not None and num_segments is not None and scratch_rows is not None
              and max_seqlen_q <= UA_MAX_3D_QUERY_LEN
              and num_seqs * -(-max_seqlen_q // block_q) <= seq_threshold_3D
              and scratch_rows >= num_tokens)
    tile_decode, tile = 16, (16 if use_3d else 32)  # _get_tile_size: BF16 decode 16, prefill 32
    segments = num_segments if use_3d else 1
    const = {"num_query_heads": num_heads, "num_queries_per_kv": group, "BLOCK_SIZE": block_size,
             "TILE_SIZE": tile, "HEAD_SIZE": head_size, "HEAD_SIZE_PADDED": _next_pow2(head_size),
             "BLOCK_Q": block_q, "BLOCK_M": block_m, "NUM_SEGMENTS_PER_SEQ": segments, "IS_3D": use_3d,
             "USE_CAUSAL": True, "SLIDING_WINDOW": 0, "USE_SOFTCAP": False, "USE_SINKS": False, "USE_FP8": False,
             "KV_QUANT_MODE": 0}
    reduce = {"num_query_heads": num_heads, "TILE_SIZE": tile_decode, "HEAD_SIZE": head_size,
              "HEAD_SIZE_PADDED": _next_pow2(head_size), "BLOCK_Q": block_q, "NUM_SEGMENTS_PER_SEQ": segments,
              "USE_FP8": False}
    return {"is_3d": use_3d, "const": const, "grid": (q_blocks, num_kv_heads, segments),
            "reduce_const": reduce if use_3d else None, "reduce_grid": (num_tokens, num_heads, 1) if use_3d else None}


def _int_letters(kind: str, names, ints: dict) -> str:
    """Triton's JIT specialization of each int (1: a constexpr, for an unannotated int only; D: a multiple of 16)."""
    out = ""
    for k in names:
        v = int(ints[k])
        out += "1" if v == 1 and (kind, k) in _UNANNOTATED else ("D" if v % 16 == 0 else "x")
    return out


def uattn_name(const: dict, specs: str) -> str:
    """``uattn_{2d|3d}_H{heads}_G{heads per KV head}_D{head}_B{block}[_S{segments}]_{specs}``: a
    ``kernel_unified_attention`` variant's name (compile_stock names what it compiles with it)."""
    seg = f"_S{const['NUM_SEGMENTS_PER_SEQ']}" if const["IS_3D"] else ""
    return (f"uattn_{'3d' if const['IS_3D'] else '2d'}_H{const['num_query_heads']}_G{const['num_queries_per_kv']}"
            f"_D{const['HEAD_SIZE']}_B{const['BLOCK_SIZE']}{seg}_{specs}")


def ureduce_name(const: dict, specs: str) -> str:
    """``ureduce_H{heads}_D{head}_T{tile}_Q{BLOCK_Q}_S{segments}_{specs}``: a ``reduce_segments`` variant's name."""
    return (f"ureduce_H{const['num_query_heads']}_D{const['HEAD_SIZE']}_T{const['TILE_SIZE']}_Q{const['BLOCK_Q']}"
            f"_S{const['NUM_SEGMENTS_PER_SEQ']}_{specs}")


def uattn_variant(const: dict, ints: dict) -> str:
    """The compiled ``kernel_unified_attention`` variant for a launch."""
    return uattn_name(const, _int_letters("uattn", UATTN_INTS, ints))


def ureduce_variant(const: dict, ints: dict) -> str:
    """The compiled ``reduce_segments`` variant for a launch."""
    return ureduce_name(const, _int_letters("ureduce", UREDUCE_INTS, ints))


def _uattn_meta(prefix: str, variant: str, const: dict, device, root: Path) -> dict:
    metas = [m for m in _triton_meta(prefix, _arch(device), root) if m["variant"] == variant]
    if not metas:
        raise KeyError(f"{variant} was not compiled (compile_stock.py --parts attention --attn-heads/--attn-rows/"
                       "--attn-n)")
    wrong = {k: (v, metas[0]["constexprs"].get(k)) for k, v in const.items() if metas[0]["constexprs"].get(k) != v}
    if wrong:
        raise RuntimeError(f"{variant}: compiled with other constexprs than the launch wants: {wrong}")
    return metas[0]


def unified_attention_launches(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                               causal, window_size, block_table, softcap, q_descale, k_descale, v_descale,
                               seq_threshold_3D=None, num_par_softmax_segments=None, softmax_segm_output=None,
                               softmax_segm_max=None, softmax_segm_expsum=None, *, root: Path = DEFAULT_DIR) -> list:
    """``unified_attention``'s launches without running them: ``[(meta,
    values, grid)]`` (the attention kernel, then ``reduce_segments`` on the
    3D path), the checks made first."""
    if not (causal is True and tuple(window_size)[0] < 0 and not softcap and q_descale is None):
        raise ValueError("unified_attention: only the draft's launch is compiled (causal=True, no window, softcap "
                         "0, no FP8 query)")
    for name, t, dtype in (("q", q, torch.bfloat16), ("k", k, torch.bfloat16), ("v", v, torch.bfloat16),
                           ("out", out, torch.bfloat16), ("cu_seqlens_q", cu_seqlens_q, torch.int32),
                           ("seqused_k", seqused_k, torch.int32), ("block_table", block_table, torch.int32),
                           ("k_descale", k_descale, torch.float32), ("v_descale", v_descale, torch.float32)):
        if t.dtype != dtype:
            raise TypeError(f"unified_attention: {name} must be {dtype} (the compiled variant), got {t.dtype}")
    if q.dim() != 3 or out.shape != q.shape or k.dim() != 4 or v.shape != k.shape:
        raise ValueError("unified_attention: q and out [tokens, heads, D], k and v [blocks, block_size, kv_heads, D]")
    if q.stride(2) != 1 or out.stride(2) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("unified_attention: the head dimension must be contiguous (stride_k_cache_3 = 1: a "
                         "constexpr)")
    if softcap != 0 or isinstance(softcap, float):
        raise TypeError("unified_attention: softcap must be the int 0 (what TritonAttentionImpl passes without a "
                        "soft cap; a float 0.0 is another signature)")
    tokens, heads, head_size = q.shape
    block_size, kv_heads = v.shape[1], k.shape[2]
    if k.shape[3] != head_size or heads % kv_heads:
        raise ValueError(f"unified_attention: {heads} heads of {head_size} over {kv_heads} KV heads of {k.shape[3]}")
    seqs = seqused_k.shape[0]
    scratch = (softmax_segm_output, softmax_segm_max, softmax_segm_expsum)
    rows = softmax_segm_max.shape[0] if all(t is not None for t in scratch) else None
    plan = unified_attention_plan(tokens, seqs, int(max_seqlen_q), heads, kv_heads, head_size, block_size,
                                  seq_threshold_3D=seq_threshold_3D, num_segments=num_par_softmax_segments,
                                  scratch_rows=rows)
    ints = {"softcap": 0, "block_table_stride": block_table.stride(0), "query_stride_0": q.stride(0),
            "query_stride_1": q.stride(1), "output_stride_0": out.stride(0), "output_stride_1": out.stride(1),
            "qq_bias_stride_0": 0, "stride_k_cache_0": k.stride(0), "stride_k_cache_1": k.stride(1),
            "stride_k_cache_2": k.stride(2), "stride_v_cache_0": v.stride(0), "stride_v_cache_1": v.stride(1),
            "stride_v_cache_2": v.stride(2), "num_seqs": seqs}
    meta = _uattn_meta("uattn_", uattn_variant(plan["const"], ints), plan["const"], q.device, root)
    _aligned(out, q, k, v, block_table, seqused_k, k_descale, v_descale, cu_seqlens_q)
    values = {"output_ptr": out, "query_ptr": q, "key_cache_ptr": k, "value_cache_ptr": v,
              "block_tables_ptr": block_table, "seq_lens_ptr": seqused_k, "scale": float(softmax_scale),
              "k_scale": k_descale, "v_scale": v_descale, "out_scale": 1.0, "rswa_prefix_lens_ptr": seqused_k,
              "query_start_len_ptr": cu_seqlens_q, **ints}
    launches = [(meta, values, plan["grid"])]
    if plan["is_3d"]:
        segm = scratch
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in segm):
            raise ValueError("unified_attention: the softmax scratch must be contiguous FP32")
        _aligned(*segm)
        values.update(segm_output_ptr=segm[0], segm_max_ptr=segm[1], segm_expsum_ptr=segm[2])
        rints = {"num_seqs": seqs, "output_stride_0": out.stride(0), "output_stride_1": out.stride(1),
                 "block_table_stride": block_table.stride(0)}
        rmeta = _uattn_meta("ureduce_", ureduce_variant(plan["reduce_const"], rints), plan["reduce_const"], q.device,
                            root)
        rvalues = {"output_ptr": out, "segm_output_ptr": segm[0], "segm_max_ptr": segm[1],
                   "segm_expsum_ptr": segm[2], "seq_lens_ptr": seqused_k, "out_scale_inv": 1.0,
                   "query_start_len_ptr": cu_seqlens_q, **rints}
        launches.append((rmeta, rvalues, plan["reduce_grid"]))
    for m, _, _ in launches:
        if m["shared"] > 48 * 1024:
            raise RuntimeError(f"{m['variant']}: {m['shared']} B of shared memory needs the opt-in attribute")
    return launches


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      window_size, block_table, softcap, q_descale, k_descale, v_descale, seq_threshold_3D=None,
                      num_par_softmax_segments=None, softmax_segm_output=None, softmax_segm_max=None,
                      softmax_segm_expsum=None, *, root: Path = DEFAULT_DIR):
    """``vllm.v1.attention.ops.triton_unified_attention.unified_attention`` as
    ``TritonAttentionImpl.forward`` calls it for the draft (same arguments:
    q ``[tokens, heads, D]``, the K and V cache views ``[blocks, block_size,
    kv_heads, D]``, out written in place, int32 ``cu_seqlens_q`` / ``seqused_k``
    / block table, the metadata builder's scratch: ``unified_attention_scratch``);
    the 2D or 3D launch (and ``reduce_segments``) ``unified_attention_plan``
    picks, from the carried binaries. Returns ``out``."""
    for meta, values, grid in unified_attention_launches(
            q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal, window_size,
            block_table, softcap, q_descale, k_descale, v_descale, seq_threshold_3D, num_par_softmax_segments,
            softmax_segm_output, softmax_segm_max, softmax_segm_expsum, root=root):
        if all(grid):
            _launch_triton(meta, root, values, grid, False)
    return out


def paged_metadata(attn_slots: torch.Tensor, block_size: int, table_width: int | None = None) -> dict:
    """vLLM's paged-attention metadata equal to attention over ``attn_slots``
    ``[m, S]`` (``dspark_core.spec.attention``'s operand: row i's valid slots
    non-negative), read on the host once: rows grouped into requests (a row
    continues the request of the row before where its valid slots are those
    plus one more), each request causal (row k of a request of q rows over
    ``seq_len`` slots attends the first ``seq_len - q + k + 1``: its valid
    slots must be a prefix of the row), its slots whole pages of the cache
    (slot j in page ``table[j // block_size]`` at ``j % block_size``).
    Returns int32 ``cu_seqlens_q``, ``seqused_k`` and ``block_table``
    (``table_width`` columns, default the widest request's, zeros past a
    request's pages) on ``attn_slots``' device, ``max_seqlen_q``,
    ``max_seqlen_k``. ValueError where the slots are not of that form."""
    s = attn_slots.detach().to("cpu", torch.int64)
    m, width = s.shape
    valid = s >= 0
    counts = valid.sum(dim=1)
    if m == 0 or int(counts.min()) == 0 or not bool((valid == (torch.arange(width)[None, :] < counts[:, None])).all()):
        raise ValueError("paged_metadata: each row's valid slots must be a non-empty prefix of it")
    starts = [0]
    for i in range(1, m):
        c = int(counts[i - 1])
        if not (int(counts[i]) == c + 1 and bool((s[i, :c] == s[i - 1, :c]).all())):
            starts.append(i)
    bounds = list(zip(starts, starts[1:] + [m]))
    pages_needed = max(-(-int(counts[b - 1]) // block_size) for _, b in bounds)
    table_width = pages_needed if table_width is None else table_width
    if table_width < pages_needed:
        raise ValueError(f"paged_metadata: a request needs {pages_needed} pages, more than table_width {table_width}")
    table = torch.zeros(len(bounds), table_width, dtype=torch.int32)
    for r, (_, b) in enumerate(bounds):
        slots = s[b - 1, :int(counts[b - 1])]
        pages = slots[::block_size] // block_size
        j = torch.arange(slots.numel())
        if not bool((slots == pages[j // block_size] * block_size + j % block_size).all()):
            raise ValueError(f"paged_metadata: request {r}'s slots do not fill whole pages in order")
        table[r, :pages.numel()] = pages.to(torch.int32)
    q_lens = torch.tensor([b - a for a, b in bounds])
    seq_lens = torch.tensor([int(counts[b - 1]) for _, b in bounds])
    device = attn_slots.device
    return {"cu_seqlens_q": torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(device, torch.int32),
            "seqused_k": seq_lens.to(device, torch.int32), "block_table": table.to(device),
            "max_seqlen_q": int(q_lens.max()), "max_seqlen_k": int(seq_lens.max())}
