"""Epilogues: what a math warpgroup does with its 64 x block_n slice of a finished tile.

Every epilogue goes through shared memory and TMA. The D tile is a row of store boxes,
each block_m rows x d_box_cols columns in the box row's swizzle (conflict-free stores),
the warpgroup's 64 rows at ``d_smem`` within each. Per tile: wait until the previous TMA
store has read the tile, write the accumulators into it, fence, then one thread issues a
TMA store (or reduction) per box, clipped at the matrix edges, which runs while the
warpgroup starts its next tile.

A thread holds column pairs: in each 8-column group, the pair at columns 2 * (lane % 4),
of rows row_in_wg and row_in_wg + 8 (accumulators 4 * group + 2 * half, + 1). A variant
overrides what is written for a pair (``write``), what it needs per tile (``start_tile``,
before the K loop; or, wrapping ``store``, after it) and per column group
(``start_group``), the kernel parameters it reads (``declare_params``), and its element
type.

A variant registers itself for the problem's epilogue terms it computes (``terms``,
kernels/gemm.py) on the layouts it serves (``layouts``); ``epilogue_for`` looks the
problem up, so a new epilogue is one class here:

    class               terms                layouts          D =
    Bf16Store           -                    dense, masked    the accumulators, rounded
    GroupRowsBf16Store  -                    contiguous       the same; rows whose m_indices
                                                              name another group are zeros
    F32ReduceAdd        accumulate           dense            D + the accumulators (f32,
                                                              TMA reduce-add: d = c + a.b^T)
    BiasBf16Store       bias                 dense            the accumulators + bias[column]
    ResidualBf16Store   residual             dense            the accumulators +
                                                              residual[row, column] (D itself
                                                              or another matrix)
    BiasResidualBf16Store  bias, residual    dense            the accumulators + bias[column]
                                                              + residual[row, column]
    ScaleBf16Store      scale                dense            alpha * the accumulators

The bias and residual variants add in f32 before the one rounding to bf16; they share
AddendBf16Store's column guard and compose by cooperative inheritance (each ``write`` adds
its own, then hands the sum to the next class's).
"""

from __future__ import annotations

from ...ptx import addr


# (terms, layout) -> the epilogue computing them: filled as the classes below are defined.
_REGISTERED: dict[tuple[tuple[str, ...], str], type["Epilogue"]] = {}


def epilogue_for(problem) -> type["Epilogue"]:
    """The epilogue registered for the problem's terms and layout; a ValueError naming
    what exists where none is."""
    found = _REGISTERED.get((problem.epilogue, problem.layout))
    if found is None:
        layouts = {}
        for terms, layout in _REGISTERED:
            layouts.setdefault(terms, []).append(layout)
        known = "; ".join(f"{' + '.join(terms) or 'a plain store'} ({', '.join(where)})"
                          for terms, where in layouts.items())
        asked = " + ".join(problem.epilogue) or "a plain store"
        raise ValueError(f"no GEMM epilogue computes {asked} on the {problem.layout} layout; "
                         f"there are: {known}")
    return found


class Epilogue:
    element = "bfloat16"   # D's dtype (torch's name, as the tensor map takes it)
    element_bytes = 2
    reduce = False         # add into D (TMA reduce-add) instead of storing
    registers = 0          # what it keeps in a math thread through the K loop (make_config)
    # The problem's epilogue terms this class computes, in alphabetical order,
    # and the layouts it serves. A class that sets ``terms`` itself is registered for them;
    # one that does not (a base of others) is not.
    terms: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ("dense",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "terms" not in cls.__dict__:
            return
        for layout in cls.layouts:
            taken = _REGISTERED.setdefault((cls.terms, layout), cls)
            if taken is not cls:
                raise TypeError(f"{cls.__name__} and {taken.__name__} both compute "
                                f"{cls.terms} on the {layout} layout")

    @classmethod
    def declare_params(cls, k, params) -> None:
        """Kernel parameters this epilogue reads, declared after the GEMM's own (a variant
        declares its own after calling super(), so that composed ones declare all)."""

    def __init__(self, k, cfg, params, thread, base):
        """Set-up once per kernel: the warpgroup's slice of the D tile, its leader thread
        and named barrier, the D tensor map."""
        self.k, self.cfg, self.thread = k, cfg, thread
        self.d_smem = k.reg("u32", "d_smem")
        k.mad(self.d_smem, thread.wg, 64 * cfg.d_box_cols * cfg.d_element_bytes, base, mode="lo")
        k.add(self.d_smem, self.d_smem, cfg.d_offset)
        self.leader = k.pred("wg_leader")
        wg_thread = k.reg("u32", "wg_thread")
        k.and_(wg_thread, thread.tid, 127)
        k.setp("eq", self.leader, wg_thread, 0)
        self.barrier = k.reg("u32", "wg_barrier")  # named barriers 1 and 2, one per warpgroup
        k.add(self.barrier, thread.wg, 1)
        self.tmap_d = k.reg("u64", "tmap_d_ptr")
        k.mov(self.tmap_d, params.tmap_d)
        k.cvta(self.tmap_d, self.tmap_d, space="param")
        self.packed = k.reg("b32", "packed")

    def start_tile(self, tiles) -> None:
        """Before the tile's K loop (its coordinates and group known)."""

    def start_group(self, group: int) -> None:
        """Before the pairs of 8-column group ``group`` are written."""

    def write(self, where, pair, half: int) -> None:
        """Write the accumulator pair ``pair`` (of row row_in_wg + 8 * half) at ``where``."""
        raise NotImplementedError

    def store(self, tiles, acc) -> None:
        """The warpgroup's slice of the tile, through shared memory, out by TMA."""
        k, cfg, thread = self.k, self.cfg, self.thread
        cols, size = cfg.d_box_cols, cfg.d_element_bytes
        row_bytes = cols * size
        chunks = row_bytes // 16                # 16-byte chunks in a box row: 8, 4, 2 or 1
        group_chunks = 8 * size // 16           # chunks an 8-column group spans: 1 (bf16), 2 (f32)
        box_bytes = cfg.block_m * row_bytes
        with k.stage("epilogue: wait for the previous store to have read the D tile"):
            with k.guard(self.leader):
                k.cp_async_bulk_wait_group(0, read=True)
            k.bar_sync(self.barrier, 128)
        with k.stage("epilogue: the accumulators into the swizzled D tile"):
            # TMA's swizzle of row_bytes-byte rows: chunk c of row r sits at chunk
            # c ^ (r / (8 / chunks)) % chunks (the pattern repeats every 8 rows of 128
            # bytes). The thread's pair is byte (lane % 4) * 2 * size of its group.
            row = k.reg("u32", "d_row")
            rows = k.regs("u32", 2, "d_row_base")
            swz = k.regs("u32", 2, "d_swizzle")
            pair, pair_chunk = k.reg("u32", "d_pair"), k.reg("u32", "d_pair_chunk")
            k.and_(pair, thread.lane, 3)
            k.mul(pair, pair, 2 * size, mode="lo")
            if group_chunks > 1:
                k.shr(pair_chunk, pair, 4)          # the chunk of the group it lies in
                k.and_(pair, pair, 15)              # its byte in that chunk
            for half in range(2):  # rows of the warpgroup's slice: d_smem is at its row 0
                k.add(row, thread.row_in_wg, 8 * half)
                if chunks > 1:
                    k.shr(swz[half], row, (8 // chunks).bit_length() - 1)
                    k.and_(swz[half], swz[half], chunks - 1)
                    if group_chunks > 1:
                        k.xor(swz[half], swz[half], pair_chunk)
                k.mad(rows[half], row, row_bytes, self.d_smem, mode="lo")
                k.add(rows[half], rows[half], pair)
            at, chunk = k.reg("u32", "d_at"), k.reg("u32", "d_chunk")
            for group in range(cfg.block_n // 8):
                self.start_group(group)
                box, group_in_box = divmod(group, cols // 8)
                for half in range(2):
                    i = 4 * group + 2 * half
                    if chunks > 1:
                        k.xor(chunk, swz[half], group_in_box * group_chunks)
                        k.mad(at, chunk, 16, rows[half], mode="lo")
                        where = addr(at, box * box_bytes)
                    else:
                        where = addr(rows[half], box * box_bytes)
                    self.write(where, acc[i:i + 2], half)
            k.fence_proxy_async()  # the TMA store reads what these ordinary stores wrote
            k.bar_sync(self.barrier, 128)
        with k.stage("epilogue: one thread stores the slice with TMA (clipped at the edges)"):
            storer = self.leader
            if tiles.repeat is not None:   # the peer's tile, computed for its B: not stored
                storer = k.pred("stores_tile")
                k.not_(storer, tiles.repeat)
                k.and_pred(storer, storer, self.leader)
            with k.if_(storer, "stored"):
                x, y = k.reg("s32", "d_x"), k.reg("s32", "d_y")
                k.mul(y, tiles.m_block, cfg.rows, mode="lo", type="s32")
                k.mad(y, thread.wg, 64, y, mode="lo", type="s32")
                src = k.reg("u32", "d_src")
                for box in range(cfg.block_n // cols):
                    k.mad(x, tiles.n_block, cfg.block_n, box * cols, mode="lo", type="s32")
                    k.add(src, self.d_smem, box * box_bytes)
                    coords = [x, y, *tiles.extra_coordinates]
                    if self.reduce:
                        k.cp_reduce_async_bulk_tensor(self.tmap_d, coords, addr(src), op="add")
                    else:
                        k.cp_async_bulk_tensor_store(self.tmap_d, coords, addr(src))
                k.cp_async_bulk_commit_group()

    def drain(self) -> None:
        """The last TMA stores complete before the CTA exits."""
        with self.k.guard(self.leader):
            self.k.cp_async_bulk_wait_group(0)


class Bf16Store(Epilogue):
    terms, layouts = (), ("dense", "masked")

    def write(self, where, pair, half: int) -> None:
        k = self.k
        k.cvt(self.packed, pair[1], pair[0], dtype="bf16x2", rnd="rn")
        k.st(where, self.packed, space="shared", type="b32")


class F32ReduceAdd(Epilogue):
    terms = ("accumulate",)
    element, element_bytes, reduce = "float32", 4, True

    def write(self, where, pair, half: int) -> None:
        self.k.st(where, pair, space="shared")


class GroupRowsBf16Store(Bf16Store):
    """MoE, contiguous layout: a tile reads the B of its first row's group; each of the
    thread's two rows that lies outside M or whose m_indices names another group (padding,
    a segment not aligned to the tile) is written as zeros."""

    terms, layouts = (), ("contiguous",)

    def __init__(self, k, cfg, params, thread, base):
        super().__init__(k, cfg, params, thread, base)
        self.m_rows = k.reg("u32", "m_rows")
        k.ld_param(self.m_rows, params.m_rows)
        self.valid = [k.pred("row_valid"), k.pred("row8_valid")]

    def start_tile(self, tiles) -> None:
        k = self.k
        at, row, index = k.reg("u64", "row_at"), k.reg("u32", "group_row"), k.reg("s32", "row_group")
        for half, valid in enumerate(self.valid):
            k.mad(row, tiles.m_block, self.cfg.rows, self.thread.row_in_tile, mode="lo")
            if half:
                k.add(row, row, 8)
            k.setp("lt", valid, row, self.m_rows, type="u32")
            k.mov(index, -1)
            with k.guard(valid):
                k.mad(at, row, 4, tiles.m_indices, mode="wide")
                k.ld(index, addr(at), nc=True)
            k.setp("eq", valid, index, tiles.group, type="s32")

    def write(self, where, pair, half: int) -> None:
        k = self.k
        k.cvt(self.packed, pair[1], pair[0], dtype="bf16x2", rnd="rn")
        k.selp(self.packed, self.packed, 0, self.valid[half], type="b32")
        k.st(where, self.packed, space="shared", type="b32")


def _widen(k, wide, pair) -> None:
    """The two f32 of a bf16 pair (two instructions): a bf16 is the upper half of an f32."""
    k.shl(wide[0], pair, 16, type="b32")
    k.and_(wide[1], pair, 0xFFFF0000, type="b32")


class AddendBf16Store(Bf16Store):
    """What the bf16 stores that add bf16 values from global memory to the accumulators
    (the bias, the residual) share: the guard of each 8-column group against N (a multiple
    of 8, so a group lies wholly inside or outside D: none of its columns is read past N),
    worked out once per group however many addends read it. Dense GEMMs only."""

    layouts = ("dense",)

    def __init__(self, k, cfg, params, thread, base):
        super().__init__(k, cfg, params, thread, base)
        self.columns_left, self.inside = k.reg("u32", "columns_left"), k.pred("group_inside")

    def store(self, tiles, acc) -> None:
        """The columns left in D from the tile's first: after the K loop, held through it
        by no register."""
        k = self.k
        k.mul(self.columns_left, tiles.n_block, self.cfg.block_n, mode="lo")
        k.sub(self.columns_left, self.cfg.n, self.columns_left)
        super().store(tiles, acc)

    def thread_column(self, tiles, column) -> None:
        """``column`` = the first of the thread's column pair in the tile's first group:
        n0 + 2 * (lane % 4) (three instructions)."""
        k = self.k
        k.and_(column, self.thread.lane, 3)
        k.shl(column, column, 1)
        k.mad(column, tiles.n_block, self.cfg.block_n, column, mode="lo")

    def start_group(self, group: int) -> None:
        super().start_group(group)
        self.k.setp("gt", self.inside, self.columns_left, 8 * group, type="u32")


class BiasBf16Store(AddendBf16Store):
    """bf16 D = the accumulators + bias, bias a bf16 [N] vector (a parameter: its address).
    Each thread reads the bias pair of its columns once per 8-column group (one 4-byte
    load, from L2 after the first tile)."""

    terms = ("bias",)
    registers = 8          # the bias base and pointer, columns left, the pair, its two f32

    @classmethod
    def declare_params(cls, k, params) -> None:
        super().declare_params(k, params)
        params.bias = k.param("bias", "u64")

    def __init__(self, k, cfg, params, thread, base):
        super().__init__(k, cfg, params, thread, base)
        self.bias_base = k.reg("u64", "bias_base")
        k.ld_param(self.bias_base, params.bias)
        self.bias_at, self.pair = k.reg("u64", "bias_at"), k.reg("b32", "bias_pair")
        self.bias, self.biased = k.regs("f32", 2, "bias"), k.regs("f32", 2, "biased")

    def start_tile(self, tiles) -> None:
        """The thread's first bias pair."""
        super().start_tile(tiles)
        column = self.k.reg("u32", "bias_column")
        self.thread_column(tiles, column)
        self.k.mad(self.bias_at, column, 2, self.bias_base, mode="wide")

    def start_group(self, group: int) -> None:
        """Load the group's bias pair (zero past N) and widen it."""
        k = self.k
        super().start_group(group)
        k.mov(self.pair, 0)
        with k.guard(self.inside):
            k.ld(self.pair, addr(self.bias_at, 16 * group), nc=True)
        _widen(k, self.bias, self.pair)

    def write(self, where, pair, half: int) -> None:
        for biased, value, bias in zip(self.biased, pair, self.bias):
            self.k.add(biased, value, bias)  # not into the accumulators: they stay a.b^T
        super().write(where, self.biased, half)


class ResidualBf16Store(AddendBf16Store):
    """bf16 D = the accumulators + residual, residual a bf16 [M, N] matrix with unit column
    stride (parameters: its address, its row stride in elements, and M). Per 8-column
    group each thread reads the residual pair of its columns in each of its two rows (a
    4-byte load), none in a row past M, past the tile's rows (a few-token tile's 64-row
    wgmma covers the next tile's rows too) or in a group past N.

    The residual may be D itself: each element is read by the one thread that writes it,
    whose load has returned before the sum goes to shared memory, from where the TMA store
    takes it only after the warpgroup's barrier; no two tiles share an element, so no
    element is read after the kernel has written it. It is read with an ordinary load, not
    through the read-only path (.nc), for that reason (the kernel writes D); each element
    is read once, so that path would save nothing."""

    terms = ("residual",)

    # None through the K loop: the parameters are read, and the rows' pointers worked out,
    # after it (ptxas reads the parameters from the constant bank there). The pointers,
    # pairs and their f32 live in the epilogue only, beside the accumulators (ptxas issues
    # all of a tile's residual loads at once there, where the registers allow). With this
    # count every tile make_config admits with a residual, with and without the bias,
    # assembles without spills (a sweep of all of them, ptxas 13.0).
    registers = 0

    @classmethod
    def declare_params(cls, k, params) -> None:
        super().declare_params(k, params)
        params.residual = k.param("residual", "u64")
        params.residual_row_stride = k.param("residual_row_stride", "u32")   # in elements
        params.m_rows = k.param("m_rows", "u32")                              # M

    def __init__(self, k, cfg, params, thread, base):
        super().__init__(k, cfg, params, thread, base)
        self.params = params
        self.residual_at = k.regs("u64", 2, "residual_at")
        self.row_inside = [k.pred("residual_row_inside"), k.pred("residual_row8_inside")]
        self.load = k.pred("residual_load")
        self.pairs = k.regs("b32", 2, "residual_pair")
        self.residual = [k.regs("f32", 2, "residual"), k.regs("f32", 2, "residual8_")]
        self.summed = k.regs("f32", 2, "residual_sum")

    def _tile_rows(self, tiles, m0, rows, base, row_bytes) -> None:
        """Where the tile's residual rows are: its first row ``m0``, the ``rows`` of it that
        lie in D (inside M and the tile), the residual's address and row stride in bytes."""
        k, params = self.k, self.params
        k.ld_param(base, params.residual)
        k.ld_param(row_bytes, params.residual_row_stride)
        k.shl(row_bytes, row_bytes, 1)
        k.ld_param(rows, params.m_rows)
        k.mul(m0, tiles.m_block, self.cfg.rows, mode="lo")
        k.sub(rows, rows, m0)                                    # rows of D from m0 ...
        k.min(rows, rows, self.cfg.rows)                         # ... and of the tile

    def start_tile(self, tiles) -> None:
        """Pull the tile's residual rows into L2 before the K loop, so the epilogue's loads
        find them there instead of waiting on memory after it (a large GEMM's residual read
        from memory in the epilogue measured 30-58 us over the plain GEMM, nothing else
        running beside it). Two threads per row of the warpgroup's: thread t takes row t / 2
        and every other 128-byte line of it from the (t % 2)-th (the addresses clamped to
        the row's last element inside D, so the line the row ends in is taken and none past
        N; the residual's rows are only 4-byte aligned, so no bulk prefetch)."""
        super().start_tile(tiles)
        k, cfg, thread = self.k, self.cfg, self.thread
        row_bytes = 2 * cfg.block_n
        probes = -(-row_bytes // 128) + 1     # lines a row can touch, unaligned
        with k.stage("tile start: the residual tile's rows into L2"):
            t, row, limit, last, line, stride, offset = (
                k.reg("u32", name) for name in ("prefetch_thread", "prefetch_row", "prefetch_rows",
                                                "prefetch_last", "prefetch_line",
                                                "prefetch_row_bytes", "prefetch_offset"))
            base, at, probe = (k.reg("u64", name) for name in ("prefetch_base", "prefetch_at",
                                                                "prefetch_probe"))
            inside = k.pred("prefetch_row_inside")
            k.and_(t, thread.tid, 127)
            k.shr(row, t, 1)
            k.mad(row, thread.wg, 64, row, mode="lo")                # row in the tile
            self._tile_rows(tiles, line, limit, base, stride)         # line: m0
            k.setp("lt", inside, row, limit, type="u32")
            k.add(row, row, line)
            k.mad(at, row, stride, base, mode="wide")
            k.mul(line, tiles.n_block, cfg.block_n, mode="lo")       # n0
            k.mad(at, line, 2, at, mode="wide")
            k.sub(last, cfg.n, line)                                  # columns of D from n0,
            k.min(last, last, cfg.block_n)                            # of the tile,
            k.shl(last, last, 1)
            k.sub(last, last, 2)                                      # as its last pair's byte
            k.and_(line, t, 1)
            k.shl(line, line, 7)                                      # this thread's first line
            with k.guard(inside):
                for _ in range(-(-probes // 2)):
                    k.min(offset, line, last)
                    k.mad(probe, offset, 1, at, mode="wide")
                    k.prefetch(addr(probe), level="L2")
                    k.add(line, line, 256)

    def store(self, tiles, acc) -> None:
        """Where the thread's residual pairs of its first group start, in its two rows, and
        which rows lie in D (inside M and the tile's rows): worked out after the K loop, so
        that none of it holds registers through it."""
        k, thread = self.k, self.thread
        with k.stage("epilogue: the thread's residual rows, and which of them lie inside D"):
            base, row_bytes = k.reg("u64", "residual_base"), k.reg("u32", "residual_row_bytes")
            row, limit = k.reg("u32", "residual_row"), k.reg("u32", "residual_rows")
            column = k.reg("u32", "residual_column")
            self._tile_rows(tiles, row, limit, base, row_bytes)     # row: m0
            k.add(row, row, thread.row_in_tile)
            k.mad(self.residual_at[0], row, row_bytes, base, mode="wide")
            self.thread_column(tiles, column)
            k.mad(self.residual_at[0], column, 2, self.residual_at[0], mode="wide")
            k.mad(self.residual_at[1], row_bytes, 8, self.residual_at[0], mode="wide")
            k.setp("lt", self.row_inside[0], thread.row_in_tile, limit, type="u32")
            k.add(row, thread.row_in_tile, 8)
            k.setp("lt", self.row_inside[1], row, limit, type="u32")
        super().store(tiles, acc)

    def start_group(self, group: int) -> None:
        """Load the group's residual pair of each of the thread's rows (zero outside D)
        and widen them."""
        k = self.k
        super().start_group(group)
        for half in range(2):
            k.and_pred(self.load, self.row_inside[half], self.inside)
            k.mov(self.pairs[half], 0)
            with k.guard(self.load):
                k.ld(self.pairs[half], addr(self.residual_at[half], 16 * group))
            _widen(k, self.residual[half], self.pairs[half])

    def write(self, where, pair, half: int) -> None:
        for summed, value, residual in zip(self.summed, pair, self.residual[half]):
            self.k.add(summed, value, residual)
        super().write(where, self.summed, half)


class BiasResidualBf16Store(BiasBf16Store, ResidualBf16Store):
    """bf16 D = (the accumulators + bias) + residual: the two above composed (each write
    adds its own and hands the sum on, the bias first), one column guard for both."""

    terms = ("bias", "residual")
    registers = BiasBf16Store.registers + ResidualBf16Store.registers


class ScaleBf16Store(Bf16Store):
    """bf16 D = alpha * the accumulators, alpha an f32 kernel parameter (set at each
    launch): a product of operands quantized with one scale per tensor comes out
    dequantized, in the one rounding to bf16."""

    terms, layouts = ("scale",), ("dense",)
    registers = 1          # alpha

    @classmethod
    def declare_params(cls, k, params) -> None:
        super().declare_params(k, params)
        params.alpha = k.param("alpha", "f32")

    def __init__(self, k, cfg, params, thread, base):
        super().__init__(k, cfg, params, thread, base)
        self.alpha = k.reg("f32", "alpha")
        k.ld_param(self.alpha, params.alpha)
        self.scaled = k.regs("f32", 2, "scaled")

    def write(self, where, pair, half: int) -> None:
        for scaled, value in zip(self.scaled, pair):
            self.k.mul(scaled, value, self.alpha)   # not into the accumulators
        super().write(where, self.scaled, half)
