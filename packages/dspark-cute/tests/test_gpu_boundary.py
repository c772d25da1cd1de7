"""GPU tests of ``dspark_cute.DraftBoundary``: bit for bit
``dspark_core.spec.layers.residual_boundary`` run on the same CUDA device
with the constants' arch's tree (sm_90a; sm_100a for some pairs: the tree is
the constants', so both run on an H200): its new FP32 stream and its BF16
output, for post/pre norms of every weight kind, FP32 and BF16 streams, with
and without the stream stored, early and late gates, with and without PDL,
many row counts, special values and in a CUDA graph; and bit for bit the
stock draft layer's chain on the same operands (vLLM 0.33.0's
``fused_rmsnorm_fwd`` binaries, ATen's ``alpha * stream + beta * p``, the
stock norm again), m in {1, 2, 7, 16, 133, 4096}, special rows planted.
Outputs are poisoned before each launch (a NaN pattern, then a finite one)
so an unwritten element shows."""

from __future__ import annotations

import pytest
import torch
from cute_testing import (
    assert_replays_repeat,
    check_poisoned,
    make_norm,
    norm_name,
    random_rows,
    requires_cuda,
    special_rows,
)
from norm_testing import STOCK_ROWS, boundary_consts, planted_rows, stock_boundary, stock_or_skip, with_arch
from test_gpu_row_norm import NORMS, ROWS

from dspark_core.spec.layers import GatedResidual, residual_boundary
from dspark_core.tools.compare import assert_bitwise

pytestmark = [pytest.mark.gpu, requires_cuda]

BF16, FP32 = torch.bfloat16, torch.float32
H = 8192
# (post-norm case, pre-norm case): every weight dtype, both sides of the
# norm, both centers and no weight appear on each side.
PAIRS = [
    (NORMS[1], NORMS[2]),
    (NORMS[0], NORMS[6]),
    (NORMS[3], NORMS[0]),
    (NORMS[5], NORMS[4]),
    (NORMS[2], NORMS[5]),
    (NORMS[6], NORMS[3]),
]


def _pair_name(pair) -> str:
    return f"post_{norm_name(pair[0])}__pre_{norm_name(pair[1])}"


def make_boundary(pair, gen: torch.Generator, special: bool = False, h: int = H):
    """The stock post norm, gated residual and pre norm of ``pair`` with
    random constants (``special``: some gates -0.0, subnormal or large)."""
    post = make_norm(pair[0], h, gen, special_weight=special, out_dtype=BF16)
    pre = make_norm(pair[1], h, gen, special_weight=special, out_dtype=BF16)
    conn = GatedResidual(h).cuda()
    conn.alpha.data.copy_(torch.rand(h, generator=gen, device="cuda") + 0.5)
    conn.beta.data.copy_(torch.randn(h, generator=gen, device="cuda") * 0.5)
    if special:
        conn.alpha.data[0::101] = -0.0
        conn.beta.data[1::101] = 1e-40
        conn.alpha.data[2::101] = 1e30
        conn.beta.data[3::101] = -0.0
    return post, conn, pre


def boundary(modules, arch: str = "sm_90a", **kwargs):
    from dspark_cute import DraftBoundary

    post, conn, pre = modules
    return DraftBoundary(boundary_consts(post, conn, pre, arch), conn.alpha, conn.beta, post.weight, pre.weight,
                         **kwargs)


def check(modules, branch, stream, store: bool, what: str, arch: str = "sm_90a", stock_outs=None,
          **kwargs) -> None:
    """The kernel of ``modules`` on ``arch`` against the spec with that arch's
    tree (and against the stock chain's ``stock_outs`` = (new stream, out),
    if given), outputs poisoned."""
    post, conn, pre = modules
    with_arch(post, arch)
    with_arch(pre, arch)
    kernel = boundary(modules, arch, **kwargs)
    kernel.prepare(stream_dtypes=(stream.dtype,), store_stream=(store,))
    assert kernel.takes(branch, stream)
    what = f"{what} [{arch}] variant={kernel.variant(branch.shape[0], stream.dtype, store)}"
    exp_stream, exp_out = residual_boundary(post, conn, pre, branch, stream)
    out = torch.empty_like(exp_out)
    if store:
        new_stream = torch.empty_like(exp_stream)
        check_poisoned(
            lambda: kernel.run(branch, stream, True, out, new_stream),
            [new_stream, out], [exp_stream, exp_out], what,
        )
    else:
        check_poisoned(lambda: kernel.run(branch, stream, False, out), [out], [exp_out], what)
    if stock_outs is not None:
        assert_bitwise(out, stock_outs[1], f"{what}: the output against the stock chain")
        if store:
            assert_bitwise(new_stream, stock_outs[0], f"{what}: the new stream against the stock chain")
    got_stream, got_out = kernel.run(branch, stream, store)
    assert (got_stream is None) == (not store)
    assert_bitwise(got_out, exp_out, f"{what} (allocated output)")
    if store:
        assert_bitwise(got_stream, exp_stream, f"{what} (allocated new stream)")


def _rows(gen, m, stream_dtype, h: int = H):
    return random_rows(gen, m, h, BF16, "cuda"), random_rows(gen, m, h, stream_dtype, "cuda")


# Launch settings that force each kernel variant at a row count (by default,
# up to one row per SM loads the gates early, more load them late).
FORCE_LATE = {"late_rows": 0}
FORCE_EARLY = {"late_rows": 10**6}


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_name)
@pytest.mark.parametrize("store", [False, True], ids=["nostore", "store"])
@pytest.mark.parametrize("stream_dtype", [FP32, BF16], ids=["stream_fp32", "stream_bf16"])
def test_every_variant(pair, store, stream_dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(pair, gen)
    # Each count with its default variant and every variant forced.
    for m in (1, 16, 133):
        branch, stream = _rows(gen, m, stream_dtype)
        for force in ({}, FORCE_LATE, FORCE_EARLY):
            check(modules, branch, stream, store, f"{_pair_name(pair)} m={m} {force}", **force)


@pytest.mark.parametrize("pair", [PAIRS[1], PAIRS[2], PAIRS[4]], ids=_pair_name)
@pytest.mark.parametrize("store", [False, True], ids=["nostore", "store"])
def test_sm100a_tree(pair, store, seed):
    """The sm_100a tree on both norms (weightless, input-scaled, FP16 and
    FP32 weights among the pairs), every gate timing, special rows planted."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(pair, gen, special=True)
    for m in (1, 16, 133):
        branch, stream = planted_rows(gen, m, H, BF16), planted_rows(gen, m, H, FP32)
        for force in ({}, FORCE_LATE, FORCE_EARLY):
            check(modules, branch, stream, store, f"{_pair_name(pair)} m={m} {force}", arch="sm_100a", **force)


@pytest.mark.parametrize("h", [2048, 4096, 16384])
def test_hidden_sizes(h, seed):
    """Other widths: 2048, 4096 and 16384 columns."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(PAIRS[4], gen, h=h)
    for m in (3, 40):
        branch, stream = _rows(gen, m, FP32, h)
        for force in ({}, FORCE_LATE, FORCE_EARLY):
            check(modules, branch, stream, True, f"H={h} m={m} {force}", **force)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("stream_dtype", [FP32, BF16], ids=["stream_fp32", "stream_bf16"])
def test_row_counts(m, stream_dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(PAIRS[0], gen)
    branch, stream = _rows(gen, m, stream_dtype)
    check(modules, branch, stream, True, f"m={m}")


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_name)
def test_special_values(pair, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(pair, gen, special=True)
    specials = special_rows(H, BF16, "cuda")
    m = specials.shape[0]
    normal_branch, _ = _rows(gen, m, FP32)
    for stream_dtype in (FP32, BF16):
        s_specials = special_rows(H, stream_dtype, "cuda")
        normal_stream = random_rows(gen, m, H, stream_dtype, "cuda")
        # Special branch rows over a normal stream, and the reverse, in every variant.
        for force in ({}, FORCE_EARLY, FORCE_LATE):
            check(modules, specials, normal_stream, True, f"special branch {stream_dtype} {force}", **force)
            check(modules, normal_branch, s_specials, True, f"special {stream_dtype} stream {force}", **force)


# Norm pairs the stock has (BF16, FP32 or no weight; input-scaled or not;
# centers 0 and 1): every kind on each side.
STOCK_PAIRS = [
    ((BF16, 0.0, False, 1e-6), (BF16, 1.0, True, 1e-5)),
    ((FP32, 1.0, False, 1e-5), (None, 0.0, False, 1e-6)),
    ((None, 0.0, False, 1e-6), (FP32, 0.0, True, 1e-6)),
    ((BF16, 1.0, True, 1e-6), (FP32, 1.0, False, 1e-6)),
    ((FP32, 0.0, True, 1e-5), (BF16, 0.0, False, 1e-6)),
]


@pytest.mark.parametrize("stream_dtype", [FP32, BF16], ids=["stream_fp32", "stream_bf16"])
@pytest.mark.parametrize("pair", STOCK_PAIRS, ids=_pair_name)
def test_against_the_stock(pair, stream_dtype, seed):
    """The kernel (sm_90a) against the stock draft layer's chain on the same
    operands (``norm_testing.stock_boundary``) and against the spec, m in
    {1, 2, 7, 16, 133, 4096} (early and late gates), special rows planted in
    the branch and the stream, special gates and weights."""
    stock = stock_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(pair, gen, special=True)
    for m in STOCK_ROWS:
        branch, stream = planted_rows(gen, m, H, BF16), planted_rows(gen, m, H, stream_dtype)
        stock_outs = stock_boundary(stock, *modules, branch, stream)
        check(modules, branch, stream, True, f"stock {_pair_name(pair)} {stream_dtype} m={m}", stock_outs=stock_outs)


@pytest.mark.parametrize("m", [1, 133])
def test_without_pdl(m, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(PAIRS[3], gen)
    branch, stream = _rows(gen, m, FP32)
    for force in ({}, FORCE_EARLY):
        check(modules, branch, stream, True, f"no PDL m={m} {force}", pdl=False, **force)


@pytest.mark.parametrize("m", [4, 100, 200])
def test_cuda_graph_chain(m, seed):
    """Two boundaries in one graph, the second reading the first's outputs
    (as consecutive draft layers do): PDL must order them; replays repeat."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    post, conn, pre = make_boundary(PAIRS[0], gen)
    kernel = boundary((post, conn, pre))
    kernel.prepare()
    branch, stream = _rows(gen, m, FP32)
    outs = [torch.empty((m, H), dtype=BF16, device="cuda") for _ in range(2)]
    news = [torch.empty((m, H), dtype=FP32, device="cuda") for _ in range(2)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            kernel.run(branch, stream, True, outs[0], news[0])
            kernel.run(outs[0], news[0], True, outs[1], news[1])
    torch.cuda.synchronize()
    for _ in range(2):
        branch.copy_(random_rows(gen, m, H, BF16, "cuda"))
        stream.copy_(random_rows(gen, m, H, FP32, "cuda"))
        exp_news, exp_outs = [], []
        b, st = branch, stream
        for _ in range(2):
            st, b = residual_boundary(post, conn, pre, b, st)
            exp_news.append(st)
            exp_outs.append(b)
        check_poisoned(graph.replay, news + outs, exp_news + exp_outs, "graph replay")
        assert_replays_repeat(graph, news + outs)


def test_refuses_bad_operands(seed):
    from dspark_cute import DraftBoundary

    gen = torch.Generator(device="cuda").manual_seed(seed)
    post, conn, pre = make_boundary(PAIRS[0], gen)
    c = boundary_consts(post, conn, pre, "sm_90a")
    kernel = DraftBoundary(c, conn.alpha, conn.beta, post.weight, pre.weight)
    branch, stream = _rows(gen, 4, FP32)
    for b, s in [
        (branch.float(), stream),
        (branch, stream[:2]),
        (branch, stream.half()),
        (branch[:, :4096].contiguous(), stream[:, :4096].contiguous()),
        (branch[:0], stream[:0]),
    ]:
        assert not kernel.takes(b, s)
        with pytest.raises(ValueError):
            kernel.run(b, s, True)
    with pytest.raises(ValueError):
        kernel.run(branch, stream, False, new_stream=torch.empty_like(stream))
    with pytest.raises(ValueError):
        DraftBoundary(c, conn.alpha.double(), conn.beta, post.weight, pre.weight)
    with pytest.raises(ValueError):
        DraftBoundary(c, conn.alpha, conn.beta, None, pre.weight)
