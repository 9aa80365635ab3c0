"""The host's half of a dispatch's layout: what each rank tells the others before the
first dispatch of a routing (one ``all_gather_object`` on the user's group), and what
each rank works out from what it hears. Plain Python on lists: no GPU.

A rank's message: the call's signature (sizes every rank must share), how many of its
tokens go to each rank on each channel, its (token, expert) pairs per expert, and how
many of its top-k indices are out of range. Every rank checks every message, so a
disagreement or a bad index raises the same error on every rank instead of leaving some
waiting in a kernel.

The received rows (``ReceiveLayout``): grouped by source rank in rank order; a source's
rows by channel, a channel's in token order, so source s's rows are its tokens for this
rank in token order. ``offsets[s][c]`` is the first row of what s sends on channel c.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Message(NamedTuple):
    signature: tuple        # (name, value) pairs every rank must share
    channel_counts: list    # [channels][ranks]: tokens for each rank on each channel
    expert_counts: list     # [experts]: (token, expert) pairs naming each expert
    bad_indices: int        # top-k indices outside [-1, experts)


@dataclass(frozen=True)
class ReceiveLayout:
    counts: list            # [ranks][channels]: tokens source s sends this rank on channel c
    offsets: list           # [ranks][channels]: the first row of those
    num_recv_tokens: int
    num_recv_tokens_per_expert: list  # this rank's experts, each padded to the alignment

    def table(self) -> list:
        """counts then offsets, flat: the kernels' recv_layout [2, ranks, channels]."""
        return [n for row in self.counts for n in row] + [n for row in self.offsets for n in row]


def check_agreement(messages: list) -> None:
    """Every rank must have called with the same signature and valid top-k indices."""
    first = messages[0].signature
    for rank, message in enumerate(messages):
        if message.signature != first:
            differ = [f"{name}: rank 0 has {value!r}, rank {rank} has {theirs!r}"
                      for (name, value), (_, theirs) in zip(first, message.signature)
                      if value != theirs]
            raise ValueError(f"ptxforge.ep: the ranks disagree on the dispatch: "
                             f"{'; '.join(differ)}")
    bad = {rank: m.bad_indices for rank, m in enumerate(messages) if m.bad_indices}
    if bad:
        experts = dict(first)["num_experts"]
        listed = ", ".join(f"rank {rank}: {n}" for rank, n in bad.items())
        raise ValueError(f"topk_idx must hold expert indices in [-1, {experts}); out of range "
                         f"({listed})")


def receive_layout(messages: list, rank: int, experts_per_rank: int,
                   expert_alignment: int = 1) -> ReceiveLayout:
    """What ``rank`` receives, from every rank's message (checked by ``check_agreement``)."""
    ranks = len(messages)
    counts = [[channel[rank] for channel in m.channel_counts] for m in messages]
    offsets, row = [], 0
    for source in range(ranks):
        offsets.append([])
        for n in counts[source]:
            offsets[source].append(row)
            row += n
    first = rank * experts_per_rank
    per_expert = [sum(m.expert_counts[first + e] for m in messages)
                  for e in range(experts_per_rank)]
    padded = [-(-n // expert_alignment) * expert_alignment for n in per_expert]
    return ReceiveLayout(counts, offsets, row, padded)
