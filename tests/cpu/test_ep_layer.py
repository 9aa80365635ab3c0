"""The MoE layer across GPUs without one: the e4m3 permutation kernel's code and the
permute op's quantized input."""

from __future__ import annotations

import re

import pytest
import torch

import ptxforge
from ptxforge import arch, jit, kernels
from ptxforge.kernels import bf16_row_rmsnorm_fp8quant as row_kernel

E4M3, F32, BF16, I32, I64 = (torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32,
                             torch.int64)


def zeros(dtype, *shape):
    return torch.zeros(shape, dtype=dtype)


def fp8_pair(*shape):
    """e4m3 [*shape] and f32 block scales [E, N/128, K/128], as quantize_fp8_per_block's."""
    *lead, n, k = shape
    return zeros(E4M3, *shape), zeros(F32, *lead, -(-n // 128), -(-k // 128))


# --------------------------------------------------------------------------- the e4m3 permutation
def test_e4m3_permutation_moves_rows_with_the_copy_engine_alone():
    """Each row copied into shared memory and stored to each of its k rows by bulk copies,
    the pair's index at sources[row]; no thread reads the row, nothing is converted."""
    spec = kernels.get("moe_permute_fp8")
    cfg = spec.config(arch.get("sm_90a"), hidden=7168, topk=8)
    assert cfg.name == "e4m3_permute8_k7168"
    assert (cfg.threads_per_row, cfg.rows_per_cta) == (16, 8)
    assert cfg.stage_row_bytes == 7168     # one byte an element
    ptx = spec.generate(cfg).ptx()
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 8
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.bulk.wait_group.read 0" in ptx
    for absent in ("cvt.", "ld.shared", "st.shared", "shl.b32 %x_stride_bytes", "scales"):
        assert absent not in ptx, absent
    assert re.findall(r"\.param \.\w+ (\w+)", ptx) == ["x", "x_row_stride", "rows", "q", "index",
                                                        "index_rows", "sources"]


@pytest.mark.parametrize("hidden, topk", [(7168, 8), (512, 2), (16384, 8)])
def test_e4m3_permutation_assembles_without_spills(hidden, topk):
    cfg = kernels.get("moe_permute_fp8").config(arch.get("sm_90a"), hidden=hidden, topk=topk)
    compiled = jit.build(row_kernel.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0


def test_the_bf16_variants_keep_their_names():
    cfg = kernels.get("moe_permute_quantize_fp8").config(arch.get("sm_90a"), hidden=7168, topk=8)
    assert cfg.name == "bf16_quant_fp8_per_token_scatter8_k7168"


@pytest.mark.parametrize("x, error, message", [
    ((zeros(BF16, 4, 256), zeros(F32, 4, 2)), TypeError,
     "x[0] must have dtype torch.float8_e4m3fn, got torch.bfloat16"),
    ((zeros(E4M3, 4, 256), zeros(F32, 4, 3)), ValueError,
     "x[1] must have shape (4, 2), got (4, 3)"),
    ((zeros(E4M3, 4, 256), zeros(BF16, 4, 2)), TypeError,
     "x[1] must have dtype torch.float32, got torch.bfloat16"),
    ((zeros(E4M3, 4, 256), zeros(F32, 4, 2)), ValueError,
     "x[0] must be on a CUDA device, got cpu"),
])
def test_the_permutation_takes_rows_quantized_already(x, error, message):
    with pytest.raises(error) as info:
        ptxforge.moe_permute_quantize_fp8(x, zeros(I32, 4, 2), (64,))
    assert str(info.value) == message


def test_quantized_rows_are_checked_against_the_routing():
    with pytest.raises(ValueError, match=r"^rows must be a contiguous int32 \[4, k\]"):
        ptxforge.moe_permute_quantize_fp8((zeros(E4M3, 4, 256), zeros(F32, 4, 2)),
                                          zeros(I32, 5, 2), (64,))
