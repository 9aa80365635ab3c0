"""``ptxforge bench model``: models compiled by the ptxforge backend beside eager PyTorch and
Inductor, as a user runs them (``ptxforge.models``: the FFN block, Llama-3-8B's sizes, the
MoE blocks).

Per model and token count: the wall time of a call as a user sees it (CUDA events around
50 back-to-back calls after 5 warm-up calls, host included, median of 5 rounds), for eager,
``torch.compile`` (Inductor) by default and with ``mode="reduce-overhead"``, and the
ptxforge backend the same two ways; the first call's time (compile, assembly, capture);
calc_diff of each output against the model computed in f32 (eager bf16's too: the error
bf16 itself makes); and the number
of graphs Dynamo made across the token counts (one: no recompile when only they change).
ptxforge's own share of the compile (its passes and weight quantization, then assembling
the kernels of the measured token counts into an empty and into a warm cache) is timed
apart from Dynamo and Inductor.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from .. import compiler, jit, models
from ..testing.checks import calc_diff
from . import format_table, pyplot

CASES = {"ffn": (64, 4096), "llama-8b": (64, 2048), "deepseek-v3-moe": (64, 4096),
         "mixtral-moe": (16, 2048)}
CANDIDATES = ("eager", "inductor", "inductor reduce-overhead", "ptxforge",
              "ptxforge reduce-overhead")


def wall_us(fn, calls: int = 50, rounds: int = 5) -> float:
    """Median over ``rounds`` of the CUDA-event time of ``calls`` back-to-back calls, per call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _compiled(case, name: str):
    """The candidate's callable. The ptxforge backend compiles once for every token count
    (its token dimensions dynamic); Inductor, the peer, gets a fresh compile per token count with static
    shapes (its fastest code)."""
    if name == "eager":
        return case.model
    mode = "reduce-overhead" if name.endswith("reduce-overhead") else None
    if name.startswith("ptxforge"):
        return compiler.compile(case.model, mode=mode)
    return torch.compile(case.model, mode=mode, dynamic=False)


def ptxforge_share(case, tokens) -> dict:
    """Seconds of ptxforge's own compile work for the model, apart from Dynamo and
    Inductor: its passes (with the weights' quantization) and the parallel assembly of the
    kernels the first call needs, with an empty kernel cache and with a warm one (the
    process's memory cache emptied both times; the driver's and nvJitLink's own caches of
    the same PTX are not ours to empty: a truly cold figure is `ptxforge precompile
    --model` in a new process)."""
    seconds = {}

    def backend(gm, example_inputs):
        compiled = compiler.backend(gm, example_inputs)
        seconds.setdefault(state, []).append(gm.ptxforge_seconds)
        return compiled

    args, kwargs = case.inputs(tokens, "cuda")
    with tempfile.TemporaryDirectory() as empty:
        saved = os.environ.get("PTXFORGE_CACHE_DIR")
        os.environ["PTXFORGE_CACHE_DIR"] = empty
        try:
            for state in ("cold", "warm"):
                with jit._memory_lock:
                    jit._memory.clear()
                torch._dynamo.reset()
                with torch.no_grad():
                    compiler.mark_token_dims(args, kwargs)  # as compiler.compile does
                    torch.compile(case.model, backend=backend)(*args, **kwargs)
        finally:
            if saved is None:
                del os.environ["PTXFORGE_CACHE_DIR"]
            else:
                os.environ["PTXFORGE_CACHE_DIR"] = saved
    total = {state: {key: sum(s[key] for s in graphs) for key in ("passes", "assembly")}
             for state, graphs in seconds.items()}
    return {"passes_s": total["cold"]["passes"], "assemble_cold_s": total["cold"]["assembly"],
            "assemble_warm_s": total["warm"]["assembly"], "tokens": tokens}


def model_suite(names=tuple(CASES), layers: int = 2) -> dict:
    from torch._dynamo.utils import counters

    rows = []
    for name in names:
        torch.manual_seed(0)
        case = models.build(name, layers)
        case.model.cuda()
        reference = models.in_f32(case.model)
        inputs = {t: case.inputs(t, "cuda") for t in CASES[name]}
        for candidate in CANDIDATES:
            torch._dynamo.reset()
            counters.clear()
            fn = _compiled(case, candidate)
            for tokens, (args, kwargs) in inputs.items():
                if candidate.startswith("inductor"):
                    torch._dynamo.reset()
                    counters.clear()
                    fn = _compiled(case, candidate)
                with torch.no_grad():
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = case.output(fn(*args, **kwargs))
                    torch.cuda.synchronize()
                    first = time.perf_counter() - start
                    expected = case.output(reference(*_f32(args), **kwargs))
                    diff = calc_diff(out, expected)   # before later calls overwrite a graph's
                    rows.append({
                        "model": case.name, "tokens": tokens, "candidate": candidate,
                        "note": case.describe(args) if case.describe else None,
                        "wall_us": wall_us(lambda f=fn, a=args, k=kwargs: f(*a, **k)),
                        "first_call_s": first, "calc_diff": diff,
                        "graphs": counters["stats"]["unique_graphs"]})
            del fn
        share = ptxforge_share(case, CASES[name][0])
        for row in rows:
            if row["model"] == case.name:
                row["ptxforge_share"] = share
        del case, reference
        torch.cuda.empty_cache()
    return {"suite": "model", "gpu": torch.cuda.get_device_name(), "rows": rows}


def _f32(args):
    return tuple(a.float() if a.is_floating_point() else a for a in args)


def model_table(result: dict) -> str:
    table, seen = [], {}
    for row in result["rows"]:
        key = (row["model"], row["tokens"])
        seen.setdefault(key, {})[row["candidate"]] = row
    for (model, tokens), by in seen.items():
        cells = [f"{by[c]['wall_us']:.1f}" if c in by else "-" for c in CANDIDATES]
        best_peer = min(by[c]["wall_us"] for c in CANDIDATES[:3] if c in by)
        ours = min(by[c]["wall_us"] for c in CANDIDATES[3:] if c in by)
        diffs = "/".join(f"{by[c]['calc_diff']:.1e}" for c in CANDIDATES[3:] if c in by)
        table.append([model, tokens, *cells, f"{best_peer / ours:.2f}x", diffs,
                      f"{by['eager']['calc_diff']:.1e}"])
    lines = [f"{result['gpu']}: wall us per call (CUDA events, host included, median)",
             format_table(["model", "tokens", *CANDIDATES, "best peer / ptxforge",
                           "ptxforge calc_diff", "eager bf16 calc_diff"], table)]
    notes = {(row["model"], row["tokens"]): row.get("note") for row in result["rows"]}
    lines += [f"  {model}, {tokens} tokens: {note}" for (model, tokens), note in notes.items()
              if note]
    firsts = [[row["model"], row["tokens"], row["candidate"], f"{row['first_call_s']:.2f}",
               row["graphs"]] for row in result["rows"] if row["candidate"] != "eager"]
    lines += ["", "first call (s: compile, assembly, capture) and graphs Dynamo made:",
              format_table(["model", "tokens", "candidate", "first call s", "graphs"], firsts)]
    shares = {row["model"]: row["ptxforge_share"] for row in result["rows"]}
    lines += ["", "ptxforge's own compile share (s), apart from Dynamo and Inductor: passes + "
              "weight quantization; the first call's kernels assembled in parallel, empty "
              "cache / warm cache"]
    lines += [f"  {model} ({s['tokens']} tokens): passes {s['passes_s']:.2f}, assembly "
              f"{s['assemble_cold_s']:.2f} / {s['assemble_warm_s']:.2f}"
              for model, s in shares.items()]
    return "\n".join(lines)


def model_plot(result: dict, path: str) -> None:
    """Wall time per call, a group of bars (one per candidate) per model and token count."""
    plt = pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys((r["model"], r["tokens"]) for r in result["rows"]))
    candidates = list(dict.fromkeys(r["candidate"] for r in result["rows"]))
    times = {(r["model"], r["tokens"], r["candidate"]): r["wall_us"] for r in result["rows"]}
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 4.5), squeeze=False)
    for ax, (model, tokens) in zip(axes[0], cases):
        values = [times.get((model, tokens, c), 0) for c in candidates]
        ax.bar(range(len(candidates)), values,
               color=["0.6" if not c.startswith("ptxforge") else "tab:orange" for c in candidates])
        ax.set_xticks(range(len(candidates)), candidates, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{model}\n{tokens} tokens", fontsize=8)
    axes[0][0].set_ylabel("us per call (wall, host included)")
    fig.suptitle(f"{result['gpu']}: models, ptxforge backend beside eager and Inductor")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
