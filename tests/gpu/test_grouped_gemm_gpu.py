"""The MoE grouped FP8 GEMM, contiguous layout, on a real GPU against fp64 references."""

import random

import pytest
import torch

import ptxforge
from ptxforge import ops, reference
from ptxforge.checks import calc_diff, relative_error

pytestmark = pytest.mark.gpu


def grouped_operands(sizes, n, k, rng):
    """Each group's rows (random count, padded with -1 rows to the alignment), quantized as
    DeepGEMM's recipe does, and the fp64 reference: padding rows are zeros."""
    align = ptxforge.get_mk_alignment_for_contiguous_layout()
    m_indices = []
    for group, size in enumerate(sizes):
        padded = -(-size // align) * align
        m_indices += [group] * size + [-1] * (padded - size)
    m = len(m_indices)
    m_indices = torch.tensor(m_indices, dtype=torch.int32, device="cuda")
    qa, sa = ops.quantize_fp8_per_token(torch.randn(m, k, device="cuda").to(torch.bfloat16))
    weights = [ops.quantize_fp8_per_block(torch.randn(n, k, device="cuda").to(torch.bfloat16))
               for _ in sizes]
    qb = torch.stack([w[0] for w in weights])
    sb = torch.stack([w[1] for w in weights])
    a = reference.dequantize_per_token(qa, sa).double()
    ref = torch.zeros(m, n, dtype=torch.float64, device="cuda")
    for group, (wq, ws) in enumerate(weights):
        rows = m_indices == group
        ref[rows] = a[rows] @ reference.dequantize_per_block(wq, ws).double().t()
    return (qa, sa), (qb, sb), m_indices, ref


def run(a, b, m_indices, n):
    d = torch.full((a[0].shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)
    torch.cuda.synchronize()
    return d


def check(d, ref, m_indices):
    padding = m_indices < 0
    assert not torch.isnan(d).any(), "some outputs were never written"
    assert torch.equal(d[padding], torch.zeros_like(d[padding])), "padding rows must be zeros"
    assert calc_diff(d, ref) < 1e-3 and relative_error(d, ref) <= 2e-3


@pytest.mark.parametrize("sizes, n, k", [([300, 0, 513, 128], 1000, 640),   # an empty group
                                         ([2000], 1032, 1024),              # one group: every row
                                         ([1, 1, 1, 1, 1, 1, 1, 1], 256, 128),
                                         ([4096] * 4, 4096, 7168)])
def test_matches_fp64_reference(sizes, n, k):
    a, b, m_indices, ref = grouped_operands(sizes, n, k, random.Random(0))
    d = run(a, b, m_indices, n)
    check(d, ref, m_indices)
    assert torch.equal(d, run(a, b, m_indices, n))  # the same bits every run


def test_random_group_sizes():
    """100 draws of 1-8 groups with 0.7-1.3x an expected size (0 included)."""
    rng = random.Random(1)
    for _ in range(100):
        expected = rng.choice([64, 200, 700])
        sizes = [int(expected * rng.uniform(0.7, 1.3)) * (rng.random() > 0.1)
                 for _ in range(rng.randint(1, 8))]
        n, k = rng.choice([(512, 384), (1000, 640), (256, 1024)])
        a, b, m_indices, ref = grouped_operands(sizes, n, k, rng)
        check(run(a, b, m_indices, n), ref, m_indices)


def test_rows_with_bad_indices_are_zeros():
    """Indices outside [0, G) and a segment not aligned to the tile: those rows are written
    as zeros (the documented behaviour), the others are right, nothing is read outside B."""
    a, b, m_indices, ref = grouped_operands([256, 256], 512, 256, random.Random(2))
    m_indices[5], m_indices[300] = 7, -9           # out of range
    m_indices[140] = 1                             # a row of group 1 inside group 0's tile
    d = run(a, b, m_indices, 512)
    for row in (5, 300, 140):
        assert torch.equal(d[row], torch.zeros_like(d[row]))
        ref[row] = 0
    assert calc_diff(d, ref) < 1e-3


def test_rejects_bad_arguments():
    a, b, m_indices, _ = grouped_operands([128, 128], 256, 256, random.Random(3))
    d = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="b\\[0\\] must have 3 dimensions"):
        ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, (b[0][0], b[1][0]), d, m_indices)
    with pytest.raises(ValueError, match="b\\[1\\] must have shape"):
        ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, (b[0], b[1][:1]), d, m_indices)
    with pytest.raises(TypeError, match="m_indices must have dtype torch.int32"):
        ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices.long())
    with pytest.raises(ValueError, match="one entry per row"):
        ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices[:128])
    with pytest.raises(ValueError, match="share K"):
        ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, (b[0][:, :, :128], b[1]), d, m_indices)
