"""ptxforge.ep on the CPU: the kernels assemble with no spills and say what the protocol
needs (system-scope acquire/release counters, no non-coherent loads of the rings, timed
waits); the buffer plan; the host's receive layout against the torch reference; argument
checks that need no GPU."""

from __future__ import annotations

import pytest

from ptxforge import arch, jit
from ptxforge.kernels.ep_intranode import combine as combine_kernel
from ptxforge.kernels.ep_intranode import dispatch as dispatch_kernel
from ptxforge.kernels.ep_intranode import exchange as exchange_kernel
from ptxforge.kernels.ep_intranode import layout as layout_kernel
from ptxforge.kernels.ep_intranode import plan as ep_plan

torch = pytest.importorskip("torch")

from ptxforge.ep import buffer_size, checks  # noqa: E402
from ptxforge.ep.layout import Message, check_agreement, receive_layout  # noqa: E402
from support import ep_reference as reference  # noqa: E402

SM90 = arch.get("sm_90a")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def assembles_cleanly(builder):
    """The kernel assembled with no spills, no stack frame and no warning."""
    compiled = jit.build(builder)
    assert compiled.resources.spills == 0, compiled.log
    assert compiled.resources.stack_frame == 0, compiled.log
    assert "warning" not in compiled.log.lower(), compiled.log
    return compiled


# ---------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("hidden, dtype", [(128, "bf16"), (7168, "bf16"), (2048, "e4m3"),
                                           (7168, "e4m3"), (16384, "bf16")])
@pytest.mark.parametrize("with_topk", [True, False])
def test_dispatch_variants_assemble_without_spills(ranks, hidden, dtype, with_topk):
    cfg = dispatch_kernel.choose_config(SM90, ranks, hidden, 8, fp8=dtype == "e4m3",
                                        with_topk=with_topk, num_sms=24, slots=256)
    compiled = assembles_cleanly(dispatch_kernel.generate(cfg))
    assert compiled.launch.cooperative and compiled.launch.block == cfg.threads


@pytest.mark.parametrize("ranks", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("hidden", [8, 256, 7168, 16384])
@pytest.mark.parametrize("topk", [0, 8, 32])
def test_combine_variants_assemble_without_spills(ranks, hidden, topk):
    cfg = combine_kernel.choose_config(SM90, ranks, hidden, topk=topk, num_sms=2, slots=64)
    assembles_cleanly(combine_kernel.generate(cfg))


@pytest.mark.parametrize("experts, ranks, topk", [(8, 2, 1), (256, 8, 8), (4096, 8, 32),
                                                  (6, 3, 2)])
def test_layout_variants_assemble_without_spills(experts, ranks, topk):
    assembles_cleanly(layout_kernel.generate(layout_kernel.choose_config(SM90, experts, ranks, topk)))


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_exchange_variants_assemble_without_spills(ranks):
    assembles_cleanly(exchange_kernel.generate(exchange_kernel.choose_config(SM90, ranks)))


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("hidden, topk", [(7168, 8), (2048, 6), (256, 1)])
def test_direct_dispatch_variants_assemble_without_spills(ranks, hidden, topk):
    from ptxforge.kernels.ep_intranode import direct

    assembles_cleanly(direct.generate(direct.choose_config(SM90, ranks, hidden, topk,
                                                           num_sms=20)))


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("hidden", [8, 256, 7168, 16384])
def test_pull_combine_variants_assemble_without_spills(ranks, hidden):
    from ptxforge.kernels.ep_intranode import pull

    compiled = assembles_cleanly(pull.generate(pull.choose_config(SM90, ranks, hidden,
                                                                  num_sms=20)))
    assert not compiled.launch.cooperative


def _body(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if line.strip() and
            not line.strip().startswith("//")]


def test_dispatch_protocol_in_the_ptx():
    """Counters: the base read relaxed, waits acquire, publications release, all at system
    scope; the rings' payload read without the non-coherent path; every wait timed, with a
    record and a trap, and so is an entry whose signature is not the receiver's."""
    cfg = dispatch_kernel.choose_config(SM90, 2, 2048, 4, fp8=True, num_sms=4, slots=64)
    lines = _body(dispatch_kernel.generate(cfg).ptx())
    # head, tail: each polled, and looked at once more past the time limit
    assert sum("ld.acquire.sys.global.u32" in line for line in lines) == 4
    assert sum("st.release.sys.global.u32" in line for line in lines) == 2  # tail, head
    assert sum("ld.relaxed.sys.global.u32" in line for line in lines) == 2  # the bases
    assert sum(line == "trap;" for line in lines) == 3
    assert sum("st.relaxed.sys.global.v4.b32 [%error]" in line for line in lines) == 3
    assert sum(f"st.global.u32 [%entry_at+{cfg.slot.signature}], {cfg.signature};" in line
               for line in lines) == 1
    assert sum(f"setp.ne.u32 %mismatch, %sent_for, {cfg.signature};" in line
               for line in lines) == 1
    # Only the sender's inputs and what the host wrote before the launch go through .nc.
    nc = [line for line in lines if ".nc" in line]
    assert all(("%copy" in line or "%flag" in line or "%scale" in line or "%topk" in line or
                "%recv_" in line or "_buffer" in line) for line in nc), nc
    receive = lines[next(i for i, line in enumerate(lines) if "not_a_sender" in line
                         and line.endswith(":")):]
    assert not [line for line in receive if line.startswith("ld.global.nc")
                and "layout_at" not in line and "own_buffer" not in line]
    assert sum("bar.sync %group_barrier" in line for line in lines) == 3


def test_combine_sums_in_rank_order_in_f32():
    cfg = combine_kernel.choose_config(SM90, 4, 256, num_sms=2, slots=64)
    lines = _body(combine_kernel.generate(cfg).ptx())
    adds = [line for line in lines if line.startswith("@%has") and "add.rn.f32" in line]
    assert cfg.unroll == 4
    assert len(adds) == 4 * 4 * 8  # 8 f32 sums a vector, one add each per rank, 4 vectors
    assert [line.split()[0] for line in adds[::8]] == ["@%has0", "@%has1", "@%has2",
                                                       "@%has3"] * 4
    assert sum("cvt.rn.bf16x2.f32" in line for line in lines) == 4 * 4
    assert not any("fma" in line for line in lines)


def test_kernels_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="multiple of 128 for e4m3"):
        dispatch_kernel.choose_config(SM90, 2, 100, 4, fp8=True)
    with pytest.raises(ValueError, match="1 to 32 columns"):
        dispatch_kernel.choose_config(SM90, 2, 128, 33, fp8=False)
    with pytest.raises(ValueError, match="power of two"):
        combine_kernel.choose_config(SM90, 2, 128, slots=96)
    with pytest.raises(ValueError, match="2 to 8 ranks"):
        combine_kernel.choose_config(SM90, 9, 128)
    with pytest.raises(ValueError, match="1 to 64 channels"):
        combine_kernel.choose_config(SM90, 2, 128, num_sms=130)
    with pytest.raises(ValueError, match="griddepcontrol"):
        combine_kernel.choose_config(arch.get("sm_80"), 2, 128)
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        layout_kernel.choose_config(SM90, 8, 3, 2)


# ---------------------------------------------------------------------------- plan
@pytest.mark.parametrize("ranks, channels, slots, hidden, topk, fp8", [
    (2, 1, 64, 8, 1, False), (8, 10, 128, 7168, 8, False), (8, 10, 128, 7168, 8, True),
    (3, 7, 256, 2048, 6, True)])
def test_plan_regions_are_aligned_and_disjoint(ranks, channels, slots, hidden, topk, fp8):
    plan = ep_plan.BufferPlan(ranks, channels, slots, hidden)
    slot = ep_plan.DispatchSlot(hidden, topk, fp8)
    parts = [0, slot.scales, slot.topk_idx, slot.topk_weights, slot.source, slot.bytes]
    assert parts == sorted(parts) and all(p % 16 == 0 for p in parts)
    assert slot.source + 4 == slot.signature and slot.signature + 4 <= slot.bytes
    assert slot.scales - 0 >= slot.row_bytes
    assert slot.topk_idx - slot.scales >= 4 * slot.scale_groups
    assert slot.topk_weights - slot.topk_idx >= 8 * topk
    assert slot.source - slot.topk_weights >= 4 * topk
    counters_end = len(ep_plan.COUNTERS) * ep_plan.COUNTER_BYTES
    last_counter = plan.counter("combine_tail", ep_plan.MAX_CHANNELS - 1, ep_plan.MAX_RANKS - 1)
    assert last_counter + 4 == counters_end == ep_plan.EXCHANGE_FLAGS
    # The exchange: a flag per rank, then two parities of a message slot per rank, 16-aligned.
    assert ep_plan.EXCHANGE_SLOTS - ep_plan.EXCHANGE_FLAGS == 4 * ep_plan.MAX_RANKS
    assert ep_plan.EXCHANGE_SLOTS % 16 == 0 and (4 * ep_plan.MESSAGE_WORDS) % 16 == 0
    last_slot = exchange_kernel.slot_offset(1, ep_plan.MAX_RANKS - 1)
    assert last_slot + 4 * ep_plan.MESSAGE_WORDS == ep_plan.EXCHANGE_END <= plan.combine_rings
    assert plan.combine_rings + channels * ranks * plan.combine_ring_bytes <= plan.dispatch_rings
    assert plan.combine_weights >= 2 * hidden and plan.combine_slot_bytes % 16 == 0
    assert plan.combine_signature >= plan.combine_weights + 4 * ep_plan.MAX_TOPK
    assert plan.combine_signature + 4 <= plan.combine_slot_bytes
    assert plan.bytes_needed(slot) == plan.dispatch_rings + channels * ranks * slots * slot.bytes
    assert plan.combine_rings % 1024 == 0 and plan.dispatch_rings % 1024 == 0


def test_counters_do_not_move_with_the_call():
    """The counters carry over from call to call, so their place depends on nothing."""
    a = ep_plan.BufferPlan(2, 1, 64, 8)
    b = ep_plan.BufferPlan(8, 64, 1024, 16384)
    for name in ep_plan.COUNTERS:
        assert a.counter(name, 3, 1) == b.counter(name, 3, 1)


def test_signatures_tell_the_sizes_apart():
    sizes = [(h, k, fp8, c, s) for h in (128, 256) for k in (0, 8) for fp8 in (False, True)
             for c in (1, 10) for s in (64, 128)]
    words = {ep_plan.signature("dispatch", *size) for size in sizes}
    assert len(words) == len(sizes) and all(0 < w < 2 ** 31 for w in words)
    a = combine_kernel.choose_config(SM90, 2, 256, num_sms=4, slots=64)
    b = combine_kernel.choose_config(SM90, 2, 256, num_sms=4, slots=128)
    assert a.signature != b.signature


def test_buffer_size_is_the_plan_s():
    assert buffer_size(8, 7168, 8) == ep_plan.BufferPlan(8, 10, 128, 7168).bytes_needed(
        ep_plan.DispatchSlot(7168, 8, False))
    assert buffer_size(8, 7168, 8, fp8=True) < buffer_size(8, 7168, 8)


def test_a_buffer_for_the_worst_case_holds_the_direct_dispatch_s_outputs_past_the_rings():
    from ptxforge.ep.buffer import direct_region

    rings = buffer_size(4, 7168, 8, fp8=True)
    size = buffer_size(4, 7168, 8, fp8=True, num_worst_tokens=16384)
    region = direct_region(rings, 16384, 7168, 8)
    assert region.start >= rings and region.start % 1024 == 0 and size == region.end
    parts = [region.x, region.scales, region.topk_idx, region.topk_weights, region.source,
             region.end]
    assert parts == sorted(parts) and all(p % 16 == 0 for p in parts)
    assert region.scales - region.x >= 16384 * 7168
    assert region.topk_idx - region.scales >= 4 * 16384 * 56
    assert region.topk_weights - region.topk_idx >= 8 * 16384 * 8
    assert region.source - region.topk_weights >= 4 * 16384 * 8
    assert region.end - region.source >= 4 * 16384
    assert buffer_size(4, 7168, 8, num_worst_tokens=16384) == buffer_size(4, 7168, 8)  # bf16


@pytest.mark.parametrize("tokens, channels", [(0, 3), (1, 4), (10, 3), (64, 10), (1000, 7)])
def test_channel_bounds_cover_the_tokens_in_order(tokens, channels):
    bounds = ep_plan.channel_bounds(tokens, channels)
    assert len(bounds) == channels and bounds[0][0] == 0 and bounds[-1][1] == tokens
    assert all(b0 <= e0 == b1 <= e1 for (b0, e0), (b1, e1) in zip(bounds, bounds[1:]))
    # The kernels' formula: per = ceil(T / C), begin = min(c * per, T), end = min(begin + per, T).
    per = -(-tokens // channels)
    assert bounds == [(min(c * per, tokens), min(min(c * per, tokens) + per, tokens))
                      for c in range(channels)]


# ---------------------------------------------------------------------------- layout logic
def _routing(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    drop = torch.rand((tokens, topk), generator=g) < 0.2
    return torch.where(drop, -1, idx).to(torch.int64)


def test_layout_reference_counts_like_a_loop():
    topk_idx = _routing(50, 16, 4, 0)
    per_rank, per_expert, in_rank = reference.dispatch_layout(topk_idx, 16, 4)
    for t, row in enumerate(topk_idx.tolist()):
        ranks = {e // 4 for e in row if 0 <= e < 16}
        assert in_rank[t].tolist() == [r in ranks for r in range(4)]
    assert per_expert.tolist() == [sum(row.count(e) for row in topk_idx.tolist()) for e in range(16)]
    assert per_rank.tolist() == in_rank.sum(0).tolist()
    assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool


def _messages(topk_idxs, experts, channels, signature=(("hidden", 8),)):
    ranks = len(topk_idxs)
    out = []
    for idx in topk_idxs:
        _, per_expert, in_rank = reference.dispatch_layout(idx, experts, ranks)
        counts = [in_rank[b:e].sum(0).tolist() for b, e in
                  ep_plan.channel_bounds(idx.shape[0], channels)]
        out.append(Message(signature, counts, per_expert.tolist(), 0))
    return out


@pytest.mark.parametrize("ranks, channels", [(2, 1), (2, 3), (4, 5)])
def test_receive_layout_matches_the_reference_order(ranks, channels):
    """The offsets the host hands the kernel put each source's channel c rows where the
    reference's source-then-token order has them."""
    experts = 4 * ranks
    topk_idxs = [_routing(37 + 11 * s, experts, 3, s) for s in range(ranks)]
    xs = [torch.arange(idx.shape[0]).unsqueeze(1) + 1000 * s for s, idx in enumerate(topk_idxs)]
    weights = [torch.rand(idx.shape) for idx in topk_idxs]
    messages = _messages(topk_idxs, experts, channels)
    for rank in range(ranks):
        layout = receive_layout(messages, rank, experts // ranks, 1)
        expected = reference.dispatch(rank, xs, topk_idxs, weights, experts)
        assert layout.num_recv_tokens == expected["x"].shape[0]
        assert layout.num_recv_tokens_per_expert == expected["per_expert"]
        rows = expected["x"].flatten().tolist()
        for s in range(ranks):
            _, _, in_rank = reference.dispatch_layout(topk_idxs[s], experts, ranks)
            for c, (b, e) in enumerate(ep_plan.channel_bounds(topk_idxs[s].shape[0], channels)):
                sent = [1000 * s + t for t in range(b, e) if in_rank[t, rank]]
                first = layout.offsets[s][c]
                assert layout.counts[s][c] == len(sent)
                assert rows[first:first + len(sent)] == sent
        assert len(layout.table()) == 2 * ranks * channels


def test_combine_reference_finds_each_token_s_rows_by_source_index():
    """The combine reference, against a search of every rank's received rows for the
    token's (source rank, source index)."""
    ranks, experts = 3, 6
    topk_idxs = [_routing(20 + 3 * s, experts, 2, 10 + s) for s in range(ranks)]
    xs = [torch.randn(idx.shape[0], 16).bfloat16() for idx in topk_idxs]
    weights = [torch.rand(idx.shape) for idx in topk_idxs]
    received = [reference.dispatch(d, xs, topk_idxs, weights, experts) for d in range(ranks)]
    sources = [torch.cat([torch.full((int(reference.dispatch_layout(topk_idxs[s], experts, ranks)
                                          [2][:, d].sum()),), s) for s in range(ranks)])
               for d in range(ranks)]
    ys = [r["x"] * (d + 1) for d, r in enumerate(received)]
    for rank in range(ranks):
        got = reference.combine(rank, ys, topk_idxs, experts)
        for t in range(topk_idxs[rank].shape[0]):
            acc = torch.zeros(16)
            for d in range(ranks):
                hit = (sources[d] == rank) & (received[d]["src_idx"] == t)
                assert int(hit.sum()) <= 1
                if hit.any():
                    acc = acc + ys[d][hit][0].float()
            assert torch.equal(got[t], acc.bfloat16()), t


def test_receive_layout_pads_expert_counts():
    messages = _messages([_routing(40, 8, 2, 1), _routing(30, 8, 2, 2)], 8, 2)
    plain = receive_layout(messages, 1, 4, 1).num_recv_tokens_per_expert
    padded = receive_layout(messages, 1, 4, 128).num_recv_tokens_per_expert
    assert padded == [-(-n // 128) * 128 for n in plain]


def test_disagreement_and_bad_indices_raise_on_every_rank():
    good = _messages([_routing(10, 8, 2, 0), _routing(10, 8, 2, 1)], 8, 1,
                     (("hidden", 256), ("num_experts", 8)))
    check_agreement(good)
    other = good[1]._replace(signature=(("hidden", 512), ("num_experts", 8)))
    with pytest.raises(ValueError, match="hidden: rank 0 has 256, rank 1 has 512"):
        check_agreement([good[0], other])
    with pytest.raises(ValueError, match=r"\[-1, 8\).*rank 1: 3"):
        check_agreement([good[0], good[1]._replace(bad_indices=3)])


# ---------------------------------------------------------------------------- argument checks
BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64


def _dispatch(x, idx=None, w=None, cached=False):
    return checks.dispatch_inputs(x, idx, w, device=0, cached=cached)


def test_dispatch_argument_errors_name_the_argument():
    x, idx, w = torch.zeros(4, 256, dtype=BF16), torch.zeros(4, 2, dtype=I64), torch.zeros(4, 2)
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16, got torch.float32"):
        _dispatch(x.float(), idx, w)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        _dispatch(x[0], idx, w)
    with pytest.raises(ValueError, match="multiple of 8 for bf16 rows, got 12"):
        _dispatch(torch.zeros(4, 12, dtype=BF16), idx, w)
    with pytest.raises(ValueError, match="x must be contiguous"):
        _dispatch(torch.zeros(4, 512, dtype=BF16)[:, :256], idx, w)
    with pytest.raises(TypeError, match="topk_idx must have dtype torch.int64, got torch.int32"):
        _dispatch(x, idx.int(), w)
    with pytest.raises(ValueError, match=r"topk_weights must have shape \(4, 2\), got \(4, 3\)"):
        _dispatch(x, idx, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"topk_idx must have shape \(4, 2\), got \(5, 2\)"):
        _dispatch(x, torch.zeros(5, 2, dtype=I64), torch.zeros(5, 2))
    with pytest.raises(ValueError, match="give both or neither, got topk_idx alone"):
        _dispatch(x, idx, None)
    with pytest.raises(ValueError, match="without a handle needs topk_idx"):
        _dispatch(x)
    with pytest.raises(ValueError, match="1 to 32 columns, got 33"):
        _dispatch(x, torch.zeros(4, 33, dtype=I64), torch.zeros(4, 33))
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        _dispatch(x, idx, w)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        _dispatch(x, cached=True)


def test_fp8_dispatch_arguments():
    q = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    idx, w = torch.zeros(4, 2, dtype=I64), torch.zeros(4, 2)
    with pytest.raises(TypeError, match=r"x must be a pair \(data, scales\)"):
        _dispatch((q,), idx, w)
    with pytest.raises(ValueError, match=r"x\[1\] must have shape \(4, 2\), got \(4, 3\)"):
        _dispatch((q, torch.zeros(4, 3)), idx, w)
    with pytest.raises(TypeError, match=r"x\[1\] must have dtype torch.float32"):
        _dispatch((q, torch.zeros(4, 2, dtype=BF16)), idx, w)
    with pytest.raises(ValueError, match="multiple of 128 for e4m3 rows, got 200"):
        _dispatch((torch.zeros(4, 200, dtype=torch.float8_e4m3fn), torch.zeros(4, 1)), idx, w)
    # Column-major scales (quantize_fp8_per_token's mn_major) pass every check but the device.
    scales = torch.zeros(2, 4).t()
    with pytest.raises(ValueError, match=r"x\[0\] must be on a CUDA device"):
        _dispatch((q, scales), idx, w)


def test_routing_and_layout_argument_errors():
    in_rank, per_expert = torch.zeros(4, 2, dtype=torch.bool), torch.zeros(8, dtype=torch.int32)

    def routing(in_rank=in_rank, per_expert=per_expert, per_rank=None, rdma=None):
        return checks.routing_inputs(in_rank, per_expert, per_rank, rdma, tokens=4, ranks=2,
                                     device=-1)

    assert routing() == 8
    with pytest.raises(ValueError, match="intranode only"):
        routing(rdma=torch.zeros(1))
    with pytest.raises(ValueError, match="needs is_token_in_rank"):
        routing(in_rank=None)
    with pytest.raises(ValueError, match=r"is_token_in_rank must have shape \(4, 2\)"):
        routing(in_rank=torch.zeros(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of the 2 ranks' entries, got 7"):
        routing(per_expert=torch.zeros(7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"num_tokens_per_rank must have shape \(2,\)"):
        routing(per_rank=torch.zeros(3, dtype=torch.int32))
    idx = torch.zeros(4, 2, dtype=I64)
    with pytest.raises(TypeError, match="num_experts must be an int, got float"):
        checks.layout_inputs(idx, 8.0, 2, 0)
    with pytest.raises(ValueError, match="multiple of the 2 ranks from 2 to 4096, got 9"):
        checks.layout_inputs(idx, 9, 2, 0)
    with pytest.raises(ValueError, match="topk_idx must be on a CUDA device"):
        checks.layout_inputs(idx, 8, 2, 0)


def test_combine_and_buffer_size_errors():
    x = torch.zeros(4, 256, dtype=BF16)
    with pytest.raises(ValueError, match=r"x must have shape \(5, 256\), got \(4, 256\)"):
        checks.combine_inputs(x, None, num_recv_tokens=5, device=0)
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16"):
        checks.combine_inputs(x.float(), None, num_recv_tokens=4, device=0)
    with pytest.raises(TypeError, match="topk_weights must have dtype torch.float32"):
        checks.combine_inputs(x, torch.zeros(4, 2, dtype=BF16), num_recv_tokens=4, device=0)
    with pytest.raises(ValueError, match=r"topk_weights must have shape \(4, 2\), got \(3, 2\)"):
        checks.combine_inputs(x, torch.zeros(3, 2), num_recv_tokens=4, device=0)
    with pytest.raises(ValueError, match="1 to 32 columns, got 33"):
        checks.combine_inputs(x, torch.zeros(4, 33), num_recv_tokens=4, device=0)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        checks.combine_inputs(x, torch.zeros(4, 2), num_recv_tokens=4, device=0)
    needed = buffer_size(8, 7168, 8)
    with pytest.raises(ValueError, match=f"too small for a dispatch.*needs {needed}"):
        checks.require_buffer(1 << 20, needed, "a dispatch of 7168-wide rows")


def test_set_num_sms_is_checked():
    from ptxforge.ep import Buffer

    with pytest.raises(ValueError, match="even int of at least 2, got 3"):
        Buffer.set_num_sms(3)


def test_a_cached_dispatch_must_match_its_handle():
    """A call reusing a handle exchanges nothing, so what the peers cannot check (the rows'
    size and dtype, the top-k columns the entries make room for) is checked against the
    handle on the host."""
    from ptxforge.ep import Buffer
    from ptxforge.ep.buffer import DispatchHandle

    handle = DispatchHandle(num_tokens=4, num_recv_tokens=0, channels=2, experts=8, hidden=256,
                            fp8=False, topk=2, is_token_in_rank=None, recv_layout=None,
                            recv_src_idx=None, layout=None, num_recv=None, send_layout=None)
    buffer = Buffer.__new__(Buffer)  # the check reads the handle and the call alone

    def call(tokens=4, hidden=256, fp8=False, topk=0, channels=2):
        inputs = checks.DispatchInputs(fp8, tokens, hidden, topk, 0, 0, (0, 0), 0, 0)
        return buffer._check_handle(handle, inputs, channels)

    assert call() == 8 and call(topk=2) == 8
    with pytest.raises(ValueError, match="x must have the handle's 4 tokens, got 5"):
        call(tokens=5)
    with pytest.raises(ValueError, match="x must have the handle's hidden size 256, got 512"):
        call(hidden=512)
    with pytest.raises(ValueError, match=r"x must be bf16 as in the handle's dispatch, got FP8"):
        call(fp8=True)
    with pytest.raises(ValueError, match="topk_idx must have the handle's 2 columns, got 3"):
        call(topk=3)
    with pytest.raises(ValueError, match="config.num_sms must be the handle's 4, got 8"):
        call(channels=4)
    with pytest.raises(TypeError, match="handle must be what dispatch returned, got tuple"):
        buffer._check_handle((), None, 2)


@pytest.mark.parametrize("worst, handle, message", [
    (-1, None, r"^num_worst_tokens must be an int in \[0, 2\^31\), got -1$"),
    (2.0, None, r"^num_worst_tokens must be an int in \[0, 2\^31\), got 2.0$"),
    (8, "a handle", "^num_worst_tokens sizes a dispatch that exchanges counts: a call reusing a "
                    r"handle keeps the handle's sizes \(pass one or the other\)$"),
])
def test_num_worst_tokens_is_checked_before_the_device(worst, handle, message):
    from types import SimpleNamespace

    from ptxforge.ep import Buffer

    buffer = Buffer.__new__(Buffer)  # the checks read the record and the normal buffer alone
    buffer.record, buffer.memory = SimpleNamespace(read=lambda: (0, 0, 0, 0)), object()
    with pytest.raises(ValueError, match=message):
        buffer.dispatch(torch.zeros(4, 128), handle=handle, num_worst_tokens=worst)


def test_low_latency_options_it_does_not_take_are_refused_by_name():
    from ptxforge.ep import Buffer

    buffer = Buffer.__new__(Buffer)  # the checks read these two attributes alone
    buffer.low_latency_group, buffer.record = None, None
    with pytest.raises(ValueError, match="no low-latency buffer: create it with num_rdma_bytes"):
        buffer._check_low_latency_options(False)
    buffer.low_latency_group = object()
    buffer._check_low_latency_options(False, use_fp8=(True, True))
    with pytest.raises(ValueError, match="async_finish: the low-latency calls run on the current"):
        buffer._check_low_latency_options(True)
    with pytest.raises(ValueError, match="use_fp8=False is not supported by ptxforge.ep yet"):
        buffer._check_low_latency_options(False, use_fp8=(False, True))
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats=.* not supported"):
        buffer._check_low_latency_options(
            False, cumulative_local_expert_recv_stats=(torch.zeros(2), None))


def test_decode_sizes_are_checked_with_the_other_ranks_once(monkeypatch):
    """The first low-latency dispatch with given sizes builds its kernels and exchanges
    the sizes; a disagreement is a ValueError naming the size and the ranks; sizes agreed
    on are not exchanged again, and a first call inside a graph capture is refused."""
    import torch.distributed as dist

    from ptxforge.ep import Buffer, low_latency
    from ptxforge.ep.layout import Message

    def sizes(hidden, topk=8, weights=False):
        return (("num_max_dispatch_tokens_per_rank", 128), ("hidden", hidden),
                ("num_experts", 256), ("topk", topk), ("topk_weights", weights))

    buffer = Buffer.__new__(Buffer)  # the check reads these attributes alone
    buffer.group, buffer.group_size, buffer._low_latency_sizes = None, 2, set()
    buffer.low_latency_group = None
    peers, calls, built = [sizes(7168)], [], []

    def all_gather_object(out, message, group=None):
        calls.append(message)
        out[:] = [message, Message(peers[0], [], [], 0)]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(low_latency, "prepare",
                        lambda group, *args, summed: built.append((*args, summed)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    buffer._agree_on_low_latency_sizes(sizes(7168))
    buffer._agree_on_low_latency_sizes(sizes(7168))
    assert len(calls) == 1 and built == [(128, 7168, 256, 8, False)]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    buffer._agree_on_low_latency_sizes(sizes(7168))  # agreed on: nothing to exchange
    with pytest.raises(ValueError, match="run one before capturing"):
        buffer._agree_on_low_latency_sizes(sizes(2048))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    peers[0] = sizes(4096)
    with pytest.raises(ValueError, match="disagree on the dispatch: hidden: rank 0 has 7168, "
                                         "rank 1 has 4096; topk: rank 0 has 6, rank 1 has 8"):
        buffer._agree_on_low_latency_sizes(sizes(7168, topk=6))
    # The weights sent with the dispatch or not: the combines differ, so every rank agrees.
    peers[0] = sizes(7168)
    with pytest.raises(ValueError, match="topk_weights: rank 0 has True, rank 1 has False"):
        buffer._agree_on_low_latency_sizes(sizes(7168, weights=True))


# ---------------------------------------------------------------------------- stored config
def test_the_stored_config_round_trips_and_survives_a_bad_file(monkeypatch, tmp_path):
    from ptxforge.ep import tuning

    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path))
    assert tuning.load("NVIDIA H200", 2) is None
    tuning.store("NVIDIA H200", 2, 20, 128, 20, dispatch_us=199.2)
    tuning.store("NVIDIA H200", 4, 16, 64, 20)
    assert tuning.load("NVIDIA H200", 2) == (20, 128, 20)
    assert tuning.load("NVIDIA H200", 4) == (16, 64, 20)
    assert tuning.load("NVIDIA H100 80GB HBM3", 2) is None
    assert [p.name for p in tmp_path.iterdir()] == [tuning.FILE]  # no temporary left
    tuning.path().write_text("{not json")
    assert tuning.load("NVIDIA H200", 2) is None
    tuning.store("NVIDIA H200", 2, 18, 128, 20)   # a broken file is replaced, not kept
    assert tuning.load("NVIDIA H200", 2) == (18, 128, 20)
    # An entry that does not say the budget it was picked within is not taken.
    tuning.path().write_text('{"NVIDIA H200, 2 ranks": {"num_sms": 20, "ring_slots": 128}}')
    assert tuning.load("NVIDIA H200", 2) is None


def test_a_buffer_returns_the_config_stored_for_its_budget():
    from ptxforge.ep import Buffer, Config
    from ptxforge.ep.buffer import DEFAULT_SLOTS

    buffer = Buffer.__new__(Buffer)   # the configs read the stored pick and the budget alone
    buffer.group_size, buffer.num_sms, buffer._picked = 2, 20, {2: (16, 64, 20)}
    assert buffer.get_dispatch_config() == buffer.get_combine_config() == Config(16, 64)
    buffer.num_sms = 12      # a pick made within another budget is not taken: not a
    assert buffer.get_dispatch_config() == Config(12, DEFAULT_SLOTS)   # smaller one,
    buffer.num_sms = 48
    assert buffer.get_dispatch_config() == Config(48, DEFAULT_SLOTS)   # nor a larger one
    buffer._picked = {2: None}
    buffer.num_sms = 20
    assert buffer.get_dispatch_config() == Config(20, DEFAULT_SLOTS)


def test_the_count_message_holds_the_signature_the_bad_indices_and_the_counts():
    """What a dispatch without a handle tells the other ranks: the header the host makes
    (the signature's words, the top-k indices out of range: counted where the host reads
    the messages, cached and not counted where it does not), then the counts the exchange
    kernel adds (tests/cpu/test_ep_sim.py); read back, it gives the receive layout, and a
    bad index is refused on every rank."""
    from ptxforge.ep import Buffer
    from ptxforge.ep.layout import message_of

    ranks, experts, channels, tokens = 2, 8, 3, 37
    idx = _routing(tokens, experts, 3, 5)
    idx[4, 1] = experts + 2   # out of range: counted, then refused on every rank
    _, per_expert, in_rank = reference.dispatch_layout(idx, experts, ranks)
    buffer = Buffer.__new__(Buffer)   # the header needs the buffer's cache of headers alone
    buffer._headers = {}
    signature = (("hidden", 256), ("fp8", True), ("topk", 3), ("num_experts", experts),
                 ("num_sms", 6), ("ring_slots", 64), ("expert_alignment", 1))
    counts = [n for b, e in ep_plan.channel_bounds(tokens, channels)
              for n in in_rank[b:e].sum(0).tolist()]

    def message(header):
        assert header.dtype == torch.int32
        return message_of(header.tolist() + counts + per_expert.tolist(), channels, ranks)

    unchecked = buffer.message_header(signature, idx, experts, checked=False)
    assert unchecked.tolist() == [256, 1, 3, experts, 6, 64, 1, 0]
    assert buffer.message_header(signature, idx, experts, checked=False) is unchecked
    read = message(buffer.message_header(signature, idx, experts, checked=True))
    assert read.signature == signature and read.bad_indices == 1
    assert read.channel_counts == [counts[c * ranks:(c + 1) * ranks] for c in range(channels)]
    assert read.expert_counts == per_expert.tolist()
    with pytest.raises(ValueError, match="out of range"):
        check_agreement([read] * ranks)
    idx[4, 1] = -1
    _, per_expert, in_rank = reference.dispatch_layout(idx, experts, ranks)
    counts = [n for b, e in ep_plan.channel_bounds(tokens, channels)
              for n in in_rank[b:e].sum(0).tolist()]
    messages = [message(buffer.message_header(signature, idx, experts, checked=True))] * ranks
    check_agreement(messages)
    layout = receive_layout(messages, 0, experts // ranks)
    assert layout.num_recv_tokens == 2 * int(in_rank[:, 0].sum())
    assert layout.num_recv_tokens_per_expert == [2 * n for n in per_expert[:4].tolist()]


def test_a_message_from_a_rank_with_other_sizes_is_refused_before_its_counts():
    from ptxforge.ep.layout import message_of, signature_words

    ours = signature_words((("hidden", 256), ("fp8", False), ("topk", 2), ("num_experts", 8),
                            ("num_sms", 4), ("ring_slots", 64), ("expert_alignment", 1)))
    theirs = list(ours)
    theirs[4] = 8   # more channels: a longer message, read here for 2 channels
    counts = [0] * (2 * 2 + 8)
    messages = [message_of(ours + [0] + counts, 2, 2), message_of(theirs + [0] + counts, 2, 2)]
    with pytest.raises(ValueError, match="num_sms: rank 0 has 4, rank 1 has 8"):
        check_agreement(messages)
    with pytest.raises(ValueError, match="a dispatch signature names"):
        signature_words((("hidden", 256),))
