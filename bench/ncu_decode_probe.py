"""Where a decode GEMM's bytes go: run under ncu with the bench's L2 flush (a 256 MB
zero_) before each kernel, e.g.

    ncu --cache-control none --clock-control none --kernel-name regex:'^(?!.*FillFunctor)' \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python bench/ncu_decode_probe.py

Kernels, in order: the FP8 GEMM at M = 1 for 2112 x 7168 and 7168 x 2048 (the model's
tile), then a torch copy of the same bytes for each."""

import torch

from ptxforge import ops
from ptxforge.bench.ops import copy_of, gemm_bytes
from ptxforge.testing.checks import fp8_gemm_operands

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
calls = []
for n, k in ((2112, 7168), (7168, 2048)):
    a, b, _ = fp8_gemm_operands(1, n, k)
    d = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    calls.append(lambda a=a, b=b, d=d: ops.fp8_gemm_nt(a, b, d))
for n, k in ((2112, 7168), (7168, 2048)):
    calls.append(copy_of(gemm_bytes([1], n, k)))
for call in calls:
    call()          # build and warm up
torch.cuda.synchronize()
for _ in range(3):
    for call in calls:
        flush.zero_()
        call()
torch.cuda.synchronize()
