"""GEMM tile shapes on the benchmark problems: every problem under the heuristic's choice
and a set of alternatives, each checked against fp64 and timed (median of 30, L2
flushed), beside its torch peer. The data the tile-choice model is fitted to.

    python bench/gemm_sweep.py [fp8|bf16|masked|contiguous ...] [--producers 1,2,4] [--json out.json]

fp8: DeepGEMM's 18 dense shapes (peer: cuBLAS blockwise); bf16: the same shapes with bf16
operands (peer: torch a @ b.t()); masked, contiguous: DeepGEMM's MoE rows (peer for
contiguous: torch._scaled_grouped_mm, row-wise). Each tile is timed twice, the second
pass in reverse order, and keeps the better time: the GPU heats up under back-to-back
GEMMs (up to 6% slower), which would otherwise favour whatever runs first.
"""

import argparse
import json

import torch

from ptxforge import ops
from ptxforge.bench.ops import (GEMM_SHAPES, GROUPED_MASKED, Timer, _bf16_pair, _torch_blockwise,
                            _torch_grouped, contiguous_problems, grouped_operands,
                            masked_operands)
from ptxforge.testing.checks import calc_diff, fp8_gemm_operands
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.gemm import GemmProblem
from ptxforge.ops import common

arch = common.device_arch(0)
sms = arch.sm_count
timer = Timer()


def problem(n, k, dtype, groups, masked):
    layout = ("masked" if masked else "contiguous") if groups else "dense"
    return GemmProblem(n, k, dtype, layout, groups)


def alternatives(m, n, k, dtype, groups=0, masked=False, producers=(1,)):
    """Tile shapes to time besides the choice: both multicast settings everywhere (small M
    has many tiles along N to pair up too), and two CTAs an SM for the small tiles."""
    widths = (16, 32, 64, 128) + ((256,) if dtype == "bf16" else ())
    if m <= 128:
        shapes = ({(64, bn, ctas) for bn in widths for ctas in (1, 2)}
                  | {(128, bn, 1) for bn in (64, 128)})
    else:
        wide = (64, 128, 176, 192, 240, 256) if dtype == "bf16" else (64, 96, 112, 128, 144, 160, 192)
        shapes = {(128, bn, 1) for bn in wide} | {(64, 128, 1), (64, 128, 2)}
    for block_m, block_n, ctas in sorted(shapes):
        for multicast in (1, 2):
            for warps in producers:
                try:
                    yield gemm.make_config(arch, problem(n, k, dtype, groups, masked), block_m,
                                           block_n, ctas, multicast, producers=warps)
                except ValueError:
                    pass


def problems(suite):
    """(label, model M, config choice arguments, run(config) -> None, d, reference view,
    peer, flops)."""
    if suite in ("fp8", "bf16"):
        for m, n, k in GEMM_SHAPES:
            d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            if suite == "fp8":
                (qa, sa), (qb, sb), ref = fp8_gemm_operands(m, n, k)
                call = lambda config, qa=qa, sa=sa, qb=qb, sb=sb, d=d: ops.fp8_gemm_nt(
                    (qa, sa), (qb, sb), d, config=config)
                peer = _torch_blockwise(qa, sa, qb, sb)
            else:
                a, b = _bf16_pair(m, n, k)
                ref = a.double() @ b.double().t()
                call = lambda config, a=a, b=b, d=d: ops.bf16_gemm_nt(a, b, d, config=config)
                peer = lambda a=a, b=b: a @ b.t()
            yield (f"{m}x{n}x{k}", m, (m, n, k, 0, False, "e4m3" if suite == "fp8" else "bf16"),
                   call, lambda d=d: d, ref, peer, 2 * m * n * k)
    elif suite == "contiguous":
        for groups, expected, n, k, sizes in contiguous_problems():   # bench grouped-gemm's
            a, b, m_indices, ref = grouped_operands(sizes, n, k)
            m = a[0].shape[0]
            d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            call = lambda config, a=a, b=b, d=d, m_indices=m_indices: \
                ops.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, config=config)
            yield (f"{groups}x{expected} {n}x{k}", m, (m, n, k, groups, False, "e4m3"), call,
                   lambda d=d: d, ref, _torch_grouped(a[0], b[0], sizes), 2 * sum(sizes) * n * k)
    else:
        for groups, count, m_max, n, k in GROUPED_MASKED:
            a, b, masked_m, ref = masked_operands([count] * groups, m_max, n, k)
            d = torch.full((groups, m_max, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            call = lambda config, a=a, b=b, d=d, masked_m=masked_m, count=count: \
                ops.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, count, config=config)
            yield (f"{groups}x{count}/{m_max} {n}x{k}", groups * count,
                   (groups * count, n, k, groups, True, "e4m3"), call,
                   lambda d=d, count=count: d[:, :count], ref[:, :count], None,
                   2 * groups * count * n * k)


def sweep(suite, producers):
    rows = []
    for label, model_m, (m, n, k, groups, masked, dtype), call, valid, ref, peer, flops in problems(suite):
        peer_tflops = flops / timer(peer) / 1e9 if peer else None
        choice = gemm.choose_config(arch, problem(n, k, dtype, groups, masked), m, sms)
        configs = [choice] + [c for c in alternatives(m, n, k, dtype, groups, masked, producers)
                              if c != choice]
        results = {}
        for order in (configs, configs[::-1]):   # two passes, the second reversed
            for cfg in order:
                valid().fill_(float("nan"))
                call(cfg)
                diff = calc_diff(valid(), ref)
                ok = diff < 1e-3 and not torch.isnan(valid()).any()
                ms = min(timer(lambda: call(cfg)),
                         results[cfg]["ms"] if cfg in results else float("inf"))
                results[cfg] = {
                    "block_m": cfg.block_m, "block_n": cfg.block_n, "stages": cfg.stages,
                    "ctas_per_sm": cfg.ctas_per_sm, "producers": cfg.producers,
                    "multicast": cfg.multicast, "part_buffers": cfg.part_buffers, "ms": ms,
                    "tflops": flops / ms / 1e9, "calc_diff": diff,
                    "ok": bool(ok) and results.get(cfg, {}).get("ok", True),
                    "model_clocks": gemm.estimate_clocks(arch, cfg, model_m, sms)}
        results = [results[cfg] for cfg in configs]
        best = max((r for r in results if r["ok"]), key=lambda r: r["tflops"], default=results[0])
        rows.append({"problem": label, "model_m": model_m, "n": n, "k": k, "peer_tflops": peer_tflops,
                     "chosen": results[0], "best": best, "all": results})
        tag = lambda r: (f"{r['block_m']}x{r['block_n']}" + ("m" if r["multicast"] > 1 else "")
                         + ("p2" if r["part_buffers"] > 1 else "")
                         + ("c2" if r["ctas_per_sm"] > 1 else "")
                         + (f"w{r['producers']}" if r["producers"] > 1 else ""))
        bad = [tag(r) for r in results if not r["ok"]]
        print(f"{suite} {label:22s} peer {peer_tflops or 0:5.0f} | chosen {tag(results[0]):8s}"
              f"{results[0]['tflops']:5.0f} | best {tag(best):8s}{best['tflops']:5.0f} | "
              + " ".join(f"{tag(r)}:{r['tflops']:.0f}" for r in results[1:])
              + (f" | WRONG: {bad}" if bad else ""), flush=True)
    if rows[0]["peer_tflops"]:
        geo = lambda key: float(torch.tensor([r[key]["tflops"] / r["peer_tflops"] for r in rows])
                                .log().mean().exp())
        print(f"{suite}: geomean speedup vs the peer: chosen {geo('chosen'):.3f}x, "
              f"best per problem {geo('best'):.3f}x")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="*", default=["fp8"], choices=["fp8", "bf16", "masked", "contiguous"])
    parser.add_argument("--producers", default="2",
                        help="producer warp counts to time each tile with, e.g. 1,2,4")
    parser.add_argument("--json")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(),
              "suites": {suite: sweep(suite, tuple(int(w) for w in args.producers.split(",")))
                         for suite in args.suites}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
