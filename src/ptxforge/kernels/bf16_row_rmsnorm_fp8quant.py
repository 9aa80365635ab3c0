"""Row kernels over bf16 activations [M, K]: RMSNorm, per-token-group FP8 quantization, RMSNorm
or SwiGLU fused with the quantization, and the MoE's permutations of the quantization; and
the MoE's permutation of rows already in e4m3.

One generator, seven variants (``VARIANTS``, one ``RowVariant`` value each: the ops, the
registry, precompiling and the compile backend all take them from there):

    variant (the op)           normalize quantize swiglu row map  writes
    rms_norm                   yes       no       no     dense    y  bf16 [M, K]
    quantize_fp8_per_token     no        yes      no     dense    q  e4m3 [M, K] + scales f32
                                                                  (M x ceil(K/128))
    rms_norm_quantize_fp8      yes       yes      no     dense    q + scales of rms_norm(x)
                                                                  rounded to bf16
    silu_mul_quantize_fp8      no        yes      yes    dense    q + scales of h = silu(gate)
                                                                  * up, rounded as eager
                                                                  PyTorch rounds it
    moe_permute_quantize_fp8   no        yes      no     scatter  a token's q into each of its
                                                                  experts' rows
    moe_silu_mul_quantize_fp8  no        yes      yes    indexed  SwiGLU + q of the grouped
                                                                  rows holding a pair
    moe_permute_fp8            no        no       no     scatter  an e4m3 row (already
                                                                  quantized) into each of
                                                                  its experts' rows

Inputs. A row is x's row, or with ``swiglu`` two rows: gate's and up's (an FFN's gate
and up projections, [M, K] each with K its intermediate size), each with its own pointer
and row stride, so they may be two tensors or the two halves of one gate_up output
[M, 2K] (row stride 2K). A stage row holds the row's inputs back to back: | x | or
| gate | up |.

Loads. Each CTA takes ``groups`` consecutive row groups (of ``rows_per_cta`` rows) and
thread 0 hands all of them to the copy engine at once, one bulk copy per row and input
into its own shared-memory stage, each stage completing on its own mbarrier:

    thread 0:  [copy group 0 -> stage 0][copy group 1 -> stage 1]
    all:        wait stage 0 | compute, store | wait stage 1 | compute, store

    shared memory: | stage 0: rows_per_cta rows | stage 1 | ... | one mbarrier per stage |

A whole row arrives without holding registers for it, and with two groups the second
copy overlaps the first group's compute. Measured on an H200 at 16384 x 7168
(docs/performance.md): one group per CTA is best for the lighter kernels (quantization
92-95%, RMSNorm 95% of the copy bandwidth), two for the fused one (90-93%); register
loads reached 84-91%.

Work mapping. ``threads_per_row`` threads own one row; thread ``t`` reads the 16-byte
vectors ``v = j * threads_per_row + t`` (8 bf16 each, j < vectors_per_thread) from the
stage into registers, so a quantization group (128 elements = 16 vectors) is one aligned
half-warp and its amax is 4 butterfly shuffles. The RMSNorm weight is loaded into
registers once per CTA. With ``swiglu`` the thread reads vector v of gate and of up and
keeps only h = silu(gate) * up (``patterns.activation.silu_mul_bf16x2``: eager's two bf16
roundings, its exp and reciprocal on the SFU), which then is quantized like x.

Per row group: [normalize: sum of squares -> row reduction (shuffles, then shared memory
across warps) -> rstd = rsqrt(mean + eps) -> y = x * rstd * w, rounded to bf16], then
either store y or [quantize: group amax -> scale, 448/amax -> e4m3 -> 8-byte stores, one
scale per group].

Row maps (the MoE's grouped layouts; quantizing variants without RMSNorm). The kernel
walks M work rows; ``row_map`` says which rows they read and write:

    dense    row i in, row i out (the ops above)
    scatter  row i in, quantized once, then its e4m3 row stored to rows index[i * fanout
             + j], j < fanout (compile-time): a token's row into each of its experts' rows
             of the grouped GEMM's A (moe_permute_quantize_fp8, fanout = top-k; x read
             once, not once a pair; the fanout indices loaded under the row's copy). Its
             scales go to row i of a token-major [M, G] (once), and the pair's index
             i * fanout + j to sources[index[i * fanout + j]]: the MoE scale gather
             (f32_moe_scale_gather.py) writes the grouped rows' MN-major scales from them,
             which stored from here would be fanout x G scattered 4-byte stores a row
    indexed  row index[i] in and out: only the rows of a grouped layout that hold a pair
             (moe_silu_mul_quantize_fp8 between the grouped GEMMs)

e4m3 input (moe_permute_fp8: an expert-parallel dispatch's received rows, quantized on
their source rank). Its rows are K bytes and no thread reads them: the copy engine
brings each row into its stage and stores it from there to each of its fanout rows (the
scatter's bulk stores), the row's first thread issuing them and writing sources as
above. Its scales travel apart: the op hands them to the MoE scale gather as the
token-major scales. Threads are only issuers here, so a row gets the fewest (a
half-warp) and a CTA eight rows: more bytes in flight an SM than one row a CTA.

index is int32 on the GPU (``moe_routing_layout`` writes it); an entry outside
[0, index_rows) is a dropped pair: nothing is written for it (indexed: row 0 is copied
into the stage, so the stage's byte count stays whole, and left there). The indexed
map's scales: row r's group g scale is at (r / rows_per_batch) * scale_batch_stride +
(r % rows_per_batch) * scale_row_stride + g * scale_group_stride (the masked layout's
[E, M_max, G] MN-major scales have M_max rows a batch; the contiguous layout's one batch).

Compile-time: K (fixed-size register arrays and stage size), the variant, row map and
input dtype.
Run-time: M, the inputs' pointers and row strides, eps, and the scale strides (so one
kernel writes either the plain [M, G] layout or the MN-major TMA-aligned layout the FP8
GEMM reads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import NamedTuple

from ..arch import Arch
from ..patterns import activation, fp8, reduce
from ..patterns.pipeline import StageRing
from ..ptx import KernelBuilder, LaunchShape, addr, sreg

GROUP = 128                 # quantization group along K
VECTOR = 8                  # bf16 per 16-byte vector
MIN_CTA_THREADS = 128
MAX_CTAS_PER_SM = 8
# The input rows a stage row holds, keyed by `swiglu`; each is a kernel parameter with its
# row stride (<name>, <name>_row_stride).
INPUTS = {False: ("x",), True: ("gate", "up")}
# Which rows the work rows read and write (see the docstring).
ROW_MAPS = ("dense", "scatter", "indexed")
# The input rows' element types and their bytes: bf16 activations, or e4m3 rows a scatter
# only moves.
INPUT_BYTES = {"bf16": 2, "e4m3": 1}


class RowVariant(NamedTuple):
    """What a row kernel computes (the docstring's table): the op it serves, the three
    switches and the row map, the PTX name's stem, and the row groups a CTA takes, measured
    (see the docstring; SwiGLU's not yet measured by bench/row_experiments.py: one, as for
    the quantization, whose stage it doubles). A named tuple: the ops' kernel caches are
    keyed on it at every call."""

    op: str
    normalize: bool
    quantize: bool
    swiglu: bool
    row_map: str
    stem: str               # of the kernel's name: <dtype>_<stem>_k<hidden>
    groups_per_cta: int
    doc: str
    dtype: str = "bf16"     # the input rows' (INPUT_BYTES)

    @property
    def inputs(self) -> tuple:
        return INPUTS[self.swiglu]


VARIANTS = {variant.op: variant for variant in (
    RowVariant("rms_norm", True, False, False, "dense", "rmsnorm", 1, "RMSNorm, bf16 in/out"),
    RowVariant("quantize_fp8_per_token", False, True, False, "dense", "quant_fp8_per_token", 1,
               "bf16 -> e4m3 + 1x128 scales"),
    RowVariant("rms_norm_quantize_fp8", True, True, False, "dense",
               "rmsnorm_quant_fp8_per_token", 2, "fused RMSNorm + 1x128 FP8 quantization"),
    RowVariant("silu_mul_quantize_fp8", False, True, True, "dense",
               "silu_mul_quant_fp8_per_token", 1,
               "fused SwiGLU silu(gate) * up + 1x128 FP8 quantization (hidden: I)"),
    RowVariant("moe_permute_quantize_fp8", False, True, False, "scatter",
               "quant_fp8_per_token_scatter", 1,
               "MoE: each token's row into its experts' rows, 1x128 FP8 quantization"),
    RowVariant("moe_silu_mul_quantize_fp8", False, True, True, "indexed",
               "silu_mul_quant_fp8_per_token_indexed", 1,
               "MoE: SwiGLU + 1x128 FP8 quantization of the grouped rows holding a pair"),
    RowVariant("moe_permute_fp8", False, False, False, "scatter", "permute", 1,
               "MoE: each e4m3 row (quantized already) into its experts' rows", "e4m3"),
)}
# e4m3 rows are moved by the copy engine alone: a half-warp a row issues its copies.
MOVE_THREADS_PER_ROW = 16
MAX_FANOUT = 16   # a scatter's rows per input row, each index in a register
# The scatter keeps the quantized row (two words a slot) and its fanout row indices live
# across its stores: 64 registers spill from fanout 2 at K = 7168 (ptxas 13.0); 96 hold
# every fanout up to 16.
SCATTER_REGISTERS = 96

# Vectors per thread and the register cap given to ptxas (through .minnctapersm), from
# ptxas 13.0's reports on sm_90a: quantization alone fits 8 vectors in 64 registers; with
# the weight (and y) live, 7 vectors fit in 128 but 8 need 167. SwiGLU (gate and up read,
# only h kept) fits 8 in 64 as well, except 7 vectors with 16 threads a row, which spill
# 8 bytes at 64 and fit in 72 (``RowKernelConfig.registers``).
MAX_VECTORS_PER_THREAD = {False: 8, True: 7}   # keyed by `normalize`
REGISTER_CAP = {False: 64, True: 128}
SWIGLU_16_THREADS_7_VECTORS_REGISTERS = 72


@dataclass(frozen=True)
class RowKernelConfig:
    variant: RowVariant
    hidden: int
    threads_per_row: int
    rows_per_cta: int
    groups: int       # row groups per CTA, each in its own shared-memory stage
    ctas_per_sm: int  # resident CTAs the registers and shared memory allow (ptxas's cap)
    target: str
    fanout: int = 1   # scatter: the rows each input row is stored to (a MoE's top-k)

    # The variant's switches, as the generator reads them.
    normalize = property(lambda self: self.variant.normalize)
    quantize = property(lambda self: self.variant.quantize)
    swiglu = property(lambda self: self.variant.swiglu)
    row_map = property(lambda self: self.variant.row_map)
    inputs = property(lambda self: self.variant.inputs)

    @property
    def name(self) -> str:
        fanout = str(self.fanout) if self.row_map == "scatter" else ""
        return f"{self.variant.dtype}_{self.variant.stem}{fanout}_k{self.hidden}"

    @property
    def threads(self) -> int:
        return self.threads_per_row * self.rows_per_cta

    @property
    def vectors_per_row(self) -> int:
        return self.hidden // VECTOR

    @property
    def vectors_per_thread(self) -> int:
        return -(-self.vectors_per_row // self.threads_per_row)

    @property
    def registers(self) -> int:
        """The register cap the heuristic counts resident CTAs with."""
        if self.swiglu and (self.threads_per_row, self.vectors_per_thread) == (16, 7):
            return SWIGLU_16_THREADS_7_VECTORS_REGISTERS
        if self.row_map == "scatter":
            return SCATTER_REGISTERS
        return REGISTER_CAP[self.normalize]

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // 32)

    @property
    def moves_only(self) -> bool:
        """e4m3 input: rows are copied, never read by the threads."""
        return self.variant.dtype == "e4m3"

    @property
    def row_bytes(self) -> int:
        """One input's row."""
        return self.hidden * INPUT_BYTES[self.variant.dtype]

    @property
    def stage_row_bytes(self) -> int:
        """A row's inputs, back to back."""
        return len(self.inputs) * self.row_bytes

    @property
    def stage_bytes(self) -> int:
        return self.rows_per_cta * self.stage_row_bytes

    @property
    def dynamic_shared_bytes(self) -> int:
        """The stages and their barriers: what the launch asks for."""
        return StageRing.shared_bytes(self.stage_bytes, self.groups)

    @property
    def static_shared_bytes(self) -> int:
        """Cross-warp partial sums of the row reduction."""
        if self.normalize and self.warps_per_row > 1:
            return 4 * self.rows_per_cta * self.warps_per_row
        return 0


def choose_config(arch: Arch, variant: RowVariant, hidden: int, *, groups: int | None = None,
                  fanout: int = 1) -> RowKernelConfig:
    """The fewest threads per row (a power of two, at least a half-warp) that keep each
    thread at <= 7-8 vectors; rows packed so a CTA has at least 128 threads; ``groups``
    row groups per CTA (the variant's measured default); then as many resident CTAs an
    SM as threads, registers and shared memory allow. ``fanout``: the scatter's rows per
    input row."""
    if variant not in VARIANTS.values():
        raise ValueError(f"the row kernel has no variant {variant!r}; its variants: "
                         f"{', '.join(VARIANTS)}")
    normalize, quantize, swiglu, row_map = (variant.normalize, variant.quantize,
                                            variant.swiglu, variant.row_map)
    if row_map == "scatter" and hidden % 16:
        raise ValueError(f"hidden size (x.shape[1]) must be a multiple of 16 for the scatter's "
                         f"bulk stores, got {hidden}")
    if not 1 <= fanout <= MAX_FANOUT or (fanout > 1 and row_map != "scatter"):
        raise ValueError(f"experts per token (topk) must be from 1 to {MAX_FANOUT}, and above "
                         f"1 only for the scatter row map, got {fanout}")
    groups = groups or variant.groups_per_cta
    if hidden <= 0 or hidden % VECTOR:
        raise ValueError(f"hidden size ({INPUTS[swiglu][0]}.shape[-1]) must be a positive "
                         f"multiple of {VECTOR}, got {hidden}")
    if quantize:
        arch.require("fp8", "FP8 quantization")
    arch.require("mbarrier_tx", "the row kernels' copy-engine pipeline")
    vectors = hidden // VECTOR
    max_vectors = MAX_VECTORS_PER_THREAD[normalize]
    threads_per_row = 16
    while -(-vectors // threads_per_row) > max_vectors:
        threads_per_row *= 2
    if variant.dtype == "e4m3":   # no thread reads the row
        threads_per_row = MOVE_THREADS_PER_ROW
    # A 1024-thread CTA gets at most 64 registers per thread: too few for x and w.
    max_threads_per_row = arch.max_threads_per_block // 2
    if threads_per_row > max_threads_per_row:
        limit = max_threads_per_row * max_vectors * VECTOR
        raise ValueError(f"hidden size must be at most {limit}, got {hidden}")
    rows_per_cta = max(1, MIN_CTA_THREADS // threads_per_row)
    threads = threads_per_row * rows_per_cta
    cfg = RowKernelConfig(variant, hidden, threads_per_row, rows_per_cta, groups, 1,
                          arch.target, fanout)
    shared = cfg.dynamic_shared_bytes + cfg.static_shared_bytes
    ctas = min(MAX_CTAS_PER_SM, arch.resident_ctas(threads, cfg.registers, shared))
    if ctas < 1:
        raise ValueError(f"hidden size {hidden}: {groups} row groups do not fit in shared memory")
    return replace(cfg, ctas_per_sm=ctas)


def generate(cfg: RowKernelConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads,
                      min_blocks_per_sm=cfg.ctas_per_sm)
    k.launch = LaunchShape(block=cfg.threads, shared_bytes=cfg.dynamic_shared_bytes)
    p = _Params(k, cfg)
    with k.stage("programmatic launch: the next kernel on the stream may start"):
        # Under a programmatic launch the next kernel may then be scheduled once every CTA
        # of this grid has started, and run its prologue beside our last wave (its
        # griddepcontrol.wait still waits for all of this grid). A no-op otherwise.
        k.griddepcontrol_launch_dependents()
    t = _thread_coordinates(k, cfg)
    smem = k.dynamic_shared("stages", align=128)
    base = k.reg("u32", "smem")
    k.mov(base, smem)
    stages = StageRing.packed(k, base, cfg.stage_bytes, cfg.groups)
    with k.stage("barriers"):
        stages.init(t.thread0)
    with k.stage("wait for the kernel before this one"):
        # x (and the weight) may be its output, and every thread stores into memory it may
        # still read (a graph's pool reuses buffers): all wait, after the prologue.
        k.griddepcontrol_wait()

    with k.stage("thread 0: copy this CTA's row groups into their stages"):
        first, total = k.reg("u32", "first_group"), k.reg("u32", "total_groups")
        k.mov(first, sreg.ctaid.x)
        k.mul(first, first, cfg.groups, mode="lo")
        k.add(total, p.rows, cfg.rows_per_cta - 1)
        k.shr(total, total, cfg.rows_per_cta.bit_length() - 1)
        with k.if_(t.thread0, "copies_issued"):
            _issue_copies(k, cfg, p, stages, first, total)

    weight = _load_weight(k, cfg, p, t) if cfg.normalize else None
    partials = k.shared("row_partials", cfg.static_shared_bytes) if cfg.static_shared_bytes else None
    group = k.reg("u32", "group")
    for s in range(cfg.groups):
        with k.stage(f"row group {s} of this CTA"):
            k.add(group, first, s)
            exists = k.pred("group_exists")
            k.setp("lt", exists, group, total)
            with k.if_(exists, "group_done", uniform=True):
                row = k.reg("u32", "row")
                k.mad(row, group, cfg.rows_per_cta, t.row_in_cta, mode="lo")
                row_ok = k.pred("row_ok")
                k.setp("lt", row_ok, row, p.rows)
                if cfg.row_map == "indexed":
                    row = _mapped_row(k, p, row, row_ok)
                targets = _scatter_rows(k, cfg, p, row, row_ok) if cfg.row_map == "scatter" else None
                if cfg.moves_only:
                    _move_row(k, cfg, p, t, stages, s, row, row_ok, targets)
                else:
                    _compute_row(k, cfg, p, t, stages, s, row, row_ok, targets, weight, partials)
    return k


def _compute_row(k, cfg, p, t, stages, s, row, row_ok, targets, weight, partials):
    """bf16 input: the row read from stage ``s``, normalized and/or quantized, stored."""
    valid = _vector_predicates(k, cfg, t, row_ok)
    stages.wait(addr(stages.base, stages.barrier_offset(s)), 0)
    x = _load_row(k, cfg, t, stages.base, s, row_ok, valid)
    if cfg.normalize:
        x = _normalize(k, cfg, p, t, x, weight, partials)
    if cfg.quantize:
        stage_row = _stage_row(k, cfg, t, stages, s) if targets is not None else None
        _quantize_and_store(k, cfg, p, t, row, x, valid, targets, stage_row)
    else:
        _store_bf16(k, cfg, p, t, row, x, valid)


def _stage_row(k, cfg, t, stages, s):
    """The thread's row's place in stage ``s`` (a shared address): a scatter's bulk stores
    read the e4m3 row from there."""
    stage_row = k.reg("u32", "stage_row")
    k.mad(stage_row, t.row_in_cta, cfg.stage_row_bytes, stages.base, mode="lo")
    k.add(stage_row, stage_row, stages.stage_offset(s))
    return stage_row


class _Params:
    """Kernel parameters (launches bind them by name)."""

    def __init__(self, k: KernelBuilder, cfg: RowKernelConfig):
        # Each input's (pointer, row stride in elements), in the stage row's order.
        self.inputs = [(k.param(name, "u64"), k.param(f"{name}_row_stride", "u32"))
                       for name in cfg.inputs]
        self.rows = k.reg("u32", "rows")
        k.ld_param(self.rows, k.param("rows", "u32"))
        if cfg.normalize:
            self.weight = k.param("weight", "u64")
            self.eps = k.param("eps", "f32")
        if cfg.quantize:
            self.q = k.param("q", "u64")
            self.scales = k.param("scales", "u64")
            self.scale_row_stride = k.param("scale_row_stride", "u32")      # elements
            self.scale_group_stride = k.param("scale_group_stride", "u32")  # elements
        elif cfg.moves_only:
            self.q = k.param("q", "u64")
        else:
            self.y = k.param("y", "u64")
        if cfg.row_map != "dense":
            self.index = k.param("index", "u64")              # int32 [rows]: the row written
            self.index_rows = k.param("index_rows", "u32")    # rows of q (indexed: and x)
        if cfg.row_map == "indexed":
            self.rows_per_batch = k.param("rows_per_batch", "u32")
            self.scale_batch_stride = k.param("scale_batch_stride", "u32")  # elements
        if cfg.row_map == "scatter":
            self.sources = k.param("sources", "u64")   # int32 [index_rows]: each row's pair


def _issue_copies(k, cfg, p, stages, first, total) -> None:
    """Arm stage s with its group's byte count and copy the group's rows of each input into
    it, for every group of this CTA that exists."""
    inputs = []
    for name, (ptr_param, stride_param) in zip(cfg.inputs, p.inputs):
        ptr, stride = k.reg("u64", f"{name}_ptr"), k.reg("u32", f"{name}_stride_bytes")
        k.ld_param(ptr, ptr_param)
        k.ld_param(stride, stride_param)
        if INPUT_BYTES[cfg.variant.dtype] == 2:
            k.shl(stride, stride, 1)
        inputs.append((ptr, stride))
    group, first_row, rows_here = (k.reg("u32", n) for n in ("copy_group", "copy_row", "copy_rows"))
    nbytes = k.reg("u32", "copy_bytes")
    for s in range(cfg.groups):
        k.add(group, first, s)
        exists = k.pred("copy_group_exists")
        k.setp("lt", exists, group, total)
        with k.if_(exists, "copy_done"):
            k.mul(first_row, group, cfg.rows_per_cta, mode="lo")
            k.sub(rows_here, p.rows, first_row)
            k.min(rows_here, rows_here, cfg.rows_per_cta)
            k.mul(nbytes, rows_here, cfg.stage_row_bytes, mode="lo")
            bar = addr(stages.base, stages.barrier_offset(s))
            k.mbarrier_arrive_expect_tx(bar, nbytes)
            if cfg.row_map == "indexed":
                _issue_mapped_copies(k, cfg, p, stages, s, inputs, first_row, rows_here, bar)
            else:
                _issue_dense_copies(k, cfg, stages, s, inputs, first_row, rows_here, bar)


def _issue_dense_copies(k, cfg, stages, s, inputs, first_row, rows_here, bar) -> None:
    """The group's rows of each input: consecutive rows from ``first_row`` on."""
    src = k.reg("u64", "copy_src")
    for i, (ptr, stride) in enumerate(inputs):
        k.mad(src, first_row, stride, ptr, mode="wide")
        dst = stages.stage_offset(s) + i * cfg.row_bytes
        k.cp_async_bulk_load(addr(stages.base, dst), addr(src), cfg.row_bytes, bar)
        for r in range(1, cfg.rows_per_cta):  # the group's other rows, where they exist
            k.mad(src, stride, 1, src, mode="wide")
            in_range = k.pred("copy_row_ok")
            k.setp("gt", in_range, rows_here, r)
            with k.guard(in_range):
                k.cp_async_bulk_load(addr(stages.base, dst + r * cfg.stage_row_bytes),
                                     addr(src), cfg.row_bytes, bar)


def _issue_mapped_copies(k, cfg, p, stages, s, inputs, first_row, rows_here, bar) -> None:
    """The group's rows one by one, each from the row its index entry names (a dropped
    pair's entry reads row 0)."""
    work, source = k.reg("u32", "copy_work_row"), k.reg("u32", "copy_source_row")
    src, index, at = k.reg("u64", "copy_src"), k.reg("u64", "copy_index"), \
        k.reg("u64", "copy_index_at")
    bound, dropped = k.reg("u32", "copy_index_rows"), k.pred("copy_dropped")
    k.ld_param(index, p.index)
    k.ld_param(bound, p.index_rows)
    for r in range(cfg.rows_per_cta):
        in_range = k.pred("copy_row_ok")
        k.setp("gt", in_range, rows_here, r)
        with k.if_(in_range, "copy_row_done"):
            k.add(work, first_row, r)
            k.mad(at, work, 4, index, mode="wide")
            k.ld(source, addr(at), nc=True)
            k.setp("ge", dropped, source, bound, type="u32")
            k.selp(source, 0, source, dropped)
            for i, (ptr, stride) in enumerate(inputs):
                k.mad(src, source, stride, ptr, mode="wide")
                dst = stages.stage_offset(s) + i * cfg.row_bytes + r * cfg.stage_row_bytes
                k.cp_async_bulk_load(addr(stages.base, dst), addr(src), cfg.row_bytes, bar)


def _mapped_row(k, p, work_row, row_ok):
    """The row a mapped work row writes, index[work_row]; ``row_ok`` is cleared for a
    dropped pair (an entry outside [0, index_rows)) as for a work row past M."""
    row, at = k.reg("u32", "out_row"), k.reg("u64", "index_at")
    bound = k.reg("u32", "index_rows")
    k.ld_param(at, p.index)
    k.mad(at, work_row, 4, at, mode="wide")
    k.mov(row, 0xFFFFFFFF)
    with k.guard(row_ok):
        k.ld(row, addr(at), nc=True)
    k.ld_param(bound, p.index_rows)
    k.setp("lt", row_ok, row, bound, type="u32")
    return row


def _thread_coordinates(k: KernelBuilder, cfg: RowKernelConfig) -> SimpleNamespace:
    t = SimpleNamespace()
    with k.stage("thread coordinates"):
        tid = k.reg("u32", "tid")
        k.mov(tid, sreg.tid.x)
        t.col = k.reg("u32", "col")          # thread index within its row
        t.row_in_cta = k.reg("u32", "row_in_cta")
        k.and_(t.col, tid, cfg.threads_per_row - 1)
        k.shr(t.row_in_cta, tid, cfg.threads_per_row.bit_length() - 1)
        t.warp_in_row = k.reg("u32", "warp_in_row")
        k.shr(t.warp_in_row, t.col, 5)
        t.lane = k.reg("u32", "lane")
        k.and_(t.lane, tid, 31)
        t.thread0 = k.pred("thread0")
        k.setp("eq", t.thread0, tid, 0)
    return t


def _slot_in_row(k, cfg, t, j):
    """A predicate 'vector slot j of this thread lies within the row', or None when it
    always does (only the last slot can stick out, when K/8 is no multiple of threads_per_row)."""
    if (j + 1) * cfg.threads_per_row <= cfg.vectors_per_row:
        return None
    in_row = k.pred(f"slot{j}_in_row")
    k.setp("lt", in_row, t.col, cfg.vectors_per_row - j * cfg.threads_per_row)
    return in_row


def _vector_predicates(k, cfg, t, row_ok):
    """Per vector slot j: row in range and slot within the row."""
    valid = []
    for j in range(cfg.vectors_per_thread):
        in_row = _slot_in_row(k, cfg, t, j)
        if in_row is not None:
            k.and_pred(in_row, in_row, row_ok)
        valid.append(in_row or row_ok)
    return valid


def _load_weight(k, cfg, p, t):
    with k.stage("weight -> registers (once per CTA)"):
        base = k.reg("u64", "w_ptr")
        k.ld_param(base, p.weight)
        k.mad(base, t.col, VECTOR * 2, base, mode="wide")
        weight = []
        for j in range(cfg.vectors_per_thread):
            w = k.regs("b32", 4, f"w{j}_")
            in_row = _slot_in_row(k, cfg, t, j)
            if in_row is None:
                k.ld(w, addr(base, j * cfg.threads_per_row * VECTOR * 2), nc=True)
            else:
                for r in w:
                    k.mov(r, 0)
                with k.guard(in_row):
                    k.ld(w, addr(base, j * cfg.threads_per_row * VECTOR * 2), nc=True)
            weight.append(w)
    return weight


def _load_row(k, cfg, t, base, stage, row_ok, valid):
    """The thread's vectors of its row: x's, or with ``swiglu`` h = silu(gate) * up, each
    computed as soon as its gate and up vectors are read (only h stays in registers)."""
    what = "h = silu(gate) * up" if cfg.swiglu else "x"
    with k.stage(f"read the row group's vectors from its stage: {what}"):
        src = k.reg("u32", "stage_ptr")
        k.mad(src, t.row_in_cta, cfg.stage_row_bytes, base, mode="lo")
        k.mad(src, t.col, VECTOR * 2, src, mode="lo")
        offset = stage * cfg.stage_bytes
        scratch = k.regs("f32", 3, "silu") if cfg.swiglu else None
        x = []
        for j in range(cfg.vectors_per_thread):
            at = offset + j * cfg.threads_per_row * VECTOR * 2
            if cfg.swiglu:
                gate = _read_vector(k, f"g{j}_", addr(src, at), valid[j], row_ok)
                up = _read_vector(k, f"u{j}_", addr(src, at + cfg.row_bytes), valid[j], row_ok)
                h = k.regs("b32", 4, f"h{j}_")
                activation.silu_mul_bf16x2(k, h, gate, up, scratch)
                x.append(h)
            else:
                x.append(_read_vector(k, f"x{j}_", addr(src, at), valid[j], row_ok))
    return x


def _read_vector(k, name, at, valid, row_ok):
    """The 16-byte vector at ``at`` in the stage. A slot that may lie past the row's end
    (``valid`` is not ``row_ok``) reads as zeros there."""
    v = k.regs("b32", 4, name)
    if valid is not row_ok:
        for r in v:
            k.mov(r, 0)  # out-of-row slots must not disturb the row's reductions
        with k.guard(valid):
            k.ld(v, at, space="shared")
    else:
        # Rows past M read stale shared memory; only their own row's lanes see it.
        k.ld(v, at, space="shared")
    return v


def _normalize(k, cfg, p, t, x, weight, partials):
    """y = x * rsqrt(mean(x^2) + eps) * w in f32, returned as packed bf16x2 (like x)."""
    with k.stage("RMSNorm: sum of squares, row reduction, scale by rstd and weight"):
        lo, hi, tmp = k.reg("f32", "lo"), k.reg("f32", "hi"), k.reg("f32", "tmp")
        sumsq = k.reg("f32", "sumsq")
        k.mov(sumsq, 0.0)
        for v in x:
            for packed in v:
                fp8.unpack_bf16x2(k, lo, hi, packed)
                k.fma(sumsq, lo, lo, sumsq)
                k.fma(sumsq, hi, hi, sumsq)
        reduce.butterfly_sum(k, [sumsq], min(cfg.threads_per_row, 32), [tmp])
        if cfg.warps_per_row > 1:
            _reduce_across_warps(k, cfg, t, partials, sumsq, tmp)
        rstd, eps = k.reg("f32", "rstd"), k.reg("f32", "eps")
        k.ld_param(eps, p.eps)
        k.mul(rstd, sumsq, 1.0 / cfg.hidden)
        k.add(rstd, rstd, eps)
        k.rsqrt(rstd, rstd)
        wlo, whi = k.reg("f32", "wlo"), k.reg("f32", "whi")
        y = []
        for v, w in zip(x, weight):
            out = k.regs("b32", 4, "y")
            for packed, wpacked, dst in zip(v, w, out):
                fp8.unpack_bf16x2(k, lo, hi, packed)
                fp8.unpack_bf16x2(k, wlo, whi, wpacked)
                k.mul(lo, lo, rstd)
                k.mul(hi, hi, rstd)
                k.mul(lo, lo, wlo)
                k.mul(hi, hi, whi)
                k.cvt(dst, hi, lo, dtype="bf16x2", rnd="rn")
            y.append(out)
    return y


def _reduce_across_warps(k, cfg, t, partials, value, tmp):
    """Sum a row's per-warp partials through shared memory (two barriers: write->read, read->reuse)."""
    slot, base = k.reg("u32", "slot"), k.reg("u32", "partials")
    k.mov(base, partials)
    k.mad(slot, t.row_in_cta, cfg.warps_per_row, t.warp_in_row, mode="lo")
    k.mad(slot, slot, 4, base, mode="lo")
    lane0 = k.pred("lane0")
    k.setp("eq", lane0, t.lane, 0)
    with k.guard(lane0):
        k.st(addr(slot), value, space="shared")
    k.bar_sync(0)
    row_base = k.reg("u32", "row_partials")
    k.mad(row_base, t.row_in_cta, cfg.warps_per_row * 4, base, mode="lo")
    k.ld(value, addr(row_base), space="shared")
    for w in range(1, cfg.warps_per_row):
        k.ld(tmp, addr(row_base, 4 * w), space="shared")
        k.add(value, value, tmp)
    k.bar_sync(0)


def _quantize_and_store(k, cfg, p, t, row, x, valid, targets, stage_row):
    """Quantize the row, then store it: at ``row``, or (scatter) at each of ``targets``,
    the rows its index entries name: the e4m3 row written once into its stage (which the
    threads have read), then copied to each target by the copy engine (one bulk store of
    K bytes a target, issued by the row's first thread, who also stores the pair's index
    at sources[target]); the scales once, at ``row`` (token-major)."""
    q, scales = _quantize(k, cfg, x)
    if targets is None:
        _store_quantized(k, cfg, p, t, row, q, scales, valid)
        return
    with k.stage("scatter: the e4m3 row into its stage, visible to the copy engine"):
        k.bar_sync(0)   # every thread has read its vectors of the stage
        at = k.reg("u32", "q_stage_at")
        k.mad(at, t.col, VECTOR, stage_row, mode="lo")
        for j, packed in enumerate(q):
            with k.guard(valid[j]):
                k.st(addr(at, j * cfg.threads_per_row * VECTOR), packed, type="b32",
                     space="shared")
        k.fence_proxy_async()
        k.bar_sync(0)
    _store_quantized(k, cfg, p, t, row, q, scales, valid, values=False)
    _scatter_stores(k, cfg, p, t, row, valid[0], targets, stage_row)


def _move_row(k, cfg, p, t, stages, s, row, row_ok, targets):
    """e4m3 input: the row, in stage ``s`` as the copy engine left it, stored to each of
    its targets. No thread has written the stage (copy engine in, copy engine out), so no
    proxy fence comes between."""
    stages.wait(addr(stages.base, stages.barrier_offset(s)), 0)
    _scatter_stores(k, cfg, p, t, row, row_ok, targets, _stage_row(k, cfg, t, stages, s))


def _scatter_stores(k, cfg, p, t, row, row_exists, targets, stage_row):
    """The row at ``stage_row`` (K e4m3 bytes) to each of ``targets`` by bulk stores, issued
    by the row's first thread (``row_exists``: of a row that exists), who also stores each
    pair's index at sources[target]; then every thread waits until the stores have read
    the stage."""
    bound, written = k.reg("u32", "index_rows"), k.pred("pair_written")
    first, issuer = k.pred("row_first_thread"), k.pred("bulk_issuer")
    q_base, dst = k.reg("u64", "q_base"), k.reg("u64", "q_dst")
    sources, source_at = k.reg("u64", "sources"), k.reg("u64", "source_at")
    pair = k.reg("u32", "pair")
    k.ld_param(bound, p.index_rows)
    k.ld_param(q_base, p.q)
    k.ld_param(sources, p.sources)
    k.setp("eq", first, t.col, 0)
    k.and_pred(first, first, row_exists)
    for j, target in enumerate(targets):
        with k.stage(f"scatter: pair {j}'s row, a bulk store, and the pair at sources[row]"):
            k.setp("lt", written, target, bound, type="u32")
            k.and_pred(issuer, first, written)
            with k.guard(issuer):
                k.mad(dst, target, cfg.hidden, q_base, mode="wide")
                k.cp_async_bulk_store(addr(dst), addr(stage_row), cfg.hidden)
                k.mad(source_at, target, 4, sources, mode="wide")
                k.mad(pair, row, cfg.fanout, j, mode="lo")
                k.st(addr(source_at), pair)
    with k.stage("scatter: the stage is read before the CTA leaves"):
        k.cp_async_bulk_commit_group()
        k.cp_async_bulk_wait_group(0, read=True)


def _scatter_rows(k, cfg, p, row, row_ok) -> list:
    """The rows input row ``row`` is stored to, index[row * fanout + j], loaded before the
    row's stage is waited for (their latency under the copy's); -1 past M."""
    with k.stage("scatter: the rows this row goes to"):
        at, index = k.reg("u64", "pair_index_at"), k.reg("u64", "pair_index")
        k.ld_param(index, p.index)
        k.mul(at, row, 4 * cfg.fanout, mode="wide")
        k.add(at, at, index)
        targets = k.regs("u32", cfg.fanout, "pair_row")
        for j, target in enumerate(targets):
            k.mov(target, 0xFFFFFFFF)
            with k.guard(row_ok):
                k.ld(target, addr(at, 4 * j), nc=True)
    return targets


def _quantize(k, cfg, x):
    """Per 128-element group (a half-warp): amax, scale, e4m3. Returns the thread's packed
    e4m3 words (two per slot) and each slot's scale."""
    with k.stage("quantize: per-128 group amax (half-warp), scale, e4m3"):
        slots = len(x)
        amax = k.regs("f32", slots, "amax")
        inv, scale = k.regs("f32", slots, "inv_scale"), k.regs("f32", slots, "scale")
        shuffled = k.regs("f32", slots, "shuffled")
        packed_max, halves = k.reg("b32", "packed_max"), k.regs("f32", 2, "half")
        # Phases across all slots, so each phase's latencies (shuffles, reciprocals) overlap.
        for j, v in enumerate(x):
            fp8.packed_amax(k, amax[j], v, packed_max, halves)
        reduce.butterfly_max(k, amax, 16, shuffled)
        for j in range(slots):
            fp8.scale_from_amax(k, amax[j], inv[j], scale[j])
        vals = k.regs("f32", VECTOR, "v")
        scratch = k.regs("b16", 2, "e4m3x2_")
        q = []
        for j, v in enumerate(x):
            for i, word in enumerate(v):
                fp8.unpack_bf16x2(k, vals[2 * i], vals[2 * i + 1], word)
            for val in vals:
                k.mul(val, val, inv[j], rnd="rn")
            packed = k.regs("b32", 2, f"q{j}_")
            fp8.pack_e4m3x4(k, packed[0], vals[:4], scratch)
            fp8.pack_e4m3x4(k, packed[1], vals[4:], scratch)
            q.append(packed)
    return q, scale


def _store_quantized(k, cfg, p, t, row, q, scales, valid, *, values: bool = True):
    """The e4m3 words of each slot (unless ``values`` is False) and each group's scale at
    ``row``."""
    with k.stage("store: e4m3 (8 bytes a slot), one scale per group"):
        s_ptr = k.reg("u64", "s_ptr")
        if values:
            q_ptr = k.reg("u64", "q_ptr")
            k.ld_param(q_ptr, p.q)
            _advance(k, q_ptr, row, cfg.hidden, t.col, VECTOR)
        # scale index of slot j = row * row_stride + (j * threads_per_row/16 + col/16) * group_stride
        srs, sgs = k.reg("u32", "scale_row_stride"), k.reg("u32", "scale_group_stride")
        k.ld_param(srs, p.scale_row_stride)
        k.ld_param(sgs, p.scale_group_stride)
        sidx, group = k.reg("u32", "scale_idx"), k.reg("u32", "group")
        k.shr(group, t.col, 4)
        k.mul(sidx, group, sgs, mode="lo")
        if cfg.row_map != "indexed":   # dense, and a scatter's token-major scales
            k.mad(sidx, row, srs, sidx, mode="lo")
        else:   # the row's batch, then its row within the batch
            per_batch, stride = k.reg("u32", "rows_per_batch"), k.reg("u32", "scale_batch_stride")
            k.ld_param(per_batch, p.rows_per_batch)
            k.ld_param(stride, p.scale_batch_stride)
            fp8.add_batched_row_offset(k, sidx, row, per_batch, stride, srs)
        k.ld_param(s_ptr, p.scales)
        k.mad(s_ptr, sidx, 4, s_ptr, mode="wide")
        slot_step = k.reg("u32", "scale_slot_step")
        k.mul(slot_step, sgs, 4 * cfg.threads_per_row // 16, mode="lo")
        step64 = k.reg("u64", "scale_slot_step64")
        k.cvt(step64, slot_step)
        leader, store_scale = k.pred("group_leader"), k.pred("store_scale")
        k.and_(group, t.col, 15)
        k.setp("eq", leader, group, 0)
        for j, packed in enumerate(q):
            if values:
                with k.guard(valid[j]):
                    k.st(addr(q_ptr, j * cfg.threads_per_row * VECTOR), packed, type="b32")
            k.and_pred(store_scale, leader, valid[j])
            with k.guard(store_scale):
                k.st(addr(s_ptr), scales[j])
            if j + 1 < len(q):
                k.add(s_ptr, s_ptr, step64)


def _store_bf16(k, cfg, p, t, row, y, valid):
    with k.stage("store y"):
        base = k.reg("u64", "y_ptr")
        k.ld_param(base, p.y)
        _advance(k, base, row, cfg.hidden * 2, t.col, VECTOR * 2)
        for j, v in enumerate(y):
            with k.guard(valid[j]):
                k.st(addr(base, j * cfg.threads_per_row * VECTOR * 2), v, type="b32")


def _advance(k, ptr, row, row_bytes, col, col_bytes):
    """Two instructions: ptr += row * row_bytes + col * col_bytes, in 64-bit (tensors may
    exceed 4 GiB)."""
    k.mad(ptr, row, row_bytes, ptr, mode="wide")
    k.mad(ptr, col, col_bytes, ptr, mode="wide")
