"""The torch.library operators (torch.ops.ptxforge.*) on the CPU: one per op that launches
a kernel, the GEMMs mutating d and nothing else, fake implementations that agree with what
the functions allocate, and a transformer FFN's ops traced into one graph with fake CUDA
tensors (no GPU needed)."""

import pytest

torch = pytest.importorskip("torch")

import ptxforge.ops  # noqa: E402,F401  registers the operators
from ptxforge.ops import block_quant, library, routing, rowwise  # noqa: E402
from ptxforge.public import PUBLIC  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402


def test_every_op_that_launches_a_kernel_is_an_operator():
    assert set(library.OPERATORS) == {entry.name for entry in PUBLIC if entry.kernels}
    for name in library.OPERATORS:
        assert hasattr(getattr(torch.ops.ptxforge, name), "default")


@pytest.mark.parametrize("name", list(library.OPERATORS))
def test_the_gemms_write_d_and_the_rest_are_functional(name):
    schema = getattr(torch.ops.ptxforge, name).default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if "gemm" in name:
        assert written == ["d"] and len(schema.returns) == 0
    else:
        assert written == [] and len(schema.returns) >= 1


def test_fakes_allocate_what_the_functions_allocate():
    with FakeTensorMode():
        x = torch.empty(100, 640, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(640, device="cuda", dtype=torch.bfloat16)
        for layout in ("mn_major", "row_major"):
            q, s = torch.ops.ptxforge.rms_norm_quantize_fp8(x, w, 1e-6, layout)
            q_real, s_real = rowwise.quantized_outputs(100, 640, layout, x.device)
            assert (q.shape, q.dtype, q.stride()) == (q_real.shape, q_real.dtype, q_real.stride())
            assert (s.shape, s.dtype, s.stride()) == (s_real.shape, s_real.dtype, s_real.stride())
        assert s.shape == (100, 5)
        q, s = torch.ops.ptxforge.quantize_fp8_per_token(x)
        assert s.stride() == (1, 100)      # MN-major, TMA-aligned columns
        y = torch.ops.ptxforge.rms_norm(torch.empty(2, 3, 640, device="cuda",
                                                    dtype=torch.bfloat16), w)
        assert y.shape == (2, 3, 640) and y.dtype == torch.bfloat16
        q, s = torch.ops.ptxforge.quantize_fp8_per_block(torch.empty(300, 640, device="cuda",
                                                                     dtype=torch.bfloat16))
        assert (q.shape, s.shape) == ((300, 640), (3, 5))
        assert s.stride() == block_quant.block_quantized_outputs(300, 640, "cuda")[1].stride()
        gate, up = torch.empty(100, 2 * 640, device="cuda", dtype=torch.bfloat16).chunk(2, -1)
        for layout in ("mn_major", "row_major"):
            q, s = torch.ops.ptxforge.silu_mul_quantize_fp8(gate, up, layout)
            q_real, s_real = rowwise.quantized_outputs(100, 640, layout, x.device)
            assert (q.shape, q.dtype, q.stride()) == (q_real.shape, q_real.dtype, q_real.stride())
            assert (s.shape, s.dtype, s.stride()) == (s_real.shape, s_real.dtype, s_real.stride())


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_the_routing_layout_fake_allocates_what_the_function_allocates(layout):
    """int32 rows [T, k] and counts [E]; the contiguous layout's m_indices (every pair and
    127 rows of padding an expert) and rows_used, the masked layout's None in their place."""
    with FakeTensorMode():
        topk_idx = torch.empty(100, 8, device="cuda", dtype=torch.int64)
        fake = torch.ops.ptxforge.moe_routing_layout(topk_idx, 256, layout=layout)
        real = routing.routing_outputs(100, 8, 256, layout, topk_idx.device)
        assert len(fake) == len(real) == 4
        for f, r in zip(fake, real):
            if r is None:
                assert f is None and layout == "masked"
            else:
                assert (f.shape, f.dtype) == (r.shape, r.dtype) == (r.shape, torch.int32)
        assert fake[0].shape == (100, 8) and fake[1].shape == (256,)
        if layout == "contiguous":
            assert fake[2].shape == (800 + 256 * 127,) and fake[3].shape == (1,)


def traced_ffn(swiglu) -> list:
    """The call nodes of an FFN block written with the operators (RMSNorm + quantize, the
    FP8 gate/up GEMM, ``swiglu(g, u) -> (q, s)`` on the halves of its output, the down GEMM
    accumulating into the residual), traced with fake CUDA tensors: no GPU needed."""
    def ffn(x, norm, gate_up, gate_up_s, down, down_s):
        q, s = torch.ops.ptxforge.rms_norm_quantize_fp8(x, norm, 1e-6)
        h = torch.empty(x.shape[0], gate_up.shape[0], device=x.device, dtype=torch.bfloat16)
        torch.ops.ptxforge.fp8_gemm_nt(q, s, gate_up, gate_up_s, h)
        g, u = h.chunk(2, dim=-1)
        q, s = swiglu(g, u)
        out = x.float()
        torch.ops.ptxforge.fp8_gemm_nt(q, s, down, down_s, out, out)
        return out

    with FakeTensorMode():
        hidden, inter = 7168, 2048
        args = (torch.empty(64, hidden, device="cuda", dtype=torch.bfloat16),
                torch.empty(hidden, device="cuda", dtype=torch.bfloat16),
                torch.empty(2 * inter, hidden, device="cuda", dtype=torch.float8_e4m3fn),
                torch.empty(2 * inter // 128, hidden // 128, device="cuda", dtype=torch.float32),
                torch.empty(hidden, inter, device="cuda", dtype=torch.float8_e4m3fn),
                torch.empty(hidden // 128, inter // 128, device="cuda", dtype=torch.float32))
        graph = make_fx(ffn, tracing_mode="fake")(*args)
    return [node for node in graph.graph.nodes if node.op == "call_function"]


def ptxforge_calls(calls: list) -> list[str]:
    return [str(node.target) for node in calls if str(node.target).startswith("ptxforge.")]


def test_a_ffn_block_traces_into_one_graph_of_ptxforge_operators():
    """SwiGLU in torch, then quantized: every ptxforge call is one node of the graph."""
    calls = traced_ffn(lambda g, u: torch.ops.ptxforge.quantize_fp8_per_token(
        (torch.nn.functional.silu(g) * u).contiguous()))
    assert ptxforge_calls(calls) == [
        "ptxforge.rms_norm_quantize_fp8.default", "ptxforge.fp8_gemm_nt.default",
        "ptxforge.quantize_fp8_per_token.default", "ptxforge.fp8_gemm_nt.default"]


def test_a_fused_ffn_block_reads_the_gate_up_output_in_place():
    """SwiGLU fused into the quantization: the gate/up GEMM's output goes to
    silu_mul_quantize_fp8 as its two halves, with no copy between them."""
    calls = traced_ffn(torch.ops.ptxforge.silu_mul_quantize_fp8)
    assert ptxforge_calls(calls) == [
        "ptxforge.rms_norm_quantize_fp8.default", "ptxforge.fp8_gemm_nt.default",
        "ptxforge.silu_mul_quantize_fp8.default", "ptxforge.fp8_gemm_nt.default"]
    gate_up_gemm = next(node for node in calls if "fp8_gemm_nt" in str(node.target))
    swiglu = next(node for node in calls if "silu_mul" in str(node.target))
    (split,) = {half.args[0] for half in swiglu.args[:2]}  # getitem(split(h), 0) and (.., 1)
    assert str(split.target) == "aten.split.Tensor" and split.args[0] is gate_up_gemm.args[4]


@pytest.mark.parametrize("name", ["fp8_gemm_nt", "bf16_gemm_nt"])
def test_the_dense_gemms_take_a_read_only_residual_by_keyword(name):
    schema = getattr(torch.ops.ptxforge, name).default._schema
    residual = next(a for a in schema.arguments if a.name == "residual")
    assert residual.kwarg_only and residual.alias_info is None
    assert str(residual.type) == "Optional[Tensor]" and residual.default_value is None


def test_the_linears_take_a_residual_of_their_output_s_shape():
    with FakeTensorMode():
        x = torch.empty(2, 3, 256, device="cuda", dtype=torch.bfloat16)
        residual = torch.empty(2, 3, 128, device="cuda", dtype=torch.bfloat16)
        wq = torch.empty(128, 256, device="cuda", dtype=torch.float8_e4m3fn)
        ws = torch.empty(1, 2, device="cuda", dtype=torch.float32)
        w = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
        for d in (torch.ops.ptxforge.fp8_linear(x, None, wq, ws, None, residual),
                  torch.ops.ptxforge.bf16_linear(x, w, residual=residual)):
            assert (d.shape, d.dtype) == ((2, 3, 128), torch.bfloat16)
    # The real linear checks the residual's shape (here before it needs a GPU): the rows it
    # reshapes to must be x's, not just as many.
    x, w = torch.zeros(2, 3, 256, dtype=torch.bfloat16), torch.zeros(128, 256, dtype=torch.bfloat16)
    wrong = torch.zeros(6, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^residual must have shape \(2, 3, 128\), got \(6, 128\)$"):
        library._bf16_linear(x, w, residual=wrong)


def test_a_residual_add_after_a_linear_traces_into_the_gemm():
    """x + o_proj(attn): the residual goes into the GEMM's epilogue, one node, no add."""
    def block(x, q, s, w, ws):
        out = torch.empty_like(x)
        torch.ops.ptxforge.fp8_gemm_nt(q, s, w, ws, out, residual=x)
        return out

    with FakeTensorMode():
        args = (torch.empty(64, 512, device="cuda", dtype=torch.bfloat16),
                torch.empty(64, 256, device="cuda", dtype=torch.float8_e4m3fn),
                torch.empty(64, 2, device="cuda", dtype=torch.float32),
                torch.empty(512, 256, device="cuda", dtype=torch.float8_e4m3fn),
                torch.empty(4, 2, device="cuda", dtype=torch.float32))
        graph = make_fx(block, tracing_mode="fake")(*args)
    calls = [node for node in graph.graph.nodes if node.op == "call_function"]
    gemms = [node for node in calls if str(node.target) == "ptxforge.fp8_gemm_nt.default"]
    assert len(gemms) == 1 and gemms[0].kwargs["residual"].op == "placeholder"
    assert not any("add" in str(node.target) for node in calls)


def _recorded(graphs: list):
    """A torch.compile backend that keeps each graph and runs nothing (its outputs None):
    what the tracer made is the test, not the kernels, which need a GPU."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        return lambda *args: [None] * len(outputs)
    return backend


def test_the_public_functions_trace_as_their_operators_with_fullgraph():
    """torch.compile(fullgraph=True) over the public functions (not torch.ops.ptxforge.*):
    each call becomes its operator in one graph, out= written by a copy, on CPU tensors
    (the tracer never runs the functions' checks or kernels)."""
    import ptxforge

    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    m, k, n, groups, inner = 64, 256, 512, 4, 128

    def every_op(x, w, wq, ws, bw, idx, weights):
        q, s = ptxforge.quantize_fp8_per_token(x)
        ptxforge.rms_norm_quantize_fp8(x, w, out=(torch.empty_like(q), torch.empty_like(s)))
        h = ptxforge.rms_norm(x, w)
        gq, gs = ptxforge.silu_mul_quantize_fp8(x, h)
        bq, bs = ptxforge.quantize_fp8_per_block(bw)
        d = torch.empty(m, n, dtype=bf16)
        ptxforge.fp8_gemm_nt((q, s), (wq, ws), d)
        ptxforge.bf16_gemm_nt(x, bw, d)
        route = ptxforge.moe_routing_layout(idx, groups)
        a = ptxforge.moe_permute_quantize_fp8(x, route.rows, (route.m_indices.shape[0],))
        grouped = torch.empty(route.m_indices.shape[0], 2 * inner, dtype=bf16)
        b = (wq.view(groups, -1, k), ws.view(groups, -1, ws.shape[1]))   # [G, 2I, K]
        ptxforge.m_grouped_fp8_gemm_nt_contiguous(a, b, grouped, route.m_indices,
                                                  rows_used=route.rows_used)
        ptxforge.m_grouped_bf16_gemm_nt_contiguous(grouped[:, :k], bw.view(groups, -1, k),
                                                   grouped, route.m_indices)
        aq, as_ = ptxforge.moe_silu_mul_quantize_fp8(grouped, route.rows)
        masked = torch.empty(groups, 16, n, dtype=bf16)
        ptxforge.m_grouped_fp8_gemm_nt_masked(
            (aq.view(groups, -1, inner)[:, :16], as_.view(groups, -1, 1)[:, :16]),
            b, masked, route.counts, 16)
        ptxforge.m_grouped_bf16_gemm_nt_masked(masked[..., :k], bw.view(groups, -1, k), masked,
                                               route.counts, 16)
        y = ptxforge.moe_combine(grouped[:, :k].contiguous(), route.rows, weights)
        cache = torch.empty(2, 4, 32, 64, dtype=bf16).transpose(1, 2)   # transformers' layout
        o = ptxforge.attention_with_kvcache(x[:2].view(2, 1, 4, 64), cache, cache,
                                            idx[:2, 0].int())
        return gq, gs, bq, bs, d, y, masked, o

    graphs = []
    inputs = (torch.randn(m, k).to(bf16), torch.randn(k).to(bf16), torch.randn(n, k).to(e4m3),
              torch.rand(n // 128, k // 128), torch.randn(n, k).to(bf16),
              torch.randint(0, groups, (m, 2)), torch.rand(m, 2))
    torch.compile(every_op, backend=_recorded(graphs), fullgraph=True)(*inputs)
    (graph,) = graphs
    called = [str(node.target).removeprefix("ptxforge.") for node in graph.graph.nodes
              if str(node.target).startswith("ptxforge.")]
    assert called == [
        "quantize_fp8_per_token", "rms_norm_quantize_fp8", "rms_norm", "silu_mul_quantize_fp8",
        "quantize_fp8_per_block", "fp8_gemm_nt", "bf16_gemm_nt", "moe_routing_layout",
        "moe_permute_quantize_fp8", "m_grouped_fp8_gemm_nt_contiguous",
        "m_grouped_bf16_gemm_nt_contiguous", "moe_silu_mul_quantize_fp8",
        "m_grouped_fp8_gemm_nt_masked", "m_grouped_bf16_gemm_nt_masked", "moe_combine",
        "attention_with_kvcache"]
    assert {entry.name for entry in PUBLIC if entry.kernels} == set(called)
    copies = [node for node in graph.graph.nodes if node.target == "copy_"]
    assert len(copies) == 2   # rms_norm_quantize_fp8's out=(q, scales)


def test_a_traced_call_refuses_what_its_operator_cannot_take():
    from ptxforge.ops.common import traced

    with pytest.raises(ValueError, match="config= cannot be traced by torch.compile"):
        traced("fp8_gemm_nt", config=object())


def test_a_public_function_called_inside_a_backend_runs_for_real():
    """A compile backend runs inside torch.compile (ptxforge's quantizes weights there with
    the real functions): the function then takes its own path, not its operator's (whose
    CUDA implementation is the function again). On the CPU that path refuses the tensor."""
    import ptxforge

    raised = []

    def backend(gm, example_inputs):
        try:
            ptxforge.quantize_fp8_per_block(torch.randn(256, 256).to(torch.bfloat16))
        except Exception as error:   # noqa: BLE001 - the error itself is the check
            raised.append(error)
        return gm.forward

    torch.compile(lambda x: x + 1, backend=backend)(torch.zeros(2))
    (error,) = raised
    assert str(error) == "w must be on a CUDA device, got cpu"   # not the operator's dispatch
