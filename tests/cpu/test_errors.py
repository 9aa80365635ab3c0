"""Errors name what is wrong: assembler rejections quote the PTX, unknown targets and
devices list the known ones, builder and op argument checks name the argument."""

from __future__ import annotations

import pytest
import torch

import ptxforge
from ptxforge import arch, jit
from ptxforge.kernels import bf16_block_quant_fp8 as block_kernel
from ptxforge.kernels import bf16_row_rmsnorm_fp8quant as row_kernel
from ptxforge.ops import get_tma_aligned_size
from ptxforge.ptx import KernelBuilder, addr

BAD_LINE = "\tfrobnicate.u32 %value, 7;"


def kernel_with_unknown_instruction() -> KernelBuilder:
    k = KernelBuilder("rejected", target="sm_90a", max_threads=32)
    out = k.param("out", "u64")
    ptr, value = k.reg("u64", "out_ptr"), k.reg("u32", "value")
    k.ld_param(ptr, out)
    k.raw(BAD_LINE)
    k.st(addr(ptr), value)
    return k


# --------------------------------------------------------------------------- assembler errors
@pytest.mark.parametrize("assembler, prefix", [("ptxas", "ptxas "), ("nvjitlink", "nvJitLink ")])
def test_assembly_error_quotes_the_log_and_the_line(assembler, prefix, monkeypatch):
    monkeypatch.setenv("PTXFORGE_DISABLE_CACHE", "1")
    k = kernel_with_unknown_instruction()
    line = k.ptx().splitlines().index(BAD_LINE) + 1
    with pytest.raises(jit.AssemblyError) as info:
        jit.build(k, assembler=assembler)
    message, log = str(info.value), info.value.log
    assert message.startswith(prefix) and "rejected the PTX" in message
    assert f"line {line}" in log and "frobnicate" in log and "error" in log
    assert log.strip() in message
    assert f">> {line:5d} | {BAD_LINE}" in message
    assert f"   {line - 1:5d} | " in message and f"   {line + 1:5d} | " in message


# --------------------------------------------------------------------------- arch lookups
def test_unknown_target_lists_the_known_ones():
    with pytest.raises(ValueError, match="sm_99") as info:
        arch.get("sm_99")
    for known in ("sm_80", "sm_89", "sm_90a"):
        assert known in str(info.value)


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(ValueError, match="nonexistent") as info:
        arch.get("sm_90a", "nonexistent")
    assert "H200" in str(info.value) and "H100 SXM" in str(info.value)


# --------------------------------------------------------------------------- builder arguments
@pytest.mark.parametrize("count", [20, 260, 100])
def test_setmaxnreg_count_out_of_range(count):
    k = KernelBuilder("k")
    with pytest.raises(ValueError, match=f"multiple of 8 in \\[24, 256\\], got {count}"):
        k.setmaxnreg(count, increase=True)
    assert k.instruction_count == 0


def test_setmaxnreg_accepts_a_valid_count():
    k = KernelBuilder("k")
    k.setmaxnreg(240, increase=True)
    assert "setmaxnreg.inc.sync.aligned.u32 240;" in k.ptx()


def test_wgmma_with_wrong_accumulator_count():
    k = KernelBuilder("k")
    a_desc, b_desc = k.reg("u64", "a_desc"), k.reg("u64", "b_desc")
    acc = k.regs("f32", 16, "acc")
    with pytest.raises(ValueError, match="m64n64 needs 32 f32 accumulators per thread, got 16"):
        k.wgmma_mma_async(acc, a_desc, b_desc, n=64, ab_type="bf16")
    assert k.instruction_count == 0


def _immediate_kernel():
    k = KernelBuilder("k")
    return k, k.reg("u32", "r"), k.reg("u64", "rd"), k.reg("f32", "f")


@pytest.mark.parametrize("emit, message", [
    (lambda k, r, rd, f: k.add(r, r, 2**32 + 5), "add.u32: immediate 4294967301 does not fit .u32"),
    (lambda k, r, rd, f: k.mov(r, -2**31 - 1), "mov.u32: immediate -2147483649 does not fit .u32"),
    (lambda k, r, rd, f: k.setp("lt", k.pred(), r, 1 << 40),
     "setp.lt.u32: immediate 1099511627776 does not fit .u32"),
    (lambda k, r, rd, f: k.and_(rd, rd, 1 << 64),
     "and.b64: immediate 18446744073709551616 does not fit .b64"),
    (lambda k, r, rd, f: k.mul(f, f, 1e39), "mul.f32: immediate 1e+39 overflows .f32"),
    (lambda k, r, rd, f: k.mov(f, -3.5e38), "mov.f32: immediate -3.5e+38 overflows .f32"),
])
def test_an_immediate_the_instruction_type_cannot_hold(emit, message):
    k, r, rd, f = _immediate_kernel()
    with pytest.raises(ValueError) as info:
        emit(k, r, rd, f)
    assert str(info.value) == message
    assert k.instruction_count == 0


def test_immediates_at_the_edges_of_their_types():
    k, r, rd, f = _immediate_kernel()
    k.add(r, r, 2**32 - 1)
    k.add(r, r, -2**31)
    k.add(rd, rd, 2**64 - 1)
    k.mov(f, 3.4028234663852886e38)  # the largest finite f32
    k.mov(f, float("inf"))
    assert [line.strip() for line in k.ptx().splitlines() if line.strip().startswith(("add", "mov"))] == [
        "add.u32 %r, %r, 4294967295;", "add.u32 %r, %r, -2147483648;",
        "add.u64 %rd, %rd, 18446744073709551615;", "mov.f32 %f, 0f7F7FFFFF;", "mov.f32 %f, 0f7F800000;"]


def test_kernel_name_must_be_an_identifier():
    with pytest.raises(ValueError, match="'bad name'"):
        KernelBuilder("bad name")


def test_param_with_unknown_type():
    k = KernelBuilder("k")
    with pytest.raises(ValueError, match="'u128'"):
        k.param("x", "u128")
    assert k.params == []


def test_duplicate_param_name():
    k = KernelBuilder("k")
    k.param("x", "u64")
    with pytest.raises(ValueError, match="already has a parameter named 'x'"):
        k.param("x", "u32")
    assert [p.name for p in k.params] == ["x"]


# --------------------------------------------------------------------------- layouts and heuristics
@pytest.mark.parametrize("x, element_size, aligned", [
    (5, 4, 8), (8, 4, 8), (3, 2, 8), (17, 1, 32), (0, 4, 0), (1, 16, 1), (9, 8, 10),
])
def test_tma_aligned_size(x, element_size, aligned):
    assert get_tma_aligned_size(x, element_size) == aligned
    assert aligned * element_size % 16 == 0


def test_tma_aligned_size_rejects_an_element_size_not_dividing_16():
    with pytest.raises(ValueError, match="element_size must divide 16, got 3"):
        get_tma_aligned_size(5, 3)


SM90 = arch.get("sm_90a")


@pytest.mark.parametrize("hidden", [12, 4100, 0, -8])
def test_row_kernel_hidden_must_be_a_positive_multiple_of_8(hidden):
    with pytest.raises(ValueError, match=f"multiple of 8, got {hidden}"):
        row_kernel.choose_config(SM90, hidden, normalize=True, quantize=False)


@pytest.mark.parametrize("normalize", [False, True])
def test_row_kernel_hidden_too_large(normalize):
    largest = ((SM90.max_threads_per_block // 2) * row_kernel.MAX_VECTORS_PER_THREAD[normalize]
               * row_kernel.VECTOR)
    assert row_kernel.choose_config(SM90, largest, normalize=normalize, quantize=True).hidden == largest
    with pytest.raises(ValueError, match=f"at most {largest}, got {largest + 8}"):
        row_kernel.choose_config(SM90, largest + 8, normalize=normalize, quantize=True)


AMPERE = arch.get("sm_80")


@pytest.mark.parametrize("normalize", [False, True], ids=["quantize", "rmsnorm-quantize"])
def test_fp8_row_kernels_need_fp8(normalize):
    with pytest.raises(ValueError, match="fp8") as info:
        row_kernel.choose_config(AMPERE, 4096, normalize=normalize, quantize=True)
    assert "sm_80" in str(info.value)


def test_fp8_block_kernel_needs_fp8():
    with pytest.raises(ValueError, match="fp8") as info:
        block_kernel.choose_config(AMPERE)
    assert "sm_80" in str(info.value)


def test_row_kernels_need_the_copy_engine_pipeline():
    with pytest.raises(ValueError, match="copy-engine pipeline needs mbarrier_tx") as info:
        row_kernel.choose_config(AMPERE, 4096, normalize=True, quantize=False)
    assert "sm_80" in str(info.value)
