"""Does the bf16 decode GEMM's time depend on its tokens' data? The same GEMM with A
random, with only row 0 non-zero, and all zeros, as % of the same-size copy (profiler,
L2 flushed, median). Measured on an H200: no (within 3 points, in no order;
docs/performance.md).

    python bench/zero_rows_probe.py
"""

import torch

from ptxforge import ops
from ptxforge.bench.ops import Timer, copy_of, gemm_bytes

timer = Timer()
for n, k in ((7168, 2048), (4096, 7168), (2112, 7168)):
    for m in (8, 64):
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        one = torch.zeros_like(full)
        one[0] = full[0]
        copy = copy_of(gemm_bytes([m], n, k, fp8=False))
        copy_ms = min(timer(copy), timer(copy))
        times = [timer(lambda a=a: ops.bf16_gemm_nt(a, b, d))
                 for a in (full, one, torch.zeros_like(full))]
        print(f"bf16 M={m} {n}x{k}: % of copy with A random / one row / zeros: "
              + " / ".join(f"{100 * copy_ms / ms:.0f}" for ms in times), flush=True)
