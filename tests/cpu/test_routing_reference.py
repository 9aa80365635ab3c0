"""The MoE routing layout's torch reference (``ptxforge.testing.reference``), which the GPU
tests hold the kernel to, against layouts worked out by hand, and the layout's invariants
on random routing."""

from __future__ import annotations

import pytest
import torch

import ptxforge
from ptxforge.testing import reference

# Four tokens, two experts each, three experts; token 2 names 5 and -1 (no expert), token 3
# names expert 2 twice.
TOPK = torch.tensor([[0, 2], [2, 1], [5, -1], [2, 2]])


def test_contiguous_layout_by_hand():
    """Segments of 4 rows (alignment 4 here): expert 0 takes rows 0-3 (one pair, 3 rows of
    padding), expert 1 rows 4-7, expert 2's four pairs rows 8-11 in flat order."""
    rows, counts, m_indices, rows_used = reference.moe_routing_layout(TOPK, 3, alignment=4)
    assert rows.tolist() == [[0, 8], [9, 4], [-1, -1], [10, 11]]
    assert counts.tolist() == [1, 1, 4]
    assert m_indices.tolist() == [0, -1, -1, -1, 1, -1, -1, -1, 2, 2, 2, 2] + [-1] * 5
    assert len(m_indices) == 8 + 3 * 3 and rows_used.tolist() == [12]
    assert {t.dtype for t in (rows, counts, m_indices, rows_used)} == {torch.int32}


def test_masked_layout_by_hand():
    """Two rows an expert: expert 2's third and fourth pairs (token 3's) are dropped, and
    its count is the rows it got."""
    rows, counts, m_indices, rows_used = reference.moe_routing_layout(TOPK, 3, "masked", 2)
    assert rows.tolist() == [[0, 4], [5, 2], [-1, -1], [-1, -1]]
    assert counts.tolist() == [1, 1, 2]
    assert m_indices is None and rows_used is None
    rows, counts, _, _ = reference.moe_routing_layout(TOPK, 3, "masked")  # T = 4 rows each
    assert rows.tolist() == [[0, 8], [9, 4], [-1, -1], [10, 11]] and counts.tolist() == [1, 1, 4]


def test_no_tokens():
    rows, counts, m_indices, rows_used = reference.moe_routing_layout(
        torch.empty(0, 8, dtype=torch.int64), 4)
    assert rows.shape == (0, 8) and counts.tolist() == [0] * 4
    assert m_indices.tolist() == [-1] * (4 * 127) and rows_used.tolist() == [0]


@pytest.mark.parametrize("tokens, k, experts", [(1, 1, 8), (7, 2, 8), (64, 8, 256), (300, 8, 8)])
def test_contiguous_layout_invariants(tokens, k, experts):
    """Every kept pair has its own row, inside its expert's segment, in flat order; each
    segment starts at a multiple of 128 and holds its expert's pairs, then -1s; m_indices
    is as long as ``max_contiguous_rows`` says."""
    scores = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    topk = scores.topk(k).indices
    rows, counts, m_indices, rows_used = reference.moe_routing_layout(topk, experts)
    assert len(m_indices) == ptxforge.max_contiguous_rows(tokens, k, experts)
    flat, placed = topk.flatten(), rows.flatten().long()
    assert (placed >= 0).all() and len(set(placed.tolist())) == placed.numel()
    assert torch.equal(m_indices[placed], flat.int())
    assert torch.equal(counts, torch.bincount(flat, minlength=experts).int())
    for e in range(experts):
        mine = placed[flat == e]
        assert torch.equal(mine, torch.sort(mine).values)        # flat order
        if len(mine):
            start = int(mine[0])
            assert start % 128 == 0 and torch.equal(mine, torch.arange(start, start + len(mine)))
    assert int(rows_used) == sum(-(-int(c) // 128) * 128 for c in counts)
    assert (m_indices[int(rows_used):] == -1).all()
    assert int((m_indices >= 0).sum()) == tokens * k


def test_max_contiguous_rows():
    assert ptxforge.max_contiguous_rows(4096, 8, 256) == 4096 * 8 + 256 * 127
    assert ptxforge.max_contiguous_rows(0, 8, 1) == 127
