"""``ptxforge.compile(model, ep_group=group)`` on the CPU: small transformers MoE blocks
(DeepSeek-V3, Mixtral, Qwen3-MoE) on the meta device, compiled on each of two ranks of a
gloo group (spawned processes) with the backend's passes for sm_90a and a stand-in for
the ptxforge.ep Buffer (which needs GPUs): each rank's graph holds the expert-parallel
operator with that rank's experts, quantized from its slice alone, and the buffer's key;
the router and the shared expert are what the one-GPU passes make of them; one buffer per
compile, sized for the blocks. The errors, one line each; a group of one rank takes the
one-GPU pass."""

from __future__ import annotations

import datetime
import functools
import importlib
import traceback

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

from ptxforge import arch, compiler, models  # noqa: E402
from ptxforge.compiler import expert_parallel  # noqa: E402
from ptxforge.ep import Buffer, buffer_size  # noqa: E402
from support import spawned  # noqa: E402

backend_module = importlib.import_module("ptxforge.compiler.backend")

TIMEOUT_S = 300
HIDDEN, INNER = 512, 256
BLOCKS = {   # kind -> (config entries, experts, top-k)
    "deepseek_v3": (dict(hidden_size=HIDDEN, moe_intermediate_size=INNER, n_routed_experts=16,
                         num_experts_per_tok=4, n_group=4, topk_group=2, intermediate_size=1024),
                    16, 4),
    "mixtral": (dict(hidden_size=HIDDEN, intermediate_size=INNER), 8, 2),
    "qwen3_moe": (dict(hidden_size=HIDDEN, moe_intermediate_size=INNER, num_experts=16,
                       num_experts_per_tok=4), 16, 4),
}


def moe_block(kind: str, experts_implementation: str = "grouped_mm", **sizes):
    """A small transformers MoE block on the meta device and its hidden states [1, 8, H]."""
    entries = {**BLOCKS[kind][0], **sizes}
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**entries)
        config._experts_implementation = experts_implementation
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
        with torch.device("meta"):
            model = block(config).to(torch.bfloat16).eval()
    else:
        model = models.moe_block(kind.replace("_", "-") + "-moe", device="meta",
                                 experts_implementation=experts_implementation,
                                 **entries).model
    return model, torch.empty(1, 8, HIDDEN, dtype=torch.bfloat16, device="meta")


class StandInBuffer:
    """What ``expert_parallel`` makes a ptxforge.ep.Buffer with, recorded (the Buffer
    itself maps GPU memory)."""
    made: list = []
    get_low_latency_rdma_size_hint = staticmethod(Buffer.get_low_latency_rdma_size_hint)

    def __init__(self, group, num_nvl_bytes, num_rdma_bytes=0, low_latency_mode=False):
        self.made.append((group, num_nvl_bytes, num_rdma_bytes, low_latency_mode))


def compiled_on_meta(model, x, **options):
    """``compiler.compile(model, **options)`` called on x, the backend's passes run for
    sm_90a (not Inductor: the graph runs as rewritten, on the meta device): [(graph module,
    plan)]."""
    graphs = []

    def spy(gm, example_inputs, *, fp8, precompile, ep, **inductor):
        graphs.append((gm, compiler.rewrite(gm, example_inputs, fp8=fp8, ep=ep,
                                            arch_of=lambda device: arch.get("sm_90a"))))
        return gm.forward

    backend_module.backend, real = spy, backend_module.backend
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiler.compile(model, **options)(x)
    finally:
        backend_module.backend = real
    return graphs


def calls(gm) -> list:
    """(operator name, node) of every ptxforge operator in the graph, in order."""
    return [(str(n.target).split(".")[1], n) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("ptxforge.")]


# ---------------------------------------------------------------------------- two ranks
def _worker(rank: int, world: int, init_file: str, scenario, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        scenario(rank, world)
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def run_ranks(scenario, world: int = 2) -> None:
    """``scenario(rank, world)`` (a function of this module) in ``world`` spawned processes
    on a gloo group; fails with their tracebacks."""
    spawned.run(_worker, scenario, world, timeout_s=TIMEOUT_S)


def scenario_each_rank_holds_its_experts(rank: int, world: int) -> None:
    import ptxforge.ep

    expert_parallel.Buffer = StandInBuffer
    sliced = []
    real_shard = ptxforge.ep.shard_experts

    def shard_experts(gate_up, down, r, ranks):
        sliced.append((gate_up, down, r, ranks))
        return real_shard(gate_up, down, r, ranks)

    ptxforge.ep.shard_experts = shard_experts
    for kind, (_, experts, top_k) in BLOCKS.items():
        model, x = moe_block(kind)
        ((gm, plan),) = compiled_on_meta(model, x, ep_group=dist.group.WORLD)
        # One buffer for the compiled model, sized for its block's normal path.
        assert StandInBuffer.made == [(dist.group.WORLD, buffer_size(world, HIDDEN, top_k,
                                                                     fp8=True), 0, False)]
        StandInBuffer.made.clear()
        key = max(expert_parallel.BUFFERS)
        assert isinstance(expert_parallel.BUFFERS[key], StandInBuffer)
        # The module's full weights went to the slicing, and this rank's slice alone was
        # quantized into the graph.
        ((gate_up, down, r, ranks),) = sliced
        sliced.clear()
        assert (r, ranks) == (rank, world)
        assert gate_up is model.experts.gate_up_proj and down is model.experts.down_proj
        (moe,) = [item for item in plan if item.rewrite == "moe experts"]
        local = experts // world
        assert moe.operator == "ptxforge.moe_experts_fp8_ep", moe.reason
        assert moe.reason.startswith(f"experts [{rank * local}, {(rank + 1) * local}) of "
                                     f"{experts} on rank {rank} of {world}, top-{top_k}")
        assert moe.reason.endswith("(ptxforge.ep: the normal path)")
        found = calls(gm)
        assert [name for name, _ in found].count("moe_experts_fp8_ep") == 1
        assert "moe_experts_fp8" not in [name for name, _ in found]
        (op,) = [node for name, node in found if name == "moe_experts_fp8_ep"]
        hidden, index, weights, w13, s13, w2, s2, buffer, layout = op.args
        assert (buffer, layout) == (key, "contiguous")
        assert index.meta["example_value"].shape[-1] == top_k
        assert index.meta["example_value"].dtype == torch.int64
        for node, shape in ((w13, (local, 2 * INNER, HIDDEN)), (s13, (local, 4, 4)),
                            (w2, (local, HIDDEN, INNER)), (s2, (local, 4, 2))):
            assert node.op == "get_attr" and tuple(getattr(gm, node.target).shape) == shape
        assert getattr(gm, w13.target).dtype == torch.float8_e4m3fn
        assert not [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
        # The router and the shared expert: as the one-GPU passes leave them, whole.
        names = [name for name, _ in found]
        if kind == "deepseek_v3":
            (router,) = [node for name, node in found if name == "bf16_linear_f32"]
            assert tuple(router.args[1].meta["example_value"].shape) == (experts, HIDDEN)
            assert names[-3:] == ["fp8_linear", "silu_mul_fp8", "fp8_linear"]
            assert found[-1][1].kwargs["residual"].args[0] is op
            shared_inner = model.shared_experts.down_proj.weight.shape[1]
            gate_up_linear, _, down_linear = (node for _, node in found[-3:])
            assert tuple(gate_up_linear.args[2].meta["example_value"].shape) == (
                2 * shared_inner, HIDDEN)       # gate and up joined: the whole weights
            assert tuple(down_linear.args[2].meta["example_value"].shape) == (
                HIDDEN, shared_inner)
        else:
            assert names == ["moe_experts_fp8_ep"]
            (router,) = [item for item in plan if item.rewrite == "linear"]
            assert router.operator is None and "router" in router.reason
    # CUDA graphs: the decode path, its buffer alone, for DECODE_TOKENS tokens a rank.
    model, x = moe_block("deepseek_v3")
    ((gm, plan),) = compiled_on_meta(model, x, ep_group=dist.group.WORLD, mode="reduce-overhead")
    size = Buffer.get_low_latency_rdma_size_hint(expert_parallel.DECODE_TOKENS, HIDDEN, world, 16)
    assert StandInBuffer.made == [(dist.group.WORLD, 0, size, True)]
    StandInBuffer.made.clear()
    (op,) = [node for name, node in calls(gm) if name == "moe_experts_fp8_ep"]
    assert op.args[-2:] == (max(expert_parallel.BUFFERS), "masked")
    assert [item.reason for item in plan if item.rewrite == "moe experts"][0].endswith(
        "(ptxforge.ep: the decode path)")
    # E not divisible by the ranks: said on every rank, before any buffer.
    model, _ = moe_block("mixtral", num_local_experts=3)
    with pytest.raises(ValueError, match=r"^ep_group: the 3 experts of experts do not divide "
                                         r"over the group's 2 ranks$"):
        compiler.compile(model, ep_group=dist.group.WORLD)
    assert not StandInBuffer.made


def test_each_rank_compiles_its_experts_onto_the_expert_parallel_layer():
    run_ranks(scenario_each_rank_holds_its_experts)


# ---------------------------------------------------------------------------- one process
@pytest.fixture
def one_rank_group(tmp_path):
    """The default group, of this process alone (gloo)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_ep_group_must_be_a_process_group():
    model, _ = moe_block("mixtral")
    for group, got in (("nccl", "str"), (1, "int")):
        with pytest.raises(TypeError, match=rf"^ep_group must be a torch.distributed "
                                            rf"ProcessGroup .*, got {got}$"):
            compiler.compile(model, ep_group=group)


def test_what_ep_group_cannot_shard_is_one_line(one_rank_group):
    cases = [(torch.nn.Linear(8, 8), "ep_group: Linear has no experts module to shard"),
             (moe_block("mixtral", experts_implementation="eager")[0],
              "ep_group: the experts of experts run transformers' per-expert loop"),
             (functools.partial(torch.relu), "ep_group needs model to be a torch.nn.Module")]
    for model, message in cases:
        with pytest.raises((TypeError, ValueError), match="^" + message) as error:
            compiler.compile(model, ep_group=one_rank_group)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="^ep_group needs fp8=True"):
        compiler.compile(moe_block("mixtral")[0], ep_group=one_rank_group, fp8=False)


def test_a_group_of_one_rank_runs_the_experts_whole(one_rank_group, monkeypatch):
    monkeypatch.setattr(expert_parallel, "Buffer", StandInBuffer)
    model, x = moe_block("deepseek_v3")
    ((gm, plan),) = compiled_on_meta(model, x, ep_group=one_rank_group)
    assert not StandInBuffer.made
    (moe,) = [item for item in plan if item.rewrite == "moe experts"]
    assert moe.operator == "ptxforge.moe_experts_fp8"
    (op,) = [node for name, node in calls(gm) if name == "moe_experts_fp8"]
    assert tuple(getattr(gm, op.args[3].target).shape) == (16, 2 * INNER, HIDDEN)


def test_aot_autograd_keeps_the_operator_one_node_with_the_buffer_s_key():
    """What Inductor gets (AOTAutograd traces the rewritten graph again): the operator as
    one node, its buffer a constant int, the token count symbolic; Dynamo's graph whole."""
    from torch._dynamo.backends.common import aot_autograd

    model, x = moe_block("qwen3_moe")
    ep = expert_parallel.ExpertParallel(rank=1, ranks=2, buffer=7, layout="masked")
    traced = []

    def spy(gm, example_inputs):
        compiler.rewrite(gm, example_inputs, arch_of=lambda device: arch.get("sm_90a"), ep=ep)
        record = lambda graph, inputs: traced.append(graph) or graph.forward
        return aot_autograd(fw_compiler=record)(gm, example_inputs)

    torch._dynamo.reset()
    compiler.mark_token_dims((x,), {})
    with torch.no_grad():
        torch.compile(model, backend=spy, fullgraph=True)(x)
    (graph,) = traced
    (op,) = [n for n in graph.graph.nodes
             if n.target is torch.ops.ptxforge.moe_experts_fp8_ep.default]
    assert op.args[-2:] == (7, "masked")
    tokens = op.args[0].meta["val"].shape[0]
    assert isinstance(tokens, torch.SymInt)
    assert tuple(op.args[3].meta["val"].shape) == (8, 2 * INNER, HIDDEN)
