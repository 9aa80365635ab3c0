"""moe_combine on a real GPU: bitwise the eager f32 loop in the same order, dropped pairs
skipped and never read, every element written, the same bits run to run."""

import pytest
import torch

import ptxforge
import ptxforge.ops  # noqa: F401  registers torch.ops.ptxforge
from ptxforge.testing.reference import moe_combine as reference

pytestmark = pytest.mark.gpu


def problem(tokens, topk, hidden, weight_dtype, *, spare_rows=5, dropped=0.1, seed=0):
    """y with a row for each (token, expert) pair and a few rows no pair names (a masked
    layout's padding), each pair's row distinct as a grouped GEMM writes them; a fraction
    ``dropped`` of the pairs marked -1, a few others R or past it (also dropped);
    softmax-like weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = tokens * topk + spare_rows
    y = torch.randn(r, hidden, device="cuda", generator=g).bfloat16()
    rows = torch.randperm(r, device="cuda", generator=g)[:tokens * topk].view(tokens, topk)
    rows = rows.int()
    drop = torch.rand(tokens, topk, device="cuda", generator=g) < dropped
    rows[drop] = -1
    if tokens * topk > 2:
        rows.view(-1)[1] = r
        rows.view(-1)[2] = r + 1000
    weights = torch.rand(tokens, topk, device="cuda", generator=g) + 0.01
    weights = (weights / weights.sum(-1, keepdim=True)).to(weight_dtype)
    return y, rows, weights


def assert_bitwise(out, expected):
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    same = out.view(torch.int16) == expected.view(torch.int16)
    assert same.all(), (f"{(~same).sum().item()} of {same.numel()} elements differ, first at "
                        f"{(~same).nonzero()[0].tolist()}")


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64, 4096])
def test_matches_the_eager_loop_bitwise(tokens, topk, hidden, weight_dtype):
    y, rows, weights = problem(tokens, topk, hidden, weight_dtype)
    out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    returned = ptxforge.moe_combine(y, rows, weights, out=out)
    assert returned is out
    assert_bitwise(out, reference(y, rows, weights))  # NaN-poisoned: every element written
    assert_bitwise(ptxforge.moe_combine(y, rows, weights), reference(y, rows, weights))


@pytest.mark.parametrize("tokens, topk, hidden", [
    (33, 8, 1032), (5, 1, 1160), (3, 6, 8), (17, 4, 576), (9, 16, 2112), (4, 32, 512)],
    ids=["ragged-k8", "ragged-4-slots", "one-vector", "k4", "k16", "k32"])
def test_edge_sizes_match_the_eager_loop_bitwise(tokens, topk, hidden):
    """Rows no multiple of a chunk (the last chunk's threads or slots past the end), one
    vector a row, and k above 8 (no register cap)."""
    for weight_dtype in (torch.float32, torch.bfloat16):
        y, rows, weights = problem(tokens, topk, hidden, weight_dtype, dropped=0.2)
        out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
        ptxforge.moe_combine(y, rows, weights, out=out)
        assert_bitwise(out, reference(y, rows, weights))


def test_dropped_pairs_are_never_read():
    """y is a view between NaN rows: a pair reading row -1 (sign-extended), R or R + 1 would
    turn its token's output into NaN. All of token 0's pairs are dropped: zeros."""
    hidden, r = 7168, 64
    buffer = torch.full((r + 4, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = buffer[2:2 + r]
    y.copy_(torch.randn(r, hidden, device="cuda").bfloat16())
    rows = torch.tensor([[-1, r, r + 1, -1], [0, -1, 5, r], [r + 1, 7, -1, 3]],
                        device="cuda", dtype=torch.int32)
    weights = torch.rand(3, 4, device="cuda")
    out = ptxforge.moe_combine(y, rows, weights)
    assert not out.isnan().any()
    assert torch.equal(out[0].view(torch.int16), torch.zeros_like(out[0]).view(torch.int16))
    assert_bitwise(out, reference(y, rows, weights))


def test_outputs_are_bitwise_repeatable():
    y, rows, weights = problem(4096, 8, 7168, torch.float32)
    first = ptxforge.moe_combine(y, rows, weights)
    for _ in range(2):
        assert torch.equal(ptxforge.moe_combine(y, rows, weights).view(torch.int16),
                           first.view(torch.int16))


def test_strided_rows_and_a_masked_layout():
    """y with a row stride past H, and the masked layout [G, M_max, H] viewed as rows."""
    y, rows, weights = problem(64, 8, 2048, torch.float32)
    wide = torch.zeros(y.shape[0], 2048 + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, :2048] = y
    assert_bitwise(ptxforge.moe_combine(wide[:, :2048], rows, weights), reference(y, rows, weights))
    groups, m_max = 4, 160
    masked = torch.randn(groups, m_max, 2048, device="cuda").bfloat16()
    flat = masked.view(groups * m_max, 2048)
    rows = (torch.randint(0, groups, (64, 8), device="cuda") * m_max
            + torch.randint(0, 128, (64, 8), device="cuda")).int()
    assert_bitwise(ptxforge.moe_combine(flat, rows, weights), reference(flat, rows, weights))


def test_no_tokens_launch_nothing():
    y = torch.randn(16, 7168, device="cuda").bfloat16()
    out = ptxforge.moe_combine(y, torch.empty(0, 8, device="cuda", dtype=torch.int32),
                               torch.empty(0, 8, device="cuda"))
    assert out.shape == (0, 7168) and out.dtype == torch.bfloat16


def test_pdl_the_operator_and_a_graph_give_the_same_bits():
    y, rows, weights = problem(64, 8, 7168, torch.bfloat16)
    expected = reference(y, rows, weights)
    assert_bitwise(ptxforge.moe_combine(y, rows, weights, pdl=True), expected)
    assert_bitwise(torch.ops.ptxforge.moe_combine(y, rows, weights), expected)
    out = torch.empty_like(expected)
    ptxforge.moe_combine(y, rows, weights, out=out)  # built and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        ptxforge.moe_combine(y, rows, weights, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, expected)


def test_errors_on_the_gpu():
    y, rows, weights = problem(8, 2, 2048, torch.float32)
    with pytest.raises(ValueError, match="^out overlaps an input; outputs must not alias inputs$"):
        ptxforge.moe_combine(y, rows, weights, out=y[:8])
    with pytest.raises(ValueError, match="^rows must be on a CUDA device, got cpu$"):
        ptxforge.moe_combine(y, rows.cpu(), weights)
    with pytest.raises(TypeError, match="^rows must have dtype torch.int32, got torch.int64$"):
        ptxforge.moe_combine(y, rows.long(), weights)
    with pytest.raises(ValueError, match=r"^weights must have shape \(8, 2\), got \(8, 1\)$"):
        ptxforge.moe_combine(y, rows, weights[:, :1].contiguous())
    with pytest.raises(ValueError, match="^weights must be contiguous"):
        ptxforge.moe_combine(y, rows, weights.t().contiguous().t())
    with pytest.raises(ValueError, match=r"^hidden size \(y.shape\[1\]\) must be a positive "
                                         r"multiple of 8, got 2044$"):
        ptxforge.moe_combine(y[:, :2044], rows, weights)
