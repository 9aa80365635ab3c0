"""What every torch-facing op shares: argument checks with clear errors, the stream, the
kernel for a device.

The checks run on every call, so each one is a few attribute reads; they name the
argument, what it got and what it needs.
"""

from __future__ import annotations

import functools

import torch

from .. import arch as _arch
from .. import jit

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # the handle, without a Stream object
except AttributeError:  # CPU-only builds of torch
    def _raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream


def current_stream(device_index: int) -> int:
    return _raw_stream(device_index)


def check_tensor(name: str, t, dtype: torch.dtype, ndim: int | tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    dims = t.dim()
    if dims != ndim and (isinstance(ndim, int) or dims not in ndim):
        want = ndim if isinstance(ndim, int) else " or ".join(str(n) for n in ndim)
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def check_rows(name: str, t) -> int:
    """Rows of 16-byte aligned, unit-stride elements (what 16-byte vector accesses need).
    Returns the row stride in elements (0 for a 1-D tensor)."""
    strides = t.stride()
    if strides[-1] != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides "
                         f"{tuple(strides)}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address, got {t.data_ptr():#x}")
    if len(strides) == 1:
        return 0
    if (strides[-2] * t.itemsize) % 16:
        raise ValueError(f"{name}'s row stride must be a multiple of 16 bytes, got "
                         f"{strides[-2]} elements of {t.itemsize} bytes")
    return strides[-2]


def check_device(name: str, t, device_index: int) -> None:
    if t.get_device() != device_index:
        raise ValueError(f"{name} is on {t.device} but the input is on cuda:{device_index}")


def check_output(name: str, out, dtype: torch.dtype, shape, device_index: int, *inputs) -> None:
    """A caller-provided output: right dtype, shape and device, and overlapping none of
    ``inputs`` (the kernels read inputs through the read-only cache, which must not see
    writes)."""
    check_tensor(name, out, dtype, len(shape))
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    check_device(name, out, device_index)
    start = out.data_ptr()
    end = start + span_bytes(out)
    for t in inputs:
        other = t.data_ptr()
        if start < other + span_bytes(t) and other < end:
            raise ValueError(f"{name} overlaps an input; outputs must not alias inputs")


def span_bytes(t) -> int:
    """Bytes from a tensor's first element to just past its last."""
    if t.is_contiguous():
        return t.numel() * t.itemsize
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.itemsize


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int) -> _arch.Arch:
    return _arch.for_device(device_index)


def load(kernel_builder, device_index: int):
    """Compile (or fetch) a kernel and load it on a device: the module to launch."""
    return jit.build(kernel_builder).load(device_index)
