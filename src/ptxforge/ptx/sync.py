"""Barriers, fences, mbarriers, cluster synchronisation and warpgroup register control.

mbarrier addresses are 32-bit shared-memory addresses (``[bar]`` with a ``u32``
register or a shared symbol); the ``.shared::cta`` forms are used unless a cluster
address is asked for.
"""

from __future__ import annotations

from .operands import Address, Operand, Reg


class SyncOps:
    # ---------------------------------------------------------------- CTA barriers
    def bar_sync(self, barrier: Operand = 0, threads: Operand | None = None) -> None:
        """``bar.sync id{, threads}``: named barrier over ``threads`` (all CTA threads if None)."""
        if threads is None:
            self.emit("bar.sync", barrier)
        else:
            self.emit("bar.sync", barrier, threads)

    def bar_arrive(self, barrier: Operand, threads: Operand) -> None:
        self.emit("bar.arrive", barrier, threads)

    # ---------------------------------------------------------------- cluster barriers
    def barrier_cluster_arrive(self, *, sem: str | None = None) -> None:
        """``barrier.cluster.arrive{.release|.relaxed}.aligned``."""
        self.emit("barrier.cluster.arrive" + (f".{sem}" if sem else "") + ".aligned")

    def barrier_cluster_wait(self) -> None:
        self.emit("barrier.cluster.wait.aligned")

    def mapa(self, d: Reg, address: Operand, cta_rank: Operand) -> None:
        """Map a shared::cta address to the same offset in CTA ``cta_rank`` of the cluster."""
        self.emit("mapa.shared::cluster.u32", d, address, cta_rank)

    # ---------------------------------------------------------------- fences
    def fence_proxy_async(self, space: str = "shared::cta") -> None:
        """Order this thread's generic-proxy writes before later async-proxy reads (TMA, wgmma)."""
        self.emit(f"fence.proxy.async.{space}")

    def fence_mbarrier_init(self) -> None:
        """Make mbarrier.init visible to the cluster (and to TMA) before anyone arrives."""
        self.emit("fence.mbarrier_init.release.cluster")

    def fence(self, sem: str = "acq_rel", scope: str = "gpu") -> None:
        self.emit(f"fence.{sem}.{scope}")

    # ---------------------------------------------------------------- mbarrier
    def mbarrier_init(self, bar: Address, count: Operand) -> None:
        self.emit("mbarrier.init.shared::cta.b64", bar, count)

    def mbarrier_arrive(self, bar: Address, *, remote: bool = False) -> None:
        """Arrive once. ``remote``: ``bar`` is a shared::cluster address (see ``mapa``).
        Both release at CTA scope (the default): a ``.release.cluster`` arrive compiles to a
        GPU-wide MEMBAR before every arrival, which halved the FP8 GEMM's speed."""
        if remote:
            self.emit("mbarrier.arrive.shared::cluster.b64", "_", bar)
        else:
            self.emit("mbarrier.arrive.shared::cta.b64", "_", bar)

    def mbarrier_arrive_expect_tx(self, bar: Address, tx_bytes: Operand) -> None:
        """Arrive and add ``tx_bytes`` to the transactions this phase waits for."""
        self.emit("mbarrier.arrive.expect_tx.shared::cta.b64", "_", bar, tx_bytes)

    def mbarrier_expect_tx(self, bar: Address, tx_bytes: Operand) -> None:
        self.emit("mbarrier.expect_tx.relaxed.cta.shared::cta.b64", bar, tx_bytes)

    def mbarrier_try_wait_parity(self, done: Reg, bar: Address, parity: Operand) -> None:
        """``done`` = the phase with ``parity`` has completed (may time out: loop on it)."""
        self.emit("mbarrier.try_wait.parity.shared::cta.b64", done, bar, parity)

    # ---------------------------------------------------------------- warp and grid control
    def bar_warp_sync(self, membermask: Operand = 0xFFFFFFFF) -> None:
        """``bar.warp.sync mask``: the lanes wait for each other, and what each accessed in
        memory before it is ordered before what any accesses after it."""
        self.emit("bar.warp.sync", membermask)

    def elect_sync(self, leader: Reg, membermask: Operand = 0xFFFFFFFF) -> None:
        """``elect.sync _|p, mask``: ``leader`` is true in exactly one active lane."""
        self.emit("elect.sync", f"_|{leader}", membermask)

    def setmaxnreg(self, count: int, *, increase: bool) -> None:
        """Raise or lower this warpgroup's register budget (sm_90a; needs a register cap at entry)."""
        if count % 8 or not 24 <= count <= 256:
            raise ValueError(f"setmaxnreg count must be a multiple of 8 in [24, 256], got {count}")
        self.emit(f"setmaxnreg.{'inc' if increase else 'dec'}.sync.aligned.u32", count)

    def griddepcontrol_wait(self) -> None:
        """Wait until the grids this one depends on (programmatic dependent launch) finished."""
        self.emit("griddepcontrol.wait")

    def griddepcontrol_launch_dependents(self) -> None:
        self.emit("griddepcontrol.launch_dependents")
