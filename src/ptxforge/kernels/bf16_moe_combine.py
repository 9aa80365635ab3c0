"""MoE combine: each token's weighted sum of its experts' output rows.

A mixture-of-experts layer sends token t to k experts; the down projection (a grouped
GEMM) writes each (token, expert) pair's output as one bf16 row of y [R, H]. Per token,

    out[t] = bf16_rn(sum over j = 0..k-1, in order, of f32(y[rows[t, j]]) * f32(weights[t, j]))

with each product and each sum rounded to f32 (``mul.rn`` then ``add.rn``: never fused
into an fma), starting from +0. A pair whose row lies outside [0, R) (-1 marks a dropped
pair) adds nothing, and its row is never read. The order is fixed, so the bits are the
same run to run, and they are those of the eager loop
``acc = acc + y[rows[:, j]].float() * weights[:, j:j+1].float()``.

Work mapping. A token's row of H/8 16-byte vectors is cut into ``chunks`` column chunks
of ``threads x vectors_per_thread`` vectors; CTA (x = token, y = chunk) computes one
chunk of one token's output. Thread ``tid`` of chunk c owns the vectors

    v = (c * vectors_per_thread + s) * threads + tid      (slot s < vectors_per_thread)

so every warp-wide load and store is 512 contiguous bytes. Small H gets one chunk of
fewer threads; the last chunk's slots past the row end (when the row is no multiple of a
chunk) load and store nothing.

Per CTA, after ``griddepcontrol.wait`` (y, rows and weights may be the previous kernel's
output):

    rows[t, j], weights[t, j]   scalar loads, every thread the same address (one L1 line)
    y[rows[t, j]]               one 16-byte ld.global.nc per (pair, slot), all issued
                                before the first multiply
    acc (f32 registers)         += y * w, pair by pair in order, skipped where the row is dropped
    out[t]                      cvt.rn.bf16x2, one 16-byte store per slot

Why register loads and not the row kernels' bulk copies into shared memory: a pair's row
is read once and used once, so shared memory would only be a waiting room, and holding a
whole token's k rows there (k x 2H bytes: 112 KiB at k = 8, H = 7168) leaves one CTA an
SM, or needs a refilled ring with a producer. In registers a thread keeps
k x ``vectors_per_thread`` 16-byte loads outstanding (4 registers each) beside its 8 f32
accumulators a slot. ``vectors_per_thread`` is 8 // k, so up to k = 8 a thread has about
``LOADS_IN_FLIGHT`` = 8 loads (128 bytes) in flight within 64 registers: 1024 threads an
SM keep ~128 KiB in flight, well past what covers HBM latency at full bandwidth. Above
k = 8 a thread has its k loads in flight and ptxas is given no register cap (168
registers at k = 32, no spills). Short CTAs (one token's chunk) let one CTA's arithmetic
overlap another's loads (docs/performance.md, the row kernels' "Grid" step). Needs no
mbarrier or TMA, only sm_90's griddepcontrol.

Compile-time: H, k, the weights' dtype (f32 or bf16). Run-time: y's pointer, row stride
(elements) and row count R; the pointers of rows (int32 [T, k]), weights ([T, k]) and
out (bf16 [T, H], contiguous). T is the grid's x. H is a multiple of 8 from 8 to the
grid's limit (chunks <= the grid's y limit, ~67M elements on sm_90a); k from 1 to
``MAX_TOPK``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from ..arch import Arch
from ..patterns import fp8
from ..ptx import KernelBuilder, LaunchShape, addr, sreg

VECTOR = 8                  # bf16 per 16-byte vector
VECTOR_BYTES = 16
MAX_THREADS = 128           # threads per CTA: one token's chunk (short CTAs, see the docstring)
LOADS_IN_FLIGHT = 8         # 16-byte y loads a thread issues before it multiplies
MAX_TOPK = 32               # pairs per token: the k loop is unrolled
# Bytes of one weight, keyed by the config's weight dtype.
WEIGHT_BYTES = {"f32": 4, "bf16": 2}
# The register cap given to ptxas (through .minnctapersm) while a thread has at most
# LOADS_IN_FLIGHT loads: ptxas 13.0 on sm_90a fits k <= 8 in it with no spills (56 registers
# at k = 8, 64 at k = 1, 2, 4), tests/cpu/test_kernels.py. More loads get no cap.
REGISTERS = 64


@dataclass(frozen=True)
class CombineConfig:
    hidden: int
    topk: int
    weight_dtype: str         # "f32" or "bf16"
    threads: int
    vectors_per_thread: int
    chunks: int               # CTAs per token: the grid's y
    ctas_per_sm: int | None   # resident CTAs the register cap allows (ptxas's); None: no cap
    target: str

    @property
    def name(self) -> str:
        return f"bf16_moe_combine_h{self.hidden}_k{self.topk}_w{self.weight_dtype}"

    @property
    def vectors_per_row(self) -> int:
        return self.hidden // VECTOR

    @property
    def chunk_vectors(self) -> int:
        return self.threads * self.vectors_per_thread

    @property
    def ragged(self) -> bool:
        """Whether the last chunk sticks out past the row's end."""
        return self.chunks * self.chunk_vectors != self.vectors_per_row

    @property
    def weight_bytes(self) -> int:
        return WEIGHT_BYTES[self.weight_dtype]

    @property
    def loads(self) -> int:
        """16-byte y loads a thread issues before its first multiply."""
        return self.topk * self.vectors_per_thread


def check_problem(hidden: int, topk: int) -> None:
    """The sizes the kernel takes, checked apart from a device (ops call this before
    asking for one); the grid's limit on H is ``choose_config``'s."""
    if hidden <= 0 or hidden % VECTOR:
        raise ValueError(f"hidden size (y.shape[1]) must be a positive multiple of {VECTOR}, "
                         f"got {hidden}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"experts per token (rows.shape[1]) must be from 1 to {MAX_TOPK}, "
                         f"got {topk}")


def choose_config(arch: Arch, hidden: int, topk: int, weight_dtype: str = "f32") -> CombineConfig:
    """8 // k vectors a thread (about LOADS_IN_FLIGHT loads outstanding up to k = 8), fewer
    when the row is too short to give a warp one each; the fewest chunks of at most
    MAX_THREADS threads that cover the row, and the threads spread evenly over them (so
    the last chunk sticks out as little as it can: not at all for the registered sizes);
    then, with at most LOADS_IN_FLIGHT loads a thread, as many resident CTAs an SM as the
    register cap allows."""
    check_problem(hidden, topk)
    arch.require("griddepcontrol", "the MoE combine kernel (programmatic dependent launch)")
    if weight_dtype not in WEIGHT_BYTES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_BYTES)}, "
                         f"got {weight_dtype!r}")
    vectors = hidden // VECTOR
    per_thread = max(1, min(LOADS_IN_FLIGHT // topk, vectors // arch.warp_size))
    chunks = -(-vectors // (MAX_THREADS * per_thread))
    if chunks > arch.max_grid[1]:
        limit = arch.max_grid[1] * MAX_THREADS * per_thread * VECTOR
        raise ValueError(f"hidden size (y.shape[1]) must be at most {limit} with {topk} "
                         f"experts per token, got {hidden}")
    threads = -(-vectors // (chunks * per_thread))
    cfg = CombineConfig(hidden, topk, weight_dtype, threads, per_thread, chunks, None,
                        arch.target)
    if cfg.loads > LOADS_IN_FLIGHT:
        return cfg
    return replace(cfg, ctas_per_sm=arch.resident_ctas(threads, REGISTERS))


def generate(cfg: CombineConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=cfg.threads,
                      min_blocks_per_sm=cfg.ctas_per_sm)
    k.launch = LaunchShape(block=cfg.threads)
    p = _Params(k)
    with k.stage("programmatic launch: the next kernel on the stream may start"):
        # Under a programmatic launch the next kernel may then be scheduled once every CTA
        # of this grid has started, and run its prologue beside our last wave (its
        # griddepcontrol.wait still waits for all of this grid). A no-op otherwise.
        k.griddepcontrol_launch_dependents()
    t = _thread_coordinates(k, cfg)
    with k.stage("wait for the kernel before this one"):
        # y, rows and weights may be its output, and out memory it still reads.
        k.griddepcontrol_wait()
    ptrs = _pointers(k, cfg, p, t)
    with k.stage("the token's pairs: indices and weights"):
        pairs = _load_pairs(k, cfg, ptrs)
    with k.stage("every pair's row: all loads issued before the first multiply"):
        data = _load_rows(k, cfg, t, ptrs, pairs)
    with k.stage("acc = +0, then acc += f32(y) * w pair by pair, in order"):
        acc = _accumulate(k, cfg, data, pairs)
    _store(k, cfg, t, ptrs, acc)
    return k


class _Params:
    """Kernel parameters (launches bind them by name)."""

    def __init__(self, k: KernelBuilder):
        self.y = k.param("y", "u64")
        self.y_row_stride = k.param("y_row_stride", "u32")  # elements
        self.y_rows = k.param("y_rows", "u32")              # R: rows at or past it are dropped
        self.rows = k.param("rows", "u64")                  # int32 [T, k]
        self.weights = k.param("weights", "u64")            # f32 or bf16 [T, k]
        self.out = k.param("out", "u64")                    # bf16 [T, H], contiguous


def _thread_coordinates(k: KernelBuilder, cfg: CombineConfig) -> SimpleNamespace:
    t = SimpleNamespace()
    with k.stage("coordinates: token, this thread's first vector, slots in the row"):
        t.token = k.reg("u32", "token")
        k.mov(t.token, sreg.ctaid.x)
        chunk, t.vector = k.reg("u32", "chunk"), k.reg("u32", "vector")
        k.mov(chunk, sreg.ctaid.y)
        k.mov(t.vector, sreg.tid.x)
        k.mad(t.vector, chunk, cfg.chunk_vectors, t.vector, mode="lo")
        # Slot s's predicate "within the row", or None where it always is: only in a ragged
        # row's last chunk may slots lie past the row's end; they load and store nothing.
        t.in_row = []
        last_chunk = (cfg.chunks - 1) * cfg.chunk_vectors
        for s in range(cfg.vectors_per_thread):
            in_row = None
            if last_chunk + (s + 1) * cfg.threads > cfg.vectors_per_row:
                in_row = k.pred(f"slot{s}_in_row")
                k.setp("lt", in_row, t.vector, cfg.vectors_per_row - s * cfg.threads)
            t.in_row.append(in_row)
    return t


def _pointers(k, cfg, p, t) -> SimpleNamespace:
    """The token's indices and weights, and y's and out's columns of this thread's first
    vector (64-bit: tensors may exceed 4 GiB)."""
    ptrs = SimpleNamespace()
    with k.stage("pointers: the token's pairs, this thread's columns of y and out"):
        ptrs.rows, ptrs.weights = k.reg("u64", "rows_ptr"), k.reg("u64", "weights_ptr")
        k.ld_param(ptrs.rows, p.rows)
        k.mad(ptrs.rows, t.token, cfg.topk * 4, ptrs.rows, mode="wide")
        k.ld_param(ptrs.weights, p.weights)
        k.mad(ptrs.weights, t.token, cfg.topk * cfg.weight_bytes, ptrs.weights, mode="wide")
        ptrs.y, ptrs.y_stride = k.reg("u64", "y_col"), k.reg("u32", "y_stride_bytes")
        k.ld_param(ptrs.y, p.y)
        k.mad(ptrs.y, t.vector, VECTOR_BYTES, ptrs.y, mode="wide")
        k.ld_param(ptrs.y_stride, p.y_row_stride)
        k.shl(ptrs.y_stride, ptrs.y_stride, 1)
        ptrs.y_rows = k.reg("u32", "y_rows")
        k.ld_param(ptrs.y_rows, p.y_rows)
        ptrs.out = k.reg("u64", "out_col")
        k.ld_param(ptrs.out, p.out)
        k.mad(ptrs.out, t.token, cfg.hidden * 2, ptrs.out, mode="wide")
        k.mad(ptrs.out, t.vector, VECTOR_BYTES, ptrs.out, mode="wide")
    return ptrs


def _load_pairs(k, cfg, ptrs) -> list[SimpleNamespace]:
    """Per pair j: its row (u32), whether it exists (0 <= row < R: one unsigned compare,
    as -1 is 2^32 - 1) and its weight as f32 bits."""
    pairs = []
    for j in range(cfg.topk):
        pair = SimpleNamespace(j=j, row=k.reg("u32", f"row{j}_"), ok=k.pred(f"pair{j}_ok"),
                               weight=k.reg("b32", f"w{j}_"))
        k.ld(pair.row, addr(ptrs.rows, 4 * j), nc=True)
        k.setp("lt", pair.ok, pair.row, ptrs.y_rows)
        if cfg.weight_dtype == "bf16":
            # A bf16 is the upper half of the f32 with the same value.
            k.ld(pair.weight, addr(ptrs.weights, 2 * j), nc=True, type="u16")
            k.shl(pair.weight, pair.weight, 16)
        else:
            k.ld(pair.weight, addr(ptrs.weights, 4 * j), nc=True)
        pairs.append(pair)
    return pairs


def _load_rows(k, cfg, t, ptrs, pairs) -> list[list]:
    """Every slot's vector of every pair's row, all issued before any is used. Each row is
    read once: ``L1::no_allocate`` keeps it from evicting the indices."""
    data, src = [], k.reg("u64", "y_row")
    either = k.pred("load") if cfg.ragged else None  # pair exists and slot within the row
    for pair in pairs:
        k.mad(src, pair.row, ptrs.y_stride, ptrs.y, mode="wide")
        vectors = []
        for s, in_row in enumerate(t.in_row):
            v = k.regs("b32", 4, f"y{pair.j}_{s}_")
            guard = pair.ok
            if in_row is not None:
                k.and_pred(either, pair.ok, in_row)
                guard = either
            with k.guard(guard):
                k.ld(v, addr(src, s * cfg.threads * VECTOR_BYTES), nc=True,
                     eviction="L1::no_allocate")
            vectors.append(v)
        data.append(vectors)
    return data


def _accumulate(k, cfg, data, pairs) -> list[list]:
    """Each slot's 8 f32 sums, from +0 as the eager loop starts from zeros: acc += f32(y)
    * w pair by pair, the product rounded, then the sum (no fma, so the bits are the
    loop's); a dropped pair's loads did not run and its adds do not."""
    acc = [k.regs("f32", VECTOR, f"acc{s}_") for s in range(cfg.vectors_per_thread)]
    for slot in acc:
        for a in slot:
            k.mov(a, 0.0)
    prod = k.regs("f32", 2, "prod")
    for pair, vectors in zip(pairs, data):
        for slot, v in zip(acc, vectors):
            for i, word in enumerate(v):
                fp8.unpack_bf16x2(k, prod[0], prod[1], word)
                for half in (0, 1):
                    k.mul(prod[half], prod[half], pair.weight, rnd="rn", type="f32")
                with k.guard(pair.ok):
                    for half in (0, 1):
                        k.add(slot[2 * i + half], slot[2 * i + half], prod[half], rnd="rn")
    return acc


def _store(k, cfg, t, ptrs, acc) -> None:
    with k.stage("store: round to bf16, one 16-byte store per slot"):
        packed = k.regs("b32", 4, "out")
        for s, (slot, in_row) in enumerate(zip(acc, t.in_row)):
            for i, word in enumerate(packed):
                k.cvt(word, slot[2 * i + 1], slot[2 * i], dtype="bf16x2", rnd="rn")
            at = addr(ptrs.out, s * cfg.threads * VECTOR_BYTES)
            if in_row is None:
                k.st(at, packed, type="b32")
            else:
                with k.guard(in_row):
                    k.st(at, packed, type="b32")
