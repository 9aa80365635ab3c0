"""The persistent tile scheduler: which output tiles a CTA computes, in which order, and for
MoE which group's B each tile reads. The kernel body asks the scheduler and never names
the layout:

    tiles = TileScheduler.create(k, cfg, params)     # dense, contiguous or masked
    with tiles.loop() as tile:
        tiles.coordinates(tile)                       # m_block, n_block (masked: group)
        tiles.load_group()                            # contiguous: the tile's group
        ... tiles.b_row(n0), tiles.group, tiles.extra_coordinates ...

A cluster of ``multicast`` CTAs takes tile groups g = cluster, cluster + clusters, ... <
count, where a tile group is ``multicast`` neighbouring tiles along N (they share A), or
with ``share_b`` along M (they share B where their rows' groups agree: an expert's block
rows then read its weights from L2 once, in lockstep, rather than in CTAs that drift apart
until the second read misses). The dense and contiguous layouts walk the tiles in raster
groups of ``cfg.raster`` block rows (all of a raster group's tiles in one block column
before the next column), so the tiles running at once share A rows and B columns in L2.
The masked layout walks only the tiles of each group's valid rows (masked_m, read on the
GPU), group after group, N fastest: the clusters share the real work evenly.
"""

from __future__ import annotations

from ...ptx import addr, sreg


class TileScheduler:
    """Dense: ``m_tiles`` (a kernel parameter) block rows of ``n_tiles`` tiles; no group."""

    group = None                # the tile's MoE group, a register (grouped layouts)
    extra_coordinates = ()      # the tensor maps' coordinates after (column, row): masked's group
    repeat = None               # share_b: a predicate, the tile is the peer's (an odd block row
                                # count leaves the cluster's last CTA none): computed, not stored

    @staticmethod
    def create(k, cfg, params) -> "TileScheduler":
        """The scheduler for ``cfg``'s layout; emits its setup (the tile count, this CTA's
        first tile and step)."""
        if cfg.masked:
            return MaskedTiles(k, cfg, params)
        if cfg.groups:
            return ContiguousTiles(k, cfg, params)
        return TileScheduler(k, cfg, params)

    def __init__(self, k, cfg, params):
        self.k, self.cfg = k, cfg
        self.n_groups = cfg.n_tiles if cfg.share_b else cfg.n_tiles // cfg.multicast
        self.count = k.reg("u32", "tiles")
        self._count_tiles(params)
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
        self._rows, self._raster = k.reg("u32", "raster_rows"), k.reg("u32", "raster_group")

    def _count_tiles(self, params) -> None:
        """``count``: the tile groups over the block rows (share_b: pairs of them) times
        the tile groups along N."""
        k = self.k
        self.m_tiles = k.reg("u32", "m_tiles")
        k.ld_param(self.m_tiles, params.m_tiles)
        self._limit_m_tiles(params)
        self.block_rows = self.m_tiles
        if self.cfg.share_b:
            self.block_rows = k.reg("u32", "row_pairs")
            k.add(self.block_rows, self.m_tiles, 1)
            k.shr(self.block_rows, self.block_rows, 1)
            self.repeat = k.pred("repeat_tile")
        k.mul(self.count, self.block_rows, self.n_groups, mode="lo")

    def _limit_m_tiles(self, params) -> None:
        """Fewer block rows than the parameter where the layout says so on the GPU."""

    def loop(self):
        """The loop over this CTA's (cluster's) tile groups; yields the tile group index."""
        return self.k.loop(self.k.reg("u32", "tile"), self.count, start=self.first,
                           step=self.step, uniform=True, hint="tile")

    def coordinates(self, tile) -> None:
        """m_block, n_block of ``tile`` in its raster group (9 instructions)."""
        k, raster, rows = self.k, self._raster, self._rows
        group = self.cfg.raster
        tiles_per_raster = group * self.n_groups
        k.div(raster, tile, tiles_per_raster, type="u32")
        k.mul(self.m_block, raster, group, mode="lo")            # the raster group's first row
        k.sub(rows, self.block_rows, self.m_block)
        k.min(rows, rows, group)                                # block rows in this raster group
        k.mad(raster, raster, -tiles_per_raster & 0xFFFFFFFF, tile, mode="lo")  # tile within it
        k.rem(self.n_block, raster, rows)
        k.add(self.m_block, self.m_block, self.n_block)
        k.div(self.n_block, raster, rows, type="u32")
        self._cluster_column()

    def _cluster_column(self) -> None:
        """The CTA of rank r takes tile n_group * multicast + r of the tile group; with
        share_b block row pair * 2 + r, or where that is past the last its peer's."""
        k = self.k
        if self.cfg.share_b:
            k.mad(self.m_block, self.m_block, 2, self.rank, mode="lo")
            k.setp("ge", self.repeat, self.m_block, self.m_tiles, type="u32")
            with k.guard(self.repeat):   # rank 1 past the last block row: rank 0's
                k.sub(self.m_block, self.m_block, 1)
        elif self.cfg.multicast > 1:
            k.mad(self.n_block, self.n_block, self.cfg.multicast, self.rank, mode="lo")

    def load_group(self) -> None:
        """The tile's group into ``group`` where coordinates() did not give it."""

    def shares_b(self):
        """share_b: a predicate, whether the cluster peer's tile reads the same B as this
        one; None where it always does (a dense B)."""
        return None

    def b_row(self, n0):
        """The first row of B that the tile reads: ``n0`` in a dense B; in a grouped B, the
        row ``n0`` of its group's matrix (group * N + n0, into a register of its own)."""
        if self.group is None:
            return n0
        row = self.k.reg("s32", "b_row")
        self.k.mad(row, self.group, self.cfg.n, n0, mode="lo", type="s32")
        return row


class ContiguousTiles(TileScheduler):
    """MoE, contiguous layout: the dense tile order over all groups' rows; each tile takes
    its group from m_indices (a parameter: int32 [M], each row's group, -1 padding). Where
    ``rows_used`` (a parameter: a pointer to an int32 on the GPU, or 0) is given, only the
    block rows holding its first rows_used rows are tiles: a caller that sizes A for the
    worst case of a routing it does not know on the host (``moe_routing_layout``) pays only
    for the rows the routing fills."""

    def __init__(self, k, cfg, params):
        super().__init__(k, cfg, params)
        self.m_indices = k.reg("u64", "m_indices")
        k.ld_param(self.m_indices, params.m_indices)
        self.group, self._at = k.reg("s32", "group"), k.reg("u64", "group_at")

    def _limit_m_tiles(self, params) -> None:
        """The block rows holding the first rows_used rows, where rows_used is given."""
        k = self.k
        at, used = k.reg("u64", "rows_used_at"), k.reg("u32", "rows_used")
        k.ld_param(at, params.rows_used)
        given = k.pred("rows_used_given")
        k.setp("ne", given, at, 0, type="u64")
        with k.if_(given, "rows_used_read"):
            k.ld(used, addr(at), nc=True)
            k.add(used, used, self.cfg.rows - 1)
            k.div(used, used, self.cfg.rows, type="u32")
            k.min(self.m_tiles, self.m_tiles, used)

    def load_group(self) -> None:
        """The group of the tile's first row, clamped into [0, groups): the B matrix and B
        scales the tile reads. Rows whose m_indices differ from it (padding -1, an index
        out of range, a segment not aligned to the tile) are the epilogue's to write as
        zeros: never a read outside B."""
        self._group_of(self.group, self.m_block)

    def shares_b(self):
        """Whether the peer's block row (this one's other half of the pair, or this one where
        that is past the last) starts in the same group as this tile."""
        k = self.k
        peer, last = k.reg("u32", "peer_block"), k.reg("u32", "last_block")
        peer_group, shared = k.reg("s32", "peer_group"), k.pred("shares_b")
        k.xor(peer, self.m_block, 1)
        k.sub(last, self.m_tiles, 1)
        k.min(peer, peer, last)
        self._group_of(peer_group, peer)
        k.setp("eq", shared, peer_group, self.group, type="s32")
        return shared

    def _group_of(self, group, block) -> None:
        """``group`` = the group of block row ``block``'s first row, clamped into [0, groups)."""
        k = self.k
        k.mul(self._at, block, self.cfg.rows * 4, mode="wide")
        k.add(self._at, self._at, self.m_indices)
        k.ld(group, addr(self._at), nc=True)
        k.max(group, group, 0)
        k.min(group, group, self.cfg.groups - 1)


class MaskedTiles(TileScheduler):
    """MoE, masked layout: A and D are [groups, M_max, ...] (the group their tensor maps'
    third coordinate); group g's valid rows are masked_m[g] (int32 on the GPU, clamped into
    [0, M_max]); the tile count is the sum of the groups' tile counts."""

    def __init__(self, k, cfg, params):
        self.group = k.reg("u32", "moe_group")
        self.extra_coordinates = (self.group,)
        super().__init__(k, cfg, params)

    def _count_tiles(self, params) -> None:
        k = self.k
        self._tiles_of = k.reg("u32", "group_tiles")
        self._masked_m, self._m_rows = k.reg("u64", "masked_m"), k.reg("u32", "m_rows")
        self._at = k.reg("u64", "masked_m_at")
        k.ld_param(self._masked_m, params.masked_m)
        k.ld_param(self._m_rows, params.m_rows)
        k.mov(self.count, 0)
        with k.loop(self.group, self.cfg.groups, uniform=True, hint="count_tiles"):
            self._group_tiles()
            k.add(self.count, self.count, self._tiles_of)

    def _group_tiles(self) -> None:
        """The tile groups of group ``group``'s valid rows into ``_tiles_of``."""
        k, rows = self.k, self._tiles_of
        negative = k.pred("negative_count")
        k.mad(self._at, self.group, 4, self._masked_m, mode="wide")
        k.ld(rows, addr(self._at), nc=True)
        k.setp("ge", negative, rows, 1 << 31, type="u32")   # a negative count: no rows
        k.selp(rows, 0, rows, negative)
        k.min(rows, rows, self._m_rows)
        k.add(rows, rows, self.cfg.rows - 1)
        k.div(rows, rows, self.cfg.rows, type="u32")
        k.mul(rows, rows, self.n_groups, mode="lo")

    def coordinates(self, tile) -> None:
        """The group holding ``tile`` (a scan over the groups' tile counts), then m_block,
        n_block within it, N fastest."""
        k, local = self.k, self._raster
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
        self._cluster_column()
