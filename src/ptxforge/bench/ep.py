"""``ptxforge bench ep``: the intranode dispatch and combine (``ptxforge.ep.Buffer``) over a
sweep of SM budgets and ring sizes, with the peers measured in the same run: the copy
engine's one-direction P2P copy (1 GiB) and NCCL's ``all_to_all_single`` moving the same
bytes, and the grouped FP8 GEMM run beside the communication on the SMs it leaves.

Each rank is a process: under ``torchrun`` the launcher's, otherwise ``world`` processes
this module spawns, one a GPU (or, with one GPU, all on it under MPS: the numbers then
time the kernels' mechanics through one GPU's memory, not NVLink, and there are no peers).

What is timed: the calls that reuse a dispatch's handle (no host synchronisation), ``calls``
of them back to back on the communication stream after a host barrier, between two CUDA
events; a call's time is the batch's over ``calls`` (the launch latency and the ranks'
start skew are paid once a batch), the median of ``repeats`` batches, the slowest rank's.
The bytes are those crossing between GPUs: the rows (and FP8 scales) a rank sends to the
other ranks, its own rows excluded; GB/s is that over the time. The L2 is not flushed:
the payload is sent once a call and does not stay in L2 between calls.
"""

from __future__ import annotations

import statistics

import torch

from . import format_table, pyplot
from .ranks import batch_us, run_ranks

DEFAULT_SMS = (8, 12, 16, 20, 24)
DEFAULT_SLOTS = (64, 128, 256)
SM_BUDGET = 20          # SMs the communication may take beside the experts' GEMMs (DeepEP's
                        # default): the picked config uses at most this many
GEMM_N = 4096           # the experts' gate_up width beside the communication (DeepSeek-V3)
DECODE_TOKENS = 128     # the decode target's tokens a rank
DECODE_PAIRS = 10       # dispatch + combine pairs a captured graph holds
EVERY_PEER_BYTES = 256 << 20   # a copy to each peer at once, beside the 1-GiB P2P copy
LAYER_TOKENS = (4096, 128)  # the MoE layer's tokens a rank: its normal path, its decode path


def ep_suite(*, tokens: int = 4096, hidden: int = 7168, topk: int = 8, experts: int = 256,
             sms=DEFAULT_SMS, slots=DEFAULT_SLOTS, world: int = 2, calls: int = 8,
             repeats: int = 5, layer_tokens=LAYER_TOKENS) -> dict | None:
    """Rank 0's results (None on the other ranks under torchrun): the communication, then
    the MoE layer across the ranks at ``layer_tokens`` tokens a rank (``bench/ep_layer.py``;
    none: no layer)."""
    params = dict(tokens=tokens, hidden=hidden, topk=topk, experts=experts, sms=list(sms),
                  slots=list(slots), calls=calls, repeats=repeats,
                  layer_tokens=list(layer_tokens))
    return run_ranks(_measure, world, params, what="ptxforge bench ep")


# ---------------------------------------------------------------------------- one rank
def _routing(rank: int, tokens: int, experts: int, topk: int, hidden: int):
    """A rank's tokens: bf16 rows quantized per token (FP8, MN-major scales), top-k
    experts drawn uniformly without repetition, softmax-like weights."""
    from .. import ops

    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    idx = torch.rand(tokens, experts, device="cuda", generator=g).topk(topk, dim=1).indices
    weights = torch.rand(tokens, topk, device="cuda", generator=g)
    return x, ops.quantize_fp8_per_token(x), idx.contiguous(), weights / weights.sum(1, True)


def _measure(rank: int, world: int, p: dict) -> dict | None:
    import torch.distributed as dist

    from ..ep import Buffer, Config, buffer_size

    device = torch.cuda.current_device()
    distinct = torch.cuda.device_count() >= world
    configs = [Config(s, n) for s in p["sms"] for n in p["slots"]]
    hidden, topk, experts = p["hidden"], p["topk"], p["experts"]
    x, (q, scales), idx, weights = _routing(rank, p["tokens"], experts, topk, hidden)
    nbytes = max(buffer_size(world, hidden, topk, fp8=True, config=c) for c in configs)
    buffer = Buffer(dist.group.WORLD, nbytes, timeout_s=60.0)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
    sent = in_rank.clone()
    sent[:, rank] = False
    rows_out = int(sent.sum())
    row_bytes = hidden + 4 * (hidden // 128)
    dispatch_bytes, combine_bytes = rows_out * row_bytes, rows_out * 2 * hidden

    sweep = []
    for config in configs:
        received, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            (q, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights, config=config)
        again = buffer.dispatch((q, scales), handle=handle, config=config)[0]
        if not torch.equal(again[0].view(torch.uint8), received[0].view(torch.uint8)):
            raise RuntimeError(f"rank {rank}: a cached dispatch received other rows ({config})")
        y = torch.randn(received[0].shape, device="cuda").bfloat16()  # the experts' rows
        dispatch_us = batch_us(lambda: buffer.dispatch((q, scales), handle=handle,
                                                        config=config), p["calls"], p["repeats"])
        combine_us = batch_us(lambda: buffer.combine(y, handle, config=config), p["calls"],
                               p["repeats"])
        sweep.append(dict(sms=config.num_sms, slots=config.ring_slots, dispatch_us=dispatch_us,
                          combine_us=combine_us))

    # The worst case's dispatch on SM_BUDGET SMs: a buffer with room for its received rows
    # takes the path without rings; the rings get one sized for them alone.
    at_budget = Config(SM_BUDGET, 128)
    rings, roomy = (Buffer(dist.group.WORLD, buffer_size(
        world, hidden, topk, fp8=True, config=at_budget, num_worst_tokens=n), timeout_s=60.0)
        for n in (0, world * p["tokens"]))
    layout = (per_rank, per_expert, in_rank)
    worst = _worst_case(rings, roomy, at_budget, (q, scales), idx, weights, layout, p)
    peers = _peers(rank, world, in_rank, row_bytes, p) if distinct else {}
    overlap = (_overlap(buffer, roomy, at_budget, (q, scales), idx, weights, layout, p)
               if distinct else None)
    decode = _decode(rank, world, p)
    everyone = [None] * world
    dist.all_gather_object(everyone, dict(sweep=sweep, decode=decode, dispatch_bytes=dispatch_bytes,
                                          combine_bytes=combine_bytes, peers=peers,
                                          overlap=overlap, worst=worst,
                                          recv=int(handle.num_recv_tokens)))
    dist.barrier()
    for used in (buffer, rings, roomy):
        used.destroy()
    layer = None
    if p["layer_tokens"]:
        from . import ep_layer

        layer = ep_layer.measure(rank, world, dict(tokens=p["layer_tokens"], hidden=hidden,
                                                   experts=experts, topk=topk))
    if rank:
        return None
    result = _summary(everyone, p, world, distinct, torch.cuda.get_device_name(device))
    if distinct:   # a GPU a rank (NVLink): what Buffer.get_dispatch_config returns from now on
        from ..ep import tuning

        c, row = result["picked"], picked_row(result)
        result["stored"] = str(tuning.store(result["device"], world, c["sms"], c["slots"],
                                            SM_BUDGET, dispatch_us=row["dispatch_us"],
                                            combine_us=row["combine_us"]))
    return dict(result, layer=layer)


def fits_default_buffer(sms: int, slots: int) -> bool:
    """Within the SM budget, and no more rings' room than ``buffer_size``'s default config
    makes: what a stored pick may be (a buffer sized by default must hold it)."""
    from ..ep.buffer import DEFAULT_NUM_SMS, DEFAULT_SLOTS

    return sms <= SM_BUDGET and sms * slots <= DEFAULT_NUM_SMS * DEFAULT_SLOTS


def picked_row(result: dict) -> dict:
    """The sweep's row of the picked config."""
    c = result["picked"]
    return next(r for r in result["sweep"] if (r["sms"], r["slots"]) == (c["sms"], c["slots"]))


def _summary(everyone: list, p: dict, world: int, distinct: bool, device_name: str) -> dict:
    """Per config the slowest rank's times and the bytes every rank sent over them; the
    config picked (the least dispatch + combine time among those ``fits_default_buffer``
    takes: one config serves a dispatch and its combine)."""
    dispatch_bytes = sum(r["dispatch_bytes"] for r in everyone) / world
    combine_bytes = sum(r["combine_bytes"] for r in everyone) / world
    sweep = []
    for i, row in enumerate(everyone[0]["sweep"]):
        d_us = max(r["sweep"][i]["dispatch_us"] for r in everyone)
        c_us = max(r["sweep"][i]["combine_us"] for r in everyone)
        sweep.append(dict(row, dispatch_us=d_us, combine_us=c_us,
                          dispatch_gbs=dispatch_bytes / d_us / 1e3,
                          combine_gbs=combine_bytes / c_us / 1e3))
    within = [r for r in sweep if fits_default_buffer(r["sms"], r["slots"])] or sweep
    best = min(within, key=lambda r: r["dispatch_us"] + r["combine_us"])
    return dict(params=p, world=world, distinct_gpus=distinct, device=device_name,
                dispatch_bytes_per_rank=dispatch_bytes, combine_bytes_per_rank=combine_bytes,
                sweep=sweep, picked=dict(sms=best["sms"], slots=best["slots"]),
                peers=everyone[0]["peers"], overlap=[r["overlap"] for r in everyone],
                decode={key: max(r["decode"][key] for r in everyone)
                        for key in everyone[0]["decode"]},
                worst={key: max(r["worst"][key] for r in everyone)
                       for key in everyone[0]["worst"]})


def _worst_case(rings, roomy, config, x, idx, weights, layout, p: dict) -> dict:
    """A dispatch sized for the worst case (``num_worst_tokens``: no host synchronisation,
    the counts exchanged by the GPU's exchange kernel, which each call includes) and its
    combine with ``config`` (SM_BUDGET SMs): through the buffer ``rings``, and through
    ``roomy``, which has room for the received rows, written in place by the direct
    dispatch (every SM sending) and combined by the pull combine (every SM loading the rows
    from their ranks' buffers).
    ``calls`` dispatches, then ``calls`` combines, are captured in a CUDA graph each (the
    path never waits for the host) and replayed: a call's time by events over the replay,
    and each kernel's median from the profiler. Both ways receive and combine the same
    bits, or this raises."""
    import torch.distributed as dist

    per_rank, per_expert, in_rank = layout
    worst = dist.get_world_size() * p["tokens"]
    experts_output = torch.randn(worst, p["hidden"], device="cuda").bfloat16()
    times, received, combined = {}, [], []
    for name, through in (("rings", rings), ("direct", roomy)):
        dispatch = lambda: through.dispatch(x, num_tokens_per_rank=per_rank,
                                            is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=idx,
                                            topk_weights=weights, num_worst_tokens=worst,
                                            config=config)
        (rows, row_scales), *_, handle, _ = dispatch()  # every kernel built before a capture
        n = int(handle.num_recv)
        received.append((rows[:n].view(torch.uint8).clone(), row_scales[:n].clone()))
        y = through.combine_input(handle) if handle.direct is not None else torch.empty_like(
            experts_output)
        y.copy_(experts_output)
        combine = lambda: through.combine(y, handle, config=config)
        combined.append(combine()[0].clone())
        for op, fn in (("dispatch", dispatch), ("combine", combine)):
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(p["calls"]):
                    fn()
            times[f"{name}_{op}_call_us"] = batch_us(graph.replay, 1, p["repeats"]) / p["calls"]
            kernels = _replay_kernel_medians(graph, p["repeats"], _worst_case_kernel)
            times.update({f"{name}_{kernel}_us": us for kernel, us in kernels.items()})
    if not all(torch.equal(a, b) for a, b in zip(*received)):
        raise RuntimeError("the direct dispatch received other rows than the rings")
    if not torch.equal(*combined):
        raise RuntimeError("the pull combine summed other bits than the ring combine")
    return times


def _worst_case_kernel(name: str) -> str | None:
    """A worst-case dispatch's and combine's kernels (OVERLAP_KERNELS's but the GEMM): the
    count exchange, either dispatch kernel and either combine kernel."""
    return next((op for op, prefixes in OVERLAP_KERNELS.items()
                 if op != "gemm" and name.startswith(prefixes)), None)


def _decode(rank: int, world: int, p: dict) -> dict:
    """The decode path at DECODE_TOKENS tokens a rank: DECODE_PAIRS dispatch + combine
    pairs captured in one CUDA graph, replayed after a host barrier under the profiler;
    each kernel's median time (a pair's kernels wait for the peer's, so this is the time
    from the later rank's start), and the replay's time per pair by events; then the same
    with the receive hooks, each half's kernel timed apart; then both again with the
    weights sent by the dispatch (the MoE layer's decode path), whose combine sums on the
    experts' ranks (``combine_summed_us``, ``summed_pair_us``; the dispatch given the
    weights: ``dispatch_weighted_us``)."""
    import torch.distributed as dist

    from ..ep import Buffer

    hidden, experts, topk = p["hidden"], p["experts"], p["topk"]
    size = Buffer.get_low_latency_rdma_size_hint(DECODE_TOKENS, hidden, world, experts)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, timeout_s=60.0)
    x, _, idx, weights = _routing(rank, DECODE_TOKENS, experts, topk, hidden)
    y = torch.randn(experts // world, world * DECODE_TOKENS, hidden, device="cuda").bfloat16()

    def pair(hooked: bool, summed: bool):
        _, _, handle, _, hook = buffer.low_latency_dispatch(
            x, idx, DECODE_TOKENS, experts, return_recv_hook=hooked,
            topk_weights=weights if summed else None)
        if hooked:
            hook()
        _, _, hook = buffer.low_latency_combine(y, idx, weights, handle, return_recv_hook=hooked)
        if hooked:
            hook()

    result = {}
    for summed in (False, True):
        for hooked in (False, True):
            pair(hooked, summed)  # every kernel built and loaded before the capture
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(DECODE_PAIRS):
                    pair(hooked, summed)
            if not hooked:
                result["summed_pair_us" if summed else "pair_us"] = batch_us(
                    graph.replay, 1, p["repeats"]) / DECODE_PAIRS
            medians = _replay_kernel_medians(graph, p["repeats"], _low_latency_kernel)
            # With the weights the dispatch is the same kernel given more to send: its
            # times are kept apart (dispatch_weighted_*).
            result.update({name.replace("dispatch", "dispatch_weighted") if summed else name: us
                           for name, us in medians.items() if summed or "summed" not in name})
    buffer.destroy()
    return result


def _low_latency_kernel(name: str) -> str | None:
    """The decode path's kernels keyed by op and phase: dispatch_us (both halves in one
    kernel), dispatch_send_us, dispatch_receive_us, the same for combine."""
    if not name.startswith("ep_ll_"):
        return None
    op, phase = name.split("_")[2:4]  # ep_ll_<op>_<phase>_..., "_summed" last if it is
    if name.endswith("_summed"):
        op += "_summed"
    return f"{op}_us" if phase == "both" else f"{op}_{phase}_us"


def _replay_kernel_medians(graph, repeats: int, key) -> dict:
    """The median time (us) of each kernel ``key`` names (None: not counted) over
    ``repeats`` replays of ``graph``, from the profiler, after a host barrier."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        name = key(event.name) if event.device_type.name == "CUDA" else None
        if name:
            times.setdefault(name, []).append(event.time_range.end - event.time_range.start)
    torch.cuda.synchronize()
    dist.barrier()
    return {name: statistics.median(values) for name, values in times.items()}


def _peers(rank: int, world: int, in_rank, row_bytes: int, p: dict) -> dict:
    """The copy engine's one-direction P2P copy of 1 GiB (rank 0 to rank 1's GPU); with
    three ranks or more, rank 0's copies of EVERY_PEER_BYTES to every other rank's GPU at
    once, a stream each (what a dispatch by the copy engines alone would move: at top-8 of
    256 over 4 ranks about 90% of the tokens go to each rank, so sending every token to
    every rank costs about 10% more bytes and no SM); and NCCL's all_to_all_single: the FP8
    dispatch's bytes (each rank's rows to each rank as uint8 rows of row_bytes), the bf16
    combine's (the rows back) and the anchor's bf16 4096 x 7168."""
    import torch.distributed as dist

    out = {}
    if rank == 0:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=0)
        dst = torch.empty(1 << 30, dtype=torch.uint8, device=1)
        out["p2p_copy_gbs"] = (1 << 30) / batch_us(lambda: dst.copy_(src), 1, 5,
                                                    together=False) / 1e3
        if world > 2:
            out["p2p_every_peer_gbs"] = _every_peer_gbs(src[:EVERY_PEER_BYTES], world)
    dist.barrier()
    nccl = dist.new_group(backend="nccl")
    to_rank = in_rank.sum(0).tolist()
    from_rank = [None] * world
    dist.all_gather_object(from_rank, to_rank)
    recv_splits = [from_rank[r][rank] for r in range(world)]
    send = torch.empty(sum(to_rank), row_bytes, dtype=torch.uint8, device="cuda")
    recv = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device="cuda")
    dispatch_like = lambda: dist.all_to_all_single(recv, send, recv_splits, to_rank, group=nccl)
    out["nccl_dispatch_bytes_us"] = batch_us(dispatch_like, p["calls"], p["repeats"])
    # The combine's bytes: bf16 rows back the other way.
    back, back_out = (torch.empty(n, 2 * p["hidden"], dtype=torch.uint8, device="cuda")
                      for n in (sum(recv_splits), sum(to_rank)))
    combine_like = lambda: dist.all_to_all_single(back_out, back, to_rank, recv_splits,
                                                  group=nccl)
    out["nccl_combine_bytes_us"] = batch_us(combine_like, p["calls"], p["repeats"])
    square = torch.empty(4096, 7168, dtype=torch.bfloat16, device="cuda")
    square_out = torch.empty_like(square)
    out["nccl_bf16_4096x7168_us"] = batch_us(
        lambda: dist.all_to_all_single(square_out, square, group=nccl), p["calls"], p["repeats"])
    dist.destroy_process_group(nccl)
    return out


def _every_peer_gbs(src: torch.Tensor, world: int) -> float:
    """GB/s out of GPU 0 while it copies ``src`` to each of GPUs 1 .. world - 1 at once, a
    stream each (the copy engines), bytes sent over the time of all the copies."""
    dsts = [torch.empty_like(src, device=d) for d in range(1, world)]
    streams = [torch.cuda.Stream(0) for _ in dsts]

    def every_peer():
        current = torch.cuda.current_stream(0)
        for dst, stream in zip(dsts, streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    return len(dsts) * src.numel() / batch_us(every_peer, 1, 5, together=False) / 1e3


def _overlap(buffer, roomy, config, x, idx, weights, layout, p) -> dict:
    """Dispatch + combine on SM_BUDGET SMs beside the received tokens' grouped FP8 GEMM
    (gate_up, N = GEMM_N) on the other SMs: each alone, then together on two streams;
    through the rings (cached calls) and, under "direct", the path without rings (a
    dispatch sized for the worst case, its count exchange included, on ``roomy``, a buffer
    with room for the rows, and the pull combine)."""
    import torch.distributed as dist

    from .. import ops
    from .ops import group_weights, padded_rows

    per_rank, per_expert, in_rank = layout
    align = ops.get_mk_alignment_for_contiguous_layout()
    received, _, _, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights, config=config,
        expert_alignment=align)
    rows = []
    for group, (size, padded) in enumerate(zip(counts, padded_rows(counts))):
        rows += [group] * size + [-1] * (padded - size)
    m_indices = torch.tensor(rows, dtype=torch.int32, device="cuda")
    a = ops.quantize_fp8_per_token(torch.randn(len(rows), p["hidden"], device="cuda").bfloat16())
    _, b = group_weights(len(counts), GEMM_N, p["hidden"])
    d = torch.empty(len(rows), GEMM_N, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(received[0].shape, device="cuda").bfloat16()
    device = torch.cuda.current_device()
    gemm_sms = torch.cuda.get_device_properties(device).multi_processor_count - SM_BUDGET
    worst = dist.get_world_size() * p["tokens"]

    def gemm():
        ops.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, num_sms=gemm_sms)

    def through_rings():
        buffer.dispatch(x, handle=handle, config=config)
        buffer.combine(y, handle, config=config)

    def direct():
        *_, sent, _ = roomy.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights,
            num_worst_tokens=worst, config=config)
        roomy.combine(roomy.combine_input(sent), sent, config=config)

    gemm_us = batch_us(gemm, 4, p["repeats"])
    result = dict(gemm_sms=gemm_sms, comm_sms=SM_BUDGET, gemm_rows=len(rows), gemm_us=gemm_us)
    for name, comm in (("rings", through_rings), ("direct", direct)):
        result[name] = _beside(gemm, comm, gemm_us, p)
    return result


def _beside(gemm, comm, gemm_us: float, p: dict) -> dict:
    """``comm`` alone, then beside ``gemm`` (on a stream of its own): the times, and each
    kernel's alone and in one overlapped call, with when it started."""
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gemm()
        comm()
        torch.cuda.current_stream().wait_stream(side)

    comm_us, both_us = (batch_us(fn, 4, p["repeats"]) for fn in (comm, both))
    alone, together = {**_kernel_spans(gemm), **_kernel_spans(comm)}, _kernel_spans(both)
    first = min(start for start, _ in together.values())
    kernels = {name: dict(alone_us=alone[name][1] - alone[name][0],
                          together_us=end - start, start_us=start - first)
               for name, (start, end) in together.items()}
    return dict(comm_us=comm_us, overlapped_us=both_us, ratio=both_us / (gemm_us + comm_us),
                over_longer=both_us / max(gemm_us, comm_us), kernels=kernels)


# The kernels of a dispatch + combine beside the grouped GEMM, by name prefix.
OVERLAP_KERNELS = {"gemm": ("sm90_",), "exchange": ("ep_exchange_",),
                   "dispatch": ("ep_intranode_dispatch", "ep_direct_dispatch"),
                   "combine": ("ep_intranode_combine", "ep_pull_combine")}


def _kernel_spans(fn) -> dict:
    """One call of ``fn`` under the profiler, after a host barrier: each of its
    OVERLAP_KERNELS's (start, end) in us, on the GPU's clock."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        for name, prefixes in OVERLAP_KERNELS.items():
            if event.name.startswith(prefixes) and name not in spans:
                spans[name] = (event.time_range.start, event.time_range.end)
    return spans


# ---------------------------------------------------------------------------- report
def ep_table(result: dict) -> str:
    p = result["params"]
    one_gpu = " (all on ONE GPU under MPS: no NVLink, no peers)"
    head = (f"ptxforge.ep intranode, {result['world']} ranks on {result['device']}"
            f"{'' if result['distinct_gpus'] else one_gpu}"
            f"; {p['tokens']} tokens a rank, H = {p['hidden']}, top-{p['topk']} of "
            f"{p['experts']} experts; FP8 dispatch, bf16 combine. Bytes crossing a rank: "
            f"{result['dispatch_bytes_per_rank'] / 1e6:.1f} MB dispatch, "
            f"{result['combine_bytes_per_rank'] / 1e6:.1f} MB combine; a call's time: the "
            f"median of batches of {p['calls']} cached calls, the slowest rank's.")
    rows = [[r["sms"], r["slots"], f"{r['dispatch_us']:.1f}", f"{r['dispatch_gbs']:.0f}",
             f"{r['combine_us']:.1f}", f"{r['combine_gbs']:.0f}"] for r in result["sweep"]]
    text = head + "\n\n" + format_table(
        ["SMs", "ring slots", "dispatch us", "GB/s", "combine us", "GB/s"], rows)
    c = result["picked"]
    text += (f"\n\npicked (the least dispatch + combine time on <= {SM_BUDGET} SMs, within the "
             f"default buffer): {c['sms']} SMs x {c['slots']} slots")
    if result.get("stored"):
        text += f", stored in {result['stored']}"
    peers = result["peers"]
    if peers:
        row = picked_row(result)
        for op in ("dispatch", "combine"):
            gbs = row[f"{op}_gbs"]
            text += f"\n{op}: {gbs:.0f} GB/s = {gbs / peers['p2p_copy_gbs']:.0%} of the P2P copy"
        nccl_gbs = result["dispatch_bytes_per_rank"] / peers["nccl_dispatch_bytes_us"] / 1e3
        combine_gbs = result["combine_bytes_per_rank"] / peers["nccl_combine_bytes_us"] / 1e3
        if "p2p_every_peer_gbs" in peers:
            text += (f"\ncopy engines, GPU 0 to the {result['world'] - 1} others at once "
                     f"({EVERY_PEER_BYTES >> 20} MiB each): {peers['p2p_every_peer_gbs']:.0f} "
                     f"GB/s out")
        text += (f"\nP2P copy engine, 1 GiB one direction: {peers['p2p_copy_gbs']:.0f} GB/s"
                 f"\nNCCL all_to_all_single, the FP8 dispatch's bytes: "
                 f"{peers['nccl_dispatch_bytes_us']:.1f} us ({nccl_gbs:.0f} GB/s); the bf16 "
                 f"combine's: {peers['nccl_combine_bytes_us']:.1f} us ({combine_gbs:.0f} GB/s)"
                 f"\nNCCL all_to_all_single bf16 4096x7168: "
                 f"{peers['nccl_bf16_4096x7168_us']:.1f} us")
    w = result["worst"]
    text += (f"\nsized for the worst case (num_worst_tokens: no host sync, in CUDA graphs), "
             f"{SM_BUDGET} SMs, a call (its kernels):")
    for name, how in (("rings", "through the rings"),
                      ("direct", "direct dispatch, pull combine")):
        text += (f"\n  {how}: dispatch {w[f'{name}_dispatch_call_us']:.1f} us (exchange "
                 f"{w[f'{name}_exchange_us']:.1f}, dispatch {w[f'{name}_dispatch_us']:.1f}: "
                 f"{result['dispatch_bytes_per_rank'] / w[f'{name}_dispatch_us'] / 1e3:.0f} "
                 f"GB/s), combine {w[f'{name}_combine_call_us']:.1f} us (kernel "
                 f"{w[f'{name}_combine_us']:.1f}: "
                 f"{result['combine_bytes_per_rank'] / w[f'{name}_combine_us'] / 1e3:.0f} GB/s)")
    d = result["decode"]
    text += (f"\ndecode, {DECODE_TOKENS} tokens a rank (CUDA graph replay, the slowest rank's "
             f"median kernel): dispatch {d['dispatch_us']:.1f} us, combine "
             f"{d['combine_us']:.1f} us; a dispatch + combine pair {d['pair_us']:.1f} us")
    if "dispatch_send_us" in d:
        text += ("\n  halves apart (the hooks): " + ", ".join(
            f"{op} {phase} {d[f'{op}_{phase}_us']:.1f} us" for op in ("dispatch", "combine")
            for phase in ("send", "receive")))
    if "combine_summed_us" in d:
        weighted = (f"dispatch {d['dispatch_weighted_us']:.1f} us (send "
                    f"{d['dispatch_weighted_send_us']:.1f}, receive "
                    f"{d['dispatch_weighted_receive_us']:.1f} apart), "
                    if "dispatch_weighted_us" in d else "")
        text += (f"\n  the weights sent with the dispatch (the layer's): {weighted}combine "
                 f"summed on the experts' ranks {d['combine_summed_us']:.1f} us (send "
                 f"{d['combine_summed_send_us']:.1f}, receive "
                 f"{d['combine_summed_receive_us']:.1f} apart); a pair "
                 f"{d['summed_pair_us']:.1f} us")
    for rank, o in enumerate(result["overlap"]):
        if not o:
            continue
        text += (f"\noverlap, rank {rank}: grouped FP8 GEMM ({o['gemm_rows']} rows, "
                 f"{o['gemm_sms']} SMs) {o['gemm_us']:.1f} us beside dispatch + combine "
                 f"({o['comm_sms']} SMs)")
        for way, how in (("rings", "through the rings"),
                         ("direct", "direct dispatch (exchange included), pull combine")):
            w = o[way]
            text += (f"\n  {how}: {w['comm_us']:.1f} us, together {w['overlapped_us']:.1f} us = "
                     f"{w['ratio']:.2f} x their sum, {w['over_longer']:.2f} x the longer")
            text += "\n    in one overlapped call (profiler): " + ", ".join(
                f"{name} {k['alone_us']:.0f} -> {k['together_us']:.0f} us (x"
                f"{k['together_us'] / k['alone_us']:.2f}), starting at +{k['start_us']:.0f} us"
                for name, k in w["kernels"].items())
    if result.get("layer"):
        from .ep_layer import layer_table

        text += "\n\n" + layer_table(result["layer"])
    return text


def ep_plot(result: dict, path: str) -> None:
    """GB/s against SMs, a line per ring size, dispatch and combine side by side, the
    direct dispatch and the pull combine (their kernels, sized for the worst case) as a
    point at SM_BUDGET; NCCL's all_to_all_single of the same bytes and the P2P copy as
    horizontal lines."""
    plt = pyplot()
    if plt is None:
        return
    layer = result.get("layer")
    fig, axes = plt.subplots(1, 3 if layer else 2, figsize=(16 if layer else 11, 4))
    peers = result["peers"]
    for ax, op in zip(axes, ("dispatch", "combine")):
        for slots in result["params"]["slots"]:
            rows = [r for r in result["sweep"] if r["slots"] == slots]
            ax.plot([r["sms"] for r in rows], [r[f"{op}_gbs"] for r in rows], marker="o",
                    label=f"ring {slots} slots")
        nbytes = result[f"{op}_bytes_per_rank"]
        ax.plot([SM_BUDGET], [nbytes / result["worst"][f"direct_{op}_us"] / 1e3], marker="*",
                markersize=12, linestyle="none", color="tab:red",
                label="direct dispatch / pull combine")
        if peers:
            ax.axhline(peers["p2p_copy_gbs"], color="gray", linestyle=":", label="P2P copy")
            nccl = nbytes / peers[f"nccl_{op}_bytes_us"] / 1e3
            ax.axhline(nccl, color="black", linestyle="--", label="NCCL all_to_all, same bytes")
        ax.set_title(f"{op} ({'FP8' if op == 'dispatch' else 'bf16'})")
        ax.set_xlabel("SMs")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s crossing a rank")
    axes[1].legend(fontsize=8)
    if layer:
        _layer_bars(axes[2], layer)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _layer_bars(ax, layer: dict) -> None:
    """The MoE layer's time per token count, ours (each normal-path mode) beside its two
    peers."""
    names = (("ours_us", "ptxforge (ep=buffer)"),
             ("bounded_us", "ptxforge, max_tokens_per_rank (no host sync)"),
             ("wide_us", f"the same, {layer['params'].get('wide_sms')} SMs"),
             ("direct_us", "the same, direct dispatch + pull combine"),
             ("graph_us", "the same, CUDA graph"),
             ("nccl_us", "NCCL + ptxforge experts"),
             ("grouped_mm_us", "grouped_mm + all_to_all"))
    rows, width = layer["rows"], 0.11
    for i, (key, label) in enumerate(names):
        ax.bar([j + width * (i - 3) for j in range(len(rows))],
               [r.get(key, 0.0) / 1e3 for r in rows], width=width, label=label)
    ax.set_xticks(range(len(rows)), [f"{r['tokens']} tokens" for r in rows])
    ax.set_ylabel("ms a layer")
    ax.set_title(f"MoE layer, {layer['world']} ranks")
    ax.legend(fontsize=7)
