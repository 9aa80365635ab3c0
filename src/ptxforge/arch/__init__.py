"""Architecture descriptions: one TOML data file per compilation target, read here.

Kernels and heuristics take every hardware number (SM count, shared-memory limits,
tensor-core shapes, bandwidth) from an ``Arch``, never from constants of their own.

    arch = ptxforge.arch.current()        # the GPU torch sees, or PTXFORGE_ARCH
    arch = ptxforge.arch.get("sm_90a", "H200")

``PTXFORGE_ARCH`` overrides detection: ``sm_90a`` or ``sm_90a:H200``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_TARGET_DIR = Path(__file__).with_name("targets")


@dataclass(frozen=True)
class Device:
    name: str
    sm_count: int
    l2_bytes: int
    memory_bytes: int
    memory_bandwidth_gbs: float
    peak_tflops: dict = field(hash=False)


@dataclass(frozen=True)
class Arch:
    """One compilation target and the device it runs on."""

    target: str
    compute_capability: tuple
    ptx_version: str
    warp_size: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    shared_memory_per_sm: int
    max_shared_memory_per_block: int
    default_shared_memory_per_block: int  # a kernel's dynamic limit until it opts in to more
    shared_memory_reserved_per_block: int
    max_cluster_size: int
    max_grid: tuple  # CTAs in x, y, z
    features: dict = field(hash=False)
    mma: dict = field(hash=False)
    device: Device = field(hash=False)
    tma_alignment: int | None = None  # bytes; None on a target without TMA
    throughput: dict = field(hash=False, default_factory=dict)  # per SM per clock: cost models
    # family -> the kernel generation this target runs (kernels.gemm_generation); a family
    # missing here has no kernel on the target
    kernels: dict = field(hash=False, default_factory=dict)

    @property
    def sm_count(self) -> int:
        return self.device.sm_count

    def has(self, feature: str) -> bool:
        return bool(self.features.get(feature, False))

    def resident_ctas(self, threads: int, registers: int, shared_bytes: int = 0) -> int:
        """CTAs of a kernel that fit on one SM at once (threads, registers, shared memory).
        Registers are allocated per warp in units of 256, i.e. 8 per thread."""
        warps = -(-threads // self.warp_size)
        regs_per_warp = -(-max(registers, 1) * self.warp_size // 256) * 256
        limits = [self.max_threads_per_sm // (warps * self.warp_size),
                  self.registers_per_sm // (regs_per_warp * warps), self.max_blocks_per_sm]
        if shared_bytes:
            per_cta = shared_bytes + self.shared_memory_reserved_per_block
            limits.append(self.shared_memory_per_sm // per_cta)
        return max(min(limits), 0)

    def require(self, feature: str, what: str) -> None:
        """Raise a clear error when ``what`` needs a feature this target lacks."""
        if not self.has(feature):
            raise ValueError(
                f"{what} needs {feature}, which {self.target} ({self.device.name}) does not have")


def targets() -> list[str]:
    return sorted(p.stem for p in _TARGET_DIR.glob("*.toml"))


@functools.lru_cache(maxsize=None)
def _load(target: str) -> dict:
    path = _TARGET_DIR / f"{target}.toml"
    if not path.exists():
        raise ValueError(f"unknown target {target!r}; described targets: {', '.join(targets())}")
    with path.open("rb") as f:
        return tomllib.load(f)


@functools.lru_cache(maxsize=None)
def _target_by_cc() -> dict:
    """Compute capability -> the target whose data file describes it."""
    return {tuple(_load(target)["compute_capability"]): target for target in targets()}


@functools.lru_cache(maxsize=None)
def tma_alignment() -> int:
    """The bytes a TMA tensor's start address and strides must be a multiple of, for code
    that has no target at hand (the runtime's descriptor encoding, DeepGEMM's
    ``get_tma_aligned_size``): every described target with TMA gives the same number."""
    by_target = {t: get(t).tma_alignment for t in targets() if get(t).has("tma")}
    alignments = set(by_target.values())
    if len(alignments) != 1 or None in alignments:
        raise ValueError(f"every target with TMA needs one and the same tma_alignment, got "
                         f"{by_target}")
    return alignments.pop()


def get(target: str, device: str | None = None) -> Arch:
    """The description of ``target`` for the named device (first listed device if None)."""
    data = dict(_load(target))
    devices = data.pop("devices")
    chosen = devices[0]
    if device is not None:
        # A full board name contains a match string ("NVIDIA H100 80GB HBM3" ~ "H100 80GB
        # HBM3"); a short one given by hand is contained in one ("H100" ~ "H100 SXM").
        wanted = device.lower()
        matches = [d for d in devices
                   if any(m.lower() in wanted or wanted in m.lower() for m in d["match"])
                   or d["name"].lower() == wanted]
        if not matches:
            known = ", ".join(d["name"] for d in devices)
            raise ValueError(f"no device {device!r} in {target}'s description (known: {known})")
        chosen = matches[0]
    chosen = {k: v for k, v in chosen.items() if k != "match"}
    data["compute_capability"] = tuple(data["compute_capability"])
    data["max_grid"] = tuple(data["max_grid"])
    return Arch(**data, device=Device(**chosen))


@functools.lru_cache(maxsize=None)
def for_device(index: int) -> Arch:
    """The description matching CUDA device ``index``, with its measured SM count and L2 size."""
    import torch

    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    target_by_cc = _target_by_cc()
    if cc not in target_by_cc:
        raise ValueError(f"GPU {index} ({props.name}) has compute capability {cc[0]}.{cc[1]}; "
                         f"ptxforge describes {sorted(target_by_cc)}")
    target = target_by_cc[cc]
    try:
        arch = get(target, props.name)
    except ValueError:
        arch = get(target)  # an unlisted board of a known target: use its family's numbers
    # What the device reports wins over the data file.
    device = replace(arch.device, name=props.name, sm_count=props.multi_processor_count,
                     l2_bytes=props.L2_cache_size, memory_bytes=props.total_memory)
    return replace(arch, device=device)


def current() -> Arch:
    """``PTXFORGE_ARCH`` if set, else the current CUDA device's description."""
    override = os.environ.get("PTXFORGE_ARCH")
    if override:
        target, _, device = override.partition(":")
        return get(target, device or None)
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible; set PTXFORGE_ARCH (e.g. sm_90a) to target one")
    return for_device(torch.cuda.current_device())


__all__ = ["Arch", "Device", "current", "for_device", "get", "targets", "tma_alignment"]
