"""The architecture data files, PTXFORGE_ARCH, and the occupancy arithmetic."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ptxforge import arch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

TARGET_DIR = Path(arch.__file__).with_name("targets")


def devices_of(target: str) -> list[str]:
    with (TARGET_DIR / f"{target}.toml").open("rb") as f:
        return [d["name"] for d in tomllib.load(f)["devices"]]


def test_targets_lists_every_data_file():
    assert {"sm_80", "sm_89", "sm_90a"} <= set(arch.targets())
    assert arch.targets() == sorted(p.stem for p in TARGET_DIR.glob("*.toml"))


@pytest.mark.parametrize("target", arch.targets())
def test_every_target_and_device_loads(target):
    names = devices_of(target)
    assert names
    assert arch.get(target).device.name == names[0]
    for name in names:
        a = arch.get(target, name)
        assert a.target == target and a.device.name == name
        assert a.sm_count > 0 and a.device.memory_bandwidth_gbs > 0
        assert a.device.l2_bytes > 0 and a.device.memory_bytes > 0
        assert a.device.peak_tflops.get("bf16", 0) > 0
    assert a.warp_size == 32
    assert 0 < a.max_shared_memory_per_block <= a.shared_memory_per_sm
    assert a.max_threads_per_block <= a.max_threads_per_sm


def test_compute_capabilities_match_the_targets():
    assert arch.get("sm_80").compute_capability == (8, 0)
    assert arch.get("sm_89").compute_capability == (8, 9)
    assert arch.get("sm_90a").compute_capability == (9, 0)


def test_a_gpu_s_compute_capability_picks_the_target_whose_file_names_it(monkeypatch):
    def properties(index):
        return SimpleNamespace(major=9, minor=0, name="NVIDIA H200", multi_processor_count=132,
                               L2_cache_size=62914560, total_memory=150323855360)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    arch.for_device.cache_clear()
    try:
        described = arch.for_device(0)
        assert described.target == "sm_90a" and described.device.name == "NVIDIA H200"
    finally:
        arch.for_device.cache_clear()


def test_a_gpu_no_file_describes_is_named_with_the_described_ones(monkeypatch):
    def properties(index):
        return SimpleNamespace(major=7, minor=5, name="Tesla T4")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    arch.for_device.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"Tesla T4\) has compute capability 7\.5; ptxforge "
                                             r"describes \[\(8, 0\), \(8, 9\), \(9, 0\)\]"):
            arch.for_device(0)
    finally:
        arch.for_device.cache_clear()


@pytest.mark.parametrize("target", arch.targets())
def test_launch_limits_by_target(target):
    a = arch.get(target)
    assert a.max_grid == (2**31 - 1, 65535, 65535)
    assert a.default_shared_memory_per_block == 48 * 1024 <= a.max_shared_memory_per_block
    assert (a.tma_alignment is not None) == a.has("tma")


def test_tma_alignment_is_the_tma_targets():
    assert arch.tma_alignment() == arch.get("sm_90a").tma_alignment == 16
    assert arch.get("sm_80").tma_alignment is None


def test_features_by_target():
    assert not arch.get("sm_80").has("fp8")
    assert arch.get("sm_89").has("fp8") and not arch.get("sm_89").has("wgmma")
    hopper = arch.get("sm_90a")
    assert all(hopper.has(f) for f in ("tma", "wgmma", "setmaxnreg", "clusters", "fp8"))
    assert not hopper.has("no_such_feature")


@pytest.mark.parametrize("device, expected", [
    ("H200", "H200"),
    ("H100 SXM", "H100 SXM"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),   # torch's name for the SXM board
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("H100", "H100 SXM"),
])
def test_ptxforge_arch_selects_the_device(device, expected, monkeypatch):
    monkeypatch.setenv("PTXFORGE_ARCH", f"sm_90a:{device}")
    current = arch.current()
    assert current.target == "sm_90a" and current.device.name == expected


def test_ptxforge_arch_without_a_device_takes_the_first(monkeypatch):
    monkeypatch.setenv("PTXFORGE_ARCH", "sm_89")
    assert arch.current().device.name == "L40S"


@pytest.mark.skipif(torch.cuda.is_available(), reason="detects the GPU instead")
def test_current_without_gpu_or_override_says_what_to_set(monkeypatch):
    monkeypatch.delenv("PTXFORGE_ARCH", raising=False)
    with pytest.raises(RuntimeError, match="PTXFORGE_ARCH"):
        arch.current()


# 65536 registers per SM, allocated per warp in units of 256; 2048 threads, 32 CTAs and
# 228 KiB of shared memory (1 KiB reserved per CTA) per SM.
@pytest.mark.parametrize("threads, registers, shared_bytes, ctas", [
    (128, 167, 0, 3),          # 168 x 32 x 4 = 21504 registers per CTA
    (256, 64, 0, 4),           # registers: 16384 per CTA
    (128, 32, 0, 16),          # threads: 2048 / 128
    (32, 8, 0, 32),            # the CTA limit
    (1024, 32, 0, 2),          # threads
    (128, 32, 100_000, 2),     # shared: 233472 // (100000 + 1024)
    (128, 32, 1040, 16),       # shared memory is not the limit
    (128, 32, 232_448, 1),     # the largest block
    (100, 32, 0, 16),          # 100 threads take 4 whole warps
])
def test_resident_ctas_on_sm90a(threads, registers, shared_bytes, ctas):
    assert arch.get("sm_90a").resident_ctas(threads, registers, shared_bytes) == ctas


def test_resident_ctas_is_zero_when_nothing_fits():
    hopper = arch.get("sm_90a")
    assert hopper.resident_ctas(1024, 255) == 0
    assert hopper.resident_ctas(128, 32, hopper.shared_memory_per_sm) == 0


def test_require_names_the_feature():
    ampere = arch.get("sm_80")
    with pytest.raises(ValueError, match="TMA loads needs tma") as info:
        ampere.require("tma", "TMA loads")
    assert "sm_80" in str(info.value) and "A100" in str(info.value)
    arch.get("sm_90a").require("tma", "TMA loads")  # present: no error
