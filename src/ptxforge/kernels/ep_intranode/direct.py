"""Intranode dispatch by direct writes, for a dispatch sized for the worst case: every CTA
sends, and each token's row goes once, straight to its row of the receiver's outputs,
which lie in the receiver's buffer (``plan.DirectRegion``). Nothing is received through
rings, so no SM copies a ring out; the count exchange that precedes every such dispatch
(exchange.py) leaves on each GPU where its rows go at every rank (send_layout) and how
many it receives (num_recv).

Roles (grid 2C CTAs, C the channels of the exchange and of the combine, so the received
order is the ring dispatch's; one group of ``warps_per_peer`` warps per destination rank):

    CTA 2c + h, group d   the tokens of half h of channel c (plan.channel_bounds, cut in
                          two): the first row at d is send_layout[d, c], past, for h = 1,
                          the first half's tokens for d (the group counts them: ballots of
                          is_token_in_rank[t, d]). 32 tokens at a time, a ballot gives each
                          token for d its row; warp w copies the rows numbered w mod
                          warps_per_peer: the e4m3 row (16-byte vectors, 16 a lane), its
                          scales, its top-k made d's (e - d * E / R where d holds expert e,
                          else -1 and weight 0) and the token's index, into d's outputs,
                          and notes the row in send_rows[token, d] here (where the pull
                          combine finds the experts' output for it, pull.py).
                          Then every thread fences its stores (fence.acq_rel.sys), a named
                          barrier over the group, and its leader stores n, the exchange's
                          number, to d's flag [this rank][2c + h] with st.release.sys.
    every CTA             the rows past num_recv of this rank's top-k outputs become -1
                          (weights 0), a share each: the worst case's rows nobody sends.
                          Then thread s < R waits (ld.acquire.sys, the watchdog) for this
                          rank's flag [s][2c + h] to reach n: when every CTA has, every
                          row has arrived, and the kernel's end passes that on.

A receiver's outputs stay free until it runs its next exchange: a rank writes into them
only after that exchange, which waits for the receiver's own (it publishes its flag there
after everything before it on its stream, the outputs' readers included). The flags are
the exchange's numbers, so they only grow and nothing is reset.

Compile-time: ranks, hidden size, k, channels, warps per peer. Run-time: T, this rank,
E / R, the outputs' places (the same in every rank's buffer), the pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns.copy import lane_words_store, warp_copy
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from . import common
from .dispatch import (ballot_to_group, check_hidden, check_topk, for_own_entries, load_scales,
                       load_topk, warps_per_peer)
from .plan import BATCH, DIRECT_DONE, EXCHANGE_FLAGS, MAX_CHANNELS, MIN_SLOTS, SCALE_GROUP

COPY_UNROLL = 16   # a lane's row vectors in flight: a 7168-byte e4m3 row in one round


@dataclass(frozen=True)
class DirectConfig:
    ranks: int
    hidden: int
    topk: int
    channels: int
    warps_per_peer: int
    target: str

    @property
    def name(self) -> str:
        return (f"ep_direct_dispatch_r{self.ranks}_h{self.hidden}_k{self.topk}_"
                f"c{self.channels}_w{self.warps_per_peer}")

    @property
    def threads(self) -> int:
        return 32 * self.ranks * self.warps_per_peer

    @property
    def scale_groups(self) -> int:
        return self.hidden // SCALE_GROUP


def choose_config(arch: Arch, ranks: int, hidden: int, topk: int, *,
                  num_sms: int = 20) -> DirectConfig:
    """e4m3 rows with their scales and top-k; channels: half the SM budget, two CTAs
    each."""
    check_hidden(hidden, True)
    check_topk(topk)
    channels = common.channels_for(arch, ranks, num_sms, MIN_SLOTS, "direct dispatch")
    return DirectConfig(ranks, hidden, topk, channels, warps_per_peer(ranks), arch.target)


def done_flag(source: int, cta: int) -> int:
    """Byte offset in a buffer of the flag CTA ``cta`` of rank ``source`` publishes there."""
    return DIRECT_DONE + 4 * (source * 2 * MAX_CHANNELS + cta)


def generate(cfg: DirectConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads)
    k.launch = LaunchShape(block=cfg.threads)
    p = _Params(k)
    t = common.prologue(k, cfg.warps_per_peer)
    common.scalars(k, t, p)
    _number(k, t)
    with k.stage("the half channel's tokens and the group's first row at its rank"):
        s = _first_row(k, cfg, p, t)
    _send(k, cfg, p, t, s)
    with k.stage("publish: the group's rows, then n to the rank's flag (st.release.sys)"):
        k.fence("acq_rel", "sys")
        k.bar_sync(t.barrier, 32 * cfg.warps_per_peer)
        flag = k.reg("u64", "flag_at")
        k.mad(flag, t.rank, 4 * 2 * MAX_CHANNELS, s.buffer, mode="wide")
        k.mad(flag, t.cta, 4, flag, mode="wide")
        with k.if_(t.leader, "not_the_leader"):
            k.st(addr(flag, DIRECT_DONE), t.number, sem="release", scope="sys")
    _fill_unsent(k, cfg, p, t)
    _wait(k, cfg, t)
    return k


class _Params:
    """Kernel parameters (launches bind them by name)."""

    def __init__(self, k: KernelBuilder):
        self.x = k.param("x", "u64")                                # e4m3 [T, H]
        self.x_scales = k.param("x_scales", "u64")                  # f32 [T, H / 128], strided
        self.scale_token_stride = k.param("scale_token_stride", "u32")  # elements
        self.scale_group_stride = k.param("scale_group_stride", "u32")
        self.topk_idx = k.param("topk_idx", "u64")                  # int64 [T, k]
        self.topk_weights = k.param("topk_weights", "u64")          # f32 [T, k]
        self.experts_per_rank = k.param("experts_per_rank", "u32")
        self.is_token_in_rank = k.param("is_token_in_rank", "u64")  # bool [T, ranks]
        self.tokens = k.param("tokens", "u32")
        self.send_layout = k.param("send_layout", "u64")  # int32 [ranks, C]: the exchange's
        self.num_recv = k.param("num_recv", "u64")        # int32 [1]: rows this rank receives
        self.worst = k.param("worst", "u32")              # the outputs' rows
        # The outputs' byte offsets in every rank's buffer (plan.DirectRegion).
        self.recv_x = k.param("recv_x", "u64")
        self.recv_scales = k.param("recv_scales", "u64")
        self.recv_topk_idx = k.param("recv_topk_idx", "u64")
        self.recv_topk_weights = k.param("recv_topk_weights", "u64")
        self.recv_src_idx = k.param("recv_src_idx", "u64")
        self.send_rows = k.param("send_rows", "u64")    # int32 [T, ranks]: each token's row
                                                        # at each rank (the pull combine's)
        self.rank = k.param("rank", "u32")
        self.peers = k.param("peers", "u64")
        self.error = k.param("error", "u64")
        self.timeout_ns = k.param("timeout_ns", "u64")


def _number(k: KernelBuilder, t) -> None:
    """t.number: the exchange's n, this rank's own flag[rank] (the exchange before this
    kernel, on the stream it waited for, wrote it); t.cta, t.tid: the CTA's and the
    thread's index."""
    own = k.reg("u64", "own_buffer")
    common.buffer_of(k, own, t.peers, t.rank)
    k.mad(own, t.rank, 4, own, mode="wide")
    t.number = k.reg("u32", "number")
    k.ld(t.number, addr(own, EXCHANGE_FLAGS), sem="relaxed", scope="sys")
    t.cta, t.tid = k.reg("u32", "cta_index"), k.reg("u32", "thread")
    k.mov(t.cta, sreg.ctaid.x)
    k.mov(t.tid, sreg.tid.x)


def _first_row(k: KernelBuilder, cfg: DirectConfig, p, t) -> SimpleNamespace:
    """The group's destination buffer, its token range [begin, end) (half h of the
    channel's) and the row at its rank of the range's first token for it."""
    s = SimpleNamespace()
    tokens = k.reg("u32", "tokens")
    k.ld_param(tokens, p.tokens)
    channel_begin, channel_end = common.channel_tokens(k, tokens, t.channel, cfg.channels)
    middle = k.reg("u32", "middle")
    k.sub(middle, channel_end, channel_begin)
    k.add(middle, middle, 1)
    k.shr(middle, middle, 1)
    k.add(middle, middle, channel_begin)
    s.begin, s.end = k.reg("u32", "begin"), k.reg("u32", "end")
    k.selp(s.begin, channel_begin, middle, t.sender)   # CTA 2c: the first half
    k.selp(s.end, middle, channel_end, t.sender)
    s.buffer = k.reg("u64", "rank_buffer")
    common.buffer_of(k, s.buffer, t.peers, t.group)
    s.in_rank = k.reg("u64", "in_rank")
    k.ld_param(s.in_rank, p.is_token_in_rank)
    s.row = k.reg("u32", "row")   # the row at the group's rank of the next token for it
    at = k.reg("u64", "send_layout_at")
    index = k.reg("u32", "send_index")
    k.mad(index, t.group, cfg.channels, t.channel)
    k.ld_param(at, p.send_layout)
    k.mad(at, index, 4, at, mode="wide")
    k.ld(s.row, addr(at), nc=True)
    with k.if_(~t.sender, "first_half", uniform=True):
        # The second half starts past the first half's tokens for the group's rank.
        first, ballot, n = k.reg("u32", "counted"), k.reg("b32", "counted_ballot"), k.reg(
            "u32", "counted_n")
        with k.loop(first, middle, start=channel_begin, step=BATCH, uniform=True,
                    hint="count_batch"):
            ballot_to_group(k, cfg.ranks, t, s.in_rank, first, middle, ballot)
            k.popc(n, ballot)
            k.add(s.row, s.row, n)
    return s


def _send(k: KernelBuilder, cfg: DirectConfig, p, t, s) -> None:
    first, ballot, n = k.reg("u32", "batch_first"), k.reg("b32", "ballot"), k.reg(
        "u32", "batch_count")
    token = k.reg("u32", "token")

    def send(i, row):
        k.add(token, first, i)
        _send_token(k, cfg, p, t, s, token, row)

    with k.loop(first, s.end, start=s.begin, step=BATCH, uniform=True, hint="send_batch"):
        with k.stage("the batch's tokens for the group's rank: a ballot"):
            ballot_to_group(k, cfg.ranks, t, s.in_rank, first, s.end, ballot)
            k.popc(n, ballot)
        with k.stage("warp `member` sends the batch's rows numbered member mod warps"):
            for_own_entries(k, ballot, s.row, cfg.warps_per_peer, t.member, send)
        k.add(s.row, s.row, n)


def _send_token(k: KernelBuilder, cfg: DirectConfig, p, t, s, token, row) -> None:
    """Token ``token`` to row ``row`` of the group's rank's outputs: every load (scales,
    top-k, the row's vectors) before the first store."""
    src, dst = k.reg("u64", "x_row"), k.reg("u64", "out_row")
    k.ld_param(src, p.x)
    k.mad(src, token, cfg.hidden, src, mode="wide")
    scales, in_row = load_scales(k, p, t.lane, token, cfg.scale_groups)
    store_topk = _load_topk(k, cfg, p, t, s, token, row)
    k.ld_param(dst, p.recv_x)
    k.add(dst, dst, s.buffer)
    k.mad(dst, row, cfg.hidden, dst, mode="wide")
    warp_copy(k, dst, src, cfg.hidden, t.lane, load=common.INPUT_LOAD, store=common.STORE,
              unroll=COPY_UNROLL)
    k.ld_param(dst, p.recv_scales)
    k.add(dst, dst, s.buffer)
    k.mad(dst, row, 4 * cfg.scale_groups, dst, mode="wide")
    lane_words_store(k, dst, scales, in_row, t.lane, store=common.STORE, name="scale")
    store_topk()
    with k.if_(t.lane0, "not_lane0"):
        k.ld_param(dst, p.recv_src_idx)
        k.add(dst, dst, s.buffer)
        k.mad(dst, row, 4, dst, mode="wide")
        k.st(addr(dst), token, **common.STORE)
        index = k.reg("u32", "send_rows_index")
        k.mad(index, token, cfg.ranks, t.group)
        k.ld_param(dst, p.send_rows)
        k.mad(dst, index, 4, dst, mode="wide")
        k.st(addr(dst), row)


def _load_topk(k: KernelBuilder, cfg: DirectConfig, p, t, s, token, row):
    """Lane j < k loads the token's expert j and its weight; returns the emitter that
    stores them into the rank's row, the expert made the rank's (e - d * E / R where rank
    d holds e, else -1, weight 0)."""
    is_pair, index, weight = load_topk(k, p, t.lane, token, cfg.topk)
    local, pair, at = k.pred("local"), k.reg("u32", "pair"), k.reg("u64", "pair_at")

    def store():
        with k.if_(is_pair, "no_pair"):
            per_rank, first_expert, span = k.reg("u32", "experts_per_rank"), k.reg(
                "u64", "first_expert"), k.reg("u64", "experts_here")
            k.ld_param(per_rank, p.experts_per_rank)
            k.mul(first_expert, t.group, per_rank, mode="wide")
            k.cvt(span, per_rank, dtype="u64", stype="u32")
            # -1 and every expert below the rank's first wrap to at least E / R unsigned.
            k.sub(index, index, first_expert)
            k.setp("lt", local, index, span)
            k.selp(index, index, 0xFFFFFFFFFFFFFFFF, local)
            k.selp(weight, weight, 0.0, local)
            k.mad(pair, row, cfg.topk, t.lane)
            k.ld_param(at, p.recv_topk_idx)
            k.add(at, at, s.buffer)
            k.mad(at, pair, 8, at, mode="wide")
            k.st(addr(at), index, **common.STORE)
            k.ld_param(at, p.recv_topk_weights)
            k.add(at, at, s.buffer)
            k.mad(at, pair, 4, at, mode="wide")
            k.st(addr(at), weight, **common.STORE)
    return store


def _fill_unsent(k: KernelBuilder, cfg: DirectConfig, p, t) -> None:
    """Pairs num_recv * k .. worst * k of this rank's top-k outputs: -1 and weight 0,
    pair i by thread i mod (the grid's threads)."""
    with k.stage("the rows nobody sends: top-k -1, weight 0"):
        own, at = k.reg("u64", "own_outputs"), k.reg("u64", "fill_at")
        common.buffer_of(k, own, t.peers, t.rank)
        first, last, pair, step = (k.reg("u32", name) for name in (
            "fill_first", "fill_last", "fill_pair", "fill_step"))
        k.ld_param(at, p.num_recv)
        k.ld(first, addr(at), nc=True)
        k.mul(first, first, cfg.topk, mode="lo")
        k.ld_param(last, p.worst)
        k.mul(last, last, cfg.topk, mode="lo")
        start = k.reg("u32", "fill_start")
        k.mad(start, t.cta, cfg.threads, t.tid)
        k.add(start, start, first)
        k.mov(step, sreg.nctaid.x)
        k.mul(step, step, cfg.threads, mode="lo")
        base_idx, base_weights = k.reg("u64", "fill_idx"), k.reg("u64", "fill_weights")
        k.ld_param(base_idx, p.recv_topk_idx)
        k.add(base_idx, base_idx, own)
        k.ld_param(base_weights, p.recv_topk_weights)
        k.add(base_weights, base_weights, own)
        with k.loop(pair, last, start=start, step=step, hint="fill"):
            k.mad(at, pair, 8, base_idx, mode="wide")
            k.st(addr(at), -1, type="s64")
            k.mad(at, pair, 4, base_weights, mode="wide")
            k.st(addr(at), 0.0, type="f32")


def _wait(k: KernelBuilder, cfg: DirectConfig, t) -> None:
    with k.stage("wait: thread s polls this rank's flag [s][cta] until it reaches n"):
        source = k.pred("a_source")
        k.setp("lt", source, t.tid, cfg.ranks)
        with k.if_(source, "not_a_source"):
            own = k.reg("u64", "done_at")
            common.buffer_of(k, own, t.peers, t.rank)
            common.wait_for_number(k, t, DIRECT_DONE, own, t.tid, t.cta, t.number,
                                   code=common.DIRECT_RECEIVE, channel=t.channel)
