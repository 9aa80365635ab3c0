"""The Hopper GEMM: D[M, N] = A[M, K] . B[N, K]^T, in FP8 with DeepGEMM's fine-grained
scaling or in BF16, dense or MoE grouped, persistent and warp-specialized.

FP8: A is e4m3 with one f32 scale per row per 128 columns of K (1x128, "1d"); B is e4m3
with one f32 scale per 128x128 block ("2d"). Each 128-wide K block is multiplied on the
tensor cores into its own f32 registers and then folded into the accumulators with
``sa[row] * sb[block]`` on the CUDA cores (promotion.py): the fp8 products never
accumulate across scale blocks inside the tensor core. BF16: no scales; K blocks of 64
accumulate straight into the accumulators, one wgmma group in flight.

Warp roles (persistent CTAs walk the output tiles of block_m x block_n, scheduler.py):

    warpgroup 0     producer  lane 0 of 1, 2 or 4 warps streams A, B and sa tiles with TMA
                              into the stage ring, the warps taking turns over K blocks
                              (registers lowered to 40 with setmaxnreg)
    warpgroups 1..  math      64 rows each: 4 x wgmma m64nNk32 (k16 in bf16) per K block,
                              wait, promote; then the epilogue (epilogue.py)
                              (registers raised to what the residency leaves)

Tiles are block_m (64 or 128: one math warpgroup per 64 rows) x block_n (16..256 in steps
of 8); tile_model.py picks the shape by a model of waves x clocks per K block fitted to
measurements. From M = 512 on, two CTAs of a cluster may share the A tile of neighbouring
tiles along N: each loads half of it with a TMA multicast into both; for a contiguous MoE
layout of small groups, the pair lies along M and shares B instead (``share_b``). A few
tokens (M <= 32) may get a 64-row tile covering only 8, 16 or 32 rows (``tile_rows``:
smaller A stages, more of them, more weight bytes in flight).

Pipeline, per K block kb (stage = kb % stages, phase flips each wrap; patterns/pipeline.py):

    producer:  wait empty[stage] -> expect_tx(full[stage]) -> TMA A (or its half, multicast),
               B, sa -> full[stage]; cp.async sb (the K block's B scales) -> arrive on
               full[stage] when landed
    math:      issue: wait full[stage] -> wgmma x4 into a part buffer (two K blocks in flight
               where the registers hold two) ; retire: read sa, sb from the stage -> wait ->
               one lane per warp arrives on empty[stage] of every CTA of the cluster ->
               promote

Shared memory (config.py's plan; A, B and D regions 1024-byte aligned for the 128-byte
swizzle):

    | A stages: S x rows x 128 B | B stages: S x block_n x 128 B | D tile: block_m x block_n x 2 (4) B |
    | sa stages: S x rows x 4 B (at least 128) | sb stages: S x 16 B |
    | full barriers: S x 8 B | empty barriers: S x 8 B |

(rows: block_m, or tile_rows.)

Scales: sa comes by TMA from the MN-major TMA-aligned [M, ceil(K/128)] tensor the
quantizer writes; sb (a few KB) is read by the math threads from global memory.

Compile-time: N, K, the tile, stages, the layout and the epilogue. Run-time: M (one kernel
serves every M), the tensors' addresses and strides (in the tensor maps).

What is computed comes in one value, the problem (``kernels/gemm.py``): N, K, the dtype,
the layout (dense; MoE contiguous: B holds ``groups`` matrices and each tile of A takes
its group from m_indices; MoE masked: A and D [groups, M_max, ...] through 3-D tensor
maps, each group's valid rows in masked_m on the GPU) and the epilogue's terms, each
computed by the epilogue class registered for them (epilogue.py: bf16 store, f32
reduce-add into D, the contiguous layout's zeroing of other groups' rows, bias, residual,
scale).

This package is a GEMM generation: what ``kernels.gemm_generation(arch)`` returns for a
target whose description names it, with ``choose_config(arch, problem, m, sms)``,
``generate(cfg)``, ``require_problem(arch, problem)``, ``token_counts(limit)`` and
``GemmConfig``.
"""

from .config import GemmConfig, block_n_candidates, make_config, require_problem
from .epilogue import Epilogue, epilogue_for
from .kernel import generate
from .promotion import MAX_PROMOTION_VARIANTS
from .tile_model import choose_config, estimate_clocks, token_counts

__all__ = ["Epilogue", "GemmConfig", "MAX_PROMOTION_VARIANTS", "block_n_candidates",
           "choose_config", "epilogue_for", "estimate_clocks", "generate", "make_config",
           "require_problem", "token_counts"]
