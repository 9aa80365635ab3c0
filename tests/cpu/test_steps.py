"""The decode runner (``compiler/steps.py``) on the CPU: which calls it captures, what a
graph is keyed on (argument tensors' shapes by copy, other objects by identity), when it
stops capturing and why, and the outputs it returns. The capture itself is replaced by a
stand-in that runs the call again on the graph's own argument copies, which is what a
replay computes; the CUDA side runs in tests/gpu/test_compiler_gpu.py."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from ptxforge import compiler  # noqa: E402
from ptxforge.compiler import steps  # noqa: E402


class _Replayed:
    """A captured call's stand-in: replay runs ``fn`` on the copies and writes its
    tensors into the captured outputs' own, as a graph's replay would."""

    def __init__(self, fn, copies, held, outputs, own, spec):
        self.fn, self.copies, self.held, self.outputs = fn, copies, held, outputs
        self.own, self.spec = own, spec
        self.replays, self.pool = 0, None

    def replay(self, leaves):
        for i, copy in self.copies.items():
            copy.copy_(leaves[i])
        positional, names = self.spec
        result = self.fn(*self.own[:positional], **dict(zip(names, self.own[positional:])))
        self.outputs["logits"].copy_(result["logits"])
        self.replays += 1
        return compiler.graphs.map_tensors(self.outputs, torch.Tensor.clone)


@pytest.fixture
def captures(monkeypatch):
    """Every capture made, through the stand-in; CUDA reported present."""
    made = []

    def capture(fn, leaves, spec, pool):
        copies = {i: x.clone() for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        own = [copies.get(i, x) for i, x in enumerate(leaves)]
        positional, names = spec
        outputs = fn(*own[:positional], **dict(zip(names, own[positional:])))
        step = _Replayed(fn, copies, [x for x in leaves if not isinstance(x, torch.Tensor)],
                         outputs, own, spec)
        made.append(step)
        return step, compiler.graphs.map_tensors(outputs, torch.Tensor.clone)

    monkeypatch.setattr(steps._Step, "capture", staticmethod(capture))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return made


class _Cache:
    """A static cache's stand-in: the call adds into it in place."""

    def __init__(self):
        self.total = torch.zeros(4)


def _forward(input_ids, cache_position, past_key_values, use_cache=True):
    past_key_values.total += input_ids.float().sum()
    return {"logits": input_ids.float() * 2 + cache_position.float(),
            "past_key_values": past_key_values}


def _step(runner, cache, value, position=0, batch=1):
    return runner(input_ids=torch.full((batch, 1), value), cache_position=torch.tensor([position]),
                  past_key_values=cache)


def test_a_decode_step_is_captured_the_second_time_and_replayed_on_new_values(captures):
    runner, cache = steps.StepGraphs(_forward), _Cache()
    for position in range(4):
        out = _step(runner, cache, position + 1, position)
        assert torch.equal(out["logits"], torch.tensor([[2.0 * (position + 1) + position]]))
        assert out["past_key_values"] is cache     # the object as the call returned it
    # the first call ran as it is, the second was captured, the others replayed
    assert len(captures) == 1 and captures[0].replays == 2
    assert cache.total.tolist() == [10.0] * 4      # every call ran once
    first, again = _step(runner, cache, 5), _step(runner, cache, 6)
    assert first["logits"].item() == 10.0          # the next replay did not overwrite it
    assert again["logits"].item() == 12.0


def test_a_prompt_that_comes_once_is_not_captured(captures):
    runner, cache = steps.StepGraphs(_forward), _Cache()
    runner(input_ids=torch.ones(1, 16, dtype=torch.long), cache_position=torch.arange(16),
           past_key_values=cache)
    assert captures == [] and len(runner.seen) == 1


def test_another_object_or_shape_gets_a_graph_of_its_own(captures):
    runner, one, two = steps.StepGraphs(_forward), _Cache(), _Cache()
    for _ in range(3):
        _step(runner, one, 1)
        _step(runner, two, 1)                      # the next generate's cache
        _step(runner, one, 1, batch=2)             # a batch of two
    assert len(captures) == 3 and [c.replays for c in captures] == [1, 1, 1]
    assert captures[1].held[0] is two              # kept alive: its id is the key


def test_graphs_of_old_caches_make_room_for_new_ones(captures):
    """A generate a cache: past max_graphs, the least recently replayed graph goes."""
    runner = steps.StepGraphs(_forward, max_graphs=2)
    caches = [_Cache() for _ in range(4)]
    for cache in caches:
        for position in range(3):
            _step(runner, cache, 1, position)
    assert len(captures) == 4 and runner.refused is None
    assert [step.held[0] for step in runner.graphs.values()] == caches[2:]


def test_many_tokens_run_as_they_are(captures):
    runner = steps.StepGraphs(_forward, max_tokens=8)
    prompt = torch.arange(64).view(1, 64)
    out = runner(input_ids=prompt, cache_position=torch.arange(64), past_key_values=_Cache())
    assert captures == [] and runner.refused is None
    assert torch.equal(out["logits"], prompt.float() * 2 + torch.arange(64))


def test_shapes_that_change_every_call_stop_the_captures_with_a_reason(captures, caplog):
    """A dynamic cache's calls: an argument one longer every step (here the positions)."""
    runner, cache = steps.StepGraphs(_forward), _Cache()
    with caplog.at_level(logging.WARNING, logger="ptxforge"):
        for length in range(1, 13):
            out = runner(input_ids=torch.tensor([[1]]), cache_position=torch.zeros(length, 1),
                         past_key_values=cache)
            assert out["logits"].tolist() == [[2.0]] * length
    assert captures == []
    assert runner.refused and "each with new shapes" in runner.refused
    assert sum("without CUDA graphs" in r.message for r in caplog.records) == 1
    assert cache.total.tolist() == [12.0] * 4      # every call ran once


def test_a_call_that_cannot_be_captured_runs_as_it_is(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def capture(fn, leaves, spec, pool):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    monkeypatch.setattr(steps._Step, "capture", staticmethod(capture))
    runner, cache = steps.StepGraphs(_forward), _Cache()
    with caplog.at_level(logging.WARNING, logger="ptxforge"):
        for _ in range(2):
            out = _step(runner, cache, 3, 1)
            assert out["logits"].item() == 7.0
    assert "could not be captured: RuntimeError: Cannot copy between CPU and CUDA" in \
        runner.refused
    assert "without CUDA graphs" in caplog.text


def test_without_a_gpu_every_call_runs_as_it_is():
    runner = steps.StepGraphs(_forward)
    out = runner(input_ids=torch.tensor([[2]]), cache_position=torch.tensor([0]),
                 past_key_values=_Cache())
    assert out["logits"].item() == 4.0 and runner.graphs == {} and runner.refused is None


def test_compile_with_step_graphs_wraps_the_compiled_call():
    model = torch.nn.Linear(4, 4)
    compiled = compiler.compile(model, step_graphs=True)
    assert isinstance(compiled, steps.StepModule)
    assert set(dict(compiled.named_parameters())) == {"compiled._orig_mod.weight",
                                                      "compiled._orig_mod.bias"}
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))


def test_step_graphs_and_reduce_overhead_are_one_or_the_other():
    with pytest.raises(ValueError, match="pass one or the other"):
        compiler.compile(torch.nn.Linear(4, 4), step_graphs=True, mode="reduce-overhead")
