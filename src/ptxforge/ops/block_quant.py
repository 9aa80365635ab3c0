"""Per-block (128 x 128) FP8 quantization of weights, on torch tensors."""

from __future__ import annotations

import functools

import torch

from .. import jit
from ..kernels import bf16_block_quant_fp8 as block_kernel
from ._common import ceil_div, check_rows, check_tensor, current_stream, device_arch


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int):
    cfg = block_kernel.choose_config(device_arch(device_index))
    return jit.build(block_kernel.generate(cfg)).load(device_index).launcher(cfg.threads)


def quantize_fp8_per_block(w: torch.Tensor):
    """128x128-block FP8 quantization (DeepGEMM's weight recipe).

    w: bf16 [N, K] (rows may be strided), K a multiple of 8. Returns ``(q, scales)``:
    q e4m3 [N, K] contiguous and scales f32 [ceil(N/128), ceil(K/128)] with
    ``w ~= q * scales`` per block.
    """
    check_tensor("w", w, torch.bfloat16, 2)
    check_rows("w", w)
    n, k = w.shape
    if k % block_kernel.VECTOR:
        raise ValueError(f"w.shape[1] must be a multiple of {block_kernel.VECTOR}, got {k}")
    block = block_kernel.BLOCK
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty((ceil_div(n, block), ceil_div(k, block)), dtype=torch.float32,
                         device=w.device)
    if n and k:
        device = w.get_device()
        _launcher(device)((ceil_div(k, block), ceil_div(n, block), 1), current_stream(device),
                          (w.data_ptr(), w.stride(0), n, k, q.data_ptr(), scales.data_ptr(),
                           scales.stride(0)))
    return q, scales
