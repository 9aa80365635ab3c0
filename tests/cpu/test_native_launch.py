"""The C launcher (runtime/native.c) without a GPU: it builds and is cached whole, packs the
bytes the struct path packs and reports the same errors, leaves the ctypes path to run
where it cannot be built, and declares the driver's types as cuda.h does. A stand-in
libcuda, built here, records what each launch path hands the driver."""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ptxforge.ptx import KernelBuilder, LaunchShape
from ptxforge.runtime import launch, native
from ptxforge.runtime.launch import Launcher, argument_layout

SRC = Path(__file__).parents[2] / "src"
TYPES = ("u32", "s32", "b32", "f32", "u64", "s64", "b64", "f64", "tensormap")


def kernel(types, name: str = "packed", shape: LaunchShape | None = None) -> KernelBuilder:
    """A kernel with parameters p0, p1, ... of ``types`` (only its parameter list is used)."""
    k = KernelBuilder(name, target="sm_90a", max_threads=32)
    for i, type_ in enumerate(types):
        k.param(f"p{i}", type_)
    k.launch = shape or k.launch
    return k


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """The C launcher, built for these tests whatever PTXFORGE_NATIVE_LAUNCH says."""
    return native.build(tmp_path_factory.mktemp("native"))


@pytest.fixture
def launcher(extension, monkeypatch):
    def make(k: KernelBuilder, path: str) -> Launcher:
        """The kernel's launcher on ``path`` (native or ctypes); no function: nothing runs."""
        monkeypatch.setattr(native, "module", lambda: extension if path == "native" else None)
        made = Launcher(0, k.params, k.name, k.launch)
        assert made.path == path
        return made

    return make


def test_the_library_is_built_once_and_cached_whole(tmp_path, monkeypatch):
    directory = tmp_path / "native"
    replaced = []
    real_replace = os.replace

    def replace(source, target):
        # The compiler wrote a temporary file beside the entry; the entry appears whole.
        assert Path(source).parent == directory and Path(source).name.endswith(".tmp")
        assert Path(source).read_bytes()[:4] == b"\x7fELF" and not Path(target).exists()
        replaced.append(Path(target))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    module = native.build(directory)
    assert {"Launch", "PackingError", "encode_tiled"} <= set(dir(module))
    (entry,) = replaced
    assert sorted(directory.iterdir()) == [entry]  # no temporary file left behind
    assert entry.name.startswith("ptxforge_native.") and entry.suffix == ".so"

    def no_compiler(path):
        raise AssertionError("a cached library is loaded, not rebuilt")

    monkeypatch.setattr(native, "_compile", no_compiler)
    assert native.build(directory) is not None


def test_a_damaged_library_is_rebuilt_and_an_unwritable_directory_builds_elsewhere(tmp_path):
    directory = tmp_path / "native"
    native.build(directory)
    (entry,) = directory.iterdir()  # loaded now: it must not be written over in place
    damaged = tmp_path / "damaged" / entry.name
    damaged.parent.mkdir()
    damaged.write_bytes(b"not a library")
    assert native.build(damaged.parent) is not None
    assert damaged.read_bytes()[:4] == b"\x7fELF"
    blocker = tmp_path / "a file"
    blocker.write_text("where the cache directory should be")
    assert native.build(blocker / "native") is not None


_FALLBACK = """
import json, warnings
from ptxforge.ptx import KernelBuilder
from ptxforge.runtime.launch import Launcher

k = KernelBuilder("two_params", target="sm_90a", max_threads=32)
k.param("out", "u64"), k.param("value", "u32")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    made = [Launcher(0, k.params, k.name, k.launch) for _ in range(2)]
try:
    made[0]((1, 1, 1), 0, out=0, value="seven")
except TypeError as exc:
    refused = str(exc)
print(json.dumps({"paths": [m.path for m in made], "refused": refused,
                  "warnings": [str(w.message) for w in caught]}))
"""


def _sysconfig_compiler_on(path: str) -> bool:
    compiler = shlex.split(sysconfig.get_config_var("CC") or "") or [""]
    return bool(compiler[0]) and shutil.which(compiler[0], path=path) is not None


@pytest.mark.parametrize("setting", ["CC=/nonexistent/cc", "PATH=", "PTXFORGE_NATIVE_LAUNCH=0"])
def test_without_a_compiler_the_ctypes_path_runs(setting, tmp_path):
    name, value = setting.split("=")
    if name == "PATH":
        value = str(tmp_path)  # an empty folder: no cc, no gcc
        if _sysconfig_compiler_on(value):
            pytest.skip("Python's own compiler is an absolute path")
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update({"PTXFORGE_NATIVE_LAUNCH": "1", "PYTHONPATH": str(SRC),
                "PTXFORGE_CACHE_DIR": str(tmp_path), name: value})
    proc = subprocess.run([sys.executable, "-c", _FALLBACK], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["paths"] == ["ctypes", "ctypes"]
    assert result["refused"].startswith("two_params takes (out: u64, value: u32); packing the "
                                        "arguments failed: value got str: ")
    if name == "PTXFORGE_NATIVE_LAUNCH":
        assert result["warnings"] == []
    else:
        (warning,) = result["warnings"]  # one for the process, not one per launcher
        assert warning.startswith("ptxforge: no native launcher (") and "ctypes" in warning
        assert ("CC=/nonexistent/cc is not an executable" if name == "CC"
                else "no C compiler") in warning
    assert not list(tmp_path.rglob("*.so"))


PARAMETER_LISTS = {
    "one u32": (["u32"], [7]),
    "u32 then u64: padding": (["u64", "u32", "u64"], [2**64 - 1, 0xFFFFFFFF, 0]),
    "a tensor map: 64-byte alignment": (
        ["u32", "tensormap", "u32", "f64"], [1, bytes(range(128)), 2, -0.0]),
    "every type": (list(TYPES), [0xDEADBEEF, -2**31, 5, 1e-6, 1 << 40, -2**63, 3, 2.5,
                                 bytearray(b"\xff" * 128)]),
    "edge values": (["f32", "f32", "f32", "u32", "s64", "tensormap", "tensormap"],
                    [float("nan"), float("inf"), 3.4e38, True, -1, b"short", b"\x01" * 200]),
}


@pytest.mark.parametrize("case", list(PARAMETER_LISTS))
def test_the_c_packer_writes_the_struct_path_s_bytes(case, launcher):
    types, values = PARAMETER_LISTS[case]
    k = kernel(types)
    fmt, _, _ = argument_layout(k.params)
    made = launcher(k, "native")
    assert made.pack(*values) == struct.pack(fmt, *values)


class _Index:
    """An int by __index__ only (None: an __index__ that raises)."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return 1 // 0 if self.value is None else self.value


class _Float:
    def __float__(self):
        return 1 / 0


def test_a_float_s_own_error_propagates_on_both_paths(launcher):
    k = kernel(["f32"])
    for path in ("native", "ctypes"):
        with pytest.raises(ZeroDivisionError):
            launcher(k, path)((1, 1, 1), 0, p0=_Float())


def test_integers_by_index_pack_and_their_errors_propagate(launcher):
    k = kernel(["u32", "s64"])
    assert launcher(k, "native").pack(_Index(7), _Index(-3)) == struct.pack(
        argument_layout(k.params)[0], 7, -3)
    for path in ("native", "ctypes"):
        with pytest.raises(ZeroDivisionError):
            launcher(k, path)((1, 1, 1), 0, p0=_Index(None), p1=0)


U32, S32 = "outside [0, 4294967295]", "outside [-2147483648, 2147483647]"
BAD_VALUES = [("u32", "seven", "needs an integer"), ("u32", -1, U32), ("u32", 2**32, U32),
              ("s32", 2**31, S32), ("s32", 2**70, S32),
              ("u64", -1, "outside [0, 18446744073709551615]"),
              ("u64", 2**64, "outside [0, 18446744073709551615]"),
              ("s64", 2**63, "outside [-9223372036854775808, 9223372036854775807]"),
              ("f32", "x", "needs a float"), ("f32", 1e300, "too large for f32"),
              ("f32", 2**2000, "too large for f32"), ("f64", None, "needs a float"),
              ("f64", 2**2000, "too large for f64"),
              ("tensormap", 5, "needs 128 bytes (an encoded tensor map) or a view (address, "
                               "shape, byte strides)"), ("b32", 1.5, "needs an integer")]


@pytest.mark.parametrize("type_, value, why", BAD_VALUES,
                         ids=[f"{t}-{v!r:.12}" for t, v, _ in BAD_VALUES])
def test_a_value_that_does_not_pack_is_the_same_error_on_both_paths(type_, value, why, launcher):
    """The same words on both paths and on every Python version (struct's own messages
    differ between 3.11 and 3.12)."""
    k = kernel(["u64", type_], name="refusing")
    messages = []
    for path in ("native", "ctypes"):
        with pytest.raises(TypeError) as caught:
            launcher(k, path)((1, 1, 1), 0, p0=0, p1=value)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    got = repr(value) if isinstance(value, (int, float)) else type(value).__name__
    assert messages[0] == (f"refusing takes (p0: u64, p1: {type_}); packing the arguments "
                           f"failed: p1 got {got}: {why}")


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_arguments_are_bound_by_name_on_both_paths(path, launcher):
    launch_ = launcher(kernel(["u64", "u32"], name="two_params"), path)
    with pytest.raises(TypeError, match=r"^two_params\(\) missing 1 required keyword-only "
                                        r"argument: 'p1'$"):
        launch_((1, 1, 1), 0, p0=0)
    with pytest.raises(TypeError, match=r"^two_params\(\) got an unexpected keyword argument "
                                        r"'p2'$"):
        launch_((1, 1, 1), 0, p0=0, p1=1, p2=2)
    with pytest.raises(TypeError, match=r"^two_params\(\) takes 3 positional arguments"):
        launch_((1, 1, 1), 0, 0, 1)
    assert launch_.name == "two_params" and [p.name for p in launch_.params] == ["p0", "p1"]


def test_the_launch_attribute_ids_are_the_driver_s():
    from cuda.bindings import driver as cu

    ids = cu.CUlaunchAttributeID
    assert (launch._COOPERATIVE, launch._CLUSTER_DIMENSION,
            launch._PROGRAMMATIC_STREAM_SERIALIZATION) == (
        int(ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE), int(ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
        int(ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION))


def _cuda_include() -> str | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *glob.glob("/usr/local/cuda-*")]
    return next((f"{r}/include" for r in roots if r and os.path.isfile(f"{r}/include/cuda.h")),
                None)


def test_the_driver_types_are_declared_as_cuda_h_declares_them():
    include = _cuda_include()
    if include is None:
        pytest.skip("no cuda.h on this machine")
    proc = subprocess.run(
        ["cc", "-fsyntax-only", "-DPTXFORGE_CHECK_ABI", f"-I{include}",
         f"-I{sysconfig.get_paths()['include']}", str(native.SOURCE)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# A stand-in for libcuda: records each launch (config, attributes, the parameter buffer
# from the first parameter's address, each parameter's offset from it) and writes what it
# was asked to encode into a tensor map; fails the next `failures` launches with `result`.
_FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <string.h>
typedef struct { unsigned grid[3], block[3], shared; void *stream; void *attrs; unsigned n; } Config;
unsigned recorded_dims[7]; unsigned long long recorded_stream; unsigned recorded_num_attrs;
unsigned char recorded_attrs[72 * 4], recorded_params[4096];
long long recorded_offsets[64]; unsigned params_size, param_count;
int launches, failures, result;
int cuInit(unsigned flags) { return 0; }
int cuLaunchKernelEx(const Config *c, void *function, void **params, void **extra) {
    memcpy(recorded_dims, c->grid, sizeof recorded_dims);
    recorded_stream = (unsigned long long)c->stream;
    recorded_num_attrs = c->n;
    memcpy(recorded_attrs, c->attrs ? c->attrs : (void *)recorded_attrs, 72 * c->n);
    memcpy(recorded_params, params[0], params_size);
    for (unsigned i = 0; i < param_count; i++)
        recorded_offsets[i] = (char *)params[i] - (char *)params[0];
    launches++;
    if (failures) { failures--; return result; }
    return 0;
}
int cuTensorMapEncodeTiled(uint64_t *map, int type, uint32_t rank, void *address,
                           const uint64_t *dims, const uint64_t *strides, const uint32_t *box,
                           const uint32_t *element_strides, int interleave, int swizzle,
                           int l2, int oob) {
    memset(map, 0, 128);
    map[0] = type; map[1] = rank; map[2] = (uint64_t)address;
    for (uint32_t i = 0; i < rank; i++) {
        map[3 + i] = dims[i]; map[8 + i] = box[i] | (uint64_t)element_strides[i] << 32;
    }
    for (uint32_t i = 0; i + 1 < rank; i++) map[13] = map[13] * 1000003 + strides[i];
    map[14] = (uint64_t)interleave << 48 | (uint64_t)swizzle << 32 | l2 << 16 | oob;
    return 0;
}
"""

_RECORD = """
import ctypes, json, struct, sys
from ptxforge.ptx import KernelBuilder, LaunchShape, TensorMap
from ptxforge.runtime import launch, native
from ptxforge.runtime.launch import Launcher, argument_layout
from ptxforge.runtime.tensormap import driver_encoding

fake = ctypes.CDLL("libcuda.so.1")
var = lambda name, kind=ctypes.c_uint: kind.in_dll(fake, name)

def kernel(types, maps, shape):
    k = KernelBuilder("recorded", target="sm_90a", max_threads=shape.block)
    for i, (type_, tensor_map) in enumerate(zip(types, maps)):
        k.param(f"p{i}", type_, tensor_map)
    k.launch = shape
    return k

def record(made, k, grid, stream, values):
    fmt, offsets, size = argument_layout(k.params)
    var("params_size").value, var("param_count").value = size, len(offsets)
    made(grid, stream, **{p.name: v for p, v in zip(k.params, values)})
    return {"dims": list(var("recorded_dims", ctypes.c_uint * 7)),
            "stream": var("recorded_stream", ctypes.c_ulonglong).value,
            "attrs": bytes(var("recorded_attrs", ctypes.c_char * (72 * 4)))[
                :72 * var("recorded_num_attrs").value].hex(),
            "params": bytes(var("recorded_params", ctypes.c_char * 4096))[:size].hex(),
            "offsets": list(var("recorded_offsets", ctypes.c_longlong * 64))[:len(offsets)],
            "expected_offsets": offsets, "expected_params": None if any(
                type(v) is tuple for v in values) else struct.pack(fmt, *values).hex()}

tmap = TensorMap("float8_e4m3fn", (128, 64), swizzle=128)
cases = [
    (["u64", "u32", "f32"], [None] * 3, LaunchShape(128), [1 << 40, 9, 0.5]),
    (["u32", "tensormap", "s64"], [None, tmap, None],
     LaunchShape(384, 200 * 1024, cluster=2, cooperative=True, programmatic=True),
     [3, bytes(range(128)), -5]),
]
extension = native.module()
calls = []
launch.call = lambda *args: calls.append(args)  # the context push and pop of a retry
out = {}
for path in ("native", "ctypes"):
    native.module = lambda: extension if path == "native" else None
    out[path] = []
    for types, maps, shape, values in cases:
        k = kernel(types, maps, shape)
        made = Launcher(0x1234, k.params, k.name, k.launch)
        assert made.path == path
        out[path].append(record(made, k, (5, 6, 7), 0xABC, values))
    # A launch in the wrong context is launched again inside the function's own; the C
    # launcher first hands the failed call to the Python one, which fails once more.
    k = kernel(["u32"], [None], LaunchShape(32))
    made = Launcher(0x1234, k.params, k.name, k.launch, context="ctx")
    failures = 2 if path == "native" else 1
    var("failures").value, var("result").value, var("launches").value = failures, 201, 0
    calls.clear()
    made((1, 1, 1), 0, p0=1)
    out[path + " retry"] = [var("launches").value, var("failures").value, calls[:]]

# The C launcher encodes a view with the parameter's TensorMap, as encode_tiled does.
native.module = lambda: extension
k = kernel(["tensormap", "u32"], [tmap, None], LaunchShape(128))
made = Launcher(0x1234, k.params, k.name, k.launch)
view = (1 << 40, (1024, 4), (1024,))
encoded = extension.encode_tiled(*view, driver_encoding("float8_e4m3fn", (128, 64), 128))
out["view"] = [record(made, k, (1, 1, 1), 0, [view, 1])["params"][:256], encoded.hex(),
               made.pack(view, 1)[:128].hex()]

class Index:  # a numpy or torch integer: an int by __index__
    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value

indexed = (Index(1 << 40), (Index(1024), Index(4)), (Index(1024),))
out["view by index"] = record(made, k, (Index(1), 1, 1), 0, [indexed, Index(1)])["params"][:256]
print(json.dumps(out))
"""


def test_both_paths_hand_the_driver_the_same_launch(tmp_path):
    fake = tmp_path / "libcuda.so.1"
    source = tmp_path / "fake_libcuda.c"
    source.write_text(_FAKE_LIBCUDA)
    proc = subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(source),
                           "-o", str(fake)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), PYTHONPATH=str(SRC),
               PTXFORGE_CACHE_DIR=str(tmp_path / "cache"), PTXFORGE_NATIVE_LAUNCH="1")
    proc = subprocess.run([sys.executable, "-c", _RECORD], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["native"] == result["ctypes"]
    for launched in result["native"]:
        assert launched["dims"][:3] == [5, 6, 7] and launched["stream"] == 0xABC
        assert launched["params"] == launched["expected_params"]
        assert launched["offsets"] == launched["expected_offsets"]
    plain, attributed = result["native"]
    assert plain["dims"] == [5, 6, 7, 128, 1, 1, 0] and plain["attrs"] == ""
    assert attributed["dims"] == [5, 6, 7, 384, 1, 1, 200 * 1024]
    attributes = bytes.fromhex(attributed["attrs"])
    assert [struct.unpack_from("<iQQ", attributes, 72 * i)[0] for i in range(3)] == [4, 2, 6]
    assert struct.unpack_from("<I4xQQ", attributes, 0)[1:] == (2 | 1 << 32, 1)  # cluster 2x1x1
    launched, encoded, packed = result["view"]
    assert launched == encoded == packed == result["view by index"]
    retried = [["cuCtxPushCurrent", "ctx"], ["cuCtxPopCurrent"]]
    assert result["native retry"] == [3, 0, retried]
    assert result["ctypes retry"] == [2, 0, retried]
