"""Split-K: a cluster of ``splits`` CTAs computes each tile, the CTA of rank r summing its
range of K blocks (TileScheduler.k_first .. k_end); rank 0 adds the others' partial
tiles to its own, in rank order, and stores D through the usual epilogue.

A few tokens' GEMM with a thin weight (N = 2112 or 4096) has too few tiles to keep every
SM streaming weights unless the tiles are narrow, and a narrow tile moves few bytes per
K block: splitting K gives each SM a wide tile's stages over a shorter K instead.

The hand-off stays in the cluster's shared memory, so it needs no workspace, no counters
in global memory and no second kernel, and it is deterministic: rank 0 always adds
partial 1, then 2, ... to its own, whatever order they arrive in.

    rank r > 0, per tile:                    rank 0, per tile:
      wait partial_free (rank 0 has read       arm partials_full with the bytes of the
        the previous tile's partial)             splits - 1 partial tiles
      st.async its partial rows into slot      wait partials_full
        r - 1 of rank 0's shared memory,       acc += slot 0, slot 1, ... (rank order)
        completing on partials_full there      all math threads done reading, then one
      (no store of D)                            arrives on every rank's partial_free
                                               the epilogue stores D
"""

from __future__ import annotations

from ...patterns.pipeline import BARRIER_BYTES, wait_parity
from ...ptx import addr


def init_barriers(k, cfg, base) -> None:
    """Thread 0: the two barriers (before the ring's fence and cluster barrier publish
    them). partials_full completes on rank 0's arming arrival and the slots' bytes;
    partial_free on rank 0's one arrival per tile."""
    if cfg.splits > 1:
        k.mbarrier_init(addr(base, cfg.split_barriers_offset), 1)
        k.mbarrier_init(addr(base, cfg.split_barriers_offset + BARRIER_BYTES), 1)


class SplitReduction:
    """A math thread's side of the hand-off (one math warpgroup: split-K tiles have 64
    rows). The thread's partial rows are row_in_tile and + 8 of its accumulator pairs,
    those below the tile's rows (a few-token tile covers 8, 16 or 32)."""

    def __init__(self, k, cfg, thread, base, tiles, leader):
        self.k, self.cfg, self.thread, self.leader = k, cfg, thread, leader
        self.rank = tiles.rank
        self.full, self.free = k.reg("u32", "partials_full"), k.reg("u32", "partial_free")
        k.add(self.full, base, cfg.split_barriers_offset)
        k.add(self.free, base, cfg.split_barriers_offset + BARRIER_BYTES)
        self.phase = k.reg("u32", "split_phase")
        k.mov(self.phase, 0)
        # The thread's place in a slot: its row, then its pair of the 8-column group.
        self.slot = k.reg("u32", "partial_at")
        pair = k.reg("u32", "partial_pair")
        k.and_(pair, thread.lane, 3)
        k.mul(pair, pair, 8, mode="lo")
        k.mad(self.slot, thread.row_in_tile, cfg.partial_row_bytes, pair, mode="lo")
        k.add(self.slot, self.slot, base)
        k.add(self.slot, self.slot, cfg.partials_offset)   # slot 0, in this CTA
        # Rank r > 0 sends into slot r - 1 of rank 0, completing on rank 0's barrier.
        self.remote_slot, self.remote_full = k.reg("u32", "remote_partial"), k.reg("u32", "remote_full")
        k.mad(self.remote_slot, self.rank, cfg.rows * cfg.partial_row_bytes, self.slot, mode="lo")
        k.sub(self.remote_slot, self.remote_slot, cfg.rows * cfg.partial_row_bytes)
        k.mapa(self.remote_slot, self.remote_slot, 0)
        k.mapa(self.remote_full, self.full, 0)
        self.is_rank0 = k.pred("split_rank0")
        k.setp("eq", self.is_rank0, self.rank, 0)
        # Which of the thread's two rows lie in the tile.
        self.halves = [k.pred("partial_row"), k.pred("partial_row8")][:1 + (cfg.rows > 8)]
        k.setp("lt", self.halves[0], thread.row_in_tile, cfg.rows)
        if cfg.rows > 8:
            k.setp("lt", self.halves[1], thread.row_in_tile, cfg.rows - 8)

    def _pairs(self):
        """(accumulator index, byte offset in a slot, row predicate) of the thread's pairs."""
        cfg = self.cfg
        for group in range(cfg.block_n // 8):
            for half, valid in enumerate(self.halves):
                yield 4 * group + 2 * half, 8 * half * cfg.partial_row_bytes + 32 * group, valid

    def hand_off(self, acc, stored) -> None:
        """After a tile's K loop: ranks > 0 send ``acc`` to rank 0 and branch to ``stored``
        (rank 0 stores the tile); rank 0 adds the partials into ``acc``."""
        k, cfg = self.k, self.cfg
        mine = k.label("split_rank0")
        with k.guard(self.is_rank0):
            k.bra(mine, uniform=True)
        with k.stage("split-K, ranks > 0: the partial tile into rank 0's shared memory"):
            parity = k.reg("u32", "free_parity")
            k.xor(parity, self.phase, 1)      # a fresh barrier passes parity 1: the first tile
            wait_parity(k, addr(self.free), parity, "wait_partial_free", uniform=True)
            for i, offset, valid in self._pairs():
                with k.guard(valid):
                    k.st_async(addr(self.remote_slot, offset), acc[i:i + 2], addr(self.remote_full),
                               type="b32")
            k.xor(self.phase, self.phase, 1)
            k.bra(stored, uniform=True)
        k.place(mine)
        with k.stage("split-K, rank 0: add the other ranks' partial tiles, in rank order"):
            with k.guard(self.leader):
                k.mbarrier_arrive_expect_tx(addr(self.full), (cfg.splits - 1) * cfg.partial_bytes)
            wait_parity(k, addr(self.full), self.phase, "wait_partials", uniform=True)
            part = k.regs("f32", 2, "partial")
            for split in range(1, cfg.splits):
                base = (split - 1) * cfg.rows * cfg.partial_row_bytes
                for i, offset, valid in self._pairs():
                    with k.guard(valid):
                        k.ld(part, addr(self.slot, base + offset), space="shared")
                        k.add(acc[i], acc[i], part[0])
                        k.add(acc[i + 1], acc[i + 1], part[1])
            # Every math thread has read the slots before any rank may refill its own.
            k.bar_sync(1, 128)
            with k.guard(self.leader):
                peer = k.reg("u32", "peer_free")
                for rank in range(1, cfg.splits):
                    k.mapa(peer, self.free, rank)
                    k.mbarrier_arrive(addr(peer), remote=True, cluster_release=True)
            k.xor(self.phase, self.phase, 1)
