"""The JIT's runtime on a real GPU: tensor maps passed by value, launches, errors."""

import pytest
import torch

from ptxforge import jit
from ptxforge.jit.driver import CudaError
from ptxforge.jit.tensormap import encode_tiled
from ptxforge.patterns.pipeline import StageRing
from ptxforge.ptx import KernelBuilder, addr, sreg

pytestmark = pytest.mark.gpu

ROWS, COLS, BOX_ROWS = 64, 32, 16  # f32: one 16 x 32 box (2 KiB) per CTA


def tma_tile_copy() -> KernelBuilder:
    """Each CTA loads one box through the tensor map into shared memory with TMA, then
    writes it out with ordinary stores."""
    k = KernelBuilder("tma_tile_copy", target="sm_90a", max_threads=128)
    tmap_param, out_param = k.tensormap_param("tmap"), k.param("out", "u64")
    tmap, out = k.reg("u64", "tmap_ptr"), k.reg("u64", "out")
    k.mov(tmap, tmap_param)
    k.cvta(tmap, tmap, space="param")
    k.ld_param(out, out_param)
    tid, cta, y = k.reg("u32", "t"), k.reg("u32", "cta"), k.reg("s32", "y")
    k.mov(tid, sreg.tid.x)
    k.mov(cta, sreg.ctaid.x)
    k.mul(y, cta, BOX_ROWS, mode="lo", type="s32")
    base = k.reg("u32", "smem")
    k.mov(base, k.dynamic_shared("tile", align=128))
    tile = StageRing(k, base, BOX_ROWS * COLS * 4, 1)
    thread0 = k.pred("thread0")
    k.setp("eq", thread0, tid, 0)
    tile.init(thread0)
    bar = addr(base, tile.barrier_offset(0))
    with k.guard(thread0):
        k.mbarrier_arrive_expect_tx(bar, BOX_ROWS * COLS * 4)
    with k.if_(thread0, "issued"):
        zero = k.reg("s32", "zero")
        k.mov(zero, 0)
        k.cp_async_bulk_tensor_load(addr(base), tmap, [zero, y], bar)
    tile.wait(bar, 0)
    v = k.regs("f32", 4, "v")
    src = k.reg("u32", "src")
    k.mad(src, tid, 16, base, mode="lo")
    k.ld(v, addr(src), space="shared")
    k.mad(out, cta, BOX_ROWS * COLS * 4, out, mode="wide")
    k.mad(out, tid, 16, out, mode="wide")
    k.st(addr(out), v)
    return k


def test_tensor_map_by_value_and_tma_load():
    x = torch.randn(ROWS, COLS, device="cuda")
    out = torch.full_like(x, float("nan"))
    blob = encode_tiled(x.data_ptr(), "float32", (COLS, ROWS), (COLS * 4,), (COLS, BOX_ROWS))
    assert len(blob) == 128
    assert encode_tiled(x.data_ptr(), "float32", (COLS, ROWS), (COLS * 4,), (COLS, BOX_ROWS)) is blob
    compiled = jit.build(tma_tile_copy())
    launch = compiled.load(0).launcher(128, StageRing.shared_bytes(BOX_ROWS * COLS * 4, 1))
    launch((ROWS // BOX_ROWS, 1, 1), torch.cuda.current_stream().cuda_stream, (blob, out.data_ptr()))
    torch.cuda.synchronize()
    assert torch.equal(out, x)


def test_tensor_map_rejects_misaligned_strides():
    x = torch.randn(8, 9, device="cuda")
    with pytest.raises(ValueError, match="16-byte multiple strides"):
        encode_tiled(x.data_ptr(), "float32", (9, 8), (36,), (8, 8))


def test_large_dynamic_shared_memory_and_launch_errors():
    compiled = jit.build(tma_tile_copy())
    module = compiled.load(0)
    module.launcher(128, 200 * 1024)  # above 48 KiB: the function's limit is raised
    with pytest.raises(CudaError, match="launch of tma_tile_copy"):
        too_many_threads = module.launcher(2048)
        too_many_threads((1, 1, 1), torch.cuda.current_stream().cuda_stream, (bytes(128), 0))
