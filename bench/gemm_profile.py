"""One FP8 GEMM shape, called a few times, for a profiler to pick a launch:

    ncu -k regex:sm90_fp8_gemm --launch-skip 2 -c 1 python bench/gemm_profile.py 4096 7168 16384
"""

import sys

import torch

from ptxforge import ops

m, n, k = (int(x) for x in sys.argv[1:4])
qa, sa = ops.quantize_fp8_per_token(torch.randn(m, k, device="cuda").to(torch.bfloat16))
qb, sb = ops.quantize_fp8_per_block(torch.randn(n, k, device="cuda").to(torch.bfloat16))
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
for _ in range(4):
    ops.fp8_gemm_nt((qa, sa), (qb, sb), d)
torch.cuda.synchronize()
