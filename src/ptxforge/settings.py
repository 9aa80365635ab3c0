"""Every ``PTXFORGE_*`` environment knob, read in this one place.

| variable                  | meaning                                                          | default                     |
|---------------------------|------------------------------------------------------------------|-----------------------------|
| PTXFORGE_ARCH             | target (and device) for the CLI and ``arch.current()`` without a GPU: ``sm_90a`` or ``sm_90a:H200``; the ops always build for the GPU they run on | the current GPU             |
| PTXFORGE_ASSEMBLER        | ``ptxas``, ``nvjitlink`` or ``driver``                           | first available, that order |
| PTXFORGE_PTXAS            | path of the ptxas to use (an error if it is not an executable)   | PATH, CUDA_HOME, pip wheel  |
| PTXFORGE_ASSEMBLE_TIMEOUT | seconds a ptxas run may take before it is stopped                | 120                         |
| PTXFORGE_CACHE_DIR        | on-disk cubin cache                                              | $XDG_CACHE_HOME/ptxforge    |
| PTXFORGE_DISABLE_CACHE    | ``1``: never read or write the disk cache                        | 0                           |
| PTXFORGE_DEBUG            | ``1``: refuse kernels that spill to local memory; keep PTX files | 0                           |
| PTXFORGE_NATIVE_LAUNCH    | ``0``: launch through ctypes, not the C launcher (native.c)      | 1                           |
| PTXFORGE_PDL              | ``1``: an op's ``pdl=None`` means a programmatic launch (PDL)    | 0                           |

(``PTXFORGE_ARCH`` is read by ``ptxforge.arch``; the others here. The ops read
``PTXFORGE_PDL`` once per process, at their first launch.)
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return value not in ("0", "false", "no") if value else default


def assembler_name() -> str | None:
    value = os.environ.get("PTXFORGE_ASSEMBLER", "").strip().lower()
    if value and value not in ("nvjitlink", "ptxas", "driver"):
        raise ValueError(f"PTXFORGE_ASSEMBLER must be nvjitlink, ptxas or driver, got {value!r}")
    return value or None


def ptxas_path() -> str | None:
    return os.environ.get("PTXFORGE_PTXAS") or None


def assemble_timeout() -> float:
    value = os.environ.get("PTXFORGE_ASSEMBLE_TIMEOUT", "").strip()
    if not value:
        return 120.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"PTXFORGE_ASSEMBLE_TIMEOUT must be a positive number of seconds, "
                         f"got {value!r}")
    return seconds


def cache_dir() -> Path:
    explicit = os.environ.get("PTXFORGE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ptxforge"


def cache_disabled() -> bool:
    return _flag("PTXFORGE_DISABLE_CACHE")


def debug() -> bool:
    return _flag("PTXFORGE_DEBUG")


def native_launch() -> bool:
    return _flag("PTXFORGE_NATIVE_LAUNCH", default=True)


def pdl() -> bool:
    return _flag("PTXFORGE_PDL")
