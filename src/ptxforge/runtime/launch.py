"""Launches: ``cuLaunchKernelEx`` in libcuda, arguments bound by name.

A ``Launcher`` is made once per kernel and launch shape. Calling it binds the kernel's
parameters by name (``launcher(grid, stream, x=..., rows=...)``): the parameter list the
kernel declared decides the order and layout of the argument buffer, so no caller repeats
it. Where the C launcher (``native.c``) is built, the launcher is a C object and a call is
one C call: bind the keywords, pack the values into the layout given at creation, launch.
Anything amiss goes to a ``__call__`` generated for the parameter list (as Triton generates
its launchers), which reports it. Without the C launcher, that generated call launches
through ctypes: a per-thread, pre-laid-out argument buffer, one ``pack_into``, four field
stores and the ctypes call (on an H200, 6.4 us a launch through ctypes against 8.2 us
through ``cuda.bindings``).
"""

from __future__ import annotations

import ctypes
import functools
import keyword
import operator
import re
import struct
import threading

from . import native
from .driver import bindings, call, check
from .tensormap import driver_encoding, encode


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an id padded to 8 bytes, then a 64-byte, 8-aligned value union.
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]


# CUlaunchAttributeID values, and what each one's value union holds.
_COOPERATIVE = 2                        # int: 1
_CLUSTER_DIMENSION = 4                  # {x, y, z} as three uint32
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # int: 1
_WRONG_CONTEXT = (201, 400)  # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE


def launch_attributes(shape) -> list[tuple[int, int, int]]:
    """(id, first and second 64-bit word of the value) of each attribute ``shape`` (a
    ``LaunchShape``) asks for."""
    attributes = []
    if shape.cluster > 1:
        attributes.append((_CLUSTER_DIMENSION, shape.cluster | (1 << 32), 1))
    if shape.cooperative:
        attributes.append((_COOPERATIVE, 1, 0))
    if shape.programmatic:
        attributes.append((_PROGRAMMATIC_STREAM_SERIALIZATION, 1, 0))
    return attributes


@functools.lru_cache(maxsize=None)
def _libcuda_launch():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_STRUCT_CODE = {"u32": "I", "s32": "i", "b32": "I", "f32": "f", "u64": "Q", "s64": "q",
                "b64": "Q", "f64": "d", "tensormap": "128s"}


_RANGES = {"I": (0, 2**32 - 1), "i": (-2**31, 2**31 - 1), "Q": (0, 2**64 - 1),
           "q": (-2**63, 2**63 - 1)}


def _why(code: str, value) -> str:
    """Why struct ``code`` refuses ``value``, in runtime/native.c's words."""
    if code == "128s":
        return "needs 128 bytes (an encoded tensor map) or a view (address, shape, byte strides)"
    if code in "fd":
        try:
            float(value)
        except (TypeError, ValueError):
            return "needs a float"
        except OverflowError:
            pass
        return "too large for f32" if code == "f" else "too large for f64"
    try:
        operator.index(value)
    except TypeError:
        return "needs an integer"
    low, high = _RANGES[code]
    return f"outside [{low}, {high}]"


def argument_layout(params) -> tuple[str, list[int], int]:
    """struct format, byte offsets and total size of the kernel's parameter buffer,
    laid out by each parameter's own size and alignment, as the kernel declares them."""
    fmt, offsets, offset = "<", [], 0
    for p in params:
        pad = -offset % p.align
        fmt += "x" * pad
        offset += pad
        offsets.append(offset)
        fmt += _STRUCT_CODE[p.type]
        offset += p.size
    return fmt, offsets, max(offset, 1)


# The call of a launcher, specialised on its kernel's parameter names: through the C
# launcher (``launch``, its positional method), or through ctypes. Each begins by encoding
# the views given for tensor maps ({views}: _VIEW once per tensor-map parameter).
_VIEW = """
    if type({name}) is tuple:
        {name} = encode(tensor_maps[{name!r}], *{name})"""
_NATIVE_CALL = """
def __call__(self, grid, stream{signature}):{views}
    try:
        err = launch(grid, stream, {values})
    except PackingError as exc:
        self._packing_failed(*exc.args)
    if err:
        self._failed(err, lambda: launch(grid, stream, {values}))
"""
_CTYPES_CALL = """
def __call__(self, grid, stream{signature}):{views}
    state = self._local.__dict__.get("state") or self._new_state()
    try:
        self._pack(state[0], 0, {values})
    except (struct.error, OverflowError):
        self._packing_failed(*self._refused({values}))
    config = state[1]
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.hStream = stream
    err = self._launch(state[2], self._function, state[3], None)
    if err:
        self._failed(err, lambda: self._launch(state[2], self._function, state[3], None))
"""

# Every name the generated calls use (their own locals and globals among them): a
# parameter of the same name would shadow it.
_CALL_NAMES = frozenset(re.findall(r"(?<![.\w])[A-Za-z_]\w*", re.sub(r"\{\w+(!r)?\}", "",
                                                                 _VIEW + _NATIVE_CALL + _CTYPES_CALL)))


class Launcher:
    """Launches one loaded function with one ``LaunchShape`` (block, dynamic shared memory,
    cluster, cooperative and programmatic launch). ``launcher(grid, stream, **arguments)``
    binds every kernel parameter by name; ``grid`` is 3 ints, ``stream`` a cudaStream_t
    handle as an int. A missing or unknown name is a TypeError naming the kernel. A
    tensor-map parameter takes its 128-byte descriptor, or a view to encode with the
    parameter's ``TensorMap``: ``(address, shape, strides_bytes)`` as
    ``tensormap.encode`` takes them (the C launcher encodes it in the call, uncached).

    Each Launcher is an instance of a class of its own, whose ``__call__`` is generated for
    its kernel's parameter list. Where the C launcher is built (``native.py``), creating
    one returns the C launcher standing for it (a ``ptxforge_native.Launch``, which reads
    its attributes from this object): calling that binds, packs and launches in one C call,
    and hands any call that goes wrong to this object's ``__call__`` to report. ``path``
    says which it is: ``native`` or ``ctypes`` (per-thread buffers). Both release the GIL
    while the driver runs."""

    def __new__(cls, function, params, name: str, shape, *, context=None):
        names = [p.name for p in params]
        taken = sorted(n for n in names if n in _CALL_NAMES or keyword.iskeyword(n))
        if taken:
            raise ValueError(f"{name}: a kernel parameter may not be named {', '.join(taken)}: "
                             f"the generated call uses those names")
        self = object.__new__(type(cls.__name__, (cls,), {}))
        self.name = name
        self.shape = shape
        self.context = context  # the primary context the function was loaded into
        self.params = list(params)
        self.tensor_maps = {p.name: p.tensor_map for p in params if p.tensor_map is not None}
        fmt, offsets, size = argument_layout(params)
        extension = native.module()
        if extension is None:
            self.path = "ctypes"
            self._function = ctypes.c_void_p(int(function))  # converted once, not per call
            self._offsets, self._size = offsets, size
            self._pack = struct.Struct(fmt).pack_into
            self._local = threading.local()
            self._launch = self._first_launch  # then libcuda's cuLaunchKernelEx itself
            launcher, template, namespace = self, _CTYPES_CALL, {"struct": struct}
        else:
            self.path = "native"
            codes = "".join(_STRUCT_CODE[p.type][-1] for p in params)
            encodings = tuple(None if p.tensor_map is None else driver_encoding(
                p.tensor_map.dtype, p.tensor_map.box, p.tensor_map.swizzle) for p in params)
            launcher = extension.Launch(self, int(function), tuple(names), codes, tuple(offsets),
                                        encodings, size, shape.block, shape.shared_bytes,
                                        launch_attributes(shape))
            template = _NATIVE_CALL
            namespace = {"launch": launcher.launch, "PackingError": extension.PackingError}
        namespace.update(encode=encode, tensor_maps=self.tensor_maps)
        signature = f", *, {', '.join(names)}" if names else ""  # a bare * needs a name after it
        views = "".join(_VIEW.format(name=name) for name in self.tensor_maps)
        exec(template.format(signature=signature, views=views, values=", ".join(names)),
             namespace)
        call = namespace["__call__"]
        call.__qualname__ = name  # TypeErrors read "<kernel>() missing ... argument: 'x'"
        type(self).__call__ = call
        return launcher

    def _first_launch(self, *args) -> int:
        """Find cuLaunchKernelEx (in libcuda: not on a machine without the driver) and
        launch; later calls go to it directly."""
        self._launch = _libcuda_launch()
        return self._launch(*args)

    def _new_state(self):
        buf = ctypes.create_string_buffer(self._size + 64)
        start = (ctypes.addressof(buf) + 63) & ~63  # tensor maps want 64-byte alignment
        argv = (ctypes.c_void_p * max(len(self._offsets), 1))(*[start + o for o in self._offsets])
        view = (ctypes.c_char * self._size).from_address(start)
        config = _LaunchConfig()
        config.blockDimX, config.blockDimY, config.blockDimZ = self.shape.block, 1, 1
        config.sharedMemBytes = self.shape.shared_bytes
        attributes = launch_attributes(self.shape)
        attrs = (_LaunchAttribute * max(len(attributes), 1))()
        for slot, (kind, first, second) in zip(attrs, attributes):
            slot.id, slot.value[0], slot.value[1] = kind, first, second
        if attributes:
            config.attrs, config.numAttrs = attrs, len(attributes)
        state = (view, config, ctypes.byref(config), ctypes.addressof(argv), (buf, argv, attrs))
        self._local.state = state
        return state

    def _refused(self, *values) -> tuple[int, str, object]:
        """(index, why, value) of the first value struct will not pack, worded as the C
        launcher words it (struct's own messages change between Python versions)."""
        for index, (p, value) in enumerate(zip(self.params, values)):
            try:
                struct.pack("<" + _STRUCT_CODE[p.type], value)
            except (struct.error, OverflowError):
                return index, _why(_STRUCT_CODE[p.type], value), value
        raise AssertionError(f"{self.name}: struct refused the arguments but none alone")

    def _packing_failed(self, index: int, detail: str, value):
        described = ", ".join(f"{p.name}: {p.type}" for p in self.params)
        got = repr(value) if isinstance(value, (int, float)) else type(value).__name__
        raise TypeError(f"{self.name} takes ({described}); packing the arguments failed: "
                        f"{self.params[index].name} got {got}: {detail}") from None

    def _failed(self, err: int, relaunch) -> None:
        if err in _WRONG_CONTEXT and self.context is not None:
            # This thread has no context, or another device's: launch again inside the
            # function's own, then restore the caller's. Checking first would cost every
            # launch a driver call.
            call("cuCtxPushCurrent", self.context)
            try:
                err = relaunch()
            finally:
                call("cuCtxPopCurrent")
        if err:
            cu = bindings()
            check(cu, cu.CUresult(err), f"launch of {self.name}")
