"""Low-latency combine: the reverse of a low-latency dispatch. Each rank sends every row of
its experts' outputs (bf16, the masked layout the dispatch filled) back to the rank of its
token, into combine row (token, k position) there (plan.py); each rank then sums, per
token, its top-k pairs' rows in k order:

    out[t] = bf16_rn(((+0 + w[t, 0] * row(t, 0)) + w[t, 1] * row(t, 1)) + ...)

in f32, each product and each sum rounded to f32 (mul.rn, add.rn: no fma), over the pairs
whose index lies in [0, E); a pair naming an expert named before it in the token's row
takes that earlier pair's row (the dispatch sent the token once). The order is fixed, so
the bits are the same run to run, and they are those of the torch loop ``acc = acc +
row.float() * w`` (``low_latency_combine`` in tests/support/ep_reference.py).

Roles (common.py: send CTAs first, then receive CTAs; ``WARPS`` warps each):

    sender l (SEND_CTAS CTAs a    rows recv_count[l] of x[l]: sender warp w takes rows w,
    local expert)                 w + SENDERS, ..., 32 a chunk: lane j loads its row's
                                  (source rank s, token t, k position j) from src_info and
                                  the dispatch's
                                  sequence number (dispatch_received[l][s] of this rank),
                                  all in one round; the warp copies the chunk's rows (16-byte
                                  vectors) into combine row (t, j) of rank s; bar.warp.sync,
                                  then each lane publishes its row's flag (t, j) = the
                                  sequence number with st.release.sys (one instruction).
    receiver t (one CTA a token)  lane j < k of each warp: the pair's expert, its weight and
                                  the k position whose row it takes; lane j of warp 0 waits
                                  (ld.acquire.sys, timed) for that row's flag to carry the
                                  dispatch's sequence number (dispatch_sent of this
                                  rank's send CTA 0 to e's rank); bar.sync; each thread
                                  sums 16-byte vectors tid, tid + threads, ... of the k
                                  rows.

Summed (``summed``: the dispatch was given the top-k weights, which it left with each
pair's row in the experts' rank's buffer): a row a (token, rank) instead of a pair.

    sender (s, t) (a CTA a source  lane j < k: pair j's local expert, weight and row
    rank and token, looping)       (dispatch_topk, dispatch_weights, dispatch_rows); if any
                                   lives here, the CTA sums those rows times their weights
                                   in k order in f32 (the reduction below), rounds to bf16
                                   into combine row (this rank, t) of rank s. Once all its
                                   pairs' rows are out: bar.sync, and thread i publishes
                                   iteration i's flag (this rank, t) at s = the dispatch's
                                   sequence number (the releases wait for the rows' stores
                                   together, not once a pair).
    receiver t (one CTA a token)   lane d < R of warp 0, where a pair of the token lives
                                   on rank d: waits for flag (d, t); bar.sync; the ranks'
                                   rows summed in rank order from +0 in f32, rounded to
                                   bf16 once.

Memory orders and cache hints as in dispatch.py. Compile-time: ranks, max_tokens, hidden,
experts, k, phase, summed. Run-time: tokens, this rank, the pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns import fp8
from ...patterns.copy import VECTOR_BYTES, warp_copy
from ...ptx import KernelBuilder, addr
from ..ep_intranode import common as intranode
from . import common
from .plan import COUNT_BITS

# CTAs a local expert's rows are sent by: an expert receives up to R x max_tokens rows,
# and its slowest sender sets the kernel's time.
SEND_CTAS = 2
SENDERS = SEND_CTAS * common.WARPS  # warps
# Summed: a CTA sums a (source, token)'s rows; with the receivers (up to 256 tokens) a
# launch of both halves stays within the CTAs 132 SMs hold at once (4 an SM).
SUMMED_SEND_CTAS = 256
# 16-byte vectors a thread sums at once: a summed send CTA's row (7168 bf16 = 896 vectors)
# takes 7 load latencies in a row at 1, and 4 at 2 (measured: the summed combine as it was,
# 31.8 -> 32.2 us at 4 ranks and 14.6 -> 14.1 at 2, its send half bound by its stores to
# peers). The rows' words in flight stay within SUM_WORDS registers (8 rows x 2 vectors),
# under MIN_CTAS_PER_SM's 128 a thread.
SUM_UNROLL = 2
SUM_WORDS = 64


@dataclass(frozen=True)
class CombineConfig(common.LowLatencyConfig):
    KIND = "combine"
    summed: bool = False   # each rank sums its pairs of a token (a dispatch given weights)

    @property
    def name(self) -> str:
        return super().name + ("_summed" if self.summed else "")

    @property
    def send_grid(self) -> int:
        """SEND_CTAS a local expert; summed: a CTA a (source, token), up to
        SUMMED_SEND_CTAS."""
        if self.summed:
            return min(self.ranks * self.max_tokens, SUMMED_SEND_CTAS)
        return SEND_CTAS * self.plan.local_experts

    def grid(self, tokens: int) -> int:
        """Send CTAs, then receive CTAs (one a token of ``tokens``, and at least one: the
        receive's CTA 0 waits for every rank's combine to start)."""
        return self.send_grid * self.sends + max(1, tokens) * self.receives


def choose_config(arch: Arch, ranks: int, max_tokens: int, hidden: int, experts: int,
                  topk: int, *, phase: str = "both", summed: bool = False) -> CombineConfig:
    common.check(arch, ranks, max_tokens, hidden, experts, topk, phase, "combine")
    return CombineConfig(ranks, max_tokens, hidden, experts, topk, phase, arch.target, summed)


def generate(cfg: CombineConfig) -> KernelBuilder:
    k = common.kernel(cfg)
    p = SimpleNamespace()
    if cfg.sends:
        p.x = k.param("x", "u64")                    # bf16 [L, R * max_tokens, H], contiguous
        if not cfg.summed:
            p.src_info = k.param("src_info", "u64")      # int32 [L, R * max_tokens, 3]
            p.recv_count = k.param("recv_count", "u64")  # int32 [L]
    if cfg.receives:
        p.topk_idx = k.param("topk_idx", "u64")          # int64 [T, k]
        if not cfg.summed:
            p.topk_weights = k.param("topk_weights", "u64")  # f32 [T, k]
        p.tokens = k.param("tokens", "u32")
        p.out = k.param("out", "u64")                    # bf16 [T, H]
    common.declare_common_params(k, p)
    t = common.prologue(k, p, cfg.send_grid if cfg.phase == "both" else None)
    send, receive = (_send_summed, _receive_summed) if cfg.summed else (_send, _receive)

    def send_half():
        _mark_started(k, cfg, t)
        send(k, cfg, p, t)

    common.roles(k, cfg, t, send_half, lambda: receive(k, cfg, p, t))
    return k


def _thread_a_rank(k, cfg, t, name: str):
    """A predicate: thread d < R of the role's CTA 0 (thread d: rank d's)."""
    first, one = k.pred(name + "_cta0"), k.pred(name)
    k.setp("eq", first, t.index, 0)
    k.setp("lt", one, t.tid, cfg.ranks)
    k.and_pred(one, one, first)
    return one


def _mark_started(k, cfg, t) -> None:
    """Send CTA 0, thread d < R: this rank's combine has started, into combine_started
    (this rank) of rank d: the sequence number of the dispatch receive that ended before it
    (pair (local expert 0, d)'s), which rank d's combine receive waits for."""
    plan = cfg.plan
    with k.stage("the round: send CTA 0's thread d < R marks this rank's combine started at "
                 "rank d"):
        with k.if_(_thread_a_rank(k, cfg, t, "marks_a_rank"), "not_marking"):
            sequence, at, peer = k.reg("u32", "round"), k.reg("u64", "round_at"), k.reg(
                "u64", "round_peer")
            k.mad(at, t.tid, 4, t.own, mode="wide")   # dispatch_received[0][d]
            k.ld(sequence, addr(at, plan.dispatch_received), sem="relaxed", scope="sys")
            intranode.buffer_of(k, peer, t.peers, t.tid)
            k.mad(at, t.rank, 4, peer, mode="wide")
            k.st(addr(at, plan.combine_started), sequence, sem="release", scope="sys")


def _send(k, cfg, p, t) -> None:
    plan, row_bytes = cfg.plan, 2 * cfg.hidden
    with k.stage("sender: the local expert, this CTA's warps among its senders', its rows"):
        local, sender_warp = k.reg("u32", "local_expert"), k.reg("u32", "sender_warp")
        k.div(local, t.index, SEND_CTAS)
        k.rem(sender_warp, t.index, SEND_CTAS)
        k.mad(sender_warp, sender_warp, common.WARPS, t.warp)
        count, at = k.reg("u32", "count"), k.reg("u64", "count_at")
        k.ld_param(at, p.recv_count)
        k.mad(at, local, 4, at, mode="wide")
        k.ld(count, addr(at), **intranode.INPUT_LOAD)
    first, i, row, source, token, position, pair, sequence, n, j = (k.reg("u32", name) for name in (
        "chunk_first", "row_index", "row", "source", "token", "position", "pair", "sequence",
        "chunk_rows", "chunk_row"))
    src, info, peer, dst, flag_at = (k.reg("u64", name) for name in (
        "x_row", "info_at", "peer_buffer", "combine_row", "flag_at"))
    valid, ballot = k.pred("row_valid"), k.reg("b32", "valid_rows")
    # Sender warp w (of the expert's SEND_CTAS x WARPS) sends rows w, w + SENDERS, ...: 32
    # of them a chunk, lane j's the chunk's j-th.
    with k.loop(first, count, start=sender_warp, step=32 * SENDERS, uniform=True,
                hint="chunk"):
        with k.stage("lane j: its row's source rank, token, k position, flag and the "
                     "dispatch's sequence number, all loaded in one round"):
            k.mad(i, t.lane, SENDERS, first)
            k.setp("lt", valid, i, count)
            k.mad(row, local, cfg.ranks * cfg.max_tokens, i)
            k.ld_param(info, p.src_info)
            k.mad(info, row, 12, info, mode="wide")
            with k.guard(valid):
                k.ld(source, addr(info), **intranode.INPUT_LOAD)
                k.ld(token, addr(info, 4), **intranode.INPUT_LOAD)
                k.ld(position, addr(info, 8), **intranode.INPUT_LOAD)
            k.mad(pair, local, cfg.ranks, source)
            k.mad(at, pair, 4, t.own, mode="wide")
            with k.guard(valid):
                k.ld(sequence, addr(at, plan.dispatch_received), sem="relaxed", scope="sys")
                intranode.buffer_of(k, peer, t.peers, source)
            k.mad(pair, token, plan.combine_slots, position)
            k.mad(flag_at, pair, 4, peer, mode="wide")
            k.vote_sync(ballot, valid, mode="ballot")
            k.popc(n, ballot)
        with k.loop(j, n, uniform=True, hint="chunk_row"):
            with k.stage("copy row j of the chunk into combine row (token, position) of its "
                         "source rank"):
                rows_j, pair_j, source_j = k.reg("u32", "row_j"), k.reg("u32", "pair_j"), k.reg(
                    "u32", "source_j")
                k.shfl_sync(rows_j, row, j, mode="idx")
                k.shfl_sync(pair_j, pair, j, mode="idx")
                k.shfl_sync(source_j, source, j, mode="idx")
                intranode.buffer_of(k, dst, t.peers, source_j)
                k.mad(dst, pair_j, row_bytes, dst, mode="wide")
                k.add(dst, dst, plan.combine_rows)
                k.ld_param(src, p.x)
                k.mad(src, rows_j, row_bytes, src, mode="wide")
                warp_copy(k, dst, src, row_bytes, t.lane, load=intranode.INPUT_LOAD,
                          store=intranode.STORE, unroll=common.COPY_UNROLL)
        with k.stage("the chunk's flags: every row's copy, then one release a lane"):
            k.bar_warp_sync()
            with k.guard(valid):
                k.st(addr(flag_at, plan.combine_flags), sequence, sem="release", scope="sys")


def _receiver_token(k, cfg, p, t):
    """Receive CTA t's token; CTA 0 first waits, thread d < R, for rank d's combine to
    start (combine_started (d) = this round's sequence number: the round's dispatch
    receive ended there), so that this rank's next dispatch cannot rewrite a flag or a
    slot rank d has yet to read, whether or not a token of this rank's went there; CTAs
    past the call's tokens exit."""
    plan = cfg.plan
    with k.stage("receive CTA 0, thread d < R: wait for rank d's combine to start"):
        with k.if_(_thread_a_rank(k, cfg, t, "waits_for_a_rank"), "not_waiting_for_the_round"):
            expected, seen, at = k.reg("u32", "round"), k.reg("u32", "round_seen"), k.reg(
                "u64", "round_at")
            ready, sender = k.pred("round_started"), k.reg("u32", "round_cta")
            k.mul(sender, t.tid, plan.send_ctas, mode="lo")   # dispatch_sent[d][0]
            k.mad(at, sender, 4, t.own, mode="wide")
            k.ld(expected, addr(at, plan.dispatch_sent), sem="relaxed", scope="sys")
            k.mad(at, t.tid, 4, t.own, mode="wide")

            def arrived(flag):
                k.setp("eq", ready, flag, expected)
                return ready

            t.watchdog.wait(seen, addr(at, plan.combine_started), arrived,
                            code=intranode.LL_COMBINE_START, channel=0, peer=t.tid)
    token = t.index
    tokens = k.reg("u32", "tokens")
    k.ld_param(tokens, p.tokens)
    beyond = k.pred("beyond")
    k.setp("ge", beyond, token, tokens)
    with k.guard(beyond):
        k.exit()
    return token


def _receive(k, cfg, p, t) -> None:
    plan = cfg.plan
    token = _receiver_token(k, cfg, p, t)
    r = SimpleNamespace()
    with k.stage("lane j < k: pair j's expert, weight, and the k position whose row it takes"):
        pair_lane, is_pair, same, earlier = k.pred("is_pair"), k.pred("valid"), k.pred(
            "same"), k.pred("earlier")
        r.valid = is_pair
        k.setp("lt", pair_lane, t.lane, cfg.topk)
        idx_at, index, other = k.reg("u64", "idx_at"), k.reg("u64", "index"), k.reg(
            "u64", "other_index")
        k.ld_param(idx_at, p.topk_idx)
        k.mad(idx_at, token, 8 * cfg.topk, idx_at, mode="wide")
        k.mov(index, -1)
        at = k.reg("u64", "lane_at")
        k.mad(at, t.lane, 8, idx_at, mode="wide")
        with k.guard(pair_lane):
            k.ld(index, addr(at), **intranode.INPUT_LOAD)
        # -1 and every index past the experts compare above E unsigned.
        k.setp("lt", is_pair, index, cfg.experts)
        r.first = k.reg("u32", "first_position")
        k.mov(r.first, t.lane)
        for j in reversed(range(cfg.topk)):  # the last match kept is the first position
            k.ld(other, addr(idx_at, 8 * j), **intranode.INPUT_LOAD)
            k.setp("eq", same, other, index)
            k.setp("gt", earlier, t.lane, j)
            k.and_pred(same, same, earlier)
            with k.guard(same):
                k.mov(r.first, j)
        r.weight = k.reg("f32", "weight")
        k.mov(r.weight, 0.0)
        k.ld_param(at, p.topk_weights)
        k.mad(at, token, 4 * cfg.topk, at, mode="wide")
        k.mad(at, t.lane, 4, at, mode="wide")
        with k.guard(is_pair):
            k.ld(r.weight, addr(at), **intranode.INPUT_LOAD)
    with k.stage("warp 0, lane j: wait for the row's flag to carry the dispatch's sequence number"):
        waiter, warp0 = k.pred("waiter"), k.pred("warp0")
        k.setp("eq", warp0, t.warp, 0)
        k.and_pred(waiter, warp0, is_pair)
        with k.if_(waiter, "not_waiting"):
            expected, seen, expert = k.reg("u32", "sequence"), k.reg("u32", "flag_seen"), k.reg(
                "u32", "expert")
            ready, flag_at = k.pred("arrived"), k.reg("u64", "flag_at")
            k.cvt(expert, index, dtype="u32", stype="u64")
            sender = k.reg("u32", "send_cta")  # send CTA 0 of the expert's rank
            k.div(sender, expert, plan.local_experts)
            k.mul(sender, sender, plan.send_ctas, mode="lo")
            k.mad(flag_at, sender, 4, t.own, mode="wide")
            k.ld(expected, addr(flag_at, plan.dispatch_sent), sem="relaxed", scope="sys")
            pair = k.reg("u32", "pair")
            k.mad(pair, token, plan.combine_slots, r.first)
            k.mad(flag_at, pair, 4, t.own, mode="wide")

            def arrived(flag):
                k.setp("eq", ready, flag, expected)
                return ready

            t.watchdog.wait(seen, addr(flag_at, plan.combine_flags), arrived,
                            code=intranode.LL_COMBINE_RECEIVE, channel=token, peer=expert)
        k.bar_sync(0)
    _reduce(k, cfg, p, t, r, token)


def _reduce(k, cfg, p, t, r, token) -> None:
    plan, row_bytes = cfg.plan, 2 * cfg.hidden
    with k.stage("each pair's row address, weight and presence, from its lane"):
        has = k.regs("pred", cfg.topk, "has")
        rows = k.regs("u64", cfg.topk, "row_at")
        weights = k.regs("f32", cfg.topk, "w")
        flag, first, pair = k.reg("u32", "has_pair"), k.reg("u32", "row_position"), k.reg(
            "u32", "row_pair")
        k.selp(flag, 1, 0, r.valid, type="u32")
        for j in range(cfg.topk):
            k.shfl_sync(first, flag, j, mode="idx")
            k.setp("ne", has[j], first, 0)
            k.shfl_sync(first, r.first, j, mode="idx")
            k.mad(pair, token, plan.combine_slots, first)
            k.mad(rows[j], pair, row_bytes, t.own, mode="wide")
            k.add(rows[j], rows[j], plan.combine_rows)
            k.shfl_sync(weights[j], r.weight, j, mode="idx")
    out = k.reg("u64", "out")
    k.ld_param(out, p.out)
    k.mad(out, token, row_bytes, out, mode="wide")
    _sum_rows(k, cfg, t, has, rows, weights, out, store={})


def _sum_rows(k, cfg, t, has, rows, weights, dst, *, store: dict) -> None:
    """dst (a bf16 row) = the rows at ``rows`` whose ``has`` holds, times ``weights`` (None:
    as they are), summed in their order from +0 in f32, each product and sum rounded to
    f32 (mul.rn, add.rn: no fma), rounded to bf16 once. A thread takes up to SUM_UNROLL
    16-byte vectors at a time (tid, tid + threads, ...), every row's load of them issued
    before the sums: the loads' latency, paid once a round, is what a CTA's few rows cost."""
    row_bytes = 2 * cfg.hidden
    vectors = row_bytes // VECTOR_BYTES
    unroll = max(1, min(SUM_UNROLL, SUM_WORDS // (4 * len(rows))))
    step = cfg.threads * unroll
    with k.stage("sum the rows in order, f32 (mul.rn, add.rn), a few 16-byte vectors a "
                 "thread"):
        v, at = k.reg("u32", "vector"), k.reg("u64", "at")
        vector = k.regs("u32", unroll, "vector_u")
        offset = k.regs("u64", unroll, "vector_offset")
        # Vector u of a round lies in the row unless the rounds cover it exactly (u = 0 always).
        in_row = [None] + [k.pred(f"in_row{u}") if vectors % step else None
                           for u in range(1, unroll)]
        load = [[has[j] if in_row[u] is None else k.pred(f"load{u}_{j}")
                 for j in range(len(rows))] for u in range(unroll)]
        data = [[k.regs("b32", 4, f"pair{j}_v{u}_") for j in range(len(rows))]
                for u in range(unroll)]
        acc, halves = k.regs("f32", 8, "acc"), k.regs("f32", 2, "half")
        packed = k.regs("b32", 4, "sum")
        with k.loop(v, vectors, start=t.tid, step=step, hint="vector"):
            for u in range(unroll):
                k.add(vector[u], v, u * cfg.threads)
                k.mul(offset[u], vector[u], VECTOR_BYTES, mode="wide")
                if in_row[u] is not None:
                    k.setp("lt", in_row[u], vector[u], vectors)
                for j in range(len(rows)):
                    if in_row[u] is not None:
                        k.and_pred(load[u][j], has[j], in_row[u])
                    k.add(at, rows[j], offset[u])
                    with k.guard(load[u][j]):
                        k.ld(data[u][j], addr(at), **intranode.PAYLOAD_LOAD)
            for u in range(unroll):
                for a in acc:
                    k.mov(a, 0.0)
                for j in range(len(rows)):
                    for w, word in enumerate(data[u][j]):
                        fp8.unpack_bf16x2(k, halves[0], halves[1], word)
                        for h in (0, 1):
                            if weights is not None:
                                k.mul(halves[h], halves[h], weights[j], rnd="rn")
                            with k.guard(has[j]):
                                k.add(acc[2 * w + h], acc[2 * w + h], halves[h], rnd="rn")
                for w, word in enumerate(packed):
                    k.cvt(word, acc[2 * w + 1], acc[2 * w], dtype="bf16x2", rnd="rn")
                k.add(at, dst, offset[u])
                if in_row[u] is None:
                    k.st(addr(at), packed, **store)
                else:
                    with k.guard(in_row[u]):
                        k.st(addr(at), packed, **store)


# ---------------------------------------------------------------------------- summed
# A dispatch given the top-k weights leaves them, each pair's row and each source's token
# count in the experts' rank's buffer: that rank then sums its experts' rows of a token
# and sends one row back a (token, rank), not one a pair.


def _send_summed(k, cfg, p, t) -> None:
    plan, row_bytes = cfg.plan, 2 * cfg.hidden
    pairs = cfg.ranks * cfg.max_tokens
    # A CTA's (source, token) pairs: c, c + send CTAs, ...; iteration i's flag (its address,
    # or 0: nothing sent) waits in shared memory until all the CTA's rows are out.
    iterations = -(-pairs // cfg.send_grid)
    q, source, token, tokens, word = (k.reg("u32", name) for name in (
        "source_token", "source", "token", "source_tokens", "flag_word"))
    at, peer, dst, x, flag_at = (k.reg("u64", name) for name in (
        "at", "peer_buffer", "sum_row", "x", "flag_at"))
    in_k, valid, beyond = k.pred("in_k"), k.pred("valid"), k.pred("beyond")
    local, row, weight, ballot = k.reg("u32", "local_expert"), k.reg("u32", "pair_row"), \
        k.reg("f32", "pair_weight"), k.reg("b32", "pairs_here")
    has = k.regs("pred", cfg.topk, "has")
    rows = k.regs("u64", cfg.topk, "row_at")
    weights = k.regs("f32", cfg.topk, "w")
    entry_at, entries = k.reg("u32", "flag_entry"), k.reg("u32", "flag_entries")
    k.mov(entries, k.shared("flags_to_publish", 8 * iterations, align=8))
    k.mov(entry_at, entries)
    k.ld_param(x, p.x)
    k.setp("lt", in_k, t.lane, cfg.topk)
    with k.loop(q, pairs, start=t.index, step=cfg.send_grid, uniform=True, hint="pair"):
        with k.stage("the pair's source and token; lane j < k: pair j's local expert, "
                     "weight and row (dispatch_rows), loaded with the source's token count"):
            k.div(source, q, cfg.max_tokens)
            k.rem(token, q, cfg.max_tokens)
            k.mul(word, source, plan.send_ctas, mode="lo")  # send CTA 0's flag: the count
            k.mad(at, word, 4, t.own, mode="wide")
            k.ld(tokens, addr(at, plan.dispatch_flags), **intranode.PAYLOAD_LOAD)
            k.mad(word, q, cfg.topk, t.lane)
            k.mad(at, word, 4, t.own, mode="wide")
            k.mov(local, -1)
            with k.guard(in_k):
                k.ld(local, addr(at, plan.dispatch_topk), **intranode.PAYLOAD_LOAD)
                k.ld(weight, addr(at, plan.dispatch_weights), **intranode.PAYLOAD_LOAD)
                k.ld(row, addr(at, plan.dispatch_rows), **intranode.PAYLOAD_LOAD)
            # A token past the source's count left stale entries: nothing lives here.
            k.and_(tokens, tokens, (1 << COUNT_BITS) - 1)
            k.setp("ge", beyond, token, tokens)
            k.setp("lt", valid, local, plan.local_experts)  # -1 compares above, unsigned
            k.and_pred(valid, valid, ~beyond)
            k.vote_sync(ballot, valid, mode="ballot")
            pick = k.reg("u32", "lane_value")
            for j in range(cfg.topk):
                k.shfl_sync(pick, row, j, mode="idx")
                k.mad(rows[j], pick, row_bytes, x, mode="wide")
                k.shfl_sync(weights[j], weight, j, mode="idx")
                k.and_(pick, ballot, 1 << j)
                k.setp("ne", has[j], pick, 0)
        any_here = k.pred("any_here")
        k.setp("ne", any_here, ballot, 0)
        k.mov(flag_at, 0)
        with k.if_(any_here, "none_here", uniform=True):
            k.mul(word, t.rank, cfg.max_tokens, mode="lo")
            k.add(word, word, token)  # slot (this rank, token) at the source
            intranode.buffer_of(k, peer, t.peers, source)
            k.mad(dst, word, row_bytes, peer, mode="wide")
            k.add(dst, dst, plan.combine_rows)
            _sum_rows(k, cfg, t, has, rows, weights, dst, store=intranode.STORE)
            k.mad(flag_at, word, 4, peer, mode="wide")
            k.add(flag_at, flag_at, plan.combine_flags)
        with k.guard(t.thread0):
            k.st(addr(entry_at), flag_at, space="shared")
        k.add(entry_at, entry_at, 8)
    with k.stage("publish: the CTA's rows, then thread i its iteration's flag = the "
                 "dispatch's sequence number (st.release.sys)"):
        k.bar_sync(0)
        mine = k.pred("publishes")
        k.mad(q, t.tid, cfg.send_grid, t.index)  # thread i: iteration i's pair
        k.setp("lt", mine, t.tid, iterations)
        k.setp("lt", valid, q, pairs)
        k.and_pred(mine, mine, valid)
        with k.if_(mine, "not_publishing"):
            k.mad(entry_at, t.tid, 8, entries)
            k.ld(flag_at, addr(entry_at), space="shared")
            k.setp("ne", valid, flag_at, 0)
            with k.guard(valid):
                sequence = k.reg("u32", "sequence")  # pair (0, source)'s
                k.div(source, q, cfg.max_tokens)
                k.mad(at, source, 4, t.own, mode="wide")
                k.ld(sequence, addr(at, plan.dispatch_received), sem="relaxed", scope="sys")
                k.st(addr(flag_at), sequence, sem="release", scope="sys")


def _receive_summed(k, cfg, p, t) -> None:
    plan, row_bytes = cfg.plan, 2 * cfg.hidden
    token = _receiver_token(k, cfg, p, t)
    has = k.regs("pred", cfg.ranks, "from")
    rows = k.regs("u64", cfg.ranks, "row_at")
    with k.stage("the ranks holding a pair of the token: ballots of lane j's expert rank"):
        in_k, valid, on_d = k.pred("in_k"), k.pred("valid"), k.pred("on_rank")
        index, at = k.reg("u64", "index"), k.reg("u64", "idx_at")
        expert, rank, ballot = k.reg("u32", "expert"), k.reg("u32", "expert_rank"), k.reg(
            "b32", "ranks_ballot")
        k.setp("lt", in_k, t.lane, cfg.topk)
        k.ld_param(at, p.topk_idx)
        k.mad(at, token, 8 * cfg.topk, at, mode="wide")
        k.mad(at, t.lane, 8, at, mode="wide")
        k.mov(index, -1)
        with k.guard(in_k):
            k.ld(index, addr(at), **intranode.INPUT_LOAD)
        # -1 and every index past the experts compare above E unsigned.
        k.setp("lt", valid, index, cfg.experts)
        k.cvt(expert, index, dtype="u32", stype="u64")
        k.div(rank, expert, plan.local_experts)
        slot = k.reg("u32", "slot")
        for d in range(cfg.ranks):
            k.setp("eq", on_d, rank, d)
            k.and_pred(on_d, on_d, valid)
            k.vote_sync(ballot, on_d, mode="ballot")
            k.setp("ne", has[d], ballot, 0)
            k.add(slot, token, d * cfg.max_tokens)
            k.mad(rows[d], slot, row_bytes, t.own, mode="wide")
            k.add(rows[d], rows[d], plan.combine_rows)
    with k.stage("warp 0, lane d < R holding a pair: wait for rank d's row of the token"):
        waiter, warp0 = k.pred("waiter"), k.pred("warp0")
        k.setp("eq", warp0, t.warp, 0)
        k.setp("lt", waiter, t.lane, cfg.ranks)
        k.and_pred(waiter, waiter, warp0)
        pick = k.reg("u32", "lane_has")
        k.mov(pick, 0)
        for d in range(cfg.ranks):  # lane d: has[d]
            lane_d = k.pred("lane_d")
            k.setp("eq", lane_d, t.lane, d)
            k.and_pred(lane_d, lane_d, has[d])
            with k.guard(lane_d):
                k.mov(pick, 1)
        k.setp("ne", on_d, pick, 0)
        k.and_pred(waiter, waiter, on_d)
        with k.if_(waiter, "not_waiting"):
            expected, seen, flag_at = k.reg("u32", "sequence"), k.reg("u32", "flag_seen"), \
                k.reg("u64", "flag_at")
            ready = k.pred("arrived")
            k.mul(slot, t.lane, plan.send_ctas, mode="lo")  # rank d's send CTA 0
            k.mad(flag_at, slot, 4, t.own, mode="wide")
            k.ld(expected, addr(flag_at, plan.dispatch_sent), sem="relaxed", scope="sys")
            k.mad(slot, t.lane, cfg.max_tokens, token)
            k.mad(flag_at, slot, 4, t.own, mode="wide")

            def arrived(flag):
                k.setp("eq", ready, flag, expected)
                return ready

            t.watchdog.wait(seen, addr(flag_at, plan.combine_flags), arrived,
                            code=intranode.LL_COMBINE_RECEIVE, channel=token, peer=t.lane)
        k.bar_sync(0)
    out = k.reg("u64", "out")
    k.ld_param(out, p.out)
    k.mad(out, token, row_bytes, out, mode="wide")
    _sum_rows(k, cfg, t, has, rows, None, out, store={})
