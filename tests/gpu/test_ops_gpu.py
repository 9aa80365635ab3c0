"""The ops on a real GPU: exact against the references, repeatable, capturable in graphs."""

import pytest
import torch

import ptxforge
from ptxforge import arch
from ptxforge.testing import checks

pytestmark = pytest.mark.gpu


def _check_cases():
    shapes = [(1, 128), (7, 576), (33, 200), (129, 2112), (512, 7168), (3, 8), (65, 16384),
              (4096, 7168)]
    for m, k in shapes:
        for layout in ("mn_major", "row_major"):
            yield pytest.param(checks.check_quantize_per_token, (m, k, layout),
                               id=f"per_token-{m}x{k}-{layout}")
        yield pytest.param(checks.check_rms_norm, (m, k), id=f"rms_norm-{m}x{k}")
        yield pytest.param(checks.check_rms_norm_quantize, (m, k), id=f"fused-{m}x{k}")
    for n, k in [(1, 8), (129, 136), (300, 200), (7168, 2048), (4096, 7168)]:
        yield pytest.param(checks.check_quantize_per_block, (n, k), id=f"per_block-{n}x{k}")
    # SwiGLU: FFN intermediate sizes, 1000 (a partial group), 776 (7 vectors, 16 threads a
    # row), 8 (one vector); gate and up apart or the halves of one tensor.
    for m, k, layout, halves in [
            (1, 128, "mn_major", False), (1, 8, "row_major", True), (7, 1000, "mn_major", False),
            (7, 1000, "row_major", True), (33, 776, "mn_major", True), (64, 2048, "mn_major", True),
            (64, 4096, "row_major", False), (64, 11008, "mn_major", False),
            (4096, 14336, "mn_major", True), (4096, 18432, "mn_major", False),
            (129, 32768, "row_major", True)]:
        yield pytest.param(checks.check_silu_mul_quantize, (m, k, layout, "cuda", halves),
                           id=f"silu_mul-{m}x{k}-{layout}{'-halves' if halves else ''}")


@pytest.mark.parametrize("check, args", list(_check_cases()))
def test_matches_reference(check, args):
    for result in check(*args):
        assert result.passed, result.row()


def test_nan_propagates_like_the_reference():
    for result in checks.check_quantize_per_token(64, 7168, "mn_major", with_nan=True):
        assert result.passed, result.row()
    x = torch.randn(4, 256, device="cuda").to(torch.bfloat16)
    x[1, 3] = float("nan")
    q, s = ptxforge.quantize_fp8_per_token(x, scale_layout="row_major")
    assert torch.isnan(s[1, 0]) and not torch.isnan(s[1, 1]) and not torch.isnan(s[0]).any()


def test_outputs_are_bitwise_repeatable():
    x = torch.randn(1000, 7168, device="cuda").to(torch.bfloat16)
    w = torch.randn(7168, device="cuda").to(torch.bfloat16)
    runs = [(ptxforge.rms_norm(x, w), *ptxforge.rms_norm_quantize_fp8(x, w),
             *ptxforge.quantize_fp8_per_block(x), *ptxforge.silu_mul_quantize_fp8(x, x))
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_strided_rows_and_leading_dims():
    big = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    x = big[:, :512]  # row stride 1024
    w = torch.randn(512, device="cuda").to(torch.bfloat16)
    assert torch.equal(ptxforge.rms_norm(x, w), ptxforge.rms_norm(x.contiguous(), w))
    q1, s1 = ptxforge.quantize_fp8_per_token(x)
    q2, s2 = ptxforge.quantize_fp8_per_token(x.contiguous())
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    x3 = torch.randn(2, 3, 512, device="cuda").to(torch.bfloat16)
    assert torch.equal(ptxforge.rms_norm(x3, w).view(6, 512), ptxforge.rms_norm(x3.view(6, 512), w))


def test_empty_input():
    x = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    q, s = ptxforge.quantize_fp8_per_token(x)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    for layout in ("mn_major", "row_major"):
        q, s = ptxforge.silu_mul_quantize_fp8(*torch.empty(0, 2000, device="cuda",
                                                           dtype=torch.bfloat16).chunk(2, -1),
                                              scale_layout=layout)
        assert q.shape == (0, 1000) and s.shape == (0, 8)


def test_silu_mul_reads_the_halves_of_one_tensor_in_place():
    """gate and up as the two halves of a gate/up projection's output give the bits of
    the same values in tensors of their own, in either scale layout and through out=."""
    gate_up = (torch.randn(300, 2 * 4096, device="cuda") * 3).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    for layout in ("mn_major", "row_major"):
        q, s = ptxforge.silu_mul_quantize_fp8(gate, up, scale_layout=layout)
        rq, rs = ptxforge.silu_mul_quantize_fp8(gate.contiguous(), up.contiguous(),
                                                scale_layout=layout)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    q = torch.empty(300, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.full((300, 32), float("nan"), device="cuda")
    ptxforge.silu_mul_quantize_fp8(gate, up, out=(q, s))  # row-major scales, as rs's
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_silu_mul_names_the_argument_on_the_wrong_device():
    gate = torch.randn(4, 256, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="^up must be on a CUDA device, got cpu$"):
        ptxforge.silu_mul_quantize_fp8(gate, gate.cpu())
    with pytest.raises(ValueError, match="^gate must be on a CUDA device, got cpu$"):
        ptxforge.silu_mul_quantize_fp8(gate.cpu(), gate)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="^up is on cuda:1 but the input is on cuda:0$"):
            ptxforge.silu_mul_quantize_fp8(gate, gate.to("cuda:1"))


def test_misaligned_input_is_refused():
    x = torch.randn(8, 264, device="cuda").to(torch.bfloat16)[:, 8:]  # 16-byte aligned start
    ptxforge.quantize_fp8_per_token(x)
    bad = torch.randn(8 * 257, device="cuda").to(torch.bfloat16)[1:2049].view(8, 256)
    with pytest.raises(ValueError, match="16-byte aligned"):
        ptxforge.quantize_fp8_per_token(bad)
    with pytest.raises(ValueError, match="unit stride"):
        ptxforge.rms_norm(torch.randn(256, 8, device="cuda").to(torch.bfloat16).t(),
                          torch.ones(8, device="cuda", dtype=torch.bfloat16))


def test_per_block_rows_past_the_grid_are_refused():
    """A 128-row block is one CTA row of the grid: the device's max_grid bounds them."""
    limit = arch.current().max_grid[1] * 128
    w = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16).expand(limit + 1, 8)
    with pytest.raises(ValueError, match=f"w may have at most {limit} rows, got {limit + 1}"):
        ptxforge.quantize_fp8_per_block(w)


def test_cuda_graph_capture_and_replay():
    x = torch.randn(256, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    ptxforge.rms_norm_quantize_fp8(x, w)  # compile and load outside the capture
    ptxforge.rms_norm(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            q, s = ptxforge.rms_norm_quantize_fp8(x, w)
            y = ptxforge.rms_norm(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        rq, rs = ptxforge.rms_norm_quantize_fp8(x, w)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        assert torch.equal(y, ptxforge.rms_norm(x, w))


def test_runs_on_a_side_stream():
    x = torch.randn(512, 2048, device="cuda").to(torch.bfloat16)
    expected = ptxforge.quantize_fp8_per_token(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = ptxforge.quantize_fp8_per_token(x)
    torch.cuda.synchronize()
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))


def test_out_arguments_are_written_and_checked():
    x = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    w = torch.randn(1024, device="cuda").to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    assert ptxforge.rms_norm(x, w, out=y) is y
    assert torch.equal(y, ptxforge.rms_norm(x, w))
    q = torch.empty(64, 1024, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.full((64, 8), float("nan"), device="cuda")
    ptxforge.quantize_fp8_per_token(x, out=(q, s))
    rq, rs = ptxforge.quantize_fp8_per_token(x, scale_layout="row_major")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    with pytest.raises(ValueError, match="overlaps an input"):
        ptxforge.rms_norm(x, w, out=x)
    with pytest.raises(ValueError, match=r"out must have shape \(64, 1024\)"):
        ptxforge.rms_norm(x, w, out=y[:32])
    with pytest.raises(TypeError, match="out\\[1\\] must have dtype torch.float32"):
        ptxforge.quantize_fp8_per_token(x, out=(q, s.to(torch.bfloat16)))


def test_launch_from_another_thread():
    """A new thread may have no CUDA context current: the launch must still land."""
    import threading

    x = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    w = torch.randn(1024, device="cuda").to(torch.bfloat16)
    expected = ptxforge.rms_norm(x, w)
    y = torch.full_like(x, float("nan"))
    errors = []

    def work():
        try:
            ptxforge.rms_norm(x, w, out=y)
            torch.cuda.synchronize()
        except Exception as exc:  # reported below, with the thread's traceback lost
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    assert torch.equal(y, expected)
