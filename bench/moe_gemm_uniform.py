"""DeepSeek-V3's grouped GEMMs (256 experts, gate_up 4096x7168 and down 7168x2048) on
contiguous layouts where every expert holds the same number of rows: what the heuristic's
configs reach with no padding (128 and 256 rows an expert: whole tiles) against the op at
4096 tokens, whose ~128 rows an expert are padded to 128-row segments (49280 rows for
32768 pairs). Kernel time (profiler, L2 flushed, median), TFLOPS, and the weights' bytes
over the time.

    python bench/moe_gemm_uniform.py [rows an expert ...]     (default 128 256)
"""

import sys

import torch

import ptxforge
from ptxforge.bench import format_table
from ptxforge.bench.ops import Timer
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import common

sys.path.insert(0, "bench")
from moe_kernels import SIZES, problem  # noqa: E402

hidden, inner, experts, _ = SIZES["deepseek-v3"]
arch = common.device_arch(0)
timer = Timer()
_, _, _, gate_up, down = problem("deepseek-v3", 1)   # the op's weights, as moe_kernels draws them

rows = []
problems = (("gate_up", gate_up, 2 * inner, hidden), ("down", down, hidden, inner))
for per_expert in [int(r) for r in sys.argv[1:]] or [128, 256]:
    if per_expert % gemm.CONTIGUOUS_ALIGNMENT:
        raise SystemExit(f"rows an expert must be a multiple of {gemm.CONTIGUOUS_ALIGNMENT}")
    m = experts * per_expert
    m_indices = torch.arange(experts, device="cuda", dtype=torch.int32).repeat_interleave(per_expert)
    for name, b, n, k in problems:
        a = ptxforge.quantize_fp8_per_token(torch.randn(m, k, device="cuda").bfloat16())
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cfg = gemm.choose_config(arch, m, n, k, groups=experts)
        t = timer(lambda: ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices))
        rows.append([name, str(per_expert), cfg.name, f"{t * 1e3:.0f}",
                     f"{2 * m * n * k / t / 1e9:.0f}", f"{experts * n * k / t / 1e6:.0f}"])
print(f"{torch.cuda.get_device_name()}: {experts} experts, every one the same rows")
print(format_table(["gemm", "rows an expert", "kernel", "us", "TFLOPS", "weights GB/s"], rows))
