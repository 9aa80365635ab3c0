"""Every kernel variant assembles for its targets with no warnings and no spills."""

import pytest

from ptxforge import arch, jit, kernels
from ptxforge.kernels import bf16_row_rmsnorm_fp8quant as row_kernel
from ptxforge.kernels.gemm import GemmProblem

QUANTIZE = row_kernel.VARIANTS["quantize_fp8_per_token"]
SWIGLU = row_kernel.VARIANTS["silu_mul_quantize_fp8"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def _variants():
    for target in arch.targets():
        a = arch.get(target)
        for spec in kernels.REGISTRY.values():
            for options in spec.variants:
                yield pytest.param(a, spec, options, id=f"{target}-{spec.name}-{options}")


@pytest.mark.parametrize("a, spec, options", list(_variants()))
def test_variant_assembles_without_spills(a, spec, options):
    try:
        config = spec.config(a, **options)
    except ValueError as exc:  # the only reasons a variant may not exist on a target:
        # a feature it lacks, or no generation of the kernel's family for it
        missing = [f for f in ("fp8", "mbarrier_tx", "wgmma", "griddepcontrol") if f in str(exc)]
        no_gemm = str(exc).startswith(f"ptxforge has no GEMM for {a.target}")
        assert (missing and not a.has(missing[0])) or (no_gemm and "gemm" not in a.kernels), exc
        return
    compiled = jit.build(spec.generate(config))
    assert compiled.resources.spills == 0, compiled.log
    assert compiled.resources.stack_frame == 0, compiled.log
    assert "warning" not in compiled.log.lower(), compiled.log
    assert "Performance Loss" not in compiled.log, compiled.log  # e.g. C7514, serialised wgmma
    assert len(compiled.cubin) > 0 and compiled.cubin[:4] == b"\x7fELF"


def test_row_kernel_shape_of_the_code():
    """The quantization kernel copies its row with the copy engine, reads 16-byte vectors
    from shared memory, reduces the group amax in a half-warp and writes e4m3 pairs."""
    cfg = row_kernel.choose_config(arch.get("sm_90a"), QUANTIZE, 7168)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.vectors_per_thread, cfg.groups) == (128, 1, 7, 1)
    ptx = row_kernel.generate(cfg).ptx()
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 1
    assert ptx.count("ld.shared.v4.b32") == 7
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 7 * 4
    assert ptx.count("shfl.sync.bfly.b32") == 7 * 4  # 16 lanes: 4 butterfly steps per slot
    assert ptx.count("rcp.rn.f32") == 7              # 448/amax, rounded as torch rounds it
    assert "// ==== quantize" in ptx


@pytest.mark.parametrize("variant, hidden, threads_per_row, rows_per_cta, groups, ctas", [
    ("rms_norm_quantize_fp8", 8, 16, 8, 2, 4), ("rms_norm_quantize_fp8", 576, 16, 8, 2, 4),
    ("rms_norm_quantize_fp8", 2048, 64, 2, 2, 4), ("rms_norm_quantize_fp8", 7168, 128, 1, 2, 4),
    ("rms_norm", 7168, 128, 1, 1, 4), ("rms_norm_quantize_fp8", 28672, 512, 1, 2, 1),
    ("quantize_fp8_per_token", 2048, 32, 4, 1, 8), ("quantize_fp8_per_token", 7168, 128, 1, 1, 8),
    ("quantize_fp8_per_token", 16384, 256, 1, 1, 4)])
def test_row_kernel_heuristic(variant, hidden, threads_per_row, rows_per_cta, groups, ctas):
    a = arch.get("sm_90a")
    variant = row_kernel.VARIANTS[variant]
    cfg = row_kernel.choose_config(a, variant, hidden)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.groups, cfg.ctas_per_sm) == (
        threads_per_row, rows_per_cta, groups, ctas)
    assert cfg.vectors_per_thread <= row_kernel.MAX_VECTORS_PER_THREAD[variant.normalize]
    assert cfg.threads_per_row * cfg.vectors_per_thread * 8 >= hidden
    # What the heuristic promises fits: the CTAs it counts on, with their shared memory.
    shared = cfg.dynamic_shared_bytes + cfg.static_shared_bytes
    assert a.resident_ctas(cfg.threads, cfg.registers, shared) >= cfg.ctas_per_sm


def test_swiglu_row_kernel_shape_of_the_code():
    """SwiGLU + quantization: two bulk copies per row (gate's, then up's, into one stage row
    of 2 x 2I bytes), gate and up vectors read from the stage, silu on the SFU and one bf16x2
    multiply per pair, then the quantizer's code."""
    cfg = row_kernel.choose_config(arch.get("sm_90a"), SWIGLU, 14336)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.vectors_per_thread, cfg.groups) == (256, 1, 7, 1)
    assert cfg.stage_bytes == 2 * 14336 * 2
    ptx = row_kernel.generate(cfg).ptx()
    for param in (".param .u64 gate", ".param .u32 gate_row_stride", ".param .u64 up",
                  ".param .u32 up_row_stride"):
        assert param in ptx
    assert ".param .u64 x" not in ptx and "weight" not in ptx
    copies = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.shared" in line]
    assert len(copies) == 2
    assert copies[0].startswith("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%smem], ")
    assert copies[1].startswith(f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%smem+{14336 * 2}], ")
    assert f"mul.lo.u32 %copy_bytes, %copy_rows, {2 * 14336 * 2};" in ptx  # expect-tx: both rows
    assert ptx.count("ld.shared.v4.b32") == 2 * 7
    assert ptx.count("ex2.approx.ftz.f32") == ptx.count("rcp.approx.ftz.f32") == 7 * 8
    assert ptx.count("cvt.rn.bf16x2.f32") == ptx.count("mul.rn.bf16x2") == 7 * 4
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 7 * 4
    assert ptx.count("rcp.rn.f32") == 7              # the quantizer's 448/amax
    assert "div." not in ptx


@pytest.mark.parametrize("hidden, threads_per_row, rows_per_cta, vectors, ctas", [
    (8, 16, 8, 1, 8), (128, 16, 8, 1, 8), (776, 16, 8, 7, 7), (1000, 16, 8, 8, 7),
    (1024, 16, 8, 8, 6), (2048, 32, 4, 8, 6), (4096, 64, 2, 8, 6), (11008, 256, 1, 6, 4),
    (14336, 256, 1, 7, 3), (18432, 512, 1, 5, 2), (28672, 512, 1, 7, 2), (32768, 512, 1, 8, 1)])
def test_swiglu_row_kernel_sizes_assemble_without_spills(hidden, threads_per_row, rows_per_cta,
                                                          vectors, ctas):
    """The heuristic's configs at FFN intermediate sizes and at its edges: 8 (one vector),
    1000 (a partial quantization group), 776 (7 vectors with 16 threads a row, which ptxas
    fits only in 72 registers) and 32768 (the largest it takes)."""
    a = arch.get("sm_90a")
    cfg = row_kernel.choose_config(a, SWIGLU, hidden)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.vectors_per_thread, cfg.ctas_per_sm) == (
        threads_per_row, rows_per_cta, vectors, ctas)
    shared = cfg.dynamic_shared_bytes + cfg.static_shared_bytes
    assert a.resident_ctas(cfg.threads, cfg.registers, shared) >= cfg.ctas_per_sm
    compiled = jit.build(row_kernel.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0, compiled.log
    assert "warning" not in compiled.log.lower(), compiled.log


def test_gemm_uses_the_fp8_tensor_cores_and_warp_specialisation():
    from ptxforge.kernels import sm90_gemm as gemm

    sm90 = arch.get("sm_90a")
    small = gemm.choose_config(sm90, GemmProblem(2112, 7168), 64)
    # Small M: one 64-row block of tiles, narrow enough to give every SM a tile.
    assert small.block_m == 64 and small.n_tiles == sm90.sm_count
    cfg = gemm.choose_config(sm90, GemmProblem(7168, 2048), 4096)
    assert (cfg.block_m, cfg.k_blocks) == (128, 16)
    for c in (small, cfg):  # setmaxnreg only redistributes the CTA's launch allocation
        at_launch = min(255, 65536 // (c.ctas_per_sm * c.threads)) // 8 * 8
        assert 128 * 40 + 128 * c.math_warpgroups * c.math_registers <= at_launch * c.threads
        assert c.dynamic_shared_bytes <= sm90.max_shared_memory_per_block
    cfg = gemm.make_config(sm90, GemmProblem(7168, 2048), 128, 128)
    assert cfg.stages == 5
    ptx = gemm.generate(cfg).ptx()
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 4
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.tile") == 3  # A, B, sa
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group") == 2  # 64-col boxes
    assert "setmaxnreg.dec.sync.aligned.u32 40" in ptx and "setmaxnreg.inc.sync.aligned.u32 232" in ptx
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0 and "C7508" not in compiled.log  # setmaxnreg honoured


def test_gemm_tile_widths_cover_at_most_two_scale_rows():
    from ptxforge.kernels import sm90_gemm as gemm

    candidates = gemm.block_n_candidates(arch.get("sm_90a"))
    assert {16, 56, 112, 128, 136, 144, 160, 192, 256} <= set(candidates)
    assert not {8, 152, 168, 176} & set(candidates)
    # bf16 has no scales: every width wgmma takes.
    assert {152, 168, 176, 240} <= set(gemm.block_n_candidates(arch.get("sm_90a"), scaled=False))
    for bn in candidates:  # every tile start j * bn, as far as the pattern repeats
        assert all((j * bn) % 128 + bn <= 256 for j in range(128))


@pytest.mark.parametrize("block_m, block_n", [(64, 16), (64, 24), (64, 56), (64, 192), (128, 112),
                                              (128, 144), (128, 160)])
def test_gemm_tile_shapes_assemble_without_spills(block_m, block_n):
    from ptxforge.kernels import sm90_gemm as gemm

    cfg = gemm.make_config(arch.get("sm_90a"), GemmProblem(2112, 7168), block_m, block_n)
    ptx = gemm.generate(cfg).ptx()
    assert f"m64n{block_n}k32.f32.e4m3.e4m3" in ptx
    # One TMA store per box of the widest of 64/32/16/8 columns dividing block_n.
    boxes = block_n // cfg.d_box_cols
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group") == boxes
    # A straddling tile selects a B scale per 8-column group, or where its width allows few
    # splits of its groups between two scale rows, branches to a promotion per split.
    dispatched = len(cfg.scale_row_splits) <= gemm.MAX_PROMOTION_VARIANTS
    assert ("selp.f32" in ptx) == (cfg.straddles and not dispatched)
    promotions = cfg.part_buffers + cfg.k_blocks % cfg.part_buffers  # emitted K-block bodies
    assert ptx.count("not_split_") == (2 * (len(cfg.scale_row_splits) - 1) * promotions
                                       if cfg.straddles and dispatched else 0)
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0


@pytest.mark.parametrize("block_m, block_n", [(64, 24), (64, 16), (128, 128), (128, 160)])
def test_gemm_accumulating_epilogue_adds_f32_boxes(block_m, block_n):
    from ptxforge.kernels import sm90_gemm as gemm

    cfg = gemm.make_config(arch.get("sm_90a"), GemmProblem(2112, 7168, epilogue=("accumulate",)),
                           block_m, block_n)
    ptx = gemm.generate(cfg).ptx()
    # f32 boxes of 128-, 64- or 32-byte rows, each added into D by a TMA reduction.
    assert cfg.d_box_cols * 4 in (128, 64, 32) and block_n % cfg.d_box_cols == 0
    assert ptx.count("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile") == \
        block_n // cfg.d_box_cols
    assert "cp.async.bulk.tensor.2d.global.shared::cta.tile" not in ptx
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0


def refuses_epilogue(*problems):
    """Each problem's terms on its layout have no registered epilogue: its config is refused,
    naming them and what there is."""
    from ptxforge.kernels import sm90_gemm as gemm

    for wrong in problems:
        with pytest.raises(ValueError, match=f"no GEMM epilogue computes "
                                             f"{' [+] '.join(wrong.epilogue)} on the "
                                             f"{wrong.layout} layout; there are: "):
            gemm.make_config(arch.get("sm_90a"), wrong, 128, 128)


@pytest.mark.parametrize("block_m, block_n, dtype", [(64, 24, "e4m3"), (128, 128, "e4m3"),
                                                     (128, 256, "bf16")])
def test_gemm_bias_epilogue_reads_one_pair_per_column_group(block_m, block_n, dtype):
    from ptxforge.kernels import sm90_gemm as gemm

    cfg = gemm.make_config(arch.get("sm_90a"), GemmProblem(2112, 7168, dtype, epilogue=("bias",)),
                           block_m, block_n)
    assert cfg.epilogue.__name__ == "BiasBf16Store" and cfg.name.endswith("_bias")
    ptx = gemm.generate(cfg).ptx()
    assert ".param .u64 bias" in ptx
    # One 4-byte bias load per 8-column group, skipped past N; two f32 adds per pair.
    assert ptx.count("ld.global.nc.b32") == block_n // 8
    assert ptx.count("add.f32") == block_n // 2
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0
    plain = gemm.make_config(arch.get("sm_90a"), GemmProblem(2112, 7168, dtype), block_m, block_n)
    assert "bias" not in gemm.generate(plain).ptx()
    # Registered for the dense layout alone, and not with an f32 D.
    refuses_epilogue(GemmProblem(2112, 7168, epilogue=("accumulate", "bias")),
                     GemmProblem(2112, 7168, "e4m3", "contiguous", 4, ("bias",)))


@pytest.mark.parametrize("block_m, block_n, dtype, tile_rows", [
    (64, 24, "e4m3", 0), (128, 128, "e4m3", 0), (128, 256, "bf16", 0), (64, 96, "e4m3", 8)])
def test_gemm_scale_epilogue_multiplies_each_pair_by_alpha(block_m, block_n, dtype, tile_rows):
    """alpha is an f32 parameter, read once; each accumulator pair is multiplied by it (two
    f32 multiplies, into registers of their own: the accumulators stay a.b^T) before the
    one rounding to bf16; dense only, alone."""
    from ptxforge.kernels import sm90_gemm as gemm

    problem = GemmProblem(2112, 7168, dtype, epilogue=("scale",))
    cfg = gemm.make_config(arch.get("sm_90a"), problem, block_m, block_n, tile_rows=tile_rows)
    assert cfg.epilogue.__name__ == "ScaleBf16Store" and cfg.name.endswith(
        "_scale" + (f"_r{tile_rows}" if tile_rows else ""))
    ptx = gemm.generate(cfg).ptx()
    assert ".param .f32 alpha" in ptx and ptx.count("ld.param.f32 %alpha") == 1
    assert ptx.count("mul.f32 %scaled") == block_n // 2
    assert "mul.f32 %acc" not in ptx
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0
    refuses_epilogue(problem._replace(epilogue=("bias", "scale")),
                     problem._replace(layout="masked", groups=4))


def _scale_heuristic_configs():
    """Every config the tile model picks with the scale for the dense registry shapes at 1,
    16, 32, 64, 300 and 4096 rows."""
    from ptxforge.kernels import sm90_gemm as gemm

    sm90, chosen = arch.get("sm_90a"), {}
    for dtype in ("e4m3", "bf16"):
        for m in (1, 16, 32, 64, 300, 4096):
            for n, k in kernels.GEMM_SHAPES:
                cfg = gemm.choose_config(sm90, GemmProblem(n, k, dtype, epilogue=("scale",)), m)
                chosen.setdefault(cfg, f"{dtype}-m{m}-n{n}-k{k}")
    return [pytest.param(cfg, id=name) for cfg, name in chosen.items()]


@pytest.mark.parametrize("cfg", _scale_heuristic_configs())
def test_every_scale_config_the_heuristic_picks_assembles_without_spills(cfg):
    from ptxforge.kernels import sm90_gemm as gemm

    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0, compiled.log
    assert compiled.resources.stack_frame == 0, compiled.log


@pytest.mark.parametrize("block_m, block_n, dtype, tile_rows", [
    (64, 24, "e4m3", 0), (128, 128, "e4m3", 0), (128, 256, "bf16", 0), (64, 96, "bf16", 8),
    (64, 136, "e4m3", 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_residual_epilogue_reads_a_pair_per_row_and_column_group(block_m, block_n, dtype,
                                                                       tile_rows, bias):
    """Per 8-column group a thread loads the residual pair of each of its two rows (4 bytes,
    not through the read-only path: the residual may be D itself), guarded by its row
    against M and the tile's rows and by the group against N, and adds it in f32 after
    the bias: two f32 adds per pair and addend."""
    from ptxforge.kernels import sm90_gemm as gemm

    problem = GemmProblem(2112, 7168, dtype, epilogue=("bias",) * bias + ("residual",))
    cfg = gemm.make_config(arch.get("sm_90a"), problem, block_m, block_n, tile_rows=tile_rows)
    assert cfg.epilogue.__name__ == ("BiasResidualBf16Store" if bias else "ResidualBf16Store")
    assert "_residual" in cfg.name and ("_bias" in cfg.name) == bias
    ptx = gemm.generate(cfg).ptx()
    for param in (".param .u64 residual", ".param .u32 residual_row_stride",
                  ".param .u32 m_rows"):
        assert param in ptx
    groups = block_n // 8
    assert ptx.count("ld.global.b32") == 2 * groups
    assert ptx.count("ld.global.nc.b32") == groups * bias
    assert ptx.count("and.pred") == 2 * groups      # row inside D and group inside N
    assert ptx.count("add.f32") == block_n // 2 * (1 + bias)
    # Before the K loop, two threads a row pull the residual tile's lines into L2: each
    # every other line a row of 2 * block_n bytes can touch.
    lines = -(-2 * block_n // 128) + 1
    assert ptx.count("prefetch.global.L2 ") == -(-lines // 2)
    assert ptx.index("prefetch.global.L2 ") < ptx.index("wgmma.mma_async")
    # The bias is added first: its sums are what the residual is added to.
    added_to = "%biased0" if bias else "%acc0"
    assert f"add.f32 %residual_sum0, {added_to}, %residual0;" in ptx
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0
    assert "warning" not in compiled.log.lower()
    refuses_epilogue(GemmProblem(2112, 7168, epilogue=("accumulate", "residual")),
                     GemmProblem(2112, 7168, "e4m3", "masked", 4, ("residual",)))


def _residual_heuristic_configs():
    """Every config the tile model picks with a residual (and with or without a bias) for
    the dense registry shapes at 1, 16, 32 (the few-token tiles), 64, 300 and 4096 rows."""
    from ptxforge.kernels import sm90_gemm as gemm

    sm90, chosen = arch.get("sm_90a"), {}
    for dtype in ("e4m3", "bf16"):
        for m in (1, 16, 32, 64, 300, 4096):
            for n, k in kernels.GEMM_SHAPES:
                for bias in (False, True):
                    terms = ("bias",) * bias + ("residual",)
                    cfg = gemm.choose_config(sm90, GemmProblem(n, k, dtype, epilogue=terms), m)
                    chosen.setdefault(cfg, f"{dtype}-m{m}-n{n}-k{k}" + ("-bias" if bias else ""))
    return [pytest.param(cfg, id=name) for cfg, name in chosen.items()]


@pytest.mark.parametrize("cfg", _residual_heuristic_configs())
def test_every_residual_config_the_heuristic_picks_assembles_without_spills(cfg):
    from ptxforge.kernels import sm90_gemm as gemm

    assert "residual" in cfg.problem.epilogue
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0, compiled.log
    assert compiled.resources.stack_frame == 0, compiled.log
    assert "warning" not in compiled.log.lower(), compiled.log
    assert "Performance Loss" not in compiled.log, compiled.log


def test_few_tokens_get_tiles_covering_their_rows():
    """At most 32 rows (a group's, masked) of a dense or masked GEMM whose tile keeps under
    128 KB of weights in flight: the same tile covering 8, 16 or 32 rows, two CTAs an SM
    (more weight bytes in flight); not
    where the tile already holds enough (64 x 192 at 24576 x 1536), for the contiguous
    layout or for more rows."""
    from ptxforge.kernels import sm90_gemm as gemm

    sm90 = arch.get("sm_90a", "H200")
    for m, rows in ((1, 8), (8, 8), (9, 16), (16, 16), (32, 32)):
        cfg = gemm.choose_config(sm90, GemmProblem(2112, 7168), m)
        plain = gemm.make_config(sm90, GemmProblem(2112, 7168), 64, cfg.block_n)
        flight = lambda c: c.stages * c.b_stage_bytes * c.ctas_per_sm
        assert cfg.tile_rows == rows and cfg.ctas_per_sm == 2 and flight(cfg) > flight(plain)
        assert cfg.name.endswith(f"_r{rows}")
        assert jit.build(gemm.generate(cfg)).resources.spills == 0
    assert gemm.choose_config(sm90, GemmProblem(2112, 7168), 33).tile_rows == 0
    assert gemm.choose_config(sm90, GemmProblem(24576, 1536), 8).tile_rows == 0
    # The masked layout counts a group's rows: 8 groups of 8 tokens get 8-row tiles, of 32
    # tokens 32-row tiles (a tile covers one group's rows: the model counts 8 groups' tiles,
    # not 256 rows' worth of 128-row tiles as it once did, which measured 69% of the copy
    # against 96% for 32 x 32 tokens at 4096 x 7168 on an H200).
    for tokens in (8, 32):
        masked = gemm.choose_config(sm90, GemmProblem(4096, 7168, "e4m3", "masked", 8), 8 * tokens)
        assert masked.block_m == 64 and masked.tile_rows == tokens
        assert jit.build(gemm.generate(masked)).resources.spills == 0
    masked = GemmProblem(4096, 7168, "e4m3", "masked", 4)
    assert gemm.choose_config(sm90, masked, 4 * 256).block_m == 128
    with pytest.raises(ValueError, match="tile_rows must be 8, 16 or 32"):
        gemm.make_config(sm90, GemmProblem(2112, 7168, "e4m3", "contiguous", 2), 64, 16,
                         tile_rows=8)


def test_gemm_admits_only_tiles_ptxas_assembles():
    """The register rules' edges: at 2 CTAs an SM a bf16 m64n200 wgmma assembles and
    m64n208 is refused; the bias epilogue's registers take 64 x 144 (e4m3) from two part
    buffers to one, which assembles without spills."""
    from ptxforge.kernels import sm90_gemm as gemm

    sm90 = arch.get("sm_90a")
    widest = gemm.make_config(sm90, GemmProblem(7168, 2048, "bf16"), 64, 200, 2)
    assert jit.build(gemm.generate(widest)).resources.spills == 0
    with pytest.raises(ValueError, match="208-wide wgmma does not assemble in the 128 registers"):
        gemm.make_config(sm90, GemmProblem(7168, 2048, "bf16"), 64, 208, 2)
    assert gemm.make_config(sm90, GemmProblem(7168, 2048), 64, 144).part_buffers == 2
    cfg = gemm.make_config(sm90, GemmProblem(7168, 2048, epilogue=("bias",)), 64, 144)
    assert cfg.part_buffers == 1 and jit.build(gemm.generate(cfg)).resources.spills == 0


@pytest.mark.parametrize("block_m, block_n, multicast", [(128, 128, 2), (64, 24, 1), (128, 160, 1)])
def test_grouped_gemm_reads_each_tile_group_and_zeroes_foreign_rows(block_m, block_n, multicast):
    from ptxforge.kernels import sm90_gemm as gemm

    problem = GemmProblem(4096, 7168, "e4m3", "contiguous", 8)
    cfg = gemm.make_config(arch.get("sm_90a"), problem, block_m, block_n, multicast=multicast)
    ptx = gemm.generate(cfg).ptx()
    assert ".param .u64 m_indices" in ptx and ".param .u32 m_rows" in ptx
    # The tile's group is clamped into [0, 8) before it picks B rows and B-scale rows.
    assert "max.s32" in ptx and "min.s32" in ptx and ", 7;" in ptx
    # Each bf16 pair of a row outside the tile's group is replaced by zeros.
    assert ptx.count("selp.b32") == block_n // 8 * 2
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0
    refuses_epilogue(problem._replace(epilogue=("accumulate",)))


@pytest.mark.parametrize("block_m, block_n, multicast", [(128, 128, 2), (64, 24, 1)])
def test_masked_grouped_gemm_walks_valid_tiles_with_3d_maps(block_m, block_n, multicast):
    from ptxforge.kernels import sm90_gemm as gemm

    problem = GemmProblem(4096, 7168, "e4m3", "masked", 4)
    cfg = gemm.make_config(arch.get("sm_90a"), problem, block_m, block_n, multicast=multicast)
    ptx = gemm.generate(cfg).ptx()
    assert ".param .u64 masked_m" in ptx and "m_indices" not in ptx
    # A and sa load per group (3-D maps), D stores per group; B is one [G*N, K] matrix.
    assert ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global.tile") == 2
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.tile") == 1
    assert ptx.count("cp.async.bulk.tensor.3d.global.shared::cta.tile") == block_n // cfg.d_box_cols
    assert "$L_find_group" in ptx  # the tile's group: a scan over the groups' valid tiles
    assert jit.build(gemm.generate(cfg)).resources.spills == 0


@pytest.mark.parametrize("block_m, block_n", [(128, 256), (128, 128), (64, 24)])
def test_bf16_gemm_is_the_same_kernel_without_scales(block_m, block_n):
    from ptxforge.kernels import sm90_gemm as gemm

    cfg = gemm.make_config(arch.get("sm_90a"), GemmProblem(7168, 2048, "bf16"), block_m, block_n)
    assert cfg.k_blocks == 2048 // 64 and cfg.part_buffers == 1 and cfg.sa_stage_bytes == 0
    ptx = gemm.generate(cfg).ptx()
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16") == 8
    assert "tmap_sa" not in ptx and "fma.rn.f32" not in ptx      # no scales, no promotion
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.tile") == 2  # A, B
    compiled = jit.build(gemm.generate(cfg))  # 128 x 256: acc alone fits the registers
    assert compiled.resources.spills == 0 and "C7514" not in compiled.log


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_bf16_gemm_assembles(masked):
    from ptxforge.kernels import sm90_gemm as gemm

    problem = GemmProblem(4096, 7168, "bf16", "masked" if masked else "contiguous", 8)
    cfg = gemm.make_config(arch.get("sm_90a"), problem, 128, 128)
    ptx = gemm.generate(cfg).ptx()
    assert "tmap_sa" not in ptx and ("masked_m" in ptx) == masked
    assert jit.build(gemm.generate(cfg)).resources.spills == 0


def test_gemm_tiles_wider_than_the_registers_are_refused():
    from ptxforge.kernels import sm90_gemm as gemm

    # 128-row tiles: two math warpgroups at 232 registers; 256 columns of acc and part
    # leave too few for the rest. 192 columns fit one part buffer, not two.
    sm90 = arch.get("sm_90a")
    with pytest.raises(ValueError, match="registers"):
        gemm.make_config(sm90, GemmProblem(2112, 7168), 128, 256)
    with pytest.raises(ValueError, match="registers"):
        gemm.make_config(sm90, GemmProblem(2112, 7168), 128, 192, part_buffers=2)
    cfg = gemm.make_config(sm90, GemmProblem(2112, 7168), 128, 192)
    assert cfg.part_buffers == 1 and jit.build(gemm.generate(cfg)).resources.spills == 0
    # Two part buffers on 128-row tiles come with multicast (A from L2 falls behind without).
    assert gemm.make_config(sm90, GemmProblem(7168, 7168), 128, 128).part_buffers == 1
    assert gemm.make_config(sm90, GemmProblem(7168, 7168), 128, 128, multicast=2).part_buffers == 2

@pytest.mark.parametrize("producers", [1, 2, 4])
def test_gemm_producer_warps_take_turns_over_the_k_blocks(producers):
    from ptxforge.kernels import sm90_gemm as gemm

    cfg = gemm.make_config(arch.get("sm_90a"), GemmProblem(2112, 7168), 64, 16, producers=producers)
    ptx = gemm.generate(cfg).ptx()
    # Lane 0 of warps 0 .. producers - 1: tid has no bits outside 32 * (producers - 1).
    assert f"and.b32 %p_leader_bits, %t, {~(32 * (producers - 1)) & 0xFFFFFFFF};" in ptx
    # Each warp steps its ring position by the producer count, wrapping past the last stage.
    assert f"add.u32 %p_stage, %p_stage, {producers};" in ptx
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.tile") == 3  # A, B, sa
    assert jit.build(gemm.generate(cfg)).resources.spills == 0


@pytest.mark.parametrize("dtype", ["e4m3", "bf16"])
def test_gemm_large_m_takes_128_row_tiles(dtype):
    """At large M a 64-row tile reads all of B from shared memory per 64 rows (measured
    20-35% slower than 128-row tiles on the H200): the model's shared-memory term keeps
    the choice on 128-row tiles, for every width bf16 allows too."""
    from ptxforge.kernels import sm90_gemm as gemm

    sm90 = arch.get("sm_90a", "H200")
    for n, k in ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168)):
        assert gemm.choose_config(sm90, GemmProblem(n, k, dtype), 4096).block_m == 128


def test_gemm_producer_counts_are_checked():
    from ptxforge.kernels import sm90_gemm as gemm

    with pytest.raises(ValueError, match="producers must be 1, 2 or 4 warps, got 3"):
        gemm.make_config(arch.get("sm_90a"), GemmProblem(2112, 7168), 64, 16, producers=3)


def test_gemm_multicast_shares_a_across_a_cluster_pair():
    from ptxforge.kernels import sm90_gemm as gemm

    sm90 = arch.get("sm_90a")
    # Too few tiles to pair.
    assert gemm.choose_config(sm90, GemmProblem(7168, 16384), 128).multicast == 1
    with pytest.raises(ValueError, match="multicast 2 needs"):
        gemm.make_config(sm90, GemmProblem(2112, 7168), 128, 128, multicast=2)  # 17 tiles along N
    cfg = gemm.make_config(sm90, GemmProblem(7168, 2048), 128, 128, multicast=2)
    ptx = gemm.generate(cfg).ptx()
    assert ptx.count(".multicast::cluster") == 1 and cfg.a_box_rows == 64
    assert "mapa.shared::cluster.u32" in ptx
    # A cluster-scope release on every arrival compiles to a GPU-wide MEMBAR (measured: half speed).
    assert "mbarrier.arrive.shared::cluster.b64" in ptx and "arrive.release.cluster" not in ptx
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0


@pytest.mark.parametrize("groups", [0, 256])
def test_gemm_clusters_along_m_share_b(groups):
    """share_b: each CTA loads its own A and half of B into both CTAs of the cluster (a
    grouped B only where the peer's block row starts in the same group, else both halves
    itself), so a stage still expects the whole A and B tiles; a repeated tile (an odd
    block-row count) is not stored."""
    from ptxforge.kernels import sm90_gemm as gemm

    sm90 = arch.get("sm_90a")
    problem = GemmProblem(4096, 7168, "e4m3", "contiguous" if groups else "dense", groups)
    cfg = gemm.make_config(sm90, problem, 128, 128, multicast=2, share_b=True, raster=1)
    plain = gemm.make_config(sm90, problem, 128, 128)
    assert cfg.name.endswith("_ras1_shb") and cfg.b_box_rows == 64 and cfg.a_box_rows == 128
    assert cfg.tx_bytes == plain.tx_bytes and cfg.launch.cluster == 2
    ptx = gemm.generate(cfg).ptx()
    assert ptx.count(".multicast::cluster") == 1      # B's half; A is this CTA's own
    # grouped: the peer's group compared with this tile's, and both halves loaded where not
    loads = ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global")   # A, B, sa
    assert loads == (5 if groups else 3)
    assert "not.pred" in ptx                            # a repeated tile stores nothing
    assert jit.build(gemm.generate(cfg)).resources.spills == 0
    with pytest.raises(ValueError, match="share_b needs multicast 2"):
        gemm.make_config(sm90, problem, 128, 128, share_b=True)
    with pytest.raises(ValueError, match="share_b needs"):
        gemm.make_config(sm90, GemmProblem(4096, 7168, "e4m3", "masked", 8), 128, 128,
                         multicast=2, share_b=True)


def test_small_groups_get_clusters_sharing_b():
    """The contiguous layout of small groups (DeepSeek-V3's 256 experts at 4096 tokens:
    ~255 rows a group) gets share_b and raster 1; large groups and dense GEMMs keep the
    clusters sharing A."""
    from ptxforge.kernels import sm90_gemm as gemm

    sm90 = arch.get("sm_90a")
    small = gemm.choose_config(sm90, GemmProblem(4096, 7168, "e4m3", "contiguous", 256),
                               4096 * 8 + 256 * 127)
    assert small.share_b and small.raster == 1 and small.multicast == 2
    large = gemm.choose_config(sm90, GemmProblem(4096, 7168, "e4m3", "contiguous", 4), 4 * 8192)
    dense = gemm.choose_config(sm90, GemmProblem(4096, 7168), 4 * 8192)
    assert not large.share_b and large.multicast == 2 and not dense.share_b


@pytest.mark.parametrize("block_n, dtype", [(64, "e4m3"), (96, "e4m3"), (64, "bf16")])
def test_gemm_b_scales_come_with_each_stage(block_n, dtype):
    """e4m3: the producer copies each K block's B scales into its stage (a 4-byte cp.async
    per scale row: two for a tile straddling two rows) and arrives on the stage's full
    barrier when they land, so a full barrier expects two arrivals; the math warps read
    sb from shared memory only. bf16 has no scales: one arrival."""
    from ptxforge.kernels import sm90_gemm as gemm

    cfg = gemm.make_config(arch.get("sm_90a"), GemmProblem(2112, 7168, dtype), 64, block_n)
    ptx = gemm.generate(cfg).ptx()
    rows = 1 + cfg.straddles
    assert ptx.count("cp.async.ca.shared.global") == (rows if cfg.scaled else 0)
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared::cta.b64") == cfg.scaled
    inits = [line.split(",")[-1].strip(" ;") for line in ptx.splitlines()
             if "mbarrier.init" in line]
    assert inits[0:2 * cfg.stages:2] == ["2" if cfg.scaled else "1"] * cfg.stages  # full, empty, ...
    assert "ld.global.nc.f32" not in ptx    # no per-K-block scale load by the math warps
    assert jit.build(gemm.generate(cfg)).resources.spills == 0


def test_moe_combine_shape_of_the_code():
    """One CTA per token and column chunk, one 16-byte column vector a thread at k = 8: the
    k indices and weights, all k row loads (each skipped for a dropped pair), then per pair
    a rounded product and a rounded sum (never an fma, whose single rounding would change
    the bits), one bf16 rounding and one 16-byte store."""
    from ptxforge.kernels import bf16_moe_combine as combine

    cfg = combine.choose_config(arch.get("sm_90a"), 7168, 8, "f32")
    assert (cfg.threads, cfg.vectors_per_thread, cfg.chunks, cfg.ctas_per_sm) == (128, 1, 7, 8)
    k = combine.generate(cfg)
    assert [p.name for p in k.params] == ["y", "y_row_stride", "y_rows", "rows", "weights", "out"]
    assert k.launch.block == 128 and k.launch.shared_bytes == 0
    ptx = k.ptx()
    assert ptx.count("ld.global.nc.u32") == 8 and ptx.count("ld.global.nc.b32") == 8
    assert ptx.count("setp.lt.u32 %pair") == 8  # 0 <= row < R, unsigned: -1 is dropped
    loads = [line.strip() for line in ptx.splitlines() if ".v4.b32" in line and "ld." in line]
    assert len(loads) == 8 and all(line.startswith(f"@%pair{j}_ok ld.global.nc.L1::no_allocate")
                                   for j, line in enumerate(loads))
    assert ptx.count("mul.rn.f32") == ptx.count("add.rn.f32") == 8 * 8
    assert ptx.count("@%pair7_ok add.rn.f32") == 8 and "fma" not in ptx
    assert ptx.count("cvt.rn.bf16x2.f32") == 4 and ptx.count("st.global.v4.b32") == 1
    assert "%slot" not in ptx  # 896 vectors = 7 chunks x 128: no chunk sticks out
    bf16 = combine.generate(combine.choose_config(arch.get("sm_90a"), 7168, 8, "bf16")).ptx()
    assert bf16.count("ld.global.nc.u16") == 8 and "ld.global.nc.b32" not in bf16


@pytest.mark.parametrize("hidden, topk, threads, vectors, chunks, ragged", [
    (7168, 8, 128, 1, 7, False), (7168, 6, 128, 1, 7, False), (7168, 4, 112, 2, 4, False),
    (7168, 2, 112, 4, 2, False), (7168, 1, 112, 8, 1, False), (2112, 8, 88, 1, 3, False),
    (512, 2, 32, 2, 1, False), (8, 8, 1, 1, 1, False), (1032, 8, 65, 1, 2, True),
    (1160, 1, 37, 4, 1, True), (16384, 16, 128, 1, 16, False)])
def test_moe_combine_heuristic(hidden, topk, threads, vectors, chunks, ragged):
    """8 // k vectors a thread (fewer for a short row), the fewest chunks of <= 128
    threads, the threads spread evenly over them."""
    from ptxforge.kernels import bf16_moe_combine as combine

    cfg = combine.choose_config(arch.get("sm_90a"), hidden, topk)
    assert (cfg.threads, cfg.vectors_per_thread, cfg.chunks, cfg.ragged) == (
        threads, vectors, chunks, ragged)
    assert cfg.chunks * cfg.chunk_vectors >= hidden // 8 > (cfg.chunks - 1) * cfg.chunk_vectors
    assert (cfg.ctas_per_sm is None) == (cfg.loads > combine.LOADS_IN_FLIGHT)


@pytest.mark.parametrize("hidden, topk, weight_dtype", [
    *((7168, topk, w) for topk in (1, 4, 6) for w in ("f32", "bf16")),
    (1032, 8, "f32"), (1160, 1, "bf16"), (8, 8, "bf16"), (7168, 16, "f32"), (7168, 32, "bf16")])
def test_moe_combine_sizes_assemble_without_spills(hidden, topk, weight_dtype):
    """The k the registry leaves out (it holds 8 and 2), ragged rows (1032: the last chunk's
    thread 64 past the end; 1160: four slots a thread, the last partly past it), one vector
    (8), and k above 8, which ptxas gets no register cap for."""
    from ptxforge.kernels import bf16_moe_combine as combine

    cfg = combine.choose_config(arch.get("sm_90a"), hidden, topk, weight_dtype)
    compiled = jit.build(combine.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0, compiled.log
    assert "warning" not in compiled.log.lower(), compiled.log
    if cfg.ctas_per_sm is not None:
        assert compiled.resources.registers <= combine.REGISTERS
    if cfg.ragged:
        assert compiled.ptx.count("st.global.v4.b32") == cfg.vectors_per_thread
        assert compiled.ptx.count("and.pred %load") >= topk


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_routing_layout_shape_of_the_code(layout):
    """One CTA of 32 warps walks the pairs twice, 8 batches of 32 a trip: a match per batch
    in each walk, the count's adds as red.shared (no warp syncs), the placement's advance
    between two warp syncs; m_indices and the segment scan in the contiguous layout only."""
    from ptxforge.kernels import i64_moe_routing_layout as routing

    cfg = routing.choose_config(arch.get("sm_90a"), 256, layout)
    assert cfg.name == f"i64_moe_routing_layout_{layout}_e256"
    ptx = routing.generate(cfg).ptx()
    assert ".maxntid 1024, 1, 1" in ptx
    assert ptx.count("ld.global.nc.s64") == 2 * routing.LOADS_AHEAD
    assert ptx.count("match.any.sync.b32") == 2 * routing.LOADS_AHEAD
    assert ptx.count("red.shared.add.u32") == routing.LOADS_AHEAD
    assert ptx.count("bar.warp.sync") == 1 + 2 * routing.LOADS_AHEAD  # + the row clearing
    contiguous = layout == "contiguous"
    assert ptx.count("bar.sync") == 2 + contiguous       # + the warp totals of the scan
    assert (".param .u64 m_indices" in ptx) == contiguous
    assert (".param .u32 rows_per_expert" in ptx) != contiguous
    assert ptx.count("shfl.sync.up.b32") == 10 * contiguous
    # The block search: log2(P) steps, P = 256.
    assert ptx.count("setp.ls.u32") == 8 * contiguous


@pytest.mark.parametrize("experts, layout, total", [
    (8, "masked", 32 * 8 * 4), (8, "contiguous", 32 * 8 * 4 + 8 * 4 + 8 * 4 + 128),
    (384, "contiguous", 32 * 384 * 4 + 512 * 4 + 384 * 4 + 128),
    (1024, "contiguous", 32 * 1024 * 4 + 1024 * 4 + 1024 * 4 + 128)])
def test_routing_layout_shared_memory_plan(experts, layout, total):
    """The histograms, then (contiguous) first_row padded to a power of two for the search,
    fill_end and the warp totals: the launch asks for the plan's total."""
    from ptxforge.kernels import i64_moe_routing_layout as routing

    cfg = routing.choose_config(arch.get("sm_90a"), experts, layout)
    assert cfg.shared.total == total
    kernel = routing.generate(cfg)
    assert kernel.launch.shared_bytes == total and kernel.launch.block == 1024
    compiled = jit.build(kernel)
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0, compiled.log
    assert compiled.resources.registers <= 64  # 1024 threads: 64 registers each at most


def test_routing_layout_configs_are_checked():
    from ptxforge.kernels import i64_moe_routing_layout as routing

    with pytest.raises(ValueError, match=r"^layout must be one of \('contiguous', 'masked'\), "
                                         r"got 'dense'$"):
        routing.choose_config(arch.get("sm_90a"), 8, "dense")
    for experts in (0, 1025):
        with pytest.raises(ValueError,
                           match=rf"^num_experts must be in \[1, 1024\], got {experts}$"):
            routing.choose_config(arch.get("sm_90a"), experts)
    with pytest.raises(ValueError, match="exceed sm_89's 101376 a CTA"):  # Ada: 99 KiB a CTA
        routing.choose_config(arch.get("sm_89"), 1024)
    # Programmatic dependent launch's instructions only where the target has them.
    ampere = routing.choose_config(arch.get("sm_80"), 8)
    assert not ampere.griddepcontrol and "griddepcontrol" not in routing.generate(ampere).ptx()
