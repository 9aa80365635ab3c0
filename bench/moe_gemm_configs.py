"""The MoE op's gate_up and down GEMMs at DeepSeek-V3's sizes (with ``mixtral``:
Mixtral's) under forced tile configs beside the heuristic's: kernel time (profiler, L2
flushed, median). A probe for what limits the grouped GEMM on small groups.

    python bench/moe_gemm_configs.py [mixtral]
        4096 tokens (Mixtral 2048), contiguous layout (rows_used from the routing):
        clusters sharing B (share_b) by tile, raster group size and segment order (the
        routing's, or the experts of an even block count first); TFLOPS over the rows
        computed and over the pairs
    python bench/moe_gemm_configs.py [mixtral] decode
        64 tokens (Mixtral 16), masked layout: tile widths, rows covered, CTAs an SM; the
        weights' bytes against their copy
"""

import sys

import torch

import ptxforge
from ptxforge.bench import format_table
from ptxforge.bench.ops import Timer, copy_of
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.ops import common, moe

sys.path.insert(0, "bench")
from moe_kernels import SIZES, problem  # noqa: E402

decode = "decode" in sys.argv[1:]
model = "mixtral" if "mixtral" in sys.argv[1:] else "deepseek-v3"
hidden, inner, experts, top_k = SIZES[model]
tokens = {"deepseek-v3": 64 if decode else 4096, "mixtral": 16 if decode else 2048}[model]
layout = "masked" if decode else "contiguous"
x, idx, w, gate_up, down = problem(model, tokens)
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
arch = common.device_arch(0)
timer = Timer()


def paired_order(counts, rows: int):
    """m_indices with the segments of the experts holding an even number of 128-row blocks
    first: each then starts at an even block, so share_b's cluster pairs lie inside it."""
    blocks = [-(-c // 128) for c in counts]
    m_indices = []
    for e in sorted(range(len(counts)), key=lambda e: blocks[e] % 2):
        m_indices += [e] * counts[e] + [-1] * (blocks[e] * 128 - counts[e])
    m_indices += [-1] * (rows - len(m_indices))
    return torch.tensor(m_indices, dtype=torch.int32, device="cuda")


def configs(n, k) -> dict:
    """label -> (config (None: the heuristic's), m_indices)."""
    found = {"heuristic": (None, None if decode else r.m_indices)}
    if decode:
        for block_n in (64, 96, 128, 160, 192, 256):
            for tile_rows, ctas in ((8, 2), (8, 1), (0, 1)):
                try:
                    found[f"64x{block_n} rows {tile_rows or 64} ctas {ctas}"] = (gemm.make_config(
                        arch, GemmProblem(n, k, "e4m3", "masked", experts), 64, block_n, ctas,
                        tile_rows=tile_rows), None)
                except ValueError:
                    pass
        return found
    grouped = GemmProblem(n, k, "e4m3", "contiguous", experts)
    chosen = gemm.choose_config(arch, grouped, lead[0])
    if chosen.share_b:
        found["heuristic's tile sharing A, raster 16"] = (gemm.make_config(
            arch, grouped, 128, chosen.block_n, 1, 2, chosen.part_buffers), r.m_indices)
    paired = paired_order(r.counts.tolist(), lead[0])
    for block_n, parts in ((128, 2), (192, 1)):
        for raster in (1, 16):
            for order, m_indices in (("expert", r.m_indices), ("paired", paired)):
                try:
                    found[f"128x{block_n} p{parts} share_b raster {raster}, {order} order"] = (
                        gemm.make_config(arch, grouped, 128, block_n, 1, 2, parts, raster=raster,
                                         share_b=True), m_indices)
                except ValueError:
                    pass
    return found


def call(lhs, b, d, cfg, m_indices):
    if decode:
        return lambda: ptxforge.m_grouped_fp8_gemm_nt_masked(lhs, b, d, r.counts, expected,
                                                             config=cfg)
    return lambda: ptxforge.m_grouped_fp8_gemm_nt_contiguous(lhs, b, d, m_indices,
                                                             rows_used=r.rows_used, config=cfg)


rows = []
for name, lhs, b, d, n, k in (("gate_up", a, gate_up, d1, 2 * inner, hidden),
                              ("down", h, down, y, hidden, inner)):
    found = configs(n, k)
    times = timer.each([call(lhs, b, d, *found[label]) for label in found])
    copy = timer(copy_of(active * n * k)) if decode else None
    for (label, (cfg, _)), t in zip(found.items(), times):
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
