"""Few-token GEMMs: the tile model's choice against variants of it (producer warps, tile
width, rows covered), as % of a same-size device-to-device copy, in one run.

    python bench/decode_tiles.py

Bytes per GEMM: A, B, their scales and D; the limit is a torch copy moving as many bytes
(read + write), timed the same way (profiler, L2 flushed, median).
"""

import torch

from ptxforge import ops
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.ops import common
from ptxforge.bench.ops import Timer, copy_of, gemm_bytes
from ptxforge.testing.checks import fp8_gemm_operands

SHAPES = ((2112, 7168), (4096, 7168), (7168, 16384), (7168, 2048))
# (rows covered: None keeps the chosen, block_n multiple of the chosen width, producer
# warps, CTAs an SM)
VARIANTS = ((0, 1, 2, 1), (None, 1, 1, 1), (None, 1, 4, 1), (None, 2, 2, 1), (None, 2, 4, 1),
            (None, 1, 2, 2))
arch = common.device_arch(0)
timer = Timer()
print("dtype    M       N x K     | chosen                 %copy | " +
      " | ".join(f"r{'=' if r is None else r} bn x{w} w{p} c{c}" for r, w, p, c in VARIANTS))
for dtype in ("e4m3", "bf16"):
    for n, k in SHAPES:
        for m in (1, 8, 32):
            if dtype == "e4m3":
                a, b, _ = fp8_gemm_operands(m, n, k)
                call = lambda cfg: ops.fp8_gemm_nt(a, b, d, config=cfg)
            else:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                call = lambda cfg: ops.bf16_gemm_nt(a, b, d, config=cfg)
            d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            copy = copy_of(gemm_bytes([m], n, k, fp8=dtype == "e4m3"))
            copy_us = timer(copy)
            chosen = gemm.choose_config(arch, GemmProblem(n, k, dtype), m)
            text = f"{dtype:5} {m:4} {n:6} x {k:5} | {chosen.name.split('_', 4)[-1][-32:]:22} {100 * copy_us / timer(lambda: call(chosen)):5.0f}"
            for rows, widen, warps, ctas in VARIANTS:
                try:
                    cfg = gemm.make_config(arch, chosen.problem, 64, chosen.block_n * widen, ctas,
                                           producers=warps,
                                           tile_rows=chosen.tile_rows if rows is None else rows)
                except ValueError:
                    text += " |    -"
                    continue
                text += f" | {100 * copy_us / timer(lambda: call(cfg)):5.0f}"
            print(text, flush=True)
