"""Row kernels at 16384 x 7168 with both scale layouts: kernel time in us (median of 30,
L2 flushed) and bandwidth against the copy measured in the same run."""

import torch

from ptxforge.bench import Timer, copy_bandwidth_gbs
from ptxforge.ops import _common, rowwise
from ptxforge.ops.layout import empty_mn_major_scales

M, K = 16384, 7168
timer = Timer()
copy = copy_bandwidth_gbs(timer)
x = (torch.randn((M, K), device="cuda") * 2).to(torch.bfloat16)
w = torch.randn((K,), device="cuda").to(torch.bfloat16)
y = torch.empty_like(x)
q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device="cuda")
layouts = {"mn_major": empty_mn_major_scales(M, K // 128, "cuda"),
           "row_major": torch.empty((M, K // 128), dtype=torch.float32, device="cuda")}
stream = _common.current_stream(0)
print(f"copy {copy:.0f} GB/s")
for normalize, quantize in ((False, True), (True, True), (True, False)):
    rows_per_cta, launcher, resident = rowwise._kernel(0, K, normalize, quantize)
    head = (x.data_ptr(), K, M)
    weight = (w.data_ptr(), 1e-6) if normalize else ()
    nbytes = 2 * M * K + (M * K + 4 * M * K // 128 if quantize else 2 * M * K)
    groups = -(-M // rows_per_cta)
    for per_cta in sorted({-(-groups // resident), 8, 4, 2}, reverse=True):
        grid = -(-groups // per_cta)
        for layout, s in (layouts.items() if quantize else [("-", None)]):
            tail = (q.data_ptr(), s.data_ptr(), s.stride(0), s.stride(1)) if quantize else (y.data_ptr(),)
            ms = timer(lambda: launcher((grid, 1, 1), stream, head + (per_cta,) + weight + tail))
            gbs = nbytes / ms / 1e6
            print(f"normalize={normalize!s:5} quantize={quantize!s:5} groups/CTA={per_cta:3d} "
                  f"grid={grid:6d} scales={layout:9} {ms * 1e3:7.1f} us {gbs:6.0f} GB/s "
                  f"{100 * gbs / copy:5.1f}% of copy")
