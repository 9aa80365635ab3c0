"""Each GPU kernel of one call of a model compiled by the ptxforge backend (profiler,
summed by kernel name, largest first), beside its wall time: what to speed up next.

    python bench/model_profile.py ffn:4096 llama-8b:64 llama-8b:2048 [name=value ...]

``name=value``: an Inductor config the compile is given (``ptxforge.compile``'s ``options``),
e.g. ``realize_opcount_threshold=4``; values are read as Python literals.
"""

import ast
import collections
import sys

import torch

from ptxforge import compiler
from ptxforge import models
from ptxforge.bench.model import wall_us


def profile(name: str, tokens: int, options: dict) -> None:
    torch.manual_seed(0)
    case = models.build(name)
    case.model.cuda()
    args, kwargs = case.inputs(tokens, "cuda")
    torch._dynamo.reset()
    # torch.compile takes a mode or options, not both: reduce-overhead is CUDA graphs.
    fn = compiler.compile(case.model, options={"triton.cudagraphs": True, **options})
    with torch.no_grad():
        wall = wall_us(lambda: fn(*args, **kwargs))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn(*args, **kwargs)
            torch.cuda.synchronize()
    times = collections.defaultdict(float)
    counts = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            times[e.name] += (e.time_range.end - e.time_range.start) / 3
            counts[e.name] += 1
    total = sum(times.values())
    print(f"== {case.name}, {tokens} tokens{' ' + str(options) if options else ''}: "
          f"wall {wall:.1f} us, kernels {total:.1f} us")
    for kernel, us in sorted(times.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {us:8.1f} us  x{counts[kernel] // 3:<3} {kernel[:110]}")


if __name__ == "__main__":
    specs = [a for a in sys.argv[1:] if ":" in a]
    options = {}
    for setting in (a for a in sys.argv[1:] if "=" in a):
        key, _, value = setting.partition("=")
        options[key] = ast.literal_eval(value)
    for spec in specs:
        name, tokens = spec.split(":")
        profile(name, int(tokens), options)
