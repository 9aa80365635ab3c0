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
    except ValueError as exc:
        assert "fp8" in str(exc) and not a.has("fp8")  # the only reason a variant may not exist
        return
    compiled = jit.build(spec.generate(config))
    assert compiled.resources.spills == 0, compiled.log
    assert compiled.resources.stack_frame == 0, compiled.log
    assert "warning" not in compiled.log.lower(), compiled.log
    assert len(compiled.cubin) > 0 and compiled.cubin[:4] == b"\x7fELF"


def test_row_kernel_shape_of_the_code():
    """The quantization kernel loads 16-byte vectors once, reduces the group amax in a
    half-warp and writes e4m3 pairs: the instructions that make it memory-bound."""
    cfg = row_kernel.choose_config(arch.get("sm_90a"), 7168, normalize=False, quantize=True)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.vectors_per_thread) == (128, 1, 7)
    ptx = row_kernel.generate(cfg).ptx()
    assert ptx.count("ld.global.nc.L1::no_allocate.v4.b32") == 7
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 7 * 4
    assert ptx.count("shfl.sync.bfly.b32") == 7 * 4  # 16 lanes: 4 butterfly steps per slot
    assert ptx.count("rcp.rn.f32") == 7            # 448/amax, rounded as torch rounds it
    assert "// ==== quantize" in ptx


@pytest.mark.parametrize("normalize, hidden, threads_per_row, rows_per_cta, min_ctas", [
    (True, 8, 16, 8, 4), (True, 576, 16, 8, 4), (True, 2048, 64, 2, 4), (True, 4096, 128, 1, 4),
    (True, 7168, 128, 1, 4), (True, 28672, 512, 1, 1),
    (False, 2048, 32, 4, 8), (False, 4096, 64, 2, 8), (False, 7168, 128, 1, 8),
    (False, 16384, 256, 1, 4)])
def test_row_kernel_heuristic(normalize, hidden, threads_per_row, rows_per_cta, min_ctas):
    cfg = row_kernel.choose_config(arch.get("sm_90a"), hidden, normalize=normalize, quantize=True)
    assert (cfg.threads_per_row, cfg.rows_per_cta, cfg.min_ctas_per_sm) == (
        threads_per_row, rows_per_cta, min_ctas)
    assert cfg.vectors_per_thread <= row_kernel.MAX_VECTORS_PER_THREAD[normalize]
    assert cfg.threads_per_row * cfg.vectors_per_thread * 8 >= hidden
