"""RMSNorm, per-token-group FP8 quantization, and RMSNorm or SwiGLU fused with the
quantization, on torch tensors.

All four run the one row-kernel generator (``kernels/bf16_row_rmsnorm_fp8quant.py``),
each its variant (``VARIANTS``, as the MoE ops run its other two), specialised on the
hidden size K (SwiGLU's intermediate size); M, pointers, strides and eps are run-time
arguments.
"""

from __future__ import annotations

import functools

import torch

from .. import jit
from ..kernels import bf16_row_rmsnorm_fp8quant as row_kernel
from .common import (current_stream, device_arch, inspect, inspect_quantized_out, pair,
                      programmatic, require_contiguous_rows, require_cuda, require_disjoint,
                      require_pdl, require_shape, row_span, traced)
from .layout import empty_mn_major_scales

SCALE_LAYOUTS = ("mn_major", "row_major")
ROW_RANKS = (1, 2, 3, 4, 5, 6, 7, 8)


VARIANTS = row_kernel.VARIANTS


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, variant, hidden: int, pdl: bool | None, fanout: int):
    """(rows per CTA, row groups per CTA, launcher) for one device and variant; ``pdl``:
    the call's (None: the process default)."""
    cfg = row_kernel.choose_config(device_arch(device_index), variant, hidden, fanout=fanout)
    launcher = jit.build(row_kernel.generate(cfg)).launcher(device_index,
                                                            programmatic=programmatic(pdl))
    return cfg.rows_per_cta, cfg.groups, launcher


def launcher(variant, rows: int, hidden: int, device: int, pdl, fanout: int = 1):
    """(launcher, grid) of a row-kernel ``variant`` (a ``VARIANTS`` value) for ``rows``
    rows: one CTA per rows_per_cta x groups rows. The ops call the launcher with their
    arguments by name themselves: one keyword call, no dict passed along."""
    rows_per_cta, groups, launch = _kernel(device, variant, hidden, pdl, fanout)
    return launch, (-(-rows // (rows_per_cta * groups)), 1, 1)


def _as_rows(name: str, x: torch.Tensor):
    """x [..., K] as rows: (M, K, row stride, data pointer, device). 2-D inputs may have
    strided rows; inputs of other ranks must be contiguous."""
    shape, strides, ptr, device = inspect(name, x, torch.bfloat16, ROW_RANKS)
    if len(shape) != 2:
        if not x.is_contiguous():
            raise ValueError(f"{name} with {len(shape)} dimensions must be contiguous "
                             f"(2-D inputs may have strided rows)")
        rows = x.numel() // shape[-1] if shape[-1] else 0
        return rows, shape[-1], shape[-1], ptr, device
    return shape[0], shape[1], strides[0], ptr, device


def _check_weight(weight: torch.Tensor, hidden: int, device: int) -> int:
    shape, _, ptr, _ = inspect("weight", weight, torch.bfloat16, 1, device=device)
    if shape[0] != hidden:
        raise ValueError(f"weight must have shape ({hidden},) to match x's last dimension, "
                         f"got {tuple(shape)}")
    return ptr


def normalized_output(x: torch.Tensor) -> torch.Tensor:
    """What ``rms_norm`` allocates for x (also the shape its torch.library form reports)."""
    return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)


def quantized_outputs(m: int, k: int, scale_layout: str, device) -> tuple:
    """What the quantizers allocate for x [M, K]: q e4m3 [M, K] and f32 scales
    [M, ceil(K/128)] in ``scale_layout``."""
    groups = -(-k // row_kernel.GROUP)
    if scale_layout == "mn_major":
        scales = empty_mn_major_scales(m, groups, device)
    else:
        scales = torch.empty((m, groups), dtype=torch.float32, device=device)
    return torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device), scales


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             out: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """``y = x * rsqrt(mean(x^2, -1) + eps) * weight`` with f32 math, bf16 in and out.

    x: bf16 [..., K] (2-D inputs may have strided rows); weight: bf16 [K]. K a multiple of 8.
    ``out``: a contiguous bf16 tensor of x's shape to write instead of allocating one (an
    allocation costs several microseconds of host time; see docs/performance.md).
    ``pdl``: launch with programmatic dependent launch (the kernel may start while the one
    before it on the stream finishes, and waits for it before it reads or writes global
    memory); None: the process default, ``PTXFORGE_PDL`` (off unless set). Same bits
    either way.
    """
    if torch.compiler.is_dynamo_compiling():
        return traced("rms_norm", x, weight, eps, out=out, pdl=pdl)
    m, k, row_stride, x_ptr, device = _as_rows("x", x)
    w_ptr = _check_weight(weight, k, device)
    if out is not None:
        shape, strides, out_ptr, _ = inspect("out", out, torch.bfloat16, x.dim(), device=device)
        require_shape("out", shape, x.shape)
        if len(shape) == 2:
            require_contiguous_rows("out", shape, strides)
        elif not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {tuple(strides)}")
        require_disjoint("out", (out_ptr, 2 * m * k), row_span(x_ptr, m, row_stride, k, 2),
                         (w_ptr, 2 * k))
    if pdl is not None:
        require_pdl(pdl)
    require_cuda("x", x, device)
    if out is None:
        out = normalized_output(x)
        out_ptr = out.data_ptr()
    if m:
        launch, grid = launcher(VARIANTS["rms_norm"], m, k, device, pdl)
        launch(grid, current_stream(device), x=x_ptr, x_row_stride=row_stride, rows=m,
               weight=w_ptr, eps=float(eps), y=out_ptr)
    return out


def quantize_fp8_per_token(x: torch.Tensor, scale_layout: str = "mn_major", *, out=None,
                           pdl: bool | None = None):
    """Per-token, per-128-channel FP8 quantization (DeepGEMM's activation recipe).

    x: bf16 [M, K], K a multiple of 8. Returns ``(q, scales)``: q e4m3 [M, K] and scales
    f32 [M, ceil(K/128)] with ``x ~= q * scales`` per 128-wide group. ``scale_layout``
    'mn_major' (default) writes the scales in the MN-major TMA-aligned layout the FP8 GEMM
    reads without a copy; 'row_major' writes a plain contiguous tensor. ``out=(q, scales)``
    writes into given tensors instead (q contiguous; scales of any strides, which then
    decide the layout). ``pdl``: as ``rms_norm``'s.
    """
    if torch.compiler.is_dynamo_compiling():
        return traced("quantize_fp8_per_token", x, scale_layout, out=out, pdl=pdl)
    shape, strides, x_ptr, device = inspect("x", x, torch.bfloat16, 2)
    (m, k), row_stride = shape, strides[0]
    q, scales, q_ptr, s_ptr, s_strides = _checked_outputs(
        "x", x, shape, device, scale_layout, out, pdl, (x_ptr, m, row_stride))
    if m:
        launch, grid = launcher(VARIANTS["quantize_fp8_per_token"], m, k, device, pdl)
        launch(grid, current_stream(device), x=x_ptr, x_row_stride=row_stride, rows=m,
               q=q_ptr, scales=s_ptr, scale_row_stride=s_strides[0],
               scale_group_stride=s_strides[1])
    return q, scales


def rms_norm_quantize_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                          scale_layout: str = "mn_major", *, out=None, pdl: bool | None = None):
    """``quantize_fp8_per_token(rms_norm(x, weight, eps))`` in one pass over x, without
    writing the bf16 intermediate: the same bits as the two calls. ``pdl``: as
    ``rms_norm``'s."""
    if torch.compiler.is_dynamo_compiling():
        return traced("rms_norm_quantize_fp8", x, weight, eps, scale_layout, out=out, pdl=pdl)
    shape, strides, x_ptr, device = inspect("x", x, torch.bfloat16, 2)
    (m, k), row_stride = shape, strides[0]
    w_ptr = _check_weight(weight, k, device)
    q, scales, q_ptr, s_ptr, s_strides = _checked_outputs(
        "x", x, shape, device, scale_layout, out, pdl, (x_ptr, m, row_stride), (w_ptr, 1, k))
    if m:
        launch, grid = launcher(VARIANTS["rms_norm_quantize_fp8"], m, k, device, pdl)
        launch(grid, current_stream(device), x=x_ptr, x_row_stride=row_stride, rows=m,
               weight=w_ptr, eps=float(eps), q=q_ptr, scales=s_ptr,
               scale_row_stride=s_strides[0], scale_group_stride=s_strides[1])
    return q, scales


def silu_mul_quantize_fp8(gate: torch.Tensor, up: torch.Tensor, scale_layout: str = "mn_major",
                          *, out=None, pdl: bool | None = None):
    """``quantize_fp8_per_token(silu(gate) * up)`` in one pass, without writing the bf16
    product: SwiGLU feeding an FFN's FP8 down projection.

    gate, up: bf16 [M, I], I a multiple of 8, each with unit stride along I and 16-byte
    aligned rows: two tensors, or the two halves of one gate_up output [M, 2I]
    (``t[:, :I], t[:, I:]``, read in place). h is rounded as eager PyTorch's
    ``F.silu(gate) * up`` rounds it: silu in f32, rounded to bf16, times up, rounded to
    bf16; the kernel's exp and reciprocal are approximate (one SFU instruction each), so
    an element of silu lying within a few f32 ulp of a bf16 rounding midpoint may round
    one bf16 step the other way (``patterns.activation.silu_mul_bf16x2``). Returns
    ``(q, scales)`` as ``quantize_fp8_per_token`` does, with ``scale_layout``, ``out`` and
    ``pdl`` as its.
    """
    if torch.compiler.is_dynamo_compiling():
        return traced("silu_mul_quantize_fp8", gate, up, scale_layout, out=out, pdl=pdl)
    shape, g_strides, g_ptr, device = inspect("gate", gate, torch.bfloat16, 2)
    u_shape, u_strides, u_ptr, _ = inspect("up", up, torch.bfloat16, 2, device=device)
    require_shape("up", u_shape, shape)
    m, k = shape
    q, scales, q_ptr, s_ptr, s_strides = _checked_outputs(
        "gate", gate, shape, device, scale_layout, out, pdl, (g_ptr, m, g_strides[0]),
        (u_ptr, m, u_strides[0]))
    if m:
        launch, grid = launcher(VARIANTS["silu_mul_quantize_fp8"], m, k, device, pdl)
        launch(grid, current_stream(device), gate=g_ptr, gate_row_stride=g_strides[0],
               up=u_ptr, up_row_stride=u_strides[0], rows=m, q=q_ptr, scales=s_ptr,
               scale_row_stride=s_strides[0], scale_group_stride=s_strides[1])
    return q, scales


def _checked_outputs(name: str, x, shape, device: int, scale_layout: str, out, pdl,
                     *inputs) -> tuple:
    """A quantizer's remaining checks and its outputs, for x [M, K] (``name``, its first
    argument): ``scale_layout``, ``out=`` (which must not overlap ``inputs``: each bf16
    input's (pointer, rows, row stride), K wide), ``pdl``, then x's device. Returns
    ``(q, scales, q pointer, scales pointer, scales strides)``, allocated unless ``out``
    gives them."""
    m, k = shape
    if scale_layout not in SCALE_LAYOUTS:  # checked with out= too, where the strides decide
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    if out is not None:
        q, scales = pair("out", out, "e4m3 [M, K] and f32 [M, ceil(K/128)]")
        q_ptr, s_ptr, s_strides = inspect_quantized_out(
            q, scales, shape, (m, -(-k // row_kernel.GROUP)), device,
            *(row_span(ptr, rows, row_stride, k, 2) for ptr, rows, row_stride in inputs))
    if pdl is not None:
        require_pdl(pdl)
    require_cuda(name, x, device)
    if out is None:
        q, scales = quantized_outputs(m, k, scale_layout, x.device)
        q_ptr, s_ptr, s_strides = q.data_ptr(), scales.data_ptr(), scales.stride()
    return q, scales, q_ptr, s_ptr, s_strides
