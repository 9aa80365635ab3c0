"""The ptxforge torch.compile backend on a GPU: an FFN block and a small transformers Llama
compiled with it, their Linears on ptxforge's GEMMs (weights quantized at compile time),
against the bf16 model computed in f32 (FP8: calc_diff <= 5e-3; bf16: <= 1e-4), with one
graph for every token count."""

import pytest
import torch

from ptxforge import compiler
from ptxforge.testing.checks import calc_diff
from ptxforge.testing.models import Ffn, in_f32

pytestmark = pytest.mark.gpu


def reference(model, x):
    """The bf16 model computed in f32."""
    return in_f32(model)(x.float())


@pytest.mark.parametrize("fp8, limit", [(True, 5e-3), (False, 1e-4)])
def test_an_ffn_block_runs_on_ptxforge_gemms(fp8, limit):
    from torch._dynamo.utils import counters

    model = Ffn(1024, 512).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(model.norm.weight, 1.0, 0.1)
    plans = []

    def backend(gm, example_inputs):
        compiled = compiler.backend(gm, example_inputs, fp8=fp8)
        plans.append(gm.ptxforge_plan)
        return compiled

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for tokens in (64, 5, 300):
        x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            got = compiled(x)
            assert calc_diff(got, reference(model, x)) <= limit
    operator = "ptxforge.fp8_linear" if fp8 else "ptxforge.bf16_linear"
    assert [r.operator for r in plans[0]] == [operator, operator]
    assert counters["stats"]["unique_graphs"] == 1


def test_the_backend_is_registered_by_name():
    model = Ffn(1024, 512).cuda().to(torch.bfloat16)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        assert calc_diff(torch.compile(model, backend="ptxforge")(x), reference(model, x)) <= 5e-3


def test_a_small_llama_compiles_onto_ptxforge_gemms():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=2, vocab_size=1000,
                                      attn_implementation="sdpa")
    model = transformers.LlamaModel(config).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (1, 64), device="cuda")
    plans = []

    def backend(gm, example_inputs):
        compiled = compiler.backend(gm, example_inputs)
        plans.append(gm.ptxforge_plan)
        return compiled

    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids).last_hidden_state.float()
        got = torch.compile(model, backend=backend)(ids).last_hidden_state
    replaced = [r for plan in plans for r in plan if r.operator]
    assert len(replaced) == 2 * 7          # q, k, v, o, gate, up, down in each layer
    assert calc_diff(got, expected) <= 5e-3
