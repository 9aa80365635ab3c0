"""The on-disk cubin cache: whole entries or misses, rebuilds of damaged entries,
concurrent writers, and the PTXFORGE_DISABLE_CACHE / PTXFORGE_DEBUG knobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ptxforge import jit
from ptxforge.jit.cache import DiskCache, cache_key
from ptxforge.ptx import KernelBuilder, addr

KEY = cache_key("test", "entry")
CUBIN = bytes(range(256)) * 4
META = {"name": "k", "resources": {"registers": 8}}


def store_constant_kernel(name: str = "store_constant") -> KernelBuilder:
    """out[0] = 7: the smallest kernel that assembles to a real cubin."""
    k = KernelBuilder(name, target="sm_90a", max_threads=32)
    out = k.param("out", "u64")
    ptr, value = k.reg("u64", "out_ptr"), k.reg("u32", "value")
    k.ld_param(ptr, out)
    k.mov(value, 7)
    k.st(addr(ptr), value)
    return k


def spilling_kernel(values: int = 200) -> KernelBuilder:
    """Loads ``values`` floats, sums them, then adds the sum to each and stores it back, so
    every loaded value is live across the sum. Capped at 1024 threads (64 registers per
    thread), ptxas spills: 1808 bytes of spill stores with CUDA 13.0."""
    k = KernelBuilder("spills_on_purpose", target="sm_90a", max_threads=1024)
    src_param, dst_param = k.param("src", "u64"), k.param("dst", "u64")
    src, dst = k.reg("u64", "src"), k.reg("u64", "dst")
    k.ld_param(src, src_param)
    k.ld_param(dst, dst_param)
    loaded = k.regs("f32", values, "v")
    for i, r in enumerate(loaded):
        k.ld(r, addr(src, 4 * i))
    total = k.reg("f32", "total")
    k.mov(total, 0.0)
    for r in loaded:
        k.add(total, total, r)
    for i, r in enumerate(loaded):
        k.add(r, r, total)
        k.st(addr(dst, 4 * i), r)
    return k


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A private cache directory and an empty in-memory cache for ``jit.build``."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(directory))
    for knob in ("PTXFORGE_DISABLE_CACHE", "PTXFORGE_DEBUG"):
        monkeypatch.delenv(knob, raising=False)
    monkeypatch.setattr(jit, "_memory", {})
    return directory


def _stored(cache: DiskCache, key: str) -> Path:
    cache.put(key, CUBIN, META)
    return cache.path(key)


# --------------------------------------------------------------------------- DiskCache
def test_round_trip(tmp_path):
    cache = DiskCache(tmp_path / "new" / "dir")
    assert cache.get(KEY) is None
    cache.put(KEY, CUBIN, META)
    assert cache.get(KEY) == (CUBIN, META)
    assert cache.entries() == [cache.path(KEY)]
    assert cache.size_bytes() == cache.path(KEY).stat().st_size > len(CUBIN)
    native = tmp_path / "new" / "dir" / "native"
    native.mkdir()
    (native / "ptxforge_native.0123.so").write_bytes(b"library")
    (native / ".ptxforge_native.4567.so.x.tmp").write_bytes(b"half")
    assert cache.clear() == 1
    assert cache.get(KEY) is None and cache.entries() == [] and list(native.iterdir()) == []


def test_cache_key_separates_its_parts():
    assert cache_key("ab", "c") != cache_key("a", "bc")
    assert cache_key("a", "b") == cache_key("a", "b")
    assert len(cache_key("a")) == 64


def test_truncated_entry_is_a_miss(tmp_path):
    cache = DiskCache(tmp_path)
    path = _stored(cache, KEY)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    assert cache.get(KEY) is None
    path.write_bytes(data[: data.index(b"\n") + 1])  # the header alone
    assert cache.get(KEY) is None


def test_entry_with_one_payload_byte_flipped_is_a_miss(tmp_path):
    cache = DiskCache(tmp_path)
    path = _stored(cache, KEY)
    data = bytearray(path.read_bytes())
    data[data.index(b"\n") + 100] ^= 0x01
    path.write_bytes(bytes(data))
    assert cache.get(KEY) is None


def test_the_checksum_covers_the_resource_report(tmp_path):
    cache = DiskCache(tmp_path)
    path = _stored(cache, KEY)
    header, payload = path.read_bytes().split(b"\n", 1)
    edited = header.replace(b'"registers": 8', b'"registers": 9')
    assert edited != header and json.loads(edited)["meta"]["resources"] == {"registers": 9}
    path.write_bytes(edited + b"\n" + payload)
    assert cache.get(KEY) is None


@pytest.mark.parametrize("header", [
    b"this is not json",
    b"\xff\xfe\x00garbage",
    b'["a", "list"]',
    b'{"format": "someone-else-1", "size": 1024}',
], ids=["text", "bad-utf8", "json-list", "foreign-format"])
def test_garbage_header_is_a_miss(tmp_path, header):
    cache = DiskCache(tmp_path)
    path = _stored(cache, KEY)
    path.write_bytes(header + b"\n" + CUBIN)
    assert cache.get(KEY) is None


def test_empty_file_is_a_miss(tmp_path):
    cache = DiskCache(tmp_path)
    cache.path(KEY).write_bytes(b"")
    assert cache.get(KEY) is None


def test_put_replaces_a_damaged_entry_and_leaves_no_temporary_file(tmp_path):
    cache = DiskCache(tmp_path)
    cache.path(KEY).write_bytes(b"junk")
    cache.put(KEY, CUBIN, META)
    assert cache.get(KEY) == (CUBIN, META)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{KEY}.cubin"]


# --------------------------------------------------------------------------- jit.build
def test_build_writes_reads_back_and_rebuilds_a_corrupted_entry(cache_dir):
    first = jit.build(store_constant_kernel())
    assert first.source == "assembled"
    cache = DiskCache(cache_dir)
    assert cache.entries() == [cache.path(first.key)]
    cubin, meta = cache.get(first.key)
    assert cubin == first.cubin
    assert meta["name"] == "store_constant" and meta["target"] == "sm_90a"
    assert meta["resources"] == first.resources.as_dict()

    assert jit.build(store_constant_kernel()) is first  # same process: the memory cache

    jit._memory.clear()
    from_disk = jit.build(store_constant_kernel())
    assert from_disk.source == "disk"
    assert from_disk.key == first.key
    assert from_disk.cubin == first.cubin
    assert from_disk.resources == first.resources

    path = cache.path(first.key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    jit._memory.clear()
    rebuilt = jit.build(store_constant_kernel())
    assert rebuilt.source == "assembled"
    cubin, meta = cache.get(first.key)
    assert cubin == rebuilt.cubin and meta["resources"] == rebuilt.resources.as_dict()


def test_disable_cache_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("PTXFORGE_DISABLE_CACHE", "1")
    assert jit.build(store_constant_kernel()).source == "assembled"
    jit._memory.clear()
    assert jit.build(store_constant_kernel()).source == "assembled"
    assert not cache_dir.exists()


def test_debug_keeps_the_ptx(cache_dir, monkeypatch):
    monkeypatch.setenv("PTXFORGE_DEBUG", "1")
    compiled = jit.build(store_constant_kernel())
    kept = cache_dir / "ptx" / f"store_constant.{compiled.key[:12]}.ptx"
    assert kept.read_text() == compiled.ptx


def test_debug_refuses_a_kernel_that_spills(cache_dir, monkeypatch):
    compiled = jit.build(spilling_kernel())
    assert compiled.resources.spill_stores > 0 and compiled.resources.spill_loads > 0

    monkeypatch.setenv("PTXFORGE_DEBUG", "1")
    jit._memory.clear()
    with pytest.raises(jit.SpillError, match=r"spills_on_purpose spills \d+ bytes"):
        jit.build(spilling_kernel())  # from the disk cache: still refused
    jit._memory.clear()
    monkeypatch.setenv("PTXFORGE_DISABLE_CACHE", "1")
    with pytest.raises(jit.SpillError, match="PTXFORGE_DEBUG"):
        jit.build(spilling_kernel())  # freshly assembled


# --------------------------------------------------------------------------- concurrent writers
_WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_cache import store_constant_kernel
from ptxforge import jit

kernel = store_constant_kernel("written_concurrently")
barrier = Path({barrier!r})
(barrier / sys.argv[1]).touch()
deadline = time.monotonic() + 60
while len(list(barrier.iterdir())) < {writers} and time.monotonic() < deadline:
    time.sleep(0.001)
compiled = jit.build(kernel)
print(compiled.key, compiled.source)
"""


def test_concurrent_writers_install_one_whole_entry(tmp_path):
    writers = 4
    cache_dir, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PTXFORGE_DISABLE_CACHE", "PTXFORGE_DEBUG")}
    env["PTXFORGE_CACHE_DIR"] = str(cache_dir)
    script = _WRITER.format(tests=str(Path(__file__).parent), barrier=str(barrier),
                            writers=writers)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(writers)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0, err
    keys = {out.split()[0] for out, _, _ in results}
    assert len(keys) == 1
    key = keys.pop()
    assert sorted(p.name for p in cache_dir.iterdir()) == [f"{key}.cubin"]
    assert not [p for p in cache_dir.rglob("*") if p.name.endswith(".tmp")]
    assert DiskCache(cache_dir).get(key) is not None


UNUSABLE = ("read-only", "a regular file", "under a regular file")


@pytest.mark.parametrize("directory, problem", [
    ("/proc/x", "cannot create a folder in /proc: No such file or directory"),
    ("/proc/x/y", "cannot create a folder in /proc: No such file or directory"),
])
def test_problem_tries_the_directory_rather_than_reading_permission_bits(directory, problem):
    """/proc looks writable to root (os.access says so) and takes no folder at all."""
    assert DiskCache(Path(directory)).problem() == problem


def test_problem_leaves_nothing_behind(tmp_path):
    existing, new = tmp_path / "cache", tmp_path / "new" / "cache"
    existing.mkdir()
    assert DiskCache(existing).problem() is None and DiskCache(new).problem() is None
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["cache"]


def unusable_cache_dir(tmp_path: Path, kind: str) -> Path:
    """A cache directory that cannot be written, in one of the UNUSABLE ways."""
    if kind == "read-only":
        directory = tmp_path / "cache"
        directory.mkdir()
        directory.chmod(0o555)
        return directory
    blocker = tmp_path / ("cache" if kind == "a regular file" else "blocker")
    blocker.write_text("a file where the cache directory should be")
    return blocker if kind == "a regular file" else blocker / "cache"


def run_unusable(kind: str, request) -> list[str]:
    """The command prefix for a test on an UNUSABLE kind (root ignores read-only folders)."""
    return request.getfixturevalue("unprivileged") if kind == "read-only" else []


_BUILD_TWO = """
import json, sys, warnings
sys.path.insert(0, {tests!r})
from test_cache import store_constant_kernel
from ptxforge import jit

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    built = [jit.build(store_constant_kernel(name)) for name in ("first", "second")]
print(json.dumps({{"sources": [c.source for c in built],
                  "elf": [c.cubin[:4] == b"\\x7fELF" for c in built],
                  "warnings": [str(w.message) for w in caught]}}))
"""


@pytest.mark.parametrize("debug", ["0", "1"], ids=["", "debug"])
@pytest.mark.parametrize("kind", UNUSABLE)
def test_an_unusable_cache_directory_costs_one_warning_never_a_build(kind, debug, tmp_path,
                                                                     request):
    directory = unusable_cache_dir(tmp_path, kind)
    env = {k: v for k, v in os.environ.items() if k != "PTXFORGE_DISABLE_CACHE"}
    env.update(PTXFORGE_CACHE_DIR=str(directory), PTXFORGE_DEBUG=debug)
    script = _BUILD_TWO.format(tests=str(Path(__file__).parent))
    proc = subprocess.run(run_unusable(kind, request) + [sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["sources"] == ["assembled", "assembled"] and all(result["elf"])
    (warning,) = result["warnings"]
    assert warning.startswith("ptxforge: cannot write the kernel cache (")
    if kind == "read-only":
        assert "Permission denied" in warning and list(directory.iterdir()) == []


def test_unwritable_cache_directory_warns_and_builds(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(jit, "_cache_write_warned", False)
    jit._memory.clear()
    with pytest.warns(UserWarning, match="cannot write the kernel cache"):
        compiled = jit.build(store_constant_kernel("unwritable_cache"))
    assert compiled.source == "assembled" and compiled.cubin[:4] == b"\x7fELF"


def test_entry_without_a_resource_report_is_rebuilt(cache_dir):
    jit._memory.clear()
    first = jit.build(store_constant_kernel("no_report"))
    DiskCache(cache_dir).put(first.key, first.cubin, {"name": "no_report"})  # valid, but no report
    jit._memory.clear()
    again = jit.build(store_constant_kernel("no_report"))
    assert again.source == "assembled" and again.resources == first.resources
