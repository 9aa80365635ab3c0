"""One of the MoE op's grouped GEMMs at DeepSeek-V3's sizes and 4096 tokens, alone, for ncu:

    ncu --kernel-name regex:sm90 --launch-skip 2 --launch-count 1 \
        python bench/moe_gemm_ncu.py [gate_up|down] [share_b: 0|1] [raster]

share_b 1 (clusters along M sharing B; raster 1 unless given) or a raster replaces the
heuristic config's own.
"""

import dataclasses
import sys

import torch

import ptxforge
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import common, moe

sys.path.insert(0, "bench")
from moe_kernels import problem  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "gate_up"
share_b = sys.argv[2:3] == ["1"]
raster = int(sys.argv[3]) if len(sys.argv) > 3 else None
x, idx, w, gate_up, down = problem("deepseek-v3", 4096)
experts, inner, hidden = 256, 2048, 7168
r = ptxforge.moe_routing_layout(idx, experts)
lead = moe.grouped_rows("contiguous", 4096, 8, experts)
a = ptxforge.moe_permute_quantize_fp8(x, r.rows, lead)
d1 = torch.empty(*lead, 2 * inner, dtype=torch.bfloat16, device="cuda")
h = moe.grouped_quantized(lead, inner, "cuda")
y = torch.empty(*lead, hidden, dtype=torch.bfloat16, device="cuda")
print("rows used", int(r.rows_used), "of", lead[0], "pairs", 4096 * 8)
lhs, b, d, n, k = (a, gate_up, d1, 2 * inner, hidden) if which == "gate_up" else \
    (h, down, y, hidden, inner)
arch = common.device_arch(0)
cfg = gemm.choose_config(arch, lead[0], n, k, groups=experts)
cfg = (gemm.make_config(arch, n, k, cfg.block_m, cfg.block_n, 1, 2, cfg.part_buffers,
                        groups=experts, share_b=True, raster=raster or 1) if share_b
       else dataclasses.replace(cfg, raster=raster or cfg.raster))
print(cfg.name)
for _ in range(3):
    ptxforge.m_grouped_fp8_gemm_nt_contiguous(lhs, b, d, r.m_indices, rows_used=r.rows_used,
                                              config=cfg)
torch.cuda.synchronize()
