"""The MoE op's masked grouped GEMMs at decode (DeepSeek-V3's sizes, 64 tokens, ~225
experts holding ~2 pairs each), under forced tile configs beside the heuristic's: kernel
time (profiler, L2 flushed, median) and the weights' bytes against a copy of the same
bytes. A probe for the down projection (N 7168, K 2048) streaming slower than gate_up.

    python bench/moe_decode_configs.py
"""

import sys

import torch

import ptxforge
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import _common, moe
from ptxforge.testing.bench import Timer, copy_of, format_table

sys.path.insert(0, "bench")
from moe_kernels import problem  # noqa: E402

tokens, experts, inner, hidden, top_k = 64, 256, 2048, 7168, 8
x, idx, w, gate_up, down = problem("deepseek-v3", tokens)
r = ptxforge.moe_routing_layout(idx, experts, layout="masked", rows_per_expert=tokens)
lead = (experts, tokens)
a = ptxforge.moe_permute_quantize_fp8(x, r.rows, lead)
h = moe.grouped_quantized(lead, inner, "cuda")
h[0].view(torch.uint8).random_(0, 120)
h[1].fill_(1e-3)
d1 = torch.empty(*lead, 2 * inner, dtype=torch.bfloat16, device="cuda")
y = torch.empty(*lead, hidden, dtype=torch.bfloat16, device="cuda")
active = int((r.counts > 0).sum())
expected = -(-tokens * top_k // experts)
arch = _common.device_arch(0)
timer = Timer()
rows = []
for name, lhs, b, d, n, k in (("gate_up", a, gate_up, d1, 2 * inner, hidden),
                              ("down", h, down, y, hidden, inner)):
    configs = {"heuristic": None}
    for block_n in (64, 96, 128, 160, 192, 256):
        for tile_rows, ctas in ((8, 2), (8, 1), (0, 1)):
            try:
                configs[f"64x{block_n} rows {tile_rows or 64} ctas {ctas}"] = gemm.make_config(
                    arch, n, k, 64, block_n, ctas, groups=experts, masked=True,
                    tile_rows=tile_rows)
            except ValueError:
                pass
    fns = [lambda c=c, lhs=lhs, b=b, d=d: ptxforge.m_grouped_fp8_gemm_nt_masked(
        lhs, b, d, r.counts, expected, config=c) for c in configs.values()]
    nbytes = active * n * k
    copy = timer(copy_of(nbytes))
    for (label, cfg), t in zip(configs.items(), timer.each(fns)):
        rows.append([name, label, cfg.name if cfg else "-", f"{t * 1e3:.0f}",
                     f"{100 * copy / t:.0f}%"])
print(f"{torch.cuda.get_device_name()}: {active} experts active, expected_m {expected}")
print(format_table(["gemm", "config", "kernel", "us", "copy of the weights / kernel"], rows))
