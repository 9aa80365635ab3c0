"""FP8 GEMM tile shapes on DeepGEMM's 18 dense shapes: every shape under the heuristic's
choice and a set of alternatives, each checked against fp64 and timed (median of 30, L2
flushed), beside cuBLAS blockwise. The data the tile-choice model is fitted to.

    python bench/gemm_sweep.py [out.json]
"""

import json
import sys

import torch

from ptxforge import ops
from ptxforge.bench import GEMM_SHAPES, Timer, _torch_blockwise
from ptxforge.checks import calc_diff, fp8_gemm_operands
from ptxforge.kernels import sm90_fp8_gemm_1d2d as gemm
from ptxforge.ops import _common
from ptxforge.ops import gemm as gemm_ops

arch = _common.device_arch(0)
sms = arch.sm_count
timer = Timer()
chosen_config = gemm_ops._config


def alternatives(m, n, k):
    if m <= 128:
        shapes = {(64, bn, 1) for bn in (16, 32, 64, 128)} | {(128, bn, 1) for bn in (64, 128)}
    else:
        shapes = {(128, bn, mc) for bn in (64, 128, 144, 160, 192) for mc in (1, 2)}
    for block_m, block_n, multicast in sorted(shapes):
        try:
            yield gemm.make_config(arch, n, k, block_m, block_n, multicast=multicast)
        except ValueError:
            pass


rows = []
for m, n, k in GEMM_SHAPES:
    (qa, sa), (qb, sb), ref = fp8_gemm_operands(m, n, k)
    flops = 2 * m * n * k
    peer_ms = timer(_torch_blockwise(qa, sa, qb, sb))
    choice = chosen_config(0, m, n, k, sms, False)
    results = []
    for cfg in [choice] + [c for c in alternatives(m, n, k) if c != choice]:
        gemm_ops._config = lambda *args, cfg=cfg: cfg
        gemm_ops._plan.cache_clear()
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ops.fp8_gemm_nt((qa, sa), (qb, sb), d)
        diff = calc_diff(d, ref)
        ok = diff < 1e-3 and not torch.isnan(d).any()
        ms = timer(lambda: ops.fp8_gemm_nt((qa, sa), (qb, sb), d))
        tiles = -(-m // cfg.block_m) * cfg.n_tiles
        results.append({"block_m": cfg.block_m, "block_n": cfg.block_n, "stages": cfg.stages,
                        "multicast": cfg.multicast, "resident_clusters": gemm_ops._launcher(0, cfg)[1],
                        "tiles": tiles, "ms": ms, "tflops": flops / ms / 1e9, "ok": bool(ok),
                        "calc_diff": diff, "model_clocks": gemm.estimate_clocks(cfg, m, sms)})
    gemm_ops._config = chosen_config
    gemm_ops._plan.cache_clear()
    best = max((r for r in results if r["ok"]), key=lambda r: r["tflops"], default=results[0])
    rows.append({"m": m, "n": n, "k": k, "blockwise_tflops": flops / peer_ms / 1e9,
                 "chosen": results[0], "best": best, "all": results})
    tag = lambda r: f"{r['block_m']}x{r['block_n']}" + (
        f"m{r['resident_clusters']}" if r["multicast"] > 1 else "")
    bad = [tag(r) for r in results if not r["ok"]]
    print(f"{m:5d} {n:6d} {k:6d} cuBLAS {flops / peer_ms / 1e9:5.0f} | chosen {tag(results[0]):8s}"
          f"{results[0]['tflops']:5.0f} | best {tag(best):8s}{best['tflops']:5.0f} | "
          + " ".join(f"{tag(r)}:{r['tflops']:.0f}" for r in results[1:])
          + (f" | WRONG: {bad}" if bad else ""), flush=True)
    del qa, qb, ref

chosen = [r["blockwise_tflops"] / r["chosen"]["tflops"] for r in rows]
best = [r["blockwise_tflops"] / r["best"]["tflops"] for r in rows]
geo = lambda xs: float(torch.tensor(xs).log().mean().neg().exp())
print(f"geomean speedup vs cuBLAS blockwise: chosen {geo(chosen):.3f}x, best per shape {geo(best):.3f}x")
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
