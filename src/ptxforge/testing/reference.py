"""Torch references for the kernels' recipes: what "correct" means, written plainly.

The quantization references are DeepGEMM's recipes (``per_token_cast_to_fp8``,
``per_block_cast_to_fp8``), extended to K that is not a multiple of 128 by padding the
last group with zeros. The kernels match them bit for bit on the fp8 data and the scales.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize_fp8_per_token(x: torch.Tensor, group: int = 128):
    """x bf16 [M, K] -> (q e4m3 [M, K], scales f32 [M, ceil(K/group)])."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x, (0, -k % group))
    view = padded.view(m, padded.shape[1] // group, group)  # M = 0 too
    amax = view.abs().float().amax(dim=2).clamp(AMAX_FLOOR)
    # ``448 / amax`` and ``amax / 448`` as CUDA evaluates them (a reciprocal times 448, a
    # product with 1 / 448), written out so the CPU rounds them the same way.
    q = (view * (amax.unsqueeze(2).reciprocal() * E4M3_MAX)).to(torch.float8_e4m3fn)
    return q.view(m, padded.shape[1])[:, :k].contiguous(), amax * (1.0 / E4M3_MAX)


def quantize_fp8_per_block(w: torch.Tensor, block: int = 128):
    """w bf16 [N, K] -> (q e4m3 [N, K], scales f32 [ceil(N/block), ceil(K/block)])."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % block, 0, -n % block))
    view = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    q = (view * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:n, :k].contiguous(), (amax / E4M3_MAX).view(view.shape[0], view.shape[2])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """f32 math: x * rsqrt(mean(x^2) + eps) * weight, rounded once to bf16."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(torch.bfloat16)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's h as eager PyTorch computes it on bf16 tensors: silu(gate) in f32 (with
    expf and an IEEE divide) rounded to bf16, times up in f32 rounded to bf16. The fused
    kernel's silu may round a few elements the other way (``checks.silu_other_rounding``)."""
    return torch.nn.functional.silu(gate) * up


def dequantize_per_token(q: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """f32 q * scale, each scale repeated over its group of channels."""
    k = q.shape[1]
    return q.float() * scales.float().repeat_interleave(group, dim=1)[:, :k]


def dequantize_per_block(q: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    n, k = q.shape
    full = scales.float().repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return q.float() * full[:n, :k]


def moe_combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its experts' rows, as the eager loop computes it: from
    zeros, for j in order, ``acc = acc + y[rows[:, j]].float() * weights[:, j:j+1].float()``
    (two kernels: the product and the sum each rounded to f32), a pair whose row is outside
    [0, R) skipped; then one rounding to bf16. The kernel gives these bits for finite
    inputs; a NaN differs only in its payload (torch's 0x7FC0 against the hardware's 0x7FFF)."""
    r, hidden = y.shape
    kept = (rows >= 0) & (rows < r)
    padded = torch.cat([y, y.new_zeros(1, hidden)])  # dropped pairs gather this row, unused
    index = torch.where(kept, rows, r).long()
    acc = torch.zeros(rows.shape[0], hidden, dtype=torch.float32, device=y.device)
    for j in range(rows.shape[1]):
        term = acc + padded[index[:, j]].float() * weights[:, j:j + 1].float()
        acc = torch.where(kept[:, j:j + 1], term, acc)
    return acc.bfloat16()


def moe_routing_layout(topk_idx: torch.Tensor, num_experts: int, layout: str = "contiguous",
                       rows_per_expert: int | None = None, alignment: int = 128):
    """The MoE routing layout, by sorting: ``(rows [T, k], counts [E], m_indices, rows_used)``,
    int32, as ``ptxforge.moe_routing_layout`` documents it (m_indices and rows_used None in
    the masked layout). A pair's rank within its expert is its place among the pairs naming
    that expert in flat order, which a stable sort by expert gives."""
    tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    n = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    expert = torch.where(valid, flat, num_experts)        # one more bin: the dropped pairs
    order = torch.sort(expert, stable=True).indices
    received = torch.bincount(expert, minlength=num_experts + 1)
    first_of_expert = torch.cumsum(received, 0) - received
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(n, device=flat.device) - first_of_expert[expert[order]]
    received = received[:num_experts]
    if layout == "masked":
        per_expert = tokens if rows_per_expert is None else rows_per_expert
        kept = valid & (rank < per_expert)
        rows = torch.where(kept, expert * per_expert + rank, -1)
        counts = received.clamp(max=per_expert)
        return rows.view(tokens, k).int(), counts.int(), None, None
    segments = (received + alignment - 1) // alignment * alignment
    first_row = torch.cumsum(segments, 0) - segments
    rows = torch.where(valid, first_row[expert.clamp(max=num_experts - 1)] + rank, -1)
    m_indices = torch.full((n + num_experts * (alignment - 1),), -1, dtype=torch.int32,
                           device=flat.device)
    m_indices[rows[valid]] = expert[valid].int()
    rows_used = segments.sum().view(1)
    return rows.view(tokens, k).int(), received.int(), m_indices, rows_used.int()
