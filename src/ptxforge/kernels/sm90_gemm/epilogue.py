"""Epilogues: what a math warpgroup does with its 64 x block_n slice of a finished tile.

Every epilogue goes through shared memory and TMA. The D tile is a row of store boxes,
each block_m rows x d_box_cols columns in the box row's swizzle (conflict-free stores),
the warpgroup's 64 rows at ``d_smem`` within each. Per tile: wait until the previous TMA
store has read the tile, write the accumulators into it, fence, then one thread issues a
TMA store (or reduction) per box, clipped at the matrix edges, which runs while the
warpgroup starts its next tile.

A thread holds column pairs: in each 8-column group, the pair at columns 2 * (lane % 4),
of rows row_in_wg and row_in_wg + 8 (accumulators 4 * group + 2 * half, + 1). A variant
overrides what is written for a pair (``write``), what it needs per tile (``start_tile``)
and per column group (``start_group``), and its element type:

    Bf16Store            bf16 D = the accumulators, rounded
    F32ReduceAdd         f32 D += the accumulators (TMA reduce-add: d = c + a.b^T)
    GroupRowsBf16Store   bf16 store; rows whose m_indices name another group are zeros
    BiasBf16Store        bf16 D = the accumulators + bias[column]
"""

from __future__ import annotations

from ...ptx import addr


class Epilogue:
    element = "bfloat16"   # D's dtype (torch's name, as the tensor map takes it)
    element_bytes = 2
    reduce = False         # add into D (TMA reduce-add) instead of storing
    registers = 0          # what it keeps in a math thread through the K loop (make_config)

    @staticmethod
    def declare_params(k, params) -> None:
        """Kernel parameters this epilogue reads, declared after the GEMM's own."""

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
            with k.if_(self.leader, "stored"):
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
    def write(self, where, pair, half: int) -> None:
        k = self.k
        k.cvt(self.packed, pair[1], pair[0], dtype="bf16x2", rnd="rn")
        k.st(where, self.packed, space="shared", type="b32")


class F32ReduceAdd(Epilogue):
    element, element_bytes, reduce = "float32", 4, True

    def write(self, where, pair, half: int) -> None:
        self.k.st(where, pair, space="shared")


class GroupRowsBf16Store(Bf16Store):
    """MoE, contiguous layout: a tile reads the B of its first row's group; each of the
    thread's two rows that lies outside M or whose m_indices names another group (padding,
    a segment not aligned to the tile) is written as zeros."""

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


class BiasBf16Store(Bf16Store):
    """bf16 D = the accumulators + bias, bias a bf16 [N] vector (a parameter: its address).
    Each thread reads the bias pair of its columns once per 8-column group (one 4-byte
    load, from L2 after the first tile), and none past N."""

    registers = 8          # the bias base and pointer, columns left, the pair, its two f32

    @staticmethod
    def declare_params(k, params) -> None:
        params.bias = k.param("bias", "u64")

    def __init__(self, k, cfg, params, thread, base):
        super().__init__(k, cfg, params, thread, base)
        self.bias_base = k.reg("u64", "bias_base")
        k.ld_param(self.bias_base, params.bias)
        self.bias_at, self.columns_left = k.reg("u64", "bias_at"), k.reg("u32", "columns_left")
        self.pair, self.inside = k.reg("b32", "bias_pair"), k.pred("bias_inside")
        self.bias, self.biased = k.regs("f32", 2, "bias"), k.regs("f32", 2, "biased")

    def start_tile(self, tiles) -> None:
        """The thread's first bias pair (column n0 + 2 * (lane % 4)) and the columns left
        in D from n0."""
        k, cfg = self.k, self.cfg
        column = k.reg("u32", "bias_column")
        k.mul(self.columns_left, tiles.n_block, cfg.block_n, mode="lo")
        k.and_(column, self.thread.lane, 3)
        k.mad(column, column, 2, self.columns_left, mode="lo")
        k.mad(self.bias_at, column, 2, self.bias_base, mode="wide")
        k.sub(self.columns_left, cfg.n, self.columns_left)

    def start_group(self, group: int) -> None:
        """Load the group's bias pair (zero past N: N is a multiple of 8, so a group lies
        wholly inside or outside D) and widen it: a bf16 is the upper half of an f32."""
        k = self.k
        k.setp("gt", self.inside, self.columns_left, 8 * group, type="u32")
        k.mov(self.pair, 0)
        with k.guard(self.inside):
            k.ld(self.pair, addr(self.bias_at, 16 * group), nc=True)
        k.shl(self.bias[0], self.pair, 16, type="b32")
        k.and_(self.bias[1], self.pair, 0xFFFF0000, type="b32")

    def write(self, where, pair, half: int) -> None:
        for biased, value, bias in zip(self.biased, pair, self.bias):
            self.k.add(biased, value, bias)  # not into the accumulators: they stay a.b^T
        super().write(where, self.biased, half)


def epilogue_for(cfg) -> type[Epilogue]:
    """The epilogue a config asks for."""
    if cfg.accumulate:
        return F32ReduceAdd
    if cfg.bias:
        return BiasBf16Store
    if cfg.groups and not cfg.masked:
        return GroupRowsBf16Store
    return Bf16Store
