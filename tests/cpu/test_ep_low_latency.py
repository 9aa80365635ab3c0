"""The low-latency EP kernels on the CPU: the buffer plan, the host's argument checks,
ptxas acceptance with no spills, the protocol in the PTX, and the kernels' PTX run over
2 and 3 simulated ranks (tests/support/ptxsim.py) against the torch references bitwise:
dispatch (rows, scales, counts, source info), combine, calls in a row on a buffer never
cleared (the sequence numbers), the halves launched apart, and a rank that never
launches (the watchdog's record and trap)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from ptxforge import arch
from ptxforge.kernels.ep_intranode import common as codes
from ptxforge.kernels.ep_low_latency import combine as combine_kernel
from ptxforge.kernels.ep_low_latency import dispatch as dispatch_kernel
from ptxforge.kernels.ep_low_latency.plan import (COUNT_BITS, SEQUENCE_MAX, LowLatencyPlan,
                                                  next_sequence)

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from ptxforge.ep import low_latency  # noqa: E402
from ptxforge.testing.reference import quantize_fp8_per_token  # noqa: E402
from support import ep_reference as reference  # noqa: E402
from support.ptxsim import Memory, Simulator, Trap  # noqa: E402

from test_ep import assembles_cleanly  # noqa: E402

SM90 = arch.get("sm_90a")
TIMEOUT = 100_000  # scheduler passes (the simulator's ns)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


# ---------------------------------------------------------------------------- plan
@pytest.mark.parametrize("ranks, max_tokens, hidden, experts, topk", [
    (2, 128, 7168, 256, 8), (8, 256, 7168, 256, 8), (3, 5, 128, 6, 2), (2, 1, 256, 2, 1)])
def test_plan_regions_are_aligned_and_disjoint(ranks, max_tokens, hidden, experts, topk):
    plan = LowLatencyPlan(ranks, max_tokens, hidden, experts, topk)
    local, ctas = experts // ranks, plan.send_ctas
    assert 1 <= ctas <= 16 and ranks * ctas <= 128  # a receiver's thread a flag
    assert ctas * plan.send_chunk >= max_tokens > (ctas - 1) * plan.send_chunk
    assert plan.dispatch_received >= 4 * ranks * ctas
    assert plan.dispatch_flags >= plan.dispatch_received + 4 * local * ranks
    assert plan.combine_flags >= plan.dispatch_flags + 4 * ranks * ctas
    # A token's combine rows and flags: one a pair, or (summed) one a rank.
    assert plan.combine_slots == max(topk, ranks)
    assert plan.dispatch_topk >= plan.combine_flags + 4 * max_tokens * plan.combine_slots
    pairs = 4 * ranks * max_tokens * topk
    assert plan.dispatch_weights >= plan.dispatch_topk + pairs
    assert plan.dispatch_rows >= plan.dispatch_weights + pairs
    assert plan.dispatch_slots >= plan.dispatch_rows + pairs
    assert plan.slot_scales >= hidden and plan.slot_bytes >= plan.slot_scales + hidden // 32
    assert plan.slot_bytes % 16 == 0
    # A slot a (source, token): the token goes to a rank once, whatever its experts there.
    assert plan.dispatch_slot(ranks - 1, max_tokens - 1) + plan.slot_bytes <= plan.combine_rows
    assert plan.bytes_needed == plan.combine_rows + max_tokens * plan.combine_slots * 2 * hidden
    assert all(offset % 16 == 0 for offset in (plan.dispatch_flags, plan.combine_flags,
                                               plan.combine_started,
                                               plan.dispatch_topk, plan.dispatch_weights,
                                               plan.dispatch_rows, plan.dispatch_slots,
                                               plan.combine_rows))
    assert low_latency.buffer_size(max_tokens, hidden, ranks, experts, topk) == plan.bytes_needed


def test_sequence_numbers_skip_zero():
    assert next_sequence(0) == 1 and next_sequence(1) == 2
    assert next_sequence(SEQUENCE_MAX) == 1
    assert (SEQUENCE_MAX << COUNT_BITS | 256) < 1 << 32


# ---------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("phase", ["send", "receive", "both"])
@pytest.mark.parametrize("ranks, max_tokens, hidden, experts, topk", [
    (2, 128, 7168, 256, 8), (8, 128, 7168, 256, 8), (4, 256, 4096, 64, 6), (3, 7, 384, 6, 2),
    (2, 16, 128, 8, 16), (8, 256, 7168, 256, 16)])
def test_variants_assemble_without_spills(phase, ranks, max_tokens, hidden, experts, topk):
    summed = combine_kernel.choose_config(SM90, ranks, max_tokens, hidden, experts, topk,
                                          phase=phase, summed=True)
    for kernel, cfg in ((dispatch_kernel, None), (combine_kernel, None), (combine_kernel, summed)):
        cfg = cfg or kernel.choose_config(SM90, ranks, max_tokens, hidden, experts, topk,
                                          phase=phase)
        compiled = assembles_cleanly(kernel.generate(cfg))
        assert compiled.launch.cooperative == (phase == "both")
        assert compiled.launch.block == cfg.threads


def _body(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if line.strip() and
            not line.strip().startswith("//")]


def test_protocol_in_the_ptx():
    """Flags published with st.release.sys and waited for with timed ld.acquire.sys; no
    non-coherent load of the buffer; the combine's sum with separate products and sums."""
    cfg = dispatch_kernel.choose_config(SM90, 2, 64, 256, 8, 2)
    lines = _body(dispatch_kernel.generate(cfg).ptx())
    assert sum("st.release.sys.global.u32 [%flag_at], %flag" in line for line in lines) == 1
    # The flag, polled and looked at once more past the limit.
    assert sum("ld.acquire.sys.global.u32" in line for line in lines) == 2
    assert sum(line == "trap;" for line in lines) == 1
    nc = [line for line in lines if ".nc" in line]
    # Only the sender's inputs (the quantized rows, their scales, top-k and its weights)
    # and the buffers' addresses, which the host wrote before the launch.
    assert nc and all("%copy" in line or "%scale" in line or "%index" in line or
                      "%weight" in line or "_buffer" in line for line in nc), nc
    # The receivers read the slots the peers wrote: never through the non-coherent path.
    receive = lines[next(i for i, line in enumerate(lines) if line.startswith("$L_not_a_sender")):]
    assert not [line for line in receive if ".nc" in line and "_buffer" not in line]
    assert not any("atom" in line for line in lines)  # positions from a scan
    cfg = combine_kernel.choose_config(SM90, 2, 64, 256, 8, 3)
    lines = _body(combine_kernel.generate(cfg).ptx())
    # A pair's flag, and the round's mark; each waited for (polled, then looked at once
    # more past the limit).
    assert sum("st.release.sys.global.u32" in line for line in lines) == 2
    assert sum("ld.acquire.sys.global.u32" in line for line in lines) == 4
    receive = lines[next(i for i, line in enumerate(lines) if line.startswith("$L_not_a_sender")):]
    # Each of a thread's SUM_UNROLL vectors: a load a pair, and the pairs summed in k order.
    rows = [line for line in receive if "{%pair" in line]
    unroll = combine_kernel.SUM_UNROLL
    assert len(rows) == 3 * unroll and not [line for line in rows if ".nc" in line], rows
    assert not any("fma" in line for line in lines)
    adds = [line for line in lines if line.startswith("@%has") and "add.rn.f32" in line]
    assert [line.split()[0] for line in adds[::8]] == ["@%has0", "@%has1", "@%has2"] * unroll


def test_kernels_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank must be 1 to 256"):
        dispatch_kernel.choose_config(SM90, 2, 257, 128, 8, 2)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 128"):
        dispatch_kernel.choose_config(SM90, 2, 8, 100, 8, 2)
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        combine_kernel.choose_config(SM90, 3, 8, 128, 8, 2)
    with pytest.raises(ValueError, match="phase must be one of"):
        combine_kernel.choose_config(SM90, 2, 8, 128, 8, 2, phase="all")
    with pytest.raises(ValueError, match="fp8"):
        dispatch_kernel.choose_config(arch.get("sm_80"), 2, 8, 128, 8, 2)


# ---------------------------------------------------------------------------- host checks
def _inputs(tokens=4, hidden=256, topk=2):
    return (torch.zeros(tokens, hidden, dtype=torch.bfloat16),
            torch.zeros(tokens, topk, dtype=torch.int64))


@pytest.mark.parametrize("change, message", [
    (lambda x, i: (x[:, :128].contiguous()[:, :96].contiguous(), i), "hidden must be a positive multiple of 128"),
    (lambda x, i: (x[0], i), "x must have 2 dimensions"),
    (lambda x, i: (x, i[:3]), "topk_idx must have x's 4 tokens"),
    (lambda x, i: (torch.zeros(9, 256, dtype=torch.bfloat16), torch.zeros(9, 2, dtype=torch.int64)),
     "at most num_max_dispatch_tokens_per_rank"),
])
def test_dispatch_argument_errors_name_the_argument(change, message):
    """Values the kernels cannot take are ValueErrors; wrong types and dtypes TypeErrors,
    as everywhere in ptxforge."""
    x, idx = change(*_inputs())
    with pytest.raises(ValueError, match=message):
        low_latency.check_dispatch(x, idx, num_max_dispatch_tokens_per_rank=8, num_experts=8,
                                   ranks=2, device=0)


def test_sizes_and_combine_argument_errors():
    x, idx = _inputs()
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16"):
        low_latency.check_dispatch(x.float(), idx, num_max_dispatch_tokens_per_rank=8,
                                   num_experts=8, ranks=2, device=0)
    with pytest.raises(TypeError, match="topk_idx must have dtype torch.int64"):
        low_latency.check_dispatch(x, idx.int(), num_max_dispatch_tokens_per_rank=8,
                                   num_experts=8, ranks=2, device=0)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank must be 1 to 256"):
        low_latency.check_dispatch(x, idx, num_max_dispatch_tokens_per_rank=300,
                                   num_experts=8, ranks=2, device=0)
    with pytest.raises(ValueError, match="num_experts must be a positive multiple of the 3"):
        low_latency.check_dispatch(x, idx, num_max_dispatch_tokens_per_rank=8, num_experts=8,
                                   ranks=3, device=0)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        low_latency.check_dispatch(x, idx, num_max_dispatch_tokens_per_rank=8, num_experts=8,
                                   ranks=2, device=0)
    handle = low_latency.Handle(2, 8, 8, 256, 2, 4, torch.zeros(4, 16, 3, dtype=torch.int32),
                                torch.zeros(4, dtype=torch.int32))
    y = torch.zeros(4, 16, 256, dtype=torch.bfloat16)
    w = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"x must have shape \(4, 16, 256\)"):
        low_latency.check_combine(y[:, :8], idx, w, handle, device=0)
    with pytest.raises(TypeError, match="topk_weights must have dtype torch.float32"):
        low_latency.check_combine(y, idx, w.double(), handle, device=0)
    with pytest.raises(ValueError, match=r"topk_weights must have shape \(4, 2\)"):
        low_latency.check_combine(y, idx, w[:2], handle, device=0)
    with pytest.raises(ValueError, match="topk_idx must have the dispatch's 4 tokens"):
        low_latency.check_combine(y, idx[:2], w[:2], handle, device=0)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        low_latency.check_combine(y, idx, w, handle, device=0)
    # Weights sent with the dispatch: its combine takes that tensor, not another.
    with pytest.raises(ValueError, match=r"topk_weights must have shape \(4, 2\)"):
        low_latency.check_dispatch(x, idx, num_max_dispatch_tokens_per_rank=8, num_experts=8,
                                   ranks=2, device=0, topk_weights=w[:2])
    with pytest.raises(TypeError, match="topk_weights must have dtype torch.float32"):
        low_latency.check_dispatch(x, idx, num_max_dispatch_tokens_per_rank=8, num_experts=8,
                                   ranks=2, device=0, topk_weights=w.bfloat16())
    weighted = dataclasses.replace(handle, weights=w)
    with pytest.raises(ValueError, match="topk_weights must be the tensor the dispatch was"):
        low_latency.check_combine(y, idx, w.clone(), weighted, device=0)


# ---------------------------------------------------------------------------- simulation
def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensor(memory: Memory, address: int, shape, dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    if not n:
        return torch.empty(shape, dtype=dtype)
    data = bytearray(memory.read(address, n * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape).clone()


class World:
    """Simulated ranks over one memory: a zeroed buffer each (never cleared again), the
    peers table, an error record each; every rank's inputs; launches and checks."""

    def __init__(self, ranks=2, max_tokens=12, hidden=256, experts=8, topk=3, seed=0):
        self.ranks, self.max_tokens, self.hidden = ranks, max_tokens, hidden
        self.experts, self.topk = experts, topk
        self.local = experts // ranks
        self.rows = ranks * max_tokens
        self.plan = LowLatencyPlan(ranks, max_tokens, hidden, experts, topk)
        self.memory = Memory()
        self.buffers = [self.memory.alloc(self.plan.bytes_needed) for _ in range(ranks)]
        self.peers = self.memory.put(struct.pack(f"<{ranks}Q", *self.buffers))
        self.errors = [self.memory.alloc(16) for _ in range(ranks)]
        self.seed = seed

    def record(self, rank: int) -> tuple:
        return struct.unpack("<4I", self.memory.read(self.errors[rank], 16))

    def common(self, rank: int) -> dict:
        return dict(rank=rank, peers=self.peers, error=self.errors[rank], timeout_ns=TIMEOUT)

    def inputs(self, tokens):
        """Every rank's bf16 rows (a zero row among them), top-k indices (-1, an index past
        E, a repeated expert) and weights."""
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        self.x, self.idx, self.weights = [], [], []
        for r, n in enumerate(tokens):
            x = torch.randn(n, self.hidden, generator=g).bfloat16()
            idx = torch.stack([torch.randperm(self.experts, generator=g)[:self.topk]
                               for _ in range(n)]).long() if n else \
                torch.empty(0, self.topk, dtype=torch.int64)
            if n:
                x[0] = 0
                idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
                idx[0, 0] = self.experts + 5
                if self.topk > 1 and n > 1:
                    idx[1, 1] = idx[1, 0] = 1
            self.x.append(x)
            self.idx.append(idx)
            self.weights.append(torch.rand(idx.shape, generator=g))

    def launch_dispatch(self, sim, rank, phase="both", weighted=False):
        cfg = dispatch_kernel.choose_config(SM90, self.ranks, self.max_tokens, self.hidden,
                                            self.experts, self.topk, phase=phase)
        m, args = self.memory, self.common(rank)
        if cfg.sends:
            # The host quantizes each token once (ops.quantize_fp8_per_token, row-major
            # scales): its recipe, bit for bit, is the reference's.
            q, scales = quantize_fp8_per_token(self.x[rank]) if len(self.x[rank]) else (
                torch.empty(0, self.hidden, dtype=torch.float8_e4m3fn), torch.empty(0))
            args.update(x=m.put(_bytes(q)), x_scales=m.put(_bytes(scales.contiguous())),
                        topk_idx=m.put(_bytes(self.idx[rank])), tokens=self.x[rank].shape[0],
                        topk_weights=m.put(_bytes(self.weights[rank]) or b"\0") if weighted
                        else 0)
        out = {}
        if cfg.receives:
            padded = -(-self.rows // 4) * 4  # MN-major, TMA-aligned columns
            groups = self.hidden // 128
            out = dict(recv_x=m.alloc(self.local * self.rows * self.hidden),
                       recv_scales=m.alloc(4 * self.local * groups * padded),
                       recv_src_info=m.alloc(12 * self.local * self.rows),
                       recv_count=m.alloc(4 * self.local))
            args.update(out, scale_expert_stride=groups * padded, scale_group_stride=padded)
        sim.launch(f"dispatch_{phase}{rank}", dispatch_kernel.generate(cfg).ptx(), cfg.grid,
                   cfg.threads, **args)
        return out

    def received(self, out) -> dict:
        m, groups = self.memory, self.hidden // 128
        padded = -(-self.rows // 4) * 4
        scales = _tensor(m, out["recv_scales"], (self.local, groups, padded), torch.float32)
        return {"x": _tensor(m, out["recv_x"], (self.local, self.rows, self.hidden),
                             torch.float8_e4m3fn),
                "scales": scales[:, :, :self.rows].transpose(1, 2),
                "src_info": _tensor(m, out["recv_src_info"], (self.local, self.rows, 3),
                                    torch.int32),
                "count": _tensor(m, out["recv_count"], (self.local,), torch.int32)}

    def check_dispatch(self, outs) -> list:
        got = []
        for r, out in enumerate(outs):
            have = self.received(out)
            expected = reference.low_latency_dispatch(r, self.x, self.idx, self.experts,
                                                      self.max_tokens)
            assert torch.equal(have["count"], expected["count"]), r
            for local, n in enumerate(expected["count"].tolist()):
                for name in ("x", "scales", "src_info"):
                    assert _bytes(have[name][local, :n]) == _bytes(expected[name][local, :n]), \
                        (r, local, name)
            got.append(have)
        return got

    def dispatch(self, phases=("both",), weighted=False):
        """Every rank's dispatch, one phase, or the send halves run to completion before the
        receive halves launch; checked. ``weighted``: the top-k weights go with it."""
        outs = None
        for phase in phases:
            sim = Simulator(self.memory)
            launched = [self.launch_dispatch(sim, r, phase, weighted)
                        for r in range(self.ranks)]
            sim.run()
            outs = launched if launched[0] else outs
        return self.check_dispatch(outs)

    @staticmethod
    def expert_outputs(got, rank: int, scale: float):
        """A rank's experts' outputs: its received rows dequantized, times ``scale``, plus
        the rank."""
        return ((got["x"].float() * got["scales"].repeat_interleave(128, 2)) * scale + rank
                ).bfloat16()

    def launch_combine(self, sim, r: int, y, received, out: int, phase: str, summed: bool):
        m = self.memory
        cfg = combine_kernel.choose_config(SM90, self.ranks, self.max_tokens, self.hidden,
                                           self.experts, self.topk, phase=phase, summed=summed)
        args = self.common(r)
        if cfg.sends:
            args.update(x=m.put(_bytes(y)))
        if cfg.sends and not summed:
            args.update(src_info=m.put(_bytes(received["src_info"])),
                        recv_count=m.put(_bytes(received["count"])))
        if cfg.receives:
            args.update(topk_idx=m.put(_bytes(self.idx[r]) or b"\0"),
                        tokens=self.x[r].shape[0], out=out)
        if cfg.receives and not summed:
            args.update(topk_weights=m.put(_bytes(self.weights[r]) or b"\0"))
        sim.launch(f"combine_{phase}{r}", combine_kernel.generate(cfg).ptx(),
                   cfg.grid(self.x[r].shape[0]), cfg.threads, **args)

    def combine(self, received, scale: float, phases=("both",), summed=False):
        """Every rank's experts' outputs (the received rows dequantized, times ``scale``,
        plus the rank), combined and checked; ``summed``: after a dispatch given the
        weights, each rank sums its pairs of a token before sending."""
        m = self.memory
        ys = [self.expert_outputs(got, r, scale) for r, got in enumerate(received)]
        outs = [m.alloc(2 * self.hidden * max(1, self.x[r].shape[0])) for r in range(self.ranks)]
        for phase in phases:
            sim = Simulator(m)
            for r in range(self.ranks):
                self.launch_combine(sim, r, ys[r], received[r], outs[r], phase, summed)
            sim.run()
        for r in range(self.ranks):
            tokens = self.x[r].shape[0]
            got = _tensor(m, outs[r], (tokens, self.hidden), torch.bfloat16)
            combine = reference.low_latency_combine_summed if summed else \
                reference.low_latency_combine
            expected = combine(r, ys, self.idx, self.weights, self.experts)
            assert _bytes(got) == _bytes(expected), r


@pytest.mark.parametrize("world, tokens", [
    (dict(), (12, 7)),                                         # 2 ranks, 4 experts each
    (dict(ranks=3, experts=6, topk=2, hidden=384), (5, 0, 9)),  # a rank with no tokens; 3 groups
    (dict(experts=2, topk=1, hidden=128, max_tokens=40), (33, 40)),  # > 32 tokens an expert
    # 3 sources x 3 batches of 32 tokens: a receive CTA's warps take two rounds of units
    (dict(ranks=3, experts=6, topk=2, hidden=128, max_tokens=72), (70, 33, 72)),
], ids=["two_ranks", "three_ranks", "one_expert_a_rank", "two_rounds_of_units"])
def test_dispatch_and_combine_match_the_references(world, tokens):
    w = World(**world)
    w.inputs(tokens)
    received = w.dispatch()
    w.combine(received, 0.5)


@pytest.mark.parametrize("world, tokens", [
    (dict(), (12, 7)),
    (dict(ranks=3, experts=6, topk=2, hidden=384), (5, 0, 9)),
    (dict(experts=2, topk=1, hidden=128, max_tokens=40), (33, 40)),
    (dict(ranks=4, experts=8, topk=4, max_tokens=6), (6, 2, 0, 5)),
    # 3 x 100 (source, token) pairs over 256 send CTAs: some send two rows, then two flags
    (dict(ranks=3, experts=6, topk=2, hidden=128, max_tokens=100), (100, 41, 97)),
], ids=["two_ranks", "three_ranks", "one_expert_a_rank", "four_ranks", "two_rows_a_cta"])
def test_a_dispatch_given_weights_and_its_summed_combine(world, tokens):
    """The dispatch sends the top-k weights with the tokens (the same received rows); the
    combine then sums a token's pairs on each experts' rank (k order, f32, one bf16 row a
    (token, rank)) and the token's rank sums those in rank order: the reference's bits."""
    w = World(**world)
    w.inputs(tokens)
    received = w.dispatch(weighted=True)
    w.combine(received, 0.5, summed=True)


def test_calls_in_a_row_on_a_buffer_never_cleared():
    """Five dispatch/combine rounds with new inputs each, the last two with the weights
    and the summed combine, the halves launched apart in the third and the fifth: each
    round's flags carry the next sequence number, never an older one."""
    w = World(max_tokens=10)
    for round, tokens in enumerate(((10, 6), (3, 9), (0, 10), (7, 7), (10, 1))):
        w.inputs(tokens)
        phases = ("send", "receive") if round in (2, 4) else ("both",)
        summed = round >= 3   # the summed combine goes on from the same numbers
        received = w.dispatch(phases, weighted=summed)
        w.combine(received, -1.0, phases, summed=summed)
    flags = w.ranks * w.plan.send_ctas
    sent = struct.unpack(f"<{flags}I", w.memory.read(w.buffers[0] + w.plan.dispatch_sent,
                                                      4 * flags))
    assert sent == (5,) * flags


def test_a_rank_that_never_launches_ends_in_the_watchdog():
    w = World()
    w.inputs((6, 6))
    sim = Simulator(w.memory)
    w.launch_dispatch(sim, 0)  # rank 1 never launches
    with pytest.raises(Trap, match="trap"):
        sim.run()
    code, channel, peer, seen = w.record(0)
    assert (code, peer, seen) == (codes.LL_DISPATCH_RECEIVE, 1, 0)
    assert 0 <= channel < w.local


def test_a_combine_without_its_peer_ends_in_the_watchdog():
    w = World()
    w.inputs((6, 6))
    received = w.dispatch()
    cfg = combine_kernel.choose_config(SM90, 2, w.max_tokens, w.hidden, w.experts, w.topk,
                                       phase="receive")
    sim, m = Simulator(w.memory), w.memory
    sim.launch("combine0", combine_kernel.generate(cfg).ptx(), cfg.grid(6), cfg.threads,
               topk_idx=m.put(_bytes(w.idx[0])), topk_weights=m.put(_bytes(w.weights[0])),
               tokens=6, out=m.alloc(2 * 6 * w.hidden), **w.common(0))
    with pytest.raises(Trap):
        sim.run()
    code, token, peer, seen = w.record(0)
    # Whichever wait ran out first: a pair's row, or the round (rank 0's or 1's combine).
    assert (code == codes.LL_COMBINE_RECEIVE and 0 <= token < 6 and 0 <= peer < w.experts) \
        or (code == codes.LL_COMBINE_START and peer in (0, 1)), (code, token, peer)
    assert received  # the dispatch before it completed


def test_a_rank_without_tokens_waits_for_the_round_in_its_combine():
    """Rank 0 has no tokens, so no pair of its waits on rank 1; rank 1's dispatch receive
    lags. Rank 0's combine still waits for rank 1's combine to start (its CTA 0, for every
    rank): otherwise it would end, and rank 0's next dispatch send would rewrite flag (0,
    c) of rank 1 before rank 1's receive read it, which then waits until its watchdog."""
    w = World()
    w.inputs((0, 6))
    sim = Simulator(w.memory)
    for r in range(2):
        w.launch_dispatch(sim, r, "send")
    sim.run()
    sim = Simulator(w.memory)
    out = w.launch_dispatch(sim, 0, "receive")
    sim.run()
    got = w.received(out)
    sim = Simulator(w.memory)
    w.launch_combine(sim, 0, w.expert_outputs(got, 0, 0.5), got, w.memory.alloc(2 * w.hidden),
                     "both", False)
    with pytest.raises(Trap):
        sim.run()
    assert w.record(0)[0] == codes.LL_COMBINE_START and w.record(0)[2] == 1
