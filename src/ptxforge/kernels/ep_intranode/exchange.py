"""The count exchange before a dispatch: every rank's message to every rank through the
ranks' buffers, over NVLink, with no host collective; the host reads the gathered
messages with one copy.

A message is ``words`` int32 (``ep/layout.py`` packs it: the call's sizes, the rank's
tokens for each rank on each channel, its pairs per expert, its top-k indices out of
range). Each buffer holds, at ``plan.EXCHANGE_FLAGS``, a u32 flag per source rank, and
at ``plan.EXCHANGE_SLOTS``, two sets (parities) of a slot per source rank, each of
``plan.MESSAGE_WORDS`` words. Exchange n (1, 2, ... counted by each rank's host since
the buffer's creation; every rank makes the same exchanges) uses parity n & 1:

    write      the CTA copies the message into slot (n & 1, rank) of every rank's buffer,
               its own included; each thread then fences its stores (fence.acq_rel.sys)
    publish    bar.sync; thread r stores n to rank r's flag[rank] with st.release.sys
    wait       thread r polls its own flag[r] until it has reached n (flag - n modulo 2^32
               below 2^31: a peer may be at n + 1 already), under the watchdog
    read       bar.sync; the CTA copies slot (n & 1, r) of every rank r, ``words`` words
               each, into out [ranks, words]

Why two parities: a rank may start exchange n + 1, writing parity (n + 1) & 1 of its
peers' buffers, as soon as its exchange n is over, while a peer is still reading
exchange n's; it cannot start n + 2 (parity n & 1 again) before every peer has written
flag n + 1, which each does only after its exchange n is over. The flags only grow,
so nothing is ever reset.

A message's first words are the sizes every rank must share: a rank whose sizes differ
may write a message of another length, and the host checks those words before it reads
any count (``ep/layout.py``). Compile-time: the ranks. Run-time: the words, the number.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns.poll import Watchdog
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from .common import EXCHANGE_RECEIVE, buffer_of
from .plan import EXCHANGE_FLAGS, EXCHANGE_SLOTS, MAX_RANKS, MESSAGE_WORDS

THREADS = 256


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
    p = SimpleNamespace(message=k.param("message", "u64"),  # int32 [words]: this rank's
                        words=k.param("words", "u32"),
                        number=k.param("number", "u32"),     # the exchange's: 1, 2, ...
                        out=k.param("out", "u64"),           # int32 [ranks, words]
                        rank=k.param("rank", "u32"),
                        peers=k.param("peers", "u64"),       # u64 [ranks]: the buffers
                        error=k.param("error", "u64"),       # the watchdog's record
                        timeout_ns=k.param("timeout_ns", "u64"))
    with k.stage("programmatic launch; wait for the kernel before this one"):
        # A no-op unless launched programmatically; the message is the previous kernels'.
        k.griddepcontrol_launch_dependents()
        k.griddepcontrol_wait()
    t = _scalars(k, p, cfg.ranks)
    with k.stage("write: the message into slot (n & 1, rank) of every rank's buffer"):
        src, dst = k.reg("u64", "message_at"), k.reg("u64", "slot_at")
        k.ld_param(src, p.message)
        for r in range(cfg.ranks):
            k.ld(dst, addr(t.peers, 8 * r), nc=True)   # rank r's buffer
            k.add(dst, dst, t.slots)
            k.mad(dst, t.rank, 4 * MESSAGE_WORDS, dst, mode="wide")
            _copy_words(k, t, src, dst)
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
            own, seen, ahead = k.reg("u64", "own_flag_at"), k.reg("u32", "flag"), k.reg(
                "u32", "flag_ahead")
            reached = k.pred("reached")
            buffer_of(k, own, t.peers, t.rank)
            k.add(own, own, EXCHANGE_FLAGS)
            k.mad(own, t.tid, 4, own, mode="wide")

            def arrived(value):
                # flag - n, modulo 2^32, below 2^31: the flag is n or past it.
                k.sub(ahead, value, t.number)
                k.setp("lt", reached, ahead, 1 << 31)
                return reached

            t.watchdog.wait(seen, addr(own), arrived, code=EXCHANGE_RECEIVE, channel=0,
                            peer=t.tid)
    k.bar_sync(0)
    with k.stage("read: every rank's slot (n & 1, r) into out[r]"):
        src, dst = k.reg("u64", "gathered_at"), k.reg("u64", "out_at")
        buffer_of(k, src, t.peers, t.rank)
        k.add(src, src, t.slots)
        k.ld_param(dst, p.out)
        row = k.reg("u64", "out_row_bytes")
        k.mul(row, t.words, 4, mode="wide")
        for _ in range(cfg.ranks):
            _copy_words(k, t, src, dst, acquired=True)
            k.add(src, src, 4 * MESSAGE_WORDS)
            k.add(dst, dst, row)
    return k


def _scalars(k: KernelBuilder, p: SimpleNamespace, ranks: int) -> SimpleNamespace:
    """The thread's index, the parameters it uses, the slots of parity n & 1 (a byte
    offset in every buffer), whether it is one of the first ``ranks`` threads."""
    t = SimpleNamespace()
    t.tid, t.rank, t.words, t.number = (k.reg("u32", n) for n in ("tid", "rank", "words",
                                                                   "number"))
    k.mov(t.tid, sreg.tid.x)
    k.ld_param(t.rank, p.rank)
    k.ld_param(t.words, p.words)
    k.ld_param(t.number, p.number)
    t.peers = k.reg("u64", "peers")
    k.ld_param(t.peers, p.peers)
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


def _copy_words(k: KernelBuilder, t, src, dst, *, acquired: bool = False) -> None:
    """words[i] of ``src`` to ``dst`` for i = tid, tid + THREADS, ... < words. A slot the
    peers wrote is read after the flags' acquire and the barrier, past L1 (``acquired``);
    the message itself is this kernel's input."""
    i, value = k.reg("u32", "word"), k.reg("u32", "word_value")
    at_src, at_dst = k.reg("u64", "word_src"), k.reg("u64", "word_dst")
    with k.loop(i, t.words, start=t.tid, step=THREADS, hint="copy_words"):
        k.mad(at_src, i, 4, src, mode="wide")
        k.mad(at_dst, i, 4, dst, mode="wide")
        if acquired:
            k.ld(value, addr(at_src), eviction="L1::no_allocate")
        else:
            k.ld(value, addr(at_src), nc=True)
        k.st(addr(at_dst), value, eviction="L1::no_allocate")
