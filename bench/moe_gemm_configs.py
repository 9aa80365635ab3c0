"""The MoE op's gate_up and down GEMMs at DeepSeek-V3's sizes under forced tile configs
beside the heuristic's: kernel time (profiler, L2 flushed, median). A probe for what limits
the grouped GEMM on small groups.

    python bench/moe_gemm_configs.py           4096 tokens, contiguous layout (rows_used
                                               from the routing): raster group sizes;
                                               TFLOPS over the rows computed and the pairs
    python bench/moe_gemm_configs.py decode    64 tokens, masked layout (~225 experts of
                                               ~2 pairs): tile widths, rows covered, CTAs an
                                               SM; the weights' bytes against their copy
"""

import sys

import torch

import ptxforge
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import _common, moe
from ptxforge.testing.bench import Timer, copy_of, format_table

sys.path.insert(0, "bench")
from moe_kernels import problem  # noqa: E402

decode = sys.argv[1:] == ["decode"]
tokens, experts, inner, hidden, top_k = (64 if decode else 4096), 256, 2048, 7168, 8
layout = "masked" if decode else "contiguous"
x, idx, w, gate_up, down = problem("deepseek-v3", tokens)
r = ptxforge.moe_routing_layout(idx, experts, layout=layout,
                                rows_per_expert=tokens if decode else None)
lead = moe.grouped_rows(layout, tokens, top_k, experts)
a = ptxforge.moe_permute_quantize_fp8(x, r.rows, lead)
h = moe.grouped_quantized(lead, inner, "cuda")
h[0].view(torch.uint8).random_(0, 120)
h[1].fill_(1e-3)
d1 = torch.empty(*lead, 2 * inner, dtype=torch.bfloat16, device="cuda")
y = torch.empty(*lead, hidden, dtype=torch.bfloat16, device="cuda")
active, used = int((r.counts > 0).sum()), (0 if decode else int(r.rows_used))
expected = moe.expected_rows(tokens, top_k, experts)
arch = _common.device_arch(0)
timer = Timer()


def configs(n, k) -> dict:
    """label -> config (None: the heuristic's)."""
    found = {"heuristic": None}
    if decode:
        for block_n in (64, 96, 128, 160, 192, 256):
            for tile_rows, ctas in ((8, 2), (8, 1), (0, 1)):
                try:
                    found[f"64x{block_n} rows {tile_rows or 64} ctas {ctas}"] = gemm.make_config(
                        arch, n, k, 64, block_n, ctas, groups=experts, masked=True,
                        tile_rows=tile_rows)
                except ValueError:
                    pass
        return found
    base = gemm.choose_config(arch, lead[0], n, k, groups=experts)
    for raster in (1, 2, 4, 8, 16):
        found[f"heuristic, raster {raster}"] = gemm.make_config(
            arch, n, k, base.block_m, base.block_n, base.ctas_per_sm, base.multicast,
            base.part_buffers, groups=experts, producers=base.producers, raster=raster)
    return found


def call(lhs, b, d, cfg):
    if decode:
        return lambda: ptxforge.m_grouped_fp8_gemm_nt_masked(lhs, b, d, r.counts, expected,
                                                             config=cfg)
    return lambda: ptxforge.m_grouped_fp8_gemm_nt_contiguous(lhs, b, d, r.m_indices,
                                                             rows_used=r.rows_used, config=cfg)


rows = []
for name, lhs, b, d, n, k in (("gate_up", a, gate_up, d1, 2 * inner, hidden),
                              ("down", h, down, y, hidden, inner)):
    found = configs(n, k)
    times = timer.each([call(lhs, b, d, cfg) for cfg in found.values()])
    copy = timer(copy_of(active * n * k)) if decode else None
    for (label, cfg), t in zip(found.items(), times):
        row = [name, label, cfg.name if cfg else "-", f"{t * 1e3:.0f}"]
        if decode:
            row.append(f"{100 * copy / t:.0f}%")
        else:
            row += [f"{2 * n * k * used / t / 1e9:.0f}", f"{2 * n * k * tokens * top_k / t / 1e9:.0f}"]
        rows.append(row)
print(f"{torch.cuda.get_device_name()}: {tokens} tokens, {layout}, {active} experts active"
      + ("" if decode else f", rows computed {used} for {tokens * top_k} pairs"))
extra = ["copy of the weights / kernel"] if decode else ["TFLOPS (computed)", "TFLOPS (pairs)"]
print(format_table(["gemm", "config", "kernel", "us", *extra], rows))
