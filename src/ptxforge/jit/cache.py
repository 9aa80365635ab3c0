"""The on-disk cubin cache.

One file per entry, ``<key>.cubin``: a one-line JSON header (format, payload size, the
kernel's metadata and a SHA-256 over both the metadata and the payload) followed by the
cubin bytes. Writers write a private temporary file in the same directory and
``os.replace`` it into place, so readers see either nothing or a whole entry, and several
processes compiling the same kernel at once each install an identical file. A reader that
finds a short, damaged or foreign entry treats it as a miss; the caller rebuilds and
overwrites it. ``PTXFORGE_DEBUG`` keeps each kernel's PTX under ``ptx/`` beside the entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

FORMAT = "ptxforge-cubin-2"


def cache_key(*parts: str) -> str:
    """A stable key from everything that decides the cubin's bytes."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _checksum(meta: dict, payload: bytes) -> str:
    """SHA-256 of the metadata (canonical JSON, which holds no newline) and the payload, so a
    changed resource report is caught like a changed cubin."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode() + b"\n")
    h.update(payload)
    return h.hexdigest()


class DiskCache:
    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.cubin"

    def get(self, key: str) -> tuple[bytes, dict] | None:
        """(cubin, metadata), or None when absent or not whole."""
        try:
            with open(self.path(key), "rb") as f:
                header_line = f.readline(65536)
                payload = f.read()
        except OSError:  # absent, unreadable, not a file: a miss either way
            return None
        try:
            header = json.loads(header_line)
        except (ValueError, UnicodeDecodeError):
            return None
        if (not isinstance(header, dict) or header.get("format") != FORMAT
                or header.get("size") != len(payload) or not isinstance(header.get("meta"), dict)
                or header.get("sha256") != _checksum(header["meta"], payload)):
            return None
        return payload, header["meta"]

    def put(self, key: str, cubin: bytes, meta: dict) -> None:
        """Write an entry; raises OSError when the directory cannot be written (the JIT
        then goes on without the disk cache)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        header = {"format": FORMAT, "size": len(cubin), "sha256": _checksum(meta, cubin),
                  "meta": meta}
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
                f.write(cubin)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def keep_ptx(self, name: str, key: str, ptx: str) -> None:
        """Keep a kernel's PTX for reading (``PTXFORGE_DEBUG``); raises OSError like ``put``."""
        directory = self.directory / "ptx"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{name}.{key[:12]}.ptx").write_text(ptx)

    def entries(self) -> list[Path]:
        return sorted(self.directory.glob("*.cubin")) if self.directory.is_dir() else []

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.entries())

    def problem(self) -> str | None:
        """Why the directory cannot take new entries, or None when it can. It need not exist
        yet: then the nearest folder above it that exists must take a new folder. Found by
        trying (a file made and removed in it, or a folder beside where it would go), since
        permission bits do not tell: root ignores them, and /proc or a read-only mount
        refuse every write whatever they say."""
        path = self.directory
        while not path.exists() and path.parent != path:
            path = path.parent
        if not path.is_dir():
            return (f"{path} is not a directory" if path == self.directory
                    else f"it sits under {path}, which is not a directory")
        try:
            if path == self.directory:
                fd, probe = tempfile.mkstemp(dir=path, prefix=".probe.", suffix=".tmp")
                os.close(fd)
                os.unlink(probe)
            else:
                os.rmdir(tempfile.mkdtemp(dir=path, prefix=".probe.", suffix=".tmp"))
        except OSError as exc:
            what = "a file" if path == self.directory else "a folder"
            return f"cannot create {what} in {path}: {exc.strerror}"
        return None

    def clear(self) -> int:
        """Remove every entry, the temporary files of writers that died, kept PTX and the
        built C launchers (native/: a process that loaded one keeps it); return how many
        entries went. (A writer racing with this loses only its own write.) Tries every
        file, then raises the first OSError if some could not be removed."""
        if not self.directory.is_dir():
            return 0
        ptx, native = self.directory / "ptx", self.directory / "native"
        temporaries = sorted(self.directory.glob(".*.tmp"))
        kept = sorted(ptx.glob("*.ptx")) if ptx.is_dir() else []
        libraries = (sorted(native.glob("*.so")) + sorted(native.glob(".*.tmp"))
                     if native.is_dir() else [])
        removed, failure = 0, None
        for path in self.entries() + temporaries + kept + libraries:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                failure = failure or exc
                continue
            removed += path.suffix == ".cubin"
        if failure is not None:
            raise failure
        return removed
