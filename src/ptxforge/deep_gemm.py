"""DeepGEMM's names for what ptxforge implements, so a DeepGEMM caller switches by
changing one import:

    import ptxforge.deep_gemm as deep_gemm
    deep_gemm.fp8_gemm_nt((a, sa), (b, sb), d)

Implemented: ``bf16_gemm_nt``, ``fp8_gemm_nt`` (with ``c``: f32 ``d = c + a @ b.T``), ``get_num_sms``/``set_num_sms``,
``get_tma_aligned_size``, ``get_mn_major_tma_aligned_tensor`` (and its older name
``get_col_major_tma_aligned_tensor``), ``ceil_div``, ``m_grouped_fp8_gemm_nt_contiguous``,
``m_grouped_fp8_gemm_nt_masked``, their bf16 forms ``m_grouped_bf16_gemm_nt_contiguous``
and ``m_grouped_bf16_gemm_nt_masked``, and ``get_mk_alignment_for_contiguous_layout``.
"""

from .ops.gemm import (bf16_gemm_nt, fp8_gemm_nt, get_mk_alignment_for_contiguous_layout, get_num_sms,
                       m_grouped_bf16_gemm_nt_contiguous, m_grouped_bf16_gemm_nt_masked,
                       m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked,
                       set_num_sms)
from .ops.layout import ceil_div, get_mn_major_tma_aligned_tensor, get_tma_aligned_size

get_col_major_tma_aligned_tensor = get_mn_major_tma_aligned_tensor

__all__ = ["bf16_gemm_nt", "ceil_div", "fp8_gemm_nt", "get_col_major_tma_aligned_tensor",
           "get_mk_alignment_for_contiguous_layout", "get_mn_major_tma_aligned_tensor",
           "get_num_sms", "get_tma_aligned_size", "m_grouped_bf16_gemm_nt_contiguous",
           "m_grouped_bf16_gemm_nt_masked", "m_grouped_fp8_gemm_nt_contiguous",
           "m_grouped_fp8_gemm_nt_masked", "set_num_sms"]
