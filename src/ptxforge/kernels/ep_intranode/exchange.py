"""The count exchange before a dispatch: every rank's message to every rank through the
ranks' buffers, over NVLink, with no host collective; and this rank's receive layout,
on the GPU. The host reads the gathered messages with one copy (a dispatch that checks
and sizes on the host), or nothing at all (a dispatch sized for the worst case).

A message is ``words`` int32 (``ep/layout.py`` reads it: the call's sizes and its top-k
indices out of range, the rank's tokens for each rank on each channel, its pairs per
expert). The kernel composes it in shared memory from the header (the sizes and the bad
indices, from the host), is_token_in_rank (the channels' counts: ``plan.channel_bounds``'s
tokens, counted by ballots) and the pairs per expert, so a dispatch runs no other kernel
to make it. Each buffer holds, at ``plan.EXCHANGE_FLAGS``, a u32 flag per source rank, and
at ``plan.EXCHANGE_SLOTS``, two sets (parities) of a slot per source rank, each of
``plan.MESSAGE_WORDS`` words. The exchanges are numbered 1, 2, ... from the buffer's
creation (every rank makes the same exchanges); a rank's own flag[rank] holds the
number of its last one, so exchange n = that + 1 needs nothing from the host (a CUDA
graph replays it as it is). Exchange n uses parity n & 1:

    number     n = this rank's flag[rank] + 1
    compose    the message in shared memory: thread i < HEADER_WORDS the header's word i,
               warp w the counts of channels w, w + WARPS, ... (32 tokens a ballot per
               rank), the threads the pairs per expert; bar.sync
    write      the CTA copies the message into slot (n & 1, rank) of every rank's buffer,
               its own included; each thread then fences its stores (fence.acq_rel.sys)
    publish    bar.sync; thread r stores n to rank r's flag[rank] with st.release.sys
    wait       thread r polls its own flag[r] until it has reached n (flag - n modulo 2^32
               below 2^31: a peer may be at n + 1 already), under the watchdog
    read       bar.sync; the CTA copies slot (n & 1, r) of every rank r, ``words`` words
               each, into out [ranks, words]
    layout     what source s sends this rank on channel c (its word HEADER_WORDS + c *
               ranks + rank) into recv_layout[0, s, c], the running sum over (s, c) before
               it into recv_layout[1, s, c] (the first row), the total into num_recv; a
               total above ``worst`` (when not 0: the rows the receiver has room for)
               writes the watchdog's record and traps

Why two parities: a rank may start exchange n + 1, writing parity (n + 1) & 1 of its
peers' buffers, as soon as its exchange n is over, while a peer is still reading
exchange n's; it cannot start n + 2 (parity n & 1 again) before every peer has written
flag n + 1, which each does only after its exchange n is over. The flags only grow,
so nothing is ever reset.

A message's first words are the sizes every rank must share: a rank whose sizes differ
may write a message of another length, and the host checks those words before it reads
any count (``ep/layout.py``); a dispatch that does not read them relies on the rings'
entry signatures instead (``plan.py``). Compile-time: the ranks. Run-time: the tokens,
the channels, the experts, ``worst``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns.poll import Watchdog
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from .common import EXCHANGE_OVERFLOW, EXCHANGE_RECEIVE, buffer_of, wait_for_number
from .plan import (EXCHANGE_FLAGS, EXCHANGE_SLOTS, HEADER_WORDS, MAX_CHANNELS, MAX_RANKS,
                   MESSAGE_WORDS)

THREADS = 256
WARPS = THREADS // 32
BATCH = 32        # tokens a ballot counts


@dataclass(frozen=True)
class ExchangeConfig:
    ranks: int
    target: str

    @property
    def name(self) -> str:
        return f"ep_exchange_r{self.ranks}"


def choose_config(arch: Arch, ranks: int) -> ExchangeConfig:
    if not 2 <= ranks <= MAX_RANKS:
        raise ValueError(f"the group must have 2 to {MAX_RANKS} ranks, got {ranks}")
    arch.require("griddepcontrol", "the count exchange kernel (programmatic dependent launch)")
    return ExchangeConfig(ranks, arch.target)


def slot_offset(parity: int, source: int) -> int:
    """Byte offset in a buffer of the slot of ``source``'s message of that parity."""
    return EXCHANGE_SLOTS + 4 * MESSAGE_WORDS * (MAX_RANKS * parity + source)


def generate(cfg: ExchangeConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS)
    k.launch = LaunchShape(block=THREADS)
    p = SimpleNamespace(header=k.param("header", "u64"),    # int32 [HEADER_WORDS]
                        in_rank=k.param("is_token_in_rank", "u64"),  # bool [T, ranks]
                        tokens=k.param("tokens", "u32"),
                        per_expert=k.param("num_tokens_per_expert", "u64"),  # int32 [E]
                        experts=k.param("experts", "u32"),
                        channels=k.param("channels", "u32"),
                        worst=k.param("worst", "u32"),       # the most rows received; 0: any
                        out=k.param("out", "u64"),           # int32 [ranks, words]
                        recv_layout=k.param("recv_layout", "u64"),  # int32 [2, ranks, channels]
                        send_layout=k.param("send_layout", "u64"),  # int32 [ranks, channels]
                        num_recv=k.param("num_recv", "u64"),        # int32 [1]
                        rank=k.param("rank", "u32"),
                        peers=k.param("peers", "u64"),       # u64 [ranks]: the buffers
                        error=k.param("error", "u64"),       # the watchdog's record
                        timeout_ns=k.param("timeout_ns", "u64"))
    with k.stage("programmatic launch; wait for the kernel before this one"):
        # A no-op unless launched programmatically; the inputs are the previous kernels'.
        k.griddepcontrol_launch_dependents()
        k.griddepcontrol_wait()
    t = _scalars(k, p, cfg.ranks)
    message = _compose(k, cfg, p, t)
    with k.stage("write: the message into slot (n & 1, rank) of every rank's buffer"):
        dst = k.reg("u64", "slot_at")
        for r in range(cfg.ranks):
            k.ld(dst, addr(t.peers, 8 * r), nc=True)   # rank r's buffer
            k.add(dst, dst, t.slots)
            k.mad(dst, t.rank, 4 * MESSAGE_WORDS, dst, mode="wide")
            _copy_words(k, t, message, dst, source="shared")
        # Each thread's stores before the flag that publishes them (the flag's release is
        # one thread's; the fence makes every thread's stores visible at system scope).
        k.fence("acq_rel", "sys")
    k.bar_sync(0)
    with k.stage("publish: thread r stores n to rank r's flag[rank] (st.release.sys)"):
        with k.if_(t.one_per_rank, "not_a_publisher"):
            flag = k.reg("u64", "flag_at")
            buffer_of(k, flag, t.peers, t.tid)
            k.add(flag, flag, EXCHANGE_FLAGS)
            k.mad(flag, t.rank, 4, flag, mode="wide")
            k.st(addr(flag), t.number, sem="release", scope="sys")
    with k.stage("wait: thread r polls this rank's flag[r] until it reaches n"):
        with k.if_(t.one_per_rank, "not_a_waiter"):
            own = k.reg("u64", "own_buffer")
            buffer_of(k, own, t.peers, t.rank)
            wait_for_number(k, t, EXCHANGE_FLAGS, own, t.tid, None, t.number,
                            code=EXCHANGE_RECEIVE, channel=0)
    k.bar_sync(0)
    with k.stage("read: every rank's slot (n & 1, r) into out[r]"):
        src, dst = k.reg("u64", "gathered_at"), k.reg("u64", "out_at")
        buffer_of(k, src, t.peers, t.rank)
        k.add(src, src, t.slots)
        k.ld_param(dst, p.out)
        row = k.reg("u64", "out_row_bytes")
        k.mul(row, t.words, 4, mode="wide")
        for _ in range(cfg.ranks):
            _copy_words(k, t, src, dst, source="acquired")
            k.add(src, src, 4 * MESSAGE_WORDS)
            k.add(dst, dst, row)
    _receive_layout(k, cfg, p, t)
    _send_layout(k, cfg, p, t)
    return k


def _compose(k: KernelBuilder, cfg: ExchangeConfig, p, t):
    """This rank's message in shared memory (its u32 address): the header's words, each
    channel's tokens for each rank, the pairs per expert."""
    message = k.shared("message", 4 * MESSAGE_WORDS, align=16)
    base, at, word = k.reg("u32", "message_smem"), k.reg("u32", "message_word_at"), k.reg(
        "u32", "message_word")
    src = k.reg("u64", "input_at")
    k.mov(base, message)
    channels, experts = t.channels, t.experts
    with k.stage("compose: the header's words (the sizes, the bad indices)"):
        is_header = k.pred("header_word")
        k.setp("lt", is_header, t.tid, HEADER_WORDS)
        with k.if_(is_header, "not_a_header_word"):
            k.ld_param(src, p.header)
            k.mad(src, t.tid, 4, src, mode="wide")
            k.ld(word, addr(src), nc=True)
            k.mad(at, t.tid, 4, base)
            k.st(addr(at), word, space="shared")
    with k.stage("compose: the pairs per expert, past the channels' counts"):
        first, i = k.reg("u32", "first_expert_word"), k.reg("u32", "expert")
        k.mad(first, channels, 4 * cfg.ranks, base)
        k.add(first, first, 4 * HEADER_WORDS)
        with k.loop(i, experts, start=t.tid, step=THREADS, hint="expert_count"):
            k.ld_param(src, p.per_expert)
            k.mad(src, i, 4, src, mode="wide")
            k.ld(word, addr(src), nc=True)
            k.mad(at, i, 4, first)
            k.st(addr(at), word, space="shared")
    with k.stage("compose: warp w counts channels w, w + WARPS, ...: a ballot per rank"):
        lane, warp = k.reg("u32", "lane"), k.reg("u32", "warp")
        k.and_(lane, t.tid, 31)
        k.shr(warp, t.tid, 5)
        tokens, per, begin, end = (k.reg("u32", n) for n in ("tokens", "per_channel",
                                                              "channel_begin", "channel_end"))
        k.ld_param(tokens, p.tokens)
        k.add(per, tokens, channels)
        k.sub(per, per, 1)
        k.div(per, per, channels)       # ceil(T / channels), as plan.channel_bounds
        in_rank = k.reg("u64", "in_rank")
        k.ld_param(in_rank, p.in_rank)
        channel, batch, token, flag, n = (k.reg("u32", name) for name in (
            "count_channel", "count_batch", "count_token", "count_flag", "count_n"))
        counts = k.regs("u32", cfg.ranks, "count")
        ballot, in_batch, goes = k.reg("b32", "count_ballot"), k.pred("count_in_batch"), k.pred(
            "count_goes")
        lane0 = k.pred("count_lane0")
        k.setp("eq", lane0, lane, 0)
        with k.loop(channel, channels, start=warp, step=WARPS, uniform=True, hint="channel"):
            k.mul(begin, channel, per, mode="lo")
            k.min(begin, begin, tokens)
            k.add(end, begin, per)
            k.min(end, end, tokens)
            for count in counts:
                k.mov(count, 0)
            with k.loop(batch, end, start=begin, step=BATCH, uniform=True, hint="count_batch"):
                k.add(token, batch, lane)
                k.setp("lt", in_batch, token, end)
                k.mad(src, token, cfg.ranks, in_rank, mode="wide")
                for r, count in enumerate(counts):
                    k.mov(flag, 0)
                    with k.guard(in_batch):
                        k.ld(flag, addr(src, r), nc=True, type="u8")
                    k.setp("ne", goes, flag, 0)
                    k.vote_sync(ballot, goes, mode="ballot")
                    k.popc(n, ballot)
                    k.add(count, count, n)
            with k.if_(lane0, "not_the_counter"):
                k.mad(at, channel, 4 * cfg.ranks, base)
                for r, count in enumerate(counts):
                    k.st(addr(at, 4 * (HEADER_WORDS + r)), count, space="shared")
    k.bar_sync(0)
    return base


def _send_layout(k: KernelBuilder, cfg: ExchangeConfig, p, t) -> None:
    """send_layout[d, c]: the row of rank d's received order where what this rank sends d
    on channel c begins (sources in rank order, a source's channels in order): thread d <
    ranks adds up, from the gathered slots, the counts for d of every channel of the
    ranks before this one, then of this rank's channels one by one."""
    with k.stage("send layout: where this rank's rows for rank d begin there, per channel"):
        with k.if_(t.one_per_rank, "not_a_destination"):
            channels = t.channels
            total, value = k.reg("u32", "send_total"), k.reg("u32", "send_count")
            source, channel, word = k.reg("u32", "send_source"), k.reg(
                "u32", "send_channel"), k.reg("u32", "send_word")
            slot, at, out = k.reg("u64", "send_slot"), k.reg("u64", "send_at"), k.reg(
                "u64", "send_out")
            buffer_of(k, slot, t.peers, t.rank)
            k.add(slot, slot, t.slots)

            def count(of_source):
                """value = source ``of_source``'s count for rank tid on ``channel``."""
                k.mad(word, channel, cfg.ranks, t.tid)
                k.add(word, word, HEADER_WORDS)
                k.mad(at, of_source, 4 * MESSAGE_WORDS, slot, mode="wide")
                k.mad(at, word, 4, at, mode="wide")
                k.ld(value, addr(at), eviction="L1::no_allocate")

            k.mov(total, 0)
            with k.loop(source, t.rank, hint="earlier_source"):
                with k.loop(channel, channels, hint="earlier_channel"):
                    count(source)
                    k.add(total, total, value)
            k.ld_param(out, p.send_layout)
            k.mul(at, t.tid, channels, mode="wide")
            k.mad(out, at, 4, out, mode="lo", type="u64")
            with k.loop(channel, channels, hint="own_channel"):
                count(t.rank)
                k.st(addr(out), total)
                k.add(out, out, 4)
                k.add(total, total, value)


def _receive_layout(k: KernelBuilder, cfg: ExchangeConfig, p, t) -> None:
    """recv_layout and num_recv from the gathered slots: thread i < ranks * channels reads
    entry i = (s, c) into shared memory; thread 0 sums them in order; each thread writes
    its entry's count and first row."""
    counts = k.shared("recv_counts", 4 * MAX_RANKS * MAX_CHANNELS, align=16)
    firsts = k.shared("recv_firsts", 4 * MAX_RANKS * MAX_CHANNELS, align=16)
    channels, entries = t.channels, k.reg("u32", "entries")
    k.mul(entries, channels, cfg.ranks, mode="lo")
    mine, source, channel = k.pred("my_entry"), k.reg("u32", "source"), k.reg("u32", "channel")
    count, first = k.reg("u32", "entry_count"), k.reg("u32", "entry_first")
    at, word = k.reg("u64", "entry_at"), k.reg("u32", "entry_word")
    smem = k.reg("u32", "entry_smem")
    k.setp("lt", mine, t.tid, entries)
    with k.stage("layout: each entry's count, from source s's word for (c, this rank)"):
        with k.if_(mine, "no_entry"):
            k.div(source, t.tid, channels)
            k.rem(channel, t.tid, channels)
            buffer_of(k, at, t.peers, t.rank)
            k.add(at, at, t.slots)
            k.mad(at, source, 4 * MESSAGE_WORDS, at, mode="wide")
            k.mad(word, channel, cfg.ranks, t.rank)
            k.add(word, word, HEADER_WORDS)
            k.mad(at, word, 4, at, mode="wide")
            k.ld(count, addr(at), eviction="L1::no_allocate")
            k.mov(smem, counts)
            k.mad(smem, t.tid, 4, smem)
            k.st(addr(smem), count, space="shared")
    k.bar_sync(0)
    with k.stage("layout: thread 0 sums the entries in (source, channel) order"):
        is_first = k.pred("thread_0")
        k.setp("eq", is_first, t.tid, 0)
        with k.if_(is_first, "not_thread_0"):
            i, total, value = k.reg("u32", "entry"), k.reg("u32", "total"), k.reg("u32", "count")
            read, write = k.reg("u32", "count_at"), k.reg("u32", "first_at")
            k.mov(total, 0)
            with k.loop(i, entries, hint="running_sum"):
                k.mov(read, counts)
                k.mad(read, i, 4, read)
                k.mov(write, firsts)
                k.mad(write, i, 4, write)
                k.ld(value, addr(read), space="shared")
                k.st(addr(write), total, space="shared")
                k.add(total, total, value)
            out = k.reg("u64", "num_recv_at")
            k.ld_param(out, p.num_recv)
            k.st(addr(out), total)
            worst, limited, over = k.reg("u32", "worst"), k.pred("limited"), k.pred("over")
            k.ld_param(worst, p.worst)
            k.setp("ne", limited, worst, 0)
            k.setp("gt", over, total, worst)
            k.and_pred(over, over, limited)
            with k.if_(over, "fits"):
                t.watchdog.fail(EXCHANGE_OVERFLOW, 0, t.rank, total)
    k.bar_sync(0)
    with k.stage("layout: each entry's count and first row into recv_layout"):
        with k.if_(mine, "no_entry_out"):
            k.mov(smem, firsts)
            k.mad(smem, t.tid, 4, smem)
            k.ld(first, addr(smem), space="shared")
            table = k.reg("u64", "recv_layout_at")
            k.ld_param(table, p.recv_layout)
            k.mad(table, t.tid, 4, table, mode="wide")
            k.st(addr(table), count)
            k.mul(at, entries, 4, mode="wide")
            k.add(table, table, at)
            k.st(addr(table), first)


def _scalars(k: KernelBuilder, p: SimpleNamespace, ranks: int) -> SimpleNamespace:
    """The thread's index, the parameters it uses (the channels and experts among them,
    loaded once), the exchange's number n, the slots of parity n & 1 (a byte offset in
    every buffer), whether it is one of the first ``ranks`` threads."""
    t = SimpleNamespace()
    t.tid, t.rank, t.words, t.number = (k.reg("u32", n) for n in ("tid", "rank", "words",
                                                                   "number"))
    k.mov(t.tid, sreg.tid.x)
    k.ld_param(t.rank, p.rank)
    # A message's words: the header, the channels' counts for every rank, the experts'.
    t.channels, t.experts = k.reg("u32", "channels"), k.reg("u32", "experts")
    k.ld_param(t.channels, p.channels)
    k.ld_param(t.experts, p.experts)
    k.mad(t.words, t.channels, ranks, t.experts)
    k.add(t.words, t.words, HEADER_WORDS)
    t.peers = k.reg("u64", "peers")
    k.ld_param(t.peers, p.peers)
    # n: this rank's last exchange + 1, read before thread ``rank`` publishes n there.
    own = k.reg("u64", "last_number_at")
    buffer_of(k, own, t.peers, t.rank)
    k.add(own, own, EXCHANGE_FLAGS)
    k.mad(own, t.rank, 4, own, mode="wide")
    k.ld(t.number, addr(own), sem="relaxed", scope="sys")
    k.add(t.number, t.number, 1)
    error, timeout = k.reg("u64", "error"), k.reg("u64", "timeout_ns")
    k.ld_param(error, p.error)
    k.ld_param(timeout, p.timeout_ns)
    t.watchdog = Watchdog(k, error, timeout)
    parity = k.reg("u32", "parity")
    k.and_(parity, t.number, 1)
    t.slots = k.reg("u64", "slots")
    k.mul(t.slots, parity, 4 * MESSAGE_WORDS * MAX_RANKS, mode="wide")
    k.add(t.slots, t.slots, EXCHANGE_SLOTS)
    t.one_per_rank = k.pred("one_per_rank")
    k.setp("lt", t.one_per_rank, t.tid, ranks)
    return t


def _copy_words(k: KernelBuilder, t, src, dst, *, source: str) -> None:
    """words[i] of ``src`` to ``dst`` for i = tid, tid + THREADS, ... < words. ``source``:
    "shared" (the composed message, a u32 shared address), or "acquired" (a slot the peers
    wrote, read after the flags' acquire and the barrier, past L1)."""
    i, value = k.reg("u32", "word"), k.reg("u32", "word_value")
    at_dst = k.reg("u64", "word_dst")
    at_src = k.reg("u32" if source == "shared" else "u64", "word_src")
    with k.loop(i, t.words, start=t.tid, step=THREADS, hint="copy_words"):
        k.mad(at_dst, i, 4, dst, mode="wide")
        if source == "shared":
            k.mad(at_src, i, 4, src)
            k.ld(value, addr(at_src), space="shared")
        else:
            k.mad(at_src, i, 4, src, mode="wide")
            k.ld(value, addr(at_src), eviction="L1::no_allocate")
        k.st(addr(at_dst), value, eviction="L1::no_allocate")
