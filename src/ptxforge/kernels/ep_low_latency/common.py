"""What the low-latency dispatch and combine share: the parameters every CTA reads, the
thread's coordinates, and each CTA's role.

A kernel's grid is its send CTAs, then its receive CTAs (a ``phase`` of "both" launches
both, cooperatively: a receiver waits for senders that must be resident; "send" or
"receive" launches one half). Senders never wait, so a send-only launch needs no
residency, and the receive half can run later (the host's hook).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

from ...arch import Arch
from ...ptx import KernelBuilder, LaunchShape, sreg
from ..ep_intranode import common as intranode
from .plan import LowLatencyPlan, check_problem

PHASES = ("send", "receive", "both")
WARPS = 4  # a CTA's warps: enough rows in flight per expert or token, many CTAs an SM
# CTAs an SM must hold (at most 128 registers a thread): a cooperative launch of both
# halves (the summed combine's 256 send CTAs and up to 256 receivers) fits 132 SMs; ptxas's
# own choice for these kernels (40 registers) spilled. A kernel's config may take other
# values (the dispatch's).
MIN_CTAS_PER_SM = 4
# The 16-byte vectors of a row a lane has in flight: a decode call's CTA copies a few rows,
# one after another, so each copy's latency is its cost; 16 cover a 7168-byte e4m3 row
# (14 a lane) in one round.
COPY_UNROLL = 16


@dataclass(frozen=True)
class LowLatencyConfig:
    """A decode kernel's variant: the sizes its buffer plan is laid out for, and which half
    (or both) it runs. ``KIND`` (the subclass's): "dispatch" or "combine"."""

    KIND: ClassVar[str]
    WARPS: ClassVar[int] = WARPS
    MIN_CTAS_PER_SM: ClassVar[int] = MIN_CTAS_PER_SM
    ranks: int
    max_tokens: int
    hidden: int
    experts: int
    topk: int
    phase: str
    target: str

    @property
    def name(self) -> str:
        return (f"ep_ll_{self.KIND}_{self.phase}_r{self.ranks}_t{self.max_tokens}_"
                f"h{self.hidden}_e{self.experts}_k{self.topk}")

    @property
    def plan(self) -> LowLatencyPlan:
        return LowLatencyPlan(self.ranks, self.max_tokens, self.hidden, self.experts, self.topk)

    @property
    def sends(self) -> bool:
        return self.phase != "receive"

    @property
    def receives(self) -> bool:
        return self.phase != "send"

    @property
    def threads(self) -> int:
        return 32 * self.WARPS


def check(arch: Arch, ranks: int, max_tokens: int, hidden: int, experts: int, topk: int,
          phase: str, kernel: str, needs: tuple = ()) -> None:
    """A variant's sizes and phase, and what the device must have: ``needs``' (feature,
    why) pairs, then programmatic launch (``kernel`` names the kernel in the errors)."""
    check_problem(ranks, max_tokens, hidden, experts, topk)
    check_phase(phase)
    for feature, why in needs:
        arch.require(feature, why)
    arch.require("griddepcontrol", f"the low-latency {kernel} (programmatic dependent launch)")


def kernel(cfg: LowLatencyConfig) -> KernelBuilder:
    """The variant's builder: CTAs of ``cfg.WARPS`` warps, ``cfg.MIN_CTAS_PER_SM`` an SM; a
    launch of both halves is cooperative (its receivers wait for senders that must be
    resident)."""
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads,
                      min_blocks_per_sm=cfg.MIN_CTAS_PER_SM)
    k.launch = LaunchShape(block=cfg.threads, cooperative=cfg.phase == "both")
    return k


def roles(k: KernelBuilder, cfg: LowLatencyConfig, t: SimpleNamespace, send, receive) -> None:
    """Emit the halves the phase runs (``send()``, ``receive()``: emitters); with both, the
    CTA's role picks its half."""
    if cfg.phase == "both":
        with k.if_(t.sender, "not_a_sender", uniform=True):
            send()
        with k.if_(~t.sender, "not_a_receiver", uniform=True):
            receive()
    elif cfg.sends:
        send()
    else:
        receive()


def check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")


def declare_common_params(k: KernelBuilder, p: SimpleNamespace) -> None:
    p.rank = k.param("rank", "u32")
    p.peers = k.param("peers", "u64")            # u64 [ranks]: every rank's buffer, mapped here
    p.error = k.param("error", "u64")            # int32 [4] in mapped host memory
    p.timeout_ns = k.param("timeout_ns", "u64")


def prologue(k: KernelBuilder, p: SimpleNamespace, senders: int | None) -> SimpleNamespace:
    """Programmatic-launch housekeeping, the thread's coordinates (``tid``, ``lane``,
    ``warp``, ``lane0``, ``thread0``), the common scalars (``rank``, ``peers``,
    ``watchdog``, ``own``: this rank's buffer) and the CTA's role: ``sender`` (a
    predicate; None where the phase has one role) and ``index``, the CTA's index among
    its role's (``senders``: how many send CTAs come first; None: one role)."""
    t = SimpleNamespace()
    with k.stage("programmatic launch; wait for the kernel before this one"):
        k.griddepcontrol_launch_dependents()
        k.griddepcontrol_wait()
    with k.stage("coordinates and role"):
        t.tid, t.lane, t.warp = k.reg("u32", "tid"), k.reg("u32", "lane"), k.reg("u32", "warp")
        k.mov(t.tid, sreg.tid.x)
        k.and_(t.lane, t.tid, 31)
        k.shr(t.warp, t.tid, 5)
        t.lane0, t.thread0 = k.pred("lane0"), k.pred("thread0")
        k.setp("eq", t.lane0, t.lane, 0)
        k.setp("eq", t.thread0, t.tid, 0)
        cta = k.reg("u32", "cta")
        k.mov(cta, sreg.ctaid.x)
        t.index, t.sender = cta, None
        if senders is not None:
            t.sender, t.index = k.pred("sender"), k.reg("u32", "role_index")
            k.setp("lt", t.sender, cta, senders)
            k.sub(t.index, cta, senders)
            k.selp(t.index, cta, t.index, t.sender)
    intranode.scalars(k, t, p)
    t.own = k.reg("u64", "own_buffer")
    intranode.buffer_of(k, t.own, t.peers, t.rank)
    return t
