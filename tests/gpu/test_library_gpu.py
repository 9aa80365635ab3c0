"""The torch.library operators on a GPU: torch.library.opcheck on every one (schema,
fake tensors, AOT dispatch), the compiler's linears among them, and a transformer FFN
written with them compiled by torch.compile(fullgraph=True, dynamic=True) once for every
token count, plain and with CUDA graphs, against the same calls made eagerly; a GEMM's
residual, given d itself, compiled the same."""

import pytest
import torch

import ptxforge
from ptxforge.bench.ops import grouped_operands, masked_operands
from ptxforge.testing.checks import fp8_gemm_operands

pytestmark = pytest.mark.gpu

ops = torch.ops.ptxforge


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def opcheck_cases():
    """(operator, arguments, keyword arguments)."""
    (qa, sa), (qb, sb), _ = fp8_gemm_operands(64, 256, 512)
    x, w = bf16(64, 512), bf16(512)
    yield ops.rms_norm, (x, w, 1e-6), {}
    yield ops.quantize_fp8_per_token, (x,), {}
    yield ops.quantize_fp8_per_token, (x, "row_major"), {}
    yield ops.rms_norm_quantize_fp8, (x, w, 1e-5), {}
    yield ops.silu_mul_quantize_fp8, (x, bf16(64, 512)), {}
    yield ops.silu_mul_quantize_fp8, (*bf16(64, 2 * 1000).chunk(2, dim=-1), "row_major"), {}
    yield ops.quantize_fp8_per_block, (bf16(256, 512),), {}
    yield ops.rms_norm_fp8, (bf16(2, 32, 512), w, 1e-6), {}
    yield ops.silu_mul_fp8, (*bf16(2, 32, 1024).chunk(2, dim=-1),), {}
    yield ops.fp8_gemm_nt, (qa, sa, qb, sb, torch.empty(64, 256, device="cuda",
                                                        dtype=torch.bfloat16)), {}
    yield ops.fp8_gemm_nt, (qa, sa, qb, sb, torch.empty(64, 256, device="cuda",
                                                        dtype=torch.bfloat16)), {
        "bias": bf16(256), "residual": bf16(64, 256)}
    yield ops.bf16_gemm_nt, (x, bf16(256, 512), torch.empty(64, 256, device="cuda",
                                                            dtype=torch.bfloat16)), {}
    yield ops.bf16_gemm_nt, (x, bf16(256, 512), torch.empty(64, 256, device="cuda",
                                                            dtype=torch.bfloat16)), {
        "residual": bf16(64, 256)}
    yield ops.fp8_linear, (bf16(2, 32, 512), None, qb, sb, bf16(256), bf16(2, 32, 256)), {}
    yield ops.bf16_linear, (bf16(2, 32, 512), bf16(256, 512)), {"residual": bf16(2, 32, 256)}
    yield ops.bf16_linear_f32, (bf16(2, 32, 512), bf16(256, 512)), {}
    (ga, gsa), (gb, gsb), m_indices, _ = grouped_operands([100, 30], 256, 512)
    yield ops.m_grouped_fp8_gemm_nt_contiguous, (
        ga, gsa, gb, gsb, torch.empty(ga.shape[0], 256, device="cuda", dtype=torch.bfloat16),
        m_indices), {}
    (ma, msa), (mb, msb), masked_m, _ = masked_operands([5, 40], 64, 256, 512)
    yield ops.m_grouped_fp8_gemm_nt_masked, (
        ma, msa, mb, msb, torch.empty(2, 64, 256, device="cuda", dtype=torch.bfloat16),
        masked_m, 32), {}
    yield ops.m_grouped_bf16_gemm_nt_contiguous, (
        bf16(ga.shape[0], 512), bf16(2, 256, 512),
        torch.empty(ga.shape[0], 256, device="cuda", dtype=torch.bfloat16), m_indices), {}
    yield ops.m_grouped_bf16_gemm_nt_masked, (
        bf16(2, 64, 512), bf16(2, 256, 512),
        torch.empty(2, 64, 256, device="cuda", dtype=torch.bfloat16), masked_m, 32), {}


def as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def bits(t: torch.Tensor) -> torch.Tensor:
    """e4m3 as its bytes (torch.equal has no e4m3), other dtypes as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def moe_opcheck_cases():
    """(operator, arguments, keyword arguments, opcheck's tests): the MoE operators on a
    routing that fills every grouped row (8 tokens, top-1, 2 tokens an expert), so that
    their outputs hold no uninitialised rows; e4m3 outputs have no allclose, so those ops
    get the fake-tensor test alone (and a bitwise repeat in the test)."""
    everything = ("test_schema", "test_autograd_registration", "test_faketensor",
                  "test_aot_dispatch_dynamic")
    idx = torch.tensor([[0], [0], [1], [1], [2], [2], [3], [3]], device="cuda")
    yield ops.moe_routing_layout, (torch.randint(0, 16, (32, 4), device="cuda"), 16), {}, everything
    yield ops.moe_routing_layout, (idx, 4), {"layout": "masked", "rows_per_expert": 2}, everything
    rows = ptxforge.moe_routing_layout(idx, 4, layout="masked", rows_per_expert=2).rows
    yield ops.moe_permute_quantize_fp8, (bf16(8, 512), rows, [4, 2]), {}, ("test_faketensor",)
    yield ops.moe_silu_mul_quantize_fp8, (bf16(4, 2, 1024), rows), {}, ("test_faketensor",)
    yield ops.moe_combine, (bf16(8, 512), rows, torch.rand(8, 1, device="cuda")), {}, everything
    w13 = ptxforge.quantize_fp8_per_block(bf16(4 * 1024, 512))
    w2 = ptxforge.quantize_fp8_per_block(bf16(4 * 512, 512))
    yield ops.moe_experts_fp8, (bf16(8, 512), idx, torch.rand(8, 1, device="cuda"),
                                w13[0].view(4, 1024, 512), w13[1].view(4, 8, 4),
                                w2[0].view(4, 512, 512), w2[1].view(4, 4, 4)), {}, (
        "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_every_operator():
    """opcheck's schema test compares inputs before and after with allclose, which torch
    does not implement for e4m3: for the ops reading e4m3 the test here checks instead that
    every input keeps its bytes, but d, which is written (the GEMMs), or the result (the
    linear)."""
    checked = set()
    for op, args, kwargs in opcheck_cases():
        fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
        if fp8:
            torch.library.opcheck(op.default, args, kwargs,
                                  test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
            before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            kwargs_before = {name: value.clone() for name, value in kwargs.items()}
            names = [a.name for a in op.default._schema.arguments]
            d = names.index("d") if "d" in names else None
            if d is not None:
                args[d].fill_(float("nan"))
            result = op(*args, **kwargs)
            for i, (a, b) in enumerate(zip(args, before)):
                if isinstance(a, torch.Tensor) and i != d:
                    bits = (lambda t: t.view(torch.uint8)) if a.dtype.itemsize == 1 else (lambda t: t)
                    assert torch.equal(bits(a), bits(b)), (op, i)
            for name, value in kwargs.items():  # bf16 bias and residual: read only
                assert torch.equal(value, kwargs_before[name]), (op, name)
            written = result if d is None else args[d]
            assert not torch.isnan(written).all(), op
        else:
            torch.library.opcheck(op.default, args, kwargs)
        checked.add(op.default.name().split("::")[1])
    for op, args, kwargs, tests in moe_opcheck_cases():
        torch.library.opcheck(op.default, args, kwargs, test_utils=tests)
        first, again = (as_tuple(op(*args, **kwargs)) for _ in range(2))
        assert all(a is b is None or torch.equal(bits(a), bits(b))
                   for a, b in zip(first, again)), op
        checked.add(op.default.name().split("::")[1])
    library = ptxforge.ops.library
    assert checked == set(library.OPERATORS) | set(library.COMPILER_OPERATORS)


def test_bf16_linear_f32_is_the_f32_linear_of_the_casts():
    """bf16 products are exact in f32: the bf16 GEMM accumulating into f32 gives the f32
    GEMM's sums, up to their order (a MoE router's scores, DeepSeek-V3's sizes)."""
    x, w = bf16(4096, 7168), bf16(256, 7168) * 0.02
    out = ops.bf16_linear_f32(x, w)
    expected = torch.nn.functional.linear(x.double(), w.double())
    assert out.dtype == torch.float32 and out.shape == (4096, 256)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_the_linears_add_the_residual():
    """fp8_linear / bf16_linear with a residual of x's leading shape: the GEMM on x's rows
    with the residual's rows, the same bits; against fp64 (bf16)."""
    from ptxforge.testing.checks import calc_diff

    x, residual, bias = bf16(2, 150, 512), bf16(2, 150, 256), bf16(256)
    w = bf16(256, 512)
    wq, ws = ptxforge.quantize_fp8_per_block(w)
    rows = x.view(-1, 512)
    d = torch.empty(300, 256, device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt(ptxforge.quantize_fp8_per_token(rows), (wq, ws), d, bias=bias,
                         residual=residual.view(-1, 256))
    got = ops.fp8_linear(x, None, wq, ws, bias, residual)
    assert got.shape == (2, 150, 256) and torch.equal(got.view(-1, 256), d)
    got = ops.bf16_linear(x, w, bias, residual)
    expected = x.double() @ w.double().T + bias.double() + residual.double()
    assert calc_diff(got, expected) < 1e-3


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_residual_that_is_d_compiles(backend):
    """ops.fp8_gemm_nt(..., out, residual=out): the schema reads residual and writes d, and
    the two are one tensor. Functionalization hands the kernel a copy of d to write or,
    reinplaced, d itself: both give the eager call's bits."""
    (qa, sa), (qb, sb), _ = fp8_gemm_operands(64, 256, 512)

    def block(x):
        out = x.clone()
        ops.fp8_gemm_nt(qa, sa, qb, sb, out, residual=out)
        return out

    x = bf16(64, 256)
    torch._dynamo.reset()
    got = torch.compile(block, backend=backend, fullgraph=True)(x)
    assert torch.equal(got, block(x))


def ffn(x, norm, gate_up, gate_up_s, down, down_s):
    """x + down(silu(g) * u), g, u = gate_up(RMSNorm(x)), written with the operators."""
    q, s = ops.rms_norm_quantize_fp8(x, norm, 1e-6)
    h = torch.empty(x.shape[0], gate_up.shape[0], device=x.device, dtype=torch.bfloat16)
    ops.fp8_gemm_nt(q, s, gate_up, gate_up_s, h)
    g, u = h.chunk(2, dim=-1)
    q, s = ops.quantize_fp8_per_token((torch.nn.functional.silu(g) * u).contiguous())
    out = torch.empty_like(x)
    ops.fp8_gemm_nt(q, s, down, down_s, out)
    return x + out


def test_swiglu_on_a_gate_up_output_compiles_for_every_token_count():
    """The gate/up GEMM's output split in two and handed to silu_mul_quantize_fp8 under
    torch.compile(fullgraph=True, dynamic=True): the eager call's bits; one graph for the
    token counts that are multiples of 4, and one more for the others: a graph that returns
    the MN-major scales guards on their column stride, M rounded up to 4 (measured; inside
    a model the scales go to the GEMM, and the compiler's tests see one graph)."""
    from torch._dynamo.utils import counters

    def swiglu(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return ops.silu_mul_quantize_fp8(gate, up)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(swiglu, fullgraph=True, dynamic=True)
    graphs = []
    for tokens in (64, 8, 300, 7, 5):
        gate_up = bf16(tokens, 2 * 2048)
        q, s = compiled(gate_up)
        rq, rs = swiglu(gate_up)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 2, 2]


@pytest.mark.parametrize("backend, mode", [("aot_eager", None), ("inductor", None),
                                           ("inductor", "reduce-overhead")])
def test_an_ffn_compiles_into_one_graph_for_every_token_count(backend, mode):
    """aot_eager runs the torch parts as eager does: the same bits. Inductor fuses
    silu(g) * u into one rounding (eager rounds twice in bf16): close, not equal.
    reduce-overhead records a CUDA graph, then replays it."""
    from torch._dynamo.utils import counters

    from ptxforge.testing.checks import calc_diff

    hidden, inter = 1024, 512
    gate_up, gate_up_s = ptxforge.quantize_fp8_per_block(bf16(2 * inter, hidden))
    down, down_s = ptxforge.quantize_fp8_per_block(bf16(hidden, inter))
    norm = bf16(hidden)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ffn, fullgraph=True, backend=backend, mode=mode, dynamic=True)
    for tokens in (64, 7, 300):
        x = bf16(tokens, hidden)
        expected = ffn(x, norm, gate_up, gate_up_s, down, down_s)
        for _ in range(3):
            got = compiled(x, norm, gate_up, gate_up_s, down, down_s)
            torch.cuda.synchronize()
            if backend == "aot_eager":
                assert torch.equal(got, expected)
            else:
                assert calc_diff(got, expected) < 1e-4
    assert counters["stats"]["unique_graphs"] == 1
