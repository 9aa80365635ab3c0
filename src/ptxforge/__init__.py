"""ptxforge: GPU kernels written in PTX from Python, assembled in milliseconds, launched from PyTorch.

    import ptxforge
    q, s = ptxforge.quantize_fp8_per_token(x)          # bf16 [M, K] -> e4m3 + 1x128 scales
    y = ptxforge.rms_norm(x, weight)

The layers, in the order a call passes through them: ``ops`` (validate, pick a config,
launch) -> ``kernels`` (one generator per kernel) -> ``ptx`` (the builder) -> ``jit``
(assemble, cache) -> ``runtime`` (load, launch by name), with hardware numbers from
``arch``; ``testing`` holds the reference recipes, checks and benchmarks.
"""

__version__ = "0.1.0"

_OPS = ("bf16_gemm_nt", "fp8_gemm_nt", "m_grouped_bf16_gemm_nt_contiguous",
        "m_grouped_bf16_gemm_nt_masked", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
        "get_mk_alignment_for_contiguous_layout",
        "quantize_fp8_per_block", "quantize_fp8_per_token", "rms_norm", "rms_norm_quantize_fp8",
        "get_mn_major_tma_aligned_tensor", "get_tma_aligned_size")


def __getattr__(name):
    # The ops import torch; keep `import ptxforge` (and the builder, the CLI's help) light.
    if name in _OPS:
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'ptxforge' has no attribute {name!r}")


__all__ = list(_OPS)
