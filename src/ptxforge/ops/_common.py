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
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def check_rows(name: str, t) -> None:
    """Rows of 16-byte aligned, unit-stride elements (what 16-byte vector accesses need)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides "
                         f"{tuple(t.stride())}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address, got {t.data_ptr():#x}")
    if t.dim() > 1 and (t.stride(-2) * t.element_size()) % 16:
        raise ValueError(f"{name}'s row stride must be a multiple of 16 bytes, got "
                         f"{t.stride(-2)} elements of {t.element_size()} bytes")


def check_output(name: str, out, dtype: torch.dtype, shape: tuple, like) -> None:
    """A caller-provided output: right dtype, shape and device, and not overlapping ``like``
    (the kernels read inputs through the read-only cache, which must not see writes)."""
    check_tensor(name, out, dtype, len(shape))
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.device != like.device:
        raise ValueError(f"{name} is on {out.device} but the input is on {like.device}")
    start, end = out.data_ptr(), out.data_ptr() + _extent_bytes(out)
    other_start = like.data_ptr()
    if start < other_start + _extent_bytes(like) and other_start < end:
        raise ValueError(f"{name} overlaps the input; outputs must not alias inputs")


def _extent_bytes(t) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def check_same_device(reference_name: str, reference, **others) -> None:
    for name, t in others.items():
        if t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int) -> _arch.Arch:
    return _arch.for_device(device_index)


def load(kernel_builder, device_index: int):
    """Compile (or fetch) a kernel and load it on a device: the module to launch."""
    return jit.build(kernel_builder).load(device_index)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
