"""The BF16 GEMM (the FP8 GEMM's kernel with bf16 operands) against fp64 on a real GPU."""

import pytest
import torch

import ptxforge
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.testing.checks import calc_diff, relative_error

pytestmark = pytest.mark.gpu


def operands(m, n, k):
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    return a, b, a.double() @ b.double().t()


@pytest.mark.parametrize("m, n, k", [(1, 128, 64), (200, 1000, 640), (129, 136, 576),
                                     (4096, 7168, 2048), (64, 2112, 7168)])
def test_matches_fp64_reference(m, n, k):
    a, b, ref = operands(m, n, k)
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.bf16_gemm_nt(a, b, d)
    assert not torch.isnan(d).any()
    assert calc_diff(d, ref) < 1e-3 and relative_error(d, ref) <= 2e-3
    again = torch.empty_like(d)
    ptxforge.bf16_gemm_nt(a, b, again)
    assert torch.equal(d, again)


def test_accumulates_into_c():
    a, b, ref = operands(300, 512, 1024)
    c = torch.randn(300, 512, device="cuda")
    expected = c.double() + ref
    ptxforge.bf16_gemm_nt(a, b, c, c=c)
    assert calc_diff(c, expected) < 1e-3 and relative_error(c, expected) <= 2e-3


def test_every_tile_width(gpu_arch):
    from ptxforge.kernels import sm90_gemm as gemm

    a, b, ref = operands(200, 1000, 640)
    failures = []
    # (block_m, block_n, multicast, CTAs an SM, producer warps): K = 640 is 10 K blocks.
    for block_m, block_n, multicast, ctas, warps in [
            (64, 16, 1, 1, 2), (64, 24, 1, 1, 2), (128, 128, 1, 1, 2), (128, 256, 1, 1, 2),
            (128, 160, 1, 1, 2), (128, 128, 2, 1, 2), (64, 16, 1, 1, 4), (64, 24, 1, 1, 1),
            (64, 32, 1, 2, 2), (128, 192, 1, 1, 4), (128, 176, 1, 1, 2), (128, 240, 1, 1, 2)]:
        try:
            cfg = gemm.make_config(gpu_arch, GemmProblem(1000, 640, "bf16"), block_m, block_n,
                                   ctas, multicast, producers=warps)
        except ValueError:
            continue
        d = torch.full((200, 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
        ptxforge.bf16_gemm_nt(a, b, d, config=cfg)
        if torch.isnan(d).any() or not calc_diff(d, ref) < 1e-3:
            failures.append((cfg.name, calc_diff(d, ref)))
    assert not failures, failures


def test_rejects_bad_arguments():
    a, b, _ = operands(128, 256, 256)
    d = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="a must have dtype torch.bfloat16"):
        ptxforge.bf16_gemm_nt(a.float(), b, d)
    with pytest.raises(ValueError, match="share K"):
        ptxforge.bf16_gemm_nt(a, b[:, :128], d)
    with pytest.raises(ValueError, match="d must have shape"):
        ptxforge.bf16_gemm_nt(a, b, d[:64])
