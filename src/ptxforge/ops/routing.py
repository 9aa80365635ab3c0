"""The MoE routing layout on torch tensors: from a router's top-k expert indices to the row
each (token, expert) pair takes in the grouped GEMMs' input, and the per-expert
bookkeeping those GEMMs read, computed on the GPU without a host sync (graph-safe).

One kernel (``kernels/i64_moe_routing_layout.py``), specialised on the expert count and
the layout; the token count, k and rows_per_expert are run-time arguments.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .. import jit
from ..kernels import i64_moe_routing_layout as routing_kernel
from .common import (current_stream, device_arch, inspect, programmatic,
                      require_contiguous_rows, require_cuda, require_pdl, traced)
from .gemm import get_mk_alignment_for_contiguous_layout

INT32_MAX = 2**31 - 1  # rows and counts are int32


class MoeRouting(NamedTuple):
    """What ``moe_routing_layout`` returns, int32 on topk_idx's device."""

    rows: torch.Tensor                # [T, k]: each pair's row, -1 where dropped
    counts: torch.Tensor              # [E]: pairs each expert received (masked: masked_m)
    m_indices: torch.Tensor | None    # [max_contiguous_rows(T, k, E)]: each row's expert or -1
    rows_used: torch.Tensor | None    # [1]: the end of the last segment


def max_contiguous_rows(tokens: int, k: int, experts: int) -> int:
    """The rows the contiguous layout may take for ``tokens`` tokens routed to ``k`` of
    ``experts`` experts each: every pair, and up to alignment - 1 rows of padding at the
    end of each expert's segment. The length of m_indices, and the rows of the grouped
    GEMM's input that the layout's rows index."""
    return tokens * k + experts * (get_mk_alignment_for_contiguous_layout() - 1)


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int, experts: int, layout: str, pdl: bool | None):
    cfg = routing_kernel.choose_config(device_arch(device_index), experts, layout)
    return jit.build(routing_kernel.generate(cfg)).launcher(device_index,
                                                            programmatic=programmatic(pdl))


def routing_outputs(tokens: int, k: int, experts: int, layout: str, device) -> MoeRouting:
    """What ``moe_routing_layout`` allocates (also the shapes its torch.library form
    reports)."""
    rows = torch.empty((tokens, k), dtype=torch.int32, device=device)
    counts = torch.empty((experts,), dtype=torch.int32, device=device)
    if layout == "masked":
        return MoeRouting(rows, counts, None, None)
    m_indices = torch.empty((max_contiguous_rows(tokens, k, experts),), dtype=torch.int32,
                            device=device)
    return MoeRouting(rows, counts, m_indices, torch.empty((1,), dtype=torch.int32,
                                                           device=device))


def moe_routing_layout(topk_idx: torch.Tensor, num_experts: int, *, layout: str = "contiguous",
                       rows_per_expert: int | None = None,
                       pdl: bool | None = None) -> MoeRouting:
    """Where each (token, expert) pair of a router's top-k goes in the grouped GEMMs' input.

    topk_idx: int64 [T, k], contiguous (``torch.topk``'s indices): pair p = t * k + j names
    expert topk_idx[t, j]. A pair naming no expert in [0, num_experts) is dropped (row -1);
    only the GPU sees the indices, so nothing else is said about them. Returns
    ``MoeRouting(rows, counts, m_indices, rows_used)``, int32:

    - rows [T, k]: the row each pair takes, -1 where dropped.
    - counts [E]: the pairs each expert received, dropped ones not counted.
    - layout "contiguous" (``m_grouped_*_gemm_nt_contiguous``): the experts' segments
      follow each other in expert order, each its count rounded up to
      ``get_mk_alignment_for_contiguous_layout()`` (128) rows, an expert without pairs
      taking none; a segment's pairs in the order of p. m_indices [max_contiguous_rows(T,
      k, E)]: each row's expert, -1 for a segment's padding and for every row from
      rows_used on; rows_used [1]: the end of the last segment.
    - layout "masked" (``m_grouped_*_gemm_nt_masked``): ``rows_per_expert`` rows per
      expert (default T): the pair of rank r within expert e (in the order of p) takes row
      e * rows_per_expert + r, and is dropped where r >= rows_per_expert (a token naming an
      expert twice, or a rows_per_expert under T); counts is masked_m. m_indices and
      rows_used are None.

    One kernel on one CTA, no host sync: capturable in a CUDA graph, which then lays out
    whatever routing topk_idx holds at each replay. The same input gives the same output,
    bit for bit. ``pdl``: as ``rms_norm``'s.
    """
    if torch.compiler.is_dynamo_compiling():
        return MoeRouting(*traced("moe_routing_layout", topk_idx, num_experts, layout=layout,
                                  rows_per_expert=rows_per_expert, pdl=pdl))
    shape, strides, ptr, device = inspect("topk_idx", topk_idx, torch.int64, 2, align=8)
    require_contiguous_rows("topk_idx", shape, strides)
    tokens, k = shape
    if type(num_experts) is not int or not 1 <= num_experts <= routing_kernel.MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {routing_kernel.MAX_EXPERTS}], "
                         f"got {num_experts!r}")
    if layout not in routing_kernel.LAYOUTS:
        raise ValueError(f"layout must be one of {routing_kernel.LAYOUTS}, got {layout!r}")
    if tokens * k > INT32_MAX:
        raise ValueError(f"topk_idx must have at most {INT32_MAX} pairs, got shape {tuple(shape)}")
    if layout == "masked":
        if rows_per_expert is None:
            rows_per_expert = tokens
        elif type(rows_per_expert) is not int or rows_per_expert < 1:
            raise ValueError(f"rows_per_expert must be a positive int, got {rows_per_expert!r}")
        if num_experts * rows_per_expert > INT32_MAX:
            raise ValueError(f"rows_per_expert must keep num_experts * rows_per_expert at most "
                             f"{INT32_MAX} (rows are int32), got {rows_per_expert} with "
                             f"{num_experts} experts")
    else:
        if rows_per_expert is not None:
            raise ValueError(f"rows_per_expert is the masked layout's, got {rows_per_expert!r} "
                             f"with layout 'contiguous'")
        m_rows = max_contiguous_rows(tokens, k, num_experts)
        if m_rows > INT32_MAX:
            raise ValueError(f"topk_idx's pairs and {num_experts} experts' padding must take at "
                             f"most {INT32_MAX} rows (rows are int32), got {m_rows}")
    if pdl is not None:
        require_pdl(pdl)
    require_cuda("topk_idx", topk_idx, device)
    out = routing_outputs(tokens, k, num_experts, layout, topk_idx.device)
    launcher = _launcher(device, num_experts, layout, pdl)
    stream = current_stream(device)
    if layout == "masked":
        launcher((1, 1, 1), stream, topk_idx=ptr, pairs=tokens * k, rows=out.rows.data_ptr(),
                 counts=out.counts.data_ptr(), rows_per_expert=rows_per_expert)
    else:
        launcher((1, 1, 1), stream, topk_idx=ptr, pairs=tokens * k, rows=out.rows.data_ptr(),
                 counts=out.counts.data_ptr(), m_indices=out.m_indices.data_ptr(),
                 m_rows=m_rows, rows_used=out.rows_used.data_ptr())
    return out
