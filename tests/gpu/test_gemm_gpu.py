"""The FP8 GEMM on a real GPU against an fp64 reference of the dequantized operands."""

import pytest
import torch

import ptxforge
from ptxforge.checks import calc_diff, fp8_gemm_operands, relative_error

pytestmark = pytest.mark.gpu


def run(m, n, k):
    a, b, ref = fp8_gemm_operands(m, n, k)
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt(a, b, d)
    torch.cuda.synchronize()
    return d, ref, a, b


SHAPES = [(128, 128, 128), (128, 256, 512), (256, 128, 1024), (64, 2112, 7168), (129, 136, 576),
          (1, 128, 256), (300, 1544, 1040), (4096, 7168, 2048)]


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_matches_fp64_reference(m, n, k):
    d, ref, _, _ = run(m, n, k)
    assert not torch.isnan(d).any(), "some outputs were never written"
    assert calc_diff(d, ref) < 1e-3
    assert relative_error(d, ref) <= 2e-3


def test_bitwise_repeatable():
    d, _, a, b = run(256, 512, 1024)
    again = torch.empty_like(d)
    ptxforge.fp8_gemm_nt(a, b, again)
    assert torch.equal(d, again)


def test_rejects_mismatched_k():
    a, b, _ = fp8_gemm_operands(128, 128, 256)
    d = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share K"):
        ptxforge.fp8_gemm_nt(a, (b[0][:, :128], b[1][:, :1]), d)


def test_deep_gemm_names_and_set_num_sms():
    import ptxforge.deep_gemm as deep_gemm

    a, b, ref = fp8_gemm_operands(256, 512, 1024)
    d = torch.empty(256, 512, device="cuda", dtype=torch.bfloat16)
    full = deep_gemm.get_num_sms()
    try:
        deep_gemm.set_num_sms(7)
        assert deep_gemm.get_num_sms() == 7
        deep_gemm.fp8_gemm_nt(a, b, d)  # fewer persistent CTAs: the same result
    finally:
        deep_gemm.set_num_sms(full)
    assert calc_diff(d, ref) < 1e-3
    assert deep_gemm.get_tma_aligned_size(5, 4) == 8 and deep_gemm.ceil_div(7, 2) == 4
    with pytest.raises(ValueError, match="num_sms"):
        deep_gemm.set_num_sms(0)


def test_row_major_scales_are_converted():
    a, b, ref = fp8_gemm_operands(200, 256, 384)
    d = torch.empty(200, 256, device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt((a[0], a[1].contiguous()), b, d)
    assert calc_diff(d, ref) < 1e-3


def test_output_aliasing_an_input_is_refused():
    a, b, _ = fp8_gemm_operands(128, 128, 256)
    alias = a[0].view(torch.bfloat16)  # a bf16 [128, 128] over A's bytes
    with pytest.raises(ValueError, match="overlaps an input"):
        ptxforge.fp8_gemm_nt(a, b, alias)


def test_nan_in_an_operand_propagates():
    a, b, _ = fp8_gemm_operands(128, 256, 512)
    qa = a[0].clone()
    qa.view(torch.uint8)[5, 7] = 0x7F  # an e4m3 NaN in row 5
    d = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt((qa, a[1]), b, d)
    assert torch.isnan(d[5]).all() and not torch.isnan(d[:5]).any() and not torch.isnan(d[6:]).any()


def test_random_shapes():
    """200 random (M, N, K): M in [1, 8192], N and K random multiples of 16 up to 8192
    (many not multiples of 128), each against its fp64 reference with a poisoned output."""
    gen = torch.Generator().manual_seed(2026)
    failures = []
    for _ in range(200):
        m = int(torch.randint(1, 8193, (1,), generator=gen))
        n, k = (16 * int(torch.randint(1, 513, (1,), generator=gen)) for _ in range(2))
        d, ref, _, _ = run(m, n, k)
        diff = calc_diff(d, ref)
        rel = relative_error(d, ref)
        if torch.isnan(d).any() or not diff < 1e-3 or not rel <= 2e-3:
            failures.append((m, n, k, diff, rel))
        del d, ref
    assert not failures, failures


def test_every_tile_shape(monkeypatch, request):
    """Each tile shape the heuristic may pick (straddling B-scale rows, every store-box
    width), forced on shapes whose edges cut the tiles, against the fp64 reference."""
    from ptxforge.kernels import sm90_fp8_gemm_1d2d as gemm
    from ptxforge.ops import _common
    from ptxforge.ops import gemm as gemm_ops

    arch = _common.device_arch(torch.cuda.current_device())
    request.addfinalizer(gemm_ops._plan.cache_clear)  # no forced plan outlives the test
    failures = []
    shapes = [(bm, bn, 1) for bm in (64, 128) for bn in gemm.block_n_candidates(arch)]
    shapes += [(128, bn, 2) for bn in (64, 128, 144, 160)]  # 2-CTA clusters sharing A
    for block_m, block_n, multicast in shapes:
        try:
            cfg = gemm.make_config(arch, 1000, 640, block_m, block_n, multicast=multicast)
        except ValueError:
            continue  # does not fit the registers, or an odd tile count for multicast
        monkeypatch.setattr(gemm_ops, "_config", lambda *args, cfg=cfg: cfg)
        gemm_ops._plan.cache_clear()  # plans hold the config they were made with
        for m in (1, 200, 700):
            d, ref, _, _ = run(m, 1000, 640)
            diff = calc_diff(d, ref)
            if torch.isnan(d).any() or not diff < 1e-3 or not relative_error(d, ref) <= 2e-3:
                failures.append((block_m, block_n, multicast, m, diff))
    assert not failures, failures
