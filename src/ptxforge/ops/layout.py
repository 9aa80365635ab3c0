"""Scale-tensor layouts shared by the quantization kernels and the FP8 GEMM.

The GEMM reads activation scales (one per token per 128 channels) with TMA along M, so
it wants them MN-major: ``s[m, g]`` at ``g * M_aligned + m``, with ``M_aligned`` rounded
up so each column is a multiple of 16 bytes. ``empty_mn_major_scales`` makes such a tensor,
viewed as [M, G] with strides (1, M_aligned), which is DeepGEMM's layout too.
"""

from __future__ import annotations

import torch

TMA_ALIGNMENT_BYTES = 16


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up so ``x * element_size`` is a multiple of 16 bytes."""
    if TMA_ALIGNMENT_BYTES % element_size:
        raise ValueError(f"element_size must divide {TMA_ALIGNMENT_BYTES}, got {element_size}")
    multiple = TMA_ALIGNMENT_BYTES // element_size
    return ceil_div(x, multiple) * multiple


def empty_mn_major_scales(rows: int, groups: int, device) -> torch.Tensor:
    """An uninitialised [rows, groups] f32 tensor in the MN-major TMA-aligned layout."""
    aligned = get_tma_aligned_size(rows, 4)
    return torch.empty_strided((rows, groups), (1, aligned), dtype=torch.float32, device=device)


def is_mn_major_tma_aligned(s: torch.Tensor) -> bool:
    """MN-major with TMA-aligned columns, starting on a 16-byte boundary."""
    rows = s.shape[0]
    return (s.stride(0) == 1 and s.data_ptr() % TMA_ALIGNMENT_BYTES == 0
            and (s.shape[1] == 1 or s.stride(1) == get_tma_aligned_size(rows, 4)))


def get_mn_major_tma_aligned_tensor(s: torch.Tensor) -> torch.Tensor:
    """``s`` [M, G] (or [B, M, G]) fp32 in the MN-major TMA-aligned layout: a 2-D ``s``
    already in it is returned as it is, anything else is copied."""
    if s.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {s.dtype}")
    if s.dim() == 2:
        if is_mn_major_tma_aligned(s):
            return s
        out = empty_mn_major_scales(s.shape[0], s.shape[1], s.device)
        out.copy_(s)
        return out
    if s.dim() == 3:
        batch, rows, groups = s.shape
        aligned = get_tma_aligned_size(rows, 4)
        out = torch.empty((batch, groups, aligned), dtype=s.dtype, device=s.device)
        out = out.transpose(1, 2)[:, :rows]
        out.copy_(s)
        return out
    raise ValueError(f"scales must have 2 or 3 dimensions, got shape {tuple(s.shape)}")
