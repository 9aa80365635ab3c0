"""Launch plans without a GPU: what a kernel declares for its launch (parameters, tensor
maps, shape) reaches the launcher, which binds arguments by name."""

from __future__ import annotations

import pytest

from ptxforge import arch, jit, kernels
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.ptx import KernelBuilder, LaunchShape, TensorMap, addr
from ptxforge.runtime.launch import Launcher, launch_attributes


def two_parameter_kernel(name: str = "two_params") -> KernelBuilder:
    k = KernelBuilder(name, target="sm_90a", max_threads=32)
    out, value = k.param("out", "u64"), k.param("value", "u32")
    ptr, v = k.reg("u64", "out_ptr"), k.reg("u32", "v")
    k.ld_param(ptr, out)
    k.ld_param(v, value)
    k.st(addr(ptr), v)
    return k


def launcher_of(k: KernelBuilder) -> Launcher:
    return Launcher(0, k.params, k.name, k.launch)  # no function: only binding is tested


def test_arguments_are_bound_by_name():
    launch = launcher_of(two_parameter_kernel())
    with pytest.raises(TypeError, match=r"^two_params\(\) missing 1 required keyword-only "
                                        r"argument: 'value'$"):
        launch((1, 1, 1), 0, out=0)
    with pytest.raises(TypeError, match=r"^two_params\(\) got an unexpected keyword argument "
                                        r"'valeu'$"):
        launch((1, 1, 1), 0, out=0, valeu=1)
    with pytest.raises(TypeError, match=r"^two_params\(\) takes 3 positional arguments"):
        launch((1, 1, 1), 0, 0, 1)  # positional arguments are not taken


def test_a_value_of_the_wrong_type_names_the_parameters():
    launch = launcher_of(two_parameter_kernel())
    with pytest.raises(TypeError, match=r"^two_params takes \(out: u64, value: u32\); packing "
                                        r"the arguments failed: "):
        launch((1, 1, 1), 0, out=0, value="seven")


@pytest.mark.parametrize("names", [("stream",), ("state", "x"), ("launch", "encode"), ("in",)])
def test_reserved_parameter_names_are_refused(names):
    """The generated call's own names (a parameter would shadow them) and Python keywords."""
    k = KernelBuilder("clash", target="sm_90a", max_threads=32)
    for name in names:
        k.param(name, "u64")
    taken = ", ".join(sorted(n for n in names if n != "x"))
    with pytest.raises(ValueError, match=f"^clash: a kernel parameter may not be named {taken}: "):
        launcher_of(k)


def test_launch_attributes():
    assert launch_attributes(LaunchShape(128)) == []
    assert launch_attributes(LaunchShape(128, cluster=2, cooperative=True, programmatic=True)) == [
        (4, 2 | (1 << 32), 1), (2, 1, 0), (6, 1, 0)]  # cluster {2, 1, 1}, cooperative, PDL


def test_the_kernel_s_launch_shape_and_parameters_reach_the_compiled_kernel(monkeypatch):
    monkeypatch.setattr(jit, "_memory", {})
    monkeypatch.setenv("PTXFORGE_DISABLE_CACHE", "1")
    plain, wide = two_parameter_kernel(), two_parameter_kernel()
    wide.launch = LaunchShape(32, shared_bytes=1024)
    first, second = jit.build(plain), jit.build(wide)
    assert first.launch == LaunchShape(32) and second.launch == LaunchShape(32, 1024)
    assert first is not second and first.cubin == second.cubin  # the same PTX, two shapes
    assert jit.build(two_parameter_kernel()) is first
    assert [p.name for p in first.params] == ["out", "value"]


def test_tensor_map_box_bytes():
    assert TensorMap("float8_e4m3fn", (128, 64), swizzle=128).box_bytes == 128 * 64
    assert TensorMap("bfloat16", (64, 128, 1)).box_bytes == 64 * 128 * 2
    assert TensorMap("float32", (128, 1)).box_bytes == 512


def _gemm_configs():
    a = arch.get("sm_90a")
    for name in ("fp8_gemm_nt", "bf16_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous",
                 "m_grouped_fp8_gemm_nt_masked"):
        spec = kernels.get(name)
        for options in spec.variants:
            yield pytest.param(spec.config(a, **options), id=f"{name}-{options}")
    yield pytest.param(gemm.make_config(a, GemmProblem(1000, 640, epilogue=("accumulate",)), 128,
                                        160), id="accumulate")


@pytest.mark.parametrize("cfg", list(_gemm_configs()))
def test_gemm_tensor_maps_are_the_kernel_s_parameters_and_its_expect_tx(cfg):
    """The boxes the launch encodes are the ones the kernel declares, and one stage's
    expect-tx count is what those boxes deliver: the shared-memory plan's stage bytes."""
    k = gemm.generate(cfg)
    declared = {p.name: p.tensor_map for p in k.params if p.type == "tensormap"}
    assert declared == cfg.tensor_maps
    assert k.launch == LaunchShape(cfg.threads, cfg.dynamic_shared_bytes, cfg.multicast)
    assert cfg.tx_bytes == cfg.a_stage_bytes + cfg.b_stage_bytes + cfg.sa_stage_bytes
    expect_tx = [line for line in k.ptx().splitlines() if "expect_tx" in line]
    assert expect_tx and all(line.endswith(f", {cfg.tx_bytes};") for line in expect_tx)
    d = cfg.tensor_maps["tmap_d"]
    assert d.box[1] == 64 and d.box[0] == cfg.d_box_cols and d.swizzle == cfg.d_swizzle
