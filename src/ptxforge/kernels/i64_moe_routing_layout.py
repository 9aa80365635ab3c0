"""The MoE routing layout: where each (token, expert) pair of a router's top-k goes in the
grouped GEMMs' input, and the per-expert bookkeeping those GEMMs read, worked out on the
GPU by one CTA: no host sync, so a call can be captured in a CUDA graph and replayed with
other routing.

Input: topk_idx int64 [T, k], read flat: pair p = t * k + j names expert topk_idx[t, j]; a
pair naming no expert in [0, E) is dropped. Outputs, int32:

    rows [T * k]          the row pair p takes, -1 where it is dropped
    counts [E]            the pairs each expert received, dropped ones not counted
    contiguous layout:    expert e's segment starts at first_row[e], the sum of the segments
                          before it, each its count rounded up to 128 rows (the grouped GEMM's
                          tallest tile, ``sm90_gemm.CONTIGUOUS_ALIGNMENT``); an expert
                          without pairs takes no rows; its pairs take its rows in the order of p
      m_indices [m_rows]  each row's expert; -1 for a segment's padding and from rows_used on
      rows_used [1]       the end of the last segment
    masked layout:        the pair of rank r within expert e (in the order of p) takes row
                          e * rows_per_expert + r, and is dropped where r >= rows_per_expert;
                          counts is then the grouped GEMM's masked_m

One CTA of 32 warps: every pair's row depends on the counts of all the pairs before it,
which one CTA gathers with bar.sync and no grid-wide synchronisation, at the price of one
SM's issue rate (below). Warp w owns the w-th of 32 equal chunks of the pairs, each chunk a
whole number of batches of 32 pairs (one a lane). Phases, a bar.sync between them:

    1. count      each warp walks its chunk, loading the experts of 8 batches before it
                  works on the first (ptxas 13.0 keeps all 8 loads in flight here, and in
                  phase 3 issues 4 ahead and the rest between batches); per batch,
                  match.any.sync gives each lane the lanes naming its expert, and the lowest
                  of them adds their number to the warp's own histogram row hist[w][e]. The
                  add is a red.shared: no two lanes of a batch add to one counter, and a sum
                  needs no order among the batches, so no bar.warp.sync between them.
    2. offsets    thread e (one per expert) replaces the column hist[0..31][e] with its
                  exclusive prefix over the warps (the rank of warp w's first pair of e); the
                  column's sum is e's count. The first row of e's segment: an exclusive
                  scan over the experts of the aligned counts (warp scans, then the warps'
                  totals through shared memory), or e * rows_per_expert. counts and
                  rows_used are written here.
    3. place      each warp walks its chunk again: a pair's rank = hist[w][e] + the number
                  of lower lanes of its batch naming e (popc(match & lanemask_lt)), its row
                  first_row[e] + rank (masked: e * rows_per_expert + rank, dropped past
                  rows_per_expert); then the lowest of those lanes advances hist[w][e] past
                  the batch. bar.warp.sync orders the lanes' reads of the counter before its
                  advance, and the advance before the next batch.
    4. m_indices  (contiguous) 128-row blocks, 32 a warp at a time: lane l finds the expert
                  of the round's block l by a binary search of first_row (the last expert
                  whose segment starts at or before the block), then the warp writes the
                  round's blocks one by one, coalesced: a row gets its block's expert below
                  first_row[e] + counts[e], else -1 (a segment's padding, and every row from
                  rows_used on, where the search lands on the last segment or an empty one).
                  A search a block, not a row, and shared by the warp's lanes: the work does
                  not follow the segments, so one expert with every pair costs no more.

The ranks come from the order of p alone (chunks in warp order, batches in order, lanes in
order), never from the timing of atomics: the layout is the same run to run.

Shared memory (``MoeLayoutConfig.shared``: one plan for the launch and the offsets emitted):

    | hist: 32 warps x E x 4 B | first_row: P x 4 B | fill_end: E x 4 B | warp totals: 32 x 4 B |

first_row, fill_end (= first_row + count) and the warp totals only in the contiguous layout;
P is E rounded up to a power of two, first_row past E holding 0xFFFFFFFF so that the
search's steps need no bounds. 66 KiB at E = 512: dynamic shared memory.

Cost (predicted, not measured): about 1.3 warp instructions a pair in the two walks and 0.2
a row of m_indices (T * k + 127 E rows), issued by one SM's four schedulers; the reads of
topk_idx (8 B a pair, the second walk's from L2) and the writes (4 B a pair and a row) stay
under one SM's bandwidth. At E = 256 that is about 3 us at T * k = 512 (mostly m_indices'
33K rows) plus the launch, 9 us at 32768 and 30 us at 131072 (the masked layout 2, 7 and 25).

Compile-time: E and the layout. Run-time: the number of pairs, the pointers, rows_per_expert
(masked) and m_indices' length m_rows (contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..arch import Arch
from ..patterns import reduce
from ..ptx import KernelBuilder, LaunchShape, addr, sreg
from .gemm import CONTIGUOUS_ALIGNMENT

WARPS = 32
THREADS = 32 * WARPS
BATCH = 32                # pairs a warp takes at once, one a lane
LOADS_AHEAD = 8           # batches whose experts a warp loads before it works on the first
MAX_EXPERTS = THREADS     # phase 2 gives each expert a thread
LAYOUTS = ("contiguous", "masked")
DROPPED = 0xFFFFFFFF      # -1 as int32: a dropped pair's row, a padding row's expert
SEARCH_PAD = 0xFFFFFFFF   # first_row past the last expert: above every row


@dataclass(frozen=True)
class SharedPlan:
    """Byte offsets in the kernel's dynamic shared memory (None: not in this layout)."""

    hist: int
    first_row: int | None
    fill_end: int | None
    warp_totals: int | None
    total: int


@dataclass(frozen=True)
class MoeLayoutConfig:
    experts: int
    masked: bool
    griddepcontrol: bool  # the target has programmatic dependent launch's instructions
    target: str

    @property
    def name(self) -> str:
        return f"i64_moe_routing_layout_{LAYOUTS[self.masked]}_e{self.experts}"

    @property
    def search_size(self) -> int:
        """P: the experts rounded up to a power of two, the binary search's range."""
        return 1 << (self.experts - 1).bit_length()

    @property
    def shared(self) -> SharedPlan:
        hist = 4 * WARPS * self.experts
        if self.masked:
            return SharedPlan(0, None, None, None, hist)
        fill_end = hist + 4 * self.search_size
        warp_totals = fill_end + 4 * self.experts
        return SharedPlan(0, hist, fill_end, warp_totals, warp_totals + 4 * WARPS)


def choose_config(arch: Arch, experts: int, layout: str = "contiguous") -> MoeLayoutConfig:
    """Nothing to choose: one CTA of 32 warps, specialised on E and the layout; this checks
    that they exist and that the shared-memory plan fits."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {experts}")
    cfg = MoeLayoutConfig(experts, layout == "masked", arch.has("griddepcontrol"), arch.target)
    if cfg.shared.total > arch.max_shared_memory_per_block:
        raise ValueError(f"num_experts {experts}: the routing layout's {cfg.shared.total} bytes "
                         f"of shared memory exceed {arch.target}'s "
                         f"{arch.max_shared_memory_per_block} a CTA")
    return cfg


def generate(cfg: MoeLayoutConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS)
    k.launch = LaunchShape(block=THREADS, shared_bytes=cfg.shared.total)
    p = _Params(k, cfg)
    if cfg.griddepcontrol:
        with k.stage("programmatic launch: the next kernel on the stream may start"):
            # It is scheduled once this CTA has started; its griddepcontrol.wait still
            # waits for all of this grid. A no-op without a programmatic launch.
            k.griddepcontrol_launch_dependents()
    t = _thread_coordinates(k, cfg, p)
    _clear_histogram_rows(k, cfg, t)
    if cfg.griddepcontrol:
        with k.stage("wait for the kernel before this one"):
            # topk_idx may be its output, and our outputs memory it still reads.
            k.griddepcontrol_wait()
    walk = _Walk(k, cfg, p, t)
    with k.stage("1. count: each warp's pairs of each expert, in its histogram row"):
        walk(lambda batch: _count(k, cfg, t, batch))
    k.bar_sync(0)
    _offsets(k, cfg, p, t)
    k.bar_sync(0)
    with k.stage("3. place: each pair's row, from its warp's next rank of its expert"):
        walk(lambda batch: _place(k, cfg, p, t, batch))
    if not cfg.masked:
        _write_m_indices(k, cfg, p, t)
    return k


class _Params:
    """Kernel parameters (launches bind them by name); counts in registers."""

    def __init__(self, k: KernelBuilder, cfg: MoeLayoutConfig):
        self.topk_idx = k.param("topk_idx", "u64")
        self.pairs = k.reg("u32", "pairs")
        k.ld_param(self.pairs, k.param("pairs", "u32"))
        self.rows = k.param("rows", "u64")
        self.counts = k.param("counts", "u64")
        if cfg.masked:
            self.rows_per_expert = k.reg("u32", "rows_per_expert")
            k.ld_param(self.rows_per_expert, k.param("rows_per_expert", "u32"))
        else:
            self.m_indices = k.param("m_indices", "u64")
            self.m_rows = k.reg("u32", "m_rows")
            k.ld_param(self.m_rows, k.param("m_rows", "u32"))
            self.rows_used = k.param("rows_used", "u64")


def _thread_coordinates(k, cfg, p) -> SimpleNamespace:
    """The thread's lane and warp, its shared-memory word (thread e's expert slots in each
    array), its warp's histogram row, and its warp's chunk of pairs: [chunk_start,
    chunk_end), walked in ``trips`` steps of LOADS_AHEAD batches."""
    t = SimpleNamespace()
    with k.stage("thread coordinates; the warp's histogram row and chunk of pairs"):
        t.tid, t.lane, t.warp = k.reg("u32", "tid"), k.reg("u32", "lane"), k.reg("u32", "warp")
        k.mov(t.tid, sreg.tid.x)
        k.and_(t.lane, t.tid, 31)
        k.shr(t.warp, t.tid, 5)
        t.lanes_below = k.reg("u32", "lanes_below")
        k.mov(t.lanes_below, sreg.lanemask_lt)
        smem = k.dynamic_shared("smem", align=16)
        t.smem = k.reg("u32", "smem")
        k.mov(t.smem, smem)
        t.word = k.reg("u32", "thread_word")             # smem + 4 * tid
        k.mad(t.word, t.tid, 4, t.smem)
        t.hist_row = k.reg("u32", "hist_row")            # smem + 4 * E * warp (+ plan.hist)
        k.mad(t.hist_row, t.warp, 4 * cfg.experts, t.smem)
        # A chunk is ceil(pairs / 32) rounded up to whole batches.
        chunk = k.reg("u32", "chunk")
        k.add(chunk, p.pairs, WARPS * BATCH - 1)
        k.shr(chunk, chunk, (WARPS * BATCH).bit_length() - 1)
        k.mul(chunk, chunk, BATCH, mode="lo")
        t.chunk_start, t.chunk_end = k.reg("u32", "chunk_start"), k.reg("u32", "chunk_end")
        k.mul(t.chunk_start, t.warp, chunk, mode="lo")
        k.add(t.chunk_end, t.chunk_start, chunk)
        k.min(t.chunk_end, t.chunk_end, p.pairs)
        t.trips = k.reg("u32", "trips")
        k.add(t.trips, chunk, BATCH * LOADS_AHEAD - 1)
        k.shr(t.trips, t.trips, (BATCH * LOADS_AHEAD).bit_length() - 1)
    return t


def _clear_histogram_rows(k, cfg, t) -> None:
    with k.stage("each warp clears its own histogram row"):
        # Only the warp itself touches its row before phase 2's bar.sync: bar.warp.sync
        # orders the clearing before its adds.
        zero = k.reg("u32", "zero")
        k.mov(zero, 0)
        slot = k.reg("u32", "clear_slot")
        k.mad(slot, t.lane, 4, t.hist_row)
        for i in range(-(-cfg.experts // 32)):
            at = addr(slot, cfg.shared.hist + 4 * 32 * i)
            if 32 * (i + 1) <= cfg.experts:
                k.st(at, zero, space="shared")
                continue
            in_row = k.pred("slot_in_row")
            k.setp("lt", in_row, t.lane, cfg.experts - 32 * i)
            with k.guard(in_row):
                k.st(at, zero, space="shared")
        k.bar_warp_sync()


class _Walk:
    """The walk over the warp's chunk, LOADS_AHEAD batches a trip: their experts loaded
    first, then ``work(self)`` for each batch in order, with this object describing the
    batch: ``first`` (this lane's pair in the trip's first batch) and ``offset`` (pairs
    from there to its pair in this batch), ``in_range`` (that pair exists), ``expert`` (E
    where the pair does not exist or names no expert in [0, E)) and ``valid`` (it names
    one), and registers the work reuses from batch to batch. The trip count is the same in
    every warp: the match and the warp syncs in ``work`` see every lane."""

    def __init__(self, k: KernelBuilder, cfg, p, t):
        self.k, self.cfg, self.p, self.t = k, cfg, p, t
        self.trip, self.first = k.reg("u32", "trip"), k.reg("u32", "first_pair")
        self.src, self.pair = k.reg("u64", "topk_at"), k.reg("u32", "pair")
        self.in_range_each = k.regs("pred", LOADS_AHEAD, "in_range")
        self.index = k.regs("s64", LOADS_AHEAD, "topk")
        self.expert, self.valid = k.reg("u32", "expert"), k.pred("valid")
        self.same = k.reg("b32", "same_expert")     # the lanes naming this lane's expert
        self.below = k.reg("b32", "same_below")     # ... lower than this one
        self.rank, self.size = k.reg("u32", "rank"), k.reg("u32", "group_size")
        self.slot, self.base = k.reg("u32", "hist_slot"), k.reg("u32", "warp_rank")
        self.row, self.at = k.reg("u32", "row"), k.reg("u32", "first_row_slot")
        self.dst = k.reg("u64", "row_at")
        self.leader, self.kept = k.pred("leader"), k.pred("kept")

    def __call__(self, work) -> None:
        k, t = self.k, self.t
        with k.loop(self.trip, t.trips, uniform=True, hint="trip"):
            k.mad(self.first, self.trip, BATCH * LOADS_AHEAD, t.chunk_start)
            k.add(self.first, self.first, t.lane)
            k.ld_param(self.src, self.p.topk_idx)
            k.mad(self.src, self.first, 8, self.src, mode="wide")
            for b, (in_range, index) in enumerate(zip(self.in_range_each, self.index)):
                k.add(self.pair, self.first, BATCH * b)
                k.setp("lt", in_range, self.pair, t.chunk_end)
                k.mov(index, -1)
                with k.guard(in_range):
                    k.ld(index, addr(self.src, 8 * BATCH * b), nc=True)
            for b, (in_range, index) in enumerate(zip(self.in_range_each, self.index)):
                # Unsigned: a negative index is above every expert, dropped with the rest.
                k.setp("lo", self.valid, index, self.cfg.experts, type="u64")
                k.cvt(self.expert, index, dtype="u32", stype="s64")
                k.selp(self.expert, self.expert, self.cfg.experts, self.valid)
                self.offset, self.in_range = BATCH * b, in_range
                work(self)


def _group(k, t, b) -> None:
    """The lanes of batch ``b`` naming this lane's expert: b.same, b.rank (how many of them
    are below this lane), b.size, b.leader (the lowest of them, if it names an expert) and
    b.slot (the expert's counter in the warp's histogram row, at the plan's hist offset)."""
    k.match_any_sync(b.same, b.expert)
    k.and_(b.below, b.same, t.lanes_below)
    k.popc(b.rank, b.below)
    k.popc(b.size, b.same)
    k.setp("eq", b.leader, b.rank, 0)
    k.and_pred(b.leader, b.leader, b.valid)
    k.mad(b.slot, b.expert, 4, t.hist_row)


def _count(k, cfg, t, b) -> None:
    _group(k, t, b)
    with k.guard(b.leader):
        k.red(addr(b.slot, cfg.shared.hist), b.size, op="add", space="shared")


def _offsets(k, cfg, p, t) -> None:
    with k.stage("2. offsets: each expert's count, its warps' first ranks, its first row"):
        count = k.reg("u32", "count")
        k.mov(count, 0)
        if cfg.experts == THREADS:
            is_expert = None
            _scan_column(k, cfg, p, t, count)
        else:
            is_expert = k.pred("is_expert")
            k.setp("lt", is_expert, t.tid, cfg.experts)
            with k.if_(is_expert, "column_scanned"):
                _scan_column(k, cfg, p, t, count)
        if not cfg.masked:
            _segments(k, cfg, p, t, count, is_expert)


def _scan_column(k, cfg, p, t, count) -> None:
    """Thread e: column e of the histograms, 8 loads in flight; each entry becomes the
    pairs of e in the warps before its own, and ``count`` sums them (at most rows_per_expert
    in the masked layout, which drops the pairs ranked past it). Writes counts[e]."""
    column = k.regs("u32", 8, "column")
    row_bytes = 4 * cfg.experts
    for w0 in range(0, WARPS, len(column)):
        for i, v in enumerate(column):
            k.ld(v, addr(t.word, cfg.shared.hist + (w0 + i) * row_bytes), space="shared")
        for i, v in enumerate(column):
            k.st(addr(t.word, cfg.shared.hist + (w0 + i) * row_bytes), count, space="shared")
            k.add(count, count, v)
    if cfg.masked:
        k.min(count, count, p.rows_per_expert)
    counts = k.reg("u64", "counts_at")
    k.ld_param(counts, p.counts)
    k.mad(counts, t.tid, 4, counts, mode="wide")
    k.st(addr(counts), count)


def _segments(k, cfg, p, t, count, is_expert) -> None:
    """first_row[e]: the exclusive scan over the experts of their counts rounded up to the
    alignment (a warp scan, then each warp scans the 32 warps' totals itself); fill_end[e] =
    first_row[e] + count; rows_used, the sum, from thread 0."""
    plan = cfg.shared
    aligned, scanned = k.reg("u32", "aligned"), k.reg("u32", "scanned")
    k.add(aligned, count, CONTIGUOUS_ALIGNMENT - 1)
    k.and_(aligned, aligned, ~(CONTIGUOUS_ALIGNMENT - 1) & 0xFFFFFFFF)
    k.mov(scanned, aligned)
    shuffled, has_giver = k.reg("u32", "shuffled"), k.pred("has_giver")
    reduce.inclusive_sum(k, scanned, t.lane, shuffled, has_giver)
    last_lane = k.pred("last_lane")
    k.setp("eq", last_lane, t.lane, 31)
    warp_word = k.reg("u32", "warp_word")
    k.mad(warp_word, t.warp, 4, t.smem)
    with k.guard(last_lane):
        k.st(addr(warp_word, plan.warp_totals), scanned, space="shared")
    k.bar_sync(0)
    total, before = k.reg("u32", "warp_total"), k.reg("u32", "warps_before")
    lane_word = k.reg("u32", "lane_word")
    k.mad(lane_word, t.lane, 4, t.smem)
    k.ld(total, addr(lane_word, plan.warp_totals), space="shared")
    k.mov(before, total)
    reduce.inclusive_sum(k, before, t.lane, shuffled, has_giver)
    rows_used = k.reg("u32", "rows_used")
    k.shfl_sync(rows_used, before, 31, mode="idx")
    k.sub(before, before, total)                      # exclusive: the warps below lane
    k.shfl_sync(before, before, t.warp, mode="idx")   # ... below this warp
    first_row = k.reg("u32", "first_row")
    k.add(first_row, before, scanned)
    k.sub(first_row, first_row, aligned)
    if is_expert is not None:
        k.selp(first_row, first_row, SEARCH_PAD, is_expert)
        in_search = k.pred("in_search")
        k.setp("lt", in_search, t.tid, cfg.search_size)
        with k.guard(in_search):
            k.st(addr(t.word, plan.first_row), first_row, space="shared")
        k.add(first_row, first_row, count)
        with k.guard(is_expert):
            k.st(addr(t.word, plan.fill_end), first_row, space="shared")
    else:
        k.st(addr(t.word, plan.first_row), first_row, space="shared")
        k.add(first_row, first_row, count)
        k.st(addr(t.word, plan.fill_end), first_row, space="shared")
    first_thread = k.pred("first_thread")
    k.setp("eq", first_thread, t.tid, 0)
    out = k.reg("u64", "rows_used_at")
    k.ld_param(out, p.rows_used)
    with k.guard(first_thread):
        k.st(addr(out), rows_used)


def _place(k, cfg, p, t, b) -> None:
    _group(k, t, b)
    with k.guard(b.valid):
        k.ld(b.base, addr(b.slot, cfg.shared.hist), space="shared")  # one word for the group
    k.add(b.rank, b.rank, b.base)
    if cfg.masked:
        k.mad(b.row, b.expert, p.rows_per_expert, b.rank)
        k.setp("lt", b.kept, b.rank, p.rows_per_expert)
        k.and_pred(b.kept, b.kept, b.valid)
        kept = b.kept
    else:
        k.mad(b.at, b.expert, 4, t.smem)
        with k.guard(b.valid):
            k.ld(b.row, addr(b.at, cfg.shared.first_row), space="shared")
        k.add(b.row, b.row, b.rank)
        kept = b.valid
    k.selp(b.row, b.row, DROPPED, kept)
    if b.offset == 0:  # once a trip: this lane's row in the trip's first batch
        k.ld_param(b.dst, p.rows)
        k.mad(b.dst, b.first, 4, b.dst, mode="wide")
    with k.guard(b.in_range):
        k.st(addr(b.dst, 4 * b.offset), b.row)
    k.bar_warp_sync()                                  # every lane has read the counter
    k.add(b.base, b.base, b.size)
    with k.guard(b.leader):
        k.st(addr(b.slot, cfg.shared.hist), b.base, space="shared")
    k.bar_warp_sync()                                  # the next batch reads the advance


def _write_m_indices(k, cfg, p, t) -> None:
    plan, block_rows = cfg.shared, CONTIGUOUS_ALIGNMENT
    with k.stage("4. m_indices: 32 blocks a warp at a time, each lane finding one's expert"):
        blocks, round_block = k.reg("u32", "blocks"), k.reg("u32", "round_block")
        k.add(blocks, p.m_rows, block_rows - 1)
        k.shr(blocks, blocks, block_rows.bit_length() - 1)
        warp_block = k.reg("u32", "warp_block")
        k.mul(warp_block, t.warp, 32, mode="lo")
        lane_expert, lane_fill_end = k.reg("u32", "lane_expert"), k.reg("u32", "lane_fill_end")
        lane_row, candidate = k.reg("u32", "lane_block_row"), k.reg("u32", "candidate")
        start, at, found = k.reg("u32", "segment_start"), k.reg("u32", "search_at"), k.pred("found")
        in_round, j = k.reg("u32", "in_round"), k.reg("u32", "j")
        expert, fill_end = k.reg("u32", "block_expert"), k.reg("u32", "block_fill_end")
        row, m_index, m_at = k.reg("u32", "m_row"), k.reg("u32", "m_index"), k.reg("u64", "m_at")
        below_fill, exists = k.pred("below_fill"), k.pred("row_exists")
        with k.loop(round_block, blocks, start=warp_block, step=THREADS, uniform=True,
                    hint="round"):
            # The last expert whose segment starts at or before the lane's block: first_row
            # never decreases, and past E it is above every row.
            k.add(lane_row, round_block, t.lane)
            k.shl(lane_row, lane_row, block_rows.bit_length() - 1)
            k.mov(lane_expert, 0)
            step = cfg.search_size // 2
            while step:
                k.add(candidate, lane_expert, step)
                k.mad(at, candidate, 4, t.smem)
                k.ld(start, addr(at, plan.first_row), space="shared")
                k.setp("ls", found, start, lane_row)
                k.selp(lane_expert, candidate, lane_expert, found)
                step //= 2
            k.mad(at, lane_expert, 4, t.smem)
            k.ld(lane_fill_end, addr(at, plan.fill_end), space="shared")
            k.sub(in_round, blocks, round_block)
            k.min(in_round, in_round, 32)
            with k.loop(j, in_round, uniform=True, hint="block"):
                k.shfl_sync(expert, lane_expert, j, mode="idx")
                k.shfl_sync(fill_end, lane_fill_end, j, mode="idx")
                k.add(row, round_block, j)
                k.mad(row, row, block_rows, t.lane)
                k.ld_param(m_at, p.m_indices)
                k.mad(m_at, row, 4, m_at, mode="wide")
                for i in range(block_rows // 32):
                    if i:
                        k.add(row, row, 32)
                    k.setp("lt", below_fill, row, fill_end)
                    k.selp(m_index, expert, DROPPED, below_fill)
                    k.setp("lt", exists, row, p.m_rows)
                    with k.guard(exists):
                        k.st(addr(m_at, 4 * 32 * i), m_index)
