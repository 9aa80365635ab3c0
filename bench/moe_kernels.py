"""The MoE op's own kernels (routing layout, permutation + quantization, SwiGLU +
quantization of the grouped rows, combine) and its two grouped GEMMs, one by one, at
DeepSeek-V3's and Mixtral's sizes: kernel time (profiler, L2 flushed, median), the bytes
each must move, and that against a device-to-device copy of the same bytes timed in the
same run.

    python bench/moe_kernels.py [deepseek-v3:4096 deepseek-v3:64 mixtral:2048 mixtral:16]
"""

import sys

import torch

import ptxforge
from ptxforge.bench import format_table
from ptxforge.bench.ops import Timer, copy_of
from ptxforge.ops import moe

SIZES = {"deepseek-v3": (7168, 2048, 256, 8), "mixtral": (4096, 14336, 8, 2)}


def problem(model: str, tokens: int):
    hidden, inner, experts, top_k = SIZES[model]
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    scores = torch.rand(tokens, experts, device="cuda")
    weights, idx = scores.topk(top_k, dim=-1)
    gate_up = ptxforge.quantize_fp8_per_block(
        (torch.randn(experts * 2 * inner, hidden, device="cuda") * 0.02).bfloat16())
    down = ptxforge.quantize_fp8_per_block(
        (torch.randn(experts * hidden, inner, device="cuda") * 0.02).bfloat16())
    gate_up = (gate_up[0].view(experts, 2 * inner, hidden), gate_up[1].view(experts, -1, gate_up[1].shape[1]))
    down = (down[0].view(experts, hidden, inner), down[1].view(experts, -1, down[1].shape[1]))
    return x, idx, weights.float(), gate_up, down


def measure(model: str, tokens: int, timer: Timer) -> list:
    x, idx, w, gate_up, down = problem(model, tokens)
    hidden, inner, experts, top_k = SIZES[model]
    layout = moe.choose_layout(tokens, top_k, experts)
    r = ptxforge.moe_routing_layout(idx, experts, layout=layout,
                                    rows_per_expert=tokens if layout == "masked" else None)
    lead = moe.grouped_rows(layout, tokens, top_k, experts)
    expected = moe.expected_rows(tokens, top_k, experts)
    a = moe.grouped_quantized(lead, hidden, "cuda")
    d1 = torch.empty(*lead, 2 * inner, dtype=torch.bfloat16, device="cuda")
    h = moe.grouped_quantized(lead, inner, "cuda")
    y = torch.empty(*lead, hidden, dtype=torch.bfloat16, device="cuda")
    pairs = tokens * top_k
    active = int((r.counts > 0).sum())
    # The permutation's peer: torch scattering the same e4m3 rows (already quantized) into
    # the same grouped rows, the source broadcast over the k pairs of a token.
    dense_q = ptxforge.quantize_fp8_per_token(x)[0].view(torch.uint8)
    grouped_bytes = a[0].view(torch.uint8).view(-1, hidden)
    kept = r.rows.view(-1) >= 0
    scatter_rows = r.rows.view(-1)[kept].long()
    scatter_src = dense_q[:, None, :].expand(tokens, top_k, hidden).reshape(-1, hidden)[kept]
    steps = {
        "routing layout": (lambda: ptxforge.moe_routing_layout(
            idx, experts, layout=layout, rows_per_expert=tokens if layout == "masked" else None),
            pairs * 12),
        "permute + quantize": (lambda: ptxforge.moe_permute_quantize_fp8(x, r.rows, lead, out=a),
                               tokens * hidden * 2 + pairs * (hidden + hidden // 32)),
        "torch index_copy_, same rows": (
            lambda: grouped_bytes.index_copy_(0, scatter_rows, scatter_src), pairs * hidden * 2),
        "gemm gate_up": (lambda: moe._grouped_gemm(layout, a, gate_up, d1, r, expected),
                         active * 2 * inner * hidden + pairs * (hidden + 4 * inner)),
        "silu_mul + quantize": (lambda: ptxforge.moe_silu_mul_quantize_fp8(d1, r.rows, out=h),
                                pairs * (4 * inner + inner + inner // 32)),
        "gemm down": (lambda: moe._grouped_gemm(layout, h, down, y, r, expected),
                      active * hidden * inner + pairs * (inner + 2 * hidden)),
        "combine": (lambda: ptxforge.moe_combine(y.view(-1, hidden), r.rows, w),
                    pairs * 2 * hidden + tokens * 2 * hidden),
        "whole op": (lambda: moe.moe_experts_fp8(x, idx, w, gate_up, down), 0),
    }
    times = timer.each([fn for fn, _ in steps.values()])
    copies = timer.each([copy_of(max(nbytes, 2)) for _, nbytes in steps.values()])
    rows = []
    for (name, (_, nbytes)), t, c in zip(steps.items(), times, copies):
        rows.append([f"{model} T={tokens} ({layout}, {active} of {experts} active)", name,
                     f"{t * 1e3:.1f}", f"{nbytes / 1e6:.1f}" if nbytes else "-",
                     f"{nbytes / t / 1e6:.0f}" if nbytes else "-",
                     f"{100 * c / t:.0f}%" if nbytes else "-"])
    return rows


def main(cases) -> None:
    timer = Timer()
    rows = []
    for case in cases:
        model, tokens = case.split(":")
        rows += measure(model, int(tokens), timer)
    print(f"{torch.cuda.get_device_name()}: MoE kernels (profiler, L2 flushed, median)")
    print(format_table(["case", "kernel", "us", "MB moved", "GB/s", "copy of the bytes / kernel"],
                       rows))


if __name__ == "__main__":
    main(sys.argv[1:] or ["deepseek-v3:4096", "deepseek-v3:64", "mixtral:2048", "mixtral:16"])
