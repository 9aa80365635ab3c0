"""The host's half of a dispatch's layout: what each rank tells the others before the
first dispatch of a routing (the count exchange: ``kernels/ep_intranode/exchange.py``
moves the messages between the GPUs, the host reads them all with one copy), and what
each rank works out from what it hears. Plain Python on lists: no GPU.

A rank's message: the call's signature (sizes every rank must share), how many of its
tokens go to each rank on each channel, its (token, expert) pairs per expert, and how
many of its top-k indices are out of range. As int32 words:

    [hidden, fp8, topk, num_experts, num_sms, ring_slots, expert_alignment, bad indices,
     channel counts [channels][ranks], expert counts [experts]]

Every rank checks every message, so a disagreement or a bad index raises the same error
on every rank instead of leaving some waiting in a kernel.

The received rows (``ReceiveLayout``): grouped by source rank in rank order; a source's
rows by channel, a channel's in token order, so source s's rows are its tokens for this
rank in token order. ``offsets[s][c]`` is the first row of what s sends on channel c.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..kernels.ep_intranode.plan import HEADER_WORDS

# The sizes a message's first words hold, in order; the bad indices follow them.
SIGNATURE = ("hidden", "fp8", "topk", "num_experts", "num_sms", "ring_slots",
             "expert_alignment")
assert len(SIGNATURE) + 1 == HEADER_WORDS


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


def signature_words(signature: tuple) -> list[int]:
    """A signature's (name, value) pairs, in SIGNATURE's order, as a message's first words."""
    if tuple(name for name, _ in signature) != SIGNATURE:
        raise ValueError(f"a dispatch signature names {SIGNATURE}, got {signature}")
    return [int(value) for _, value in signature]


def message_of(words: list, channels: int, ranks: int) -> Message:
    """A rank's message from its words, its counts read for ``channels`` and ``ranks``
    (the reader's: a message whose signature differs is refused by ``check_agreement``
    before its counts are used) and its header's experts."""
    signature = tuple((name, bool(value) if name == "fp8" else value)
                      for name, value in zip(SIGNATURE, words))
    at = HEADER_WORDS + channels * ranks
    per_channel = [words[HEADER_WORDS + c * ranks:HEADER_WORDS + (c + 1) * ranks]
                   for c in range(channels)]
    experts = dict(signature)["num_experts"]
    return Message(signature, per_channel, words[at:at + experts], words[HEADER_WORDS - 1])


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
