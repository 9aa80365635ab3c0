"""Where the host time of a compiled model's call goes, per model and token
count (default: the FFN block and Llama-3-8B's 2 layers at 64 tokens):
  - wall us per call (CUDA events around 50 back-to-back calls) of Dynamo alone (a
    backend that returns a stored output: guards and frame, nothing launched; with every
    dimension dynamic as ptxforge.compile asks, with static shapes, and with only the
    token dimension dynamic (torch._dynamo.mark_dynamic)), the eager
    model, Inductor's reduce-overhead, and the ptxforge backend default and reduce-overhead,
    each with its host time alone (enqueueing 50 calls, no wait for the GPU);
  - the ptxforge reduce-overhead call piece by piece, host time of each alone: the weight
    check around the graph runner, the runner, its key, the input copy, the replay and the
    output clone; what is left of the whole call is Dynamo's;
  - each GPU kernel of one ptxforge call, and a cProfile of its host side.

    python bench/compile_host_probe.py [ffn:64 llama-8b:64 ...]
"""

import cProfile
import pstats
import sys
import time

import torch

from ptxforge import compiler
from ptxforge.compiler import graphs
from ptxforge import models
from ptxforge.bench.model import wall_us


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


def pieces(case, args, kwargs) -> dict:
    """Host us of each piece of a ptxforge reduce-overhead call, alone."""
    captured = []

    def keeping(gm, example_inputs, **options):
        compiled = compiler.backend(gm, example_inputs, **options)
        captured.append((compiled, list(example_inputs)))
        return compiled

    torch._dynamo.reset()
    fn = torch.compile(case.model, backend=keeping, mode="reduce-overhead")
    compiler.mark_token_dims(args, kwargs)        # as compiler.compile does
    fn(*args, **kwargs)
    (folded, inputs), = captured
    # A call passes the token count where the example held its symbol.
    inputs = [x.node.hint if isinstance(x, torch.SymInt) else x for x in inputs]
    runner = folded.fn
    assert isinstance(runner, graphs.GraphRunner)
    folded(*inputs)
    entry = runner.graphs[runner._key(inputs)]
    (i, static), *_ = entry.inputs
    output = entry.outputs[0]
    return {"whole call": host_us(lambda: fn(*args, **kwargs)),
            "weight check + runner": host_us(lambda: folded(*inputs)),
            "runner": host_us(lambda: runner(*inputs)),
            "runner's key": host_us(lambda: runner._key(inputs)),
            "input copy": host_us(lambda: static.copy_(inputs[i])),
            "replay": host_us(entry.graph.replay),
            "output clone": host_us(output.clone)}


def probe(name: str, tokens: int) -> None:
    torch.manual_seed(0)
    case = models.build(name)
    model = case.model.cuda()
    args, kwargs = case.inputs(tokens, "cuda")
    call = lambda fn: (lambda: fn(*args, **kwargs))
    stored = model(*args, **kwargs)

    def dynamo_only(gm, example_inputs):
        return lambda *inputs: (stored,)

    rows = {}
    with torch.no_grad():
        torch._dynamo.reset()
        fn = torch.compile(model, backend=dynamo_only, dynamic=True)
        rows["dynamo guards + frame only"] = wall_us(call(fn))
        torch._dynamo.reset()
        fn = torch.compile(model, backend=dynamo_only, dynamic=False)
        rows["  the same, static shapes"] = wall_us(call(fn))
        torch._dynamo.reset()
        for x in args:     # the token dimension alone dynamic
            torch._dynamo.mark_dynamic(x, [d for d, size in enumerate(x.shape) if size == tokens])
        fn = torch.compile(model, backend=dynamo_only)
        rows["  the same, the token dimension alone dynamic"] = wall_us(call(fn))
        for x in args:
            del x._dynamo_dynamic_indices
        rows["eager (host only)"] = host_us(call(model))
        for label, make in {
            "inductor reduce-overhead": lambda: torch.compile(model, mode="reduce-overhead"),
            "ptxforge": lambda: compiler.compile(model),
            "ptxforge reduce-overhead": lambda: compiler.compile(model, mode="reduce-overhead"),
            "ptxforge reduce-overhead, every dimension dynamic": lambda: compiler.compile(
                model, mode="reduce-overhead", dynamic=True),
        }.items():
            torch._dynamo.reset()
            fn = make()
            rows[label] = wall_us(call(fn))
            rows[label + " (host only)"] = host_us(call(fn))
            if label in ("ptxforge", "ptxforge reduce-overhead"):
                kernels(call(fn), label)
                profile = cProfile.Profile()
                torch.cuda.synchronize()
                profile.enable()
                for _ in range(200):
                    fn(*args, **kwargs)
                profile.disable()
                torch.cuda.synchronize()
                print(f"== {label}: host functions by own time, 200 calls")
                pstats.Stats(profile).sort_stats("tottime").print_stats(10)
        split = pieces(case, args, kwargs)
    print(f"== {case.name}, {tokens} tokens: wall / host us per call")
    for label, us in rows.items():
        print(f"{label:<48} {us:7.1f} us")
    print("ptxforge reduce-overhead, host us of each piece alone:")
    for label, us in split.items():
        print(f"  {label:<46} {us:7.1f} us")


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["ffn:64", "llama-8b:64"]:
        name, tokens = spec.split(":")
        probe(name, int(tokens))
