"""``ptxforge.generate`` on the CPU: the tokens of transformers' greedy generate with a
static cache, on the model as it is and compiled by ptxforge; the end token; bad input."""

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
        max_new_tokens=new_tokens, do_sample=False,
        cache_implementation="static", pad_token_id=0, disable_compile=True, **options)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids),
                              generation_config=config)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_tokens_of_transformers_greedy_generate(compiled):
    model = _llama()
    ids = torch.randint(0, 96, (3, 7))
    expected = _theirs(model, ids, 9)
    if compiled:
        torch._dynamo.reset()
        model.forward = ptxforge.compile(model.forward)
    assert torch.equal(ptxforge.generate(model, ids, 9), expected)


def test_an_ended_sequence_keeps_the_end_token_and_all_ended_stops():
    model = _llama()
    ids = torch.randint(0, 96, (2, 5))
    free = ptxforge.generate(model, ids, 12)
    eos = int(free[0, 5 + 2])                  # sequence 0's third new token
    got = ptxforge.generate(model, ids, 12, eos_token_id=eos, check_every=4)
    first = [int((row[5:] == eos).nonzero()[0]) if (row[5:] == eos).any() else None
             for row in free]
    for row, mine, at in zip(free, got, first):
        if at is None:
            assert torch.equal(mine[:len(row)], row[:len(mine)])
        else:                                  # the same up to the end token, then only it
            assert torch.equal(mine[:5 + at + 1], row[:5 + at + 1])
            assert bool((mine[5 + at:] == eos).all())
    if all(at is not None for at in first):    # stopped at the check after the last ended
        assert got.shape[1] == 5 + -(-(max(first) + 1) // 4) * 4
    else:
        assert got.shape[1] == 5 + 12


@pytest.mark.parametrize("ids, tokens, match", [
    (torch.zeros(5, dtype=torch.long), 4, "input_ids must be a tensor \\[batch, tokens\\]"),
    (torch.zeros(1, 5, dtype=torch.int32), 4, "must be int64"),
    (torch.zeros(1, 0, dtype=torch.long), 4, "at least one token"),
    (torch.zeros(1, 5, dtype=torch.long), 0, "max_new_tokens must be a positive int, got 0"),
])
def test_bad_input_is_one_line_naming_it(ids, tokens, match):
    with pytest.raises(ValueError, match=match):
        ptxforge.generate(_llama(), ids, tokens)
