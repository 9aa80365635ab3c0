"""Where everything lies in each rank's low-latency buffer, for the host (its size) and the
kernel generators (the offsets they emit).

Each rank allocates one buffer, mapped by every other rank (CUDA IPC, ``peers[r]``). For
R ranks, E experts (L = E / R on each rank), T = max_tokens, k experts a token and C
send CTAs a destination rank (``send_ctas``):

    | sequence numbers (this rank's own):                                               |
    |   dispatch_sent     [R][C] u32  dispatches this rank's send CTA c sent to rank d  |
    |   dispatch_received [L][R] u32  dispatches local expert l received from rank s   |
    | dispatch_flags [R][C] u32: written by rank s's send CTA c, sequence << 9 | tokens |
    | combine_flags  [T][S] u32 (S = max(k, R)): pair (t, j)'s, written by the rank of  |
    |                its expert, or (summed) rank d's at [d][t]: the sequence number    |
    | combine_started [R] u32: written by rank d's combine send as it starts: the      |
    |                sequence number of its dispatch receive just ended                 |
    | dispatch_topk  [R][T][k] i32: rank s's token t's experts as this rank's local     |
    |                experts (-1: an expert elsewhere, or none)                         |
    | dispatch_weights [R][T][k] f32: their top-k weights (a dispatch given them)       |
    | dispatch_rows  [R][T][k] u32: the row of pair (s, t, j) among the local experts'  |
    |                received rows (pairs naming a local expert)                        |
    | dispatch slots [R][T]: token t of rank s, if it names an expert here: its e4m3    |
    |                row (H bytes) and its H / 128 f32 scales                           |
    | combine rows   [T][S]: a bf16 row (2 H bytes) a (token, k position) pair, or      |
    |                (summed) rank d's sum of its pairs of token t at [d][t]            |

Protocol. A token goes to a rank once, whatever number of its experts live there: slot
(s, t) holds token t of rank s, and every local expert's receiver reads it from there
(the rank's experts then take their rows in the layout the grouped GEMM reads). Rank s's
send CTA c writes its share of the tokens (their top-k rows to every rank, their rows to
the ranks they name), then publishes ``sequence << 9 | tokens`` into flag (s, c) of the
destination with st.release.sys; a receiver waits (ld.acquire.sys, timed) until each of
the R x C flags carries the sequence number it expects. The combine returns pair (t,
j)'s row into combine row (t, j) of rank s and publishes flag (t, j) = the dispatch's
sequence number.

Sequence numbers instead of clearing: the buffer starts zeroed and is never cleared.
Each end keeps the count of dispatches it sends or receives on in its own buffer
(``dispatch_sent`` a send CTA, ``dispatch_received`` a (local expert, source) pair; the
thread that publishes or waits reads, increments and stores it, so no atomics and no
grid-wide step): every dispatch publishes every flag once, so both ends count alike,
and a flag from an earlier call carries an older number. The combine reuses its
dispatch's numbers (the sender's ``dispatch_received``, the receiver's
``dispatch_sent`` of the expert's rank and CTA 0): one combine a dispatch. Numbers run
1 .. 2**23 - 1 and wrap to 1, so a zeroed flag never matches. A call's receive half must
end on every rank before any rank's next send of the same kind rewrites its slots. The
dispatch -> combine -> dispatch chain guarantees it: each rank's combine send starts by
writing the round's sequence number into combine_started (this rank) of every rank, after
its dispatch receive ended, and each rank's combine receive (its CTA 0) waits until every
rank's has come, whatever pairs its tokens have where; a rank's next dispatch send
follows its combine, so it rewrites no flag or slot a peer has yet to read, even where
none of its tokens went to that peer.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_RANKS = 8
MAX_TOKENS = 256          # a count fits COUNT_BITS
MAX_TOPK = 16
COUNT_BITS = 9
SEQUENCE_MAX = (1 << (32 - COUNT_BITS)) - 1
SCALE_GROUP = 128
ALIGN = 16
REGION_ALIGN = 1024
MAX_SEND_CTAS = 16        # a destination's send CTAs: R x C flags, one a receiver's thread
TOKENS_PER_SEND_CTA = 8   # at least: one a warp of the dispatch's 8, a row's copy in flight


def _aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def next_sequence(sequence: int) -> int:
    """The sequence number after ``sequence`` (1 .. SEQUENCE_MAX, then 1 again); the
    kernels emit the same."""
    return sequence % SEQUENCE_MAX + 1


def check_problem(ranks: int, max_tokens: int, hidden: int, experts: int, topk: int) -> None:
    """The sizes the low-latency kernels take; errors name the argument."""
    if not 2 <= ranks <= MAX_RANKS:
        raise ValueError(f"the group must have 2 to {MAX_RANKS} ranks, got {ranks}")
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be 1 to {MAX_TOKENS}, "
                         f"got {max_tokens}")
    if hidden <= 0 or hidden % SCALE_GROUP:
        raise ValueError(f"hidden must be a positive multiple of {SCALE_GROUP}, got {hidden}")
    if experts <= 0 or experts % ranks:
        raise ValueError(f"num_experts must be a positive multiple of the {ranks} ranks, "
                         f"got {experts}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_idx must have 1 to {MAX_TOPK} columns, got {topk}")


@dataclass(frozen=True)
class LowLatencyPlan:
    ranks: int
    max_tokens: int
    hidden: int
    experts: int
    topk: int

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks

    @property
    def scale_groups(self) -> int:
        return self.hidden // SCALE_GROUP

    @property
    def send_ctas(self) -> int:
        """C: the CTAs that send to each rank, each a ``send_chunk`` of the tokens."""
        return min(MAX_SEND_CTAS, -(-self.max_tokens // TOKENS_PER_SEND_CTA))

    @property
    def send_chunk(self) -> int:
        return -(-self.max_tokens // self.send_ctas)

    # ---- a dispatch slot
    @property
    def slot_scales(self) -> int:
        return _aligned(self.hidden)

    @property
    def slot_bytes(self) -> int:
        return self.slot_scales + _aligned(4 * self.scale_groups)

    # ---- the regions
    @property
    def dispatch_sent(self) -> int:
        return 0

    @property
    def dispatch_received(self) -> int:
        return _aligned(4 * self.ranks * self.send_ctas)

    @property
    def dispatch_flags(self) -> int:
        return _aligned(self.dispatch_received + 4 * self.local_experts * self.ranks)

    @property
    def combine_flags(self) -> int:
        return _aligned(self.dispatch_flags + 4 * self.ranks * self.send_ctas)

    @property
    def combine_slots(self) -> int:
        """A token's combine rows and flags: one a pair, or (summed) one a rank."""
        return max(self.topk, self.ranks)

    @property
    def combine_started(self) -> int:
        return _aligned(self.combine_flags + 4 * self.max_tokens * self.combine_slots)

    @property
    def dispatch_topk(self) -> int:
        return _aligned(self.combine_started + 4 * self.ranks)

    @property
    def _pair_words(self) -> int:
        return 4 * self.ranks * self.max_tokens * self.topk

    @property
    def dispatch_weights(self) -> int:
        return _aligned(self.dispatch_topk + self._pair_words)

    @property
    def dispatch_rows(self) -> int:
        return _aligned(self.dispatch_weights + self._pair_words)

    @property
    def dispatch_slots(self) -> int:
        return _aligned(self.dispatch_rows + self._pair_words, REGION_ALIGN)

    def dispatch_slot(self, source: int, token: int) -> int:
        """Byte offset of slot (source, token)."""
        return self.dispatch_slots + (source * self.max_tokens + token) * self.slot_bytes

    @property
    def combine_rows(self) -> int:
        return _aligned(self.dispatch_slot(self.ranks, 0), REGION_ALIGN)

    @property
    def bytes_needed(self) -> int:
        return self.combine_rows + self.max_tokens * self.combine_slots * 2 * self.hidden
