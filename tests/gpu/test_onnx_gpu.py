"""An exported Llama (hidden 1024, 2 layers; torch.onnx.export at opset 18 and 23) loaded
by ptxforge.onnx in bf16 and compiled by the ptxforge backend on the GPU, against
onnxruntime (CPU) running the same ONNX file in f32 on the same token ids: calc_diff <= 1e-4
with fp8=False (bf16 GEMMs), <= 5e-3 with FP8; the Linears, norms, SwiGLUs and residual
adds on ptxforge's kernels, one graph for both sequence lengths."""

import pytest
import torch

import ptxforge.onnx as ptxforge_onnx
from ptxforge import compiler
from ptxforge.testing import models
from ptxforge.testing.checks import calc_diff

pytestmark = pytest.mark.gpu
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 4096}


@pytest.fixture(scope="module", params=[18, 23])
def exported(request, tmp_path_factory):
    """(path, onnxruntime session) of the Llama exported in f32 at the opset."""
    torch.manual_seed(0)
    model = models.transformers_model(transformers.LlamaConfig(**LLAMA)).model.float()
    path = tmp_path_factory.mktemp(f"llama{request.param}") / "llama.onnx"
    models.export_onnx(model, path, request.param)
    return path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("fp8, limit", [(False, 1e-4), (True, 5e-3)])
def test_an_exported_llama_on_ptxforge_matches_onnxruntime(exported, fp8, limit):
    from torch._dynamo.utils import counters

    path, session = exported
    module = ptxforge_onnx.load(path, dtype=torch.bfloat16, device="cuda")
    plans = []

    def backend(gm, example_inputs):
        compiled = compiler.backend(gm, example_inputs, fp8=fp8)
        plans.append(gm.ptxforge_plan)
        return compiled

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend=backend)
    for tokens in (64, 200):
        ids = torch.randint(0, LLAMA["vocab_size"], (1, tokens))
        expected = torch.from_numpy(session.run(None, {"ids": ids.numpy()})[0])
        cuda_ids = ids.cuda()
        compiler.mark_token_dims((cuda_ids,), {})
        with torch.no_grad():
            got = compiled(cuda_ids)
        assert calc_diff(got.float().cpu(), expected) <= limit, (tokens, fp8)
    assert counters["stats"]["unique_graphs"] == 1
    (plan,) = plans
    linear = "ptxforge.fp8_linear" if fp8 else "ptxforge.bf16_linear"
    # per layer: q/k/v as one GEMM, o, gate/up as one, down; o and down add the residual
    assert [item.pattern for item in plan if item.operator == linear] == \
        ["3 linears of one x", "linear", "2 linears of one x", "linear"] * 2 + ["residual add"] * 4
    assert [item.operator for item in plan if item.pattern == "causal attention"] == \
        ["SDPA is_causal=True"] * 2
    if fp8:
        assert [item.operator for item in plan if item.pattern.endswith("-> fp8")] == \
            ["ptxforge.rms_norm_fp8", "ptxforge.rms_norm_fp8", "ptxforge.silu_mul_fp8"] * 2
