"""The MoE grouped FP8 GEMM, contiguous layout, on a real GPU against fp64 references."""

import random

import pytest
import torch

import ptxforge
from ptxforge.bench.ops import grouped_operands
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.testing.checks import calc_diff, relative_error

pytestmark = pytest.mark.gpu


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
    a, b, m_indices, ref = grouped_operands(sizes, n, k)
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
        a, b, m_indices, ref = grouped_operands(sizes, n, k)
        check(run(a, b, m_indices, n), ref, m_indices)


def test_rows_with_bad_indices_are_zeros():
    """Indices outside [0, G) and a segment not aligned to the tile: those rows are written
    as zeros (the documented behaviour), the others are right, nothing is read outside B."""
    a, b, m_indices, ref = grouped_operands([256, 256], 512, 256)
    m_indices[5], m_indices[300] = 7, -9           # out of range
    m_indices[140] = 1                             # a row of group 1 inside group 0's tile
    d = run(a, b, m_indices, 512)
    for row in (5, 300, 140):
        assert torch.equal(d[row], torch.zeros_like(d[row]))
        ref[row] = 0
    assert calc_diff(d, ref) < 1e-3


def test_segments_ending_at_each_side_of_a_warpgroup():
    """Segments ending at each side of a math warpgroup's 64 rows, and a tile whose first 64
    rows are padding while the next 64 are its group's (the tile's group is then index
    -1's, clamped to group 0)."""
    a, b, m_indices, ref = grouped_operands([1, 63, 64, 65, 127, 128, 129, 192, 193], 512, 384)
    check(run(a, b, m_indices, 512), ref, m_indices)
    a, b, m_indices, ref = grouped_operands([128, 100], 512, 384)
    m_indices[:64] = -1
    ref[:64] = 0
    check(run(a, b, m_indices, 512), ref, m_indices)


@pytest.mark.parametrize("used", [0, 128, 384, 640])
def test_rows_used_skips_the_tiles_past_it(used):
    """rows_used (on the GPU; the end of the last segment, a multiple of the alignment):
    its rows are computed as without it, the rows past it never written (they keep the NaN
    poison)."""
    a, b, m_indices, ref = grouped_operands([300, 0, 213, 128], 512, 256)
    d = torch.full((a[0].shape[0], 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    rows_used = torch.tensor([used], dtype=torch.int32, device="cuda")
    ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, rows_used=rows_used)
    if used:
        check(d[:used], ref[:used], m_indices[:used])
    assert torch.isnan(d[used:]).all()


def test_clusters_sharing_b(gpu_arch):
    """share_b: a cluster's two CTAs take neighbouring block rows and share B's loads where
    both rows start in one group. Random group sizes put pairs inside a group, across two
    and past the last block row (an odd count: the second CTA repeats the first's tile and
    must not store it); with rows_used the pairs end where it does; bad indices stay
    zeros. Poisoned outputs, the fp64 reference, the same bits as the unshared config."""
    from ptxforge.kernels import sm90_gemm as gemm

    rng = random.Random(2)
    for n, k, block_n in ((512, 384, 128), (1000, 640, 160), (7168, 256, 192)):
        for _ in range(8):
            sizes = [rng.choice([0, 1, 100, 128, 129, 250, 256, 300])
                     for _ in range(rng.randint(1, 6))] + [rng.choice([1, 129])]
            a, b, m_indices, ref = grouped_operands(sizes, n, k)
            problem = GemmProblem(n, k, "e4m3", "contiguous", len(sizes))
            shared = gemm.make_config(gpu_arch, problem, 128, block_n, 1, 2, 1, share_b=True)
            plain = gemm.make_config(gpu_arch, problem, 128, block_n, 1, 1, 1)
            outputs = []
            for cfg in (shared, plain):
                d = torch.full((a[0].shape[0], n), float("nan"), device="cuda",
                               dtype=torch.bfloat16)
                ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, config=cfg)
                outputs.append(d)
            check(outputs[0], ref, m_indices)
            assert torch.equal(outputs[0], outputs[1]), (sizes, n, k)
    a, b, m_indices, ref = grouped_operands([300, 0, 213, 128], 512, 256)
    m_indices[5], m_indices[300] = 7, -9
    cfg = gemm.make_config(gpu_arch, GemmProblem(512, 256, "e4m3", "contiguous", 4), 128, 128,
                           1, 2, share_b=True)
    for used in (0, 128, 384, 640):
        d = torch.full((a[0].shape[0], 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        rows_used = torch.tensor([used], dtype=torch.int32, device="cuda")
        ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, rows_used=rows_used,
                                                  config=cfg)
        for row in (5, 300):
            if row < used:
                assert torch.equal(d[row], torch.zeros_like(d[row]))
        expected = ref.clone()
        expected[[5, 300]] = 0
        if used:
            check(d[:used], expected[:used], m_indices[:used])
        assert torch.isnan(d[used:]).all()


def test_rejects_bad_arguments():
    a, b, m_indices, _ = grouped_operands([128, 128], 256, 256)
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


def run_masked(a, b, masked_m, expected_m):
    groups, m_max, _ = a[0].shape
    d = torch.full((groups, m_max, b[0].shape[1]), float("nan"), device="cuda",
                   dtype=torch.bfloat16)
    ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m)
    torch.cuda.synchronize()
    return d


def check_masked(d, ref, counts):
    for group, count in enumerate(counts):
        rows = min(max(count, 0), d.shape[1])
        assert not torch.isnan(d[group, :rows]).any(), "valid rows were not written"
        if rows:
            assert calc_diff(d[group, :rows], ref[group, :rows]) < 1e-3
            assert relative_error(d[group, :rows], ref[group, :rows]) <= 2e-3


@pytest.mark.parametrize("counts, m_max, n, k", [([100, 0, 512, 37], 512, 1000, 640),
                                                 ([129], 129, 256, 1024),       # scales copied
                                                 ([1024, 700], 1024, 4096, 7168),
                                                 ([-3, 5000, 64], 200, 512, 256)])  # clamped
def test_masked_matches_fp64_reference(counts, m_max, n, k):
    from ptxforge.bench.ops import masked_operands

    a, b, masked_m, ref = masked_operands(counts, m_max, n, k)
    d = run_masked(a, b, masked_m, max(1, max(counts) // 2))
    check_masked(d, ref, counts)
    again = run_masked(a, b, masked_m, max(1, max(counts) // 2))
    valid = ~torch.isnan(d)
    assert torch.equal(d[valid], again[valid])  # the same bits every run


@pytest.mark.parametrize("tile_rows", [8, 16, 32])
def test_masked_few_token_tiles(gpu_arch, tile_rows):
    """Masked decode: tiles covering 8, 16 or 32 of a group's rows, counts around the tile
    edges (and a group with none), against fp64; the model's choice for 8 tokens a group
    is such a tile."""
    from ptxforge.kernels import sm90_gemm as gemm
    from ptxforge.bench.ops import masked_operands

    counts = [1, tile_rows - 1, tile_rows, tile_rows + 1, 0, 3 * tile_rows + 2]
    a, b, masked_m, ref = masked_operands(counts, 4 * tile_rows, 1000, 640)
    cfg = gemm.make_config(gpu_arch, GemmProblem(1000, 640, "e4m3", "masked", len(counts)), 64,
                           24, tile_rows=tile_rows)
    d = torch.full((len(counts), 4 * tile_rows, 1000), float("nan"), device="cuda",
                   dtype=torch.bfloat16)
    ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, tile_rows, config=cfg)
    torch.cuda.synchronize()
    check_masked(d, ref, counts)
    masked = GemmProblem(4096, 7168, "e4m3", "masked", 8)
    assert gemm.choose_config(gpu_arch, masked, 8 * 8).tile_rows == 8


def test_masked_graph_replays_new_counts():
    """Captured once; masked_m changes on the GPU between replays: each replay's valid rows
    are those of a call over every row."""
    from ptxforge.bench.ops import masked_operands

    a, b, masked_m, _ = masked_operands([64, 64, 64], 256, 512, 512)
    full = torch.empty(3, 256, 512, device="cuda", dtype=torch.bfloat16)
    ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, full, torch.full_like(masked_m, 256), 64)
    d = torch.empty_like(full)
    ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, 64)  # built before the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, 64)
    for counts in ([256, 0, 17], [1, 255, 128], [0, 0, 0], [300, 256, 256]):
        masked_m.copy_(torch.tensor(counts, dtype=torch.int32))
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for group, count in enumerate(counts):
            rows = min(count, 256)
            assert torch.equal(d[group, :rows], full[group, :rows])


def test_masked_rejects_bad_arguments():
    from ptxforge.bench.ops import masked_operands

    a, b, masked_m, _ = masked_operands([64, 64], 128, 256, 256)
    d = torch.empty(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share G"):
        ptxforge.m_grouped_fp8_gemm_nt_masked(a, (b[0][:1], b[1][:1]), d, masked_m, 64)
    with pytest.raises(ValueError, match="one entry per group"):
        ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m[:1], 64)
    with pytest.raises(ValueError, match="expected_m"):
        ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, 0)
    with pytest.raises(ValueError, match="d must have shape"):
        ptxforge.m_grouped_fp8_gemm_nt_masked(a, b, d[:, :64], masked_m, 64)


def test_bf16_contiguous_and_masked():
    """The grouped BF16 GEMMs: the same layouts and contracts without scales."""
    torch.manual_seed(0)
    sizes, n, k = [300, 0, 129], 512, 384
    align = ptxforge.get_mk_alignment_for_contiguous_layout()
    rows = []
    for group, size in enumerate(sizes):
        rows += [group] * size + [-1] * (-(-size // align) * align - size)
    m_indices = torch.tensor(rows, dtype=torch.int32, device="cuda")
    a = torch.randn(len(rows), k, device="cuda").to(torch.bfloat16)
    b = torch.randn(len(sizes), n, k, device="cuda").to(torch.bfloat16)
    ref = torch.zeros(len(rows), n, dtype=torch.float64, device="cuda")
    for group in range(len(sizes)):
        mine = m_indices == group
        ref[mine] = a[mine].double() @ b[group].double().t()
    d = torch.full((len(rows), n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)
    check(d, ref, m_indices)

    counts, m_max = [100, 0, 256], 256
    a = torch.randn(3, m_max, k, device="cuda").to(torch.bfloat16)
    masked_m = torch.tensor(counts, dtype=torch.int32, device="cuda")
    d = torch.full((3, m_max, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, 128)
    ref = torch.stack([a[g].double() @ b[g].double().t() for g in range(3)])
    check_masked(d, ref, counts)
