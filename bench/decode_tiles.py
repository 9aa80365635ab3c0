"""Few-token GEMMs: the tile model's choice against the same tile covering 8, 16 or 32 rows
(``tile_rows``), as % of a same-size device-to-device copy, in one run.

    python bench/decode_tiles.py

Bytes per GEMM: A, B, their scales and D; the limit is a torch copy moving as many bytes
(read + write: a copy of bytes / 2), timed the same way (profiler, L2 flushed, median).
"""

import torch

from ptxforge import ops
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import _common
from ptxforge.testing.bench import Timer
from ptxforge.testing.checks import fp8_gemm_operands

SHAPES = ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))
arch = _common.device_arch(0)
timer = Timer()
print("dtype    M       N x K     | copy us | chosen tile          us  %copy | rows  8: us %copy | rows 16 | rows 32")
for dtype in ("e4m3", "bf16"):
    for n, k in SHAPES:
        for m in (1, 8, 16, 32, 64):
            if dtype == "e4m3":
                a, b, _ = fp8_gemm_operands(m, n, k)
                nbytes = m * k + n * k + 4 * m * (k // 128) + 4 * (n // 128) * (k // 128) + 2 * m * n
                call = lambda cfg: ops.fp8_gemm_nt(a, b, d, config=cfg)
            else:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                nbytes = 2 * (m * k + n * k + m * n)
                call = lambda cfg: ops.bf16_gemm_nt(a, b, d, config=cfg)
            d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)
            dst = torch.empty_like(src)
            copy_us = timer(lambda: dst.copy_(src))
            chosen = gemm.choose_config(arch, m, n, k, dtype=dtype)
            cells = [f"{chosen.block_m}x{chosen.block_n} s{chosen.stages} c{chosen.ctas_per_sm}",
                     timer(lambda: call(chosen))]
            for rows in (8, 16, 32):
                if rows > 2 * max(m, 8) or chosen.block_m != 64 or chosen.multicast > 1:
                    cells.append(None)
                    continue
                try:
                    cfg = gemm.make_config(arch, n, k, 64, chosen.block_n, chosen.ctas_per_sm,
                                           dtype=dtype, tile_rows=rows)
                except ValueError:
                    cells.append(None)
                    continue
                cells.append(timer(lambda: call(cfg)))
            text = f"{dtype:5} {m:4} {n:6} x {k:5} | {copy_us:7.1f} | {cells[0]:18} {cells[1]:6.1f} {100 * copy_us / cells[1]:5.0f}"
            for us in cells[2:]:
                text += " |   -     -" if us is None else f" | {us:6.1f} {100 * copy_us / us:4.0f}"
            print(text, flush=True)
