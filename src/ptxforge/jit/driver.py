"""The CUDA driver: contexts, modules, functions, the PTX JIT fallback, and the launch.

Everything but the launch goes through ``cuda.bindings.driver``. The launch itself calls
``cuLaunchKernelEx`` in ``libcuda`` through ctypes with a per-thread, pre-laid-out
argument buffer: on an H200 this costs 6.4 us per call against 8.2 us for the same call
through ``cuda.bindings`` (``../shared/anchors/h200-launch-cost-2026-11-21.md``), and the
per-call host budget is 8 us.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

from .assemble import AssemblyError


class CudaError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _cu():
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    _check(driver, err, "cuInit")
    return driver


def _check(cu, err, what: str):
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        text = text.decode() if isinstance(text, bytes) else text
        raise CudaError(f"{what} failed: {name}: {text}")


def call(what: str, *args):
    """Call ``cuda.bindings.driver.<what>(*args)``, raise CudaError on failure, return its values."""
    cu = _cu()
    result = getattr(cu, what)(*args)
    _check(cu, result[0], what)
    values = result[1:]
    return values[0] if len(values) == 1 else values or None


def driver_version() -> str:
    v = call("cuDriverGetVersion")
    return f"{v // 1000}.{(v % 1000) // 10}"


@functools.lru_cache(maxsize=None)
def primary_context(device_index: int):
    """The device's primary context: the one PyTorch's runtime calls use too."""
    device = call("cuDeviceGet", device_index)
    return call("cuDevicePrimaryCtxRetain", device)


class _ContextScope:
    def __init__(self, device_index: int):
        self.ctx = primary_context(device_index)

    def __enter__(self):
        call("cuCtxPushCurrent", self.ctx)

    def __exit__(self, *exc):
        call("cuCtxPopCurrent")


def link_ptx(ptx: str, target: str) -> tuple[bytes, str]:
    """Assemble with the driver's JIT (on device 0) and return (cubin, log)."""
    cu = _cu()
    log_size = 1 << 16
    info, error = bytearray(log_size), bytearray(log_size)
    options = [cu.CUjit_option.CU_JIT_INFO_LOG_BUFFER, cu.CUjit_option.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
               cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
               cu.CUjit_option.CU_JIT_LOG_VERBOSE]
    values = [info, log_size, error, log_size, 1]
    with _ContextScope(0):
        state = call("cuLinkCreate", len(options), options, values)
        try:
            data = ptx.encode() + b"\0"
            err, = cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, data, len(data),
                                    b"kernel.ptx", 0, [], [])
            if int(err) == 0:
                err, cubin_ptr, size = cu.cuLinkComplete(state)
            if int(err) != 0:
                raise AssemblyError.rejected(f"driver {driver_version()}",
                                             error.rstrip(b"\0").decode(errors="replace"), ptx)
            cubin = ctypes.string_at(int(cubin_ptr), size)
        finally:
            call("cuLinkDestroy", state)
    return cubin, info.rstrip(b"\0").decode(errors="replace")


# ---------------------------------------------------------------------------- launch
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


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_WRONG_CONTEXT = (201, 400)  # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE


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


class Launcher:
    """Launches one loaded function with a fixed block shape, dynamic shared memory and
    cluster size; arguments are packed as the kernel's parameter list lays them out.

    Per call only the grid, the stream and the argument bytes change: one ``pack_into``,
    four field stores and the ctypes call. Each thread has its own buffers, since ctypes
    releases the GIL during the call."""

    def __init__(self, function, params, name: str, *, block: int, shared_bytes: int = 0,
                 cluster: int = 1, context=None):
        self.function = ctypes.c_void_p(int(function))  # converted once, not per call
        self.name = name
        self.context = context  # the primary context the function was loaded into
        self.block, self.shared_bytes, self.cluster = block, shared_bytes, cluster
        self.format, self.offsets, self.size = argument_layout(params)
        self.param_names = [f"{p.name}: {p.type}" for p in params]
        self._pack = struct.Struct(self.format).pack_into
        self._local = threading.local()
        self._launch = _libcuda_launch()

    def _new_state(self):
        buf = ctypes.create_string_buffer(self.size + 64)
        start = (ctypes.addressof(buf) + 63) & ~63  # tensor maps want 64-byte alignment
        argv = (ctypes.c_void_p * max(len(self.offsets), 1))(*[start + o for o in self.offsets])
        view = (ctypes.c_char * self.size).from_address(start)
        config, attr = _LaunchConfig(), _LaunchAttribute()
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block, 1, 1
        config.sharedMemBytes = self.shared_bytes
        if self.cluster > 1:  # value.clusterDim = {x, y, z} as three uint32
            attr.id = _CLUSTER_DIMENSION
            attr.value[0], attr.value[1] = self.cluster | (1 << 32), 1
            config.attrs, config.numAttrs = ctypes.pointer(attr), 1
        state = (view, config, ctypes.byref(config), ctypes.addressof(argv), (buf, argv, attr))
        self._local.state = state
        return state

    def __call__(self, grid: tuple, stream: int, args: tuple) -> None:
        state = getattr(self._local, "state", None) or self._new_state()
        view, config, config_ref, argv_address, _ = state
        try:
            self._pack(view, 0, *args)
        except struct.error as exc:  # the caller's tuple does not match the parameter list
            raise TypeError(f"{self.name} takes ({', '.join(self.param_names)}); "
                            f"packing {len(args)} arguments failed: {exc}") from None
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.hStream = stream
        err = self._launch(config_ref, self.function, argv_address, None)
        if err in _WRONG_CONTEXT and self.context is not None:
            # This thread has no context, or another device's: launch again inside the
            # function's own, then restore the caller's. Checking first would cost every
            # launch a driver call.
            call("cuCtxPushCurrent", self.context)
            try:
                err = self._launch(config_ref, self.function, argv_address, None)
            finally:
                call("cuCtxPopCurrent")
        if err:
            _check(_cu(), _cu().CUresult(err), f"launch of {self.name}")


class LoadedModule:
    """A cubin loaded into one device's primary context, with its single entry function."""

    def __init__(self, cubin: bytes, entry: str, device_index: int, params):
        cu = _cu()
        self.device_index = device_index
        with _ContextScope(device_index):
            self.module = call("cuModuleLoadData", cubin)
            self.function = call("cuModuleGetFunction", self.module, entry.encode())
        self._attr = cu.CUfunction_attribute
        self._params, self._entry = params, entry
        self._dynamic_shared_limit = 48 * 1024

    def attribute(self, name: str) -> int:
        return call("cuFuncGetAttribute", getattr(self._attr, name), self.function)

    def launcher(self, block: int, shared_bytes: int = 0, cluster: int = 1) -> Launcher:
        """A launcher for one launch shape (raising the shared-memory limit if it needs to)."""
        self.allow_dynamic_shared(shared_bytes)
        return Launcher(self.function, self._params, self._entry, block=block,
                        shared_bytes=shared_bytes, cluster=cluster,
                        context=primary_context(self.device_index))

    def max_active_clusters(self, block: int, shared_bytes: int, cluster: int) -> int:
        """How many clusters of ``cluster`` CTAs can run at once on the device: SMs of a
        GPC that cannot hold a whole cluster stay out, so this can be less than SMs / cluster."""
        cu = _cu()
        self.allow_dynamic_shared(shared_bytes)
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes = shared_bytes
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        config.attrs, config.numAttrs = [attr], 1
        with _ContextScope(self.device_index):
            return call("cuOccupancyMaxActiveClusters", self.function, config)

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Raise the function's dynamic shared-memory limit (needed above 48 KiB)."""
        if nbytes > self._dynamic_shared_limit:
            call("cuFuncSetAttribute", self.function,
                 self._attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
            self._dynamic_shared_limit = nbytes
