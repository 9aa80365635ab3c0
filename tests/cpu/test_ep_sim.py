"""The EP kernels' PTX run on the CPU (tests/support/ptxsim.py), several simulated ranks
over one memory as CUDA IPC maps it: layout, dispatch and combine against the torch
references bitwise, calls that reuse the counters (rings wrapping across launches), a
rank that never launches (the watchdog's record and trap), ranks whose sizes disagree
(the entries' signatures). Sequentially consistent memory: this checks the protocol's
logic, not its memory orders (see ptxsim's docstring)."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest

from ptxforge import arch
from ptxforge.kernels.ep_intranode import combine as combine_kernel
from ptxforge.kernels.ep_intranode import common
from ptxforge.kernels.ep_intranode import direct as direct_kernel
from ptxforge.kernels.ep_intranode import dispatch as dispatch_kernel
from ptxforge.kernels.ep_intranode import exchange as exchange_kernel
from ptxforge.kernels.ep_intranode import layout as layout_kernel
from ptxforge.kernels.ep_intranode import plan as ep_plan
from ptxforge.kernels.ep_intranode import pull as pull_kernel
from ptxforge.kernels.ep_intranode.plan import channel_bounds

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from ptxforge.ep.layout import Message, message_of, receive_layout, signature_words  # noqa: E402
from ptxforge.testing.reference import quantize_fp8_per_token  # noqa: E402
from support import ep_reference as reference  # noqa: E402
from support.ptxsim import Kernel, Memory, Simulator, Trap  # noqa: E402

SM90 = arch.get("sm_90a")
TIMEOUT = 100_000  # scheduler passes (the simulator's ns)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensor(memory: Memory, address: int, shape, dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    size = n * torch.empty((), dtype=dtype).element_size()
    data = bytearray(memory.read(address, size)) if size else bytearray()
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape).clone() if size \
        else torch.empty(shape, dtype=dtype)


class World:
    """Simulated ranks: one buffer each (zeroed), the peers table, an error record each."""

    def __init__(self, ranks: int, nbytes: int):
        self.ranks, self.memory = ranks, Memory()
        self.buffers = [self.memory.alloc(nbytes) for _ in range(ranks)]
        self.peers = self.memory.put(struct.pack(f"<{ranks}Q", *self.buffers))
        self.errors = [self.memory.alloc(16) for _ in range(ranks)]

    def record(self, rank: int) -> tuple:
        return struct.unpack("<4I", self.memory.read(self.errors[rank], 16))

    def common(self, rank: int, layout_table: int) -> dict:
        return dict(rank=rank, peers=self.peers, recv_layout=layout_table,
                    error=self.errors[rank], timeout_ns=TIMEOUT)


def _routing(rank, tokens, experts, topk, seed, kind="random"):
    g = torch.Generator().manual_seed(100 * seed + rank)
    if not tokens:
        return torch.empty((0, topk), dtype=torch.int64)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    if kind == "random":
        idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
        idx[0] = -1  # a token that goes nowhere
    elif kind == "to_rank_0":
        idx = idx % (experts // 2)  # experts of rank 0 (of 2), repeats allowed
    return idx.to(torch.int64)


def _layout(world, sim, rank, idx, experts):
    """Launch the layout kernel for ``idx``; returns the output addresses."""
    cfg = layout_kernel.choose_config(SM90, experts, world.ranks, idx.shape[1])
    memory, tokens = world.memory, idx.shape[0]
    out = dict(num_tokens_per_rank=memory.alloc(4 * world.ranks),
               num_tokens_per_expert=memory.alloc(4 * experts),
               is_token_in_rank=memory.alloc(tokens * world.ranks))
    if tokens:
        sim.launch(f"layout{rank}", layout_kernel.generate(cfg).ptx(),
                   -(-tokens // layout_kernel.THREADS), layout_kernel.THREADS,
                   topk_idx=memory.put(_bytes(idx)), tokens=tokens, **out)
    return out


class Case:
    """Every rank's inputs, the layout (kernel and host), a dispatch and a combine."""

    def __init__(self, ranks=2, tokens=(40, 29), hidden=64, experts=8, topk=3, fp8=False,
                 num_sms=2, slots=64, warps=2, seed=0, kind="random", buffer_bytes=None,
                 pace=None):
        self.ranks, self.hidden, self.experts, self.fp8 = ranks, hidden, experts, fp8
        self.dispatch_cfg = replace(dispatch_kernel.choose_config(
            SM90, ranks, hidden, topk, fp8=fp8, num_sms=num_sms, slots=slots),
            warps_per_peer=warps)
        self.combine_cfg = replace(combine_kernel.choose_config(
            SM90, ranks, hidden, num_sms=num_sms, slots=slots), warps_per_peer=warps)
        self.channels = self.dispatch_cfg.channels
        g = torch.Generator().manual_seed(seed)
        self.idx = [_routing(r, tokens[r], experts, topk, seed, kind) for r in range(ranks)]
        self.weights = [torch.rand(self.idx[r].shape, generator=g) for r in range(ranks)]
        x = [torch.randn(tokens[r], hidden, generator=g).bfloat16() for r in range(ranks)]
        self.scales = None
        if fp8:
            pairs = [quantize_fp8_per_token(t) for t in x]
            x, self.scales = [q for q, _ in pairs], [s for _, s in pairs]
        self.x = x
        self.world = World(ranks, buffer_bytes or self.dispatch_cfg.plan.bytes_needed(
            self.dispatch_cfg.slot))
        self.layouts, self.in_rank, self.tables = [], [], []
        self.pace = pace  # the simulator's pace: instructions a turn by launch and CTA

    def run_layout(self):
        sim = Simulator(self.world.memory)
        outs = [_layout(self.world, sim, r, self.idx[r], self.experts) for r in range(self.ranks)]
        sim.run()
        messages = []
        for r, out in enumerate(outs):
            m = self.world.memory
            per_rank = _tensor(m, out["num_tokens_per_rank"], (self.ranks,), torch.int32)
            per_expert = _tensor(m, out["num_tokens_per_expert"], (self.experts,), torch.int32)
            in_rank = _tensor(m, out["is_token_in_rank"], (self.idx[r].shape[0], self.ranks),
                              torch.bool)
            ref = reference.dispatch_layout(self.idx[r], self.experts, self.ranks)
            assert torch.equal(per_rank, ref[0]) and torch.equal(per_expert, ref[1])
            assert torch.equal(in_rank, ref[2])
            counts = [in_rank[b:e].sum(0).tolist() for b, e in
                      channel_bounds(in_rank.shape[0], self.channels)]
            messages.append(Message((), counts, per_expert.tolist(), 0))
            self.in_rank.append(out["is_token_in_rank"])
        for r in range(self.ranks):
            layout = receive_layout(messages, r, self.experts // self.ranks)
            self.layouts.append(layout)
            self.tables.append(self.world.memory.put(struct.pack(f"<{len(layout.table())}I",
                                                                 *layout.table())))

    def launch_dispatch(self, sim, rank, cfg=None):
        cfg = cfg or self.dispatch_cfg
        m, n, k = self.world.memory, self.layouts[rank].num_recv_tokens, self.idx[rank].shape[1]
        out = dict(recv_x=m.alloc(n * cfg.slot.row_bytes), recv_src_idx=m.alloc(4 * n))
        args = dict(x=m.put(_bytes(self.x[rank])), is_token_in_rank=self.in_rank[rank],
                    tokens=self.x[rank].shape[0], **self.world.common(rank, self.tables[rank]))
        if cfg.with_topk:
            out.update(recv_topk_idx=m.alloc(8 * n * k), recv_topk_weights=m.alloc(4 * n * k))
            args.update(topk_idx=m.put(_bytes(self.idx[rank])),
                        topk_weights=m.put(_bytes(self.weights[rank])),
                        experts_per_rank=self.experts // self.ranks)
        args.update(out)
        if cfg.fp8:
            scales = self.scales[rank].t().contiguous().t()  # column-major, as mn_major
            out["recv_scales"] = m.alloc(4 * n * cfg.slot.scale_groups)
            args.update(x_scales=m.put(_bytes(scales.t())), scale_token_stride=1,
                        scale_group_stride=scales.shape[0], recv_scales=out["recv_scales"])
        sim.launch(f"dispatch{rank}", dispatch_kernel.generate(cfg).ptx(), 2 * cfg.channels,
                   cfg.threads, **args)
        return out

    def dispatch(self, with_topk: bool = True):
        """Every rank's dispatch, checked; ``with_topk`` False: the variant of a call that
        reuses a handle without top-k."""
        cfg = replace(self.dispatch_cfg, with_topk=with_topk)
        sim = Simulator(self.world.memory, self.pace)
        outs = [self.launch_dispatch(sim, r, cfg) for r in range(self.ranks)]
        sim.run()
        received = []
        for r, out in enumerate(outs):
            m, n, k = self.world.memory, self.layouts[r].num_recv_tokens, self.idx[r].shape[1]
            dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
            got = dict(x=_tensor(m, out["recv_x"], (n, self.hidden), dtype),
                       src_idx=_tensor(m, out["recv_src_idx"], (n,), torch.int32))
            if with_topk:
                got.update(topk_idx=_tensor(m, out["recv_topk_idx"], (n, k), torch.int64),
                           topk_weights=_tensor(m, out["recv_topk_weights"], (n, k),
                                                torch.float32))
            expected = reference.dispatch(r, self.x, self.idx, self.weights, self.experts,
                                          self.scales)
            for name in got:
                assert _bytes(got[name]) == _bytes(expected[name]), (r, name)
            if self.fp8:
                scales = _tensor(m, out["recv_scales"], (n, self.hidden // 128), torch.float32)
                assert _bytes(scales) == _bytes(expected["scales"]), (r, "scales")
            assert self.layouts[r].num_recv_tokens_per_expert == expected["per_expert"]
            received.append(got)
        return received

    def combine(self, ys, weights=None):
        """Every rank's combine of ys (and of ``weights``, the dispatch's received top-k
        weights), checked: the rows against the reference, the weights against each
        token's own (0 where the index was -1)."""
        sim, m, outs = Simulator(self.world.memory, self.pace), self.world.memory, []
        k = 0 if weights is None else weights[0].shape[1]
        cfg = replace(self.combine_cfg, topk=k)
        for r in range(self.ranks):
            tokens = self.x[r].shape[0]
            outs.append((m.alloc(2 * self.hidden * tokens), m.alloc(4 * k * tokens)))
            extra = {} if not k else dict(topk_weights=m.put(_bytes(weights[r])),
                                          combined_topk_weights=outs[r][1])
            sim.launch(f"combine{r}", combine_kernel.generate(cfg).ptx(), 2 * cfg.channels,
                       cfg.threads, x=m.put(_bytes(ys[r])), is_token_in_rank=self.in_rank[r],
                       tokens=tokens, out=outs[r][0], **extra,
                       **self.world.common(r, self.tables[r]))
        sim.run()
        for r in range(self.ranks):
            tokens = self.x[r].shape[0]
            got = _tensor(m, outs[r][0], (tokens, self.hidden), torch.bfloat16)
            expected = reference.combine(r, ys, self.idx, self.experts)
            assert _bytes(got) == _bytes(expected), r
            if k:
                got = _tensor(m, outs[r][1], (tokens, k), torch.float32)
                valid = (self.idx[r] >= 0) & (self.idx[r] < self.experts)
                assert _bytes(got) == _bytes(torch.where(valid, self.weights[r], 0.0)), r


def _experts_output(received, scale: float):
    return [(got["x"].float() * scale + rank).bfloat16() for rank, got in enumerate(received)]


@pytest.mark.parametrize("case", [
    dict(),                                                 # 2 ranks, 1 channel
    dict(num_sms=4, tokens=(50, 7), warps=1),               # 2 channels, one warp a peer
    dict(ranks=3, tokens=(20, 0, 33), experts=6, topk=2),   # a rank with no tokens
    dict(kind="to_rank_0", tokens=(30, 30)),                # rank 1 receives nothing
    dict(fp8=True, hidden=256, tokens=(24, 17)),            # e4m3 rows and their scales
], ids=["two_ranks", "two_channels", "three_ranks", "all_to_rank_0", "fp8"])
def test_dispatch_and_combine_match_the_references(case):
    c = Case(**case)
    c.run_layout()
    received = c.dispatch()
    if not c.fp8:
        c.combine(_experts_output(received, 0.5), [got["topk_weights"] for got in received])


# Instructions a turn: senders (even CTAs) far ahead of receivers, the reverse, one rank
# far ahead of the other, the odd warps of every CTA far behind the even ones.
PACES = {"even": None,
         "senders_ahead": lambda name, cta, tid: 1 if cta % 2 else 1024,
         "receivers_ahead": lambda name, cta, tid: 1024 if cta % 2 else 1,
         "rank_0_ahead": lambda name, cta, tid: 1024 if name.endswith("0") else 1,
         "odd_warps_behind": lambda name, cta, tid: 1 if tid // 32 % 2 else 1024}


@pytest.mark.parametrize("pace", list(PACES))
@pytest.mark.parametrize("topk", [1, 2])
def test_counters_carry_over_and_rings_wrap(pace, topk):
    """150 tokens a rank through 64-entry rings, three dispatches and two combines in a
    row: each launch starts from the counters the last one left. Threads at different
    paces make senders outrun receivers and the reverse, and one warp of a group lag
    another."""
    c = Case(tokens=(150, 120), hidden=16, topk=topk, pace=PACES[pace])
    c.run_layout()
    first = c.dispatch()
    c.combine(_experts_output(first, 1.0), [got["topk_weights"] for got in first])
    again = c.dispatch()
    assert all(_bytes(a["x"]) == _bytes(b["x"]) for a, b in zip(first, again))
    c.combine(_experts_output(again, -2.0))
    c.dispatch()


def test_three_ranks_two_channels_fp8_and_a_call_without_top_k():
    """Rings of 64 entries wrapping on every channel of three ranks, FP8 rows and scales,
    then the layout reused by a dispatch without top-k (its own kernel variant, whose
    entries carry another signature) and a combine."""
    c = Case(ranks=3, tokens=(130, 90, 150), experts=6, topk=3, fp8=True, hidden=128,
             num_sms=4, pace=PACES["senders_ahead"])
    c.run_layout()
    c.dispatch()
    received = c.dispatch(with_topk=False)
    c.combine([(got["x"].float() * (rank + 1)).bfloat16() for rank, got in enumerate(received)])


def test_layout_over_several_ctas():
    """600 tokens: three CTAs add their histograms into the same outputs."""
    world, experts = World(4, 64), 16
    sim = Simulator(world.memory)
    idx = _routing(0, 600, experts, 4, 7)
    idx[5, 2] = experts + 3  # out of range: counted nowhere
    out = _layout(world, sim, 0, idx, experts)
    sim.run()
    ref = reference.dispatch_layout(idx, experts, 4)
    assert torch.equal(_tensor(world.memory, out["num_tokens_per_rank"], (4,), torch.int32), ref[0])
    assert torch.equal(_tensor(world.memory, out["num_tokens_per_expert"], (experts,),
                               torch.int32), ref[1])
    assert torch.equal(_tensor(world.memory, out["is_token_in_rank"], (600, 4), torch.bool), ref[2])


def test_a_rank_that_never_launches_ends_in_the_watchdog():
    c = Case(tokens=(20, 20))
    c.run_layout()
    sim = Simulator(c.world.memory)
    c.launch_dispatch(sim, 0)  # rank 1 never launches
    with pytest.raises(Trap, match="trap"):
        sim.run()
    code, channel, peer, seen = c.world.record(0)
    assert (code, channel, peer, seen) == (common.DISPATCH_RECEIVE, 0, 1, 0)


def test_ranks_that_disagree_on_sizes_trap_on_the_signature():
    """Both ranks reuse one layout (a cached call: nothing exchanged), rank 1 with rows
    twice as wide: a receiver finds an entry signed for other sizes."""
    wide = replace(Case(hidden=128).dispatch_cfg, warps_per_peer=2)
    c = Case(tokens=(20, 20), hidden=64, buffer_bytes=wide.plan.bytes_needed(wide.slot))
    c.run_layout()
    c.dispatch()
    sim = Simulator(c.world.memory)
    c.launch_dispatch(sim, 0)
    c.x[1] = torch.randn(20, 128).bfloat16()
    c.launch_dispatch(sim, 1, wide)
    with pytest.raises(Trap):
        sim.run()
    codes = {c.world.record(r)[0] for r in range(2)} - {0}
    assert common.DISPATCH_MISMATCH in codes, codes


def _exchanges(world, inputs: dict, channels: int, pace=None, worst: int = 0) -> dict:
    """One exchange on the ranks in ``inputs`` (rank: its header words, is_token_in_rank,
    pairs per expert), run to the end; every launched rank's (gathered rows, recv_layout
    [2, ranks, channels], num_recv, send_layout [ranks, channels])."""
    kernel = Kernel(exchange_kernel.generate(exchange_kernel.choose_config(SM90,
                                                                           world.ranks)).ptx())
    sim, outs, m = Simulator(world.memory, pace), {}, world.memory
    for rank, (header, in_rank, per_expert) in inputs.items():
        words = len(header) + channels * world.ranks + len(per_expert)
        outs[rank] = (m.alloc(4 * world.ranks * words), m.alloc(8 * world.ranks * channels),
                      m.alloc(4), m.alloc(4 * world.ranks * channels), words)
        sim.launch(f"exchange{rank}", kernel, 1, exchange_kernel.THREADS,
                   header=m.put(struct.pack(f"<{len(header)}i", *header)),
                   is_token_in_rank=m.put(_bytes(in_rank)), tokens=in_rank.shape[0],
                   num_tokens_per_expert=m.put(struct.pack(f"<{len(per_expert)}i", *per_expert)),
                   experts=len(per_expert), channels=channels, worst=worst, out=outs[rank][0],
                   recv_layout=outs[rank][1], num_recv=outs[rank][2], send_layout=outs[rank][3],
                   rank=rank, peers=world.peers, error=world.errors[rank], timeout_ns=TIMEOUT)
    sim.run()
    return {rank: (_tensor(m, out, (world.ranks, words), torch.int32).tolist(),
                   _tensor(m, table, (2, world.ranks, channels), torch.int32).tolist(),
                   _tensor(m, num_recv, (1,), torch.int32).item(),
                   _tensor(m, send, (world.ranks, channels), torch.int32).tolist())
            for rank, (out, table, num_recv, send, words) in outs.items()}


def _count_inputs(g, ranks: int, channels: int, experts: int, tokens=(40, 29, 0)) -> tuple:
    """Every rank's exchange inputs (a signature's header with a bad-index count, a random
    is_token_in_rank, random pairs per expert) and the message the host reads of each: the
    header, each channel's tokens for each rank (plan.channel_bounds), the pairs."""
    header = signature_words((("hidden", 256), ("fp8", True), ("topk", 4),
                              ("num_experts", experts), ("num_sms", 2 * channels),
                              ("ring_slots", 64), ("expert_alignment", 1)))
    inputs, messages = {}, {}
    for r in range(ranks):
        in_rank = torch.rand(tokens[r], ranks, generator=g) < 0.6
        per_expert = torch.randint(0, 50, (experts,), generator=g).tolist()
        counts = [n for b, e in channel_bounds(tokens[r], channels)
                  for n in in_rank[b:e].sum(0).tolist()]
        inputs[r] = (header + [r], in_rank, per_expert)
        messages[r] = header + [r] + counts + per_expert
    return inputs, messages


@pytest.mark.parametrize("pace", [None, lambda name, cta, tid: 1 + 40 * (name == "exchange1")],
                         ids=["even", "rank_1_slow"])
def test_the_count_exchange_gives_every_rank_every_message_and_its_layout(pace):
    """Three ranks (one without tokens), three exchanges (both parities, the first one
    again), messages longer than the CTA's threads: every rank gathers every rank's
    message as the host reads it (the counts the kernel made), in rank order, and its
    receive layout and rows as the host works them out."""
    world = World(3, exchange_kernel.slot_offset(1, 7) + 4 * 4616)
    g = torch.Generator().manual_seed(3)
    for number, channels in ((1, 3), (2, 5), (3, 1)):
        inputs, messages = _count_inputs(g, 3, channels, 300, tokens=(70, 0, 45 + number))
        gathered = _exchanges(world, inputs, channels, pace)
        parsed = [message_of(messages[r], channels, 3) for r in range(3)]
        for rank, (rows, table, num_recv, send) in gathered.items():
            assert rows == [messages[r] for r in range(3)]
            expected = receive_layout(parsed, rank, 100)
            assert [n for part in table for row in part for n in row] == expected.table()
            assert num_recv == expected.num_recv_tokens
            # Where this rank's rows for rank d begin there: d's layout's offsets for it.
            assert send == [receive_layout(parsed, d, 100).offsets[rank] for d in range(3)]
    # Each rank's flag[rank] in its own buffer counts its exchanges: the next is number 4.
    assert all(struct.unpack("<I", world.memory.read(world.buffers[r] + ep_plan.EXCHANGE_FLAGS
                                                     + 4 * r, 4)) == (3,) for r in range(3))
    assert all(world.record(r) == (0, 0, 0, 0) for r in range(3))


def test_a_rank_that_skips_the_exchange_ends_in_the_watchdog():
    world = World(2, exchange_kernel.slot_offset(1, 7) + 4 * 4616)
    inputs, _ = _count_inputs(torch.Generator().manual_seed(0), 2, 2, 4)
    _exchanges(world, inputs, 2)
    with pytest.raises(Trap, match="trap"):
        _exchanges(world, {0: inputs[0]}, 2)   # rank 1 never makes exchange 2
    assert world.record(0) == (common.EXCHANGE_RECEIVE, 0, 1, 1)  # its flag still at 1


def test_more_rows_than_the_worst_case_trap_with_the_count():
    world = World(2, exchange_kernel.slot_offset(1, 7) + 4 * 4616)
    inputs, messages = _count_inputs(torch.Generator().manual_seed(1), 2, 2, 4)
    parsed = [message_of(messages[r], 2, 2) for r in range(2)]
    rows = [receive_layout(parsed, r, 2).num_recv_tokens for r in range(2)]
    most = max(rows)
    assert [out[2] for out in _exchanges(world, inputs, 2, worst=most).values()] == rows
    with pytest.raises(Trap, match="trap"):
        _exchanges(world, inputs, 2, worst=most - 1)   # room for one row fewer
    busiest = rows.index(most)
    assert world.record(busiest) == (common.EXCHANGE_OVERFLOW, 0, busiest, most)


def test_simulator_refuses_what_it_does_not_know():
    with pytest.raises(NotImplementedError, match="wgmma"):
        Kernel(".visible .entry k(\n)\n{\n\twgmma.fence.sync.aligned;\n\tret;\n}\n")


# --------------------------------------------------------------------------- direct dispatch
def _direct_dispatch(c: Case, number: int, worst: int, pace=None) -> list:
    """Every rank's direct dispatch after exchange ``number`` (its flag set by hand, the
    send layout and row counts from the host's layout of the messages), run to the end;
    each rank's outputs read from its buffer: rows 0 .. worst - 1."""
    cfg = replace(direct_kernel.choose_config(SM90, c.ranks, c.hidden, c.idx[0].shape[1],
                                              num_sms=2 * c.channels), warps_per_peer=2)
    kernel = Kernel(direct_kernel.generate(cfg).ptx())
    k, m = cfg.topk, c.world.memory
    region = _direct_region(c, worst)
    sim = Simulator(m, pace)
    send_rows = [m.alloc(4 * x.shape[0] * c.ranks) for x in c.x]
    for r in range(c.ranks):
        m.write(c.world.buffers[r] + ep_plan.EXCHANGE_FLAGS + 4 * r, struct.pack("<I", number))
        send = [c.layouts[d].offsets[r] for d in range(c.ranks)]
        scales = c.scales[r].t().contiguous().t()  # column-major, as mn_major
        sim.launch(f"direct{r}", kernel, 2 * cfg.channels, cfg.threads,
                   x=m.put(_bytes(c.x[r])), x_scales=m.put(_bytes(scales.t())),
                   scale_token_stride=1, scale_group_stride=scales.shape[0],
                   topk_idx=m.put(_bytes(c.idx[r])), topk_weights=m.put(_bytes(c.weights[r])),
                   experts_per_rank=c.experts // c.ranks, is_token_in_rank=c.in_rank[r],
                   tokens=c.x[r].shape[0],
                   send_layout=m.put(struct.pack(f"<{c.ranks * c.channels}i",
                                                 *[n for row in send for n in row])),
                   num_recv=m.put(struct.pack("<i", c.layouts[r].num_recv_tokens)),
                   worst=worst, recv_x=region.x, recv_scales=region.scales,
                   recv_topk_idx=region.topk_idx, recv_topk_weights=region.topk_weights,
                   recv_src_idx=region.source, send_rows=send_rows[r], rank=r,
                   peers=c.world.peers, error=c.world.errors[r], timeout_ns=TIMEOUT)
    sim.run()
    outs = []
    for r in range(c.ranks):
        at = c.world.buffers[r]
        outs.append(dict(
            x=_tensor(m, at + region.x, (worst, c.hidden), torch.float8_e4m3fn),
            scales=_tensor(m, at + region.scales, (worst, c.hidden // 128), torch.float32),
            topk_idx=_tensor(m, at + region.topk_idx, (worst, k), torch.int64),
            topk_weights=_tensor(m, at + region.topk_weights, (worst, k), torch.float32),
            src_idx=_tensor(m, at + region.source, (worst,), torch.int32),
            send_rows=send_rows[r]))
    return outs


def _direct_region(c: Case, worst: int) -> ep_plan.DirectRegion:
    """Where a direct dispatch of ``worst`` rows puts its outputs (and its combine's
    inputs) in each of the case's buffers: past the rings."""
    return ep_plan.DirectRegion(ep_plan.BufferPlan(c.ranks, c.channels, 64, c.hidden)
                                .combine_rings, worst, c.hidden, c.idx[0].shape[1])


def _direct_case(case: dict) -> tuple:
    """An FP8 case whose buffers have room for every row sent (the worst case) past the
    rings, its layout run: (the case, the worst case's rows)."""
    c = Case(fp8=True, hidden=256, **case)
    worst = sum(x.shape[0] for x in c.x)
    c.world = World(c.ranks, _direct_region(c, worst).end)
    c.run_layout()
    return c, worst


@pytest.mark.parametrize("case, pace", [
    (dict(), None),
    (dict(ranks=3, tokens=(33, 2, 41), experts=6, topk=2), None),
    (dict(kind="to_rank_0", tokens=(30, 30)), None),
    (dict(num_sms=4, tokens=(70, 45)), lambda name, cta, tid: 1 + 30 * (name == "direct1")),
], ids=["two_ranks", "three_ranks", "all_to_rank_0", "two_channels_rank_1_slow"])
def test_the_direct_dispatch_writes_every_row_where_the_ring_dispatch_would(case, pace):
    """Each rank's outputs, read from its buffer: the received rows, scales, local top-k
    and source tokens bitwise as the reference (the ring dispatch's order), then top-k -1
    and weight 0 up to the worst case's rows; twice (the flags move on with the number)."""
    c, worst = _direct_case(case)
    for number in (1, 2):
        outs = _direct_dispatch(c, number, worst, pace)
        for r, got in enumerate(outs):
            n = c.layouts[r].num_recv_tokens
            expected = reference.dispatch(r, c.x, c.idx, c.weights, c.experts, c.scales)
            for name in ("x", "scales", "topk_idx", "topk_weights", "src_idx"):
                assert _bytes(got[name][:n]) == _bytes(expected[name]), (r, name)
            assert (got["topk_idx"][n:] == -1).all() and (got["topk_weights"][n:] == 0).all()
        assert all(c.world.record(r) == (0, 0, 0, 0) for r in range(c.ranks))


def _pull_combine(c: Case, outs: list, ys: list, worst: int, pace=None) -> list:
    """Every rank's experts' output ys[r] written to its combine inputs, then every rank's
    pull combine, run to the end: each rank's combined rows."""
    cfg = replace(pull_kernel.choose_config(SM90, c.ranks, c.hidden, num_sms=2 * c.channels),
                  warps=2)
    kernel, m = Kernel(pull_kernel.generate(cfg).ptx()), c.world.memory
    region = _direct_region(c, worst)
    sim, combined = Simulator(m, pace), []
    for r in range(c.ranks):
        m.write(c.world.buffers[r] + region.combine_x, _bytes(ys[r]))
        combined.append(m.alloc(2 * c.hidden * c.x[r].shape[0]))
        sim.launch(f"pull{r}", kernel, 2 * c.channels, cfg.threads, x=region.combine_x,
                   send_rows=outs[r]["send_rows"], is_token_in_rank=c.in_rank[r],
                   tokens=c.x[r].shape[0], out=combined[r], rank=r, peers=c.world.peers,
                   error=c.world.errors[r], timeout_ns=TIMEOUT)
    sim.run()
    return [_tensor(m, combined[r], (c.x[r].shape[0], c.hidden), torch.bfloat16)
            for r in range(c.ranks)]


@pytest.mark.parametrize("case, pace", [
    (dict(), None),
    (dict(ranks=3, tokens=(33, 0, 41), experts=6, topk=2), None),
    (dict(kind="to_rank_0", tokens=(30, 30)), None),
    (dict(num_sms=4, tokens=(70, 45)), lambda name, cta, tid: 1 + 30 * (name == "pull1")),
], ids=["two_ranks", "three_ranks_one_without_tokens", "all_to_rank_0",
        "two_channels_rank_1_slow"])
def test_the_pull_combine_gives_the_ring_combine_s_bits(case, pace):
    """After a direct dispatch, each rank's experts' output in its buffer: every rank pulls
    its tokens' rows and sums them in rank order, bitwise as the reference (the ring
    combine's sums); twice, with other outputs (the flags move on with the number)."""
    c, worst = _direct_case(case)
    outs = _direct_dispatch(c, 1, worst)
    for scale in (0.5, -3.0):
        ys = [(got["x"][:c.layouts[r].num_recv_tokens].float() * scale + r).bfloat16()
              for r, got in enumerate(outs)]
        for r, got in enumerate(_pull_combine(c, outs, ys, worst, pace)):
            assert _bytes(got) == _bytes(reference.combine(r, ys, c.idx, c.experts)), r
    assert all(c.world.record(r) == (0, 0, 0, 0) for r in range(c.ranks))


def test_a_rank_that_never_pulls_ends_in_the_watchdog():
    c, _ = _direct_case(dict(tokens=(20, 20)))
    cfg = replace(pull_kernel.choose_config(SM90, 2, 256, num_sms=2), warps=1)
    m = c.world.memory
    sim = Simulator(m)
    sim.launch("pull0", pull_kernel.generate(cfg).ptx(), 2, cfg.threads, x=0,
               send_rows=m.alloc(4 * 40), is_token_in_rank=c.in_rank[0], tokens=20,
               out=m.alloc(2 * 256 * 20), rank=0, peers=c.world.peers, error=c.world.errors[0],
               timeout_ns=TIMEOUT)
    with pytest.raises(Trap, match="trap"):
        sim.run()
    # Rank 0's CTA 0 (thread 1) waited for rank 1's CTA 0.
    assert c.world.record(0)[:3] == (common.PULL_RECEIVE, 0, 1)


def test_a_rank_that_never_sends_directly_ends_in_the_watchdog():
    c, worst = _direct_case(dict(tokens=(20, 20)))
    cfg = replace(direct_kernel.choose_config(SM90, 2, 256, 3, num_sms=2), warps_per_peer=1)
    # Rank 0 alone: its wait for rank 1's CTA 0 outlasts the limit.
    m = c.world.memory
    m.write(c.world.buffers[0] + ep_plan.EXCHANGE_FLAGS, struct.pack("<I", 1))
    region = _direct_region(c, worst)
    scales = c.scales[0].t().contiguous().t()
    sim = Simulator(m)
    sim.launch("direct0", direct_kernel.generate(cfg).ptx(), 2 * cfg.channels, cfg.threads,
               x=m.put(_bytes(c.x[0])), x_scales=m.put(_bytes(scales.t())),
               scale_token_stride=1, scale_group_stride=scales.shape[0],
               topk_idx=m.put(_bytes(c.idx[0])), topk_weights=m.put(_bytes(c.weights[0])),
               experts_per_rank=4, is_token_in_rank=c.in_rank[0], tokens=20,
               send_layout=m.put(struct.pack("<2i", 0, c.layouts[1].offsets[0][0])),
               num_recv=m.put(struct.pack("<i", c.layouts[0].num_recv_tokens)), worst=worst,
               recv_x=region.x, recv_scales=region.scales, recv_topk_idx=region.topk_idx,
               recv_topk_weights=region.topk_weights, recv_src_idx=region.source,
               send_rows=m.alloc(4 * 2 * 20), rank=0, peers=c.world.peers,
               error=c.world.errors[0], timeout_ns=TIMEOUT)
    with pytest.raises(Trap, match="trap"):
        sim.run()
    assert c.world.record(0)[:3] == (common.DIRECT_RECEIVE, 0, 1)
