"""ptxforge.ep.low_latency across processes: dispatch and combine against the torch
references (ptxforge.testing.ep) built from every rank's inputs, bitwise; rounds in a row
on a buffer never cleared, with and without the receive hook; a peer that never launches
ends in the device timeout's record. The harness (spawned processes, gathers, bitwise
checks) is test_ep_gpu.py's; the buffer is a ``Buffer``'s memory, sized by
``low_latency.buffer_size``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ptxforge.ep import Buffer, low_latency
from ptxforge.kernels.ep_intranode import common as codes
from ptxforge.testing import ep as reference

from test_ep_gpu import NO_MULTICAST, _assert_bitwise, _gather, run_spawned

pytestmark = pytest.mark.gpu

KERNEL_TIMEOUT_S = 20.0
MAX_TOKENS, HIDDEN, EXPERTS, TOPK = 64, 1024, 8, 4


def _group(world: int) -> tuple[Buffer, low_latency.Group]:
    size = low_latency.buffer_size(MAX_TOKENS, HIDDEN, world, EXPERTS)
    buffer = Buffer(dist.group.WORLD, size, timeout_s=KERNEL_TIMEOUT_S)
    return buffer, low_latency.Group(buffer.rank, buffer.group_size, buffer.peers,
                                     buffer.record.device_pointer, int(KERNEL_TIMEOUT_S * 1e9),
                                     buffer.device_index, buffer.arch, buffer.num_nvl_bytes)


def _inputs(rank: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(11 + 1000 * seed + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    return x, idx.long(), torch.rand(idx.shape, generator=g)


def scenario_rounds(rank: int, world: int) -> None:
    """Four dispatch/combine rounds with new inputs (the last two through the receive
    hooks), each against the references, the combine run twice per dispatch's rows."""
    buffer, group = _group(world)
    dev = torch.device("cuda", buffer.device_index)
    for seed, tokens in enumerate((MAX_TOKENS, 17, 1, 40)):
        hooked = seed >= 2
        x, idx, weights = _inputs(rank, tokens, seed)
        (recv_x, recv_scales), recv_count, handle, hook = low_latency.dispatch(
            group, x.to(dev), idx.to(dev), num_max_dispatch_tokens_per_rank=MAX_TOKENS,
            num_experts=EXPERTS, return_recv_hook=hooked)
        if hooked:
            hook()
        everyone = _gather((x, idx, weights))
        expected = reference.low_latency_dispatch(rank, [e[0] for e in everyone],
                                                  [e[1] for e in everyone], EXPERTS, MAX_TOKENS)
        assert recv_count.cpu().tolist() == expected["count"].tolist()
        for local, n in enumerate(expected["count"].tolist()):
            for name, got in (("x", recv_x), ("scales", recv_scales),
                              ("src_info", handle.src_info)):
                _assert_bitwise(got[local, :n], expected[name][local, :n],
                                f"round {seed}: expert {local}'s {name}")
        scales = recv_scales.repeat_interleave(128, 2)
        y = (recv_x.float() * scales * 0.5 + rank).bfloat16()
        combined, hook = low_latency.combine(group, y, idx.to(dev), weights.to(dev), handle,
                                             return_recv_hook=hooked)
        if hooked:
            hook()
        ys = _gather(y.cpu())
        _assert_bitwise(combined, reference.low_latency_combine(
            rank, ys, [e[1] for e in everyone], [e[2] for e in everyone], EXPERTS),
            f"round {seed}: combined rows")
    torch.cuda.synchronize()
    buffer.destroy()


def scenario_peer_never_launches(rank: int, world: int) -> None:
    """Rank 1 creates its buffer and stops: rank 0's dispatch receiver times out, writes
    its record and traps."""
    buffer, group = _group(world)
    if rank == 0:
        x, idx, _ = _inputs(rank, 8, 0)
        dev = torch.device("cuda", buffer.device_index)
        low_latency.dispatch(group, x.to(dev), idx.to(dev),
                             num_max_dispatch_tokens_per_rank=MAX_TOKENS, num_experts=EXPERTS)
        with pytest.raises(RuntimeError):
            torch.cuda.synchronize()
        code, _, peer, _ = buffer.record.read()
        assert (code, peer) == (codes.LL_DISPATCH_RECEIVE, 1)
    dist.barrier()


@pytest.mark.parametrize("scenario", [scenario_rounds, scenario_peer_never_launches],
                         ids=["rounds", "peer_never_launches"])
def test_two_processes(scenario, monkeypatch):
    for name, value in NO_MULTICAST.items():
        monkeypatch.setenv(name, value)
    run_spawned(scenario)
