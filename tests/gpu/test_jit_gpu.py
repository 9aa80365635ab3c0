"""The JIT's runtime on a real GPU: tensor maps passed by value, launches, errors."""

from pathlib import Path

import pytest
import torch

from ptxforge import jit
from ptxforge.runtime import CudaError, encode_tiled
from ptxforge.patterns.pipeline import StageRing
from ptxforge.ptx import KernelBuilder, LaunchShape, addr, sreg

pytestmark = pytest.mark.gpu

ROWS, COLS, BOX_ROWS = 64, 32, 16  # f32: one 16 x 32 box (2 KiB) per CTA


def tma_tile_copy() -> KernelBuilder:
    """Each CTA loads one box through the tensor map into shared memory with TMA, then
    writes it out with ordinary stores."""
    k = KernelBuilder("tma_tile_copy", target="sm_90a", max_threads=128)
    k.launch = LaunchShape(128, StageRing.shared_bytes(BOX_ROWS * COLS * 4, 1))
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
    tile = StageRing.packed(k, base, BOX_ROWS * COLS * 4, 1)
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
    launch = compiled.launcher(0)
    launch((ROWS // BOX_ROWS, 1, 1), torch.cuda.current_stream().cuda_stream, tmap=blob,
           out=out.data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(out, x)


def test_tensor_map_rejects_misaligned_strides():
    x = torch.randn(8, 9, device="cuda")
    with pytest.raises(ValueError, match="16-byte multiple strides"):
        encode_tiled(x.data_ptr(), "float32", (9, 8), (36,), (8, 8))


def test_large_dynamic_shared_memory_and_launch_errors():
    compiled = jit.build(tma_tile_copy())
    module = compiled.load(0)
    module.launcher(LaunchShape(128, 200 * 1024))  # above 48 KiB: the limit is raised
    with pytest.raises(CudaError, match="launch of tma_tile_copy"):
        too_many_threads = module.launcher(LaunchShape(2048))
        too_many_threads((1, 1, 1), torch.cuda.current_stream().cuda_stream, tmap=bytes(128),
                         out=0)


def store_value(name: str, shape: LaunchShape) -> KernelBuilder:
    """out[cta] = value, after griddepcontrol.wait: under a programmatic launch the CTAs may
    start early, but not store before the grid before them finished."""
    k = KernelBuilder(name, target="sm_90a", max_threads=shape.block)
    k.launch = shape
    out_param, value_param = k.param("out", "u64"), k.param("value", "u32")
    out, value, cta = k.reg("u64", "out"), k.reg("u32", "value"), k.reg("u32", "cta")
    k.ld_param(out, out_param)
    k.ld_param(value, value_param)
    k.mov(cta, sreg.ctaid.x)
    k.mad(out, cta, 4, out, mode="wide")
    k.griddepcontrol_wait()
    k.st(addr(out), value)
    return k


def test_programmatic_and_cooperative_launches():
    """The launch attributes reach the driver: a cooperative grid larger than can be
    resident is refused, one that fits runs; a programmatic launch after a plain one on the
    same stream leaves the later value."""
    stream = torch.cuda.current_stream().cuda_stream
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(sms, dtype=torch.int32, device="cuda")
    plain = jit.build(store_value("plain_store", LaunchShape(32))).launcher(0)
    programmatic = jit.build(store_value("pdl_store", LaunchShape(32, programmatic=True)))
    for _ in range(10):
        plain((sms, 1, 1), stream, out=out.data_ptr(), value=1)
        programmatic.launcher(0)((sms, 1, 1), stream, out=out.data_ptr(), value=2)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 2))

    cooperative = jit.build(store_value("cooperative_store", LaunchShape(32, cooperative=True)))
    launch = cooperative.launcher(0)
    launch((sms, 1, 1), stream, out=out.data_ptr(), value=3)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 3))
    with pytest.raises(CudaError, match="COOPERATIVE_LAUNCH_TOO_LARGE"):
        launch((sms * 64, 1, 1), stream, out=out.data_ptr(), value=4)  # 64 CTAs an SM: no


def test_the_readme_kernel_example_runs():
    """README.md's 'Writing a kernel' block, run as written: it doubles x."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("Writing a kernel:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    expected = 2 * torch.randn(1 << 20, device="cuda")
    torch.manual_seed(0)
    namespace = {"torch": torch}
    exec(block, namespace)
    torch.cuda.synchronize()
    assert torch.equal(namespace["x"], expected)
