"""Per-block FP8 quantization of a bf16 weight [N, K]: one e4m3 scale per 128 x 128 block.

DeepGEMM's ``per_block_cast_to_fp8`` recipe: amax over the block (clamped to 1e-4),
``q = e4m3(x * (448 / amax))``, ``scale = amax / 448``; blocks at the edges take their
amax over the elements that exist.

One CTA of 256 threads per block. Threads 0-127 each copy one row of the block into
shared memory with the copy engine (a bulk copy of up to 256 bytes, all completing on one
mbarrier), so the whole 32 KiB block is in flight without holding registers. Thread ``t``
then owns the 16-byte column vector ``t % 16`` of rows ``t / 16 + 16 j`` (j < 8), read
from shared memory twice: for the amax (packed bf16x2 maxima, a warp butterfly, then a
max over the 8 warps through shared memory) and for the scaling pass.

Everything is run-time (N, K, the input row stride), so one kernel serves every shape.
Outputs: q e4m3 [N, K] contiguous, scales f32 [ceil(N/128), ceil(K/128)] with a run-time
row stride.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import Arch
from ..patterns import fp8, reduce
from ..patterns.pipeline import StageRing
from ..ptx import KernelBuilder, LaunchShape, addr, sreg

BLOCK = 128
VECTOR = 8              # bf16 per 16-byte vector
THREADS = 256
ROWS_PER_PASS = THREADS // (BLOCK // VECTOR)   # 16
PASSES = BLOCK // ROWS_PER_PASS                # 8


@dataclass(frozen=True)
class BlockQuantConfig:
    target: str
    threads: int = THREADS

    @property
    def name(self) -> str:
        return "bf16_quant_fp8_per_block_128x128"

    @property
    def dynamic_shared_bytes(self) -> int:
        """The block and its mbarrier: what the launch asks for."""
        return StageRing.shared_bytes(BLOCK * BLOCK * 2, 1)


def choose_config(arch: Arch) -> BlockQuantConfig:
    arch.require("fp8", "FP8 quantization")
    arch.require("mbarrier_tx", "per-block quantization's bulk copies")
    return BlockQuantConfig(arch.target)


def generate(cfg: BlockQuantConfig) -> KernelBuilder:
    k = KernelBuilder(cfg.name, target=cfg.target, max_threads=THREADS)
    k.launch = LaunchShape(block=THREADS, shared_bytes=cfg.dynamic_shared_bytes)
    x_param, x_stride_param = k.param("x", "u64"), k.param("x_row_stride", "u32")
    rows_param, cols_param = k.param("rows", "u32"), k.param("cols", "u32")
    q_param, s_param = k.param("q", "u64"), k.param("scales", "u64")
    s_stride_param = k.param("scale_row_stride", "u32")

    with k.stage("programmatic launch: the next kernel on the stream may start"):
        # Under a programmatic launch the next kernel may then be scheduled once every CTA
        # of this grid has started (its griddepcontrol.wait still waits for all of this
        # grid). A no-op otherwise.
        k.griddepcontrol_launch_dependents()
    with k.stage("coordinates: block origin, this thread's column and first row"):
        rows, cols = k.reg("u32", "rows"), k.reg("u32", "cols")
        k.ld_param(rows, rows_param)
        k.ld_param(cols, cols_param)
        tid, col, row = k.reg("u32", "tid"), k.reg("u32", "col"), k.reg("u32", "row")
        k.mov(tid, sreg.tid.x)
        k.and_(col, tid, BLOCK // VECTOR - 1)
        k.shr(row, tid, 4)
        block_col, block_row = k.reg("u32", "block_col"), k.reg("u32", "block_row")
        k.mov(block_col, sreg.ctaid.x)
        k.mov(block_row, sreg.ctaid.y)
        k.mad(col, col, VECTOR, 0, mode="lo")
        k.mad(col, block_col, BLOCK, col, mode="lo")
        k.mad(row, block_row, BLOCK, row, mode="lo")
        col_ok = k.pred("col_ok")
        k.setp("lt", col_ok, col, cols)
        ok = k.regs("pred", PASSES, "ok")
        row_j = k.reg("u32", "row_j")
        for j in range(PASSES):
            k.add(row_j, row, ROWS_PER_PASS * j)
            k.setp("lt", ok[j], row_j, rows)
            k.and_pred(ok[j], ok[j], col_ok)

    with k.stage("copy the block into shared memory: one bulk copy per row (threads 0-127)"):
        smem = k.dynamic_shared("block", align=128)
        base = k.reg("u32", "smem")
        k.mov(base, smem)
        stage = StageRing.packed(k, base, BLOCK * BLOCK * 2, 1)
        thread0 = k.pred("thread0")
        k.setp("eq", thread0, tid, 0)
        stage.init(thread0)
        # w may be the output of the kernel before this one, and every thread stores into
        # memory it may still read: all wait for it here, after the prologue.
        k.griddepcontrol_wait()
        bar = addr(base, stage.barrier_offset(0))
        rows_here, row_bytes = k.reg("u32", "rows_here"), k.reg("u32", "row_bytes")
        first_row, first_col = k.reg("u32", "first_row"), k.reg("u32", "first_col")
        k.mul(first_row, block_row, BLOCK, mode="lo")
        k.mul(first_col, block_col, BLOCK, mode="lo")
        k.sub(rows_here, rows, first_row)
        k.min(rows_here, rows_here, BLOCK)
        k.sub(row_bytes, cols, first_col)
        k.min(row_bytes, row_bytes, BLOCK)
        k.shl(row_bytes, row_bytes, 1)
        nbytes = k.reg("u32", "block_bytes")
        k.mul(nbytes, rows_here, row_bytes, mode="lo")
        with k.guard(thread0):
            k.mbarrier_arrive_expect_tx(bar, nbytes)
        copies_row = k.pred("copies_a_row")
        k.setp("lt", copies_row, tid, rows_here)
        with k.if_(copies_row, "row_copied"):
            x_ptr, stride = k.reg("u64", "x_ptr"), k.reg("u32", "x_stride_bytes")
            k.ld_param(x_ptr, x_param)
            k.ld_param(stride, x_stride_param)
            k.shl(stride, stride, 1)
            src_row = k.reg("u32", "src_row")
            k.add(src_row, first_row, tid)
            k.mad(x_ptr, src_row, stride, x_ptr, mode="wide")
            k.mad(x_ptr, first_col, 2, x_ptr, mode="wide")
            dst = k.reg("u32", "dst")
            k.mad(dst, tid, BLOCK * 2, base, mode="lo")
            k.cp_async_bulk_load(addr(dst), addr(x_ptr), row_bytes, bar)
        stage.wait(bar, 0)
        # This thread's vectors in the block: rows row_in_block + 16 j, column vector col % 16.
        src = k.reg("u32", "vectors")
        k.shr(src, tid, 4)
        k.mad(src, src, BLOCK * 2, base, mode="lo")
        vector = k.reg("u32", "vector_offset")
        k.and_(vector, tid, BLOCK // VECTOR - 1)
        k.mad(src, vector, VECTOR * 2, src, mode="lo")

        def read_vectors(j):
            """The thread's vector j from shared memory (zero outside the matrix)."""
            v = k.regs("b32", 4, f"x{j}_")
            for r in v:
                k.mov(r, 0)
            with k.guard(ok[j]):
                k.ld(v, addr(src, j * ROWS_PER_PASS * BLOCK * 2), space="shared")
            return v

    with k.stage("block amax: thread, warp butterfly, then the 8 warps through shared memory"):
        amax, tmp = k.reg("f32", "amax"), k.reg("f32", "shuffled")
        words = [word for j in range(PASSES) for word in read_vectors(j)]
        fp8.packed_amax(k, amax, words, k.reg("b32", "packed_max"), k.regs("f32", 2, "half"))
        reduce.butterfly_max(k, [amax], 32, [tmp])
        warp_max = k.shared("warp_amax", 4 * (THREADS // 32), align=16)
        lane, slot = k.reg("u32", "lane"), k.reg("u32", "slot")
        k.and_(lane, tid, 31)
        k.shr(slot, tid, 5)
        k.mul(slot, slot, 4, mode="lo")
        base = k.reg("u32", "warp_amax_base")
        k.mov(base, warp_max)
        k.add(slot, slot, base)
        lane0 = k.pred("lane0")
        k.setp("eq", lane0, lane, 0)
        with k.guard(lane0):
            k.st(addr(slot), amax, space="shared")
        k.bar_sync(0)
        partial = k.regs("f32", THREADS // 32, "warp_max")
        k.ld(partial[:4], addr(base), space="shared")
        k.ld(partial[4:], addr(base, 16), space="shared")
        for w in partial:
            k.max(amax, amax, w, nan=True)
        inv, scale = k.reg("f32", "inv_scale"), k.reg("f32", "scale")
        fp8.scale_from_amax(k, amax, inv, scale)

    with k.stage("store the block's scale (thread 0)"):
        s_ptr, s_stride, s_idx = k.reg("u64", "s_ptr"), k.reg("u32", "s_stride"), k.reg("u32", "s_idx")
        k.ld_param(s_ptr, s_param)
        k.ld_param(s_stride, s_stride_param)
        k.mad(s_idx, block_row, s_stride, block_col, mode="lo")
        k.mad(s_ptr, s_idx, 4, s_ptr, mode="wide")
        thread0 = k.pred("thread0")
        k.setp("eq", thread0, tid, 0)
        with k.guard(thread0):
            k.st(addr(s_ptr), scale)

    with k.stage("scale, convert to e4m3 and store"):
        q_ptr = k.reg("u64", "q_ptr")
        k.ld_param(q_ptr, q_param)
        k.mad(q_ptr, row, cols, q_ptr, mode="wide")
        k.mad(q_ptr, col, 1, q_ptr, mode="wide")
        q_step = k.reg("u64", "q_pass_step")
        k.mul(q_step, cols, ROWS_PER_PASS, mode="wide")
        vals = k.regs("f32", VECTOR, "v")
        packed = k.regs("b32", 2, "q")
        scratch = k.regs("b16", 2, "e4m3x2_")
        for j in range(PASSES):  # read again rather than keep 32 registers live
            for i, word in enumerate(read_vectors(j)):
                fp8.unpack_bf16x2(k, vals[2 * i], vals[2 * i + 1], word)
            for val in vals:
                k.mul(val, val, inv, rnd="rn")
            fp8.pack_e4m3x4(k, packed[0], vals[:4], scratch)
            fp8.pack_e4m3x4(k, packed[1], vals[4:], scratch)
            with k.guard(ok[j]):
                k.st(addr(q_ptr), packed, type="b32")
            if j + 1 < PASSES:
                k.add(q_ptr, q_ptr, q_step)
    return k
