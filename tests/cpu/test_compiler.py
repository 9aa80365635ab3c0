"""The torch.compile backend's passes on the CPU. On a real (CPU) model every Linear stays
with Inductor with its reason; on a graph of fake CUDA tensors the eligible Linears become
ptxforge.fp8_linear (their weights quantized into buffers of the graph module) or, with
fp8=False, ptxforge.bf16_linear, and the others keep their reason; models built on the
meta device (the FFN block, a small Llama) get their RMSNorms and SwiGLUs fused with the
quantization, their parallel Linears joined and their residual adds moved into the GEMM;
the plan's kernels and the CLI's report come from the same trace."""

import copy
import inspect
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from ptxforge import arch, cli, compiler  # noqa: E402
from ptxforge.compiler import precompile, rewriting  # noqa: E402
from ptxforge.kernels import sm90_gemm as gemm_kernel  # noqa: E402
from ptxforge.kernels.gemm import GemmProblem  # noqa: E402
from ptxforge.kernels.sm90_gemm.tile_model import token_counts  # noqa: E402
from ptxforge import models  # noqa: E402
from ptxforge.models import Ffn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def test_a_cpu_model_keeps_its_linears_with_the_reason(caplog):
    plans = []

    def spy(gm, example_inputs):
        plans.append(compiler.rewrite(gm, example_inputs))
        return gm.forward

    model = Ffn(256, 128).to(torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    torch.compile(model, backend=spy, fullgraph=True)(x)
    (plan,) = plans
    assert [(r.operator, r.reason) for r in plan] == [(None, "the weight is on cpu")] * 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "ptxforge leaves every Linear to Inductor: the weight is on cpu"]


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
        plan = compiler.rewrite(gm, inputs, fp8=fp8, arch_of=hopper)
        two, two_inputs = linear_graph(x, [(param(512, 256), None), (param(104, 512), param(104))])
        compiler.rewrite(two, two_inputs, fp8=fp8, arch_of=hopper)
        out = two(*two_inputs)     # the operators' fakes: the shape of the last Linear
    operator = "ptxforge.fp8_linear" if fp8 else "ptxforge.bf16_linear"
    assert [r.operator for r in plan] == [operator, operator, None]
    assert plan[2].reason == ("the GEMM needs N a positive multiple of 8 and K of 16 (16-byte "
                              "rows), got N=96, K=104")
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [operator + ".default"] * 2 + ["<built-in function linear>"]
    buffers = dict(gm.named_buffers())
    if fp8:
        assert buffers["_ptxforge_linear_w"].dtype == torch.float8_e4m3fn
        assert buffers["_ptxforge_linear_ws"].shape == (4, 2)     # 128x128 block scales
    else:
        assert buffers["_ptxforge_linear_w"].dtype == torch.bfloat16
    assert out.shape == (64, 104) and out.dtype == torch.bfloat16


def test_a_device_without_the_gemm_or_a_description_keeps_every_linear():
    reasons = []
    for arch_of in (lambda device: arch.get("sm_80"), lambda device: "no such GPU"):
        with FakeTensorMode():
            x = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
            gm, inputs = linear_graph(x, [(torch.empty(512, 256, device="cuda",
                                                       dtype=torch.bfloat16), None)])
            (item,) = compiler.rewrite(gm, inputs, arch_of=arch_of)
        assert item.operator is None
        reasons.append(item.reason)
    assert reasons[0] == "ptxforge has no GEMM for sm_80 (A100 80GB); its GEMM runs on sm_90a"
    assert reasons[1] == "no such GPU"


def ptxforge_calls(gm):
    """(operator name, the node) of every ptxforge operator in the graph, in order."""
    return [(str(n.target).split(".")[1], n) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("ptxforge.")]


def trace_on_meta(model, *args, fp8=True, **kwargs):
    """Dynamo's graphs of model(*args) on the meta device, rewritten by the passes for
    sm_90a: [(graph module, plan)]."""
    graphs = []

    def spy(gm, example_inputs):
        graphs.append((gm, compiler.rewrite(gm, example_inputs, fp8=fp8, arch_of=hopper)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        compiler.mark_token_dims(args, kwargs)        # as compiler.compile does
        torch.compile(model, backend=spy)(*args, **kwargs)
    return graphs


def test_the_ffn_block_becomes_four_ptxforge_kernels():
    with torch.device("meta"):
        model = Ffn(256, 128).to(torch.bfloat16)
        x = torch.empty(8, 256, dtype=torch.bfloat16)
    ((gm, plan),) = trace_on_meta(model, x)
    calls = ptxforge_calls(gm)
    assert [name for name, _ in calls] == ["rms_norm_fp8", "fp8_linear", "silu_mul_fp8",
                                           "fp8_linear"]
    (x_node,) = [n for n in gm.graph.nodes if n.op == "placeholder" and "x" in n.name]
    norm, gate_up, swiglu, down = (node for _, node in calls)
    assert norm.args[0] is x_node and norm.args[2] == pytest.approx(1e-6)
    assert gate_up.args[0].args == (norm, 0) and gate_up.args[1].args == (norm, 1)
    assert down.args[0].args == (swiglu, 0) and down.kwargs["residual"] is x_node
    assert [n for n in gm.graph.nodes if n.op == "output"][0].args[0] == (down,)
    assert {item.rewrite for item in plan} == {"linear", "rms_norm -> fp8",
                                               "silu(gate) * up -> fp8", "residual add"}


def small_llama(layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=layers, vocab_size=128)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaModel(config).to(torch.bfloat16)
        ids = torch.zeros(1, 8, dtype=torch.long)
    return model, ids


@pytest.mark.parametrize("fp8", [True, False])
def test_a_llama_layer_joins_its_linears_and_fuses_norms_swiglu_and_residuals(fp8):
    model, ids = small_llama()
    ((gm, plan),) = trace_on_meta(model, ids, fp8=fp8, use_cache=False)
    names = [name for name, _ in ptxforge_calls(gm)]
    if fp8:   # per layer: norm, q/k/v as one GEMM, o (+ residual), norm, gate/up, SwiGLU, down
        layer = ["rms_norm_fp8", "fp8_linear", "fp8_linear", "rms_norm_fp8", "fp8_linear",
                 "silu_mul_fp8", "fp8_linear"]
    else:
        layer = ["bf16_linear"] * 4
    assert names == layer * 2
    joined = [item for item in plan if item.rewrite.endswith("linears of one x")]
    assert [item.rewrite for item in joined] == ["3 linears of one x", "2 linears of one x"] * 2
    assert sum(item.rewrite == "residual add" for item in plan) == 4
    assert all(item.operator for item in plan)
    linears = [n for n in gm.graph.nodes if rewriting.kind(n) == "linear"]
    assert linears == []


def test_a_norm_read_by_more_than_linears_is_kept_beside_the_fused_kernel():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(256)
            self.proj = torch.nn.Linear(256, 256, bias=False)

        def forward(self, x):
            y = self.norm(x)
            return self.proj(y), y

    with torch.device("meta"):
        model = Block().to(torch.bfloat16)
        x = torch.empty(8, 256, dtype=torch.bfloat16)
    ((gm, plan),) = trace_on_meta(model, x)
    assert [name for name, _ in ptxforge_calls(gm)] == ["rms_norm_fp8", "fp8_linear"]
    assert [n for n in gm.graph.nodes if rewriting.kind(n) == "rms_norm"]   # still y's


def test_the_plan_lists_each_kernel_and_its_configs_by_token_count():
    model, ids = small_llama(layers=1)
    ((gm, plan),) = trace_on_meta(model, ids, use_cache=False)
    kernels = [k for ks in precompile.kernels_of(gm.graph).values() for k in ks]
    gemms = [k for k in kernels if isinstance(k, precompile.Gemm)]
    assert [g.problem for g in gemms] == [
        GemmProblem(512, 256), GemmProblem(256, 256, epilogue=("residual",)),
        GemmProblem(1024, 256), GemmProblem(256, 512, epilogue=("residual",))]
    sm90 = arch.get("sm_90a")
    every = precompile.every_token_count(sm90, 16384)
    configs = gemms[0].configs(sm90, every)
    assert len(set(configs)) == len(configs) >= 2
    assert len(precompile.builders(kernels, sm90, every)) == (
        sum(len(g.configs(sm90, every)) for g in set(gemms)) + 3)   # + the three row kernels


def test_token_counts_stand_for_every_m_the_tile_model_sees():
    sm90 = arch.get("sm_90a")
    counts = token_counts(4096)
    for n, k in ((4096, 7168), (7168, 2048), (6144, 4096)):
        chosen = {m: gemm_kernel.choose_config(sm90, GemmProblem(n, k), m) for m in counts}
        for m in range(1, 4097):
            representative = max(c for c in counts if c <= m)
            chose = gemm_kernel.choose_config(sm90, GemmProblem(n, k), m)
            assert chose == chosen[representative], (n, k, m)


def test_moe_gemm_configs_cover_every_token_count():
    """The MoE GEMMs' tiles switch between the dense representatives (the layout at ~130
    tokens, the clusters sharing B at ~4128 for DeepSeek-V3): precompiling for every count
    up to a limit still builds each tile some count gets."""
    sm90 = arch.get("sm_90a")
    every = precompile.every_token_count(sm90, 8192)
    for experts, top_k, n, k in ((256, 8, 4096, 7168), (256, 8, 7168, 2048), (8, 2, 28672, 4096)):
        moe_gemm = precompile.MoeGemm(n, k, experts, top_k)
        wanted = {moe_gemm.config(sm90, m) for m in range(1, 8193)}
        assert set(moe_gemm.configs(sm90, every)) == wanted, (experts, n, k)


def test_compile_report_prints_the_plan_without_a_gpu(tmp_path, capsys):
    model, _ = small_llama()
    path = tmp_path / "config.json"
    model.config.to_json_file(path)
    assert cli.main(["compile-report", "--model", str(path), "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "LlamaModel, 1 layer on sm_90a: 1 graph(s)" in out
    header = next(line for line in out.splitlines() if line.startswith("|"))
    assert [c.strip() for c in header.split("|")[1:-1]] == ["rewrite", "nodes", "runs on", "detail"]
    assert "7 of 7 Linears on ptxforge GEMMs; their weights: 1 MB a call" in out
    assert "silu_mul_quantize_fp8 hidden=512" in out and "e4m3 GEMM N=256 K=512 + residual" in out


def test_compile_report_lists_a_moe_blocks_kernels_by_token_count(capsys):
    """Mixtral's block at its sizes, traced on the meta device: the experts' kernels, their
    grouped GEMMs masked for a few tokens and contiguous for many."""
    pytest.importorskip("transformers")
    assert cli.main(["compile-report", "--model", "mixtral-moe"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("|")}
    assert rows["moe_routing_layout E=8"][0] == "i64_moe_routing_layout_masked_e8"
    assert rows["moe_routing_layout E=8"][2] == "i64_moe_routing_layout_contiguous_e8"
    gate_up = rows["MoE e4m3 GEMM E=8 N=28672 K=4096"]
    assert gate_up[0].endswith("_g8m_w2_r8") and "_g8_" in gate_up[2]
    assert "moe_permute_quantize_fp8 hidden=4096 topk=2" in rows
    assert "moe_combine hidden=4096 topk=2 weights f32" in rows


def cpu_llama(config_class="LlamaConfig", **extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_class)(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=128, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).eval()


def test_transformers_causal_mask_and_kv_repeat_go_to_sdpa_with_the_same_result():
    model = cpu_llama()
    ids = torch.randint(0, 128, (1, 9))
    graphs = trace_on_meta(model, ids, use_cache=False)   # real CPU tensors: checked here
    ((gm, plan),) = graphs
    (attention,) = [item for item in plan if item.rewrite == "causal attention"]
    assert attention.operator == "SDPA is_causal=True"
    (sdpa,) = [n for n in gm.graph.nodes if rewriting.kind(n) == "sdpa"]
    assert sdpa.kwargs["is_causal"] is True and "attn_mask" not in sdpa.kwargs
    assert sdpa.kwargs["enable_gqa"] is True          # keys and values not repeated
    assert [tuple(rewriting.Graph.value(x).shape[1:2]) for x in sdpa.args] == [(4,), (2,), (2,)]
    with torch.no_grad():
        expected = model(ids, use_cache=False).last_hidden_state
        torch._dynamo.reset()
        got = torch.compile(model, backend=lambda gm, ex: (compiler.rewrite(gm, ex), gm.forward)[1],
                            dynamic=True)(ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def cpu_causal_lm(hidden_size=256, num_attention_heads=4):
    """A 2-layer LlamaForCausalLM on the CPU, 2 key-value heads, SDPA, seeded weights."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=hidden_size, intermediate_size=512, num_attention_heads=num_attention_heads,
        num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _rewritten(fn, plans):
    def backend(gm, example_inputs):
        plans.append(compiler.rewrite(gm, example_inputs))
        return gm.forward
    return torch.compile(fn, backend=backend)


def test_decode_steps_over_a_static_cache_read_each_key_once():
    """A decode step's mask covers the static cache's length, so SDPA keeps it (the causal
    rewrite leaves it), and reads the keys and values unrepeated (enable_gqa). The same
    logits as eager at every step of a generate. Three tokens at once (a dynamic count,
    under a mask) keep the repeat, with the reason, and the same logits."""
    transformers = pytest.importorskip("transformers")
    model = cpu_causal_lm()
    config = model.config
    eager, plans = model.forward, []
    ids = torch.randint(0, 128, (2, 5))
    generation = transformers.GenerationConfig(
        max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static",
        pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model.generate(ids, generation_config=generation).logits
        model.forward = _rewritten(eager, plans)
        got = model.generate(ids, generation_config=generation).logits
        for step, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        three = torch.randint(0, 128, (2, 3))
        # (transformers 5.2x names it cache, earlier ones past_key_values)
        name = "cache" if "cache" in inspect.signature(eager).parameters else "past_key_values"
        logits = []
        for forward in (eager, model.forward):
            cache = transformers.StaticCache(config=config, max_cache_len=16)
            forward(input_ids=ids, **{name: cache})
            logits.append(forward(input_ids=three, **{name: cache}).logits)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    grouped = [item for plan in plans for item in plan if item.rewrite == "grouped-query attention"]
    unrepeated = [item for item in grouped if item.operator == "SDPA enable_gqa=True"]
    kept = {item.reason for item in grouped if item.operator is None}
    assert len(unrepeated) >= config.num_hidden_layers               # the decode step's
    assert kept == {"a mask over more than 64 query rows, or a dynamic count: the repeat "
                    "kept (SDPA's masked enable_gqa may fall back to math)"}


def _decode_step_graph(monkeypatch, padding=False):
    """A bf16 Llama's decode step over transformers' static cache, traced on the CPU and
    rewritten as for sm_90a, the device check let through (a copy of the graph: the CPU
    runs the traced one): (graph module, plan)."""
    transformers = pytest.importorskip("transformers")
    from ptxforge.compiler import passes

    model = cpu_causal_lm(hidden_size=512, num_attention_heads=8).bfloat16()
    config = model.config
    monkeypatch.setattr(passes, "gpu_arch", lambda x, arch_of: (hopper(x.device), None))
    graphs = []

    def spy(gm, example_inputs):
        rewritten = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        graphs.append((rewritten, compiler.rewrite(rewritten, example_inputs, fp8=False,
                                                   arch_of=hopper)))
        return gm.forward

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = transformers.StaticCache(config=config, max_cache_len=80)
    mask = {}
    if padding:
        mask = {"attention_mask": torch.ones(2, 6, dtype=torch.long)}
        mask["attention_mask"][0, :2] = 0
    torch._dynamo.reset()
    with torch.no_grad():
        prompt = {k: v[:, :5] for k, v in mask.items()}
        model(input_ids=torch.randint(0, 128, (2, 5)), **{name: cache}, **prompt)
        torch.compile(model.forward, backend=spy)(
            input_ids=torch.randint(0, 128, (2, 1)), **{name: cache}, **mask)
    return graphs[-1]


def test_a_decode_step_s_attention_becomes_the_ptxforge_kernel(monkeypatch):
    """SDPA of one token over the static cache, under a mask of the cache's length alone
    (checked a prefix at several lengths): ptxforge.attention_with_kvcache on the
    unrepeated cache, its lengths the mask's counts, computed once for both layers."""
    gm, plan = _decode_step_graph(monkeypatch)
    decode = [item for item in plan if item.rewrite == "decode attention"]
    assert [item.operator for item in decode] == ["ptxforge.attention_with_kvcache"] * 2
    calls = [node for name, node in ptxforge_calls(gm) if name == "attention_with_kvcache"]
    assert len(calls) == 2 and not [n for n in gm.graph.nodes if rewriting.kind(n) == "sdpa"]
    lengths = {call.args[3] for call in calls}
    (count,) = lengths
    assert count.target is torch.sum and count.kwargs["dtype"] is torch.int32
    for call in calls:
        q, k, v = (rewriting.Graph.value(x) for x in call.args[:3])
        assert q.shape == (2, 1, 8, 64) and k.shape == v.shape == (2, 80, 2, 64)
        assert call.kwargs["softmax_scale"] == 64 ** -0.5


def test_a_decode_step_with_a_padding_mask_keeps_sdpa(monkeypatch):
    gm, plan = _decode_step_graph(monkeypatch, padding=True)
    decode = [item for item in plan if item.rewrite == "decode attention"]
    assert len(decode) == 2 and all(item.operator is None for item in decode)
    assert decode[0].reason.startswith("the mask depends on the input")


def test_a_padding_mask_or_a_sliding_window_keeps_the_mask():
    model = cpu_llama()
    ids, padding = torch.randint(0, 128, (1, 9)), torch.ones(1, 9, dtype=torch.long)
    padding[0, :2] = 0
    ((_, plan),) = trace_on_meta(model, ids, attention_mask=padding, use_cache=False)
    (attention,) = [item for item in plan if item.rewrite == "causal attention"]
    assert attention.operator is None and attention.reason.startswith("the mask depends on the input")
    window = cpu_llama("MistralConfig", sliding_window=4)
    ((_, plan),) = trace_on_meta(window, torch.randint(0, 128, (1, 9)), use_cache=False)
    (attention,) = [item for item in plan if item.rewrite == "causal attention"]
    assert attention.operator is None


def test_a_weight_changed_in_place_after_compile_is_refused():
    weight = torch.nn.Parameter(torch.ones(4, 4))
    from ptxforge.compiler.backend import FoldedWeights

    compiled = FoldedWeights(lambda *args: "ran", [weight])
    assert compiled() == "ran"
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="compile the model again"):
        compiled()


def test_the_graph_runner_runs_the_function_itself_without_a_gpu():
    calls = []
    runner = compiler.graphs.GraphRunner(lambda *args: calls.append(args) or args[1] * 2, [1, 2])
    x = torch.ones(3)
    assert torch.equal(runner(torch.zeros(2), x, 5), x * 2) and len(calls) == 1
    assert list(runner.graphs.values()) == [None]      # this shape: no graph (no CUDA)
    # a CPU scalar (a float attribute Dynamo lifted) is part of a graph's key by value
    assert runner._key((None, x, torch.tensor(0.5))) != runner._key((None, x, torch.tensor(2.0)))


def test_the_graph_runner_keeps_the_most_recently_used_graphs(monkeypatch):
    """Past MAX_GRAPHS, the graph used longest ago goes (a generate's cache is new each
    time: its graph is never replayed after it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compiler.graphs, "MAX_GRAPHS", 2)
    runner = compiler.graphs.GraphRunner(lambda *args: args[1], [0], [1])
    replays = []
    idle = types.SimpleNamespace(replay=lambda: replays.append(1))
    monkeypatch.setattr(runner, "_capture", lambda inputs: (
        compiler.graphs._Graph(idle, [], inputs[1]), inputs[1]))
    x, caches = torch.ones(2), [torch.zeros(3) for _ in range(3)]
    runner(x, caches[0])
    runner(x, caches[1])
    runner(x, caches[0])                  # replayed: now the most recently used
    runner(x, caches[2])
    assert replays == [1]
    assert [key[1][0][0] for key in runner.graphs] == [caches[0].data_ptr(),
                                                        caches[2].data_ptr()]


def test_the_graph_runners_pool_goes_with_its_last_graph(monkeypatch):
    """The graphs share a memory pool, which goes when the last of them does: the next
    capture makes a new one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compiler.graphs, "MAX_GRAPHS", 1)
    monkeypatch.setattr(compiler.graphs, "MAX_COPY_BYTES", 64)
    runner, made = compiler.graphs.GraphRunner(lambda *args: args[0], [0]), []

    def capture(inputs):
        runner.pool = runner.pool or f"pool {len(made)}"
        made.append(inputs[0])
        return compiler.graphs._Graph(types.SimpleNamespace(replay=None), [], inputs[0]), inputs[0]

    monkeypatch.setattr(runner, "_capture", capture)
    runner(torch.ones(2))
    assert runner.pool == "pool 0"
    runner(torch.ones(64))                   # too large for a graph; the only graph goes
    assert list(runner.graphs.values()) == [None] and runner.pool is None
    runner(torch.ones(3))
    assert runner.pool == "pool 1" and len(made) == 2


def test_a_graph_is_for_the_tensors_it_holds_in_place():
    """A static input other than a parameter (transformers' static KV cache, which
    mark_static_address leaves unguarded and generate makes anew) may be another tensor at
    the next call: a graph replayed then would read and write the earlier one."""
    runner = compiler.graphs.GraphRunner(lambda *args: args[0], [0], [1])
    x, cache = torch.ones(2), torch.zeros(4, 8)
    assert runner._key((x, cache)) == runner._key((x.clone(), cache))
    assert runner._key((x, cache)) != runner._key((x, torch.zeros(4, 8)))
    assert runner._key((x, cache)) != runner._key((x, cache[:2]))


def test_the_backend_holds_buffers_and_marked_tensors_in_place_by_address(monkeypatch):
    """mode="reduce-overhead": the inputs copied into a graph are the ones that change;
    a marked static tensor (and a buffer) is read in place, its address part of the key;
    parameters are neither."""
    made = []

    class Recording(compiler.graphs.GraphRunner):
        def __init__(self, fn, changing, held=()):
            super().__init__(fn, changing, held)
            made.append(self)

    monkeypatch.setattr(compiler.graphs, "GraphRunner", Recording)

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.cache = torch.zeros(4, 8)
            torch._dynamo.mark_static_address(self.cache)

        def forward(self, x, position):
            self.cache.index_copy_(0, position, self.proj(x))
            return self.cache.sum(0)

    model = Cached()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=compiler.backend, mode="reduce-overhead")
    with torch.no_grad():
        compiled(torch.ones(1, 8), torch.tensor([1]))
    (runner,) = made
    assert len(runner.changing) == 2 and len(runner.held) == 1


def test_precompile_assembles_what_a_model_needs(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path))
    assert cli.main(["precompile", "--model", "ffn", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FFN 7168/2048: ")
    count = int(out.split(": ", 1)[1].split(" kernels")[0])
    # the two row kernels, and each GEMM's configs for the counts that stand for 1..64
    sm90 = arch.get("sm_90a")
    every = precompile.every_token_count(sm90, 64)
    gemms = [precompile.Gemm(GemmProblem(4096, 7168)),
             precompile.Gemm(GemmProblem(7168, 2048, epilogue=("residual",)))]
    assert count == 2 + sum(len(g.configs(sm90, every)) for g in gemms)


def test_a_model_holding_fp8_weights_keeps_them_and_gets_its_fusions():
    """Fp8Linear's weights are taken as they are (no second quantization: no constants of
    the pass's own), and the norm before it and the residual after it still fuse."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(256)
            self.proj = compiler.Fp8Linear(torch.empty(256, 256, dtype=torch.float8_e4m3fn),
                                           torch.empty(2, 2))

        def forward(self, x):
            return x + self.proj(self.norm(x))

    with torch.device("meta"):
        model = Block().to(torch.bfloat16)    # (buffers keep their dtypes: e4m3, f32)
        x = torch.empty(8, 256, dtype=torch.bfloat16)
    ((gm, plan),) = trace_on_meta(model, x)
    assert (model.proj.weight.dtype, model.proj.weight_scale.dtype) == (torch.float8_e4m3fn,
                                                                        torch.float32)
    assert [name for name, _ in ptxforge_calls(gm)] == ["rms_norm_fp8", "fp8_linear"]
    _, linear = ptxforge_calls(gm)[1]
    assert linear.kwargs["residual"].op == "placeholder"
    assert not [name for name, _ in gm.named_buffers() if name.startswith("_ptxforge")]
    assert [item.rewrite for item in plan] == ["fp8 linear of the model", "rms_norm -> fp8",
                                               "residual add"]


def test_the_backend_is_found_by_name_without_importing_ptxforge():
    """An installed ptxforge is a torch_dynamo_backends entry point; from a source tree,
    importing ptxforge.compiler registers the name."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    if not any(ep.name == "ptxforge" for ep in entry_points(group="torch_dynamo_backends")):
        assert torch._dynamo.lookup_backend("ptxforge") is compiler.backend
        return
    code = ("import sys, torch; fn = torch._dynamo.lookup_backend('ptxforge'); "
            "print(fn.__module__, 'ptxforge' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ptxforge.compiler.backend", "True"]
    assert torch._dynamo.lookup_backend("ptxforge") is compiler.backend


def test_token_dims_are_every_dimension_but_features_and_ones():
    assert compiler.token_dims(torch.empty(64, 7168)) == [0]
    assert compiler.token_dims(torch.empty(1, 64, 4096, dtype=torch.bfloat16)) == [1]
    assert compiler.token_dims(torch.empty(1, 64, dtype=torch.long)) == [1]
    assert compiler.token_dims(torch.empty(4, 64, dtype=torch.long)) == [0, 1]
    assert compiler.token_dims(torch.empty(1, 4096)) == []


@pytest.mark.parametrize("as_module", [True, False])
def test_compile_traces_the_token_dimension_alone_dynamic_once(monkeypatch, as_module):
    """ptxforge.compile marks the first call's token dimensions dynamic (not the features):
    one graph serves every token count, its hidden size a constant."""
    import importlib

    backend_module = importlib.import_module("ptxforge.compiler.backend")
    graphs = []

    def spy(gm, example_inputs, **options):
        values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append([tuple(v.shape) for v in values if isinstance(v, torch.Tensor)])
        return gm.forward

    monkeypatch.setattr(backend_module, "backend", spy)
    model = torch.nn.Linear(32, 16)
    torch._dynamo.reset()
    compiled = compiler.compile(model if as_module else (lambda x: model(x)))
    with torch.no_grad():
        for tokens in (8, 24, 5):
            x = torch.randn(tokens, 32)
            assert torch.equal(compiled(x), model(x))
    (shapes,) = graphs                    # one graph: no recompile
    (x_shape,) = [shape for shape in shapes if shape not in ((16, 32), (16,))]  # not W, b
    assert isinstance(x_shape[0], torch.SymInt) and x_shape[1] == 32
    if as_module:      # the marking hook removed itself after the first call
        assert not compiled._forward_pre_hooks


SMALL_MOE = {"deepseek_v3": dict(hidden_size=512, moe_intermediate_size=256,
                                  n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                  topk_group=2, intermediate_size=1024),
             "mixtral": dict(hidden_size=512, intermediate_size=256)}


def moe_block(kind, experts_implementation="grouped_mm", device="meta"):
    """A small transformers MoE block on ``device`` and its hidden states [1, 8, H]."""
    pytest.importorskip("transformers")
    case = models.moe_block(kind.replace("_", "-") + "-moe", device=device,
                            experts_implementation=experts_implementation, **SMALL_MOE[kind])
    (x,), _ = case.inputs(8, device)
    return case.model, x


@pytest.mark.parametrize("kind", ["deepseek_v3", "mixtral"])
def test_a_moe_blocks_experts_become_one_operator(kind):
    model, x = moe_block(kind)
    ((gm, plan),) = trace_on_meta(model, x)
    (moe,) = [item for item in plan if item.rewrite == "moe experts"]
    assert moe.operator == "ptxforge.moe_experts_fp8" and "top-" in moe.reason
    calls = ptxforge_calls(gm)
    (experts,) = [node for name, node in calls if name == "moe_experts_fp8"]
    hidden, index, weights, w13, s13, w2, s2 = experts.args
    assert index.meta["example_value"].dtype == torch.int64
    assert weights.meta["example_value"].dtype == torch.float32 or kind == "mixtral"
    experts_count = 16 if kind == "deepseek_v3" else 8
    inner = 256
    for node, shape in ((w13, (experts_count, 2 * inner, 512)), (s13, (experts_count, 4, 4)),
                        (w2, (experts_count, 512, inner)), (s2, (experts_count, 4, 2))):
        assert node.op == "get_attr" and tuple(getattr(gm, node.target).shape) == shape
    grouped = [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert grouped == []   # transformers' grouped GEMMs, sort and weighted sum are gone
    assert not any(n.op == "call_function" and n.target is torch.sort for n in gm.graph.nodes)
    names = [name for name, _ in calls]
    # In-place methods whose result goes unused survive the passes' dead-code elimination
    # (DeepSeek-V3's group-limited routing writes its group mask with scatter_).
    scatters = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "scatter_"]
    assert len(scatters) == (kind == "deepseek_v3")
    if kind == "deepseek_v3":   # the shared expert: the FFN's kernels, the experts' sum its residual
        assert names[-3:] == ["fp8_linear", "silu_mul_fp8", "fp8_linear"]
        assert calls[-1][1].kwargs["residual"].args[0] is experts
        # The router's f32 Linear of bf16 casts: the bf16 GEMM accumulating into f32, on the
        # bf16 values themselves (the casts are gone).
        (router,) = [node for name, node in calls if name == "bf16_linear_f32"]
        x, w = router.args
        assert x.meta["example_value"].dtype == w.meta["example_value"].dtype == torch.bfloat16
        assert w.op == "placeholder" and "gate" in w.name
        assert not any(n.op == "call_method" and n.target == "type" for n in gm.graph.nodes)
    else:   # Mixtral's router is a bf16 Linear [8, H]: kept, FP8 scores would re-route tokens
        assert names == ["moe_experts_fp8"]
        (router,) = [item for item in plan if item.rewrite == "linear"]
        assert router.operator is None and "router" in router.reason


def test_moe_experts_left_to_inductor_say_why():
    model, x = moe_block("mixtral")
    ((_, plan),) = trace_on_meta(model, x, fp8=False)
    (moe,) = [item for item in plan if item.rewrite == "moe experts"]
    assert moe.operator is None and "FP8" in moe.reason



def test_moe_sizes_the_kernels_do_not_take_are_left_with_the_reason():
    pytest.importorskip("transformers")
    for experts, hidden, inner, reason in (
            (1100, 512, 256, "num_experts must be in [1, 1024], got 1100"),
            (8, 520, 256, "the GEMM needs N a positive multiple of 8 and K of 16"),
            (8, 512, 192, "need 2I and H multiples of 256 and 128, got 2I=384, H=512")):
        case = models.moe_block("mixtral-moe", device="meta", hidden_size=hidden,
                                intermediate_size=inner, num_local_experts=experts)
        ((gm, plan),) = trace_on_meta(case.model, *case.inputs(8, "meta")[0])
        (moe,) = [item for item in plan if item.rewrite == "moe experts"]
        assert moe.operator is None and reason in moe.reason
        assert any("grouped_mm" in str(n.target) for n in gm.graph.nodes)   # left as it was


def test_compiling_a_model_whose_experts_loop_warns(caplog):
    """transformers' per-expert loop breaks the graph at every expert: no graph holds the
    experts for the pass, and ptxforge.compile says so, naming them."""
    model, x = moe_block("mixtral", experts_implementation="eager", device="cpu")
    with caplog.at_level("WARNING", logger="ptxforge.compiler"):
        compiler.compile(model)
    assert "experts of experts to Inductor" in caplog.text
    assert "experts_implementation='grouped_mm'" in caplog.text
    # The loop's data-dependent steps run between its graphs: none reads the expert weights.
    for gm, plan in trace_on_meta(model, x):
        assert not any("gate_up_proj" in n.name for n in gm.graph.nodes)
    grouped, _ = moe_block("mixtral")
    assert compiler.moe.looping_experts(grouped) == []


def _generating_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False,
                              cache_implementation="static")
    return transformers, model, ids, expected


def _recording(monkeypatch) -> list:
    """Every graph ptxforge's backend compiles from now on, by its first tensor input's
    shape (a dynamic dimension as its symbol's name)."""
    backend_module = sys.modules["ptxforge.compiler.backend"]
    original, graphs = backend_module.backend, []

    def recorded(gm, example_inputs, **options):
        first = next(x for x in example_inputs if isinstance(x, torch.Tensor))
        graphs.append(tuple(str(d) for d in first.shape))
        return original(gm, example_inputs, **options)

    monkeypatch.setattr(backend_module, "backend", recorded)
    # backend="ptxforge" resolves through Dynamo's registry, which keeps what it found.
    from torch._dynamo.backends.registry import _COMPILER_FNS

    monkeypatch.setitem(_COMPILER_FNS, "ptxforge", recorded)
    torch._dynamo.reset()
    return graphs


def _generate_compiled(transformers, model, ids, backend: str):
    """model.generate with a static cache and transformers' own compile of the decode step
    with ``backend`` (transformers makes it on a GPU; ``_compile_all_devices`` here)."""
    from transformers.generation.configuration_utils import CompileConfig

    compile_config = CompileConfig(backend=backend, fullgraph=False)
    compile_config._compile_all_devices = True
    return model.generate(ids, generation_config=transformers.GenerationConfig(
        max_new_tokens=6, do_sample=False, cache_implementation="static",
        compile_config=compile_config))


def test_generate_with_a_forward_ptxforge_compiled_runs_its_graphs(monkeypatch):
    """model.forward = ptxforge.compile(model.forward), transformers' documented recipe:
    generate's own compile of the decode step used to trace through the wrapper (and
    failed on its maybe_mark_dynamic); now the decode steps call the compiled forward,
    whose ptxforge graphs (the prompt, then one token) give eager's tokens."""
    transformers, model, ids, expected = _generating_llama()
    graphs = _recording(monkeypatch)
    model.forward = compiler.compile(model.forward)
    assert torch.equal(_generate_compiled(transformers, model, ids, "inductor"), expected)
    assert graphs[1:] == [("1", "1")] and len(graphs) == 2   # the prompt's, a token's


def test_generate_with_ptxforge_as_transformers_compile_backend(monkeypatch):
    """generation_config.compile_config with backend="ptxforge": transformers compiles the
    decode step with ptxforge's backend, eager's tokens."""
    transformers, model, ids, expected = _generating_llama()
    graphs = _recording(monkeypatch)
    assert torch.equal(_generate_compiled(transformers, model, ids, "ptxforge"), expected)
    assert graphs == [("1", "1")]


def test_generate_with_a_dynamic_cache_and_a_forward_ptxforge_compiled(monkeypatch):
    """The default (dynamic) cache, which transformers does not compile itself: the
    compiled forward gives eager's tokens, with three graphs for 12 new tokens (the
    prompt, a first step, and once the cache grows its length dynamic), not one a step."""
    transformers, model, ids, _ = _generating_llama()
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    graphs = _recording(monkeypatch)
    model.forward = compiler.compile(model.forward)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), expected)
    assert len(graphs) == 3
