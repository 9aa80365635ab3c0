"""MoE permutation, second kernel: the grouped rows' FP8 scales in the MN-major layout the
grouped GEMMs read.

``moe_permute_quantize_fp8`` quantizes each token once and copies its e4m3 row to each of
its k rows of the grouped A. Its G = ceil(H/128) scales per row lie MN-major
(``scales[g][r]``, a column of rows per group), so storing them from the token's side
scatters k x G four-byte stores per token, each a sector of its own in L2. DeepSeek-V3
at 4096 tokens makes 1.8 M of them, and they took the permutation from 79 us to 107 us
(measured on an H200). So the row kernel stores each token's scales once, token-major
(``token_scales [T, G]``), and for each pair its index p = t * k + j at
``sources[rows[p]]``. This kernel then walks the grouped rows: CTA (x, y) writes, for
THREADS rows (a thread each), their scales of the y-th run of GROUPS_PER_CTA groups. A
warp's stores of one group are 32 consecutive floats; a thread's chain of dependent
loads is short (a few tokens' rows, Mixtral's 5112, still fill the GPU).

A row's ``sources`` entry is trusted only where it names a pair that names the row back
(p < T * k and rows[p] == r). The buffer is not cleared: a row no pair names holds
whatever it held, fails that check, and keeps its scales as they were (the op's
contract).

Per thread, after ``griddepcontrol.wait`` (its inputs are the row kernel's output):

    p = sources[r]; q = rows[p] where p < pairs     two 4-byte loads
    t = p / k                                       (k compile-time)
    scales[batch, g, row in batch] = token_scales[t, g] for the CTA's groups g (< G):
                                                    their loads, then their stores

Compile-time: G (from H) and k. Run-time: R (the grouped rows, E x M_max in the masked
layout: ``rows_per_batch`` each), the pair count and the pointers and strides.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import Arch
from ..patterns import fp8
from ..ptx import KernelBuilder, LaunchShape, addr, sreg
from .bf16_row_rmsnorm_fp8quant import GROUP   # columns per scale (the 1x128 recipe)

THREADS = 128               # grouped rows per CTA, one a thread
GROUPS_PER_CTA = 8          # scales a thread copies: its loads all issued before its stores


@dataclass(frozen=True)
class ScaleGatherConfig:
    groups: int     # G: scales per row
    topk: int       # k: pairs per token
    target: str

    @property
    def name(self) -> str:
        return f"f32_moe_scale_gather_g{self.groups}_k{self.topk}"

    @property
    def group_runs(self) -> int:
        """CTAs along y: runs of GROUPS_PER_CTA groups (the last may be shorter)."""
        return -(-self.groups // GROUPS_PER_CTA)


def choose_config(arch: Arch, hidden: int, topk: int) -> ScaleGatherConfig:
    if hidden <= 0 or topk <= 0:
        raise ValueError(f"hidden size and experts per token must be positive, got "
                         f"hidden={hidden}, topk={topk}")
    arch.require("griddepcontrol", "the MoE scale gather (programmatic dependent launch)")
    return ScaleGatherConfig(-(-hidden // GROUP), topk, arch.target)


def generate(cfg: ScaleGatherConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS)
    k.launch = LaunchShape(block=THREADS)
    p = _Params(k)
    with k.stage("programmatic launch: the next kernel on the stream may start"):
        k.griddepcontrol_launch_dependents()
    row, in_range = k.reg("u32", "row"), k.pred("row_in_range")
    with k.stage("coordinates: this thread's grouped row"):
        tid, rows = k.reg("u32", "tid"), k.reg("u32", "grouped_rows")
        k.mov(row, sreg.ctaid.x)
        k.mov(tid, sreg.tid.x)
        k.mad(row, row, THREADS, tid, mode="lo")
        k.ld_param(rows, p.grouped_rows)
        k.setp("lt", in_range, row, rows)
    with k.stage("wait for the kernel before this one"):
        # sources and token_scales are its output; scales may be memory it still reads.
        k.griddepcontrol_wait()
    with k.if_(in_range, "row_done"):
        token, named = _pair_of(k, cfg, p, row)
        _copy_scales(k, cfg, p, row, token, named)
    return k


class _Params:
    """Kernel parameters (launches bind them by name)."""

    def __init__(self, k: KernelBuilder):
        self.sources = k.param("sources", "u64")            # int32 [R]: each row's pair
        self.rows = k.param("rows", "u64")                  # int32 [T * k]: each pair's row
        self.pairs = k.param("pairs", "u32")                # T * k
        self.token_scales = k.param("token_scales", "u64")  # f32 [T, G], contiguous
        self.grouped_rows = k.param("grouped_rows", "u32")  # R
        self.rows_per_batch = k.param("rows_per_batch", "u32")
        self.scales = k.param("scales", "u64")              # f32, MN-major: the strides below
        self.scale_row_stride = k.param("scale_row_stride", "u32")      # elements
        self.scale_group_stride = k.param("scale_group_stride", "u32")  # elements
        self.scale_batch_stride = k.param("scale_batch_stride", "u32")  # elements


def _pair_of(k, cfg, p, row):
    """The token whose pair names ``row`` and a predicate: whether one does."""
    with k.stage("the row's pair: sources[row], trusted where rows[pair] is this row"):
        at, pair, back = k.reg("u64", "source_at"), k.reg("u32", "pair"), k.reg("u32", "pair_row")
        pairs, named = k.reg("u32", "pairs"), k.pred("row_named")
        k.ld_param(at, p.sources)
        k.mad(at, row, 4, at, mode="wide")
        k.ld(pair, addr(at), nc=True)
        k.ld_param(pairs, p.pairs)
        k.setp("lt", named, pair, pairs)     # unsigned: a negative entry is no pair
        k.mov(back, 0xFFFFFFFF)
        k.ld_param(at, p.rows)
        k.mad(at, pair, 4, at, mode="wide")
        with k.guard(named):
            k.ld(back, addr(at), nc=True)
        k.setp("eq", named, back, row)
        token = k.reg("u32", "token")
        k.div(token, pair, cfg.topk, type="u32")
    return token, named


def _copy_scales(k, cfg, p, row, token, named) -> None:
    with k.stage("the token's scales of this CTA's groups into the row's column of each"):
        first = k.reg("u32", "first_group")
        k.mov(first, sreg.ctaid.y)
        k.mul(first, first, GROUPS_PER_CTA, mode="lo")
        src, dst = k.reg("u64", "token_scale_at"), k.reg("u64", "scale_at")
        k.ld_param(src, p.token_scales)
        k.mad(src, token, 4 * cfg.groups, src, mode="wide")
        k.mad(src, first, 4, src, mode="wide")
        # The row's scale of the CTA's first group.
        per_batch, batch_stride, row_stride, group_stride, index = (
            k.reg("u32", n) for n in ("rows_per_batch", "scale_batch_stride", "scale_row_stride",
                                      "scale_group_stride", "scale_index"))
        for reg, param in ((per_batch, p.rows_per_batch), (batch_stride, p.scale_batch_stride),
                           (row_stride, p.scale_row_stride), (group_stride, p.scale_group_stride)):
            k.ld_param(reg, param)
        k.mul(index, first, group_stride, mode="lo")
        fp8.add_batched_row_offset(k, index, row, per_batch, batch_stride, row_stride)
        k.ld_param(dst, p.scales)
        k.mad(dst, index, 4, dst, mode="wide")
        step = k.reg("u64", "group_step")
        k.mul(step, group_stride, 4, mode="wide")
        # A run's slots (G of them where G is less); where G is more and no multiple of
        # them, the last run's slots past G copy nothing.
        width = min(GROUPS_PER_CTA, cfg.groups)
        slots = [named] * width
        if cfg.groups % width:
            slots = [k.pred(f"slot{i}_copies") for i in range(width)]
            in_groups = k.pred("slot_in_groups")
            for i, slot in enumerate(slots):
                k.setp("lt", in_groups, first, cfg.groups - i, type="u32")   # G - i > 0
                k.and_pred(slot, named, in_groups)
        values = k.regs("f32", width, "scale")
        for i, (value, slot) in enumerate(zip(values, slots)):
            with k.guard(slot):
                k.ld(value, addr(src, 4 * i), nc=True)
        for value, slot in zip(values, slots):
            with k.guard(slot):
                k.st(addr(dst), value)
            k.add(dst, dst, step)
