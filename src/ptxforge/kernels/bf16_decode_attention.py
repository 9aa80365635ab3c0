"""Decode attention over a bf16 KV cache: one query token a sequence, grouped-query heads,
the cache split across CTAs and the splits merged on the GPU.

For sequence b and query head h (KV head h // g of ``g`` query heads a KV head), over the
cache's first ``seqlens[b]`` tokens:

    out[b, h] = sum over t of softmax_t(scale * q[b, h] . k[b, h // g, t]) * v[b, h // g, t]

in f32 (the scores in base 2: q is multiplied by scale * log2(e) once, and ex2 takes the
exponentials), rounded to bf16 once. A sequence of no tokens gives zeros.

Work mapping. CTA (x = split, y = KV head, z = sequence) reads the tokens [split *
split_tokens, min(seqlens[b], (split + 1) * split_tokens)) of one KV head once, for all
``g`` query heads of its group. A token's row of D bf16 is D / 8 16-byte vectors, one a
lane: ``lanes`` = D / 8 neighbouring threads hold a token (each 8 dimensions of it, and
of the g queries, in f32 registers), so a CTA of ``threads`` works on ``slots`` =
threads / lanes tokens at once, and each thread on ``tokens_per_thread`` of them a step:

    step (tokens_per_step = slots x tokens_per_thread):
      ld.global.nc.v4  the step's k and v vectors, all issued before the first multiply;
                       the next step's rows prefetched into L2
      score            8 fma a head, summed over the token's lanes by a reduce-scatter
                       butterfly (shfl.bfly): each step halves the heads a lane carries,
                       so each lane ends with one head's full score (lanes / g a head)
      online softmax   by each lane for its head: the step's max, one rescale, p =
                       ex2(score - max); every lane then takes each head's rescale and
                       p's from that head's lanes (shfl.idx) for acc = acc * r + p * v

A lane keeps its own head's running (max, sum) in the loop and takes every head's after
it, so each of the CTA's ``slots`` token slots ends with its own (max, sum, acc) per
head; the slots of a warp merge through shuffles, the warps through shared memory. With
one split the CTA writes out; with several each writes its unnormalised acc and its (max, sum) to a
workspace, and the last of a (sequence, KV head)'s splits to finish (a counter a pair,
counted with atom.add.acq_rel) merges them all, writes out, and sets the counter back to
0 for the next call: one kernel, no host round trip, capturable in a CUDA graph.

The lengths are read on the GPU: the split size comes from the cache's capacity (the op's
choice), and a CTA past its sequence's length reads nothing. Loads past the length are
not issued: their registers hold zeros, their scores -inf.

Compile-time: D, g, tokens_per_thread, and whether the caches are paged (a block table
names each token's page). Run-time: the tensors' pointers and strides (q [B, Hq, D] and
the caches [B, Hkv, S, D] in any order of their first three dimensions, D contiguous:
transformers' static-cache layout and FlashAttention's both), the split size, the scale,
B, Hkv and the split count (the grid). The tensor-core form, and with it e4m3 caches:
bf16_decode_attention_mma.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..arch import Arch
from ..patterns import fp8
from ..ptx import KernelBuilder, LaunchShape, addr, sreg

VECTOR = 8                  # bf16 per 16-byte vector
VECTOR_BYTES = 16
HEAD_DIMS = (64, 128, 256)
MMA_HEAD_DIM = 128         # the tensor-core form's widest head: 256 spills (ptxas 13.0)
MMA_MIN_PAGE = 16          # the tensor-core form's smallest page: a warp's tile in one page
MMA_ROWS = 16              # the tensor-core tile's rows: query tokens x heads a KV head
MAX_Q_LEN = 8              # query tokens a sequence (more rows than a tile: several tiles)
MAX_CLUSTER = 8            # CTAs a cluster (the portable limit): a pair's splits merged there
MAX_GROUP = 8               # query heads a KV head: each one's query and accumulators
                            # take 16 registers of every thread
THREADS = 128
NO_SCORE = float("-inf")    # a token past the length
MAX_START = -1e30           # a running max before any token: finite, so that ex2 of the
                            # difference of two such stays 1, never NaN
# Registers ptxas may use (through .minnctapersm): up to 4 query heads a KV head (a
# thread holds 8 dimensions of each one's query and accumulator) 168, three CTAs an SM;
# more, 255, two (the tensor-core form: bf16_decode_attention_mma.ctas_per_sm). Every
# variant assembles with no spills (tests/cpu/test_kernels.py).
REGISTERS = {False: 168, True: 255}


@dataclass(frozen=True)
class DecodeAttentionConfig:
    head_dim: int
    group: int                 # query heads a KV head
    target: str
    paged: bool = False        # the caches in pages that a block table names (vLLM's layout)
    tensor_cores: bool = False  # mma.sync (bf16_decode_attention_mma.py)
    cache_dtype: str = "bf16"   # or e4m3, with per-token-and-head f32 scales (tensor cores)
    stages: int = 3            # the tensor-core form's tiles in flight a warp
    q_len: int = 1             # query tokens a sequence (the tensor-core form, up to 8)
    causal: bool = True        # with q_len > 1: token j of q_len sees the cache's first L -
                               # (q_len - 1 - j) tokens (FlashAttention's, bottom-right)
    cluster: int = 1           # the tensor-core form: a pair's splits as one cluster of this
                               # many CTAs, merged through distributed shared memory
    append: bool = False       # the tensor-core form over a bf16 cache: k_new and v_new's
                               # tokens appended at each sequence's length (and attended to)

    @property
    def name(self) -> str:
        return (f"bf16_decode_attention_d{self.head_dim}_g{self.group}"
                + (f"_mma_s{self.stages}" if self.tensor_cores
                   else f"_t{self.tokens_per_thread}")
                + ("_paged" if self.paged else "")
                + ("_e4m3" if self.cache_dtype == "e4m3" else "")
                + (f"_q{self.q_len}" + ("" if self.causal else "_full") if self.q_len > 1
                   else "")
                + (f"_c{self.cluster}" if self.cluster > 1 else "")
                + ("_append" if self.append else ""))

    @property
    def rows(self) -> int:
        """The tensor-core form's rows: query token j's head h in row j x group + h."""
        return self.q_len * self.group

    @property
    def row_tiles(self) -> int:
        """Tiles of MMA_ROWS rows, each its own CTAs (each reading the cache)."""
        return -(-self.rows // MMA_ROWS)

    @property
    def tile_rows(self) -> int:
        """The rows a tile holds."""
        return min(self.rows, MMA_ROWS)

    @property
    def tokens_per_thread(self) -> int:
        """A thread's tokens a step (the CUDA-core form): four, eight k and v loads in
        flight; two above four query heads a KV head, where the queries and accumulators
        take the registers."""
        return 2 if self.wide else 4

    @property
    def element_bytes(self) -> int:
        """Bytes of one cached value."""
        return 1 if self.cache_dtype == "e4m3" else 2

    @property
    def lanes(self) -> int:
        """Threads a token: one 16-byte vector of its row each."""
        return self.head_dim // VECTOR

    @property
    def slots(self) -> int:
        """Tokens a CTA works on at once."""
        return THREADS // self.lanes

    @property
    def tokens_per_step(self) -> int:
        if self.tensor_cores:
            return 64                  # four warps' tiles of 16
        return self.slots * self.tokens_per_thread

    @property
    def warps(self) -> int:
        return THREADS // 32

    @property
    def lane_record(self) -> int:
        """Shared-memory bytes of one lane's merged heads: every head's 8 accumulators
        (16-byte aligned), then every head's (max, sum); padded to 16 bytes."""
        return -(-self.group * (VECTOR + 2) * 4 // 16) * 16

    @property
    def shared_bytes(self) -> int:
        """Each warp's merged (max, sum, acc) per head, from its first ``lanes`` lanes."""
        return self.warps * self.lanes * self.lane_record

    @property
    def wide(self) -> bool:
        """More than four query heads a KV head: two tokens a thread a step, and more
        registers."""
        return self.group > 4

    @property
    def ctas_per_sm(self) -> int:
        """The CUDA-core form's resident CTAs an SM, by its registers."""
        return 65536 // (THREADS * REGISTERS[self.wide])


def check_problem(head_dim: int, group: int) -> None:
    """The sizes the kernel takes, checked apart from a device."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"query heads a KV head must be from 1 to {MAX_GROUP}, got {group}")


def choose_config(arch: Arch, head_dim: int, group: int, paged: bool = False,
                  tensor_cores: bool | None = None, cache_dtype: str = "bf16",
                  stages: int = 3, q_len: int = 1, causal: bool = True,
                  cluster: int = 1, append: bool = False) -> DecodeAttentionConfig:
    """The kernel for ``group`` query heads a KV head of ``head_dim``: the tensor-core form
    (``tensor_cores``; by default where it takes the head, D <= MMA_HEAD_DIM; ``stages``:
    the tiles each warp has in flight) or the CUDA-core one; ``paged``: a block table's
    pages (the tensor-core form: of MMA_MIN_PAGE tokens or more); ``cache_dtype`` e4m3:
    its scales too (the tensor-core form); ``q_len`` query tokens a sequence, ``causal``
    among themselves (the tensor-core form, up to MAX_Q_LEN; past MMA_ROWS rows, q_len x
    group, in several tiles, each reading the cache); ``cluster``: the
    splits of a (sequence, KV head) pair, as one cluster (the tensor-core form, 2 to
    MAX_CLUSTER), merged through distributed shared memory instead of global memory;
    ``append``: new keys and values written into the cache at each sequence's length in the
    same kernel (the tensor-core form, a bf16 cache)."""
    check_problem(head_dim, group)
    if tensor_cores is None:
        tensor_cores = head_dim <= MMA_HEAD_DIM
    arch.require("griddepcontrol", "the decode attention kernel (programmatic dependent launch)")
    if tensor_cores and head_dim > MMA_HEAD_DIM:
        raise ValueError(f"the tensor-core decode attention takes head_dim up to "
                         f"{MMA_HEAD_DIM}, got {head_dim}")
    if cache_dtype not in ("bf16", "e4m3"):
        raise ValueError(f"cache_dtype must be bf16 or e4m3, got {cache_dtype!r}")
    if cache_dtype == "e4m3" and not tensor_cores:
        raise ValueError("an e4m3 cache takes the tensor-core form")
    if not 1 <= stages <= 8:
        raise ValueError(f"stages must be from 1 to 8, got {stages}")
    if not 1 <= q_len <= MAX_Q_LEN or (q_len > 1 and not tensor_cores):
        raise ValueError(f"q_len query tokens a sequence take the tensor-core form, q_len up "
                         f"to {MAX_Q_LEN}: got q_len {q_len}"
                         + ("" if tensor_cores else " on CUDA cores"))
    if cluster != 1 and (not tensor_cores or not 2 <= cluster <= MAX_CLUSTER):
        raise ValueError(f"cluster must be 1, or 2 to {MAX_CLUSTER} with the tensor-core form, "
                         f"got {cluster}")
    if append and (not tensor_cores or cache_dtype != "bf16"):
        raise ValueError("appending new keys and values takes the tensor-core form and a bf16 "
                         "cache")
    return DecodeAttentionConfig(head_dim, group, arch.target, paged, tensor_cores, cache_dtype,
                                 stages, q_len, causal, cluster, append)


def generate(cfg: DecodeAttentionConfig) -> KernelBuilder:
    """The CUDA-core form (a ``tensor_cores`` config: bf16_decode_attention_mma.generate;
    ``kernels.generate_attention`` picks)."""
    if cfg.tensor_cores:
        raise ValueError(f"{cfg.name} is the tensor-core form: bf16_decode_attention_mma")
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS,
                      min_blocks_per_sm=cfg.ctas_per_sm)
    k.launch = LaunchShape(block=THREADS)
    p = _Params(k, cfg)
    with k.stage("programmatic launch: the next kernel on the stream may start"):
        k.griddepcontrol_launch_dependents()
    t = _coordinates(k, cfg.lanes)
    with k.stage("wait for the kernel before this one"):
        # q, the caches and the lengths may be its output (the cache write just before).
        k.griddepcontrol_wait()
    ptrs = _pointers(k, cfg, p, t)
    q = _queries(k, cfg, p, ptrs)
    state = _start_state(k, cfg)
    _token_loop(k, cfg, t, ptrs, q, state)
    merger = _Merger(k, cfg, t)
    merger.slots(state)
    merger.warps(state)
    _finish(k, cfg, p, t, state, merger)
    return k


class _Params:
    """Kernel parameters (launches bind them by name). Strides in bytes."""

    def __init__(self, k: KernelBuilder, cfg: DecodeAttentionConfig):
        self.q = k.param("q", "u64")
        self.q_batch_stride = k.param("q_batch_stride", "u64")
        self.q_head_stride = k.param("q_head_stride", "u64")
        if cfg.q_len > 1:
            self.q_token_stride = k.param("q_token_stride", "u64")
        for name in ("k", "v"):
            setattr(self, name, k.param(name, "u64"))
            for stride in ("batch", "head", "token"):
                setattr(self, f"{name}_{stride}_stride", k.param(f"{name}_{stride}_stride", "u64"))
        # Paged: k_batch_stride and v_batch_stride are a page's stride (under 4 GiB), and
        # token t of sequence b lies in page block_table[b, t >> page_shift], row t & (2 **
        # page_shift - 1); a page index at or past num_blocks reads the last page.
        if cfg.paged:
            self.block_table = k.param("block_table", "u64")          # int32 [B, pages]
            self.block_table_stride = k.param("block_table_stride", "u32")  # elements
            self.page_shift = k.param("page_shift", "u32")
            self.num_blocks = k.param("num_blocks", "u32")
        # e4m3: each (token, KV head)'s f32 scales of k and v, strides in bytes (paged:
        # scale_batch_stride is a page's, under 4 GiB, the scales paged as the caches).
        if cfg.cache_dtype == "e4m3":
            self.k_scale, self.v_scale = k.param("k_scale", "u64"), k.param("v_scale", "u64")
            self.scale_batch_stride = k.param("scale_batch_stride", "u64")
            self.scale_head_stride = k.param("scale_head_stride", "u64")
            self.scale_token_stride = k.param("scale_token_stride", "u32")
        # append: k_new and v_new [B, new_tokens, Hkv, D] (the same strides, in bytes), written
        # at each sequence's length; seqlens count the cache's tokens before them.
        if cfg.append:
            self.k_new, self.v_new = k.param("k_new", "u64"), k.param("v_new", "u64")
            for stride in ("batch", "token", "head"):
                setattr(self, f"new_{stride}_stride", k.param(f"new_{stride}_stride", "u64"))
            self.new_tokens = k.param("new_tokens", "u32")
        self.seqlens = k.param("seqlens", "u64")           # int32 [B]
        self.capacity = k.param("capacity", "u32")         # S_max: no token at or past it is read
        self.split_tokens = k.param("split_tokens", "u32")  # a multiple of tokens_per_step
        self.scale_log2 = k.param("scale_log2", "f32")      # softmax scale * log2(e)
        self.out = k.param("out", "u64")                    # bf16 [B, Hq, D], contiguous
        self.partial = k.param("partial", "u64")            # f32 [B, Hkv, splits, g, D]
        self.partial_ml = k.param("partial_ml", "u64")      # f32 [B, Hkv, splits, g, 2]
        self.counters = k.param("counters", "u64")          # u32 [B, Hkv], zeros between calls


def _coordinates(k, lanes: int) -> SimpleNamespace:
    """The CTA's split, KV head and sequence; the thread's lane and warp; its token slot
    and vector with ``lanes`` threads a token (each a 16-byte vector of its row)."""
    t = SimpleNamespace()
    with k.stage("coordinates: split, KV head, sequence; this thread's token slot and vector"):
        t.split, t.kv_head, t.seq = (k.reg("u32", n) for n in ("split", "kv_head", "seq"))
        t.splits, t.kv_heads = k.reg("u32", "splits"), k.reg("u32", "kv_heads")
        k.mov(t.split, sreg.ctaid.x)
        k.mov(t.kv_head, sreg.ctaid.y)
        k.mov(t.seq, sreg.ctaid.z)
        k.mov(t.splits, sreg.nctaid.x)
        k.mov(t.kv_heads, sreg.nctaid.y)
        t.tid, t.lane, t.warp = k.reg("u32", "tid"), k.reg("u32", "lane"), k.reg("u32", "warp")
        k.mov(t.tid, sreg.tid.x)
        k.and_(t.lane, t.tid, 31)
        k.shr(t.warp, t.tid, 5)
        t.slot, t.vector = k.reg("u32", "slot"), k.reg("u32", "vector")
        k.shr(t.slot, t.tid, lanes.bit_length() - 1)
        k.and_(t.vector, t.tid, lanes - 1)
        # The (sequence, KV head) pair: its counter, and its splits' workspace rows.
        t.pair = k.reg("u32", "pair")
        k.mad(t.pair, t.seq, t.kv_heads, t.kv_head, mode="lo")
    return t


def _pointers(k, cfg, p, t, cache_vectors: bool = True) -> SimpleNamespace:
    """This thread's vector of the pair's first cache row (``cache_vectors`` False: the
    row's start) and of its group's queries, and the split's token range [start, end)."""
    ptrs = SimpleNamespace()
    with k.stage("the split's tokens, and pointers to this thread's vectors"):
        wide = k.reg("u64", "wide")
        stride = k.reg("u64", "stride")

        def at(name, base, *terms, vector_bytes=VECTOR_BYTES):
            r = k.reg("u64", name)
            k.ld_param(r, base)
            for index, param in terms:
                k.cvt(wide, index, dtype="u64")
                k.ld_param(stride, param)
                k.mad(r, wide, stride, r, mode="lo", type="u64")
            if vector_bytes:
                k.mad(r, t.vector, vector_bytes, r, mode="wide")
            return r

        def narrow(name, param):
            """A u64 stride parameter under 4 GiB as a u32 register."""
            r = k.reg("u32", name)
            k.ld_param(stride, param)
            k.cvt(r, stride, dtype="u32")
            return r

        row_vector = VECTOR * cfg.element_bytes if cache_vectors else 0

        # Contiguous: the sequence's rows; paged: the KV head's in page 0, each token's
        # page added in the token loop.
        sequence = () if cfg.paged else ((t.seq, p.k_batch_stride),)
        ptrs.k = at("k_ptr", p.k, *sequence, (t.kv_head, p.k_head_stride),
                    vector_bytes=row_vector)
        sequence = () if cfg.paged else ((t.seq, p.v_batch_stride),)
        ptrs.v = at("v_ptr", p.v, *sequence, (t.kv_head, p.v_head_stride),
                    vector_bytes=row_vector)
        if cfg.cache_dtype == "e4m3":
            sequence = () if cfg.paged else ((t.seq, p.scale_batch_stride),)
            terms = (*sequence, (t.kv_head, p.scale_head_stride))
            ptrs.k_scale = at("k_scale_ptr", p.k_scale, *terms, vector_bytes=0)
            ptrs.v_scale = at("v_scale_ptr", p.v_scale, *terms, vector_bytes=0)
            ptrs.scale_token = k.reg("u32", "scale_token_bytes")
            k.ld_param(ptrs.scale_token, p.scale_token_stride)
            if cfg.paged:
                ptrs.scale_page = narrow("scale_page_bytes", p.scale_batch_stride)
        if cfg.paged:
            _page_pointers(k, p, t, ptrs, narrow)
        first_head = k.reg("u32", "first_head")
        k.mul(first_head, t.kv_head, cfg.group, mode="lo")
        ptrs.q = at("q_ptr", p.q, (t.seq, p.q_batch_stride), (first_head, p.q_head_stride))
        ptrs.q_head_stride = k.reg("u64", "q_head_stride")
        k.ld_param(ptrs.q_head_stride, p.q_head_stride)
        ptrs.k_token = narrow("k_token_bytes", p.k_token_stride)
        ptrs.v_token = narrow("v_token_bytes", p.v_token_stride)
        # The split's tokens.
        ptrs.start, ptrs.end = k.reg("u32", "start"), k.reg("u32", "end")
        split_tokens, length = k.reg("u32", "split_tokens"), k.reg("u32", "length")
        k.ld_param(split_tokens, p.split_tokens)
        k.mul(ptrs.start, t.split, split_tokens, mode="lo")
        k.add(ptrs.end, ptrs.start, split_tokens)
        at_len = k.reg("u64", "seqlen_at")
        k.ld_param(at_len, p.seqlens)
        k.mad(at_len, t.seq, 4, at_len, mode="wide")
        # the sequence's length, at most S_max (unsigned here: a length of -1 is past it)
        ptrs.length, ptrs.capacity = length, k.reg("u32", "capacity")
        capacity = ptrs.capacity
        k.ld(length, addr(at_len), nc=True)
        k.ld_param(capacity, p.capacity)
        if cfg.append:    # the cache's tokens before the new ones, then the new ones
            ptrs.old, new = k.reg("u32", "old_length"), k.reg("u32", "new_tokens")
            k.min(ptrs.old, length, capacity)
            k.ld_param(new, p.new_tokens)
            k.add(length, ptrs.old, new)
        k.min(length, length, capacity)
        k.min(ptrs.end, ptrs.end, length)
    return ptrs


def _page_pointers(k, p, t, ptrs, narrow) -> None:
    """Paged: the sequence's row of the block table, the pages' strides (``narrow``: a
    stride parameter as a u32 register), the shift and mask that split a token into page
    and row, the last page."""
    ptrs.pages = k.reg("u64", "block_row")
    k.ld_param(ptrs.pages, p.block_table)
    row_stride = k.reg("u32", "block_table_stride")
    k.ld_param(row_stride, p.block_table_stride)
    k.mul(row_stride, row_stride, 4, mode="lo")
    k.mad(ptrs.pages, t.seq, row_stride, ptrs.pages, mode="wide")
    ptrs.k_page = narrow("k_page_bytes", p.k_batch_stride)
    ptrs.v_page = narrow("v_page_bytes", p.v_batch_stride)
    ptrs.shift, ptrs.row_mask = k.reg("u32", "page_shift"), k.reg("u32", "row_mask")
    k.ld_param(ptrs.shift, p.page_shift)
    k.shl(ptrs.row_mask, 1, ptrs.shift, type="b32")
    k.sub(ptrs.row_mask, ptrs.row_mask, 1)
    ptrs.last_page = k.reg("u32", "last_page")
    k.ld_param(ptrs.last_page, p.num_blocks)
    k.sub(ptrs.last_page, ptrs.last_page, 1)


def _queries(k, cfg, p, ptrs) -> list[list]:
    """This thread's 8 dimensions of each of the group's queries, as f32 times scale *
    log2(e): a score is then the exponent of 2."""
    with k.stage("the group's queries: this thread's 8 dimensions each, scaled"):
        scale = k.reg("f32", "scale_log2")
        k.ld_param(scale, p.scale_log2)
        q, packed, at = [], k.regs("b32", 4, "q_packed"), k.reg("u64", "q_at")
        k.mov(at, ptrs.q)
        for head in range(cfg.group):
            k.ld(packed, addr(at), nc=True)
            values = k.regs("f32", VECTOR, f"q{head}_")
            for i, word in enumerate(packed):
                fp8.unpack_bf16x2(k, values[2 * i], values[2 * i + 1], word)
            for value in values:
                k.mul(value, value, scale)
            q.append(values)
            if head + 1 < cfg.group:
                k.add(at, at, ptrs.q_head_stride)
    return q


def _start_state(k, cfg) -> SimpleNamespace:
    """Per head: the running max (MAX_START), sum (0) and this thread's 8 accumulators (0)."""
    state = SimpleNamespace(max=k.regs("f32", cfg.group, "m"), sum=k.regs("f32", cfg.group, "l"),
                            acc=[k.regs("f32", VECTOR, f"acc{h}_") for h in range(cfg.group)])
    with k.stage("running max, sum and accumulators"):
        _fresh(k, cfg, state)
    return state


def _fresh(k, cfg, state) -> None:
    """Every head's state before any token: MAX_START, 0 and zeros."""
    for head in range(cfg.group):
        k.mov(state.max[head], MAX_START)
        k.mov(state.sum[head], 0.0)
        for a in state.acc[head]:
            k.mov(a, 0.0)


def _token_loop(k, cfg, t, ptrs, q, state) -> None:
    """The split's tokens, tokens_per_step at a time: thread slot s takes tokens base + j *
    slots + s (j < tokens_per_thread)."""
    n = cfg.tokens_per_thread
    token, valid = k.regs("u32", n, "token"), [k.pred(f"valid{j}_") for j in range(n)]
    keys = [k.regs("b32", 4, f"k{j}_") for j in range(n)]
    values = [k.regs("b32", 4, f"v{j}_") for j in range(n)]
    at = k.reg("u64", "row_at")
    scores = [k.regs("f32", cfg.group, f"s{j}_") for j in range(n)]
    unpacked = k.regs("f32", VECTOR, "x")
    step_max, fresh = k.reg("f32", "step_max"), k.reg("f32", "fresh")
    scale = k.reg("f32", "rescale")
    prob = k.reg("f32", "p")
    heads = _lane_heads(k, cfg, t)
    pad, sends = k.reg("f32", "zero_score"), k.regs("f32", 3, "scatter")
    k.mov(pad, 0.0)
    # This lane's head's running max and sum (every head's accumulators are every lane's).
    own = SimpleNamespace(max=k.reg("f32", "own_max"), sum=k.reg("f32", "own_sum"))
    k.mov(own.max, MAX_START)
    k.mov(own.sum, 0.0)
    first = k.reg("u32", "first_token")
    later = k.reg("u32", "later")       # one step ahead: two to four measured slower
    next_valid = [k.pred(f"next_valid{j}_") for j in range(n)]
    page, next_page = (k.reg("u32", "page"), k.reg("u32", "next_page")) if cfg.paged else (None,
                                                                                         None)
    k.add(first, ptrs.start, t.slot)
    with k.loop(k.reg("u32", "base"), ptrs.end, start=ptrs.start, step=cfg.tokens_per_step,
                hint="tokens", uniform=True):
        with k.stage("load: every k and v vector of the step, before the first multiply"):
            for j in range(n):
                k.add(token[j], first, j * cfg.slots)
                k.setp("lt", valid[j], token[j], ptrs.end)
                k.add(later, token[j], cfg.tokens_per_step)
                k.setp("lt", next_valid[j], later, ptrs.end)
                if cfg.paged:
                    _token_page(k, ptrs, token[j], valid[j], page)
                    _token_page(k, ptrs, later, next_valid[j], next_page)
                for vec, which in ((keys[j], "k"), (values[j], "v")):
                    for word in vec:
                        k.mov(word, 0)
                    _row_at(k, cfg, ptrs, at, token[j], page, which)
                    with k.guard(valid[j]):
                        k.ld(vec, addr(at), nc=True, eviction="L1::no_allocate")
                    # The next step's row into L2 meanwhile: its loads then wait on L2, not
                    # on DRAM, with no registers held for it.
                    _row_at(k, cfg, ptrs, at, later, next_page, which)
                    with k.guard(next_valid[j]):
                        k.prefetch(addr(at))
            k.add(first, first, cfg.tokens_per_step)
        with k.stage("scores: q . k over this thread's 8 dimensions; summed over the token's "
                     "lanes, each lane keeping one head's sum (reduce-scatter); -inf past "
                     "the length"):
            for j in range(n):
                _unpack(k, unpacked, keys[j])
                for head in range(cfg.group):
                    s = scores[j][head]
                    k.mul(s, q[head][0], unpacked[0])
                    for d in range(1, VECTOR):
                        k.fma(s, q[head][d], unpacked[d], s)
                _reduce_scatter(k, cfg, heads, scores[j], pad, sends)
                k.selp(scores[j][0], scores[j][0], NO_SCORE, valid[j])
        with k.stage("online softmax of this lane's head: the step's max, one rescale a "
                     "step, p = ex2(score - max)"):
            mine = [scores[j][0] for j in range(n)]
            k.max(step_max, own.max, mine[0])
            for score in mine[1:]:
                k.max(step_max, step_max, score)
            k.sub(fresh, own.max, step_max)
            k.ex2(scale, fresh, ftz=True)
            k.mov(own.max, step_max)
            k.mul(own.sum, own.sum, scale)
            for score in mine:
                k.sub(score, score, step_max)
                k.ex2(score, score, ftz=True)          # p, in place of the score
                k.add(own.sum, own.sum, score)
        with k.stage("acc = acc * rescale + p * v for every head, the rescales and p's from "
                     "their heads' lanes (shfl.idx)"):
            for head in range(cfg.group):
                rescale = heads.of(scale, prob, head)
                for a in state.acc[head]:
                    k.mul(a, a, rescale)
            for j in range(n):
                _unpack(k, unpacked, values[j])
                for head in range(cfg.group):
                    p_head = heads.of(scores[j][0], prob, head)
                    for a, x in zip(state.acc[head], unpacked):
                        k.fma(a, p_head, x, a)
    with k.stage("every head's running max and sum, from its lanes"):
        for head in range(cfg.group):
            for into, value in ((state.max[head], own.max), (state.sum[head], own.sum)):
                held = heads.of(value, into, head)
                if held is not into:
                    k.mov(into, held)


def _token_page(k, ptrs, token, valid, page) -> None:
    """Paged: ``token``'s page from the block table (read where ``valid``, or always where
    it is None), clamped to the last page: an index past the pool reads a page of it,
    never outside."""
    at = k.reg("u64", "page_at")
    k.shr(page, token, ptrs.shift)
    k.mad(at, page, 4, ptrs.pages, mode="wide")
    if valid is None:
        k.ld(page, addr(at), nc=True)
    else:
        k.mov(page, 0)
        with k.guard(valid):
            k.ld(page, addr(at), nc=True)
    k.min(page, page, ptrs.last_page)


def _row_at(k, cfg, ptrs, at, token, page, which: str) -> None:
    """``at`` = this thread's vector of ``token``'s row of the k or v cache."""
    base, stride = (ptrs.k, ptrs.k_token) if which == "k" else (ptrs.v, ptrs.v_token)
    if not cfg.paged:
        k.mad(at, token, stride, base, mode="wide")
        return
    row = k.reg("u32", "page_row")
    k.and_(row, token, ptrs.row_mask)
    k.mad(at, row, stride, base, mode="wide")
    k.mad(at, page, ptrs.k_page if which == "k" else ptrs.v_page, at, mode="wide")


def _lane_heads(k, cfg, t) -> SimpleNamespace:
    """Which head's score each lane keeps after the reduce-scatter: the token's ``lanes``
    lanes hold the group's heads (padded to a power of two, ``padded``) in blocks of
    lanes / padded, head h in the lanes from h * lanes / padded; ``source[h]`` is the
    first such lane of this thread's token (a shfl.idx source), ``upper[o]`` whether this
    lane keeps the upper half at the butterfly step of offset o."""
    heads = SimpleNamespace(padded=1 << (cfg.group - 1).bit_length())
    block = cfg.lanes // heads.padded

    def of(value, into, head):
        """``value`` as head ``head``'s lanes hold it: shuffled from them into ``into``;
        with one head every lane of the token holds it already."""
        if heads.padded == 1:
            return value
        k.shfl_sync(into, value, heads.source[head], mode="idx")
        return into

    heads.of = of
    with k.stage("the lane's head after the reduce-scatter, and each head's source lane"):
        base = k.reg("u32", "token_lane0")
        k.and_(base, t.lane, ~(cfg.lanes - 1) & 0xFFFFFFFF)
        heads.source = k.regs("u32", cfg.group, "head_lane")
        for head in range(cfg.group):
            k.add(heads.source[head], base, head * block)
        heads.upper, offset, bit = {}, cfg.lanes // 2, k.reg("u32", "lane_bit")
        count = heads.padded
        while count > 1:
            upper = k.pred(f"upper{offset}_")
            k.and_(bit, t.lane, offset)
            k.setp("ne", upper, bit, 0)
            heads.upper[offset] = upper
            count //= 2
            offset //= 2
    return heads


def _reduce_scatter(k, cfg, heads, partial: list, pad, sends) -> None:
    """The token's lanes' partial scores of every head summed by a butterfly that halves
    the heads a lane carries at each step while there are several (each lane sends the
    half it gives up and adds the half it keeps): the lane's own head's full score lands
    in ``partial[0]``."""
    held = list(partial) + [pad] * (heads.padded - cfg.group)   # padding: zeros
    offset = cfg.lanes // 2
    send, keep, got = sends
    while offset:
        if len(held) > 1:
            half, upper = len(held) // 2, heads.upper[offset]
            for i in range(half):
                k.selp(send, held[i], held[half + i], upper)
                k.selp(keep, held[half + i], held[i], upper)
                k.shfl_sync(got, send, offset, mode="bfly")
                k.add(partial[i], keep, got)
            held = partial[:half]
        else:
            k.shfl_sync(got, held[0], offset, mode="bfly")
            k.add(held[0], held[0], got)
        offset //= 2


def _unpack(k, f32: list, packed: list) -> None:
    for i, word in enumerate(packed):
        fp8.unpack_bf16x2(k, f32[2 * i], f32[2 * i + 1], word)


def _merge(k, state, head: int, other_max, other_sum, other_acc: list, scratch) -> None:
    """Fold another (max, sum, acc) of ``head`` into the state: both rescaled to the
    larger max."""
    top, mine, theirs = scratch
    k.max(top, state.max[head], other_max)
    k.sub(mine, state.max[head], top)
    k.ex2(mine, mine, ftz=True)
    k.sub(theirs, other_max, top)
    k.ex2(theirs, theirs, ftz=True)
    k.mov(state.max[head], top)
    k.mul(state.sum[head], state.sum[head], mine)
    k.fma(state.sum[head], other_sum, theirs, state.sum[head])
    for a, b in zip(state.acc[head], other_acc):
        k.mul(a, a, mine)
        k.fma(a, b, theirs, a)


class _Merger:
    """Merges (max, sum, acc) states a head: of the token slots of a warp, through
    shuffles; of the warps, through shared memory into warp 0's first ``lanes`` lanes."""

    def __init__(self, k, cfg, t):
        self.k, self.cfg, self.t = k, cfg, t
        self.other_max, self.other_sum = k.reg("f32", "o_max"), k.reg("f32", "o_sum")
        self.other_acc = k.regs("f32", VECTOR, "o_acc")
        self.scratch = k.regs("f32", 3, "merge")
        self.mine = k.pred("first_lanes")   # a warp's first lanes: one of each token vector
        k.setp("lt", self.mine, t.lane, cfg.lanes)
        self.warp0 = k.pred("warp0")
        k.setp("eq", self.warp0, t.warp, 0)
        self.smem = k.shared("slots", cfg.shared_bytes) if cfg.warps > 1 else None
        self.at = k.reg("u32", "smem_at")

    def fold(self, state, head: int) -> None:
        _merge(self.k, state, head, self.other_max, self.other_sum, self.other_acc,
               self.scratch)

    def slots(self, state) -> None:
        k, cfg = self.k, self.cfg
        with k.stage("merge the warp's token slots (shfl.bfly)"):
            offset = cfg.lanes
            while offset < 32:
                for head in range(cfg.group):
                    k.shfl_sync(self.other_max, state.max[head], offset, mode="bfly")
                    k.shfl_sync(self.other_sum, state.sum[head], offset, mode="bfly")
                    for a, b in zip(state.acc[head], self.other_acc):
                        k.shfl_sync(b, a, offset, mode="bfly")
                    self.fold(state, head)
                offset *= 2

    def warps(self, state) -> None:
        """Every thread arrives (a CTA barrier); warp 0's first lanes hold the merge."""
        k, cfg, t = self.k, self.cfg, self.t
        if cfg.warps == 1:
            return
        record, ml = cfg.lane_record, cfg.group * VECTOR * 4  # a lane's heads; (max, sum)
        at, other_acc = self.at, self.other_acc
        with k.stage("merge the warps: each warp's first lanes write, warp 0 folds them in"):
            # By the thread's vector (its lane within the token): warp 0's other lanes read
            # what its first lanes do.
            k.mov(at, self.smem)
            k.mad(at, t.warp, cfg.lanes * record, at, mode="lo")
            k.mad(at, t.vector, record, at, mode="lo")
            with k.guard(self.mine):
                for head in range(cfg.group):
                    k.st(addr(at, head * 32), state.acc[head][:4], space="shared")
                    k.st(addr(at, head * 32 + 16), state.acc[head][4:], space="shared")
                    k.st(addr(at, ml + head * 8), [state.max[head], state.sum[head]],
                         space="shared")
            k.bar_sync(0)
            with k.if_(self.warp0, "warps_merged", uniform=True):
                for w in range(1, cfg.warps):
                    for head in range(cfg.group):
                        base = w * cfg.lanes * record
                        k.ld(other_acc[:4], addr(at, base + head * 32), space="shared")
                        k.ld(other_acc[4:], addr(at, base + head * 32 + 16), space="shared")
                        k.ld([self.other_max, self.other_sum], addr(at, base + ml + head * 8),
                             space="shared")
                        self.fold(state, head)


def _finish(k, cfg, p, t, state, merger) -> None:
    """With one split the CTA writes out; with several, its partial, and the last of the
    pair's splits to count itself in merges them all (its token slots each folding every
    slots-th split, then merged as the tokens were) and writes out."""
    last = k.pred("writes_out")    # one split, or the last of the pair's splits
    k.setp("eq", last, t.splits, 1)
    with k.if_(~last, "partial_done", uniform=True):
        with k.if_(merger.warp0, "partial_stored", uniform=True):
            _store_partial(k, cfg, p, t, state, merger.mine)
        counter, thread0 = count_split(k, p, t, last)
        with k.if_(last, "merged", uniform=True):
            k.fence("acq_rel", "gpu")      # every split's partial, seen
            _merge_partials(k, cfg, p, t, state, merger)
            merger.slots(state)
            merger.warps(state)
            with k.guard(thread0):
                k.st(addr(counter), 0, type="u32")   # zero for the next call
    with k.if_(last, "written", uniform=True):
        with k.if_(merger.warp0, "out_stored", uniform=True):
            _store_out(k, cfg, p, t, state, merger.mine)


def count_split(k, p, t, last):
    """After every thread stored its part of the split's partial: thread 0 counts the
    split in on the pair's counter, and ``last`` (every thread's) says whether it was the
    pair's last. Returns the counter's address and the thread-0 predicate (the last split
    sets the counter back to zero)."""
    with k.stage("the pair's counter: the last of its splits merges"):
        k.fence("acq_rel", "gpu")      # this thread's partial before the count
        k.bar_sync(0)
        counter, count = k.reg("u64", "counter_at"), k.reg("u32", "count")
        thread0 = k.pred("thread0")
        flag = k.shared("last_split", 4)
        k.ld_param(counter, p.counters)
        k.mad(counter, t.pair, 4, counter, mode="wide")
        k.setp("eq", thread0, t.tid, 0)
        with k.if_(thread0, "counted"):
            k.atom(count, addr(counter), 1, op="add", sem="acq_rel", scope="gpu", type="u32")
            k.add(count, count, 1)
            k.st(addr(flag), count, space="shared")
        k.bar_sync(0)
        k.ld(count, addr(flag), space="shared")
        k.setp("eq", last, count, t.splits)
    return counter, thread0


def _partial_row(k, cfg, p, t, split, name: str):
    """Addresses of split ``split``'s first head: its acc (this thread's vector) and its
    (max, sum)."""
    row, acc, ml = k.reg("u32", name), k.reg("u64", name + "_acc"), k.reg("u64", name + "_ml")
    k.mad(row, t.pair, t.splits, split, mode="lo")
    k.mul(row, row, cfg.group, mode="lo")
    k.ld_param(acc, p.partial)
    k.mad(acc, row, cfg.head_dim * 4, acc, mode="wide")
    k.mad(acc, t.vector, VECTOR * 4, acc, mode="wide")
    k.ld_param(ml, p.partial_ml)
    k.mad(ml, row, 8, ml, mode="wide")
    return acc, ml


def _store_partial(k, cfg, p, t, state, mine) -> None:
    with k.stage("this split's partial: acc as it is, (max, sum) a head"):
        acc, ml = _partial_row(k, cfg, p, t, t.split, "mine_row")
        with k.guard(mine):
            for head in range(cfg.group):
                base = head * cfg.head_dim * 4
                k.st(addr(acc, base), state.acc[head][:4])
                k.st(addr(acc, base + 16), state.acc[head][4:])
                k.st(addr(ml, head * 8), [state.max[head], state.sum[head]])


def _merge_partials(k, cfg, p, t, state, merger) -> None:
    """Each token slot folds splits slot, slot + slots, ... (in order) into a fresh state."""
    with k.stage("the last split: every split's partial, a slot's share each"):
        _fresh(k, cfg, state)
        with k.loop(k.reg("u32", "merged_split"), t.splits, start=t.slot, step=cfg.slots,
                    hint="splits") as s:
            acc, ml = _partial_row(k, cfg, p, t, s, "split_row")
            for head in range(cfg.group):
                base = head * cfg.head_dim * 4
                # written by other CTAs during this kernel: through L2, not the read-only path
                k.ld(merger.other_acc[:4], addr(acc, base), cache="cg")
                k.ld(merger.other_acc[4:], addr(acc, base + 16), cache="cg")
                k.ld([merger.other_max, merger.other_sum], addr(ml, head * 8), cache="cg")
                merger.fold(state, head)


def _store_out(k, cfg, p, t, state, mine) -> None:
    with k.stage("out: acc / sum (zeros for no tokens), rounded to bf16 once"):
        out, inv, positive = k.reg("u64", "out_at"), k.reg("f32", "inv_sum"), k.pred("any_token")
        scaled, packed = k.regs("f32", 2, "o"), k.regs("b32", 4, "out")
        row = k.reg("u32", "out_row")
        k.mul(row, t.pair, cfg.group, mode="lo")
        k.ld_param(out, p.out)
        k.mad(out, row, cfg.head_dim * 2, out, mode="wide")
        k.mad(out, t.vector, VECTOR_BYTES, out, mode="wide")
        for head in range(cfg.group):
            k.setp("gt", positive, state.sum[head], 0.0)
            k.rcp(inv, state.sum[head])
            k.selp(inv, inv, 0.0, positive)
            for i, word in enumerate(packed):
                k.mul(scaled[0], state.acc[head][2 * i], inv)
                k.mul(scaled[1], state.acc[head][2 * i + 1], inv)
                k.cvt(word, scaled[1], scaled[0], dtype="bf16x2", rnd="rn")
            with k.guard(mine):
                k.st(addr(out, head * cfg.head_dim * 2), packed, type="b32")
