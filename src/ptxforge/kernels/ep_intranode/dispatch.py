"""Intranode dispatch: every rank sends each of its tokens to the ranks holding one of its
experts, through rings in the receivers' buffers (plan.py), and each rank copies what it
receives into its outputs, grouped by source rank in token order.

Roles (common.py: CTA 2c sends on channel c, CTA 2c + 1 receives on it; one group of
``warps_per_peer`` warps per peer rank):

    sender, group d      the channel's tokens [begin, end) of this rank (plan.channel_bounds),
                         32 at a time (one a lane): is_token_in_rank[t, d] -> a ballot; the
                         batch's n tokens for d take ring entries tail .. tail + n - 1 in
                         token order. Lane 0 of each warp waits (ld.acquire.sys of d's
                         head) until the ring has room for all n; warp w of the group copies
                         the entries numbered w mod warps_per_peer: the row (16-byte vectors,
                         patterns/copy.py), the FP8 scales, the top-k indices and weights,
                         the token's index. Then a named barrier over the group, and its
                         leader publishes tail += n with st.release.sys into d's buffer.
    receiver, group s    count and first row of what s sends on the channel (recv_layout,
                         from the host's exchange of counts): until all arrived, the
                         leader waits (ld.acquire.sys of the local tail) for new entries and
                         hands their end to the group through shared memory (bar.sync);
                         warp w copies entries w, w + warps_per_peer, ... to rows first +
                         i of the outputs (top-k indices made local: e - rank * E / R
                         where the expert is this rank's, else -1 with weight 0); a second
                         bar.sync, then the leader publishes head with st.release.sys.

Counters run on from launch to launch (plan.py): a sender starts from the tail it left in
the receiver's buffer, a receiver from the head it left in its own; both read them with
ld.relaxed.sys, as only they write them. The host's exchange makes both ends agree on
how many entries each ring carries per launch, so they stay equal.

Memory orders and cache hints: the release of a tail orders the group's payload stores
before it (bar.sync, then one thread's release, cumulative); the receiver's acquire
orders its loads of the entries after it; the head's release orders those loads before
the sender, after its acquire of the head, overwrites the entries. The payload is read
with weak loads that skip L1 (``L1::no_allocate``) and never through the non-coherent
path, which may hold a stale line of a ring another GPU rewrote; the sender's inputs
(x, scales, top-k), which nothing writes while the kernel runs, are read with
``ld.global.nc``. Stores to a peer's ring bypass L1 too.

Each wait is timed (patterns/poll.py): past ``timeout_ns`` the thread writes a record
(what it waited for, channel, peer, the counter seen) to mapped host memory and traps.

Compile-time: ranks, hidden size, bf16 or e4m3 rows, k (whether top-k travels), channels,
ring slots, warps per peer. Run-time: T, this rank, E / R, the pointers and strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns.copy import lane_words_load, lane_words_store, warp_copy
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from . import common
from .plan import BATCH, MAX_TOPK, SCALE_GROUP, DispatchSlot, signature

MAX_THREADS = 1024


@dataclass(frozen=True)
class DispatchConfig(common.RingConfig):
    fp8: bool
    topk: int
    with_topk: bool      # top-k indices and weights travel with the rows

    @property
    def name(self) -> str:
        return (f"ep_intranode_dispatch_r{self.ranks}_h{self.hidden}_"
                f"{'e4m3' if self.fp8 else 'bf16'}_k{self.topk if self.with_topk else 0}_"
                f"c{self.channels}_s{self.slots}_w{self.warps_per_peer}")

    @property
    def slot(self) -> DispatchSlot:
        return DispatchSlot(self.hidden, self.topk if self.with_topk else 0, self.fp8)

    @property
    def copy_unroll(self) -> int:
        """A lane's row vectors in flight: 16 for e4m3 rows (a 7168-byte row in one round),
        4 for bf16 ones, whose kernel already holds 126 of its 128 registers a thread (512
        threads an SM)."""
        return 16 if self.fp8 else 4

    @property
    def signature(self) -> int:
        """What every entry carries: the sizes its rings were laid out for."""
        return signature("dispatch", self.hidden, self.slot.topk, self.fp8, self.channels,
                         self.slots)


def warps_per_peer(ranks: int) -> int:
    """The warps a CTA gives each peer: a power of two (a warp takes the entries numbered
    its place in the group modulo the count), up to 16 warps a CTA in all."""
    return 1 << ((16 // ranks).bit_length() - 1)


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
                  with_topk: bool = True, num_sms: int = 20, slots: int = 128) -> DispatchConfig:
    """Channels: half the SM budget; warps: ``warps_per_peer``. Nothing is tuned yet."""
    check_hidden(hidden, fp8)
    check_topk(topk)
    channels = common.channels_for(arch, ranks, num_sms, slots, "dispatch")
    return DispatchConfig(ranks=ranks, hidden=hidden, channels=channels, slots=slots,
                          warps_per_peer=warps_per_peer(ranks), target=arch.target, fp8=fp8,
                          topk=topk, with_topk=with_topk)


def generate(cfg: DispatchConfig) -> KernelBuilder:
    # One CTA an SM (the grid is the SM budget): ptxas may give a thread every register
    # the CTA's size allows, where it would otherwise spill to fit more CTAs.
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads, min_blocks_per_sm=1)
    k.launch = LaunchShape(block=cfg.threads, cooperative=True)
    p = _Params(k, cfg)
    t = common.prologue(k, cfg.warps_per_peer)
    common.scalars(k, t, p)
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


def _send(k, cfg, p, t) -> None:
    s = SimpleNamespace()
    with k.stage("sender: the peer's ring and counters, the channel's tokens"):
        tokens = k.reg("u32", "tokens")
        k.ld_param(tokens, p.tokens)
        s.begin, s.end = common.channel_tokens(k, tokens, t.channel, cfg.channels)
        peer_buffer = k.reg("u64", "peer_buffer")
        common.buffer_of(k, peer_buffer, t.peers, t.group)
        s.ring = common.ring(k, peer_buffer, cfg.plan.dispatch_rings,
                             cfg.plan.dispatch_ring_bytes(cfg.slot), t.channel, t.rank, cfg.ranks)
        s.tail_at = common.counter(k, peer_buffer, cfg.plan, "dispatch_tail", t.channel, t.rank)
        s.head_at = common.counter(k, peer_buffer, cfg.plan, "dispatch_head", t.channel, t.rank)
        s.tail = k.reg("u32", "tail")  # entries published since the buffer's creation
        k.ld(s.tail, addr(s.tail_at), sem="relaxed", scope="sys")
        s.in_rank = k.reg("u64", "in_rank")
        k.ld_param(s.in_rank, p.is_token_in_rank)
        s.lanes_below = k.reg("u32", "lanes_below")
        k.mov(s.lanes_below, sreg.lanemask_lt)
    first, any_sent = k.reg("u32", "batch_first"), k.pred("any_sent")
    ballot, n = k.reg("b32", "ballot"), k.reg("u32", "batch_count")
    head, room_end, used = k.reg("u32", "head"), k.reg("u32", "room_end"), k.reg("u32", "used")
    fits, publish = k.pred("fits"), k.pred("publish")
    with k.loop(first, s.end, start=s.begin, step=BATCH, uniform=True, hint="send_batch"):
        with k.stage("the batch's tokens for the peer: a ballot of is_token_in_rank[t, peer]"):
            ballot_to_group(k, cfg.ranks, t, s.in_rank, first, s.end, ballot)
            k.popc(n, ballot)
            k.setp("ne", any_sent, n, 0)
        with k.if_(any_sent, "nothing_to_send", uniform=True):
            with k.stage("wait for room: head + slots >= tail + n"):
                k.add(room_end, s.tail, n)

                def room(seen):
                    k.sub(used, room_end, seen)
                    k.setp("le", fits, used, cfg.slots)
                    return fits

                with k.if_(t.lane0, "not_polling"):
                    t.watchdog.wait(head, addr(s.head_at), room, code=common.DISPATCH_SEND,
                                    channel=t.channel, peer=t.group)
                k.bar_warp_sync()
            _send_batch(k, cfg, p, t, s, first, ballot)
        with k.stage("publish: the group's entries, then tail += n (st.release.sys)"):
            k.bar_sync(t.barrier, 32 * cfg.warps_per_peer)
            k.add(s.tail, s.tail, n)
            k.and_pred(publish, t.leader, any_sent)
            with k.guard(publish):
                k.st(addr(s.tail_at), s.tail, sem="release", scope="sys")


def ballot_to_group(k, ranks: int, t, in_rank, first, end, ballot) -> None:
    """ballot: which of tokens first .. first + 31 (below ``end``) go to the group's rank
    (is_token_in_rank[token, group], bool [T, ranks] at ``in_rank``), a bit a lane."""
    token, flag, flag_at = k.reg("u32", "lane_token"), k.reg("u32", "flag"), k.reg(
        "u64", "flag_at")
    index, in_batch, goes = k.reg("u32", "flag_index"), k.pred("in_batch"), k.pred("goes")
    k.add(token, first, t.lane)
    k.setp("lt", in_batch, token, end)
    k.mov(flag, 0)
    k.mad(index, token, ranks, t.group)
    k.mad(flag_at, index, 1, in_rank, mode="wide")
    with k.guard(in_batch):
        k.ld(flag, addr(flag_at), nc=True, type="u8")
    k.setp("ne", goes, flag, 0)
    k.vote_sync(ballot, goes, mode="ballot")


def _send_batch(k, cfg, p, t, s, first, ballot) -> None:
    """Token i of the batch, if it goes to the peer, takes entry tail + (the batch's tokens
    for the peer before it); warp ``member`` copies the entries numbered member modulo
    warps_per_peer."""
    token = k.reg("u32", "token")

    def send(i, entry):
        k.add(token, first, i)
        _send_token(k, cfg, p, t, s, token, entry)

    for_own_entries(k, ballot, s.tail, cfg.warps_per_peer, t.member, send)


def for_own_entries(k, ballot, base, warps: int, member, emit) -> None:
    """For each set bit i of ``ballot`` (a batch's tokens for one peer) whose number, base +
    (the set bits below i), is ``member`` modulo ``warps`` (a power of two): ``emit(i,
    number)``, under a branch the whole warp takes alike."""
    i, bit, below, number, owner = (k.reg("u32", name) for name in (
        "batch_lane", "bit", "before", "number", "owner"))
    mine, has = k.pred("mine"), k.pred("has")
    with k.loop(i, BATCH, uniform=True, hint="batch_token"):
        k.bfe(bit, ballot, i, 1, type="u32")
        k.shl(below, 1, i, type="b32")
        k.sub(below, below, 1)
        k.and_(below, below, ballot)
        k.popc(below, below)
        k.add(number, base, below)
        k.and_(owner, number, warps - 1)
        k.setp("eq", mine, owner, member)
        k.setp("ne", has, bit, 0)
        k.and_pred(mine, mine, has)
        with k.if_(mine, "not_mine", uniform=True):
            emit(i, number)


def _send_token(k, cfg, p, t, s, token, entry) -> None:
    """Entry ``entry`` of the ring: the token's row, scales, top-k and index. Every load
    goes out before the first store (the row's in one round, 16 vectors a lane for e4m3),
    so that an entry costs one load latency, not one a part."""
    slot = cfg.slot
    src, dst, slot_index = k.reg("u64", "x_row"), k.reg("u64", "entry_at"), k.reg(
        "u32", "slot_index")
    k.ld_param(src, p.x)
    k.mad(src, token, slot.row_bytes, src, mode="wide")
    k.and_(slot_index, entry, cfg.slots - 1)
    k.mad(dst, slot_index, slot.bytes, s.ring, mode="wide")
    stores = []
    if cfg.fp8:
        stores.append(_load_scales(k, cfg, p, t, token, dst))
    if cfg.with_topk:
        stores.append(_load_topk(k, cfg, p, t, token, dst))
    warp_copy(k, dst, src, slot.row_bytes, t.lane, load=common.INPUT_LOAD, store=common.STORE,
              unroll=cfg.copy_unroll)
    for store in stores:
        store()
    with k.if_(t.lane0, "not_lane0"):
        k.st(addr(dst, slot.source), token)
        k.st(addr(dst, slot.signature), cfg.signature, type="u32")
        k.st(addr(dst, slot.number), entry)


def _load_scales(k, cfg, p, t, token, dst):
    """The token's scales (``load_scales``); returns the emitter of their stores into the
    entry at ``dst``."""
    scales, in_row = load_scales(k, p, t.lane, token, cfg.slot.scale_groups)

    def store():
        lane_words_store(k, dst, scales, in_row, t.lane, store={}, name="scale",
                         offset=cfg.slot.scales)
    return store


def load_scales(k, p, lane, token, groups: int) -> tuple:
    """Lane j loads scales j, j + 32, ... of the token's ``groups`` (x_scales[token, j]
    lies at token * scale_token_stride + j * scale_group_stride elements): (the words, the
    predicates of those within the row), as ``lane_words_load`` gives them."""
    trips = -(-groups // 32)
    token_stride, group_stride = k.reg("u32", "scale_token_stride"), k.reg(
        "u32", "scale_group_stride")
    k.ld_param(token_stride, p.scale_token_stride)
    k.ld_param(group_stride, p.scale_group_stride)
    src, offset = k.reg("u64", "scale_at"), k.reg("u64", "scale_offset")
    scales, in_row = k.regs("b32", trips, "scale"), k.regs("pred", trips, "scale_in_row")
    group = k.reg("u32", "scale_group")
    for trip in range(trips):
        k.add(group, lane, 32 * trip)
        k.setp("lt", in_row[trip], group, groups)
        k.mul(offset, token, token_stride, mode="wide")
        k.mad(offset, group, group_stride, offset, mode="wide")
        k.ld_param(src, p.x_scales)
        k.shl(offset, offset, 2)
        k.add(src, src, offset)
        with k.guard(in_row[trip]):
            k.ld(scales[trip], addr(src), **common.INPUT_LOAD)
    return scales, in_row


def _load_topk(k, cfg, p, t, token, dst):
    """The token's top-k (``load_topk``); returns the emitter of their stores into the
    entry at ``dst``."""
    slot = cfg.slot
    is_pair, index, weight = load_topk(k, p, t.lane, token, cfg.topk)
    at = k.reg("u64", "pair_dst")

    def store():
        k.mad(at, t.lane, 8, dst, mode="wide")
        with k.guard(is_pair):
            k.st(addr(at, slot.topk_idx), index)
        k.mad(at, t.lane, 4, dst, mode="wide")
        with k.guard(is_pair):
            k.st(addr(at, slot.topk_weights), weight)
    return store


def load_topk(k, p, lane, token, topk: int) -> tuple:
    """Lane j < ``topk`` loads the token's expert j (int64) and its weight (f32): (the
    lane's predicate, the index, the weight)."""
    is_pair = k.pred("is_pair")
    k.setp("lt", is_pair, lane, topk)
    pair, src = k.reg("u32", "pair"), k.reg("u64", "pair_at")
    index, weight = k.reg("u64", "topk_index"), k.reg("f32", "topk_weight")
    k.mad(pair, token, topk, lane)
    k.ld_param(src, p.topk_idx)
    k.mad(src, pair, 8, src, mode="wide")
    with k.guard(is_pair):
        k.ld(index, addr(src), **common.INPUT_LOAD)
    k.ld_param(src, p.topk_weights)
    k.mad(src, pair, 4, src, mode="wide")
    with k.guard(is_pair):
        k.ld(weight, addr(src), **common.INPUT_LOAD)
    return is_pair, index, weight


def _receive(k, cfg, p, t) -> None:
    r = SimpleNamespace()
    with k.stage("receiver: this rank's ring from the peer, its counters, the rows it fills"):
        r.total, r.first_row = common.recv_entry(k, p, t.group, t.channel, cfg.channels,
                                                 cfg.ranks)
        own = k.reg("u64", "own_buffer")
        common.buffer_of(k, own, t.peers, t.rank)
        r.ring = common.ring(k, own, cfg.plan.dispatch_rings,
                             cfg.plan.dispatch_ring_bytes(cfg.slot), t.channel, t.group, cfg.ranks)
        r.tail_at = common.counter(k, own, cfg.plan, "dispatch_tail", t.channel, t.group)
        r.head_at = common.counter(k, own, cfg.plan, "dispatch_head", t.channel, t.group)
        r.base = k.reg("u32", "base")  # entries read since the buffer's creation
        k.ld(r.base, addr(r.head_at), sem="relaxed", scope="sys")
        if cfg.with_topk:
            r.first_expert = k.reg("u64", "first_expert")  # rank * E / R
            per_rank = k.reg("u32", "experts_per_rank")
            k.ld_param(per_rank, p.experts_per_rank)
            k.mul(r.first_expert, t.rank, per_rank, mode="wide")
            r.experts_per_rank = k.reg("u64", "experts_per_rank_wide")
            k.cvt(r.experts_per_rank, per_rank, dtype="u64", stype="u32")
        shared = k.shared("arrived", 4 * cfg.ranks, align=4)
        r.arrived_at = k.reg("u32", "arrived_at")
        k.mov(r.arrived_at, shared)
        k.mad(r.arrived_at, t.group, 4, r.arrived_at)
    received, arrived, seen, ahead = (k.reg("u32", name) for name in (
        "received", "arrived", "tail_seen", "ahead"))
    done, ready = k.pred("all_received"), k.pred("ready")
    top, end = k.label("receive"), k.label("receive_end")
    k.mov(received, 0)
    k.place(top)
    k.setp("ge", done, received, r.total)
    with k.guard(done):
        k.bra(end, uniform=True)

    def news(tail):
        k.sub(ahead, tail, r.base)
        k.setp("gt", ready, ahead, received)
        return ready

    with k.stage("the leader waits for entries past `received`, shares where they end"):
        with k.if_(t.leader, "not_the_leader"):
            t.watchdog.wait(seen, addr(r.tail_at), news, code=common.DISPATCH_RECEIVE,
                            channel=t.channel, peer=t.group)
            k.min(ahead, ahead, r.total)  # never past what the host's layout made room for
            k.st(addr(r.arrived_at), ahead, space="shared")
        k.bar_sync(t.barrier, 32 * cfg.warps_per_peer)
        k.ld(arrived, addr(r.arrived_at), space="shared")
    with k.stage("copy out: warp `member` takes entries received + member, + warps_per_peer, ..."):
        index = k.reg("u32", "index")
        start = k.reg("u32", "start")
        k.add(start, received, t.member)
        with k.loop(index, arrived, start=start, step=cfg.warps_per_peer, uniform=True,
                    hint="entry"):
            _receive_entry(k, cfg, p, t, r, index)
    with k.stage("free the entries: head = base + arrived (st.release.sys)"):
        k.bar_sync(t.barrier, 32 * cfg.warps_per_peer)
        with k.if_(t.leader, "not_freeing"):
            head = k.reg("u32", "head")
            k.add(head, r.base, arrived)
            k.st(addr(r.head_at), head, sem="release", scope="sys")
        k.mov(received, arrived)
        k.bra(top, uniform=True)
    k.place(end)


def _receive_entry(k, cfg, p, t, r, index) -> None:
    """Entry ``index`` past the base to row first_row + index of the outputs: every load
    (the signature and number, the source, the scales, the top-k) before the row's, every
    store after, so that an entry costs one load latency."""
    slot = cfg.slot
    entry, slot_index, row = k.reg("u32", "entry"), k.reg("u32", "slot_index"), k.reg(
        "u32", "row")
    src, dst = k.reg("u64", "entry_at"), k.reg("u64", "out_row")
    k.add(entry, r.base, index)
    k.and_(slot_index, entry, cfg.slots - 1)
    k.mad(src, slot_index, slot.bytes, r.ring, mode="wide")
    k.add(row, r.first_row, index)
    source = k.reg("u32", "source")
    with k.if_(t.lane0, "not_lane0_loading"):
        verify = common.check_entry(k, t, src, slot.signature, cfg.signature, entry,
                                    common.DISPATCH_MISMATCH, t.group)
        k.ld(source, addr(src, slot.source), **common.PAYLOAD_LOAD)
    stores = []
    if cfg.fp8:
        stores.append(_receive_scales(k, cfg, p, t, src, row))
    if cfg.with_topk:
        stores.append(_receive_topk(k, cfg, p, t, r, src, row))
    k.ld_param(dst, p.recv_x)
    k.mad(dst, row, slot.row_bytes, dst, mode="wide")
    warp_copy(k, dst, src, slot.row_bytes, t.lane, load=common.PAYLOAD_LOAD, store={},
              unroll=cfg.copy_unroll)
    for store in stores:
        store()
    with k.if_(t.lane0, "not_lane0"):
        verify()
        at = k.reg("u64", "source_at")
        k.ld_param(at, p.recv_src_idx)
        k.mad(at, row, 4, at, mode="wide")
        k.st(addr(at), source)


def _receive_scales(k, cfg, p, t, src, row):
    """Lane j loads scales j, j + 32, ... of the entry at ``src``; returns the emitter of
    their stores into recv_scales[row]."""
    slot = cfg.slot
    group, element, at = k.reg("u32", "scale_group"), k.reg("u32", "scale_element"), k.reg(
        "u64", "scale_at")
    scales, in_row = lane_words_load(k, src, slot.scale_groups, t.lane,
                                     load=common.PAYLOAD_LOAD, name="scale", offset=slot.scales)

    def store():
        for trip in range(len(scales)):
            k.add(group, t.lane, 32 * trip)
            k.mad(element, row, slot.scale_groups, group)
            k.ld_param(at, p.recv_scales)
            k.mad(at, element, 4, at, mode="wide")
            with k.guard(in_row[trip]):
                k.st(addr(at), scales[trip])
    return store


def _receive_topk(k, cfg, p, t, r, src, row):
    """Lane j < k loads index j and its weight; returns the emitter that stores them,
    the index made local (e - rank * E / R where this rank holds expert e, else -1) and
    the weight 0 where the expert is elsewhere."""
    slot = cfg.slot
    is_pair, local = k.pred("is_pair"), k.pred("local")
    k.setp("lt", is_pair, t.lane, cfg.topk)
    index, weight = k.reg("u64", "topk_index"), k.reg("f32", "topk_weight")
    at, pair = k.reg("u64", "pair_at"), k.reg("u32", "pair")
    k.mad(at, t.lane, 8, src, mode="wide")
    with k.guard(is_pair):
        k.ld(index, addr(at, slot.topk_idx), **common.PAYLOAD_LOAD)
    k.mad(at, t.lane, 4, src, mode="wide")
    with k.guard(is_pair):
        k.ld(weight, addr(at, slot.topk_weights), **common.PAYLOAD_LOAD)

    def store():
        with k.if_(is_pair, "no_pair"):
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
    return store
