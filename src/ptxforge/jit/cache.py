"""The on-disk cubin cache.

One file per entry, ``<key>.cubin``: a one-line JSON header (format, payload size and
SHA-256, and the kernel's metadata) followed by the cubin bytes. Writers write a private
temporary file in the same directory and ``os.replace`` it into place, so readers see
either nothing or a whole entry, and several processes compiling the same kernel at once
each install an identical file. A reader that finds a short, damaged or foreign entry
treats it as a miss; the caller rebuilds and overwrites it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

FORMAT = "ptxforge-cubin-1"


def cache_key(*parts: str) -> str:
    """A stable key from everything that decides the cubin's bytes."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
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
                or header.get("size") != len(payload)
                or header.get("sha256") != hashlib.sha256(payload).hexdigest()
                or not isinstance(header.get("meta"), dict)):
            return None
        return payload, header["meta"]

    def put(self, key: str, cubin: bytes, meta: dict) -> None:
        """Write an entry; raises OSError when the directory cannot be written (the JIT
        then goes on without the disk cache)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        header = {"format": FORMAT, "size": len(cubin),
                  "sha256": hashlib.sha256(cubin).hexdigest(), "meta": meta}
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

    def entries(self) -> list[Path]:
        return sorted(self.directory.glob("*.cubin")) if self.directory.exists() else []

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.entries())

    def clear(self) -> int:
        removed = 0
        for p in self.entries():
            p.unlink(missing_ok=True)
            removed += 1
        return removed
