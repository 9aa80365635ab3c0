"""Decode attention on the tensor cores, the default form for head dims 64 and 128: the
CUDA-core kernel's problem, parameters and split (``bf16_decode_attention.py``), the cache
streamed through shared memory, the scores and weighted sums as warp-level mma.sync
m16n8k16 (bf16 in, or f16 over an e4m3 cache; f32 accumulators).

Each warp takes tiles of 16 tokens (the CTA's four warps 64 a step) and, for its KV head's
query rows (a 16-row tile: query token j's head h in row j x group + h, the rows past
q_len x group zero; one query token: head h in row h):

    ring        the warp's own ring of ``stages`` slots, each a tile's 16 k and 16 v rows
                copied by cp.async in 16-byte pieces (``_Ring``), on an mbarrier a slot;
                a slot is refilled with the tile ``stages`` ahead once every lane read it
                (with new keys and values, ``append``: their rows from k_new and v_new)
    S [16 rows, 16 tokens] = Q [16, D] x K^T       (D / 16 mma a token half)
    online softmax by row (a quad of lanes holds a row's 4 x 2 scores of the tile; the
                running max moves only when a tile's passes it by MAX_SLACK, so most
                tiles rescale nothing; a causal query token's row masks the cache's
                last tokens it does not see)
    O [16 rows, D] += P [16, 16 tokens] x V        (D / 8 mma)

Lane (g, t) (g = lane / 4, t = lane % 4) reads tokens g and g + 8 of the slot, 16-byte
vectors of dimensions 32 i + 8 t .. + 8 (8-byte ones of e4m3). The mma's k index is a
permutation of the dimensions, the same for Q and K (a dot product is blind to the
order), so those vectors are K's B fragments as read: for chunk i, k-step 2i takes
dimensions 32 i + 8 t + {0, 1} (b0) and {2, 3} (b1), k-step 2i + 1 takes {4, 5} and {6,
7}; Q's A fragments follow. V is B of the second product with k = tokens: each b32 of a V
vector is a lane's pair in an 8 x 8 matrix of (8 tokens, 8 permuted dimensions), and
movmatrix.trans turns it into the B fragment. The output fragment of n-block (i, j) then
holds, for head g, dimensions 32 i + 8 t + 2 j + {0, 1}: lane (g, t) ends with its head's
dimensions 32 i + 8 t .. + 8. The slots' rows are swizzled (``_swizzle``) so that these
reads hit distinct banks.

The split across CTAs, the workspace layout and the counters are the CUDA-core kernel's
(``count_split``); the CTA's warps merge through shared memory (the rings' slots, once
their tokens are done), after their tokens and again in the last split, where each warp
folds every fourth split's partial; or, with ``cluster``, the pair's splits are one
cluster and CTA 0 folds the others' states through distributed shared memory
(``_cluster_merge``). Head dims 64 and 128: at 256 the O fragments and Q's outgrow the
registers.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..patterns.pipeline import BARRIER_BYTES, StageRing, wait_parity
from ..ptx import KernelBuilder, LaunchShape, addr
from . import bf16_decode_attention as base

TILE = 16                 # tokens a warp's tile
WARPS = 4
THREADS = 32 * WARPS
CHUNK = 32                # dimensions a lane's 16-byte vectors step over
BANK_BYTES = 128          # a shared-memory wavefront: 32 banks of 4 bytes
REGISTERS = {False: 168, True: 255}   # ptxas's cap by whether the tile has rows past 8
                                       # (a lane holding two rows); no variant spills
SHARED_PER_SM = 228 << 10  # Hopper's shared memory an SM, and what each CTA's takes
SHARED_RESERVED = 1 << 10  # besides its own
MAX_SLACK = 8.0           # how far (in log2) a tile's max may pass the running one unapplied


def generate(cfg) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS,
                      min_blocks_per_sm=ctas_per_sm(cfg))
    k.launch = LaunchShape(block=THREADS, shared_bytes=shared_bytes(cfg), cluster=cfg.cluster)
    p = base._Params(k, cfg)
    with k.stage("programmatic launch: the next kernel on the stream may start"):
        k.griddepcontrol_launch_dependents()
    t = _coordinates(k, cfg)
    ring = _Ring(k, cfg, t)
    with k.stage("wait for the kernel before this one"):
        k.griddepcontrol_wait()
    ptrs = base._pointers(k, cfg, p, t, cache_vectors=False)
    ring.lane_rows(t, ptrs, p)
    if cfg.append:
        _append(k, cfg, p, t, ptrs, ring)
    q = _query_fragments(k, cfg, p, ptrs, t)
    state = _state(k, cfg, t)
    _tiles(k, cfg, t, ptrs, q, state, ring)
    _finish(k, cfg, p, t, state, ring.base)
    return k


def _coordinates(k, cfg) -> SimpleNamespace:
    """The CUDA-core kernel's coordinates with four threads a token (the quad's t is the
    vector ``_pointers`` offsets rows by), the lane's row g and its rows of the tile."""
    t = base._coordinates(k, 4)
    t.row = k.reg("u32", "row_g")
    k.shr(t.row, t.lane, 2)
    t.row_tile = None
    if cfg.row_tiles > 1:   # grid y: (KV head, row tile); the pair counts both
        t.row_tile = k.reg("u32", "row_tile")
        k.rem(t.row_tile, t.kv_head, cfg.row_tiles)
        k.div(t.kv_head, t.kv_head, cfg.row_tiles)
        k.div(t.kv_heads, t.kv_heads, cfg.row_tiles)
    t.rows = _lane_rows(k, cfg, t.row, t.row_tile)
    return t


def _lane_rows(k, cfg, g, row_tile) -> list:
    """Lane (g, t)'s rows of the tile (query token j's head h in row j x group + h): g,
    and g + 8 where the rows pass 8 (the mma's accumulators c0, c1 and c2, c3). Each has
    its index (clamped to the last row: a row past the rows reads that row's query and
    stores nothing), whether it is real, its query token and head, and with causal query
    tokens how many of the cache's last tokens it does not see (q_len - 1 - j). Past
    MMA_ROWS rows, the CTA's tile ``row_tile`` holds rows row_tile x MMA_ROWS on."""
    rows = []
    with k.stage("this lane's rows of the tile: query token and head"):
        for half in range(2 if cfg.tile_rows > 8 else 1):
            name = "_hi" if half else ""
            r = SimpleNamespace(half=half, components=(2 * half, 2 * half + 1), name=name,
                                unseen=None)
            r.index, r.real = k.reg("u32", "tile_row" + name), k.pred("real_row" + name)
            k.add(r.index, g, 8 * half)
            r.local = r.index       # the row in its tile (the workspace's row)
            if cfg.row_tiles > 1:    # this CTA's tile of the rows
                r.local = k.reg("u32", "local_row" + name)
                k.mov(r.local, r.index)
                k.mad(r.index, row_tile, base.MMA_ROWS, r.index, mode="lo")
            k.setp("lt", r.real, r.index, cfg.rows)
            k.min(r.index, r.index, cfg.rows - 1)
            r.token, r.head = None, r.index
            if cfg.q_len > 1:
                r.token, r.head = k.reg("u32", "q_token" + name), k.reg("u32", "q_head" + name)
                k.div(r.token, r.index, cfg.group)
                k.rem(r.head, r.index, cfg.group)
                if cfg.causal:
                    r.unseen = k.reg("u32", "unseen" + name)
                    k.mov(r.unseen, cfg.q_len - 1)
                    k.sub(r.unseen, r.unseen, r.token)
            rows.append(r)
    return rows


def _chunks(cfg) -> int:
    return cfg.head_dim // CHUNK


def _operands(cfg) -> str:
    """The mma's operand type: bf16 over a bf16 cache; f16 over an e4m3 one (the cache's
    values convert to f16 pairs in one instruction, and Q and P follow)."""
    return "f16" if cfg.cache_dtype == "e4m3" else "bf16"


def _query_fragments(k, cfg, p, ptrs, t) -> list:
    """Per k-step, the A fragment (a0, a1, a2, a3) as pairs of q times scale * log2(e): a0
    and a2 of row g, a1 and a3 of row g + 8 (its query token's head's permuted dimensions;
    zero past the rows)."""
    with k.stage("Q's A fragments: each row's permuted dimensions, scaled, as mma pairs"):
        scale, zero = k.reg("f32", "scale_log2"), k.reg("b32", "q_zero")
        k.ld_param(scale, p.scale_log2)
        k.mov(zero, 0)
        steps = [[zero] * 4 for _ in range(2 * _chunks(cfg))]
        at, wide = k.reg("u64", "q_at"), k.reg("u64", "q_row")
        packed, f32 = k.regs("b32", 4, "q_packed"), k.regs("f32", 8, "q_f32")
        if cfg.q_len > 1:
            stride = k.reg("u64", "q_token_stride")
            k.ld_param(stride, p.q_token_stride)
        for r in t.rows:
            k.cvt(wide, r.head, dtype="u64")
            k.mad(at, wide, ptrs.q_head_stride, ptrs.q, mode="lo", type="u64")
            if r.token is not None:
                k.cvt(wide, r.token, dtype="u64")
                k.mad(at, wide, stride, at, mode="lo", type="u64")
            for i in range(_chunks(cfg)):
                for word in packed:
                    k.mov(word, 0)
                with k.guard(r.real):
                    k.ld(packed, addr(at, i * CHUNK * 2), nc=True)
                base._unpack(k, f32, packed)
                for value in f32:
                    k.mul(value, value, scale)
                for half in range(2):    # k-step 2i + half: dimensions 4 half + {0, 1}, {2, 3}
                    lo = k.reg("b32", f"qa{i}_{half}{r.name}_lo")
                    hi = k.reg("b32", f"qa{i}_{half}{r.name}_hi")
                    pair = _operands(cfg) + "x2"
                    k.cvt(lo, f32[4 * half + 1], f32[4 * half], dtype=pair, rnd="rn")
                    k.cvt(hi, f32[4 * half + 3], f32[4 * half + 2], dtype=pair, rnd="rn")
                    # row g: a0 (k 0..7), a2 (k 8..15); row g + 8: a1, a3
                    steps[2 * i + half][r.half] = lo
                    steps[2 * i + half][r.half + 2] = hi
    return steps


def _state(k, cfg, t) -> SimpleNamespace:
    """Each of the lane's rows' running max and (this lane's part of the) sum, and O's
    fragments: for chunk i and movmatrix j, c0..c3 (c0, c1 row g's, c2, c3 row g + 8's)."""
    state = SimpleNamespace(
        rows=[SimpleNamespace(lane=r, max=k.reg("f32", "m" + r.name),
                              sum=k.reg("f32", "l" + r.name)) for r in t.rows],
        out=[[k.regs("f32", 4, f"o{i}_{j}_") for j in range(4)] for i in range(_chunks(cfg))])
    with k.stage("running max, sum and O"):
        _fresh(k, state)
    return state


def _fresh(k, state) -> None:
    for row in state.rows:
        k.mov(row.max, base.MAX_START)
        k.mov(row.sum, 0.0)
    for chunk in state.out:
        for frag in chunk:
            for r in frag:
                k.mov(r, 0.0)


def ctas_per_sm(cfg) -> int:
    """Resident CTAs an SM, by the registers and the rings' shared memory."""
    return min(65536 // (THREADS * REGISTERS[cfg.tile_rows > 8]),
               SHARED_PER_SM // (shared_bytes(cfg) + SHARED_RESERVED))


def row_bytes(cfg) -> int:
    return cfg.head_dim * cfg.element_bytes


def _span(cfg) -> int:
    """Bytes of a row that a quad reads at once: four lanes' vectors of 8 values."""
    return 4 * 8 * cfg.element_bytes


def _swizzle(k, cfg, row, into) -> None:
    """``into`` = the span offset XORed into row ``row``'s byte offsets in a slot.

    A wavefront of reads (a quarter warp's 16-byte vectors, a half warp's 8-byte ones)
    takes the same span of BANK_BYTES / span consecutive rows; unswizzled, rows a
    multiple of BANK_BYTES apart would all hit the same banks. Row r's spans are stored
    in the order i ^ x(r), x(r) = (r mod R) >> shift (R = BANK_BYTES / span; shift for
    rows shorter than BANK_BYTES, whose own offsets already part two of them), which puts
    the wavefront's rows in distinct banks; the copies write whole rows, so their
    wavefronts stay conflict-free too."""
    rows = BANK_BYTES // _span(cfg)
    shift = max(0, (BANK_BYTES // row_bytes(cfg)).bit_length() - 1)
    k.and_(into, row, rows - 1)
    k.shr(into, into, shift)
    k.mul(into, into, _span(cfg), mode="lo")


def slot_bytes(cfg) -> int:
    """A slot of a warp's ring: a tile's 16 k rows and 16 v rows (swizzled), and with an
    e4m3 cache the tile's 16 k scales and 16 v scales."""
    scales = 2 * TILE * 4 if cfg.cache_dtype == "e4m3" else 0
    return 2 * TILE * row_bytes(cfg) + scales


def _slots_bytes(cfg) -> int:
    """The warps' rings of slots; once the tokens are done, the warp merge's records
    (a lane's O values, then its (max, sum))."""
    return max(WARPS * cfg.stages * slot_bytes(cfg), THREADS * _record_bytes(cfg))


def _record_bytes(cfg) -> int:
    """A lane's record in the warp merge: each of its rows' O values, then (max, sum)."""
    return (8 * _chunks(cfg) * 4 + 16) * (2 if cfg.tile_rows > 8 else 1)


def shared_bytes(cfg) -> int:
    """The slots, then a full barrier a slot."""
    return _slots_bytes(cfg) + WARPS * cfg.stages * BARRIER_BYTES


class _Ring:
    """This warp's ``stages`` slots, filled by cp.async, each on its full barrier.

    A tile's 32 rows (16 k, then 16 v) are copied in 16-byte pieces, each instruction a
    run of whole rows (a row's pieces from neighbouring lanes: coalesced), into the
    slot's swizzled rows (``_swizzle``). Tokens past the split's end copy its last
    token's row instead: a partial tile repeats a real row, whose score the softmax
    masks, so no slot holds stale or uninitialised values. Each lane then arrives on the
    slot's barrier once its copies land (cp.async.mbarrier.arrive.noinc: the barrier
    expects 32 arrivals). With an e4m3 cache, lane l also copies the scale of row l (k
    below lane 16, v from it).

    Not bulk copies: cp.async.bulk takes its operands from uniform registers, so a
    warp's 32 different rows become 32 serial copies (a loop over the lanes in SASS);
    one bulk copy a tile would need the rows contiguous, and could not swizzle them."""

    def __init__(self, k, cfg, t):
        self.k, self.cfg = k, cfg
        self.e4m3 = cfg.cache_dtype == "e4m3"
        self.lanes_per_row = row_bytes(cfg) // 16
        self.rows_per_copy = 32 // self.lanes_per_row
        assert self.rows_per_copy % (BANK_BYTES // _span(cfg)) == 0, "a copy's swizzle varies"
        with k.stage("the warps' rings: shared memory and barriers"):
            smem = k.dynamic_shared("rings", align=128)
            self.base = k.reg("u32", "smem")
            k.mov(self.base, smem)
            slots = WARPS * cfg.stages
            self.barriers = StageRing(k, self.base, slots, full_offset=_slots_bytes(cfg),
                                      fillers=32)
            thread0 = k.pred("ring_thread0")
            k.setp("eq", thread0, t.tid, 0)
            self.barriers.init(thread0)
            # the warp's first slot and its barrier; the slot the loop is at, its barrier
            first = k.reg("u32", "first_slot")
            k.mul(first, t.warp, cfg.stages, mode="lo")
            self.first_bar = k.reg("u32", "first_bar")
            k.mad(self.first_bar, first, BARRIER_BYTES, self.base, mode="lo")
            k.add(self.first_bar, self.first_bar, _slots_bytes(cfg))
            self.first_slot = k.reg("u32", "first_slot_at")
            k.mad(self.first_slot, first, slot_bytes(cfg), self.base, mode="lo")
            self.slot, self.bar = k.reg("u32", "slot_at"), k.reg("u32", "bar_at")
            self.phase, self.index = k.reg("u32", "ring_phase"), k.reg("u32", "ring_index")
            k.mov(self.slot, self.first_slot)
            k.mov(self.bar, self.first_bar)
            k.mov(self.phase, 0)
            k.mov(self.index, 0)

    def lane_rows(self, t, ptrs, p) -> None:
        """This lane's piece of a row (``sub_row`` of each copy's rows, 16 bytes from
        ``piece``), its k and v sources for token 0, where it lands in a slot (``dst``)."""
        k, cfg, self.ptrs = self.k, self.cfg, ptrs
        with k.stage("this lane's piece of the rows it copies"):
            self.sub_row, piece = k.reg("u32", "copy_sub_row"), k.reg("u32", "copy_piece")
            k.shr(self.sub_row, t.lane, self.lanes_per_row.bit_length() - 1)
            k.and_(piece, t.lane, self.lanes_per_row - 1)
            k.shl(piece, piece, 4, type="b32")
            def with_piece(name, row):
                src = k.reg("u64", f"copy_{name}")
                k.cvt(src, piece, dtype="u64")
                k.add(src, src, row)
                return src

            # unswizzled in global memory
            self.sources = [with_piece(n, row) for n, row in (("k", ptrs.k), ("v", ptrs.v))]
            if cfg.append:   # k_new's and v_new's rows of the pair, and this lane's piece
                self.new_rows = [_new_row(k, p, t, which) for which in "kv"]
                self.new_sources = [with_piece(f"new_{n}", row)
                                    for n, row in zip("kv", self.new_rows)]
                stride = k.reg("u64", "new_token_stride")
                k.ld_param(stride, p.new_token_stride)
                ptrs.new_token = k.reg("u32", "new_token_bytes")
                k.cvt(ptrs.new_token, stride, dtype="u32")
            # each copy's rows start at a multiple of R: the swizzle is the sub-row's
            self.dst = k.reg("u32", "copy_dst")
            _swizzle(k, cfg, self.sub_row, self.dst)
            k.xor(self.dst, self.dst, piece)
            k.mad(self.dst, self.sub_row, row_bytes(cfg), self.dst, mode="lo")
            if self.e4m3:
                is_v = k.pred("copies_v_scale")
                k.setp("ge", is_v, t.lane, TILE)
                self.scales = k.reg("u64", "copy_scales")
                k.selp(self.scales, ptrs.v_scale, ptrs.k_scale, is_v)
                self.scale_row = k.reg("u32", "copy_scale_row")
                k.and_(self.scale_row, t.lane, TILE - 1)
                self.scale_dst = k.reg("u32", "copy_scale_dst")
                k.shl(self.scale_dst, t.lane, 2, type="b32")
                k.add(self.scale_dst, self.scale_dst, 2 * TILE * row_bytes(cfg))

    def fill(self, tile, stage: int | None = None) -> None:
        """Copy the 16 tokens from ``tile`` into the warp's current slot (or its slot
        ``stage``), then arrive on its barrier as the copies land: every lane."""
        k, cfg, ptrs = self.k, self.cfg, self.ptrs
        if stage is None:
            slot, bar = addr(self.slot), addr(self.bar)
        else:
            slot = addr(self.first_slot, stage * slot_bytes(cfg))
            bar = addr(self.first_bar, stage * BARRIER_BYTES)
        first, token, last, dst = (k.reg("u32", n) for n in (
            "copy_first", "copy_token", "copy_last", "copy_to"))
        src = k.reg("u64", "copy_src")
        k.sub(last, ptrs.end, 1)
        k.add(first, tile, self.sub_row)
        k.add(dst, slot.base, self.dst)
        sources, strides = self.sources, (ptrs.k_token, ptrs.v_token)
        if cfg.paged:   # the tile lies in one page (pages of at least 16 tokens)
            page = k.reg("u32", "copy_page")
            base._token_page(k, ptrs, tile, None, page)
            sources = [k.reg("u64", f"copy_page_{n}") for n in "kv"]
            for into, start, page_bytes in zip(sources, self.sources,
                                               (ptrs.k_page, ptrs.v_page)):
                k.mad(into, page, page_bytes, start, mode="wide")
        if cfg.append:
            fresh, is_new = k.reg("u32", "copy_fresh"), k.pred("copy_is_new")
            new_src = k.reg("u64", "copy_new_src")
        for j in range(TILE // self.rows_per_copy):
            k.add(token, first, j * self.rows_per_copy)
            k.min(token, token, last)
            if cfg.append:     # a token from the old length on: k_new's row, not the cache's
                k.setp("ge", is_new, token, ptrs.old)
                k.sub(fresh, token, ptrs.old)
            if cfg.paged:
                k.and_(token, token, ptrs.row_mask)
            for half, (start, stride) in enumerate(zip(sources, strides)):
                k.mad(src, token, stride, start, mode="wide")
                if cfg.append:
                    k.mad(new_src, fresh, ptrs.new_token, self.new_sources[half], mode="wide")
                    k.selp(src, new_src, src, is_new)
                row_at = half * TILE + j * self.rows_per_copy
                k.cp_async(addr(dst, slot.offset + row_at * row_bytes(cfg)), addr(src), 16,
                           cache="cg")
        if self.e4m3:
            k.add(token, tile, self.scale_row)
            k.min(token, token, last)
            scales = self.scales
            if cfg.paged:      # the scales paged as the caches, the tile's page
                scales = k.reg("u64", "copy_page_scales")
                k.mad(scales, page, ptrs.scale_page, self.scales, mode="wide")
                k.and_(token, token, ptrs.row_mask)
            k.mad(src, token, ptrs.scale_token, scales, mode="wide")
            k.add(dst, slot.base, self.scale_dst)
            k.cp_async(addr(dst, slot.offset), addr(src), 4)
        k.cp_async_mbarrier_arrive(bar)

    def advance(self) -> None:
        """The next slot (after the last, the first, in the other phase)."""
        k, cfg = self.k, self.cfg
        wrapped = k.pred("ring_wrapped")
        k.add(self.index, self.index, 1)
        k.add(self.slot, self.slot, slot_bytes(cfg))
        k.add(self.bar, self.bar, BARRIER_BYTES)
        k.setp("eq", wrapped, self.index, cfg.stages)
        with k.guard(wrapped):
            k.mov(self.index, 0)
            k.mov(self.slot, self.first_slot)
            k.mov(self.bar, self.first_bar)
            k.xor(self.phase, self.phase, 1)


def _new_row(k, p, t, which: str):
    """k_new's (or v_new's) first row of the pair."""
    at, wide, stride = k.reg("u64", f"new_{which}"), k.reg("u64", "new_wide"), \
        k.reg("u64", "new_stride")
    k.ld_param(at, p.k_new if which == "k" else p.v_new)
    for index, param in ((t.seq, p.new_batch_stride), (t.kv_head, p.new_head_stride)):
        k.cvt(wide, index, dtype="u64")
        k.ld_param(stride, param)
        k.mad(at, wide, stride, at, mode="lo", type="u64")
    return at


def _append(k, cfg, p, t, ptrs, ring) -> None:
    """The pair's first split writes k_new's and v_new's rows into the cache at positions
    old + i (those under S_max), 16 bytes a thread in turn; the kernel reads them from
    k_new and v_new, so no CTA waits for the write."""
    lanes = row_bytes(cfg) // 16                # threads a row
    with k.stage("append: the first split writes k_new and v_new into the cache"):
        first = k.pred("first_split")
        k.setp("eq", first, t.split, 0)
        with k.if_(first, "appended", uniform=True):
            total, new = k.reg("u32", "append_pieces"), k.reg("u32", "append_tokens")
            k.ld_param(new, p.new_tokens)
            k.mul(total, new, 2 * lanes, mode="lo")
            i, rest, piece, pos = (k.reg("u32", n) for n in (
                "append_row", "append_rest", "append_piece", "append_pos"))
            src, dst, wide = (k.reg("u64", n) for n in ("append_src", "append_dst",
                                                          "append_wide"))
            is_v, inside = k.pred("append_v"), k.pred("append_inside")
            data = k.regs("b32", 4, "append_data")
            with k.loop(k.reg("u32", "append_at"), total, start=t.tid, step=THREADS,
                        hint="append") as at:
                k.shr(i, at, (2 * lanes).bit_length() - 1)
                k.and_(rest, at, 2 * lanes - 1)
                k.setp("ge", is_v, rest, lanes)
                k.and_(piece, rest, lanes - 1)
                k.shl(piece, piece, 4, type="b32")
                k.add(pos, ptrs.old, i)
                k.setp("lt", inside, pos, ptrs.capacity)
                # the source: k_new's (v_new's) row i, the piece
                k.selp(src, ring.new_rows[1], ring.new_rows[0], is_v)
                k.mad(src, i, ptrs.new_token, src, mode="wide")
                k.cvt(wide, piece, dtype="u64")
                k.add(src, src, wide)
                # the destination: the cache's row at pos (its page's), the piece
                k.selp(dst, ptrs.v, ptrs.k, is_v)
                token_bytes = k.reg("u32", "append_token_bytes")
                k.selp(token_bytes, ptrs.v_token, ptrs.k_token, is_v)
                row = pos
                if cfg.paged:
                    page, page_bytes = k.reg("u32", "append_page"), k.reg("u32",
                                                                           "append_page_bytes")
                    base._token_page(k, ptrs, pos, inside, page)
                    k.selp(page_bytes, ptrs.v_page, ptrs.k_page, is_v)
                    k.mad(dst, page, page_bytes, dst, mode="wide")
                    row = k.reg("u32", "append_page_row")
                    k.and_(row, pos, ptrs.row_mask)
                k.mad(dst, row, token_bytes, dst, mode="wide")
                k.add(dst, dst, wide)
                with k.guard(inside):
                    k.ld(data, addr(src), nc=True)
                    k.st(addr(dst), data)


def _tiles(k, cfg, t, ptrs, q, state, ring) -> None:
    """The split's tokens, a tile of 16 a warp, the CTA's four warps 64 a step; each warp's
    tiles stream through its ring, ``stages`` tiles ahead."""
    chunks = _chunks(cfg)
    zero = k.reg("b32", "zero")
    k.mov(zero, 0)
    words = 4 if cfg.element_bytes == 2 else 2        # b32 words of a lane's 8 values
    keys = [[k.regs("b32", words, f"k{h}_{i}_") for i in range(chunks)] for h in range(2)]
    values = [[k.regs("b32", words, f"v{h}_{i}_") for i in range(chunks)] for h in range(2)]
    pairs = _Pairs(k, cfg)
    scores = [k.regs("f32", 4, f"s{n}_") for n in range(2)]
    # each row's P pairs of the two n-blocks; a row the tile lacks is zero
    probs = [[zero, zero], [zero, zero]]
    for row in state.rows:
        probs[row.lane.half] = [k.reg("b32", f"p{n}{row.lane.name}") for n in range(2)]
    b0, b1 = k.reg("b32", "vb0"), k.reg("b32", "vb1")
    mine, ahead = k.pred("warp_has_tile"), k.pred("tile_ahead")
    scales = ([k.regs("f32", 2, f"{c}_scale{h}_") for h in range(2) for c in "kv"]
              if cfg.cache_dtype == "e4m3" else None)
    first, later = k.reg("u32", "tile_first"), k.reg("u32", "later")
    row = row_bytes(cfg)
    with k.stage("this lane's reads of a slot: token g's (and g + 8's) vector of 8 values "
                 "from 8 t in each chunk's span, swizzled"):
        swizzle, reads = k.reg("u32", "read_swizzle"), k.regs("u32", chunks, "lane_reads")
        at = k.regs("u32", chunks, "read_at")
        _swizzle(k, cfg, t.row, swizzle)
        for i, offset in enumerate(reads):
            k.mad(offset, t.vector, 8 * cfg.element_bytes, i * _span(cfg), mode="lo")
            k.xor(offset, offset, swizzle)
            k.mad(offset, t.row, row, offset, mode="lo")
    k.mad(first, t.warp, TILE, ptrs.start, mode="lo")
    with k.stage("the first tiles of each warp into its ring"):
        k.mov(later, first)
        for s in range(cfg.stages):
            k.setp("lt", ahead, later, ptrs.end)
            with k.if_(ahead, "filled", uniform=True):
                ring.fill(later, stage=s)
            k.add(later, later, WARPS * TILE)
    with k.loop(k.reg("u32", "tile_base"), ptrs.end, start=ptrs.start, step=WARPS * TILE,
                hint="tiles", uniform=True):
        k.setp("lt", mine, first, ptrs.end)
        with k.if_(mine, "tile_done", uniform=True):
            with k.stage("wait for the slot; k vectors of tokens g and g + 8"):
                wait_parity(k, addr(ring.bar), ring.phase, "wait_tile", uniform=True)
                for i in range(chunks):
                    k.add(at[i], ring.slot, reads[i])
                for h in range(2):
                    for i, vec in enumerate(keys[h]):
                        k.ld(vec, addr(at[i], h * 8 * row), space="shared")
            with k.stage("S = Q K^T: two n-blocks of 8 tokens, D / 16 k-steps each"):
                for h in range(2):
                    for s in scores[h]:
                        k.mov(s, 0.0)
                    for i in range(chunks):
                        key = pairs.of(keys[h][i])
                        for half in range(2):
                            k.mma_sync(scores[h], q[2 * i + half],
                                       key[2 * half:2 * half + 2], scores[h],
                                       ab_type=_operands(cfg))
            scratch = _softmax(k, cfg, t, ptrs, ring, state, scores, probs, first, scales)
            with k.stage("O += P V: V's vectors from the slot, their pairs transposed "
                         "(movmatrix) into B fragments"):
                for h in range(2):
                    for i, vec in enumerate(values[h]):
                        k.ld(vec, addr(at[i], (TILE + h * 8) * row), space="shared")
                for i in range(chunks):
                    lo, hi = pairs.of(values[0][i]), pairs.of(values[1][i], second=True)
                    for j in range(4):
                        k.movmatrix(b0, lo[j])
                        k.movmatrix(b1, hi[j])
                        frag = state.out[i][j]
                        k.mma_sync(frag, [probs[0][0], probs[1][0], probs[0][1], probs[1][1]],
                                   [b0, b1], frag, ab_type=_operands(cfg))
            with k.stage("the slot read by every lane: refill it, stages tiles ahead"):
                k.bar_warp_sync()
                k.add(later, first, cfg.stages * WARPS * TILE)
                k.setp("lt", ahead, later, ptrs.end)
                with k.if_(ahead, "refilled", uniform=True):
                    ring.fill(later)
        ring.advance()
        k.add(first, first, WARPS * TILE)
    with k.stage("each row's sum over its quad"):
        other = scratch.other
        for row in state.rows:
            for mask in (1, 2):
                k.shfl_sync(other, row.sum, mask, mode="bfly")
                k.add(row.sum, row.sum, other)


def _softmax(k, cfg, t, ptrs, ring, state, scores, probs, first, scales) -> SimpleNamespace:
    """One tile's online softmax (below); returns its scratch registers."""
    r = SimpleNamespace(top=k.reg("f32", "tile_max"), other=k.reg("f32", "quad"),
                        corr=k.regs("f32", 2, "rescale"), column=k.reg("u32", "column"),
                        quad_column=k.reg("u32", "quad_column"), masked=k.pred("masked"),
                        unseen=k.pred("unseen"), moved=k.pred("max_moved"),
                        any_moved=k.pred("any_moved"), moved_now=k.pred("moved_now"))
    with k.stage("online softmax of each row: tokens past the end (or past its query "
                 "token) -inf, the tile's max over the quad, the running max moved where "
                 "it passed it far, p = ex2(s - max)"):
        k.mad(r.quad_column, t.vector, 2, first, mode="lo")   # the tile's token 2 t
        if scales is not None:    # the tile's k and v scales of tokens 8 h + 2 t + {0, 1}
            at = k.reg("u32", "scales_at")
            k.mad(at, t.vector, 8, ring.slot, mode="lo")
            for h in range(2):
                for c, which in enumerate("kv"):
                    k.ld(scales[2 * h + c], addr(at, 2 * TILE * row_bytes(cfg) + 64 * c
                                                 + 32 * h), space="shared")
        k.mov(r.any_moved, 0)
        for row in state.rows:
            lane, corr = row.lane, r.corr[row.lane.half]
            mine = [(h, c, scores[h][lane.components[c]]) for h in range(2) for c in range(2)]
            for h, c, score in mine:     # token 8 h + 2 t + c
                k.add(r.column, r.quad_column, 8 * h + c)
                k.setp("ge", r.masked, r.column, ptrs.end)
                if lane.unseen is not None:    # past the cache's length less the unseen
                    k.add(r.column, r.column, lane.unseen)
                    k.setp("ge", r.unseen, r.column, ptrs.length)
                    k.or_(r.masked, r.masked, r.unseen)
                if scales is not None:
                    k.mul(score, score, scales[2 * h][c])
                k.selp(score, base.NO_SCORE, score, r.masked)
            k.max(r.top, mine[0][2], mine[1][2])
            k.max(r.top, r.top, mine[2][2])
            k.max(r.top, r.top, mine[3][2])
            for mask in (1, 2):
                k.shfl_sync(r.other, r.top, mask, mode="bfly")
                k.max(r.top, r.top, r.other)
            # The running max moves only when the tile's passes it by more than MAX_SLACK
            # (p then stays under 2 ** MAX_SLACK): most tiles keep it, and their O needs
            # no rescale; a warp rescales its O when any of its rows moved.
            k.add(r.other, row.max, MAX_SLACK)
            k.setp("gt", r.moved, r.top, r.other)
            k.selp(r.top, r.top, row.max, r.moved)
            k.vote_sync(r.moved_now, r.moved, mode="any")
            k.or_(r.any_moved, r.any_moved, r.moved_now)
            k.sub(corr, row.max, r.top)
            k.ex2(corr, corr, ftz=True)
            k.mov(row.max, r.top)
            k.mul(row.sum, row.sum, corr)
            for h, c, score in mine:
                k.sub(score, score, r.top)
                k.ex2(score, score, ftz=True)
                k.add(row.sum, row.sum, score)
                if scales is not None:   # P x the v scales: V's e4m3 as it is
                    k.mul(score, score, scales[2 * h + 1][c])
            for h in range(2):
                k.cvt(probs[lane.half][h], mine[2 * h + 1][2], mine[2 * h][2],
                      dtype=_operands(cfg) + "x2", rnd="rn")
        with k.if_(r.any_moved, "rescaled", uniform=True):
            for row in state.rows:
                for chunk in state.out:
                    for frag in chunk:
                        for c in row.lane.components:
                            k.mul(frag[c], frag[c], r.corr[row.lane.half])
    return r


class _Pairs:
    """A lane's 8 values of a cache row as four b32 words of two 16-bit values (the mma's
    operand pairs): bf16 words as loaded; e4m3 bytes converted to f16 pairs."""

    def __init__(self, k, cfg):
        self.k, self.e4m3 = k, cfg.cache_dtype == "e4m3"
        if self.e4m3:
            self.words = [k.regs("b32", 4, "f16_pairs"), k.regs("b32", 4, "f16_pairs_hi")]
            self.half = k.reg("b16", "e4m3_pair")
            self.shifted = k.reg("b32", "e4m3_upper")

    def of(self, loaded: list, second: bool = False) -> list:
        """``loaded``'s four words of pairs (``second``: into the other set of registers,
        for two vectors in use at once)."""
        if not self.e4m3:
            return loaded
        k, out = self.k, self.words[second]
        for w, word in enumerate(loaded):
            k.cvt(self.half, word, dtype="u16", stype="u32")
            k.cvt(out[2 * w], self.half, dtype="f16x2", stype="e4m3x2", rnd="rn")
            k.shr(self.shifted, word, 16, type="b32")
            k.cvt(self.half, self.shifted, dtype="u16", stype="u32")
            k.cvt(out[2 * w + 1], self.half, dtype="f16x2", stype="e4m3x2", rnd="rn")
        return out


def _values(state, row) -> list:
    """Lane (g, t)'s O values of ``row`` in dimension order: chunk i's 32 i + 8 t + 0..7."""
    return [[frag[c] for frag in chunk for c in row.lane.components] for chunk in state.out]


def _fold(k, state, row, other_max, other_sum, other: list, scratch) -> None:
    """Fold another (max, sum, O values) of ``row`` into the state."""
    top, mine, theirs = scratch
    k.max(top, row.max, other_max)
    k.sub(mine, row.max, top)
    k.ex2(mine, mine, ftz=True)
    k.sub(theirs, other_max, top)
    k.ex2(theirs, theirs, ftz=True)
    k.mov(row.max, top)
    k.mul(row.sum, row.sum, mine)
    k.fma(row.sum, other_sum, theirs, row.sum)
    for a, b in zip((v for chunk in _values(state, row) for v in chunk), other):
        k.mul(a, a, mine)
        k.fma(a, b, theirs, a)


class _WarpMerge:
    """Folds (max, sum, O) states of each of the lane's rows: another's registers into
    the state, and the CTA's warps' through shared memory into warp 0's."""

    def __init__(self, k, cfg, t, smem):
        self.k, self.t, self.chunks = k, t, _chunks(cfg)
        self.other_max, self.other_sum = k.reg("f32", "o_max"), k.reg("f32", "o_sum")
        self.other = k.regs("f32", 8 * self.chunks, "o_val")
        self.scratch = k.regs("f32", 3, "merge")
        self.warp0 = k.pred("warp0")
        k.setp("eq", self.warp0, t.warp, 0)
        self.record = _record_bytes(cfg)
        self.row_record = self.record // len(t.rows)     # a row's part of a lane's record
        self.smem = smem
        self.at, self.ml_at = k.reg("u32", "smem_at"), k.reg("u32", "smem_ml_at")

    def fold(self, state, row) -> None:
        _fold(self.k, state, row, self.other_max, self.other_sum, self.other, self.scratch)

    def load(self, space: str, acc, ml, offset: int = 0, **hints) -> None:
        """Another state into the fold's registers: its O values from ``acc`` + ``offset``
        (this lane's first dimension; chunks 128 bytes apart in global memory, 32 in a
        shared record) and its (max, sum) from ``ml`` + ``offset``."""
        k, other = self.k, self.other
        stride = 4 * CHUNK if space == "global" else 32
        for i in range(self.chunks):
            k.ld(other[8 * i:8 * i + 4], addr(acc, offset + stride * i), space=space, **hints)
            k.ld(other[8 * i + 4:8 * i + 8], addr(acc, offset + stride * i + 16), space=space,
                 **hints)
        k.ld([self.other_max, self.other_sum], addr(ml, offset), space=space, **hints)

    def store(self, state) -> None:
        """This lane's rows' states into its record (at ``at``, from ``warps``)."""
        k, at = self.k, self.at
        for n, row in enumerate(state.rows):
            part = n * self.row_record
            for i, vals in enumerate(_values(state, row)):
                k.st(addr(at, part + 32 * i), vals[:4], space="shared")
                k.st(addr(at, part + 32 * i + 16), vals[4:], space="shared")
            k.st(addr(self.ml_at, part), [row.max, row.sum], space="shared")

    def warps(self, state) -> None:
        """Every thread arrives (a CTA barrier); warp 0 ends with the CTA's state."""
        k, at, record, chunks = self.k, self.at, self.record, self.chunks
        with k.stage("merge the warps: each lane writes, warp 0 folds the others in"):
            k.mov(at, self.smem)
            k.mad(at, self.t.tid, record, at, mode="lo")
            k.add(self.ml_at, at, 32 * chunks)
            self.store(state)
            k.bar_sync(0)
            with k.if_(self.warp0, "warps_merged", uniform=True):
                for w in range(1, WARPS):
                    for n, row in enumerate(state.rows):
                        self.load("shared", at, self.ml_at,
                                  w * 32 * record + n * self.row_record)
                        self.fold(state, row)


def _finish(k, cfg, p, t, state, smem) -> None:
    """The warps merged into warp 0 (through ``smem``: the rings' slots, every copy into
    them landed and read); then the CUDA-core kernel's ending: out with one split, else
    the partial, the count, and the last split's merge (each warp folding every fourth
    split, then the warps merged again)."""
    k.bar_sync(0)        # every warp done with its ring before the records overwrite it
    merge = _WarpMerge(k, cfg, t, smem)
    merge.warps(state)
    if cfg.cluster > 1:
        _cluster_merge(k, cfg, p, t, state, merge)
        return
    last = k.pred("writes_out")
    k.setp("eq", last, t.splits, 1)
    with k.if_(~last, "partial_done", uniform=True):
        with k.if_(merge.warp0, "partial_stored", uniform=True):
            for row in state.rows:
                acc, ml = _partial_row(k, cfg, p, t, t.split, row, "mine_row")
                with k.guard(row.lane.real):
                    for i, vals in enumerate(_values(state, row)):
                        k.st(addr(acc, 4 * CHUNK * i), vals[:4])
                        k.st(addr(acc, 4 * CHUNK * i + 16), vals[4:])
                    k.st(addr(ml), [row.max, row.sum])
        counter, thread0 = base.count_split(k, p, t, last)
        with k.if_(last, "merged", uniform=True):
            k.fence("acq_rel", "gpu")
            with k.stage("the last split: every split's partial, a warp's share each"):
                _fresh(k, state)
                with k.loop(k.reg("u32", "merged_split"), t.splits, start=t.warp, step=WARPS,
                            uniform=True, hint="splits") as s:
                    for row in state.rows:
                        acc, ml = _partial_row(k, cfg, p, t, s, row, "split_row")
                        # written by other CTAs during this kernel: through L2
                        merge.load("global", acc, ml, cache="cg")
                        merge.fold(state, row)
            merge.warps(state)
            with k.guard(thread0):
                k.st(addr(counter), 0, type="u32")
    with k.if_(last, "written", uniform=True):
        with k.if_(merge.warp0, "out_stored", uniform=True):
            _store_out(k, cfg, p, t, state)


def _cluster_merge(k, cfg, p, t, state, merge) -> None:
    """The pair's splits are one cluster (split = the CTA's rank): each CTA's warp 0 leaves
    its state in its records, CTA 0's warp 0 folds the others' in through distributed
    shared memory and writes out; the others wait for it before their shared memory goes.
    No workspace, no counter, no round trip through L2."""
    at, chunks = merge.at, merge.chunks
    with k.stage("the cluster's splits: warp 0 of each CTA leaves its state in its records"):
        with k.if_(merge.warp0, "cluster_state_stored", uniform=True):
            merge.store(state)
        k.barrier_cluster_arrive(sem="release")
        k.barrier_cluster_wait()
    first = k.pred("cluster_first")
    k.setp("eq", first, t.split, 0)
    with k.stage("CTA 0: every other CTA's state, through distributed shared memory; out"):
        with k.if_(first, "cluster_merged", uniform=True):
            with k.if_(merge.warp0, "cluster_folded", uniform=True):
                remote, remote_ml = k.reg("u32", "remote_at"), k.reg("u32", "remote_ml_at")
                for rank in range(1, cfg.cluster):
                    k.mapa(remote, at, rank)
                    k.add(remote_ml, remote, 32 * chunks)
                    for n, row in enumerate(state.rows):
                        merge.load("shared::cluster", remote, remote_ml, n * merge.row_record)
                        merge.fold(state, row)
                _store_out(k, cfg, p, t, state)
        k.barrier_cluster_arrive(sem="release")   # CTA 0 read the others' records
        k.barrier_cluster_wait()


def _partial_row(k, cfg, p, t, split, row, name: str):
    """Split ``split``'s workspace for ``row`` (a row past the tile's: its last row's,
    never stored to, read harmlessly): its O (this lane's first dimension) and its (max,
    sum)."""
    at, acc, ml = k.reg("u32", name), k.reg("u64", name + "_acc"), k.reg("u64", name + "_ml")
    k.mad(at, t.pair, t.splits, split, mode="lo")
    k.mad(at, at, cfg.tile_rows, row.lane.local, mode="lo")
    k.ld_param(acc, p.partial)
    k.mad(acc, at, cfg.head_dim * 4, acc, mode="wide")
    k.mad(acc, t.vector, 8 * 4, acc, mode="wide")
    k.ld_param(ml, p.partial_ml)
    k.mad(ml, at, 8, ml, mode="wide")
    return acc, ml


def _store_out(k, cfg, p, t, state) -> None:
    with k.stage("out: O / sum for each row (zeros for no tokens), rounded to bf16 once"):
        out, inv, positive = k.reg("u64", "out_at"), k.reg("f32", "inv_sum"), k.pred("any_token")
        at, scaled = k.reg("u32", "out_row"), k.regs("f32", 2, "o")
        packed = k.regs("b32", 4, "out")
        if cfg.q_len > 1:
            heads = k.reg("u32", "out_heads")
            k.mul(heads, t.kv_heads, cfg.group, mode="lo")
        for row in state.rows:
            lane = row.lane
            # out [B, q_len, Hq, D]: row (seq x q_len + token) x Hq + kv_head x group + head
            if lane.token is None:
                k.mad(at, t.pair, cfg.group, lane.head, mode="lo")
            else:
                k.mad(at, t.seq, cfg.q_len, lane.token, mode="lo")
                k.mul(at, at, heads, mode="lo")
                k.mad(at, t.kv_head, cfg.group, at, mode="lo")
                k.add(at, at, lane.head)
            k.ld_param(out, p.out)
            k.mad(out, at, cfg.head_dim * 2, out, mode="wide")
            k.mad(out, t.vector, 16, out, mode="wide")
            k.setp("gt", positive, row.sum, 0.0)
            k.rcp(inv, row.sum)
            k.selp(inv, inv, 0.0, positive)
            for i, vals in enumerate(_values(state, row)):
                for w, word in enumerate(packed):
                    k.mul(scaled[0], vals[2 * w], inv)
                    k.mul(scaled[1], vals[2 * w + 1], inv)
                    k.cvt(word, scaled[1], scaled[0], dtype="bf16x2", rnd="rn")
                with k.guard(lane.real):
                    k.st(addr(out, 2 * CHUNK * i), packed, type="b32")
