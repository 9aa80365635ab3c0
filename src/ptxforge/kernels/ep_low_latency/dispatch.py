"""Low-latency dispatch: each rank writes each of its tokens, quantized to FP8 beforehand
(``ops.quantize_fp8_per_token``, row-major scales: once a token), once into every rank
that holds one of its experts (slot (this rank, token) there, plan.py), with its top-k
row as that rank's local experts; each rank's receivers then copy what its local experts
were sent into the masked layout the grouped GEMM reads.

Why once a rank and not once a (token, expert) pair: a token's k experts often share a
rank (top-8 of 256 over 2 ranks: about 4 a rank), the NVLink bytes are what a decode
dispatch waits for, and the receivers' copies into each expert's rows run at HBM speed.

Roles (common.py: send CTAs first, then receive CTAs; ``WARPS`` warps each):

    sender (d, c) (C CTAs a       warp w takes tokens w, w + WARPS, ... of its chunk
    destination rank d)           (plan.send_chunk tokens): lane j < k loads the token's
                                  j-th expert and stores it as d's local expert (-1: an
                                  expert elsewhere, or none) into d's top-k row (this rank,
                                  token), and its weight beside it where the dispatch was
                                  given weights; if a ballot finds one on d, the warp copies
                                  the e4m3 row (16-byte vectors, one round) and its scales
                                  into slot (this rank, token) of d. bar.sync, then thread 0
                                  takes its next sequence number and publishes
                                  ``sequence << 9 | tokens`` into flag (this rank, c) of d
                                  with st.release.sys (every CTA, tokens or none).
    receiver l (one CTA a local   thread (s, c) < R x C waits (ld.acquire.sys, timed) for
    expert)                       flag (s, c) to carry the next sequence number of pair
                                  (l, s); (s, 0) shares rank s's token count. bar.sync;
                                  the warps take units (source s, batch of 32 tokens, one a
                                  lane) in turn, w, w + WARPS, ...: the first k position
                                  naming l in each token's top-k row, a ballot, the unit's
                                  count into shared memory; bar.sync; each unit's first row
                                  the counts of the units before it summed (source s's rows
                                  follow the earlier sources', in token order: no atomics),
                                  thread ``units`` writing recv_count[l]; bar.sync. Each
                                  warp copies its units' routed tokens: slot (s, token)'s
                                  e4m3 row, its scales (into MN-major recv_scales), (s,
                                  token, k position) into recv_src_info, and the row into
                                  dispatch_rows (s, token, j) for each j naming l.

Memory orders: a sender's payload stores precede its flag's release (bar.sync, then one
thread's release); a receiver's loads follow its acquires (the waiting threads', passed
on by bar.sync). Slots and top-k rows are read with weak loads that skip L1, never
through the non-coherent path; the sender's inputs (x, its scales, topk_idx) through it.

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
# Top-k words a receive lane loads before matching them: the rounds' loads overlap, within
# MIN_CTAS_PER_SM's 128 registers a thread (8 ranks x 256 tokens at top-16: 128 words in
# one group spilled).
SCAN_WORDS = 64


@dataclass(frozen=True)
class DispatchConfig(common.LowLatencyConfig):
    KIND = "dispatch"
    # A send warp a token of its CTA's 8, and a local expert's receive units (a source's
    # batch of 32 tokens, about one routed row at 4 ranks) over twice the warps: each warp
    # pays half the load latencies in a row. Two such CTAs an SM keep 128 registers a
    # thread; R x C + L CTAs (160 for 256 experts over 2 or 8 ranks) fit 264.
    WARPS = 8
    MIN_CTAS_PER_SM = 2

    @property
    def send_grid(self) -> int:
        """C send CTAs a destination rank."""
        return self.ranks * self.plan.send_ctas

    @property
    def grid(self) -> int:
        """Send CTAs (C a destination rank), then receive CTAs (one a local expert)."""
        return self.send_grid * self.sends + self.plan.local_experts * self.receives


def choose_config(arch: Arch, ranks: int, max_tokens: int, hidden: int, experts: int,
                  topk: int, *, phase: str = "both") -> DispatchConfig:
    common.check(arch, ranks, max_tokens, hidden, experts, topk, phase, "dispatch",
                 needs=(("fp8", "the low-latency dispatch (FP8 rows)"),))
    return DispatchConfig(ranks, max_tokens, hidden, experts, topk, phase, arch.target)


def generate(cfg: DispatchConfig) -> KernelBuilder:
    k = common.kernel(cfg)
    p = _Params(k, cfg)
    t = common.prologue(k, p, cfg.send_grid if cfg.phase == "both" else None)
    common.roles(k, cfg, t, lambda: _send(k, cfg, p, t), lambda: _receive(k, cfg, p, t))
    return k


class _Params:
    """Kernel parameters (launches bind them by name)."""

    def __init__(self, k: KernelBuilder, cfg: DispatchConfig):
        if cfg.sends:
            self.x = k.param("x", "u64")                    # e4m3 [T, H], contiguous
            self.x_scales = k.param("x_scales", "u64")      # f32 [T, H / 128], contiguous
            self.topk_idx = k.param("topk_idx", "u64")      # int64 [T, k], contiguous
            self.topk_weights = k.param("topk_weights", "u64")  # f32 [T, k], or 0: none
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
    with k.stage("sender (d, c): rank d's buffer, this rank's top-k rows and slots there, "
                 "the CTA's tokens"):
        dest, cta = k.reg("u32", "dest_rank"), k.reg("u32", "send_cta")
        k.div(dest, t.index, plan.send_ctas)
        k.rem(cta, t.index, plan.send_ctas)
        peer = k.reg("u64", "peer_buffer")
        intranode.buffer_of(k, peer, t.peers, dest)
        s.slots, s.topk_rows, s.flag_at = (k.reg("u64", name) for name in (
            "slots", "topk_rows", "flag_at"))
        k.add(s.slots, peer, plan.dispatch_slots)
        k.mad(s.slots, t.rank, cfg.max_tokens * plan.slot_bytes, s.slots, mode="wide")
        k.add(s.topk_rows, peer, plan.dispatch_topk)
        k.mad(s.topk_rows, t.rank, 4 * cfg.max_tokens * cfg.topk, s.topk_rows, mode="wide")
        flag = k.reg("u32", "flag_index")
        k.mad(flag, t.rank, plan.send_ctas, cta)
        k.add(s.flag_at, peer, plan.dispatch_flags)
        k.mad(s.flag_at, flag, 4, s.flag_at, mode="wide")
        s.first_expert = k.reg("u64", "first_expert")  # d's experts: [first, first + L)
        k.mul(s.first_expert, dest, plan.local_experts, mode="wide")
        s.tokens, s.x, s.x_scales, s.topk_idx = (k.reg(kind, name) for kind, name in (
            ("u32", "tokens"), ("u64", "x"), ("u64", "x_scales"), ("u64", "topk_idx")))
        k.ld_param(s.tokens, p.tokens)
        k.ld_param(s.x, p.x)
        k.ld_param(s.x_scales, p.x_scales)
        k.ld_param(s.topk_idx, p.topk_idx)
        s.topk_weights, s.weighted = k.reg("u64", "topk_weights"), k.pred("weighted")
        k.ld_param(s.topk_weights, p.topk_weights)
        k.setp("ne", s.weighted, s.topk_weights, 0)
        first, end = k.reg("u32", "chunk_first"), k.reg("u32", "chunk_end")
        k.mul(first, cta, plan.send_chunk, mode="lo")
        k.add(end, first, plan.send_chunk)
        k.min(end, end, s.tokens)
        k.add(first, first, t.warp)
    token = k.reg("u32", "token")
    with k.loop(token, end, start=first, step=cfg.WARPS, uniform=True, hint="token"):
        _send_token(k, cfg, t, s, token)
    with k.stage("publish: the CTA's rows, then sequence << 9 | tokens (st.release.sys)"):
        k.bar_sync(0)
        with k.if_(t.thread0, "not_publishing"):
            sequence, sequence_at = k.reg("u32", "sequence"), k.reg("u64", "sequence_at")
            k.mad(sequence_at, t.index, 4, t.own, mode="wide")  # (d, c): d * C + c
            k.ld(sequence, addr(sequence_at, plan.dispatch_sent), sem="relaxed", scope="sys")
            advance_sequence(k, sequence)
            k.st(addr(sequence_at, plan.dispatch_sent), sequence, sem="relaxed", scope="sys")
            word = k.reg("u32", "flag")
            k.shl(word, sequence, COUNT_BITS)
            k.or_(word, word, s.tokens)
            k.st(addr(s.flag_at), word, sem="release", scope="sys")


def _send_token(k, cfg, t, s, token) -> None:
    """Lane j < k: the token's j-th expert as d's local expert (or -1) into d's top-k row;
    then, if any lives on d, x[token] (e4m3) and its scales into the token's slot there:
    the scales' loads (one f32 a lane) issued first, then the row's (16-byte vectors, up to
    COPY_UNROLL a lane at once), so that a row costs one load latency."""
    plan = cfg.plan
    with k.stage("top-k: lane j's expert, as one of d's or -1, into d's top-k row"):
        in_k, here, any_here = k.pred("in_k"), k.pred("expert_here"), k.pred("token_goes")
        index, at = k.reg("u64", "index"), k.reg("u64", "index_at")
        local, ballot = k.reg("u32", "local_expert"), k.reg("b32", "experts_here")
        k.setp("lt", in_k, t.lane, cfg.topk)
        k.mad(at, token, 8 * cfg.topk, s.topk_idx, mode="wide")
        k.mad(at, t.lane, 8, at, mode="wide")
        k.mov(index, -1)
        with k.guard(in_k):
            k.ld(index, addr(at), **intranode.INPUT_LOAD)
        k.sub(index, index, s.first_expert)  # -1 and indices outside [0, E) wrap high
        k.setp("lt", here, index, plan.local_experts)
        k.and_pred(here, here, in_k)
        k.mov(local, -1)
        with k.guard(here):
            k.cvt(local, index, dtype="u32", stype="u64")
        k.mad(at, token, 4 * cfg.topk, s.topk_rows, mode="wide")
        k.mad(at, t.lane, 4, at, mode="wide")
        with k.guard(in_k):
            k.st(addr(at), local, **intranode.STORE)
        # Its weight beside it, for a combine that sums on the experts' rank.
        weighted, weight, weight_at = k.pred("lane_weighted"), k.reg("f32", "weight"), k.reg(
            "u64", "weight_at")
        k.and_pred(weighted, in_k, s.weighted)
        k.mad(weight_at, token, 4 * cfg.topk, s.topk_weights, mode="wide")
        k.mad(weight_at, t.lane, 4, weight_at, mode="wide")
        with k.guard(weighted):
            k.ld(weight, addr(weight_at), **intranode.INPUT_LOAD)
            k.st(addr(at, plan.dispatch_weights - plan.dispatch_topk), weight,
                 **intranode.STORE)
        k.vote_sync(ballot, here, mode="ballot")
        k.setp("ne", any_here, ballot, 0)
    with k.if_(any_here, "token_stays", uniform=True):
        src, dst = k.reg("u64", "x_row"), k.reg("u64", "slot_at")
        k.mad(src, token, cfg.hidden, s.x, mode="wide")
        k.mad(dst, token, plan.slot_bytes, s.slots, mode="wide")
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
            lane_words_store(k, dst, scales, in_row, t.lane, store=intranode.STORE,
                             name="scale", offset=plan.slot_scales)


def _receive(k, cfg, p, t) -> None:
    plan, local = cfg.plan, t.index
    flags = cfg.ranks * plan.send_ctas
    with k.stage("receiver: thread (s, c) < R x C waits for flag (s, c) to carry pair "
                 "(l, s)'s next sequence number"):
        tokens_at = k.reg("u32", "source_tokens_at")
        k.mov(tokens_at, k.shared("source_tokens", 4 * cfg.ranks, align=4))
        waiter, first_cta = k.pred("waiter"), k.pred("first_cta")
        source, cta = k.reg("u32", "source"), k.reg("u32", "send_cta")
        expected, pair_at = k.reg("u32", "sequence"), k.reg("u64", "pair_at")
        k.setp("lt", waiter, t.tid, flags)
        k.div(source, t.tid, plan.send_ctas)
        k.rem(cta, t.tid, plan.send_ctas)
        k.setp("eq", first_cta, cta, 0)
        k.and_pred(first_cta, first_cta, waiter)
        pair = k.reg("u32", "pair_index")
        k.mad(pair, local, cfg.ranks, source)
        k.mad(pair_at, pair, 4, t.own, mode="wide")
        k.mov(expected, 0)
        with k.guard(waiter):
            k.ld(expected, addr(pair_at, plan.dispatch_received), sem="relaxed", scope="sys")
        advance_sequence(k, expected)
        # Every waiter has its number before (s, 0) stores the next one.
        k.bar_sync(0)
        with k.if_(waiter, "not_waiting"):
            seen, got, at = k.reg("u32", "flag_seen"), k.reg("u32", "sequence_seen"), k.reg(
                "u64", "flag_at")
            ready = k.pred("arrived")
            k.mad(at, t.tid, 4, t.own, mode="wide")  # flag (s, c): s * C + c

            def arrived(flag):
                k.shr(got, flag, COUNT_BITS)
                k.setp("eq", ready, got, expected)
                return ready

            t.watchdog.wait(seen, addr(at, plan.dispatch_flags), arrived,
                            code=intranode.LL_DISPATCH_RECEIVE, channel=local, peer=source)
            with k.if_(first_cta, "not_first_cta"):
                k.st(addr(pair_at, plan.dispatch_received), expected, sem="relaxed",
                     scope="sys")
                k.and_(seen, seen, (1 << COUNT_BITS) - 1)
                shared_at = k.reg("u32", "tokens_at")
                k.mad(shared_at, source, 4, tokens_at)
                k.st(addr(shared_at), seen, space="shared")
        k.bar_sync(0)
    units = _Units(cfg)
    counts_at, firsts_at = k.reg("u32", "unit_counts_at"), k.reg("u32", "unit_firsts_at")
    k.mov(counts_at, k.shared("unit_counts", 4 * units.count, align=4))
    k.mov(firsts_at, k.shared("unit_firsts", 4 * (units.count + 1), align=4))
    ballots, positions = _scan(k, cfg, t, units, tokens_at, counts_at)
    k.bar_sync(0)
    _unit_firsts(k, cfg, p, t, units, counts_at, firsts_at)
    k.bar_sync(0)
    _copy_units(k, cfg, p, t, units, firsts_at, ballots, positions)


class _Units:
    """The receive's work: unit u = (source s, batch b) = s x batches + b, a batch
    ``BATCH`` tokens of source s (one a lane); warp w takes units w, w + WARPS, ..., a
    round each, so that a local expert's few rows a source spread over all its warps.
    Their order is the rows' order: source s's rows follow the earlier sources', in token
    order."""

    def __init__(self, cfg: DispatchConfig):
        self.batches = -(-cfg.max_tokens // BATCH)
        self.count = cfg.ranks * self.batches
        self.rounds = -(-self.count // cfg.WARPS)

    def unit(self, k, t, cfg, r: int, unit, exists) -> None:
        """Round r's unit of this warp, and whether it exists."""
        k.add(unit, t.warp, cfg.WARPS * r)
        k.setp("lt", exists, unit, self.count)

    def coordinates(self, k, t, cfg, r: int, unit, source, batch, exists) -> None:
        """Round r's unit of this warp, its source and batch, and whether it exists."""
        self.unit(k, t, cfg, r, unit, exists)
        k.div(source, unit, self.batches)
        k.rem(batch, unit, self.batches)


def _scan(k, cfg, t, units: _Units, tokens_at, counts_at):
    """Each round's unit: lane i's token's first k position naming the local expert in
    its top-k row (k: none), a ballot, the unit's count into shared memory; the top-k
    loads of as many rounds as SCAN_WORDS registers hold issued before their first match.
    Returns (ballots, positions), a register a round."""
    plan, local = cfg.plan, t.index
    ballots = k.regs("b32", units.rounds, "ballot")
    positions = k.regs("u32", units.rounds, "position")
    group = max(1, min(units.rounds, SCAN_WORDS // cfg.topk))
    values = [k.regs("u32", cfg.topk, f"top_k_{r}_") for r in range(group)]
    unit, source, batch, tokens, token, n = (k.reg("u32", name) for name in (
        "unit", "source", "batch", "source_token_count", "lane_token", "unit_count"))
    row_at, at = k.reg("u64", "top_k_row"), k.reg("u32", "count_at")
    exists, in_batch, match, goes = (k.pred(name) for name in (
        "unit_exists", "in_batch", "match", "goes"))
    for first in range(0, units.rounds, group):
        rounds = range(first, min(first + group, units.rounds))
        with k.stage("scan: the top-k rows of a group of rounds' units, loaded"):
            for r in rounds:
                units.coordinates(k, t, cfg, r, unit, source, batch, exists)
                k.mad(at, source, 4, tokens_at)
                k.mov(tokens, 0)
                with k.guard(exists):
                    k.ld(tokens, addr(at), space="shared")
                k.mad(token, batch, BATCH, t.lane)
                k.setp("lt", in_batch, token, tokens)
                k.and_pred(in_batch, in_batch, exists)
                k.mad(token, source, cfg.max_tokens, token)  # slot (source, token)
                k.mad(row_at, token, 4 * cfg.topk, t.own, mode="wide")
                for j, value in enumerate(values[r - first]):
                    k.mov(value, -1)
                    with k.guard(in_batch):
                        k.ld(value, addr(row_at, plan.dispatch_topk + 4 * j),
                             **intranode.PAYLOAD_LOAD)
        with k.stage("scan: the first k position naming the local expert, a ballot, the "
                     "count"):
            for r in rounds:
                k.mov(positions[r], cfg.topk)  # none
                for j in reversed(range(cfg.topk)):  # the last match kept is the first
                    k.setp("eq", match, values[r - first][j], local)
                    with k.guard(match):
                        k.mov(positions[r], j)
                k.setp("lt", goes, positions[r], cfg.topk)
                k.vote_sync(ballots[r], goes, mode="ballot")
                k.popc(n, ballots[r])
                units.unit(k, t, cfg, r, unit, exists)
                k.and_pred(exists, exists, t.lane0)
                k.mad(at, unit, 4, counts_at)
                with k.guard(exists):
                    k.st(addr(at), n, space="shared")
    return ballots, positions


def _unit_firsts(k, cfg, p, t, units: _Units, counts_at, firsts_at) -> None:
    """Thread u <= units: unit u's first row, the units before it's counts summed (thread
    ``units.count``: the expert's rows, into recv_count[l])."""
    with k.stage("each unit's first row; recv_count[l]"):
        mine, last = k.pred("sums_a_unit"), k.pred("counts_rows")
        k.setp("le", mine, t.tid, units.count)
        with k.if_(mine, "not_summing"):
            before, earlier, n, at = (k.reg("u32", name) for name in (
                "rows_before", "earlier_unit", "earlier_count", "earlier_at"))
            k.mov(before, 0)
            with k.loop(earlier, t.tid, hint="earlier_unit"):
                k.mad(at, earlier, 4, counts_at)
                k.ld(n, addr(at), space="shared")
                k.add(before, before, n)
            k.mad(at, t.tid, 4, firsts_at)
            k.st(addr(at), before, space="shared")
            k.setp("eq", last, t.tid, units.count)
            with k.guard(last):
                count_at = k.reg("u64", "recv_count_at")
                k.ld_param(count_at, p.recv_count)
                k.mad(count_at, t.index, 4, count_at, mode="wide")
                k.st(addr(count_at), before)


def _copy_units(k, cfg, p, t, units: _Units, firsts_at, ballots, positions) -> None:
    """Each round's unit's routed tokens: lane i's to the unit's first row + the routed
    lanes below it."""
    lanes_below = k.reg("u32", "lanes_below")
    k.mov(lanes_below, sreg.lanemask_lt)
    unit, source, batch, first, slot, at = (k.reg("u32", name) for name in (
        "unit", "source", "batch", "batch_first", "lane_slot", "first_at"))
    exists = k.pred("unit_exists")
    for r, (ballot, position) in enumerate(zip(ballots, positions)):
        with k.stage(f"copy: round {r}'s unit's routed tokens, after the earlier units' rows"):
            units.coordinates(k, t, cfg, r, unit, source, batch, exists)
            with k.if_(exists, f"no_unit_{r}", uniform=True):
                k.mul(first, batch, BATCH, mode="lo")
                k.mad(at, unit, 4, firsts_at)
                k.ld(slot, addr(at), space="shared")
                before = k.reg("u32", "routed_below")
                k.and_(before, ballot, lanes_below)
                k.popc(before, before)
                k.add(slot, slot, before)
                _receive_batch(k, cfg, p, t, source, first, ballot, slot, position)


def _receive_batch(k, cfg, p, t, source, first, ballot, row, position) -> None:
    """The batch's routed tokens (the set bits of ``ballot``, highest first), lane i's to
    row ``row`` of lane i: the warp visits only those."""
    bits, bit, i = k.reg("b32", "routed_bits"), k.reg("u32", "bit"), k.reg("u32", "batch_lane")
    token_row, token_position = k.reg("u32", "token_row"), k.reg("u32", "token_position")
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
    k.shfl_sync(token_row, row, i, mode="idx")
    k.shfl_sync(token_position, position, i, mode="idx")
    token = k.reg("u32", "token")
    k.add(token, first, i)
    _receive_row(k, cfg, p, t, source, token, token_row, token_position)
    k.bra(top, uniform=True)
    k.place(done)


def _receive_row(k, cfg, p, t, source, token, i, position) -> None:
    """Slot (source, token) to row i of expert l's rows: the e4m3 row, its scales, its
    (source rank, token, k position), and i into dispatch_rows for each k position naming
    l. The scales' and the top-k row's loads go out with the row's, so that a row costs
    one load latency."""
    plan, local = cfg.plan, t.index
    rows = cfg.ranks * cfg.max_tokens
    slot, row, src, dst = k.reg("u32", "slot"), k.reg("u32", "row"), k.reg(
        "u64", "slot_at"), k.reg("u64", "out_row")
    k.mad(slot, source, cfg.max_tokens, token)
    k.mad(src, slot, plan.slot_bytes, t.own, mode="wide")
    k.add(src, src, plan.dispatch_slots)
    k.mad(row, local, rows, i)  # among all experts' rows
    group, at = k.reg("u32", "group"), k.reg("u64", "scale_at")
    with k.stage("load: the scales (lane g: group g), lane j < k the token's j-th local expert"):
        scales, in_row = lane_words_load(k, src, plan.scale_groups, t.lane,
                                         load=intranode.PAYLOAD_LOAD, name="scale",
                                         offset=plan.slot_scales)
        in_k, names = k.pred("in_k"), k.pred("names_expert")
        value, pair, pair_at = k.reg("u32", "top_k_value"), k.reg("u32", "pair_index"), k.reg(
            "u64", "pair_at")
        k.setp("lt", in_k, t.lane, cfg.topk)
        k.mad(pair, slot, cfg.topk, t.lane)
        k.mad(pair_at, pair, 4, t.own, mode="wide")
        k.mov(value, -1)
        with k.guard(in_k):
            k.ld(value, addr(pair_at, plan.dispatch_topk), **intranode.PAYLOAD_LOAD)
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
            k.mad(element, group, group_stride, i)
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
    with k.stage("lane j < k naming the local expert: the row into dispatch_rows (s, token, j)"):
        k.setp("eq", names, value, local)
        with k.guard(names):
            k.st(addr(pair_at, plan.dispatch_rows), row, **intranode.STORE)
