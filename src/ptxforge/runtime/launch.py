"""Launches: ``cuLaunchKernelEx`` in libcuda through ctypes, arguments bound by name.

A ``Launcher`` is made once per kernel and launch shape. Calling it binds the kernel's
parameters by name (``launcher(grid, stream, x=..., rows=...)``): the parameter list the
kernel declared decides the order and layout of the argument buffer, so no caller repeats
it. The call is a method generated for that parameter list (as Triton generates its
launchers), with a per-thread, pre-laid-out argument buffer: one ``pack_into``, four field
stores and the ctypes call. Through ctypes the launch costs 6.4 us a call on an H200
against 8.2 us through ``cuda.bindings`` (``shared/anchors/h200-launch-cost-2026-11-21.md``).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

from .driver import bindings, call, check


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


# The call of a launcher, specialised on its kernel's parameter names.
_CALL = """
def __call__(self, grid, stream, *, {params}):
    state = self._local.__dict__.get("state") or self._new_state()
    try:
        self._pack(state[0], 0, {params})
    except struct.error as exc:
        self._packing_failed(exc)
    config = state[1]
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.hStream = stream
    err = self._launch(state[2], self._function, state[3], None)
    if err:
        self._failed(err, state)
"""


class Launcher:
    """Launches one loaded function with one ``LaunchShape`` (block, dynamic shared memory,
    cluster, cooperative and programmatic launch). ``launcher(grid, stream, **arguments)``
    binds every kernel parameter by name; ``grid`` is 3 ints, ``stream`` a cudaStream_t
    handle as an int. Each launcher is an instance of a subclass whose ``__call__`` is
    generated for its kernel's parameter list (a missing or unknown name is a TypeError
    naming the kernel). Each thread has its own buffers: ctypes releases the GIL during
    the call."""

    def __new__(cls, function, params, name: str, shape, *, context=None):
        names = [p.name for p in params]
        if {"self", "grid", "stream"} & set(names):
            raise ValueError(f"{name}: a kernel parameter may not be named self, grid or stream")
        namespace = {"struct": struct}
        exec(_CALL.format(params=", ".join(names)), namespace)
        call = namespace["__call__"]
        call.__qualname__ = name  # TypeErrors read "<kernel>() missing ... argument: 'x'"
        return object.__new__(type(cls.__name__, (cls,), {"__call__": call}))

    def __init__(self, function, params, name: str, shape, *, context=None):
        self.name = name
        self.shape = shape
        self.context = context  # the primary context the function was loaded into
        self.params = list(params)
        self.tensor_maps = {p.name: p.tensor_map for p in params if p.tensor_map is not None}
        self._function = ctypes.c_void_p(int(function))  # converted once, not per call
        fmt, self._offsets, self._size = argument_layout(params)
        self._pack = struct.Struct(fmt).pack_into
        self._local = threading.local()
        self._launch = self._first_launch  # then libcuda's cuLaunchKernelEx itself

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

    def _packing_failed(self, exc: struct.error):
        described = ", ".join(f"{p.name}: {p.type}" for p in self.params)
        raise TypeError(f"{self.name} takes ({described}); packing the arguments failed: "
                        f"{exc}") from None

    def _failed(self, err: int, state) -> None:
        if err in _WRONG_CONTEXT and self.context is not None:
            # This thread has no context, or another device's: launch again inside the
            # function's own, then restore the caller's. Checking first would cost every
            # launch a driver call.
            call("cuCtxPushCurrent", self.context)
            try:
                err = self._launch(state[2], self._function, state[3], None)
            finally:
                call("cuCtxPopCurrent")
        if err:
            cu = bindings()
            check(cu, cu.CUresult(err), f"launch of {self.name}")
