"""The ops as torch.library operators, ``torch.ops.ptxforge.<name>``: what torch.compile
traces through (with ``fullgraph=True``) and a CUDA graph replays, for every op that
launches a kernel.

    import ptxforge.ops                                  # registers them
    q, s = torch.ops.ptxforge.rms_norm_quantize_fp8(x, w, 1e-6)
    torch.ops.ptxforge.fp8_gemm_nt(q, s, wq, ws, d)      # mutates d

Each operator's CUDA implementation is the plain function (``ptxforge.fp8_gemm_nt``...),
whose eager callers keep calling it directly: registering costs them nothing; while
torch.compile traces, the function calls its operator (``ops.common.traced``). The fake
implementations (shapes, dtypes and strides under FakeTensorMode) allocate with the same
helpers as the functions, so the two cannot drift apart. Registered with ``Library`` +
``define`` / ``impl`` and ``register_fake``, not ``@custom_op``, whose per-call wrapper
cost 9-22 us of host time a call (measured on an H200), against ~4 us for a call through
the dispatcher.

The schemas spell the functions' tuples out: ``(A, sa)`` is ``a, sa``. What the schema
cannot carry stays with the Python functions: ``config=`` and ``out=``. The GEMMs write
``d`` (``Tensor(a!)``) and return nothing, as the functions do. A GEMM's ``residual`` is
read-only in its schema and may still be ``d`` itself: torch.compile's functionalization
then hands the kernel either a copy of d to write (the residual, the old d, disjoint from
it) or, where Inductor writes in place again, d itself; the kernel takes both. (On torch
2.13 aot_eager does the former, Inductor the latter; tests/gpu/test_library_gpu.py holds
both to the eager call.)
"""

from __future__ import annotations

import torch

from . import attention, block_quant, gemm, moe, routing, rowwise
from .common import require_shape
# By name from the module: the package's attribute moe_combine is the function.
from .moe_combine import combined_output, moe_combine

NAMESPACE = "ptxforge"   # torch.ops.ptxforge.<name>

_library = torch.library.Library(NAMESPACE, "DEF")

# name -> (schema arguments and returns, the CUDA implementation, the fake implementation)
_GEMM_OPTIONS = "int? num_sms=None, bool? pdl=None"


def _rms_norm(x, weight, eps=1e-6, pdl=None):
    return rowwise.rms_norm(x, weight, eps, pdl=pdl)


def _rms_norm_fake(x, weight, eps=1e-6, pdl=None):
    return rowwise.normalized_output(x)


def _quantize_fp8_per_token(x, scale_layout="mn_major", pdl=None):
    return rowwise.quantize_fp8_per_token(x, scale_layout, pdl=pdl)


def _quantize_fp8_per_token_fake(x, scale_layout="mn_major", pdl=None):
    return rowwise.quantized_outputs(x.shape[0], x.shape[1], scale_layout, x.device)


def _rms_norm_quantize_fp8(x, weight, eps=1e-6, scale_layout="mn_major", pdl=None):
    return rowwise.rms_norm_quantize_fp8(x, weight, eps, scale_layout, pdl=pdl)


def _rms_norm_quantize_fp8_fake(x, weight, eps=1e-6, scale_layout="mn_major", pdl=None):
    return rowwise.quantized_outputs(x.shape[0], x.shape[1], scale_layout, x.device)


def _silu_mul_quantize_fp8(gate, up, scale_layout="mn_major", pdl=None):
    return rowwise.silu_mul_quantize_fp8(gate, up, scale_layout, pdl=pdl)


def _silu_mul_quantize_fp8_fake(gate, up, scale_layout="mn_major", pdl=None):
    return rowwise.quantized_outputs(gate.shape[0], gate.shape[1], scale_layout, gate.device)


def _quantize_fp8_per_block(w, pdl=None):
    return block_quant.quantize_fp8_per_block(w, pdl=pdl)


def _quantize_fp8_per_block_fake(w, pdl=None):
    return block_quant.block_quantized_outputs(w.shape[0], w.shape[1], w.device)


def _fp8_gemm_nt(a, sa, b, sb, d, c=None, bias=None, residual=None, alpha=None, num_sms=None,
                 pdl=None):
    gemm.fp8_gemm_nt((a, sa), (b, sb), d, c, bias=bias, residual=residual, alpha=alpha,
                     num_sms=num_sms, pdl=pdl)


def _bf16_gemm_nt(a, b, d, c=None, bias=None, residual=None, alpha=None, num_sms=None,
                  pdl=None):
    gemm.bf16_gemm_nt(a, b, d, c, bias=bias, residual=residual, alpha=alpha, num_sms=num_sms,
                      pdl=pdl)


def _m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, d, m_indices, rows_used=None, num_sms=None,
                                      pdl=None):
    gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, m_indices, rows_used=rows_used,
                                          num_sms=num_sms, pdl=pdl)


def _m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices, rows_used=None, num_sms=None,
                                       pdl=None):
    gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices, rows_used=rows_used,
                                           num_sms=num_sms, pdl=pdl)


def _m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, d, masked_m, expected_m, num_sms=None,
                                  pdl=None):
    gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, masked_m, expected_m,
                                      num_sms=num_sms, pdl=pdl)


def _m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, num_sms=None, pdl=None):
    gemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, num_sms=num_sms, pdl=pdl)


def _moe_routing_layout(topk_idx, num_experts, layout="contiguous", rows_per_expert=None,
                        pdl=None):
    return routing.moe_routing_layout(topk_idx, num_experts, layout=layout,
                                      rows_per_expert=rows_per_expert, pdl=pdl)


def _moe_routing_layout_fake(topk_idx, num_experts, layout="contiguous", rows_per_expert=None,
                             pdl=None):
    return routing.routing_outputs(topk_idx.shape[0], topk_idx.shape[1], num_experts, layout,
                                   topk_idx.device)


def _writes_d(*args, **kwargs) -> None:
    """The GEMMs' fake: they only write d, which the caller already holds."""


def _moe_permute_quantize_fp8(x, rows, shape, pdl=None):
    return moe.moe_permute_quantize_fp8(x, rows, shape, pdl=pdl)


def _moe_permute_quantize_fp8_fake(x, rows, shape, pdl=None):
    return moe.grouped_quantized(tuple(shape), x.shape[1], x.device)


def _moe_silu_mul_quantize_fp8(d, rows, pdl=None):
    return moe.moe_silu_mul_quantize_fp8(d, rows, pdl=pdl)


def _moe_silu_mul_quantize_fp8_fake(d, rows, pdl=None):
    return moe.grouped_quantized(tuple(d.shape[:-1]), d.shape[-1] // 2, d.device)


def _attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None,
                            k_scale=None, v_scale=None, softmax_scale=None, causal=True,
                            pdl=None):
    return attention.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens,
                                            block_table=block_table, k_scale=k_scale,
                                            v_scale=v_scale, softmax_scale=softmax_scale,
                                            causal=causal, pdl=pdl)


def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, block_table=None,
                                 k_scale=None, v_scale=None, softmax_scale=None, causal=True,
                                 pdl=None):
    return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)


def _moe_combine(y, rows, weights, pdl=None):
    return moe_combine(y, rows, weights, pdl=pdl)


def _moe_combine_fake(y, rows, weights, pdl=None):
    return combined_output(rows.shape[0], y.shape[1], y.device)


OPERATORS = {
    "rms_norm": ("(Tensor x, Tensor weight, float eps=1e-06, *, bool? pdl=None) -> Tensor",
                 _rms_norm, _rms_norm_fake),
    "quantize_fp8_per_token": ("(Tensor x, str scale_layout=\"mn_major\", *, bool? pdl=None)"
                               " -> (Tensor, Tensor)",
                               _quantize_fp8_per_token, _quantize_fp8_per_token_fake),
    "rms_norm_quantize_fp8": ("(Tensor x, Tensor weight, float eps=1e-06, "
                              "str scale_layout=\"mn_major\", *, bool? pdl=None) "
                              "-> (Tensor, Tensor)",
                              _rms_norm_quantize_fp8, _rms_norm_quantize_fp8_fake),
    "silu_mul_quantize_fp8": ("(Tensor gate, Tensor up, str scale_layout=\"mn_major\", *, "
                              "bool? pdl=None) -> (Tensor, Tensor)",
                              _silu_mul_quantize_fp8, _silu_mul_quantize_fp8_fake),
    "quantize_fp8_per_block": ("(Tensor w, *, bool? pdl=None) -> (Tensor, Tensor)",
                               _quantize_fp8_per_block, _quantize_fp8_per_block_fake),
    "fp8_gemm_nt": (f"(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor(d!) d, Tensor? c=None, *,"
                    f" Tensor? bias=None, Tensor? residual=None, float? alpha=None, "
                    f"{_GEMM_OPTIONS}) -> ()", _fp8_gemm_nt, _writes_d),
    "bf16_gemm_nt": (f"(Tensor a, Tensor b, Tensor(d!) d, Tensor? c=None, *, "
                     f"Tensor? bias=None, Tensor? residual=None, float? alpha=None, "
                     f"{_GEMM_OPTIONS}) -> ()", _bf16_gemm_nt, _writes_d),
    "m_grouped_fp8_gemm_nt_contiguous": (
        f"(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor(d!) d, Tensor m_indices, *, "
        f"Tensor? rows_used=None, {_GEMM_OPTIONS}) -> ()", _m_grouped_fp8_gemm_nt_contiguous,
        _writes_d),
    "m_grouped_bf16_gemm_nt_contiguous": (
        f"(Tensor a, Tensor b, Tensor(d!) d, Tensor m_indices, *, Tensor? rows_used=None, "
        f"{_GEMM_OPTIONS}) -> ()",
        _m_grouped_bf16_gemm_nt_contiguous, _writes_d),
    "m_grouped_fp8_gemm_nt_masked": (
        f"(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor(d!) d, Tensor masked_m, "
        f"int expected_m, *, {_GEMM_OPTIONS}) -> ()", _m_grouped_fp8_gemm_nt_masked, _writes_d),
    "m_grouped_bf16_gemm_nt_masked": (
        f"(Tensor a, Tensor b, Tensor(d!) d, Tensor masked_m, int expected_m, *, "
        f"{_GEMM_OPTIONS}) -> ()", _m_grouped_bf16_gemm_nt_masked, _writes_d),
    "moe_routing_layout": ("(Tensor topk_idx, int num_experts, *, str layout=\"contiguous\", "
                           "int? rows_per_expert=None, bool? pdl=None) "
                           "-> (Tensor, Tensor, Tensor?, Tensor?)",
                           _moe_routing_layout, _moe_routing_layout_fake),
    "moe_permute_quantize_fp8": ("(Tensor x, Tensor rows, int[] shape, *, bool? pdl=None) "
                                 "-> (Tensor, Tensor)", _moe_permute_quantize_fp8,
                                 _moe_permute_quantize_fp8_fake),
    "moe_silu_mul_quantize_fp8": ("(Tensor d, Tensor rows, *, bool? pdl=None) -> (Tensor, Tensor)",
                                  _moe_silu_mul_quantize_fp8, _moe_silu_mul_quantize_fp8_fake),
    "moe_combine": ("(Tensor y, Tensor rows, Tensor weights, *, bool? pdl=None) -> Tensor",
                    _moe_combine, _moe_combine_fake),
    "attention_with_kvcache": ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor "
                               "cache_seqlens, *, Tensor? block_table=None, Tensor? "
                               "k_scale=None, Tensor? v_scale=None, float? "
                               "softmax_scale=None, bool causal=True, bool? pdl=None) -> "
                               "Tensor",
                               _attention_with_kvcache,
                               _attention_with_kvcache_fake),
}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., K] as [M, K] rows: a view where the strides allow (the column slices of a
    fused GEMM's output are), else a copy."""
    return t.reshape(-1, t.shape[-1])


def _linear_output(x, n: int):
    return torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16, device=x.device)


def _linear_residual(residual, d):
    """A linear's residual [..., N] (d's shape: x's leading dimensions) as rows, like the
    GEMM's d (a view where its strides allow)."""
    if residual is None:
        return None
    require_shape("residual", residual.shape, d.shape)
    return _rows(residual)


def _fp8_linear(x, x_scales, wq, ws, bias=None, residual=None):
    d = _linear_output(x, wq.shape[0])
    if x_scales is not None:
        a = (_rows(x), x_scales)
    else:
        a = rowwise.quantize_fp8_per_token(_rows(x))
    gemm.fp8_gemm_nt(a, (wq, ws), _rows(d), bias=bias, residual=_linear_residual(residual, d))
    return d


def _bf16_linear(x, w, bias=None, residual=None):
    d = _linear_output(x, w.shape[0])
    gemm.bf16_gemm_nt(_rows(x), w, _rows(d), bias=bias,
                      residual=_linear_residual(residual, d))
    return d


def _bf16_linear_f32(x, w):
    d = torch.zeros((*x.shape[:-1], w.shape[0]), dtype=torch.float32, device=x.device)
    gemm.bf16_gemm_nt(_rows(x), w, _rows(d), c=_rows(d))
    return d


def _rms_norm_fp8(x, weight, eps):
    q, scales = rowwise.rms_norm_quantize_fp8(_rows(x), weight, eps)
    return q.view(x.shape), scales


def _silu_mul_fp8(gate, up):
    q, scales = rowwise.silu_mul_quantize_fp8(_rows(gate), _rows(up))
    return q.view(gate.shape), scales


def _quantized_like(x):
    q, scales = rowwise.quantized_outputs(x.numel() // x.shape[-1], x.shape[-1], "mn_major",
                                          x.device)
    return q.view(x.shape), scales


def _moe_experts_fp8(x, topk_idx, topk_weights, w13, s13, w2, s2):
    return moe.moe_experts_fp8(x, topk_idx, topk_weights, (w13, s13), (w2, s2))


# What the torch.compile backend (ptxforge.compiler) puts in a model's graph: functional
# operators (they allocate their outputs) on x [..., K] as the model holds it. fp8_linear's
# x is bf16 (quantized per token inside), or e4m3 with its scales as rms_norm_fp8 and
# silu_mul_fp8 write them (q shaped like their input, scales MN-major); residual [..., N]
# is added in the GEMM's epilogue.
COMPILER_OPERATORS = {
    "fp8_linear": ("(Tensor x, Tensor? x_scales, Tensor wq, Tensor ws, Tensor? bias=None, "
                   "Tensor? residual=None) -> Tensor", _fp8_linear,
                   lambda x, x_scales, wq, ws, bias=None, residual=None:
                       _linear_output(x, wq.shape[0])),
    "bf16_linear": ("(Tensor x, Tensor w, Tensor? bias=None, Tensor? residual=None) -> Tensor",
                    _bf16_linear,
                    lambda x, w, bias=None, residual=None: _linear_output(x, w.shape[0])),
    # x @ w.T of bf16 x and w into f32 (a Linear of their f32 casts: the same products)
    "bf16_linear_f32": ("(Tensor x, Tensor w) -> Tensor", _bf16_linear_f32,
                        lambda x, w: x.new_empty((*x.shape[:-1], w.shape[0]),
                                                 dtype=torch.float32)),
    "rms_norm_fp8": ("(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", _rms_norm_fp8,
                     lambda x, weight, eps: _quantized_like(x)),
    "silu_mul_fp8": ("(Tensor gate, Tensor up) -> (Tensor, Tensor)", _silu_mul_fp8,
                     lambda gate, up: _quantized_like(gate)),
    # A MoE layer's experts (compiler/moe.py): x [T, H], the router's top-k, the experts'
    # FP8 weights gate_up [E, 2I, H] and down [E, H, I] with their 128x128 block scales.
    "moe_experts_fp8": ("(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w13, "
                        "Tensor s13, Tensor w2, Tensor s2) -> Tensor", _moe_experts_fp8,
                        lambda x, topk_idx, topk_weights, w13, s13, w2, s2:
                            torch.empty_like(x, memory_format=torch.contiguous_format)),
}

for _name, (_schema, _cuda, _fake) in {**OPERATORS, **COMPILER_OPERATORS}.items():
    _library.define(_name + _schema)
    _library.impl(_name, _cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=_library)
