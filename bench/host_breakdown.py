"""Where the host time of one small op goes: each step timed alone, 20,000 calls each."""

import sys
import time

import torch

import ptxforge
from ptxforge.ops import _common, rowwise

N = 20000
x = torch.randn((4, 1024), device="cuda").to(torch.bfloat16)
w = torch.randn((1024,), device="cuda").to(torch.bfloat16)
ptxforge.rms_norm(x, w)
ptxforge.quantize_fp8_per_token(x)
_, launcher, _ = rowwise._kernel(0, 1024, True, False)
y = torch.empty_like(x)
args = (x.data_ptr(), x.stride(0), 4, w.data_ptr(), 1e-6, y.data_ptr())
stream = _common.current_stream(0)

steps = {
    "x.get_device()": lambda: x.get_device(),
    "x.data_ptr()": lambda: x.data_ptr(),
    "current_stream(0)": lambda: _common.current_stream(0),
    "check_tensor + check_rows(x)": lambda: (_common.check_tensor("x", x, torch.bfloat16, 2),
                                             _common.check_rows("x", x)),
    "x.device": lambda: x.device,
    "torch.empty((4,1024), bf16)": lambda: torch.empty((4, 1024), dtype=torch.bfloat16, device=x.device),
    "torch.empty_strided f32": lambda: torch.empty_strided((4, 8), (1, 4), dtype=torch.float32, device=x.device),
    "rowwise._kernel lookup": lambda: rowwise._kernel(0, 1024, True, False),
    "launcher() alone": lambda: launcher((1, 1, 1), stream, args),
    "ptxforge.rms_norm": lambda: ptxforge.rms_norm(x, w),
    "ptxforge.quantize_fp8_per_token": lambda: ptxforge.quantize_fp8_per_token(x),
    "torch F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6),
    "torch x.add_(0)": lambda: x.add_(0),
}
rows = []
for name, fn in steps.items():
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(N):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / N * 1e6)
    rows.append((name, sorted(times)[1]))
out = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout
for name, us in rows:
    print(f"{name:<36} {us:7.2f} us", file=out)
