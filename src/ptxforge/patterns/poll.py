"""Waiting for a counter that another GPU publishes, with a time limit; failing with a
record the host can read.

A communication kernel waits on counters its peers write (``st.release.sys``); if a peer
never writes (it died, or disagrees on how much to send), the wait must end with a
message instead of hanging the GPU. ``Watchdog.wait`` emits, per wait:

    mov.u64   start, %globaltimer              the wait's start, in ns
  top:
    ld.acquire.sys.global.u32  seen, [counter] the counter, and everything published before it
    (the caller's test of ``seen``)            -> ready
    @ready bra done
    mov.u64   now, %globaltimer
    sub.u64   now, now, start
    setp.le.u64 waiting, now, timeout_ns
    @waiting bra top
    ld.acquire.sys.global.u32  seen, [counter] once more: the context may have been switched
    (the caller's test of ``seen``)            out between the load and the clock, for longer
    @ready bra done                            than the limit, while the counter arrived
    st.relaxed.sys.global.v4.b32 [error], {code, channel, peer, seen}
    fence.sc.sys
    trap
  done:

The record lands in host memory the launch names (``error``: a pinned, mapped buffer of
4 int32); the trap then ends the kernel with an error the host sees at its next
synchronisation, and the host reads the record to say which wait timed out. One thread
polls (the caller picks it); the acquire orders what it reads after the counter, and a
barrier after the wait passes that order on to the other threads. ``Watchdog.fail``
emits the last three lines alone, for a check that fails outright.
"""

from __future__ import annotations

from typing import Callable

from ..ptx import KernelBuilder, Reg, addr, sreg
from ..ptx.operands import Address


class Watchdog:
    """Emits timed waits and failures; ``error`` (u64: the record's address) and
    ``timeout_ns`` (u64) are registers the kernel loaded once. Registers are shared by
    every wait it emits."""

    def __init__(self, k: KernelBuilder, error: Reg, timeout_ns: Reg):
        self.k, self.error, self.timeout_ns = k, error, timeout_ns
        self.start, self.now = k.reg("u64", "wait_start"), k.reg("u64", "wait_now")
        self.waiting = k.pred("still_waiting")
        self.record = k.regs("b32", 4, "timeout_record")

    def wait(self, seen: Reg, counter: Address, ready: Callable[[Reg], Reg], *, code: int,
             channel, peer) -> None:
        """Poll ``counter`` into ``seen`` until ``ready(seen)`` (a predicate the callback
        computes) holds; past the time limit, write the record (code, channel, peer, seen)
        and trap. ``channel`` and ``peer``: registers or integers."""
        k = self.k
        top, done = k.label("poll"), k.label("poll_done")
        k.mov(self.start, sreg.globaltimer)
        k.place(top)
        k.ld(seen, counter, sem="acquire", scope="sys")
        with k.guard(ready(seen)):
            k.bra(done)
        k.mov(self.now, sreg.globaltimer)
        k.sub(self.now, self.now, self.start)
        k.setp("le", self.waiting, self.now, self.timeout_ns)
        with k.guard(self.waiting):
            k.bra(top)
        # Past the limit, one more look: a time slice given to another context between the
        # load and the clock can outlast the limit while the counter is already there.
        k.ld(seen, counter, sem="acquire", scope="sys")
        with k.guard(ready(seen)):
            k.bra(done)
        self.fail(code, channel, peer, seen)
        k.place(done)

    def fail(self, code: int, channel, peer, value) -> None:
        """Write the record (code, channel, peer, value) and trap."""
        k = self.k
        for word, field in zip(self.record, (code, channel, peer, value)):
            k.mov(word, field, type="b32")
        k.st(addr(self.error), self.record, sem="relaxed", scope="sys")
        k.fence("sc", "sys")
        k.trap()
