"""Where the host time of a compiled model's call goes (issue 14): wall us per call of the
FFN block at 64 tokens (CUDA events around 50 back-to-back calls), for
  - Dynamo alone: a backend that returns a stored output (guards + frame, nothing launched),
  - Dynamo + AOTAutograd + Inductor with an empty graph's worth of work,
  - a raw CUDA graph of the eager model, replayed (x copied in, output cloned),
  - the ptxforge backend, default and reduce-overhead, and Inductor's reduce-overhead,
and a cProfile of the ptxforge calls' host side (top functions by own time).

    python bench/compile_host_probe.py
"""

import cProfile
import pstats
import time

import torch

from ptxforge import compiler
from ptxforge.testing.model_bench import wall_us
from ptxforge.testing.models import ffn


def host_us(fn, calls=50):
    """Host time per call: enqueueing ``calls`` calls, no wait for the GPU (the launch
    queue holds them)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def kernels(fn, label):
    """Each GPU kernel of one call (profiler), and their sum."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.time_range.end - e.time_range.start for e in events)
    print(f"== {label}: {len(events)} kernels, {total:.1f} us")
    for e in events:
        print(f"   {e.time_range.end - e.time_range.start:7.1f} us  {e.name[:100]}")


def main():
    case = ffn()
    model = case.model.cuda()
    (x,), _ = case.inputs(64, "cuda")
    stored = model(x).detach()

    def dynamo_only(gm, example_inputs):
        return lambda *args: (stored,)

    rows = {}
    with torch.no_grad():
        torch._dynamo.reset()
        fn = torch.compile(model, backend=dynamo_only, dynamic=True)
        rows["dynamo guards + frame only"] = wall_us(lambda: fn(x))
        rows["eager (host only)"] = host_us(lambda: model(x))

        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        model(static_x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static_out = model(static_x)

        def replay():
            static_x.copy_(x)
            graph.replay()
            return static_out.clone()
        rows["raw CUDA graph: copy in, replay, clone out"] = wall_us(replay)
        rows["raw CUDA graph: replay only"] = wall_us(graph.replay)

        for name, make in {
            "inductor reduce-overhead": lambda: torch.compile(model, mode="reduce-overhead"),
            "ptxforge": lambda: compiler.compile(model),
            "ptxforge reduce-overhead": lambda: compiler.compile(model, mode="reduce-overhead"),
        }.items():
            torch._dynamo.reset()
            fn = make()
            rows[name] = wall_us(lambda: fn(x))
            rows[name + " (host only)"] = host_us(lambda: fn(x))
            kernels(lambda: fn(x), name)
            profile = cProfile.Profile()
            torch.cuda.synchronize()
            profile.enable()
            for _ in range(200):
                fn(x)
            profile.disable()
            torch.cuda.synchronize()
            print(f"== {name}: host functions by own time, 200 calls")
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    for name, us in rows.items():
        print(f"{name:<48} {us:7.1f} us")


if __name__ == "__main__":
    main()
