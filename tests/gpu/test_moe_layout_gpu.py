"""The MoE routing layout on a real GPU: equal to the torch reference (both layouts, every
output, every entry written), repeatable bit for bit, replayed from a CUDA graph with the
routing changed between replays, and feeding the grouped GEMMs."""

import pytest
import torch

import ptxforge
from ptxforge.ops.routing import routing_outputs
from ptxforge.testing import reference

pytestmark = pytest.mark.gpu

LAYOUTS = ("contiguous", "masked")
GARBAGE = 0x2A2A2A2A  # what the outputs' memory holds before the kernel writes it


def topk_routing(tokens: int, k: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Router-like indices: k distinct experts per token, as torch.topk gives them."""
    scores = torch.rand(tokens, experts, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(seed))
    return scores.topk(k, dim=1).indices


def poisoned_call(topk_idx, experts, layout="contiguous", rows_per_expert=None, **options):
    """The op, its outputs landing in memory just filled with garbage: blocks of their
    sizes are allocated, filled and freed first, and the caching allocator hands them back
    (checked), so an entry the kernel does not write shows."""
    tokens, k = topk_idx.shape
    bait = [t for t in routing_outputs(tokens, k, experts, layout, "cuda") if t is not None]
    for t in bait:
        t.fill_(GARBAGE)
    pointers = [t.data_ptr() for t in bait]
    del bait, t
    out = ptxforge.moe_routing_layout(topk_idx, experts, layout=layout,
                                      rows_per_expert=rows_per_expert, **options)
    assert [t.data_ptr() for t in out if t is not None] == pointers, "not poisoned"
    return out


def assert_layout(got, topk_idx, experts, layout="contiguous", rows_per_expert=None):
    want = reference.moe_routing_layout(topk_idx, experts, layout, rows_per_expert)
    for name, g, w in zip(("rows", "counts", "m_indices", "rows_used"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == torch.int32 and g.shape == w.shape, name
        mismatched = (g != w).nonzero().flatten()[:8].tolist()
        assert not mismatched, f"{name} differs at {mismatched}"


def check(topk_idx, experts, layout="contiguous", rows_per_expert=None):
    got = poisoned_call(topk_idx, experts, layout, rows_per_expert)
    torch.cuda.synchronize()
    assert_layout(got, topk_idx, experts, layout, rows_per_expert)
    return got


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("experts", [8, 256])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64, 4096])
def test_random_routing_matches_the_reference(tokens, k, experts, layout):
    check(topk_routing(tokens, k, experts, seed=tokens * k + experts), experts, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("experts, k", [(384, 8), (512, 8), (1024, 4), (1, 1)])
def test_other_expert_counts(experts, k, layout):
    """Kimi-K2's 384 and 512 routed experts, the most the kernel takes (one thread each),
    a single expert."""
    check(topk_routing(1000, k, experts), experts, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_largest_routing(layout):
    """T * k = 131072 pairs: DeepSeek-V3's routing of 16384 tokens."""
    check(topk_routing(16384, 8, 256), 256, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("experts", [8, 256])
def test_every_token_to_one_expert(experts, layout):
    for expert in (0, experts - 1):
        rows, counts, m_indices, _ = check(torch.full((4096, 1), expert, device="cuda"),
                                           experts, layout)
        assert int(counts[expert]) == 4096 and int(counts.sum()) == 4096
    tokens = torch.arange(4096, device="cuda")
    if layout == "contiguous":    # the last expert's segment starts at row 0: nothing before
        assert torch.equal(rows.flatten(), tokens.int())
        assert (m_indices[:4096] == experts - 1).all() and (m_indices[4096:] == -1).all()
    else:
        assert torch.equal(rows.flatten(), (tokens + (experts - 1) * 4096).int())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_without_tokens(layout):
    """Only experts 3, 4 and 200 of 256 are named (and in the contiguous layout the others
    take no rows), then only the odd experts of 8."""
    torch.manual_seed(0)
    choice = torch.tensor([3, 4, 200], device="cuda")
    topk = choice[torch.randint(0, 3, (500, 2), device="cuda")]
    _, counts, _, rows_used = check(topk, 256, layout)
    assert int((counts > 0).sum()) == 3
    if layout == "contiguous":
        assert int(rows_used) == sum(-(-int(counts[e]) // 128) * 128 for e in choice.tolist())
    check(topk_routing(300, 2, 4) * 2 + 1, 8, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_range_experts_are_dropped(layout):
    topk = topk_routing(300, 4, 8)
    topk[::3, 0] = -1
    topk[1::5, 2] = 8
    topk[7, 1], topk[8, 3] = 1 << 40, -(1 << 40)     # the low 32 bits name no expert either
    rows, counts, *_ = check(topk, 8, layout)
    dropped = (topk < 0) | (topk >= 8)
    assert (rows[dropped] == -1).all() and (rows[~dropped] >= 0).all()
    assert int(counts.sum()) == int((~dropped).sum())


def test_masked_layout_drops_what_overflows_rows_per_expert():
    """A token naming one expert twice (not what topk gives) can push an expert past T
    rows; here past a rows_per_expert of 2, and one under T."""
    topk = torch.tensor([[3, 3], [3, 1], [3, 3], [0, 3]], device="cuda")
    rows, counts, _, _ = check(topk, 8, "masked", rows_per_expert=2)
    assert rows.tolist() == [[6, 7], [-1, 2], [-1, -1], [0, -1]]
    assert counts.tolist() == [1, 1, 0, 2, 0, 0, 0, 0]
    check(topk_routing(4096, 8, 8), 8, "masked", rows_per_expert=3000)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_tokens(layout):
    rows, counts, m_indices, rows_used = check(torch.empty(0, 8, dtype=torch.int64,
                                                           device="cuda"), 256, layout)
    assert rows.shape == (0, 8) and (counts == 0).all()
    if layout == "contiguous":
        assert (m_indices == -1).all() and int(rows_used) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bitwise_repeatable_and_the_same_with_pdl(layout):
    topk = topk_routing(4096, 8, 256)
    runs = [ptxforge.moe_routing_layout(topk, 256, layout=layout, pdl=pdl)
            for pdl in (False, True, False, None, True)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_graph_replays_new_routing(layout):
    """Captured once; each replay lays out what topk_idx holds then, into outputs filled
    with garbage before it."""
    topk = topk_routing(512, 8, 256)
    ptxforge.moe_routing_layout(topk, 256, layout=layout)       # built before the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = ptxforge.moe_routing_layout(topk, 256, layout=layout)
    skewed = torch.zeros(512, 8, dtype=torch.int64, device="cuda")
    skewed[:, 1:] = torch.arange(1, 8, device="cuda")
    dropped = topk_routing(512, 8, 256, seed=3)
    dropped[::2, 0] = -1
    for routing in (topk_routing(512, 8, 256, seed=1), skewed, dropped,
                    torch.full((512, 8), 255, device="cuda"), topk_routing(512, 8, 256)):
        topk.copy_(routing)
        for t in out:
            if t is not None:
                t.fill_(GARBAGE)
        graph.replay()
        torch.cuda.synchronize()
        assert_layout(out, routing, 256, layout)


def test_the_layouts_feed_the_grouped_gemms():
    """Tokens gathered into the rows the layout gives, through the grouped BF16 GEMMs
    (contiguous with m_indices, masked with counts as masked_m), come back as each token
    times its experts' weights."""
    torch.manual_seed(0)
    tokens, k, experts, hidden, n = 200, 2, 8, 256, 384
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    w = torch.randn(experts, n, hidden, device="cuda").to(torch.bfloat16)
    topk = topk_routing(tokens, k, experts)
    token_of_pair = torch.arange(tokens, device="cuda").repeat_interleave(k)
    want = torch.einsum("ph,pnh->pn", x[token_of_pair].double(), w[topk.flatten()].double())

    rows, counts, m_indices, _ = ptxforge.moe_routing_layout(topk, experts)
    a = torch.zeros(len(m_indices), hidden, device="cuda", dtype=torch.bfloat16)
    a[rows.flatten().long()] = x[token_of_pair]
    d = torch.empty(len(m_indices), n, device="cuda", dtype=torch.bfloat16)
    ptxforge.m_grouped_bf16_gemm_nt_contiguous(a, w, d, m_indices)
    got = d[rows.flatten().long()].double()
    assert ((got - want).abs() <= 0.02 * want.abs() + 0.5).all()

    rows, counts, _, _ = ptxforge.moe_routing_layout(topk, experts, layout="masked")
    a = torch.zeros(experts * tokens, hidden, device="cuda", dtype=torch.bfloat16)
    a[rows.flatten().long()] = x[token_of_pair]
    d = torch.empty(experts, tokens, n, device="cuda", dtype=torch.bfloat16)
    ptxforge.m_grouped_bf16_gemm_nt_masked(a.view(experts, tokens, hidden), w, d, counts,
                                           expected_m=tokens * k // experts)
    got = d.view(experts * tokens, n)[rows.flatten().long()].double()
    assert ((got - want).abs() <= 0.02 * want.abs() + 0.5).all()
