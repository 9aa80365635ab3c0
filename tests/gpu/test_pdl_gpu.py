"""Programmatic dependent launch on a real GPU: a decode-like chain where each kernel reads
what the one before it wrote gives the same bits with pdl=True as with pdl=False, called
directly and replayed in a CUDA graph with new inputs (a kernel reading before its wait
would see the previous replay's values); and the chain benchmark runs."""

import pytest
import torch

import ptxforge
from ptxforge.bench import ops as bench

pytestmark = pytest.mark.gpu

M, HIDDEN, INTER = 64, 7168, 2048      # tokens, hidden and intermediate sizes
GROUPS, M_MAX, EXPERT_N = 4, 16, 256   # MoE: G groups of M_MAX rows (G * M_MAX = M)
BF16 = torch.bfloat16


def weights() -> dict:
    torch.manual_seed(0)
    bf16 = lambda *shape: torch.randn(*shape, device="cuda").to(BF16)
    experts = [ptxforge.quantize_fp8_per_block(bf16(EXPERT_N, HIDDEN)) for _ in range(GROUPS)]
    return {"norm": bf16(HIDDEN), "norm2": bf16(INTER),
            "up": ptxforge.quantize_fp8_per_block(bf16(INTER, HIDDEN)),
            "down": ptxforge.quantize_fp8_per_block(bf16(HIDDEN, INTER)),
            "dense_bf16": bf16(INTER, HIDDEN),
            "experts": (torch.stack([e[0] for e in experts]), torch.stack([e[1] for e in experts])),
            "experts_bf16": bf16(GROUPS, EXPERT_N, HIDDEN),
            "m_indices": torch.tensor([1] * 48 + [-1] * 16, dtype=torch.int32, device="cuda"),
            "masked_m": torch.tensor([16, 5, 0, 11], dtype=torch.int32, device="cuda")}


def step(x: torch.Tensor, w: dict, pdl: bool) -> list[torch.Tensor]:
    """Every op, each reading what the kernel just before it wrote (a torch kernel where an
    op needs its input made: m_indices, masked_m, c); returns every output."""
    empty = lambda *shape, dtype=BF16: torch.empty(*shape, dtype=dtype, device="cuda")
    h = ptxforge.rms_norm(x, w["norm"], pdl=pdl)
    a = ptxforge.quantize_fp8_per_token(h, pdl=pdl)
    up = empty(M, INTER)
    ptxforge.fp8_gemm_nt(a, w["up"], up, pdl=pdl)
    a2 = ptxforge.rms_norm_quantize_fp8(up, w["norm2"], pdl=pdl)
    down = empty(M, HIDDEN)
    ptxforge.fp8_gemm_nt(a2, w["down"], down, pdl=pdl)
    b = ptxforge.quantize_fp8_per_block(down, pdl=pdl)          # the GEMM's D as a weight
    mixed = empty(M, M)
    ptxforge.fp8_gemm_nt(a, b, mixed, pdl=pdl)                 # B and sb just written
    acc = mixed.float()
    ptxforge.fp8_gemm_nt(a, b, acc, acc, pdl=pdl)              # c = d, just written
    h2 = ptxforge.rms_norm(down, w["norm"], pdl=pdl)
    dense = empty(M, INTER)
    ptxforge.bf16_gemm_nt(h2, w["dense_bf16"], dense, pdl=pdl)
    a3 = ptxforge.silu_mul_quantize_fp8(*dense.chunk(2, dim=-1), pdl=pdl)  # D's halves
    outputs = [h, *a, up, *a2, down, *b, mixed, acc, h2, dense, *a3]
    for scaled in (True, False):
        contiguous = empty(M, EXPERT_N)
        m_indices = w["m_indices"] * 1                          # written just before
        if scaled:
            ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, w["experts"], contiguous, m_indices,
                                                      pdl=pdl)
        else:
            ptxforge.m_grouped_bf16_gemm_nt_contiguous(h2, w["experts_bf16"], contiguous,
                                                       m_indices, pdl=pdl)
        masked = torch.zeros(GROUPS, M_MAX, EXPERT_N, dtype=BF16, device="cuda")
        masked_m = w["masked_m"] * 1
        if scaled:
            a_masked = (a[0].view(GROUPS, M_MAX, HIDDEN), a[1].view(GROUPS, M_MAX, -1))
            ptxforge.m_grouped_fp8_gemm_nt_masked(a_masked, w["experts"], masked, masked_m, 8,
                                                  pdl=pdl)
        else:
            ptxforge.m_grouped_bf16_gemm_nt_masked(h2.view(GROUPS, M_MAX, HIDDEN),
                                                   w["experts_bf16"], masked, masked_m, 8,
                                                   pdl=pdl)
        outputs += [contiguous, masked]
    return outputs


def same_bits(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, i
        assert torch.equal(g.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)), i


def inputs(count: int) -> list[torch.Tensor]:
    return [torch.randn(M, HIDDEN, device="cuda").to(BF16) * (1 + i) for i in range(count)]


def test_pdl_gives_the_same_bits_called_directly():
    w = weights()
    for x in inputs(3):
        expected = step(x, w, pdl=False)
        torch.cuda.synchronize()
        assert not any(t.float().isnan().any() for t in expected if t.dtype == BF16)
        for _ in range(3):
            same_bits(step(x, w, pdl=True), expected)


def test_pdl_gives_the_same_bits_in_a_cuda_graph_with_new_inputs():
    w = weights()
    static_x = inputs(1)[0]
    step(static_x, w, pdl=True)                                  # plans and launchers
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            captured = step(static_x, w, pdl=True)
    torch.cuda.current_stream().wait_stream(stream)
    for x in inputs(4):
        static_x.copy_(x)
        graph.replay()
        same_bits(captured, step(x, w, pdl=False))


def test_the_chain_bench_runs():
    result = bench.chain_suite(bench.Timer(warmup=2, reps=5))
    assert [row["pdl"] for row in result["rows"]] == [False, True]
    assert len(result["standalone_us"]) == len(bench.CHAIN_SHAPES)
    for row in result["rows"]:
        assert row["chain_us"] > 0 and len(row["gaps_us"]) == len(bench.CHAIN_SHAPES) - 1
        assert row["calc_diff"] < 1e-3
        # the chain spans its kernels: at least the longest one
        assert row["chain_us"] >= 0.5 * max(result["standalone_us"])
    assert "PDL on: chain" in bench.chain_table(result)
