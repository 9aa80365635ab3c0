"""One GEMM shape, called a few times, for a profiler to pick a launch:

    ncu -k regex:sm90_ --launch-skip 2 -c 1 python bench/gemm_profile.py 4096 7168 16384
    python bench/gemm_profile.py M N K [e4m3|bf16] [BMxBN[cC]]   (a forced tile, C CTAs an SM)
"""

import sys

import torch

from ptxforge import ops
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import common

m, n, k = (int(x) for x in sys.argv[1:4])
dtype = sys.argv[4] if len(sys.argv) > 4 else "e4m3"
cfg = None
if len(sys.argv) > 5:
    tile, _, ctas = sys.argv[5].partition("c")
    block_m, block_n = (int(x) for x in tile.split("x"))
    cfg = gemm.make_config(common.device_arch(0), n, k, block_m, block_n, int(ctas or 1),
                           dtype=dtype)
a, b = torch.randn(m, k, device="cuda").to(torch.bfloat16), torch.randn(n, k, device="cuda").to(torch.bfloat16)
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
if dtype == "bf16":
    call = lambda: ops.bf16_gemm_nt(a, b, d, config=cfg)
else:
    qa, qb = ops.quantize_fp8_per_token(a), ops.quantize_fp8_per_block(b)
    call = lambda: ops.fp8_gemm_nt(qa, qb, d, config=cfg)
for _ in range(4):
    call()
torch.cuda.synchronize()
