"""The CUDA driver through ``cuda.bindings.driver``: initialisation, checked calls, the
devices' primary contexts."""

from __future__ import annotations

import functools


class CudaError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def bindings():
    """``cuda.bindings.driver``, initialised (cuInit) on first use."""
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    check(driver, err, "cuInit")
    return driver


def check(cu, err, what: str):
    """Raise CudaError, naming ``what`` and the driver's error, for a non-zero ``err``."""
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        text = text.decode() if isinstance(text, bytes) else text
        raise CudaError(f"{what} failed: {name}: {text}")


def call(what: str, *args):
    """Call ``cuda.bindings.driver.<what>(*args)``, raise CudaError on failure, return its values."""
    cu = bindings()
    result = getattr(cu, what)(*args)
    check(cu, result[0], what)
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


class ContextScope:
    def __init__(self, device_index: int):
        self.ctx = primary_context(device_index)

    def __enter__(self):
        call("cuCtxPushCurrent", self.ctx)

    def __exit__(self, *exc):
        call("cuCtxPopCurrent")
