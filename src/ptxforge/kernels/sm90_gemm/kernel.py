"""The GEMM kernel body: a prologue, the producer warps and the math warpgroups. Layouts
live in the tile scheduler, the FP8 scaling in the promotion, D's dtype and fused
operations in the epilogue; here are the warp roles and the stages they go through."""

from __future__ import annotations

from dataclasses import dataclass

from ... import arch
from ...patterns.pipeline import StageRing, next_stage
from ...ptx import KernelBuilder, Reg, addr, sreg, vec
from .config import PRODUCER_REGISTERS, ROW_BYTES, SWIZZLE_ATOM, GemmConfig
from .promotion import Promotion, TileScaleRows
from .scheduler import TileScheduler


def generate(cfg: GemmConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads,
                      min_blocks_per_sm=cfg.ctas_per_sm)
    k.launch = cfg.launch
    p = _Params(k, cfg)
    smem = k.dynamic_shared("smem", align=SWIZZLE_ATOM)
    base = k.reg("u32", "smem")
    # Each stage's empty barrier takes one arrival per math warp of every CTA whose loads
    # fill it (the cluster's, with multicast).
    ring = StageRing(k, base, cfg.stages, full_offset=cfg.full_offset,
                     empty_offset=cfg.empty_offset,
                     consumers=4 * cfg.math_warpgroups * cfg.multicast, tx_bytes=cfg.tx_bytes,
                     fillers=1 + cfg.scaled)   # e4m3: the B scales' cp.async arrives too
    with k.stage("programmatic launch: the next kernel on the stream may start"):
        # First thing: under a programmatic launch the next kernel's CTAs may then take the
        # SM slots ours leave free or give up, and run their prologue while our tiles
        # finish; its griddepcontrol.wait still waits for all of this grid. A no-op
        # otherwise.
        k.griddepcontrol_launch_dependents()
    with k.stage("shared memory base (rounded up to a swizzle atom) and barriers"):
        k.mov(base, smem)
        k.add(base, base, SWIZZLE_ATOM - 1)
        k.and_(base, base, -SWIZZLE_ATOM & 0xFFFFFFFF)
        tid = k.reg("u32", "t")
        k.mov(tid, sreg.tid.x)
        thread0 = k.pred("thread0")
        k.setp("eq", thread0, tid, 0)
        # With multicast the peer's barriers exist before anything lands there.
        ring.init(thread0, cluster=cfg.multicast > 1)
        warpgroup = k.reg("u32", "warpgroup")
        k.shr(warpgroup, tid, 7)
        is_producer = k.pred("is_producer")
        k.setp("eq", is_producer, warpgroup, 0)

    finish = k.label("finish")
    with k.if_(is_producer, "producer_done", uniform=True):
        _producer(k, cfg, p, base, tid, ring)
        k.bra(finish, uniform=True)
    with k.stage("math warpgroups: wait for the kernel before this one"):
        # Everything the math threads read from global memory (bias, residual, masked_m,
        # m_indices) may be its output, and D, which they store, may be memory it still
        # reads (a graph's pool reuses buffers): only the prologue above runs before it ends.
        k.griddepcontrol_wait()
    _math(k, cfg, p, base, tid, warpgroup, ring)
    k.place(finish)
    if cfg.multicast > 1:
        with k.stage("finish: no CTA leaves while its peer may still signal its barriers"):
            k.barrier_cluster_arrive(sem="release")
            k.barrier_cluster_wait()
    return k


class _Params:
    """The kernel's parameters, declared in this order (launches bind them by name)."""

    def __init__(self, k: KernelBuilder, cfg: GemmConfig):
        maps = cfg.tensor_maps
        self.tmap_a = k.tensormap_param("tmap_a", maps["tmap_a"])
        self.tmap_b = k.tensormap_param("tmap_b", maps["tmap_b"])
        if cfg.scaled:
            self.tmap_sa = k.tensormap_param("tmap_sa", maps["tmap_sa"])
        self.tmap_d = k.tensormap_param("tmap_d", maps["tmap_d"])
        if cfg.scaled:
            self.sb = k.param("sb", "u64")
        if not cfg.masked:   # the masked layout counts its tiles from masked_m
            self.m_tiles = k.param("m_tiles", "u32")
        if cfg.scaled:
            self.sb_row_stride = k.param("sb_row_stride", "u32")
        if cfg.masked:
            self.masked_m = k.param("masked_m", "u64")     # int32 [groups]: each group's valid rows
            self.m_rows = k.param("m_rows", "u32")         # M_max
        elif cfg.groups:
            self.m_indices = k.param("m_indices", "u64")   # int32 [M]: each row's group, -1: padding
            self.m_rows = k.param("m_rows", "u32")
            # int32 [1] on the GPU, or 0: the rows in use; the tiles from it on are skipped
            self.rows_used = k.param("rows_used", "u64")
        cfg.epilogue.declare_params(k, self)


def _producer(k, cfg, p, base, tid, ring):
    """Lane 0 of each producer warp issues the loads of every producers-th K block (of the
    tile sequence as a whole): one thread's chain of barrier waits, address arithmetic and
    TMA issues per stage is what bounds the small tiles, and warps take it in turns."""
    with k.stage("producer: lane 0 of the producer warps streams A, B, sa and sb into the "
                 "stage ring, tile after tile, the warps taking turns over the K blocks"):
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
            # A, sa, masked_m and m_indices may be the previous kernel's output (under a
            # programmatic launch it may still run): the scheduler, which reads the last
            # two, and every load come after the wait. (Prefetching the first weights into
            # L2 before it cost 3-14% on every launch, PDL or not: measured, removed.)
            k.griddepcontrol_wait()
            tiles = TileScheduler.create(k, cfg, p)
            scale_rows = TileScaleRows(k, cfg, p) if cfg.scaled else None
            m0, n0 = k.reg("s32", "m0"), k.reg("s32", "n0")
            share_a = cfg.multicast > 1 and not cfg.share_b
            if cfg.multicast > 1:
                everyone = k.reg("b16", "cluster_mask")
                k.mov(everyone, (1 << cfg.multicast) - 1)
            if share_a:
                m0_share = k.reg("s32", "m0_share")
            if cfg.share_b:   # B in two halves: this CTA's (shared) or both (not shared)
                half_bytes = cfg.b_box_rows * ROW_BYTES
                b_mine, b_second = k.reg("s32", "b_row_mine"), k.reg("s32", "b_row_second")
                dst_b_mine, dst_b_second = k.reg("u32", "dst_b_mine"), k.reg("u32", "dst_b_second")
            # This warp's next K block: the first of a tile, or (producers > 1) a few later.
            stage, phase, first = (k.reg("u32", n) for n in ("p_stage", "p_phase", "p_first"))
            k.shr(first, tid, 5)
            k.mov(stage, first)
            k.mov(phase, 0)
            kx = k.reg("s32", "k0")
            dst_a, dst_b, dst_sa, dst_sb = (k.reg("u32", n)
                                            for n in ("dst_a", "dst_b", "dst_sa", "dst_sb"))
            group = list(tiles.extra_coordinates)   # the masked layout's: A's and sa's group

            def load_b(b_row, full, shared):
                """B's tile, or with share_b this CTA's half into both CTAs where the peer
                reads the same B (``shared``: a predicate, None: always), else both halves."""
                if not cfg.share_b:
                    k.cp_async_bulk_tensor_load(addr(dst_b), tmap_b, [kx, b_row], addr(full))
                    return
                k.mad(dst_b_mine, tiles.rank, half_bytes, dst_b, mode="lo")
                share = lambda: k.cp_async_bulk_tensor_load(
                    addr(dst_b_mine), tmap_b, [kx, b_mine], addr(full), multicast_mask=everyone)
                if shared is None:
                    share()
                    return
                k.add(dst_b_second, dst_b, half_bytes)
                with k.guard(shared):
                    share()
                with k.guard(~shared):
                    k.cp_async_bulk_tensor_load(addr(dst_b), tmap_b, [kx, b_row], addr(full))
                    k.cp_async_bulk_tensor_load(addr(dst_b_second), tmap_b, [kx, b_second],
                                                addr(full))

            def load_tile(b_row, shared):
                with k.loop(k.reg("u32", "p_kb"), cfg.k_blocks, start=first,
                            step=cfg.producers) as kb:
                    full = ring.acquire(stage, phase)
                    k.mad(dst_a, stage, cfg.a_stage_bytes, base, mode="lo")
                    if share_a:
                        k.mad(dst_a, tiles.rank, cfg.a_box_rows * ROW_BYTES, dst_a, mode="lo")
                    k.mad(dst_b, stage, cfg.b_stage_bytes, base, mode="lo")
                    k.add(dst_b, dst_b, cfg.b_offset)
                    if cfg.scaled:
                        k.mad(dst_sa, stage, cfg.sa_stage_bytes, base, mode="lo")
                        k.add(dst_sa, dst_sa, cfg.sa_offset)
                    k.mul(kx, kb, cfg.k_per_block, mode="lo", type="s32")
                    if share_a:  # this CTA's share of A, into every CTA of the cluster
                        k.cp_async_bulk_tensor_load(addr(dst_a), tmap_a, [kx, m0_share] + group,
                                                    addr(full), multicast_mask=everyone)
                    else:
                        k.cp_async_bulk_tensor_load(addr(dst_a), tmap_a, [kx, m0] + group,
                                                    addr(full))
                    load_b(b_row, full, shared)
                    if cfg.scaled:
                        k.cp_async_bulk_tensor_load(addr(dst_sa), tmap_sa, [m0, kb] + group,
                                                    addr(full))
                        k.mad(dst_sb, stage, cfg.sb_stage_bytes, base, mode="lo")
                        k.add(dst_sb, dst_sb, cfg.sb_offset)
                        scale_rows.copy(kb, dst_sb, full)
                    next_stage(k, stage, phase, cfg.stages, cfg.producers)
                if cfg.producers > 1:
                    k.sub(first, kb, cfg.k_blocks)

            with tiles.loop() as tile:
                tiles.coordinates(tile)
                k.mul(m0, tiles.m_block, cfg.rows, mode="lo", type="s32")
                k.mul(n0, tiles.n_block, cfg.block_n, mode="lo", type="s32")
                tiles.load_group()
                b_row = tiles.b_row(n0)
                if cfg.scaled:
                    scale_rows.start_tile(tiles, n0)
                if share_a:
                    k.mad(m0_share, tiles.rank, cfg.a_box_rows, m0, mode="lo", type="s32")
                shared = None
                if cfg.share_b:
                    shared = tiles.shares_b()
                    k.mad(b_mine, tiles.rank, cfg.b_box_rows, b_row, mode="lo", type="s32")
                    k.add(b_second, b_row, cfg.b_box_rows, type="s32")
                load_tile(b_row, shared)


@dataclass(frozen=True)
class _MathThread:
    """A math thread's place: its warpgroup among the math ones, lane, and its two
    accumulator rows (row_in_wg and + 8 within the warpgroup's 64 rows of the tile)."""
    tid: Reg
    wg: Reg
    lane: Reg
    row_in_wg: Reg
    row_in_tile: Reg


def _math_thread(k, tid, warpgroup) -> _MathThread:
    wg = k.reg("u32", "math_wg")
    k.sub(wg, warpgroup, 1)
    # From lane 0: ptxas then knows it is the same in the whole warp and keeps what
    # derives from it (the descriptors) in uniform registers.
    k.shfl_sync(wg, wg, 0, mode="idx")
    lane, warp = k.reg("u32", "lane"), k.reg("u32", "warp_in_wg")
    k.and_(lane, tid, 31)
    k.shr(warp, tid, 5)
    k.and_(warp, warp, 3)
    row_in_wg, row_in_tile = k.reg("u32", "row_in_wg"), k.reg("u32", "row_in_tile")
    k.shr(row_in_wg, lane, 2)
    k.mad(row_in_wg, warp, 16, row_in_wg, mode="lo")
    k.mad(row_in_tile, wg, 64, row_in_wg, mode="lo")
    return _MathThread(tid, wg, lane, row_in_wg, row_in_tile)


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


class _StageMma:
    """The math warpgroup's side of the stage ring: ``issue`` waits for the next full stage
    and runs its wgmma; ``release`` frees the oldest stage in flight (``held``)."""

    def __init__(self, k, cfg, ring, thread, base):
        self.k, self.cfg, self.ring = k, cfg, ring
        self.overwrite, self.accumulate = k.pred("overwrite"), k.pred("accumulate")
        k.setp("ne", self.overwrite, thread.tid, thread.tid)   # false: a K block's first wgmma overwrites
        k.setp("eq", self.accumulate, thread.tid, thread.tid)  # true: the rest accumulate
        self.stage, self.phase = k.reg("u32", "stage"), k.reg("u32", "phase")
        k.mov(self.stage, 0)
        k.mov(self.phase, 0)
        # Descriptors of stage 0 (this warpgroup's 64 rows of A; B): a stage and a K step
        # only add a constant to them.
        self.desc_a0, self.desc_b0 = k.reg("b64", "desc_a0"), k.reg("b64", "desc_b0")
        at, lo, hi = k.reg("u32", "desc_at"), k.reg("b32", "desc_lo"), k.reg("b32", "desc_hi")
        k.mov(hi, DESCRIPTOR_HI)
        k.mad(at, thread.wg, 64 * ROW_BYTES, base, mode="lo")
        _descriptor(k, self.desc_a0, at, lo, hi)
        k.add(at, base, cfg.b_offset)
        _descriptor(k, self.desc_b0, at, lo, hi)
        # Lane r arrives on the empty barrier of CTA r of the cluster.
        self.arrive_lanes = k.pred("arrive_lane")
        k.setp("lt", self.arrive_lanes, thread.lane, cfg.multicast)
        self.empty = base
        if cfg.multicast > 1:
            self.empty = k.reg("u32", "empty_bars")
            k.mapa(self.empty, base, thread.lane)
        self.desc_a, self.desc_b = k.reg("b64", "desc_a"), k.reg("b64", "desc_b")
        self.stage_a, self.stage_b = k.reg("b64", "stage_desc_a"), k.reg("b64", "stage_desc_b")
        self.offset = k.reg("u64", "stage_desc_offset")
        self.held, self.wrapped = k.reg("u32", "held_stage"), k.pred("held_wrapped")
        # wgmma's K step (32 e4m3 or 16 bf16: 32 bytes of a 128-byte row) and how many of
        # them a stage holds.
        k_step = arch.get(cfg.target).mma["k"][cfg.dtype]
        self.steps, self.step_bytes = cfg.k_per_block // k_step, ROW_BYTES * k_step // cfg.k_per_block

    def start_tile(self) -> None:
        self.k.mov(self.held, self.stage)

    def issue(self, accumulator, first_scale_d) -> None:
        """wgmma the K block in the next stage into ``accumulator`` (its first step
        overwrites or adds by ``first_scale_d``); step the ring."""
        k, cfg = self.k, self.cfg
        self.ring.wait_full(self.stage, self.phase)
        # The stage's descriptors; a K step (inside the swizzle atom) adds its bytes >> 4.
        k.mul(self.offset, self.stage, cfg.a_stage_bytes >> 4, mode="wide")
        k.add(self.stage_a, self.desc_a0, self.offset, type="s64")
        k.mul(self.offset, self.stage, cfg.b_stage_bytes >> 4, mode="wide")
        k.add(self.stage_b, self.desc_b0, self.offset, type="s64")
        k.wgmma_fence()
        for step in range(self.steps):
            k.add(self.desc_a, self.stage_a, step * self.step_bytes >> 4, type="s64")
            k.add(self.desc_b, self.stage_b, step * self.step_bytes >> 4, type="s64")
            k.wgmma_mma_async(accumulator, self.desc_a, self.desc_b, n=cfg.block_n,
                              ab_type=cfg.dtype,
                              scale_d=first_scale_d if step == 0 else self.accumulate)
        k.wgmma_commit_group()
        next_stage(k, self.stage, self.phase, cfg.stages)

    def release(self) -> None:
        """The warp is done with stage ``held``: free it for the producer(s)."""
        k = self.k
        self.ring.release(self.held, self.arrive_lanes, self.empty, remote=self.cfg.multicast > 1)
        k.add(self.held, self.held, 1)
        k.setp("eq", self.wrapped, self.held, self.cfg.stages)
        k.selp(self.held, 0, self.held, self.wrapped)


def _math(k, cfg, p, base, tid, warpgroup, ring):
    """The math warpgroups: set up once, then for each tile the K loop and the epilogue."""
    with k.stage("math warpgroups: registers, coordinates"):
        k.setmaxnreg(cfg.math_registers, increase=True)
        thread = _math_thread(k, tid, warpgroup)
        acc = k.regs("f32", cfg.block_n // 2, "acc")
        promotion = Promotion(k, cfg, thread, base) if cfg.scaled else None
        mma = _StageMma(k, cfg, ring, thread, base)
        epilogue = cfg.epilogue(k, cfg, p, thread, base)
    tiles = TileScheduler.create(k, cfg, p)
    with tiles.loop() as tile:
        tiles.coordinates(tile)
        tiles.load_group()
        epilogue.start_tile(tiles)
        if promotion is None:
            _k_loop(k, cfg, acc, mma)
        else:
            _scaled_k_loop(k, cfg, tiles, acc, mma, promotion)
        epilogue.store(tiles, acc)
    with k.stage("drain: the last TMA stores complete before the CTA exits"):
        epilogue.drain()


def _k_loop(k, cfg, acc, mma):
    """bf16: every K block's wgmma accumulates into `acc` (the first overwrites); one group
    stays in flight while the next is issued, and each stage is released once its group is
    done. Only wgmma touches `acc` inside the loop, so the group in flight across the loop's
    back edge does not make ptxas serialize the wgmma (C7514 needs another reader)."""
    mma.start_tile()
    with k.stage("K loop (bf16): wgmma every K block into `acc`, one group in flight"):
        mma.issue(acc, mma.overwrite)
        with k.loop(k.reg("u32", "kb"), cfg.k_blocks - 1, uniform=True):
            mma.issue(acc, mma.accumulate)
            k.wgmma_wait_group(1)
            mma.release()
        k.wgmma_wait_group(0)
        mma.release()


def _scaled_k_loop(k, cfg, tiles, acc, mma, promotion):
    """e4m3: each K block's wgmma writes a part buffer, which the promotion folds into
    `acc` with the block's scales once the wgmma is done."""
    with k.stage("tile start: zero the accumulators, point at this tile's B scales"):
        promotion.start_tile(tiles, acc)
    mma.start_tile()

    def retire(part, pending):
        """The oldest K block in flight (stage `held`): wait until at most ``pending``
        later ones are, release its stage, promote ``part``."""
        promotion.scales(mma.held)
        k.wgmma_wait_group(pending)
        mma.release()
        promotion.fold(acc, part)

    # With two part buffers, K blocks go in pairs: both wgmma issued, then the first
    # promotes while the second's wgmma runs. (A pipeline across loop iterations, with a
    # wgmma in flight at the back edge, makes ptxas serialize every wgmma: C7514.)
    parts, blocks = promotion.parts, cfg.k_blocks
    with k.stage("K loop: wgmma K blocks into `part`, promote each into `acc`"):
        with k.loop(k.reg("u32", "kb_group"), blocks // len(parts), uniform=True):
            for part in parts:
                mma.issue(part, mma.overwrite)
            for j, part in enumerate(parts):
                retire(part, len(parts) - 1 - j)
        if blocks % len(parts):
            mma.issue(parts[0], mma.overwrite)
            retire(parts[0], 0)
