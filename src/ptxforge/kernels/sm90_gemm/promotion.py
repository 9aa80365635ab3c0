"""The FP32 promotion of DeepGEMM's fine-grained FP8 scaling: each 128-wide K block's wgmma
writes a *part* buffer of f32 registers, which is folded into the accumulators with
``acc += part * sa[row] * sb[block]`` on the CUDA cores, so that the fp8 products of two
scale blocks never accumulate inside the tensor core.

sa (one scale per row per K block) comes with each stage, by TMA, into shared memory, and
so does sb (one per 128 x 128 block of B): the producer copies the K block's (one float,
two for a straddling tile) with a 4-byte cp.async whose completion the stage's full
barrier also waits for. (Read by the math threads from global memory one K block ahead,
the scale stalled them while a few tokens' GEMM streamed weights: without its scale reads
and promotion that kernel ran 5-20% faster, measured on an H200.) A tile whose columns
straddle two 128-column rows of B scales (a block_n that does not divide 128) takes each
8-column group's sb from its own row.
"""

from __future__ import annotations

from ...ptx import addr
from ..gemm import BLOCK_K

# A straddling tile width with at most this many scale-row splits gets a promotion per split.
MAX_PROMOTION_VARIANTS = 4


class TileScaleRows:
    """The rows of B scales a tile reads (the producer copies its K block's into each
    stage): the tile's first column n0 lies in row n0 / 128 of B scales; a straddling
    tile's columns from 128 - n0 % 128 on lie in the next row (clamped at the last row,
    where those columns are past N and never stored). A grouped B's rows are its group's."""

    def __init__(self, k, cfg, params):
        self.k, self.cfg = k, cfg
        self.base, self.stride = k.reg("u64", "sb_base"), k.reg("u32", "sb_stride")
        k.ld_param(self.base, params.sb)
        k.ld_param(self.stride, params.sb_row_stride)
        self.pointers = k.regs("u64", 1 + cfg.straddles, "sb_ptr")   # the rows' starts
        self._row, self._index = k.reg("u32", "sb_row"), k.reg("u32", "sb_index")
        self._at = k.reg("u64", "sb_at")

    def start_tile(self, tiles, n0) -> None:
        """The tile's rows, from its first column ``n0`` (a register)."""
        k, cfg = self.k, self.cfg
        scale_rows = -(-cfg.n // BLOCK_K)
        first_row = 0
        if tiles.group is not None:
            first_row = k.reg("u32", "sb_first_row")
            k.mul(first_row, tiles.group, scale_rows, mode="lo")
        k.shr(self._row, n0, 7)
        for block, pointer in enumerate(self.pointers):
            if block:
                k.add(self._row, self._row, 1)
                k.min(self._row, self._row, scale_rows - 1)
            k.add(self._index, self._row, first_row)
            k.mul(self._index, self._index, self.stride, mode="lo")
            k.mad(pointer, self._index, 4, self.base, mode="wide")

    def copy(self, kb, stage_sb, full) -> None:
        """K block ``kb``'s scale of each row into the stage at ``stage_sb`` (a shared
        address), landing before the stage's full barrier at ``full`` completes."""
        for block, pointer in enumerate(self.pointers):
            self.k.mad(self._at, kb, 4, pointer, mode="wide")
            self.k.cp_async(addr(stage_sb, 4 * block), addr(self._at), 4)
        self.k.cp_async_mbarrier_arrive(addr(full))


class Promotion:
    """One math thread's scales and part buffers. Made once per kernel (it finds the
    thread's row of sa in stage 0); per tile ``start_tile``, per K block ``scales`` (before
    the wgmma wait) and ``fold`` (after it)."""

    def __init__(self, k, cfg, thread, base):
        self.k, self.cfg = k, cfg
        self.parts = [k.regs("f32", cfg.block_n // 2, f"part{b}_") for b in range(cfg.part_buffers)]
        if cfg.straddles:
            self.low_groups = k.reg("u32", "low_groups")  # 8-column groups in the first row
        self.sa_row = k.reg("u32", "sa_row")   # the thread's row of sa in stage 0
        row = thread.row_in_tile
        if cfg.tile_rows:
            # A tile of a few rows: rows past them (never stored) read the last rows of
            # the stage's own sa, not the next stage's or the barriers after the last.
            row = k.reg("u32", "sa_row_in_stage")
            k.min(row, thread.row_in_tile, cfg.sa_stage_bytes // 4 - 9)
        k.mad(self.sa_row, row, 4, base, mode="lo")
        k.add(self.sa_row, self.sa_row, cfg.sa_offset)
        self.sb_stage0 = k.reg("u32", "sb_stage0")   # the K block's sb in stage 0
        k.add(self.sb_stage0, base, cfg.sb_offset)
        # Lane 0 reads the stage's sb and hands it to the warp: the lane that frees the
        # stage (StageRing.release) is then the only one that read what the producer's next
        # cp.async overwrites (compute-sanitizer's racecheck holds every reader to it).
        self.lane0 = k.pred("sb_reader")
        k.setp("eq", self.lane0, thread.lane, 0)
        self.sa = k.regs("f32", 2, "sa")       # of the thread's rows: row_in_tile and + 8
        self.sb = k.regs("f32", 1 + cfg.straddles, "sb")
        # scale[block][h]: sa of row h times sb of scale row `block`.
        self.scale = [k.regs("f32", 2, f"scale{block}_") for block in range(1 + cfg.straddles)]
        self._at = k.reg("u32", "sa_at")

    def start_tile(self, tiles, acc) -> None:
        """Zero the accumulators; a straddling tile's split between its two scale rows."""
        k, cfg = self.k, self.cfg
        for a in acc:
            k.mov(a, 0.0)
        if cfg.straddles:
            n0 = k.reg("u32", "sb_n0")
            k.mul(n0, tiles.n_block, cfg.block_n, mode="lo")
            k.and_(n0, n0, BLOCK_K - 1)
            k.sub(self.low_groups, BLOCK_K, n0)
            k.shr(self.low_groups, self.low_groups, 3)
            k.min(self.low_groups, self.low_groups, cfg.block_n // 8)

    def scales(self, stage) -> None:
        """The K block in stage ``stage``: its scales, sa times sb, both from the stage."""
        k, cfg, sa = self.k, self.cfg, self.sa
        k.mad(self._at, stage, cfg.sa_stage_bytes, self.sa_row, mode="lo")
        k.ld(sa[0], addr(self._at), space="shared")
        k.ld(sa[1], addr(self._at, 8 * 4), space="shared")
        k.mad(self._at, stage, cfg.sb_stage_bytes, self.sb_stage0, mode="lo")
        for block, sb in enumerate(self.sb):
            with k.guard(self.lane0):
                k.ld(sb, addr(self._at, 4 * block), space="shared")
            k.shfl_sync(sb, sb, 0, mode="idx")
            k.mul(self.scale[block][0], sa[0], sb)
            k.mul(self.scale[block][1], sa[1], sb)

    def fold(self, acc, part) -> None:
        """acc += part * scale. The thread's accumulators come in 8-column groups of 4:
        (row, 2 columns) then (row + 8, the same 2 columns). A straddling tile's first
        low_groups groups take the B scale of its first scale row, the others the next
        row's. Where a tile width allows few splits, each has its own code and a K block
        branches to its tile's (no per-group choice); otherwise every group selects its
        scale."""
        k, cfg, scale = self.k, self.cfg, self.scale
        groups = cfg.block_n // 8

        def fma_groups(first, stop, row_scales):
            for i in range(4 * first, 4 * stop):
                k.fma(acc[i], part[i], row_scales[(i >> 1) & 1], acc[i])

        if not cfg.straddles:
            fma_groups(0, groups, scale[0])
        elif len(cfg.scale_row_splits) <= MAX_PROMOTION_VARIANTS:
            done, other = k.label("promoted"), k.pred("other_split")
            *tested, fallthrough = cfg.scale_row_splits
            for split in tested:
                next_split = k.label(f"not_split_{split}")
                k.setp("ne", other, self.low_groups, split, type="u32")
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
                k.setp("gt", low, self.low_groups, group, type="u32")
                for h in range(2):
                    k.selp(chosen[h], scale[0][h], scale[1][h], low)
                fma_groups(group, group + 1, chosen)
