"""Where everything lies in each rank's communication buffer: one plan for the host (the
size check, the zeroed counters) and the kernel generators (the offsets they emit).

Each rank allocates one buffer; every rank maps every other rank's (CUDA IPC), so a
kernel reaches rank r's buffer at ``peers[r]``. A buffer holds, for every channel c and
every peer rank p, the receiving end of the rings p sends on, and their counters:

    | counters: 4 arrays [MAX_CHANNELS][MAX_RANKS] u32 (8 KiB)                          |
    |   dispatch_head, dispatch_tail, combine_head, combine_tail                       |
    | the count exchange (exchange.py): flags [MAX_RANKS] u32, then message slots      |
    |   [2 parities][MAX_RANKS] of MESSAGE_WORDS int32 (289 KiB)                        |
    | the direct dispatch's flags (direct.py): [MAX_RANKS][2 * MAX_CHANNELS] u32         |
    | the pull combine's flags (pull.py): [MAX_RANKS][2 * MAX_CHANNELS] u32              |
    | combine rings:  [channels][ranks] rings of `slots` bf16 rows (hidden * 2 bytes)  |
    |                 and up to MAX_TOPK f32 top-k weights                             |
    | dispatch rings: [channels][ranks] rings of `slots` DispatchSlot entries           |
    | a direct dispatch's outputs and its combine's inputs (DirectRegion), where one runs|

Ring (c, p) in rank r's buffer carries what rank p sends rank r on channel c; its tail
(slots written) is stored by p with st.release.sys, its head (slots read) by r. Both
counters count from the buffer's creation: they never reset, so no kernel has to wait
for the others to clear them (a kernel starts from the values its predecessor left; see
``dispatch.py``). Slot i of a ring holds the entry numbered i modulo ``slots`` (a power
of two, so the u32 counters wrap cleanly).

The counters' and the exchange's place depends on nothing, so it survives a change of
hidden size, channels or ring slots between calls; the rings' layout is the call's. Every entry carries a
signature of the sizes its sender laid the rings out for (``signature``) and its number
(the counter value it was written under); a receiver whose own sizes differ (ranks that
disagree, in a call that reuses a handle and so exchanges nothing) finds another
signature, or an entry left there by an earlier call, and stops with an error instead of
reading it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

MAX_RANKS = 8          # one NVLink domain of 8 GPUs
MAX_CHANNELS = 64      # channels = SMs / 2, and an H200 has 132 SMs
BATCH = 32             # tokens a warp looks at once (one a lane); at most that many a publish
MIN_SLOTS = 2 * BATCH  # the combine's sender publishes batches of 32 rows, its receiver frees
                       # them 32 tokens at a time: two batches keep both moving
ALIGN = 16             # every part of a slot starts 16-byte aligned (vector copies)
RING_ALIGN = 1024
COUNTERS = ("dispatch_head", "dispatch_tail", "combine_head", "combine_tail")
COUNTER_BYTES = 4 * MAX_CHANNELS * MAX_RANKS
SCALE_GROUP = 128      # FP8 rows carry one f32 scale per 128 elements
MAX_TOPK = 32          # top-k entries a token carries (one lane each)
MAX_EXPERTS = 4096     # the layout kernel's histograms stay under 17 KiB of shared memory
HEADER_WORDS = 8       # a count message's sizes and bad indices (ep/layout.py)
MESSAGE_WORDS = HEADER_WORDS + MAX_CHANNELS * MAX_RANKS + MAX_EXPERTS
EXCHANGE_FLAGS = len(COUNTERS) * COUNTER_BYTES
EXCHANGE_SLOTS = EXCHANGE_FLAGS + 4 * MAX_RANKS
EXCHANGE_END = EXCHANGE_SLOTS + 2 * MAX_RANKS * 4 * MESSAGE_WORDS
# The direct dispatch's flags (direct.py): [MAX_RANKS sources][2 * MAX_CHANNELS CTAs] u32.
DIRECT_DONE = EXCHANGE_END
# The pull combine's flags (pull.py), laid out alike: rank s's CTA c has started (so s's
# rows to combine are complete).
PULL_READY = DIRECT_DONE + 4 * MAX_RANKS * 2 * MAX_CHANNELS
PULL_READY_END = PULL_READY + 4 * MAX_RANKS * 2 * MAX_CHANNELS


def _aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class DispatchSlot:
    """One dispatched token in a ring: its row (bf16, or e4m3 and its f32 scales), its
    top-k expert indices (int64) and weights (f32), and its index on the source rank."""

    hidden: int
    topk: int
    fp8: bool

    @property
    def row_bytes(self) -> int:
        return self.hidden * (1 if self.fp8 else 2)

    @property
    def scale_groups(self) -> int:
        return self.hidden // SCALE_GROUP if self.fp8 else 0

    @property
    def scales(self) -> int:
        return _aligned(self.row_bytes)

    @property
    def topk_idx(self) -> int:
        return self.scales + _aligned(4 * self.scale_groups)

    @property
    def topk_weights(self) -> int:
        return self.topk_idx + _aligned(8 * self.topk)

    @property
    def source(self) -> int:
        return self.topk_weights + _aligned(4 * self.topk)

    @property
    def signature(self) -> int:
        return self.source + 4

    @property
    def number(self) -> int:
        return self.source + 8

    @property
    def bytes(self) -> int:
        return self.source + ALIGN


@dataclass(frozen=True)
class BufferPlan:
    ranks: int
    channels: int
    slots: int
    hidden: int

    def counter(self, name: str, channel: int = 0, peer: int = 0) -> int:
        """Byte offset of counter ``name`` of ring (channel, peer)."""
        return COUNTERS.index(name) * COUNTER_BYTES + 4 * (channel * MAX_RANKS + peer)

    @property
    def combine_weights(self) -> int:
        """A combine entry: the bf16 row, room for MAX_TOPK f32 weights (so that the rings'
        place does not depend on k), the signature and the entry's number."""
        return _aligned(2 * self.hidden)

    @property
    def combine_signature(self) -> int:
        return self.combine_weights + 4 * MAX_TOPK

    @property
    def combine_number(self) -> int:
        return self.combine_signature + 4

    @property
    def combine_slot_bytes(self) -> int:
        return self.combine_signature + ALIGN

    @property
    def combine_rings(self) -> int:
        return _aligned(PULL_READY_END, RING_ALIGN)

    @property
    def combine_ring_bytes(self) -> int:
        return self.slots * self.combine_slot_bytes

    @property
    def dispatch_rings(self) -> int:
        return _aligned(self.combine_rings + self.channels * self.ranks * self.combine_ring_bytes,
                        RING_ALIGN)

    def dispatch_ring_bytes(self, slot: DispatchSlot) -> int:
        return self.slots * slot.bytes

    def bytes_needed(self, slot: DispatchSlot) -> int:
        """The buffer size a dispatch with ``slot``'s entries and its combine need."""
        return self.dispatch_rings + self.channels * self.ranks * self.dispatch_ring_bytes(slot)


def signature(*sizes) -> int:
    """A non-zero 32-bit word naming ``sizes`` (the kernel, its row layout and rings)."""
    return (zlib.crc32(repr(sizes).encode()) & 0x7FFFFFFF) | 1


def check_plan(ranks: int, channels: int, slots: int) -> None:
    """The sizes a plan takes (the hidden size is each kernel's to check)."""
    if not 2 <= ranks <= MAX_RANKS:
        raise ValueError(f"the group must have 2 to {MAX_RANKS} ranks, got {ranks}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"num_sms must give 1 to {MAX_CHANNELS} channels (2 SMs each), "
                         f"got {channels} channels")
    if slots < MIN_SLOTS or slots & (slots - 1):
        raise ValueError(f"ring slots must be a power of two of at least {MIN_SLOTS}, got {slots}")


def channel_bounds(tokens: int, channels: int) -> list[tuple[int, int]]:
    """The tokens [begin, end) of a rank's each channel: ceil(tokens / channels) each, the
    last ones shorter or empty. ``common.channel_tokens`` emits the same in the kernels."""
    per = -(-tokens // channels)
    return [(min(c * per, tokens), min(c * per + per, tokens)) for c in range(channels)]


@dataclass(frozen=True)
class DirectRegion:
    """A direct dispatch's outputs in the receiver's buffer, ``rows`` of them (the worst
    case), each array 16-aligned, from byte ``start``: e4m3 rows [rows, H], f32 scales
    [rows, H / 128], int64 top-k [rows, k], f32 weights [rows, k], int32 source tokens
    [rows]; then the combine's inputs, bf16 [rows, H] (the experts' output a row, which the
    source ranks' pull combine reads; RING_ALIGN-aligned)."""

    start: int
    rows: int
    hidden: int
    topk: int

    @property
    def x(self) -> int:
        return self.start

    @property
    def scales(self) -> int:
        return _aligned(self.x + self.rows * self.hidden)

    @property
    def topk_idx(self) -> int:
        return _aligned(self.scales + 4 * self.rows * (self.hidden // SCALE_GROUP))

    @property
    def topk_weights(self) -> int:
        return _aligned(self.topk_idx + 8 * self.rows * self.topk)

    @property
    def source(self) -> int:
        return _aligned(self.topk_weights + 4 * self.rows * self.topk)

    @property
    def combine_x(self) -> int:
        return _aligned(self.source + 4 * self.rows, RING_ALIGN)

    @property
    def end(self) -> int:
        return _aligned(self.combine_x + 2 * self.rows * self.hidden)
