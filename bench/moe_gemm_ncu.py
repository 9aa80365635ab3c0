"""One of the MoE op's grouped GEMMs at DeepSeek-V3's sizes and 4096 tokens, alone, for ncu:

    ncu --kernel-name regex:sm90 --launch-skip 2 --launch-count 1 python bench/moe_gemm_ncu.py [gate_up|down]
"""

import sys

import torch

import ptxforge
from ptxforge.ops import moe

sys.path.insert(0, "bench")
from moe_kernels import problem  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "gate_up"
x, idx, w, gate_up, down = problem("deepseek-v3", 4096)
experts, inner, hidden = 256, 2048, 7168
r = ptxforge.moe_routing_layout(idx, experts)
lead = moe.grouped_rows("contiguous", 4096, 8, experts)
a = ptxforge.moe_permute_quantize_fp8(x, r.rows, lead)
d1 = torch.empty(*lead, 2 * inner, dtype=torch.bfloat16, device="cuda")
h = moe.grouped_quantized(lead, inner, "cuda")
y = torch.empty(*lead, hidden, dtype=torch.bfloat16, device="cuda")
print("rows used", int(r.rows_used), "of", lead[0], "pairs", 4096 * 8)
for _ in range(3):
    if which == "gate_up":
        moe._grouped_gemm("contiguous", a, gate_up, d1, r, 0)
    else:
        moe._grouped_gemm("contiguous", h, down, y, r, 0)
torch.cuda.synchronize()
