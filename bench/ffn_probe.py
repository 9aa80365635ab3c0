"""A first look at the ptxforge torch.compile backend on issue 14's FFN block
(x + down(silu(g) * u), g, u = gate_up(RMSNorm(x)), hidden 7168, intermediate 2048):
wall time per call as a user sees it (CUDA events around 50 back-to-back calls, host
included, median of 5 rounds) beside eager and Inductor, and calc_diff against the bf16
model computed in f32. Not yet the `ptxforge bench model` the issue asks for.

    python bench/ffn_probe.py [--profile]      # --profile: each kernel of one call at 64 tokens
"""

import statistics
import sys

import torch

from ptxforge import compiler
from ptxforge.testing.checks import calc_diff
from ptxforge.testing.models import Ffn, in_f32


def wall_us(fn, x, calls=50, rounds=5):
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def profile(candidates, tokens=64):
    """Each kernel of one call, and the host time, per candidate."""
    x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
    for name, fn in candidates.items():
        for _ in range(5):
            fn(x)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                fn(x)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.time_range.end - e.time_range.start for e in kernels) / 3
        print(f"== {name}: {len(kernels) // 3} kernels a call, {busy:.1f} us of kernel time")
        for e in kernels[:len(kernels) // 3]:
            print(f"   {e.time_range.end - e.time_range.start:7.1f} us  {e.name[:90]}")


def main():
    torch.manual_seed(0)
    model = Ffn().cuda().to(torch.bfloat16)
    reference = in_f32(model)
    candidates = {
        "eager": model,
        "inductor": torch.compile(model, dynamic=True),
        "inductor reduce-overhead": torch.compile(model, mode="reduce-overhead"),
        "ptxforge": compiler.compile(model, dynamic=True),
        "ptxforge reduce-overhead": compiler.compile(model, mode="reduce-overhead"),
    }
    with torch.no_grad():
        if "--profile" in sys.argv:
            profile(candidates)
            return
        print("| tokens | " + " | ".join(candidates) + " | ptxforge calc_diff |")
        for tokens in (64, 4096):
            x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
            cells = [f"{wall_us(fn, x):.1f}" for fn in candidates.values()]
            diff = calc_diff(candidates["ptxforge"](x), reference(x.float()))
            print(f"| {tokens} | " + " | ".join(cells) + f" | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
