"""DeepGEMM's names for what ptxforge implements, so a DeepGEMM caller switches by
changing one import:

    import ptxforge.deep_gemm as deep_gemm
    deep_gemm.fp8_gemm_nt((a, sa), (b, sb), d)

The names are those ``ptxforge.public.PUBLIC`` marks ``in_deep_gemm``: the GEMMs (dense
fp8, with ``c`` an f32 ``d = c + a @ b.T``, dense bf16, and the MoE grouped forms), their
layout helpers (``get_col_major_tma_aligned_tensor`` is the older name of
``get_mn_major_tma_aligned_tensor``), ``ceil_div`` and the process-wide SM count
(``get_num_sms``/``set_num_sms``).
"""

from .public import DEEP_GEMM_NAMES, load

globals().update(load(DEEP_GEMM_NAMES))

__all__ = list(DEEP_GEMM_NAMES)
