"""Intranode combine by pulling, after a direct dispatch: each rank reads, over NVLink, the
rows its tokens' ranks computed for them, straight from those ranks' buffers, and sums them
in rank order, in f32, as the ring combine does (the same bits):

    out[t] = bf16_rn(((+0 + f32(row of t at rank 0)) + f32(row of t at rank 1)) + ...)

over the ranks t went to (is_token_in_rank[t]). No rows are pushed through rings and no
SM waits for another's copies: every CTA of every rank loads and sums.

Where the rows lie. A direct dispatch wrote token t's row at rank d to row send_rows[t, d]
of d's outputs (it records them on the source, direct.py), and the experts' output for
that row is row send_rows[t, d] of d's combine inputs (``plan.DirectRegion.combine_x``,
at the same place in every rank's buffer), which the rank's experts wrote before this
kernel, on its stream.

Roles (grid: the dispatch's SMs, one CTA each; ``warps`` warps a CTA):

    thread s < R of CTA c   after a fence, stores n to rank s's flag [this rank][c]
                            (st.release.sys): this rank's kernel has started, so every
                            row it combines is written. Then it waits (ld.acquire.sys, the
                            watchdog) until this rank's flag [s][c] reaches n, and a
                            bar.sync passes that on to the CTA.
    warp w of CTA c         tokens begin_c + w, + warps, ... of the CTA's share (ceil(T /
                            CTAs) consecutive tokens): per rank d the token went to, the
                            row's address in d's buffer; then ``combine.sum_rows``, 16-byte
                            vectors, ``unroll`` from every rank in flight a lane.

Numbering: CTA c reads n - 1 from this rank's own flag [rank][c] (its own store of the
last call), so a replayed graph numbers itself; the flags only grow. A rank's combine
inputs stay as they are until its next dispatch's exchange, which every rank runs only
after its combine: no rank reads rows a rank is rewriting.

Compile-time: ranks, hidden size, warps. Run-time: T, this rank, the combine inputs'
offset in every buffer, the pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from . import common
from .combine import check_problem, sum_rows
from .plan import MAX_CHANNELS, PULL_READY

WARPS = 16        # tokens a CTA sums at once, one a warp


@dataclass(frozen=True)
class PullConfig:
    ranks: int
    hidden: int
    warps: int
    target: str

    @property
    def name(self) -> str:
        return f"ep_pull_combine_r{self.ranks}_h{self.hidden}_w{self.warps}"

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def unroll(self) -> int:
        """The 16-byte vectors of each rank's row a lane loads at once: about 16 loads in
        flight a lane, whatever the ranks."""
        return max(1, 16 // self.ranks)


def choose_config(arch: Arch, ranks: int, hidden: int, *, num_sms: int = 20) -> PullConfig:
    """WARPS warps a CTA (nothing tuned yet); the grid is ``num_sms`` CTAs."""
    check_problem(hidden)
    common.channels_for(arch, ranks, num_sms, 64, "pull combine")
    return PullConfig(ranks=ranks, hidden=hidden, warps=WARPS, target=arch.target)


def ready_flag(source: int, cta: int) -> int:
    """Byte offset in a buffer of the flag CTA ``cta`` of rank ``source`` publishes there."""
    return PULL_READY + 4 * (source * 2 * MAX_CHANNELS + cta)


def generate(cfg: PullConfig) -> KernelBuilder:
    # One CTA an SM: ptxas may give a thread every register the CTA's size allows.
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads, min_blocks_per_sm=1)
    k.launch = LaunchShape(block=cfg.threads)
    p = SimpleNamespace()
    p.x = k.param("x", "u64")                    # the combine inputs' byte offset in a buffer
    p.send_rows = k.param("send_rows", "u64")    # int32 [T, ranks]: the dispatch's rows
    p.is_token_in_rank = k.param("is_token_in_rank", "u64")  # bool [T, ranks]
    p.tokens = k.param("tokens", "u32")
    p.out = k.param("out", "u64")                # bf16 [T, H], contiguous
    p.rank = k.param("rank", "u32")
    p.peers = k.param("peers", "u64")
    p.error = k.param("error", "u64")
    p.timeout_ns = k.param("timeout_ns", "u64")
    t = common.prologue(k, cfg.warps)
    common.scalars(k, t, p)
    _ready(k, cfg, t)
    _sum(k, cfg, p, t)
    return k


def _ready(k: KernelBuilder, cfg: PullConfig, t) -> None:
    with k.stage("n: this rank's own flag [rank][cta] (the last call's) + 1"):
        t.cta, t.tid = k.reg("u32", "cta_index"), k.reg("u32", "thread")
        k.mov(t.cta, sreg.ctaid.x)
        k.mov(t.tid, sreg.tid.x)
        own, at = k.reg("u64", "own_buffer"), k.reg("u64", "flag_at")
        common.buffer_of(k, own, t.peers, t.rank)
        k.mad(at, t.rank, 4 * 2 * MAX_CHANNELS, own, mode="wide")
        k.mad(at, t.cta, 4, at, mode="wide")
        t.number = k.reg("u32", "number")
        k.ld(t.number, addr(at, PULL_READY), sem="relaxed", scope="sys")
        k.add(t.number, t.number, 1)
        k.bar_sync(0)   # every thread has read the flag before thread `rank` moves it on
    source = k.pred("a_source")
    k.setp("lt", source, t.tid, cfg.ranks)
    with k.if_(source, "not_a_source"):
        with k.stage("publish: n to rank tid's flag [rank][cta] (st.release.sys)"):
            peer = k.reg("u64", "peer_buffer")
            common.buffer_of(k, peer, t.peers, t.tid)
            k.mad(at, t.rank, 4 * 2 * MAX_CHANNELS, peer, mode="wide")
            k.mad(at, t.cta, 4, at, mode="wide")
            k.fence("acq_rel", "sys")
            k.st(addr(at, PULL_READY), t.number, sem="release", scope="sys")
        with k.stage("wait: this rank's flag [tid][cta] reaches n"):
            common.wait_for_number(k, t, PULL_READY, own, t.tid, t.cta, t.number,
                                   code=common.PULL_RECEIVE, channel=t.cta)
    k.bar_sync(0)


def _sum(k: KernelBuilder, cfg: PullConfig, p, t) -> None:
    with k.stage("the CTA's tokens; every rank's combine inputs"):
        tokens, per, begin, end = (k.reg("u32", name) for name in (
            "tokens", "per_cta", "begin", "end"))
        k.ld_param(tokens, p.tokens)
        k.mov(per, sreg.nctaid.x)
        k.add(begin, tokens, per)
        k.sub(begin, begin, 1)
        k.div(per, begin, per)
        k.mul(begin, t.cta, per, mode="lo")
        k.min(begin, begin, tokens)
        k.add(end, begin, per)
        k.min(end, end, tokens)
        offset = k.reg("u64", "inputs_offset")
        k.ld_param(offset, p.x)
        inputs = k.regs("u64", cfg.ranks, "inputs")
        for d in range(cfg.ranks):
            k.ld(inputs[d], addr(t.peers, 8 * d), nc=True)  # rank d's buffer
            k.add(inputs[d], inputs[d], offset)
        in_rank, send_rows, out = k.reg("u64", "in_rank"), k.reg("u64", "send_rows"), k.reg(
            "u64", "out")
        k.ld_param(in_rank, p.is_token_in_rank)
        k.ld_param(send_rows, p.send_rows)
        k.ld_param(out, p.out)
        k.add(begin, begin, t.warp)
    token, flag, row = k.reg("u32", "token"), k.reg("u32", "flag"), k.reg("u32", "row")
    at, out_at = k.reg("u64", "at"), k.reg("u64", "out_row")
    has, rows_at = k.regs("pred", cfg.ranks, "has"), k.regs("u64", cfg.ranks, "row_at")
    with k.loop(token, end, start=begin, step=cfg.warps, uniform=True, hint="token"):
        with k.stage("the token's ranks and its rows there"):
            for d in range(cfg.ranks):
                k.mad(at, token, cfg.ranks, in_rank, mode="wide")
                k.ld(flag, addr(at, d), nc=True, type="u8")
                k.setp("ne", has[d], flag, 0)
                k.mad(at, token, 4 * cfg.ranks, send_rows, mode="wide")
                k.ld(row, addr(at, 4 * d), nc=True)
                k.mad(rows_at[d], row, 2 * cfg.hidden, inputs[d], mode="wide")
            k.mad(out_at, token, 2 * cfg.hidden, out, mode="wide")
        sum_rows(k, cfg.hidden, cfg.unroll, t.lane, rows_at, has, out_at, common.PAYLOAD_LOAD)
