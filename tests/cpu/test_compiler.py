"""The torch.compile backend's Linear pass on the CPU: on a real (CPU) model every Linear
stays with Inductor with its reason; on a graph of fake CUDA tensors the eligible Linears
become ptxforge.fp8_linear (their weights quantized into buffers of the graph module) or,
with fp8=False, ptxforge.bf16_linear, and the others keep their reason."""

import pytest

torch = pytest.importorskip("torch")

from ptxforge import arch, compiler  # noqa: E402
from ptxforge.testing.models import Ffn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def test_a_cpu_model_keeps_its_linears_with_the_reason():
    plans = []

    def spy(gm, example_inputs):
        plans.append(compiler.rewrite_linears(gm, example_inputs))
        return gm.forward

    model = Ffn(256, 128).to(torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    torch.compile(model, backend=spy, fullgraph=True)(x)
    (plan,) = plans
    assert [(r.operator, r.reason) for r in plan] == [(None, "the weight is on cpu")] * 2


def linear_graph(x, weights):
    """A Dynamo-style graph: x and the weights as placeholders (the weights' marked static,
    as Dynamo marks a module's parameters), torch._C._nn.linear calls in a chain, each with
    its fake example value."""
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["example_value"] = x
    value = x

    def parameter(name):
        placeholder = graph.placeholder(name)
        placeholder.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
        return placeholder

    for i, (weight, bias) in enumerate(weights):
        w = parameter(f"w{i}")
        args = [node, w]
        if bias is not None:
            args.append(parameter(f"b{i}"))
        node = graph.call_function(torch._C._nn.linear, tuple(args))
        # (torch's own linear on fake CUDA tensors aborts in a CPU-only build)
        value = torch.empty(*value.shape[:-1], weight.shape[0], device=value.device,
                            dtype=value.dtype)
        node.meta["example_value"] = value
    graph.output(node)
    inputs = [x] + [t for pair in weights for t in pair if t is not None]
    return torch.fx.GraphModule(torch.nn.Module(), graph), inputs


def hopper(device):
    return arch.get("sm_90a")


@pytest.mark.parametrize("fp8", [True, False])
def test_eligible_linears_become_ptxforge_operators(fp8):
    with FakeTensorMode():
        param = lambda *shape: torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
        x = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
        gm, inputs = linear_graph(x, [(param(512, 256), None), (param(104, 512), param(104)),
                                      (param(96, 104), None)])   # K = 104: not a multiple of 16
        plan = compiler.rewrite_linears(gm, inputs, fp8=fp8, arch_of=hopper)
        two, two_inputs = linear_graph(x, [(param(512, 256), None), (param(104, 512), param(104))])
        compiler.rewrite_linears(two, two_inputs, fp8=fp8, arch_of=hopper)
        out = two(*two_inputs)     # the operators' fakes: the shape of the last Linear
    operator = "ptxforge.fp8_linear" if fp8 else "ptxforge.bf16_linear"
    assert [r.operator for r in plan] == [operator, operator, None]
    assert plan[2].reason == ("the GEMM needs N a positive multiple of 8 and K of 16 (16-byte "
                              "rows), got N=96, K=104")
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [operator + ".default"] * 2 + ["<built-in function linear>"]
    buffers = dict(gm.named_buffers())
    if fp8:
        assert buffers["_ptxforge_linear_0"].dtype == torch.float8_e4m3fn
        assert buffers["_ptxforge_linear_1"].shape == (4, 2)     # 128x128 block scales
    else:
        assert buffers["_ptxforge_linear_0"].dtype == torch.bfloat16
    assert out.shape == (64, 104) and out.dtype == torch.bfloat16


def test_a_device_without_the_gemm_or_a_description_keeps_every_linear():
    reasons = []
    for arch_of in (lambda device: arch.get("sm_80"), lambda device: "no such GPU"):
        with FakeTensorMode():
            x = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
            gm, inputs = linear_graph(x, [(torch.empty(512, 256, device="cuda",
                                                       dtype=torch.bfloat16), None)])
            (item,) = compiler.rewrite_linears(gm, inputs, arch_of=arch_of)
        assert item.operator is None
        reasons.append(item.reason)
    assert reasons[0].startswith("the GEMM needs wgmma, which sm_80")
    assert reasons[1] == "no such GPU"
