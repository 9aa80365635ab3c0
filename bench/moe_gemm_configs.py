"""The MoE op's gate_up and down GEMMs at DeepSeek-V3's sizes, 4096 tokens (contiguous
layout, rows_used from the routing), under forced tile configs beside the heuristic's:
kernel time (profiler, L2 flushed, median) and TFLOPS over the rows computed and over the
pairs. A probe for what limits the grouped GEMM on small groups (~128 rows an expert).

    python bench/moe_gemm_configs.py
"""

import sys

import torch

import ptxforge
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import _common, moe
from ptxforge.testing.bench import Timer, format_table

sys.path.insert(0, "bench")
from moe_kernels import problem  # noqa: E402

tokens, experts, inner, hidden, top_k = 4096, 256, 2048, 7168, 8
x, idx, w, gate_up, down = problem("deepseek-v3", tokens)
r = ptxforge.moe_routing_layout(idx, experts)
lead = (moe.max_contiguous_rows(tokens, top_k, experts),)
a = ptxforge.moe_permute_quantize_fp8(x, r.rows, lead)
h = moe.grouped_quantized(lead, inner, "cuda")
h[0].view(torch.uint8).random_(0, 120)
h[1].fill_(1e-3)
d1 = torch.empty(*lead, 2 * inner, dtype=torch.bfloat16, device="cuda")
y = torch.empty(*lead, hidden, dtype=torch.bfloat16, device="cuda")
used = int(r.rows_used)
arch = _common.device_arch(0)
timer = Timer()
rows = []
for name, lhs, b, d, n, k in (("gate_up", a, gate_up, d1, 2 * inner, hidden),
                              ("down", h, down, y, hidden, inner)):
    configs = {"heuristic": None}
    base = gemm.choose_config(arch, lead[0], n, k, groups=experts)
    for raster in (1, 2, 4, 8, 16):
        configs[f"heuristic, raster {raster}"] = gemm.make_config(
            arch, n, k, base.block_m, base.block_n, base.ctas_per_sm, base.multicast,
            base.part_buffers, groups=experts, producers=base.producers, raster=raster)
    fns = [lambda c=c, lhs=lhs, b=b, d=d: ptxforge.m_grouped_fp8_gemm_nt_contiguous(
        lhs, b, d, r.m_indices, rows_used=r.rows_used, config=c) for c in configs.values()]
    for (label, cfg), t in zip(configs.items(), timer.each(fns)):
        flops = 2 * n * k
        rows.append([name, label, cfg.name if cfg else "-", f"{t * 1e3:.0f}",
                     f"{flops * used / t / 1e9:.0f}", f"{flops * tokens * top_k / t / 1e9:.0f}"])
print(f"{torch.cuda.get_device_name()}: rows computed {used} for {tokens * top_k} pairs")
print(format_table(["gemm", "config", "kernel", "us", "TFLOPS (computed)", "TFLOPS (pairs)"], rows))
