"""The kernels a rewritten graph launches, and assembling all of them ahead of its calls.

A GEMM's tile depends on M, which is a run-time argument: for every token count up to a
bound, the tile model (``sm90_gemm.choose_config``) gives the config, and the distinct
configs are assembled in parallel (``jit.precompile``, into the on-disk cache). The row
kernels depend on the hidden size only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import bf16_moe_combine as combine_kernel
from ..kernels import bf16_row_rmsnorm_fp8quant as row_kernel
from ..kernels import f32_moe_scale_gather as gather_kernel
from ..kernels import i64_moe_routing_layout as routing_kernel
from ..kernels import sm90_gemm as gemm_kernel
from ..kernels.sm90_gemm.tile_model import token_counts
from ..ops import moe as moe_ops

PTXFORGE = torch.ops.ptxforge

# The row generator's switches for each row kernel the passes use.
ROW_VARIANTS = {
    "quantize_fp8_per_token": {"normalize": False, "quantize": True},
    "rms_norm_quantize_fp8": {"normalize": True, "quantize": True},
    "silu_mul_quantize_fp8": {"normalize": False, "quantize": True, "swiglu": True},
    "moe_permute_quantize_fp8": {"normalize": False, "quantize": True, "row_map": "scatter"},
    "moe_silu_mul_quantize_fp8": {"normalize": False, "quantize": True, "swiglu": True,
                                  "row_map": "indexed"},
}


class _Kernel:
    """A kernel descriptor's configs: ``config(arch, m)`` for each token count, once each."""

    def configs(self, arch, tokens=(1,)) -> list:
        return list(dict.fromkeys(self.config(arch, m) for m in tokens))


@dataclass(frozen=True)
class Gemm(_Kernel):
    """A GEMM of the graph, less its M."""
    n: int
    k: int
    dtype: str               # "e4m3" or "bf16"
    bias: bool = False
    residual: bool = False
    accumulate: bool = False  # an f32 D added to (bf16_linear_f32: into zeros)

    def config(self, arch, m: int):
        return gemm_kernel.choose_config(arch, m, self.n, self.k, dtype=self.dtype,
                                         bias=self.bias, residual=self.residual,
                                         accumulate=self.accumulate)

    generate = staticmethod(gemm_kernel.generate)

    @property
    def weight_bytes(self) -> int:
        """B's bytes (and its 128x128 scales' in e4m3): what a call reads whatever M is."""
        if self.dtype == "bf16":
            return 2 * self.n * self.k
        return self.n * self.k + 4 * -(-self.n // 128) * -(-self.k // 128)

    def __str__(self):
        extras = "".join(f" + {name}" for name in ("bias", "residual") if getattr(self, name))
        into = " into f32" if self.accumulate else ""
        return f"{self.dtype} GEMM N={self.n} K={self.k}{extras}{into}"


@dataclass(frozen=True)
class Row(_Kernel):
    """A row kernel of the graph: its variant and hidden size (and a scatter's fanout)."""
    variant: str             # the row generator's variant name
    hidden: int
    fanout: int = 1

    def config(self, arch, m: int = 0):
        return row_kernel.choose_config(arch, self.hidden, fanout=self.fanout,
                                        **ROW_VARIANTS[self.variant])

    generate = staticmethod(row_kernel.generate)

    def __str__(self):
        fanout = f" topk={self.fanout}" if self.fanout > 1 else ""
        return f"{self.variant} hidden={self.hidden}{fanout}"


@dataclass(frozen=True)
class MoeGemm(Gemm):
    """A MoE layer's grouped GEMM (``moe_experts_fp8``): its layout, and so its tile,
    follow the token count; ``config``'s m is the number of tokens."""
    experts: int = 0
    top_k: int = 0

    def config(self, arch, m: int):
        """The tile ``moe_experts_fp8`` launches for m tokens: for its layout's rows (all of
        the contiguous layout's, or E x the rows an expert is expected to hold)."""
        masked = moe_ops.choose_layout(m, self.top_k, self.experts) == "masked"
        rows = self.experts * moe_ops.expected_rows(m, self.top_k, self.experts) if masked \
            else moe_ops.grouped_rows("contiguous", m, self.top_k, self.experts)[0]
        return gemm_kernel.choose_config(arch, rows, self.n, self.k, groups=self.experts,
                                         masked=masked)

    def configs(self, arch, tokens=(1,)) -> list:
        """The configs of every token count from the least of ``tokens`` to the greatest:
        the rows, and so the tile, follow the count at a pace of their own (top_k rows a
        token; the layout's switch), between the dense GEMM's representatives."""
        return list(dict.fromkeys(self.config(arch, m)
                                  for m in range(min(tokens), max(tokens) + 1)))

    @property
    def weight_bytes(self) -> int:
        """Every expert's: the bound when the routing activates them all."""
        return self.experts * super().weight_bytes

    def __str__(self):
        return f"MoE e4m3 GEMM E={self.experts} N={self.n} K={self.k}"


@dataclass(frozen=True)
class MoeRouting(_Kernel):
    """The routing-layout kernel: one per layout the token counts choose."""
    experts: int
    top_k: int

    def config(self, arch, m: int = 1):
        return routing_kernel.choose_config(arch, self.experts,
                                            moe_ops.choose_layout(m, self.top_k, self.experts))

    generate = staticmethod(routing_kernel.generate)

    def __str__(self):
        return f"moe_routing_layout E={self.experts}"


@dataclass(frozen=True)
class MoeScaleGather(_Kernel):
    """The permutation's second kernel, the grouped rows' scales: one config."""
    hidden: int
    top_k: int

    def config(self, arch, m: int = 0):
        return gather_kernel.choose_config(arch, self.hidden, self.top_k)

    generate = staticmethod(gather_kernel.generate)

    def __str__(self):
        return f"moe_permute_scales hidden={self.hidden} topk={self.top_k}"


@dataclass(frozen=True)
class MoeCombine(_Kernel):
    """The combine kernel: one config, whatever the token count."""
    hidden: int
    top_k: int
    weight_dtype: str        # "f32" or "bf16"

    def config(self, arch, m: int = 0):
        return combine_kernel.choose_config(arch, self.hidden, self.top_k, self.weight_dtype)

    generate = staticmethod(combine_kernel.generate)

    def __str__(self):
        return f"moe_combine hidden={self.hidden} topk={self.top_k} weights {self.weight_dtype}"


def _shape(node):
    """The node's shape as ints: the sizes a kernel is specialised on are static (a token
    count, dynamic, is never asked for here)."""
    return tuple(int(size) for size in node.meta["example_value"].shape)


def _last(node) -> int:
    return int(node.meta["example_value"].shape[-1])


def kernels_of(graph: torch.fx.Graph) -> dict[str, tuple]:
    """node name -> the kernels its ptxforge operator launches."""
    found = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        bias = node.kwargs.get("bias") is not None
        residual = node.kwargs.get("residual") is not None
        if node.target is PTXFORGE.fp8_linear.default:
            x, x_scales, wq = node.args[:3]
            n, k = _shape(wq)
            kernels = (Gemm(n, k, "e4m3", bias, residual),)
            if x_scales is None:   # it quantizes x itself
                kernels = (Row("quantize_fp8_per_token", k),) + kernels
            found[node.name] = kernels
        elif node.target is PTXFORGE.bf16_linear.default:
            n, k = _shape(node.args[1])
            found[node.name] = (Gemm(n, k, "bf16", bias, residual),)
        elif node.target is PTXFORGE.rms_norm_fp8.default:
            found[node.name] = (Row("rms_norm_quantize_fp8", _last(node.args[0])),)
        elif node.target is PTXFORGE.silu_mul_fp8.default:
            found[node.name] = (Row("silu_mul_quantize_fp8", _last(node.args[0])),)
        elif node.target is PTXFORGE.bf16_linear_f32.default:
            n, k = _shape(node.args[1])
            found[node.name] = (Gemm(n, k, "bf16", accumulate=True),)
        elif node.target is PTXFORGE.moe_experts_fp8.default:
            found[node.name] = _moe_kernels(node)
    return found


def _moe_kernels(node) -> tuple:
    """The kernels of ``moe_experts_fp8(x, topk_idx, topk_weights, w13, s13, w2, s2)``."""
    x, index, weights, w13, _, w2, _ = node.args
    experts, two_inner, hidden = _shape(w13)
    return moe_kernels(experts, hidden, two_inner // 2, _last(index),
                       weights.meta["example_value"].dtype)


def moe_kernels(experts: int, hidden: int, inner: int, top_k: int, weight_dtype) -> tuple:
    """The kernels ``moe_experts_fp8`` launches for these sizes (``weight_dtype``: the top-k
    weights' torch dtype)."""
    weight_dtype = "bf16" if weight_dtype == torch.bfloat16 else "f32"
    return (MoeRouting(experts, top_k),
            Row("moe_permute_quantize_fp8", hidden, fanout=top_k),
            MoeScaleGather(hidden, top_k),
            MoeGemm(2 * inner, hidden, "e4m3", experts=experts, top_k=top_k),
            Row("moe_silu_mul_quantize_fp8", inner),
            MoeGemm(hidden, inner, "e4m3", experts=experts, top_k=top_k),
            MoeCombine(hidden, top_k, weight_dtype))


def builders(kernels, arch, tokens) -> list:
    """Zero-argument builders of every distinct config of ``kernels`` (an iterable of
    Gemm / Row) for these token counts (``every_token_count(limit)``: all of 1..limit)."""
    configs = {}
    for kernel in dict.fromkeys(kernels):
        for cfg in kernel.configs(arch, tokens):
            configs.setdefault(cfg, kernel.generate)
    return [lambda cfg=cfg, generate=generate: generate(cfg) for cfg, generate in configs.items()]


def every_token_count(limit: int) -> list[int]:
    """Token counts that stand for all of 1..limit: one for each config the GEMMs' tile
    model can choose among them."""
    return token_counts(limit)
