"""ptxforge.ep's decode path (``Buffer.low_latency_dispatch`` / ``low_latency_combine``)
across processes: against the torch references (tests/support/ep_reference.py) built
from every rank's inputs, bitwise; rounds in a row on a buffer never cleared, with and
without the receive hook; the same calls captured in a CUDA graph and replayed on new
inputs; a peer that never launches ends in the device timeout, named on the host. The harness (spawned
processes, gathers, bitwise checks, MPS on one GPU) is test_ep_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ptxforge.ep import Buffer
from support import ep_reference as reference

from test_ep_gpu import _assert_bitwise, _gather, rank_0_times_out, run_two_ranks

pytestmark = pytest.mark.gpu

KERNEL_TIMEOUT_S = 20.0
MAX_TOKENS, HIDDEN, EXPERTS, TOPK = 64, 1024, 8, 4


def _buffer(world: int, timeout_s: float = KERNEL_TIMEOUT_S) -> Buffer:
    size = Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, world, EXPERTS)
    return Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, timeout_s=timeout_s)


def _inputs(rank: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(11 + 1000 * seed + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    return x, idx.long(), torch.rand(idx.shape, generator=g)


def scenario_rounds(rank: int, world: int) -> None:
    """Six dispatch/combine rounds with new inputs (the third, fourth and sixth through the
    receive hooks; the last two with the weights sent by the dispatch and the combine
    summed on the experts' ranks), each against the references."""
    buffer = _buffer(world)
    dev = torch.device("cuda", buffer.device_index)
    for seed, tokens in enumerate((MAX_TOKENS, 17, 1, 40, 33, MAX_TOKENS)):
        hooked, summed = seed in (2, 3, 5), seed >= 4
        x, idx, weights = _inputs(rank, tokens, seed)
        idx, weights = idx.to(dev), weights.to(dev)
        (recv_x, recv_scales), recv_count, handle, _, hook = buffer.low_latency_dispatch(
            x.to(dev), idx, MAX_TOKENS, EXPERTS, return_recv_hook=hooked,
            topk_weights=weights if summed else None)
        if hooked:
            hook()
        inputs = (x, idx.cpu(), weights.cpu())
        y = _check_dispatch(rank, seed, inputs, recv_x, recv_scales, recv_count, handle)
        combined, _, hook = buffer.low_latency_combine(y, idx, weights, handle,
                                                       return_recv_hook=hooked)
        if hooked:
            hook()
        _check_combine(rank, seed, inputs, y, combined, summed)
    torch.cuda.synchronize()
    buffer.destroy()


def _check_dispatch(rank, seed, inputs, recv_x, recv_scales, recv_count, handle):
    """The received rows, scales, counts and sources against the reference from every
    rank's inputs; returns the experts' outputs (bf16, a function of the rows and rank)."""
    everyone = _gather(inputs)
    expected = reference.low_latency_dispatch(rank, [e[0] for e in everyone],
                                              [e[1] for e in everyone], EXPERTS, MAX_TOKENS)
    assert recv_count.cpu().tolist() == expected["count"].tolist()
    for local, n in enumerate(expected["count"].tolist()):
        for name, got in (("x", recv_x), ("scales", recv_scales), ("src_info", handle.src_info)):
            _assert_bitwise(got[local, :n], expected[name][local, :n],
                            f"round {seed}: expert {local}'s {name}")
    scales = recv_scales.repeat_interleave(128, 2)
    return (recv_x.float() * scales * 0.5 + rank).bfloat16()


def _check_combine(rank, seed, inputs, y, combined, summed=False):
    everyone = _gather(inputs)
    ys = _gather(y.cpu())
    combine = reference.low_latency_combine_summed if summed else reference.low_latency_combine
    _assert_bitwise(combined, combine(rank, ys, [e[1] for e in everyone],
                                      [e[2] for e in everyone], EXPERTS),
                    f"round {seed}: combined rows{' (summed)' if summed else ''}")


def scenario_graph(rank: int, world: int) -> None:
    """Dispatch, the experts (a bf16 function of the rows) and combine captured in one CUDA
    graph, replayed on new inputs copied into its static ones: each replay against the
    references. Nothing in the calls waits for the host, so replays need no resetting."""
    buffer = _buffer(world)
    dev = torch.device("cuda", buffer.device_index)
    tokens = 48
    x, idx, weights = (t.to(dev) for t in _inputs(rank, tokens, 10))

    def step():
        (recv_x, recv_scales), recv_count, handle, _, _ = buffer.low_latency_dispatch(
            x, idx, MAX_TOKENS, EXPERTS)
        y = (recv_x.float() * recv_scales.repeat_interleave(128, 2) * 0.5 + rank).bfloat16()
        combined, _, _ = buffer.low_latency_combine(y, idx, weights, handle)
        return recv_x, recv_scales, recv_count, handle, y, combined

    step()  # every kernel built and loaded before the capture
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for seed in (11, 12, 13):
        inputs = _inputs(rank, tokens, seed)
        for static, new in zip((x, idx, weights), inputs):
            static.copy_(new)
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        recv_x, recv_scales, recv_count, handle, y, combined = outputs
        expected_y = _check_dispatch(rank, seed, inputs, recv_x, recv_scales, recv_count, handle)
        _assert_bitwise(y, expected_y, f"replay {seed}: the experts' outputs")
        _check_combine(rank, seed, inputs, y, combined)
    buffer.destroy()


def scenario_ranks_disagree(rank: int, world: int) -> None:
    """Ranks whose decode sizes differ (rank 1's rows twice as wide) raise the same
    ValueError before any kernel runs; the buffer then still works."""
    buffer = _buffer(world)
    dev = torch.device("cuda", buffer.device_index)
    x, idx, weights = (t.to(dev) for t in _inputs(rank, 16, 20))
    wide = torch.cat([x, x], 1) if rank else x[:, :HIDDEN // 2].contiguous()
    with pytest.raises(ValueError, match=f"disagree on the dispatch: hidden: rank 0 has "
                                         f"{HIDDEN // 2}, rank 1 has {2 * HIDDEN}"):
        buffer.low_latency_dispatch(wide, idx, MAX_TOKENS, EXPERTS)
    (recv_x, recv_scales), recv_count, handle, _, _ = buffer.low_latency_dispatch(
        x, idx, MAX_TOKENS, EXPERTS)
    y = _check_dispatch(rank, 20, (x.cpu(), idx.cpu(), weights.cpu()), recv_x, recv_scales,
                        recv_count, handle)
    combined, _, _ = buffer.low_latency_combine(y, idx, weights, handle)
    _check_combine(rank, 20, (x.cpu(), idx.cpu(), weights.cpu()), y, combined)
    torch.cuda.synchronize()
    buffer.destroy()


def scenario_peer_never_launches(rank: int, world: int) -> None:
    """After a round together, rank 1 stops: rank 0's next dispatch receiver times out,
    writes its record and traps."""
    buffer = _buffer(world, timeout_s=2.0)
    dev = torch.device("cuda", buffer.device_index)
    x, idx, weights = (t.to(dev) for t in _inputs(rank, 8, 0))
    # One round together: the first call with these sizes checks them with the peer.
    (recv_x, _), _, handle, _, _ = buffer.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS)
    buffer.low_latency_combine(torch.zeros(recv_x.shape, dtype=torch.bfloat16, device=dev),
                               idx, weights, handle)
    torch.cuda.synchronize()
    dist.barrier()
    rank_0_times_out(rank, buffer, lambda: buffer.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS),
                     r"low-latency dispatch kernel waited more than 2.0 s for tokens from rank 1 "
                     r"for local expert")


@pytest.mark.parametrize("scenario", [scenario_rounds, scenario_graph, scenario_ranks_disagree,
                                      scenario_peer_never_launches],
                         ids=["rounds", "graph", "ranks_disagree", "peer_never_launches"])
def test_two_processes(scenario, monkeypatch):
    run_two_ranks(scenario, monkeypatch)
