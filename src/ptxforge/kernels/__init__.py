"""Kernel generators, one per file, the GEMM generation of each target, and the registry
the CLI and tests walk.

Each registry entry turns (arch, keyword options) into a config through the kernel's
own heuristic, and a config into a ``KernelBuilder`` through its generator. Each is the
kernel of a public op, named in that op's row of ``ptxforge.public.PUBLIC``.

The GEMM has generations (``sm90_gemm``: wgmma and TMA); a target's architecture
description names the one it runs (``[kernels] gemm``), and ``gemm_generation(arch)``
finds it: the ops, precompiling and the compile backend ask it, never a module by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import arch as _arch
from . import (bf16_block_quant_fp8, bf16_decode_attention, bf16_decode_attention_mma,
               bf16_moe_combine, bf16_row_rmsnorm_fp8quant, f32_moe_scale_gather,
               i64_moe_routing_layout, sm90_gemm)
from .gemm import GemmProblem
from .ep_intranode import combine as ep_combine
from .ep_intranode import direct as ep_direct
from .ep_intranode import pull as ep_pull
from .ep_intranode import dispatch as ep_dispatch
from .ep_intranode import exchange as ep_exchange
from .ep_intranode import layout as ep_layout
from .ep_low_latency import combine as ep_ll_combine
from .ep_low_latency import dispatch as ep_ll_dispatch

# Hidden sizes of DeepSeek-V3 / common LLM layers, for precompiling and the CPU checks.
HIDDEN_SIZES = (512, 576, 1536, 2048, 2112, 4096, 7168, 8192, 16384)
# FFN intermediate sizes (SwiGLU's rows): DeepSeek-V3's MoE experts (2048) and dense layers
# (18432), Llama-2-7B (11008), Llama-3-8B and Mistral-7B (14336), and powers of two.
INTERMEDIATE_SIZES = (1024, 2048, 4096, 11008, 14336, 18432)


# The largest value of a kernel's integer option, checked before its configure runs (which
# checks the kernel's own, often narrower, range): sizes reach the kernels as 32-bit
# integers; hidden and slots multiply into the EP kernels' 32-bit ring offsets.
OPTION_LIMITS = {"hidden": 1 << 16, "slots": 1 << 12}
OPTION_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class KernelSpec:
    name: str
    configure: Callable  # (arch, **options) -> config
    generate: Callable   # config -> KernelBuilder
    options: dict        # option name -> default: the sizes (and words) the config is
                         # specialised on
    variants: tuple      # option dicts worth precompiling
    doc: str

    def config(self, arch, **options):
        """The config for ``options`` (integers from 1 to their ``OPTION_LIMITS`` entry or
        ``OPTION_LIMIT``, or their decimal text, as the command line gives them; text where
        the default is text, such as a layout, which the kernel's configure checks), the
        unnamed ones at their defaults."""
        values = dict(self.options)
        for key, value in options.items():
            if key not in self.options:
                raise ValueError(f"{self.name} has no option {key!r}; its options: "
                                 f"{', '.join(self.options) or 'none'}")
            if isinstance(self.options[key], str):
                if not isinstance(value, str):
                    raise ValueError(f"option {key} must be text, got {value!r}")
                values[key] = value
                continue
            if isinstance(value, str) and value.strip().isdigit():
                value = int(value)
            limit = OPTION_LIMITS.get(key, OPTION_LIMIT)
            if type(value) is not int or not 1 <= value <= limit:
                raise ValueError(f"option {key} must be an integer from 1 to {limit}, "
                                 f"got {value!r}")
            values[key] = value
        return self.configure(arch, **values)

    def builder(self, arch, **options):
        return self.generate(self.config(arch, **options))


# The GEMM generation each target's description names ([kernels] gemm).
GEMM_GENERATIONS = {"sm90_gemm": sm90_gemm}


def gemm_generation(arch):
    """The GEMM generation ``arch`` runs: a module with ``choose_config(arch, problem, m,
    sms)``, ``generate(cfg)``, ``require_problem(arch, problem)``, ``token_counts(limit)``
    and ``GemmConfig``."""
    name = arch.kernels.get("gemm")
    if name is None:
        runs = ", ".join(target for target in _arch.targets()
                         if "gemm" in _arch.get(target).kernels)
        raise ValueError(f"ptxforge has no GEMM for {arch.target} ({arch.device.name}); its "
                         f"GEMM runs on {runs}")
    return GEMM_GENERATIONS[name]


def gemm_config(arch, problem: GemmProblem, m: int, sms: int | None = None):
    """The config ``problem`` runs with for ``m`` rows (the masked layout: all groups'
    expected rows) on ``sms`` SMs: the one tile choice, which launches and precompiling
    both make."""
    return gemm_generation(arch).choose_config(arch, problem, m, sms)


def _row_spec(variant) -> "KernelSpec":
    """The registry entry of a row-kernel variant: its options and precompiled sizes follow
    from what it reads (a hidden size, SwiGLU's intermediate size, the scatter's top-k)."""
    if variant.row_map == "scatter":
        options = {"hidden": 7168, "topk": 8}
        sizes = tuple({"hidden": h, "topk": k} for h in HIDDEN_SIZES for k in (8, 2))
    elif variant.swiglu:   # hidden: the intermediate size I of gate and up [M, I]
        options = {"hidden": 2048 if variant.row_map == "indexed" else 18432}
        sizes = tuple({"hidden": i} for i in INTERMEDIATE_SIZES)
    else:
        options, sizes = {"hidden": 7168}, tuple({"hidden": h} for h in HIDDEN_SIZES)

    def configure(arch, hidden: int, topk: int = 1):
        return bf16_row_rmsnorm_fp8quant.choose_config(arch, variant, hidden, fanout=topk)
    return KernelSpec(variant.op, configure, bf16_row_rmsnorm_fp8quant.generate, options,
                      sizes, variant.doc)

# (N, K) of DeepGEMM's dense benchmark table.
GEMM_SHAPES = ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))
# DeepGEMM's MoE rows: (groups, rows per group, N, K).
CONTIGUOUS_SHAPES = ((4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168),
                  (8, 4096, 7168, 2048))
MASKED_SHAPES = ((1, 1024, 4096, 7168), (1, 1024, 7168, 2048), (2, 512, 4096, 7168),
                 (2, 512, 7168, 2048), (4, 256, 4096, 7168), (4, 256, 7168, 2048))


def _gemm(dtype: str = "e4m3", layout: str = "dense"):
    """The GEMM's configure: dense (m), contiguous (groups, m: all rows) or masked (groups,
    expected_m: rows a group)."""
    def configure(arch, n, k, m=0, groups=0, expected_m=0):
        if layout == "masked":
            m = groups * expected_m
        return gemm_config(arch, GemmProblem(n, k, dtype, layout, groups), m)
    return configure


def generate_gemm(cfg):
    """The PTX builder of a GEMM config, from the generation its target runs."""
    return gemm_generation(_arch.get(cfg.target)).generate(cfg)


_DENSE_OPTIONS = {"m": 4096, "n": 7168, "k": 2048}
_CONTIGUOUS_OPTIONS = {"groups": 4, "m": 4 * 8192, "n": 4096, "k": 7168}
_MASKED_OPTIONS = {"groups": 1, "expected_m": 1024, "n": 4096, "k": 7168}
_DENSE_VARIANTS = tuple({"m": m, "n": n, "k": k} for m in (64, 4096) for n, k in GEMM_SHAPES)
_CONTIGUOUS_VARIANTS = tuple({"groups": g, "m": g * rows, "n": n, "k": k}
                             for g, rows, n, k in CONTIGUOUS_SHAPES)
_MASKED_VARIANTS = tuple({"groups": g, "expected_m": rows, "n": n, "k": k}
                         for g, rows, n, k in MASKED_SHAPES)
# Routed experts: Mixtral (8), DeepSeek-V2-Lite (64), Qwen3-MoE (128), DeepSeek-V3 (256),
# Kimi-K2 (384), Qwen3-Next (512).
MOE_EXPERTS = (8, 64, 128, 256, 384, 512)
_ROUTING_OPTIONS = {"experts": 256, "layout": "contiguous"}
_ROUTING_VARIANTS = tuple({"experts": e, "layout": layout} for e in MOE_EXPERTS
                          for layout in i64_moe_routing_layout.LAYOUTS)


def generate_attention(cfg):
    """The decode attention kernel of ``cfg``: its tensor-core form or its CUDA-core one."""
    module = bf16_decode_attention_mma if cfg.tensor_cores else bf16_decode_attention
    return module.generate(cfg)


def _attention(arch, head_dim: int, group: int, cache: str, math: str, q_len: int = 1,
               cluster: int = 1, kv_new: str = "none"):
    """Decode attention's configure: ``cache`` contiguous or paged (a block table) bf16,
    or e4m3 or paged-e4m3 (with scales); ``math`` cuda (cores) or mma (tensor cores);
    ``q_len`` query tokens a sequence (causal; mma, up to 8); ``cluster``:
    the splits merged in a cluster of that many CTAs (mma); ``kv_new`` none or appended:
    new keys and values written into a bf16 cache and attended to (mma)."""
    if kv_new not in ("none", "appended"):
        raise ValueError(f"option kv_new must be none or appended, got {kv_new!r}")
    if cache not in _ATTENTION_CACHES:
        raise ValueError(f"option cache must be one of {', '.join(_ATTENTION_CACHES)}, got "
                         f"{cache!r}")
    if math not in ("cuda", "mma"):
        raise ValueError(f"option math must be cuda or mma, got {math!r}")
    return bf16_decode_attention.choose_config(
        arch, head_dim, group, paged=cache.startswith("paged"), tensor_cores=math == "mma",
        cache_dtype="e4m3" if cache.endswith("e4m3") else "bf16", q_len=q_len, cluster=cluster,
        append=kv_new == "appended")


_ATTENTION_CACHES = ("contiguous", "paged", "e4m3", "paged-e4m3")


def _attention_variants() -> tuple:
    """Every head size, group and cache on CUDA cores (bf16, one query token) and on the
    tensor cores (D up to 128): one and two query tokens, a full tile's (16 rows) and the
    most query tokens (up to four tiles); the contiguous cache's also with four splits
    merged in a cluster; the bf16 caches' also appending two new tokens."""
    variants = []

    def add(d, g, c, math, q_len=1, cluster=1, kv_new="none"):
        variants.append({"head_dim": d, "group": g, "cache": c, "math": math, "q_len": q_len,
                         "cluster": cluster, "kv_new": kv_new})

    for d in bf16_decode_attention.HEAD_DIMS:
        for g in (1, 2, 4, 8):
            for c in _ATTENTION_CACHES:
                if not c.endswith("e4m3"):
                    add(d, g, c, "cuda")
                if d > bf16_decode_attention.MMA_HEAD_DIM:
                    continue
                most = bf16_decode_attention.MAX_Q_LEN
                for q in sorted({1, 2, min(most, bf16_decode_attention.MMA_ROWS // g), most}):
                    if q <= 2 or c == "contiguous":
                        add(d, g, c, "mma", q)
                if c == "contiguous":
                    add(d, g, c, "mma", cluster=4)
                if not c.endswith("e4m3"):
                    add(d, g, c, "mma", 2, kv_new="appended")
    return tuple(variants)


def _combine(arch, hidden: int, topk: int, weight_bits: int):
    """The MoE combine's configure: ``weight_bits`` 32 (f32 weights) or 16 (bf16)."""
    dtypes = {32: "f32", 16: "bf16"}
    if weight_bits not in dtypes:
        raise ValueError(f"option weight_bits must be 32 (f32 weights) or 16 (bf16), "
                         f"got {weight_bits}")
    return bf16_moe_combine.choose_config(arch, hidden, topk, dtypes[weight_bits])


_COMBINE_OPTIONS = {"hidden": 7168, "topk": 8, "weight_bits": 32}
# DeepSeek-V3's and Qwen3's 8 experts a token, Mixtral's 2; both weight dtypes.
_COMBINE_VARIANTS = tuple({"hidden": h, "topk": topk, "weight_bits": bits}
                          for h in HIDDEN_SIZES for topk in (8, 2) for bits in (32, 16))


def _ep_dispatch(arch, ranks: int, hidden: int, topk: int, num_sms: int, slots: int,
                 dtype: str):
    """The EP dispatch's configure: ``dtype`` of the rows, bf16 or e4m3."""
    if dtype not in ("bf16", "e4m3"):
        raise ValueError(f"option dtype must be bf16 or e4m3, got {dtype!r}")
    return ep_dispatch.choose_config(arch, ranks, hidden, topk, fp8=dtype == "e4m3",
                                     num_sms=num_sms, slots=slots)


# DeepSeek-V3 over 8 GPUs (256 experts, k = 8, H = 7168) and the 2-GPU tests' shapes;
# DeepEP's default of 20 SMs.
_EP_OPTIONS = {"ranks": 8, "hidden": 7168, "num_sms": 20, "slots": 128}
_EP_LAYOUT_VARIANTS = ({"experts": 256, "ranks": 8, "topk": 8},
                       {"experts": 256, "ranks": 2, "topk": 8}, {"experts": 8, "ranks": 2, "topk": 2})
_EP_DISPATCH_VARIANTS = tuple({"ranks": r, "hidden": h, "topk": 8, "dtype": d}
                              for r in (2, 8) for h in (4096, 7168) for d in ("bf16", "e4m3"))
_EP_COMBINE_VARIANTS = tuple({"ranks": r, "hidden": h, "weights": w} for r in (2, 8)
                             for h in (4096, 7168) for w in ("none", "f32"))


def _ep_combine(arch, ranks: int, hidden: int, num_sms: int, slots: int, topk: int,
                weights: str):
    """The EP combine's configure: ``weights`` f32 (k = topk weights a row travel with it)
    or none."""
    if weights not in ("none", "f32"):
        raise ValueError(f"option weights must be none or f32, got {weights!r}")
    return ep_combine.choose_config(arch, ranks, hidden, topk=topk if weights == "f32" else 0,
                                    num_sms=num_sms, slots=slots)


def _ep_low_latency(kernel):
    """The low-latency kernels' configure: ``phase`` send, receive or both."""
    def configure(arch, ranks: int, max_tokens: int, hidden: int, experts: int, topk: int,
                  phase: str):
        return kernel.choose_config(arch, ranks, max_tokens, hidden, experts, topk, phase=phase)
    return configure


# The decode target (128 tokens a rank, DeepSeek-V3's H = 7168, top-8 of 256 experts) on 2
# and 8 ranks, each half apart and both together.
_EP_LL_OPTIONS = {"ranks": 2, "max_tokens": 128, "hidden": 7168, "experts": 256, "topk": 8,
                  "phase": "both"}
_EP_LL_VARIANTS = tuple({**_EP_LL_OPTIONS, "ranks": r, "phase": phase} for r in (2, 8)
                        for phase in ("send", "receive", "both"))

REGISTRY = {
    spec.name: spec for spec in (
        *map(_row_spec, bf16_row_rmsnorm_fp8quant.VARIANTS.values()),
        KernelSpec("quantize_fp8_per_block", bf16_block_quant_fp8.choose_config,
                   bf16_block_quant_fp8.generate, {}, ({},), "bf16 -> e4m3 + 128x128 scales"),
        KernelSpec("fp8_gemm_nt", _gemm(), generate_gemm, _DENSE_OPTIONS,
                   _DENSE_VARIANTS, "FP8 GEMM, 1x128 x 128x128 scaling"),
        KernelSpec("bf16_gemm_nt", _gemm("bf16"), generate_gemm, _DENSE_OPTIONS,
                   _DENSE_VARIANTS, "BF16 GEMM"),
        KernelSpec("m_grouped_fp8_gemm_nt_contiguous", _gemm(layout="contiguous"),
                   generate_gemm, _CONTIGUOUS_OPTIONS, _CONTIGUOUS_VARIANTS,
                   "MoE FP8 GEMM, contiguous layout (m: all groups' rows)"),
        KernelSpec("m_grouped_fp8_gemm_nt_masked", _gemm(layout="masked"), generate_gemm,
                   _MASKED_OPTIONS, _MASKED_VARIANTS,
                   "MoE FP8 GEMM, masked layout (expected_m: rows a group)"),
        KernelSpec("m_grouped_bf16_gemm_nt_contiguous", _gemm("bf16", "contiguous"),
                   generate_gemm, _CONTIGUOUS_OPTIONS, _CONTIGUOUS_VARIANTS,
                   "MoE BF16 GEMM, contiguous layout (m: all groups' rows)"),
        KernelSpec("m_grouped_bf16_gemm_nt_masked", _gemm("bf16", "masked"),
                   generate_gemm, _MASKED_OPTIONS, _MASKED_VARIANTS,
                   "MoE BF16 GEMM, masked layout (expected_m: rows a group)"),
        KernelSpec("moe_combine", _combine, bf16_moe_combine.generate, _COMBINE_OPTIONS,
                   _COMBINE_VARIANTS, "MoE combine: each token's weighted sum of its experts' "
                   "bf16 rows (topk: k)"),
        KernelSpec("attention_with_kvcache", _attention, generate_attention,
                   {"head_dim": 128, "group": 4, "cache": "contiguous", "math": "mma",
                    "q_len": 1, "cluster": 1, "kv_new": "none"},
                   _attention_variants(),
                   "decode attention over a KV cache (group: query heads a KV head; cache: "
                   "contiguous or paged, bf16 or e4m3; math: cuda cores or mma "
                   "(tensor cores); q_len: query tokens a sequence, causal; cluster: the "
                   "splits merged in a cluster; kv_new: none or appended)"),
        KernelSpec("moe_routing_layout", i64_moe_routing_layout.choose_config,
                   i64_moe_routing_layout.generate, _ROUTING_OPTIONS, _ROUTING_VARIANTS,
                   "MoE routing: each (token, expert) pair's row in the grouped GEMMs' input "
                   "(layout: contiguous or masked)"),
        KernelSpec("moe_permute_scales", f32_moe_scale_gather.choose_config,
                   f32_moe_scale_gather.generate, {"hidden": 7168, "topk": 8},
                   tuple({"hidden": h, "topk": k} for h in HIDDEN_SIZES for k in (8, 2)),
                   "MoE: the grouped rows' 1x128 scales, MN-major, after the permutation"),
        KernelSpec("ep_dispatch_layout", ep_layout.choose_config, ep_layout.generate,
                   {"experts": 256, "ranks": 8, "topk": 8}, _EP_LAYOUT_VARIANTS,
                   "EP: tokens per rank and expert, token-in-rank mask (ptxforge.ep)"),
        KernelSpec("ep_count_exchange", ep_exchange.choose_config, ep_exchange.generate,
                   {"ranks": 8}, ({"ranks": 2}, {"ranks": 8}),
                   "EP: every rank's dispatch counts to every rank over NVLink (ptxforge.ep)"),
        KernelSpec("ep_direct_dispatch", ep_direct.choose_config, ep_direct.generate,
                   {"ranks": 8, "hidden": 7168, "topk": 8, "num_sms": 20},
                   tuple({"ranks": r, "hidden": 7168, "topk": 8, "num_sms": 20} for r in (2, 8)),
                   "EP: e4m3 tokens written straight to their rows at their experts' ranks "
                   "(ptxforge.ep, a dispatch sized for the worst case)"),
        KernelSpec("ep_pull_combine", ep_pull.choose_config, ep_pull.generate,
                   {"ranks": 8, "hidden": 7168, "num_sms": 20},
                   tuple({"ranks": r, "hidden": 7168, "num_sms": 20} for r in (2, 8)),
                   "EP: each token's expert outputs loaded from its ranks' buffers and summed "
                   "(ptxforge.ep, the combine after a direct dispatch)"),
        KernelSpec("ep_intranode_dispatch", _ep_dispatch, ep_dispatch.generate,
                   {**_EP_OPTIONS, "topk": 8, "dtype": "bf16"}, _EP_DISPATCH_VARIANTS,
                   "EP: tokens to their experts' ranks over NVLink rings (ptxforge.ep)"),
        KernelSpec("ep_intranode_combine", _ep_combine, ep_combine.generate,
                   {**_EP_OPTIONS, "topk": 8, "weights": "none"}, _EP_COMBINE_VARIANTS,
                   "EP: expert outputs back to their tokens' ranks, summed (ptxforge.ep)"),
        KernelSpec("ep_low_latency_dispatch", _ep_low_latency(ep_ll_dispatch),
                   ep_ll_dispatch.generate, _EP_LL_OPTIONS, _EP_LL_VARIANTS,
                   "EP decode: tokens quantized to FP8 into their experts' ranks, the masked "
                   "layout (ptxforge.ep.low_latency)"),
        KernelSpec("ep_low_latency_combine", _ep_low_latency(ep_ll_combine),
                   ep_ll_combine.generate, _EP_LL_OPTIONS, _EP_LL_VARIANTS,
                   "EP decode: expert outputs back to their tokens' ranks, weighted sums "
                   "(ptxforge.ep.low_latency)"),
    )
}


def get(name: str) -> KernelSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown kernel {name!r}; kernels: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def all_variants(arch):
    """Zero-argument builders for every registered variant that the target supports."""
    makers = []
    for spec in REGISTRY.values():
        for options in spec.variants:
            try:
                config = spec.config(arch, **options)
            except ValueError:
                continue  # e.g. FP8 kernels on a target without FP8
            makers.append(lambda spec=spec, config=config: spec.generate(config))
    return makers
