"""A MoE layer's experts (ops/moe.py) and the backend's MoE pass on a real GPU: the
grouped row kernels bit for bit against the dense ones on the same rows, the experts
against the bf16 experts computed in fp64, both layouts, routings with empty experts and
with one expert taking every token, graph replays with the routing changed, and
transformers' DeepSeek-V3 and Mixtral blocks compiled by the backend."""

import pytest
import torch

import ptxforge
from ptxforge import compiler, models
from ptxforge.ops import moe
from ptxforge.testing.checks import calc_diff
from support.plans import PlanRecorder

pytestmark = pytest.mark.gpu


def routing(tokens, top_k, experts, *, hot=None, seed=0):
    """topk_idx [T, k] (distinct experts per token, as torch.topk gives) and f32 weights;
    ``hot``: every token's first choice is that expert."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    if hot is not None:
        scores[:, hot] = 2.0
    weights, idx = scores.topk(top_k, dim=-1)
    return idx, (weights / weights.sum(-1, keepdim=True)).float()


def expert_weights(experts, hidden, inner, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inner, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(experts, hidden, inner, device="cuda", generator=g) * 0.02).bfloat16()
    return gate_up, down


def quantized(w):
    q, s = ptxforge.quantize_fp8_per_block(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), s.view(w.shape[0], -1, s.shape[-1])


def reference(x, idx, weights, gate_up, down):
    """The bf16 experts in fp64: sum_j w_j * down_e(silu(gate_e x) * up_e x)."""
    x, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inner = down.shape[-1]
    for e in idx.unique().tolist():
        if not 0 <= e < gate_up.shape[0]:
            continue
        t, j = (idx == e).nonzero(as_tuple=True)
        h = x[t] @ gate_up[e].double().t()
        h = torch.nn.functional.silu(h[:, :inner]) * h[:, inner:]
        out.index_add_(0, t, (h @ down[e].double().t()) * weights[t, j, None].double())
    return out


@pytest.mark.parametrize("layout", moe.LAYOUTS)
def test_permute_and_silu_kernels_match_the_dense_kernels_bit_for_bit(layout):
    tokens, top_k, experts, hidden, inner = 50, 4, 16, 1024, 512
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    idx, _ = routing(tokens, top_k, experts)
    r = ptxforge.moe_routing_layout(idx, experts, layout=layout,
                                    rows_per_expert=tokens if layout == "masked" else None)
    lead = moe.grouped_rows(layout, tokens, top_k, experts)
    q, s = ptxforge.moe_permute_quantize_fp8(x, r.rows, lead)
    dense_q, dense_s = ptxforge.quantize_fp8_per_token(x)
    rows = r.rows.view(-1).long()
    pair_token = torch.arange(tokens * top_k, device="cuda") // top_k
    assert torch.equal(q.view(-1, hidden)[rows].view(torch.uint8),
                       dense_q[pair_token].view(torch.uint8))
    assert torch.equal(s.reshape(-1, s.shape[-1])[rows], dense_s[pair_token])

    d = torch.randn(*lead, 2 * inner, device="cuda").bfloat16()
    hq, hs = ptxforge.moe_silu_mul_quantize_fp8(d, r.rows)
    flat = d.view(-1, 2 * inner)[rows]
    dense_hq, dense_hs = ptxforge.silu_mul_quantize_fp8(flat[:, :inner], flat[:, inner:])
    assert torch.equal(hq.view(-1, inner)[rows].view(torch.uint8), dense_hq.view(torch.uint8))
    assert torch.equal(hs.reshape(-1, hs.shape[-1])[rows], dense_hs)


@pytest.mark.parametrize("layout", moe.LAYOUTS)
@pytest.mark.parametrize("hidden", [7168, 2112, 512])   # 56, 17 and 4 scales a row
def test_permute_leaves_the_rows_no_pair_names(layout, hidden):
    """Into a poisoned out=, after a call with another routing (whose row -> pair entries
    the scale gather then finds in its reused buffer): the rows this routing names get
    their token's row and scales, the others keep the poison; dropped pairs write nothing."""
    tokens, top_k, experts = 300, 8, 32
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    lead = moe.grouped_rows(layout, tokens, top_k, experts)
    per_expert = {"rows_per_expert": tokens} if layout == "masked" else {}
    first = ptxforge.moe_routing_layout(routing(tokens, top_k, experts, seed=1)[0], experts,
                                        layout=layout, **per_expert)
    ptxforge.moe_permute_quantize_fp8(x, first.rows, lead)
    idx, _ = routing(tokens, top_k, experts, seed=2)
    idx[::7, 0] = experts   # dropped pairs
    r = ptxforge.moe_routing_layout(idx, experts, layout=layout, **per_expert)
    q, s = moe.grouped_quantized(lead, hidden, "cuda")
    q.view(torch.uint8).fill_(0x7F)   # e4m3 NaN
    s.fill_(float("nan"))
    ptxforge.moe_permute_quantize_fp8(x, r.rows, lead, out=(q, s))
    dense_q, dense_s = ptxforge.quantize_fp8_per_token(x)
    flat_q, flat_s = q.view(-1, hidden), s.reshape(-1, s.shape[-1])
    rows = r.rows.view(-1).long()
    kept = rows >= 0   # -1: a dropped pair
    pair_token = (torch.arange(tokens * top_k, device="cuda") // top_k)[kept]
    rows = rows[kept]
    assert torch.equal(flat_q[rows].view(torch.uint8), dense_q[pair_token].view(torch.uint8))
    assert torch.equal(flat_s[rows], dense_s[pair_token])
    others = torch.ones(flat_q.shape[0], dtype=torch.bool, device="cuda")
    others[rows] = False
    assert (flat_q[others].view(torch.uint8) == 0x7F).all()
    assert flat_s[others].isnan().all()


CASES = [(1, 2, 8), (16, 2, 8), (64, 4, 16), (300, 8, 32)]


@pytest.mark.parametrize("layout", moe.LAYOUTS)
@pytest.mark.parametrize("tokens, top_k, experts", CASES)
def test_experts_match_the_fp64_reference(layout, tokens, top_k, experts):
    hidden, inner = 1024, 512
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    idx, w = routing(tokens, top_k, experts)
    gate_up, down = expert_weights(experts, hidden, inner)
    out = moe.moe_experts_fp8(x, idx, w, quantized(gate_up), quantized(down), layout=layout)
    ref = reference(x, idx, w, gate_up, down)
    assert not out.isnan().any()
    assert calc_diff(out, ref) < 5e-3
    again = moe.moe_experts_fp8(x, idx, w, quantized(gate_up), quantized(down), layout=layout)
    assert torch.equal(out, again)   # the same bits every run


@pytest.mark.parametrize("layout", moe.LAYOUTS)
def test_one_expert_with_every_token_and_experts_with_none(layout):
    tokens, top_k, experts, hidden, inner = 200, 2, 32, 1024, 512
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    idx, w = routing(tokens, top_k, experts, hot=5)
    idx[:, 1] = idx[:, 1] % 3 + 6            # 6, 7, 8 or 5's neighbours; most experts: nothing
    idx[idx[:, 1] == 5, 1] = 9
    gate_up, down = expert_weights(experts, hidden, inner)
    out = moe.moe_experts_fp8(x, idx, w, quantized(gate_up), quantized(down), layout=layout)
    assert calc_diff(out, reference(x, idx, w, gate_up, down)) < 5e-3


def test_indices_out_of_range_drop_their_pairs():
    tokens, top_k, experts, hidden, inner = 64, 4, 16, 1024, 512
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    idx, w = routing(tokens, top_k, experts)
    idx[3, 1], idx[10, 0], idx[20, 3] = -1, experts, 1 << 40
    gate_up, down = expert_weights(experts, hidden, inner)
    for layout in moe.LAYOUTS:
        out = moe.moe_experts_fp8(x, idx, w, quantized(gate_up), quantized(down), layout=layout)
        assert calc_diff(out, reference(x, idx, w, gate_up, down)) < 5e-3


def test_a_graph_replays_with_the_routing_changed():
    tokens, top_k, experts, hidden, inner = 32, 2, 8, 1024, 512
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    idx, w = routing(tokens, top_k, experts)
    gate_up, down = expert_weights(experts, hidden, inner)
    b13, b2 = quantized(gate_up), quantized(down)
    for layout in moe.LAYOUTS:
        moe.moe_experts_fp8(x, idx, w, b13, b2, layout=layout)   # build the kernels first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.moe_experts_fp8(x, idx, w, b13, b2, layout=layout)
        for seed in (1, 2, 3):
            new_idx, new_w = routing(tokens, top_k, experts, seed=seed, hot=seed)
            idx.copy_(new_idx)
            w.copy_(new_w)
            x.copy_(torch.randn_like(x))
            graph.replay()
            expected = moe.moe_experts_fp8(x, idx, w, b13, b2, layout=layout)
            assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", ["deepseek_v3", "mixtral"])
def test_a_transformers_moe_block_compiles_to_the_experts_op(kind):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = {"deepseek_v3": dict(hidden_size=1024, moe_intermediate_size=512,
                                 n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                                 topk_group=2, intermediate_size=2048),
             "mixtral": dict(hidden_size=1024, intermediate_size=1024)}[kind]
    model = models.moe_block(kind.replace("_", "-") + "-moe", device="cuda", **sizes).model
    f32 = models.in_f32(model)
    backend = PlanRecorder()
    plans = backend.plans

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for tokens in (3, 64, 700):
            x = torch.randn(1, tokens, 1024, device="cuda").bfloat16()
            compiler.mark_token_dims((x,), {})
            out = compiled(x)
            assert calc_diff(out, f32(x.float())) < 5e-3
            assert torch.equal(out, compiled(x))
    (plan,) = plans   # one graph for every token count
    assert [item.operator for item in plan if item.rewrite == "moe experts"] == \
        ["ptxforge.moe_experts_fp8"]
