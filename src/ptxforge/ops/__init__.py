"""The public torch-facing functions: validate, choose a config, build (cached), launch."""

from .block_quant import quantize_fp8_per_block
from .gemm import (bf16_gemm_nt, fp8_gemm_nt, get_mk_alignment_for_contiguous_layout,
                   m_grouped_bf16_gemm_nt_contiguous, m_grouped_bf16_gemm_nt_masked,
                   m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked)
from .layout import get_mn_major_tma_aligned_tensor, get_tma_aligned_size
from .rowwise import quantize_fp8_per_token, rms_norm, rms_norm_quantize_fp8

__all__ = ["bf16_gemm_nt", "fp8_gemm_nt", "m_grouped_bf16_gemm_nt_contiguous",
           "m_grouped_bf16_gemm_nt_masked", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
           "get_mk_alignment_for_contiguous_layout",
           "quantize_fp8_per_block", "quantize_fp8_per_token", "rms_norm", "rms_norm_quantize_fp8",
           "get_mn_major_tma_aligned_tensor", "get_tma_aligned_size"]
