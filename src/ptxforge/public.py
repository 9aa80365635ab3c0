"""Every public function, listed once: the ``ptxforge.ops`` module that defines it, the
kernel registry entries it launches (``ptxforge.kernels.REGISTRY``, what ``ptxforge
precompile`` walks), and which namespaces export it.

``ptxforge``, ``ptxforge.ops`` and ``ptxforge.deep_gemm`` take their names from this
table, and the tests hold the kernel registry to it. Nothing here imports torch until
``load`` is called, so ``import ptxforge``, which reads the table, stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class PublicName:
    name: str
    module: str                 # the ptxforge.ops module that defines it
    kernels: tuple = ()         # the kernel registry entries it launches, if any
    in_ptxforge: bool = True    # exported by ptxforge and ptxforge.ops
    in_deep_gemm: bool = False  # DeepGEMM has the name: exported by ptxforge.deep_gemm


PUBLIC = (
    PublicName("rms_norm", "rowwise", kernels=("rms_norm",)),
    PublicName("quantize_fp8_per_token", "rowwise", kernels=("quantize_fp8_per_token",)),
    PublicName("rms_norm_quantize_fp8", "rowwise", kernels=("rms_norm_quantize_fp8",)),
    PublicName("silu_mul_quantize_fp8", "rowwise", kernels=("silu_mul_quantize_fp8",)),
    PublicName("quantize_fp8_per_block", "block_quant", kernels=("quantize_fp8_per_block",)),
    PublicName("fp8_gemm_nt", "gemm", kernels=("fp8_gemm_nt",), in_deep_gemm=True),
    PublicName("bf16_gemm_nt", "gemm", kernels=("bf16_gemm_nt",), in_deep_gemm=True),
    PublicName("m_grouped_fp8_gemm_nt_contiguous", "gemm",
               kernels=("m_grouped_fp8_gemm_nt_contiguous",), in_deep_gemm=True),
    PublicName("m_grouped_fp8_gemm_nt_masked", "gemm", kernels=("m_grouped_fp8_gemm_nt_masked",),
               in_deep_gemm=True),
    PublicName("m_grouped_bf16_gemm_nt_contiguous", "gemm",
               kernels=("m_grouped_bf16_gemm_nt_contiguous",), in_deep_gemm=True),
    PublicName("m_grouped_bf16_gemm_nt_masked", "gemm", kernels=("m_grouped_bf16_gemm_nt_masked",),
               in_deep_gemm=True),
    PublicName("get_mk_alignment_for_contiguous_layout", "gemm", in_deep_gemm=True),
    PublicName("get_tma_aligned_size", "layout", in_deep_gemm=True),
    # A MoE layer's experts (ops/moe.py), and the kernels it runs around the grouped GEMMs.
    PublicName("moe_experts_fp8", "moe"),
    PublicName("moe_routing_layout", "routing", kernels=("moe_routing_layout",)),
    PublicName("max_contiguous_rows", "routing"),
    PublicName("moe_permute_quantize_fp8", "moe", kernels=("moe_permute_quantize_fp8",
                                                                   "moe_permute_fp8",
                                                                   "moe_permute_scales")),
    PublicName("moe_silu_mul_quantize_fp8", "moe", kernels=("moe_silu_mul_quantize_fp8",)),
    PublicName("moe_combine", "moe_combine", kernels=("moe_combine",)),
    PublicName("attention_with_kvcache", "attention", kernels=("attention_with_kvcache",)),
    PublicName("get_mn_major_tma_aligned_tensor", "layout", in_deep_gemm=True),
    # DeepGEMM's helpers, for its callers; ptxforge's own callers use num_sms= and the above.
    PublicName("ceil_div", "layout", in_ptxforge=False, in_deep_gemm=True),
    PublicName("get_num_sms", "gemm", in_ptxforge=False, in_deep_gemm=True),
    PublicName("set_num_sms", "gemm", in_ptxforge=False, in_deep_gemm=True),
    PublicName("get_col_major_tma_aligned_tensor", "layout", in_ptxforge=False,
               in_deep_gemm=True),
)

# Kernels that ``ptxforge.ep`` launches (``Buffer``'s methods, or the functions of
# ``ptxforge.ep.low_latency`` that the buffer's methods call): not public ops, as they need
# the buffer's peers; listed so that every registry kernel has a caller.
EP_KERNELS = {"ep_dispatch_layout": "Buffer.get_dispatch_layout",
              "ep_count_exchange": "Buffer.dispatch", "ep_direct_dispatch": "Buffer.dispatch",
              "ep_pull_combine": "Buffer.combine",
              "ep_intranode_dispatch": "Buffer.dispatch", "ep_intranode_combine": "Buffer.combine",
              "ep_low_latency_dispatch": "Buffer.low_latency_dispatch",
              "ep_low_latency_combine": "Buffer.low_latency_combine"}

PTXFORGE_NAMES = tuple(entry.name for entry in PUBLIC if entry.in_ptxforge)
DEEP_GEMM_NAMES = tuple(entry.name for entry in PUBLIC if entry.in_deep_gemm)


def load(names) -> dict:
    """name -> the function, for each of ``names``, imported from its ops module (which
    imports torch)."""
    modules = {entry.name: entry.module for entry in PUBLIC}
    return {name: getattr(import_module(f"ptxforge.ops.{modules[name]}"), name)
            for name in names}
