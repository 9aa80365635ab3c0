"""``ptxforge bench generate``: text generation with transformers' ``generate`` and a static
KV cache, Llama-3-8B's full sizes (32 layers, vocab 128256, random weights N(0, 0.02)),
greedy, every new token forced (no end of sequence), as a user runs it:

    eager               transformers' generate with its own compile turned off
    torch.compile       transformers' generate as it comes: it compiles each decode step
                        (torch.compile of the model's call, its default CompileConfig:
                        Inductor, reduce-overhead)
    ptxforge forward    ``model.forward = ptxforge.compile(model.forward, step_graphs=False)``:
                        the compiled forward, Dynamo's frame and guards every step
    ptxforge steps      ``model.forward = ptxforge.compile(model.forward)`` (the default:
                        each decode step one CUDA graph)
    ptxforge backend    ``generation_config.compile_config`` with ``backend="ptxforge"``
    ptxforge generate   ``ptxforge.generate`` on the forward compiled as in "ptxforge steps":
                        ptxforge's greedy loop, no host synchronisation between steps

Per case (batch x prompt) and candidate: the time a new token takes, from two timed
generates after a warm one (the first compiles and captures): ``1 + NEW_TOKENS`` new tokens
less 1 new token (the prompt's prefill and the first token), over NEW_TOKENS, CUDA events,
host included, the median of ROUNDS; tokens/s over the batch. Beside it the step's
roofline: the bytes a decode step must read (``step_bytes``: every Linear's weights once,
FP8 with their 128 x 128 block scales as ptxforge runs them, the lm_head in bf16, the KV
cache of the batch at the mean context of the timed tokens) at the copy rate measured in
the same run (``bench.ops.copy_bandwidth_gbs``: bytes read plus written, as the anchors
count it).
"""

from __future__ import annotations

import statistics

import torch

from .. import compiler, models
from ..compiler import decoding
from . import format_table, pyplot

CASES = ((1, 512), (32, 4096))     # (batch, prompt tokens)
NEW_TOKENS = 128
ROUNDS = 3
CANDIDATES = ("eager", "torch.compile", "ptxforge forward", "ptxforge steps",
              "ptxforge backend", "ptxforge generate")
SCALE_BLOCK = 128                  # an FP8 weight's f32 scale covers 128 x 128 elements


def step_bytes(config, batch: int, context: int, *, fp8: bool = True) -> dict:
    """The bytes one decode step of a Llama-like ``config`` reads at least: each layer's
    q, k, v, o, gate, up and down weights (e4m3 and their block scales, or bf16), the
    lm_head (bf16), and ``batch`` sequences' K and V of ``context`` tokens (bf16)."""
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = (hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                 + heads * head_dim * hidden + 3 * hidden * inner)
    weights = layers * per_layer * ((1 + 4 / SCALE_BLOCK ** 2) if fp8 else 2)
    lm_head = 2 * config.vocab_size * hidden
    kv_cache = 2 * batch * layers * 2 * kv_heads * head_dim * context
    return dict(weights=weights, lm_head=lm_head, kv_cache=kv_cache,
                total=weights + lm_head + kv_cache)


def llama_8b_for_generation(layers: int = 32):
    """transformers' LlamaForCausalLM at Llama-3-8B's sizes, initialised on the GPU (N(0,
    0.02) weights, bf16), SDPA attention."""
    import transformers

    config = transformers.LlamaConfig(**models.LLAMA_8B, num_hidden_layers=layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def _generation_config(candidate: str, new_tokens: int):
    import transformers
    from transformers.generation.configuration_utils import CompileConfig

    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   cache_implementation="static", pad_token_id=0)
    if candidate == "eager":
        options["disable_compile"] = True
    elif candidate == "ptxforge backend":
        options["compile_config"] = CompileConfig(backend="ptxforge")
    return transformers.GenerationConfig(**options)


def _generate_ms(model, ids, candidate: str, new_tokens: int) -> float:
    """A generate's wall time (ms, CUDA events around it, host included)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    if candidate == "ptxforge generate":
        decoding.generate(model, ids, new_tokens)
    else:
        with torch.no_grad():
            model.generate(ids, generation_config=_generation_config(candidate, new_tokens))
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def per_token_ms(model, ids, candidate: str) -> float:
    """The time a new token takes: (a generate of 1 + NEW_TOKENS tokens less one of 1) /
    NEW_TOKENS, the median of ROUNDS, after a warm generate (compile, capture)."""
    _generate_ms(model, ids, candidate, 1 + NEW_TOKENS)
    times = [(_generate_ms(model, ids, candidate, 1 + NEW_TOKENS)
              - _generate_ms(model, ids, candidate, 1)) / NEW_TOKENS for _ in range(ROUNDS)]
    return statistics.median(times)


def _prepared(model, candidate: str):
    """The model as the candidate runs it: for "ptxforge steps" and "ptxforge generate",
    its forward compiled by ptxforge as it comes (decode steps as whole CUDA graphs); for
    "ptxforge forward", the same without step graphs."""
    if candidate in ("ptxforge forward", "ptxforge steps", "ptxforge generate"):
        model.forward = compiler.compile(model.forward,
                                         step_graphs=candidate != "ptxforge forward")
    return model


def _case_ms(candidate: str, batch: int, prompt: int, layers: int) -> float:
    """In a process of its own: the candidate's ms a new token at (batch, prompt), on the
    model and prompt every candidate gets (the same seeds)."""
    model = _prepared(llama_8b_for_generation(layers), candidate)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(batch * prompt))
    return per_token_ms(model, ids, candidate)


def generate_suite(cases=CASES, candidates=CANDIDATES, layers: int = 32) -> dict:
    """Each (case, candidate) in a spawned process of its own, as a user runs one: a
    candidate leaves state behind that the next would run into (transformers' static cache
    and its compiled call, Dynamo's caches, CUDA graphs), and a device-side assert leaves
    the process's CUDA context unusable. A run that raises is reported (``error``: its
    last line) and the others go on."""
    import multiprocessing

    import transformers

    from .ops import Timer, copy_bandwidth_gbs

    copy_gbs = copy_bandwidth_gbs(Timer())
    config = transformers.LlamaConfig(**models.LLAMA_8B, num_hidden_layers=layers)
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for batch, prompt in cases:
        needed = step_bytes(config, batch, prompt + 1 + NEW_TOKENS // 2)
        for candidate in candidates:
            row = dict(batch=batch, prompt=prompt, candidate=candidate, ms=None,
                       tokens_per_s=None, step_bytes=needed,
                       roofline_ms=needed["total"] / copy_gbs / 1e6)
            with spawn.Pool(1) as pool:
                try:
                    row["ms"] = pool.apply(_case_ms, (candidate, batch, prompt, layers))
                    row["tokens_per_s"] = batch * 1e3 / row["ms"]
                except Exception as error:  # the run's own failure, reported in its row
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            rows.append(row)
            print(f"{batch} x {prompt}, {candidate}: "
                  f"{row.get('error') or format(row['ms'], '.2f') + ' ms a token'}", flush=True)
    return {"suite": "generate", "gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs,
            "layers": layers, "new_tokens": NEW_TOKENS, "rows": rows}


def generate_table(result: dict) -> str:
    rows = [[f"{r['batch']} x {r['prompt']}", r["candidate"], f"{r['ms']:.2f}",
             f"{r['tokens_per_s']:.0f}", f"{r['ms'] / r['roofline_ms']:.2f}"]
            if r["ms"] is not None else
            [f"{r['batch']} x {r['prompt']}", r["candidate"], "failed", "-", "-"]
            for r in result["rows"]]
    lines = [f"{result['gpu']}: Llama-3-8B sizes, {result['layers']} layers, greedy generate "
             f"with a static cache, {result['new_tokens']} new tokens; ms a new token (CUDA "
             f"events, host included, the median), tokens/s over the batch, and over the "
             f"step's roofline (the bytes it reads at the copy rate, "
             f"{result['copy_gbs']:.0f} GB/s read + written)",
             format_table(["batch x prompt", "candidate", "ms / token", "tokens/s",
                           "x roofline"], rows)]
    seen = {}
    for r in result["rows"]:
        seen.setdefault((r["batch"], r["prompt"]), r)
    for r in result["rows"]:
        if r.get("error"):
            lines.append(f"  {r['batch']} x {r['prompt']}, {r['candidate']} failed: "
                         f"{r['error']}")
    for (batch, prompt), r in seen.items():
        b = r["step_bytes"]
        lines.append(f"  {batch} x {prompt}: a step reads {b['total'] / 1e9:.2f} GB (FP8 "
                     f"weights {b['weights'] / 1e9:.2f}, lm_head {b['lm_head'] / 1e9:.2f}, "
                     f"KV cache {b['kv_cache'] / 1e9:.2f}): {r['roofline_ms']:.2f} ms")
    return "\n".join(lines)


def generate_plot(result: dict, path: str) -> None:
    """ms a new token per candidate, a group per case, the roofline as a line over it."""
    plt = pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys((r["batch"], r["prompt"]) for r in result["rows"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.5 * len(cases), 4), squeeze=False)
    for ax, (batch, prompt) in zip(axes[0], cases):
        rows = [r for r in result["rows"] if (r["batch"], r["prompt"]) == (batch, prompt)]
        ax.bar(range(len(rows)), [r["ms"] or 0.0 for r in rows],  # a failed run: no bar
               color=["tab:orange" if r["candidate"].startswith("ptxforge") else "0.6"
                      for r in rows])
        ax.axhline(rows[0]["roofline_ms"], color="black", linestyle="--", label="roofline")
        ax.set_xticks(range(len(rows)), [r["candidate"] for r in rows], rotation=30,
                      ha="right", fontsize=8)
        ax.set_title(f"batch {batch}, prompt {prompt}")
        ax.set_ylabel("ms a new token")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['gpu']}: generate, Llama-3-8B sizes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
