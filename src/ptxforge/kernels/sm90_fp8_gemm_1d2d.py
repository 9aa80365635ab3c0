"""FP8 GEMM with DeepGEMM's fine-grained scaling on Hopper: D[M, N] (bf16) = A[M, K] . B[N, K]^T.

A is e4m3 with one f32 scale per row per 128 columns of K (1x128, "1d"); B is e4m3 with one
f32 scale per 128x128 block ("2d"). Each 128-wide K block is multiplied on the tensor
cores into its own f32 registers and then folded into the accumulators with
``sa[row] * sb[block]`` on the CUDA cores ("promotion"): the fp8 products never
accumulate across scale blocks inside the tensor core.

Warp roles (persistent CTAs walk the output tiles of block_m x block_n):

    warpgroup 0     producer  thread 0 streams A, B and sa tiles with TMA into the stage ring
                              (registers lowered to 40 with setmaxnreg)
    warpgroups 1..  math      64 rows each: 4 x wgmma m64nNk32 per K block, wait, promote
                              (registers raised to what the residency leaves)

Tiles are block_m (64 or 128: one math warpgroup per 64 rows) x block_n (16..256 in steps
of 8); choose_config picks the shape by a model of waves x clocks per K block fitted to
measurements (bench/gemm_sweep.py). From M = 512 on, two CTAs of a cluster may share the A
tile of neighbouring tiles along N: each loads half of it with a TMA multicast into both.

Pipeline, per K block kb (stage = kb % stages, phase flips each wrap):

    producer:  wait empty[stage] -> expect_tx(full[stage]) -> TMA A (or its half, multicast),
               B, sa -> full[stage]
    math:      issue: wait full[stage] -> wgmma x4 into a part buffer (two K blocks in flight
               where the registers hold two) ; retire: read sa, sb -> wait -> one lane per
               warp arrives on empty[stage] of every CTA of the cluster -> promote

Shared memory (A, B and D regions 1024-byte aligned for the 128-byte swizzle):

    | A stages: S x block_m x 128 B | B stages: S x block_n x 128 B | D tile: block_m x block_n x 2 B |
    | sa stages: S x block_m x 4 B | full barriers: S x 8 B | empty barriers: S x 8 B |

Scales: sa comes by TMA from the MN-major TMA-aligned [M, ceil(K/128)] tensor the
quantizer writes; sb (a few KB) is read by the math threads from global memory.

Tiles are visited in groups of RASTER_GROUP block rows (all of a group's tiles in one
block column before the next column), so the tiles running at once share A rows and B
columns in L2. The producer runs ahead into the next tile while the math warpgroups
finish the current one.

Epilogue, per math warpgroup: wait until its previous TMA store has read the D tile,
write the bf16 accumulators into it (64-column halves, 128-byte swizzle: conflict-free),
fence, then one thread issues the TMA stores, which clip at the matrix edges and run
while the warpgroup starts its next tile.

Compile-time: N, K, BLOCK_N, stages. Run-time: M (one kernel serves every M).

The same generator gives (see Fp8GemmConfig): ``accumulate`` (D f32, each tile added into
it by a TMA reduction: d = c + a.b^T); ``groups`` (MoE: B holds that many matrices; each
tile of A takes its group from m_indices, contiguous layout) and ``masked`` (A and D
[groups, M_max, ...] through 3-D tensor maps, each group's valid rows in masked_m on the
GPU); ``dtype`` bf16 (no scales, no promotion: K blocks of 64 accumulate straight into the
accumulators with one wgmma group in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from ..arch import Arch
from ..patterns.pipeline import BARRIER_BYTES, next_stage, wait_parity
from ..ptx import KernelBuilder, LaunchShape, TensorMap, addr, sreg, vec

BLOCK_K = 128            # one scale group of A and B per K block (e4m3)
ROW_BYTES = 128          # a stage row of A or B: K = 128 e4m3 or 64 bf16 (one swizzle row)
PRODUCER_REGISTERS = 40
SWIZZLE_ATOM = 1024      # 8 rows x 128 bytes: the 128-byte swizzle repeats every 1024 bytes
RASTER_GROUP = 16        # block rows per raster group: 16 A rows + ~8 B columns stay in L2


@dataclass(frozen=True)
class Fp8GemmConfig:
    n: int
    k: int
    block_m: int           # 64 or 128: one math warpgroup per 64 rows
    block_n: int           # a multiple of 8 (wgmma's n step), see block_n_candidates
    stages: int
    ctas_per_sm: int
    math_registers: int
    target: str
    multicast: int = 1     # CTAs of a cluster sharing each A tile (neighbours along N)
    part_buffers: int = 1  # 2: a K block's wgmma runs while the one before it promotes
    accumulate: bool = False  # D is f32 and the tile is added into it (d = c + a.b^T)
    groups: int = 0        # > 0: MoE, B holds `groups` matrices; contiguous layout: each row
                           # of A names its group in m_indices (see _tile_group)
    masked: bool = False   # MoE, masked layout: A and D [groups, M_max, ...], the valid rows
                           # of each group in masked_m (read on the GPU)
    dtype: str = "e4m3"    # of A and B: e4m3 with DeepGEMM's scales, or bf16 (no scales)
    producers: int = 2     # producer warps, taking turns over the K blocks (see _producer)

    @property
    def name(self) -> str:
        kind = "fp8_gemm_1d2d" if self.scaled else "bf16_gemm"
        return (f"sm90_{kind}_n{self.n}_k{self.k}_bm{self.block_m}_bn{self.block_n}"
                f"_s{self.stages}_c{self.ctas_per_sm}_mc{self.multicast}_p{self.part_buffers}"
                + ("_acc" if self.accumulate else "")
                + (f"_g{self.groups}" if self.groups else "") + ("m" if self.masked else "")
                + (f"_w{self.producers}" if self.producers > 1 else ""))

    @property
    def math_warpgroups(self) -> int:
        return self.block_m // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.math_warpgroups)

    @property
    def scaled(self) -> bool:
        """e4m3 operands with 1x128 / 128x128 scales, promoted per K block."""
        return self.dtype == "e4m3"

    @property
    def k_per_block(self) -> int:
        """K of one stage: a 128-byte row of A and B."""
        return ROW_BYTES // (1 if self.scaled else 2)

    @property
    def k_blocks(self) -> int:
        return -(-self.k // self.k_per_block)

    @property
    def n_tiles(self) -> int:
        return -(-self.n // self.block_n)

    @property
    def straddles(self) -> bool:
        """Whether a tile can cover two 128-column blocks of B scales (block_n does not
        divide 128); block_n_candidates keeps it to at most two."""
        return self.scaled and BLOCK_K % self.block_n != 0

    @property
    def scale_row_splits(self) -> tuple[int, ...]:
        """The counts of a tile's 8-column groups in its first B-scale row, over all tile
        starts (a tile not straddling has all its groups there)."""
        groups = self.block_n // 8
        return tuple(sorted({min((BLOCK_K - j * self.block_n % BLOCK_K) // 8, groups)
                             for j in range(BLOCK_K)}))

    @property
    def d_element_bytes(self) -> int:
        """bf16 D, or f32 when the tile is added into it."""
        return 4 if self.accumulate else 2

    @property
    def d_box_cols(self) -> int:
        """Columns of one TMA store box: the widest whose rows are 128, 64, 32 or 16 bytes and
        that divides block_n."""
        return next(c for c in (row // self.d_element_bytes for row in (128, 64, 32, 16))
                    if self.block_n % c == 0)

    @property
    def d_swizzle(self) -> int:
        """The store boxes' swizzle: the box row's bytes; 16-byte rows need none."""
        row = self.d_element_bytes * self.d_box_cols
        return row if row >= 32 else 0

    @property
    def a_box_rows(self) -> int:
        """Rows of A one CTA loads per stage (and multicasts to the cluster)."""
        return self.block_m // self.multicast

    @property
    def a_stage_bytes(self) -> int:
        return self.block_m * ROW_BYTES

    @property
    def b_stage_bytes(self) -> int:
        return self.block_n * ROW_BYTES

    @property
    def sa_stage_bytes(self) -> int:
        return self.block_m * 4 if self.scaled else 0

    @property
    def b_offset(self) -> int:
        return self.stages * self.a_stage_bytes

    @property
    def d_offset(self) -> int:
        return self.b_offset + self.stages * self.b_stage_bytes

    @property
    def d_bytes(self) -> int:
        return self.block_m * self.block_n * self.d_element_bytes

    @property
    def sa_offset(self) -> int:
        return self.d_offset + self.d_bytes

    @property
    def full_offset(self) -> int:
        return self.sa_offset + self.stages * self.sa_stage_bytes

    @property
    def empty_offset(self) -> int:
        return self.full_offset + self.stages * BARRIER_BYTES

    @property
    def dynamic_shared_bytes(self) -> int:
        # + SWIZZLE_ATOM: the kernel rounds the dynamic base up to a swizzle atom.
        return self.empty_offset + self.stages * BARRIER_BYTES + SWIZZLE_ATOM

    @property
    def tensor_maps(self) -> dict[str, TensorMap]:
        """The TMA descriptors the kernel reads and writes, by parameter name: A and B in
        128-byte swizzled rows, sa one column of block_m scales, D in store boxes of 64
        rows. The masked layout's group is a third dimension, one group per box."""
        element = "float8_e4m3fn" if self.scaled else "bfloat16"
        group = (1,) if self.masked else ()
        maps = {"tmap_a": TensorMap(element, (self.k_per_block, self.a_box_rows) + group,
                                    swizzle=ROW_BYTES),
                "tmap_b": TensorMap(element, (self.k_per_block, self.block_n), swizzle=ROW_BYTES)}
        if self.scaled:
            maps["tmap_sa"] = TensorMap("float32", (self.block_m, 1) + group)
        maps["tmap_d"] = TensorMap("float32" if self.accumulate else "bfloat16",
                                   (self.d_box_cols, 64) + group, swizzle=self.d_swizzle)
        return maps

    @property
    def launch(self) -> LaunchShape:
        return LaunchShape(block=self.threads, shared_bytes=self.dynamic_shared_bytes,
                           cluster=self.multicast)

    @property
    def tx_bytes(self) -> int:
        """Bytes the TMA copies of one stage deliver: the loads' boxes (full, even at the
        edges), A's from every CTA of the cluster."""
        maps = self.tensor_maps
        return (self.multicast * maps["tmap_a"].box_bytes + maps["tmap_b"].box_bytes
                + (maps["tmap_sa"].box_bytes if self.scaled else 0))


MAX_STAGES = 16
# A straddling tile width with at most this many scale-row splits gets a promotion per split.
MAX_PROMOTION_VARIANTS = 4
# Registers a math thread needs besides the accumulators (acc and part: block_n of them).
# 40 is what ptxas needs: every tile it admits assembles without spills (tests/cpu), among
# them 128 x 192 with one part buffer and 128 x 128 with two (232 registers).
MATH_REGISTERS_BESIDES_ACCUMULATORS = 40


def block_n_candidates(arch: Arch, max_block_n: int = 256, scaled: bool = True) -> tuple[int, ...]:
    """Tile widths: wgmma's n steps (multiples of 8) from 16 up; with ``scaled`` (e4m3) only
    those whose tiles, starting at any multiple of the width, cover at most two 128-column
    blocks of B scales."""
    mma = arch.mma
    return tuple(bn for bn in range(max(16, mma["n_min"]), min(mma["n_max"], max_block_n) + 1,
                                    mma["n_step"])
                 if not scaled or bn <= BLOCK_K + math.gcd(bn, BLOCK_K))


def _require_problem(arch: Arch, n: int, k: int) -> None:
    arch.require("wgmma", "the FP8 GEMM")
    arch.require("tma", "the FP8 GEMM")
    if n <= 0 or n % 8 or k <= 0 or k % 16:
        raise ValueError(f"the FP8 GEMM needs N a positive multiple of 8 and K of 16 "
                         f"(16-byte rows), got N={n}, K={k}")


def make_config(arch: Arch, n: int, k: int, block_m: int, block_n: int,
                ctas_per_sm: int = 1, multicast: int = 1,
                part_buffers: int | None = None, accumulate: bool = False,
                groups: int = 0, masked: bool = False, dtype: str = "e4m3",
                producers: int = 2) -> Fp8GemmConfig:
    """A config for one tile shape: as many stages as the CTA's share of shared memory
    holds, and the math registers that residency leaves. ``multicast`` 2: clusters of two
    CTAs on neighbouring tiles of one block row, each loading half of the shared A tile.
    ``part_buffers``: 1 or 2 registers sets a K block's wgmma accumulates into (2 overlap
    a K block's promotion with the next one's wgmma); by default 2 where they fit.
    ``accumulate``: D is f32 and each tile is added into it by a TMA reduction (the f32 D
    tile takes shared memory from the stages). ``groups`` > 0: MoE, B holding that many
    [N, K] matrices, in the contiguous layout or with ``masked`` the masked one (neither
    with ``accumulate``). ``dtype`` "bf16": bf16 A and B, no scales, K blocks of 64.
    ``producers``: warps issuing the loads (1, 2 or 4), each every producers-th K block."""
    _require_problem(arch, n, k)
    widths = block_n_candidates(arch, scaled=dtype == "e4m3")
    if block_m not in (64, 128) or block_n not in widths:
        raise ValueError(f"no {dtype} GEMM tile {block_m} x {block_n}: block_m is 64 or 128, "
                         f"block_n one of {widths}")
    if multicast not in (1, 2) or -(-n // block_n) % multicast:
        raise ValueError(f"multicast {multicast} needs 1 or 2 and a tile count along N "
                         f"({-(-n // block_n)}) it divides")
    if multicast > 1:
        arch.require("clusters", "the FP8 GEMM's TMA multicast")
    if producers not in (1, 2, 4):
        raise ValueError(f"producers must be 1, 2 or 4 warps, got {producers}")
    if dtype not in ("e4m3", "bf16"):
        raise ValueError(f"dtype must be e4m3 or bf16, got {dtype!r}")
    if groups < 0 or (groups and accumulate) or (masked and not groups):
        raise ValueError(f"groups must be >= 0 (0: not grouped), is not combined with "
                         f"accumulate, and masked needs groups; got groups={groups}, "
                         f"accumulate={accumulate}, masked={masked}")
    math_wgs = block_m // 64
    budget = min(arch.shared_memory_per_sm // ctas_per_sm - arch.shared_memory_reserved_per_block,
                 arch.max_shared_memory_per_block)
    # The shared-memory plan (the config's offsets) decides the stages: as many as fit.
    plan = lambda stages: Fp8GemmConfig(n, k, block_m, block_n, stages, ctas_per_sm, 0, arch.target,
                                        multicast, accumulate=accumulate, groups=groups,
                                        masked=masked, dtype=dtype)
    stages = max((s for s in range(1, MAX_STAGES + 1) if plan(s).dynamic_shared_bytes <= budget),
                 default=0)
    if stages < max(2, producers):
        raise ValueError(f"the FP8 GEMM's {block_m} x {block_n} tiles do not fit "
                         f"{max(2, producers)} times in {budget} bytes of shared memory")
    # setmaxnreg moves registers between the warps of one CTA: the math warpgroups can gain
    # only what the producer gives up from the CTA's allocation at launch (a larger request
    # waits forever).
    threads = 128 * (1 + math_wgs)
    at_launch = min(arch.max_registers_per_thread,
                    arch.registers_per_sm // (ctas_per_sm * threads)) // 8 * 8
    math_registers = (at_launch * threads - 128 * PRODUCER_REGISTERS) // (128 * math_wgs) // 8 * 8
    math_registers = min(math_registers, 256)
    # acc and each part buffer (e4m3 only: bf16 accumulates in acc) hold block_n / 2 registers.
    scaled = dtype == "e4m3"
    fits = lambda buffers: (block_n // 2 * (1 + buffers * scaled)
                            + MATH_REGISTERS_BESIDES_ACCUMULATORS <= math_registers)
    if part_buffers is None:
        # Two part buffers speed up the math of a 128-row tile so much that, measured, A
        # from L2 falls behind at long K unless the cluster pair shares it (multicast).
        part_buffers = 2 if scaled and fits(2) and (block_m == 64 or multicast > 1) else 1
    if part_buffers not in (1, 2) or not fits(part_buffers):
        raise ValueError(f"the FP8 GEMM's {block_m} x {block_n} tiles with {part_buffers} part "
                         f"buffer(s) need more than the {math_registers} registers a math thread "
                         f"gets at {ctas_per_sm} CTA(s) an SM")
    return Fp8GemmConfig(n, k, block_m, block_n, stages, ctas_per_sm, math_registers, arch.target,
                         multicast, part_buffers, accumulate, groups, masked, dtype, producers)


# The tile-choice model, fitted to `bench/gemm_sweep.py` on an H200 (docs/performance.md).
# A K block of one tile costs the longest of: one math warpgroup's dependent chain (wait
# for the stage, wgmma, wait, promote: what bounds the small tiles); the MMA plus the
# promotion of every math warpgroup (measured, the tensor cores idle while the warpgroups
# promote; two part buffers hide it), with a fixed cost per wgmma instruction (what makes
# narrow tiles slow in bf16, where nothing else hides it); the tile's operand bytes at what
# one SM takes in from L2; and the shared-memory bytes the stage's TMA writes and the
# wgmma reads (why 64-row tiles lose at large M: each reads all of B per 64 rows). A tile
# straddling two B-scale rows pays for its scale choice; each tile adds the pipeline fill
# and the epilogue. CTAs sharing an SM share its throughputs but run their chains side by
# side. Refitted in session 4 to the FP8, BF16, masked and contiguous sweeps together (46
# problems, two producer warps): the model's choice is on average within 1.1% of the best
# measured tile, at worst 9% (fp8 128x32768x512).
CHAIN_CLOCKS = 150
PROMOTE_CLOCKS_PER_COLUMN = 0.1    # per math warpgroup
WGMMA_CLOCKS = 30                  # per wgmma instruction of a math warpgroup
L2_BYTES_PER_CLOCK_PER_SM = 70
STRADDLE_CLOCKS = 100
TILE_CLOCKS = 3000
MMA_FLOPS_PER_CLOCK = 8192
SHARED_BYTES_PER_CLOCK = 128       # an SM's shared memory, TMA writes and wgmma reads together
WGMMAS_PER_K_BLOCK = 4             # K = 128 e4m3 in steps of 32, or 64 bf16 in steps of 16


def estimate_clocks(cfg: Fp8GemmConfig, m: int, sms: int) -> float:
    """The model's clocks for the whole problem on ``sms`` SMs: waves of tiles."""
    # A K block is one 128-byte row of A and B: the same MMA clocks in e4m3 (K = 128 at
    # MMA_FLOPS_PER_CLOCK) and bf16 (K = 64 at half the rate); only e4m3 promotes.
    mma = (cfg.block_m * cfg.block_n * BLOCK_K * 2 / MMA_FLOPS_PER_CLOCK
           + WGMMA_CLOCKS * WGMMAS_PER_K_BLOCK * cfg.math_warpgroups)
    # With two part buffers the promotion overlaps the next K block's wgmma.
    promote = (PROMOTE_CLOCKS_PER_COLUMN * cfg.block_n * cfg.math_warpgroups
               * (cfg.scaled and cfg.part_buffers == 1))
    load = (cfg.a_box_rows + cfg.block_n) * ROW_BYTES / L2_BYTES_PER_CLOCK_PER_SM
    # Shared memory: the stage lands once (A and B rows) and each math warpgroup's wgmma
    # reads its 64 rows of A and all of B.
    smem = ((cfg.block_m + cfg.block_n + cfg.math_warpgroups * (64 + cfg.block_n)) * ROW_BYTES
            / SHARED_BYTES_PER_CLOCK)
    shared = cfg.ctas_per_sm
    k_block = (max(CHAIN_CLOCKS, shared * (mma + promote), shared * load, shared * smem)
               + STRADDLE_CLOCKS * cfg.straddles)
    tiles = -(-m // cfg.block_m) * cfg.n_tiles
    waves = -(-tiles // (sms * cfg.ctas_per_sm))
    return waves * (cfg.k_blocks * k_block + TILE_CLOCKS)


MULTICAST_MIN_M = 512  # below, the tiles of a block row are too few to pair up


def choose_config(arch: Arch, m: int, n: int, k: int, sms: int | None = None,
                  accumulate: bool = False, groups: int = 0,
                  masked: bool = False, dtype: str = "e4m3") -> Fp8GemmConfig:
    """The config the model above finishes first on ``sms`` SMs (the device's by default);
    ties go to no multicast (session 4: as often 1-3% faster as slower, and simpler), then
    to the smaller tile."""
    _require_problem(arch, n, k)
    sms = sms or arch.sm_count
    best = None
    multicasts = (1, 2) if m >= MULTICAST_MIN_M and sms % 2 == 0 else (1,)
    for block_m in (64,) if m <= 64 else (64, 128):
        # Two CTAs an SM: two K-loop chains overlap (what small tiles are bound by).
        for ctas_per_sm in (1, 2) if block_m == 64 else (1,):
            for block_n in block_n_candidates(arch, scaled=dtype == "e4m3"):
                for multicast in multicasts:
                    try:
                        cfg = make_config(arch, n, k, block_m, block_n, ctas_per_sm, multicast,
                                          accumulate=accumulate, groups=groups, masked=masked,
                                          dtype=dtype)
                    except ValueError:
                        continue
                    estimate = (estimate_clocks(cfg, m, sms), multicast, ctas_per_sm)
                    if best is None or estimate < best[0]:
                        best = (estimate, cfg)
    if best is None:
        raise ValueError(f"no FP8 GEMM tile fits N={n}, K={k} on {arch.target}")
    return best[1]


def generate(cfg: Fp8GemmConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads,
                      min_blocks_per_sm=cfg.ctas_per_sm)
    k.launch = cfg.launch
    p = _params(k, cfg)
    smem = k.dynamic_shared("smem", align=SWIZZLE_ATOM)
    base = k.reg("u32", "smem")
    with k.stage("shared memory base (rounded up to a swizzle atom) and barriers"):
        k.mov(base, smem)
        k.add(base, base, SWIZZLE_ATOM - 1)
        k.and_(base, base, -SWIZZLE_ATOM & 0xFFFFFFFF)
        tid = k.reg("u32", "t")
        k.mov(tid, sreg.tid.x)
        thread0 = k.pred("thread0")
        k.setp("eq", thread0, tid, 0)
        with k.guard(thread0):
            for s in range(cfg.stages):
                k.mbarrier_init(addr(base, cfg.full_offset + s * BARRIER_BYTES), 1)
                # One arrival per math warp of every CTA whose loads fill this stage.
                k.mbarrier_init(addr(base, cfg.empty_offset + s * BARRIER_BYTES),
                                4 * cfg.math_warpgroups * cfg.multicast)
            k.fence_mbarrier_init()
        k.fence_proxy_async()
        if cfg.multicast > 1:  # the peer's barriers exist before anything lands there
            k.barrier_cluster_arrive(sem="release")
            k.barrier_cluster_wait()
        else:
            k.bar_sync(0)
        warpgroup = k.reg("u32", "warpgroup")
        k.shr(warpgroup, tid, 7)
        is_producer = k.pred("is_producer")
        k.setp("eq", is_producer, warpgroup, 0)

    finish = k.label("finish")
    with k.if_(is_producer, "producer_done", uniform=True):
        _producer(k, cfg, p, base, tid)
        k.bra(finish, uniform=True)
    _math(k, cfg, p, base, tid, warpgroup)
    k.place(finish)
    if cfg.multicast > 1:
        with k.stage("finish: no CTA leaves while its peer may still signal its barriers"):
            k.barrier_cluster_arrive(sem="release")
            k.barrier_cluster_wait()
    return k


def _params(k, cfg):
    p = type("Params", (), {})()
    maps = cfg.tensor_maps
    p.tmap_a = k.tensormap_param("tmap_a", maps["tmap_a"])
    p.tmap_b = k.tensormap_param("tmap_b", maps["tmap_b"])
    if cfg.scaled:
        p.tmap_sa = k.tensormap_param("tmap_sa", maps["tmap_sa"])
    p.tmap_d = k.tensormap_param("tmap_d", maps["tmap_d"])
    if cfg.scaled:
        p.sb = k.param("sb", "u64")
    if not cfg.masked:   # the masked layout counts its tiles from masked_m
        p.m_tiles = k.param("m_tiles", "u32")
    if cfg.scaled:
        p.sb_row_stride = k.param("sb_row_stride", "u32")
    if cfg.masked:
        p.masked_m = k.param("masked_m", "u64")     # int32 [groups]: each group's valid rows
        p.m_rows = k.param("m_rows", "u32")         # M_max
    elif cfg.groups:
        p.m_indices = k.param("m_indices", "u64")   # int32 [M]: each row's group, -1: padding
        p.m_rows = k.param("m_rows", "u32")
    return p


def _tile_group(k, cfg, m_indices, m_block, group, at):
    """Grouped (contiguous layout): the group of the tile's first row, clamped into
    [0, groups): the B matrix and B scales the tile reads. Rows whose m_indices differ
    from it (padding -1, an index out of range, a segment not aligned to the tile) are
    written as zeros by the epilogue: never a read outside B."""
    k.mul(at, m_block, cfg.block_m * 4, mode="wide")
    k.add(at, at, m_indices)
    k.ld(group, addr(at), nc=True)
    k.max(group, group, 0)
    k.min(group, group, cfg.groups - 1)


class _Tiles:
    """The persistent tile loop. A cluster of ``multicast`` CTAs takes tile groups
    g = cluster, cluster + clusters, ... < m_tiles * n_tiles / multicast; group g is
    (m_block, n_group) in raster groups of RASTER_GROUP block rows, and the CTA of rank r
    takes n_block = n_group * multicast + r (so the cluster shares m_block: A). The masked
    MoE layout walks only the tiles of each group's valid rows (masked_m, read on the GPU),
    group after group, n_group fastest: the clusters share the real work evenly."""

    def __init__(self, k, cfg, p):
        self.k, self.cfg = k, cfg
        self.n_groups = cfg.n_tiles // cfg.multicast
        self.count = k.reg("u32", "tiles")
        if not cfg.masked:
            self.m_tiles = k.reg("u32", "m_tiles")
            k.ld_param(self.m_tiles, p.m_tiles)
            k.mul(self.count, self.m_tiles, self.n_groups, mode="lo")
        else:
            self.group, self._tiles_of = k.reg("u32", "moe_group"), k.reg("u32", "group_tiles")
            self._masked_m, self._m_rows = k.reg("u64", "tiles_masked_m"), k.reg("u32", "tiles_m_rows")
            self._at = k.reg("u64", "tiles_at")
            k.ld_param(self._masked_m, p.masked_m)
            k.ld_param(self._m_rows, p.m_rows)
            k.mov(self.count, 0)
            with k.loop(self.group, cfg.groups, uniform=True, hint="count_tiles"):
                self._group_tiles()
                k.add(self.count, self.count, self._tiles_of)
        self.first, self.step = k.reg("u32", "first_tile"), k.reg("u32", "tile_step")
        if cfg.multicast > 1:
            self.rank = k.reg("u32", "cta_rank")
            k.mov(self.rank, sreg.cluster_ctarank)
            k.mov(self.first, sreg.clusterid.x)
            k.mov(self.step, sreg.nclusterid.x)
        else:
            k.mov(self.first, sreg.ctaid.x)
            k.mov(self.step, sreg.nctaid.x)
        self.m_block, self.n_block = k.reg("u32", "m_block"), k.reg("u32", "n_block")
        self._rows, self._group = k.reg("u32", "group_rows"), k.reg("u32", "group")

    def loop(self):
        return self.k.loop(self.k.reg("u32", "tile"), self.count, start=self.first, step=self.step,
                           uniform=True, hint="tile")

    def _group_tiles(self) -> None:
        """Masked: the tile groups of group ``self.group``'s valid rows (masked_m[group]
        clamped into [0, M_max]) into ``self._tiles_of``."""
        k, rows = self.k, self._tiles_of
        negative = k.pred("negative_count")
        k.mad(self._at, self.group, 4, self._masked_m, mode="wide")
        k.ld(rows, addr(self._at), nc=True)
        k.setp("ge", negative, rows, 1 << 31, type="u32")   # a negative count: no rows
        k.selp(rows, 0, rows, negative)
        k.min(rows, rows, self._m_rows)
        k.add(rows, rows, self.cfg.block_m - 1)
        k.div(rows, rows, self.cfg.block_m, type="u32")
        k.mul(rows, rows, self.n_groups, mode="lo")

    def _masked_coordinates(self, tile) -> None:
        """Masked: the group holding ``tile`` (a scan over the groups' tile counts), then
        m_block, n_block within it, n fastest."""
        k, local = self.k, self._group
        found, scan, done = k.pred("found_group"), k.label("find_group"), k.label("found_group")
        k.mov(self.group, 0)
        k.mov(local, tile)
        k.place(scan)
        self._group_tiles()
        k.setp("lt", found, local, self._tiles_of, type="u32")
        with k.guard(found):
            k.bra(done, uniform=True)
        k.sub(local, local, self._tiles_of)
        k.add(self.group, self.group, 1)
        k.bra(scan, uniform=True)
        k.place(done)
        k.div(self.m_block, local, self.n_groups, type="u32")
        k.rem(self.n_block, local, self.n_groups, type="u32")
        if self.cfg.multicast > 1:
            k.mad(self.n_block, self.n_block, self.cfg.multicast, self.rank, mode="lo")

    def coordinates(self, tile) -> None:
        """m_block, n_block (and the masked layout's group) of ``tile`` (about 30
        instructions, once per tile)."""
        if self.cfg.masked:
            self._masked_coordinates(tile)
            return
        k, group, rows = self.k, self._group, self._rows
        tiles_per_group = RASTER_GROUP * self.n_groups
        k.div(group, tile, tiles_per_group, type="u32")
        k.mul(self.m_block, group, RASTER_GROUP, mode="lo")      # the group's first block row
        k.sub(rows, self.m_tiles, self.m_block)
        k.min(rows, rows, RASTER_GROUP)                          # block rows in this group
        k.mad(group, group, -tiles_per_group & 0xFFFFFFFF, tile, mode="lo")  # tile within group
        k.rem(self.n_block, group, rows)
        k.add(self.m_block, self.m_block, self.n_block)
        k.div(self.n_block, group, rows, type="u32")
        if self.cfg.multicast > 1:
            k.mad(self.n_block, self.n_block, self.cfg.multicast, self.rank, mode="lo")


def _producer(k, cfg, p, base, tid):
    """Lane 0 of each producer warp issues the loads of every producers-th K block (of the
    tile sequence as a whole): one thread's chain of barrier waits, address arithmetic and
    TMA issues per stage is what bounds the small tiles, and warps take it in turns."""
    with k.stage("producer: lane 0 of the producer warps streams A, B and sa into the stage "
                 "ring, tile after tile, the warps taking turns over the K blocks"):
        k.setmaxnreg(PRODUCER_REGISTERS, increase=False)
        leader, mine = k.pred("producer_leader"), k.reg("u32", "p_leader_bits")
        # tid is 32 * warp (lane 0) with warp < producers: no bits outside 32 * (producers - 1).
        k.and_(mine, tid, ~(32 * (cfg.producers - 1)) & 0xFFFFFFFF)
        k.setp("eq", leader, mine, 0)
        with k.if_(leader, "producer_leader_done"):
            def tensor_map(name, param):
                r = k.reg("u64", name)
                k.mov(r, param)
                k.cvta(r, r, space="param")
                k.prefetch_tensormap(addr(r))
                return r

            tmap_a, tmap_b = tensor_map("tmap_a_ptr", p.tmap_a), tensor_map("tmap_b_ptr", p.tmap_b)
            tmap_sa = tensor_map("tmap_sa_ptr", p.tmap_sa) if cfg.scaled else None
            tiles = _Tiles(k, cfg, p)
            m0, n0 = k.reg("s32", "m0"), k.reg("s32", "n0")
            if cfg.multicast > 1:
                m0_share, everyone = k.reg("s32", "m0_share"), k.reg("b16", "cluster_mask")
                k.mov(everyone, (1 << cfg.multicast) - 1)
            # This warp's next K block: the first of a tile, or (producers > 1) a few later.
            stage, phase, first = (k.reg("u32", n) for n in ("p_stage", "p_phase", "p_first"))
            k.shr(first, tid, 5)
            k.mov(stage, first)
            k.mov(phase, 0)
            empty_parity, kx = k.reg("u32", "empty_parity"), k.reg("s32", "k0")
            bar_full, bar_empty = k.reg("u32", "bar_full"), k.reg("u32", "bar_empty")
            dst_a, dst_b, dst_sa = (k.reg("u32", n) for n in ("dst_a", "dst_b", "dst_sa"))
            b_row = n0   # the tile's first row of B: in a grouped B, its group's matrix's
            a_group = []   # the masked layout's third coordinate (A, sa): the group
            if cfg.groups:
                group, b_row = k.reg("s32", "p_group"), k.reg("s32", "b_row")
            if cfg.masked:
                a_group = [group]
            elif cfg.groups:
                m_indices, at = k.reg("u64", "p_m_indices"), k.reg("u64", "p_group_at")
                k.ld_param(m_indices, p.m_indices)

            def load_tile():
                with k.loop(k.reg("u32", "p_kb"), cfg.k_blocks, start=first,
                            step=cfg.producers) as kb:
                    k.mad(bar_empty, stage, BARRIER_BYTES, base, mode="lo")
                    k.add(bar_empty, bar_empty, cfg.empty_offset)
                    k.xor(empty_parity, phase, 1)  # a fresh barrier passes a wait on parity 1
                    wait_parity(k, addr(bar_empty), empty_parity, "wait_empty")
                    k.mad(bar_full, stage, BARRIER_BYTES, base, mode="lo")
                    k.add(bar_full, bar_full, cfg.full_offset)
                    k.mbarrier_arrive_expect_tx(addr(bar_full), cfg.tx_bytes)
                    k.mad(dst_a, stage, cfg.a_stage_bytes, base, mode="lo")
                    if cfg.multicast > 1:
                        k.mad(dst_a, tiles.rank, cfg.a_box_rows * ROW_BYTES, dst_a, mode="lo")
                    k.mad(dst_b, stage, cfg.b_stage_bytes, base, mode="lo")
                    k.add(dst_b, dst_b, cfg.b_offset)
                    if cfg.scaled:
                        k.mad(dst_sa, stage, cfg.sa_stage_bytes, base, mode="lo")
                        k.add(dst_sa, dst_sa, cfg.sa_offset)
                    k.mul(kx, kb, cfg.k_per_block, mode="lo", type="s32")
                    if cfg.multicast > 1:  # this CTA's share of A, into every CTA of the cluster
                        k.cp_async_bulk_tensor_load(addr(dst_a), tmap_a, [kx, m0_share] + a_group,
                                                    addr(bar_full), multicast_mask=everyone)
                    else:
                        k.cp_async_bulk_tensor_load(addr(dst_a), tmap_a, [kx, m0] + a_group,
                                                    addr(bar_full))
                    k.cp_async_bulk_tensor_load(addr(dst_b), tmap_b, [kx, b_row], addr(bar_full))
                    if cfg.scaled:
                        k.cp_async_bulk_tensor_load(addr(dst_sa), tmap_sa, [m0, kb] + a_group,
                                                    addr(bar_full))
                    next_stage(k, stage, phase, cfg.stages, cfg.producers)
                if cfg.producers > 1:
                    k.sub(first, kb, cfg.k_blocks)

            with tiles.loop() as tile:
                tiles.coordinates(tile)
                k.mul(m0, tiles.m_block, cfg.block_m, mode="lo", type="s32")
                k.mul(n0, tiles.n_block, cfg.block_n, mode="lo", type="s32")
                if cfg.masked:
                    k.mov(group, tiles.group)
                elif cfg.groups:
                    _tile_group(k, cfg, m_indices, tiles.m_block, group, at)
                if cfg.groups:
                    k.mad(b_row, group, cfg.n, n0, mode="lo", type="s32")
                if cfg.multicast > 1:
                    k.mad(m0_share, tiles.rank, cfg.a_box_rows, m0, mode="lo", type="s32")
                load_tile()


# The upper word of every descriptor: stride offset 1024 B (8 rows of 128 B) >> 4, and
# layout type 1 (128-byte swizzle) in bits 62-63.
DESCRIPTOR_HI = (SWIZZLE_ATOM >> 4) | (1 << 30)


def _descriptor(k, desc, smem_address, lo, hi):
    """A wgmma shared-memory descriptor for a K-major tile with the 128-byte swizzle:
    start address >> 4 in bits 0-13, leading offset 16 B (unused by this layout) in
    bits 16-29; ``hi`` holds DESCRIPTOR_HI."""
    k.shr(lo, smem_address, 4)
    k.and_(lo, lo, 0x3FFF)
    k.or_(lo, lo, 1 << 16)
    k.mov(desc, vec(lo, hi), type="b64")


def _math(k, cfg, p, base, tid, warpgroup):
    """The math warpgroups: set up once, then for each tile the K loop and the epilogue."""
    r = SimpleNamespace()
    with k.stage("math warpgroups: registers, coordinates"):
        k.setmaxnreg(cfg.math_registers, increase=True)
        r.wg = k.reg("u32", "math_wg")
        k.sub(r.wg, warpgroup, 1)
        # From lane 0: ptxas then knows it is the same in the whole warp and keeps what
        # derives from it (the descriptors) in uniform registers.
        k.shfl_sync(r.wg, r.wg, 0, mode="idx")
        r.lane, warp = k.reg("u32", "lane"), k.reg("u32", "warp_in_wg")
        k.and_(r.lane, tid, 31)
        k.shr(warp, tid, 5)
        k.and_(warp, warp, 3)
        # This thread's two accumulator rows within the tile: row_in_tile and row_in_tile + 8.
        r.row_in_wg, r.row_in_tile = k.reg("u32", "row_in_wg"), k.reg("u32", "row_in_tile")
        k.shr(r.row_in_wg, r.lane, 2)
        k.mad(r.row_in_wg, warp, 16, r.row_in_wg, mode="lo")
        k.mad(r.row_in_tile, r.wg, 64, r.row_in_wg, mode="lo")
        r.acc = k.regs("f32", cfg.block_n // 2, "acc")
        if cfg.scaled:
            r.parts = [k.regs("f32", cfg.block_n // 2, f"part{b}_")
                       for b in range(cfg.part_buffers)]
            r.sb_base = k.reg("u64", "sb_base")
            # This tile's B scales: the row of its first column, and for a straddling tile the next.
            r.sb_ptrs = k.regs("u64", 1 + cfg.straddles, "sb_ptr")
            if cfg.straddles:
                r.low_groups = k.reg("u32", "low_groups")
            r.sb_stride, r.sb_index = k.reg("u32", "sb_stride"), k.reg("u32", "sb_index")
            k.ld_param(r.sb_base, p.sb)
            k.ld_param(r.sb_stride, p.sb_row_stride)
        r.overwrite, r.accumulate = k.pred("overwrite"), k.pred("accumulate")
        k.setp("ne", r.overwrite, tid, tid)     # false: a K block's first wgmma overwrites
        k.setp("eq", r.accumulate, tid, tid)    # true: the rest accumulate
        r.stage, r.phase = k.reg("u32", "stage"), k.reg("u32", "phase")
        k.mov(r.stage, 0)
        k.mov(r.phase, 0)
        # Descriptors of stage 0 (this warpgroup's 64 rows of A; B): a stage and a K step
        # only add a constant to them.
        r.desc_a, r.desc_b = k.reg("b64", "desc_a0"), k.reg("b64", "desc_b0")
        at, lo, hi = k.reg("u32", "desc_at"), k.reg("b32", "desc_lo"), k.reg("b32", "desc_hi")
        k.mov(hi, DESCRIPTOR_HI)
        k.mad(at, r.wg, 64 * ROW_BYTES, base, mode="lo")
        _descriptor(k, r.desc_a, at, lo, hi)
        k.add(at, base, cfg.b_offset)
        _descriptor(k, r.desc_b, at, lo, hi)
        if cfg.scaled:
            r.sa_row = k.reg("u32", "sa_row")   # the thread's row of sa in stage 0
            k.mad(r.sa_row, r.row_in_tile, 4, base, mode="lo")
            k.add(r.sa_row, r.sa_row, cfg.sa_offset)
        # The warpgroup's slice of the D tile: its 64 rows of each store box.
        r.d_smem = k.reg("u32", "d_smem")
        k.mad(r.d_smem, r.wg, 64 * cfg.d_box_cols * cfg.d_element_bytes, base, mode="lo")
        k.add(r.d_smem, r.d_smem, cfg.d_offset)
        r.arrive_lane = k.pred("arrive_lane")
        k.setp("lt", r.arrive_lane, r.lane, cfg.multicast)
        r.empty = base             # the empty barriers this thread arrives on (lane r: CTA r's)
        if cfg.multicast > 1:
            r.empty = k.reg("u32", "empty_bars")
            k.mapa(r.empty, base, r.lane)
        r.wg_leader = k.pred("wg_leader")
        wg_thread = k.reg("u32", "wg_thread")
        k.and_(wg_thread, tid, 127)
        k.setp("eq", r.wg_leader, wg_thread, 0)
        r.wg_barrier = k.reg("u32", "wg_barrier")  # named barriers 1 and 2, one per warpgroup
        k.add(r.wg_barrier, r.wg, 1)
        r.tmap_d = k.reg("u64", "tmap_d_ptr")
        k.mov(r.tmap_d, p.tmap_d)
        k.cvta(r.tmap_d, r.tmap_d, space="param")
        if cfg.groups and not cfg.masked:
            r.m_indices, r.m_rows = k.reg("u64", "m_indices"), k.reg("u32", "m_rows")
            k.ld_param(r.m_indices, p.m_indices)
            k.ld_param(r.m_rows, p.m_rows)
            r.group, r.valid = k.reg("s32", "group"), [k.pred("row_valid"), k.pred("row8_valid")]
    tiles = _Tiles(k, cfg, p)
    with tiles.loop() as tile:
        tiles.coordinates(tile)
        _k_loop(k, cfg, base, tiles, r)
        _epilogue(k, cfg, tiles, r)
    with k.stage("drain: the last TMA stores complete before the CTA exits"):
        with k.guard(r.wg_leader):
            k.cp_async_bulk_wait_group(0)


def _group_rows(k, cfg, tiles, r):
    """Grouped: the tile's group, and whether each of the thread's two rows belongs to it
    (inside M, with that m_indices): rows that do not are written as zeros."""
    at, row, index = k.reg("u64", "group_at"), k.reg("u32", "group_row"), k.reg("s32", "row_group")
    _tile_group(k, cfg, r.m_indices, tiles.m_block, r.group, at)
    for half, valid in enumerate(r.valid):
        k.mad(row, tiles.m_block, cfg.block_m, r.row_in_tile, mode="lo")
        if half:
            k.add(row, row, 8)
        k.setp("lt", valid, row, r.m_rows, type="u32")
        k.mov(index, -1)
        with k.guard(valid):
            k.mad(at, row, 4, r.m_indices, mode="wide")
            k.ld(index, addr(at), nc=True)
        k.setp("eq", valid, index, r.group, type="s32")


class _Ring:
    """The math warpgroup's side of the stage ring: ``issue`` the wgmma of the next full
    stage, ``release`` the oldest stage in flight (``held``) to the producer(s)."""

    def __init__(self, k, cfg, base, r):
        self.k, self.cfg, self.base, self.r = k, cfg, base, r
        self.desc_a, self.desc_b = k.reg("b64", "desc_a"), k.reg("b64", "desc_b")
        self.stage_a, self.stage_b = k.reg("b64", "stage_desc_a"), k.reg("b64", "stage_desc_b")
        self.offset, self.at = k.reg("u64", "stage_desc_offset"), k.reg("u32", "stage_at")
        self.held, self.wrapped = k.reg("u32", "held_stage"), k.pred("held_wrapped")
        k.mov(self.held, r.stage)

    def issue(self, accumulator, first_scale_d):
        """wgmma the K block in stage r.stage into ``accumulator`` (its first step
        overwrites or adds by ``first_scale_d``); step the ring."""
        k, cfg, r = self.k, self.cfg, self.r
        k.mad(self.at, r.stage, BARRIER_BYTES, self.base, mode="lo")
        wait_parity(k, addr(self.at, cfg.full_offset), r.phase, "wait_full")
        # The stage's descriptors; a K step of 32 bytes (inside the swizzle atom) adds 2.
        k.mul(self.offset, r.stage, cfg.a_stage_bytes >> 4, mode="wide")
        k.add(self.stage_a, r.desc_a, self.offset, type="s64")
        k.mul(self.offset, r.stage, cfg.b_stage_bytes >> 4, mode="wide")
        k.add(self.stage_b, r.desc_b, self.offset, type="s64")
        k.wgmma_fence()
        for step in range(ROW_BYTES // 32):
            k.add(self.desc_a, self.stage_a, 2 * step, type="s64")
            k.add(self.desc_b, self.stage_b, 2 * step, type="s64")
            k.wgmma_mma_async(accumulator, self.desc_a, self.desc_b, n=cfg.block_n,
                              ab_type=cfg.dtype,
                              scale_d=first_scale_d if step == 0 else r.accumulate)
        k.wgmma_commit_group()
        next_stage(k, r.stage, r.phase, cfg.stages)

    def release(self):
        """The warp is done with stage `held`: lane r tells CTA r of the cluster."""
        k, r = self.k, self.r
        k.mad(self.at, self.held, BARRIER_BYTES, r.empty, mode="lo")
        with k.guard(r.arrive_lane):
            k.mbarrier_arrive(addr(self.at, self.cfg.empty_offset), remote=self.cfg.multicast > 1)
        k.add(self.held, self.held, 1)
        k.setp("eq", self.wrapped, self.held, self.cfg.stages)
        k.selp(self.held, 0, self.held, self.wrapped)


def _k_loop(k, cfg, base, tiles, r):
    if cfg.groups and not cfg.masked:
        _group_rows(k, cfg, tiles, r)
    if cfg.scaled:
        _scaled_k_loop(k, cfg, base, tiles, r)
    else:
        _unscaled_k_loop(k, cfg, base, r)


def _unscaled_k_loop(k, cfg, base, r):
    """bf16: every K block's wgmma accumulates into `acc` (the first overwrites); one group
    stays in flight while the next is issued, and each stage is released once its group is
    done. Only wgmma touches `acc` inside the loop, so the group in flight across the loop's
    back edge does not make ptxas serialize the wgmma (C7514 needs another reader)."""
    ring = _Ring(k, cfg, base, r)
    with k.stage("K loop (bf16): wgmma every K block into `acc`, one group in flight"):
        ring.issue(r.acc, r.overwrite)
        with k.loop(k.reg("u32", "kb"), cfg.k_blocks - 1, uniform=True):
            ring.issue(r.acc, r.accumulate)
            k.wgmma_wait_group(1)
            ring.release()
        k.wgmma_wait_group(0)
        ring.release()


def _scaled_k_loop(k, cfg, base, tiles, r):
    sb_row = k.reg("u32", "sb_row")
    with k.stage("tile start: zero the accumulators, point at this tile's B scales"):
        for a in r.acc:
            k.mov(a, 0.0)
        # The tile's first column n0 lies in row n0 / 128 of B scales; a straddling tile's
        # columns from 128 - n0 % 128 on lie in the next row (clamped at the last row,
        # where those columns are past N and never stored).
        n0 = k.reg("u32", "sb_n0")
        k.mul(n0, tiles.n_block, cfg.block_n, mode="lo")
        scale_rows = -(-cfg.n // BLOCK_K)
        first_row = 0   # of the tile's B scales: a grouped B's are its group's rows
        if cfg.groups:
            first_row = k.reg("u32", "sb_first_row")
            k.mul(first_row, tiles.group if cfg.masked else r.group, scale_rows, mode="lo")
        k.shr(sb_row, n0, 7)
        k.add(r.sb_index, sb_row, first_row)
        k.mul(r.sb_index, r.sb_index, r.sb_stride, mode="lo")
        k.mad(r.sb_ptrs[0], r.sb_index, 4, r.sb_base, mode="wide")
        if cfg.straddles:
            k.add(sb_row, sb_row, 1)
            k.min(sb_row, sb_row, scale_rows - 1)
            k.add(sb_row, sb_row, first_row)
            k.mul(r.sb_index, sb_row, r.sb_stride, mode="lo")
            k.mad(r.sb_ptrs[1], r.sb_index, 4, r.sb_base, mode="wide")
            k.and_(n0, n0, BLOCK_K - 1)
            k.sub(r.low_groups, BLOCK_K, n0)
            k.shr(r.low_groups, r.low_groups, 3)   # 8-column groups in the first scale row
            k.min(r.low_groups, r.low_groups, cfg.block_n // 8)
    sa0, sa1 = k.reg("f32", "sa0"), k.reg("f32", "sa1")
    # sb of the next K block (one load ahead: its latency hides behind a K block).
    sb = k.regs("f32", 1 + cfg.straddles, "sb")
    for block, ptr in enumerate(r.sb_ptrs):
        k.ld(sb[block], addr(ptr), nc=True)
    # scale[block][h]: sa of the thread's row (h = 0) or row + 8 (h = 1) times sb of scale row `block`
    scale = [k.regs("f32", 2, f"scale{block}_") for block in range(1 + cfg.straddles)]

    ring = _Ring(k, cfg, base, r)
    at, kb, more = k.reg("u32", "sa_at"), k.reg("u32", "kb"), k.pred("more")

    def retire(part, pending):
        """The oldest K block in flight (stage `held`): wait until at most ``pending``
        later ones are, release its stage, promote ``part``."""
        k.mad(at, ring.held, cfg.sa_stage_bytes, r.sa_row, mode="lo")
        k.ld(sa0, addr(at), space="shared")
        k.ld(sa1, addr(at, 8 * 4), space="shared")
        k.add(kb, kb, 1)
        k.setp("lt", more, kb, cfg.k_blocks, type="u32")
        for block, ptr in enumerate(r.sb_ptrs):  # this block's scales, the next block's sb
            k.mul(scale[block][0], sa0, sb[block])
            k.mul(scale[block][1], sa1, sb[block])
            k.add(ptr, ptr, 4)
            with k.guard(more):
                k.ld(sb[block], addr(ptr), nc=True)
        k.wgmma_wait_group(pending)
        ring.release()
        _promote(k, cfg, r, part, scale)

    # With two part buffers, K blocks go in pairs: both wgmma issued, then the first
    # promotes while the second's wgmma runs. (A pipeline across loop iterations, with a
    # wgmma in flight at the back edge, makes ptxas serialize every wgmma: C7514.)
    buffers, blocks = cfg.part_buffers, cfg.k_blocks
    with k.stage("K loop: wgmma K blocks into `part`, promote each into `acc`"):
        k.mov(kb, 0)
        with k.loop(k.reg("u32", "kb_group"), blocks // buffers, uniform=True):
            for part in r.parts:
                ring.issue(part, r.overwrite)
            for j, part in enumerate(r.parts):
                retire(part, buffers - 1 - j)
        if blocks % buffers:
            ring.issue(r.parts[0], r.overwrite)
            retire(r.parts[0], 0)


def _promote(k, cfg, r, part, scale):
    """acc += part * sa * sb. The thread's accumulators come in 8-column groups of 4:
    (row, 2 columns) then (row + 8, the same 2 columns). A straddling tile's first
    r.low_groups groups take the B scale of its first scale row, the others the next row's.
    Where a tile width allows few splits, each has its own code and a K block branches to
    its tile's (no per-group choice); otherwise every group selects its scale."""
    groups = cfg.block_n // 8

    def fma_groups(first, stop, row_scales):
        for i in range(4 * first, 4 * stop):
            k.fma(r.acc[i], part[i], row_scales[(i >> 1) & 1], r.acc[i])

    if not cfg.straddles:
        fma_groups(0, groups, scale[0])
    elif len(cfg.scale_row_splits) <= MAX_PROMOTION_VARIANTS:
        done, other = k.label("promoted"), k.pred("other_split")
        *tested, fallthrough = cfg.scale_row_splits
        for split in tested:
            next_split = k.label(f"not_split_{split}")
            k.setp("ne", other, r.low_groups, split, type="u32")
            with k.guard(other):
                k.bra(next_split, uniform=True)
            fma_groups(0, split, scale[0])
            fma_groups(split, groups, scale[1])
            k.bra(done, uniform=True)
            k.place(next_split)
        fma_groups(0, fallthrough, scale[0])
        fma_groups(fallthrough, groups, scale[1])
        k.place(done)
    else:
        low, chosen = k.pred("low_scale_row"), k.regs("f32", 2, "group_scale")
        for group in range(groups):
            k.setp("gt", low, r.low_groups, group, type="u32")
            for h in range(2):
                k.selp(chosen[h], scale[0][h], scale[1][h], low)
            fma_groups(group, group + 1, chosen)


def _epilogue(k, cfg, tiles, r):
    """The warpgroup's 64 x BLOCK_N slice of the tile, through shared memory, out by TMA
    (stored, or with ``accumulate`` added into D).

    The D tile is a row of store boxes, each block_m rows x d_box_cols columns, the
    warpgroup's 64 rows at r.d_smem within each. A thread holds column pairs: in each
    8-column group, the pair at columns 2 * (lane % 4), of rows row_in_wg and + 8."""
    leader, barrier = r.wg_leader, r.wg_barrier
    cols, size = cfg.d_box_cols, cfg.d_element_bytes
    row_bytes = cols * size
    chunks = row_bytes // 16                # 16-byte chunks in a box row: 8, 4, 2 or 1
    group_chunks = 8 * size // 16           # chunks an 8-column group spans: 1 (bf16), 2 (f32)
    box_bytes = cfg.block_m * row_bytes
    with k.stage("epilogue: wait for the previous store to have read the D tile"):
        with k.guard(leader):
            k.cp_async_bulk_wait_group(0, read=True)
        k.bar_sync(barrier, 128)
    with k.stage("epilogue: the accumulators into the swizzled D tile"):
        # TMA's swizzle of row_bytes-byte rows: chunk c of row r sits at chunk
        # c ^ (r / (8 / chunks)) % chunks (the pattern repeats every 8 rows of 128 bytes):
        # conflict-free stores. The thread's pair is byte (lane % 4) * 2 * size of its group.
        row = k.reg("u32", "d_row")
        rows = k.regs("u32", 2, "d_row_base")
        swz = k.regs("u32", 2, "d_swizzle")
        pair, pair_chunk = k.reg("u32", "d_pair"), k.reg("u32", "d_pair_chunk")
        k.and_(pair, r.lane, 3)
        k.mul(pair, pair, 2 * size, mode="lo")
        if group_chunks > 1:
            k.shr(pair_chunk, pair, 4)          # the chunk of the group it lies in
            k.and_(pair, pair, 15)              # its byte in that chunk
        for half in range(2):  # rows within the warpgroup's slice: d_smem starts at its row 0
            k.add(row, r.row_in_wg, 8 * half)
            if chunks > 1:
                k.shr(swz[half], row, (8 // chunks).bit_length() - 1)
                k.and_(swz[half], swz[half], chunks - 1)
                if group_chunks > 1:
                    k.xor(swz[half], swz[half], pair_chunk)
            k.mad(rows[half], row, row_bytes, r.d_smem, mode="lo")
            k.add(rows[half], rows[half], pair)
        packed, at, chunk = k.reg("b32", "packed"), k.reg("u32", "d_at"), k.reg("u32", "d_chunk")
        for group in range(cfg.block_n // 8):
            box, group_in_box = divmod(group, cols // 8)
            for half in range(2):
                i = 4 * group + 2 * half
                if chunks > 1:
                    k.xor(chunk, swz[half], group_in_box * group_chunks)
                    k.mad(at, chunk, 16, rows[half], mode="lo")
                    where = addr(at, box * box_bytes)
                else:
                    where = addr(rows[half], box * box_bytes)
                if cfg.accumulate:
                    k.st(where, r.acc[i:i + 2], space="shared")
                else:
                    k.cvt(packed, r.acc[i + 1], r.acc[i], dtype="bf16x2", rnd="rn")
                    if cfg.groups and not cfg.masked:  # rows outside the tile's group: zeros
                        k.selp(packed, packed, 0, r.valid[half], type="b32")
                    k.st(where, packed, space="shared", type="b32")
        k.fence_proxy_async()  # the TMA store reads what these ordinary stores wrote
        k.bar_sync(barrier, 128)
    with k.stage("epilogue: one thread stores the slice with TMA (clipped at the edges)"):
        with k.if_(leader, "stored"):
            x, y = k.reg("s32", "d_x"), k.reg("s32", "d_y")
            k.mul(y, tiles.m_block, cfg.block_m, mode="lo", type="s32")
            k.mad(y, r.wg, 64, y, mode="lo", type="s32")
            src = k.reg("u32", "d_src")
            for box in range(cfg.block_n // cols):
                k.mad(x, tiles.n_block, cfg.block_n, box * cols, mode="lo", type="s32")
                k.add(src, r.d_smem, box * box_bytes)
                coords = [x, y] + ([tiles.group] if cfg.masked else [])
                if cfg.accumulate:
                    k.cp_reduce_async_bulk_tensor(r.tmap_d, coords, addr(src), op="add")
                else:
                    k.cp_async_bulk_tensor_store(r.tmap_d, coords, addr(src))
            k.cp_async_bulk_commit_group()
