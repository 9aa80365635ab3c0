"""PTX -> cubin with the fastest assembler available.

Three assemblers, tried in this order unless ``PTXFORGE_ASSEMBLER`` names one:

- ``ptxas``: the assembler found through PTXFORGE_PTXAS, PATH, CUDA_HOME or the
  ``nvidia-cuda-nvcc`` wheel. First because of the code it makes: from the same PTX,
  nvJitLink 13.0 doubled every shuffle of the quantization kernels behind WARPSYNC
  divergence guards that ptxas 13.0 leaves out (docs/performance.md).
- ``nvjitlink``: NVIDIA's in-process JIT linker (``cuda.bindings.nvjitlink``); no process
  start (13 ms against 20 ms for a ptxas process on a small kernel, 2-core machine).
- ``driver``: the CUDA driver's own PTX JIT (``cuLink*``); needs a GPU.

Every assembler runs ptxas's verbose mode; its report gives the kernel's resources.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from . import settings


class AssemblyError(RuntimeError):
    """The assembler refused the PTX. The message quotes its log and the PTX lines it names."""

    def __init__(self, assembler: str, log: str, ptx: str):
        lines = ptx.splitlines()
        named = {int(n) for n in re.findall(r"line (\d+)", log)}
        # Each named line with one line of context either side; overlapping windows merge.
        shown = sorted({i for n in named for i in (n - 1, n, n + 1) if 1 <= i <= len(lines)})
        quoted = []
        for i in shown:
            if quoted and i != previous + 1:
                quoted.append("   ...")
            quoted.append(f"{'>>' if i in named else '  '} {i:5d} | {lines[i - 1]}")
            previous = i
        text = f"{assembler} rejected the PTX:\n{log.strip()}"
        if quoted:
            text += "\n\nat:\n" + "\n".join(quoted)
        super().__init__(text)
        self.log = log


@dataclass(frozen=True)
class Resources:
    """What one kernel uses, from ptxas's verbose report."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_shared: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @classmethod
    def from_log(cls, log: str) -> "Resources":
        def number(pattern: str) -> int:
            m = re.search(pattern, log)
            return int(m.group(1)) if m else 0

        return cls(
            registers=number(r"Used (\d+) registers"),
            spill_stores=number(r"(\d+) bytes spill stores"),
            spill_loads=number(r"(\d+) bytes spill loads"),
            stack_frame=number(r"(\d+) bytes stack frame"),
            static_shared=number(r"(\d+) bytes smem"),
        )

    def as_dict(self) -> dict:
        return {"registers": self.registers, "spill_stores": self.spill_stores,
                "spill_loads": self.spill_loads, "stack_frame": self.stack_frame,
                "static_shared": self.static_shared}


class Assembler:
    name: str
    version: str

    def assemble(self, ptx: str, target: str) -> tuple[bytes, str]:
        """Return (cubin, verbose log); raise AssemblyError on failure."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{self.name} {self.version}"


class PtxasAssembler(Assembler):
    name = "ptxas"

    def __init__(self, path: str):
        self.path = path
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True)
        m = re.search(r"V(\d+\.\d+\.\d+)", out.stdout)
        self.version = m.group(1) if m else out.stdout.strip().splitlines()[-1]

    def assemble(self, ptx: str, target: str) -> tuple[bytes, str]:
        with tempfile.TemporaryDirectory(prefix="ptxforge-") as tmp:
            src, dst = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            proc = subprocess.run([self.path, f"-arch={target}", "-v", src, "-o", dst],
                                  capture_output=True, text=True)
            log = proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise AssemblyError(f"ptxas {self.version}", log, ptx)
            with open(dst, "rb") as f:
                return f.read(), log


class NvJitLinkAssembler(Assembler):
    name = "nvjitlink"

    def __init__(self):
        from cuda.bindings import nvjitlink

        self._nvjitlink = nvjitlink
        self.version = "%d.%d" % nvjitlink.version()

    def assemble(self, ptx: str, target: str) -> tuple[bytes, str]:
        nvj = self._nvjitlink
        data = ptx.encode()
        handle = nvj.create(2, [f"-arch={target}", "-verbose"])
        try:
            try:  # PTX is compiled in add_data already, linked in complete
                nvj.add_data(handle, nvj.InputType.PTX, data, len(data), "kernel.ptx")
                nvj.complete(handle)
            except nvj.nvJitLinkError:
                raise AssemblyError(f"nvJitLink {self.version}", self._log(handle, error=True),
                                    ptx) from None
            cubin = bytearray(nvj.get_linked_cubin_size(handle))
            nvj.get_linked_cubin(handle, cubin)
            return bytes(cubin), self._log(handle)
        finally:
            nvj.destroy(handle)

    def _log(self, handle, error: bool = False) -> str:
        nvj = self._nvjitlink
        size = (nvj.get_error_log_size if error else nvj.get_info_log_size)(handle)
        buf = bytearray(size)
        (nvj.get_error_log if error else nvj.get_info_log)(handle, buf)
        return buf.rstrip(b"\0").decode(errors="replace")


class DriverAssembler(Assembler):
    """The driver's PTX JIT through cuLink*: the fallback when no toolkit is installed."""

    name = "driver"

    def __init__(self):
        from . import driver

        self._driver = driver
        self.version = driver.driver_version()

    def assemble(self, ptx: str, target: str) -> tuple[bytes, str]:
        return self._driver.link_ptx(ptx, target)


def find_cuda_tool(name: str, explicit: str | None = None) -> str | None:
    """A CUDA command-line tool (ptxas, cuobjdump, nvdisasm): ``explicit``, then PATH,
    CUDA_HOME, /usr/local/cuda, then the ``nvidia-*`` pip wheels' bin folders."""
    candidates = [explicit, shutil.which(name)]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", name))
    for site in sys.path:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", name)))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_ptxas() -> str | None:
    return find_cuda_tool("ptxas", settings.ptxas_path())


def _make(name: str) -> Assembler:
    if name == "nvjitlink":
        return NvJitLinkAssembler()
    if name == "ptxas":
        path = find_ptxas()
        if path is None:
            raise FileNotFoundError("no ptxas found (PTXFORGE_PTXAS, PATH, CUDA_HOME, "
                                    "/usr/local/cuda, or `pip install nvidia-cuda-nvcc`)")
        return PtxasAssembler(path)
    return DriverAssembler()


@functools.lru_cache(maxsize=None)
def get_assembler(name: str | None = None) -> Assembler:
    """The named assembler, else PTXFORGE_ASSEMBLER's, else the first that works."""
    name = name or settings.assembler_name()
    if name is not None:
        return _make(name)
    failures = []
    for candidate in ("ptxas", "nvjitlink", "driver"):
        try:
            return _make(candidate)
        except Exception as exc:  # the next one may work; report all if none does
            failures.append(f"{candidate}: {exc}")
    raise RuntimeError("no PTX assembler is available:\n  " + "\n  ".join(failures))
