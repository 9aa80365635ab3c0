"""What the dispatch and combine kernels share: the CTA's role and channel, the warp's
group, the channel's tokens, a rank's buffer address and the timed waits.

Grid: 2 x channels CTAs (the SM budget), all resident at once (a cooperative launch:
senders and receivers of one kernel wait on each other). CTA 2c sends on channel c, CTA
2c + 1 receives on it. A CTA's warps form one group of ``warps_per_peer`` warps per peer
rank; group p's named barrier is 1 + p.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...arch import Arch
from ...patterns.poll import Watchdog
from ...ptx import KernelBuilder, addr, sreg
from .plan import MAX_CHANNELS, MAX_RANKS, BufferPlan, check_plan

# The watchdog's record codes: which wait timed out, or which entry came from a peer
# that laid its rings out for other sizes (the host's messages, ep/buffer.py).
DISPATCH_SEND, DISPATCH_RECEIVE, COMBINE_SEND, COMBINE_RECEIVE = 1, 2, 3, 4
DISPATCH_MISMATCH, COMBINE_MISMATCH = 5, 6
# The low-latency kernels' waits (kernels/ep_low_latency): a dispatch receiver for a
# source rank's flag (channel: the local expert), a combine receiver for a pair's row
# (channel: the token, peer: the expert).
LL_DISPATCH_RECEIVE, LL_COMBINE_RECEIVE = 7, 8
# The count exchange's wait for a source rank's message (exchange.py; peer: the source),
# and a receiver given room for fewer rows than the ranks send it (peer: the receiver,
# value: the rows).
EXCHANGE_RECEIVE, EXCHANGE_OVERFLOW = 9, 10
# The direct dispatch's wait for a source's CTA (direct.py; channel: the channel, peer: the
# source).
DIRECT_RECEIVE = 11
# The pull combine's wait for a rank's CTA to start (pull.py; channel: the CTA, peer: the
# rank).
PULL_RECEIVE = 12
# The low-latency combine receive's wait for a rank's combine send to start (peer: the
# rank): the round's end on every rank, whatever pairs a token has where.
LL_COMBINE_START = 13
# Cache hints. A ring's entries are written by another GPU while the kernel runs: weak
# loads that skip L1, never the non-coherent path. Inputs nothing writes meanwhile may
# take it. Stores to a peer's ring skip L1.
PAYLOAD_LOAD = {"eviction": "L1::no_allocate"}
INPUT_LOAD = {"nc": True, "eviction": "L1::no_allocate"}
STORE = {"eviction": "L1::no_allocate"}



@dataclass(frozen=True)
class RingConfig:
    """What the dispatch's and the combine's variants share: the ranks and row size, the
    channels (two CTAs each) and their rings' slots, the warps a CTA gives each peer."""

    ranks: int
    hidden: int
    channels: int
    slots: int
    warps_per_peer: int
    target: str

    @property
    def plan(self) -> BufferPlan:
        return BufferPlan(self.ranks, self.channels, self.slots, self.hidden)

    @property
    def warps(self) -> int:
        return self.ranks * self.warps_per_peer

    @property
    def threads(self) -> int:
        return 32 * self.warps


def channels_for(arch: Arch, ranks: int, num_sms: int, slots: int, kernel: str) -> int:
    """The channels an SM budget gives (two SMs each), checked against the plan and the
    device; ``kernel`` names the kernel in the errors."""
    channels = num_sms // 2
    check_plan(ranks, channels, slots)
    arch.require("griddepcontrol", f"the {kernel} kernel (programmatic dependent launch)")
    if 2 * channels > arch.sm_count:
        raise ValueError(f"num_sms must be at most the {arch.sm_count} SMs of the device, "
                         f"got {num_sms}")
    return channels

def prologue(k: KernelBuilder, warps_per_peer: int) -> SimpleNamespace:
    """Programmatic-launch housekeeping, then the thread's coordinates: ``lane``,
    ``warp``, ``group`` (the peer rank of its warp's group), ``member`` (the warp's place
    in the group), ``channel``, ``sender`` (predicate), ``leader`` (lane 0 of the group's
    first warp), ``lane0``."""
    t = SimpleNamespace()
    with k.stage("programmatic launch; wait for the kernel before this one"):
        # A no-op unless launched programmatically; the inputs may be the previous
        # kernel's output.
        k.griddepcontrol_launch_dependents()
        k.griddepcontrol_wait()
    with k.stage("coordinates: role, channel, peer group"):
        tid = k.reg("u32", "tid")
        k.mov(tid, sreg.tid.x)
        t.lane, t.warp = k.reg("u32", "lane"), k.reg("u32", "warp")
        k.and_(t.lane, tid, 31)
        k.shr(t.warp, tid, 5)
        t.group, t.member = k.reg("u32", "group"), k.reg("u32", "member")
        k.div(t.group, t.warp, warps_per_peer)
        k.rem(t.member, t.warp, warps_per_peer)
        cta = k.reg("u32", "cta")
        k.mov(cta, sreg.ctaid.x)
        t.channel = k.reg("u32", "channel")
        k.shr(t.channel, cta, 1)
        role = k.reg("u32", "role")
        k.and_(role, cta, 1)
        t.sender = k.pred("sender")
        k.setp("eq", t.sender, role, 0)
        t.lane0, t.leader = k.pred("lane0"), k.pred("leader")
        k.setp("eq", t.lane0, t.lane, 0)
        k.setp("eq", t.leader, t.member, 0)
        k.and_pred(t.leader, t.leader, t.lane0)
        t.barrier = k.reg("u32", "group_barrier")  # named barrier 1 + group (0: the CTA's)
        k.add(t.barrier, t.group, 1)
    return t


def scalars(k: KernelBuilder, t: SimpleNamespace, p: SimpleNamespace) -> None:
    """The parameters every thread uses: ``rank``, ``peers``; and ``watchdog``, the
    kernel's Watchdog on the error record and time limit."""
    t.rank, t.peers = k.reg("u32", "rank"), k.reg("u64", "peers")
    k.ld_param(t.rank, p.rank)
    k.ld_param(t.peers, p.peers)
    error, timeout = k.reg("u64", "error"), k.reg("u64", "timeout_ns")
    k.ld_param(error, p.error)
    k.ld_param(timeout, p.timeout_ns)
    t.watchdog = Watchdog(k, error, timeout)


def declare_common_params(k: KernelBuilder, p: SimpleNamespace) -> None:
    p.rank = k.param("rank", "u32")
    p.peers = k.param("peers", "u64")            # u64 [ranks]: every rank's buffer, mapped here
    p.recv_layout = k.param("recv_layout", "u64")  # int32 [2, ranks, channels]: counts, offsets
    p.error = k.param("error", "u64")            # int32 [4] in mapped host memory
    p.timeout_ns = k.param("timeout_ns", "u64")


def buffer_of(k: KernelBuilder, dst, peers, rank) -> None:
    """``dst`` = rank ``rank``'s buffer (written by the host before the launch: the
    read-only path is safe)."""
    k.mad(dst, rank, 8, peers, mode="wide")
    k.ld(dst, addr(dst), nc=True)


def channel_tokens(k: KernelBuilder, tokens, channel, channels: int):
    """(begin, end) registers of the channel's tokens, as ``plan.channel_bounds``:
    ceil(tokens / channels) a channel."""
    per, begin, end = k.reg("u32", "per_channel"), k.reg("u32", "tokens_begin"), k.reg(
        "u32", "tokens_end")
    k.add(per, tokens, channels - 1)
    k.div(per, per, channels)
    k.mul(begin, channel, per, mode="lo")
    k.min(begin, begin, tokens)
    k.add(end, begin, per)
    k.min(end, end, tokens)
    return begin, end


def recv_entry(k: KernelBuilder, p, peer, channel, channels: int, ranks: int):
    """(count, first row) of what ``peer`` sends this rank on ``channel``: recv_layout[0,
    peer, channel] and recv_layout[1, peer, channel], written by the host before the
    launch."""
    at, count, first = k.reg("u64", "layout_at"), k.reg("u32", "recv_count"), k.reg(
        "u32", "recv_first")
    index = k.reg("u32", "layout_index")
    k.mad(index, peer, channels, channel)
    k.ld_param(at, p.recv_layout)
    k.mad(at, index, 4, at, mode="wide")
    k.ld(count, addr(at), nc=True)
    k.ld(first, addr(at, 4 * ranks * channels), nc=True)
    return count, first



def ring(k: KernelBuilder, buffer, rings: int, ring_bytes: int, channel, peer, ranks: int):
    """The address of ring (channel, peer) of the rings at byte ``rings`` of the buffer at
    ``buffer``: [channels][ranks] rings of ``ring_bytes``."""
    at, index = k.reg("u64", "ring"), k.reg("u32", "ring_index")
    k.mad(index, channel, ranks, peer)
    k.add(at, buffer, rings)
    k.mad(at, index, ring_bytes, at, mode="wide")
    return at


def counter(k: KernelBuilder, buffer, plan: BufferPlan, name: str, channel, peer):
    """The address of counter ``name`` of ring (channel, peer) in the buffer at ``buffer``."""
    at, index = k.reg("u64", name + "_at"), k.reg("u32", name + "_index")
    k.mad(index, channel, MAX_RANKS, peer)
    k.add(at, buffer, plan.counter(name))
    k.mad(at, index, 4, at, mode="wide")
    return at


def wait_for_number(k, t, flags: int, own, source, cta, number, *, code: int, channel) -> None:
    """The thread waits (the watchdog: ``code``, ``channel``, peer ``source``) until flag
    [source][cta] of the [MAX_RANKS][2 * MAX_CHANNELS] u32 flags at byte ``flags`` of the
    buffer ``own`` (``cta`` None: flag [source] of [MAX_RANKS] flags) reaches ``number``.
    Such flags carry the numbers of calls, so they only grow: arrived when flag - number,
    modulo 2^32, lies below 2^31."""
    at, seen, ahead = k.reg("u64", "flag_wait_at"), k.reg("u32", "flag_seen"), k.reg(
        "u32", "flag_ahead")
    reached = k.pred("arrived")
    if cta is None:
        k.mad(at, source, 4, own, mode="wide")
    else:
        k.mad(at, source, 4 * 2 * MAX_CHANNELS, own, mode="wide")
        k.mad(at, cta, 4, at, mode="wide")

    def arrived(value):
        k.sub(ahead, value, number)
        k.setp("lt", reached, ahead, 1 << 31)
        return reached

    t.watchdog.wait(seen, addr(at, flags), arrived, code=code, channel=channel, peer=source)


def check_entry(k, t, entry_at, signature_offset: int, signature: int, number, code: int,
                peer):
    """An entry's signature (at ``signature_offset``) and number (the word after it) must
    be this kernel's and ``number``: else the peer laid its rings out for other sizes, and
    the watchdog's record says so (with the signature seen). Emits the loads now; returns
    the emitter of the comparison and the failure, to place after other loads."""
    seen, seen_number = k.reg("u32", "sent_for"), k.reg("u32", "sent_number")
    mismatch, other = k.pred("mismatch"), k.pred("other_number")
    k.ld(seen, addr(entry_at, signature_offset), **PAYLOAD_LOAD)
    k.ld(seen_number, addr(entry_at, signature_offset + 4), **PAYLOAD_LOAD)

    def verify():
        k.setp("ne", mismatch, seen, signature)
        k.setp("ne", other, seen_number, number)
        k.or_(mismatch, mismatch, other)
        with k.if_(mismatch, "entry_checked"):
            t.watchdog.fail(code, t.channel, peer, seen)
    return verify
