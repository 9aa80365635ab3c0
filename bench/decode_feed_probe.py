"""Where a few-token GEMM's time goes: the model's tile with parts of its K loop taken
out, at several stage counts, as % of the same-size copy (profiler, L2 flushed, median).
The cut variants' results are wrong by construction.

    python bench/decode_feed_probe.py

    full        the kernel as shipped (its stage cap lifted to the count asked)
    no_scales   e4m3 without the per-K-block scale reads (sa from shared, sb from global)
                and the promotion: wgmma and the feed
    feed        no wgmma, no promotion: the producer, the barriers and the epilogue
"""

import contextlib

import torch

from ptxforge import jit
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.sm90_gemm import config as gemm_config, promotion
from ptxforge.ops import common, gemm as gemm_ops
from ptxforge.ops.layout import ceil_div, get_tma_aligned_size
from ptxforge.ptx import KernelBuilder
from ptxforge.bench.ops import Timer, copy_of, gemm_bytes
from ptxforge.testing.checks import fp8_gemm_operands


@contextlib.contextmanager
def patched(*changes):
    old = [(owner, name, getattr(owner, name)) for owner, name, _ in changes]
    for owner, name, value in changes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in old:
            setattr(owner, name, value)


nothing = lambda *args, **kwargs: None
VARIANTS = {
    "full": lambda: patched(),
    "no_scales": lambda: patched((promotion.Promotion, "scales", nothing),
                                 (promotion.Promotion, "fold", nothing)),
    "feed": lambda: patched((promotion.Promotion, "scales", nothing),
                            (promotion.Promotion, "fold", nothing),
                            (KernelBuilder, "wgmma_mma_async", nothing)),
}
arch = common.device_arch(0)
timer = Timer()


def launcher(cfg, variant):
    with VARIANTS[variant]():
        compiled = jit.build(gemm.generate(cfg))
    return compiled.load(0).launcher(compiled.launch)


def call(cfg, variant, m, n, k, a, sa, b, sb, d):
    launch = launcher(cfg, variant)
    # The grid and tile count the op would launch the unpatched kernel with.
    _, grid, m_tiles = gemm_ops._plan(0, m, n, k, arch.sm_count, False, 0, False, 0,
                                      cfg.dtype, False, False, cfg, None)
    size = 1 if cfg.scaled else 2
    args = {"tmap_a": (a.data_ptr(), (k, m), (size * k,)),
            "tmap_b": (b.data_ptr(), (k, n), (size * k,)),
            "tmap_d": (d.data_ptr(), (n, m), (2 * n,)), "m_tiles": m_tiles}
    if cfg.scaled:
        args["tmap_sa"] = (sa.data_ptr(), (m, ceil_div(k, 128)), (4 * get_tma_aligned_size(m, 4),))
        args["sb"], args["sb_row_stride"] = sb.data_ptr(), sb.stride(0)
    stream = common.current_stream(0)
    return lambda: launch((grid, 1, 1), stream, **args)


print("dtype    M       N x K     | tile          | " + " | ".join(
    f"{v} s{s}" for s in ("cap", 24, 48) for v in VARIANTS))
for dtype in ("e4m3", "bf16"):
    for n, k in ((2112, 7168), (4096, 7168), (7168, 2048), (7168, 16384)):
        for m in (1, 64):
            if dtype == "e4m3":
                (a, sa), (b, sb), _ = fp8_gemm_operands(m, n, k)
                sa = gemm_ops.get_mn_major_tma_aligned_tensor(sa)
            else:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                sa = sb = None
            d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            chosen = gemm.choose_config(arch, m, n, k, dtype=dtype)
            copy = copy_of(gemm_bytes([m], n, k, fp8=dtype == "e4m3"))
            copy_us = min(timer(copy), timer(copy))
            cells = []
            for cap in (gemm_config.MAX_STAGES[dtype], 24, 48):
                with patched((gemm_config, "MAX_STAGES", {dtype: cap})):
                    cfg = gemm.make_config(arch, n, k, chosen.block_m, chosen.block_n,
                                           chosen.ctas_per_sm, chosen.multicast, dtype=dtype,
                                           tile_rows=chosen.tile_rows)
                for variant in VARIANTS:
                    us = timer(call(cfg, variant, m, n, k, a, sa, b, sb, d))
                    cells.append(f"{100 * copy_us / us:4.0f} ({cfg.stages:2})")
            print(f"{dtype:5} {m:4} {n:6} x {k:5} | {chosen.rows}x{chosen.block_n} c{chosen.ctas_per_sm:<8}| "
                  + " | ".join(cells), flush=True)
