"""Where the host time of one small op goes.

Two measures per step: 'host' = wall time per call while the GPU is kept busy by a long
sleep kernel (so nothing waits for the GPU: pure host cost, up to the launch queue), and
'back-to-back' = wall time per call of many calls followed by a synchronize (the issue's
measure: host cost, or the GPU's launch throughput when that is slower).
"""

import sys
import time

import torch

import ptxforge
from ptxforge.ops import _common, rowwise

x = torch.randn((4, 1024), device="cuda").to(torch.bfloat16)
w = torch.randn((1024,), device="cuda").to(torch.bfloat16)
y = torch.empty_like(x)
q = torch.empty((4, 1024), dtype=torch.float8_e4m3fn, device="cuda")
s = torch.empty((4, 8), dtype=torch.float32, device="cuda")
ptxforge.rms_norm(x, w)
ptxforge.quantize_fp8_per_token(x)
_, _, launcher = rowwise._kernel(0, 1024, True, False)
args = (x.data_ptr(), x.stride(0), 4, w.data_ptr(), 1e-6, y.data_ptr())
stream = _common.current_stream(0)
device = x.device
ga, gb = ptxforge.quantize_fp8_per_token(x), ptxforge.quantize_fp8_per_block(torch.randn((256, 1024), device="cuda").to(torch.bfloat16))
gd = torch.empty((4, 256), dtype=torch.bfloat16, device="cuda")
# MoE: 2 groups of 128 rows (contiguous), 2 x 64 of 128 rows (masked); bf16 dense.
gq = ptxforge.quantize_fp8_per_token(torch.randn((256, 1024), device="cuda").to(torch.bfloat16))
gbb = torch.randn((2, 256, 1024), device="cuda").to(torch.bfloat16)
gB = (gbb.to(torch.float8_e4m3fn), torch.ones((2, 2, 8), device="cuda"))
m_indices = torch.arange(256, device="cuda", dtype=torch.int32) // 128
gcd = torch.empty((256, 256), dtype=torch.bfloat16, device="cuda")
mq = (gq[0].view(2, 128, 1024), gq[1].view(2, 128, 8))
masked_m = torch.tensor([64, 64], device="cuda", dtype=torch.int32)
gmd = torch.empty((2, 128, 256), dtype=torch.bfloat16, device="cuda")
xb, wb = torch.randn((4, 1024), device="cuda").to(torch.bfloat16), gbb[0]

steps = {
    "x.data_ptr()": lambda: x.data_ptr(),
    "current_stream(0)": lambda: _common.current_stream(0),
    "inspect(x) (the checks of one tensor)": lambda: _common.inspect("x", x, torch.bfloat16, 2),
    "torch.empty((4,1024), device=x.device)": lambda: torch.empty((4, 1024), dtype=torch.bfloat16, device=x.device),
    "torch.empty((4,1024), device=device)": lambda: torch.empty((4, 1024), dtype=torch.bfloat16, device=device),
    "x.new_empty((4,1024))": lambda: x.new_empty((4, 1024)),
    "torch.empty_like(x)": lambda: torch.empty_like(x),
    "torch.empty_strided f32": lambda: torch.empty_strided((4, 8), (1, 4), dtype=torch.float32, device=device),
    "rowwise._kernel lookup": lambda: rowwise._kernel(0, 1024, True, False),
    "launcher() alone [launches]": lambda: launcher((1, 1, 1), stream, args),
    "ptxforge.rms_norm(out=y) [launches]": lambda: ptxforge.rms_norm(x, w, out=y),
    "ptxforge.rms_norm [launches]": lambda: ptxforge.rms_norm(x, w),
    "ptxforge.quantize_fp8_per_token(out=) [launches]": lambda: ptxforge.quantize_fp8_per_token(x, out=(q, s)),
    "ptxforge.quantize_fp8_per_token [launches]": lambda: ptxforge.quantize_fp8_per_token(x),
    "ptxforge.fp8_gemm_nt [4x256x1024, launches]": lambda: ptxforge.fp8_gemm_nt(ga, gb, gd),
    "ptxforge.bf16_gemm_nt [4x256x1024, launches]": lambda: ptxforge.bf16_gemm_nt(xb, wb, gd),
    "m_grouped_fp8_gemm_nt_contiguous [2x128, launches]":
        lambda: ptxforge.m_grouped_fp8_gemm_nt_contiguous(gq, gB, gcd, m_indices),
    "m_grouped_fp8_gemm_nt_masked [2x64/128, launches]":
        lambda: ptxforge.m_grouped_fp8_gemm_nt_masked(mq, gB, gmd, masked_m, 64),
    "torch F.rms_norm [launches]": lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6),
    "torch x.add_(0) [launches]": lambda: x.add_(0),
}


def host_only(fn, calls=400):
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the queue never drains meanwhile
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def back_to_back(fn, calls=1000):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def median3(measure, fn):
    return sorted(measure(fn) for _ in range(3))[1]


graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    for _ in range(100):
        ptxforge.rms_norm(x, w, out=y)
graph.replay()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(20):
    graph.replay()
torch.cuda.synchronize()
graph_us = (time.perf_counter() - start) / 2000 * 1e6

out = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout
print(f"{'step':<50} {'host us':>8} {'back-to-back us':>16}", file=out)
for name, fn in steps.items():
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    print(f"{name:<50} {median3(host_only, fn):8.2f} {median3(back_to_back, fn):16.2f}", file=out)
print(f"{'GPU floor: rms_norm [4x1024] in a CUDA graph, per kernel':<50} {'':>8} {graph_us:16.2f}",
      file=out)
