"""Intranode dispatch: every rank sends each of its tokens to the ranks holding one of its
experts, through rings in the receivers' buffers (plan.py), and each rank copies what it
receives into its outputs, grouped by source rank in token order.

The bytes move by bulk copies through shared memory (the copy engine of each SM, TMA),
so an SM keeps tens of entries in flight without holding them in registers; one warp a
CTA issues them. Roles (common.py: CTA 2c sends on channel c, CTA 2c + 1 receives on it):

    sender       the channel's tokens [begin, end) of this rank (plan.channel_bounds), in
                 token order, each token once however many ranks it goes to:
                   load   the row (cp.async.bulk global -> shared, on the stage's mbarrier),
                          its FP8 scales and top-k (cp.async, lanes), into one of ``stages``
                          shared-memory entries laid out as a ring slot;
                   store  lane d, for each rank d the token goes to: wait for room in ring
                          (c, this rank) at d (head + slots > tail), then one bulk store
                          of the slot (shared -> d's buffer over NVLink), and the slot's
                          last 16 bytes (source token, signature, entry number) by st.v4;
                 loads run up to half the stages ahead of the stores, and a lane's
                 stores still reading their stages take the other half. Every PUBLISH tokens
                 lane d waits until its bulk stores older than the last PUBLISH tokens have
                 completed (cp.async.bulk.wait_group) and publishes the tail they reach
                 with st.release.sys; the rest at the end.
    receiver     lane s keeps source s's ring: its count and first row from recv_layout
                 (the host's exchange), the entries taken, arrived, consumed. The lanes
                 whose source has arrived entries each load one (a bulk copy of the whole
                 slot, ring -> shared) into the next free stages, oldest stage first;
                 then the warp empties the oldest stage: signature and number checked,
                 source token, scales and top-k (local indices) stored by lanes, the row
                 by one bulk store into recv_x; the source's lane frees the slot (head,
                 st.release.sys) every PUBLISH entries and whenever the warp runs out of
                 work, then polls every tail it still waits for (ld.acquire.sys).

Counters run on from launch to launch (plan.py): a sender starts from the tail it left in
the receiver's buffer, a receiver from the head it left in its own; both read them with
ld.relaxed.sys, as only they write them. The host's exchange makes both ends agree on
how many entries each ring carries per launch, so they stay equal.

Memory orders. A sender's lane d orders its slot's bytes before the tail it publishes:
the bulk stores by waiting for their completion (wait_group, not .read, in the lane that
issued them), the st.v4 by program order, then its own st.release.sys. A receiver's lane
acquires the tail (ld.acquire.sys), then a proxy fence (fence.proxy.async.global) orders
the bulk loads it issues next after what it acquired. A slot is freed once its bulk load
has landed (the stage's mbarrier), so the head's release comes after the read. Shared
memory: a stage's mbarrier carries the load's bytes and the cp.async arrivals; a fence
(fence.proxy.async.shared::cta) before a stage's bulk store orders the lanes' cp.async
writes for the copy engine; a stage is refilled only after the bulk stores that read it
have read it (wait_group.read).

Cache hints: the payload in a ring is written by another GPU while the kernel runs, so
it is read only by the bulk copy, after the acquire and proxy fence; inputs nothing
writes meanwhile (x, scales, top-k, is_token_in_rank, recv_layout, peers) are read with
cp.async or ``ld.global.nc``.

Each wait is timed (patterns/poll.py): past ``timeout_ns`` the thread writes a record
(what it waited for, channel, peer, the counter seen) to mapped host memory and traps.

Compile-time: ranks, hidden size, bf16 or e4m3 rows, k (whether top-k travels), channels,
ring slots, stages. Run-time: T, this rank, E / R, the pointers and strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns.pipeline import BARRIER_BYTES, wait_parity
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from . import common
from .plan import BATCH, MAX_TOPK, SCALE_GROUP, DispatchSlot, signature

THREADS = 32          # one warp a CTA issues every copy
MAX_STAGES = 32       # shared-memory entries a CTA cycles through
PUBLISH = 16          # tokens (sender) or entries (receiver) between publications
STAGE_INFO = 3        # u32 words a stage's bookkeeping takes: token or row, mask or entry, source


@dataclass(frozen=True)
class DispatchConfig(common.RingConfig):
    fp8: bool
    topk: int
    with_topk: bool      # top-k indices and weights travel with the rows
    stages: int          # slots of shared memory a CTA holds in flight

    @property
    def name(self) -> str:
        return (f"ep_intranode_dispatch_r{self.ranks}_h{self.hidden}_"
                f"{'e4m3' if self.fp8 else 'bf16'}_k{self.topk if self.with_topk else 0}_"
                f"c{self.channels}_s{self.slots}_st{self.stages}")

    @property
    def slot(self) -> DispatchSlot:
        return DispatchSlot(self.hidden, self.topk if self.with_topk else 0, self.fp8)

    @property
    def threads(self) -> int:
        return THREADS

    @property
    def shared_bytes(self) -> int:
        """The stages (dynamic shared memory): one ring slot each."""
        return self.stages * self.slot.bytes

    @property
    def signature(self) -> int:
        """What every entry carries: the sizes its rings were laid out for."""
        return signature("dispatch", self.hidden, self.slot.topk, self.fp8, self.channels,
                         self.slots)


def stores_in_flight(stages: int) -> int:
    """Bulk stores a lane leaves reading their stages before it loads into another: half
    the stages (the other half hold loads in flight). A store reads its stage as its
    bytes leave, so one store at a time would pace the warp by one round trip."""
    return (stages - 1) // 2


def stages_for(arch: Arch, slot: DispatchSlot) -> int:
    """The stages a CTA's shared memory holds (up to MAX_STAGES), besides the barriers and
    bookkeeping; at least 2, else the row is too wide for the pipeline."""
    static = MAX_STAGES * (BARRIER_BYTES + 4 * STAGE_INFO)
    stages = min(MAX_STAGES, (arch.max_shared_memory_per_block - static) // slot.bytes)
    if stages < 2:
        raise ValueError(f"hidden size {slot.hidden} ({'e4m3' if slot.fp8 else 'bf16'}) needs "
                         f"{2 * slot.bytes} bytes of shared memory for two ring slots; the "
                         f"device has {arch.max_shared_memory_per_block} a CTA")
    return stages


def check_hidden(hidden: int, fp8: bool) -> None:
    """The row sizes the kernel takes, checked apart from a device."""
    multiple = SCALE_GROUP if fp8 else 8
    if hidden <= 0 or hidden % multiple:
        raise ValueError(f"hidden size (x.shape[1]) must be a positive multiple of {multiple} "
                         f"for {'e4m3' if fp8 else 'bf16'} rows, got {hidden}")


def check_topk(topk: int) -> None:
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_idx must have 1 to {MAX_TOPK} columns, got {topk}")


def choose_config(arch: Arch, ranks: int, hidden: int, topk: int, *, fp8: bool,
                  with_topk: bool = True, num_sms: int = 20, slots: int = 128,
                  stages: int | None = None) -> DispatchConfig:
    """Channels: half the SM budget; stages: as many as shared memory holds (or
    ``stages``, at least 2)."""
    check_hidden(hidden, fp8)
    check_topk(topk)
    channels = common.channels_for(arch, ranks, num_sms, slots, "dispatch")
    arch.require("tma", "the dispatch kernel (bulk copies)")
    slot = DispatchSlot(hidden, topk if with_topk else 0, fp8)
    most = stages_for(arch, slot)
    if stages is not None and not 2 <= stages <= most:
        raise ValueError(f"stages must be 2 to {most} for this row size, got {stages}")
    return DispatchConfig(ranks=ranks, hidden=hidden, channels=channels, slots=slots,
                          warps_per_peer=1, target=arch.target, fp8=fp8, topk=topk,
                          with_topk=with_topk, stages=stages or most)


def generate(cfg: DispatchConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads, min_blocks_per_sm=1)
    k.launch = LaunchShape(block=cfg.threads, shared_bytes=cfg.shared_bytes, cooperative=True)
    p = _Params(k, cfg)
    t = common.prologue(k, 1)
    common.scalars(k, t, p)
    t.stages = _stages(k, cfg, t)
    with k.if_(t.sender, "not_a_sender", uniform=True):
        _send(k, cfg, p, t)
    with k.if_(~t.sender, "not_a_receiver", uniform=True):
        _receive(k, cfg, p, t)
    return k


class _Params:
    """Kernel parameters (launches bind them by name)."""

    def __init__(self, k: KernelBuilder, cfg: DispatchConfig):
        self.x = k.param("x", "u64")                            # bf16 or e4m3 [T, H]
        if cfg.fp8:
            self.x_scales = k.param("x_scales", "u64")          # f32 [T, H / 128], strided
            self.scale_token_stride = k.param("scale_token_stride", "u32")  # elements
            self.scale_group_stride = k.param("scale_group_stride", "u32")
        if cfg.with_topk:
            self.topk_idx = k.param("topk_idx", "u64")          # int64 [T, k]
            self.topk_weights = k.param("topk_weights", "u64")  # f32 [T, k]
            self.experts_per_rank = k.param("experts_per_rank", "u32")
        self.is_token_in_rank = k.param("is_token_in_rank", "u64")  # bool [T, ranks]
        self.tokens = k.param("tokens", "u32")
        common.declare_common_params(k, self)
        self.recv_x = k.param("recv_x", "u64")                  # [N, H], contiguous
        if cfg.fp8:
            self.recv_scales = k.param("recv_scales", "u64")    # f32 [N, H / 128], contiguous
        if cfg.with_topk:
            self.recv_topk_idx = k.param("recv_topk_idx", "u64")          # int64 [N, k]
            self.recv_topk_weights = k.param("recv_topk_weights", "u64")  # f32 [N, k]
        self.recv_src_idx = k.param("recv_src_idx", "u64")      # int32 [N]


def _stages(k: KernelBuilder, cfg: DispatchConfig, t) -> SimpleNamespace:
    """The stages (dynamic shared memory, a ring slot each), their mbarriers and
    bookkeeping words (static), the barriers initialised by lane 0. A sender's barrier
    also counts the lanes' cp.async arrivals (``.noinc``)."""
    st = SimpleNamespace()
    data = k.dynamic_shared("stages", align=128)
    bars = k.shared("stage_bars", cfg.stages * BARRIER_BYTES, align=8)
    info = k.shared("stage_info", cfg.stages * 4 * STAGE_INFO, align=4)
    st.data, st.bars, st.info = (k.reg("u32", n) for n in ("stages", "stage_bars", "stage_info"))
    k.mov(st.data, data)
    k.mov(st.bars, bars)
    k.mov(st.info, info)
    st.lane_copies = cfg.fp8 or cfg.with_topk
    arrivals = k.reg("u32", "stage_arrivals")
    k.selp(arrivals, 1 + THREADS if st.lane_copies else 1, 1, t.sender)
    with k.stage("stage barriers: one arrival (the load's bytes), and the lanes' cp.async"):
        with k.if_(t.lane0, "not_initialising"):
            for s in range(cfg.stages):
                k.mbarrier_init(addr(st.bars, s * BARRIER_BYTES), arrivals)
            k.fence_mbarrier_init()
        k.fence_proxy_async()
        k.bar_warp_sync()
    return st


def _stage_at(k, st, stage, slot_bytes: int, hint: str):
    """(data, barrier, info) shared addresses of stage ``stage``."""
    data, bar, info = (k.reg("u32", f"{hint}_{n}") for n in ("data", "bar", "info"))
    k.mad(data, stage, slot_bytes, st.data)
    k.mad(bar, stage, BARRIER_BYTES, st.bars)
    k.mad(info, stage, 4 * STAGE_INFO, st.info)
    return data, bar, info


def _advance(k, stage, phase, stages: int) -> None:
    wrapped = k.pred("stage_wrapped")
    k.add(stage, stage, 1)
    k.setp("ge", wrapped, stage, stages)
    with k.guard(wrapped):
        k.mov(stage, 0)
    if phase is not None:
        with k.guard(wrapped):
            k.xor(phase, phase, 1)


# ---------------------------------------------------------------------------- sender
def _send(k, cfg, p, t) -> None:
    s = SimpleNamespace()
    slot = cfg.slot
    with k.stage("sender: lane d keeps ring (channel, this rank) at rank d"):
        tokens = k.reg("u32", "tokens")
        k.ld_param(tokens, p.tokens)
        s.begin, s.end = common.channel_tokens(k, tokens, t.channel, cfg.channels)
        s.dest = k.pred("is_destination")
        k.setp("lt", s.dest, t.lane, cfg.ranks)
        peer_buffer = k.reg("u64", "peer_buffer")
        k.mov(peer_buffer, 0)
        with k.guard(s.dest):
            k.mad(peer_buffer, t.lane, 8, t.peers, mode="wide")
        with k.guard(s.dest):
            k.ld(peer_buffer, addr(peer_buffer), nc=True)
        s.ring = common.ring(k, peer_buffer, cfg.plan.dispatch_rings,
                             cfg.plan.dispatch_ring_bytes(slot), t.channel, t.rank, cfg.ranks)
        s.tail_at = common.counter(k, peer_buffer, cfg.plan, "dispatch_tail", t.channel, t.rank)
        s.head_at = common.counter(k, peer_buffer, cfg.plan, "dispatch_head", t.channel, t.rank)
        s.tail, s.head, s.published = (k.reg("u32", n) for n in ("tail", "head", "published"))
        k.mov(s.tail, 0)
        k.mov(s.head, 0)
        with k.guard(s.dest):
            k.ld(s.tail, addr(s.tail_at), sem="relaxed", scope="sys")
        with k.guard(s.dest):
            k.ld(s.head, addr(s.head_at), sem="acquire", scope="sys")
        k.mov(s.published, s.tail)
        s.in_rank = k.reg("u64", "in_rank")
        k.ld_param(s.in_rank, p.is_token_in_rank)
    c = SimpleNamespace(**{n: k.reg("u32", n) for n in (
        "produced", "consumed", "load_stage", "store_stage", "store_phase", "next_batch",
        "batch_first", "pending", "mask")})
    for name in ("produced", "consumed", "load_stage", "store_stage", "store_phase", "pending",
                 "mask"):
        k.mov(getattr(c, name), 0)
    k.mov(c.next_batch, s.begin)
    top, done = k.label("send"), k.label("send_end")
    more, ahead, full, has = (k.pred(n) for n in ("more_tokens", "loads_ahead", "pipe_full",
                                                  "loaded"))
    in_flight = k.reg("u32", "in_flight")
    k.place(top)
    with k.stage("the next batch of 32 tokens with a destination, once these are sent"):
        refill = k.label("refill")
        k.place(refill)
        k.setp("eq", more, c.pending, 0)
        k.setp("lt", ahead, c.next_batch, s.end)
        k.and_pred(more, more, ahead)
        with k.if_(more, "no_refill", uniform=True):
            _next_batch(k, cfg, t, s, c)
            k.bra(refill, uniform=True)
    with k.stage("load: the next token into a free stage while fewer than half wait"):
        k.sub(in_flight, c.produced, c.consumed)
        k.setp("lt", full, in_flight, cfg.stages - 1 - stores_in_flight(cfg.stages))
        k.setp("ne", more, c.pending, 0)
        k.and_pred(more, more, full)
        with k.if_(more, "no_load", uniform=True):
            _load_token(k, cfg, p, t, c)
            k.bra(top, uniform=True)
    with k.stage("store: the oldest loaded token to every rank it goes to"):
        k.setp("lt", has, c.consumed, c.produced)
        with k.if_(has, "no_store", uniform=True):
            _store_token(k, cfg, t, s, c)
            k.bra(top, uniform=True)
    k.place(done)
    with k.stage("the end: every store complete, then the final tails"):
        with k.if_(s.dest, "not_publishing"):
            k.cp_async_bulk_wait_group(0)
            k.st(addr(s.tail_at), s.tail, sem="release", scope="sys")


def _next_batch(k, cfg, t, s, c) -> None:
    """Lane i: the ranks token next_batch + i goes to (a bit each, ``mask``); ``pending``:
    the ballot of the tokens that go anywhere."""
    token, flag, at = k.reg("u32", "lane_token"), k.reg("u32", "flag"), k.reg("u64", "flag_at")
    in_batch, goes = k.pred("in_batch"), k.pred("goes")
    k.add(token, c.next_batch, t.lane)
    k.setp("lt", in_batch, token, s.end)
    k.mov(c.mask, 0)
    k.mul(at, token, cfg.ranks, mode="wide")
    k.add(at, at, s.in_rank)
    for d in range(cfg.ranks):
        k.mov(flag, 0)
        with k.guard(in_batch):
            k.ld(flag, addr(at, d), nc=True, type="u8")
        k.setp("ne", goes, flag, 0)
        with k.guard(goes):
            k.or_(c.mask, c.mask, 1 << d)
    k.setp("ne", goes, c.mask, 0)
    k.vote_sync(c.pending, goes, mode="ballot")
    k.mov(c.batch_first, c.next_batch)
    k.add(c.next_batch, c.next_batch, BATCH)


def _load_token(k, cfg, p, t, c) -> None:
    """The first pending token: its ranks (shuffled from its lane) and index into the
    stage's bookkeeping; scales and top-k by the lanes' cp.async, the row by lane 0's bulk
    copy, all completing on the stage's mbarrier."""
    slot = cfg.slot
    low, lane, token, mask = (k.reg("u32", n) for n in ("lowest", "token_lane", "token",
                                                        "token_mask"))
    k.neg(low, c.pending, type="s32")
    k.and_(low, low, c.pending)
    k.bfind(lane, low)
    k.xor(c.pending, c.pending, low)
    k.add(token, c.batch_first, lane)
    k.shfl_sync(mask, c.mask, lane, mode="idx")
    data, bar, info = _stage_at(k, t.stages, c.load_stage, slot.bytes, "load")
    with k.if_(t.lane0, "not_recording"):
        k.st(addr(info), token, space="shared")
        k.st(addr(info, 4), mask, space="shared")
    if cfg.fp8:
        _copy_scales(k, cfg, p, t, token, data)
    if cfg.with_topk:
        _copy_topk(k, cfg, p, t, token, data)
    if t.stages.lane_copies:
        k.cp_async_mbarrier_arrive(addr(bar))
    with k.if_(t.lane0, "not_loading"):
        src = k.reg("u64", "x_row")
        k.ld_param(src, p.x)
        k.mad(src, token, slot.row_bytes, src, mode="wide")
        k.mbarrier_arrive_expect_tx(addr(bar), slot.row_bytes)
        k.cp_async_bulk_load(addr(data), addr(src), slot.row_bytes, addr(bar))
    k.add(c.produced, c.produced, 1)
    _advance(k, c.load_stage, None, cfg.stages)


def _copy_scales(k, cfg, p, t, token, data) -> None:
    """Lane j copies scales j, j + 32, ... (x_scales[token, j] at token *
    scale_token_stride + j * scale_group_stride elements) into the stage."""
    slot = cfg.slot
    token_stride, group_stride = k.reg("u32", "scale_token_stride"), k.reg(
        "u32", "scale_group_stride")
    k.ld_param(token_stride, p.scale_token_stride)
    k.ld_param(group_stride, p.scale_group_stride)
    src, offset, base = k.reg("u64", "scale_at"), k.reg("u64", "scale_offset"), k.reg(
        "u64", "x_scales")
    k.ld_param(base, p.x_scales)
    group, dst = k.reg("u32", "scale_group"), k.reg("u32", "scale_dst")
    in_row = k.pred("scale_in_row")
    for trip in range(-(-slot.scale_groups // 32)):
        k.add(group, t.lane, 32 * trip)
        k.setp("lt", in_row, group, slot.scale_groups)
        k.mul(offset, token, token_stride, mode="wide")
        k.mad(offset, group, group_stride, offset, mode="wide")
        k.mad(src, offset, 4, base)
        k.mad(dst, group, 4, data)
        with k.guard(in_row):
            k.cp_async(addr(dst, slot.scales), addr(src), 4)


def _copy_topk(k, cfg, p, t, token, data) -> None:
    """Lane j < k copies the token's index j (int64) and weight j (f32) into the stage."""
    slot = cfg.slot
    is_pair = k.pred("is_pair")
    k.setp("lt", is_pair, t.lane, cfg.topk)
    pair, src, dst = k.reg("u32", "pair"), k.reg("u64", "pair_at"), k.reg("u32", "pair_dst")
    k.mad(pair, token, cfg.topk, t.lane)
    k.ld_param(src, p.topk_idx)
    k.mad(src, pair, 8, src, mode="wide")
    k.mad(dst, t.lane, 8, data)
    with k.guard(is_pair):
        k.cp_async(addr(dst, slot.topk_idx), addr(src), 8)
    k.ld_param(src, p.topk_weights)
    k.mad(src, pair, 4, src, mode="wide")
    k.mad(dst, t.lane, 4, data)
    with k.guard(is_pair):
        k.cp_async(addr(dst, slot.topk_weights), addr(src), 4)


def _store_token(k, cfg, t, s, c) -> None:
    """The oldest loaded stage to each of its token's ranks (lane d: rank d), one bulk
    group a lane a token; then the stage of the token before is free, and every PUBLISH
    tokens the tails reached PUBLISH tokens ago are published."""
    slot = cfg.slot
    data, bar, info = _stage_at(k, t.stages, c.store_stage, slot.bytes, "store")
    wait_parity(k, addr(bar), c.store_phase, "wait_loaded", uniform=True)
    k.fence_proxy_async()  # the lanes' cp.async writes, before the copy engine reads them
    token, mask, bit = k.reg("u32", "stored_token"), k.reg("u32", "stored_mask"), k.reg(
        "u32", "rank_bit")
    k.ld(token, addr(info), space="shared")
    k.ld(mask, addr(info, 4), space="shared")
    k.bfe(bit, mask, t.lane, 1, type="u32")
    goes = k.pred("goes_here")
    k.setp("ne", goes, bit, 0)
    k.and_pred(goes, goes, s.dest)
    with k.if_(goes, "not_this_rank"):
        used, dst, slot_index = k.reg("u32", "used"), k.reg("u64", "entry_at"), k.reg(
            "u32", "slot_index")
        fits = k.pred("fits")
        k.sub(used, s.tail, s.head)
        k.setp("lt", fits, used, cfg.slots)
        with k.if_(~fits, "room"):
            def room(seen):
                k.sub(used, s.tail, seen)
                k.setp("lt", fits, used, cfg.slots)
                return fits

            t.watchdog.wait(s.head, addr(s.head_at), room, code=common.DISPATCH_SEND,
                            channel=t.channel, peer=t.lane)
        k.and_(slot_index, s.tail, cfg.slots - 1)
        k.mad(dst, slot_index, slot.bytes, s.ring, mode="wide")
        k.cp_async_bulk_store(addr(dst), addr(data), slot.source)
        words = k.regs("b32", 4, "entry_tail")
        for word, value in zip(words, (token, cfg.signature, s.tail, 0)):
            k.mov(word, value, type="b32")
        k.st(addr(dst, slot.source), words, **common.STORE)
        k.add(s.tail, s.tail, 1)
    with k.if_(s.dest, "not_committing"):
        k.cp_async_bulk_commit_group()
        k.cp_async_bulk_wait_group(stores_in_flight(cfg.stages), read=True)
    k.bar_warp_sync()  # the stages the waits freed, before any lane refills one
    k.add(c.consumed, c.consumed, 1)
    _advance(k, c.store_stage, c.store_phase, cfg.stages)
    checkpoint, lag = k.reg("u32", "checkpoint"), k.pred("publish")
    k.and_(checkpoint, c.consumed, PUBLISH - 1)
    k.setp("eq", lag, checkpoint, 0)
    k.and_pred(lag, lag, s.dest)
    with k.if_(lag, "not_publishing_yet"):
        k.cp_async_bulk_wait_group(PUBLISH)
        k.st(addr(s.tail_at), s.published, sem="release", scope="sys")
        k.mov(s.published, s.tail)


# ---------------------------------------------------------------------------- receiver
def _receive(k, cfg, p, t) -> None:
    r = SimpleNamespace()
    slot = cfg.slot
    with k.stage("receiver: lane s keeps this rank's ring (channel, s)"):
        r.source = k.pred("is_source")
        k.setp("lt", r.source, t.lane, cfg.ranks)
        r.total, r.first = k.reg("u32", "recv_count"), k.reg("u32", "recv_first")
        k.mov(r.total, 0)
        k.mov(r.first, 0)
        with k.if_(r.source, "not_a_source"):
            total, first = common.recv_entry(k, p, t.lane, t.channel, cfg.channels, cfg.ranks)
            k.mov(r.total, total)
            k.mov(r.first, first)
        own = k.reg("u64", "own_buffer")
        common.buffer_of(k, own, t.peers, t.rank)
        r.ring = common.ring(k, own, cfg.plan.dispatch_rings,
                             cfg.plan.dispatch_ring_bytes(slot), t.channel, t.lane, cfg.ranks)
        r.tail_at = common.counter(k, own, cfg.plan, "dispatch_tail", t.channel, t.lane)
        r.head_at = common.counter(k, own, cfg.plan, "dispatch_head", t.channel, t.lane)
        r.base = k.reg("u32", "base")  # entries read since the buffer's creation
        k.mov(r.base, 0)
        with k.guard(r.source):
            k.ld(r.base, addr(r.head_at), sem="relaxed", scope="sys")
        for name in ("taken", "arrived", "freed", "published"):
            setattr(r, name, k.reg("u32", name))
            k.mov(getattr(r, name), 0)
        r.everything = k.reg("u32", "all_entries")
        k.redux_sync(r.everything, r.total, op="add", type="u32")
        if cfg.with_topk:
            r.first_expert = k.reg("u64", "first_expert")  # rank * E / R
            per_rank = k.reg("u32", "experts_per_rank")
            k.ld_param(per_rank, p.experts_per_rank)
            k.mul(r.first_expert, t.rank, per_rank, mode="wide")
            r.experts_per_rank = k.reg("u64", "experts_per_rank_wide")
            k.cvt(r.experts_per_rank, per_rank, dtype="u64", stype="u32")
    c = SimpleNamespace(**{n: k.reg("u32", n) for n in (
        "produced", "consumed", "load_stage", "store_stage", "store_phase")})
    for name in vars(c):
        k.mov(getattr(c, name), 0)
    top, done = k.label("receive"), k.label("receive_end")
    finished, has = k.pred("all_received"), k.pred("loaded")
    k.place(top)
    k.setp("ge", finished, c.consumed, r.everything)
    with k.guard(finished):
        k.bra(done, uniform=True)
    with k.stage("load: each lane with an arrived entry takes the next free stage"):
        _load_entries(k, cfg, t, r, c)
    with k.stage("store: the oldest loaded stage into the outputs"):
        k.setp("lt", has, c.consumed, c.produced)
        with k.if_(has, "nothing_loaded", uniform=True):
            _store_entry(k, cfg, p, t, r, c)
            k.bra(top, uniform=True)
    with k.stage("out of work: free what was read, wait for any tail to move"):
        _wait_for_entries(k, cfg, t, r)
        k.bra(top, uniform=True)
    k.place(done)
    with k.stage("the end: the row stores complete, the last heads freed"):
        with k.if_(t.lane0, "not_draining"):
            k.cp_async_bulk_wait_group(0)
        _free(k, r, every=True)


def _load_entries(k, cfg, t, r, c) -> None:
    """Passes over the sources, an entry a lane whose source has one arrived, until the
    stages are full or nothing more has arrived: the loads in flight are what the
    pipeline hides the ring's latency with."""
    slot = cfg.slot
    want, mine, again = k.pred("want"), k.pred("mine"), k.pred("load_again")
    ballot, before, room, count = (k.reg("u32", n) for n in ("want_ballot", "want_before",
                                                             "stage_room", "loads"))
    top = k.label("load_pass")
    k.place(top)
    k.setp("lt", want, r.taken, r.arrived)
    k.vote_sync(ballot, want, mode="ballot")
    k.mov(before, sreg.lanemask_lt)
    k.and_(before, before, ballot)
    k.popc(before, before)
    k.sub(room, c.consumed, c.produced)
    # free stages: those neither loading nor still read by a store
    k.add(room, room, cfg.stages - 1 - stores_in_flight(cfg.stages))
    k.setp("lt", mine, before, room)
    k.and_pred(mine, mine, want)
    with k.if_(mine, "not_loading"):
        stage, wrapped = k.reg("u32", "stage"), k.pred("stage_wraps")
        k.add(stage, c.load_stage, before)
        k.setp("ge", wrapped, stage, cfg.stages)
        with k.guard(wrapped):
            k.sub(stage, stage, cfg.stages)
        data, bar, info = _stage_at(k, t.stages, stage, slot.bytes, "load")
        entry, slot_index, row = k.reg("u32", "entry"), k.reg("u32", "slot_index"), k.reg(
            "u32", "row")
        src = k.reg("u64", "entry_at")
        k.add(entry, r.base, r.taken)
        k.and_(slot_index, entry, cfg.slots - 1)
        k.mad(src, slot_index, slot.bytes, r.ring, mode="wide")
        k.add(row, r.first, r.taken)
        k.st(addr(info), row, space="shared")
        k.st(addr(info, 4), entry, space="shared")
        k.st(addr(info, 8), t.lane, space="shared")
        k.mbarrier_arrive_expect_tx(addr(bar), slot.bytes)
        k.cp_async_bulk_load(addr(data), addr(src), slot.bytes, addr(bar))
        k.add(r.taken, r.taken, 1)
    k.popc(count, ballot)
    k.min(count, count, room)
    k.add(c.produced, c.produced, count)
    k.add(c.load_stage, c.load_stage, count)
    wrapped = k.pred("stages_wrap")
    k.setp("ge", wrapped, c.load_stage, cfg.stages)
    with k.guard(wrapped):
        k.sub(c.load_stage, c.load_stage, cfg.stages)
    k.setp("ne", again, count, 0)
    k.setp("lt", mine, count, room)  # room left after this pass
    k.and_pred(again, again, mine)
    with k.guard(again):
        k.bra(top, uniform=True)
    k.bar_warp_sync()  # the stages' bookkeeping, before any lane reads it


def _store_entry(k, cfg, p, t, r, c) -> None:
    """The oldest stage to row ``row`` of the outputs: the signature and number checked,
    the source token, scales and top-k by lanes, the row by lane 0's bulk copy."""
    slot = cfg.slot
    data, bar, info = _stage_at(k, t.stages, c.store_stage, slot.bytes, "store")
    wait_parity(k, addr(bar), c.store_phase, "wait_loaded", uniform=True)
    row, entry, source = (k.reg("u32", n) for n in ("stored_row", "stored_entry", "stored_source"))
    k.ld(row, addr(info), space="shared")
    k.ld(entry, addr(info, 4), space="shared")
    k.ld(source, addr(info, 8), space="shared")
    with k.if_(t.lane0, "not_checking"):
        seen, number, token = (k.reg("u32", n) for n in ("sent_for", "sent_number", "source_token"))
        bad, other = k.pred("mismatch"), k.pred("other_number")
        k.ld(seen, addr(data, slot.signature), space="shared")
        k.ld(number, addr(data, slot.number), space="shared")
        k.setp("ne", bad, seen, cfg.signature)
        k.setp("ne", other, number, entry)
        k.or_(bad, bad, other)
        with k.if_(bad, "signature_matches"):
            t.watchdog.fail(common.DISPATCH_MISMATCH, t.channel, source, seen)
        k.ld(token, addr(data, slot.source), space="shared")
        at = k.reg("u64", "source_at")
        k.ld_param(at, p.recv_src_idx)
        k.mad(at, row, 4, at, mode="wide")
        k.st(addr(at), token)
        dst = k.reg("u64", "out_row")
        k.ld_param(dst, p.recv_x)
        k.mad(dst, row, slot.row_bytes, dst, mode="wide")
        k.cp_async_bulk_store(addr(dst), addr(data), slot.row_bytes)
    if cfg.fp8:
        _store_scales(k, cfg, p, t, data, row)
    if cfg.with_topk:
        _store_topk(k, cfg, p, t, r, data, row)
    with k.if_(t.lane0, "not_committing"):
        k.cp_async_bulk_commit_group()
        k.cp_async_bulk_wait_group(stores_in_flight(cfg.stages), read=True)
    k.bar_warp_sync()  # every lane's reads of the stage, and the stages stores freed
    mine = k.pred("my_source")
    k.setp("eq", mine, t.lane, source)
    with k.guard(mine):
        k.add(r.freed, r.freed, 1)
    k.add(c.consumed, c.consumed, 1)
    _advance(k, c.store_stage, c.store_phase, cfg.stages)
    _free(k, r, every=False)


def _store_scales(k, cfg, p, t, data, row) -> None:
    slot = cfg.slot
    group, element, at, scale = (k.reg(ty, n) for ty, n in (
        ("u32", "scale_group"), ("u32", "scale_element"), ("u64", "scale_at"), ("b32", "scale")))
    src = k.reg("u32", "scale_src")
    in_row = k.pred("scale_in_row")
    for trip in range(-(-slot.scale_groups // 32)):
        k.add(group, t.lane, 32 * trip)
        k.setp("lt", in_row, group, slot.scale_groups)
        with k.if_(in_row, "past_the_scales"):
            k.mad(src, group, 4, data)
            k.ld(scale, addr(src, slot.scales), space="shared")
            k.mad(element, row, slot.scale_groups, group)
            k.ld_param(at, p.recv_scales)
            k.mad(at, element, 4, at, mode="wide")
            k.st(addr(at), scale)


def _store_topk(k, cfg, p, t, r, data, row) -> None:
    """Lane j < k: index j made local (e - rank * E / R where this rank holds expert e,
    else -1) and its weight (0 where the expert is elsewhere)."""
    slot = cfg.slot
    is_pair, local = k.pred("is_pair"), k.pred("local")
    k.setp("lt", is_pair, t.lane, cfg.topk)
    with k.if_(is_pair, "no_pair"):
        index, weight = k.reg("u64", "topk_index"), k.reg("f32", "topk_weight")
        src, pair, at = k.reg("u32", "pair_src"), k.reg("u32", "pair"), k.reg("u64", "pair_at")
        k.mad(src, t.lane, 8, data)
        k.ld(index, addr(src, slot.topk_idx), space="shared")
        k.mad(src, t.lane, 4, data)
        k.ld(weight, addr(src, slot.topk_weights), space="shared")
        # -1 and every expert below this rank's first wrap to at least E / R unsigned.
        k.sub(index, index, r.first_expert)
        k.setp("lt", local, index, r.experts_per_rank)
        k.selp(index, index, 0xFFFFFFFFFFFFFFFF, local)
        k.selp(weight, weight, 0.0, local)
        k.mad(pair, row, cfg.topk, t.lane)
        k.ld_param(at, p.recv_topk_idx)
        k.mad(at, pair, 8, at, mode="wide")
        k.st(addr(at), index)
        k.ld_param(at, p.recv_topk_weights)
        k.mad(at, pair, 4, at, mode="wide")
        k.st(addr(at), weight)


def _free(k, r, *, every: bool) -> None:
    """Lane s publishes head = base + freed (st.release.sys) where it freed PUBLISH entries
    since the last time, or (``every``) any."""
    owed, publish, head = k.reg("u32", "owed"), k.pred("free_now"), k.reg("u32", "head")
    k.sub(owed, r.freed, r.published)
    k.setp("ge" if not every else "ne", publish, owed, PUBLISH if not every else 0)
    k.and_pred(publish, publish, r.source)
    with k.if_(publish, "nothing_to_free"):
        k.add(head, r.base, r.freed)
        k.st(addr(r.head_at), head, sem="release", scope="sys")
        k.mov(r.published, r.freed)


def _wait_for_entries(k, cfg, t, r) -> None:
    """Free every slot read, then poll the tails of the sources with entries still to
    come until one moves (or the time limit passes: the record names the first source
    waited for)."""
    _free(k, r, every=True)
    waiting, news, late = k.pred("waiting_for"), k.pred("news"), k.pred("late")
    any_news, any_late = k.pred("any_news"), k.pred("any_late")
    seen, ahead = k.reg("u32", "tail_seen"), k.reg("u32", "ahead")
    start, now = k.reg("u64", "poll_start"), k.reg("u64", "poll_now")
    k.mov(start, sreg.globaltimer)
    poll = k.label("poll_tails")
    k.place(poll)
    k.setp("lt", waiting, r.arrived, r.total)
    k.and_pred(waiting, waiting, r.source)
    k.mov(seen, 0)
    with k.guard(waiting):
        k.ld(seen, addr(r.tail_at), sem="acquire", scope="sys")
    k.sub(ahead, seen, r.base)
    k.min(ahead, ahead, r.total)  # never past what the host's layout made room for
    k.setp("gt", news, ahead, r.arrived)
    k.and_pred(news, news, waiting)
    with k.if_(news, "no_news"):
        k.fence_proxy_async("global")  # the bulk loads after what the acquire saw
        k.mov(r.arrived, ahead)
    k.vote_sync(any_news, news, mode="any")
    with k.if_(~any_news, "moved", uniform=True):
        k.mov(now, sreg.globaltimer)
        k.sub(now, now, start)
        k.setp("gt", late, now, t.watchdog.timeout_ns)
        k.vote_sync(any_late, late, mode="any")
        with k.if_(any_late, "in_time", uniform=True):
            stuck, first, value = k.reg("u32", "stuck"), k.reg("u32", "first_stuck"), k.reg(
                "u32", "stuck_seen")
            k.vote_sync(stuck, waiting, mode="ballot")
            k.neg(first, stuck, type="s32")
            k.and_(first, first, stuck)
            k.bfind(first, first)
            k.shfl_sync(value, seen, first, mode="idx")
            with k.if_(t.lane0, "not_reporting"):
                t.watchdog.fail(common.DISPATCH_RECEIVE, t.channel, first, value)
        k.bra(poll, uniform=True)
