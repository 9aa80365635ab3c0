"""``ptxforge.generate`` on the CPU: the tokens of transformers' greedy generate with a
static cache, on the model as it is and compiled by ptxforge; the end token; bad input."""

import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ptxforge  # noqa: E402


def _llama(vocab_size=96):
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=vocab_size, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _theirs(model, ids, new_tokens, **options):
    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
        disable_compile=True, **{"pad_token_id": 0, **options})
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids),
                              generation_config=config)


@pytest.mark.parametrize("compiled", [None, "forward", "module"])
def test_the_tokens_of_transformers_greedy_generate(compiled):
    """The model as it is, its forward compiled in place, the model compiled (whose
    wrapper's forward takes ``*args, **kwargs``: the cache's argument name and
    logits_to_keep come from the transformers model under it)."""
    model = _llama()
    ids = torch.randint(0, 96, (3, 7))
    expected = _theirs(model, ids, 9)
    torch._dynamo.reset()
    if compiled == "forward":
        model.forward = ptxforge.compile(model.forward)
    elif compiled == "module":
        model = ptxforge.compile(model)
    assert torch.equal(ptxforge.generate(model, ids, 9), expected)
    assert torch.equal(ptxforge.generate(model, ids[:, :1], 4), _theirs(_llama(), ids[:, :1], 4))


@pytest.mark.parametrize("check_every", [1, 5, 16])
def test_end_tokens_give_transformers_tokens_and_length(check_every):
    """A sequence that produced an end token has the pad token after it, and the tokens
    stop where the last sequence ended, whenever the host learns it."""
    model = _llama()
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    free = ptxforge.generate(model, ids, 14)[:, 5:]
    shared = sorted(set(free[0].tolist()) & set(free[1].tolist()))
    assert shared, "no token both sequences produce: pick another prompt"
    ends, pad = [shared[0], 95], 94
    got = ptxforge.generate(model, ids, 14, eos_token_id=ends, pad_token_id=pad,
                            check_every=check_every)
    expected = _theirs(model, ids, 14, eos_token_id=ends, pad_token_id=pad)
    assert torch.equal(got, expected)
    assert got.shape[1] < 5 + 14                  # both ended before the last token
    assert torch.equal(ptxforge.generate(model, ids, 14, eos_token_id=96 - 1),
                       _theirs(model, ids, 14, eos_token_id=95, pad_token_id=95))


@pytest.mark.parametrize("ids, tokens, options, match", [
    (torch.zeros(5, dtype=torch.long), 4, {}, "input_ids must be a tensor \\[batch, tokens\\]"),
    (torch.zeros(1, 5, dtype=torch.int32), 4, {}, "must be int64"),
    (torch.zeros(1, 0, dtype=torch.long), 4, {}, "at least one token"),
    (torch.zeros(1, 5, dtype=torch.long), 0, {}, "max_new_tokens must be a positive int, got 0"),
    (torch.zeros(1, 5, dtype=torch.long), True, {}, "max_new_tokens must be a positive int"),
    (torch.zeros(1, 5, dtype=torch.long), 4, {"check_every": 0}, "check_every must be"),
    (torch.zeros(1, 5, dtype=torch.long), 4, {"eos_token_id": 96},
     "eos_token_id must be a token id in \\[0, 96\\) or a non-empty list of them, got 96"),
    (torch.zeros(1, 5, dtype=torch.long), 4, {"eos_token_id": []}, "eos_token_id must be"),
    (torch.zeros(1, 5, dtype=torch.long), 4, {"eos_token_id": 3, "pad_token_id": -1},
     "pad_token_id must be a token id in \\[0, 96\\), got -1"),
])
def test_bad_input_is_one_line_naming_it(ids, tokens, options, match):
    with pytest.raises(ValueError, match=match):
        ptxforge.generate(_llama(), ids, tokens, **options)


def test_the_static_cache_stays_with_the_model_while_it_fits():
    """The next call on the same batch within the cache's positions resets and reuses the
    cache (a decode step's CUDA graph, captured on it, lives as long as it does), and the
    tokens stay transformers'; a larger batch or more positions get a new cache."""
    model = _llama()
    forward, seen = model.forward, []

    @functools.wraps(forward)    # the forward's signature: generate names the cache from it
    def recording(*args, **kwargs):
        seen.append(kwargs.get("cache", kwargs.get("past_key_values")))
        return forward(*args, **kwargs)

    model.forward = recording
    ids = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(5))
    used = []
    for rows, prompt, tokens in ((2, 6, 8), (2, 3, 5), (2, 6, 8), (2, 6, 9), (3, 6, 8)):
        del seen[:]
        got = ptxforge.generate(model, ids[:rows, :prompt], tokens)
        assert torch.equal(got, _theirs(_llama(), ids[:rows, :prompt], tokens))
        assert all(cache is seen[0] for cache in seen)
        used.append(seen[0])
    assert used[0] is used[1] is used[2]          # 14 positions, then 8 and 14 of them
    assert used[3] is not used[2]                 # 15 positions
    assert used[4] is not used[3]                 # 3 sequences
