"""The GEMM's config: the problem (``kernels/gemm.py``: N, K, dtype, layout, epilogue
terms) and how this generation computes it: the tile, the stage count, the registers, with
the one shared-memory plan that the heuristic's capacity check, the generator's offsets and
the launch all read, and the tensor maps the kernel takes (their boxes also give the
stages' expect-tx bytes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ...arch import Arch
from ...patterns.pipeline import BARRIER_BYTES
from ...ptx import LaunchShape, TensorMap
from ..gemm import BLOCK_K, GemmProblem
from .epilogue import Epilogue, epilogue_for

ROW_BYTES = 128          # a stage row of A or B: K = 128 e4m3 or 64 bf16 (one swizzle row)
PRODUCER_REGISTERS = 40
SWIZZLE_ATOM = 1024      # 8 rows x 128 bytes: the 128-byte swizzle repeats every 1024 bytes
TMA_SHARED_ALIGNMENT = 128  # a tensor copy's shared-memory address (the PTX ISA's rule)


@dataclass(frozen=True)
class GemmConfig:
    problem: GemmProblem   # what is computed: N, K, dtype, layout, epilogue terms
    block_m: int           # 64 or 128: one math warpgroup per 64 rows
    block_n: int           # a multiple of 8 (wgmma's n step), see block_n_candidates
    stages: int
    ctas_per_sm: int
    math_registers: int
    target: str
    multicast: int = 1     # CTAs of a cluster sharing each A tile (neighbours along N)
    part_buffers: int = 1  # 2: a K block's wgmma runs while the one before it promotes
    producers: int = 2     # producer warps, taking turns over the K blocks (see the producer)
    tile_rows: int = 0     # 8, 16 or 32: rows of A and D a 64-row tile covers (few tokens);
                           # 0: block_m. The wgmma still computes 64 rows: those past
                           # tile_rows read what follows in shared memory (A) or their
                           # stage's last scales (sa), and are never stored.
    raster: int = 16        # block rows a raster group walks (scheduler.py), dense/contiguous
    share_b: bool = False   # with multicast: the cluster's CTAs are neighbours along M and
                            # share each B tile where their rows' groups agree (a dense B
                            # always), instead of neighbours along N sharing A

    def __post_init__(self):
        # The contiguous layout's segments and the multicast split assume whole tiles.
        if self.tile_rows and (self.block_m != 64 or self.multicast > 1
                               or self.problem.layout == "contiguous"):
            raise ValueError(f"tile_rows needs block_m 64, no multicast and a dense or masked "
                             f"layout, got block_m={self.block_m}, multicast={self.multicast}, "
                             f"layout={self.problem.layout}")
        # Halves of B land 1024-byte aligned (the swizzle atom): block_n a multiple of 16.
        if self.share_b and (self.multicast != 2 or self.masked or self.block_n % 16):
            raise ValueError(f"share_b needs multicast 2, a dense or contiguous layout and "
                             f"block_n a multiple of 16, got multicast={self.multicast}, "
                             f"layout={self.problem.layout}, block_n={self.block_n}")

    # The problem's sizes and kind, as the kernel body reads them.
    n = property(lambda self: self.problem.n)
    k = property(lambda self: self.problem.k)
    dtype = property(lambda self: self.problem.dtype)
    groups = property(lambda self: self.problem.groups)
    masked = property(lambda self: self.problem.masked)
    scaled = property(lambda self: self.problem.scaled)

    @property
    def name(self) -> str:
        kind = "fp8_gemm_1d2d" if self.scaled else "bf16_gemm"
        terms = self.problem.epilogue
        return (f"sm90_{kind}_n{self.n}_k{self.k}_bm{self.block_m}_bn{self.block_n}"
                f"_s{self.stages}_c{self.ctas_per_sm}_mc{self.multicast}_p{self.part_buffers}"
                + ("_acc" if "accumulate" in terms else "")
                + (f"_g{self.groups}" if self.groups else "") + ("m" if self.masked else "")
                + (f"_w{self.producers}" if self.producers > 1 else "")
                + "".join(f"_{term}" for term in terms if term != "accumulate")
                + (f"_r{self.tile_rows}" if self.tile_rows else "")
                + (f"_ras{self.raster}" if self.raster != 16 else "")
                + ("_shb" if self.share_b else ""))

    @property
    def rows(self) -> int:
        """Rows of A and D one tile covers (M advances by this much from tile to tile)."""
        return self.tile_rows or self.block_m

    @property
    def math_warpgroups(self) -> int:
        return self.block_m // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.math_warpgroups)

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
    def epilogue(self) -> type[Epilogue]:
        """What the math warpgroups do with a finished tile: see epilogue.py."""
        return epilogue_for(self.problem)

    @property
    def d_element_bytes(self) -> int:
        return self.epilogue.element_bytes

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
        return self.rows if self.share_b else self.rows // self.multicast

    @property
    def b_box_rows(self) -> int:
        """Rows of B one TMA copy loads (share_b: half the tile, one per CTA of the cluster)."""
        return self.block_n // self.multicast if self.share_b else self.block_n

    @property
    def a_stage_bytes(self) -> int:
        return self.rows * ROW_BYTES

    @property
    def b_stage_bytes(self) -> int:
        return self.block_n * ROW_BYTES

    @property
    def sa_stage_bytes(self) -> int:
        # A TMA copy lands on a 128-byte aligned shared address: a few rows' scales get
        # a stage of 128 bytes.
        return -(-self.rows * 4 // TMA_SHARED_ALIGNMENT) * TMA_SHARED_ALIGNMENT if self.scaled else 0

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
    def sb_stage_bytes(self) -> int:
        """A stage's B scales: the K block's of the tile's one or two scale rows (f32), in
        16 bytes."""
        return 16 if self.scaled else 0

    @property
    def sb_offset(self) -> int:
        return self.sa_offset + self.stages * self.sa_stage_bytes

    @property
    def full_offset(self) -> int:
        return self.sb_offset + self.stages * self.sb_stage_bytes

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
        128-byte swizzled rows, sa one column of the tile's scales, D in store boxes of
        each math warpgroup's rows. The masked layout's group is a third dimension, one
        group per box."""
        element = "float8_e4m3fn" if self.scaled else "bfloat16"
        group = (1,) if self.masked else ()
        maps = {"tmap_a": TensorMap(element, (self.k_per_block, self.a_box_rows) + group,
                                    swizzle=ROW_BYTES),
                "tmap_b": TensorMap(element, (self.k_per_block, self.b_box_rows),
                                    swizzle=ROW_BYTES)}
        if self.scaled:
            maps["tmap_sa"] = TensorMap("float32", (self.rows, 1) + group)
        maps["tmap_d"] = TensorMap(self.epilogue.element,
                                   (self.d_box_cols, min(self.rows, 64)) + group,
                                   swizzle=self.d_swizzle)
        return maps

    @property
    def launch(self) -> LaunchShape:
        return LaunchShape(block=self.threads, shared_bytes=self.dynamic_shared_bytes,
                           cluster=self.multicast)

    @property
    def tx_bytes(self) -> int:
        """Bytes the TMA copies of one stage deliver: the loads' boxes (full, even at the
        edges): the whole A and B tiles, whichever CTA of the cluster loads each part."""
        maps = self.tensor_maps
        a_parts, b_parts = (1, self.multicast) if self.share_b else (self.multicast, 1)
        return (a_parts * maps["tmap_a"].box_bytes + b_parts * maps["tmap_b"].box_bytes
                + (maps["tmap_sa"].box_bytes if self.scaled else 0))


# Stages beyond these were slower, measured on an H200 at 1-128 tokens (bench/decode_tiles.py
# and a stage sweep): e4m3 at 8-12 stages ran 5-17% faster than at 21-35 (2112x7168, M=1:
# 10.9 us at 12, 13.2 at 35), likely as the flood of weight loads delays the math warps'
# per-K-block loads of B scales; bf16, which has none, was best at 16-24.
MAX_STAGES = {"e4m3": 12, "bf16": 24}
# Registers a math thread needs besides the accumulators (acc and part: block_n of them)
# and what its epilogue keeps (Epilogue.registers). 40 is what ptxas needs: every tile it
# admits assembles without spills (a sweep of all of them with ptxas 13.0), among them
# 128 x 192 with one part buffer and 128 x 128 with two (232 registers).
MATH_REGISTERS_BESIDES_ACCUMULATORS = 40
# ptxas places one wgmma's accumulators within the registers the launch bounds give a
# thread, not those setmaxnreg raises it to: at 2 CTAs an SM (128), m64n208 and wider
# fail to assemble (C7602, ptxas 13.0); m64n200 assembles.
WGMMA_REGISTERS_BESIDES_ACCUMULATORS = 28


def block_n_candidates(arch: Arch, max_block_n: int = 256, scaled: bool = True) -> tuple[int, ...]:
    """Tile widths: wgmma's n steps (multiples of 8) from 16 up; with ``scaled`` (e4m3) only
    those whose tiles, starting at any multiple of the width, cover at most two 128-column
    blocks of B scales."""
    mma = arch.mma
    return tuple(bn for bn in range(max(16, mma["n_min"]), min(mma["n_max"], max_block_n) + 1,
                                    mma["n_step"])
                 if not scaled or bn <= BLOCK_K + math.gcd(bn, BLOCK_K))


def require_problem(arch: Arch, problem: GemmProblem) -> None:
    """Raise a ValueError naming what this generation cannot compute of ``problem`` on
    ``arch``: the target's features, N and K's alignment, the epilogue's terms."""
    problem.require_valid()
    arch.require("wgmma", "the GEMM")
    arch.require("tma", "the GEMM")
    # TMA needs every row to start aligned: D's bf16 rows of N, A's e4m3 rows of K.
    row, n, k = arch.tma_alignment, problem.n, problem.k
    if n <= 0 or n % (row // 2) or k <= 0 or k % row:
        raise ValueError(f"the GEMM needs N a positive multiple of {row // 2} and K of {row} "
                         f"({row}-byte rows), got N={n}, K={k}")
    epilogue_for(problem)


@functools.lru_cache(maxsize=None)   # the tile model asks for each tile at every M
def make_config(arch: Arch, problem: GemmProblem, block_m: int, block_n: int,
                ctas_per_sm: int = 1, multicast: int = 1, part_buffers: int | None = None,
                producers: int = 2, tile_rows: int = 0, raster: int = 16,
                share_b: bool = False) -> GemmConfig:
    """A config for one tile shape of ``problem``: as many stages as the CTA's share of
    shared memory holds, and the math registers that residency leaves. ``multicast`` 2:
    clusters of two CTAs on neighbouring tiles of one block row, each loading half of the
    shared A tile; with ``share_b`` on neighbouring block rows of one column, each loading
    half of B (where their rows' groups agree). ``raster``: block rows a raster group
    walks. ``part_buffers``: 1 or 2 registers sets a K block's wgmma accumulates into (2
    overlap a K block's promotion with the next one's wgmma); by default 2 where they fit.
    An ``accumulate`` problem's f32 D tile takes shared memory from the stages. bf16
    operands: no scales, K blocks of 64. ``producers``: warps issuing the loads (1, 2 or
    4), each every producers-th K block. ``tile_rows`` 8, 16 or 32: a 64-row tile that
    covers only that many rows of A and D (dense or masked, no multicast): a few tokens'
    stages hold less of A, so more of them, more weight bytes, fit."""
    require_problem(arch, problem)
    dtype, layout = problem.dtype, problem.layout
    widths = block_n_candidates(arch, scaled=problem.scaled)
    if block_m not in (64, 128) or block_n not in widths:
        raise ValueError(f"no {dtype} GEMM tile {block_m} x {block_n}: block_m is 64 or 128, "
                         f"block_n one of {widths}")
    n_tiles = -(-problem.n // block_n)
    if multicast not in (1, 2) or (not share_b and n_tiles % multicast):
        raise ValueError(f"multicast {multicast} needs 1 or 2 and a tile count along N "
                         f"({n_tiles}) it divides")
    if multicast > 1:
        arch.require("clusters", "the GEMM's TMA multicast")
    if producers not in (1, 2, 4):
        raise ValueError(f"producers must be 1, 2 or 4 warps, got {producers}")
    if tile_rows and (tile_rows not in (8, 16, 32) or block_m != 64 or multicast > 1
                      or layout == "contiguous"):
        raise ValueError(f"tile_rows must be 8, 16 or 32, with block_m 64, no multicast and a "
                         f"dense or masked layout; got tile_rows={tile_rows}, block_m={block_m}, "
                         f"multicast={multicast}, layout={layout}")
    math_wgs = block_m // 64
    budget = min(arch.shared_memory_per_sm // ctas_per_sm - arch.shared_memory_reserved_per_block,
                 arch.max_shared_memory_per_block)
    # The shared-memory plan (the config's offsets) decides the stages: as many as fit.
    plan = lambda stages: GemmConfig(problem, block_m, block_n, stages, ctas_per_sm, 0,
                                     arch.target, multicast, tile_rows=tile_rows)
    stages = max((s for s in range(1, MAX_STAGES[dtype] + 1)
                  if plan(s).dynamic_shared_bytes <= budget), default=0)
    if stages < max(2, producers):
        raise ValueError(f"the GEMM's {block_m} x {block_n} tiles do not fit "
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
    scaled = problem.scaled
    besides = MATH_REGISTERS_BESIDES_ACCUMULATORS + epilogue_for(problem).registers
    fits = lambda buffers: block_n // 2 * (1 + buffers * scaled) + besides <= math_registers
    if part_buffers is None:
        # Two part buffers speed up the math of a 128-row tile so much that, measured, A
        # from L2 falls behind at long K unless the cluster pair shares it (multicast).
        part_buffers = 2 if scaled and fits(2) and (block_m == 64 or multicast > 1) else 1
    if part_buffers == 2 and not scaled:
        raise ValueError("part_buffers 2 needs e4m3 operands: bf16 K blocks accumulate "
                         "straight into the accumulators")
    if part_buffers not in (1, 2) or not fits(part_buffers):
        raise ValueError(f"the GEMM's {block_m} x {block_n} tiles with {part_buffers} part "
                         f"buffer(s) need more than the {math_registers} registers a math thread "
                         f"gets at {ctas_per_sm} CTA(s) an SM")
    if block_n // 2 + WGMMA_REGISTERS_BESIDES_ACCUMULATORS > at_launch:
        raise ValueError(f"the GEMM's {block_n}-wide wgmma does not assemble in the {at_launch} "
                         f"registers a thread has at launch at {ctas_per_sm} CTA(s) an SM")
    return GemmConfig(problem, block_m, block_n, stages, ctas_per_sm, math_registers,
                      arch.target, multicast, part_buffers, producers, tile_rows, raster, share_b)
