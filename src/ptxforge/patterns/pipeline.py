"""A ring of shared-memory stages filled by the copy engine and guarded by mbarriers.

    ring = StageRing(k, smem_base, stage_bytes, stages)
    ring.init(thread0)                  # barriers + fences + a CTA barrier
    ring.expect_and_copy(stage, ...)    # producer: arm the stage, issue the copies
    ring.wait(stage, phase)             # consumer: until the stage's bytes landed

Each stage has one mbarrier (arrival count 1: the producer's arrive.expect_tx). Phases
alternate 0, 1, 0, ... each time the ring wraps; the consumer tracks (stage, phase) in
registers with ``advance``.
"""

from __future__ import annotations

from ..ptx import KernelBuilder, Reg, addr

BARRIER_BYTES = 8


class StageRing:
    def __init__(self, k: KernelBuilder, base: Reg, stage_bytes: int, stages: int):
        """``base``: a u32 shared address; the stages, then the barriers, start there."""
        self.k, self.base, self.stage_bytes, self.stages = k, base, stage_bytes, stages
        self.barriers_offset = stages * stage_bytes

    @staticmethod
    def shared_bytes(stage_bytes: int, stages: int) -> int:
        """Shared memory the ring occupies (the stages, then one barrier per stage)."""
        return stages * stage_bytes + stages * BARRIER_BYTES

    def stage_address(self, dst: Reg, stage: Reg) -> None:
        """One instruction: dst = base + stage * stage_bytes."""
        self.k.mad(dst, stage, self.stage_bytes, self.base, mode="lo")

    def barrier_address(self, dst: Reg, stage: Reg) -> None:
        """Two instructions: dst = the stage's mbarrier."""
        self.k.mad(dst, stage, BARRIER_BYTES, self.base, mode="lo")
        self.k.add(dst, dst, self.barriers_offset)

    def init(self, thread0: Reg) -> None:
        """Thread 0 initialises every barrier; the fences make the barriers visible to the
        copy engine; a CTA barrier makes them visible to every thread. (stages + 4 instructions)"""
        k = self.k
        with k.guard(thread0):
            for s in range(self.stages):
                k.mbarrier_init(addr(self.base, self.barriers_offset + s * BARRIER_BYTES), 1)
            k.fence_mbarrier_init()
        k.fence_proxy_async()
        k.bar_sync(0)

    def wait(self, bar: Reg, phase: Reg) -> None:
        """Spin until the phase ``phase`` of barrier ``bar`` completed (3 instructions)."""
        k = self.k
        done, again = k.pred("stage_ready"), k.label("wait_stage")
        k.place(again)
        k.mbarrier_try_wait_parity(done, addr(bar), phase)
        with k.guard(~done):
            k.bra(again, uniform=True)

    def advance(self, stage: Reg, phase: Reg) -> None:
        """stage += 1, wrapping to 0 and flipping ``phase`` (4 instructions)."""
        k = self.k
        wrapped = k.pred("ring_wrapped")
        k.add(stage, stage, 1)
        k.setp("eq", wrapped, stage, self.stages)
        k.selp(stage, 0, stage, wrapped)
        with k.guard(wrapped):
            k.xor(phase, phase, 1)
