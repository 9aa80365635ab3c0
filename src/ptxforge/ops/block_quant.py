"""Per-block (128 x 128) FP8 quantization of weights, on torch tensors."""

from __future__ import annotations

import functools

import torch

from .. import jit
from ..kernels import bf16_block_quant_fp8 as block_kernel
from .common import (current_stream, device_arch, inspect, inspect_quantized_out, pair,
                      programmatic, require_cuda, require_pdl, row_span, traced)
from .layout import ceil_div


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int, pdl: bool | None):
    cfg = block_kernel.choose_config(device_arch(device_index))
    return jit.build(block_kernel.generate(cfg)).launcher(device_index,
                                                          programmatic=programmatic(pdl))


def block_quantized_outputs(n: int, k: int, device) -> tuple:
    """What ``quantize_fp8_per_block`` allocates for w [N, K]: q e4m3 [N, K] and f32
    scales [ceil(N/128), ceil(K/128)], both contiguous."""
    block = block_kernel.BLOCK
    return (torch.empty((n, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((ceil_div(n, block), ceil_div(k, block)), dtype=torch.float32,
                        device=device))


def quantize_fp8_per_block(w: torch.Tensor, *, out=None, pdl: bool | None = None):
    """128x128-block FP8 quantization (DeepGEMM's weight recipe).

    w: bf16 [N, K] (rows may be strided), K a multiple of 8. Returns ``(q, scales)``:
    q e4m3 [N, K] contiguous and scales f32 [ceil(N/128), ceil(K/128)] with
    ``w ~= q * scales`` per block. ``out=(q, scales)`` writes into given tensors instead
    (q contiguous, scales with unit column stride). ``pdl``: launch with programmatic
    dependent launch (as ``rms_norm``'s); None: the process default, ``PTXFORGE_PDL``.
    """
    if torch.compiler.is_dynamo_compiling():
        return traced("quantize_fp8_per_block", w, out=out, pdl=pdl)
    shape, strides, w_ptr, device = inspect("w", w, torch.bfloat16, 2)
    n, k = shape
    row_stride = strides[0]
    if k % block_kernel.VECTOR:
        raise ValueError(f"w.shape[1] must be a multiple of {block_kernel.VECTOR}, got {k}")
    block = block_kernel.BLOCK
    scale_shape = (ceil_div(n, block), ceil_div(k, block))
    if out is not None:
        q, scales = pair("out", out, "e4m3 [N, K] and f32 [ceil(N/128), ceil(K/128)]")
        q_ptr, s_ptr, s_strides = inspect_quantized_out(q, scales, shape, scale_shape, device,
                                                        row_span(w_ptr, n, row_stride, k, 2))
        if s_strides[1] != 1:
            raise ValueError(f"out[1] must have unit column stride, got strides {tuple(s_strides)}")
        s_row_stride = s_strides[0]
    if pdl is not None:
        require_pdl(pdl)
    require_cuda("w", w, device)
    # The blocks' rows are the grid's y dimension: the device's limit, known once there is one.
    max_block_rows = device_arch(device).max_grid[1]
    if scale_shape[0] > max_block_rows:
        raise ValueError(f"w may have at most {max_block_rows * block} rows, got {n}")
    if out is None:
        q, scales = block_quantized_outputs(n, k, w.device)
        q_ptr, s_ptr, s_row_stride = q.data_ptr(), scales.data_ptr(), scale_shape[1]
    if n and k:
        _launcher(device, pdl)((scale_shape[1], scale_shape[0], 1), current_stream(device), x=w_ptr,
                          x_row_stride=row_stride, rows=n, cols=k, q=q_ptr, scales=s_ptr,
                          scale_row_stride=s_row_stride)
    return q, scales
