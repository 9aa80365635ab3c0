"""Per-block (128 x 128) FP8 quantization of weights, on torch tensors."""

from __future__ import annotations

import functools

import torch

from .. import jit
from ..kernels import bf16_block_quant_fp8 as block_kernel
from ._common import (check_output, check_rows, check_tensor, current_stream, device_arch,
                      row_span)
from .layout import ceil_div


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int):
    cfg = block_kernel.choose_config(device_arch(device_index))
    return jit.build(block_kernel.generate(cfg)).load(device_index).launcher(
        cfg.threads, cfg.dynamic_shared_bytes)


def quantize_fp8_per_block(w: torch.Tensor, *, out=None):
    """128x128-block FP8 quantization (DeepGEMM's weight recipe).

    w: bf16 [N, K] (rows may be strided), K a multiple of 8. Returns ``(q, scales)``:
    q e4m3 [N, K] contiguous and scales f32 [ceil(N/128), ceil(K/128)] with
    ``w ~= q * scales`` per block. ``out=(q, scales)`` writes into given tensors instead
    (q contiguous, scales with unit column stride).
    """
    check_tensor("w", w, torch.bfloat16, 2)
    row_stride, w_ptr = check_rows("w", w)
    n, k = w.shape
    if k % block_kernel.VECTOR:
        raise ValueError(f"w.shape[1] must be a multiple of {block_kernel.VECTOR}, got {k}")
    block = block_kernel.BLOCK
    scale_shape = (ceil_div(n, block), ceil_div(k, block))
    device = w.get_device()
    if out is None:
        q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty(scale_shape, dtype=torch.float32, device=w.device)
        q_ptr, s_ptr, s_row_stride = q.data_ptr(), scales.data_ptr(), scale_shape[1]
    else:
        q, scales = out
        w_span = row_span(w_ptr, n, row_stride, k, 2)
        q_ptr = check_output("out[0]", q, torch.float8_e4m3fn, w.shape, device, w_span)
        check_tensor("out[1]", scales, torch.float32, 2)
        s_strides = scales.stride()
        if s_strides[1] != 1:
            raise ValueError(f"out[1] must have unit column stride, got strides {tuple(s_strides)}")
        s_ptr = check_output("out[1]", scales, torch.float32, torch.Size(scale_shape), device,
                             w_span, (q_ptr, n * k), strides=s_strides)
        s_row_stride = s_strides[0]
    if n and k:
        _launcher(device)((scale_shape[1], scale_shape[0], 1), current_stream(device),
                          (w_ptr, row_stride, n, k, q_ptr, s_ptr, s_row_stride))
    return q, scales
