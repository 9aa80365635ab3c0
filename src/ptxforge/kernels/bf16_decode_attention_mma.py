"""Decode attention on the tensor cores: the CUDA-core kernel's problem, parameters and
split (``bf16_decode_attention.py``), its scores and weighted sums as warp-level
mma.sync m16n8k16 (bf16 in, f32 accumulators).

Each warp takes tiles of 16 tokens (the CTA's four warps 64 a step) and, for its KV head's
query heads (rows of a 16-row tile: head h in row h, the rows past the group zero):

    S [16 heads, 16 tokens] = Q [16, D] x K^T      (D / 16 mma a token half)
    online softmax by row (a quad of lanes holds a row's 4 x 2 scores of the tile)
    O [16 heads, D] += P [16, 16 tokens] x V        (D / 8 mma)

Lane (g, t) (g = lane / 4, t = lane % 4) loads tokens g and g + 8 of the tile, in 16-byte
vectors of dimensions 32 i + 8 t .. + 8. The mma's k index is a permutation of the
dimensions, the same for Q and K (a dot product is blind to the order), so those vectors
are K's B fragments as loaded: for chunk i, k-step 2i takes dimensions 32 i + 8 t + {0, 1}
(b0) and {2, 3} (b1), k-step 2i + 1 takes {4, 5} and {6, 7}; Q's A fragments follow. V is
B of the second product with k = tokens: each b32 of a V vector is a lane's pair in an 8 x
8 matrix of (8 tokens, 8 permuted dimensions), and movmatrix.trans turns it into the B
fragment. The output fragment of n-block (i, j) then holds, for head g, dimensions 32 i +
8 t + 2 j + {0, 1}: lane (g, t) ends with its head's dimensions 32 i + 8 t .. + 8.

The split across CTAs, the workspace layout and the counters are the CUDA-core kernel's
(``count_split``); the CTA's warps merge through shared memory, after their tokens and
again in the last split, where each warp folds every fourth split's partial. Head dims
64 and 128: at 256 the K and V vectors and O's fragments outgrow the registers.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..ptx import KernelBuilder, LaunchShape, addr
from . import bf16_decode_attention as base

TILE = 16                 # tokens a warp's tile
WARPS = 4
THREADS = 32 * WARPS
CHUNK = 32                # dimensions a lane's 16-byte vectors step over


def generate(cfg) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS,
                      min_blocks_per_sm=cfg.ctas_per_sm)
    k.launch = LaunchShape(block=THREADS)
    p = base._Params(k, cfg)
    with k.stage("programmatic launch: the next kernel on the stream may start"):
        k.griddepcontrol_launch_dependents()
    t = _coordinates(k)
    with k.stage("wait for the kernel before this one"):
        k.griddepcontrol_wait()
    ptrs = base._pointers(k, cfg, p, t)
    q = _query_fragments(k, cfg, p, ptrs, t)
    state = _state(k, cfg)
    _tiles(k, cfg, t, ptrs, q, state)
    _finish(k, cfg, p, t, state)
    return k


def _coordinates(k) -> SimpleNamespace:
    """The CUDA-core kernel's coordinates with four threads a token (the quad's t is the
    vector ``_pointers`` offsets rows by), and the lane's row g."""
    t = base._coordinates(k, 4)
    t.row = k.reg("u32", "row_g")
    k.shr(t.row, t.lane, 2)
    return t


def _chunks(cfg) -> int:
    return cfg.head_dim // CHUNK


def _operands(cfg) -> str:
    """The mma's operand type: bf16 over a bf16 cache; f16 over an e4m3 one (the cache's
    values convert to f16 pairs in one instruction, and Q and P follow)."""
    return "f16" if cfg.cache_dtype == "e4m3" else "bf16"


def _query_fragments(k, cfg, p, ptrs, t) -> list:
    """Per k-step, the A fragment's a0 and a2 (row g: head g, zero past the group) as
    bf16 pairs of q times scale * log2(e); a1 and a3 (rows g + 8) are zero."""
    with k.stage("Q's A fragments: head g's permuted dimensions, scaled, in bf16"):
        scale, real = k.reg("f32", "scale_log2"), k.pred("real_head")
        k.ld_param(scale, p.scale_log2)
        k.setp("lt", real, t.row, cfg.group)
        at, wide = k.reg("u64", "q_at"), k.reg("u64", "q_row")
        k.cvt(wide, t.row, dtype="u64")
        k.mad(at, wide, ptrs.q_head_stride, ptrs.q, mode="lo", type="u64")
        packed, f32 = k.regs("b32", 4, "q_packed"), k.regs("f32", 8, "q_f32")
        steps = []
        for i in range(_chunks(cfg)):
            for word in packed:
                k.mov(word, 0)
            with k.guard(real):
                k.ld(packed, addr(at, i * CHUNK * 2), nc=True)
            base._unpack(k, f32, packed)
            for value in f32:
                k.mul(value, value, scale)
            for half in range(2):       # k-step 2i + half: dimensions 4 half + {0, 1}, {2, 3}
                a0, a2 = k.reg("b32", f"qa{i}_{half}_0"), k.reg("b32", f"qa{i}_{half}_2")
                pair = _operands(cfg) + "x2"
                k.cvt(a0, f32[4 * half + 1], f32[4 * half], dtype=pair, rnd="rn")
                k.cvt(a2, f32[4 * half + 3], f32[4 * half + 2], dtype=pair, rnd="rn")
                steps.append((a0, a2))
    return steps


def _state(k, cfg) -> SimpleNamespace:
    """Row g's running max and (this lane's part of the) sum, and O's fragments: for chunk
    i and movmatrix j, c0..c3 (c2, c3: rows g + 8, never read)."""
    state = SimpleNamespace(max=k.reg("f32", "m"), sum=k.reg("f32", "l"),
                            out=[[k.regs("f32", 4, f"o{i}_{j}_") for j in range(4)]
                                 for i in range(_chunks(cfg))])
    with k.stage("running max, sum and O"):
        _fresh(k, state)
    return state


def _fresh(k, state) -> None:
    k.mov(state.max, base.MAX_START)
    k.mov(state.sum, 0.0)
    for chunk in state.out:
        for frag in chunk:
            for r in frag:
                k.mov(r, 0.0)


def _tiles(k, cfg, t, ptrs, q, state) -> None:
    """The split's tokens, a tile of 16 a warp, the CTA's four warps 64 a step."""
    chunks = _chunks(cfg)
    zero = k.reg("b32", "zero")
    k.mov(zero, 0)
    token, valid = k.regs("u32", 2, "token"), [k.pred("valid_lo"), k.pred("valid_hi")]
    later, next_valid = k.reg("u32", "later"), [k.pred("next_lo"), k.pred("next_hi")]
    words = 4 if cfg.element_bytes == 2 else 2        # b32 words of a lane's 8 values
    keys = [[k.regs("b32", words, f"k{h}_{i}_") for i in range(chunks)] for h in range(2)]
    values = [[k.regs("b32", words, f"v{h}_{i}_") for i in range(chunks)] for h in range(2)]
    pairs = _Pairs(k, cfg)
    at = k.reg("u64", "row_at")
    page, next_page = ((k.reg("u32", "page"), k.reg("u32", "next_page")) if cfg.paged
                       else (None, None))
    scores = [k.regs("f32", 4, f"s{n}_") for n in range(2)]
    probs = [k.reg("b32", "p_lo"), k.reg("b32", "p_hi")]
    b0, b1 = k.reg("b32", "vb0"), k.reg("b32", "vb1")
    top, other, corr = k.reg("f32", "tile_max"), k.reg("f32", "quad"), k.reg("f32", "rescale")
    column, quad_column = k.reg("u32", "column"), k.reg("u32", "quad_column")
    masked = k.pred("masked")
    scale = k.reg("f32", "k_scale")
    v_scales = ([k.regs("f32", 2, f"v_scale{h}_") for h in range(2)]
                if cfg.cache_dtype == "e4m3" else None)
    first = k.reg("u32", "tile_first")
    k.mad(first, t.warp, TILE, ptrs.start, mode="lo")
    with k.loop(k.reg("u32", "tile_base"), ptrs.end, start=ptrs.start, step=WARPS * TILE,
                hint="tiles", uniform=True):
        with k.stage("load: tokens g and g + 8 of the tile, every chunk's k and v vector"):
            for h in range(2):
                k.add(token[h], first, t.row)
                if h:
                    k.add(token[h], token[h], 8)
                k.setp("lt", valid[h], token[h], ptrs.end)
                k.add(later, token[h], WARPS * TILE)
                k.setp("lt", next_valid[h], later, ptrs.end)
                if cfg.paged:
                    base._token_page(k, ptrs, token[h], valid[h], page)
                    base._token_page(k, ptrs, later, next_valid[h], next_page)
                for vectors, which in ((keys[h], "k"), (values[h], "v")):
                    base._row_at(k, cfg, ptrs, at, token[h], page, which)
                    for i, vec in enumerate(vectors):
                        for word in vec:
                            k.mov(word, 0)
                        with k.guard(valid[h]):
                            k.ld(vec, addr(at, i * CHUNK * cfg.element_bytes), nc=True,
                                 eviction="L1::no_allocate")
                    base._row_at(k, cfg, ptrs, at, later, next_page, which)
                    with k.guard(next_valid[h]):
                        k.prefetch(addr(at))
        with k.stage("S = Q K^T: two n-blocks of 8 tokens, D / 16 k-steps each"):
            for h in range(2):
                for s in scores[h]:
                    k.mov(s, 0.0)
                for i in range(chunks):
                    key = pairs.of(keys[h][i])
                    for half in range(2):
                        a0, a2 = q[2 * i + half]
                        k.mma_sync(scores[h], [a0, zero, a2, zero], key[2 * half:2 * half + 2],
                                   scores[h], ab_type=_operands(cfg))
        with k.stage("online softmax of row g: tokens past the end -inf, the tile's max "
                     "over the quad, one rescale, p = ex2(s - max)"):
            k.mad(quad_column, t.vector, 2, first, mode="lo")   # the tile's token 2 t
            for h in range(2):
                for c in range(2):     # score c of n-block h: token 8 h + 2 t + c
                    k.add(column, quad_column, 8 * h + c)
                    k.setp("ge", masked, column, ptrs.end)
                    if cfg.cache_dtype == "e4m3":   # the token's k scale; its v scale for P
                        _token_scale(k, ptrs.k_scale, ptrs, column, masked, scale)
                        k.mul(scores[h][c], scores[h][c], scale)
                        _token_scale(k, ptrs.v_scale, ptrs, column, masked, v_scales[h][c])
                    k.selp(scores[h][c], base.NO_SCORE, scores[h][c], masked)
            k.max(top, scores[0][0], scores[0][1])
            k.max(top, top, scores[1][0])
            k.max(top, top, scores[1][1])
            for mask in (1, 2):
                k.shfl_sync(other, top, mask, mode="bfly")
                k.max(top, top, other)
            k.max(top, top, state.max)
            k.sub(corr, state.max, top)
            k.ex2(corr, corr, ftz=True)
            k.mov(state.max, top)
            k.mul(state.sum, state.sum, corr)
            for h in range(2):
                for c in range(2):
                    k.sub(scores[h][c], scores[h][c], top)
                    k.ex2(scores[h][c], scores[h][c], ftz=True)
                    k.add(state.sum, state.sum, scores[h][c])
                    if cfg.cache_dtype == "e4m3":   # P x the v scales: V's e4m3 as it is
                        k.mul(scores[h][c], scores[h][c], v_scales[h][c])
                k.cvt(probs[h], scores[h][1], scores[h][0], dtype=_operands(cfg) + "x2",
                      rnd="rn")
            for chunk in state.out:
                for frag in chunk:
                    k.mul(frag[0], frag[0], corr)
                    k.mul(frag[1], frag[1], corr)
        with k.stage("O += P V: V's pairs transposed (movmatrix) into B fragments"):
            for i in range(chunks):
                lo, hi = pairs.of(values[0][i]), pairs.of(values[1][i], second=True)
                for j in range(4):
                    k.movmatrix(b0, lo[j])
                    k.movmatrix(b1, hi[j])
                    frag = state.out[i][j]
                    k.mma_sync(frag, [probs[0], zero, probs[1], zero], [b0, b1], frag,
                               ab_type=_operands(cfg))
        k.add(first, first, WARPS * TILE)
    with k.stage("row g's sum over its quad"):
        for mask in (1, 2):
            k.shfl_sync(other, state.sum, mask, mode="bfly")
            k.add(state.sum, state.sum, other)


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


def _token_scale(k, base_ptr, ptrs, token, masked, into) -> None:
    """The (token, KV head)'s f32 scale from the row at ``base_ptr``; 0 past the length."""
    at = k.reg("u64", "scale_at")
    k.mad(at, token, ptrs.scale_token, base_ptr, mode="wide")
    k.mov(into, 0.0)
    with k.guard(~masked):
        k.ld(into, addr(at), nc=True)


def _values(state) -> list:
    """Lane (g, t)'s O values in dimension order: chunk i's 32 i + 8 t + 0..7."""
    return [[frag[c] for frag in chunk for c in (0, 1)] for chunk in state.out]


def _fold(k, state, other_max, other_sum, other: list, scratch) -> None:
    """Fold another (max, sum, O values) of row g into the state."""
    top, mine, theirs = scratch
    k.max(top, state.max, other_max)
    k.sub(mine, state.max, top)
    k.ex2(mine, mine, ftz=True)
    k.sub(theirs, other_max, top)
    k.ex2(theirs, theirs, ftz=True)
    k.mov(state.max, top)
    k.mul(state.sum, state.sum, mine)
    k.fma(state.sum, other_sum, theirs, state.sum)
    for a, b in zip((v for chunk in _values(state) for v in chunk), other):
        k.mul(a, a, mine)
        k.fma(a, b, theirs, a)


class _WarpMerge:
    """Folds (max, sum, O) states of row g: another's registers into the state, and the
    CTA's warps' through shared memory into warp 0's."""

    def __init__(self, k, cfg, t):
        self.k, self.t, self.chunks = k, t, _chunks(cfg)
        self.other_max, self.other_sum = k.reg("f32", "o_max"), k.reg("f32", "o_sum")
        self.other = k.regs("f32", 8 * self.chunks, "o_val")
        self.scratch = k.regs("f32", 3, "merge")
        self.warp0 = k.pred("warp0")
        k.setp("eq", self.warp0, t.warp, 0)
        self.record = 8 * self.chunks * 4 + 16           # a lane's O values, then (max, sum)
        self.smem = k.shared("warps", WARPS * 32 * self.record)
        self.at, self.ml_at = k.reg("u32", "smem_at"), k.reg("u32", "smem_ml_at")

    def fold(self, state) -> None:
        _fold(self.k, state, self.other_max, self.other_sum, self.other, self.scratch)

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

    def warps(self, state) -> None:
        """Every thread arrives (a CTA barrier); warp 0 ends with the CTA's state."""
        k, at, record, chunks = self.k, self.at, self.record, self.chunks
        with k.stage("merge the warps: each lane writes, warp 0 folds the others in"):
            k.mov(at, self.smem)
            k.mad(at, self.t.tid, record, at, mode="lo")
            k.add(self.ml_at, at, 32 * chunks)
            for i, vals in enumerate(_values(state)):
                k.st(addr(at, 32 * i), vals[:4], space="shared")
                k.st(addr(at, 32 * i + 16), vals[4:], space="shared")
            k.st(addr(self.ml_at), [state.max, state.sum], space="shared")
            k.bar_sync(0)
            with k.if_(self.warp0, "warps_merged", uniform=True):
                for w in range(1, WARPS):
                    self.load("shared", at, self.ml_at, w * 32 * record)
                    self.fold(state)


def _finish(k, cfg, p, t, state) -> None:
    """The warps merged into warp 0; then the CUDA-core kernel's ending: out with one
    split, else the partial, the count, and the last split's merge (each warp folding
    every fourth split, then the warps merged again)."""
    real = k.pred("real_row")
    k.setp("lt", real, t.row, cfg.group)
    merge = _WarpMerge(k, cfg, t)
    merge.warps(state)
    last = k.pred("writes_out")
    k.setp("eq", last, t.splits, 1)
    with k.if_(~last, "partial_done", uniform=True):
        with k.if_(merge.warp0, "partial_stored", uniform=True):
            acc, ml = _partial_row(k, cfg, p, t, t.split, "mine_row")
            with k.guard(real):
                for i, vals in enumerate(_values(state)):
                    k.st(addr(acc, 4 * CHUNK * i), vals[:4])
                    k.st(addr(acc, 4 * CHUNK * i + 16), vals[4:])
                k.st(addr(ml), [state.max, state.sum])
        counter, thread0 = base.count_split(k, p, t, last)
        with k.if_(last, "merged", uniform=True):
            k.fence("acq_rel", "gpu")
            with k.stage("the last split: every split's partial, a warp's share each"):
                _fresh(k, state)
                with k.loop(k.reg("u32", "merged_split"), t.splits, start=t.warp, step=WARPS,
                            uniform=True, hint="splits") as s:
                    acc, ml = _partial_row(k, cfg, p, t, s, "split_row")
                    # written by other CTAs during this kernel: through L2
                    merge.load("global", acc, ml, cache="cg")
                    merge.fold(state)
            merge.warps(state)
            with k.guard(thread0):
                k.st(addr(counter), 0, type="u32")
    with k.if_(last, "written", uniform=True):
        with k.if_(merge.warp0, "out_stored", uniform=True):
            _store_out(k, cfg, p, t, state, real)


def _partial_row(k, cfg, p, t, split, name: str):
    """Split ``split``'s workspace for head g: its O (this lane's first dimension) and
    its (max, sum); past the group, head 0's (never stored to, read harmlessly)."""
    row, acc, ml = k.reg("u32", name), k.reg("u64", name + "_acc"), k.reg("u64", name + "_ml")
    head = k.reg("u32", name + "_head")
    k.min(head, t.row, cfg.group - 1)
    k.mad(row, t.pair, t.splits, split, mode="lo")
    k.mad(row, row, cfg.group, head, mode="lo")
    k.ld_param(acc, p.partial)
    k.mad(acc, row, cfg.head_dim * 4, acc, mode="wide")
    k.mad(acc, t.vector, 8 * 4, acc, mode="wide")
    k.ld_param(ml, p.partial_ml)
    k.mad(ml, row, 8, ml, mode="wide")
    return acc, ml


def _store_out(k, cfg, p, t, state, real) -> None:
    with k.stage("out: O / sum for head g (zeros for no tokens), rounded to bf16 once"):
        out, inv, positive = k.reg("u64", "out_at"), k.reg("f32", "inv_sum"), k.pred("any_token")
        row, scaled = k.reg("u32", "out_row"), k.regs("f32", 2, "o")
        packed = k.regs("b32", 4, "out")
        k.mad(row, t.pair, cfg.group, t.row, mode="lo")
        k.ld_param(out, p.out)
        k.mad(out, row, cfg.head_dim * 2, out, mode="wide")
        k.mad(out, t.vector, 16, out, mode="wide")
        k.setp("gt", positive, state.sum, 0.0)
        k.rcp(inv, state.sum)
        k.selp(inv, inv, 0.0, positive)
        for i, vals in enumerate(_values(state)):
            for w, word in enumerate(packed):
                k.mul(scaled[0], vals[2 * w], inv)
                k.mul(scaled[1], vals[2 * w + 1], inv)
                k.cvt(word, scaled[1], scaled[0], dtype="bf16x2", rnd="rn")
            with k.guard(real):
                k.st(addr(out, 2 * CHUNK * i), packed, type="b32")
