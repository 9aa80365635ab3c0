"""Scale-tensor layouts shared by the quantization kernels and the FP8 GEMM.

The GEMM reads activation scales (one per token per 128 channels) with TMA along M, so
it wants them MN-major: ``s[m, g]`` at ``g * M_aligned + m``, with ``M_aligned`` rounded
up so each column is a multiple of TMA's alignment (``arch.tma_alignment()``, 16 bytes).
``empty_mn_major_scales`` makes such a tensor, viewed as [M, G] with strides
(1, M_aligned), which is DeepGEMM's layout too.
"""

from __future__ import annotations

import torch

from ..arch import tma_alignment
from .common import inspect


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up so ``x * element_size`` is a multiple of TMA's alignment."""
    alignment = tma_alignment()
    if alignment % element_size:
        raise ValueError(f"element_size must divide {alignment}, got {element_size}")
    multiple = alignment // element_size
    return ceil_div(x, multiple) * multiple


def empty_mn_major_scales(rows: int, groups: int, device, batch: int | None = None) -> torch.Tensor:
    """An uninitialised [rows, groups] f32 tensor in the MN-major TMA-aligned layout, or
    with ``batch`` [batch, rows, groups], each batch's columns after the last's."""
    aligned = get_tma_aligned_size(rows, 4)
    if batch is None:
        return torch.empty_strided((rows, groups), (1, aligned), dtype=torch.float32,
                                   device=device)
    return torch.empty_strided((batch, rows, groups), (groups * aligned, 1, aligned),
                               dtype=torch.float32, device=device)


def is_mn_major_tma_aligned(shape, strides, ptr: int) -> bool:
    """An [M, G] tensor of this shape, strides and data pointer is MN-major with TMA-aligned
    columns, starting on a TMA-aligned address. From numbers the caller has read: the GEMM
    asks on every call."""
    return (strides[0] == 1 and ptr % tma_alignment() == 0
            and (shape[1] == 1 or strides[1] == get_tma_aligned_size(shape[0], 4)))


def get_mn_major_tma_aligned_tensor(s: torch.Tensor) -> torch.Tensor:
    """``s`` [M, G] (or [B, M, G]) fp32 in the MN-major TMA-aligned layout: a 2-D ``s``
    already in it is returned as it is, anything else is copied."""
    shape, strides, ptr, _ = inspect("scales", s, torch.float32, (2, 3), align=4, rows=False)
    if len(shape) == 2:
        if is_mn_major_tma_aligned(shape, strides, ptr):
            return s
        out = empty_mn_major_scales(shape[0], shape[1], s.device)
        out.copy_(s)
        return out
    batch, rows, groups = shape
    out = empty_mn_major_scales(rows, groups, s.device, batch)
    out.copy_(s)
    return out


get_col_major_tma_aligned_tensor = get_mn_major_tma_aligned_tensor  # DeepGEMM's older name
