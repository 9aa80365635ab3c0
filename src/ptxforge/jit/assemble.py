"""PTX -> cubin with the fastest assembler available.

Three assemblers, tried in this order unless ``PTXFORGE_ASSEMBLER`` names one:

- ``ptxas``: PTXFORGE_PTXAS when set (then that one or an error, never another), else the
  first found on PATH, under CUDA_HOME or in the ``nvidia-cuda-nvcc`` wheel. First because
  of the code it makes: from the same PTX, nvJitLink 13.0 doubled every shuffle of the
  quantization kernels behind WARPSYNC divergence guards that ptxas 13.0 leaves out
  (docs/performance.md). Each run is a process stopped after PTXFORGE_ASSEMBLE_TIMEOUT.
- ``nvjitlink``: NVIDIA's in-process JIT linker (``cuda.bindings.nvjitlink``); no process
  start (13 ms against 20 ms for a ptxas process on a small kernel, 2-core machine).
- ``driver``: the CUDA driver's own PTX JIT (``cuLink*``); needs a GPU.

Every assembler runs ptxas's verbose mode; its report gives the kernel's resources. One
that cannot run here raises AssemblerUnavailable, whose one line says what to install.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from .. import settings


class AssemblyError(RuntimeError):
    """The assembler refused the PTX (the message quotes its log and the PTX lines it names),
    or ran past ``PTXFORGE_ASSEMBLE_TIMEOUT`` and was stopped."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log

    @classmethod
    def rejected(cls, assembler: str, log: str, ptx: str) -> "AssemblyError":
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
        return cls(text, log)


class AssemblerUnavailable(RuntimeError):
    """The assembler asked for cannot run here (or, when none was named, no assembler can);
    the one-line message says what is missing and how to install it."""


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

    def assemble(self, ptx: str, target: str, kernel: str = "kernel") -> tuple[bytes, str]:
        """Return (cubin, verbose log) for the PTX of ``kernel``; raise AssemblyError on
        failure."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{self.name} {self.version}"


# What to install when an assembler is missing: the CUDA 13.0 line, as on the GPU machines.
INSTALL_PTXAS = 'pip install "nvidia-cuda-nvcc==13.0.*"'
INSTALL_NVJITLINK = 'pip install "nvidia-nvjitlink==13.0.*"'


def _run(command: list[str], timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr) of a tool run in a process group of its own, so that on
    timeout the whole group is killed (subprocess.TimeoutExpired is raised then)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended just now
            pass
        proc.communicate()
        raise
    return proc.returncode, out + err


class PtxasAssembler(Assembler):
    name = "ptxas"

    def __init__(self, path: str):
        self.path = path
        timeout = settings.assemble_timeout()
        try:
            code, out = _run([path, "--version"], timeout)
        except subprocess.TimeoutExpired:
            raise AssemblerUnavailable(f"{path} --version did not answer within {timeout:g} s "
                                       f"(PTXFORGE_ASSEMBLE_TIMEOUT)") from None
        except OSError as exc:
            raise AssemblerUnavailable(f"{path} cannot run: {exc.strerror}") from None
        m = re.search(r"V(\d+\.\d+\.\d+)", out)
        if code != 0 or m is None:
            first_line = (out.strip().splitlines() or [""])[0]
            raise AssemblerUnavailable(f"{path} is not a ptxas: `--version` printed "
                                       f"{first_line[:80]!r}")
        self.version = m.group(1)

    def assemble(self, ptx: str, target: str, kernel: str = "kernel") -> tuple[bytes, str]:
        timeout = settings.assemble_timeout()
        with tempfile.TemporaryDirectory(prefix="ptxforge-") as tmp:
            src, dst = os.path.join(tmp, f"{kernel}.ptx"), os.path.join(tmp, f"{kernel}.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            try:
                code, log = _run([self.path, f"-arch={target}", "-v", src, "-o", dst], timeout)
            except subprocess.TimeoutExpired:
                raise AssemblyError(f"ptxas {self.version} did not finish assembling {kernel} "
                                    f"within {timeout:g} s and was stopped (the limit is "
                                    f"PTXFORGE_ASSEMBLE_TIMEOUT)") from None
            if code != 0:
                raise AssemblyError.rejected(f"ptxas {self.version}", log, ptx)
            with open(dst, "rb") as f:
                return f.read(), log


class NvJitLinkAssembler(Assembler):
    name = "nvjitlink"

    def __init__(self):
        from cuda.bindings import nvjitlink

        try:
            self.version = "%d.%d" % nvjitlink.version()
        except RuntimeError:  # cuda.pathfinder: the library is not installed
            raise AssemblerUnavailable(f"the nvJitLink library is not installed: "
                                       f"{INSTALL_NVJITLINK}") from None
        self._nvjitlink = nvjitlink

    def assemble(self, ptx: str, target: str, kernel: str = "kernel") -> tuple[bytes, str]:
        nvj = self._nvjitlink
        data = ptx.encode()
        handle = nvj.create(2, [f"-arch={target}", "-verbose"])
        try:
            try:  # PTX is compiled in add_data already, linked in complete
                nvj.add_data(handle, nvj.InputType.PTX, data, len(data), f"{kernel}.ptx")
                nvj.complete(handle)
            except nvj.nvJitLinkError:
                raise AssemblyError.rejected(f"nvJitLink {self.version}",
                                             self._log(handle, error=True), ptx) from None
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
    """The driver's PTX JIT through cuLink* (on device 0): the fallback when no toolkit is
    installed."""

    name = "driver"

    def __init__(self):
        from ..runtime import driver

        try:
            self.version = driver.driver_version()
        except driver.CudaError as exc:  # cuInit: no GPU, or a driver too old
            raise AssemblerUnavailable(f"the driver's PTX JIT needs a GPU: {exc}") from None
        except RuntimeError:  # cuda.pathfinder found no libcuda
            raise AssemblerUnavailable("the driver's PTX JIT needs the NVIDIA driver "
                                       "(libcuda.so.1), which is not installed") from None
        self._driver = driver

    def assemble(self, ptx: str, target: str, kernel: str = "kernel") -> tuple[bytes, str]:
        driver, cu = self._driver, self._driver.bindings()
        log_size = 1 << 16
        info, error = bytearray(log_size), bytearray(log_size)
        jit = cu.CUjit_option
        options = [jit.CU_JIT_INFO_LOG_BUFFER, jit.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                   jit.CU_JIT_ERROR_LOG_BUFFER, jit.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
                   jit.CU_JIT_LOG_VERBOSE]
        values = [info, log_size, error, log_size, 1]
        with driver.ContextScope(0):
            state = driver.call("cuLinkCreate", len(options), options, values)
            try:
                data = ptx.encode() + b"\0"
                err, = cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, data,
                                        len(data), f"{kernel}.ptx".encode(), 0, [], [])
                if int(err) == 0:
                    err, cubin_ptr, size = cu.cuLinkComplete(state)
                if int(err) != 0:
                    raise AssemblyError.rejected(f"driver {self.version}",
                                                 error.rstrip(b"\0").decode(errors="replace"), ptx)
                cubin = ctypes.string_at(int(cubin_ptr), size)
            finally:
                driver.call("cuLinkDestroy", state)
        return cubin, info.rstrip(b"\0").decode(errors="replace")


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_cuda_tool(name: str) -> str | None:
    """A CUDA command-line tool (ptxas, cuobjdump, nvdisasm) on PATH, under CUDA_HOME,
    CUDA_PATH or /usr/local/cuda, or in an ``nvidia-*`` pip wheel's bin folder."""
    candidates = [shutil.which(name)]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", name))
    for site in sys.path:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", name)))
    return next((path for path in candidates if path and _executable(path)), None)


def find_ptxas(explicit: str | None = None) -> str | None:
    """``explicit`` (PTXFORGE_PTXAS by default), which must then be an executable file,
    else the first ptxas ``find_cuda_tool`` finds, else None."""
    explicit = explicit or settings.ptxas_path()
    if explicit is None:
        return find_cuda_tool("ptxas")
    if not _executable(explicit):
        raise AssemblerUnavailable(f"PTXFORGE_PTXAS is {explicit!r}, which is not an "
                                   f"executable file")
    return explicit


def get_assembler(name: str | None = None) -> Assembler:
    """The named assembler, else PTXFORGE_ASSEMBLER's, else the first that works; raises
    AssemblerUnavailable with one line saying what is missing."""
    return _assembler(name or settings.assembler_name(), settings.ptxas_path())


@functools.lru_cache(maxsize=None)
def _assembler(name: str | None, ptxas: str | None) -> Assembler:
    if name is not None:
        return _make(name, ptxas)
    if ptxas is not None:  # the user named a ptxas: it is that one or an error, no fallback
        return _make("ptxas", ptxas)
    failures = []
    for candidate in ("ptxas", "nvjitlink", "driver"):
        try:
            return _make(candidate, None)
        except AssemblerUnavailable as exc:  # the next one may work; report all if none does
            failures.append(f"{candidate}: {exc}")
    raise AssemblerUnavailable("no PTX assembler is available (" + "; ".join(failures) + ")")


def _make(name: str, ptxas: str | None) -> Assembler:
    if name == "nvjitlink":
        return NvJitLinkAssembler()
    if name == "driver":
        return DriverAssembler()
    path = find_ptxas(ptxas)
    if path is None:
        raise AssemblerUnavailable(f"no ptxas on PATH, under CUDA_HOME or /usr/local/cuda, or in "
                                   f"a pip wheel: {INSTALL_PTXAS}")
    return PtxasAssembler(path)
