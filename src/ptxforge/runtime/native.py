"""The launch path's C half (``native.c``): compiled with the system C compiler at first
use, cached, loaded. ``module()`` is None where that cannot be done (no compiler, no
Python headers, a failed build: one warning) or ``PTXFORGE_NATIVE_LAUNCH=0`` says not to;
launches then go through ctypes and tensor maps through cuda.bindings, with the same
results.

The library is cached as ``<cache dir>/native/ptxforge_native.<key>.so``, the key a hash of
the C source and the Python ABI it is built for (``EXT_SUFFIX``). Like the cubin cache's
entries it is written to a temporary file and moved into place with ``os.replace``, so a
reader sees a whole file or none; a cached file that does not load is rebuilt. Where the
directory cannot be written, or the cache is disabled, it is built in a temporary
directory for this process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

from .. import settings

SOURCE = Path(__file__).with_name("native.c")
NAME = "ptxforge_native"  # native.c's PyInit_ function is named for it
BUILD_TIMEOUT = 120.0  # seconds a compiler run may take


class BuildError(Exception):
    """native.c could not be compiled or loaded; the message says why, in one line."""


_lock = threading.Lock()


def module():
    """The loaded extension, or None (the ctypes path). Built or loaded once per process."""
    with _lock:
        return _module()


@functools.lru_cache(maxsize=None)
def _module():
    if not settings.native_launch():
        return None
    try:
        return build(None if settings.cache_disabled() else settings.cache_dir() / "native")
    except (BuildError, OSError) as exc:  # OSError: no source, no writable directory at all
        warnings.warn(f"ptxforge: no native launcher ({exc}); launching through ctypes, a few "
                      f"microseconds slower per call")
        return None


def build(directory: Path | None):
    """Load native.c's library from ``directory``, compiling it there first when it is not
    built yet (None: in a temporary directory); return the module. Raises BuildError."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(f"ptxforge-native-1\n{suffix}\n{SOURCE.read_text()}".encode())
    name = f"{NAME}.{key.hexdigest()[:24]}.so"
    if directory is not None:
        path = Path(directory) / name
        if path.is_file():
            try:
                return _load(path)
            except BuildError:
                pass  # damaged or foreign: rebuilt below, like a damaged cubin entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _compile(path)
            return _load(path)
        except OSError:
            pass  # an unwritable directory: built for this process below
    with tempfile.TemporaryDirectory(prefix="ptxforge-native-") as scratch:
        path = Path(scratch) / name
        _compile(path)
        return _load(path)  # the loaded library outlives its file


def _compiler() -> list[str]:
    """The C compiler command: $CC where set, else the one Python was built with, else cc."""
    explicit = os.environ.get("CC", "").strip()
    candidates = [explicit] if explicit else [sysconfig.get_config_var("CC") or "", "cc"]
    for candidate in candidates:
        words = shlex.split(candidate)
        if words and shutil.which(words[0]):
            return words
    if explicit:
        raise BuildError(f"CC={explicit} is not an executable")
    raise BuildError(f"no C compiler ({' or '.join(c for c in candidates if c)} not found on "
                     f"PATH)")


def _compile(path: Path) -> None:
    """Compile native.c into ``path`` through a temporary file beside it and os.replace.
    Raises BuildError without a compiler or Python's headers or for a failed compiler run,
    OSError for an unwritable directory."""
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise BuildError(f"no Python.h in {include}: the Python development headers are "
                         f"not installed")
    compiler = _compiler()
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    command = [*compiler, "-shared", "-fPIC", "-O2", f"-I{include}", str(SOURCE), "-o", temporary]
    try:
        try:
            result = subprocess.run(command, capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildError(f"{compiler[0]} did not run: {exc}") from None
        if result.returncode:
            lines = result.stderr.strip().splitlines() or [f"exit code {result.returncode}"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise BuildError(f"{shlex.join(compiler)} failed: {first_error.strip()}")
        # mkstemp made it private to this user: readable by whoever shares the cache.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o755 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _load(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        raise BuildError(f"{path} does not load: {exc}") from None
    return module
