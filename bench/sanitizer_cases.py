"""Every kernel family once, small, through the ops' launch path, for compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no python bench/sanitizer_cases.py
    (and --tool synccheck, --tool racecheck)

(cuda-bindings probes the driver with cuGetProcAddress calls that return INVALID_VALUE:
API errors are not reported.) The row kernels (RMSNorm, the two FP8 quantizations, their
fusion, SwiGLU + quantization on the halves of one tensor, rows not filling the last
CTA); the GEMM's epilogues (bf16 store, f32 reduce-add, bias, residual: separate and in
place) and dense tile variants (producer warps, CTAs per SM, multicast, few-token tiles); the
contiguous layout with m_indices past the group count, negative and mis-aligned; the
masked layout with counts past M_max and negative. Prints one line per call; sanitizer
findings follow its own format.
"""

import torch

import ptxforge
from ptxforge.bench.ops import masked_operands
from ptxforge.testing.checks import fp8_gemm_operands
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.ops import common

arch = common.device_arch(0)

x = torch.randn(333, 7168, device="cuda").bfloat16()
weight = torch.randn(7168, device="cuda").bfloat16()
ptxforge.rms_norm(x, weight)
ptxforge.quantize_fp8_per_token(x)
ptxforge.rms_norm_quantize_fp8(x, weight)
ptxforge.silu_mul_quantize_fp8(*x.chunk(2, dim=-1))
ptxforge.quantize_fp8_per_block(x[:, :1000])
torch.cuda.synchronize()
print("ran the row kernels and the block quantization", flush=True)


def forced(cfg, call):
    call(cfg)
    torch.cuda.synchronize()
    print("ran", cfg.name, flush=True)


m, n, k = 200, 1000, 640
a, b, _ = fp8_gemm_operands(m, n, k)
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
for block_m, block_n, ctas, warps in ((64, 16, 1, 4), (64, 32, 2, 2), (128, 128, 1, 1)):
    cfg = gemm.make_config(arch, GemmProblem(n, k), block_m, block_n, ctas, producers=warps)
    forced(cfg, lambda cfg: ptxforge.fp8_gemm_nt(a, b, d, config=cfg))
cfg = gemm.make_config(arch, GemmProblem(n, k, epilogue=("accumulate",)), 128, 40, multicast=1)
c = torch.randn(m, n, device="cuda")
forced(cfg, lambda cfg: ptxforge.fp8_gemm_nt(a, b, c, c=c, config=cfg))
bias = torch.randn(n, device="cuda").bfloat16()
for block_m, block_n in ((64, 24), (128, 160)):
    cfg = gemm.make_config(arch, GemmProblem(n, k, epilogue=("bias",)), block_m, block_n)
    forced(cfg, lambda cfg: ptxforge.fp8_gemm_nt(a, b, d, bias=bias, config=cfg))
residual = torch.randn(m, n, device="cuda").bfloat16()
for block_m, block_n, rows, tokens in ((64, 24, 0, m), (128, 160, 0, m), (64, 24, 8, 5)):
    # the residual's reads: none past M, N or the tile's rows; d itself, in place
    cfg = gemm.make_config(arch, GemmProblem(n, k, epilogue=("bias", "residual")), block_m,
                           block_n, tile_rows=rows)
    forced(cfg, lambda cfg: ptxforge.fp8_gemm_nt(a, b, d, bias=bias, residual=residual,
                                                 config=cfg))
    few_a, few_b, _ = fp8_gemm_operands(tokens, n, k)
    in_place = residual[:tokens].clone()
    forced(cfg, lambda cfg: ptxforge.fp8_gemm_nt(few_a, few_b, in_place, bias=bias,
                                                 residual=in_place, config=cfg))
for rows, tokens in ((8, 5), (32, 20)):  # few-token tiles: rows past them read, never stored
    few_a, few_b, _ = fp8_gemm_operands(tokens, n, k)
    few_d = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    cfg = gemm.make_config(arch, GemmProblem(n, k), 64, 24, tile_rows=rows)
    forced(cfg, lambda cfg: ptxforge.fp8_gemm_nt(few_a, few_b, few_d, config=cfg))
big_a, big_b, _ = fp8_gemm_operands(1024, 1024, 512)
big_d = torch.empty(1024, 1024, device="cuda", dtype=torch.bfloat16)
cfg = gemm.make_config(arch, GemmProblem(1024, 512), 128, 128, multicast=2)
forced(cfg, lambda cfg: ptxforge.fp8_gemm_nt(big_a, big_b, big_d, config=cfg))
a16, b16 = torch.randn(m, k, device="cuda").bfloat16(), torch.randn(n, k, device="cuda").bfloat16()
cfg = gemm.make_config(arch, GemmProblem(n, k, "bf16"), 64, 24, 2, producers=4)
forced(cfg, lambda cfg: ptxforge.bf16_gemm_nt(a16, b16, d, config=cfg))

groups, rows = 3, 512
indices = torch.tensor([5] * 128 + [-1] * 128 + [1] * 100 + [2] * 28 + [-7] * 128,
                       dtype=torch.int32, device="cuda")          # out of range, mis-aligned
qa, sa = ptxforge.quantize_fp8_per_token(torch.randn(rows, k, device="cuda").bfloat16())
qb = torch.randn(groups, n, k, device="cuda").to(torch.float8_e4m3fn)
sb = torch.rand(groups, -(-n // 128), k // 128, device="cuda")
d = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
ptxforge.m_grouped_fp8_gemm_nt_contiguous((qa, sa), (qb, sb), d, indices)
ptxforge.m_grouped_bf16_gemm_nt_contiguous(torch.randn(rows, k, device="cuda").bfloat16(),
                                           torch.randn(groups, n, k, device="cuda").bfloat16(),
                                           d, indices)
torch.cuda.synchronize()
print("ran contiguous fp8 and bf16 with bad m_indices", flush=True)

m_max = 192
a3, b3, masked_m, _ = masked_operands([500, -3, 100], m_max, n, k)  # past M_max, negative
d3 = torch.empty(groups, m_max, n, device="cuda", dtype=torch.bfloat16)
ptxforge.m_grouped_fp8_gemm_nt_masked(a3, b3, d3, masked_m, 128)
ptxforge.m_grouped_bf16_gemm_nt_masked(torch.randn(groups, m_max, k, device="cuda").bfloat16(),
                                       torch.randn(groups, n, k, device="cuda").bfloat16(),
                                       d3, masked_m, 128)
cfg = gemm.make_config(arch, GemmProblem(n, k, "e4m3", "masked", groups), 64, 24, tile_rows=8)
forced(cfg, lambda cfg: ptxforge.m_grouped_fp8_gemm_nt_masked(a3, b3, d3, masked_m, 8,
                                                              config=cfg))
torch.cuda.synchronize()
print("ran masked fp8 and bf16 with counts past M_max and negative", flush=True)

# MoE: the routing layout (indices out of range, one expert taking most pairs), the
# permutation and SwiGLU row maps, the contiguous GEMM stopping at rows_used, the combine
# skipping dropped pairs; both layouts through moe_experts_fp8.
from ptxforge.ops import moe  # noqa: E402

tokens, top_k, experts, hidden, inner = 150, 4, 16, 1024, 512
topk_idx = torch.randint(0, experts, (tokens, top_k), device="cuda")
topk_idx[:, 0] = 3
topk_idx[7, 1], topk_idx[9, 2] = -1, experts
topk_w = torch.rand(tokens, top_k, device="cuda")
moe_x = torch.randn(tokens, hidden, device="cuda").bfloat16()
w13 = ptxforge.quantize_fp8_per_block(torch.randn(experts * 2 * inner, hidden, device="cuda").bfloat16())
w2 = ptxforge.quantize_fp8_per_block(torch.randn(experts * hidden, inner, device="cuda").bfloat16())
w13 = (w13[0].view(experts, 2 * inner, hidden), w13[1].view(experts, -1, w13[1].shape[1]))
w2 = (w2[0].view(experts, hidden, inner), w2[1].view(experts, -1, w2[1].shape[1]))
for layout in moe.LAYOUTS:
    moe.moe_experts_fp8(moe_x, topk_idx, topk_w, w13, w2, layout=layout)
    torch.cuda.synchronize()
    print("ran the MoE experts,", layout, "layout", flush=True)
# The permutation's scale gather where its runs of 8 groups do not divide the groups:
# fewer than 8 (512 columns: 4) and a ragged last run (2112: 17).
for width in (512, 2112):
    for layout in moe.LAYOUTS:
        r = ptxforge.moe_routing_layout(topk_idx, experts, layout=layout,
                                        rows_per_expert=tokens if layout == "masked" else None)
        ptxforge.moe_permute_quantize_fp8(torch.randn(tokens, width, device="cuda").bfloat16(),
                                          r.rows, moe.grouped_rows(layout, tokens, top_k, experts))
torch.cuda.synchronize()
print("ran the MoE permutation at 512 and 2112 columns", flush=True)
