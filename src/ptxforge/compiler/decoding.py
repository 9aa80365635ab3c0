"""``ptxforge.generate``: greedy decoding of a transformers causal LM over a static KV cache,
with no host synchronisation between its steps.

transformers' ``generate`` synchronises with the GPU at every step (its stopping check
reads a flag on the host), so each step's host work (preparing the next inputs, the mask,
the logits processors, the model call) runs while the GPU waits: about a millisecond a
token with Llama-3-8B at batch 1 (H200, ``bench/generate_profile.py``), a quarter of the
token. Here the loop only queues work: the model's call on the last tokens (one CUDA graph
replay when the forward is ``ptxforge.compile``'s), an argmax, the finished sequences'
tokens replaced by the end token; the host reads the GPU only every ``check_every`` steps,
to stop once every sequence has ended. The host runs ahead of the GPU, so a token costs
the GPU's time for it.

    prompt [B, T] --model (prefill: the static cache's first T positions)--> logits
                  --argmax--> token 1
    token i [B, 1] --model (the cache's position T + i - 1)--> logits --argmax--> token i + 1
                   (every check_every tokens: has every sequence ended? then stop)

The tokens are those of transformers' greedy ``generate`` with a static cache on the same
model (no padding: every sequence is the prompt's length).
"""

from __future__ import annotations

import inspect

import torch


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *,
             eos_token_id: int | None = None, check_every: int = 16) -> torch.Tensor:
    """``input_ids`` [B, T] (int64, on the model's device) followed by up to
    ``max_new_tokens`` greedy tokens: [B, T + n]. ``model``: a transformers causal LM whose
    forward takes a static cache (``model.forward = ptxforge.compile(model.forward)`` for
    ptxforge's kernels and a CUDA graph a step). With ``eos_token_id``, a sequence that
    produced it has it for every later token, and generation stops at the first multiple
    of ``check_every`` tokens at which every sequence has (n may then be less than
    max_new_tokens)."""
    import transformers

    _check(model, input_ids, max_new_tokens, check_every)
    batch, prompt = input_ids.shape
    cache = transformers.StaticCache(config=model.config,
                                     max_cache_len=prompt + max_new_tokens)
    forward = inspect.signature(model.forward).parameters
    # (transformers 5.2x names the cache argument ``cache``, earlier releases
    # ``past_key_values``; ``logits_to_keep=1``: the prompt's last logits only)
    fixed = {"cache" if "cache" in forward else "past_key_values": cache, "use_cache": True}
    if "logits_to_keep" in forward:
        fixed["logits_to_keep"] = 1
    tokens, ended = [], torch.zeros(batch, 1, dtype=torch.bool, device=input_ids.device)
    last = input_ids
    with torch.no_grad():
        for step in range(max_new_tokens):
            logits = model(input_ids=last, **fixed).logits[:, -1:]
            last = logits.argmax(-1)
            if eos_token_id is not None:
                last = torch.where(ended, eos_token_id, last)
                ended |= last == eos_token_id
                if (step + 1) % check_every == 0 and bool(ended.all()):
                    tokens.append(last)
                    break
            tokens.append(last)
    return torch.cat([input_ids, *tokens], dim=1)


def _check(model, input_ids, max_new_tokens, check_every) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"generate: input_ids must be a tensor [batch, tokens], got "
                         f"{_described(input_ids)}")
    if input_ids.dtype != torch.int64 or input_ids.shape[1] < 1:
        raise ValueError(f"generate: input_ids must be int64 with at least one token a "
                         f"sequence, got {_described(input_ids)}")
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise ValueError(f"generate: input_ids must be on the model's device {device}, got "
                         f"{input_ids.device}")
    for name, value in (("max_new_tokens", max_new_tokens), ("check_every", check_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"generate: {name} must be a positive int, got {value!r}")


def _described(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)}"
    return type(x).__name__
