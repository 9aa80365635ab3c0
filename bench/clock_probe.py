"""SM clock and board power while one GEMM runs back to back, beside cuBLAS blockwise
(nvidia-smi sampled every 100 ms): whether the GPU runs at its power cap.

    python bench/clock_probe.py [M N K]
"""

import subprocess
import sys
import time

import torch

from ptxforge import ops
from ptxforge.bench.ops import _torch_blockwise
from ptxforge.testing.checks import fp8_gemm_operands

m, n, k = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 7168, 16384)
(qa, sa), (qb, sb), _ = fp8_gemm_operands(m, n, k)
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
peers = {"ptxforge": lambda: ops.fp8_gemm_nt((qa, sa), (qb, sb), d),
         "cuBLAS blockwise": _torch_blockwise(qa, sa, qb, sb)}
query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
         "--format=csv,noheader", "-lms", "100"]
for name, fn in peers.items():
    fn()
    torch.cuda.synchronize()
    sampler = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
    start, calls = time.time(), 0
    while time.time() - start < 2.5:
        for _ in range(50):
            fn()
        calls += 50
        torch.cuda.synchronize()
    seconds = time.time() - start
    sampler.terminate()
    samples = sampler.communicate()[0].splitlines()[8:]  # after the first 0.8 s
    print(f"{name}: {2 * m * n * k * calls / seconds / 1e12:.0f} TFLOPS back to back; "
          f"clock, power, throttle reasons: {' | '.join(samples[::4])}")
