"""GPU tests of ``dspark_cute.DraftBoundary``: bit for bit
``dspark_core.layers.residual_boundary`` run on the same CUDA device (its new
FP32 stream and its BF16 output), for post/pre norms of every weight kind,
FP32 and BF16 streams, with and without the stream stored, early and late
gates, with and without PDL, many row counts, special values and in a CUDA
graph. Outputs are poisoned before each launch (a NaN pattern, then a finite
one) so an unwritten element shows."""

from __future__ import annotations

import pytest
import torch
from cute_testing import check_poisoned, random_rows, requires_cuda, special_rows
from dspark_core.compare import assert_bitwise
from dspark_core.constants import boundary_constants
from dspark_core.layers import GatedResidual, residual_boundary
from test_gpu_row_norm import NORMS, ROWS, _name, make_norm

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
    return f"post_{_name(pair[0])}__pre_{_name(pair[1])}"


def make_boundary(pair, gen: torch.Generator, special: bool = False):
    """The stock post norm, gated residual and pre norm of ``pair`` with
    random constants (``special``: some gates -0.0, subnormal or large)."""
    post = make_norm(pair[0], H, BF16, gen, special_weight=special)
    pre = make_norm(pair[1], H, BF16, gen, special_weight=special)
    conn = GatedResidual(H).cuda()
    conn.alpha.data.copy_(torch.rand(H, generator=gen, device="cuda") + 0.5)
    conn.beta.data.copy_(torch.randn(H, generator=gen, device="cuda") * 0.5)
    if special:
        conn.alpha.data[0::101] = -0.0
        conn.beta.data[1::101] = 1e-40
        conn.alpha.data[2::101] = 1e30
        conn.beta.data[3::101] = -0.0
    return post, conn, pre


def check(modules, branch, stream, store: bool, what: str, **kwargs) -> None:
    from dspark_cute import DraftBoundary

    post, conn, pre = modules
    kernel = DraftBoundary(
        boundary_constants(post, conn, pre, H), conn.alpha, conn.beta, post.weight, pre.weight,
        **kwargs,
    )
    kernel.prepare(stream_dtypes=(stream.dtype,), store_stream=(store,))
    assert kernel.takes(branch, stream)
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
    got_stream, got_out = kernel.run(branch, stream, store)
    assert (got_stream is None) == (not store)
    assert_bitwise(got_out, exp_out, f"{what} (allocated output)")
    if store:
        assert_bitwise(got_stream, exp_stream, f"{what} (allocated new stream)")


def _rows(gen, m, stream_dtype):
    return random_rows(gen, m, H, BF16, "cuda"), random_rows(gen, m, H, stream_dtype, "cuda")


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_name)
@pytest.mark.parametrize("store", [False, True], ids=["nostore", "store"])
@pytest.mark.parametrize("stream_dtype", [FP32, BF16], ids=["stream_fp32", "stream_bf16"])
def test_every_variant(pair, store, stream_dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(pair, gen)
    # 1 and 16 rows load the gates early, 133 late (an H200 has 132 SMs);
    # late_rows forces the other timing at each count too.
    for m in (1, 16, 133):
        branch, stream = _rows(gen, m, stream_dtype)
        check(modules, branch, stream, store, f"{_pair_name(pair)} m={m}")
        forced = 0 if m <= 132 else 10**6
        check(modules, branch, stream, store, f"{_pair_name(pair)} m={m} late_rows={forced}",
              late_rows=forced)


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
        # Special branch rows over a normal stream, and the reverse.
        check(modules, specials, normal_stream, True, f"special branch, {stream_dtype} stream")
        check(modules, normal_branch, s_specials, True, f"special {stream_dtype} stream")


@pytest.mark.parametrize("m", [1, 133])
def test_without_pdl(m, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = make_boundary(PAIRS[3], gen)
    branch, stream = _rows(gen, m, FP32)
    check(modules, branch, stream, True, f"no PDL m={m}", pdl=False)


@pytest.mark.parametrize("m", [4, 200])
def test_cuda_graph_chain(m, seed):
    """Two boundaries in one graph, the second reading the first's outputs
    (as consecutive draft layers do): PDL must order them; replays repeat."""
    from dspark_cute import DraftBoundary

    gen = torch.Generator(device="cuda").manual_seed(seed)
    post, conn, pre = make_boundary(PAIRS[0], gen)
    kernel = DraftBoundary(
        boundary_constants(post, conn, pre, H), conn.alpha, conn.beta, post.weight, pre.weight
    )
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
        first = [t.clone() for t in news + outs]
        graph.replay()
        torch.cuda.synchronize()
        for a, t in zip(first, news + outs):
            assert torch.equal(a.view(torch.int16), t.view(torch.int16)), "replays differ"


def test_refuses_bad_operands(seed):
    from dspark_cute import DraftBoundary

    gen = torch.Generator(device="cuda").manual_seed(seed)
    post, conn, pre = make_boundary(PAIRS[0], gen)
    c = boundary_constants(post, conn, pre, H)
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
