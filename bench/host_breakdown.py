"""Where the host time of one small op goes.

Two measures per step: 'host' = wall time per call while the GPU is kept busy by a long
sleep kernel (so nothing waits for the GPU: pure host cost, up to the launch queue), and
'back-to-back' = wall time per call of many calls followed by a synchronize (a serving
loop's measure: host cost, or the GPU's launch throughput when that is slower).
"""

import sys
import time

import torch

import ptxforge
from ptxforge.ops import common, rowwise

from host_ab import calls, host_us as host_only  # noqa: E402 (a script beside this one)

x = torch.randn((4, 1024), device="cuda").to(torch.bfloat16)
w = torch.randn((1024,), device="cuda").to(torch.bfloat16)
y = torch.empty_like(x)
ptxforge.rms_norm(x, w)
RMS_NORM = rowwise.VARIANTS["rms_norm"]
_, _, launcher = rowwise._kernel(0, RMS_NORM, 1024, None, 1)
args = {"x": x.data_ptr(), "x_row_stride": x.stride(0), "rows": 4, "weight": w.data_ptr(),
        "eps": 1e-6, "y": y.data_ptr()}
stream = common.current_stream(0)
device = x.device

steps = {
    "x.data_ptr()": lambda: x.data_ptr(),
    "current_stream(0)": lambda: common.current_stream(0),
    "inspect(x) (the checks of one tensor)": lambda: common.inspect("x", x, torch.bfloat16, 2),
    "torch.empty((4,1024), device=x.device)": lambda: torch.empty((4, 1024), dtype=torch.bfloat16, device=x.device),
    "torch.empty((4,1024), device=device)": lambda: torch.empty((4, 1024), dtype=torch.bfloat16, device=device),
    "x.new_empty((4,1024))": lambda: x.new_empty((4, 1024)),
    "torch.empty_like(x)": lambda: torch.empty_like(x),
    "torch.empty_strided f32": lambda: torch.empty_strided((4, 8), (1, 4), dtype=torch.float32, device=device),
    "rowwise._kernel lookup": lambda: rowwise._kernel(0, RMS_NORM, 1024, None, 1),
    "launcher() alone [launches]": lambda: launcher((1, 1, 1), stream, **args),
    **{f"ptxforge.{op} [launches]": fn for op, fn in calls(ptxforge).items()},
    "torch F.rms_norm [launches]": lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6),
    "torch x.add_(0) [launches]": lambda: x.add_(0),
}


def back_to_back(fn, count=1000):
    start = time.perf_counter()
    for _ in range(count):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / count * 1e6


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
print(f"launches through {launcher.path}", file=out)
print(f"{'step':<62} {'host us':>8} {'back-to-back us':>16}", file=out)
for name, fn in steps.items():
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    print(f"{name:<62} {median3(host_only, fn):8.2f} {median3(back_to_back, fn):16.2f}", file=out)
print(f"{'GPU floor: rms_norm [4x1024] in a CUDA graph, per kernel':<62} {'':>8} {graph_us:16.2f}",
      file=out)
