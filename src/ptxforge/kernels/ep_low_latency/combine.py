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

Memory orders and cache hints as in dispatch.py. Compile-time: ranks, max_tokens, hidden,
experts, k, phase. Run-time: tokens, this rank, the pointers.
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

# CTAs a local expert's rows are sent by: an expert receives up to R x max_tokens rows,
# and its slowest sender sets the kernel's time.
SEND_CTAS = 2
SENDERS = SEND_CTAS * common.WARPS  # warps


@dataclass(frozen=True)
class CombineConfig(common.LowLatencyConfig):
    KIND = "combine"

    def grid(self, tokens: int) -> int:
        """Send CTAs (SEND_CTAS a local expert), then receive CTAs (one of ``tokens``); at
        least one CTA."""
        return max(1, SEND_CTAS * self.plan.local_experts * self.sends
                   + tokens * self.receives)


def choose_config(arch: Arch, ranks: int, max_tokens: int, hidden: int, experts: int,
                  topk: int, *, phase: str = "both") -> CombineConfig:
    common.check(arch, ranks, max_tokens, hidden, experts, topk, phase, "combine")
    return CombineConfig(ranks, max_tokens, hidden, experts, topk, phase, arch.target)


def generate(cfg: CombineConfig) -> KernelBuilder:
    k = common.kernel(cfg)
    p = SimpleNamespace()
    if cfg.sends:
        p.x = k.param("x", "u64")                    # bf16 [L, R * max_tokens, H], contiguous
        p.src_info = k.param("src_info", "u64")      # int32 [L, R * max_tokens, 3]
        p.recv_count = k.param("recv_count", "u64")  # int32 [L]
    if cfg.receives:
        p.topk_idx = k.param("topk_idx", "u64")          # int64 [T, k]
        p.topk_weights = k.param("topk_weights", "u64")  # f32 [T, k]
        p.tokens = k.param("tokens", "u32")
        p.out = k.param("out", "u64")                    # bf16 [T, H]
    common.declare_common_params(k, p)
    t = common.prologue(k, p, SEND_CTAS * cfg.plan.local_experts if cfg.phase == "both"
                        else None)
    common.roles(k, cfg, t, lambda: _send(k, cfg, p, t), lambda: _receive(k, cfg, p, t))
    return k


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
            k.mad(pair, token, cfg.topk, position)
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


def _receive(k, cfg, p, t) -> None:
    plan = cfg.plan
    token = t.index
    tokens = k.reg("u32", "tokens")
    k.ld_param(tokens, p.tokens)
    beyond = k.pred("beyond")
    k.setp("ge", beyond, token, tokens)
    with k.guard(beyond):
        k.exit()
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
            k.mad(pair, token, cfg.topk, r.first)
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
            k.mad(pair, token, cfg.topk, first)
            k.mad(rows[j], pair, row_bytes, t.own, mode="wide")
            k.add(rows[j], rows[j], plan.combine_rows)
            k.shfl_sync(weights[j], r.weight, j, mode="idx")
    with k.stage("sum the pairs in k order, f32 (mul.rn, add.rn), one 16-byte vector a thread"):
        vectors = row_bytes // VECTOR_BYTES
        v, offset, at = k.reg("u32", "vector"), k.reg("u64", "vector_offset"), k.reg(
            "u64", "at")
        data = [k.regs("b32", 4, f"pair{j}_") for j in range(cfg.topk)]
        acc, halves = k.regs("f32", 8, "acc"), k.regs("f32", 2, "half")
        packed = k.regs("b32", 4, "sum")
        out = k.reg("u64", "out")
        k.ld_param(out, p.out)
        k.mad(out, token, row_bytes, out, mode="wide")
        with k.loop(v, vectors, start=t.tid, step=cfg.threads, hint="vector"):
            k.mul(offset, v, VECTOR_BYTES, mode="wide")
            for j in range(cfg.topk):
                k.add(at, rows[j], offset)
                with k.guard(has[j]):
                    k.ld(data[j], addr(at), **intranode.PAYLOAD_LOAD)
            for a in acc:
                k.mov(a, 0.0)
            for j in range(cfg.topk):
                for w, word in enumerate(data[j]):
                    fp8.unpack_bf16x2(k, halves[0], halves[1], word)
                    for h in (0, 1):
                        k.mul(halves[h], halves[h], weights[j], rnd="rn")
                        with k.guard(has[j]):
                            k.add(acc[2 * w + h], acc[2 * w + h], halves[h], rnd="rn")
            for w, word in enumerate(packed):
                k.cvt(word, acc[2 * w + 1], acc[2 * w], dtype="bf16x2", rnd="rn")
            k.add(at, out, offset)
            k.st(addr(at), packed)
