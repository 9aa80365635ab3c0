"""The dispatch layout: from a router's top-k to what each rank and expert receives.

Input: topk_idx int64 [T, k]; expert e lives on rank e // (E / R). A pair naming no
expert in [0, E) (-1 marks none) counts nowhere. Outputs:

    num_tokens_per_rank [R] int32     tokens with at least one expert on the rank
    num_tokens_per_expert [E] int32   (token, expert) pairs naming the expert
    is_token_in_rank [T, R] bool      whether the token goes to the rank

One thread a token, CTAs of THREADS tokens. A thread reads its k indices, adds each valid
one to the CTA's expert histogram in shared memory (red.shared) and sets the expert's
rank in a bit mask; it writes its row of is_token_in_rank from the mask and adds the
ranks it names to the CTA's rank histogram. After a bar.sync, the CTA adds its non-zero
histogram entries to the outputs with red.global (the host zeroes them first). Sums
need no order: the counts are the same run to run.

Compile-time: E, R, k. Run-time: T and the pointers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...arch import Arch
from ...ptx import KernelBuilder, LaunchShape, addr, sreg
from .plan import MAX_EXPERTS, MAX_RANKS, MAX_TOPK

THREADS = 256


@dataclass(frozen=True)
class LayoutConfig:
    experts: int
    ranks: int
    topk: int
    target: str

    @property
    def name(self) -> str:
        return f"ep_dispatch_layout_e{self.experts}_r{self.ranks}_k{self.topk}"

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.ranks

    @property
    def rank_hist(self) -> int:
        """Byte offset of the rank histogram after the expert histogram."""
        return 4 * self.experts


def check_problem(experts: int, ranks: int, topk: int) -> None:
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"the group must have 1 to {MAX_RANKS} ranks, got {ranks}")
    if not 1 <= experts <= MAX_EXPERTS or experts % ranks:
        raise ValueError(f"num_experts must be a multiple of the {ranks} ranks from {ranks} to "
                         f"{MAX_EXPERTS}, got {experts}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_idx must have 1 to {MAX_TOPK} columns, got {topk}")


def choose_config(arch: Arch, experts: int, ranks: int, topk: int) -> LayoutConfig:
    check_problem(experts, ranks, topk)
    arch.require("griddepcontrol", "the dispatch layout kernel (programmatic dependent launch)")
    return LayoutConfig(experts, ranks, topk, arch.target)


def generate(cfg: LayoutConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS)
    k.launch = LaunchShape(block=THREADS)
    topk_idx, tokens_param = k.param("topk_idx", "u64"), k.param("tokens", "u32")
    per_rank, per_expert = k.param("num_tokens_per_rank", "u64"), k.param(
        "num_tokens_per_expert", "u64")
    in_rank = k.param("is_token_in_rank", "u64")
    hist = k.shared("hist", 4 * (cfg.experts + cfg.ranks), align=16)
    with k.stage("programmatic launch; wait for the kernel before this one"):
        k.griddepcontrol_launch_dependents()
        k.griddepcontrol_wait()
    tid, smem = k.reg("u32", "tid"), k.reg("u32", "smem")
    k.mov(tid, sreg.tid.x)
    k.mov(smem, hist)
    with k.stage("clear the histograms"):
        _for_each_entry(k, cfg, tid, smem, lambda at: k.st(at, 0, space="shared",
                                                           type="u32"))
    k.bar_sync(0)
    with k.stage("the thread's token: its experts, its ranks"):
        _count_token(k, cfg, tid, smem, topk_idx, tokens_param, in_rank)
    k.bar_sync(0)
    with k.stage("add the CTA's non-zero counts to the outputs"):
        _flush(k, cfg, tid, smem, per_rank, per_expert)
    return k


def _for_each_entry(k, cfg, tid, smem, emit) -> None:
    """``emit(address)`` for each histogram entry the thread owns: entries tid, tid +
    THREADS, ... of the E + R."""
    entries = cfg.experts + cfg.ranks
    at, inside = k.reg("u32", "entry_at"), k.pred("entry_inside")
    k.mad(at, tid, 4, smem)
    for i in range(-(-entries // THREADS)):
        if (i + 1) * THREADS <= entries:
            emit(addr(at, 4 * THREADS * i))
            continue
        k.setp("lt", inside, tid, entries - THREADS * i)
        with k.if_(inside, "past_entries"):
            emit(addr(at, 4 * THREADS * i))


def _count_token(k, cfg, tid, smem, topk_idx, tokens_param, in_rank) -> None:
    token, tokens = k.reg("u32", "token"), k.reg("u32", "tokens")
    k.mov(token, sreg.ctaid.x)
    k.mad(token, token, THREADS, tid)
    k.ld_param(tokens, tokens_param)
    is_token = k.pred("is_token")
    k.setp("lt", is_token, token, tokens)
    with k.if_(is_token, "no_token"):
        src = k.reg("u64", "topk_at")
        k.ld_param(src, topk_idx)
        k.mad(src, token, 8 * cfg.topk, src, mode="wide")
        index, expert = k.reg("u64", "expert_index"), k.reg("u32", "expert")
        valid, owner, ranks = k.pred("valid"), k.reg("u32", "owner"), k.reg("u32", "rank_bits")
        bit, at = k.reg("u32", "bit"), k.reg("u32", "hist_at")
        k.mov(ranks, 0)
        for j in range(cfg.topk):
            k.ld(index, addr(src, 8 * j), nc=True, type="u64")
            # -1 and every other index outside [0, E) compare as at least E unsigned.
            k.setp("lt", valid, index, cfg.experts)
            k.cvt(expert, index, dtype="u32", stype="u64")
            with k.if_(valid, "not_an_expert"):
                k.mad(at, expert, 4, smem)
                k.red(addr(at), 1, op="add", space="shared", type="u32")
                k.div(owner, expert, cfg.experts_per_rank)
                k.shl(bit, 1, owner, type="b32")
                k.or_(ranks, ranks, bit)
        row = k.reg("u64", "in_rank_at")
        k.ld_param(row, in_rank)
        k.mad(row, token, cfg.ranks, row, mode="wide")
        named = k.pred("named")
        for r in range(cfg.ranks):
            k.bfe(bit, ranks, r, 1)
            k.st(addr(row, r), bit, type="u8")
            k.setp("ne", named, bit, 0)
            with k.guard(named):
                k.red(addr(smem, cfg.rank_hist + 4 * r), 1, op="add", space="shared", type="u32")


def _flush(k, cfg, tid, smem, per_rank, per_expert) -> None:
    """Thread i adds entries i, i + THREADS, ... (experts, then ranks) where non-zero."""
    count, entry, wide = k.reg("u32", "count"), k.reg("u32", "entry_bytes"), k.reg(
        "u64", "entry_wide")
    nonzero, is_expert = k.pred("nonzero"), k.pred("is_expert_entry")
    out, rank_base, expert_base = k.reg("u64", "out_at"), k.reg("u64", "rank_base"), k.reg(
        "u64", "expert_base")
    k.ld_param(expert_base, per_expert)
    k.ld_param(rank_base, per_rank)
    k.sub(rank_base, rank_base, 4 * cfg.experts)  # entry E + r counts rank r

    def flush_one(at):
        k.ld(count, at, space="shared")
        k.setp("ne", nonzero, count, 0)
        k.sub(entry, at.base, smem)
        k.add(entry, entry, at.offset)
        k.setp("lt", is_expert, entry, 4 * cfg.experts)
        k.selp(out, expert_base, rank_base, is_expert)
        k.cvt(wide, entry, dtype="u64", stype="u32")
        k.add(out, out, wide)
        with k.guard(nonzero):
            k.red(addr(out), count, op="add", type="u32")

    _for_each_entry(k, cfg, tid, smem, flush_one)
