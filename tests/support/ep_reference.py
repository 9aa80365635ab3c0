"""Torch references for ``ptxforge.ep``: what a dispatch layout, a dispatch and a combine
must give, computed from every rank's inputs with plain indexing (what an NCCL
``all_to_all_single`` of the selected rows would deliver, in the documented order).
They run on any device, the CPU included.
"""

from __future__ import annotations

import torch

from ptxforge.testing.reference import quantize_fp8_per_token


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank
    bool [T, R]) of one rank's topk_idx: indices outside [0, E) count nowhere."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    experts = torch.where(valid, topk_idx, 0)
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    per_expert.index_add_(0, experts[valid], torch.ones_like(experts[valid]))
    owner = experts // (num_experts // num_ranks)
    in_rank = torch.zeros((topk_idx.shape[0], num_ranks), dtype=torch.bool,
                          device=topk_idx.device)
    for j in range(topk_idx.shape[1]):
        hit = torch.nn.functional.one_hot(owner[:, j], num_ranks).bool() & valid[:, j:j + 1]
        in_rank |= hit
    return in_rank.sum(0).to(torch.int32), per_expert.to(torch.int32), in_rank


def dispatch(rank: int, xs: list, topk_idxs: list, topk_weights: list, num_experts: int,
             scales: list | None = None) -> dict:
    """What ``rank`` receives from every rank s's (xs[s], topk_idxs[s], topk_weights[s]):
    rows grouped by source rank, each source's in token order; top-k made local (-1 and
    weight 0 for experts elsewhere); ``src_idx`` the token on its source; ``per_expert``
    the (token, expert) pairs each local expert receives."""
    ranks = len(xs)
    per_rank = num_experts // ranks
    first = rank * per_rank
    rows, scale_rows, idx, weights, src = [], [], [], [], []
    per_expert = torch.zeros(per_rank, dtype=torch.int64)
    for s in range(ranks):
        _, _, in_rank = dispatch_layout(topk_idxs[s], num_experts, ranks)
        tokens = torch.nonzero(in_rank[:, rank]).flatten()
        rows.append(xs[s][tokens])
        if scales is not None:
            scale_rows.append(scales[s][tokens])
        local = topk_idxs[s][tokens] - first
        mine = (local >= 0) & (local < per_rank)
        idx.append(torch.where(mine, local, -1))
        weights.append(torch.where(mine, topk_weights[s][tokens], 0.0))
        src.append(tokens.to(torch.int32))
        per_expert += torch.bincount(local[mine].flatten().cpu(), minlength=per_rank)
    out = {"x": torch.cat(rows), "topk_idx": torch.cat(idx), "topk_weights": torch.cat(weights),
           "src_idx": torch.cat(src), "per_expert": per_expert.tolist()}
    if scales is not None:
        out["scales"] = torch.cat(scale_rows)
    return out


def combine(rank: int, ys: list, topk_idxs: list, num_experts: int,
            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What ``rank`` gets back when every rank d returns ys[d] (rows in d's received
    order): per token, the f32 sum in rank order of the rows of the ranks it went to
    (+0 where none), rounded to ``dtype`` once (bf16 rows; f32 for top-k weights)."""
    ranks = len(ys)
    _, _, in_rank = dispatch_layout(topk_idxs[rank], num_experts, ranks)
    acc = torch.zeros((in_rank.shape[0], ys[0].shape[1]), dtype=torch.float32)
    for d in range(ranks):
        # Rank d's received rows: sources in order, each source's tokens in order.
        start = 0
        for s in range(rank):
            _, _, theirs = dispatch_layout(topk_idxs[s], num_experts, ranks)
            start += int(theirs[:, d].sum())
        tokens = torch.nonzero(in_rank[:, d]).flatten()
        rows = ys[d][start:start + len(tokens)].float()
        acc[tokens] = acc[tokens] + rows
    return acc.to(dtype)


def _routed(topk_idx: torch.Tensor, expert: int):
    """(tokens, k positions) of the tokens of ``topk_idx`` naming ``expert``, in token
    order, each at its first k position naming it."""
    hits = topk_idx == expert
    tokens = torch.nonzero(hits.any(1)).flatten()
    return tokens, hits[tokens].int().argmax(1)


def low_latency_dispatch(rank: int, xs: list, topk_idxs: list, num_experts: int,
                         max_tokens: int) -> dict:
    """What ``rank`` receives from every rank s's (xs[s] bf16, topk_idxs[s]) in a
    low-latency dispatch: per local expert l, the rows of the tokens naming expert rank * L
    + l (indices outside [0, E) name none; a token naming it twice sends once), source
    ranks in order, each in token order: ``x`` e4m3 and ``scales`` f32 (each source's
    rows quantized by ``quantize_fp8_per_token``), ``src_info`` int32 (source rank, token,
    first k position), rows past ``count`` [L] zero."""
    ranks, hidden = len(xs), xs[0].shape[1]
    per_rank, rows = num_experts // ranks, ranks * max_tokens
    quantized = [quantize_fp8_per_token(x) if x.shape[0] else
                 (x.to(torch.float8_e4m3fn), x.new_zeros((0, hidden // 128), dtype=torch.float32))
                 for x in xs]
    x = torch.zeros((per_rank, rows, hidden), dtype=torch.float8_e4m3fn)
    scales = torch.zeros((per_rank, rows, hidden // 128), dtype=torch.float32)
    src_info = torch.zeros((per_rank, rows, 3), dtype=torch.int32)
    count = torch.zeros(per_rank, dtype=torch.int32)
    for local in range(per_rank):
        n = 0
        for s in range(ranks):
            tokens, positions = _routed(topk_idxs[s], rank * per_rank + local)
            q, sc = quantized[s]
            x[local, n:n + len(tokens)] = q[tokens]
            scales[local, n:n + len(tokens)] = sc[tokens]
            src_info[local, n:n + len(tokens)] = torch.stack(
                [torch.full_like(tokens, s), tokens, positions], 1).int()
            n += len(tokens)
        count[local] = n
    return {"x": x, "scales": scales, "src_info": src_info, "count": count}


def _low_latency_row(rank: int, topk_idxs: list, expert: int, t: int) -> int:
    """Where token t of ``rank`` lies among expert ``expert``'s low-latency received rows."""
    start = sum(len(_routed(topk_idxs[s], expert)[0]) for s in range(rank))
    tokens, _ = _routed(topk_idxs[rank], expert)
    return start + int((tokens < t).sum())


def low_latency_combine_summed(rank: int, ys: list, topk_idxs: list, topk_weights: list,
                               num_experts: int) -> torch.Tensor:
    """The combine after a dispatch given the top-k weights: each rank d holding pairs of
    token t sums them, from +0, in k order, ``part = part + row.float() * weight`` (each
    product and sum rounded to f32), rounded to bf16; rank ``rank`` sums those parts from
    +0 in rank order in f32, rounded to bf16 once."""
    ranks = len(ys)
    per_rank = num_experts // ranks
    idx, weights = topk_idxs[rank], topk_weights[rank].float()
    acc = torch.zeros((idx.shape[0], ys[0].shape[2]), dtype=torch.float32)
    for t in range(idx.shape[0]):
        for d in range(ranks):
            part = None
            for j in range(idx.shape[1]):
                expert = int(idx[t, j])
                if not 0 <= expert < num_experts or expert // per_rank != d:
                    continue
                row = _low_latency_row(rank, topk_idxs, expert, t)
                term = ys[d][expert % per_rank, row].float() * weights[t, j]
                part = (torch.zeros_like(term) if part is None else part) + term
            if part is not None:
                acc[t] = acc[t] + part.bfloat16().float()
    return acc.bfloat16()


def low_latency_combine(rank: int, ys: list, topk_idxs: list, topk_weights: list,
                        num_experts: int) -> torch.Tensor:
    """What ``rank`` gets back when every rank d returns ys[d] (bf16 [L, R * max_tokens, H],
    rows in d's low-latency received order): per token, from +0, in k order over its
    pairs whose index lies in [0, E), ``acc = acc + row.float() * weight`` (the product
    and the sum each rounded to f32), rounded to bf16 once."""
    ranks = len(ys)
    per_rank = num_experts // ranks
    idx, weights = topk_idxs[rank], topk_weights[rank].float()
    acc = torch.zeros((idx.shape[0], ys[0].shape[2]), dtype=torch.float32)
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            expert = int(idx[t, j])
            if not 0 <= expert < num_experts:
                continue
            d, local = divmod(expert, per_rank)
            row = _low_latency_row(rank, topk_idxs, expert, t)
            acc[t] = acc[t] + ys[d][local, row].float() * weights[t, j]
    return acc.bfloat16()
