"""The MoE layer across GPUs: ``ptxforge.moe_experts_fp8(x, topk_idx, topk_weights, gate_up,
down, ep=buffer)`` on every rank of the buffer's group, each with its own tokens. Rank r of
R holds experts [r * L, (r + 1) * L) of the E = R * L (``shard_experts`` slices them from
a full block's); topk_idx names global experts. Unfused, in two paths:

normal path (``layout='contiguous'``; many tokens; the dispatch synchronises with the host,
unless ``max_tokens_per_rank`` bounds every rank's tokens: then the received rows are
sized for the worst case, R * max_tokens_per_rank, the rows past those received carry no
pair, and nothing waits for the host):

    x [T, H] --quantize_fp8_per_token--> (e4m3, 1x128 scales): each token quantized once
    topk_idx --Buffer.get_dispatch_layout--> tokens per rank and expert, is_token_in_rank
    --Buffer.dispatch--> N received rows (e4m3 + their scales, as sent), local top-k [N, k]
                         (-1 and weight 0 for experts elsewhere)
    the local experts on them as the one-GPU op runs them, contiguous layout:
      moe_routing_layout, moe_permute_quantize_fp8 (the e4m3 rows moved, not requantized),
      grouped gate_up, moe_silu_mul_quantize_fp8, grouped down, moe_combine
      --> y [N, H]: each received row's weighted sum over its local experts, bf16
    --Buffer.combine--> out [T, H]: each token's rows from the ranks summed in rank order
                        in f32, rounded to bf16 once

decode path (``layout='masked'``; few tokens; nothing waits for the host: capturable):

    x, topk_idx --Buffer.low_latency_dispatch--> e4m3 [L, M, H] (M = R * T_max) with
                 MN-major scales, recv_count [L] (the masked layout's masked_m)
    --m_grouped_fp8_gemm_nt_masked (gate_up)--> [L, M, 2I]
    --moe_silu_mul_quantize_fp8 on the received rows (listed on the GPU)--> [L, M, I]
    --m_grouped_fp8_gemm_nt_masked (down)--> y [L, M, H]
    --Buffer.low_latency_combine--> out [T, H]: the weights went with the dispatch, so
                                    each experts' rank sums its pairs of a token (k order,
                                    f32, rounded to bf16) and the token's rank sums those
                                    in rank order in f32, rounded once

The decode path's T_max is the buffer's: the most tokens a rank its low-latency buffer
holds for these sizes (``decode_capacity``), so every rank lays the rows out alike.
The path (``choose_path``): ``layout`` where given; else the decode path where the
buffer has low-latency room for T tokens (for ``max_tokens_per_rank`` where given), else
the normal one. The ranks must take the same path (each would wait for the others in
its own kernels): where their token counts may fall on both sides of the capacity, pass
``layout`` or ``max_tokens_per_rank``.

Numerics. The FP8 recipe is the one-GPU op's: each token quantized once per token, the
same GEMMs and SwiGLU. Both paths round each rank's part of a token to bf16 before the sum
over ranks, so they differ from the one-GPU op (all k rows summed in f32) by a bf16
rounding of the parts.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.ep_intranode import dispatch as dispatch_kernel
from ..kernels.ep_intranode import layout as layout_kernel
from ..kernels.ep_low_latency.plan import MAX_TOKENS, MAX_TOPK, LowLatencyPlan, check_problem
from ..ops import moe
from ..ops.gemm import m_grouped_fp8_gemm_nt_masked
from ..ops.rowwise import quantize_fp8_per_token
from .buffer import Buffer, buffer_size
from .checks import check_device

PATHS = {"masked": "the decode path", "contiguous": "the normal path"}


def shard_experts(gate_up, down, rank: int, num_ranks: int) -> tuple:
    """Rank ``rank``'s experts of a block's ``gate_up`` and ``down``: experts [rank * E/R,
    (rank + 1) * E/R) of the E, R = ``num_ranks``. Each is a tensor with the experts first
    (bf16 [E, 2I, H] and [E, H, I], as transformers' experts hold them) or a ``(q, s)``
    pair of them (``quantize_fp8_per_block``'s, [E, ...] both). Returns the same kinds,
    views of the given tensors (no copy: ``.clone()`` them to let the full block go)."""
    for name, value in (("rank", rank), ("num_ranks", num_ranks)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if num_ranks < 1 or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, num_ranks) with num_ranks >= 1, got rank={rank}, "
                         f"num_ranks={num_ranks}")
    experts = _experts_of("gate_up", gate_up)
    down_experts = _experts_of("down", down)
    if down_experts != experts:
        raise ValueError(f"down must have gate_up's {experts} experts, got {down_experts}")
    if experts % num_ranks:
        raise ValueError(f"num_ranks must divide the experts: gate_up has {experts}, got "
                         f"num_ranks={num_ranks}")
    per_rank = experts // num_ranks
    first = rank * per_rank
    return tuple(_sliced(w, first, per_rank) for w in (gate_up, down))


def _experts_of(name: str, weights) -> int:
    """The leading dimension of a weight tensor or of both members of a (q, s) pair."""
    members = weights if isinstance(weights, (tuple, list)) else (weights,)
    if len(members) not in (1, 2) or not all(isinstance(t, torch.Tensor) for t in members):
        raise TypeError(f"{name} must be a tensor [E, ...] or a pair (q, s) of them, got "
                        f"{type(weights).__name__}")
    leading = {t.shape[0] if t.dim() else None for t in members}
    if len(leading) != 1 or None in leading:
        raise ValueError(f"{name} must have the experts first in every member, got shapes "
                         f"{[tuple(t.shape) for t in members]}")
    return leading.pop()


def _sliced(weights, first: int, count: int):
    if isinstance(weights, torch.Tensor):
        return weights[first:first + count]
    return tuple(t[first:first + count] for t in weights)


def decode_capacity(buffer: Buffer, hidden: int, experts: int) -> int:
    """The most tokens a rank ``buffer``'s decode path takes for rows of ``hidden`` and
    ``experts`` experts: the largest num_max_dispatch_tokens_per_rank (up to 256) whose
    layout, with room for top-16, fits its low-latency buffer, as
    ``Buffer.get_low_latency_rdma_size_hint`` sizes it (a buffer made with the hint for
    T_max gives T_max back). 0 without a low-latency buffer, or for sizes the decode path
    does not take. Every rank's buffer is as large as the smallest, so every rank gets
    the same."""
    if buffer.low_latency_group is None:
        return 0
    return _capacity(buffer.num_rdma_bytes, buffer.group_size, hidden, experts)


@functools.lru_cache(maxsize=None)
def _capacity(num_bytes: int, ranks: int, hidden: int, experts: int) -> int:
    try:
        check_problem(ranks, 1, hidden, experts, MAX_TOPK)
    except ValueError:
        return 0
    fits = lambda tokens: LowLatencyPlan(ranks, tokens, hidden, experts,
                                         MAX_TOPK).bytes_needed <= num_bytes
    low, high = 0, MAX_TOKENS          # fits(low) (or low = 0); the plan grows with the tokens
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def choose_path(buffer: Buffer, tokens: int, hidden: int, experts: int,
                layout: str | None = None) -> str:
    """'masked' (the decode path) or 'contiguous' (the normal path) for T = ``tokens`` on
    this rank: ``layout`` where given (checked against the buffer), else the decode path
    where its low-latency room holds T tokens (``decode_capacity``), else the normal
    path. Raises a ValueError naming ``ep`` where the buffer has no room for the path."""
    capacity = decode_capacity(buffer, hidden, experts)
    normal = buffer.num_nvl_bytes > 0
    if layout is None:
        if 0 < capacity and tokens <= capacity:
            return "masked"
        if normal:
            return "contiguous"
        raise ValueError(f"ep has no normal-mode buffer (num_nvl_bytes=0) and its low-latency "
                         f"buffer takes at most {capacity} tokens a rank of {hidden}-wide rows "
                         f"and {experts} experts, got x with {tokens}")
    if layout == "masked":
        if not capacity:
            raise ValueError(f"layout='masked' runs ep's decode path, and ep has no low-latency "
                             f"room for {hidden}-wide rows and {experts} experts (make the Buffer "
                             f"with low_latency_mode and get_low_latency_rdma_size_hint's bytes)")
        if tokens > capacity:
            raise ValueError(f"x must have at most {capacity} tokens for layout='masked' (ep's "
                             f"low-latency buffer holds that many a rank), got {tokens}")
        return "masked"
    if not normal:
        raise ValueError("layout='contiguous' runs ep's normal path, and ep has no normal-mode "
                         "buffer (num_nvl_bytes=0): make the Buffer with "
                         "num_nvl_bytes=ptxforge.ep.buffer_size(...)")
    return "contiguous"


def experts_across(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights,
                   gate_up, down, *, layout: str | None, sizes: moe.ExpertsSizes,
                   max_tokens_per_rank: int | None = None) -> torch.Tensor:
    """``moe_experts_fp8(..., ep=buffer)`` after its shape checks (``sizes``: this rank's
    experts): the path's checks, all before the GPU, then the path."""
    tokens, hidden, top_k, local, _, device = sizes
    ranks = buffer.group_size
    experts = local * ranks
    if max_tokens_per_rank is not None:
        if type(max_tokens_per_rank) is not int or max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be a positive int, got "
                             f"{max_tokens_per_rank!r}")
        if tokens > max_tokens_per_rank:
            raise ValueError(f"x must have at most max_tokens_per_rank ({max_tokens_per_rank}) "
                             f"tokens, got {tokens}")
        if ranks * max_tokens_per_rank >= 2 ** 31:
            raise ValueError(f"max_tokens_per_rank times the {ranks} ranks must be below 2^31, "
                             f"got {max_tokens_per_rank}")
        capacity = decode_capacity(buffer, hidden, experts)
        if layout == "masked" and capacity and max_tokens_per_rank > capacity:
            raise ValueError(f"max_tokens_per_rank must be at most {capacity} for "
                             f"layout='masked' (ep's low-latency buffer holds that many a "
                             f"rank), got {max_tokens_per_rank}")
    path = choose_path(buffer, max_tokens_per_rank or tokens, hidden, experts, layout)
    if topk_weights.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"topk_weights must have dtype torch.float32 or torch.bfloat16, got "
                        f"{topk_weights.dtype}")
    if path == "masked":
        check_problem(ranks, decode_capacity(buffer, hidden, experts), hidden, experts, top_k)
    else:
        dispatch_kernel.check_hidden(hidden, True)
        layout_kernel.check_problem(experts, ranks, top_k)
        config = buffer.get_dispatch_config()
        needed = buffer_size(ranks, hidden, top_k, fp8=True, config=config)
        if needed > buffer.num_nvl_bytes:
            raise ValueError(f"ep's num_nvl_bytes ({buffer.num_nvl_bytes}) must hold an FP8 "
                             f"dispatch of {hidden}-wide rows with top-{top_k} over {ranks} "
                             f"ranks: {needed} (ptxforge.ep.buffer_size)")
    check_device("x", x, device, buffer.device_index)
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.float().contiguous()
    if path == "masked":
        return _decode(buffer, x.contiguous(), topk_idx, topk_weights, gate_up, down, sizes)
    worst = ranks * max_tokens_per_rank if max_tokens_per_rank else 0
    return _normal(buffer, x, topk_idx, topk_weights, gate_up, down, sizes, worst)


def _normal(buffer: Buffer, x, topk_idx, topk_weights, gate_up, down, sizes,
            worst: int) -> torch.Tensor:
    """The normal path; ``worst`` > 0: the received rows sized for that many (no host
    synchronisation)."""
    tokens, hidden, top_k, local, two_inner, device = sizes
    experts = local * buffer.group_size
    # The dispatch refuses indices outside [-1, E) on every rank; the op drops their pairs.
    topk_idx = torch.where((topk_idx >= 0) & (topk_idx < experts), topk_idx, -1)
    quantized = quantize_fp8_per_token(x, "row_major")
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
    received, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
        quantized, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        num_worst_tokens=worst)
    rows = handle.num_recv_tokens
    if rows:
        # After a direct dispatch the experts write their output where the other ranks'
        # combines pull it from.
        out = buffer.combine_input(handle) if handle.direct is not None else None
        y = moe.grouped_experts(received, recv_idx, recv_weights, gate_up, down, "contiguous",
                                moe.ExpertsSizes(rows, hidden, top_k, local, two_inner, device),
                                out=out)
    else:
        y = torch.empty((0, hidden), dtype=torch.bfloat16, device=x.device)
    combined, _, _ = buffer.combine(y, handle)
    return combined


def _decode(buffer: Buffer, x, topk_idx, topk_weights, gate_up, down, sizes) -> torch.Tensor:
    tokens, hidden, top_k, local, two_inner, _ = sizes
    ranks = buffer.group_size
    experts = local * ranks
    capacity = decode_capacity(buffer, hidden, experts)
    # The weights go with the tokens: each experts' rank then sums its pairs of a token and
    # the combine returns one row a (token, rank), not one a pair.
    received, recv_count, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_idx, capacity, experts, topk_weights=topk_weights)
    rows_per_expert = ranks * capacity
    # The GEMMs' tile hint: the pairs an expert receives when every rank has this rank's T.
    expected = moe.expected_rows(ranks * tokens, top_k, experts)
    gate_up_out = torch.empty((local, rows_per_expert, two_inner), dtype=torch.bfloat16,
                              device=x.device)
    m_grouped_fp8_gemm_nt_masked(received, gate_up, gate_up_out, recv_count, expected)
    # A source's token goes to at most min(k, L) of this rank's experts.
    rows = received_rows(recv_count, rows_per_expert, ranks * capacity * min(top_k, local))
    h = moe.moe_silu_mul_quantize_fp8(gate_up_out, rows)
    y = torch.empty((local, rows_per_expert, hidden), dtype=torch.bfloat16, device=x.device)
    m_grouped_fp8_gemm_nt_masked(h, down, y, recv_count, expected)
    combined, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
    return combined


def received_rows(recv_count: torch.Tensor, rows_per_expert: int, room: int) -> torch.Tensor:
    """int32 [room, 1]: the rows of a masked layout [L, rows_per_expert] that hold a pair
    (expert l's first recv_count[l]), flattened and in order, then -1 (a dropped pair) up
    to ``room`` (at least the rows held): the rows SwiGLU reads. A few torch kernels on
    the GPU, no host synchronisation, so a CUDA graph replays it on any counts; the row
    kernel then walks ``room`` rows, not all L * rows_per_expert."""
    local, device = recv_count.shape[0], recv_count.device
    within = torch.arange(rows_per_expert, dtype=torch.int32, device=device)
    held = (within < recv_count.unsqueeze(1)).view(-1)
    slot = torch.cumsum(held, 0, dtype=torch.int32) - 1
    # The rows not held all go to slot ``room``, cut off below.
    slot = torch.where(held, slot, room).long()
    rows = torch.full((room + 1,), -1, dtype=torch.int32, device=device)
    rows.scatter_(0, slot, torch.arange(local * rows_per_expert, dtype=torch.int32,
                                        device=device))
    return rows[:room].view(room, 1)


moe.register_expert_parallel(Buffer, experts_across)
