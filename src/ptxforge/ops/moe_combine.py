"""MoE combine on torch tensors: each token's weighted sum of its experts' output rows.

One generator (``kernels/bf16_moe_combine.py``), specialised on the hidden size H, the
experts per token k and the weights' dtype; T, R, the pointers and y's row stride are
run-time arguments.
"""

from __future__ import annotations

import functools

import torch

from .. import jit
from ..kernels import bf16_moe_combine as combine_kernel
from .common import (current_stream, device_arch, inspect, programmatic,
                      require_contiguous_rows, require_cuda, require_disjoint, require_pdl,
                      require_shape, row_span, traced)

# The weights' torch dtype -> the kernel's name for it.
WEIGHT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, hidden: int, topk: int, weight_dtype: str, pdl: bool | None):
    """(chunks a token, launcher) for one device and variant; ``pdl``: the call's (None: the
    process default)."""
    cfg = combine_kernel.choose_config(device_arch(device_index), hidden, topk, weight_dtype)
    launcher = jit.build(combine_kernel.generate(cfg)).launcher(device_index,
                                                                programmatic=programmatic(pdl))
    return cfg.chunks, launcher


def combined_output(tokens: int, hidden: int, device) -> torch.Tensor:
    """What ``moe_combine`` allocates: bf16 [T, H] (also what its torch.library form reports)."""
    return torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device)


def moe_combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, *,
                out: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """Each token's weighted sum of its experts' output rows, the combine step of a
    mixture-of-experts layer:

        out[t] = bf16(sum over j = 0..k-1, in order, of f32(y[rows[t, j]]) * f32(weights[t, j]))

    in f32 (each product, then each sum, rounded to f32, from +0), rounded to bf16 once.
    The order is fixed, so the bits are the same run to run: those of the eager loop
    ``acc = acc + y[rows[:, j]].float() * weights[:, j:j+1].float()``. A pair whose row is
    outside [0, R) (-1 marks a dropped pair) adds nothing and its row is never read.

    y: bf16 [R, H], the down projection's output, one row per (token, expert) pair; rows
    may be strided (16-byte aligned); a masked layout [G, M_max, H] is passed as
    ``y.view(G * M_max, H)``. H a multiple of 8. rows: int32 [T, k], contiguous, k from 1
    to 32. weights: f32 or bf16 [T, k], contiguous. ``out``: a contiguous bf16 [T, H] to
    write instead of allocating one; it must not overlap the inputs. T may be 0 (nothing
    is launched). ``pdl``: as ``rms_norm``'s. Returns out.
    """
    if torch.compiler.is_dynamo_compiling():
        return traced("moe_combine", y, rows, weights, out=out, pdl=pdl)
    (r, hidden), y_strides, y_ptr, device = inspect("y", y, torch.bfloat16, 2)
    (tokens, topk), rows_ptr = _pair_table("rows", rows, torch.int32, device)
    w_dtype = weights.dtype if isinstance(weights, torch.Tensor) else torch.float32
    if w_dtype not in WEIGHT_DTYPES:
        raise TypeError(f"weights must have dtype torch.float32 or torch.bfloat16, got {w_dtype}")
    w_shape, w_ptr = _pair_table("weights", weights, w_dtype, device)
    require_shape("weights", w_shape, (tokens, topk))
    combine_kernel.check_problem(hidden, topk)
    if r >= 1 << 31:  # row indices are int32: -1 must never be a row
        raise ValueError(f"y must have fewer than 2**31 rows, got {r}")
    if out is not None:
        shape, strides, out_ptr, _ = inspect("out", out, torch.bfloat16, 2, device=device)
        require_shape("out", shape, (tokens, hidden))
        require_contiguous_rows("out", shape, strides)
        require_disjoint("out", (out_ptr, 2 * tokens * hidden),
                         row_span(y_ptr, r, y_strides[0], hidden, 2),
                         (rows_ptr, 4 * tokens * topk),
                         (w_ptr, w_dtype.itemsize * tokens * topk))
    if pdl is not None:
        require_pdl(pdl)
    require_cuda("y", y, device)
    max_tokens = device_arch(device).max_grid[0]  # one CTA column per token
    if tokens > max_tokens:
        raise ValueError(f"rows may have at most {max_tokens} tokens, got {tokens}")
    if out is None:
        out = combined_output(tokens, hidden, y.device)
        out_ptr = out.data_ptr()
    if tokens:
        chunks, launcher = _kernel(device, hidden, topk, WEIGHT_DTYPES[w_dtype], pdl)
        launcher((tokens, chunks, 1), current_stream(device), y=y_ptr,
                 y_row_stride=y_strides[0], y_rows=r, rows=rows_ptr, weights=w_ptr,
                 out=out_ptr)
    return out


def _pair_table(name: str, t, dtype, device: int) -> tuple:
    """A contiguous [T, k] table of ``dtype`` (rows or weights): (shape, data pointer)."""
    shape, strides, ptr, _ = inspect(name, t, dtype, 2, align=dtype.itemsize, device=device,
                                     rows=False)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(strides)}")
    return shape, ptr
