"""Intranode combine: the reverse of a dispatch. Each rank sends every row it received
back to the token's source rank, and each rank sums, per token, the rows its ranks send
back, in rank order, in f32:

    out[t] = bf16_rn(((+0 + f32(row from rank 0)) + f32(row from rank 1)) + ...)

over the ranks t went to (is_token_in_rank[t]), each sum rounded to f32 (add.rn). The
order is fixed, so the bits are the same run to run, and they are those of the torch loop
``acc = acc + rows[d].float()`` over d. A token that went nowhere gets +0. With top-k
weights (k > 0, compile-time), each row's k f32 weights travel with it and are summed
the same way into combined_topk_weights [T, k] (a dispatch's received weights are 0 for
the experts of other ranks, so the sum gives each token its weights back).

It reuses the dispatch's layout (recv_layout: what each source rank sent on each
channel, and where those rows start; the received rows are grouped by source rank, and
within one by channel and token), so a sender's rows for one peer on one channel are
contiguous, and a receiver finds the entry of its token t in ring (c, d) by counting the
channel's tokens before t that went to rank d.

Roles (common.py: CTA 2c sends on channel c, CTA 2c + 1 receives on it):

    sender, group s     rows first .. first + count - 1 of x (what s sent on the channel),
                        32 at a time: lane 0 of each warp waits for room in ring (c, this
                        rank) of s's buffer (ld.acquire.sys of its head), warp w copies rows
                        w, w + warps_per_peer, ...; a named barrier over the group, then its
                        leader publishes the tail (st.release.sys).
    receiver (the CTA)  the channel's tokens, 32 at a time: per rank d a ballot of
                        is_token_in_rank[t, d] gives each token its entry in ring (c, d);
                        warp w sums tokens w, w + warps, ... of the batch: for each d the
                        token went to, lane 0 waits (acquire) until d's tail passes the
                        token's entry (each warp remembers the last tail it saw), then the
                        warp adds the rows, 16-byte vectors a lane, in rank order. After the
                        batch, bar.sync over the CTA and thread 0 frees the batch's entries
                        of every ring (st.release.sys of its heads).

Memory orders, cache hints and time limits as in dispatch.py.

Compile-time: ranks, hidden size, channels, ring slots, warps per peer. Run-time: T, this
rank, the pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns import fp8
from ...patterns.copy import VECTOR_BYTES, warp_copy
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from . import common
from .common import INPUT_LOAD, PAYLOAD_LOAD, STORE, check_entry
from .dispatch import warps_per_peer
from .plan import BATCH, MAX_TOPK, BufferPlan, signature


@dataclass(frozen=True)
class CombineConfig(common.RingConfig):
    topk: int            # top-k weights a row carries (0: none)

    @property
    def name(self) -> str:
        return (f"ep_intranode_combine_r{self.ranks}_h{self.hidden}_k{self.topk}_"
                f"c{self.channels}_s{self.slots}_w{self.warps_per_peer}")

    @property
    def unroll(self) -> int:
        """The 16-byte vectors of each rank's row a receiving lane loads at once: about 16
        loads in flight a lane, whatever the ranks."""
        return max(1, 16 // self.ranks)

    @property
    def signature(self) -> int:
        """What every entry carries: the sizes its rings were laid out for."""
        return signature("combine", self.hidden, self.topk, self.channels, self.slots)


def combine_warps_per_peer(ranks: int) -> int:
    """Half the dispatch's: 8 warps a CTA, so that a receiver thread may hold up to 255
    registers (its sum keeps ``unroll`` 16-byte loads from every rank in flight)."""
    return max(1, warps_per_peer(ranks) // 2)


def check_problem(hidden: int, topk: int = 0) -> None:
    if hidden <= 0 or hidden % 8:
        raise ValueError(f"hidden size (x.shape[1]) must be a positive multiple of 8, got {hidden}")
    if not 0 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_weights must have 1 to {MAX_TOPK} columns, got {topk}")


def choose_config(arch: Arch, ranks: int, hidden: int, *, topk: int = 0, num_sms: int = 20,
                  slots: int = 128) -> CombineConfig:
    """The dispatch's channels; ``combine_warps_per_peer`` (nothing tuned yet)."""
    check_problem(hidden, topk)
    channels = common.channels_for(arch, ranks, num_sms, slots, "combine")
    return CombineConfig(ranks=ranks, hidden=hidden, channels=channels, slots=slots,
                         warps_per_peer=combine_warps_per_peer(ranks), target=arch.target,
                         topk=topk)


def generate(cfg: CombineConfig) -> KernelBuilder:
    # One CTA an SM (the grid is the SM budget): ptxas may give a thread every register
    # the CTA's size allows, where it would otherwise spill to fit more CTAs.
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads, min_blocks_per_sm=1)
    k.launch = LaunchShape(block=cfg.threads, cooperative=True)
    p = SimpleNamespace()
    p.x = k.param("x", "u64")                                # bf16 [N, H], contiguous
    p.is_token_in_rank = k.param("is_token_in_rank", "u64")  # bool [T, ranks]
    p.tokens = k.param("tokens", "u32")
    common.declare_common_params(k, p)
    p.out = k.param("out", "u64")                            # bf16 [T, H], contiguous
    if cfg.topk:
        p.topk_weights = k.param("topk_weights", "u64")      # f32 [N, k]
        p.out_weights = k.param("combined_topk_weights", "u64")  # f32 [T, k]
    t = common.prologue(k, cfg.warps_per_peer)
    common.scalars(k, t, p)
    with k.if_(t.sender, "not_a_sender", uniform=True):
        _send(k, cfg, p, t)
    with k.if_(~t.sender, "not_a_receiver", uniform=True):
        _receive(k, cfg, p, t)
    return k


def _send(k, cfg, p, t) -> None:
    plan, row_bytes = cfg.plan, 2 * cfg.hidden
    with k.stage("sender: the rows the peer sent on the channel, its ring and counters"):
        count, first_row = common.recv_entry(k, p, t.group, t.channel, cfg.channels, cfg.ranks)
        peer_buffer = k.reg("u64", "peer_buffer")
        common.buffer_of(k, peer_buffer, t.peers, t.group)
        ring = common.ring(k, peer_buffer, plan.combine_rings, plan.combine_ring_bytes,
                           t.channel, t.rank, cfg.ranks)
        tail_at = common.counter(k, peer_buffer, plan, "combine_tail", t.channel, t.rank)
        head_at = common.counter(k, peer_buffer, plan, "combine_head", t.channel, t.rank)
        start = k.reg("u32", "start_tail")  # entries published since the buffer's creation
        k.ld(start, addr(tail_at), sem="relaxed", scope="sys")
    batch, batch_end, tail, head, used = (k.reg("u32", name) for name in (
        "batch", "batch_end", "tail", "head", "used"))
    fits = k.pred("fits")
    with k.loop(batch, count, step=BATCH, uniform=True, hint="send_batch"):
        k.add(batch_end, batch, BATCH)
        k.min(batch_end, batch_end, count)
        k.add(tail, start, batch_end)
        with k.stage("wait for room: head + slots >= the batch's tail"):
            def room(seen):
                k.sub(used, tail, seen)
                k.setp("le", fits, used, cfg.slots)
                return fits

            with k.if_(t.lane0, "not_polling"):
                t.watchdog.wait(head, addr(head_at), room, code=common.COMBINE_SEND,
                                channel=t.channel, peer=t.group)
            k.bar_warp_sync()
        with k.stage("copy: warp `member` takes rows batch + member, + warps_per_peer, ..."):
            i, first = k.reg("u32", "row_index"), k.reg("u32", "first_index")
            k.add(first, batch, t.member)
            entry, slot_index, row = k.reg("u32", "entry"), k.reg("u32", "slot_index"), k.reg(
                "u32", "row")
            src, dst = k.reg("u64", "x_row"), k.reg("u64", "entry_at")
            with k.loop(i, batch_end, start=first, step=cfg.warps_per_peer, uniform=True,
                        hint="row"):
                k.add(row, first_row, i)
                k.ld_param(src, p.x)
                k.mad(src, row, row_bytes, src, mode="wide")
                k.add(entry, start, i)
                k.and_(slot_index, entry, cfg.slots - 1)
                k.mad(dst, slot_index, plan.combine_slot_bytes, ring, mode="wide")
                # 16 vectors in flight a lane: a CTA has half the dispatch's warps.
                warp_copy(k, dst, src, row_bytes, t.lane, load=INPUT_LOAD, store=STORE,
                          unroll=16)
                if cfg.topk:
                    _send_weights(k, cfg, p, t, row, dst)
                with k.if_(t.lane0, "not_lane0"):
                    k.st(addr(dst, plan.combine_signature), cfg.signature, type="u32")
                    k.st(addr(dst, plan.combine_number), entry)
        with k.stage("publish: the group's rows, then the tail (st.release.sys)"):
            k.bar_sync(t.barrier, 32 * cfg.warps_per_peer)
            with k.guard(t.leader):
                k.st(addr(tail_at), tail, sem="release", scope="sys")


def _send_weights(k, cfg, p, t, row, dst) -> None:
    """Lane j < k copies the row's weight j into the entry."""
    is_pair, pair = k.pred("is_pair"), k.reg("u32", "pair")
    at, weight = k.reg("u64", "weight_at"), k.reg("b32", "weight")
    k.setp("lt", is_pair, t.lane, cfg.topk)
    with k.if_(is_pair, "no_weight"):
        k.mad(pair, row, cfg.topk, t.lane)
        k.ld_param(at, p.topk_weights)
        k.mad(at, pair, 4, at, mode="wide")
        k.ld(weight, addr(at), **INPUT_LOAD)
        k.mad(at, t.lane, 4, dst, mode="wide")
        k.st(addr(at, cfg.plan.combine_weights), weight)


def _receive(k, cfg, p, t) -> None:
    plan = cfg.plan
    r = SimpleNamespace()
    with k.stage("receiver: the channel's tokens, this rank's rings and counters"):
        tokens = k.reg("u32", "tokens")
        k.ld_param(tokens, p.tokens)
        r.begin, r.end = common.channel_tokens(k, tokens, t.channel, cfg.channels)
        own = k.reg("u64", "own_buffer")
        common.buffer_of(k, own, t.peers, t.rank)
        # Ring (c, d) and its counters lie at fixed distances from ring (c, 0)'s: d is a
        # compile-time index below.
        r.rings = common.ring(k, own, plan.combine_rings, plan.combine_ring_bytes, t.channel,
                              0, cfg.ranks)
        r.counters = common.counter(k, own, plan, "combine_head", t.channel, 0)
        r.head = k.regs("u32", cfg.ranks, "head")  # ring d's entries read before the batch
        r.seen = k.regs("u32", cfg.ranks, "seen")  # the last tail of ring d this warp saw
        for d in range(cfg.ranks):
            k.ld(r.head[d], addr(r.counters, _head(plan, d)), sem="relaxed", scope="sys")
            k.mov(r.seen[d], r.head[d])
        r.in_rank = k.reg("u64", "in_rank")
        k.ld_param(r.in_rank, p.is_token_in_rank)
        r.out = k.reg("u64", "out")
        k.ld_param(r.out, p.out)
        lanes_below = k.reg("u32", "lanes_below")
        k.mov(lanes_below, sreg.lanemask_lt)
        tid = k.reg("u32", "thread")
        k.mov(tid, sreg.tid.x)
        first_thread = k.pred("first_thread")
        k.setp("eq", first_thread, tid, 0)
    first, token, flag, batch_size = (k.reg("u32", name) for name in (
        "batch_first", "lane_token", "flag", "batch_size"))
    flag_at = k.reg("u64", "flag_at")
    in_batch, goes, sent = k.pred("in_batch"), k.pred("goes"), k.pred("sent")
    r.ballot = k.regs("b32", cfg.ranks, "ballot")
    r.entry = k.regs("u32", cfg.ranks, "lane_entry")  # the lane's token's entry, from head
    n = k.reg("u32", "batch_count")
    with k.loop(first, r.end, start=r.begin, step=BATCH, uniform=True, hint="receive_batch"):
        with k.stage("the batch's tokens: per rank a ballot, each token's entry"):
            k.add(token, first, t.lane)
            k.setp("lt", in_batch, token, r.end)
            k.mad(flag_at, token, cfg.ranks, r.in_rank, mode="wide")
            for d in range(cfg.ranks):
                k.mov(flag, 0)
                with k.guard(in_batch):
                    k.ld(flag, addr(flag_at, d), nc=True, type="u8")
                k.setp("ne", goes, flag, 0)
                k.vote_sync(r.ballot[d], goes, mode="ballot")
                k.and_(r.entry[d], r.ballot[d], lanes_below)
                k.popc(r.entry[d], r.entry[d])
            k.sub(batch_size, r.end, first)
            k.min(batch_size, batch_size, BATCH)
        i = k.reg("u32", "batch_token")
        with k.loop(i, batch_size, start=t.warp, step=cfg.warps, uniform=True, hint="token"):
            _reduce_token(k, cfg, p, t, r, first, i)
        with k.stage("free the batch's entries: heads (st.release.sys) after every warp's reads"):
            # Every entry of the batch was acquired by the warp that summed it, and the
            # bar.sync passes that on: a warp whose last tail seen lies below the new head
            # moves it there (each warp keeps seen >= head, so seen - head never wraps).
            k.bar_sync(0)
            ahead, lags = k.reg("u32", "seen_ahead"), k.pred("lags")
            for d in range(cfg.ranks):
                k.popc(n, r.ballot[d])
                k.sub(ahead, r.seen[d], r.head[d])
                k.setp("lt", lags, ahead, n)
                k.add(r.head[d], r.head[d], n)
                k.selp(r.seen[d], r.head[d], r.seen[d], lags)
                k.setp("ne", sent, n, 0)
                k.and_pred(sent, sent, first_thread)
                with k.guard(sent):
                    k.st(addr(r.counters, _head(plan, d)), r.head[d], sem="release", scope="sys")


def _head(plan: BufferPlan, peer: int) -> int:
    """Distance of ring (c, peer)'s head from ring (c, 0)'s head."""
    return plan.counter("combine_head", 0, peer) - plan.counter("combine_head")


def _tail(plan: BufferPlan, peer: int) -> int:
    """Distance of ring (c, peer)'s tail from ring (c, 0)'s head."""
    return plan.counter("combine_tail", 0, peer) - plan.counter("combine_head")


def _reduce_token(k, cfg, p, t, r, first, i) -> None:
    """Token first + i: wait for its entries, then out[token] = the sum of its rows in rank
    order, 16-byte vectors a lane."""
    plan = cfg.plan
    has = k.regs("pred", cfg.ranks, "has")
    rows = k.regs("u32", cfg.ranks, "row")  # the token's entry in ring (c, d), from ring (c, 0)
    entry, bit, ahead = k.reg("u32", "entry"), k.reg("u32", "bit"), k.reg("u32", "ahead")
    behind, ready = k.pred("behind"), k.pred("ready")
    check, number = k.pred("check"), k.reg("u32", "number")
    at = k.reg("u64", "at")
    with k.stage("wait for the token's entries, their addresses; check their signatures"):
        for d in range(cfg.ranks):
            k.bfe(bit, r.ballot[d], i, 1, type="u32")
            k.setp("ne", has[d], bit, 0)
            k.shfl_sync(entry, r.entry[d], i, mode="idx")
            k.sub(ahead, r.seen[d], r.head[d])
            k.setp("le", behind, ahead, entry)
            k.and_pred(behind, behind, has[d])

            def arrived(tail, d=d):
                k.sub(ahead, tail, r.head[d])
                k.setp("gt", ready, ahead, entry)
                return ready

            with k.if_(behind, f"entry_{d}_seen", uniform=True):
                with k.if_(t.lane0, f"not_polling_{d}"):
                    t.watchdog.wait(r.seen[d], addr(r.counters, _tail(plan, d)), arrived,
                                    code=common.COMBINE_RECEIVE, channel=t.channel, peer=d)
                k.bar_warp_sync()
                k.shfl_sync(r.seen[d], r.seen[d], 0, mode="idx")
            k.add(number, entry, r.head[d])
            k.and_(entry, number, cfg.slots - 1)
            k.mad(rows[d], entry, plan.combine_slot_bytes, d * plan.combine_ring_bytes)
            k.and_pred(check, has[d], t.lane0)
            with k.if_(check, f"row_{d}_unchecked"):
                k.mad(at, rows[d], 1, r.rings, mode="wide")
                check_entry(k, t, at, plan.combine_signature, cfg.signature, number,
                            common.COMBINE_MISMATCH, d)()
    token, out_at = k.reg("u32", "token"), k.reg("u64", "out_row")
    k.add(token, first, i)
    k.mad(out_at, token, 2 * cfg.hidden, r.out, mode="wide")
    rows_at = k.regs("u64", cfg.ranks, "row_at")
    for d in range(cfg.ranks):
        k.mad(rows_at[d], rows[d], 1, r.rings, mode="wide")
    sum_rows(k, cfg.hidden, cfg.unroll, t.lane, rows_at, has, out_at, PAYLOAD_LOAD)
    if cfg.topk:
        _reduce_weights(k, cfg, p, t, r, rows, has, token)


def sum_rows(k, hidden: int, unroll: int, lane, rows_at, has, out_at, load: dict) -> None:
    """The warp's row at ``out_at`` = bf16_rn of the f32 sum, in rank order, of the bf16
    rows at ``rows_at[d]`` for the ranks d with ``has[d]`` (+0 where none), 16-byte vectors
    a lane; each row's loads take the options ``load``. A lane's loads of ``unroll``
    vectors from every rank are all issued before the first add: one vector a rank at a
    time left each warp a single load in flight per rank, and the sum latency-bound."""
    with k.stage("sum the rows in rank order, f32, `unroll` 16-byte vectors a lane at once"):
        vectors, ranks = 2 * hidden // VECTOR_BYTES, len(rows_at)
        v, offset, at = k.reg("u32", "vector"), k.reg("u64", "vector_offset"), k.reg(
            "u64", "vector_at")
        data = [[k.regs("b32", 4, f"row{d}_{u}_") for d in range(ranks)]
                for u in range(unroll)]
        in_row = k.regs("pred", unroll, "in_row")
        loads = k.pred("load")
        acc, halves = k.regs("f32", 8, "acc"), k.regs("f32", 2, "half")
        packed = k.regs("b32", 4, "sum")
        with k.loop(v, vectors, start=lane, step=32 * unroll, hint="vector"):
            k.mul(offset, v, VECTOR_BYTES, mode="wide")
            for u in range(unroll):
                k.setp("lt", in_row[u], v, max(vectors - 32 * u, 0))  # u32: never below 0
            for u in range(unroll):
                for d in range(ranks):
                    k.add(at, rows_at[d], offset)
                    k.and_pred(loads, has[d], in_row[u])
                    with k.guard(loads):
                        k.ld(data[u][d], addr(at, 32 * VECTOR_BYTES * u), **load)
            k.add(at, out_at, offset)
            for u in range(unroll):
                for a in acc:
                    k.mov(a, 0.0)
                for d in range(ranks):
                    for w, word in enumerate(data[u][d]):
                        fp8.unpack_bf16x2(k, halves[0], halves[1], word)
                        with k.guard(has[d]):
                            for h in (0, 1):
                                k.add(acc[2 * w + h], acc[2 * w + h], halves[h], rnd="rn")
                for w, word in enumerate(packed):
                    k.cvt(word, acc[2 * w + 1], acc[2 * w], dtype="bf16x2", rnd="rn")
                with k.guard(in_row[u]):
                    k.st(addr(at, 32 * VECTOR_BYTES * u), packed)


def _reduce_weights(k, cfg, p, t, r, rows, has, token) -> None:
    """Lane j < k: the token's weight j, summed over its ranks in rank order in f32."""
    with k.stage("sum the top-k weights in rank order, f32, one a lane"):
        is_pair, pair = k.pred("is_pair"), k.reg("u32", "pair")
        at, weight, total = k.reg("u64", "weight_at"), k.reg("f32", "weight"), k.reg(
            "f32", "weight_sum")
        k.setp("lt", is_pair, t.lane, cfg.topk)
        with k.if_(is_pair, "no_weight"):
            k.mov(total, 0.0)
            for d in range(cfg.ranks):
                k.mad(at, rows[d], 1, r.rings, mode="wide")
                k.mad(at, t.lane, 4, at, mode="wide")
                with k.guard(has[d]):
                    k.ld(weight, addr(at, cfg.plan.combine_weights), **PAYLOAD_LOAD)
                with k.guard(has[d]):
                    k.add(total, total, weight, rnd="rn")
            k.mad(pair, token, cfg.topk, t.lane)
            k.ld_param(at, p.out_weights)
            k.mad(at, pair, 4, at, mode="wide")
            k.st(addr(at), total)
