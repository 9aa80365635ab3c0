"""Where a generated token's time goes: transformers' generate (greedy, static cache) on
Llama-3-8B's sizes with ``model.forward = ptxforge.compile(model.forward)`` (each decode
step one CUDA graph). Three figures a token: its time (``bench generate``'s measure); the
GPU's time for a decode call (CUDA events around it: the runner's copies in, the replay,
its output's clone), inside a generate; and the kernels of one decode call run without the
graph under the profiler (the graph's kernels, summed by name, largest first). What the
decode call's GPU time leaves of a token is the host's: transformers' loop between steps,
and a generate's first decode calls (its cache is new: the call runs, then is captured);
last, the host's Python functions by their own time, a generate under cProfile.

    python bench/generate_profile.py [layers, default 32] [batch x prompt, default 1x512]
"""

import collections
import cProfile
import functools
import pstats
import statistics
import sys
import time

import torch

from ptxforge import compiler
from ptxforge.bench.generate import _generate_ms, llama_8b_for_generation, per_token_ms

PROFILED = 16      # decode steps timed; the one profiled is the last


def main(layers: int, batch: int, prompt: int) -> None:
    model = llama_8b_for_generation(layers)
    compiled = compiler.compile(model.forward)
    model.forward = compiled
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    token_ms = per_token_ms(model, ids, "ptxforge steps")
    calls, prof = [], None

    @functools.wraps(compiled)
    def timed(*args, **kwargs):
        nonlocal prof
        if kwargs["input_ids"].shape[-1] > 1:       # the prompt
            return compiled(*args, **kwargs)
        if len(calls) == PROFILED:                  # the graph's kernels, without the graph
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = compiled.steps.fn(*args, **kwargs)
                torch.cuda.synchronize()
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        out = compiled(*args, **kwargs)
        end.record()
        calls.append((start, end, time.perf_counter() - began))
        return out

    model.forward = timed
    _generate_ms(model, ids, "ptxforge steps", 2 + PROFILED)
    step_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e, _ in calls[2:])
    host = [wall * 1e3 for _, _, wall in calls]
    times, counts = collections.defaultdict(float), collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            times[event.name] += event.time_range.end - event.time_range.start
            counts[event.name] += 1
    for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {us:8.1f} us  x{counts[name]:<4} {name[:100]}")
    print(f"== {layers} layers, {batch} x {prompt}: a token {token_ms * 1e3:.1f} us; a decode "
          f"call's GPU time {step_us:.1f} us; its {sum(counts.values())} kernels "
          f"{sum(times.values()):.1f} us summed; host {token_ms * 1e3 - step_us:.1f} us")
    print(f"  a decode call's host time: the first three (a new cache: run, warm-up and "
          f"capture, replay) {', '.join(f'{ms:.1f}' for ms in host[:3])} ms, later ones "
          f"{statistics.median(host[3:]) * 1e3:.1f} us; runner refused: "
          f"{compiled.steps.refused}")
    model.forward = compiled
    _host_profile(model, ids)


def _host_profile(model, ids) -> None:
    """The host's Python between decode steps: one generate under cProfile (which slows
    Python about twice; the shares hold), the functions with the most time of their own,
    us a decode step."""
    _generate_ms(model, ids, "ptxforge steps", 2 + PROFILED)        # the cache's capture
    profiler = cProfile.Profile()
    profiler.enable()
    _generate_ms(model, ids, "ptxforge steps", 2 + PROFILED)
    profiler.disable()
    rows = pstats.Stats(profiler).stats.items()
    top = sorted(rows, key=lambda row: -row[1][2])[:20]
    print(f"host, {1 + PROFILED} decode steps under cProfile: us a step of its own time")
    for (path, line, name), (_, calls, own, _, _) in top:
        where = f"{path.rsplit('/', 1)[-1]}:{line}" if path != "~" else "builtin"
        print(f"  {own / (1 + PROFILED) * 1e6:8.1f} us  {calls // (1 + PROFILED):>5} calls"
              f"  {name[:50]} ({where})")


if __name__ == "__main__":
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    batch, prompt = map(int, (sys.argv[2] if len(sys.argv) > 2 else "1x512").split("x"))
    main(layers, batch, prompt)
