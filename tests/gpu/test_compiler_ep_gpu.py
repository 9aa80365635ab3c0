"""``ptxforge.compile(model, ep_group=group)`` across processes: a small transformers
DeepSeek-V3 MoE block (16 experts, top-4, one shared expert, weights N(0, 0.02)) compiled
on each of two ranks, each holding 8 of its experts, against the same block run on the
rank's GPU uncompiled in bf16 (calc_diff <= 5e-3), the same bits run to run, the ranks
calling with different token counts; on the normal path (the default) and on the decode
path in CUDA graphs (mode="reduce-overhead"). And the graph runner running the model once
a call, which keeps the ranks' calls paired.

The harness is test_ep_gpu.py's: two spawned processes on a GPU each, or on one GPU under
MPS (``bash bench/device_run.sh ep`` starts the daemon), else skipped."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from ptxforge import compiler, models
from ptxforge.compiler import expert_parallel, graphs
from ptxforge.testing.checks import calc_diff

from test_ep_gpu import run_two_ranks

pytestmark = pytest.mark.gpu

HIDDEN = 512
SIZES = dict(hidden_size=HIDDEN, moe_intermediate_size=256, n_routed_experts=16,
             num_experts_per_tok=4, n_group=4, topk_group=2, intermediate_size=1024)
# Tokens each rank sends, call by call (every call is collective: the same number of calls
# on every rank, the counts their own).
NORMAL_TOKENS = {0: (64, 300, 5, 1), 1: (200, 7, 129, 64)}
DECODE_TOKENS = {0: (8, 100, 8, 1), 1: (3, 128, 3, 40)}


class _Plans(logging.Handler):
    """The plan lines the backend logs (logger ptxforge.compiler)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _block():
    """The block, the same on every rank (drawn on the CPU from one seed), on this rank's
    GPU."""
    torch.manual_seed(0)
    model = models.moe_block("deepseek-v3-moe", device="cpu", **SIZES).model
    return model.to(torch.device("cuda", torch.cuda.current_device()))


def _compiled_against_the_block(rank: int, tokens: dict, **options) -> None:
    model = _block()
    plans = _Plans()
    logger = logging.getLogger("ptxforge.compiler")
    logger.addHandler(plans)
    logger.setLevel(logging.INFO)
    torch._dynamo.reset()
    compiled = compiler.compile(model, ep_group=dist.group.WORLD, **options)
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for count in tokens[rank]:
            x = torch.randn(1, count, HIDDEN, generator=g).bfloat16().cuda()
            got = compiled(x)
            expected = model(x)                 # the uncompiled block, bf16, on this GPU
            assert calc_diff(got, expected) <= 5e-3, (count, calc_diff(got, expected))
            again = compiled(x)
            assert torch.equal(got, again), f"{count} tokens: not the same bits run to run"
    taken = [line for line in plans.lines if line.startswith("moe experts")]
    assert taken and all("-> ptxforge.moe_experts_fp8_ep" in line for line in taken), taken
    assert f"experts [{8 * rank}, {8 * rank + 8}) of 16 on rank {rank} of 2" in taken[0]
    (buffer,) = [expert_parallel.BUFFERS[key] for key in expert_parallel.BUFFERS]
    assert buffer.group_size == 2
    buffer.destroy()


def scenario_normal_path(rank: int, world: int) -> None:
    _compiled_against_the_block(rank, NORMAL_TOKENS)


def scenario_decode_path_in_cuda_graphs(rank: int, world: int) -> None:
    _compiled_against_the_block(rank, DECODE_TOKENS, mode="reduce-overhead")


@pytest.mark.parametrize("scenario", [scenario_normal_path, scenario_decode_path_in_cuda_graphs],
                         ids=["normal", "decode_graphs"])
def test_a_deepseek_v3_block_compiled_over_two_ranks(scenario, monkeypatch):
    pytest.importorskip("transformers")
    run_two_ranks(scenario, monkeypatch)


def test_the_graph_runner_runs_the_model_once_a_call():
    """A new shape: the warm-up runs, the capture runs nothing, and the call returns the
    warm-up's outputs; a known shape: one replay."""
    runs = torch.zeros((), dtype=torch.int64, device="cuda")

    def model(x):
        runs.add_(1)
        return x * 2

    runner = graphs.GraphRunner(model, [0])
    for count, expected_runs in ((8, 1), (8, 2), (5, 3), (8, 4), (5, 5)):
        x = torch.randn(count, device="cuda")
        assert torch.equal(runner(x), x * 2)
        assert int(runs) == expected_runs
    assert all(entry is not None for entry in runner.graphs.values())
