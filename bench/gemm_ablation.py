"""Where a GEMM tile's time goes: the kernel with one part of its K loop taken out at a
time, timed like the benchmark (median of 30, L2 flushed). The results of the cut variants
are wrong by construction; only "full" is checked.

    python bench/gemm_ablation.py M N K BLOCK_M BLOCK_N MULTICAST [...more configs]

    full        the kernel as shipped
    no_promote  wgmma, wait, no promotion (the tensor cores' and the feed's time)
    no_mma      the stage ring and the promotion, no wgmma (the feed's and CUDA cores' time)
    feed_only   neither: what the producer and the barriers alone take
"""

import contextlib
import sys

import torch

from ptxforge import ops
from ptxforge.bench.ops import Timer
from ptxforge.testing.checks import calc_diff, fp8_gemm_operands
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.ops import common
from ptxforge.ops import gemm as gemm_ops
from ptxforge.ptx import KernelBuilder


@contextlib.contextmanager
def patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def no_promote():
    return patched(gemm, "_promote", lambda *args: None)


def no_mma():
    return patched(KernelBuilder, "wgmma_mma_async", lambda *args, **kwargs: None)


@contextlib.contextmanager
def feed_only():
    with no_promote(), no_mma():
        yield


VARIANTS = {"full": contextlib.nullcontext, "no_promote": no_promote, "no_mma": no_mma,
            "feed_only": feed_only}

arch = common.device_arch(0)
timer = Timer()
m, n, k = (int(x) for x in sys.argv[1:4])
configs = [tuple(int(x) for x in sys.argv[i:i + 3]) for i in range(4, len(sys.argv), 3)]
(qa, sa), (qb, sb), ref = fp8_gemm_operands(m, n, k)
flops = 2 * m * n * k
for block_m, block_n, multicast in configs:
    cfg = gemm.make_config(arch, n, k, block_m, block_n, multicast=multicast)
    line = []
    for variant, context in VARIANTS.items():
        gemm_ops._launcher.cache_clear()   # each variant generates the kernel anew,
        gemm_ops._plan.cache_clear()       # and plans hold their launcher
        with context():
            d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            ops.fp8_gemm_nt((qa, sa), (qb, sb), d, config=cfg)
            check = f" diff {calc_diff(d, ref):.1e}" if variant == "full" else ""
            ms = timer(lambda: ops.fp8_gemm_nt((qa, sa), (qb, sb), d, config=cfg))
        line.append(f"{variant} {ms * 1e3:7.1f} us {flops / ms / 1e9:5.0f} TF{check}")
    print(f"{m}x{n}x{k} {block_m}x{block_n} mc{multicast} s{cfg.stages}: " + " | ".join(line),
          flush=True)
