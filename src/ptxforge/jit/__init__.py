"""The JIT: PTX text -> cubin (assembled or cached) -> module loaded on a device -> launch.

    compiled = jit.build(kernel_builder)      # memory cache, then disk cache, then assemble
    launch = compiled.launcher(device_index)  # loaded once per device (ptxforge.runtime)
    launch(grid, stream, x=x_ptr, rows=m)     # per call, bound by parameter name

The disk cache key is a hash of the PTX text, the assembler and its version, and the
target, so a change to any generator that changes its PTX is a new entry. In memory the
kernel's parameters and launch shape are part of the key too: they are not in the PTX.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from .. import settings
from .assemble import AssemblerUnavailable, AssemblyError, Resources, get_assembler
from .cache import DiskCache, cache_key


class SpillError(RuntimeError):
    """PTXFORGE_DEBUG is set and the kernel spills registers to local memory."""


@dataclass
class CompiledKernel:
    name: str
    target: str
    ptx: str
    cubin: bytes
    resources: Resources
    params: list
    launch: object  # the kernel's LaunchShape
    assembler: str
    key: str
    source: str  # where the cubin came from when first built: "assembled" or "disk"
    seconds: float
    log: str = ""
    _modules: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def launcher(self, device_index: int = 0, *, programmatic: bool = False):
        """A launcher of the kernel with its own LaunchShape, on ``device_index``;
        ``programmatic``: with programmatic dependent launch as well (the kernel may start
        while the previous one on its stream finishes, and waits with
        griddepcontrol.wait)."""
        shape = replace(self.launch, programmatic=True) if programmatic else self.launch
        return self.load(device_index).launcher(shape)

    def load(self, device_index: int = 0):
        """The module loaded on ``device_index`` (loaded on first use)."""
        module = self._modules.get(device_index)
        if module is None:
            from ..runtime import LoadedModule

            with self._lock:
                module = self._modules.get(device_index)
                if module is None:
                    module = LoadedModule(self.cubin, self.name, device_index, self.params,
                                          self.target)
                    self._modules[device_index] = module
        return module


_memory: dict[tuple, CompiledKernel] = {}
_memory_lock = threading.Lock()


def build(kernel, *, assembler: str | None = None) -> CompiledKernel:
    """Assemble a ``KernelBuilder``'s PTX, or fetch it from the memory or disk cache."""
    start = time.perf_counter()
    ptx = kernel.ptx()
    asm = get_assembler(assembler)
    key = cache_key("ptxforge-jit-1", ptx, asm.name, asm.version, kernel.target)
    memory_key = (key, tuple(kernel.params), kernel.launch)
    hit = _memory.get(memory_key)
    if hit is not None:
        _refuse_spills_in_debug(hit.name, hit.resources)
        return hit
    disk = None if settings.cache_disabled() else DiskCache(settings.cache_dir())
    cached = disk.get(key) if disk is not None else None
    resources = _cached_resources(cached)
    if resources is not None:
        cubin, log, source = cached[0], cached[1].get("log", ""), "disk"
    else:
        cubin, log = asm.assemble(ptx, kernel.target, kernel.name)
        resources, source = Resources.from_log(log), "assembled"
        if disk is not None:
            _write_to_disk(disk.put, key, cubin, {"name": kernel.name, "target": kernel.target,
                                                  "assembler": repr(asm),
                                                  "resources": resources.as_dict(), "log": log})
    _refuse_spills_in_debug(kernel.name, resources)
    for line in log.splitlines():
        # ptxas reports some slow paths only as "info" (e.g. C7514: wgmma serialised).
        if "Potential Performance Loss" in line:
            warnings.warn(f"{kernel.name}: {line.split(':', 1)[-1].strip()}")
    if settings.debug():  # kept even when the cache is disabled
        _write_to_disk((disk or DiskCache(settings.cache_dir())).keep_ptx, kernel.name, key, ptx)
    compiled = CompiledKernel(
        name=kernel.name, target=kernel.target, ptx=ptx, cubin=cubin, resources=resources,
        params=list(kernel.params), launch=kernel.launch, assembler=repr(asm), key=key,
        source=source, seconds=time.perf_counter() - start, log=log)
    with _memory_lock:
        return _memory.setdefault(memory_key, compiled)


def _cached_resources(cached) -> Resources | None:
    """The resource report of a disk-cache hit; None for a miss or an entry without one."""
    if cached is None:
        return None
    try:
        return Resources(**cached[1]["resources"])
    except (KeyError, TypeError):
        return None


_cache_write_warned = False


def _write_to_disk(write, *args) -> None:
    """``write(*args)``, a DiskCache method: a read-only, full or misplaced cache directory
    costs one warning per process, never the build."""
    global _cache_write_warned
    try:
        write(*args)
    except OSError as exc:
        if not _cache_write_warned:
            warnings.warn(f"ptxforge: cannot write the kernel cache ({exc}); going on without it")
            _cache_write_warned = True


def _refuse_spills_in_debug(name: str, resources: Resources) -> None:
    if settings.debug() and resources.spills:
        raise SpillError(f"{name} spills {resources.spill_stores} bytes to local memory and "
                         f"reloads {resources.spill_loads} (PTXFORGE_DEBUG is set)")


def precompile(makers, *, workers: int | None = None, progress: bool = True) -> list[CompiledKernel]:
    """Build many kernel variants in parallel. ``makers`` are zero-argument callables that
    return a ``KernelBuilder``; assembly runs in threads (the assemblers release the GIL)."""
    makers = list(makers)
    workers = workers or os.cpu_count() or 1
    done, results = 0, [None] * len(makers)

    def one(i):
        results[i] = build(makers[i]())
        return i

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i in pool.map(one, range(len(makers))):
            done += 1
            if progress:
                _progress(done, len(makers), results[i].name)
    if progress and makers:
        sys.stderr.write("\n")
    return results


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:<40}")
    sys.stderr.flush()


__all__ = ["AssemblerUnavailable", "AssemblyError", "CompiledKernel", "Resources", "SpillError",
           "build", "precompile", "get_assembler"]
