"""Low-latency dispatch: each rank writes each (token, expert) pair of its tokens, quantized
to FP8 beforehand (``ops.quantize_fp8_per_token``, row-major scales: once a token, not
once a pair), straight into slot (l, this rank, i) of the expert's rank (plan.py); each
rank then packs what its local experts received into the masked layout the grouped GEMM
reads.

Roles (common.py: send CTAs first, then receive CTAs; ``WARPS`` warps each):

    sender e (one CTA an expert)   warp w scans batches w, w + WARPS, ... of 32 tokens
                                   (one a lane): the first k position naming e, a ballot,
                                   the batch's count into shared memory; bar.sync; each
                                   routed token's slot = the routed tokens before it (the
                                   earlier batches' counts, then the ballot: token order,
                                   no atomics). Warp w copies its batches' routed tokens
                                   (the ballot's set bits): the e4m3 row (16-byte vectors,
                                   one round), its scales, the (token, k position) pair.
                                   bar.sync, then thread 0 takes the pair's next sequence
                                   number and publishes
                                   ``sequence << 9 | count`` into flag (l, this rank) of the
                                   expert's rank with st.release.sys (count 0 too).
    receiver l (one CTA a local    thread s < R waits (ld.acquire.sys, timed) for flag
    expert)                        (l, s) to carry its next sequence number and shares the
                                   count through shared memory; bar.sync; each source's
                                   rows start after the counts of the ranks before it.
                                   Warp w copies rows w, w + WARPS, ... of each source: the
                                   e4m3 row, its scales (into MN-major recv_scales), and
                                   (source rank, token, k position) into recv_src_info.
                                   Thread 0 writes recv_count[l].

Memory orders: a sender's payload stores precede its flag's release (bar.sync, then one
thread's release); a receiver's loads follow its acquire (the waiting thread's, passed on
by bar.sync). Slots are read with weak loads that skip L1, never through the non-coherent
path; the sender's inputs (x, topk_idx) through it.

Top-k indices outside [0, E) (-1 among them) route nowhere; a token naming an expert twice
goes to it once (its first k position).

Compile-time: ranks, max_tokens, hidden, experts, k, phase. Run-time: tokens (<=
max_tokens), this rank, the pointers and the scales' strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns.copy import lane_words_load, lane_words_store, warp_copy
from ...ptx import KernelBuilder, addr, sreg
from ..ep_intranode import common as intranode
from . import common
from .plan import COUNT_BITS, SEQUENCE_MAX

BATCH = 32                 # tokens a warp scans at once, one a lane


@dataclass(frozen=True)
class DispatchConfig(common.LowLatencyConfig):
    KIND = "dispatch"

    @property
    def grid(self) -> int:
        """Send CTAs (one an expert), then receive CTAs (one a local expert)."""
        return self.experts * self.sends + self.plan.local_experts * self.receives


def choose_config(arch: Arch, ranks: int, max_tokens: int, hidden: int, experts: int,
                  topk: int, *, phase: str = "both") -> DispatchConfig:
    common.check(arch, ranks, max_tokens, hidden, experts, topk, phase, "dispatch",
                 needs=(("fp8", "the low-latency dispatch (FP8 rows)"),))
    return DispatchConfig(ranks, max_tokens, hidden, experts, topk, phase, arch.target)


def generate(cfg: DispatchConfig) -> KernelBuilder:
    k = common.kernel(cfg)
    p = _Params(k, cfg)
    t = common.prologue(k, p, cfg.experts if cfg.phase == "both" else None)
    common.roles(k, cfg, t, lambda: _send(k, cfg, p, t), lambda: _receive(k, cfg, p, t))
    return k


class _Params:
    """Kernel parameters (launches bind them by name)."""

    def __init__(self, k: KernelBuilder, cfg: DispatchConfig):
        if cfg.sends:
            self.x = k.param("x", "u64")                    # e4m3 [T, H], contiguous
            self.x_scales = k.param("x_scales", "u64")      # f32 [T, H / 128], contiguous
            self.topk_idx = k.param("topk_idx", "u64")      # int64 [T, k], contiguous
            self.tokens = k.param("tokens", "u32")          # T <= max_tokens
        common.declare_common_params(k, self)
        if cfg.receives:
            self.recv_x = k.param("recv_x", "u64")          # e4m3 [L, R * max_tokens, H]
            self.recv_scales = k.param("recv_scales", "u64")  # f32 [L, R * max_tokens, H / 128]
            self.scale_expert_stride = k.param("scale_expert_stride", "u32")  # elements
            self.scale_group_stride = k.param("scale_group_stride", "u32")    # (row stride 1)
            self.recv_src_info = k.param("recv_src_info", "u64")  # int32 [L, R * max_tokens, 3]
            self.recv_count = k.param("recv_count", "u64")  # int32 [L]


def advance_sequence(k: KernelBuilder, sequence) -> None:
    """Two instructions: ``sequence`` = the next sequence number (plan.next_sequence)."""
    k.rem(sequence, sequence, SEQUENCE_MAX)
    k.add(sequence, sequence, 1)


def _send(k, cfg, p, t) -> None:
    plan, s = cfg.plan, SimpleNamespace()
    expert = t.index
    with k.stage("sender: the expert's rank, its slots (l, this rank) there, the inputs"):
        dest, local, pair = k.reg("u32", "dest_rank"), k.reg("u32", "local_expert"), k.reg(
            "u32", "pair_index")
        k.div(dest, expert, plan.local_experts)
        k.rem(local, expert, plan.local_experts)
        peer = k.reg("u64", "peer_buffer")
        intranode.buffer_of(k, peer, t.peers, dest)
        k.mad(pair, local, cfg.ranks, t.rank)
        s.slots, s.flag_at = k.reg("u64", "slots"), k.reg("u64", "flag_at")
        k.add(s.slots, peer, plan.dispatch_slots)
        k.mad(s.slots, pair, cfg.max_tokens * plan.slot_bytes, s.slots, mode="wide")
        k.add(s.flag_at, peer, plan.dispatch_flags)
        k.mad(s.flag_at, pair, 4, s.flag_at, mode="wide")
        s.tokens, s.x, idx = k.reg("u32", "tokens"), k.reg("u64", "x"), k.reg("u64", "topk_idx")
        k.ld_param(s.tokens, p.tokens)
        k.ld_param(s.x, p.x)
        s.x_scales = k.reg("u64", "x_scales")
        k.ld_param(s.x_scales, p.x_scales)
        k.ld_param(idx, p.topk_idx)
        wanted = k.reg("u64", "expert_wide")
        k.cvt(wanted, expert, dtype="u64", stype="u32")
        lanes_below = k.reg("u32", "lanes_below")
        k.mov(lanes_below, sreg.lanemask_lt)
    batches = -(-cfg.max_tokens // BATCH)
    rounds = -(-batches // common.WARPS)  # the batches a warp scans: w, w + WARPS, ...
    counts_at = k.reg("u32", "batch_counts_at")
    k.mov(counts_at, k.shared("batch_counts", 4 * batches, align=4))
    ballots, positions = k.regs("b32", rounds, "ballot"), k.regs("u32", rounds, "position")
    token, n, batch = (k.reg("u32", name) for name in ("lane_token", "batch_count", "batch"))
    idx_at, index, at = k.reg("u64", "idx_at"), k.reg("u64", "index"), k.reg("u32", "count_at")
    in_batch, match, goes, exists = (k.pred(name) for name in (
        "in_batch", "match", "goes", "batch_exists"))
    with k.stage("scan: warp w's batches w, w + WARPS, ...: each lane's token's first k "
                 "position naming the expert, a ballot, the batch's count to shared memory"):
        for r in range(rounds):
            k.add(batch, t.warp, common.WARPS * r)
            k.mad(token, batch, BATCH, t.lane)
            k.setp("lt", in_batch, token, s.tokens)
            k.mad(idx_at, token, 8 * cfg.topk, idx, mode="wide")
            k.mov(positions[r], cfg.topk)  # none
            for j in reversed(range(cfg.topk)):  # the last match kept is the first position
                k.mov(index, -1)
                with k.guard(in_batch):
                    k.ld(index, addr(idx_at, 8 * j), **intranode.INPUT_LOAD)
                k.setp("eq", match, index, wanted)
                with k.guard(match):
                    k.mov(positions[r], j)
            k.setp("lt", goes, positions[r], cfg.topk)
            k.vote_sync(ballots[r], goes, mode="ballot")
            k.popc(n, ballots[r])
            k.setp("lt", exists, batch, batches)
            k.and_pred(exists, exists, t.lane0)
            k.mad(at, batch, 4, counts_at)
            with k.guard(exists):
                k.st(addr(at), n, space="shared")
        k.bar_sync(0)
    first, slot, before, earlier = (k.reg("u32", name) for name in (
        "batch_first", "lane_slot", "routed_before", "earlier_batch"))
    for r in range(rounds):
        with k.stage("copy: the batch's routed tokens, their slots after the earlier batches'"):
            k.add(batch, t.warp, common.WARPS * r)
            k.setp("lt", exists, batch, batches)
            with k.if_(exists, f"no_batch_{r}", uniform=True):
                k.mul(first, batch, BATCH, mode="lo")
                k.mov(before, 0)
                with k.loop(earlier, batch, uniform=True, hint="earlier_batch"):
                    k.mad(at, earlier, 4, counts_at)
                    k.ld(n, addr(at), space="shared")
                    k.add(before, before, n)
                k.and_(slot, ballots[r], lanes_below)
                k.popc(slot, slot)
                k.add(slot, slot, before)
                _send_batch(k, cfg, t, s, first, ballots[r], slot, positions[r])
    with k.stage("publish: the CTA's rows, then sequence << 9 | count (st.release.sys)"):
        k.bar_sync(0)
        with k.if_(t.thread0, "not_publishing"):
            count = k.reg("u32", "count")  # the tokens routed to the expert
            k.mov(count, 0)
            for b in range(batches):
                k.ld(n, addr(counts_at, 4 * b), space="shared")
                k.add(count, count, n)
            sequence, sequence_at = k.reg("u32", "sequence"), k.reg("u64", "sequence_at")
            k.mad(sequence_at, expert, 4, t.own, mode="wide")
            k.ld(sequence, addr(sequence_at, plan.dispatch_sent), sem="relaxed", scope="sys")
            advance_sequence(k, sequence)
            k.st(addr(sequence_at, plan.dispatch_sent), sequence, sem="relaxed", scope="sys")
            word = k.reg("u32", "flag")
            k.shl(word, sequence, COUNT_BITS)
            k.or_(word, word, count)
            k.st(addr(s.flag_at), word, sem="release", scope="sys")


def _send_batch(k, cfg, t, s, first, ballot, slot, position) -> None:
    """The batch's routed tokens (the set bits of ``ballot``, highest first), lane i's at
    slot ``slot`` of lane i: the warp visits only those."""
    bits, bit, i = k.reg("b32", "routed_bits"), k.reg("u32", "bit"), k.reg("u32", "batch_lane")
    token_slot, token_position = k.reg("u32", "token_slot"), k.reg("u32", "token_position")
    none_left = k.pred("none_left")
    top, done = k.label("routed"), k.label("routed_end")
    k.mov(bits, ballot)
    k.place(top)
    k.setp("eq", none_left, bits, 0)
    with k.guard(none_left):
        k.bra(done, uniform=True)
    k.bfind(i, bits)
    k.shl(bit, 1, i)
    k.xor(bits, bits, bit)
    k.shfl_sync(token_slot, slot, i, mode="idx")
    k.shfl_sync(token_position, position, i, mode="idx")
    token = k.reg("u32", "token")
    k.add(token, first, i)
    _send_token(k, cfg, t, s, token, token_slot, token_position)
    k.bra(top, uniform=True)
    k.place(done)


def _send_token(k, cfg, t, s, token, slot, position) -> None:
    """Copy x[token] (e4m3), its scales and its (token, k position) pair into slot
    ``slot``: the scales' loads (one f32 a lane) issued first, then the row's (16-byte
    vectors, up to COPY_UNROLL a lane at once), so that a row costs one load latency."""
    plan = cfg.plan
    src, dst = k.reg("u64", "x_row"), k.reg("u64", "slot_at")
    k.mad(src, token, cfg.hidden, s.x, mode="wide")
    k.mad(dst, slot, plan.slot_bytes, s.slots, mode="wide")
    scale_row = k.reg("u64", "scale_row")
    k.mul(scale_row, token, 4 * plan.scale_groups, mode="wide")
    k.add(scale_row, scale_row, s.x_scales)
    with k.stage("scales: one f32 a lane, loaded"):
        scales, in_row = lane_words_load(k, scale_row, plan.scale_groups, t.lane,
                                         load=intranode.INPUT_LOAD, name="scale")
    with k.stage("row: the e4m3 bytes, 16 a lane at a time"):
        warp_copy(k, dst, src, cfg.hidden, t.lane, load=intranode.INPUT_LOAD,
                  store=intranode.STORE, unroll=common.COPY_UNROLL)
    with k.stage("scales: stored"):
        lane_words_store(k, dst, scales, in_row, t.lane, store=intranode.STORE, name="scale",
                         offset=plan.slot_scales)
    with k.if_(t.lane0, "not_lane0"):
        k.st(addr(dst, plan.slot_source), token, **intranode.STORE)
        k.st(addr(dst, plan.slot_source + 4), position, **intranode.STORE)


def _receive(k, cfg, p, t) -> None:
    plan, local = cfg.plan, t.index
    with k.stage("receiver: thread s < R waits for flag (l, s) to carry its next sequence number"):
        counts_at = k.reg("u32", "counts_at")
        k.mov(counts_at, k.shared("counts", 4 * cfg.ranks, align=4))
        waiter = k.pred("waiter")
        k.setp("lt", waiter, t.tid, cfg.ranks)
        with k.if_(waiter, "not_waiting"):
            pair, seen, got = k.reg("u32", "pair_index"), k.reg("u32", "flag_seen"), k.reg(
                "u32", "sequence_seen")
            expected, at = k.reg("u32", "sequence"), k.reg("u64", "pair_at")
            ready = k.pred("arrived")
            k.mad(pair, local, cfg.ranks, t.tid)
            k.mad(at, pair, 4, t.own, mode="wide")
            k.ld(expected, addr(at, plan.dispatch_received), sem="relaxed", scope="sys")
            advance_sequence(k, expected)

            def arrived(flag):
                k.shr(got, flag, COUNT_BITS)
                k.setp("eq", ready, got, expected)
                return ready

            t.watchdog.wait(seen, addr(at, plan.dispatch_flags), arrived,
                            code=intranode.LL_DISPATCH_RECEIVE, channel=local, peer=t.tid)
            k.st(addr(at, plan.dispatch_received), expected, sem="relaxed", scope="sys")
            k.and_(seen, seen, (1 << COUNT_BITS) - 1)
            shared_at = k.reg("u32", "count_at")
            k.mad(shared_at, t.tid, 4, counts_at)
            k.st(addr(shared_at), seen, space="shared")
        k.bar_sync(0)
    with k.stage("each source's count and first row; recv_count[l]"):
        counts = k.regs("u32", cfg.ranks, "count")
        firsts = k.regs("u32", cfg.ranks, "first_row")
        for s in range(cfg.ranks):
            k.ld(counts[s], addr(counts_at, 4 * s), space="shared")
            if s == 0:
                k.mov(firsts[0], 0)
            else:
                k.add(firsts[s], firsts[s - 1], counts[s - 1])
        total, at = k.reg("u32", "received"), k.reg("u64", "recv_count_at")
        k.add(total, firsts[-1], counts[-1])
        with k.if_(t.thread0, "not_counting"):
            k.ld_param(at, p.recv_count)
            k.mad(at, local, 4, at, mode="wide")
            k.st(addr(at), total)
    i = k.reg("u32", "slot_index")
    for s in range(cfg.ranks):
        with k.loop(i, counts[s], start=t.warp, step=common.WARPS, uniform=True,
                    hint=f"source_{s}_row"):
            _receive_row(k, cfg, p, t, s, i, firsts[s])


def _receive_row(k, cfg, p, t, source: int, i, first) -> None:
    """Slot (l, source, i) to row first + i of expert l's rows: the e4m3 row, its scales,
    its (source rank, token, k position). The scales' and the pair's loads go out with
    the row's, so that a row costs one load latency."""
    plan, local = cfg.plan, t.index
    rows = cfg.ranks * cfg.max_tokens
    slot, row, src, dst = k.reg("u32", "slot"), k.reg("u32", "row"), k.reg(
        "u64", "slot_at"), k.reg("u64", "out_row")
    k.mad(slot, local, cfg.ranks, source)
    k.mad(slot, slot, cfg.max_tokens, i)
    k.mad(src, slot, plan.slot_bytes, t.own, mode="wide")
    k.add(src, src, plan.dispatch_slots)
    k.add(row, first, i)
    k.mad(row, local, rows, row)  # among all experts' rows
    group, at = k.reg("u32", "group"), k.reg("u64", "scale_at")
    token, position = k.reg("u32", "token"), k.reg("u32", "position")
    with k.stage("load: the scales (lane g: group g), the (token, k position) pair"):
        scales, in_row = lane_words_load(k, src, plan.scale_groups, t.lane,
                                         load=intranode.PAYLOAD_LOAD, name="scale",
                                         offset=plan.slot_scales)
        with k.guard(t.lane0):
            k.ld(token, addr(src, plan.slot_source), **intranode.PAYLOAD_LOAD)
            k.ld(position, addr(src, plan.slot_source + 4), **intranode.PAYLOAD_LOAD)
    with k.stage("the row: e4m3 bytes, 16 a lane at a time"):
        k.ld_param(dst, p.recv_x)
        k.mad(dst, row, cfg.hidden, dst, mode="wide")
        warp_copy(k, dst, src, cfg.hidden, t.lane, load=intranode.PAYLOAD_LOAD, store={},
                  unroll=common.COPY_UNROLL)
    with k.stage("store: scale g to recv_scales[l, row, g] (MN-major), the row's source"):
        element = k.reg("u32", "scale_element")
        expert_stride, group_stride = k.reg("u32", "scale_expert_stride"), k.reg(
            "u32", "scale_group_stride")
        k.ld_param(expert_stride, p.scale_expert_stride)
        k.ld_param(group_stride, p.scale_group_stride)
        for trip in range(len(scales)):
            k.add(group, t.lane, 32 * trip)
            k.add(element, first, i)
            k.mad(element, group, group_stride, element)
            k.mad(element, local, expert_stride, element)
            k.ld_param(at, p.recv_scales)
            k.mad(at, element, 4, at, mode="wide")
            with k.guard(in_row[trip]):
                k.st(addr(at), scales[trip])
        with k.if_(t.lane0, "not_lane0"):
            k.ld_param(at, p.recv_src_info)
            k.mad(at, row, 12, at, mode="wide")
            k.st(addr(at), source, type="u32")
            k.st(addr(at, 4), token)
            k.st(addr(at, 8), position)
