"""Row kernels at 16384 x 7168 (SwiGLU: gate and up of that shape each): row groups per
CTA x scale layout. Kernel time in us (median of 30, L2 flushed), bandwidth against the
copy measured in this run."""

import torch

from ptxforge import jit
from ptxforge.bench.ops import Timer, copy_bandwidth_gbs
from ptxforge.kernels import bf16_row_rmsnorm_fp8quant as row_kernel
from ptxforge.ops import common
from ptxforge.ops.layout import empty_mn_major_scales

M, K = 16384, 7168
timer = Timer()
copy = copy_bandwidth_gbs(timer)
x = (torch.randn((M, K), device="cuda") * 2).to(torch.bfloat16)
w = torch.randn((K,), device="cuda").to(torch.bfloat16)
up = (torch.randn((M, K), device="cuda") * 2).to(torch.bfloat16)
y = torch.empty_like(x)
q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device="cuda")
layouts = {"mn_major": empty_mn_major_scales(M, K // 128, "cuda"),
           "row_major": torch.empty((M, K // 128), dtype=torch.float32, device="cuda")}
stream = common.current_stream(0)
arch = common.device_arch(0)
print(f"copy {copy:.0f} GB/s")
for variant in row_kernel.VARIANTS.values():
    if variant.row_map != "dense":
        continue
    normalize, quantize, swiglu = variant.normalize, variant.quantize, variant.swiglu
    for groups in (1, 2, 3):
        cfg = row_kernel.choose_config(arch, variant, K, groups=groups)
        compiled = jit.build(row_kernel.generate(cfg))
        launcher = compiled.launcher(0)
        if swiglu:
            head = {"gate": x.data_ptr(), "gate_row_stride": K, "up": up.data_ptr(),
                    "up_row_stride": K, "rows": M}
        else:
            head = {"x": x.data_ptr(), "x_row_stride": K, "rows": M}
        if normalize:
            head.update(weight=w.data_ptr(), eps=1e-6)
        nbytes = 2 * M * K * len(cfg.inputs) + (M * K + 4 * M * K // 128 if quantize else 2 * M * K)
        grid = -(-M // (cfg.rows_per_cta * groups))
        for layout, s in (layouts.items() if quantize else [("-", None)]):
            tail = ({"q": q.data_ptr(), "scales": s.data_ptr(), "scale_row_stride": s.stride(0),
                     "scale_group_stride": s.stride(1)} if quantize else {"y": y.data_ptr()})
            ms = timer(lambda: launcher((grid, 1, 1), stream, **head, **tail))
            gbs = nbytes / ms / 1e6
            chosen = "  <- default" if groups == variant.groups_per_cta else ""
            print(f"norm={normalize:d} quant={quantize:d} swiglu={swiglu:d} groups/CTA={groups} "
                  f"ctas/SM={cfg.ctas_per_sm} "
                  f"regs={compiled.resources.registers:3d} scales={layout:9} {ms * 1e3:6.1f} us "
                  f"{100 * gbs / copy:5.1f}% of copy{chosen}")
