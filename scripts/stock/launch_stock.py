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
