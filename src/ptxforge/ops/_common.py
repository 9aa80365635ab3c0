"""What every torch-facing op shares: argument checks with clear errors, the stream, the
kernel for a device.

The checks run on every call, so each one is a few attribute reads; they name the
argument, what it got and what it needs.
"""

from __future__ import annotations

import functools

import torch

from .. import arch as _arch

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


def check_rows(name: str, t) -> tuple[int, int]:
    """Rows of 16-byte aligned, unit-stride elements (what 16-byte vector accesses need).
    Returns (row stride in elements, 0 for a 1-D tensor; data pointer)."""
    strides = t.stride()
    ptr = t.data_ptr()
    if strides[-1] != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides "
                         f"{tuple(strides)}")
    if ptr % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address, got {ptr:#x}")
    if len(strides) == 1:
        return 0, ptr
    if (strides[-2] * t.itemsize) % 16:
        raise ValueError(f"{name}'s row stride must be a multiple of 16 bytes, got "
                         f"{strides[-2]} elements of {t.itemsize} bytes")
    return strides[-2], ptr


def check_device(name: str, t, device_index: int) -> None:
    if t.get_device() != device_index:
        raise ValueError(f"{name} is on {t.device} but the input is on cuda:{device_index}")


def row_span(ptr: int, rows: int, row_stride: int, cols: int, itemsize: int) -> tuple[int, int]:
    """(first byte, byte count) of a [rows, cols] matrix with a row stride, from known
    numbers: no tensor calls on the launch path."""
    return ptr, (((rows - 1) * row_stride + cols) * itemsize if rows and cols else 0)


def check_output(name: str, out, dtype: torch.dtype, shape, device_index: int,
                 *inputs: tuple[int, int], strides: tuple | None = None) -> int:
    """A caller-provided output: right dtype, shape and device, contiguous (or with the
    given element ``strides``), and overlapping none of the ``inputs`` spans (the kernels
    read inputs through the read-only cache, which must not see writes). Returns its
    data pointer."""
    check_tensor(name, out, dtype, len(shape))
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    check_device(name, out, device_index)
    if strides is None:
        if not out.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(out.stride())}")
        strides = (shape[1], 1) if len(shape) == 2 else None
    ptr = out.data_ptr()
    if len(shape) == 2:
        start, nbytes = row_span(ptr, shape[0], strides[0], 1 + (shape[1] - 1) * strides[1],
                                 out.itemsize)
    else:
        start, nbytes = ptr, out.numel() * out.itemsize
    for other, other_bytes in inputs:
        if start < other + other_bytes and other < start + nbytes:
            raise ValueError(f"{name} overlaps an input; outputs must not alias inputs")
    return ptr


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int) -> _arch.Arch:
    return _arch.for_device(device_index)
