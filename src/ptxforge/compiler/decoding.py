"""``ptxforge.generate``: greedy decoding of a transformers causal LM over a static KV cache,
with no host synchronisation between its steps.

transformers' ``generate`` synchronises with the GPU at every step (its stopping check
reads a flag on the host), so each step's host work (the next inputs, the mask, the logits
processors, the model call) runs while the GPU waits (docs/performance.md, text
generation). Here the loop only queues work: the model's call on the last tokens (one
CUDA graph replay when the forward is ``ptxforge.compile``'s), an argmax, the ended
sequences' tokens replaced by the pad token; the host reads the GPU only every
``check_every`` steps, to stop once every sequence has ended. The host runs ahead of the
GPU, so a token costs the GPU's time for it.

    prompt [B, T] --model (prefill: the static cache's first T positions)--> logits
                  --argmax--> token 1
    token i [B, 1] --model (the cache's position T + i - 1)--> logits --argmax--> token i + 1
                   (every check_every tokens: has every sequence ended? then stop)

The tokens and the length are those of transformers' greedy ``generate`` with a static
cache on the same model and end and pad tokens (no padding in the prompt: every sequence
is the prompt's length), up to the attention's rounding: the model gets no padding mask
here, so on a compiled forward the decode steps' attention is ptxforge's kernel
(``attention_with_kvcache``), where transformers' generate, which passes one, keeps SDPA.

The static cache stays with the model for the next call, as transformers' ``generate``
keeps its own: reset in place (zeroed, its position back to 0) where it holds the batch
and enough positions, else made anew. A decode step's CUDA graph lives as long as the
cache it was captured on, so only a model's first generate (or one that needs a larger
cache) pays for the capture, 33-40 ms at 32 layers; the cache's memory stays taken
between calls, as transformers' does.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from .steps import StepModule


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             check_every: int = 16) -> torch.Tensor:
    """``input_ids`` [B, T] (int64, on the model's device) followed by up to
    ``max_new_tokens`` greedy tokens: [B, T + n]. ``model``: a transformers causal LM whose
    forward takes a static cache, as it is or compiled (``ptxforge.compile(model)``, or
    ``model.forward = ptxforge.compile(model.forward)``: ptxforge's kernels and a CUDA
    graph a step). ``eos_token_id`` (an int or a list, as transformers' generation config
    takes it): a sequence that produced one has ``pad_token_id`` (default: the first end
    token) for every later token, and the tokens end at the step where the last sequence
    ended; the host learns it every ``check_every`` tokens, and what the GPU ran past it
    is cut."""
    import transformers

    ends = _check(model, input_ids, max_new_tokens, eos_token_id, pad_token_id, check_every)
    batch, prompt = input_ids.shape
    device = input_ids.device
    cache = _static_cache(model, batch, prompt + max_new_tokens)
    takes = inspect.signature(_transformers_forward(model)).parameters
    # (transformers 5.2x names the cache argument ``cache``, earlier releases
    # ``past_key_values`` and take the positions, ``cache_position``: kept on the GPU here,
    # as a model that computed them from the cache would read its length on the host)
    fixed = {"cache" if "cache" in takes else "past_key_values": cache, "use_cache": True}
    if "logits_to_keep" in takes:
        fixed["logits_to_keep"] = 1     # the prompt's last logits only
    positions = (torch.arange(prompt, device=device) if "cache_position" in takes else None)
    ended = torch.zeros(batch, 1, dtype=torch.bool, device=device)
    pad = None if ends is None else (pad_token_id if pad_token_id is not None else ends[0])
    ends = None if ends is None else torch.tensor(ends, device=device)
    tokens, last = [], input_ids
    with torch.no_grad():
        for step in range(max_new_tokens):
            at = {} if positions is None else {"cache_position": positions}
            last = model(input_ids=last, **fixed, **at).logits[:, -1:].argmax(-1)
            if positions is not None:
                positions = positions[-1:] + 1
            if ends is not None:
                last = torch.where(ended, pad, last)
                ended |= torch.isin(last, ends)
            tokens.append(last)
            if ends is not None and (step + 1) % check_every == 0 and bool(ended.all()):
                break
        new = torch.cat(tokens, dim=1)
        if ends is not None and bool(ended.all()):
            # the step where the last sequence ended (a sequence's first end token)
            first = torch.isin(new, ends).int().argmax(dim=1)
            new = new[:, :int(first.max()) + 1]
    return torch.cat([input_ids, new], dim=1)


# Each model's static cache from its last generate, with the batch and positions it was
# made for (transformers' own generate keeps one on the model the same way); it goes with
# the model.
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _static_cache(model, batch: int, length: int):
    """The model's static cache from its last call, reset, if it was made for ``batch``
    sequences and holds ``length`` positions; else a new one (which replaces it)."""
    import transformers

    cache, made_for, holds = _caches.get(model, (None, 0, 0))
    if cache is not None and made_for == batch and holds >= length:
        cache.reset()
        return cache
    _caches.pop(model, None)   # the old cache's memory goes before the new one is taken
    del cache
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    _caches[model] = (cache, batch, length)
    return cache


def _transformers_forward(model):
    """The forward of the transformers model under ptxforge's and torch.compile's module
    wrappers, whose own forward takes ``*args, **kwargs`` (a forward compiled in place keeps
    the model's signature)."""
    from torch._dynamo.eval_frame import OptimizedModule

    while True:
        if isinstance(model, StepModule):
            model = model.compiled
        elif isinstance(model, OptimizedModule):
            model = model._orig_mod
        else:
            return model.forward


def _check(model, input_ids, max_new_tokens, eos_token_id, pad_token_id,
           check_every) -> list[int] | None:
    """The arguments checked; the end tokens as a list (None: none)."""
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
        if not _is_int(value) or value < 1:
            raise ValueError(f"generate: {name} must be a positive int, got {value!r}")
    vocab = model.config.vocab_size
    ends = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if ends is not None and (not isinstance(ends, (list, tuple)) or not ends or not all(
            _is_int(e) and 0 <= e < vocab for e in ends)):
        raise ValueError(f"generate: eos_token_id must be a token id in [0, {vocab}) or a "
                         f"non-empty list of them, got {eos_token_id!r}")
    if pad_token_id is not None and not (_is_int(pad_token_id) and 0 <= pad_token_id < vocab):
        raise ValueError(f"generate: pad_token_id must be a token id in [0, {vocab}), got "
                         f"{pad_token_id!r}")
    return None if ends is None else list(ends)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _described(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)}"
    return type(x).__name__
