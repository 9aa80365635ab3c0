"""A ring of shared-memory stages that the copy engine fills, each guarded by mbarriers.

Every stage has a *full* barrier: the producer arms it with the bytes its copies will
deliver (one arrival, ``arrive.expect_tx``) and the copies complete it. A ring whose
stages are refilled also has an *empty* barrier per stage, on which each consumer warp
arrives when it is done with the stage; the producer waits for it before refilling.

    ring = StageRing(k, base, stages, full_offset=..., empty_offset=..., consumers=8,
                     tx_bytes=...)
    ring.init(thread0)                      # barriers, fences, a CTA (or cluster) barrier
    # producer, per stage:                  # consumers, per stage:
    bar = ring.acquire(stage, phase)        ring.wait_full(stage, phase)
    (copies completing on ``bar``)          (read the stage)
    next_stage(k, stage, phase, stages)     ring.release(stage, arrive_lanes)

The ring does not own the stages' data: where they lie is the kernel's shared-memory
plan. ``StageRing.packed`` is the simple plan of one-shot copies: the stages back to
back from the base, then one full barrier each.
"""

from __future__ import annotations

from ..ptx import Address, KernelBuilder, Reg, addr

BARRIER_BYTES = 8


class StageRing:
    def __init__(self, k: KernelBuilder, base: Reg, count: int, *, full_offset: int,
                 empty_offset: int | None = None, consumers: int = 0,
                 tx_bytes: int | None = None, stage_bytes: int = 0, fillers: int = 1):
        """``base``: a u32 shared-memory address; the full (and empty) barriers are 8 bytes
        apart from ``full_offset`` (``empty_offset``) past it. ``consumers``: the arrivals
        that free a stage. ``tx_bytes``: what one stage's copies deliver, derived from
        the copies' boxes, for ``acquire``. ``stage_bytes``: a packed ring's stage size.
        ``fillers``: arrivals that complete a full barrier besides its bytes: the
        producer's expect-tx, and one per other kind of copy that arrives when it lands
        (``cp.async.mbarrier.arrive.noinc``)."""
        if (empty_offset is None) != (consumers == 0):
            raise ValueError("a ring with empty barriers needs consumers to arrive on them")
        self.k, self.base, self.count = k, base, count
        self.full_offset, self.empty_offset = full_offset, empty_offset
        self.consumers, self.tx_bytes, self.stage_bytes = consumers, tx_bytes, stage_bytes
        self.fillers = fillers
        self._at = None

    @classmethod
    def packed(cls, k: KernelBuilder, base: Reg, stage_bytes: int, count: int) -> "StageRing":
        """Stages of ``stage_bytes`` back to back from ``base``, then their full barriers."""
        return cls(k, base, count, full_offset=count * stage_bytes, stage_bytes=stage_bytes)

    @staticmethod
    def shared_bytes(stage_bytes: int, count: int) -> int:
        """Shared memory a packed ring occupies: the stages and their barriers."""
        return count * stage_bytes + count * BARRIER_BYTES

    def stage_offset(self, stage: int) -> int:
        """A packed ring's stage ``stage``, from the base."""
        return stage * self.stage_bytes

    def barrier_offset(self, stage: int) -> int:
        """The full barrier of stage ``stage``, from the base."""
        return self.full_offset + stage * BARRIER_BYTES

    def init(self, thread0: Reg, *, cluster: bool = False) -> None:
        """Thread 0 initialises every barrier; the fences make them visible to the copy
        engine, a barrier of the CTA (``cluster``: of the cluster, whose CTAs arrive on
        each other's barriers) to every thread."""
        k = self.k
        with k.guard(thread0):
            for s in range(self.count):
                k.mbarrier_init(addr(self.base, self.barrier_offset(s)), self.fillers)
                if self.empty_offset is not None:
                    k.mbarrier_init(addr(self.base, self.empty_offset + s * BARRIER_BYTES),
                                    self.consumers)
            k.fence_mbarrier_init()
        k.fence_proxy_async()
        if cluster:
            k.barrier_cluster_arrive(sem="release")
            k.barrier_cluster_wait()
        else:
            k.bar_sync(0)

    def wait(self, bar: Address, phase) -> None:
        """Every thread of the CTA waits on the full barrier at ``bar``: the spin branch is
        uniform."""
        wait_parity(self.k, bar, phase, "wait_stage", uniform=True)

    def _barrier_at(self) -> Reg:
        if self._at is None:
            self._at = self.k.reg("u32", "ring_bar")
        return self._at

    def acquire(self, stage: Reg, phase: Reg) -> Reg:
        """Producer: wait until stage ``stage`` is empty (a fresh barrier passes the wait
        on parity 1, so the first round does not wait), then arm its full barrier with
        ``tx_bytes``. Returns the register holding the full barrier's address, on which
        the stage's copies complete (7 instructions and a spin loop)."""
        k = self.k
        empty, full, parity = (k.reg(t, n) for t, n in (("u32", "bar_empty"), ("u32", "bar_full"),
                                                        ("u32", "empty_parity")))
        k.mad(empty, stage, BARRIER_BYTES, self.base, mode="lo")
        k.add(empty, empty, self.empty_offset)
        k.xor(parity, phase, 1)
        wait_parity(k, addr(empty), parity, "wait_empty")
        k.mad(full, stage, BARRIER_BYTES, self.base, mode="lo")
        k.add(full, full, self.full_offset)
        k.mbarrier_arrive_expect_tx(addr(full), self.tx_bytes)
        return full

    def wait_full(self, stage: Reg, phase: Reg) -> None:
        """Consumer: wait until stage ``stage``'s copies have landed (1 instruction and a
        spin loop)."""
        at = self._barrier_at()
        self.k.mad(at, stage, BARRIER_BYTES, self.base, mode="lo")
        wait_parity(self.k, addr(at, self.full_offset), phase, "wait_full")

    def release(self, stage: Reg, lanes: Reg, barriers: Reg | None = None,
                remote: bool = False) -> None:
        """Consumer: the warp is done with stage ``stage``; the lanes where ``lanes`` holds
        arrive on its empty barrier at ``barriers`` (by default this CTA's base; with
        ``remote``, each lane's own CTA of the cluster, mapped there by the caller). Every
        lane of the warp calls it: a warp barrier first orders all lanes' reads of the
        stage before the arrival, which otherwise covers only the arriving lanes' own (the
        memory model's rule; compute-sanitizer's racecheck does not count it, so a stage
        written by cp.async, which racecheck tracks, is read by the arriving lane only:
        the GEMM's B scales)."""
        k, at = self.k, self._barrier_at()
        k.bar_warp_sync()
        k.mad(at, stage, BARRIER_BYTES, self.base if barriers is None else barriers, mode="lo")
        with k.guard(lanes):
            k.mbarrier_arrive(addr(at, self.empty_offset), remote=remote)


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
