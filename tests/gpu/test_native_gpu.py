"""Both launch paths on a real GPU: the C launcher (runtime/native.c) and ctypes hand a
kernel the same arguments, tensor-map views included, and report the same errors; the C
encoder writes cuda.bindings' descriptor."""

from __future__ import annotations

import struct
from collections import OrderedDict

import pytest
import torch

from ptxforge import jit
from ptxforge.ptx import KernelBuilder, LaunchShape, TensorMap, addr
from ptxforge.runtime import CudaError, native, tensormap
from ptxforge.runtime.launch import argument_layout

pytestmark = pytest.mark.gpu

ECHOED = [("word", "u32"), ("scale", "f32"), ("offset", "s64"), ("tmap", "tensormap"),
          ("address", "u64")]
TMAP = TensorMap("float32", (32, 16))


def echo(shape: LaunchShape = LaunchShape(32)) -> KernelBuilder:
    """Writes each parameter after ``out`` to out at the parameter's own offset: out holds
    the parameter buffer as the kernel received it."""
    k = KernelBuilder("echo_params", target="sm_90a", max_threads=shape.block)
    k.launch = shape
    out_param = k.param("out", "u64")
    params = [k.param(name, type_, TMAP if type_ == "tensormap" else None)
              for name, type_ in ECHOED]
    out = k.reg("u64", "out")
    k.ld_param(out, out_param)
    _, offsets, _ = argument_layout(k.params)
    for p, offset in zip(params, offsets[1:]):
        words = [(p.type, 0)] if p.type != "tensormap" else [("b64", 8 * i) for i in range(16)]
        for type_, within in words:
            value = k.reg(type_)
            k.ld(value, addr(p, within), space="param")
            k.st(addr(out, offset + within), value)
    return k


@pytest.fixture(params=["native", "ctypes"])
def path(request, monkeypatch):
    if request.param == "native":
        if native.module() is None:
            pytest.skip("the C launcher is not built here (no C compiler)")
    else:
        monkeypatch.setattr(native, "module", lambda: None)
    return request.param


def test_the_kernel_receives_what_was_packed(path):
    compiled = jit.build(echo())
    fmt, _, size = argument_layout(compiled.params)
    x = torch.zeros((64, 32), device="cuda")
    out = torch.zeros(size, dtype=torch.uint8, device="cuda")
    view = (x.data_ptr(), (32, 64), (32 * 4,))
    launch = compiled.launcher(0)
    assert launch.path == path
    values = {"word": 0xDEADBEEF, "scale": 1.5, "offset": -5, "tmap": view, "address": 1 << 40}
    launch((1, 1, 1), torch.cuda.current_stream().cuda_stream, out=out.data_ptr(), **values)
    torch.cuda.synchronize()
    descriptor = tensormap.encode(TMAP, *view)
    expected = struct.pack(fmt, 0, *{**values, "tmap": descriptor}.values())
    assert bytes(out.cpu().numpy())[8:] == expected[8:]


def test_a_misaligned_view_and_a_refused_launch_are_the_same_errors(path):
    compiled = jit.build(echo())
    x = torch.zeros((64, 32), device="cuda")
    values = {"word": 1, "scale": 1.0, "offset": 0, "address": 0}
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="TMA needs a 16-byte aligned base address"):
        compiled.launcher(0)((1, 1, 1), stream, out=0, tmap=(x.data_ptr() + 4, (31, 64),
                                                             (128,)), **values)
    too_many_threads = compiled.load(0).launcher(LaunchShape(2048))
    with pytest.raises(CudaError, match="^launch of echo_params failed: CUDA_ERROR_"):
        too_many_threads((1, 1, 1), stream, out=0, tmap=bytes(128), **values)


@pytest.mark.parametrize("dtype, shape, strides, box, swizzle, oob_fill_nan", [
    ("float8_e4m3fn", (1024, 256), (1024,), (128, 64), 128, False),
    ("bfloat16", (64, 128, 3), (256, 256 * 128), (64, 32, 1), 0, False),
    ("float32", (128, 40), (512,), (128, 1), 0, True),
])
def test_the_c_encoder_writes_the_bindings_descriptor(dtype, shape, strides, box, swizzle,
                                                      oob_fill_nan, monkeypatch):
    if native.module() is None:
        pytest.skip("the C launcher is not built here (no C compiler)")
    x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    blobs = []
    for extension in (native.module(), None):
        monkeypatch.setattr(tensormap, "_cache", OrderedDict())
        monkeypatch.setattr(native, "module", lambda: extension)
        blobs.append(tensormap.encode_tiled(x.data_ptr(), dtype, shape, strides, box, swizzle,
                                            oob_fill_nan))
    assert blobs[0] == blobs[1] and len(blobs[0]) == 128
