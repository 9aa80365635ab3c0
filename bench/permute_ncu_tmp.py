import torch, ptxforge
from ptxforge.ops import moe
torch.manual_seed(0)
T, H, E, k = 4096, 7168, 256, 8
x = torch.randn(T, H, device="cuda").bfloat16()
idx = torch.rand(T, E, device="cuda").topk(k, dim=-1)[1]
r = ptxforge.moe_routing_layout(idx, E)
lead = (moe.max_contiguous_rows(T, k, E),)
a = moe.grouped_quantized(lead, H, "cuda")
for _ in range(3):
    ptxforge.moe_permute_quantize_fp8(x, r.rows, lead, out=a)
torch.cuda.synchronize()
