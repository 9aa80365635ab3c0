"""The GEMM's tile choice: a model of the clocks each config takes, and the config it
finishes first. Kept apart from the kernel, as DeepGEMM keeps its heuristics apart from
its kernels: the generator emits any config it is given, the model only ranks them."""

from __future__ import annotations

import functools

from ...arch import Arch
from ..gemm import GemmProblem
from .config import GemmConfig, ROW_BYTES, require_problem, block_n_candidates, make_config

# Fitted to `bench/gemm_sweep.py` on an H200 (docs/performance.md).
# A K block of one tile costs the longest of: one math warpgroup's dependent chain (wait
# for the stage, wgmma, wait, promote: what bounds the small tiles); the MMA plus the
# promotion of every math warpgroup (measured, the tensor cores idle while the warpgroups
# promote; two part buffers hide it), with a fixed cost per wgmma instruction (what makes
# narrow tiles slow in bf16, where nothing else hides it); the tile's operand bytes at what
# one SM takes in from L2; and the shared-memory bytes the stage's TMA writes and the
# wgmma reads (why 64-row tiles lose at large M: each reads all of B per 64 rows). A tile
# straddling two B-scale rows pays for its scale choice; each tile adds the pipeline fill
# and the epilogue. CTAs sharing an SM share its throughputs but run their chains side by
# side. Fitted to the FP8, BF16, masked and contiguous sweeps together (46 problems, two
# producer warps): the model's choice is on average within 1.1% of the best measured tile,
# at worst 9% (fp8 128x32768x512). The SM's throughputs (tensor-core flops, L2 and shared
# memory bytes per clock) come from the arch file; the costs below are this kernel's.
CHAIN_CLOCKS = 150
PROMOTE_CLOCKS_PER_COLUMN = 0.1    # per math warpgroup
WGMMA_CLOCKS = 30                  # per wgmma instruction of a math warpgroup
STRADDLE_CLOCKS = 100
TILE_CLOCKS = 3000


def tile_clocks(arch: Arch, cfg: GemmConfig) -> float:
    """The model's clocks for one tile of ``cfg`` (its K loop and its fixed costs)."""
    throughput = arch.throughput
    # A K block is one 128-byte row of A and B: the same MMA clocks in e4m3 (K = 128) and
    # bf16 (K = 64 at half the rate); only e4m3 promotes.
    mma = (cfg.block_m * cfg.block_n * cfg.k_per_block * 2
           / throughput["mma_flops_per_clock"][cfg.dtype]
           + WGMMA_CLOCKS * cfg.k_per_block // arch.mma["k"][cfg.dtype] * cfg.math_warpgroups)
    # With two part buffers the promotion overlaps the next K block's wgmma.
    promote = (PROMOTE_CLOCKS_PER_COLUMN * cfg.block_n * cfg.math_warpgroups
               * (cfg.scaled and cfg.part_buffers == 1))
    load = (cfg.a_box_rows + cfg.block_n) * ROW_BYTES / throughput["l2_bytes_per_clock"]
    # Shared memory: the stage lands once (A and B rows) and each math warpgroup's wgmma
    # reads its 64 rows of A and all of B.
    smem = ((cfg.rows + cfg.block_n + cfg.math_warpgroups * (64 + cfg.block_n)) * ROW_BYTES
            / throughput["shared_bytes_per_clock"])
    shared = cfg.ctas_per_sm
    k_block = (max(CHAIN_CLOCKS, shared * (mma + promote), shared * load, shared * smem)
               + STRADDLE_CLOCKS * cfg.straddles)
    return cfg.k_blocks * k_block + TILE_CLOCKS


def estimate_clocks(arch: Arch, cfg: GemmConfig, m: int, sms: int, groups: int = 1) -> float:
    """The model's clocks for the whole problem on ``sms`` SMs: waves of tiles. ``groups``
    > 1: the masked layout, ``m`` rows in each of that many groups (a tile covers one
    group's rows)."""
    return _waves(cfg, m, sms, groups) * tile_clocks(arch, cfg)


def _waves(cfg: GemmConfig, m: int, sms: int, groups: int) -> int:
    tiles = groups * -(-m // cfg.rows) * cfg.n_tiles
    return -(-tiles // (sms * cfg.ctas_per_sm))


MULTICAST_MIN_M = 512  # below, the tiles of a block row are too few to pair up


@functools.lru_cache(maxsize=None)
def _candidates(arch: Arch, problem: GemmProblem, block_ms: tuple, multicasts: tuple) -> tuple:
    """(config, clocks a tile) for every tile that fits the problem, in the order the ties
    go: what does not depend on M, worked out once per problem."""
    found = []
    for block_m in block_ms:
        # Two CTAs an SM: two K-loop chains overlap (what small tiles are bound by).
        for ctas_per_sm in (1, 2) if block_m == 64 else (1,):
            for block_n in block_n_candidates(arch, scaled=problem.scaled):
                for multicast in multicasts:
                    try:
                        cfg = make_config(arch, problem, block_m, block_n, ctas_per_sm, multicast)
                    except ValueError:
                        continue
                    found.append((cfg, tile_clocks(arch, cfg)))
    return tuple(found)


def choose_config(arch: Arch, problem: GemmProblem, m: int, sms: int | None = None) -> GemmConfig:
    """The config the model above finishes first for ``m`` rows (the masked layout: all
    groups' expected rows) on ``sms`` SMs (the device's by default); ties go to no
    multicast (measured as often 1-3% faster as slower, and simpler), then to the smaller
    tile. A few tokens may then get it covering only their rows (``few_token_tile``)."""
    require_problem(arch, problem)
    sms = sms or arch.sm_count
    # The masked layout's m is all groups' rows; a tile covers one group's.
    group_rows, tile_groups = (m // problem.groups, problem.groups) if problem.masked else (m, 1)
    multicasts = (1, 2) if m >= MULTICAST_MIN_M and sms % 2 == 0 else (1,)
    block_ms = (64,) if group_rows <= 64 else (64, 128)
    best = None
    for cfg, clocks in _candidates(arch, problem, block_ms, multicasts):
        estimate = (_waves(cfg, group_rows, sms, tile_groups) * clocks, cfg.multicast,
                    cfg.ctas_per_sm)
        if best is None or estimate < best[0]:
            best = (estimate, cfg)
    if best is None:
        raise ValueError(f"no GEMM tile fits {problem} on {arch.target}")
    return few_token_tile(arch, clusters_sharing_b(arch, best[1], m), group_rows)


def token_counts(limit: int) -> list[int]:
    """One M for each answer ``choose_config`` can give a dense GEMM for 1..limit rows: it
    sees M only through the 64- and 128-row tile counts, whether M reaches
    MULTICAST_MIN_M, and the few-token rows (what precompiling for every M needs)."""
    seen, counts = set(), []
    for m in range(1, limit + 1):
        key = (-(-m // 64), -(-m // 128), m >= MULTICAST_MIN_M,
               next((r for r in FEW_TOKEN_ROWS if m <= r), 0))
        if key not in seen:
            seen.add(key)
            counts.append(m)
    return counts


# Rows a group (of the contiguous layout's M) holds at most, on average, for its clusters
# to share B: see clusters_sharing_b.
SHARE_B_MAX_GROUP_ROWS = 256


def clusters_sharing_b(arch: Arch, cfg: GemmConfig, m: int) -> GemmConfig:
    """``cfg``, or for a contiguous layout of small groups (two 128-row blocks or fewer on
    average) whose tile is a 128-row cluster sharing A (neighbours along N), the same tile
    with the clusters along M sharing B, walked one block-row pair at a time (raster 1).
    Separate CTAs on a group's block rows drift apart tile after tile until the second
    one's read of the weights misses L2: DeepSeek-V3's gate_up at 4096 tokens (256 experts
    of ~1.5 block rows) read 11.6 GB from DRAM for 7.5 GB of weights (ncu); a cluster's two
    CTAs run in lockstep. Measured on an H200 (bench/moe_gemm_configs.py): 3100-3200 us ->
    2855-2882. Larger groups lost 3% (4 x 8192 rows, 4096 x 7168: 1290 -> 1253 TFLOPS) or
    nothing measurable (Mixtral's down, ~640 rows a group)."""
    if (cfg.problem.layout != "contiguous" or cfg.multicast == 1 or cfg.block_m != 128
            or m > SHARE_B_MAX_GROUP_ROWS * cfg.groups):
        return cfg
    return make_config(arch, cfg.problem, cfg.block_m, cfg.block_n, cfg.ctas_per_sm,
                       cfg.multicast, cfg.part_buffers, producers=cfg.producers, raster=1,
                       share_b=True)


# A few tokens' GEMM streams weights: what bounds it is the weight bytes in flight per SM
# and how many producer chains issue them, which the model above does not see. Measured
# on an H200 (bench/decode_tiles.py), the chosen tile covering only the tokens' rows (more,
# smaller stages) gained up to 1.8x of the same-size copy's speed where the tile held less
# than this many B bytes in flight per SM, and lost up to 7% where it held more (fp8
# 24576x1536, 64 x 192 tiles); two such CTAs an SM then gained another 3-21% on 23 of 24
# decode rows (one level) over one CTA with twice the stages.
FEW_TOKEN_FLIGHT_BYTES = 128 << 10
FEW_TOKEN_ROWS = (8, 16, 32)


def few_token_tile(arch: Arch, cfg: GemmConfig, m: int) -> GemmConfig:
    """``cfg``, or for at most 32 rows (a group's, masked) of a dense or masked GEMM whose
    64-row tile keeps too few weight bytes in flight, the same tile covering only the
    smallest of 8, 16 or 32 rows that holds them, two CTAs an SM."""
    rows = next((r for r in FEW_TOKEN_ROWS if m <= r), 0)
    flight = cfg.stages * cfg.b_stage_bytes * cfg.ctas_per_sm
    if (not rows or cfg.block_m != 64 or cfg.multicast > 1
            or cfg.problem.layout == "contiguous" or flight >= FEW_TOKEN_FLIGHT_BYTES):
        return cfg
    for ctas_per_sm in (2, cfg.ctas_per_sm):  # two CTAs an SM where their registers fit
        try:
            return make_config(arch, cfg.problem, 64, cfg.block_n, ctas_per_sm,
                               producers=cfg.producers, tile_rows=rows)
        except ValueError:
            continue
    return cfg
