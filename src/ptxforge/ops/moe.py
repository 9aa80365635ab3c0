"""A mixture-of-experts layer's experts on the grouped FP8 GEMMs, from the router's top-k
to the combined output, with no host sync (graph-capturable at every token count):

    topk_idx [T, k] --moe_routing_layout--> rows [T, k] (each pair's row of the grouped A),
                                            counts / m_indices, rows_used (on the GPU)
    x [T, H] --moe_permute_quantize_fp8--> A: each token's row quantized once and copied
                                           to its k rows (1x128 scales, MN-major)
    A --grouped FP8 GEMM (gate_up)--> [rows, 2I] --moe_silu_mul_quantize_fp8--> [rows, I]
      (only the rows holding a pair) --grouped FP8 GEMM (down)--> y [rows, H]
    y --moe_combine--> out [T, H] = sum over j of weights[t, j] * y[rows[t, j]], in j order

Two layouts of the grouped rows, chosen per call from the token count (``choose_layout``):

    masked      [E, T, ...]: expert e's pairs in its own T rows, masked_m = counts; the
                GEMM walks only the tiles of each expert's pairs. E * T rows: for few tokens.
    contiguous  [T*k + E*127, ...]: segments aligned to 128 rows, m_indices per row; the GEMM
                stops at rows_used. For many tokens, where E * T rows would not fit.

Both are sized for the worst routing, known on the host from T alone; what the routing
fills is known only on the GPU, and only that is computed.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .. import jit
from ..kernels import bf16_row_rmsnorm_fp8quant as row_kernel
from ..kernels import f32_moe_scale_gather as gather_kernel
from . import rowwise
from .common import (current_stream, device_arch, inspect, pair, programmatic, require_cuda,
                      require_disjoint, require_pdl, require_shape, strided_span, traced)
from .gemm import m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked
from .layout import ceil_div, empty_mn_major_scales
from .moe_combine import moe_combine
from .routing import max_contiguous_rows, moe_routing_layout

LAYOUTS = ("masked", "contiguous")


def choose_layout(tokens: int, top_k: int, experts: int) -> str:
    """The layout with the fewer rows for the worst routing: masked (E x T rows) for few
    tokens, contiguous (T*k + E*127 rows) beyond. DeepSeek-V3 (256 experts, top-8):
    masked up to 130 tokens; Mixtral (8 experts, top-2): up to 169."""
    masked_rows = experts * tokens
    return "masked" if masked_rows <= max_contiguous_rows(tokens, top_k, experts) else "contiguous"


def grouped_rows(layout: str, tokens: int, top_k: int, experts: int) -> tuple:
    """The leading shape of the grouped operands, sized for the worst routing: (E, T) in
    the masked layout, (T*k + E*127,) in the contiguous one."""
    if layout == "masked":
        return experts, max(tokens, 1)
    return (max_contiguous_rows(tokens, top_k, experts),)


def expected_rows(tokens: int, top_k: int, experts: int) -> int:
    """The masked GEMM's tile hint: the pairs an expert receives on average."""
    return max(1, ceil_div(tokens * top_k, experts))


def grouped_quantized(lead: tuple, hidden: int, device) -> tuple:
    """An FP8 grouped operand, uninitialised: q e4m3 [*lead, hidden] and f32 scales
    [*lead, ceil(hidden/128)] in the MN-major TMA-aligned layout the GEMMs read. ``lead``:
    (rows,) for the contiguous layout, (experts, rows per expert) for the masked one."""
    groups = ceil_div(hidden, row_kernel.GROUP)
    q = torch.empty((*lead, hidden), dtype=torch.float8_e4m3fn, device=device)
    batch = lead[0] if len(lead) == 2 else None
    return q, empty_mn_major_scales(lead[-1], groups, device, batch)


def _grouped_out(out, hidden: int, device: int, *input_spans, rows: tuple) -> dict:
    """``out=(q, scales)`` of a grouped row kernel: q e4m3 [*rows, H] ([R, H] or
    [E, M_max, H]), contiguous, scales f32 [*rows, ceil(H/128)] (any strides: they are
    passed on). Returns the launch's output arguments by name."""
    q, scales = pair("out", out, "e4m3 [R, H] or [E, M_max, H] and f32 scales of the same rows")
    q_shape, _, q_ptr, _ = inspect("out[0]", q, torch.float8_e4m3fn, len(rows) + 1, align=16,
                                   device=device)
    require_shape("out[0]", q_shape, (*rows, hidden))
    if not q.is_contiguous():
        raise ValueError(f"out[0] must be contiguous, got strides {tuple(q.stride())}")
    scale_shape = (*q_shape[:-1], ceil_div(hidden, row_kernel.GROUP))
    s_shape, s_strides, s_ptr, _ = inspect("out[1]", scales, torch.float32, len(q_shape),
                                           align=4, device=device, rows=False)
    require_shape("out[1]", s_shape, scale_shape)
    q_span = (q_ptr, q.numel())
    require_disjoint("out[0]", q_span, *input_spans)
    require_disjoint("out[1]", strided_span(s_ptr, s_shape, s_strides, 4), q_span, *input_spans)
    return _out_arguments(q_shape, q_ptr, s_ptr, s_strides)


def _out_arguments(q_shape, q_ptr: int, s_ptr: int, s_strides) -> dict:
    """A grouped row kernel's output arguments by name, for q [*rows, H] at ``q_ptr`` and
    its scales at ``s_ptr`` with ``s_strides``."""
    total = math.prod(q_shape[:-1])
    if len(q_shape) == 2:   # one batch: every row's scales at row * stride
        batch = {"rows_per_batch": max(total, 1), "scale_batch_stride": 0}
    else:
        batch = {"rows_per_batch": max(q_shape[1], 1), "scale_batch_stride": s_strides[0]}
    return {"q": q_ptr, "scales": s_ptr, "scale_row_stride": s_strides[-2],
            "scale_group_stride": s_strides[-1], "index_rows": total, **batch}


def _checked_out(out, lead: tuple, width: int, pdl, first, *input_spans) -> tuple:
    """A grouped row kernel's last checks, in the ops' order: ``out`` (if given), pdl, then
    the device of ``first`` (its name, tensor, device index); the output allocated where
    not given. Returns (out, the launch's output arguments)."""
    name, tensor, device = first
    if out is not None:
        arguments = _grouped_out(out, width, device, *input_spans, rows=lead)
    if pdl is not None:
        require_pdl(pdl)
    require_cuda(name, tensor, device)
    if out is None:
        out = grouped_quantized(lead, width, tensor.device)
        arguments = _out_arguments(out[0].shape, out[0].data_ptr(), out[1].data_ptr(),
                                   out[1].stride())
    return out, arguments


def _routing_rows(rows, device: int, tokens: int | None = None) -> tuple:
    """rows int32 [T, k] on the device, contiguous (T = ``tokens`` where given): (pairs, k,
    pointer, span)."""
    shape, _, ptr, _ = inspect("rows", rows, torch.int32, 2, align=4, device=device, rows=False)
    if (tokens is not None and shape[0] != tokens) or not rows.is_contiguous():
        want = f"[{tokens}, k] (a row per token)" if tokens is not None else "[T, k]"
        raise ValueError(f"rows must be a contiguous int32 {want}, got shape {tuple(shape)} "
                         f"and strides {tuple(rows.stride())}")
    return shape[0] * shape[1], shape[1], ptr, (ptr, 4 * rows.numel())


def moe_permute_quantize_fp8(x, rows: torch.Tensor, shape, *, out=None,
                             pdl: bool | None = None):
    """Each token's row into its experts' rows of the grouped GEMM's A, quantized per token
    (1x128 groups, as ``quantize_fp8_per_token``): row ``rows[t, j]`` of the output (its
    leading dimensions flattened) gets x[t]'s. Each row is read and quantized once, then
    stored k times; a second kernel writes the grouped rows' scales, column by column of
    the MN-major layout (``kernels/f32_moe_scale_gather.py`` says why).

    x: bf16 [T, H], contiguous rows; or rows quantized already, ``(q, scales)``: e4m3
    [T, H] (rows 16-byte aligned, H a multiple of 16) and f32 [T, ceil(H/128)] (any
    strides), such as an expert-parallel dispatch receives: then only moved, by the copy
    engine, with their scales. rows: int32 [T, k] (``moe_routing_layout``'s); an entry
    outside [0, R) is a dropped pair, not written. shape: the grouped rows' leading shape,
    (R,) in the contiguous layout (``max_contiguous_rows``), (E, M_max) in the masked one.
    Returns ``(q, scales)``: q e4m3 [*shape, H], scales f32 [*shape, ceil(H/128)] MN-major
    (``grouped_quantized``), or ``out`` with any scale strides; rows no pair names are left
    as they were. ``pdl``: as ``rms_norm``'s."""
    if torch.compiler.is_dynamo_compiling():
        if isinstance(x, (tuple, list)):
            raise ValueError("moe_permute_quantize_fp8 of quantized rows ((q, scales)) has no "
                             "operator to trace: pass the bf16 rows under torch.compile")
        return traced("moe_permute_quantize_fp8", x, rows, list(shape), out=out, pdl=pdl)
    quantized = isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], torch.Tensor)
    if quantized:
        x, x_scales = x
    (tokens, hidden), x_strides, x_ptr, device = inspect(
        "x[0]" if quantized else "x", x, torch.float8_e4m3fn if quantized else torch.bfloat16, 2)
    groups = ceil_div(hidden, row_kernel.GROUP)
    input_spans = [(x_ptr, x.itemsize * tokens * x_strides[0])]
    if quantized:
        s_shape, s_strides, s_ptr, _ = inspect("x[1]", x_scales, torch.float32, 2, align=4,
                                               device=device, rows=False)
        require_shape("x[1]", s_shape, (tokens, groups))
        input_spans.append(strided_span(s_ptr, s_shape, s_strides, 4))
    pairs, k, rows_ptr, rows_span = _routing_rows(rows, device, tokens)
    out, arguments = _checked_out(out, _leading_shape(shape), hidden, pdl, (
        "x[0]" if quantized else "x", x, device), *input_spans, rows_span)
    if not pairs:
        return out
    sources = torch.empty(arguments["index_rows"], dtype=torch.int32, device=x.device)
    if quantized:
        # The scale gather reads token-major scales [T, G].
        token_scales = x_scales.contiguous()
        # A CTA per 8 rows: each copied in and stored k times by the copy engine.
        launcher, grid = rowwise.launcher(rowwise.VARIANTS["moe_permute_fp8"], tokens, hidden,
                                          device, pdl, k)
        launcher(grid, current_stream(device), x=x_ptr, x_row_stride=x_strides[0],
                 rows=tokens, index=rows_ptr, index_rows=arguments["index_rows"],
                 q=arguments["q"], sources=sources.data_ptr())
    else:
        token_scales = torch.empty((tokens, groups), dtype=torch.float32, device=x.device)
        # A CTA per token (or a few): its row read and quantized once, stored k times; its
        # scales once, token-major.
        launcher, grid = rowwise.launcher(rowwise.VARIANTS["moe_permute_quantize_fp8"], tokens,
                                          hidden, device, pdl, k)
        launcher(grid, current_stream(device), x=x_ptr, x_row_stride=x_strides[0],
                 rows=tokens, index=rows_ptr, index_rows=arguments["index_rows"],
                 q=arguments["q"], scales=token_scales.data_ptr(), scale_row_stride=groups,
                 scale_group_stride=1, sources=sources.data_ptr())
    launcher, grid = _scale_gather(device, hidden, k, pdl, arguments["index_rows"])
    launcher(grid, current_stream(device), sources=sources.data_ptr(), rows=rows_ptr,
             pairs=pairs, token_scales=token_scales.data_ptr(),
             grouped_rows=arguments["index_rows"], rows_per_batch=arguments["rows_per_batch"],
             scales=arguments["scales"], scale_row_stride=arguments["scale_row_stride"],
             scale_group_stride=arguments["scale_group_stride"],
             scale_batch_stride=arguments["scale_batch_stride"])
    return out


@functools.lru_cache(maxsize=None)
def _scale_gather_kernel(device_index: int, hidden: int, topk: int, pdl: bool | None):
    """(runs of groups, launcher) of the MoE scale gather for one device and variant."""
    cfg = gather_kernel.choose_config(device_arch(device_index), hidden, topk)
    launcher = jit.build(gather_kernel.generate(cfg)).launcher(device_index,
                                                               programmatic=programmatic(pdl))
    return cfg.group_runs, launcher


def _scale_gather(device: int, hidden: int, topk: int, pdl, grouped_rows: int):
    """(launcher, grid) of the MoE scale gather: a thread per grouped row and run of groups."""
    runs, launcher = _scale_gather_kernel(device, hidden, topk, pdl)
    return launcher, (ceil_div(grouped_rows, gather_kernel.THREADS), runs, 1)


def _leading_shape(shape) -> tuple:
    shape = tuple(shape)
    if len(shape) not in (1, 2) or not all(isinstance(n, int) and n > 0 for n in shape):
        raise ValueError(f"shape must be (R,) or (E, M_max), positive ints, got {shape}")
    return shape


def moe_silu_mul_quantize_fp8(d: torch.Tensor, rows: torch.Tensor, *, out=None,
                              pdl: bool | None = None):
    """``silu_mul_quantize_fp8`` on the rows of a grouped gate_up output that hold a pair:
    row r = ``rows[t, j]`` of ``d`` (gate its first I columns, up the next I) into row r of
    the output; the other rows (padding, other experts' unused rows) are neither read nor
    written.

    d: bf16 [R, 2I] or [E, M_max, 2I], contiguous. rows: int32 [T, k] as
    ``moe_permute_quantize_fp8``'s. Returns ``(q, scales)`` with d's leading shape and I
    columns (``grouped_quantized``), or ``out``."""
    if torch.compiler.is_dynamo_compiling():
        return traced("moe_silu_mul_quantize_fp8", d, rows, out=out, pdl=pdl)
    shape, _, d_ptr, device = inspect("d", d, torch.bfloat16, (2, 3))
    if shape[-1] % 2 or not d.is_contiguous():
        raise ValueError(f"d must be a contiguous gate_up output [..., 2I], got shape "
                         f"{tuple(shape)} and strides {tuple(d.stride())}")
    inner = shape[-1] // 2
    pairs, _, rows_ptr, rows_span = _routing_rows(rows, device)
    out, arguments = _checked_out(out, tuple(shape[:-1]), inner, pdl, ("d", d, device),
                                  (d_ptr, 2 * d.numel()), rows_span)
    if pairs:
        launcher, grid = rowwise.launcher(rowwise.VARIANTS["moe_silu_mul_quantize_fp8"], pairs,
                                          inner, device, pdl)
        launcher(grid, current_stream(device), gate=d_ptr, gate_row_stride=shape[-1],
                 up=d_ptr + 2 * inner, up_row_stride=shape[-1], rows=pairs, index=rows_ptr,
                 **arguments)
    return out


class ExpertsSizes(NamedTuple):
    """A MoE experts call's sizes, from its arguments' shapes (``experts_sizes``)."""

    tokens: int
    hidden: int
    top_k: int
    experts: int        # in gate_up and down: a rank's own with ``ep``
    two_inner: int
    device: int         # x's device index, -1 off CUDA


# The expert-parallel layers by the type of ``ep`` they take. ``ptxforge.ep`` registers its
# Buffer's when it is imported (as it is before anyone holds a Buffer): the ops import nothing
# of ``ep``, whose kernels' host side imports the ops.
_EXPERT_PARALLEL: dict = {}


def register_expert_parallel(ep_type: type, layer) -> None:
    """``moe_experts_fp8(..., ep=e)`` with ``e`` an ``ep_type`` runs ``layer(e, x, topk_idx,
    topk_weights, gate_up, down, layout=layout, sizes=ExpertsSizes, max_tokens_per_rank=
    max_tokens_per_rank)``, after the checks of the arguments' shapes."""
    _EXPERT_PARALLEL[ep_type] = layer


def moe_experts_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up, down, *, layout: str | None = None, ep=None,
                    max_tokens_per_rank: int | None = None) -> torch.Tensor:
    """A MoE layer's experts with SwiGLU, as transformers' experts modules compute them:
    ``out[t] = sum_j topk_weights[t, j] * down[e](silu(gate[e](x[t])) * up[e](x[t]))`` with
    e = topk_idx[t, j], in FP8 (DeepGEMM's recipe: activations 1x128, weights 128x128).

    x: bf16 [T, H]. topk_idx: int64 [T, k] (an index outside [0, E) drops its pair).
    topk_weights: f32 or bf16 [T, k]. gate_up: ``(q, s)``, e4m3 [E, 2I, H] (gate's I rows,
    then up's) and f32 [E, 2I/128, H/128] (``quantize_fp8_per_block`` of the bf16 weights
    viewed [E*2I, H]). down: ``(q, s)``, e4m3 [E, H, I] and f32 [E, H/128, I/128].
    layout: 'masked' or 'contiguous' (None: ``choose_layout``). Returns bf16 [T, H]. Nothing
    is read back to the host.

    ``ep``: a ``ptxforge.ep.Buffer`` over R ranks, every rank calling with its own tokens:
    the layer across GPUs (``ptxforge/ep/layer.py``). topk_idx then holds global experts
    in [0, R * E) and gate_up, down this rank's E of them (rank r: [r * E, (r + 1) * E),
    ``ptxforge.ep.shard_experts``); layout picks the path: 'masked' the decode path
    (low-latency dispatch, no host synchronisation, capturable in a CUDA graph),
    'contiguous' the normal path (a host synchronisation in the dispatch), None the decode
    path where the buffer's low-latency room holds T tokens, else the normal one. Every
    rank must take the same path. ``max_tokens_per_rank``: a bound on every rank's T;
    the path is then chosen from it (so every rank takes the same one), and the normal
    path sizes its received rows for the worst case instead of synchronising with the
    host: no host synchronisation on either path, capturable in a CUDA graph."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
    if ep is None and max_tokens_per_rank is not None:
        raise ValueError(f"max_tokens_per_rank bounds the tokens of every rank of ep: it needs "
                         f"ep=, got max_tokens_per_rank={max_tokens_per_rank!r} and ep=None")
    layer = None if ep is None else _expert_parallel_layer(ep)
    sizes = experts_sizes(x, topk_idx, topk_weights, gate_up, down)
    if layer is not None:
        return layer(ep, x, topk_idx, topk_weights, gate_up, down, layout=layout, sizes=sizes,
                     max_tokens_per_rank=max_tokens_per_rank)
    require_cuda("x", x, sizes.device)
    # A router's top-k may come as views (a gather's, a slice's): the kernels read rows.
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    layout = layout or choose_layout(sizes.tokens, sizes.top_k, sizes.experts)
    return grouped_experts(x, topk_idx, topk_weights, gate_up, down, layout, sizes)


def _expert_parallel_layer(ep):
    for ep_type, layer in _EXPERT_PARALLEL.items():
        if isinstance(ep, ep_type):
            return layer
    raise TypeError(f"ep must be a ptxforge.ep.Buffer (or None), got {type(ep).__name__}")


def grouped_experts(x, topk_idx: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                    layout: str, sizes: ExpertsSizes,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_experts_fp8``'s kernels after its checks, in ``layout``: x bf16 [T, H], or its
    rows quantized already (``(q, scales)``, as ``moe_permute_quantize_fp8`` takes them:
    an expert-parallel dispatch's received rows); topk_idx, topk_weights contiguous.
    ``out``: bf16 [T, H] for the result (``moe_combine``'s), else a new tensor."""
    tokens, hidden, top_k, experts, two_inner, _ = sizes
    device = topk_idx.device
    lead = grouped_rows(layout, tokens, top_k, experts)
    routing = moe_routing_layout(topk_idx, experts, layout=layout,
                                 rows_per_expert=lead[1] if layout == "masked" else None)
    expected = expected_rows(tokens, top_k, experts)
    a = moe_permute_quantize_fp8(x, routing.rows, lead)
    gate_up_out = torch.empty((*lead, two_inner), dtype=torch.bfloat16, device=device)
    _grouped_gemm(layout, a, gate_up, gate_up_out, routing, expected)
    h = moe_silu_mul_quantize_fp8(gate_up_out, routing.rows)
    y = torch.empty((*lead, hidden), dtype=torch.bfloat16, device=device)
    _grouped_gemm(layout, h, down, y, routing, expected)
    return moe_combine(y.view(-1, hidden), routing.rows, topk_weights, out=out)


def experts_sizes(x, topk_idx, topk_weights, gate_up, down) -> ExpertsSizes:
    """The experts' arguments' shapes, checked against each other (the kernels check each
    tensor again); the device is checked by the caller."""
    (tokens, hidden), _, _, device = inspect("x", x, torch.bfloat16, 2)
    (idx_tokens, top_k), _, _, _ = inspect("topk_idx", topk_idx, torch.int64, 2, rows=False)
    if idx_tokens != tokens:
        raise ValueError(f"topk_idx must have a row per token of x ({tokens}), got shape "
                         f"{tuple(topk_idx.shape)}")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (tokens, top_k):
        raise ValueError(f"topk_weights must have topk_idx's shape {(tokens, top_k)}, got "
                         f"{tuple(getattr(topk_weights, 'shape', ()))}")
    w13, _ = pair("gate_up", gate_up, "e4m3 [E, 2I, H] and f32 [E, 2I/128, H/128]")
    w2, _ = pair("down", down, "e4m3 [E, H, I] and f32 [E, H/128, I/128]")
    (experts, two_inner, k13), _, _, _ = inspect("gate_up[0]", w13, torch.float8_e4m3fn, 3)
    if k13 != hidden or two_inner % 2:
        raise ValueError(f"gate_up[0] must be [E, 2I, H] with H = {hidden} (x's), got shape "
                         f"{tuple(w13.shape)}")
    (down_experts, down_n, down_k), _, _, _ = inspect("down[0]", w2, torch.float8_e4m3fn, 3)
    if (down_experts, down_n, down_k) != (experts, hidden, two_inner // 2):
        raise ValueError(f"down[0] must be [E, H, I] = {(experts, hidden, two_inner // 2)} "
                         f"(gate_up's E and I, x's H), got shape {tuple(w2.shape)}")
    return ExpertsSizes(tokens, hidden, top_k, experts, two_inner, device)


def _grouped_gemm(layout: str, a, b, d, routing, expected: int) -> None:
    if layout == "masked":
        m_grouped_fp8_gemm_nt_masked(a, b, d, routing.counts, expected)
    else:
        m_grouped_fp8_gemm_nt_contiguous(a, b, d, routing.m_indices, rows_used=routing.rows_used)
