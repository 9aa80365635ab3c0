"""Errors name what is wrong: assembler rejections quote the PTX, a missing or hung
assembler is one line saying what to do, unknown targets and devices list the known ones,
builder arguments (immediates included) name the argument. The ops' argument checks are in
test_op_errors.py."""

from __future__ import annotations

import time

import pytest
import torch

from ptxforge import arch, jit
from ptxforge.jit import assemble
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
    try:
        jit.get_assembler(assembler)
    except jit.AssemblerUnavailable as exc:
        pytest.skip(str(exc))
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


@pytest.fixture
def no_assembler_knobs(monkeypatch):
    """No assembler settings, no disk cache, and assemblers looked up afresh."""
    for knob in ("PTXFORGE_ASSEMBLER", "PTXFORGE_PTXAS", "PTXFORGE_ASSEMBLE_TIMEOUT"):
        monkeypatch.delenv(knob, raising=False)
    monkeypatch.setenv("PTXFORGE_DISABLE_CACHE", "1")
    assemble._assembler.cache_clear()
    yield monkeypatch
    assemble._assembler.cache_clear()


def fake_ptxas(directory, body: str) -> str:
    """An executable that answers ``--version`` as ptxas 13.0 does, then runs ``body``."""
    path = directory / "ptxas"
    path.write_text("#!/bin/sh\n"
                    'if [ "$1" = --version ]; then echo "Cuda compilation tools, release 13.0, '
                    'V13.0.88"; exit 0; fi\n' + body + "\n")
    path.chmod(0o755)
    return str(path)


def assert_one_line(exc: BaseException) -> None:
    """A message of one line, raised without a chained traceback behind it."""
    assert "\n" not in str(exc) and exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__


def test_a_hung_ptxas_is_stopped_and_named(tmp_path, no_assembler_knobs):
    # The shell waits on a child: killing the shell alone would leave the pipes open.
    no_assembler_knobs.setenv("PTXFORGE_PTXAS", fake_ptxas(tmp_path, "sleep 60 & wait"))
    no_assembler_knobs.setenv("PTXFORGE_ASSEMBLE_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(jit.AssemblyError) as info:
        jit.build(kernel_with_unknown_instruction())
    assert time.monotonic() - start < 10
    assert str(info.value) == ("ptxas 13.0.88 did not finish assembling rejected within 0.5 s and "
                               "was stopped (the limit is PTXFORGE_ASSEMBLE_TIMEOUT)")


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "nan"])
def test_assemble_timeout_must_be_a_positive_number(value, no_assembler_knobs):
    no_assembler_knobs.setenv("PTXFORGE_ASSEMBLE_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"^PTXFORGE_ASSEMBLE_TIMEOUT must be a positive number "
                                         f"of seconds, got '{value}'$"):
        jit.build(kernel_with_unknown_instruction(), assembler="ptxas")


@pytest.mark.parametrize("assembler", [None, "ptxas"])
def test_a_missing_ptxforge_ptxas_is_an_error_not_a_fallback(assembler, tmp_path,
                                                              no_assembler_knobs):
    missing = str(tmp_path / "no" / "ptxas")
    no_assembler_knobs.setenv("PTXFORGE_PTXAS", missing)
    with pytest.raises(jit.AssemblerUnavailable) as info:
        jit.get_assembler(assembler)
    assert str(info.value) == f"PTXFORGE_PTXAS is {missing!r}, which is not an executable file"


def test_a_ptxforge_ptxas_that_is_not_ptxas(tmp_path, no_assembler_knobs):
    no_assembler_knobs.setenv("PTXFORGE_PTXAS", "/bin/true")
    with pytest.raises(jit.AssemblerUnavailable, match="^/bin/true is not a ptxas") as info:
        jit.get_assembler()
    assert_one_line(info.value)


def hide_nvjitlink(monkeypatch) -> None:
    """Make cuda.bindings fail to find libnvJitLink, as where the wheel is not installed."""
    from cuda.bindings import nvjitlink
    from cuda.pathfinder import DynamicLibNotFoundError

    def not_found():
        raise DynamicLibNotFoundError('Failure finding "libnvJitLink.so.13": No such file')

    monkeypatch.setattr(nvjitlink, "version", not_found)


def test_nvjitlink_without_its_library_says_what_to_install(no_assembler_knobs):
    hide_nvjitlink(no_assembler_knobs)
    with pytest.raises(jit.AssemblerUnavailable) as info:
        jit.build(kernel_with_unknown_instruction(), assembler="nvjitlink")
    assert str(info.value) == ('the nvJitLink library is not installed: '
                               'pip install "nvidia-nvjitlink==13.0.*"')
    assert_one_line(info.value)


def test_driver_assembler_without_a_gpu_says_so(no_assembler_knobs):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the driver's PTX JIT works here")
    no_assembler_knobs.setenv("PTXFORGE_ASSEMBLER", "driver")
    with pytest.raises(jit.AssemblerUnavailable, match="^the driver's PTX JIT needs ") as info:
        jit.build(kernel_with_unknown_instruction())
    assert_one_line(info.value)


def test_no_assembler_at_all_is_one_line_naming_each(no_assembler_knobs):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the driver's PTX JIT works here")
    no_assembler_knobs.setattr(assemble, "find_cuda_tool", lambda name: None)  # no toolkit
    hide_nvjitlink(no_assembler_knobs)
    with pytest.raises(jit.AssemblerUnavailable) as info:
        jit.build(kernel_with_unknown_instruction())
    message = str(info.value)
    assert message.startswith("no PTX assembler is available (ptxas: ")
    assert 'pip install "nvidia-cuda-nvcc==13.0.*"' in message
    assert 'pip install "nvidia-nvjitlink==13.0.*"' in message
    assert "; driver: the driver's PTX JIT needs " in message
    assert_one_line(info.value)


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


@pytest.mark.parametrize("n, ab_type, target, message", [
    (264, "bf16", "sm_90a", "wgmma n must be a multiple of 8 in [8, 256] on sm_90a, got 264"),
    (12, "bf16", "sm_90a", "wgmma n must be a multiple of 8 in [8, 256] on sm_90a, got 12"),
    (64, "s8", "sm_90a", "wgmma ab_type must be one of e4m3, e5m2, bf16, f16, tf32 on sm_90a, "
                         "got 's8'"),
    (64, "bf16", "sm_80", "wgmma.mma_async needs wgmma, which sm_80 (A100 80GB) does not have"),
])
def test_wgmma_shape_and_type_come_from_the_target(n, ab_type, target, message):
    k = KernelBuilder("k", target=target)
    desc = k.reg("u64", "desc")
    with pytest.raises(ValueError) as info:
        k.wgmma_mma_async(k.regs("f32", n // 2, "acc"), desc, desc, n=n, ab_type=ab_type)
    assert str(info.value) == message
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
ROW = row_kernel.VARIANTS


@pytest.mark.parametrize("hidden", [12, 4100, 0, -8])
def test_row_kernel_hidden_must_be_a_positive_multiple_of_8(hidden):
    with pytest.raises(ValueError, match=f"multiple of 8, got {hidden}"):
        row_kernel.choose_config(SM90, ROW["rms_norm"], hidden)


def test_swiglu_row_kernel_names_gate_in_its_size_error():
    with pytest.raises(ValueError, match=r"hidden size \(gate.shape\[-1\]\) must be a positive "
                                         "multiple of 8, got 1004"):
        row_kernel.choose_config(SM90, ROW["silu_mul_quantize_fp8"], 1004)


@pytest.mark.parametrize("switches", [
    dict(normalize=False, quantize=False), dict(normalize=True, swiglu=True),
    dict(normalize=True, row_map="scatter")])
def test_row_kernel_refuses_switches_that_name_no_variant(switches):
    made_up = ROW["quantize_fp8_per_token"]._replace(op="made_up", **switches)
    with pytest.raises(ValueError) as info:
        row_kernel.choose_config(SM90, made_up, 1024)
    assert str(info.value).startswith("the row kernel has no variant RowVariant(op='made_up'")
    assert str(info.value).endswith("its variants: " + ", ".join(ROW))


@pytest.mark.parametrize("normalize", [False, True])
def test_row_kernel_hidden_too_large(normalize):
    largest = ((SM90.max_threads_per_block // 2) * row_kernel.MAX_VECTORS_PER_THREAD[normalize]
               * row_kernel.VECTOR)
    variant = ROW["rms_norm_quantize_fp8" if normalize else "quantize_fp8_per_token"]
    assert row_kernel.choose_config(SM90, variant, largest).hidden == largest
    with pytest.raises(ValueError, match=f"at most {largest}, got {largest + 8}"):
        row_kernel.choose_config(SM90, variant, largest + 8)
    if not normalize:  # SwiGLU keeps as many vectors a thread as the quantization
        swiglu = ROW["silu_mul_quantize_fp8"]
        assert row_kernel.choose_config(SM90, swiglu, largest).hidden == largest
        with pytest.raises(ValueError, match=f"at most {largest}, got {largest + 8}"):
            row_kernel.choose_config(SM90, swiglu, largest + 8)


AMPERE = arch.get("sm_80")


@pytest.mark.parametrize("variant", [v for v in ROW if ROW[v].quantize])
def test_fp8_row_kernels_need_fp8(variant):
    with pytest.raises(ValueError, match="fp8") as info:
        row_kernel.choose_config(AMPERE, ROW[variant], 4096)
    assert "sm_80" in str(info.value)


def test_fp8_block_kernel_needs_fp8():
    with pytest.raises(ValueError, match="fp8") as info:
        block_kernel.choose_config(AMPERE)
    assert "sm_80" in str(info.value)


def test_row_kernels_need_the_copy_engine_pipeline():
    with pytest.raises(ValueError, match="copy-engine pipeline needs mbarrier_tx") as info:
        row_kernel.choose_config(AMPERE, ROW["rms_norm"], 4096)
    assert "sm_80" in str(info.value)


@pytest.mark.parametrize("hidden, topk, message", [
    (1004, 8, r"hidden size \(y.shape\[1\]\) must be a positive multiple of 8, got 1004"),
    (0, 8, r"hidden size \(y.shape\[1\]\) must be a positive multiple of 8, got 0"),
    (7168, 0, r"experts per token \(rows.shape\[1\]\) must be from 1 to 32, got 0"),
    (7168, 33, r"experts per token \(rows.shape\[1\]\) must be from 1 to 32, got 33")])
def test_moe_combine_names_the_size_it_cannot_take(hidden, topk, message):
    from ptxforge.kernels import bf16_moe_combine as combine_kernel

    with pytest.raises(ValueError, match=f"^{message}$"):
        combine_kernel.choose_config(SM90, hidden, topk)


def test_moe_combine_hidden_too_large():
    """The chunks of a token's row are the grid's y dimension."""
    from ptxforge.kernels import bf16_moe_combine as combine_kernel

    largest = SM90.max_grid[1] * combine_kernel.MAX_THREADS * 8
    assert combine_kernel.choose_config(SM90, largest, 8).chunks == SM90.max_grid[1]
    with pytest.raises(ValueError, match=f"^hidden size \\(y.shape\\[1\\]\\) must be at most "
                                         f"{largest} with 8 experts per token, got {largest + 8}$"):
        combine_kernel.choose_config(SM90, largest + 8, 8)


def test_moe_combine_weight_dtypes_and_targets():
    from ptxforge import kernels
    from ptxforge.kernels import bf16_moe_combine as combine_kernel

    with pytest.raises(ValueError, match="^weight dtype must be one of f32, bf16, got 'f16'$"):
        combine_kernel.choose_config(SM90, 7168, 8, "f16")
    with pytest.raises(ValueError, match="^option weight_bits must be 32 .* or 16 .*, got 8$"):
        kernels.get("moe_combine").config(SM90, weight_bits=8)
    with pytest.raises(ValueError, match="needs griddepcontrol, which sm_80") as info:
        combine_kernel.choose_config(AMPERE, 7168, 8)
    assert str(info.value).startswith("the MoE combine kernel (programmatic dependent launch)")


@pytest.mark.parametrize("problem, message", [
    (dict(dtype="f16"), "dtype must be one of ('e4m3', 'bf16'), got 'f16'"),
    (dict(layout="ragged", groups=2), "layout must be one of ('dense', 'contiguous', 'masked'), "
                                      "got 'ragged'"),
    (dict(layout="masked"), "groups must be 0 for the dense layout and positive for a grouped "
                            "one, got layout='masked', groups=0"),
    (dict(groups=4), "groups must be 0 for the dense layout and positive for a grouped one, got "
                     "layout='dense', groups=4"),
    (dict(epilogue=("residual", "bias")), "epilogue must list distinct terms in alphabetical "
                                          "order, got ('residual', 'bias')"),
    (dict(epilogue=("bias", "bias")), "epilogue must list distinct terms in alphabetical order, "
                                      "got ('bias', 'bias')"),
])
def test_a_gemm_problem_built_by_hand_is_checked(problem, message):
    from ptxforge.kernels import gemm_config
    from ptxforge.kernels.gemm import GemmProblem

    with pytest.raises(ValueError) as info:
        gemm_config(SM90, GemmProblem(4096, 7168, **problem), 64)
    assert str(info.value) == message
