"""What every torch-facing op shares: argument checks with clear errors, the stream, the
kernel for a device.

The checks run on every call, so each one is a few attribute reads; they name the
argument, what it got and what it needs. An op checks every argument first and calls
``require_cuda`` last, before it allocates, copies or launches: a user without a GPU
sees what else is wrong with the call before being told to move it to one.
"""

from __future__ import annotations

import functools

import torch

from .. import arch as _arch
from .. import settings

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # the handle, without a Stream object
except AttributeError:  # CPU-only builds of torch
    def _raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream


current_stream = _raw_stream  # (device index) -> the cudaStream_t torch is using there


def inspect(name: str, t, dtype: torch.dtype, ndim, *, align: int = 16,
            device: int | None = None, rows: bool = True) -> tuple:
    """Check a tensor argument and return what the launch needs from it:
    ``(shape, strides, data pointer, device index)``, the index -1 off CUDA.

    Checked: a torch.Tensor of ``dtype`` with ``ndim`` dimensions (an int or a tuple of
    allowed counts), on the CUDA device ``device`` when one is given (a tensor after a
    first one off CUDA is not compared: ``require_cuda`` names the first), its start
    address a multiple of ``align`` bytes and, with ``rows``, unit stride in the last
    dimension and a row stride that keeps every row ``align``-aligned. Each attribute is
    read once: this runs on every call."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    shape = t.shape
    if len(shape) != ndim and (isinstance(ndim, int) or len(shape) not in ndim):
        want = ndim if isinstance(ndim, int) else " or ".join(str(n) for n in ndim)
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(shape)}")
    index = t.get_device()
    if device is not None and index != device:
        require_cuda(name, t, index)
        if device >= 0:
            raise ValueError(f"{name} is on cuda:{index} but the input is on cuda:{device}")
    strides, ptr = t.stride(), t.data_ptr()
    if ptr % align:
        raise ValueError(f"{name} must start at a {align}-byte aligned address, got {ptr:#x}")
    if not rows:
        return shape, strides, ptr, index
    if strides[-1] != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides "
                         f"{tuple(strides)}")
    if len(shape) > 1 and (strides[-2] * t.itemsize) % align:
        raise ValueError(f"{name}'s row stride must be a multiple of {align} bytes, got "
                         f"{strides[-2]} elements of {t.itemsize} bytes")
    if len(shape) > 1 and strides[-2] * t.itemsize >= 1 << 31:  # the kernels' strides are 32-bit
        raise ValueError(f"{name}'s row stride must be under 2 GiB, got {strides[-2]} elements")
    return shape, strides, ptr, index


def require_cuda(name: str, t: torch.Tensor, device: int) -> None:
    """``t`` (argument ``name``, on the device ``inspect`` returned) must be on a CUDA
    device. Each op calls this after its other checks and before it touches data."""
    if device < 0:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def traced(name: str, *args, out=None, config=None, **kwargs):
    """What a public function runs while Dynamo traces it (``torch.compiler.
    is_dynamo_compiling()``: false inside a compile backend, which may call the function
    for real, as ptxforge's quantizing weights does): its
    torch.library operator, ``torch.ops.ptxforge.<name>``, which the graph records (the
    function's own checks read data pointers, which the tracer's fake tensors do not
    have); the results copied into ``out`` where the caller gave it. ``config=`` has no
    place in an operator's schema: refused by name."""
    if config is not None:
        raise ValueError(f"config= cannot be traced by torch.compile (torch.ops.ptxforge."
                         f"{name} has no such argument): leave it to the stored choice")
    results = getattr(torch.ops.ptxforge, name)(*args, **kwargs)
    if out is None:
        return results
    if isinstance(out, torch.Tensor):
        return out.copy_(results)
    for given, result in zip(out, results):
        given.copy_(result)
    return tuple(out)


def pair(name: str, value, holds: str):
    """``value`` as ``(data, scales)``: a tuple or list of two items, ``holds`` saying
    what they are (``inspect`` checks each, naming ``name[0]`` and ``name[1]``)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        got = type(value).__name__
        if isinstance(value, (tuple, list)):
            got += f" of length {len(value)}"
        raise TypeError(f"{name} must be a pair (data, scales): {holds}, got {got}")
    return value


def require_shape(name: str, shape, expected) -> None:
    if shape != expected:
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(shape)}")


def require_contiguous_rows(name: str, shape, strides) -> None:
    """A matrix whose rows follow each other (what the kernels' output stores assume)."""
    if len(shape) == 2 and strides[0] != shape[1] and shape[0] > 1:
        raise ValueError(f"{name} must be contiguous, got strides {tuple(strides)}")


def row_span(ptr: int, rows: int, row_stride: int, cols: int, itemsize: int) -> tuple[int, int]:
    """(first byte, byte count) of a [rows, cols] matrix with a row stride, from known
    numbers: no tensor calls on the launch path."""
    return ptr, (((rows - 1) * row_stride + cols) * itemsize if rows and cols else 0)


def strided_span(ptr: int, shape, strides, itemsize: int) -> tuple[int, int]:
    """(first byte, byte count) a strided tensor's elements lie within. A plain loop: this
    runs on every call, and a generator with sum() costs twice as much."""
    last = 0
    for size, stride in zip(shape, strides):
        if not size:
            return ptr, 0
        last += (size - 1) * stride
    return ptr, (last + 1) * itemsize


def require_disjoint(name: str, span: tuple[int, int], *inputs: tuple[int, int]) -> None:
    """An output must not overlap an input: the kernels read inputs through the read-only
    cache, which must not see writes."""
    start, nbytes = span
    for other, other_bytes in inputs:
        if start < other + other_bytes and other < start + nbytes:
            raise ValueError(f"{name} overlaps an input; outputs must not alias inputs")


def require_pdl(pdl) -> None:
    """A call's ``pdl=`` must be True, False or None; the ops call this only when it is not
    None, so the default costs a call nothing."""
    if pdl is not True and pdl is not False:
        raise TypeError(f"pdl must be True, False or None, got {pdl!r}")


@functools.lru_cache(maxsize=None)
def default_pdl() -> bool:
    """What ``pdl=None`` means: PTXFORGE_PDL, read once per process."""
    return settings.pdl()


def programmatic(pdl: bool | None) -> bool:
    """Whether a call's ``pdl=`` asks for a programmatic dependent launch. Called where the
    ops make their (cached) launchers, never per call."""
    return default_pdl() if pdl is None else pdl


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int) -> _arch.Arch:
    return _arch.for_device(device_index)


def inspect_quantized_out(q, scales, shape, scale_shape, device: int, *input_spans) -> tuple:
    """``out=(q, scales)`` given to a quantizer, unpacked by ``pair``: q e4m3 of ``shape``
    with contiguous rows, scales f32 of ``scale_shape`` with any strides, overlapping
    neither the inputs nor each other. Returns (q pointer, scales pointer, scales strides)."""
    q_shape, q_strides, q_ptr, _ = inspect("out[0]", q, torch.float8_e4m3fn, 2, align=8,
                                           device=device)
    require_shape("out[0]", q_shape, shape)
    require_contiguous_rows("out[0]", q_shape, q_strides)
    s_shape, s_strides, s_ptr, _ = inspect("out[1]", scales, torch.float32, 2, align=4,
                                           device=device, rows=False)
    require_shape("out[1]", s_shape, scale_shape)
    q_span = (q_ptr, shape[0] * shape[1])
    require_disjoint("out[0]", q_span, *input_spans)
    s_span = strided_span(s_ptr, scale_shape, s_strides, 4)
    if s_span[1] > 4 << 32:  # the kernels index scales with 32-bit element offsets
        raise ValueError(f"out[1] must span fewer than 2**32 elements, got strides {tuple(s_strides)}")
    require_disjoint("out[1]", s_span, q_span, *input_spans)
    return q_ptr, s_ptr, s_strides
