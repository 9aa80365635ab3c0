"""ptxforge.ep across processes: get_dispatch_layout, dispatch and combine (with and without
top-k weights) against the torch references (tests/support/ep_reference.py) built from
every rank's inputs, gathered over the group; bitwise where the recipe is exact, the same
bits run to run; errors that every rank raises instead of hanging; a peer that never
launches ends in the device timeout.

Two processes (``gloo`` rendezvous: NCCL refuses two ranks on one GPU): on cuda:0 and
cuda:1 when two GPUs are visible; both on cuda:0 when one is, under MPS (the ranks'
kernels wait for each other, so they must be resident together, as on two GPUs; without
MPS the two contexts only take turns; ``bash bench/device_run.sh ep`` starts the MPS
daemon). Each scenario spawns its processes and fails with their tracebacks, or after
TIMEOUT_S (``PTXFORGE_EP_TEST_TIMEOUT_S``) with the ranks that did not finish. Under
torchrun on a multi-GPU machine:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=src:tests torchrun --nproc-per-node 2 tests/gpu/test_ep_gpu.py
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from ptxforge.bench.ranks import NO_MULTICAST, mps_running
from ptxforge.ep import Buffer, Config, EPTimeoutError, buffer_size
from ptxforge.testing.reference import quantize_fp8_per_token
from support import ep_reference as reference
from support import spawned

pytestmark = pytest.mark.gpu

WORLD = 2
TIMEOUT_S = float(os.environ.get("PTXFORGE_EP_TEST_TIMEOUT_S", 300))  # a scenario, JIT included
KERNEL_TIMEOUT_S = 20.0  # the buffers' device-side time limit (two processes share a GPU)
EXPERTS, TOPK = 16, 4   # at 4 ranks still TOPK experts a rank


# ---------------------------------------------------------------------------- process harness
_results = None  # the queue a spawned rank reports on


def _report(rank: int, error) -> None:
    """Put the rank's report and wait until it has left the process."""
    _results.put((rank, error))
    _results.close()
    _results.join_thread()


def _report_and_exit(rank: int) -> None:
    """For a rank whose kernel trapped as the scenario meant: report success and leave at
    once. Freeing a tensor used on two streams then makes torch record an event in the
    dead context, which throws from a destructor and aborts the process."""
    _report(rank, None)
    os._exit(0)


def _worker(rank: int, world: int, init_file: str, scenario: str, results) -> None:
    global _results
    _results = results
    try:
        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        # A rank stuck in CUDA leaves its peer in a collective: 60 s, not gloo's 30 minutes,
        # so the peer reports it within the scenario's deadline.
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        (SCENARIOS[scenario] if isinstance(scenario, str) else scenario)(rank, world)
        _report(rank, None)
    except BaseException:
        _report(rank, traceback.format_exc())


def run_spawned(scenario, world: int = WORLD) -> None:
    """Run ``scenario`` (a name in SCENARIOS, or a module-level function of (rank, world)
    that another test file passes) in ``world`` spawned processes."""
    spawned.run(_worker, scenario, world, timeout_s=TIMEOUT_S)


def _gather(obj) -> list:
    """Every rank's ``obj`` (a tensor, a tuple of them, or plain data), tensors on the CPU.
    e4m3 tensors travel as their bytes: the unpickler of torch 2.11 has no float8 storage."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, _packed(obj))
    return [_unpacked(o) for o in out]


def _packed(obj):
    if isinstance(obj, tuple):
        return tuple(_packed(o) for o in obj)
    if isinstance(obj, torch.Tensor):
        return ("tensor", _bits(obj), str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
    return obj


def _unpacked(obj):
    if isinstance(obj, tuple) and obj[:1] == ("tensor",):
        _, data, dtype, shape = obj
        return data.view(getattr(torch, dtype)).view(shape)
    if isinstance(obj, tuple):
        return tuple(_unpacked(o) for o in obj)
    return obj


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bitwise comparisons."""
    return t.contiguous().view(torch.uint8).cpu()


def _assert_bitwise(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, (
        f"{what}: got {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} "
        f"{expected.dtype}")
    differ = (_bits(got) != _bits(expected)).view(got.shape[0], -1).any(1) if got.numel() else []
    bad = torch.nonzero(torch.as_tensor(differ)).flatten().tolist()
    assert not bad, f"{what}: rows {bad[:10]} differ (of {got.shape[0]})"


# ---------------------------------------------------------------------------- routings
def _routing(rank: int, tokens: int, kind: str, seed: int) -> torch.Tensor:
    """int64 [tokens, TOPK] expert indices (-1: none) of one rank of the group."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    world = dist.get_world_size()
    if not tokens:
        return torch.empty((0, TOPK), dtype=torch.int64)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
    if kind == "random":
        idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    elif kind == "some_ranks_left_out":
        # Token t: experts on rank t % world only, every third token on none at all.
        local = torch.stack([torch.randperm(EXPERTS // world, generator=g)[:TOPK]
                             for _ in range(tokens)])
        idx = local + (torch.arange(tokens) % world).unsqueeze(1) * (EXPERTS // world)
        idx[::3] = -1
    elif kind == "all_to_rank_0":
        idx = torch.stack([torch.randperm(EXPERTS // world, generator=g)[:TOPK]
                           for _ in range(tokens)])
    return idx.to(torch.int64)


def _inputs(rank: int, tokens: int, hidden: int, kind: str, seed: int, fp8: bool):
    g = torch.Generator().manual_seed(7 + 1000 * seed + rank)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = _routing(rank, tokens, kind, seed)
    weights = torch.rand(idx.shape, generator=g)
    scales = None
    if fp8:
        x, scales = quantize_fp8_per_token(x)
    return x, scales, idx, weights


def _dispatch_case(buffer: Buffer, rank: int, *, tokens: int, hidden: int, kind: str,
                   seed: int, fp8: bool = False, config: Config | None = None) -> None:
    """One routing: layout, dispatch, cached dispatch, combine (twice), each against the
    references from every rank's inputs."""
    x, scales, idx, weights = _inputs(rank, tokens, hidden, kind, seed, fp8)
    dev = torch.device("cuda", torch.cuda.current_device())
    x_dev, idx_dev, w_dev = x.to(dev), idx.to(dev), weights.to(dev)
    # Column-major scales, as quantize_fp8_per_token's mn_major layout gives them.
    x_arg = (x_dev, scales.t().contiguous().t().to(dev)) if fp8 else x_dev
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx_dev, EXPERTS)
    ref_rank, ref_expert, ref_in_rank = reference.dispatch_layout(idx, EXPERTS,
                                                                  dist.get_world_size())
    assert per_rank.cpu().tolist() == ref_rank.tolist(), (per_rank, ref_rank)
    assert per_expert.cpu().tolist() == ref_expert.tolist(), (per_expert, ref_expert)
    assert torch.equal(in_rank.cpu(), ref_in_rank)

    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x_arg, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx_dev, topk_weights=w_dev, config=config)
    everyone = _gather((x, scales, idx, weights))
    expected = reference.dispatch(rank, [e[0] for e in everyone], [e[2] for e in everyone],
                                  [e[3] for e in everyone], EXPERTS,
                                  [e[1] for e in everyone] if fp8 else None)
    rows = recv_x[0] if fp8 else recv_x
    _assert_bitwise(rows, expected["x"], f"{kind}: received rows")
    if fp8:
        _assert_bitwise(recv_x[1], expected["scales"], f"{kind}: received scales")
    _assert_bitwise(recv_idx, expected["topk_idx"], f"{kind}: local top-k indices")
    _assert_bitwise(recv_w, expected["topk_weights"], f"{kind}: top-k weights")
    _assert_bitwise(handle.recv_src_idx, expected["src_idx"], f"{kind}: source token indices")
    assert counts == expected["per_expert"], (counts, expected["per_expert"])

    again = buffer.dispatch(x_arg, handle=handle, config=config)
    _assert_bitwise(again[0][0] if fp8 else again[0], rows, f"{kind}: cached dispatch rows")
    assert again[1] is None and again[2] is None

    # The experts: each received row times the sum of its local weights, in bf16.
    y = (rows.float() * recv_w.sum(1, keepdim=True)).bfloat16()
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, config=config)
    valid = (idx >= 0) & (idx < EXPERTS)
    # Each valid expert lives on one rank, the others send 0: the sum is the weight itself.
    _assert_bitwise(combined_w, torch.where(valid, weights, 0.0), f"{kind}: combined weights")
    _assert_bitwise(combined, reference.combine(rank, _gather(y.cpu()), [e[2] for e in everyone],
                                                EXPERTS),
                    f"{kind}: combined rows (f32 sum in rank order)")
    repeat, none, _ = buffer.combine(y, handle, config=config)
    assert none is None
    _assert_bitwise(repeat, combined, f"{kind}: combine run to run")
    # Against the weighted sum in f32: bf16 rounding of each rank's part and of the sum.
    weighted = x.float() * torch.where(valid, weights, 0.0).sum(1, keepdim=True)
    torch.testing.assert_close(combined.cpu().float(), weighted, rtol=2 ** -6, atol=1e-2)


# ---------------------------------------------------------------------------- scenarios
def scenario_routings(rank: int, world: int) -> None:
    small = Config(num_sms=4, ring_slots=64)
    buffer = Buffer(dist.group.WORLD, buffer_size(world, 512, TOPK), timeout_s=KERNEL_TIMEOUT_S)
    _dispatch_case(buffer, rank, tokens=96 - 20 * rank, hidden=256, kind="random", seed=0,
                   config=small)
    _dispatch_case(buffer, rank, tokens=50, hidden=512, kind="some_ranks_left_out", seed=1)
    _dispatch_case(buffer, rank, tokens=40 + rank, hidden=256, kind="all_to_rank_0", seed=2,
                   config=small)
    _dispatch_case(buffer, rank, tokens=77, hidden=256, kind="random", seed=3, fp8=True,
                   config=small)
    # 700 tokens through one channel's 64-entry rings: each ring wraps about 5 times.
    _dispatch_case(buffer, rank, tokens=700, hidden=128, kind="random", seed=4,
                   config=Config(num_sms=2, ring_slots=64))
    _dispatch_case(buffer, rank, tokens=0 if rank else 30, hidden=256, kind="random", seed=5,
                   config=small)
    buffer.destroy()


def scenario_direct(rank: int, world: int) -> None:
    """On a buffer with room for the worst case: the direct dispatch's rows, scales, top-k
    and source tokens as the reference (then top-k -1 up to the worst case), and the pull
    combine of combine_input(handle) bitwise as the reference and as the ring combine of
    the same rows, twice with other rows; routings with a rank that receives nothing and
    a rank that sends nothing; then a dispatch through the rings on the same buffer."""
    hidden, worst = 256, world * 100
    roomy = Buffer(dist.group.WORLD, buffer_size(world, hidden, TOPK, fp8=True,
                                                 num_worst_tokens=worst),
                   timeout_s=KERNEL_TIMEOUT_S)
    dev = torch.device("cuda", torch.cuda.current_device())
    for kind, tokens, seed in (("random", 100 - 25 * rank, 10), ("all_to_rank_0", 60, 11),
                               ("random", 0 if rank else 90, 12)):
        x, scales, idx, weights = _inputs(rank, tokens, hidden, kind, seed, True)
        idx_dev = idx.to(dev)
        per_rank, _, per_expert, in_rank, _ = roomy.get_dispatch_layout(idx_dev, EXPERTS)
        (rows, row_scales), recv_idx, recv_w, _, handle, _ = roomy.dispatch(
            (x.to(dev), scales.t().contiguous().t().to(dev)), num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx_dev,
            topk_weights=weights.to(dev), num_worst_tokens=worst, config=Config(num_sms=4))
        assert handle.direct is not None, "a buffer with room takes the direct dispatch"
        everyone = _gather((x, scales, idx, weights))
        expected = reference.dispatch(rank, [e[0] for e in everyone], [e[2] for e in everyone],
                                      [e[3] for e in everyone], EXPERTS,
                                      [e[1] for e in everyone])
        n = int(handle.num_recv)
        what = f"direct, {kind}, {tokens} tokens"
        _assert_bitwise(rows[:n], expected["x"], f"{what}: received rows")
        _assert_bitwise(row_scales[:n], expected["scales"], f"{what}: received scales")
        _assert_bitwise(recv_idx[:n], expected["topk_idx"], f"{what}: local top-k")
        _assert_bitwise(recv_w[:n], expected["topk_weights"], f"{what}: top-k weights")
        assert (recv_idx[n:] == -1).all() and (recv_w[n:] == 0).all(), what
        for scale in (0.5, -3.0):
            # Rewritten before its next dispatch: safe here, as the ring combine below
            # ends after every rank's pull of the first rows.
            y = (rows[:n].float() * scale + rank).bfloat16()
            pulled = roomy.combine_input(handle)
            pulled[:n] = y
            combined, none, _ = roomy.combine(pulled, handle, config=Config(num_sms=4))
            assert none is None
            _assert_bitwise(combined, reference.combine(rank, _gather(y.cpu()),
                                                        [e[2] for e in everyone], EXPERTS),
                            f"{what}: pull combine (f32 sum in rank order)")
            through_rings, _, _ = roomy.combine(pulled.clone(), handle, config=Config(num_sms=4))
            _assert_bitwise(through_rings, combined, f"{what}: ring combine of the same rows")
    _dispatch_case(roomy, rank, tokens=50, hidden=hidden, kind="random", seed=13, fp8=True,
                   config=Config(num_sms=4))
    roomy.destroy()


def scenario_errors(rank: int, world: int) -> None:
    """Disagreements and bad indices raise the same error on every rank, and leave the
    buffer usable; a buffer too small is refused before the dispatch launches (after the
    count exchange: where ranks disagree on the rows' width, only some would find their
    rows too wide, so every rank names the disagreement first)."""
    buffer = Buffer(dist.group.WORLD, buffer_size(world, 512, TOPK, config=Config(4, 64)),
                    num_sms=4, timeout_s=KERNEL_TIMEOUT_S)
    dev = torch.device("cuda", torch.cuda.current_device())

    def dispatch(hidden, idx):
        x = torch.zeros(len(idx), hidden, dtype=torch.bfloat16, device=dev)
        idx = idx.to(dev)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, EXPERTS)
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=idx,
                               topk_weights=torch.ones(idx.shape, device=dev),
                               config=Config(4, 64))

    idx = _routing(rank, 20, "random", 9)
    with pytest.raises(ValueError, match="disagree.*hidden: rank 0 has 256, rank 1 has 512"):
        dispatch(256 * (rank + 1), idx)
    bad = idx.clone()
    if rank == 1:
        bad[3, 1] = EXPERTS + 5
    with pytest.raises(ValueError, match=rf"\[-1, {EXPERTS}\); out of range \(rank 1: 1\)"):
        dispatch(256, bad)
    with pytest.raises(ValueError, match="too small for a dispatch of 7168-wide rows"):
        dispatch(7168, idx)
    recv_x, *_ = dispatch(256, idx)  # still works
    everyone = _gather(idx)
    assert recv_x.shape[0] == sum(int(reference.dispatch_layout(i, EXPERTS, world)[2][:, rank]
                                      .sum()) for i in everyone)
    buffer.destroy()


def _dispatched_together(rank: int, world: int, seed: int):
    """A buffer with a 2 s time limit, and a first dispatch of 16 tokens a rank that every
    rank completes: ``(buffer, x, handle)``."""
    buffer = Buffer(dist.group.WORLD, buffer_size(world, 256, TOPK, config=Config(4, 64)),
                    num_sms=4, timeout_s=2.0)
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(16, 256, device=dev).bfloat16()
    idx = _routing(rank, 16, "random", seed).to(dev)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, EXPERTS)
    _, _, _, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=torch.ones(16, TOPK, device=dev), config=Config(4, 64))
    torch.cuda.synchronize()
    dist.barrier()
    return buffer, x, handle


def scenario_peer_never_launches(rank: int, world: int) -> None:
    """Rank 1 stops taking part after the first dispatch; rank 0's next dispatch waits for
    its tokens until the device timeout, traps, and the host names the wait."""
    buffer, x, handle = _dispatched_together(rank, world, 11)
    rank_0_times_out(rank, buffer, lambda: buffer.dispatch(x, handle=handle, config=Config(4, 64)),
                     r"dispatch kernel waited more than 2.0 s .* tokens from rank 1")


def scenario_peer_dies(rank: int, world: int) -> None:
    """Rank 1 exits after the first dispatch; rank 0's next dispatch waits for it until the
    device timeout, traps, and the host names the wait: an error within a minute, not a
    hang."""
    buffer, x, handle = _dispatched_together(rank, world, 13)
    if rank == 1:
        _report_and_exit(rank)
    time.sleep(3)  # rank 1 is gone; its buffer's mapping here outlives it
    rank_0_times_out(rank, buffer, lambda: buffer.dispatch(x, handle=handle, config=Config(4, 64)),
                     r"dispatch kernel waited more than 2.0 s .* rank 1", peer_waits=False)


def rank_0_times_out(rank: int, buffer: Buffer, launch, message: str, *,
                     peer_waits: bool = True) -> None:
    """Rank 0 launches a kernel that waits for rank 1, which launches nothing: it stays
    alive in a barrier (``peer_waits``) or is gone. The kernel traps within a minute and
    the host names the wait (``message``, a regex); then rank 0 reports and leaves (its
    context is dead)."""
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            launch()
            torch.cuda.synchronize()
        assert time.monotonic() - start < 60
        with pytest.raises(EPTimeoutError, match=message):
            buffer.check_timeout()
    if peer_waits:
        dist.barrier()
    if rank == 0:
        _report_and_exit(rank)


def scenario_cached_call_disagrees(rank: int, world: int) -> None:
    """A call reusing a handle exchanges nothing, and the host checks it against the handle
    alone: rank 1 lays its rings out for 128 entries where rank 0 keeps 64. The receivers
    find entries signed for other sizes (or, where a peer trapped first, wait until the
    timeout); no rank hangs, and at least one names the disagreement."""
    buffer = Buffer(dist.group.WORLD, buffer_size(world, 256, TOPK, config=Config(4, 128)),
                    num_sms=4, timeout_s=5.0)
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = _routing(rank, 24, "random", 12).to(dev)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, EXPERTS)
    x = torch.randn(24, 256, device=dev).bfloat16()
    _, _, _, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=torch.ones(24, TOPK, device=dev), config=Config(4, 64))
    torch.cuda.synchronize()
    dist.barrier()
    with pytest.raises(RuntimeError):
        buffer.dispatch(x, handle=handle, config=Config(4, 64 * (rank + 1)))
        torch.cuda.synchronize()
    with pytest.raises(EPTimeoutError) as error:
        buffer.check_timeout()
    messages = _gather(str(error.value))
    assert any("laid out for other sizes" in m for m in messages), messages
    _report_and_exit(rank)


SCENARIOS = {"routings": scenario_routings, "direct": scenario_direct,
             "errors": scenario_errors,
             "peer_never_launches": scenario_peer_never_launches,
             "peer_dies": scenario_peer_dies,
             "cached_call_disagrees": scenario_cached_call_disagrees}


def run_two_ranks(scenario, monkeypatch) -> None:
    """A scenario over two processes: a GPU each, or one GPU under MPS (else skipped);
    NVLink multicast off in both."""
    if torch.cuda.device_count() < 2 and not mps_running():
        pytest.skip("two ranks on one GPU need MPS (bash bench/device_run.sh ep starts it)")
    for name, value in NO_MULTICAST.items():
        monkeypatch.setenv(name, value)
    run_spawned(scenario)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_processes(scenario, monkeypatch):
    run_two_ranks(scenario, monkeypatch)


def main() -> int:
    """torchrun entry: every scenario of both paths but the ones that end in a trap, on
    the launcher's group."""
    import test_ep_low_latency_gpu as low_latency

    return run_torchrun({"routings": SCENARIOS["routings"], "direct": SCENARIOS["direct"],
                         "errors": SCENARIOS["errors"],
                         "low_latency_rounds": low_latency.scenario_rounds,
                         "low_latency_graph": low_latency.scenario_graph,
                         "low_latency_ranks_disagree": low_latency.scenario_ranks_disagree})


def run_torchrun(scenarios: dict) -> int:
    """Each of ``scenarios`` (name: scenario) on the launcher's group, in order, NVLink
    multicast off; each rank prints what passed."""
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    for name, scenario in scenarios.items():
        scenario(rank, world)
        print(f"rank {rank}: {name} passed", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
