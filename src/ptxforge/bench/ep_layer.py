"""The MoE layer across GPUs (``ptxforge.moe_experts_fp8(..., ep=buffer)``) against what it
replaces, every rank timed in the same run: DeepSeek-V3's routed experts (256 experts,
top-8, H = 7168, I = 2048, weights N(0, 0.02), router-like softmax top-k weights), each
rank holding E / R of them, at 4096 tokens a rank (the normal path) and 128 (the decode
path).

    ours       moe_experts_fp8(..., ep=buffer): FP8 dispatch, the grouped FP8 experts,
               combine (the path by the buffer's rule: decode where 128 tokens fit)
    bounded    the normal path with max_tokens_per_rank = T: the received rows sized for
               the worst case, no host synchronisation (the decode path has none anyway)
    wide       bounded, on a buffer whose SM budget is WIDE_SMS: the layer runs its
               communication alone on the GPU, between its GEMMs
    direct     bounded, on a buffer with room for the worst case's received rows: the
               direct dispatch writes them in place (every SM sending), the experts
               write their output into the buffer, the pull combine reads it
    graph      direct, a call captured in a CUDA graph and replayed (what a serving loop
               runs: no host work between the kernels)
    nccl       NCCL all_to_all_single of the FP8 rows (scales, local top-k and weights
               packed beside them; the split sizes exchanged first, a host sync), the same
               local experts (ptxforge's grouped FP8 GEMMs on the received rows),
               all_to_all_single back, each token's sum: one after another
    grouped_mm what a user would write: transformers' grouped_mm experts
               (``experts_implementation="grouped_mm"``: sort the pairs by expert,
               torch grouped_mm in bf16, SwiGLU, grouped_mm, weights, index_add) on bf16
               rows moved by torch's all_to_all_single

Times: a layer call's, the median of ``repeats`` batches of ``calls`` calls after a host
barrier and behind a sleep kernel (so a path without host synchronisation runs at the
GPU's pace), the slowest rank's. TFLOPS: the routed experts' FLOPs a rank, 2 * T * k *
(H * 2I + I * H), over that time. At the decode sizes, the time to read the rank's FP8
experts (weights and scales) once at the copy rate measured in the run (a device-to-
device copy of 1 GiB, ``bench.ops.copy_bandwidth_gbs``: kernel time, L2 flushed; its
rate counts the bytes read and written), and the layer's time
over it. ``ptxforge bench ep`` runs it on its ranks after the communication
(``bench/ep.py``), whose harness and timing it shares.
"""

from __future__ import annotations

import torch

from . import format_table
from .ops import Timer, copy_bandwidth_gbs
from .ranks import batch_us

COPY_BYTES = 1 << 30        # the copy's source: it moves twice that, read and written
DECODE_LIMIT = 256          # the decode path's most tokens a rank
INNER = 2048                # DeepSeek-V3's expert width
CALLS, REPEATS = 4, 5       # a batch's layer calls, batches timed
WIDE_SMS = 48               # where dispatch and combine level off at 2 ranks (~245 GB/s)


def _local_experts(rank: int, local: int, hidden: int, inner: int):
    """The rank's bf16 experts, global experts rank * local ..., N(0, 0.02), each drawn
    from its own seed (so a rank's are the full block's), an expert at a time."""
    gate_up = torch.empty(local, 2 * inner, hidden, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(local, hidden, inner, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda")
    for e in range(local):
        g.manual_seed(rank * local + e)
        gate_up[e] = torch.randn(gate_up.shape[1:], device="cuda", generator=g) * 0.02
        down[e] = torch.randn(down.shape[1:], device="cuda", generator=g) * 0.02
    return gate_up, down


def _block_quantized(w: torch.Tensor) -> tuple:
    from .. import ops

    q, s = ops.quantize_fp8_per_block(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), s.view(w.shape[0], -1, s.shape[-1])


def _router(rank: int, tokens: int, experts: int, topk: int, hidden: int):
    """A rank's tokens and a router's choice: softmax over random logits, the top-k experts
    and their probabilities renormalized."""
    g = torch.Generator(device="cuda").manual_seed(4321 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    probs = torch.randn(tokens, experts, device="cuda", generator=g).softmax(-1)
    weights, idx = probs.topk(topk, dim=-1)
    return x, idx.contiguous(), (weights / weights.sum(-1, keepdim=True)).contiguous()


def measure(rank: int, world: int, p: dict) -> dict | None:
    """One rank's part (every rank of the group calls it): rank 0 gets the summary, the
    others None. ``p``: tokens (a list), hidden, experts, topk."""
    import torch.distributed as dist

    from .. import ops
    from ..ep import Buffer, Config, buffer_size
    from ..ep.layer import choose_path

    p = dict(p, inner=INNER, calls=CALLS, repeats=REPEATS)
    hidden, inner, experts, topk = p["hidden"], p["inner"], p["experts"], p["topk"]
    local = experts // world
    bf16 = _local_experts(rank, local, hidden, inner)
    fp8 = tuple(_block_quantized(w) for w in bf16)
    fp8_bytes = sum(t.numel() * t.element_size() for pair in fp8 for t in pair)
    decode = [t for t in p["tokens"] if t <= DECODE_LIMIT]
    rdma = (Buffer.get_low_latency_rdma_size_hint(max(decode), hidden, world, experts)
            if decode else 0)
    buffer = Buffer(dist.group.WORLD, buffer_size(world, hidden, topk, fp8=True), rdma,
                    low_latency_mode=bool(decode), timeout_s=60.0)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    wide_sms = min(WIDE_SMS, sms // 2 * 2)
    wide = Buffer(dist.group.WORLD, buffer_size(world, hidden, topk, fp8=True,
                                                config=Config(wide_sms, 128)),
                  num_sms=wide_sms, timeout_s=60.0)
    normal = [t for t in p["tokens"] if t > DECODE_LIMIT] or [1]
    roomy = Buffer(dist.group.WORLD, buffer_size(world, hidden, topk, fp8=True,
                                                 num_worst_tokens=world * max(normal)),
                   timeout_s=60.0)
    nccl = dist.new_group(backend="nccl")
    copy_gbs = None
    for turn in range(world):   # one rank at a time: ranks may share a GPU
        if turn == rank:
            copy_gbs = copy_bandwidth_gbs(Timer(), 2 * COPY_BYTES)
        dist.barrier()
    rows = []
    for tokens in p["tokens"]:
        x, idx, weights = _router(rank, tokens, experts, topk, hidden)
        ours = lambda: ops.moe_experts_fp8(x, idx, weights, *fp8, ep=buffer)
        bounded = lambda: ops.moe_experts_fp8(x, idx, weights, *fp8, ep=buffer,
                                              max_tokens_per_rank=tokens)
        widely = lambda: ops.moe_experts_fp8(x, idx, weights, *fp8, ep=wide,
                                             max_tokens_per_rank=tokens)
        directly = lambda: ops.moe_experts_fp8(x, idx, weights, *fp8, ep=roomy,
                                               max_tokens_per_rank=tokens)
        with_nccl = lambda: _nccl_fp8_layer(x, idx, weights, fp8, local, world, nccl)
        grouped_mm = lambda: _grouped_mm_layer(x, idx, weights, bf16, local, world, nccl)
        path = choose_path(buffer, tokens, hidden, experts)
        timed = [("ours_us", ours), ("nccl_us", with_nccl), ("grouped_mm_us", grouped_mm)]
        if path == "contiguous":
            timed += [("bounded_us", bounded), ("wide_us", widely), ("direct_us", directly),
                      ("graph_us", _captured(directly))]
        rows.append(dict(tokens=tokens, path=path,
                         **{name: batch_us(fn, p["calls"], p["repeats"]) for name, fn in timed},
                         timeline=timeline(bounded if path == "contiguous" else ours)))
    everyone = [None] * world
    dist.all_gather_object(everyone, dict(rows=rows, copy_gbs=copy_gbs, fp8_bytes=fp8_bytes))
    dist.destroy_process_group(nccl)
    buffer.destroy()
    wide.destroy()
    roomy.destroy()
    if rank:
        return None
    return _summary(everyone, dict(p, wide_sms=wide_sms), world,
                    torch.cuda.device_count() >= world, torch.cuda.get_device_name())


def _captured(fn):
    """``fn``'s call captured in a CUDA graph (after a call that builds its kernels): the
    graph's replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _summary(everyone: list, p: dict, world: int, distinct: bool, device_name: str) -> dict:
    """Per token count, each candidate's slowest rank's time and its TFLOPS; at the decode
    sizes, the FP8 experts' read time at the slowest rank's copy rate."""
    copy_gbs = min(r["copy_gbs"] for r in everyone)
    fp8_bytes = everyone[0]["fp8_bytes"]
    read_us = fp8_bytes / copy_gbs / 1e3
    rows = []
    for i, row in enumerate(everyone[0]["rows"]):
        t = row["tokens"]
        flops = 2 * t * p["topk"] * (p["hidden"] * 2 * p["inner"] + p["inner"] * p["hidden"])
        out = dict(tokens=t, path=row["path"])
        for name in ("ours", "bounded", "wide", "direct", "graph", "nccl", "grouped_mm"):
            if f"{name}_us" in row:
                us = max(r["rows"][i][f"{name}_us"] for r in everyone)
                out[f"{name}_us"], out[f"{name}_tflops"] = us, flops / us / 1e6
        out["timelines"] = [r["rows"][i]["timeline"] for r in everyone]
        if t <= DECODE_LIMIT:
            out["weights_read_us"] = read_us
            out["ours_over_read"] = out["ours_us"] / read_us
        rows.append(out)
    return dict(params=p, world=world, distinct_gpus=distinct, device=device_name,
                copy_gbs=copy_gbs, fp8_weights_bytes=fp8_bytes, rows=rows)


GAP_US = 10.0     # the GPU idle gaps a timeline lists: at least this long
TOP = 6           # the kernels and gaps a timeline keeps


def timeline(fn) -> dict:
    """Where one call of ``fn`` spends its time on the GPU (after a host barrier, kernels
    built): span (first kernel's start to last one's end), busy (the union of the kernels'
    intervals), the kernels with the most time (summed by name) and the longest idle gaps,
    each with the kernels before and after it. A gap is the GPU waiting for the host: a
    host synchronisation, or work enqueued slower than it runs."""
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type.name == "CUDA")
    if not kernels:
        return dict(span_us=0.0, busy_us=0.0, kernels=[], gaps=[])
    busy, gaps, reach, last = 0.0, [], kernels[0][0], kernels[0][2]
    by_name: dict = {}
    for start, end, name in kernels:
        by_name[name] = by_name.get(name, 0.0) + end - start
        if start - reach >= GAP_US:
            gaps.append(dict(us=start - reach, at_us=reach - kernels[0][0], after=last,
                             before=name))
        if end > reach:
            busy += end - max(start, reach)
            reach, last = end, name
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP]
    return dict(span_us=reach - kernels[0][0], busy_us=busy,
                kernels=[dict(name=name[:60], us=us) for name, us in top],
                gaps=sorted(gaps, key=lambda g: -g["us"])[:TOP])


# ---------------------------------------------------------------------------- the peers
def _exchange(rows: torch.Tensor, ranks: torch.Tensor, world: int, group) -> tuple:
    """``rows`` (uint8 [n, B], sorted by destination ``ranks``) to their ranks by NCCL
    all_to_all_single, the split sizes exchanged first: (received rows, send splits,
    receive splits); the splits are read on the host."""
    import torch.distributed as dist

    send = torch.bincount(ranks, minlength=world)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)
    send, receive = send.tolist(), receive.tolist()
    received = torch.empty(sum(receive), rows.shape[1], dtype=torch.uint8, device=rows.device)
    dist.all_to_all_single(received, rows, receive, send, group=group)
    return received, send, receive


def _packed_pairs(payload: list, idx: torch.Tensor, weights: torch.Tensor, local: int,
                  world: int):
    """Each (token, rank) its experts live on, sorted by rank: the token's ``payload``
    tensors' rows, its top-k made local to that rank (-1, weight 0 for the others), as one
    uint8 row padded to 16 bytes; and the pairs' ranks and tokens."""
    owner = idx // local
    in_rank = torch.zeros(idx.shape[0], world, dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, owner, True)
    ranks, tokens = in_rank.t().nonzero(as_tuple=True)
    mine = owner[tokens] == ranks.unsqueeze(1)
    local_idx = torch.where(mine, idx[tokens] - ranks.unsqueeze(1) * local, -1)
    local_weights = torch.where(mine, weights[tokens].float(), 0.0)
    parts = [t[tokens].contiguous().view(torch.uint8) for t in payload]
    parts += [local_idx.contiguous().view(torch.uint8), local_weights.view(torch.uint8)]
    width = sum(part.shape[1] for part in parts)
    parts.append(torch.zeros(len(tokens), -width % 16, dtype=torch.uint8, device=idx.device))
    return torch.cat(parts, 1), ranks, tokens


def _unpacked(received: torch.Tensor, widths: list, dtypes: list):
    """The received rows split back into their parts (each contiguous, of its dtype)."""
    parts, at = [], 0
    for width, dtype in zip(widths, dtypes):
        parts.append(received[:, at:at + width].contiguous().view(dtype))
        at += width
    return parts


def _summed_back(y: torch.Tensor, send: list, receive: list, tokens: torch.Tensor,
                 count: int, group) -> torch.Tensor:
    """The experts' rows ``y`` (bf16 [received, H]) back to their tokens' ranks by NCCL,
    each token's rows summed in f32, rounded to bf16."""
    import torch.distributed as dist

    back = torch.empty(sum(send), y.shape[1], dtype=y.dtype, device=y.device)
    dist.all_to_all_single(back, y.contiguous(), send, receive, group=group)
    out = torch.zeros(count, y.shape[1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, tokens, back.float()).bfloat16()


def _nccl_fp8_layer(x, idx, weights, fp8, local: int, world: int, group) -> torch.Tensor:
    """NCCL's all_to_all_single around ptxforge's local FP8 experts."""
    from .. import ops
    from ..ops import moe

    tokens_here, hidden = x.shape
    top_k = idx.shape[1]
    q, scales = ops.quantize_fp8_per_token(x, "row_major")
    rows, ranks, tokens = _packed_pairs([q, scales], idx, weights, local, world)
    received, send, receive = _exchange(rows, ranks, world, group)
    widths = [hidden, 4 * scales.shape[1], 8 * top_k, 4 * top_k]
    rq, rs, r_idx, r_weights = _unpacked(received, widths, [torch.float8_e4m3fn, torch.float32,
                                                            torch.int64, torch.float32])
    n = received.shape[0]
    if n:
        y = moe.grouped_experts((rq, rs), r_idx, r_weights, *fp8, "contiguous",
                                moe.ExpertsSizes(n, hidden, top_k, local,
                                                 fp8[0][0].shape[1], x.device.index))
    else:
        y = torch.empty(0, hidden, dtype=torch.bfloat16, device=x.device)
    return _summed_back(y, send, receive, tokens, tokens_here, group)


def _grouped_mm_layer(x, idx, weights, bf16, local: int, world: int, group) -> torch.Tensor:
    """torch's all_to_all_single around transformers' grouped_mm experts in bf16."""
    tokens_here, hidden = x.shape
    top_k = idx.shape[1]
    rows, ranks, tokens = _packed_pairs([x], idx, weights, local, world)
    received, send, receive = _exchange(rows, ranks, world, group)
    rx, r_idx, r_weights = _unpacked(received, [2 * hidden, 8 * top_k, 4 * top_k],
                                     [torch.bfloat16, torch.int64, torch.float32])
    y = _grouped_mm_experts(rx, r_idx, r_weights, *bf16)
    return _summed_back(y, send, receive, tokens, tokens_here, group)


def _grouped_mm_experts(x, idx, weights, gate_up, down) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` (integrations/moe.py) with expert
    parallelism's sentinel: pairs of other ranks' experts (-1) sorted to the tail,
    outside the offsets, their rows zeroed before the sum."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    local, top_k = gate_up.shape[0], idx.shape[1]
    experts = torch.where(idx >= 0, idx, local).reshape(-1)
    experts_sorted, perm = torch.sort(experts)
    # transformers counts with histc (int on CUDA only); the sentinel's count is cut off.
    counts = torch.bincount(experts_sorted, minlength=local + 1)[:local]
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    sentinel = (experts_sorted >= local).unsqueeze(-1)
    h = grouped_mm(x[perm // top_k], gate_up.transpose(-2, -1), offs=offsets)
    inner = h.shape[-1] // 2
    h = torch.nn.functional.silu(h[:, :inner]) * h[:, inner:]
    out = grouped_mm(h, down.transpose(-2, -1), offs=offsets)
    out = out * weights.reshape(-1)[perm].unsqueeze(-1).to(out.dtype)
    out = out.masked_fill(sentinel, 0.0)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    return y.index_add_(0, perm // top_k, out)


# ---------------------------------------------------------------------------- report
def layer_table(result: dict) -> str:
    p = result["params"]
    one_gpu = " (all on ONE GPU under MPS: no NVLink)"
    head = (f"MoE layer across {result['world']} ranks on {result['device']}"
            f"{'' if result['distinct_gpus'] else one_gpu}: DeepSeek-V3's routed experts "
            f"({p['experts']} experts, top-{p['topk']}, H = {p['hidden']}, I = {p['inner']}), "
            f"{p['experts'] // result['world']} a rank; a layer call's time, the median of "
            f"batches of {p['calls']}, the slowest rank's; TFLOPS on the routed experts' "
            f"FLOPs a rank.")
    rows = []
    for r in result["rows"]:
        best = min(r[f"{n}_us"] for n in ("ours", "bounded", "wide", "direct", "graph")
                   if f"{n}_us" in r)
        rows.append([r["tokens"], r["path"],
                     *(f"{r[f'{n}_us']:.0f} ({r[f'{n}_tflops']:.0f})" if f"{n}_us" in r else "-"
                       for n in ("ours", "bounded", "wide", "direct", "graph", "nccl",
                                 "grouped_mm")),
                     f"{r['nccl_us'] / best:.2f}x", f"{r['grouped_mm_us'] / best:.2f}x"])
    text = head + "\n\n" + format_table(
        ["tokens a rank", "path", "ours us (TFLOPS)", "ours, no host sync",
         f"no host sync, {p.get('wide_sms', WIDE_SMS)} SMs", "no host sync, direct + pull",
         "the same, CUDA graph",
         "NCCL + ptxforge experts",
         "grouped_mm + all_to_all", "best of ours vs NCCL", "vs grouped_mm"], rows)
    text += (f"\n\ncopy rate (device to device, 1 GiB, read + written): "
             f"{result['copy_gbs']:.0f} GB/s; the rank's FP8 experts: "
             f"{result['fp8_weights_bytes'] / 1e9:.2f} GB")
    for r in result["rows"]:
        if "weights_read_us" in r:
            text += (f"\n{r['tokens']} tokens a rank: ours {r['ours_us']:.0f} us = "
                     f"{r['ours_over_read']:.2f} x the time to read them once "
                     f"({r['weights_read_us']:.0f} us)")
    for r in result["rows"]:
        which = "ours, no host sync" if "bounded_us" in r else "ours"
        text += f"\n\none call of {which} at {r['tokens']} tokens a rank (profiler), per rank:"
        for rank, t in enumerate(r["timelines"]):
            text += (f"\n  rank {rank}: GPU span {t['span_us']:.0f} us, busy {t['busy_us']:.0f}; "
                     + ", ".join(f"{k['name'][:32]} {k['us']:.0f}" for k in t["kernels"]))
            text += "".join(f"\n    idle {g['us']:.0f} us at +{g['at_us']:.0f}: "
                            f"{g['after'][:32]} -> {g['before'][:32]}" for g in t["gaps"])
    return text
