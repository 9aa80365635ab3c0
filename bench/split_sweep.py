"""Split-K for few tokens: the tile model's choice against wide tiles split over a
cluster of CTAs (2-8 K splits), as % of a same-size device-to-device copy, in one run.

    python bench/split_sweep.py [--quick]

For each (dtype, N x K, M) it times the choice, then for each tile width, CTAs an SM and
rows covered the split counts that put the most CTAs on the SMs without a second wave
(and one fewer). Prints one line per problem: the choice, then the best split variant
and the three next best. Bytes and limit as in `ptxforge bench decode`.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from ptxforge import jit, ops
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import _common
from ptxforge.testing.bench import Timer, copy_of, gemm_bytes
from ptxforge.testing.checks import fp8_gemm_operands

SHAPES = ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))
TOKENS = (1, 16, 64) if "--quick" in sys.argv else (1, 8, 32, 64, 128)
arch = _common.device_arch(0)
sms = arch.sm_count


def variants(dtype, m, n, k):
    rows = next((r for r in (8, 16, 32) if m <= r), 0)
    for block_n in ((64, 128) if dtype == "e4m3" else (64, 128, 192)):
        for ctas in (1, 2):
            tiles = -(-m // (rows or 64)) * -(-n // block_n)
            best = min(8, sms * ctas // tiles)
            for splits in sorted({best, best - 1, (best + 1) // 2} - {0, 1}):
                try:
                    yield gemm.make_config(arch, n, k, 64, block_n, ctas, dtype=dtype,
                                           tile_rows=rows, splits=splits)
                except ValueError:
                    pass


def tag(cfg):
    return (f"{cfg.rows}x{cfg.block_n} c{cfg.ctas_per_sm} s{cfg.stages}"
            + (f" k{cfg.splits}" if cfg.splits > 1 else ""))


problems = [(dtype, n, k, m) for dtype in ("e4m3", "bf16") for n, k in SHAPES for m in TOKENS]
configs = {p: [gemm.choose_config(arch, p[3], p[1], p[2], dtype=p[0])]
           + list(variants(p[0], p[3], p[1], p[2])) for p in problems}
with ThreadPoolExecutor(16) as pool:   # assemble everything first, in parallel
    list(pool.map(lambda cfg: jit.build(gemm.generate(cfg)),
                  {cfg for cfgs in configs.values() for cfg in cfgs}))
timer = Timer()
print("dtype    M       N x K     | chosen                 %copy | best split variants, %copy")
for (dtype, n, k, m), cfgs in configs.items():
    if dtype == "e4m3":
        a, b, _ = fp8_gemm_operands(m, n, k)
        call = lambda cfg: ops.fp8_gemm_nt(a, b, d, config=cfg)
    else:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        call = lambda cfg: ops.bf16_gemm_nt(a, b, d, config=cfg)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    copy = copy_of(gemm_bytes([m], n, k, fp8=dtype == "e4m3"))
    copy_us = min(timer(copy), timer(copy))
    results = sorted(((100 * copy_us / timer(lambda: call(cfg)), tag(cfg)) for cfg in cfgs[1:]),
                     reverse=True)
    chosen = 100 * copy_us / timer(lambda: call(cfgs[0]))
    print(f"{dtype:5} {m:4} {n:6} x {k:5} | {tag(cfgs[0]):22} {chosen:5.0f} | "
          + " | ".join(f"{t} {r:.0f}" for r, t in results[:4]), flush=True)
