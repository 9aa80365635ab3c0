"""Every kernel variant assembles for its targets with no warnings and no spills."""

import pytest

from ptxforge import arch, jit, kernels
from ptxforge.kernels import bf16_row_rmsnorm_fp8quant as row_kernel


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
        config = spec.configure(a, **options)
    except ValueError as exc:  # the only reasons a variant may not exist on a target
        missing = [f for f in ("fp8", "mbarrier_tx", "wgmma") if f in str(exc)]
        assert missing and not a.has(missing[0]), exc
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
    cfg = row_kernel.choose_config(arch.get("sm_90a"), 7168, normalize=False, quantize=True)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.vectors_per_thread, cfg.groups) == (128, 1, 7, 1)
    ptx = row_kernel.generate(cfg).ptx()
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 1
    assert ptx.count("ld.shared.v4.b32") == 7
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 7 * 4
    assert ptx.count("shfl.sync.bfly.b32") == 7 * 4  # 16 lanes: 4 butterfly steps per slot
    assert ptx.count("rcp.rn.f32") == 7              # 448/amax, rounded as torch rounds it
    assert "// ==== quantize" in ptx


@pytest.mark.parametrize("normalize, quantize, hidden, threads_per_row, rows_per_cta, groups, ctas", [
    (True, True, 8, 16, 8, 2, 4), (True, True, 576, 16, 8, 2, 4), (True, True, 2048, 64, 2, 2, 4),
    (True, True, 7168, 128, 1, 2, 4), (True, False, 7168, 128, 1, 1, 4),
    (True, True, 28672, 512, 1, 2, 1), (False, True, 2048, 32, 4, 1, 8),
    (False, True, 7168, 128, 1, 1, 8), (False, True, 16384, 256, 1, 1, 4)])
def test_row_kernel_heuristic(normalize, quantize, hidden, threads_per_row, rows_per_cta, groups,
                              ctas):
    a = arch.get("sm_90a")
    cfg = row_kernel.choose_config(a, hidden, normalize=normalize, quantize=quantize)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.groups, cfg.ctas_per_sm) == (
        threads_per_row, rows_per_cta, groups, ctas)
    assert cfg.vectors_per_thread <= row_kernel.MAX_VECTORS_PER_THREAD[normalize]
    assert cfg.threads_per_row * cfg.vectors_per_thread * 8 >= hidden
    # What the heuristic promises fits: the CTAs it counts on, with their shared memory.
    shared = cfg.dynamic_shared_bytes + cfg.static_shared_bytes
    assert a.resident_ctas(cfg.threads, row_kernel.REGISTER_CAP[normalize], shared) >= cfg.ctas_per_sm


def test_gemm_uses_the_fp8_tensor_cores_and_warp_specialisation():
    from ptxforge.kernels import sm90_fp8_gemm_1d2d as gemm

    small = gemm.choose_config(arch.get("sm_90a"), 64, 7168, 2048)
    assert (small.block_m, small.block_n, small.ctas_per_sm, small.math_registers) == (64, 64, 3, 120)
    assert small.dynamic_shared_bytes * small.ctas_per_sm <= arch.get("sm_90a").shared_memory_per_sm
    cfg = gemm.choose_config(arch.get("sm_90a"), 4096, 7168, 2048)
    assert (cfg.block_m, cfg.block_n, cfg.stages, cfg.k_blocks) == (128, 128, 5, 16)
    for c in (small, cfg):  # setmaxnreg only redistributes the CTA's launch allocation
        at_launch = 65536 // (c.ctas_per_sm * c.threads) // 8 * 8
        assert 128 * 40 + 128 * c.math_warpgroups * c.math_registers <= at_launch * c.threads
    assert cfg.dynamic_shared_bytes <= arch.get("sm_90a").max_shared_memory_per_block
    ptx = gemm.generate(cfg).ptx()
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 4
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.tile") == 3  # A, B, sa
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group") == 2  # D halves
    assert "setmaxnreg.dec.sync.aligned.u32 40" in ptx and "setmaxnreg.inc.sync.aligned.u32 232" in ptx
    compiled = jit.build(gemm.generate(cfg))
    assert compiled.resources.spills == 0 and "C7508" not in compiled.log  # setmaxnreg honoured
