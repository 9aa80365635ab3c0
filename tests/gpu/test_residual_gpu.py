"""The residual-add epilogue on a real GPU: d = a @ b.T (+ bias) + residual for the FP8 and
BF16 dense GEMMs against fp64, d poisoned with NaN: the decode shapes at 1 to 4096 rows,
with and without the bias, in place (the residual is d), a strided residual, every tile
class, and the arguments it refuses."""

import pytest
import torch

import ptxforge
from ptxforge import kernels
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.testing.checks import (bf16_gemm_operands, calc_diff, fp8_gemm_operands,
                                     relative_error)

pytestmark = pytest.mark.gpu

GEMMS = {"fp8": (fp8_gemm_operands, ptxforge.fp8_gemm_nt, "e4m3"),
         "bf16": (bf16_gemm_operands, ptxforge.bf16_gemm_nt, "bf16")}  # + make_config's dtype


def residual_like(ref: torch.Tensor) -> torch.Tensor:
    """A bf16 residual as large as the product, so that a lost or doubled residual shows."""
    return (torch.randn(ref.shape, device="cuda") * ref.std().clamp_min(1)).to(torch.bfloat16)


def poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)


def failure(d: torch.Tensor, expected: torch.Tensor):
    """None where d is fully written and matches ``expected`` as the bias tests ask, else
    what was wrong."""
    if torch.isnan(d).any():
        return "unwritten or NaN outputs"
    diff, rel = calc_diff(d, expected), relative_error(d, expected)
    return None if diff < 1e-3 and rel <= 2e-3 else (diff, rel)


@pytest.mark.parametrize("n, k", kernels.GEMM_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64, 300, 4096])
@pytest.mark.parametrize("dtype", list(GEMMS))
def test_adds_the_residual(dtype, m, n, k):
    """d = a @ b.T + residual and d = a @ b.T + bias + residual against fp64 at the decode
    shapes (the few-token tiles at 1 and 7 rows, 64- and 128-row tiles, multicast at
    4096); the same bits every run."""
    operands, gemm, _ = GEMMS[dtype]
    a, b, ref = operands(m, n, k)
    residual = residual_like(ref)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 4
    failures = []
    for with_bias in (False, True):
        extra = {"bias": bias} if with_bias else {}
        expected = ref + residual.double() + (bias.double() if with_bias else 0)
        d = poisoned(m, n)
        gemm(a, b, d, residual=residual, **extra)
        torch.cuda.synchronize()
        wrong = failure(d, expected)
        if wrong:
            failures.append((with_bias, wrong))
        again = poisoned(m, n)
        gemm(a, b, again, residual=residual, **extra)
        if not torch.equal(d, again):
            failures.append((with_bias, "not repeatable"))
    assert not failures, failures


@pytest.mark.parametrize("dtype", list(GEMMS))
@pytest.mark.parametrize("m, n, k", [(1, 2112, 7168), (7, 4096, 7168), (300, 7168, 2048),
                                     (4096, 7168, 2048), (200, 1000, 640)])
def test_the_residual_may_be_d_itself(dtype, m, n, k):
    """residual=d: d += a @ b.T in place (each element read by the thread that writes it,
    before the tile's store), the same bits as from a separate copy of the residual, with
    and without the bias."""
    operands, gemm, _ = GEMMS[dtype]
    a, b, ref = operands(m, n, k)
    residual = residual_like(ref)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for extra in ({}, {"bias": bias}):
        separate = poisoned(m, n)
        gemm(a, b, separate, residual=residual, **extra)
        in_place = residual.clone()
        gemm(a, b, in_place, residual=in_place, **extra)
        torch.cuda.synchronize()
        expected = ref + residual.double() + (bias.double() if extra else 0)
        assert failure(in_place, expected) is None, (extra.keys(), failure(in_place, expected))
        assert torch.equal(in_place, separate)


@pytest.mark.parametrize("dtype", list(GEMMS))
@pytest.mark.parametrize("m", [1, 300])
def test_a_strided_residual(dtype, m):
    """A column slice of a wider matrix (row strides of 2004 bytes, a multiple of 4 but not
    of 16, and 2128; starting 4 and 64 bytes into it): the same bits as its contiguous
    copy."""
    operands, gemm, _ = GEMMS[dtype]
    n, k = 1000, 640
    a, b, ref = operands(m, n, k)
    for extra_columns, first in ((2, 2), (64, 32)):
        wide = torch.randn(m, n + extra_columns, device="cuda").to(torch.bfloat16)
        residual = wide[:, first:first + n]
        assert residual.stride() == (n + extra_columns, 1)
        d = poisoned(m, n)
        gemm(a, b, d, residual=residual)
        contiguous = poisoned(m, n)
        gemm(a, b, contiguous, residual=residual.contiguous())
        torch.cuda.synchronize()
        assert failure(d, ref + residual.double()) is None
        assert torch.equal(d, contiguous)


def test_every_tile_class_adds_the_residual(gpu_arch):
    """Each 8-column group and both rows of a thread read their own pair: tile widths that
    straddle scale rows, one and two math warpgroups, two CTAs an SM, multicast, and the
    few-token tiles at M around their edges (rows past M or the tile not read), fp8 and
    bf16, with the bias and in place."""
    from ptxforge.kernels import sm90_gemm as gemm

    n, k = 1000, 640
    failures = []
    tiles = [(64, 16, {}), (64, 24, {}), (128, 56, {}), (128, 128, {}), (64, 160, {}),
             (128, 160, {}), (64, 32, {"ctas_per_sm": 2})]
    for dtype, (_, _, config_dtype) in GEMMS.items():
        for block_m, block_n, options in tiles:
            problem = GemmProblem(n, k, config_dtype, epilogue=("residual",))
            cfg = gemm.make_config(gpu_arch, problem, block_m, block_n, **options)
            for m in (1, 200, 700):
                failures += _forced(dtype, cfg, m, n, k)
        for tile_rows in (8, 16, 32):
            problem = GemmProblem(n, k, config_dtype, epilogue=("residual",))
            cfg = gemm.make_config(gpu_arch, problem, 64, 24, tile_rows=tile_rows)
            for m in (1, tile_rows - 1, tile_rows, tile_rows + 1, 3 * tile_rows + 5):
                failures += _forced(dtype, cfg, m, n, k)
    cfg = gemm.make_config(gpu_arch, GemmProblem(1024, 512, epilogue=("bias", "residual")), 128,
                           128, multicast=2)
    failures += _forced("fp8", cfg, 1000, 1024, 512, bias=True)
    assert not failures, failures


def _forced(dtype, cfg, m, n, k, bias=False):
    """Failures of one forced config: a separate residual and d itself."""
    operands, gemm, _ = GEMMS[dtype]
    a, b, ref = operands(m, n, k)
    residual = residual_like(ref)
    extra = {"bias": torch.randn(n, device="cuda", dtype=torch.bfloat16)} if bias else {}
    expected = ref + residual.double() + (extra["bias"].double() if bias else 0)
    d = poisoned(m, n)
    gemm(a, b, d, residual=residual, config=cfg, **extra)
    in_place = residual.clone()
    gemm(a, b, in_place, residual=in_place, config=cfg, **extra)
    torch.cuda.synchronize()
    found = []
    for name, out in (("separate", d), ("in place", in_place)):
        wrong = failure(out, expected)
        if wrong:
            found.append((cfg.name, m, name, wrong))
    return found


def test_rejects_bad_residual():
    a, b, _ = fp8_gemm_operands(128, 256, 256)
    d = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="residual must have dtype torch.bfloat16"):
        ptxforge.fp8_gemm_nt(a, b, d, residual=torch.zeros(128, 256, device="cuda"))
    with pytest.raises(ValueError, match=r"residual must have shape \(128, 256\), got \(64, 256\)"):
        ptxforge.fp8_gemm_nt(a, b, d, residual=torch.zeros(64, 256, device="cuda",
                                                           dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual must be on a CUDA device, got cpu"):
        ptxforge.fp8_gemm_nt(a, b, d, residual=torch.zeros(128, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual is added to a bf16 d"):
        c = torch.zeros(128, 256, device="cuda")
        ptxforge.fp8_gemm_nt(a, b, c, c=c, residual=torch.zeros(128, 256, device="cuda",
                                                               dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="overlaps"):  # d and a residual a row after it
        flat = torch.zeros(129 * 256, device="cuda", dtype=torch.bfloat16)
        ptxforge.fp8_gemm_nt(a, b, flat[:128 * 256].view(128, 256),
                             residual=flat[256:].view(128, 256))
    with pytest.raises(ValueError, match="residual's row stride must be a multiple of 4 bytes"):
        odd = torch.zeros(128, 257, device="cuda", dtype=torch.bfloat16)
        ptxforge.fp8_gemm_nt(a, b, d, residual=odd[:, :256])
