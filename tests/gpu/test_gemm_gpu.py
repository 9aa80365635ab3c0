"""The FP8 GEMM on a real GPU against an fp64 reference of the dequantized operands."""

import pytest
import torch

import ptxforge
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.testing.checks import calc_diff, fp8_gemm_operands, relative_error

pytestmark = pytest.mark.gpu


def run(m, n, k, config=None):
    a, b, ref = fp8_gemm_operands(m, n, k)
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt(a, b, d, config=config)
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


def test_num_sms_per_call():
    """A call on fewer SMs (the rest left to other work) gives the same bits; the count is
    checked."""
    d, _, a, b = run(1024, 2112, 1024)
    for num_sms in (1, 20, 131):
        again = torch.full_like(d, float("nan"))
        ptxforge.fp8_gemm_nt(a, b, again, num_sms=num_sms)
        assert torch.equal(d, again), num_sms
    for wrong in (0, 10_000, 2.5):
        with pytest.raises(ValueError, match="num_sms must be an int in"):
            ptxforge.fp8_gemm_nt(a, b, d, num_sms=wrong)


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


def test_every_tile_shape(gpu_arch):
    """Each tile shape the heuristic may pick (straddling B-scale rows, every store-box
    width), forced on shapes whose edges cut the tiles, against the fp64 reference."""
    from ptxforge.kernels import sm90_gemm as gemm

    arch = gpu_arch
    failures = []
    # (block_m, block_n, multicast, CTAs an SM, producer warps); K = 640 is 5 K blocks, so
    # the producer warps' turns carry over from one tile to the next.
    shapes = [(bm, bn, 1, 1, 2) for bm in (64, 128) for bn in gemm.block_n_candidates(arch)]
    shapes += [(128, bn, 2, 1, 2) for bn in (64, 128, 144, 160)]  # 2-CTA clusters sharing A
    shapes += [(64, bn, 1, 1, warps) for bn in (16, 64) for warps in (1, 4)]
    shapes += [(64, 32, 1, 2, 2), (64, 128, 1, 2, 4), (128, 128, 2, 1, 4)]
    for block_m, block_n, multicast, ctas, warps in shapes:
        try:
            cfg = gemm.make_config(arch, GemmProblem(1000, 640), block_m, block_n, ctas,
                                   multicast, producers=warps)
        except ValueError:
            continue  # does not fit the registers, or an odd tile count for multicast
        for m in (1, 200, 700):
            d, ref, _, _ = run(m, 1000, 640, config=cfg)
            diff = calc_diff(d, ref)
            if torch.isnan(d).any() or not diff < 1e-3 or not relative_error(d, ref) <= 2e-3:
                failures.append((cfg.name, m, diff))
    assert not failures, failures


def test_clusters_sharing_b(gpu_arch):
    """share_b on a dense GEMM: the cluster's CTAs on neighbouring block rows, each loading
    half of B into both; odd block-row counts (1, 3, 7) leave the second CTA repeating the
    first's tile, which it must not store."""
    from ptxforge.kernels import sm90_gemm as gemm

    failures = []
    for block_n in (64, 128, 144, 160):
        for parts in (1, 2):
            try:
                cfg = gemm.make_config(gpu_arch, GemmProblem(1000, 640), 128, block_n, 1, 2,
                                       parts, share_b=True)
            except ValueError:
                continue  # does not fit the registers
            for m in (1, 200, 300, 700, 900):
                d, ref, _, _ = run(m, 1000, 640, config=cfg)
                diff = calc_diff(d, ref)
                if torch.isnan(d).any() or not diff < 1e-3 or not relative_error(d, ref) <= 2e-3:
                    failures.append((cfg.name, m, diff))
    assert not failures, failures


@pytest.mark.parametrize("m, n, k", [(1, 128, 256), (200, 1000, 640), (4096, 7168, 2048)])
def test_accumulates_into_c(m, n, k):
    """d = c + a @ b.T into an f32 d: in place (c is d) and from a separate c; the same
    bits every run; NaN in c comes through."""
    a, b, ref = fp8_gemm_operands(m, n, k)
    c = torch.randn(m, n, device="cuda", dtype=torch.float32)
    expected = c.double() + ref
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32)
    ptxforge.fp8_gemm_nt(a, b, d, c=c)
    in_place = c.clone()
    ptxforge.fp8_gemm_nt(a, b, in_place, c=in_place)
    torch.cuda.synchronize()
    assert calc_diff(d, expected) < 1e-3 and relative_error(d, expected) <= 2e-3
    assert torch.equal(d, in_place)
    again = torch.empty_like(d)
    ptxforge.fp8_gemm_nt(a, b, again, c=c)
    assert torch.equal(d, again)
    c[0, 0] = float("nan")
    ptxforge.fp8_gemm_nt(a, b, d, c=c)
    assert torch.isnan(d[0, 0]) and not torch.isnan(d[1:]).any()


def test_rejects_bad_accumulation_arguments():
    a, b, _ = fp8_gemm_operands(128, 256, 256)
    c = torch.zeros(128, 256, device="cuda", dtype=torch.float32)
    with pytest.raises(TypeError, match="d must have dtype torch.float32"):
        ptxforge.fp8_gemm_nt(a, b, torch.empty(128, 256, device="cuda", dtype=torch.bfloat16), c=c)
    with pytest.raises(TypeError, match="c must have dtype torch.float32"):
        ptxforge.fp8_gemm_nt(a, b, c, c=c.to(torch.bfloat16))
    with pytest.raises(ValueError, match="c must have shape"):
        ptxforge.fp8_gemm_nt(a, b, c, c=c[:64])
    with pytest.raises(ValueError, match="overlaps"):  # c partly overlapping d
        big = torch.zeros(129 * 256, device="cuda", dtype=torch.float32)
        ptxforge.fp8_gemm_nt(a, b, big[:128 * 256].view(128, 256), c=big[256:].view(128, 256))


def test_accumulates_with_every_store_box(gpu_arch):
    """The f32 epilogue's boxes of 128-, 64- and 32-byte rows (tile widths 32k, 16k, 8k)."""
    from ptxforge.kernels import sm90_gemm as gemm

    failures = []
    for block_m, block_n in [(64, 16), (64, 24), (64, 32), (128, 56), (128, 128), (128, 160)]:
        cfg = gemm.make_config(gpu_arch, GemmProblem(1000, 640, epilogue=("accumulate",)),
                               block_m, block_n)
        a, b, ref = fp8_gemm_operands(200, 1000, 640)
        c = torch.randn(200, 1000, device="cuda", dtype=torch.float32)
        d = torch.full_like(c, float("nan"))
        ptxforge.fp8_gemm_nt(a, b, d, c=c, config=cfg)
        expected = c.double() + ref
        if not (calc_diff(d, expected) < 1e-3 and relative_error(d, expected) <= 2e-3):
            failures.append((block_m, block_n, calc_diff(d, expected)))
    assert not failures, failures


def test_cuda_graph_capture_allocates_nothing():
    """A cached call allocates no device memory and needs no host synchronization: it is
    captured in a CUDA graph and each replay computes the current inputs' product."""
    (qa, sa), (qb, sb), _ = fp8_gemm_operands(256, 512, 1024)
    d = torch.empty(256, 512, device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt((qa, sa), (qb, sb), d)  # build and load the kernel first
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    ptxforge.fp8_gemm_nt((qa, sa), (qb, sb), d)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ptxforge.fp8_gemm_nt((qa, sa), (qb, sb), d)
    for _ in range(2):  # new inputs into the captured buffers, then replay
        (na, nsa), (nb, nsb), ref = fp8_gemm_operands(256, 512, 1024)
        for dst, src in ((qa, na), (sa, nsa), (qb, nb), (sb, nsb)):
            dst.copy_(src)
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert calc_diff(d, ref) < 1e-3


@pytest.mark.parametrize("m, n, k", [(1, 128, 256), (200, 1000, 640), (129, 136, 576),
                                     (4096, 7168, 2048)])
def test_adds_the_bias(m, n, k):
    """d = a @ b.T + bias, the bias fused into the epilogue, against fp64; the same bits
    every run; no column past N is read (N not a multiple of the tile width)."""
    a, b, ref = fp8_gemm_operands(m, n, k)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 4
    expected = ref + bias.double()
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt(a, b, d, bias=bias)
    torch.cuda.synchronize()
    assert not torch.isnan(d).any(), "some outputs were never written"
    assert calc_diff(d, expected) < 1e-3 and relative_error(d, expected) <= 2e-3
    again = torch.empty_like(d)
    ptxforge.fp8_gemm_nt(a, b, again, bias=bias)
    assert torch.equal(d, again)
    without = torch.empty_like(d)
    ptxforge.fp8_gemm_nt(a, b, without)
    assert relative_error(without, ref) <= 2e-3 and not torch.equal(d, without)


def test_adds_the_bias_with_every_tile_width(gpu_arch):
    """Each 8-column group reads its own bias pair: tile widths that straddle scale rows,
    one and two math warpgroups, and the bf16 GEMM."""
    from ptxforge.kernels import sm90_gemm as gemm

    failures = []
    for block_m, block_n in [(64, 16), (64, 24), (128, 56), (128, 128), (64, 160), (128, 160)]:
        cfg = gemm.make_config(gpu_arch, GemmProblem(1000, 640, epilogue=("bias",)), block_m,
                               block_n)
        a, b, ref = fp8_gemm_operands(200, 1000, 640)
        bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
        d = torch.full((200, 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
        ptxforge.fp8_gemm_nt(a, b, d, bias=bias, config=cfg)
        expected = ref + bias.double()
        if not (calc_diff(d, expected) < 1e-3 and relative_error(d, expected) <= 2e-3):
            failures.append((block_m, block_n, calc_diff(d, expected)))
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    d = torch.full((300, 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.bf16_gemm_nt(x, w, d, bias=bias)
    expected = x.double() @ w.double().T + bias.double()
    if not (calc_diff(d, expected) < 1e-3 and relative_error(d, expected) <= 2e-3):
        failures.append(("bf16", calc_diff(d, expected)))
    assert not failures, failures


def test_rejects_bad_bias():
    a, b, _ = fp8_gemm_operands(128, 256, 256)
    d = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bias must have dtype torch.bfloat16"):
        ptxforge.fp8_gemm_nt(a, b, d, bias=torch.zeros(256, device="cuda"))
    with pytest.raises(ValueError, match=r"bias must have shape \(256,\), got \(128,\)"):
        ptxforge.fp8_gemm_nt(a, b, d, bias=torch.zeros(128, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias is added to a bf16 d"):
        c = torch.zeros(128, 256, device="cuda")
        ptxforge.fp8_gemm_nt(a, b, c, c=c, bias=torch.zeros(256, device="cuda",
                                                           dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="overlaps"):
        ptxforge.fp8_gemm_nt(a, b, d, bias=d[0])


def test_few_token_tiles(gpu_arch):
    """Tiles covering 8, 16 or 32 rows of a 64-row wgmma (the rows past them read what
    follows the stage and are never stored): every M around the tile's edges, fp8 and bf16,
    against fp64, NaN-poisoned outputs fully written."""
    from ptxforge.kernels import sm90_gemm as gemm

    failures = []
    for tile_rows in (8, 16, 32):
        for m in (1, tile_rows - 1, tile_rows, tile_rows + 1, 3 * tile_rows + 5):
            a, b, ref = fp8_gemm_operands(m, 1000, 640)
            cfg = gemm.make_config(gpu_arch, GemmProblem(1000, 640), 64, 24, tile_rows=tile_rows)
            d = torch.full((m, 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
            ptxforge.fp8_gemm_nt(a, b, d, config=cfg)
            if torch.isnan(d).any() or not relative_error(d, ref) <= 2e-3:
                failures.append(("e4m3", tile_rows, m, relative_error(d, ref)))
            x = torch.randn(m, 640, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(1000, 640, device="cuda", dtype=torch.bfloat16)
            cfg = gemm.make_config(gpu_arch, GemmProblem(1000, 640, "bf16"), 64, 32,
                                   tile_rows=tile_rows)
            d = torch.full((m, 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
            ptxforge.bf16_gemm_nt(x, w, d, config=cfg)
            expected = x.double() @ w.double().T
            if torch.isnan(d).any() or not relative_error(d, expected) <= 2e-3:
                failures.append(("bf16", tile_rows, m, relative_error(d, expected)))
    assert not failures, failures


@pytest.mark.parametrize("m, n, k", [(1, 128, 256), (200, 1000, 640), (4096, 7168, 2048)])
def test_scales_the_product(m, n, k):
    """d = alpha * (a @ b.T), alpha multiplied in the epilogue before the one rounding,
    against fp64, FP8 and bf16; the kernel reads alpha at each launch (a second alpha with
    the same kernel gives its own product)."""
    a, b, ref = fp8_gemm_operands(m, n, k)
    for alpha in (0.03125, -3.0):
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ptxforge.fp8_gemm_nt(a, b, d, alpha=alpha)
        torch.cuda.synchronize()
        assert not torch.isnan(d).any(), "some outputs were never written"
        assert calc_diff(d, alpha * ref) < 1e-3 and relative_error(d, alpha * ref) <= 2e-3
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.bf16_gemm_nt(x, w, d, alpha=0.5)
    expected = 0.5 * (x.double() @ w.double().T)
    assert calc_diff(d, expected) < 1e-4 and relative_error(d, expected) <= 2e-3
    q = torch.empty_like(d)
    torch.ops.ptxforge.bf16_gemm_nt(x, w, q, alpha=0.5)   # the operator takes it too
    assert torch.equal(q, d)
