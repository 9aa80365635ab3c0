"""The MoE layer across GPUs (``ptxforge.moe_experts_fp8(..., ep=buffer)``) over two spawned
ranks, each holding half the experts (``shard_experts``), against the same block run on
ONE GPU: the one-GPU op with every expert on the rank's own tokens, and the bf16 experts
in fp64 (test_moe_gpu.py's reference). Both paths; uniform routing, dropped pairs and
out-of-range indices, every token to rank 0's experts, a rank with no tokens; the same
bits run to run; the decode path captured in a CUDA graph and replayed on new inputs;
a DeepSeek-V3-shaped block (H = 7168, I = 2048, 256 experts, top-8, 256 tokens a rank).

Against the one-GPU op: the FP8 recipe is the same (each token quantized once per token,
the same GEMMs and SwiGLU). Both paths round each rank's part of a token to bf16 before the
sum over ranks (the decode path's dispatch sends the weights, so each experts' rank sums
its pairs), where the one-GPU combine sums all k rows in f32. Both are held to calc_diff
<= 1e-5 against it, and each comparison prints its numbers (``-s`` shows them):
calc_diff, the largest difference, the rows that differ.

The harness (spawned processes, gloo, MPS on one GPU) is test_ep_gpu.py's:

    PYTHONPATH=src:tests python -m pytest -q -s tests/gpu/test_ep_layer_gpu.py

or under torchrun, a GPU a rank (2 or more ranks; the experts must split evenly):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=src:tests torchrun --nproc-per-node 2 tests/gpu/test_ep_layer_gpu.py
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import ptxforge
from ptxforge.ep import Buffer, buffer_size, decode_capacity, shard_experts
from ptxforge.testing.checks import calc_diff

from test_ep_gpu import _assert_bitwise, run_torchrun, run_two_ranks
from test_moe_gpu import quantized, reference

pytestmark = pytest.mark.gpu

KERNEL_TIMEOUT_S = 60.0
HIDDEN, INNER, EXPERTS, TOPK = 512, 256, 16, 4
DECODE_TOKENS = 32                   # the low-latency buffer's tokens a rank
DIRECT_BOUND = 200                   # the tokens a rank the buffer holds received rows for
BF16_LIMIT = 5e-3                    # calc_diff against the bf16 block in fp64
ONE_GPU_LIMIT = 1e-5                 # calc_diff against the one-GPU op


# ---------------------------------------------------------------------------- inputs
def _block(experts: int, hidden: int, inner: int, seed: int = 1):
    """The block's bf16 experts, N(0, 0.02), the same on every rank; drawn an expert at a
    time (DeepSeek-V3's block in f32 would take 45 GB)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights = []
    for shape in ((2 * inner, hidden), (hidden, inner)):
        w = torch.empty((experts, *shape), dtype=torch.bfloat16, device="cuda")
        for e in range(experts):
            w[e] = torch.randn(shape, device="cuda", generator=g) * 0.02
        weights.append(w)
    return tuple(weights)


def _tokens(rank: int, tokens: int, experts: int, top_k: int, kind: str, seed: int,
            hidden: int = HIDDEN):
    """A rank's x [T, H], top-k indices (distinct, router-like) and softmax-like f32
    weights. ``kind``: 'uniform'; 'dropped' (a fifth of the pairs -1, a tenth out of range);
    'rank0' (every token's experts on rank 0)."""
    g = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    if kind == "rank0":
        scores[:, experts // dist.get_world_size():] = -1.0
    weights, idx = scores.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    if kind == "dropped":
        drop = torch.rand(idx.shape, device="cuda", generator=g)
        idx = torch.where(drop < 0.2, -1, idx)
        idx = torch.where((drop >= 0.2) & (drop < 0.3), experts + 3, idx)
    return x, idx.contiguous(), weights


class _Layer:
    """One rank's view of a block: the full experts quantized (for the one-GPU op), the
    rank's shard of them, the bf16 weights (for the reference; None where the caller
    computed it and let them go), and a buffer with both the normal mode's room and the
    decode path's."""

    def __init__(self, rank: int, world: int, *, experts=EXPERTS, hidden=HIDDEN, inner=INNER,
                 top_k=TOPK, decode_tokens=DECODE_TOKENS, full=None):
        self.bf16 = None if full else _block(experts, hidden, inner)
        self.full = full or tuple(quantized(w) for w in self.bf16)
        self.shard = shard_experts(*self.full, rank, world)
        self.experts, self.hidden, self.top_k = experts, hidden, top_k
        self.buffer = Buffer(
            dist.group.WORLD, buffer_size(world, hidden, top_k, fp8=True,
                                          num_worst_tokens=world * DIRECT_BOUND),
            Buffer.get_low_latency_rdma_size_hint(decode_tokens, hidden, world, experts),
            low_latency_mode=True, timeout_s=KERNEL_TIMEOUT_S)
        assert decode_capacity(self.buffer, hidden, experts) == decode_tokens

    def __call__(self, x, idx, weights, layout=None, bound=None):
        return ptxforge.moe_experts_fp8(x, idx, weights, *self.shard, layout=layout,
                                        ep=self.buffer, max_tokens_per_rank=bound)

    def check(self, what: str, rank: int, x, idx, weights, layout=None, *, fp64=None):
        """The layer on this rank's tokens, twice (the same bits), against the one-GPU op
        and the fp64 reference (``fp64`` where given); prints the comparison."""
        out = self(x, idx, weights, layout)
        again = self(x, idx, weights, layout)
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            self.buffer.check_timeout()  # a kernel that trapped on a wait names the wait
            raise
        _assert_bitwise(again, out, f"{what}: run to run")
        assert out.shape == x.shape and out.dtype == torch.bfloat16, (out.shape, out.dtype)
        if not x.shape[0]:
            print(f"rank {rank}: {what}: no tokens, none back", flush=True)
            return out
        if fp64 is None:
            fp64 = reference(x, idx, weights, *self.bf16)
        compare(what, rank, out, ptxforge.moe_experts_fp8(x, idx, weights, *self.full), fp64)
        return out

    def destroy(self):
        torch.cuda.synchronize()
        self.buffer.destroy()


def compare(what: str, rank: int, out, one_gpu, fp64) -> None:
    """The layer's ``out`` against the one-GPU op's and the bf16 block's in fp64."""
    to_bf16 = calc_diff(out, fp64)
    to_one = calc_diff(out, one_gpu)
    differ = int((out.view(torch.int16) != one_gpu.view(torch.int16)).any(1).sum())
    largest = float((out.float() - one_gpu.float()).abs().max())
    print(f"rank {rank}: {what}: calc_diff vs bf16 (fp64) {to_bf16:.2e} (one-GPU op "
          f"{calc_diff(one_gpu, fp64):.2e}); vs the one-GPU op {to_one:.2e}, largest "
          f"difference {largest:.3g}, {differ} of {out.shape[0]} rows differ", flush=True)
    assert to_bf16 <= BF16_LIMIT, (what, to_bf16)
    assert to_one <= ONE_GPU_LIMIT, (what, to_one)


def check_replays(rank: int, layer: _Layer, tokens: int, seed: int, what: str, captured,
                  eager) -> None:
    """``captured(x, idx, weights)`` on static inputs in a CUDA graph, after one call outside
    it (every kernel built, the sizes agreed before capture); replays on three new routings
    copied into the inputs give ``eager``'s bits on them."""
    x, idx, weights = _tokens(rank, tokens, EXPERTS, TOPK, "uniform", seed)
    captured(x, idx, weights)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = captured(x, idx, weights)
    for new_seed, kind in enumerate(("uniform", "dropped", "rank0"), seed + 1):
        new = _tokens(rank, tokens, EXPERTS, TOPK, kind, new_seed)
        for static, value in zip((x, idx, weights), new):
            static.copy_(value)
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        replayed = static_out.clone()
        expected = eager(*new)
        torch.cuda.synchronize()
        _assert_bitwise(replayed, expected, f"{what} replay {new_seed} ({kind}): against the "
                                            f"eager call")
        compare(f"{what} replay, {kind}", rank, replayed,
                ptxforge.moe_experts_fp8(*new, *layer.full), reference(*new, *layer.bf16))


# ---------------------------------------------------------------------------- scenarios
def scenario_normal(rank: int, world: int) -> None:
    """The normal path (T above the decode capacity, or layout='contiguous'): uneven
    token counts, dropped pairs, every token to rank 0's experts, a rank with none."""
    layer = _Layer(rank, world)
    for seed, (tokens, kind) in enumerate(((200 - 40 * rank, "uniform"),
                                           (150, "dropped"), (96 + rank, "rank0"))):
        x, idx, weights = _tokens(rank, tokens, EXPERTS, TOPK, kind, seed)
        layer.check(f"normal, {kind}, {tokens} tokens", rank, x, idx, weights)
    # A rank with no tokens. Every rank names the path: with layout=None rank 1's 0 tokens
    # would fit the decode path and rank 0's 120 would not.
    x, idx, weights = _tokens(rank, 0 if rank else 120, EXPERTS, TOPK, "uniform", 7)
    layer.check("normal, rank 1 sends nothing", rank, x, idx, weights, "contiguous")
    # bf16 top-k weights, as a bf16 router gives them.
    x, idx, weights = _tokens(rank, 77, EXPERTS, TOPK, "uniform", 8)
    layer.check("normal, bf16 weights", rank, x, idx, weights.bfloat16())
    layer.destroy()


def scenario_decode(rank: int, world: int) -> None:
    """The decode path (T within the capacity): the same routings, and the normal path on
    the same buffer between two decode calls."""
    layer = _Layer(rank, world)
    for seed, (tokens, kind) in enumerate(((DECODE_TOKENS, "uniform"), (17 + rank, "dropped"),
                                           (DECODE_TOKENS - rank, "rank0"),
                                           (0 if rank else 9, "uniform"))):
        x, idx, weights = _tokens(rank, tokens, EXPERTS, TOPK, kind, 20 + seed)
        layer.check(f"decode, {kind}, {tokens} tokens", rank, x, idx, weights)
    # The normal path on the same tokens, named by layout, and the decode path again after it.
    x, idx, weights = _tokens(rank, 24, EXPERTS, TOPK, "uniform", 30)
    normal = layer.check("normal (layout='contiguous') at 24 tokens", rank, x, idx, weights,
                         "contiguous")
    decode = layer.check("decode after normal", rank, x, idx, weights)
    torch.testing.assert_close(normal, decode, rtol=2 ** -7, atol=2 ** -8 * float(
        decode.abs().max()))
    layer.destroy()


def scenario_graph(rank: int, world: int) -> None:
    """The decode path captured in a CUDA graph: replays on new tokens and routings copied
    into the static inputs give the eager call's bits."""
    layer = _Layer(rank, world)
    check_replays(rank, layer, 24, 40, "graph", layer, layer)
    layer.destroy()


def scenario_deepseek(rank: int, world: int) -> None:
    """DeepSeek-V3's routed experts (H = 7168, I = 2048, 256 experts, top-8), 256 tokens a
    rank, both paths."""
    hidden, inner, experts, top_k, tokens = 7168, 2048, 256, 8, 256
    x, idx, weights = _tokens(rank, tokens, experts, top_k, "uniform", 50, hidden)
    # The bf16 block is 22.5 GB: one rank at a time holds it (two ranks may share a GPU),
    # computes its reference and keeps the FP8 block (11.3 GB).
    for turn in range(world):
        if turn == rank:
            bf16 = _block(experts, hidden, inner)
            fp64 = reference(x, idx, weights, *bf16)
            full = tuple(quantized(w) for w in bf16)
            del bf16
            torch.cuda.empty_cache()
        dist.barrier()
    layer = _Layer(rank, world, experts=experts, hidden=hidden, inner=inner, top_k=top_k,
                   decode_tokens=tokens, full=full)
    decode = layer.check("DeepSeek-V3 shape, decode", rank, x, idx, weights, "masked",
                         fp64=fp64)
    normal = layer.check("DeepSeek-V3 shape, normal", rank, x, idx, weights, "contiguous",
                         fp64=fp64)
    assert calc_diff(normal, decode) <= ONE_GPU_LIMIT
    layer.destroy()


def scenario_bounded(rank: int, world: int) -> None:
    """The normal path without a host synchronisation (max_tokens_per_rank: the received rows
    sized for the worst case), with the rows written in place (the direct dispatch: bound
    200, which the buffer has room for) and through the rings (bound 300, which it has
    not): the host-synchronising path's bits on uneven token counts, dropped pairs, every
    token to rank 0's experts and a rank with none; then each captured in a CUDA graph,
    whose replays on new tokens and routings give the eager call's bits."""
    layer = _Layer(rank, world)
    for bound, how in ((DIRECT_BOUND, "in place"), (DIRECT_BOUND + 100, "through the rings")):
        for seed, (tokens, kind) in enumerate(((200 - 40 * rank, "uniform"), (150, "dropped"),
                                               (96 + rank, "rank0"),
                                               (0 if rank else 120, "uniform"))):
            x, idx, weights = _tokens(rank, tokens, EXPERTS, TOPK, kind, 60 + seed)
            synced = layer(x, idx, weights, "contiguous")
            bounded = layer(x, idx, weights, bound=bound)
            torch.cuda.synchronize()
            what = f"bounded {bound} ({how}), {kind}, {tokens} tokens"
            _assert_bitwise(bounded, synced, f"{what}: against the host-synchronising path")
            print(f"rank {rank}: {what}: the synchronising path's bits", flush=True)
        check_replays(rank, layer, 150, 70, f"bounded {bound} graph",
                      lambda *args: layer(*args, bound=bound),
                      lambda *args: layer(*args, "contiguous"))
    layer.destroy()


SCENARIOS = {"normal": scenario_normal, "decode": scenario_decode, "graph": scenario_graph,
             "bounded": scenario_bounded, "deepseek": scenario_deepseek}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_layer_two_ranks(scenario, monkeypatch):
    if scenario == "deepseek" and torch.cuda.device_count() < 2:
        # 256 experts over two ranks: each rank's decode kernels take 384 and 512 CTAs,
        # which wait for the peer's; both ranks' together exceed the 132 x 4 CTAs one GPU
        # holds at once, so under MPS a rank can wait on CTAs that never start.
        pytest.skip("the DeepSeek-V3 shape needs a GPU a rank")
    run_two_ranks(SCENARIOS[scenario], monkeypatch)


def main() -> int:
    """torchrun entry: the scenarios named on the command line (all by default) on the
    launcher's group."""
    names = sys.argv[1:] or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"scenarios must be among {list(SCENARIOS)}, got {unknown}")
    return run_torchrun({name: SCENARIOS[name] for name in names})


if __name__ == "__main__":
    sys.exit(main())
