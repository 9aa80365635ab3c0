"""Shared-memory stages filled by the copy engine, each guarded by an mbarrier.

    stages = StageRing(k, smem_base, stage_bytes, count)
    stages.init(thread0)                           # barriers, fences, a CTA barrier
    k.mbarrier_arrive_expect_tx(bar, nbytes)       # producer: arm, then copy
    stages.wait(bar, phase)                        # consumer: until the bytes landed

Layout: the stages back to back from the base, then one 8-byte mbarrier per stage.
Each barrier expects one arrival (the producer's arrive.expect_tx) per phase.
"""

from __future__ import annotations

from ..ptx import Address, KernelBuilder, Reg, addr

BARRIER_BYTES = 8


class StageRing:
    def __init__(self, k: KernelBuilder, base: Reg, stage_bytes: int, count: int):
        """``base``: a u32 shared-memory address where the stages begin."""
        self.k, self.base, self.stage_bytes, self.count = k, base, stage_bytes, count

    @staticmethod
    def shared_bytes(stage_bytes: int, count: int) -> int:
        """Shared memory the stages and their barriers occupy."""
        return count * stage_bytes + count * BARRIER_BYTES

    def stage_offset(self, stage: int) -> int:
        return stage * self.stage_bytes

    def barrier_offset(self, stage: int) -> int:
        return self.count * self.stage_bytes + stage * BARRIER_BYTES

    def init(self, thread0: Reg) -> None:
        """Thread 0 initialises every barrier; the fences make them visible to the copy
        engine, a CTA barrier to every thread (count + 3 instructions)."""
        k = self.k
        with k.guard(thread0):
            for s in range(self.count):
                k.mbarrier_init(addr(self.base, self.barrier_offset(s)), 1)
            k.fence_mbarrier_init()
        k.fence_proxy_async()
        k.bar_sync(0)

    def wait(self, bar: Address, phase) -> None:
        """Every thread of the CTA waits: the spin branch is uniform."""
        wait_parity(self.k, bar, phase, "wait_stage", uniform=True)


def wait_parity(k: KernelBuilder, bar: Address, parity, hint: str = "wait", *,
                uniform: bool = False) -> None:
    """Spin until the phase with ``parity`` of the mbarrier at ``bar`` completed
    (try_wait, then a branch back while it has not; 2 instructions and a label).
    ``uniform``: all threads of each warp wait together (``bra.uni``)."""
    done, again = k.pred(hint + "_done"), k.label(hint)
    k.place(again)
    k.mbarrier_try_wait_parity(done, bar, parity)
    with k.guard(~done):
        k.bra(again, uniform=uniform)


def next_stage(k: KernelBuilder, stage: Reg, phase: Reg, stages: int, step: int = 1) -> None:
    """Step a ring position by ``step`` (<= stages) stages, wrapping around and flipping
    the phase bit that mbarrier waits compare against (4 instructions)."""
    wrapped = k.pred("ring_wrapped")
    k.add(stage, stage, step)
    k.setp("ge", wrapped, stage, stages)
    with k.guard(wrapped):
        k.sub(stage, stage, stages)
        k.xor(phase, phase, 1)
